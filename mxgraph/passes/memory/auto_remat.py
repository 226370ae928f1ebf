"""Auto remat: under Inductor codegen, recompute in the backward what torch.compile would.

torch.compile splits its joint graph with the min-cut partitioner, which saves for the
backward the fewest bytes it can and recomputes the cheap, fusible values between them
(a norm's fp32 upcast, an activation, a rotary embedding) inside the backward's kernels.
mxgraph's joint graph otherwise saves what eager autograd saves: on an H200, llama-1b's
4-layer step at 8 x 2048 tokens held 12.2 GB at its peak under mx.compile, as eager did,
against torch.compile's 5.4 GB.

`auto_remat_pass(gm, ctx)`: for a plan with no memory policy of its own (`recompute`,
`recompute_stages`, `memory_budget`, `offload`) whose programs Inductor lowers, the
min-cut partitioner runs on a copy of the joint graph as an oracle. Every forward ATen
value it does not save becomes part of the recompute set of `remat.apply_remat`, which
clones each chain the backward reads right before its first backward use. Collectives,
mxgraph's own ops and random ops are never cloned (they stay saved).

First, as torch.compile decomposes its joint graph before partitioning it, softmax,
log-softmax, layer norm and the NLL loss, forward and backward, are decomposed into the
ops Inductor would lower them to (`decompose_saved`). Whole, the partitioner may not
recompute them, and a loss's fp32 log-softmax over the vocabulary (llama-1b's 32000
words at 8 x 2048 tokens: 2.1 GB) stayed saved; decomposed, it saves the bf16 logits and two values a row, and the
backward's kernel recomputes the rest. Numerics: bitwise the same as the decomposed
graph without the recompute (the same ops on the same inputs); Inductor lowers the
decomposed ops as it lowers the whole ones. A concatenation of one tensor with itself (a
rotary embedding's angles) is decomposed as Inductor does (a copy of an expanded view),
so that it is recomputed from the inverse frequencies, not saved.

Then forward ops that repeat an earlier one are merged into it (`merge_duplicates`), as
the partitioner's CSE merges them on its copy: its saved names are those of the
survivors, and a repeat left in place (the reshape of a normed input that each of a
layer's projections makes) would be recomputed in the backward, the norm with it, written
out for the weight gradient's matmul: hf-llama-20m's backward (12 layers) ran 97 kernels
where torch.compile's runs 75, as it does with the merge.

The pass's record gives the saved bytes before and after; a graph the partitioner cannot
take is left as it is (decomposed and merged), with the reason.
Off under Python codegen, where a recomputed op is one more kernel and fuses with nothing.
"""
from __future__ import annotations

import contextlib
import copy
import operator
import warnings

import torch
from torch._decomp import get_decompositions
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from mxgraph.context import CompileContext
from mxgraph.ir import graph_device, is_backward, is_random
from mxgraph.memory_saved import boundary, estimate_saved
from mxgraph.passes.memory.remat import apply_remat

PURE_NAMESPACES = ("aten", "prims")
"""Ops that may be cloned into the backward: functional ATen and prims ops."""

aten = torch.ops.aten
DECOMPOSED = (aten._log_softmax.default, aten._softmax.default, aten.native_layer_norm.default,
              aten._log_softmax_backward_data.default, aten._softmax_backward_data.default,
              aten.native_layer_norm_backward.default, aten.nll_loss_forward.default,
              aten.nll_loss_backward.default)
"""Ops decomposed before the partitioner runs. It may not recompute a forward one whole
(not on its list), nor a value a backward one reads whole (that must be materialized);
their decompositions are row reductions and pointwise ops it may."""

UNINITIALISED = (aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty)
"""Allocations whose contents are undefined: never merged (nor by `fx_graph_cse`)."""


