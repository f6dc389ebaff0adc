"""compute-sanitizer on a small fused forward + backward and on every grouped-GEMM op (ci/sanitize.sh running
tests/sanitize_case.py): each of memcheck, racecheck, synccheck and initcheck must report 0 errors.

The GPU tests skip, with the reason shown, without a CUDA GPU or without compute-sanitizer. The parser tests run
anywhere: they feed ci/sanitize.sh saved reports of each form.

One class of report is excluded, a limitation of initcheck: it does not see TMA (cp.async.bulk.tensor) stores, so
it reports every later generic-proxy read of rows written only that way as a read of uninitialised memory. In the
layer part the combine reads exactly such rows (the fused forward's L2 output and the grouped backward's dX
slots):

    ========= Uninitialized __global__ memory read of size 16 bytes
    =========     at deep_gemm::common::combine_bf16_kernel(const __nv_bfloat16 *, long, long, const int *, ...)+0x1790

ci/sanitize.sh therefore runs initcheck on the layer part with combine_bf16_kernel left unchecked
(compute-sanitizer's --kernel-name-exclude), and on nothing else. The rows it reads are written: y and dX match the
float64 reference in the GPU tests, which rows left with an earlier allocation's bytes would break, and memcheck
bounds every combine read.
The ops part, whose combine reads rows a torch kernel wrote, runs initcheck with nothing excluded. (Counting the
combine's reports and subtracting them does not work: about 35,000 per run overflow the tool's record buffer,
which keeps 512 and drops the rest unread.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "ci" / "sanitize.sh"
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
TIMEOUT_S = int(os.environ.get("PK_SANITIZE_TIMEOUT", "900"))


def _sanitizer() -> str | None:
    """COMPUTE_SANITIZER, PATH, the folder of the nvcc on PATH, or an installed CUDA toolkit. (Not conftest's
    find_tool: at collection time it could start a toolkit download on a machine without nvcc.)"""
    found = os.environ.get("COMPUTE_SANITIZER") or shutil.which("compute-sanitizer")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    cands = [Path(nvcc).parent / "compute-sanitizer"] if nvcc else []
    cands += [Path("/usr/local/cuda/bin/compute-sanitizer"),
              *sorted(Path("/usr/local").glob("cuda-*/bin/compute-sanitizer"), reverse=True)]
    return next((str(c) for c in cands if c.exists()), None)


def _count(tool: str, text: str, tmp_path: Path) -> str:
    log = tmp_path / f"{tool}.log"
    log.write_text(text)
    return subprocess.run(["bash", str(SCRIPT), "--count", tool, str(log)], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize("tool,text,want", [
    ("memcheck", "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n", "0"),
    ("memcheck", "========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 1 error\n", "1"),
    ("initcheck", "========= Uninitialized __global__ memory read\n========= ERROR SUMMARY: 129,568 errors\n", "129568"),
    ("synccheck", "========= ERROR SUMMARY: 3 errors\n", "3"),
    ("racecheck", "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n", "1"),
    ("racecheck", "========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)\n", "0"),
    ("racecheck", "========= ERROR SUMMARY: 0 errors\n", "0"),
    ("memcheck", "Traceback (most recent call last):\nRuntimeError: CUDA error\n", "none"),
])
def test_sanitize_script_parses_summaries(tool, text, want, tmp_path):
    assert _count(tool, text, tmp_path) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.skipif(_sanitizer() is None, reason="compute-sanitizer not found (PATH, the CUDA toolkit, COMPUTE_SANITIZER)")
@pytest.mark.parametrize("tool", TOOLS)
def test_compute_sanitizer_reports_no_errors(tool, tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, COMPUTE_SANITIZER=_sanitizer(), PK_SANITIZE_LOG_DIR=str(tmp_path),
               PK_SANITIZE_TIMEOUT=str(TIMEOUT_S))
    r = subprocess.run(["bash", str(SCRIPT), tool], capture_output=True, text=True, env=env, timeout=TIMEOUT_S + 120)
    print(r.stdout)
    # one line per run: "tool: N errors ..." or, for initcheck, one per part: "initcheck (layer): N errors ..."
    lines = [ln for ln in r.stdout.splitlines() if re.match(rf"{tool}( \(\w+\))?: ", ln)]
    assert lines, f"ci/sanitize.sh printed no line for {tool}:\n{r.stdout}\n{r.stderr[-2000:]}"
    for line in lines:
        m = re.match(rf"{tool}( \(\w+\))?: (\d+) errors", line)
        logs = sorted(tmp_path.glob(f"{tool}-*.log"))
        report = "".join(p.read_text()[-3000:] for p in logs)
        assert m is not None, f"{line}\n{report}"
        assert int(m.group(2)) == 0, f"{line}\n{report}"
    assert r.returncode == 0, f"ci/sanitize.sh exited {r.returncode}:\n{r.stdout}\n{r.stderr[-2000:]}"


_REPORT = ("========= Uninitialized __global__ memory read of size 16 bytes\n"
           "=========     at {kernel}(const __nv_bfloat16 *, long)+0x1790\n"
           "=========     by thread (0,0,0) in block (0,60,0)\n"
           "=========     Address 0x7fbae6ed2800\n=========\n")


def _fake_initcheck(tmp_path: Path, log_text: str, tools=("initcheck",), part=None) -> tuple[subprocess.CompletedProcess,
                                                                                              dict]:
    """ci/sanitize.sh's runs of ``tools`` (PK_SANITIZE_PART=part where given) with a stand-in for compute-sanitizer
    that writes log_text as its report and runs nothing: the script's handling of the reports, without a GPU. Also
    returns the arguments the script gave the tool for each part (one line per run)."""
    log_src = tmp_path / "report.txt"
    log_src.write_text(log_text)
    args_dir = tmp_path / "args"
    args_dir.mkdir()
    fake = tmp_path / "fake-sanitizer"
    fake.write_text("#!/usr/bin/env bash\n"
                    "[ \"$1\" = --version ] && { echo fake; exit 0; }\n"
                    "all=\"$*\"; part=${all##*--part }; part=${part%% *}\n"
                    f"echo \"$all\" >> '{args_dir}'/$part\n"
                    "while [ $# -gt 0 ]; do case \"$1\" in --log-file) log=$2; shift 2;; *) shift;; esac; done\n"
                    f"cp '{log_src}' \"$log\"; echo 'sanitize_case: done'\n")
    fake.chmod(0o755)
    env = dict(os.environ, COMPUTE_SANITIZER=str(fake), PK_SANITIZE_LOG_DIR=str(tmp_path / "logs"))
    if part is not None:
        env["PK_SANITIZE_PART"] = part
    r = subprocess.run(["bash", str(SCRIPT), *tools], capture_output=True, text=True, env=env, timeout=60)
    return r, {p.name: p.read_text() for p in args_dir.iterdir()}


def test_initcheck_leaves_only_the_combine_unchecked_and_only_in_the_layer_part(tmp_path):
    r, args = _fake_initcheck(tmp_path, "========= ERROR SUMMARY: 0 errors\n")
    assert "--kernel-name-exclude kns=combine_bf16_kernel" in args["layer"], args
    assert "--kernel-name-exclude" not in args["ops"], args
    assert all("--no-readback" in a for a in args.values()), args
    assert re.search(r"initcheck \(layer\): 0 errors", r.stdout) and re.search(r"initcheck \(ops\): 0 errors", r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr


def test_initcheck_counts_every_report(tmp_path):
    text = (_REPORT.format(kernel="deep_gemm::common::combine_bf16_kernel")
            + _REPORT.format(kernel="void at::native::reduce_kernel<512, 1>")
            + "========= ERROR SUMMARY: 2 errors\n")
    r, _ = _fake_initcheck(tmp_path, text)
    assert "initcheck (layer): 2 errors" in r.stdout, r.stdout
    assert "reports in: 1 reduce_kernel" in r.stdout, r.stdout
    assert r.returncode != 0


def test_initcheck_fails_when_the_tool_dropped_reports(tmp_path):
    text = (_REPORT.format(kernel="deep_gemm::common::combine_bf16_kernel")
            + "========= Warning: Error buffer overflow has been detected. Some records have been dropped\n"
            + "========= ERROR SUMMARY: 2 errors\n========= 34,624 errors were skipped (error buffer overflow).\n")
    r, _ = _fake_initcheck(tmp_path, text)
    assert "initcheck (layer): FAILED: the tool dropped 34624 reports" in r.stdout, r.stdout
    assert r.returncode != 0


def test_the_dgrad_part_alone_runs_each_tool_on_it(tmp_path):
    """PK_SANITIZE_PART=dgrad (ci/verify_fused_bwd.sh): every tool runs the case's dgrad part only, one line each
    ("TOOL (dgrad): N errors")."""
    tools = ("memcheck", "racecheck", "synccheck")
    r, args = _fake_initcheck(tmp_path, "========= ERROR SUMMARY: 0 errors\n", tools=tools, part="dgrad")
    assert set(args) == {"dgrad"}, args
    runs = args["dgrad"].splitlines()
    assert [ln.split("--tool ")[1].split()[0] for ln in runs] == list(tools), runs
    assert all("sanitize_case.py --part dgrad" in ln for ln in runs), runs
    for tool in tools:
        assert re.search(rf"^{tool} \(dgrad\): 0 errors", r.stdout, re.M), r.stdout
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dgrad_part_runs_on_the_cpu_references():
    """The case's dgrad part, dry-run on the CPU (the pipeline's references stand in for the kernel): every call of
    the part runs and its checks pass."""
    r = subprocess.run([sys.executable, "sanitize_case.py", "--device", "cpu", "--part", "dgrad"], capture_output=True,
                       text=True, cwd=REPO / "tests", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    calls = [ln for ln in r.stdout.splitlines() if ln.startswith("[case] mega_moe_bwd_fused")]
    assert len(calls) == 6 and all(ln.endswith(" ok") for ln in calls), r.stdout  # 3 dgrad, 3 with the wgrad tiles
    assert r.stdout.rstrip().endswith("sanitize_case: done"), r.stdout
