"""torch.library custom ops ``prime_kernels::mega_moe_fwd`` and ``prime_kernels::mega_moe_bwd``.

Both are registered for every device through the same Python implementation, which validates and then
resolves and runs the backend through :mod:`prime_kernels.mega._backend` (the call path every entry point shares).
``register_fake`` gives static output shapes (the pool is laid into a fixed capacity, see
:func:`prime_kernels.mega._backend.capacity`), and ``register_autograd`` joins the two ops.

The routing plan is an output of the forward op and is saved for the backward, which reuses it.
When the caller passes fp32 weight-gradient accumulation buffers (``dw13_accum``/``dw2_accum``),
the backward op adds the weight gradients into them and autograd returns None for w13 and w2.

The forward op is where :func:`prime_kernels.mega.mega_moe` (and so :class:`~prime_kernels.mega.MegaMoE`) has its
inputs validated: it checks everything before any routing or GEMM. A single-rank call with no tokens (T = 0)
returns its empty and zero outputs without running a backend (the kernels take no empty operands).
``num_sms`` (0 = every SM) bounds the SMs the kernel backends use; the reference ignores it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _backend, _comm, _peer_ep, _validate, deferred, reference
from .buffer import get_buffer


def _check_forward_args(x, topk_idx, topk_weights, w13, w2, dw13_accum, dw2_accum, activation_clamp, num_experts,
                        ep_size, max_tokens_per_rank, block_m, backend, buffer_id, num_sms, precision="bf16",
                        ep_chunks=1):
    """The forward op's metadata checks, run by its implementation and by its fake (which is what runs for meta
    tensors and while torch.compile traces). Returns ((T, H, I, K, El, E), the staging buffer or None)."""
    buffer = get_buffer(buffer_id)
    dims = _validate.check_inputs(
        x, topk_idx, topk_weights, w13, w2, num_experts=None if num_experts < 0 else num_experts, ep_size=ep_size,
        max_tokens=max_tokens_per_rank if (ep_size > 1 or buffer is not None) else None,
        activation_clamp=activation_clamp, block_m=block_m)
    _validate.check_buffer_shape(buffer, dims[1], dims[3])
    _check_accum(dw13_accum, w13, "dw13_accum (wgrad_accum[0])", x)
    _check_accum(dw2_accum, w2, "dw2_accum (wgrad_accum[1])", x)
    _validate.check_op_num_sms(num_sms)
    _validate.check_ep_chunks(ep_chunks, ep_size=ep_size, backend=backend, precision=precision)
    _validate.check_exact_mode(x, backend)
    return dims, buffer


@torch.library.custom_op("prime_kernels::mega_moe_fwd", mutates_args=())
def mega_moe_fwd(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    dw13_accum: Optional[Tensor],
    dw2_accum: Optional[Tensor],
    activation_clamp: Optional[float],
    group_name: str,
    num_experts: int,
    ep_size: int,
    max_tokens_per_rank: int,
    block_m: int,
    save_h: bool,
    backend: str,
    precision: str,
    buffer_id: int,
    keep_pooled_x: bool = False,
    num_sms: int = 0,
    deferral_id: int = 0,
    ep_chunks: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """y plus the state the backward reuses: (y, h, expert_counts, expert_offsets,
    pool_src_route, pool_src_rank, route_to_pool, x_pool). ``dw13_accum``/``dw2_accum`` are not read
    here; they ride along so that the backward can accumulate into them. ``num_experts`` < 0 means
    El * ep_size. ``buffer_id`` names the staging buffer (:func:`prime_kernels.mega.buffer.get_buffer`; 0 = none)
    the fused kernels use; it bounds T. x_pool: the token rows in pool order [capacity, H] with
    ``keep_pooled_x`` (the fused forward keeps its dispatched rows; the other backends gather them), else [0, H].
    ``num_sms``: the SMs the kernel backends may use (0 = every SM). ``deferral_id`` (0 = none) names the
    :class:`~prime_kernels.mega.deferred.DeferredWgrad` whose accumulators ``dw13_accum``/``dw2_accum`` are: the
    backward queues its weight gradients there instead of adding them. ``ep_chunks``: the expert-parallel path's chunk
    count (:mod:`prime_kernels.mega._ep_chunks`), the same on every rank."""
    (T, H, I, K, El, E), buffer = _check_forward_args(
        x, topk_idx, topk_weights, w13, w2, dw13_accum, dw2_accum, activation_clamp, num_experts, ep_size,
        max_tokens_per_rank, block_m, backend, buffer_id, num_sms, precision, ep_chunks)
    which = _backend.resolve("fwd", backend, precision, x, w13, ep_size=ep_size, activation_clamp=activation_clamp,
                             block_m=block_m)
    group = reference.resolve_group(group_name)
    which = _peer_ep.path_for_group(which, backend, group, x.device)
    return _backend.forward(which, x, topk_idx, topk_weights, w13, w2, precision=precision,
                            activation_clamp=activation_clamp, group=group, num_experts=E,
                            ep_size=ep_size, max_tokens_per_rank=max_tokens_per_rank, block_m=block_m, save_h=save_h,
                            buffer=buffer, keep_pooled_x=keep_pooled_x, num_sms=num_sms, ep_chunks=ep_chunks)


def empty_backward(x: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, need_wgrad: bool, dw13_accum,
                   dw2_accum):
    """The backward op's outputs for T = 0 on one rank: empty dx and d topk_weights; zero weight gradients where
    they are returned (no route reached an expert), accumulation buffers left as they are."""
    dw13 = torch.zeros_like(w13) if (need_wgrad and dw13_accum is None) else w13.new_empty((0,))
    dw2 = torch.zeros_like(w2) if (need_wgrad and dw2_accum is None) else w2.new_empty((0,))
    return x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape), dw13, dw2


@mega_moe_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, dw13_accum, dw2_accum, activation_clamp, group_name, num_experts,
      ep_size, max_tokens_per_rank, block_m, save_h, backend, precision, buffer_id, keep_pooled_x=False, num_sms=0,
      deferral_id=0, ep_chunks=1):
    _check_forward_args(x, topk_idx, topk_weights, w13, w2, dw13_accum, dw2_accum, activation_clamp, num_experts,
                        ep_size, max_tokens_per_rank, block_m, backend, buffer_id, num_sms, precision, ep_chunks)
    T, H = x.shape
    K = topk_idx.shape[1]
    El, twoI = w13.shape[0], w13.shape[1]
    cap = _backend.capacity(T, K, El, ep_size, max_tokens_per_rank, block_m)
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty((T, H)),
        x.new_empty((cap if save_h else 0, twoI)),
        torch.empty((El,), **i32),
        torch.empty((El + 1,), **i32),
        torch.empty((cap,), **i32),
        torch.empty((cap,), **i32),
        torch.empty((T, K), **i32),
        x.new_empty((cap if keep_pooled_x else 0, H)),
    )


@torch.library.custom_op("prime_kernels::mega_moe_bwd", mutates_args=("dw13_accum", "dw2_accum"))
def mega_moe_bwd(
    dy: Tensor,
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    h: Tensor,
    expert_counts: Tensor,
    expert_offsets: Tensor,
    pool_src_route: Tensor,
    pool_src_rank: Tensor,
    route_to_pool: Tensor,
    dw13_accum: Optional[Tensor],
    dw2_accum: Optional[Tensor],
    activation_clamp: Optional[float],
    group_name: str,
    num_experts: int,
    recompute: bool,
    need_wgrad: bool,
    backend: str,
    precision: str,
    buffer_id: int,
    x_pool: Optional[Tensor] = None,
    num_sms: int = 0,
    deferral_id: int = 0,
    ep_chunks: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d topk_weights, dw13, dw2). ``x_pool`` (the forward's pooled token rows, when it kept
    them) spares the grouped backward its gather of x. dw13 (dw2) is an empty tensor when ``need_wgrad`` is False
    or when it was added into ``dw13_accum`` (``dw2_accum``) instead. ``num_sms`` as in the forward op. With a
    ``deferral_id`` (the forward op's) the weight gradients are queued on that DeferredWgrad (added by its flush), and
    dw13, dw2 are empty.

    Every other input is one the forward op checked (its tensors, accumulation buffers and options) or the state
    it returned, as autograd hands them over: only dy is checked here."""
    ep_size = 1
    group = reference.resolve_group(group_name)
    if group is not None:
        ep_size = _comm.world_size(group)
    _validate.check_dy(dy, x)
    T = x.shape[0]
    E = w13.shape[0] * ep_size if num_experts < 0 else num_experts
    which = _backend.resolve("bwd", backend, precision, x, w13, ep_size=ep_size, activation_clamp=activation_clamp)
    which = _peer_ep.path_for_group(which, backend, group, x.device)
    if T == 0 and ep_size == 1:
        return empty_backward(x, topk_weights, w13, w2, need_wgrad, dw13_accum, dw2_accum)
    if deferral_id:
        dx, dtopk, later = _backend.backward(
            which, dy, x, topk_idx, topk_weights, w13, w2, h, expert_counts, expert_offsets, pool_src_route,
            pool_src_rank, route_to_pool, precision=precision, activation_clamp=activation_clamp, group=group,
            num_experts=E, recompute=recompute, need_wgrad=False, buffer=get_buffer(buffer_id), x_pool=x_pool,
            num_sms=num_sms, defer_wgrad=True, ep_chunks=ep_chunks)
        deferred.get(deferral_id).push(later)
        return dx, dtopk, w13.new_empty((0,)), w2.new_empty((0,))
    dx, dtopk, dw13, dw2 = _backend.backward(
        which, dy, x, topk_idx, topk_weights, w13, w2, h, expert_counts, expert_offsets, pool_src_route,
        pool_src_rank, route_to_pool, precision=precision, activation_clamp=activation_clamp, group=group,
        num_experts=E, recompute=recompute, need_wgrad=need_wgrad, dw13_accum=dw13_accum, dw2_accum=dw2_accum,
        buffer=get_buffer(buffer_id), x_pool=x_pool, num_sms=num_sms, ep_chunks=ep_chunks)
    if dw13 is None:
        dw13 = w13.new_empty((0,))
    if dw2 is None:
        dw2 = w2.new_empty((0,))
    return dx, dtopk, dw13, dw2


