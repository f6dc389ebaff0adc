"""The layer API of ``prime_kernels.mega``: :func:`mega_moe` (autograd) and :class:`MegaMoE` (an ``nn.Module``).

Both go through the custom ops of :mod:`prime_kernels.mega._ops`, which check the inputs and then resolve and run the
backend through :mod:`prime_kernels.mega._backend`. The DeepGEMM-shaped calls are in
:mod:`prime_kernels.mega.deepgemm_compat`."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import _backend, _comm, _ep_heuristics, _ops, _shared_ops, _validate, shared
from ..routing import RoutingPlan
from .buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from .deferred import DeferredWgrad
from .constants import BLOCK_M

_MMA_FOR_PRECISION = {"bf16": "bf16xbf16", "fp8": "fp8xfp8", "fp8_bwd": "bf16xbf16", "mxfp8": "fp8xfp8"}


def _group_info(group):
    if group is None:
        return 1, ""
    R = _comm.world_size(group)
    return R, (group.group_name if R > 1 else "")


def _wgrad_accum_pair(wgrad_accum):
    """(dw13 buffer, dw2 buffer, deferral id): the two accumulation buffers (each may be None; the forward op checks
    them against the weights), and the id of the DeferredWgrad they belong to (0: added by the backward itself)."""
    if wgrad_accum is None:
        return None, None, 0
    if isinstance(wgrad_accum, DeferredWgrad):
        return wgrad_accum.dw13, wgrad_accum.dw2, wgrad_accum.deferral_id
    if not isinstance(wgrad_accum, (tuple, list)) or len(wgrad_accum) != 2:
        _validate._fail("wgrad_accum must be a pair (dw13_fp32, dw2_fp32) of tensors shaped like w13 and w2")
    a13, a2 = wgrad_accum
    for name, a in (("wgrad_accum[0]", a13), ("wgrad_accum[1]", a2)):
        if a is not None and not isinstance(a, torch.Tensor):
            _validate._fail(f"{name} must be a torch.Tensor or None, got {type(a).__name__}", TypeError)
    return a13, a2, 0


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
    ep_chunks: Optional[int] = None,
    shared_w13: Optional[torch.Tensor] = None,
    shared_w2: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
):
    """Routed-experts MoE layer: ``y[t] = sum_k w[t,k] * W2[e] (silu(Wg[e] x_t) * (Wu[e] x_t))``, plus shared experts
    when given.

    Args:
      x: [T, H] bf16 tokens of this rank (float64 is accepted with ``backend="reference"`` as an
        exact, unrounded mode for tests).
      topk_idx: [T, K] int64 (int32 accepted) global expert ids, -1 masks a route.
      topk_weights: [T, K] fp32, applied in fp32 at the combine.
      w13: [El, 2I, H] local experts' gate rows [0, I) then up rows [I, 2I) (natural layout).
      w2: [El, H, I].
      group: a ``torch.distributed`` process group for expert parallelism (experts sharded by
        rank, El = E / R contiguous per rank, tokens exchanged all-to-all), or None.
      precision: "bf16"; "fp8" (blockwise FP8 forward and backward) and "fp8_bwd" (the bf16 forward, the FP8
        backward) run on ``backend="reference"`` only for now, as an emulation of the recipe (docs/fp8.md), with
        the default recipe and weight cache (``reference.mega_moe_reference`` takes the options); the kernel
        backends raise the ``prime_kernels.status()`` reason. "mxfp8": the forward's GEMMs on torch's MXFP8
        grouped GEMM, the backward in bf16, on backend "grouped" (or "auto") of one rank on an sm_100 GPU
        (status key ``mega_moe_grouped.mxfp8.sm100``, :mod:`prime_kernels.mega._mxfp8`); elsewhere it raises that
        key's reason.
      activation_clamp: None (no clamp) or a finite c > 0: gate <= c and -c <= up <= c before SiLU
        (DeepSeek-V4).
      backend: "auto" | "fused" | "grouped" | "reference" (see :mod:`prime_kernels.mega._backend`).
      recompute: recompute the gate/up pre-activation h in the backward instead of saving it. Without
        a possible backward (grad mode off, or no input that takes a gradient) h is never saved, so
        inference does not pay for it.
      num_experts: E over the group (default El * group size); checked against the group.
      buffer: a :class:`SymmBuffer`; bounds the tokens per rank (the fused kernels stage into it).
      max_tokens_per_rank: with EP and no buffer, the largest T of any rank (default: this T,
        which then must be equal on every rank).
      wgrad_accum: optional pair (dw13_fp32, dw2_fp32) shaped like w13 / w2: the backward *adds*
        the weight gradients into them (fp32), and autograd returns None for w13 and w2 (so
        ``w13.grad`` / ``w2.grad`` are left untouched). Either entry may be None. Or a
        :class:`~prime_kernels.mega.DeferredWgrad`: the backward returns dX and d topk_weights and queues the weight
        gradients, which its ``flush()`` adds into its accumulators later, bitwise as the pair would have had them
        (:mod:`prime_kernels.mega.deferred`).
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
      ep_chunks: with a group, the tokens' exchange and expert GEMMs run in this many chunks, each chunk's exchange
        under another's GEMMs (bf16, grouped backend; the same bits for any count). None (default): the count
        :func:`prime_kernels.mega._ep_heuristics.default_ep_chunks` picks (1 on every shape measured so far:
        docs/expert_parallel.md), the same on every rank.
      shared_w13, shared_w2: shared experts ([S, 2Is, H] and [S, H, Is], or 2-D for one), through which every token
        goes and whose output is added to y (:mod:`prime_kernels.mega.shared`: semantics and rounding S1-S3). They
        run on the same backend and options as the routed experts, replicated under a group; their gradients go to
        their ``.grad`` (``wgrad_accum`` holds the routed weights' only).
      shared_gate: None (weight 1), or float32 [T] or [T, S]: each token's weight on the shared experts (it gets a
        gradient).

    Returns y [T, H] (x's dtype), or (y, plan) with ``return_plan=True``. T = 0 is allowed: y is [0, H]
    and the weight gradients are zero.
    Gradients flow to x, topk_weights, w13 and w2 (not to topk_idx).
    The rounding points are listed in the docstring of :mod:`prime_kernels.mega.reference`.
    """
    # The forward op checks the tensors (and everything else) before any compute: this is the one place on
    # this path. Only what cannot reach the op as typed (a bool read as a number, a non-tensor) is checked here.
    _validate.check_tensor_types(x=x, topk_idx=topk_idx, topk_weights=topk_weights, w13=w13, w2=w2)
    ep_size, group_name = _group_info(group)
    if buffer is not None and not isinstance(buffer, SymmBuffer):
        _validate._fail(f"buffer must come from get_symm_buffer_for_mega_moe, got {type(buffer).__name__}", TypeError)
    a13, a2, deferral_id = _wgrad_accum_pair(wgrad_accum)
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
    if ep_chunks is None:
        ep_chunks = _ep_heuristics.default_ep_chunks(ep_size=ep_size, backend=backend, precision=precision)
    else:  # here too: the op's int argument would take True as 1
        ep_chunks = _validate.check_ep_chunks(ep_chunks, ep_size=ep_size, backend=backend, precision=precision)
    shared_call = shared.prepare(x, shared_w13, shared_w2, shared_gate, backend=backend, precision=precision,
                                 activation_clamp=clamp, block_m=block_m)
    if shared_call is not None and _shared_ops.reason(
            x, w13, shared_call.w13, backend=backend, precision=precision, ep_size=ep_size,
            accumulators=a13 is not None or a2 is not None or deferral_id != 0 or buffer is not None,
            return_plan=return_plan, activation_clamp=clamp) is None:
        # the shared experts' tiles inside the routed experts' launches (SF1-SF3 of mega._shared_grouped)
        return _shared_ops.layer(x, topk_idx, topk_weights, w13, w2, shared_call.w13, shared_call.w2, shared_gate,
                                 activation_clamp=clamp, block_m=block_m, recompute=recompute, num_sms=sms,
                                 precision=precision, backend=backend)
    out = _ops.mega_moe_fwd(
        x, topk_idx, topk_weights, w13, w2, a13, a2, clamp, group_name, -1 if num_experts is None else num_experts,
        ep_size, int(max_tokens), block_m, save_h, backend, precision, 0 if buffer is None else buffer.buffer_id,
        bool(keep_pooled_x), sms, deferral_id, ep_chunks)
    y = out[0]
    if shared_call is not None:
        y = shared.add_shared(y, shared.run(mega_moe, x, shared_call, precision=precision, activation_clamp=clamp,
                                            backend=backend, recompute=recompute, block_m=block_m, num_sms=num_sms))
    if not return_plan:
        return y
    counts, offsets, src, srank, r2p = out[2:7]
    E = counts.shape[0] * ep_size if num_experts is None else int(num_experts)
    plan = RoutingPlan(expert_counts=counts, expert_offsets=offsets, pool_src_route=src, pool_src_rank=srank,
                       route_to_pool=r2p, block_m=block_m, num_experts=E, top_k=topk_idx.shape[1])
    return y, plan


def _backward_possible(x, topk_weights, w13, w2) -> bool:
    """Whether autograd can call this call's backward: grad mode on and an input that takes a gradient. Else the
    forward saves nothing for it (h: [T*K, 2I] bf16, and the fused kernel's stores of it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))


def _keep_pooled_x_by_default(x, w13, dw13_accum, backend, precision, ep_size, clamp, block_m) -> bool:
    """keep_pooled_x=None: the fused forward's dispatched rows are kept when the backward will read them: the bf16
    fused forward's (bf16 and fp8_bwd), not the FP8 one's, whose pool is e4m3 (its backward quantizes the token rows
    itself; a bf16 pool would be a gather of its own, about 1 ms at Qwen3-30B-A3B, T = 16384)."""
    if not torch.is_grad_enabled() or not (w13.requires_grad or dw13_accum is not None):
        return False
    try:
        which = _backend.resolve("fwd", backend, precision, x, w13, ep_size=ep_size, activation_clamp=clamp,
                                 block_m=block_m)
    except Exception:  # bad arguments: the forward op raises the reason itself
        return False
    return which == "fused" and precision != "fp8"


class MegaMoE(nn.Module):
    """The routed experts of an MoE layer, with expert parallelism over ``group``.

    Owns ``w13 [El, 2I, H]`` (gate rows then up rows) and ``w2 [El, H, I]``; ``forward(x, topk_idx,
    topk_weights)`` calls :func:`mega_moe`. With ``max_tokens_per_rank`` the staging buffer is
    allocated here, once, and shared with every layer of the same shape (never inside forward).
    ``recompute`` and ``keep_pooled_x`` trade memory for backward time as in :func:`mega_moe`; ``num_sms``
    bounds the SMs its kernels use, forward and backward (None: all); ``ep_chunks`` is :func:`mega_moe`'s.
    ``num_shared_experts=S`` adds S shared experts of ``shared_intermediate`` (default: ``intermediate``) each,
    ``shared_w13 [S, 2Is, H]`` and ``shared_w2 [S, H, Is]``, replicated on every rank; ``forward(..., shared_gate=)``
    weights them per token (:mod:`prime_kernels.mega.shared`).
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
        ep_chunks: Optional[int] = None,
        num_shared_experts: int = 0,
        shared_intermediate: Optional[int] = None,
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
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            _validate._fail(f"num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
        shared_i = intermediate if shared_intermediate is None else shared_intermediate
        if isinstance(shared_i, bool) or not isinstance(shared_i, int) or shared_i < 1:
            _validate._fail(f"shared_intermediate must be a positive int, got {shared_intermediate!r}")
        if backend == "fused":
            for inter in (intermediate, shared_i) if num_shared_experts else (intermediate,):
                reason = _backend.alignment_reason(hidden, inter, precision)
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
        if ep_chunks is not None:
            _validate.check_ep_chunks(ep_chunks, ep_size=ep_size, backend=backend, precision=precision)
        self.ep_chunks = ep_chunks
        self.max_tokens_per_rank = max_tokens_per_rank
        if buffer is None and max_tokens_per_rank is not None:
            buffer = get_symm_buffer_for_mega_moe(
                group, num_experts, max_tokens_per_rank, top_k, hidden, intermediate,
                mma_type=_MMA_FOR_PRECISION[precision], device=device)
        self.buffer = buffer
        El = self.num_local_experts
        self.w13 = nn.Parameter(torch.empty((El, 2 * intermediate, hidden), device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty((El, hidden, intermediate), device=device, dtype=dtype))
        self.num_shared_experts = num_shared_experts
        self.shared_intermediate = shared_i if num_shared_experts else None
        if num_shared_experts:
            S = num_shared_experts
            self.shared_w13 = nn.Parameter(torch.empty((S, 2 * shared_i, hidden), device=device, dtype=dtype))
            self.shared_w2 = nn.Parameter(torch.empty((S, hidden, shared_i), device=device, dtype=dtype))
        else:
            self.shared_w13 = self.shared_w2 = None
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            nn.init.normal_(self.w13, std=1.0 / math.sqrt(self.hidden))
            nn.init.normal_(self.w2, std=1.0 / math.sqrt(self.intermediate))
            if self.num_shared_experts:
                nn.init.normal_(self.shared_w13, std=1.0 / math.sqrt(self.hidden))
                nn.init.normal_(self.shared_w2, std=1.0 / math.sqrt(self.shared_intermediate))

    def forward(self, x, topk_idx, topk_weights, *, wgrad_accum=None, shared_gate=None):
        if shared_gate is not None and not self.num_shared_experts:
            _validate._fail("shared_gate needs shared experts (num_shared_experts > 0)")
        return mega_moe(
            x, topk_idx, topk_weights, self.w13, self.w2, group=self.group, precision=self.precision,
            activation_clamp=self.activation_clamp, backend=self.backend, recompute=self.recompute,
            num_experts=self.num_experts, buffer=self.buffer, max_tokens_per_rank=self.max_tokens_per_rank,
            wgrad_accum=wgrad_accum, block_m=self.block_m, keep_pooled_x=self.keep_pooled_x, num_sms=self.num_sms,
            ep_chunks=self.ep_chunks, shared_w13=self.shared_w13, shared_w2=self.shared_w2, shared_gate=shared_gate)

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, local={self.num_local_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, top_k={self.top_k}, precision={self.precision!r}, "
                f"backend={self.backend!r}, recompute={self.recompute}, activation_clamp={self.activation_clamp}, "
                f"num_sms={self.num_sms}, ep_chunks={self.ep_chunks}, num_shared_experts={self.num_shared_experts}, "
                f"shared_intermediate={self.shared_intermediate}")
