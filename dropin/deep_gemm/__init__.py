"""``deep_gemm`` from the ``prime-kernels`` distribution: prime_kernels' Mega MoE training API under the
import name that existing DeepGEMM call sites use.

Every name is the prime_kernels object itself (``deep_gemm.MegaMoE is prime_kernels.MegaMoE``), and
``deep_gemm.<sub>`` is the module ``prime_kernels.<sub>`` (``deep_gemm.mega``,
``deep_gemm.integrations.transformers``, ...), so state such as registered ops, staging buffers and caches is
shared, never duplicated. A name that prime_kernels lacks (upstream DeepGEMM's FP8 GEMMs, JIT helpers, ...)
raises an AttributeError that says how to have both: upstream DeepGEMM for those, ``import prime_kernels``
beside it for Mega MoE.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

import prime_kernels as _impl
from prime_kernels import *  # noqa: F401,F403
from prime_kernels import __all__, __version__  # noqa: F401

_IMPL = _impl.__name__


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``deep_gemm.X.Y`` to the module object ``prime_kernels.X.Y`` (imported if needed)."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        target_name = _IMPL + fullname[len(__name__):]
        try:
            found = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:
            return None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self,
                                              is_package=found.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(_IMPL + spec.name[len(__name__):])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import machinery stamps the alias's spec on the module it got from create_module; that module
        # is prime_kernels' own, so it gets its own spec back (reload, pickling by module path, tracebacks).
        name = module.__spec__.name
        module.__spec__ = self._own_specs.pop(name, module.__spec__)


if not any(isinstance(f, _SubmoduleAlias) for f in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleAlias())


def _upstream_only(name: str) -> AttributeError:
    return AttributeError(
        f"deep_gemm.{name}: this deep_gemm is the prime-kernels drop-in (pip package prime-kernels), which "
        f"re-exports prime_kernels' Mega MoE training API and has no {name!r}. If {name!r} is a function of "
        f"upstream DeepGEMM (its FP8/BF16 GEMMs, layout and JIT helpers), install upstream DeepGEMM in place "
        f"of the drop-in (pip uninstall prime-kernels) and use prime-kernels beside it as `import prime_kernels` "
        f"(pip install prime-kernels-core): the two import names do not clash.")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return getattr(_impl, name)
    except AttributeError:
        raise _upstream_only(name) from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(_impl)))


def _warn_if_upstream_installed() -> None:
    """Upstream DeepGEMM (distribution ``deep_gemm``) owns the same package directory: two owners
    overwrite each other's files, so say so once. Looks for that distribution's metadata folder on sys.path
    (a glob per entry: reading every installed distribution's metadata would add ~0.2 s to the import)."""
    import glob
    import os
    import warnings

    for base in sys.path:
        if not base or not os.path.isdir(base):
            continue
        for meta in glob.glob(os.path.join(base, "deep_gemm-*.dist-info")) + glob.glob(
                os.path.join(base, "deep_gemm-*.egg-info")):
            version = os.path.splitext(os.path.basename(meta))[0].split("-", 1)[1]
            warnings.warn(
                f"deep_gemm: both prime-kernels (the deep_gemm drop-in) and upstream deep_gemm {version} provide "
                f"the import package 'deep_gemm'; whichever was installed last owns its files. To use both, "
                f"uninstall the drop-in (pip uninstall prime-kernels), reinstall upstream deep_gemm, and import "
                f"prime-kernels as prime_kernels (pip install prime-kernels-core).", RuntimeWarning, stacklevel=3)
            return


_warn_if_upstream_installed()
