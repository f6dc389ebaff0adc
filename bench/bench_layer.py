#!/usr/bin/env python3
"""Time one MoE layer: the TorchTitan-style torch baseline and every available prime_kernels backend,
on the same inputs in the same run.

    python bench/bench_layer.py                       # default GPU run (H200: a few minutes)
    python bench/bench_layer.py --smoke               # tiny CPU-runnable check of every code path
    torchrun --nproc-per-node 8 bench/bench_layer.py  # expert parallelism (tokens are per rank)

Backends: "torch" (baseline), "torch_fp8" (the same TorchTitan-style layer with every expert GEMM, forward, dgrad and
wgrad, in e4m3 with rowwise fp32 scales through torch._scaled_grouped_mm: bench_common.torch_fp8_moe; single rank;
its rows say precision "fp8"; in the default list only with --precision fp8 or fp8_bwd; ratio_vs_torch stays
relative to the BF16 torch row), "deep_gemm" (backend="auto", what a user gets: the fused kernel of each
direction where prime_kernels.status() says it is available, else the grouped pipeline; the log says which), "deep_gemm_grouped" (the single-rank pipeline of our grouped GEMMs, prime_kernels.mega._grouped),
"deep_gemm_torch_gemms" (that pipeline with torch's grouped GEMM in place of ours, prime_kernels.grouped_gemm_torch
forced: the path for GPUs without our sm90 kernels, timed on one that has them; bf16, no clamp; only when requested),
"deep_gemm_reference" (the pure-PyTorch reference; by default timed only at
T <= --reference-max-tokens because it is slow), "sonicmoe" (the SonicMoE package as a peer, bench/peer_sonicmoe.py;
in the default list only when it imports; a requested peer that cannot run gets rows with "skipped": the reason,
e.g. the exact import error). The "deep_gemm*" labels name our backends: the results files have used them since
the first run, and docs/performance.md compares across runs. Timing: CUDA events, --warmup runs then the median
of --iters; fwd with autograd on, fwdbwd = forward + torch.autograd.grad, bwd = fwdbwd - fwd; with
--inference also infer = the forward under torch.no_grad() (nothing saved for a backward). Peak
memory: reset_peak_memory_stats before a grad-enabled forward (fwd rows), a no-grad one (infer rows) or
forward+backward (bwd, fwdbwd rows), inputs and weights resident: peak_mem_gib, and added_mem_gib = that peak less
what was allocated just before the call; each call starts with the FP8 weight caches empty, as after an optimizer
step, so an FP8 row's memory counts the weight copies it makes (the forward's, and the backward's transposes) and no
copy an earlier call left. max_rel_err (non-torch rows): the largest
||out - ref|| / ||ref|| against the reference evaluated in float64 on the same inputs, over y (fwd,
infer) and also dX, d topk_weights, dW13, dW2 (bwd, fwdbwd). floor_ms: the fastest any layer could be on
the row's useful FLOPs, measured once per (shape, T) in the same run with the same timer: the forward's two
GEMMs as dense cuBLAS products (fwd, infer), the backward's four (dgrad and wgrad of both layers) plus the time
to write the weight gradients at the bandwidth of a large device copy (bwd), both (fwdbwd); ms_over_floor =
ms / floor_ms. With EP every number is the slowest (largest) over the ranks. Results: JSON in bench/results/
(fields: docs/performance.md), a table, and a PNG.

--shared-experts S adds S shared experts (DeepSeek / Qwen2-MoE style: every token goes through each, weight 1) of
intermediate --shared-intermediate (default: the shape's I) to every row's layer: our backends pass them to
mega_moe (shared_w13 [S, 2Is, H], shared_w2 [S, H, Is]; their gradients are checked like the routed weights'), the
torch baseline adds one dense bf16 SwiGLU MLP per shared expert to torch_moe (bench_common.torch_shared_experts),
torch_fp8 and the peers have no shared experts and get skipped rows; TFLOP/s and floor_ms count the shared
experts' FLOPs (6 T H Is each forward, 12 T H Is backward) and floor_ms their weight-gradient writes too. Rows
record shared_experts and shared_intermediate (0 and None without).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import peer_sonicmoe  # noqa: E402

BACKENDS = ("torch", "torch_fp8", "deep_gemm", "deep_gemm_grouped", "deep_gemm_torch_gemms", "deep_gemm_reference",
            "sonicmoe")
TORCH_GEMMS = "deep_gemm_torch_gemms"
PEERS = ("sonicmoe",)  # other libraries' layers: timed and checked like ours, skipped with a reason when unusable


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b",
                   help=f"comma list from {sorted(bc.SHAPES)}, e<E>-h<H>-i<I>-k<K> names, or 'grid' "
                        f"(bench_common.grid_shapes(): E x (H, I) at top-8)")
    p.add_argument("--tokens", default="4096,16384", help="comma list of tokens per rank")
    p.add_argument("--routings", default="uniform,zipf", help="comma list from uniform,zipf")
    p.add_argument("--backends", default=None,
                   help=f"comma list from {BACKENDS} (default: all of them, sonicmoe only when it imports, "
                        f"torch_fp8 only with --precision fp8 or fp8_bwd)")
    p.add_argument("--reference-max-tokens", type=int, default=4096,
                   help="time deep_gemm_reference only at T <= this (it is slow); 0 = no limit")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2,
                   help="timing rounds interleaved over the backends; the best median of the rounds is reported")
    p.add_argument("--sustained-seconds", type=float, default=0.0,
                   help="also time each backend's fwd and fwd+bwd in the steady state: after this many seconds of "
                        "back-to-back calls, the mean of 10 more (rows gain ms_sustained, ratio_sustained); 0 = off")
    p.add_argument("--inference", action="store_true",
                   help="also time every backend's forward under torch.no_grad() (direction 'infer')")
    p.add_argument("--no-check", action="store_true", help="skip max_rel_err (the float64 evaluation)")
    p.add_argument("--check-max-tokens", type=int, default=0,
                   help="compute max_rel_err only at T <= this (0 = always)")
    p.add_argument("--recompute", action="store_true", help="deep_gemm backends recompute h in the backward")
    p.add_argument("--keep-pooled-x", choices=("auto", "on", "off"), default="auto",
                   help="deep_gemm backends' keep_pooled_x: auto = the library default (None: kept when the "
                        "fused forward runs and the backward needs them), on = True, off = False")
    p.add_argument("--activation-clamp", type=float, default=None)
    p.add_argument("--precision", choices=("bf16", "fp8", "fp8_bwd"), default="bf16",
                   help="of our backends and the reference (torch and the peers run bf16, torch_fp8 fp8)")
    p.add_argument("--shared-experts", type=int, default=0,
                   help="shared experts per layer (every token through each, weight 1); 0 = none")
    p.add_argument("--shared-intermediate", type=int, default=None,
                   help="intermediate size of each shared expert (default: the shape's I)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=10.0,
                   help="stop starting new configurations after this many minutes (results so far are kept)")
    p.add_argument("--peak-n", type=int, default=8192, help="size of the bf16 matmul that measures the peak")
    p.add_argument("--copy-mib", type=int, default=1024,
                   help="MiB of the device copy whose bandwidth prices the weight-gradient writes in bwd floor_ms")
    p.add_argument("--out", default=None, help="results JSON path (default bench/results/layer_<gpu>_<date>.json)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape, few iterations, CPU-runnable; results go to a temp dir unless --out")
    a = p.parse_args(argv)
    if a.shared_experts < 0:
        p.error(f"--shared-experts must be >= 0, got {a.shared_experts}")
    if a.shared_intermediate is not None and (a.shared_intermediate < 1 or not a.shared_experts):
        p.error(f"--shared-intermediate must be a positive int and needs --shared-experts > 0, got "
                f"{a.shared_intermediate} with --shared-experts {a.shared_experts}")
    if a.smoke:  # smoke defaults, unless given on the command line
        for name, value in (("shapes", "smoke"), ("tokens", "64,130"), ("warmup", 2), ("iters", 5), ("peak_n", 256),
                            ("copy_mib", 8)):
            if getattr(a, name) == p.get_default(name):
                setattr(a, name, value)
    return a


def _split(s):
    return [v.strip() for v in s.split(",") if v.strip()]


def _fused_state():
    """(fwd_reason, bwd_reason) of the bf16 fused kernels (None = available)."""
    from prime_kernels.mega._backend import _fused_reason

    return _fused_reason("bf16", "fwd"), _fused_reason("bf16", "bwd")


def _shared_dims(I: int, args) -> tuple[int, int | None]:
    """(S, Is) of the rows: the shared experts and their intermediate size, (0, None) without."""
    if not args.shared_experts:
        return 0, None
    return args.shared_experts, args.shared_intermediate or I


def _useful_flops(routes: int, T: int, H: int, I: int, S: int, Is: int | None, direction: str) -> float:
    """The row's useful FLOPs (bench_common.layer_flops): the routed experts' over their unmasked routes, plus each
    of the S shared experts' over all T tokens (6 T H Is forward, 12 T H Is backward each)."""
    return bc.layer_flops(routes, H, I, direction) + (bc.layer_flops(T * S, H, Is, direction) if S else 0.0)


