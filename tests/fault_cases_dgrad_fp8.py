"""The fault matrix's cases for the fused FP8 dgrad kernel (op prime_kernels::mega_moe_fp8_dgrad_fused, through
prime_kernels.swiglu_bwd_fp8.mega_moe_fp8_dgrad_fused): the FP8 twin of tests/fault_cases_dgrad.py, registered into
tests/fault_cases.py's CASES and run by its worker like the others; every name starts with "dgrad_fp8_"
(``python3 -m pytest tests/test_fault_matrix.py -k dgrad_fp8``).

Classes: bad input (group_offsets decreasing, past the pool, negative, off the 128-row grid: reported by the device
check and nothing written; pool_src_route values outside [-1, routes): read as masked and reported), forward
progress (the op while a helper kernel holds all SMs but k, with num_sms = k and the default), concurrency (3
streams at once, 2,000 back-to-back calls, a CUDA graph) and the wait watchdog (its L1-dgrad wait made to time out).
Every case skips, with the reason, where prime_kernels._status.runnable() says the kernel cannot run (no sm_90 GPU,
or a build without it); the op runs wherever runnable() says it can, verified or not, so the cases also run on the
GPU that is to verify it.

The op's outputs must be those of the two launches it replaces, bit for bit: m_grouped_fp8_gemm_swiglu_bwd (its
Fp8SwigluBwd) and then m_grouped_fp8_gemm_nt(dh_q, dh_sa, W13^T) (dx_pool). Compared are the parts the ops specify,
as bytes (NaN patterns compare, and float8 needs no comparison kernel of its own): the experts' rows of dh_q,
dh_sa, dt_part and dx_pool, their token columns of dht_q and awt_q and their 128-row blocks of dht_s and awt_s
(rows after the last expert are not written).
"""

from __future__ import annotations

import torch

import fault_cases as fc
import fault_cases_dgrad as fcd
from fault_cases import Skip, case

STATUS_KEY = "mega_moe_backward.fp8.sm90"
FIELDS = ("dh_q", "dh_sa", "dht_q", "dht_s", "awt_q", "awt_s", "dt_part", "dx_pool")


def _fp8_or_skip():
    fc._need_cuda()
    from prime_kernels import _status

    why = _status.runnable(STATUS_KEY)
    if why != _status.AVAILABLE:
        raise Skip(f"{STATUS_KEY} cannot run here: {why}")


def _fp8_inputs(st, pow2=False):
    """The op's operands from a bf16 state of fault_cases_dgrad (_state, or _small's tensors in that order), as the
    FP8 backward makes them: qK(dy_pool, 128) from the pool's own rows, the weights' transposed FP8 copies.
    [dy_q, dy_qs, w2t_q, w2t_s, w13t_q, w13t_s, offsets, h, pool_src_route, topk_weights]."""
    from prime_kernels.mega.fp8 import Fp8WeightCache
    from prime_kernels.quantize import dispatch_rows_fp8

    dy_pool, w13, w2, h, offsets, src, wts = st
    rows = dy_pool.shape[0]
    own_rows = torch.arange(rows, device=dy_pool.device, dtype=torch.int32)[:, None]
    dy_q, dy_qs = dispatch_rows_fp8(dy_pool, own_rows, rows, pow2_scales=pow2)
    cache = Fp8WeightCache()
    w13t, w2t = cache.get(w13, pow2).transposed, cache.get(w2, pow2).transposed
    return [dy_q, dy_qs, w2t.data, w2t.scale, w13t.data, w13t.scale, offsets, h, src, wts]


def _fused(x8, **kw):
    from prime_kernels.swiglu_bwd_fp8 import mega_moe_fp8_dgrad_fused

    return mega_moe_fp8_dgrad_fused(*x8, **kw)


def _pipeline(x8, clamp=None, pow2_scales=False):
    """The two launches the op replaces, as prime_kernels.mega._fp8_bwd.data_grads makes them without it."""
    from prime_kernels.grouped_gemm import m_grouped_fp8_gemm_nt
    from prime_kernels.swiglu_bwd_fp8 import m_grouped_fp8_gemm_swiglu_bwd

    dy_q, dy_qs, w2t_q, w2t_s, w13t_q, w13t_s, offsets, h, src, wts = x8
    l2 = m_grouped_fp8_gemm_swiglu_bwd(dy_q, dy_qs, w2t_q, w2t_s, offsets, h, src, wts, clamp=clamp,
                                       pow2_scales=pow2_scales)
    return l2, m_grouped_fp8_gemm_nt(l2.dh_q, l2.dh_sa, w13t_q, w13t_s, offsets)


