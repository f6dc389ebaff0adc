#!/usr/bin/env python3
"""A/B of the fused forward under the values of one switch (default: PK_MEGA_FWD_KERNEL = pingpong, cooperative;
`--switch NAME=v1,v2,...` for any other switch the library reads at every call) at the two layer shapes,
T=16384, uniform routing, kernel op alone (no plan, no combine), without and with h saved: checks the variants
agree bit for bit, then times 15-iteration bursts (best of 3 interleaved rounds) and the steady state
(bench_common.sustained_ms: the mean of 10 calls after `--sustained-seconds` back to back). Prints one burst
and one sustained line per shape (ms and TFLOP/s). Development tool (bench/NOTES.md, sessions 6 and 7)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import deep_gemm  # noqa: F401,E402
from deep_gemm.routing import routing_plan  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shapes", nargs="*", choices=[*bc.FWD_DEV_SHAPES, []], help="default: all")
    ap.add_argument("--sustained-seconds", type=float, default=2.0)
    bc.add_switch_arg(ap, "PK_MEGA_FWD_KERNEL=pingpong,cooperative")
    args = ap.parse_args()
    env, variants = bc.parse_switch(args.switch)
    for name in args.shapes or list(bc.FWD_DEV_SHAPES):
        E, H, I, K, T, x, idx, w13, w2, _ = bc.fused_fwd_problem(name)
        flops = 6 * T * K * H * I
        plan = routing_plan(idx, E, 1, validate=False)
        src, offs = plan.pool_src_route, plan.expert_offsets
        op = torch.ops.deep_gemm.mega_moe_fused_fwd

        def run(save_h: bool):
            return op(x, src, offs, w13, w2, K, save_h, 0.0)

        outs = bc.outputs_per_variant(env, variants, lambda: run(True))
        first, *others = outs.values()  # every variant against the first (any number of variants)
        same = all(torch.equal(a, b) for o in others for a, b in zip(first, o) if a is not None and a.numel() > 0)
        burst, sustained = bc.switch_ab(env, variants, {"": lambda: run(False), "+h": lambda: run(True)},
                                        args.sustained_seconds)
        print(f"{name} ({env}): variants agree bit for bit: {same}")
        bc.print_ab(name, burst, sustained, flops)
        del x, w13, w2, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
