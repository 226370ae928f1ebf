"""Layout ops around torch's functional collectives, for collectives lowered to a start
and a wait (`passes/overlap/async_collectives.py`).

`_c10d_functional.all_gather_into_tensor` stacks the ranks' tensors along dim 0 and
`reduce_scatter_tensor` splits along dim 0. The mxgraph collectives gather and scatter
along any dim, and context parallelism's along head-tail chunks; these ops move rows
between those layouts, out of place and without communication:

| op                 | from                                  | to                              |
|--------------------|---------------------------------------|---------------------------------|
| `rows_to_dim`      | n ranks' blocks stacked along dim 0   | the blocks joined along `dim`   |
| `dim_to_rows`      | a tensor cut in n blocks along `dim`  | the blocks stacked along dim 0  |
| `cp_rows_to_dim`   | n ranks' head-tail chunks, dim 0      | the sequence in order, on `dim` |
| `cp_dim_to_rows`   | a sequence along `dim`                | rank r's head and tail chunks   |
|                    |                                       | (r and 2n-1-r) per block        |

Each is the inverse of the next one in the table (rows_to_dim of dim_to_rows is the
identity), which gives its backward; the joint graphs these ops enter are already
differentiated, so none is needed.
"""
from __future__ import annotations

import torch


def _pieces(x: torch.Tensor, dim: int, parts: int) -> list[torch.Tensor]:
    return list(x.chunk(parts, dim))


@torch.library.custom_op("mxgraph::rows_to_dim", mutates_args=())
def rows_to_dim(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return torch.cat(_pieces(x, 0, n), dim)


@torch.library.custom_op("mxgraph::dim_to_rows", mutates_args=())
def dim_to_rows(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return torch.cat(_pieces(x, dim, n), 0)


@torch.library.custom_op("mxgraph::cp_rows_to_dim", mutates_args=())
def cp_rows_to_dim(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    halves = [part.chunk(2, dim) for part in _pieces(x, 0, n)]
    order = [halves[i][0] for i in range(n)] + [halves[n - 1 - i][1] for i in range(n)]
    return torch.cat(order, dim)


@torch.library.custom_op("mxgraph::cp_dim_to_rows", mutates_args=())
def cp_dim_to_rows(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    pieces = _pieces(x, dim, 2 * n)
    return torch.cat([torch.cat([pieces[r], pieces[2 * n - 1 - r]], dim) for r in range(n)], 0)


def _moved(x: torch.Tensor, dim: int, n: int, to_rows: bool) -> torch.Tensor:
    shape = list(x.shape)
    if to_rows:
        shape[dim] //= n
        shape[0] *= n
    else:
        shape[0] //= n
        shape[dim] *= n
    return x.new_empty(shape)


for _op, _to_rows in ((rows_to_dim, False), (dim_to_rows, True), (cp_rows_to_dim, False),
                      (cp_dim_to_rows, True)):
    _op.register_fake(lambda x, dim, n, _to_rows=_to_rows: _moved(x, dim, n, _to_rows))
