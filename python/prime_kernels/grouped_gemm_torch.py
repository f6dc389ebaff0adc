"""The grouped pipeline's bf16 GEMMs on torch's grouped GEMM (``torch._grouped_mm``), for GPUs our sm90 kernels do
not run on (torch ships grouped-GEMM kernels for sm_100 too), with our arch-neutral SwiGLU kernels between them.

Each function takes what its namesake in :mod:`prime_kernels.grouped_gemm` takes (group_offsets [E + 1] int32 from
0; torch's ``offs`` are their ends) and returns what it returns. Where the rounding points of
:mod:`prime_kernels.mega.reference` cannot be kept, because torch's grouped GEMM returns its operands' dtype:

* B2: da = dy_pool @ w2_g is rounded to bf16 before the SwiGLU backward (ours keeps it in fp32 registers);
* B10: each expert's weight gradient is rounded to bf16 before it is added into fp32 accumulators;
* F6 with a clamp needs the fp32 h to keep the clamp masks: ``clamp`` is refused (plain rounding lost 3-5% of dX
  and dW13 at c = 0.75, reference.py).

Rows outside every group are left as torch's GEMM leaves them; the pipeline reads none of them.

Selection (:func:`selected`, asked by every bf16 GEMM of :mod:`prime_kernels.grouped_gemm`): these run on a CUDA
device whose compute capability major is not 9 (sm_100, sm_103 and later: our sm90 GEMM kernels cannot run there),
and on any device within :func:`forced` (how the tests check them on a GPU that has our kernels); our kernels run
everywhere else. Nothing here has run on Blackwell hardware: verified on Hopper with them forced.
"""

from __future__ import annotations

import contextlib

import torch

from .swiglu import swiglu_bwd, swiglu_fwd

__all__ = ["forced", "is_forced", "selected", "m_grouped_bf16_gemm_nt", "m_grouped_bf16_gemm_nn",
           "m_grouped_bf16_gemm_swiglu", "m_grouped_bf16_gemm_swiglu_bwd", "k_grouped_bf16_gemm_tn"]

_forced = False


@contextlib.contextmanager
def forced():
    """Within this block (in every thread: a loopback group's ranks too), :mod:`prime_kernels.grouped_gemm`'s bf16
    GEMMs run on torch's grouped GEMM: how the tests check this path on a GPU that has our kernels."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


def is_forced() -> bool:
    return _forced


# CUDA device index -> whether its GEMMs are torch's (a device's compute capability cannot change, and every GEMM of
# the pipeline asks)
_selected_by_device: dict[int, bool] = {}


def selected(device: torch.device) -> bool:
    """Whether :mod:`prime_kernels.grouped_gemm`'s bf16 GEMMs on ``device`` run here: within :func:`forced`, or on a
    CUDA device whose compute capability major is not 9 (our GEMM kernels are sm_90a only). CPU tensors run our
    kernels' CPU references unless forced."""
    if _forced:
        return True
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    answer = _selected_by_device.get(index)
    if answer is None:
        answer = torch.cuda.get_device_capability(index)[0] != 9
        _selected_by_device[index] = answer
    return answer


def _ends(group_offsets: torch.Tensor) -> torch.Tensor:
    return group_offsets[1:].contiguous()


def _no_clamp(clamp, op: str) -> None:
    if clamp is not None:
        raise ValueError(f"prime_kernels.{op} on torch's grouped GEMM takes no clamp: keeping the clamp masks of the "
                         "fp32 pre-activation (reference F6) needs an fp32 output torch's grouped GEMM does not give")


def _gathered(a: torch.Tensor, a_row_index: torch.Tensor, m_total: int) -> torch.Tensor:
    """Row r: a[a_row_index[r]], a zero row for -1."""
    idx = a_row_index[:m_total].long()
    rows = a.index_select(0, idx.clamp(min=0)) if a.shape[0] else a.new_zeros((m_total, a.shape[1]))
    return rows.masked_fill_((idx < 0)[:, None], 0)


def m_grouped_bf16_gemm_nt(a, b, group_offsets, *, a_row_index=None, m_total=None, num_sms=None):
    """a [M, K] (or its rows by ``a_row_index``) @ b[g]^T, b [E, N, K]."""
    if a_row_index is not None:
        a = _gathered(a, a_row_index, a_row_index.shape[0] if m_total is None else m_total)
    return torch._grouped_mm(a, b.transpose(1, 2), offs=_ends(group_offsets))


def m_grouped_bf16_gemm_nn(a, b, group_offsets, *, num_sms=None):
    """a [M, K] @ b[g], b [E, K, N]."""
    return torch._grouped_mm(a, b, offs=_ends(group_offsets))


def m_grouped_bf16_gemm_swiglu(a, w13, group_offsets, *, a_row_index=None, m_total=None, save_h=False, clamp=None,
                               num_sms=None):
    """(s, h or [0, 2I]): h = the L1 in bf16, then s from it by the SwiGLU kernel (F3 on the rounded h)."""
    _no_clamp(clamp, "m_grouped_bf16_gemm_swiglu")
    if m_total is None:
        m_total = a_row_index.shape[0] if a_row_index is not None else a.shape[0]
    rows = _gathered(a, a_row_index, m_total) if a_row_index is not None else a[:m_total]
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=_ends(group_offsets))
    s = swiglu_fwd(h, group_offsets[-1:], None)
    return s, (h if save_h else h.new_empty((0, h.shape[1])))


def m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, group_offsets, h, pool_src_route, topk_weights, *, clamp=None,
                                   num_sms=None):
    """(dh, w * s, dt_part [M, 1]): da = dy_pool @ w2_g in bf16, then the SwiGLU backward kernel on it."""
    _no_clamp(clamp, "m_grouped_bf16_gemm_swiglu_bwd")
    M = dy_pool.shape[0]
    da = torch._grouped_mm(dy_pool, w2, offs=_ends(group_offsets))
    dh, aw, dt = swiglu_bwd(h[:M], da, pool_src_route[:M], topk_weights.reshape(-1), group_offsets[-1:], None)
    return dh, aw, dt.view(M, 1)


def k_grouped_bf16_gemm_tn(a, b, group_offsets, *, out_dtype=torch.float32, accumulate_into=None, num_sms=None):
    """C_g = a_g^T @ b_g over each group's rows, in bf16; added into ``accumulate_into`` (fp32) when given."""
    c = torch._grouped_mm(a.t(), b, offs=_ends(group_offsets))
    if accumulate_into is not None:
        accumulate_into.add_(c)
        return accumulate_into
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    return c if out_dtype == torch.bfloat16 else c.float()
