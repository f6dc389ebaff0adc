"""H or I a multiple of 64 but not of 128 (half-width last tiles in every kernel) through the kernel backends' forward
and backward, against float64: (H, I) = (2880, 2880) (gpt-oss-like) and (1088, 320), uniform and skewed routings with
masked routes, NaN-poisoned free memory. The layer keeps these shapes behind status()["mega_moe_half_tiles.bf16.sm90"]
until this passes on a GPU, so the backends are called directly here: the fused forward, then the grouped backward
and (where it can run) the fused backward, which must equal the grouped one bit for bit. GPU only (sm_90)."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_sm90
from mega_helpers import make_problem, poison_free_memory, rel_err
from test_mega_grouped import NAMES, float64_reference

CASES = [  # T, E, H, I, K, routing, masked
    (300, 8, 2880, 2880, 2, "uniform", 0.0),
    (301, 16, 1088, 320, 4, "skewed", 0.1),
    (1000, 32, 1088, 320, 8, "uniform", 0.05),
]


def _require(key):
    from prime_kernels import _status

    why = _status.runnable(key)
    if why != _status.AVAILABLE:
        pytest.skip(f"{key} cannot run here: {why}")


@requires_sm90
@pytest.mark.parametrize("T,E,H,I,K,routing,masked", CASES)
def test_half_width_tiles_against_float64(T, E, H, I, K, routing, masked):
    from prime_kernels.mega import _backend, _fused, _fused_bwd, _grouped

    _require(_backend.HALF_TILES_KEY)
    prob = make_problem(T, H, I, E, K, routing=routing, seed=T + H + I, masked_frac=masked)
    x, idx, w, w13, w2, dy = [t.cuda() for t in prob]
    cap = _backend.capacity(T, K, E, 1, None, 128)
    poison_free_memory()
    fwd = _fused.forward(x, idx, w, w13, w2, num_experts=E, block_m=128, capacity=cap, save_h=True,
                         keep_x_pool=True)
    y, state, x_pool = fwd[0], fwd[1:7], fwd[7]
    poison_free_memory()
    got = _grouped.backward(dy, x, idx, w, w13, w2, *state, num_experts=E, x_pool=x_pool)
    ref = float64_reference(prob)
    for name, a, b in zip(NAMES, (y,) + tuple(got), ref):
        assert torch.isfinite(a).all(), f"{name}: non-finite (an element left unwritten?)"
        err = rel_err(a.cpu(), b.cpu())
        assert err < 1e-2, f"{name}: rel err {err:.3e} (H={H}, I={I})"
    from prime_kernels import _status

    if _status.runnable(_fused_bwd.STATUS_KEY) == _status.AVAILABLE:
        poison_free_memory()
        fused = _fused_bwd.backward(dy, x, idx, w, w13, w2, *state, num_experts=E, x_pool=x_pool)
        for name, a, b in zip(NAMES[1:], fused, got):
            assert torch.equal(a, b), f"{name}: the fused backward differs from the grouped one"
