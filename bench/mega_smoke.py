#!/usr/bin/env python3
"""Quick device check of the fused forward: a small problem against float64, then the two layer shapes
timed against the grouped pipeline (one short table). Development aid; bench_layer.py is the benchmark."""

import sys
import time

import torch

sys.path.insert(0, "tests")
from mega_helpers import make_problem, rel_err  # noqa: E402

import deep_gemm  # noqa: E402
from deep_gemm.mega import mega_moe  # noqa: E402

print("status:", deep_gemm.status()["mega_moe.bf16.sm90"], flush=True)
for (T, E, H, I, K) in [(1000, 16, 256, 128, 4)]:
    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(T, H, I, E, K, routing="skewed", seed=T, masked_frac=0.05)]
    with torch.no_grad():
        t0 = time.time()
        y = mega_moe(x, idx, w, w13, w2, backend="fused")
        torch.cuda.synchronize()
        g = mega_moe(x, idx, w, w13, w2, backend="grouped")
        r = mega_moe(x.double(), idx, w.double(), w13.double(), w2.double(), backend="reference")
    print(f"T={T} E={E} H={H} I={I}: fused err {rel_err(y, r):.3e} grouped err {rel_err(g, r):.3e} "
          f"equal={torch.equal(y, g)} finite={bool(torch.isfinite(y).all())} ({time.time() - t0:.2f}s)", flush=True)

def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(iters):
        ev[0].record(); fn(); ev[1].record(); torch.cuda.synchronize()
        ts.append(ev[0].elapsed_time(ev[1]))
    ts.sort()
    return ts[len(ts) // 2]

for name, (E, H, I, K) in {"30B": (128, 2048, 768, 8), "235B": (128, 4096, 1536, 8)}.items():
    T = 16384
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, device="cuda", generator=g) + 0.1
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    flops = 6 * T * K * H * I
    row = []
    with torch.no_grad():
        for be in ("fused", "grouped"):
            ms = bench(lambda: mega_moe(x, idx, w, w13, w2, backend=be))
            row.append(f"{be} {ms:.3f} ms ({flops / ms / 1e9:.0f} TF)")
        from deep_gemm.routing import routing_plan
        plan = routing_plan(idx, E, 1, validate=False)
        src = plan.pool_src_route
        ms = bench(lambda: torch.ops.deep_gemm.mega_moe_fused_fwd(x, src, plan.expert_offsets, w13, w2, K, False, 0.0))
        row.append(f"kernel only {ms:.3f} ms ({flops / ms / 1e9:.0f} TF)")
        ms = bench(lambda: torch.ops.deep_gemm.mega_moe_fused_fwd(x, src, plan.expert_offsets, w13, w2, K, True, 0.0))
        row.append(f"kernel+h {ms:.3f} ms")
    print(name, " | ".join(row), flush=True)
