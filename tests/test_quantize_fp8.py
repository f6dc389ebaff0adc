"""The blockwise-FP8 quantizing producers (prime_kernels.quantize): dispatch_rows_fp8 (qK 1x128 in the dispatch) and
quantize_tokens_fp8 (qT of pool rows), against the recipe (prime_kernels.mega.fp8) bit for bit on the CPU, the CUDA
ops against the CPU ops bit for bit, and their outputs through the FP8 GEMMs.

"Bit for bit": the e4m3 bytes (compared as uint8) and the fp32 scales (compared as int32 bits). The inputs are built
to reach the rounding's corners: rows whose magnitudes span bf16's range down to its subnormals (so scales are
subnormal or the quotient underflows to 0, scale 1), all-zero blocks, and values whose quotient lands on, or one
bf16 step beside, a midpoint between two e4m3 values (ties to even, in the normal and in the subnormal e4m3 range),
with general and with power-of-two scales.
"""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from conftest import requires_host_cxx, requires_sm90, run_host_check
from prime_kernels.mega import fp8 as recipe
from prime_kernels.quantize import k_block_major_empty
from prime_kernels.routing import routing_plan_reference

E4M3 = torch.float8_e4m3fn
POW2 = [False, True]
on_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, for exact comparisons (e4m3 as uint8, fp32 as int32: -0 differs from 0, NaN equals itself)."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def poisoned_e4m3(*shape, device="cpu") -> torch.Tensor:
    return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(E4M3)  # e4m3 NaN


def e4m3_midpoints() -> torch.Tensor:
    """Every midpoint between two adjacent non-negative e4m3 values (subnormal and normal range), in fp32."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448, 0x7f (NaN) left out
    return (vals[:-1] + vals[1:]) / 2


def bf16_neighbours(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, and the bf16 values one step below and above it (positive x)."""
    b = x.bfloat16().view(torch.int16)
    return torch.cat([b - 1, b, b + 1]).view(torch.bfloat16)


