"""The FP8 L1 GEMM with the SwiGLU forward and the quantization of s in its epilogue (precision "fp8", docs/fp8.md).

``m_grouped_fp8_gemm_swiglu(x_q, x_sa, w13_q, w13_sb, group_offsets)`` computes, for the rows of each group (expert)
g, ``h = G(qK(x_p), W13[g])`` in fp32 (the FP8 m-grouped GEMM's numbers: e4m3 products, promotion into fp32 every
128 of H; reference F1), ``s = silu(gate) * up`` on that fp32 h (F3; with ``clamp`` c, gate <= c and -c <= up <= c
first: F2), and returns (:class:`Fp8SwigluFwd`):

- ``s_q`` e4m3 [M, I], ``s_sa`` fp32 [M, I/64] K-block major: qK(s, 64) along I (the recipe with
  ``l2_act_block=64``), the A operand of the L2 GEMM, which promotes every 64 of K;
- ``h`` bf16 [M, 2I] (gate | up): the fp32 h rounded to nearest even (F6: with a clamp, a value never rounds onto
  or across a bound, so the backward's clamp masks on h are the forward's), for the backward; only with
  ``save_h=True``.

x_q / x_sa come from :func:`prime_kernels.dispatch_rows_fp8` (padding rows quantize to zeros, so their s and h are
zeros); w13_q / w13_sb are the weight cache's copy of w13 ([E, 2I, H] gate rows then up rows, 128 x 128 block scales
[E, 2I/128, ceil(H/128)], the grid along 2I: with I = 64 mod 128 one block holds the last 64 gate and the first 64 up
rows). H and I must be multiples of 64 (H = 64 mod 128: the last k-block is 64 wide). Rows outside every group are
not written.

On CUDA (sm90a) one kernel does all of it (verified on an H200 against the emulation, tests/test_swiglu_fwd_fp8.py;
with a clamp, its own instantiation, which needs ``allow_unverified=True`` until it has run on a GPU: status entry
``m_grouped_gemm_swiglu_clamp.fp8.sm90``);
the FP8 forward pipeline (:mod:`prime_kernels.mega._fp8_fwd`) calls it, then m_grouped_fp8_gemm_nt with sa [M, I/64]
for the L2. On the CPU the op runs :func:`swiglu_fwd_fp8_reference`, the emulation the GPU
tests compare the kernel with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _status
from .grouped_gemm import check_offsets_cpu, k_block_major_empty
from .mega import fp8 as _fp8
from .mega import reference

__all__ = ["Fp8SwigluFwd", "m_grouped_fp8_gemm_swiglu", "swiglu_fwd_fp8_reference", "allocate_outputs"]

E4M3 = torch.float8_e4m3fn
BLOCK = 128
S_BLOCK = 64  # the 1 x 64 blocks of s: one L1 tile's 64 columns of I (64 gate + 64 up accumulators)
KEY_STEM = "m_grouped_gemm_swiglu.fp8"
CLAMP_KEY_STEM = "m_grouped_gemm_swiglu_clamp.fp8"


class Fp8SwigluFwd(NamedTuple):
    s_q: torch.Tensor
    s_sa: torch.Tensor
    h: torch.Tensor  # [M, 2I] bf16, or empty when not saved


def allocate_outputs(m: int, inter: int, device, save_h: bool = True) -> Fp8SwigluFwd:
    """Uninitialised outputs for M pool rows and I columns (h empty unless ``save_h``)."""
    h = torch.empty((m, 2 * inter) if save_h else (0,), dtype=torch.bfloat16, device=device)
    return Fp8SwigluFwd(torch.empty(m, inter, dtype=E4M3, device=device),
                        k_block_major_empty(m, inter // S_BLOCK, device), h)


def _check(x_q, x_sa, w13_q, w13_sb, group_offsets, out) -> None:
    """The op's argument rule, before anything runs (the CUDA op's shim and core check the same and the layouts)."""
    op = "prime_kernels.m_grouped_fp8_gemm_swiglu"
    if x_q.dtype != E4M3 or w13_q.dtype != E4M3 or x_q.dim() != 2 or w13_q.dim() != 3:
        raise TypeError(f"{op}: x_q [M, H] and w13_q [E, 2I, H] must be float8_e4m3fn")
    m, hidden = x_q.shape
    experts, two_i, hk = w13_q.shape
    inter = two_i // 2
    if hk != hidden:
        raise ValueError(f"{op}: w13_q's H ({hk}) does not match x_q's ({hidden})")
    if hidden % 64 or inter % 64 or hidden == 0 or inter == 0 or two_i % 2:
        raise ValueError(f"{op}: H ({hidden}) and I ({two_i} / 2) must be positive multiples of 64")
    hb = -(-hidden // BLOCK)
    if x_sa.dtype != torch.float32 or tuple(x_sa.shape) != (m, hb):
        raise ValueError(f"{op}: x_sa must be float32 [M, ceil(H/128)] = [{m}, {hb}]")
    if w13_sb.dtype != torch.float32 or tuple(w13_sb.shape) != (experts, two_i // BLOCK, hb):
        raise ValueError(f"{op}: w13_sb must be float32 [E, 2I/128, ceil(H/128)] = [{experts}, {two_i // BLOCK}, "
                         f"{hb}]")
    if group_offsets.dtype != torch.int32 or tuple(group_offsets.shape) != (experts + 1,):
        raise ValueError(f"{op}: group_offsets must be int32 [E + 1] = [{experts + 1}]")
    tensors = [x_q, x_sa, w13_q, w13_sb, group_offsets, *out]
    if any(t.device != x_q.device for t in tensors):
        raise ValueError(f"{op}: every tensor must be on x_q's device ({x_q.device})")
    for name, t, dtype, shape in (("s_q", out.s_q, E4M3, (m, inter)),
                                  ("s_sa", out.s_sa, torch.float32, (m, inter // S_BLOCK))):
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{op}: out.{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if out.h.numel() and (out.h.dtype != torch.bfloat16 or tuple(out.h.shape) != (m, 2 * inter)):
        raise ValueError(f"{op}: out.h must be empty or bfloat16 [{m}, {2 * inter}], got {out.h.dtype} "
                         f"{list(out.h.shape)}")
    if group_offsets.device.type == "cpu":
        check_offsets_cpu(group_offsets, m)


def m_grouped_fp8_gemm_swiglu(x_q: torch.Tensor, x_sa: torch.Tensor, w13_q: torch.Tensor, w13_sb: torch.Tensor,
                              group_offsets: torch.Tensor, *, pow2_scales: bool = False, save_h: bool = True,
                              num_sms: int | None = None, out: Fp8SwigluFwd | None = None,
                              clamp: float | None = None, allow_unverified: bool = False) -> Fp8SwigluFwd:
    """See the module docstring; ``out`` (an :class:`Fp8SwigluFwd` in those layouts) to write into, else allocated
    by :func:`allocate_outputs` (with ``save_h``); ``clamp`` None or a finite c > 0."""
    if clamp is not None and not (0.0 < float(clamp) < float("inf")):
        raise ValueError(f"prime_kernels.m_grouped_fp8_gemm_swiglu: clamp must be None or finite and > 0, got {clamp}")
    _status.require_on(x_q.device, KEY_STEM if clamp is None else CLAMP_KEY_STEM, "m_grouped_fp8_gemm_swiglu",
                       allow_unverified=allow_unverified)
    sms = 0 if num_sms is None else int(num_sms)
    if sms < 0:
        raise ValueError(f"num_sms must be None or >= 0, got {num_sms}")
    if x_sa.dim() == 2 and x_sa.dtype == torch.float32 and x_sa.shape[0] > 1 and x_sa.stride(0) != 1:
        buf = k_block_major_empty(*x_sa.shape, x_sa.device)
        buf.copy_(x_sa)
        x_sa = buf
    if out is None:
        inter = w13_q.shape[1] // 2 if w13_q.dim() == 3 else 0
        out = allocate_outputs(x_q.shape[0], inter, x_q.device, save_h)
    out = Fp8SwigluFwd(*out)
    _check(x_q, x_sa, w13_q, w13_sb, group_offsets, out)
    torch.ops.prime_kernels.m_grouped_fp8_gemm_swiglu_(x_q, x_sa, w13_q, w13_sb, group_offsets, *out,
                                                       bool(pow2_scales), sms, 0.0 if clamp is None else float(clamp))
    return out


def swiglu_fwd_fp8_reference(x_q, x_sa, w13_q, w13_sb, group_offsets, out, pow2_scales: bool = False,
                             clamp: float | None = None) -> None:
    """The emulation of the kernel from :mod:`prime_kernels.mega.fp8` (G1-G3, Q1-Q3) and the reference's fp32
    SwiGLU (F2, F3, F6), written into ``out`` for the rows of the groups (the rows a kernel writes)."""
    inter = w13_q.shape[1] // 2
    offs = group_offsets.tolist()
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if hi <= lo:
            continue
        rows = slice(lo, hi)
        a = _fp8.BlockQuantized(x_q[rows], x_sa[rows].contiguous(), 1, BLOCK)
        b = _fp8.BlockQuantized(w13_q[g], w13_sb[g].contiguous(), BLOCK, BLOCK)
        h = _fp8.fp8_gemm_nt(a, b)  # F1, fp32
        _, _, gc, uc = reference._swiglu_parts(h, clamp)  # F2 on the fp32 accumulators
        s = torch.nn.functional.silu(gc) * uc  # F3
        q = _fp8.quantize_along_k(s, S_BLOCK, pow2_scales)
        out.s_q[rows] = q.data
        out.s_sa[rows] = q.scale
        if out.h.numel():
            out.h[rows] = reference.round_h(h, clamp, torch.bfloat16)  # F6


def _register() -> None:
    lib = "prime_kernels::m_grouped_fp8_gemm_swiglu_"

    def cpu(x_q, x_sa, w13_q, w13_sb, group_offsets, s_q, s_sa, h, pow2_scales=False, num_sms=0, clamp_limit=0.0):
        out = Fp8SwigluFwd(s_q, s_sa, h)
        _check(x_q, x_sa, w13_q, w13_sb, group_offsets, out)
        swiglu_fwd_fp8_reference(x_q, x_sa, w13_q, w13_sb, group_offsets, out, pow2_scales,
                                 clamp_limit if clamp_limit > 0 else None)

    def fake(x_q, x_sa, w13_q, w13_sb, group_offsets, s_q, s_sa, h, pow2_scales=False, num_sms=0, clamp_limit=0.0):
        return None

    torch.library.register_kernel(lib, "cpu", cpu)
    torch.library.register_fake(lib, fake)
