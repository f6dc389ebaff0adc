"""Hook where the fused CUDA kernels plug into ``deep_gemm.mega``.

``_backend.resolve_backend`` returns "fused" only when ``deep_gemm.status()`` reports the kernel
"available"; the functions below then run it. They take the same arguments as the reference
functions (``reference.forward`` / ``reference.backward``) and must return the same tuples, with
the same rounding points (see the docstring of :mod:`deep_gemm.mega.reference`), plus a keyword
``buffer`` (the :class:`deep_gemm.mega.SymmBuffer` the caller registered, or None). Register the
CUDA ops they call under names other than ``deep_gemm::mega_moe_fwd`` / ``deep_gemm::mega_moe_bwd``
(those are the Python custom ops of :mod:`deep_gemm.mega._ops`).
Until the kernels are bound here they raise, so nothing can silently run the wrong code.
"""

from __future__ import annotations

from ._backend import FusedKernelUnavailable


def forward(*args, precision: str = "bf16", **kwargs):
    raise FusedKernelUnavailable(
        f"deep_gemm.mega: deep_gemm.status() reports the {precision} forward kernel available, but "
        f"deep_gemm/mega/_fused.py has no binding for it yet; use backend='reference'"
    )


def backward(*args, precision: str = "bf16", **kwargs):
    raise FusedKernelUnavailable(
        f"deep_gemm.mega: deep_gemm.status() reports the {precision} backward kernel available, but "
        f"deep_gemm/mega/_fused.py has no binding for it yet; use backend='reference'"
    )