def hard_rows(T: int, H: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [T, H]: row magnitudes from 2^-133 (bf16 subnormals) to 2^100, all-zero blocks, and blocks whose values
    sit on or beside e4m3 midpoints after division by their scale. Beyond 500 rows the first 500 repeat."""
    if T > 500:
        return hard_rows(500, H, gen).repeat((T + 499) // 500, 1)[:T].contiguous()
    x = torch.randn(T, H, generator=gen) * torch.exp2(torch.randint(-133, 100, (T, 1), generator=gen).float())
    x = x.bfloat16()
    mids = e4m3_midpoints()
    blocks = -(-H // 128)  # a 64-wide last block when H = 64 (mod 128): its part of each pattern below
    for t in range(T):
        kind = t % 5
        j = t % blocks
        blk = slice(128 * j, min(128 * (j + 1), H))
        n = blk.stop - blk.start
        if kind == 1:
            x[t, blk] = 0
        elif kind == 2:  # amax 448 * 2^e: scale 2^e exactly (both options), quotients exactly on the midpoints
            e = int(torch.randint(-120, 100, (1,), generator=gen))
            vals = torch.cat([torch.tensor([448.0]), mids[torch.randint(0, len(mids), (127,), generator=gen)]])
            sign = torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)
            sign[0] = 1.0
            x[t, blk] = (vals * sign * 2.0 ** e).bfloat16()[:n]
        elif kind == 3:  # a general scale: quotients near the midpoints, one bf16 step to either side
            amax = 300.0 * 2.0 ** int(torch.randint(-60, 60, (1,), generator=gen))
            scale = torch.tensor(amax, dtype=torch.float32) / 448.0
            pick = mids[torch.randint(0, len(mids), (43,), generator=gen)] * scale
            vals = torch.cat([torch.tensor([amax]).bfloat16(), bf16_neighbours(pick)[:127]])
            x[t, blk] = vals[torch.randperm(128, generator=gen)][:n]
        elif kind == 4:  # tiny: the quotient underflows to 0 (scale 1) or is a subnormal fp32
            x[t, blk] = (torch.randn(128, generator=gen) * 2.0 ** -130).bfloat16()[:n]
    return x


def random_routes(T: int, K: int, num_rows: int, masked_frac: float, gen: torch.Generator) -> torch.Tensor:
    """route_to_pool [T, K]: distinct pool rows (of num_rows >= T * K), a share masked (-1)."""
    rows = torch.randperm(num_rows, generator=gen)[: T * K].to(torch.int32).view(T, K)
    rows[torch.rand(T, K, generator=gen) < masked_frac] = -1
    return rows.contiguous()


def test_status_lists_both_producers_on_every_family_and_none_unverified():
    from prime_kernels import _status

    notes = _status.unverified()
    for stem in ("dispatch_rows.fp8", "quantize_tokens.fp8"):
        for fam in ("sm90", "sm100"):
            key = f"{stem}.{fam}"
            assert key in prime_kernels.status(), key
            assert key not in notes, key  # their GPU tests passed on an H200


# --------------------------------------------------------------------------------------------- dispatch_rows_fp8


def dispatch_expected(src, r2p, num_rows, pow2):
    """The recipe's qK(src) placed at the routes' rows; other rows NaN (q) / NaN (sa)."""
    qk = recipe.quantize_along_k(src, pow2_scales=pow2)
    q = poisoned_e4m3(num_rows, src.shape[1])
    sa = torch.full((num_rows, -(-src.shape[1] // 128)), float("nan"))
    for t, row in enumerate(r2p.tolist()):
        for p in row:
            if p >= 0:
                q[p], sa[p] = qk.data[t], qk.scale[t]
    return q, sa


def poisoned_dispatch_out(num_rows, H, device="cpu"):
    sa = k_block_major_empty(num_rows, -(-H // 128), device)
    sa.fill_(float("nan"))
    return poisoned_e4m3(num_rows, H, device=device), sa


@pytest.mark.parametrize("pow2", POW2)
@pytest.mark.parametrize("T,K,H", [(0, 1, 128), (1, 1, 128), (1, 8, 256), (7, 2, 384), (33, 8, 128), (64, 1, 1024),
                                   (5, 2, 64), (9, 3, 192), (17, 4, 1088)])  # the last three: a 64-wide last block
def test_dispatch_cpu_is_the_recipe_bit_for_bit(T, K, H, pow2):
    gen = torch.Generator().manual_seed(1000 * T + 10 * K + pow2)
    src = hard_rows(T, H, gen) if T else torch.zeros(0, H, dtype=torch.bfloat16)
    num_rows = T * K + 5  # rows no route names
    r2p = random_routes(T, K, num_rows, 0.25, gen)
    q, sa = prime_kernels.dispatch_rows_fp8(src, r2p, num_rows, pow2_scales=pow2,
                                            out=poisoned_dispatch_out(num_rows, H))
    want_q, want_sa = dispatch_expected(src, r2p, num_rows, pow2)
    assert torch.equal(bits(q), bits(want_q)), "q differs from fp8.quantize_along_k (or an unrouted row was written)"
    assert torch.equal(bits(sa), bits(want_sa)), "sa differs from fp8.quantize_along_k's scales"
    assert sa.stride(0) == 1 and sa.stride(1) % 4 == 0  # the GEMM's K-block-major layout, as allocated


def test_dispatch_cpu_hits_the_corners():
    """The inputs reach what they are meant to: ties in both e4m3 ranges, underflowed and subnormal scales, zero
    blocks (so the bit-for-bit test above is not passing on easy values only)."""
    gen = torch.Generator().manual_seed(5)
    src = hard_rows(40, 256, gen)
    for pow2 in POW2:
        q, sa = prime_kernels.dispatch_rows_fp8(src, torch.arange(40, dtype=torch.int32)[:, None], 40, pow2_scales=pow2)
        s = sa.flatten()
        assert bool((s == 1).any()) and bool(((s > 0) & (s < torch.finfo(torch.float32).tiny)).any())
        quotient = src.float() / sa.repeat_interleave(128, 1)
        assert bool(torch.isin(quotient.abs(), e4m3_midpoints()).any()), "no quotient on a midpoint"
        assert bool(((quotient.abs() < 2.0 ** -6) & (quotient != 0)).any()), "no e4m3 subnormal"
        assert bool((q.float().abs() == 448).any())


def test_dispatch_pow2_scales_are_powers_of_two_above_the_quotient():
    src = hard_rows(20, 128, torch.Generator().manual_seed(6))
    _, sa = prime_kernels.dispatch_rows_fp8(src, torch.arange(20, dtype=torch.int32)[:, None], 20, pow2_scales=True)
    quotient = src.float().abs().amax(1, keepdim=True) / 448
    mantissa, _ = torch.frexp(sa)
    assert bool((mantissa == 0.5).all())
    assert bool(((sa >= quotient) & ((sa < 2 * quotient) | (quotient == 0))).all())


def test_dispatch_cpu_default_out_layout_feeds_the_gemm_without_a_copy():
    from prime_kernels.grouped_gemm import k_block_major_scales

    src = torch.randn(5, 256).bfloat16()
    q, sa = prime_kernels.dispatch_rows_fp8(src, torch.arange(5, dtype=torch.int32)[:, None], 6)
    assert q.shape == (6, 256) and q.dtype == E4M3 and sa.shape == (6, 2)
    assert k_block_major_scales(sa) is sa


def _dispatch_bad_cases():
    src = torch.randn(4, 256).bfloat16()
    r2p = torch.tensor([[0, 1], [2, -1], [3, 4], [5, 6]], dtype=torch.int32)
    rows = 8
    buf = torch.empty(2, 9)  # ld 9: not a multiple of 4
    misaligned = torch.empty(2 * 8 + 1)[1:].view(2, 8)[:, :rows].t()  # base 4 bytes past a 16-byte boundary
    q_misaligned = torch.empty(rows * 256 + 8, dtype=torch.uint8)[8:].view(E4M3).view(rows, 256)
    return [
        ("src dtype", (src.float(), r2p, None, None), "src must be a bfloat16"),
        ("route dtype", (src, r2p.long(), None, None), "route_to_pool must be a contiguous int32"),
        ("q dtype", (src, r2p, torch.empty(rows, 256, dtype=torch.uint8), None), "q must be a float8_e4m3fn"),
        ("sa dtype", (src, r2p, None, torch.empty(2, rows, dtype=torch.float64).t()), "sa must be a float32"),
        ("H not a multiple of 64", (torch.randn(4, 136).bfloat16(), r2p, None, None),
         r"H \(src's columns, 136\) must be a multiple of 64 \(one fp32 scale per 1 x 128 block, the last block 64 "
         r"wide when H is 64 mod 128\)"),
        ("route outside q", (src, torch.tensor([[0, 1], [2, 8], [3, 4], [5, 6]], dtype=torch.int32), None, None),
         r"route_to_pool\[3\] = 8 is outside \[-1, 8\)"),
        ("route below -1", (src, torch.tensor([[0, 1], [2, -2], [3, 4], [5, 6]], dtype=torch.int32), None, None),
         "is outside"),
        ("sa not K-block major", (src, r2p, None, torch.empty(rows, 2)), "K-block major"),
        ("ld_sa not a multiple of 4", (src, r2p, None, buf[:, :rows].t()), "ld_sa = 9"),
        ("ld_sa below the rows", (src, r2p, None, torch.empty(16).as_strided((rows, 2), (1, 4))), "ld_sa = 4"),
        ("sa misaligned", (src, r2p, None, misaligned), "16-byte aligned"),
        ("q misaligned", (src, r2p, q_misaligned, None), "16-byte aligned"),
        ("q row stride", (src, r2p, poisoned_e4m3(rows, 264)[:, :256], None), "ld_q = 264"),
    ]


@pytest.mark.parametrize("case", _dispatch_bad_cases(), ids=lambda c: c[0])
def test_dispatch_bad_arguments_raise_before_anything_is_written(case):
    _, (src, r2p, q, sa), message = case
    rows = 8
    q = poisoned_e4m3(rows, src.shape[1]) if q is None else q
    sa = k_block_major_empty(rows, 2, "cpu") if sa is None else sa
    if sa.dtype == torch.float32:
        sa.fill_(float("nan"))
    if q.dtype == E4M3:
        q.view(torch.uint8).fill_(0x7F)
    with pytest.raises((RuntimeError, TypeError), match=message):
        torch.ops.prime_kernels.dispatch_rows_fp8_(src, r2p, q, sa, False)
    if q.dtype == E4M3:
        assert bool((q.view(torch.uint8) == 0x7F).all()), "a refused call wrote q"
    if sa.dtype == torch.float32:
        assert bool(sa.isnan().all()), "a refused call wrote sa"


def test_dispatch_cpu_op_passes_opcheck():
    src = torch.randn(3, 256).bfloat16()
    r2p = torch.tensor([[0, 4], [-1, 2], [1, 3]], dtype=torch.int32)
    q, sa = poisoned_dispatch_out(6, 256)
    # test_schema is left out: its mutation check does arithmetic on every input, which torch has no CPU kernel
    # for on float8_e4m3fn
    torch.library.opcheck(torch.ops.prime_kernels.dispatch_rows_fp8_.default, (src, r2p, q, sa, True),
                          test_utils=("test_autograd_registration", "test_faketensor"))


# --------------------------------------------------------------------------------------------- quantize_tokens_fp8


def pool_layout(counts: list[int], extra_rows: int = 0, ragged_end: bool = False):
    """(offsets, counts) int32 of a routing plan's pool: each expert's range its count rounded up to 128; with
    ragged_end the last expert's range ends at its count (P not a multiple of 128); extra_rows rows in no expert."""
    offs = [0]
    for e, c in enumerate(counts):
        offs.append(offs[-1] + (c if ragged_end and e == len(counts) - 1 else (c + 127) // 128 * 128))
    return torch.tensor(offs, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32), offs[-1] + extra_rows


def tokens_expected(v, offsets, counts, pow2):
    """The recipe's qT applied per expert on its rows with the padding zeroed; rows in no expert as zeros (q 0,
    scale 1); q [C, P], scale [C, ceil(P / 128)]."""
    P, C = v.shape
    q = torch.zeros(C, P, dtype=E4M3)
    scale = torch.ones(C, (P + 127) // 128)
    o, n = offsets.tolist(), counts.tolist()
    for e in range(len(n)):
        lo, hi = o[e], o[e + 1]
        if hi == lo:
            continue
        rows = v[lo:hi].float().clone()
        rows[n[e]:] = 0
        qt = recipe.quantize_along_tokens(rows, pow2_scales=pow2)  # data [hi - lo, C], scale [blocks, C]
        q[:, lo:hi] = qt.data.t()
        scale[:, lo // 128: lo // 128 + qt.scale.shape[0]] = qt.scale.t()
    return q, scale


def pool_rows(offsets, counts, P, C, gen, garbage=True, hard=True):
    """bf16 [P, C] pool rows: in the live rows hard_rows' values laid along the token axis (each column's 128-row
    blocks get its corners), or (hard=False) unit normals; huge values in the padding and in rows of no expert (which
    must neither be quantized nor raise an amax)."""
    if hard:
        v = hard_rows(C, (P + 127) // 128 * 128, gen).t()[:P].contiguous() if P else torch.zeros(0, C).bfloat16()
    else:
        v = torch.randn(P, C, generator=gen).bfloat16()
    live = torch.zeros(P, dtype=torch.bool)
    o = offsets.tolist()
    for e, c in enumerate(counts.tolist()):
        live[o[e]:o[e] + c] = True
    if garbage:
        v[~live] = torch.full((int((~live).sum()), C), 3.0e38).bfloat16()
    return v


def poisoned_tokens_out(P, C, device="cpu", pad=0):
    """NaN-filled (q, scale) as the op allocates them, and q's whole buffer (row stride >= P + pad)."""
    buf = poisoned_e4m3(C, (P + 15) // 16 * 16 + pad, device=device)
    scale = k_block_major_empty(C, (P + 127) // 128, device)
    scale.fill_(float("nan"))
    return buf[:, :P], scale, buf


TOKEN_CASES = [
    ([0], 0, False, 8),                      # one empty expert, no rows
    ([1], 0, False, 8),                      # one row, eight columns
    ([5, 0, 130, 1, 256], 0, False, 72),     # empty experts, block boundaries, a partial column tile
    ([127, 128, 129], 37, False, 136),       # rows in no expert after the last one
    ([300, 3], 0, True, 64),                 # P = 687: the last expert ends at its count, P % 16 != 0
    ([0, 0, 0], 256, False, 16),             # no live row anywhere
]


@pytest.mark.parametrize("pow2", POW2)
@pytest.mark.parametrize("counts,extra,ragged,C", TOKEN_CASES)
def test_tokens_cpu_is_the_recipe_per_expert_bit_for_bit(counts, extra, ragged, C, pow2):
    gen = torch.Generator().manual_seed(sum(counts) + C + extra + pow2)
    offsets, cnt, P = pool_layout(counts, extra, ragged)
    v = pool_rows(offsets, cnt, P, C, gen)
    q, scale, buf = poisoned_tokens_out(P, C, pad=16)
    prime_kernels.quantize_tokens_fp8(v, offsets, cnt, pow2_scales=pow2, out=(q, scale))
    want_q, want_s = tokens_expected(v, offsets, cnt, pow2)
    assert torch.equal(bits(q), bits(want_q)), "q differs from fp8.quantize_along_tokens per expert"
    assert torch.equal(bits(scale), bits(want_s)), "scale differs from fp8.quantize_along_tokens per expert"
    assert bool((buf[:, P:].view(torch.uint8) == 0x7F).all()), "a byte past the pool's rows was written"


def test_tokens_padding_is_not_read():
    """Huge values in the padding rows change nothing: the result equals that of zeros there."""
    offsets, cnt, P = pool_layout([3, 140], 20)
    gen = torch.Generator().manual_seed(9)
    v = pool_rows(offsets, cnt, P, 64, gen, garbage=False)
    clean = prime_kernels.quantize_tokens_fp8(v, offsets, cnt)
    v2 = pool_rows(offsets, cnt, P, 64, torch.Generator().manual_seed(9), garbage=True)
    assert not torch.equal(v, v2)
    dirty = prime_kernels.quantize_tokens_fp8(v2, offsets, cnt)
    assert torch.equal(bits(clean[0]), bits(dirty[0])) and torch.equal(bits(clean[1]), bits(dirty[1]))


def test_tokens_default_out_layout_is_what_the_k_grouped_gemm_takes():
    from prime_kernels.grouped_gemm import k_block_major_scales

    offsets, cnt, P = pool_layout([5, 200], ragged_end=True)
    q, scale = prime_kernels.quantize_tokens_fp8(torch.randn(P, 24).bfloat16(), offsets, cnt)
    assert q.shape == (24, P) and q.stride(1) == 1 and q.stride(0) % 16 == 0 and q.stride(0) >= P
    assert scale.shape == (24, 3) and k_block_major_scales(scale) is scale


def _tokens_bad_cases():
    offsets, counts, P = pool_layout([5, 130])  # offsets [0, 128, 384]
    v = torch.randn(P, 64).bfloat16()
    return [
        ("v dtype", (v.float(), offsets, counts, None, None), "v must be a bfloat16"),
        ("offsets dtype", (v, offsets.long(), counts, None, None), "expert_offsets must be a contiguous 1-D int32"),
        ("counts length", (v, offsets, counts[:1], None, None), r"expert_counts must be .* \[E\]"),
        ("q dtype", (v, offsets, counts, torch.empty(64, P, dtype=torch.uint8), None), "q must be a float8_e4m3fn"),
        ("q shape", (v, offsets, counts, poisoned_e4m3(P, 64), None), r"q must be a float8_e4m3fn \[C, P\]"),
        ("cols not a multiple of 8", (torch.randn(P, 12).bfloat16(), offsets, counts, poisoned_e4m3(12, P),
                                      k_block_major_empty(12, 3, "cpu")), "cols \\(12\\) must be a multiple of 8"),
        ("offset not a multiple of 128", (v, torch.tensor([0, 100, 384], dtype=torch.int32), counts, None, None),
         r"expert_offsets\[1\] = 100"),
        ("offsets decrease", (v, torch.tensor([0, 256, 128], dtype=torch.int32), counts, None, None),
         r"expert_offsets\[2\] = 128"),
        ("offset past the rows", (v, torch.tensor([0, 128, 512], dtype=torch.int32), counts, None, None),
         r"expert_offsets\[2\] = 512"),
        ("count past the expert's rows", (v, offsets, torch.tensor([129, 5], dtype=torch.int32), None, None),
         r"expert_counts\[0\] = 129 is outside \[0, 128\]"),
        ("negative count", (v, offsets, torch.tensor([5, -1], dtype=torch.int32), None, None),
         r"expert_counts\[1\] = -1"),
        ("q row stride", (v, offsets, counts, poisoned_e4m3(64, P + 8)[:, :P], None), f"ld_q = {P + 8}"),
        ("scale ld not a multiple of 4", (v, offsets, counts, None, torch.empty(3, 66)[:, :64].t()), "ld_scale = 66"),
        ("scale misaligned", (v, offsets, counts, None, torch.empty(3 * 64 + 2)[2:].view(3, 64).t()),
         "16-byte aligned"),
    ]


@pytest.mark.parametrize("case", _tokens_bad_cases(), ids=lambda c: c[0])
def test_tokens_bad_arguments_raise_before_anything_is_written(case):
    _, (v, offsets, counts, q, scale), message = case
    P, C = v.shape
    q = poisoned_e4m3(C, P) if q is None else q
    scale = k_block_major_empty(C, (P + 127) // 128, "cpu") if scale is None else scale
    if q.dtype == E4M3:
        q.view(torch.uint8).fill_(0x7F)
    scale.fill_(float("nan"))
    with pytest.raises((RuntimeError, TypeError), match=message):
        torch.ops.prime_kernels.quantize_tokens_fp8_(v, offsets, counts, q, scale, False)
    if q.dtype == E4M3:
        assert bool((q.view(torch.uint8) == 0x7F).all()), "a refused call wrote q"
    assert bool(scale.isnan().all()), "a refused call wrote scale"


def test_tokens_cpu_op_passes_opcheck():
    offsets, counts, P = pool_layout([3, 0, 130])
    v = torch.randn(P, 16).bfloat16()
    q, scale, _ = poisoned_tokens_out(P, 16)
    torch.library.opcheck(torch.ops.prime_kernels.quantize_tokens_fp8_.default, (v, offsets, counts, q, scale, False),
                          test_utils=("test_autograd_registration", "test_faketensor"))


# --------------------------------------------------------------------------------------------- host C++ checks


@requires_host_cxx
def test_argument_checks_on_the_host(tmp_path):
    """The producers' checks (csrc/common/quantize_fp8_args.hpp), compiled here without CUDA: each bad argument fails
    with a message that names it, before anything would be launched."""
    run_host_check("quantize_fp8_args_check", tmp_path, timeout=60)


# --------------------------------------------------------------------------------------------- through the GEMMs


def plan_of(T, E, K, gen, device):
    idx = torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K]
    idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    plan = routing_plan_reference(idx, E, 128)
    return (plan.route_to_pool.contiguous().to(device), plan.expert_offsets.to(device),
            plan.expert_counts.to(device), plan.pool_src_route, int(plan.expert_offsets[-1]))


GEMM_DEVICES = ["cpu", pytest.param("cuda", marks=requires_sm90)]


@pytest.mark.parametrize("device", GEMM_DEVICES)
@pytest.mark.parametrize("pow2", POW2)
def test_dispatch_output_through_the_m_grouped_gemm(device, pow2):
    """L1 on the dispatched FP8 rows (recipe step F1) equals L1 on the recipe's qK of the token rows gathered into
    the pool, on the rows that hold tokens."""
    gen = torch.Generator().manual_seed(11 + pow2)
    T, E, K, H, N = 150, 4, 2, 256, 128
    r2p, offs, _, src_route, P = plan_of(T, E, K, gen, device)
    x = torch.randn(T, H, generator=gen).bfloat16()
    w = recipe.quantize_weight(torch.randn(E, N, H, generator=gen), pow2)
    q, sa = prime_kernels.dispatch_rows_fp8(x.to(device), r2p, P, pow2_scales=pow2)
    live = src_route[:P] >= 0
    tok = torch.where(live, src_route[:P] // K, 0).long()
    qk = recipe.quantize_along_k(x, pow2_scales=pow2)
    ref_q = torch.where(live[:, None], qk.data[tok].view(torch.uint8), 0).view(E4M3)
    ref_sa = torch.where(live[:, None], qk.scale[tok], 1.0)
    wd, ws = w.data.to(device), w.scale.to(device)
    got = prime_kernels.m_grouped_fp8_gemm_nt(q, sa, wd, ws, offs)
    want = prime_kernels.m_grouped_fp8_gemm_nt(ref_q.to(device), ref_sa.to(device), wd, ws, offs)
    assert torch.equal(bits(got[live.to(device)].float()), bits(want[live.to(device)].float()))


@pytest.mark.parametrize("device", GEMM_DEVICES)
@pytest.mark.parametrize("pow2", POW2)
def test_tokens_output_through_the_k_grouped_gemm(device, pow2):
    """dW = qT(dy_e)^T qT(x_e) per expert (recipe step B10) from the op's operands equals it from the recipe's
    quantization of each expert's rows, with garbage in the pool's padding rows."""
    gen = torch.Generator().manual_seed(21 + pow2)
    T, E, K, M, N = 200, 4, 2, 128, 64
    _, offs, counts, _, P = plan_of(T, E, K, gen, device)
    dy = pool_rows(offs.cpu(), counts.cpu(), P, M, gen, hard=False)
    xp = pool_rows(offs.cpu(), counts.cpu(), P, N, gen, hard=False)
    a, sa = prime_kernels.quantize_tokens_fp8(dy.to(device), offs, counts, pow2_scales=pow2)
    b, sb = prime_kernels.quantize_tokens_fp8(xp.to(device), offs, counts, pow2_scales=pow2)
    ra, rsa = tokens_expected(dy, offs.cpu(), counts.cpu(), pow2)
    rb, rsb = tokens_expected(xp, offs.cpu(), counts.cpu(), pow2)
    got = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs)
    want = prime_kernels.k_grouped_fp8_gemm_tn(*(t.to(device) for t in (ra, rsa, rb, rsb)), offs)
    assert torch.equal(bits(got), bits(want))


# --------------------------------------------------------------------------------------------- GPU


@requires_sm90
def test_status_says_both_producers_are_available_on_sm90():
    for key in ("dispatch_rows.fp8.sm90", "quantize_tokens.fp8.sm90"):
        assert prime_kernels.status()[key] == "available", key


@on_cuda
@pytest.mark.parametrize("pow2", POW2)
@pytest.mark.parametrize("T,K,H", [(1, 1, 128), (7, 8, 384), (1000, 8, 2048), (70000, 1, 128), (3, 2, 64),
                                   (300, 4, 1088), (1000, 8, 2880)])
def test_dispatch_cuda_equals_cpu_bit_for_bit(T, K, H, pow2):
    """T = 70000 runs past the grid's 65535 token rows (the kernel strides over the rest); H = 64, 1088 and 2880 end
    on a 64-wide block (the tail kernel)."""
    gen = torch.Generator().manual_seed(T + K + H + pow2)
    src = hard_rows(T, H, gen)
    num_rows = T * K + 3
    r2p = random_routes(T, K, num_rows, 0.25, gen)
    want_q, want_sa = prime_kernels.dispatch_rows_fp8(src, r2p, num_rows, pow2_scales=pow2,
                                                      out=poisoned_dispatch_out(num_rows, H))
    q, sa = prime_kernels.dispatch_rows_fp8(src.cuda(), r2p.cuda(), num_rows, pow2_scales=pow2,
                                            out=poisoned_dispatch_out(num_rows, H, "cuda"))
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(sa), bits(want_sa))


@on_cuda
@pytest.mark.parametrize("pow2", POW2)
@pytest.mark.parametrize("counts,extra,ragged,C", TOKEN_CASES + [([900, 0, 4000, 37], 128, False, 2048)])
def test_tokens_cuda_equals_cpu_bit_for_bit(counts, extra, ragged, C, pow2):
    gen = torch.Generator().manual_seed(sum(counts) + C + pow2)
    offsets, cnt, P = pool_layout(counts, extra, ragged)
    v = pool_rows(offsets, cnt, P, C, gen)
    want_q, want_s = prime_kernels.quantize_tokens_fp8(v, offsets, cnt, pow2_scales=pow2)
    q, scale, buf = poisoned_tokens_out(P, C, "cuda", pad=16)
    prime_kernels.quantize_tokens_fp8(v.cuda(), offsets.cuda(), cnt.cuda(), pow2_scales=pow2, out=(q, scale))
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(scale), bits(want_s))
    assert bool((buf[:, P:].view(torch.uint8) == 0x7F).all()), "a byte past the pool's rows was written"


# ----------------------------------------------------------------------- quantize_tokens_fp8 gathering from token rows


def gathered_case(counts, extra, ragged, C, K, gen, masked_live_row=False):
    """(tokens [T, C], pool_src_route [P], offsets, counts, P, pool [P, C]): a plan's pool for the layout (live rows
    name distinct routes of T = ceil(live / K) + 1 tokens, padding and extra rows -1) and the pool that gathering it
    gives (zeros where a row names no route). masked_live_row: one live row's route is -1 (read as zeros)."""
    offsets, cnt, P = pool_layout(counts, extra, ragged)
    live = int(cnt.sum())
    T = (live + K - 1) // K + 1
    tokens = hard_rows(C, (T + 127) // 128 * 128, gen).t()[:T].contiguous() if T else torch.zeros(0, C).bfloat16()
    routes = torch.randperm(T * K, generator=gen)[:live].to(torch.int32)
    src = torch.full((P,), -1, dtype=torch.int32)
    o, i = offsets.tolist(), 0
    for e, c in enumerate(cnt.tolist()):
        src[o[e]:o[e] + c] = routes[i:i + c]
        i += c
    if masked_live_row and live:
        src[o[0] if cnt[0] > 0 else int((src >= 0).nonzero()[0])] = -1
    pool = torch.zeros(P, C).bfloat16()
    ok = src >= 0
    pool[ok] = tokens[src[ok].long() // K]
    return tokens, src, offsets, cnt, P, pool


GATHER_CASES = TOKEN_CASES + [([3, 0, 250, 77], 0, False, 2048)]


@pytest.mark.parametrize("K", [1, 8])
@pytest.mark.parametrize("counts,extra,ragged,C", GATHER_CASES)
def test_tokens_gathered_cpu_equals_the_gathered_pool_bit_for_bit(counts, extra, ragged, C, K):
    gen = torch.Generator().manual_seed(sum(counts) + C + extra + K)
    tokens, src, offsets, cnt, P, pool = gathered_case(counts, extra, ragged, C, K, gen, masked_live_row=True)
    want_q, want_s = prime_kernels.quantize_tokens_fp8(pool, offsets, cnt)
    q, scale, buf = poisoned_tokens_out(P, C, pad=16)
    prime_kernels.quantize_tokens_fp8(tokens, offsets, cnt, out=(q, scale), pool_src_route=src, top_k=K)
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(scale), bits(want_s))
    assert bool((buf[:, P:].view(torch.uint8) == 0x7F).all()), "a byte past the pool's rows was written"


def test_tokens_gathered_cpu_refuses_a_route_past_the_tokens_before_writing():
    gen = torch.Generator().manual_seed(3)
    tokens, src, offsets, cnt, P, _ = gathered_case([5, 130], 0, False, 64, 2, gen)
    src[129] = tokens.shape[0] * 2  # a live row of the second expert
    q, scale, _ = poisoned_tokens_out(P, 64)
    with pytest.raises(RuntimeError, match=r"pool_src_route\[129\] = .* is past the"):
        prime_kernels.quantize_tokens_fp8(tokens, offsets, cnt, out=(q, scale), pool_src_route=src, top_k=2)
    assert bool((q.view(torch.uint8) == 0x7F).all()) and bool(scale.isnan().all()), "a refused call wrote"


def test_tokens_gathered_cpu_op_passes_opcheck():
    gen = torch.Generator().manual_seed(4)
    tokens, src, offsets, cnt, P, _ = gathered_case([3, 0, 130], 0, False, 16, 4, gen)
    q, scale, _ = poisoned_tokens_out(P, 16)
    torch.library.opcheck(torch.ops.prime_kernels.quantize_tokens_gathered_fp8_.default,
                          (tokens, src, 4, offsets, cnt, q, scale, False),
                          test_utils=("test_autograd_registration", "test_faketensor"))


@on_cuda
@pytest.mark.parametrize("pow2", POW2)
@pytest.mark.parametrize("counts,extra,ragged,C", GATHER_CASES + [([900, 0, 4000, 37], 128, False, 2048)])
def test_tokens_gathered_cuda_equals_cpu_bit_for_bit(counts, extra, ragged, C, pow2):
    gen = torch.Generator().manual_seed(sum(counts) + C + pow2)
    tokens, src, offsets, cnt, P, _ = gathered_case(counts, extra, ragged, C, 8, gen, masked_live_row=True)
    want_q, want_s = prime_kernels.quantize_tokens_fp8(tokens, offsets, cnt, pow2_scales=pow2, pool_src_route=src,
                                                       top_k=8)
    q, scale, buf = poisoned_tokens_out(P, C, "cuda", pad=16)
    prime_kernels.quantize_tokens_fp8(tokens.cuda(), offsets.cuda(), cnt.cuda(), pow2_scales=pow2, out=(q, scale),
                                      pool_src_route=src.cuda(), top_k=8)
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(scale), bits(want_s))
    assert bool((buf[:, P:].view(torch.uint8) == 0x7F).all()), "a byte past the pool's rows was written"


@on_cuda
def test_tokens_gathered_cuda_reports_a_route_past_the_tokens_and_reads_zeros():
    gen = torch.Generator().manual_seed(5)
    tokens, src, offsets, cnt, P, pool = gathered_case([5, 130], 0, False, 64, 2, gen)
    bad = src.clone()
    bad[129] = tokens.shape[0] * 2
    pool[129] = 0  # the row that route names is read as zeros
    want_q, want_s = prime_kernels.quantize_tokens_fp8(pool, offsets, cnt)
    prime_kernels.check_device_errors()
    q, scale = prime_kernels.quantize_tokens_fp8(tokens.cuda(), offsets.cuda(), cnt.cuda(), pool_src_route=bad.cuda(),
                                                 top_k=2)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="gathering quantize_tokens_fp8's pool_src_route"):
        prime_kernels.check_device_errors()
    assert torch.equal(bits(q), bits(want_q.cuda())) and torch.equal(bits(scale), bits(want_s.cuda()))


@on_cuda
def test_dispatch_cuda_reports_routes_outside_q():
    """Routes outside q write nothing and are raised by check_device_errors after a synchronisation, once."""
    src = torch.randn(3, 128).bfloat16().cuda()
    r2p = torch.tensor([[0, 7], [-1, 2], [-5, 100]], dtype=torch.int32, device="cuda")
    q, sa = poisoned_dispatch_out(4, 128, "cuda")
    prime_kernels.check_device_errors()  # nothing pending from earlier tests
    prime_kernels.dispatch_rows_fp8(src, r2p, 4, out=(q, sa))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="dispatch_rows_fp8's route_to_pool"):
        prime_kernels.check_device_errors()
    prime_kernels.check_device_errors()  # reported once
    want_q, want_sa = prime_kernels.dispatch_rows_fp8(src.cpu(), torch.tensor([[0, -1], [-1, 2], [-1, -1]],
                                                                              dtype=torch.int32), 4,
                                                      out=poisoned_dispatch_out(4, 128))
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(sa), bits(want_sa))


@on_cuda
@pytest.mark.parametrize("offsets,counts", [([0, 100, 256], [5, 3]), ([0, 128, 256], [5, 129]),
                                            ([0, 256, 128], [5, 3]), ([0, 128, 512], [5, 3])])
def test_tokens_cuda_broken_layout_writes_nothing_and_is_reported(offsets, counts):
    v = torch.randn(256, 64).bfloat16().cuda()
    q, scale, _ = poisoned_tokens_out(256, 64, "cuda")
    prime_kernels.check_device_errors()
    prime_kernels.quantize_tokens_fp8(v, torch.tensor(offsets, dtype=torch.int32, device="cuda"),
                                      torch.tensor(counts, dtype=torch.int32, device="cuda"), out=(q, scale))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="quantize_tokens_fp8's expert_offsets / expert_counts"):
        prime_kernels.check_device_errors()
    assert bool((q.view(torch.uint8) == 0x7F).all()) and bool(scale.isnan().all()), "a refused layout was written"


@requires_host_cxx
def test_division_free_quotient_is_the_division(tmp_path):
    """common::div_by_scale, the FP8 L2 dgrad epilogue's Q3 without a divide, gives the IEEE division's bits
    (tests/cpp/fp8_div_check.cpp, 2e7 cases built to hit e4m3 rounding boundaries, zeros and subnormal values)."""
    run_host_check("fp8_div_check", tmp_path, timeout=120)


# -- qT of e4m3 pool rows (quantize_tokens_fp8 with v_scale: the pooled rows of prime-rl's FP8 dispatch) ----------

E4M3_CASES = [
    ([5, 0, 130, 1, 256], 0, False, 128),   # empty experts, block boundaries
    ([127, 128, 129], 37, False, 256),      # rows in no expert after the last one
    ([300, 3], 0, True, 384),               # the last expert ends at its count, P % 16 != 0
    ([0, 0, 0], 256, False, 128),           # no live row anywhere
]


def e4m3_case(counts, extra, ragged, C, gen, pow2_in, block_major_scales):
    """(q e4m3 [P, C], v_scale fp32 [P, C/128], offsets, counts, P, dequantized bf16 pool): pool rows quantized 1 x 128
    (general or power-of-two scales), NaN bytes and NaN scales in the rows no expert holds live (never to be read);
    the scales row-major or K-block major."""
    offsets, cnt, P = pool_layout(counts, extra, ragged)
    v = pool_rows(offsets, cnt, P, C, gen, garbage=False)
    qv = recipe.quantize_along_k(v, pow2_scales=pow2_in)
    q, s = qv.data.clone(), qv.scale.clone()
    live = torch.zeros(P, dtype=torch.bool)
    for e, c in enumerate(cnt.tolist()):
        live[offsets[e]:offsets[e] + c] = True
    q.view(torch.uint8)[~live] = 0x7F
    s[~live] = float("nan")
    deq = (q.float() * s.repeat_interleave(128, dim=1)).bfloat16()  # fp32 product, rounded once to bf16
    if block_major_scales:
        sb = k_block_major_empty(P, C // 128, "cpu")
        sb.copy_(s)
        s = sb
    return q, s, offsets, cnt, P, deq


@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("pow2_in", POW2)
@pytest.mark.parametrize("counts,extra,ragged,C", E4M3_CASES)
def test_tokens_e4m3_cpu_equals_the_dequantized_pool_bit_for_bit(counts, extra, ragged, C, pow2_in, block_major):
    gen = torch.Generator().manual_seed(sum(counts) + C + extra + 2 * pow2_in + block_major)
    q_in, s_in, offsets, cnt, P, deq = e4m3_case(counts, extra, ragged, C, gen, pow2_in, block_major)
    for pow2 in POW2:
        want_q, want_s = prime_kernels.quantize_tokens_fp8(deq, offsets, cnt, pow2_scales=pow2)
        q, scale, buf = poisoned_tokens_out(P, C, pad=16)
        prime_kernels.quantize_tokens_fp8(q_in, offsets, cnt, pow2_scales=pow2, out=(q, scale), v_scale=s_in)
        assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(scale), bits(want_s))
        assert bool((buf[:, P:].view(torch.uint8) == 0x7F).all()), "a byte past the pool's rows was written"


def test_tokens_e4m3_refusals_write_nothing():
    gen = torch.Generator().manual_seed(8)
    q_in, s_in, offsets, cnt, P, _ = e4m3_case([5, 130], 0, False, 128, gen, True, False)
    q, scale, _ = poisoned_tokens_out(P, 128)
    with pytest.raises(RuntimeError, match=r"v_scale must be a float32 \[P, C / 128\]"):
        prime_kernels.quantize_tokens_fp8(q_in, offsets, cnt, out=(q, scale), v_scale=s_in[:, :0])
    with pytest.raises(RuntimeError, match="multiple of 128"):
        prime_kernels.quantize_tokens_fp8(q_in[:, :64], offsets, cnt, out=(poisoned_tokens_out(P, 64)[:2]),
                                          v_scale=s_in)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        prime_kernels.quantize_tokens_fp8(q_in.float().bfloat16(), offsets, cnt, out=(q, scale), v_scale=s_in)
    with pytest.raises(ValueError, match="do not combine"):
        prime_kernels.quantize_tokens_fp8(q_in, offsets, cnt, out=(q, scale), v_scale=s_in,
                                          pool_src_route=torch.zeros(P, dtype=torch.int32))
    assert bool((q.view(torch.uint8) == 0x7F).all()) and bool(scale.isnan().all()), "a refused call wrote"


def test_tokens_e4m3_cpu_op_passes_opcheck():
    gen = torch.Generator().manual_seed(9)
    q_in, s_in, offsets, cnt, P, _ = e4m3_case([3, 0, 130], 0, False, 128, gen, False, True)
    q, scale, _ = poisoned_tokens_out(P, 128)
    torch.library.opcheck(torch.ops.prime_kernels.quantize_tokens_e4m3_fp8_.default,
                          (q_in, s_in, offsets, cnt, q, scale, False),
                          test_utils=("test_autograd_registration", "test_faketensor"))


@on_cuda
@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("pow2", POW2)
@pytest.mark.parametrize("counts,extra,ragged,C", E4M3_CASES + [([900, 0, 4000, 37], 128, False, 2048)])
def test_tokens_e4m3_cuda_equals_cpu_bit_for_bit(counts, extra, ragged, C, pow2, block_major):
    gen = torch.Generator().manual_seed(sum(counts) + C + pow2 + block_major)
    q_in, s_in, offsets, cnt, P, _ = e4m3_case(counts, extra, ragged, C, gen, pow2, block_major)
    want_q, want_s = prime_kernels.quantize_tokens_fp8(q_in, offsets, cnt, pow2_scales=pow2, v_scale=s_in)
    q, scale, buf = poisoned_tokens_out(P, C, "cuda", pad=16)
    s_dev = s_in.cuda() if not block_major else k_block_major_empty(P, C // 128, "cuda").copy_(s_in)
    prime_kernels.quantize_tokens_fp8(q_in.cuda(), offsets.cuda(), cnt.cuda(), pow2_scales=pow2, out=(q, scale),
                                      v_scale=s_dev)
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(scale), bits(want_s))
    assert bool((buf[:, P:].view(torch.uint8) == 0x7F).all()), "a byte past the pool's rows was written"
