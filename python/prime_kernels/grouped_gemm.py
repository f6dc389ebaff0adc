"""BF16 grouped GEMMs (sm90 wgmma kernels on CUDA; a float32-accumulating reference on the CPU). On a CUDA device
whose compute capability major is not 9 the bf16 ones run on torch's grouped GEMM instead
(:func:`prime_kernels.grouped_gemm_torch.selected` decides, for every one of them).

Rows are grouped by ``group_offsets`` (int32 [E + 1], cumulative row starts, last entry = rows used;
no padding needed, empty groups allowed).

- ``m_grouped_bf16_gemm_nt(a [M, K], b [E, N, K], offs) -> [M, N]``: row r of group g is a[r] @ b[g]^T
  (the forward passes, weights in their natural [out, in] layout).
- ``m_grouped_bf16_gemm_nn(a [M, K], b [E, K, N], offs) -> [M, N]``: a[r] @ b[g] (the dgrad passes:
  the same weights read MN-major, no transposed copy).
- ``k_grouped_bf16_gemm_tn(a [P, M], b [P, N], offs) -> [E, M, N]``: a_g^T @ b_g over each group's rows
  (the weight gradients), fp32 or bf16 out, or accumulated into a given fp32 buffer.
- ``m_grouped_fp8_gemm_nt(a [M, K], sa [M, K/128], b [E, N, K], sb [E, N/128, K/128], offs) -> [M, N]``
  (bf16): blockwise-scaled FP8 (e4m3 operands, fp32 scales per 1 x 128 of a and per 128 x 128 of b,
  DeepSeek-V3's recipe): row r of group g is sum over 128-wide k-blocks kb of
  (a[r, kb] . b[g][n, kb]) * sa[r, kb] * sb[g][n // 128, kb]. See docs/fp8_gemm.md for the layouts.
- ``k_grouped_fp8_gemm_tn(a [M, P], sa [M, P/128], b [N, P], sb [N, P/128], offs) -> [E, M, N]``: the
  blockwise-FP8 weight gradients, C_g = sum over group g's 128-row token blocks kb of
  (a[:, kb] . b[:, kb]) * sa[:, kb] * sb[:, kb] (row x column scales), fp32 or bf16 out, or added into a given fp32
  buffer. The operands are the recipe's qT operands stored token axis contiguous (sm90's FP8 wgmma reads K-major
  operands only), and every group offset is a multiple of 128 or P (each expert starts on a whole token block, as
  the routing plan's pool lays experts out).

Rows of the m-grouped output that lie outside every group are left unspecified.

``group_offsets`` must satisfy 0 <= offs[0] <= ... <= offs[E] <= rows. Index arrays (``a_row_index``,
``pool_src_route``) hold -1 (masked) or an index in range. On CUDA these values are checked by the kernels
themselves (no host synchronisation): bad offsets make the GEMM write nothing, an out-of-range index is read as
masked, and the finding is raised as a RuntimeError by the next call into the library, or by
:func:`prime_kernels.check_device_errors` (call it after synchronising to check the calls before). On the CPU they raise at once.

``num_sms`` (every op): the most SMs the kernel may use (None: all of them), for leaving SMs to other work;
every value gives the same bits.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import _lib, _status
from . import grouped_gemm_torch as _torch_gemms
from .swiglu import _parts as swiglu_parts
from .swiglu import swiglu_bwd_reference

__all__ = ["m_grouped_bf16_gemm_nt", "m_grouped_bf16_gemm_nn", "m_grouped_bf16_gemm_swiglu", "k_grouped_bf16_gemm_tn",
           "m_grouped_fp8_gemm_nt", "m_grouped_gemm_reference", "k_grouped_gemm_reference",
           "m_grouped_fp8_gemm_reference", "k_block_major_scales", "k_grouped_fp8_gemm_tn",
           "k_grouped_fp8_gemm_reference"]

_KEYS = {"m_grouped_bf16_gemm_nt": "m_grouped_gemm_nt.bf16.sm90",
         "m_grouped_bf16_gemm_nn": "m_grouped_gemm_nn.bf16.sm90",
         "m_grouped_bf16_gemm_nt_gather": "m_grouped_gemm_nt_gather.bf16.sm90",
         "m_grouped_bf16_gemm_swiglu": "m_grouped_gemm_swiglu.bf16.sm90",
         "m_grouped_bf16_gemm_swiglu_bwd": "m_grouped_gemm_swiglu_bwd.bf16.sm90",
         "k_grouped_bf16_gemm_tn": "k_grouped_gemm_tn.bf16.sm90",
         "k_grouped_bf16_gemm_tn_accumulate_": "k_grouped_gemm_tn.bf16.sm90",
         "m_grouped_fp8_gemm_nt": "m_grouped_gemm_nt.fp8.sm90",
         "k_grouped_fp8_gemm_tn": "k_grouped_gemm_tn.fp8.sm90",
         "k_grouped_fp8_gemm_tn_accumulate_": "k_grouped_gemm_tn.fp8.sm90"}


def _ready(op: str, device: torch.device) -> None:
    if device.type == "cuda":
        _status.require(_KEYS[op])
    elif not _lib.load().shim_loaded:
        raise RuntimeError(f"prime_kernels: {op} is not available: {_lib.load().reason}")


def _sms(num_sms: int | None) -> int:
    if num_sms is None:
        return 0
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms must be a positive int or None (every SM), got {num_sms!r}")
    return num_sms


def check_offsets_cpu(offs: torch.Tensor, rows: int) -> None:
    """The kernels' rule for group_offsets, on a CPU tensor: 0 <= offs[0] <= ... <= offs[-1] <= rows."""
    o = offs.to(torch.int64)
    if o.numel() and (bool((o[1:] < o[:-1]).any()) or int(o[0]) < 0 or int(o[-1]) > rows):
        raise RuntimeError(f"group_offsets must be non-decreasing within [0, {rows}], got {offs.tolist()}")


