"""torch.library custom ops ``prime_kernels::mega_moe_shared_fwd`` / ``mega_moe_shared_bwd``: the layer with its
shared experts inside the routed experts' launches (:mod:`prime_kernels.mega._shared_grouped`, SF1-SF3; in FP8
:mod:`prime_kernels.mega._shared_fp8`), joined by ``register_autograd``; fake kernels give the static shapes
torch.compile needs.

:func:`layer` is the call :func:`prime_kernels.mega.mega_moe` makes when :func:`reason` is None: one rank, no
weight-gradient accumulators, no returned plan, the shared intermediate a multiple of the routed one (a multiple of
128), and its status entries available on the device: ``mega_moe_shared.bf16.sm90`` and
``m_grouped_gemm_second_b.bf16.sm90`` for bf16 (the grouped pipeline on the second-B GEMMs; its forward is the fused
kernel with the second B where ``mega_moe_shared_fused.bf16.sm90`` is available too),
``mega_moe_shared.fp8.sm90`` for fp8 (the FP8 layer on the combined FP8 weight copies); in bf16 at most
``BF16_MAX_SHARED_GROUPS`` shared groups (measured: beyond that the second pass is faster). Elsewhere the shared
experts run as a second pass of the layer (:mod:`prime_kernels.mega.shared`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _backend, _shared_fp8, _shared_grouped, _validate
from .constants import FUSED_MAX_EXPERTS, GROUPED_MAX_EXPERTS
from .. import _status
from ..routing import pool_capacity
from ..second_b import STATUS_KEY_STEM

SECOND_B_KEY = f"{STATUS_KEY_STEM}.sm90"
# the layer path's own entries
BF16_KEY = "mega_moe_shared.bf16.sm90"
FP8_KEY = "mega_moe_shared.fp8.sm90"
# the fused BF16 forward with the shared experts' chunks as its last groups (the kernel's second B)
FUSED_BF16_KEY = "mega_moe_shared_fused.bf16.sm90"
# The most shared groups (S shared experts x Is / I chunks each) that bf16 runs inside the routed launches. In bf16
# the shared chunks' L2 dgrad is a launch of its own (on a copy of their w2) and their weight gradients are a
# k-grouped launch of their own, so every group adds to the backward what the second pass does once for any width.
# Measured on an H100, T = 16384, both paths in one run (bench/results/bench_shared_h100_2026-12-07_c1bc3d6_bf16_groups
# .log, forward / forward + backward in ms, second pass against inside): two groups are faster inside at both shapes
# (30B 2 x I: 3.44 / 11.50 against 3.06 / 10.90; 235B 1 x 2I: 11.15 / 38.05 against 11.22 / 37.37, so also with the
# forward run again under checkpointing); from three groups on the forward is slower inside at 235B (1 x 3I: 12.39
# against 13.34; 4 x I: 13.61 against 14.29) and a recomputed forward takes back what the backward gains (1 x 3I:
# 53.02 against 53.11 for forward + backward + forward). FP8 has no such launches (its shared groups are experts of
# the combined FP8 copies) and runs faster inside at both widths (30B: 9.40 against 10.71 ms at one group, 11.95
# against 12.14 at four), so it has no such limit.
BF16_MAX_SHARED_GROUPS = 2


def runs_inside(x2d: Tensor, w13: Tensor, shared_inter: int, *, backend: str, precision: str) -> bool:
    """What the integrations ask before they hand a model's shared SwiGLU expert (intermediate size
    ``shared_inter``) to the routed experts' call: whether :func:`reason` lets it run inside the routed launches of a
    one-rank call on the tokens ``x2d`` with ``w13`` [E, 2I, H], no accumulators, no returned plan, no clamp. A
    function of shapes, devices and the kernels' status only (the shared weight is a meta tensor), so the modules
    of one layer that ask it always agree."""
    shared_w13 = torch.empty((1, 2 * shared_inter, w13.shape[-1]), device="meta")
    return reason(x2d, w13, shared_w13, backend=backend, precision=precision, ep_size=1, accumulators=False,
                  return_plan=False, activation_clamp=None) is None


def reason(x: Tensor, w13: Tensor, shared_w13: Tensor, *, backend: str, precision: str, ep_size: int,
           accumulators: bool, return_plan: bool, activation_clamp) -> Optional[str]:
    """None when the shared experts can run inside the routed experts' launches for this call, else why not."""
    if x.device.type != "cuda":
        return "the shared experts run inside the routed launches on CUDA only"
    if precision not in ("bf16", "fp8") or ep_size != 1 or backend not in ("auto", "grouped", "fused"):
        return "inside the routed launches: bf16 or fp8, one rank"
    if x.dim() != 2 or x.shape[0] == 0:
        return "inside the routed launches: at least one token"
    if accumulators or return_plan:
        return "inside the routed launches: no wgrad_accum and no returned plan"
    inter, shared_inter = w13.shape[1] // 2, shared_w13.shape[1] // 2
    chunks = _shared_grouped.chunks_of(inter, shared_inter)
    if chunks is None or inter % 128 != 0:
        return (f"the shared intermediate ({shared_inter}) must be a multiple of the routed one ({inter}), itself a "
                f"multiple of 128")
    num_groups = w13.shape[0] + shared_w13.shape[0] * chunks
    if precision == "bf16" and shared_w13.shape[0] * chunks > BF16_MAX_SHARED_GROUPS:
        return (f"in bf16, {shared_w13.shape[0]} shared expert(s) of {chunks} chunk(s) of width {inter} are "
                f"{shared_w13.shape[0] * chunks} groups; beyond {BF16_MAX_SHARED_GROUPS} the second pass is faster "
                f"(docs/shared_experts.md)")
    if num_groups > GROUPED_MAX_EXPERTS:
        return f"E + S * chunks exceeds GROUPED_MAX_EXPERTS={GROUPED_MAX_EXPERTS}"
    if precision == "bf16" and backend == "fused" and not _bf16_fused_forward(backend, activation_clamp, num_groups):
        return (f"inside the routed launches in bf16 with backend 'fused': {FUSED_BF16_KEY}: "
                f"{_status.reason(FUSED_BF16_KEY)}")
    for key in (SECOND_B_KEY, BF16_KEY) if precision == "bf16" else (FP8_KEY,):
        why = _status.reason(key)
        if not _status.is_available(why):
            return f"{key}: {why}"
    if precision == "fp8":
        if w13.shape[2] % 128:
            return f"inside the FP8 launches: H ({w13.shape[2]}) must be a multiple of 128"
        return (_backend.fp8_kernel_reason("fp8", "fwd") or _backend._fp8_pipeline_reason("fp8", 1, activation_clamp)
                or _backend._grouped_reason("fp8", 1, activation_clamp, w13.shape[0]))
    return _backend._grouped_reason("bf16", 1, activation_clamp, w13.shape[0])


