"""The MXFP8 reference (prime_kernels.mxfp8) on the CPU: exact bytes on hand-made blocks, the scale rule
checked against its defining inequality, round-trip bounds, the blocked scale layout against hand-computed
positions and an independent formulation, the grouped layouts, and torch's own MX test helpers where they
can be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prime_kernels import mxfp8

E4M3 = torch.float8_e4m3fn


def qbytes(q: torch.Tensor) -> list[int]:
    return q.view(torch.uint8).flatten().tolist()


def sbytes(s: torch.Tensor) -> list[int]:
    return s.view(torch.uint8).flatten().tolist()


def block(values: list[float], fill: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One [1, 32] block: ``values`` first, the rest ``fill``."""
    row = list(values) + [fill] * (32 - len(values))
    return torch.tensor([row], dtype=torch.float64).to(dtype)


# e4m3fn bytes written out by hand: sign | exponent (4 bits, bias 7) | mantissa (3 bits).
B_1_0, B_1_125, B_1_25 = 0x38, 0x39, 0x3A
B_2M9, B_2M8 = 0x01, 0x02  # the two smallest subnormals, 2^-9 and 2^-8
B_224, B_240, B_256, B_448 = 0x76, 0x77, 0x78, 0x7E


# ---- shapes and argument checks -------------------------------------------------------------------------------

def test_shapes_and_dtypes():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    q, s = mxfp8.quantize_mxfp8_reference(x)
    assert q.dtype == E4M3 and q.shape == (3, 64) and q.is_contiguous()
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2) and s.is_contiguous()
    q0, s0 = mxfp8.quantize_mxfp8_reference(torch.randn(64, 5), axis=0)
    assert q0.shape == (64, 5) and s0.shape == (2, 5)


@pytest.mark.parametrize("shape,axis", [((4, 48), -1), ((4, 33), -1), ((31, 64), 0), ((2, 0 + 16), 1)])
def test_length_not_multiple_of_32_raises(shape, axis):
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8.quantize_mxfp8_reference(torch.ones(shape), axis=axis)


def test_bad_scale_mode_and_dtype_raise():
    with pytest.raises(ValueError, match="scale_mode"):
        mxfp8.quantize_mxfp8_reference(torch.ones(1, 32), scale_mode="ceil")
    with pytest.raises(TypeError):
        mxfp8.quantize_mxfp8_reference(torch.ones(1, 32, dtype=torch.float64))


def test_axis0_is_the_transpose_of_axis_last():
    x = torch.randn(96, 40, dtype=torch.bfloat16)
    q0, s0 = mxfp8.quantize_mxfp8_reference(x, axis=0)
    q1, s1 = mxfp8.quantize_mxfp8_reference(x.t().contiguous())
    assert qbytes(q0.t().contiguous()) == qbytes(q1)
    assert sbytes(s0.t().contiguous()) == sbytes(s1)


# ---- exact values on hand-made blocks -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_powers_of_two(mode):
    # amax 1 = 1.0 * 2^0: E = -8 in both modes (s = 1 <= 1.75); 1 -> 256, 0.5 -> 128, 2^-14 -> 2^-6 (smallest
    # normal, 0x08), 2^-17 -> 2^-9 (smallest subnormal).
    q, s = mxfp8.quantize_mxfp8_reference(block([1.0, 0.5, 2.0 ** -14, 2.0 ** -17], fill=0.25), scale_mode=mode)
    assert sbytes(s) == [127 - 8]
    assert qbytes(q)[:5] == [B_256, 0x70, 0x08, B_2M9, 0x68]  # 0.25 -> 64 = 1.0 * 2^6 -> (6 + 7) << 3


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_amax_power_of_two(mode):
    # amax 512 = 2^9: E = 1 either way, amax -> 256; 3.0 -> 1.5 (0x3C).
    q, s = mxfp8.quantize_mxfp8_reference(block([512.0, -3.0]), scale_mode=mode)
    assert sbytes(s) == [128]
    assert qbytes(q)[:3] == [B_256, 0x80 | 0x3C, 0x00]


