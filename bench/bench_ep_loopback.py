#!/usr/bin/env python3
"""What the all-to-all expert-parallel path costs on one GPU: R virtual ranks of a loopback group against EP = 1.

    python3 bench/bench_ep_loopback.py --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 2048,4096 --ranks 2,4,8 \
        --chunks 1,2,4
    python3 bench/bench_ep_loopback.py --smoke --device cpu      # the CI path: a tiny shape on the CPU

For each shape, T (tokens per rank) and R, the same work two ways on the one device:

* ``ep1``: the grouped backend's forward and backward (``_backend.forward`` / ``backward``, no autograd) over all
  R * T tokens with all E experts, on one stream;
* ``loopback``: a :class:`prime_kernels.mega.LoopbackGroup` of R ranks (threads, each on its own CUDA stream), each
  with its T tokens and E / R experts, running the all-to-all path (``prime_kernels.mega._grouped_ep``): the plan's
  two all-gathers, the forward's two exchanges, the backward's two, the combines on the source ranks.

Both are timed as wall-clock time per iteration (``torch.cuda.synchronize`` before and after a batch of iterations),
host work included: the loopback ranks' host work is serialised by the GIL and their kernels share one GPU, so the
ratio loopback / ep1 is the path's overhead on one card (its plan, its exchanges as device copies, its host syncs),
not the speed of a multi-GPU run, where each rank has a GPU of its own and the exchanges cross NVLink or the network.
The outputs of the two are compared bit for bit on every run (``bitwise``), as the tests do.

Results: a table on stdout and a JSON (``--out``, default bench/results/ep_loopback_<gpu>_<date>.json) with the
run's header (GPU, torch, git sha) and one row per (shape, T, R, routing, chunks): ep1_ms, loopback_ms, overhead,
bitwise. ``--chunks`` times the bf16 path in that many chunks (each chunk's exchange under another's GEMMs), the
measurement that is to set the path's chunk count.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b", help=f"comma list from {sorted(bc.SHAPES)}")
    p.add_argument("--tokens", default="2048,4096", help="comma list of tokens per rank")
    p.add_argument("--ranks", default="2,4,8", help="comma list of virtual rank counts (each must divide E)")
    p.add_argument("--routings", default="uniform", help="comma list from uniform,zipf")
    p.add_argument("--precision", choices=("bf16", "fp8", "fp8_bwd"), default="bf16")
    p.add_argument("--chunks", default="1", help="comma list of chunk counts of the path (bf16; 1: one exchange)")
    p.add_argument("--num-sms", default="0",
                   help="comma list of the SMs the loopback path's kernels may use (0: all; fewer leave SMs to the "
                        "exchanges running beside the GEMMs)")
    p.add_argument("--link-gbps", default="0",
                   help="comma list of modelled link bandwidths in GB/s for the loopback exchanges (0: none, the "
                        "copies alone; see LoopbackGroup's link_gbps)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=8.0,
                   help="stop starting new configurations after this many minutes (results so far are kept)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default=None, help="results JSON path")
    p.add_argument("--trace", default=None,
                   help="directory: profile one loopback call of every configuration into a gzipped chrome trace "
                        "there, and add each rank's GEMM, other-kernel and exchange-under-GEMM times to its row")
    p.add_argument("--smoke", action="store_true", help="tiny shape, few iterations, CPU-runnable")
    a = p.parse_args(argv)
    if a.smoke:
        for name, value in (("shapes", "smoke"), ("tokens", "40"), ("ranks", "2,4"), ("warmup", 1), ("iters", 2)):
            if getattr(a, name) == p.get_default(name):
                setattr(a, name, value)
    return a


def _split(s: str) -> list[str]:
    return [v.strip() for v in s.split(",") if v.strip()]


def _layer(x, idx, w, w13, w2, dy, *, group, num_experts: int, tmax: int | None, precision: str, chunks: int = 1,
           num_sms: int = 0):
    """(y, dx, dtopk, dw13, dw2) of the grouped backend's forward and backward, without autograd."""
    from prime_kernels.mega import _backend, _comm

    ep = _comm.world_size(group)
    fwd = _backend.forward("grouped", x, idx, w, w13, w2, precision=precision, activation_clamp=None, group=group,
                           num_experts=num_experts, ep_size=ep, max_tokens_per_rank=tmax, block_m=128, save_h=True,
                           ep_chunks=chunks, num_sms=num_sms)
    y, h, counts, offsets, src, srank, r2p, _ = fwd
    dx, dtopk, dw13, dw2 = _backend.backward("grouped", dy, x, idx, w, w13, w2, h, counts, offsets, src, srank, r2p,
                                             precision=precision, activation_clamp=None, group=group,
                                             num_experts=num_experts, recompute=False, need_wgrad=True,
                                             ep_chunks=chunks, num_sms=num_sms)
    return y, dx, dtopk, dw13, dw2


