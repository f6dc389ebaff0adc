"""Public entry points of ``deep_gemm.mega``: the autograd layer and the DeepGEMM-shaped calls."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from . import _backend, _fused, _grouped, _ops, _validate, reference  # noqa: F401  (_ops registers the custom ops)
from ._plan import make_plan
from .buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from .constants import BLOCK_M

_MMA_FOR_PRECISION = {"bf16": "bf16xbf16", "fp8": "fp8xfp8", "fp8_bwd": "bf16xbf16", "mxfp8": "fp8xfp8"}


def _group_info(group):
    if group is None:
        return 1, ""
    import torch.distributed as dist  # noqa: PLC0415

    R = dist.get_world_size(group)
    return R, (group.group_name if R > 1 else "")


def _wgrad_accum_pair(wgrad_accum):
    """The two accumulation buffers (each may be None); the forward op checks them against the weights."""
    if wgrad_accum is None:
        return None, None
    if not isinstance(wgrad_accum, (tuple, list)) or len(wgrad_accum) != 2:
        _validate._fail("wgrad_accum must be a pair (dw13_fp32, dw2_fp32) of tensors shaped like w13 and w2")
    a13, a2 = wgrad_accum
    for name, a in (("wgrad_accum[0]", a13), ("wgrad_accum[1]", a2)):
        if a is not None and not isinstance(a, torch.Tensor):
            _validate._fail(f"{name} must be a torch.Tensor or None, got {type(a).__name__}", TypeError)
    return a13, a2


def mega_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    group=None,
    precision: str = "bf16",
    activation_clamp: Optional[float] = None,
    backend: str = "auto",
    recompute: bool = False,
    num_experts: Optional[int] = None,
    buffer: Optional[SymmBuffer] = None,
    max_tokens_per_rank: Optional[int] = None,
    wgrad_accum=None,
    block_m: int = BLOCK_M,
    return_plan: bool = False,
    keep_pooled_x: Optional[bool] = None,
    num_sms: Optional[int] = None,
):
    """Routed-experts MoE layer: ``y[t] = sum_k w[t,k] * W2[e] (silu(Wg[e] x_t) * (Wu[e] x_t))``.

    Args:
      x: [T, H] bf16 tokens of this rank (float64 is accepted with ``backend="reference"`` as an
        exact, unrounded mode for tests).
      topk_idx: [T, K] int64 (int32 accepted) global expert ids, -1 masks a route.
      topk_weights: [T, K] fp32, applied in fp32 at the combine.
      w13: [El, 2I, H] local experts' gate rows [0, I) then up rows [I, 2I) (natural layout).
      w2: [El, H, I].
      group: a ``torch.distributed`` process group for expert parallelism (experts sharded by
        rank, El = E / R contiguous per rank, tokens exchanged all-to-all), or None.
      precision: "bf16" (others report through ``deep_gemm.status()`` and raise for now).
      activation_clamp: None (no clamp) or a finite c > 0: gate <= c and -c <= up <= c before SiLU
        (DeepSeek-V4).
      backend: "auto" | "fused" | "grouped" | "reference" (see :mod:`deep_gemm.mega._backend`).
      recompute: recompute the gate/up pre-activation h in the backward instead of saving it. Without
        a possible backward (grad mode off, or no input that takes a gradient) h is never saved, so
        inference does not pay for it.
      num_experts: E over the group (default El * group size); checked against the group.
      buffer: a :class:`SymmBuffer`; bounds the tokens per rank (the fused kernels stage into it).
      max_tokens_per_rank: with EP and no buffer, the largest T of any rank (default: this T,
        which then must be equal on every rank).
      wgrad_accum: optional pair (dw13_fp32, dw2_fp32) shaped like w13 / w2: the backward *adds*
        the weight gradients into them (fp32), and autograd returns None for w13 and w2 (so
        ``w13.grad`` / ``w2.grad`` are left untouched). Either entry may be None.
      block_m: pool m-block (rows per expert padded to a multiple of it): one of
        ``constants.KERNEL_BLOCK_MS`` (128) on the kernel backends, any int in [1, 1024] on the reference.
      return_plan: also return the routing plan the forward built (and the backward reuses).
      keep_pooled_x: keep the token rows in pool order ([T*K, H] bf16 for one rank, K times x's size)
        from the forward for the backward, which then does not gather x again for dW13 (the fused
        forward has them anyway: it dispatched them; the grouped and reference ones gather them).
        Costs that memory from the forward to the backward (the torch baseline's autograd keeps its
        gathered rows too). None (default): kept exactly when the forward runs the fused kernel and dW13
        will be needed (grad mode on and w13 requires grad, or ``wgrad_accum`` given), so inference and
        the other backends are unchanged; at Qwen3-30B-A3B, T=16384 on an H200 the backward was 0.14 ms
        shorter with it in one run (5.08 -> 4.94 ms) at the same forward+backward peak memory
        (docs/performance.md).
      num_sms: the most SMs the kernels of this call (forward and backward) may use, so that a trainer can leave
        SMs to its communication kernels; None (default) = all of them. The reference ignores it.

    Returns y [T, H] (x's dtype), or (y, plan) with ``return_plan=True``. T = 0 is allowed: y is [0, H]
    and the weight gradients are zero.
    Gradients flow to x, topk_weights, w13 and w2 (not to topk_idx).
    The rounding points are listed in the docstring of :mod:`deep_gemm.mega.reference`.
    """
    # The forward op checks the tensors (and everything else) before any compute: this is the one place on
    # this path. Only what cannot reach the op as typed (a bool read as a number, a non-tensor) is checked here.
    _validate.check_tensor_types(x=x, topk_idx=topk_idx, topk_weights=topk_weights, w13=w13, w2=w2)
    ep_size, group_name = _group_info(group)
    if buffer is not None and not isinstance(buffer, SymmBuffer):
        _validate._fail(f"buffer must come from get_symm_buffer_for_mega_moe, got {type(buffer).__name__}", TypeError)
    a13, a2 = _wgrad_accum_pair(wgrad_accum)
    clamp = _validate.check_activation_clamp(activation_clamp)
    block_m = _validate.check_block_m(block_m)
    sms = _validate.num_sms_arg(num_sms)
    if buffer is not None:
        max_tokens = buffer.num_max_tokens_per_rank
    elif max_tokens_per_rank is not None:
        max_tokens = max_tokens_per_rank
    else:
        max_tokens = x.shape[0] if x.dim() > 0 else 0
    if keep_pooled_x is None:
        keep_pooled_x = _keep_pooled_x_by_default(x, w13, a13, backend, precision, ep_size, clamp, block_m)
    save_h = not recompute and _backward_possible(x, topk_weights, w13, w2)
    out = _ops.mega_moe_fwd(
        x, topk_idx, topk_weights, w13, w2, a13, a2, clamp, group_name, -1 if num_experts is None else num_experts,
        ep_size, int(max_tokens), block_m, save_h, backend, precision, 0 if buffer is None else buffer.buffer_id,
        bool(keep_pooled_x), sms)
    y = out[0]
    if not return_plan:
        return y
    counts, offsets, src, srank, r2p = out[2:7]
    E = counts.shape[0] * ep_size if num_experts is None else int(num_experts)
    plan = make_plan(expert_counts=counts, expert_offsets=offsets, pool_src_route=src, pool_src_rank=srank,
                     route_to_pool=r2p, block_m=block_m, num_experts=E, top_k=topk_idx.shape[1])
    return y, plan


def _backward_possible(x, topk_weights, w13, w2) -> bool:
    """Whether autograd can call this call's backward: grad mode on and an input that takes a gradient. Else the
    forward saves nothing for it (h: [T*K, 2I] bf16, and the fused kernel's stores of it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))


def _keep_pooled_x_by_default(x, w13, dw13_accum, backend, precision, ep_size, clamp, block_m) -> bool:
    """keep_pooled_x=None: the fused forward's dispatched rows are kept when the backward will read them."""
    if not torch.is_grad_enabled() or not (w13.requires_grad or dw13_accum is not None):
        return False
    try:
        which = _backend.resolve_backend(backend, precision, "fwd", device_type=x.device.type, hidden=x.shape[1],
                                         intermediate=w13.shape[1] // 2, ep_size=ep_size, activation_clamp=clamp,
                                         num_local_experts=w13.shape[0], block_m=block_m)
    except Exception:  # bad arguments: the forward op raises the reason itself
        return False
    return which == "fused"


class MegaMoE(nn.Module):
    """The routed experts of an MoE layer, with expert parallelism over ``group``.

    Owns ``w13 [El, 2I, H]`` (gate rows then up rows) and ``w2 [El, H, I]``; ``forward(x, topk_idx,
    topk_weights)`` calls :func:`mega_moe`. With ``max_tokens_per_rank`` the staging buffer is
    allocated here, once, and shared with every layer of the same shape (never inside forward).
    ``recompute`` and ``keep_pooled_x`` trade memory for backward time as in :func:`mega_moe`; ``num_sms``
    bounds the SMs its kernels use, forward and backward (None: all).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        top_k: int,
        *,
        group=None,
        precision: str = "bf16",
        activation_clamp: Optional[float] = None,
        backend: str = "auto",
        recompute: bool = False,
        max_tokens_per_rank: Optional[int] = None,
        buffer: Optional[SymmBuffer] = None,
        block_m: int = BLOCK_M,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
        keep_pooled_x: Optional[bool] = None,
        num_sms: Optional[int] = None,
    ):
        super().__init__()
        # The layer's options, checked once here so that a bad one fails at construction (the per-call
        # checks of mega_moe see the same values again).
        _backend.check_backend(backend)
        _backend.check_precision(precision)
        _validate.check_activation_clamp(activation_clamp)
        _validate.check_block_m(block_m)
        _validate.num_sms_arg(num_sms)
        ep_size, _ = _group_info(group)
        if num_experts % ep_size:
            _validate._fail(f"num_experts={num_experts} is not divisible by the group size {ep_size}; "
                            f"use a group whose size divides it")
        if backend == "fused":
            reason = _backend.alignment_reason(hidden, intermediate)
            if reason is not None:
                _validate._fail(reason)
        self.num_experts = int(num_experts)
        self.num_local_experts = self.num_experts // ep_size
        self.hidden = int(hidden)
        self.intermediate = int(intermediate)
        self.top_k = int(top_k)
        self.group = group
        self.precision = precision
        self.activation_clamp = activation_clamp
        self.backend = backend
        self.recompute = recompute
        self.keep_pooled_x = None if keep_pooled_x is None else bool(keep_pooled_x)
        self.block_m = int(block_m)
        self.num_sms = num_sms
        self.max_tokens_per_rank = max_tokens_per_rank
        if buffer is None and max_tokens_per_rank is not None:
            buffer = get_symm_buffer_for_mega_moe(
                group, num_experts, max_tokens_per_rank, top_k, hidden, intermediate,
                mma_type=_MMA_FOR_PRECISION[precision], device=device)
        self.buffer = buffer
        El = self.num_local_experts
        self.w13 = nn.Parameter(torch.empty((El, 2 * intermediate, hidden), device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty((El, hidden, intermediate), device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            nn.init.normal_(self.w13, std=1.0 / math.sqrt(self.hidden))
            nn.init.normal_(self.w2, std=1.0 / math.sqrt(self.intermediate))

    def forward(self, x, topk_idx, topk_weights, *, wgrad_accum=None):
        return mega_moe(
            x, topk_idx, topk_weights, self.w13, self.w2, group=self.group, precision=self.precision,
            activation_clamp=self.activation_clamp, backend=self.backend, recompute=self.recompute,
            num_experts=self.num_experts, buffer=self.buffer, max_tokens_per_rank=self.max_tokens_per_rank,
            wgrad_accum=wgrad_accum, block_m=self.block_m, keep_pooled_x=self.keep_pooled_x, num_sms=self.num_sms)

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, local={self.num_local_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, top_k={self.top_k}, precision={self.precision!r}, "
                f"backend={self.backend!r}, recompute={self.recompute}, activation_clamp={self.activation_clamp}, "
                f"num_sms={self.num_sms}")


# ----------------------------------------------------------------------------------------------
# DeepGEMM-shaped low-level calls
# ----------------------------------------------------------------------------------------------


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


def _no_shared(shared):
    if any(s is not None for s in shared):
        raise NotImplementedError("deep_gemm.mega: fused shared experts are not supported; run the shared "
                                  "expert outside (e.g. a plain torch MLP) and pass shared_*=None")


def _staged(buffer, T):
    if not isinstance(buffer, SymmBuffer):
        _validate._fail(f"buffer must come from get_symm_buffer_for_mega_moe, got {type(buffer).__name__}", TypeError)
    if T > buffer.num_max_tokens_per_rank:
        _validate._fail(f"{T} tokens exceed the buffer's num_max_tokens_per_rank={buffer.num_max_tokens_per_rank}; "
                        f"allocate the buffer with a larger max")
    if buffer.mma_type != "bf16xbf16":
        _validate._fail(f"bf16 calls need a buffer with mma_type='bf16xbf16', got {buffer.mma_type!r}")
    return buffer.x[:T], buffer.topk_idx[:T], buffer.topk_weights[:T]


def _check_out(t, name, shape, dtypes, device):
    if not isinstance(t, torch.Tensor):
        _validate._fail(f"{name} must be a tensor", TypeError)
    if t.dtype not in dtypes:
        _validate._fail(f"{name} must be one of {list(dtypes)}, got {t.dtype}", TypeError)
    if list(t.shape) != list(shape):
        _validate._fail(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        _validate._fail(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        _validate._fail(f"{name} must be contiguous; allocate it with torch.empty")


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
    """
    _no_shared((shared_l1_weights, shared_l2_weights))
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
    which = _backend.resolve_backend(backend, "bf16", "fwd", device_type=x.device.type, hidden=H, intermediate=I,
                                     ep_size=buffer.num_ranks, activation_clamp=activation_clamp,
                                     num_local_experts=El, block_m=block_m)
    ids = _validate.ExpertIdCheck(topk_idx, E, which, from_plan=buffer.num_ranks == 1)  # finished before y is touched
    cap = _ops._capacity(T, K, El, buffer.num_ranks, buffer.num_max_tokens_per_rank, block_m)
    kwargs = dict(activation_clamp=activation_clamp, group=buffer.group if buffer.num_ranks > 1 else None,
                  num_experts=E, max_tokens_per_rank=buffer.num_max_tokens_per_rank, block_m=block_m,
                  capacity=cap, save_h=save_h)
    with torch.no_grad():
        if T == 0 and buffer.num_ranks == 1:
            out = _ops.empty_forward(x, topk_idx, l1, cap, save_h, False)
        elif which == "fused":
            out = _fused.forward(x, topk_idx, topk_weights, l1, l2, precision="bf16", buffer=buffer, id_check=ids,
                                 num_sms=sms, **kwargs)
        elif which == "grouped":
            out = _grouped.forward(x, topk_idx, topk_weights, l1, l2, buffer=buffer, id_check=ids, num_sms=sms,
                                   **kwargs)
        else:
            out = reference.forward(x, topk_idx, topk_weights, l1, l2, **kwargs)
        yy, h, counts, offsets, src, srank, r2p = out[:7]
        ids.finish()
        if accumulate:
            y.add_(yy)
        else:
            y.copy_(yy)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(counts)
    plan = make_plan(expert_counts=counts, expert_offsets=offsets, pool_src_route=src, pool_src_rank=srank,
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
    zero (or, with ``accumulate=True``, as they were). Rounding points: see :mod:`deep_gemm.mega.reference`.
    """
    _no_shared((shared_l1_weights, shared_l2_weights, shared_dw1_weights, shared_dw2_weights))
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
    cap = _ops._capacity(T, K, El, buffer.num_ranks, buffer.num_max_tokens_per_rank, block_m)
    if state is not None:
        _check_state(state, buffer, T, K, El, I, block_m, cap)
    which = _backend.resolve_backend(backend, "bf16", "bwd", device_type=dev.type, hidden=H, intermediate=I,
                                     ep_size=buffer.num_ranks, activation_clamp=activation_clamp,
                                     num_local_experts=El, block_m=block_m)
    if T == 0 and buffer.num_ranks == 1:  # no route: zero weight gradients, dx and dtopk are empty
        for out in (dw1, dw2):
            if out is not None and not accumulate:
                out.zero_()
        return None
    ids = _validate.ExpertIdCheck(topk_idx, E, which)  # finished before the caller's outputs are touched
    group = buffer.group if buffer.num_ranks > 1 else None
    with torch.no_grad():
        if state is None:
            counts, offsets, src, srank, r2p = reference.build_plan(
                topk_idx, E, block_m, cap, group, buffer.num_max_tokens_per_rank)
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
        args = (dy, x, topk_idx, topk_weights, l1, l2, h, counts, offsets, src, srank, r2p)
        kwargs = dict(activation_clamp=activation_clamp, group=group, num_experts=E, recompute=recompute,
                      need_wgrad=need_wgrad, dw13_accum=tmp13, dw2_accum=tmp2)
        if which == "fused":
            gx, gt, g13, g2 = _fused.backward(*args, precision="bf16", buffer=buffer, num_sms=sms, **kwargs)
        elif which == "grouped":
            gx, gt, g13, g2 = _grouped.backward(*args, buffer=buffer, num_sms=sms, **kwargs)
        else:
            gx, gt, g13, g2 = reference.backward(*args, **kwargs)
        g13 = tmp13 if tmp13 is not None else g13
        g2 = tmp2 if tmp2 is not None else g2
        if dw1 is not None and not dw_natural_layout:
            g13 = interleave_l1(g13)
        ids.finish()
        for out, g in ((dx, gx), (dtopk, gt), (dw1, g13), (dw2, g2)):
            if out is None:
                continue
            if accumulate:
                out.add_(g.to(out.dtype))
            else:
                out.copy_(g)
    return None


# ----------------------------------------------------------------------------------------------
# FP8 / MXFP8 names: present, and they say why they cannot run yet.
# ----------------------------------------------------------------------------------------------


def _unavailable(precision, direction, what):
    reason = _backend._fused_reason(precision, direction)
    if reason is None:  # status() says the kernel exists: hand over to the binding
        return _fused.forward if direction == "fwd" else _fused.backward
    raise _backend.FusedKernelUnavailable(
        f"deep_gemm.mega.{what}: precision={precision!r} {direction} is not available: {reason} "
        f"(see deep_gemm.status()); use bf16_mega_moe / mega_moe(precision='bf16')")


def fp8_mega_moe(*args, **kwargs):
    """SM90 blockwise-FP8 forward (``precision="fp8"``). Raises the ``deep_gemm.status()`` reason
    until the kernel exists."""
    return _unavailable("fp8", "fwd", "fp8_mega_moe")(*args, precision="fp8", **kwargs)


def fp8_mega_moe_backward(*args, **kwargs):
    """SM90 blockwise-FP8 backward (``precision="fp8"``); raises the status() reason for now."""
    return _unavailable("fp8", "bwd", "fp8_mega_moe_backward")(*args, precision="fp8", **kwargs)


def fp8_mega_moe_weight_grads(*args, **kwargs):
    """SM90 FP8 weight gradients into fp32 accumulators; raises the status() reason for now."""
    return _unavailable("fp8", "bwd", "fp8_mega_moe_weight_grads")(*args, precision="fp8", **kwargs)


def fp8_bwd_mega_moe_backward(*args, **kwargs):
    """BF16-forward / FP8-backward (``precision="fp8_bwd"``) backward; raises the status() reason for now."""
    return _unavailable("fp8_bwd", "bwd", "fp8_bwd_mega_moe_backward")(*args, precision="fp8_bwd", **kwargs)


def mxfp8_mega_moe(*args, **kwargs):
    """SM100 MXFP8 forward (``precision="mxfp8"``); raises the status() reason for now."""
    return _unavailable("mxfp8", "fwd", "mxfp8_mega_moe")(*args, precision="mxfp8", **kwargs)


def mxfp8_mega_moe_backward(*args, **kwargs):
    """SM100 MXFP8 backward (``precision="mxfp8"``); raises the status() reason for now."""
    return _unavailable("mxfp8", "bwd", "mxfp8_mega_moe_backward")(*args, precision="mxfp8", **kwargs)


def fp8_fp4_mega_moe(*args, **kwargs):
    """Upstream's SM100 FP8xFP4 forward name, mapped to the mxfp8 kernel entry; raises for now."""
    return _unavailable("mxfp8", "fwd", "fp8_fp4_mega_moe")(*args, precision="mxfp8", **kwargs)

