"""Communication report (mxgraph/comm.py): bytes per axis and kind read from graphs compiled
on a paper mesh (meta device) equal hand counts from the config; dumps and `inspect` show them."""
import pytest
import torch

import models
from mxgraph.cli.main import main as cli_main
from mxgraph.comm import comm_report
from mxgraph.dump import read_summary
from mxgraph.plan import Plan
from mxgraph.runtime.cluster.mesh import Mesh

B, S = 2, 16  # batch, sequence
F32 = 4  # bytes per element: the tiny models are fp32


def llama(n_layers=2):
    return models.build_model("llama-tiny", device="meta", n_layers=n_layers)


def tokens():
    return torch.zeros(B, S, dtype=torch.long, device="meta")


def report(model, plan, **kwargs):
    return comm_report(model, plan, (tokens(), tokens()), **kwargs)


def llama_param_bytes(cfg, tp: int) -> int:
    """This rank's parameter bytes: matrices (embedding, linears, LM head) split over tp,
    norm weights whole."""
    h, kv = cfg.dim, cfg.n_kv_heads * (cfg.dim // cfg.n_heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_dim
    matrices = 2 * cfg.vocab_size * h + cfg.n_layers * layer
    return (matrices // tp + (2 * cfg.n_layers + 1) * h) * F32


def test_tp2_all_reduces_equal_hand_count():
    model = llama()
    cfg = model.config
    rep = report(model, Plan(tp=2))
    bsh = B * S * cfg.dim * F32
    # per layer: all-reduce after attention and after the MLP (forward), and of the
    # gradients of their inputs (backward, tp_copy's conjugate); vocab-parallel embedding:
    # forward all-reduce of partial rows; vocab-parallel cross-entropy: 3 all-reduces of one
    # fp32 per token; column-parallel LM head: backward all-reduce of its input gradient.
    forward = 2 * cfg.n_layers * bsh + bsh + 3 * B * S * 4
    backward = 2 * cfg.n_layers * bsh + bsh
    assert rep.total("tp", "all_reduce", "forward") == forward
    assert rep.total("tp", "all_reduce", "backward") == backward
    assert rep.calls("tp", "all_reduce") == 4 * cfg.n_layers + 3
    assert rep.total() == forward + backward  # nothing else: dp = 1
    assert rep.by_kind()["all_gather"] == 0


def test_the_model_is_left_as_it_was():
    model = llama()
    before = {n: (p, p.shape, p.is_meta) for n, p in model.named_parameters()}
    report(model, Plan(tp=2))
    assert {n: (p, p.shape, p.is_meta) for n, p in model.named_parameters()} == before


def test_recomputed_collectives_count_again():
    bsh = B * S * llama().config.dim * F32
    saved = report(llama(), Plan(tp=2))
    remat = report(llama(), Plan(tp=2, recompute="full"))
    # remat copies forward all-reduces into the backward: each copy runs, so counts again
    assert remat.total("tp", "all_reduce", "forward") == saved.total("tp", "all_reduce", "forward")
    extra = (remat.total("tp", "all_reduce", "backward")
             - saved.total("tp", "all_reduce", "backward"))
    assert extra > 0 and extra % bsh == 0


def test_sequence_parallel_gathers_and_scatters_what_tp_all_reduced():
    model = llama()
    cfg = model.config
    rep = report(model, Plan(tp=2, sequence_parallel=True))
    bsh = B * S * cfg.dim * F32
    assert rep.total("tp", "all_gather") == (4 * cfg.n_layers + 2) * bsh
    assert rep.total("tp", "reduce_scatter") == (4 * cfg.n_layers + 2) * bsh
    # norm weights are replicated in the SP region: their gradients are summed over tp
    assert rep.total("tp", "all_reduce") == (2 * cfg.n_layers + 1) * cfg.dim * F32 + 3 * B * S * 4


def test_dp_bytes_equal_parameter_bytes():
    model = llama()
    rep = report(model, Plan(tp=2, dp=2))
    loss = 4  # the fp32 loss, averaged over dp by the step
    assert rep.total("dp", "all_reduce") == llama_param_bytes(model.config, tp=2) + loss
    assert rep.total("dp", "all_reduce", "runtime") == rep.total("dp")


def test_zero1_reduce_scatters_gradients_and_gathers_parameters():
    model = llama()
    rep = report(model, Plan(dp=2, zero1=True))
    params = llama_param_bytes(model.config, tp=1)  # every size is even: no bucket padding
    assert rep.total("dp", "reduce_scatter") == params
    assert rep.total("dp", "all_gather") == params
    assert rep.total("dp", "all_reduce") == 4  # only the loss


def test_context_parallel_gathers_kv_and_sums_gradients():
    model = llama()
    cfg = model.config
    rep = report(model, Plan(cp=2))
    # per layer K and V gathered over the whole sequence (at KV-head width: before the
    # model repeats its KV heads), their gradients reduce-scattered backward
    kv = 2 * cfg.n_layers * B * S * cfg.n_kv_heads * (cfg.dim // cfg.n_heads) * F32
    assert rep.total("cp", "all_gather", "forward") == kv
    assert rep.total("cp", "reduce_scatter", "backward") == kv
    # the gradient buckets reduce over dp x cp (dp = 1 here: the sum over cp); the mean
    # cross-entropy all-reduces its local sum (fp32) and token count (int64), and the sum's
    # gradient backward
    assert rep.total("dp_cp", "all_reduce", "runtime") == llama_param_bytes(cfg, tp=1)
    assert rep.total("cp", "all_reduce") == 4 + 8 + 4
    assert rep.total("dp", "all_reduce") == 0  # dp = 1: no loss average


def test_pipeline_sends_per_rank():
    cfg = llama().config
    boundary = B // 2 * S * cfg.dim * F32  # one micro-batch's activations
    first = report(llama(), Plan(pp=2, micro_batches=2))
    last = report(llama(), Plan(pp=2, micro_batches=2), pp_rank=1)
    assert first.total("pp", "send", "forward") == 2 * boundary
    assert first.total("pp", "send", "backward") == 0
    assert last.total("pp", "send", "backward") == 2 * boundary
    assert last.total("pp", "send", "forward") == 0


def test_expert_all_to_all_at_bound_and_balanced():
    ep, model = 2, models.build_model("moe-tiny", device="meta", n_layers=2,
                                      expert_impl="grouped_mm")
    cfg = model.config
    rows = B * S * cfg.topk * cfg.dim * F32  # routed rows this rank sends
    counts = cfg.n_routed_experts * 8  # int64 per-expert row counts
    balanced = report(model, Plan(ep=ep, dp=2), unbacked=lambda upper: upper // ep)
    # dispatch and combine, forward and backward, one MoE layer; the received rows are
    # data-dependent, at most ep x the rows sent
    assert balanced.total("ep", "all_to_all") == 4 * rows + counts
    assert sum(e.worst_case for e in balanced.entries if e.axis == "ep") == \
        2 * rows + 2 * ep * rows + counts
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert balanced.total("edp", "all_reduce") == 0  # edp = dp / ep = 1: nothing to reduce
    assert balanced.total("dp", "all_reduce") == \
        sum(p.numel() for p in model.parameters()) * F32 - experts * F32 + 4


def test_mesh_maps_group_names_back_to_axes():
    mesh = Mesh.on_paper(tp=4, dp=2)
    for axis in ("tp", "dp", "cp", "pp"):
        assert mesh.axis_of(mesh.group_name(axis)) == axis
    with pytest.raises(KeyError, match="no axis"):
        mesh.axis_of("nonsense")


def test_dump_summary_and_inspect_show_the_totals(tmp_path, capsys):
    rep = report(llama(), Plan(tp=2, dump_dir=str(tmp_path)))
    last = read_summary(tmp_path)[-1]
    assert int(last["comm_all_reduce"]) == rep.total("tp", "all_reduce")
    assert int(last["comm_all_gather"]) == 0
    assert (tmp_path / "comm.txt").read_text().startswith("axis")
    assert cli_main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "comm MiB" in out
    assert f"all_reduce {rep.total('tp', 'all_reduce') / 2**20:.2f}" in out


def test_inspect_comm_prints_the_table(tmp_path, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text("tp = 2\ndp = 2\n")
    assert cli_main(["inspect", "--comm", "--model", "llama-tiny", "--plan", str(plan),
                     "--layers", "2", "--batch-size", str(B), "--seq-len", str(S),
                     "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    cfg = llama().config
    tp_bytes = (4 * cfg.n_layers + 2) * B * S * cfg.dim * F32 + 3 * B * S * 4
    lines = {tuple(line.split()[:2]): line.split() for line in out.splitlines()}
    assert lines[("tp", "all_reduce")][-1] == f"{tp_bytes / 2**20:.2f}"
    assert lines[("dp", "all_reduce")][-1] == \
        f"{(llama_param_bytes(cfg, tp=2) + 4) / 2**20:.2f}"


def hf(family: str):
    from mxgraph.hf.models import TINY, build_hf_model
    return build_hf_model(f"hf:{family}", TINY[family])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_tp2_volume_equals_megatrons_formula(family):
    """A Hugging Face model under tp=2 moves what Megatron-LM's formula says (the terms of
    `benchmarks/bench_comm.py`, counted as in test_tp2_all_reduces_equal_hand_count): no
    hidden gathers."""
    model = hf(family)
    cfg = model.model.config
    layers, bsh = cfg.num_hidden_layers, B * S * cfg.hidden_size * F32
    rep = report(model, Plan(tp=2))
    assert rep.total("tp", "all_reduce", "forward") == 2 * layers * bsh + bsh + 3 * B * S * 4
    assert rep.total("tp", "all_reduce", "backward") == 2 * layers * bsh + bsh
    assert rep.total() == rep.total("tp", "all_reduce")  # nothing else: no gathers, dp = 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_sequence_parallel_volume_equals_megatrons_formula(family):
    model = hf(family)
    cfg = model.model.config
    layers, h = cfg.num_hidden_layers, cfg.hidden_size
    bsh = B * S * h * F32
    rep = report(model, Plan(tp=2, sequence_parallel=True))
    # GPT-2's learned positions [1, s, h] are sliced to the sequence shard (the word
    # embedding is reduce-scattered); the slice's backward gathers their gradient, s·h·e
    positions = S * h * F32 if family == "gpt2" else 0
    assert rep.total("tp", "all_gather") == (4 * layers + 2) * bsh + positions
    assert rep.total("tp", "reduce_scatter") == (4 * layers + 2) * bsh
    norms = (2 * layers + 1) * h * F32 * (2 if family == "gpt2" else 1)  # LayerNorm: + bias
    # GPT-2's row-parallel biases are added on the sequence shard: their gradients sum too
    biases = 2 * layers * h * F32 if family == "gpt2" else 0
    assert rep.total("tp", "all_reduce") == norms + biases + 3 * B * S * 4
