#!/usr/bin/env python3
"""The forward's dense-GEMM floor under bench_layer.py's own timing: how long cuBLAS takes for the layer
forward's useful FLOPs as two dense GEMMs, next to the torch baseline and our fused forward, in one run.

Why: the forward targets are ratios of bench_layer's burst times (warm-up, then the median of 20 calls), and on
the H200 those bursts already run into the card's 700 W cap (docs/performance.md). No routed forward can beat
the fastest GEMM this card has on the same FLOPs: cuBLAS on one dense problem of the same size, with no routing,
no ragged groups, no dispatch, no SwiGLU, no saved h and no combine. Per shape, P = T * top_k rows:
  * dense      L1 [P, H] @ [H, 2I] then L2 [P, I] @ [I, H] (torch.mm, out= preallocated): 2 P H 3I FLOPs, the
               forward's useful work;
  * combine    our combine kernel on a [P, H] bf16 pool: the reduction every forward must end with;
  * dense+comb the two in sequence;
  * torch      the baseline layer forward (autograd on, as bench_layer.py calls it);
  * ours       mega_moe (backend "auto", the fused kernel), autograd on.
Each is timed as bench_layer.py times it (burst: time_ms) and over `--seconds` of back-to-back calls (steady
state: ms, J per call from the board's energy counter, watts), rounds interleaved over the five; the best
burst median and the median steady figures count. The table sets each against the target (torch / ratio).

    python bench/floor_fwd.py --out bench/results/floor_fwd_h200_DATE_SHA.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

BARS = {"qwen3-30b-a3b": 3.0, "qwen3-235b-a22b": 2.0}  # the forward targets (x torch) at T = 16384


def forward_calls(shape: str, T: int, routing: str) -> tuple[float, dict]:
    """(useful forward TFLOP, {name: fn}) on one set of random operands (never zeros)."""
    from prime_kernels.combine import combine
    from prime_kernels.mega import mega_moe

    E, H, I, K = bc.SHAPES[shape]
    P = T * K
    g = torch.Generator(device="cuda").manual_seed(T)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    # dense operands: the weights as one [H, 2I] and one [I, H] matrix, scaled by 1/sqrt(fan-in)
    x_pool, s = rnd(P, H), rnd(P, I)
    w1 = (torch.randn(H, 2 * I, device="cuda", generator=g) / H ** 0.5).bfloat16()
    w2d = (torch.randn(I, H, device="cuda", generator=g) / I ** 0.5).bfloat16()
    h_out, o_out = torch.empty(P, 2 * I, device="cuda", dtype=torch.bfloat16), torch.empty(P, H, device="cuda",
                                                                                           dtype=torch.bfloat16)
    # combine: every token's K routes at distinct pool rows (a random permutation), weights in (0, 1)
    route_to_pool = torch.randperm(P, device="cuda", generator=g).to(torch.int32).view(T, K)
    cw = torch.rand(T, K, device="cuda", generator=g)

    def dense():
        torch.mm(x_pool, w1, out=h_out)
        torch.mm(s, w2d, out=o_out)

    def dense_comb():
        dense()
        return combine(o_out, route_to_pool, cw)

    w13, w2 = bc.make_weights(E, H, I, 0, "cuda")
    x, idx, w, _ = bc.make_tokens(T, E, H, K, routing, 1, "cuda")
    torch_lv = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    ours_lv = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    calls = {
        "dense": dense,
        "combine": lambda: combine(o_out, route_to_pool, cw),
        "dense+comb": dense_comb,
        "torch": lambda: bc.torch_moe(torch_lv[0], idx, *torch_lv[1:]),
        "ours": lambda: mega_moe(ours_lv[0], idx, *ours_lv[1:], num_experts=E),
    }
    return 2.0 * P * H * 3 * I / 1e12, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b")
    ap.add_argument("--tokens", default="16384,4096")
    ap.add_argument("--routing", default="uniform", choices=["uniform", "zipf"])
    ap.add_argument("--seconds", type=float, default=1.0, help="steady state: per call kind and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("floor_fwd: no CUDA device, nothing to measure")
        return
    counter = bc.EnergyCounter.for_current_device()
    rows = []
    for shape in args.shapes.split(","):
        for T in (int(t) for t in args.tokens.split(",")):
            tflop, calls = forward_calls(shape, T, args.routing)
            burst: dict = {}
            steady: dict = {}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    burst.setdefault(name, []).append(bc.time_ms(fn, "cuda"))
                    steady.setdefault(name, []).append(bc.energy_per_call(fn, counter, args.seconds))
            torch_ms = min(burst["torch"])
            bar = BARS.get(shape)
            for name in calls:
                j, ms, watts = (statistics.median(v[i] for v in steady[name]) for i in range(3))
                b = min(burst[name])
                rows.append({"shape": shape, "tokens": T, "routing": args.routing, "what": name,
                             "burst_ms": round(b, 4), "steady_ms": round(ms, 4), "joules": round(j, 4),
                             "watts": round(watts, 1),
                             "tflops_burst": None if name == "combine" else round(tflop / b * 1e3, 1),
                             "bar_ms": None if bar is None else round(torch_ms / bar, 4),
                             "torch_over_this_burst": round(torch_ms / b, 3)})
            del calls
            torch.cuda.empty_cache()
    cols = [("shape", "shape", 16, "s"), ("T", "tokens", 6, "d"), ("what", "what", 11, "s"),
            ("burst ms", "burst_ms", 9, ".3f"), ("steady ms", "steady_ms", 9, ".3f"), ("J/call", "joules", 7, ".3f"),
            ("W", "watts", 6, ".0f"), ("TFLOP/s", "tflops_burst", 8, ".0f"), ("bar ms", "bar_ms", 7, ".3f"),
            ("torch/this", "torch_over_this_burst", 10, ".2f")]
    print(" ".join(f"{h:{w}s}" if f == "s" else f"{h:>{w}s}" for h, _, w, f in cols))
    for r in rows:
        cells = ("-" if r[k] is None else format(r[k], f) for _, k, _, f in cols)
        print(" ".join(f"{c:{w}s}" if f == "s" else f"{c:>{w}s}" for c, (_, _, w, f) in zip(cells, cols)))
    if args.out:
        doc = {**bc.run_header("cuda", 0.0), "seconds": args.seconds, "rounds": args.rounds, "bars": BARS,
               "rows": rows}
        doc.pop("peak_bf16_tflops", None)  # this tool measures no peak figure
        print(f"wrote {bc.write_results(doc, bc.Path(args.out))}")


if __name__ == "__main__":
    main()
