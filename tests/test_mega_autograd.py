"""Custom ops: opcheck, torch.compile (aot_eager), non-reentrant checkpoint, fp32 wgrad accumulation."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mega_helpers import make_problem, run_layer

from prime_kernels.mega import MegaMoE, mega_moe

E, H, I, K = 6, 32, 16, 3


def _fwd_args(x, idx, w, w13, w2, *, accum=(None, None), clamp=None, recompute=False, block_m=8):
    return (x, idx, w, w13, w2, accum[0], accum[1], clamp, "", E, 1, x.shape[0], block_m, not recompute,
            "reference", "bf16", 0)


@pytest.mark.parametrize("clamp,recompute", [(None, False), (0.5, True)])
def test_opcheck_forward(clamp, recompute):
    x, idx, w, w13, w2, _ = make_problem(11, H, I, E, K, seed=21, masked_frac=0.2)
    args = _fwd_args(x.requires_grad_(), idx, w.requires_grad_(), w13.requires_grad_(), w2.requires_grad_(),
                     clamp=clamp, recompute=recompute)
    torch.library.opcheck(torch.ops.prime_kernels.mega_moe_fwd.default, args)


def test_opcheck_backward_with_and_without_accum():
    x, idx, w, w13, w2, dy = make_problem(9, H, I, E, K, seed=22, masked_frac=0.1)
    out = torch.ops.prime_kernels.mega_moe_fwd(*_fwd_args(x, idx, w, w13, w2))
    _, h, counts, offsets, src, srank, r2p, _ = out
    base = (dy, x, idx, w, w13, w2, h, counts, offsets, src, srank, r2p)
    tail = (None, "", E, False, True, "reference", "bf16", 0)
    torch.library.opcheck(torch.ops.prime_kernels.mega_moe_bwd.default, base + (None, None) + tail)
    acc = (torch.randn(w13.shape), torch.randn(w2.shape))
    torch.library.opcheck(torch.ops.prime_kernels.mega_moe_bwd.default, base + acc + tail)


def test_opcheck_forward_keeping_pooled_x():
    x, idx, w, w13, w2, _ = make_problem(10, H, I, E, K, seed=25, masked_frac=0.2)
    args = _fwd_args(x.requires_grad_(), idx, w.requires_grad_(), w13.requires_grad_(), w2.requires_grad_())
    torch.library.opcheck(torch.ops.prime_kernels.mega_moe_fwd.default, args + (True,))
    out = torch.ops.prime_kernels.mega_moe_fwd(*(args + (True,)))
    src, x_pool = out[4], out[7]
    assert x_pool.shape == (src.shape[0], H)
    ok = src >= 0
    assert torch.equal(x_pool[ok], x.detach()[src[ok].long() // K]) and not x_pool[~ok].any()


def test_keep_pooled_x_gives_the_same_gradients():
    x, idx, w, w13, w2, dy = make_problem(13, H, I, E, K, seed=26, masked_frac=0.1)
    res = []
    for keep in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
        y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="reference", num_experts=E,
                     block_m=8, keep_pooled_x=keep)
        res.append((y.detach(),) + torch.autograd.grad(y, leaves, dy))
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad_mode,w13_grad,accum,resolved,expect,precision", [
    (True, True, False, "fused", True, "bf16"), (False, True, False, "fused", False, "bf16"),
    (True, False, False, "fused", False, "bf16"), (True, False, True, "fused", True, "bf16"),
    (True, True, False, "grouped", False, "bf16"), (True, True, False, "reference", False, "bf16"),
    (True, True, False, "fused", True, "fp8_bwd"),  # the bf16 fused forward's rows, read by the FP8 backward's qT
    (True, True, False, "fused", False, "fp8")])  # the FP8 fused forward has no bf16 pool to keep
def test_keep_pooled_x_default_keeps_the_rows_only_for_a_fused_forward_whose_backward_reads_them(
        monkeypatch, grad_mode, w13_grad, accum, resolved, expect, precision):
    from prime_kernels.mega import _backend, _ops, api

    x, idx, w, w13, w2, _ = make_problem(9, H, I, E, K, seed=27)
    monkeypatch.setattr(_backend, "resolve_backend", lambda *a, **k: resolved)
    seen = []

    class Stop(Exception):
        pass

    def spy(*args):  # the keep_pooled_x the forward op would get; nothing runs
        seen.append(args[17])
        raise Stop

    monkeypatch.setattr(_ops, "mega_moe_fwd", spy)
    acc = (torch.zeros(w13.shape), None) if accum else None
    with torch.set_grad_enabled(grad_mode), pytest.raises(Stop):
        api.mega_moe(x, idx, w, w13.requires_grad_(w13_grad), w2, backend="reference", num_experts=E, block_m=8,
                     wgrad_accum=acc, precision=precision)
    assert seen == [expect]
    with pytest.raises(Stop):  # an explicit choice is passed through
        api.mega_moe(x, idx, w, w13, w2, backend="reference", num_experts=E, block_m=8, keep_pooled_x=not expect)
    assert seen[-1] is (not expect)


def test_opcheck_forward_with_accum_inputs():
    x, idx, w, w13, w2, _ = make_problem(7, H, I, E, K, seed=23)
    acc = (torch.randn(w13.shape), torch.randn(w2.shape))
    args = _fwd_args(x.requires_grad_(), idx, w.requires_grad_(), w13.requires_grad_(), w2.requires_grad_(),
                     accum=acc)
    torch.library.opcheck(torch.ops.prime_kernels.mega_moe_fwd.default, args)


def _layer(seed=24, **kw):
    torch.manual_seed(seed)
    layer = MegaMoE(E, H, I, K, backend="reference", block_m=8, **kw)
    return layer


def _grads(layer, x, idx, w, dy, fn=None):
    xs = x.detach().clone().requires_grad_()
    ws = w.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = (fn if fn is not None else layer)(xs, idx, ws)
    y.backward(dy)
    return y.detach(), xs.grad, ws.grad, layer.w13.grad.clone(), layer.w2.grad.clone()


def test_compile_fullgraph_aot_eager_forward_backward():
    torch._dynamo.reset()
    layer = _layer(activation_clamp=0.6)
    x, idx, w, _, _, dy = make_problem(13, H, I, E, K, seed=25, masked_frac=0.2)
    eager = _grads(layer, x, idx, w, dy)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = _grads(layer, x, idx, w, dy, fn=compiled)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


def test_non_reentrant_checkpoint():
    layer = _layer(seed=26)
    x, idx, w, _, _, dy = make_problem(17, H, I, E, K, seed=27)
    eager = _grads(layer, x, idx, w, dy)
    got = _grads(layer, x, idx, w, dy, fn=lambda a, b, c: checkpoint(layer, a, b, c, use_reentrant=False))
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


def test_wgrad_accum_buffers_get_grads_and_autograd_returns_none():
    x, idx, w, w13, w2, dy = make_problem(21, H, I, E, K, seed=28, masked_frac=0.1)
    y, dx, dtopk, dw13, dw2 = run_layer(x, idx, w, w13, w2, dy, backend="reference")
    g = torch.Generator().manual_seed(29)
    a13, a2 = torch.randn(w13.shape, generator=g), torch.randn(w2.shape, generator=g)
    a13_0, a2_0 = a13.clone(), a2.clone()
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    p13, p2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    y2 = mega_moe(xs, idx, ws, p13, p2, backend="reference", wgrad_accum=(a13, a2))
    y2.backward(dy)
    assert p13.grad is None and p2.grad is None
    assert torch.equal(y2, y) and torch.equal(xs.grad, dx) and torch.equal(ws.grad, dtopk)
    # bf16 grads are the fp32 sums rounded once; the accumulators hold them unrounded
    torch.testing.assert_close((a13 - a13_0).bfloat16(), dw13, rtol=0, atol=0)
    torch.testing.assert_close((a2 - a2_0).bfloat16(), dw2, rtol=0, atol=0)


def test_no_weight_grads_when_weights_frozen():
    x, idx, w, w13, w2, dy = make_problem(10, H, I, E, K, seed=30)
    xs = x.clone().requires_grad_()
    y = mega_moe(xs, idx, w, w13, w2, backend="reference")
    y.backward(dy)
    assert xs.grad is not None and xs.grad.abs().sum() > 0


def test_return_plan_fields():
    x, idx, w, w13, w2, _ = make_problem(10, H, I, E, K, seed=31, masked_frac=0.2)
    y, plan = mega_moe(x, idx, w, w13, w2, backend="reference", block_m=4, return_plan=True)
    assert int(plan.expert_counts.sum()) == int((idx >= 0).sum())
    assert plan.block_m == 4 and plan.top_k == K and plan.num_experts == E
    off = plan.expert_offsets.long()
    assert (off[1:] - off[:-1] >= plan.expert_counts.long()).all() and (off % 4 == 0).all()
    r2p = plan.route_to_pool.long()
    assert ((r2p >= 0) == (idx >= 0)).all()
    t = torch.arange(10).unsqueeze(1).expand(10, K)
    route = (t * K + torch.arange(K)).reshape(-1)[r2p.reshape(-1) >= 0]
    assert torch.equal(plan.pool_src_route.long()[r2p.reshape(-1)[r2p.reshape(-1) >= 0]], route)
    assert (plan.pool_src_rank[plan.pool_src_route >= 0] == 0).all()


def test_compile_with_wgrad_accum_and_dynamic_tokens():
    torch._dynamo.reset()
    layer = _layer(seed=32)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for T, seed in ((13, 33), (29, 34)):
        x, idx, w, _, _, dy = make_problem(T, H, I, E, K, seed=seed, masked_frac=0.1)
        outs = []
        for fn in (layer, compiled):
            a13, a2 = torch.zeros(layer.w13.shape), torch.zeros(layer.w2.shape)
            xs = x.clone().requires_grad_()
            y = fn(xs, idx, w, wgrad_accum=(a13, a2))
            y.backward(dy)
            assert layer.w13.grad is None and layer.w2.grad is None
            outs.append((y, xs.grad, a13, a2))
        for u, v in zip(*outs):
            assert torch.equal(u, v)