def test_amax_448_exactly_and_just_above():
    # 448 = 1.75 * 2^8: both modes E = 0, 448 itself stored.
    for mode in ("rceil", "floor"):
        q, s = mxfp8.quantize_mxfp8_reference(block([448.0]), scale_mode=mode)
        assert sbytes(s) == [127] and qbytes(q)[0] == B_448
    # 449: rceil takes E = 1 (449 / 2 = 224.5 -> 224, no saturation); floor keeps E = 0 and saturates to 448.
    x = block([449.0, 232.0])
    q, s = mxfp8.quantize_mxfp8_reference(x, scale_mode="rceil")
    assert sbytes(s) == [128] and qbytes(q)[:2] == [B_224, 0x6E]  # 232 / 2 = 116: tie of 112 and 120 -> 112
    q, s = mxfp8.quantize_mxfp8_reference(x, scale_mode="floor")
    assert sbytes(s) == [127] and qbytes(q)[:2] == [B_448, B_224]  # 232: tie of 224 and 240 -> 224


def test_saturation_floor_mode_only():
    # amax 1.99 * 2^k: floor gives amax / 2^E in [448, 512) -> 448; rceil one exponent up, no element at 448.
    x = block([1.99 * 4, 1.9 * 4, -1.99 * 4])
    qf, sf = mxfp8.quantize_mxfp8_reference(x, scale_mode="floor")
    assert sbytes(sf) == [127 + 2 - 8]
    assert qbytes(qf)[:3] == [B_448, B_448, 0x80 | B_448]
    qr, sr = mxfp8.quantize_mxfp8_reference(x, scale_mode="rceil")
    assert sbytes(sr) == [127 + 2 - 7]
    assert qbytes(qr)[0] == B_256  # 1.99 * 4 / 2^-5 = 254.72 -> 256
    assert torch.all(qr.float().abs() < 448)


def test_round_to_nearest_even_at_boundaries():
    # amax 256 = 2^8 -> E = 0: values pass through unscaled, so the e4m3 rounding shows directly.
    vals = [256.0,
            1.0625,                 # tie between 1.0 and 1.125 -> 1.0 (even mantissa)
            1.1875,                 # tie between 1.125 and 1.25 -> 1.25
            1.0625 + 2.0 ** -20,    # just above the tie -> 1.125
            1.1875 - 2.0 ** -20,    # just below the tie -> 1.125
            2.0 ** -10,             # half the smallest subnormal: tie with 0 -> 0
            3 * 2.0 ** -10,         # tie between 2^-9 and 2^-8 -> 2^-8
            2.0 ** -10 + 2.0 ** -24,  # just above half the smallest subnormal -> 2^-9
            232.0,                  # tie between 224 and 240 -> 224
            248.0,                  # tie between 240 and 256 -> 256
            -1.0625]
    q, s = mxfp8.quantize_mxfp8_reference(block(vals), scale_mode="rceil")
    assert sbytes(s) == [127]
    assert qbytes(q)[:len(vals)] == [B_256, B_1_0, B_1_25, B_1_125, B_1_125, 0x00, B_2M8, B_2M9, B_224, B_256,
                                     0x80 | B_1_0]


def test_negative_numbers_mirror_positive():
    x = torch.randn(8, 64, dtype=torch.bfloat16) * 5
    x[x == 0] = 1.0
    qp, sp = mxfp8.quantize_mxfp8_reference(x.abs())
    qn, sn = mxfp8.quantize_mxfp8_reference(-x.abs())
    assert sbytes(sp) == sbytes(sn)
    assert qbytes(qn) == [b | 0x80 for b in qbytes(qp)]


def test_all_zero_block_and_signed_zero():
    q, s = mxfp8.quantize_mxfp8_reference(block([0.0, -0.0]))
    assert sbytes(s) == [0]
    assert qbytes(q)[:3] == [0x00, 0x80, 0x00]
    assert torch.all(mxfp8.dequantize_mxfp8_reference(q, s) == 0)


def test_nan_block():
    x = torch.cat([block([1.0, float("nan"), 3.0]), block([1.0, 2.0])], dim=1)
    q, s = mxfp8.quantize_mxfp8_reference(x)
    assert sbytes(s)[0] == 0xFF and sbytes(s)[1] == 127 - 7
    assert torch.isnan(q.float()[0, :32]).all()
    assert not torch.isnan(q.float()[0, 32:]).any()
    assert torch.isnan(mxfp8.dequantize_mxfp8_reference(q, s)[0, :32]).all()


