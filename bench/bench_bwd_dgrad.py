#!/usr/bin/env python3
"""The fused backward kernel against the pipeline steps it replaces, on the same inputs in the same run: without its
weight-gradient tiles (the two dgrad steps) and with them (the dgrad steps and the two k-grouped GEMMs).

    python bench/bench_bwd_dgrad.py [--shapes qwen3-30b-a3b,qwen3-235b-a22b] [--tokens 4096,16384]
                                    [--routings uniform,zipf] [--precision bf16|fp8] [--warmup 5] [--reps 20]
                                    [--out PATH] [--max-seconds S]

Inputs, per (shape, T, routing): the grouped backward's state (prime_kernels.mega._grouped.backward) built from
bench_common's seeded tokens, routing and weights: the routing plan padded to 128-row m-blocks, the dy rows
gathered into the pool (padding rows zero), h random N(0, 1) bf16 (what the forward's pre-activations are at
these weight scales), topk_weights fp32.

  pipeline: m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offsets, h, pool_src_route, topk_weights) -> dh, w * s,
            dt_part; then m_grouped_bf16_gemm_nn(dh, w13, offsets) -> dx_pool (each also timed alone: l2, l1)
  fused:    prime_kernels.mega._fused_bwd.dgrad(dy_pool, w13, w2, h, offsets, pool_src_route, topk_weights)
  pipeline_full: pipeline, then k_grouped_bf16_gemm_tn(dy_pool, w * s) -> dW2 and (dh, x_pool) -> dW13, bf16
  fused_full:    prime_kernels.mega._fused_bwd.dgrad_wgrad(dy_pool, x_pool, ...), bf16 weight gradients

With --precision fp8 the FP8 backward's two dgrad steps on the same state (dy_pool quantized qK(dy, 128) by
dispatch_rows_fp8 from the pool's own rows, the weights' transposed FP8 copies from the weight cache):
  pipeline: m_grouped_fp8_gemm_swiglu_bwd(qK(dy), W2^T, ...) -> qK(dh), qT(dh), qT(w * s), dt_part; then
            m_grouped_fp8_gemm_nt(qK(dh), W13^T) -> dx_pool (each also timed alone: l2, l1)
  fused:    prime_kernels.swiglu_bwd_fp8.mega_moe_fp8_dgrad_fused on the same operands (no *_full rows: the weight
            gradients stay with the k-grouped FP8 GEMM), pct_peak against the FP8 peak measured in the run.

Timing: bench_gemm.time_interleaved (CUDA events around each call after a short GPU spin, so that the interval
holds the call's GPU work only; rounds that run every function once; median of --reps after --warmup calls).
Useful FLOPs: 2 M H I (L2 dgrad) + 2 M 2I H (L1 dgrad), twice that with the weight gradients, M = routed rows
(the pool's padding rows not counted);
pct_peak against the bf16 matmul peak measured in the same run. Check, in the same run: the fused outputs against
the pipeline's (dh, w * s, dx_pool over the experts' rows, all of dt_part): a bitwise flag per output and the
largest relative error. Results: a table, and JSON (bench_common.run_header's fields, the timing, a row per
configuration) written after every configuration to --out (default bench/results/bwd_dgrad_<gpu>_x1_<date>.json).
The kernels have no CPU path: on a machine without a CUDA GPU this says so and exits 2.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

SHAPES = ("qwen3-30b-a3b", "qwen3-235b-a22b")
BLOCK_M = 128  # the plans' m-block: both forwards pad to it, and the kernel's tiles are 128 rows
OUTPUTS = ("dh", "w*s", "dt_part", "dx_pool", "dw13", "dw2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list from {sorted(bc.SHAPES)}")
    p.add_argument("--tokens", default="4096,16384", help="comma list of T")
    p.add_argument("--routings", default="uniform,zipf", help="comma list from uniform,zipf")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--lags", default="",
                   help="comma list of task-sequence lags to time fused_full (fp8: fused) at as well "
                        "(fused_full_lag<L>_ms, fused_lag<L>_ms; empty: the heuristic's only)")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="start no new configuration after this many seconds (0: no limit); results so far are kept")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/bwd_dgrad_<gpu>_x1_<date>.json)")
    a = p.parse_args(argv)
    a.shapes, a.routings = _split(a.shapes), _split(a.routings)
    a.tokens = [int(t) for t in _split(a.tokens)]
    a.lags = [int(v) for v in _split(a.lags)]
    if any(not 0 <= v <= 64 for v in a.lags):
        p.error("--lags must be in [0, 64]")
    for s in a.shapes:
        if s not in bc.SHAPES:
            p.error(f"unknown shape {s!r}: choose from {sorted(bc.SHAPES)}")
    for r in a.routings:
        if r not in ("uniform", "zipf"):
            p.error(f"unknown routing {r!r}: choose from uniform, zipf")
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens must list positive token counts")
    if a.reps < 1 or a.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    return a


def _split(s):
    return [v.strip() for v in s.split(",") if v.strip()]


def dgrad_flops(routed_rows: int, H: int, I: int) -> int:
    """Useful FLOPs of the two dgrad GEMMs over the routed rows: L2 dgrad dy [M, H] @ w2_e [H, I], L1 dgrad
    dh [M, 2I] @ w13_e [2I, H]."""
    return 2 * routed_rows * H * I + 2 * routed_rows * (2 * I) * H


def make_state(shape: str, T: int, routing: str, seed: int, device) -> dict:
    """The pipeline's inputs to its two dgrad steps (the module docstring says how they are drawn). Works on any
    device (the plan on the CPU comes from the core's host loop), so the construction is checked without a GPU."""
    from prime_kernels.mega import _grouped
    from prime_kernels.routing import routing_plan

    E, H, I, K = bc.SHAPES[shape]
    x, idx, w, dy = bc.make_tokens(T, E, H, K, routing, seed, device)
    w13, w2 = bc.make_weights(E, H, I, seed, device)
    plan = routing_plan(idx, num_experts=E, block_m=BLOCK_M)
    src = plan.pool_src_route
    tok = _grouped._token_rows(src, K)
    pooled = lambda rows: rows.index_select(0, tok.clamp(min=0).long()).masked_fill_((tok < 0)[:, None], 0)
    dy_pool = pooled(dy)
    g = torch.Generator(device=device).manual_seed(seed * 1000 + 29)
    h = torch.randn(src.shape[0], 2 * I, generator=g, device=device).to(torch.bfloat16)
    return {"inputs": [dy_pool, w13, w2, h, plan.expert_offsets, src, w.float().contiguous()], "x_pool": pooled(x),
            "E": E, "H": H, "I": I, "K": K, "routed_rows": int((idx >= 0).sum()), "pool_rows": int(src.shape[0]),
            "expert_rows": int(plan.expert_offsets[-1])}


def pipeline(inputs):
    """The grouped backward's two steps, as prime_kernels.mega._grouped.backward calls them."""
    from prime_kernels.grouped_gemm import m_grouped_bf16_gemm_nn, m_grouped_bf16_gemm_swiglu_bwd

    dy_pool, w13, w2, h, offsets, src, wts = inputs
    dh, aw, dt_part = m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offsets, h, src, wts)
    return dh, aw, dt_part, m_grouped_bf16_gemm_nn(dh, w13, offsets)


