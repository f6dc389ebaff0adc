"""The fault matrix's cases for the fused backward kernel (op prime_kernels::mega_moe_bwd_fused), without its
weight-gradient tiles (prime_kernels.mega._fused_bwd.dgrad) and with them (dgrad_wgrad, cases "dgrad_wgrad_*"),
registered into tests/fault_cases.py's CASES and run by its worker like the others; every name starts with "dgrad_" (``python3 -m pytest tests/test_fault_matrix.py -k dgrad``).

Classes: bad input (group_offsets decreasing, past the pool, negative: reported by the device check and nothing
written; pool_src_route values outside [-1, routes): read as masked and reported), forward progress (the op while a
helper kernel holds all SMs but k, with num_sms = k and the default), concurrency (3 streams at once, 2,000
back-to-back calls, a CUDA graph) and the wait watchdog (its L1-dgrad wait made to time out). Every case skips,
with the reason, where prime_kernels._status.runnable() says the kernel cannot run (no sm_90 GPU, or a build
without it).

Outputs compared bit for bit are the ones the op specifies: dh, w * s and dx_pool rows of the experts (rows after
the last expert are not written, so they hold whatever the allocator's block held) and all of dt_part.
"""

from __future__ import annotations

import torch

import fault_cases as fc
from fault_cases import Skip, case


def _dgrad_or_skip():
    fc._need_cuda()
    from prime_kernels import _status
    from prime_kernels.mega import _fused_bwd

    why = _status.runnable(_fused_bwd.STATUS_KEY)
    if why != _status.AVAILABLE:
        raise Skip(f"{_fused_bwd.STATUS_KEY} cannot run here: {why}")


def _dgrad(st, **kw):
    from prime_kernels.mega._fused_bwd import dgrad

    return dgrad(*st, **kw)


def _dgrad_wgrad(st, x_pool, **kw):
    from prime_kernels.mega._fused_bwd import dgrad_wgrad

    dy_pool, *rest = st
    return dgrad_wgrad(dy_pool, x_pool, *rest, **kw)


def _cut(out, rows: int):
    dh, aw, dt_part, dx, *wgrad = out
    return [dh[:rows], aw[:rows], dt_part, dx[:rows], *wgrad]


