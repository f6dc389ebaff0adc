"""Expert parallelism over peer memory (path 2): the ranks of one NVLink domain read each other's token rows and
write each other's combine slots directly, with no communication kernels.

Each rank owns a :class:`PeerBuffers`: its staged token rows ``x`` [T_max, H] (dy in a backward), routing
``topk_idx`` [T_max, K] (rows past its T masked with -1) and top-k weights ``weights`` [T_max * K] fp32, the combine
``slots`` [T_max * K, H] that the ranks owning its routes' experts write its L2 rows (dX rows in a backward) into
(row token * K + k), ``dt_slots`` [T_max * K] fp32 for the d topk_weights of its routes, and its signal block
(csrc/common/ep_signal.hpp). On several GPUs the four live
in torch symmetric memory and a rank sees its peers' through their peer pointers; in the one-GPU emulator
(:class:`EmulatedGroup`) the R virtual ranks' buffers are plain allocations on the one GPU. The device code is the
same: a forward is

1. stage: the rank's rows and routing into its buffers;
2. enter barrier: every rank's epoch goes up by one and every rank waits until all have entered;
3. plan: each rank plans its pool from every rank's routing (the plan of the whole group over tokens (rank, t), so
   the pool order is (expert, rank, token, k), then the rank's slice of it: no host sync, so a CUDA graph captures
   it);
4. the fused forward: dispatch reads the pool's rows from their ranks' ``x``, L1 + SwiGLU + L2 as on one rank,
   and each L2 row goes to ``slots[rank] + route`` of its source rank;
5. exit barrier: every rank has pushed its rows;
6. combine: each rank sums its own slots (fixed k order, fp32 weights): the bits of EP = 1 over the concatenated
   tokens, because every expert's tiles hold the same rows in the same order and the combine is the same.

A backward is: stage dy and the top-k weights; enter; gather each pool row's dy row and weight from its source rank
(csrc/common/peer_rows.hpp); the one-rank layer's backward over the rank's pool (the grouped pipeline of our kernels,
as the layer runs it on one rank; the forward's plan, h and dispatched x rows; weights by pool row) up to dX and d
topk_weights, the bf16 dX GEMM's epilogue writing each pool row's dX row into its source rank's slot while its
remaining tiles run (the FP8 backward's dX rows and every d topk_weights go by a row-move kernel after their
kernels); arrive at the exit; the weight gradients of the rank's experts (they stay on it), which fill the time the
slower ranks still take to push into this rank's slots; wait at the exit; each rank sums its dX slots (fixed k order)
and reads its d topk_weights.

The emulator plays every rank in each launch of the barriers and the fused forward (its CTAs split over the ranks;
the backward's kernels run rank by rank), or, with ``delays``, each rank on a stream of its own with random waits
between its steps, so that the ranks meet in the orders separate GPUs would produce.
"""

from __future__ import annotations

import ctypes
import functools
import random
import threading
from dataclasses import dataclass

import torch

from .. import _lib
from . import _grouped_ep, _nvlink_domain
from .buffer import packed_offsets, packed_views, symmetric_empty
from ..combine import combine
from ..routing import pool_capacity

_ENTER, _EXIT = 0, 1
_ARRIVE_AND_WAIT, _ARRIVE_ONLY, _WAIT_ONLY = 0, 1, 2  # csrc/common/ep_signal.hpp, EpBarrierPhase
MAX_RANKS = 8


def signals_bytes() -> int:
    """Bytes of one rank's signal block (csrc/common/ep_signal.hpp, EpSignals)."""
    core = _lib.load().core
    if core is None:
        raise RuntimeError(f"prime_kernels: the native core is not loaded: {_lib.load().reason}")
    core.pk_ep_signals_bytes.restype = ctypes.c_int64
    return int(core.pk_ep_signals_bytes())


