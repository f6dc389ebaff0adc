"""The fused backward's dgrad kernel (sm90, BF16).

:func:`dgrad` runs the two dgrad steps of the grouped backward (:func:`prime_kernels.mega._grouped.backward`) in
one persistent kernel (``torch.ops.prime_kernels.mega_moe_bwd_dgrad``, csrc/sm90/mega_moe_bwd.cuh): the L2 dgrad
with the SwiGLU backward in its epilogue (the pipeline's ``m_grouped_bf16_gemm_swiglu_bwd``) and the L1 dgrad
(the pipeline's ``m_grouped_bf16_gemm_nn(dh, w13, offsets)``), whose tiles wait for their m-block's L2-dgrad tiles
instead of for the end of a kernel. It takes what the pipeline hands those two steps and returns what they return.

Nothing in the library calls it yet: bitwise equal to the two pipeline steps on the H200, it takes 1.07-1.14x their
time at the Qwen3 30B and 235B shapes (bench/bench_bwd_dgrad.py; docs/performance.md). So
``backend="auto"`` (and "fused") keep running the grouped backward, and ``status()["mega_moe_backward.bf16.sm90"]``
(the whole fused backward) says it is not written yet. The weight gradients, the dy dispatch before it and the dX combine after it stay the pipeline's kernels.
"""

from __future__ import annotations

import numbers

import torch

from .. import _status
from ._validate import FusedKernelUnavailable, check_activation_clamp

STATUS_KEY = "mega_moe_bwd_dgrad.bf16.sm90"

# What the kernel's tiles and tables take (csrc/sm90/mega_moe_bwd.cu, prepare_swiglu_bwd): I in 64-column pieces
# of the SwiGLU epilogue, H in 64-column TMA boxes of the L1-dgrad output, at most 1024 experts (their offsets live
# in shared memory), 32-bit row and route indices.
INTER_MULTIPLE = 64
HIDDEN_MULTIPLE = 64
MAX_EXPERTS = 1024
MAX_INDEX = 2 ** 31 - 1

_PREFIX = "prime_kernels.mega._fused_bwd.dgrad: "


def _fail(msg: str, exc=ValueError):
    raise exc(_PREFIX + msg)


def _check_tensor(t, name: str, dtype: torch.dtype, dim: int | None, aligned16: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}", TypeError)
    if dim is not None and t.dim() != dim:
        _fail(f"{name} must be {dim}-D, got {t.dim()}-D {list(t.shape)}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous; call .contiguous()")
    if aligned16 and t.numel() and t.data_ptr() % 16 != 0:
        _fail(f"{name} must start 16-byte aligned (the kernel reads it by TMA or 16-byte loads); pass a copy "
              "(.clone())")


def check_dgrad_inputs(dy_pool, w13, w2, h, expert_offsets, pool_src_route, topk_weights, activation_clamp=None,
                       num_sms=None) -> tuple[int, int, int, int]:
    """Every host-side check of :func:`dgrad`, in the order it runs them; nothing here reads device memory.
    Returns (M, H, I, E). Raises TypeError for a wrong type or dtype, ValueError for a wrong shape, size, layout,
    device or option."""
    _check_tensor(dy_pool, "dy_pool", torch.bfloat16, 2, aligned16=True)
    _check_tensor(w13, "w13", torch.bfloat16, 3, aligned16=True)
    _check_tensor(w2, "w2", torch.bfloat16, 3, aligned16=True)
    _check_tensor(h, "h", torch.bfloat16, 2, aligned16=True)
    _check_tensor(expert_offsets, "expert_offsets", torch.int32, 1)
    _check_tensor(pool_src_route, "pool_src_route", torch.int32, 1)
    _check_tensor(topk_weights, "topk_weights", torch.float32, None)
    M, H = dy_pool.shape
    E, two_i, H13 = w13.shape
    I = two_i // 2
    if two_i % 2 or H13 != H:
        _fail(f"w13 must be [E, 2I, H] with H = dy_pool's {H} columns, got {list(w13.shape)}")
    if list(w2.shape) != [E, H, I]:
        _fail(f"w2 must be [E, H, I] = {[E, H, I]} (from w13 {list(w13.shape)}), got {list(w2.shape)}")
    if not 1 <= E <= MAX_EXPERTS:
        _fail(f"E = {E} experts, must be in [1, {MAX_EXPERTS}]")
    if I < INTER_MULTIPLE or I % INTER_MULTIPLE:
        _fail(f"I = {I} must be a positive multiple of {INTER_MULTIPLE}")
    if H < HIDDEN_MULTIPLE or H % HIDDEN_MULTIPLE:
        _fail(f"H = {H} must be a positive multiple of {HIDDEN_MULTIPLE}")
    if list(expert_offsets.shape) != [E + 1]:
        _fail(f"expert_offsets must be [E + 1] = [{E + 1}], got {list(expert_offsets.shape)}")
    if h.shape[0] < M or h.shape[1] != two_i:
        _fail(f"h must be [>= {M} pool rows, 2I = {two_i}], got {list(h.shape)}")
    if pool_src_route.shape[0] < M:
        _fail(f"pool_src_route must have >= {M} entries (one per pool row), got {pool_src_route.shape[0]}")
    if M > MAX_INDEX or topk_weights.numel() > MAX_INDEX:
        _fail(f"{M} pool rows and {topk_weights.numel()} routes must each be below 2^31")
    devices = {t.device for t in (dy_pool, w13, w2, h, expert_offsets, pool_src_route, topk_weights)}
    if len(devices) != 1:
        _fail(f"every tensor must be on one device, got {sorted(str(d) for d in devices)}")
    check_activation_clamp(activation_clamp)  # the layer's rule: None or a finite number > 0
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, numbers.Integral) or num_sms < 1):
        _fail(f"num_sms must be None (every SM) or an int >= 1, got {num_sms!r}")
    return M, H, I, E


