"""The FP8 L1 GEMM with the SwiGLU forward and the quantization of s (prime_kernels.swiglu_fwd_fp8).

CPU: the op's CPU path (the emulation built from prime_kernels.mega.fp8) against the unquantized float64 formula and
bit for bit against the recipe's own quantization of its s, its argument checks (raised before anything is
written), the layouts and the fake kernel, the status() entry.
GPU (sm90): the CUDA op against the emulation on NaN-poisoned outputs, with uneven experts (an empty one, tails
shorter than a 128-row block), with both scale options and without h; bitwise repeatability across grid sizes.
The kernel's values differ from the emulation's by the sigmoid (the SFU's approximation against torch's) and the
tensor core's FP8 accumulation, so the comparison is test_swiglu_bwd_fp8.py's (ACC_RTOL, one e4m3 step).
"""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from prime_kernels import _status
from prime_kernels import swiglu_fwd_fp8 as sff
from prime_kernels.mega import fp8 as recipe
from test_swiglu_bwd_fp8 import ACC_RTOL, bits, check_scales, group_rows

E4M3 = torch.float8_e4m3fn
KEY = "m_grouped_gemm_swiglu.fp8.sm90"


def make_case(counts, H=256, I=256, seed=0, pow2=False):
    """Pool rows of len(counts) experts (offsets as given: contiguous, no padding), x quantized by qK and W13 by qW."""
    gen = torch.Generator().manual_seed(seed)
    E = len(counts)
    offs = [0]
    for n in counts:
        offs.append(offs[-1] + n)
    M = offs[-1]
    x = torch.randn(M, H, generator=gen).bfloat16()
    qx = recipe.quantize_along_k(x, 128, pow2)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).bfloat16()
    qw = recipe.quantize_weight(w13, pow2)
    case = dict(x_q=qx.data, x_sa=qx.scale.contiguous(), w13_q=qw.data, w13_sb=qw.scale.contiguous(),
                group_offsets=torch.tensor(offs, dtype=torch.int32))
    return case, dict(x=x, w13=w13, offs=offs, M=M, I=I, H=H)


def poisoned(M, I, device, save_h=True):
    out = sff.allocate_outputs(M, I, device, save_h)
    out.s_q.view(torch.uint8).fill_(0x7F)
    out.s_sa.fill_(float("nan"))
    out.h.fill_(float("nan"))
    return out


def run(case, device, pow2=False, num_sms=None, save_h=True, clamp=None):
    c = {k: v.to(device) for k, v in case.items()}
    M, I = c["x_q"].shape[0], c["w13_q"].shape[1] // 2
    return sff.m_grouped_fp8_gemm_swiglu(**c, pow2_scales=pow2, num_sms=num_sms, out=poisoned(M, I, device, save_h),
                                         clamp=clamp, allow_unverified=True)


def emulated_h(case):
    """The emulation's fp32 h of every group's rows (fp8.py's G1-G3), the values the kernel's epilogue holds."""
    offs = case["group_offsets"].tolist()
    h = torch.zeros(case["x_q"].shape[0], case["w13_q"].shape[1])
    for g in range(len(offs) - 1):
        r = slice(offs[g], offs[g + 1])
        a = recipe.BlockQuantized(case["x_q"][r], case["x_sa"][r], 1, 128)
        b = recipe.BlockQuantized(case["w13_q"][g], case["w13_sb"][g], 128, 128)
        h[r] = recipe.fp8_gemm_nt(a, b)
    return h


# ---------------------------------------------------------------------------------------------------------- CPU


def test_status_lists_the_kernel():
    """Verified on an H200: status() lists it and its clamp instantiation like any built kernel."""
    assert KEY in prime_kernels.status() and KEY not in _status.unverified()
    assert "m_grouped_gemm_swiglu_clamp.fp8.sm90" not in _status.unverified()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        assert prime_kernels.status()[KEY] == _status.AVAILABLE


@pytest.mark.parametrize("H,I", [(256, 256), (1088, 320)])  # (1088, 320): 64-wide last blocks along H and I
def test_cpu_op_follows_the_unquantized_formula(H, I):
    case, x = make_case([200, 0, 128, 77], H=H, I=I)
    out = run(case, "cpu")
    offs, I = x["offs"], x["I"]
    h = torch.empty(x["M"], 2 * I, dtype=torch.float64)
    for e in range(len(offs) - 1):
        r = slice(offs[e], offs[e + 1])
        h[r] = x["x"][r].double() @ x["w13"][e].double().t()
    s = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    deq = (out.s_q.float() * out.s_sa.repeat_interleave(64, 1)).double()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert rel(deq, s) < 0.08
    assert rel(out.h.double(), h) < 0.08


