"""What runs on a Blackwell GPU, checked on the CPU against a faked device: the compute capability queries and the
build's list of compiled (kernel, arch) pairs are replaced, so status(), the backend resolution of prime_kernels.mega
and the GEMM selection of prime_kernels.grouped_gemm answer as they would on an sm_100 (or sm_90) GPU. Nothing here
launches a kernel."""

from __future__ import annotations

import types

import pytest
import torch

import prime_kernels
from prime_kernels import _lib, _status
from prime_kernels import grouped_gemm as gg
from prime_kernels import grouped_gemm_torch as torch_gemms
from prime_kernels.mega import _backend, _selftest
from prime_kernels.mega._validate import FusedKernelUnavailable

# Compiled for every requested arch (CMakeLists.txt, PK_COMPILED_KERNELS)
ARCH_NEUTRAL = ("routing_plan", "combine", "dispatch_rows", "swiglu", "dispatch_rows_fp8", "quantize_tokens_fp8",
                "quantize_mxfp8")
SM90_ONLY = sorted({e.compiled_as for e in _status.KERNELS.values()
                    if e.family == "sm90" and e.compiled_as and e.compiled_as not in ARCH_NEUTRAL})
KEY = "mega_moe_grouped.bf16.sm100"
CLAMP_KEY = "mega_moe_grouped_clamp.bf16.sm100"
SHAPE = dict(device_type="cuda", hidden=256, intermediate=128)


@pytest.fixture
def fake(monkeypatch):
    """fake(cc, archs, absent=()): a CUDA device of compute capability ``cc`` (None: no device) and a build of
    ``archs`` holding the arch-neutral kernels for each and the sm90 ones for 90a, less the (kernel, arch) pairs in
    ``absent``."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    monkeypatch.setattr(_backend, "_warned", set())
    # No native sm100 forward registered: these tests are about the grouped pipeline, and the first eager forward on
    # a faked sm_100 device would otherwise self-test the registered one on tensors this machine cannot hold
    # (tests/test_selftest.py tests it with the registry).
    monkeypatch.setattr(_selftest, "_candidates", {})
    monkeypatch.setattr(_selftest, "_verdicts", {})
    monkeypatch.setattr(_selftest, "_settled", set())

    def set_up(cc, archs=("90a", "100a"), absent=()):
        pairs = {(k, a) for a in archs for k in ARCH_NEUTRAL}
        pairs |= {(k, "90a") for k in SM90_ONLY if "90a" in archs}
        pairs -= set(absent)
        monkeypatch.setattr(_lib, "built_archs", lambda: tuple(archs))
        monkeypatch.setattr(_lib, "compiled_kernels", lambda: frozenset(pairs))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cc is not None)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # status() asks afresh, nothing cached
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

        def capability(device=None):
            if cc is None:
                raise RuntimeError("no CUDA device")
            return cc

        monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
        monkeypatch.setattr(torch_gemms, "_selected_by_device", {})
        monkeypatch.setattr(_backend, "_ARCH_BY_DEVICE", {})

    return set_up


# --- the selection of torch's grouped GEMM ---------------------------------------------------------------------------

@pytest.mark.parametrize("cc, want", [((9, 0), False), ((10, 0), True), ((10, 3), True), ((12, 0), True)])
def test_selection_is_torch_gemms_wherever_the_major_is_not_9(fake, cc, want):
    fake(cc)
    assert torch_gemms.selected(torch.device("cuda", 0)) is want
    assert torch_gemms.selected(torch.device("cuda")) is want  # the current device
    assert torch_gemms.selected(torch.device("cpu")) is False  # the CPU runs our kernels' references
    with torch_gemms.forced():
        assert torch_gemms.selected(torch.device("cuda", 0)) is True
        assert torch_gemms.selected(torch.device("cpu")) is True
    assert torch_gemms.selected(torch.device("cuda", 0)) is want  # forced() does not outlive its block


def test_selection_is_remembered_per_device_index(fake, monkeypatch):
    fake((10, 0))
    asked = []

    def capability(device=None):
        asked.append(device)
        return (9, 0) if device == 1 else (10, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    for _ in range(3):
        assert torch_gemms.selected(torch.device("cuda", 0)) is True
        assert torch_gemms.selected(torch.device("cuda", 1)) is False
    assert asked == [0, 1]


def _cpu_operands():
    E, M, H, I = 2, 16, 32, 32
    a = torch.randn(M, H).bfloat16()
    offs = torch.tensor([0, 8, M], dtype=torch.int32)
    w13 = torch.randn(E, 2 * I, H).bfloat16()
    w2 = torch.randn(E, H, I).bfloat16()
    w2_nn = torch.randn(E, H, I).bfloat16()
    h = torch.randn(M, 2 * I).bfloat16()
    src = torch.arange(M, dtype=torch.int32)
    weights = torch.rand(M)
    return dict(a=a, offs=offs, w13=w13, w2=w2, w2_nn=w2_nn, h=h, src=src, weights=weights,
                dy=torch.randn(M, H).bfloat16(), s=torch.randn(M, I).bfloat16())


def _calls(o):
    return {
        "m_grouped_bf16_gemm_nt": lambda: gg.m_grouped_bf16_gemm_nt(o["s"], o["w2"], o["offs"]),
        "m_grouped_bf16_gemm_nn": lambda: gg.m_grouped_bf16_gemm_nn(o["dy"], o["w2_nn"], o["offs"]),
        "m_grouped_bf16_gemm_swiglu": lambda: gg.m_grouped_bf16_gemm_swiglu(o["a"], o["w13"], o["offs"], save_h=True),
        "m_grouped_bf16_gemm_swiglu_bwd": lambda: gg.m_grouped_bf16_gemm_swiglu_bwd(o["dy"], o["w2"], o["offs"], o["h"],
                                                                                   o["src"], o["weights"]),
        "k_grouped_bf16_gemm_tn": lambda: gg.k_grouped_bf16_gemm_tn(o["dy"], o["s"], o["offs"]),
    }


def test_every_bf16_gemm_runs_where_the_selection_says(monkeypatch):
    """Each bf16 GEMM of prime_kernels.grouped_gemm asks grouped_gemm_torch.selected with its operands' device and
    runs torch's grouped GEMM (here a recorder) when it says so, ours (the CPU reference) otherwise."""
    ran, asked = [], []
    for name in _calls({}).keys():
        monkeypatch.setattr(torch_gemms, name, lambda *a, _name=name, **k: ran.append(_name) or _name)
    answer = {"value": True}

    def selected(device):
        asked.append(device)
        return answer["value"]

    monkeypatch.setattr(torch_gemms, "selected", selected)
    calls = _calls(_cpu_operands())
    for name, call in calls.items():
        assert call() == name
    assert ran == list(calls) and asked == [torch.device("cpu")] * len(calls)
    ran.clear()
    answer["value"] = False
    for name, call in calls.items():
        assert call() is not name
    assert ran == []


