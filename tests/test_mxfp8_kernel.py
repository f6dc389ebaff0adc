"""Our MXFP8 quantization (csrc/common/quantize_mxfp8.cu through prime_kernels.mxfp8.quantize_mxfp8) against the
pure-torch reference, bit for bit: e4m3 bytes and e8m0 bytes, plain and in the blocked layout torch's scaled grouped
GEMM reads, whole or per group (rows: the 2d-3d A operand; columns: the 2d-2d operands), with empty groups, rows or
columns past the last group, T = 0 / 1 / odd, K a multiple of 32 but not of 128, strided inputs and outputs, special
values (inf, NaN, +-0, subnormals, the largest finite values) and outputs poisoned before the call, so that a byte
the call should write and did not, or should not write and did, shows.

Every case runs on the CPU (the kernel's host loop through the same op and C ABI) and on CUDA (the kernel itself;
skipped without a GPU). The bad-argument cases check that nothing is written.
"""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from prime_kernels import mxfp8 as mx

from conftest import requires_gpu

DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
POISON = 0xA5  # a finite e4m3 (-0.078125) and e8m0 byte no case produces where it checks for the poison


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def _data(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows whose 32-element blocks span the whole exponent range, with special values sown in: whole zero
    blocks, -0, inf, -inf, NaN, subnormals, the largest finite value, blocks of tiny values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    nblk = cols // 32
    if rows and nblk:
        scale_exp = torch.randint(-135, 120, (rows, nblk), generator=gen).to(torch.float64)
        x = x * torch.exp2(scale_exp).repeat_interleave(32, dim=1)
    x = x.to(torch.float32)
    flat = x.view(-1)
    n = flat.numel()
    if n >= 64:
        pick = torch.randperm(n, generator=gen)
        specials = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 3.0e38, -3.3e38, 1.0e-40, -2.0e-45,
                    448.0, 449.0, -464.0, 2.0 ** -126, 1.17e-38]
        for i, v in enumerate(specials):
            flat[pick[i]] = v
        x[0, :32] = 0.0  # a whole zero block
        if rows > 2:
            x[2, :32] = -0.0
            x[1, -32:] = torch.linspace(-1e-39, 1e-39, 32)  # a subnormal block
    return x.to(dtype)


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=torch.uint8, device=device).view(dtype)


