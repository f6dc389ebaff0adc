"""The grouped backend under expert parallelism: the all-to-all path (bf16, fp8 and fp8_bwd).

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

FP8 (``precision="fp8"`` forward, ``"fp8"`` and ``"fp8_bwd"`` backward): the exchanges carry bf16 rows, and the
FP8 pipeline's functions (:mod:`prime_kernels.mega._fp8_fwd`, :mod:`prime_kernels.mega._fp8_bwd`) run on the pool as
if its rows were tokens with one route each (route_to_pool the identity on the used rows, -1 on padding rows): every
quantization of the recipe is per row (qK) or per expert's rows from its first pool row (qT), so it sees the values
the one-rank pipeline quantizes, and the per-row results (dx rows, d topk_weights) go back to be combined on the
source rank as above.

In one chunk (the default) the exchanges run on the calling stream and block it; with ``chunks`` > 1 the bf16 path
runs in :mod:`prime_kernels.mega._ep_chunks`, each chunk's exchange under another's GEMMs, with the same bits.
"""

from __future__ import annotations

import torch

from . import _ep_chunks, _fp8_bwd, _fp8_fwd, fp8 as _fp8
from ..combine import combine, dispatch_rows
from ..grouped_gemm import (
    k_grouped_bf16_gemm_tn,
    m_grouped_bf16_gemm_nn,
    m_grouped_bf16_gemm_nt,
    m_grouped_bf16_gemm_swiglu,
    m_grouped_bf16_gemm_swiglu_bwd,
    m_grouped_fp8_gemm_nt,
)
from ..quantize import quantize_tokens_fp8
from ._grouped import _sms, _wgrad, deferred_wgrad, recompute_h
from ._plan import build_plan
from .constants import BLOCK_M
from .reference import FP8_PRECISIONS, Exchange, gather_rows


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


def _pool_routes(pool_src_route: torch.Tensor) -> torch.Tensor:
    """The pool's rows as routes of their own, [capacity] int32: row m is route m (each row reads its own top-k
    weight, its own token row), -1 for the padding rows."""
    rows = torch.arange(pool_src_route.shape[0], dtype=torch.int32, device=pool_src_route.device)
    return torch.where(pool_src_route >= 0, rows, torch.full_like(rows, -1))


def _route_to_send(ex: Exchange, T: int, K: int) -> torch.Tensor:
    """[T, K] int32: each route's row in this rank's send order (-1: masked). The rows that come back arrive in that
    order too, so the same map drives the send-side dispatch and the combine."""
    r2s = torch.full((T * K,), -1, dtype=torch.int32, device=ex.send_order.device)
    r2s[ex.send_order] = torch.arange(ex.send_order.numel(), dtype=torch.int32, device=r2s.device)
    return r2s.view(T, K)


def _send_token_rows(x: torch.Tensor, route_to_send: torch.Tensor, num_send: int) -> torch.Tensor:
    """x's token rows in send order (each token row read once, written once per route)."""
    return dispatch_rows(x, route_to_send, x.new_empty((num_send, x.shape[1])))


def pool_rows(like: torch.Tensor, capacity: int, width: int, used_rows: int) -> torch.Tensor:
    """A [capacity, width] pool tensor whose rows below ``used_rows`` (every row a GEMM reads: the local experts'
    padded blocks) start at zero; the rows above, never read, are left unset (the capacity covers every route of
    every rank, up to R times the rows a rank gets: zero-filling it would cost more than the layer's copies)."""
    rows = like.new_empty((capacity, width))
    rows[:min(used_rows, capacity)].zero_()
    return rows


def _into_pool(recv: torch.Tensor, ex: Exchange, used_rows: int) -> torch.Tensor:
    """The received rows (recv order) laid into a :func:`pool_rows` pool."""
    pool = pool_rows(recv, ex.capacity, recv.shape[1], used_rows)
    return dispatch_rows(recv, ex.recv_order.to(torch.int32).view(-1, 1), pool)


