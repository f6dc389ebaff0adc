"""Expert parallelism over two processes: EP = 2 gives the same result as EP = 1. On the CPU with
gloo (bit for bit, in CI), and on two GPUs with NCCL and a symmetric-memory buffer when present."""

import os
import tempfile
from datetime import timedelta

import pytest
import torch

from mega_helpers import end_rank, make_problem, run_layer, spawn_ranks

E, H, I, K = 8, 32, 16, 3
TOKENS = (5, 9)  # unequal tokens per rank
CLAMP = 0.6
TIMEOUT_S = 120


def _full_problem():
    return make_problem(sum(TOKENS), H, I, E, K, routing="skewed", seed=61, masked_frac=0.1)


def _ep_worker(rank, world, port, outdir, device_type="cpu"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dev = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from prime_kernels.mega import bf16_mega_moe, bf16_mega_moe_backward, get_symm_buffer_for_mega_moe

        group = dist.group.WORLD
        x, idx, w, w13, w2, dy = [t.to(dev) for t in _full_problem()]
        lo = sum(TOKENS[:rank])
        sl = slice(lo, lo + TOKENS[rank])
        El = E // world
        es = slice(rank * El, (rank + 1) * El)
        x, idx, w, dy = (t[sl].contiguous() for t in (x, idx, w, dy))
        w13, w2 = w13[es].contiguous(), w2[es].contiguous()
        out = {}
        out["autograd"] = run_layer(x, idx, w, w13, w2, dy, group=group, backend="reference", num_experts=E,
                                    activation_clamp=CLAMP, max_tokens_per_rank=max(TOKENS))
        out["recompute"] = run_layer(x, idx, w, w13, w2, dy, group=group, backend="reference", num_experts=E,
                                     activation_clamp=CLAMP, max_tokens_per_rank=max(TOKENS), recompute=True)
        buf = get_symm_buffer_for_mega_moe(group, E, 16, K, H, I, device=dev)
        assert buf.symmetric == (device_type == "cuda"), buf
        T = x.shape[0]
        buf.stage(x, idx, w)
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        state = bf16_mega_moe(y, w13, w2, buf, activation_clamp=CLAMP, backend="reference")
        dx, dt, d13, d2 = torch.empty_like(x), torch.empty_like(w), torch.empty_like(w13), torch.empty_like(w2)
        bf16_mega_moe_backward(dx, d13, d2, dt, dy, w13, w2, buf, activation_clamp=CLAMP, state=state,
                               backend="reference")
        out["low_level"] = (y, dx, dt, d13, d2)
        out = {k: tuple(t.cpu() for t in v) for k, v in out.items()}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        end_rank(rank, outdir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_ep2_equals_ep1(device_type):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs for NCCL + symmetric memory (this machine has {torch.cuda.device_count()})")
    prob = _full_problem()
    if device_type == "cuda":
        prob = [t.cuda() for t in prob]
    ref = [t.cpu() for t in run_layer(*prob, backend="reference", activation_clamp=CLAMP)]
    world = 2
    with tempfile.TemporaryDirectory() as outdir:
        codes = spawn_ranks(_ep_worker, world, outdir, (device_type,), TIMEOUT_S)
        assert all(c == 0 for c in codes), codes
        outs = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
    El = E // world
    for key in ("autograd", "recompute", "low_level"):
        for r in range(world):
            lo = sum(TOKENS[:r])
            sl = slice(lo, lo + TOKENS[r])
            es = slice(r * El, (r + 1) * El)
            y, dx, dt, d13, d2 = outs[r][key]
            want = (ref[0][sl], ref[1][sl], ref[2][sl], ref[3][es], ref[4][es])
            for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), (y, dx, dt, d13, d2), want):
                if device_type == "cpu":
                    assert torch.equal(a, b), f"{key} rank {r} {name}: max diff {(a.double() - b.double()).abs().max()}"
                else:  # cuBLAS may pick other kernels for other shapes: equal up to fp32 reassociation
                    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                    assert err < 1e-3, f"{key} rank {r} {name}: rel err {err:.2e}"
