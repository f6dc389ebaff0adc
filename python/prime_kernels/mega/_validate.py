"""Argument checks that run before any launch or compute; every message is one line that says
what to do. Metadata checks (dtype, device, shape, contiguity, alignment) are separate from the
value checks (expert ids), which need the data and so run inside the op implementation."""

from __future__ import annotations

import math
import numbers

import torch

from .. import _watchdog
from .constants import KERNEL_BLOCK_MS, MAX_BLOCK_M, SKIP_VALUE_CHECKS_ENV, env_flag

PREFIX = "prime_kernels.mega: "


class FusedKernelUnavailable(RuntimeError):
    """Raised when a kernel backend was asked for (or needed) and cannot run here; the message says why.
    Defined with the argument checks so that the backend modules and the resolver that imports them share it."""


def _fail(msg, exc=ValueError):
    raise exc(PREFIX + msg)


def _shape(t):
    return list(t.shape)


def check_call_tensor(t, name, shape, dtypes, device, contiguous: bool = True) -> None:
    """A tensor a DeepGEMM-shaped call reads or writes: a tensor of one of ``dtypes``, of ``shape``, on ``device``, and
    (``contiguous``) contiguous; TypeError for the kind, ValueError for the rest."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}", TypeError)
    if t.dtype not in dtypes:
        want = dtypes[0] if len(dtypes) == 1 else f"one of {list(dtypes)}"
        _fail(f"{name} must be {want}, got {t.dtype}", TypeError)
    if list(t.shape) != list(shape):
        _fail(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        _fail(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        _fail(f"{name} must be contiguous; allocate it with torch.empty")


def check_tensor_types(**tensors):
    """Each argument is a torch.Tensor (before anything reads its shape)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)


def check_activation_clamp(activation_clamp):
    """None (no clamp) or a finite number > 0. The kernels encode "no clamp" as 0, so a 0 that reached them
    would silently mean something else than the reference's clamp to 0; a bound <= 0 zeroes every gate anyway."""
    if activation_clamp is None:
        return None
    if isinstance(activation_clamp, bool) or not isinstance(activation_clamp, numbers.Real):
        _fail(f"activation_clamp must be None (no clamp) or a finite number > 0, got {activation_clamp!r}", TypeError)
    c = float(activation_clamp)
    if not (math.isfinite(c) and c > 0.0):
        _fail(f"activation_clamp must be None (no clamp) or a finite number > 0, got {activation_clamp!r}")
    return c


def check_block_m(block_m):
    """An int in [1, MAX_BLOCK_M] (the routing plan's bound); which values the kernel backends take is
    :func:`kernel_block_m_reason`'s part, checked once the backend is known."""
    if isinstance(block_m, bool) or not isinstance(block_m, numbers.Integral) or not 1 <= int(block_m) <= MAX_BLOCK_M:
        _fail(f"block_m must be one of {KERNEL_BLOCK_MS} for the kernel backends ('fused', 'grouped') or an int in "
              f"[1, {MAX_BLOCK_M}] for backend='reference', got {block_m!r}")
    return int(block_m)


def kernel_block_m_reason(block_m):
    """None when the kernel backends take ``block_m``, else the one-line reason listing the values they take."""
    if int(block_m) in KERNEL_BLOCK_MS:
        return None
    return (f"block_m={block_m} is not accepted by the kernel backends ('fused', 'grouped'): accepted values are "
            f"{KERNEL_BLOCK_MS}; pass one of them, or backend='reference' (any block_m in [1, {MAX_BLOCK_M}])")


def num_sms_arg(num_sms) -> int:
    """The public ``num_sms`` (None = every SM, else an int >= 1) as the ops take it (0 = every SM)."""
    if num_sms is None:
        return 0
    if isinstance(num_sms, bool) or not isinstance(num_sms, numbers.Integral) or int(num_sms) < 1:
        _fail(f"num_sms must be None (every SM) or an int >= 1, got {num_sms!r}")
    return int(num_sms)


