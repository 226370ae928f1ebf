"""Data-parallel gradient reduction in buckets, and ZeRO-1 sharding of the optimizer state.

    dp = DataParallel.build(step.model_parameters(), step.layouts, plan, mesh)
    dp.reduce()             # after the step: average gradients over the data-parallel ranks
    opt = AdamW(p for _, p in dp.named_shards())   # zero1: this rank's flat shards
    # clipping by the whole gradient's norm: runtime/grad_norm.py
    dp.gather_parameters()  # zero1: updated shards back into the model's parameters

Layout (`build_buckets`): this rank's trainable parameters, in reverse parameter order (as
DDP and Megatron-LM: roughly the order the backward produces gradients), are flattened
into buckets of at most `Plan.bucket_mb` MiB (a larger parameter gets a bucket of its
own), one collective per bucket. Parameters the expert-parallel pass shards over "ep"
(`ParamLayout.ep` in `Step.layouts`) are reduced over "edp", the ranks holding the same
experts, and never share a bucket with others (reduced over "dp"); nor do parameters of
different dtypes. With cp > 1 the groups are "dp_cp" and "edp_cp" (`runtime/cluster/mesh.py`): a
context-parallel rank's gradient covers its part of the sequence, and the same collective
that averages over dp sums those parts. Every gradient is divided by the full dp, so that
it is the gradient of the loss averaged over the global batch. A parameter without a
gradient on this rank counts as zeros; after the reduction every bucketed parameter has one.

ZeRO-1 (`Plan(zero1=True)`, as Megatron-LM's distributed optimizer): each bucket is
padded to a multiple of its group size and reduce-scattered instead of all-reduced. This
rank keeps one flat `nn.Parameter` per bucket, its 1/group-size slice of the parameter
values ("zero1.bucket<i>"), whose `.grad` receives the reduce-scattered slice; the
optimizer is built on those, so its state is sharded. The model's parameters keep
`.grad = None`. `gather_parameters` all-gathers the shards back into the model's
parameters (the step does so at its start; `Step.sync_parameters` for the user).

bf16-mixed (`master`, a `runtime/precision.MasterWeights`): the flat buffers are fp32 and
read the parameters' fp32 main gradients; the reduced values go back there (to the
masters' `.grad` via `MasterWeights.to_masters`), or under ZeRO-1 into fp32 shards (the
master weights) whose values are rounded to the bucket's dtype before the all-gather.

Why in the runtime and not in the graph: the reduction runs once per optimizer step,
after the whole step: after the last micro-batch of a pipeline schedule (and after the
sum of tied weights' gradients over pipeline ranks), when this rank's gradients are
final. The compiled graphs run per (stage, micro-batch); a collective inside them would
run once per micro-batch (micro_batches times the traffic) or need one graph spanning the
whole schedule. With `Plan.overlap.dp_buckets` a bucket's collective starts during the
last micro-batch's backward, as soon as its last gradient exists (`data_parallel/overlap.py`): the
same `start`, and `complete` after the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mxgraph.runtime.cluster.mesh import Mesh

MiB = 2 ** 20


@dataclass
class Bucket:
    """Parameters whose gradients move in one collective, flattened in this order."""

    axis: str
    """The group that reduces it: "dp", or "edp" for expert parameters ("dp_cp", "edp_cp"
    with cp > 1)."""
    names: list[str]
    params: list[torch.nn.Parameter]
    offsets: list[int]
    """Where each parameter starts in the flat buffer."""
    numel: int
    """Elements of the parameters together."""
    group_size: int
    shard: torch.nn.Parameter | None = None
    """ZeRO-1: this rank's slice of the flat parameter values."""

    @property
    def padded_numel(self) -> int:
        """`numel` rounded up to a multiple of the group size."""
        return math.ceil(self.numel / self.group_size) * self.group_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.group_size

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def views(self, flat: torch.Tensor):
        """(parameter, its slice of `flat` shaped like it), in bucket order."""
        for param, offset in zip(self.params, self.offsets, strict=True):
            yield param, flat[offset:offset + param.numel()].view_as(param)


