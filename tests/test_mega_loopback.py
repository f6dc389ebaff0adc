"""The loopback expert-parallel group (prime_kernels.mega.LoopbackGroup: R virtual ranks as threads of one process):
the grouped backend's all-to-all path and the reference's over it equal EP = 1 bit for bit, on the CPU and on one GPU
(every rank on its own stream); its collectives against torch's semantics; a rank that raises makes the others raise
at their next collective, and ranks that disagree raise the same ValueError, without a hang."""

from __future__ import annotations

import threading

import pytest
import torch

from mega_helpers import make_problem
from test_mega_ep_grouped import CASES, E, FP8_CASES, H, I, K, NAMES, _problem, _run


def _devices():
    return ["cpu", "cuda"]


def _skip_unless(device: str, backend: str) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (the CPU variant runs the same path on the pipeline's CPU ops)")
        if backend == "grouped":
            from mega_helpers import skip_unless_available

            skip_unless_available("mega_moe_grouped.bf16.sm90")


def _check_against_ep1(group, world: int, device: str, case, seed: int) -> None:
    """One case (name, tokens per rank, routing, masked fraction, options) over the loopback group's ranks against
    the one-rank call on all ranks' tokens: every output bit for bit (the options' "chunks" apply to the group)."""
    name, tokens, routing, masked, opts = case
    El = E // world
    prob = [t.to(device) for t in _problem(tokens, routing, masked, seed)]
    x, idx, w, w13, w2, dy = prob

    def rank_fn(r):
        lo = sum(tokens[:r])
        mine = [t[lo:lo + tokens[r]].contiguous() for t in (x, idx, w, dy)]
        return _run(mine[0], mine[1], mine[2], w13[r * El:(r + 1) * El].contiguous(),
                    w2[r * El:(r + 1) * El].contiguous(), mine[3], group=group, num_experts=E, tmax=max(tokens),
                    opts=opts)

    outs = group.run(rank_fn, device=device)
    want = _run(*prob, group=None, num_experts=E, tmax=None, opts={k: v for k, v in opts.items() if k != "chunks"})
    for r in range(world):
        lo = sum(tokens[:r])
        sl, es = slice(lo, lo + tokens[r]), slice(r * El, (r + 1) * El)
        for what, a, b in zip(NAMES, outs[r], (want[0][sl], want[1][sl], want[2][sl], want[3][es], want[4][es])):
            assert torch.equal(a, b), f"{opts} {name} rank {r} {what}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("device", _devices())
def test_loopback_grouped_ep_equals_ep1_bitwise(world, device):
    _skip_unless(device, "grouped")
    from prime_kernels.mega import LoopbackGroup

    group = LoopbackGroup(world)
    for seed, case in enumerate(CASES[world]):
        _check_against_ep1(group, world, device, case, 100 + seed)


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("device", _devices())
def test_loopback_chunked_ep_equals_ep1_bitwise(chunks, world, device):
    """The bf16 path in chunks (each chunk's exchange under another's GEMMs on a GPU) gives the one-rank bits: the
    same cases as unchunked, with more tokens so that every chunk holds some."""
    _skip_unless(device, "grouped")
    from prime_kernels.mega import LoopbackGroup

    group = LoopbackGroup(world)
    for seed, (name, tokens, routing, masked, opts) in enumerate(CASES[world]):
        tokens = tuple(3 * t + (1 if t else 0) for t in tokens)
        _check_against_ep1(group, world, device, (name, tokens, routing, masked, {**opts, "chunks": chunks}),
                           500 + seed)


def test_chunk_pools_partition_the_pool_in_order():
    """Every used row of the full pool is in exactly one chunk pool, each chunk pool keeps the full pool's order
    within an expert and starts every expert on a block boundary."""
    from prime_kernels.mega import _ep_chunks
    from prime_kernels.mega._plan import build_plan

    T, K, El, block_m = 37, 3, 8, 16
    _, idx, _, _, _, _ = make_problem(T, H, I, El, K, routing="skewed", seed=9, masked_frac=0.1)
    cap = 512
    counts, offsets, src, srank, r2p = build_plan(idx, El, block_m, cap)
    pools = _ep_chunks.chunk_pools(idx, r2p, src, srank, offsets, chunks=4, block_m=block_m, num_experts=El,
                                   group=None)
    seen = torch.cat([p.row_map[p.row_map >= 0] for p in pools])
    used = torch.nonzero(src >= 0).flatten()
    assert torch.equal(torch.sort(seen).values, used)
    for p in pools:
        assert all(int(o) % block_m == 0 for o in p.offsets)
        for e in range(El):
            rows = p.row_map[int(p.offsets[e]):int(p.offsets[e]) + int(p.counts[e])]
            assert (rows >= 0).all() and (rows[1:] > rows[:-1]).all()
            assert ((rows >= int(offsets[e])) & (rows < int(offsets[e + 1]))).all()


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("device", _devices())
def test_loopback_fp8_ep_equals_ep1_bitwise(precision, device):
    _skip_unless(device, "grouped")
    if device == "cuda":
        from mega_helpers import skip_unless_available

        skip_unless_available("mega_moe_grouped.fp8.sm90")
        skip_unless_available("mega_moe.fp8_bwd.sm90")
    from prime_kernels.mega import LoopbackGroup

    world = 2
    group = LoopbackGroup(world)
    cases = FP8_CASES + ([("clamp_recompute", (7, 6), "skewed", 0.2, {"activation_clamp": 0.6, "recompute": True})]
                         if precision == "fp8_bwd" else [])
    for seed, (name, tokens, routing, masked, opts) in enumerate(cases):
        _check_against_ep1(group, world, device, (name, tokens, routing, masked, {**opts, "precision": precision}),
                           300 + seed)


@pytest.mark.parametrize("device", _devices())
def test_loopback_collectives_match_torch_semantics(device):
    _skip_unless(device, "none")
    from prime_kernels.mega import LoopbackGroup, _comm

    world = 3
    group = LoopbackGroup(world)
    # rank r sends (r + 1) * d rows to rank d, rows valued 100 * r + d
    splits = [[(r + 1) * d for d in range(world)] for r in range(world)]

    def rank_fn(r):
        assert _comm.world_size(group) == world and _comm.rank(group) == r
        gathered = [torch.empty(2, device=device) for _ in range(world)]
        _comm.all_gather(gathered, torch.full((2,), float(r), device=device), group)
        inp = torch.cat([torch.full((n, 2), 100.0 * r + d, device=device) for d, n in enumerate(splits[r])])
        out_splits = [splits[s][r] for s in range(world)]
        out = torch.empty(sum(out_splits), 2, device=device)
        _comm.all_to_all_single(out, inp, out_splits, splits[r], group)
        return torch.stack(gathered).cpu(), out.cpu()

    for r, (gathered, out) in enumerate(group.run(rank_fn, device=device)):
        assert torch.equal(gathered, torch.arange(world, dtype=torch.float32)[:, None].expand(world, 2))
        want = torch.cat([torch.full((splits[s][r], 2), 100.0 * s + r) for s in range(world)])
        assert torch.equal(out, want)


def test_loopback_rank_that_raises_breaks_the_others_and_run_reraises():
    from prime_kernels.mega import LoopbackGroup, _comm

    group = LoopbackGroup(2, timeout_s=30)
    seen = {}

    def rank_fn(r):
        if r == 1:
            raise KeyError("injected on rank 1")
        try:
            out = [torch.empty(1), torch.empty(1)]
            _comm.all_gather(out, torch.ones(1), group)
        except threading.BrokenBarrierError as e:
            seen[r] = e
            raise

    with pytest.raises(KeyError, match="injected on rank 1"):
        group.run(rank_fn)
    assert isinstance(seen.get(0), threading.BrokenBarrierError)
    assert group.run(lambda r: r) == [0, 1]  # the group is usable again


def test_loopback_ranks_that_disagree_raise_the_same_error():
    from prime_kernels.mega import LoopbackGroup, _backend

    group = LoopbackGroup(2)
    errors = {}

    def rank_fn(r):
        hidden = 256 if r == 1 else H
        x, idx, w, w13, w2, _ = make_problem(5, hidden, I, E, K, seed=4)
        try:
            _backend.forward("grouped", x, idx, w, w13[4 * r:4 * r + 4].contiguous(), w2[4 * r:4 * r + 4].contiguous(),
                             precision="bf16", activation_clamp=None, group=group, num_experts=E, ep_size=2,
                             max_tokens_per_rank=5, block_m=128, save_h=True)
        except ValueError as e:
            errors[r] = str(e)

    group.run(rank_fn)
    assert errors.get(0) == errors.get(1) and "hidden: rank 0 has 128, rank 1 has 256" in errors[0], errors


def test_symmetric_buffer_refuses_a_loopback_group():
    from prime_kernels.mega import LoopbackGroup, get_symm_buffer_for_mega_moe

    with pytest.raises(ValueError, match="LoopbackGroup has no symmetric buffer"):
        get_symm_buffer_for_mega_moe(LoopbackGroup(2), E, 16, K, H, I, device="cpu")


def test_loopback_through_the_public_call_and_autograd_on_the_cpu():
    """mega_moe(group=LoopbackGroup) with autograd, backend "reference", equals EP = 1 bit for bit (on the CPU the
    backward runs on the calling thread; CUDA's autograd device thread is shared, see the loopback module)."""
    from mega_helpers import run_layer
    from prime_kernels.mega import LoopbackGroup

    tokens = (5, 7)
    x, idx, w, w13, w2, dy = make_problem(sum(tokens), H, I, E, K, routing="skewed", seed=5, masked_frac=0.1)
    group = LoopbackGroup(2)

    def rank_fn(r):
        lo = sum(tokens[:r])
        sl, es = slice(lo, lo + tokens[r]), slice(4 * r, 4 * r + 4)
        return run_layer(x[sl].contiguous(), idx[sl].contiguous(), w[sl].contiguous(), w13[es].contiguous(),
                         w2[es].contiguous(), dy[sl].contiguous(), group=group, backend="reference", num_experts=E,
                         max_tokens_per_rank=max(tokens))

    outs = group.run(rank_fn)
    want = run_layer(x, idx, w, w13, w2, dy, backend="reference")
    for r in range(2):
        lo = sum(tokens[:r])
        sl, es = slice(lo, lo + tokens[r]), slice(4 * r, 4 * r + 4)
        for what, a, b in zip(NAMES, outs[r], (want[0][sl], want[1][sl], want[2][sl], want[3][es], want[4][es])):
            assert torch.equal(a, b), f"rank {r} {what}"


def test_bench_ep_loopback_smoke(tmp_path):
    """bench/bench_ep_loopback.py --smoke on the CPU: a row per rank count, the loopback path bit for bit EP = 1,
    positive times."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "bench_ep_loopback.py"
    out = tmp_path / "ep.json"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranks"] for r in rows] == [2, 4], rows
    for r in rows:
        assert r["bitwise"] is True and r["ep1_ms"] > 0 and r["loopback_ms"] > 0, r