def test_inf_block():
    q, s = mxfp8.quantize_mxfp8_reference(block([float("inf"), -float("inf"), 1.0e30, 1.0]))
    assert sbytes(s) == [254]
    assert qbytes(q)[:4] == [B_448, 0x80 | B_448, 0x00, 0x00]


def test_tiny_block_keeps_precision():
    # amax far below 448 * 2^-127: E clamps to -127 (byte 0) and the values are still scaled up by 2^127.
    x = block([2.0 ** -130, 3 * 2.0 ** -132, -(2.0 ** -133)])
    q, s = mxfp8.quantize_mxfp8_reference(x)
    assert sbytes(s) == [0]
    assert qbytes(q)[:3] == [0x20, 0x1C, 0x80 | 0x08]
    assert torch.equal(mxfp8.dequantize_mxfp8_reference(q, s)[0, :3], x[0, :3])


def test_hand_bytes_for_tiny_block_are_right():
    # The bytes used above, rebuilt from their definition: 2^-3 -> exponent field 4, 1.5 * 2^-5 -> 2 | 4,
    # 2^-6 -> field 1 (smallest normal); 2^-130 * 2^127 = 2^-3, 3 * 2^-132 * 2^127 = 1.5 * 2^-4 -> field 3 | 4.
    assert torch.tensor([0.125, 1.5 * 2 ** -4, -(2.0 ** -6)]).to(E4M3).view(torch.uint8).tolist() == [
        0x20, 0x1C, 0x80 | 0x08]


def test_e8m0_decoding():
    s = _e8m0([0, 1, 119, 127, 128, 254, 255])
    v = mxfp8.e8m0_to_float(s)
    assert v[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 2.0 ** -8, 1.0, 2.0, 2.0 ** 127]
    assert torch.isnan(v[6])
    # torch's own e8m0 -> fp32 conversion reads the bytes the same way
    assert torch.equal(v[:6], s[:6].float())


# ---- the scale rule against its definition --------------------------------------------------------------------

def _exhaustive_bf16_positive() -> torch.Tensor:
    bits = torch.arange(0x0001, 0x7F80, dtype=torch.int32).to(torch.int16)  # every positive finite bf16
    return bits.view(torch.bfloat16).float()


@pytest.mark.parametrize("source", ["bf16_all", "fp32_random"])
def test_rceil_is_the_smallest_sufficient_power_of_two(source):
    if source == "bf16_all":
        a = _exhaustive_bf16_positive()
    else:
        g = torch.Generator().manual_seed(0)
        a = torch.exp2(torch.empty(200_000).uniform_(-140, 127, generator=g)) * torch.rand(200_000, generator=g)
        a = a[(a > 0) & torch.isfinite(a)]
        # fp32 values straddling 448 * 2^k by one ulp, where a rounded division could go wrong
        edge = torch.tensor([448.0 * 2.0 ** k for k in range(-100, 100, 7)])
        a = torch.cat([a, edge, torch.nextafter(edge, edge * 2), torch.nextafter(edge, edge * 0)])
    e = mxfp8.mxfp8_scale_exponent(a, "rceil").to(torch.float64)
    a64 = a.to(torch.float64)
    unclamped = e > -127
    assert torch.all(448.0 * torch.exp2(e) >= a64)
    assert torch.all((448.0 * torch.exp2(e - 1) < a64)[unclamped])
    assert torch.all(a64[~unclamped] <= 448.0 * 2.0 ** -127)


def test_floor_is_floor_log2_minus_8():
    a = _exhaustive_bf16_positive()
    e = mxfp8.mxfp8_scale_exponent(a, "floor").to(torch.float64)
    a64 = a.to(torch.float64)
    ok = e > -127
    assert torch.all((torch.exp2(e + 8) <= a64)[ok]) and torch.all((a64 < torch.exp2(e + 9))[ok])
    assert torch.all(a64[~ok] < 2.0 ** -118)


