"""The all-to-all expert-parallel path in chunks (bf16): chunk c + 1's exchange under chunk c's GEMMs.

The tokens of every rank are cut on one grid that every rank knows without a collective: token t is in chunk
``t // ceil(capacity / (R * top_k * chunks))`` (the pool's capacity, R * max_tokens_per_rank * top_k and its padding,
is the same on every rank; the forward checked it). The whole call keeps one plan (:func:`prime_kernels.mega._plan.
build_plan`), and chunk c's pool is the subset of the full pool's rows whose token is in chunk c, compacted per
expert and padded to ``block_m``. Within an expert that keeps the full pool's (source rank, token, k) order, so a
rank's sends sorted by full-pool row are sorted by chunk-pool row (:class:`reference.Exchange` with ``row_stride``).

Why the bits are the one-rank call's: every per-row result (h, o, dh, w * s, dx rows, d topk_weights) depends on its
row alone, so computing it in chunk c's pool gives the value it has in the full pool; h, x, dy, dh and w * s are
written back to their full-pool rows (padding rows zero), and the weight gradients run once over the full pool after
the last chunk, in its order, as without chunks. The combines run once, over every route's slot. FP8 is not chunked:
its qT blocks start at each expert's first pool row, which a chunk pool moves.

On CUDA the exchanges run on a side stream: chunk c + 1's rows are exchanged while chunk c's GEMMs run, and chunk
c's results go back while chunk c + 1's run; the compute stream waits on an event per chunk's arrival, the side stream
on one per chunk's results, and every tensor handed across streams is recorded on the stream that reads it.
Every split list is computed (host syncs) before the first launch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import _comm
from .reference import Exchange, gather_rows, scatter_rows


@dataclass
class ChunkPool:
    """One chunk's pool: the exchange of its rows, each chunk-pool row's full-pool row (-1: padding), the local
    experts' row counts and block-aligned offsets in the chunk pool, its pool_src_route, the chunk-pool rows that hold
    a route with their full-pool rows, and whether there is any (all made before the first launch: reading them later
    would be a host sync that ends the overlap)."""

    exchange: Exchange
    row_map: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    pool_src_route: torch.Tensor
    rows: torch.Tensor
    full_rows: torch.Tensor
    has_rows: bool

    @property
    def capacity(self) -> int:
        return self.row_map.shape[0]

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk-pool rows that hold a route, their full-pool rows)."""
        return self.rows, self.full_rows


def chunk_pools(topk_idx, route_to_pool, pool_src_route, pool_src_rank, offsets, *, chunks: int, block_m: int,
                num_experts: int, group) -> list[ChunkPool]:
    """The chunk pools of one call's plan (see the module docstring)."""
    T, K = topk_idx.shape
    dev = topk_idx.device
    cap = pool_src_route.numel()
    El = offsets.numel() - 1
    step = max(1, -(-cap // (_comm.world_size(group) * K * chunks)))
    token_chunk = torch.div(torch.arange(T, device=dev), step, rounding_mode="floor")
    used = pool_src_route >= 0
    row_chunk = torch.where(used, torch.div(pool_src_route.long(), K * step, rounding_mode="floor"), -1)
    row_expert = torch.bucketize(torch.arange(cap, device=dev), offsets[1:].long(), right=True)
    pools = []
    for c in range(chunks):
        rows = torch.nonzero(row_chunk == c).flatten()  # full-pool order: expert-major
        expert = row_expert[rows]
        counts = torch.bincount(expert, minlength=El)
        padded = torch.div(counts + block_m - 1, block_m, rounding_mode="floor") * block_m
        chunk_offsets = torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)])
        group_start = torch.cumsum(counts, 0) - counts  # each expert's first index in ``rows``
        pos = chunk_offsets[:-1][expert] + torch.arange(rows.numel(), device=dev) - group_start[expert]
        ccap = int(chunk_offsets[-1])
        row_map = torch.full((ccap,), -1, dtype=torch.long, device=dev)
        row_map[pos] = rows
        src = torch.full((ccap,), -1, dtype=pool_src_route.dtype, device=dev)
        srank = torch.full((ccap,), -1, dtype=pool_src_rank.dtype, device=dev)
        src[pos] = pool_src_route[rows]
        srank[pos] = pool_src_rank[rows]
        mine = (token_chunk == c)[:, None] & (route_to_pool >= 0)
        r2p = torch.where(mine, route_to_pool, torch.full_like(route_to_pool, -1))
        ex = Exchange(topk_idx, r2p, src, srank, num_experts, group, row_stride=cap)
        pools.append(ChunkPool(ex, row_map, counts.to(torch.int32), chunk_offsets.to(torch.int32), src, pos, rows,
                               ccap > 0))
    return pools