# Backends with no shared experts: with --shared-experts they get skipped rows with the reason.
NO_SHARED = {"torch_fp8": "the torch_fp8 baseline has no shared experts (--shared-experts)",
             "sonicmoe": "the sonicmoe adapter has no shared experts (--shared-experts)"}


def _layer_fn(backend, group, E, args):
    """fn(x, topk_idx, topk_weights, w13, w2, *shared) -> y, shared = () or (shared_w13, shared_w2)."""
    if backend == "torch":
        def torch_layer(x, i, w, a, b, *shared):
            y = bc.torch_moe(x, i, w, a, b, group=group)
            # a trainer's bf16 add of the shared MLPs' output (ours sums in fp32 and rounds once)
            return y + bc.torch_shared_experts(x, *shared) if shared else y
        return torch_layer
    if backend == "torch_fp8":
        return lambda x, i, w, a, b: bc.torch_fp8_moe(x, i, w, a, b, group=group)
    if backend == "sonicmoe":
        return peer_sonicmoe.sonicmoe_layer
    from prime_kernels.mega import mega_moe

    which = {"deep_gemm": "auto", "deep_gemm_grouped": "grouped", TORCH_GEMMS: "grouped"}.get(backend, "reference")
    keep = {"auto": None, "on": True, "off": False}[args.keep_pooled_x]

    def ours(x, i, w, a, b, *shared):
        sw13, sw2 = shared if shared else (None, None)
        return mega_moe(x, i, w, a, b, group=group, num_experts=E, backend=which, precision=_precision(backend, args),
                        recompute=args.recompute, activation_clamp=args.activation_clamp, keep_pooled_x=keep,
                        shared_w13=sw13, shared_w2=sw2)
    return ours


