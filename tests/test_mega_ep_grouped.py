"""The grouped backend's expert parallelism (the all-to-all path, prime_kernels.mega._grouped_ep) equals EP = 1 bit
for bit: R ranks of a gloo group, each with E / R experts and its own tokens, give the one-rank call's y, dX and
d topk_weights on their token slices and its weight gradients on their experts' slices, forward and backward, over
routings that stress the exchange (unequal T per rank, a rank with T = 0, masked routes, every route to the
first ranks' experts), a clamp, recompute, fp32 accumulators and deferred weight gradients.

On the CPU the grouped pipeline's ops run their CPU implementations; each expert's GEMMs see the same rows in both
runs, so the bits are the same. On a GPU the same test runs the kernels through gloo (which stages CUDA tensors
through host memory), every rank on the one card."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch

from mega_helpers import end_rank, make_problem, spawn_ranks

E, H, I, K = 8, 128, 128, 3
TIMEOUT_S = 180
NAMES = ("y", "dx", "dtopk", "dw13", "dw2")

# (name, tokens per rank, routing, masked fraction, options)
CASES = {
    2: [
        ("skewed", (9, 5), "skewed", 0.1, {}),
        ("empty_rank", (0, 11), "uniform", 0.0, {}),
        ("clamp_recompute", (7, 6), "skewed", 0.2, {"activation_clamp": 0.6, "recompute": True}),
        ("low_experts", (6, 8), "low_experts", 0.0, {}),
        ("accum", (5, 9), "uniform", 0.1, {"accum": True}),
        ("deferred", (8, 3), "skewed", 0.0, {"defer": True}),
        ("all_masked", (4, 3), "uniform", 1.0, {}),
    ],
    4: [
        ("skewed", (5, 0, 9, 3), "skewed", 0.1, {}),
        ("low_experts", (3, 4, 2, 6), "low_experts", 0.0, {"activation_clamp": 0.6}),
    ],
}


def _problem(tokens, routing, masked, seed):
    T = sum(tokens)
    kind = "skewed" if routing == "skewed" else "uniform"
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, routing=kind, seed=seed, masked_frac=masked)
    if routing == "low_experts":  # every route to experts 0-3: one rank's of two, two ranks' of four, the rest idle
        g = torch.Generator().manual_seed(seed)
        idx = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(T)]) if T else idx
    if masked >= 1.0:
        idx[:] = -1
    return x, idx, w, w13, w2, dy


def _run(x, idx, w, w13, w2, dy, *, group, num_experts, tmax, opts):
    """(y, dx, dtopk, dw13, dw2) of the grouped backend's forward and backward, on ``group`` or on one rank."""
    from prime_kernels.mega import _backend, _comm

    ep = _comm.world_size(group)
    clamp = opts.get("activation_clamp")
    precision = opts.get("precision", "bf16")
    fwd = _backend.forward("grouped", x, idx, w, w13, w2, precision=precision, activation_clamp=clamp, group=group,
                           num_experts=num_experts, ep_size=ep, max_tokens_per_rank=tmax, block_m=128, save_h=True,
                           ep_chunks=opts.get("chunks", 1))
    y, h, counts, offsets, src, srank, r2p, _ = fwd
    state = (h, counts, offsets, src, srank, r2p)
    common = dict(precision=precision, activation_clamp=clamp, group=group, num_experts=num_experts,
                  ep_chunks=opts.get("chunks", 1),
                  recompute=opts.get("recompute", False))
    if opts.get("accum") or opts.get("defer"):
        g = torch.Generator().manual_seed(11)
        a13 = torch.randn((num_experts,) + w13.shape[1:], generator=g).to(x.device)
        a2 = torch.randn((num_experts,) + w2.shape[1:], generator=g).to(x.device)
        if ep > 1:  # this rank's experts' slice of the one-rank accumulators
            r, El = _comm.rank(group), w13.shape[0]
            a13, a2 = a13[r * El:(r + 1) * El].contiguous(), a2[r * El:(r + 1) * El].contiguous()
        init13, init2 = a13.clone(), a2.clone()
        if opts.get("defer"):
            dx, dtopk, later = _backend.backward("grouped", dy, x, idx, w, w13, w2, *state, need_wgrad=False,
                                                 defer_wgrad=True, **common)
            later.run(a13, a2)
        else:
            dx, dtopk, _, _ = _backend.backward("grouped", dy, x, idx, w, w13, w2, *state, need_wgrad=False,
                                                dw13_accum=a13, dw2_accum=a2, **common)
        return y, dx, dtopk, a13 - init13, a2 - init2
    dx, dtopk, dw13, dw2 = _backend.backward("grouped", dy, x, idx, w, w13, w2, *state, need_wgrad=True, **common)
    return y, dx, dtopk, dw13, dw2


