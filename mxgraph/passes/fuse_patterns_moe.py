"""MoE fusion patterns: the top-k router and the token permute/unpermute around experts."""
from __future__ import annotations

import torch
from torch.fx import Node

from mxgraph.passes.fuse_patterns_base import Pattern, Rewriter

aten = torch.ops.aten
mx = torch.ops.mxgraph


class MoERouter(Pattern):
    """Matches: nothing yet."""

    kind = "moe_router"

    def match(self, node: Node, rw: Rewriter):
        return None


class MoEPermute(Pattern):
    """Matches: nothing yet."""

    kind = "moe_permute"

    def match(self, node: Node, rw: Rewriter):
        return None