def _precision(backend, args):
    """The precision a backend's rows run in: --precision for ours and the reference, fp8 for torch_fp8, bf16 for
    the others."""
    if backend == "torch_fp8":
        return "fp8"
    return "bf16" if backend in ("torch", "sonicmoe") else args.precision


def _in_context(backend, fn):
    """fn run with torch's grouped GEMM forced in place of ours for the deep_gemm_torch_gemms rows (forward and the
    backward that autograd.grad runs inside the same call), as it is for the others."""
    if backend != TORCH_GEMMS:
        return fn

    def call():
        from prime_kernels.grouped_gemm_torch import forced

        with forced():
            return fn()
    return call


def _no_grad(fn):
    """fn called under torch.no_grad(): the layer as inference calls it (no state saved for a backward)."""
    def call():
        with torch.no_grad():
            return fn()
    return call


def _free(device):
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _peak_as_in_a_step(fn, device):
    """(peak, added) GiB of one ``fn()`` that starts, as a training step's first call after an optimizer step does,
    with the FP8 weight caches empty: the FP8 copies it makes count (a forward makes the weights', its backward their
    transposes), and none left by earlier calls (a backward's transposes held before a forward) does."""
    from prime_kernels.mega.fp8 import empty_weight_caches

    empty_weight_caches()
    _free(device)
    return bc.peak_and_added_mem_gib(fn, device)


