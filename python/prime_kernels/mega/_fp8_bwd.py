"""The FP8 backward (``precision="fp8_bwd"`` and the backward of ``"fp8"``) as a pipeline of our kernels, sm90.

Steps, in the reference's names (:mod:`prime_kernels.mega.reference`, B1-B10 of its FP8 section):

  B1   qK(dy_p, 128) dispatched from the token rows (``dispatch_rows_fp8``; padding rows left unwritten, the L2 dgrad
       ignores them), and for dW2 qT(dy_e) read from the token rows through the plan's pool_src_route
       (``quantize_tokens_fp8`` gathering: padding rows zero, no bf16 pool written).
  B2-B6, B9  the FP8 L2 dgrad with the SwiGLU backward in its epilogue (``m_grouped_fp8_gemm_swiglu_bwd``): da in
       fp32 from the
       FP8 GEMM, d topk_weights partials per 128 columns of I, dh = [dg, du] in fp32 quantized twice (qK along 2I
       for B7, qT per expert for dW13) and a = w * s quantized qT for dW2, all inside the tile that computes
       them.
  B7   ``m_grouped_fp8_gemm_nt(qK(dh), W13^T)``, B8 the BF16 combine (fixed k order). Where
       ``mega_moe_backward.fp8.sm90`` is available, B2-B7 are one persistent kernel
       (``mega_moe_fp8_dgrad_fused``: the same tiles, the same bits).
  B10  ``k_grouped_fp8_gemm_tn`` twice; the x rows quantized qT from bf16 (``quantize_tokens_fp8``, gathering from
       the token rows unless the forward kept its pooled rows).
The weights' FP8 tiles and their transposes come from the recipe's weight cache (:class:`fp8.Fp8WeightCache`),
made once per version of the weight.

Every step is one of our kernels on CUDA and its CPU op on the CPU, so on the CPU the whole pipeline runs and is
compared with the reference.
"""

from __future__ import annotations

import torch

from . import _fp8_fwd, fp8 as _fp8
from ._grouped import _rows_for_kernels, _sms, recompute_h
from ..combine import combine
from ..grouped_gemm import k_grouped_fp8_gemm_tn, m_grouped_fp8_gemm_nt
from ..quantize import quantize_tokens_fp8
from .. import _status
from ..swiglu_bwd_fp8 import FUSED_KEY as FUSED_DGRAD_KEY
from ..swiglu_bwd_fp8 import FUSED_MAX_EXPERTS, m_grouped_fp8_gemm_swiglu_bwd, mega_moe_fp8_dgrad_fused


def _fused_dgrad_runs(device: torch.device, w2t_q: torch.Tensor) -> bool:
    """B2-B7 in one kernel: where FUSED_DGRAD_KEY is available, I a multiple of 128, at most FUSED_MAX_EXPERTS
    experts, on CUDA."""
    experts, inter = w2t_q.shape[0], w2t_q.shape[1]
    return (device.type == "cuda" and inter % 128 == 0 and experts <= FUSED_MAX_EXPERTS
            and _status.is_available(_status.reason(FUSED_DGRAD_KEY)))


def _wgrad(a, sa, b, sb, offsets, dtype, accum, sms):
    """a_g^T b_g for every expert: added into ``accum`` (fp32) when given (returns None), else returned in the
    parameter's dtype (a bf16 weight's gradient rounded once, in the GEMM's epilogue)."""
    if accum is not None:
        k_grouped_fp8_gemm_tn(a, sa, b, sb, offsets, accumulate_into=accum, num_sms=sms)
        return None
    out_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return k_grouped_fp8_gemm_tn(a, sa, b, sb, offsets, out_dtype=out_dtype, num_sms=sms).to(dtype)


