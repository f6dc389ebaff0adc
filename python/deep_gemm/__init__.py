"""prime-kernels: fused Mixture-of-Experts training kernels for NVIDIA Hopper and Blackwell.

``deep_gemm.status()`` says, for every kernel x precision x arch, "available" or why not.
"""

from __future__ import annotations

import warnings

from . import _lib
from ._status import status

try:
    from ._build_info import build_date, cuda_archs, git_sha, nvcc_version, version as __version__
except ImportError:  # running from a source tree that was never built
    __version__ = "0.0.0+unbuilt"
    cuda_archs, nvcc_version, git_sha, build_date = (), "", "", ""


def build_info() -> dict[str, object]:
    """Arches, nvcc version, git sha and build date of this build."""
    return {"version": __version__, "cuda_archs": cuda_archs, "nvcc_version": nvcc_version,
            "git_sha": git_sha, "build_date": build_date}


def _warn_if_upstream_installed() -> None:
    """prime-kernels replaces the import package of DeepSeek's DeepGEMM; two owners of one package
    directory overwrite each other's files, so say so once."""
    try:
        from importlib.metadata import distributions
    except ImportError:
        return
    ours = {"prime-kernels", "prime_kernels"}
    for dist in distributions():
        name = (dist.metadata.get("Name") or "").strip()
        if name.lower().replace("_", "-") in ours:
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        files = [str(f) for f in (dist.files or [])[:200]]
        if name.lower().replace("_", "-") == "deep-gemm" or "deep_gemm" in top or any(
                f.startswith("deep_gemm/") for f in files):
            warnings.warn(
                f"deep_gemm: both prime-kernels and {name} {dist.version} provide the import package "
                f"'deep_gemm'; whichever was installed last owns its files. Uninstall one "
                f"(pip uninstall {name}).", RuntimeWarning, stacklevel=3)
            return


_warn_if_upstream_installed()

if _lib.load().shim_loaded:
    from . import routing as routing  # noqa: E402

    routing._register_fake()
    from . import grouped_gemm as _grouped_gemm  # noqa: E402

    _grouped_gemm._register()
    from . import combine as _combine  # noqa: E402

    _combine._register()
    from . import swiglu as _swiglu  # noqa: E402

    _swiglu._register()
from .grouped_gemm import (  # noqa: E402
    k_grouped_bf16_gemm_tn,
    m_grouped_bf16_gemm_nn,
    m_grouped_bf16_gemm_nt,
)
from .combine import combine  # noqa: E402
from .routing import RoutingPlan, pool_capacity, routing_plan, routing_plan_reference  # noqa: E402

from . import mega  # noqa: E402
from .mega import *  # noqa: E402,F401,F403  (upstream's top-level names: bf16_mega_moe, ...)

__all__ = list(mega.__all__) + ["status", "build_info", "__version__", "RoutingPlan", "routing_plan", "routing_plan_reference",
           "pool_capacity", "combine", "m_grouped_bf16_gemm_nt", "m_grouped_bf16_gemm_nn", "k_grouped_bf16_gemm_tn"]
