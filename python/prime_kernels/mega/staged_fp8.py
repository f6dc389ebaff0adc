"""The DeepGEMM-shaped FP8 calls: prime-rl's FP8 Mega MoE call sequence on the FP8 pipelines' kernels, sm90.

The sequence, for one MoE layer (the caller's autograd function owns every tensor named here):

  once     ``buffer = FP8SymmBuffer(group, num_experts, max_tokens, top_k, hidden)``, shared by every layer;
           ``h, h_sf = FP8Pools.l2_operand(capacity, intermediate)``, the L2 operand pool, shared too;
           ``capacity = pool_capacity(max_tokens, top_k, num_local_experts)``.
  step     ``weights = fp8_weights_for_mega_moe(w13, w2)``: the eight tensors (w13, w13_sf, w2, w2_sf, and the
           transposed tiles of each) from the weight cache, made once per version of the weights.
  forward  stage ``buffer.x[:T]`` (e4m3, 1 x 128 blocks along H), ``buffer.x_sf[:T]`` (fp32 [T, H/128]),
           ``buffer.topk_idx[:T]`` (-1 = masked route), ``buffer.topk_weights[:T]`` (fp32); then
           ``pools = FP8Pools.allocate(capacity, hidden, intermediate, num_local_experts, h, h_sf)``,
           ``fp8_mega_moe(y, (w13, w13_sf), (w2, w2_sf), pools, buffer)``, and for the weight gradients
           ``column_quant(pools.x, pools.x_sf, pools.counts, x_t, x_t_sf)`` (on a side stream if the caller likes).
           Keep ``pools.z``, ``weights``, ``meta``, ``counts`` and ``x_t, x_t_sf`` for the backward.
  backward stage ``buffer.dy[:T]``; ``bufs = FP8BackwardBuffers(capacity, hidden, intermediate)``; ``pools`` may be
           ``FP8Pools(z=, weights=, meta=, counts=)`` rebuilt from what was kept;
           ``fp8_mega_moe_backward(grad_x, grad_topk_weights, (w13_t, w13_t_sf), (w2_t, w2_t_sf), pools, bufs,
           buffer)`` writes the data gradients; ``fp8_mega_moe_weight_grads(pools.counts, bufs, (x_t, x_t_sf),
           dw13_acc, dw2_acc, side_stream)`` adds the weight gradients into fp32 accumulators, now or (``defer=True``)
           when ``fp8_mega_moe_weight_grads_add`` flushes the held micro-batches.

Numerics: the recipe of :mod:`prime_kernels.mega.fp8` with x quantized by the caller (any fp32 1 x 128 scales; the
DeepEP dispatch format is power-of-two scales) and ``pow2_scales`` choosing the scales of what the kernels quantize
(s, dy, dh, w * s and the weight-gradient operands). The wgrad operand of x is qT of the dequantized pool rows
rounded to bf16, exact when x's scales are powers of two. The pools' rows are the routing plan's, each expert's rows
starting at a multiple of 128 (:func:`expert_offsets` rebuilds the offsets from the counts). Single rank. An
``activation_clamp`` given to the forward must be given to its backward too: the forward clamps gate and up on the
L1's fp32 accumulators and keeps z with the clamp masks (the reference's F2, F6), the backward applies the clamp's
gradient rule to z (B5). On the CPU every step runs the ops' CPU kernels (the emulation), so the sequence is testable there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _backend, _fp8_bwd, _validate, fp8 as _fp8
from ._grouped import _padding_row_index, _padding_span, _sms, _token_rows
from .buffer import SymmBuffer
from ..combine import combine, dispatch_rows
from ..grouped_gemm import k_block_major_empty, k_grouped_fp8_gemm_tn, m_grouped_fp8_gemm_nt
from ..quantize import quantize_tokens_fp8
from ..routing import pool_capacity as _plan_capacity, routing_plan
from ..swiglu_bwd_fp8 import Fp8SwigluBwd, _token_major_empty
from ..swiglu_fwd_fp8 import S_BLOCK, Fp8SwigluFwd, m_grouped_fp8_gemm_swiglu

E4M3 = _fp8.E4M3
BLOCK = _fp8.BLOCK
#: Micro-batches ``fp8_mega_moe_weight_grads(..., defer=True)`` holds at most: the call that would hold one more
#: flushes the held ones first, so deferral never keeps more than this many sets of operands alive.
MAX_DEFERRED = 4


def _fail(msg: str, exc=ValueError):
    _validate._fail(msg, exc)


def pool_capacity(num_max_tokens: int, num_topk: int, num_local_experts: int, capacity_factor=None) -> int:
    """Pool rows for up to ``num_max_tokens`` tokens: every route, plus each expert's padding to 128 rows (the
    routing plan's rule). No route is ever dropped, so ``capacity_factor`` (accepted for prime-rl's call) does not
    shrink the pools; it must be None or positive."""
    if capacity_factor is not None and not capacity_factor > 0:
        _fail(f"capacity_factor must be None or > 0, got {capacity_factor}")
    return _plan_capacity(int(num_max_tokens), int(num_topk), int(num_local_experts), BLOCK)


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """int32 [El + 1]: the pool offsets of the routing plan whose expert counts are ``counts`` (each expert's rows
    padded to a multiple of 128), computed on counts' device without a sync."""
    padded = (counts.to(torch.int64) + BLOCK - 1) // BLOCK * BLOCK
    return torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)]).to(torch.int32)


