"""Fused Mixture-of-Experts layer (``prime_kernels.mega``).

Layer API (:mod:`prime_kernels.mega.api`): :func:`mega_moe` (autograd) and :class:`MegaMoE` (an ``nn.Module``).
DeepGEMM-shaped calls (:mod:`prime_kernels.mega.deepgemm_compat`): :func:`get_symm_buffer_for_mega_moe`,
:func:`transform_weights_for_mega_moe`, :func:`bf16_mega_moe`, :func:`bf16_mega_moe_backward`,
:func:`fp8_bwd_mega_moe_backward`, and the mxfp8 names (which report through ``prime_kernels.status()`` why they
cannot run yet). The FP8 call sequence (:mod:`prime_kernels.mega.staged_fp8`): :class:`FP8SymmBuffer`,
:class:`FP8Pools`, :func:`fp8_mega_moe`, :func:`column_quant`, :func:`fp8_mega_moe_backward`,
:func:`fp8_mega_moe_weight_grads`.

Semantics and every rounding point: :mod:`prime_kernels.mega.reference`. Backend selection and the call path every
entry point shares: :mod:`prime_kernels.mega._backend`. Alignment constants: :mod:`prime_kernels.mega.constants`.
"""

from . import constants
from ._backend import FusedKernelUnavailable, _fused_reason
from ..routing import RoutingPlan
from .api import MegaMoE, mega_moe
from .deepgemm_compat import (
    MegaMoEState,
    bf16_mega_moe,
    bf16_mega_moe_backward,
    deinterleave_l1,
    fp8_bwd_mega_moe_backward,
    fp8_fp4_mega_moe,
    fp8_mega_moe,
    fp8_mega_moe_backward,
    fp8_mega_moe_weight_grads,
    interleave_l1,
    mxfp8_mega_moe,
    mxfp8_mega_moe_backward,
    transform_weights_for_mega_moe,
)
from .buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from .deferred import DeferredWgrad
from .loopback import LoopbackGroup
from .staged_fp8 import (
    FP8BackwardBuffers,
    FP8Pools,
    FP8SymmBuffer,
    allocate_column_quant,
    column_quant,
    fp8_mega_moe_weight_grads_add,
    fp8_weights_for_mega_moe,
)
from .constants import BLOCK_M, FP8_ALIGN, FULL_TILE_ALIGN, HIDDEN_ALIGN, INTERMEDIATE_ALIGN

# Names the package top level (prime_kernels) re-exports, as upstream does.
__all__ = [
    "MegaMoE",
    "mega_moe",
    "SymmBuffer",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
    "bf16_mega_moe",
    "bf16_mega_moe_backward",
    "fp8_mega_moe",
    "fp8_mega_moe_backward",
    "fp8_mega_moe_weight_grads",
    "fp8_mega_moe_weight_grads_add",
    "FP8SymmBuffer",
    "FP8Pools",
    "FP8BackwardBuffers",
    "fp8_weights_for_mega_moe",
    "column_quant",
    "allocate_column_quant",
    "fp8_bwd_mega_moe_backward",
    "fp8_fp4_mega_moe",
    "mxfp8_mega_moe",
    "mxfp8_mega_moe_backward",
]
