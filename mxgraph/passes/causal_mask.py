"""A causal mask computed from shapes alone becomes SDPA's `is_causal=True`.

Hugging Face's models build their attention mask in the forward. Run eagerly, with no
padding mask, they skip it and call SDPA with `is_causal=True`; traced by torch.export
(mxgraph's capture) they cannot know the traced length is the one they will see again, so
they build the mask: a `[b, 1, s, s]` tensor from `arange`s and a comparison, handed to
every layer's SDPA. That mask costs memory and time, keeps SDPA off its flash kernels, and
hides the causal structure from the passes after this one (the fused GQA attention, context
parallelism's causal split, the cost model's halved FLOPs).

mxgraph compiles for one input signature, so the traced length is the length. Each SDPA
whose `attn_mask` reads no graph input (no placeholder among its ancestors, no random op) is
evaluated here, on the CPU; where it equals the lower triangle of ones over the
queries x keys (a bool mask, or a float mask of 0 and -inf / the dtype's lowest value),
broadcast over the batch and the heads, and the query and key lengths are equal, the call
becomes `is_causal=True` without a mask, and the mask's ops are dropped when nothing else
reads them. A padding mask (it reads the input's `attention_mask`), a sliding window or
any other pattern stays as it is. So does a mask of over `MAX_ELEMENTS` elements (its
evaluation here would cost more than it saves): recorded in the pass's findings.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from mxgraph.context import CompileContext
from mxgraph.ir import ancestors, is_random, schema_arg

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default

MAX_ELEMENTS = 2**27
"""The largest mask evaluated (elements, before broadcasting over batch and heads)."""


def causal_mask_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Rewrite each SDPA whose mask is the causal one to `is_causal=True` (module text)."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    causal: dict[tuple[Node, int], bool] = {}  # a mask every layer reads: evaluated once
    masks: list[Node] = []
    for node in list(gm.graph.find_nodes(op="call_function", target=_SDPA)):
        mask = schema_arg(node, "attn_mask")
        if not isinstance(mask, Node) or schema_arg(node, "is_causal", False):
            continue
        q_len, k_len = (_shape(a)[-2] for a in node.args[:2])
        if q_len != k_len:
            continue
        if (mask, q_len) not in causal:
            value = _evaluate(mask, position, ctx)
            causal[mask, q_len] = value is not None and _is_causal(value, q_len)
        if not causal[mask, q_len]:
            continue
        node.args = tuple(node.args[:3])
        node.kwargs = {"dropout_p": schema_arg(node, "dropout_p", 0.0), "is_causal": True,
                       **{key: schema_arg(node, key) for key in ("scale", "enable_gqa")
                          if schema_arg(node, key) not in (None, False)}}
        masks.append(mask)
    if masks:
        # the masks' ops nothing reads any more, last first (ATen ops without side effects:
        # `_evaluate` ran them)
        computed = ancestors(masks)
        for node in reversed(list(gm.graph.nodes)):
            if node in computed and not node.users:
                gm.graph.erase_node(node)
        gm.recompile()
    return gm


def _shape(node) -> tuple:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else (None, None)


def _evaluate(mask: Node, position: dict[Node, int],
              ctx: CompileContext) -> torch.Tensor | None:
    """The mask's value, computed on the CPU from its ancestors (run in graph order,
    `position`); None where it reads a graph input, a random op or anything but ATen ops,
    or is too large."""
    nodes = sorted(ancestors([mask]), key=position.__getitem__)
    if any(n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload)
           or is_random(n) for n in nodes):
        return None
    value = mask.meta.get("val")
    if not isinstance(value, torch.Tensor) or max(
            _unbroadcast_numel(n) for n in nodes) > MAX_ELEMENTS:
        ctx.findings.append(
            f"causal_mask: {mask.name}: an attention mask of shape "
            f"{tuple(value.shape) if isinstance(value, torch.Tensor) else '?'} was not "
            "evaluated (too large or unknown); SDPA keeps it")
        return None
    env: dict[Node, object] = {}

    def on_cpu(arg):
        return torch.device("cpu") if isinstance(arg, torch.device) else arg
    try:
        for node in nodes:
            args = map_arg(node.args, env.__getitem__)
            kwargs = {k: on_cpu(v) for k, v in map_arg(node.kwargs, env.__getitem__).items()}
            env[node] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not a mask this pass can read: SDPA keeps it
        return None
    out = env[mask]
    return out if isinstance(out, torch.Tensor) else None


def _unbroadcast_numel(node: Node) -> int:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    return int(torch.Size([s for s, st in zip(value.shape, value.stride(), strict=True)
                           if st != 0]).numel())


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """`mask` (broadcastable to [..., length, length]) keeps exactly the lower triangle."""
    if mask.ndim < 2 or mask.shape[-2:] != (length, length):
        return False
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        kept = mask
    elif mask.is_floating_point():
        lowest = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= lowest)).all()):
            return False
        kept = mask == 0
    else:
        return False
    return bool((kept == lower).all())


__all__ = ["MAX_ELEMENTS", "causal_mask_pass"]