def _peer_failure(fn, leaves, idx, dy, args):
    """None when the peer layer runs a forward, a backward and (with --inference) a no-grad forward on these
    inputs (the first call also compiles what it JIT-compiles, outside the timings); else the exception as
    ``Type: message``. ``leaves``: (x, topk_weights, w13, w2), no shared experts (peers have none)."""
    xl, wl, w13l, w2l = leaves
    if bool((idx < 0).any()):
        return "masked routes (topk_idx < 0): the peer adapters take every route as valid"
    try:
        torch.autograd.grad(fn(xl, idx, wl, w13l, w2l), leaves, dy)
        if args.inference:
            with torch.no_grad():
                fn(xl, idx, wl, w13l, w2l)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _floor(shape, T, routes, grad_bytes, args, device, cache, copy_gbps):
    """floor_ms per direction for (shape, T), measured at its first configuration and kept in ``cache``: the
    dense-GEMM times (best of --rounds) and, for the backward, the weight-gradient write at ``copy_gbps``
    (``grad_bytes``: every weight gradient, the shared experts' included). With shared experts the dense times add
    the shared experts' GEMMs as dense products over T * S rows of intermediate Is (their useful FLOPs: every token
    through each), timed apart from the routed ones since Is may differ from I."""
    _, H, I, _ = bc.shape_dims(shape)
    S, Is = _shared_dims(I, args)
    key = (shape, T, routes, S, Is)
    if key not in cache:
        parts = [(routes, I)] + ([(T * S, Is)] if S and T else [])
        fwd = bwd = 0.0
        for rows, inter in parts:
            dense = None
            for _ in range(max(1, args.rounds)):
                d = bc.dense_gemm_ms(rows, H, inter, device, args.warmup, args.iters)
                dense = d if dense is None else {k: min(dense[k], d[k]) for k in d}
            _free(device)
            fwd, bwd = fwd + dense["fwd"], bwd + dense["bwd"]
        fwd, bwd = bc.reduce_max(fwd, device), bc.reduce_max(bwd, device)
        write = bc.reduce_max(grad_bytes / (copy_gbps * 1e9) * 1e3, device)
        cache[key] = {"shape": shape, "tokens": T, "routes": routes, "dense_fwd_ms": round(fwd, 4),
                      "dense_bwd_ms": round(bwd, 4), "weight_grad_bytes": grad_bytes,
                      "weight_grad_write_ms": round(write, 4),
                      "floor_ms": {"fwd": fwd, "infer": fwd, "bwd": bwd + write, "fwdbwd": fwd + bwd + write}}
        if S:
            cache[key].update(shared_experts=S, shared_intermediate=Is)
    return cache[key]["floor_ms"]


def _skipped_rows(shape, T, routing, ep, backends, reason, args):
    """The rows of backends that did not run at one configuration, each direction with the reason."""
    E, H, I, K = bc.shape_dims(shape)
    S, Is = _shared_dims(I, args)
    return [{"shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K,
             "shared_experts": S, "shared_intermediate": Is, "tokens": T,
             "ep": ep, "routing": routing, "precision": _precision(b, args), "backend": b, "direction": d,
             "ms": None, "tflops": None, "pct_peak": None, "pct_peak_fp8": None, "ratio_vs_torch": None,
             "peak_mem_gib": None, "added_mem_gib": None, "max_rel_err": None, "skipped": reason}
            for b in backends for d in ("fwd", "bwd", "fwdbwd") + (("infer",) if args.inference else ())]


def _ratio(baseline_ms: float, ms: float) -> float:
    """baseline / ours to four significant digits (three decimals would print a row 2000x slower as 0.0)."""
    return float(f"{baseline_ms / ms:.4g}")


