"""Shared pieces of the benchmarks: shapes, routing, the TorchTitan-style torch baseline, timing (bursts,
steady state, energy per call), FLOP counts, provenance and the results file (docs/performance.md)."""

from __future__ import annotations

import datetime as _dt
import ctypes
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"

# name -> (num_experts, hidden, intermediate, top_k)
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
    "smoke": (8, 128, 128, 2),  # tiny, CPU-runnable (--smoke)
}

# The shape grid a layer is judged on beyond the two Qwen3 shapes (bench_layer.py --shapes grid): every E x (H, I),
# top-8, named "e<E>-h<H>-i<I>-k<K>" (shape_dims reads such a name back).
GRID_EXPERTS = (16, 32, 64, 128, 256)
GRID_HIDDEN_INTER = ((1024, 512), (2048, 768), (4096, 1536), (7168, 2048))
GRID_TOP_K = 8


def grid_shapes() -> list[str]:
    return [f"e{E}-h{H}-i{I}-k{GRID_TOP_K}" for E in GRID_EXPERTS for H, I in GRID_HIDDEN_INTER]


def shape_dims(name: str) -> tuple[int, int, int, int]:
    """(num_experts, hidden, intermediate, top_k) of a SHAPES name or of an "e<E>-h<H>-i<I>-k<K>" name;
    ValueError for anything else."""
    if name in SHAPES:
        return SHAPES[name]
    parts = name.split("-")
    if len(parts) == 4 and all(p[:1] == c and p[1:].isdigit() for p, c in zip(parts, "ehik")):
        E, H, I, K = (int(p[1:]) for p in parts)
        if E >= 1 and H >= 1 and I >= 1 and 1 <= K <= E:
            return E, H, I, K
    raise ValueError(f"unknown shape {name!r}: one of {sorted(SHAPES)}, 'grid', or e<E>-h<H>-i<I>-k<K>")


# ------------------------------------------------------------------------------------------------
# distributed helpers (torchrun); everything also works without torch.distributed initialised
# ------------------------------------------------------------------------------------------------


def dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world() -> tuple[int, int]:
    """(rank, world size)."""
    if dist_on():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def init_distributed_from_env(device_type: str):
    """Start the process group when launched by torchrun (WORLD_SIZE > 1); return the group or None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend, timeout=_dt.timedelta(seconds=300))
    return torch.distributed.group.WORLD


def reduce_max(value, device):
    """The largest value over the ranks (the slowest rank for times). None stays None."""
    if value is None or not dist_on():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def gather_values(value: float, device) -> list[float]:
    """Every rank's value, in rank order ([value] without torch.distributed)."""
    if not dist_on():
        return [float(value)]
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t)
    return [float(v.item()) for v in out]


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def make_routing(T: int, E: int, K: int, kind: str, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [T,K] int64, topk_weights [T,K] fp32), seeded.

    "uniform": ``topk(softmax(randn(T, E)), K)``.
    "zipf": expert popularity ~ 1/rank^1.1 over a random permutation of the experts: top-k of
    softmax(log(popularity) + Gumbel noise), which draws K distinct experts per token with
    probability proportional to popularity (the Gumbel-top-k trick); weights are the top-k
    softmax scores, as for "uniform".
    """
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "uniform":
        logits = torch.randn(T, E, generator=g, device=device)
    elif kind == "zipf":
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float32, device=device) ** 1.1
        pop = pop[torch.randperm(E, generator=g, device=device)]
        u = torch.rand(T, E, generator=g, device=device).clamp_(1e-20, 1.0)
        logits = pop.log() - torch.log(-torch.log(u))
    else:
        raise ValueError(f"unknown routing {kind!r}: use 'uniform' or 'zipf'")
    w, idx = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
    return idx.contiguous(), w.float().contiguous()


def make_weights(E, H, I, seed, device, rank=0, ep=1):
    """This rank's slice (experts [rank*El, (rank+1)*El)) of seeded global weights: every expert
    has its own seed, so every EP layout sees the same numbers. bf16, w13 [El,2I,H], w2 [El,H,I]."""
    El = E // ep
    g = torch.Generator(device=device)
    w13 = torch.empty(El, 2 * I, H, device=device, dtype=torch.bfloat16)
    w2 = torch.empty(El, H, I, device=device, dtype=torch.bfloat16)
    for le in range(El):
        g.manual_seed(seed * 100_003 + rank * El + le)
        w13[le] = torch.randn(2 * I, H, generator=g, device=device) * H ** -0.5
        w2[le] = torch.randn(H, I, generator=g, device=device) * I ** -0.5
    return w13, w2


def make_shared_weights(S, H, Is, seed, device):
    """S shared experts' seeded weights, the same on every rank (they are replicated under EP): bf16 shared_w13
    [S, 2Is, H] (gate rows, then up rows, as w13) and shared_w2 [S, H, Is], scaled as make_weights' experts. Their
    generator seeds count down from seed * 100_003 + 100_002, apart from every routed expert's (seed * 100_003 +
    expert) below 100_003 - S experts (the CPU generator keeps a seed's low 32 bits only: no offset above them)."""
    g = torch.Generator(device=device)
    w13 = torch.empty(S, 2 * Is, H, device=device, dtype=torch.bfloat16)
    w2 = torch.empty(S, H, Is, device=device, dtype=torch.bfloat16)
    for s in range(S):
        g.manual_seed(seed * 100_003 + 100_002 - s)
        w13[s] = torch.randn(2 * Is, H, generator=g, device=device) * H ** -0.5
        w2[s] = torch.randn(H, Is, generator=g, device=device) * Is ** -0.5
    return w13, w2


def make_tokens(T, E, H, K, routing, seed, device, rank=0):
    """This rank's x [T,H] bf16, topk_idx, topk_weights and dy [T,H] bf16 (fresh random, seeded)."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    idx, w = make_routing(T, E, K, routing, seed * 1000 + 17 + rank, device)
    return x, idx, w, dy


# ------------------------------------------------------------------------------------------------
# the TorchTitan-style baseline: argsort, gather, torch._grouped_mm, SwiGLU, weights in bf16 after
# L2, index_add; all_to_all over the group for EP
# ------------------------------------------------------------------------------------------------


def _a2a(t, out_splits, in_splits, group):
    """Differentiable all-to-all of rows (its backward is the reverse all-to-all)."""
    import torch.distributed._functional_collectives as fc

    out = fc.all_to_all_single_autograd(t.contiguous(), out_splits, in_splits, group)
    return fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out


def torch_moe(x, topk_idx, topk_weights, w13, w2, group=None):
    """The baseline layer (what a TorchTitan MoE layer runs on one rank). Differentiable in x, topk_weights, w13, w2."""
    T, K = topk_idx.shape
    El, twoI, H = w13.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    xs = x[tok]
    if group is None:
        counts = torch.bincount(flat, minlength=El)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
        g, u = h[:, : twoI // 2], h[:, twoI // 2 :]
        o = torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    else:
        R = torch.distributed.get_world_size(group)
        E = El * R
        counts = torch.bincount(flat, minlength=E)  # [E] routes of this rank per global expert
        recv_counts = torch.empty_like(counts)
        torch.distributed.all_to_all_single(recv_counts, counts, group=group)  # [R*El]: (src, local e)
        send_splits = counts.view(R, El).sum(1).tolist()
        recv_splits = recv_counts.view(R, El).sum(1).tolist()
        xr = _a2a(xs, recv_splits, send_splits, group)
        # rows arrive grouped by (source rank, local expert): regroup by local expert
        le = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(R), recv_counts)
        perm = torch.argsort(le, stable=True)
        offs = torch.cumsum(recv_counts.view(R, El).sum(0), 0).to(torch.int32)
        h = torch._grouped_mm(xr[perm], w13.transpose(-2, -1), offs=offs)
        g, u = h[:, : twoI // 2], h[:, twoI // 2 :]
        op = torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=x.device)
        o = _a2a(op[inv], send_splits, recv_splits, group)
    o = o * topk_weights.reshape(-1)[order].to(torch.bfloat16).unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, o)


def torch_shared_experts(x, shared_w13, shared_w2):
    """The shared experts as a trainer without our kernels runs them beside torch_moe: one dense SwiGLU MLP per
    shared expert s, y_s = (silu(x Wg_s^T) * (x Wu_s^T)) W2_s^T, every token through each (weight 1), bf16 matmuls.
    x [T, H]; shared_w13 [S, 2Is, H] (gate rows [0, Is), up rows [Is, 2Is)); shared_w2 [S, H, Is]. Returns the sum
    of the y_s, added in bf16 one expert at a time (prime_kernels sums in fp32 and rounds once: shared.py's S2).
    Gate and up are one product over the 2Is rows, as a fused gate_up projection runs them: the same FLOPs as two,
    and no slower. Local to the rank under EP (shared experts are replicated: no exchange)."""
    Is = shared_w2.shape[-1]
    y = None
    for s in range(shared_w13.shape[0]):
        h = x @ shared_w13[s].t()
        o = (F.silu(h[:, :Is]) * h[:, Is:]) @ shared_w2[s].t()
        y = o if y is None else y + o
    return y


# ------------------------------------------------------------------------------------------------
# the FP8 torch baseline: torch_moe's glue with every expert GEMM (forward, dgrad and wgrad) in e4m3 through
# torch._scaled_grouped_mm with rowwise fp32 scales (torchao's FP8-rowwise grouped-GEMM recipe, in eager torch)
# ------------------------------------------------------------------------------------------------

E4M3_MAX = 448.0
FP8_GROUP_ALIGN = 16  # rows per expert group are padded to a multiple of this (the FP8 wgrad's requirement)
FP8_FAST_ACCUM = True  # as torchao's FP8-rowwise grouped GEMM calls it (TorchTitan's FP8 MoE path)


def _fp8_quant(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 data of ``x`` (same shape and memory layout) and fp32 scales amax/448 over ``dim`` (that dim dropped):
    x ~= data * scale."""
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp_min(1e-12)
    s = amax / E4M3_MAX
    q = (x.float() / s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s.squeeze(dim)


def _fp8_quant_token_groups(x: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 data of ``x`` [P, C] (row-major) and fp32 scales [G, C]: one per (group, column), amax/448 over the
    group's rows (the groups of ``offs``, cumulative row ends). Every group boundary must be a multiple of
    FP8_GROUP_ALIGN and offs[-1] == P: the amax runs over 16-row blocks first, each inside one group."""
    P, C = x.shape
    A = FP8_GROUP_ALIGN
    G = offs.numel()
    blocks = x.abs().view(P // A, A, C).amax(1).float()  # [P/A, C]
    bid = torch.searchsorted(offs, torch.arange(0, P, A, device=x.device, dtype=offs.dtype), right=True)
    amax = torch.zeros(G, C, device=x.device, dtype=torch.float32)
    amax.scatter_reduce_(0, bid.long().unsqueeze(1).expand(-1, C), blocks, "amax", include_self=True)
    s = amax.clamp_min_(1e-12) / E4M3_MAX  # [G, C]
    q = (x.float().view(P // A, A, C) / s[bid].unsqueeze(1)).clamp_(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(P, C), s


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dims column-major (a no-op when they are)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _check_fp8_gmm_args(a, b, scale_a, scale_b, offs):
    """On the CPU (no _scaled_grouped_mm kernel): the exact arguments through torch's meta registration of
    _scaled_grouped_mm (dtypes, row-/column-major, 16-byte strides, scale shapes, offs), plus what only the CUDA
    op checks: trailing dims % 16 and, for 2d x 2d, every group's rows along K % 16 with offs[-1] == K."""
    m = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
    torch._scaled_grouped_mm(m(a), m(b), m(scale_a), m(scale_b), offs=m(offs), out_dtype=torch.bfloat16,
                             use_fast_accum=FP8_FAST_ACCUM)
    if a.size(-1) % 16 or b.size(-2) % 16 or b.size(-1) % 16:
        raise ValueError(f"_scaled_grouped_mm needs a's last dim and b's last two dims % 16: {a.shape} {b.shape}")
    if a.dim() == 2 and b.dim() == 2:
        ends = offs.tolist()
        sizes = [e - s for s, e in zip([0] + ends[:-1], ends)]
        if ends[-1] != a.size(1) or any(n < 0 or n % 16 for n in sizes):
            raise ValueError(f"2d x 2d _scaled_grouped_mm: group sizes along K must be multiples of 16 ending at "
                             f"K={a.size(1)}: {sizes}")


def _scaled_gmm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=bf16) on CUDA (sm90+); elsewhere the
    same product emulated in float32 from the same e4m3 data and scales, after the arguments are checked against
    the op's contract (_check_fp8_gmm_args).

    2d x 3d: a [P, K] e4m3 row-major, b [G, K, N] e4m3 column-major, scale_a [P], scale_b [G, N], offs [G] int32
    cumulative row ends; out [P, N], out[rows of g] = (a * scale_a[:, None])[rows] @ (b[g] * scale_b[g]).
    2d x 2d: a [M, Ktot] row-major, b [Ktot, N] column-major, groups along Ktot, scale_a [G*M], scale_b [G*N]
    (group-major); out [G, M, N], out[g] = (a[:, cols_g] * scale_a[g]) @ (b[cols_g] * scale_b[g])."""
    if a.device.type == "cuda":
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=FP8_FAST_ACCUM)
    _check_fp8_gmm_args(a, b, scale_a, scale_b, offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    af = a.float()
    bf = b.float()
    if b.dim() == 3:
        af = af * scale_a.unsqueeze(1)
        bf = bf * scale_b.unsqueeze(1)
        out = torch.zeros(a.size(0), b.size(-1), dtype=torch.float32, device=a.device)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = af[s:e] @ bf[g]
        return out.to(torch.bfloat16)
    G, M, N = len(ends), a.size(0), b.size(1)
    sa, sb = scale_a.view(G, M), scale_b.view(G, N)
    out = torch.stack([(af[:, s:e] * sa[g].unsqueeze(1)) @ (bf[s:e] * sb[g])
                       for g, (s, e) in enumerate(zip(starts, ends))])
    return out.to(torch.bfloat16)


class _Fp8GroupedMM(torch.autograd.Function):
    """out[rows of group g] = a[rows] @ b[g] with every GEMM in e4m3 (rowwise fp32 scales, bf16 out, fp32
    accumulation; use_fast_accum=FP8_FAST_ACCUM) through torch._scaled_grouped_mm (_scaled_gmm):

    a [P, K] bf16, b [G, K, N] bf16 (any strides, e.g. w13.transpose(-2, -1)), offs [G] int32 cumulative row ends
    with every group's row count a multiple of FP8_GROUP_ALIGN and offs[-1] == P (the 2d x 2d wgrad's TMA needs
    16-byte group starts along the token axis; torch_fp8_moe pads its groups so).

    forward  out = a_q @ b_q: a one scale per row (amax over K), b one per (group, output column) (amax over K).
    backward dA = dout_q @ (b^T)_q: dout one scale per row (over N), b^T one per (group, column k) (over N);
             dB[g] = (dout[rows_g]^T @ a[rows_g])^T in the 2d x 2d (k-grouped) form, offs along the tokens:
             dout^T one scale per (group, column n), a one per (group, column k), each the amax over the group's
             rows (so dB is an FP8 GEMM too; it comes back as the transpose of a [G, N, K] product, so
             w13.grad / w2.grad are laid out like w13 / w2).
    The bf16 a and b are saved; the backward quantizes them again in the layouts it needs."""

    @staticmethod
    def forward(ctx, a, b, offs):
        a_q, a_s = _fp8_quant(a, -1)  # [P, K] row-major, [P]
        b_q, b_s = _fp8_quant(b, -2)  # [G, K, N], [G, N]
        out = _scaled_gmm(_row_major(a_q), _col_major(b_q), a_s, b_s.contiguous(), offs)
        ctx.save_for_backward(a, b, offs)
        return out

    @staticmethod
    def backward(ctx, dout):
        a, b, offs = ctx.saved_tensors
        dout = dout.contiguous()
        d_a = d_b = None
        if ctx.needs_input_grad[0]:
            g_q, g_s = _fp8_quant(dout, -1)  # [P, N], [P]
            bt_q, bt_s = _fp8_quant(b, -1)  # b^T [G, N, K] quantized per (g, k) over N: scales [G, K]
            d_a = _scaled_gmm(_row_major(g_q), _row_major(bt_q).transpose(-2, -1), g_s, bt_s.contiguous(), offs)
        if ctx.needs_input_grad[1]:
            g_q, g_s = _fp8_quant_token_groups(dout, offs)  # [P, N], [G, N]
            a_q, a_s = _fp8_quant_token_groups(a.contiguous(), offs)  # [P, K], [G, K]
            d_bt = _scaled_gmm(g_q.t().contiguous(), _col_major(a_q), g_s.reshape(-1), a_s.reshape(-1), offs)
            d_b = d_bt.transpose(-2, -1)  # [G, N, K] -> [G, K, N]
        return d_a, d_b, None


def fp8_grouped_mm(a, b, offs):
    """_Fp8GroupedMM.apply(a, b, offs): the FP8 counterpart of torch._grouped_mm(a, b, offs=offs)."""
    return _Fp8GroupedMM.apply(a, b, offs)


def torch_fp8_moe(x, topk_idx, topk_weights, w13, w2, group=None):
    """torch_moe with FP8 expert GEMMs: argsort by expert, gather, _Fp8GroupedMM for L1 and L2 (forward, dgrad and
    wgrad all e4m3 with rowwise fp32 scales through torch._scaled_grouped_mm), SwiGLU, bf16 weights after L2,
    index_add combine. Single rank only. Differentiable in x, topk_weights, w13, w2.

    Each expert's rows are padded with zero rows to a multiple of FP8_GROUP_ALIGN (at least one block, also for an
    expert with no routes), as TorchTitan pads token groups for FP8 grouped GEMMs: the 2d x 2d FP8 weight-gradient
    GEMM needs every group's start along the token axis 16-byte aligned. Padding rows are zero through L1, SwiGLU and
    L2 and carry zero gradient, so they change no result; the padded row count is read on the host (one sync, as
    torch_moe's bincount on CUDA has). Quantization is eager torch (amax, divide, cast per operand and call), part
    of what this baseline times."""
    if group is not None:
        raise ValueError("torch_fp8_moe (backend torch_fp8) runs on a single rank only: group must be None")
    T, K = topk_idx.shape
    El, twoI, H = w13.shape
    A = FP8_GROUP_ALIGN
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=El)
    padded = ((counts + A - 1) // A).clamp_min(1) * A
    ends = torch.cumsum(padded, 0)
    P_pad = int(ends[-1])
    offs = ends.to(torch.int32)
    e_sorted = flat[order]
    rank_in_expert = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    dest = (ends - padded)[e_sorted] + rank_in_expert  # padded row of each sorted route
    tok_pad = torch.full((P_pad,), T, dtype=tok.dtype, device=x.device).index_put((dest,), tok)  # T: a zero row
    w_pad = torch.zeros(P_pad, dtype=torch.bfloat16, device=x.device).index_put(
        (dest,), topk_weights.reshape(-1)[order].to(torch.bfloat16))
    xs = torch.cat([x, x.new_zeros(1, H)])[tok_pad]
    h = fp8_grouped_mm(xs, w13.transpose(-2, -1), offs)
    g, u = h[:, : twoI // 2], h[:, twoI // 2 :]
    o = fp8_grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs)
    o = o * w_pad.unsqueeze(1)
    return x.new_zeros(T + 1, H).index_add(0, tok_pad, o)[:T]


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, device, warmup: int, iters: int) -> float:
    """Wall-clock ms per call of ``fn`` over ``iters`` calls after ``warmup``, host work included (synchronised
    before and after the batch): for paths whose host work is part of their cost."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def time_ms(fn, device, warmup=5, iters=20) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (CUDA events on
    the GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if torch.device(device).type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sustained_ms(fn, device, seconds: float, iters: int = 10) -> float:
    """Mean milliseconds of ``fn()`` over ``iters`` back-to-back calls (one timer pair), after ``seconds`` of
    back-to-back calls: the steady state of a training loop, at the clock the GPU settles at under its power
    limit (an H200 runs our kernels at its 700 W cap within ~100 ms: docs/performance.md), where time_ms's
    short bursts see a higher clock."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(iters):
            fn()
        sync(device)
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t1 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t1) * 1e3 / iters


class EnergyCounter:
    """Millijoules the board has consumed since the driver loaded (NVML's total energy counter)."""

    def __init__(self, device_index: int):
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self._lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        self._handle = ctypes.c_void_p()
        if self._lib.nvmlDeviceGetHandleByIndex_v2(device_index, ctypes.byref(self._handle)) != 0:
            raise RuntimeError(f"no NVML handle for device {device_index}")

    @classmethod
    def for_current_device(cls) -> "EnergyCounter":
        dev = torch.cuda.current_device()
        get_index = getattr(torch.cuda, "_get_nvml_device_index", None)  # CUDA_VISIBLE_DEVICES -> NVML index
        return cls(get_index(dev) if get_index is not None else dev)

    def mj(self) -> int:
        v = ctypes.c_ulonglong()
        rc = self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(v))
        if rc != 0:
            raise RuntimeError(f"nvmlDeviceGetTotalEnergyConsumption returned {rc}")
        return v.value


def energy_per_call(fn, counter: EnergyCounter, seconds: float, chunk: int = 10) -> tuple[float, float, float]:
    """(joules per call, ms per call, mean watts) of ``fn`` over about ``seconds`` of back-to-back calls. At a
    power cap a call's steady-state time is about its energy over the capped power, so J per call is what a
    change must lower to move a steady-state figure. The counter covers the whole board (idle power included)
    and is read after a synchronize, so chunks are long to keep host gaps small."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, t0, n = counter.mj(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(chunk):
            fn()
        n += chunk
        torch.cuda.synchronize()
    dt, de = time.perf_counter() - t0, (counter.mj() - e0) / 1e3
    return de / n, dt * 1e3 / n, de / dt


def peak_mem_gib(fn, device):
    """Peak allocated GiB while running ``fn`` once (reset_peak_memory_stats first); None on CPU."""
    return peak_and_added_mem_gib(fn, device)[0]


def peak_and_added_mem_gib(fn, device):
    """(peak allocated GiB while running ``fn`` once, that peak less what was allocated just before: the memory the
    call itself added, apart from what stays resident between calls, e.g. the weights and an FP8 weight cache);
    (None, None) on CPU."""
    if torch.device(device).type != "cuda":
        fn()
        return None, None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak / 2 ** 30, (peak - before) / 2 ** 30


def bf16_peak_tflops(device, n=8192, warmup=5, iters=20) -> float:
    """bf16 matmul throughput of an n^3 product in this run (the % of peak denominator)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(a, b), device, warmup, iters)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def fp8_peak_tflops(device, n=8192, warmup=5, iters=20) -> float | None:
    """e4m3 matmul throughput of an n^3 torch._scaled_mm with rowwise scales in this run (the FP8 rows' % of peak
    denominator); None off CUDA (no FP8 matmul to time)."""
    if torch.device(device).type != "cuda":
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    ms = time_ms(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16), device, warmup, iters)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def dense_gemm_calls(P: int, H: int, I: int, device) -> dict:
    """{"fwd": fn, "bwd": fn}: the layer's useful GEMM FLOPs as dense cuBLAS products (torch.mm into
    preallocated outputs) on bf16 operands of the layer's sizes, P = routed rows. No routing, ragged groups,
    SwiGLU or combine, so no routed layer can be faster on the same FLOPs.

    fwd: L1 X[P,H] @ W1[H,2I], then L2 S[P,I] @ W2[I,H] (6 P H I FLOPs, layer_flops' fwd).
    bwd: the dgrad and wgrad of both: dS = dO @ W2^T, dW2 = S^T @ dO, dX = dHm @ W1^T, dW1 = X^T @ dHm
    (12 P H I, layer_flops' bwd); each wgrad reduces over all P rows at once, as one expert with every row."""
    g = torch.Generator(device=device).manual_seed(P)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    x, s, d_o, d_h = rnd(P, H), rnd(P, I), rnd(P, H), rnd(P, 2 * I)  # random, never zeros (zeros run faster)
    w1, w2 = rnd(H, 2 * I), rnd(I, H)
    h_out, o_out, ds_out, dx_out = (torch.empty(r, c, device=device, dtype=torch.bfloat16)
                                    for r, c in ((P, 2 * I), (P, H), (P, I), (P, H)))
    dw1_out, dw2_out = torch.empty_like(w1), torch.empty_like(w2)

    def fwd():
        torch.mm(x, w1, out=h_out)
        torch.mm(s, w2, out=o_out)

    def bwd():
        torch.mm(d_o, w2.t(), out=ds_out)
        torch.mm(s.t(), d_o, out=dw2_out)
        torch.mm(d_h, w1.t(), out=dx_out)
        torch.mm(x.t(), d_h, out=dw1_out)

    return {"fwd": fwd, "bwd": bwd}


