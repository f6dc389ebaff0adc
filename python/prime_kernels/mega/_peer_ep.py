"""Expert parallelism over peer memory (path 2): the ranks of one NVLink domain read each other's token rows and
write each other's combine slots directly, with no communication kernels.

Each rank owns a :class:`PeerBuffers`: its staged token rows ``x`` [T_max, H] and routing ``topk_idx`` [T_max, K]
(rows past its T masked with -1), the combine ``slots`` [T_max * K, H] that the ranks owning its routes' experts write
its L2 rows into (row token * K + k), and its signal block (csrc/common/ep_signal.hpp). On several GPUs the four live
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

The emulator plays every rank in each launch (the barrier: one CTA per rank; the forward: its CTAs split over the
ranks), or, with ``delays``, each rank on a stream of its own with random waits before each of its steps, so that the
ranks run in the orders separate GPUs would.
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass

import torch

from .. import _lib
from ..combine import combine
from ..routing import pool_capacity

_ENTER, _EXIT = 0, 1
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
    """One rank's buffers that its peers read (x, topk_idx) or write (slots), and its signal block."""

    x: torch.Tensor         # bf16 [T_max, H]
    topk_idx: torch.Tensor  # int64 [T_max, K]; rows past the call's T are -1
    slots: torch.Tensor     # bf16 [T_max * K, H]
    signals: torch.Tensor   # uint8 [signals_bytes()], zeroed once, never reset

    @classmethod
    def allocate(cls, max_tokens: int, hidden: int, top_k: int, device) -> "PeerBuffers":
        return cls(torch.empty(max_tokens, hidden, dtype=torch.bfloat16, device=device),
                   torch.full((max_tokens, top_k), -1, dtype=torch.int64, device=device),
                   torch.empty(max_tokens * top_k, hidden, dtype=torch.bfloat16, device=device),
                   torch.zeros(signals_bytes(), dtype=torch.uint8, device=device))

    def stage(self, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
        T = x.shape[0]
        if T > self.x.shape[0]:
            raise ValueError(f"{T} tokens exceed the buffers' max_tokens={self.x.shape[0]}")
        self.x[:T].copy_(x)
        self.topk_idx[:T].copy_(topk_idx)
        self.topk_idx[T:].fill_(-1)


def rank_plan(all_topk: list[torch.Tensor], rank: int, num_experts: int, block_m: int):
    """Rank ``rank``'s pool from every rank's staged routing (each [T_max, K], rows past a rank's T at -1), without a
    host sync: (expert_offsets [El + 1], pool_src_route [cap], pool_src_rank [cap]) as int32, cap = the most rows the
    rank's pool can need (every route of the group to its experts, plus padding)."""
    R = len(all_topk)
    tmax, K = all_topk[0].shape
    El = num_experts // R
    gidx = torch.cat(all_topk, 0)  # global token g = rank * T_max + t
    gplan = torch.ops.prime_kernels.routing_plan(gidx, num_experts, block_m, 0, -1)
    offsets_g, src_g = gplan[1], gplan[2]
    cap = pool_capacity(R * tmax, K, El, block_m)
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
    return offsets, pool_src_route, pool_src_rank


def _own_routes(topk_idx: torch.Tensor) -> torch.Tensor:
    """The combine's map over this rank's slots: route t * K + k for a live route, -1 for a masked one."""
    T, K = topk_idx.shape
    ids = torch.arange(T * K, dtype=torch.int32, device=topk_idx.device).view(T, K)
    return torch.where(topk_idx >= 0, ids, -1)


def barrier(buffers: list[PeerBuffers], kind: int, played: list[int]) -> None:
    torch.ops.prime_kernels.ep_barrier_([b.signals for b in buffers], kind, played)


def forward_ranks(buffers: list[PeerBuffers], played: list[int], topk_idx: list[torch.Tensor],
                  topk_weights: list[torch.Tensor], w13: list[torch.Tensor], w2: list[torch.Tensor], *,
                  num_experts: int, block_m: int, save_h: bool = True, clamp: float | None = None,
                  num_sms: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, tuple]]:
    """Steps 2-6 of the module docstring for the ``played`` ranks (their rows already staged), on the current
    stream. topk_idx, topk_weights, w13 ([El, 2I, H]), w2 ([El, H, I]): one per played rank. Returns, per played rank,
    (y [T, H], h [pool, 2I] or [0, 2I], (expert_offsets, pool_src_route, pool_src_rank))."""
    K = buffers[0].topk_idx.shape[1]
    barrier(buffers, _ENTER, played)
    all_topk = [b.topk_idx for b in buffers]
    plans = [rank_plan(all_topk, r, num_experts, block_m) for r in played]
    hs = torch.ops.prime_kernels.mega_moe_fused_fwd_ranks(
        [b.x for b in buffers], [b.slots for b in buffers], [p[1] for p in plans], [p[2] for p in plans],
        [p[0] for p in plans], w13, w2, K, save_h, 0.0 if clamp is None else float(clamp), num_sms)
    barrier(buffers, _EXIT, played)
    out = []
    for i, r in enumerate(played):
        T = topk_idx[i].shape[0]
        slots = buffers[r].slots[: T * K]
        y = combine(slots, _own_routes(topk_idx[i]), topk_weights[i].float().contiguous())
        out.append((y, hs[i], plans[i]))
    return out