# --- status() ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cc, archs, arch", [((10, 0), ("90a", "100a"), "sm_100a"), ((10, 3), ("100f",), "sm_100f"),
                                             ((10, 3), ("90a", "103a"), "sm_103a")])
def test_status_says_what_runs_on_blackwell(fake, cc, archs, arch):
    fake(cc, archs)
    st = prime_kernels.status()
    why = st[KEY]
    assert _status.is_available(why) and why.startswith("available: "), why
    for words in ("routing plan, dispatch, SwiGLU and combine kernels", f"compiled for {arch}", "torch._grouped_mm",
                  "never run on Blackwell hardware", "verified on Hopper with torch's GEMMs forced"):
        assert words in why, why
    assert _status.reason(KEY) == why
    _status.require(KEY)
    # the clamp is refused, the fused kernels stay unwritten for Blackwell, and ours for Hopper cannot run here
    assert "takes no activation_clamp" in st[CLAMP_KEY] and not _status.is_available(st[CLAMP_KEY])
    assert st["mega_moe.bf16.sm100"].startswith("no native sm100 forward kernel is registered")
    ours = st["mega_moe_grouped.bf16.sm90"]
    assert ours == f"device sm_{cc[0]}{cc[1]} cannot run this sm90 kernel" if "90a" in archs else (
        ours.startswith("not built for sm90")), ours
    assert st["swiglu.bf16.sm100"] == "available"


@pytest.mark.parametrize("case", ["no sm_100 in the build", "swiglu not built for sm_100", "torch without _grouped_mm",
                                  "sm_103 on a 100a build", "sm_90 device", "no device"])
def test_status_says_why_it_cannot_run(fake, monkeypatch, case):
    if case == "no sm_100 in the build":
        fake((10, 0), ("90a",))
        want = "not built for sm100 (this build has 90a): rebuild with PRIME_KERNELS_CUDA_ARCHS=100a"
    elif case == "swiglu not built for sm_100":
        fake((10, 0), ("90a", "100a"), absent=[("swiglu", "100a")])
        want = "our swiglu kernel(s) not compiled into this build of sm100 (its sources were not part of it)"
    elif case == "torch without _grouped_mm":
        fake((10, 0))
        monkeypatch.delattr(torch, "_grouped_mm")
        want = f"torch {torch.__version__} has no torch._grouped_mm: upgrade torch"
    elif case == "sm_103 on a 100a build":
        fake((10, 3))
        want = "device sm_103 needs a rebuild with PRIME_KERNELS_CUDA_ARCHS=103a"
    elif case == "sm_90 device":
        fake((9, 0))
        want = "device sm_90 cannot run this sm100 kernel"
    else:
        fake(None)
        want = "no CUDA device"
    assert prime_kernels.status()[KEY] == want
    with pytest.raises(RuntimeError, match="not available"):
        _status.require(KEY)


