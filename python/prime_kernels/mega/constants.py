"""Alignment constants shared by the Python API and the fused kernels.

This is the one exported set: the host-side validation in :mod:`prime_kernels.mega` checks
against these values and the CUDA kernels are written to them.

* ``HIDDEN_ALIGN``: H (the hidden size) must be a multiple of this for the kernel backends (bf16).
* ``INTERMEDIATE_ALIGN``: I (the expert intermediate size) must be a multiple of this.
* ``FP8_ALIGN``: the FP8 kernels' scale blocks. H and I multiples of it fill them; multiples of 64 that are not end
  on a 64-wide last block, which runs where ``status()["mega_moe_half_tiles.fp8.sm90"]`` says available (not for
  MXFP8, nor in the fused FP8 forward: "auto" then runs the FP8 forward pipeline).
* ``FULL_TILE_ALIGN``: H and I multiples of this fill the kernels' 128-wide tiles; multiples of 64 that are not
  leave a half-width last tile, which runs where ``status()["mega_moe_half_tiles.bf16.sm90"]`` says available.
* ``BLOCK_M``: rows per m-block; every expert's rows start at a multiple of it in the pool
  (the routing plan pads each expert's row count up to a multiple of ``BLOCK_M``).

The pure-PyTorch reference accepts any H and I (so that tiny float64 gradchecks are possible);
the alignment is enforced whenever a fused kernel would run.

* ``KERNEL_BLOCK_MS``: the ``block_m`` values the kernel backends ("fused", "grouped") accept. Their plans,
  pools and tiles are laid out for the fused kernel's 128-row m-block; the reference takes any block_m in
  [1, ``MAX_BLOCK_M``] (the routing plan's bound).
* ``FUSED_MAX_EXPERTS``: the most local experts the fused forward kernel takes (its per-expert tables live in
  shared memory: ``kMegaMaxExperts`` in csrc/sm90/mega_moe_fwd_roles.cuh); more run the grouped pipeline under
  ``backend="auto"``.
* ``GROUPED_MAX_EXPERTS``: the most groups the grouped GEMMs take (``kMaxGroups`` in csrc/sm90/kernel_common.cuh).
"""

import os

HIDDEN_ALIGN = 64
INTERMEDIATE_ALIGN = 64
FP8_ALIGN = 128
FULL_TILE_ALIGN = 128
BLOCK_M = 128
KERNEL_BLOCK_MS = (BLOCK_M,)
MAX_BLOCK_M = 1024
FUSED_MAX_EXPERTS = 512
GROUPED_MAX_EXPERTS = 1024

#: Environment variable that lets ``backend="auto"`` fall back to the reference.
ALLOW_FALLBACK_ENV = "PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK"

#: Environment variable: "1" skips the expert-id value check (a device -> host read that the kernel
#: backends wait for after queueing their kernels) on the kernel backends, whose routing plan treats an
#: out-of-range id as a masked route.
SKIP_VALUE_CHECKS_ENV = "PRIME_KERNELS_SKIP_VALUE_CHECKS"

#: The names these variables had when the import package was deep_gemm. They are still read (the new
#: name wins when both are set), so existing job scripts keep working.
LEGACY_ENV_NAMES = {ALLOW_FALLBACK_ENV: "DEEP_GEMM_ALLOW_REFERENCE_FALLBACK",
                    SKIP_VALUE_CHECKS_ENV: "DEEP_GEMM_SKIP_VALUE_CHECKS"}


def env_flag(name: str) -> bool:
    """True when the variable ``name`` (or, if it is unset, its legacy name) is "1"."""
    value = os.environ.get(name)
    if value is None:
        value = os.environ.get(LEGACY_ENV_NAMES.get(name, ""), "")
    return value == "1"


#: Precision names (those of the competing product's announcement).
PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")

#: Backend names accepted by every entry point.
BACKENDS = ("auto", "fused", "grouped", "reference")

__all__ = [
    "HIDDEN_ALIGN",
    "INTERMEDIATE_ALIGN",
    "FP8_ALIGN",
    "FULL_TILE_ALIGN",
    "BLOCK_M",
    "KERNEL_BLOCK_MS",
    "MAX_BLOCK_M",
    "FUSED_MAX_EXPERTS",
    "GROUPED_MAX_EXPERTS",
    "ALLOW_FALLBACK_ENV",
    "SKIP_VALUE_CHECKS_ENV",
    "LEGACY_ENV_NAMES",
    "env_flag",
    "PRECISIONS",
    "BACKENDS",
]
