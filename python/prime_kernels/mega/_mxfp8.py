"""``precision="mxfp8"`` on backend "grouped": the forward's two GEMMs on torch's MXFP8 grouped GEMM (sm_100).

Forward, one rank (docs/mxfp8.md has the format and the layouts):

  plan   the routing plan, padded to block_m like every grouped forward's;
  pool   the token rows dispatched into the pool (bf16), the plan's padding rows zeroed;
  L1     the pool and w13 quantized to MXFP8 along H by our kernel (:func:`prime_kernels.mxfp8.quantize_mxfp8`: the
         pool's scales blocked per expert, each expert's rows padded to 128 in the scales only; w13's per expert),
         then ``torch._scaled_grouped_mm`` (2d-3d, ``offs`` the experts' ends) -> h in bf16;
  F3     s = SwiGLU(h) by our kernel;
  L2     s and w2 quantized along I the same way, the second ``torch._scaled_grouped_mm`` -> o in bf16;
  F5     our combine with the fp32 top-k weights.

Backward: the bf16 grouped backward (:func:`prime_kernels.mega._grouped.backward`; on Blackwell its GEMMs are
torch's bf16 grouped GEMM) from the forward's h, as ``precision="fp8"``'s FP8 forward hands its h to a backward of
another precision: the gradients are the bf16 layer's at the quantized forward's activations, the quantization
taken as the identity (straight-through). A recompute reruns this forward's L1, so h is the same either way.

Not here: activation_clamp (torch's GEMM returns bf16, the clamp masks of reference F6 need the fp32 h), expert
parallelism, a weight cache (the weights are quantized on every forward), and a reference of these numerics
(``backend="reference"`` has no mxfp8). Nothing here has run on Blackwell hardware; the plumbing is checked on the
CPU with :data:`grouped_mm` replaced by an emulation (tests/test_mxfp8_grouped.py).
"""

from __future__ import annotations

import torch

from ..combine import combine
from ..mxfp8 import quantize_mxfp8, quantize_mxfp8_weights
from ..routing import routing_plan
from ..swiglu import swiglu_fwd
from . import _grouped
from ._grouped import PaddingRows, _gathered_pool, _rows_for_kernels

STATUS_KEY = "mega_moe_grouped.mxfp8.sm100"


def scaled_grouped_mm(a_q, b_q, scale_a, scale_b, offs):
    """torch's MXFP8 grouped GEMM, 2d-3d: a_q [M, K] e4m3 @ b_q [G, K, N] (a K-contiguous view) -> bf16 [M, N]; one
    seam, so that the tests can run the pipeline with an emulation where torch has no kernel."""
    return torch._scaled_grouped_mm(a_q, b_q, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


#: What the forward calls for its GEMMs (replaced by the tests' emulation on machines without an sm_100 GPU).
grouped_mm = scaled_grouped_mm


def _mx_gemm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ w[g]^T for the experts' row groups ending at ``ends``, both operands MXFP8 along K."""
    a_q, a_s = quantize_mxfp8(a, group_ends=ends, group_axis="rows")
    w_q, w_s = quantize_mxfp8_weights(w)
    return grouped_mm(a_q, w_q.transpose(1, 2), a_s, w_s, ends)


def l1(x_pool: torch.Tensor, w13: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """h [P, 2I] bf16: the MXFP8 L1 of the pooled rows (rows past the last expert's end are not written)."""
    return _mx_gemm(x_pool, w13, offsets[1:].contiguous())


def forward(x, topk_idx, topk_weights, w13, w2, *, activation_clamp=None, group=None, num_experts=None,
            max_tokens_per_rank=None, block_m, capacity, save_h=True, buffer=None, id_check=None, num_sms=0):
    """Same contract as :func:`prime_kernels.mega.reference.forward`; ``id_check`` as in
    :func:`prime_kernels.mega._grouped.forward`. ``num_sms`` is not passed on: torch's GEMM takes no grid cap."""
    if group is not None:
        raise RuntimeError("prime_kernels.mega: the MXFP8 forward runs on a single rank (group=None)")
    if activation_clamp is not None:
        raise RuntimeError("prime_kernels.mega: the MXFP8 forward takes no activation_clamp")
    T, K = topk_idx.shape
    plan = routing_plan(topk_idx, num_experts, block_m, validate=False, capacity=capacity)
    if id_check is not None:
        id_check.watch(plan.num_invalid)
    counts, offsets = plan.expert_counts, plan.expert_offsets
    route_to_pool = plan.route_to_pool.view(T, K)
    x_pool = _gathered_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity)
    ends = offsets[1:].contiguous()
    h = _mx_gemm(x_pool, w13, ends)
    del x_pool
    s = swiglu_fwd(h, offsets[-1:], None)
    o = _mx_gemm(s, w2, ends)
    del s
    y = combine(o, route_to_pool, topk_weights.float())
    h_saved = h if save_h else x.new_empty((0, w13.shape[1]))
    return (y, h_saved, counts, offsets, plan.pool_src_route, plan.pool_src_rank, route_to_pool)


def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
             route_to_pool, *, activation_clamp=None, group=None, num_experts=None, recompute=False, need_wgrad=True,
             dw13_accum=None, dw2_accum=None, buffer=None, x_pool=None, num_sms=0, defer_wgrad=False):
    """The bf16 grouped backward (:func:`prime_kernels.mega._grouped.backward`, same contract) from this forward's
    h; with ``recompute`` h is this forward's MXFP8 L1 again (the pooled rows then serve dW13 too)."""
    if group is not None:
        raise RuntimeError("prime_kernels.mega: the MXFP8 pipeline runs on a single rank (group=None)")
    if activation_clamp is not None:
        raise RuntimeError("prime_kernels.mega: the MXFP8 pipeline takes no activation_clamp")
    h = h_saved
    if recompute:
        capacity = pool_src_route.shape[0]
        route = route_to_pool.contiguous()
        if x_pool is None:
            padding = PaddingRows(counts, offsets, route.numel(), capacity)
            x_pool = _gathered_pool(_rows_for_kernels(x), route, counts, offsets, capacity, padding)
        h = l1(x_pool, w13, offsets)
    return _grouped.backward(dy, x, topk_idx, topk_weights, w13, w2, h, counts, offsets, pool_src_route,
                             pool_src_rank, route_to_pool, activation_clamp=None, group=None,
                             num_experts=num_experts, recompute=False, need_wgrad=need_wgrad, dw13_accum=dw13_accum,
                             dw2_accum=dw2_accum, buffer=buffer, x_pool=x_pool, num_sms=num_sms,
                             defer_wgrad=defer_wgrad)
