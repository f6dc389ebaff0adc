"""Shared experts inside the routed experts' launches: the grouped pipeline (BF16, one rank) over E routed and
S * m shared groups, the shared experts' weights read in place by the second-B GEMMs (:mod:`prime_kernels.second_b`).

A shared SwiGLU expert of intermediate size Is = m * I is m experts of size I (SwiGLU is separable over its
intermediate units), and "every token goes through it with weight g_t" is m more routes per token. So the layer with
S shared experts is the routed layer with E + S * m experts and K + S * m routes per token:

  SF1. routes K + s * m + j (s < S, j < m) of token t go to group E + s * m + j with weight gate[t, s] (1 without a
       gate): :func:`extended_routes`;
  SF2. F1-F6 and B1-B10 of :mod:`prime_kernels.mega.reference` over those routes, group E + s * m + j computing
       with chunk j of shared expert s (:func:`prime_kernels.second_b.expand_chunks`'s layout), so the combine (F5)
       sums routed and shared contributions in fp32 and rounds y once;
  SF3. the shared weights' gradients are their chunks' B10 put back in place (``collapse_chunks``), d gate is
       the sum over its routes' B9.

The shared groups come after the routed ones in every launch's tile order, so their tiles fill in behind the routed
tiles. The forward is the fused kernel with those groups' B tiles read from the shared weights where its status entry
is available (``mega_moe_shared_fused.bf16.sm90``), else the pipeline's second-B GEMMs. The L2 dgrad with the SwiGLU
backward and the weight gradients are two launches each (the routed groups, then the shared ones). Forward and
backward run every step through the ops, so on the CPU they run the ops' CPU kernels and are compared with the
reference there (which computes SF2 on the weights with the chunks as experts).
"""

from __future__ import annotations

import functools

import torch

from ._fused import run_bf16
from ._grouped import PaddingRows, _gathered_pool, _rows_for_kernels, _sms, _token_rows, _wgrad
from ..combine import combine
from ..routing import routing_plan
from ..second_b import (collapse_chunks, expand_chunks, m_grouped_bf16_gemm_nn_second_b,
                        m_grouped_bf16_gemm_nt_second_b, m_grouped_bf16_gemm_swiglu_bwd_into,
                        m_grouped_bf16_gemm_swiglu_second_b)


def chunks_of(inter: int, shared_inter: int) -> int | None:
    """m with Is = m * I, or None when the shared intermediate is not a multiple of the routed one."""
    return shared_inter // inter if inter > 0 and shared_inter % inter == 0 and shared_inter > 0 else None


def extended_routes(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, num_shared: int,
                    chunks: int, shared_gate: torch.Tensor | None = None):
    """SF1: (topk_idx [T, K + S m], topk_weights [T, K + S m]); shared_gate None, [T] or [T, S] (topk_weights' dtype)."""
    T = topk_idx.shape[0]
    groups = num_experts + torch.arange(num_shared * chunks, device=topk_idx.device, dtype=topk_idx.dtype)
    idx = torch.cat([topk_idx, groups.expand(T, -1)], dim=1)
    if shared_gate is None:
        gate = topk_weights.new_ones(T, num_shared * chunks)
    else:
        g = shared_gate.reshape(T, -1).expand(T, num_shared)
        gate = g.repeat_interleave(chunks, dim=1)
    return idx.contiguous(), torch.cat([topk_weights, gate.to(topk_weights.dtype)], dim=1).contiguous()


