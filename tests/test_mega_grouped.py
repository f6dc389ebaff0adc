"""The "grouped" backend (our grouped GEMMs + combine, prime_kernels.mega._grouped) against float64."""

import re

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from mega_helpers import loop_reference, make_problem, rel_err, run_layer

NAMES = ("y", "dx", "dtopk", "dw13", "dw2")


def float64_reference(prob, clamp=None):
    """The reference backend in exact (float64) mode on the GPU: the unrounded formula, fast enough
    for thousands of tokens (it equals the per-token loop to ~1e-12, see test_mega_reference)."""
    x, idx, w, w13, w2, dy = [t.cuda() for t in prob]
    as64 = [t.double() if t.is_floating_point() else t for t in (x, idx, w, w13, w2, dy)]
    return run_layer(*as64, backend="reference", activation_clamp=clamp)


CASES = [  # T, E, H, I, K, routing, masked_frac, clamp, experts_used
    (1, 8, 256, 128, 2, "uniform", 0.0, None, None),
    (7, 64, 256, 256, 8, "skewed", 0.0, None, None),
    (128, 8, 512, 384, 4, "uniform", 0.2, None, None),
    (1000, 128, 256, 256, 8, "skewed", 0.05, None, None),
    (1000, 256, 384, 128, 8, "uniform", 0.0, None, 64),  # 192 experts get nothing
    (4096, 128, 512, 256, 8, "uniform", 0.0, None, None),
    (300, 16, 256, 128, 4, "all_masked", 0.0, None, None),
]


@requires_sm90
@pytest.mark.parametrize("T,E,H,I,K,routing,masked,clamp,used", CASES)
def test_grouped_matches_float64(T, E, H, I, K, routing, masked, clamp, used):
    prob = make_problem(T, H, I, E, K, routing=routing, seed=T + E + H, masked_frac=masked, experts_used=used)
    got = run_layer(*[t.cuda() for t in prob], backend="grouped", activation_clamp=clamp)
    if routing == "all_masked":
        for name, g in zip(NAMES, got):
            assert torch.count_nonzero(g) == 0, name
        return
    ref = loop_reference(*prob, clamp=clamp) if T <= 128 else float64_reference(prob, clamp)
    for name, a, b in zip(NAMES, got, ref):
        assert torch.isfinite(a).all(), name
        err = rel_err(a.cpu(), b.cpu())
        assert err < 1e-2, f"{name}: rel err {err:.3e}"


@requires_sm90
def test_grouped_is_bitwise_deterministic_and_auto_picks_it(monkeypatch):
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    assert prime_kernels.status()["mega_moe_grouped.bf16.sm90"] == "available"
    prob = [t.cuda() for t in make_problem(2048, 256, 256, 64, 8, routing="skewed", seed=5, masked_frac=0.1)]
    runs = [run_layer(*prob, backend="grouped") for _ in range(3)]
    for r in runs[1:]:
        for name, a, b in zip(NAMES, runs[0], r):
            assert torch.equal(a, b), name
    auto = run_layer(*prob, backend="auto")  # no fallback variable: auto must pick the grouped kernels
    for name, a, b in zip(NAMES, runs[0], auto):
        assert torch.equal(a, b), name


@requires_sm90
def test_low_level_calls_run_grouped():
    from prime_kernels.mega import bf16_mega_moe, bf16_mega_moe_backward, get_symm_buffer_for_mega_moe

    T, E, H, I, K = 512, 32, 256, 128, 4
    x, idx, w, w13, w2, dy = [t.cuda() for t in make_problem(T, H, I, E, K, seed=9, masked_frac=0.1)]
    buf = get_symm_buffer_for_mega_moe(None, E, T, K, H, I)
    buf.stage(x, idx, w)
    y = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    state = bf16_mega_moe(y, w13, w2, buf, backend="grouped")
    dx = torch.full_like(x, float("nan"))
    dtopk = torch.full_like(w, float("nan"))
    dw1 = torch.full_like(w13, float("nan"))
    dw2 = torch.full_like(w2, float("nan"))
    bf16_mega_moe_backward(dx, dw1, dw2, dtopk, dy, w13, w2, buf, state=state, backend="grouped")
    ref = loop_reference(x.cpu(), idx.cpu(), w.cpu(), w13.cpu(), w2.cpu(), dy.cpu())
    for name, a, b in zip(NAMES, (y, dx, dtopk, dw1, dw2), ref):
        assert rel_err(a.cpu(), b) < 1e-2, name


