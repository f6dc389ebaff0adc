"""Shared experts (prime_kernels.mega.shared) through mega_moe, MegaMoE and the DeepGEMM-shaped calls: y and every
gradient (x, topk_weights, the routed and shared weights, the shared gate) against an independent float64 evaluation
(routed: the per-token loop of mega_helpers; shared: a dense SwiGLU MLP per shared expert), on the reference backend
(CPU) and, where they run, the kernel backends (GPU). Bad shared arguments raise before anything runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mega_helpers import auto_kernel_skip_reason, loop_reference, make_problem, rel_err
from prime_kernels.mega import MegaMoE, mega_moe

H, I, IS, E, K = 64, 32, 48, 8, 2


def _shared_problem(T, S, gate, seed, device="cpu", two_d=False):
    g = torch.Generator().manual_seed(seed)
    sw13 = (torch.randn(S, 2 * IS, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    sw2 = (torch.randn(S, H, IS, generator=g) / IS ** 0.5).to(torch.bfloat16)
    if two_d:
        sw13, sw2 = sw13[0], sw2[0]
    gt = None
    if gate == "per_token":
        gt = torch.rand(T, generator=g)
    elif gate == "per_expert":
        gt = torch.rand(T, S, generator=g)
    return [None if t is None else t.to(device) for t in (sw13, sw2, gt)]


def _shared64(x, sw13, sw2, gate, dy, clamp=None):
    """float64 shared part: y_s[t] = sum_s gate[t, s] * W2s (silu(min(g, c)) * clamp(u, -c, c)), and its gradients
    for x, shared_w13, shared_w2 and the gate."""
    x = x.detach().double().requires_grad_()
    a = sw13.detach().double().requires_grad_()
    b = sw2.detach().double().requires_grad_()
    g = None if gate is None else gate.detach().double().requires_grad_()
    a3, b3 = (a, b) if a.dim() == 3 else (a.unsqueeze(0), b.unsqueeze(0))
    inter = a3.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    for s in range(a3.shape[0]):
        h = x @ a3[s].t()
        gte, up = h[:, :inter], h[:, inter:]
        if clamp is not None:
            gte, up = gte.clamp(max=clamp), up.clamp(-clamp, clamp)
        o = (F.silu(gte) * up) @ b3[s].t()
        w = 1.0 if g is None else (g if g.dim() == 1 else g[:, s]).unsqueeze(1)
        y = y + w * o
    (y * dy.double()).sum().backward()
    return y.detach(), x.grad, a.grad, b.grad, None if g is None else g.grad


def _run(prob, shared_args, **kw):
    """mega_moe forward + backward on leaf copies: (y, dx, dtopk, dw13, dw2, dsw13, dsw2, dgate)."""
    x, idx, w, w13, w2, dy = prob
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    sh = [None if t is None else t.detach().clone().requires_grad_() for t in shared_args]
    y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], shared_w13=sh[0], shared_w2=sh[1],
                 shared_gate=sh[2], **kw)
    y.backward(dy)
    return (y.detach(),) + tuple(t.grad for t in leaves) + tuple(None if t is None else t.grad for t in sh)


def _check_against_float64(prob, shared_args, got, clamp=None, bound=1e-2):
    x, idx, w, w13, w2, dy = prob
    ref = loop_reference(x, idx, w, w13, w2, dy, clamp=clamp)
    sref = _shared64(x, shared_args[0], shared_args[1], shared_args[2], dy, clamp=clamp)
    want = (ref[0] + sref[0], ref[1] + sref[1], ref[2], ref[3], ref[4], sref[2], sref[3], sref[4])
    names = ("y", "dx", "dtopk", "dw13", "dw2", "d shared_w13", "d shared_w2", "d shared_gate")
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a is not None and torch.isfinite(a.float()).all(), name
        err = rel_err(a.detach().cpu().double(), b.double())
        assert err < bound, f"{name}: rel err {err:.3e}"


@pytest.mark.parametrize("S,gate,two_d", [(1, None, True), (1, "per_token", False), (2, None, False),
                                          (2, "per_expert", False)])
@pytest.mark.parametrize("clamp", [None, 0.75])
def test_shared_experts_on_the_reference_against_float64(S, gate, two_d, clamp):
    T = 37
    prob = make_problem(T, H, I, E, K, routing="skewed", seed=S * 7 + 1, masked_frac=0.1)
    shared_args = _shared_problem(T, S, gate, seed=S + 3, two_d=two_d)
    got = _run(prob, shared_args, backend="reference", num_experts=E, activation_clamp=clamp)
    _check_against_float64(prob, shared_args, got, clamp=clamp)


def test_shared_experts_in_exact_mode_are_the_unrounded_formula():
    """float64 inputs (the reference's exact mode): the routed and shared parts summed without rounding."""
    T = 9
    prob = [t.double() if t.is_floating_point() else t for t in make_problem(T, H, I, E, K, seed=5)]
    sw13, sw2, gate = _shared_problem(T, 2, "per_expert", seed=6)
    shared_args = (sw13.double(), sw2.double(), gate.double())
    got = _run(prob, shared_args, backend="reference", num_experts=E)
    _check_against_float64(prob, shared_args, got, bound=1e-12)


def test_no_tokens_and_the_plan():
    """T = 0 gives an empty y and zero shared gradients; return_plan returns the routed experts' plan."""
    x, idx, w, w13, w2, dy = make_problem(4, H, I, E, K, seed=2)
    prob = (x[:0], idx[:0], w[:0], w13, w2, dy[:0])
    got = _run(prob, _shared_problem(0, 2, None, seed=2), backend="reference", num_experts=E)
    assert got[0].shape == (0, H) and got[5] is not None and torch.count_nonzero(got[5]) == 0
    x, idx, w, w13, w2, _ = make_problem(5, H, I, E, K, seed=3)
    sw13, sw2, _ = _shared_problem(5, 1, None, seed=3)
    y, plan = mega_moe(x, idx, w, w13, w2, backend="reference", num_experts=E, return_plan=True, shared_w13=sw13,
                       shared_w2=sw2)
    assert y.shape == (5, H) and plan.num_experts == E and plan.top_k == K


def test_module_with_shared_experts():
    torch.manual_seed(0)
    layer = MegaMoE(E, H, I, K, backend="reference", num_shared_experts=2, shared_intermediate=IS, dtype=torch.bfloat16)
    assert list(layer.shared_w13.shape) == [2, 2 * IS, H] and list(layer.shared_w2.shape) == [2, H, IS]
    x, idx, w, _, _, dy = make_problem(11, H, I, E, K, seed=8)
    gate = torch.rand(11, 2)
    y = layer(x, idx, w, shared_gate=gate)
    y.backward(dy)
    assert layer.shared_w13.grad is not None and layer.shared_w2.grad is not None and layer.w13.grad is not None
    want = mega_moe(x, idx, w, layer.w13, layer.w2, backend="reference", num_experts=E, shared_w13=layer.shared_w13,
                    shared_w2=layer.shared_w2, shared_gate=gate)
    assert torch.equal(y, want)
    plain = MegaMoE(E, H, I, K, backend="reference")
    assert plain.shared_w13 is None and "num_shared_experts=0" in repr(plain)
    with pytest.raises(ValueError, match="shared_gate needs shared experts"):
        plain(x, idx, w, shared_gate=gate)


BAD = [  # (shared_w13, shared_w2, shared_gate) makers, exception, fragment
    (lambda: (torch.zeros(2 * IS, H, dtype=torch.bfloat16), None, None), ValueError, "go together"),
    (lambda: (torch.zeros(1, 2 * IS, H, dtype=torch.bfloat16), torch.zeros(H, IS, dtype=torch.bfloat16), None),
     ValueError, "must both be 3-D"),
    (lambda: (torch.zeros(1, 2 * IS, H + 8, dtype=torch.bfloat16), torch.zeros(1, H + 8, IS, dtype=torch.bfloat16),
              None), ValueError, "w13 must be"),
    (lambda: (torch.zeros(2, 2 * IS, H, dtype=torch.bfloat16), torch.zeros(2, H, IS + 2, dtype=torch.bfloat16),
              None), ValueError, "w2 must be"),
    (lambda: (torch.zeros(1, 2 * IS, H), torch.zeros(1, H, IS), None), TypeError, "x's dtype"),
    (lambda: (torch.zeros(2, 2 * IS, H, dtype=torch.bfloat16), torch.zeros(2, H, IS, dtype=torch.bfloat16),
              torch.ones(7, 3)), ValueError, "shared_gate must be"),
    (lambda: (torch.zeros(2, 2 * IS, H, dtype=torch.bfloat16), torch.zeros(2, H, IS, dtype=torch.bfloat16),
              torch.ones(7, dtype=torch.bfloat16)), TypeError, "shared_gate must be torch.float32"),
    (lambda: (torch.zeros(2, 2 * IS, H, dtype=torch.bfloat16), [1.0], None), TypeError, "shared_w2 must be a"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_shared_arguments_raise_before_anything_runs(case, monkeypatch):
    """Each bad shared argument raises with its message before the routed experts run (the routed op is made to
    fail if it is reached)."""
    from prime_kernels.mega import _ops

    make, exc, fragment = BAD[case]
    x, idx, w, w13, w2, _ = make_problem(7, H, I, E, K, seed=1)

    def reached(*a, **k):
        raise AssertionError("the routed experts ran before the shared arguments were checked")

    monkeypatch.setattr(_ops, "mega_moe_fwd", reached)
    sw13, sw2, gate = make()
    with pytest.raises(exc, match=fragment):
        mega_moe(x, idx, w, w13, w2, backend="reference", num_experts=E, shared_w13=sw13, shared_w2=sw2,
                 shared_gate=gate)


def _stage(buf, x, idx, w):
    buf.x[: x.shape[0]].copy_(x)
    buf.topk_idx[: x.shape[0]].copy_(idx)
    buf.topk_weights[: x.shape[0]].copy_(w)


@pytest.mark.parametrize("S,two_d", [(1, True), (2, False)])
def test_deepgemm_calls_with_shared_experts_equal_the_layer_api(S, two_d):
    """bf16_mega_moe / bf16_mega_moe_backward with shared_l1/l2 (and their gradients) give mega_moe's bits with the
    same shared experts: y, dx, dtopk, the routed and the shared weight gradients (bf16 outputs); fp32 shared outputs
    get the unrounded sums and accumulate; the interleaved layout gives the same values; T = 0 zeroes them."""
    from prime_kernels.mega import bf16_mega_moe, bf16_mega_moe_backward, get_symm_buffer_for_mega_moe, interleave_l1

    T, c = 13, 0.7
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, routing="skewed", seed=71, masked_frac=0.1)
    sw13, sw2, _ = _shared_problem(T, S, None, seed=72 + S, two_d=two_d)
    ref = _run((x, idx, w, w13, w2, dy), (sw13, sw2, None), backend="reference", num_experts=E, activation_clamp=c)
    buf = get_symm_buffer_for_mega_moe(None, E, 40, K, H, I, device="cpu", num_shared_experts=S)
    assert buf.num_shared_experts == S
    _stage(buf, x, idx, w)
    y = torch.full((T, H), 7.0, dtype=torch.bfloat16)
    state = bf16_mega_moe(y, w13, w2, buf, activation_clamp=c, backend="reference", shared_l1_weights=sw13,
                          shared_l2_weights=sw2)
    assert torch.equal(y, ref[0])
    outs = [torch.full_like(t, 3.0) for t in (x, w, w13, w2, sw13, sw2)]
    dx, dt, d13, d2, s13, s2 = outs
    bf16_mega_moe_backward(dx, d13, d2, dt, dy, w13, w2, buf, activation_clamp=c, state=state, backend="reference",
                           shared_l1_weights=sw13, shared_l2_weights=sw2, shared_dw1_weights=s13,
                           shared_dw2_weights=s2)
    for name, a, b in zip(("dx", "dtopk", "dw13", "dw2", "d shared_l1", "d shared_l2"), (dx, dt, d13, d2, s13, s2),
                          (ref[1], ref[2], ref[3], ref[4], ref[5], ref[6])):
        assert torch.equal(a, b), name
    # fp32 shared gradients: the unrounded sums (rounded, the bf16 ones), added with accumulate=True
    f13, f2 = torch.zeros(sw13.shape), torch.zeros(sw2.shape)
    bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf,
                           activation_clamp=c, backend="reference", shared_l1_weights=sw13, shared_l2_weights=sw2,
                           shared_dw1_weights=f13, shared_dw2_weights=f2)
    assert torch.equal(f13.bfloat16(), s13) and torch.equal(f2.bfloat16(), s2)
    a13 = torch.randn(sw13.shape)
    a13_0 = a13.clone()
    bf16_mega_moe_backward(torch.zeros_like(x), None, None, torch.zeros_like(w), dy, w13, w2, buf,
                           activation_clamp=c, backend="reference", shared_l1_weights=sw13, shared_l2_weights=sw2,
                           shared_dw1_weights=a13, accumulate=True)
    assert torch.equal(a13, a13_0 + f13)
    # upstream's interleaved l1 layout, for the shared l1 too
    il13 = interleave_l1(sw13 if sw13.dim() == 3 else sw13.unsqueeze(0)).reshape(sw13.shape)
    y_il = torch.empty(T, H, dtype=torch.bfloat16)
    bf16_mega_moe(y_il, interleave_l1(w13), w2, buf, activation_clamp=c, backend="reference",
                  l1_natural_layout=False, shared_l1_weights=il13, shared_l2_weights=sw2)
    assert torch.equal(y_il, y)
    s13_il = torch.empty_like(sw13)
    bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, interleave_l1(w13), w2, buf,
                           activation_clamp=c, backend="reference", l1_natural_layout=False,
                           dw_natural_layout=False, shared_l1_weights=il13, shared_l2_weights=sw2,
                           shared_dw1_weights=s13_il)
    assert torch.equal(s13_il, interleave_l1(s13 if s13.dim() == 3 else s13.unsqueeze(0)).reshape(s13.shape))
    # no tokens: the shared gradients are zeroed (nothing is added with accumulate=True)
    z13 = torch.full_like(sw13, 3.0)
    bf16_mega_moe_backward(x[:0].clone(), None, None, w[:0].clone(), dy[:0].clone(), w13, w2, buf,
                           backend="reference", shared_l1_weights=sw13, shared_l2_weights=sw2, shared_dw1_weights=z13)
    assert torch.count_nonzero(z13) == 0