@mega_moe_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, h, expert_counts, expert_offsets, pool_src_route, pool_src_rank,
      route_to_pool, dw13_accum, dw2_accum, activation_clamp, group_name, num_experts, recompute, need_wgrad,
      backend, precision, buffer_id, x_pool=None, num_sms=0, deferral_id=0, ep_chunks=1):
    dw13 = w13.new_empty(w13.shape) if (need_wgrad and dw13_accum is None) else w13.new_empty((0,))
    dw2 = w2.new_empty(w2.shape) if (need_wgrad and dw2_accum is None) else w2.new_empty((0,))
    return x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape), dw13, dw2


def _check_accum(acc, w, name, x):
    if acc is None:
        return
    want = torch.float64 if x.dtype == torch.float64 else torch.float32
    if acc.dtype != want:
        _validate._fail(f"{name} must be {want} (an fp32 accumulation buffer), got {acc.dtype}", TypeError)
    if acc.shape != w.shape:
        _validate._fail(f"{name} must have the weight's shape {list(w.shape)}, got {list(acc.shape)}")
    if acc.device != w.device:
        _validate._fail(f"{name} must be on {w.device}, got {acc.device}")
    if not acc.is_contiguous():
        _validate._fail(f"{name} must be contiguous; call .contiguous()")


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_weights, w13, w2, dw13_accum, dw2_accum, activation_clamp, group_name, num_experts,
     ep_size, max_tokens_per_rank, block_m, save_h, backend, precision, buffer_id, *rest) = inputs
    num_sms = rest[1] if len(rest) > 1 else 0
    deferral_id = rest[2] if len(rest) > 2 else 0
    ep_chunks = rest[3] if len(rest) > 3 else 1
    y, h, counts, offsets, src, srank, r2p, x_pool = output
    ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, h, counts, offsets, src, srank, r2p,
                          dw13_accum, dw2_accum, x_pool)
    ctx.mark_non_differentiable(h, x_pool)
    ctx.set_materialize_grads(False)
    ctx.opts = (activation_clamp, group_name, num_experts, not save_h, backend, precision, buffer_id, num_sms,
                deferral_id, ep_chunks)