@dataclass
class PeerBuffers:
    """One rank's buffers that its peers read (x, topk_idx, weights) or write (slots, dt_slots), and its signals."""

    x: torch.Tensor         # bf16 [T_max, H]: the tokens' rows (a forward's; a backward's when it gathers them again)
    dy: torch.Tensor        # bf16 [T_max, H]: a backward's dy rows
    topk_idx: torch.Tensor  # int64 [T_max, K]; rows past the call's T are -1
    weights: torch.Tensor   # fp32 [T_max * K]: the top-k weights (a backward's)
    slots: torch.Tensor     # bf16 [T_max * K, H]: L2 rows (forward) or dX rows (backward) of this rank's routes
    dt_slots: torch.Tensor  # fp32 [T_max * K]: d topk_weights of this rank's routes
    signals: torch.Tensor   # uint8 [signals_bytes()], zeroed once, never reset

    @staticmethod
    def layout(max_tokens: int, hidden: int, top_k: int) -> tuple[list[tuple[str, tuple, torch.dtype, int]], int]:
        """The buffers' places in one allocation: (name, shape, dtype, byte offset) each, and the total bytes (every
        rank's allocation has the same layout, so a peer's buffer is its allocation at the same offset)."""
        routes = max_tokens * top_k
        specs = [("x", (max_tokens, hidden), torch.bfloat16), ("dy", (max_tokens, hidden), torch.bfloat16),
                 ("topk_idx", (max_tokens, top_k), torch.int64),
                 ("weights", (routes,), torch.float32), ("slots", (routes, hidden), torch.bfloat16),
                 ("dt_slots", (routes,), torch.float32), ("signals", (signals_bytes(),), torch.uint8)]
        offsets, total = packed_offsets(specs)
        return [(*spec, off) for spec, off in zip(specs, offsets)], total

    @classmethod
    def view(cls, raw: torch.Tensor, max_tokens: int, hidden: int, top_k: int) -> "PeerBuffers":
        """The buffers inside ``raw`` (uint8, at least :meth:`layout`'s total bytes), as laid out there."""
        laid, _ = cls.layout(max_tokens, hidden, top_k)
        return cls(**packed_views(raw, [spec[:3] for spec in laid], [spec[3] for spec in laid]))

    def initialize(self) -> None:
        """The state a rank's buffers start in (before any peer may use them): no routes, zero signals."""
        self.topk_idx.fill_(-1)
        self.weights.zero_()
        self.signals.zero_()

    @classmethod
    def allocate(cls, max_tokens: int, hidden: int, top_k: int, device) -> "PeerBuffers":
        _, total = cls.layout(max_tokens, hidden, top_k)
        bufs = cls.view(torch.empty(total, dtype=torch.uint8, device=device), max_tokens, hidden, top_k)
        bufs.initialize()
        return bufs

    def _rows(self, T: int) -> None:
        if T > self.x.shape[0]:
            raise ValueError(f"{T} tokens exceed the buffers' max_tokens={self.x.shape[0]}")

    def stage(self, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
        """A forward's rows and routing."""
        T = x.shape[0]
        self._rows(T)
        self.x[:T].copy_(x)
        self.topk_idx[:T].copy_(topk_idx)
        self.topk_idx[T:].fill_(-1)

    def stage_backward(self, dy: torch.Tensor, topk_weights: torch.Tensor, x: torch.Tensor | None = None) -> None:
        """A backward's dy rows and top-k weights (the routing is the forward's, kept in its plans), and the token
        rows again when the backward gathers its pool's x rows anew (a forward's dispatched rows not kept)."""
        T = dy.shape[0]
        self._rows(T)
        self.dy[:T].copy_(dy)
        self.weights[: topk_weights.numel()].copy_(topk_weights.reshape(-1))
        if x is not None:
            self.x[:T].copy_(x)


def rank_plans(all_topk: list[torch.Tensor], ranks: list[int], num_experts: int, block_m: int):
    """The pools of ``ranks`` from every rank's staged routing (each [T_max, K], rows past a rank's T at -1), without
    a host sync: per rank (expert_offsets [El + 1], pool_src_route [cap], pool_src_rank [cap], expert_counts [El]) as
    int32, cap = the most rows a rank's pool can need (every route of the group to its experts, plus padding). The
    group's plan is made once and sliced for each rank."""
    R = len(all_topk)
    tmax, K = all_topk[0].shape
    El = num_experts // R
    gidx = torch.cat(all_topk, 0)  # global token g = rank * T_max + t
    counts_g, offsets_g, src_g = torch.ops.prime_kernels.routing_plan(gidx, num_experts, block_m, 0, -1)[:3]
    cap = pool_capacity(R * tmax, K, El, block_m)
    plans = []
    for rank in ranks:
        lo, hi = rank * El, (rank + 1) * El
        base = offsets_g[lo].long()
        rows = base + torch.arange(cap, device=gidx.device)
        inside = rows < offsets_g[hi].long()
        src = torch.where(inside, src_g[rows.clamp(max=src_g.numel() - 1)].long(), -1)
        ok = src >= 0
        g_tok = torch.div(src, K, rounding_mode="floor")
        pool_src_rank = torch.where(ok, torch.div(g_tok, tmax, rounding_mode="floor"), -1).to(torch.int32)
        pool_src_route = torch.where(ok, (g_tok % tmax) * K + src % K, -1).to(torch.int32)
        offsets = (offsets_g[lo:hi + 1].long() - base).to(torch.int32)
        plans.append((offsets, pool_src_route, pool_src_rank, counts_g[lo:hi]))
    return plans


def _own_routes(topk_idx: torch.Tensor) -> torch.Tensor:
    """The combine's map over this rank's slots: route t * K + k for a live route, -1 for a masked one."""
    T, K = topk_idx.shape
    ids = torch.arange(T * K, dtype=torch.int32, device=topk_idx.device).view(T, K)
    return torch.where(topk_idx >= 0, ids, -1)


def barrier(buffers: list[PeerBuffers], kind: int, played: list[int], phase: int = _ARRIVE_AND_WAIT) -> None:
    torch.ops.prime_kernels.ep_barrier_([b.signals for b in buffers], kind, played, phase)


def _no_pause() -> None:
    pass


def _enter(buffers: list[PeerBuffers], played: list[int], exchange: bool, pause) -> list[PeerBuffers]:
    """The enter barrier; the buffers the call's pointer tables hold (with ``exchange=False``, one played rank's own
    buffers in every entry, and no barrier)."""
    if not exchange:
        (r,) = played
        return [buffers[r]] * len(buffers)
    barrier(buffers, _ENTER, played)
    pause()
    return buffers


def _exit(buffers: list[PeerBuffers], played: list[int], exchange: bool, pause,
          phase: int = _ARRIVE_AND_WAIT) -> None:
    """The exit barrier, whole or one of its halves (csrc/common/ep_signal.hpp, EpBarrierPhase)."""
    pause()
    if exchange:
        barrier(buffers, _EXIT, played, phase)
    pause()


@dataclass
class Saved:
    """What a rank's forward keeps for its backward."""

    offsets: torch.Tensor     # int32 [El + 1]
    src_route: torch.Tensor   # int32 [cap]
    src_rank: torch.Tensor    # int32 [cap]
    counts: torch.Tensor      # int32 [El]
    h: torch.Tensor           # bf16 [cap, 2I]
    x_pool: torch.Tensor | None  # bf16 [cap, H], or None: the backward gathers the rows again (x staged anew)


def _forward_fp8(buffers: list[PeerBuffers], plan, w13, w2, *, num_sms: int, clamp: float | None = None):
    """One rank's FP8 forward on its pool: the pool's rows gathered from their source ranks, the FP8 forward
    pipeline on them as one-route tokens (every quantization is per row or per expert's rows: EP = 1's values), the
    L2 rows scattered to their source ranks' slots. Returns (h, x_pool)."""
    offsets, src_route, src_rank, counts = plan
    K = buffers[0].topk_idx.shape[1]
    cap = src_route.shape[0]
    x_pool = buffers[0].x.new_empty(cap, buffers[0].x.shape[1])
    torch.ops.prime_kernels.peer_rows_(x_pool, [b.x for b in buffers], src_route, src_rank, K, True)
    # no rows for this rank's experts (the pipeline wants some): a host sync, after the enter barrier, so this rank's
    # host waits for every peer's entry here (the bf16 forward has none and is capturable in a CUDA graph)
    if int(offsets[-1]) == 0:
        return x_pool.new_zeros(cap, w13.shape[1]), x_pool
    h, o = _grouped_ep.local_forward_fp8(x_pool, w13, w2, counts, offsets, src_route, save_h=True,
                                         sms=num_sms or None, fp8_recipe=None, weight_cache=None,
                                         clamp=clamp)
    torch.ops.prime_kernels.peer_rows_(o, [b.slots for b in buffers], src_route, src_rank, 1, False)
    return h, x_pool


def forward_ranks(buffers: list[PeerBuffers], played: list[int], topk_idx: list[torch.Tensor],
                  topk_weights: list[torch.Tensor], w13: list[torch.Tensor], w2: list[torch.Tensor], *,
                  num_experts: int, block_m: int, clamp: float | None = None, num_sms: int = 0,
                  precision: str = "bf16", pause=_no_pause, exchange: bool = True,
                  max_tokens: int | None = None) -> list[tuple[torch.Tensor, Saved]]:
    """Steps 2-6 of the module docstring for the ``played`` ranks (their rows already staged), on the current
    stream; ``pause`` runs between the steps (the emulator's delays). topk_idx, topk_weights, w13 ([El, 2I, H]), w2
    ([El, H, I]): one per played rank. ``precision`` "bf16" (the fused forward) or "fp8" (:func:`_forward_fp8` per
    rank). Returns, per played rank, (y [T, H], what its backward needs).

    ``exchange=False`` (one played rank; the benchmark's measure of what the exchange costs): the same plan and
    kernels with every peer pointer on the rank's own buffers and no barriers: the same work without a byte over
    the link and without waiting for a peer. Its results are not the layer's.

    ``max_tokens`` (default: the buffers' rows) sizes the plan: its pool capacity is that of max_tokens tokens on
    every rank (the layer's, whose buffers may hold more rows)."""
    K = buffers[0].topk_idx.shape[1]
    all_topk = [b.topk_idx[:max_tokens] for b in buffers]
    buffers = _enter(buffers, played, exchange, pause)
    plans = rank_plans(all_topk, played, num_experts, block_m)
    if precision == "fp8":
        hs, x_pools = zip(*[_forward_fp8(buffers, p, w13[i], w2[i], num_sms=num_sms, clamp=clamp)
                            for i, p in enumerate(plans)])
    else:
        hs, x_pools = torch.ops.prime_kernels.mega_moe_fused_fwd_ranks(
            [b.x for b in buffers], [b.slots for b in buffers], [p[1] for p in plans], [p[2] for p in plans],
            [p[0] for p in plans], w13, w2, K, True, 0.0 if clamp is None else float(clamp), num_sms)
    _exit(buffers, played, exchange, pause)
    out = []
    for i, r in enumerate(played):
        T = topk_idx[i].shape[0]
        y = combine(buffers[r].slots[: T * K], _own_routes(topk_idx[i]), topk_weights[i].float().contiguous())
        out.append((y, Saved(*plans[i], hs[i], x_pools[i])))
    return out


def backward_ranks(buffers: list[PeerBuffers], played: list[int], topk_idx: list[torch.Tensor],
                   saved: list[Saved], w13: list[torch.Tensor], w2: list[torch.Tensor], *,
                   clamp: float | None = None, num_sms: int = 0, fp8: bool = False, pause=_no_pause,
                   exchange: bool = True, recompute: bool = False, need_wgrad: bool = True, dw13_accum=None,
                   dw2_accum=None):
    """The backward of the module docstring for the ``played`` ranks (dy and weights already staged, and x where a
    rank's ``saved`` has no x_pool), on the current stream; ``fp8``: the FP8 backward pipeline on each rank's pool
    (precision "fp8" or "fp8_bwd") in place of the bf16 one; ``exchange`` as in :func:`forward_ranks`;
    ``fp8`` is False or the precision ("fp8" or "fp8_bwd", which picks how ``recompute`` computes h; True reads as
    "fp8_bwd"); ``recompute``: h computed again from the pool's rows; ``dw13_accum`` / ``dw2_accum``: per played rank, fp32
    accumulators the weight gradients are added into (or None). Returns, per played rank, (dX [T, H], d topk_weights
    [T, K] fp32, dW13 [El, 2I, H], dW2 [El, H, I]), a weight gradient None where not asked for or accumulated (else
    in w13's dtype)."""
    K = buffers[0].topk_idx.shape[1]
    buffers = _enter(buffers, played, exchange, pause)
    xs, dys, ws = [b.x for b in buffers], [b.dy for b in buffers], [b.weights for b in buffers]
    sms = num_sms or None
    want_w = need_wgrad or dw13_accum is not None or dw2_accum is not None
    later = []  # per played rank: what computes its weight gradients, after its rows have gone back
    for i, r in enumerate(played):
        sv = saved[i]
        a13 = None if dw13_accum is None else dw13_accum[i]
        a2 = None if dw2_accum is None else dw2_accum[i]
        cap = sv.src_route.shape[0]
        dy_pool = buffers[r].dy.new_empty(cap, buffers[r].dy.shape[1])
        torch.ops.prime_kernels.peer_rows_(dy_pool, dys, sv.src_route, sv.src_rank, K, True)
        x_pool = sv.x_pool
        if x_pool is None:  # the forward's dispatched rows were not kept: every rank staged its x again
            x_pool = torch.empty_like(dy_pool)
            torch.ops.prime_kernels.peer_rows_(x_pool, xs, sv.src_route, sv.src_rank, K, True)
        w_pool = ws[r].new_empty(cap)
        torch.ops.prime_kernels.peer_rows_(w_pool, ws, sv.src_route, sv.src_rank, 1, True)
        # the kernels read each pool row's weight at its route: here the pool row itself
        local_route = _grouped_ep._pool_routes(sv.src_route)
        if fp8:
            if int(sv.offsets[-1]) == 0:  # no rows for this rank's experts: nothing goes back, zero gradients
                dx_pool, dt_pool = dy_pool[:0], w_pool[:0]
                wgrads = functools.partial(_grouped_ep._zero_wgrads, need_wgrad, a13, a2, w13[i], w2[i])
            else:
                dx_pool, dt_pool, wgrads = _grouped_ep._local_backward_fp8(
                    dy_pool, w_pool, x_pool, sv.h, w13[i], w2[i], sv.counts, sv.offsets, local_route,
                    recompute=recompute, clamp=clamp, sms=sms, precision="fp8" if fp8 == "fp8" else "fp8_bwd",
                    want_wgrad=want_w, need_wgrad=need_wgrad, dw13_accum=a13, dw2_accum=a2, fp8_recipe=None,
                    weight_cache=None)
        else:  # the one-rank layer's bf16 backward: the grouped pipeline of our kernels (the fused one is withheld)
            # dX rows leave the dX GEMM's epilogue for their source ranks' slots while its remaining tiles run
            dx_pool, dt_pool, operands = _grouped_ep._local_backward_bf16(
                dy_pool, w_pool, x_pool, sv.h, w13[i], w2[i], sv.counts, sv.offsets, local_route, recompute=recompute,
                clamp=clamp, sms=sms, dx_to_slots=([b.slots for b in buffers], sv.src_route, sv.src_rank))
            wgrads = (functools.partial(_grouped_ep._add_wgrad, *operands, sv.offsets, need_wgrad, a13, a2, w13[i],
                                        w2[i], sms)
                      if want_w else lambda: (None, None))
            del operands
        if dx_pool is not None:  # the FP8 backward's dX rows: moved by a kernel of their own
            torch.ops.prime_kernels.peer_rows_(dx_pool, [b.slots for b in buffers], sv.src_route, sv.src_rank, 1,
                                               False)
        torch.ops.prime_kernels.peer_rows_(dt_pool, [b.dt_slots for b in buffers], sv.src_route, sv.src_rank, 1,
                                           False)
        later.append(wgrads)
        del dy_pool, x_pool, w_pool, dx_pool, dt_pool, wgrads
    # The rows have gone back: arrive, and let the weight gradients (local work, no peer's memory) fill the time in
    # which the slower ranks finish their pushes into this rank's slots; then wait for them and combine.
    _exit(buffers, played, exchange, pause, _ARRIVE_ONLY)
    grads = []
    for wgrads in later:
        grads.append(wgrads())
    del later, wgrads
    _exit(buffers, played, exchange, pause, _WAIT_ONLY)
    out = []
    for i, r in enumerate(played):
        T = topk_idx[i].shape[0]
        dx = combine(buffers[r].slots[: T * K], _own_routes(topk_idx[i]), None)
        dt = buffers[r].dt_slots[: T * K].view(T, K)
        dtopk = torch.where(topk_idx[i] >= 0, dt, torch.zeros((), dtype=dt.dtype, device=dt.device))
        out.append((dx, dtopk, *grads[i]))
    return out


class PeerGroup:
    """Expert parallelism over peer memory on a process group whose ranks are GPUs of one NVLink domain (one per
    rank): this rank's :class:`PeerBuffers` in torch symmetric memory, every peer's seen through its peer pointer.
    Creating it is a collective; it raises ValueError, on every rank alike, when the group is not one NVLink domain
    (NVML's answer per pair of GPUs; :mod:`prime_kernels.mega._nvlink_domain`). Multicast is never used: the
    variables that turn it off are set for this process first."""

    def __init__(self, group, *, num_experts: int, hidden: int, top_k: int, max_tokens: int, device=None):
        import torch.distributed as dist  # noqa: PLC0415

        _nvlink_domain.disable_multicast_env()
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if not 1 <= self.num_ranks <= MAX_RANKS:
            raise ValueError(f"a group of {self.num_ranks} ranks: expert parallelism over peer memory takes 1 to "
                             f"{MAX_RANKS}")
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts = {num_experts} is not divisible by the group size {self.num_ranks}")
        self.device = torch.device(device if device is not None else torch.cuda.current_device())
        # The buffers' layout follows these: a rank with other values would read and write its peers' memory at the
        # wrong places, so every rank raises the same error first.
        mine = {"num_experts": int(num_experts), "hidden": int(hidden), "top_k": int(top_k),
                "max_tokens": int(max_tokens)}
        every = [None] * self.num_ranks
        dist.all_gather_object(every, mine, group=group)
        bad = [f"{k}: " + ", ".join(f"rank {r} has {e[k]}" for r, e in enumerate(every))
               for k in mine if len({e[k] for e in every}) > 1]
        if bad:
            raise ValueError("prime_kernels.mega: the ranks of the group disagree on the peer buffers' shape ("
                             + "; ".join(bad) + ")")
        why = domain_reason(group, self.device)
        if why is not None:
            raise ValueError(f"prime_kernels.mega: the group is not one NVLink domain ({why})")
        self.num_experts, self.top_k, self.max_tokens = num_experts, top_k, max_tokens
        _, total = PeerBuffers.layout(max_tokens, hidden, top_k)
        raw, self.handle = symmetric_empty(total, self.device, group)
        mine = PeerBuffers.view(raw, max_tokens, hidden, top_k)
        mine.initialize()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)  # every rank's buffers are initialized before any peer reads or signals them
        self.buffers = [mine if r == self.rank else
                        PeerBuffers.view(self.handle.get_buffer(r, (total,), torch.uint8, 0), max_tokens, hidden,
                                         top_k)
                        for r in range(self.num_ranks)]

    def forward(self, x, topk_idx, topk_weights, w13, w2, *, block_m: int = 128, clamp: float | None = None,
                num_sms: int = 0, precision: str = "bf16", exchange: bool = True,
                max_tokens: int | None = None) -> tuple[torch.Tensor, Saved]:
        """This rank's forward (w13 / w2: its experts): (y, what its backward needs). ``exchange`` and
        ``max_tokens`` as in :func:`forward_ranks`."""
        self.buffers[self.rank].stage(x, topk_idx)
        return forward_ranks(self.buffers, [self.rank], [topk_idx], [topk_weights], [w13], [w2],
                             num_experts=self.num_experts, block_m=block_m, clamp=clamp, num_sms=num_sms,
                             precision=precision, exchange=exchange, max_tokens=max_tokens)[0]

    def backward(self, dy, topk_idx, topk_weights, saved: Saved, w13, w2, *, clamp: float | None = None,
                 num_sms: int = 0, fp8: bool = False, exchange: bool = True, x=None):
        """This rank's backward: (dX, d topk_weights, dW13, dW2). ``x``: this rank's token rows, needed (on every
        rank alike) when ``saved.x_pool`` is None."""
        self.buffers[self.rank].stage_backward(dy, topk_weights, x)
        return backward_ranks(self.buffers, [self.rank], [topk_idx], [saved], [w13], [w2], clamp=clamp,
                              num_sms=num_sms, fp8=fp8, exchange=exchange)[0]


