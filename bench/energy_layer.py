#!/usr/bin/env python3
"""Energy per layer call: joules of one forward and one forward+backward (autograd, as a trainer calls the
layer) of the torch baseline and of deep_gemm (backend "auto"), read from the GPU's cumulative energy counter
(NVML) over `--seconds` of back-to-back calls each, rounds interleaved over the backends.

Why: the H200 runs both backends at its 700 W cap in steady state (bench/NOTES.md, sessions 5 and 12), where
a call's time is about its energy over the capped power. So J/call is the figure a change must lower to move
a steady-state ratio, and torch J / our J bounds the ratio any kernel of ours can reach at that cap. bwd =
fwdbwd - fwd, as in bench_layer.py. The counter covers the whole board (idle power included) and is read only
after a synchronize, so host gaps between chunks of calls count too; chunks are long to keep them small.

    python bench/energy_layer.py --shapes qwen3-30b-a3b --tokens 16384 --seconds 3 --out FILE.json

Development tool: prints a table; --out writes the rows as JSON (results under bench/results/)."""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


class EnergyCounter:
    """Millijoules consumed by the board since the driver loaded (nvmlDeviceGetTotalEnergyConsumption)."""

    def __init__(self, device_index: int):
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self._lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        self._handle = ctypes.c_void_p()
        if self._lib.nvmlDeviceGetHandleByIndex_v2(device_index, ctypes.byref(self._handle)) != 0:
            raise RuntimeError(f"no NVML handle for device {device_index}")

    @classmethod
    def for_current_device(cls) -> "EnergyCounter":
        dev = torch.cuda.current_device()
        get_index = getattr(torch.cuda, "_get_nvml_device_index", None)  # CUDA_VISIBLE_DEVICES -> NVML index
        return cls(get_index(dev) if get_index is not None else dev)

    def sm_mhz(self) -> int:
        """The SM clock now (NVML_CLOCK_SM; an instantaneous reading), -1 if NVML does not say."""
        v = ctypes.c_uint()
        return v.value if self._lib.nvmlDeviceGetClockInfo(self._handle, 1, ctypes.byref(v)) == 0 else -1

    def mj(self) -> int:
        v = ctypes.c_ulonglong()
        rc = self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(v))
        if rc != 0:
            raise RuntimeError(f"nvmlDeviceGetTotalEnergyConsumption returned {rc}")
        return v.value


def measure(fn, counter: EnergyCounter, seconds: float, chunk: int) -> tuple[float, float, float]:
    """(joules per call, ms per call, mean watts) of fn over about `seconds` of back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, t0, n = counter.mj(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(chunk):
            fn()
        n += chunk
        torch.cuda.synchronize()
    dt, de = time.perf_counter() - t0, (counter.mj() - e0) / 1e3
    return de / n, dt * 1e3 / n, de / dt


def print_table(rows: list, columns: list) -> None:
    """rows as a text table; columns: (header, key, width, format spec) each, "-" for a None value, headers of
    text columns (format "s") left-aligned."""
    def cell(value, width: int, spec: str) -> str:
        text = "-" if value is None else format(value, spec)
        return f"{text:{width}s}" if spec == "s" else f"{text:>{width}s}"
    print(" ".join(f"{h:{w}s}" if spec == "s" else f"{h:>{w}s}" for h, _, w, spec in columns))
    for r in rows:
        print(" ".join(cell(r[key], w, spec) for _, key, w, spec in columns))


def write_energy_results(path: str, rows: list, **extra) -> None:
    """The run header (no peak figure: these tools measure none), `extra`, and the rows, as JSON at path."""
    doc = {**bc.run_header("cuda", 0.0), **extra, "rows": rows}
    doc.pop("peak_bf16_tflops", None)
    print(f"wrote {bc.write_results(doc, bc.Path(path))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--routing", default="uniform", choices=["uniform", "zipf"])
    ap.add_argument("--seconds", type=float, default=3.0, help="per backend, direction and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds interleaved over the backends; the median counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("energy_layer: no CUDA device, nothing to measure")
        return
    from deep_gemm.mega import mega_moe

    counter = EnergyCounter.for_current_device()
    rows = []
    for shape in args.shapes.split(","):
        E, H, I, K = bc.SHAPES[shape]
        w13, w2 = bc.make_weights(E, H, I, 0, "cuda")
        x, idx, w, dy = bc.make_tokens(args.tokens, E, H, K, args.routing, 1, "cuda")
        layers = {"torch": lambda x_, w_, a_, b_: bc.torch_moe(x_, idx, w_, a_, b_),
                  "deep_gemm": lambda x_, w_, a_, b_: mega_moe(x_, idx, w_, a_, b_, num_experts=E)}
        leaves = {b: [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)] for b in layers}
        calls = {}
        for b, layer in layers.items():
            lv = leaves[b]
            calls[(b, "fwd")] = lambda layer=layer, lv=lv: layer(*lv)
            calls[(b, "fwdbwd")] = lambda layer=layer, lv=lv: torch.autograd.grad(layer(*lv), lv, dy)
        got: dict = {}
        for _ in range(args.rounds):
            for key, fn in calls.items():
                got.setdefault(key, []).append(measure(fn, counter, args.seconds, chunk=10))
        med = {k: tuple(statistics.median(v[i] for v in vals) for i in range(3)) for k, vals in got.items()}
        per_backend = {}
        for b in layers:
            f, fb = med[(b, "fwd")], med[(b, "fwdbwd")]
            per_backend[b] = {"fwd": f, "fwdbwd": fb, "bwd": (fb[0] - f[0], fb[1] - f[1], None)}
        for b, per in per_backend.items():
            for d, (j, ms, watts) in per.items():
                tj = per_backend["torch"][d][0]
                rows.append({"shape": shape, "tokens": args.tokens, "routing": args.routing, "backend": b,
                             "direction": d, "joules": round(j, 4), "ms": round(ms, 4),
                             "watts": None if watts is None else round(watts, 1),
                             "torch_joules_over_these": round(tj / j, 3)})
        del leaves, calls, x, dy, w13, w2
        torch.cuda.empty_cache()
    print_table(rows, [("shape", "shape", 16, "s"), ("T", "tokens", 6, "d"), ("backend", "backend", 10, "s"),
                       ("dir", "direction", 7, "s"), ("J/call", "joules", 8, ".4f"), ("ms", "ms", 8, ".3f"),
                       ("W", "watts", 6, ".0f"), ("torch J / J", "torch_joules_over_these", 11, ".3f")])
    if args.out:
        write_energy_results(args.out, rows, seconds=args.seconds, rounds=args.rounds)


if __name__ == "__main__":
    main()
