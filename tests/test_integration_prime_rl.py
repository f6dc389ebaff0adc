"""prime-rl's Mega MoE call sites, replayed on the DeepGEMM-shaped low-level API.

The sequence (research/prime_and_ports.md 1.4, Gen A): one staging buffer allocated once for every
layer of a shape (``get_symm_buffer_for_mega_moe(group, E, max_tokens, top_k, H, I,
mma_type="bf16xbf16")``); per forward, x / topk_idx / topk_weights are copied into the buffer's
views, then ``bf16_mega_moe(y, l1, l2, buffer, activation_clamp=, l1_natural_layout=True)``; per
backward, the inputs are staged again (other layers overwrote the buffer meanwhile) and
``bf16_mega_moe_backward(dx, dw1, dw2, dtopk, dy, l1, l2, buffer, activation_clamp=,
dw_natural_layout=True, l1_natural_layout=True)`` writes dX, dW1, dW2 and d(topk_weights).
No ``backend=`` is passed, as in prime-rl: on this CPU machine "auto" needs the fallback variable."""

import pytest
import torch

from mega_helpers import loop_reference, make_problem, rel_err

import deep_gemm
from deep_gemm.mega import _backend
from deep_gemm.mega import buffer as buffer_mod
from deep_gemm.mega import interleave_l1, mega_moe

E, H, I, K, TMAX = 8, 64, 32, 3, 48


@pytest.fixture(autouse=True)
def allow_reference(monkeypatch):
    monkeypatch.setenv("DEEP_GEMM_ALLOW_REFERENCE_FALLBACK", "1")
    monkeypatch.setattr(_backend, "_warned", set())