class EmulatedGroup:
    """R virtual ranks of expert parallelism over peer memory on one GPU: R sets of :class:`PeerBuffers` and the
    same device code as R GPUs. Rank r owns experts [r * E / R, (r + 1) * E / R).

    ``delays`` (seconds, or 0): each rank runs on a stream of its own and waits a random time up to ``delays``
    (seeded by ``seed``) before each of its steps; without it each barrier and the fused forward are one launch over
    all ranks."""

    def __init__(self, num_ranks: int, *, num_experts: int, hidden: int, top_k: int, max_tokens: int,
                 device=None, delays: float = 0.0, seed: int = 0):
        if not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"num_ranks = {num_ranks}, must be in [1, {MAX_RANKS}]")
        if num_experts % num_ranks:
            raise ValueError(f"num_experts = {num_experts} is not divisible by num_ranks = {num_ranks}")
        self.num_ranks = num_ranks
        self.num_experts = num_experts
        self.top_k = top_k
        self.device = torch.device(device if device is not None else "cuda")
        self.buffers = [PeerBuffers.allocate(max_tokens, hidden, top_k, self.device) for _ in range(num_ranks)]
        self.delays = float(delays)
        self._rng = random.Random(seed)
        # one generator per rank: each rank's waits are drawn by its own host thread
        self._rank_rngs = [random.Random(seed * MAX_RANKS + r) for r in range(num_ranks)]
        self._streams = [torch.cuda.Stream(self.device) for _ in range(num_ranks)] if delays else None

    def _pause(self, r: int):
        """Rank r's wait between its steps: a spin kernel of a random length on the current stream (~1.4 GHz:
        cycles per second, roughly)."""
        rng = self._rank_rngs[r]
        return lambda: torch.cuda._sleep(int(rng.uniform(0.0, self.delays) * 1.4e9))

    def _per_rank(self, step):
        """step(r, pause) for every rank, each from a host thread of its own on a stream of its own after a random
        wait, the threads started in a random order: as R processes would run, so that a rank whose host waits for
        its stream between its barriers (a host sync, which waits for every peer's entry) does not keep the other
        ranks from launching theirs. The caller's stream waits for all of them. Returns the results by rank."""
        caller = torch.cuda.current_stream(self.device)
        outs: list = [None] * self.num_ranks
        errors: list = [None] * self.num_ranks
        for s in self._streams:
            s.wait_stream(caller)

        def run(r: int) -> None:
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(self._streams[r]):
                    pause = self._pause(r)
                    pause()
                    outs[r] = step(r, pause)
            except BaseException as exc:  # raised again by the caller's thread
                errors[r] = exc

        threads = [threading.Thread(target=run, args=(r,), name=f"prime-kernels-emulated-rank-{r}")
                   for r in self._rng.sample(range(self.num_ranks), self.num_ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for exc in errors:
            if exc is not None:
                raise exc
        for s in self._streams:
            caller.wait_stream(s)
        for o in outs:
            for t in _tensors(o):
                t.record_stream(caller)
        return outs

    def _sms_per_rank(self, num_sms: int) -> int:
        sms = num_sms or torch.cuda.get_device_properties(self.device).multi_processor_count
        return max(1, sms // self.num_ranks)

    def forward(self, x: list[torch.Tensor], topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor],
                w13: list[torch.Tensor], w2: list[torch.Tensor], *, block_m: int = 128, clamp: float | None = None,
                num_sms: int = 0, precision: str = "bf16") -> list[tuple[torch.Tensor, Saved]]:
        """One forward of every rank: per rank (y, saved) as :func:`forward_ranks` returns them."""
        R = self.num_ranks
        kw = dict(num_experts=self.num_experts, block_m=block_m, clamp=clamp, precision=precision)
        if not self.delays:
            for b, xr, tr in zip(self.buffers, x, topk_idx):
                b.stage(xr, tr)
            return forward_ranks(self.buffers, list(range(R)), topk_idx, topk_weights, w13, w2, num_sms=num_sms, **kw)

        def step(r, pause):
            self.buffers[r].stage(x[r], topk_idx[r])
            return forward_ranks(self.buffers, [r], [topk_idx[r]], [topk_weights[r]], [w13[r]], [w2[r]],
                                 num_sms=self._sms_per_rank(num_sms), pause=pause, **kw)[0]

        return self._per_rank(step)

    def backward(self, dy: list[torch.Tensor], topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor],
                 saved: list[Saved], w13: list[torch.Tensor], w2: list[torch.Tensor], *, clamp: float | None = None,
                 num_sms: int = 0, fp8: bool = False, x: list[torch.Tensor] | None = None):
        """One backward of every rank: per rank (dX, d topk_weights, dW13, dW2) as :func:`backward_ranks`. ``x``:
        the token rows, staged again for the ranks whose ``saved`` has no x_pool (gathered anew)."""
        R = self.num_ranks
        if not self.delays:
            for r, (b, d, w) in enumerate(zip(self.buffers, dy, topk_weights)):
                b.stage_backward(d, w, None if x is None else x[r])
            return backward_ranks(self.buffers, list(range(R)), topk_idx, saved, w13, w2, clamp=clamp,
                                  num_sms=num_sms, fp8=fp8)

        def step(r, pause):
            self.buffers[r].stage_backward(dy[r], topk_weights[r], None if x is None else x[r])
            return backward_ranks(self.buffers, [r], [topk_idx[r]], [saved[r]], [w13[r]], [w2[r]], clamp=clamp,
                                  num_sms=self._sms_per_rank(num_sms), fp8=fp8, pause=pause)[0]

        return self._per_rank(step)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Saved):
        yield from (t for t in (obj.offsets, obj.src_route, obj.src_rank, obj.counts, obj.h, obj.x_pool)
                    if t is not None)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)


