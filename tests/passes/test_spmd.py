"""Sequence, context and vocabulary parallelism vs the single-process model.

Multi-rank cases run `check_plan` (tests/runtime/test_pipeline_exec.py) on gloo processes: every
rank's loss within 1e-5 relative of eager autograd on the global batch, its (gathered:
compared shard by shard) gradients within 1e-4 relative (fp32), its parameters within
1e-4 after 3 AdamW steps. Layout errors are checked in one process on a paper mesh.
"""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models
import mxgraph as mx
import tests.runtime.test_pipeline_exec as pipeline_exec
from mxgraph.capture import capture
from mxgraph.context import CompileContext
from mxgraph.passes.pipeline import FORWARD_PASSES
from mxgraph.passes.runner import run_pass
from mxgraph.runtime.cluster.mesh import Mesh
from tests.distributed import run_ranks
from tests.helpers import batch, rel_err
from tests.runtime.test_pipeline_exec import check_plan

LLAMA = "llama-tiny"
MODEL_KWARGS = {"moe-tiny": dict(expert_impl="grouped_mm", n_layers=2)}
"""The loop form traces slowly; 2 layers: the dense first layer and one MoE layer."""


def check_models(rank, world, cases, lr=1e-2):
    """check_plan for several (model, plan, model_kwargs) in the same processes."""
    for model_name, plan_kwargs, model_kwargs in cases:
        check_plan(rank, world, model_name, plan_kwargs, model_kwargs=model_kwargs, lr=lr)


@pytest.mark.parametrize("model_name", ["llama-tiny", "gpt-tiny", "moe-tiny"])
def test_tp2_sequence_parallel(model_name):
    # MoE at lr 1e-3, as test_pipeline_exec.test_tp2: at 1e-2 AdamW turns summation-order
    # differences (gradients agree to 1e-6) into a different top-k choice for some token
    run_ranks(2, check_models, [(model_name, dict(tp=2, sequence_parallel=True),
                                 MODEL_KWARGS.get(model_name))],
              1e-3 if model_name == "moe-tiny" else 1e-2)


@pytest.mark.parametrize("model_name", ["llama-tiny", "gpt-tiny", "moe-tiny"])
def test_cp2(model_name):
    run_ranks(2, check_models, [(model_name, dict(cp=2), MODEL_KWARGS.get(model_name))])


def test_cp2_tp2_llama_with_sequence_parallel():
    # cp2 x tp2 without SP: the drawn config below (one step)
    run_ranks(4, check_models, [(LLAMA, dict(cp=2, tp=2, sequence_parallel=True), None)])


def check_new_shapes(rank, world, cases):
    """One step per input shape (seq 16, 8, then 16 again: the first graph reused), each
    against eager: loss 1e-5, gradients 1e-4 (floored as check_plan)."""
    for model_name, plan_kwargs, model_kwargs in cases:
        torch.manual_seed(0)
        model = models.build_model(model_name, **model_kwargs)
        reference = copy.deepcopy(model)
        step = mx.compile(model, mx.Plan(**plan_kwargs))
        for seq in (16, 8, 16):
            args = batch(vocab=model.config.vocab_size, batch_size=2, seq_len=seq)
            loss = step(*args)
            reference.zero_grad()
            ref_loss = reference(*args)
            ref_loss.backward()
            assert rel_err(loss, ref_loss) <= 1e-5, (model_name, seq, loss.item(), ref_loss.item())
            ref_params = dict(reference.named_parameters())
            pipeline_exec.assert_like_reference(
                ((n, p.grad, ref_params[n].grad, p) for n, p in step.named_parameters()), step,
                pipeline_exec.largest_norm(reference, "grad"), 1e-4, f"{model_name} seq {seq}")
            model.zero_grad()
        assert len(step.executors()) == 2


def test_sharded_step_recompiles_for_new_input_shapes():
    """A TP (and an EP) step called with a new sequence length captures the whole model again
    (the shards stand in for whole parameters while tracing) and reuses its shards."""
    run_ranks(2, check_new_shapes, [(LLAMA, dict(tp=2), {}),
                                    ("moe-tiny", dict(ep=2), dict(n_layers=2, expert_impl="grouped_mm"))])


LAYOUTS = {"tp2": (2, dict(tp=2)),
           "dp2": (2, dict()),
           "tp2xdp2": (4, dict(tp=2)),
           "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
           "cp2": (2, dict(cp=2)),
           "cp2xtp2": (4, dict(cp=2, tp=2))}
"""Layouts with a drawn llama config each (dp2 + zero1: tests/runtime/test_data_parallel.py; ep2:
tests/parallel/test_expert_parallel.py, drawn MoE configs)."""


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@settings(max_examples=1, deadline=None)
@given(dim=st.sampled_from([32, 64]), heads=st.sampled_from([2, 4]),
       layers=st.integers(1, 2), seq=st.sampled_from([8, 16]), tie=st.booleans())
def test_drawn_llama_config_per_layout(layout, dim, heads, layers, seq, tie):
    world, plan = LAYOUTS[layout]
    config = dict(dim=dim, n_heads=heads, n_kv_heads=2, n_layers=layers, ffn_dim=2 * dim,
                  tie_embeddings=tie)
    run_ranks(world, check_plan, LLAMA, plan, 1, 2, seq, config)


# ---- layouts that cannot work: PlanError with the valid choices (one process) ---------

def forward_passes(model, plan: mx.Plan, seq: int = 16):
    """Run the forward passes for `plan` on a paper mesh (no processes needed)."""
    tokens = torch.randint(0, 256, (2, seq))
    ctx = CompileContext.for_plan(plan, "", Mesh.on_paper(tp=plan.tp, cp=plan.cp))
    gm = capture(model, (tokens, tokens), {}).gm
    for spec in FORWARD_PASSES:
        gm = run_pass(spec, gm, ctx)
    return gm


