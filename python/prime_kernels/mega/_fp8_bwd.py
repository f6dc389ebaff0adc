"""The FP8 backward (``precision="fp8_bwd"`` and the backward of ``"fp8"``) as a pipeline of our kernels, sm90.

Steps, in the reference's names (:mod:`prime_kernels.mega.reference`, B1-B10 of its FP8 section):

  B1   dy rows gathered into the pool (bf16, padding rows zero), then qK(dy_p, 128) of every pool row
       (``dispatch_rows_fp8`` over the pool, so the padding rows quantize to zeros) and qT(dy_e)
       (``quantize_tokens_fp8``) for dW2.
  B2-B6, B9  the FP8 L2 dgrad with the SwiGLU backward in its epilogue (:func:`l2_dgrad`): da in fp32 from the
       FP8 GEMM, d topk_weights partials per 128 columns of I, dh = [dg, du] in fp32 quantized twice (qK along 2I
       for B7, qT per expert for dW13) and a = w * s quantized qT for dW2, all inside the tile that computes them.
  B7   ``m_grouped_fp8_gemm_nt(qK(dh), W13^T)``, B8 the BF16 combine (fixed k order).
  B10  ``k_grouped_fp8_gemm_tn`` twice; the x rows quantized qT from bf16 (``quantize_tokens_fp8``).
The weights' FP8 tiles and their transposes come from the recipe's weight cache (:class:`fp8.Fp8WeightCache`),
made once per version of the weight.

:func:`l2_dgrad` is written here as the recipe computes it (the reference's arithmetic, laid out as the kernels
exchange it). It is the step the FP8 L2-dgrad kernel replaces on CUDA; everything else already runs as our
kernels (their CPU ops on the CPU), so on the CPU the whole pipeline runs and is compared with the reference.
"""

from __future__ import annotations

import torch

from . import fp8 as _fp8
from ._grouped import _gathered_pool, _rows_for_kernels, _sms, recompute_h
from ..combine import combine
from ..grouped_gemm import k_block_major_empty, k_grouped_fp8_gemm_tn, m_grouped_fp8_gemm_nt
from ..quantize import dispatch_rows_fp8, quantize_tokens_fp8

BLOCK = _fp8.BLOCK


class L2DgradOutputs:
    """What the FP8 L2 dgrad hands on, in the layouts the FP8 GEMMs read.

    ``dh_q`` e4m3 [P, 2I] and ``dh_qs`` fp32 [P, 2I/128] K-block major: qK(dh, 128), the A operand of the L1 dgrad.
    ``dh_t`` e4m3 [2I, P] and ``dh_ts`` fp32 [2I, ceil(P/128)]: qT(dh) per expert, token axis contiguous (dW13's A).
    ``a_t`` e4m3 [I, P] and ``a_ts`` fp32 [I, ceil(P/128)]: qT(w * s) per expert (dW2's B).
    ``dt_part`` fp32 [P, I/128]: per pool row, sum over each 128 columns of I of da * s (summed in column order
    afterwards). Padding rows and rows in no expert: zeros everywhere."""

    __slots__ = ("dh_q", "dh_qs", "dh_t", "dh_ts", "a_t", "a_ts", "dt_part")

    def __init__(self, dh_q, dh_qs, dh_t, dh_ts, a_t, a_ts, dt_part):
        self.dh_q, self.dh_qs, self.dh_t, self.dh_ts = dh_q, dh_qs, dh_t, dh_ts
        self.a_t, self.a_ts, self.dt_part = a_t, a_ts, dt_part


