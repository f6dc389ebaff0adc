"""Routing plans: which pool row holds which (rank, token, k) route.

The pool of a rank holds one row per route to one of its local experts, ordered stably by
(expert, source rank, token, k); each expert's rows start at a multiple of ``block_m`` (its
row count is padded up to a multiple of ``block_m``). Padding rows have source route and source
rank -1. Masked routes (``topk_idx == -1``) have no pool row (``route_to_pool == -1``).

The single-rank plan comes from ``deep_gemm.routing.routing_plan_reference`` when the lead's
module is importable, and from the equivalent local implementation below otherwise. Either way
the per-row tensors are re-laid into a fixed *capacity* (a pure function of the shapes, see
:func:`pool_capacity`) so that fake tensors and saved state have static shapes.

Under expert parallelism (R ranks, El = E / R experts per rank, rank r owns experts
[r*El, (r+1)*El)), every rank all-gathers the routing, builds the plan of the whole group once
(global tokens = (rank, token), so the stable global order is (expert, rank, token, k)) and keeps
its own slice; ``route_to_pool`` then gives, for each local route, its row in the pool of the
rank that owns its expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingPlan:
    """Local stand-in with the fields of ``deep_gemm.routing.RoutingPlan`` (see the module docstring)."""

    expert_counts: torch.Tensor  # [El] int32: routes per local expert
    expert_offsets: torch.Tensor  # [El+1] int32: first pool row of each expert, padded to block_m
    pool_src_route: torch.Tensor  # [P_cap] int32: token*K + k of the source route, -1 = padding
    pool_src_rank: torch.Tensor  # [P_cap] int32: source rank, -1 = padding
    route_to_pool: torch.Tensor  # [T, K] int32: pool row (on the owning rank), -1 = masked
    block_m: int
    num_experts: int
    top_k: int


def _routing_module():
    try:
        from deep_gemm import routing  # noqa: PLC0415
    except Exception:
        return None
    if not hasattr(routing, "routing_plan_reference"):
        return None
    return routing


def make_plan(**fields) -> "RoutingPlan":
    """Build a plan object of the lead's class when it exists (same fields), else the local one."""
    mod = _routing_module()
    cls = getattr(mod, "RoutingPlan", None) if mod is not None else None
    if cls is not None:
        try:
            return cls(**fields)
        except TypeError:
            pass
    return RoutingPlan(**fields)


