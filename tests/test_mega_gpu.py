"""GPU checks of prime_kernels.mega (skipped, with the reason shown, on machines without CUDA)."""

import pytest
import torch

from mega_helpers import loop_reference, make_problem, rel_err, run_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

E, H, I, K = 8, 128, 128, 4


def _cuda(ts):
    return [t.cuda() for t in ts]


def test_reference_on_cuda_matches_float64_loop():
    prob = make_problem(200, H, I, E, K, routing="skewed", seed=71, masked_frac=0.1)
    got = run_layer(*_cuda(prob), backend="reference", activation_clamp=0.8)
    ref = loop_reference(*prob, clamp=0.8)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, ref):
        assert rel_err(a.cpu(), b) < 1e-2, name


def test_reference_cuda_close_to_cpu():
    prob = make_problem(300, H, I, E, K, seed=72)
    a = run_layer(*_cuda(prob), backend="reference")
    b = run_layer(*prob, backend="reference")
    for u, v in zip(a, b):
        assert rel_err(u.cpu(), v) < 5e-3


def test_fused_matches_reference_when_available():
    from prime_kernels.mega._backend import _fused_reason

    reason = _fused_reason("bf16", "fwd") or _fused_reason("bf16", "bwd")
    if reason is not None:
        pytest.skip(f"fused bf16 kernels not available: {reason}")
    prob = make_problem(1000, 256, 256, E, K, routing="skewed", seed=73, masked_frac=0.05)
    got = run_layer(*_cuda(prob), backend="fused")
    ref = loop_reference(*prob)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, ref):
        assert rel_err(a.cpu(), b) < 1e-2, name


def test_compile_inductor_on_cuda():
    pytest.importorskip("triton", reason="inductor needs triton")
    from prime_kernels.mega import MegaMoE

    torch._dynamo.reset()
    torch.manual_seed(74)
    layer = MegaMoE(E, H, I, K, backend="reference", device="cuda")
    x, idx, w, _, _, dy = _cuda(make_problem(64, H, I, E, K, seed=75))
    compiled = torch.compile(layer, fullgraph=True)
    xs = x.clone().requires_grad_()
    compiled(xs, idx, w).backward(dy)
    assert torch.isfinite(xs.grad).all() and layer.w13.grad is not None
