"""The blockwise-FP8 recipe's quantizing producers (docs/fp8.md), rounding as :mod:`prime_kernels.mega.fp8` does.

- ``dispatch_rows_fp8(src [T, H], route_to_pool [T, K], num_rows) -> (q [rows, H], sa [rows, ceil(H/128)])``: the
  dispatch of bf16 token rows into the pool with qK(., 128): q[p] is ``fp8.quantize_along_k(src)[t]`` for every
  route p = route_to_pool[t, k], sa its scales K-block major (``sa.stride(0) == 1``), the A operand
  :func:`prime_kernels.m_grouped_fp8_gemm_nt` takes. Routes of -1 write nothing; rows no route names keep their
  contents (with no ``out``: unspecified).
- ``quantize_tokens_fp8(v [P, C], expert_offsets [E+1], expert_counts [E]) -> (q [C, P], scale [C, ceil(P/128)])``:
  qT of pool rows (bf16, or e4m3 with their 1 x 128 scales, read as their bf16 dequantization) for the weight-gradient
  GEMMs: expert e's rows [offsets[e], offsets[e] + counts[e]) quantized
  with ``fp8.quantize_along_tokens`` (block grid from the expert's first row), its padding rows and rows in no
  expert as zeros whatever they hold; q token axis contiguous, the operand layout
  :func:`prime_kernels.k_grouped_fp8_gemm_tn` takes. Every offset must be a multiple of 128 or P.

- ``quantize_weight_fp8(w [L, R, C]) -> (q [L, R, C], scale [L, R/128, C/128])``: a layer's bf16 weights in 128 x
  128 tiles (``fp8.quantize_weight`` bit for bit), R and C multiples of 128, in one read of w.
- ``transpose_tiles_fp8(q [L, R, C]) -> qt [L, C, R]``: such tiles transposed byte for byte (the K-major copy the
  GEMMs that read a weight the other way round take).

All run on CUDA (one kernel each, arch-neutral) and on the CPU (the core's host loops, the same bits). On CUDA,
invalid routes or pool layouts are checked by the kernels without a synchronisation (an invalid route writes
nothing, a broken layout makes the call write nothing; the next call into the library raises); on the CPU they
raise before anything is written.
"""

from __future__ import annotations

import torch

from . import _status
from .grouped_gemm import k_block_major_empty

__all__ = ["dispatch_rows_fp8", "quantize_tokens_fp8", "quantize_weight_fp8", "transpose_tiles_fp8",
           "k_block_major_empty"]

E4M3 = torch.float8_e4m3fn
BLOCK = 128


def _ready(key_stem: str, op: str, device: torch.device) -> None:
    _status.require_on(device, key_stem, op)


