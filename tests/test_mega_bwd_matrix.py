"""The layer's forward and backward as a trainer runs it (backend="auto": our kernels) against float64, over a
covering set of the backward's test matrix: routings (uniform, Zipf-skewed, one hot expert, empty experts, masked
routes, all masked), T in {0, 1, 7, 128, 1000, 4096, 16384}, E in {8, 16, 64, 128, 256}, (H, I) in {(256, 128),
(1024, 512), (2048, 768), (4096, 1536)}, with recompute=True and fp32 weight-gradient accumulation on some rows.
Every value of every axis appears in at least one case, the two Qwen3 shapes at T = 4096 and 16384 among them.

Each case: inputs drawn fresh on the GPU; the caching allocator's free memory filled with NaN before the run, so
an output element nothing wrote shows; y, dX, d topk_weights, dW13 and dW2 within 1e-2 relative of the reference
backend in float64 (the unrounded formula, which equals an independent per-token loop to ~1e-12, see
test_mega_reference.py); a second run bitwise equal to the first. The same matrix runs again through the grouped
backend with torch's grouped GEMM forced in place of ours (the path for GPUs without our sm90 kernels). GPU only (an
sm_90 device): the kernels' CPU-side checks and the reference have their own tests."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_sm90
from mega_helpers import poison_free_memory, rel_err, run_layer, skip_if_out_of_memory_on_a_small_card
from test_mega_grouped import float64_reference

NAMES = ("y", "dx", "dtopk", "dw13", "dw2")
BOUND = 1e-2

# T, E, H, I, K, routing, extra ("recompute", "accum", or "")
CASES = [
    (1, 8, 256, 128, 2, "uniform", ""),
    (7, 16, 1024, 512, 8, "zipf", ""),
    (7, 128, 4096, 1536, 8, "masked", "recompute"),
    (128, 64, 2048, 768, 8, "one_hot", ""),
    (128, 256, 256, 128, 8, "one_hot", "recompute"),
    (300, 16, 256, 128, 4, "all_masked", ""),
    (1000, 8, 4096, 1536, 2, "masked", ""),
    (1000, 128, 2048, 768, 8, "uniform", "accum"),
    (1000, 256, 1024, 512, 8, "empty_experts", ""),
    (4096, 64, 1024, 512, 8, "uniform", "accum"),
    (4096, 128, 2048, 768, 8, "zipf", ""),
    (4096, 128, 4096, 1536, 8, "uniform", "recompute"),
    (16384, 128, 2048, 768, 8, "uniform", ""),
    (16384, 128, 4096, 1536, 8, "zipf", ""),
    (16384, 256, 1024, 512, 8, "zipf", "recompute"),
]


def _routing(T: int, E: int, K: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """topk_idx [T, K] int64 on the GPU, K distinct experts per token (or -1)."""
    dev = "cuda"
    if kind == "zipf":  # popularity ~ 1/rank^1.1 over a random order of the experts (Gumbel top-k)
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float32, device=dev) ** 1.1
        pop = pop[torch.randperm(E, generator=g, device=dev)]
        u = torch.rand(T, E, generator=g, device=dev).clamp_(1e-20, 1.0)
        scores = pop.log() - torch.log(-torch.log(u))
    else:
        scores = torch.rand(T, E, generator=g, device=dev)
    if kind == "one_hot":  # every token's first route goes to one expert
        scores[:, int(torch.randint(E, (1,), generator=g, device=dev))] = 2.0
    if kind == "empty_experts":  # only a quarter of the experts receive routes
        used = torch.randperm(E, generator=g, device=dev)[: max(K, E // 4)]
        sub = torch.rand(T, used.numel(), generator=g, device=dev)
        return used[sub.topk(K, dim=1).indices].long()
    idx = scores.topk(K, dim=1).indices.long()
    if kind == "masked":
        idx[torch.rand(T, K, generator=g, device=dev) < 0.3] = -1
    elif kind == "all_masked":
        idx[:] = -1
    return idx


def _problem(T, E, H, I, K, kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(T, H, generator=g, device="cuda").to(bf)
    idx = _routing(T, E, K, kind, g)
    w = torch.rand(T, K, generator=g, device="cuda") + 0.1
    w = (w / w.sum(1, keepdim=True)).float()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H ** 0.5).to(bf)
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I ** 0.5).to(bf)
    dy = torch.randn(T, H, generator=g, device="cuda").to(bf)
    return x, idx, w, w13, w2, dy


def _run(prob, extra: str, accum_init=None, backend: str = "auto"):
    """(y, dx, dtopk, dw13, dw2) of ``backend``; with "accum", dW13 / dW2 as what the backward added into fp32
    accumulators that held accum_init."""
    x, idx, w, w13, w2, dy = prob
    if extra != "accum":
        return run_layer(x, idx, w, w13, w2, dy, recompute=extra == "recompute", backend=backend)
    a13, a2 = (t.clone() for t in accum_init)
    y, dx, dtopk, dw13, dw2 = run_layer(x, idx, w, w13, w2, dy, wgrad_accum=(a13, a2), backend=backend)
    assert dw13 is None and dw2 is None, "with wgrad_accum the weights get no .grad"
    return y, dx, dtopk, a13 - accum_init[0], a2 - accum_init[1]


@requires_sm90
@pytest.mark.parametrize("T,E,H,I,K,routing,extra", CASES)
def test_layer_matches_float64_and_repeats_bitwise(T, E, H, I, K, routing, extra):
    with skip_if_out_of_memory_on_a_small_card():
        _check_case(T, E, H, I, K, routing, extra)


@requires_sm90
@pytest.mark.parametrize("T,E,H,I,K,routing,extra", CASES)
def test_grouped_on_torch_gemms_matches_float64_and_repeats_bitwise(T, E, H, I, K, routing, extra):
    """The same matrix through backend="grouped" with torch's grouped GEMM in place of ours
    (prime_kernels.grouped_gemm_torch, the path for GPUs without our sm90 kernels), forced on this one."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    from prime_kernels.grouped_gemm_torch import forced

    with skip_if_out_of_memory_on_a_small_card(), forced():
        _check_case(T, E, H, I, K, routing, extra, backend="grouped")