class PrimeRLRoutedExperts(torch.autograd.Function):
    """Shaped like prime-rl's ``_MegaMoeRoutedExperts``: saves its inputs, stages them into the shared
    buffer before each kernel call, returns (dx, dtopk, None, dl1, dl2, None, None)."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, l1, l2, buffer, clamp):
        T = x.shape[0]
        buffer.x[:T].copy_(x)
        buffer.topk_idx[:T].copy_(topk_idx)
        buffer.topk_weights[:T].copy_(topk_weights)
        y = torch.empty((T, x.shape[1]), dtype=torch.bfloat16, device=x.device)
        deep_gemm.bf16_mega_moe(y, l1, l2, buffer, activation_clamp=clamp, l1_natural_layout=True)
        ctx.save_for_backward(x, topk_idx, topk_weights, l1, l2)
        ctx.buffer, ctx.clamp = buffer, clamp
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, l1, l2 = ctx.saved_tensors
        buffer, T = ctx.buffer, x.shape[0]
        buffer.x[:T].copy_(x)
        buffer.topk_idx[:T].copy_(topk_idx)
        buffer.topk_weights[:T].copy_(topk_weights)
        dw_dtype = l1.dtype if l1.dtype in (torch.bfloat16, torch.float32) else torch.float32
        dx = torch.empty_like(x)
        dw1 = torch.empty(l1.shape, dtype=dw_dtype, device=l1.device)
        dw2 = torch.empty(l2.shape, dtype=dw_dtype, device=l2.device)
        dtopk = torch.empty(topk_weights.shape, dtype=torch.float32, device=x.device)
        deep_gemm.bf16_mega_moe_backward(dx, dw1, dw2, dtopk, dy.contiguous(), l1, l2, buffer,
                                         activation_clamp=ctx.clamp, dw_natural_layout=True, l1_natural_layout=True)
        return dx, dtopk, None, dw1, dw2, None, None


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("clamp", [None, 0.75])
def test_two_layers_share_one_buffer_over_steps(clamp, monkeypatch):
    """Two layers, three steps of varying T <= max_tokens, one buffer for both (allocated once).
    Forward of both layers, then backward in reverse (each re-stages its inputs): every output
    equals mega_moe(backend="reference") exactly (same math) and is within 1e-2 of float64."""
    made = []
    real_init = buffer_mod.SymmBuffer.__init__

    def counting_init(self, *a, **k):
        made.append(1)
        real_init(self, *a, **k)

    monkeypatch.setattr(buffer_mod.SymmBuffer, "__init__", counting_init)
    monkeypatch.setattr(buffer_mod, "_cache", {})
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, mma_type="bf16xbf16", device="cpu")
    seed = 0
    for T in (TMAX, 17, 33):
        assert deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, mma_type="bf16xbf16", device="cpu") is buf
        layers = []
        for _ in range(2):
            seed += 1
            x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, seed=seed, masked_frac=0.1)
            layers.append((x, idx, w, w13, w2, dy))
        outs = []
        with pytest.warns(RuntimeWarning, match="falling back") if seed <= 2 else _nullwarn():
            for x, idx, w, w13, w2, dy in layers:  # forward of every layer first
                xs, ws, a, b = _leaf(x), _leaf(w), _leaf(w13), _leaf(w2)
                y = PrimeRLRoutedExperts.apply(xs, ws, idx, a, b, buf, clamp)
                outs.append((y, xs, ws, a, b))
            for (y, xs, ws, a, b), (*_, dy) in zip(reversed(outs), reversed(layers)):  # backward in reverse
                y.backward(dy)
        for (y, xs, ws, a, b), (x, idx, w, w13, w2, dy) in zip(outs, layers):
            rx, rw, ra, rb = _leaf(x), _leaf(w), _leaf(w13), _leaf(w2)
            ry = mega_moe(rx, idx, rw, ra, rb, activation_clamp=clamp, backend="reference", recompute=True)
            ry.backward(dy)
            exact = loop_reference(x, idx, w, w13, w2, dy, clamp=clamp)
            for got, ref, ex in ((y, ry, exact[0]), (xs.grad, rx.grad, exact[1]), (ws.grad, rw.grad, exact[2]),
                                 (a.grad, ra.grad, exact[3]), (b.grad, rb.grad, exact[4])):
                assert torch.equal(got.detach(), ref.detach())
                assert rel_err(got.detach(), ex) < 1e-2
    assert len(made) == 1


@pytest.mark.filterwarnings("ignore:deep_gemm.mega. falling back:RuntimeWarning")
def test_fp32_weight_grads_and_interleaved_layout():
    """dw in fp32 (fp32 parameters) and upstream's interleaved l1 / dw1 (l1_natural_layout=False,
    dw_natural_layout=False), as the earlier prime-rl variant calls it."""
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, device="cpu")
    x, idx, w, w13, w2, dy = make_problem(29, H, I, E, K, seed=40)
    T = x.shape[0]
    buf.x[:T].copy_(x)
    buf.topk_idx[:T].copy_(idx)
    buf.topk_weights[:T].copy_(w)
    y_nat = torch.empty(T, H, dtype=torch.bfloat16)
    y_il = torch.empty(T, H, dtype=torch.bfloat16)
    deep_gemm.bf16_mega_moe(y_nat, w13, w2, buf)
    deep_gemm.bf16_mega_moe(y_il, interleave_l1(w13), w2, buf, l1_natural_layout=False)
    assert torch.equal(y_nat, y_il)
    outs = {}
    for natural in (True, False):
        l1 = w13 if natural else interleave_l1(w13)
        dx = torch.empty_like(x)
        dw1 = torch.empty(w13.shape, dtype=torch.float32)
        dw2 = torch.empty(w2.shape, dtype=torch.float32)
        dtopk = torch.empty(T, K, dtype=torch.float32)
        deep_gemm.bf16_mega_moe_backward(dx, dw1, dw2, dtopk, dy, l1, w2, buf, l1_natural_layout=natural,
                                         dw_natural_layout=natural)
        outs[natural] = (dx, dw1 if natural else _deinterleave(dw1), dw2, dtopk)
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)
    exact = loop_reference(x, idx, w, w13, w2, dy)
    assert rel_err(outs[True][0], exact[1]) < 1e-2
    assert rel_err(outs[True][3], exact[2]) < 1e-2
    assert rel_err(outs[True][1], exact[3]) < 1e-2
    assert rel_err(outs[True][2], exact[4]) < 1e-2
    # fp32 weight gradients are the unrounded sums: closer to float64 than bf16 ones
    dw1_bf = torch.empty(w13.shape, dtype=torch.bfloat16)
    deep_gemm.bf16_mega_moe_backward(torch.empty_like(x), dw1_bf, None, torch.empty(T, K), dy, w13, w2, buf)
    assert rel_err(outs[True][1], exact[3]) < rel_err(dw1_bf, exact[3])


@pytest.mark.filterwarnings("ignore:deep_gemm.mega. falling back:RuntimeWarning")
def test_too_many_tokens_for_the_buffer_raise():
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, device="cpu")
    x, idx, w, w13, w2, _ = make_problem(TMAX + 1, H, I, E, K, seed=41)
    with pytest.raises(ValueError, match="exceed the buffer"):
        deep_gemm.bf16_mega_moe(torch.empty(TMAX + 1, H, dtype=torch.bfloat16), w13, w2, buf)


def _deinterleave(t):
    from deep_gemm.mega import deinterleave_l1

    return deinterleave_l1(t)


class _nullwarn:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
