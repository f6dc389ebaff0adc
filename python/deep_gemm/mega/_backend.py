"""Backend selection: fused kernel, reference, or an error that says why.

Rules (the same for every entry point):

* ``backend="reference"`` always runs the pure-PyTorch reference (bf16 numerics only).
* ``backend="fused"`` runs the fused kernel, or raises the reason ``deep_gemm.status()`` gives.
* ``backend="grouped"`` runs the pipeline of our grouped-GEMM kernels (:mod:`deep_gemm.mega._grouped`,
  bf16, single rank), or raises the reason.
* ``backend="auto"`` runs the fused kernel when it is available, else the grouped pipeline where
  that is available (bf16, single rank); otherwise it falls back to the reference only when the
  environment variable ``DEEP_GEMM_ALLOW_REFERENCE_FALLBACK=1`` is set, with a one-time warning,
  and raises the reason otherwise. Never silently.
* A forward with more local experts than the fused kernel takes (``FUSED_MAX_EXPERTS``) is a ValueError
  under ``backend="fused"`` and runs the grouped pipeline under ``"auto"`` (:func:`choose_backend` says why).
* The kernel backends take ``block_m`` in ``KERNEL_BLOCK_MS`` only: another value is a ValueError listing
  them whenever one of them would run (the reference takes any block_m up to ``MAX_BLOCK_M``).
"""

from __future__ import annotations

import os
import warnings

from . import _validate
from .constants import (ALLOW_FALLBACK_ENV, BACKENDS, FUSED_MAX_EXPERTS, GROUPED_MAX_EXPERTS, HIDDEN_ALIGN,
                        INTERMEDIATE_ALIGN, PRECISIONS)

# (precision, direction) -> kernel name in deep_gemm.status().
# "fp8_bwd" is a BF16 forward with an FP8 backward.
KERNEL_NAMES = {
    ("bf16", "fwd"): "mega_moe.bf16.sm90",
    ("bf16", "bwd"): "mega_moe_backward.bf16.sm90",
    ("fp8", "fwd"): "mega_moe.fp8.sm90",
    ("fp8", "bwd"): "mega_moe.fp8_bwd.sm90",
    ("fp8_bwd", "fwd"): "mega_moe.bf16.sm90",
    ("fp8_bwd", "bwd"): "mega_moe.fp8_bwd.sm90",
    ("mxfp8", "fwd"): "mega_moe.mxfp8.sm100",
    ("mxfp8", "bwd"): "mega_moe.mxfp8.sm100",
}

_NOT_IMPLEMENTED = "not implemented yet"
_warned: set = set()


class FusedKernelUnavailable(RuntimeError):
    """Raised when a fused kernel was asked for (or needed) and does not exist here."""


def _status() -> dict:
    try:
        import deep_gemm  # noqa: PLC0415  (lazy: the package imports before the lead's module lands)
    except Exception:  # pragma: no cover - only while the tree is half-built
        return {}
    fn = getattr(deep_gemm, "status", None)
    if fn is None:
        return {}
    try:
        return dict(fn())  # cheap: deep_gemm.status() remembers its answers once CUDA is up
    except Exception as exc:  # a broken status() is a reason, not a crash
        return {"__error__": f"deep_gemm.status() failed: {exc}"}


# current CUDA device -> "sm90" / "sm100" (a device's arch cannot change; get_device_capability costs a
# properties query, and every layer call asks two or three times)
_ARCH_BY_DEVICE: dict = {}


def _device_arch() -> str:
    """"sm100" on a Blackwell current device, else "sm90" (also without any GPU)."""
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            dev = torch.cuda.current_device()
            arch = _ARCH_BY_DEVICE.get(dev)
            if arch is None:
                arch = "sm100" if torch.cuda.get_device_capability(dev)[0] == 10 else "sm90"
                _ARCH_BY_DEVICE[dev] = arch
            return arch
    except Exception:
        pass
    return "sm90"


