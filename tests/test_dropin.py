"""The two distributions: prime-kernels-core (import package prime_kernels) and the prime-kernels drop-in
(import package deep_gemm), which re-exports prime_kernels' objects for DeepGEMM-shaped call sites."""

import importlib.metadata
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import deep_gemm
import prime_kernels
from conftest import REPO, run_python

# Names of upstream DeepGEMM (1.0.0 and 2.x) that the drop-in does not provide.
UPSTREAM_ONLY = ["gemm_fp8_fp8_bf16_nt", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
                 "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "get_col_major_tma_aligned_tensor", "fp8_gemm_nt",
                 "m_grouped_fp8_gemm_nt_contiguous", "bf16_gemm_nt", "set_num_sms", "get_num_sms"]


def test_dropin_is_its_own_package_and_the_core_is_separate():
    assert Path(deep_gemm.__file__).parent.name == "deep_gemm"
    assert Path(prime_kernels.__file__).parent.name == "prime_kernels"
    assert Path(deep_gemm.__file__).parent != Path(prime_kernels.__file__).parent


def test_every_public_name_is_the_same_object():
    assert deep_gemm.__all__ == prime_kernels.__all__
    for name in prime_kernels.__all__:
        assert getattr(deep_gemm, name) is getattr(prime_kernels, name), name
    for name in ("bf16_mega_moe", "bf16_mega_moe_backward", "get_symm_buffer_for_mega_moe",
                 "transform_weights_for_mega_moe", "MegaMoE", "mega_moe", "status", "build_info"):
        assert getattr(deep_gemm, name) is getattr(prime_kernels, name), name
    assert deep_gemm.__version__ == prime_kernels.__version__


def test_status_and_build_info_answer_alike_under_both_names():
    assert deep_gemm.status() == prime_kernels.status()
    assert deep_gemm.build_info() == prime_kernels.build_info()


def test_submodules_are_the_prime_kernels_modules():
    import deep_gemm.mega
    import deep_gemm.mega.reference
    from deep_gemm.mega import MegaMoE
    from deep_gemm.mega.api import mega_moe

    import prime_kernels.mega.reference

    assert deep_gemm.mega is prime_kernels.mega
    assert deep_gemm.mega.reference is prime_kernels.mega.reference
    assert MegaMoE is prime_kernels.mega.MegaMoE and mega_moe is prime_kernels.mega.mega_moe
    # The alias does not leave its own name on the shared module.
    assert prime_kernels.mega.__spec__.name == "prime_kernels.mega"
    assert prime_kernels.mega.reference.__spec__.name == "prime_kernels.mega.reference"


def test_a_submodule_imported_first_through_the_dropin_is_loaded_once():
    """prime_kernels.integrations._common is not imported by `import prime_kernels`: importing it as
    deep_gemm.integrations._common must load prime_kernels' module (once), not a second copy."""
    code = ("import sys, deep_gemm\n"
            "assert 'prime_kernels.integrations._common' not in sys.modules\n"
            "from deep_gemm.integrations._common import UnsupportedLayerError as A\n"
            "from prime_kernels.integrations._common import UnsupportedLayerError as B\n"
            "assert A is B\n"
            "assert sys.modules['deep_gemm.integrations._common'] is sys.modules['prime_kernels.integrations._common']\n"
            "assert sys.modules['prime_kernels.integrations._common'].__spec__.name == 'prime_kernels.integrations._common'\n"
            "import importlib; importlib.reload(sys.modules['prime_kernels.integrations._common'])\n"
            "print('OK')\n")
    out = run_python(code)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr


def test_a_missing_submodule_is_a_module_not_found_error():
    with pytest.raises(ModuleNotFoundError):
        import deep_gemm.no_such_module  # noqa: F401


@pytest.mark.parametrize("name", UPSTREAM_ONLY)
def test_upstream_only_names_raise_naming_prime_kernels_and_upstream(name):
    assert not hasattr(deep_gemm, name)
    with pytest.raises(AttributeError) as info:
        getattr(deep_gemm, name)
    msg = str(info.value)
    assert name in msg and "prime_kernels" in msg and "upstream DeepGEMM" in msg, msg
    assert "pip install prime-kernels-core" in msg, msg


