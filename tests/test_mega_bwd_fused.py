"""The fused backward kernel (op prime_kernels::mega_moe_bwd_fused) against the grouped backward's own steps on the
same inputs, and its host-side checks: prime_kernels.mega._fused_bwd.dgrad (the kernel without its weight-gradient
tiles), dgrad_wgrad (with them) and backward (the layer's backward on it).

GPU tests build the grouped pipeline's real backward state (its forward's plan and saved h, the dy and x rows
gathered into the pool as its backward gathers them) and run both the fused kernel and the pipeline's steps
(m_grouped_bf16_gemm_swiglu_bwd, m_grouped_bf16_gemm_nn(dh, w13), the two k-grouped GEMMs) on it. They skip, with
the reason, where the kernel cannot run (no sm_90 GPU, or a build without it). The CPU tests need no GPU."""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from prime_kernels import _status
from prime_kernels.grouped_gemm import (k_grouped_bf16_gemm_tn, m_grouped_bf16_gemm_nn, m_grouped_bf16_gemm_swiglu_bwd,
                                        m_grouped_gemm_reference)
from prime_kernels.mega import _backend, _fused_bwd, _grouped
from mega_helpers import make_problem, rel_err
from test_grouped_gemm import _swiglu_bwd_ref64

KEY = _fused_bwd.STATUS_KEY
_WHY = _status.runnable(KEY)
requires_dgrad = pytest.mark.skipif(_WHY != _status.AVAILABLE, reason=f"{KEY} cannot run here: {_WHY}")


def _state(T, H, I, E, K, routing="uniform", masked=0.0, used=None, seed=0):
    """The grouped backward's inputs to its L2-dgrad and L1-dgrad steps, from its own forward on fresh random
    inputs: (dy_pool, w13, w2, h, offsets, pool_src_route, topk_weights)."""
    x, idx, w, w13, w2, dy = [t.cuda() for t in make_problem(T, H, I, E, K, routing=routing, seed=seed,
                                                             masked_frac=masked, experts_used=used)]
    cap = _backend.capacity(T, K, E, 1, None, 128)
    _y, h, counts, offsets, src, _srank, r2p = _grouped.forward(x, idx, w, w13, w2, num_experts=E, block_m=128,
                                                                 capacity=cap, save_h=True)
    dy_pool = _grouped._gathered_pool(_grouped._rows_for_kernels(dy), r2p.contiguous(), counts, offsets, cap)
    return dy_pool, w13, w2, h, offsets, src, w.float().contiguous()


def _poison(*shapes_dtypes):
    """NaN-filled blocks of the outputs' sizes, freed into the caching allocator: the op's outputs of those sizes
    reuse them, so an element the kernel does not write reads as NaN (not as a stale value)."""
    blocks = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del blocks


