"""The native sm_100a BF16 fused forward (csrc/sm100, C ABI ``pk_mega_moe_fwd_bf16_sm100``) as the self-tested
candidate of ``status()["mega_moe.bf16.sm100"]``.

No Blackwell GPU has run this kernel, so being built is not enough for it to be chosen: :func:`_register` (called when
the package loads the torch shim) makes it the candidate of :mod:`prime_kernels.mega._selftest`, which tests it only
where status says it could run (an sm_100 device and a build with a Blackwell arch; on Hopper, or in a 90a-only
build, status names what is missing and it never runs) and lets the fused backend use it there once it has matched
the grouped pipeline.

:func:`forward` is the sm90 fused forward's bf16 one-rank path (:func:`prime_kernels.mega._fused.forward`) with the
op swapped: the same routing plan, the same op arguments (``torch.ops.prime_kernels.mega_moe_fused_fwd_sm100`` shares
the sm90 op's checks and allocations in the shim, csrc/torch/shim.cpp), the same 8 outputs, so that the self-test
compares the kernel and nothing else.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _fused, _selftest
from ._validate import FusedKernelUnavailable
from .. import _status

STATUS_KEY = "mega_moe.bf16.sm100"
COMPILED_AS = "mega_moe_fwd_bf16_sm100"  # its name in the build's compiled-kernel list (CMakeLists.txt)
OP = "mega_moe_fused_fwd_sm100"
CANDIDATE_NAME = "native sm100a bf16 fused forward (csrc/sm100)"


def _check_device(x: Tensor) -> None:
    """Refuse anything but an sm_100 CUDA tensor before the routing plan is launched: elsewhere the op would only
    fail after the plan had run (the C ABI's own refusal)."""
    family = _status.family_of_device(x.device.index) if x.device.type == "cuda" else "no CUDA device"
    if family != "sm100":
        raise FusedKernelUnavailable(f"prime_kernels.mega: {STATUS_KEY}: the native sm100 forward runs on an sm_100 "
                                     f"device, x is on {x.device} ({family or 'neither sm_90 nor sm_100'})")


def forward(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, *,
            activation_clamp: float | None, num_experts: int, block_m: int, capacity: int, save_h: bool,
            keep_x_pool: bool, id_check=None, num_sms: int = 0) -> tuple:
    """:func:`prime_kernels.mega._fused.forward`'s contract for a bf16 layer on one rank: (y, h, expert_counts,
    expert_offsets, pool_src_route, pool_src_rank, route_to_pool, x_pool), x_pool [capacity, H] with ``keep_x_pool``
    else [0, H]. ``id_check`` gets the plan's count of out-of-range expert ids; ``num_sms`` bounds the persistent
    launches' grids (0: every SM)."""
    _check_device(x)
    return _fused.run_bf16(getattr(torch.ops.prime_kernels, OP), x, topk_idx, topk_weights, w13, w2,
                           activation_clamp=activation_clamp, num_experts=num_experts, block_m=block_m,
                           capacity=capacity, save_h=save_h, keep_x_pool=keep_x_pool, id_check=id_check,
                           num_sms=num_sms)


def _fake(x, pool_src_route, expert_offsets, w13, w2, top_k, save_h, clamp=0.0, keep_x_pool=False,
          route_to_pool=None, topk_weights=None, num_sms=0):
    """The op's output shapes (meta tensors, torch.compile tracing): s, h, o, x_pool, y as the shim allocates them."""
    M = pool_src_route.shape[0]
    T, H = x.shape
    inter = w13.shape[1] // 2
    combine = route_to_pool is not None
    return (x.new_empty((0 if combine else M, inter)), x.new_empty((M if save_h else 0, 2 * inter)),
            x.new_empty((M, H)), x.new_empty((M if keep_x_pool else 0, H)), x.new_empty((T if combine else 0, H)))


def candidate() -> _selftest.Candidate:
    return _selftest.Candidate(name=CANDIDATE_NAME, key=STATUS_KEY, compiled_as=COMPILED_AS, forward=forward)


def _register() -> None:
    """The op's fake kernel and the candidate's registration: once, when the package loads the shim."""
    torch.library.register_fake(f"prime_kernels::{OP}", _fake)
    _selftest.register(candidate())
