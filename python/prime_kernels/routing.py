"""The routing plan: which pool row each (token, k) route lands in, grouped by expert.

Pool rows are in stable (expert, token, k) order. Expert e owns rows
[expert_offsets[e], expert_offsets[e] + expert_counts[e]); its range is padded with rows whose
source is -1 up to the next multiple of ``block_m``, so every m-block of a grouped GEMM belongs to
one expert. ``route_to_pool`` is the inverse map (-1 for masked routes, topk_idx == -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _lib, _status, _watchdog

__all__ = ["RoutingPlan", "routing_plan", "routing_plan_reference", "pool_capacity"]


@dataclass
class RoutingPlan:
    expert_counts: torch.Tensor   # [E] int32
    expert_offsets: torch.Tensor  # [E + 1] int32; [E] = pool rows in use
    pool_src_route: torch.Tensor  # [P_cap] int32: token * top_k + k, -1 for padding
    pool_src_rank: torch.Tensor   # [P_cap] int32: source rank, -1 for padding
    route_to_pool: torch.Tensor   # [T, K] int32: pool row, -1 for masked routes
    block_m: int
    num_experts: int
    top_k: int
    # [1] int32: routes whose expert id lay outside [-1, num_experts) (planned as masked routes); None from
    # routing_plan_reference, which raises on such ids instead
    num_invalid: torch.Tensor | None = None

    @property
    def pool_capacity(self) -> int:
        return self.pool_src_route.numel()


def pool_capacity(num_tokens, top_k: int, num_experts: int, block_m: int):
    """The most pool rows a plan can use: T*K routes plus at most block_m - 1 padding rows per expert, rounded up
    to a multiple of block_m. This is the one capacity rule of the package: the C ABI's
    ``pk_routing_plan_pool_capacity`` (which the plan kernel checks its output size against) for plain ints, and
    the same expression spelled out for symbolic sizes (a fake kernel traced with dynamic shapes passes SymInts,
    which a C call would specialize to one value) or when the core library is not loaded."""
    args = (num_tokens, top_k, num_experts, block_m)
    if not any(isinstance(a, torch.SymInt) for a in args):
        core = _lib.load().core
        if core is not None:
            return int(core.pk_routing_plan_pool_capacity(*(int(a) for a in args)))
    rows = num_tokens * top_k + num_experts * (block_m - 1)
    return (rows + block_m - 1) // block_m * block_m


def _check(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be 2-D [num_tokens, top_k], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int64 or int32, got {topk_idx.dtype}")
    if topk_idx.size(1) < 1:
        raise ValueError("topk_idx must have top_k >= 1 columns")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")


def routing_plan_reference(topk_idx: torch.Tensor, num_experts: int, block_m: int, rank: int = 0) -> RoutingPlan:
    """Pure-torch plan (any device): the oracle the kernel is tested against. Invalid ids raise."""
    _check(topk_idx, num_experts, block_m)
    T, K = topk_idx.shape
    dev = topk_idx.device
    flat = topk_idx.reshape(-1).to(torch.int64)
    bad = (flat < -1) | (flat >= num_experts)
    if bool(bad.any()):
        raise ValueError(f"topk_idx holds expert ids outside [-1, {num_experts}); e.g. {flat[bad][0].item()}")
    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts).to(torch.int64)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    cap = pool_capacity(T, K, num_experts, block_m)
    src_route = torch.full((cap,), -1, dtype=torch.int32, device=dev)
    src_rank = torch.full((cap,), -1, dtype=torch.int32, device=dev)
    route_to_pool = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    routes = torch.nonzero(valid).squeeze(1)                  # ascending route ids = (token, k) order
    experts = flat[routes]
    order = torch.sort(experts, stable=True).indices           # stable: keeps (token, k) order per expert
    routes, experts = routes[order], experts[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(routes.numel(), device=dev) - first_of_expert[experts]
    rows = offsets[experts] + rank_in_expert
    src_route[rows] = routes.to(torch.int32)
    src_rank[rows] = rank
    route_to_pool[routes] = rows.to(torch.int32)
    return RoutingPlan(counts.to(torch.int32), offsets.to(torch.int32), src_route, src_rank,
                       route_to_pool.view(T, K), block_m, num_experts, K)


def routing_plan(topk_idx: torch.Tensor, num_experts: int, block_m: int, rank: int = 0,
                 validate: bool = True, capacity: int | None = None) -> RoutingPlan:
    """The plan from our kernel (CUDA) or the core's host loop (CPU).

    Expert ids outside [-1, num_experts) are errors. With ``validate=True`` (the default) they raise
    here, which on CUDA reads one int back from the device; ``validate=False`` skips that sync and
    treats such routes as masked.

    ``capacity`` (>= :func:`pool_capacity` of the shapes; default: exactly that) sizes the per-pool-row
    outputs; rows past the plan's end are padding (-1).
    """
    if topk_idx.is_cuda:
        _watchdog.check_device_errors()  # a lost context says why before a vaguer CUDA error can
    _check(topk_idx, num_experts, block_m)
    if capacity is not None:
        needed = pool_capacity(topk_idx.size(0), topk_idx.size(1), num_experts, block_m)
        if capacity < needed:
            raise ValueError(f"capacity = {capacity} is below the {needed} pool rows this plan may need")
    _status.require_on(topk_idx.device, "routing_plan.int32", "routing_plan")
    outs = torch.ops.prime_kernels.routing_plan(topk_idx.contiguous(), num_experts, block_m, rank,
                                            -1 if capacity is None else int(capacity))
    counts, offsets, src_route, src_rank, route_to_pool, num_invalid = outs
    if validate:
        n = int(num_invalid.item())
        if n:
            raise ValueError(f"topk_idx holds {n} expert id(s) outside [-1, {num_experts})")
    return RoutingPlan(counts, offsets, src_route, src_rank, route_to_pool, block_m, num_experts,
                       topk_idx.size(1), num_invalid)


def _register_fake() -> None:
    """Shapes of the op's outputs depend on input shapes only, so torch.compile can trace it."""
    @torch.library.register_fake("prime_kernels::routing_plan")
    def _(topk_idx, num_experts, block_m, rank=0, capacity=-1):
        T, K = topk_idx.shape
        cap = pool_capacity(T, K, num_experts, block_m) if capacity == -1 else capacity
        new = lambda *s: topk_idx.new_empty(s, dtype=torch.int32)  # noqa: E731
        return new(num_experts), new(num_experts + 1), new(cap), new(cap), new(T, K), new(1)