def test_tp_not_dividing_the_vocabulary():
    model = models.build_model(LLAMA, vocab_size=250, n_heads=2, n_kv_heads=2)
    with pytest.raises(mx.PlanError, match=r"tp=4 does not divide .*size 250.*embed.weight"
                                           r".*choose tp in \[1, 2, 5, 10"):
        forward_passes(model, mx.Plan(tp=4))


def test_tp_not_dividing_the_ffn_width():
    model = models.build_model(LLAMA, ffn_dim=90, n_heads=4, n_kv_heads=4)
    with pytest.raises(mx.PlanError, match=r"tp=4 does not divide .*size 90.*choose tp in "
                                           r"\[1, 2, 3, 5, 6, 9"):
        forward_passes(model, mx.Plan(tp=4))


def test_cp_needs_sequence_divisible_by_2cp():
    model = models.build_model(LLAMA)
    with pytest.raises(mx.PlanError, match=r"cp=2 needs the sequence length .* 6\) divisible "
                                           r"by 2\*cp = 4; choose cp in \[1, 3\]"):
        forward_passes(model, mx.Plan(cp=2), seq=6)


def test_sequence_parallel_leaves_no_all_reduce_in_llama_layers():
    """SP replaces each of Megatron's two all-reduces per layer by an all-gather before
    the column-parallel linears and a reduce-scatter after the row-parallel one."""
    cfg = dict(n_layers=2)
    graph = forward_passes(models.build_model(LLAMA, **cfg),
                           mx.Plan(tp=2, sequence_parallel=True)).graph
    count = {}
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "")
        count[name.split(".")[0]] = count.get(name.split(".")[0], 0) + 1
    assert count.get("sp_all_gather", 0) == 2 * 2 + 1  # per layer qkv, gate/up; + LM head
    assert count.get("sp_reduce_scatter", 0) == 2 * 2 + 1  # per layer wo, down; + embedding
    assert count.get("tp_all_reduce", 0) == 0
    assert count.get("tp_all_gather", 0) == 0  # no fallback gathers
    assert count.get("vocab_parallel_ce", 0) == 1  # the logits are never gathered


@pytest.mark.parametrize("plan", [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(cp=2)],
                         ids=["tp2", "tp2-sp", "cp2"])
def test_nanogpt_style_model(plan):
    """A model written in another style (fused q/k/v linear split in three, nn.Sequential
    MLP, tied head declared the other way round, ignore_index=-1)."""
    from tests.foreign_models import NanoGPT
    run_ranks(2, check_plan, NanoGPT, plan, 3, 8, 16)


class PaddedTiedLM(torch.nn.Module):
    """A tied embedding and LM head whose padding row (no gradient, as OPT's) is token 235:
    in tp rank 1's half of the vocabulary, and among the first batch's tokens."""

    def __init__(self, padding_idx: int = 235):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32, padding_idx=padding_idx)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, 256, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        logits = self.head(x + self.mlp(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("plan", [dict(tp=2), dict(tp=2, sequence_parallel=True)], ids=["tp2", "tp2-sp"])
def test_vocab_parallel_embedding_with_a_padding_row(plan):
    """The padding row lives on one rank: that rank's lookup skips its gradient, the other's
    has none (the lookup was left whole and read a split table before)."""
    run_ranks(2, check_plan, PaddedTiedLM, plan)


class ScanLM(torch.nn.Module):
    """A recurrence over the sequence written into slices of a buffer, as RWKV's CPU path
    and Mamba-style scans are: `out[:, t] = state` is an in-place write through a select
    along the dim that CP and SP shard."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.inner = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, tokens, targets):
        h = self.inner(self.embed(tokens))
        out = torch.zeros_like(h)
        state = torch.zeros_like(h[:, 0])
        for t in range(h.shape[1]):
            state = 0.5 * state + h[:, t]
            out[:, t] = state
        logits = self.head(out + h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("plan", [dict(cp=2), dict(tp=2, sequence_parallel=True)], ids=["cp2", "tp2-sp"])
def test_writes_into_slices_of_a_sequence_buffer(plan):
    """The buffer is kept whole (a gather before each select would take the writes into a
    copy: the output stayed zeros)."""
    run_ranks(2, check_plan, ScanLM, plan, 3, 4, 8)


def test_hf_style_llama_tp2_sequence_parallel_fused():
    """Llama written the Hugging Face way (tests/foreign_llama.py: heads transposed before RoPE,
    GQA repeat in [B, H, S, D], weight-first RMSNorm) under tp2 + SP with every fusion on."""
    from tests.foreign_llama import HFLlama
    run_ranks(2, check_plan, HFLlama, dict(tp=2, sequence_parallel=True, fusion=True), 2, 8, 16)


def _einsum_layouts(rank, world):
    from tests.passes.test_unit import Einsums
    for plan in (dict(cp=2), dict(tp=2, sequence_parallel=True)):
        torch.manual_seed(0)
        model = Einsums()
        reference = copy.deepcopy(model)
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
        loss = mx.compile(model, mx.Plan(strict_sharding=True, **plan))(x)
        expected = reference(x)
        expected.backward()
        assert rel_err(loss, expected.detach()) <= 1e-5, plan
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            assert rel_err(p.grad, q.grad) <= 1e-4, f"{plan} {name}"


def test_einsum_projections_on_token_shards():
    """A model written with einsum equations (passes/sharding/einsum.py) under cp=2 and
    tp=2 + SP, strict: loss 1e-5, gradients 1e-4 relative against eager."""
    run_ranks(2, _einsum_layouts)
