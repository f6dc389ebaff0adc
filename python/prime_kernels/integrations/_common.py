"""Helpers shared by the framework integrations."""

from __future__ import annotations

import torch

from ..mega.constants import BACKENDS


class UnsupportedLayerError(ValueError):
    """A layer cannot run on prime_kernels.mega (layout, activation, bias, parallelism, ...).

    The message names the layer and what is missing; nothing was switched when it is raised."""


#: The precisions an integration may pass to the layer: bf16, and the blockwise FP8 recipe of the Hopper kernels for
#: the forward and backward ("fp8") or the backward alone ("fp8_bwd"). The layer's "mxfp8" (a forward on sm_100 only)
#: is not offered until an integration is tested with it.
PRECISIONS = ("bf16", "fp8", "fp8_bwd")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"prime_kernels.integrations: backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_precision(precision: str) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"prime_kernels.integrations: precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def compute_dtypes(x_dtype: torch.dtype):
    """(io dtype, routing-weight dtype) that mega_moe wants for activations of ``x_dtype``.

    float64 stays float64 (the reference's exact mode, backend="reference" only); every other
    floating dtype computes in bfloat16 with fp32 routing weights, as the fused kernels do."""
    if x_dtype == torch.float64:
        return torch.float64, torch.float64
    return torch.bfloat16, torch.float32


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter or activation, which the adapters do not take)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return isinstance(t, DTensor)


def fail(where: str, what: str, exc=UnsupportedLayerError):
    raise exc(f"prime_kernels.integrations: {where}: {what}")
