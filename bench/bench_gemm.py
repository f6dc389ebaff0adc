"""Grouped-GEMM core benchmark: prime_kernels' sm90 kernels vs torch._grouped_mm on the same tensors.

The six GEMM passes of a MoE layer (128 experts, T tokens, top-8, so P = T*8 pool rows), for the
Qwen3-30B-A3B and Qwen3-235B-A22B shapes, uniform and Zipf routing. Times with CUDA events (5
warm-ups, median of --reps; GPU time, see SPIN_CYCLES), measures the bf16 matmul peak in the same run, checks each output
against torch's, prints a table and writes bench/results/gemm_<date>_<sha>.json.

    python bench/bench_gemm.py [--tokens 16384] [--shapes qwen3-30b-a3b,qwen3-235b-a22b] [--reps 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch

import bench_common

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3-235b-a22b": (128, 4096, 1536, 8)}


# Each timed call is preceded by a ~0.1 ms GPU spin, enqueued before the start event: while the GPU spins,
# the host enqueues the start event, the call and the end event, so the interval holds the call's GPU work
# only (the same for both backends), not the Python/launch overhead a synchronised loop would put on the GPU
# timeline between the events (in a training step the host runs ahead of the GPU and that overhead is hidden).
SPIN_CYCLES = 200_000


def time_interleaved(fns: dict, warmup: int, reps: int) -> dict:
    """Median ms of each function, timed in rounds that run every function once."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}


def time_ms(fn, warmup: int, reps: int) -> float:
    return time_interleaved({"fn": fn}, warmup, reps)["fn"]


def peak_bf16_tflops(reps: int) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, 3, reps)
    return 2 * n ** 3 / ms / 1e9


def expert_counts(T: int, E: int, K: int, routing: str, seed: int) -> torch.Tensor:
    """uniform: topk(softmax(randn(T, E)), K); zipf: K distinct experts per token drawn with popularity
    ~ 1/rank^1.1 over a random permutation of the experts (bench_common.make_routing's rule)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if routing == "zipf":
        perm = torch.randperm(E, device="cuda", generator=gen)
        pop = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32) ** 1.1
        idx = torch.multinomial(pop[perm].expand(T, E), K, replacement=False, generator=gen)
    else:
        idx = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=gen), -1), K, dim=-1).indices
    return torch.bincount(idx.reshape(-1), minlength=E)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--routings", default="uniform,zipf")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()

    import prime_kernels

    for key in ("m_grouped_gemm_nt.bf16.sm90", "m_grouped_gemm_nn.bf16.sm90", "k_grouped_gemm_tn.bf16.sm90"):
        print(f"{key}: {prime_kernels.status()[key]}")
    peak = peak_bf16_tflops(args.reps)
    print(f"measured bf16 matmul peak: {peak:.0f} TFLOP/s")
    rows = []
    for shape in args.shapes.split(","):
        E, H, I, K = SHAPES[shape]
        for routing in args.routings.split(","):
            counts = expert_counts(args.tokens, E, K, routing, seed=1234)
            P = int(counts.sum())
            ends = torch.cumsum(counts, 0).to(torch.int32)
            offs = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), ends])
            g = torch.Generator(device="cuda").manual_seed(7)
            rnd = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.1).bfloat16()  # noqa: E731
            x, s, dy, dh = rnd(P, H), rnd(P, I), rnd(P, H), rnd(P, 2 * I)
            w13, w2 = rnd(E, 2 * I, H), rnd(E, H, I)
            passes = [  # (op, ours, torch's, flops)
                ("l1_fwd", lambda: prime_kernels.m_grouped_bf16_gemm_nt(x, w13, offs),
                 lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16), 4 * P * H * I),
                ("l2_fwd", lambda: prime_kernels.m_grouped_bf16_gemm_nt(s, w2, offs),
                 lambda: torch._grouped_mm(s, w2.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16), 2 * P * H * I),
                ("l2_dgrad", lambda: prime_kernels.m_grouped_bf16_gemm_nn(dy, w2, offs),
                 lambda: torch._grouped_mm(dy, w2, offs=ends, out_dtype=torch.bfloat16), 2 * P * H * I),
                ("l1_dgrad", lambda: prime_kernels.m_grouped_bf16_gemm_nn(dh, w13, offs),
                 lambda: torch._grouped_mm(dh, w13, offs=ends, out_dtype=torch.bfloat16), 4 * P * H * I),
                ("l2_wgrad", lambda: prime_kernels.k_grouped_bf16_gemm_tn(dy, s, offs, out_dtype=torch.bfloat16),
                 lambda: torch._grouped_mm(dy.t(), s, offs=ends, out_dtype=torch.bfloat16), 2 * P * H * I),
                ("l1_wgrad", lambda: prime_kernels.k_grouped_bf16_gemm_tn(dh, x, offs, out_dtype=torch.bfloat16),
                 lambda: torch._grouped_mm(dh.t(), x, offs=ends, out_dtype=torch.bfloat16), 4 * P * H * I),
            ]
            for op, ours, theirs, flops in passes:
                ref = theirs().float()
                got = ours().float()
                err = ((got - ref).norm() / ref.norm()).item()
                # Interleaved rounds: the card's clock moves with power draw over seconds, so timing one
                # backend after the other would charge the drift to whichever ran second.
                med = time_interleaved({"torch": theirs, "deep_gemm": ours}, 5, args.reps)
                for backend in ("torch", "deep_gemm"):
                    ms = med[backend]
                    rows.append({"shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K,
                                 "tokens": args.tokens, "ep": 1, "routing": routing, "precision": "bf16",
                                 "backend": backend, "op": op, "pool_rows": P, "ms": ms,
                                 "tflops": flops / ms / 1e9, "pct_peak": 100 * flops / ms / 1e9 / peak,
                                 **({"rel_err_vs_torch": err} if backend == "deep_gemm" else {})})
                t, d = rows[-2], rows[-1]
                d["ratio_vs_torch"] = t["ms"] / d["ms"]
                print(f"{shape:16s} {routing:8s} {op:9s} torch {t['ms']:7.3f} ms {t['tflops']:5.0f} TF | "
                      f"deep_gemm {d['ms']:7.3f} ms {d['tflops']:5.0f} TF ({d['pct_peak']:4.1f}% peak) "
                      f"x{d['ratio_vs_torch']:.3f}  err {err:.1e}", flush=True)
            del x, s, dy, dh, w13, w2
            torch.cuda.empty_cache()
    ratios = [r["ratio_vs_torch"] for r in rows if r["backend"] == "deep_gemm"]
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"passes >= 1.0x torch: {sum(r >= 1.0 for r in ratios)}/{len(ratios)}; min x{min(ratios):.3f}; "
          f"geometric mean x{geo:.3f}")
    sha = bench_common.git_sha()  # the checkout's commit, else the wheel's build record
    result = {"gpu": torch.cuda.get_device_name(), "num_gpus": 1, "torch": torch.__version__,
              "cuda": torch.version.cuda, "git_sha": sha, "deep_gemm_build": prime_kernels.build_info(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "peak_bf16_tflops": peak, "geomean_ratio_vs_torch": geo, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gemm_{result['date'][:10]}_{sha[:12]}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