def dense_gemm_ms(P: int, H: int, I: int, device, warmup=5, iters=20) -> dict:
    """{"fwd": ms, "bwd": ms} of dense_gemm_calls, timed by time_ms."""
    return {k: time_ms(fn, device, warmup, iters) for k, fn in dense_gemm_calls(P, H, I, device).items()}


def copy_gbps(device, mib: int = 1024, warmup=5, iters=20) -> float:
    """Device memory bandwidth in GB/s of one large tensor copy (bytes read + bytes written over its time):
    the rate at which a backward can at best write its weight gradients."""
    n = mib * 2 ** 20
    src = torch.ones(n, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup, iters)
    return 2 * n / (ms * 1e-3) / 1e9


def layer_flops(routes: int, H: int, I: int, direction: str) -> float:
    """Useful FLOPs of unmasked routes: 6*P*H*I forward (with or without grad: fwd, infer), 12*P*H*I backward
    (never recompute)."""
    fwd = 6.0 * routes * H * I
    return {"fwd": fwd, "infer": fwd, "bwd": 2 * fwd, "fwdbwd": 3 * fwd}[direction]


def rel_err(out, ref, chunk: int = 1 << 26) -> float:
    """||out - ref|| / ||ref|| in float64 (||out - ref|| where ref is 0), a chunk of elements at a time: a 235B
    layer's weight gradient in float64 is 12 GiB, which the whole-tensor form allocated three times over."""
    out, ref = out.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for i in range(0, ref.numel(), chunk):
        r = ref[i:i + chunk].double()
        num += (out[i:i + chunk].double() - r).square().sum().item()
        den += r.square().sum().item()
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


