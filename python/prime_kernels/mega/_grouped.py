"""The "grouped" backend: the layer as a short pipeline of our own CUDA kernels.

Forward: routing plan -> L1 as an m-grouped GEMM that gathers the token rows itself and applies
SwiGLU in its epilogue -> L2 as an m-grouped GEMM -> the deterministic combine. Backward: gathers of
the dy rows (and of x, unless the fused forward kept them) -> L2 dgrad with the SwiGLU backward in its
epilogue (weights read MN-major, no transposed copy; d topk_weights partials per 128 columns, dh, w*s)
-> L1 dgrad -> combine for dX, and the weight gradients as k-grouped GEMMs. Every stage is one of our
kernels, but the stages meet in HBM (the fused forward keeps its stages on chip). On a GPU our sm90 GEMMs cannot run
on (Blackwell), the five GEMMs are torch's grouped GEMM (:mod:`prime_kernels.grouped_gemm`, which asks
:func:`prime_kernels.grouped_gemm_torch.selected`), the other stages ours; status key :data:`TORCH_GEMMS_STATUS_KEY`.

Rounding points: those of :mod:`prime_kernels.mega.reference`, F6 included (with a clamp the L1's epilogue saves
h with the clamp masks of the fp32 pre-activation, as the fused forward's does, and a recompute reruns that
epilogue). One rank here; with an expert-parallel group the same kernels run between all-to-all exchanges
(:mod:`prime_kernels.mega._grouped_ep`).
"""

from __future__ import annotations

import torch

from ..combine import combine, dispatch_rows
from ..grouped_gemm import (k_grouped_bf16_gemm_tn, m_grouped_bf16_gemm_nn, m_grouped_bf16_gemm_nt,
                            m_grouped_bf16_gemm_swiglu, m_grouped_bf16_gemm_swiglu_bwd)
from ..routing import routing_plan

STATUS_KEY = "mega_moe_grouped.bf16.sm90"
# With activation_clamp (the L1's kMaskedH kernels)
CLAMP_STATUS_KEY = "mega_moe_grouped_clamp.bf16.sm90"
# On Blackwell the same pipeline runs its GEMMs on torch's grouped GEMM (prime_kernels.grouped_gemm_torch.selected),
# which takes no clamp
TORCH_GEMMS_STATUS_KEY = "mega_moe_grouped.bf16.sm100"
TORCH_GEMMS_CLAMP_STATUS_KEY = "mega_moe_grouped_clamp.bf16.sm100"