def _check_case(T, E, H, I, K, routing, extra, backend="auto"):
    prob = _problem(T, E, H, I, K, routing, seed=T * 7 + E * 3 + H + I + K)
    accum_init = None
    if extra == "accum":
        g = torch.Generator(device="cuda").manual_seed(E + H)
        accum_init = (torch.randn(prob[3].shape, generator=g, device="cuda"),
                      torch.randn(prob[4].shape, generator=g, device="cuda"))
    poison_free_memory()
    got = _run(prob, extra, accum_init, backend)
    if routing == "all_masked":
        for name, t in zip(NAMES, got):
            assert torch.count_nonzero(t) == 0, f"{name}: all routes masked, yet not zero"
    else:
        ref = float64_reference(prob)
        for name, a, b in zip(NAMES, got, ref):
            assert torch.isfinite(a).all(), f"{name}: non-finite values (unwritten elements read as NaN)"
            err = rel_err(a, b)
            assert err < BOUND, f"{name}: rel err {err:.3e}"
        del ref
    poison_free_memory()
    again = _run(prob, extra, accum_init, backend)
    for name, a, b in zip(NAMES, got, again):
        assert torch.equal(a, b), f"{name}: a second run differs"


@requires_sm90
def test_empty_batch_gives_empty_y_and_zero_weight_gradients():
    """T = 0 (an EP rank or a short last micro-batch): y is [0, H], the weight gradients are zero (and the fp32
    accumulators are left as they were)."""
    prob = _problem(0, 16, 1024, 512, 4, "uniform", seed=5)
    y, dx, dtopk, dw13, dw2 = _run(prob, "")
    assert y.shape == (0, 1024) and dx.shape == (0, 1024) and dtopk.shape == (0, 4)
    assert torch.count_nonzero(dw13) == 0 and torch.count_nonzero(dw2) == 0
    init = (torch.ones(prob[3].shape, device="cuda"), torch.ones(prob[4].shape, device="cuda"))
    _y, _dx, _dt, d13, d2 = _run(prob, "accum", init)
    assert torch.count_nonzero(d13) == 0 and torch.count_nonzero(d2) == 0
