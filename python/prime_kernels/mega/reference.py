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
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

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
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: PLC0415

    return _resolve_process_group(group_name)


def _pack(tensors):
    n = tensors[0].shape[0]
    parts = [t.contiguous().view(n, -1).view(torch.uint8) if t.numel() else
             torch.empty((n, t[0].numel() * t.element_size() if n else 0), dtype=torch.uint8, device=t.device)
             for t in tensors]
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _unpack(buf, likes):
    n = buf.shape[0]
    out, col = [], 0
    for shape, dtype in likes:
        width = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        part = buf[:, col : col + width].contiguous()
        col += width
        out.append(part.view(dtype).view(n, *shape))
    return out


class Exchange:
    """Moves per-route rows between this rank's routes and the owning ranks' pools.

    ``send_order``: this rank's unmasked routes (t*K + k) in the order they are sent: by owning
    rank, then by pool row there. ``recv_order``: this rank's used pool rows in the order they
    arrive: by source rank, then by pool row. With one rank both are the pool order.
    """

    def __init__(self, topk_idx, route_to_pool, pool_src_route, pool_src_rank, num_experts, group):
        self.group = group
        self.num_ranks = 1 if group is None else torch.distributed.get_world_size(group)
        R = self.num_ranks
        El = num_experts // R
        cap = pool_src_route.numel()
        r2p = route_to_pool.reshape(-1).long()
        ridx = torch.nonzero(r2p >= 0).flatten()
        if R > 1:
            dest = torch.div(topk_idx.reshape(-1)[ridx].long(), El, rounding_mode="floor")
        else:
            dest = torch.zeros_like(ridx)
        self.send_order = ridx[torch.argsort(dest * cap + r2p[ridx])]
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
        if self.group is None:
            return tensors
        likes = [(t.shape[1:], t.dtype) for t in tensors]
        send = _pack(tensors)
        recv = send.new_empty((sum(out_splits), send.shape[1]))
        torch.distributed.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        return _unpack(recv, likes)

    def to_pool(self, route_rows):
        """[n_send, ...] rows in send order -> [capacity, ...] pool tensors (zero padding rows)."""
        recv = self._a2a(route_rows, getattr(self, "send_splits", None), getattr(self, "recv_splits", None))
        out = []
        for t in recv:
            pool = t.new_zeros((self.capacity, *t.shape[1:]))
            pool[self.recv_order] = t
            out.append(pool)
        return out

    def to_routes(self, pool_tensors, num_routes):
        """[capacity, ...] pool tensors -> [num_routes, ...] per-route tensors (zero when masked)."""
        rows = [p[self.recv_order] for p in pool_tensors]
        back = self._a2a(rows, getattr(self, "recv_splits", None), getattr(self, "send_splits", None))
        out = []
        for t in back:
            r = t.new_zeros((num_routes, *t.shape[1:]))
            r[self.send_order] = t
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
):
    """Reference forward (F1-F5). Returns (y, h_saved, counts, offsets, pool_src_route,
    pool_src_rank, route_to_pool); h_saved is [capacity, 2I] (or [0, 2I] if not save_h)."""
    io, acc = dtypes_for(x.dtype)
    T, H = x.shape
    K = topk_idx.shape[1]
    El, twoI, _ = w13.shape
    plan = build_plan(topk_idx, num_experts, block_m, capacity, group, max_tokens_per_rank)
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
):
    """Reference backward (B1-B10). Returns (dx [T,H] io, dtopk [T,K] (topk_weights dtype),
    dw13 like w13 or None, dw2 like w2 or None); weight grads are None when accumulated into
    the given buffers or when need_wgrad is False. ``x_pool`` (pooled rows kept by a forward) is
    accepted and not used: the reference exchanges the rows itself."""
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
            if recompute:
                h = round_h(xe @ w13e.t(), activation_clamp, io).to(acc)
            else:
                h = h_saved[rows].to(acc)
            g, u, gc, uc = _swiglu_parts(h, activation_clamp)
            sig = torch.sigmoid(gc)
            silu = gc * sig
            s = silu * uc
            dye = dyp[rows].to(acc)
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
