"""precision="fp8" as a trainer runs it (backend="auto": the fused FP8 forward, the FP8 backward pipeline) over a
covering set of the backward's test matrix (the routings, T, E and (H, I) of test_mega_bwd_matrix.py; recompute and
fp32 weight-gradient accumulation on some rows), against two references on the same inputs:

* the FP8-emulating reference (backend="reference", precision="fp8": every quantization as the kernels do it, the
  rest in fp32/float64, each K slice summed as the tensor core sums it, prime_kernels.mega.fp8.tensor_core_partial).
  Measured on an H100 over these cases (bench/results/tests_h100_2026-12-07_44311c7_fp8_matrix.log): fp8 y, dX,
  dW13, dW2 0 to 4.7e-4 (most outputs of the small cases bit for bit), d topk_weights under 2e-7; fp8_bwd up to
  1.3e-3 (dX; its BF16 forward is not emulated bit for bit). The bound, 5e-3, is four times the largest measured;
  a wrong scale, operand or block is an error of order one.
* the unquantized float64 evaluation: the recipe's own error, printed per output ("[err64]" lines, for the results
  log; 5.4-7.7e-2 measured for fp8) and bounded at 1.2e-1.

Free memory is NaN-filled before each run; a second run must give the same bits. GPU only (an sm_90 device); the
cases whose float64 references do not fit an 80 GB card skip there with that reason."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_sm90
from mega_helpers import (FP8_EMULATION_BOUND, poison_free_memory, rel_err, run_layer,
                          skip_if_out_of_memory_on_a_small_card, skip_unless_available)
from test_mega_bwd_matrix import CASES as MATRIX_CASES, NAMES, _problem
from test_mega_grouped import float64_reference

BOUND_FLOAT64 = 1.2e-1

# the BF16 matrix's cases but those whose FP8 emulation is slowest (T = 16384 at H = 4096)
CASES = [c for c in MATRIX_CASES if c[0] * c[2] <= 16384 * 2048]


def _run(prob, extra: str, accum_init=None, backend: str = "auto", precision: str = "fp8"):
    """(y, dx, dtopk, dw13, dw2) in fp8; with "accum", dW13 / dW2 as what the backward added into fp32 accumulators
    that held accum_init."""
    x, idx, w, w13, w2, dy = prob
    opts = dict(precision=precision, backend=backend, recompute=extra == "recompute")
    if extra != "accum":
        return run_layer(x, idx, w, w13, w2, dy, **opts)
    a13, a2 = (t.clone() for t in accum_init)
    y, dx, dtopk, dw13, dw2 = run_layer(x, idx, w, w13, w2, dy, wgrad_accum=(a13, a2), **opts)
    assert dw13 is None and dw2 is None, "with wgrad_accum the weights get no .grad"
    return y, dx, dtopk, a13 - accum_init[0], a2 - accum_init[1]


@requires_sm90
@pytest.mark.parametrize("T,E,H,I,K,routing,extra", CASES)
def test_fp8_layer_matches_the_emulation_and_float64_and_repeats_bitwise(T, E, H, I, K, routing, extra):
    skip_unless_available("mega_moe.fp8.sm90")
    skip_unless_available("mega_moe.fp8_bwd.sm90")
    with skip_if_out_of_memory_on_a_small_card():
        _check_case(T, E, H, I, K, routing, extra)


# H and I = 64 (mod 128): the FP8 kernels' 64-wide last scale blocks (backend "auto": the grouped FP8 forward, the
# fused one keeping whole 128-wide blocks; fp8_bwd's BF16 forward with half-width last tiles), small enough to run in
# seconds. The layer takes those shapes where the status entry mega_moe_half_tiles.fp8.sm90 is available; the test
# presents it as available wherever its kernels can run (runnable), so that it checks them whatever the entry says.
TAIL_CASES = [(precision, *case) for precision in ("fp8", "fp8_bwd") for case in [
    (300, 8, 1088, 320, 4, "masked", ""),
    (300, 8, 1088, 320, 4, "zipf", "recompute"),
    (256, 4, 2880, 2880, 4, "uniform", "accum"),
]]


@requires_sm90
@pytest.mark.parametrize("precision,T,E,H,I,K,routing,extra", TAIL_CASES)
def test_fp8_layer_with_64_wide_last_blocks_matches_the_emulation_and_float64(monkeypatch, precision, T, E, H, I, K,
                                                                               routing, extra):
    from prime_kernels import _status
    from prime_kernels.mega import _backend

    skip_unless_available("mega_moe_grouped.fp8.sm90")
    skip_unless_available("mega_moe.fp8_bwd.sm90")
    skip_unless_available("mega_moe_half_tiles.bf16.sm90")
    why = _status.runnable(_backend.FP8_TAILS_KEY)
    if not _status.is_available(why):
        pytest.skip(f"{_backend.FP8_TAILS_KEY}: {why}")
    real = _backend._status
    monkeypatch.setattr(_backend, "_status", lambda: {**real(), _backend.FP8_TAILS_KEY: _status.AVAILABLE})
    assert _backend.resolve_backend("auto", "fp8", "fwd", hidden=H, intermediate=I) == "grouped"
    with skip_if_out_of_memory_on_a_small_card():
        _check_case(T, E, H, I, K, routing, extra, precision)


def _check_case(T, E, H, I, K, routing, extra, precision="fp8"):
    prob = _problem(T, E, H, I, K, routing, seed=T * 5 + E * 3 + H + I + K)
    accum_init = None
    if extra == "accum":
        g = torch.Generator(device="cuda").manual_seed(E + H)
        accum_init = (torch.randn(prob[3].shape, generator=g, device="cuda"),
                      torch.randn(prob[4].shape, generator=g, device="cuda"))
    poison_free_memory()
    got = _run(prob, extra, accum_init, precision=precision)
    if routing == "all_masked":
        for name, t in zip(NAMES, got):
            assert torch.count_nonzero(t) == 0, f"{name}: all routes masked, yet not zero"
    else:
        emulated = _run(prob, extra, accum_init, backend="reference", precision=precision)
        exact = float64_reference(prob)
        failures = []
        for name, a, b, c in zip(NAMES, got, emulated, exact):  # every output's errors printed before any assert
            assert torch.isfinite(a).all(), f"{name}: non-finite values (unwritten elements read as NaN)"
            err, err64 = rel_err(a, b), rel_err(a, c)
            print(f"[err64] {precision} T={T} E={E} H={H} I={I} {routing} {extra or '-'} {name}: {err64:.3e} "
                  f"(against the emulation {err:.3e})")
            if not err < FP8_EMULATION_BOUND:
                failures.append(f"{name}: rel err {err:.3e} against the FP8 emulation")
            if not err64 < BOUND_FLOAT64:
                failures.append(f"{name}: rel err {err64:.3e} against float64")
        del emulated, exact
        assert not failures, "; ".join(failures)
    poison_free_memory()
    again = _run(prob, extra, accum_init, precision=precision)
    for name, a, b in zip(NAMES, got, again):
        assert torch.equal(a, b), f"{name}: a second run differs"
