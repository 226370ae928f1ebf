"""The device mesh of a plan: one process group per parallel axis.

Axes, outermost first: pp, dp, cp, tp (tp fastest, so a TP group sits on one node, as in
Megatron-LM). The data-parallel axis is itself (edp, ep): `ep` neighbouring data-parallel
ranks split the routed experts, and the `edp = dp / ep` ranks holding the same experts
reduce their gradients together. With cp > 1 each rank's gradients cover its part of the
sequence, so gradients reduce over "dp_cp" (dp x cp; "edp_cp" for experts) in one collective,
as Megatron-LM's data-parallel-with-context group. Groups: "pp", "dp", "edp", "ep", "cp",
"tp", and with cp > 1 "dp_cp", "edp_cp". Built with
`torch.distributed.device_mesh.init_device_mesh` on the device `runtime.cluster.device.detect` names
(its backend: gloo on the CPU, nccl on `cuda`, MCCL behind it on MXMACA).
`default_device` lives in runtime/cluster/device.py; importing it from here keeps working.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mxgraph.errors import PlanError
from mxgraph.plan import Plan
from mxgraph.runtime.cluster.device import check_copy_engine, default_device, detect

AXES = ("pp", "dp", "cp", "tp")
MESH_AXES = ("pp", "edp", "ep", "cp", "tp")  # the device mesh's dims: dp = edp x ep


@dataclass
class Mesh:
    """This rank's place in the mesh and the groups of each axis."""

    sizes: dict[str, int]
    coords: dict[str, int]
    device_mesh: object | None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where this rank's tensors live: every tensor the runtime allocates goes here."""

    @classmethod
    def from_plan(cls, plan: Plan, device: torch.device | None = None) -> "Mesh":
        """This rank's mesh for `plan`; `device` defaults to `default_device()`."""
        device = device or default_device()
        info = detect(device)
        check_copy_engine(plan, info)
        world = dist.get_world_size() if dist.is_initialized() else 1
        dp = plan.resolve_dp(world)
        sizes = _with_merged_axes({"pp": plan.pp, "dp": dp, "cp": plan.cp, "tp": plan.tp,
                                   "ep": plan.ep})
        if world == 1:
            return cls(sizes, {axis: 0 for axis in sizes}, None, device)
        if not dist.is_initialized():
            raise PlanError("a multi-rank plan needs torch.distributed initialised; start "
                            "with torchrun or `mxgraph train --nproc N`")
        mesh = init_device_mesh(info.torch_device.type, tuple(sizes[a] for a in MESH_AXES),
                                mesh_dim_names=MESH_AXES)
        mesh["edp", "ep"]._flatten(mesh_dim_name="dp")
        if sizes["cp"] > 1:  # gradient buckets reduce over the data and context ranks at once
            mesh["edp", "ep", "cp"]._flatten(mesh_dim_name="dp_cp")
            mesh["edp", "cp"]._flatten(mesh_dim_name="edp_cp")
        coords = dict(zip(MESH_AXES, mesh.get_coordinate(), strict=True))
        coords["dp"] = coords["edp"] * sizes["ep"] + coords["ep"]
        coords["dp_cp"] = coords["dp"] * sizes["cp"] + coords["cp"]
        coords["edp_cp"] = coords["edp"] * sizes["cp"] + coords["cp"]
        return cls(sizes, coords, mesh, device)

    @classmethod
    def on_paper(cls, **sizes: int) -> "Mesh":
        """A mesh of rank 0 whose groups exist only by name (see `group_name`): for
        compiling a plan for many ranks in one process, e.g. on the meta device, to read
        its graphs (communication report, memory estimate). Steps compiled on it cannot
        run. Missing axes have size 1."""
        sizes = _with_merged_axes({axis: sizes.get(axis, 1) for axis in AXES + ("ep",)})
        return cls(sizes, {axis: 0 for axis in sizes}, None)

    def group(self, axis: str):
        return None if self.device_mesh is None else self.device_mesh.get_group(axis)

    def group_name(self, axis: str) -> str:
        """The process-group name the collective ops take for `axis`; on a paper mesh a
        name registered in `collectives.groups.GROUP_SIZES` with the axis size."""
        if self.device_mesh is not None:
            return self.device_mesh.get_group(axis).group_name
        from mxgraph.runtime.collectives.groups import GROUP_SIZES
        name = f"paper:{axis}:{self.sizes[axis]}"
        GROUP_SIZES[name] = self.sizes[axis]
        return name

    def axis_of(self, group_name: str) -> str:
        """The axis whose group is named `group_name` (the inverse of `group_name`). Should
        two axes share a group, the narrower wins: ep over dp (edp == 1), dp over edp
        (ep == 1)."""
        for axis in ("tp", "cp", "ep", "dp", "edp", "dp_cp", "edp_cp", "pp"):
            if self.group_name(axis) == group_name:
                return axis
        raise KeyError(f"no axis of this mesh has the group {group_name!r}; its groups: "
                       f"{ {axis: self.group_name(axis) for axis in self.sizes} }")

    def rank_at(self, **coords) -> int:
        """The global rank at this rank's coordinates, with `coords` replaced."""
        merged = {**self.coords, **coords}
        rank = 0
        for axis in AXES:
            rank = rank * self.sizes[axis] + merged[axis]
        return rank


def _with_merged_axes(sizes: dict[str, int]) -> dict[str, int]:
    """`sizes` plus the axes made of others: "edp" (dp / ep, the ranks holding the same
    experts), and "dp_cp" and "edp_cp" (dp and edp times cp, over which gradients reduce)."""
    sizes["edp"] = sizes["dp"] // sizes["ep"]
    sizes["dp_cp"] = sizes["dp"] * sizes["cp"]
    sizes["edp_cp"] = sizes["edp"] * sizes["cp"]
    return sizes