def build_buckets(named_params, expert_ids: set[int], bucket_bytes: int,
                  group_sizes: dict[str, int], axes: tuple[str, str] = ("dp", "edp")) -> list[Bucket]:
    """Split the trainable parameters into buckets (see the module docstring); `axes`: the
    groups of other and of expert parameters."""
    buckets, open_buckets = [], {}
    for name, param in reversed(list(named_params)):
        if not param.requires_grad:
            continue
        axis = axes[1] if id(param) in expert_ids else axes[0]
        members = open_buckets.setdefault((axis, param.dtype), [])
        used = sum(p.numel() for _, p in members) * param.element_size()
        if members and used + param.numel() * param.element_size() > bucket_bytes:
            buckets.append(_bucket(axis, members, group_sizes[axis]))
            members = open_buckets[(axis, param.dtype)] = []
        members.append((name, param))
    buckets += [_bucket(axis, members, group_sizes[axis])
                for (axis, _), members in open_buckets.items() if members]
    return buckets


def bucket_layout(named_params, layouts: dict, plan, mesh: Mesh) -> list[Bucket]:
    """This rank's buckets for `plan` on `mesh` (groups "dp"/"edp", or "dp_cp"/"edp_cp"
    with cp > 1), without allocating anything; `layouts`: name -> `ParamLayout`."""
    named_params = list(named_params)
    expert_ids = {id(p) for n, p in named_params if n in layouts and layouts[n].ep}
    axes = ("dp_cp", "edp_cp") if mesh.sizes["cp"] > 1 else ("dp", "edp")
    sizes = {axis: mesh.sizes[axis] for axis in axes}
    return build_buckets(named_params, expert_ids, int(plan.bucket_mb * MiB), sizes, axes)


def _bucket(axis: str, members: list, group_size: int) -> Bucket:
    offsets, numel = [], 0
    for _, param in members:
        offsets.append(numel)
        numel += param.numel()
    return Bucket(axis, [n for n, _ in members], [p for _, p in members], offsets, numel,
                  group_size)


