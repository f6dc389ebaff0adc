#!/usr/bin/env python3
"""Energy per useful TFLOP of each of the layer's GEMMs, ours against torch._grouped_mm (CUTLASS) on the same
operands, in steady state (`--seconds` of back-to-back calls each, rounds interleaved over the backends).

Why: at the H200's 700 W cap a GEMM's steady-state time is its joules over ~700 W, so J/TFLOP, not burst
milliseconds, says whether a kernel of ours wastes energy that a different tile, schedule or epilogue could
give back (bench/NOTES.md, sessions 11-13). Every group has T*K/E rows (1024 at both layer shapes: the uniform
routing's mean), so both backends get one identical, padding-free problem. The SM clock is NVML's reading at
the end of each measurement (instantaneous, not a mean).

    python bench/energy_kernels.py --shapes qwen3-30b-a3b,qwen3-235b-a22b --seconds 1.5

Development tool: prints a table; --out writes the rows as JSON (results under bench/results/)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from energy_layer import EnergyCounter, measure, print_table, write_energy_results  # noqa: E402

def gemm_calls(E: int, H: int, I: int, rows_per_group: int, g: torch.Generator) -> dict:
    """{gemm: (TFLOP, {backend: fn})} on one set of random operands (never zeros)."""
    import deep_gemm
    from deep_gemm.grouped_gemm import m_grouped_bf16_gemm_swiglu, m_grouped_bf16_gemm_swiglu_bwd

    M = E * rows_per_group
    dev = "cuda"
    starts = torch.arange(0, M + 1, rows_per_group, device=dev, dtype=torch.int32)  # [E + 1]
    ends = starts[1:].contiguous()  # torch._grouped_mm's offs
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g).bfloat16()  # noqa: E731
    x_pool, dy_pool = rnd(M, H), rnd(M, H)
    s, dh, h = rnd(M, I), rnd(M, 2 * I), rnd(M, 2 * I)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).bfloat16()
    src_route = torch.arange(M, device=dev, dtype=torch.int32)
    topk_w = torch.rand(M, device=dev, generator=g)
    gm = torch._grouped_mm
    f1, f2 = 2 * M * H * 2 * I / 1e12, 2 * M * H * I / 1e12
    return {
        "L1 fwd  x@w13^T": (f1, {"ours": lambda: deep_gemm.m_grouped_bf16_gemm_nt(x_pool, w13, starts),
                                 "torch": lambda: gm(x_pool, w13.transpose(-2, -1), offs=ends)}),
        "L1 fwd +SwiGLU,h": (f1, {"ours": lambda: m_grouped_bf16_gemm_swiglu(x_pool, w13, starts, save_h=True)}),
        "L2 fwd  s@w2^T": (f2, {"ours": lambda: deep_gemm.m_grouped_bf16_gemm_nt(s, w2, starts),
                                "torch": lambda: gm(s, w2.transpose(-2, -1), offs=ends)}),
        "L2 dgrad dy@w2": (f2, {"ours": lambda: deep_gemm.m_grouped_bf16_gemm_nn(dy_pool, w2, starts),
                                "torch": lambda: gm(dy_pool, w2, offs=ends)}),
        "L2 dgrad +SwiGLU bwd": (f2, {"ours": lambda: m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, starts, h,
                                                                                     src_route, topk_w)}),
        "L1 dgrad dh@w13": (f1, {"ours": lambda: deep_gemm.m_grouped_bf16_gemm_nn(dh, w13, starts),
                                 "torch": lambda: gm(dh, w13, offs=ends)}),
        "dW2  dy^T@s": (f2, {"ours": lambda: deep_gemm.k_grouped_bf16_gemm_tn(dy_pool, s, starts,
                                                                            out_dtype=torch.bfloat16),
                             "torch": lambda: gm(dy_pool.t(), s, offs=ends)}),
        "dW13 dh^T@x": (f1, {"ours": lambda: deep_gemm.k_grouped_bf16_gemm_tn(dh, x_pool, starts,
                                                                             out_dtype=torch.bfloat16),
                             "torch": lambda: gm(dh.t(), x_pool, offs=ends)}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=1.5, help="per GEMM, backend and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds interleaved over the backends; the median counts")
    ap.add_argument("--only", default="", help="comma list of substrings: run only the GEMMs whose name has one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("energy_kernels: no CUDA device, nothing to measure")
        return
    counter = EnergyCounter.for_current_device()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", generator=g).bfloat16() for _ in range(2))
    rows = []
    for shape in args.shapes.split(","):
        E, H, I, K = bc.SHAPES[shape]
        calls = {"mm 8192^3": (2 * n ** 3 / 1e12, {"torch": lambda: a @ b})}
        calls.update(gemm_calls(E, H, I, args.tokens * K // E, g))
        only = [o for o in args.only.split(",") if o]
        for name, (tflop, fns) in calls.items():
            if only and not any(o in name for o in only):
                continue
            got = {bk: [] for bk in fns}
            for _ in range(args.rounds):
                for bk, fn in fns.items():
                    j, ms, watts = measure(fn, counter, args.seconds, chunk=20)
                    got[bk].append((j, ms, watts, counter.sm_mhz()))
            for bk, vals in got.items():
                j, ms, watts, mhz = (statistics.median(v[i] for v in vals) for i in range(4))
                rows.append({"shape": shape, "tokens": args.tokens, "gemm": name, "backend": bk, "tflop": tflop,
                             "joules": j, "ms": ms, "watts": watts, "sm_mhz": mhz, "j_per_tflop": j / tflop,
                             "tflops": tflop / ms * 1e3})
            torch.cuda.empty_cache()
    print_table(rows, [("shape", "shape", 16, "s"), ("gemm", "gemm", 22, "s"), ("backend", "backend", 7, "s"),
                       ("J/TFLOP", "j_per_tflop", 8, ".3f"), ("TFLOP/s", "tflops", 8, ".1f"), ("ms", "ms", 8, ".3f"),
                       ("W", "watts", 5, ".0f"), ("MHz", "sm_mhz", 5, ".0f")])
    if args.out:
        write_energy_results(args.out, rows, seconds=args.seconds, rounds=args.rounds)


if __name__ == "__main__":
    main()
