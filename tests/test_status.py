"""status(), build info, error reasons, and the import-time guards."""

import os
import shutil
from pathlib import Path

import pytest
import torch

import prime_kernels
from conftest import run_python

PKG_DIR = Path(prime_kernels.__file__).parent


def test_every_kernel_has_a_reason_or_is_available():
    st = prime_kernels.status()
    expected = {"routing_plan.int32.sm90", "routing_plan.int32.sm100", "m_grouped_gemm_nt.bf16.sm90",
                "m_grouped_gemm_nn.bf16.sm90", "k_grouped_gemm_tn.bf16.sm90", "mega_moe.bf16.sm90",
                "mega_moe_backward.bf16.sm90", "mega_moe.fp8.sm90", "mega_moe.fp8_bwd.sm90",
                "mega_moe.mxfp8.sm100"}
    assert expected <= set(st)
    for key, why in st.items():
        assert isinstance(why, str) and why, key
    if not torch.cuda.is_available():
        assert st["routing_plan.int32.sm90"] == "no CUDA device"
    elif torch.cuda.get_device_capability() == (9, 0):
        assert st["routing_plan.int32.sm90"] == "available"
        if any(a in prime_kernels.build_info()["cuda_archs"] for a in ("100a", "103a", "100f")):
            assert st["routing_plan.int32.sm100"].startswith("device sm_90 cannot run")
        else:
            assert st["routing_plan.int32.sm100"].startswith("not built for sm100")
    assert st["mega_moe.mxfp8.sm100"].startswith("not implemented yet")
    # the fused FP8 forward is built (and runs) wherever the FP8 L1 kernel is
    assert st["mega_moe.fp8.sm90"] == st["m_grouped_gemm_swiglu.fp8.sm90"]
    assert (st["mega_moe_grouped.fp8.sm90"] in ("available", "no CUDA device")
            or st["mega_moe_grouped.fp8.sm90"].startswith(("not built", "device sm_", "built;")))
    # the FP8 backward runs where its last kernel runs
    assert (st["mega_moe.fp8_bwd.sm90"] == "available") == (st["m_grouped_gemm_swiglu_bwd.fp8.sm90"] == "available")


def test_require_raises_the_status_reason():
    from prime_kernels._status import is_available, require

    st = prime_kernels.status()
    for key, why in st.items():
        if is_available(why):
            require(key)
        else:
            with pytest.raises(RuntimeError) as info:
                require(key)
            assert why in str(info.value)


def test_an_unverified_entry_reports_its_note_and_stays_runnable(monkeypatch):
    """A kernel built but not yet verified on a GPU (KernelEntry.unverified) gets its note from status() and
    reason() in place of "available", require() refuses it unless allow_unverified, and runnable() says it could run;
    the other entries are unaffected. The mechanism is exercised on an entry that has passed its GPU tests, marked
    here."""
    import dataclasses

    from prime_kernels import _status

    key, other = "k_grouped_gemm_tn.fp8.sm90", "m_grouped_gemm_nt.bf16.sm90"
    note = "compiled but not yet run on a GPU"
    shipped = _status.unverified()
    assert key not in shipped and other not in shipped
    monkeypatch.setitem(_status.KERNELS, key, dataclasses.replace(_status.KERNELS[key], unverified=note))
    monkeypatch.setattr(_status, "_current_cuda_device", lambda: None)  # no cached answers
    monkeypatch.setattr(_status, "_reason", lambda k: _status.AVAILABLE)  # as if it could run here
    assert _status.reason(key) == note and prime_kernels.status()[key] == note
    assert _status.unverified() == {**shipped, key: note}
    assert _status.runnable(key) == _status.AVAILABLE
    with pytest.raises(RuntimeError, match=note):
        _status.require(key)
    _status.require(key, allow_unverified=True)
    assert _status.reason(other) == _status.AVAILABLE


