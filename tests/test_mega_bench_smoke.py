"""bench/bench_layer.py --smoke runs on the CPU and writes a results file with the documented fields (docs/performance.md)."""

import importlib
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"

TOP = {"gpu", "num_gpus", "torch", "cuda", "git_sha", "date", "peak_bf16_tflops", "timing", "options", "rows"}
ROW = {"shape", "num_experts", "hidden", "intermediate", "top_k", "tokens", "ep", "routing", "precision",
       "backend", "direction", "ms", "tflops", "pct_peak", "ratio_vs_torch", "peak_mem_gib"}


def _bench_module(name: str):
    """A module of bench/ (bench/ is on sys.path for the import only)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _run_smoke(out: Path, *extra: str) -> dict:
    """bench_layer.py --smoke at T=40 (2 iterations after 1 warm-up, no plot) plus `extra`; its results JSON."""
    _bench_module("bench_layer").main(["--smoke", "--tokens", "40", "--out", str(out), "--no-plot", "--iters", "2",
                                       "--warmup", "1", *extra])
    return json.loads(out.read_text())


def test_bench_layer_smoke(tmp_path, capsys):
    plot_results = _bench_module("plot_results")
    out = tmp_path / "smoke.json"
    doc = _run_smoke(out)
    assert set(doc) == TOP
    assert doc["timing"]["iters"] == 2 and doc["timing"]["warmup"] == 1 and doc["timing"]["rounds"] >= 1
    assert doc["options"] == {"recompute": False, "keep_pooled_x": "auto", "activation_clamp": None,
                              "inference": False}
    assert not any(r["direction"] == "infer" for r in doc["rows"])
    rows = doc["rows"]
    assert {(r["backend"], r["direction"], r["routing"]) for r in rows} >= {
        (b, d, g) for b in ("torch", "deep_gemm_reference") for d in ("fwd", "bwd", "fwdbwd")
        for g in ("uniform", "zipf")}
    for r in rows:
        want = ROW | ({"max_rel_err"} if r["backend"] != "torch" else set())
        assert set(r) == want, r
        if r["backend"] != "torch":
            assert r["max_rel_err"] < 1e-2
    assert "deep_gemm_reference" in capsys.readouterr().out  # the printed table
    png = plot_results.plot(out)
    if png is None:  # matplotlib missing: the plot is skipped with a message
        assert "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert Path(png).exists() and Path(png).stat().st_size > 0


def test_bench_layer_sustained_smoke(tmp_path):
    """--sustained-seconds adds a steady-state time and its ratio to the torch baseline to every row."""
    doc = _run_smoke(tmp_path / "sustained.json", "--routings", "uniform", "--rounds", "1", "--sustained-seconds",
                     "0.05", "--no-check")
    assert "sustained" in doc["timing"]
    for r in doc["rows"]:
        if r["direction"] == "bwd":  # a difference of two timings: may be <= 0 at this size on the CPU
            continue
        assert r["ms_sustained"] > 0, r
        assert r["ratio_sustained"] == 1.0 if r["backend"] == "torch" else r["ratio_sustained"] > 0, r


def test_bench_layer_inference_smoke(tmp_path):
    """--inference adds an 'infer' row per backend (the forward under no_grad) with its time, TFLOP/s, ratio to the
    torch baseline, peak memory and, for ours, the error against float64."""
    doc = _run_smoke(tmp_path / "infer.json", "--routings", "uniform", "--rounds", "2", "--inference")
    assert doc["options"]["inference"] is True
    infer = {r["backend"]: r for r in doc["rows"] if r["direction"] == "infer"}
    # one row per backend that ran (torch and the reference on a CPU; the kernels' backends on a GPU)
    assert set(infer) == {r["backend"] for r in doc["rows"] if r["direction"] == "fwd"}
    assert "torch" in infer and len(infer) >= 2, infer
    for b, r in infer.items():
        assert set(r) == ROW | ({"max_rel_err"} if b != "torch" else set()), r
        assert r["ms"] > 0 and r["tflops"] is not None and r["ratio_vs_torch"] > 0, r  # (tflops rounds to 0 here)
        if b != "torch":
            assert r["max_rel_err"] < 1e-2, r
    assert infer["torch"]["ratio_vs_torch"] == 1.0