def fused(inputs):
    from prime_kernels.mega._fused_bwd import dgrad

    return dgrad(*inputs)


def pipeline_full(inputs, x_pool):
    """The two dgrad steps, then the weight gradients as the grouped backward computes them for bf16 weights."""
    from prime_kernels.grouped_gemm import k_grouped_bf16_gemm_tn

    dh, aw, dt_part, dx = pipeline(inputs)
    offsets = inputs[4]
    dw2 = k_grouped_bf16_gemm_tn(inputs[0], aw, offsets, out_dtype=torch.bfloat16)
    dw13 = k_grouped_bf16_gemm_tn(dh, x_pool, offsets, out_dtype=torch.bfloat16)
    return dh, aw, dt_part, dx, dw13, dw2


def fused_full(inputs, x_pool, lag=None):
    from prime_kernels.mega._fused_bwd import dgrad_wgrad

    dy_pool, *rest = inputs
    return dgrad_wgrad(dy_pool, x_pool, *rest, lag=lag)


def compare(got, want, expert_rows: int) -> dict:
    """Per output: bitwise equality and relative error of got against want, over what the op specifies (the
    experts' rows of dh, w * s and dx_pool; rows after them are not written; all of dt_part)."""
    bitwise, rel = {}, {}
    for name, a, b in zip(OUTPUTS, got, want):
        if name in ("dh", "w*s", "dx_pool"):
            a, b = a[:expert_rows], b[:expert_rows]
        bitwise[name] = bool(torch.equal(a, b))
        rel[name] = 0.0 if bitwise[name] else bc.rel_err(a, b)
    return {"bitwise": bitwise, "bitwise_all": all(bitwise.values()), "rel_err": rel,
            "max_rel_err": max(rel.values())}


