"""prime-rl's Mega MoE call sites, replayed on the DeepGEMM-shaped low-level API through the ``deep_gemm``
drop-in, as prime-rl imports it.

The sequence (../shared/research/prime_and_ports.md 1.4, Gen A; that file is outside this
repository): one staging buffer allocated once for every layer of a shape
(``get_symm_buffer_for_mega_moe(group, E, max_tokens, top_k, H, I, mma_type="bf16xbf16")``); per
forward, x / topk_idx / topk_weights are copied into the buffer's views, then ``bf16_mega_moe(y,
l1, l2, buffer, activation_clamp=, l1_natural_layout=True)``; per backward, the inputs are staged
again (other layers overwrote the buffer meanwhile) and ``bf16_mega_moe_backward(dx, dw1, dw2,
dtopk, dy, l1, l2, buffer, activation_clamp=, dw_natural_layout=True, l1_natural_layout=True)``
writes dX, dW1, dW2 and d(topk_weights). No ``backend=`` is passed, as in prime-rl: on the CPU
"auto" needs the fallback variable; on the GPU it runs our kernels and must not fall back. Every
output buffer the caller passes starts as NaN, so an element a kernel fails to write shows."""

from contextlib import nullcontext

import pytest
import torch

from mega_helpers import auto_kernel_skip_reason, loop_reference, make_problem, rel_err, run_layer

# prime-rl imports the drop-in; the calls below are the same objects as prime_kernels' (tests/test_dropin.py).
import deep_gemm
from prime_kernels.mega import _backend
from prime_kernels.mega import buffer as buffer_mod
from prime_kernels.mega import interleave_l1

E, H, I, K, TMAX = 8, 64, 32, 3, 48


def _nan(shape, dtype, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


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
        y = _nan((T, x.shape[1]), torch.bfloat16, x.device)
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
        dx = _nan(x.shape, x.dtype, x.device)
        dw1 = _nan(l1.shape, dw_dtype, l1.device)
        dw2 = _nan(l2.shape, dw_dtype, l2.device)
        dtopk = _nan(topk_weights.shape, torch.float32, x.device)
        deep_gemm.bf16_mega_moe_backward(dx, dw1, dw2, dtopk, dy.contiguous(), l1, l2, buffer,
                                         activation_clamp=ctx.clamp, dw_natural_layout=True, l1_natural_layout=True)
        return dx, dtopk, None, dw1, dw2, None, None


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _one_step(buf, layers, clamp):
    """prime-rl's order within a step: the forward of every layer, then the backwards in reverse
    (each re-stages its inputs). Returns (y, dx, dtopk, dw1, dw2) per layer."""
    outs = []
    for x, idx, w, w13, w2, _ in layers:
        xs, ws, a, b = _leaf(x), _leaf(w), _leaf(w13), _leaf(w2)
        outs.append((PrimeRLRoutedExperts.apply(xs, ws, idx, a, b, buf, clamp), xs, ws, a, b))
    for (y, *_), (*_, dy) in zip(reversed(outs), reversed(layers)):
        y.backward(dy)
    return [(y.detach(), xs.grad, ws.grad, a.grad, b.grad) for y, xs, ws, a, b in outs]


def _check_call_sequence(monkeypatch, device, H, I, clamp, ref_tol):
    """Two layers, three steps of varying T <= max_tokens, one buffer for both (allocated once).
    Each step runs twice, bit-identical; every output is within ``ref_tol`` of
    mega_moe(backend="reference") (0: equal bit for bit) and within 1e-2 of float64."""
    made = []
    real_init = buffer_mod.SymmBuffer.__init__

    def counting_init(self, *a, **k):
        made.append(1)
        real_init(self, *a, **k)

    monkeypatch.setattr(buffer_mod.SymmBuffer, "__init__", counting_init)
    monkeypatch.setattr(buffer_mod, "_cache", {})
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, mma_type="bf16xbf16", device=device)
    seed = 0
    for T in (TMAX, 17, 33):
        assert deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, mma_type="bf16xbf16",
                                                      device=device) is buf
        layers = [make_problem(T, H, I, E, K, seed=seed + n, masked_frac=0.1, device=device) for n in (1, 2)]
        seed += 2
        # the CPU's "auto" falls back to the reference, saying so once
        with pytest.warns(RuntimeWarning, match="falling back") if device == "cpu" and T == TMAX else nullcontext():
            got = _one_step(buf, layers, clamp)
        again = _one_step(buf, layers, clamp)
        for outs, outs_again in zip(got, again):
            for a, b in zip(outs, outs_again):
                assert torch.equal(a, b)
        for outs, layer in zip(got, layers):
            ref = run_layer(*layer, activation_clamp=clamp, backend="reference", recompute=True)
            exact = loop_reference(*[t.cpu() for t in layer], clamp=clamp)
            for name, o, r, ex in zip(("y", "dx", "dtopk", "dw1", "dw2"), outs, ref, exact):
                assert o.device == r.device and o.dtype == r.dtype, (T, name)
                if ref_tol == 0:
                    assert torch.equal(o, r), (T, name)
                else:
                    assert rel_err(o, r) <= ref_tol, (T, name)
                assert rel_err(o.cpu(), ex) < 1e-2, (T, name)
    assert len(made) == 1


