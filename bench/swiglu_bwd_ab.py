#!/usr/bin/env python3
"""A/B of the L2 dgrad + SwiGLU backward op (m_grouped_bf16_gemm_swiglu_bwd: da = dy_pool @ w2_e, then dh, w * s and
the d topk_weights partials) under the values of one switch (`--switch NAME=v1,v2,...`; default PK_SWIGLU_BWD_COOP=0,1:
the ping-pong kernel against the cooperative one) at the two layer shapes, T=16384 (or --tokens), uniform routing, op
alone. Prints each variant's error against a float64 reference on the first 2048 pool rows (variants may sum the
d topk_weights partials differently, so they need not agree bit for bit) and whether a second run repeats it bit
for bit, then 15-iteration bursts (best of 3 interleaved rounds) and the steady state (bench_common.sustained_ms),
ms and TFLOP/s (2 * P * H * I). Development tool (bench/NOTES.md, session 10: written for the helper-warp kernel
measured there)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import deep_gemm  # noqa: E402
from deep_gemm.routing import routing_plan  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shapes", nargs="*", choices=[*bc.FWD_DEV_SHAPES, []], help="default: all")
    ap.add_argument("--sustained-seconds", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank (default 16384)")
    bc.add_switch_arg(ap, "PK_SWIGLU_BWD_COOP=0,1")
    args = ap.parse_args()
    env, variants = bc.parse_switch(args.switch)
    f = deep_gemm.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd
    for name in args.shapes or list(bc.FWD_DEV_SHAPES):
        E, H, I, K, T, x, idx, w13, w2, g = bc.fused_fwd_problem(name, args.tokens)
        del x, w13
        plan = routing_plan(idx, E, 1, validate=False)
        offs, src = plan.expert_offsets, plan.pool_src_route
        P = src.numel()  # pool rows (with the plan's padding)
        dy = torch.randn(P, H, device="cuda", generator=g).bfloat16()
        h = (2 * torch.randn(P, 2 * I, device="cuda", generator=g)).bfloat16()
        wts = torch.rand(T, K, device="cuda", generator=g) + 0.1

        def run():
            return f(dy, w2, offs, h, src, wts)

        # float64 reference on the first rows (all in the first experts' groups)
        rows = 2048
        offs_c = offs.cpu().clamp(max=rows)
        e_last = int(torch.searchsorted(offs_c, torch.tensor([rows]), right=False)[0].item())
        da = torch.zeros(rows, I, dtype=torch.float64)
        for e in range(min(e_last + 1, E)):
            a, b = int(offs_c[e]), int(offs_c[e + 1])
            if b > a:
                da[a:b] = dy[a:b].cpu().double() @ w2[e].cpu().double()
        g64, u64 = h[:rows, :I].cpu().double(), h[:rows, I:].cpu().double()
        s64 = src[:rows].cpu().long()
        wr = torch.where(s64 >= 0, wts.reshape(-1).cpu().double()[s64.clamp(min=0)], torch.zeros((), dtype=torch.float64))
        sig = torch.sigmoid(g64)
        dh_ref = torch.cat([wr[:, None] * da * u64 * sig * (1 + g64 * (1 - sig)), wr[:, None] * da * g64 * sig], 1)
        aw_ref = wr[:, None] * g64 * sig * u64
        dt_ref = torch.where(s64 >= 0, (da * g64 * sig * u64).sum(1), torch.zeros((), dtype=torch.float64))
        outs = bc.outputs_per_variant(env, variants, run)
        for v, (dh, aw, dt) in outs.items():
            print(f"{name} {env}={v}: rel err dh {_rel(dh[:rows].cpu(), dh_ref):.2e} w*s {_rel(aw[:rows].cpu(), aw_ref):.2e}"
                  f" dt {_rel(dt[:rows].sum(1).cpu(), dt_ref):.2e}", flush=True)
        for v in variants:
            os.environ[env] = v
            again = run()
            print(f"{name} {env}={v}: a second run is bit-identical: {all(torch.equal(a, b) for a, b in zip(outs[v], again))}")
        del os.environ[env]
        del outs, again
        burst, sustained = bc.switch_ab(env, variants, {"": run}, args.sustained_seconds)
        bc.print_ab(name, burst, sustained, 2.0 * T * K * H * I)
        del dy, h, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
