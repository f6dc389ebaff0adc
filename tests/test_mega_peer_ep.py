"""Expert parallelism over peer memory (prime_kernels.mega._peer_ep), proven on one GPU by its emulator: R virtual
ranks with their own buffers, the barriers and the fused forward's pushes of the R-GPU path, equal to EP = 1 over the
concatenated tokens bit for bit (y, and each rank's h rows against EP = 1's pool slice of its experts), over routings
that stress the exchange (a rank with T = 0, every route to one rank's experts, skewed, masked routes), with the ranks
in one launch or each on its own stream with random delays; long loops, CUDA-graph replay, a late rank, and a rank
that never arrives (bounded: the wait traps with the ranks named).

On the CPU only the plan slicing runs (the barriers and the fused forward are CUDA kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mega_helpers import make_problem

E, H, I, K = 16, 256, 256, 4
BLOCK_M = 128

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the emulator runs CUDA kernels)")


def _skip_unless_fused():
    from prime_kernels import _status

    why = _status.reason("mega_moe.bf16.sm90")
    if why != "available":
        pytest.skip(f"mega_moe.bf16.sm90: {why}")


def _routing(name: str, tokens: list[int], num_ranks: int, seed: int):
    """Per rank (x, topk_idx, topk_weights); routing "uniform", "skewed", "one_rank" (every route to rank 0's
    experts) or "masked"."""
    out = []
    for r, T in enumerate(tokens):
        if T == 0:
            out.append((torch.empty(0, H, dtype=torch.bfloat16), torch.empty(0, K, dtype=torch.int64),
                        torch.empty(0, K, dtype=torch.float32)))
            continue
        kind = {"one_rank": "uniform", "masked": "uniform"}.get(name, name)
        used = E // num_ranks if name == "one_rank" else None
        x, idx, w, *_ = make_problem(T, H, I, E, K, routing=kind, seed=seed * 31 + r, experts_used=used,
                                     masked_frac=0.3 if name == "masked" else 0.0)
        out.append((x, idx, w))
    return out


def _weights(seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    return w13, w2


def _ep1(inputs, w13, w2, dys=None):
    """EP = 1 over the concatenated tokens: (y, h, expert_offsets) of the fused forward, and with dys (per rank dy)
    (dX, d topk_weights, dW13, dW2) of the layer's bf16 backward (the grouped pipeline)."""
    from prime_kernels.mega import _backend, _fused
    from prime_kernels.routing import pool_capacity

    x = torch.cat([t[0] for t in inputs]).cuda()
    idx = torch.cat([t[1] for t in inputs]).cuda()
    w = torch.cat([t[2] for t in inputs]).cuda()
    T = x.shape[0]
    outs = _fused.forward(x, idx, w, w13.cuda(), w2.cuda(), num_experts=E, block_m=BLOCK_M,
                          capacity=pool_capacity(T, K, E, BLOCK_M))
    fwd = (outs[0], outs[1], outs[3])
    if dys is None:
        return fwd
    dy = torch.cat(dys).cuda()
    grads = _backend.backward("grouped", dy, x, idx, w, w13.cuda(), w2.cuda(), *outs[1:7], precision="bf16",
                              activation_clamp=None, group=None, num_experts=E, recompute=False, need_wgrad=True)
    return fwd, grads


def _poison(group):
    """NaN in every slot a call should write: one it does not write shows in y, dX or d topk_weights."""
    for b in group.buffers:
        b.slots.fill_(float("nan"))
        b.dt_slots.fill_(float("nan"))


def _slices(w, num_ranks):
    El = E // num_ranks
    return [w[r * El:(r + 1) * El].cuda() for r in range(num_ranks)]


def _emulated(inputs, w13, w2, num_ranks, *, delays=0.0, seed=0, group=None):
    from prime_kernels.mega._peer_ep import EmulatedGroup

    tmax = max(1, max(t[0].shape[0] for t in inputs))
    if group is None:
        group = EmulatedGroup(num_ranks, num_experts=E, hidden=H, top_k=K, max_tokens=tmax, delays=delays, seed=seed)
    _poison(group)
    outs = group.forward([t[0].cuda() for t in inputs], [t[1].cuda() for t in inputs],
                         [t[2].cuda() for t in inputs], _slices(w13, num_ranks), _slices(w2, num_ranks),
                         block_m=BLOCK_M)
    return outs, group


