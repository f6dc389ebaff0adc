"""Deferred weight gradients (prime_kernels.mega.DeferredWgrad as ``wgrad_accum``): the backward returns dX and
d topk_weights, queues dW13 / dW2, and ``flush()`` adds them into the fp32 accumulators, bitwise as the immediate path
(``wgrad_accum=(dw13, dw2)`` on every backward) adds them. Four micro-batches per test, fresh random inputs each.

CPU tests run the reference backend (the flush runs its backward again with the data gradients discarded); GPU tests
(an sm_90 device) the kernel backends, whose queued work is the k-grouped GEMMs on the kept operands, on the current
stream and on a side stream."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_sm90
from mega_helpers import make_problem
from prime_kernels.mega import DeferredWgrad, MegaMoE, mega_moe

T, H, I, E, K = 37, 128, 128, 8, 2


def _micro_batches(n=4, device="cpu", seed=0, **kw):
    return [[t.to(device) for t in make_problem(T + 3 * i, H, I, E, K, seed=seed + i, **kw)] for i in range(n)]


def _run(batches, w13, w2, wgrad_accum, **kw):
    """Forward + backward of every micro-batch on the same weights; (dx, dtopk) per micro-batch."""
    out = []
    for x, idx, w, _w13, _w2, dy in batches:
        xs = x.detach().clone().requires_grad_()
        ws = w.detach().clone().requires_grad_()
        y = mega_moe(xs, idx, ws, w13, w2, num_experts=E, wgrad_accum=wgrad_accum, **kw)
        y.backward(dy)
        out.append((xs.grad, ws.grad))
    return out


def _check_equal(batches, device, stream=None, **kw):
    w13 = batches[0][3].detach().clone().requires_grad_()
    w2 = batches[0][4].detach().clone().requires_grad_()
    now = (torch.zeros(w13.shape, device=device), torch.zeros(w2.shape, device=device))
    got_now = _run(batches, w13, w2, now, **kw)
    later = DeferredWgrad(torch.zeros(w13.shape, device=device), torch.zeros(w2.shape, device=device), stream=stream)
    got_later = _run(batches, w13, w2, later, **kw)
    assert later.pending == len(batches)
    assert not bool(later.dw13.any()) and not bool(later.dw2.any()), "an accumulator was written before the flush"
    later.flush()
    later.wait()
    assert later.pending == 0
    assert w13.grad is None and w2.grad is None
    for i, ((a, b), (c, d)) in enumerate(zip(got_now, got_later)):
        assert torch.equal(a, c) and torch.equal(b, d), f"micro-batch {i}: dx / d topk_weights differ"
    assert bool(now[0].any()) and bool(now[1].any())
    assert torch.equal(later.dw13, now[0]) and torch.equal(later.dw2, now[1]), "flushed gradients differ"


@pytest.mark.parametrize("recompute", [False, True])
def test_reference_deferred_equals_immediate(recompute):
    _check_equal(_micro_batches(), "cpu", backend="reference", recompute=recompute)


def test_reference_deferred_with_masked_routes_and_a_clamp():
    _check_equal(_micro_batches(masked_frac=0.25, routing="skewed"), "cpu", backend="reference",
                 activation_clamp=2.0)


def test_module_path_and_a_second_round():
    """MegaMoE.forward(..., wgrad_accum=DeferredWgrad): two rounds of two micro-batches, flushed after each, equal
    the immediate pair over all four."""
    torch.manual_seed(0)
    layer = MegaMoE(E, H, I, K, backend="reference")
    batches = _micro_batches()
    now = (torch.zeros_like(layer.w13, dtype=torch.float32), torch.zeros_like(layer.w2, dtype=torch.float32))
    later = DeferredWgrad(torch.zeros_like(now[0]), torch.zeros_like(now[1]))
    for j, (x, idx, w, _a, _b, dy) in enumerate(batches):
        layer(x, idx, w, wgrad_accum=now).backward(dy)
        layer(x, idx, w, wgrad_accum=later).backward(dy)
        if j % 2 == 1:
            later.flush()
    assert torch.equal(later.dw13, now[0]) and torch.equal(later.dw2, now[1])


def test_flush_with_nothing_queued_and_the_pending_bound():
    d = DeferredWgrad(torch.zeros(E, 2 * I, H), torch.zeros(E, H, I), max_pending=2)
    d.flush()
    d.wait()
    assert d.pending == 0
    batches = _micro_batches(3)
    w13 = batches[0][3].detach().clone().requires_grad_()
    w2 = batches[0][4].detach().clone().requires_grad_()
    _run(batches[:2], w13, w2, d, backend="reference")
    assert d.pending == 2
    with pytest.raises(ValueError, match="max_pending"):
        _run(batches[2:], w13, w2, d, backend="reference")


@pytest.mark.parametrize("kw,exc,fragment", [
    (dict(dw13=None), TypeError, "dw13 must be a torch.Tensor"),
    (dict(max_pending=0), ValueError, "max_pending"),
    (dict(max_pending=True), ValueError, "max_pending"),
])
def test_constructor_checks(kw, exc, fragment):
    args = dict(dw13=torch.zeros(E, 2 * I, H), dw2=torch.zeros(E, H, I))
    args.update(kw)
    with pytest.raises(exc, match=fragment):
        DeferredWgrad(args.pop("dw13"), args.pop("dw2"), **args)


def test_wrong_accumulator_shapes_are_refused_at_the_forward():
    x, idx, w, w13, w2, _dy = make_problem(T, H, I, E, K, seed=3)
    d = DeferredWgrad(torch.zeros(E, H, H), torch.zeros(E, H, I))
    with pytest.raises(ValueError, match="dw13_accum"):
        mega_moe(x, idx, w, w13.requires_grad_(), w2, num_experts=E, backend="reference", wgrad_accum=d)
    assert d.pending == 0


@requires_sm90
@pytest.mark.parametrize("backend", ["grouped", "auto"])
@pytest.mark.parametrize("side_stream", [False, True])
def test_kernel_backends_deferred_equals_immediate(backend, side_stream):
    """On the kernel backends (auto: the fused forward and, where status() has it, the fused backward): the queued
    k-grouped GEMMs on the kept operands, on the current stream or a side stream, equal the immediate additions."""
    batches = _micro_batches(device="cuda", seed=20, masked_frac=0.1, routing="skewed")
    _check_equal(batches, "cuda", stream=torch.cuda.Stream() if side_stream else None, backend=backend)
