"""Tokenized training data: token files, every --data kind, packing, resume, errors.

References: the tokenizer itself, called on one document at a time (transformers'
`tokenizer(text)["input_ids"]`), the ids joined with its end-of-text token; a run that
is not interrupted. Every comparison is exact (np.array_equal, torch.equal, ==).
"""
import glob
import json
import shutil
import uuid

import numpy as np
import pytest
import torch

import mxgraph.data.packed
import mxgraph.train.loop
from mxgraph.cli.main import main
from mxgraph.data.packed import PackedBatches
from mxgraph.data.token_file import default_tokenizer, ensure_token_file, open_tokens
from mxgraph.runtime.checkpoint.shm import segment_prefix
from mxgraph.train.loop import TrainConfig, train
from tests.dataset_files import SAVED_DATASET, saved_dataset_documents, write_jsonl, write_parquet
from tests.hf_checkpoint_dirs import EOS, TOKENIZER_VOCAB, built_in_text, save_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def reference_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """Each document tokenized alone, followed by EOS, in order."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = []
    for doc in docs:
        ids += tokenizer(doc)["input_ids"] + [eos]
    return np.array(ids)


def test_jsonl_token_file_is_each_document_tokenized_and_joined_with_eos(
        tmp_path, tokenizer_dir, tokenizer):
    docs = built_in_text(30_000) + saved_dataset_documents()
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    path = ensure_token_file(str(data), str(tokenizer_dir), progress=False)
    assert path.parent == tmp_path and path.name.startswith("docs.jsonl.")
    tokens = open_tokens(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert np.array_equal(tokens, reference_stream(tokenizer, docs))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", path.name]  # no leftovers


def test_text_file_documents_are_its_blank_line_separated_blocks(tmp_path, tokenizer_dir,
                                                                 tokenizer):
    docs = ["first line\nsecond  line ", "  indented block\n\tand a tab", "last"]
    data = tmp_path / "docs.txt"
    data.write_text("\n\n" + "\n \n\n".join(docs) + "\n\n\n")
    tokens = open_tokens(ensure_token_file(str(data), str(tokenizer_dir), progress=False))
    assert np.array_equal(tokens, reference_stream(tokenizer, docs))


def test_a_tokenizer_that_ends_documents_with_eos_itself_gets_no_second_one(tmp_path,
                                                                            tokenizer_dir):
    """A post-processor that appends EOS (and prepends it, as a BOS): the stream is the
    tokenizer's own output, document after document."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # a copy to change
    eos = tokenizer.convert_tokens_to_ids(EOS)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{EOS} $A {EOS}", special_tokens=[(EOS, eos)])
    tokenizer.save_pretrained(tmp_path / "tok")
    docs = saved_dataset_documents()
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    tokens = open_tokens(ensure_token_file(str(data), str(tmp_path / "tok"), progress=False))
    ends = AutoTokenizer.from_pretrained(tmp_path / "tok")
    want = [i for doc in docs for i in ends(doc)["input_ids"]]
    assert want[:1] == [eos] and want[-1:] == [eos] and tokens.tolist() == want


def test_parquet_and_a_saved_dataset_load_the_same_stream_as_jsonl(tmp_path, tokenizer_dir,
                                                                   tokenizer):
    docs = saved_dataset_documents()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs)
    parquet = write_parquet(tmp_path / "docs.parquet", docs)
    saved = shutil.copytree(SAVED_DATASET, tmp_path / "saved")  # the token file goes beside it
    want = open_tokens(ensure_token_file(str(jsonl), str(tokenizer_dir), progress=False))
    assert np.array_equal(want, reference_stream(tokenizer, docs))
    for data in (parquet, saved):
        path = ensure_token_file(str(data), str(tokenizer_dir), progress=False)
        assert np.array_equal(open_tokens(path), want), data
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in SAVED_DATASET.iterdir())