# ------------------------------------------------------------------------------------------------
# provenance and output
# ------------------------------------------------------------------------------------------------


def git_sha() -> str:
    """The commit the measured kernels were built from: the wheel's build record when it has one (the
    device machine gets a copy of the tree whose .git may be stale), else this checkout's HEAD
    (+ "-dirty" with uncommitted changes)."""
    try:
        import prime_kernels  # noqa: PLC0415

        sha = prime_kernels.build_info().get("git_sha") or ""
        if sha and sha != "unknown":
            return sha
    except Exception:
        pass
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def run_header(device, peak) -> dict:
    cuda = torch.device(device).type == "cuda"
    _, ws = world()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "num_gpus": ws if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_sha": git_sha(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "peak_bf16_tflops": round(peak, 2),
    }


def write_results(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def default_results_path(prefix: str, header: dict) -> Path:
    gpu = header["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stamp = header["date"].replace(":", "").replace("-", "")
    return RESULTS_DIR / f"{prefix}_{gpu}_x{max(1, header['num_gpus'])}_{stamp}.json"


def format_table(rows: list[dict]) -> str:
    cols = [("shape", "{}"), ("tokens", "{}"), ("ep", "{}"), ("routing", "{}"), ("backend", "{}"),
            ("direction", "{}"), ("ms", "{:.3f}"), ("tflops", "{:.1f}"), ("pct_peak", "{:.1f}"),
            ("ratio_vs_torch", "{:.2f}"), ("peak_mem_gib", "{:.2f}"), ("added_mem_gib", "{:.2f}"),
            ("max_rel_err", "{:.2e}")]
    if any(r.get("pct_peak_fp8") is not None for r in rows):
        cols[9:9] = [("pct_peak_fp8", "{:.1f}")]
    if any("ms_sustained" in r for r in rows):
        cols[7:7] = [("ms_sustained", "{:.3f}"), ("ratio_sustained", "{:.2f}")]
    if any("floor_ms" in r for r in rows):
        at = [c for c, _ in cols].index("ratio_vs_torch") + 1
        cols[at:at] = [("floor_ms", "{:.3f}"), ("ms_over_floor", "{:.2f}")]
    if any(r.get("shared_experts") for r in rows):
        cols[5:5] = [("shared_experts", "{}"), ("shared_intermediate", "{}")]
    if any(r.get("skipped") for r in rows):
        cols.append(("skipped", "{}"))
    cells = [[c for c, _ in cols]]
    for r in rows:
        cells.append([("-" if r.get(c) is None else " ".join(f.format(r[c]).split())) for c, f in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