def _expected_blocked(plain: torch.Tensor, nbytes: int, ends=None, axis: str = "rows", fill: int = POISON):
    """The bytes a blocked buffer of ``nbytes`` holds after the call: the reference's scales at their positions (per
    group as the grouped layouts place them), ``fill`` wherever nothing is written."""
    rows, per = plain.shape
    src = _bits(plain)
    out = torch.full((nbytes,), fill, dtype=torch.uint8)
    if ends is None:
        out[mx.blocked_index(rows, per).reshape(-1)] = src.reshape(-1)
        return out
    start = 0
    prev = 0
    for end in ends:
        if axis == "rows":
            if end > prev:
                out[(mx.blocked_index(end - prev, per) + start * ((per + 3) // 4 * 4)).reshape(-1)] = \
                    src[prev:end].reshape(-1)
            start += (end - prev + 127) // 128 * 128
        else:
            kb = (end - prev) // 32
            if kb:
                base = (rows + 127) // 128 * 128 * start
                out[(mx.blocked_index(rows, kb) + base).reshape(-1)] = src[:, prev // 32:end // 32].reshape(-1)
            start += (kb + 3) // 4 * 4
        prev = end
    return out


SHAPES = [(0, 64), (1, 32), (1, 96), (37, 160), (129, 96), (300, 256)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
def test_plain_and_blocked_equal_the_reference(device, dtype, rows, cols, scale_mode):
    x = _data(rows, cols, dtype, seed=rows * 7 + cols)
    want_q, want_s = mx.quantize_mxfp8_reference(x, scale_mode=scale_mode)
    xd = x.to(device)

    q = _poisoned((rows, cols), torch.float8_e4m3fn, device)
    s = _poisoned((rows, cols // 32), torch.float8_e8m0fnu, device)
    mx.quantize_mxfp8(xd, blocked=False, scale_mode=scale_mode, out=(q, s))
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))

    q, s = mx.quantize_mxfp8(xd, scale_mode=scale_mode)  # allocated: the padding zeroed, as torch's to_blocked
    assert torch.equal(_bits(q), _bits(want_q))
    assert torch.equal(_bits(s), _bits(mx.to_blocked_scales(want_s)))

    nbytes = (rows + 127) // 128 * 128 * ((cols // 32 + 3) // 4 * 4)
    q = _poisoned((rows, cols), torch.float8_e4m3fn, device)
    s = _poisoned((nbytes,), torch.float8_e8m0fnu, device)
    mx.quantize_mxfp8(xd, scale_mode=scale_mode, out=(q, s))
    assert torch.equal(_bits(q), _bits(want_q))
    assert torch.equal(_bits(s), _expected_blocked(want_s, nbytes))


ROW_GROUPS = [
    (37, [0, 5, 5, 37]),         # empty first and middle groups
    (37, [37]),                  # one group
    (37, [10, 37, 37]),          # empty last group
    (37, [20, 30]),              # rows past the last group: q, no scale
    (300, [128, 129, 129, 300]),  # a group of exactly 128, one of 1
    (1, [0, 1]),
    (0, [0, 0]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, ends", ROW_GROUPS)
@pytest.mark.parametrize("cols", [96, 256])
def test_row_groups_equal_the_reference(device, dtype, rows, ends, cols):
    x = _data(rows, cols, dtype, seed=rows + len(ends) + cols)
    want_q, want_s = mx.quantize_mxfp8_reference(x)
    ends_t = torch.tensor(ends, dtype=torch.int32, device=device)
    q, s = mx.quantize_mxfp8(x.to(device), group_ends=ends_t, group_axis="rows")
    assert torch.equal(_bits(q), _bits(want_q))
    ref = _bits(mx.blocked_scales_row_groups(want_s, ends)).reshape(-1)
    got = _bits(s).reshape(-1)
    assert s.shape == (mx.row_groups_scale_rows(rows, len(ends)), (cols // 32 + 3) // 4 * 4)
    assert torch.equal(got[:ref.numel()], ref) and not got[ref.numel():].any()

    nbytes = s.numel()
    q = _poisoned((rows, cols), torch.float8_e4m3fn, device)
    s = _poisoned((nbytes,), torch.float8_e8m0fnu, device)
    mx.quantize_mxfp8(x.to(device), group_ends=ends_t, group_axis="rows", out=(q, s))
    assert torch.equal(_bits(q), _bits(want_q))
    assert torch.equal(_bits(s), _expected_blocked(want_s, nbytes, ends, "rows"))


COL_GROUPS = [
    (160, [32, 32, 96, 160]),   # an empty group
    (160, [0, 160]),
    (160, [64, 128]),           # columns past the last group: q, no scale
    (256, [96, 256, 256]),      # groups of 3 and 5 blocks, an empty last one
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 37, 130])
@pytest.mark.parametrize("cols, ends", COL_GROUPS)
def test_column_groups_equal_the_reference(device, rows, cols, ends):
    x = _data(rows, cols, torch.bfloat16, seed=rows * 3 + cols + len(ends))
    want_q, want_s = mx.quantize_mxfp8_reference(x)
    ends_t = torch.tensor(ends, dtype=torch.int32, device=device)
    q, s = mx.quantize_mxfp8(x.to(device), group_ends=ends_t, group_axis="cols")
    assert torch.equal(_bits(q), _bits(want_q))
    covered = (ends[-1] // 32)
    ref = _bits(mx.blocked_scales_k_groups(want_s[:, :covered], ends)).reshape(-1)
    got = _bits(s).reshape(-1)
    assert s.shape == ((rows + 127) // 128 * 128, mx.k_groups_scale_cols(cols, len(ends)))
    assert torch.equal(got[:ref.numel()], ref) and not got[ref.numel():].any()

    nbytes = s.numel()
    q = _poisoned((rows, cols), torch.float8_e4m3fn, device)
    s = _poisoned((nbytes,), torch.float8_e8m0fnu, device)
    mx.quantize_mxfp8(x.to(device), group_ends=ends_t, group_axis="cols", out=(q, s))
    assert torch.equal(_bits(q), _bits(want_q))
    assert torch.equal(_bits(s), _expected_blocked(want_s, nbytes, ends, "cols"))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input_and_output(device):
    """Blocking along the token axis is x.t(): a strided read; q written through a row stride wider than its
    rows. Bytes of the wider buffer outside q stay as they were."""
    x = _data(67, 96, torch.bfloat16, seed=11)
    y = x.t().contiguous()  # [K, T] in memory: x = y.t() is read with a column stride of T
    want_q, want_s = mx.quantize_mxfp8_reference(x)
    buf = _poisoned((67, 96 + 32), torch.float8_e4m3fn, device)
    q = buf[:, :96]
    s = _poisoned((67, 3), torch.float8_e8m0fnu, device)
    mx.quantize_mxfp8(y.to(device).t(), blocked=False, out=(q, s))
    assert torch.equal(_bits(q.contiguous()), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))
    assert (_bits(buf)[:, 96:] == POISON).all()


@pytest.mark.parametrize("device", DEVICES)
def test_weights_are_blocked_per_expert(device):
    """quantize_mxfp8_weights: expert g's scales blocked on their own in row g (torch's 2d-3d scale_b)."""
    w = _data(3 * 72, 96, torch.bfloat16, seed=5).reshape(3, 72, 96)
    q, s = mx.quantize_mxfp8_weights(w.to(device))
    assert s.shape == (3, 128 * 4)
    for g in range(3):
        want_q, want_s = mx.quantize_mxfp8_reference(w[g])
        assert torch.equal(_bits(q[g]), _bits(want_q))
        assert torch.equal(_bits(s[g]), _bits(mx.to_blocked_scales(want_s)).reshape(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_every_bf16_value_as_a_block_amax(device):
    """Each positive finite bf16 value once as the largest of a block (the rest a fixed pattern below it): the
    scale rule on every exponent and mantissa the input can have."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    ramp = torch.linspace(-1.0, 1.0, 31)
    x = torch.cat([amax[:, None], amax[:, None] * ramp[None, :]], dim=1).bfloat16()
    for mode in ("rceil", "floor"):
        want_q, want_s = mx.quantize_mxfp8_reference(x, scale_mode=mode)
        q, s = mx.quantize_mxfp8(x.to(device), blocked=False, scale_mode=mode)
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))


# ---- bad arguments: a clear error, nothing written ---------------------------------------------------------------

def test_python_checks_before_the_op():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize_mxfp8(torch.randn(4, 48).bfloat16())
    with pytest.raises(ValueError, match="2-D"):
        mx.quantize_mxfp8(torch.randn(64).bfloat16())
    with pytest.raises(TypeError, match="bf16 or fp32"):
        mx.quantize_mxfp8(x.half())
    with pytest.raises(ValueError, match="blocked"):
        mx.quantize_mxfp8(x, blocked=False, group_ends=[4])
    with pytest.raises(ValueError, match="group_axis"):
        mx.quantize_mxfp8(x, group_ends=[4], group_axis="k")
    with pytest.raises(ValueError, match="scale_mode"):
        mx.quantize_mxfp8(x, scale_mode="ceil")


@pytest.mark.parametrize("ends, axis, match", [
    ([5, 3], "rows", "non-decreasing within \\[0, rows\\]"),
    ([-1, 4], "rows", "non-decreasing within \\[0, rows\\]"),
    ([4, 5], "rows", "non-decreasing within \\[0, rows\\]"),
    ([33], "cols", "multiple of 32"),
    ([96], "cols", "within \\[0, cols\\]"),
])
def test_cpu_rejects_bad_group_ends_before_writing(ends, axis, match):
    x = _data(4, 64, torch.bfloat16, seed=1)
    q = _poisoned((4, 64), torch.float8_e4m3fn, "cpu")
    s = _poisoned((4096,), torch.float8_e8m0fnu, "cpu")
    with pytest.raises(RuntimeError, match=match):
        mx.quantize_mxfp8(x, group_ends=ends, group_axis=axis, out=(q, s))
    assert (_bits(q) == POISON).all() and (_bits(s) == POISON).all()


def test_the_op_rejects_bad_buffers_before_writing():
    op = torch.ops.prime_kernels.quantize_mxfp8_
    x = _data(40, 64, torch.bfloat16, seed=2)
    none = torch.empty(0, dtype=torch.int32)
    q = _poisoned((40, 64), torch.float8_e4m3fn, "cpu")
    small = torch.full((128 * 4 - 1,), POISON, dtype=torch.uint8)  # one byte short of the blocked layout
    with pytest.raises(RuntimeError, match="need 512 bytes"):
        op(x, q, small, none, none, 0, True, True)
    ends = torch.tensor([20, 40], dtype=torch.int32)
    starts = torch.empty(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="smaller than the groups' padded blocked layout"):
        op(x, q, small, ends, starts, 1, True, True)  # two groups of rows need 2 x 128 x 4 bytes
    with pytest.raises(RuntimeError, match="plain scales must be"):
        op(x, q, torch.empty(40, 3, dtype=torch.uint8), none, none, 0, False, True)
    with pytest.raises(RuntimeError, match="group_starts"):
        op(x, q, torch.zeros(4096, dtype=torch.uint8), ends, torch.empty(1, dtype=torch.int32), 1, True, True)
    with pytest.raises(RuntimeError, match="uint8"):
        op(x, q, torch.zeros(4096, dtype=torch.int8), none, none, 0, True, True)
    with pytest.raises(RuntimeError, match="float8_e4m3fn tensor of x's shape"):
        op(x, q[:39], torch.zeros(4096, dtype=torch.uint8), none, none, 0, True, True)
    assert (_bits(q) == POISON).all() and (small == POISON).all()


@requires_gpu
@pytest.mark.parametrize("ends, axis", [([5, 3], "rows"), ([4, 41], "rows"), ([33], "cols"), ([96], "cols")])
def test_cuda_bad_group_ends_write_nothing_and_are_reported(ends, axis):
    """On the device the ends are checked by the group-start kernel: nothing is written, and the finding is raised
    by the next check (here check_device_errors after a synchronisation), once."""
    x = _data(40, 64, torch.bfloat16, seed=3).cuda()
    q = _poisoned((40, 64), torch.float8_e4m3fn, "cuda")
    s = _poisoned((4096,), torch.float8_e8m0fnu, "cuda")
    prime_kernels.check_device_errors()
    mx.quantize_mxfp8(x, group_ends=torch.tensor(ends, dtype=torch.int32, device="cuda"), group_axis=axis,
                      out=(q, s))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="quantize_mxfp8's group ends"):
        prime_kernels.check_device_errors()
    prime_kernels.check_device_errors()
    assert (_bits(q) == POISON).all() and (_bits(s) == POISON).all()


@requires_gpu
def test_cuda_scale_buffer_too_small_for_the_device_ends_writes_nothing():
    x = _data(300, 64, torch.bfloat16, seed=4).cuda()
    q = _poisoned((300, 64), torch.float8_e4m3fn, "cuda")
    s = _poisoned((2 * 128 * 4,), torch.float8_e8m0fnu, "cuda")  # three non-empty groups need three tiles
    ends = torch.tensor([1, 2, 300], dtype=torch.int32, device="cuda")
    prime_kernels.check_device_errors()
    mx.quantize_mxfp8(x, group_ends=ends, group_axis="rows", out=(q, s))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="do not fit in the scale buffer"):
        prime_kernels.check_device_errors()
    assert (_bits(q) == POISON).all() and (_bits(s) == POISON).all()