def _runnable_clamp_or_skip():
    from prime_kernels import _status
    from prime_kernels.mega import _grouped

    why = _status.runnable(_grouped.CLAMP_STATUS_KEY)
    if why != _status.AVAILABLE:
        pytest.skip(f"{_grouped.CLAMP_STATUS_KEY} cannot run here: {why}")


@requires_sm90
@pytest.mark.parametrize("clamp", [1.0, 7.0, 10.0])
@pytest.mark.parametrize("recompute", [False, True])
def test_grouped_with_a_clamp_against_float64_and_the_fused_h(clamp, recompute):
    """The grouped pipeline with activation_clamp (its forward and backward called directly: the layer keeps it
    behind its status entry until this passes on a GPU): y and every gradient against float64; the saved h bitwise
    the fused forward's (both keep the clamp masks of the fp32 pre-activation, F6); recompute gives the same
    gradients as the saved h."""
    from prime_kernels.mega import _backend, _fused, _grouped

    _runnable_clamp_or_skip()
    T, E, H, I, K = 301, 16, 512, 192, 4
    prob = make_problem(T, H, I, E, K, routing="skewed", seed=int(clamp) + 50, masked_frac=0.1)
    x, idx, w, w13, w2, dy = [t.cuda() for t in prob]
    cap = _backend.capacity(T, K, E, 1, None, 128)
    fwd = _grouped.forward(x, idx, w, w13, w2, num_experts=E, block_m=128, capacity=cap, save_h=True,
                           activation_clamp=clamp)
    y, h = fwd[0], fwd[1]
    fused = _fused.forward(x, idx, w, w13, w2, num_experts=E, block_m=128, capacity=cap, save_h=True,
                           activation_clamp=clamp)
    rows = int(fwd[3][-1])
    assert torch.equal(h[:rows], fused[1][:rows]), "h differs from the fused forward's"
    got = _grouped.backward(dy, x, idx, w, w13, w2, None if recompute else h, *fwd[2:7], num_experts=E,
                            recompute=recompute, activation_clamp=clamp)
    ref = float64_reference(prob, clamp)
    for name, a, b in zip(NAMES, (y,) + tuple(got), ref):
        assert torch.isfinite(a).all(), name
        err = rel_err(a.cpu(), b.cpu())
        assert err < 1e-2, f"{name}: rel err {err:.3e} (clamp {clamp}, recompute {recompute})"
    if recompute:
        saved = _grouped.backward(dy, x, idx, w, w13, w2, h, *fwd[2:7], num_experts=E, activation_clamp=clamp)
        for name, a, b in zip(NAMES[1:], got, saved):
            assert torch.equal(a, b), f"{name}: recompute differs from the saved h"