def test_cpu_op_is_the_recipe_on_its_own_s():
    """s_q is fp8.py's qK(., 64) of one fp32 s, bit for bit (requantizing the dequantized values is the identity),
    and h the bf16 rounding of the same fp32 h."""
    case, x = make_case([130, 256], seed=3)
    out = run(case, "cpu")
    deq = out.s_q.float() * out.s_sa.repeat_interleave(64, 1)
    again = recipe.quantize_along_k(deq, 64)
    assert torch.equal(bits(again.data), bits(out.s_q))
    assert not bool(out.h.isnan().any())


@pytest.mark.parametrize("clamp", [0.25, 1.0])
def test_cpu_op_with_a_clamp_clamps_on_the_fp32_h_and_saves_its_masks(clamp):
    """With a clamp c: s is silu(min(g, c)) * clamp(u, -c, c) of the fp32 h (against the float64 formula on that h), and
    the saved bf16 h gives every clamp mask the fp32 h gives (F6: no value rounds onto or across a bound), where a
    plain rounding would move some (c = 0.25 and 1.0 are bf16 values, so values near them round onto them)."""
    case, x = make_case([200, 0, 128, 77], seed=5)
    out = run(case, "cpu", clamp=clamp)
    h = emulated_h(case)
    I = x["I"]
    g, u = h[:, :I].double(), h[:, I:].double()
    s = torch.nn.functional.silu(g.clamp(max=clamp)) * u.clamp(-clamp, clamp)
    deq = (out.s_q.float() * out.s_sa.repeat_interleave(64, 1)).double()
    assert float((deq - s).norm() / s.norm()) < 0.08
    saved = out.h.float()
    for got, exact, bound in ((saved[:, :I], h[:, :I], clamp), (saved[:, I:], h[:, I:], clamp),
                              (saved[:, I:], h[:, I:], -clamp)):
        assert torch.equal(got < bound, exact < bound) and torch.equal(got > bound, exact > bound)
    plain = h.bfloat16().float()
    assert not torch.equal(plain[:, :I] < clamp, h[:, :I] < clamp)  # the case has values the plain rounding moves
    assert float((saved - plain).abs().max()) <= 2 ** -7 * clamp  # one bf16 step, at the bounds only


def test_cpu_rejects_bad_arguments_before_writing():
    case, x = make_case([64, 64])
    out = poisoned(x["M"], x["I"], "cpu")
    bad = dict(case, x_sa=case["x_sa"][:, :1])
    with pytest.raises(ValueError, match="x_sa"):
        sff.m_grouped_fp8_gemm_swiglu(**bad, out=out, allow_unverified=True)
    bad = dict(case, group_offsets=torch.tensor([0, 100, 90], dtype=torch.int32))
    with pytest.raises(RuntimeError):
        sff.m_grouped_fp8_gemm_swiglu(**bad, out=out, allow_unverified=True)
    with pytest.raises(ValueError, match="out.s_sa"):
        sff.m_grouped_fp8_gemm_swiglu(**case, out=sff.Fp8SwigluFwd(out.s_q, out.s_sa[:, :1], out.h),
                                      allow_unverified=True)
    assert bool(out.s_sa.isnan().all()) and bool(out.h.isnan().all())


