"""Context parallelism: the sequence split over the CP group, by sharding propagation.

Every input of the step with two or more dims ([batch, seq, ...]) is cut along dim 1 into
2*cp chunks inside the graph (`cp_chunk`: rank r keeps chunks r and 2*cp-1-r, which
balances causal attention). The placement of a value is R (replicated) or (dim, outer):
sharded along `dim`, whose `outer` leading factor comes from dims merged in front of the
sequence by a view ([b, s] -> [b*s] gives (0, b)). Rules keyed by op:

- per-token ops keep the shard: pointwise (replicated tensors with a sequence dim, like
  RoPE tables, are cut the same way), linear, embedding, norms and reductions over other
  dims, views, transposes, splits/cats along other dims;
- attention all-gathers K and V (`cp_all_gather`, backward reduce-scatter) and masks by
  the positions of this rank's chunks, so causal attention stays exact;
- a sum/mean over the sequence and the mean cross-entropy add up local sums with
  `cp_all_reduce`;
- anything else all-gathers its inputs (correct, slower; tagged "gathers").

Gradient convention: a replicated value carries a partial gradient on each rank, so the
replicated outputs (the loss) go through `cp_replicated` (backward / cp) and the
parameters' gradients are summed over the CP group by the runtime, in the same bucket
collectives as the data-parallel average (group dp x cp: `runtime/data_parallel.py`). Numerics: equal to the unsharded graph up to summation order.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule, Node

import mxgraph.runtime.collectives_cp  # noqa: F401 - registers the ops
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import SHAPE_OPS, VIEW_OPS, insert_call
from mxgraph.passes.shard_tp import KEEP_OPS, SPLIT_OPS, add_tag, propagate, repropagate, view_group
from mxgraph.plan import divisors

aten = torch.ops.aten
mx = torch.ops.mxgraph
R = None
TOKEN_OPS = {aten.linear.default, aten.layer_norm.default, aten.rms_norm.default}


class _ContextSharder:
    def __init__(self, gm: GraphModule, ctx: CompileContext):
        self.gm, self.graph = gm, gm.graph
        self.cp = ctx.mesh.sizes["cp"]
        self.group = ctx.mesh.group_name("cp")
        self.place: dict[Node, tuple[int, int] | None] = {}

    def new(self, before: Node, target, args, kwargs=None, val=None) -> Node:
        """`target(*args, **kwargs)` before `before`, with its provenance; `val` (rules read
        full, unsharded, shapes) or no fake value until the pass re-propagates."""
        return insert_call(self.graph, target, args, kwargs, before=before, like=before, val=val)

    def full(self, node: Node) -> list[int]:
        return list(node.meta["val"].shape)

    # ---- inputs and redistribution ---------------------------------------------------
    def cut_inputs(self) -> None:
        for node in self.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if node.meta.get("mx_slot_kind") != "input" or not isinstance(val, torch.Tensor) \
                    or val.dim() < 2:
                continue
            seq = val.shape[1]
            if seq % (2 * self.cp):
                raise PlanError(
                    f"cp={self.cp} needs the sequence length (dim 1 of input "
                    f"{node.meta.get('mx_slot_key')}, {seq}) divisible by 2*cp = "
                    f"{2 * self.cp}; choose cp in "
                    f"{[c for c in divisors(seq) if seq % (2 * c) == 0]} or pad the sequence")
            first = next(iter(node.users), None)
            if first is None:
                continue
            cut = self.new(first, mx.cp_chunk.default, (node, 1, self.group), val=val)
            node.replace_all_uses_with(cut, delete_user_cb=lambda u: u is not cut)
            self.place[cut] = (1, 1)

    def chunk(self, value: Node, dim: int, user: Node) -> Node:
        return self.new(user, mx.cp_chunk.default, (value, dim, self.group),
                        val=value.meta["val"])

    def gather(self, value: Node, user: Node) -> Node:
        dim, outer = self.place[value]
        full = self.full(value)
        if outer == 1:
            out = self.new(user, mx.cp_all_gather.default, (value, dim, self.group),
                           val=value.meta["val"])
        else:  # split the merged dim, gather its sequence part, merge back
            local = list(full)
            local[dim] //= self.cp
            split = local[:dim] + [outer, local[dim] // outer] + local[dim + 1:]
            view = self.new(user, aten.reshape.default, (value, split))
            gathered = self.new(user, mx.cp_all_gather.default, (view, dim + 1, self.group))
            out = self.new(user, aten.reshape.default, (gathered, full), val=value.meta["val"])
        self.place[out] = R
        return out

    def gather_all(self, node: Node) -> None:
        for arg in list(node.all_input_nodes):
            if self.place.get(arg, R) is not R:
                node.replace_input_with(arg, self.gather(arg, node))
        add_tag(node, "gathers")

    # ---- rules ------------------------------------------------------------------------
    def pointwise(self, node: Node):
        out_ndim = node.meta["val"].dim()
        tensors = [a for a in node.all_input_nodes
                   if isinstance(a.meta.get("val"), torch.Tensor)]
        placed = {(out_ndim - a.meta["val"].dim() + self.place[a][0], self.place[a][1])
                  for a in tensors if self.place.get(a, R) is not R}
        if len(placed) != 1:
            self.gather_all(node)
            return R
        out_dim, outer = placed.pop()
        for arg in tensors:
            if self.place.get(arg, R) is not R:
                continue
            arg_dim = out_dim - (out_ndim - arg.meta["val"].dim())
            if arg_dim >= 0 and arg.meta["val"].shape[arg_dim] != 1:
                if outer != 1:
                    self.gather_all(node)
                    return R
                node.replace_input_with(arg, self.chunk(arg, arg_dim, node))
        return out_dim, outer

    def keep(self, node: Node):
        return self.place.get(node.args[0], R)

    def linear_like(self, node: Node):
        dim, outer = self.place[node.args[0]]
        ndim = node.args[0].meta["val"].dim()
        normalized = len(node.args[1]) if node.target is not aten.linear.default else 1
        if dim >= ndim - normalized or any(self.place.get(a, R) is not R
                                           for a in node.all_input_nodes[1:]):
            self.gather_all(node)
            return R
        return dim, outer

    def embedding(self, node: Node):
        weight, indices = node.args[:2]
        if self.place.get(weight, R) is not R:
            self.gather_all(node)
            return R
        return self.place[indices]

    def view(self, node: Node):
        x = node.args[0]
        dim, outer = self.place[x]
        full_in = self.full(x)
        full_out = list(node.args[1])
        if -1 in full_out:
            known = math.prod(s for s in full_out if s != -1)
            full_out[full_out.index(-1)] = math.prod(full_in) // known
        mapped = _map_view(full_in, full_out, dim, outer)
        if mapped is None:
            self.gather_all(node)
            return R
        out_dim, out_outer = mapped
        local = list(full_out)
        local[out_dim] //= self.cp
        node.args = (x, local) + tuple(node.args[2:])
        return out_dim, out_outer

    def permute(self, node: Node):
        x = node.args[0]
        dim, outer = self.place[x]
        ndim = x.meta["val"].dim()
        if node.target is aten.transpose.int:
            a, b = (d % ndim for d in node.args[1:3])
            return (b if dim == a else a if dim == b else dim), outer
        if node.target is aten.t.default:
            return 1 - dim, outer
        return [d % ndim for d in node.args[1]].index(dim), outer

    def unsqueeze(self, node: Node):
        dim, outer = self.place[node.args[0]]
        new = node.args[1] % node.meta["val"].dim()
        return (dim + 1 if new <= dim else dim), outer

    def expand(self, node: Node):
        x, sizes = node.args[0], list(node.args[1])
        dim, outer = self.place[x]
        out_dim = dim + len(sizes) - x.meta["val"].dim()
        if sizes[out_dim] != -1:
            sizes[out_dim] //= self.cp
        node.args = (x, sizes) + tuple(node.args[2:])
        return out_dim, outer

    def along_other_dim(self, node: Node):
        """slice/select/split/chunk/unbind/cat: fine unless along the sharded dim."""
        x = node.args[0][0] if node.target is aten.cat.default else node.args[0]
        place = self.place.get(x, R)
        ndim = x.meta["val"].dim()
        default = 1 if node.target in (aten.slice.Tensor, aten.select.int) else 0
        position = 2 if node.target in (aten.split.Tensor, aten.split_with_sizes.default,
                                        aten.chunk.default) else 1
        along = node.args[position] if len(node.args) > position else \
            node.kwargs.get("dim", default)
        along %= ndim
        inputs = node.args[0] if node.target is aten.cat.default else [x]
        if place is R or along == place[0] or any(self.place.get(t, R) != place
                                                  for t in inputs):
            self.gather_all(node)
            return R
        dim, outer = place
        dropped = node.target in (aten.select.int, aten.unbind.int) and along < dim
        return (dim - 1 if dropped else dim), outer

    def reduction(self, node: Node):
        x = node.args[0]
        dim, outer = self.place[x]
        ndim = x.meta["val"].dim()
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        dims = set(range(ndim)) if not dims else {d % ndim for d in (
            [dims] if isinstance(dims, int) else dims)}
        if dim not in dims:
            return (dim if keepdim else dim - sum(d < dim for d in dims)), outer
        if node.target not in (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default):
            self.gather_all(node)
            return R
        return self.sum_over_group(node, dims)

    def sum_over_group(self, node: Node, dims: set[int]):
        """sum -> local sum + cp_all_reduce; mean -> the same divided by the full count."""
        mean = node.target is aten.mean.dim
        if mean:
            node.target = aten.sum.dim_IntList
        full = self.full(node.args[0])
        total = insert_call(self.graph, mx.cp_all_reduce.default, (node, self.group),
                            after=node, like=node, val=node.meta["val"])
        result = total
        if mean:
            result = insert_call(self.graph, aten.div.Tensor,
                                 (total, math.prod(full[d] for d in dims)), after=total,
                                 like=node, val=node.meta["val"])
        node.replace_all_uses_with(result, delete_user_cb=lambda u: u not in (total, result))
        self.place[total] = self.place[result] = R
        return R

    def attention(self, node: Node):
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        seq_dim = q.meta["val"].dim() - 2
        if mask is not None or any(self.place.get(t, R) != (seq_dim, 1) for t in (q, k, v)):
            self.gather_all(node)
            return R
        keys = [self.gather_early(t, node) for t in (k, v)]
        kwargs = {key: val for key, val in node.kwargs.items()
                  if key not in ("attn_mask", "dropout_p", "is_causal")}
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        mask = self.causal_mask(q, node) if causal else None
        node.args = (q, keys[0], keys[1], mask, dropout, False)
        node.kwargs = kwargs
        return seq_dim, 1

    def gather_early(self, value: Node, user: Node) -> Node:
        """Gather K or V for attention where it is smallest: before the shape-only ops
        that lead to `user` (e.g. before a GQA repeat by expand + reshape, so the KV
        heads move, not the query heads); those ops then see full shapes again."""
        chain = [value]  # from the attention input back towards its source
        while (chain[-1].op == "call_function" and chain[-1].target in SHAPE_OPS
               and len(chain[-1].users) == 1
               and self.place.get(chain[-1].args[0], R) is not R):
            chain.append(chain[-1].args[0])
        best = min(range(len(chain)), key=lambda i: (chain[i].meta["val"].numel(), i))
        if best == 0:
            return self.gather(value, user)
        consumer = chain[best - 1]
        consumer.replace_input_with(chain[best], self.gather(chain[best], consumer))
        for node in reversed(chain[:best]):  # back to full shapes, replicated
            if node.target in VIEW_OPS or node.target is aten.expand.default:
                node.args = (node.args[0], list(node.meta["val"].shape)) + node.args[2:]
            self.place[node] = R
        return value

    def causal_mask(self, q: Node, user: Node) -> Node:
        """[s/cp, s] bool: query at this rank's position i sees keys at positions <= i."""
        seq = self.full(q)[-2]
        device = q.meta["val"].device
        positions = self.new(user, aten.arange.default, (seq,),
                             {"dtype": torch.int64, "device": device})
        mine = self.new(user, mx.cp_chunk.default, (positions, 0, self.group))
        rows = self.new(user, aten.unsqueeze.default, (mine, 1))
        return self.new(user, aten.ge.Tensor, (rows, positions))

    def cross_entropy(self, node: Node):
        logits, target = node.args[:2]
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        place = self.place.get(logits, R)
        if place is R or place[0] != 0 or self.place.get(target, R) != place:
            self.gather_all(node)
            return R
        if reduction == 0:
            return place
        args = list(node.args) + [None] * (4 - len(node.args))
        args[3] = 2  # sum
        node.args = tuple(args[:4]) + tuple(node.args[4:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "reduction"}
        total = insert_call(self.graph, mx.cp_all_reduce.default, (node, self.group),
                            after=node, like=node, val=node.meta["val"])
        result = total
        if reduction == 1:
            counted = self.new(total, aten.ne.Scalar, (target, ignore))
            count = self.new(total, aten.sum.default, (counted,))
            count_all = self.new(total, mx.cp_all_reduce.default, (count, self.group))
            result = insert_call(self.graph, aten.div.Tensor, (total, count_all), after=total,
                                 like=node, val=node.meta["val"])
        node.replace_all_uses_with(result, delete_user_cb=lambda u: u not in (total, result))
        self.place[total] = self.place[result] = R
        return R

    def rule(self, node: Node):
        target = node.target
        if target in VIEW_OPS:
            return self.view
        if target in (aten.transpose.int, aten.permute.default, aten.t.default):
            return self.permute
        if target is aten.unsqueeze.default:
            return self.unsqueeze
        if target is aten.expand.default:
            return self.expand
        if target in SPLIT_OPS or target in (aten.slice.Tensor, aten.select.int, aten.cat.default):
            return self.along_other_dim
        if target is operator.getitem:
            return self.keep
        if target in TOKEN_OPS:
            return self.linear_like
        if target is aten.embedding.default:
            return self.embedding
        if target in (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.amax.default):
            return self.reduction
        if target is aten.scaled_dot_product_attention.default:
            return self.attention
        if target is aten.cross_entropy_loss.default:
            return self.cross_entropy
        if target in KEEP_OPS:
            return self.keep
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            return self.pointwise
        return None

    def run(self) -> None:
        self.cut_inputs()
        propagate(self)
        output = self.graph.find_nodes(op="output")[0]
        for value in output.all_input_nodes:
            if self.place.get(value, R) is not R:
                value = self.gather(value, output)
            if isinstance(value.meta.get("val"), torch.Tensor) and \
                    value.meta["val"].is_floating_point():
                replicated = self.new(output, mx.cp_replicated.default, (value, self.group))
                output.replace_input_with(value, replicated)


def _map_view(full_in, full_out, dim, outer):
    """(output dim, outer) carrying a sequence shard through a view, or None.

    Same groups as shard_tp's (`view_group`): dims merged in front of the sequence
    multiply `outer`; a merged dim split back must give the sequence its own last dim of
    the group."""
    group = view_group(full_in, full_out, dim)
    if group is None:
        return None
    gi, gj = group
    if gi[-1] != dim:  # dims merged after the sequence: not a run of tokens
        return None
    new_outer = outer * math.prod(full_in[d] for d in gi[:-1])
    if len(gj) == 1:
        return gj[0], new_outer
    lead = math.prod(full_out[d] for d in gj[:-1])
    return (gj[-1], 1) if lead == new_outer else None


def shard_cp_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Shard the forward graph's sequence over the CP group (see module docstring).

    Precondition: placeholders carry meta["mx_slot_kind"]; inputs are [batch, seq, ...].
    Guarantee: the graph takes the full inputs and cuts them itself; parameters are
    unchanged (their gradients are partial sums the runtime adds over the CP group);
    every node's meta["val"] is re-propagated. Returns `gm` unchanged when cp == 1.
    """
    if ctx.mesh is None or ctx.mesh.sizes["cp"] == 1:
        return gm
    _ContextSharder(gm, ctx).run()
    return repropagate(gm, {})
