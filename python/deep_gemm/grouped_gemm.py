"""BF16 grouped GEMMs (sm90 wgmma kernels on CUDA; a float32-accumulating reference on the CPU).

Rows are grouped by ``group_offsets`` (int32 [E + 1], cumulative row starts, last entry = rows used;
no padding needed, empty groups allowed).

- ``m_grouped_bf16_gemm_nt(a [M, K], b [E, N, K], offs) -> [M, N]``: row r of group g is a[r] @ b[g]^T
  (the forward passes, weights in their natural [out, in] layout).
- ``m_grouped_bf16_gemm_nn(a [M, K], b [E, K, N], offs) -> [M, N]``: a[r] @ b[g] (the dgrad passes:
  the same weights read MN-major, no transposed copy).
- ``k_grouped_bf16_gemm_tn(a [P, M], b [P, N], offs) -> [E, M, N]``: a_g^T @ b_g over each group's rows
  (the weight gradients), fp32 or bf16 out, or accumulated into a given fp32 buffer.

Rows of the m-grouped output that lie outside every group are left unspecified.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _lib, _status
from .swiglu import _parts as swiglu_parts
from .swiglu import swiglu_bwd_reference

__all__ = ["m_grouped_bf16_gemm_nt", "m_grouped_bf16_gemm_nn", "m_grouped_bf16_gemm_swiglu", "k_grouped_bf16_gemm_tn",
           "m_grouped_gemm_reference", "k_grouped_gemm_reference"]

_KEYS = {"m_grouped_bf16_gemm_nt": "m_grouped_gemm_nt.bf16.sm90",
         "m_grouped_bf16_gemm_nn": "m_grouped_gemm_nn.bf16.sm90",
         "m_grouped_bf16_gemm_nt_gather": "m_grouped_gemm_nt_gather.bf16.sm90",
         "m_grouped_bf16_gemm_swiglu": "m_grouped_gemm_swiglu.bf16.sm90",
         "m_grouped_bf16_gemm_swiglu_bwd": "m_grouped_gemm_swiglu_bwd.bf16.sm90",
         "m_grouped_bf16_gemm_swiglu_bwd_gather": "m_grouped_gemm_swiglu_bwd.bf16.sm90",
         "k_grouped_bf16_gemm_tn": "k_grouped_gemm_tn.bf16.sm90",
         "k_grouped_bf16_gemm_tn_accumulate_": "k_grouped_gemm_tn.bf16.sm90"}


def _ready(op: str, device: torch.device) -> None:
    if device.type == "cuda":
        _status.require(_KEYS[op])
    elif not _lib.load().shim_loaded:
        raise RuntimeError(f"deep_gemm: {op} is not available: {_lib.load().reason}")


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


def m_grouped_bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor, *,
                           a_row_index: torch.Tensor | None = None, m_total: int | None = None) -> torch.Tensor:
    """With ``a_row_index`` (int32 [>= m_total]), output row r is a[a_row_index[r]] @ b[g]^T (an index
    outside [0, a.shape[0]) reads a zero row): a token gather without a materialised copy."""
    if a_row_index is None:
        _ready("m_grouped_bf16_gemm_nt", a.device)
        return torch.ops.deep_gemm.m_grouped_bf16_gemm_nt(a, b, group_offsets)
    _ready("m_grouped_bf16_gemm_nt_gather", a.device)
    m_total = a_row_index.shape[0] if m_total is None else m_total
    return torch.ops.deep_gemm.m_grouped_bf16_gemm_nt_gather(a, b, group_offsets, a_row_index, m_total)


def m_grouped_bf16_gemm_nn(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    _ready("m_grouped_bf16_gemm_nn", a.device)
    return torch.ops.deep_gemm.m_grouped_bf16_gemm_nn(a, b, group_offsets)


def m_grouped_bf16_gemm_swiglu(a: torch.Tensor, w13: torch.Tensor, group_offsets: torch.Tensor, *,
                               a_row_index: torch.Tensor | None = None, m_total: int | None = None,
                               save_h: bool = False, clamp: float | None = None):
    """L1 with the SwiGLU epilogue. w13 [E, 2I, K] in its natural layout (gate rows, then up rows).
    Returns (s [m_total, I], h [m_total, 2I] or [0, 2I]): h = bf16(g|u) from the fp32 accumulators (returned
    when ``save_h``), and s = bf16(silu(min(g~, c)) * clamp(u~, -c, c)) on those bf16 values g~, u~ in fp32
    (the reference's F3: s is the rounding of what the backward differentiates)."""
    _ready("m_grouped_bf16_gemm_swiglu", a.device)
    if m_total is None:
        m_total = a_row_index.shape[0] if a_row_index is not None else a.shape[0]
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 (or None), got {clamp}")
    return torch.ops.deep_gemm.m_grouped_bf16_gemm_swiglu(a, w13, group_offsets, a_row_index, m_total, save_h,
                                                          0.0 if clamp is None else float(clamp))


def m_grouped_bf16_gemm_swiglu_bwd(dy_pool: torch.Tensor, w2: torch.Tensor, group_offsets: torch.Tensor,
                                   h: torch.Tensor, pool_src_route: torch.Tensor, topk_weights: torch.Tensor, *,
                                   clamp: float | None = None, a_row_index: torch.Tensor | None = None,
                                   m_total: int | None = None):
    """L2 dgrad with the SwiGLU backward in its epilogue (the fp32 da = dy_pool @ w2_g never goes to
    memory). w2 [E, H, I], h [>= M, 2I] the saved gate | up, pool_src_route [>= M] route ids (< 0:
    padding), topk_weights [T, K] fp32 (indexed by route id). Returns (dh [M, 2I], w * s [M, I],
    dt_part [M, ceil(I / 128)] fp32): the row's d topk_weight is dt_part's row summed left to right.
    Rows outside every group are not written.

    With ``a_row_index`` (int32 [>= m_total]) and ``m_total``, the first argument is the dy rows by token
    [T, H] and the kernel gathers pool row m = dy[a_row_index[m]] (zeros for an index outside [0, T))
    while its tiles run (no separate gather pass; I must be a multiple of 64); it returns that pooled copy
    too, as a fourth output [m_total, H] (rows past the last group unspecified), for the weight gradient."""
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 (or None), got {clamp}")
    c = 0.0 if clamp is None else float(clamp)
    if a_row_index is not None:
        if m_total is None:
            raise ValueError("a_row_index needs m_total (the pool rows)")
        _ready("m_grouped_bf16_gemm_swiglu_bwd_gather", dy_pool.device)
        return torch.ops.deep_gemm.m_grouped_bf16_gemm_swiglu_bwd_gather(
            dy_pool, a_row_index, int(m_total), w2, group_offsets, h, pool_src_route, topk_weights.reshape(-1), c)
    _ready("m_grouped_bf16_gemm_swiglu_bwd", dy_pool.device)
    return torch.ops.deep_gemm.m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, group_offsets, h, pool_src_route,
                                                              topk_weights.reshape(-1), c)


