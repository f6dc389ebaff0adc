"""bench/train_step.py --smoke on the CPU: a tiny Qwen3-MoE trained a few steps with the trainer's own experts
(transformers' grouped_mm; TorchTitan's grouped-mm GroupedExperts) and with ours (the reference backend), from the
same weights on the same batches; the results file has every run with its family, finite losses that agree,
positive step times and an experts share in [0, 1]. Without torchtitan the TorchTitan family must be recorded as
skipped with the reason."""

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
TITAN_IMPL = {"torchtitan_grouped_mm": "RoutedExperts(GroupedExperts)",
              "prime_mega_moe": "MegaMoERoutedExperts(MegaMoEGroupedExperts)",
              "prime_mega_moe_fp8": "MegaMoERoutedExperts(MegaMoEGroupedExperts)"}
# our FP8 variants are the same transformers experts implementation, given another precision
HF_IMPL = {"prime_mega_moe_fp8": "prime_mega_moe", "prime_mega_moe_fp8_bwd": "prime_mega_moe"}
FP8_VARIANTS = {"prime_mega_moe_fp8": "fp8", "prime_mega_moe_fp8_bwd": "fp8_bwd"}


def _torchtitan_skip_reason() -> str | None:
    """What bench/train_step.py will find: None when TorchTitan's Qwen3 model and our adapter import."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("train_step_torchtitan").skip_reason()
    finally:
        sys.path.remove(str(BENCH))


def run_smoke(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "x.json"
    # as bench/ab.py's smoke test: the child sees no GPU, so the smoke run is the same on a GPU machine. One CPU
    # thread: the tiny model gains nothing from more, and on a busy machine OpenMP's spinning threads made the same
    # run four times slower (56 s against 12 s for --model both on two loaded cores)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "train_step.py"), "--smoke", "--device", "cpu",
                           "--out", str(out), "--no-plot", *extra],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "train_step" and doc["device"] == "cpu"
    assert doc["args"]["smoke"] and doc["args"]["backend"] == "reference"
    return doc, proc.stdout


def check_family(doc: dict, family: str, reference: str, ckpts: tuple[bool, ...]) -> None:
    """The family's reference and prime_mega_moe ran at every setting, with sane figures, and agree."""
    runs = [run for run in doc["runs"] if run["family"] == family and not run.get("skipped")]
    want = {(v, ck) for v in (reference, "prime_mega_moe") for ck in ckpts}
    assert {(run["variant"], run["checkpointing"]) for run in runs} >= want
    n_steps = doc["args"]["warmup"] + doc["args"]["steps"] + doc["args"]["share_steps"]
    layers = doc["models"][family]["layers"]
    for run in runs:
        want_impl = TITAN_IMPL[run["variant"]] if family == "torchtitan" else HF_IMPL.get(run["variant"], run["variant"])
        assert run["experts_implementation"] == want_impl, run
        assert len(run["losses"]) == n_steps and all(math.isfinite(x) for x in run["losses"]), run
        assert run["step_ms"] > 0 and all(t > 0 for t in run["step_ms_all"]), run
        assert run["tokens_per_s_per_gpu"] > 0, run
        assert 0.0 <= run["moe_share"] <= 1.0, run
        for s in run["moe_share_steps"]:  # every layer's experts: one backward, one forward (two when recomputed)
            assert s["bwd_windows"] == layers and s["fwd_windows"] == layers * (2 if run["checkpointing"] else 1), s
    ours = [p for p in doc["parity"] if p["family"] == family and p["variant"] == "prime_mega_moe"]
    assert len(ours) == len(ckpts), ours
    assert all(p["ok"] and p["vs"] == reference and p["steps_checked"] == n_steps for p in ours), ours
    ratios = {(x["variant"], x["vs"], x["checkpointing"]) for x in doc["ratios"] if x["family"] == family}
    assert ratios >= {("prime_mega_moe", reference, ck) for ck in ckpts}


