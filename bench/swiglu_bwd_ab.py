#!/usr/bin/env python3
"""A/B of the L2-dgrad + SwiGLU-backward kernel in one CTA per tile or in 2-CTA clusters with B multicast
(PK_SWIGLU_BWD_CLUSTER = 0 / 1, read at every call) at the two layer shapes, T=16384, uniform routing, op alone:
checks the two agree bit for bit, then times 15-iteration bursts (best of 3 interleaved rounds) and the steady
state (bench_common.sustained_ms). Prints one burst and one sustained line per shape (ms and TFLOP/s of the
useful 2 * P * H * I). Development tool (bench/NOTES.md, session 7)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import deep_gemm  # noqa: E402
from deep_gemm.routing import routing_plan  # noqa: E402

VARIANTS = {"single": "0", "cluster": "1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shapes", nargs="*", default=list(bc.FWD_DEV_SHAPES), choices=list(bc.FWD_DEV_SHAPES))
    ap.add_argument("--sustained-seconds", type=float, default=2.0)
    args = ap.parse_args()
    for name in args.shapes:
        E, H, I, K, T, x, idx, _, w2, g = bc.fused_fwd_problem(name)
        del x
        plan = routing_plan(idx, E, 1, validate=False)
        src, offs = plan.pool_src_route, plan.expert_offsets
        P = src.shape[0]
        dy = torch.randn(P, H, device="cuda", generator=g).bfloat16()
        h = (torch.randn(P, 2 * I, device="cuda", generator=g) * 2).bfloat16()
        wts = torch.rand(T, K, device="cuda", generator=g) + 0.1
        flops = 2 * T * K * H * I
        f = deep_gemm.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd

        def run():
            return f(dy, w2, offs, h, src, wts)

        outs = {}
        for v, env in VARIANTS.items():
            os.environ["PK_SWIGLU_BWD_CLUSTER"] = env
            outs[v] = run()
        same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
        burst: dict = {}
        for _ in range(3):
            for v, env in VARIANTS.items():
                os.environ["PK_SWIGLU_BWD_CLUSTER"] = env
                burst.setdefault(v, []).append(bc.time_ms(run, "cuda", warmup=3, iters=15))
        sustained = {}
        for v, env in VARIANTS.items():
            os.environ["PK_SWIGLU_BWD_CLUSTER"] = env
            sustained[v] = bc.sustained_ms(run, "cuda", args.sustained_seconds)
        os.environ.pop("PK_SWIGLU_BWD_CLUSTER", None)
        print(f"{name}: variants agree bit for bit: {same}")
        print(f"{name} burst: " + " | ".join(f"{k} {min(v):.3f} ({flops / min(v) / 1e9:.0f} TF)"
                                             for k, v in burst.items()))
        print(f"{name} sustained: " + " | ".join(f"{k} {v:.3f} ({flops / v / 1e9:.0f} TF)"
                                                 for k, v in sustained.items()), flush=True)
        del dy, h, w2, outs


if __name__ == "__main__":
    main()