def check_op_num_sms(num_sms) -> int:
    """``num_sms`` as the custom ops take it: an int >= 0 (0 = every SM)."""
    if isinstance(num_sms, bool) or not isinstance(num_sms, numbers.Integral) or int(num_sms) < 0:
        _fail(f"num_sms must be an int >= 0 (0 = every SM), got {num_sms!r}")
    return int(num_sms)


MAX_EP_CHUNKS = 64


def check_ep_chunks(ep_chunks, *, ep_size: int, backend: str, precision: str) -> int:
    """``ep_chunks`` as the forward op takes it: an int in [1, MAX_EP_CHUNKS]; above 1 only where the chunked
    exchange runs (a group of more than one rank, the grouped backend, bf16)."""
    if (isinstance(ep_chunks, bool) or not isinstance(ep_chunks, numbers.Integral)
            or not 1 <= ep_chunks <= MAX_EP_CHUNKS):
        _fail(f"ep_chunks must be None (the default) or an int in [1, {MAX_EP_CHUNKS}], got {ep_chunks!r}")
    if ep_chunks > 1:
        if ep_size == 1:
            _fail(f"ep_chunks={ep_chunks} splits the expert-parallel exchanges; without a group of more than one rank "
                  "there is none (pass ep_chunks=None or 1)")
        if backend not in ("auto", "grouped"):  # under a group, "auto" runs the grouped backend
            _fail(f"ep_chunks={ep_chunks}: the chunked exchange runs on the grouped backend, this call asks for "
                  f"{backend!r}")
        if precision != "bf16":
            _fail(f"ep_chunks={ep_chunks}: the {precision} expert-parallel path exchanges its rows in one chunk "
                  "(pass ep_chunks=None or 1)")
    return int(ep_chunks)


def check_buffer_shape(buffer, hidden, top_k):
    if buffer is not None and (buffer.hidden != hidden or buffer.num_topk != top_k):
        _fail(f"the buffer was allocated for H={buffer.hidden}, K={buffer.num_topk} but the inputs have "
              f"H={hidden}, K={top_k}; allocate one for this shape")


