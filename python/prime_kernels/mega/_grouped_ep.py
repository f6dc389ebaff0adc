"""The grouped backend under expert parallelism: the all-to-all path (bf16).

R ranks of ``group`` each hold El = E / R experts (rank r the global ids [r*El, (r+1)*El)) and their own T tokens (T
may differ per rank, 0 included). The plan is the reference's group plan
(:func:`prime_kernels.mega._plan.build_plan`): rank r's pool is the slice, for its experts, of the one-rank pool
over all ranks' tokens concatenated in rank order, so its rows are in (expert, source rank, token, k) order and each
expert's rows start on a multiple of ``block_m``, as on one rank. Rows move between a rank's routes and the owning
ranks' pools with ``all_to_all_single`` (:class:`prime_kernels.mega.reference.Exchange` through
:mod:`prime_kernels.mega._comm`: a torch.distributed group, NCCL on GPUs and gloo staging CUDA tensors through host
memory, or a :class:`~prime_kernels.mega.loopback.LoopbackGroup` of R threads of one process). Between the exchanges
run the grouped pipeline's kernels on the local pool:

  forward   x rows -> pool; L1 with SwiGLU (h saved); L2 -> o rows back to their routes; the combine over the
            route slots with the top-k weights, on the source rank;
  backward  dy rows and the routes' top-k weights (and x rows, unless the forward kept its pool) -> pool; the L2
            dgrad with the SwiGLU backward, reading each row's weight through a pool-local route index; the L1
            dgrad -> dx rows and d topk_weights back to their routes; the dX combine on the source rank; the
            k-grouped weight gradients on the local pool.

Why the result is the one-rank call's, bit for bit: every GEMM of an expert sees the rows it sees on one rank, in
the same order, from the same block-aligned start, so its outputs and its k-grouped sums are the same; the combines
read the route slots in (token, k) order with the same kernel and weights as the one-rank combine reads the pool;
d topk_weights is the same per-row sum of the same partials. Shapes, dtypes, precision, backend or options that
disagree across ranks raise the same ValueError on every rank at the plan's first collective, before any exchange;
every wait is a collective of the process group, bounded by its timeout.

The exchanges run on the calling stream and block it; splitting the tokens into chunks so that one chunk's exchange
runs under another's GEMMs is not done here.
"""

from __future__ import annotations

import torch

from ..combine import combine
from ..grouped_gemm import (
    k_grouped_bf16_gemm_tn,
    m_grouped_bf16_gemm_nn,
    m_grouped_bf16_gemm_nt,
    m_grouped_bf16_gemm_swiglu,
    m_grouped_bf16_gemm_swiglu_bwd,
)
from ._grouped import _wgrad, deferred_wgrad
from ._plan import build_plan
from .reference import Exchange


def _slot_index(topk_idx: torch.Tensor) -> torch.Tensor:
    """The combine's route_to_pool over route slots [T * K, H] in (token, k) order: route t*K + k reads slot t*K + k,
    a masked route (-1) reads nothing."""
    T, K = topk_idx.shape
    slots = torch.arange(T * K, dtype=torch.int32, device=topk_idx.device).view(T, K)
    return torch.where(topk_idx >= 0, slots, torch.full_like(slots, -1)).contiguous()