def _bf16_fused_forward(backend: str, activation_clamp, num_groups: int) -> bool:
    """Whether the BF16 forward runs the fused kernel with the second B (else the grouped pipeline's forward)."""
    return (backend in ("auto", "fused") and num_groups <= FUSED_MAX_EXPERTS
            and _status.is_available(_status.reason(FUSED_BF16_KEY)) and _backend._fused_reason("bf16", "fwd") is None)


def _fp8_fused_forward(backend: str, activation_clamp, num_groups: int) -> bool:
    """Whether the FP8 forward runs the fused kernel (else the FP8 forward pipeline, which takes a clamp)."""
    return (backend in ("auto", "fused") and activation_clamp is None and num_groups <= FUSED_MAX_EXPERTS
            and _backend._fused_reason("fp8", "fwd") is None)


@torch.library.custom_op("prime_kernels::mega_moe_shared_fwd", mutates_args=())
def mega_moe_shared_fwd(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                        shared_w13: Tensor, shared_w2: Tensor, chunks: int, activation_clamp: Optional[float],
                        block_m: int, save_h: bool, num_sms: int = 0, precision: str = "bf16", fused: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, h, expert_counts, expert_offsets, pool_src_route, pool_src_rank, route_to_pool) over the extended routes
    (:func:`prime_kernels.mega._shared_grouped.extended_routes`); ``fused``: the fused forward kernel (fp8's on the
    combined copies, bf16's with the second B)."""
    num_groups = w13.shape[0] + shared_w13.shape[0] * chunks
    cap = pool_capacity(x.shape[0], topk_idx.shape[1], num_groups, block_m)
    run = _shared_fp8.forward if precision == "fp8" else _shared_grouped.forward
    out = run(x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, chunks=chunks,
              activation_clamp=activation_clamp, block_m=block_m, capacity=cap, save_h=save_h, num_sms=num_sms,
              fused=fused)
    return tuple(t.contiguous() for t in out)


@mega_moe_shared_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, chunks, activation_clamp, block_m, save_h,
      num_sms=0, precision="bf16", fused=False):
    T, K = topk_idx.shape
    num_groups = w13.shape[0] + shared_w13.shape[0] * chunks
    cap = pool_capacity(T, K, num_groups, block_m)
    i32 = dict(dtype=torch.int32)
    return (x.new_empty(T, x.shape[1]), x.new_empty(cap if save_h else 0, w13.shape[1]),
            x.new_empty(num_groups, **i32), x.new_empty(num_groups + 1, **i32), x.new_empty(cap, **i32),
            x.new_empty(cap, **i32), x.new_empty(T, K, **i32))