@pytest.mark.parametrize("clamp", [None, 0.75])
def test_two_layers_share_one_buffer_over_steps(clamp, monkeypatch):
    """On the CPU "auto" is the reference: equal to it bit for bit (same math)."""
    _check_call_sequence(monkeypatch, "cpu", H, I, clamp, ref_tol=0)


@pytest.mark.skipif(auto_kernel_skip_reason() is not None, reason=str(auto_kernel_skip_reason()))
def test_gpu_call_sequence_close_to_reference(monkeypatch):
    """The same sequence on the GPU at sizes the fused sm90 kernels take (multiples of 128), no
    clamp, as prime-rl calls it: "auto" runs our kernels (never the reference, hence no fallback)."""
    monkeypatch.delenv("DEEP_GEMM_ALLOW_REFERENCE_FALLBACK", raising=False)
    _check_call_sequence(monkeypatch, "cuda", 256, 128, None, ref_tol=1e-2)


@pytest.mark.filterwarnings("ignore:prime_kernels.mega. falling back:RuntimeWarning")
def test_fp32_weight_grads_and_interleaved_layout():
    """dw in fp32 (fp32 parameters) and upstream's interleaved l1 / dw1 (l1_natural_layout=False,
    dw_natural_layout=False), as the earlier prime-rl variant calls it."""
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, device="cpu")
    x, idx, w, w13, w2, dy = make_problem(29, H, I, E, K, seed=40)
    T = x.shape[0]
    buf.x[:T].copy_(x)
    buf.topk_idx[:T].copy_(idx)
    buf.topk_weights[:T].copy_(w)
    y_nat = _nan((T, H), torch.bfloat16)
    y_il = _nan((T, H), torch.bfloat16)
    deep_gemm.bf16_mega_moe(y_nat, w13, w2, buf)
    deep_gemm.bf16_mega_moe(y_il, interleave_l1(w13), w2, buf, l1_natural_layout=False)
    assert torch.equal(y_nat, y_il)
    outs = {}
    for natural in (True, False):
        l1 = w13 if natural else interleave_l1(w13)
        dx = _nan(x.shape, x.dtype)
        dw1 = _nan(w13.shape, torch.float32)
        dw2 = _nan(w2.shape, torch.float32)
        dtopk = _nan((T, K), torch.float32)
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
    dw1_bf = _nan(w13.shape, torch.bfloat16)
    deep_gemm.bf16_mega_moe_backward(_nan(x.shape, x.dtype), dw1_bf, None, _nan((T, K), torch.float32), dy, w13, w2,
                                     buf)
    assert rel_err(outs[True][1], exact[3]) < rel_err(dw1_bf, exact[3])


@pytest.mark.filterwarnings("ignore:prime_kernels.mega. falling back:RuntimeWarning")
def test_too_many_tokens_for_the_buffer_raise():
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, device="cpu")
    x, idx, w, w13, w2, _ = make_problem(TMAX + 1, H, I, E, K, seed=41)
    with pytest.raises(ValueError, match="exceed the buffer"):
        deep_gemm.bf16_mega_moe(_nan((TMAX + 1, H), torch.bfloat16), w13, w2, buf)


def _deinterleave(t):
    from prime_kernels.mega import deinterleave_l1

    return deinterleave_l1(t)



