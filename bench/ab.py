#!/usr/bin/env python3
"""A/B of two builds of the library in one run: the layer forward and backward (backend="auto") at the
Qwen3-30B-A3B and Qwen3-235B-A22B shapes, T=16384, uniform routing, timed in alternating rounds.

    python bench/ab.py --old /tmp/site_old --new /tmp/site_new      # `pip install --target` folders
    python bench/ab.py --old old.whl --new new.whl                   # wheels: installed into temp folders
    python bench/ab.py --old A --new B --smoke                       # tiny shape, one round: a quick check

Every round runs one child Python process per build (PYTHONPATH = that build's folder, so the two builds never
share a process or a CUDA context); rounds go old,new / new,old / old,new ... (ABBA), so a drift of the clock
over the run (an H200 settles at its power cap) weighs on both builds alike. Both builds see the same seeded
inputs (bench_common.make_weights / make_tokens). Each child times fwd (grad enabled) and fwd+bwd with
bench_common.time_ms (bwd = fwdbwd - fwd) and returns a bitwise fingerprint of y and the gradients, so the
report also says whether the builds compute the same bits. Reported per shape and direction: the median over
rounds of new/old (each round's pair), plus the median milliseconds of each build. JSON:
bench/results/ab_<gpu>_<date>_<old>_<new>.json with bench_common's provenance fields and both builds' info.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {"30B": "qwen3-30b-a3b", "235B": "qwen3-235b-a22b", "smoke": "smoke"}
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
# the same directions timed in steady state (bench_common.sustained_ms), with --steady-seconds > 0
STEADY_DIRECTIONS = ("fwd_steady", "bwd_steady", "fwdbwd_steady")
# the board's energy per call over the same steady state (NVML, CUDA only), millijoules: at the power cap a build
# that spends more energy per call loses steady-state time though its kernels' burst times are equal
ENERGY_DIRECTIONS = ("fwd_mj", "bwd_mj", "fwdbwd_mj")


def _unit(direction: str) -> str:
    """The row keys' unit: old_ms / new_ms, or old_mj / new_mj for an energy row."""
    return "mj" if direction in ENERGY_DIRECTIONS else "ms"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="build A: a `pip install --target` folder or a .whl file")
    p.add_argument("--new", required=True, help="build B: a `pip install --target` folder or a .whl file")
    p.add_argument("--shapes", default="30B,235B", help=f"comma list from {sorted(SHAPES)}")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steady-seconds", type=float, default=1.0,
                   help="also time each direction in steady state: this many seconds of back-to-back calls, then "
                        "the mean of --iters more (bench_common.sustained_ms; the clock a training loop sees, where "
                        "the bursts' first calls run at a higher one); 0: bursts only")
    p.add_argument("--backend", default="auto", help="mega_moe backend (auto; reference for a CPU dry run)")
    p.add_argument("--precision", choices=("bf16", "fp8", "fp8_bwd"), default="bf16", help="mega_moe precision")
    p.add_argument("--child-timeout", type=float, default=900.0, help="seconds one child may take")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/ab_<gpu>_<date>_<old>_<new>.json)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, T=256, one round, few iterations; "
                                                         "results go to a temp dir unless --out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        for name, value in (("shapes", "smoke"), ("tokens", 256), ("rounds", 1), ("warmup", 2), ("iters", 5),
                            ("steady_seconds", 0.05)):
            if getattr(a, name) == p.get_default(name):
                setattr(a, name, value)
    for s in a.shapes.split(","):
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}: choose from {sorted(SHAPES)}")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    return a


def round_order(rounds: int) -> list[tuple[str, str]]:
    """ABBA: old,new then new,old, alternating."""
    return [("old", "new") if r % 2 == 0 else ("new", "old") for r in range(rounds)]


# ------------------------------------------------------------------------------------------------
# the child: one build, every shape, one timing pass
# ------------------------------------------------------------------------------------------------


def _fingerprint(t) -> str:
    """A bitwise fingerprint of a tensor (any change of a bit changes it with overwhelming probability),
    computed on the device in chunks so that a 235B weight gradient needs no host copy."""
    import torch

    flat = t.detach().contiguous().view(-1)
    flat = flat.view(torch.int16) if flat.element_size() == 2 else flat.view(torch.int32)
    acc, chunk = 0, 1 << 24
    g = torch.Generator(device=flat.device).manual_seed(12345)
    mult = torch.randint(1, 1 << 30, (chunk,), generator=g, device=flat.device, dtype=torch.int64)
    for i in range(0, flat.numel(), chunk):
        c = flat[i:i + chunk].to(torch.int64)
        acc = (acc * 1_000_003 + int((c * mult[:c.numel()]).sum().item())) % (1 << 61)
    return f"{acc:016x}:{flat.numel()}"


