"""Pure-PyTorch reference of the Mega MoE layer: the definition the fused kernels keep to.

Notation: T tokens on this rank, H hidden, I intermediate, K top-k, E experts over R ranks
(El = E / R local experts, rank r owns experts [r*El, (r+1)*El)). A *route* is (t, k) with
e = topk_idx[t, k]; e == -1 masks the route. Pool row p holds one route of one local expert
(see :mod:`prime_kernels.mega._plan`). ``io`` is bfloat16 and ``acc`` is float32; with float64
inputs ("exact mode", used by gradcheck) both are float64 and every rounding below is the
identity, so the reference *is* the unrounded formula.

Forward, per route p = (t, k) of expert e, with gate/up weights Wg = w13[e, :I], Wu = w13[e, I:]:

  F1. h_p = x_t @ w13[e]^T                 acc GEMM (products exact, acc accumulation)  [2I]
      g~, u~ = round_h(h_p) split           (h rounded to bf16 the way F6 saves it, before SwiGLU)
  F2. clamp c (optional): g~ <- min(g~, c), u~ <- clamp(u~, -c, c), in acc
  F3. s_p = round_io(silu(g~) * u~)        SwiGLU in acc, rounded to bf16: the L2 operand. From the
                                           rounded h, so that s_p is exactly round_io of the backward's
                                           s, and an epilogue that holds only bf16 h computes it too
  F4. o_p = round_io(s_p @ w2[e]^T)        acc GEMM, rounded to bf16: the combine slot [H]
  F5. y_t = round_io(sum_{k=0..K-1} w[t,k] * o_{t,k})
                                           topk weight in fp32 (not rounded), products and the
                                           sum in acc, k in increasing order (fixed, no atomics)
  Masked routes (e == -1) contribute nothing (no pool row; their slot is zero).
  F6. Saved for the backward (unless recompute=True), in pool order: h~_p = round_h(h_p), the
      unclamped fp32 h rounded to bf16 to nearest-even, except that with a clamp a value never
      rounds onto or across a bound it is strictly on one side of (it takes the nearest bf16
      value on its own side instead): then the backward's clamp masks, evaluated on h~, equal
      the forward's masks on the fp32 h. (Plain rounding sends every value within half a bf16
      ulp of c to c itself and zeroes its gradient: measured 5-7% relative error in dX and
      dW13 at c = 0.75 on unit-variance h, against ~3e-3 with this rule.) If c itself is not a
      bf16 value, an h exactly equal to c keeps plain rounding.

Backward, given dy [T, H] (bf16). h~ = the saved round_h(h_p) (F6; recompute=True recomputes
F1 and rounds the same way, so the values are identical); g~, u~ = h~ split; gc, uc the
clamped g~, u~ (F2); sig = sigmoid(gc); silu = gc * sig; s = silu * uc, all in acc (s is *not*
rounded here; the forward's F3 value is its bf16 rounding):

  B1. dispatch: dy_p = dy_t (bf16, no weight factor); w_p = topk_weights[t, k] (fp32).
  B2. da_p = dy_p @ w2[e]                  acc GEMM  [I]
  B3. d topk_weights[t, k] = sum_i da_p[i] * s[i]   in acc (0 for masked routes)
  B4. ds = w_p * da_p;  dgc = ds * uc * sig * (1 + gc * (1 - sig));  duc = ds * silu   (acc)
  B5. clamp gradient: it passes strictly inside the bounds (torch 2.14 clamp's rule; 2.11 differs)
      only, dg = dgc * [g~ < c], du = duc * [-c < u~ < c] (0 at equality)
  B6. dh_p = round_io([dg, du])            bf16: the operand of the L1 dgrad and the L1 wgrad
  B7. dx_p = round_io(dh_p @ w13[e])       acc GEMM, rounded to bf16: the per-route dx slot [H]
  B8. dx_t = round_io(sum_{k=0..K-1} dx_{t,k})   acc, increasing k (fixed order)
  B9. a_p = round_io(w_p * s)              bf16: the L2 wgrad operand (weight applied here)
  B10. dW2[e]  = sum_p dy_p^T a_p          acc accumulation over the expert's rows [H, I]
       dW13[e] = sum_p dh_p^T x_p          acc accumulation [2I, H]
       rounded once to the weight dtype (bf16), or *added* in fp32 into caller-provided
       accumulation buffers (``wgrad_accum``), in which case no weight gradient is returned.
  Padding rows of the pool are never read. Experts with no rows get zero weight gradients.

Shared experts (``shared_w13`` / ``shared_w2``): a second layer of S experts that every token routes to, whose output
is added to y in acc and rounded once; their rounding points S1-S3 are in :mod:`prime_kernels.mega.shared`.

Order of accumulation: the fixed-order sums are F5 and B8 (over k) and nothing else is
reduced across routes except the weight gradients B10, whose order inside an expert's GEMM is
the GEMM's (a kernel may tile it differently; only the fp32 accumulation is specified).
Expert parallelism: dispatch and combine exchange per-route rows with ``all_to_all_single``;
rank r's pool equals the slice, for r's experts, of the single-rank pool over all ranks' tokens
concatenated in rank order (pool order (expert, rank, token, k)), so every GEMM sees the same
rows in the same order and EP = R equals EP = 1 bit for bit (tested on CPU with gloo).

GEMMs on CUDA run in true fp32: TF32 is switched off around them.
Tests hold the bf16 reference to ||out - ref|| / ||ref|| < 1e-2 against an independent float64
per-token loop for y, dX, d topk_weights, dW13 and dW2 (measured ~3e-3).

FP8 (``precision="fp8"``: FP8 forward and backward; ``"fp8_bwd"``: the bf16 forward above, bit for
bit, and the FP8 backward). The DeepSeek-V3 blockwise recipe; quantization q(.) (Q1-Q3), its block
grids and tail blocks, and the emulated GEMM with promotion every 128 of K (G1-G3) are defined in
:mod:`prime_kernels.mega.fp8`. qK(v, b): 1 x b blocks along the last axis (the GEMM's K); qT(v): 128 x 1
blocks along the token axis, the grid starting at each expert's first pool row (with the kernels'
block_m = 128 these are the pool's m-blocks), so results do not depend on block_m; qW(w): 128 x 128.
x and dy are bf16; everything else below is fp32 unless said.

Tail blocks (H or I a multiple of 64 but not of 128, which the kernels take): every grid starts at index 0 of
its axis, and the last block along H or I is 64 wide, its amax over those 64 values (scale = amax / 448),
ceil(len / 128) scales along that axis; a GEMM whose K is H or I has a 64-wide last slice (G1 over 64
products). qW(w13) is blocked along 2I from row 0, so with I = 64 (mod 128) one block holds the last 64
gate and the first 64 up rows. dh (B6, B7) is the one exception to a grid along the whole axis: its gate
and up halves are blocked from their own first columns (``fp8.quantize_halves_along_k``: a kernel tile of
128 columns of I holds one block of dg and one of du), so with I = 64 (mod 128) both halves end on a
64-wide block and B7 promotes every 64 of 2I, where dh's and W13^T's grids meet.

  W.  W13 = qW(w13[e]) [2I, H] and W2 = qW(w2[e]) [H, I], made once per version of the weight
      (``fp8.Fp8WeightCache``), with their transposes W13^T [H, 2I] and W2^T [I, H]: the same tiles
      transposed, which is exactly qW of the transposed weight. The backward reuses the forward's.
  Forward (precision "fp8"):
  F1. h_p = G(qK(x_t, 128), W13)           x quantized from bf16 by the dispatch; fp32 h   [2I]
  F2. clamp as above, on the fp32 h (not on round_h(h): the L1 epilogue holds the accumulators)
  F3. s_p = silu(gc) * uc                  fp32, then qK(s_p, l2_act_block) in the L1 epilogue
                                           (l2_act_block 64 by default, the kernels' L1 tile of 64+64
                                           columns; or 128)
  F4. o_p = round_io(G(qK(s_p), W2))       bf16 combine slot
  F5. as above (topk weights in fp32 at the combine, fixed k order)
  F6. h~_p = round_h(h_p) of the fp32 h of F1 (same rule as above); recompute=True recomputes F1 the
      same way (so the backward sees identical values)
  Backward (precision "fp8" or "fp8_bwd"); h~, g~, u~, gc, uc, sig, silu, s as above (s from h~):
  B1. dispatch of dy_p (bf16): qK(dy_p, 128) for B2, and qT(dy_e) over the expert's rows for B10
  B2. da_p = G(qK(dy_p), W2^T)             fp32 [I]
  B3-B5. as above, in fp32
  B6. dh_p = round_io([dg, du]) (bf16, the BF16 backward's operand), quantized by the L2-dgrad epilogue
      twice: qK(dh_p, 128) of dg and of du for B7 (each half's grid from its first column; with I a
      multiple of 128, the grid along 2I), and qT(dh_e) for B10 (the amaxes are the bf16 values')
  B7. dx_p = round_io(G(qK(dh_p), W13^T))  bf16 per-route dx slot; promoted every 128 of 2I, or every
                                           64 when I = 64 (mod 128)
  B8. as above
  B9. a_p = round_io(w_p * s) (bf16), qT(a_e) in the same epilogue
  B10. dW2[e]  = G(qT(dy_e)^T, qT(a_e)^T)  K = the expert's rows, promoted every 128 rows
       dW13[e] = G(qT(dh_e)^T, qT(x_e)^T)  x rows quantized from bf16 by the backward's dispatch (not
       from the forward's 1x128 FP8 x: one quantization, not two)
       then rounded / accumulated as above.
  Measured against the float64 loop (tests/test_fp8_reference.py, unit-variance inputs, H=256,
  I=128): fp8 5.4e-2 .. 7.6e-2 for every output (up to 7.9e-2 with a clamp); fp8_bwd ~4e-3 for y
  and 2e-3 .. 5.3e-2 for the gradients; bound at 1.2e-1. With the FP8 forward and a clamp, values of
  h near the bound land on the other side of it than the exact h, so dX and dW13 lose more (2.4e-1
  at c = 0.75 on unit-variance h, 9.7e-2 at c = 2). The reference follows an independent
  step-by-step emulation of this recipe to < 1e-3 (1.0e-4 measured). FP8 takes bf16 tokens (there
  is no float64 "exact mode" for it). docs/fp8.md describes the recipe in prose.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import _comm
from . import fp8 as _fp8
from ._plan import build_plan


def dtypes_for(x_dtype: torch.dtype):
    """(io, acc) dtypes: (bf16, fp32) normally, (fp64, fp64) in exact mode."""
    if x_dtype == torch.float64:
        return torch.float64, torch.float64
    return torch.bfloat16, torch.float32


@contextlib.contextmanager
def _no_tf32(device: torch.device):
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    attr, value = ("fp32_precision", "ieee") if hasattr(m, "fp32_precision") else ("allow_tf32", False)
    old = getattr(m, attr)
    setattr(m, attr, value)
    try:
        yield
    finally:
        setattr(m, attr, old)


def _resolve_group(group_name: str):
    return _comm.resolve(group_name)


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes per row (first dim) of ``t``, from its shape: the same on every rank, rows or none."""
    return int(torch.Size(t.shape[1:]).numel()) * t.element_size()