def test_deepgemm_calls_refuse_half_a_shared_pair():
    from prime_kernels.mega import bf16_mega_moe, bf16_mega_moe_backward, get_symm_buffer_for_mega_moe

    x, idx, w, w13, w2, dy = make_problem(4, H, I, E, K, seed=58)
    sw13, sw2, _ = _shared_problem(4, 1, None, seed=59)
    buf = get_symm_buffer_for_mega_moe(None, E, 40, K, H, I, device="cpu")
    _stage(buf, x, idx, w)
    y = torch.full((4, H), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="go together"):
        bf16_mega_moe(y, w13, w2, buf, backend="reference", shared_l1_weights=sw13)
    assert torch.all(y == 7.0)
    with pytest.raises(ValueError, match="need shared_l1_weights"):
        bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf,
                               backend="reference", shared_dw1_weights=torch.empty_like(sw13))
    with pytest.raises(ValueError, match="shared_dw2_weights"):
        bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf,
                               backend="reference", shared_l1_weights=sw13, shared_l2_weights=sw2,
                               shared_dw2_weights=torch.empty(3, 3))


_GPU_WHY = auto_kernel_skip_reason()


@pytest.mark.skipif(_GPU_WHY is not None, reason=f"kernel backends: {_GPU_WHY}")
@pytest.mark.parametrize("backend", ["auto", "grouped"])
def test_shared_experts_on_the_kernel_backends_against_float64(backend):
    """The shared experts through the kernel backends (Is = 256, I = 128), against float64."""
    T, h, i, e, shared_i = 301, 256, 128, 16, 256
    prob = [t.cuda() for t in make_problem(T, h, i, e, 4, routing="skewed", seed=41, masked_frac=0.1)]
    g = torch.Generator().manual_seed(4)
    sw13 = (torch.randn(2, 2 * shared_i, h, generator=g) / h ** 0.5).to(torch.bfloat16).cuda()
    sw2 = (torch.randn(2, h, shared_i, generator=g) / shared_i ** 0.5).to(torch.bfloat16).cuda()
    gate = torch.rand(T, 2, generator=g).cuda()
    got = _run(prob, (sw13, sw2, gate), backend=backend, num_experts=e)
    cpu = [t.cpu() for t in prob]
    _check_against_float64(cpu, (sw13.cpu(), sw2.cpu(), gate.cpu()), [t.cpu() for t in got])