def test_train_step_smoke(tmp_path):
    """--model both: transformers' family always; TorchTitan's where it imports, else skipped with the reason."""
    doc, stdout = run_smoke(tmp_path, "--model", "both", "--checkpointing", "both")
    assert "transformers: prime_mega_moe / grouped_mm step time" in stdout  # the printed ratios
    assert doc["transformers"]
    check_family(doc, "transformers", "grouped_mm", (False, True))
    titan_reason = _torchtitan_skip_reason()
    if titan_reason is None:
        assert doc["torchtitan"] and doc["families_skipped"] == {}
        check_family(doc, "torchtitan", "torchtitan_grouped_mm", (False, True))
        check_titan_fp8(doc, stdout, (False, True))
    else:  # the family is recorded as skipped, with the exception, and the transformers runs still count
        assert doc["families_skipped"] == {"torchtitan": titan_reason}
        titan_runs = [run for run in doc["runs"] if run["family"] == "torchtitan"]
        assert titan_runs and all(run["skipped"] == titan_reason for run in titan_runs)
        assert f"torchtitan family skipped: {titan_reason}" in stdout
    for run in doc["runs"]:
        if run.get("skipped") and run["family"] == "transformers":  # sonicmoe without its kernel: the reason
            assert run["variant"] == "sonicmoe" and run["skipped"], run
    check_fp8_variants(doc, stdout, (False, True))
    assert doc["parity_ok"] is True
    assert all(x["step_ms_ratio"] > 0 for x in doc["ratios"])


def check_titan_fp8(doc: dict, stdout: str, ckpts: tuple[bool, ...]) -> None:
    """TorchTitan's family on the CPU: our FP8 experts run the recipe's emulation, held to the FP8 rule against
    torchtitan_grouped_mm; TorchTitan's own FP8 experts (torchao's scaled grouped GEMMs) need a CUDA GPU, so their
    rows are skipped with that reason, and ours get no ratio against them."""
    ours = [r for r in doc["runs"] if r["family"] == "torchtitan" and r["variant"] == "prime_mega_moe_fp8"]
    assert [r["checkpointing"] for r in ours] == list(ckpts)
    assert all(not r.get("skipped") and r["precision"] == "fp8" for r in ours), ours
    verdicts = [p for p in doc["parity"] if p["family"] == "torchtitan" and p["variant"] == "prime_mega_moe_fp8"]
    assert len(verdicts) == len(ckpts) and all(p["ok"] and p["rtol"] == pytest.approx(1.5e-2) for p in verdicts)
    theirs = [r for r in doc["runs"] if r["family"] == "torchtitan" and r["variant"] == "torchtitan_fp8_grouped_mm"]
    assert [r["checkpointing"] for r in theirs] == list(ckpts)
    assert all("CUDA GPU" in r["skipped"] for r in theirs), theirs
    assert {x["vs"] for x in doc["ratios"] if x["variant"] == "prime_mega_moe_fp8" and x["family"] == "torchtitan"} \
        == {"torchtitan_grouped_mm"}
    assert "torchtitan: prime_mega_moe_fp8 / torchtitan_grouped_mm step time" in stdout


def test_fp8_ratios_include_the_trainers_own_fp8_experts():
    """Where the family's own FP8 experts ran, each FP8 variant of ours gets a ratio against them too, and they are
    held to the FP8 parity rule; bf16 variants are not set against them."""
    ts = _import_train_step()
    rows = [{"family": "torchtitan", "variant": v, "checkpointing": True, "step_ms": ms, "losses": [1.0]}
            for v, ms in (("torchtitan_grouped_mm", 100.0), ("prime_mega_moe", 80.0), ("prime_mega_moe_fp8", 70.0),
                          ("torchtitan_fp8_grouped_mm", 90.0))]
    got = {(r["variant"], r["vs"]): r["step_ms_ratio"] for r in ts.ratios(rows)}
    assert got == {("prime_mega_moe", "torchtitan_grouped_mm"): 0.8,
                   ("prime_mega_moe_fp8", "torchtitan_grouped_mm"): 0.7,
                   ("prime_mega_moe_fp8", "torchtitan_fp8_grouped_mm"): pytest.approx(70 / 90, abs=1e-4),
                   ("torchtitan_fp8_grouped_mm", "torchtitan_grouped_mm"): 0.9}
    assert ts.parity_rtol("torchtitan_fp8_grouped_mm") == ts.parity_rtol("prime_mega_moe_fp8") > \
        ts.parity_rtol("prime_mega_moe")