def _assert_equal_to_ep1(inputs, outs, ep1):
    y1, h1, off1 = ep1
    R = len(outs)
    El = E // R
    row = 0
    for r, (y, saved) in enumerate(outs):
        T = inputs[r][0].shape[0]
        assert torch.equal(y, y1[row:row + T]), f"rank {r}: y differs from EP = 1 on its tokens"
        row += T
        base, end = int(off1[r * El]), int(off1[(r + 1) * El])
        n = int(saved.offsets[-1])
        assert n == end - base, f"rank {r}: its pool has {n} rows, EP = 1's slice {end - base}"
        assert torch.equal(saved.h[:n], h1[base:end]), f"rank {r}: h differs from EP = 1's rows of its experts"


CASES = [
    ("uniform", (40, 56)),
    ("skewed", (131, 64)),
    ("empty_rank", (0, 77)),
    ("one_rank", (50, 61)),
    ("masked", (45, 1)),
    ("uniform4", (33, 0, 70, 128)),
    ("skewed4", (90, 17, 1, 64)),
    ("one_rank4", (20, 30, 0, 41)),
]


@cuda
@pytest.mark.parametrize("delays", [0.0, 2e-4], ids=["one_launch", "delays"])
@pytest.mark.parametrize("case,tokens", CASES, ids=[c[0] for c in CASES])
def test_emulated_forward_equals_ep1_bitwise(case, tokens, delays):
    _skip_unless_fused()
    name = case.rstrip("4").replace("empty_rank", "uniform")
    R = len(tokens)
    seed = CASES.index((case, tokens))
    inputs = _routing(name, list(tokens), R, seed)
    w13, w2 = _weights(seed)
    outs, _ = _emulated(inputs, w13, w2, R, delays=delays, seed=seed)
    torch.cuda.synchronize()
    _assert_equal_to_ep1(inputs, outs, _ep1(inputs, w13, w2))


BWD_CASES = [c for c in CASES if c[0] in ("skewed", "empty_rank", "masked", "uniform4", "one_rank4")]


@cuda
@pytest.mark.parametrize("regather", [False, True], ids=["kept_x_pool", "regather_x"])
@pytest.mark.parametrize("delays", [0.0, 2e-4], ids=["one_launch", "delays"])
@pytest.mark.parametrize("case,tokens", BWD_CASES, ids=[c[0] for c in BWD_CASES])
def test_emulated_backward_equals_ep1_bitwise(case, tokens, delays, regather):
    from mega_helpers import skip_unless_available

    _skip_unless_fused()
    skip_unless_available("mega_moe_grouped.bf16.sm90")
    name = case.rstrip("4").replace("empty_rank", "uniform")
    R = len(tokens)
    seed = 50 + CASES.index((case, tokens))
    inputs = _routing(name, list(tokens), R, seed)
    w13, w2 = _weights(seed)
    g = torch.Generator().manual_seed(seed)
    dys = [torch.randn(T, H, generator=g).to(torch.bfloat16) for T in tokens]
    outs, group = _emulated(inputs, w13, w2, R, delays=delays, seed=seed)
    _poison(group)
    saved = [o[1] for o in outs]
    if regather:  # the dispatched rows not kept: every rank stages x again and the pools are gathered anew
        import dataclasses

        saved = [dataclasses.replace(sv, x_pool=None) for sv in saved]
        for b in group.buffers:
            b.x.fill_(float("nan"))
    grads = group.backward([d.cuda() for d in dys], [t[1].cuda() for t in inputs], [t[2].cuda() for t in inputs],
                           saved, _slices(w13, R), _slices(w2, R),
                           x=[t[0].cuda() for t in inputs] if regather else None)
    torch.cuda.synchronize()
    fwd1, (dx1, dt1, dw13_1, dw2_1) = _ep1(inputs, w13, w2, dys)
    _assert_equal_to_ep1(inputs, outs, fwd1)
    El, row = E // R, 0
    for r, (dx, dt, dw13, dw2) in enumerate(grads):
        T = tokens[r]
        assert torch.equal(dx, dx1[row:row + T]), f"rank {r}: dX differs from EP = 1"
        assert torch.equal(dt, dt1[row:row + T].float()), f"rank {r}: d topk_weights differ from EP = 1"
        assert torch.equal(dw13, dw13_1[r * El:(r + 1) * El]), f"rank {r}: dW13 differs from EP = 1"
        assert torch.equal(dw2, dw2_1[r * El:(r + 1) * El]), f"rank {r}: dW2 differs from EP = 1"
        row += T