# FP8 over the same exchanges: the FP8 pipelines on each rank's pool (no clamp with the FP8 forward)
FP8_CASES = [
    ("skewed", (9, 5), "skewed", 0.1, {}),
    ("empty_rank", (0, 11), "uniform", 0.0, {}),
    ("low_experts_recompute", (6, 8), "low_experts", 0.0, {"recompute": True}),
    ("accum", (5, 9), "uniform", 0.1, {"accum": True}),
    ("deferred", (8, 3), "skewed", 0.0, {"defer": True}),
]

# one GPU per rank over NCCL: the 2-rank cases (bf16, then FP8 both ways), and for 4 and 8 ranks a spread of tokens
# with an empty rank and every route to the first ranks' experts
NCCL_TOKENS = {2: None, 4: (5, 0, 9, 3), 8: (4, 0, 7, 3, 6, 1, 5, 2)}


def _nccl_cases(world):
    if world == 2:
        return CASES[2] + [(f"{name}_{p}", tokens, routing, masked, {**opts, "precision": p})
                           for p in ("fp8", "fp8_bwd") for name, tokens, routing, masked, opts in FP8_CASES]
    tokens = NCCL_TOKENS[world]
    return [("spread", tokens, "skewed", 0.1, {}), ("low_experts", tokens, "low_experts", 0.0, {}),
            ("spread_fp8", tokens, "uniform", 0.1, {"precision": "fp8"})]


def _cases(world, device_type):
    return _nccl_cases(world) if device_type == "nccl" else CASES[world]


def _worker(rank, world, port, outdir, device_type):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device_type == "nccl":  # one GPU per rank; the library never uses NVLink multicast
        for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            os.environ[var] = "0" if var == "NCCL_NVLS_ENABLE" else "1"
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120), device_id=dev)
    else:
        dev = torch.device(device_type)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
    try:
        out = {}
        El = E // world
        for seed, (name, tokens, routing, masked, opts) in enumerate(_cases(world, device_type)):
            x, idx, w, w13, w2, dy = [t.to(dev) for t in _problem(tokens, routing, masked, 100 + seed)]
            lo = sum(tokens[:rank])
            sl = slice(lo, lo + tokens[rank])
            es = slice(rank * El, (rank + 1) * El)
            mine = [t[sl].contiguous() for t in (x, idx, w, dy)]
            got = _run(mine[0], mine[1], mine[2], w13[es].contiguous(), w2[es].contiguous(), mine[3],
                       group=dist.group.WORLD, num_experts=E, tmax=max(tokens), opts=opts)
            out[name] = tuple(t.cpu() for t in got)
            if device_type != "cpu" and name == _cases(world, device_type)[0][0]:  # the public call, "auto"
                from mega_helpers import run_layer

                got = run_layer(mine[0], mine[1], mine[2], w13[es].contiguous(), w2[es].contiguous(), mine[3],
                                group=dist.group.WORLD, num_experts=E, max_tokens_per_rank=max(tokens))
                out["api"] = tuple(t.cpu() for t in got)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        end_rank(rank, outdir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world, device_type):
    with tempfile.TemporaryDirectory() as outdir:
        codes = spawn_ranks(_worker, world, outdir, (device_type,), TIMEOUT_S)
        assert all(c == 0 for c in codes), codes
        return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]


