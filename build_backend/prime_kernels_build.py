"""The PEP 517 backend of prime-kernels-core: scikit-build-core's, behind two additions.

* The arch list (PRIME_KERNELS_CUDA_ARCHS) is checked in get_requires_for_build_wheel, the first hook pip
  calls: pyproject.toml declares no static build requirements, so a bad value fails before pip downloads
  anything, with the accepted values (the rule of ci/cuda_archs.sh and CMakeLists.txt).
* The build requirements it returns are pinned by ci/constraints.txt: scikit-build-core (and the packages it
  imports), CMake, ninja, and pip, which CMakeLists.txt uses to fetch the torch wheel whose stable-ABI
  headers the shim compiles against (hash-checked against third_party/PROVENANCE.md) and, on a machine
  without nvcc, the CUDA compiler wheels.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCEPTED_ARCHS = ("90a", "100a", "103a", "100f")
BUILD_REQUIREMENTS = ("scikit-build-core", "packaging", "pathspec", "cmake", "ninja", "pip")


def arch_list_error(value: str | None) -> str | None:
    """Why PRIME_KERNELS_CUDA_ARCHS cannot be built, or None (unset means the default)."""
    if value is None:
        return None
    stripped = "".join(value.split())
    if not stripped:
        return "it is empty"
    for arch in stripped.split(";"):
        if not arch:
            return "it has an empty entry"
        if arch.removesuffix("-real") not in ACCEPTED_ARCHS:
            return f"'{arch}' cannot be built"
    return None


def _check_archs() -> None:
    value = os.environ.get("PRIME_KERNELS_CUDA_ARCHS")
    why = arch_list_error(value)
    if why is not None:
        print(f"error: PRIME_KERNELS_CUDA_ARCHS='{value}': {why}. Accepted values: {', '.join(ACCEPTED_ARCHS)} "
              f"(';'-separated, e.g. PRIME_KERNELS_CUDA_ARCHS=\"90a;100a\")", file=sys.stderr)
        raise SystemExit(2)


def pinned(names=BUILD_REQUIREMENTS) -> list[str]:
    pins = {}
    for line in (ROOT / "ci" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    missing = [n for n in names if n not in pins]
    if missing:
        raise RuntimeError(f"ci/constraints.txt pins no version of {', '.join(missing)}")
    return [f"{n}=={pins[n]}" for n in names]


def get_requires_for_build_wheel(config_settings=None):
    _check_archs()
    return pinned()


def get_requires_for_build_editable(config_settings=None):
    _check_archs()
    return pinned()


def get_requires_for_build_sdist(config_settings=None):
    return pinned(("scikit-build-core", "packaging", "pathspec"))


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    from scikit_build_core import build

    return build.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _check_archs()
    from scikit_build_core import build

    return build.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _check_archs()
    from scikit_build_core import build

    return build.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    from scikit_build_core import build

    return build.build_sdist(sdist_directory, config_settings)