def check_inputs(
    x,
    topk_idx,
    topk_weights,
    w13,
    w2,
    *,
    num_experts=None,
    ep_size=1,
    max_tokens=None,
    activation_clamp=None,
    block_m=None,
    dy=None,
):
    """Metadata checks of the layer's inputs (and of ``activation_clamp`` and ``block_m`` when given). Returns
    (T, H, I, K, El, E). First of all, a lost CUDA context (a kernel wait that timed out) or an earlier call's
    invalid device-side inputs are reported (a read of host memory), before any CUDA work fails more vaguely."""
    if isinstance(x, torch.Tensor) and x.is_cuda:
        _watchdog.check_device_errors()
    check_tensor_types(x=x, topk_idx=topk_idx, topk_weights=topk_weights, w13=w13, w2=w2)
    if dy is not None:
        check_tensor_types(dy=dy)
    exact = x.dtype == torch.float64
    if x.dtype not in (torch.bfloat16, torch.float64):
        _fail(f"x must be bfloat16 (float64 only for exactness tests), got {x.dtype}; cast with x.to(torch.bfloat16)", TypeError)
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype:
            _fail(f"{name} must have x's dtype {x.dtype}, got {w.dtype}; cast it (keep fp32 master weights in the optimizer)", TypeError)
    if topk_idx.dtype not in (torch.int64, torch.int32):
        _fail(f"topk_idx must be int64 (or int32), got {topk_idx.dtype}", TypeError)
    want_w = torch.float64 if exact else torch.float32
    if topk_weights.dtype != want_w:
        _fail(f"topk_weights must be {want_w} (the combine applies them in fp32), got {topk_weights.dtype}; cast with .float()", TypeError)

    devs = {t.device for t in (x, topk_idx, topk_weights, w13, w2)}
    if dy is not None:
        devs.add(dy.device)
    if len(devs) != 1:
        _fail(f"all tensors must be on one device, got {sorted(str(d) for d in devs)}; move them with .to(device)")

    if x.dim() != 2:
        _fail(f"x must be 2-D [T, H], got shape {_shape(x)}")
    T, H = x.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != T:
        _fail(f"topk_idx must be [T, K] with T={T} (x's rows), got shape {_shape(topk_idx)}")
    K = topk_idx.shape[1]
    if K < 1:
        _fail("topk_idx must have at least one column (K >= 1)")
    if topk_weights.shape != topk_idx.shape:
        _fail(f"topk_weights shape {_shape(topk_weights)} must match topk_idx shape {_shape(topk_idx)}")
    if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2:
        _fail(f"w13 must be [El, 2I, H] with H={H} (gate rows then up rows), got shape {_shape(w13)}")
    El, twoI = w13.shape[0], w13.shape[1]
    I = twoI // 2
    if El < 1 or I < 1:
        _fail(f"w13 must have at least one expert and I >= 1, got shape {_shape(w13)}")
    if _shape(w2) != [El, H, I]:
        _fail(f"w2 must be [El, H, I] = {[El, H, I]} to match w13 {_shape(w13)}, got {_shape(w2)}")
    if dy is not None:
        _check_dy_shape(dy, x)

    names = [("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2)]
    if dy is not None:
        names.append(("dy", dy))
    for name, t in names:
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous (shape {_shape(t)}, strides {list(t.stride())}); call .contiguous()")

    if ep_size < 1:
        _fail(f"the group size must be >= 1, got {ep_size}")
    E = El * ep_size if num_experts is None else int(num_experts)
    if E % ep_size:
        _fail(f"num_experts={E} is not divisible by the group size {ep_size}; use a group whose size divides it")
    if E // ep_size != El:
        _fail(f"w13 holds {El} local experts but num_experts={E} over {ep_size} ranks needs {E // ep_size}")
    if max_tokens is not None and T > max_tokens:
        _fail(f"{T} tokens exceed the buffer's num_max_tokens_per_rank={max_tokens}; allocate the buffer with a larger max")
    check_activation_clamp(activation_clamp)
    if block_m is not None:
        check_block_m(block_m)
    return T, H, I, K, El, E


def _check_dy_shape(dy, x):
    if dy.dtype != x.dtype:
        _fail(f"dy must be {x.dtype}, got {dy.dtype}", TypeError)
    if _shape(dy) != _shape(x):
        _fail(f"dy must be [T, H] = {_shape(x)}, got {_shape(dy)}")


def check_dy(dy, x):
    """The checks of a backward whose other inputs are its forward's, already checked by :func:`check_inputs`
    when the forward ran (the backward op under autograd): dy like y (x's dtype, shape and device, contiguous),
    after the report of a lost CUDA context (the forward's kernels may have been the ones that lost it)."""
    if x.is_cuda:
        _watchdog.check_device_errors()
    check_tensor_types(dy=dy)
    _check_dy_shape(dy, x)
    if dy.device != x.device:
        _fail(f"all tensors must be on one device, got {sorted({str(dy.device), str(x.device)})}; move them with "
              f".to(device)")
    if not dy.is_contiguous():
        _fail(f"dy must be contiguous (shape {_shape(dy)}, strides {list(dy.stride())}); call .contiguous()")


def check_exact_mode(x, backend):
    """float64 inputs are the reference's exact (unrounded) mode only."""
    if x.dtype == torch.float64 and backend != "reference":
        _fail(f"float64 inputs (the exact, unrounded mode) run on backend='reference' only, got backend={backend!r}; "
              f"pass backend='reference' or use bfloat16 inputs")


# Pinned host buffers for ExpertIdCheck, reused: allocating pinned memory per call cost ~100-350 us of host
# time each forward (measured as GPU idle gaps next to the copy by bench/profile_layer.py). One pool per form:
# int64 [2] (min, max) and int32 [1] (the routing plan's count of bad ids).
_PINNED: dict = {"lohi": [], "count": []}


class ExpertIdCheck:
    """The expert-id value check of one call, in two halves so that it costs no GPU idle time.

    ``start`` (the constructor) queues one min/max reduction and its copy to pinned host memory; the
    caller then queues its kernels (the routing plan treats an out-of-range id as a masked route, so
    nothing is read out of bounds and only this call's fresh outputs are written) and calls ``finish``
    before it returns or touches caller-owned memory: ``finish`` waits for the copy only (already done,
    or next in the queue) and raises if an id is out of range. A synchronous read before the launches
    instead left the GPU idle while the host queued the rest of the layer (~0.8 ms per forward at 30B,
    T=16384). The reference backend checks before it computes (it indexes with the ids on the host's
    terms).

    With ``from_plan=True`` (a kernel backend that builds the routing plan on the GPU) nothing is queued
    at first: the backend hands the plan's count of out-of-range ids to :meth:`watch`, which copies that
    count instead (the plan kernels count them anyway; the min/max reduction, its stack and its copy cost
    ~10 us of GPU time per forward at 30B, T=16384, measured on an H200). The min and max for the
    message are read only when the count is not zero. If no count was handed over, ``finish`` checks
    synchronously."""

    def __init__(self, topk_idx, num_experts, backend=None, from_plan=False):
        self.num_experts = num_experts
        self._lohi = None
        self._count = None
        self._event = None
        self._idx = None
        if topk_idx.numel() == 0:
            return
        if backend in ("fused", "grouped") and env_flag(SKIP_VALUE_CHECKS_ENV):
            return
        if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # no host read is possible inside a CUDA graph capture; ids are masked routes there
        if from_plan and topk_idx.is_cuda and backend in ("fused", "grouped"):
            self._idx = topk_idx  # waits for watch()
            return
        lohi = torch.stack(torch.aminmax(topk_idx))
        if topk_idx.is_cuda and backend in ("fused", "grouped"):
            self._lohi = self._pinned("lohi", torch.int64, 2)
            self._lohi.copy_(lohi.to(torch.int64), non_blocking=True)
            self._record(topk_idx.device)
        else:
            self._lohi = lohi
            self.finish()

    @staticmethod
    def _pinned(kind, dtype, n):
        pool = _PINNED[kind]
        return pool.pop() if pool else torch.empty(n, dtype=dtype, pin_memory=True)

    def _record(self, device):
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))  # the copy's stream, any current device

    def watch(self, num_invalid) -> None:
        """Queue the copy of the routing plan's count of out-of-range ids ([1] int32, on the plan's stream)."""
        if self._idx is None:
            return
        self._count = self._pinned("count", torch.int32, 1)
        self._count.copy_(num_invalid.reshape(1), non_blocking=True)
        self._record(num_invalid.device)

    def finish(self) -> None:
        if self._idx is not None:
            idx, self._idx = self._idx, None
            if self._count is None:  # no count was handed over: the whole check, synchronously
                self._lohi = torch.stack(torch.aminmax(idx))
            else:
                self._event.synchronize()
                bad = int(self._count[0])
                _PINNED["count"].append(self._count)
                self._count = None
                self._event = None
                if bad == 0:
                    return
                lo, hi = torch.stack(torch.aminmax(idx)).tolist()  # only for the message
                if lo >= -1 and hi < self.num_experts:  # the ids changed since the plan read them
                    _fail(f"topk_idx held {bad} expert id(s) outside [-1, {self.num_experts - 1}] when the routing "
                          f"plan read it; fix the router output")
                self._lohi = torch.tensor([lo, hi])
        if self._lohi is None:
            return
        if self._event is not None:
            self._event.synchronize()
        lo, hi = self._lohi.tolist()
        if self._event is not None:
            _PINNED["lohi"].append(self._lohi)  # read: free for the next check
        self._lohi = None
        self._event = None
        if lo < -1 or hi >= self.num_experts:
            _fail(
                f"topk_idx holds expert ids in [{lo}, {hi}] but must lie in [-1, {self.num_experts - 1}] "
                f"(-1 masks a route); fix the router output"
            )


def check_expert_ids(topk_idx, num_experts, backend=None):
    """The whole value check at once (one device -> host read); see :class:`ExpertIdCheck`. With
    ``PRIME_KERNELS_SKIP_VALUE_CHECKS=1`` it is skipped for the kernel backends (``backend`` "fused" or
    "grouped"), where an out-of-range id is then a masked route; never for the reference."""
    ExpertIdCheck(topk_idx, num_experts, backend).finish()
