"""The DeepGEMM-shaped calls of ``prime_kernels.mega``, for call sites written against upstream's Mega MoE API.

``get_symm_buffer_for_mega_moe`` (the staging buffer, :mod:`prime_kernels.mega.buffer`), the weight-layout helpers
(``transform_weights_for_mega_moe``, ``interleave_l1`` / ``deinterleave_l1``), the bf16 forward and backward
(``bf16_mega_moe``, ``bf16_mega_moe_backward``: not differentiable, they write into the caller's tensors), and
``fp8_bwd_mega_moe_backward``, and the mxfp8 names, which raise the ``prime_kernels.status()`` reason until their
kernels exist. They run through the same call path as the layer API (:mod:`prime_kernels.mega.api`): inputs checked
here, at their boundary, then :mod:`prime_kernels.mega._backend` resolves and runs the backend. The FP8 call sequence
(``fp8_mega_moe``, ``fp8_mega_moe_backward``, ``fp8_mega_moe_weight_grads`` and their buffers) is
:mod:`prime_kernels.mega.staged_fp8`, re-exported here.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass
from typing import Optional

import torch

from . import _backend, _fused, _validate, reference, shared
from ._plan import agreement_fields
from ..routing import RoutingPlan
from .api import mega_moe
from .buffer import SymmBuffer, get_symm_buffer_for_mega_moe  # noqa: F401  (one of the upstream names)
from .staged_fp8 import fp8_mega_moe, fp8_mega_moe_backward, fp8_mega_moe_weight_grads  # noqa: F401
from .constants import BLOCK_M


@dataclass
class MegaMoEState:
    """What ``bf16_mega_moe`` returns: the routing plan, and the saved h when asked (``save_h``).
    Pass it to ``bf16_mega_moe_backward(..., state=)`` to reuse both. It belongs to the inputs staged in its
    buffer when it was made: ``buffer_id``, ``generation`` (:attr:`SymmBuffer.generation` then) and
    ``num_tokens`` say which; a backward refuses it once the buffer has been staged again, since its plan and h
    would then describe other inputs."""

    plan: object
    h: Optional[torch.Tensor] = None
    buffer_id: int = 0
    generation: Optional[int] = None
    num_tokens: Optional[int] = None


def transform_weights_for_mega_moe(l1, l2, activation: str = "swiglu"):
    """Return the weights in the layout the kernels consume: our kernels read the natural layout
    (``l1 [El, 2I, H]`` gate rows then up rows, ``l2 [El, H, I]``), so this is a documented no-op
    that returns its arguments (no copy, no interleave). Kept for upstream call sites."""
    if activation != "swiglu":
        _validate._fail(f"only activation='swiglu' is supported, got {activation!r}")
    return l1, l2


def interleave_l1(l1: torch.Tensor, granularity: int = 8) -> torch.Tensor:
    """Natural [gate | up] rows -> upstream's interleave [g0..7, u0..7, g8..15, ...] (a copy)."""
    El, twoI, H = l1.shape
    I = twoI // 2
    g = l1[:, :I].reshape(El, I // granularity, granularity, H)
    u = l1[:, I:].reshape(El, I // granularity, granularity, H)
    return torch.stack([g, u], 2).reshape(El, twoI, H)


def deinterleave_l1(l1: torch.Tensor, granularity: int = 8) -> torch.Tensor:
    """Inverse of :func:`interleave_l1` (a copy)."""
    El, twoI, H = l1.shape
    I = twoI // 2
    v = l1.reshape(El, I // granularity, 2, granularity, H)
    return torch.cat([v[:, :, 0].reshape(El, I, H), v[:, :, 1].reshape(El, I, H)], 1)


def _shared_call(x, shared_l1, shared_l2, l1_natural_layout, backend, precision, activation_clamp, block_m):
    """The shared experts of a staged call (None without them), checked before anything runs: shared_l1 [S, 2Is, H]
    or [2Is, H] in l1's layout, shared_l2 [S, H, Is] or [H, Is] (:mod:`prime_kernels.mega.shared`)."""
    if shared_l1 is None and shared_l2 is None:
        return None
    if shared_l1 is None or shared_l2 is None:
        _validate._fail("shared_l1_weights and shared_l2_weights go together")
    w13, w2 = shared.shared_weights_3d(shared_l1, shared_l2)
    if not l1_natural_layout:
        w13 = deinterleave_l1(w13)
    return shared.prepare(x, w13, w2, None, backend=backend, precision=precision, activation_clamp=activation_clamp,
                          block_m=block_m)


def _staged(buffer, T):
    if not isinstance(buffer, SymmBuffer):
        _validate._fail(f"buffer must come from get_symm_buffer_for_mega_moe, got {type(buffer).__name__}", TypeError)
    if T > buffer.num_max_tokens_per_rank:
        _validate._fail(f"{T} tokens exceed the buffer's num_max_tokens_per_rank={buffer.num_max_tokens_per_rank}; "
                        f"allocate the buffer with a larger max")
    if buffer.mma_type != "bf16xbf16":
        _validate._fail(f"bf16 calls need a buffer with mma_type='bf16xbf16', got {buffer.mma_type!r}")
    return buffer.x[:T], buffer.topk_idx[:T], buffer.topk_weights[:T]


_check_out = _validate.check_call_tensor


def bf16_mega_moe(
    y: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    buffer: SymmBuffer,
    *,
    cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    activation_clamp: Optional[float] = None,
    fast_math: bool = True,
    l1_natural_layout: bool = True,
    shared_l1_weights=None,
    shared_l2_weights=None,
    accumulate: bool = False,
    save_h: bool = False,
    backend: str = "auto",
    block_m: int = BLOCK_M,
    num_sms: Optional[int] = None,
) -> MegaMoEState:
    """Forward into ``y [T, H]`` (bf16; overwritten, or added to with ``accumulate=True``).

    x, topk_idx and topk_weights are read from ``buffer.x[:T]``, ``buffer.topk_idx[:T]`` and
    ``buffer.topk_weights[:T]`` (T = y.size(0)), which the caller stages first, as upstream.
    ``l1 [El, 2I, H]`` natural layout (``l1_natural_layout=False``: upstream's interleave, undone
    here), ``l2 [El, H, I]``. ``cumulative_local_expert_recv_stats`` (int32 [El]) gets this call's
    per-local-expert row counts added. ``fast_math`` is accepted for upstream call sites (the
    reference computes SiLU exactly). Returns a :class:`MegaMoEState` (the routing plan, and h
    with ``save_h=True``) for ``bf16_mega_moe_backward``, tied to this staging of the buffer.
    ``num_sms``: the most SMs the kernels may use (None: all; the reference ignores it). T = 0 is allowed
    (nothing is written). Not differentiable: use :func:`mega_moe` for autograd.
    ``shared_l1_weights`` [S, 2Is, H] or [2Is, H] (l1's layout) and ``shared_l2_weights`` [S, H, Is] or [H, Is]:
    shared experts whose output is added to the routed one (:mod:`prime_kernels.mega.shared`, S1-S2), as a second
    pass of the same backend's kernels.
    """
    if activation != "swiglu":
        _validate._fail(f"only activation='swiglu' is supported, got {activation!r}")
    _validate.check_tensor_types(y=y, l1=l1, l2=l2)
    sms = _validate.num_sms_arg(num_sms)
    T = y.shape[0]
    x, topk_idx, topk_weights = _staged(buffer, T)
    generation = buffer.generation
    if not l1_natural_layout:
        l1 = deinterleave_l1(l1)
    _, H, I, K, El, E = _validate.check_inputs(
        x, topk_idx, topk_weights, l1, l2, num_experts=buffer.num_experts, ep_size=buffer.num_ranks,
        activation_clamp=activation_clamp, block_m=block_m)
    _check_out(y, "y", (T, H), (torch.bfloat16,), x.device)
    if cumulative_local_expert_recv_stats is not None:
        _check_out(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", (El,), (torch.int32,), x.device)
    shared_call = _shared_call(x, shared_l1_weights, shared_l2_weights, l1_natural_layout, backend, "bf16",
                               activation_clamp, block_m)
    which = _backend.resolve("fwd", backend, "bf16", x, l1, ep_size=buffer.num_ranks,
                             activation_clamp=activation_clamp, block_m=block_m)
    # the expert ids are checked before this returns, so before y is touched
    yy, h, counts, offsets, src, srank, r2p, _ = _backend.forward(
        which, x, topk_idx, topk_weights, l1, l2, precision="bf16", activation_clamp=activation_clamp,
        group=buffer.group if buffer.num_ranks > 1 else None, num_experts=E, ep_size=buffer.num_ranks,
        max_tokens_per_rank=buffer.num_max_tokens_per_rank, block_m=block_m, save_h=save_h, buffer=buffer,
        num_sms=sms)
    with torch.no_grad():
        if shared_call is not None:
            yy = shared.add_shared(yy, shared.run(mega_moe, x, shared_call, precision="bf16", backend=backend,
                                                  activation_clamp=activation_clamp, block_m=block_m, num_sms=num_sms))
        if accumulate:
            y.add_(yy)
        else:
            y.copy_(yy)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(counts)
    plan = RoutingPlan(expert_counts=counts, expert_offsets=offsets, pool_src_route=src, pool_src_rank=srank,
                       route_to_pool=r2p, block_m=int(block_m), num_experts=E, top_k=K)
    return MegaMoEState(plan=plan, h=h if save_h else None, buffer_id=buffer.buffer_id, generation=generation,
                        num_tokens=T)


def _check_state(state, buffer, T, K, El, I, block_m, capacity):
    """``state`` belongs to the inputs staged in ``buffer`` now (see :class:`MegaMoEState`)."""
    if not isinstance(state, MegaMoEState):
        _validate._fail(f"state must be the MegaMoEState that bf16_mega_moe returned, got {type(state).__name__}",
                        TypeError)
    if state.generation is None or state.buffer_id != buffer.buffer_id:
        _validate._fail("state was not made by bf16_mega_moe on this buffer; pass the state of the forward that "
                        "read this buffer, or state=None (the plan and h are then recomputed)")
    plan = state.plan
    if state.num_tokens != T:
        _validate._fail(f"state was made for T={state.num_tokens} tokens but dy has T={T}; pass the state of the "
                        f"forward of these tokens, or state=None")
    if plan.top_k != K or plan.expert_counts.shape[0] != El or plan.block_m != block_m \
            or plan.pool_src_route.shape[0] != capacity:
        _validate._fail(f"state was made for K={plan.top_k}, {plan.expert_counts.shape[0]} local experts, "
                        f"block_m={plan.block_m} ({plan.pool_src_route.shape[0]} pool rows) but this call has K={K}, "
                        f"{El} local experts, block_m={block_m} ({capacity} pool rows); pass the matching state, or "
                        f"state=None")
    if state.h is not None and list(state.h.shape) != [capacity, 2 * I]:
        _validate._fail(f"state's h has shape {list(state.h.shape)} but this call needs {[capacity, 2 * I]} "
                        f"(I={I}); pass the matching state, or state=None")
    now = buffer.generation
    if state.generation != now:
        _validate._fail(f"state belongs to staging {state.generation} of this buffer, but the buffer has been staged "
                        f"again since (staging {now}): its plan and h would describe other inputs. Run the backward "
                        f"right after its forward's staging (do not re-stage in between), or pass state=None")


def bf16_mega_moe_backward(
    dx: torch.Tensor,
    dw1: Optional[torch.Tensor],
    dw2: Optional[torch.Tensor],
    dtopk: torch.Tensor,
    dy: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    buffer: SymmBuffer,
    *,
    activation: str = "swiglu",
    activation_clamp: Optional[float] = None,
    state: Optional[MegaMoEState] = None,
    accumulate: bool = False,
    l1_natural_layout: bool = True,
    dw_natural_layout: bool = True,
    shared_l1_weights=None,
    shared_l2_weights=None,
    shared_dw1_weights=None,
    shared_dw2_weights=None,
    fast_math: bool = True,
    backend: str = "auto",
    block_m: int = BLOCK_M,
    num_sms: Optional[int] = None,
) -> None:
    """Backward into ``dx [T, H]`` bf16, ``dw1`` like l1, ``dw2`` like l2 (bf16 or fp32; None skips
    the weight gradients) and ``dtopk [T, K]`` fp32: overwritten, or added to with
    ``accumulate=True`` (fp32 ``dw1``/``dw2`` then act as fp32 accumulation buffers).

    x, topk_idx and topk_weights are read from the buffer. ``state`` (what ``bf16_mega_moe``
    returned) reuses the routing plan and, if saved, h: it must belong to the inputs staged now (the
    buffer not staged again since that forward; a ValueError otherwise); without it both are recomputed
    from the inputs staged now (re-stage them before this call, as upstream). ``dw_natural_layout=False``
    writes dw1 in upstream's interleave. ``num_sms`` as in :func:`bf16_mega_moe`. T = 0 leaves dw1 and dw2
    zero (or, with ``accumulate=True``, as they were). Rounding points: see :mod:`prime_kernels.mega.reference`.
    With shared experts (``shared_l1_weights``, ``shared_l2_weights`` as in :func:`bf16_mega_moe`) their forward
    is recomputed, dx gets their part (S3 of :mod:`prime_kernels.mega.shared`), and ``shared_dw1_weights`` /
    ``shared_dw2_weights`` (like the shared weights, bf16 or fp32, or None) their weight gradients, as dw1 / dw2
    get the routed ones.
    """
    _staged_backward("bf16", **locals())


def fp8_bwd_mega_moe_backward(*args, **kwargs) -> None:
    """:func:`bf16_mega_moe_backward` (the same arguments) with the FP8 backward of ``precision="fp8_bwd"``: the
    forward ran in bf16 (:func:`bf16_mega_moe`), the backward quantizes dy, dh and the weight-gradient operands as
    the recipe says (docs/fp8.md) and runs the FP8 backward pipeline. Raises the ``prime_kernels.status()`` reason
    where that cannot run."""
    bound = inspect.signature(bf16_mega_moe_backward).bind(*args, **kwargs)
    bound.apply_defaults()
    _staged_backward("fp8_bwd", **bound.arguments)


def _staged_backward(precision: str, *, dx, dw1, dw2, dtopk, dy, l1, l2, buffer, activation, activation_clamp,
                     state, accumulate, l1_natural_layout, dw_natural_layout, shared_l1_weights, shared_l2_weights,
                     shared_dw1_weights, shared_dw2_weights, fast_math, backend, block_m, num_sms) -> None:
    """The backward of the staged-buffer calls for ``precision`` ("bf16" or "fp8_bwd")."""
    if activation != "swiglu":
        _validate._fail(f"only activation='swiglu' is supported, got {activation!r}")
    _validate.check_tensor_types(dx=dx, dtopk=dtopk, dy=dy, l1=l1, l2=l2)
    sms = _validate.num_sms_arg(num_sms)
    T = dy.shape[0]
    x, topk_idx, topk_weights = _staged(buffer, T)
    if not l1_natural_layout:
        l1 = deinterleave_l1(l1)
    _, H, I, K, El, E = _validate.check_inputs(
        x, topk_idx, topk_weights, l1, l2, num_experts=buffer.num_experts, ep_size=buffer.num_ranks,
        activation_clamp=activation_clamp, block_m=block_m, dy=dy)
    dev = x.device
    _check_out(dx, "dx", (T, H), (torch.bfloat16,), dev)
    _check_out(dtopk, "dtopk", (T, K), (torch.float32,), dev)
    if dw1 is not None:
        _check_out(dw1, "dw1", l1.shape, (torch.bfloat16, torch.float32), dev)
    if dw2 is not None:
        _check_out(dw2, "dw2", l2.shape, (torch.bfloat16, torch.float32), dev)
    shared_call = _shared_call(x, shared_l1_weights, shared_l2_weights, l1_natural_layout, backend, precision,
                               activation_clamp, block_m)
    if shared_call is None and (shared_dw1_weights is not None or shared_dw2_weights is not None):
        _validate._fail("shared_dw1_weights / shared_dw2_weights need shared_l1_weights and shared_l2_weights")
    if shared_dw1_weights is not None:
        _check_out(shared_dw1_weights, "shared_dw1_weights", shared_l1_weights.shape, (torch.bfloat16, torch.float32),
                   dev)
    if shared_dw2_weights is not None:
        _check_out(shared_dw2_weights, "shared_dw2_weights", shared_l2_weights.shape, (torch.bfloat16, torch.float32),
                   dev)
    cap = _backend.capacity(T, K, El, buffer.num_ranks, buffer.num_max_tokens_per_rank, block_m)
    if state is not None:
        _check_state(state, buffer, T, K, El, I, block_m, cap)
    which = _backend.resolve("bwd", backend, precision, x, l1, ep_size=buffer.num_ranks,
                             activation_clamp=activation_clamp, block_m=block_m)
    if T == 0 and buffer.num_ranks == 1:  # no route: zero weight gradients, dx and dtopk are empty
        for out in (dw1, dw2, shared_dw1_weights, shared_dw2_weights):
            if out is not None and not accumulate:
                out.zero_()
        return None
    ids = _validate.ExpertIdCheck(topk_idx, E, which)  # finished before the caller's outputs are touched
    group = buffer.group if buffer.num_ranks > 1 else None
    with torch.no_grad():
        if state is None:
            counts, offsets, src, srank, r2p = reference.build_plan(
                topk_idx, E, block_m, cap, group, buffer.num_max_tokens_per_rank,
                agreement_fields(x=x, w13=l1, precision=precision, backend=which, activation_clamp=activation_clamp,
                                 phase=1))
            h = None
        else:
            p = state.plan
            counts, offsets, src, srank, r2p = (p.expert_counts, p.expert_offsets, p.pool_src_route,
                                                p.pool_src_rank, p.route_to_pool)
            h = state.h
        recompute = h is None
        if h is None:
            h = x.new_empty((0, 2 * I))
        # fp32 outputs receive the unrounded fp32 sums (B10): they act as accumulation buffers
        tmp13 = torch.zeros(l1.shape, dtype=torch.float32, device=dev) if (
            dw1 is not None and dw1.dtype == torch.float32) else None
        tmp2 = torch.zeros(l2.shape, dtype=torch.float32, device=dev) if (
            dw2 is not None and dw2.dtype == torch.float32) else None
        need_wgrad = dw1 is not None or dw2 is not None
        gx, gt, g13, g2 = _backend.backward(
            which, dy, x, topk_idx, topk_weights, l1, l2, h, counts, offsets, src, srank, r2p, precision=precision,
            activation_clamp=activation_clamp, group=group, num_experts=E, recompute=recompute,
            need_wgrad=need_wgrad, dw13_accum=tmp13, dw2_accum=tmp2, buffer=buffer, num_sms=sms)
        g13 = tmp13 if tmp13 is not None else g13
        g2 = tmp2 if tmp2 is not None else g2
        if dw1 is not None and not dw_natural_layout:
            g13 = interleave_l1(g13)
        outs = [(dx, gx), (dtopk, gt), (dw1, g13), (dw2, g2)]
        if shared_call is not None:
            gxs, gs13, gs2 = _shared_backward(shared_call, x, dy, shared_dw1_weights, shared_dw2_weights,
                                              dw_natural_layout, precision=precision, backend=backend,
                                              activation_clamp=activation_clamp, block_m=block_m, num_sms=num_sms)
            outs[0] = (dx, shared.add_shared(gx, gxs))  # S3
            outs += [(shared_dw1_weights, gs13), (shared_dw2_weights, gs2)]
        ids.finish()
        for out, g in outs:
            if out is None:
                continue
            if accumulate:
                out.add_(g.to(out.dtype))
            else:
                out.copy_(g)
    return None


def _shared_backward(call, x, dy, sdw1, sdw2, dw_natural_layout, **layer_kwargs):
    """The shared experts' part of the staged backward: their forward recomputed and differentiated (dX, and the
    weight gradients wanted: fp32 outputs get the unrounded fp32 sums through the layer's accumulators, bf16 ones the
    gradients rounded once), as (dx_shared, d shared_l1 in its layout and shape or None, d shared_l2 or None)."""
    fp32 = [o is not None and o.dtype == torch.float32 for o in (sdw1, sdw2)]
    acc13 = torch.zeros(call.w13.shape, dtype=torch.float32, device=x.device) if fp32[0] else None
    acc2 = torch.zeros(call.w2.shape, dtype=torch.float32, device=x.device) if fp32[1] else None
    with torch.enable_grad():
        xs = x.detach().requires_grad_(True)
        w13 = call.w13.detach().requires_grad_(sdw1 is not None and not fp32[0])
        w2 = call.w2.detach().requires_grad_(sdw2 is not None and not fp32[1])
        ys = shared.run(mega_moe, xs, shared.SharedCall(w13, w2, call.topk_idx, call.topk_weights),
                        wgrad_accum=(acc13, acc2) if any(fp32) else None, **layer_kwargs)
        leaves = [t for t in (xs, w13, w2) if t.requires_grad]
        grads = dict(zip((id(t) for t in leaves), torch.autograd.grad(ys, leaves, dy)))
    g13 = acc13 if fp32[0] else grads.get(id(w13))
    g2 = acc2 if fp32[1] else grads.get(id(w2))
    if g13 is not None and not dw_natural_layout:
        g13 = interleave_l1(g13)
    if sdw1 is not None:
        g13 = g13.reshape(sdw1.shape)
    if sdw2 is not None:
        g2 = g2.reshape(sdw2.shape)
    return grads[id(xs)], g13, g2


# ----------------------------------------------------------------------------------------------
# MXFP8 names: present, and they say why they cannot run yet. (The FP8 calls: staged_fp8.)
# ----------------------------------------------------------------------------------------------


def _unavailable(precision, direction, what):
    reason = _backend.fp8_kernel_reason(precision, direction) or _backend._fused_reason(precision, direction)
    if reason is None:  # status() says the kernel exists: hand over to the binding
        return _fused.forward if direction == "fwd" else _fused.backward
    raise _backend.FusedKernelUnavailable(
        f"prime_kernels.mega.{what}: precision={precision!r} {direction} is not available: {reason} "
        f"(see prime_kernels.status()); use bf16_mega_moe / mega_moe(precision='bf16')")


def mxfp8_mega_moe(*args, **kwargs):
    """SM100 MXFP8 forward (``precision="mxfp8"``); raises the status() reason for now."""
    return _unavailable("mxfp8", "fwd", "mxfp8_mega_moe")(*args, precision="mxfp8", **kwargs)


def mxfp8_mega_moe_backward(*args, **kwargs):
    """SM100 MXFP8 backward (``precision="mxfp8"``); raises the status() reason for now."""
    return _unavailable("mxfp8", "bwd", "mxfp8_mega_moe_backward")(*args, precision="mxfp8", **kwargs)


def fp8_fp4_mega_moe(*args, **kwargs):
    """Upstream's SM100 FP8xFP4 forward name, mapped to the mxfp8 kernel entry; raises for now."""
    return _unavailable("mxfp8", "fwd", "fp8_fp4_mega_moe")(*args, precision="mxfp8", **kwargs)