def pool_capacity(num_routes: int, num_experts: int, block_m: int):
    """Rows reserved for a pool of ``num_routes`` routes over ``num_experts`` experts.

    sum_e round_up(c_e, block_m) <= sum_e c_e + num_experts * (block_m - 1), rounded up to a multiple of
    block_m as :func:`deep_gemm.routing.pool_capacity` rounds it (the fused forward builds the kernel plan of
    its padded pool in these rows, and the plan kernel asks for that many).
    Works on SymInts (no data dependence), so fake kernels can use it.
    """
    return (num_routes + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m


def _plan_local(topk_idx: torch.Tensor, num_experts: int, block_m: int):
    """Pure-torch single-rank plan with a tight pool (our own code; any device)."""
    T, K = topk_idx.shape
    dev = topk_idx.device
    flat = topk_idx.reshape(-1).long()
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    n_valid = int(counts.sum())
    routes = order[:n_valid]
    experts = key[routes]
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    rows = offsets[experts] + torch.arange(n_valid, device=dev) - first[experts]
    p_total = int(offsets[-1])
    pool_src_route = torch.full((p_total,), -1, dtype=torch.long, device=dev)
    pool_src_route[rows] = routes
    route_to_pool = torch.full((T * K,), -1, dtype=torch.long, device=dev)
    route_to_pool[routes] = rows
    return counts, offsets, pool_src_route, route_to_pool.view(T, K)


def _single_plan(topk_idx: torch.Tensor, num_experts: int, block_m: int):
    """(counts, offsets, pool_src_route[tight], route_to_pool) as int64, lead's code when present."""
    mod = _routing_module()
    if mod is not None:
        p = mod.routing_plan_reference(topk_idx, num_experts, block_m)
        p_total = int(p.expert_offsets[-1])
        return (
            p.expert_counts.long(),
            p.expert_offsets.long(),
            p.pool_src_route[:p_total].long(),
            p.route_to_pool.long().view(topk_idx.shape),
        )
    return _plan_local(topk_idx, num_experts, block_m)


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def build_plan(
    topk_idx: torch.Tensor,
    num_experts: int,
    block_m: int,
    capacity: int,
    group=None,
    max_tokens_per_rank: int | None = None,
):
    """Return the plan tensors of this rank, laid into ``capacity`` pool rows, all int32:
    (expert_counts [El], expert_offsets [El+1], pool_src_route [capacity],
    pool_src_rank [capacity], route_to_pool [T, K]).
    """
    T, K = topk_idx.shape
    dev = topk_idx.device
    if group is None:
        counts, offsets, src, r2p = _single_plan(topk_idx, num_experts, block_m)
        used = src.numel()
        if used > capacity:  # cannot happen with pool_capacity(); a guard against a broken plan
            raise RuntimeError(f"deep_gemm.mega: routing plan needs {used} pool rows > capacity {capacity}")
        pool_src_route = torch.full((capacity,), -1, dtype=torch.long, device=dev)
        pool_src_route[:used] = src
        pool_src_rank = torch.where(pool_src_route >= 0, 0, -1)
        return tuple(_i32(t) for t in (counts, offsets, pool_src_route, pool_src_rank, r2p))

    import torch.distributed as dist  # noqa: PLC0415

    R = dist.get_world_size(group)
    r = dist.get_rank(group)
    El = num_experts // R
    tmax = int(max_tokens_per_rank if max_tokens_per_rank is not None else T)
    # Every rank learns every rank's token count, then every rank's routing (padded to tmax).
    t_local = torch.tensor([T], dtype=torch.long, device=dev)
    t_all = [torch.zeros_like(t_local) for _ in range(R)]
    dist.all_gather(t_all, t_local, group=group)
    t_all = [int(t) for t in t_all]
    if max(t_all) > tmax:
        raise ValueError(
            f"deep_gemm.mega: a rank has {max(t_all)} tokens > max_tokens_per_rank={tmax} "
            f"(tokens per rank: {t_all}); pass max_tokens_per_rank= (or a buffer) at least that large"
        )
    padded = torch.full((tmax, K), -1, dtype=torch.long, device=dev)
    padded[:T] = topk_idx.long()
    gathered = [torch.empty_like(padded) for _ in range(R)]
    dist.all_gather(gathered, padded, group=group)
    gidx = torch.cat(gathered, 0)  # [R*tmax, K]: global token g = rank*tmax + t

    counts_g, offsets_g, src_g, r2p_g = _single_plan(gidx, num_experts, block_m)
    lo, hi = r * El, (r + 1) * El
    base, end = int(offsets_g[lo]), int(offsets_g[hi])
    counts = counts_g[lo:hi]
    offsets = offsets_g[lo : hi + 1] - base
    if end - base > capacity:
        raise RuntimeError(f"deep_gemm.mega: routing plan needs {end - base} pool rows > capacity {capacity}")
    src = src_g[base:end]
    ok = src >= 0
    g_tok = torch.div(src, K, rounding_mode="floor")
    src_rank = torch.where(ok, torch.div(g_tok, tmax, rounding_mode="floor"), -1)
    src_route = torch.where(ok, (g_tok % tmax) * K + src % K, -1)
    pool_src_route = torch.full((capacity,), -1, dtype=torch.long, device=dev)
    pool_src_rank = torch.full((capacity,), -1, dtype=torch.long, device=dev)
    pool_src_route[: end - base] = src_route
    pool_src_rank[: end - base] = src_rank
    # This rank's routes: global pool row -> row within the owning rank's pool.
    mine = r2p_g.view(R, tmax, K)[r, :T]
    e_mine = topk_idx.long()
    owner_base = offsets_g[(torch.clamp(e_mine, min=0) // El) * El]
    r2p = torch.where(e_mine >= 0, mine - owner_base, -1)
    return tuple(_i32(t) for t in (counts, offsets, pool_src_route, pool_src_rank, r2p))
