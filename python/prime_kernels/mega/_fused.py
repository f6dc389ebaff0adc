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

Forward (sm90, FP8, single rank; :func:`_forward_fp8`): the same plan, the weights' FP8 tiles from the weight cache,
then ``torch.ops.prime_kernels.mega_moe_fp8_fused_fwd`` (the quantizing dispatch, then one persistent kernel for the
FP8 L1 with SwiGLU and the FP8 L2, csrc/sm90/mega_moe_fwd_fp8.cuh) and the combine: the FP8 forward pipeline's bits.

Forward (sm100, BF16, single rank): the native kernel registered for ``mega_moe.bf16.sm100``
(:mod:`prime_kernels.mega._selftest`), once its self-test has passed on the device; the backend resolution chooses
"fused" there only then, and this raises status()'s reason otherwise. Its self-test covers no activation clamp,
so a clamp is refused.

Backward (sm90, BF16): :func:`backward`, the fused backward kernel of :mod:`prime_kernels.mega._fused_bwd`, which
:mod:`prime_kernels.mega._backend` resolves to only where ``prime_kernels.status()["mega_moe_backward.bf16.sm90"]``
says "available".
"""

from __future__ import annotations

import torch

from . import _fp8_fwd, _fused_bwd, _selftest
from . import fp8 as _fp8
from ._grouped import _rows_for_kernels
from ._validate import FusedKernelUnavailable
from .. import _status
from ..combine import combine
from ..routing import routing_plan

STATUS_KEY_FWD = "mega_moe.bf16.sm90"
# arch family -> the status key of its native bf16 forward, where ours is not the sm90 kernel
NATIVE_FWD_KEYS = {"sm100": "mega_moe.bf16.sm100"}


STATUS_KEY_FWD_FP8 = "mega_moe.fp8.sm90"


def clamp_reason(key: str, activation_clamp: float | None) -> str | None:
    """Why the fused forward of status key ``key`` cannot take this call's clamp: a native one's self-test runs
    without a clamp, so a clamp would run it on numerics nothing checked; the fused FP8 kernel's L1 epilogue has no
    clamp (the FP8 forward pipeline's L1 has). None otherwise."""
    if activation_clamp is None:
        return None
    if key in NATIVE_FWD_KEYS.values():
        return f"{key}: its self-test covers no activation_clamp"
    if key == STATUS_KEY_FWD_FP8:
        return f"{key}: the fused FP8 forward kernel takes no activation_clamp (the FP8 forward pipeline does)"
    return None


def forward(x, topk_idx, topk_weights, w13, w2, *, precision: str = "bf16", activation_clamp=None, group=None,
            num_experts=None, max_tokens_per_rank=None, block_m, capacity, save_h=True, buffer=None,
            keep_x_pool=False, id_check=None, num_sms=0):
    """The contract of :func:`prime_kernels.mega.reference.forward`, plus an 8th output: the dispatched
    rows x_pool [capacity, H] with ``keep_x_pool`` (their own buffer instead of o's), else [0, H].
    ``id_check`` (a :class:`prime_kernels.mega._validate.ExpertIdCheck` made with ``from_plan=True``) gets the
    plan's count of out-of-range expert ids. ``num_sms``: the SMs the kernels may use (0 = all), so that a
    trainer can leave some to its communication kernels."""
    if precision not in ("bf16", "fp8"):
        raise FusedKernelUnavailable(f"prime_kernels.mega: no fused {precision} forward kernel")
    if group is not None:  # the peer-memory path (prime_kernels.mega._peer_ep)
        from . import _peer_ep  # noqa: PLC0415

        return _peer_ep.layer_forward(x, topk_idx, topk_weights, w13, w2, precision=precision,
                                      activation_clamp=activation_clamp, group=group, num_experts=num_experts,
                                      max_tokens_per_rank=max_tokens_per_rank, block_m=block_m, capacity=capacity,
                                      save_h=save_h, keep_x_pool=keep_x_pool, num_sms=num_sms)
    if precision == "fp8":
        return _forward_fp8(x, topk_idx, topk_weights, w13, w2, activation_clamp=activation_clamp,
                            num_experts=num_experts, block_m=block_m, capacity=capacity, save_h=save_h,
                            id_check=id_check, num_sms=num_sms)
    native_key = NATIVE_FWD_KEYS.get(_status.family_of_device(x.device.index)) if x.device.type == "cuda" else None
    if native_key is not None:
        why = clamp_reason(native_key, activation_clamp)
        if why is not None:
            raise FusedKernelUnavailable(f"prime_kernels.mega: {why}")
        native = _selftest.native_forward(x.device, native_key)
        return native(x, topk_idx, topk_weights, w13, w2, activation_clamp=None, num_experts=num_experts,
                      block_m=block_m, capacity=capacity, save_h=save_h, keep_x_pool=keep_x_pool, id_check=id_check,
                      num_sms=num_sms)
    return run_bf16(torch.ops.prime_kernels.mega_moe_fused_fwd, x, topk_idx, topk_weights, w13, w2,
                    activation_clamp=activation_clamp, num_experts=num_experts, block_m=block_m, capacity=capacity,
                    save_h=save_h, keep_x_pool=keep_x_pool, id_check=id_check, num_sms=num_sms)


def run_bf16(op, x, topk_idx, topk_weights, w13, w2, *, activation_clamp, num_experts, block_m, capacity, save_h,
             keep_x_pool, id_check, num_sms):
    """The routing plan, then ``op`` (a bf16 fused forward op: sm90's, or the native sm100 one with the same
    arguments and outputs, the combine included): :func:`forward`'s 8 outputs."""
    T, K = topk_idx.shape
    with torch.no_grad():
        plan = routing_plan(topk_idx, num_experts, block_m, validate=False, capacity=capacity)
        if id_check is not None:
            id_check.watch(plan.num_invalid)
        route_to_pool = plan.route_to_pool.view(T, K)
        # The kernels read clamp 0 as "no clamp": the public boundary rejects a clamp <= 0, so 0 can only
        # come from None here.
        clamp = 0.0 if activation_clamp is None else float(activation_clamp)
        _s, h, _o, x_pool, y = op(
            x.contiguous(), plan.pool_src_route, plan.expert_offsets, w13.contiguous(), w2.contiguous(), K, save_h,
            clamp, keep_x_pool, route_to_pool, topk_weights.float().contiguous(),  # F5: the op's combine
            num_sms=int(num_sms))
    return (y, h, plan.expert_counts, plan.expert_offsets, plan.pool_src_route, plan.pool_src_rank, route_to_pool,
            x_pool)


def _forward_fp8(x, topk_idx, topk_weights, w13, w2, *, activation_clamp, num_experts, block_m, capacity, save_h,
                 id_check, num_sms, weight_cache=None):
    """precision="fp8": the routing plan, the weights' FP8 tiles from the weight cache, then the fused FP8 kernel
    (``torch.ops.prime_kernels.mega_moe_fp8_fused_fwd``: the quantizing dispatch, then one persistent kernel for the
    FP8 L1 with SwiGLU, qK(s, 64) and h rounded to bf16, and the FP8 L2) and the combine. The kernels and rounding
    points of the FP8 forward pipeline (:mod:`._fp8_fwd`), so the same y and h bits; the default recipe (1 x 64 s,
    general scales), no activation clamp. The 8th output is None: the layer gathers x_pool itself when it is asked
    to keep it. ``weight_cache``: where the FP8 tiles come from (default: the process-wide cache)."""
    why = clamp_reason(STATUS_KEY_FWD_FP8, activation_clamp)
    if why is not None:
        raise FusedKernelUnavailable(f"prime_kernels.mega: {why}")
    recipe = _fp8.DEFAULT_RECIPE
    _fp8_fwd.check_recipe(recipe)
    T, K = topk_idx.shape
    with torch.no_grad():
        plan = routing_plan(topk_idx, num_experts, block_m, validate=False, capacity=capacity)
        if id_check is not None:
            id_check.watch(plan.num_invalid)
        route_to_pool = plan.route_to_pool.view(T, K)
        cache = _fp8.WEIGHT_CACHE if weight_cache is None else weight_cache
        c13 = cache.get(w13, recipe.pow2_scales)
        c2 = cache.get(w2, recipe.pow2_scales)
        # h is [0, 2I] without save_h, the shape the other backends return
        h, o = torch.ops.prime_kernels.mega_moe_fp8_fused_fwd(
            _rows_for_kernels(x), plan.pool_src_route, route_to_pool.view(-1), plan.expert_offsets, c13.weight.data,
            c13.weight.scale, c2.weight.data, c2.weight.scale, K, save_h, recipe.pow2_scales, num_sms=int(num_sms))
        y = combine(o, route_to_pool, topk_weights.float())  # F5
        del o
    return (y, h, plan.expert_counts, plan.expert_offsets, plan.pool_src_route, plan.pool_src_rank,
            route_to_pool, None)


def backward(*args, precision: str = "bf16", buffer=None, **kwargs):
    """The fused BF16 backward (:func:`prime_kernels.mega._fused_bwd.backward`); the FP8 precisions' backward is the
    FP8 pipeline's (:mod:`prime_kernels.mega._backend` sends them there)."""
    if precision != "bf16":
        raise FusedKernelUnavailable(f"prime_kernels.mega: no fused {precision} backward kernel")
    return _fused_bwd.backward(*args, buffer=buffer, **kwargs)
