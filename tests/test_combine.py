"""The combine op (y[t] = bf16(sum over k, in order, of w[t, k] * slots[route_to_pool[t, k]])) on the GPU against
the CPU op bit for bit (both sum in fp32 with one fused multiply-add per route in k order) and against float64."""

import pytest
import torch

import prime_kernels  # noqa: F401  (registers torch.ops.prime_kernels)
from conftest import requires_gpu
from prime_kernels.combine import combine_reference
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
    want = torch.ops.prime_kernels.combine(slots, r2p, w)
    ref = combine_reference(slots.double(), r2p, w.double() if w is not None else None, torch.float64)
    for _ in range(3):  # repeats are bitwise identical
        got = torch.ops.prime_kernels.combine(slots.cuda(), r2p.cuda(), w.cuda() if w is not None else None)
        assert not got.isnan().any()
        assert torch.equal(got.cpu(), want)
    if masked < 1.0:
        assert rel_err(got.cpu(), ref) < 1e-2
    dead = (r2p < 0).all(1)
    assert (got.cpu()[dead] == 0).all(), "a token with every route masked must be zero"


# ------------------------------------------------------------------ index values against the sizes the op is given


def test_combine_cpu_rejects_routes_outside_the_slots():
    slots = torch.randn(6, 16).bfloat16()
    w = torch.rand(2, 2)
    ok = torch.tensor([[0, -1], [5, 2]], dtype=torch.int32)
    torch.ops.prime_kernels.combine(slots, ok, w)  # -1 (masked) and every row of slots are valid
    for bad in (6, 1000, -2):
        r2p = torch.tensor([[0, bad], [5, 2]], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"route_to_pool\[1\] = .* outside \[-1, 6\)"):
            torch.ops.prime_kernels.combine(slots, r2p, w)


def test_dispatch_rows_cpu_rejects_routes_outside_out():
    src = torch.randn(2, 16).bfloat16()
    out = torch.full((4, 16), float("nan"), dtype=torch.bfloat16)
    for bad in (4, -3):
        r2p = torch.tensor([[0, -1], [bad, 2]], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"outside \[-1, 4\)"):
            torch.ops.prime_kernels.dispatch_rows_(src, r2p, out)
        assert out.isnan().all(), "nothing is written before the check"


def _device_finding(match: str) -> None:
    """The kernels' device-side finding is raised by check_device_errors after a synchronisation, once."""
    from prime_kernels import check_device_errors as check_device
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=match):
        check_device()
    check_device()  # reported once, then cleared


@requires_gpu
def test_combine_gpu_skips_and_reports_routes_outside_the_slots():
    gen = torch.Generator().manual_seed(3)
    slots = torch.randn(6, 16, generator=gen).bfloat16()
    w = torch.rand(3, 2, generator=gen)
    r2p = torch.tensor([[0, 6], [5, -2], [1, 100000]], dtype=torch.int32)  # 6, -2, 100000: not rows of slots
    masked = torch.where((r2p >= 0) & (r2p < 6), r2p, torch.full_like(r2p, -1))
    want = torch.ops.prime_kernels.combine(slots, masked, w)
    got = torch.ops.prime_kernels.combine(slots.cuda(), r2p.cuda(), w.cuda())
    assert torch.equal(got.cpu(), want), "an invalid route must read nothing (a masked route)"
    _device_finding("combine's route_to_pool names a row outside the slots")


@requires_gpu
def test_dispatch_rows_gpu_skips_and_reports_routes_outside_out():
    src = torch.randn(3, 16).bfloat16().cuda()
    r2p = torch.tensor([[0, 7], [-1, 2], [-5, 100]], dtype=torch.int32, device="cuda")
    out = torch.full((4, 16), float("nan"), dtype=torch.bfloat16, device="cuda")
    prime_kernels.dispatch_rows(src, r2p, out)
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[1])
    assert out[1].isnan().all() and out[3].isnan().all()
    _device_finding("dispatch_rows' route_to_pool names a row outside out")


@requires_gpu
def test_a_device_finding_fails_the_next_call_before_it_runs():
    slots = torch.randn(4, 16).bfloat16().cuda()
    bad = torch.tensor([[9]], dtype=torch.int32, device="cuda")
    torch.ops.prime_kernels.combine(slots, bad, None)
    torch.cuda.synchronize()
    good = torch.tensor([[1]], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="not run, since an earlier launch found invalid values"):
        torch.ops.prime_kernels.combine(slots, good, None)
    assert torch.equal(torch.ops.prime_kernels.combine(slots, good, None), slots[1:2])  # cleared: runs again
