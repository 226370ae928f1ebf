"""Tensor parallelism by sharding propagation on the forward graph.

Every tensor value gets a placement: R (replicated) or S(d) (sharded along dim d over
the TP group). Nodes are visited in order and a rule keyed by op decides the output
placement from the inputs', inserting redistributions (differentiable collectives from
`mxgraph.runtime.collectives`) where producer and consumer disagree.

Parameter placements are chosen by the Megatron default, found from structure alone:
a linear whose input is replicated gets its weight sharded by output rows (column
parallel: S(0)), so its output is sharded on the last dim; a linear whose input is
sharded on the last dim gets its weight sharded by input columns (row parallel: S(1)),
its partial output is all-reduced, and its bias added after. Embedding and cross-entropy
are vocabulary-parallel (`shard_vocab.py`). Views, transposes,
expands, pointwise ops, attention over heads and norms over unsharded dims keep the
shard; anything else gathers its inputs first (correct, slower) — `gathers` in the
node table shows where. A parameter read other than as a linear weight (or an embedding
table) stays replicated.

Sequence parallelism (`Plan(sequence_parallel=True)`, Megatron-LM's SP): activations
[..., s, h] between a row-parallel linear and the next column-parallel one are sharded
along the sequence (the dim before the last): the row-parallel output is reduce-scattered
along it instead of all-reduced, norms, dropout and residual adds run on the sequence
shard, and the column-parallel input is all-gathered (backward: reduce-scatter). Replicated
parameters read in that region (norm weights, biases) get their gradient summed over the
group by a `tp_copy`. Numerics: equal up to all-reduce summation order.
"""
from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import mxgraph.runtime.collectives  # noqa: F401 - registers the collective ops
import mxgraph.runtime.collectives_cp  # noqa: F401 - registers the CP ops
from mxgraph.capture import set_parameter
from mxgraph.context import CompileContext
from mxgraph.errors import PlanError
from mxgraph.ir import COPY_LIKE_OPS, VIEW_OPS, insert_call
from mxgraph.passes import shard_vocab
from mxgraph.plan import divisors

aten = torch.ops.aten
mx = torch.ops.mxgraph
R = None  # placement: replicated; an int d means sharded along dim d

DROPOUT_OPS = {aten.dropout.default, aten.native_dropout.default}  # random, but per element
KEEP_OPS = COPY_LIKE_OPS | {aten.type_as.default} | DROPOUT_OPS
"""Ops whose output keeps the placement of their first input."""
REDUCTION_OPS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
                 aten.var.correction, aten.logsumexp.default}
CP_OPS = {mx.cp_chunk.default, mx.cp_all_gather.default, mx.cp_all_reduce.default,
          mx.cp_replicated.default}
SPLIT_OPS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default,
             aten.unbind.int}


