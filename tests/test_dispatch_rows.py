"""The dispatch op (out[route_to_pool[t, k]] = src[t], the combine's transpose) on the CPU and the GPU."""

import re

import pytest
import torch

import prime_kernels
from conftest import requires_gpu
from mega_helpers import random_route_to_pool

DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]


def _route_to_pool(T: int, E: int, K: int, masked: bool, gen: torch.Generator) -> torch.Tensor:
    return random_route_to_pool(T, E, K, 0.3 if masked else 0.0, gen)


def _expected(src: torch.Tensor, r2p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    want = out.clone()
    for t in range(r2p.shape[0]):
        for row in r2p[t].tolist():
            if 0 <= row < want.shape[0]:
                want[row] = src[t]
    return want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,E,K,H,masked,ld", [(1, 4, 1, 8, False, 8), (7, 4, 2, 136, True, 136),
                                               (333, 64, 8, 520, True, 640), (128, 16, 4, 2048, False, 2048)])
def test_dispatch_rows_copies_every_route_and_nothing_else(device, T, E, K, H, masked, ld):
    gen = torch.Generator().manual_seed(T * 31 + H)
    r2p = _route_to_pool(T, E, K, masked, gen).to(device)
    src = torch.randn(T, ld, generator=gen).bfloat16().to(device)[:, :H]  # ld > H: a strided view
    rows = int(r2p.max().item()) + 1 + 5  # five rows no route names
    out = torch.full((rows, H), float("nan"), dtype=torch.bfloat16, device=device)
    want = _expected(src.cpu(), r2p.cpu(), out.cpu())
    got = prime_kernels.dispatch_rows(src, r2p, out)
    assert got is out
    assert torch.equal(out.cpu().isnan(), want.isnan()), "a row no route names was written, or a route was skipped"
    live = ~want.isnan().any(1)
    assert torch.equal(out.cpu()[live], want[live])
    again = torch.full_like(out, float("nan"))
    prime_kernels.dispatch_rows(src, r2p, again)
    assert torch.equal(again[live.to(device)], out[live.to(device)])


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_rows_reports_routes_outside_out(device):
    """Routes that are not rows of out (7, -5, 100; -1 is a masked route) write nothing there, and are an error:
    at once on the CPU; on the GPU (checked by the kernel, no synchronisation) by check_device_errors after a
    synchronisation, once."""
    src = torch.randn(3, 16).bfloat16().to(device)
    r2p = torch.tensor([[0, 7], [-1, 2], [-5, 100]], dtype=torch.int32, device=device)
    out = torch.full((4, 16), float("nan"), dtype=torch.bfloat16, device=device)
    if device == "cpu":
        with pytest.raises(RuntimeError, match="route_to_pool"):
            prime_kernels.dispatch_rows(src, r2p, out)
        assert out.isnan().all(), "a refused call wrote rows"
        return
    prime_kernels.check_device_errors()  # nothing pending from earlier tests
    prime_kernels.dispatch_rows(src, r2p, out)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="route_to_pool"):
        prime_kernels.check_device_errors()
    prime_kernels.check_device_errors()  # reported once
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[1])
    assert out[1].isnan().all() and out[3].isnan().all()


def test_dispatch_rows_bad_inputs_raise():
    src = torch.randn(4, 16).bfloat16()
    r2p = torch.zeros(4, 2, dtype=torch.int32)
    out = torch.empty(8, 16, dtype=torch.bfloat16)
    bad = [
        (src.float(), r2p, out, "src must be a bfloat16"),
        (src, r2p.long(), out, "route_to_pool must be a contiguous int32"),
        (src, r2p[:3], out, "src's T rows"),
        (src, r2p, out[:, :8], "out must be a bfloat16 [rows, H]"),
        (src[:, :12], r2p, torch.empty(8, 12, dtype=torch.bfloat16), "multiples of 8"),
    ]
    for s, r, o, msg in bad:
        with pytest.raises(Exception, match=re.escape(msg)):
            prime_kernels.dispatch_rows(s, r, o)


def test_dispatch_rows_opcheck():
    gen = torch.Generator().manual_seed(5)
    r2p = _route_to_pool(9, 8, 2, True, gen)
    src = torch.randn(9, 24, generator=gen).bfloat16()
    out = torch.zeros(int(r2p.max()) + 3, 24, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.prime_kernels.dispatch_rows_.default, (src, r2p, out))
