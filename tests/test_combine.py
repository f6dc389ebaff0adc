"""The combine op (y[t] = bf16(sum over k, in order, of w[t, k] * slots[route_to_pool[t, k]])) on the GPU against
the CPU op bit for bit (both sum in fp32 with one fused multiply-add per route in k order) and against float64."""

import pytest
import torch

import deep_gemm  # noqa: F401  (registers torch.ops.deep_gemm)
from conftest import requires_gpu
from deep_gemm.combine import combine_reference
from mega_helpers import random_route_to_pool, rel_err


# K from 1 to 12 (past the layers' top-8), T odd, H = 136 not a multiple of the kernel's 2048-column blocks, all routes
# of a token masked.
@requires_gpu
@pytest.mark.parametrize("T,K,H,masked,weighted", [(1, 1, 8, 0.0, True), (7, 8, 136, 0.3, True),
                                                   (333, 10, 520, 0.3, True), (129, 12, 2048, 0.0, False),
                                                   (64, 8, 2048, 1.0, True), (1000, 6, 1024, 0.1, False)])
def test_combine_gpu_is_the_cpu_op_bit_for_bit(T, K, H, masked, weighted):
    gen = torch.Generator().manual_seed(T * 7 + K)
    r2p = random_route_to_pool(T, 2 * K, K, masked, gen)
    slots = torch.randn(T * K + 3, H, generator=gen).bfloat16()  # three rows no route names
    w = torch.rand(T, K, generator=gen) + 0.1 if weighted else None
    want = torch.ops.deep_gemm.combine(slots, r2p, w)
    ref = combine_reference(slots.double(), r2p, w.double() if w is not None else None, torch.float64)
    for _ in range(3):  # repeats are bitwise identical
        got = torch.ops.deep_gemm.combine(slots.cuda(), r2p.cuda(), w.cuda() if w is not None else None)
        assert not got.isnan().any()
        assert torch.equal(got.cpu(), want)
    if masked < 1.0:
        assert rel_err(got.cpu(), ref) < 1e-2
    dead = (r2p < 0).all(1)
    assert (got.cpu()[dead] == 0).all(), "a token with every route masked must be zero"