class _Sharder:
    def __init__(self, gm: GraphModule, ctx: CompileContext):
        self.gm, self.graph = gm, gm.graph
        self.tp = ctx.mesh.sizes["tp"]
        self.rank = ctx.mesh.coords["tp"]
        self.sp = ctx.plan.sequence_parallel
        self.group = ctx.mesh.group_name("tp")
        self.place: dict[Node, int | None] = {}
        self.param_dim: dict[Node, int | None] = {}
        self.copies: dict[Node, Node] = {}
        self.seq_gathers: dict[Node, Node] = {}
        self.blocks: dict[Node, list[int]] = {}  # parameter -> block sizes along dim 0

    # ---- helpers ----------------------------------------------------------------------
    def insert(self, before: Node, target, args) -> Node:
        """`target(*args)` before `before`, with its provenance. Rules read full (unsharded)
        shapes: a collective keeps its input's fake value, other new nodes get none until
        the pass re-propagates."""
        full = args[0].meta.get("val") if getattr(target, "namespace", None) == "mxgraph" \
            else None
        return insert_call(self.graph, target, args, before=before, like=before, val=full)

    def copy_of(self, value: Node, user: Node) -> Node:
        """`tp_copy(value)`: identity forward, all-reduce of the gradient backward. One per
        value, so q, k and v reading the same input share one all-reduce."""
        if value not in self.copies:
            self.copies[value] = self.insert(user, mx.tp_copy.default, (value, self.group))
            self.place[self.copies[value]] = R
        return self.copies[value]

    def seq_dim(self, value: Node) -> int | None:
        """With SP, the sequence dim of an activation [..., s, h] (the one before the
        last) if tp divides it; else None (the value stays unsharded by sequence)."""
        shape = value.meta["val"].shape
        if not self.sp or len(shape) < 3 or shape[-2] % self.tp:
            return None
        return len(shape) - 2

    def seq_gather(self, value: Node, user: Node) -> Node:
        """`sp_all_gather` of a sequence shard before a column-parallel linear, one per
        value (its backward reduce-scatters the partial input gradients)."""
        if value not in self.seq_gathers:
            self.seq_gathers[value] = self.insert(
                user, mx.sp_all_gather.default, (value, self.place[value], self.group))
            self.place[self.seq_gathers[value]] = R
        return self.seq_gathers[value]

    def reduce_after(self, value: Node, op, args: tuple, placement) -> Node:
        """Sum `value`'s partials over the group with `op` (all-reduce, or reduce-scatter
        along `placement`), rerouting every other user of `value` to the result."""
        reduced = insert_call(self.graph, op, (value,) + args + (self.group,), after=value,
                              like=value, val=value.meta["val"])  # the full shape, as rules expect
        value.replace_all_uses_with(reduced, delete_user_cb=lambda u: u is not reduced)
        self.place[reduced] = placement
        return reduced

    def to_replicated(self, user: Node, value: Node) -> Node:
        dim = self.place.get(value, R)
        if dim is R:
            return value
        gathered = self.insert(user, mx.tp_all_gather.default, (value, dim, self.group))
        self.place[gathered] = R
        return gathered

    def shard_param(self, param: Node, dim: int, user: Node) -> bool:
        """Choose S(dim) for a parameter placeholder read only as linear weights (and, for
        dim 0, embedding tables). PlanError if tp does not divide that dim."""
        if self.param_dim.get(param, "unset") != "unset":
            return self.param_dim[param] == dim
        ok = (param.op == "placeholder" and param.meta.get("mx_slot_kind") == "param"
              and all(_reads_as_matrix(u, param, dim) for u in param.users))
        size = param.meta["val"].shape[dim] if ok else 0
        if ok and size % self.tp:
            where = (user.meta.get("custom") or {}).get("module", "?")
            raise PlanError(
                f"tp={self.tp} does not divide dim {dim} (size {size}) of parameter "
                f"{param.meta.get('mx_slot_key')} read by {where} ({user.target}): the "
                f"vocabulary, FFN width and heads must split evenly; choose tp in "
                f"{divisors(size)} or pad that dim")
        self.param_dim[param] = dim if ok else R
        return ok

    # ---- rules ------------------------------------------------------------------------
    def linear(self, node: Node) -> int | None:
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        ndim = len(node.meta["val"].shape)
        x_dim = self.place.get(x, R)
        x_last = len(x.meta["val"].shape) - 1
        in_seq = x_dim is not R and x_dim != x_last and x_dim == self.seq_dim(x)
        if (x_dim is R or in_seq) and self.shard_param(weight, 0, node) and (
                bias is None or self.shard_param_bias(bias, 0)):
            feed = self.seq_gather(x, node) if in_seq else self.copy_of(x, node)
            node.replace_input_with(x, feed)
            return ndim - 1
        if x_dim == x_last and self.shard_param(weight, 1, node):
            node.args = (x, weight)
            seq = self.seq_dim(node)
            if seq is None:
                reduced = self.reduce_after(node, mx.tp_all_reduce.default, (), R)
            else:
                reduced = self.reduce_after(node, mx.sp_reduce_scatter.default, (seq,), seq)
            if bias is not None:
                added = insert_call(self.graph, aten.add.Tensor, (reduced, bias), after=reduced,
                                    like=node, val=node.meta["val"])
                reduced.replace_all_uses_with(added, delete_user_cb=lambda u: u is not added)
                self.place[added] = self.pointwise(added)
            return R  # the linear itself is partial; only the reduced value is read
        if any(self.place.get(a, R) is not R for a in node.all_input_nodes):
            self.gather_all(node)
        return R

    def shard_param_bias(self, bias: Node, dim: int) -> bool:
        ok = (bias.op == "placeholder" and bias.meta.get("mx_slot_kind") == "param"
              and all(u.target is aten.linear.default and u.args[2] is bias
                      for u in bias.users))
        self.param_dim[bias] = dim if ok else R
        return ok

    def view(self, node: Node) -> int | None:
        x, shape = node.args[0], list(node.args[1])
        dim = self.place.get(x, R)
        if dim is R:
            return R
        full_in = list(x.meta["val"].shape)
        full_out = list(shape)
        if -1 in full_out:  # infer it from the other sizes
            known = math.prod(s for s in full_out if s != -1)
            full_out[full_out.index(-1)] = math.prod(full_in) // known
        out_dim = _view_dim(full_in, full_out, dim)
        if out_dim is None:  # e.g. flattening [b, s/tp, h] -> [b*s, h] with b > 1
            self.gather_all(node)
            return R
        if full_out[out_dim] % self.tp:
            size = full_out[out_dim]
            raise PlanError(f"tp={self.tp} cannot shard {node.name} ({node.target}: "
                            f"{full_in} -> {full_out}) along the split dim of size {size}: "
                            f"choose tp in {divisors(size)} (e.g. tp must divide the "
                            f"number of heads and KV heads)")
        local = list(full_out)
        local[out_dim] //= self.tp
        node.args = (x, local) + tuple(node.args[2:])
        return out_dim

    def expand(self, node: Node) -> int | None:
        x, sizes = node.args[0], list(node.args[1])
        dim = self.place.get(x, R)
        if dim is R:
            return R
        out_dim = dim + len(sizes) - x.meta["val"].dim()
        if sizes[out_dim] != -1:
            sizes[out_dim] //= self.tp
        node.args = (x, sizes) + tuple(node.args[2:])
        return out_dim

    def permute(self, node: Node) -> int | None:
        x = node.args[0]
        dim = self.place.get(x, R)
        if dim is R:
            return R
        ndim = x.meta["val"].dim()
        if node.target is aten.transpose.int:
            a, b = (d % ndim for d in node.args[1:3])
            return b if dim == a else a if dim == b else dim
        if node.target is aten.t.default:
            return 1 - dim
        order = [d % ndim for d in node.args[1]]
        return order.index(dim)

    def unsqueeze(self, node: Node) -> int | None:
        dim = self.place.get(node.args[0], R)
        if dim is R:
            return R
        new = node.args[1] % node.meta["val"].dim()
        return dim + 1 if new <= dim else dim

    def slice_like(self, node: Node) -> int | None:
        x = node.args[0]
        dim = self.place.get(x, R)
        ndim = x.meta["val"].dim()
        along = node.args[1] % ndim if len(node.args) > 1 else 0
        if dim is R:
            return R
        if along != dim:
            dropped = node.target is aten.select.int and along < dim
            return dim - 1 if dropped else dim
        self.gather_all(node)
        return R

    def split(self, node: Node) -> int | None:
        """Multi-output: every piece keeps the shard if the split is along another dim."""
        x = node.args[0]
        dim = self.place.get(x, R)
        ndim = x.meta["val"].dim()
        position = 1 if node.target is aten.unbind.int else 2
        along = (node.args[position] if len(node.args) > position else
                 node.kwargs.get("dim", 0)) % ndim
        if dim is not R and along == dim and self.split_blocks(node, x, along):
            return dim
        if dim is R or along == dim:
            if dim is not R:
                self.gather_all(node)
            return R
        return dim - 1 if node.target is aten.unbind.int and along < dim else dim

    def split_blocks(self, node: Node, x: Node, along: int) -> bool:
        """A column-parallel output split in pieces along its sharded dim (a fused q/k/v
        or gate/up projection): shard the weight block by block, so that each rank holds
        its slice of every piece (Megatron's fused-QKV layout) and the pieces stay sharded.
        False if the pattern does not hold (the caller gathers)."""
        src = x
        while src.op == "call_function" and src.target in KEEP_OPS - DROPOUT_OPS:
            src = src.args[0]
        if src.op != "call_function" or src.target is not aten.linear.default or \
                node.target is aten.unbind.int or along != x.meta["val"].dim() - 1:
            return False
        params = [p for p in src.args[1:3] if p is not None]
        full = x.meta["val"].shape[along]
        if node.target is aten.split.Tensor:
            size = node.args[1]
            sizes = [size] * (full // size) + ([full % size] if full % size else [])
        elif node.target is aten.split_with_sizes.default:
            sizes = list(node.args[1])
        else:  # chunk
            sizes = [t.meta["val"].shape[along] for t in node.users] or []
            if len(sizes) != node.args[1]:
                return False
        if any(size % self.tp for size in sizes) or any(
                self.param_dim.get(p) != 0 or len(p.users) != 1 for p in params):
            return False
        for param in params:
            self.blocks[param] = sizes
        if node.target is aten.split.Tensor:
            node.args = (x, node.args[1] // self.tp) + tuple(node.args[2:])
        elif node.target is aten.split_with_sizes.default:
            node.args = (x, [size // self.tp for size in sizes]) + tuple(node.args[2:])
        return True

    def cat(self, node: Node) -> int | None:
        tensors, along = node.args[0], node.args[1] if len(node.args) > 1 else 0
        dims = {self.place.get(t, R) for t in tensors}
        ndim = node.meta["val"].dim()
        sharded = dims - {R}
        if len(sharded) == 1 and (d := sharded.pop()) != along % ndim:
            for t in tensors:  # replicated pieces (e.g. a shared RoPE key): this rank's part
                if self.place.get(t, R) is R:
                    node.replace_input_with(t, self.insert(node, mx.tp_slice.default,
                                                           (t, d, self.group)))
            return d
        self.gather_all(node)
        return R

    def attention(self, node: Node) -> int | None:
        q, k, v = node.args[:3]
        dims = [self.place.get(t, R) for t in (q, k, v)]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        mask_ok = mask is None or (self.place.get(mask, R) is R and (
            mask.meta["val"].dim() < 3 or mask.meta["val"].shape[-3] == 1))
        if dims == [1, 1, 1] and mask_ok:  # a mask broadcast over heads is fine
            return 1
        self.gather_all(node)
        return R

    def reduction(self, node: Node) -> int | None:
        """Sum/mean/max over dims that do not include the shard keep it."""
        x = node.args[0]
        dim, ndim = self.place.get(x, R), x.meta["val"].dim()
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        if dims is None or dim is R:
            self.gather_all(node)
            return R
        dims = {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}
        if dim in dims or not dims:
            self.gather_all(node)
            return R
        return dim if keepdim else dim - sum(d < dim for d in dims)

    def norm(self, node: Node) -> int | None:
        x = node.args[0]
        dim = self.place.get(x, R)
        normalized = len(node.args[1])
        if dim is not R and dim < x.meta["val"].dim() - normalized:
            for param in node.all_input_nodes[1:]:  # weight, bias: partial gradients
                node.replace_input_with(param, self.copy_of(param, node))
            return dim
        self.gather_all(node)
        return R

    def pointwise(self, node: Node) -> int | None:
        out_ndim = node.meta["val"].dim()
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"),
                                                                 torch.Tensor)]
        sharded = {out_ndim - a.meta["val"].dim() + self.place[a] for a in tensors
                   if self.place.get(a, R) is not R}
        if not sharded:
            return R
        if len(sharded) > 1:
            self.gather_all(node)
            return R
        out_dim = sharded.pop()
        for arg in tensors:
            if self.place.get(arg, R) is not R:
                continue
            arg_dim = out_dim - (out_ndim - arg.meta["val"].dim())
            if arg_dim >= 0 and arg.meta["val"].shape[arg_dim] != 1:
                sliced = self.insert(node, mx.tp_slice.default, (arg, arg_dim, self.group))
                node.replace_input_with(arg, sliced)
            else:  # broadcast over the shard: its gradient is a partial sum per rank
                node.replace_input_with(arg, self.copy_of(arg, node))
        return out_dim

    def context_parallel(self, node: Node) -> int | None:
        """A CP collective along another dim than the TP shard keeps it."""
        dim = self.place.get(node.args[0], R)
        along = node.args[1] if len(node.args) > 2 else None
        if dim is R or (along is not None and along % node.meta["val"].dim() == dim):
            self.gather_all(node)
            return R
        return dim

    def gather_all(self, node: Node) -> None:
        for arg in list(node.all_input_nodes):
            if self.place.get(arg, R) is not R:
                node.replace_input_with(arg, self.to_replicated(node, arg))
        add_tag(node, "gathers")

    def rule(self, node: Node):
        target = node.target
        if target is aten.linear.default:
            return self.linear
        if target in VIEW_OPS:
            return self.view
        if target is aten.expand.default:
            return self.expand
        if target in (aten.transpose.int, aten.permute.default, aten.t.default):
            return self.permute
        if target is aten.unsqueeze.default:
            return self.unsqueeze
        if target in (aten.slice.Tensor, aten.select.int):
            return self.slice_like
        if target is aten.cat.default:
            return self.cat
        if target in SPLIT_OPS:
            return self.split
        if getattr(target, "__name__", "") == "getitem":
            return lambda n: self.place.get(n.args[0], R)
        if target is aten.scaled_dot_product_attention.default:
            return self.attention
        if target in (aten.rms_norm.default, aten.layer_norm.default):
            return self.norm
        if target in REDUCTION_OPS:
            return self.reduction
        if target is aten.embedding.default:
            return lambda n: shard_vocab.embedding(self, n)
        if target is aten.cross_entropy_loss.default:
            return lambda n: shard_vocab.cross_entropy(self, n)
        if target in KEEP_OPS:
            return lambda n: self.place.get(n.args[0], R)
        if target in CP_OPS:
            return self.context_parallel
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            return self.pointwise
        return None

    def run(self) -> None:
        propagate(self, always=(aten.linear.default, aten.embedding.default))
        output = self.graph.find_nodes(op="output")[0]
        for value in output.all_input_nodes:
            if self.place.get(value, R) is not R:
                output.replace_input_with(value, self.to_replicated(output, value))


def _reads_as_matrix(user: Node, param: Node, dim: int) -> bool:
    if user.target is aten.linear.default:
        return user.args[1] is param
    return user.target is aten.embedding.default and user.args[0] is param and dim == 0


def propagate(sharder, always=()) -> None:
    """Visit the graph in order: a node with no sharded input (unless its op is in
    `always`) is replicated; else `sharder.rule(node)` gives its placement, and a node
    with no rule gathers its inputs (`sharder.gather_all`)."""
    for node in list(sharder.graph.nodes):
        if node.op != "call_function" or node in sharder.place:
            continue
        if node.target not in always and all(sharder.place.get(a, R) is R
                                             for a in node.all_input_nodes):
            sharder.place[node] = R
            continue
        rule = sharder.rule(node)
        if rule is None:
            sharder.gather_all(node)
            sharder.place[node] = R
        else:
            sharder.place[node] = rule(node)


def add_tag(node: Node, tag: str) -> None:
    """Append `tag` to meta["custom"]["tags"] (shown in the dump's node table)."""
    custom = dict(node.meta.get("custom") or {})
    custom["tags"] = tuple(custom.get("tags", ())) + (tag,)
    node.meta["custom"] = custom


def view_group(full_in: list[int], full_out: list[int], dim: int):
    """(input dims, output dims) of the group holding input dim `dim` in a view, or None.

    Groups of input and output dims with equal products are matched left to right."""
    i = j = 0
    while i < len(full_in) and j < len(full_out):
        gi, gj = [i], [j]
        pi, pj = full_in[i], full_out[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= full_in[i]
            else:
                j += 1
                gj.append(j)
                pj *= full_out[j]
        if dim in gi:
            return gi, gj
        i, j = i + 1, j + 1
    return None


def _view_dim(full_in: list[int], full_out: list[int], dim: int) -> int | None:
    """The output dim that carries input dim `dim`'s shard through a view, or None: the
    shard survives if `dim` is the leading non-1 dim of its group (`view_group`), and goes
    to the leading non-1 output dim of the same group."""
    group = view_group(full_in, full_out, dim)
    if group is None:
        return None
    gi, gj = group
    lead_in = next((d for d in gi if full_in[d] != 1), None)
    lead_out = next((d for d in gj if full_out[d] != 1), None)
    return lead_out if lead_in == dim else None


def shard_tp_pass(gm: GraphModule, ctx: CompileContext) -> GraphModule:
    """Shard the forward graph for tensor parallelism (see module docstring).

    Precondition: placeholders carry meta["mx_slot_kind"]. Guarantee: parameter
    placeholders chosen for sharding carry meta["tp_shard_dim"] and their local shape;
    every node's meta["val"] is re-propagated. Numerics: not bitwise (all-reduce order).
    Returns `gm` unchanged when tp == 1.
    """
    if ctx.mesh is None or ctx.mesh.sizes["tp"] == 1:
        return gm
    sharder = _Sharder(gm, ctx)
    sharder.run()
    for node in gm.graph.find_nodes(op="placeholder"):
        dim = sharder.param_dim.get(node)
        if isinstance(dim, int):
            node.meta["tp_shard_dim"] = dim
            if node in sharder.blocks:
                node.meta["tp_blocks"] = sharder.blocks[node]
    return repropagate(gm, {node: (dim, sharder.tp) for node, dim in sharder.param_dim.items()
                            if isinstance(dim, int)})


def repropagate(gm: GraphModule, shards: dict) -> GraphModule:
    """Lint, recompile and re-run fake propagation on `gm` after a sharding pass, with the
    placeholders in `shards` (node -> (dim, parts)) at their local shape."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    fake_mode = torch._guards.detect_fake_mode([n.meta["val"] for n in placeholders])
    fake_inputs = []
    for node in placeholders:
        value = node.meta["val"]
        if node in shards:
            dim, parts = shards[node]
            shape = list(value.shape)
            shape[dim] //= parts
            with fake_mode:
                value = torch.empty(shape, dtype=value.dtype, device=value.device)
        fake_inputs.append(value)
    gm.graph.lint()
    gm.recompile()
    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fake_inputs)
    return gm


def shard_parameters(model: torch.nn.Module, gm: GraphModule, ctx: CompileContext) -> None:
    """Replace each parameter the pass sharded by this rank's shard, in the model itself
    (every alias of a tied parameter too), so `step.parameters()` are the local shards."""
    if ctx.mesh is None or ctx.mesh.sizes["tp"] == 1:
        return
    tp, rank = ctx.mesh.sizes["tp"], ctx.mesh.coords["tp"]
    named = dict(model.named_parameters(remove_duplicate=False))
    for node in gm.graph.find_nodes(op="placeholder"):
        dim = node.meta.get("tp_shard_dim")
        if dim is None:
            continue
        full = named[node.meta["mx_slot_key"]]
        if full.shape == node.meta["val"].shape:
            continue  # already sharded by an earlier compile
        shard = torch.nn.Parameter(tp_shard(full.detach(), dim, node.meta.get("tp_blocks"),
                                            tp, rank).clone(),
                                   requires_grad=full.requires_grad)
        shard.mx_tp_layout = (dim, node.meta.get("tp_blocks"))
        for name, param in named.items():
            if param is full:
                set_parameter(model, name, shard)


def tp_shard(full: torch.Tensor, dim: int, blocks: list[int] | None, tp: int,
             rank: int) -> torch.Tensor:
    """Rank `rank`'s TP shard of a full tensor along `dim`: one chunk, or with `blocks`
    (sizes along `dim` of a fused projection's pieces) its chunk of every block. A
    parameter the pass sharded carries `mx_tp_layout = (dim, blocks)`, so a full tensor
    (a checkpoint, a reference gradient) can be cut the same way."""
    if blocks is None:
        return full.chunk(tp, dim)[rank]
    return torch.cat([block.chunk(tp, dim)[rank] for block in full.split(blocks, dim)], dim)