_GEMM = re.compile(r"grouped_.*(gemm|swiglu)")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def trace_overlap(trace: dict) -> list[dict]:
    """Per rank (host thread) of a chrome trace of one loopback call: the GPU time of its exchange work (every kernel
    and copy it launched on a stream other than the one its GEMMs ran on) and how much of it ran while one of its own
    GEMMs ran. Kernels are tied to the thread that launched them through the runtime call's correlation id."""
    events = trace.get("traceEvents", [])
    launcher = {e["args"]["correlation"]: e["tid"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    per_thread: dict = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or e.get("ph") != "X":
            continue
        tid = launcher.get(e.get("args", {}).get("correlation"))
        if tid is None:
            continue
        per_thread.setdefault(tid, []).append((e["name"], e["args"].get("stream"), e["ts"], e["ts"] + e["dur"]))
    out = []
    for tid, evs in per_thread.items():
        gemms = [(a, b, st) for name, st, a, b in evs if _GEMM.search(name)]
        if not gemms:
            continue
        compute = {st for _, _, st in gemms}
        busy = _union([(a, b) for a, b, _ in gemms])
        comm = [(a, b) for _, st, a, b in evs if st not in compute]
        total = sum(b - a for a, b in comm)
        hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in busy)
        out.append({"thread": tid, "gemm_us": round(sum(b - a for a, b, _ in gemms), 1),
                    "glue_us": round(sum(b - a for name, _, a, b in evs if not _GEMM.search(name)), 1),
                    "exchange_us": round(total, 1), "under_own_gemms_us": round(hidden, 1),
                    "fraction": round(hidden / total, 3) if total else 0.0})
    return out


def run_config(shape: str, T: int, R: int, routing: str, chunks: int, num_sms: int, link: float, args,
               device) -> dict:
    from prime_kernels.mega import LoopbackGroup

    E, H, I, K = bc.shape_dims(shape)
    if E % R:
        raise ValueError(f"{R} ranks do not divide {E} experts")
    El = E // R
    w13, w2 = bc.make_weights(E, H, I, args.seed, device)
    parts = [bc.make_tokens(T, E, H, K, routing, args.seed + T, device, rank=r) for r in range(R)]
    x, idx, w, dy = (torch.cat([p[i] for p in parts]) for i in range(4))
    group = LoopbackGroup(R, timeout_s=300, link_gbps=link or None)

    def rank_args(r):
        sl, es = slice(r * T, (r + 1) * T), slice(r * El, (r + 1) * El)
        return (x[sl].contiguous(), idx[sl].contiguous(), w[sl].contiguous(), w13[es].contiguous(),
                w2[es].contiguous(), dy[sl].contiguous())

    per_rank = [rank_args(r) for r in range(R)]

    def loop_once():
        return group.run(lambda r: _layer(*per_rank[r], group=group, num_experts=E, tmax=T,
                                          precision=args.precision, chunks=chunks, num_sms=num_sms),
                         device=device)

    def ep1_once():
        return _layer(x, idx, w, w13, w2, dy, group=None, num_experts=E, tmax=None, precision=args.precision)

    want = ep1_once()
    got = loop_once()
    bitwise = all(torch.equal(got[r][i], want[i][r * T:(r + 1) * T]) for r in range(R) for i in range(3)) and all(
        torch.equal(got[r][i], want[i][r * El:(r + 1) * El]) for r in range(R) for i in (3, 4))
    del want, got
    ep1_ms = bc.wall_ms(ep1_once, device, args.warmup, args.iters)
    loop_ms = bc.wall_ms(loop_once, device, args.warmup, args.iters)
    overlap = None
    if args.trace and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop_once()
            bc.sync(device)
        trace_dir = Path(args.trace)
        trace_dir.mkdir(parents=True, exist_ok=True)
        raw = trace_dir / f"ep_loopback_{shape}_T{T}_R{R}_{routing}_c{chunks}_sms{num_sms}_link{link:g}.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        with gzip.open(f"{raw}.gz", "wt") as f:
            json.dump(trace, f)
        raw.unlink()
        overlap = trace_overlap(trace)
    return {"shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K, "tokens_per_rank": T,
            "ranks": R, "routing": routing, "precision": args.precision, "chunks": chunks, "num_sms": num_sms,
            "link_gbps": link,
            "ep1_ms": round(ep1_ms, 4), "loopback_ms": round(loop_ms, 4), "overhead": round(loop_ms / ep1_ms, 4),
            "bitwise": bool(bitwise), "trace_overlap": overlap}


def main(argv=None) -> int:
    args = parse_args(argv)
    # The loopback ranks are threads: with the default 5 ms switch interval a rank woken at a collective's barrier
    # waits for the GIL behind the others' host work, which serialises them far more than separate processes are.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        return _run(args)
    finally:
        sys.setswitchinterval(switch)


def _run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    header = bc.run_header(device, 0.0)
    header.pop("peak_bf16_tflops")
    rows = []
    start = time.time()
    for shape in _split(args.shapes):
        for T in (int(t) for t in _split(args.tokens)):
            for R in (int(r) for r in _split(args.ranks)):
                for routing in _split(args.routings):
                    for chunks in (int(c) for c in _split(args.chunks)):
                        for num_sms, link in ((int(n), float(g)) for n in _split(args.num_sms)
                                              for g in _split(args.link_gbps)):
                            if time.time() - start > args.max_minutes * 60:
                                print(f"[ep_loopback] out of time before {shape} T={T} R={R} {routing} "
                                      f"chunks={chunks} num_sms={num_sms} link={link:g}", flush=True)
                                break
                            row = run_config(shape, T, R, routing, chunks, num_sms, link, args, device)
                            rows.append(row)
                            print(f"[ep_loopback] {shape} T={T}/rank R={R} {routing} chunks={chunks} "
                                  f"num_sms={num_sms} link={link:g} GB/s: ep1 {row['ep1_ms']:.3f} ms, "
                                  f"loopback {row['loopback_ms']:.3f} "
                                  f"ms ({row['overhead']:.2f}x), bitwise {row['bitwise']}", flush=True)
                            for o in row["trace_overlap"] or []:
                                print(f"[ep_loopback]   rank thread {o['thread']}: GEMMs {o['gemm_us']:.0f} us, other "
                                      f"kernels {o['glue_us']:.0f} us, exchange stream {o['exchange_us']:.0f} "
                                      f"us, {o['under_own_gemms_us']:.0f} us of it under its own GEMMs "
                                      f"({o['fraction']:.0%})", flush=True)
    doc = {**header, "script": "bench/bench_ep_loopback.py", "args": vars(args),
           "timing": "wall-clock ms per forward + backward over --iters after --warmup, host work included",
           "rows": rows}
    path = Path(args.out) if args.out else bc.default_results_path("ep_loopback", header)
    bc.write_results(doc, path)
    print(f"[ep_loopback] wrote {path}")
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
