"""The deterministic combine: out[t] = bf16(sum over k, in order, of w[t,k] * slots[route_to_pool[t,k]]).

Top-k weights are fp32 and the sum is fp32 in increasing k (no atomics), so the result does not
depend on scheduling. Without weights it is the plain sum the backward's dX needs. Masked routes
(row -1) add nothing; a token whose routes are all masked gets zeros.

Its transpose, the dispatch: out[route_to_pool[t,k]] = src[t] (rows copied as they are), which builds
the backward's dy pool rows.
"""

from __future__ import annotations

import torch

from . import _status

__all__ = ["combine", "combine_reference", "dispatch_rows"]


def combine_reference(slots: torch.Tensor, route_to_pool: torch.Tensor,
                      weights: torch.Tensor | None = None, acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    T, K = route_to_pool.shape
    acc = torch.zeros(T, slots.shape[1], dtype=acc_dtype, device=slots.device)
    for k in range(K):
        rows = route_to_pool[:, k].long()
        live = rows >= 0
        w = weights[:, k].to(acc_dtype) if weights is not None else torch.ones(T, dtype=acc_dtype, device=slots.device)
        acc[live] += w[live, None] * slots[rows[live]].to(acc_dtype)
    return acc if acc_dtype == torch.float64 else acc.to(slots.dtype)


def combine(slots: torch.Tensor, route_to_pool: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    _status.require_on(slots.device, "combine.bf16", "combine")
    return torch.ops.prime_kernels.combine(slots, route_to_pool, weights)


def dispatch_rows(src: torch.Tensor, route_to_pool: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[route_to_pool[t, k]] = src[t] for every route, in place; returns out.

    src: bf16 [T, H]; route_to_pool: int32 [T, K] (a routing plan's); out: bf16 [rows, H]. Routes of -1,
    or naming a row outside [0, rows), write nothing, and rows no route names keep their contents (a
    plan's padding rows, which no GEMM reads). Each src row is read once (token-major), so this runs at
    the card's write rate where ``src.index_select`` by pool row re-reads rows from HBM.
    """
    _status.require_on(src.device, "dispatch_rows.bf16", "dispatch_rows")
    torch.ops.prime_kernels.dispatch_rows_(src, route_to_pool, out)
    return out


def _register() -> None:
    @torch.library.register_fake("prime_kernels::combine")
    def _(slots, route_to_pool, weights=None):
        return slots.new_empty(route_to_pool.shape[0], slots.shape[1])

    @torch.library.register_fake("prime_kernels::dispatch_rows_")
    def _(src, route_to_pool, out):
        return None