def forward(x, topk_idx, topk_weights, w13, w2, *, activation_clamp=None, group, num_experts, max_tokens_per_rank,
            block_m, capacity, save_h=True, num_sms=0, agreement=None, precision="bf16", fp8_recipe=None,
            weight_cache=None, chunks=1):
    """The forward over ``group``. Returns ((y, h, expert_counts, expert_offsets, pool_src_route, pool_src_rank,
    route_to_pool), x_pool): the reference forward's contract (pool_src_route / pool_src_rank name the route on its
    source rank; route_to_pool the row in the owning rank's pool), and the pooled x rows [capacity, H].
    ``agreement``: what every rank must agree on (:func:`prime_kernels.mega._plan.agreement_fields`). ``precision``
    "fp8" runs the FP8 forward pipeline on the pool (the bf16 one otherwise). ``chunks`` > 1 (bf16) exchanges and
    computes the tokens in that many chunks, each chunk's exchange under another's GEMMs
    (:mod:`prime_kernels.mega._ep_chunks`; the same bits)."""
    sms = _sms(num_sms)
    T, K = topk_idx.shape
    H = x.shape[1]
    twoI = w13.shape[1]
    counts, offsets, src, srank, r2p = build_plan(topk_idx, num_experts, block_m, capacity, group,
                                                  max_tokens_per_rank, agreement)
    if chunks > 1 and precision != "fp8":
        plan = (counts, offsets, src, srank, r2p)
        y, h, x_pool = _ep_chunks.forward(x, topk_idx, topk_weights, w13, w2, plan, chunks=chunks, block_m=block_m,
                                          num_experts=num_experts, group=group, save_h=save_h, clamp=activation_clamp,
                                          sms=sms)
        return (y, h, counts, offsets, src, srank, r2p), x_pool
    ex = Exchange(topk_idx, r2p, src, srank, num_experts, group)
    r2s = _route_to_send(ex, T, K)
    used = int(offsets[-1])
    (recv,) = ex.send_rows([_send_token_rows(x.to(torch.bfloat16), r2s, ex.send_order.numel())])
    x_pool = _into_pool(recv, ex, used)  # padding rows are zeros, as the one-rank gather's
    del recv
    if used == 0:
        h = x_pool.new_zeros((capacity if save_h else 0, twoI))
        o = x_pool.new_zeros((capacity, H))
    elif precision == "fp8":
        h, o = local_forward_fp8(x_pool, w13, w2, counts, offsets, src, save_h=save_h, sms=sms,
                                 fp8_recipe=fp8_recipe, weight_cache=weight_cache, clamp=activation_clamp)
    else:
        h, o = local_forward_bf16(x_pool, w13, w2, offsets, save_h=save_h, clamp=activation_clamp, sms=sms)
    (back,) = ex.return_rows([gather_rows(o, ex.recv_order)])
    del o
    y = back.new_zeros((0, H)) if T == 0 else combine(back, r2s, topk_weights.float().contiguous())
    return (y, h, counts, offsets, src, srank, r2p), x_pool


def local_forward_fp8(x_pool, w13, w2, counts, offsets, pool_src_route, *, save_h, sms, fp8_recipe, weight_cache,
                      clamp=None):
    """The FP8 forward pipeline on a pool with rows, its rows as one-route tokens (every quantization is per row or
    per expert's rows, so it sees the one-rank values): (h as saved or [0, 2I], o [capacity, H] bf16)."""
    recipe, cache = _fp8.recipe_and_cache(fp8_recipe, weight_cache)
    l1 = _fp8_fwd.l1(x_pool, w13, counts, offsets, _pool_routes(pool_src_route).view(-1, 1), x_pool.shape[0], recipe,
                     cache, save_h, sms, clamp)
    h = l1.h if save_h else x_pool.new_empty((0, w13.shape[1]))
    c2 = cache.get(w2, recipe.pow2_scales)
    return h, m_grouped_fp8_gemm_nt(l1.s_q, l1.s_sa, c2.weight.data, c2.weight.scale, offsets, num_sms=sms)