def _flat(out):
    l2, dx_pool = out
    return [*l2, dx_pool]


def _cut(out, rows: int):
    """The specified parts of (Fp8SwigluBwd, dx_pool) for the experts' first ``rows`` pool rows, as contiguous bytes
    in FIELDS' order."""
    dh_q, dh_sa, dht_q, dht_s, awt_q, awt_s, dt_part, dx = _flat(out)
    blocks = -(-rows // 128)
    parts = (dh_q[:rows], dh_sa[:rows], dht_q[:, :rows], dht_s[:, :blocks], awt_q[:, :rows], awt_s[:, :blocks],
             dt_part[:rows], dx[:rows])
    return [p.contiguous().view(torch.uint8) for p in parts]


def _same(name, got, want):
    for field, a, b in zip(FIELDS, got, want):
        if a.shape != b.shape:
            raise AssertionError(f"{name}: {field} has {list(a.shape)} bytes, not {list(b.shape)}")
        if not torch.equal(a, b):
            raise AssertionError(f"{name}: {field} differs bitwise ({int((a != b).sum())} of {b.numel()} bytes)")


def _rows(x8) -> int:
    return int(x8[6][-1])


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

# 256 pool rows in 3 experts. fault_cases._BAD_OFFSETS are off the 128-row grid as well, which this kernel refuses on
# that ground alone: here each set breaks one rule, the grid one last.
_BAD_OFFSETS = {"decreasing": [0, 256, 128, 256], "past_end": [0, 128, 256, 256 + 128],
                "negative": [-128, 128, 128, 256], "not_multiple_of_128": [0, 64, 128, 256]}
_GOOD_OFFSETS = [0, 128, 128, 256]  # every pool row in an expert, one of them empty


def _sentinel(t):
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)  # an e4m3 NaN: no quantized value the kernel could store
    else:
        t.fill_(7.0)


def _holds_sentinel(t) -> bool:
    if t.dtype == torch.float8_e4m3fn:
        return bool((t.view(torch.uint8) == 0x7F).all())
    return bool((t == 7).all())


def _bad_offsets(kind):
    """Offsets the kernel must refuse: every CTA checks them before any store (the L1-dgrad tiles' dX rows
    included), so the op returns, the device check reports them, and the L2 outputs handed in through ``out`` keep
    their sentinel (dt_part its zeros)."""
    _fp8_or_skip()
    import prime_kernels
    from prime_kernels.swiglu_bwd_fp8 import allocate_outputs

    M, H, I = fc._M, 256, 128
    dy_pool, w13, w2, h, tw = fcd._small(80, E=fc._G, M=M, H=H, I=I)
    route = torch.arange(M, dtype=torch.int32, device="cuda")
    x8 = _fp8_inputs([dy_pool, w13, w2, h, torch.tensor(_GOOD_OFFSETS, dtype=torch.int32, device="cuda"), route, tw])
    bad = torch.tensor(_BAD_OFFSETS[kind], dtype=torch.int32, device="cuda")
    out = allocate_outputs(M, I, "cuda")
    for name, t in zip(FIELDS, out):
        if name != "dt_part":
            _sentinel(t)
    fc._clear_findings()
    fc._rejects(lambda: _fused(x8[:6] + [bad] + x8[7:], out=out), "offsets",
                what=f"the fused FP8 dgrad with {kind} group_offsets {_BAD_OFFSETS[kind]}")
    for name, t in zip(FIELDS, out):
        if name == "dt_part":
            assert not bool(t.any()), "dt_part: not all zeros"
        elif not _holds_sentinel(t):
            raise AssertionError(f"{name}: written although the offsets were refused")
    rows = _rows(x8)
    good = _cut(_fused(x8), rows)
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    _same("the valid call after the refused one, against the pipeline", good, _cut(_pipeline(x8), rows))
    return "reported on the device, nothing written; a valid call afterwards equals the pipeline bit for bit"


for _kind in _BAD_OFFSETS:
    case(f"dgrad_fp8_group_offsets_{_kind}", 60)(lambda _kind=_kind: _bad_offsets(_kind))


