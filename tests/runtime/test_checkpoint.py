"""Flash checkpoint in one process: memory and disk round trips, integrity, retention."""

import glob
import logging
import os
import uuid
import warnings

import pytest
import torch

from mxgraph.runtime.checkpoint import disk
from mxgraph.runtime.checkpoint.flash import (
    FlashCheckpointer,
    Shard,
    apply_training_state,
    capture_training_state,
)
from mxgraph.runtime.checkpoint.shm import WRITING, newest_common_step, segment_prefix


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randn(4, 8)  # global RNG: restoring it matters
        model(x).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.fixture
def run_id():
    rid = f"test-{uuid.uuid4().hex[:10]}"
    yield rid
    left = glob.glob(f"/dev/shm/{segment_prefix(rid)}*")
    for path in left:
        os.unlink(path)
    assert not left, f"/dev/shm leftovers: {left}"


def _ckpt(tmp_path, run_id, **kw):
    kw.setdefault("saver", "thread")
    kw.setdefault("fsync", False)
    return FlashCheckpointer(str(tmp_path / "ckpt"), run_id=run_id, **kw)


def test_memory_restore_continues_bitwise(tmp_path, run_id):
    model, opt, sched = _tiny()
    _train(model, opt, sched, 3)
    first = _ckpt(tmp_path, run_id, persist_every=1000)
    res = first.save(3, capture_training_state(model, opt, sched, 3, {"dp": 1}))
    assert res.status == "copied" and res.nbytes > 0 and not res.persist
    _train(model, opt, sched, 3)
    expected = [p.detach().clone() for p in model.parameters()]

    second = _ckpt(tmp_path, run_id, persist_every=1000)  # a restarted process, same run
    model2, opt2, sched2 = _tiny()
    _train(model2, opt2, sched2, 1)  # different values everywhere, state tensors exist
    restored = second.restore(into=capture_training_state(model2, opt2, sched2))
    assert restored is not None and restored.source == "memory" and restored.step == 3
    assert restored.state["model"]["0.weight"].data_ptr() == model2[0].weight.data_ptr()
    assert apply_training_state(restored.state, model2, opt2, sched2) == 3
    assert restored.state["plan"] == {"dp": 1}
    _train(model2, opt2, sched2, 3)
    for a, b in zip(expected, model2.parameters(), strict=True):
        assert torch.equal(a, b)
    second.close()
    first.close()


def test_ranks_agree_on_the_newest_step_all_hold():
    assert newest_common_step([[7, 6], [7, 6]]) == 7
    assert newest_common_step([[7, 6], [6, 5]]) == 6  # rank 1 died before saving step 7
    assert newest_common_step([[7, 6], [5, -1]]) == -1  # nothing in common: use disk
    assert newest_common_step([[7, -1], [-1, -1]]) == -1


def test_half_written_snapshot_is_never_loaded(tmp_path, run_id):
    model, opt, sched = _tiny()
    ck = _ckpt(tmp_path, run_id, saver="none")
    ck.save(1, capture_training_state(model, opt, sched, 1))
    _train(model, opt, sched, 1)
    ck.save(2, capture_training_state(model, opt, sched, 2))
    newest = max(ck.slots, key=lambda s: s.get("seq"))
    newest.set(state=WRITING)  # as if the rank died mid-copy
    got = ck.restore()
    assert got.step == 1 and got.source == "memory"
    ck.close()


def test_reserve_sizes_every_slot_up_front(tmp_path, run_id):
    model, opt, sched = _tiny()
    _train(model, opt, sched, 1)
    ck = _ckpt(tmp_path, run_id, saver="none")
    state = capture_training_state(model, opt, sched, 0)
    ck.reserve(state)
    sizes = [s.size for s in ck.slots]
    nbytes = sum(t.numel() * t.element_size() for t in opt.state_dict()["state"][0].values())
    assert all(size > nbytes for size in sizes)
    assert ck.save(1, state).status == ck.save(2, state).status == "copied"
    assert [s.size for s in ck.slots] == sizes  # no growth: the reservation was enough
    ck.close()


def test_save_skips_when_every_slot_awaits_disk(tmp_path, run_id):
    model, opt, sched = _tiny()
    ck = _ckpt(tmp_path, run_id, saver="none")
    state = capture_training_state(model, opt, sched, 0)
    assert ck.save(1, state).status == "copied"
    assert ck.save(2, state).status == "copied"
    for s in ck.slots:  # pretend both still wait for the saver
        s.set(persist_req=1)
    res = ck.save(3, state)
    assert res.status == "skipped" and "persisted" in res.reason
    ck.close()