def test_layouts_and_fake_kernel():
    M, I, H = 300, 256, 384
    out = sff.allocate_outputs(M, I, "meta")
    assert [tuple(t.shape) for t in out] == [(M, I), (M, I // 64), (M, 2 * I)]
    assert out.s_sa.stride(0) == 1 and out.s_sa.stride(1) % 4 == 0
    assert tuple(sff.allocate_outputs(M, I, "meta", save_h=False).h.shape) == (0,)
    m = dict(x_q=torch.empty(M, H, dtype=E4M3, device="meta"),
             x_sa=prime_kernels.grouped_gemm.k_block_major_empty(M, H // 128, "meta"),
             w13_q=torch.empty(2, 2 * I, H, dtype=E4M3, device="meta"),
             w13_sb=torch.empty(2, 2 * I // 128, H // 128, device="meta"),
             group_offsets=torch.empty(3, dtype=torch.int32, device="meta"))
    assert torch.ops.prime_kernels.m_grouped_fp8_gemm_swiglu_(*m.values(), *out, False, 0) is None


# ---------------------------------------------------------------------------------------------------------- GPU


def compare(got, want, offs, pow2):
    rows = group_rows(offs)
    got = sff.Fp8SwigluFwd(*(t.cpu() for t in got))
    check_scales("s_sa", got.s_sa[rows], want.s_sa[rows], pow2)
    q, r = got.s_q[rows], want.s_q[rows]
    q_scale, r_scale = got.s_sa[rows].repeat_interleave(64, 1), want.s_sa[rows].repeat_interleave(64, 1)
    assert not bool(torch.isnan(q.float()).any()), "s_q: a poisoned output byte was left unwritten"
    same = (bits(q) == bits(r)).float().mean().item()
    dq, dr = q.float() * q_scale, r.float() * r_scale
    coarse = torch.maximum(q_scale, r_scale)
    step = torch.maximum(dr.abs() / 8, coarse * 2.0 ** -9) + ACC_RTOL * 448 * coarse  # as test_swiglu_bwd_fp8.py
    worst = ((dq - dr).abs() / step).max().item()
    print(f"[compare] s_q: {same:.5f} of the bytes equal, worst difference {worst:.3f} of the bound")
    assert same > 0.98, f"s_q: only {same:.4f} of the bytes equal the emulation's"
    assert worst <= 1.01, f"s_q: a value differs by {worst:.3f} of one e4m3 step"
    if want.h.numel():
        hg, hw = got.h[rows].float(), want.h[rows].float()
        assert not bool(hg.isnan().any()), "h: a poisoned value was left unwritten"
        torch.testing.assert_close(hg, hw, rtol=ACC_RTOL + 2.0 ** -8, atol=ACC_RTOL * hw.abs().max().item())


@requires_sm90
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("counts", [[200, 0, 128, 77], [1, 300, 0], [513]])
def test_cuda_matches_the_emulation(counts, pow2):
    case, x = make_case(counts, pow2=pow2, seed=len(counts))
    got = run(case, "cuda", pow2=pow2)
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    compare(got, run(case, "cpu", pow2=pow2), x["offs"], pow2)


@requires_sm90
@pytest.mark.parametrize("counts,H,I", [([200, 0, 128, 77], 1088, 320), ([1, 300, 0], 192, 192),
                                        ([130, 256, 5, 60], 2880, 2880), ([513], 64, 64)])
def test_cuda_matches_the_emulation_with_64_wide_last_blocks(counts, H, I):
    """H = 64 (mod 128): the last k-block holds 64 columns (the rest load as zeros); I = 64 (mod 128): a W13 scale
    block holds the last 64 gate and the first 64 up rows. Bitwise repeatable over grid sizes."""
    case, x = make_case(counts, H=H, I=I, seed=H + I)
    got = run(case, "cuda")
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    compare(got, run(case, "cpu"), x["offs"], False)
    again = run(case, "cuda", num_sms=5)
    for a, b in zip(got, again):
        assert torch.equal(bits(a), bits(b)) if a.dtype == E4M3 else torch.equal(a, b)


@requires_sm90
@pytest.mark.parametrize("clamp", [0.25, 1.0, 7.0])
def test_cuda_with_a_clamp_matches_the_emulation(clamp):
    """The kernel's clamp instantiation (status entry m_grouped_gemm_swiglu_clamp.fp8.sm90) against the emulation with
    the same clamp, h's clamp masks included; bitwise repeatable over grid sizes."""
    case, x = make_case([200, 0, 128, 77], H=512, I=320, seed=11)
    got = run(case, "cuda", clamp=clamp)
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    want = run(case, "cpu", clamp=clamp)
    compare(got, want, x["offs"], False)
    rows = group_rows(x["offs"])
    hg, hw = got.h.cpu()[rows].float(), want.h[rows].float()
    I = x["I"]
    for a, b, bound in ((hg[:, :I], hw[:, :I], clamp), (hg[:, I:], hw[:, I:], clamp), (hg[:, I:], hw[:, I:], -clamp)):
        # masks differ only where the tensor core's sum and the emulation's straddle the bound itself
        assert float(((a < bound) != (b < bound)).float().mean()) < 1e-3
    again = run(case, "cuda", num_sms=3, clamp=clamp)
    for a, b in zip(got, again):
        assert torch.equal(bits(a), bits(b)) if a.dtype == E4M3 else torch.equal(a, b)


@requires_sm90
def test_cuda_without_h_and_bitwise_repeatable_over_grid_sizes():
    case, x = make_case([300, 0, 128, 77], H=512, I=384, seed=7)
    first = run(case, "cuda")
    no_h = run(case, "cuda", save_h=False)
    assert no_h.h.numel() == 0
    assert torch.equal(bits(no_h.s_q), bits(first.s_q)) and torch.equal(first.s_sa, no_h.s_sa)
    for sms in (1, 7):
        again = run(case, "cuda", num_sms=sms)
        for a, b in zip(first, again):
            assert torch.equal(bits(a), bits(b)) if a.dtype == E4M3 else torch.equal(a, b)
