"""`mxgraph export CHECKPOINT --hf OUT` (`mxgraph/hf/export.py`): a pretrained model trained
a few steps under tp=2 (Llama), pp=2 (Llama) and ep=2 (Mixtral) with --save-every, exported
from its last checkpoint, loads with transformers' `AutoModelForCausalLM.from_pretrained`
without missing or unexpected keys; every rank's final parameter equals its part of the
exported one (bitwise: so the logits are the step's), and the exported model's validation
loss on `train.evaluate`'s batches equals the run's within 1e-5 relative (fp32; the
compiled step sums in another order than transformers' eager forward).
"""
import json

import numpy as np
import pytest
import torch

from mxgraph.errors import UserError
from mxgraph.hf.models import HFCausalLM
from tests.distributed import run_ranks
from tests.hf_checkpoint_dirs import save_model_dir

VAL_RTOL = 1e-5
COMMON = dict(steps=2, batch_size=4, seq_len=16, val_batches=2, save_every=2, lr=1e-3,
              warmup=1)


def _train_cases(rank, world, cases, tmp):
    from mxgraph.train.loop import TrainConfig, train
    for i, (directory, plan) in enumerate(cases):
        plan_path = f"{tmp}/plan{i}.toml"
        if rank == 0:
            with open(plan_path, "w") as f:
                f.write(plan)
        torch.distributed.barrier()
        cfg = TrainConfig(model=directory, plan=plan_path, checkpoint_dir=f"{tmp}/ck{i}",
                          **COMMON)
        result = train(cfg, progress=False)
        torch.save({name: p.detach().clone() for name, p in result["parameters"].items()},
                   f"{tmp}/params{i}_rank{rank}.pt")
        if rank == 0:
            with open(f"{tmp}/val{i}.json", "w") as f:
                json.dump(result["val_loss"], f)


def _hf_val_loss(model, cfg_batch_size, seq_len, val_batches) -> float:
    """`train.evaluate`'s validation loss, computed by the exported model in transformers."""
    from mxgraph.data.batches import Batches, load_tokens, split
    _, val_tokens = split(load_tokens(None))
    batches = Batches(val_tokens, cfg_batch_size, seq_len, seed=12345)
    model.eval()
    with torch.no_grad():
        return float(np.mean([model(*batches.next()).item() for _ in range(val_batches)]))


@pytest.mark.slow
def test_trained_checkpoint_exports_to_hugging_face(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mxgraph.hf.export import export
    from mxgraph.runtime.param_layout import ParamLayout
    llama = str(save_model_dir(tmp_path / "llama", "llama"))
    mixtral = str(save_model_dir(tmp_path / "mixtral", "mixtral"))
    cases = [(llama, "tp = 2\n"), (llama, "pp = 2\nmicro_batches = 2\n"), (mixtral, "ep = 2\n"),
             (llama, "zero1 = true\n")]
    run_ranks(2, _train_cases, cases, str(tmp_path))
    for i, (_, plan) in enumerate(cases):
        out = tmp_path / f"out{i}"
        shard_size = "200KB" if i == 0 else "5GB"  # the first split in several files
        export(str(tmp_path / f"ck{i}"), str(out), shard_size, progress=False)
        assert (out / "tokenizer.json").exists()
        assert (out / "model.safetensors.index.json").exists() == (i == 0)
        hf_logging.set_verbosity_warning()
        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        exported = dict(HFCausalLM(model).named_parameters())
        layouts = _layouts(tmp_path / f"ck{i}")
        for rank in range(2):
            held = torch.load(tmp_path / f"params{i}_rank{rank}.pt")
            entry = layouts[rank]
            for name, piece in held.items():
                layout = ParamLayout(*(entry["layouts"].get(name) or [None, None, False]))
                if layout.tp_blocks:
                    layout = ParamLayout(layout.tp_dim, tuple(layout.tp_blocks), layout.ep)
                whole = exported[name]
                part = layout.shard(whole, entry["mesh"]["sizes"], entry["mesh"]["coords"]) \
                    if layout.sharded else whole
                assert torch.equal(part, piece), (plan, rank, name)
        val = json.loads((tmp_path / f"val{i}.json").read_text())
        ours = _hf_val_loss(HFCausalLM(model), COMMON["batch_size"], COMMON["seq_len"],
                            COMMON["val_batches"])
        assert ours == pytest.approx(val, rel=VAL_RTOL), (plan, ours, val)


def _layouts(checkpoint) -> list[dict]:
    from mxgraph.hf.export import _Snapshot, committed_step
    return [info for info, _ in _Snapshot(committed_step(str(checkpoint))).ranks]


def test_export_to_non_empty_directory_is_one_line_error(tmp_path, capsys):
    from mxgraph.cli.main import main
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    assert main(["export", str(tmp_path), "--hf", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not empty" in err, err


def test_max_shard_size_parsing():
    from mxgraph.hf.export import parse_size
    assert parse_size("5GB") == 5_000_000_000 and parse_size("500MB") == 500_000_000
    assert parse_size(1234) == 1234
    with pytest.raises(UserError, match="no size"):
        parse_size("five")


def test_preset_exports_its_state_dict(tmp_path):
    """A preset model (one process, --eager): model.safetensors holds exactly the run's
    final parameters (bitwise), mxgraph_model.json names the preset."""
    from safetensors.torch import load_file

    from mxgraph.hf.export import export
    from mxgraph.train.loop import TrainConfig, train
    cfg = TrainConfig(model="llama-tiny", checkpoint_dir=str(tmp_path / "ck"), eager=True,
                      **{**COMMON, "steps": 1, "save_every": 1, "val_batches": 1})
    result = train(cfg, progress=False)
    export(str(tmp_path / "ck"), str(tmp_path / "out"), progress=False)
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == result["parameters"].keys()
    for name, param in result["parameters"].items():
        assert torch.equal(saved[name], param.detach()), name
    assert json.loads((tmp_path / "out" / "mxgraph_model.json").read_text())["preset"] == \
        "llama-tiny"