class PrimeRLFusedSharedExpert(torch.autograd.Function):
    """Shaped like prime-rl's later BF16 dispatcher with ``fuses_shared_expert=True``: the shared expert's
    ``shared_l1 = cat(gate_proj.weight, up_proj.weight)`` [2Is, H] and ``shared_l2 = down_proj.weight`` [H, Is] go
    into bf16_mega_moe, and bf16_mega_moe_backward returns their gradients beside the routed ones."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, l1, l2, shared_l1, shared_l2, buffer, clamp):
        T = x.shape[0]
        buffer.x[:T].copy_(x)
        buffer.topk_idx[:T].copy_(topk_idx)
        buffer.topk_weights[:T].copy_(topk_weights)
        y = _nan((T, x.shape[1]), torch.bfloat16, x.device)
        deep_gemm.bf16_mega_moe(y, l1, l2, buffer, shared_l1_weights=shared_l1, shared_l2_weights=shared_l2,
                                activation_clamp=clamp)
        ctx.save_for_backward(x, topk_idx, topk_weights, l1, l2, shared_l1, shared_l2)
        ctx.buffer, ctx.clamp = buffer, clamp
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, l1, l2, sl1, sl2 = ctx.saved_tensors
        buffer, T = ctx.buffer, x.shape[0]
        buffer.x[:T].copy_(x)
        buffer.topk_idx[:T].copy_(topk_idx)
        buffer.topk_weights[:T].copy_(topk_weights)
        dx, dtopk = _nan(x.shape, x.dtype, x.device), _nan(topk_weights.shape, torch.float32, x.device)
        dw1, dw2 = _nan(l1.shape, l1.dtype, x.device), _nan(l2.shape, l2.dtype, x.device)
        dsw1, dsw2 = _nan(sl1.shape, sl1.dtype, x.device), _nan(sl2.shape, sl2.dtype, x.device)
        deep_gemm.bf16_mega_moe_backward(dx, dw1, dw2, dtopk, dy.contiguous(), l1, l2, buffer, shared_l1_weights=sl1,
                                         shared_l2_weights=sl2, shared_dw1_weights=dsw1, shared_dw2_weights=dsw2,
                                         activation_clamp=ctx.clamp)
        return dx, dtopk, None, dw1, dw2, dsw1, dsw2, None, None


def _fused_shared_step(device, H, I, Is, clamp, seed):
    """One layer with a fused shared expert through the call sequence, against mega_moe with the same shared expert
    (backend "reference": bitwise on the CPU) and float64: (outputs, reference outputs, float64 outputs)."""
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, E, TMAX, K, H, I, device=device, num_shared_experts=1)
    x, idx, w, w13, w2, dy = make_problem(TMAX - 5, H, I, E, K, seed=seed, masked_frac=0.1, device=device)
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * Is, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(device)
    down = (torch.randn(H, Is, generator=g) / Is ** 0.5).to(torch.bfloat16).to(device)
    leaves = [_leaf(t) for t in (x, w, w13, w2, gate_up, down)]
    y = PrimeRLFusedSharedExpert.apply(leaves[0], leaves[1], idx, leaves[2], leaves[3], leaves[4], leaves[5], buf,
                                       clamp)
    y.backward(dy)
    got = [y.detach()] + [t.grad for t in leaves]
    ref_leaves = [_leaf(t) for t in (x, w, w13, w2, gate_up, down)]
    y_ref = deep_gemm.mega.mega_moe(ref_leaves[0], idx, ref_leaves[1], ref_leaves[2], ref_leaves[3], num_experts=E,
                                    backend="reference", activation_clamp=clamp, shared_w13=ref_leaves[4],
                                    shared_w2=ref_leaves[5])
    y_ref.backward(dy)
    ref = [y_ref.detach()] + [t.grad for t in ref_leaves]
    ex = loop_reference(*[t.cpu() for t in (x, idx, w, w13, w2, dy)], clamp=clamp)
    xs, a, b = (t.detach().cpu().double().requires_grad_() for t in (x, gate_up, down))
    hs = xs @ a.t()
    gte, up = hs[:, :Is], hs[:, Is:]
    if clamp is not None:
        gte, up = gte.clamp(max=clamp), up.clamp(-clamp, clamp)
    ys = (torch.nn.functional.silu(gte) * up) @ b.t()
    (ys * dy.cpu().double()).sum().backward()
    exact = [ex[0] + ys.detach(), ex[1] + xs.grad, ex[2], ex[3], ex[4], a.grad, b.grad]
    return got, ref, exact


@pytest.mark.filterwarnings("ignore:prime_kernels.mega. falling back:RuntimeWarning")
@pytest.mark.parametrize("clamp", [None, 0.75])
def test_fused_shared_expert_call_sequence(clamp):
    """On the CPU ("auto" falls back to the reference): bit for bit mega_moe with the shared expert, and every output
    (y, dx, dtopk, dw1, dw2, and the shared expert's two gradients) within 1e-2 of float64."""
    got, ref, exact = _fused_shared_step("cpu", H, I, 48, clamp, seed=90)
    names = ("y", "dx", "dtopk", "dw1", "dw2", "d shared_l1", "d shared_l2")
    for name, o, r, ex in zip(names, got, ref, exact):
        assert torch.equal(o, r), name
        assert rel_err(o.double(), ex) < 1e-2, name


@pytest.mark.skipif(auto_kernel_skip_reason() is not None, reason=str(auto_kernel_skip_reason()))
def test_gpu_fused_shared_expert_call_sequence(monkeypatch):
    """The same on the GPU (our kernels for both passes, no fallback), within 1e-2 of the reference and float64."""
    monkeypatch.delenv("DEEP_GEMM_ALLOW_REFERENCE_FALLBACK", raising=False)
    got, ref, exact = _fused_shared_step("cuda", 256, 128, 256, None, seed=91)
    names = ("y", "dx", "dtopk", "dw1", "dw2", "d shared_l1", "d shared_l2")
    for name, o, r, ex in zip(names, got, ref, exact):
        assert rel_err(o, r) <= 1e-2, name
        assert rel_err(o.cpu().double(), ex) < 1e-2, name