def bench_config(shape, T, routing, backends, args, device, group, peak, skipped=None, floors=None, copy_gbps=None,
                 peak_fp8=None):
    """Rows of every backend at one configuration. ``skipped``: {backend: reason} of requested backends that
    cannot run at all (they get rows with the reason); ``floors``: the cache of floor_ms per (shape, T) and
    ``copy_gbps`` the run's copy bandwidth (floor_ms is left out without them)."""
    E, H, I, K = bc.shape_dims(shape)
    S, Is = _shared_dims(I, args)
    rank, ep = bc.world()
    w13, w2 = bc.make_weights(E, H, I, args.seed, device, rank, ep)
    # the shared experts' weights are leaves like the routed ones: every backward computes their gradients
    shared = bc.make_shared_weights(S, H, Is, args.seed, device) if S else ()
    x, idx, w, dy = bc.make_tokens(T, E, H, K, routing, args.seed + T, device, rank)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2, *shared)]
    xl, wl = leaves[:2]
    weights = leaves[2:]  # w13, w2, then shared_w13, shared_w2 with --shared-experts
    routes = int((idx >= 0).sum())
    floor = None
    if floors is not None and copy_gbps:
        grad_bytes = sum(t.numel() * t.element_size() for t in weights)  # dW13 + dW2 (+ the shared experts')
        floor = _floor(shape, T, routes, grad_bytes, args, device, floors, copy_gbps)
    skipped = dict(skipped or {})
    for backend in [b for b in backends if b in PEERS and b not in skipped]:
        why = _peer_failure(_layer_fn(backend, group, E, args), leaves[:4], idx, dy, args)
        if why is not None:
            skipped[backend] = why
            if rank == 0:
                print(f"[bench] {shape} T={T} {routing}: skipping backend {backend}: {why}")
    backends = [b for b in backends if b not in skipped]
    results, outputs = {}, {}
    for backend in backends:
        fn = _layer_fn(backend, group, E, args)
        fwd = _in_context(backend, lambda: fn(xl, idx, wl, *weights))
        with_bwd = True
        fwdbwd = _in_context(backend, lambda: torch.autograd.grad(fwd(), leaves, dy))
        infer = _no_grad(fwd)
        _free(device)
        res = {"fwd": bc.time_ms(fwd, device, args.warmup, args.iters)}
        res["mem_fwd"], res["added_fwd"] = _peak_as_in_a_step(fwd, device)
        if args.inference:
            res["infer"] = bc.time_ms(infer, device, args.warmup, args.iters)
            res["mem_infer"], res["added_infer"] = _peak_as_in_a_step(infer, device)
        if with_bwd:
            res["fwdbwd"] = bc.time_ms(fwdbwd, device, args.warmup, args.iters)
            res["bwd"] = res["fwdbwd"] - res["fwd"]
            res["mem_fwdbwd"], res["added_fwdbwd"] = _peak_as_in_a_step(fwdbwd, device)
        if backend != "torch" and not args.no_check and (not args.check_max_tokens or T <= args.check_max_tokens):
            def check_run():
                y = fwd()
                return y, (torch.autograd.grad(y, leaves, dy) if with_bwd else None)

            y, grads = _in_context(backend, check_run)()
            outputs[backend] = (y.detach(), grads, infer() if args.inference else None)
        results[backend] = res
        _free(device)
    # Further rounds, interleaved over the backends: each figure is the best median of its rounds, so a
    # transient in one round (seen once: a 1.5x slower first configuration of a run) does not decide it.
    for _ in range(1, max(1, args.rounds)):
        for backend in backends:
            fn = _layer_fn(backend, group, E, args)
            fwd = _in_context(backend, lambda: fn(xl, idx, wl, *weights))
            fwdbwd = _in_context(backend, lambda: torch.autograd.grad(fwd(), leaves, dy))
            res = results[backend]
            res["fwd"] = min(res["fwd"], bc.time_ms(fwd, device, args.warmup, args.iters))
            res["fwdbwd"] = min(res["fwdbwd"], bc.time_ms(fwdbwd, device, args.warmup, args.iters))
            res["bwd"] = res["fwdbwd"] - res["fwd"]
            if args.inference:
                res["infer"] = min(res["infer"], bc.time_ms(_no_grad(fwd), device, args.warmup, args.iters))
            _free(device)
    if args.sustained_seconds > 0:
        for backend in backends:
            fn = _layer_fn(backend, group, E, args)
            fwd = _in_context(backend, lambda: fn(xl, idx, wl, *weights))
            fwdbwd = _in_context(backend, lambda: torch.autograd.grad(fwd(), leaves, dy))
            res = results[backend]
            res["fwd_sustained"] = bc.sustained_ms(fwd, device, args.sustained_seconds)
            res["fwdbwd_sustained"] = bc.sustained_ms(fwdbwd, device, args.sustained_seconds)
            res["bwd_sustained"] = res["fwdbwd_sustained"] - res["fwd_sustained"]
            if args.inference:
                res["infer_sustained"] = bc.sustained_ms(_no_grad(fwd), device, args.sustained_seconds)
            _free(device)

    errs = {}
    if outputs:
        from prime_kernels.mega import mega_moe

        ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, w13, w2, *shared)]
        sw13, sw2 = ref_leaves[4:] if S else (None, None)
        y64 = mega_moe(ref_leaves[0], idx, ref_leaves[1], ref_leaves[2], ref_leaves[3], group=group, num_experts=E,
                       backend="reference", activation_clamp=args.activation_clamp, shared_w13=sw13, shared_w2=sw2)
        g64 = torch.autograd.grad(y64, ref_leaves, dy.double())
        for backend, (y, grads, y_infer) in outputs.items():
            e_fwd = bc.rel_err(y, y64)
            e_bwd = None
            if grads is not None:
                e_bwd = max([e_fwd] + [bc.rel_err(g, r) for g, r in zip(grads, g64)])
            errs[backend] = {"fwd": e_fwd, "bwd": e_bwd, "fwdbwd": e_bwd,
                             "infer": None if y_infer is None else bc.rel_err(y_infer, y64)}
        del y64, g64, ref_leaves, outputs
        _free(device)

    rows = []
    for backend, res in results.items():
        for direction in ("fwd", "bwd", "fwdbwd", "infer"):
            if direction not in res:
                continue
            per_rank = bc.gather_values(res[direction], device)
            ms = max(per_rank)  # the slowest rank's
            mem_key = {"fwd": "fwd", "infer": "infer"}.get(direction, "fwdbwd")
            mem = bc.reduce_max(res[f"mem_{mem_key}"], device)
            added = bc.reduce_max(res[f"added_{mem_key}"], device)
            flops = _useful_flops(routes, T, H, I, S, Is, direction)
            tflops = flops / (ms * 1e-3) / 1e12 if ms > 0 else None
            tflops = bc.reduce_max(tflops, device)  # per rank; with EP the slowest rank sets ms anyway
            row = {
                "shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K,
                "shared_experts": S, "shared_intermediate": Is, "tokens": T, "ep": ep, "routing": routing,
                "precision": _precision(backend, args), "backend": backend,
                "direction": direction, "ms": round(ms, 4), "tflops": None if tflops is None else round(tflops, 2),
                "pct_peak": None if tflops is None else round(100.0 * tflops / peak, 2),
                "pct_peak_fp8": None if tflops is None or not peak_fp8 else round(100.0 * tflops / peak_fp8, 2),
                "ratio_vs_torch": None,
                "peak_mem_gib": None if mem is None else round(mem, 3),
                "added_mem_gib": None if added is None else round(added, 3),
            }
            if ep > 1:  # every rank's time; ms is the slowest
                row["ms_per_rank"] = [round(v, 4) for v in per_rank]
            if f"{direction}_sustained" in res:
                row["ms_sustained"] = round(bc.reduce_max(res[f"{direction}_sustained"], device), 4)
                row["ratio_sustained"] = None
            if backend != "torch":
                e = errs.get(backend)
                err = None if e is None else e[direction]
                row["max_rel_err"] = bc.reduce_max(err, device)
            rows.append(row)
    for backend, reason in skipped.items():
        rows += _skipped_rows(shape, T, routing, ep, [backend], reason, args)
    torch_ms = {r["direction"]: r["ms"] for r in rows if r["backend"] == "torch"}
    torch_sus = {r["direction"]: r.get("ms_sustained") for r in rows if r["backend"] == "torch"}
    for r in rows:
        if floor is not None:
            r["floor_ms"] = round(floor[r["direction"]], 4)
            r["ms_over_floor"] = round(r["ms"] / floor[r["direction"]], 3) if r["ms"] is not None else None
        t = torch_ms.get(r["direction"])
        if t and r["ms"] is not None and r["ms"] > 0:
            r["ratio_vs_torch"] = _ratio(t, r["ms"])  # > 1: faster than the torch baseline
        t = torch_sus.get(r["direction"])
        if t and r.get("ms_sustained"):
            r["ratio_sustained"] = _ratio(t, r["ms_sustained"])
    return rows


