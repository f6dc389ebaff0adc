"""The FP8 L2 dgrad with the SwiGLU backward and a quantizing epilogue (precision "fp8_bwd", docs/fp8.md).

``m_grouped_fp8_gemm_swiglu_bwd(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, topk_weights)``
computes, for the rows of each group (expert) g, ``da = G(qK(dy_p), W2^T[g])`` (the FP8 m-grouped GEMM's numbers:
e4m3 products, promotion into fp32 every 128 of H), the SwiGLU backward on fp32 with the saved bf16 h and the route
weight ``w = topk_weights.flatten()[pool_src_route[r]]``, rounds dh = [dg, du] and w * s to bf16 (the operands the
BF16 backward hands on) and returns them quantized as :mod:`prime_kernels.mega.fp8` quantizes (:class:`Fp8SwigluBwd`):

- ``dh_q`` e4m3 [M, 2I], ``dh_sa`` fp32 K-block major: qK(dh, 128) of dg and of du (``fp8.quantize_halves_along_k``),
  the A operand of :func:`prime_kernels.m_grouped_fp8_gemm_nt` for the L1 dgrad; [M, 2I/128], or with I = 64
  (mod 128) [M, 2I/64], a scale per 64 columns (:func:`dh_scale_block`);
- ``dht_q`` e4m3 [2I, M] (token axis contiguous), ``dht_s`` fp32 [2I, ceil(M/128)]: qT(dh_e), and ``awt_q`` [I, M],
  ``awt_s`` [I, ceil(M/128)]: qT((w * s)_e), the operands of :func:`prime_kernels.k_grouped_fp8_gemm_tn`;
- ``dt_part`` fp32 [M, ceil(I/128)]: the d topk_weights partials (``sum`` over 128 columns of ``da * s``), whose row
  sums are the d weights, as the BF16 kernel writes them.

dy_q / dy_sa come from :func:`prime_kernels.dispatch_rows_fp8`; w2t_q / w2t_sb are the weight cache's transposed
copy of w2 ([E, I, H], 128 x 128 block scales [E, ceil(I/128), ceil(H/128)]). H and I must be multiples of 64 (a size
of 64 mod 128 has a 64-wide last block) and every group offset a multiple of 128 or M (the routing plan's layout
with block_m = 128: each 128-row tile is one qT block).
Padding rows (route -1) are zeros in every output; rows outside every group are not written (dt_part: zeros).

On CUDA (sm90a) one kernel does all of it (verified on an H200 against the emulation, tests/test_swiglu_bwd_fp8.py).
On the CPU the op runs :func:`swiglu_bwd_fp8_reference`, the emulation the
GPU tests compare the kernel with.

``mega_moe_fp8_dgrad_fused(dy_q, dy_sa, w2t_q, w2t_sb, w13t_q, w13t_sb, group_offsets, h, pool_src_route,
topk_weights)`` returns the same :class:`Fp8SwigluBwd` and the L1 dgrad ``dx_pool = m_grouped_fp8_gemm_nt(dh_q,
dh_sa, w13t_q, w13t_sb, group_offsets)`` (bf16 [M, H]; rows outside every group unspecified), the FP8 backward's two
data-gradient launches as one persistent kernel on CUDA (sm90a; status entry ``mega_moe_backward.fp8.sm90``), whose
outputs are those two launches' bit for bit; I must be a multiple of 128 there. On the CPU it runs those two ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _status
from .grouped_gemm import check_offsets_cpu, k_block_major_empty, m_grouped_fp8_gemm_nt
from .mega import fp8 as _fp8

__all__ = ["Fp8SwigluBwd", "m_grouped_fp8_gemm_swiglu_bwd", "mega_moe_fp8_dgrad_fused", "swiglu_bwd_fp8_reference",
           "allocate_outputs"]

E4M3 = torch.float8_e4m3fn
BLOCK = 128
KEY_STEM = "m_grouped_gemm_swiglu_bwd.fp8"
# The fused FP8 dgrad kernel is sm90a only: one key, whatever the device (another device gets its reason)
FUSED_KEY = "mega_moe_backward.fp8.sm90"
# The task sequence's lag of the fused dgrad (csrc/sm90/mega_moe_heuristics.hpp, kMegaBwdMaxLagHost), -1: its heuristic
MAX_LAG = 64
# The most experts the fused dgrad takes (csrc/sm90/mega_moe_bwd_fp8.hpp, kMegaBwdFp8MaxExpertsHost)
FUSED_MAX_EXPERTS = 256


class Fp8SwigluBwd(NamedTuple):
    dh_q: torch.Tensor
    dh_sa: torch.Tensor
    dht_q: torch.Tensor
    dht_s: torch.Tensor
    awt_q: torch.Tensor
    awt_s: torch.Tensor
    dt_part: torch.Tensor


def _token_major_empty(cols: int, rows: int, device) -> torch.Tensor:
    """e4m3 [cols, rows], the row stride rounded up to 16 bytes (the k-grouped FP8 GEMM's operand layout)."""
    return torch.empty(cols, (rows + 15) // 16 * 16, dtype=E4M3, device=device)[:, :rows]


def dh_scale_block(inter: int) -> int:
    """The column width of one ``dh_sa`` entry: 128 (the 1 x 128 blocks along 2I), or 64 when I = 64 (mod 128), where
    dg's and du's last blocks are 64 wide and every block's scale sits in each of its 64-column slots (the L1 dgrad
    then promotes every 64 of 2I: W13^T's 128-column blocks start at column 0 of 2I, du's at column I)."""
    return BLOCK if inter % BLOCK == 0 else BLOCK // 2


def allocate_outputs(m: int, inter: int, device) -> Fp8SwigluBwd:
    """The outputs for M pool rows and I columns, uninitialised except dt_part (zeros: rows outside every group)."""
    tb = (m + BLOCK - 1) // BLOCK
    return Fp8SwigluBwd(
        torch.empty(m, 2 * inter, dtype=E4M3, device=device),
        k_block_major_empty(m, 2 * inter // dh_scale_block(inter), device),
        _token_major_empty(2 * inter, m, device), k_block_major_empty(2 * inter, tb, device),
        _token_major_empty(inter, m, device), k_block_major_empty(inter, tb, device),
        torch.zeros(m, -(-inter // BLOCK), dtype=torch.float32, device=device))


def _check(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights, out, clamp) -> None:
    """The op's argument rule, before anything runs (the CUDA op's shim and core check the same and the layouts)."""
    op = "prime_kernels.m_grouped_fp8_gemm_swiglu_bwd"
    if dy_q.dtype != E4M3 or w2t_q.dtype != E4M3 or dy_q.dim() != 2 or w2t_q.dim() != 3:
        raise TypeError(f"{op}: dy_q [M, H] and w2t_q [E, I, H] must be float8_e4m3fn")
    m, hidden = dy_q.shape
    experts, inter, hk = w2t_q.shape
    if hk != hidden:
        raise ValueError(f"{op}: w2t_q's H ({hk}) does not match dy_q's ({hidden})")
    if hidden % 64 or inter % 64 or hidden == 0 or inter == 0:
        raise ValueError(f"{op}: H ({hidden}) and I ({inter}) must be positive multiples of 64")
    hb, ib = -(-hidden // BLOCK), -(-inter // BLOCK)
    if dy_sa.dtype != torch.float32 or tuple(dy_sa.shape) != (m, hb):
        raise ValueError(f"{op}: dy_sa must be float32 [M, ceil(H/128)] = [{m}, {hb}]")
    if w2t_sb.dtype != torch.float32 or tuple(w2t_sb.shape) != (experts, ib, hb):
        raise ValueError(f"{op}: w2t_sb must be float32 [E, ceil(I/128), ceil(H/128)] = [{experts}, {ib}, {hb}]")
    if group_offsets.dtype != torch.int32 or tuple(group_offsets.shape) != (experts + 1,):
        raise ValueError(f"{op}: group_offsets must be int32 [E + 1] = [{experts + 1}]")
    if h.dtype != torch.bfloat16 or h.dim() != 2 or h.shape[0] < m or h.shape[1] != 2 * inter:
        raise ValueError(f"{op}: h must be bfloat16 [>= M, 2I] = [>= {m}, {2 * inter}]")
    if pool_src_route.dtype != torch.int32 or pool_src_route.numel() < m:
        raise ValueError(f"{op}: pool_src_route must be int32 with >= M = {m} entries")
    if route_weights.dtype != torch.float32:
        raise TypeError(f"{op}: topk_weights must be float32 (the weights stay fp32 in the recipe)")
    if not clamp >= 0:
        raise ValueError(f"{op}: clamp must be >= 0 (0 = no clamp), got {clamp}")
    tensors = [dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights, *out]
    if any(t.device != dy_q.device for t in tensors):
        raise ValueError(f"{op}: every tensor must be on dy_q's device ({dy_q.device})")
    want = allocate_outputs(0, inter, "meta")
    shapes = [(m, 2 * inter), (m, 2 * inter // dh_scale_block(inter)), (2 * inter, m),
              (2 * inter, (m + BLOCK - 1) // BLOCK), (inter, m), (inter, (m + BLOCK - 1) // BLOCK), (m, ib)]
    for name, t, w, shape in zip(Fp8SwigluBwd._fields, out, want, shapes):
        if t.dtype != w.dtype or tuple(t.shape) != shape:
            raise ValueError(f"{op}: out.{name} must be {w.dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if group_offsets.device.type == "cpu":
        check_offsets_cpu(group_offsets, m)
        offs = group_offsets.tolist()
        if any(o % BLOCK and o != m for o in offs):
            raise ValueError(f"{op}: every group offset must be a multiple of 128 or M = {m}, got {offs}")


def m_grouped_fp8_gemm_swiglu_bwd(dy_q: torch.Tensor, dy_sa: torch.Tensor, w2t_q: torch.Tensor, w2t_sb: torch.Tensor,
                                  group_offsets: torch.Tensor, h: torch.Tensor, pool_src_route: torch.Tensor,
                                  topk_weights: torch.Tensor, *, clamp: float | None = None, pow2_scales: bool = False,
                                  num_sms: int | None = None, out: Fp8SwigluBwd | None = None,
                                  allow_unverified: bool = False) -> Fp8SwigluBwd:
    """See the module docstring; ``out`` (an :class:`Fp8SwigluBwd` of tensors in those layouts) to write into,
    else allocated by :func:`allocate_outputs`. ``clamp``: the layer's activation_clamp (None or 0: none)."""
    _status.require_on(dy_q.device, KEY_STEM, "m_grouped_fp8_gemm_swiglu_bwd", allow_unverified=allow_unverified)
    dy_sa, weights, out, c, sms = _op_arguments(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route,
                                                topk_weights, clamp, num_sms, out)
    torch.ops.prime_kernels.m_grouped_fp8_gemm_swiglu_bwd_(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h,
                                                           pool_src_route, weights, *out, c, bool(pow2_scales), sms)
    return out


def _op_arguments(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, topk_weights, clamp, num_sms, out):
    """The L2 dgrad's arguments as its ops take them, checked (:func:`_check`): (dy_sa K-block major, the weights
    flattened, ``out`` or the outputs allocated, the clamp and num_sms as numbers)."""
    c = 0.0 if clamp is None else float(clamp)
    sms = 0 if num_sms is None else int(num_sms)
    if sms < 0:
        raise ValueError(f"num_sms must be None or >= 0, got {num_sms}")
    if dy_sa.dim() == 2 and dy_sa.dtype == torch.float32 and dy_sa.shape[0] > 1 and dy_sa.stride(0) != 1:
        buf = k_block_major_empty(*dy_sa.shape, dy_sa.device)
        buf.copy_(dy_sa)
        dy_sa = buf
    weights = topk_weights.reshape(-1)
    out = Fp8SwigluBwd(*(out if out is not None else allocate_outputs(dy_q.shape[0], w2t_q.shape[1] if w2t_q.dim() == 3
                                                                      else 0, dy_q.device)))
    _check(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, weights, out, c)
    return dy_sa, weights, out, c, sms


def _check_fused(dy_q, w2t_q, w13t_q, w13t_sb, num_sms, lag) -> None:
    """What the fused dgrad takes beyond the L2 dgrad's arguments, checked before anything runs: W13^T and its scales
    for the L1 dgrad, I a multiple of 128, the lag."""
    op = "prime_kernels.mega_moe_fp8_dgrad_fused"
    if w2t_q.dim() != 3 or dy_q.dim() != 2:
        raise ValueError(f"{op}: dy_q must be [M, H] and w2t_q [E, I, H]")
    experts, inter, hidden = w2t_q.shape
    if experts > FUSED_MAX_EXPERTS:
        raise ValueError(f"{op}: {experts} experts; the fused kernel takes at most {FUSED_MAX_EXPERTS} (its per-expert "
                         "tables in shared memory are sized for them)")
    if inter % BLOCK:
        raise ValueError(f"{op}: I ({inter}) must be a multiple of {BLOCK} (the fused kernel has no 64-wide last block "
                         "of I; m_grouped_fp8_gemm_swiglu_bwd and m_grouped_fp8_gemm_nt take I = 64 mod 128)")
    if w13t_q.dtype != E4M3 or tuple(w13t_q.shape) != (experts, hidden, 2 * inter):
        raise ValueError(f"{op}: w13t_q must be float8_e4m3fn [E, H, 2I] = [{experts}, {hidden}, {2 * inter}] (W13's "
                         f"transposed copy), got {w13t_q.dtype} {list(w13t_q.shape)}")
    want = (experts, -(-hidden // BLOCK), 2 * inter // BLOCK)
    if w13t_sb.dtype != torch.float32 or tuple(w13t_sb.shape) != want:
        raise ValueError(f"{op}: w13t_sb must be float32 [E, ceil(H/128), 2I/128] = {list(want)}, got "
                         f"{w13t_sb.dtype} {list(w13t_sb.shape)}")
    if w13t_q.device != dy_q.device or w13t_sb.device != dy_q.device:
        raise ValueError(f"{op}: w13t_q and w13t_sb must be on dy_q's device ({dy_q.device})")
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0):
        raise ValueError(f"{op}: num_sms must be None or an int >= 0 (0: every SM), got {num_sms!r}")
    if isinstance(lag, bool) or not isinstance(lag, int) or not -1 <= lag <= MAX_LAG:
        raise ValueError(f"{op}: lag must be -1 (the heuristic's) or an int in [0, {MAX_LAG}], got {lag!r}")


def mega_moe_fp8_dgrad_fused(dy_q: torch.Tensor, dy_sa: torch.Tensor, w2t_q: torch.Tensor, w2t_sb: torch.Tensor,
                             w13t_q: torch.Tensor, w13t_sb: torch.Tensor, group_offsets: torch.Tensor, h: torch.Tensor,
                             pool_src_route: torch.Tensor, topk_weights: torch.Tensor, *, clamp: float | None = None,
                             pow2_scales: bool = False, num_sms: int | None = 0, lag: int = -1,
                             out: Fp8SwigluBwd | None = None) -> tuple[Fp8SwigluBwd, torch.Tensor]:
    """(:func:`m_grouped_fp8_gemm_swiglu_bwd`'s :class:`Fp8SwigluBwd`, dx_pool bf16 [M, H]): the L2 dgrad and the
    L1 dgrad ``m_grouped_fp8_gemm_nt(dh_q, dh_sa, w13t_q, w13t_sb, group_offsets)`` (rows outside every group
    unspecified), the FP8 backward's two launches. The arguments are the L2 dgrad's (``out``: its outputs to write
    into, else allocated) and W13^T's FP8 copy: w13t_q float8_e4m3fn [E, H, 2I], w13t_sb float32
    [E, ceil(H/128), 2I/128] (the weight cache's transposed copy of w13). I must be a multiple of 128.

    On CUDA one persistent kernel (sm90a) computes both, with the same bits as the two launches: ``num_sms`` caps its
    grid (0 or None: every SM), ``lag`` sets how far its task sequence runs the L2-dgrad tiles ahead of the L1-dgrad
    tiles that wait for them (-1: the heuristic's; any lag gives the same bits). It runs wherever status entry
    ``mega_moe_backward.fp8.sm90`` could run (``_status.runnable``: an explicit op, so also before the kernel is
    verified on a GPU; a layer asks ``status()`` before it chooses it), else raises RuntimeError with the reason. On
    the CPU it runs the two ops (their CPU kernels), ``num_sms`` and ``lag`` unused."""
    _check_fused(dy_q, w2t_q, w13t_q, w13t_sb, num_sms, lag)
    if dy_q.device.type != "cuda":
        l2 = m_grouped_fp8_gemm_swiglu_bwd(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route,
                                           topk_weights, clamp=clamp, pow2_scales=pow2_scales, num_sms=num_sms,
                                           out=out)
        return l2, m_grouped_fp8_gemm_nt(l2.dh_q, l2.dh_sa, w13t_q, w13t_sb, group_offsets, num_sms=num_sms or None)
    _status.require(FUSED_KEY, allow_unverified=True)
    dy_sa, weights, out, c, sms = _op_arguments(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route,
                                                topk_weights, clamp, num_sms, out)
    dx_pool = torch.ops.prime_kernels.mega_moe_fp8_dgrad_fused(dy_q, dy_sa, w2t_q, w2t_sb, w13t_q, w13t_sb,
                                                               group_offsets, h, pool_src_route, weights, *out, c,
                                                               bool(pow2_scales), sms, lag)
    return out, dx_pool


def swiglu_bwd_fp8_reference(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights, out,
                             clamp: float = 0.0, pow2_scales: bool = False) -> None:
    """The emulation of the kernel from :mod:`prime_kernels.mega.fp8` (G1-G3, Q1-Q3) and the reference's fp32
    SwiGLU backward (B3-B5), dh and w * s rounded to bf16 (B6, B9), written into ``out`` for the rows of the groups (the
    rows a kernel writes)."""
    m, inter = dy_q.shape[0], w2t_q.shape[1]
    nb = -(-inter // BLOCK)
    offs = group_offsets.tolist()
    route = pool_src_route.reshape(-1)[:m].long()
    routed_all = (route >= 0) & (route < route_weights.numel())
    w_all = torch.where(routed_all, route_weights.reshape(-1)[route.clamp(0, max(route_weights.numel() - 1, 0))]
                        if route_weights.numel() else torch.zeros(m), torch.zeros(()))
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if hi <= lo:
            continue
        rows = slice(lo, hi)
        a = _fp8.BlockQuantized(dy_q[rows], dy_sa[rows].contiguous(), 1, BLOCK)
        b = _fp8.BlockQuantized(w2t_q[g], w2t_sb[g].contiguous(), BLOCK, BLOCK)
        da = _fp8.fp8_gemm_nt(a, b)  # B2, fp32
        hr = h[rows].float()
        gv, uv = hr[:, :inter], hr[:, inter:]
        gc, uc = gv, uv
        if clamp > 0:
            gc, uc = torch.clamp(gv, max=clamp), torch.clamp(uv, min=-clamp, max=clamp)
        sig = torch.sigmoid(gc)
        silu = gc * sig
        s = silu * uc
        routed = routed_all[rows, None]
        w = w_all[rows, None].float()
        ds = w * da  # B4
        dg = ds * uc * sig * (1 + gc * (1 - sig))
        du = ds * silu
        if clamp > 0:  # B5: the gradient passes strictly inside the bounds
            dg = torch.where(gv < clamp, dg, torch.zeros(()))
            du = torch.where((uv > -clamp) & (uv < clamp), du, torch.zeros(()))
        zero = torch.zeros(())
        # B6, B9: rounded to bf16 (the BF16 backward's operands), then quantized
        dh = torch.where(routed, torch.cat([dg, du], 1), zero).bfloat16().float()
        aw = torch.where(routed, w * s, zero).bfloat16().float()
        n = hi - lo
        part = torch.nn.functional.pad(da * s, (0, nb * BLOCK - inter)).view(n, nb, BLOCK).sum(-1)  # B3, per 128
        out.dt_part[rows] = torch.where(routed, part, zero)
        qk = _fp8.quantize_halves_along_k(dh, pow2_scales)
        out.dh_q[rows] = qk.data
        out.dh_sa[rows] = qk.scale
        b0 = lo // BLOCK
        for q_out, s_out, v in ((out.dht_q, out.dht_s, dh), (out.awt_q, out.awt_s, aw)):
            qt = _fp8.quantize_along_tokens(v, BLOCK, pow2_scales)
            q_out[:, rows] = qt.data.t()
            s_out[:, b0:b0 + qt.scale.shape[0]] = qt.scale.t()


def _register() -> None:
    lib = "prime_kernels::m_grouped_fp8_gemm_swiglu_bwd_"

    def cpu(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights, dh_q, dh_sa, dht_q, dht_s,
            awt_q, awt_s, dt_part, clamp=0.0, pow2_scales=False, num_sms=0):
        out = Fp8SwigluBwd(dh_q, dh_sa, dht_q, dht_s, awt_q, awt_s, dt_part)
        _check(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights, out, clamp)
        swiglu_bwd_fp8_reference(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights, out,
                                 clamp, pow2_scales)

    def fake(dy_q, dy_sa, w2t_q, w2t_sb, group_offsets, h, pool_src_route, route_weights, dh_q, dh_sa, dht_q, dht_s,
             awt_q, awt_s, dt_part, clamp=0.0, pow2_scales=False, num_sms=0):
        return None

    torch.library.register_kernel(lib, "cpu", cpu)
    torch.library.register_fake(lib, fake)

    def fused_fake(dy_q, dy_sa, w2t_q, w2t_sb, w13t_q, w13t_sb, group_offsets, h, pool_src_route, route_weights, dh_q,
                   dh_sa, dht_q, dht_s, awt_q, awt_s, dt_part, clamp=0.0, pow2_scales=False, num_sms=0, lag=-1):
        return dy_q.new_empty(dy_q.shape[0], dy_q.shape[1], dtype=torch.bfloat16)

    torch.library.register_fake("prime_kernels::mega_moe_fp8_dgrad_fused", fused_fake)