class FP8SymmBuffer(SymmBuffer):
    """The staging buffer of the FP8 calls: :class:`SymmBuffer` with ``mma_type="fp8xfp8"`` (views x e4m3 [Tmax, H],
    x_sf fp32 [Tmax, H/128], topk_idx, topk_weights, dy bf16). It does not depend on the intermediate size."""

    def __init__(self, group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int, *,
                 device=None):
        super().__init__(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, 1, mma_type="fp8xfp8",
                         device=device)
        self.intermediate_hidden = None


def _device(device, like: Optional[torch.Tensor] = None) -> torch.device:
    """``device`` (a CUDA device with its index), else like's device, else the current CUDA device or the CPU."""
    if device is not None:
        dev = torch.device(device)
        return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
    if like is not None:
        return like.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class FP8Pools:
    """One forward's pool rows, in the routing plan's order (``capacity`` rows; the padding rows inside an expert's
    128-row blocks are zeros in x, x_sf and z; rows past the last expert are unspecified there; every row no route
    names has weight 0 and meta -1):

    - ``x`` e4m3 [C, H] and ``x_sf`` fp32 [C, H/128] (K-block major, ``x_sf.stride(0) == 1``): the dispatched rows;
    - ``z`` bf16 [C, 2I]: L1's gate | up accumulators rounded once, the backward's saved activation;
    - ``weights`` fp32 [C]: each row's top-k weight; ``meta`` int32 [C, 3]: (source rank, token, k slot);
    - ``counts`` int32 [El]: rows per local expert;
    - ``h`` e4m3 [C, I] and ``h_sf`` fp32 [I/64, C]: qK(s, 64), the L2 operand, which every layer may share
      (:meth:`l2_operand`); ``h_sf`` is the storage of the [C, I/64] K-block-major scales.

    The forward needs pools made by :meth:`allocate` (x and x_sf are views of buffers with scratch rows past the
    pool, where the zeroing of the padding rows sends its spare index slots). The backward reads z, weights, meta and
    counts only: a caller that keeps just those (and x_t from :func:`column_quant`) may hand the backward
    ``FP8Pools(z=z, weights=weights, meta=meta, counts=counts)``, and x, x_sf and the L2 operand need not live until
    then."""

    x: Optional[torch.Tensor] = None
    x_sf: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    meta: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None
    h: Optional[torch.Tensor] = None
    h_sf: Optional[torch.Tensor] = None
    _x_rows: Optional[torch.Tensor] = None
    _x_sf_rows: Optional[torch.Tensor] = None

    @property
    def capacity(self) -> int:
        return (self.z if self.z is not None else self.x).shape[0]

    @staticmethod
    def l2_operand(capacity: int, intermediate: int, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h e4m3 [C, I], h_sf fp32 [I/64, C]): the L2 operand pool, to share between layers."""
        dev = _device(device)
        return (torch.empty(capacity, intermediate, dtype=E4M3, device=dev),
                torch.empty(intermediate // S_BLOCK, capacity, dtype=torch.float32, device=dev))

    @classmethod
    def allocate(cls, capacity: int, hidden: int, intermediate: int, num_local_experts: int,
                 h: Optional[torch.Tensor] = None, h_sf: Optional[torch.Tensor] = None, *, device=None) -> "FP8Pools":
        if h is None or h_sf is None:
            h, h_sf = cls.l2_operand(capacity, intermediate, device=_device(device, h))
        dev = h.device
        scratch = capacity // max(1, num_local_experts) + 1  # >= any plan's padding span (_padding_span)
        x_rows = torch.empty(capacity + scratch, hidden, dtype=E4M3, device=dev)
        x_sf_rows = k_block_major_empty(capacity + scratch, max(1, hidden // BLOCK), dev)
        return cls(x=x_rows[:capacity], x_sf=x_sf_rows[:capacity],
                   z=torch.empty(capacity, 2 * intermediate, dtype=torch.bfloat16, device=dev),
                   weights=torch.empty(capacity, dtype=torch.float32, device=dev),
                   meta=torch.empty(capacity, 3, dtype=torch.int32, device=dev),
                   counts=torch.empty(num_local_experts, dtype=torch.int32, device=dev),
                   h=h, h_sf=h_sf, _x_rows=x_rows, _x_sf_rows=x_sf_rows)


class FP8BackwardBuffers:
    """The weight-gradient operands one backward produces (qT per expert, 128 pool rows per scale, token axis
    contiguous): ``dy_t`` e4m3 [H, C] / ``dy_t_sf`` fp32 [H, C/128], ``a_t`` [I, C] / ``a_t_sf`` (qT of w * s), and
    ``dh_t`` [2I, C] / ``dh_t_sf`` (qT of dh). Allocate one per backward: a deferred weight-gradient call keeps
    using it."""

    def __init__(self, capacity: int, hidden: int, intermediate: int, *, device=None):
        dev = _device(device)
        tb = (capacity + BLOCK - 1) // BLOCK
        self.capacity, self.hidden, self.intermediate = int(capacity), int(hidden), int(intermediate)
        self.dy_t, self.dy_t_sf = _token_major_empty(hidden, capacity, dev), k_block_major_empty(hidden, tb, dev)
        self.dh_t = _token_major_empty(2 * intermediate, capacity, dev)
        self.dh_t_sf = k_block_major_empty(2 * intermediate, tb, dev)
        self.a_t = _token_major_empty(intermediate, capacity, dev)
        self.a_t_sf = k_block_major_empty(intermediate, tb, dev)

    def l2_out(self) -> Fp8SwigluBwd:
        """The L2 dgrad's outputs: qK(dh) and the d-topk partials fresh (dead after the backward), the qT operands
        these buffers keep."""
        C, I, dev = self.capacity, self.intermediate, self.dy_t.device
        return Fp8SwigluBwd(torch.empty(C, 2 * I, dtype=E4M3, device=dev), k_block_major_empty(C, 2 * I // BLOCK, dev),
                            self.dh_t, self.dh_t_sf, self.a_t, self.a_t_sf,
                            torch.zeros(C, I // BLOCK, dtype=torch.float32, device=dev))  # zeros: rows of no group


def fp8_weights_for_mega_moe(w13: torch.Tensor, w2: torch.Tensor, *, pow2_scales: bool = False, cache=None):
    """(w13, w13_sf, w2, w2_sf, w13_t, w13_t_sf, w2_t, w2_t_sf): the FP8 tiles (128 x 128 scales) of the weights
    and of their transposes, from the recipe's weight cache (``cache``, default the one the layer API uses), so one
    copy per version of each weight serves every caller."""
    cache = _fp8.WEIGHT_CACHE if cache is None else cache
    c13, c2 = cache.get(w13, pow2_scales), cache.get(w2, pow2_scales)
    return (c13.weight.data, c13.weight.scale, c2.weight.data, c2.weight.scale,
            c13.transposed.data, c13.transposed.scale, c2.transposed.data, c2.transposed.scale)


# ----------------------------------------------------------------------------------------------
# argument checks (all before anything is written)
# ----------------------------------------------------------------------------------------------


def _check(t, name, shape, dtype, device, contiguous=True):
    _validate.check_call_tensor(t, name, shape, (dtype,), device, contiguous)


def _check_block_major(t, name, rows, cols, device):
    _check(t, name, (rows, cols), torch.float32, device, contiguous=False)
    if rows > 1 and t.stride(0) != 1:
        _fail(f"{name} must be K-block major (stride(0) == 1, as k_block_major_empty makes it)")


def _pair(pair, name):
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        _fail(f"{name} must be a pair (e4m3 values, fp32 128 x 128 block scales)", TypeError)
    return pair


def _check_weights(l1, l2, hidden, device, transposed: bool):
    """(El, I) from the weight pairs; natural [El, 2I, H] / [El, H, I] or their transposes."""
    n1, n2 = ("l1_t", "l2_t") if transposed else ("l1", "l2")
    (w13, w13_sf), (w2, w2_sf) = _pair(l1, n1), _pair(l2, n2)
    for name, w in ((n1, w13), (n2, w2)):
        if not isinstance(w, torch.Tensor) or w.dtype != E4M3 or w.dim() != 3:
            _fail(f"{name}[0] must be a float8_e4m3fn tensor [El, N, K]", TypeError)
    El = w13.shape[0]
    two_i = w13.shape[2] if transposed else w13.shape[1]
    I = two_i // 2
    if two_i % 2 or I % BLOCK or I == 0 or hidden % BLOCK:
        _fail(f"{n1}, {n2}: hidden ({hidden}) and the intermediate size ({two_i} / 2 from {n1}[0]'s shape "
              f"{list(w13.shape)}) must be positive multiples of {BLOCK}")
    s13 = (El, hidden, two_i) if transposed else (El, two_i, hidden)
    s2 = (El, I, hidden) if transposed else (El, hidden, I)
    for name, w, sf, shape in ((n1, w13, w13_sf, s13), (n2, w2, w2_sf, s2)):
        _check(w, f"{name}[0]", shape, E4M3, device)
        _check(sf, f"{name}[1]", (El, shape[1] // BLOCK, shape[2] // BLOCK), torch.float32, device)
    return El, I


def _check_buffer(buffer, T):
    if not isinstance(buffer, SymmBuffer) or buffer.mma_type != "fp8xfp8":
        _fail("buffer must be an FP8SymmBuffer (a SymmBuffer with mma_type='fp8xfp8')", TypeError)
    if buffer.num_ranks != 1:
        _fail(f"the FP8 calls run on a single rank; the buffer's group has {buffer.num_ranks}")
    if T > buffer.num_max_tokens_per_rank:
        _fail(f"{T} tokens exceed the buffer's num_max_tokens_per_rank={buffer.num_max_tokens_per_rank}")


def _check_pools(pools, T, K, El, hidden, inter, device, forward: bool):
    """The pools' capacity, after the checks of what the forward writes (all of it) or the backward reads (z, weights,
    meta, counts)."""
    if not isinstance(pools, FP8Pools) or (forward and pools._x_rows is None):
        _fail("pools must come from FP8Pools.allocate" if forward else "pools must be an FP8Pools", TypeError)
    if pools.z is None:
        _fail("pools.z must be a tensor (the forward's saved activation)", TypeError)
    C = pools.capacity
    need = _plan_capacity(T, K, El, BLOCK)
    if C < need:
        _fail(f"the pools hold {C} rows but {T} tokens x top-{K} over {El} experts may need {need}; allocate them "
              f"with pool_capacity(max_tokens, top_k, num_local_experts)")
    if forward:
        _check(pools.x, "pools.x", (C, hidden), E4M3, device)
        _check_block_major(pools.x_sf, "pools.x_sf", C, hidden // BLOCK, device)
        _check(pools.h, "pools.h", (C, inter), E4M3, device)
        _check(pools.h_sf, "pools.h_sf", (inter // S_BLOCK, C), torch.float32, device)
    _check(pools.z, "pools.z", (C, 2 * inter), torch.bfloat16, device)
    _check(pools.weights, "pools.weights", (C,), torch.float32, device)
    _check(pools.meta, "pools.meta", (C, 3), torch.int32, device)
    _check(pools.counts, "pools.counts", (El,), torch.int32, device)
    return C


def require_kernels(device: torch.device, call: str, activation_clamp: float | None = None) -> None:
    """On CUDA, raise ``FusedKernelUnavailable`` with the ``prime_kernels.status()`` reason unless the FP8 kernels of
    both directions can run here (a forward must not run where its backward cannot), with the clamp's kernels when
    ``activation_clamp`` is given; the CPU runs the ops' CPU kernels."""
    if device.type != "cuda":
        return
    why = (_backend.fp8_kernel_reason("fp8", "bwd" if "backward" in call or "grads" in call else "fwd")
           or _backend._fp8_pipeline_reason("fp8", 1, activation_clamp))
    if why is not None:
        raise _backend.FusedKernelUnavailable(f"prime_kernels.mega.{call}: the FP8 kernels are not available here: "
                                              f"{why} (see prime_kernels.status())")


