"""prime-kernels: fused Mixture-of-Experts training kernels for NVIDIA Hopper and Blackwell.

``prime_kernels.status()`` says, for every kernel x precision x arch, "available" or why not. The import
name clashes with nothing upstream DeepGEMM ships, so both can be installed in one environment; the
``prime-kernels`` distribution adds a ``deep_gemm`` package that re-exports this one for existing call sites.
"""

from __future__ import annotations

from . import _lib
from ._status import status

try:
    from ._build_info import build_date, cuda_archs, git_sha, nvcc_version, version as __version__
except ImportError:  # running from a source tree that was never built
    __version__ = "0.0.0+unbuilt"
    cuda_archs, nvcc_version, git_sha, build_date = (), "", "", ""


def build_info() -> dict[str, object]:
    """Arches, nvcc version, git sha and build date of this build; "verified": for each built arch, status key ->
    how far that kernel was checked on hardware ("verified on an H200", "compiled only, never run on hardware", ...;
    kernels not written for the arch are left out), the table README.md's status table is made from."""
    from ._verification import by_arch

    return {"version": __version__, "cuda_archs": cuda_archs, "nvcc_version": nvcc_version,
            "git_sha": git_sha, "build_date": build_date, "verified": by_arch(cuda_archs)}


if _lib.load().shim_loaded:
    from . import routing as routing  # noqa: E402

    routing._register_fake()
    from . import grouped_gemm as _grouped_gemm  # noqa: E402

    _grouped_gemm._register()
    from . import second_b as _second_b  # noqa: E402

    _second_b._register()
    from . import combine as _combine  # noqa: E402

    _combine._register()
    from . import swiglu as _swiglu  # noqa: E402

    _swiglu._register()
    from . import quantize as _quantize  # noqa: E402

    _quantize._register()
from .grouped_gemm import (  # noqa: E402
    k_grouped_bf16_gemm_tn,
    k_grouped_fp8_gemm_tn,
    m_grouped_bf16_gemm_nn,
    m_grouped_bf16_gemm_nt,
    m_grouped_fp8_gemm_nt,
)
from .combine import combine, dispatch_rows  # noqa: E402
from .quantize import dispatch_rows_fp8, quantize_tokens_fp8  # noqa: E402
from .routing import RoutingPlan, pool_capacity, routing_plan, routing_plan_reference  # noqa: E402

from . import _watchdog  # noqa: E402
from ._watchdog import check_device_errors, peer_wait_timeout, set_peer_wait_timeout, set_wait_timeout, wait_timeout  # noqa: E402,E501
from . import mega  # noqa: E402
from .mega._selftest import selftest  # noqa: E402

if _lib.load().shim_loaded:
    from .mega import _fused_bwd  # noqa: E402

    _fused_bwd._register()
    from .mega import _native_sm100  # noqa: E402

    _native_sm100._register()  # a candidate only: it runs on a device once its self-test has passed there
    from . import swiglu_bwd_fp8 as _swiglu_bwd_fp8  # noqa: E402

    _swiglu_bwd_fp8._register()
    from . import swiglu_fwd_fp8 as _swiglu_fwd_fp8  # noqa: E402

    _swiglu_fwd_fp8._register()
from .mega import *  # noqa: E402,F401,F403  (upstream's top-level names: bf16_mega_moe, ...)

__all__ = list(mega.__all__) + ["status", "build_info", "selftest", "__version__", "RoutingPlan", "routing_plan", "routing_plan_reference",
           "pool_capacity", "combine", "dispatch_rows", "m_grouped_bf16_gemm_nt", "m_grouped_bf16_gemm_nn", "k_grouped_bf16_gemm_tn",
           "m_grouped_fp8_gemm_nt", "k_grouped_fp8_gemm_tn", "set_wait_timeout", "wait_timeout", "check_device_errors",
           "set_peer_wait_timeout", "peer_wait_timeout",
           "dispatch_rows_fp8", "quantize_tokens_fp8"]
