"""Shared experts beside the routed ones (DeepSeek-style): every token goes through each of S shared SwiGLU experts,
with weight 1 or a per-token gate, and the result is added to the routed experts' output.

The shared experts run through the same layer op as the routed ones (:func:`prime_kernels.mega.mega_moe`): S experts
to which every token routes once each, so each backend (the fused and grouped kernels, the reference) computes them
with its own kernels and its own autograd. With an expert-parallel group the shared experts are replicated: each
rank computes them for its own tokens, with no exchange. They run as a second pass of the layer's kernels after the
routed experts' pass, except where :func:`prime_kernels.mega._shared_ops.reason` is None: then they run inside the
routed experts' launches (:mod:`prime_kernels.mega._shared_grouped`, SF1-SF3: one rounding of y instead of S2's).

Semantics, with the rounding points of :mod:`prime_kernels.mega.reference` (F1-F6, B1-B10):

  S1. y_shared = the layer over the shared weights: E = S experts, K = S routes per token (route s to expert s),
      topk weights gate[t, s] (1 without a gate), F1-F6 as for any layer (so y_shared is rounded to bf16 by F5).
  S2. y_t = round_io(y_routed_t + y_shared_t)          the sum in acc (fp32), one more rounding
  S3. backward: dy feeds both layers unchanged; dx_t = round_io(dx_routed_t + dx_shared_t) in acc, the shared
      weights' gradients are the shared layer's B10 (into ``.grad``: ``wgrad_accum`` is the routed weights' only),
      d gate is its B3.

Shapes: ``shared_w13`` [S, 2Is, H] (gate rows [0, Is), up rows [Is, 2Is), as w13) or [2Is, H] for one shared
expert, ``shared_w2`` [S, H, Is] or [H, Is]; ``shared_gate`` None, [T] (one gate for all S) or [T, S], float32.
The shared intermediate Is is the shared experts' own (it need not equal the routed I); the kernel backends need it
to be a multiple of 64 (128 for FP8), as I.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _backend, _validate


@dataclass
class SharedCall:
    """The shared layer of S1 as the routed op takes it: weights [S, 2Is, H] / [S, H, Is], routes and weights [T, S]."""

    w13: torch.Tensor
    w2: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def shared_weights_3d(shared_w13, shared_w2) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared weights as [S, 2Is, H] and [S, H, Is] views (a 2-D pair is one shared expert)."""
    for name, w in (("shared_w13", shared_w13), ("shared_w2", shared_w2)):
        if not isinstance(w, torch.Tensor):
            _validate._fail(f"{name} must be a torch.Tensor, got {type(w).__name__}", TypeError)
    if shared_w13.dim() != shared_w2.dim() or shared_w13.dim() not in (2, 3):
        _validate._fail(f"shared_w13 and shared_w2 must both be 3-D ([S, 2Is, H], [S, H, Is]) or both 2-D (one shared "
                        f"expert), got shapes {list(shared_w13.shape)} and {list(shared_w2.shape)}")
    if shared_w13.dim() == 2:
        return shared_w13.unsqueeze(0), shared_w2.unsqueeze(0)
    return shared_w13, shared_w2


def shared_routes(x: torch.Tensor, num_shared: int, shared_gate) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [T, S] int64: route s to expert s; topk_weights [T, S]: the gate, or ones) of S1, contiguous, the
    weights in the dtype the op takes with x's (float32; float64 in the reference's exact mode)."""
    T = x.shape[0] if x.dim() == 2 else 0
    want = torch.float64 if x.dtype == torch.float64 else torch.float32
    idx = torch.arange(num_shared, device=x.device, dtype=torch.int64).expand(T, num_shared).contiguous()
    if shared_gate is None:
        return idx, torch.ones(T, num_shared, device=x.device, dtype=want)
    if not isinstance(shared_gate, torch.Tensor):
        _validate._fail(f"shared_gate must be a torch.Tensor or None, got {type(shared_gate).__name__}", TypeError)
    if shared_gate.dtype != want:
        _validate._fail(f"shared_gate must be {want} (as topk_weights), got {shared_gate.dtype}", TypeError)
    if shared_gate.device != x.device:
        _validate._fail(f"shared_gate is on {shared_gate.device}, x on {x.device}")
    if list(shared_gate.shape) == [T]:
        return idx, shared_gate.unsqueeze(1).expand(T, num_shared).contiguous()
    if list(shared_gate.shape) != [T, num_shared]:
        _validate._fail(f"shared_gate must be [T] = [{T}] or [T, S] = [{T}, {num_shared}], got "
                        f"{list(shared_gate.shape)}")
    return idx, shared_gate.contiguous()


def prepare(x: torch.Tensor, shared_w13, shared_w2, shared_gate, *, backend: str, precision: str,
            activation_clamp, block_m) -> Optional[SharedCall]:
    """None without shared experts; else the shared layer's call, checked as the op will check it (shapes, dtypes,
    devices, the backend that will run it), so that a bad shared argument raises before the routed experts run."""
    if shared_w13 is None and shared_w2 is None and shared_gate is None:
        return None
    if shared_w13 is None or shared_w2 is None:
        _validate._fail("shared_w13 and shared_w2 go together (shared_gate needs both)")
    w13, w2 = shared_weights_3d(shared_w13, shared_w2)
    idx, weights = shared_routes(x, w13.shape[0], shared_gate)
    _validate.check_inputs(x, idx, weights, w13, w2, num_experts=w13.shape[0], ep_size=1,
                           activation_clamp=activation_clamp, block_m=block_m)
    _backend.resolve("fwd", backend, precision, x, w13, ep_size=1, activation_clamp=activation_clamp,
                     block_m=block_m)
    return SharedCall(w13, w2, idx, weights)


def add_shared(y_routed: torch.Tensor, y_shared: torch.Tensor) -> torch.Tensor:
    """S2: the two outputs summed in fp32 (float64 stays float64) and rounded once to y's dtype."""
    acc = torch.float64 if y_routed.dtype == torch.float64 else torch.float32
    return (y_routed.to(acc) + y_shared.to(acc)).to(y_routed.dtype)


def run(layer, x: torch.Tensor, call: SharedCall, **layer_kwargs) -> torch.Tensor:
    """y_shared of S1 through ``layer`` (:func:`prime_kernels.mega.mega_moe`), with ``layer_kwargs`` (precision,
    backend, activation_clamp, ...) as the routed call's; no group, buffer, weight accumulators or plan: the shared
    experts are local and their gradients go to ``.grad``."""
    return layer(x, call.topk_idx, call.topk_weights, call.w13, call.w2, num_experts=call.w13.shape[0],
                 **layer_kwargs)