def check_fp8_variants(doc: dict, stdout: str, ckpts: tuple[bool, ...]) -> None:
    """On the CPU our FP8 variants run the reference's emulation of the recipe (the kernels' own FP8 runs are the
    GPU's): each at every setting, with its precision, held to the wider FP8 tolerance against grouped_mm, and the
    baseline's lack of an FP8 path recorded."""
    for variant, precision in FP8_VARIANTS.items():
        runs = [r for r in doc["runs"] if r["variant"] == variant and r["family"] == "transformers"]
        assert [r["checkpointing"] for r in runs] == list(ckpts), runs
        assert all(not r.get("skipped") and r["precision"] == precision and r["backend"] == "reference"
                   for r in runs), runs
        verdicts = [p for p in doc["parity"] if p["variant"] == variant and p["family"] == "transformers"]
        assert len(verdicts) == len(ckpts) and all(p["ok"] and p["vs"] == "grouped_mm" for p in verdicts), verdicts
        assert all(p["rtol"] == pytest.approx(1.5e-2) for p in verdicts), verdicts
        assert f"transformers: {variant} / grouped_mm step time" in stdout
    assert {r["precision"] for r in doc["runs"] if r["variant"] == "prime_mega_moe"} <= {"bf16"}
    assert "no FP8 training path" in doc["fp8_baseline"]


def test_train_step_smoke_torchtitan(tmp_path):
    """--model torchtitan alone, under TorchTitan's FullAC: its own experts against ours; no transformers runs."""
    # exc_type=ImportError: a torchtitan that is installed but fails to import skips too, with its reason
    pytest.importorskip("torchtitan", reason="the TorchTitan family needs torchtitan (ci/test.sh installs "
                                             "torchtitan==0.3.0 with --no-deps plus spmd_types and tyro)",
                        exc_type=ImportError)
    reason = _torchtitan_skip_reason()
    assert reason is None, f"torchtitan imports but its Qwen3 model or our adapter does not: {reason}"
    doc, stdout = run_smoke(tmp_path, "--model", "torchtitan", "--checkpointing", "on", "--warmup", "0",
                            "--steps", "1")
    assert "torchtitan: prime_mega_moe / torchtitan_grouped_mm step time, checkpointing on" in stdout
    assert {run["family"] for run in doc["runs"]} == {"torchtitan"} and list(doc["models"]) == ["torchtitan"]
    assert doc["model"]["model"] == "torchtitan.models.qwen3.Qwen3Model" and doc["torchtitan"]
    check_family(doc, "torchtitan", "torchtitan_grouped_mm", (True,))
    assert doc["parity_ok"] is True


