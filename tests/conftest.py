import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def pytest_report_header(config):
    import prime_kernels

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return [f"prime_kernels from {os.path.dirname(prime_kernels.__file__)}", f"build: {prime_kernels.build_info()}",
            f"torch {torch.__version__}, GPU: {gpu}"]


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 (Hopper) GPU")


def find_tool(name: str) -> str | None:
    """A CUDA binary tool: PATH, the nvcc's folder, or the copy that triton ships."""
    found = shutil.which(name)
    if found:
        return found
    try:
        nvcc = subprocess.run(["bash", str(REPO / "ci" / "find_nvcc.sh")], capture_output=True, text=True,
                              check=True, cwd=REPO).stdout.strip()
        cand = Path(nvcc).parent / name
        if cand.exists():
            return str(cand)
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    try:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    return None


HOST_CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
requires_host_cxx = pytest.mark.skipif(HOST_CXX is None, reason="no host C++ compiler (c++, g++, clang++) on PATH")


def run_host_check(name: str, tmp_path: Path, timeout: int = 300) -> None:
    """Compiles tests/cpp/<name>.cpp against csrc/ with the host C++ compiler alone (no CUDA; warnings are errors)
    and runs it: it must exit 0 and print "ok <cases>"."""
    exe = tmp_path / name
    build = subprocess.run([HOST_CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(REPO / "csrc"),
                            str(REPO / "tests" / "cpp" / f"{name}.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout[-2000:] + run.stderr[-2000:]


def run_python(code: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          cwd=cwd or str(Path(__file__).parent), timeout=300)