def kernel_name(precision: str, direction: str) -> str:
    """The ``deep_gemm.status()`` key of the fused kernel for (precision, direction) on this device:
    the bf16 kernels have sm90 and sm100 variants; fp8/fp8_bwd are sm90, mxfp8 is sm100."""
    check_precision(precision)
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"deep_gemm.mega: direction must be 'fwd' or 'bwd', got {direction!r}")
    name = KERNEL_NAMES[(precision, direction)]
    if name.startswith(("mega_moe.bf16.", "mega_moe_backward.bf16.")) and _device_arch() == "sm100":
        name = name.replace(".sm90", ".sm100")
    return name


def _fused_reason(precision: str, direction: str) -> str | None:
    """None when the fused kernel for (precision, direction) is available, else the reason."""
    name = kernel_name(precision, direction)
    st = _status()
    if "__error__" in st:
        return st["__error__"]
    reason = st.get(name)
    if reason is None:
        return f"{name}: {_NOT_IMPLEMENTED}"
    if reason == "available":
        return None
    return f"{name}: {reason}"


GROUPED_KEY = "mega_moe_grouped.bf16.sm90"


def fused_experts_reason(num_local_experts: int | None) -> str | None:
    """None when the fused forward kernel takes this many local experts, else why not."""
    if num_local_experts is not None and num_local_experts > FUSED_MAX_EXPERTS:
        return (f"{num_local_experts} local experts exceed the fused forward kernel's limit of "
                f"FUSED_MAX_EXPERTS={FUSED_MAX_EXPERTS} (deep_gemm.mega.constants)")
    return None


def _grouped_reason(precision: str, ep_size: int, activation_clamp: float | None = None,
                    num_local_experts: int | None = None) -> str | None:
    """None when the grouped pipeline can run this call, else why not."""
    if activation_clamp is not None:
        # Its h is stored as plain bf16, so values within half an ulp of the bound land on it and
        # lose their gradient (measured ~3% in dX); the mask-preserving rounding (reference F6)
        # needs the fp32 accumulators, i.e. the fused L1 epilogue.
        return "the grouped pipeline does not support activation_clamp (it needs the fused SwiGLU epilogue)"
    if precision != "bf16":
        return f"the grouped pipeline is bf16 only (precision={precision!r})"
    if ep_size != 1:
        return "the grouped pipeline runs on a single rank (no expert-parallel group)"
    if num_local_experts is not None and num_local_experts > GROUPED_MAX_EXPERTS:
        return (f"{num_local_experts} local experts exceed the grouped GEMMs' limit of "
                f"GROUPED_MAX_EXPERTS={GROUPED_MAX_EXPERTS} (deep_gemm.mega.constants)")
    reason = _status().get(GROUPED_KEY, f"{_NOT_IMPLEMENTED}")
    return None if reason == "available" else f"{GROUPED_KEY}: {reason}"


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(
            f"deep_gemm.mega: precision must be one of {PRECISIONS}, got {precision!r}"
        )


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"deep_gemm.mega: backend must be one of {BACKENDS}, got {backend!r}")


def fallback_allowed() -> bool:
    return os.environ.get(ALLOW_FALLBACK_ENV, "") == "1"


def alignment_reason(hidden: int, intermediate: int) -> str | None:
    """None when H and I suit the fused kernels, else a one-line reason."""
    if hidden % HIDDEN_ALIGN or intermediate % INTERMEDIATE_ALIGN:
        return (
            f"hidden={hidden} and intermediate={intermediate} must be multiples of "
            f"HIDDEN_ALIGN={HIDDEN_ALIGN} and INTERMEDIATE_ALIGN={INTERMEDIATE_ALIGN} "
            f"(deep_gemm.mega.constants) for the fused kernels; pad the weights or use "
            f"backend='reference'"
        )
    return None


def resolve_backend(backend: str, precision: str, direction: str, **shape) -> str:
    """Return "fused", "grouped" or "reference", or raise with the reason (see the module docstring); the
    keyword arguments are those of :func:`choose_backend`."""
    return choose_backend(backend, precision, direction, **shape)[0]


