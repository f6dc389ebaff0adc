"""Shared experts inside the routed experts' FP8 launches (``precision="fp8"``, one rank): SF1-SF3 of
:mod:`prime_kernels.mega._shared_grouped` with the FP8 forward (the fused kernel, or the pipeline with a clamp) and
the FP8 backward pipeline.

The FP8 layer reads its weights from the weight cache's FP8 copies, made once per optimizer step. Here that copy is
the routed weight with the shared experts' chunks as experts after its own (:meth:`fp8.Fp8WeightCache.get_with_chunks`,
the routed weight quantized straight into it), so every FP8 kernel of the layer runs the shared groups as the last
groups of its launch without knowing them: the fused forward's task list, the L1 and L2, the L2 dgrad and the L1
dgrad (on the combined copy's transposed tiles). The weight gradients come out of one k-grouped launch per weight
over every group and are split: the routed experts' slice is a view, the shared chunks go back in place.
"""

from __future__ import annotations

import torch

from . import _fp8_bwd, _fp8_fwd, _fused
from . import fp8 as _fp8
from ..second_b import collapse_chunks


class CombinedWeights:
    """A weight cache for one call: ``get(w13)`` and ``get(w2)`` give the combined FP8 copies (routed experts, then
    the shared chunks) from the underlying cache; any other tensor is refused."""

    def __init__(self, cache: _fp8.Fp8WeightCache, w13, w2, shared_w13, shared_w2, chunks: int):
        self._cache = cache
        self._weights = {id(w13): (w13, shared_w13, "w13"), id(w2): (w2, shared_w2, "w2")}
        self._chunks = chunks

    def get(self, w: torch.Tensor, pow2_scales: bool = False) -> _fp8.QuantizedWeight:
        entry = self._weights.get(id(w))
        if entry is None or entry[0] is not w:
            raise RuntimeError("prime_kernels.mega: the shared experts' FP8 weights are asked for another tensor")
        return self._cache.get_with_chunks(entry[0], entry[1], self._chunks, entry[2], pow2_scales)


def forward(x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, *, chunks: int, activation_clamp=None,
            block_m: int, capacity: int, save_h: bool = True, num_sms=0, fused: bool = True):
    """The contract of :func:`prime_kernels.mega._shared_grouped.forward` in FP8: the fused FP8 forward (``fused``),
    else the FP8 forward pipeline (which takes a clamp)."""
    cache = CombinedWeights(_fp8.WEIGHT_CACHE, w13, w2, shared_w13, shared_w2, chunks)
    num_groups = w13.shape[0] + shared_w13.shape[0] * chunks
    opts = dict(activation_clamp=activation_clamp, num_experts=num_groups, block_m=block_m, capacity=capacity,
                save_h=save_h, num_sms=num_sms)
    if fused:
        return _fused._forward_fp8(x, topk_idx, topk_weights, w13, w2, id_check=None, weight_cache=cache, **opts)[:7]
    return _fp8_fwd.forward(x, topk_idx, topk_weights, w13, w2, weight_cache=cache, **opts)


def backward(dy, x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, h_saved, counts, offsets, pool_src_route,
             pool_src_rank, route_to_pool, *, chunks: int, activation_clamp=None, recompute=False, need_wgrad=True,
             num_sms=0):
    """(dx, d topk_weights over the extended routes, dW13, dW2, d shared_w13, d shared_w2) from the FP8 backward
    pipeline; the weight gradients in their weights' dtype (None without ``need_wgrad``)."""
    cache = CombinedWeights(_fp8.WEIGHT_CACHE, w13, w2, shared_w13, shared_w2, chunks)
    E = w13.shape[0]
    dx, dtopk, d13, d2 = _fp8_bwd.backward(
        dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
        route_to_pool, activation_clamp=activation_clamp, num_experts=E + shared_w13.shape[0] * chunks,
        recompute=recompute, need_wgrad=need_wgrad, num_sms=num_sms, precision="fp8", weight_cache=cache)
    if d13 is None:
        return dx, dtopk, None, None, None, None
    # the shared parts copied out of the combined gradients: no returned tensor may share memory with another
    return (dx, dtopk, d13[:E], d2[:E], collapse_chunks(d13[E:], chunks, "w13").to(shared_w13.dtype, copy=True),
            collapse_chunks(d2[E:], chunks, "w2").to(shared_w2.dtype, copy=True))
