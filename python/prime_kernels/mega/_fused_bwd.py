"""The fused backward (sm90, BF16): one persistent kernel for the L2 dgrad with the SwiGLU backward, the L1 dgrad and
the weight gradients (``torch.ops.prime_kernels.mega_moe_bwd_fused``, csrc/sm90/mega_moe_bwd.cuh).

* :func:`dgrad` runs the kernel without its weight-gradient tiles: the pipeline's ``m_grouped_bf16_gemm_swiglu_bwd``
  and ``m_grouped_bf16_gemm_nn(dh, w13, offsets)`` in one launch, whose L1-dgrad tiles wait for their m-block's
  L2-dgrad tiles instead of for the end of a kernel. It takes what the pipeline hands those two steps and returns
  what they return.
* :func:`dgrad_wgrad` adds the weight-gradient tiles (the pipeline's two k-grouped GEMMs), each scheduled once its
  expert's L2-dgrad tiles are stored: dW2_e = dy_pool_e^T (w * s)_e and dW13_e = dh_e^T x_pool_e, in bf16 or fp32, or
  added to fp32 accumulators.
* :func:`backward` is the layer's backward on it (backend "fused"): the dy dispatch, the kernel, the d topk_weights
  sum and the dX combine, with the grouped backward's contract.

``prime_kernels.status()["mega_moe_backward.bf16.sm90"]`` says whether it runs: until the kernel with its
weight-gradient tiles is verified on a GPU it names that reason, and ``backend="auto"`` runs the grouped backward.
"""

from __future__ import annotations

import numbers

import torch

from .. import _status
from ._grouped import PaddingRows, _gathered_pool, _rows_for_kernels, deferred_wgrad, recompute_h
from ._validate import FusedKernelUnavailable, check_activation_clamp
from ..combine import combine

STATUS_KEY = "mega_moe_backward.bf16.sm90"

# What the kernel's tiles and tables take (csrc/sm90/mega_moe_bwd.cu, prepare_swiglu_bwd): I in 64-column pieces
# of the SwiGLU epilogue, H in 64-column TMA boxes of the L1-dgrad output, at most 1024 experts (their offsets live
# in shared memory), 32-bit row and route indices.
INTER_MULTIPLE = 64
HIDDEN_MULTIPLE = 64
MAX_EXPERTS = 1024
MAX_INDEX = 2 ** 31 - 1

_PREFIX = "prime_kernels.mega._fused_bwd: "


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


def _runnable_or_raise(dy_pool) -> None:
    if dy_pool.device.type != "cuda":
        _fail(f"the tensors must be CUDA tensors, got {dy_pool.device}")
    why = _status.runnable(STATUS_KEY)
    if why != _status.AVAILABLE:
        raise FusedKernelUnavailable(f"{_PREFIX}{STATUS_KEY} cannot run here: {why}")


def _clamp_arg(activation_clamp) -> float:
    return 0.0 if activation_clamp is None else float(activation_clamp)  # the kernel's 0: no clamp


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
    _runnable_or_raise(dy_pool)
    out = torch.ops.prime_kernels.mega_moe_bwd_fused(dy_pool, w2, w13, expert_offsets, h, pool_src_route,
                                                     topk_weights.reshape(-1), _clamp_arg(activation_clamp),
                                                     num_sms=0 if num_sms is None else int(num_sms))
    return out[:4]


def check_wgrad_inputs(x_pool, M: int, H: int, I: int, E: int, like, wgrad_dtype, dw13_accum, dw2_accum) -> None:
    """The host-side checks :func:`dgrad_wgrad` adds to :func:`check_dgrad_inputs`."""
    _check_tensor(x_pool, "x_pool", torch.bfloat16, 2, aligned16=True)
    if x_pool.shape[0] < M or x_pool.shape[1] != H:
        _fail(f"x_pool must be [>= {M} pool rows, H = {H}], got {list(x_pool.shape)}")
    if x_pool.device != like.device:
        _fail(f"x_pool must be on {like.device}, got {x_pool.device}")
    if (dw13_accum is None) != (dw2_accum is None):
        _fail("give both accumulators (dw13_accum, dw2_accum) or neither")
    if dw13_accum is None:
        if wgrad_dtype not in (torch.bfloat16, torch.float32):
            _fail(f"wgrad_dtype must be torch.bfloat16 or torch.float32, got {wgrad_dtype}", TypeError)
        return
    for name, t, shape in (("dw13_accum", dw13_accum, [E, 2 * I, H]), ("dw2_accum", dw2_accum, [E, H, I])):
        _check_tensor(t, name, torch.float32, 3, aligned16=True)
        if list(t.shape) != shape:
            _fail(f"{name} must be {shape}, got {list(t.shape)}")
        if t.device != like.device:
            _fail(f"{name} must be on {like.device}, got {t.device}")