def auto_remat_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Recompute what the min-cut partitioner would (see the module docstring)."""
    plan = ctx.plan
    if plan.recompute or plan.recompute_stages or plan.memory_budget is not None or \
            plan.offload or boundary(gm) is None:
        return gm
    device = graph_device(gm)
    if device is None or not lowered_by_inductor(plan, device.type):
        return gm
    before = estimate_saved(gm).device_bytes
    decomposed = decompose_saved(gm, ctx.findings)
    merged = merge_duplicates(gm)
    try:
        saved = min_cut_saved(gm)
    except Exception as error:  # noqa: BLE001 - an optimisation: report and keep the graph
        ctx.findings.append(f"auto remat skipped: the min-cut partitioner refused the joint "
                            f"graph ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
        return gm
    nodes = {n for n in gm.graph.nodes if _clonable(n) and n.name not in saved}
    clones = apply_remat(gm, nodes)
    after = estimate_saved(gm).device_bytes
    ctx.findings.append(f"auto remat: {decomposed} ops decomposed, {merged} duplicate forward "
                        f"ops merged, {clones} values recomputed in the backward; saved "
                        f"activations {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    return gm


def lowered_by_inductor(plan, device_type: str) -> bool:
    """Whether the plan's programs on a `device_type` device are Inductor's to lower (the
    pass's one reason to run; tests of the joint graph alone patch it to skip the lowering)."""
    return plan.codegen_for(device_type) == "inductor"


def decompose_saved(gm: GraphModule, findings: list | None = None) -> int:
    """Decompose each op of DECOMPOSED in place with torch's decompositions (traced on
    its fake values), and each concatenation of one tensor with itself with Inductor's
    (`_repeated_cat`); returns how many. One whose trace fails stays whole, named in
    `findings`."""
    from torch._inductor.decomposition import select_decomp_table
    table = {**get_decompositions(list(DECOMPOSED)),
             aten.cat.default: select_decomp_table()[aten.cat.default]}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and (node.target in DECOMPOSED or _repeated_cat(node)):
            try:
                _decompose(gm, node, table)
            except Exception as error:  # noqa: BLE001 - the op stays whole: only less saved
                if findings is not None:
                    findings.append(f"auto remat: {node.name} ({node.target}) kept whole: "
                                    f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _repeated_cat(node: Node) -> bool:
    """A concatenation of one tensor with itself (a rotary embedding's `cat((freqs, freqs))`).
    Inductor decomposes it, as torch.compile's joint graph has it, into a copy of an expanded
    view, which the partitioner may recompute; whole (a cat is not on its list), it stayed
    saved: the [1, seq, head_dim] angles, in place of the inverse frequencies."""
    if node.target is not aten.cat.default or not isinstance(node.args[0], (list, tuple)):
        return False
    tensors = node.args[0]
    return len(tensors) > 1 and isinstance(tensors[0], Node) and \
        all(t is tensors[0] for t in tensors)


def _decompose(gm: GraphModule, node: Node, table: dict) -> None:
    inputs = node.all_input_nodes
    values = [n.meta["val"] for n in inputs]

    def call(*tensors):
        env = dict(zip(inputs, tensors, strict=True))
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), env.__getitem__)
        return node.target(*args, **kwargs)

    fake_mode = detect_fake_mode(values)
    with fake_mode or contextlib.nullcontext():
        traced = make_fx(call, decomposition_table=table)(*values)
    env = dict(zip(traced.graph.find_nodes(op="placeholder"), inputs, strict=True))
    with gm.graph.inserting_before(node):
        result = gm.graph.graph_copy(traced.graph, env)
    inherited = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    for new in traced.graph.nodes:  # graph_copy maps each copied node to its copy in `env`
        if new.op not in ("placeholder", "output"):
            copy_ = env[new]
            for key, value in inherited.items():
                copy_.meta.setdefault(key, value)
            copy_.meta["decomposed_from"] = node.name  # one kernel under Inductor
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    gm.graph.erase_node(node)


def merge_duplicates(gm: GraphModule) -> int:
    """Merge each forward op that repeats an earlier one (the same clonable op on the same
    inputs and arguments) into that one, in place; returns how many. The min-cut
    partitioner does the same on its copy (`fx_graph_cse`) and names only the survivor of
    each set: a duplicate left here would be missing from its saved names and recomputed
    in the backward (a linear layer's reshape of a normed input, one per projection: the
    norm then ran again in the backward, its output written out for the weight gradient's
    matmul). Numerics: bitwise the same (one op on the same inputs instead of two). A
    graph output, a random op and an uninitialised allocation are never merged."""
    (output,) = gm.graph.find_nodes(op="output")
    outputs = set(output.all_input_nodes)
    seen: dict[tuple, Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if not _clonable(node) or node in outputs or is_random(node) or \
                getattr(node.target, "overloadpacket", None) in UNINITIALISED:
            continue
        try:
            key = (node.target, _frozen(node.args), _frozen(node.kwargs))
            first = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument (a symbolic size): left alone
            continue
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _frozen(value):
    """A hashable form of an op's arguments; the type is kept (1, 1.0 and True differ), and
    a float by its text (0.0 and -0.0 differ)."""
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return dict, tuple((k, _frozen(v)) for k, v in sorted(value.items()))
    if isinstance(value, float):
        return float, repr(value)
    hash(value)
    return type(value), value


def min_cut_saved(gm: GraphModule) -> set[str]:
    """Names of the joint graph's nodes the min-cut partitioner saves for the backward."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    with warnings.catch_warnings():  # deepcopy of the module's pytree specs warns
        warnings.simplefilter("ignore", FutureWarning)
        joint = copy.deepcopy(gm)
    count = num_forward_outputs(gm)
    forward, _ = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=count)
    (output,) = forward.graph.find_nodes(op="output")
    return {o.name for o in output.args[0][count:] if isinstance(o, Node)}


def num_forward_outputs(gm: GraphModule) -> int:
    """The joint graph's forward outputs: those before its first gradient (AOTAutograd
    puts the forward's outputs first; each gradient is a backward node or None)."""
    (output,) = gm.graph.find_nodes(op="output")
    count = 0
    for value in output.args[0]:
        if not isinstance(value, Node) or is_backward(value):
            break
        count += 1
    return count


def _clonable(node: Node) -> bool:
    """A forward node a backward may recompute: a functional ATen op or a getitem of one."""
    if node.op != "call_function" or is_backward(node):
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _clonable(node.args[0])
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in PURE_NAMESPACES \
        and not target._schema.is_mutable