# --- the backend resolution -------------------------------------------------------------------------------------------

def _tensors(hidden=256, intermediate=128, experts=8):
    """What resolve reads of x and w13: the device and the shapes."""
    x = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(64, hidden))
    w13 = types.SimpleNamespace(shape=(experts, 2 * intermediate, hidden))
    return x, w13


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("ep_size", [1, 2])
@pytest.mark.parametrize("backend", ["grouped", "auto"])
def test_blackwell_resolves_bf16_to_the_grouped_pipeline(fake, direction, ep_size, backend):
    fake((10, 0))
    assert _backend.grouped_keys() == (KEY, CLAMP_KEY)
    x, w13 = _tensors()
    assert _backend.resolve(direction, backend, "bf16", x, w13, ep_size=ep_size, block_m=128) == "grouped"
    # H and I multiples of 64 but not of 128: our kernels' half tiles do not concern torch's GEMMs
    x, w13 = _tensors(hidden=192, intermediate=320)
    assert _backend.resolve(direction, backend, "bf16", x, w13, ep_size=ep_size) == "grouped"
    if backend == "auto":
        which, why = _backend.choose_backend("auto", "bf16", direction, ep_size=ep_size, **SHAPE)
        assert which == "grouped"
        fused = "mega_moe.bf16.sm100" if direction == "fwd" else "mega_moe_backward.bf16.sm100"
        unwritten = "no native sm100 forward kernel is registered" if direction == "fwd" else "not implemented yet"
        want = f"{fused}: {unwritten}" if ep_size == 1 else f"{_backend.PEER_KEY}: "
        assert why.startswith(want), why


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_blackwell_keeps_the_fused_kernels_and_the_fp8_pipelines_unavailable(fake, direction):
    fake((10, 0))
    name = "mega_moe.bf16.sm100" if direction == "fwd" else "mega_moe_backward.bf16.sm100"
    why = "no native sm100 forward kernel is registered" if direction == "fwd" else "not implemented yet"
    with pytest.raises(FusedKernelUnavailable, match=f"{name}: {why}"):
        _backend.resolve_backend("fused", "bf16", direction, **SHAPE)
    for precision in ("fp8", "fp8_bwd"):  # the FP8 kernels are sm90 only
        with pytest.raises(FusedKernelUnavailable, match=f"backend='grouped' cannot run: precision='{precision}': "):
            _backend.resolve_backend("grouped", precision, direction, **SHAPE)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_blackwell_refuses_a_clamp_before_any_launch(fake, monkeypatch, direction):
    fake((10, 0))
    clamp_why = f"{CLAMP_KEY}: the grouped pipeline on torch's grouped GEMM takes no activation_clamp"
    with pytest.raises(FusedKernelUnavailable, match=f"backend='grouped' cannot run: {clamp_why}"):
        _backend.resolve_backend("grouped", "bf16", direction, activation_clamp=7.0, **SHAPE)
    with pytest.raises(FusedKernelUnavailable) as info:
        _backend.resolve_backend("auto", "bf16", direction, activation_clamp=7.0, ep_size=2, **SHAPE)
    assert clamp_why in str(info.value) and "backend='reference'" in str(info.value)
    monkeypatch.setenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", "1")
    with pytest.warns(RuntimeWarning, match="takes no activation_clamp"):
        assert _backend.resolve_backend("auto", "bf16", direction, activation_clamp=7.0, **SHAPE) == "reference"
    # without a clamp the same call runs the pipeline
    assert _backend.resolve_backend("auto", "bf16", direction, **SHAPE) == "grouped"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_hopper_still_resolves_to_our_kernels(fake, direction):
    fake((9, 0))
    assert torch_gemms.selected(torch.device("cuda", 0)) is False
    assert _backend.grouped_keys() == ("mega_moe_grouped.bf16.sm90", "mega_moe_grouped_clamp.bf16.sm90")
    st = prime_kernels.status()
    assert st["mega_moe_grouped.bf16.sm90"] == "available" and st["mega_moe.bf16.sm90"] == "available"
    assert _backend.resolve_backend("grouped", "bf16", direction, **SHAPE) == "grouped"
    assert _backend.resolve_backend("grouped", "bf16", direction, activation_clamp=7.0, **SHAPE) == "grouped"
    # the fused forward where it runs; the fused backward is withheld, so the backward is our grouped pipeline
    assert _backend.resolve_backend("auto", "bf16", direction, **SHAPE) == ("fused" if direction == "fwd" else
                                                                             "grouped")
