"""Shared experts over the backward's test matrix: every case of test_mega_bwd_matrix.CASES up to T = 4096 (the
routings, T, E and (H, I) it covers, masked and all-masked routes and empty experts included) with S = 1 and S = 2
shared experts of width I and a per-expert gate, in bf16 and fp8, through mega_moe with backend="auto" on the GPU:
y and every gradient (x, topk_weights, the routed and shared weights, the gate) against the reference's float64
evaluation of the same layer, on NaN-poisoned free memory, and a second run bit for bit the first.

Which path a call takes is the layer's choice (prime_kernels.mega._shared_ops.reason): S = 1 and S = 2 of width I
are one and two shared groups, which run inside the routed launches in both precisions (bf16 up to
BF16_MAX_SHARED_GROUPS); the second pass has its own tests (test_mega_shared.py). Bounds: bf16 the matrix's
1e-2; fp8 the FP8 matrix's bound against float64 (the recipe's own error, 1.2e-1), with a wider one for d
topk_weights and d gate of fewer than 16 tokens (a few values, each a dot product with an output carrying the e4m3
roundings' error, which a norm over so few does not average)."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_sm90
from mega_helpers import poison_free_memory, rel_err, skip_if_out_of_memory_on_a_small_card, skip_unless_available
from test_fp8_matrix import BOUND_FLOAT64 as FP8_BOUND
from test_mega_bwd_matrix import BOUND as BF16_BOUND
from test_mega_bwd_matrix import CASES as MATRIX_CASES
from test_mega_bwd_matrix import _problem

NAMES = ("y", "dx", "dtopk", "dw13", "dw2", "dsw13", "dsw2", "dgate")
FEW_TOKENS_BOUND = 2.5e-1
CASES = [(precision, S, *case) for precision in ("bf16", "fp8") for S in (1, 2)
         for case in MATRIX_CASES if case[0] <= 4096]


def _shared(S: int, H: int, I: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    sw13 = (torch.randn(S, 2 * I, H, generator=g, device="cuda") / H ** 0.5).to(torch.bfloat16)
    sw2 = (torch.randn(S, H, I, generator=g, device="cuda") / I ** 0.5).to(torch.bfloat16)
    gate = torch.rand(T, S, generator=g, device="cuda") + 0.5
    return sw13, sw2, gate


def _run(prob, shared, **kw):
    """mega_moe forward + backward on leaf copies: the gradients of NAMES, in order."""
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2, dy = prob
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2, *shared)]
    y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], shared_w13=leaves[4], shared_w2=leaves[5],
                 shared_gate=leaves[6], num_experts=w13.shape[0], **kw)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


def _float64(prob, shared):
    as64 = [t.double() if t.is_floating_point() else t for t in prob]
    return _run(as64, [t.double() for t in shared], backend="reference")


@requires_sm90
@pytest.mark.parametrize("precision,S,T,E,H,I,K,routing,extra", CASES)
def test_shared_experts_over_the_matrix_against_float64(precision, S, T, E, H, I, K, routing, extra):
    skip_unless_available("mega_moe_shared.bf16.sm90" if precision == "bf16" else "mega_moe_shared.fp8.sm90")
    if precision == "fp8":
        skip_unless_available("mega_moe.fp8.sm90")
    recompute = extra == "recompute"  # "accum" rows: shared experts take no wgrad_accum, so the plain backward
    seed = T * 7 + E * 3 + H + I + K + S
    with skip_if_out_of_memory_on_a_small_card():
        prob = _problem(T, E, H, I, K, routing, seed=seed)
        shared = _shared(S, H, I, T, seed + 1)
        poison_free_memory()
        got = _run(prob, shared, backend="auto", precision=precision, recompute=recompute)
        want = _float64(prob, shared)
        failures = []
        for name, a, b in zip(NAMES, got, want):
            assert a is not None and torch.isfinite(a.float()).all(), f"{name}: missing or non-finite"
            if torch.count_nonzero(b) == 0:  # all routes masked: the routed parts are zero
                if torch.count_nonzero(a) != 0:
                    failures.append(f"{name}: the float64 value is zero, this is not")
                continue
            bound = BF16_BOUND if precision == "bf16" else FP8_BOUND
            if precision == "fp8" and T < 16 and name in ("dtopk", "dgate"):
                bound = FEW_TOKENS_BOUND
            err = rel_err(a, b)
            print(f"[shared-matrix] {precision} S={S} T={T} E={E} H={H} I={I} {routing} {extra or '-'} {name}: "
                  f"{err:.3e}")
            if not err < bound:
                failures.append(f"{name}: rel err {err:.3e} >= {bound:g}")
        assert not failures, "; ".join(failures)
        del want
        poison_free_memory()
        again = _run(prob, shared, backend="auto", precision=precision, recompute=recompute)
        for name, a, b in zip(NAMES, got, again):
            assert torch.equal(a, b), f"{name}: a second run differs"