_COMM_STREAMS: dict = {}


def _comm_stream(compute: torch.cuda.Stream) -> torch.cuda.Stream:
    """The exchange stream beside ``compute``, the same one on every call (the caching allocator keeps freed blocks
    per stream: a fresh stream per call would find none and fall back to cudaMalloc / cudaFree, which synchronises
    the device)."""
    key = (compute.device_index, compute.stream_id)
    if key not in _COMM_STREAMS:
        _COMM_STREAMS[key] = torch.cuda.Stream(compute.device)
    return _COMM_STREAMS[key]


def pool_rows(like: torch.Tensor, capacity: int, width: int, used_rows: int) -> torch.Tensor:
    """A [capacity, width] full-pool tensor whose rows below ``used_rows`` (every row a GEMM reads: the local experts'
    padded blocks) start at zero; the rows above, never read, are left unset (the capacity covers every route of
    every rank, up to R times the rows a rank gets: zero-filling it costs more than the chunks' copies)."""
    rows = like.new_empty((capacity, width))
    rows[:min(used_rows, capacity)].zero_()
    return rows


class _Streams:
    """The compute stream (the caller's) and a side stream for the exchanges, on CUDA; nothing on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.comm = _comm_stream(self.compute)
            self.comm.wait_stream(self.compute)  # the plan, the inputs and every index tensor are ready

    def on_comm(self):
        return torch.cuda.stream(self.comm) if self.cuda else contextlib.nullcontext()

    def mark(self, stream_name: str):
        """An event on ``stream_name``'s queue as it is now (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(getattr(self, stream_name))
        return event

    def wait(self, stream_name: str, event) -> None:
        if event is not None:
            getattr(self, stream_name).wait_event(event)

    def hand(self, tensors, stream_name: str) -> None:
        """Tensors made on one stream and read on ``stream_name``: kept from reuse until that stream is done."""
        if self.cuda:
            for t in tensors:
                t.record_stream(getattr(self, stream_name))


def forward(x, topk_idx, topk_weights, w13, w2, plan, *, chunks: int, block_m: int, num_experts: int, group,
            save_h: bool, clamp, sms):
    """The bf16 forward of :func:`prime_kernels.mega._grouped_ep.forward` in ``chunks`` chunks, on the call's
    ``plan``: (y, h [capacity, 2I] in full-pool rows, x_pool [capacity, H] in full-pool rows)."""
    from ._grouped_ep import _combine_slots, local_forward_bf16, pool_rows

    counts, offsets, src, srank, r2p = plan
    T, K = topk_idx.shape
    H, twoI, cap = x.shape[1], w13.shape[1], src.numel()
    x = x.to(torch.bfloat16)
    pools = chunk_pools(topk_idx, r2p, src, srank, offsets, chunks=chunks, block_m=block_m, num_experts=num_experts,
                        group=group)
    used = int(offsets[-1])
    h_full = pool_rows(x, cap if save_h else 0, twoI, used)
    x_full = pool_rows(x, cap, H, used)
    slots = x.new_empty((T * K, H))  # every unmasked route's slot is written by its chunk; the combine reads no other
    st = _Streams(x.device)

    def send_rows(p: ChunkPool):
        with st.on_comm():
            tok = torch.div(p.exchange.send_order, K, rounding_mode="floor")
            (rows,) = p.exchange.to_pool([gather_rows(x, tok)])
        return rows, st.mark("comm")

    arrived = [send_rows(pools[0])]
    for c, p in enumerate(pools):
        x_c, ready = arrived[c]
        st.wait("compute", ready)
        st.hand([x_c], "compute")
        if c + 1 < len(pools):  # the next chunk's rows cross while this chunk's GEMMs run
            arrived.append(send_rows(pools[c + 1]))
        rows, full_rows = p.valid()
        if p.has_rows:
            h_c, o_c = local_forward_bf16(x_c, w13, w2, p.offsets, save_h=save_h, clamp=clamp, sms=sms)
            if save_h:
                scatter_rows(h_full, full_rows, gather_rows(h_c, rows))
        else:
            o_c = x.new_zeros((p.capacity, H))
        scatter_rows(x_full, full_rows, gather_rows(x_c, rows))
        done = st.mark("compute")
        with st.on_comm():
            st.wait("comm", done)
            st.hand([o_c, slots], "comm")
            (back,) = p.exchange.to_routes([o_c], T * K)
            order = p.exchange.send_order
            scatter_rows(slots, order, gather_rows(back, order))
    st.wait("compute", st.mark("comm"))
    y = _combine_slots(slots, topk_idx, topk_weights.float().contiguous())
    return y, h_full, x_full