class EmulatedGroup:
    """R virtual ranks of expert parallelism over peer memory on one GPU: R sets of :class:`PeerBuffers` and the
    same device code as R GPUs. Rank r owns experts [r * E / R, (r + 1) * E / R).

    ``delays`` (seconds, or 0): each rank runs on a stream of its own and waits a random time up to ``delays``
    (seeded by ``seed``) before each of its steps, so that the barriers and pushes meet in the orders separate GPUs
    would produce; without it every step is one launch over all ranks."""

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
        self._streams = [torch.cuda.Stream(self.device) for _ in range(num_ranks)] if delays else None

    def _sleep(self) -> None:
        # a spin kernel of a random length on the current stream (~1.4 GHz: cycles per second, roughly)
        torch.cuda._sleep(int(self._rng.uniform(0.0, self.delays) * 1.4e9))

    def forward(self, x: list[torch.Tensor], topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor],
                w13: list[torch.Tensor], w2: list[torch.Tensor], *, block_m: int = 128, save_h: bool = True,
                clamp: float | None = None, num_sms: int = 0):
        """One forward of every rank: per rank (y, h, plan) as :func:`forward_ranks` returns them."""
        R = self.num_ranks
        kw = dict(num_experts=self.num_experts, block_m=block_m, save_h=save_h, clamp=clamp)
        if not self.delays:
            for b, xr, tr in zip(self.buffers, x, topk_idx):
                b.stage(xr, tr)
            return forward_ranks(self.buffers, list(range(R)), topk_idx, topk_weights, w13, w2, num_sms=num_sms, **kw)
        caller = torch.cuda.current_stream(self.device)
        sms = num_sms or torch.cuda.get_device_properties(self.device).multi_processor_count
        outs = [None] * R
        for r in self._rng.sample(range(R), R):  # the ranks' host work in a random order too
            s = self._streams[r]
            s.wait_stream(caller)
            with torch.cuda.stream(s):
                self._sleep()
                self.buffers[r].stage(x[r], topk_idx[r])
                outs[r] = _forward_one_delayed(self, r, topk_idx[r], topk_weights[r], w13[r], w2[r],
                                               num_sms=max(1, sms // R), **kw)
        for s in self._streams:
            caller.wait_stream(s)
        for r in range(R):
            for t in (outs[r][0], outs[r][1], *outs[r][2]):
                t.record_stream(caller)
        return outs


def _forward_one_delayed(group: EmulatedGroup, r: int, topk_idx, topk_weights, w13, w2, *, num_sms: int, **kw):
    """Rank r's forward alone on the current stream, with the group's random waits between its steps (each launch
    plays rank r only: the barriers then meet across streams, as across GPUs)."""
    bufs = group.buffers
    K = group.top_k
    barrier(bufs, _ENTER, [r])
    group._sleep()
    offsets, src_route, src_rank = rank_plan([b.topk_idx for b in bufs], r, kw["num_experts"], kw["block_m"])
    clamp = kw["clamp"]
    (h,) = torch.ops.prime_kernels.mega_moe_fused_fwd_ranks(
        [b.x for b in bufs], [b.slots for b in bufs], [src_route], [src_rank], [offsets], [w13], [w2], K,
        kw["save_h"], 0.0 if clamp is None else float(clamp), num_sms)
    group._sleep()
    barrier(bufs, _EXIT, [r])
    group._sleep()
    T = topk_idx.shape[0]
    y = combine(bufs[r].slots[: T * K], _own_routes(topk_idx), topk_weights.float().contiguous())
    return y, h, (offsets, src_route, src_rank)