def test_dropin_runs_a_deepgemm_shaped_call_on_the_cpu(monkeypatch):
    """The DeepGEMM-shaped forward through the drop-in, on the CPU reference, against prime_kernels' layer."""
    from prime_kernels.mega import _backend

    monkeypatch.setenv("DEEP_GEMM_ALLOW_REFERENCE_FALLBACK", "1")
    monkeypatch.setattr(_backend, "_warned", set())
    E, H, I, K, T = 4, 64, 32, 2, 10
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.randint(0, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, T, K, H, I, device="cpu")
    buf.x[:T].copy_(x)
    buf.topk_idx[:T].copy_(idx)
    buf.topk_weights[:T].copy_(w)
    y = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="falling back"):
        deep_gemm.bf16_mega_moe(y, w13, w2, buf)
    want = prime_kernels.mega.mega_moe(x, idx, w, w13, w2, backend="reference")
    assert torch.equal(y, want)


def test_versions_are_one_and_the_dropin_pins_the_core():
    core = importlib.metadata.version("prime-kernels-core")
    assert importlib.metadata.version("prime-kernels") == core == prime_kernels.__version__
    assert importlib.metadata.requires("prime-kernels") == [f"prime-kernels-core=={core}"]
    out = subprocess.run(["bash", str(REPO / "ci" / "check_versions.sh")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == core, out.stderr


@pytest.mark.parametrize("edit", ["version", "pin"])
def test_version_check_fails_when_the_two_differ(tmp_path, edit):
    shutil.copytree(REPO / "ci", tmp_path / "ci")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "dropin").mkdir()
    text = (REPO / "dropin" / "pyproject.toml").read_text()
    core = importlib.metadata.version("prime-kernels-core")
    if edit == "version":
        text = text.replace(f'\nversion = "{core}"', '\nversion = "9.9.9"', 1)
    else:
        text = text.replace(f'"prime-kernels-core=={core}"', '"prime-kernels-core>=0"', 1)
    (tmp_path / "dropin" / "pyproject.toml").write_text(text)
    out = subprocess.run(["bash", str(tmp_path / "ci" / "check_versions.sh")], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode != 0 and "dropin/pyproject.toml" in out.stderr, out.stdout + out.stderr


def test_the_two_distributions_share_no_file():
    core = {str(f) for f in importlib.metadata.files("prime-kernels-core")}
    dropin = {str(f) for f in importlib.metadata.files("prime-kernels")}
    assert not core & dropin, core & dropin
    assert all(f.startswith("deep_gemm/") or ".dist-info/" in f for f in dropin), dropin
    assert not any(f.startswith("deep_gemm/") for f in core), core
    assert any(f == "prime_kernels/__init__.py" for f in core)


def test_dropin_licence_is_the_repository_licence():
    assert (REPO / "dropin" / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes()


def test_upstream_deep_gemm_beside_the_dropin_is_reported(tmp_path):
    dist = tmp_path / "deep_gemm-2.6.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: deep_gemm\nVersion: 2.6.1\n")
    (dist / "RECORD").write_text("deep_gemm/__init__.py,,\n")
    code = "import warnings; warnings.simplefilter('always'); import deep_gemm"
    out = run_python(code, env={"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr
    assert "upstream deep_gemm 2.6.1" in out.stderr and "prime-kernels-core" in out.stderr, out.stderr
    clean = run_python(code)
    assert clean.returncode == 0 and "upstream deep_gemm" not in clean.stderr, clean.stderr
    # prime_kernels itself has nothing to warn about: it shares no import name with upstream.
    core = run_python(code.replace("import deep_gemm", "import prime_kernels"),
                      env={"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert core.returncode == 0 and "deep_gemm" not in core.stderr, core.stderr


@pytest.mark.parametrize("new,legacy,want", [(None, "1", True), ("1", None, True), ("0", "1", False),
                                             (None, None, False), (None, "0", False)])
def test_environment_flags_read_the_new_name_then_the_deep_gemm_one(monkeypatch, new, legacy, want):
    from prime_kernels.mega import constants

    for name in (constants.ALLOW_FALLBACK_ENV, constants.SKIP_VALUE_CHECKS_ENV):
        old = constants.LEGACY_ENV_NAMES[name]
        assert name.startswith("PRIME_KERNELS_") and old.startswith("DEEP_GEMM_")
        for var, value in ((name, new), (old, legacy)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        assert constants.env_flag(name) is want
