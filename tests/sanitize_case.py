#!/usr/bin/env python3
"""The small workload that ci/sanitize.sh runs under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    python3 tests/sanitize_case.py [--part all|layer|ops|dgrad]

layer: the layer forward + backward with backend="auto" (the fused forward where status() has it, the grouped
backward) at E=8, H=256, I=128, T=300, K=2, ~10% of the routes masked; then a no-grad forward (nothing saved for
a backward) and, where the fused forward exists, a clamped one. ops: every raw op on groups that include an empty
one and sizes that are not multiples of 128 rows (77, 0, 200, 1, 130): the m-grouped GEMMs (nt, nn, nt with
gathered rows, SwiGLU L1 with and without gathered rows, the SwiGLU backward L2 with and without a dy gather),
the k-grouped GEMM (fp32 and bf16 out, and accumulating), combine (with and without weights), dispatch_rows_,
the FP8 producers (dispatch_rows_fp8_, quantize_tokens_fp8_), swiglu_fwd and swiglu_bwd, routing_plan, and the
dgrad part. dgrad (also on its own: --part dgrad): the fused backward kernel without and with its weight-gradient
tiles (prime_kernels.mega._fused_bwd.dgrad and dgrad_wgrad) on those ragged groups with every SM and with 3 CTAs,
and on 128-row groups with padding rows with I % 128 = H % 128 = 64; on its own it fails where the kernel cannot run, inside the ops part
it is skipped with the reason. dgrad_fp8 (also inside the ops part): the fused FP8 dgrad kernel
(prime_kernels.swiglu_bwd_fp8.mega_moe_fp8_dgrad_fused) on 128-row groups (an empty one, padding rows, a last
partial group) with every SM and with 3 CTAs, each output bit for bit the two-launch pipeline's.

Every group of the m-grouped calls covers the whole M so that every output row is written: reading rows a kernel
leaves unspecified would be this script's uninitialised read, not the library's. Results are compared with the
CPU references loosely (the point is that the work really ran, not the numerics, which other tests check). The
last line, "sanitize_case: done", tells ci/sanitize.sh that the run finished.
"""

from __future__ import annotations

import argparse
import sys

import torch

SIZES = (77, 0, 200, 1, 130)  # an empty group, and none a multiple of 128 rows


def _offsets(sizes, device):
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return torch.tensor(offs, dtype=torch.int32, device=device)


READBACK = True


def _close(name, got, ref, tol=3e-2):
    # With --no-readback (initcheck) nothing is compared: initcheck does not see TMA stores and would report this
    # script's own copy of every TMA-stored output (ci/sanitize.sh); the other tools' runs compare.
    if not READBACK:
        return
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    den = ref.norm().item()
    err = (got - ref).norm().item() / (den if den > 0 else 1.0)
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol}")


DEVICE = "cuda"


def _done(name):
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"[case] {name} ok", flush=True)


def layer_part():
    from prime_kernels.mega import mega_moe
    from prime_kernels.mega._backend import _fused_reason

    E, H, I, T, K = 8, 256, 128, 300, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.1] = -1
    w = torch.rand(T, K, generator=g) + 0.1
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    x, idx, w, w13, w2, dy = (t.to(DEVICE) for t in (x, idx, w, w13, w2, dy))
    auto = "auto" if DEVICE == "cuda" else "reference"  # the CPU dry run has no kernel backend
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend=auto)
    grads = torch.autograd.grad(y, leaves, dy)
    # the reference on the CPU: on the GPU its cuBLAS calls would be sanitized too, and reported as ours
    ref = [t.detach().cpu().requires_grad_() for t in (x, w, w13, w2)]
    y_ref = mega_moe(ref[0], idx.cpu(), ref[1], ref[2], ref[3], backend="reference")
    g_ref = torch.autograd.grad(y_ref, ref, dy.cpu())
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), (y, *grads), (y_ref, *g_ref)):
        _close(f"layer {name}", a, b)
    _done("layer fwd+bwd (auto)")
    with torch.no_grad():
        y2 = mega_moe(x, idx, w, w13, w2, backend=auto)
    _close("layer no-grad y", y2, y_ref)
    _done("layer fwd no_grad (auto)")
    if DEVICE == "cuda" and _fused_reason("bf16", "fwd") is None:
        with torch.no_grad():
            yc = mega_moe(x, idx, w, w13, w2, backend="fused", activation_clamp=0.5)
            yc_ref = mega_moe(*(t.cpu() for t in (x, idx, w, w13, w2)), backend="reference", activation_clamp=0.5)
        _close("layer clamped y", yc, yc_ref)
        _done("layer fwd clamp=0.5 (fused)")


