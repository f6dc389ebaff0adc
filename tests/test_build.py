"""The build: per-arch cubins (on a tiny probe target), exported symbols, no torch C++ ABI, release config."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prime_kernels
from conftest import REPO, find_tool

PKG_DIR = Path(prime_kernels.__file__).parent
CORE = PKG_DIR / "libprime_kernels_core.so"
SHIM = PKG_DIR / "libprime_kernels_torch.so"


def _nvcc() -> str | None:
    try:
        return subprocess.run(["bash", str(REPO / "ci" / "find_nvcc.sh")], capture_output=True, text=True,
                              check=True, cwd=REPO, timeout=600).stdout.strip()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None


def _cmake() -> str | None:
    """A CMake >= 3.31 (the project's minimum), or None."""
    exe = Path(sys.executable).parent / "cmake"
    path = str(exe) if exe.exists() else shutil.which("cmake")
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    return path if m and (int(m.group(1)), int(m.group(2))) >= (3, 31) else None


def _configure(build: Path, archs: str, extra=()) -> subprocess.CompletedProcess:
    nvcc = _nvcc()
    cmake = _cmake()
    if nvcc is None or cmake is None:
        pytest.skip("needs nvcc and cmake >= 3.31 (ci/find_nvcc.sh, pip install cmake)")
    ninja = Path(sys.executable).parent / "ninja"
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja.exists() else []
    return subprocess.run([cmake, "-S", str(REPO), "-B", str(build), *gen, f"-DCMAKE_CUDA_COMPILER={nvcc}",
                           f"-DPRIME_KERNELS_CUDA_ARCHS={archs}", "-DPRIME_KERNELS_PROBE_ONLY=ON", *extra],
                          capture_output=True, text=True, timeout=600)


def _same_arches(listed: list[str], requested: list[str]) -> bool:
    """Older cuobjdump builds name an sm_90a cubin "sm_90" (and every tool names 100f "sm_100"):
    compare the numbers, and the suffix too wherever the tool printed one."""
    num = lambda a: re.sub(r"[af]$", "", a)  # noqa: E731
    if sorted({num(a) for a in listed}) != sorted({num(a) for a in requested}):
        return False
    want = {num(a): a for a in requested}
    return all(a == num(a) or a == want[num(a)] for a in listed)


def _list_elf(lib: Path) -> list[str]:
    """Sorted distinct arches of the cubins in `lib` (one cubin per translation unit and arch)."""
    tool = find_tool("cuobjdump")
    if tool is None:
        pytest.skip("needs cuobjdump (CUDA toolkit, triton's copy, or pip install nvidia-cuda-cuobjdump)")
    out = subprocess.run([tool, "--list-elf", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted(set(re.findall(r"\.(sm_\d+[af]?)\.cubin", out)))


def _sass_functions(lib: Path, arch: str) -> set[str]:
    tool = find_tool("cuobjdump")
    out = subprocess.run([tool, "-sass", "-arch", arch, str(lib)], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"Function : (\w+)", out))


@pytest.mark.parametrize("archs,expected", [("90a", ["sm_90a"]), ("90a;100a", ["sm_100a", "sm_90a"])])
def test_probe_build_holds_exactly_the_requested_cubins(tmp_path, archs, expected):
    cfg = _configure(tmp_path, archs)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    build = subprocess.run([_cmake(), "--build", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    lib = tmp_path / "libpk_probe.so"
    assert _same_arches(_list_elf(lib), expected), _list_elf(lib)
    # Each arch group only in its own cubin; arch-neutral code in every cubin.
    sm90 = _sass_functions(lib, "sm_90a")
    assert {"pk_probe_common_kernel", "pk_probe_sm90_kernel"} <= sm90 and "pk_probe_sm100_kernel" not in sm90
    if "sm_100a" in expected:
        sm100 = _sass_functions(lib, "sm_100a")
        assert {"pk_probe_common_kernel", "pk_probe_sm100_kernel"} <= sm100
        assert "pk_probe_sm90_kernel" not in sm100


@pytest.mark.parametrize("bad", ["89", "sm_90", "120a"])
def test_unknown_arch_fails_at_configure(tmp_path, bad):
    cfg = _configure(tmp_path, bad)
    assert cfg.returncode != 0
    err = " ".join(cfg.stderr.split())  # CMake wraps its messages
    assert "Accepted values: 90a" in err and bad in err


@pytest.mark.parametrize("bad", ["", " ", "90a;;100a", "90a;", "90a,100a", "bogus"])
def test_empty_or_malformed_arch_list_fails_before_the_compiler_is_looked_for(tmp_path, bad):
    """Needs only CMake: the arch list is checked before project(), so no nvcc is involved (the nvcc
    given does not exist and must not be reached)."""
    cmake = _cmake()
    if cmake is None:
        pytest.skip("needs cmake >= 3.31")
    cfg = subprocess.run([cmake, "-S", str(REPO), "-B", str(tmp_path), "-DCMAKE_CUDA_COMPILER=/nonexistent/nvcc",
                          f"-DPRIME_KERNELS_CUDA_ARCHS={bad}", "-DPRIME_KERNELS_PROBE_ONLY=ON"],
                         capture_output=True, text=True, timeout=120)
    assert cfg.returncode != 0
    err = " ".join(cfg.stderr.split())
    assert "PRIME_KERNELS_CUDA_ARCHS" in err and "Accepted values: 90a (Hopper), 100a" in err, err
    assert "/nonexistent/nvcc" not in err, err


@pytest.mark.parametrize("bad", ["", " ", "90a;;100a", ";90a", "sm_90", "bogus"])
def test_build_script_rejects_a_bad_arch_list_before_any_download(tmp_path, bad):
    """ci/build_wheel.sh checks the list before it looks for nvcc, makes its venv or installs anything:
    every tool that could download is replaced by one that leaves a mark, and no mark may appear."""
    fake = tmp_path / "bin"
    fake.mkdir()
    mark = tmp_path / "called"
    for tool in ("python3", "python", "pip", "pip3", "nvcc", "curl", "wget", "git", "cmake"):
        (fake / tool).write_text(f"#!/bin/sh\necho {tool} >> '{mark}'\nexit 1\n")
        (fake / tool).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path), "PRIME_KERNELS_CUDA_ARCHS": bad,
           "PRIME_KERNELS_BUILD_VENV": str(tmp_path / "venv"), "CUDACXX": str(fake / "nvcc")}
    out = subprocess.run(["bash", str(REPO / "ci" / "build_wheel.sh")], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode != 0
    assert "Accepted values: 90a, 100a, 103a, 100f" in out.stdout + out.stderr, out.stdout + out.stderr
    assert not mark.exists(), mark.read_text()
    assert not (tmp_path / "venv").exists()


def test_installed_core_holds_the_built_arches():
    want = sorted(f"sm_{a}" for a in prime_kernels.build_info()["cuda_archs"])
    assert _same_arches(_list_elf(CORE), want), (_list_elf(CORE), want)


def _dynsyms(lib: Path, defined: bool) -> list[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, str(lib)], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def _needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"NEEDED.*\[(.+)\]", out)


def test_core_exports_only_the_c_api_and_links_cudart_statically():
    exported = [s for s in _dynsyms(CORE, True) if s not in ("_init", "_fini")]
    assert exported and all(s.startswith("pk_") for s in exported), exported
    needed = _needed(CORE)
    assert not any("cudart" in n or "python" in n or "torch" in n or n.startswith("libcuda") for n in needed), needed


def test_no_mangled_torch_symbols_and_no_libpython():
    for lib in (CORE, SHIM):
        undefined = _dynsyms(lib, False)
        demangled = subprocess.run(["c++filt"], input="\n".join(undefined), capture_output=True, text=True).stdout
        assert not re.search(r"\b(at|c10|torch)::", demangled), lib
        assert not any("python" in n for n in _needed(lib)), lib
        assert not any(s.startswith("Py") for s in undefined), lib
    assert "libtorch_cuda.so" not in _needed(SHIM), "the shim must load under a CPU-only torch"


def test_cibuildwheel_identifiers():
    exe = Path(sys.executable).parent / "cibuildwheel"
    if not exe.exists():
        pytest.skip("needs cibuildwheel (pip install cibuildwheel==4.3.5)")
    out = subprocess.run([str(exe), "--print-build-identifiers", "--platform", "linux", str(REPO)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cp312-manylinux_x86_64"]


def test_probe_builds_with_the_pypi_cuda_compiler(tmp_path):
    """The fresh-machine path: nvcc from PyPI wheels (ci/install_cuda_from_pypi.sh), no system toolkit."""
    if os.environ.get("PRIME_KERNELS_TEST_PYPI_NVCC", "1") != "1":
        pytest.skip("PRIME_KERNELS_TEST_PYPI_NVCC=0")
    prefix = tmp_path / "cuda"
    inst = subprocess.run(["bash", str(REPO / "ci" / "install_cuda_from_pypi.sh"), str(prefix)],
                          capture_output=True, text=True, timeout=600)
    if inst.returncode != 0:
        pytest.skip(f"PyPI unreachable or install failed: {inst.stderr[-300:]}")
    nvcc = inst.stdout.strip().splitlines()[-1]
    cmake = _cmake()
    if cmake is None:
        pytest.skip("needs cmake >= 3.31")
    build = tmp_path / "build"
    cfg = subprocess.run([cmake, "-S", str(REPO), "-B", str(build), f"-DCMAKE_CUDA_COMPILER={nvcc}",
                          "-DPRIME_KERNELS_CUDA_ARCHS=90a", "-DPRIME_KERNELS_PROBE_ONLY=ON"],
                         capture_output=True, text=True, timeout=600)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    assert "NVIDIA 13.0" in cfg.stdout
    out = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _same_arches(_list_elf(build / "libpk_probe.so"), ["sm_90a"])


@pytest.mark.parametrize("name", ["prime-kernels-core", "prime-kernels"])
def test_installed_metadata_has_the_license_and_project_urls(name):
    dist = importlib.metadata.distribution(name)
    assert dist.metadata["License-Expression"] == "MIT"
    assert "LICENSE" in dist.metadata.get_all("License-File")
    licence = [f for f in dist.files if f.name == "LICENSE"]
    assert licence and "MIT License" in licence[0].read_text()
    urls = dict(u.split(", ", 1) for u in dist.metadata.get_all("Project-URL"))
    assert {"Homepage", "Source", "Issues"} <= urls.keys(), urls


def test_a_failed_build_leaves_no_wheel_behind(tmp_path):
    """A copy of ci/ in an empty tree whose build fails at its first step (no nvcc, no python3): the
    wheel a previous build left in wheelhouse/ and its dist/ must be gone."""
    shutil.copytree(REPO / "ci", tmp_path / "ci")
    (tmp_path / "wheelhouse").mkdir()
    old = [tmp_path / "wheelhouse" / "prime_kernels_core-0.0.1-py3-none-manylinux_2_28_x86_64.whl",
           tmp_path / "wheelhouse" / "prime_kernels-0.0.1-py3-none-any.whl"]
    for f in old:
        f.write_bytes(b"old")
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "prime_kernels_core-0.0.1-py3-none-linux_x86_64.whl").write_bytes(b"old")
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("python3", "nvcc"):
        (fake / tool).write_text("#!/bin/sh\nexit 1\n")
        (fake / tool).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path), "PRIME_KERNELS_CUDA_ARCHS": "90a",
           "CUDACXX": str(fake / "nvcc")}
    out = subprocess.run(["bash", str(tmp_path / "ci" / "build_wheel.sh")], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode != 0, out.stdout + out.stderr
    assert not any(f.exists() for f in old) and not (tmp_path / "dist").exists()


def test_provenance_check_fails_on_a_mismatch_and_passes_on_a_match(tmp_path):
    script = str(REPO / "ci" / "check_provenance.sh")
    listed = tmp_path / "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    listed.write_bytes(b"not the real wheel")
    bad = subprocess.run(["bash", script, str(listed)], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "sha256" in bad.stderr, bad.stderr
    unlisted = tmp_path / "other-1.0-py3-none-any.whl"
    unlisted.write_bytes(b"x")
    assert subprocess.run(["bash", script, str(unlisted)], capture_output=True, timeout=30).returncode != 0
    import hashlib
    table = tmp_path / "PROVENANCE.md"
    table.write_text(f"| x | 1 | {listed.name} | {hashlib.sha256(listed.read_bytes()).hexdigest()} | MIT | - |\n")
    good = subprocess.run(["bash", script, str(listed)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PRIME_KERNELS_PROVENANCE": str(table)})
    assert good.returncode == 0, good.stderr
    # The build installs torch with every listed wheel hash; the pinned version is the listed one.
    hashes = subprocess.run(["bash", script, "--hashes", "torch"], capture_output=True, text=True, check=True).stdout
    assert hashes.count("--hash=sha256:") >= 2
    pins = (REPO / "ci" / "constraints.txt").read_text()
    assert "torch==2.14.1" in pins.splitlines() and "torch-2.14.1-" in (REPO / "third_party" / "PROVENANCE.md").read_text()


def _backend():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prime_kernels_build", REPO / "build_backend" / "prime_kernels_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("value", [None, "90a", "90a;100a", " 90a ; 100a-real ", "100f;103a", "", " ", "90a;;100a",
                                   "90a;", ";90a", "sm_90", "90a,100a", "bogus", "100a-real-real"])
def test_the_sdist_backend_and_the_build_script_agree_on_arch_lists(value):
    ok_backend = _backend().arch_list_error(value) is None
    script = 'source ci/cuda_archs.sh && check_archs "$1"' if value is not None else "true"
    ok_script = subprocess.run(["bash", "-c", script, "_", value or ""], cwd=REPO, capture_output=True,
                               timeout=30).returncode == 0
    assert ok_backend == ok_script, (value, ok_backend, ok_script)


def test_the_sdist_backend_pins_its_build_requirements_from_the_constraints_file():
    pins = {line.split("==")[0]: line for line in (REPO / "ci" / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    reqs = _backend().get_requires_for_build_wheel()
    assert {r.split("==")[0] for r in reqs} >= {"scikit-build-core", "cmake", "ninja", "pip"}
    assert all(pins[r.split("==")[0]] == r for r in reqs), reqs
    import tomllib

    system = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    assert system["requires"] == [] and system["build-backend"] == "prime_kernels_build"


@pytest.mark.parametrize("bad", ["", "90a;;100a", "sm_90", "bogus"])
def test_an_isolated_build_rejects_a_bad_arch_list_before_any_download(tmp_path, bad):
    """pip with build isolation on and nothing to download from (no index, an empty find-links folder): the
    first hook pip calls must fail with the accepted values. Had pip needed a build requirement first, it
    would fail with "No matching distribution" instead."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "PRIME_KERNELS_CUDA_ARCHS": bad, "PIP_FIND_LINKS": str(empty), "PIP_NO_INDEX": "1",
           "PIP_CONFIG_FILE": os.devnull}
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "w"), str(REPO)],
                         capture_output=True, text=True, env=env, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "Accepted values: 90a, 100a, 103a, 100f" in text, text[-2000:]
    assert "No matching distribution" not in text, text[-2000:]
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())
