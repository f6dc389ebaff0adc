"""m-grouped BF16 GEMMs whose last groups read a second weight tensor: shared experts as extra groups of the routed
experts' launch (sm90 kernels on CUDA; on the CPU the same ops on the weights with the second tensor's chunks laid
out as experts of their own).

A SwiGLU expert of intermediate size m * I is m experts of intermediate size I with weight 1 each (SwiGLU is
separable over its intermediate units: y = sum_j W2[:, j] silu(g_j) u_j). So S shared experts of width Is = m * I
join E routed experts of width I as S * m extra groups: group E + v is chunk j = v % m of shared expert v // m, and
its weights are read in place from the shared tensors (no copy), chunk by chunk:

- ``m_grouped_bf16_gemm_swiglu_second_b(a, w13 [E, 2I, K], w13_2 [S, 2 m I, K], offs, chunks=m)``: the L1 with the
  SwiGLU epilogue; chunk j's gate rows are w13_2[s, j I : (j + 1) I], its up rows w13_2[s, m I + j I : ...];
- ``m_grouped_bf16_gemm_nt_second_b(a [M, I], w2 [E, H, I], w2_2 [S, H, m I], offs, chunks=m)``: the L2; chunk j
  reads columns [j I, (j + 1) I) of w2_2[s];
- ``m_grouped_bf16_gemm_nn_second_b(a [M, 2I], w13 [E, 2I, H], w13_2 [S, 2 m I, H], offs, chunks=m)``: the L1
  dgrad (dh @ w13); chunk j reads the gate and up rows of the L1's chunk j.
- ``m_grouped_bf16_gemm_swiglu_bwd_into(dy_pool, w2, offs, h, pool_src_route, topk_weights, (dh, aw, dt_part))``:
  the L2 dgrad with the SwiGLU backward written into given outputs on the rows of its groups only, so that the
  routed groups (w2) and the shared chunks (their w2 chunks as experts, a copy of the shared weight only) run as two
  launches into one set of outputs. (A second B in that kernel changed its instructions for the routed experts
  too, which would have put the verified BF16 backward's L2 dgrad back to unverified.)

``offs`` has E + S * m groups. The kernels are built for block_n 256 / 3 stages only; A is pooled (not gathered)
except for the SwiGLU L1. Status entry ``m_grouped_gemm_second_b.bf16.sm90``.
"""

from __future__ import annotations

import torch

from . import _lib, _status
from .grouped_gemm import _sms

__all__ = ["expand_chunks", "collapse_chunks", "m_grouped_bf16_gemm_swiglu_second_b",
           "m_grouped_bf16_gemm_nt_second_b", "m_grouped_bf16_gemm_nn_second_b", "m_grouped_bf16_gemm_swiglu_bwd_into"]

STATUS_KEY_STEM = "m_grouped_gemm_second_b.bf16"


def expand_chunks(b2: torch.Tensor, chunks: int, layout: str) -> torch.Tensor:
    """The second tensor's chunks as experts of their own, in the first tensor's layout: ``layout`` "w13"
    ([S, 2 m I, X] -> [S m, 2I, X], gate rows then up rows of each chunk; a copy) or "w2" ([S, H, m I] -> [S m, H, I];
    a view of b2 where the strides allow it, as with one shared expert, else a copy)."""
    chunks = _chunks(chunks)
    S = b2.shape[0]
    if layout == "w13":
        if b2.shape[1] % (2 * chunks):
            raise ValueError(f"w13_2's rows ({b2.shape[1]}) are not 2 * chunks ({chunks}) chunks")
        inter = b2.shape[1] // (2 * chunks)
        g, u = b2[:, : chunks * inter], b2[:, chunks * inter:]
        g = g.reshape(S, chunks, inter, -1)
        u = u.reshape(S, chunks, inter, -1)
        return torch.cat([g, u], dim=2).reshape(S * chunks, 2 * inter, b2.shape[2])
    if layout == "w2":
        if b2.shape[2] % chunks:
            raise ValueError(f"w2_2's columns ({b2.shape[2]}) are not {chunks} chunks")
        inter = b2.shape[2] // chunks
        return b2.reshape(S, b2.shape[1], chunks, inter).permute(0, 2, 1, 3).reshape(S * chunks, b2.shape[1], inter)
    raise ValueError(f"layout must be 'w13' or 'w2', got {layout!r}")