def test_a_withheld_entry_reports_its_reason_and_stays_runnable(monkeypatch):
    """A kernel verified on a GPU that no layer chooses (KernelEntry.withheld) gets its reason from status() and
    reason() in place of "available", require() refuses it unless allow_unverified, runnable() says it could run, and
    withheld() lists it (unverified() does not)."""
    import dataclasses

    from prime_kernels import _status

    key = "k_grouped_gemm_tn.fp8.sm90"
    note = "verified, but slower than what runs instead"
    shipped = _status.withheld()
    assert key not in shipped
    monkeypatch.setitem(_status.KERNELS, key, dataclasses.replace(_status.KERNELS[key], withheld=note))
    monkeypatch.setattr(_status, "_current_cuda_device", lambda: None)  # no cached answers
    monkeypatch.setattr(_status, "_reason", lambda k: _status.AVAILABLE)  # as if it could run here
    assert _status.reason(key) == note and prime_kernels.status()[key] == note
    assert _status.withheld() == {**shipped, key: note} and key not in _status.unverified()
    assert _status.runnable(key) == _status.AVAILABLE
    with pytest.raises(RuntimeError, match=note):
        _status.require(key)
    _status.require(key, allow_unverified=True)


def test_build_info_is_importable():
    from prime_kernels import _build_info

    info = prime_kernels.build_info()
    assert set(info["cuda_archs"]) <= {"90a", "100a", "103a", "100f"} and info["cuda_archs"]
    assert info["nvcc_version"].split(".")[0] in {"12", "13"}
    assert info["git_sha"] and info["build_date"].endswith("Z")
    assert _build_info.version == prime_kernels.__version__
    assert "+" not in prime_kernels.__version__, "PyPI refuses local version segments"
    assert prime_kernels._lib.built_archs() == info["cuda_archs"]


def test_cuda_op_without_gpu_raises_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-device path is for CPU-only machines")
    from prime_kernels._status import reason

    assert reason("routing_plan.int32.sm90") == "no CUDA device"


def test_old_torch_is_reported_not_crashed():
    code = (
        "import torch, warnings; torch.__version__ = '2.9.1'\n"
        "import prime_kernels\n"
        "st = prime_kernels.status(); print(st['routing_plan.int32.sm90'])\n"
        "try:\n  prime_kernels.routing_plan(torch.zeros(2, 2, dtype=torch.int64), 4, 8)\n"
        "except RuntimeError as e: print('RAISED', e)\n")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "torch 2.9.1 is older than 2.10" in out.stdout
    assert "RAISED" in out.stdout and "older than 2.10" in out.stdout


def test_damaged_install_is_reported(tmp_path):
    broken = tmp_path / "prime_kernels"
    shutil.copytree(PKG_DIR, broken, ignore=shutil.ignore_patterns("libprime_kernels_core.so", "__pycache__"))
    code = ("import prime_kernels; print(prime_kernels.__file__); print(prime_kernels.status()['routing_plan.int32.sm90'])")
    out = run_python(code, env={"PYTHONPATH": str(tmp_path)}, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert str(broken) in out.stdout
    assert "libprime_kernels_core.so is missing" in out.stdout and "reinstall" in out.stdout


def test_cpu_only_older_torch_imports_and_runs_cpu_ops():
    """The shim links no libtorch_cuda, and a build against newer torch headers loads on torch >= 2.10."""
    py = os.environ.get("PRIME_KERNELS_CPU_TORCH_PYTHON")
    if not py:
        pytest.skip("set PRIME_KERNELS_CPU_TORCH_PYTHON to a Python with a CPU-only torch (ci/test.sh does)")
    import subprocess

    code = ("import torch, prime_kernels\n"
            "assert torch.version.cuda is None, torch.__version__\n"
            "st = prime_kernels.status(); assert st['routing_plan.int32.sm90'] == 'no CUDA device', st\n"
            "idx = torch.randint(-1, 16, (100, 4))\n"
            "p = prime_kernels.routing_plan(idx, 16, 32); r = prime_kernels.routing_plan_reference(idx, 16, 32)\n"
            "assert torch.equal(p.pool_src_route, r.pool_src_route)\n"
            "a = torch.randn(10, 64).bfloat16(); b = torch.randn(2, 16, 64).bfloat16()\n"
            "o = prime_kernels.m_grouped_bf16_gemm_nt(a, b, torch.tensor([0, 4, 10], dtype=torch.int32))\n"
            "print('OK', torch.__version__, tuple(o.shape))\n")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK 2." in out.stdout
