"""precision="mxfp8" on the grouped backend (prime_kernels.mega._mxfp8): its status entry and the backend selection on
a faked device (as tests/test_blackwell_selection.py fakes one), and its whole forward on the CPU with torch's MXFP8
grouped GEMM replaced by an emulation that reads the operands the way the sm_100 kernel does (docs/mxfp8.md): the
scale layouts, group offsets and paddings our pipeline hands it are checked numerically against float64. Nothing here
needs a GPU; nothing here has run on Blackwell hardware."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import prime_kernels
from prime_kernels import _lib, _status
from prime_kernels import grouped_gemm_torch as torch_gemms
from prime_kernels import mxfp8 as mx
from prime_kernels.mega import _backend, _mxfp8
from prime_kernels.mega._validate import FusedKernelUnavailable

KEY = "mega_moe_grouped.mxfp8.sm100"
ARCH_NEUTRAL = ("routing_plan", "combine", "dispatch_rows", "swiglu", "dispatch_rows_fp8", "quantize_tokens_fp8",
                "quantize_mxfp8")
SHAPE = dict(device_type="cuda", hidden=256, intermediate=128)


@pytest.fixture
def fake(monkeypatch):
    """fake(cc, archs, mslk=True, absent=()): a CUDA device of capability ``cc``, a build of ``archs`` holding the
    arch-neutral kernels for each, and a torch built with (or without) its MXFP8 grouped GEMM."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    monkeypatch.setattr(_backend, "_warned", set())

    def set_up(cc, archs=("90a", "100a"), mslk=True, absent=()):
        pairs = {(k, a) for a in archs for k in ARCH_NEUTRAL} - set(absent)
        monkeypatch.setattr(_lib, "built_archs", lambda: tuple(archs))
        monkeypatch.setattr(_lib, "compiled_kernels", lambda: frozenset(pairs))
        monkeypatch.setattr(_status, "_torch_build_config", lambda: "-DUSE_MSLK" if mslk else "-DUSE_CUDA")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cc is not None)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(torch_gemms, "_selected_by_device", {})
        monkeypatch.setattr(_backend, "_ARCH_BY_DEVICE", {})

    return set_up


# --- status() ---------------------------------------------------------------------------------------------------------

def test_available_on_sm100_with_a_torch_that_has_the_kernel(fake):
    fake((10, 0))
    why = prime_kernels.status()[KEY]
    assert _status.is_available(why) and why.startswith("available: "), why
    for words in ("compiled for sm_100a", "torch._scaled_grouped_mm", "backward in bf16",
                  "never run on Blackwell hardware"):
        assert words in why, why
    _status.require(KEY)


@pytest.mark.parametrize("cc, archs, mslk, want", [
    ((9, 0), ("90a", "100a"), True, "device sm_90 cannot run this sm100 kernel"),
    ((10, 3), ("90a", "103a"), True, "runs on sm_100 (compute capability 10.0) only, this device is sm_103"),
    ((10, 3), ("100f",), True, "runs on sm_100 (compute capability 10.0) only, this device is sm_103"),
    ((10, 0), ("90a", "100a"), False, "built without USE_MSLK"),
    ((10, 0), ("90a",), True, "not built for sm100"),
    (None, ("90a", "100a"), True, "no CUDA device"),
])
def test_the_exact_reason_elsewhere(fake, cc, archs, mslk, want):
    fake(cc, archs, mslk)
    why = prime_kernels.status()[KEY]
    assert not _status.is_available(why) and want in why, why
    with pytest.raises(RuntimeError, match="mega_moe_grouped.mxfp8.sm100 is not available"):
        _status.require(KEY)


def test_a_build_without_the_quantization_kernel_says_so(fake):
    fake((10, 0), absent={("quantize_mxfp8", "100a")})
    assert "quantize_mxfp8 kernel(s) not compiled" in prime_kernels.status()[KEY]


def test_a_torch_without_scaled_grouped_mm_says_so(fake, monkeypatch):
    fake((10, 0))
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    assert "has no torch._scaled_grouped_mm" in prime_kernels.status()[KEY]


def test_the_quantization_kernel_is_available_on_hopper_and_unverified_on_blackwell(fake):
    fake((9, 0))
    assert prime_kernels.status()["quantize.mxfp8.sm90"] == _status.AVAILABLE
    fake((10, 0))
    key = "quantize.mxfp8.sm100"
    assert prime_kernels.status()[key] == _status.KERNELS[key].unverified != ""
    assert "never run on Blackwell" in prime_kernels.status()[key]
    assert _status.runnable(key) == _status.AVAILABLE
    _status.require(key, allow_unverified=True)


# --- the backend selection ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_sm100_runs_the_grouped_pipeline(fake, direction):
    fake((10, 0))
    assert _backend.resolve_backend("grouped", "mxfp8", direction, **SHAPE) == "grouped"
    which, why = _backend.choose_backend("auto", "mxfp8", direction, **SHAPE)
    assert which == "grouped" and "mega_moe.mxfp8.sm100" in why  # the fused MXFP8 kernel is not written
    with pytest.raises(FusedKernelUnavailable, match="mega_moe.mxfp8.sm100: not implemented yet"):
        _backend.resolve_backend("fused", "mxfp8", direction, **SHAPE)