# ---- round trip --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spread", [1e-3, 1.0, 1e4])
def test_round_trip_error_bound(dtype, spread):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 256, generator=g) * spread * torch.exp2(torch.randint(-6, 6, (64, 1), generator=g))).to(dtype)
    q, s = mxfp8.quantize_mxfp8_reference(x)
    d = mxfp8.dequantize_mxfp8_reference(q, s)
    xf = x.float()
    # e4m3 round to nearest: half an ulp, 2^-4 relative for normals, 2^-10 * 2^E absolute in the subnormal range.
    scale = mxfp8.e8m0_to_float(s).repeat_interleave(32, dim=1)
    bound = torch.maximum(xf.abs() * 2.0 ** -4, scale * 2.0 ** -10)
    assert torch.all((d - xf).abs() <= bound)
    # and the block's largest element keeps its full 3-bit precision, never saturated under rceil
    assert torch.all(q.float().abs() <= 448)
    assert torch.all(q.float().abs().reshape(64, 8, 32).amax(-1) >= 224)


def test_round_trip_of_representable_values_is_exact():
    # Every e4m3 value times a block scale survives the round trip unchanged.
    allq = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    allq = allq[torch.isfinite(allq)]
    x = (allq[: 224] * 2.0 ** -5).reshape(7, 32)
    x[:, 0] = 448 * 2.0 ** -5  # each block's amax exactly 448 * 2^-5 -> E = -5
    q, s = mxfp8.quantize_mxfp8_reference(x)
    assert set(sbytes(s)) == {122}
    assert torch.equal(mxfp8.dequantize_mxfp8_reference(q, s), x)


# ---- the blocked scale layout --------------------------------------------------------------------------------

def _e8m0(vals) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_blocked_hand_positions_small():
    # [3, 5] -> [128, 8]: two 128 x 4 tiles side by side; (r, c) at 512 * (c // 4) + 16 * r + c % 4 for r < 32.
    s = _e8m0([[10 * r + c + 1 for c in range(5)] for r in range(3)])
    b = mxfp8.to_blocked_scales(s)
    assert b.shape == (128, 8) and b.dtype == torch.float8_e8m0fnu
    flat = b.view(torch.uint8).flatten().tolist()
    expect = {0: 1, 3: 4, 16: 11, 33: 22, 36: 0, 512: 5, 512 + 16: 15, 512 + 32: 25, 512 + 1: 0}
    for pos, val in expect.items():
        assert flat[pos] == val, pos
    assert sum(1 for v in flat if v) == 15


def test_blocked_hand_positions_rows():
    # [130, 4] -> [256, 4]: rows 0..127 in tile 0, rows 128.. in tile 1; inside a tile row r goes to
    # 16 * (r % 32) + 4 * (r // 32).
    s = torch.zeros(130, 4, dtype=torch.uint8)
    for r, c, v in [(33, 2, 7), (127, 3, 9), (128, 0, 11), (129, 1, 13), (64, 0, 5)]:
        s[r, c] = v
    b = mxfp8.to_blocked_scales(s.view(torch.float8_e8m0fnu))
    flat = b.view(torch.uint8).flatten()
    assert b.shape == (256, 4)
    for pos, val in [(16 + 4 + 2, 7), (496 + 12 + 3, 9), (512, 11), (512 + 16 + 1, 13), (8, 5)]:
        assert flat[pos].item() == val, pos
    assert int((flat != 0).sum()) == 5


def _blocked_by_tiles(scale_u8: torch.Tensor) -> torch.Tensor:
    """An independent statement of the layout: cut into 128 x 4 tiles (row-tile major), each tile written as
    32 lines of 16 bytes, line i holding rows i, i + 32, i + 64, i + 96 (4 bytes each)."""
    rows, cols = scale_u8.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros(rp, cp, dtype=torch.uint8)
    padded[:rows, :cols] = scale_u8
    out = []
    for tr in range(rp // 128):
        for tc in range(cp // 4):
            tile = padded[tr * 128:(tr + 1) * 128, tc * 4:(tc + 1) * 4]
            for i in range(32):
                out.append(torch.cat([tile[i + 32 * j] for j in range(4)]))
    return torch.cat(out)


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (129, 5), (300, 12), (64, 130)])
def test_blocked_matches_independent_tiling_and_round_trips(rows, cols):
    s = torch.randint(0, 255, (rows, cols), dtype=torch.int32).to(torch.uint8)
    b = mxfp8.to_blocked_scales(s.view(torch.float8_e8m0fnu))
    assert torch.equal(b.view(torch.uint8).flatten(), _blocked_by_tiles(s))
    back = mxfp8.from_blocked_scales(b, rows, cols)
    assert torch.equal(back.view(torch.uint8), s)


