"""The reference backend against an independent float64 per-token loop: forward and all four
gradients, on fresh random data; plus float64 gradcheck and the rounding-point conventions."""

import math

import pytest
import torch

from mega_helpers import loop_reference, make_problem, rel_err, run_layer

from prime_kernels.mega import mega_moe

TOL = 1e-2  # bf16 rounding points (measured ~3e-3: a few 2^-9 relative)

CASES = {
    "uniform": dict(T=64, routing="uniform"),
    "skewed": dict(T=96, routing="skewed"),
    "empty_experts": dict(T=48, routing="uniform", experts_used=5),
    "masked_some": dict(T=40, routing="uniform", masked_frac=0.3),
    "T1": dict(T=1, routing="uniform"),
    "T_not_mult_128": dict(T=130, routing="skewed"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("clamp", [None, 0.75])
def test_reference_vs_float64_loop(case, clamp):
    c = CASES[case]
    E, H, I, K = 8, 64, 32, 4
    x, idx, w, w13, w2, dy = make_problem(c["T"], H, I, E, K, routing=c["routing"], seed=sorted(CASES).index(case) + 100,
                                          masked_frac=c.get("masked_frac", 0.0), experts_used=c.get("experts_used"))
    got = run_layer(x, idx, w, w13, w2, dy, backend="reference", activation_clamp=clamp, block_m=16)
    ref = loop_reference(x, idx, w, w13, w2, dy, clamp=clamp)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, ref):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        err = rel_err(a, b)
        assert err < TOL, f"{case} clamp={clamp} {name}: rel err {err:.3e}"
    # masked routes get no topk-weight gradient; unused experts get zero weight gradients
    assert (got[2][idx < 0] == 0).all()
    if c.get("experts_used"):
        assert (got[3][c["experts_used"]:] == 0).all() and (got[4][c["experts_used"]:] == 0).all()


def test_exact_mode_matches_loop_to_float64_precision():
    """With float64 inputs every rounding point is the identity: the reference is the formula."""
    x, idx, w, w13, w2, dy = make_problem(33, 24, 12, 5, 3, routing="skewed", seed=3, dtype=torch.float64,
                                          masked_frac=0.2)
    for clamp in (None, 0.5):
        got = run_layer(x, idx, w, w13, w2, dy, backend="reference", activation_clamp=clamp, block_m=8)
        ref = loop_reference(x, idx, w, w13, w2, dy, clamp=clamp)
        for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, ref):
            assert rel_err(a, b) < 1e-12, name


def test_every_token_masked():
    x, idx, w, w13, w2, dy = make_problem(20, 64, 32, 8, 4, routing="all_masked", seed=5)
    y, dx, dtopk, dw13, dw2 = run_layer(x, idx, w, w13, w2, dy, backend="reference")
    for t in (y, dx, dtopk, dw13, dw2):
        assert (t == 0).all()


def test_block_m_does_not_change_results():
    x, idx, w, w13, w2, dy = make_problem(50, 64, 32, 8, 4, routing="skewed", seed=6)
    a = run_layer(x, idx, w, w13, w2, dy, backend="reference", block_m=128)
    b = run_layer(x, idx, w, w13, w2, dy, backend="reference", block_m=1)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_recompute_equals_saved_h():
    x, idx, w, w13, w2, dy = make_problem(70, 64, 32, 8, 4, routing="uniform", seed=7, masked_frac=0.1)
    a = run_layer(x, idx, w, w13, w2, dy, backend="reference", activation_clamp=0.5)
    b = run_layer(x, idx, w, w13, w2, dy, backend="reference", activation_clamp=0.5, recompute=True)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_int32_topk_idx_accepted():
    x, idx, w, w13, w2, dy = make_problem(16, 64, 32, 8, 2, seed=8)
    a = run_layer(x, idx, w, w13, w2, dy, backend="reference")
    b = run_layer(x, idx.int(), w, w13, w2, dy, backend="reference")
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_forward_rounding_points():
    """F3/F4/F5 spelled out independently on one route per token (K=1, weight fp32)."""
    x, idx, w, w13, w2, dy = make_problem(9, 32, 16, 4, 1, seed=9)
    y = mega_moe(x, idx, w, w13, w2, backend="reference")
    for t in range(9):
        e = int(idx[t, 0])
        h = w13[e].float() @ x[t].float()
        s = (torch.nn.functional.silu(h[:16]) * h[16:]).bfloat16().float()
        o = (w2[e].float() @ s).bfloat16().float()
        ref = (w[t, 0] * o).bfloat16()
        assert torch.allclose(y[t].float(), ref.float(), rtol=0, atol=1e-2 * ref.float().abs().max().item())


