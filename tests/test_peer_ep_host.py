"""The host side of expert parallelism over peer memory, on any machine: the C ABI's argument checks of the barrier
and the row moves (each refuses a bad call with its reason before touching a device), the peer wait timeout, and the
buffers' layout (one allocation, the same offsets on every rank)."""

from __future__ import annotations

import ctypes

import pytest
import torch

PK_OK, PK_ERR_INVALID_ARGUMENT = 0, 1


def _core():
    from prime_kernels import _lib

    core = _lib.load().core
    if core is None:
        pytest.skip(f"the native core is not loaded: {_lib.load().reason}")
    core.pk_ep_barrier.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_void_p]
    core.pk_ep_barrier.restype = ctypes.c_int
    core.pk_peer_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    core.pk_peer_rows.restype = ctypes.c_int
    core.pk_last_error.restype = ctypes.c_char_p
    return core


def _barrier(core, num_ranks, kind, played, signals=None, phase=0):
    sig = (ctypes.c_void_p * max(num_ranks, 1))(*([signals] * max(num_ranks, 1) if signals is not None else
                                                   [0x1000] * max(num_ranks, 1)))
    pl = (ctypes.c_int32 * max(len(played), 1))(*played)
    rc = core.pk_ep_barrier(sig, num_ranks, kind, phase, pl, len(played), None)
    return rc, core.pk_last_error().decode()


@pytest.mark.parametrize("num_ranks,kind,played,phase,want", [
    (0, 0, [0], 0, "num_ranks = 0"),
    (9, 0, [0], 0, "num_ranks = 9"),
    (2, 2, [0], 0, "kind = 2"),
    (2, 0, [], 0, "num_played = 0"),
    (2, 0, [0, 0], 0, "played twice"),
    (2, 0, [2], 0, "played[0] = 2"),
    (2, 0, [-1], 0, "played[0] = -1"),
    # an enter's wait may not be split from its arrival: nothing may touch a peer in between
    (2, 0, [0], 1, "phase = 1"),
    (2, 0, [0], 2, "phase = 2"),
    (2, 1, [0], 3, "phase = 3"),
    (2, 1, [0], -1, "phase = -1"),
])
def test_barrier_refuses_a_bad_call_before_any_launch(num_ranks, kind, played, phase, want):
    rc, msg = _barrier(_core(), num_ranks, kind, played, phase=phase)
    assert rc == PK_ERR_INVALID_ARGUMENT, (rc, msg)
    assert want in msg, msg


def test_barrier_refuses_misaligned_signals():
    rc, msg = _barrier(_core(), 2, 0, [0], signals=0x1003)
    assert rc == PK_ERR_INVALID_ARGUMENT and "not 8-byte aligned" in msg, msg


@pytest.mark.parametrize("row_bytes,ld_pool,divisor,ranks,want", [
    (6, 8, 1, 1, "multiple of 4"),
    (8, 4, 1, 1, "row strides"),
    (8, 8, 0, 1, "route_divisor 0"),
    (8, 8, 1, 9, "num_ranks = 9"),
])
def test_peer_rows_refuses_a_bad_call_before_any_launch(row_bytes, ld_pool, divisor, ranks, want):
    core = _core()
    peers = (ctypes.c_void_p * 9)(*([0x1000] * 9))
    rc = core.pk_peer_rows(0x1000, ld_pool, peers, ranks, 8, 4, 4, row_bytes, 0x1000, 0x1000, divisor, 1, None)
    msg = core.pk_last_error().decode()
    assert rc == PK_ERR_INVALID_ARGUMENT and want in msg, (rc, msg)


def test_peer_rows_with_no_rows_is_a_no_op_without_a_device():
    core = _core()
    peers = (ctypes.c_void_p * 1)(0)
    assert core.pk_peer_rows(None, 16, peers, 1, 16, 0, 0, 16, None, None, 1, 1, None) == PK_OK


