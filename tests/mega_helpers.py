"""Shared helpers of the prime_kernels.mega tests: random problems, an independent float64
per-token loop, and the relative error metric."""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.nn.functional as F


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (ref must not be all zeros)."""
    out = out.double()
    ref = ref.double()
    den = ref.norm().item()
    assert den > 0, "reference is all zeros: rel_err is undefined"
    return (out - ref).norm().item() / den


def random_route_to_pool(T: int, E: int, K: int, masked_frac: float, gen: torch.Generator) -> torch.Tensor:
    """A routing plan's route_to_pool [T, K] (int32) for random top-K experts of E per token, a share masked_frac
    of the routes masked (-1): every live route names its own pool row."""
    from prime_kernels.routing import routing_plan_reference

    idx = torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K]
    if masked_frac > 0:
        idx[torch.rand(T, K, generator=gen) < masked_frac] = -1
    return routing_plan_reference(idx, E, 1).route_to_pool.contiguous()


def make_problem(T, H, I, E, K, *, routing="uniform", seed=0, dtype=torch.bfloat16, masked_frac=0.0,
                 experts_used=None, device="cpu"):
    """Fresh random inputs (never zeros). routing: "uniform" (K distinct experts per token),
    "skewed" (most routes to a few experts, Zipf-like), "all_masked"."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    pool = E if experts_used is None else experts_used
    if routing == "skewed":
        pop = 1.0 / torch.arange(1, pool + 1, dtype=torch.float64) ** 1.5
        idx = torch.stack([torch.multinomial(pop, K, replacement=False, generator=g) for _ in range(T)])
        idx = torch.randperm(pool, generator=g)[idx]
    else:
        idx = torch.stack([torch.randperm(pool, generator=g)[:K] for _ in range(T)])
    if routing == "all_masked":
        idx[:] = -1
    elif masked_frac > 0:
        m = torch.rand(T, K, generator=g) < masked_frac
        idx[m] = -1
    w = torch.rand(T, K, generator=g) + 0.1
    w = (w / w.sum(1, keepdim=True)).to(torch.float64 if dtype == torch.float64 else torch.float32)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    dy = torch.randn(T, H, generator=g).to(dtype)
    t = [x, idx.long(), w, w13, w2, dy]
    return [v.to(device) for v in t]


# Routings every layer test runs: skewed and empty-expert routings, masked routes, T = 1 and an odd T that is not a
# multiple of any block (T = 0 is tested apart: no routing to draw).
ROUTING_CASES = {
    "uniform": dict(T=64, routing="uniform"),
    "skewed": dict(T=96, routing="skewed"),
    "empty_experts": dict(T=48, routing="uniform", experts_used=5),
    "masked_some": dict(T=40, routing="uniform", masked_frac=0.3),
    "T1": dict(T=1, routing="uniform"),
    "T_odd": dict(T=131, routing="skewed"),
}


def case_problem(case, H, I, E, K, seed_base):
    """make_problem for one of ROUTING_CASES, seeded by its name and ``seed_base``."""
    c = ROUTING_CASES[case]
    return make_problem(c["T"], H, I, E, K, routing=c["routing"], seed=sorted(ROUTING_CASES).index(case) + seed_base,
                        masked_frac=c.get("masked_frac", 0.0), experts_used=c.get("experts_used"))


def loop_reference(x, topk_idx, topk_weights, w13, w2, dy, clamp=None):
    """Independent float64 evaluation, one token and one route at a time, with no rounding.
    Returns (y, dx, dtopk, dw13, dw2) in float64 (gradients by torch autograd)."""
    x = x.detach().double().requires_grad_()
    w = topk_weights.detach().double().requires_grad_()
    a = w13.detach().double().requires_grad_()
    b = w2.detach().double().requires_grad_()
    T, K = topk_idx.shape
    I = a.shape[1] // 2
    rows = []
    for t in range(T):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(K):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            h = a[e] @ x[t]
            gte, up = h[:I], h[I:]
            if clamp is not None:
                gte = torch.clamp(gte, max=clamp)
                up = torch.clamp(up, min=-clamp, max=clamp)
            s = F.silu(gte) * up
            acc = acc + w[t, k] * (b[e] @ s)
        rows.append(acc)
    y = torch.stack(rows)
    (y * dy.double()).sum().backward()
    return y.detach(), x.grad, w.grad, a.grad, b.grad