def k_grouped_bf16_gemm_tn(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor, *,
                           out_dtype: torch.dtype = torch.float32,
                           accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """C_g = a_g^T @ b_g. With ``accumulate_into`` (fp32 [E, M, N]) adds into it and returns it."""
    if accumulate_into is not None:
        _ready("k_grouped_bf16_gemm_tn_accumulate_", a.device)
        torch.ops.deep_gemm.k_grouped_bf16_gemm_tn_accumulate_(a, b, group_offsets, accumulate_into)
        return accumulate_into
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    _ready("k_grouped_bf16_gemm_tn", a.device)
    return torch.ops.deep_gemm.k_grouped_bf16_gemm_tn(a, b, group_offsets, out_dtype == torch.float32)


def _register() -> None:
    """CPU kernels (the reference) and fake kernels, so opcheck and torch.compile run anywhere."""
    lib = "deep_gemm::"

    def _check_cpu(a, b, offs):
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            raise TypeError("deep_gemm grouped GEMMs take bfloat16 operands")
        if offs.dtype != torch.int32 or offs.dim() != 1:
            raise TypeError("group_offsets must be a 1-D int32 tensor [num_groups + 1]")

    for name, k_major in (("m_grouped_bf16_gemm_nt", True), ("m_grouped_bf16_gemm_nn", False)):
        def cpu(a, b, group_offsets, _k_major=k_major):
            _check_cpu(a, b, group_offsets)
            return m_grouped_gemm_reference(a, b, group_offsets, _k_major)

        def fake(a, b, group_offsets, _k_major=k_major):
            return a.new_empty(a.shape[0], b.shape[1] if _k_major else b.shape[2])

        torch.library.register_kernel(lib + name, "cpu", cpu)
        torch.library.register_fake(lib + name, fake)

    def gather_rows(a, a_row_index, m_total):
        idx = a_row_index[:m_total].long()
        ok = (idx >= 0) & (idx < a.shape[0])
        rows = a[idx.clamp(0, max(a.shape[0] - 1, 0))] if a.shape[0] else a.new_zeros(m_total, a.shape[1])
        return torch.where(ok[:, None], rows, torch.zeros((), dtype=a.dtype))

    def gather_cpu(a, b, group_offsets, a_row_index, m_total):
        _check_cpu(a, b, group_offsets)
        return m_grouped_gemm_reference(gather_rows(a, a_row_index, m_total), b, group_offsets, True)

    def gather_fake(a, b, group_offsets, a_row_index, m_total):
        return a.new_empty(m_total, b.shape[1])

    def swiglu_cpu(a, w13, group_offsets, a_row_index, m_total, save_h, clamp=0.0):
        _check_cpu(a, w13, group_offsets)
        rows = gather_rows(a, a_row_index, m_total) if a_row_index is not None else a[:m_total]
        h = m_grouped_gemm_reference(rows, w13, group_offsets, True, torch.float32, round_output=False)
        I = w13.shape[1] // 2
        hb = h.to(a.dtype)  # SwiGLU on h rounded as it is saved (reference F3)
        g, u = hb[:, :I].float(), hb[:, I:].float()
        if clamp > 0:
            g, u = torch.clamp(g, max=clamp), torch.clamp(u, min=-clamp, max=clamp)
        s = (torch.nn.functional.silu(g) * u).to(a.dtype)
        return s, (hb if save_h else a.new_empty(0, 2 * I))

    def swiglu_fake(a, w13, group_offsets, a_row_index, m_total, save_h, clamp=0.0):
        I = w13.shape[1] // 2
        return a.new_empty(m_total, I), a.new_empty(m_total if save_h else 0, 2 * I)

    def swiglu_bwd_cpu(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, clamp=0.0):
        # the pool-row kernel's reference on the unrounded da, plus the per-128-column d weight partials
        _check_cpu(dy_pool, w2, group_offsets)
        M, I = dy_pool.shape[0], w2.shape[2]
        nb = (I + 127) // 128
        da = m_grouped_gemm_reference(dy_pool, w2, group_offsets, False, torch.float32, round_output=False)
        ref_clamp = clamp if clamp > 0 else -1.0  # the pool-row kernel's convention: < 0 = none
        dh, aw, _ = swiglu_bwd_reference(h[:M], da, pool_src_route, topk_weights, torch.tensor([M]), ref_clamp)
        _, _, gc, uc = swiglu_parts(h[:M], ref_clamp)
        prod = torch.nn.functional.pad(da * F.silu(gc) * uc, (0, nb * 128 - I)).view(M, nb, 128).sum(-1)
        dt_part = torch.where(pool_src_route[:M, None] >= 0, prod, torch.zeros(()))
        return dh, aw, dt_part

    def swiglu_bwd_fake(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, clamp=0.0):
        M, I = dy_pool.shape[0], w2.shape[2]
        return (dy_pool.new_empty(M, 2 * I), dy_pool.new_empty(M, I),
                dy_pool.new_empty(M, (I + 127) // 128, dtype=torch.float32))

    def swiglu_bwd_gather_cpu(dy, a_row_index, m_total, w2, group_offsets, h, pool_src_route, topk_weights,
                              clamp=0.0):
        dy_pool = gather_rows(dy, a_row_index, m_total)
        return (*swiglu_bwd_cpu(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, clamp), dy_pool)

    def swiglu_bwd_gather_fake(dy, a_row_index, m_total, w2, group_offsets, h, pool_src_route, topk_weights,
                               clamp=0.0):
        I = w2.shape[2]
        return (dy.new_empty(m_total, 2 * I), dy.new_empty(m_total, I),
                dy.new_empty(m_total, (I + 127) // 128, dtype=torch.float32), dy.new_empty(m_total, dy.shape[1]))

    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_swiglu_bwd", "cpu", swiglu_bwd_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_swiglu_bwd", swiglu_bwd_fake)
    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_swiglu_bwd_gather", "cpu", swiglu_bwd_gather_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_swiglu_bwd_gather", swiglu_bwd_gather_fake)
    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_swiglu", "cpu", swiglu_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_swiglu", swiglu_fake)
    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_nt_gather", "cpu", gather_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_nt_gather", gather_fake)

    def k_cpu(a, b, group_offsets, out_fp32=True):
        _check_cpu(a, b, group_offsets)
        out = k_grouped_gemm_reference(a, b, group_offsets)
        return out if out_fp32 else out.to(torch.bfloat16)

    def k_fake(a, b, group_offsets, out_fp32=True):
        return a.new_empty(group_offsets.shape[0] - 1, a.shape[1], b.shape[1],
                           dtype=torch.float32 if out_fp32 else torch.bfloat16)

    def k_acc_cpu(a, b, group_offsets, c):
        _check_cpu(a, b, group_offsets)
        c.add_(k_grouped_gemm_reference(a, b, group_offsets))

    def k_acc_fake(a, b, group_offsets, c):
        return None

    torch.library.register_kernel(lib + "k_grouped_bf16_gemm_tn", "cpu", k_cpu)
    torch.library.register_fake(lib + "k_grouped_bf16_gemm_tn", k_fake)
    torch.library.register_kernel(lib + "k_grouped_bf16_gemm_tn_accumulate_", "cpu", k_acc_cpu)
    torch.library.register_fake(lib + "k_grouped_bf16_gemm_tn_accumulate_", k_acc_fake)