def _wide(t):
    """``t`` as [rows, 8-byte words] when its rows are contiguous whole words (else ``t``): row copies then move 8 bytes
    per element instead of 2 (bf16) or 1 (e4m3), which the index kernels do element by element."""
    if t.dim() < 2 or t.numel() == 0 or not t.is_contiguous():
        return t
    es = t.element_size()
    if (t[0].numel() * es) % 8 or (t.storage_offset() * es) % 8:
        return t
    return t.view(t.shape[0], -1).view(torch.int64)


def gather_rows(src, idx):
    """``src[idx]`` for row indices ``idx``, bit for bit."""
    wide = _wide(src)
    if wide is src:
        return src[idx]
    return wide.index_select(0, idx).view(src.dtype).view(idx.numel(), *src.shape[1:])


def scatter_rows(dst, idx, rows) -> None:
    """``dst[idx] = rows`` for row indices ``idx`` (distinct), bit for bit."""
    wide_dst, wide_rows = _wide(dst), _wide(rows)
    if wide_dst is dst or wide_rows is rows or wide_dst.shape[1] != wide_rows.shape[1]:
        dst[idx] = rows
    else:
        wide_dst[idx] = wide_rows


class Exchange:
    """Moves per-route rows between this rank's routes and the owning ranks' pools.

    ``send_order``: this rank's unmasked routes (t*K + k) in the order they are sent: by owning
    rank, then by pool row there. ``recv_order``: this rank's used pool rows in the order they
    arrive: by source rank, then by pool row. With one rank both are the pool order.
    ``row_stride``: a bound on ``route_to_pool``'s values (default: this pool's capacity), for a
    ``route_to_pool`` that names rows of a larger pool whose order this pool's rows keep.
    """

    def __init__(self, topk_idx, route_to_pool, pool_src_route, pool_src_rank, num_experts, group,
                 row_stride=None):
        self.group = group
        self.num_ranks = _comm.world_size(group)
        R = self.num_ranks
        El = num_experts // R
        cap = pool_src_route.numel()
        r2p = route_to_pool.reshape(-1).long()
        ridx = torch.nonzero(r2p >= 0).flatten()
        if R > 1:
            dest = torch.div(topk_idx.reshape(-1)[ridx].long(), El, rounding_mode="floor")
        else:
            dest = torch.zeros_like(ridx)
        self.send_order = ridx[torch.argsort(dest * (cap if row_stride is None else row_stride) + r2p[ridx])]
        prow = torch.nonzero(pool_src_route >= 0).flatten()
        if R > 1:
            srank = pool_src_rank[prow].long()
            self.recv_order = prow[torch.sort(srank, stable=True).indices]
            self.send_splits = torch.bincount(dest, minlength=R).tolist()
            self.recv_splits = torch.bincount(srank, minlength=R).tolist()
        else:
            self.recv_order = prow
        self.capacity = cap

    def _a2a(self, tensors, in_splits, out_splits):
        """One all-to-all per tensor (packing them side by side would cost a concatenation and a strided copy per
        tensor on each side, more than the exchanges it saves). A rank that sends no row still has the row width
        from its own (empty) tensor's shape, which sizes what it receives."""
        if self.group is None:
            return tensors
        out = []
        for t in tensors:  # as bytes: every backend moves uint8 (gloo has no e4m3)
            row = int(torch.Size(t.shape[1:]).numel())
            send = t.contiguous().view(t.shape[0], row).view(torch.uint8)
            recv = send.new_empty((sum(out_splits), _row_bytes(t)))
            _comm.all_to_all_single(recv, send, out_splits, in_splits, self.group)
            out.append(recv.view(t.dtype).view(-1, *t.shape[1:]))
        return out

    def send_rows(self, route_rows):
        """[n_send, ...] rows in send order -> the rows this rank receives, [n_recv, ...] in recv order."""
        return self._a2a(route_rows, getattr(self, "send_splits", None), getattr(self, "recv_splits", None))

    def return_rows(self, pool_rows):
        """[n_recv, ...] rows in recv order -> the rows that come back to this rank, [n_send, ...] in send order."""
        return self._a2a(pool_rows, getattr(self, "recv_splits", None), getattr(self, "send_splits", None))

    def to_pool(self, route_rows):
        """[n_send, ...] rows in send order -> [capacity, ...] pool tensors (zero padding rows)."""
        recv = self.send_rows(route_rows)
        out = []
        for t in recv:
            pool = t.new_zeros((self.capacity, *t.shape[1:]))
            scatter_rows(pool, self.recv_order, t)
            out.append(pool)
        return out

    def to_routes(self, pool_tensors, num_routes):
        """[capacity, ...] pool tensors -> [num_routes, ...] per-route tensors (zero when masked)."""
        back = self.return_rows([gather_rows(p, self.recv_order) for p in pool_tensors])
        out = []
        for t in back:
            r = t.new_zeros((num_routes, *t.shape[1:]))
            scatter_rows(r, self.send_order, t)
            out.append(r)
        return out