FP8_OUTPUTS = ("dh_q", "dh_sa", "dht_q", "dht_s", "awt_q", "awt_s", "dt_part", "dx_pool")


def fp8_inputs(st) -> list:
    """The FP8 dgrad steps' operands from the bf16 state: qK(dy_pool) and the transposed FP8 weight copies."""
    from prime_kernels.mega import fp8 as _fp8
    from prime_kernels.quantize import dispatch_rows_fp8

    dy_pool, w13, w2, h, offsets, src, wts = st["inputs"]
    rows = dy_pool.shape[0]
    own_rows = torch.arange(rows, device=dy_pool.device, dtype=torch.int32)[:, None]
    dy_q, dy_sa = dispatch_rows_fp8(dy_pool, own_rows, rows)
    cache = _fp8.Fp8WeightCache()
    w13t, w2t = cache.get(w13).transposed, cache.get(w2).transposed
    return [dy_q, dy_sa, w2t.data, w2t.scale, w13t.data, w13t.scale, offsets, h, src, wts]


def fp8_pipeline_l2(x8):
    from prime_kernels.swiglu_bwd_fp8 import m_grouped_fp8_gemm_swiglu_bwd

    dy_q, dy_sa, w2t_q, w2t_s, _, _, offsets, h, src, wts = x8
    return m_grouped_fp8_gemm_swiglu_bwd(dy_q, dy_sa, w2t_q, w2t_s, offsets, h, src, wts)


def fp8_pipeline(x8):
    """The FP8 backward's two dgrad steps, as prime_kernels.mega._fp8_bwd.data_grads calls them."""
    from prime_kernels.grouped_gemm import m_grouped_fp8_gemm_nt

    l2 = fp8_pipeline_l2(x8)
    return (*l2, m_grouped_fp8_gemm_nt(l2.dh_q, l2.dh_sa, x8[4], x8[5], x8[6]))


def fp8_fused(x8, lag=-1):
    from prime_kernels.swiglu_bwd_fp8 import mega_moe_fp8_dgrad_fused

    l2, dx_pool = mega_moe_fp8_dgrad_fused(*x8, lag=lag)
    return (*l2, dx_pool)


