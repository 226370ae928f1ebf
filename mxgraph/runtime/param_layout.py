"""How each parameter is laid out over the mesh: one record per parameter name, kept by
the step (`Step.layouts`) and read by everything that needs the whole shape or the rank's
part: re-capture at new input shapes, gradient clipping, the data-parallel buckets,
checkpoints, tests cutting a reference.

A parameter the sharding passes split keeps its identity: its `.data` is replaced by this
rank's part in place (`materialize`), so an optimizer built on `step.parameters()` before
the first step holds the tensors the step updates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's split: along `tp_dim` over "tp" (by `tp_blocks` of a fused
    projection: this rank's chunk of every block), and along dim 0 over "ep" (experts)."""

    tp_dim: int | None = None
    tp_blocks: tuple[int, ...] | None = None
    ep: bool = False

    @property
    def sharded(self) -> bool:
        return self.tp_dim is not None or self.ep

    def full_shape(self, local: torch.Size, sizes: dict[str, int]) -> list[int]:
        shape = list(local)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= sizes["tp"]
        if self.ep:
            shape[0] *= sizes["ep"]
        return shape

    def shard(self, full: torch.Tensor, sizes: dict[str, int], coords: dict[str, int]
              ) -> torch.Tensor:
        """This rank's part of the whole tensor `full` (a checkpoint, a reference)."""
        part = full
        if self.ep:
            part = part.chunk(sizes["ep"], 0)[coords["ep"]]
        if self.tp_dim is not None:
            tp, rank = sizes["tp"], coords["tp"]
            if self.tp_blocks is None:
                part = part.chunk(tp, self.tp_dim)[rank]
            else:
                part = torch.cat([block.chunk(tp, self.tp_dim)[rank] for block in
                                  part.split(list(self.tp_blocks), self.tp_dim)], self.tp_dim)
        return part


def materialize(model: torch.nn.Module, layouts: dict[str, ParamLayout],
                local_shapes: dict[str, list[int]], mesh) -> None:
    """Give every parameter with a layout this rank's part (of shape `local_shapes[name]`),
    in place; one already at that shape (an earlier compile cut it) is left alone, and
    tied aliases share the tensor (cut once)."""
    for name, param in model.named_parameters(remove_duplicate=False):
        layout = layouts.get(name)
        local = local_shapes.get(name)
        if layout is None or local is None or not layout.sharded or list(param.shape) == local:
            continue
        with torch.no_grad():
            param.data = layout.shard(param.data, mesh.sizes, mesh.coords).clone()
        param.grad = None


def set_parameter(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    """Put `param` at the dotted `name` in `model` (one alias of a tied parameter: call it for
    each name the old parameter has)."""
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, param)
