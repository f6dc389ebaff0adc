"""The fused kernels behind ``prime_kernels.mega`` (backend "fused").

Forward (sm90, BF16, single rank): the routing plan, then one persistent kernel
(``torch.ops.prime_kernels.mega_moe_fused_fwd``: dispatch of the token rows into the pool, L1 with the
SwiGLU epilogue and L2, tiles released to each other through per-m-block counters, work claimed from
counters so that any number of its CTAs may run), whose op also returns y: the deterministic combine over
the L2 rows, a second kernel launched right after the forward kernel. Same arguments, return tuple and
rounding points as :func:`prime_kernels.mega.reference.forward`, F6 included (with a clamp the saved h keeps the
clamp masks of the fp32 pre-activation). The plan pads every expert's rows to a multiple of ``block_m`` (128:
the kernel's m-block, so that no tile straddles two experts: at the H200's power cap a partly filled tile cost
about as much time as two full ones, docs/performance.md); the padding rows are dispatched as zeros, so
their h, s and o rows are zeros, and the grouped backward reads this state (it zeroes the padding rows of the
pools it gathers itself). The dispatched pool rows are kept for the backward only when asked
(``keep_pooled_x``: one more [capacity, H] buffer); otherwise L2's output overwrites them (lower peak memory)
and the backward gathers x again.

The fused backward is not written yet: ``prime_kernels.status()`` says so, and :mod:`prime_kernels.mega._backend`
never resolves "fused" for it.
"""

from __future__ import annotations

import torch

from ._validate import FusedKernelUnavailable
from ..routing import routing_plan

STATUS_KEY_FWD = "mega_moe.bf16.sm90"


def forward(x, topk_idx, topk_weights, w13, w2, *, precision: str = "bf16", activation_clamp=None, group=None,
            num_experts=None, max_tokens_per_rank=None, block_m, capacity, save_h=True, buffer=None,
            keep_x_pool=False, id_check=None, num_sms=0):
    """The contract of :func:`prime_kernels.mega.reference.forward`, plus an 8th output: the dispatched
    rows x_pool [capacity, H] with ``keep_x_pool`` (their own buffer instead of o's), else [0, H].
    ``id_check`` (a :class:`prime_kernels.mega._validate.ExpertIdCheck` made with ``from_plan=True``) gets the
    plan's count of out-of-range expert ids. ``num_sms``: the SMs the kernels may use (0 = all), so that a
    trainer can leave some to its communication kernels."""
    if precision != "bf16":
        raise FusedKernelUnavailable(f"prime_kernels.mega: no fused {precision} forward kernel")
    if group is not None:
        raise FusedKernelUnavailable("prime_kernels.mega: the fused forward runs on a single rank for now (group=None)")
    T = x.shape[0]
    K = topk_idx.shape[1]
    with torch.no_grad():
        plan = routing_plan(topk_idx, num_experts, block_m, validate=False, capacity=capacity)
        if id_check is not None:
            id_check.watch(plan.num_invalid)
        src = plan.pool_src_route
        srank = plan.pool_src_rank
        route_to_pool = plan.route_to_pool.view(T, K)
        # The kernels read clamp 0 as "no clamp": the public boundary rejects a clamp <= 0, so 0 can only
        # come from None here.
        clamp = 0.0 if activation_clamp is None else float(activation_clamp)
        _s, h, _o, x_pool, y = torch.ops.prime_kernels.mega_moe_fused_fwd(
            x.contiguous(), src, plan.expert_offsets, w13.contiguous(), w2.contiguous(), K, save_h, clamp,
            keep_x_pool, route_to_pool, topk_weights.float().contiguous(),  # F5: the op's combine
            num_sms=int(num_sms))
    return (y, h, plan.expert_counts, plan.expert_offsets, src, srank,
            route_to_pool, x_pool)


def backward(*args, precision: str = "bf16", **kwargs):
    raise FusedKernelUnavailable(
        f"prime_kernels.mega: no fused {precision} backward kernel yet (prime_kernels.status() "
        f"'mega_moe_backward.bf16.sm90'); backend='auto' runs the grouped backward"
    )