def test_prepare_makes_the_file_once_and_again_for_a_changed_file_or_tokenizer(
        tmp_path, tokenizer_dir, capsys):
    data = write_jsonl(tmp_path / "docs.jsonl", saved_dataset_documents())
    tok = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    argv = ["data", "prepare", "--data", str(data), "--tokenizer", str(tok), "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.endswith(", made\n") and "tokens (uint16)" in first
    assert main(argv) == 0
    assert capsys.readouterr().out == first.replace(", made", ", already up to date")
    path = first.split(":")[0]
    write_jsonl(data, saved_dataset_documents()[:-1])  # another size and mtime
    assert main(argv) == 0
    changed = capsys.readouterr().out
    assert changed.endswith(", made\n") and changed.split(":")[0] != path
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert main(argv) == 0
    retokenized = capsys.readouterr().out
    assert retokenized.endswith(", made\n") and retokenized.split(":")[0] not in (path, changed)


def test_data_help_lists_prepare(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["data", "--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and "prepare" in out and "tokenize --data with --tokenizer" in out


def test_default_tokenizer_is_the_model_directory_holding_one(tokenizer_dir, tmp_path):
    assert default_tokenizer(str(tokenizer_dir)) == str(tokenizer_dir)
    assert default_tokenizer(str(tmp_path)) is None  # a directory without tokenizer files
    assert default_tokenizer("llama-tiny") is None and default_tokenizer("hf:llama") is None


def test_packed_batches_are_shifted_sequences_each_read_once_per_epoch_by_one_rank():
    tokens = np.arange(1 + 10 * 8, dtype=np.uint16)  # 10 sequences of 8 + 1
    one = PackedBatches(tokens, 4, 8, seed=3)
    ranks = [PackedBatches(tokens, 2, 8, seed=3, dp_rank=r, dp_size=2) for r in (0, 1)]
    seen = []
    for _ in range(2):  # an epoch: 2 steps of 4 sequences, the 2 left over skipped
        x, y = one.next()
        parts = [rank.next() for rank in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
        assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        for row in x:  # a sequence starts at a multiple of seq_len, reads seq_len + 1
            assert row[0] % 8 == 0 and torch.equal(row, torch.arange(row[0], row[0] + 8))
        seen += (x[:, 0] // 8).tolist()
    assert len(set(seen)) == 8
    assert one.next()[0].shape == (4, 8) and one.state_dict()["epoch"] == 1
    order = [one.order(0), one.order(1)]
    assert sorted(order[0].tolist()) == list(range(10)) and not np.array_equal(*order)


def test_packed_position_resumes_exactly_and_refuses_other_data():
    tokens = np.arange(1 + 12 * 4, dtype=np.uint16)
    batches = PackedBatches(tokens, 5, 4, seed=1)
    for _ in range(3):
        batches.next()
    state = batches.state_dict()
    want = [batches.next() for _ in range(4)]  # across the epoch's end
    again = PackedBatches(tokens, 5, 4, seed=1)
    again.load_state_dict(state)
    for w, g in zip(want, (again.next() for _ in range(4)), strict=True):
        assert torch.equal(w[0], g[0]) and torch.equal(w[1], g[1])
    with pytest.raises(ValueError, match="resume with the same --data, --tokenizer, --seq-len"):
        PackedBatches(tokens[:-4], 5, 4, seed=1).load_state_dict(state)


VALIDATION_SEED = 12345
"""`mxgraph.train.loop.evaluate`'s loader's: its batches are not recorded."""


def _recording(monkeypatch, kill_at: int | None = None) -> tuple[dict, dict, list, type]:
    """Record every batch read (by position) and every step's loss; raise at batch
    `kill_at` as a crash would; collect the run's checkpoint holders to close."""
    batches, losses, holders = {}, {}, []
    read, one_step = PackedBatches.next, mxgraph.train.loop._Loop.one_step

    class Killed(Exception):
        pass

    def next_batch(self):
        if self.seed == VALIDATION_SEED:
            return read(self)
        if self.step == kill_at:
            raise Killed(f"killed at batch {kill_at}")
        position = self.step
        batches[position] = read(self)
        return batches[position]

    def step(self, update):
        verdict = one_step(self, update)
        losses[update] = verdict.loss
        return verdict

    class Holder(mxgraph.train.loop.RunCheckpoints):
        def __init__(self, *args):
            super().__init__(*args)
            holders.append(self)
    monkeypatch.setattr(mxgraph.data.packed.PackedBatches, "next", next_batch)
    monkeypatch.setattr(mxgraph.train.loop._Loop, "one_step", step)
    monkeypatch.setattr(mxgraph.train.loop, "RunCheckpoints", Holder)
    return batches, losses, holders, Killed


def test_a_killed_run_resumed_reads_the_same_batches_and_losses(tmp_path, tokenizer_dir,
                                                                monkeypatch):
    data = write_jsonl(tmp_path / "docs.jsonl", built_in_text(30_000))
    base = dict(model="llama-tiny", model_config=f"vocab_size={TOKENIZER_VOCAB}",
                data=str(data), tokenizer=str(tokenizer_dir), steps=4, batch_size=2,
                seq_len=16, warmup=2, val_batches=1, eager=True)
    with monkeypatch.context() as patch:  # the reference: not interrupted, nothing saved
        want_batches, want_losses, _, _ = _recording(patch)
        want = train(TrainConfig(**base), progress=False)
    assert sorted(want_batches) == [0, 1, 2, 3]
    run_id = f"data-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MXGRAPH_RUN_ID", run_id)
    cfg = TrainConfig(**base, save_every=2, checkpoint_dir=str(tmp_path / "ckpt"))
    with monkeypatch.context() as patch:  # killed reading the 4th batch (after step 2's save)
        _, killed_losses, holders, Killed = _recording(patch, kill_at=3)
        with pytest.raises(Killed):
            train(cfg, progress=False)
        holders[0].checkpointer.close()
    assert killed_losses == {k: want_losses[k] for k in range(3)}
    with monkeypatch.context() as patch:
        got_batches, got_losses, _, _ = _recording(patch)
        got = train(TrainConfig(**{**cfg.__dict__, "resume": True}), progress=False)
    assert got["start_step"] == 2 and sorted(got_batches) == [2, 3]
    for position, (x, y) in got_batches.items():
        assert torch.equal(x, want_batches[position][0]), position
        assert torch.equal(y, want_batches[position][1]), position
    assert got_losses == {k: want_losses[k] for k in (2, 3)}
    assert got["val_loss"] == want["val_loss"]
    assert not glob.glob(f"/dev/shm/{segment_prefix(run_id)}*"), "shared memory left behind"
    for name, param in want["parameters"].items():
        assert torch.equal(param, got["parameters"][name]), name


def _two_ranks(rank, world, tmp, data, tokenizer_dir, cfg_fields):
    import mxgraph.data.token_file
    write = mxgraph.data.token_file.write_token_file

    def write_once(*args, **kwargs):  # mark which rank tokenized
        open(f"{tmp}/tokenized-by-{rank}", "w").close()
        return write(*args, **kwargs)
    mxgraph.data.token_file.write_token_file = write_once
    read, batches = PackedBatches.next, []

    def next_batch(self):
        batch = read(self)
        if self.seed != VALIDATION_SEED:
            batches.append((self.step - 1, batch))
        return batch
    PackedBatches.next = next_batch
    result = train(TrainConfig(**cfg_fields), progress=False)
    torch.save({"batches": dict(batches), "train_loss": result["train_loss"]},
               f"{tmp}/rank{rank}.pt")


@pytest.mark.slow
def test_two_data_parallel_ranks_tokenize_once_and_read_halves_of_one_batch(
        tmp_path, tokenizer_dir, tokenizer):
    """2 gloo ranks (dp = 2, compiled) on a JSONL without a token file: one rank tokenizes
    while the other waits on the lock; each step's two batches are the two halves of the
    one-process batch of twice the size, and the loss (the mean over the dp group) is that
    run's (tolerance 1e-5 relative: the two halves' means are averaged, another order)."""
    from tests.distributed import run_ranks
    docs = built_in_text(30_000)
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    fields = dict(model="llama-tiny", model_config=f"vocab_size={TOKENIZER_VOCAB}",
                  data=str(data), tokenizer=str(tokenizer_dir), steps=2, batch_size=2,
                  seq_len=16, warmup=1, val_batches=1)
    run_ranks(2, _two_ranks, str(tmp_path), str(data), str(tokenizer_dir), fields)
    assert len(list(tmp_path.glob("tokenized-by-*"))) == 1
    token_files = list(tmp_path.glob("docs.jsonl.*"))
    assert len(token_files) == 1 and token_files[0].name.endswith(".tokens.npy")
    assert np.array_equal(open_tokens(token_files[0]), reference_stream(tokenizer, docs))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    with pytest.MonkeyPatch.context() as patch:
        one_batches, _, _, _ = _recording(patch)
        one = train(TrainConfig(**{**fields, "batch_size": 4}), progress=False)
    assert sorted(one_batches) == sorted(ranks[0]["batches"]) == [0, 1]
    for step, (x, y) in one_batches.items():
        halves = [rank["batches"][step] for rank in ranks]
        assert torch.equal(x, torch.cat([h[0] for h in halves]))
        assert torch.equal(y, torch.cat([h[1] for h in halves]))
    assert abs(ranks[0]["train_loss"] - one["train_loss"]) <= 1e-5 * one["train_loss"]