def _call_prologue(rows_out, name, buffer, activation_clamp, num_sms, call):
    """(sms, T, H, K, device, clamp) of a forward or backward call whose [T, H] bf16 output ``rows_out`` gives T,
    after the checks every such call shares."""
    clamp = _validate.check_activation_clamp(activation_clamp)
    sms = _sms(_validate.num_sms_arg(num_sms))
    if not isinstance(rows_out, torch.Tensor):
        _fail(f"{name} must be a tensor", TypeError)
    T = rows_out.shape[0]
    _check_buffer(buffer, T)
    H, K, dev = buffer.hidden, buffer.num_topk, _device(buffer.device)
    _check(rows_out, name, (T, H), torch.bfloat16, dev)
    require_kernels(dev, call, clamp)
    return sms, T, H, K, dev, clamp


# ----------------------------------------------------------------------------------------------
# the calls
# ----------------------------------------------------------------------------------------------


def fp8_mega_moe(y: torch.Tensor, l1, l2, pools: FP8Pools, buffer: SymmBuffer, *, activation_clamp=None,
                 fast_math: bool = True, num_sms: Optional[int] = None, pow2_scales: bool = False,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None) -> None:
    """The FP8 forward of the tokens staged in ``buffer`` into ``y`` (bf16 [T, H], T = y.size(0); overwritten),
    filling ``pools`` for the backward. ``l1`` = (w13 e4m3 [El, 2I, H] gate rows then up rows, w13_sf fp32
    [El, 2I/128, H/128]), ``l2`` = (w2 [El, H, I], w2_sf [El, H/128, I/128]). ``fast_math`` is accepted (SiLU runs
    at full precision). Every argument is checked, and the expert ids before ``y`` is written."""
    sms, T, H, K, dev, clamp = _call_prologue(y, "y", buffer, activation_clamp, num_sms, "fp8_mega_moe")
    E = buffer.num_experts
    El, I = _check_weights(l1, l2, H, dev, transposed=False)
    if El != buffer.num_local_experts:
        _fail(f"the weights hold {El} experts but the buffer has {buffer.num_local_experts} local experts")
    C = _check_pools(pools, T, K, El, H, I, dev, forward=True)
    if cumulative_local_expert_recv_stats is not None:
        _check(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", (El,), torch.int32, dev)
    x_q, x_sf = buffer.x[:T], buffer.x_sf[:T]
    topk_idx, topk_weights = buffer.topk_idx[:T], buffer.topk_weights[:T]
    ids = _validate.ExpertIdCheck(topk_idx, E, "grouped", from_plan=True)
    with torch.no_grad():
        plan = routing_plan(topk_idx, E, BLOCK, validate=False, capacity=C)
        ids.watch(plan.num_invalid)
        counts, offsets, src = plan.expert_counts, plan.expert_offsets, plan.pool_src_route
        route_to_pool = plan.route_to_pool.view(T, K)
        if T == 0:  # no route: empty pools (y has no rows)
            _fill_row_state(pools, src, plan.pool_src_rank, topk_weights, counts, K)
            ids.finish()
            return None
        # F1 with x already quantized: the value bytes moved as bf16 pairs by the row dispatch (each token row read
        # once), the scales gathered; then the padding rows zeroed, so every row an m-block reads is finite
        dispatch_rows(x_q.view(torch.bfloat16), route_to_pool, pools.x.view(torch.bfloat16))
        tok = _token_rows(src, K).long()
        pools.x_sf.copy_(x_sf.index_select(0, tok.clamp(min=0)))
        index = _padding_row_index(counts, offsets, T * K, C)
        if index is not None:
            pools._x_rows.view(torch.uint8).index_fill_(0, index, 0)
            pools._x_sf_rows.index_fill_(0, index, 0)
        # F1-F3, F6: the FP8 L1 with SwiGLU; s into the shared L2 operand pool, h into z
        m_grouped_fp8_gemm_swiglu(pools.x, pools.x_sf, l1[0], l1[1], offsets, pow2_scales=pow2_scales, save_h=True,
                                  num_sms=sms, out=Fp8SwigluFwd(pools.h, pools.h_sf.t(), pools.z), clamp=clamp)
        o = m_grouped_fp8_gemm_nt(pools.h, pools.h_sf.t(), l2[0], l2[1], offsets, num_sms=sms)  # F4
        out = combine(o, route_to_pool, topk_weights.float())  # F5
        del o
        _fill_row_state(pools, src, plan.pool_src_rank, topk_weights, counts, K)
        ids.finish()
        y.copy_(out)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(counts)


def _fill_row_state(pools: FP8Pools, src, srank, topk_weights, counts, K: int) -> None:
    """weights, meta and counts of the pools from the plan (no sync: masked slots read a trailing zero)."""
    num_routes = topk_weights.numel()
    valid = src >= 0
    slot = torch.where(valid, src, torch.full_like(src, num_routes)).long()
    w_ext = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])
    pools.weights.copy_(w_ext[slot])
    neg = torch.full_like(src, -1)
    pools.meta[:, 0] = torch.where(valid, srank, neg)
    pools.meta[:, 1] = torch.where(valid, torch.div(src, K, rounding_mode="floor"), neg)
    pools.meta[:, 2] = torch.where(valid, src % K, neg)
    pools.counts.copy_(counts)