def poison_free_memory() -> None:
    """Fill half of the free CUDA memory with NaN and release it, so that a buffer a kernel forgets to write shows."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info()
    block = torch.full((int(free * 0.5) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del block


# How far an FP8 layer's outputs and gradients may lie from the FP8-emulating reference (relative Frobenius error):
# four times the largest measured over the FP8 test matrix (1.3e-3); a wrong scale, operand or block is an error of
# order one.
FP8_EMULATION_BOUND = 5e-3

# The matrix tests' float64 references at T = 16384 were sized for the 141 GB H200.
SMALL_CARD_GIB = 100.0


@contextlib.contextmanager
def skip_if_out_of_memory_on_a_small_card():
    """Runs the body; a CUDA out-of-memory error skips the test, with the card's size in the reason, on a card of less
    than SMALL_CARD_GIB, and fails it on a larger one."""
    import pytest

    reason = None
    try:
        yield
    except torch.OutOfMemoryError as e:
        total_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        if total_gib >= SMALL_CARD_GIB:
            raise
        reason = (f"out of memory on this {total_gib:.0f} GiB card (the case needs a card of at least "
                  f"{SMALL_CARD_GIB:.0f} GiB): {str(e).splitlines()[0]}")
    if reason is not None:
        gc.collect()
        torch.cuda.empty_cache()
        pytest.skip(reason)


def autograd_run(problem, backend, precision, recompute=False, activation_clamp=None):
    """(y, [dx, dtopk, dw13, dw2]) of mega_moe through autograd on ``problem`` (make_problem's list), dy =
    problem[5]."""
    from prime_kernels.mega import mega_moe

    leaves = [t.clone().requires_grad_(i in (0, 2, 3, 4)) for i, t in enumerate(problem[:5])]
    y = mega_moe(*leaves, precision=precision, backend=backend, recompute=recompute,
                 num_experts=problem[3].shape[0], activation_clamp=activation_clamp)
    y.backward(problem[5])
    return y.detach(), [leaves[i].grad for i in (0, 2, 3, 4)]


def skip_unless_available(key: str) -> None:
    """Skip (with the status() reason) unless prime_kernels.status() reports kernel ``key`` available here."""
    import pytest

    from prime_kernels import _status

    why = _status.reason(key)
    if not _status.is_available(why):
        pytest.skip(f"{key}: {why}")


def run_layer(x, topk_idx, topk_weights, w13, w2, dy, **kwargs):
    """mega_moe forward + backward on leaf copies. Returns (y, dx, dtopk, dw13, dw2)."""
    from prime_kernels.mega import mega_moe

    xs = [t.detach().clone().requires_grad_() for t in (x, topk_weights, w13, w2)]
    y = mega_moe(xs[0], topk_idx, xs[1], xs[2], xs[3], **kwargs)
    y.backward(dy)
    return y.detach(), xs[0].grad, xs[1].grad, xs[2].grad, xs[3].grad


def auto_kernel_skip_reason() -> str | None:
    """None when backend="auto" resolves to one of our kernel paths (fused, else the grouped-GEMM
    pipeline) for both directions on this machine's GPU, never to the reference; else why not."""
    import torch

    from prime_kernels.mega import _backend

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none on this machine)"
    for direction in ("fwd", "bwd"):
        fused = _backend._fused_reason("bf16", direction)
        grouped = _backend._grouped_reason("bf16", 1)
        if fused is not None and grouped is not None:
            return f"backend='auto' has no kernel for bf16 {direction} here: {fused}; {grouped}"
    return None


def end_rank(rank: int, outdir: str) -> None:
    """The end of a spawned rank's work: every rank past its last collective (a barrier), then this rank marks itself
    done and tears the group down. gloo's teardown can abort a rank ("terminate called without an active exception",
    SIGABRT) when a peer that left first closes sockets its threads still read; :func:`spawn_ranks` counts a rank
    that aborted after marking itself done as done, and nothing else."""
    import os

    import torch.distributed as dist

    dist.barrier()
    open(os.path.join(outdir, f"rank{rank}.done"), "w").close()
    dist.destroy_process_group()


def spawn_ranks(target, world: int, outdir: str, args: tuple = (), timeout_s: float = 180.0) -> list[int]:
    """Run ``target(rank, world, port, outdir, *args)`` in ``world`` spawned processes (``port``: a free localhost
    port for their process group) and return their exit codes; a process still alive after ``timeout_s`` is killed
    and fails the test as a hang. A rank that aborted (SIGABRT) after :func:`end_rank` marked it done reads as 0."""
    import os
    import signal

    import socket

    import pytest
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, outdir, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if alive:
        pytest.fail(f"{len(alive)} of {world} ranks still running after {timeout_s} s: a hang")
    return [0 if (p.exitcode == -signal.SIGABRT and os.path.exists(os.path.join(outdir, f"rank{r}.done")))
            else p.exitcode for r, p in enumerate(procs)]