def test_disk_restore_skips_corrupt_and_uncommitted(tmp_path, run_id, caplog):
    model, opt, sched = _tiny()
    ck = _ckpt(tmp_path, run_id, keep=5)
    params = {}
    for step in (1, 2, 3):
        _train(model, opt, sched, 1)
        params[step] = [p.detach().clone() for p in model.parameters()]
        assert ck.save(step, capture_training_state(model, opt, sched, step),
                       persist=True).status == "copied"
        ck.wait_persisted()
    ck.close()
    root = str(tmp_path / "ckpt")
    assert [s for s, p in disk.list_steps(root) if disk.is_committed(p)] == [3, 2, 1]

    # step 3: flip bytes in a shard; step 2: lose the commit record
    shard = os.path.join(disk.step_dir(root, 3), "rank_0", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xde\xad\xbe\xef")
    os.unlink(os.path.join(disk.step_dir(root, 2), disk.METADATA))

    fresh = _ckpt(tmp_path, f"{run_id}-b", saver="none")
    with caplog.at_level(logging.WARNING, logger="mxgraph.checkpoint"):
        got = fresh.restore()
    assert got.source == "disk" and got.step == 1
    skipped = dict(fresh.restore_info.skipped)
    assert "checksum mismatch" in skipped[disk.step_dir(root, 3)]
    assert "no .metadata" in skipped[disk.step_dir(root, 2)]
    assert shard in caplog.text and disk.step_dir(root, 2) in caplog.text
    model2, opt2, sched2 = _tiny()
    apply_training_state(got.state, model2, opt2, sched2)
    for a, b in zip(params[1], model2.parameters(), strict=True):
        assert torch.equal(a, b)
    fresh.close()


def test_keep_prunes_old_checkpoints(tmp_path, run_id):
    model, opt, sched = _tiny()
    ck = _ckpt(tmp_path, run_id, keep=2)
    for step in range(1, 6):
        ck.save(step, capture_training_state(model, opt, sched, step), persist=True)
        ck.wait_persisted()
    ck.close()
    assert [s for s, _ in disk.list_steps(str(tmp_path / "ckpt"))] == [5, 4]


def test_checkpoint_is_plain_dcp(tmp_path, run_id):
    """Another tool can read the weights with torch.distributed.checkpoint alone."""
    import torch.distributed.checkpoint as dcp
    model, opt, sched = _tiny()
    ck = _ckpt(tmp_path, run_id)
    ck.save(7, capture_training_state(model, opt, sched, 7), persist=True)
    ck.close()
    target = {f"model/{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled..."
        dcp.load(target, checkpoint_id=disk.step_dir(str(tmp_path / "ckpt"), 7), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target[f"model/{k}"], v)


def test_step_resaved_after_restart_replaces_the_lost_attempt(tmp_path, run_id):
    """A step persisted by a lost attempt is replaced, never mixed, when saved again."""
    model, opt, sched = _tiny()
    lost = _ckpt(tmp_path, run_id)
    lost.save(5, capture_training_state(model, opt, sched, "lost"), persist=True)
    lost.close()
    again = _ckpt(tmp_path, f"{run_id}-b")
    assert again.incarnation != lost.incarnation
    again.save(5, capture_training_state(model, opt, sched, "new"), persist=True)
    again.close()
    fresh = _ckpt(tmp_path, f"{run_id}-c", saver="none")
    got = fresh.restore()
    fresh.close()
    assert got.step == 5 and got.state["rank_local"]["data_position"] == "new"


def test_shards_load_whole_at_another_world_size(tmp_path, run_id):
    """Two ranks (simulated in one process) save row shards of one tensor; at world size 1
    the tensor comes back whole, at the saving layout each rank gets its own rows."""
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    bias = torch.ones(6)
    ranks = [_ckpt(tmp_path, run_id, rank=r, world_size=2) for r in range(2)]
    ranks[1].incarnation = ranks[0].incarnation  # agreed over the process group in real runs
    for r, ck in enumerate(ranks):
        state = {"model": {"w": Shard(full[2 * r:2 * r + 2].clone(), (4, 6), (2 * r, 0)),
                           "b": bias},
                 "rank_local": {"data_position": r}}
        assert ck.save(3, state, persist=True).status == "copied"
        ck.wait_persisted()
    for ck in reversed(ranks):  # rank 0 commits once every part is on disk
        ck.close()

    one = _ckpt(tmp_path, f"{run_id}-one", saver="none")
    got = one.restore()
    one.close()
    assert one.restore_info.resharded and got.step == 3
    w = got.state["model"]["w"]
    assert torch.equal(w.local, full) and w.offsets == (0, 0)
    assert torch.equal(got.state["model"]["b"], bias)

    again = _ckpt(tmp_path, f"{run_id}-two", saver="none", rank=1, world_size=2)
    target = {"model": {"w": Shard(torch.zeros(2, 6), (4, 6), (2, 0)), "b": torch.zeros(6)}}
    got = again.restore(into=target)
    again.close()
    w = got.state["model"]["w"]
    assert not again.restore_info.resharded and w.offsets == (2, 0)
    assert torch.equal(w.local, full[2:])
    assert w.local.data_ptr() == target["model"]["w"].local.data_ptr()  # filled in place
    assert got.state["rank_local"]["data_position"] == 1


def test_first_mismatch_names_the_tensor_and_both_shapes():
    from mxgraph.runtime.checkpoint.match import first_mismatch, normalized, signature_of
    f32 = torch.float32
    saved = normalized({"model/a": ((4, 4), f32), "model/b": ((4,), f32), "__rank1__/rank_local/x":
                        ((2,), torch.uint8), "optimizer/state/0/exp_avg": ((4, 4), f32)})
    here = signature_of({"model/a": torch.zeros(4, 4), "model/b": torch.zeros(4),
                         "__rank0__/rank_local/x": torch.zeros(2, dtype=torch.uint8)})
    assert first_mismatch(saved, here) is None  # optimizer moments: unknown before a step
    assert first_mismatch(saved, {**here, "model/a": ((2, 4), f32)}) == \
        "model/a is [4, 4] float32 in the checkpoint but [2, 4] float32 here"
    assert first_mismatch(saved, {**here, "model/c": ((1,), f32)}) == \
        "model/c ([1] float32 here) is not in the checkpoint"
    del here["model/b"]
    assert first_mismatch(saved, here) == \
        "the checkpoint has model/b ([4] float32), which this run has not"
    assert first_mismatch({**saved, "model/a": None}, {**here, "model/b": ((4,), f32),
                                                       "model/a": ((2, 4), f32)}) is None