def forward(x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, *, chunks: int, activation_clamp=None,
            block_m: int, capacity: int, save_h: bool = True, num_sms=0, fused: bool = False):
    """The contract of :func:`prime_kernels.mega._grouped.forward` over the extended routes (``topk_idx`` and
    ``topk_weights`` from :func:`extended_routes`; groups E.. are the shared chunks). ``fused``: the fused forward
    kernel whose last groups read the shared weights (``mega_moe_fused_fwd_second_b``; the fused forward's state,
    which the backward below reads as the pipeline's), else the pipeline's second-B GEMMs."""
    T, K = topk_idx.shape
    num_groups = w13.shape[0] + shared_w13.shape[0] * chunks
    if fused:
        op = functools.partial(torch.ops.prime_kernels.mega_moe_fused_fwd_second_b, shared_w13=shared_w13.contiguous(),
                               shared_w2=shared_w2.contiguous(), chunks=chunks)
        return run_bf16(op, x, topk_idx, topk_weights, w13, w2, activation_clamp=activation_clamp,
                        num_experts=num_groups, block_m=block_m, capacity=capacity, save_h=save_h, keep_x_pool=False,
                        id_check=None, num_sms=num_sms)[:7]
    sms = _sms(num_sms)
    plan = routing_plan(topk_idx, num_groups, block_m, validate=False, capacity=capacity)
    offsets = plan.expert_offsets
    tok = _token_rows(plan.pool_src_route, K)
    s, h_saved = m_grouped_bf16_gemm_swiglu_second_b(x, w13, shared_w13, offsets, chunks=chunks, a_row_index=tok,
                                                     m_total=capacity, save_h=save_h, clamp=activation_clamp,
                                                     num_sms=sms)
    o = m_grouped_bf16_gemm_nt_second_b(s, w2, shared_w2, offsets, chunks=chunks, num_sms=sms)
    y = combine(o, plan.route_to_pool, topk_weights.float())
    return (y, h_saved, plan.expert_counts, offsets, plan.pool_src_route, plan.pool_src_rank,
            plan.route_to_pool.view(T, K))


def backward(dy, x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, h_saved, counts, offsets, pool_src_route,
             route_to_pool, *, chunks: int, activation_clamp=None, recompute=False, need_wgrad=True, num_sms=0):
    """(dx, d topk_weights over the extended routes, dW13, dW2, d shared_w13, d shared_w2), the weight gradients in
    their weights' dtype (None without ``need_wgrad``)."""
    sms = _sms(num_sms)
    E = w13.shape[0]
    capacity = pool_src_route.shape[0]
    route_to_pool = route_to_pool.contiguous()
    padding = PaddingRows(counts, offsets, route_to_pool.numel(), capacity)
    x_pool = _gathered_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity, padding)
    h = h_saved
    if recompute:  # the L1 with its epilogue saving h (its s is not used): the second-B L1 has no plain variant
        h = m_grouped_bf16_gemm_swiglu_second_b(x_pool, w13, shared_w13, offsets, chunks=chunks, save_h=True,
                                                clamp=activation_clamp, num_sms=sms)[1]
    weights = topk_weights.float().contiguous()
    dy_pool = _gathered_pool(_rows_for_kernels(dy.to(torch.bfloat16)), route_to_pool, counts, offsets, capacity,
                             padding)
    # the L2 dgrad as two launches into one set of outputs: the routed groups, then the shared chunks (their w2 columns
    # as experts: a copy of the shared weight only)
    inter = w2.shape[2]
    dh = dy_pool.new_empty(capacity, 2 * inter)
    a = dy_pool.new_empty(capacity, inter)
    dt_part = dy_pool.new_zeros(capacity, -(-inter // 128), dtype=torch.float32)
    for w2_part, offs in ((w2, offsets[: E + 1]), (expand_chunks(shared_w2, chunks, "w2"), offsets[E:])):
        m_grouped_bf16_gemm_swiglu_bwd_into(dy_pool, w2_part, offs, h, pool_src_route, weights, (dh, a, dt_part),
                                            clamp=activation_clamp, num_sms=sms)
    dt_pool = dt_part.new_empty(capacity + 1)
    dt_pool[capacity:].zero_()
    torch.sum(dt_part, 1, out=dt_pool[:capacity])
    del dt_part, h
    dx_pool = m_grouped_bf16_gemm_nn_second_b(dh, w13, shared_w13, offsets, chunks=chunks, num_sms=sms)
    dx = combine(dx_pool, route_to_pool, None)
    del dx_pool
    dtopk = dt_pool[route_to_pool.reshape(-1)].view_as(topk_weights).to(topk_weights.dtype)
    if not need_wgrad:
        return dx, dtopk, None, None, None, None
    routed, shared = offsets[: E + 1], offsets[E:]  # the k-grouped GEMMs take any first offset
    dw2 = _wgrad(dy_pool, a, routed, w2.dtype, sms)
    dsw2 = collapse_chunks(_wgrad(dy_pool, a, shared, shared_w2.dtype, sms), chunks, "w2")
    del dy_pool, a
    dw13 = _wgrad(dh, x_pool, routed, w13.dtype, sms)
    dsw13 = collapse_chunks(_wgrad(dh, x_pool, shared, shared_w13.dtype, sms), chunks, "w13")
    return dx, dtopk, dw13, dw2, dsw13, dsw2

