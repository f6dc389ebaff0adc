#!/usr/bin/env python3
"""Energy of the layer's building blocks, to split a layer call's joules (bench/energy_layer.py) into tensor work and
memory traffic: J per TFLOP of a dense bf16 matmul (the cuBLAS floor) and J per GB of HBM traffic for a write
(fill_), a read (sum), a copy, our combine and our dispatch_rows, at the Qwen3-30B-A3B pool size (T=16384, top-8,
H=2048: 537 MB of bf16 rows), each over `--seconds` of back-to-back calls. The board's idle power is inside every
figure (the counter covers the whole board): its share is printed as the board's resting W x ms.

    python bench/energy_ops.py --seconds 2

Development tool: prints a table; --out writes the rows as JSON."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from energy_layer import EnergyCounter, measure, print_table, write_energy_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("energy_ops: no CUDA device, nothing to measure")
        return
    import deep_gemm
    from deep_gemm.routing import routing_plan

    counter = EnergyCounter.for_current_device()
    T, K, H, E = 16384, 8, 2048, 128
    P = T * K
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 8192
    a = torch.randn(n, n, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, n, device="cuda", generator=g).bfloat16()
    pool = torch.randn(P, H, device="cuda", generator=g).bfloat16()
    pool2 = torch.empty_like(pool)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :K]
    r2p = routing_plan(idx, E, 1, validate=False).route_to_pool.view(T, K).contiguous()
    wts = torch.rand(T, K, device="cuda", generator=g)
    gb_pool = pool.numel() * 2 / 1e9
    gb_x = x.numel() * 2 / 1e9
    ops = {  # name: (fn, TFLOP, GB moved)
        "mm 8192^3 bf16": (lambda: a @ b, 2 * n ** 3 / 1e12, 0.0),
        "fill_ pool (write)": (lambda: pool2.fill_(1.0), 0.0, gb_pool),
        "sum pool (read)": (lambda: pool.sum(dtype=torch.float32), 0.0, gb_pool),
        "copy pool": (lambda: pool2.copy_(pool), 0.0, 2 * gb_pool),
        "combine (read pool, write y)": (lambda: deep_gemm.combine(pool, r2p, wts), 0.0, gb_pool + gb_x),
        "dispatch_rows (read x, write pool)": (lambda: deep_gemm.dispatch_rows(x, r2p, pool2), 0.0, gb_pool + gb_x),
    }
    torch.cuda.synchronize()
    time.sleep(1.0)  # the board at rest (clocks still up from the allocations), for the idle share
    e0, t0 = counter.mj(), time.perf_counter()
    time.sleep(1.0)
    idle_w = (counter.mj() - e0) / 1e3 / (time.perf_counter() - t0)
    rows = []
    for name, (fn, tflop, gb) in ops.items():
        j, ms, watts = measure(fn, counter, args.seconds, chunk=20)
        rows.append({"op": name, "joules": j, "ms": ms, "watts": watts, "idle_joules": idle_w * ms / 1e3,
                     "j_per_tflop": j / tflop if tflop else None, "j_per_gb": j / gb if gb else None})
    print(f"board at rest: {idle_w:.0f} W")
    print_table(rows, [("op", "op", 36, "s"), ("J/call", "joules", 8, ".4f"), ("idle J", "idle_joules", 7, ".4f"),
                       ("ms", "ms", 8, ".3f"), ("W", "watts", 6, ".0f"), ("J/TFLOP", "j_per_tflop", 8, ".3f"),
                       ("J/GB", "j_per_gb", 7, ".3f")])
    if args.out:
        write_energy_results(args.out, rows, seconds=args.seconds, idle_watts=idle_w)


if __name__ == "__main__":
    main()