# ---------------------------------------------------------------------------------------------------------------
# The layer's calls (backend "fused" under a group): one PeerGroup per (group, device, shape), made at first use
# ---------------------------------------------------------------------------------------------------------------

STATUS_KEY = "mega_moe_ep_peer.bf16.sm90"
_groups: dict = {}
_domains: dict = {}


def domain_reason(group, device) -> str | None:
    """None when the ranks of ``group`` are one NVLink domain, else why not. A collective the first time per (group,
    device): every rank asks in the same call, since every rank resolves the same backend for it; the answer is kept,
    since which GPUs are peers does not change while the process runs."""
    key = (group.group_name, torch.device(device).index)
    if key not in _domains:
        ok, why = _nvlink_domain.check_group(group, device)
        _domains[key] = None if ok else why
    return _domains[key]


def path_for_group(which: str, backend: str, group, device) -> str:
    """``which`` (the resolved backend) unless "auto" resolved the peer-memory path for a group that is not one
    NVLink domain: then the all-to-all path ("grouped"), and the process says so once."""
    if which != "fused" or backend != "auto" or group is None:
        return which
    why = domain_reason(group, device)
    if why is None:
        return which
    _nvlink_domain.warn_fallback_once(why)
    return "grouped"


def peer_group(group, device, *, num_experts: int, hidden: int, top_k: int, max_tokens: int) -> PeerGroup:
    """The :class:`PeerGroup` of these shapes on ``group``, holding at least ``max_tokens`` rows per rank: made on
    first use, and made again larger when a call needs more rows (a collective each time: max_tokens_per_rank is the
    same on every rank, so every rank makes it in the same call). A backward never reads what its forward left in
    the buffers (it stages what it needs), so one of any size serves both."""
    key = (group.group_name, torch.device(device).index, num_experts, hidden, top_k)
    pg = _groups.get(key)
    if pg is None or pg.max_tokens < max_tokens:
        _groups.pop(key, None)
        pg = _groups[key] = PeerGroup(group, num_experts=num_experts, hidden=hidden, top_k=top_k,
                                      max_tokens=max_tokens, device=device)
    return pg