def _fused(dy_pool, w13, w2, h, offsets, src, wts, **kw):
    M, H = dy_pool.shape
    I = w2.shape[2]
    _poison(((M, 2 * I), torch.bfloat16), ((M, I), torch.bfloat16), ((M, (I + 127) // 128), torch.float32),
            ((M, H), torch.bfloat16))
    return _fused_bwd.dgrad(dy_pool, w13, w2, h, offsets, src, wts, **kw)


def _pipeline(dy_pool, w13, w2, h, offsets, src, wts):
    dh, aw, dt_part = m_grouped_bf16_gemm_swiglu_bwd(dy_pool, w2, offsets, h, src, wts)
    return dh, aw, dt_part, m_grouped_bf16_gemm_nn(dh, w13, offsets)


CASES = [  # T, H, I, E, K, routing, masked, experts_used
    (1, 256, 128, 8, 2, "uniform", 0.0, None),
    (257, 1024, 384, 32, 8, "uniform", 0.0, None),      # the 30B shape (H 2048, I 768, E 128, K 8) scaled down
    (301, 512, 192, 16, 4, "skewed", 0.25, None),       # I % 128 == 64: a half-width last L2-dgrad tile; -1 routes
    (1500, 256, 256, 4, 2, "uniform", 0.0, None),       # ~6 m-blocks per expert
    (999, 384, 128, 64, 8, "uniform", 0.1, 16),         # 48 experts get no rows; H % 256 == 128: a last L1-dgrad
                                                        # column block half past H
    (700, 320, 128, 8, 4, "uniform", 0.0, None),        # H % 128 == 64: one 64-column box of the last block
    (2048, 256, 256, 16, 4, "skewed", 0.0, None),       # one expert with many m-blocks (bands of 16)
    (300, 256, 128, 16, 4, "all_masked", 0.0, None),    # every route masked: a pool of padding, no tasks
]


@requires_dgrad
@pytest.mark.parametrize("T,H,I,E,K,routing,masked,used", CASES)
def test_dgrad_matches_the_pipeline_steps(T, H, I, E, K, routing, masked, used):
    st = _state(T, H, I, E, K, routing, masked, used, seed=T + H + I + E)
    dy_pool, w13, w2, h, offsets, src, wts = st
    # the fused kernel first: an output it leaves unwritten is NaN, never the pipeline's values left in freed memory
    dh, aw, dt_part, dx = _fused(*st)
    want = _pipeline(*st)
    rows = int(offsets[-1])  # rows of the experts; dh, w * s and dx rows after them are unspecified in both
    # Bitwise where the arithmetic is the same: the L2-dgrad tiles are the ping-pong kernel's (same 128 x 128 tiles,
    # same 64-wide k-blocks in increasing order, same SwiGLU-backward epilogue code, SwigluBwdTileEpilogue), and the
    # L1-dgrad tiles read the same dh and accumulate the same k16 wgmma steps in the same k order into fp32 as the
    # nn GEMM, rounded to bf16 once. (The nn GEMM may use 256-column tiles; this also checks that a wgmma's N does not
    # change a column's sums. If dx alone differs while its float64 bound below holds, that assumption is what broke.)
    for name, got, ref in (("dh", dh, want[0]), ("w*s", aw, want[1]), ("dx", dx, want[3])):
        assert got.shape == ref.shape, name
        assert torch.isfinite(got[:rows]).all(), f"{name}: rows left unwritten or non-finite"
        assert torch.equal(got[:rows], ref[:rows]), f"{name}: differs from the pipeline"
    assert torch.equal(dt_part, want[2]), "dt_part"  # rows after the experts are zeros in both
    if rows == 0:
        assert torch.count_nonzero(dt_part) == 0
        return
    # float64 bounds, independent of the pipeline: dh, w * s and d topk_weights from the inputs, dx from this dh
    cpu = [t.cpu() for t in (dy_pool, w2, offsets, h, src, wts)]
    dh64, aw64, dt64 = _swiglu_bwd_ref64(cpu[0][:rows], cpu[1], cpu[2], cpu[3], cpu[4], cpu[5], None)
    dx64 = m_grouped_gemm_reference(dh[:rows].cpu().double(), w13.cpu().double(), cpu[2], False, torch.float64)
    for name, got, ref in (("dh", dh[:rows], dh64), ("w*s", aw[:rows], aw64), ("dt", dt_part[:rows].sum(1), dt64),
                           ("dx", dx[:rows], dx64)):
        err = rel_err(got.cpu(), ref)
        assert err < 1e-2, f"{name}: rel err {err:.3e} against float64"


@requires_dgrad
def test_dgrad_is_bitwise_repeatable_and_independent_of_num_sms():
    """Two repeats, and 3 CTAs against every SM: with 3 CTAs most L1-dgrad tiles are claimed while their m-block's
    L2-dgrad tiles are still running or not yet claimed, so the waits and the claim order carry the progress."""
    st = _state(2048, 512, 256, 16, 4, "skewed", 0.05, seed=11)
    runs = [_fused(*st), _fused(*st), _fused(*st, num_sms=3), _fused(*st, num_sms=1)]
    rows = int(st[4][-1])
    for i, r in enumerate(runs[1:], 1):
        for name, a, b in zip(("dh", "w*s", "dt_part", "dx"), runs[0], r):
            assert torch.equal(a[:rows], b[:rows]), f"run {i}: {name}"


@requires_dgrad
def test_dgrad_with_no_pool_rows_returns_empty_tensors():
    H, I, E, K = 256, 128, 4, 2
    dev = "cuda"
    out = _fused_bwd.dgrad(torch.empty(0, H, dtype=torch.bfloat16, device=dev),
                           torch.randn(E, 2 * I, H, device=dev).bfloat16(), torch.randn(E, H, I, device=dev).bfloat16(),
                           torch.empty(0, 2 * I, dtype=torch.bfloat16, device=dev),
                           torch.zeros(E + 1, dtype=torch.int32, device=dev),
                           torch.empty(0, dtype=torch.int32, device=dev),
                           torch.empty(0, K, device=dev))
    assert [tuple(t.shape) for t in out] == [(0, 2 * I), (0, I), (0, 1), (0, H)]


@requires_dgrad
def test_dgrad_reports_an_invalid_offset_on_the_device():
    st = list(_state(64, 256, 128, 4, 2, seed=3))
    bad = st[4].clone()
    bad[2] = bad[1] - 1  # decreasing offsets: the kernel writes nothing and notes the finding
    st[4] = bad
    _fused_bwd.dgrad(*st)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="offsets"):
        prime_kernels.check_device_errors()


# ------------------------------------------------------------------- the weight-gradient tiles and the layer


def _layer_state(T, H, I, E, K, routing="uniform", masked=0.0, used=None, seed=0, clamp=None, fused_fwd=False):
    """The inputs, the forward's plan and saved h (the grouped forward's, or with ``fused_fwd`` the fused one's,
    which a clamp needs), and the dy and x rows gathered into the pool as the grouped backward gathers them."""
    x, idx, w, w13, w2, dy = [t.cuda() for t in make_problem(T, H, I, E, K, routing=routing, seed=seed,
                                                             masked_frac=masked, experts_used=used)]
    cap = _backend.capacity(T, K, E, 1, None, 128)
    if fused_fwd:
        from prime_kernels.mega import _fused

        fwd = _fused.forward(x, idx, w, w13, w2, num_experts=E, block_m=128, capacity=cap, save_h=True,
                             activation_clamp=clamp)[:7]
    else:
        fwd = _grouped.forward(x, idx, w, w13, w2, num_experts=E, block_m=128, capacity=cap, save_h=True)
    _y, h, counts, offsets, src, srank, r2p = fwd
    r2p = r2p.contiguous()
    pool = lambda rows: _grouped._gathered_pool(_grouped._rows_for_kernels(rows), r2p, counts, offsets, cap)
    return dict(x=x, idx=idx, w=w, w13=w13, w2=w2, dy=dy, h=h, counts=counts, offsets=offsets, src=src, srank=srank,
                r2p=r2p, dy_pool=pool(dy), x_pool=pool(x), wts=w.float().contiguous(), E=E)


def _wgrad64(a, b, offsets):
    """a_e^T b_e per expert in float64 (CPU)."""
    a, b, off = a.cpu().double(), b.cpu().double(), offsets.tolist()
    return torch.stack([a[off[e]:off[e + 1]].t() @ b[off[e]:off[e + 1]] for e in range(len(off) - 1)])


@requires_dgrad
@pytest.mark.parametrize("T,H,I,E,K,routing,masked,used", CASES)
def test_wgrad_tiles_match_the_k_grouped_gemms(T, H, I, E, K, routing, masked, used):
    """dW13 and dW2 from the kernel's weight-gradient tiles, in bf16, fp32 and added to fp32 accumulators, against
    the pipeline's k-grouped GEMMs on the pipeline's own dh and w * s: bitwise (the same 64-row k-blocks of each
    expert in increasing order, the same k16 wgmma steps into fp32, one rounding), and against float64. The dgrad
    outputs stay the pipeline's bits with the weight-gradient tiles in the sequence."""
    st = _layer_state(T, H, I, E, K, routing, masked, used, seed=T + H + I + E + 1)
    args = (st["dy_pool"], st["x_pool"], st["w13"], st["w2"], st["h"], st["offsets"], st["src"], st["wts"])
    dh_ref, aw_ref, dt_ref = m_grouped_bf16_gemm_swiglu_bwd(st["dy_pool"], st["w2"], st["offsets"], st["h"],
                                                            st["src"], st["wts"])
    dx_ref = m_grouped_bf16_gemm_nn(dh_ref, st["w13"], st["offsets"])
    rows = int(st["offsets"][-1])
    for dt in (torch.bfloat16, torch.float32):
        _poison(((E, 2 * I, H), dt), ((E, H, I), dt))
        dh, aw, dt_part, dx, dw13, dw2 = _fused_bwd.dgrad_wgrad(*args, wgrad_dtype=dt)
        for name, got, ref in (("dh", dh, dh_ref), ("w*s", aw, aw_ref), ("dx", dx, dx_ref)):
            assert torch.equal(got[:rows], ref[:rows]), f"{name} ({dt}): differs from the pipeline"
        assert torch.equal(dt_part, dt_ref)
        want13 = k_grouped_bf16_gemm_tn(dh_ref, st["x_pool"], st["offsets"], out_dtype=dt)
        want2 = k_grouped_bf16_gemm_tn(st["dy_pool"], aw_ref, st["offsets"], out_dtype=dt)
        assert dw13.dtype == dt and dw2.dtype == dt
        assert torch.isfinite(dw13).all() and torch.isfinite(dw2).all(), "a gradient element left unwritten"
        assert torch.equal(dw13, want13), f"dW13 ({dt}): differs from the k-grouped GEMM"
        assert torch.equal(dw2, want2), f"dW2 ({dt}): differs from the k-grouped GEMM"
    # added to caller-given fp32 accumulators: the same sums added to what they held
    g = torch.Generator(device="cuda").manual_seed(5)
    acc13 = torch.randn(E, 2 * I, H, device="cuda", generator=g)
    acc2 = torch.randn(E, H, I, device="cuda", generator=g)
    want13 = k_grouped_bf16_gemm_tn(dh_ref, st["x_pool"], st["offsets"], accumulate_into=acc13.clone())
    want2 = k_grouped_bf16_gemm_tn(st["dy_pool"], aw_ref, st["offsets"], accumulate_into=acc2.clone())
    out = _fused_bwd.dgrad_wgrad(*args, dw13_accum=acc13, dw2_accum=acc2)
    assert out[4].numel() == 0 and out[5].numel() == 0
    assert torch.equal(acc13, want13) and torch.equal(acc2, want2), "accumulated weight gradients"
    # float64, from the pipeline's dh and w * s (their own bounds are the dgrad test's)
    for name, got, ref in (("dW13", _fused_bwd.dgrad_wgrad(*args, wgrad_dtype=torch.float32)[4],
                            _wgrad64(dh_ref, st["x_pool"], st["offsets"])),
                           ("dW2", _fused_bwd.dgrad_wgrad(*args, wgrad_dtype=torch.float32)[5],
                            _wgrad64(st["dy_pool"], aw_ref, st["offsets"]))):
        if ref.abs().max() == 0:  # no rows anywhere (all masked): zeros
            assert torch.count_nonzero(got) == 0, name
            continue
        err = rel_err(got.cpu(), ref)
        assert err < 1e-2, f"{name}: rel err {err:.3e} against float64"


@requires_dgrad
def test_wgrad_tiles_are_bitwise_repeatable_and_independent_of_num_sms():
    """With 1 and 3 CTAs the weight-gradient tiles wait for their experts' L2-dgrad tiles claimed by the same few
    CTAs; the results do not depend on which CTA ran a tile, nor on the sequence's lag (0: an expert's waiting tiles
    right behind its L2-dgrad tiles; 64: all L2-dgrad tiles first)."""
    st = _layer_state(2048, 512, 256, 16, 4, "skewed", 0.05, seed=12)
    args = (st["dy_pool"], st["x_pool"], st["w13"], st["w2"], st["h"], st["offsets"], st["src"], st["wts"])
    runs = [_fused_bwd.dgrad_wgrad(*args), _fused_bwd.dgrad_wgrad(*args),
            _fused_bwd.dgrad_wgrad(*args, num_sms=3), _fused_bwd.dgrad_wgrad(*args, num_sms=1),
            _fused_bwd.dgrad_wgrad(*args, lag=0), _fused_bwd.dgrad_wgrad(*args, lag=64, num_sms=5)]
    rows = int(st["offsets"][-1])
    for i, r in enumerate(runs[1:], 1):
        for name, a, b in zip(("dh", "w*s", "dt_part", "dx", "dw13", "dw2"), runs[0], r):
            n = rows if name in ("dh", "w*s", "dx") else a.shape[0]
            assert torch.equal(a[:n], b[:n]), f"run {i}: {name}"


@requires_dgrad
def test_wgrad_with_no_pool_rows_gives_zeros_or_adds_nothing():
    H, I, E, K = 256, 128, 4, 2
    dev = "cuda"
    empty = dict(dy_pool=torch.empty(0, H, dtype=torch.bfloat16, device=dev),
                 x_pool=torch.empty(0, H, dtype=torch.bfloat16, device=dev),
                 w13=torch.randn(E, 2 * I, H, device=dev).bfloat16(), w2=torch.randn(E, H, I, device=dev).bfloat16(),
                 h=torch.empty(0, 2 * I, dtype=torch.bfloat16, device=dev),
                 expert_offsets=torch.zeros(E + 1, dtype=torch.int32, device=dev),
                 pool_src_route=torch.empty(0, dtype=torch.int32, device=dev), topk_weights=torch.empty(0, K, device=dev))
    out = _fused_bwd.dgrad_wgrad(**empty, wgrad_dtype=torch.float32)
    assert out[4].shape == (E, 2 * I, H) and out[5].shape == (E, H, I)
    assert torch.count_nonzero(out[4]) == 0 and torch.count_nonzero(out[5]) == 0
    acc13, acc2 = torch.ones(E, 2 * I, H, device=dev), torch.ones(E, H, I, device=dev)
    _fused_bwd.dgrad_wgrad(**empty, dw13_accum=acc13, dw2_accum=acc2)
    assert bool((acc13 == 1).all()) and bool((acc2 == 1).all())


@requires_dgrad
def test_the_op_passes_opcheck():
    """torch.library.opcheck on the op with and without weight-gradient tiles and with the accumulators (schema,
    the declared mutations only, the fake kernel's shapes, no aliasing of outputs and inputs). The pool is cut at the
    last expert's end: the op never writes the rows past it, which opcheck would compare between two runs."""
    st = _layer_state(257, 256, 128, 8, 4, seed=71)
    rows = int(st["offsets"][-1])
    cut = {k: st[k][:rows].contiguous() for k in ("dy_pool", "h", "src", "x_pool")}
    base = (cut["dy_pool"], st["w2"], st["w13"], st["offsets"], cut["h"], cut["src"], st["wts"].reshape(-1), 0.0)
    E, I, H = st["E"], 128, 256
    op = torch.ops.prime_kernels.mega_moe_bwd_fused.default
    torch.library.opcheck(op, base)
    torch.library.opcheck(op, base + (cut["x_pool"], True))
    torch.library.opcheck(op, base + (cut["x_pool"], False, torch.zeros(E, 2 * I, H, device="cuda"),
                                      torch.zeros(E, H, I, device="cuda")))


LAYER_CASES = [  # T, H, I, E, K, routing, masked, used
    (1, 256, 128, 8, 2, "uniform", 0.0, None),
    (257, 1024, 384, 32, 8, "uniform", 0.0, None),
    (301, 512, 192, 16, 4, "skewed", 0.25, None),
    (999, 384, 128, 64, 8, "uniform", 0.1, 16),
    (300, 256, 128, 16, 4, "all_masked", 0.0, None),
]


def _backward_args(st):
    return (st["dy"], st["x"], st["idx"], st["w"], st["w13"], st["w2"], st["h"], st["counts"], st["offsets"],
            st["src"], st["srank"], st["r2p"])


@requires_dgrad
@pytest.mark.parametrize("T,H,I,E,K,routing,masked,used", LAYER_CASES)
@pytest.mark.parametrize("mode", ["plain", "recompute", "accum", "accum_dw13", "accum_dw2", "no_wgrad"])
def test_layer_backward_equals_the_grouped_backward(T, H, I, E, K, routing, masked, used, mode):
    """_fused_bwd.backward (the layer's "fused" backward) against _grouped.backward on the same forward state: dX,
    d topk_weights, dW13 and dW2 bitwise, with recompute, with fp32 accumulators (both, or either alone), and
    without weight gradients. NaN-poisoned free memory before the fused run."""
    st = _layer_state(T, H, I, E, K, routing, masked, used, seed=3 * T + E)
    kw = dict(num_experts=E, recompute=mode == "recompute", need_wgrad=mode != "no_wgrad")
    acc = {}
    if mode in ("accum", "accum_dw13"):
        acc["dw13_accum"] = torch.randn(E, 2 * I, H, device="cuda")
    if mode in ("accum", "accum_dw2"):
        acc["dw2_accum"] = torch.randn(E, H, I, device="cuda")
    acc_ref = {k: v.clone() for k, v in acc.items()}
    _poison(((T, H), torch.bfloat16), ((E, 2 * I, H), torch.bfloat16), ((E, H, I), torch.bfloat16))
    got = _fused_bwd.backward(*_backward_args(st), **kw, **acc)
    want = _grouped.backward(*_backward_args(st), **kw, **acc_ref)
    for name, a, b in zip(("dx", "dtopk", "dw13", "dw2"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), f"{name} ({mode}): differs from the grouped backward"
    for k in acc:
        assert torch.equal(acc[k], acc_ref[k]), f"{k} ({mode})"


@requires_dgrad
@pytest.mark.parametrize("clamp", [1.0, 7.0])
@pytest.mark.parametrize("recompute", [False, True])
def test_layer_backward_with_a_clamp_against_float64(clamp, recompute):
    """A clamped layer (the fused forward's h keeps the clamp masks): the fused backward, recomputing h through the
    fused forward kernel when asked, against the reference backend's float64 backward on the same inputs."""
    from prime_kernels.mega import reference

    T, H, I, E, K = 301, 512, 192, 16, 4
    st = _layer_state(T, H, I, E, K, "skewed", 0.1, seed=41, clamp=clamp, fused_fwd=True)
    got = _fused_bwd.backward(*_backward_args(st), num_experts=E, recompute=recompute, activation_clamp=clamp)
    d = {k: st[k].double() for k in ("dy", "x", "w", "w13", "w2")}
    want = reference.backward(d["dy"], d["x"], st["idx"], d["w"], d["w13"], d["w2"], st["h"].double(), st["counts"],
                              st["offsets"], st["src"], st["srank"], st["r2p"], num_experts=E, recompute=recompute,
                              activation_clamp=clamp)
    for name, a, b in zip(("dx", "dtopk", "dw13", "dw2"), got, want):
        err = rel_err(a.double().cpu(), b.cpu())
        assert err < 1e-2, f"{name}: rel err {err:.3e} against float64 (clamp {clamp}, recompute {recompute})"


# --------------------------------------------------------------------------------------------- CPU


def _cpu_inputs(M=40, H=128, I=192, E=3, K=2):
    g = torch.Generator().manual_seed(0)
    return dict(dy_pool=torch.randn(M, H, generator=g).bfloat16(),
                w13=torch.randn(E, 2 * I, H, generator=g).bfloat16(), w2=torch.randn(E, H, I, generator=g).bfloat16(),
                h=torch.randn(M, 2 * I, generator=g).bfloat16(),
                expert_offsets=torch.tensor([0, 16, 16, M], dtype=torch.int32)[: E + 1],
                pool_src_route=torch.arange(M, dtype=torch.int32) % (M // 2 * K) - 1,
                topk_weights=torch.rand(M // 2, K, generator=g))


def _with(**changes):
    args = _cpu_inputs()
    args.update(changes)
    return args


BAD = [  # (what changes, exception, message fragment)
    (lambda a: dict(dy_pool=a["dy_pool"].float()), TypeError, "dy_pool must be torch.bfloat16"),
    (lambda a: dict(w13=a["w13"].half()), TypeError, "w13 must be torch.bfloat16"),
    (lambda a: dict(h=a["h"].float()), TypeError, "h must be torch.bfloat16"),
    (lambda a: dict(expert_offsets=a["expert_offsets"].long()), TypeError, "expert_offsets must be torch.int32"),
    (lambda a: dict(pool_src_route=a["pool_src_route"].long()), TypeError, "pool_src_route must be torch.int32"),
    (lambda a: dict(topk_weights=a["topk_weights"].double()), TypeError, "topk_weights must be torch.float32"),
    (lambda a: dict(dy_pool=a["dy_pool"].tolist()), TypeError, "dy_pool must be a torch.Tensor"),
    (lambda a: dict(dy_pool=a["dy_pool"][None]), ValueError, "dy_pool must be 2-D"),
    (lambda a: dict(w13=a["w13"][:, :, :64].contiguous()), ValueError, "w13 must be [E, 2I, H]"),
    (lambda a: dict(w2=a["w2"][:2]), ValueError, "w2 must be [E, H, I]"),
    (lambda a: dict(w13=a["w13"][:, :320].contiguous(), w2=a["w2"][..., :160].contiguous()), ValueError,
     "I = 160 must be a positive multiple"),
    (lambda a: dict(dy_pool=a["dy_pool"][:, :96].contiguous(), w13=a["w13"][..., :96].contiguous(),
                    w2=a["w2"][:, :96].contiguous()), ValueError,
     "H = 96 must be a positive multiple"),
    (lambda a: dict(expert_offsets=a["expert_offsets"][:3]), ValueError, "expert_offsets must be [E + 1]"),
    (lambda a: dict(h=a["h"][:10]), ValueError, "h must be [>= 40 pool rows"),
    (lambda a: dict(h=a["h"][:, :256].contiguous()), ValueError, "h must be [>= 40 pool rows, 2I = 384]"),
    (lambda a: dict(pool_src_route=a["pool_src_route"][:39]), ValueError, "pool_src_route must have >= 40"),
    (lambda a: dict(dy_pool=a["dy_pool"].t().contiguous().t()), ValueError, "dy_pool must be contiguous"),
    (lambda a: dict(w2=a["w2"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "w2 must be contiguous"),
    (lambda a: dict(dy_pool=a["dy_pool"].view(-1)[4:4 + 39 * 128].view(39, 128), h=a["h"][:39],
                    pool_src_route=a["pool_src_route"][:39]), ValueError, "dy_pool must start 16-byte aligned"),
    (lambda a: dict(h=a["h"].to("meta")), ValueError, "every tensor must be on one device"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_dgrad_host_checks_raise_before_any_launch(case):
    change, exc, fragment = BAD[case]
    args = _with(**change(_cpu_inputs()))
    with pytest.raises(exc, match="prime_kernels.mega._fused_bwd: ") as info:
        _fused_bwd.dgrad(**args)
    assert fragment in str(info.value)


@pytest.mark.parametrize("opt,exc,fragment", [(dict(activation_clamp=0.0), ValueError, "activation_clamp"),
                                              (dict(activation_clamp=True), TypeError, "activation_clamp"),
                                              (dict(activation_clamp=float("inf")), ValueError, "activation_clamp"),
                                              (dict(num_sms=0), ValueError, "num_sms"),
                                              (dict(num_sms=True), ValueError, "num_sms")])
def test_dgrad_option_checks(opt, exc, fragment):
    with pytest.raises(exc, match=fragment):
        _fused_bwd.dgrad(**_cpu_inputs(), **opt)


def test_dgrad_too_many_experts_is_refused():
    E = _fused_bwd.MAX_EXPERTS + 1
    meta = dict(device="meta")
    with pytest.raises(ValueError, match=f"E = {E} experts"):
        _fused_bwd.dgrad(torch.empty(8, 64, dtype=torch.bfloat16, **meta),
                         torch.empty(E, 128, 64, dtype=torch.bfloat16, **meta),
                         torch.empty(E, 64, 64, dtype=torch.bfloat16, **meta),
                         torch.empty(8, 128, dtype=torch.bfloat16, **meta),
                         torch.empty(E + 1, dtype=torch.int32, **meta), torch.empty(8, dtype=torch.int32, **meta),
                         torch.empty(8, dtype=torch.float32, **meta))


def test_dgrad_valid_cpu_inputs_stop_at_the_device_check():
    """Every check passes, and the call stops before the op: the kernel runs on CUDA tensors only."""
    with pytest.raises(ValueError, match="must be CUDA tensors, got cpu"):
        _fused_bwd.dgrad(**_cpu_inputs())


def test_dgrad_with_no_pool_rows_launches_nothing():
    """M = 0 returns empty outputs of the right shapes and dtypes on any device (CPU tensors: nothing could launch)."""
    out = _fused_bwd.dgrad(**_with(dy_pool=torch.empty(0, 128, dtype=torch.bfloat16),
                                   pool_src_route=torch.empty(0, dtype=torch.int32)))
    assert [tuple(t.shape) for t in out] == [(0, 384), (0, 192), (0, 2), (0, 128)]
    assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]


def test_dgrad_op_fake_gives_the_output_shapes():
    if not prime_kernels._lib.load().shim_loaded:
        pytest.skip(f"the torch shim is not loaded: {prime_kernels._lib.load().reason}")
    a = {k: v.to("meta") for k, v in _cpu_inputs(M=300, H=256, I=320, E=3).items()}
    args = (a["dy_pool"], a["w2"], a["w13"], a["expert_offsets"], a["h"], a["pool_src_route"],
            a["topk_weights"].reshape(-1), 0.0)
    out = torch.ops.prime_kernels.mega_moe_bwd_fused(*args)
    assert [tuple(t.shape) for t in out] == [(300, 640), (300, 320), (300, 3), (300, 256), (0,), (0,)]
    assert [t.dtype for t in out[:4]] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    x_pool = a["dy_pool"]
    for fp32, dt in ((False, torch.bfloat16), (True, torch.float32)):
        out = torch.ops.prime_kernels.mega_moe_bwd_fused(*args, x_pool, fp32)
        assert [(tuple(t.shape), t.dtype) for t in out[4:]] == [((3, 640, 256), dt), ((3, 256, 320), dt)]
    acc = (torch.empty(3, 640, 256, device="meta"), torch.empty(3, 256, 320, device="meta"))
    out = torch.ops.prime_kernels.mega_moe_bwd_fused(*args, x_pool, False, *acc)
    assert [tuple(t.shape) for t in out[4:]] == [(0,), (0,)]


def test_status_lists_the_kernel_and_auto_does_not_choose_it():
    st = prime_kernels.status()
    assert KEY == "mega_moe_backward.bf16.sm90" == _backend.KERNEL_NAMES[("bf16", "bwd")]
    assert KEY in st and isinstance(st[KEY], str) and st[KEY]
    if not torch.cuda.is_available():
        assert st[KEY] == "no CUDA device"
    # verified on a GPU but slower than the grouped pipeline's kernels: status() names that, so backend="auto" runs the
    # grouped backward (and backend="fused" refuses the backward with that reason), while its op runs
    assert KEY in _status.withheld() and KEY not in _status.unverified()
    if _WHY == _status.AVAILABLE:
        assert st[KEY] == _status.withheld()[KEY]
        assert _backend.resolve_backend("auto", "bf16", "bwd", hidden=256, intermediate=128) == "grouped"


def test_the_build_lists_the_kernel_when_it_has_sm90():
    if "90a" not in prime_kernels._lib.built_archs():
        pytest.skip(f"this build has no sm90 kernels ({prime_kernels._lib.built_archs()})")
    assert ("mega_moe_bwd_bf16", "90a") in prime_kernels._lib.compiled_kernels()


WGRAD_BAD = [  # (changes to dgrad_wgrad's extra arguments, exception, message fragment)
    (lambda a: dict(x_pool=a["dy_pool"].float()), TypeError, "x_pool must be torch.bfloat16"),
    (lambda a: dict(x_pool=a["dy_pool"][:10]), ValueError, "x_pool must be [>= 40 pool rows, H = 128]"),
    (lambda a: dict(x_pool=a["dy_pool"][:, :64].contiguous()), ValueError, "x_pool must be [>= 40 pool rows"),
    (lambda a: dict(wgrad_dtype=torch.float16), TypeError, "wgrad_dtype must be torch.bfloat16 or torch.float32"),
    (lambda a: dict(lag=65), ValueError, "lag must be None (the heuristic's) or an int in [0, 64]"),
    (lambda a: dict(lag=True), ValueError, "lag must be None"),
    (lambda a: dict(dw13_accum=torch.zeros(3, 384, 128)), ValueError, "give both accumulators"),
    (lambda a: dict(dw13_accum=torch.zeros(3, 384, 128), dw2_accum=torch.zeros(3, 192, 128)), ValueError,
     "dw2_accum must be [3, 128, 192]"),
    (lambda a: dict(dw13_accum=torch.zeros(3, 384, 128, dtype=torch.float64), dw2_accum=torch.zeros(3, 128, 192)),
     TypeError, "dw13_accum must be torch.float32"),
    (lambda a: dict(dw13_accum=torch.zeros(3, 384, 128).to("meta"), dw2_accum=torch.zeros(3, 128, 192).to("meta")),
     ValueError, "dw13_accum must be on cpu"),
]


@pytest.mark.parametrize("case", range(len(WGRAD_BAD)))
def test_dgrad_wgrad_host_checks_raise_before_any_launch(case):
    change, exc, fragment = WGRAD_BAD[case]
    a = _cpu_inputs()
    extra = dict(x_pool=a["dy_pool"].clone())
    extra.update(change(a))
    with pytest.raises(exc, match="prime_kernels.mega._fused_bwd: ") as info:
        _fused_bwd.dgrad_wgrad(**a, **extra)
    assert fragment in str(info.value)


def test_dgrad_wgrad_valid_cpu_inputs_stop_at_the_device_check():
    a = _cpu_inputs()
    with pytest.raises(ValueError, match="must be CUDA tensors, got cpu"):
        _fused_bwd.dgrad_wgrad(**a, x_pool=a["dy_pool"].clone())
    with pytest.raises(ValueError, match="must be CUDA tensors, got cpu"):
        _fused_bwd.dgrad_wgrad(**a, x_pool=a["dy_pool"].clone(), dw13_accum=torch.zeros(3, 384, 128),
                               dw2_accum=torch.zeros(3, 128, 192))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_dgrad_wgrad_with_no_pool_rows_gives_zero_gradients_without_a_launch(dt):
    a = _with(dy_pool=torch.empty(0, 128, dtype=torch.bfloat16), pool_src_route=torch.empty(0, dtype=torch.int32))
    out = _fused_bwd.dgrad_wgrad(**a, x_pool=torch.empty(0, 128, dtype=torch.bfloat16), wgrad_dtype=dt)
    assert [tuple(t.shape) for t in out] == [(0, 384), (0, 192), (0, 2), (0, 128), (3, 384, 128), (3, 128, 192)]
    assert out[4].dtype == dt and out[5].dtype == dt
    assert torch.count_nonzero(out[4]) == 0 and torch.count_nonzero(out[5]) == 0


def test_layer_backward_refuses_an_expert_parallel_group():
    from prime_kernels.mega._validate import FusedKernelUnavailable

    with pytest.raises(FusedKernelUnavailable, match="single rank"):
        _fused_bwd.backward(*([None] * 12), group=object())