def child(args) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_common as bc
    import importlib

    # Builds from before the package split (the A/B baseline among them) ship the package as deep_gemm only.
    package = importlib.import_module(_package_name(Path(os.environ["PYTHONPATH"])))  # run_child sets it
    mega_moe = importlib.import_module(package.__name__ + ".mega").mega_moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"package_file": package.__file__, "build_info": package.build_info(),
           "header": bc.run_header(device, 0.0), "shapes": {}}
    for short in args.shapes.split(","):
        E, H, I, K = bc.SHAPES[SHAPES[short]]
        T = args.tokens
        w13, w2 = bc.make_weights(E, H, I, args.seed, device)
        x, idx, w, dy = bc.make_tokens(T, E, H, K, "uniform", args.seed + T, device)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
        fwd = lambda: mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], num_experts=E,  # noqa: E731
                               backend=args.backend, precision=args.precision)
        fwdbwd = lambda: torch.autograd.grad(fwd(), leaves, dy)  # noqa: E731
        res = {"fwd": bc.time_ms(fwd, device, args.warmup, args.iters),
               "fwdbwd": bc.time_ms(fwdbwd, device, args.warmup, args.iters)}
        res["bwd"] = res["fwdbwd"] - res["fwd"]
        if args.steady_seconds > 0:
            res["fwd_steady"] = bc.sustained_ms(fwd, device, args.steady_seconds, args.iters)
            res["fwdbwd_steady"] = bc.sustained_ms(fwdbwd, device, args.steady_seconds, args.iters)
            res["bwd_steady"] = res["fwdbwd_steady"] - res["fwd_steady"]
            if device == "cuda":
                counter = bc.EnergyCounter.for_current_device()
                res["fwd_mj"] = bc.energy_per_call(fwd, counter, args.steady_seconds)[0] * 1e3
                res["fwdbwd_mj"] = bc.energy_per_call(fwdbwd, counter, args.steady_seconds)[0] * 1e3
                res["bwd_mj"] = res["fwdbwd_mj"] - res["fwd_mj"]
        y = fwd()
        grads = torch.autograd.grad(y, leaves, dy)
        res["fingerprint"] = {n: _fingerprint(t) for n, t in zip(("y", "dx", "dtopk", "dw13", "dw2"), (y, *grads))}
        out["shapes"][short] = res
        leaves.clear()
        del w13, w2, x, y, grads
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------
# the parent: builds, rounds, report
# ------------------------------------------------------------------------------------------------


def _package_name(site: Path) -> str:
    """prime_kernels where the build has it, else deep_gemm (builds from before the two distributions)."""
    return "prime_kernels" if (site / "prime_kernels").is_dir() or not (site / "deep_gemm").is_dir() else "deep_gemm"


def resolve_build(spec: str, tmp: Path, label: str) -> Path:
    """A folder to put on PYTHONPATH: the given one, or a wheel installed into a temp folder."""
    path = Path(spec).resolve()
    if path.is_dir():
        if not (path / "prime_kernels").is_dir() and not (path / "deep_gemm").is_dir():
            raise SystemExit(f"--{label} {spec}: no prime_kernels (or, for older builds, deep_gemm) package there")
        return path
    if path.suffix == ".whl" and path.is_file():
        target = tmp / label
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(target), str(path)], check=True)
        return target
    raise SystemExit(f"--{label} {spec}: neither a folder nor a .whl file")


def run_child(site: Path, args, argv_tail: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--old", "-", "--new", "-", *argv_tail]
    try:
        r = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                           timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"[ab] the child for {site} ran past {args.child_timeout:.0f} s (a hang?)")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("@@AB@@ ")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"[ab] the child for {site} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    res = json.loads(lines[-1][len("@@AB@@ "):])
    if not Path(res["package_file"]).resolve().is_relative_to(site):
        raise SystemExit(f"[ab] the child for {site} imported {_package_name(site)} from {res['package_file']}: "
                         f"another copy shadows the build (check PYTHONPATH / the current directory)")
    return res


def summarize(samples: dict, shapes: list[str]) -> list[dict]:
    """samples[label] = list of child results, one per round (same round index = one pair)."""
    rows = []
    def everywhere(d):
        return all(d in c["shapes"][s] for c in samples["old"] + samples["new"] for s in shapes)

    extra = (STEADY_DIRECTIONS if everywhere(STEADY_DIRECTIONS[0]) else ()) + \
        (ENERGY_DIRECTIONS if everywhere(ENERGY_DIRECTIONS[0]) else ())
    for s in shapes:
        for d in DIRECTIONS + extra:
            unit = _unit(d)
            old = [c["shapes"][s][d] for c in samples["old"]]
            new = [c["shapes"][s][d] for c in samples["new"]]
            ratios = [n / o for n, o in zip(new, old) if o > 0]
            same = all(samples["old"][i]["shapes"][s]["fingerprint"] == samples["new"][i]["shapes"][s]["fingerprint"]
                       for i in range(len(old)))
            rows.append({"shape": s, "direction": d, f"old_{unit}": round(statistics.median(old), 4),
                         f"new_{unit}": round(statistics.median(new), 4),
                         "ratio_new_old": round(statistics.median(ratios), 4) if ratios else None,
                         "ratio_min": round(min(ratios), 4) if ratios else None,
                         "ratio_max": round(max(ratios), 4) if ratios else None,
                         f"old_{unit}_rounds": old, f"new_{unit}_rounds": new, "outputs_bitwise_equal": same})
    return rows