def _token_major(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed qT operand [cols, rows] (row stride rounded up to 16 bytes, as the k-grouped GEMM needs) and its
    K-block-major scales [cols, ceil(rows / 128)], ones (a zero block's scale)."""
    q = torch.zeros(cols, (rows + 15) // 16 * 16, dtype=_fp8.E4M3, device=device)[:, :rows]
    s = k_block_major_empty(cols, (rows + BLOCK - 1) // BLOCK, device)
    s.fill_(1.0)
    return q, s


def l2_dgrad(dy_q, dy_qs, w2_t: _fp8.BlockQuantized, h, pool_src_route, topk_weights, expert_offsets,
             expert_counts, *, pow2_scales: bool = False) -> L2DgradOutputs:
    """B2-B6 and B9 of the recipe over the pool: dy_q e4m3 [P, H] and dy_qs [P, H/128] (qK of the pool rows),
    ``w2_t`` the cached W2^T tiles [E, I, H], h bf16 [P, 2I] (gate | up, as saved), pool_src_route int32 [P] (the
    route of each pool row, -1 for padding), topk_weights fp32 [T, K], expert_offsets int32 [E + 1] and
    expert_counts int32 [E] of the plan (every expert's first row a multiple of 128); H and I multiples of 128.
    No activation clamp."""
    P, twoI = h.shape
    I = twoI // 2
    if I % BLOCK or dy_q.shape[1] % BLOCK:
        raise ValueError(f"prime_kernels.mega: the FP8 backward takes H and I in multiples of {BLOCK}, got "
                         f"H={dy_q.shape[1]}, I={I}")
    dev = h.device
    dh_q = torch.zeros(P, twoI, dtype=_fp8.E4M3, device=dev)
    dh_qs = k_block_major_empty(P, twoI // BLOCK, dev)
    dh_qs.fill_(1.0)
    dh_t, dh_ts = _token_major(P, twoI, dev)
    a_t, a_ts = _token_major(P, I, dev)
    dt_part = torch.zeros(P, I // BLOCK, dtype=torch.float32, device=dev)
    w_routes = topk_weights.reshape(-1).float()
    off, cnt = expert_offsets.tolist(), expert_counts.tolist()
    for e, n in enumerate(cnt):
        if n == 0:
            continue
        lo, hi = off[e], off[e] + n
        dy_e = _fp8.BlockQuantized(dy_q[lo:hi], dy_qs[lo:hi], 1, BLOCK)
        da = _fp8.fp8_gemm_nt(dy_e, w2_t[e])  # B2, fp32 [n, I]
        hf = h[lo:hi].float()
        g, u = hf[:, :I], hf[:, I:]
        sig = torch.sigmoid(g)
        silu = g * sig
        s = silu * u
        dt_part[lo:hi] = (da * s).view(n, I // BLOCK, BLOCK).sum(-1)  # B3, per 128 columns
        w = w_routes[pool_src_route[lo:hi].long()].unsqueeze(1)
        ds = w * da  # B4
        dh = torch.cat([ds * u * sig * (1 + g * (1 - sig)), ds * silu], 1)  # B6, fp32
        qk = _fp8.quantize_along_k(dh, BLOCK, pow2_scales)
        dh_q[lo:hi] = qk.data
        dh_qs[lo:hi] = qk.scale
        blocks = slice(lo // BLOCK, (hi + BLOCK - 1) // BLOCK)
        qt = _fp8.quantize_along_tokens(dh, BLOCK, pow2_scales)
        dh_t[:, lo:hi] = qt.data.t()
        dh_ts[:, blocks] = qt.scale.t()
        qa = _fp8.quantize_along_tokens(w * s, BLOCK, pow2_scales)  # B9
        a_t[:, lo:hi] = qa.data.t()
        a_ts[:, blocks] = qa.scale.t()
    return L2DgradOutputs(dh_q, dh_qs, dh_t, dh_ts, a_t, a_ts, dt_part)


def _wgrad(a, sa, b, sb, offsets, dtype, accum, sms):
    """a_g^T b_g for every expert: added into ``accum`` (fp32) when given (returns None), else returned in the
    parameter's dtype (a bf16 weight's gradient rounded once, in the GEMM's epilogue)."""
    if accum is not None:
        k_grouped_fp8_gemm_tn(a, sa, b, sb, offsets, accumulate_into=accum, num_sms=sms)
        return None
    out_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return k_grouped_fp8_gemm_tn(a, sa, b, sb, offsets, out_dtype=out_dtype, num_sms=sms).to(dtype)


def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
             route_to_pool, *, activation_clamp=None, group=None, num_experts=None, recompute=False,
             need_wgrad=True, dw13_accum=None, dw2_accum=None, buffer=None, x_pool=None, num_sms=0,
             precision="fp8_bwd", fp8_recipe=None, weight_cache=None):
    """Same contract as :func:`prime_kernels.mega.reference.backward` with ``precision="fp8_bwd"`` (the bf16
    forward's state: h saved, or recomputed by the bf16 L1 GEMM); single rank, no activation clamp. With
    ``precision="fp8"`` (an FP8 forward's saved h) the same steps run; its recompute would need the FP8 L1."""
    if precision == "fp8" and recompute:
        raise RuntimeError("prime_kernels.mega: recompute=True with precision='fp8' needs the FP8 L1 GEMM, which "
                           "the FP8 backward pipeline does not run")
    if group is not None:
        raise RuntimeError("prime_kernels.mega: the FP8 backward pipeline runs on a single rank (group=None)")
    if activation_clamp is not None:
        raise RuntimeError("prime_kernels.mega: the FP8 backward pipeline does not take activation_clamp yet")
    recipe = fp8_recipe or _fp8.DEFAULT_RECIPE
    pow2 = recipe.pow2_scales
    cache = _fp8.WEIGHT_CACHE if weight_cache is None else weight_cache
    c13, c2 = cache.get(w13, pow2), cache.get(w2, pow2)  # W: once per version of the weights
    sms = _sms(num_sms)
    capacity = pool_src_route.shape[0]
    route_to_pool = route_to_pool.contiguous()
    if recompute:
        h_saved, x_pool = recompute_h(x, w13, counts, offsets, route_to_pool, capacity, x_pool, sms)
    dy = _rows_for_kernels(dy.to(torch.bfloat16))
    dy_pool = _gathered_pool(dy, route_to_pool, counts, offsets, capacity)  # B1, padding rows zero
    every_row = torch.arange(capacity, dtype=torch.int32, device=dy.device).view(capacity, 1)
    dy_q, dy_qs = dispatch_rows_fp8(dy_pool, every_row, capacity, pow2_scales=pow2)  # qK(dy_p), padding -> 0
    want_w = need_wgrad or dw13_accum is not None or dw2_accum is not None
    dy_t = quantize_tokens_fp8(dy_pool, offsets, counts, pow2_scales=pow2) if want_w else None  # qT(dy_e)
    del dy_pool
    l2 = l2_dgrad(dy_q, dy_qs, c2.transposed, h_saved, pool_src_route, topk_weights.float().contiguous(), offsets,
                  counts, pow2_scales=pow2)
    del dy_q, dy_qs
    # d topk_weights per pool row: the per-128-column partials summed in column order; masked routes
    # (route_to_pool = -1) read the zero past the pool's end
    dt_pool = l2.dt_part.new_zeros(capacity + 1)
    torch.sum(l2.dt_part, 1, out=dt_pool[:capacity])
    dx_pool = m_grouped_fp8_gemm_nt(l2.dh_q, l2.dh_qs, c13.transposed.data, c13.transposed.scale, offsets,
                                    num_sms=sms)  # B7
    dx = combine(dx_pool, route_to_pool, None)  # B8
    del dx_pool
    dtopk = dt_pool[route_to_pool.reshape(-1)].view_as(topk_weights).to(topk_weights.dtype)
    out13 = out2 = None
    if want_w:
        if dw2_accum is not None or need_wgrad:  # B10: dW2[e] = qT(dy_e)^T qT(a_e)
            out2 = _wgrad(dy_t[0], dy_t[1], l2.a_t, l2.a_ts, offsets, w2.dtype, dw2_accum, sms)
        del dy_t
        if x_pool is None:  # the forward did not keep its pooled rows
            x_pool = _gathered_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity)
        x_t = quantize_tokens_fp8(x_pool, offsets, counts, pow2_scales=pow2)  # qT(x_e) from bf16
        if dw13_accum is not None or need_wgrad:  # B10: dW13[e] = qT(dh_e)^T qT(x_e)
            out13 = _wgrad(l2.dh_t, l2.dh_ts, x_t[0], x_t[1], offsets, w13.dtype, dw13_accum, sms)
    return dx, dtopk, out13, out2