def compare_fp8(got, want, expert_rows: int) -> dict:
    """Per output, bitwise over what the ops specify: the experts' rows (token columns of the qT outputs, their
    128-row blocks of the qT scales), all of dt_part's rows up to them."""
    blocks = -(-expert_rows // BLOCK_M)
    bitwise = {}
    for name, a, b in zip(FP8_OUTPUTS, got, want):
        if name in ("dht_q", "awt_q"):
            a, b = a[:, :expert_rows], b[:, :expert_rows]
        elif name in ("dht_s", "awt_s"):
            a, b = a[:, :blocks], b[:, :blocks]
        else:
            a, b = a[:expert_rows], b[:expert_rows]
        bitwise[name] = bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    rel = {"dx_pool": bc.rel_err(got[-1][:expert_rows], want[-1][:expert_rows])}
    return {"bitwise": bitwise, "bitwise_all": all(bitwise.values()), "rel_err": rel, "max_rel_err": rel["dx_pool"]}


def bench_config_fp8(shape, T, routing, args, peak) -> dict:
    from bench_gemm import time_interleaved
    from prime_kernels.grouped_gemm import m_grouped_fp8_gemm_nt

    st = make_state(shape, T, routing, args.seed, "cuda")
    x8 = fp8_inputs(st)
    E, H, I, K = st["E"], st["H"], st["I"], st["K"]
    row = {"shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K, "tokens": T,
           "routing": routing, "precision": "fp8", "routed_rows": st["routed_rows"], "pool_rows": st["pool_rows"],
           "expert_rows": st["expert_rows"]}
    got = fp8_fused(x8)  # first: a kernel fault here is the fused op's, with the pipeline not yet run
    torch.cuda.synchronize()
    want = fp8_pipeline(x8)
    row.update(compare_fp8(got, want, st["expert_rows"]))
    dh_q, dh_sa = want[0], want[1]
    del got, want
    ms = time_interleaved({
        "pipeline": lambda: fp8_pipeline(x8),
        "pipeline_l2": lambda: fp8_pipeline_l2(x8),
        "pipeline_l1": lambda: m_grouped_fp8_gemm_nt(dh_q, dh_sa, x8[4], x8[5], x8[6]),
        "fused": lambda: fp8_fused(x8),
        **{f"fused_lag{v}": (lambda v=v: fp8_fused(x8, v)) for v in args.lags},
    }, args.warmup, args.reps)
    flops = dgrad_flops(st["routed_rows"], H, I)
    for k, v in ms.items():
        row[f"{k}_ms"] = v
    row["ratio_fused_over_pipeline"] = ms["fused"] / ms["pipeline"]
    for k in ("pipeline", "fused"):
        row[f"{k}_tflops"] = flops / ms[k] / 1e9
        row[f"{k}_pct_peak"] = 100.0 * row[f"{k}_tflops"] / peak if peak else None
    return row


def bench_config(shape, T, routing, args, peak) -> dict:
    from bench_gemm import time_interleaved
    from prime_kernels.grouped_gemm import m_grouped_bf16_gemm_nn, m_grouped_bf16_gemm_swiglu_bwd

    st = make_state(shape, T, routing, args.seed, "cuda")
    x = st["inputs"]
    dy_pool, w13, w2, h, offsets, src, wts = x
    E, H, I, K = st["E"], st["H"], st["I"], st["K"]
    row = {"shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K, "tokens": T,
           "routing": routing, "precision": "bf16", "routed_rows": st["routed_rows"], "pool_rows": st["pool_rows"],
           "expert_rows": st["expert_rows"]}
    xp = st["x_pool"]
    got = fused_full(x, xp)  # first: a kernel fault here is the fused op's, with the pipeline not yet run
    torch.cuda.synchronize()
    want = pipeline_full(x, xp)
    row.update(compare(got, want, st["expert_rows"]))
    row["dgrad_only_bitwise"] = compare(fused(x) + want[4:], want, st["expert_rows"])["bitwise_all"]
    dh = want[0]
    del got, want
    ms = time_interleaved({
        "pipeline": lambda: pipeline(x),
        "pipeline_l2": lambda: m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offsets, h, src, wts),
        "pipeline_l1": lambda: m_grouped_bf16_gemm_nn(dh, w13, offsets),
        "fused": lambda: fused(x),
        "pipeline_full": lambda: pipeline_full(x, xp),
        "fused_full": lambda: fused_full(x, xp),
        **{f"fused_full_lag{v}": (lambda v=v: fused_full(x, xp, v)) for v in args.lags},
    }, args.warmup, args.reps)
    flops = dgrad_flops(st["routed_rows"], H, I)
    for k, v in ms.items():
        row[f"{k}_ms"] = v
    row["ratio_fused_over_pipeline"] = ms["fused"] / ms["pipeline"]
    row["ratio_full"] = ms["fused_full"] / ms["pipeline_full"]
    for k, f in (("pipeline", flops), ("fused", flops), ("pipeline_full", 2 * flops), ("fused_full", 2 * flops)):
        row[f"{k}_tflops"] = f / ms[k] / 1e9
        row[f"{k}_pct_peak"] = 100.0 * row[f"{k}_tflops"] / peak
    return row