def check_index_cpu(idx: torch.Tensor, bound: int, name: str) -> None:
    """-1 or [0, bound) for every entry of a CPU index tensor."""
    bad = (idx < -1) | (idx >= bound)
    if bool(bad.any()):
        raise RuntimeError(f"{name} holds {int(idx[bad][0])}, outside [-1, {bound})")


def m_grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor, b_k_major: bool,
                             acc_dtype: torch.dtype = torch.float32, round_output: bool = True) -> torch.Tensor:
    """Per-group matmul in ``acc_dtype``, rounded to a's dtype (unless float64 or ``round_output`` is
    False); rows outside every group are zero."""
    offs = group_offsets.tolist()
    out = torch.zeros(a.shape[0], b.shape[1] if b_k_major else b.shape[2], dtype=acc_dtype, device=a.device)
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if hi > lo:
            w = b[g].to(acc_dtype)
            out[lo:hi] = a[lo:hi].to(acc_dtype) @ (w.t() if b_k_major else w)
    return out.to(a.dtype) if (acc_dtype != torch.float64 and round_output) else out


def k_grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor,
                             acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    offs = group_offsets.tolist()
    out = torch.zeros(len(offs) - 1, a.shape[1], b.shape[1], dtype=acc_dtype, device=a.device)
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if hi > lo:
            out[g] = a[lo:hi].to(acc_dtype).t() @ b[lo:hi].to(acc_dtype)
    return out


FP8_BLOCK = 128  # the recipe's scale block along K (and along N for b)


