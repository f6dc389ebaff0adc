"""The FP8 L2 dgrad with the SwiGLU backward and the quantizing epilogue (prime_kernels.swiglu_bwd_fp8).

CPU: the op's CPU path (the emulation built from prime_kernels.mega.fp8) against the unquantized float64 formula, its
argument checks (raised before anything is written), the layouts and the fake kernel, the status() entry.
GPU (sm90): the CUDA op against the emulation on NaN-poisoned outputs, with uneven experts (an empty one, one whose
rows are not a multiple of 128 at the pool's end), padding and masked rows, with and without a clamp and with both
scale options; bitwise repeatability across grid sizes; the device finding for offsets off the 128-row grid; and
operands whose sums the tensor core makes exactly, where the outputs must equal the emulation's but for the sigmoid.

The kernel's values differ from the emulation's by the sigmoid (the SFU's approximation against torch's) and the
tensor core's FP8 accumulation (fewer mantissa bits than fp32, ACC_RTOL below), so the quantized bytes are compared
to one e4m3 step and the scales to that accumulation; where the fp32 values agree (almost everywhere) the bytes are
the same, which the tests require of all but a small fraction of them.
"""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from prime_kernels import _status
from prime_kernels import swiglu_bwd_fp8 as sbf
from prime_kernels.mega import fp8 as recipe

E4M3 = torch.float8_e4m3fn
KEY = "m_grouped_gemm_swiglu_bwd.fp8.sm90"


def make_case(counts, H=256, I=256, pad_last=False, masked=3, seed=0, device="cpu", pow2=False):
    """Pool rows of len(counts) experts (each padded to 128 rows, the last one too only with pad_last), routes,
    weights, dy quantized by qK, W2^T quantized by qW, and the saved h; padding rows hold NaN in dy_q and h."""
    gen = torch.Generator().manual_seed(seed)
    E = len(counts)
    offs = [0]
    for e, n in enumerate(counts):
        padded = (n + 127) // 128 * 128 if (e < E - 1 or pad_last) else n
        offs.append(offs[-1] + padded)
    M = offs[-1]
    num_routes = sum(counts) + 5
    route = torch.full((M,), -1, dtype=torch.int32)
    perm = torch.randperm(num_routes, generator=gen).to(torch.int32)
    k = 0
    for e, n in enumerate(counts):
        route[offs[e]:offs[e] + n] = perm[k:k + n]
        k += n
    live = (route >= 0).nonzero().flatten()
    if masked and live.numel():
        route[live[torch.randperm(live.numel(), generator=gen)[:masked]]] = -1  # masked routes inside an expert
    weights = torch.rand(num_routes, generator=gen) + 0.25
    dy = torch.randn(M, H, generator=gen).bfloat16()
    qdy = recipe.quantize_along_k(dy, 128, pow2)
    dy_q = qdy.data.clone()
    w2 = (torch.randn(E, H, I, generator=gen) * H ** -0.5).bfloat16()
    qw = recipe.quantize_weight(w2.transpose(1, 2).contiguous(), pow2)  # W2^T [E, I, H]
    h = (torch.randn(M, 2 * I, generator=gen) * 2).bfloat16()
    pad = route < 0
    pad[torch.tensor([r for e, n in enumerate(counts) for r in range(offs[e], offs[e] + n)], dtype=torch.long)] = False
    dy_q.view(torch.uint8)[pad] = 0x7F  # e4m3 NaN in padding rows: never read into an output
    h[pad] = float("nan")
    case = dict(dy_q=dy_q, dy_sa=qdy.scale.contiguous(), w2t_q=qw.data, w2t_sb=qw.scale.contiguous(),
                group_offsets=torch.tensor(offs, dtype=torch.int32), h=h, pool_src_route=route, topk_weights=weights)
    extra = dict(dy=dy, w2=w2, offs=offs, M=M, I=I, H=H)
    return {k: v.to(device) for k, v in case.items()}, extra


def poisoned(M, I, device):
    out = sbf.allocate_outputs(M, I, device)
    for t in out:
        if t.dtype == E4M3:
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
    return out


def run(case, device, clamp=0.0, pow2=False, num_sms=None, out=None):
    c = {k: v.to(device) for k, v in case.items()}
    M, I = c["dy_q"].shape[0], c["w2t_q"].shape[1]
    out = poisoned(M, I, device) if out is None else out
    return sbf.m_grouped_fp8_gemm_swiglu_bwd(**c, clamp=clamp, pow2_scales=pow2, num_sms=num_sms, out=out,
                                             allow_unverified=True)