def _token_rows(pool_src_route: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token row of every pool row, -1 (reads as a zero row) for padding."""
    return torch.where(pool_src_route >= 0, torch.div(pool_src_route, top_k, rounding_mode="floor"),
                       torch.full_like(pool_src_route, -1))


def _rows_for_kernels(t: torch.Tensor) -> torch.Tensor:
    """t as the row kernels take it: contiguous and 16-byte aligned (autograd may hand dy over as a broadcast
    or an offset view)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _padding_span(capacity: int, num_routes: int, num_experts: int) -> int:
    """The most padding rows one expert of a padded plan can have: the capacity reserves block_m - 1 per expert."""
    return max(0, (capacity - num_routes) // num_experts)


def _padding_row_index(counts: torch.Tensor, offsets: torch.Tensor, num_routes: int, capacity: int):
    """The rows :func:`_zero_padding_rows` fills (None when the plan has no padding span), for buffers of
    [capacity + span] rows: the padding rows [offsets[e] + counts[e], offsets[e + 1]) of a padded plan's pool, and for
    index slot j of an expert past its padding, scratch row capacity + j. So no row is named by more than E slots
    (with one shared scratch row, a plan without padding sent all E * span slots to that row, and the fill took
    0.118 ms of the 30B backward's 1.59 ms of kernels at T=4096 on the H200). No host sync."""
    span = _padding_span(capacity, num_routes, counts.shape[0])
    if span <= 0:
        return None
    first = (offsets[:-1] + counts).long()
    slot = torch.arange(span, device=counts.device)
    rows = first[:, None] + slot[None, :]
    return torch.where(rows < offsets[1:, None].long(), rows, capacity + slot[None, :]).view(-1)


def _zero_padding_rows(buf: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor, num_routes: int,
                       capacity: int, index: torch.Tensor | None = None) -> None:
    """Zero the padding rows of a padded plan's pool in ``buf`` ([capacity + span, H]: the pool, then span scratch
    rows, :func:`_gathered_pool`); ``index``: :func:`_padding_row_index` of the plan, when the caller fills several
    buffers. The grouped GEMMs read the padding rows as part of their expert's m-blocks (both forwards pad their
    plans), so they must be finite: zero rows add nothing to any gradient."""
    if index is None:
        index = _padding_row_index(counts, offsets, num_routes, capacity)
    if index is not None:
        buf.index_fill_(0, index, 0)


class PaddingRows:
    """A plan's :func:`_padding_row_index`, computed once for every pool a backward gathers (eight small kernels
    each time otherwise: a backward that gathers dy and x rows paid them twice)."""

    def __init__(self, counts: torch.Tensor, offsets: torch.Tensor, num_routes: int, capacity: int):
        self.span = _padding_span(capacity, num_routes, counts.shape[0])
        self.index = _padding_row_index(counts, offsets, num_routes, capacity) if self.span > 0 else None


def _gathered_pool(rows: torch.Tensor, route_to_pool: torch.Tensor, counts: torch.Tensor,
                   offsets: torch.Tensor, capacity: int, padding: PaddingRows | None = None) -> torch.Tensor:
    """rows (token-major, as :func:`_rows_for_kernels` gives them) dispatched into a [capacity, H] pool in plan
    order, each row read once, with the plan's padding rows zeroed. The pool is a view of a [capacity + span, H]
    buffer whose last rows are scratch for :func:`_zero_padding_rows`. ``padding``: the plan's :class:`PaddingRows`
    when the caller gathers several pools (else computed here)."""
    if padding is None:
        padding = PaddingRows(counts, offsets, route_to_pool.numel(), capacity)
    buf = rows.new_empty(capacity + padding.span, rows.shape[1])
    pool = dispatch_rows(rows, route_to_pool, buf[:capacity])
    if padding.index is not None:
        buf.index_fill_(0, padding.index, 0)
    return pool


def recompute_h(x, w13, counts, offsets, route_to_pool, capacity: int, x_pool, sms, activation_clamp=None,
                padding: PaddingRows | None = None):
    """(h, x_pool) for a backward that recomputes h: the token rows pooled once (or the forward's x_pool, when it
    kept them), then L1 as the plain m-grouped GEMM on them. The pooled rows serve dW13 afterwards, so the
    recompute costs one GEMM; the gathering GEMM (``a_row_index``) instead took 1.89 ms beside a 5.06 ms backward at
    30B, T=16384 on the H200, where the L1's FLOPs at the backward's own rate take about 1.4 ms. With a clamp, h
    keeps the clamp masks (F6): the L1 with the SwiGLU epilogue that saves them (its s is not used). ``padding`` as
    in :func:`_gathered_pool`."""
    if x_pool is None:
        x_pool = _gathered_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity, padding)
    if activation_clamp is not None:
        return m_grouped_bf16_gemm_swiglu(x_pool, w13, offsets, save_h=True, clamp=activation_clamp,
                                          num_sms=sms)[1], x_pool
    return m_grouped_bf16_gemm_nt(x_pool, w13, offsets, num_sms=sms), x_pool


def _wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, sms) -> torch.Tensor:
    """a_g^T b_g in the parameter's dtype. A bf16 weight gets its gradient rounded in the GEMM's epilogue
    (the same single fp32 -> bf16 rounding as a cast, without writing and re-reading an fp32 copy)."""
    if dtype == torch.bfloat16:
        return k_grouped_bf16_gemm_tn(a, b, offsets, out_dtype=torch.bfloat16, num_sms=sms)
    return k_grouped_bf16_gemm_tn(a, b, offsets, num_sms=sms).to(dtype)


def _sms(num_sms):
    """The backends' num_sms (0 or None: every SM) as the grouped GEMMs take it."""
    return num_sms if num_sms else None


def forward(x, topk_idx, topk_weights, w13, w2, *, activation_clamp=None, group=None, num_experts=None,
            max_tokens_per_rank=None, block_m, capacity, save_h=True, buffer=None, id_check=None, num_sms=0):
    """Same contract as :func:`prime_kernels.mega.reference.forward`; ``id_check`` as in
    :func:`prime_kernels.mega._fused.forward`; ``num_sms`` caps every GEMM's grid (0: every SM)."""
    sms = _sms(num_sms)
    if group is not None:
        raise RuntimeError("prime_kernels.mega: the grouped backend runs on a single rank (group=None)")
    T = x.shape[0]
    K = topk_idx.shape[1]
    # The plan is padded to the caller's block_m like the fused forward's (one plan layout for both backends, as
    # the MegaMoEState's plan says): the GEMMs need no padding, but whole m-blocks are cheaper than ragged groups
    # (partly filled tiles between full ones cost ~5% at the H200's power cap).
    # Padding rows gather no token (a zero row), so their h, s and o rows are zeros.
    plan = routing_plan(topk_idx, num_experts, block_m, validate=False, capacity=capacity)
    if id_check is not None:
        id_check.watch(plan.num_invalid)
    src = plan.pool_src_route
    srank = plan.pool_src_rank
    tok = _token_rows(src, K)
    offsets = plan.expert_offsets
    # F1-F3 in one kernel: SwiGLU on the accumulators rounded to bf16 (as h is saved), s and h in bf16.
    s, h_saved = m_grouped_bf16_gemm_swiglu(x, w13, offsets, a_row_index=tok, m_total=capacity, save_h=save_h,
                                            clamp=activation_clamp, num_sms=sms)
    o = m_grouped_bf16_gemm_nt(s, w2, offsets, num_sms=sms)  # F4
    y = combine(o, plan.route_to_pool, topk_weights.float())  # F5
    return (y, h_saved, plan.expert_counts, offsets, src, srank, plan.route_to_pool.view(T, K))