def _backward(ctx, dy, *unused):
    (x, topk_idx, topk_weights, w13, w2, h, counts, offsets, src, srank, r2p,
     dw13_accum, dw2_accum, x_pool) = ctx.saved_tensors
    (activation_clamp, group_name, num_experts, recompute, backend, precision, buffer_id, num_sms, deferral_id,
     ep_chunks) = ctx.opts
    needs = ctx.needs_input_grad
    if dy is None:
        dy = torch.zeros_like(x)
    need_wgrad = bool(needs[3] or needs[4])
    dx, dtopk, dw13, dw2 = torch.ops.prime_kernels.mega_moe_bwd(
        dy.contiguous(), x, topk_idx, topk_weights, w13, w2, h, counts, offsets, src, srank, r2p,
        dw13_accum, dw2_accum, activation_clamp, group_name, num_experts, recompute, need_wgrad, backend, precision,
        buffer_id, x_pool, num_sms, deferral_id, ep_chunks)
    g13 = dw13 if (needs[3] and dw13_accum is None) else None
    g2 = dw2 if (needs[4] and dw2_accum is None) else None
    return (dx if needs[0] else None, None, dtopk if needs[2] else None, g13, g2) + (None,) * 16


mega_moe_fwd.register_autograd(_backward, setup_context=_setup_context)