def _close_swiglu_bwd(name, got, dy_pool, w2, offs, h, route, topk_weights):
    """(dh, w * s, dt_part) of an L2 dgrad with the SwiGLU backward against the CPU references."""
    from prime_kernels import grouped_gemm as gg
    from prime_kernels.swiglu import swiglu_bwd_reference

    dh, aw, dt_part = got
    da = gg.m_grouped_gemm_reference(dy_pool.cpu(), w2.cpu(), offs.cpu(), False, torch.float32, round_output=False)
    dh_ref, aw_ref, dt_ref = swiglu_bwd_reference(h.cpu(), da, route.cpu(), topk_weights.cpu(),
                                                  torch.tensor([dy_pool.shape[0]], dtype=torch.int32))
    _close(f"{name} dh", dh, dh_ref)
    _close(f"{name} w*s", aw, aw_ref)
    _close(f"{name} dt", dt_part.cpu().sum(1), dt_ref)


def ops_part():
    import prime_kernels
    from prime_kernels import grouped_gemm as gg
    from prime_kernels.combine import combine_reference
    from prime_kernels.swiglu import swiglu_bwd, swiglu_bwd_reference, swiglu_fwd, swiglu_fwd_reference

    dev = DEVICE
    G, M = len(SIZES), sum(SIZES)
    offs = _offsets(SIZES, dev)
    g = torch.Generator().manual_seed(1)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16().to(dev)

    Kd, N = 256, 256
    a = rnd(M, Kd)
    b_nt = rnd(G, N, Kd, scale=Kd ** -0.5)
    _close("m_grouped nt", gg.m_grouped_bf16_gemm_nt(a, b_nt, offs),
           gg.m_grouped_gemm_reference(a.cpu(), b_nt.cpu(), offs.cpu(), True))
    _done("m_grouped_bf16_gemm_nt")
    b_nn = rnd(G, Kd, N, scale=Kd ** -0.5)
    _close("m_grouped nn", gg.m_grouped_bf16_gemm_nn(a, b_nn, offs),
           gg.m_grouped_gemm_reference(a.cpu(), b_nn.cpu(), offs.cpu(), False))
    _done("m_grouped_bf16_gemm_nn")

    # gathered rows: a source of Ts rows, every pool row names one of them or -1 (a zero row)
    Ts = 150
    src = rnd(Ts, Kd)
    row_index = torch.randint(0, Ts, (M,), generator=g, dtype=torch.int32)
    row_index[torch.rand(M, generator=g) < 0.1] = -1
    row_index = row_index.to(dev)
    gathered = torch.where((row_index >= 0)[:, None].cpu(), src.cpu()[row_index.cpu().clamp(min=0).long()],
                           torch.zeros((), dtype=torch.bfloat16))
    _close("m_grouped nt gather", gg.m_grouped_bf16_gemm_nt(src, b_nt, offs, a_row_index=row_index, m_total=M),
           gg.m_grouped_gemm_reference(gathered, b_nt.cpu(), offs.cpu(), True))
    _done("m_grouped_bf16_gemm_nt_gather")

    H, I = 256, 128
    w13 = rnd(G, 2 * I, H, scale=H ** -0.5)
    w2 = rnd(G, H, I, scale=I ** -0.5)
    xs = rnd(M, H)
    s, h = gg.m_grouped_bf16_gemm_swiglu(xs, w13, offs, save_h=True)
    h_ref = gg.m_grouped_gemm_reference(xs.cpu(), w13.cpu(), offs.cpu(), True)
    _close("swiglu L1 h", h, h_ref)
    if READBACK:  # the reference reads the kernel's h (TMA-stored): see _close
        _close("swiglu L1 s", s, swiglu_fwd_reference(h.cpu(), torch.tensor([M], dtype=torch.int32)))
    _done("m_grouped_bf16_gemm_swiglu")
    srcx = rnd(Ts, H)
    sg, hg = gg.m_grouped_bf16_gemm_swiglu(srcx, w13, offs, a_row_index=row_index, m_total=M, save_h=True,
                                           clamp=0.5)
    _close("swiglu L1 gather h", hg, gg.m_grouped_bf16_gemm_nt(srcx, w13, offs, a_row_index=row_index, m_total=M))
    _done("m_grouped_bf16_gemm_swiglu (gathered rows, clamp)")

    Tk, Kk = 120, 4
    topk_weights = torch.rand(Tk, Kk, generator=g).to(dev)
    route = torch.randint(0, Tk * Kk, (M,), generator=g, dtype=torch.int32)
    route[torch.rand(M, generator=g) < 0.1] = -1
    route = route.to(dev)
    dy_pool = rnd(M, H)
    dh, aw, dt_part = gg.m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offs, h, route, topk_weights)
    if READBACK:  # the reference reads the kernel's h (TMA-stored): see _close
        _close_swiglu_bwd("swiglu bwd", (dh, aw, dt_part), dy_pool, w2, offs, h, route, topk_weights)
    _done("m_grouped_bf16_gemm_swiglu_bwd")

    ka, kb = rnd(M, 128), rnd(M, 256)
    k_ref = gg.k_grouped_gemm_reference(ka.cpu(), kb.cpu(), offs.cpu())
    _close("k_grouped fp32", gg.k_grouped_bf16_gemm_tn(ka, kb, offs), k_ref)
    _close("k_grouped bf16", gg.k_grouped_bf16_gemm_tn(ka, kb, offs, out_dtype=torch.bfloat16), k_ref)
    acc = torch.ones(G, 128, 256, device=dev)
    gg.k_grouped_bf16_gemm_tn(ka, kb, offs, accumulate_into=acc)
    _close("k_grouped accumulate", acc, k_ref + 1)
    _done("k_grouped_bf16_gemm_tn (fp32, bf16, accumulate)")

    # combine / dispatch over a routing plan with padded rows: slots fully written (randn), routes masked ~10%
    E, T, K = 8, 300, 2
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.1] = -1
    plan = prime_kernels.routing_plan(idx.to(dev), num_experts=E, block_m=128)
    r2p = plan.route_to_pool
    slots = rnd(plan.pool_capacity, H)
    wts = torch.rand(T, K, generator=g).to(dev)
    _close("combine weighted", prime_kernels.combine(slots, r2p, wts), combine_reference(slots.cpu(), r2p.cpu(), wts.cpu()))
    _close("combine plain", prime_kernels.combine(slots, r2p), combine_reference(slots.cpu(), r2p.cpu()))
    _done("routing_plan + combine")
    tok = rnd(T, H)
    out = torch.zeros(plan.pool_capacity, H, dtype=torch.bfloat16, device=dev)
    prime_kernels.dispatch_rows(tok, r2p, out)
    _close("dispatch_rows", combine_reference(out.cpu(), r2p.cpu()),
           tok.cpu() * (r2p >= 0).sum(1, keepdim=True).cpu())
    _done("dispatch_rows_")
    # the FP8 producers on the same plan: q of the routed rows (unrouted pool rows stay unwritten, so only the routed
    # ones are read back), and qT of the dispatched pool (padding rows hold zeros here, as the plan's layout says)
    live = r2p >= 0
    q, sa = prime_kernels.dispatch_rows_fp8(tok, r2p, plan.pool_capacity)
    rows = r2p[live].long()
    routed_tok = tok[torch.nonzero(live)[:, 0]]
    _close("dispatch_rows_fp8", q[rows].float() * sa[rows].repeat_interleave(128, 1), routed_tok, tol=7e-2)
    _done("dispatch_rows_fp8_")
    qt, st = prime_kernels.quantize_tokens_fp8(out, plan.expert_offsets, plan.expert_counts)
    _close("quantize_tokens_fp8", (qt.float() * st.repeat_interleave(128, 1)[:, :qt.shape[1]]).t(), out, tol=7e-2)
    _done("quantize_tokens_fp8_")

    hh = rnd(M, 2 * I)
    n = torch.tensor([M], dtype=torch.int32, device=dev)
    _close("swiglu_fwd", swiglu_fwd(hh, n), swiglu_fwd_reference(hh.cpu(), n.cpu()))
    da2 = rnd(M, I)
    got = swiglu_bwd(hh, da2, route, topk_weights, n)
    ref = swiglu_bwd_reference(hh.cpu(), da2.cpu(), route.cpu(), topk_weights.cpu(), n.cpu())
    for name, u, v in zip(("dh", "a", "dt"), got, ref):
        _close(f"swiglu_bwd {name}", u, v)
    _done("swiglu_fwd + swiglu_bwd")


