"""prime-kernels-core installed beside upstream DeepGEMM (PyPI's deep-gemm 1.0.0 stands in for it): both
import in one process, each under its own name, and neither owns a file of the other.

The environment is made by ci/test.sh: a fresh venv with a CPU-only torch, upstream DeepGEMM installed
first (ci/install_upstream_deep_gemm.sh), then `pip install prime-kernels-core`. This machine has no GPU,
so upstream's GEMMs (JIT-compiled on a GPU at first call) are not run: the test imports upstream's whole
package (its jit and jit_kernels modules load on a CPU-only torch) and calls its host-side helpers."""

import json
import os
import subprocess

import pytest

PY = os.environ.get("PRIME_KERNELS_UPSTREAM_PYTHON")
pytestmark = pytest.mark.skipif(not PY, reason="set PRIME_KERNELS_UPSTREAM_PYTHON to a Python with upstream "
                                               "deep_gemm and prime-kernels-core installed (ci/test.sh does)")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-W", "error::RuntimeWarning", "-c", code], capture_output=True, text=True,
                          timeout=300, cwd="/")


def test_the_two_distributions_install_side_by_side_without_sharing_a_file():
    code = ("import importlib.metadata as m, json\n"
            "up = sorted(str(f) for f in m.files('deep_gemm'))\n"
            "core = sorted(str(f) for f in m.files('prime-kernels-core'))\n"
            "print(json.dumps({'up': up, 'core': core, 'up_version': m.version('deep_gemm'),\n"
            "                  'dropin': [d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] == 'prime-kernels']}))\n")
    out = _run(code)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["up_version"] == "1.0.0"
    assert not got["dropin"], "the deep_gemm drop-in must not be in this environment"
    assert "deep_gemm/__init__.py" in got["up"] and "prime_kernels/__init__.py" in got["core"]
    assert not set(got["up"]) & set(got["core"])
    assert not any(f.startswith("deep_gemm/") for f in got["core"])
    assert not any(f.startswith("prime_kernels/") for f in got["up"])


def test_upstream_deep_gemm_and_prime_kernels_work_in_one_process():
    code = r"""
import importlib.metadata as m, os, sys, warnings
import torch
import deep_gemm                       # upstream's package, with its jit and jit_kernels modules
import prime_kernels
from prime_kernels.mega import mega_moe

up_init = os.path.realpath(str(m.distribution("deep_gemm").locate_file("deep_gemm/__init__.py")))
assert os.path.realpath(deep_gemm.__file__) == up_init, (deep_gemm.__file__, up_init)
assert "deep_gemm.jit" in sys.modules and "deep_gemm.jit_kernels" in sys.modules
assert callable(deep_gemm.gemm_fp8_fp8_bf16_nt) and callable(deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous)
assert deep_gemm.ceil_div(300, 128) == 3
assert deep_gemm.get_m_alignment_for_contiguous_layout() > 0
# prime_kernels does not touch the deep_gemm name: upstream's module is still the one imported.
assert sys.modules["deep_gemm"] is deep_gemm and not hasattr(deep_gemm, "mega")
assert os.path.dirname(prime_kernels.__file__) != os.path.dirname(deep_gemm.__file__)

st = prime_kernels.status()
assert st["routing_plan.int32.sm90"] == "no CUDA device", st
idx = torch.randint(-1, 16, (100, 4), generator=torch.Generator().manual_seed(0))
p = prime_kernels.routing_plan(idx, 16, 32)
r = prime_kernels.routing_plan_reference(idx, 16, 32)
assert torch.equal(p.pool_src_route, r.pool_src_route)
g = torch.Generator().manual_seed(1)
x = torch.randn(8, 64, generator=g).bfloat16()
ids = torch.randint(0, 4, (8, 2), generator=g)
w = torch.rand(8, 2, generator=g)
y = mega_moe(x, ids, w, (torch.randn(4, 64, 64, generator=g) * 0.05).bfloat16(),
             (torch.randn(4, 64, 32, generator=g) * 0.05).bfloat16(), backend="reference")
assert y.shape == (8, 64) and torch.isfinite(y.float()).all()
print("OK", m.version("deep_gemm"), prime_kernels.__version__, prime_kernels.build_info()["cuda_archs"])
"""
    out = _run(code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("OK 1.0.0"), out.stdout