def format_rows(rows) -> str:
    cols = [("shape", "{}"), ("tokens", "{}"), ("routing", "{}"), ("pipeline_ms", "{:.3f}"), ("pipeline_l2_ms", "{:.3f}"),
            ("pipeline_l1_ms", "{:.3f}"), ("fused_ms", "{:.3f}"), ("ratio_fused_over_pipeline", "{:.3f}"),
            ("pipeline_tflops", "{:.0f}"), ("fused_tflops", "{:.0f}"), ("pipeline_full_ms", "{:.3f}"),
            ("fused_full_ms", "{:.3f}"), ("ratio_full", "{:.3f}"), ("fused_full_pct_peak", "{:.1f}"),
            ("bitwise_all", "{}"), ("max_rel_err", "{:.2e}"), ("error", "{}")]
    cells = [[c for c, _ in cols]]
    for r in rows:
        cells.append(["-" if r.get(c) is None else f.format(r[c]) for c, f in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("[bench] bench_bwd_dgrad: needs a CUDA GPU (the kernels have no CPU path)")
        return 2
    import prime_kernels
    from prime_kernels import _status
    from prime_kernels.mega import _fused_bwd
    from prime_kernels.swiglu_bwd_fp8 import FUSED_KEY

    fp8 = args.precision == "fp8"
    key = FUSED_KEY if fp8 else _fused_bwd.STATUS_KEY
    why = _status.runnable(key)
    peak = bc.fp8_peak_tflops("cuda") if fp8 else bc.bf16_peak_tflops("cuda")
    header = bc.run_header("cuda", peak)
    doc = dict(header, build=prime_kernels.build_info(), precision=args.precision,
               status={key: prime_kernels.status()[key]}, timing={"warmup": args.warmup, "reps": args.reps,
                                         "statistic": "median of reps CUDA-event times, rounds interleaved over the "
                                                      "functions, a GPU spin before each call"},
               flops="2*M*H*I + 2*M*2I*H, M = routed rows (twice that for the *_full rows)", rows=[])
    path = Path(args.out) if args.out else bc.default_results_path("bwd_dgrad" + ("_fp8" if fp8 else ""), header)
    print(f"[bench] {header['gpu']}, torch {header['torch']}, cuda {header['cuda']}, {args.precision} peak "
          f"{peak or 0:.0f} TFLOP/s; {key}: {doc['status'][key]}", flush=True)
    if why != _status.AVAILABLE:
        doc["skipped"] = f"{key} cannot run here: {why}"
        bc.write_results(doc, path)
        print(f"[bench] {doc['skipped']}; wrote {path}")
        return 1
    t0 = time.monotonic()
    status = 0
    for shape, T, routing in itertools.product(args.shapes, args.tokens, args.routings):
        if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
            doc["stopped"] = f"--max-seconds={args.max_seconds:g} reached: later configurations not run"
            break
        try:
            row = (bench_config_fp8 if fp8 else bench_config)(shape, T, routing, args, peak)
        except Exception as exc:  # noqa: BLE001  (recorded; the CUDA context may be gone, so stop)
            row = {"shape": shape, "tokens": T, "routing": routing, "error": f"{type(exc).__name__}: {exc}"}
            doc["stopped"] = f"stopped after an error at {shape} T={T} {routing}"
        doc["rows"].append(row)
        status |= int("error" in row or not row["bitwise_all"])
        bc.write_results(doc, path)
        print(f"[bench] {shape} T={T} {routing}: " + (row.get("error") or
              f"pipeline {row['pipeline_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms "
              f"(x{row['ratio_fused_over_pipeline']:.3f}), bitwise {row['bitwise_all']}, "
              f"max rel err {row['max_rel_err']:.2e}") + f" [{time.monotonic() - t0:.0f} s]", flush=True)
        torch.cuda.empty_cache()
        if "error" in row:
            break
    if "stopped" in doc:
        print(f"[bench] {doc['stopped']}")
    print(format_rows(doc["rows"]))
    print(f"[bench] wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