def _outputs_like(dy_pool, M: int, H: int, I: int):
    """Uninitialised tensors of the op's output shapes: (dh, w * s, dt_part, dx_pool)."""
    return (dy_pool.new_empty(M, 2 * I), dy_pool.new_empty(M, I),
            dy_pool.new_empty(M, (I + 127) // 128, dtype=torch.float32), dy_pool.new_empty(M, H))


def dgrad(dy_pool, w13, w2, h, expert_offsets, pool_src_route, topk_weights, *, activation_clamp=None,
          num_sms=None):
    """The grouped backward's L2 dgrad + SwiGLU backward and L1 dgrad in one kernel.

    Inputs as the pipeline has them: dy_pool [M, H] bf16 (the dy rows in pool order, padding rows zero), w13
    [E, 2I, H] and w2 [E, H, I] bf16 (natural layouts), h [>= M, 2I] bf16 (the saved gate | up), expert_offsets
    [E + 1] int32 (the plan's), pool_src_route [>= M] int32 (route per pool row, -1: padding), topk_weights fp32
    [T, K] (indexed by route id), all contiguous on one CUDA device. H and I multiples of 64.

    Returns (dh [M, 2I], w * s [M, I], dt_part [M, ceil(I / 128)] fp32, dx_pool [M, H]): the first three as
    ``m_grouped_bf16_gemm_swiglu_bwd`` returns them (dt_part's rows after the last expert are zeros), dx_pool as
    ``m_grouped_bf16_gemm_nn(dh, w13, offsets)`` (rows after the last expert unspecified). M = 0 returns empty
    tensors and launches nothing. Raises :class:`~prime_kernels.mega.FusedKernelUnavailable` where the kernel
    cannot run (``prime_kernels._status.runnable`` says why)."""
    M, H, I, _E = check_dgrad_inputs(dy_pool, w13, w2, h, expert_offsets, pool_src_route, topk_weights,
                                     activation_clamp, num_sms)
    if M == 0:
        return _outputs_like(dy_pool, 0, H, I)
    if dy_pool.device.type != "cuda":
        _fail(f"the tensors must be CUDA tensors, got {dy_pool.device}")
    why = _status.runnable(STATUS_KEY)
    if why != _status.AVAILABLE:
        raise FusedKernelUnavailable(f"{_PREFIX}{STATUS_KEY} cannot run here: {why}")
    clamp = 0.0 if activation_clamp is None else float(activation_clamp)  # the kernel's 0: no clamp
    return torch.ops.prime_kernels.mega_moe_bwd_dgrad(dy_pool, w2, w13, expert_offsets, h, pool_src_route,
                                                      topk_weights.reshape(-1), clamp,
                                                      0 if num_sms is None else int(num_sms))


def _register() -> None:
    """The op's fake kernel (meta tensors, torch.compile tracing): the output shapes."""

    def fake(dy_pool, w2, w13, group_offsets, h, pool_src_route, topk_weights, clamp=0.0, num_sms=0):
        return _outputs_like(dy_pool, dy_pool.shape[0], dy_pool.shape[1], w2.shape[2])

    torch.library.register_fake("prime_kernels::mega_moe_bwd_dgrad", fake)
