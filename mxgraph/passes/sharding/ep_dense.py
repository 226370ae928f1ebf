"""Expert parallelism for the all-experts form (`moe_dense.py`: every expert on every token
through batched GEMMs, weighted by router scores, summed over the experts; Llama 4's text
experts): the frame `sharding/ep.py` writes for a block of form "dense".

Tokens differ across the EP group: EP ranks are data-parallel ranks (`Plan`: ep divides dp;
`runtime/cluster/mesh.py`: dp = edp x ep), each with its own batch. So rank r computes its
experts [r*E/ep, (r+1)*E/ep) on the tokens of the whole group, and a reduce-scatter sums the
experts' shares and hands each rank its own tokens' rows:

  Matches                                        Rewrite to
  R = repeat(x, [E, 1])  (or expand to [E, T])   x_g = ep_all_gather(x)            [ep*T, ...]
                                                 R = repeat(x_g, [E/ep, 1])  (expand [E/ep, ep*T])
  ... S.T.reshape(-1, 1) * R ...                 S_l = narrow(ep_all_gather(S), 1, r*E/ep, E/ep)
                                                 ... S_l.T.reshape(-1, 1) * R ...
  bmm(A.view(E, -1, H), W) ...                   bmm(A.view(E/ep, -1, H), W_l) ...
  Y = V.view(E, -1, H).sum(0)                    Y = ep_reduce_scatter(V.view(E/ep, -1, H).sum(0))

Every size argument in the block (views, the repeat or expand) is recomputed from its
layout (`DenseMatch.sizes`: E/ep experts over ep*T tokens; -1 stays); the score chain is
copied onto S_l (S and its other users unchanged). Each rank computes the same number of
(expert, token) rows as before: E*T. Backward: the all-gathers' gradients are
reduce-scattered (every rank's experts' share of each token's gradient reaches its owner),
the reduce-scatter's gradient is all-gathered. No all-to-all, no counts, no host sync.

Precondition: the block has no problem and a routing top-k (`ExpertSharder.check`).
Numerics: each token meets the same experts; the sum over experts runs as per-rank partial
sums then the reduce-scatter (fp32 rounding, not bitwise).
"""
from __future__ import annotations

import torch
from torch.fx import Node

import mxgraph.runtime.collectives.ep  # noqa: F401 - registers ep_all_gather, ep_reduce_scatter
from mxgraph.ir import VIEW_OPS
from mxgraph.passes.sharding.moe_blocks import ExpertBlock

aten = torch.ops.aten
mx = torch.ops.mxgraph


def shard_dense(sharder, block: ExpertBlock) -> None:
    """Rewrite one all-experts block for this rank's experts (module docstring)."""
    s, match = sharder, block.dense
    num, ep = match.num, s.ep
    x, entry = match.x, match.entry
    with s.after(x):
        x_g = s.call(mx.ep_all_gather.default, (x, s.group), x)
    if entry.target is aten.repeat.default:
        entry.args = (x_g, [num // ep, *entry.args[1][1:]])
    else:  # expand(unsqueeze(x, 0) or x, [E, T, ...])
        source = entry.args[0]
        if source is not x:
            with s.after(x_g):
                source = s.call(source.target, (x_g, *source.args[1:]), source, source.kwargs)
        else:
            source = x_g
        entry.args = (source, match.sizes(entry, entry.args[1], ep))
    for node in match.nodes:
        if node.target in VIEW_OPS:
            node.args = (node.args[0], match.sizes(node, node.args[1], ep))
    first = s.rank * (num // ep)
    for score in match.scores:
        source = score.source
        with s.after(source):
            gathered = s.call(mx.ep_all_gather.default, (source, s.group), source)
            local = s.call(aten.narrow.default, (gathered, 1, first, num // ep), source)
            for step in score.chain:
                args = (local, match.sizes(step, step.args[1], ep)) if step.target in VIEW_OPS \
                    else (local, *step.args[1:])
                local = s.call(step.target, args, step, step.kwargs)
        read = score.chain[-1] if score.chain else source
        for user in list(read.users):
            if user in match.nodes:
                user.replace_input_with(read, local)
        s.dead += score.chain  # removed where nothing else reads them
    _reduce_scatter(s, match.exit)


def _reduce_scatter(s, exit_: Node) -> None:
    with s.after(exit_):
        out = s.call(mx.ep_reduce_scatter.default, (exit_, s.group), exit_)
    exit_.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)


__all__ = ["shard_dense"]
