#!/usr/bin/env python3
"""Draw a results file of bench_layer.py as a PNG next to it:
one panel per (shape, tokens, routing), bars of ms per direction and backend, labelled with the
speed-up over the torch baseline, and a black line per direction at the dense floor (floor_ms) where the
file has one. Skipped rows (no time) draw nothing; the log names them.

    python bench/plot_results.py bench/results/layer_....json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(path) -> Path | None:
    """Write <path>.png and return its path; None (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[plot] matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return None
    path = Path(path)
    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if "direction" in r]
    for r in rows:
        if r.get("skipped"):
            print(f"[plot] not drawn: {r['backend']} {r['direction']} {r['shape']} T={r['tokens']} "
                  f"{r['routing']}: skipped: {r['skipped']}")
    rows = [r for r in rows if r.get("ms") is not None]
    if not rows:
        print("[plot] no layer rows to plot")
        return None
    keys = sorted({(r["shape"], r["tokens"], r["ep"], r["routing"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    backends = [b for b in ("torch", "deep_gemm", "deep_gemm_reference", "sonicmoe")
                if any(r["backend"] == b for r in rows)]
    directions = tuple(d for d in ("fwd", "infer", "bwd", "fwdbwd") if any(r["direction"] == d for r in rows))
    ncol = min(4, len(keys))
    nrow = (len(keys) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    width = 0.8 / max(1, len(backends))
    for ax, key in zip(axes.flat, keys):
        sub = [r for r in rows if (r["shape"], r["tokens"], r["ep"], r["routing"]) == key]
        for j, b in enumerate(backends):
            for i, d in enumerate(directions):
                r = next((r for r in sub if r["backend"] == b and r["direction"] == d), None)
                if r is None:
                    continue
                x = i + (j - (len(backends) - 1) / 2) * width
                ax.bar(x, r["ms"], width, color=f"C{j}", label=b if i == 0 else None)
                if r.get("ratio_vs_torch") and b != "torch":
                    ax.annotate(f"{r['ratio_vs_torch']:.2f}x", (x, r["ms"]), ha="center", va="bottom", fontsize=7)
        for i, d in enumerate(directions):
            floor = next((r["floor_ms"] for r in sub if r["direction"] == d and r.get("floor_ms")), None)
            if floor is not None:
                ax.hlines(floor, i - 0.45, i + 0.45, colors="k", linewidth=1.2,
                          label="dense floor" if i == 0 else None)
        ax.set_xticks(range(len(directions)))
        ax.set_xticklabels(directions)
        ax.set_ylabel("ms")
        ax.set_title(f"{key[0]}\nT={key[1]}/rank ep={key[2]} {key[3]}", fontsize=9)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"{doc.get('gpu')} x{max(1, doc.get('num_gpus') or 1)}, torch {doc.get('torch')}, "
                 f"bf16 peak {doc.get('peak_bf16_tflops')} TFLOP/s, {doc.get('git_sha', '')[:12]}", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: plot_results.py RESULTS.json")
    plot(sys.argv[1])
