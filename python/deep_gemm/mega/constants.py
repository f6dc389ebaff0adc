"""Alignment constants shared by the Python API and the fused kernels.

This is the one exported set: the host-side validation in :mod:`deep_gemm.mega` checks
against these values and the CUDA kernels are written to them.

* ``HIDDEN_ALIGN``: H (the hidden size) must be a multiple of this for the fused kernels.
* ``INTERMEDIATE_ALIGN``: I (the expert intermediate size) must be a multiple of this.
* ``BLOCK_M``: rows per m-block; every expert's rows start at a multiple of it in the pool
  (the routing plan pads each expert's row count up to a multiple of ``BLOCK_M``).

The pure-PyTorch reference accepts any H and I (so that tiny float64 gradchecks are possible);
the alignment is enforced whenever a fused kernel would run.
"""

HIDDEN_ALIGN = 128
INTERMEDIATE_ALIGN = 128
BLOCK_M = 128

#: Environment variable that lets ``backend="auto"`` fall back to the reference.
ALLOW_FALLBACK_ENV = "DEEP_GEMM_ALLOW_REFERENCE_FALLBACK"

#: Environment variable: "1" skips the expert-id value check (a device -> host read that the kernel
#: backends wait for after queueing their kernels) on the kernel backends, whose routing plan treats an
#: out-of-range id as a masked route.
SKIP_VALUE_CHECKS_ENV = "DEEP_GEMM_SKIP_VALUE_CHECKS"

#: Precision names (those of the competing product's announcement).
PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")

#: Backend names accepted by every entry point.
BACKENDS = ("auto", "fused", "grouped", "reference")

__all__ = [
    "HIDDEN_ALIGN",
    "INTERMEDIATE_ALIGN",
    "BLOCK_M",
    "ALLOW_FALLBACK_ENV",
    "SKIP_VALUE_CHECKS_ENV",
    "PRECISIONS",
    "BACKENDS",
]