def _dgrad(dy_pool, w13, w2, h, offs, route, tw, num_sms=None):
    """The dgrad kernel's four outputs. The CPU dry run has no kernel: the pipeline's two steps (their CPU
    references) stand in, so that the rest of the part is checked."""
    from prime_kernels import grouped_gemm as gg
    from prime_kernels.mega import _fused_bwd

    if DEVICE == "cpu":
        dh, aw, dt_part = gg.m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offs, h, route, tw)
        return dh, aw, dt_part, gg.m_grouped_bf16_gemm_nn(dh, w13, offs)
    return _fused_bwd.dgrad(dy_pool, w13, w2, h, offs, route, tw, num_sms=num_sms)


def _dgrad_wgrad(dy_pool, x_pool, w13, w2, h, offs, route, tw, num_sms=None):
    """The kernel with its weight-gradient tiles (fp32 out): dh, w * s, dt_part, dx, dw13, dw2; on the CPU dry run
    the pipeline's steps stand in, as in _dgrad."""
    from prime_kernels import grouped_gemm as gg
    from prime_kernels.mega import _fused_bwd

    if DEVICE == "cpu":
        dh, aw, dt_part, dx = _dgrad(dy_pool, w13, w2, h, offs, route, tw)
        return (dh, aw, dt_part, dx, gg.k_grouped_bf16_gemm_tn(dh, x_pool, offs),
                gg.k_grouped_bf16_gemm_tn(dy_pool, aw, offs))
    return _fused_bwd.dgrad_wgrad(dy_pool, x_pool, w13, w2, h, offs, route, tw, wgrad_dtype=torch.float32,
                                  num_sms=num_sms)


