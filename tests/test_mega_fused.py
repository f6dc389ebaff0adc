"""The fused sm90 forward (backend="fused", prime_kernels.mega._fused) against float64, on the GPU.

The matrix: uniform, Zipf-skewed, one hot expert, empty experts and -1 masked routings;
T in {1, 7, 128, 1000, 4096, 16384}; E in {8, 64, 128, 256}. Every run starts from a caching
allocator whose free blocks hold NaN (poison_allocator), so a pool row the kernel fails to write
shows up as a non-finite output instead of a stale value.
"""

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from mega_helpers import make_problem, rel_err

FUSED_KEY = "mega_moe.bf16.sm90"
# CTA counts of the launch: every one must give the same bits (the kernel claims its work, whichever CTAs run).
NUM_SMS = [0, 1, 7, 66]


def _require_fused():
    reason = prime_kernels.status().get(FUSED_KEY)
    if reason != "available":
        pytest.skip(f"{FUSED_KEY}: {reason}")


def poison_allocator(num_bytes: int = 1 << 30) -> None:
    """Fill free memory of torch's caching allocator with NaN: the next allocations (the kernel's
    pool tensors and outputs) start as NaN rather than zeros or a previous run's values."""
    torch.cuda.synchronize()
    blocks = [torch.full((num_bytes // 8 // 2,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    del blocks


def fused_forward(x, idx, w, w13, w2, clamp=None):
    from prime_kernels.mega import mega_moe

    poison_allocator()
    with torch.no_grad():
        return mega_moe(x, idx, w, w13, w2, backend="fused", activation_clamp=clamp)


def float64_forward(x, idx, w, w13, w2, clamp=None):
    """Unrounded float64 forward on the GPU (routes looped per expert, no bf16 rounding anywhere)."""
    x, w13, w2, w = x.double(), w13.double(), w2.double(), w.double()
    T, K = idx.shape
    I = w13.shape[1] // 2
    y = torch.zeros(T, x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(idx[idx >= 0]).tolist():
        t, k = torch.nonzero(idx == e, as_tuple=True)
        h = x[t] @ w13[e].T
        g, u = h[:, :I], h[:, I:]
        if clamp is not None:
            g = g.clamp(max=clamp)
            u = u.clamp(-clamp, clamp)
        o = (torch.nn.functional.silu(g) * u) @ w2[e].T
        y.index_add_(0, t, w[t, k, None] * o)
    return y


def hot_routing(T, E, K, seed, hot=3):
    """K distinct experts per token, the first always expert `hot`: one expert gets every token."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    first = idx[:, 0].clone()
    dup = idx[:, 1:] == hot
    idx[:, 0] = hot
    idx[:, 1:][dup] = first.unsqueeze(1).expand(-1, K - 1)[dup]
    return idx


CASES = [  # T, E, H, I, K, routing, masked_frac, experts_used, clamp
    (1, 8, 256, 128, 2, "uniform", 0.0, None, None),
    (7, 64, 256, 256, 8, "skewed", 0.0, None, None),
    (128, 8, 512, 384, 4, "uniform", 0.2, None, None),
    (1000, 128, 256, 256, 8, "skewed", 0.05, None, None),
    (1000, 256, 384, 128, 8, "uniform", 0.0, 64, None),  # 192 experts get no rows
    (1000, 64, 256, 384, 8, "hot", 0.0, None, None),
    (4096, 128, 512, 256, 8, "uniform", 0.0, None, None),
    (4096, 64, 256, 128, 6, "skewed", 0.1, None, 0.75),
    (16384, 128, 256, 128, 8, "uniform", 0.0, None, None),
    (999, 64, 256, 128, 2, "skewed", 0.3, None, None),  # ~9% of the tokens have no route
    (16384, 256, 256, 128, 8, "skewed", 0.02, None, None),
]


@requires_sm90
@pytest.mark.parametrize("T,E,H,I,K,routing,masked,used,clamp", CASES)
def test_fused_forward_matches_float64(T, E, H, I, K, routing, masked, used, clamp):
    _require_fused()
    seed = 1000 + T + E + H + I
    prob = make_problem(T, H, I, E, K, routing="skewed" if routing == "skewed" else "uniform", seed=seed,
                        masked_frac=masked, experts_used=used)
    x, idx, w, w13, w2, _ = [t.cuda() for t in prob]
    if routing == "hot":
        idx = hot_routing(T, E, K, seed).cuda()
    y = fused_forward(x, idx, w, w13, w2, clamp)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.isfinite(y).all(), "non-finite output (a pool row was not written?)"
    ref = float64_forward(x, idx, w, w13, w2, clamp)
    if ref.norm() == 0:
        assert torch.count_nonzero(y) == 0
        return
    err = rel_err(y, ref)
    assert err < 1e-2, f"rel err {err:.3e}"
    # masked tokens (all routes -1) get exact zeros
    dead = (idx < 0).all(1)
    assert torch.count_nonzero(y[dead]) == 0


@requires_sm90
def test_fused_forward_all_masked_is_zero():
    _require_fused()
    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(300, 256, 128, 16, 4, routing="all_masked", seed=9)]
    y = fused_forward(x, idx, w, w13, w2)
    assert torch.count_nonzero(y) == 0


@requires_sm90
def test_fused_forward_is_bitwise_deterministic_and_matches_grouped_rounding():
    _require_fused()
    prob = [t.cuda() for t in make_problem(4096, 256, 256, 64, 8, routing="skewed", seed=11, masked_frac=0.1)]
    x, idx, w, w13, w2, _ = prob
    runs = [fused_forward(x, idx, w, w13, w2) for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(runs[0], r)
    # Same rounding points as the grouped pipeline (F1-F5, fp32 accumulation in the same k order): equal
    # bit for bit.
    from prime_kernels.mega import mega_moe

    with torch.no_grad():
        grouped = mega_moe(x, idx, w, w13, w2, backend="grouped")
    assert torch.equal(runs[0], grouped)


def _skewed_fused_fwd(T: int, E: int, H: int, I: int, K: int, seed: int):
    """A skewed routing with masked routes, on CUDA. Returns run(save_h, clamp, num_sms, label) -> (s, h, o) of the
    fused forward op over the plan's pool rows (h: empty without save_h), each run on NaN-poisoned memory and checked
    to leave no pool row unwritten (label names the variant in the message)."""
    from prime_kernels.routing import routing_plan

    x, idx, _, w13, w2, _ = [t.cuda() for t in make_problem(T, H, I, E, K, routing="skewed", seed=seed,
                                                            masked_frac=0.05)]
    plan = routing_plan(idx, E, 1, validate=False)
    rows = int(plan.expert_offsets[-1])
    op = torch.ops.prime_kernels.mega_moe_fused_fwd

    def run(save_h: bool, clamp: float, num_sms: int, label: str):
        poison_allocator()
        s, h, o, _, _ = op(x, plan.pool_src_route, plan.expert_offsets, w13, w2, K, save_h, clamp, False, None, None,
                           num_sms)
        got = (s[:rows], h[:rows] if save_h else h, o[:rows])
        for name, t in zip("sho", got):
            assert torch.isfinite(t.float()).all(), f"{name} ({label}) has rows the kernel did not write"
        return got

    return run


@requires_sm90
@pytest.mark.parametrize("save_h,clamp", [(True, 0.0), (False, 0.0), (True, 0.75)])
def test_fused_outputs_are_bitwise_equal_at_every_num_sms(save_h, clamp):
    """The kernel claims its tasks and dispatch pieces from counters, so any number of CTAs (one included: it then
    waits only on its own earlier tasks) computes the same s, h and o, bit for bit, and repeats agree. Skewed
    routing: tiles crossing an expert's end take the consumers' epilogue, whole tiles the hand-off to the dispatch
    warps, in the same run; I = 320 leaves the last L1 n-block half empty and H = 448 the last L2 n-block a quarter
    empty (a 64-column box past the end is not stored)."""
    _require_fused()
    run = _skewed_fused_fwd(4097, 32, 448, 320, 8, seed=31)
    ref = run(save_h, clamp, 0, "all SMs")
    for num_sms in NUM_SMS + [0]:
        got = run(save_h, clamp, num_sms, f"num_sms={num_sms}")
        for name, a, b in zip("sho", ref, got):
            assert torch.equal(a, b), f"{name}: num_sms={num_sms} differs from the run on every SM"


@requires_sm90
@pytest.mark.parametrize("num_sms", [0, 5])
@pytest.mark.parametrize("T,H", [(3001, 448), (3001, 2112), (7, 448)])
def test_token_major_dispatch_is_bit_identical(num_sms, T, H):
    """With route_to_pool the pool rows past a split are dispatched token by token (each x row read once, stored
    to all its routes' rows); without it, every row in pool order. x_pool, h and o agree bit for bit between
    the two, x_pool holds exactly x's rows in pool order (NaN-poisoned memory), and y is the combine of o.
    H = 2112: a row is two dispatch pieces, the second partial; T = 7: fewer tokens than dispatch warps. Skewed
    routing, masked routes."""
    _require_fused()
    from prime_kernels.routing import routing_plan

    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(T, H, 192, 32, 8, routing="skewed", seed=53 + T,
                                                            masked_frac=0.05)]
    K = idx.shape[1]
    plan = routing_plan(idx, 32, 1, validate=False)
    rows = int(plan.expert_offsets[-1])
    src = plan.pool_src_route[:rows].long()
    op = torch.ops.prime_kernels.mega_moe_fused_fwd

    def run(token_major: bool):
        poison_allocator()
        s, h, o, x_pool, y = op(x, plan.pool_src_route, plan.expert_offsets, w13, w2, K, True, 0.0, True,
                                plan.route_to_pool if token_major else None, w.float() if token_major else None,
                                num_sms)
        # (with route_to_pool the op frees s before the combine: it is compared through h and o)
        got = (h[:rows], o[:rows], x_pool[:rows])
        assert torch.equal(got[2], x[src // K]), f"x_pool (token_major={token_major}) is not x's rows in pool order"
        return got, y

    ref, _ = run(False)
    for _ in range(2):
        got, y = run(True)
        for name, a, b in zip(("h", "o", "x_pool"), ref, got):
            assert torch.equal(a, b), f"{name}: the token-major dispatch differs from the pool-order dispatch"
        assert torch.equal(y, torch.ops.prime_kernels.combine(got[1], plan.route_to_pool, w.float()))


@requires_sm90
def test_token_major_dispatch_survives_an_inconsistent_route_map():
    """route_to_pool that does not invert pool_src_route (routes masked, two routes' rows swapped, two routes
    naming one row) cannot hang or skip the token-major dispatch: the rows it does not name back are copied from
    pool_src_route, so x_pool is still x's rows in pool order and h, o match the pool-order dispatch (the run
    without route_to_pool)."""
    _require_fused()
    from prime_kernels.routing import routing_plan

    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(1001, 256, 128, 16, 4, seed=59)]
    T, K = idx.shape
    plan = routing_plan(idx, 16, 1, validate=False)
    rows = int(plan.expert_offsets[-1])
    src = plan.pool_src_route[:rows].long()
    bad = plan.route_to_pool.clone().view(-1)
    bad[7] = -1
    bad[[100, 2000]] = bad[[2000, 100]].clone()
    bad[3001] = bad[3002]
    op = torch.ops.prime_kernels.mega_moe_fused_fwd
    outs = {}
    for label, r2p, weights in (("pool order", None, None), ("bad map", bad.view(T, K), w.float())):
        poison_allocator()
        s, h, o, x_pool, _ = op(x, plan.pool_src_route, plan.expert_offsets, w13, w2, K, True, 0.0, True, r2p,
                                weights)
        torch.cuda.synchronize()
        assert torch.equal(x_pool[:rows], x[src // K]), f"x_pool ({label})"
        outs[label] = (h[:rows], o[:rows])  # (with route_to_pool the op frees s before its combine)
    for name, a, b in zip("ho", outs["pool order"], outs["bad map"]):
        assert torch.equal(a, b), f"{name}: an inconsistent map changed the result"


@requires_sm90
def test_fused_forward_saves_h_and_auto_backward_runs(monkeypatch):
    """backend="auto": the fused forward, then the grouped backward from the state it saved."""
    _require_fused()
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    from prime_kernels.mega import mega_moe

    from mega_helpers import run_layer

    prob = [t.cuda() for t in make_problem(1000, 256, 256, 32, 4, routing="skewed", seed=12, masked_frac=0.05)]
    auto = run_layer(*prob, backend="auto")
    grouped = run_layer(*prob, backend="grouped")
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), auto, grouped):
        assert torch.equal(a, b), name


@requires_sm90
@pytest.mark.parametrize("T,E,H,K,masked", [(1, 8, 192, 2, 0.0), (999, 64, 192, 2, 0.3), (4096, 128, 512, 8, 0.05)])
def test_fused_op_combine_is_the_standalone_combine_bit_for_bit(T, E, H, K, masked):
    """The op's y equals the standalone combine kernel over the same o, bit for bit, over 3 runs, and tokens
    with no route are zero (hidden = 192 has a half-width column block)."""
    _require_fused()
    from prime_kernels.routing import routing_plan

    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(T, H, 128, E, K, routing="skewed", seed=T + H + K,
                                                            masked_frac=masked)]
    plan = routing_plan(idx, E, 1, validate=False)
    r2p = plan.route_to_pool.view(T, K)
    ys = []
    for _ in range(3):
        poison_allocator()
        _, _, o, _, y = torch.ops.prime_kernels.mega_moe_fused_fwd(x, plan.pool_src_route, plan.expert_offsets, w13, w2,
                                                               K, False, 0.0, False, r2p, w)
        ys.append(y)
        assert torch.equal(y, torch.ops.prime_kernels.combine(o, r2p, w))
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    dead = (idx < 0).all(1)
    assert torch.count_nonzero(ys[0][dead]) == 0 and torch.isfinite(ys[0]).all()
    if masked ** K * T > 20:
        assert bool(dead.any()), "no token without a route: the zero-row path was not exercised"
    with pytest.raises(RuntimeError, match="route_to_pool"):
        torch.ops.prime_kernels.mega_moe_fused_fwd(x, plan.pool_src_route, plan.expert_offsets, w13, w2, K + 1, False,
                                               0.0, False, r2p, w)
    with pytest.raises(RuntimeError, match="only used with route_to_pool"):
        torch.ops.prime_kernels.mega_moe_fused_fwd(x, plan.pool_src_route, plan.expert_offsets, w13, w2, K, False,
                                               0.0, False, None, w)


@requires_sm90
def test_fused_saved_h_keeps_the_clamp_masks():
    """With a clamp, the saved h follows rounding point F6: a pre-activation strictly on one side of a bound
    stays strictly on that side in bf16 (plain rounding puts everything within half an ulp of c onto c; at
    c = 0.75 that is ~0.2% of unit-variance values, and each loses its gradient). Checked against an fp32
    matmul of the same pool rows, away from the bound by more than the fp32 accumulation-order noise."""
    _require_fused()
    from prime_kernels.routing import routing_plan

    T, E, H, I, K, c = 4096, 16, 512, 256, 4, 0.75
    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(T, H, I, E, K, seed=21)]
    plan = routing_plan(idx, E, 1, validate=False)
    src = plan.pool_src_route
    poison_allocator()
    s, h, o, _, _ = torch.ops.prime_kernels.mega_moe_fused_fwd(x, src, plan.expert_offsets, w13, w2, K, True, c)
    rows = int(plan.expert_offsets[-1])
    xp = x[(src[:rows] // K).long()].float()
    offs = plan.expert_offsets.tolist()
    ref = torch.empty(rows, 2 * I, device="cuda")
    for e in range(E):
        ref[offs[e]:offs[e + 1]] = xp[offs[e]:offs[e + 1]] @ w13[e].float().T
    got = h[:rows].float()
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-2
    tol = 1e-4
    gate, up = (slice(0, I), slice(I, 2 * I))
    near = 0
    for cols, bounds in ((gate, (c,)), (up, (c, -c))):
        for b in bounds:
            r, g = ref[:, cols], got[:, cols]
            below, above = r < b - tol, r > b + tol
            assert bool((g[below] < b).all()), f"a value below {b} was saved on or above it"
            assert bool((g[above] > b).all()), f"a value above {b} was saved on or below it"
            near += int(((r - b).abs() < 2e-3).sum())
    assert near > 0, "no pre-activation near a bound: the check did not exercise F6"


@requires_sm90
@pytest.mark.parametrize("backend", ["fused", "grouped"])
def test_out_of_range_expert_id_raises_and_leaves_caller_memory_alone(backend):
    """The kernel backends check the ids after queueing their kernels (no GPU idle time), yet still raise
    before returning, and bf16_mega_moe leaves the caller's y untouched."""
    if backend == "fused":
        _require_fused()
    from prime_kernels.mega import bf16_mega_moe, get_symm_buffer_for_mega_moe, mega_moe

    T, H, I, E, K = 37, 256, 128, 16, 4
    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(T, H, I, E, K, seed=21)]
    for bad in (E, -2):
        idx_bad = idx.clone()
        idx_bad[T // 2, 1] = bad
        with pytest.raises(ValueError, match=r"must lie in \[-1, 15\]"):
            mega_moe(x, idx_bad, w, w13, w2, backend=backend)
        buf = get_symm_buffer_for_mega_moe(None, E, T, K, H, I, device="cuda")
        buf.x[:T].copy_(x)
        buf.topk_idx[:T].copy_(idx_bad)
        buf.topk_weights[:T].copy_(w)
        y = torch.randn(T, H, device="cuda").bfloat16()
        before = y.clone()
        with pytest.raises(ValueError, match=r"must lie in \[-1, 15\]"):
            bf16_mega_moe(y, w13, w2, buf, backend=backend)
        assert torch.equal(y, before)


@requires_sm90
def test_autograd_layer_has_no_implicit_host_sync(monkeypatch):
    """Forward and backward of backend "auto" queue their work without a synchronizing torch call (the
    expert-id check reads through pinned memory after the launches), so the host can run ahead."""
    _require_fused()
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2, dy = [t.cuda() for t in make_problem(1000, 256, 256, 32, 4, routing="skewed", seed=22)]
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="auto")  # warm-up (status, first launches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="auto")
        grads = torch.autograd.grad(y, leaves, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(g).all() for g in grads)


@requires_sm90
def test_fused_forward_keeps_pooled_x_for_the_backward(monkeypatch):
    """keep_pooled_x: the fused forward returns its dispatched rows (exactly x's rows in pool order, NaN
    poisoned buffers), y is unchanged, and the backward that uses them instead of gathering x again
    gives the same gradients bit for bit."""
    _require_fused()
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    from prime_kernels.mega import _ops, mega_moe

    x, idx, w, w13, w2, dy = [t.cuda() for t in make_problem(999, 256, 256, 32, 4, routing="skewed", seed=23,
                                                             masked_frac=0.05)]
    T, K = idx.shape
    poison_allocator()
    out = _ops.mega_moe_fwd(x, idx, w, w13, w2, None, None, None, "", 32, 1, T, 128, True, "fused", "bf16", 0, True)
    src, x_pool = out[4], out[7]
    assert x_pool.shape == (src.shape[0], 256)
    valid = src >= 0
    assert torch.equal(x_pool[valid], x[(src[valid] // K).long()])
    runs = {}
    for keep in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
        poison_allocator()
        y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="auto", keep_pooled_x=keep)
        runs[keep] = (y.detach(),) + torch.autograd.grad(y, leaves, dy)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), runs[False], runs[True]):
        assert torch.isfinite(b).all(), name
        assert torch.equal(a, b), name


@requires_sm90
@pytest.mark.parametrize("save_h,keep_x_pool", [(True, True), (False, False)])
def test_fused_op_combine_does_not_raise_the_peak(save_h, keep_x_pool):
    """With the combine as a second launch, the op frees s (dead once the forward kernel is queued) before it
    allocates y, so asking for y costs no peak memory: the op's peak with route_to_pool is about its peak
    without (where y is never allocated), not that plus y's bytes. s comes back empty in that case. Each
    measured call starts from an emptied allocator cache so both see the same block rounding (a cached block
    reused without a split counts whole: up to 1 MB of noise per tensor otherwise)."""
    _require_fused()
    from prime_kernels.routing import routing_plan

    T, E, H, I, K = 2047, 32, 512, 512, 4
    x, idx, w, w13, w2, _ = [t.cuda() for t in make_problem(T, H, I, E, K, routing="skewed", seed=5, masked_frac=0.1)]
    plan = routing_plan(idx, E, 1, validate=False)
    r2p = plan.route_to_pool.view(T, K)
    op = torch.ops.prime_kernels.mega_moe_fused_fwd
    args = (x, plan.pool_src_route, plan.expert_offsets, w13, w2, K, save_h, 0.0, keep_x_pool)

    def peak(*extra):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = op(*args, *extra)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    without, out = peak()
    del out
    with_y, (s, _, o, _, y) = peak(r2p, w)
    y_bytes = T * H * 2  # 2 MB; before the change the peak with y was the peak without plus this
    assert s.shape == (0, I)
    assert torch.equal(y, torch.ops.prime_kernels.combine(o, r2p, w))
    assert with_y <= without + y_bytes // 4, f"peak with y {with_y} B, without {without} B (y is {y_bytes} B)"