def k_block_major_empty(rows: int, blocks: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised [rows, blocks] scale tensor laid out as the FP8 GEMMs read scales: stride(0) == 1 and
    stride(1) = rows rounded up to a multiple of 4 (16-byte aligned columns)."""
    buf = torch.empty(blocks, (rows + 3) // 4 * 4, dtype=dtype, device=device)
    return buf[:, :rows].t()


def k_block_major_scales(sa: torch.Tensor) -> torch.Tensor:
    """``sa`` [M, K/128] fp32 laid out as the FP8 kernel reads it (one TMA box per tile and k-block): K-block major,
    i.e. stride(0) == 1 and stride(1) a multiple of 4 that is >= M, 16-byte aligned (the transpose of a contiguous
    [K/128, M'] tensor, M' = M rounded up to 4). Returns ``sa`` itself when it is laid out so, else such a copy."""
    m, kb = sa.shape
    ok_rows = m <= 1 or sa.stride(0) == 1
    ok_ld = kb == 1 or (sa.stride(1) % 4 == 0 and sa.stride(1) >= m)
    if m == 0 or (ok_rows and ok_ld and sa.data_ptr() % 16 == 0):
        return sa
    buf = k_block_major_empty(m, kb, sa.device, sa.dtype)
    buf.copy_(sa)
    return buf


def _a_scales_are_64(k: int, sa_cols: int) -> bool:
    """Whether an A scale tensor with ``sa_cols`` columns holds 1 x 64 blocks (K / 64 of them) rather than 1 x 128
    (ceil(K / 128)); at K = 64 the two are one block and read alike."""
    return k % 64 == 0 and sa_cols == k // 64 and k // 64 != -(-k // FP8_BLOCK)


def m_grouped_fp8_gemm_reference(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                                 group_offsets: torch.Tensor, acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The blockwise-FP8 m-grouped GEMM emulated. float32: the recipe's G1-G3 in the kernel's order (each K block's
    products summed as the tensor core sums them, prime_kernels.mega.fp8.tensor_core_partial; scaled by the fp32
    product sa * sb and added into the fp32 accumulator with one rounding; the block is 128, or 64 when sa has K / 64
    columns: an A quantized 1 x 64), rounded to bf16; float64: the dequantized operands' product, not rounded. Rows
    outside every group are zero."""
    from .mega.fp8 import tensor_core_partial

    offs = group_offsets.tolist()
    m, k = a.shape
    n = b.shape[1]
    a_block = FP8_BLOCK // 2 if _a_scales_are_64(k, sa.shape[1]) else FP8_BLOCK
    kb = (k + a_block - 1) // a_block
    out = torch.zeros(m, n, dtype=acc_dtype, device=a.device)
    sa_c = sa.to(acc_dtype)
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if hi <= lo:
            continue
        x, w = a[lo:hi].to(acc_dtype), b[g].to(acc_dtype)
        sbn = sb[g].to(acc_dtype).repeat_interleave(FP8_BLOCK, 0)[:n]  # [N, K / 128]: each column's block scales
        if acc_dtype == torch.float64:
            xs = x * sa_c[lo:hi].repeat_interleave(a_block, 1)[:, :k]
            ws = w * sbn.repeat_interleave(FP8_BLOCK, 1)[:, :k]
            out[lo:hi] = xs @ ws.t()
            continue
        c = torch.zeros(hi - lo, n, dtype=torch.float32, device=a.device)
        for j in range(kb):
            blk = slice(j * a_block, min(k, (j + 1) * a_block))
            partial = tensor_core_partial(x[:, blk], w[:, blk])  # G1
            scale = sa_c[lo:hi, j:j + 1] * sbn[:, (j * a_block) // FP8_BLOCK][None, :]  # G2
            c = (c.double() + scale.double() * partial.double()).float()  # G3
        out[lo:hi] = c
    return out if acc_dtype == torch.float64 else out.to(torch.bfloat16)


def m_grouped_fp8_gemm_nt(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                          group_offsets: torch.Tensor, *, num_sms: int | None = None) -> torch.Tensor:
    """Blockwise-FP8 m-grouped GEMM, bf16 [M, N] out. a float8_e4m3fn [M, K] (K a multiple of 64: with K = 64 mod
    128 the last scale block along K is 64 wide), sa float32 [M, ceil(K/128)], or [M, K/64] for an A quantized
    1 x 64 (the FP8 forward's L2 operand; each 128-wide k-block is then promoted in two halves), in any layout (it is
    made K-block major first, see k_block_major_scales), b float8_e4m3fn [E, N, K] (K contiguous), sb float32
    [E, ceil(N/128), ceil(K/128)]. Rows outside every group are left unspecified."""
    sms = _sms(num_sms)
    _ready("m_grouped_fp8_gemm_nt", a.device)
    if sa.dim() == 2 and sa.dtype == torch.float32:
        sa = k_block_major_scales(sa)
    return torch.ops.prime_kernels.m_grouped_fp8_gemm_nt(a, sa, b, sb, group_offsets, sms)


def check_token_block_offsets_cpu(offs: torch.Tensor, rows: int) -> None:
    """The FP8 k-grouped GEMM's rule for group_offsets, on a CPU tensor: check_offsets_cpu's, and every entry a
    multiple of 128 or ``rows`` (each expert starts on a whole 128-row token block of the scales)."""
    check_offsets_cpu(offs, rows)
    o = offs.to(torch.int64)
    bad = (o % FP8_BLOCK != 0) & (o != rows)
    if bool(bad.any()):
        raise RuntimeError(f"group_offsets must be multiples of {FP8_BLOCK} or {rows} (each expert starts on a whole "
                           f"{FP8_BLOCK}-row token block), got {offs.tolist()}")


def k_grouped_fp8_gemm_reference(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                                 group_offsets: torch.Tensor, acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The blockwise-FP8 k-grouped GEMM emulated, fp32 (or float64) [E, M, N]. float32: the recipe's G1-G3
    (docs/fp8.md; prime_kernels.mega.fp8.fp8_gemm_nt): each 128-row token block's products summed as the tensor
    core sums them (prime_kernels.mega.fp8.tensor_core_partial), scaled by the fp32 product sa[m, kb] * sb[n, kb]
    and added into the fp32 accumulator with one rounding, blocks in increasing order; float64: the dequantized
    operands' product. An empty group gives zeros."""
    from .mega.fp8 import tensor_core_partial

    offs = group_offsets.tolist()
    (m, p), n = a.shape, b.shape[0]
    out = torch.zeros(len(offs) - 1, m, n, dtype=acc_dtype, device=a.device)
    fa, fb = a.double(), b.double()
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if hi <= lo:
            continue
        if acc_dtype == torch.float64:
            xs = fa[:, lo:hi] * sa.double().repeat_interleave(FP8_BLOCK, 1)[:, lo:hi]
            ws = fb[:, lo:hi] * sb.double().repeat_interleave(FP8_BLOCK, 1)[:, lo:hi]
            out[g] = xs @ ws.t()
            continue
        c = torch.zeros(m, n, dtype=torch.float32, device=a.device)
        for k0 in range(lo, hi, FP8_BLOCK):
            k1, kb = min(k0 + FP8_BLOCK, hi), k0 // FP8_BLOCK
            partial = tensor_core_partial(fa[:, k0:k1], fb[:, k0:k1])  # G1
            scale = sa[:, kb, None].float() * sb[None, :, kb].float()  # G2
            c = (c.double() + scale.double() * partial.double()).float()  # G3
        out[g] = c
    return out


def k_grouped_fp8_gemm_tn(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                          group_offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
                          accumulate_into: torch.Tensor | None = None, num_sms: int | None = None) -> torch.Tensor:
    """Blockwise-FP8 k-grouped GEMM (the weight gradients): C_g [M, N] for every group g of group_offsets' token
    rows. a float8_e4m3fn [M, P] and b float8_e4m3fn [N, P], token axis contiguous (the qT operands transposed);
    sa float32 [M, ceil(P/128)] and sb [N, ceil(P/128)] (one scale per column and 128-row token block, any layout:
    made K-block major first, see k_block_major_scales); group_offsets int32 [E + 1], every entry a multiple of 128
    or P. Returns fp32 or bf16 [E, M, N]; with ``accumulate_into`` (fp32 [E, M, N]) adds into it and returns it (an
    empty group leaves its slice as it is)."""
    sms = _sms(num_sms)
    if sa.dim() == 2 and sa.dtype == torch.float32:
        sa = k_block_major_scales(sa)
    if sb.dim() == 2 and sb.dtype == torch.float32:
        sb = k_block_major_scales(sb)
    if accumulate_into is not None:
        _ready("k_grouped_fp8_gemm_tn_accumulate_", a.device)
        torch.ops.prime_kernels.k_grouped_fp8_gemm_tn_accumulate_(a, sa, b, sb, group_offsets, accumulate_into, sms)
        return accumulate_into
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    _ready("k_grouped_fp8_gemm_tn", a.device)
    return torch.ops.prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, group_offsets, out_dtype == torch.float32, sms)


def m_grouped_bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor, *,
                           a_row_index: torch.Tensor | None = None, m_total: int | None = None,
                           num_sms: int | None = None) -> torch.Tensor:
    """With ``a_row_index`` (int32 [>= m_total]), output row r is a[a_row_index[r]] @ b[g]^T (-1 reads a zero
    row): a token gather without a materialised copy."""
    if _torch_gemms.selected(a.device):
        return _torch_gemms.m_grouped_bf16_gemm_nt(a, b, group_offsets, a_row_index=a_row_index, m_total=m_total)
    sms = _sms(num_sms)
    if a_row_index is None:
        _ready("m_grouped_bf16_gemm_nt", a.device)
        return torch.ops.prime_kernels.m_grouped_bf16_gemm_nt(a, b, group_offsets, sms)
    _ready("m_grouped_bf16_gemm_nt_gather", a.device)
    m_total = a_row_index.shape[0] if m_total is None else m_total
    return torch.ops.prime_kernels.m_grouped_bf16_gemm_nt_gather(a, b, group_offsets, a_row_index, m_total, sms)


def m_grouped_bf16_gemm_nn(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor, *,
                           num_sms: int | None = None) -> torch.Tensor:
    if _torch_gemms.selected(a.device):
        return _torch_gemms.m_grouped_bf16_gemm_nn(a, b, group_offsets)
    sms = _sms(num_sms)
    _ready("m_grouped_bf16_gemm_nn", a.device)
    return torch.ops.prime_kernels.m_grouped_bf16_gemm_nn(a, b, group_offsets, sms)


def m_grouped_bf16_gemm_swiglu(a: torch.Tensor, w13: torch.Tensor, group_offsets: torch.Tensor, *,
                               a_row_index: torch.Tensor | None = None, m_total: int | None = None,
                               save_h: bool = False, clamp: float | None = None, num_sms: int | None = None):
    """L1 with the SwiGLU epilogue. w13 [E, 2I, K] in its natural layout (gate rows, then up rows).
    Returns (s [m_total, I], h [m_total, 2I] or [0, 2I]): h = bf16(g|u) from the fp32 accumulators (returned
    when ``save_h``; with a clamp rounded so that it keeps the clamp masks, reference F6), and s = bf16(silu(min(g~, c)) * clamp(u~, -c, c)) on those bf16 values g~, u~ in fp32
    (the reference's F3: s is the rounding of what the backward differentiates)."""
    if _torch_gemms.selected(a.device):
        return _torch_gemms.m_grouped_bf16_gemm_swiglu(a, w13, group_offsets, a_row_index=a_row_index,
                                                      m_total=m_total, save_h=save_h, clamp=clamp)
    sms = _sms(num_sms)
    _ready("m_grouped_bf16_gemm_swiglu", a.device)
    if m_total is None:
        m_total = a_row_index.shape[0] if a_row_index is not None else a.shape[0]
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 (or None), got {clamp}")
    return torch.ops.prime_kernels.m_grouped_bf16_gemm_swiglu(a, w13, group_offsets, a_row_index, m_total, save_h,
                                                          0.0 if clamp is None else float(clamp), sms)


def m_grouped_bf16_gemm_swiglu_bwd(dy_pool: torch.Tensor, w2: torch.Tensor, group_offsets: torch.Tensor,
                                   h: torch.Tensor, pool_src_route: torch.Tensor, topk_weights: torch.Tensor, *,
                                   clamp: float | None = None, num_sms: int | None = None):
    """L2 dgrad with the SwiGLU backward in its epilogue (the fp32 da = dy_pool @ w2_g never goes to
    memory). w2 [E, H, I] (I a multiple of 64), h [>= M, 2I] the saved gate | up, pool_src_route [>= M] route
    ids (-1: padding), topk_weights [T, K] fp32 (indexed by route id, so every id must be < T * K). Returns
    (dh [M, 2I], w * s [M, I], dt_part [M, ceil(I / 128)] fp32): the row's d topk_weight is dt_part's row summed
    left to right. Rows outside every group are not written in dh and w * s, and are zeros in dt_part."""
    if _torch_gemms.selected(dy_pool.device):
        return _torch_gemms.m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, group_offsets, h, pool_src_route,
                                                          topk_weights, clamp=clamp)
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 (or None), got {clamp}")
    sms = _sms(num_sms)
    _ready("m_grouped_bf16_gemm_swiglu_bwd", dy_pool.device)
    return torch.ops.prime_kernels.m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, group_offsets, h, pool_src_route,
                                                              topk_weights.reshape(-1),
                                                              0.0 if clamp is None else float(clamp), sms)