@pytest.mark.parametrize("clamp", [1.0, 7.0])
@pytest.mark.parametrize("recompute", [False, True])
def test_grouped_with_a_clamp_on_the_cpu_ops_against_float64(clamp, recompute):
    """The grouped pipeline's own logic with a clamp (h saved with the clamp masks by the L1's CPU op, as its kernel
    does; the clamp handed to the SwiGLU backward; the recompute through the masking L1) on the ops' CPU kernels,
    against the reference in float64."""
    from prime_kernels.mega import _grouped, reference
    from prime_kernels.routing import pool_capacity

    T, E, H, I, K = 61, 8, 128, 128, 3
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, routing="skewed", seed=23, masked_frac=0.1)
    x, w13 = x * 2, w13 * 2  # pre-activations of a few units, so that the clamp masks bite
    cap = pool_capacity(T, K, E, 128)
    fwd = _grouped.forward(x, idx, w, w13, w2, num_experts=E, block_m=128, capacity=cap, save_h=True,
                           activation_clamp=clamp)
    g = fwd[1][:, :I].float()
    assert bool((g > clamp).any()), "the clamp never bites"
    got = _grouped.backward(dy, x, idx, w, w13, w2, None if recompute else fwd[1], *fwd[2:7], num_experts=E,
                            recompute=recompute, activation_clamp=clamp)
    d = [t.double() for t in (x, w, w13, w2, dy)]
    ref = run_layer(d[0], idx, d[1], d[2], d[3], d[4], backend="reference", activation_clamp=clamp)
    for name, a, b in zip(NAMES, (fwd[0],) + tuple(got), ref):
        err = rel_err(a, b)
        assert err < 1e-2, f"{name}: rel err {err:.3e} (clamp {clamp}, recompute {recompute})"


def test_grouped_clamp_follows_its_own_status_entry():
    """With activation_clamp the grouped pipeline runs where its clamp entry (the L1's kernels that save h with the
    clamp masks) is available, and is refused with that entry's reason elsewhere (not yet verified on a GPU, no
    GPU); with precision="fp8" the entry is that of the FP8 L1's clamp instantiation."""
    from prime_kernels import _status
    from prime_kernels.mega import _grouped
    from prime_kernels.mega._backend import FusedKernelUnavailable, resolve_backend

    key = _grouped.CLAMP_STATUS_KEY
    why = _status.reason(key)
    for direction in ("fwd", "bwd"):
        if why == _status.AVAILABLE:
            assert resolve_backend("grouped", "bf16", direction, device_type="cuda", hidden=256, intermediate=256,
                                   activation_clamp=0.5) == "grouped"
        else:
            with pytest.raises(FusedKernelUnavailable, match=re.escape(f"{key}: {why}")):
                resolve_backend("grouped", "bf16", direction, device_type="cuda", hidden=256, intermediate=256,
                                activation_clamp=0.5)
    from prime_kernels.mega._backend import GROUPED_FP8_CLAMP_KEY, _grouped_reason

    fp8_why = _status.reason(GROUPED_FP8_CLAMP_KEY)  # the FP8 L1's clamp instantiation
    got = _grouped_reason("fp8", 1, activation_clamp=0.5)
    assert got is None if fp8_why == _status.AVAILABLE else got == f"{GROUPED_FP8_CLAMP_KEY}: {fp8_why}"


def test_zero_padding_rows_touches_only_the_padding_rows():
    """The grouped backward zeroes a padded plan's padding rows in the pools it gathers (the fused forward pads its
    plan; the GEMMs read those rows): exactly rows [offsets[e] + counts[e], offsets[e + 1]) become zero, every
    other row keeps its contents (NaN here), an unpadded plan changes nothing but the scratch rows past the pool."""
    from prime_kernels.mega import _grouped
    from prime_kernels.routing import pool_capacity, routing_plan

    T, E, K, H = 37, 6, 3, 16
    idx = make_problem(T, H, 32, E, K, routing="skewed", seed=5, masked_frac=0.2)[1]
    for block_m in (8, 1):
        cap = pool_capacity(T, K, E, 8)
        plan = routing_plan(idx, E, block_m, validate=False, capacity=cap)
        span = _grouped._padding_span(cap, T * K, E)
        assert span >= 1
        buf = torch.full((cap + span, H), float("nan"), dtype=torch.bfloat16)
        _grouped._zero_padding_rows(buf, plan.expert_counts, plan.expert_offsets, T * K, cap)
        off, cnt = plan.expert_offsets.long(), plan.expert_counts.long()
        pad = torch.zeros(cap, dtype=torch.bool)
        for e in range(E):
            pad[off[e] + cnt[e]:off[e + 1]] = True
        assert bool(pad.any()) == (block_m == 8)
        assert (buf[:cap][pad] == 0).all() and buf[:cap][~pad].isnan().all()


