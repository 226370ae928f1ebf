"""Expert parallelism on two more forms of routed experts, found by dataflow:

* per-expert tensors gathered per sorted row inside a grouped-GEMM block (Hugging Face
  gpt_oss: expert biases B[ids] added between and after the expert GEMMs);
* the all-experts form: every expert on every token through bmm over [E, ...] weights,
  weighted by the router's scores and summed over the experts (Hugging Face llama4_text;
  a hand-built variant with expand and the scores on the outputs).

The HF models are built from their config defaults with only the sizes made tiny
(benchmarks/hf_zoo/shrink.py; fp32, torch.manual_seed(0), the zoo's `CausalLMLoss`). On 2
gloo ranks, `Plan(ep=2)` (dp=2: each rank its own batch of 2 x 16 tokens), AdamW from
`step.parameters()` before the first step (lr per model: `MODELS`), against the
single-process eager model on the global batch: the loss of every step within 1e-5 relative; the gradients of step 1 and
the parameters after 3 steps, each gathered whole over the ep group through `step.layouts`
(expert tensors: every rank's experts stacked along dim 0), within 1e-4 of the reference's
norm (floored at 1e-3 of the largest norm: `tests/runtime/test_pipeline_exec.py`'s measure). One
run_ranks launch covers the three models. Refusals are checked on a paper mesh.
"""
import copy
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mxgraph as mx
from mxgraph.capture import capture
from mxgraph.context import CompileContext
from mxgraph.driver import compile_step, fake_model
from mxgraph.passes.sharding.moe_blocks import find_expert_blocks
from mxgraph.runtime.cluster.mesh import Mesh
from tests.distributed import run_ranks
from tests.helpers import drift_tol, rel_err, under_inductor
from tests.runtime.test_pipeline_exec import GRAD_TOL, LOSS_TOL, floored_err, largest_norm

pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from hf_zoo.cells import build  # noqa: E402

mxop = torch.ops.mxgraph


class DenseMoE(nn.Module):
    """Every expert on every token: x.unsqueeze(0).expand(E, T, D) through two bmm's, the
    outputs weighted by the top-k scores laid out [E, T, 1] and summed over the experts.
    `mix_tokens`: a cumsum over the tokens between the GEMMs (not per (expert, token))."""

    def __init__(self, experts=4, dim=16, ffn=32, topk=2, vocab=256, mix_tokens=False):
        super().__init__()
        self.topk, self.mix_tokens = topk, mix_tokens
        self.embed = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, ffn) * 0.2)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, dim) * 0.2)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        x_TD = self.embed(tokens).flatten(0, 1)
        logits_TE = self.router(x_TD)
        top, ids = logits_TE.topk(self.topk, dim=-1)
        scores_TE = torch.zeros_like(logits_TE).scatter(1, ids, top.softmax(-1))
        h_ETF = F.gelu(torch.bmm(x_TD.unsqueeze(0).expand(len(self.w_in), -1, -1), self.w_in))
        if self.mix_tokens:
            h_ETF = h_ETF.cumsum(1)
        y_ETD = torch.bmm(h_ETF, self.w_out) * scores_TE.t().unsqueeze(-1)
        return F.cross_entropy(self.head(x_TD + y_ETD.sum(0)), targets.flatten())


def _dense_moe():
    torch.manual_seed(0)
    return DenseMoE()


MODELS = {"gpt_oss": (lambda: build("gpt_oss"), 1e-2),
          "llama4_text": (lambda: build("llama4_text"), 1e-3),
          "dense-hand": (_dense_moe, 1e-2)}
"""name -> (builder, AdamW lr). llama4_text at lr 1e-3: its step-1 gradients match to 3e-7
but some are of the order of AdamW's eps (1e-6), where the update amplifies rounding, so at
lr 1e-2 the parameters drift to 1.8e-4 after 3 steps (1.8e-6 at 1e-3; dp=2 alone is bitwise)."""
INDUCTOR_AFTER_STEPS = {"gpt_oss": 2e-3}
"""Under MXGRAPH_CODEGEN=inductor, the parameters after check_ep2's 3 AdamW steps, where
torch.compile itself drifts further from eager than `drift_tol` allows: gpt_oss's third-step
gradients 5.9e-4 and embedding after it 1.5e-3 apart in this loop, in one process
(`python -m tests.inductor_drift gpt_oss`)."""


