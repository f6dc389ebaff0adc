"""The fused backward's dgrad kernel (prime_kernels.mega._fused_bwd.dgrad, op prime_kernels::mega_moe_bwd_dgrad)
against the grouped backward's own two steps on the same inputs, and its host-side checks.

GPU tests build the grouped pipeline's real backward state (its forward's plan and saved h, the dy rows gathered
into the pool as its backward gathers them) and run both the fused kernel and the pipeline's steps
(m_grouped_bf16_gemm_swiglu_bwd, then m_grouped_bf16_gemm_nn(dh, w13)) on it. They skip, with the reason, where
the kernel cannot run (no sm_90 GPU, or a build without it). The CPU tests need no GPU."""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from prime_kernels import _status
from prime_kernels.grouped_gemm import m_grouped_bf16_gemm_nn, m_grouped_bf16_gemm_swiglu_bwd, m_grouped_gemm_reference
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
    with pytest.raises(exc, match="prime_kernels.mega._fused_bwd.dgrad: ") as info:
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
    out = torch.ops.prime_kernels.mega_moe_bwd_dgrad(a["dy_pool"], a["w2"], a["w13"], a["expert_offsets"], a["h"],
                                                     a["pool_src_route"], a["topk_weights"].reshape(-1), 0.0, 0)
    assert [tuple(t.shape) for t in out] == [(300, 640), (300, 320), (300, 3), (300, 256)]
    assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]


def test_status_lists_the_kernel_and_auto_does_not_use_it():
    st = prime_kernels.status()
    assert KEY in st and isinstance(st[KEY], str) and st[KEY]
    assert KEY not in _status.unverified()  # its GPU tests have passed on an H200
    if not torch.cuda.is_available():
        assert st[KEY] == "no CUDA device"
    # the layer's fused backward is still the unwritten whole kernel, so backend="auto" runs the grouped one
    assert _backend.KERNEL_NAMES[("bf16", "bwd")] == "mega_moe_backward.bf16.sm90"
    assert _status.KERNELS["mega_moe_backward.bf16.sm90"].missing


def test_the_build_lists_the_kernel_when_it_has_sm90():
    if "90a" not in prime_kernels._lib.built_archs():
        pytest.skip(f"this build has no sm90 kernels ({prime_kernels._lib.built_archs()})")
    assert ("mega_moe_bwd_dgrad_bf16", "90a") in prime_kernels._lib.compiled_kernels()
