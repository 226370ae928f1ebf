"""Key/value heads repeated for grouped-query attention become SDPA's own `enable_gqa=True`.

A model with fewer key/value heads than query heads repeats each K/V head for its group of
query heads before attention (Hugging Face's `repeat_kv`: an expand and a reshape; or a
`repeat_interleave`). Run eagerly with no mask, a Hugging Face model skips the repeat and asks
SDPA to read the shared heads itself (`enable_gqa=True`); traced by torch.export it builds a
mask, so the repeat is traced, and it stays after the causal_mask pass has turned the mask
back into `is_causal`. The repeat costs a copy of K and of V per layer in the forward, and in
the backward a sum of each group's repeated gradients, where SDPA's kernels read the shared
heads in place and accumulate their gradients as they go.

Each SDPA without a mask or dropout whose K and V are both repeats of their heads by the
same factor (through transposes/permutes that bring the head dim to dim 1: `repeated_kv`,
the Repeat-GQA fusion's matcher) reads the un-repeated K and V with `enable_gqa=True`; the
repeats are dropped when nothing else reads them. The forward is bitwise the same; the K/V
gradients are summed in another order (about 1 ulp).

When: only where the plan's programs are Inductor's to lower (`Plan.codegen_for`), as
torch.compile lowers a Hugging Face model that asks SDPA for shared heads; Python codegen
keeps the model's own ops, so its results stay those of the eager model.

Where: on the CPU (its flash kernel takes shared heads), and elsewhere for fp16/bf16 with a
head dim of at most 256 (on CUDA only the flash and math kernels take `enable_gqa`; fp32 would
fall to the math kernel): other calls keep their repeat, recorded in the pass's findings.
The fusion pass runs first, so with the `gqa` fusion kind on, its fused kernel takes these
calls instead.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from mxgraph.context import CompileContext
from mxgraph.ir import graph_device, insert_call, schema_arg
from mxgraph.passes.fusion.attention import repeated_kv
from mxgraph.passes.fusion.rewriter import erase_dead, shape

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
"""The largest head dim rewritten off the CPU (CUDA's flash kernels)."""


def native_gqa_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Hand each repeated K/V of a plain SDPA to SDPA's `enable_gqa=True` (module text)."""
    device = graph_device(gm)
    if device is None or ctx.plan.codegen_for(device.type) != "inductor":
        return gm
    dropped: list[Node] = []
    kept = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=_SDPA)):
        found = _repeats(node)
        if found is None:
            continue
        if not sdpa_takes_gqa(*(a.meta["val"] for a in node.args[:3])):
            kept += 1
            continue
        kv = []
        for base, layout, nodes in found:
            x = base
            for op in layout:
                x = insert_call(gm.graph, op.target, (x, *op.args[1:]), before=node, like=op)
            kv.append(x)
            dropped += nodes
        kwargs = {"dropout_p": 0.0, "is_causal": bool(schema_arg(node, "is_causal", False)),
                  "enable_gqa": True}
        if schema_arg(node, "scale") is not None:
            kwargs["scale"] = schema_arg(node, "scale")
        node.args = (node.args[0], *kv)
        node.kwargs = kwargs
    if kept:
        ctx.findings.append(
            f"native_gqa: {kept} attention call(s) keep their repeated K/V heads: off the CPU "
            f"SDPA reads shared heads in its flash kernel only (fp16/bf16, head dim <= {MAX_HEAD_DIM})")
    if dropped:
        erase_dead(gm.graph, dropped)
        gm.recompile()
    return gm


def _repeats(node: Node):
    """[(base, layout ops, repeat nodes)] for K and V when `node` is a maskless, dropout-free
    SDPA on [B, H, S, D] whose K and V repeat their heads by one factor; else None."""
    if schema_arg(node, "attn_mask") is not None or schema_arg(node, "dropout_p", 0.0) != 0.0 \
            or schema_arg(node, "enable_gqa", False):
        return None
    q, k, v = node.args[:3]
    if len(shape(q) or ()) != 4 or shape(q)[:2] != shape(k)[:2] or shape(k) != shape(v):
        return None
    found = repeated_kv(k, v)
    if found is None:
        return None
    return [(base, layout, nodes) for base, _, _, layout, nodes in found]


def sdpa_takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA's kernel for these (fake or real) query, key and value tensors' device
    and dtype reads shared K/V heads without falling to a slower kernel."""
    if q.device.type == "cpu":
        return True
    return q.dtype in _FLASH_DTYPES and k.shape[-1] == v.shape[-1] <= MAX_HEAD_DIM