def layer_forward(x, topk_idx, topk_weights, w13, w2, *, precision, activation_clamp, group, num_experts,
                  max_tokens_per_rank, block_m, capacity, save_h, keep_x_pool, num_sms):
    """The forward's contract of :func:`prime_kernels.mega._fused.forward` on the peer-memory path: (y, h, counts,
    offsets, pool_src_route, pool_src_rank, route_to_pool, x_pool), route_to_pool being this rank's own slot map (its
    routes' rows come back to its own slots) and x_pool the dispatched rows with ``keep_x_pool`` (else [0, H]: the
    backward gathers them again)."""
    T, K = topk_idx.shape
    H = x.shape[1]
    tmax = int(max_tokens_per_rank if max_tokens_per_rank is not None else T)
    pg = peer_group(group, x.device, num_experts=num_experts, hidden=H, top_k=K, max_tokens=tmax)
    y, sv = pg.forward(x, topk_idx, topk_weights, w13, w2, block_m=block_m, clamp=activation_clamp,
                       num_sms=num_sms, precision=precision, max_tokens=tmax)
    if sv.src_route.shape[0] != capacity:  # the plan's rows are the layer's capacity: a mismatch is a bug here
        raise RuntimeError(f"prime_kernels.mega: the peer-memory plan has {sv.src_route.shape[0]} pool rows, the "
                           f"layer {capacity}")
    h = sv.h if save_h else sv.h[:0]
    x_pool = sv.x_pool if keep_x_pool else sv.x_pool[:0]
    return (y.to(x.dtype), h, sv.counts, sv.offsets, sv.src_route, sv.src_rank, _own_routes(topk_idx), x_pool)


