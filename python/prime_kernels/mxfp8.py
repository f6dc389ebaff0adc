"""MXFP8 (OCP microscaling, e4m3 values, one e8m0 scale per 32 elements): the pure-torch reference.

This module is the definition the MXFP8 quantization kernels must match bit for bit (docs/mxfp8.md), and the
producer of the scale layout ``torch._scaled_grouped_mm`` / ``torch._scaled_mm`` take on sm_100.

- ``quantize_mxfp8_reference(x, axis=-1, scale_mode="rceil") -> (q e4m3, scale e8m0)``: one scale per 32
  consecutive elements along ``axis``; q has x's shape, scale x's shape with that axis divided by 32.
- ``dequantize_mxfp8_reference(q, scale, axis=-1) -> fp32``.
- ``to_blocked_scales(scale [R, C]) -> [round_up(R, 128), round_up(C, 4)]``: the 128 x 4 tile layout with the
  32 x 4 x 4 interleave inside each tile (torch's ``SwizzleType.SWIZZLE_32_4_4``, cuBLAS' "block scaling
  factors layout"); ``from_blocked_scales`` undoes it.
- ``blocked_scales_row_groups`` / ``blocked_scales_k_groups``: the per-group padded layouts of the grouped
  GEMM's 2d-3d (groups along M) and 2d-2d (groups along K) cases.

Everything above runs on whatever device its inputs are on; nothing there needs the compiled library.

Our kernel (csrc/common/quantize_mxfp8.cu, the same bits as the reference):

- ``quantize_mxfp8(x [rows, cols], blocked=True, group_ends=None, group_axis="rows") -> (q, scale)``: on CUDA the
  kernel, on the CPU its host loop (through the op ``torch.ops.prime_kernels.quantize_mxfp8_``).
- ``quantize_mxfp8_weights(w [G, N, K]) -> (q, scale [G, round_up(N, 128) * round_up(K/32, 4)])``: a stack of
  weights blocked along K, each expert's scales blocked on their own: the ``scale_b`` of the 2d-3d grouped GEMM.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

__all__ = [
    "BLOCK", "E4M3_MAX", "E8M0_BIAS", "E8M0_NAN",
    "mxfp8_scale_exponent", "quantize_mxfp8_reference", "dequantize_mxfp8_reference",
    "to_blocked_scales", "from_blocked_scales", "blocked_index",
    "blocked_scales_row_groups", "blocked_scales_k_groups",
    "quantize_mxfp8", "quantize_mxfp8_weights", "row_groups_scale_rows", "k_groups_scale_cols",
]

BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Unbiased exponent range an e8m0 byte can carry (0x00 .. 0xFE); 0xFF is NaN.
_E_MIN, _E_MAX = -127, 127

ScaleMode = Literal["rceil", "floor"]


def mxfp8_scale_exponent(amax: torch.Tensor, scale_mode: ScaleMode = "rceil") -> torch.Tensor:
    """Unbiased int32 scale exponent E for blocks whose largest magnitude is ``amax`` (fp32 or bf16, >= 0).

    Write amax = s * 2^p with s in [1, 2) (exact, from the float's bits; subnormals included). Then

    - ``"rceil"``: E = ceil(log2(amax / 448)) computed exactly = p - 8 + (s > 1.75). The smallest power of two
      that brings amax to at most 448, so no element of the block saturates. The rule of torch's own MX test
      helper (whose fp32 log2 misses by one for fp32 amax a few ulps above 448 * 2^k), DeepGEMM's UE8M0 casts
      and Blackwell's ``cvt.rp.satfinite.ue8m0x2.f32`` (given amax / 448 as fp32: that quotient never rounds
      across a power of two, see docs/mxfp8.md).
    - ``"floor"``: E = floor(log2(amax)) - 8 = p - 8 (OCP MX v1.0 section 6.3, emax(e4m3) = 8). amax / 2^E lies
      in [256, 512), so blocks with s > 1.75 saturate their largest elements to 448.

    Both clamp E to [-127, 127]; amax == 0 gives -127 (the e8m0 byte 0x00); amax == inf gives 127. NaN is not
    handled here (the caller maps NaN blocks to the e8m0 NaN byte).
    """
    a = amax.to(torch.float32)
    mant, exp = torch.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1)
    p = exp.to(torch.int32) - 1
    e = p - 8
    if scale_mode == "rceil":
        e = e + (mant > 0.875).to(torch.int32)  # s = 2 * mant > 1.75
    elif scale_mode != "floor":
        raise ValueError(f"scale_mode must be 'rceil' or 'floor', got {scale_mode!r}")
    e = torch.where(a == 0, torch.full_like(e, _E_MIN), e)
    e = torch.where(torch.isinf(a), torch.full_like(e, _E_MAX), e)
    return e.clamp(_E_MIN, _E_MAX)


def quantize_mxfp8_reference(x: torch.Tensor, *, axis: int = -1,
                             scale_mode: ScaleMode = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn, same shape as x; scale float8_e8m0fnu, x's shape with ``axis`` divided by 32).

    x is bf16 or fp32 (fp16 is accepted too: every input is read exactly as fp32). Each run of 32 consecutive
    elements along ``axis`` (x.shape[axis] must be a multiple of 32) is one block with one scale:

    1. amax = max |x| over the block.
    2. The scale exponent E from amax (:func:`mxfp8_scale_exponent`, ``scale_mode`` "rceil" by default or
       "floor"), stored as the e8m0 byte E + 127; the block's decoding scale is 2^E.
    3. Every element: q = e4m3(clamp(x * 2^-E, -448, 448)), the product exact (a power of two times an fp32
       value, taken in float64), the conversion round-to-nearest-even on the e4m3 grid (subnormals included:
       steps of 2^-9 below 2^-6; magnitudes up to 2^-10 become zero, 2^-10 itself by the tie rule). The clamp is
       the saturation: nothing finite becomes NaN.

    Special values:

    - all-zero block: scale byte 0x00 (2^-127), every q zero with x's sign (-0.0 stays 0x80).
    - block holding +-inf (and no NaN): E = 127 (byte 0xFE); inf elements become +-448, the others x * 2^-127,
      in practice zero.
    - block holding a NaN: scale byte 0xFF (e8m0 NaN) and every q of the block NaN (0x7F), so that no
      consumer reads a finite value out of it whichever of the two it looks at.
    - tiny blocks (amax below 448 * 2^-127): E clamps to -127 and the values are still scaled by 2^127, so the
      block dequantizes to within e4m3 rounding of x (no flush to zero beyond e4m3's own subnormal range).
    """
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    ax = axis % x.dim()
    n = x.shape[ax]
    if n % BLOCK != 0:
        raise ValueError(f"x.shape[{axis}] = {n} must be a multiple of {BLOCK}")

    xt = x.movedim(ax, -1).to(torch.float32)
    blocks = xt.reshape(*xt.shape[:-1], n // BLOCK, BLOCK)
    has_nan = torch.isnan(blocks).any(dim=-1)
    # NaN blocks are overwritten below; zeroing NaNs keeps their amax out of the way (inf must stay inf).
    amax = torch.where(torch.isnan(blocks), torch.zeros_like(blocks), blocks.abs()).amax(dim=-1)
    e = mxfp8_scale_exponent(amax, scale_mode)

    inv = torch.exp2((-e).to(torch.float64)).unsqueeze(-1)
    y = (blocks.to(torch.float64) * inv).clamp(-E4M3_MAX, E4M3_MAX)
    # y is exact in float64 and, once clamped, exactly representable in fp32 wherever it could round to a
    # nonzero e4m3 value, so the fp32 hop adds no second rounding.
    q = y.to(torch.float32).to(torch.float8_e4m3fn)
    q = torch.where(has_nan.unsqueeze(-1), torch.full_like(q, float("nan")), q)

    sbyte = (e + E8M0_BIAS).to(torch.uint8)
    sbyte = torch.where(has_nan, torch.full_like(sbyte, E8M0_NAN), sbyte)

    q = q.reshape(xt.shape).movedim(-1, ax).contiguous()
    scale = sbyte.view(torch.float8_e8m0fnu).movedim(-1, ax).contiguous()
    return q, scale


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 value of e8m0 scales: 2^(byte - 127), NaN for 0xFF (independent of torch's own e8m0 cast)."""
    b = scale.view(torch.uint8).to(torch.int32)
    v = torch.exp2((b - E8M0_BIAS).to(torch.float32))
    return torch.where(b == E8M0_NAN, torch.full_like(v, float("nan")), v)


def dequantize_mxfp8_reference(q: torch.Tensor, scale: torch.Tensor, *, axis: int = -1) -> torch.Tensor:
    """fp32 q * 2^E, each scale applied to its 32 elements along ``axis`` (the layout quantize returns)."""
    ax = axis % q.dim()
    s = e8m0_to_float(scale).repeat_interleave(BLOCK, dim=ax)
    if s.shape != q.shape:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match q shape {tuple(q.shape)} along {axis}")
    return q.to(torch.float32) * s


def _round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def blocked_index(rows: int, cols: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [rows, cols]: where scale (r, c) lands in the flattened blocked layout of a [rows, cols] scale.

    Tiles of 128 rows x 4 columns, 512 bytes each, tile (r // 128, c // 4) at tile index
    (r // 128) * ceil(cols / 4) + c // 4 (tiles along the scale's K dimension are adjacent); inside a tile,
    (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4.
    """
    r = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(cols, device=device, dtype=torch.int64).unsqueeze(0)
    tiles_per_row = _round_up(cols, 4) // 4
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def to_blocked_scales(scale: torch.Tensor) -> torch.Tensor:
    """[round_up(R, 128), round_up(C, 4)] e8m0 whose contiguous bytes are ``scale`` [R, C] in the blocked layout.

    R is the operand's M (or N) dimension, C = K / 32. Padding bytes are 0x00; the GEMM never reads them for
    results (they stand for rows past M or K blocks past K). ``.flatten()`` gives torch's 1-D form.
    """
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, K/32], got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    rp, cp = _round_up(rows, 128), _round_up(cols, 4)
    out = torch.zeros(rp * cp, dtype=torch.uint8, device=scale.device)
    if rows and cols:
        src = scale.contiguous().view(torch.uint8).reshape(-1)
        out[blocked_index(rows, cols, scale.device).reshape(-1)] = src
    return out.view(torch.float8_e8m0fnu).reshape(rp, cp)


def from_blocked_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] scales back out of a blocked buffer (any shape with the right number of bytes)."""
    flat = blocked.contiguous().view(torch.uint8).flatten()
    need = _round_up(rows, 128) * _round_up(cols, 4)
    if flat.numel() != need:
        raise ValueError(f"blocked buffer has {flat.numel()} bytes, a [{rows}, {cols}] scale needs {need}")
    return flat[blocked_index(rows, cols, flat.device)].view(torch.float8_e8m0fnu)


def _group_bounds(group_ends: Sequence[int] | torch.Tensor, total: int) -> list[tuple[int, int]]:
    ends = [int(v) for v in (group_ends.tolist() if isinstance(group_ends, torch.Tensor) else group_ends)]
    bounds, start = [], 0
    for end in ends:
        if end < start or end > total:
            raise ValueError(f"group end offsets must be non-decreasing and <= {total}, got {ends}")
        bounds.append((start, end))
        start = end
    return bounds


def blocked_scales_row_groups(scale: torch.Tensor, group_ends: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The 2d-3d grouped GEMM's A scales: [sum_g round_up(m_g, 128), round_up(K/32, 4)].

    ``scale`` [total_M, K/32] holds the scales of the 2-D operand whose groups are row ranges (group g ends at
    row group_ends[g], the ``offs`` torch takes). Each group is blocked on its own, its rows padded to 128, and
    the groups concatenated; empty groups take no space. The e4m3 data itself stays unpadded.
    """
    parts = [to_blocked_scales(scale[a:b]) for a, b in _group_bounds(group_ends, scale.shape[0]) if b > a]
    if not parts:
        return scale.new_empty((0, _round_up(scale.shape[1], 4)))
    return torch.cat(parts, dim=0)


def blocked_scales_k_groups(scale: torch.Tensor, group_ends: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The 2d-2d grouped GEMM's scales: [round_up(R, 128), sum_g round_up(k_g / 32, 4)] as one contiguous buffer.

    ``scale`` [R, total_K/32] holds an operand's scales whose groups are ranges of K (group g ends at element
    group_ends[g] along K; every k_g must be a multiple of 32). Group g's [R, k_g/32] slice is blocked on its
    own and the blocks laid end to end in memory (group after group, not interleaved by row), which is what the
    GEMM reads at offset round_up(R, 128) * sum_{j<g} round_up(k_j/32, 4).
    """
    rows = scale.shape[0]
    bounds = _group_bounds(group_ends, scale.shape[1] * BLOCK)
    parts = []
    for a, b in bounds:
        if a % BLOCK or b % BLOCK:
            raise ValueError(f"2d-2d group boundaries must be multiples of {BLOCK}, got {a}..{b}")
        if b > a:
            parts.append(to_blocked_scales(scale[:, a // BLOCK:b // BLOCK]).flatten())
    rp = _round_up(rows, 128)
    if not parts:
        return scale.new_empty((rp, 0))
    return torch.cat(parts).reshape(rp, -1)


# ---- our kernel ---------------------------------------------------------------------------------------------------

#: The status() key stem of the quantization kernel (``quantize.mxfp8.sm90`` / ``.sm100``).
STATUS_STEM = "quantize.mxfp8"
_GROUP_AXES = {"rows": 1, "cols": 2}


def row_groups_scale_rows(rows: int, num_groups: int) -> int:
    """Rows of a blocked scale buffer that holds any ``num_groups`` row groups of ``rows`` rows in all, each padded
    to 128 (the largest sum_g round_up(m_g, 128) with sum_g m_g <= rows): the ends can stay on the device."""
    return (rows + 127 * num_groups) // 128 * 128


def k_groups_scale_cols(cols: int, num_groups: int) -> int:
    """Columns (scale blocks, each 32 of K) of a blocked scale buffer that holds any ``num_groups`` column groups of
    ``cols`` elements in all, each padded to 4 blocks."""
    return (cols // BLOCK + 3 * num_groups) // 4 * 4


def quantize_mxfp8(x: torch.Tensor, *, blocked: bool = True,
                   group_ends: Sequence[int] | torch.Tensor | None = None, group_axis: str = "rows",
                   scale_mode: ScaleMode = "rceil",
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [rows, cols], scale float8_e8m0fnu) of x [rows, cols] (bf16 or fp32, any strides), one scale
    per 32 consecutive elements of a row: :func:`quantize_mxfp8_reference` with ``axis=-1``, bit for bit. For the
    other axis pass ``x.t()`` (correct, with uncoalesced reads).

    Scales: ``blocked=False`` gives them plain [rows, cols/32]; blocked (the default) in the layout of
    :func:`to_blocked_scales`, zero padded: [round_up(rows, 128), round_up(cols/32, 4)] without groups. With
    ``group_ends`` (int32 on x's device, or a sequence of ints) each group is blocked on its own:
    ``group_axis="rows"`` (2d-3d A operand, groups of rows, as :func:`blocked_scales_row_groups`) into
    [:func:`row_groups_scale_rows`, round_up(cols/32, 4)] or ``"cols"`` (2d-2d operands, every end a multiple of 32,
    as :func:`blocked_scales_k_groups`) into [round_up(rows, 128), :func:`k_groups_scale_cols`] bytes laid end to
    end; the bytes past the groups' padded extent are zeros. Those sizes hold any ends, so ends on the device need no
    synchronisation; there a bad set of ends (not non-decreasing within the axis, a column end not a multiple of 32)
    makes the call write nothing and the next call into the library raise, on the CPU it raises at once.

    ``out`` = (q, scale) to write into (returned): q e4m3 of x's shape (any strides), scale contiguous e8m0: [rows,
    cols/32] when plain, else any shape with enough bytes, zeroed by the caller (padding bytes are not written).
    """
    from . import _status  # the library's loader: only this part needs the compiled ops

    if x.dim() != 2:
        raise ValueError(f"quantize_mxfp8: x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"quantize_mxfp8: x must be bf16 or fp32, got {x.dtype}")
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"quantize_mxfp8: x.shape[1] = {cols} must be a multiple of {BLOCK}")
    if scale_mode not in ("rceil", "floor"):
        raise ValueError(f"quantize_mxfp8: scale_mode must be 'rceil' or 'floor', got {scale_mode!r}")
    if group_axis not in _GROUP_AXES:
        raise ValueError(f"quantize_mxfp8: group_axis must be 'rows' or 'cols', got {group_axis!r}")
    if group_ends is not None and not blocked:
        raise ValueError("quantize_mxfp8: groups need the blocked scale layout (blocked=True)")
    _status.require_on(x.device, STATUS_STEM, "quantize_mxfp8", allow_unverified=True)
    dev = x.device
    axis = 0
    if group_ends is None:
        ends = torch.empty(0, dtype=torch.int32, device=dev)
    else:
        ends = (group_ends if isinstance(group_ends, torch.Tensor)
                else torch.tensor([int(v) for v in group_ends], dtype=torch.int32)).to(dev)
        if ends.dtype != torch.int32 or ends.dim() != 1 or ends.numel() == 0:
            raise ValueError("quantize_mxfp8: group_ends must be a non-empty 1-D int32 tensor (or sequence of ints)")
        ends = ends.contiguous()
        axis = _GROUP_AXES[group_axis]
    starts = torch.empty(ends.numel() if axis else 0, dtype=torch.int32, device=dev)
    if out is not None:
        q, scale = out
    else:
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=dev)
        per = cols // BLOCK
        if not blocked:
            shape = (rows, per)
        elif axis == 1:
            shape = (row_groups_scale_rows(rows, ends.numel()), _round_up(per, 4))
        elif axis == 2:
            shape = (_round_up(rows, 128), k_groups_scale_cols(cols, ends.numel()))
        else:
            shape = (_round_up(rows, 128), _round_up(per, 4))
        alloc = torch.empty if not blocked else torch.zeros
        scale = alloc(shape, dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu)
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"quantize_mxfp8: scale must be float8_e8m0fnu (or its uint8 bytes), got {scale.dtype}")
    torch.ops.prime_kernels.quantize_mxfp8_(x, q, scale.view(torch.uint8), ends, starts, axis, bool(blocked),
                                            scale_mode == "rceil")
    return q, scale


def quantize_mxfp8_weights(w: torch.Tensor, *, scale_mode: ScaleMode = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [G, N, K], scale e8m0 [G, round_up(N, 128) * round_up(K/32, 4)]) of a weight stack w [G, N, K]
    blocked along K (its last, contiguous dimension): expert g's [N, K/32] scales blocked on their own in row g, the
    ``scale_b`` of ``torch._scaled_grouped_mm``'s 2d-3d case, whose ``mat_b`` is ``q.transpose(-2, -1)``."""
    if w.dim() != 3:
        raise ValueError(f"quantize_mxfp8_weights: w must be 3-D [G, N, K], got shape {tuple(w.shape)}")
    G, N, K = w.shape
    per_expert = _round_up(N, 128) * _round_up(K // BLOCK, 4)
    scale = torch.zeros(G, per_expert, dtype=torch.uint8, device=w.device).view(torch.float8_e8m0fnu)
    q = torch.empty(G, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    if G == 0 or N == 0:
        return q, scale
    # equal groups of N rows: every expert's padded extent is round_up(N, 128) rows, so the buffer is exact
    ends = torch.arange(1, G + 1, dtype=torch.int32, device=w.device) * N
    quantize_mxfp8(w.reshape(G * N, K), group_ends=ends, scale_mode=scale_mode, out=(q.view(G * N, K), scale))
    return q, scale


def _register_fake() -> None:
    @torch.library.register_fake("prime_kernels::quantize_mxfp8_")
    def _(x, q, scale, group_ends, group_starts, group_axis=0, blocked=True, rceil=True):
        return None