def local_forward_bf16(x_pool, w13, w2, offsets, *, save_h, clamp, sms):
    """The bf16 forward on a pool with rows: (h as saved, o [capacity, H]), L1 with SwiGLU then L2."""
    s, h = m_grouped_bf16_gemm_swiglu(x_pool, w13, offsets, m_total=x_pool.shape[0], save_h=save_h, clamp=clamp,
                                      num_sms=sms)
    return h, m_grouped_bf16_gemm_nt(s, w2, offsets, num_sms=sms)


def _add_wgrad(dy_pool, a, dh, x_pool, offsets, need_wgrad, dw13_accum, dw2_accum, w13, w2, sms):
    """dW2 from (dy_pool, w * s) and dW13 from (dh, x_pool), each a k-grouped GEMM over the local experts' rows, as
    the one-rank backward runs them: added into the fp32 accumulators when given, else in the weights' dtype (None
    when not asked for)."""
    out13 = out2 = None
    if dw2_accum is not None:
        k_grouped_bf16_gemm_tn(dy_pool, a, offsets, accumulate_into=dw2_accum, num_sms=sms)
    elif need_wgrad:
        out2 = _wgrad(dy_pool, a, offsets, w2.dtype, sms)
    if dw13_accum is not None:
        k_grouped_bf16_gemm_tn(dh, x_pool, offsets, accumulate_into=dw13_accum, num_sms=sms)
    elif need_wgrad:
        out13 = _wgrad(dh, x_pool, offsets, w13.dtype, sms)
    return out13, out2


def _local_backward_bf16(dy_pool, w_pool, x_pool, h_saved, w13, w2, counts, offsets, routes, *, recompute, clamp,
                         sms, dx_to_slots=None):
    """The bf16 backward on the pool: (dx rows [capacity, H] bf16, d topk_weights rows [capacity] fp32, the
    weight-gradient operands (dy_pool, w * s, dh, x_pool)). ``dx_to_slots`` (slots, pool_src_route, pool_src_rank):
    the dX GEMM's epilogue writes each row into its source rank's slot instead (expert parallelism over peer memory),
    and the dx rows returned are None."""
    capacity = routes.shape[0]
    h = h_saved
    if recompute:  # the one-rank backward's recompute, on the pooled rows
        h, x_pool = recompute_h(None, w13, counts, offsets, None, capacity, x_pool, sms, clamp)
    dh, a, dt_part = m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offsets, h, routes, w_pool, clamp=clamp, num_sms=sms)
    del h
    dt_rows = torch.sum(dt_part, 1)  # the one-rank backward's sum of the same partials, in column order
    if dx_to_slots is not None:
        slots, src_route, src_rank = dx_to_slots
        torch.ops.prime_kernels.m_grouped_bf16_gemm_nn_to_routes_(dh, w13, offsets, slots, src_route, src_rank,
                                                                  sms or 0)
        return None, dt_rows, (dy_pool, a, dh, x_pool)
    dx_rows = m_grouped_bf16_gemm_nn(dh, w13, offsets, num_sms=sms)
    return dx_rows, dt_rows, (dy_pool, a, dh, x_pool)


