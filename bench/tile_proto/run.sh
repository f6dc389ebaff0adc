#!/usr/bin/env bash
# Runs the tile_proto bench on one H200 (< 2 minutes, about 75 s). Args pass through: [--equal768 (round 1)]
# [steady_seconds (1.5)] [rounds (3)].
# BENCH=bench_debug ./run.sh runs the debug build (bounded spin-waits; a hang traps instead of timing out).
cd "$(dirname "$0")"
exec timeout 150 "./${BENCH:-bench}" "$@"