def test_from_blocked_rejects_wrong_size():
    with pytest.raises(ValueError):
        mxfp8.from_blocked_scales(torch.zeros(100, dtype=torch.uint8), 3, 5)


def test_row_groups_layout():
    # groups of 50, 0 and 250 rows, K/32 = 3: [128 + 256, 4]; group 2 starts at row 128 of the buffer.
    s = torch.randint(0, 255, (300, 3), dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    b = mxfp8.blocked_scales_row_groups(s, [50, 50, 300])
    assert b.shape == (128 + 256, 4)
    assert torch.equal(mxfp8.from_blocked_scales(b[:128], 50, 3).view(torch.uint8), s[:50].view(torch.uint8))
    assert torch.equal(mxfp8.from_blocked_scales(b[128:], 250, 3).view(torch.uint8), s[50:].view(torch.uint8))
    with pytest.raises(ValueError):
        mxfp8.blocked_scales_row_groups(s, [60, 50, 300])


def test_k_groups_layout():
    # R = 5, K groups of 64, 0 and 128 elements (2, 0 and 4 scale columns): [128, 4 + 4], group 2 at byte 512.
    s = torch.randint(0, 255, (5, 6), dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    b = mxfp8.blocked_scales_k_groups(s, torch.tensor([64, 64, 192], dtype=torch.int32))
    assert b.shape == (128, 8)
    flat = b.view(torch.uint8).flatten()
    assert torch.equal(mxfp8.from_blocked_scales(flat[:512], 5, 2).view(torch.uint8), s[:, :2].view(torch.uint8))
    assert torch.equal(mxfp8.from_blocked_scales(flat[512:], 5, 4).view(torch.uint8), s[:, 2:].view(torch.uint8))
    with pytest.raises(ValueError, match="multiples of 32"):
        mxfp8.blocked_scales_k_groups(s, [48, 192])


# ---- torch's own helpers (torch.testing._internal.common_quantized) ---------------------------------------------

_TORCH_HELPER_CHECK = textwrap.dedent("""
    import torch
    from torch.testing._internal.common_quantized import to_blocked, to_mxfp
    from prime_kernels import mxfp8
    g = torch.Generator().manual_seed(2)
    bad = 0
    for dtype in (torch.bfloat16, torch.float32):
        for spread in (1e-30, 1e-3, 1.0, 3e4):
            x = (torch.randn(256, 512, generator=g) * spread).to(dtype)
            x[0, :32] = 0
            x[2, 7] = float("inf")
            x[3, 40] = -float("inf")
            q, s = mxfp8.quantize_mxfp8_reference(x)
            ts, tq = to_mxfp(x, format="mxfp8")
            bad += int((ts.view(torch.uint8) != s.view(torch.uint8)).sum())
            bad += int((tq.view(torch.uint8) != q.view(torch.uint8)).sum())
    for rows, cols in ((1, 1), (129, 5), (300, 12)):
        s = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
        s = s.view(torch.float8_e8m0fnu)
        bad += int((to_blocked(s).view(torch.uint8) != mxfp8.to_blocked_scales(s).view(torch.uint8).flatten()).sum())
    print("MISMATCHES", bad)
""")


def test_agrees_with_torch_mx_helpers(tmp_path: Path):
    """Bit-for-bit against torch's test helpers (to_mxfp, RCEIL; to_blocked) on bf16 and fp32 data without NaN.

    The helpers live in torch's test utilities, whose import needs the ``expecttest`` test dependency; when that
    alone is missing the check runs in a subprocess that provides an empty stand-in for it (nothing the two
    helpers use comes from it)."""
    env = dict(os.environ)
    pkg = Path(mxfp8.__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(pkg)] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        import expecttest  # noqa: F401
    except ModuleNotFoundError:
        (tmp_path / "expecttest.py").write_text("class TestCase:\n    pass\n")
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(tmp_path)])
    r = subprocess.run([sys.executable, "-c", _TORCH_HELPER_CHECK], capture_output=True, text=True, env=env,
                       timeout=300)
    if r.returncode != 0 and ("ImportError" in r.stderr or "ModuleNotFoundError" in r.stderr):
        pytest.skip(f"torch's MX test helpers are not importable here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    assert "MISMATCHES 0" in r.stdout, r.stdout


# ---- the CUDA kernel's host loop (csrc/common/quantize_mxfp8.cu) computes the reference's bits ----------------

_REPO = Path(__file__).resolve().parent.parent

_HOST_DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_bf16.h>
#include "common/quantize_mxfp8.hpp"
using namespace prime_kernels::common;
// in.bin (fp32 rows x cols) rows cols bf16? rceil? axis G ends... out.bin -> q, plain scales, blocked scales
int main(int argc, char** argv) {
  const long rows = atol(argv[2]), cols = atol(argv[3]);
  const int bf16 = atoi(argv[4]), rceil = atoi(argv[5]), axis = atoi(argv[6]), G = atoi(argv[7]);
  std::vector<float> x(rows * cols);
  FILE* f = fopen(argv[1], "rb");
  if (fread(x.data(), 4, x.size(), f) != x.size()) return 2;
  fclose(f);
  std::vector<__nv_bfloat16> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = __float2bfloat16_rn(x[i]);
  std::vector<int> ends(G + 1), starts(G + 1);
  for (int g = 0; g < G; ++g) ends[g] = atoi(argv[8 + g]);
  const Mxfp8GroupAxis gaxis = static_cast<Mxfp8GroupAxis>(axis);
  mxfp8_blocked_group_starts_host(ends.data(), G, gaxis, starts.data());
  const long per = cols / 32, prow = (rows + 127) / 128 * 128, pcol = (per + 3) / 4 * 4;
  long blk_bytes = prow * pcol;
  if (G) {  // the starts past the last group: one more group after it
    ends[G] = ends[G - 1];
    mxfp8_blocked_group_starts_host(ends.data(), G + 1, gaxis, starts.data());
    blk_bytes = gaxis == Mxfp8GroupAxis::kRows ? starts[G] * pcol : prow * starts[G];
  }
  std::vector<unsigned char> q(rows * cols), q2(rows * cols), plain(rows * per), blk(blk_bytes, 0);
  QuantizeMxfp8Args a;
  a.x = bf16 ? static_cast<const void*>(xb.data()) : static_cast<const void*>(x.data());
  a.x_type = bf16 ? Mxfp8InputType::kBf16 : Mxfp8InputType::kFp32;
  a.rows = rows; a.cols = cols; a.x_stride_row = cols; a.q = q.data(); a.q_stride_row = cols; a.rceil = rceil;
  a.scale = plain.data(); a.scale_ld = per;
  if (check_quantize_mxfp8_args(a)) return 3;
  quantize_mxfp8_host(a);
  a.q = q2.data(); a.scale = blk.data(); a.scale_layout = Mxfp8ScaleLayout::kBlocked;
  if (G) { a.group_axis = gaxis; a.group_ends = ends.data(); a.group_starts = starts.data(); a.num_groups = G; }
  if (check_quantize_mxfp8_args(a)) return 4;
  quantize_mxfp8_host(a);
  if (q != q2) return 5;
  FILE* o = fopen(argv[argc - 1], "wb");
  fwrite(q.data(), 1, q.size(), o); fwrite(plain.data(), 1, plain.size(), o); fwrite(blk.data(), 1, blk.size(), o);
  fclose(o);
  return 0;
}
"""


def _find_nvcc() -> str | None:
    try:
        found = subprocess.run(["bash", str(_REPO / "ci" / "find_nvcc.sh")], capture_output=True, text=True,
                               check=True, cwd=_REPO, timeout=120).stdout.strip()
        return found or None
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None


@pytest.fixture(scope="module")
def mxfp8_host_driver(tmp_path_factory) -> Path:
    src = _REPO / "csrc" / "common" / "quantize_mxfp8.cu"
    if not src.exists():
        pytest.skip("the CUDA sources are not next to these tests")
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc to build the kernel's host loop")
    d = tmp_path_factory.mktemp("mxfp8_host")
    (d / "drv.cpp").write_text(_HOST_DRIVER)
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-I", str(_REPO / "csrc"), str(d / "drv.cpp"), str(src),
                        "-o", str(d / "drv")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return d / "drv"


def _host_quantize(drv: Path, x: torch.Tensor, bf16: bool, rceil: bool, ends: list[int], axis: int = 0):
    """(q, plain scales, blocked scales) from the kernel's host loop; axis 1: row groups, 2: column groups."""
    rows, cols = x.shape
    inp, out = drv.parent / "in.bin", drv.parent / "out.bin"
    inp.write_bytes(x.to(torch.float32).contiguous().numpy().tobytes())
    r = subprocess.run([str(drv), str(inp), str(rows), str(cols), str(int(bf16)), str(int(rceil)), str(axis),
                        str(len(ends))]
                       + [str(e) for e in ends] + [str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)
    raw = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.uint8)
    per = cols // 32
    return raw[:rows * cols].reshape(rows, cols), raw[rows * cols:rows * cols + rows * per].reshape(rows, per), \
        raw[rows * cols + rows * per:]


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("rceil", [True, False])
def test_cuda_host_loop_matches_reference(mxfp8_host_driver, bf16, rceil):
    g = torch.Generator().manual_seed(4)
    for spread in (1e-35, 1e-3, 1.0, 1e30):
        x = torch.randn(300, 160, generator=g) * spread
        x = x * torch.exp2(torch.randint(-8, 8, (300, 1), generator=g).float())
        x[0, :32] = 0
        x[1, 3] = float("nan")
        x[2, 40] = float("inf")
        x[3, 70] = -float("inf")
        x[4, :32] = -0.0
        x[5] = torch.tensor([448.0 * 2.0 ** k for k in range(-20, 20)] * 4)
        x[6] = torch.nextafter(x[5], x[5] * 2)  # one ulp above 448 * 2^k (fp32 only: bf16 rounds it back)
        xin = x.to(torch.bfloat16) if bf16 else x
        rq, rs = mxfp8.quantize_mxfp8_reference(xin, scale_mode="rceil" if rceil else "floor")
        cases = [(0, [], mxfp8.to_blocked_scales(rs)),
                 (1, [50, 50, 177, 300], mxfp8.blocked_scales_row_groups(rs, [50, 50, 177, 300])),
                 (1, [20, 130], mxfp8.blocked_scales_row_groups(rs[:130], [20, 130])),  # rows past the last end
                 (2, [64, 64, 96, 160], mxfp8.blocked_scales_k_groups(rs, [64, 64, 96, 160])),
                 (2, [32], mxfp8.blocked_scales_k_groups(rs[:, :1], [32]))]  # columns past the last end
        for axis, ends, want in cases:
            q, plain, blk = _host_quantize(mxfp8_host_driver, x, bf16, rceil, ends, axis)
            assert torch.equal(q, rq.view(torch.uint8)), (spread, ends)
            assert torch.equal(plain, rs.view(torch.uint8)), (spread, ends)
            assert torch.equal(blk, want.view(torch.uint8).flatten()), (spread, axis, ends)


def test_cuda_host_loop_every_bf16_amax(mxfp8_host_driver):
    # each bf16 bit pattern once as a block's amax (element 0), with a fraction of it beside it to be rounded
    vals = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    blocks = torch.zeros(vals.numel(), 32)
    blocks[:, 0] = vals
    blocks[:, 1] = vals * 0.3
    blocks[:, 2] = -vals * 0.0071
    allb = blocks.reshape(-1, 512)
    for rceil in (True, False):
        rq, rs = mxfp8.quantize_mxfp8_reference(allb, scale_mode="rceil" if rceil else "floor")
        q, plain, _ = _host_quantize(mxfp8_host_driver, allb, False, rceil, [])
        assert torch.equal(q, rq.view(torch.uint8)) and torch.equal(plain, rs.view(torch.uint8))
