"""The FP8 recipe's quantizing producers (prime_kernels.quantize) against the bytes they move and the torch ops that
compute the same: dispatch_rows_fp8 (bf16 token rows -> e4m3 pool rows with 1x128 scales) beside the bf16
dispatch_rows of the same routing (the same reads, twice the written bytes), and quantize_tokens_fp8 (qT of bf16
pool rows -> e4m3 [C, P] with 128-row scales) beside a torch transpose copy of the pool.

The MoE layer's shapes (128 experts, T tokens, top-8): the dispatch of x or dy (H columns), and qT of pool rows of
H columns (x, dy) and of I columns (a = w * s). GB/s counts the bytes each op must read and write (bf16 in,
e4m3 and fp32 scales out); the card's copy rate is measured in the same run. Times are CUDA events, the median of
--reps after 5 warm-ups. --smoke: a tiny shape on the CPU (the host loops), to check that the script runs.

    python bench/bench_quantize_fp8.py [--tokens 16384] [--routing uniform] [--reps 20] [--out FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import bench_common
import prime_kernels


def dispatch_rows(shape, T, H, plan, x, reps, device) -> list[dict]:
    P = plan.pool_capacity
    routes = int((plan.route_to_pool >= 0).sum())
    q = torch.empty(P, H, dtype=torch.float8_e4m3fn, device=device)
    sa = prime_kernels.quantize.k_block_major_empty(P, H // 128, device)
    out = torch.empty(P, H, dtype=torch.bfloat16, device=device)
    read = T * H * 2
    runs = {
        "dispatch_rows_fp8": (lambda: prime_kernels.dispatch_rows_fp8(x, plan.route_to_pool, P, out=(q, sa)),
                              read + routes * (H + H // 128 * 4)),
        "dispatch_rows (bf16)": (lambda: prime_kernels.dispatch_rows(x, plan.route_to_pool, out), read + routes * H * 2),
    }
    return [_row(shape, f"dispatch H={H}", name, fn, nbytes, reps, device) for name, (fn, nbytes) in runs.items()]


def quantize_tokens(shape, C, plan, v, reps, device) -> list[dict]:
    P = v.shape[0]
    live = int(plan.expert_counts.sum())
    q = torch.empty(C, (P + 15) // 16 * 16, dtype=torch.float8_e4m3fn, device=device)[:, :P]
    scale = prime_kernels.quantize.k_block_major_empty(C, (P + 127) // 128, device)
    t = torch.empty(C, P, dtype=torch.bfloat16, device=device)
    runs = {
        "quantize_tokens_fp8": (lambda: prime_kernels.quantize_tokens_fp8(v, plan.expert_offsets, plan.expert_counts,
                                                                         out=(q, scale)),
                                live * C * 2 + P * C + (P + 127) // 128 * C * 4),
        "torch transpose copy (bf16)": (lambda: t.copy_(v.t()), 2 * P * C * 2),
    }
    return [_row(shape, f"qT C={C}", name, fn, nbytes, reps, device) for name, (fn, nbytes) in runs.items()]


def _row(shape, op, backend, fn, nbytes, reps, device) -> dict:
    ms = bench_common.time_ms(fn, device, warmup=5, iters=reps)
    return {"shape": shape, "pass": op, "backend": backend, "ms": round(ms, 4), "bytes": nbytes,
            "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b")
    p.add_argument("--routing", default="uniform")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU; writes no results file")
    a = p.parse_args(argv)
    device = "cpu" if a.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_quantize_fp8: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    shapes = ["smoke"] if a.smoke else a.shapes.split(",")
    tokens = 64 if a.smoke else a.tokens
    rows = []
    for shape in shapes:
        E, H, I, K = bench_common.SHAPES[shape]
        idx, _ = bench_common.make_routing(tokens, E, K, a.routing, a.seed, device)
        plan = prime_kernels.routing_plan(idx, num_experts=E, block_m=128)
        g = torch.Generator(device=device).manual_seed(a.seed)
        x = torch.randn(tokens, H, generator=g, device=device).bfloat16()
        rows += dispatch_rows(shape, tokens, H, plan, x, a.reps, device)
        for C in (H, I):
            v = torch.randn(plan.pool_capacity, C, generator=g, device=device).bfloat16()
            rows += quantize_tokens(shape, C, plan, v, a.reps, device)
    copy = bench_common.copy_gbps(device, mib=16 if a.smoke else 1024)
    for r in rows:
        r.update(tokens=tokens, routing=a.routing)
        print(f"[bench] {r['shape']:16s} {r['pass']:14s} {r['backend']:28s} {r['ms']:8.3f} ms {r['gbps']:7.1f} GB/s")
    print(f"[bench] copy rate {copy:.1f} GB/s")
    if not a.smoke:
        header = bench_common.run_header(device, bench_common.bf16_peak_tflops(device))
        path = Path(a.out) if a.out else bench_common.default_results_path("quantize_fp8", header)
        bench_common.write_results({**header, "copy_gbps": round(copy, 1), "options": vars(a), "rows": rows}, path)
        print(f"[bench] wrote {path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