def round_h(h, clamp, io):
    """F6: round the fp32 pre-activation h [n, 2I] to ``io`` keeping the clamp masks exact."""
    hb = h.to(io)
    if clamp is None or io == h.dtype:
        return hb
    I = h.shape[-1] // 2
    c = float(torch.tensor(float(clamp), dtype=h.dtype))  # the bound as the acc dtype holds it
    for lo, hi, bound in ((0, I, c), (I, 2 * I, c), (I, 2 * I, -c)):
        exact, rnd = h[:, lo:hi], hb[:, lo:hi]
        below, above = _io_neighbours(bound, io)
        r = rnd.to(h.dtype)
        rnd.copy_(torch.where((exact < bound) & (r >= bound), below,
                              torch.where((exact > bound) & (r <= bound), above, rnd)))
    return hb


def _io_neighbours(bound: float, io):
    """(largest io value < bound, smallest io value > bound) as Python floats (computed on the CPU)."""
    b = torch.tensor(bound, dtype=torch.float64).to(io)
    lo = b if float(b) < bound else torch.nextafter(b, torch.tensor(float("-inf"), dtype=io))
    hi = b if float(b) > bound else torch.nextafter(b, torch.tensor(float("inf"), dtype=io))
    return float(lo), float(hi)


def _swiglu_parts(h, clamp):
    I = h.shape[-1] // 2
    g, u = h[:, :I], h[:, I:]
    if clamp is not None:
        gc = torch.clamp(g, max=clamp)
        uc = torch.clamp(u, min=-clamp, max=clamp)
    else:
        gc, uc = g, u
    return g, u, gc, uc


