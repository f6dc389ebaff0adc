#!/usr/bin/env python3
"""Development timing of the fused forward kernel (no plan; "+y": with the combine, "(launch)" as a second
launch, "(kernel)" inside the kernel) at the two layer shapes: ping-pong ("pp"), ping-pong
with 5 stages ("pp5") and cooperative ("coop", the default) interleaved in one process, beside our
separate GEMMs on the same pool (plain-A SwiGLU L1 + L2). With PK_MEGA_FWD_STATS=1 the kernel prints its
per-role clock figures once per shape, without and with h."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import deep_gemm  # noqa: F401
from deep_gemm.grouped_gemm import m_grouped_bf16_gemm_nt, m_grouped_bf16_gemm_swiglu
from deep_gemm.routing import routing_plan


def bench(fn, iters=15):
    return bc.time_ms(fn, "cuda", warmup=3, iters=iters)


stats = os.environ.get("PK_MEGA_FWD_STATS") is not None
for name in sys.argv[1:] or list(bc.FWD_DEV_SHAPES):
    E, H, I, K, T, x, idx, w13, w2, g = bc.fused_fwd_problem(name)
    flops = 6 * T * K * H * I
    plan = routing_plan(idx, E, 1, validate=False)
    src, offs = plan.pool_src_route, plan.expert_offsets
    op = torch.ops.deep_gemm.mega_moe_fused_fwd
    if stats:  # one line set without h, then one with h saved
        for save_h in (False, True):
            op(x, src, offs, w13, w2, K, save_h, 0.0)
            torch.cuda.synchronize()
        continue
    s, _, o, _, _ = op(x, src, offs, w13, w2, K, False, 0.0)
    r2p, tw = plan.route_to_pool.view(T, K), torch.rand(T, K, device="cuda", generator=g)
    xp = x.index_select(0, (src.clamp(min=0) // K).long())  # the pool rows, for the separate-GEMM timing
    row = {}
    for _ in range(2):  # interleaved rounds; the PK_MEGA_FWD_* switches are read at every call
        for kern, which, stages in (("pp", "pingpong", "4"), ("pp5", "pingpong", "5"), ("coop", "cooperative", "4")):
            os.environ["PK_MEGA_FWD_KERNEL"] = which
            os.environ["PK_MEGA_FWD_PP_STAGES"] = stages
            row.setdefault(f"{kern}", []).append(bench(lambda: op(x, src, offs, w13, w2, K, False, 0.0)))
            row.setdefault(f"{kern}+h", []).append(bench(lambda: op(x, src, offs, w13, w2, K, True, 0.0)))
            for where in ("launch", "kernel") if kern == "pp" else ("launch",):
                os.environ["PK_MEGA_FWD_COMBINE"] = where
                row.setdefault(f"{kern}+h+y({where})", []).append(
                    bench(lambda: op(x, src, offs, w13, w2, K, True, 0.0, False, r2p, tw)))
        os.environ["PK_MEGA_FWD_KERNEL"] = "cooperative"
        row.setdefault("L1 plain", []).append(bench(lambda: m_grouped_bf16_gemm_swiglu(xp, w13, offs, save_h=False)))
        row.setdefault("L2", []).append(bench(lambda: m_grouped_bf16_gemm_nt(s, w2, offs)))
    out = " | ".join(f"{k} {min(v):.3f}" for k, v in row.items())
    both = min(row["L1 plain"]) + min(row["L2"])
    print(f"{name}: {out} | L1+L2 {both:.3f} ms | pp {flops / min(row['pp']) / 1e9:.0f} TF", flush=True)
