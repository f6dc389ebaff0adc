"""The fault matrix: bad input, concurrency, forward progress and the wait watchdog (cases in tests/fault_cases.py).

Every case runs in a worker process with a wall-clock bound of its own, so that a hang or a device fault fails
that case instead of stalling or killing the suite; the worker is started once and restarted only after a case
left its CUDA context unusable, died, or ran past its bound (then it is killed). A summary table of every case
run is printed at the end (and written as JSON to $PK_FAULT_MATRIX_REPORT, default
<tmp>/pk_fault_matrix.json).

    python3 -m pytest -q tests/test_fault_matrix.py            # from tests/, as the rest of the suite
    python3 tests/test_fault_matrix.py [CASE ...]              # the same runner without pytest

On a machine without a GPU every case is collected and skipped.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fault_cases  # noqa: E402

STARTUP_S = 180.0  # a fresh worker imports torch and prime_kernels and creates its CUDA context


class Worker:
    """A ``fault_cases.py --serve`` process: case names in on stdin, one protocol line out per case."""

    def __init__(self):
        self.proc = None
        self.lines: queue.Queue = queue.Queue()
        self.err_path = None
        self.starts = 0

    def _start(self):
        self.err_path = Path(tempfile.mkstemp(prefix="pk_fault_worker_", suffix=".err")[1])
        err = open(self.err_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-u", str(HERE / "fault_cases.py"), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                     cwd=str(HERE), env=dict(os.environ, PYTHONUNBUFFERED="1"))
        err.close()
        self.starts += 1
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        msg = self._next(time.monotonic() + STARTUP_S)
        if not (isinstance(msg, dict) and msg.get("ready")):
            self.stop()
            raise RuntimeError(f"the fault-matrix worker did not start: {msg}; stderr: {self._stderr_tail()}")

    @staticmethod
    def _read(proc, q):
        for line in proc.stdout:
            if line.startswith(fault_cases.PROTOCOL):
                q.put(json.loads(line[len(fault_cases.PROTOCOL):]))
        q.put(None)  # end of output: the worker has exited

    def _next(self, deadline):
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return "timeout"

    def _stderr_tail(self, n=3000) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-n:]
        except (OSError, AttributeError):
            return ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # the worker this runner started, by its own handle
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.proc = None

    def run(self, name: str) -> dict:
        timeout = fault_cases.CASES[name][1]
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        t0 = time.monotonic()
        try:
            self.proc.stdin.write(name + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.stop()
            self._start()
            self.proc.stdin.write(name + "\n")
            self.proc.stdin.flush()
        msg = self._next(t0 + timeout)
        secs = round(time.monotonic() - t0, 3)
        if msg == "timeout":
            self.stop()
            return {"name": name, "status": "fail", "seconds": secs, "restarted": True,
                    "detail": f"timed out after {timeout:.0f} s (a hang); the worker was killed"}
        if msg is None:
            code = self.proc.wait(30) if self.proc is not None else None
            tail = self._stderr_tail()
            self.proc = None
            return {"name": name, "status": "fail", "seconds": secs, "restarted": True,
                    "detail": f"the worker died (exit {code}): {tail[-1500:]}"}
        if not msg.get("healthy", True):
            self.stop()  # its CUDA context is gone: the next case gets a fresh worker
            msg["restarted"] = True
            msg["detail"] = msg.get("detail", "") + " [the CUDA context was unusable afterwards]"
            if msg.get("status") == "pass":
                msg["status"] = "fail"
        return msg


RESULTS: list[dict] = []


def summary_table(results) -> str:
    rows = [("case", "result", "s", "detail")]
    for r in results:
        detail = " ".join(str(r.get("detail", "")).split())
        rows.append((r["name"], r["status"].upper() + (" (restart)" if r.get("restarted") else ""),
                     f"{r.get('seconds', 0):.1f}", detail[:110]))
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d}" for a, b, c, d in rows]
    lines.insert(1, "-" * min(160, sum(w) + 60))
    counts = {s: sum(1 for r in results if r["status"] == s) for s in ("pass", "fail", "skip")}
    lines.append(f"fault matrix: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)


def _write_report(results):
    path = Path(os.environ.get("PK_FAULT_MATRIX_REPORT", Path(tempfile.gettempdir()) / "pk_fault_matrix.json"))
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


@pytest.fixture(scope="module")
def worker(request):
    w = Worker()
    yield w
    w.stop()
    if RESULTS:
        text = summary_table(RESULTS) + f"\n(report: {_write_report(RESULTS)})"
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("")
            for line in text.splitlines():
                tr.write_line(line)
        else:
            print(text)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("name", list(fault_cases.CASES))
def test_fault_case(name, worker):
    res = worker.run(name)
    RESULTS.append(res)
    if res["status"] == "skip":
        pytest.skip(res["detail"])
    assert res["status"] == "pass", f"{name}: {res['detail']}\n{res.get('traceback', '')}"


def main(argv) -> int:
    names = argv or list(fault_cases.CASES)
    unknown = [n for n in names if n not in fault_cases.CASES]
    if unknown:
        print(f"unknown cases: {unknown}", file=sys.stderr)
        return 2
    w = Worker()
    try:
        for n in names:
            res = w.run(n)
            RESULTS.append(res)
            print(f"[fault] {n}: {res['status']} ({res.get('seconds', 0):.1f} s) {res.get('detail', '')[:200]}",
                  flush=True)
    finally:
        w.stop()
    print(summary_table(RESULTS))
    print(f"(report: {_write_report(RESULTS)})")
    return 1 if any(r["status"] == "fail" for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
