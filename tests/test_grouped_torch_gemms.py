"""The grouped pipeline on torch's grouped GEMM (prime_kernels.grouped_gemm_torch, for GPUs without our sm90
kernels), forced on a machine that has them: each GEMM against ours (a few ulps apart where the rounding points are
the same and only the sums' order differs; within bf16 rounding where torch's GEMM rounds da or a weight gradient
that ours keep in fp32), and the layer's forward and backward through the grouped backend against the float64 loop,
deterministic, on one rank and over a loopback group. On a GPU where they are selected without forcing (Blackwell:
prime_kernels.grouped_gemm_torch.selected), the layer runs against the float64 loop alone."""

from __future__ import annotations

import pytest
import torch

from mega_helpers import loop_reference, make_problem, rel_err

E, H, I, K = 8, 128, 128, 2
# against the float64 loop, measured on the CPU (torch's CPU grouped GEMM, 37 tokens, uniform and skewed): y 3.9e-3,
# dx 3.9e-3, dtopk 3.3e-3, dw13 3.5e-3, dw2 3.6e-3, where the CPU ops of our kernels' path give 2.4e-3 to 3.9e-3
BOUND = 1e-2


def _devices():
    return ["cpu", "cuda"]


def _ours_run(device) -> bool:
    """Whether our GEMMs run on ``device`` without forcing (else torch's are selected there)."""
    from prime_kernels.grouped_gemm_torch import selected

    return not selected(torch.device(device))


