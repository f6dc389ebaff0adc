"""bench/train_step.py --smoke on the CPU: a tiny Qwen3-MoE trained a few steps with transformers' grouped_mm experts
and with ours (the reference backend), from the same weights on the same batches; the results file has both runs
with finite losses that agree, positive step times and an experts share in [0, 1]."""

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.0",
                    reason="bench/train_step.py trains transformers' Qwen3-MoE: needs transformers>=5 "
                           "(ci/test.sh installs transformers==5.24.0)")

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_train_step_smoke(tmp_path):
    out = tmp_path / "x.json"
    # as bench/ab.py's smoke test: the child sees no GPU, so the smoke run is the same on a GPU machine
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(BENCH / "train_step.py"), "--smoke", "--device", "cpu",
                           "--checkpointing", "both", "--out", str(out), "--no-plot"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "prime_mega_moe / grouped_mm step time" in proc.stdout  # the printed ratios
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "train_step" and doc["device"] == "cpu" and doc["transformers"]
    assert doc["args"]["smoke"] and doc["args"]["backend"] == "reference"
    runs = [run for run in doc["runs"] if not run.get("skipped")]
    want = {(v, ck) for v in ("grouped_mm", "prime_mega_moe") for ck in (False, True)}
    assert {(run["variant"], run["checkpointing"]) for run in runs} >= want
    n_steps = doc["args"]["warmup"] + doc["args"]["steps"] + doc["args"]["share_steps"]
    for run in runs:
        assert run["experts_implementation"] == run["variant"], run
        assert len(run["losses"]) == n_steps and all(math.isfinite(x) for x in run["losses"]), run
        assert run["step_ms"] > 0 and all(t > 0 for t in run["step_ms_all"]), run
        assert run["tokens_per_s_per_gpu"] > 0, run
        assert 0.0 <= run["moe_share"] <= 1.0, run
        for s in run["moe_share_steps"]:  # every layer's experts: one backward, one forward (two when recomputed)
            layers = doc["model"]["layers"]
            assert s["bwd_windows"] == layers and s["fwd_windows"] == layers * (2 if run["checkpointing"] else 1), s
    for run in doc["runs"]:
        if run.get("skipped"):  # sonicmoe without its kernel: the reason is recorded
            assert run["variant"] == "sonicmoe" and run["skipped"], run
    ours = [p for p in doc["parity"] if p["variant"] == "prime_mega_moe"]
    assert len(ours) == 2 and all(p["ok"] and p["steps_checked"] == n_steps for p in ours), ours
    assert doc["parity_ok"] is True
    ratios = {(x["variant"], x["checkpointing"]) for x in doc["ratios"]}
    assert ratios >= {("prime_mega_moe", ck) for ck in (False, True)}
    assert all(x["step_ms_ratio"] > 0 for x in doc["ratios"])


def test_parity_rule_flags_divergence_and_nan():
    """The rule the script exits 1 on: a loss more than 1e-2 off the reference's, or a non-finite one, fails it."""
    sys.path.insert(0, str(BENCH))
    try:
        ts = importlib.import_module("train_step")
    finally:
        sys.path.remove(str(BENCH))

    def runs(ours):
        return [{"variant": "grouped_mm", "checkpointing": False, "losses": [10.0, 10.0, 10.0]},
                {"variant": "prime_mega_moe", "checkpointing": False, "losses": ours},
                {"variant": "sonicmoe", "checkpointing": False, "skipped": "ImportError: no kernel"}]

    [ok] = ts.parity(runs([10.05, 9.95, 10.09]), steps=10)
    assert ok["ok"] and ok["steps_checked"] == 3 and abs(ok["max_rel_diff"] - 9e-3) < 1e-9
    [off] = ts.parity(runs([10.0, 10.2, 10.0]), steps=10)
    assert not off["ok"] and abs(off["max_rel_diff"] - 2e-2) < 1e-9
    [late] = ts.parity(runs([10.0, 10.0, 10.2]), steps=2)  # only the first --parity-steps steps are held to it
    assert late["ok"] and late["steps_checked"] == 2
    [nan] = ts.parity(runs([10.0, float("nan"), 10.0]), steps=10)
    assert not nan["ok"] and not nan["finite"]