def _ep1_grouped(inputs, w13, w2, dys, precision):
    """EP = 1 on the grouped backend (the FP8 pipelines): y and (dX, d topk_weights, dW13, dW2)."""
    from prime_kernels.mega import _backend

    x, idx, w = (torch.cat([t[i] for t in inputs]).cuda() for i in range(3))
    w13, w2, dy = w13.cuda(), w2.cuda(), torch.cat(dys).cuda()
    fwd = _backend.forward("grouped", x, idx, w, w13, w2, precision=precision, activation_clamp=None, group=None,
                           num_experts=E, ep_size=1, max_tokens_per_rank=None, block_m=BLOCK_M, save_h=True)
    grads = _backend.backward("grouped", dy, x, idx, w, w13, w2, *fwd[1:7], precision=precision,
                              activation_clamp=None, group=None, num_experts=E, recompute=False, need_wgrad=True)
    return fwd[0], grads


FP8_CASES = [("uniform", (40, 56), 0.0), ("skewed", (131, 64), 0.0), ("empty_rank4", (33, 0, 70, 128), 0.0),
             ("one_rank", (50, 61), 2e-4)]


@cuda
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("case,tokens,delays", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_emulated_fp8_equals_ep1_bitwise(case, tokens, delays, precision):
    """FP8 forward (fp8) or the bf16 fused forward (fp8_bwd), then the FP8 backward pipeline on each rank's pool,
    against EP = 1's FP8 pipelines."""
    from mega_helpers import skip_unless_available

    _skip_unless_fused()
    skip_unless_available("mega_moe_grouped.fp8.sm90")
    skip_unless_available("mega_moe.fp8_bwd.sm90")
    name = case.rstrip("4").replace("empty_rank", "uniform")
    R = len(tokens)
    seed = 80 + [c[0] for c in FP8_CASES].index(case)
    inputs = _routing(name, list(tokens), R, seed)
    w13, w2 = _weights(seed)
    g = torch.Generator().manual_seed(seed)
    dys = [torch.randn(T, H, generator=g).to(torch.bfloat16) for T in tokens]
    from prime_kernels.mega._peer_ep import EmulatedGroup

    group = EmulatedGroup(R, num_experts=E, hidden=H, top_k=K, max_tokens=max(tokens), delays=delays, seed=seed)
    _poison(group)
    outs = group.forward([t[0].cuda() for t in inputs], [t[1].cuda() for t in inputs], [t[2].cuda() for t in inputs],
                         _slices(w13, R), _slices(w2, R), block_m=BLOCK_M,
                         precision="fp8" if precision == "fp8" else "bf16")
    _poison(group)
    grads = group.backward([d.cuda() for d in dys], [t[1].cuda() for t in inputs], [t[2].cuda() for t in inputs],
                           [o[1] for o in outs], _slices(w13, R), _slices(w2, R), fp8=True)
    torch.cuda.synchronize()
    y1, (dx1, dt1, dw13_1, dw2_1) = _ep1_grouped(inputs, w13, w2, dys, precision)
    El, row = E // R, 0
    for r in range(R):
        T = tokens[r]
        sl, es = slice(row, row + T), slice(r * El, (r + 1) * El)
        dx, dt, dw13, dw2 = grads[r]
        for what, a, b in (("y", outs[r][0], y1[sl]), ("dX", dx, dx1[sl]), ("dtopk", dt, dt1[sl].float()),
                           ("dW13", dw13, dw13_1[es]), ("dW2", dw2, dw2_1[es])):
            assert torch.equal(a, b), f"rank {r}: {what} differs from EP = 1 ({precision})"
        row += T


@cuda
@pytest.mark.parametrize("n,slot_cols", [(256, 256), (192, 200)], ids=["wide", "narrow_strided"])
def test_dx_gemm_pushes_its_rows_to_their_routes_bitwise(n, slot_cols):
    """The dX GEMM whose epilogue writes each row into its source rank's slot equals the plain GEMM followed by the
    row scatter, bit for bit: groups of 0, odd and whole-block sizes, padding rows (route -1) and rows past every
    group going nowhere, two ranks' slot buffers NaN-filled first (a slot no row names must stay NaN)."""
    _skip_unless_fused()
    g = torch.Generator().manual_seed(7)
    k, ranks, routes = 384, 2, 600
    offsets = torch.tensor([0, 0, 300, 301, 429, 506], dtype=torch.int32)
    m_total = 512
    a = torch.randn(m_total, k, generator=g).to(torch.bfloat16)
    b = (torch.randn(5, k, n, generator=g) / k ** 0.5).to(torch.bfloat16)
    pairs = torch.randperm(ranks * routes, generator=g)[:m_total]
    src_rank, src_route = (pairs // routes).to(torch.int32), (pairs % routes).to(torch.int32)
    src_route[torch.rand(m_total, generator=g) < 0.1] = -1  # a plan's padding rows
    src_route[int(offsets[-1]):] = -1                        # rows in no group
    a, b, offsets, src_route, src_rank = (t.cuda() for t in (a, b, offsets, src_route, src_rank))

    def slots():
        return [torch.full((routes, slot_cols), float("nan"), dtype=torch.bfloat16, device="cuda")[:, :n]
                for _ in range(ranks)]

    want = slots()
    d = torch.ops.prime_kernels.m_grouped_bf16_gemm_nn(a, b, offsets, 0)
    torch.ops.prime_kernels.peer_rows_(d, want, src_route, src_rank, 1, False)
    got = slots()
    torch.ops.prime_kernels.m_grouped_bf16_gemm_nn_to_routes_(a, b, offsets, got, src_route, src_rank, 0)
    torch.cuda.synchronize()
    for r in range(ranks):
        assert torch.equal(got[r].view(torch.int16), want[r].view(torch.int16)), f"rank {r}'s slots differ"
    written = sum(int((~torch.isnan(w.float())).any(1).sum()) for w in want)
    assert written == int((src_route >= 0).sum()), "the scatter wrote another number of slots than rows have routes"


@cuda
def test_emulated_back_to_back_calls_are_stable_and_never_hang():
    _skip_unless_fused()
    R = 4
    inputs = _routing("skewed", [24, 9, 0, 31], R, 7)
    w13, w2 = _weights(7)
    outs, group = _emulated(inputs, w13, w2, R)
    first = [o[0].clone() for o in outs]
    args = ([t[0].cuda() for t in inputs], [t[1].cuda() for t in inputs], [t[2].cuda() for t in inputs],
            _slices(w13, R), _slices(w2, R))
    for i in range(2000):
        outs = group.forward(*args, block_m=BLOCK_M)
        if i % 500 == 499:
            torch.cuda.synchronize()
            for r in range(R):
                assert torch.equal(outs[r][0], first[r]), f"call {i}: rank {r}'s y changed"
    torch.cuda.synchronize()
    epochs = [int(b.signals[:8].view(torch.int64).item()) for b in group.buffers]
    assert epochs == [2001] * R, f"every rank entered 2001 calls, epochs {epochs}"


@cuda
def test_emulated_forward_replays_in_a_cuda_graph():
    _skip_unless_fused()
    R = 2
    inputs = _routing("uniform", [37, 52], R, 3)
    w13, w2 = _weights(3)
    eager, group = _emulated(inputs, w13, w2, R)
    args = ([t[0].cuda() for t in inputs], [t[1].cuda() for t in inputs], [t[2].cuda() for t in inputs],
            _slices(w13, R), _slices(w2, R))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        group.forward(*args, block_m=BLOCK_M)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = group.forward(*args, block_m=BLOCK_M)
    before = [int(b.signals[:8].view(torch.int64).item()) for b in group.buffers]
    for _ in range(3):
        _poison(group)
        graph.replay()
    torch.cuda.synchronize()
    after = [int(b.signals[:8].view(torch.int64).item()) for b in group.buffers]
    assert after == [e + 3 for e in before], f"epochs advance on replay: {before} -> {after}"
    for r in range(R):
        assert torch.equal(captured[r][0], eager[r][0]), f"rank {r}: the replay's y differs from eager"


@cuda
def test_a_rank_seconds_late_still_succeeds():
    """Rank 1 enters 2 s after rank 0 (each on its own stream): rank 0's waits outlast it (the peer bound is 60 s)."""
    _skip_unless_fused()
    from prime_kernels.mega import _peer_ep

    R = 2
    inputs = _routing("uniform", [16, 16], R, 5)
    w13, w2 = _weights(5)
    outs, group = _emulated(inputs, w13, w2, R)
    ref = [o[0].clone() for o in outs]
    streams = [torch.cuda.Stream() for _ in range(R)]
    res = [None] * R
    for r in (0, 1):
        streams[r].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(streams[r]):
            if r == 1:
                torch.cuda._sleep(int(2.0 * 1.4e9))
            res[r] = _peer_ep.forward_ranks(group.buffers, [r], [inputs[r][1].cuda()], [inputs[r][2].cuda()],
                                            [_slices(w13, R)[r]], [_slices(w2, R)[r]], num_experts=E,
                                            block_m=BLOCK_M, num_sms=16)[0]
    torch.cuda.synchronize()
    for r in range(R):
        assert torch.equal(res[r][0], ref[r])


_ABSENT_PEER = textwrap.dedent("""
    import torch, prime_kernels
    from prime_kernels.mega import _peer_ep
    prime_kernels.set_peer_wait_timeout(0.5)
    bufs = [_peer_ep.PeerBuffers.allocate(4, 128, 2, "cuda") for _ in range(3)]
    _peer_ep.barrier(bufs, 0, [0, 2])  # rank 1 never arrives
    try:
        torch.cuda.synchronize()
    except Exception:
        pass
    try:
        prime_kernels.check_device_errors()
    except RuntimeError as e:
        print("ERROR:", e)
""")


@cuda
def test_a_rank_that_never_arrives_traps_with_the_ranks_named():
    _skip_unless_fused()
    r = subprocess.run([sys.executable, "-c", _ABSENT_PEER], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = r.stdout + r.stderr
    assert "ERROR:" in out, out[-2000:]
    msg = out.split("ERROR:", 1)[1]
    assert "rank 0" in msg or "rank 2" in msg, msg
    assert "rank 1" in msg and "entering the call" in msg and "expected its epoch >= 1, observed 0" in msg, msg


def test_rank_plan_is_the_group_plans_slice():
    """rank_plans (no host sync) gives each rank the rows of its experts in the group's plan over tokens (rank, t), with
    their source ranks and routes, on the CPU too."""
    from prime_kernels.mega._peer_ep import rank_plans
    from prime_kernels.routing import routing_plan_reference

    R, tmax = 4, 9
    g = torch.Generator().manual_seed(0)
    topk = []
    for r, T in enumerate((9, 0, 5, 7)):
        t = torch.full((tmax, K), -1, dtype=torch.int64)
        for i in range(T):
            t[i] = torch.randperm(E, generator=g)[:K]
        t[:T][torch.rand(T, K, generator=g) < 0.2] = -1
        topk.append(t)
    ref = routing_plan_reference(torch.cat(topk), E, BLOCK_M)
    El = E // R
    for r in range(R):
        offsets, src_route, src_rank, counts = rank_plans(topk, [r], E, BLOCK_M)[0]
        assert counts.tolist() == ref.expert_counts[r * El:(r + 1) * El].tolist()
        base, end = int(ref.expert_offsets[r * El]), int(ref.expert_offsets[(r + 1) * El])
        assert offsets.tolist() == [int(v) - base for v in ref.expert_offsets[r * El:(r + 1) * El + 1]]
        g_src = ref.pool_src_route[base:end].long()
        ok = g_src >= 0
        g_tok = torch.div(g_src, K, rounding_mode="floor")
        want_rank = torch.where(ok, torch.div(g_tok, tmax, rounding_mode="floor"), -1)
        want_route = torch.where(ok, (g_tok % tmax) * K + g_src % K, -1)
        assert src_rank[:end - base].tolist() == want_rank.tolist()
        assert src_route[:end - base].tolist() == want_route.tolist()
        assert (src_route[end - base:] == -1).all() and (src_rank[end - base:] == -1).all()


# One GPU per rank, the ranks NVLink peers (the multi-GPU machines): PeerGroup over torch symmetric memory.
NCCL_TOKENS = {2: (40, 0), 4: (33, 0, 70, 128), 8: (4, 0, 7, 3, 6, 1, 5, 2)}


def _nccl_worker(rank, world, port, outdir):
    from datetime import timedelta

    import torch.distributed as dist

    from mega_helpers import end_rank

    from prime_kernels.mega import _nvlink_domain
    from prime_kernels.mega._peer_ep import PeerGroup

    _nvlink_domain.disable_multicast_env()
    torch.set_num_threads(1)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=dev)
    try:
        tokens = NCCL_TOKENS[world]
        inputs = _routing("skewed", list(tokens), world, 11)
        w13, w2 = _weights(11)
        g = torch.Generator().manual_seed(11)
        dys = [torch.randn(T, H, generator=g).to(torch.bfloat16) for T in tokens]
        x, idx, w = (t.to(dev) for t in inputs[rank])
        El = E // world
        pg = PeerGroup(dist.group.WORLD, num_experts=E, hidden=H, top_k=K, max_tokens=max(tokens), device=dev)
        w13_r, w2_r = w13[rank * El:(rank + 1) * El].to(dev), w2[rank * El:(rank + 1) * El].to(dev)
        outs = []
        for _ in range(3):  # epochs advance across calls
            y, saved = pg.forward(x, idx, w, w13_r, w2_r)
            grads = pg.backward(dys[rank].to(dev), idx, w, saved, w13_r, w2_r)
            outs.append([t.cpu() for t in (y, *grads)])
        # the public call, backend "fused" under the group (its status entry read as available: it is what this
        # test verifies), through autograd
        from mega_helpers import run_layer
        from prime_kernels.mega import _backend

        real = _backend._status
        _backend._status = lambda: {**real(), _backend.PEER_KEY: "available"}
        try:
            got = run_layer(x, idx, w, w13_r, w2_r, dys[rank].to(dev), group=dist.group.WORLD, backend="fused",
                            num_experts=E, max_tokens_per_rank=max(tokens))
        finally:
            _backend._status = real
        y, dx, dw, dw13, dw2 = (t.cpu() for t in got)
        outs.append([y, dx, dw.float(), dw13, dw2])
        torch.cuda.synchronize()
        torch.save(outs, os.path.join(outdir, f"rank{rank}.pt"))
        end_rank(rank, outdir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_peer_group_over_nvlink_equals_ep1_bitwise(world):
    import tempfile

    from mega_helpers import spawn_ranks

    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"needs {world} CUDA GPUs, one per rank (this machine has {have})")
    _skip_unless_fused()
    tokens = NCCL_TOKENS[world]
    with tempfile.TemporaryDirectory() as outdir:
        codes = spawn_ranks(_nccl_worker, world, outdir, (), 240)
        assert all(c == 0 for c in codes), codes
        outs = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
    inputs = _routing("skewed", list(tokens), world, 11)
    w13, w2 = _weights(11)
    g = torch.Generator().manual_seed(11)
    dys = [torch.randn(T, H, generator=g).to(torch.bfloat16) for T in tokens]
    (y1, _h, _off), (dx1, dt1, dw13_1, dw2_1) = _ep1(inputs, w13, w2, dys)
    El, row = E // world, 0
    for r in range(world):
        T = tokens[r]
        sl, es = slice(row, row + T), slice(r * El, (r + 1) * El)
        want = (y1[sl], dx1[sl], dt1[sl].float(), dw13_1[es], dw2_1[es])
        for call, got in enumerate(outs[r]):
            for what, a, b in zip(("y", "dX", "dtopk", "dW13", "dW2"), got, want):
                assert torch.equal(a, b.cpu()), f"rank {r} call {call}: {what} differs from EP = 1"
        row += T