# ---- two ranks vs eager -------------------------------------------------------------------
def _whole(step, name: str, mine: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of parameter `name` made whole: expert tensors all-gathered over
    the ep group along dim 0 (`step.layouts`), others as they are."""
    layout = step.layouts.get(name)
    if layout is None or not layout.ep:
        return mine
    assert layout.tp_dim is None
    out = mine.new_empty(layout.full_shape(mine.shape, step.mesh.sizes))
    dist.all_gather_single(out, mine.contiguous(), group=step.mesh.group("ep"))
    return out


def _assert_whole(step, rows, scale: float, what: str, tol: float = GRAD_TOL) -> None:
    for name, mine, ref in rows:
        err = floored_err(_whole(step, name, mine), ref, scale)
        assert err <= tol, f"{what} {name}: error {err:.2e}"


def check_ep2(rank, world, model_name, steps=3, batch_size=2, seq_len=16):
    make_model, lr = MODELS[model_name]
    model = make_model()
    reference = copy.deepcopy(model)
    step = mx.compile(model, mx.Plan(ep=2))
    opt = torch.optim.AdamW(step.parameters(), lr=lr, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=1e-6)
    dp, dp_rank = step.mesh.sizes["dp"], step.mesh.coords["dp"]
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        tokens = torch.randint(0, 256, (batch_size * dp, seq_len), generator=g)
        targets = torch.randint(0, 256, (batch_size * dp, seq_len), generator=g)
        mine = slice(dp_rank * batch_size, (dp_rank + 1) * batch_size)
        loss = step(tokens[mine], targets[mine])
        reference.zero_grad()
        ref_loss = sum(reference(x, y) / dp for x, y in zip(tokens.chunk(dp), targets.chunk(dp), strict=True))
        ref_loss.backward()
        assert rel_err(loss, ref_loss) <= LOSS_TOL, (model_name, i, loss.item(), ref_loss.item())
        if i == 0:
            ref = dict(reference.named_parameters())
            _assert_whole(step, [(n, p.grad if p.grad is not None else torch.zeros_like(p), ref[n].grad)
                                 for n, p in step.named_parameters() if p.requires_grad],
                          largest_norm(reference, "grad"), f"{model_name} grad")
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    ref = dict(reference.named_parameters())
    tol = INDUCTOR_AFTER_STEPS.get(model_name, 0.0) if under_inductor() else 0.0
    _assert_whole(step, [(n, p.detach(), ref[n].detach()) for n, p in step.named_parameters()],
                  largest_norm(reference), f"{model_name} after {steps} steps",
                  max(tol, drift_tol(GRAD_TOL, steps)))
    experts = [n for n, layout in step.layouts.items() if layout.ep]
    assert experts and all(dict(model.named_parameters())[n].shape[0] == 2 for n in experts)
    if model_name == "gpt_oss":  # the biases go with their experts
        assert sum(n.endswith("_bias") for n in experts) == 4, experts


def _every_model(rank, world):
    for name in MODELS:
        try:
            check_ep2(rank, world, name)
        except Exception as error:
            raise AssertionError(f"{name} ep=2: {error}") from error


def test_ep2_hf_expert_biases_and_all_experts_forms():
    run_ranks(2, _every_model)


# ---- what the finder sees, what the pass writes (paper mesh) ------------------------------
def _blocks(model):
    tokens = torch.randint(0, 256, (2, 16))
    return find_expert_blocks(capture(model, (tokens, tokens), {}).gm)


def _paper_forward(model, **plan):
    tokens = torch.randint(0, 256, (2, 16))
    model, inputs = fake_model(model, (tokens, tokens))
    plan, mesh = mx.Plan(ep=2, **plan), Mesh.on_paper(ep=2, dp=2)
    return compile_step(model, plan, mesh, CompileContext(plan=plan, mesh=mesh), inputs, {},
                        stop_after="shard_ep").forward.gm


def test_gpt_oss_biases_join_the_grouped_block():
    blocks = _blocks(build("gpt_oss"))
    assert [b.form for b in blocks] == ["grouped", "grouped"]
    for block in blocks:
        assert block.problem is None and len(block.gathers) == 2
        keys = [w.param.meta["mx_slot_key"].rsplit(".", 1)[1] for w in block.weights]
        assert sorted(keys) == ["down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"]


def test_llama4_text_is_the_all_experts_form():
    blocks = _blocks(build("llama4_text"))
    assert [b.form for b in blocks] == ["dense", "dense"]
    for block in blocks:
        assert block.problem is None and block.topk is not None and len(block.gemms) == 2
        assert block.exit.target is torch.ops.aten.sum.dim_IntList and block.combine is block.exit
        assert len(block.dense.scores) == 1


def test_all_experts_form_reads_the_group_tokens():
    with torch.device("meta"):
        model = DenseMoE()
    gm = _paper_forward(model)
    ops = [n.target for n in gm.graph.nodes]
    assert ops.count(mxop.ep_all_gather.default) == 2  # the tokens and the scores
    assert ops.count(mxop.ep_reduce_scatter.default) == 1
    assert mxop.ep_dispatch.default not in ops
    experts = [n for n in gm.graph.find_nodes(op="placeholder") if "ep_shard_dim" in n.meta]
    assert sorted(tuple(n.meta["val"].shape) for n in experts) == [(2, 16, 32), (2, 32, 16)]
    bmm = [n for n in gm.graph.nodes if n.target is torch.ops.aten.bmm.default]
    assert [tuple(n.meta["val"].shape) for n in bmm] == [(2, 64, 32), (2, 64, 16)]  # E/ep, ep*T


def test_all_experts_form_mixing_tokens_is_refused():
    with torch.device("meta"):
        model = DenseMoE(mix_tokens=True)
    with pytest.raises(mx.PlanError, match=r"^expert parallelism \(ep=2\) found the expert "
                                           r"weights w_in \[4, 16, 32\] read by aten\.cumsum at "
                                           r"<top>, aten\.cumsum at <top> between the expert "
                                           r"GEMMs is not per \(expert, token\); .*set ep=1$"):
        _paper_forward(model)


def test_all_experts_form_refuses_capacity():
    with torch.device("meta"):
        model = DenseMoE()
    with pytest.raises(mx.PlanError, match=r"capacity_factor: the experts at <top> run on "
                                           r"every token .*drop the plan's capacity_factor"):
        _paper_forward(model, moe=mx.MoEOptions(capacity_factor=1.5))
