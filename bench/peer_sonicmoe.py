"""SonicMoE (PyPI ``sonic-moe``) as a peer backend of bench_layer.py: our layer's inputs in, its y out.

The call pattern was learned from two sources: the transformers 5.24 "sonicmoe" experts backend
(transformers/integrations/sonicmoe.py, which builds the flat routing arrays and permutes the weights) and
sonic-moe 0.1.2.post1's own ``moe_general_routing_inputs`` (sonicmoe/functional/__init__.py), read for what
each argument means:

* ``router_scores`` [T*K]: one weight per route (cast to fp32 inside; its gradient is d topk_weights);
* ``token_indices`` [T*K] int32, sorted ascending: the token of each route;
* ``expert_indices`` [T*K] int32: the expert of each route;
* ``w1`` of shape (2I, H, E): our w13 [E, 2I, H] permuted (1, 2, 0); with ``concat_layout=True`` its 2I rows
  are [gate; up] as ours are (the default, False, would mean gate and up rows interleaved), and SwiGLU is
  silu(gate) * up, as ours;
* ``w2`` of shape (H, I, E): our w2 [E, H, I] permuted (1, 2, 0);
* ``E`` (it reads E from w2's last dimension anyway), ``stream_id`` (unused), ``is_inference_mode_enabled``
  (True saves nothing for a backward);
* it returns (y [T, H], the per-expert route counts).

Routes are taken token-major (token t's K routes in topk order), so the token indices are sorted as required.
The flat arrays are built inside every call, as transformers builds them, so their cost is in the timings.
The adapter has no expert parallelism and no masked routes (topk_idx < 0); bench_layer.py reports those cases
as skipped rather than calling it.
"""

from __future__ import annotations

import torch


def import_error() -> str | None:
    """None when sonicmoe and its activation enum import; else the exception as ``Type: message``."""
    try:
        import sonicmoe  # noqa: F401, PLC0415
        from sonicmoe.enums import ActivationType  # noqa: F401, PLC0415
    except Exception as e:  # an ImportError, or whatever a dependency raises at import time
        return f"{type(e).__name__}: {e}"
    return None


def sonicmoe_layer(x, topk_idx, topk_weights, w13, w2):
    """y [T, H] of the MoE layer, computed by sonicmoe.moe_general_routing_inputs.

    x [T, H] bf16; topk_idx [T, K] (every entry a valid expert); topk_weights [T, K]; w13 [E, 2I, H] with rows
    [gate; up]; w2 [E, H, I]. Differentiable in x, topk_weights, w13 and w2 (through SonicMoE's autograd)."""
    import sonicmoe  # noqa: PLC0415
    from sonicmoe.enums import ActivationType  # noqa: PLC0415

    T, K = topk_idx.shape
    E = w13.shape[0]
    token_idx = torch.arange(T, device=x.device, dtype=torch.int32).unsqueeze(1).expand(T, K).reshape(-1)
    expert_idx = topk_idx.reshape(-1).to(torch.int32)
    # the scores in the activations' dtype, as transformers passes them (SonicMoE widens them to fp32)
    scores = topk_weights.reshape(-1).to(x.dtype)
    y, _ = sonicmoe.moe_general_routing_inputs(
        x, scores, token_idx, expert_idx, w13.permute(1, 2, 0), None, w2.permute(1, 2, 0), None,
        E=E, stream_id=None, activation_type=ActivationType.SWIGLU,
        is_inference_mode_enabled=not torch.is_grad_enabled(), concat_layout=True)
    return y