def _local_backward_fp8(dy_pool, w_pool, x_pool, h_saved, w13, w2, counts, offsets, routes, *, recompute, clamp,
                        sms, precision, want_wgrad, need_wgrad, dw13_accum, dw2_accum, fp8_recipe, weight_cache):
    """The FP8 backward pipeline on the pool (its rows as one-route tokens): (dx rows, d topk_weights rows, wgrads),
    where ``wgrads()`` computes (dW13, dW2) as :func:`prime_kernels.mega._fp8_bwd.backward` gives them, whenever the
    caller runs it (its operands are held until then)."""
    recipe, cache = _fp8.recipe_and_cache(fp8_recipe, weight_cache)
    pow2 = recipe.pow2_scales
    c13, c2 = cache.get(w13, pow2), cache.get(w2, pow2)
    capacity = routes.shape[0]
    one_route = routes.view(-1, 1)
    h = h_saved
    if recompute and precision == "fp8":
        h = _fp8_fwd.recompute_h(x_pool, w13, counts, offsets, one_route, capacity, recipe, cache, sms, clamp)
    elif recompute:
        h, x_pool = recompute_h(None, w13, counts, offsets, None, capacity, x_pool, sms, clamp)
    dx_rows, dt_rows, dy_t, l2 = _fp8_bwd.data_grads(
        dy_pool, (c13.transposed.data, c13.transposed.scale), (c2.transposed.data, c2.transposed.scale), h, counts,
        offsets, routes, one_route, w_pool.view(-1, 1), pow2=pow2, sms=sms, want_wgrad_operands=want_wgrad,
        clamp=clamp)

    def wgrads():
        nonlocal dy_t
        out13 = out2 = None
        if want_wgrad:
            if dw2_accum is not None or need_wgrad:
                out2 = _fp8_bwd._wgrad(dy_t[0], dy_t[1], l2.awt_q, l2.awt_s, offsets, w2.dtype, dw2_accum, sms)
            dy_t = None
            x_t = quantize_tokens_fp8(x_pool, offsets, counts, pow2_scales=pow2)  # qT(x_e) from the bf16 rows
            if dw13_accum is not None or need_wgrad:
                out13 = _fp8_bwd._wgrad(l2.dht_q, l2.dht_s, x_t[0], x_t[1], offsets, w13.dtype, dw13_accum, sms)
        return out13, out2

    return dx_rows, dt_rows.view(-1), wgrads


def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
             route_to_pool, *, activation_clamp=None, group, num_experts, recompute=False, need_wgrad=True,
             dw13_accum=None, dw2_accum=None, x_pool=None, num_sms=0, defer_wgrad=False, precision="bf16",
             fp8_recipe=None, weight_cache=None, chunks=1):
    """The backward over ``group``, with the grouped backward's contract (:func:`prime_kernels.mega._grouped.backward`):
    (dx, d topk_weights, dw13, dw2), or with ``defer_wgrad`` (bf16 only) (dx, d topk_weights, a WgradLater).
    ``x_pool``: the forward's pooled rows (else the x rows are exchanged again). ``precision`` "fp8" or "fp8_bwd" runs
    the FP8 backward pipeline on the pool. ``chunks`` as in :func:`forward` (bf16)."""
    sms = _sms(num_sms)
    if chunks > 1 and precision not in FP8_PRECISIONS:
        return _backward_chunked(dy, x, topk_idx, topk_weights, w13, w2, h_saved,
                                 (counts, offsets, pool_src_route, pool_src_rank, route_to_pool), x_pool,
                                 chunks=chunks, clamp=activation_clamp, group=group, num_experts=num_experts,
                                 recompute=recompute, need_wgrad=need_wgrad, dw13_accum=dw13_accum,
                                 dw2_accum=dw2_accum, defer_wgrad=defer_wgrad, sms=sms)
    T, K = topk_idx.shape
    H = x.shape[1]
    capacity = pool_src_route.shape[0]
    ex = Exchange(topk_idx, route_to_pool, pool_src_route, pool_src_rank, num_experts, group)
    r2s = _route_to_send(ex, T, K)
    used = int(offsets[-1])
    n_send = ex.send_order.numel()
    send = [_send_token_rows(dy.to(torch.bfloat16), r2s, n_send)]
    if x_pool is None:
        send.append(_send_token_rows(x.to(torch.bfloat16), r2s, n_send))
    recv = ex.send_rows(send)
    dy_pool = _into_pool(recv[0], ex, used)
    if x_pool is None:
        x_pool = _into_pool(recv[1], ex, used)
    del recv, send
    (w_pool,) = ex.to_pool([topk_weights.reshape(-1)[ex.send_order].float()])
    routes = _pool_routes(pool_src_route)
    want_w = need_wgrad or dw13_accum is not None or dw2_accum is not None
    fp8_back = precision in FP8_PRECISIONS
    out13 = out2 = operands = None
    if used == 0:  # no GEMM: zero rows back, zero gradients, the accumulators untouched
        dx_rows, dt_rows = dy_pool.new_zeros((capacity, H)), w_pool.new_zeros((capacity,))
        if fp8_back:  # (the bf16 path's: _weight_grads)
            out13, out2 = _zero_wgrads(need_wgrad, dw13_accum, dw2_accum, w13, w2)
    elif fp8_back:
        dx_rows, dt_rows, wgrads = _local_backward_fp8(
            dy_pool, w_pool, x_pool, h_saved, w13, w2, counts, offsets, routes, recompute=recompute,
            clamp=activation_clamp, sms=sms, precision=precision, want_wgrad=want_w and not defer_wgrad,
            need_wgrad=need_wgrad, dw13_accum=dw13_accum, dw2_accum=dw2_accum, fp8_recipe=fp8_recipe,
            weight_cache=weight_cache)
        out13, out2 = wgrads()
        del wgrads
    else:
        dx_rows, dt_rows, operands = _local_backward_bf16(dy_pool, w_pool, x_pool, h_saved, w13, w2, counts, offsets,
                                                          routes, recompute=recompute, clamp=activation_clamp,
                                                          sms=sms)
    (dx_back,) = ex.return_rows([gather_rows(dx_rows, ex.recv_order)])
    del dx_rows
    (dt_routes,) = ex.to_routes([dt_rows], T * K)
    dx = dx_back.new_zeros((0, H)) if T == 0 else combine(dx_back, r2s, None)
    dtopk = dt_routes.view(T, K).to(topk_weights.dtype)
    if fp8_back:
        if defer_wgrad:
            raise RuntimeError("prime_kernels.mega: deferred weight gradients of the FP8 expert-parallel backward run "
                               "the whole backward again (the caller's path)")
        return dx, dtopk, out13, out2
    return _weight_grads(dx, dtopk, operands, offsets, need_wgrad=need_wgrad, dw13_accum=dw13_accum,
                         dw2_accum=dw2_accum, defer_wgrad=defer_wgrad, w13=w13, w2=w2, sms=sms)


