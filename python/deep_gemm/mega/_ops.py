"""torch.library custom ops ``deep_gemm::mega_moe_fwd`` and ``deep_gemm::mega_moe_bwd``.

Both are registered for every device through the same Python implementation, which validates,
resolves the backend (fused kernel or reference, see :mod:`deep_gemm.mega._backend`) and runs it.
``register_fake`` gives static output shapes (the pool is laid into a fixed capacity, see
:func:`deep_gemm.mega._plan.pool_capacity`), and ``register_autograd`` joins the two ops.

The routing plan is an output of the forward op and is saved for the backward, which reuses it.
When the caller passes fp32 weight-gradient accumulation buffers (``dw13_accum``/``dw2_accum``),
the backward op adds the weight gradients into them and autograd returns None for w13 and w2.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _backend, _fused, _grouped, _validate, reference
from ._plan import pool_capacity
from .buffer import get_buffer


def _capacity(T, K, El, ep_size, max_tokens_per_rank, block_m):
    tmax = T if ep_size == 1 else max_tokens_per_rank
    return pool_capacity(ep_size * tmax * K, El, block_m)


@torch.library.custom_op("deep_gemm::mega_moe_fwd", mutates_args=())
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """y plus the state the backward reuses: (y, h, expert_counts, expert_offsets,
    pool_src_route, pool_src_rank, route_to_pool, x_pool). ``dw13_accum``/``dw2_accum`` are not read
    here; they ride along so that the backward can accumulate into them. ``buffer_id`` names the
    staging buffer (:func:`deep_gemm.mega.buffer.get_buffer`; 0 = none) the fused kernels use.
    x_pool: the token rows in pool order [capacity, H] with ``keep_pooled_x`` (the fused forward
    keeps its dispatched rows; the other backends gather them), else [0, H]."""
    T, H, I, K, El, E = _validate.check_inputs(
        x, topk_idx, topk_weights, w13, w2, num_experts=num_experts, ep_size=ep_size,
        max_tokens=max_tokens_per_rank if ep_size > 1 else None, activation_clamp=activation_clamp)
    _validate.check_exact_mode(x, backend)
    which = _backend.resolve_backend(backend, precision, "fwd", device_type=x.device.type, hidden=H, intermediate=I,
                                     ep_size=ep_size, activation_clamp=activation_clamp)
    # raises before returning (see its docstring); the kernel backends hand it their plan's count
    ids = _validate.ExpertIdCheck(topk_idx, E, which, from_plan=ep_size == 1)
    cap = _capacity(T, K, El, ep_size, max_tokens_per_rank, block_m)
    kwargs = dict(activation_clamp=activation_clamp, group=reference.resolve_group(group_name), num_experts=E,
                  max_tokens_per_rank=max_tokens_per_rank, block_m=block_m, capacity=cap, save_h=save_h)
    x_pool = None
    if which == "fused":
        out = _fused.forward(x, topk_idx, topk_weights, w13, w2, precision=precision, buffer=get_buffer(buffer_id),
                             keep_x_pool=keep_pooled_x, id_check=ids, **kwargs)
        out, x_pool = out[:7], out[7]
    elif which == "grouped":
        with torch.no_grad():
            out = _grouped.forward(x, topk_idx, topk_weights, w13, w2, buffer=get_buffer(buffer_id), id_check=ids,
                                   **kwargs)
    else:
        with torch.no_grad():
            out = reference.forward(x, topk_idx, topk_weights, w13, w2, **kwargs)
    if x_pool is None:
        with torch.no_grad():
            x_pool = _gather_pool_rows(x, out[4], K) if keep_pooled_x else x.new_empty((0, H))
    ids.finish()
    return tuple(out) + (x_pool,)


def _gather_pool_rows(x: Tensor, pool_src_route: Tensor, top_k: int) -> Tensor:
    """x rows in pool order (zero rows for padding), for backends whose forward does not keep them."""
    tok = _grouped._token_rows(pool_src_route, top_k)
    return x.index_select(0, tok.clamp(min=0).long()).masked_fill_((tok < 0)[:, None], 0)


@mega_moe_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, dw13_accum, dw2_accum, activation_clamp, group_name, num_experts,
      ep_size, max_tokens_per_rank, block_m, save_h, backend, precision, buffer_id, keep_pooled_x=False):
    T, H = x.shape
    K = topk_idx.shape[1]
    El, twoI = w13.shape[0], w13.shape[1]
    cap = _capacity(T, K, El, ep_size, max_tokens_per_rank, block_m)
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


@torch.library.custom_op("deep_gemm::mega_moe_bwd", mutates_args=("dw13_accum", "dw2_accum"))
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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d topk_weights, dw13, dw2). ``x_pool`` (the forward's pooled token rows, when it kept
    them) spares the grouped backward its gather of x. dw13 (dw2) is an empty tensor when ``need_wgrad`` is False
    or when it was added into ``dw13_accum`` (``dw2_accum``) instead."""
    ep_size = 1
    group = reference.resolve_group(group_name)
    if group is not None:
        ep_size = torch.distributed.get_world_size(group)
    T, H, I, K, El, E = _validate.check_inputs(
        x, topk_idx, topk_weights, w13, w2, num_experts=num_experts, ep_size=ep_size,
        activation_clamp=activation_clamp, dy=dy)
    _check_accum(dw13_accum, w13, "dw13_accum", x)
    _check_accum(dw2_accum, w2, "dw2_accum", x)
    _validate.check_exact_mode(x, backend)
    which = _backend.resolve_backend(backend, precision, "bwd", device_type=x.device.type, hidden=H, intermediate=I,
                                     ep_size=ep_size, activation_clamp=activation_clamp)
    kwargs = dict(activation_clamp=activation_clamp, group=group, num_experts=E, recompute=recompute,
                  need_wgrad=need_wgrad, dw13_accum=dw13_accum, dw2_accum=dw2_accum)
    if x_pool is not None and x_pool.shape[0] == pool_src_route.shape[0] and x_pool.shape[0] > 0:
        kwargs["x_pool"] = x_pool
    args = (dy, x, topk_idx, topk_weights, w13, w2, h, expert_counts, expert_offsets, pool_src_route,
            pool_src_rank, route_to_pool)
    if which == "fused":
        dx, dtopk, dw13, dw2 = _fused.backward(*args, precision=precision, buffer=get_buffer(buffer_id), **kwargs)
    elif which == "grouped":
        with torch.no_grad():
            dx, dtopk, dw13, dw2 = _grouped.backward(*args, buffer=get_buffer(buffer_id), **kwargs)
    else:
        with torch.no_grad():
            dx, dtopk, dw13, dw2 = reference.backward(*args, **kwargs)
    if dw13 is None:
        dw13 = w13.new_empty((0,))
    if dw2 is None:
        dw2 = w2.new_empty((0,))
    return dx, dtopk, dw13, dw2


