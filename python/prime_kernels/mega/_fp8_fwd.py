"""The FP8 forward (``precision="fp8"``) as a pipeline of our kernels, sm90.

Steps, in the reference's names (:mod:`prime_kernels.mega.reference`, W and F1-F6 of its FP8 section):

  W    the weights' FP8 tiles from the recipe's weight cache (:class:`fp8.Fp8WeightCache`), once per version.
  F1   x rows dispatched into the pool with qK(x, 128) (``dispatch_rows_fp8``); the plan's padding rows are zero
       bytes with zero scales, so every pool row an m-block reads is finite and the padding rows' s and h are zeros.
  F1-F3, F6  ``m_grouped_fp8_gemm_swiglu``: the FP8 L1 GEMM, SwiGLU on its fp32 accumulators, qK(s, 64) and h
       rounded once to bf16 for the backward, in one kernel.
  F4   ``m_grouped_fp8_gemm_nt(qK(s, 64), W2)``: the L2, promoted every 64 of K.
  F5   the combine (fp32 top-k weights, fixed k order).

The L1 tile holds 64 gate and 64 up columns, so s is quantized in 1 x 64 blocks: the pipeline runs the recipe with
``l2_act_block=64``, the default :class:`fp8.Fp8Recipe`. Single rank. With ``activation_clamp`` the L1 is the
kernel's clamp instantiation (F2 on its fp32 accumulators, h saved by F6's masked rounding). Every step is one of our kernels on CUDA and its CPU op on the CPU, so the whole pipeline runs on the CPU
and is compared with the reference there.
"""

from __future__ import annotations

import torch

from . import fp8 as _fp8
from ._grouped import _padding_row_index, _padding_span, _rows_for_kernels, _sms, _zero_padding_rows
from ..combine import combine
from ..grouped_gemm import k_block_major_empty, m_grouped_fp8_gemm_nt
from ..quantize import dispatch_rows_fp8
from ..routing import routing_plan
from ..swiglu_fwd_fp8 import CLAMP_KEY_STEM, S_BLOCK, m_grouped_fp8_gemm_swiglu

STATUS_KEY = "mega_moe_grouped.fp8.sm90"
CLAMP_STATUS_KEY = f"{CLAMP_KEY_STEM}.sm90"  # the L1 the pipeline runs with activation_clamp


def quantized_pool(x, route_to_pool, counts, offsets, capacity: int, pow2_scales: bool, zero_padding: bool = True):
    """qK(x, 128) of the token rows dispatched into a [capacity, H] pool (e4m3, and fp32 scales [capacity, ceil(H/128)]
    K-block major), each token row read once. With ``zero_padding`` the plan's padding rows are zeros (value bytes
    and scales; both are then views of buffers with ``span`` scratch rows past the pool, as
    :func:`_grouped._gathered_pool`), else they are left unspecified, for a consumer that ignores them."""
    hidden = x.shape[1]
    span = _padding_span(capacity, route_to_pool.numel(), counts.shape[0]) if zero_padding else 0
    q_buf = torch.empty(capacity + span, hidden, dtype=_fp8.E4M3, device=x.device)
    sa_buf = k_block_major_empty(capacity + span, -(-hidden // _fp8.BLOCK), x.device)
    q, sa = dispatch_rows_fp8(x, route_to_pool, capacity, pow2_scales=pow2_scales,
                              out=(q_buf[:capacity], sa_buf[:capacity]))
    if zero_padding:  # e4m3 has no index_fill: the bytes are zeroed (0x00 is +0)
        index = _padding_row_index(counts, offsets, route_to_pool.numel(), capacity)
        _zero_padding_rows(q_buf.view(torch.uint8), counts, offsets, route_to_pool.numel(), capacity, index)
        _zero_padding_rows(sa_buf, counts, offsets, route_to_pool.numel(), capacity, index)
    return q, sa


def l1(x, w13, counts, offsets, route_to_pool, capacity: int, recipe: _fp8.Fp8Recipe, cache, save_h: bool, sms,
       clamp: float | None = None):
    """W, F1-F3 and F6: the pooled qK(x) and the FP8 L1 with SwiGLU (:class:`prime_kernels.swiglu_fwd_fp8.Fp8SwigluFwd`),
    with the activation clamp ``clamp`` when not None."""
    check_recipe(recipe)
    c13 = cache.get(w13, recipe.pow2_scales)
    x_q, x_sa = quantized_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity, recipe.pow2_scales)
    return m_grouped_fp8_gemm_swiglu(x_q, x_sa, c13.weight.data, c13.weight.scale, offsets,
                                     pow2_scales=recipe.pow2_scales, save_h=save_h, num_sms=sms, clamp=clamp)


def recompute_h(x, w13, counts, offsets, route_to_pool, capacity: int, recipe, cache, sms,
                clamp: float | None = None) -> torch.Tensor:
    """The FP8 forward's saved h (F6) computed again, for a backward with ``recompute=True``: the same kernels on
    the same operands with the same clamp, so the same bits."""
    return l1(x, w13, counts, offsets, route_to_pool, capacity, recipe, cache, True, sms, clamp).h


def check_recipe(recipe: _fp8.Fp8Recipe) -> None:
    if recipe.l2_act_block != S_BLOCK:
        raise ValueError(f"prime_kernels.mega: the FP8 forward kernels quantize s in 1 x {S_BLOCK} blocks; a recipe "
                         f"with l2_act_block={recipe.l2_act_block} runs on backend='reference' only")


def forward(x, topk_idx, topk_weights, w13, w2, *, activation_clamp=None, group=None, num_experts=None,
            max_tokens_per_rank=None, block_m, capacity, save_h=True, buffer=None, id_check=None, num_sms=0,
            fp8_recipe=None, weight_cache=None):
    """Same contract as :func:`prime_kernels.mega.reference.forward` with ``precision="fp8"``; ``id_check`` and
    ``num_sms`` as in :func:`prime_kernels.mega._grouped.forward`."""
    if group is not None:
        raise RuntimeError("prime_kernels.mega: the FP8 forward pipeline runs on a single rank (group=None)")
    recipe, cache = _fp8.recipe_and_cache(fp8_recipe, weight_cache)
    sms = _sms(num_sms)
    T, K = topk_idx.shape
    plan = routing_plan(topk_idx, num_experts, block_m, validate=False, capacity=capacity)
    if id_check is not None:
        id_check.watch(plan.num_invalid)
    counts, offsets = plan.expert_counts, plan.expert_offsets
    route_to_pool = plan.route_to_pool.view(T, K)
    out = l1(x, w13, counts, offsets, route_to_pool, capacity, recipe, cache, save_h, sms, activation_clamp)
    h_saved = out.h if save_h else x.new_empty((0, w13.shape[1]))
    c2 = cache.get(w2, recipe.pow2_scales)
    o = m_grouped_fp8_gemm_nt(out.s_q, out.s_sa, c2.weight.data, c2.weight.scale, offsets, num_sms=sms)  # F4
    del out  # s is dead once the L2 is queued
    y = combine(o, route_to_pool, topk_weights.float())  # F5
    return (y, h_saved, counts, offsets, plan.pool_src_route, plan.pool_src_rank, route_to_pool)
