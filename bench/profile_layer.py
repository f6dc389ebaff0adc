#!/usr/bin/env python3
"""Where a layer's time goes: per-kernel GPU time of one MegaMoE forward and backward (autograd, as a
trainer calls it) under torch.profiler, grouped by kernel name. Development aid, no results file.

usage: python bench/profile_layer.py [--shapes qwen3-30b-a3b] [--tokens 16384] [--backend auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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


def idle_report(prof, top: int = 10) -> str:
    """GPU idle time between consecutive device activities (kernels, copies, memsets) and the largest
    gaps, each with the activity it ends at and the one that follows."""
    evs = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda t: t[0])
    if not evs:
        return "no device activity"
    gaps, end, prev = [], evs[0][1], evs[0][2]
    for start, stop, name in evs[1:]:
        if start > end:
            gaps.append((start - end, prev, name))
        if stop >= end:
            end, prev = stop, name
    span = (max(e[1] for e in evs) - evs[0][0]) / 1e3
    idle = sum(g[0] for g in gaps) / 1e3
    lines = [f"span {span:.3f} ms, idle {idle:.3f} ms in {len(gaps)} gaps; largest:"]
    for us, a, b in sorted(gaps, reverse=True)[:top]:
        lines.append(f"    {us:7.1f} us  after {a[:60]}  before {b[:60]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--backend", default="auto")
    p.add_argument("--precision", choices=("bf16", "fp8", "fp8_bwd"), default="bf16")
    a = p.parse_args()
    from prime_kernels.mega import mega_moe

    for shape in a.shapes.split(","):
        E, H, I, K = bc.SHAPES[shape]
        w13, w2 = bc.make_weights(E, H, I, 0, "cuda", 0, 1)
        x, idx, w, dy = bc.make_tokens(a.tokens, E, H, K, "uniform", 1, "cuda", 0)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]

        def fwd():
            return mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], num_experts=E, backend=a.backend,
                            precision=a.precision)

        for _ in range(3):
            torch.autograd.grad(fwd(), leaves, dy)
        torch.cuda.synchronize()
        for phase in ("fwd", "bwd"):
            y = fwd() if phase == "bwd" else None
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                if phase == "fwd":
                    y = fwd()
                else:
                    torch.autograd.grad(y, leaves, dy)
                host_ms = (time.perf_counter() - t0) * 1e3  # until the call returned: queued, not run
                torch.cuda.synchronize()
            rows = kernel_table(prof)
            total = sum(r[1] for r in rows)
            print(f"== {shape} T={a.tokens} backend={a.backend} {phase}: kernels sum {total:.3f} ms, "
                  f"{sum(r[2] for r in rows)} launches (kernels, copies, memsets), host {host_ms:.3f} ms to return "
                  f"(under the profiler)")
            for name, ms, n in rows:
                print(f"  {ms:8.3f} ms  x{n:<3d} {name[:110]}")
            del y
        # steady state of a training loop: three fwd+bwd iterations queued back to back, one sync at the end
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                torch.autograd.grad(fwd(), leaves, dy)
            torch.cuda.synchronize()
        print(f"== {shape} 3 x fwd+bwd back to back: " + idle_report(prof))
        # host side: CUDA runtime calls that can block the host (synchronizations, allocations)
        calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("cuda"):
                dur = (ev.time_range.end - ev.time_range.start)
                c = calls[ev.name]
                c[0] += dur
                c[1] += 1
                c[2] = max(c[2], dur)
        print("   host CUDA runtime calls (total us, count, max us):")
        for name, (tot, n, mx) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:8]:
            print(f"    {tot:9.1f} us  x{n:<4d} max {mx:8.1f}  {name}")


if __name__ == "__main__":
    main()