@case("dgrad_fp8_pool_src_route_out_of_range", 60)
def _route_bad():
    """Route ids index topk_weights: one past its end and one below -1 must be read as masked rows (weight 0, as
    -1) and reported, never read."""
    _fp8_or_skip()
    import prime_kernels

    M, routes = fc._M, 400
    dy_pool, w13, w2, h, tw = fcd._small(81, E=fc._G, M=M, routes=routes)
    offs = torch.tensor(_GOOD_OFFSETS, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(82)
    fixed = torch.randperm(routes, generator=g, device="cuda")[:M].to(torch.int32)
    fixed[[5, 11, 200]] = -1
    bad = fixed.clone()
    bad[11], bad[200] = routes + 1000, -7
    x8 = _fp8_inputs([dy_pool, w13, w2, h, offs, fixed, tw])
    fc._clear_findings()
    got = _cut(_fused(x8[:8] + [bad, tw]), M)
    torch.cuda.synchronize()
    try:
        prime_kernels.check_device_errors()
        raise AssertionError("out-of-range pool_src_route values were not reported")
    except RuntimeError as exc:
        assert "pool_src_route" in str(exc), f"the report does not name pool_src_route: {str(exc)[:200]}"
    _same("bad routes against the same rows masked", got, _cut(_fused(x8), M))
    _same("bad routes against the pipeline with those rows masked", got, _cut(_pipeline(x8), M))
    return "read as masked rows (bitwise the -1 result and the pipeline's) and reported"


# ------------------------------------------------------------------------------------------------
# forward progress and concurrency
# ------------------------------------------------------------------------------------------------

# T 512 routed to 4 of 16 experts: about 20 m-blocks of 4 tasks (2 L2-dgrad tiles of I, 2 L1-dgrad tiles of H)
_SHAPE = dict(T=512, E=16, H=256, I=256, K=4)


def _progress(k: int):
    _fp8_or_skip()
    fc.free_sms_or_skip(k)
    x8 = _fp8_inputs(fcd._state(**_SHAPE, seed=80))
    rows = _rows(x8)
    _same(f"num_sms={k} against the pipeline", _cut(_fused(x8, num_sms=k), rows), _cut(_pipeline(x8), rows))
    stream = torch.cuda.Stream()

    def run(num_sms):
        with torch.cuda.stream(stream):
            out = _cut(_fused(x8, num_sms=num_sms or 0), rows)
            done = torch.cuda.Event()
            done.record(stream)
            return out, done

    return fc.progress_beside_helper(k, run, "the fused FP8 dgrad op")


# k = 1: one SM left, so with the default grid a single CTA is resident and claims every task in turn, each L1-dgrad
# tile after the L2-dgrad tiles it waits for
for _k in (1, 8, 66):
    case(f"dgrad_fp8_forward_progress_{_k}_free_sms", 240)(lambda _k=_k: _progress(_k))


@case("dgrad_fp8_three_streams_bitwise", 150)
def _three_streams():
    """The op on 3 streams at once, 5 calls each (about 100 tasks per grid, a CTA per task up to one per SM: the
    three grids cannot all be resident together), one stream without a clamp, one with, one with it and power-of-two
    scales: each must return its pipeline's bits."""
    _fp8_or_skip()
    kws = [{}, {"clamp": 1.5}, {"clamp": 1.5, "pow2_scales": True}]
    inputs = [_fp8_inputs(fcd._state(**_SHAPE, seed=83 + i, masked=0.0), pow2=kw.get("pow2_scales", False))
              for i, kw in enumerate(kws)]
    rows = [_rows(x8) for x8 in inputs]
    want = [_cut(_pipeline(x8, **kw), r) for x8, kw, r in zip(inputs, kws, rows)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(3)]
    fns = [fc._on_stream(stream, lambda x8=x8, kw=kw, r=r: _cut(_fused(x8, **kw), r), reps=5)
           for stream, x8, kw, r in zip(streams, inputs, kws, rows)]
    outs = fc._threads(fns, 90, "3 concurrent fused FP8 dgrad ops")
    for i in range(3):
        _same(f"stream {i} ({kws[i] or 'defaults'})", outs[i], want[i])
    return "3 concurrent fused FP8 dgrad streams equal to the pipeline bit for bit"


@case("dgrad_fp8_repeat_2000_bitwise_flat_memory", 180)
def _repeat():
    """2,000 back-to-back calls on one skewed state, num_sms cycling through every SM, 7, 1 and 64 and the lag
    through the heuristic's, 0 and 64 (every pair gives the same bits): each equal to the first call's, which equals
    the pipeline's, with allocated memory flat."""
    _fp8_or_skip()
    x8 = _fp8_inputs(fcd._state(**_SHAPE, seed=84, skewed=True))
    rows = _rows(x8)
    sms, lags = (0, 7, 1, 64), (-1, 0, 64)
    _same("the first call against the pipeline", _cut(_fused(x8), rows), _cut(_pipeline(x8), rows))
    return fc.repeat_bitwise(lambda i: _cut(_fused(x8, num_sms=sms[i % len(sms)], lag=lags[i % len(lags)]), rows))


@case("dgrad_fp8_cuda_graph_equals_eager", 120)
def _graph():
    """The op captured in a CUDA graph (its counters' memset and dt_part's zeroing inside it): replays equal eager
    calls and the pipeline bit for bit, also after a new state of the same sizes (other routes, other offsets, other
    quantized operands) is copied in."""
    _fp8_or_skip()
    static = _fp8_inputs(fcd._state(**_SHAPE, seed=85))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _fused(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _fused(static)
    for seed in (85, 86):
        new = _fp8_inputs(fcd._state(**_SHAPE, seed=seed))
        for t, v in zip(static, new):
            t.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        rows = _rows(new)
        got = _cut(static_out, rows)
        _same(f"replay (inputs of seed {seed}) against eager", got, _cut(_fused(new), rows))
        _same(f"replay (inputs of seed {seed}) against the pipeline", got, _cut(_pipeline(new), rows))
    return "replays equal eager and the pipeline bit for bit, also after new inputs were copied in"


# ------------------------------------------------------------------------------------------------
# the wait watchdog
# ------------------------------------------------------------------------------------------------

# As for the BF16 kernel (fault_cases_dgrad): the L1-dgrad wait cannot be made to hang without a kernel change, but
# it can be made to time out. The bound (set_wait_timeout) applies to every wait of the kernels launched after it,
# and 100 ns is far below one L2-dgrad tile (128 x 128 x K = 2048 in FP8: microseconds). With one expert of one
# m-block, two L2-dgrad tiles and 16 L1-dgrad tiles, the CTAs that claim L1-dgrad tiles at the start wait for
# L2-dgrad tiles that have not begun, so the wait must trap, and its record must name the kernel and the wait. The
# operands are quantized before the bound is set (their kernels do not wait, but nothing else should run under it).
_WAIT_WORDS = ("timed out", "CUDA context is lost", "mega_moe_bwd_fp8_kernel",
               "L1-dgrad tile waits for its m-block's L2-dgrad tiles", "expected", "observed")

_WAIT_CHILD = fc.CHILD_PRELUDE + r"""
from prime_kernels.mega.fp8 import Fp8WeightCache
from prime_kernels.quantize import dispatch_rows_fp8
from prime_kernels.swiglu_bwd_fp8 import mega_moe_fp8_dgrad_fused
M, H, I = 128, 2048, 256
g = torch.Generator(device="cuda").manual_seed(0)
dy_pool = torch.randn(M, H, generator=g, device="cuda").bfloat16()
w13 = (torch.randn(1, 2 * I, H, generator=g, device="cuda") * H ** -0.5).bfloat16()
w2 = (torch.randn(1, H, I, generator=g, device="cuda") * I ** -0.5).bfloat16()
route = torch.arange(M, dtype=torch.int32, device="cuda")
dy_q, dy_qs = dispatch_rows_fp8(dy_pool, route[:, None], M)
cache = Fp8WeightCache()
w13t, w2t = cache.get(w13).transposed, cache.get(w2).transposed
args = (dy_q, dy_qs, w2t.data, w2t.scale, w13t.data, w13t.scale, torch.tensor([0, M], dtype=torch.int32, device="cuda"),
        torch.randn(M, 2 * I, generator=g, device="cuda").bfloat16(), route,
        torch.rand(M, 1, generator=g, device="cuda"))
def dgrad():
    return mega_moe_fp8_dgrad_fused(*args)
attempt("fused FP8 dgrad at the default bound", dgrad)
attempt("synchronize", torch.cuda.synchronize)
prime_kernels.set_wait_timeout(1e-7)
attempt("fused FP8 dgrad at a 100 ns bound", dgrad)
time.sleep(3.0)
attempt("synchronize", torch.cuda.synchronize)
attempt("next fused FP8 dgrad", dgrad)
attempt("check_device_errors", prime_kernels.check_device_errors)
print("\n".join(texts), file=sys.stderr, flush=True)
"""


@case("dgrad_fp8_wait_timeout_traps", 90)
def _wait_timeout():
    _fp8_or_skip()
    return fc.trapping_child(_WAIT_CHILD, _WAIT_WORDS)
