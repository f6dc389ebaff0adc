#!/usr/bin/env python3
"""Where a layer's time goes: per-kernel GPU time of one MegaMoE forward and backward (autograd, as a
trainer calls it) under torch.profiler, grouped by kernel name. Development aid, no results file.

usage: python bench/profile_layer.py [--shapes qwen3-30b-a3b] [--tokens 16384] [--backend auto]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def kernel_table(prof) -> list[tuple[str, float, int]]:
    """(kernel name, total GPU ms, count) for every device kernel and memcpy/memset, largest first."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name][0] += ev.device_time_total / 1e3 if hasattr(ev, "device_time_total") else ev.cuda_time_total / 1e3
            acc[ev.name][1] += 1
    return sorted(((n, v[0], v[1]) for n, v in acc.items()), key=lambda r: -r[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--backend", default="auto")
    a = p.parse_args()
    from deep_gemm.mega import mega_moe

    for shape in a.shapes.split(","):
        E, H, I, K = bc.SHAPES[shape]
        w13, w2 = bc.make_weights(E, H, I, 0, "cuda", 0, 1)
        x, idx, w, dy = bc.make_tokens(a.tokens, E, H, K, "uniform", 1, "cuda", 0)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]

        def fwd():
            return mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], num_experts=E, backend=a.backend)

        for _ in range(3):
            torch.autograd.grad(fwd(), leaves, dy)
        torch.cuda.synchronize()
        for phase in ("fwd", "bwd"):
            y = fwd() if phase == "bwd" else None
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                if phase == "fwd":
                    y = fwd()
                else:
                    torch.autograd.grad(y, leaves, dy)
                torch.cuda.synchronize()
            rows = kernel_table(prof)
            total = sum(r[1] for r in rows)
            print(f"== {shape} T={a.tokens} backend={a.backend} {phase}: kernels sum {total:.3f} ms")
            for name, ms, n in rows:
                print(f"  {ms:8.3f} ms  x{n:<3d} {name[:110]}")
            del y


if __name__ == "__main__":
    main()