def dgrad_wgrad(dy_pool, x_pool, w13, w2, h, expert_offsets, pool_src_route, topk_weights, *,
                wgrad_dtype=torch.bfloat16, dw13_accum=None, dw2_accum=None, activation_clamp=None, num_sms=None,
                lag=None):
    """:func:`dgrad` and the weight gradients in one kernel.

    x_pool [>= M, H] bf16: the token rows in pool order (every row of every expert finite; the padding rows zero).
    Returns (dh, w * s, dt_part, dx_pool, dw13, dw2): the first four as :func:`dgrad`, then dW13_e = dh_e^T x_pool_e
    [E, 2I, H] and dW2_e = dy_pool_e^T (w * s)_e [E, H, I] over each expert's rows (zeros for an expert without rows):
    in ``wgrad_dtype`` (bf16: one rounding of the fp32 sum; or fp32), or, given both fp32 accumulators, added to them
    (then dw13 and dw2 come back empty). The same bits as the pipeline's ``k_grouped_bf16_gemm_tn`` calls.
    ``lag`` (for the benchmark's sweep; None: the heuristic's): how many experts' L2-dgrad tiles the task sequence
    runs ahead of the tiles that wait for them, 0 to 64; every lag gives the same bits."""
    M, H, I, E = check_dgrad_inputs(dy_pool, w13, w2, h, expert_offsets, pool_src_route, topk_weights,
                                    activation_clamp, num_sms)
    check_wgrad_inputs(x_pool, M, H, I, E, dy_pool, wgrad_dtype, dw13_accum, dw2_accum)
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= 64):
        _fail(f"lag must be None (the heuristic's) or an int in [0, 64], got {lag!r}")
    if M == 0:
        dh, aw, dt, dx = _outputs_like(dy_pool, 0, H, I)
        if dw13_accum is not None:
            return dh, aw, dt, dx, dy_pool.new_empty(0), dy_pool.new_empty(0)
        return (dh, aw, dt, dx, dy_pool.new_zeros(E, 2 * I, H, dtype=wgrad_dtype),
                dy_pool.new_zeros(E, H, I, dtype=wgrad_dtype))
    _runnable_or_raise(dy_pool)
    return torch.ops.prime_kernels.mega_moe_bwd_fused(
        dy_pool, w2, w13, expert_offsets, h, pool_src_route, topk_weights.reshape(-1), _clamp_arg(activation_clamp),
        x_pool, wgrad_dtype == torch.float32, dw13_accum, dw2_accum, 0 if num_sms is None else int(num_sms),
        -1 if lag is None else lag)