def _combine_slots(slots: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The one-rank combine's fixed-k-order fp32 sum over this rank's route slots (zero rows for T = 0)."""
    if topk_idx.shape[0] == 0:
        return slots.new_zeros((0, slots.shape[1]))
    return combine(slots, _slot_index(topk_idx), weights)


def _sms(num_sms):
    return num_sms if num_sms else None


def _has_rows(offsets: torch.Tensor) -> bool:
    """Whether any local expert received a row (the GEMMs take no all-empty plan)."""
    return int(offsets[-1]) > 0


def forward(x, topk_idx, topk_weights, w13, w2, *, activation_clamp=None, group, num_experts, max_tokens_per_rank,
            block_m, capacity, save_h=True, num_sms=0, agreement=None):
    """The forward over ``group``. Returns ((y, h, expert_counts, expert_offsets, pool_src_route, pool_src_rank,
    route_to_pool), x_pool): the reference forward's contract (pool_src_route / pool_src_rank name the route on its
    source rank; route_to_pool the row in the owning rank's pool), and the pooled x rows [capacity, H].
    ``agreement``: what every rank must agree on (:func:`prime_kernels.mega._plan.agreement_fields`)."""
    sms = _sms(num_sms)
    T, K = topk_idx.shape
    H = x.shape[1]
    twoI = w13.shape[1]
    counts, offsets, src, srank, r2p = build_plan(topk_idx, num_experts, block_m, capacity, group,
                                                  max_tokens_per_rank, agreement)
    ex = Exchange(topk_idx, r2p, src, srank, num_experts, group)
    tok = torch.div(ex.send_order, K, rounding_mode="floor")
    (x_pool,) = ex.to_pool([x.to(torch.bfloat16)[tok]])  # padding rows are zeros, as the one-rank gather's
    if _has_rows(offsets):
        s, h = m_grouped_bf16_gemm_swiglu(x_pool, w13, offsets, m_total=capacity, save_h=save_h,
                                          clamp=activation_clamp, num_sms=sms)
        o = m_grouped_bf16_gemm_nt(s, w2, offsets, num_sms=sms)
        del s
    else:
        h = x_pool.new_zeros((capacity if save_h else 0, twoI))
        o = x_pool.new_zeros((capacity, H))
    (slots,) = ex.to_routes([o], T * K)
    del o
    y = _combine_slots(slots, topk_idx, topk_weights.float().contiguous())
    return (y, h, counts, offsets, src, srank, r2p), x_pool


def _add_wgrad(dy_pool, a, dh, x_pool, offsets, need_wgrad, dw13_accum, dw2_accum, w13, w2, sms):
    """dW2 from (dy_pool, w * s) and dW13 from (dh, x_pool), each a k-grouped GEMM over the local experts' rows, as
    the one-rank backward runs them: added into the fp32 accumulators when given, else in the weights' dtype (None
    when not asked for). An empty local pool runs no GEMM: zero gradients, the accumulators untouched."""
    out13 = out2 = None
    if not _has_rows(offsets):
        return (w13.new_zeros(w13.shape) if need_wgrad and dw13_accum is None else None,
                w2.new_zeros(w2.shape) if need_wgrad and dw2_accum is None else None)
    if dw2_accum is not None:
        k_grouped_bf16_gemm_tn(dy_pool, a, offsets, accumulate_into=dw2_accum, num_sms=sms)
    elif need_wgrad:
        out2 = _wgrad(dy_pool, a, offsets, w2.dtype, sms)
    if dw13_accum is not None:
        k_grouped_bf16_gemm_tn(dh, x_pool, offsets, accumulate_into=dw13_accum, num_sms=sms)
    elif need_wgrad:
        out13 = _wgrad(dh, x_pool, offsets, w13.dtype, sms)
    return out13, out2


def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
             route_to_pool, *, activation_clamp=None, group, num_experts, recompute=False, need_wgrad=True,
             dw13_accum=None, dw2_accum=None, x_pool=None, num_sms=0, defer_wgrad=False):
    """The backward over ``group``, with the grouped backward's contract (:func:`prime_kernels.mega._grouped.backward`):
    (dx, d topk_weights, dw13, dw2), or with ``defer_wgrad`` (dx, d topk_weights, a WgradLater). ``x_pool``: the
    forward's pooled rows (else the x rows are exchanged again)."""
    sms = _sms(num_sms)
    T, K = topk_idx.shape
    H = x.shape[1]
    capacity = pool_src_route.shape[0]
    ex = Exchange(topk_idx, route_to_pool, pool_src_route, pool_src_rank, num_experts, group)
    tok = torch.div(ex.send_order, K, rounding_mode="floor")
    w_routes = topk_weights.reshape(-1)[ex.send_order].float()
    send = [dy.to(torch.bfloat16)[tok], w_routes]
    if x_pool is None:
        send.append(x.to(torch.bfloat16)[tok])
    pooled = ex.to_pool(send)
    dy_pool, w_pool = pooled[0], pooled[1].contiguous()
    if x_pool is None:
        x_pool = pooled[2]
    # each pool row reads its own top-k weight: route index = its row (-1 for padding rows, weight 0)
    rows = torch.arange(capacity, dtype=torch.int32, device=x.device)
    local_route = torch.where(pool_src_route >= 0, rows, torch.full_like(rows, -1))
    if _has_rows(offsets):
        h = h_saved
        if recompute:
            _, h = m_grouped_bf16_gemm_swiglu(x_pool, w13, offsets, m_total=capacity, save_h=True,
                                              clamp=activation_clamp, num_sms=sms)
        dh, a, dt_part = m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offsets, h, local_route, w_pool,
                                                        clamp=activation_clamp, num_sms=sms)
        del h
        dt_pool = torch.sum(dt_part, 1)  # the one-rank backward's sum of the same partials, in column order
        dx_pool = m_grouped_bf16_gemm_nn(dh, w13, offsets, num_sms=sms)
    else:
        twoI, I = w13.shape[1], w2.shape[2]
        dh, a = dy_pool.new_zeros((capacity, twoI)), dy_pool.new_zeros((capacity, I))
        dt_pool, dx_pool = w_pool.new_zeros((capacity,)), dy_pool.new_zeros((capacity, H))
    dx_slots, dt_routes = ex.to_routes([dx_pool, dt_pool], T * K)
    del dx_pool
    dx = _combine_slots(dx_slots, topk_idx, None)
    dtopk = dt_routes.view(T, K).to(topk_weights.dtype)
    if defer_wgrad:
        if not _has_rows(offsets):  # nothing to add later
            from .deferred import WgradLater

            return dx, dtopk, WgradLater(lambda dw13_accum, dw2_accum: None, ())
        return dx, dtopk, deferred_wgrad(dy_pool, a, dh, x_pool, offsets, sms)
    if not (need_wgrad or dw13_accum is not None or dw2_accum is not None):
        return dx, dtopk, None, None
    out13, out2 = _add_wgrad(dy_pool, a, dh, x_pool, offsets, need_wgrad, dw13_accum, dw2_accum, w13, w2, sms)
    return dx, dtopk, out13, out2
