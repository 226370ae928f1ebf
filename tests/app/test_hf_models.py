"""Hugging Face transformers models (mxgraph/hf/models.py): each family of `TINY` builds, its loss
is the mean next-token cross-entropy of its logits (the same as HF's own `labels=` loss),
`mx.compile` on one process gives the eager loss and gradients in fp32, and
`mxgraph train --model hf:...` runs; the CLI's one-line errors for HF specs."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mxgraph as mx
from mxgraph.cli.main import main as cli_main
from mxgraph.errors import UserError
from mxgraph.hf.models import TINY, build_hf_model, parse_overrides
from mxgraph.train.loop import TrainConfig, build_training_model

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
# (family, experts implementation; None = transformers' default, grouped_mm for MoE)
CASES = [("llama", None), ("gpt2", None), ("mixtral", None), ("qwen2_moe", None),
         ("mixtral", "batched_mm")]


def _batch(seed: int = 0):
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    return tokens, tokens[:, :-1], tokens[:, 1:]  # targets already shifted, as mxgraph's data


def _build(family: str, experts: str | None = None):
    torch.manual_seed(0)
    overrides = TINY[family] | ({"experts_implementation": experts} if experts else {})
    return build_hf_model(f"hf:{family}", overrides)


@pytest.mark.parametrize("family", list(TINY))
def test_loss_is_the_mean_cross_entropy_of_the_logits(family):
    model = _build(family)
    tokens, inputs, targets = _batch()
    assert model.vocab_size == model.config.vocab_size == 256
    assert all(name.startswith("model.") for name, _ in model.named_parameters())
    loss = model(inputs, targets)
    logits = model.model(input_ids=inputs).logits
    direct = -logits.float().log_softmax(-1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss, direct, rtol=1e-6, atol=0)
    # HF shifts `labels` itself: the full window with labels = inputs is the same loss
    hf_loss = model.model(input_ids=tokens, labels=tokens).loss
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family,experts", CASES)
def test_compiled_step_matches_eager_in_fp32(family, experts):
    model = _build(family, experts)
    if experts:
        assert model.config._experts_implementation == experts
    _, inputs, targets = _batch(1)
    eager = model(inputs, targets)
    eager.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = mx.compile(model, mx.Plan())(inputs, targets)
    assert abs(loss.item() - eager.item()) <= 1e-5 * abs(eager.item())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        error = (param.grad - reference[name]).norm()
        assert error <= 1e-4 * reference[name].norm(), name


@pytest.mark.parametrize("dtype,op", [(torch.float32, "transformers.grouped_mm_fallback"),
                                      (torch.bfloat16, "aten._grouped_mm")])
def test_grouped_mm_experts_trace_as_documented(dtype, op):
    """mxgraph/hf/models.py's docstring: the default experts ("grouped_mm") export as transformers'
    fallback custom op in fp32 and as aten._grouped_mm in bf16."""
    torch.manual_seed(0)
    model = build_hf_model("hf:mixtral", TINY["mixtral"], dtype=dtype)
    _, inputs, targets = _batch()
    graph = torch.export.export(model, (inputs, targets), strict=False).graph
    targets_seen = {str(node.target) for node in graph.nodes if node.op == "call_function"}
    assert f"{op}.default" in targets_seen


def test_eager_experts_loop_does_not_trace():
    """The claim of mxgraph/hf/models.py's docstring: the "eager" experts implementation (a loop
    over the experts hit) is data-dependent and torch.export refuses it."""
    model = _build("mixtral", "eager")
    _, inputs, targets = _batch()
    with pytest.raises(Exception, match="data-dependent"):
        torch.export.export(model, (inputs, targets), strict=False)


def test_config_json_and_overrides(tmp_path):
    path = tmp_path / "config.json"
    _build("llama").config.to_json_file(str(path))
    cfg = TrainConfig(model=str(path), model_config="num_hidden_layers=1", dtype="bfloat16")
    model = build_training_model(cfg)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 64
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float32}  # RoPE frequencies
    preset = build_training_model(TrainConfig(model="llama-tiny", model_config="n_layers=1"))
    assert len(preset.layers) == 1 and preset.config.vocab_size == 256


def test_parse_overrides():
    assert parse_overrides("a=1,b=2.5,c=true,d=False,e=gelu,f=none,") == {
        "a": 1, "b": 2.5, "c": True, "d": False, "e": "gelu", "f": None}
    assert parse_overrides(None) == parse_overrides("") == {}
    with pytest.raises(UserError, match="is not key=value"):
        parse_overrides("hidden_size")


def test_only_the_hugging_face_modules_import_transformers_and_only_in_functions():
    found = []
    for path in sorted((ROOT / "mxgraph").rglob("*.py")):
        tree = ast.parse(path.read_text())
        local = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "transformers" for n in names):
                found.append((str(path.relative_to(ROOT)), id(node) in local))
    allowed = {"mxgraph/hf/models.py", "mxgraph/hf/pretrained.py", "mxgraph/data/token_file.py"}
    assert found and all(path in allowed and inside for path, inside in found), found


HF_ERRORS = {
    "unknown model_type": (["train", "--model", "hf:lama"],
                           "mxgraph: error: unknown Hugging Face model_type 'lama'; did you "
                           "mean 'llama'?"),
    "override typo": (["train", "--model", "hf:llama", "--model-config", "hiden_size=64"],
                      "mxgraph: error: --model-config hiden_size is no field of LlamaConfig; "
                      "did you mean 'hidden_size'?"),
    "no causal LM": (["train", "--model", "hf:vit"],
                     "mxgraph: error: Hugging Face model_type 'vit' has no causal language "
                     "model (AutoModelForCausalLM); choose a decoder such as llama, gpt2, "
                     "mixtral or qwen2_moe"),
    "missing config file": (["train", "--model", "missing.json"],
                            "mxgraph: error: config file missing.json does not exist; --model "
                            "takes a preset, hf:<model_type> or the path of a Hugging Face "
                            "config.json"),
    "preset field typo": (["train", "--model-config", "n_layer=1"],
                          "mxgraph: error: --model-config n_layer is no field of llama-tiny's "
                          "LlamaConfig; its fields: vocab_size, dim, n_layers, n_heads, "
                          "n_kv_heads, ffn_dim, max_seq_len, rope_theta, norm_eps, "
                          "tie_embeddings, init_std"),
}


@pytest.mark.parametrize("name", HF_ERRORS)
def test_cli_error_is_one_line(name, tmp_path, monkeypatch, capfd):
    argv, expected = HF_ERRORS[name]
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    out, err = capfd.readouterr()
    assert (out, err) == ("", expected + "\n")


def test_cli_without_transformers_says_how_to_install(monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    assert cli_main(["train", "--model", "hf:llama"]) == 2
    assert capfd.readouterr().err == ("mxgraph: error: Hugging Face models need the "
                                      "transformers package: pip install mxgraph[hf]\n")


def test_cli_trains_an_hf_model(tmp_path):
    overrides = ",".join(f"{k}={v}" for k, v in TINY["llama"].items())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "mxgraph.cli", "train", "--model", "hf:llama",
                          "--model-config", overrides, "--steps", "3", "--batch-size", "2",
                          "--seq-len", "16", "--val-batches", "1", "--no-progress"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "validation loss" in run.stdout