FP8_PRECISIONS = ("fp8", "fp8_bwd")


def _check_precision(precision, x):
    if precision not in ("bf16",) + FP8_PRECISIONS:
        raise ValueError(f"prime_kernels.mega.reference: precision must be 'bf16', 'fp8' or 'fp8_bwd', "
                         f"got {precision!r}")
    if precision in FP8_PRECISIONS and x.dtype != torch.bfloat16:
        raise ValueError(f"prime_kernels.mega.reference: precision={precision!r} takes bf16 tokens, got {x.dtype}")
    return precision


class _Quantizer:
    """qK / qT of the FP8 section with the recipe's scale option."""

    def __init__(self, recipe):
        self.pow2 = recipe.pow2_scales

    def along_k(self, v, block=_fp8.BLOCK):
        return _fp8.quantize_along_k(v, block, self.pow2)

    def halves_along_k(self, v):
        return _fp8.quantize_halves_along_k(v, self.pow2)

    def along_tokens(self, v):
        return _fp8.quantize_along_tokens(v, _fp8.BLOCK, self.pow2)


def _fp8_l1(x_rows, q13e, qz):
    """F1 (FP8): the fp32 L1 accumulators of bf16 token rows."""
    return _fp8.fp8_gemm_nt(qz.along_k(x_rows), q13e)


