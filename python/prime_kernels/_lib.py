"""Loading the two native libraries: the torch-free core (ctypes) and the torch shim (torch.ops)."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
CORE_NAME = "libprime_kernels_core.so"
SHIM_NAME = "libprime_kernels_torch.so"
ABI_VERSION = 11  # must equal PK_ABI_VERSION in csrc/api/prime_kernels_api.h
MIN_TORCH = (2, 10)


@dataclass(frozen=True)
class LoadResult:
    core: ctypes.CDLL | None
    shim_loaded: bool
    reason: str | None  # why something could not be loaded; None when both are in


def torch_version() -> tuple[int, int]:
    import torch

    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def torch_too_old_reason() -> str | None:
    try:
        major, minor = torch_version()
    except Exception as exc:  # torch missing or unparsable
        return f"torch could not be imported ({exc}): pip install 'torch>=2.10'"
    if (major, minor) < MIN_TORCH:
        import torch

        return f"torch {torch.__version__} is older than 2.10: pip install 'torch>=2.10'"
    return None


def _declare(core: ctypes.CDLL) -> None:
    c = ctypes
    core.pk_abi_version.restype = c.c_int
    core.pk_last_error.restype = c.c_char_p
    core.pk_built_archs.restype = c.c_char_p
    core.pk_compiled_kernels.restype = c.c_char_p
    core.pk_check_device.argtypes = [c.c_int]
    core.pk_check_device.restype = c.c_int
    core.pk_routing_plan_pool_capacity.argtypes = [c.c_int64] * 4
    core.pk_routing_plan_pool_capacity.restype = c.c_int64


@functools.lru_cache(maxsize=None)
def load() -> LoadResult:
    core_path = os.path.join(_HERE, CORE_NAME)
    if not os.path.exists(core_path):
        return LoadResult(None, False, f"{core_path} is missing: the install is damaged or was not built; "
                                       "reinstall prime-kernels-core (pip install --force-reinstall prime-kernels-core)")
    try:
        core = ctypes.CDLL(core_path)
        _declare(core)
    except OSError as exc:
        return LoadResult(None, False, f"could not load {core_path}: {exc}")
    if core.pk_abi_version() != ABI_VERSION:
        return LoadResult(None, False, f"{CORE_NAME} has ABI {core.pk_abi_version()}, the Python package expects "
                                       f"{ABI_VERSION}: mixed installs; reinstall prime-kernels-core")
    old = torch_too_old_reason()
    if old is not None:
        return LoadResult(core, False, old)
    shim_path = os.path.join(_HERE, SHIM_NAME)
    if not os.path.exists(shim_path):
        return LoadResult(core, False, f"{shim_path} is missing: the install is damaged; reinstall prime-kernels-core")
    try:
        import torch

        torch.ops.load_library(shim_path)
    except Exception as exc:
        return LoadResult(core, False, f"could not load {shim_path}: {exc}")
    return LoadResult(core, True, None)


def built_archs() -> tuple[str, ...]:
    res = load()
    if res.core is None:
        return ()
    return tuple(a for a in res.core.pk_built_archs().decode().split(",") if a)


def compiled_kernels() -> frozenset[tuple[str, str]]:
    """(kernel, arch) pairs compiled into the core."""
    res = load()
    if res.core is None:
        return frozenset()
    pairs = (p.split(":") for p in res.core.pk_compiled_kernels().decode().split(",") if p)
    return frozenset((k, a) for k, a in pairs)