def layer_backward(dy, x, topk_idx, topk_weights, w13, w2, h, counts, offsets, pool_src_route, pool_src_rank,
                   route_to_pool, *, precision, activation_clamp, group, num_experts, recompute, need_wgrad,
                   dw13_accum=None, dw2_accum=None, x_pool=None, num_sms=0):
    """The backward's contract of :func:`prime_kernels.mega._grouped_ep.backward` on the peer-memory path:
    (dx, d topk_weights, dw13, dw2), a weight gradient None where not asked for or added into its accumulator.
    Without the forward's dispatched rows (``x_pool``) every rank stages its x again and the pools are gathered anew.
    ``recompute``: h is computed again from the pool's rows (as the one-rank pipelines do)."""
    T, K = topk_idx.shape
    pg = _groups.get((group.group_name, x.device.index, num_experts, x.shape[1], K))
    if pg is None or pg.max_tokens < T:
        raise RuntimeError("prime_kernels.mega: no peer-memory buffers of this shape on this group: the backward of "
                           "the peer-memory path runs after its forward")
    keep = x_pool is not None and x_pool.shape[0] == pool_src_route.shape[0] and x_pool.shape[0] > 0
    sv = Saved(offsets, pool_src_route, pool_src_rank, counts, h, x_pool if keep else None)
    pg.buffers[pg.rank].stage_backward(dy, topk_weights, None if keep else x)
    dx, dt, dw13, dw2 = backward_ranks(
        pg.buffers, [pg.rank], [topk_idx], [sv], [w13], [w2], clamp=activation_clamp, num_sms=num_sms,
        fp8=precision if precision in ("fp8", "fp8_bwd") else False, recompute=recompute, need_wgrad=need_wgrad,
        dw13_accum=None if dw13_accum is None else [dw13_accum],
        dw2_accum=None if dw2_accum is None else [dw2_accum])[0]
    return dx.to(dy.dtype), dt.to(topk_weights.dtype), dw13, dw2