class DataParallel:
    """This rank's gradient buckets and, under ZeRO-1, its parameter shards."""

    def __init__(self, buckets: list[Bucket], mesh: Mesh, zero1: bool, master=None):
        self.buckets = buckets
        self.mesh = mesh
        self.zero1 = zero1
        self.master = master
        """bf16-mixed: the `MasterWeights` whose fp32 main gradients are reduced (None:
        the parameters' own `.grad`, in their dtype)."""
        if zero1:
            for bucket in buckets:
                bucket.shard = self._make_shard(bucket)

    @classmethod
    def build(cls, named_params, layouts: dict, plan, mesh: Mesh, master=None) -> "DataParallel":
        return cls(bucket_layout(named_params, layouts, plan, mesh), mesh, plan.zero1, master)

    def named_shards(self):
        """("zero1.bucket<i>", flat shard) per bucket (ZeRO-1 only)."""
        return ((f"zero1.bucket{i}", b.shard) for i, b in enumerate(self.buckets))

    # ---- after the step -------------------------------------------------------------
    def reduce(self) -> None:
        """Average gradients over the data-parallel ranks (and sum them over the context-
        parallel ones): all-reduce each bucket, or under ZeRO-1 reduce-scatter it into its
        shard's `.grad` (added, like backward)."""
        for bucket in self.buckets:
            self.complete(bucket, self.start(bucket))

    lane = None
    """A `copy_engine.TransferLane` (`Plan.overlap.copy_engine`): the collectives run there
    instead of being issued from the compute thread. None: issued here, asynchronously."""

    def _issue(self, collective, *args, group):
        if self.lane is not None:
            return self.lane.submit(lambda: collective(*args, group=group))
        return collective(*args, group=group, async_op=True)

    def start(self, bucket: Bucket) -> "Reduction":
        """Start `bucket`'s collective on its current gradients (asynchronously)."""
        flat = _flat_grads(bucket, self.master)
        group = self.process_group(bucket)
        out, work = flat, None
        if self.zero1:
            out = flat.clone() if group is None else flat.new_empty(bucket.shard_numel)
            if group is not None:
                work = self._issue(dist.reduce_scatter_single, out, flat, group=group)
        elif group is not None:
            work = self._issue(dist.all_reduce, flat, group=group)
        return Reduction(out, work)

    def complete(self, bucket: Bucket, reduction: "Reduction") -> None:
        """Wait for `reduction` and write the averaged gradients: the parameters' `.grad`,
        or under ZeRO-1 the shard's (added) and the parameters' set to None."""
        if reduction.work is not None:
            reduction.work.wait()
        mine = reduction.out.div_(self.mesh.sizes["dp"])
        if not self.zero1 and self.master is not None:
            for param, grad in bucket.views(mine):
                self.master.set_grad(param, grad)
            return
        if not self.zero1:
            for param, grad in bucket.views(mine):
                if param.grad is None:
                    param.grad = grad.clone()
                else:
                    param.grad.copy_(grad)
            return
        shard = bucket.shard
        if shard.grad is None:
            shard.grad = mine
        else:
            shard.grad.add_(mine)
        for param in bucket.params:
            param.grad = None
            if self.master is not None:
                self.master.set_grad(param, None)

    # ---- ZeRO-1 parameters ----------------------------------------------------------
    def gather_parameters(self) -> None:
        """ZeRO-1: all-gather the shards into the model's parameters (no-op otherwise)."""
        if not self.zero1:
            return
        for bucket in self.buckets:
            self.gather_complete(bucket, *self.gather_start(bucket))

    def gather_start(self, bucket: Bucket):
        """ZeRO-1: start the all-gather of `bucket`'s shards; (flat values, work or None)."""
        group = self.process_group(bucket)
        shard = bucket.shard.detach().to(bucket.dtype)  # bf16-mixed: rounded, half the bytes
        if group is None:
            return shard, None
        flat = shard.new_empty(bucket.padded_numel)
        return flat, self._issue(dist.all_gather_single, flat, shard, group=group)

    def gather_complete(self, bucket: Bucket, flat: torch.Tensor, work) -> None:
        """Wait for a `gather_start` and copy the values into the bucket's parameters."""
        if work is not None:
            work.wait()
        with torch.no_grad():
            for param, value in bucket.views(flat):
                param.copy_(value)

    def shard_pieces(self, bucket: Bucket):
        """ZeRO-1: (parameter, the part of this rank's shard gradient that holds a slice of
        its gradient) for each parameter overlapping this rank's shard of `bucket`."""
        if bucket.shard.grad is None:
            return
        start = self._group_rank(bucket) * bucket.shard_numel
        end = start + bucket.shard_numel
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            lo, hi = max(start, offset), min(end, offset + param.numel())
            if lo < hi:
                yield param, bucket.shard.grad[lo - start:hi - start]

    def _make_shard(self, bucket: Bucket) -> torch.nn.Parameter:
        dtype = torch.float32 if self.master is not None else bucket.dtype
        flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in bucket.params])
        flat = torch.nn.functional.pad(flat, (0, bucket.padded_numel - bucket.numel))
        start = self._group_rank(bucket) * bucket.shard_numel
        return torch.nn.Parameter(flat[start:start + bucket.shard_numel].clone())

    def process_group(self, bucket: Bucket):
        """The process group of the bucket's axis; None when it holds this rank alone."""
        return None if bucket.group_size == 1 else self.mesh.group(bucket.axis)

    def _group_rank(self, bucket: Bucket) -> int:
        group = self.process_group(bucket)
        return 0 if group is None else dist.get_rank(group)


@dataclass
class Reduction:
    """A bucket's collective in flight: its output buffer and the work to wait on (None
    when the group is this rank alone)."""

    out: torch.Tensor
    work: object


def _flat_grads(bucket: Bucket, master=None) -> torch.Tensor:
    """The bucket's gradients in one padded buffer (zeros for missing gradients); with a
    `master` (bf16-mixed) its fp32 main gradients in an fp32 buffer."""
    dtype = torch.float32 if master is not None else bucket.dtype
    flat = bucket.params[0].new_zeros(bucket.padded_numel, dtype=dtype)
    for param, view in bucket.views(flat):
        grad = param.grad if master is None else master.grad_of(param)
        if grad is not None:
            view.copy_(grad)
    return flat