def group_rows(offs):
    return torch.tensor([r for e in range(len(offs) - 1) for r in range(offs[e], offs[e + 1])], dtype=torch.long)


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


# ---------------------------------------------------------------------------------------------------------- CPU


def test_status_lists_the_kernel():
    """Verified on an H200: status() lists it like any built kernel (available where an sm90 device runs it)."""
    assert KEY not in _status.unverified()
    want = _status.AVAILABLE if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else None
    if want is not None:
        assert prime_kernels.status()[KEY] == want


@pytest.mark.parametrize("clamp", [0.0, 1.5])
@pytest.mark.parametrize("H,I", [(256, 256), (1088, 320)])  # (1088, 320): 64-wide last blocks along H and I
def test_cpu_op_follows_the_unquantized_formula(clamp, H, I):
    case, x = make_case([200, 0, 128, 77], H=H, I=I, masked=4)
    out = run(case, "cpu", clamp=clamp)
    offs, I = x["offs"], x["I"]
    rows = group_rows(offs)
    route = case["pool_src_route"].long()
    ok = (route >= 0)[rows]
    w = torch.where(route >= 0, case["topk_weights"][route.clamp(0)], torch.zeros(()))
    da = torch.empty(x["M"], I, dtype=torch.float64)
    for e in range(len(offs) - 1):
        r = slice(offs[e], offs[e + 1])
        da[r] = x["dy"][r].double() @ x["w2"][e].double()
    h = case["h"].double()
    g, u = h[:, :I], h[:, I:]
    gc, uc = (g.clamp(max=clamp), u.clamp(-clamp, clamp)) if clamp else (g, u)
    sig = torch.sigmoid(gc)
    ds = w[:, None].double() * da
    dg = ds * uc * sig * (1 + gc * (1 - sig))
    du = ds * gc * sig
    if clamp:
        dg, du = dg * (g < clamp), du * ((u > -clamp) & (u < clamp))
    dh = torch.cat([dg, du], 1)[rows][ok]
    aw = (w[:, None].double() * gc * sig * uc)[rows][ok]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    deq_k = (out.dh_q.float() * out.dh_sa.repeat_interleave(sbf.dh_scale_block(I), 1)).double()[rows][ok]
    assert rel(deq_k, dh) < 0.08
    tb = torch.arange(x["M"]) // 128
    deq_t = (out.dht_q.float() * out.dht_s[:, tb]).t().double()[rows][ok]
    assert rel(deq_t, dh) < 0.08
    deq_a = (out.awt_q.float() * out.awt_s[:, tb]).t().double()[rows][ok]
    assert rel(deq_a, aw) < 0.08
    dt = (da * gc * sig * uc)[rows][ok].sum(1)
    assert rel(out.dt_part[rows][ok].double().sum(1), dt) < 0.05
    # padding and masked rows: zeros in every output, whatever dy and h hold there
    dead = rows[~ok]
    assert bool((out.dh_q[dead].float() == 0).all()) and bool((out.dht_q[:, dead].float() == 0).all())
    assert bool((out.awt_q[:, dead].float() == 0).all()) and bool((out.dt_part[dead] == 0).all())


