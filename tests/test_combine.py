"""The combine op (y[t] = bf16(sum over k, in order, of w[t, k] * slots[route_to_pool[t, k]])) on the GPU against
the CPU op bit for bit (both sum in fp32 with one fused multiply-add per route in k order) and against float64."""

import pytest
import torch

import deep_gemm
from conftest import requires_gpu
from deep_gemm.combine import combine_reference


def _routes(T: int, rows: int, K: int, masked: float, gen: torch.Generator) -> torch.Tensor:
    """route_to_pool [T, K]: distinct slot rows per token (any order), a share of them masked (-1)."""
    r2p = torch.stack([torch.randperm(rows, generator=gen)[:K] for _ in range(T)]).int()
    r2p[torch.rand(T, K, generator=gen) < masked] = -1
    return r2p


# K from 1 to 12 (past the layers' top-8), T odd, H = 136 not a multiple of the kernel's 2048-column blocks, all routes
# of a token masked.
@requires_gpu
@pytest.mark.parametrize("T,K,H,masked,weighted", [(1, 1, 8, 0.0, True), (7, 8, 136, 0.3, True),
                                                   (333, 10, 520, 0.3, True), (129, 12, 2048, 0.0, False),
                                                   (64, 8, 2048, 1.0, True), (1000, 6, 1024, 0.1, False)])
def test_combine_gpu_is_the_cpu_op_bit_for_bit(T, K, H, masked, weighted):
    gen = torch.Generator().manual_seed(T * 7 + K)
    rows = T * K + 3
    slots = torch.randn(rows, H, generator=gen).bfloat16()
    r2p = _routes(T, rows, K, masked, gen)
    w = torch.rand(T, K, generator=gen) + 0.1 if weighted else None
    want = torch.ops.deep_gemm.combine(slots, r2p, w)
    ref = combine_reference(slots.double(), r2p, w.double() if w is not None else None, torch.float64)
    for _ in range(3):  # repeats are bitwise identical
        got = torch.ops.deep_gemm.combine(slots.cuda(), r2p.cuda(), w.cuda() if w is not None else None)
        assert not got.isnan().any()
        assert torch.equal(got.cpu(), want)
    err = (got.cpu().double() - ref).norm() / ref.norm().clamp_min(1e-30)
    if masked < 1.0:
        assert err < 1e-2, err
    dead = (r2p < 0).all(1)
    assert (got.cpu()[dead] == 0).all(), "a token with every route masked must be zero"