def backward(dy, x, topk_idx, topk_weights, w13, w2, h_saved, counts, offsets, pool_src_route, pool_src_rank,
             route_to_pool, *, activation_clamp=None, group=None, num_experts=None, recompute=False,
             need_wgrad=True, dw13_accum=None, dw2_accum=None, buffer=None, x_pool=None, num_sms=0,
             defer_wgrad=False):
    """The layer's backward on the fused kernel; the contract of :func:`prime_kernels.mega.reference.backward`
    (``num_sms`` as in :func:`prime_kernels.mega._grouped.forward`; ``defer_wgrad`` as in
    :func:`prime_kernels.mega._grouped.backward`: the kernel runs without its weight-gradient tiles, and the queued
    work is the grouped backward's k-grouped GEMMs on the kept operands). The dy rows are dispatched into the pool
    (and the x rows, when the weight gradients are wanted and the forward did not keep them), then one kernel
    computes dh, w * s, the d topk_weights partials, the dX slots and both weight gradients; the partials are summed
    in column order and the slots combined, as the grouped backward does."""
    if group is not None:
        raise FusedKernelUnavailable("prime_kernels.mega: the fused backward runs on a single rank for now "
                                     "(group=None)")
    sms = num_sms if num_sms else None
    capacity = pool_src_route.shape[0]
    route_to_pool = route_to_pool.contiguous()
    want_w = not defer_wgrad and (need_wgrad or dw13_accum is not None or dw2_accum is not None)
    padding = PaddingRows(counts, offsets, route_to_pool.numel(), capacity)  # for every pool gathered below
    h = h_saved
    if recompute:  # the grouped backward's recompute: with a clamp, h keeps the clamp masks as the forward's did
        h, x_pool = recompute_h(x, w13, counts, offsets, route_to_pool, capacity, x_pool, sms, activation_clamp,
                                padding)
    weights = topk_weights.float().contiguous()
    dy_pool = _gathered_pool(_rows_for_kernels(dy.to(torch.bfloat16)), route_to_pool, counts, offsets, capacity,
                             padding)
    if (want_w or defer_wgrad) and x_pool is None:
        x_pool = _gathered_pool(_rows_for_kernels(x), route_to_pool, counts, offsets, capacity, padding)
    both = dw13_accum is not None and dw2_accum is not None
    if want_w:
        # bf16 or fp32 parameters get their gradients in their dtype from the kernel; a single accumulator (or another
        # dtype) gets fp32, added (or cast) here
        direct = (w13.dtype == w2.dtype and w13.dtype in (torch.bfloat16, torch.float32) and dw13_accum is None
                  and dw2_accum is None)
        _dh, _aw, dt_part, dx_pool, dw13, dw2 = dgrad_wgrad(
            dy_pool, x_pool, w13, w2, h, offsets, pool_src_route, weights,
            wgrad_dtype=w13.dtype if direct else torch.float32, dw13_accum=dw13_accum if both else None,
            dw2_accum=dw2_accum if both else None, activation_clamp=activation_clamp, num_sms=sms)
    else:
        _dh, _aw, dt_part, dx_pool = dgrad(dy_pool, w13, w2, h, offsets, pool_src_route, weights,
                                           activation_clamp=activation_clamp, num_sms=sms)
    later = deferred_wgrad(dy_pool, _aw, _dh, x_pool, offsets, sms) if defer_wgrad else None
    del _dh, _aw, dy_pool, h
    # d topk_weights per pool row: the partials summed in column order, into a buffer whose last entry is a zero that
    # masked routes (route_to_pool = -1, which indexes the last entry) read
    dt_pool = dt_part.new_empty(capacity + 1)
    dt_pool[capacity:].zero_()
    torch.sum(dt_part, 1, out=dt_pool[:capacity])
    dx = combine(dx_pool, route_to_pool, None)
    del dx_pool
    dtopk = dt_pool[route_to_pool.reshape(-1)].view_as(topk_weights).to(topk_weights.dtype)
    if defer_wgrad:
        return dx, dtopk, later
    out13 = out2 = None
    if want_w and not both:
        if dw13_accum is not None:
            dw13_accum.add_(dw13)
        elif need_wgrad:
            out13 = dw13.to(w13.dtype)
        if dw2_accum is not None:
            dw2_accum.add_(dw2)
        elif need_wgrad:
            out2 = dw2.to(w2.dtype)
    return dx, dtopk, out13, out2


def _register() -> None:
    """The op's fake kernel (meta tensors, torch.compile tracing): the output shapes."""

    def fake(dy_pool, w2, w13, group_offsets, h, pool_src_route, topk_weights, clamp=0.0, x_pool=None,
             wgrad_fp32=False, dw13_accum=None, dw2_accum=None, num_sms=0, lag=-1):
        M, H = dy_pool.shape
        E, _, I = w2.shape
        if x_pool is None or dw13_accum is not None:
            dw13, dw2 = dy_pool.new_empty(0), dy_pool.new_empty(0)
        else:
            dt = torch.float32 if wgrad_fp32 else torch.bfloat16
            dw13, dw2 = dy_pool.new_empty(E, 2 * I, H, dtype=dt), dy_pool.new_empty(E, H, I, dtype=dt)
        return _outputs_like(dy_pool, M, H, I) + (dw13, dw2)

    torch.library.register_fake("prime_kernels::mega_moe_bwd_fused", fake)