def test_torchtitan_runs_with_a_stand_in_for_a_torch_name_it_imports_but_this_torch_lacks(tmp_path):
    """torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.11 lacks: with the name
    taken away, the family still trains (the name serves FSDP code a one-GPU step never runs), the results file names
    the stand-in, and the stand-in raises when used."""
    pytest.importorskip("torchtitan", reason="the TorchTitan family needs torchtitan", exc_type=ImportError)
    assert _torchtitan_skip_reason() is None
    out = tmp_path / "x.json"
    child = ("import runpy, sys\n"
             "import torch.distributed.fsdp as fsdp\n"
             "if hasattr(fsdp, 'DataParallelMeshDims'):\n"
             "    del fsdp.DataParallelMeshDims\n"
             f"sys.path.insert(0, {str(BENCH)!r})\n"
             "import train_step_torchtitan as titan\n"
             "assert titan.skip_reason() is None, titan.skip_reason()\n"
             "try:\n"
             "    fsdp.DataParallelMeshDims(shard=('dp',))\n"
             "except RuntimeError as exc:\n"
             "    assert 'stand-in' in str(exc), exc\n"
             "else:\n"
             "    raise AssertionError('the stand-in did not raise')\n"
             f"sys.argv = ['train_step.py', '--smoke', '--device', 'cpu', '--out', {str(out)!r}, '--no-plot',\n"
             "            '--model', 'torchtitan', '--checkpointing', 'off', '--warmup', '0', '--steps', '1']\n"
             f"runpy.run_path({str(BENCH / 'train_step.py')!r}, run_name='__main__')\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["torchtitan_stand_ins"] == ["torch.distributed.fsdp.DataParallelMeshDims"]
    check_family(doc, "torchtitan", "torchtitan_grouped_mm", (False,))
    assert doc["parity_ok"] is True


def test_torchtitan_family_skip_is_recorded(monkeypatch):
    """Where TorchTitan's model code does not import, the family becomes skipped rows carrying the exception."""
    ts = _import_train_step()
    assert ts.parse_args(["--smoke"]).families == ["transformers"]  # the default: the transformers family alone
    monkeypatch.setattr(ts.titan, "skip_reason", lambda: "ImportError: no module named torchtitan")
    args = ts.parse_args(["--smoke", "--device", "cpu", "--model", "torchtitan", "--checkpointing", "both"])
    fam, reason = ts.load_family("torchtitan", args, ts.torch.device("cpu"))
    assert fam is None and reason == "ImportError: no module named torchtitan"
    rows = ts.skipped_rows("torchtitan", reason, args)
    assert {(r["variant"], r["checkpointing"]) for r in rows} == {
        (v, ck) for v in ("torchtitan_grouped_mm", "prime_mega_moe", "prime_mega_moe_fp8", "torchtitan_fp8_grouped_mm")
        for ck in (False, True)}
    assert all(r["family"] == "torchtitan" and r["skipped"] == reason for r in rows)
    assert ts.parity(rows, steps=10) == [] and ts.ratios(rows) == []
    assert "skipped: ImportError: no module named torchtitan" in ts.format_table(rows)


def _import_train_step():
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("train_step")
    finally:
        sys.path.remove(str(BENCH))


def test_parity_rule_flags_divergence_and_nan():
    """The rule the script exits 1 on: a loss more than 1e-2 off the reference's, or a non-finite one, fails it."""
    ts = _import_train_step()

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
    # within a family: TorchTitan's runs are held to torchtitan_grouped_mm, not to transformers' grouped_mm
    titan_rows = [{"family": "torchtitan", "variant": "torchtitan_grouped_mm", "checkpointing": False,
                   "losses": [5.0, 5.0]},
                  {"family": "torchtitan", "variant": "prime_mega_moe", "checkpointing": False, "losses": [5.01, 5.02]}]
    [titan] = ts.parity(runs([10.0, 10.0, 10.0])[:1] + titan_rows, steps=10)
    assert titan["family"] == "torchtitan" and titan["vs"] == "torchtitan_grouped_mm" and titan["ok"]
    assert abs(titan["max_rel_diff"] - 4e-3) < 1e-9


def test_parity_rule_is_wider_for_fp8_variants():
    """An FP8 variant may sit 1.5e-2 off the bf16 reference (FP8 rounding); the bf16 variant at the same distance
    fails, and an FP8 one beyond it or with a NaN fails too."""
    ts = _import_train_step()
    ref = {"variant": "grouped_mm", "checkpointing": True, "losses": [10.0, 10.0]}

    def verdict(variant, losses):
        [p] = ts.parity([ref, {"variant": variant, "checkpointing": True, "losses": losses}], steps=10)
        return p

    assert verdict("prime_mega_moe_fp8", [10.0, 10.14])["ok"]
    assert verdict("prime_mega_moe_fp8_bwd", [9.86, 10.0])["rtol"] == pytest.approx(1.5e-2)
    assert not verdict("prime_mega_moe", [10.0, 10.14])["ok"]
    assert not verdict("prime_mega_moe_fp8", [10.0, 10.16])["ok"]
    assert not verdict("prime_mega_moe_fp8", [10.0, float("nan")])["ok"]


def test_fp8_variant_skip_is_recorded(monkeypatch):
    """Where the layer cannot run FP8 with --backend (here "auto" on the CPU: no FP8 kernels), each FP8 variant is a
    skipped row carrying the layer's reason, and the other variants still run."""
    ts = _import_train_step()
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    args = ts.parse_args(["--smoke", "--device", "cpu", "--backend", "auto", "--checkpointing", "both",
                          "--variants", "grouped_mm,prime_mega_moe_fp8,prime_mega_moe_fp8_bwd"])
    cpu = ts.torch.device("cpu")
    reasons = {v: ts.precision_skip_reason(p, args, cpu) for v, p in FP8_VARIANTS.items()}
    assert all(f"precision={p!r}" in reasons[v] for v, p in FP8_VARIANTS.items()), reasons
    assert ts.precision_skip_reason("fp8", ts.parse_args(["--smoke", "--device", "cpu"]), cpu) is None  # reference
    ran = []
    monkeypatch.setattr(ts, "run_variant", lambda spec, *a: ran.append(spec.variant) or {
        "family": spec.family, "variant": spec.variant, "checkpointing": spec.checkpointing})
    fam = ts.Family(name="transformers", state={}, build=None, swap_in_ours=None, enable_checkpointing=None, loss=None,
                    is_experts_module=None, experts_implementation=None)
    rows = ts.run_family(fam, args, cpu, batches=[])
    assert ran == ["grouped_mm", "grouped_mm"]
    skipped = [(r["variant"], r["checkpointing"], r["skipped"]) for r in rows if r.get("skipped")]
    assert skipped == [(v, ck, reasons[v]) for ck in (False, True) for v in FP8_VARIANTS]
    assert ts.parity(rows, steps=10) == [] and ts.ratios(rows) == []
