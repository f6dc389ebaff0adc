#!/usr/bin/env python3
"""A/B of the k-grouped weight-gradient GEMMs (dW2 = dy_pool^T @ (w*s) and dW13 = dh^T @ x_pool, bf16 out) under the
values of one switch (`--switch NAME=v1,v2,...`, required: an environment switch the library reads at every call;
session 7's PK_K_GROUPED_BK32 was measured and removed, bench/NOTES.md) at the two layer shapes, T=16384 (or --tokens), uniform routing, op alone: checks the variants agree bit for bit,
then times 15-iteration bursts (best of 3 interleaved rounds) and the steady state (bench_common.sustained_ms).
Prints one burst and one sustained line per shape and GEMM (ms and TFLOP/s). Development tool (bench/NOTES.md,
session 7)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import deep_gemm  # noqa: E402
from deep_gemm.routing import routing_plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shapes", nargs="*", choices=[*bc.FWD_DEV_SHAPES, []], help="default: all")
    ap.add_argument("--sustained-seconds", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank (default 16384)")
    bc.add_switch_arg(ap, None)
    args = ap.parse_args()
    env, variants = bc.parse_switch(args.switch)
    f = deep_gemm.grouped_gemm.k_grouped_bf16_gemm_tn
    for name in args.shapes or list(bc.FWD_DEV_SHAPES):
        E, H, I, K, T, x, idx, w13, w2, g = bc.fused_fwd_problem(name, args.tokens)
        del x, w13, w2
        offs = routing_plan(idx, E, 1, validate=False).expert_offsets
        P = T * K
        gemms = {  # name: (a, b) with C_e = a_e^T @ b_e, as the grouped backward calls them
            "dW2": (torch.randn(P, H, device="cuda", generator=g).bfloat16(),   # dy_pool
                    torch.randn(P, I, device="cuda", generator=g).bfloat16()),  # w * s
            "dW13": (torch.randn(P, 2 * I, device="cuda", generator=g).bfloat16(),
                     torch.randn(P, H, device="cuda", generator=g).bfloat16()),
        }
        for gname, (a, b) in gemms.items():
            flops = 2 * P * a.shape[1] * b.shape[1]

            def run():
                return f(a, b, offs, out_dtype=torch.bfloat16)

            outs = bc.outputs_per_variant(env, variants, run)
            same = all(torch.equal(outs[variants[0]], o) for o in outs.values())
            burst, sustained = bc.switch_ab(env, variants, {"": run}, args.sustained_seconds)
            print(f"{name} {gname} ({env}): variants agree bit for bit: {same}")
            bc.print_ab(f"{name} {gname}", burst, sustained, flops)
            del outs
        del gemms
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