def main(argv=None):
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    group = bc.init_distributed_from_env(device)
    rank, ep = bc.world()
    log = print if rank == 0 else (lambda *a, **k: None)
    peer_errors = {"sonicmoe": peer_sonicmoe.import_error()}  # None = it imports
    if args.backends is None:
        backends = [b for b in BACKENDS if (b not in PEERS or peer_errors[b] is None)
                    and (b != "torch_fp8" or args.precision in ("fp8", "fp8_bwd")) and b != TORCH_GEMMS]
        for b in PEERS:
            if peer_errors[b] is not None:
                log(f"[bench] {b} is not in the default backends: {peer_errors[b]}")
    else:
        backends = _split(args.backends)
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}: choose from {BACKENDS}")
    # requested peers that cannot run at all: every configuration gets their rows with the reason
    skipped = {}
    for b in (b for b in backends if b in PEERS):
        if peer_errors[b] is not None:
            skipped[b] = f"import {b} failed: {peer_errors[b]}"
        elif ep > 1:
            skipped[b] = f"the {b} adapter has no expert parallelism (ep={ep})"
    if "torch_fp8" in backends and ep > 1:
        skipped["torch_fp8"] = f"torch_fp8 runs on a single rank only (ep={ep})"
    if args.shared_experts:
        for b in (b for b in backends if b in NO_SHARED):
            skipped.setdefault(b, NO_SHARED[b])  # a reason found above (an import error) stays the one reported
    for b, why in skipped.items():
        log(f"[bench] skipping backend {b}: {why}")
    shapes = [g for s in _split(args.shapes) for g in (bc.grid_shapes() if s == "grid" else [s])]
    for s in shapes:
        try:
            num_experts = bc.shape_dims(s)[0]
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if num_experts % ep:
            raise SystemExit(f"shape {s}: {num_experts} experts do not divide over {ep} ranks")
    fused_fwd_reason, fused_bwd_reason = _fused_state()
    if "deep_gemm" in backends:
        # backend="auto" must resolve to one of our kernel paths in both directions (never the reference)
        from prime_kernels.mega._backend import _grouped_reason

        impl, why = [], None
        for r in (fused_fwd_reason, fused_bwd_reason):
            g = _grouped_reason("bf16", ep, args.activation_clamp)
            if r is None:
                impl.append("fused")
            elif g is None and torch.device(device).type == "cuda":
                impl.append("grouped")
            else:
                why = f"{r}; {g or 'tensors are not on CUDA'}"
        if why is None:
            log(f"[bench] deep_gemm = backend 'auto': fwd {impl[0]}, bwd {impl[1]}")
        else:
            log(f"[bench] skipping backend deep_gemm (backend 'auto' has no kernel path here): {why}")
            backends.remove("deep_gemm")
    if "deep_gemm_grouped" in backends:
        from prime_kernels.mega._backend import _grouped_reason

        why = _grouped_reason("bf16", ep, args.activation_clamp)
        if why is not None:
            log(f"[bench] skipping backend deep_gemm_grouped: {why}")
            backends.remove("deep_gemm_grouped")
    if TORCH_GEMMS in backends:
        from prime_kernels.mega._backend import _grouped_reason

        why = (f"torch {torch.__version__} has no torch._grouped_mm" if not hasattr(torch, "_grouped_mm") else
               "tensors are not on CUDA" if torch.device(device).type != "cuda" else
               "bf16 only" if args.precision != "bf16" else
               "no activation_clamp (its L1 keeps no fp32 h)" if args.activation_clamp is not None else
               _grouped_reason("bf16", ep, None))
        if why is not None:
            log(f"[bench] skipping backend {TORCH_GEMMS}: {why}")
            backends.remove(TORCH_GEMMS)
    if args.shared_experts and any(b in backends for b in ("deep_gemm", "deep_gemm_grouped", TORCH_GEMMS)):
        # the kernels take the shared experts' Is under the routed I's alignment rule: refuse here, before any timing
        from prime_kernels.mega._backend import alignment_reason

        for s in shapes:
            _, H, I, _ = bc.shape_dims(s)
            why = alignment_reason(H, _shared_dims(I, args)[1], args.precision)
            if why is not None:
                raise SystemExit(f"shape {s} with --shared-experts {args.shared_experts}: {why}")

    t0 = time.time()
    peak = bc.reduce_max(bc.bf16_peak_tflops(device, args.peak_n, args.warmup, args.iters), device)
    copy_gbps = bc.copy_gbps(device, args.copy_mib, args.warmup, args.iters)
    copy_gbps = -bc.reduce_max(-copy_gbps, device)  # the slowest rank's
    # FP8 rows are also measured against the card's FP8 matmul rate (pct_peak_fp8), timed in this run
    want_fp8 = args.precision != "bf16" or "torch_fp8" in backends
    peak_fp8 = bc.reduce_max(bc.fp8_peak_tflops(device, args.peak_n, args.warmup, args.iters), device) if want_fp8 else None
    header = bc.run_header(device, peak)
    if peak_fp8:
        header["peak_fp8_tflops"] = round(peak_fp8, 2)
    log(f"[bench] {header['gpu']} x{max(1, header['num_gpus'])}, torch {header['torch']}, cuda {header['cuda']}, "
        f"ep={ep}, bf16 peak {peak:.1f} TFLOP/s ({args.peak_n}^3 matmul), copy {copy_gbps:.0f} GB/s "
        f"({args.copy_mib} MiB)")
    floors = {}
    rows = []
    stopped = False
    for shape in shapes:
        for T in (int(t) for t in _split(args.tokens)):
            for routing in _split(args.routings):
                over = (time.time() - t0) / 60.0 > args.max_minutes
                if bc.reduce_max(1.0 if over else 0.0, device):
                    stopped = True
                    break
                bks = [b for b in backends
                       if not (b == "deep_gemm_reference" and args.reference_max_tokens
                               and T > args.reference_max_tokens)]
                try:
                    cfg = bench_config(shape, T, routing, bks, args, device, group, peak, skipped, floors, copy_gbps,
                                       peak_fp8)
                except torch.OutOfMemoryError as e:
                    # a grid corner that does not fit this card: its rows say so, the run goes on
                    _free(device)
                    why = f"out of memory: {str(e).splitlines()[0]}"
                    log(f"[bench] {shape} T={T} {routing}: {why}")
                    cfg = _skipped_rows(shape, T, routing, ep, bks, why, args)
                rows += cfg
                log(f"[bench] {shape} T={T} {routing}: done at {time.time() - t0:.0f} s")
            if stopped:
                break
        if stopped:
            break
    if stopped:
        log(f"[bench] --max-minutes={args.max_minutes} reached: later configurations were not run")

    timing = {"warmup": args.warmup, "iters": args.iters, "rounds": args.rounds,
              "statistic": "best over rounds of the median of iters CUDA-event times"}
    if args.sustained_seconds > 0:
        timing["sustained"] = (f"ms_sustained: mean of 10 back-to-back calls after {args.sustained_seconds:g} s of "
                               "back-to-back calls (one event pair)")
    doc = dict(header, timing=timing,
               options={"recompute": args.recompute, "keep_pooled_x": args.keep_pooled_x,
                        "activation_clamp": args.activation_clamp, "inference": args.inference},
               floor={"copy_mib": args.copy_mib, "copy_gbps": round(copy_gbps, 1),
                      "configs": [{k: v for k, v in f.items() if k != "floor_ms"} for f in floors.values()]},
               rows=rows)
    if rank == 0:
        print(bc.format_table(rows))
        if args.out:
            path = Path(args.out)
        elif args.smoke:
            path = Path(tempfile.gettempdir()) / "prime_kernels_bench_smoke" / "layer_smoke.json"
        else:
            path = bc.default_results_path("layer", header)
        bc.write_results(doc, path)
        print(f"[bench] wrote {path}")
        if not args.no_plot:
            import plot_results

            png = plot_results.plot(path)
            if png:
                print(f"[bench] wrote {png}")
    if bc.dist_on():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return doc


if __name__ == "__main__":
    main()