def _fp8_expert_forward(x_rows, q13e, q2e, clamp, recipe, io):
    """F1-F4 and F6 (FP8) of one expert's rows: (round_h(h), o) with o the bf16 combine slots."""
    qz = _Quantizer(recipe)
    h = _fp8_l1(x_rows, q13e, qz)
    hr = round_h(h, clamp, io)  # F6
    _, _, gc, uc = _swiglu_parts(h, clamp)  # F2, on the fp32 accumulators
    s = qz.along_k(F.silu(gc) * uc, recipe.l2_act_block)  # F3
    return hr, _fp8.fp8_gemm_nt(s, q2e).to(io)  # F4


def forward(
    x,
    topk_idx,
    topk_weights,
    w13,
    w2,
    *,
    activation_clamp=None,
    group=None,
    num_experts=None,
    max_tokens_per_rank=None,
    block_m,
    capacity,
    save_h=True,
    precision="bf16",
    fp8_recipe=None,
    weight_cache=None,
    agreement=None,
):
    """Reference forward (F1-F5). Returns (y, h_saved, counts, offsets, pool_src_route,
    pool_src_rank, route_to_pool); h_saved is [capacity, 2I] (or [0, 2I] if not save_h).
    ``precision`` "fp8" runs the FP8 forward (W, F1-F6 of the FP8 section), "bf16" and "fp8_bwd"
    the bf16 one; ``fp8_recipe`` (:class:`fp8.Fp8Recipe`) and ``weight_cache`` (default
    ``fp8.WEIGHT_CACHE``) apply to "fp8"; ``agreement`` as in :func:`._plan.build_plan`."""
    fp8_fwd = _check_precision(precision, x) == "fp8"
    if fp8_fwd:
        recipe, cache = _fp8.recipe_and_cache(fp8_recipe, weight_cache)
        q13 = cache.get(w13, recipe.pow2_scales).weight  # W
        q2 = cache.get(w2, recipe.pow2_scales).weight
    io, acc = dtypes_for(x.dtype)
    T, H = x.shape
    K = topk_idx.shape[1]
    El, twoI, _ = w13.shape
    plan = build_plan(topk_idx, num_experts, block_m, capacity, group, max_tokens_per_rank, agreement)
    counts, offsets, pool_src_route, pool_src_rank, route_to_pool = plan
    ex = Exchange(topk_idx, route_to_pool, pool_src_route, pool_src_rank, num_experts, group)
    tok = torch.div(ex.send_order, K, rounding_mode="floor")
    (xp,) = ex.to_pool([x[tok]])
    op = xp.new_zeros((capacity, H))
    h_saved = x.new_zeros((capacity if save_h else 0, twoI))
    cnt = counts.tolist()
    off = offsets.tolist()
    with _no_tf32(x.device):
        for e in range(El):
            if cnt[e] == 0:
                continue
            rows = slice(off[e], off[e] + cnt[e])
            if fp8_fwd:
                hr, op[rows] = _fp8_expert_forward(xp[rows], q13[e], q2[e], activation_clamp, recipe, io)
                if save_h:
                    h_saved[rows] = hr
                continue
            h = xp[rows].to(acc) @ w13[e].to(acc).t()  # F1
            hr = round_h(h, activation_clamp, io)  # F6 (and F3's operands)
            if save_h:
                h_saved[rows] = hr
            _, _, gc, uc = _swiglu_parts(hr.to(acc), activation_clamp)  # F2
            s = (F.silu(gc) * uc).to(io).to(acc)  # F3
            op[rows] = (s @ w2[e].to(acc).t()).to(io)  # F4
    (slots,) = ex.to_routes([op], T * K)
    slots = slots.view(T, K, H)
    wts = topk_weights.to(acc)
    y = torch.zeros((T, H), dtype=acc, device=x.device)
    for k in range(K):  # F5, fixed k order
        y += wts[:, k : k + 1] * slots[:, k].to(acc)
    return (y.to(io), h_saved, counts, offsets, pool_src_route, pool_src_rank, route_to_pool)


