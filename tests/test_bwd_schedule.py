"""The fused backward's task sequence (csrc/sm90/mega_moe_bwd_schedule.hpp) checked on the host: the header is
compiled with the host C++ compiler into tests/cpp/bwd_schedule_check.cpp, which walks 840 random layers (tile sizes 128 or 256) and
routings (empty experts, one hot expert, skew, every expert empty; lags 0, 1, 6; 1 or 2 releases per tile) and
checks that every output tile is exactly one task, that every task's wait is released exactly by tasks of lower
index, and that claim-in-order execution by a random subset of up to 140 CTAs never hangs."""

from __future__ import annotations

from conftest import requires_host_cxx, run_host_check


@requires_host_cxx
def test_backward_task_sequence_covers_every_tile_and_cannot_hang(tmp_path):
    run_host_check("bwd_schedule_check", tmp_path)