@mega_moe_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, h, expert_counts, expert_offsets, pool_src_route, pool_src_rank,
      route_to_pool, dw13_accum, dw2_accum, activation_clamp, group_name, num_experts, recompute, need_wgrad,
      backend, precision, buffer_id, x_pool=None):
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
    y, h, counts, offsets, src, srank, r2p, x_pool = output
    ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, h, counts, offsets, src, srank, r2p,
                          dw13_accum, dw2_accum, x_pool)
    ctx.mark_non_differentiable(h, x_pool)
    ctx.set_materialize_grads(False)
    ctx.opts = (activation_clamp, group_name, num_experts, not save_h, backend, precision, buffer_id)


def _backward(ctx, dy, *unused):
    (x, topk_idx, topk_weights, w13, w2, h, counts, offsets, src, srank, r2p,
     dw13_accum, dw2_accum, x_pool) = ctx.saved_tensors
    activation_clamp, group_name, num_experts, recompute, backend, precision, buffer_id = ctx.opts
    needs = ctx.needs_input_grad
    if dy is None:
        dy = torch.zeros_like(x)
    need_wgrad = bool(needs[3] or needs[4])
    dx, dtopk, dw13, dw2 = torch.ops.deep_gemm.mega_moe_bwd(
        dy.contiguous(), x, topk_idx, topk_weights, w13, w2, h, counts, offsets, src, srank, r2p,
        dw13_accum, dw2_accum, activation_clamp, group_name, num_experts, recompute, need_wgrad, backend, precision,
        buffer_id, x_pool)
    g13 = dw13 if (needs[3] and dw13_accum is None) else None
    g2 = dw2 if (needs[4] and dw2_accum is None) else None
    return (dx if needs[0] else None, None, dtopk if needs[2] else None, g13, g2) + (None,) * 13


mega_moe_fwd.register_autograd(_backward, setup_context=_setup_context)