def test_peer_wait_timeout_is_its_own_bound():
    import prime_kernels

    try:
        prime_kernels.set_peer_wait_timeout(12.5)
        assert prime_kernels.peer_wait_timeout() == pytest.approx(12.5)
        assert prime_kernels.wait_timeout() != pytest.approx(12.5)
        for bad in (0, -1, 3601, float("nan"), True, "5"):
            with pytest.raises(ValueError):
                prime_kernels.set_peer_wait_timeout(bad)
        assert prime_kernels.peer_wait_timeout() == pytest.approx(12.5)
    finally:
        prime_kernels.set_peer_wait_timeout(60.0)


def test_buffers_layout_is_one_aligned_allocation_with_the_same_offsets():
    from prime_kernels.mega._peer_ep import PeerBuffers, signals_bytes

    specs, total = PeerBuffers.layout(37, 256, 8)
    names = [s[0] for s in specs]
    assert names == ["x", "dy", "topk_idx", "weights", "slots", "dt_slots", "signals"]
    ends = []
    for name, shape, dt, off in specs:
        assert off % 256 == 0, (name, off)
        ends.append(off + torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size())
    assert all(e <= o for e, (_, _, _, o) in zip(ends, specs[1:])), "buffers overlap"
    assert ends[-1] <= total and specs[-1][1] == (signals_bytes(),)
    bufs = PeerBuffers.allocate(37, 256, 8, "cpu")
    assert bufs.slots.shape == (37 * 8, 256) and bufs.x.shape == (37, 256) and bufs.dt_slots.shape == (37 * 8,)
    assert (bufs.topk_idx == -1).all() and (bufs.signals == 0).all()
    x = torch.randn(5, 256).to(torch.bfloat16)
    idx = torch.randint(0, 16, (5, 8))
    bufs.stage(x, idx)
    assert torch.equal(bufs.x[:5], x) and torch.equal(bufs.topk_idx[:5], idx) and (bufs.topk_idx[5:] == -1).all()
    with pytest.raises(ValueError, match="max_tokens=37"):
        bufs.stage(torch.zeros(38, 256, dtype=torch.bfloat16), torch.zeros(38, 8, dtype=torch.int64))


class _Group:
    group_name = "fake-group"


def test_auto_takes_the_all_to_all_path_on_a_group_that_is_not_one_nvlink_domain(monkeypatch):
    from prime_kernels.mega import _nvlink_domain, _peer_ep

    asked = []

    def check(group, device):
        asked.append(group.group_name)
        return False, "ranks 0 and 1 are not NVLink peers"

    monkeypatch.setattr(_nvlink_domain, "check_group", check)
    monkeypatch.setattr(_nvlink_domain, "_warned", False)
    monkeypatch.setattr(_peer_ep, "_domains", {})
    group, dev = _Group(), torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match="not NVLink peers.*all-to-all path"):
        assert _peer_ep.path_for_group("fused", "auto", group, dev) == "grouped"
    assert _peer_ep.path_for_group("fused", "auto", group, dev) == "grouped"  # said once, asked once
    assert asked == ["fake-group"]
    # a backend named by the caller is not changed here: "fused" raises the reason when its buffers are made
    assert _peer_ep.path_for_group("fused", "fused", group, dev) == "fused"
    assert _peer_ep.path_for_group("grouped", "auto", group, dev) == "grouped"
    assert _peer_ep.path_for_group("fused", "auto", None, dev) == "fused"  # one rank: no group to check


def test_auto_keeps_the_peer_path_on_one_nvlink_domain(monkeypatch):
    from prime_kernels.mega import _nvlink_domain, _peer_ep

    monkeypatch.setattr(_nvlink_domain, "check_group", lambda group, device: (True, ""))
    monkeypatch.setattr(_peer_ep, "_domains", {})
    assert _peer_ep.path_for_group("fused", "auto", _Group(), torch.device("cuda", 0)) == "fused"
