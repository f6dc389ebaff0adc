"""Blockwise FP8 (e4m3) numerics of the Hopper recipe: quantization, the weight cache, and an emulated FP8 GEMM.

These functions define the numbers; the reference (:mod:`prime_kernels.mega.reference`, precision "fp8" and
"fp8_bwd") calls them at the points its docstring names, and the FP8 kernels are to quantize the same way.

Quantization of a tensor ``v`` in blocks of ``rows x cols`` (the block grid starts at index 0 of both axes):

  Q1. amax = max |v| over the block, in fp32 (v is converted to fp32 first; bf16 -> fp32 is exact).
  Q2. scale = amax / 448 (fp32 division, round to nearest); 448 is the largest finite e4m3 value.
      With ``pow2_scales``: scale = 2^ceil(log2(amax / 448)), the exponent taken from the fp32 quotient
      exactly (a quotient that is already a power of two keeps it). A block whose fp32 quotient is 0 (all
      zeros, or an amax so small that amax / 448 underflows) gets scale 1: its values quantize to 0 (or to
      e4m3 subnormals), and no 0/0 appears.
  Q3. q = e4m3(clamp(v / scale, -448, 448)): fp32 division, then round to nearest even into e4m3 with
      saturation (the PTX ``cvt.rn.satfinite.e4m3x2.f32``). With power-of-two scales the division is exact,
      so a kernel may multiply by the reciprocal instead; with general scales it must divide (a multiply by
      a rounded reciprocal can move a value across an e4m3 rounding boundary).
  Tail blocks: an axis whose length is not a multiple of the block keeps a narrower last block; its amax is
  over the elements that exist (equivalently: the tensor is zero-padded to whole blocks, and zeros never
  raise an amax or add to a product). The scales have ceil(len / block) entries along that axis.

Dequantization (tests, debugging): fp32(q * scale), one rounding.

The emulated GEMM ``C[m, n] = sum_k A[m, k] B[n, k]`` on two quantized operands, both blocked along K with
block grids starting at k = 0 (:func:`fp8_gemm_nt`), promotes every ``w`` of K, w = the smaller of the two
K-block widths (128, or 64 when one operand has 1x64 scales), which must divide the larger:

  G1. P_j[m, n] = sum over k in slice j of qa[m, k] * qb[n, k] as the sm90 tensor core sums it
      (:func:`tensor_core_partial`, bit for bit an H100's e4m3 wgmma): 32 products at a time, each step's products
      and the running sum aligned to the largest exponent among them and cut toward zero 14 bits below it, the
      exact sum of those cut to 13 mantissa bits.
  G2. s_j[m, n] = fp32(scale_a[m, j] * scale_b[n, j]), the scales of the blocks holding slice j.
  G3. C <- fp32(C + s_j * P_j) for j = 0, 1, ... in increasing order, C starting at 0: the promotion into the
      fp32 accumulator (evaluated in float64 and rounded once to fp32, i.e. a fused multiply-add up to a
      double rounding in rare ties).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _status
from ..quantize import quantize_weight_fp8, transpose_tiles_fp8

E4M3 = torch.float8_e4m3fn
#: The largest finite e4m3 (fn) value.
E4M3_MAX = 448.0
#: The block of the recipe: 1x128 activation/gradient scales along K, 128x128 weight tiles, 128 tokens per
#: weight-gradient scale, promotion every 128 of K.
BLOCK = 128
#: The other width the L2 operand (s) may be quantized with: a kernel whose L1 tile holds 64 gate and 64 up
#: columns sees only 64 s values per row and cannot take a 128-wide amax without exchanging partials.
HALF_BLOCK = 64


@dataclass(frozen=True)
class Fp8Recipe:
    """The options of the blockwise recipe.

    ``l2_act_block``: the K-block width (64 or 128) of the L2 operand s; with 64, L2 promotes every 64 of K.
    The default is 64, the recipe the kernels run: the FP8 L1's tile holds 64 columns of s per row.
    ``pow2_scales``: scales rounded up to powers of two (Q2), for every operand, weights included.
    """

    l2_act_block: int = HALF_BLOCK
    pow2_scales: bool = False

    def __post_init__(self):
        if self.l2_act_block not in (BLOCK, HALF_BLOCK):
            raise ValueError(f"l2_act_block must be {BLOCK} or {HALF_BLOCK}, got {self.l2_act_block}")


DEFAULT_RECIPE = Fp8Recipe()


@dataclass
class BlockQuantized:
    """e4m3 values and their fp32 block scales.

    ``data``: [..., R, C] e4m3. ``scale``: [..., ceil(R / block_rows), ceil(C / block_cols)] fp32: the scale
    of element (r, c) is ``scale[..., r // block_rows, c // block_cols]``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int
    block_cols: int

    def t(self) -> "BlockQuantized":
        """The transpose of the last two axes: data and scale grid transposed, blocks swapped. Exact: every
        block keeps its elements and its amax."""
        return BlockQuantized(self.data.transpose(-2, -1).contiguous(), self.scale.transpose(-2, -1).contiguous(),
                              self.block_cols, self.block_rows)

    def __getitem__(self, index) -> "BlockQuantized":
        """One entry of the leading (expert) axis."""
        return BlockQuantized(self.data[index], self.scale[index], self.block_rows, self.block_cols)

    def expanded_scale(self) -> torch.Tensor:
        """The scale of every element, shaped like ``data``."""
        R, C = self.data.shape[-2:]
        s = self.scale.repeat_interleave(self.block_rows, dim=-2)[..., :R, :]
        return s.repeat_interleave(self.block_cols, dim=-1)[..., :C]

    def dequantize(self) -> torch.Tensor:
        """fp32(q * scale)."""
        return self.data.float() * self.expanded_scale()


def scales_from_amax(amax: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """Q2: fp32 block scales from fp32 block amaxes."""
    amax = amax.float()
    # a tensor divisor: torch on CUDA multiplies by the reciprocal of a Python-number divisor, which is not Q2's
    # rounded quotient (one ulp off in about 5% of blocks on an H100, where our kernels and the CPU agree bit for bit)
    scale = amax / torch.full_like(amax, E4M3_MAX)
    if pow2_scales:
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two keeps its exponent
        scale = torch.ldexp(torch.ones_like(scale), exponent)
        scale = torch.where(mantissa == 0, torch.zeros_like(scale), scale)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_blocks(v: torch.Tensor, block_rows: int, block_cols: int, pow2_scales: bool = False) -> BlockQuantized:
    """Q1-Q3 over the last two axes of ``v`` [..., R, C] in blocks of ``block_rows x block_cols``."""
    v = v.float()
    *lead, R, C = v.shape
    nr, nc = -(-R // block_rows), -(-C // block_cols)
    padded = v.new_zeros((*lead, nr * block_rows, nc * block_cols))
    padded[..., :R, :C] = v
    blocks = padded.view(*lead, nr, block_rows, nc, block_cols)
    amax = blocks.abs().amax(dim=(-3, -1)) if R and C else v.new_zeros((*lead, nr, nc))
    scale = scales_from_amax(amax, pow2_scales)
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.view(*lead, nr * block_rows, nc * block_cols)[..., :R, :C].contiguous()
    return BlockQuantized(q, scale, block_rows, block_cols)


def quantize_along_k(v: torch.Tensor, block: int = BLOCK, pow2_scales: bool = False) -> BlockQuantized:
    """Activations and gradients as a GEMM's K-major operand: one scale per row and ``block`` of the last axis
    (1 x block)."""
    return quantize_blocks(v, 1, block, pow2_scales)


def quantize_halves_along_k(v: torch.Tensor, pow2_scales: bool = False) -> BlockQuantized:
    """qK(v, 128) of a gate | up operand [..., 2I] (dh = [dg, du], the L1 dgrad's A), each half blocked from its own
    first column. I a multiple of 128: the grid along 2I, :func:`quantize_along_k` itself. I = 64 (mod 128): each
    half's last block is 64 wide (a kernel tile of 128 columns of I holds one block of dg and one of du per row), and
    the scales are given per 64 columns (``block_cols`` 64, a block's scale in each of its slots): W13^T's 128-column
    blocks along 2I start at column 0, dg's and du's at 0 and I, so the two grids meet every 64 columns and the GEMM
    promotes every 64 (G1-G3). Any other I (sizes only the reference runs): the grid along 2I."""
    inter = v.shape[-1] // 2
    if inter % BLOCK == 0 or inter % HALF_BLOCK:
        return quantize_along_k(v, BLOCK, pow2_scales)
    halves = (quantize_along_k(v[..., :inter], BLOCK, pow2_scales),
              quantize_along_k(v[..., inter:], BLOCK, pow2_scales))
    data = torch.cat([h.data for h in halves], -1)
    scale = torch.cat([h.scale.repeat_interleave(2, -1)[..., :inter // HALF_BLOCK] for h in halves], -1)
    return BlockQuantized(data, scale, 1, HALF_BLOCK)


def quantize_along_tokens(v: torch.Tensor, block: int = BLOCK, pow2_scales: bool = False) -> BlockQuantized:
    """A weight-gradient operand [tokens, C]: one scale per column and ``block`` rows of the token axis
    (block x 1), the token axis being the weight-gradient GEMM's K."""
    return quantize_blocks(v, block, 1, pow2_scales)


def _kernel_runs(key_stem: str, device: torch.device) -> bool:
    """Whether the kernel of status entry ``key_stem`` (``"quantize_weight.fp8"``: prime_kernels.quantize's weight
    quantizer, ``"transpose_tiles.fp8"``: its tile transpose) runs on ``device``."""
    family = _status.family_of_device(device.index) or "sm90"
    return _status.is_available(_status.reason(f"{key_stem}.{family}"))


#: The most fp32 elements :func:`quantize_weight` holds at once (1 GiB): it quantizes a weight some experts at a time.
_WEIGHT_CHUNK_ELEMENTS = 1 << 28


def quantize_weight(w: torch.Tensor, pow2_scales: bool = False) -> BlockQuantized:
    """A weight [..., N, K] in 128 x 128 tiles: Q1-Q3 as :func:`quantize_blocks` computes them, bit for bit. Where N and
    K are multiples of 128 (no block needs padding): a bf16 weight on a GPU where our kernel runs goes through it (one
    read of the weight); otherwise the weight is read in its own dtype, the amaxes by two reductions and the quotients
    a few leading entries at a time, since the generic path's fp32 and padded copies of a whole layer's experts (over
    a GB of bf16 each at Qwen3-30B-A3B) made each weight's quantization, once per optimizer step, cost more than the
    layer's FP8 forward and backward together."""
    *lead, R, C = w.shape
    if R % BLOCK or C % BLOCK or not R or not C or w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return quantize_blocks(w, BLOCK, BLOCK, pow2_scales)
    if w.is_cuda and w.dtype == torch.bfloat16 and _kernel_runs("quantize_weight.fp8", w.device):
        q, scale = quantize_weight_fp8(w.reshape(-1, R, C), pow2_scales=pow2_scales)
        return BlockQuantized(q.view(*lead, R, C), scale.view(*lead, R // BLOCK, C // BLOCK), BLOCK, BLOCK)
    nr, nc = R // BLOCK, C // BLOCK
    flat = w.reshape(-1, R, C)
    blocks = flat.view(-1, nr, BLOCK, nc, BLOCK)
    # max |v| of each block, exact: the larger of its max and minus its min
    amax = torch.maximum(blocks.amax(dim=(-3, -1)), blocks.amin(dim=(-3, -1)).neg()).float()
    scale = scales_from_amax(amax, pow2_scales)
    q = torch.empty(flat.shape, dtype=E4M3, device=w.device)
    step = max(1, _WEIGHT_CHUNK_ELEMENTS // (R * C))
    for e0 in range(0, flat.shape[0], step):
        e1 = min(e0 + step, flat.shape[0])
        quotient = torch.div(blocks[e0:e1], scale[e0:e1, :, None, :, None])  # fp32: v is exact in it
        q[e0:e1].view(-1, nr, BLOCK, nc, BLOCK).copy_(quotient.clamp_(-E4M3_MAX, E4M3_MAX))
    return BlockQuantized(q.view(*lead, R, C), scale.view(*lead, nr, nc), BLOCK, BLOCK)


def quantize_weight_with_chunks(w: torch.Tensor, w_2: torch.Tensor, chunks: int, layout: str,
                                pow2_scales: bool = False) -> BlockQuantized:
    """:func:`quantize_weight` of ``cat([w, expand_chunks(w_2, chunks, layout)])`` (the routed experts' weight and the
    shared experts' chunks as experts of their own, :mod:`prime_kernels.mega._shared_grouped`), bit for bit. The
    chunks' rows and columns start on 128 x 128 tile edges (I a multiple of 128), so each tile of w_2 is a tile of
    the chunks: where our kernel runs, w is quantized straight into the combined tensor (no copy of the routed
    weight) and only w_2's tiles and scales are moved."""
    from ..second_b import expand_chunks  # noqa: PLC0415 (the grouped GEMM wrappers import this module's package)

    E, R, C = w.shape
    chunk = R // 2 if layout == "w13" else C  # the chunk's width I: its tiles are w_2's where I % 128 == 0
    if (w.is_cuda and w.dtype == torch.bfloat16 and w_2.dtype == torch.bfloat16 and not R % BLOCK and not C % BLOCK
            and R and C and not chunk % BLOCK and _kernel_runs("quantize_weight.fp8", w.device)):
        q2 = quantize_weight(w_2, pow2_scales)
        rows = expand_chunks(q2.data.view(torch.uint8), chunks, layout)
        q = torch.empty((E + rows.shape[0], R, C), dtype=E4M3, device=w.device)
        scale = torch.empty((E + rows.shape[0], R // BLOCK, C // BLOCK), dtype=torch.float32, device=w.device)
        quantize_weight_fp8(w, pow2_scales=pow2_scales, out=(q[:E], scale[:E]))
        q[E:].view(torch.uint8).copy_(rows)
        scale[E:].copy_(expand_chunks(q2.scale, chunks, layout))
        return BlockQuantized(q, scale, BLOCK, BLOCK)
    return quantize_weight(torch.cat([w, expand_chunks(w_2, chunks, layout)]), pow2_scales)


def _transpose_weight(w: BlockQuantized) -> BlockQuantized:
    """``w.t()``: through our tile-transposing kernel where it runs (torch's copy of a transposed byte tensor was most
    of what the weights' copies still cost an FP8 training step once the quantization ran in our kernel)."""
    q = w.data
    *lead, R, C = q.shape
    if (q.is_cuda and q.dtype == E4M3 and w.block_rows == w.block_cols == BLOCK and not R % BLOCK and not C % BLOCK
            and R and C and _kernel_runs("transpose_tiles.fp8", q.device)):
        qt = transpose_tiles_fp8(q.reshape(-1, R, C))
        return BlockQuantized(qt.view(*lead, C, R), w.scale.transpose(-2, -1).contiguous(), BLOCK, BLOCK)
    return w.t()


# The sm90 tensor core's sum of e4m3 products (m64nNk32 wgmma into an fp32 accumulator), as measured on an H100
# against k_grouped_fp8_gemm_tn's fp32 partials with unit scales (every one of 3 x 16384 partials equal, for normal,
# wide-exponent and cancelling operands; none of a dozen other models came close): per k-step of WGMMA_K products,
# every product and the running sum are aligned to the largest exponent among them (a product's exponent the sum of
# its operands', its mantissa product not renormalized) and cut toward zero to a multiple of 2^(e_max - 14); the
# cut terms are summed exactly and the sum is cut toward zero to 13 mantissa bits (the e8m13 accumulator).
WGMMA_K = 32
_ALIGN_BITS = 14
_SUM_MANTISSA_BITS = 13
_NO_EXPONENT = -1 << 20


def _cut_mantissa(v: torch.Tensor, bits: int) -> torch.Tensor:
    m, e = torch.frexp(v)
    unit = float(1 << (bits + 1))
    return torch.ldexp(torch.trunc(m * unit) / unit, e)


_exact_partials = False


@contextlib.contextmanager
def exact_partial_sums():
    """Within it, G1 sums each slice's products exactly (rounded once to fp32) instead of as the tensor core does:
    the recipe without the hardware's accumulation, for tests that hold the emulation to an independent float64
    evaluation of the recipe."""
    global _exact_partials
    before, _exact_partials = _exact_partials, True
    try:
        yield
    finally:
        _exact_partials = before


def tensor_core_partial(fa: torch.Tensor, fb: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N]: sum over k of fa[m, k] * fb[n, k] as the tensor core sums e4m3 products (above), for fa [M, k]
    and fb [N, k] holding e4m3 values (any float dtype). A k that is not a multiple of WGMMA_K (sizes only the
    reference runs) has a last step of fewer products (zeros take no part in the alignment). Every step is exact in
    fp32: products of e4m3 values have 8 significant bits, and the cut terms are integer multiples of the step's
    unit below 2^15 each, so their sum stays below 2^24."""
    if _exact_partials:
        return (fa.double() @ fb.double().t()).float()
    fa, fb = fa.float(), fb.float()
    M, K = fa.shape
    N = fb.shape[0]
    if K % WGMMA_K:
        pad = WGMMA_K - K % WGMMA_K
        fa, fb = torch.nn.functional.pad(fa, (0, pad)), torch.nn.functional.pad(fb, (0, pad))
        K += pad
    _, ea = torch.frexp(fa)
    _, eb = torch.frexp(fb)
    out = torch.empty(M, N, dtype=torch.float32, device=fa.device)
    # bounds the [rows, N, WGMMA_K] temporaries (fp32: 64 MB on the CPU, 256 MB on a GPU, where fewer launches pay)
    per_chunk = (1 << 26) if fa.is_cuda else (1 << 24)
    rows = max(1, min(M, per_chunk // max(1, N * WGMMA_K)))
    for m0 in range(0, M, rows):
        a, xa = fa[m0:m0 + rows, None, :], ea[m0:m0 + rows, None, :]
        acc = torch.zeros(a.shape[0], N, dtype=torch.float32, device=fa.device)
        for k0 in range(0, K, WGMMA_K):
            p = a[..., k0:k0 + WGMMA_K] * fb[None, :, k0:k0 + WGMMA_K]
            e = (xa[..., k0:k0 + WGMMA_K] + eb[None, :, k0:k0 + WGMMA_K] - 1).masked_fill_(p == 0, _NO_EXPONENT)
            _, e_acc = torch.frexp(acc)
            e_max = torch.maximum(e.amax(-1), e_acc.masked_fill_(acc == 0, _NO_EXPONENT))
            e_max.masked_fill_(e_max == _NO_EXPONENT, 0)  # nothing but zeros: any unit
            unit = torch.ldexp(torch.ones_like(acc), e_max - _ALIGN_BITS)
            total = torch.trunc(p.div_(unit[..., None])).sum(-1) + torch.trunc(acc / unit)
            acc = _cut_mantissa(total * unit, _SUM_MANTISSA_BITS)
        out[m0:m0 + rows] = acc
    return out


def fp8_gemm_nt(a: BlockQuantized, b: BlockQuantized) -> torch.Tensor:
    """G1-G3: C [M, N] fp32 = A [M, K] B [N, K]^T from two quantized operands, promoted per K slice."""
    qa, qb = a.data, b.data
    M, K = qa.shape
    N, Kb = qb.shape
    if K != Kb:
        raise ValueError(f"fp8_gemm_nt: K differs ({K} vs {Kb})")
    wide, narrow = max(a.block_cols, b.block_cols), min(a.block_cols, b.block_cols)
    if wide % narrow:
        raise ValueError(f"fp8_gemm_nt: K blocks {a.block_cols} and {b.block_cols} do not nest")
    # per-row scales of each operand, one column per K block
    sa = a.scale.repeat_interleave(a.block_rows, dim=0)[:M]
    sb = b.scale.repeat_interleave(b.block_rows, dim=0)[:N]
    fa, fb = qa.float(), qb.float()
    c = torch.zeros((M, N), dtype=torch.float32, device=qa.device)
    for k0 in range(0, K, narrow):
        k1 = min(k0 + narrow, K)
        partial = tensor_core_partial(fa[:, k0:k1], fb[:, k0:k1])  # G1
        scale = sa[:, k0 // a.block_cols, None] * sb[None, :, k0 // b.block_cols]  # G2 (fp32)
        c = (c.double() + scale.double() * partial.double()).float()  # G3
    return c


class QuantizedWeight:
    """A weight [El, N, K] in 128x128 tiles, and the same tiles transposed ([El, K, N]) for the GEMMs that
    read it the other way round (FP8 wgmma on sm90 takes K-major operands only). The transposed copy is made on
    first use and kept: a forward reads only ``weight``, so its peak memory holds one FP8 copy of each weight,
    and the backward of every micro-batch of the weight's version shares one transpose."""

    def __init__(self, weight: BlockQuantized):
        self.weight = weight
        self._transposed: BlockQuantized | None = None

    @property
    def transposed(self) -> BlockQuantized:
        if self._transposed is None:
            with torch.no_grad():
                self._transposed = _transpose_weight(self.weight)
        return self._transposed


#: Every live cache. A global post-step hook empties them at any torch.optim step: torch's fused optimizers
#: (``AdamW(fused=True)``) update the parameters without bumping their version counters, so a cache keyed on
#: ``_version`` alone would keep serving the pre-step FP8 copy, and emptying (rather than marking stale) frees the
#: copies (a layer's weights and their transposes, 1.2 GB at Qwen3-30B-A3B) at the step, not at the layer's next use.
_caches: "weakref.WeakSet[Fp8WeightCache]" = weakref.WeakSet()


def empty_weight_caches() -> None:
    """Empty every live :class:`Fp8WeightCache`, as any torch.optim step does: the next FP8 call quantizes its weights
    anew (e.g. after updating them through ``w.data``, or to measure memory as a training step's forward sees it)."""
    for cache in list(_caches):
        cache.clear()


def _clear_caches_after_a_step(_optimizer, _args, _kwargs) -> None:
    empty_weight_caches()


register_optimizer_step_post_hook(_clear_caches_after_a_step)


class Fp8WeightCache:
    """FP8 copies of weights, made once per version of the weight and optimizer step (any step empties the cache).

    An entry is keyed on where the weight lies (``data_ptr``, shape, strides, dtype, device) and the scale option, so
    that an alias of the weight (autograd hands the backward of a checkpointed call a detached alias of a saved
    parameter, a new tensor object each time) finds the copy its parameter made. It holds a weak reference to the
    weight's storage (one Python object as long as the storage lives, whichever alias asked) and the asking tensor's
    ``_version``; it is reused only while that storage is alive (so the memory is still its weight's) and the
    ``_version`` (aliases share the counter) is unchanged. An in-place update through the tensor (``w.add_``) bumps
    ``_version`` and so invalidates the entry; any torch.optim step (fused ones included, which leave ``_version`` as
    it was) empties every cache; an update through ``w.data`` outside an optimizer does neither (``.data`` has its own
    version counter): call :meth:`clear` after one. An entry goes when its weight's storage is freed.
    """

    def __init__(self):
        self._entries: dict = {}
        self.hits = 0
        self.misses = 0
        _caches.add(self)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(w: torch.Tensor, pow2_scales: bool):
        return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device, bool(pow2_scales))

    def get(self, w: torch.Tensor, pow2_scales: bool = False) -> QuantizedWeight:
        key = self._key(w, pow2_scales)
        state = w._version
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is not None and entry[1] == state:
            self.hits += 1
            return entry[2]
        self.misses += 1
        with torch.no_grad():
            q = quantize_weight(w.detach(), pow2_scales)
        return self._remember(key, w, state, QuantizedWeight(q))

    def _remember(self, key, w: torch.Tensor, state, value: QuantizedWeight, *more) -> QuantizedWeight:
        """Keep ``value`` under ``key`` until ``w``'s storage is freed (``more``: further entries' fields)."""
        entries = self._entries

        def _drop(_ref, key=key, entries=entries):
            current = entries.get(key)
            if current is not None and current[0] is _ref:
                del entries[key]

        entries[key] = (weakref.ref(w.untyped_storage(), _drop), state, value, *more)
        return value

    def get_with_chunks(self, w: torch.Tensor, w_2: torch.Tensor, chunks: int, layout: str,
                        pow2_scales: bool = False) -> QuantizedWeight:
        """The FP8 copy of ``w`` with ``w_2``'s chunks as experts after its own (:func:`quantize_weight_with_chunks`),
        kept while both weights are alive and at the versions it was made from, and emptied at any optimizer step,
        as :meth:`get`'s entries."""
        key = ("chunks", self._key(w, pow2_scales), self._key(w_2, pow2_scales), int(chunks), layout)
        state = (w._version, w_2._version)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is not None and entry[1] == state and entry[3]() is not None:
            self.hits += 1
            return entry[2]
        self.misses += 1
        with torch.no_grad():
            q = quantize_weight_with_chunks(w.detach(), w_2.detach(), chunks, layout, pow2_scales)
        return self._remember(key, w, state, QuantizedWeight(q), weakref.ref(w_2.untyped_storage()))


#: The cache the reference uses unless it is given one.
WEIGHT_CACHE = Fp8WeightCache()


def recipe_and_cache(fp8_recipe: Fp8Recipe | None,
                     weight_cache: Fp8WeightCache | None) -> tuple[Fp8Recipe, Fp8WeightCache]:
    """The call's (recipe, weight cache): the ones given, else DEFAULT_RECIPE and the process-wide WEIGHT_CACHE."""
    return fp8_recipe or DEFAULT_RECIPE, WEIGHT_CACHE if weight_cache is None else weight_cache


#: The FP8 call sequence's names (:mod:`prime_kernels.mega.staged_fp8`), reachable here too because call sites
#: written for a DeepGEMM fork import them from its ``mega.fp8`` module. Resolved on first use: that module
#: imports the kernels' wrappers, which import this one.
STAGED_CALLS = ("FP8SymmBuffer", "FP8Pools", "FP8BackwardBuffers", "pool_capacity", "expert_offsets",
                "fp8_weights_for_mega_moe", "fp8_mega_moe", "column_quant", "allocate_column_quant",
                "fp8_mega_moe_backward", "fp8_mega_moe_weight_grads", "fp8_mega_moe_weight_grads_add",
                "MAX_DEFERRED")


def __getattr__(name):
    if name in STAGED_CALLS:
        from . import staged_fp8  # noqa: PLC0415

        return getattr(staged_fp8, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