@pytest.mark.parametrize("backend", ["grouped", "auto"])
def test_sm90_raises_the_reason_before_anything_runs(fake, backend):
    fake((9, 0))
    with pytest.raises(FusedKernelUnavailable,
                       match="mega_moe_grouped.mxfp8.sm100: device sm_90 cannot run this sm100 kernel"):
        _backend.resolve_backend(backend, "mxfp8", "fwd", **SHAPE)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ep_size=2), "single rank"),
    (dict(activation_clamp=7.0), "takes no activation_clamp"),
    (dict(num_local_experts=2048), "GROUPED_MAX_EXPERTS"),
    (dict(hidden=192), "FP8_ALIGN"),
])
def test_what_the_pipeline_does_not_take(fake, kwargs, match):
    fake((10, 0))
    shape = {**SHAPE, **kwargs}
    with pytest.raises((FusedKernelUnavailable, ValueError), match=match):
        _backend.resolve_backend("grouped", "mxfp8", "fwd", **shape)


def test_the_reference_has_no_mxfp8(fake):
    fake((10, 0))
    with pytest.raises(NotImplementedError, match="'mxfp8' has no reference numerics"):
        _backend.resolve_backend("reference", "mxfp8", "fwd", **SHAPE)


# --- the forward with the GEMM emulated ---------------------------------------------------------------------------

def _round_up(a, b):
    return (a + b - 1) // b * b