def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, plan, x_pool, *, chunks: int, block_m: int,
             num_experts: int, group, recompute: bool, clamp, sms):
    """The bf16 backward's data gradients in ``chunks`` chunks, on the forward's ``plan``: (dx, d topk_weights, the
    weight-gradient operands (dy_pool, w * s, dh, x_pool) in full-pool rows, padding rows zero, or None when no local
    expert received a row)."""
    from ._grouped_ep import _combine_slots, _local_backward_bf16, _pool_routes, pool_rows

    counts, offsets, src, srank, r2p = plan
    T, K = topk_idx.shape
    H, twoI, I, cap = x.shape[1], w13.shape[1], w2.shape[2], src.numel()
    x = x.to(torch.bfloat16)
    dy = dy.to(torch.bfloat16)
    pools = chunk_pools(topk_idx, r2p, src, srank, offsets, chunks=chunks, block_m=block_m, num_experts=num_experts,
                        group=group)
    used = int(offsets[-1])
    dy_full, a_full, dh_full = (pool_rows(x, cap, width, used) for width in (H, I, twoI))
    x_full = x_pool if x_pool is not None else pool_rows(x, cap, H, used)
    dx_slots = x.new_empty((T * K, H))  # as the forward's slots
    dt_slots = topk_weights.new_zeros((T * K,), dtype=torch.float32)
    weights = topk_weights.reshape(-1).float()
    st = _Streams(x.device)

    def send_rows(p: ChunkPool):
        with st.on_comm():  # the gathers too: made on the compute stream, the comm stream would not wait for them
            order = p.exchange.send_order
            tok = torch.div(order, K, rounding_mode="floor")
            sends = [gather_rows(dy, tok), weights[order]] + ([gather_rows(x, tok)] if x_pool is None else [])
            got = p.exchange.to_pool(sends)
        return got, st.mark("comm")

    arrived = [send_rows(pools[0])]
    for c, p in enumerate(pools):
        got, ready = arrived[c]
        st.wait("compute", ready)
        st.hand(got, "compute")
        if c + 1 < len(pools):
            arrived.append(send_rows(pools[c + 1]))
        rows, full_rows = p.valid()
        dy_c, w_c = got[0], got[1].contiguous()
        if x_pool is None:
            x_c = got[2]
        else:
            x_c = x.new_zeros((p.capacity, H))
            scatter_rows(x_c, rows, gather_rows(x_pool, full_rows))
        if p.has_rows:
            h_c = None
            if not recompute:
                h_c = h_saved.new_zeros((p.capacity, twoI))
                scatter_rows(h_c, rows, gather_rows(h_saved, full_rows))
            dx_rows, dt_rows, (_, a_c, dh_c, _) = _local_backward_bf16(
                dy_c, w_c, x_c, h_c, w13, w2, p.counts, p.offsets, _pool_routes(p.pool_src_route),
                recompute=recompute, clamp=clamp, sms=sms)
            scatter_rows(a_full, full_rows, gather_rows(a_c, rows))
            scatter_rows(dh_full, full_rows, gather_rows(dh_c, rows))
        else:
            dx_rows, dt_rows = x.new_zeros((p.capacity, H)), w_c.new_zeros((p.capacity,))
        scatter_rows(dy_full, full_rows, gather_rows(dy_c, rows))
        if x_pool is None:
            scatter_rows(x_full, full_rows, gather_rows(x_c, rows))
        done = st.mark("compute")
        with st.on_comm():
            st.wait("comm", done)
            st.hand([dx_rows, dt_rows, dx_slots, dt_slots], "comm")
            dx_back, dt_back = p.exchange.to_routes([dx_rows, dt_rows], T * K)
            order = p.exchange.send_order
            scatter_rows(dx_slots, order, gather_rows(dx_back, order))
            dt_slots.index_copy_(0, order, dt_back[order])
    st.wait("compute", st.mark("comm"))
    dx = _combine_slots(dx_slots, topk_idx, None)
    dtopk = dt_slots.view(T, K).to(topk_weights.dtype)
    return dx, dtopk, (dy_full, a_full, dh_full, x_full) if used else None
