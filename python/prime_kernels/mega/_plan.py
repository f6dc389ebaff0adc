"""The reference backend's routing plans, on any device and under expert parallelism.

The pool of a rank holds one row per route to one of its local experts, ordered stably by
(expert, source rank, token, k); each expert's rows start at a multiple of ``block_m`` (its
row count is padded up to a multiple of ``block_m``). Padding rows have source route and source
rank -1. Masked routes (``topk_idx == -1``) have no pool row (``route_to_pool == -1``).

The plan of one rank's routing is :func:`prime_kernels.routing.routing_plan_reference` (pure torch, so the
reference runs on the CPU too); its per-row tensors are re-laid into a fixed *capacity*
(:func:`prime_kernels.routing.pool_capacity` of the shapes) so that fake tensors and saved state have static
shapes. The plan object the public calls return is :class:`prime_kernels.routing.RoutingPlan`.

Under expert parallelism (R ranks, El = E / R experts per rank, rank r owns experts
[r*El, (r+1)*El)), every rank all-gathers the routing, builds the plan of the whole group once
(global tokens = (rank, token), so the stable global order is (expert, rank, token, k)) and keeps
its own slice; ``route_to_pool`` then gives, for each local route, its row in the pool of the
rank that owns its expert.
"""

from __future__ import annotations

import struct

import torch

from ..routing import routing_plan_reference
from . import _comm


def _single_plan(topk_idx: torch.Tensor, num_experts: int, block_m: int):
    """(counts, offsets, pool_src_route[tight], route_to_pool) as int64: the rows the plan uses, without the
    padding to its capacity (the callers lay them into theirs)."""
    p = routing_plan_reference(topk_idx, num_experts, block_m)
    p_total = int(p.expert_offsets[-1])
    return (
        p.expert_counts.long(),
        p.expert_offsets.long(),
        p.pool_src_route[:p_total].long(),
        p.route_to_pool.long().view(topk_idx.shape),
    )


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


# What every rank of a group must agree on besides the routing shapes, in this order (a fixed-length descriptor: a
# rank that passes no agreement sends -1 for each, so the gather itself always matches).
AGREEMENT_KEYS = ("hidden", "intermediate", "x_dtype", "weight_dtype", "precision", "backend", "keep_pooled_x",
                  "activation_clamp", "phase", "ep_chunks")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")
_BACKENDS = ("reference", "grouped", "fused")


def _code(value, table) -> int:
    return table.index(value) if value in table else len(table)


def agreement_fields(*, x, w13, precision: str, backend: str, activation_clamp=None, keep_pooled_x: bool = False,
                     phase: int = 0, ep_chunks: int = 1) -> dict[str, int]:
    """The :data:`AGREEMENT_KEYS` of a call as ints (``phase``: 0 for a forward, 1 for a backward that plans again;
    the clamp by its float64 bits, -1 without)."""
    clamp = -1 if activation_clamp is None else struct.unpack("<q", struct.pack("<d", float(activation_clamp)))[0]
    return {"hidden": int(x.shape[1]), "intermediate": int(w13.shape[1]) // 2, "x_dtype": _code(x.dtype, _DTYPES),
            "weight_dtype": _code(w13.dtype, _DTYPES), "precision": _code(precision, _PRECISIONS),
            "backend": _code(backend, _BACKENDS), "keep_pooled_x": int(bool(keep_pooled_x)),
            "activation_clamp": clamp, "phase": int(phase), "ep_chunks": int(ep_chunks)}


def _check_agreement(names: list[str], rows: list[list[int]]) -> None:
    """Raise on every rank (each has the same ``rows``: every rank's values of ``names``) when they differ."""
    bad = [(n, [r[i] for r in rows]) for i, n in enumerate(names) if len({r[i] for r in rows}) > 1]
    if bad:
        what = "; ".join(f"{n}: " + ", ".join(f"rank {r} has {v}" for r, v in enumerate(vals)) for n, vals in bad)
        raise ValueError(
            f"prime_kernels.mega: the ranks of the expert-parallel group disagree ({what}); every rank must call the "
            f"layer with the same top_k, num_experts, hidden and intermediate sizes, dtypes, precision, backend and "
            f"options, or the exchanges that follow would not match")