def test_clamp_gradient_at_equality_is_zero():
    """B5: with the pre-activation exactly at the bound, no gradient passes (the rule torch.clamp with
    scalar bounds follows in torch 2.14; torch 2.11 passes it at equality, so the rule is fixed here
    rather than taken from whichever torch runs). Float64, one token, one expert, H=1, g = c, u = -c."""
    c = 0.5
    x = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0]])
    w = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    w13 = torch.tensor([[[c], [-c]]], dtype=torch.float64, requires_grad=True)
    w2 = torch.tensor([[[1.0]]], dtype=torch.float64, requires_grad=True)
    y = mega_moe(x, idx, w, w13, w2, backend="reference", activation_clamp=c)
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w13.grad, torch.zeros_like(w13))
    silu_c = c / (1 + math.exp(-c))
    assert torch.allclose(w.grad, torch.tensor([[silu_c * -c]], dtype=torch.float64), rtol=1e-12, atol=0)
    # Where the running torch uses the same rule, the reference equals torch.clamp's autograd too.
    probe = torch.tensor([c], dtype=torch.float64, requires_grad=True)
    torch.clamp(probe, max=c).sum().backward()
    if probe.grad.item() == 0.0:
        xr = x.detach().clone().requires_grad_()
        a = w13.detach().clone().requires_grad_()
        h = a[0, :, 0] * xr[0, 0]
        g = torch.clamp(h[:1], max=c)
        u = torch.clamp(h[1:], min=-c, max=c)
        (torch.nn.functional.silu(g) * u).sum().backward()
        assert torch.equal(x.grad, xr.grad) and torch.equal(w13.grad, a.grad)


@pytest.mark.parametrize("clamp", [None, 0.3])
def test_gradcheck_float64(clamp):
    torch.manual_seed(11)
    T, H, I, E, K = 4, 4, 3, 3, 2
    x, idx, w, w13, w2, _ = make_problem(T, H, I, E, K, seed=12, dtype=torch.float64)
    idx[1, 0] = -1
    inputs = [t.clone().requires_grad_() for t in (x, w, w13, w2)]

    def f(x_, w_, a_, b_):
        return mega_moe(x_, idx, w_, a_, b_, backend="reference", activation_clamp=clamp, block_m=2)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_reference_plan_is_the_routing_plan_in_the_call_capacity():
    """The reference backend's single-rank plan is prime_kernels.routing's, laid into the call's pool capacity
    (rows past the plan's end are padding: source route and rank -1)."""
    from prime_kernels import routing
    from prime_kernels.mega._plan import build_plan

    _, idx, *_ = make_problem(77, 8, 8, 10, 3, routing="skewed", seed=13, masked_frac=0.2)
    p = routing.routing_plan_reference(idx, 10, 16)
    cap = routing.pool_capacity(77, 3, 10, 16) + 16
    counts, offsets, src, srank, r2p = build_plan(idx, 10, 16, cap)
    assert torch.equal(p.expert_counts, counts) and torch.equal(p.expert_offsets, offsets)
    n = int(offsets[-1])
    assert src.shape == (cap,) and torch.equal(p.pool_src_route[:n], src[:n]) and (src[n:] == -1).all()
    assert torch.equal(srank, torch.where(src >= 0, 0, -1).int())
    assert torch.equal(p.route_to_pool.view(77, 3), r2p)


def test_saved_h_rounding_keeps_clamp_masks():
    """F6: the bf16 h the backward sees gives the same clamp masks as the forward's fp32 h."""
    from prime_kernels.mega.reference import round_h

    g = torch.Generator().manual_seed(14)
    c = 0.75
    h = torch.randn(4096, 64, generator=g) * 0.01 + c  # many values within a bf16 ulp of c
    h[:, 32:] *= torch.where(torch.rand(4096, 32, generator=g) < 0.5, -1.0, 1.0)
    hb = round_h(h, c, torch.bfloat16).float()
    assert torch.equal(hb[:, :32] < c, h[:, :32] < c)
    assert torch.equal(hb[:, 32:] < c, h[:, 32:] < c) and torch.equal(hb[:, 32:] > -c, h[:, 32:] > -c)
    assert ((hb - h).abs() <= h.abs() * 2 ** -7).all()  # still within one bf16 ulp
    assert torch.equal(round_h(h, None, torch.bfloat16), h.bfloat16())