def backward(
    dy,
    x,
    topk_idx,
    topk_weights,
    w13,
    w2,
    h_saved,
    counts,
    offsets,
    pool_src_route,
    pool_src_rank,
    route_to_pool,
    *,
    activation_clamp=None,
    group=None,
    num_experts=None,
    recompute=False,
    need_wgrad=True,
    dw13_accum=None,
    dw2_accum=None,
    x_pool=None,
    precision="bf16",
    fp8_recipe=None,
    weight_cache=None,
):
    """Reference backward (B1-B10). Returns (dx [T,H] io, dtopk [T,K] (topk_weights dtype),
    dw13 like w13 or None, dw2 like w2 or None); weight grads are None when accumulated into
    the given buffers or when need_wgrad is False. ``x_pool`` (pooled rows kept by a forward) is
    accepted and not used: the reference exchanges the rows itself. ``precision`` "fp8" and
    "fp8_bwd" run the FP8 backward (B1-B10 of the FP8 section; with ``recompute``, F1 is recomputed
    the way the forward of that precision ran it)."""
    fp8_back = _check_precision(precision, x) in FP8_PRECISIONS
    if fp8_back:
        recipe, cache = _fp8.recipe_and_cache(fp8_recipe, weight_cache)
        c13 = cache.get(w13, recipe.pow2_scales)  # W: the forward's tiles and their transposes
        c2 = cache.get(w2, recipe.pow2_scales)
        qz = _Quantizer(recipe)
    io, acc = dtypes_for(x.dtype)
    T, H = x.shape
    K = topk_idx.shape[1]
    El, twoI, _ = w13.shape
    capacity = pool_src_route.numel()
    ex = Exchange(topk_idx, route_to_pool, pool_src_route, pool_src_rank, num_experts, group)
    tok = torch.div(ex.send_order, K, rounding_mode="floor")
    w_routes = topk_weights.reshape(-1)[ex.send_order].to(acc)
    xp, dyp, wp = ex.to_pool([x[tok], dy.to(io)[tok], w_routes])  # B1
    dxp = xp.new_zeros((capacity, H))
    dtp = wp.new_zeros((capacity,))
    want_w = need_wgrad or dw13_accum is not None or dw2_accum is not None
    if want_w:
        dw13 = torch.zeros((El, twoI, H), dtype=acc, device=x.device)
        dw2 = torch.zeros((El, H, twoI // 2), dtype=acc, device=x.device)
    cnt = counts.tolist()
    off = offsets.tolist()
    with _no_tf32(x.device):
        for e in range(El):
            if cnt[e] == 0:
                continue
            rows = slice(off[e], off[e] + cnt[e])
            xe = xp[rows].to(acc)
            w13e = w13[e].to(acc)
            w2e = w2[e].to(acc)
            if recompute and precision == "fp8":
                h = round_h(_fp8_l1(xp[rows], c13.weight[e], qz), activation_clamp, io).to(acc)
            elif recompute:
                h = round_h(xe @ w13e.t(), activation_clamp, io).to(acc)
            else:
                h = h_saved[rows].to(acc)
            g, u, gc, uc = _swiglu_parts(h, activation_clamp)
            sig = torch.sigmoid(gc)
            silu = gc * sig
            s = silu * uc
            dye = dyp[rows].to(acc)
            if fp8_back:
                da = _fp8.fp8_gemm_nt(qz.along_k(dyp[rows]), c2.transposed[e])  # B1, B2
            else:
                da = dye @ w2e  # B2
            dtp[rows] = (da * s).sum(-1)  # B3
            we = wp[rows].unsqueeze(1)
            ds = we * da  # B4
            dg = ds * uc * sig * (1 + gc * (1 - sig))
            du = ds * silu
            if activation_clamp is not None:  # B5
                c = activation_clamp
                dg = dg * (g < c)
                du = du * ((u > -c) & (u < c))
            if fp8_back:
                dh = torch.cat([dg, du], 1).to(torch.bfloat16).to(acc)  # B6: bf16, quantized below
                dxp[rows] = _fp8.fp8_gemm_nt(qz.halves_along_k(dh), c13.transposed[e]).to(io)  # B7
                if want_w:  # B9, B10
                    a = qz.along_tokens((we * s).to(torch.bfloat16).to(acc))
                    dw2[e] = _fp8.fp8_gemm_nt(qz.along_tokens(dyp[rows]).t(), a.t())
                    dw13[e] = _fp8.fp8_gemm_nt(qz.along_tokens(dh).t(), qz.along_tokens(xp[rows]).t())
                continue
            dh = torch.cat([dg, du], 1).to(io).to(acc)  # B6
            dxp[rows] = (dh @ w13e).to(io)  # B7
            if want_w:  # B9, B10
                a = (we * s).to(io).to(acc)
                dw2[e] = dye.t() @ a
                dw13[e] = dh.t() @ xe
    dx_slots, dt_routes = ex.to_routes([dxp, dtp], T * K)
    dx_slots = dx_slots.view(T, K, H)
    dx = torch.zeros((T, H), dtype=acc, device=x.device)
    for k in range(K):  # B8, fixed k order
        dx += dx_slots[:, k].to(acc)
    dtopk = dt_routes.view(T, K).to(topk_weights.dtype)
    out13 = out2 = None
    if want_w:
        if dw13_accum is not None:
            dw13_accum.add_(dw13.to(dw13_accum.dtype))
        elif need_wgrad:
            out13 = dw13.to(w13.dtype)
        if dw2_accum is not None:
            dw2_accum.add_(dw2.to(dw2_accum.dtype))
        elif need_wgrad:
            out2 = dw2.to(w2.dtype)
    return dx.to(io), dtopk, out13, out2


def resolve_group(group_name: str):
    return _resolve_group(group_name)


class _ReferenceLayer(torch.autograd.Function):
    """:func:`forward` and :func:`backward` as one autograd node (the plan rides from one to the other)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w13, w2, topk_idx, opts):
        out = forward(x, topk_idx, topk_weights, w13, w2, **opts["fwd"])
        y, h, counts, offsets, src, srank, r2p = out
        ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, h, counts, offsets, src, srank, r2p)
        ctx.opts = opts
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        need_wgrad = bool(ctx.needs_input_grad[2] or ctx.needs_input_grad[3])
        dx, dtopk, dw13, dw2 = backward(dy, *saved, need_wgrad=need_wgrad, **ctx.opts["bwd"])
        return dx, dtopk, dw13, dw2, None, None


def mega_moe_reference(x, topk_idx, topk_weights, w13, w2, *, precision="bf16", activation_clamp=None, group=None,
                       num_experts=None, max_tokens_per_rank=None, block_m=128, recompute=False, fp8_recipe=None,
                       weight_cache=None):
    """The reference layer with autograd, for every precision it defines ("bf16", "fp8", "fp8_bwd"): y [T, H],
    with gradients to x, topk_weights, w13 and w2 from :func:`backward`. Inputs are taken as valid (the public
    :func:`prime_kernels.mega.mega_moe` checks them and, with backend="reference", runs :func:`forward` and
    :func:`backward` through its custom ops, with the default recipe and weight cache)."""
    from ..routing import pool_capacity  # noqa: PLC0415

    _check_precision(precision, x)
    R = _comm.world_size(group)
    T, K = topk_idx.shape
    El = w13.shape[0]
    E = El * R if num_experts is None else int(num_experts)
    tmax = T if max_tokens_per_rank is None else int(max_tokens_per_rank)
    capacity = pool_capacity(R * tmax, K, El, block_m)
    fp8_opts = dict(precision=precision, fp8_recipe=fp8_recipe, weight_cache=weight_cache)
    opts = {
        "fwd": dict(activation_clamp=activation_clamp, group=group, num_experts=E, max_tokens_per_rank=tmax,
                    block_m=block_m, capacity=capacity, save_h=not recompute, **fp8_opts),
        "bwd": dict(activation_clamp=activation_clamp, group=group, num_experts=E, recompute=recompute, **fp8_opts),
    }
    return _ReferenceLayer.apply(x, topk_weights, w13, w2, topk_idx, opts)