def data_grads(dy, w13t, w2t, h_saved, counts, offsets, pool_src_route, route_to_pool, topk_weights, *, pow2: bool,
               sms, want_wgrad_operands: bool, clamp=None, dy_t_out=None, l2_out=None):
    """B1-B9: (dx bf16 [T, H], dtopk fp32 [T, K], qT(dy_e) or None, :class:`Fp8SwigluBwd` of the L2 dgrad).

    ``w13t`` / ``w2t``: the (e4m3, 128 x 128 scales) pairs of the transposed weights; ``h_saved`` the forward's
    bf16 h; ``topk_weights`` fp32 [T, K]. ``want_wgrad_operands``: quantize qT(dy_e) for dW2 (into ``dy_t_out``
    when given); the L2 dgrad's qT(dh) and qT(w * s) are in the returned tuple (written into ``l2_out`` when
    given). Every pool-sized buffer but those is dead when this returns."""
    capacity = pool_src_route.shape[0]
    dy = _rows_for_kernels(dy.to(torch.bfloat16))
    # B1: qK(dy_p) dispatched from the token rows (each read once); its padding rows are left as they are (the L2
    # dgrad writes zeros for every row no route names, whatever its operands hold there).
    dy_q, dy_qs = _fp8_fwd.quantized_pool(dy, route_to_pool, counts, offsets, capacity, pow2, zero_padding=False)
    dy_t = None
    if want_wgrad_operands:  # qT(dy_e), each pool row read from its token row (no bf16 pool is written)
        dy_t = quantize_tokens_fp8(dy, offsets, counts, pow2_scales=pow2, pool_src_route=pool_src_route,
                                   top_k=route_to_pool.shape[1], out=dy_t_out)
    dx_pool = None
    if _fused_dgrad_runs(dy.device, w2t[0]):  # B2-B7
        l2, dx_pool = mega_moe_fp8_dgrad_fused(dy_q, dy_qs, w2t[0], w2t[1], w13t[0], w13t[1], offsets, h_saved,
                                               pool_src_route, topk_weights, clamp=clamp, pow2_scales=pow2,
                                               num_sms=sms, out=l2_out)
    else:  # B2-B6, B9 in one kernel (its CPU op: the recipe's emulation)
        l2 = m_grouped_fp8_gemm_swiglu_bwd(dy_q, dy_qs, w2t[0], w2t[1], offsets, h_saved, pool_src_route,
                                           topk_weights, clamp=clamp, pow2_scales=pow2, num_sms=sms, out=l2_out)
    del dy_q, dy_qs
    # d topk_weights per pool row: the per-128-column partials summed in column order; masked routes
    # (route_to_pool = -1) read the zero past the pool's end
    dt_pool = l2.dt_part.new_zeros(capacity + 1)
    torch.sum(l2.dt_part, 1, out=dt_pool[:capacity])
    if dx_pool is None:
        dx_pool = m_grouped_fp8_gemm_nt(l2.dh_q, l2.dh_sa, w13t[0], w13t[1], offsets, num_sms=sms)  # B7
    dx = combine(dx_pool, route_to_pool, None)  # B8
    del dx_pool
    dtopk = dt_pool[route_to_pool.reshape(-1)].view(route_to_pool.shape)
    return dx, dtopk, dy_t, l2


def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
             route_to_pool, *, activation_clamp=None, group=None, num_experts=None, recompute=False,
             need_wgrad=True, dw13_accum=None, dw2_accum=None, buffer=None, x_pool=None, num_sms=0,
             precision="fp8_bwd", fp8_recipe=None, weight_cache=None):
    """Same contract as :func:`prime_kernels.mega.reference.backward` with ``precision="fp8_bwd"`` (the bf16
    forward's state: h saved, or recomputed by the bf16 L1 GEMM; with ``activation_clamp`` h keeps the clamp masks
    and the FP8 L2 dgrad applies the clamp's gradient rule); single rank. With ``precision="fp8"`` (an FP8 forward's
    saved h) the same steps run, and a recompute runs the FP8 forward's L1 again with the same clamp
    (:func:`_fp8_fwd.recompute_h`: the same bits as the saved h)."""
    if group is not None:
        raise RuntimeError("prime_kernels.mega: the FP8 backward pipeline runs on a single rank (group=None)")
    recipe, cache = _fp8.recipe_and_cache(fp8_recipe, weight_cache)
    pow2 = recipe.pow2_scales
    c13, c2 = cache.get(w13, pow2), cache.get(w2, pow2)  # W: once per version of the weights
    sms = _sms(num_sms)
    capacity = pool_src_route.shape[0]
    route_to_pool = route_to_pool.contiguous()
    if recompute and precision == "fp8":
        h_saved = _fp8_fwd.recompute_h(x, w13, counts, offsets, route_to_pool, capacity, recipe, cache, sms,
                                       activation_clamp)
    elif recompute:
        h_saved, x_pool = recompute_h(x, w13, counts, offsets, route_to_pool, capacity, x_pool, sms, activation_clamp)
    want_w = need_wgrad or dw13_accum is not None or dw2_accum is not None
    dx, dtopk, dy_t, l2 = data_grads(dy, (c13.transposed.data, c13.transposed.scale),
                                     (c2.transposed.data, c2.transposed.scale), h_saved, counts, offsets,
                                     pool_src_route, route_to_pool, topk_weights.float().contiguous(), pow2=pow2,
                                     sms=sms, want_wgrad_operands=want_w, clamp=activation_clamp)
    dtopk = dtopk.to(topk_weights.dtype)
    top_k = route_to_pool.shape[1]
    out13 = out2 = None
    if want_w:
        if dw2_accum is not None or need_wgrad:  # B10: dW2[e] = qT(dy_e)^T qT(a_e)
            out2 = _wgrad(dy_t[0], dy_t[1], l2.awt_q, l2.awt_s, offsets, w2.dtype, dw2_accum, sms)
        del dy_t
        if x_pool is None:  # the forward did not keep its pooled rows: qT(x_e) from the token rows
            x_t = quantize_tokens_fp8(_rows_for_kernels(x), offsets, counts, pow2_scales=pow2,
                                      pool_src_route=pool_src_route, top_k=top_k)
        else:
            x_t = quantize_tokens_fp8(x_pool, offsets, counts, pow2_scales=pow2)  # qT(x_e) from bf16
        if dw13_accum is not None or need_wgrad:  # B10: dW13[e] = qT(dh_e)^T qT(x_e)
            out13 = _wgrad(l2.dht_q, l2.dht_s, x_t[0], x_t[1], offsets, w13.dtype, dw13_accum, sms)
    return dx, dtopk, out13, out2