def k_grouped_bf16_gemm_tn(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor, *,
                           out_dtype: torch.dtype = torch.float32,
                           accumulate_into: torch.Tensor | None = None, num_sms: int | None = None) -> torch.Tensor:
    """C_g = a_g^T @ b_g. With ``accumulate_into`` (fp32 [E, M, N]) adds into it and returns it."""
    if _torch_gemms.selected(a.device):
        return _torch_gemms.k_grouped_bf16_gemm_tn(a, b, group_offsets, out_dtype=out_dtype,
                                                  accumulate_into=accumulate_into)
    sms = _sms(num_sms)
    if accumulate_into is not None:
        _ready("k_grouped_bf16_gemm_tn_accumulate_", a.device)
        torch.ops.prime_kernels.k_grouped_bf16_gemm_tn_accumulate_(a, b, group_offsets, accumulate_into, sms)
        return accumulate_into
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    _ready("k_grouped_bf16_gemm_tn", a.device)
    return torch.ops.prime_kernels.k_grouped_bf16_gemm_tn(a, b, group_offsets, out_dtype == torch.float32, sms)


def _register() -> None:
    """CPU kernels (the reference) and fake kernels, so opcheck and torch.compile run anywhere."""
    lib = "prime_kernels::"

    def _check_cpu(a, b, offs, rows):
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            raise TypeError("prime_kernels grouped GEMMs take bfloat16 operands")
        if offs.dtype != torch.int32 or offs.dim() != 1:
            raise TypeError("group_offsets must be a 1-D int32 tensor [num_groups + 1]")
        check_offsets_cpu(offs, rows)

    for name, k_major in (("m_grouped_bf16_gemm_nt", True), ("m_grouped_bf16_gemm_nn", False)):
        def cpu(a, b, group_offsets, num_sms=0, _k_major=k_major):
            _check_cpu(a, b, group_offsets, a.shape[0])
            return m_grouped_gemm_reference(a, b, group_offsets, _k_major)

        def fake(a, b, group_offsets, num_sms=0, _k_major=k_major):
            return a.new_empty(a.shape[0], b.shape[1] if _k_major else b.shape[2])

        torch.library.register_kernel(lib + name, "cpu", cpu)
        torch.library.register_fake(lib + name, fake)

    def gather_rows(a, a_row_index, m_total):
        check_index_cpu(a_row_index[:m_total], a.shape[0], "a_row_index")
        idx = a_row_index[:m_total].long()
        ok = (idx >= 0) & (idx < a.shape[0])
        rows = a[idx.clamp(0, max(a.shape[0] - 1, 0))] if a.shape[0] else a.new_zeros(m_total, a.shape[1])
        return torch.where(ok[:, None], rows, torch.zeros((), dtype=a.dtype))

    def gather_cpu(a, b, group_offsets, a_row_index, m_total, num_sms=0):
        _check_cpu(a, b, group_offsets, m_total)
        return m_grouped_gemm_reference(gather_rows(a, a_row_index, m_total), b, group_offsets, True)

    def gather_fake(a, b, group_offsets, a_row_index, m_total, num_sms=0):
        return a.new_empty(m_total, b.shape[1])

    def swiglu_cpu(a, w13, group_offsets, a_row_index, m_total, save_h, clamp=0.0, num_sms=0):
        _check_cpu(a, w13, group_offsets, m_total)
        rows = gather_rows(a, a_row_index, m_total) if a_row_index is not None else a[:m_total]
        h = m_grouped_gemm_reference(rows, w13, group_offsets, True, torch.float32, round_output=False)
        I = w13.shape[1] // 2
        from .mega.reference import round_h  # noqa: PLC0415 (the layer package imports this module)

        # SwiGLU on h rounded as it is saved (reference F3); with a clamp, keeping its masks (F6) as the kernels do
        hb = round_h(h, clamp if clamp > 0 else None, a.dtype)
        g, u = hb[:, :I].float(), hb[:, I:].float()
        if clamp > 0:
            g, u = torch.clamp(g, max=clamp), torch.clamp(u, min=-clamp, max=clamp)
        s = (torch.nn.functional.silu(g) * u).to(a.dtype)
        return s, (hb if save_h else a.new_empty(0, 2 * I))

    def swiglu_fake(a, w13, group_offsets, a_row_index, m_total, save_h, clamp=0.0, num_sms=0):
        I = w13.shape[1] // 2
        return a.new_empty(m_total, I), a.new_empty(m_total if save_h else 0, 2 * I)

    def swiglu_bwd_cpu(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, clamp=0.0, num_sms=0):
        # the pool-row kernel's reference on the unrounded da, plus the per-128-column d weight partials
        _check_cpu(dy_pool, w2, group_offsets, dy_pool.shape[0])
        M, I = dy_pool.shape[0], w2.shape[2]
        nb = (I + 127) // 128
        da = m_grouped_gemm_reference(dy_pool, w2, group_offsets, False, torch.float32, round_output=False)
        ref_clamp = clamp if clamp > 0 else -1.0  # the pool-row kernel's convention: < 0 = none
        dh, aw, _ = swiglu_bwd_reference(h[:M], da, pool_src_route, topk_weights, torch.tensor([M]), ref_clamp)
        _, _, gc, uc = swiglu_parts(h[:M], ref_clamp)
        prod = torch.nn.functional.pad(da * F.silu(gc) * uc, (0, nb * 128 - I)).view(M, nb, 128).sum(-1)
        dt_part = torch.where(pool_src_route[:M, None] >= 0, prod, torch.zeros(()))
        return dh, aw, dt_part

    def swiglu_bwd_fake(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, clamp=0.0, num_sms=0):
        M, I = dy_pool.shape[0], w2.shape[2]
        return (dy_pool.new_empty(M, 2 * I), dy_pool.new_empty(M, I),
                dy_pool.new_empty(M, (I + 127) // 128, dtype=torch.float32))

    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_swiglu_bwd", "cpu", swiglu_bwd_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_swiglu_bwd", swiglu_bwd_fake)
    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_swiglu", "cpu", swiglu_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_swiglu", swiglu_fake)
    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_nt_gather", "cpu", gather_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_nt_gather", gather_fake)

    def fp8_dtypes_cpu(op, a, sa, b, sb, offs):
        """The dtypes both FP8 GEMMs take: e4m3 operands, fp32 scales, int32 offsets."""
        if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
            raise TypeError(f"prime_kernels.{op}: a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
        if sa.dtype != torch.float32 or sb.dtype != torch.float32:
            raise TypeError(f"prime_kernels.{op}: sa and sb must be float32, got {sa.dtype} and {sb.dtype}")
        if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] < 2:
            raise TypeError(f"prime_kernels.{op}: group_offsets must be a 1-D int32 tensor [num_groups + 1]")

    def fp8_check_cpu(a, sa, b, sb, offs):
        op = "m_grouped_fp8_gemm_nt"
        fp8_dtypes_cpu(op, a, sa, b, sb, offs)
        if a.dim() != 2 or b.dim() != 3:
            raise RuntimeError(f"prime_kernels.{op}: a must be 2-D [M, K] and b 3-D [E, N, K]")
        m, k = a.shape
        e, n = offs.shape[0] - 1, b.shape[1]
        if b.shape[0] != e:
            raise RuntimeError(f"prime_kernels.{op}: b has {b.shape[0]} groups, group_offsets {e}")
        if b.shape[2] != k:
            raise RuntimeError(f"prime_kernels.{op}: b's K ({b.shape[2]}) does not match a's K ({k})")
        if k < 64 or k % 64 != 0:
            raise RuntimeError(f"prime_kernels.{op}: k ({k}) must be a positive multiple of 64 (one scale block per "
                               f"128 of K, the last one 64 wide when k is 64 mod 128)")
        if n < 8 or n % 8 != 0:
            raise RuntimeError(f"prime_kernels.{op}: n ({n}) must be a multiple of 8")
        kb, nb = -(-k // FP8_BLOCK), (n + FP8_BLOCK - 1) // FP8_BLOCK
        if tuple(sa.shape) not in ((m, kb), (m, k // 64)):
            raise RuntimeError(f"prime_kernels.{op}: sa must be [M, ceil(K / 128)] = [{m}, {kb}] or [M, K / 64] = "
                               f"[{m}, {k // 64}], got {list(sa.shape)}")
        if tuple(sb.shape) != (e, nb, kb):
            raise RuntimeError(f"prime_kernels.{op}: sb must be [E, ceil(N / 128), ceil(K / 128)] = [{e}, {nb}, {kb}], "
                               f"got {list(sb.shape)}")
        check_offsets_cpu(offs, m)

    def fp8_cpu(a, sa, b, sb, group_offsets, num_sms=0):
        fp8_check_cpu(a, sa, b, sb, group_offsets)
        return m_grouped_fp8_gemm_reference(a, sa, b, sb, group_offsets)

    def fp8_fake(a, sa, b, sb, group_offsets, num_sms=0):
        return a.new_empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)

    torch.library.register_kernel(lib + "m_grouped_fp8_gemm_nt", "cpu", fp8_cpu)
    torch.library.register_fake(lib + "m_grouped_fp8_gemm_nt", fp8_fake)

    def k_cpu(a, b, group_offsets, out_fp32=True, num_sms=0):
        _check_cpu(a, b, group_offsets, a.shape[0])
        out = k_grouped_gemm_reference(a, b, group_offsets)
        return out if out_fp32 else out.to(torch.bfloat16)

    def k_fake(a, b, group_offsets, out_fp32=True, num_sms=0):
        return a.new_empty(group_offsets.shape[0] - 1, a.shape[1], b.shape[1],
                           dtype=torch.float32 if out_fp32 else torch.bfloat16)

    def k_acc_cpu(a, b, group_offsets, c, num_sms=0):
        _check_cpu(a, b, group_offsets, a.shape[0])
        c.add_(k_grouped_gemm_reference(a, b, group_offsets))

    def k_acc_fake(a, b, group_offsets, c, num_sms=0):
        return None

    torch.library.register_kernel(lib + "k_grouped_bf16_gemm_tn", "cpu", k_cpu)
    torch.library.register_fake(lib + "k_grouped_bf16_gemm_tn", k_fake)
    torch.library.register_kernel(lib + "k_grouped_bf16_gemm_tn_accumulate_", "cpu", k_acc_cpu)
    torch.library.register_fake(lib + "k_grouped_bf16_gemm_tn_accumulate_", k_acc_fake)

    def fp8k_check_cpu(op, a, sa, b, sb, offs):
        fp8_dtypes_cpu(op, a, sa, b, sb, offs)
        if a.dim() != 2 or b.dim() != 2:
            raise RuntimeError(f"prime_kernels.{op}: a [M, P], b [N, P], group_offsets [E + 1] expected")
        (m, p), n = a.shape, b.shape[0]
        if b.shape[1] != p:
            raise RuntimeError(f"prime_kernels.{op}: a [M, P] and b [N, P] must have the same token count P, got {p} "
                               f"and {b.shape[1]}")
        if m < 8 or n < 8 or m % 8 or n % 8:
            raise RuntimeError(f"prime_kernels.{op}: m ({m}) and n ({n}) must be multiples of 8")
        kb = (p + FP8_BLOCK - 1) // FP8_BLOCK
        for name, s, cols, label in (("sa", sa, m, "M"), ("sb", sb, n, "N")):
            if tuple(s.shape) != (cols, kb):
                raise RuntimeError(f"prime_kernels.{op}: {name} must be [{label}, ceil(P / 128)] = [{cols}, {kb}], "
                                   f"got {list(s.shape)}")
        check_token_block_offsets_cpu(offs, p)

    def fp8k_cpu(a, sa, b, sb, group_offsets, out_fp32=True, num_sms=0):
        fp8k_check_cpu("k_grouped_fp8_gemm_tn", a, sa, b, sb, group_offsets)
        out = k_grouped_fp8_gemm_reference(a, sa, b, sb, group_offsets)
        return out if out_fp32 else out.to(torch.bfloat16)

    def fp8k_fake(a, sa, b, sb, group_offsets, out_fp32=True, num_sms=0):
        return a.new_empty(group_offsets.shape[0] - 1, a.shape[0], b.shape[0],
                           dtype=torch.float32 if out_fp32 else torch.bfloat16)

    def fp8k_acc_cpu(a, sa, b, sb, group_offsets, c, num_sms=0):
        op = "k_grouped_fp8_gemm_tn_accumulate_"
        fp8k_check_cpu(op, a, sa, b, sb, group_offsets)
        want = (group_offsets.shape[0] - 1, a.shape[0], b.shape[0])
        if c.dtype != torch.float32 or c.dim() != 3 or not c.is_contiguous() or tuple(c.shape) != want:
            raise RuntimeError(f"prime_kernels.{op}: c must be a contiguous fp32 [E, M, N] tensor = {list(want)}")
        c.add_(k_grouped_fp8_gemm_reference(a, sa, b, sb, group_offsets))

    def fp8k_acc_fake(a, sa, b, sb, group_offsets, c, num_sms=0):
        return None

    torch.library.register_kernel(lib + "k_grouped_fp8_gemm_tn", "cpu", fp8k_cpu)
    torch.library.register_fake(lib + "k_grouped_fp8_gemm_tn", fp8k_fake)
    torch.library.register_kernel(lib + "k_grouped_fp8_gemm_tn_accumulate_", "cpu", fp8k_acc_cpu)
    torch.library.register_fake(lib + "k_grouped_fp8_gemm_tn_accumulate_", fp8k_acc_fake)