def dgrad_part(required: bool):
    from prime_kernels import _status
    from prime_kernels import grouped_gemm as gg
    from prime_kernels.mega import _fused_bwd

    if DEVICE == "cuda":
        why = _status.runnable(_fused_bwd.STATUS_KEY)
        if why != _status.AVAILABLE:
            if required:
                raise RuntimeError(f"{_fused_bwd.STATUS_KEY} cannot run here: {why}")
            print(f"[case] dgrad skipped: {_fused_bwd.STATUS_KEY} cannot run here: {why}", flush=True)
            return
    dev = DEVICE
    g = torch.Generator().manual_seed(2)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16().to(dev)

    Tk, Kk = 120, 4
    tw = torch.rand(Tk, Kk, generator=g).to(dev)
    # (group sizes, H, I, SM caps): the ops part's ragged groups (partial m-blocks, an empty group), then a padded
    # plan's 128-row groups whose last rows are padding (route -1, zero dy rows) with half-width last tiles
    for sizes, H, I, caps, padded in ((SIZES, 256, 128, (None, 3), False), ((128, 0, 256, 128), 320, 192, (None,), True)):
        G, M = len(sizes), sum(sizes)
        offs = _offsets(sizes, dev)
        w13 = rnd(G, 2 * I, H, scale=H ** -0.5)
        w2 = rnd(G, H, I, scale=I ** -0.5)
        h = rnd(M, 2 * I)
        dy_pool = rnd(M, H)
        route = torch.randint(0, Tk * Kk, (M,), generator=g, dtype=torch.int32)
        route[torch.rand(M, generator=g) < 0.1] = -1
        if padded:
            pad = torch.zeros(M, dtype=torch.bool)
            for end in _offsets(sizes, "cpu")[1:].tolist():
                pad[max(0, end - 20):end] = True
            route[pad] = -1
            dy_pool[pad.to(dev)] = 0
        route = route.to(dev)
        for cap in caps:
            dh, aw, dt_part, dx = _dgrad(dy_pool, w13, w2, h, offs, route, tw, num_sms=cap)
            if READBACK:
                _close_swiglu_bwd("dgrad", (dh, aw, dt_part), dy_pool, w2, offs, h, route, tw)
                _close("dgrad dx", dx, gg.m_grouped_gemm_reference(dh.cpu(), w13.cpu(), offs.cpu(), False))
            _done(f"mega_moe_bwd_fused dgrad (groups {list(sizes)}, H={H}, I={I}, num_sms={cap})")
            # the weight-gradient tiles: each expert's rows as K, ragged groups end inside a k-block
            x_pool = rnd(M, H)
            dh, aw, _dt, _dx, dw13, dw2 = _dgrad_wgrad(dy_pool, x_pool, w13, w2, h, offs, route, tw, num_sms=cap)
            if READBACK:
                _close("wgrad dw13", dw13, gg.k_grouped_gemm_reference(dh.cpu(), x_pool.cpu(), offs.cpu()))
                _close("wgrad dw2", dw2, gg.k_grouped_gemm_reference(dy_pool.cpu(), aw.cpu(), offs.cpu()))
            _done(f"mega_moe_bwd_fused wgrad (groups {list(sizes)}, H={H}, I={I}, num_sms={cap})")