def _zero_wgrads(need_wgrad, dw13_accum, dw2_accum, w13, w2):
    """(dW13, dW2) where no row reached the local experts: zeros where returned, None where not asked for or where an
    accumulator takes them (left untouched)."""
    return (w13.new_zeros(w13.shape) if need_wgrad and dw13_accum is None else None,
            w2.new_zeros(w2.shape) if need_wgrad and dw2_accum is None else None)


def _weight_grads(dx, dtopk, operands, offsets, *, need_wgrad, dw13_accum, dw2_accum, defer_wgrad, w13, w2, sms):
    """The bf16 backward's return from its data gradients and its weight-gradient operands (None: no local row):
    with ``defer_wgrad`` a WgradLater over the operands; else the weight gradients as :func:`_add_wgrad` gives them,
    zero where no row reached the experts (the accumulators untouched)."""
    if defer_wgrad:
        if operands is None:  # nothing to add later
            from .deferred import WgradLater

            return dx, dtopk, WgradLater(lambda dw13_accum, dw2_accum: None, ())
        return dx, dtopk, deferred_wgrad(*operands, offsets, sms)
    if not (need_wgrad or dw13_accum is not None or dw2_accum is not None):
        return dx, dtopk, None, None
    if operands is None:
        return (dx, dtopk) + _zero_wgrads(need_wgrad, dw13_accum, dw2_accum, w13, w2)
    return (dx, dtopk) + _add_wgrad(*operands, offsets, need_wgrad, dw13_accum, dw2_accum, w13, w2, sms)


def _backward_chunked(dy, x, topk_idx, topk_weights, w13, w2, h_saved, plan, x_pool, *, chunks, clamp, group,
                      num_experts, recompute, need_wgrad, dw13_accum, dw2_accum, defer_wgrad, sms):
    """:func:`backward` in chunks (bf16): the data gradients chunk by chunk, the weight gradients once over the full
    pool's operands."""
    dx, dtopk, operands = _ep_chunks.backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, plan, x_pool,
                                              chunks=chunks, block_m=BLOCK_M, num_experts=num_experts, group=group,
                                              recompute=recompute, clamp=clamp, sms=sms)
    return _weight_grads(dx, dtopk, operands, plan[1], need_wgrad=need_wgrad, dw13_accum=dw13_accum,
                         dw2_accum=dw2_accum, defer_wgrad=defer_wgrad, w13=w13, w2=w2, sms=sms)