def dispatch_rows_fp8(src: torch.Tensor, route_to_pool: torch.Tensor, num_rows: int, *, pow2_scales: bool = False,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, sa) of the routed rows; ``out`` = (q e4m3 [num_rows, H], sa fp32 [num_rows, ceil(H/128)] K-block major) to
    write into (returned), else both are allocated. H must be a multiple of 64; with H = 64 (mod 128) the last block
    is 64 columns wide (its amax over those 64, as ``fp8.quantize_along_k``)."""
    _ready("dispatch_rows.fp8", "dispatch_rows_fp8", src.device)
    if out is None:
        q = torch.empty(num_rows, src.shape[-1], dtype=E4M3, device=src.device)
        sa = k_block_major_empty(num_rows, -(-src.shape[-1] // BLOCK), src.device)
    else:
        q, sa = out
    torch.ops.prime_kernels.dispatch_rows_fp8_(src, route_to_pool, q, sa, bool(pow2_scales))
    return q, sa


def quantize_tokens_fp8(v: torch.Tensor, expert_offsets: torch.Tensor, expert_counts: torch.Tensor, *,
                        pow2_scales: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                        pool_src_route: torch.Tensor | None = None, top_k: int = 1,
                        v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [C, P], scale fp32 [C, ceil(P/128)] K-block major); ``out`` to write into (returned), else allocated
    (q with its row stride rounded up to 16 bytes, as the k-grouped FP8 GEMM needs).

    v is the pool [P, C] bf16; or, with ``pool_src_route`` (int32 [P], the routing plan's: route = token * top_k + k,
    -1 for a padding row), the token rows [T, C], pool row r read from token row pool_src_route[r] // top_k: the same
    bits as gathering the pool first, without writing it. With ``v_scale`` (fp32 [P, C/128], any strides) v is the
    pool in e4m3, quantized 1 x 128 along C, and is read as ``bf16(v * scale)``: the same bits as dequantizing it to
    bf16 first (``fp8.BlockQuantized.dequantize`` rounded to bf16), without writing that copy."""
    _ready("quantize_tokens.fp8", "quantize_tokens_fp8", v.device)
    P = v.shape[0] if pool_src_route is None else pool_src_route.shape[0]
    if out is None:
        C = v.shape[1]
        q = torch.empty(C, (P + 15) // 16 * 16, dtype=E4M3, device=v.device)[:, :P]
        scale = k_block_major_empty(C, (P + BLOCK - 1) // BLOCK, v.device)
    else:
        q, scale = out
    if v_scale is not None:
        if pool_src_route is not None:
            raise ValueError("quantize_tokens_fp8: v_scale (e4m3 pool rows) and pool_src_route (gathering) do not "
                             "combine; pass one")
        torch.ops.prime_kernels.quantize_tokens_e4m3_fp8_(v, v_scale, expert_offsets, expert_counts, q, scale,
                                                          bool(pow2_scales))
    elif pool_src_route is None:
        torch.ops.prime_kernels.quantize_tokens_fp8_(v, expert_offsets, expert_counts, q, scale, bool(pow2_scales))
    else:
        torch.ops.prime_kernels.quantize_tokens_gathered_fp8_(v, pool_src_route, int(top_k), expert_offsets,
                                                             expert_counts, q, scale, bool(pow2_scales))
    return q, scale


def quantize_weight_fp8(w: torch.Tensor, *, pow2_scales: bool = False,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): ``w`` bf16 [L, R, C] (R, C multiples of 128) in 128 x 128 tiles, as ``fp8.quantize_weight`` gives
    them bit for bit; written into ``out`` (contiguous e4m3 [L, R, C] and fp32 [L, R / 128, C / 128]) when given."""
    _ready("quantize_weight.fp8", "quantize_weight_fp8", w.device)
    if w.dtype != torch.bfloat16 or w.dim() != 3:
        raise ValueError(f"quantize_weight_fp8: w must be a bfloat16 [L, R, C] tensor, got {w.dtype} {list(w.shape)}")
    L, R, C = w.shape
    if R % BLOCK or C % BLOCK:
        raise ValueError(f"quantize_weight_fp8: R ({R}) and C ({C}) must be multiples of {BLOCK} (whole tiles)")
    w = w.contiguous()
    if out is None:
        q = torch.empty((L, R, C), dtype=E4M3, device=w.device)
        scale = torch.empty((L, R // BLOCK, C // BLOCK), dtype=torch.float32, device=w.device)
    else:
        q, scale = out
        if (q.dtype != E4M3 or tuple(q.shape) != (L, R, C) or not q.is_contiguous() or scale.dtype != torch.float32
                or tuple(scale.shape) != (L, R // BLOCK, C // BLOCK) or not scale.is_contiguous()):
            raise ValueError(f"quantize_weight_fp8: out must be contiguous (e4m3 {[L, R, C]}, fp32 "
                             f"{[L, R // BLOCK, C // BLOCK]})")
    torch.ops.prime_kernels.quantize_weight_fp8_(w, q, scale, bool(pow2_scales))
    return q, scale


def transpose_tiles_fp8(q: torch.Tensor) -> torch.Tensor:
    """qt [L, C, R]: the e4m3 tiles of ``q`` [L, R, C] (R, C multiples of 128) transposed, byte for byte (the copy
    ``fp8.QuantizedWeight.transposed`` makes for the GEMMs that read a weight the other way round)."""
    _ready("transpose_tiles.fp8", "transpose_tiles_fp8", q.device)
    if q.dtype != E4M3 or q.dim() != 3:
        raise ValueError(f"transpose_tiles_fp8: q must be a float8_e4m3fn [L, R, C] tensor, got {q.dtype} "
                         f"{list(q.shape)}")
    L, R, C = q.shape
    if R % BLOCK or C % BLOCK:
        raise ValueError(f"transpose_tiles_fp8: R ({R}) and C ({C}) must be multiples of {BLOCK} (whole tiles)")
    q = q.contiguous()
    qt = torch.empty((L, C, R), dtype=E4M3, device=q.device)
    torch.ops.prime_kernels.transpose_tiles_fp8_(q, qt)
    return qt


def _register() -> None:
    from .mxfp8 import _register_fake as _register_mxfp8

    _register_mxfp8()

    @torch.library.register_fake("prime_kernels::dispatch_rows_fp8_")
    def _(src, route_to_pool, q, sa, pow2_scales=False):
        return None

    @torch.library.register_fake("prime_kernels::quantize_tokens_fp8_")
    def _(v, expert_offsets, expert_counts, q, scale, pow2_scales=False):
        return None

    @torch.library.register_fake("prime_kernels::quantize_tokens_gathered_fp8_")
    def _(src, pool_src_route, top_k, expert_offsets, expert_counts, q, scale, pow2_scales=False):
        return None

    @torch.library.register_fake("prime_kernels::quantize_weight_fp8_")
    def _(w, q, scale, pow2_scales=False):
        return None

    @torch.library.register_fake("prime_kernels::transpose_tiles_fp8_")
    def _(q, qt):
        return None

    @torch.library.register_fake("prime_kernels::quantize_tokens_e4m3_fp8_")
    def _(v, v_scale, expert_offsets, expert_counts, q, scale, pow2_scales=False):
        return None