def collapse_chunks(d: torch.Tensor, chunks: int, layout: str) -> torch.Tensor:
    """The inverse of :func:`expand_chunks`: per-chunk tensors [S m, 2I, X] ("w13") or [S m, H, I] ("w2") back in the
    second tensor's layout [S, 2 m I, X] or [S, H, m I]."""
    chunks = _chunks(chunks)
    S = d.shape[0] // chunks
    if layout == "w13":
        inter = d.shape[1] // 2
        v = d.reshape(S, chunks, 2, inter, d.shape[2])
        return v.permute(0, 2, 1, 3, 4).reshape(S, 2 * chunks * inter, d.shape[2])
    if layout == "w2":
        return d.reshape(S, chunks, d.shape[1], d.shape[2]).permute(0, 2, 1, 3).reshape(S, d.shape[1],
                                                                                        chunks * d.shape[2])
    raise ValueError(f"layout must be 'w13' or 'w2', got {layout!r}")


def _ready(device: torch.device) -> None:
    if device.type == "cuda":
        _status.require_on(device, STATUS_KEY_STEM, "m_grouped_bf16_gemm_second_b")
    elif not _lib.load().shim_loaded:
        raise RuntimeError(f"prime_kernels: the second-B GEMMs are not available: {_lib.load().reason}")


def _chunks(chunks) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    return chunks


def m_grouped_bf16_gemm_swiglu_second_b(a: torch.Tensor, w13: torch.Tensor, w13_2: torch.Tensor,
                                        group_offsets: torch.Tensor, *, chunks: int = 1,
                                        a_row_index: torch.Tensor | None = None, m_total: int | None = None,
                                        save_h: bool = False, clamp: float | None = None,
                                        num_sms: int | None = None):
    """:func:`prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu` with groups E.. reading w13_2's chunks."""
    chunks = _chunks(chunks)
    _ready(a.device)
    if m_total is None:
        m_total = a_row_index.shape[0] if a_row_index is not None else a.shape[0]
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 (or None), got {clamp}")
    return torch.ops.prime_kernels.m_grouped_bf16_gemm_swiglu_second_b(
        a, w13, w13_2, group_offsets, a_row_index, m_total, save_h, chunks, 0.0 if clamp is None else float(clamp),
        _sms(num_sms))


def _gemm(a, b, b2, group_offsets, b_k_major: bool, chunks, num_sms) -> torch.Tensor:
    chunks = _chunks(chunks)
    _ready(a.device)
    return torch.ops.prime_kernels.m_grouped_bf16_gemm_second_b(a, b, b2, group_offsets, b_k_major, chunks,
                                                                _sms(num_sms))


def m_grouped_bf16_gemm_nt_second_b(a: torch.Tensor, w2: torch.Tensor, w2_2: torch.Tensor,
                                    group_offsets: torch.Tensor, *, chunks: int = 1,
                                    num_sms: int | None = None) -> torch.Tensor:
    """The L2 (a [M, I] @ w2[g]^T) with groups E.. reading columns [j I, (j + 1) I) of w2_2's experts."""
    return _gemm(a, w2, w2_2, group_offsets, True, chunks, num_sms)