def dgrad_fp8_part(required: bool):
    from prime_kernels import _status
    from prime_kernels.grouped_gemm import m_grouped_fp8_gemm_nt
    from prime_kernels.mega import fp8 as _fp8
    from prime_kernels.quantize import dispatch_rows_fp8
    from prime_kernels.swiglu_bwd_fp8 import FUSED_KEY as key
    from prime_kernels.swiglu_bwd_fp8 import m_grouped_fp8_gemm_swiglu_bwd, mega_moe_fp8_dgrad_fused

    if DEVICE != "cuda":
        print("[case] dgrad_fp8 skipped: the fused FP8 dgrad has no CPU kernel of its own", flush=True)
        return
    why = _status.runnable(key)
    if why != _status.AVAILABLE:
        if required:
            raise RuntimeError(f"{key} cannot run here: {why}")
        print(f"[case] dgrad_fp8 skipped: {key} cannot run here: {why}", flush=True)
        return
    g = torch.Generator().manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16().to(DEVICE)

    sizes, H, I, Tk, Kk = (128, 0, 256, 77), 320, 256, 120, 4
    G, M = len(sizes), sum(sizes)
    offs = _offsets(sizes, DEVICE)
    cache = _fp8.Fp8WeightCache()
    w13t = cache.get(rnd(G, 2 * I, H, scale=H ** -0.5)).transposed
    w2t = cache.get(rnd(G, H, I, scale=I ** -0.5)).transposed
    h = rnd(M, 2 * I)
    dy_pool = rnd(M, H)
    tw = torch.rand(Tk, Kk, generator=g).to(DEVICE)
    route = torch.randint(0, Tk * Kk, (M,), generator=g, dtype=torch.int32)
    route[torch.rand(M, generator=g) < 0.1] = -1
    route = route.to(DEVICE)
    dy_q, dy_sa = dispatch_rows_fp8(dy_pool, torch.arange(M, dtype=torch.int32, device=DEVICE)[:, None], M)
    args = (dy_q, dy_sa, w2t.data, w2t.scale, w13t.data, w13t.scale, offs, h, route, tw)
    for cap in (None, 3):
        l2, dx = mega_moe_fp8_dgrad_fused(*args, num_sms=cap or 0)
        if READBACK:
            want = m_grouped_fp8_gemm_swiglu_bwd(dy_q, dy_sa, w2t.data, w2t.scale, offs, h, route, tw)
            want_dx = m_grouped_fp8_gemm_nt(want.dh_q, want.dh_sa, w13t.data, w13t.scale, offs)
            for name, a, b in (("dh_q", l2.dh_q, want.dh_q), ("dh_sa", l2.dh_sa, want.dh_sa),
                               ("dht_q", l2.dht_q, want.dht_q), ("awt_q", l2.awt_q, want.awt_q),
                               ("dt_part", l2.dt_part, want.dt_part), ("dx_pool", dx, want_dx)):
                if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
                    raise AssertionError(f"dgrad_fp8 {name}: differs from the two-launch pipeline")
        _done(f"mega_moe_bwd_fp8 (groups {list(sizes)}, H={H}, I={I}, num_sms={cap})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "layer", "ops", "dgrad", "dgrad_fp8"), default="all")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of this script on the CPU references (no kernel runs)")
    p.add_argument("--no-readback", action="store_true",
                   help="run every op but compare no result (initcheck: see _close)")
    args = p.parse_args(argv)
    global DEVICE, READBACK
    DEVICE = args.device
    READBACK = not args.no_readback
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("sanitize_case: needs a CUDA GPU", file=sys.stderr)
        return 2
    import prime_kernels

    print(f"sanitize_case: prime_kernels from {prime_kernels.__file__}, {prime_kernels.build_info()}", flush=True)
    if args.part in ("all", "layer"):
        layer_part()
    if args.part in ("all", "ops"):
        ops_part()
        dgrad_part(required=False)
        dgrad_fp8_part(required=False)
    if args.part == "dgrad":
        dgrad_part(required=True)
    if args.part == "dgrad_fp8":
        dgrad_fp8_part(required=True)
    print("sanitize_case: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