def test_cpu_op_blocks_dh_per_half_with_64_wide_last_blocks():
    """I = 320: dg and du are each quantized from their own first column in 1 x 128 blocks, the last 64 wide (its
    scale the amax of its 64 values / 448), and dh_sa gives every block's scale in each of its 64-column slots."""
    case, x = make_case([130, 77], H=192, I=320, masked=0, seed=5)
    out = run(case, "cpu")
    I, rows = 320, group_rows(x["offs"])
    assert out.dh_sa.shape == (x["M"], 2 * I // 64) and out.dt_part.shape == (x["M"], 3)
    rows = rows[case["pool_src_route"][rows] >= 0]  # routed rows (padding rows are zeros)
    q = out.dh_q[rows].float().abs()
    sa = out.dh_sa[rows]
    for base in (0, I):  # each block's largest value lands on 448: its amax is over that block's columns alone
        for b0, b1 in ((0, 128), (128, 256), (256, 320)):
            assert bool((q[:, base + b0:base + b1].amax(1) == 448).all()), (base, b0)
        s0 = base // 64
        assert torch.equal(sa[:, s0], sa[:, s0 + 1]) and torch.equal(sa[:, s0 + 2], sa[:, s0 + 3])
    assert not torch.equal(sa[:, 4], sa[:, 5]), "du's first block starts at column I, not in dg's tail block"


def test_cpu_op_is_the_recipe_on_its_own_da():
    """The quantized outputs are fp8.py's quantize functions of one fp32 dh, bit for bit (qK, and qT per expert with
    the grid from the expert's first row)."""
    case, x = make_case([130, 256], masked=0, seed=3)
    out = run(case, "cpu")
    offs = x["offs"]
    deq = out.dh_q.float() * out.dh_sa.repeat_interleave(128, 1)
    for e in range(len(offs) - 1):
        r = slice(offs[e], offs[e + 1])
        again = recipe.quantize_along_k(deq[r], 128)  # requantizing the dequantized values is the identity
        assert torch.equal(bits(again.data), bits(out.dh_q[r]))


def test_cpu_rejects_bad_arguments_before_writing():
    case, x = make_case([128, 60], masked=0)
    M, I = x["M"], x["I"]

    def expect(msg, **over):
        c = dict(case, **over)
        out = poisoned(M, I, "cpu")
        with pytest.raises((ValueError, TypeError, RuntimeError), match=msg):
            sbf.m_grouped_fp8_gemm_swiglu_bwd(**c, out=out, allow_unverified=True)
        assert all(bool(torch.isnan(t.float()).all()) for t in out), "an output was written"

    expect("multiple of 128 or M", group_offsets=torch.tensor([0, 100, M], dtype=torch.int32))
    expect("non-decreasing", group_offsets=torch.tensor([0, 128, M + 128], dtype=torch.int32))
    expect("float8_e4m3fn", dy_q=case["dy_q"].float())
    expect("dy_sa", dy_sa=case["dy_sa"][:, :1].contiguous())
    expect("w2t_sb", w2t_sb=case["w2t_sb"][:, :1].contiguous())
    expect("h must be", h=case["h"][:, :I].contiguous())
    expect("topk_weights must be float32", topk_weights=case["topk_weights"].double())
    expect("pool_src_route", pool_src_route=case["pool_src_route"][:10].contiguous())
    expect("group_offsets must be int32", group_offsets=case["group_offsets"][:2].contiguous())
    out = poisoned(M, I, "cpu")
    with pytest.raises(ValueError, match="clamp must be >= 0"):
        sbf.m_grouped_fp8_gemm_swiglu_bwd(**case, clamp=-1.0, out=out, allow_unverified=True)
    bad = out._replace(dht_q=torch.empty(2 * I, M + 1, dtype=E4M3))
    with pytest.raises(ValueError, match="out.dht_q"):
        sbf.m_grouped_fp8_gemm_swiglu_bwd(**case, out=bad, allow_unverified=True)
    c = dict(case, w2t_q=case["w2t_q"][:, :160].contiguous(), w2t_sb=case["w2t_sb"])
    with pytest.raises(ValueError, match=r"H \(\d+\) and I \(160\) must be positive multiples of 64"):
        sbf.m_grouped_fp8_gemm_swiglu_bwd(**c, allow_unverified=True)


def test_layouts_and_fake_kernel():
    M, I, H = 300, 256, 384
    out = sbf.allocate_outputs(M, I, "meta")
    assert [tuple(t.shape) for t in out] == [(M, 2 * I), (M, 2 * I // 128), (2 * I, M), (2 * I, 3), (I, M), (I, 3),
                                             (M, I // 128)]
    assert out.dh_sa.stride(0) == 1 and out.dh_sa.stride(1) % 4 == 0 and out.dh_sa.stride(1) >= M
    assert out.dht_s.stride(0) == 1 and out.awt_s.stride(0) == 1
    assert out.dht_q.stride(1) == 1 and out.dht_q.stride(0) % 16 == 0 and out.awt_q.stride(0) % 16 == 0
    assert [t.dtype for t in out] == [E4M3, torch.float32, E4M3, torch.float32, E4M3, torch.float32, torch.float32]
    m = dict(dy_q=torch.empty(M, H, dtype=E4M3, device="meta"),
             dy_sa=prime_kernels.grouped_gemm.k_block_major_empty(M, H // 128, "meta"),
             w2t_q=torch.empty(2, I, H, dtype=E4M3, device="meta"),
             w2t_sb=torch.empty(2, I // 128, H // 128, device="meta"),
             group_offsets=torch.empty(3, dtype=torch.int32, device="meta"),
             h=torch.empty(M, 2 * I, dtype=torch.bfloat16, device="meta"),
             route=torch.empty(M, dtype=torch.int32, device="meta"), weights=torch.empty(M, device="meta"))
    assert torch.ops.prime_kernels.m_grouped_fp8_gemm_swiglu_bwd_(*m.values(), *out, 0.0, False, 0) is None


# ---------------------------------------------------------------------------------------------------------- GPU


# Hopper's FP8 wgmma adds its products into the fp32 accumulator with fewer mantissa bits than fp32 (why the recipe
# promotes every 128 of K), so the kernel's fp32 sums differ from the emulation's by up to ~1e-3 of the magnitude of
# their terms (measured on the H200: up to 5.6e-4 of a row's amax): the tolerance of everything derived from them. A
# sum whose terms cancel has a larger error relative to itself, so the bounds are relative to a block's amax (448
# times its scale), and a scale (an amax that may be such a sum) is within ACC_RTOL in all but 1% of the blocks and
# within 10 ACC_RTOL in every one (measured: up to 1.3e-2 in 0.9% of the column scales of dh).
ACC_RTOL = 2e-3
BF16_STEP = 2.0 ** -7  # the largest relative step between adjacent bf16 values


def check_scales(name, a, b, pow2, floor=None, exact=False):
    """Power-of-two scales are equal or one factor of 2 apart (an amax near a power of two), in at most 1% of the
    blocks; plain scales are amax / 448, as above, relative to the larger of the emulation's scale and ``floor`` (the
    scale of the magnitude the amax's values were summed against, where that can be far larger). ``exact``: operands
    whose sums the tensor core makes exactly (with_exact_sums), so only the sigmoid can move an amax, by one bf16
    rounding of its value."""
    if exact:
        rel = ((a - b).abs() / b.abs().clamp_min(1e-30)).flatten()
        # a sigmoid off by 2^-18 relative (about eight times the SFU's) leaves 99.88% of them equal, at I = 320
        equal = (a == b).float().mean().item()
        assert equal >= 0.99, f"{name}: only {equal:.5f} of the scales equal the emulation's"
        assert rel.max().item() <= BF16_STEP, f"{name}: a scale differs by {rel.max().item():.3e}"
        return
    if not pow2:
        # the amaxes are of bf16 values (B6, B9): an accumulator's difference can move one by a bf16 step (2^-7)
        ref = b.abs() if floor is None else torch.maximum(b.abs(), floor)
        rel = ((a - b).abs() / ref.clamp_min(1e-30)).flatten()
        close = (rel <= ACC_RTOL + BF16_STEP).float().mean().item()
        assert close >= 0.99, f"{name}: only {close:.4f} of the scales within {ACC_RTOL} + a bf16 step of the emulation's"
        assert rel.max().item() <= 10 * ACC_RTOL + BF16_STEP, f"{name}: a scale differs by {rel.max().item():.3e}"
        return
    ratio = a / b
    assert bool(((ratio == 1) | (ratio == 2) | (ratio == 0.5)).all()), f"{name}: scales not a power of 2 apart"
    off = (ratio != 1).float().mean().item()
    assert off <= 0.01, f"{name}: {off:.4f} of the scales differ"


def row_scales_of_values(want, rows, kb):
    """[len(rows), 2I]: the emulation's row scale of each value of dh (dh_sa, one per kb columns), 0 where the row's
    block is all zeros (padding and masked rows: their scale 1 measures nothing)."""
    q = want.dh_q[rows].float().abs()
    live = q.view(q.shape[0], -1, kb).amax(-1) > 0
    return torch.where(live, want.dh_sa[rows], torch.zeros(())).repeat_interleave(kb, 1)


def compare(got, want, offs, M, pow2, exact=False):
    """got (CUDA) against want (the CPU emulation) on the rows of the groups. ``exact``: operands with exact sums
    (with_exact_sums): scales and bytes equal but where the sigmoid moves a bf16 rounding, by one bf16 step of a value
    at most."""
    rows = group_rows(offs)
    got = sbf.Fp8SwigluBwd(*(t.cpu() for t in got))
    tb_end = (offs[-1] + 127) // 128
    kb = got.dh_q.shape[1] // got.dh_sa.shape[1]  # dh_sa's columns per scale: 128, or 64 with I = 64 (mod 128)
    # A value's accumulation error is relative to its sum's terms, which its row's amax (448 times its row scale)
    # measures, not to the value: a column of dh over a 128-row block that holds a few routed rows (a group's last
    # ones) can have an amax that is a cancelled sum, far below those rows' amaxes (at H = I = 2880, blocks of 2 and
    # 4 routed rows: column scales 9.6% off, 34% with the clamp, every row scale within the bound). So each column
    # scale of dh is bounded relative to the largest row scale of its block's rows over its columns, and each value
    # of dh in qT form relative to its own row scale.
    row_scale = row_scales_of_values(want, rows, kb)
    floor = torch.zeros(want.dht_s.shape[0], tb_end)
    blocks = rows // 128
    for b in blocks.unique().tolist():
        floor[:, b] = row_scale[blocks == b].amax(0)
    check_scales("dh_sa", got.dh_sa[rows], want.dh_sa[rows], pow2, exact=exact)
    check_scales("dht_s", got.dht_s[:, :tb_end], want.dht_s[:, :tb_end], pow2, floor, exact)
    check_scales("awt_s", got.awt_s[:, :tb_end], want.awt_s[:, :tb_end], pow2, exact=exact)
    dt_got, dt_want = got.dt_part[rows], want.dt_part[rows]  # sums of 128 products that may cancel: absolute bound
    dt_tol = 1e-4 if exact else ACC_RTOL  # exact: the sum's order and the sigmoid
    torch.testing.assert_close(dt_got, dt_want, rtol=dt_tol, atol=dt_tol * dt_want.abs().max().item())
    pairs = [("dh_q", got.dh_q[rows], want.dh_q[rows], got.dh_sa[rows].repeat_interleave(kb, 1),
              want.dh_sa[rows].repeat_interleave(kb, 1), None),
             ("dht_q", got.dht_q[:, rows], want.dht_q[:, rows], got.dht_s[:, rows // 128], want.dht_s[:, rows // 128],
              row_scale.t()),
             ("awt_q", got.awt_q[:, rows], want.awt_q[:, rows], got.awt_s[:, rows // 128], want.awt_s[:, rows // 128],
              None)]
    # exact: a bf16 step of the block's amax for a value the sigmoid moved across a bf16 rounding
    acc = BF16_STEP if exact else ACC_RTOL
    for name, q, r, q_scale, r_scale, acc_scale in pairs:
        assert not bool(torch.isnan(q.float()).any()), f"{name}: a poisoned output byte was left unwritten"
        same = (bits(q) == bits(r)).float().mean().item()
        dq, dr = q.float() * q_scale, r.float() * r_scale
        # one e4m3 step at that magnitude (of the coarser scale), plus the accumulators' difference (of the block, or
        # of the value's row where that is larger)
        coarse = torch.maximum(q_scale, r_scale)
        acc_coarse = coarse if acc_scale is None else torch.maximum(coarse, acc_scale)
        step = torch.maximum(dr.abs() / 8, coarse * 2.0 ** -9) + acc * 448 * acc_coarse
        worst = ((dq - dr).abs() / step).max().item()
        print(f"[compare] {name}: {same:.5f} of the bytes equal, worst difference {worst:.3f} of the bound")
        assert same > (0.999 if exact else 0.98), f"{name}: only {same:.4f} of the bytes equal the emulation's"
        assert worst <= 1.01, f"{name}: a value differs by {worst:.3f} of one e4m3 step"


def with_exact_sums(case, seed):
    """The case with the e4m3 values of dy_q (its NaN padding rows kept) and of W2^T replaced by integers in [-2, 2]:
    a product is at most 4 and a k-block's sum of 128 at most 512 in magnitude, which the tensor core's accumulator
    holds exactly (10 bits below the leading one of its largest term would do; it keeps about 13), so the kernel's da
    equals the emulation's bit for bit: each promotion is one fused multiply-add by fp32(sa * sb) in both (fp8.py
    G3). The outputs then differ from the emulation's only where the sigmoid (the SFU's against torch's) moves a bf16
    rounding, and a wrong index or block anywhere is an error of order one, with no accumulation bound to hide in."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(case)
    dy = case["dy_q"].clone()
    pad = (dy.view(torch.uint8) == 0x7F).all(1)
    ints = torch.randint(-2, 3, dy.shape, generator=gen).float().to(E4M3)
    dy.view(torch.uint8)[~pad] = ints.view(torch.uint8)[~pad]
    out["dy_q"] = dy
    out["w2t_q"] = torch.randint(-2, 3, case["w2t_q"].shape, generator=gen).float().to(E4M3)
    return out


@requires_sm90
@pytest.mark.parametrize("clamp,pow2", [(0.0, False), (1.5, False), (0.0, True), (1.5, True)])
@pytest.mark.parametrize("counts,pad_last", [([200, 0, 128, 77], False), ([1, 300, 0], True), ([513], False)])
def test_cuda_matches_the_emulation(counts, pad_last, clamp, pow2):
    case, x = make_case(counts, pad_last=pad_last, masked=5, pow2=pow2, seed=len(counts))
    got = run(case, "cuda", clamp=clamp, pow2=pow2)
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    want = run(case, "cpu", clamp=clamp, pow2=pow2)
    compare(got, want, x["offs"], x["M"], pow2)


@requires_sm90
@pytest.mark.parametrize("clamp", [0.0, 1.5])
@pytest.mark.parametrize("counts,H,I", [([200, 0, 128, 77], 1088, 320), ([1, 300, 0], 256, 192),
                                        ([130, 256, 5, 60], 2880, 2880), ([513], 128, 64)])
def test_cuda_matches_the_emulation_with_64_wide_last_blocks(counts, H, I, clamp):
    """H or I = 64 (mod 128): the tail kernel, whose last tile holds 64 columns of I (nothing past I written: h's
    up half, the next row and the outputs' neighbours would show it), dh_sa per 64 columns."""
    case, x = make_case(counts, H=H, I=I, masked=5, seed=H + I)
    got = run(case, "cuda", clamp=clamp)
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    want = run(case, "cpu", clamp=clamp)
    assert got.dh_sa.shape[1] == 2 * I // sbf.dh_scale_block(I)
    compare(got, want, x["offs"], x["M"], False)
    again = run(case, "cuda", clamp=clamp, num_sms=3)
    for a, b in zip(got, again):
        assert torch.equal(bits(a), bits(b))


@requires_sm90
@pytest.mark.parametrize("clamp", [0.0, 1.5])
@pytest.mark.parametrize("counts,H,I", [([130, 256, 5, 60], 2880, 2880), ([200, 0, 128, 77], 1088, 320),
                                        ([130, 256, 5, 60], 1024, 1536)])
def test_cuda_with_exact_sums_matches_the_emulation_up_to_the_sigmoid(counts, H, I, clamp):
    """Operands whose sums are exact on the tensor core (with_exact_sums): every output equals the emulation's but
    where the sigmoid moves a bf16 rounding, in every column and 128-row block: blocks of a group's last few rows,
    the tail kernel's last tile of 64 columns (I = 64 mod 128) and the other kernel's, each CTA taking one tile or,
    with num_sms=3, dozens of them."""
    case, x = make_case(counts, H=H, I=I, masked=5, seed=H + I)
    case = with_exact_sums(case, seed=H + I + 1)
    want = run(case, "cpu", clamp=clamp)
    for sms in (None, 3):
        got = run(case, "cuda", clamp=clamp, num_sms=sms)
        torch.cuda.synchronize()
        prime_kernels.check_device_errors()
        compare(got, want, x["offs"], x["M"], False, exact=True)


@requires_sm90
def test_cuda_is_bitwise_repeatable_over_grid_sizes():
    case, x = make_case([300, 0, 128, 77], H=512, I=384, masked=5, seed=7)
    first = run(case, "cuda", clamp=1.5)
    for sms in (None, 1, 7):
        again = run(case, "cuda", clamp=1.5, num_sms=sms)
        for a, b in zip(first, again):
            assert torch.equal(bits(a), bits(b))


@requires_sm90
def test_cuda_offsets_off_the_128_row_grid_write_nothing():
    case, x = make_case([128, 100], masked=0)
    c = {k: v.cuda() for k, v in case.items()}
    c["group_offsets"] = torch.tensor([0, 100, x["M"]], dtype=torch.int32, device="cuda")  # unchecked on the host
    out = poisoned(x["M"], x["I"], "cuda")
    sbf.m_grouped_fp8_gemm_swiglu_bwd(**c, out=out, allow_unverified=True)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="FP8 L2 dgrad's group_offsets"):
        prime_kernels.check_device_errors()
    assert all(bool(torch.isnan(t.float()).all()) for t in out)