def _x_pool(st, seed):
    """Token rows in pool order for _state's plan: random rows, zero where the plan pads."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(st[0].shape, generator=g, device="cuda").bfloat16()
    return x.masked_fill_((st[5] < 0)[:, None], 0)


def _state(T, E, H, I, K, seed, masked=0.1, skewed=False):
    """The op's inputs as the grouped backward hands them over, from a routing plan (block_m 128) of random routes:
    [dy_pool (padding rows zero), w13, w2, h, expert_offsets, pool_src_route, topk_weights]. Drawn on the GPU (the
    cases compare the op with itself, so the numbers need not match any other machine's); h is random, as the
    forward's pre-activations are at these scales."""
    import prime_kernels

    g = torch.Generator(device="cuda").manual_seed(seed)
    if skewed:
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float32, device="cuda") ** 1.5
        idx = torch.multinomial(pop.expand(T, E), K, replacement=False, generator=g)
    else:
        idx = torch.argsort(torch.rand(T, E, generator=g, device="cuda"), dim=1)[:, :K]
    if masked > 0:
        idx[torch.rand(T, K, generator=g, device="cuda") < masked] = -1
    plan = prime_kernels.routing_plan(idx, num_experts=E, block_m=128)
    src = plan.pool_src_route
    tok = torch.where(src >= 0, torch.div(src, K, rounding_mode="floor"), torch.full_like(src, -1))
    dy = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    dy_pool = dy.index_select(0, tok.clamp(min=0).long()).masked_fill_((tok < 0)[:, None], 0)
    h = torch.randn(src.shape[0], 2 * I, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") * I ** -0.5).bfloat16()
    w = torch.rand(T, K, generator=g, device="cuda") + 0.1
    return [dy_pool, w13, w2, h, plan.expert_offsets, src, w]


def _small(seed, E=fc._G, M=fc._M, H=256, I=128, routes=None):
    """dy_pool, w13, w2, h of M pool rows and E experts, and topk_weights [routes, 1] (default: one per row)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return (torch.randn(*s, generator=g, device="cuda") * 0.1).bfloat16()

    return r(M, H), r(E, 2 * I, H), r(E, H, I), r(M, 2 * I), torch.rand(routes or M, 1, generator=g, device="cuda")


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


def _bad_offsets(kind):
    """Offsets the kernel must refuse (fault_cases._BAD_OFFSETS, 256 pool rows in 3 experts): every CTA checks
    them before any store, so the op returns, the device check reports them, and dh, w * s and dx_pool keep the
    contents of the blocks they were given (dt_part, which the op zeroes, stays zero)."""
    _dgrad_or_skip()
    import prime_kernels

    M, H, I = fc._M, 256, 128
    dy_pool, w13, w2, h, tw = _small(70, H=H, I=I)
    route = torch.arange(M, dtype=torch.int32, device="cuda")
    bad = torch.tensor(fc._BAD_OFFSETS[kind], dtype=torch.int32, device="cuda")

    def call(offs):
        return _dgrad([dy_pool, w13, w2, h, offs, route, tw])

    # The op's outputs come from the caching allocator, which gives the same blocks back to the same sequence of
    # requests from the same state. So: one call (the kernel loaded, every block it takes cached), then the op's
    # requests in its order (dh, w * s, dt_part, dx_pool, the int32 counters: one 512-byte block) filled with 7 and
    # freed, then the call whose outputs must be those blocks, unwritten.
    call(bad)
    fc._clear_findings()
    blocks = [torch.full((M, 2 * I), 7.0, dtype=torch.bfloat16, device="cuda"),
              torch.full((M, I), 7.0, dtype=torch.bfloat16, device="cuda"),
              torch.full((M, (I + 127) // 128), 7.0, device="cuda"),
              torch.full((M, H), 7.0, dtype=torch.bfloat16, device="cuda"),
              torch.zeros(128, dtype=torch.int32, device="cuda")]
    ptrs = [b.data_ptr() for b in blocks[:4]]
    del blocks
    box = {}
    fc._rejects(lambda: box.update(out=call(bad)), "offsets",
                what=f"dgrad with {kind} expert_offsets {fc._BAD_OFFSETS[kind]}")
    dh, aw, dt_part, dx = box["out"]
    got = [t.data_ptr() for t in (dh, aw, dt_part, dx)]
    if got != ptrs:
        raise AssertionError(f"the outputs are not the 7-filled blocks (pointers {got} vs {ptrs}): the allocator "
                             "did not repeat itself, so 'nothing written' could not be checked")
    for name, t in (("dh", dh), ("w*s", aw), ("dx_pool", dx)):
        if not bool((t == 7).all()):
            raise AssertionError(f"{name}: written although the offsets were refused")
    assert not bool(dt_part.any()), "dt_part: not all zeros"
    good = call(torch.tensor([0, 128, 128, 256], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    assert all(bool(torch.isfinite(t).all()) for t in good), "the valid call after the refused one: non-finite output"
    return "reported on the device, nothing written; a valid call runs afterwards"


for _kind in fc._BAD_OFFSETS:
    case(f"dgrad_group_offsets_{_kind}", 60)(lambda _kind=_kind: _bad_offsets(_kind))


@case("dgrad_pool_src_route_out_of_range", 60)
def _route_bad():
    """Route ids index topk_weights: one past its end and one below -1 must be read as masked rows (weight 0, as
    -1) and reported, never read."""
    _dgrad_or_skip()
    import prime_kernels

    M, routes = fc._M, 400
    dy_pool, w13, w2, h, tw = _small(71, routes=routes)
    offs = torch.tensor([0, 128, 128, 256], dtype=torch.int32, device="cuda")  # every pool row in an expert
    fixed = torch.randperm(routes, device="cuda")[:M].to(torch.int32)
    fixed[[5, 11, 200]] = -1
    bad = fixed.clone()
    bad[11], bad[200] = routes + 1000, -7
    fc._clear_findings()
    got = _dgrad([dy_pool, w13, w2, h, offs, bad, tw])
    torch.cuda.synchronize()
    try:
        prime_kernels.check_device_errors()
        raise AssertionError("out-of-range pool_src_route values were not reported")
    except RuntimeError as exc:
        assert "pool_src_route" in str(exc), f"the report does not name pool_src_route: {str(exc)[:200]}"
    fc._equal("bad routes against the same rows masked", got, _dgrad([dy_pool, w13, w2, h, offs, fixed, tw]))
    return "read as masked rows (bitwise the -1 result) and reported"


# ------------------------------------------------------------------------------------------------
# forward progress and concurrency
# ------------------------------------------------------------------------------------------------


def _progress(k: int):
    _dgrad_or_skip()
    fc.free_sms_or_skip(k)
    st = _state(2048, 32, 1024, 512, 4, seed=60)
    rows = int(st[4][-1])
    stream = torch.cuda.Stream()

    def run(num_sms):
        with torch.cuda.stream(stream):
            out = _cut(_dgrad(st, num_sms=num_sms), rows)
            done = torch.cuda.Event()
            done.record(stream)
            return out, done

    return fc.progress_beside_helper(k, run, "the dgrad op")


# k = 1: one SM left, so with the default grid a single CTA is resident and claims every task in turn
for _k in (1, 8, 66):
    case(f"dgrad_forward_progress_{_k}_free_sms", 240)(lambda _k=_k: _progress(_k))


def _progress_wgrad(k: int):
    """As _progress, with the weight-gradient tiles: they wait for their experts' L2-dgrad tiles, which with one
    resident CTA it runs itself, earlier in the sequence."""
    _dgrad_or_skip()
    fc.free_sms_or_skip(k)
    st = _state(2048, 32, 1024, 512, 4, seed=61)
    xp = _x_pool(st, 62)
    rows = int(st[4][-1])
    stream = torch.cuda.Stream()

    def run(num_sms):
        with torch.cuda.stream(stream):
            out = _cut(_dgrad_wgrad(st, xp, num_sms=num_sms), rows)
            done = torch.cuda.Event()
            done.record(stream)
            return out, done

    return fc.progress_beside_helper(k, run, "the dgrad + wgrad op")


for _k in (1, 66):
    case(f"dgrad_wgrad_forward_progress_{_k}_free_sms", 240)(lambda _k=_k: _progress_wgrad(_k))


@case("dgrad_wgrad_three_streams_bitwise", 180)
def _three_streams_wgrad():
    """The op with its weight-gradient tiles at the 30B shape (T 4096) on 3 streams at once, 3 calls each."""
    _dgrad_or_skip()
    states = [_state(4096, 128, 2048, 768, 8, seed=33 + i, masked=0.0) for i in range(3)]
    pools = [_x_pool(s, 70 + i) for i, s in enumerate(states)]
    rows = [int(s[4][-1]) for s in states]
    serial = [_cut(_dgrad_wgrad(s, xp), r) for s, xp, r in zip(states, pools, rows)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(3)]
    fns = [fc._on_stream(stream, lambda s=s, xp=xp, r=r: _cut(_dgrad_wgrad(s, xp), r), reps=3)
           for stream, s, xp, r in zip(streams, states, pools, rows)]
    outs = fc._threads(fns, 120, "3 concurrent dgrad + wgrad ops")
    for i in range(3):
        fc._equal(f"stream {i}", outs[i], serial[i])
    return "3 concurrent dgrad + wgrad streams equal to the serial results bit for bit"


@case("dgrad_three_streams_bitwise", 150)
def _three_streams():
    """The op at the 30B shape (E 128, H 2048, I 768, K 8, T 4096) on 3 streams at once, 5 calls each: three
    persistent grids share the SMs, none of them resident as a whole; each must return its serial result."""
    _dgrad_or_skip()
    states = [_state(4096, 128, 2048, 768, 8, seed=30 + i, masked=0.0) for i in range(3)]
    rows = [int(s[4][-1]) for s in states]
    serial = [_cut(_dgrad(s), r) for s, r in zip(states, rows)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(3)]
    fns = [fc._on_stream(stream, lambda s=s, r=r: _cut(_dgrad(s), r), reps=5)
           for stream, s, r in zip(streams, states, rows)]
    outs = fc._threads(fns, 90, "3 concurrent dgrad ops")
    for i in range(3):
        fc._equal(f"stream {i}", outs[i], serial[i])
    return "3 concurrent dgrad streams equal to the serial results bit for bit"


@case("dgrad_repeat_2000_bitwise_flat_memory", 180)
def _repeat():
    """2,000 back-to-back calls on one skewed state, num_sms cycling through every SM, 7, 1 and 64 (every value
    gives the same bits): each equal to the first call's, with allocated memory flat."""
    _dgrad_or_skip()
    st = _state(512, 16, 256, 256, 4, seed=40, skewed=True)
    rows = int(st[4][-1])
    sms = (None, 7, 1, 64)
    return fc.repeat_bitwise(lambda i: _cut(_dgrad(st, num_sms=sms[i % len(sms)]), rows))


@case("dgrad_cuda_graph_equals_eager", 120)
def _graph():
    """The op captured in a CUDA graph (its counters' memset and dt_part's zeroing inside it): replays equal eager
    calls bit for bit, also after a new state of the same sizes (other routes, other offsets) is copied in."""
    _dgrad_or_skip()
    T, E, H, I, K = 1024, 16, 512, 256, 4
    static = _state(T, E, H, I, K, seed=50)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _dgrad(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _dgrad(static)
    for seed in (50, 51):
        new = _state(T, E, H, I, K, seed=seed)
        for t, v in zip(static, new):
            t.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        rows = int(new[4][-1])
        fc._equal(f"replay (inputs of seed {seed})", _cut(static_out, rows), _cut(_dgrad(new), rows))
    return "replays equal eager bit for bit, also after new inputs were copied in"


# ------------------------------------------------------------------------------------------------
# the wait watchdog
# ------------------------------------------------------------------------------------------------

# The L1-dgrad wait cannot be made to hang without a kernel change (its L2-dgrad tiles always finish), but it can be
# made to time out: the bound (set_wait_timeout) applies to every wait of the kernels launched after it, and 100 ns
# is far below one L2-dgrad tile (128 x 128 x K = 2048: microseconds). With one expert of one m-block, two
# L2-dgrad tiles and 16 L1-dgrad tiles, the CTAs that claim L1-dgrad tiles at the start wait for L2-dgrad tiles
# that have not begun, so the wait must trap, and its record must name the kernel and the wait.
_DGRAD_WAIT_WORDS = ("timed out", "CUDA context is lost", "mega_moe_bwd_kernel",
                     "L1-dgrad tile waits for its m-block's L2-dgrad tiles", "expected", "observed")

_DGRAD_WAIT_CHILD = fc.CHILD_PRELUDE + r"""
from prime_kernels.mega._fused_bwd import dgrad
M, H, I = 128, 2048, 256
g = torch.Generator(device="cuda").manual_seed(0)
args = (torch.randn(M, H, generator=g, device="cuda").bfloat16(),
        (torch.randn(1, 2 * I, H, generator=g, device="cuda") * H ** -0.5).bfloat16(),
        (torch.randn(1, H, I, generator=g, device="cuda") * I ** -0.5).bfloat16(),
        torch.randn(M, 2 * I, generator=g, device="cuda").bfloat16(),
        torch.tensor([0, M], dtype=torch.int32, device="cuda"),
        torch.arange(M, dtype=torch.int32, device="cuda"),
        torch.rand(M, 1, generator=g, device="cuda"))
attempt("dgrad at the default bound", lambda: dgrad(*args))
attempt("synchronize", torch.cuda.synchronize)
prime_kernels.set_wait_timeout(1e-7)
attempt("dgrad at a 100 ns bound", lambda: dgrad(*args))
time.sleep(3.0)
attempt("synchronize", torch.cuda.synchronize)
attempt("next dgrad", lambda: dgrad(*args))
attempt("check_device_errors", prime_kernels.check_device_errors)
print("\n".join(texts), file=sys.stderr, flush=True)
"""


@case("dgrad_wait_timeout_traps", 90)
def _wait_timeout():
    _dgrad_or_skip()
    return fc.trapping_child(_DGRAD_WAIT_CHILD, _DGRAD_WAIT_WORDS)


# With the weight-gradient tiles the sequence has both waits (L1-dgrad on its m-block, weight-gradient on its expert);
# whichever times out first writes the record, so the words name the kernel and a wait, not which one.
_WGRAD_WAIT_WORDS = ("timed out", "CUDA context is lost", "mega_moe_bwd_kernel", "waits for its", "L2-dgrad tiles",
                     "expected", "observed")
_WGRAD_WAIT_CHILD = _DGRAD_WAIT_CHILD.replace("from prime_kernels.mega._fused_bwd import dgrad\n", """\
from prime_kernels.mega._fused_bwd import dgrad_wgrad
def dgrad(dy_pool, *rest):
    return dgrad_wgrad(dy_pool, dy_pool.clone(), *rest)
""")


@case("dgrad_wgrad_wait_timeout_traps", 90)
def _wait_timeout_wgrad():
    _dgrad_or_skip()
    return fc.trapping_child(_WGRAD_WAIT_CHILD, _WGRAD_WAIT_WORDS)