def build_plan(
    topk_idx: torch.Tensor,
    num_experts: int,
    block_m: int,
    capacity: int,
    group=None,
    max_tokens_per_rank: int | None = None,
    agreement: dict[str, int] | None = None,
):
    """Return the plan tensors of this rank, laid into ``capacity`` pool rows, all int32:
    (expert_counts [El], expert_offsets [El+1], pool_src_route [capacity],
    pool_src_rank [capacity], route_to_pool [T, K]).

    Under a group the first collective gathers every rank's token count together with top_k, num_experts,
    block_m, max_tokens_per_rank, capacity and the caller's ``agreement`` (:func:`agreement_fields`); if any
    differs, every rank raises the same ValueError before an exchange whose sizes would not match (which gloo
    aborts on and NCCL may hang on).
    """
    T, K = topk_idx.shape
    dev = topk_idx.device
    if group is None:
        counts, offsets, src, r2p = _single_plan(topk_idx, num_experts, block_m)
        used = src.numel()
        if used > capacity:  # cannot happen with pool_capacity(); a guard against a broken plan
            raise RuntimeError(f"prime_kernels.mega: routing plan needs {used} pool rows > capacity {capacity}")
        pool_src_route = torch.full((capacity,), -1, dtype=torch.long, device=dev)
        pool_src_route[:used] = src
        pool_src_rank = torch.where(pool_src_route >= 0, 0, -1)
        return tuple(_i32(t) for t in (counts, offsets, pool_src_route, pool_src_rank, r2p))

    R = _comm.world_size(group)
    r = _comm.rank(group)
    El = num_experts // R
    tmax = int(max_tokens_per_rank if max_tokens_per_rank is not None else T)
    # Every rank learns every rank's token count and call shape, then every rank's routing (padded to tmax).
    agreement = agreement or {}
    names = ["top_k", "num_experts", "block_m", "max_tokens_per_rank", "capacity", *AGREEMENT_KEYS]
    fields = {"top_k": K, "num_experts": num_experts, "block_m": block_m, "max_tokens_per_rank": tmax,
              "capacity": capacity, **{k: int(agreement.get(k, -1)) for k in AGREEMENT_KEYS}}
    desc = torch.tensor([T] + [fields[n] for n in names], dtype=torch.long, device=dev)
    gathered_desc = [torch.zeros_like(desc) for _ in range(R)]
    _comm.all_gather(gathered_desc, desc, group)
    rows = [d.tolist() for d in gathered_desc]
    _check_agreement(names, [row[1:] for row in rows])
    t_all = [row[0] for row in rows]
    if max(t_all) > tmax:
        raise ValueError(
            f"prime_kernels.mega: a rank has {max(t_all)} tokens > max_tokens_per_rank={tmax} "
            f"(tokens per rank: {t_all}); pass max_tokens_per_rank= (or a buffer) at least that large"
        )
    padded = torch.full((tmax, K), -1, dtype=torch.long, device=dev)
    padded[:T] = topk_idx.long()
    gathered = [torch.empty_like(padded) for _ in range(R)]
    _comm.all_gather(gathered, padded, group)
    gidx = torch.cat(gathered, 0)  # [R*tmax, K]: global token g = rank*tmax + t

    counts_g, offsets_g, src_g, r2p_g = _single_plan(gidx, num_experts, block_m)
    lo, hi = r * El, (r + 1) * El
    base, end = int(offsets_g[lo]), int(offsets_g[hi])
    counts = counts_g[lo:hi]
    offsets = offsets_g[lo : hi + 1] - base
    if end - base > capacity:
        raise RuntimeError(f"prime_kernels.mega: routing plan needs {end - base} pool rows > capacity {capacity}")
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