def emulated_scaled_grouped_mm(a_q, b_q, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm's MXFP8 2d-3d case in float64, reading what the sm_100 kernel reads: torch's checks
    on the operands (docs/mxfp8.md), group g's A rows [offs[g-1], offs[g]), its A scales at padded row
    sum_{j<g} round_up(m_j, 128) of scale_a, expert g's B scales in row g of scale_b. Rows past the last group are
    NaN, so a consumer that reads them shows."""
    M, K = a_q.shape
    G, Kb, N = b_q.shape
    assert a_q.dtype == b_q.dtype == torch.float8_e4m3fn and Kb == K
    assert a_q.stride(1) == 1 and b_q.stride(1) == 1, "both operands K-contiguous"
    assert K % 32 == 0 and N % 16 == 0 and (a_q.stride(0) % 16 == 0)
    assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
    assert scale_a.dim() == 2 and scale_a.is_contiguous() and scale_a.size(0) >= M
    cb = _round_up(K // 32, 4)
    assert scale_b.shape == (G, _round_up(N, 128) * cb) and scale_b.is_contiguous()
    assert offs.dtype == torch.int32 and offs.dim() == 1 and offs.numel() == G
    out = torch.full((M, N), float("nan"), dtype=torch.float64)
    flat_a = scale_a.view(torch.uint8).reshape(-1)
    start = prev = 0
    for g, end in enumerate(offs.tolist()):
        m = end - prev
        if m:
            sa = mx.from_blocked_scales(flat_a[start * cb:(start + _round_up(m, 128)) * cb], m, K // 32)
            a = mx.dequantize_mxfp8_reference(a_q[prev:end], sa).double()
            sb = mx.from_blocked_scales(scale_b[g], N, K // 32)
            b = mx.dequantize_mxfp8_reference(b_q[g].t(), sb).double()
            out[prev:end] = a @ b.t()
        start += _round_up(m, 128)
        prev = end
    return out.to(torch.bfloat16)


def _problem(T, E, K, H, I, seed, empty_expert=True):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=gen) * 3).bfloat16()
    x[0, :32] = 0  # a zero block
    choices = E - 1 if empty_expert else E
    idx = torch.stack([torch.randperm(choices, generator=gen)[:K] for _ in range(T)]).int()
    weights = torch.rand(T, K, generator=gen)
    # experts' weights on scales a few powers of two apart: a scale applied to the wrong expert or block shows
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * torch.exp2(torch.arange(E) - 6.0)[:, None, None]).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) * torch.exp2(2.0 - torch.arange(E))[:, None, None]).bfloat16()
    return x, idx, weights, w13, w2


def _layer64(x, idx, weights, w13, w2, quantized):
    """The layer in float64; with ``quantized``, each GEMM operand first through the MXFP8 reference along the
    contraction axis and h, s, o rounded to bf16 where the pipeline rounds them (its quantization points)."""
    def q(t):
        if not quantized:
            return t.double()
        qq, ss = mx.quantize_mxfp8_reference(t)
        return mx.dequantize_mxfp8_reference(qq, ss).double()

    def rnd(t):
        return t.to(torch.bfloat16).double() if quantized else t

    T, K = idx.shape
    I = w2.shape[2]
    y = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            h = rnd(q(x[t:t + 1]) @ q(w13[e]).t())
            g, u = h[:, :I], h[:, I:]
            s = F.silu(g.float()).double() * u if quantized else F.silu(g) * u
            s = rnd(s)
            o = rnd(q(s.to(torch.bfloat16) if quantized else s) @ q(w2[e]).t())
            y[t] += float(weights[t, k]) * o[0]
    return y


@pytest.mark.parametrize("T, E, K, H, I", [(37, 4, 2, 256, 128), (1, 3, 1, 128, 128), (130, 5, 3, 128, 256)])
def test_forward_with_the_gemm_emulated_matches_float64(monkeypatch, T, E, K, H, I):
    """The whole MXFP8 forward on the CPU (routing plan, dispatch, our quantization's host loop, SwiGLU and combine
    CPU ops), torch's GEMM emulated: y equals the quantization-aware float64 layer up to its bf16 roundings, and the
    unquantized layer within MXFP8's error. Experts get few rows (not multiples of 128), one expert none, and the
    plan pads each expert to 128 rows, so the scale paddings and group offsets are all exercised."""
    monkeypatch.setattr(_mxfp8, "grouped_mm", emulated_scaled_grouped_mm)
    x, idx, weights, w13, w2 = _problem(T, E, K, H, I, seed=T + E)
    block_m = 128
    cap = _backend.capacity(T, K, E, 1, None, block_m)
    y, h, counts, offsets, src, srank, r2p, x_pool = _backend.forward(
        "grouped", x, idx, weights, w13, w2, precision="mxfp8", activation_clamp=None, group=None, num_experts=E,
        ep_size=1, max_tokens_per_rank=None, block_m=block_m, save_h=True)
    assert int(counts[E - 1]) == 0 and y.dtype == torch.bfloat16 and h.shape == (cap, 2 * I)
    assert bool(torch.isfinite(h[:int(offsets[-1])]).all())
    ref_q = _layer64(x, idx, weights, w13, w2, quantized=True)
    ref = _layer64(x, idx, weights, w13, w2, quantized=False)
    scale = ref.abs().max()
    err_q = ((y.double() - ref_q).abs().max() / scale).item()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err_q < 2e-2, err_q  # bf16 roundings of h, s, o and y against float64 ones
    assert err < 0.15, err  # MXFP8 itself: ~0.07-0.09 measured (e4m3 rounds to 2^-4 relative, four operands)


def test_the_emulation_catches_a_misplaced_scale(monkeypatch):
    """The check above can fail: the same forward with the A scales of two experts exchanged (one group's 128-row
    scale tile moved) is far from the quantization-aware float64 layer."""
    def swapped(a_q, b_q, scale_a, scale_b, offs):
        s = scale_a.clone()
        first, second = s[:128].clone(), s[128:256].clone()
        s[:128], s[128:256] = second, first
        return emulated_scaled_grouped_mm(a_q, b_q, s, scale_b, offs)

    monkeypatch.setattr(_mxfp8, "grouped_mm", swapped)
    E, K, H, I = 4, 2, 256, 128
    x, idx, weights, w13, w2 = _problem(37, E, K, H, I, seed=9)
    x = x * torch.exp2(torch.randint(-8, 8, (37, 1)).float()).bfloat16()  # rows of different scales
    y = _backend.forward("grouped", x, idx, weights, w13, w2, precision="mxfp8", activation_clamp=None, group=None,
                         num_experts=E, ep_size=1, max_tokens_per_rank=None, block_m=128, save_h=False)[0]
    ref_q = _layer64(x, idx, weights, w13, w2, quantized=True)
    assert ((y.double() - ref_q).abs().max() / ref_q.abs().max()).item() > 0.1  # ~0.002 with the scales in place


def test_backward_recompute_reruns_the_mxfp8_l1(monkeypatch):
    """The backward from the saved h and with recompute give the same bits: a recompute reruns this forward's L1,
    not the bf16 one."""
    monkeypatch.setattr(_mxfp8, "grouped_mm", emulated_scaled_grouped_mm)
    E, K, H, I, T = 3, 2, 128, 128, 20
    x, idx, weights, w13, w2 = _problem(T, E, K, H, I, seed=4)
    fwd = _backend.forward("grouped", x, idx, weights, w13, w2, precision="mxfp8", activation_clamp=None, group=None,
                           num_experts=E, ep_size=1, max_tokens_per_rank=None, block_m=128, save_h=True)
    dy = torch.randn(T, H).bfloat16()
    common = dict(precision="mxfp8", activation_clamp=None, group=None, num_experts=E, need_wgrad=True)
    plan = fwd[1:7]
    saved = _backend.backward("grouped", dy, x, idx, weights, w13, w2, *plan, recompute=False, **common)
    again = _backend.backward("grouped", dy, x, idx, weights, w13, w2, *plan, recompute=True, **common)
    for a, b in zip(saved, again):
        assert torch.equal(a, b)
    dx = saved[0]
    assert dx.shape == x.shape and bool(torch.isfinite(dx.float()).all())