def _short(info: dict, site: Path) -> str:
    sha = str(info.get("git_sha") or "")
    return sha[:12] if sha and sha != "unknown" else site.name


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print("@@AB@@ " + json.dumps(child(args)), flush=True)
        return None
    sys.path.insert(0, str(HERE))
    import bench_common as bc  # torch only; the parent never imports prime_kernels

    shapes = args.shapes.split(",")
    tail = ["--shapes", args.shapes, "--tokens", str(args.tokens), "--warmup", str(args.warmup),
            "--iters", str(args.iters), "--seed", str(args.seed), "--backend", args.backend,
            "--precision", args.precision, "--steady-seconds", str(args.steady_seconds)]
    with tempfile.TemporaryDirectory(prefix="pk_ab_") as tmp:
        sites = {"old": resolve_build(args.old, Path(tmp), "old"), "new": resolve_build(args.new, Path(tmp), "new")}
        samples = {"old": [], "new": []}
        for r, order in enumerate(round_order(args.rounds)):
            for label in order:
                res = run_child(sites[label], args, tail)
                samples[label].append(res)
                print(f"[ab] round {r + 1}/{args.rounds} {label}: " + ", ".join(
                    f"{s} fwd {res['shapes'][s]['fwd']:.3f} bwd {res['shapes'][s]['bwd']:.3f} ms" for s in shapes),
                    flush=True)
    rows = summarize(samples, shapes)
    first = samples["old"][0]
    header = {k: v for k, v in first["header"].items() if k not in ("git_sha", "peak_bf16_tflops")}
    builds = {label: {"path": str(sites[label]), "spec": getattr(args, label), "build_info": samples[label][0]["build_info"]}
              for label in ("old", "new")}
    doc = dict(header, git_sha_old=builds["old"]["build_info"].get("git_sha"),
               git_sha_new=builds["new"]["build_info"].get("git_sha"), builds=builds,
               timing={"warmup": args.warmup, "iters": args.iters, "rounds": args.rounds, "order": "ABBA",
                       "steady_seconds": args.steady_seconds,
                       "statistic": "per round: median of iters CUDA-event times (the *_steady rows: mean of iters "
                                    "back-to-back calls after steady_seconds of them; the *_mj rows, on CUDA: the board's "
                                    "NVML energy per call over steady_seconds of back-to-back calls, millijoules, in "
                                    "old_mj / new_mj); reported: median over rounds of new/old (each round's pair); "
                                    "bwd = fwdbwd - fwd"},
               options={"tokens": args.tokens, "routing": "uniform", "backend": args.backend, "seed": args.seed,
                        "precision": args.precision},
               rows=rows)
    print(f"{'shape':>6} {'dir':>7} {'old':>9} {'new':>9} {'new/old':>8} {'min':>7} {'max':>7}  same bits  "
          f"(ms; mJ per call in the *_mj rows)")
    # A ratio is None where no round had a positive old time (bwd = fwdbwd - fwd can be <= 0 on a noisy CPU run).
    num = lambda v, width: f"{v:{width}.4f}" if v is not None else f"{'n/a':>{width}}"  # noqa: E731
    for r in rows:
        unit = _unit(r["direction"])
        print(f"{r['shape']:>6} {r['direction']:>7} {r[f'old_{unit}']:9.3f} {r[f'new_{unit}']:9.3f} "
              f"{num(r['ratio_new_old'], 8)} {num(r['ratio_min'], 7)} {num(r['ratio_max'], 7)}  "
              f"{r['outputs_bitwise_equal']}")
    if args.out:
        path = Path(args.out)
    elif args.smoke:
        path = Path(tempfile.gettempdir()) / "prime_kernels_bench_smoke" / "ab_smoke.json"
    else:
        gpu = header["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
        day = header["date"][:10]
        path = bc.RESULTS_DIR / (f"ab_{gpu}_{day}_{_short(builds['old']['build_info'], sites['old'])}_"
                                 f"{_short(builds['new']['build_info'], sites['new'])}.json")
    bc.write_results(doc, path)
    print(f"[ab] wrote {path}")
    return doc


if __name__ == "__main__":
    main()
