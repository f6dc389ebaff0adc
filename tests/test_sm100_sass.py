"""The sm_100a fused forward's machine code, checked on the build machine (no GPU needed; no Blackwell GPU exists for
this project, so this is all the checking its kernels get before the self-test on a device).

csrc/sm100/mega_moe_sm100.cu is compiled for sm_100a into a cubin; its kernels must be there, the GEMM kernels with
the tcgen05 instruction families (UTCHMMA: tcgen05.mma kind::f16; UTCBAR: tcgen05.commit; LDTM: tcgen05.ld;
UTCATOMSWS: the tensor-memory allocator), TMA loads (UTMALDG) and the epilogue's TMA stores (UTMASTG); no kernel may touch local memory (LDL / STL, a
stack frame, LOCAL in the resource usage) or spill (ptxas -v). The same checks run on two small kernels built to
break them, so a checker that can no longer see a problem fails too."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, find_tool

SRC = REPO / "csrc" / "sm100" / "mega_moe_sm100.cu"
GEMM_KERNELS = ("mega_moe_fwd_sm100_kernelILi1E", "mega_moe_fwd_sm100_kernelILi2E")
DISPATCH_KERNEL = "mega_dispatch_pool_sm100_kernel"
# Per GEMM kernel: the least count of each instruction family (four K = 16 MMAs unrolled per stage, a commit per
# stage and one per accumulator stage, A and B loads, at least one tensor-memory load, a TMA store of the staged
# epilogue box).
GEMM_MIN_COUNTS = {"UTCHMMA": 4, "UTCBAR": 2, "LDTM": 1, "UTMALDG": 2, "UTCATOMSWS": 1, "UTMASTG": 1}
# The L1 epilogue stores s alone, or s with the gate and up halves of h: at least two store sites.
L1_MIN_COUNTS = {**GEMM_MIN_COUNTS, "UTMASTG": 2}
LOCAL_MEMORY_OPS = ("LDL", "STL")


def _nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def _tools() -> tuple[str, str]:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc (CUDA >= 12.8 for sm_100a): not on PATH, CUDACXX or /usr/local/cuda")
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("needs cuobjdump (CUDA toolkit, triton's copy, or pip install nvidia-cuda-cuobjdump)")
    return nvcc, cuobjdump


def _compile(nvcc: str, src: Path, out: Path) -> str:
    """Compiles src to an sm_100a cubin; returns ptxas's -v report."""
    cmd = [nvcc, "-std=c++17", "-cubin", "-gencode", "arch=compute_100a,code=sm_100a", f"-I{REPO / 'csrc'}",
           "--expt-relaxed-constexpr", "-Xptxas", "-v", "-Xptxas", "-warn-spills", str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


def _sass_by_function(cuobjdump: str, cubin: Path) -> dict[str, str]:
    out = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    parts = re.split(r"\n\s*Function : (\S+)\n", out)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _res_usage(cuobjdump: str, cubin: Path) -> dict[str, dict[str, int]]:
    out = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = {}
    for name, fields in re.findall(r"Function (\S+):\s*\n\s*(.*)", out):
        usage[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", fields)}
    return usage


def _ptxas_by_function(log: str) -> dict[str, str]:
    """ptxas -v's 'Function properties' line (stack, spills) and 'Used' line (registers) per function."""
    found = {}
    for name, props, used in re.findall(
            r"Function properties for (\S+)\n\s*(.*?)\n.*?ptxas info\s*: (Used [^\n]*)", log, flags=re.S):
        found[name] = props + "; " + used
    return found


def _opcodes(sass: str) -> list[str]:
    """The opcode (without its modifiers or predicate) of every instruction."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return ops


def findings(sass: dict[str, str], usage: dict[str, dict[str, int]], ptxas: dict[str, str],
             want: dict[str, dict[str, int]]) -> list[str]:
    """Everything wrong with the kernels: want maps a substring of a function's name to the least count of each
    instruction family it must contain; every function is checked for local memory and spills."""
    problems = []
    for key, mins in want.items():
        names = [n for n in sass if key in n]
        if len(names) != 1:
            problems.append(f"{key}: {len(names)} matching functions in the cubin ({sorted(sass)})")
            continue
        ops = _opcodes(sass[names[0]])
        for family, least in mins.items():
            n = sum(1 for op in ops if op == family)
            if n < least:
                problems.append(f"{key}: {n} {family} (want >= {least})")
    for name, text in sass.items():
        ops = _opcodes(text)
        for op in LOCAL_MEMORY_OPS:
            if op in ops:
                problems.append(f"{name}: {ops.count(op)} {op} (local memory)")
        u = usage.get(name)
        if u is None:
            problems.append(f"{name}: no resource usage reported")
        elif u.get("STACK", 0) != 0 or u.get("LOCAL", 0) != 0:
            problems.append(f"{name}: STACK {u.get('STACK')} LOCAL {u.get('LOCAL')}")
        p = ptxas.get(name)
        if p is None:
            problems.append(f"{name}: no ptxas -v report")
        elif not re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", p):
            problems.append(f"{name}: ptxas: {p}")
    return problems


@pytest.fixture(scope="module")
def sm100_cubin(tmp_path_factory):
    nvcc, cuobjdump = _tools()
    cubin = tmp_path_factory.mktemp("sm100") / "mega_moe_sm100.cubin"
    log = _compile(nvcc, SRC, cubin)
    return _sass_by_function(cuobjdump, cubin), _res_usage(cuobjdump, cubin), _ptxas_by_function(log)


def test_fused_forward_sass_has_tcgen05_and_tma_and_no_local_memory(sm100_cubin):
    sass, usage, ptxas = sm100_cubin
    want = {GEMM_KERNELS[0]: L1_MIN_COUNTS, GEMM_KERNELS[1]: GEMM_MIN_COUNTS}
    want[DISPATCH_KERNEL] = {}
    problems = findings(sass, usage, ptxas, want)
    assert not problems, "\n".join(problems)
    assert len(sass) == 3, sorted(sass)  # the dispatch (run only when x_pool is kept) and the two GEMM phases
    # The L1 producer reads its A rows from x by TMA gather4 (four token rows per instruction), not from x_pool.
    l1 = next(n for n in sass if GEMM_KERNELS[0] in n)
    assert re.search(r"UTMALDG\.2D\.GATHER4\b", sass[l1]), "the L1 kernel has no UTMALDG.2D.GATHER4"
    for name in sass:
        print(name, ptxas[name], {f: _opcodes(sass[name]).count(f) for f in GEMM_MIN_COUNTS})


# A kernel with a stack array indexed at run time (local memory) and no tcgen05 at all: every check must fire.
_BAD_SRC = r"""
extern "C" __global__ void pk_bad_kernel(const int* idx, float* out) {
  float buf[512];
  for (int i = 0; i < 512; ++i) buf[idx[i] & 511] = out[i];
  out[threadIdx.x] = buf[idx[threadIdx.x] & 511];
}
"""


def test_the_checks_catch_local_memory_and_missing_tcgen05(tmp_path):
    nvcc, cuobjdump = _tools()
    src = tmp_path / "bad.cu"
    src.write_text(_BAD_SRC)
    cubin = tmp_path / "bad.cubin"
    log = _compile(nvcc, src, cubin)
    problems = findings(_sass_by_function(cuobjdump, cubin), _res_usage(cuobjdump, cubin), _ptxas_by_function(log),
                        {"pk_bad_kernel": GEMM_MIN_COUNTS})
    text = "\n".join(problems)
    for expected in ("UTCHMMA", "UTMALDG", "UTMASTG", "LDTM", "STACK", "ptxas"):
        assert expected in text, text
    assert "LDL" in text or "STL" in text, text


# The gather4 wrapper on its own, in the smallest kernel that uses it: the L1 kernel's check above could pass on
# some other gather, this one pins the wrapper's encoding.
_GATHER4_SRC = r"""
#include <cuda.h>
#include "sm100/ptx_sm100.cuh"
using namespace prime_kernels::sm100;
extern "C" __global__ void pk_gather4_probe(const __grid_constant__ CUtensorMap m, int* out) {
  __shared__ __align__(1024) uint8_t buf[4 * 128];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    ptx::mbar_init(&bar, 1);
    ptx::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::mbar_arrive_expect_tx(&bar, sizeof(buf));
    ptx::tma_gather4(buf, &m, &bar, 0, out[1], out[2], out[3], out[4]);
    ptx::mbar_wait(&bar, 0);
    out[0] = buf[3];
  }
}
"""


def test_gather4_wrapper_assembles_to_the_tma_gather(tmp_path):
    nvcc, cuobjdump = _tools()
    src = tmp_path / "gather4.cu"
    src.write_text(_GATHER4_SRC)
    cubin = tmp_path / "gather4.cubin"
    _compile(nvcc, src, cubin)
    sass = _sass_by_function(cuobjdump, cubin)["pk_gather4_probe"]
    assert re.search(r"UTMALDG\.2D\.GATHER4\b", sass), sass