def _skip_unless(device, need_ours=True):
    """Skip unless torch's grouped GEMM runs on ``device`` and, with ``need_ours``, so do ours (to compare against);
    without, a GPU where torch's are selected (the Blackwell pipeline's status entry available) runs too."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (the CPU variant runs the same code on torch's CPU grouped GEMM)")
        from prime_kernels import _status

        key = "mega_moe_grouped.bf16.sm90" if need_ours or _ours_run(device) else "mega_moe_grouped.bf16.sm100"
        why = _status.reason(key)
        if not _status.is_available(why):
            pytest.skip(f"{key}: {why}")
    try:
        x = torch.zeros(16, 16, dtype=torch.bfloat16, device=device)
        torch._grouped_mm(x, torch.zeros(1, 16, 16, dtype=torch.bfloat16, device=device),
                          offs=torch.tensor([16], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch {torch.__version__}'s grouped GEMM does not run on {device}: {e}")


def _operands(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = [40, 0, 128, 7]  # an empty group, a full block, a ragged one
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // 128) * 128 if c else offsets[-1])
    rows = offsets[-1]
    src = torch.full((rows,), -1, dtype=torch.int32)
    route = 0
    for e, c in enumerate(counts):
        src[offsets[e]:offsets[e] + c] = torch.arange(route, route + c, dtype=torch.int32)
        route += c
    a = torch.randn(rows, H, generator=g).bfloat16()
    a[src < 0] = 0  # a pool's padding rows are zero
    w13 = (torch.randn(len(counts), 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(len(counts), H, I, generator=g) / I ** 0.5).bfloat16()
    weights = torch.rand(route, generator=g)
    offs = torch.tensor(offsets, dtype=torch.int32)
    return [t.to(device) for t in (a, w13, w2, offs, src, weights)]


@pytest.mark.parametrize("device", _devices())
def test_each_gemm_against_ours(device):
    _skip_unless(device)
    from prime_kernels import grouped_gemm as gg
    from prime_kernels.grouped_gemm_torch import forced

    a, w13, w2, offs, src, weights = _operands(device)
    used = src >= 0
    ours_s, ours_h = gg.m_grouped_bf16_gemm_swiglu(a, w13, offs, save_h=True)
    ours_o = gg.m_grouped_bf16_gemm_nt(ours_s, w2, offs)
    dy = torch.randn(a.shape[0], H, device=device).bfloat16().masked_fill_(~used[:, None], 0)
    ours_dh, ours_aw, ours_dt = gg.m_grouped_bf16_gemm_swiglu_bwd(dy, w2, offs, ours_h, src, weights)
    ours_dx = gg.m_grouped_bf16_gemm_nn(ours_dh, w13, offs)
    ours_w2 = gg.k_grouped_bf16_gemm_tn(dy, ours_aw, offs)
    with forced():
        s, h = gg.m_grouped_bf16_gemm_swiglu(a, w13, offs, save_h=True)
        o = gg.m_grouped_bf16_gemm_nt(ours_s, w2, offs)
        dh, aw, dt = gg.m_grouped_bf16_gemm_swiglu_bwd(dy, w2, offs, ours_h, src, weights)
        dx = gg.m_grouped_bf16_gemm_nn(ours_dh, w13, offs)
        dw2 = gg.k_grouped_bf16_gemm_tn(dy, ours_aw, offs)
        acc = torch.ones_like(ours_w2)
        gg.k_grouped_bf16_gemm_tn(dy, ours_aw, offs, accumulate_into=acc)
        with pytest.raises(ValueError, match="no clamp"):
            gg.m_grouped_bf16_gemm_swiglu(a, w13, offs, save_h=True, clamp=0.5)
    # the same rounding points as ours, the GEMMs' sums in another order: one bf16 ulp here and there
    errs = {name: rel_err(mine[used], theirs[used]) for name, mine, theirs in
            (("h", h, ours_h), ("s", s, ours_s), ("o", o, ours_o), ("dx", dx, ours_dx))}
    # and torch's GEMM rounds da and the weight gradient to bf16, which ours keep in fp32
    errs.update(dh=rel_err(dh[used], ours_dh[used]), dt=rel_err(dt.sum(1)[used], ours_dt.sum(1)[used]),
                dw2=rel_err(dw2, ours_w2), acc=rel_err(acc - 1, ours_w2))
    print(device, {k: f"{v:.1e}" for k, v in errs.items()})
    # measured on the CPU: h 4.6e-6, s 5.4e-6, o 8.6e-5, dx 3.1e-9; dh 2.9e-3, dt 1.8e-3, dw2 1.7e-3
    assert all(errs[k] < 1e-3 for k in ("h", "s", "o", "dx")), errs
    assert all(errs[k] < 1e-2 for k in ("dh", "dt", "dw2", "acc")), errs
    assert torch.equal(aw[used], ours_aw[used])  # w * s does not depend on da
    assert torch.equal(dw2.float(), dw2) and dw2.dtype == torch.float32


def _layer(x, idx, w, w13, w2, dy, *, group=None, num_experts=E, tmax=None):
    from prime_kernels.mega import _backend, _comm

    ep = _comm.world_size(group)
    y, h, counts, offsets, src, srank, r2p, _ = _backend.forward(
        "grouped", x, idx, w, w13, w2, precision="bf16", activation_clamp=None, group=group, num_experts=num_experts,
        ep_size=ep, max_tokens_per_rank=tmax, block_m=128, save_h=True)
    dx, dtopk, dw13, dw2 = _backend.backward(
        "grouped", dy, x, idx, w, w13, w2, h, counts, offsets, src, srank, r2p, precision="bf16",
        activation_clamp=None, group=group, num_experts=num_experts, recompute=False, need_wgrad=True)
    return y, dx, dtopk, dw13, dw2


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("device", _devices())
def test_layer_against_float64(routing, device):
    _skip_unless(device, need_ours=False)
    from prime_kernels.grouped_gemm_torch import forced

    x, idx, w, w13, w2, dy = make_problem(37, H, I, E, K, routing=routing, seed=5, masked_frac=0.1)
    ref = loop_reference(x, idx, w, w13, w2, dy)
    prob = [t.to(device) for t in (x, idx, w, w13, w2, dy)]
    ours = _layer(*prob) if _ours_run(device) else (None,) * len(ref)
    with forced():
        got = _layer(*prob)
        again = _layer(*prob)
    errs = {}
    for name, a, b, mine, r in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, again, ours, ref):
        assert torch.equal(a, b), f"{name} not deterministic"
        errs[name] = (rel_err(a.cpu(), r), float("nan") if mine is None else rel_err(mine.cpu(), r))
    print(device, routing, {k: f"{v[0]:.1e} (ours {v[1]:.1e})" for k, v in errs.items()})
    assert all(v[0] < BOUND for v in errs.values()), errs


def test_layer_over_loopback_against_one_rank():
    """Expert parallelism on the same GEMMs: a 2-rank loopback group (CPU) against the one-rank call. Not bit for
    bit: torch's CPU grouped GEMM rounds a row differently with the size of the group it is in (a rank's pool holds
    fewer rows per expert), so within bf16 rounding; the forward's y is the same."""
    _skip_unless("cpu")
    from prime_kernels.grouped_gemm_torch import forced
    from prime_kernels.mega import LoopbackGroup

    world, tokens = 2, (9, 6)
    El = E // world
    x, idx, w, w13, w2, dy = make_problem(sum(tokens), H, I, E, K, routing="skewed", seed=8)
    group = LoopbackGroup(world)

    def rank_fn(r):
        lo = sum(tokens[:r])
        sl = slice(lo, lo + tokens[r])
        return _layer(x[sl], idx[sl], w[sl], w13[r * El:(r + 1) * El], w2[r * El:(r + 1) * El], dy[sl], group=group,
                      tmax=max(tokens))

    with forced():
        want = _layer(x, idx, w, w13, w2, dy)
        outs = group.run(rank_fn)
    for r in range(world):
        lo = sum(tokens[:r])
        sl, es = slice(lo, lo + tokens[r]), slice(r * El, (r + 1) * El)
        for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), outs[r],
                              (want[0][sl], want[1][sl], want[2][sl], want[3][es], want[4][es])):
            err = rel_err(a, b)
            assert err < 8e-3, f"rank {r} {name}: {err:.2e}"  # measured up to 4.1e-3 (dx)