@torch.library.custom_op("prime_kernels::mega_moe_shared_bwd", mutates_args=())
def mega_moe_shared_bwd(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                        shared_w13: Tensor, shared_w2: Tensor, h: Tensor, expert_counts: Tensor,
                        expert_offsets: Tensor, pool_src_route: Tensor, pool_src_rank: Tensor, route_to_pool: Tensor,
                        chunks: int, activation_clamp: Optional[float], recompute: bool, need_wgrad: bool,
                        num_sms: int = 0, precision: str = "bf16"
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d topk_weights, dW13, dW2, d shared_w13, d shared_w2); the weight gradients [0] without need_wgrad."""
    h_saved = None if recompute else h
    opts = dict(chunks=chunks, activation_clamp=activation_clamp, recompute=recompute, need_wgrad=need_wgrad,
                num_sms=num_sms)
    if precision == "fp8":
        out = _shared_fp8.backward(dy, x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2,
                                   h_saved if h_saved is not None else x.new_empty((0, w13.shape[1])), expert_counts,
                                   expert_offsets, pool_src_route, pool_src_rank, route_to_pool, **opts)
    else:
        out = _shared_grouped.backward(dy, x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, h_saved,
                                       expert_counts, expert_offsets, pool_src_route, route_to_pool, **opts)
    dx, dtopk = out[0], out[1]
    grads = [g.contiguous() if g is not None else w.new_empty((0,))
             for g, w in zip(out[2:], (w13, w2, shared_w13, shared_w2))]
    return (dx, dtopk, *grads)


@mega_moe_shared_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, h, expert_counts, expert_offsets, pool_src_route,
      pool_src_rank, route_to_pool, chunks, activation_clamp, recompute, need_wgrad, num_sms=0, precision="bf16"):
    grads = [w.new_empty(w.shape if need_wgrad else (0,)) for w in (w13, w2, shared_w13, shared_w2)]
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape), *grads)


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, chunks, activation_clamp, block_m, save_h,
     *rest) = inputs
    y, h, counts, offsets, src, srank, r2p = output
    ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, shared_w13, shared_w2, h, counts, offsets, src, srank,
                          r2p)
    ctx.mark_non_differentiable(h, counts, offsets, src, srank, r2p)
    ctx.set_materialize_grads(False)
    ctx.opts = (chunks, activation_clamp, not save_h, rest[0] if rest else 0, rest[1] if len(rest) > 1 else "bf16")


def _backward(ctx, dy, *unused):
    x, topk_idx, topk_weights, w13, w2, sw13, sw2, h, counts, offsets, src, srank, r2p = ctx.saved_tensors
    chunks, clamp, recompute, num_sms, precision = ctx.opts
    needs = ctx.needs_input_grad
    if dy is None:
        dy = torch.zeros_like(x)
    need_wgrad = bool(needs[3] or needs[4] or needs[5] or needs[6])
    dx, dtopk, dw13, dw2, dsw13, dsw2 = torch.ops.prime_kernels.mega_moe_shared_bwd(
        dy.contiguous(), x, topk_idx, topk_weights, w13, w2, sw13, sw2, h, counts, offsets, src, srank, r2p, chunks,
        clamp, recompute, need_wgrad, num_sms, precision)
    wanted = [g if needs[i] else None for i, g in zip((3, 4, 5, 6), (dw13, dw2, dsw13, dsw2))]
    return (dx if needs[0] else None, None, dtopk if needs[2] else None, *wanted) + (None,) * 7


mega_moe_shared_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, shared_w13: Tensor,
          shared_w2: Tensor, shared_gate: Optional[Tensor], *, activation_clamp, block_m: int, recompute: bool,
          num_sms: int, precision: str = "bf16", backend: str = "auto") -> Tensor:
    """y of the layer with its shared experts inside the routed launches (SF1-SF3); gradients through autograd
    (d shared_gate through the extended topk_weights)."""
    E = w13.shape[0]
    _validate.check_inputs(x, topk_idx, topk_weights, w13, w2, num_experts=E, ep_size=1, max_tokens=None,
                           activation_clamp=activation_clamp, block_m=block_m)
    # an id in [E, E + S * chunks) would be a route to a shared chunk: checked against E, raised after the launches
    # (the plan reads nothing out of bounds; only this call's fresh outputs are written)
    ids = _validate.ExpertIdCheck(topk_idx, E, "grouped")
    inter = w13.shape[1] // 2
    chunks = _shared_grouped.chunks_of(inter, shared_w13.shape[1] // 2)
    idx, weights = _shared_grouped.extended_routes(topk_idx, topk_weights, E, shared_w13.shape[0], chunks,
                                                   shared_gate)
    save_h = not recompute and torch.is_grad_enabled()
    num_groups = E + shared_w13.shape[0] * chunks
    fused = x.is_cuda and (_fp8_fused_forward if precision == "fp8" else _bf16_fused_forward)(
        backend, activation_clamp, num_groups)
    y = mega_moe_shared_fwd(x, idx, weights, w13, w2, shared_w13, shared_w2, chunks, activation_clamp, block_m,
                            save_h, num_sms, precision, fused)[0]
    ids.finish()
    return y