def add_wgrad(dy_pool, a, dh, x_pool, offsets, dw13_accum, dw2_accum, sms) -> None:
    """The weight gradients added into fp32 accumulators, as :func:`backward` adds them: dW2 from (dy_pool, w * s),
    then dW13 from (dh, x_pool), each a k-grouped GEMM over the experts' pool rows."""
    k_grouped_bf16_gemm_tn(dy_pool, a, offsets, accumulate_into=dw2_accum, num_sms=sms)  # B10
    k_grouped_bf16_gemm_tn(dh, x_pool, offsets, accumulate_into=dw13_accum, num_sms=sms)


def deferred_wgrad(dy_pool, a, dh, x_pool, offsets, sms):
    """The :class:`~prime_kernels.mega.deferred.WgradLater` of a backward whose weight gradients wait: it keeps the
    operands and runs :func:`add_wgrad` on them."""
    from .deferred import WgradLater

    operands = (dy_pool, a, dh, x_pool, offsets)
    return WgradLater(lambda dw13_accum, dw2_accum: add_wgrad(*operands, dw13_accum, dw2_accum, sms), operands)


def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
             route_to_pool, *, activation_clamp=None, group=None, num_experts=None, recompute=False,
             need_wgrad=True, dw13_accum=None, dw2_accum=None, buffer=None, x_pool=None, num_sms=0,
             defer_wgrad=False):
    """Same contract as :func:`prime_kernels.mega.reference.backward`; ``num_sms`` as in :func:`forward`. With
    ``defer_wgrad`` it returns (dx, d topk_weights, a :class:`~prime_kernels.mega.deferred.WgradLater`) and computes
    no weight gradient now (the accumulators are not touched)."""
    sms = _sms(num_sms)
    if group is not None:
        raise RuntimeError("prime_kernels.mega: the grouped backend runs on a single rank (group=None)")
    capacity = pool_src_route.shape[0]
    route_to_pool = route_to_pool.contiguous()
    padding = PaddingRows(counts, offsets, route_to_pool.numel(), capacity)  # for every pool gathered below
    h = h_saved
    if recompute:
        h, x_pool = recompute_h(x, w13, counts, offsets, route_to_pool, capacity, x_pool, sms, activation_clamp,
                                padding)
    # B1 (gather), then B2-B6 and B9 in one GEMM: da stays in fp32 registers (0.80 ms against 0.94 for the nn
    # GEMM plus the pool-row kernel at 30B, T=16384 on the H200); with a clamp, B5's masks from the saved h.
    weights = topk_weights.float().contiguous()
    dy = _rows_for_kernels(dy.to(torch.bfloat16))
    # B1, token-major: each dy row read once (an index_select by pool row re-read rows from HBM: 0.26 vs
    # 0.17 ms at 30B, T=16384 on the H200). A padded plan's padding rows are zeroed.
    dy_pool = _gathered_pool(dy, route_to_pool, counts, offsets, capacity, padding)
    dh, a, dt_part = m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offsets, h, pool_src_route, weights,
                                                    clamp=activation_clamp, num_sms=sms)
    # d topk_weights per pool row: the per-128-column partials summed in column order, into a buffer whose last
    # entry is a zero that masked routes (route_to_pool = -1, which indexes the last entry) read.
    dt_pool = dt_part.new_empty(capacity + 1)
    dt_pool[capacity:].zero_()
    torch.sum(dt_part, 1, out=dt_pool[:capacity])
    del dt_part, h  # pool-sized buffers are freed as soon as their last reader is queued (lower peak memory)
    dx_pool = m_grouped_bf16_gemm_nn(dh, w13, offsets, num_sms=sms)  # B7
    dx = combine(dx_pool, route_to_pool, None)  # B8
    del dx_pool
    dtopk = dt_pool[route_to_pool.reshape(-1)].view_as(topk_weights).to(topk_weights.dtype)
    if defer_wgrad:
        if x_pool is None:
            x_pool = _gathered_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity, padding)
        return dx, dtopk, deferred_wgrad(dy_pool, a, dh, x_pool, offsets, sms)
    out13 = out2 = None
    if need_wgrad or dw13_accum is not None or dw2_accum is not None:
        if dw2_accum is not None:
            k_grouped_bf16_gemm_tn(dy_pool, a, offsets, accumulate_into=dw2_accum, num_sms=sms)  # B10 (add_wgrad's)
        elif need_wgrad:
            out2 = _wgrad(dy_pool, a, offsets, w2.dtype, sms)
        # dy_pool and w*s are dead once dW2 is queued: freed before dW13 (and a re-gathered x_pool) are allocated,
        # the backward's peak drops by P * (H + I) * 2 bytes (30B, T=16384: 0.7 GiB; 235B: 1.4 GiB)
        del dy_pool, a
        if x_pool is None:  # the forward did not keep its pooled rows
            x_pool = _gathered_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity, padding)
        if dw13_accum is not None:
            k_grouped_bf16_gemm_tn(dh, x_pool, offsets, accumulate_into=dw13_accum, num_sms=sms)
        elif need_wgrad:
            out13 = _wgrad(dh, x_pool, offsets, w13.dtype, sms)
    return dx, dtopk, out13, out2