def column_quant(x: torch.Tensor, x_sf: torch.Tensor, counts: torch.Tensor, x_t: torch.Tensor,
                 x_t_sf: torch.Tensor, *, pow2_scales: bool = False) -> None:
    """The weight-gradient operand of x: qT per expert (128 pool rows per scale, block grid from each expert's first
    row) of the pool rows ``x`` (e4m3 [C, H]) / ``x_sf`` (fp32 [C, H/128]) dequantized and rounded to bf16 (exact
    for power-of-two scales), written into ``x_t`` (e4m3 [H, C], token axis contiguous, row stride a multiple of 16
    bytes: :func:`allocate_column_quant`) and ``x_t_sf`` (fp32 [H, ceil(C/128)], K-block major). Rows of no expert
    and padding rows count as zeros. It reads only its arguments, so it may run on a side stream once the forward's
    dispatch is done (the caller orders the streams); its tensors are marked as used by the stream it runs on, so the
    caller may drop the pools at once."""
    if not isinstance(x, torch.Tensor) or x.dtype != E4M3 or x.dim() != 2:
        _fail("x must be float8_e4m3fn [C, H]", TypeError)
    C, H = x.shape
    dev = x.device
    if H % BLOCK:
        _fail(f"H ({H}) must be a multiple of {BLOCK}")
    _check_block_major(x_sf, "x_sf", C, H // BLOCK, dev)
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or counts.dim() != 1:
        _fail("counts must be int32 [El]", TypeError)
    _check(x_t, "x_t", (H, C), E4M3, dev, contiguous=False)
    if x_t.stride(1) != 1 or (H > 1 and x_t.stride(0) % 16):
        _fail("x_t must have its token axis contiguous and a row stride of a multiple of 16 (allocate_column_quant)")
    _check_block_major(x_t_sf, "x_t_sf", H, (C + BLOCK - 1) // BLOCK, dev)
    require_kernels(dev, "column_quant")
    # one kernel reads the e4m3 rows and their scales (a bf16 dequantized copy through torch first took 2.70 ms at
    # 30B, T=16384 on the H200, most of it in torch's e4m3 copy and the broadcast multiply)
    quantize_tokens_fp8(x, expert_offsets(counts), counts, pow2_scales=pow2_scales, out=(x_t, x_t_sf), v_scale=x_sf)
    if x.is_cuda:  # on a side stream, the caller may drop the pools before this kernel has read them
        stream = torch.cuda.current_stream(x.device)
        for t in (x, x_sf, counts, x_t, x_t_sf):
            t.record_stream(stream)


def allocate_column_quant(capacity: int, hidden: int, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t e4m3 [H, C], x_t_sf fp32 [H, ceil(C/128)]) in the layouts :func:`column_quant` writes."""
    dev = _device(device)
    return (_token_major_empty(hidden, capacity, dev),
            k_block_major_empty(hidden, (capacity + BLOCK - 1) // BLOCK, dev))


def _routes_from_meta(meta: torch.Tensor, weights: torch.Tensor, T: int, K: int):
    """(pool_src_route int32 [C], route_to_pool int32 [T, K], topk_weights fp32 [T, K]) from the pools' meta and
    weights, without a sync: the pool rows no route names write into one spare slot past the routes."""
    C = meta.shape[0]
    valid = meta[:, 1] >= 0
    src = torch.where(valid, meta[:, 1] * K + meta[:, 2], torch.full_like(meta[:, 1], -1))
    # a route past T * K (pools of a forward with more tokens than this dy) goes to the spare slot here, and the
    # kernels that read src report it (CUDA: a device finding, raised by the next call; CPU: raised now)
    slot = torch.where(valid & (src < T * K), src, torch.full_like(src, T * K)).long()
    r2p = torch.full((T * K + 1,), -1, dtype=torch.int32, device=meta.device)
    r2p.scatter_(0, slot, torch.arange(C, dtype=torch.int32, device=meta.device))
    tw = weights.new_zeros(T * K + 1)
    tw.scatter_(0, slot, weights)
    return src.to(torch.int32), r2p[:-1].view(T, K), tw[:-1].view(T, K)


def fp8_mega_moe_backward(grad_x: torch.Tensor, grad_weights: torch.Tensor, l1_t, l2_t, pools: FP8Pools,
                          bufs: FP8BackwardBuffers, buffer: SymmBuffer, *, activation_clamp=None,
                          fast_math: bool = True, num_sms: Optional[int] = None, pow2_scales: bool = False) -> None:
    """The data gradients of the forward that filled ``pools``, from ``buffer.dy[:T]`` (bf16, staged by the
    caller; T the forward's): ``grad_x`` bf16 [T, H] and ``grad_weights`` fp32 [T, K] (d topk_weights; 0 for masked
    routes), overwritten. ``l1_t`` = (w13_t e4m3 [El, H, 2I], w13_t_sf [El, H/128, 2I/128]) and ``l2_t`` = (w2_t [El, I, H],
    w2_t_sf [El, I/128, H/128]): the transposed tiles (:func:`fp8_weights_for_mega_moe`). The weight-gradient
    operands are left in ``bufs`` for :func:`fp8_mega_moe_weight_grads`. The forward is not recomputed: z is the
    saved activation."""
    sms, T, H, K, dev, clamp = _call_prologue(grad_x, "grad_x", buffer, activation_clamp, num_sms,
                                              "fp8_mega_moe_backward")
    _check(grad_weights, "grad_weights", (T, K), torch.float32, dev)
    El, I = _check_weights(l1_t, l2_t, H, dev, transposed=True)
    C = _check_pools(pools, T, K, El, H, I, dev, forward=False)
    if not isinstance(bufs, FP8BackwardBuffers) or (bufs.capacity, bufs.hidden, bufs.intermediate) != (C, H, I):
        _fail(f"bufs must be FP8BackwardBuffers({C}, {H}, {I})", TypeError)
    with torch.no_grad():
        if T == 0:
            bufs.dy_t_sf.zero_()  # no route: every operand block is empty (zero scales, zero gradients)
            bufs.dh_t_sf.zero_()
            bufs.a_t_sf.zero_()
            return None
        src, route_to_pool, topk_weights = _routes_from_meta(pools.meta, pools.weights, T, K)
        offsets = expert_offsets(pools.counts)
        dx, dtopk, _, _ = _fp8_bwd.data_grads(
            buffer.dy[:T], l1_t, l2_t, pools.z, pools.counts, offsets, src, route_to_pool, topk_weights,
            pow2=pow2_scales, sms=sms, want_wgrad_operands=True, dy_t_out=(bufs.dy_t, bufs.dy_t_sf),
            l2_out=bufs.l2_out(), clamp=clamp)
        grad_x.copy_(dx)
        grad_weights.copy_(dtopk)


def _weight_grads_now(counts, bufs: FP8BackwardBuffers, x_t, dw13, dw2, side_stream, sms) -> None:
    offsets = expert_offsets(counts)

    def run():
        k_grouped_fp8_gemm_tn(bufs.dy_t, bufs.dy_t_sf, bufs.a_t, bufs.a_t_sf, offsets, accumulate_into=dw2,
                              num_sms=sms)  # dW2[e] += qT(dy_e)^T qT(a_e)
        k_grouped_fp8_gemm_tn(bufs.dh_t, bufs.dh_t_sf, x_t[0], x_t[1], offsets, accumulate_into=dw13,
                              num_sms=sms)  # dW13[e] += qT(dh_e)^T qT(x_e)

    if side_stream is None or not dw13.is_cuda:
        run()
        return
    side_stream.wait_stream(torch.cuda.current_stream(dw13.device))
    with torch.cuda.stream(side_stream):
        run()
    # the allocator may not hand these to the caller's stream before the side stream's GEMMs are done
    for t in (offsets, bufs.dy_t, bufs.dy_t_sf, bufs.a_t, bufs.a_t_sf, bufs.dh_t, bufs.dh_t_sf, x_t[0], x_t[1]):
        t.record_stream(side_stream)


def _check_accumulators(dw13, dw2, bufs: FP8BackwardBuffers, counts):
    El = counts.shape[0] if isinstance(counts, torch.Tensor) else -1
    H, I, dev = bufs.hidden, bufs.intermediate, bufs.dy_t.device
    _check(dw13, "dw13", (El, 2 * I, H), torch.float32, dev)
    _check(dw2, "dw2", (El, H, I), torch.float32, dev)


def fp8_mega_moe_weight_grads(counts: torch.Tensor, bufs: FP8BackwardBuffers, x_t, dw13: torch.Tensor,
                              dw2: torch.Tensor, side_stream=None, wgrad_tile_scales: bool = False, *,
                              pending: Optional[list] = None, defer: bool = False,
                              num_sms: Optional[int] = None) -> None:
    """Add this micro-batch's weight gradients into the fp32 accumulators ``dw13`` [El, 2I, H] and ``dw2``
    [El, H, I] (e.g. FSDP's unsharded gradient buffers): ``bufs`` from :func:`fp8_mega_moe_backward`, ``x_t`` =
    (x_t, x_t_sf) from :func:`column_quant`, ``counts`` the pools'. On CUDA with ``side_stream`` the GEMMs run on
    that stream after the work queued so far on the current one; the caller makes its stream wait on
    ``side_stream`` before it reads the accumulators. ``defer=True`` holds the micro-batch in ``pending`` (a list the
    caller keeps) for :func:`fp8_mega_moe_weight_grads_add`; a call that would hold more than
    :data:`MAX_DEFERRED` flushes the held ones first. ``wgrad_tile_scales`` (128 x 128 scales for the operands) is
    not implemented: pass False. The sums are added in call order, so the result is deterministic."""
    if wgrad_tile_scales:
        _fail("wgrad_tile_scales=True (128 x 128 tile scales for the weight-gradient operands) is not implemented; "
              "the operands have one scale per column and 128 tokens: pass False", NotImplementedError)
    if not isinstance(bufs, FP8BackwardBuffers):
        _fail("bufs must be the FP8BackwardBuffers of fp8_mega_moe_backward", TypeError)
    _check_accumulators(dw13, dw2, bufs, counts)
    x_t = _pair(x_t, "x_t")
    _check(x_t[0], "x_t[0]", (bufs.hidden, bufs.capacity), E4M3, dw13.device, contiguous=False)
    require_kernels(dw13.device, "fp8_mega_moe_weight_grads")
    sms = _sms(_validate.num_sms_arg(num_sms))
    if defer:
        if pending is None:
            _fail("defer=True needs pending= (a list that holds the deferred micro-batches)", TypeError)
        if len(pending) >= MAX_DEFERRED:
            fp8_mega_moe_weight_grads_add(pending, dw13, dw2, side_stream, num_sms=num_sms)
        pending.append((counts, bufs, tuple(x_t)))
        return None
    _weight_grads_now(counts, bufs, x_t, dw13, dw2, side_stream, sms)


def fp8_mega_moe_weight_grads_add(pending: list, dw13: torch.Tensor, dw2: torch.Tensor, side_stream=None, *,
                                  num_sms: Optional[int] = None) -> None:
    """Add every micro-batch ``pending`` holds (oldest first) into the accumulators, as
    :func:`fp8_mega_moe_weight_grads` would have, and empty it."""
    sms = _sms(_validate.num_sms_arg(num_sms))
    for counts, bufs, _ in pending:
        _check_accumulators(dw13, dw2, bufs, counts)
    while pending:
        counts, bufs, x_t = pending.pop(0)
        _weight_grads_now(counts, bufs, x_t, dw13, dw2, side_stream, sms)