def _require_kernel_block_m(block_m) -> None:
    why = None if block_m is None else _validate.kernel_block_m_reason(block_m)
    if why is not None:
        raise ValueError(f"deep_gemm.mega: {why}")


def choose_backend(
    backend: str,
    precision: str,
    direction: str,
    *,
    device_type: str = "cuda",
    hidden: int | None = None,
    intermediate: int | None = None,
    ep_size: int = 1,
    activation_clamp: float | None = None,
    num_local_experts: int | None = None,
    block_m: int | None = None,
) -> tuple[str, str | None]:
    """(the backend that runs this call, why the fused kernel does not run it or None when it does), or raise
    with the reason. Shape limits of the kernels (H and I alignment, the fused kernel's expert count, block_m)
    are ValueErrors when a kernel backend was named; under "auto" a shape the fused kernel cannot take runs the
    grouped pipeline where that can, and a block_m the kernel backends do not take is a ValueError whenever one
    of them would run."""
    check_backend(backend)
    check_precision(precision)
    if backend == "reference":
        if precision != "bf16":
            raise NotImplementedError(
                f"deep_gemm.mega: the reference implements precision='bf16' only; "
                f"precision={precision!r} has no reference numerics yet: use precision='bf16'"
            )
        return "reference", "backend='reference' was asked for"

    if backend in ("fused", "grouped"):  # a named kernel backend: the call is wrong on any device
        _require_kernel_block_m(block_m)
    align = alignment_reason(hidden, intermediate) if hidden is not None and intermediate is not None else None
    if align is not None and backend == "fused":
        raise ValueError(f"deep_gemm.mega: {align}")
    too_many = fused_experts_reason(num_local_experts) if direction == "fwd" else None
    if too_many is not None and backend == "fused":
        raise ValueError(f"deep_gemm.mega: backend='fused' cannot run: {too_many}; use backend='auto' or "
                         f"'grouped' (the grouped pipeline takes up to {GROUPED_MAX_EXPERTS})")
    off_device = None if device_type == "cuda" else f"tensors are on {device_type}; the fused kernels need CUDA tensors"
    common = align or off_device
    if backend == "grouped":
        why = common or _grouped_reason(precision, ep_size, activation_clamp, num_local_experts)
        if why is not None:
            raise FusedKernelUnavailable(f"deep_gemm.mega: backend='grouped' cannot run: {why}")
        return "grouped", "backend='grouped' was asked for"
    reason = common or too_many or _fused_reason(precision, direction)
    if reason is None:
        _require_kernel_block_m(block_m)
        return "fused", None
    if backend == "auto" and common is None:
        grouped_why = _grouped_reason(precision, ep_size, activation_clamp, num_local_experts)
        if grouped_why is None:
            _require_kernel_block_m(block_m)
            return "grouped", reason
        if too_many is not None:  # the reason the fused kernel cannot run is not the only one
            reason = f"{reason}, and the grouped pipeline cannot run either: {grouped_why}"

    advice = (
        "use backend='reference', or set "
        f"{ALLOW_FALLBACK_ENV}=1 to let backend='auto' fall back to it"
    )
    if backend == "fused":
        raise FusedKernelUnavailable(
            f"deep_gemm.mega: no fused kernel for precision={precision!r} {direction}: {reason}; {advice}"
        )
    # backend == "auto"
    if precision != "bf16":
        raise FusedKernelUnavailable(
            f"deep_gemm.mega: no fused kernel for precision={precision!r} {direction}: {reason}; "
            f"the reference implements precision='bf16' only"
        )
    if not fallback_allowed():
        raise FusedKernelUnavailable(
            f"deep_gemm.mega: no fused kernel for precision={precision!r} {direction}: {reason}; {advice}"
        )
    key = (precision, direction, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"deep_gemm.mega: falling back to the pure-PyTorch reference for {precision} {direction} "
            f"({reason}); it is slow. Unset {ALLOW_FALLBACK_ENV} to make this an error.",
            RuntimeWarning,
            stacklevel=4,
        )
    return "reference", reason