def _check_against_ep1(world, device_type):
    outs = _spawn(world, device_type)
    El = E // world
    device = "cuda" if device_type == "nccl" else device_type
    for seed, (name, tokens, routing, masked, opts) in enumerate(_cases(world, device_type)):
        prob = [t.to(device) for t in _problem(tokens, routing, masked, 100 + seed)]
        want = [t.cpu() for t in _run(*prob, group=None, num_experts=E, tmax=None, opts=opts)]
        for r in range(world):
            lo = sum(tokens[:r])
            sl, es = slice(lo, lo + tokens[r]), slice(r * El, (r + 1) * El)
            for what, a, b in zip(NAMES, outs[r][name], (want[0][sl], want[1][sl], want[2][sl], want[3][es],
                                                        want[4][es])):
                assert a.shape == b.shape and a.dtype == b.dtype, f"{name} rank {r} {what}: {a.shape} vs {b.shape}"
                assert torch.equal(a, b), \
                    f"{name} rank {r} {what}: max diff {(a.double() - b.double()).abs().max().item():.3e}"
    if device != "cpu":  # mega_moe(group=...) under "auto" runs this path, and EP = 1's fused forward's bits
        from mega_helpers import run_layer

        name, tokens, routing, masked, _ = _cases(world, device_type)[0]
        want = [t.cpu() for t in run_layer(*[t.cuda() for t in _problem(tokens, routing, masked, 100)])]
        for r in range(world):
            lo = sum(tokens[:r])
            sl, es = slice(lo, lo + tokens[r]), slice(r * El, (r + 1) * El)
            for what, a, b in zip(NAMES, outs[r]["api"], (want[0][sl], want[1][sl], want[2][sl], want[3][es],
                                                         want[4][es])):
                assert torch.equal(a, b), f"api rank {r} {what}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_grouped_ep_equals_ep1_bitwise(world, device_type):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if device_type == "cuda":
        from mega_helpers import skip_unless_available

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (the CPU variant runs the same path on the pipeline's CPU ops)")
        skip_unless_available("mega_moe_grouped.bf16.sm90")
    _check_against_ep1(world, device_type)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_grouped_ep_over_nccl_equals_ep1_bitwise(world):
    """One GPU per rank over NCCL (the multi-GPU machines): bf16 and FP8 against EP = 1 on one of the same GPUs."""
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"needs {world} CUDA GPUs, one per rank (this machine has {have})")
    from mega_helpers import skip_unless_available

    skip_unless_available("mega_moe_grouped.bf16.sm90")
    skip_unless_available("mega_moe_grouped.fp8.sm90")
    skip_unless_available("mega_moe.fp8_bwd.sm90")
    _check_against_ep1(world, "nccl")


def _disagree_worker(rank, world, port, outdir, scenario):
    """One rank of a call that must fail on every rank: the scenario's bad input on rank 1 only."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=5 if scenario == "raises_mid_call" else 60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    try:
        from prime_kernels.mega import _backend, _grouped_ep

        tokens = (6, 5)
        hidden = 256 if scenario == "hidden" and rank == 1 else H
        x, idx, w, w13, w2, dy = make_problem(sum(tokens), hidden, I, E, K, routing="uniform", seed=3)
        lo = sum(tokens[:rank])
        x, idx, w = (t[lo:lo + tokens[rank]].contiguous() for t in (x, idx, w))
        El = E // world
        w13, w2 = w13[rank * El:(rank + 1) * El].contiguous(), w2[rank * El:(rank + 1) * El].contiguous()
        which = "reference" if scenario == "backend" and rank == 1 else "grouped"
        top_k_cut = scenario == "top_k" and rank == 1
        if top_k_cut:
            idx, w = idx[:, :2].contiguous(), w[:, :2].contiguous()
        if scenario == "raises_mid_call" and rank == 1:
            def broken(*args, **kwargs):
                raise RuntimeError("injected failure on rank 1")
            _grouped_ep.m_grouped_bf16_gemm_swiglu = broken
        try:
            _backend.forward(which, x, idx, w, w13, w2, precision="bf16", activation_clamp=None,
                             group=dist.group.WORLD, num_experts=E, ep_size=world, max_tokens_per_rank=max(tokens),
                             block_m=128, save_h=True)
            result = "returned"
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            result = f"{type(e).__name__}: {e}"
        with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
            f.write(result)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group broken by the scenario
            pass


@pytest.mark.parametrize("scenario", ["hidden", "top_k", "backend", "raises_mid_call"])
def test_ranks_that_disagree_or_fail_raise_on_every_rank_and_none_hangs(scenario):
    """A call whose ranks disagree (hidden size, top_k, backend) raises the same ValueError on every rank, naming what
    differs, before any exchange; a rank that raises mid-call makes the other raise within the group's timeout."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world = 2
    with tempfile.TemporaryDirectory() as outdir:
        spawn_ranks(_disagree_worker, world, outdir, (scenario,), 60)
        results = [open(os.path.join(outdir, f"rank{r}.txt")).read() for r in range(world)]
    if scenario == "raises_mid_call":
        assert results[1] == "RuntimeError: injected failure on rank 1", results
        assert results[0] != "returned" and results[0].startswith("RuntimeError"), results
        return
    assert results[0] == results[1], results  # the same message on every rank
    assert results[0].startswith("ValueError") and "disagree" in results[0], results
    assert {"hidden": "hidden: rank 0 has 128, rank 1 has 256", "top_k": "top_k: rank 0 has 3, rank 1 has 2",
            "backend": "backend: rank 0 has 1, rank 1 has 0"}[scenario] in results[0], results
