"""The sm_90a FP8 kernels' machine code, checked on the build machine (no GPU needed), the instantiations for H or I =
64 (mod 128) among them: the FP8 grouped GEMMs, the L1 (with and without the clamp) and L2-dgrad kernels with their
SwiGLU epilogues (csrc/sm90/grouped_gemm_fp8.cu) and the quantizing producers (csrc/common/quantize_fp8.cu) are
compiled for sm_90a into cubins; every GEMM kernel must hold the e4m3 wgmma (QGMMA) and TMA loads (UTMALDG), and no kernel may touch
local memory (LDL / STL, a stack frame, LOCAL in the resource usage) or spill (ptxas -v). The checker is
tests/test_sm100_sass.py's, whose own test shows it sees such problems."""

import pytest

from conftest import REPO
from test_sm100_sass import _ptxas_by_function, _res_usage, _sass_by_function, _tools, findings

GEMM_SRC = REPO / "csrc" / "sm90" / "grouped_gemm_fp8.cu"
QUANT_SRC = REPO / "csrc" / "common" / "quantize_fp8.cu"
# Per GEMM kernel: four k32 e4m3 wgmma per 128-wide k-block, and the A, B (and A-scale) TMA loads.
GEMM_MIN_COUNTS = {"QGMMA": 4, "UTMALDG": 2}
GEMM_KERNELS = ("m_grouped_fp8_gemm_kernelILi128ELi5ELi1E", "m_grouped_fp8_gemm_kernelILi128ELi5ELi2E",
                "k_grouped_fp8_gemm_kernelILi4ELi0E", "k_grouped_fp8_gemm_kernelILi4ELi1E",
                "k_grouped_fp8_gemm_kernelILi5ELi2E", "m_grouped_fp8_swiglu_kernelILi5ELb0E",
                "m_grouped_fp8_swiglu_kernelILi5ELb1E",
                "m_grouped_fp8_swiglu_bwd_kernelILi3E", "m_grouped_fp8_swiglu_bwd_tail_kernelILi3E")
QUANT_KERNELS = ("dispatch_rows_fp8_kernel", "dispatch_rows_fp8_tail_kernel", "quantize_tokens_fp8_kernelILb0E",
                 "quantize_tokens_fp8_kernelILb1E")


def _compile(nvcc: str, src, out) -> str:
    import subprocess

    cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "-cubin", "-gencode", "arch=compute_90a,code=sm_90a",
           f"-I{REPO / 'csrc'}", "--expt-relaxed-constexpr", "-Xptxas", "-v", "-Xptxas", "-warn-spills", str(src),
           "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


@pytest.fixture(scope="module")
def sm90_cubins(tmp_path_factory):
    nvcc, cuobjdump = _tools()
    out = {}
    for name, src in (("gemm", GEMM_SRC), ("quant", QUANT_SRC)):
        cubin = tmp_path_factory.mktemp("sm90") / f"{name}.cubin"
        log = _compile(nvcc, src, cubin)
        out[name] = (_sass_by_function(cuobjdump, cubin), _res_usage(cuobjdump, cubin), _ptxas_by_function(log))
    return out


def test_fp8_gemm_kernels_have_wgmma_and_tma_and_no_local_memory(sm90_cubins):
    sass, usage, ptxas = sm90_cubins["gemm"]
    want = {k: GEMM_MIN_COUNTS for k in GEMM_KERNELS}
    problems = findings(sass, usage, ptxas, want)
    assert not problems, "\n".join(problems)
    assert len(sass) == len(GEMM_KERNELS), sorted(sass)


def test_fp8_quantizing_producers_have_no_local_memory(sm90_cubins):
    sass, usage, ptxas = sm90_cubins["quant"]
    problems = findings(sass, usage, ptxas, {k: {} for k in QUANT_KERNELS})
    assert not problems, "\n".join(problems)
    assert len(sass) == len(QUANT_KERNELS), sorted(sass)