@pytest.mark.parametrize("recompute", [False, True])
def test_pipeline_logic_on_cpu(recompute):
    """The pipeline's own logic (plan layout, gathers, SwiGLU and its backward, combine) through the
    ops' CPU kernels, so CI checks it without a GPU; the GPU tests above check the CUDA kernels."""
    from prime_kernels.mega import _grouped
    from prime_kernels.routing import pool_capacity

    T, E, H, I, K = 61, 8, 64, 32, 3
    clamp = None
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, routing="skewed", seed=3 + recompute, masked_frac=0.15)
    cap = pool_capacity(T, K, E, 128)
    y, h, counts, offsets, src, srank, r2p = _grouped.forward(
        x, idx, w, w13, w2, activation_clamp=clamp, num_experts=E, block_m=128, capacity=cap, save_h=not recompute)
    assert src.shape == (cap,) and h.shape[0] == (0 if recompute else cap)
    # one plan layout for both kernel backends: every expert starts on an m-block, as the fused forward's plan
    assert (offsets.long() % 128 == 0).all() and (offsets[1:] - offsets[:-1] >= counts).all()
    dx, dtopk, dw13, dw2 = _grouped.backward(
        dy, x, idx, w, w13, w2, h, counts, offsets, src, srank, r2p, activation_clamp=clamp, num_experts=E,
        recompute=recompute)
    ref = loop_reference(x, idx, w, w13, w2, dy, clamp=clamp)
    for name, a, b in zip(NAMES, (y, dx, dtopk, dw13, dw2), ref):
        err = rel_err(a, b)
        assert err < 1e-2, f"{name}: rel err {err:.3e}"


def _swiglu_inputs(rows, I, device, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 2 * I, generator=g).bfloat16().to(device)
    da = torch.randn(rows, I, generator=g).bfloat16().to(device)
    T, K = rows, 2
    src = torch.randint(-1, T * K, (rows,), generator=g, dtype=torch.int32).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    n = torch.tensor([rows - 3], dtype=torch.int32, device=device)
    return h, da, src, w, n


def test_swiglu_ops_pass_opcheck():
    h, da, src, w, n = _swiglu_inputs(19, 16, "cpu", 0)
    torch.library.opcheck(torch.ops.prime_kernels.swiglu_fwd.default, (h, n, 0.7))
    torch.library.opcheck(torch.ops.prime_kernels.swiglu_bwd.default, (h, da, src, w, n, -1.0))


@requires_sm90
@pytest.mark.parametrize("clamp", [None, 0.7])
def test_swiglu_kernels_match_reference(clamp):
    from prime_kernels.swiglu import swiglu_bwd, swiglu_bwd_reference, swiglu_fwd, swiglu_fwd_reference

    h, da, src, w, n = _swiglu_inputs(1003, 384, "cuda", 1)
    c = -1.0 if clamp is None else clamp
    rows = int(n)
    s = swiglu_fwd(h, n, clamp)
    s_ref = swiglu_fwd_reference(h.cpu(), n.cpu(), c)
    assert rel_err(s[:rows].cpu(), s_ref[:rows]) < 1e-2
    outs = swiglu_bwd(h, da, src, w, n, clamp)
    refs = swiglu_bwd_reference(h.cpu(), da.cpu(), src.cpu(), w.cpu(), n.cpu(), c)
    for name, a, b in zip(("dh", "a", "dt"), outs, refs):
        assert torch.isfinite(a[:rows]).all(), name
        assert rel_err(a[:rows].cpu(), b[:rows]) < 1e-2, name
    again = swiglu_bwd(h, da, src, w, n, clamp)
    for a, b in zip(outs, again):
        assert torch.equal(a[:rows], b[:rows])