def m_grouped_bf16_gemm_nn_second_b(a: torch.Tensor, w13: torch.Tensor, w13_2: torch.Tensor,
                                    group_offsets: torch.Tensor, *, chunks: int = 1,
                                    num_sms: int | None = None) -> torch.Tensor:
    """The L1 dgrad (a [M, 2I] @ w13[g]) with groups E.. reading the gate and up rows of w13_2's chunks."""
    return _gemm(a, w13, w13_2, group_offsets, False, chunks, num_sms)


def m_grouped_bf16_gemm_swiglu_bwd_into(dy_pool: torch.Tensor, w2: torch.Tensor, group_offsets: torch.Tensor,
                                        h: torch.Tensor, pool_src_route: torch.Tensor, topk_weights: torch.Tensor,
                                        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
                                        clamp: float | None = None, num_sms: int | None = None) -> None:
    """:func:`prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd` into ``out`` = (dh [M, 2I], aw [M, I] bf16,
    dt_part [M, ceil(I / 128)] fp32, the latter zeroed by the caller for rows no launch writes). ``w2`` may be any
    strided view, such as :func:`expand_chunks`' of one shared expert (the kernel reads a contiguous copy of it)."""
    _ready(dy_pool.device)
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be > 0 (or None), got {clamp}")
    torch.ops.prime_kernels.m_grouped_bf16_gemm_swiglu_bwd_into_(
        dy_pool, w2.contiguous(), group_offsets, h, pool_src_route, topk_weights.reshape(-1), *out,
        0.0 if clamp is None else float(clamp), _sms(num_sms))


def _register() -> None:
    """CPU kernels (the first ops on the weights with the chunks as experts) and fake kernels."""
    lib = "prime_kernels::"
    ops = torch.ops.prime_kernels

    def gemm_cpu(a, b, b2, group_offsets, b_k_major, chunks, num_sms=0):
        if b_k_major:
            both = torch.cat([b, expand_chunks(b2, chunks, "w2")])
            return ops.m_grouped_bf16_gemm_nt(a, both, group_offsets, num_sms)
        both = torch.cat([b, expand_chunks(b2, chunks, "w13")])
        return ops.m_grouped_bf16_gemm_nn(a, both, group_offsets, num_sms)

    def gemm_fake(a, b, b2, group_offsets, b_k_major, chunks, num_sms=0):
        return a.new_empty(a.shape[0], b.shape[1] if b_k_major else b.shape[2])

    def swiglu_cpu(a, w13, w13_2, group_offsets, a_row_index, m_total, save_h, chunks, clamp=0.0, num_sms=0):
        both = torch.cat([w13, expand_chunks(w13_2, chunks, "w13")])
        return ops.m_grouped_bf16_gemm_swiglu(a, both, group_offsets, a_row_index, m_total, save_h, clamp, num_sms)

    def swiglu_fake(a, w13, w13_2, group_offsets, a_row_index, m_total, save_h, chunks, clamp=0.0, num_sms=0):
        inter = w13.shape[1] // 2
        return a.new_empty(m_total, inter), a.new_empty(m_total if save_h else 0, 2 * inter)

    def swiglu_bwd_into_cpu(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, dh, aw, dt_part, clamp=0.0,
                            num_sms=0):
        got = ops.m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, clamp,
                                                 num_sms)
        rows = slice(int(group_offsets[0]), int(group_offsets[-1]))  # the rows of this launch's groups
        for dst, src in zip((dh, aw, dt_part), got):
            dst[rows] = src[rows]

    def swiglu_bwd_into_fake(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, dh, aw, dt_part, clamp=0.0,
                             num_sms=0):
        return None

    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_swiglu_bwd_into_", "cpu", swiglu_bwd_into_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_swiglu_bwd_into_", swiglu_bwd_into_fake)
    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_second_b", "cpu", gemm_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_second_b", gemm_fake)
    torch.library.register_kernel(lib + "m_grouped_bf16_gemm_swiglu_second_b", "cpu", swiglu_cpu)
    torch.library.register_fake(lib + "m_grouped_bf16_gemm_swiglu_second_b", swiglu_fake)
