"""The fused backward's task sequence (csrc/sm90/mega_moe_bwd_schedule.hpp) checked on the host: the header is
compiled with the host C++ compiler into tests/cpp/bwd_schedule_check.cpp, which walks 840 random layers (tile sizes 128 or 256) and
routings (empty experts, one hot expert, skew, every expert empty; lags 0, 1, 6; 1 or 2 releases per tile) and
checks that every output tile is exactly one task, that every task's wait is released exactly by tasks of lower
index, and that claim-in-order execution by a random subset of up to 140 CTAs never hangs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler (c++, g++, clang++) on PATH")
def test_backward_task_sequence_covers_every_tile_and_cannot_hang(tmp_path):
    exe = tmp_path / "bwd_schedule_check"
    build = subprocess.run([CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(REPO / "csrc"),
                            str(REPO / "tests" / "cpp" / "bwd_schedule_check.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout[-2000:] + run.stderr[-2000:]
