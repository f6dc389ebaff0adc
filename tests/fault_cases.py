"""The cases of the fault matrix (tests/test_fault_matrix.py): each is a small function that raises on failure,
run inside a worker process (``python fault_cases.py --serve``) so that a hang or a device fault fails that case
instead of the test session.

Classes: bad input (T = 0 on each backend, activation_clamp <= 0 / not finite, a stale backward state, bad
group_offsets in every grouped GEMM, out-of-range index values in every raw op, E beyond the fused kernel under
"auto", bad block_m), concurrency (the layer on several streams at once beside a large matmul, 2,000 back-to-back
calls, a CUDA graph), forward progress (the layer while a helper kernel holds all SMs but k) and the wait
watchdog (a raw op that waits forever must trap, and the error must say so). The same classes for the fused
backward's dgrad kernel are in tests/fault_cases_dgrad.py (case names start with "dgrad_").

Conventions: a case returns a short note or raises (AssertionError for a wrong result); ``Skip`` says the case
cannot run here and why. An error "rejected" means a Python exception (ValueError, TypeError or RuntimeError)
raised by the call, with the CUDA context intact afterwards (the worker checks it after every failure and is
restarted when it is not).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback

import torch

PROTOCOL = "@@FM@@ "
REJECTED = (ValueError, TypeError, RuntimeError, IndexError)


class Skip(Exception):
    """The case cannot run on this machine (the reason is its message)."""


CASES: dict = {}  # name -> (fn, timeout_s)


def case(name: str, timeout: float = 60.0):
    def deco(fn):
        CASES[name] = (fn, timeout)
        return fn
    return deco


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _need_cuda():
    if not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU")


def _fused_fwd_or_skip():
    from prime_kernels.mega._backend import _fused_reason

    reason = _fused_reason("bf16", "fwd")
    if reason is not None:
        raise Skip(f"the fused forward is not available here: {reason}")


def _problem(T, E, H, I, K, seed=0, masked=0.1, skewed=False):
    """x, topk_idx, topk_weights, w13, w2, dy on the GPU, from a CPU generator (the same numbers on any GPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    if skewed:
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        idx = torch.multinomial(pop.expand(T, E), K, replacement=False, generator=g)
        idx = torch.randperm(E, generator=g)[idx]
    else:
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    if masked > 0 and T > 0:
        idx[torch.rand(T, K, generator=g) < masked] = -1
    w = torch.rand(T, K, generator=g) + 0.1
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    return [t.cuda() for t in (x, idx.long(), w.float(), w13, w2, dy)]


def _layer(x, idx, w, w13, w2, dy, **kw):
    """mega_moe forward + backward on fresh leaves: (y, dx, dtopk, dw13, dw2)."""
    from prime_kernels.mega import mega_moe

    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], **kw)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def _equal(name, got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            raise AssertionError(f"{name}: output {i} differs bitwise (max |diff| "
                                 f"{(a.double() - b.double()).abs().max().item():.3e})")


def _clear_findings() -> None:
    """Drops a device-side finding an earlier case left behind (it is not the next call's)."""
    import prime_kernels

    torch.cuda.synchronize()
    try:
        prime_kernels.check_device_errors()
    except RuntimeError:
        pass


def _rejects(fn, *words, what=""):
    """fn() must be refused with a Python exception whose message holds every word (case-insensitive), and the
    CUDA context must stay usable. Values only the kernel reads (offsets, indices in device memory) are checked on
    the device without a host synchronisation and reported by the next check: so a call that returns counts as
    refused when, after a synchronisation, prime_kernels.check_device_errors() raises. Returns the message."""
    import prime_kernels

    _clear_findings()
    try:
        fn()
        torch.cuda.synchronize()
        prime_kernels.check_device_errors()
    except REJECTED as exc:
        msg = str(exc)
        torch.cuda.synchronize()  # a device fault would surface here
        for w in words:
            if w.lower() not in msg.lower():
                raise AssertionError(f"{what}: rejected, but the message does not say {w!r}: {msg[:300]}")
        if "CUDA error" in msg or "illegal" in msg.lower():
            raise AssertionError(f"{what}: a device fault, not a check: {msg[:300]}")
        return msg
    torch.cuda.synchronize()
    raise AssertionError(f"{what}: accepted (no error raised)")


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

E0, H0, I0, K0 = 8, 256, 128, 2


def _t0(backend):
    _need_cuda()
    from prime_kernels.mega import mega_moe
    from prime_kernels.mega._backend import _fused_reason

    if backend == "fused":
        _fused_fwd_or_skip()
    x, idx, w, w13, w2, dy = _problem(0, E0, H0, I0, K0)
    with_bwd = not (backend == "fused" and _fused_reason("bf16", "bwd") is not None)
    leaves = [t.detach().clone().requires_grad_(with_bwd) for t in (x, w, w13, w2)]
    y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend=backend)
    assert tuple(y.shape) == (0, H0) and y.dtype == torch.bfloat16, f"y is {tuple(y.shape)} {y.dtype}"
    if not with_bwd:
        return "forward only (no fused backward here)"
    dx, dt, d13, d2 = torch.autograd.grad(y, leaves, dy)
    assert tuple(dx.shape) == (0, H0) and tuple(dt.shape) == (0, K0), f"dx {tuple(dx.shape)}, dtopk {tuple(dt.shape)}"
    assert d13.shape == w13.shape and d2.shape == w2.shape and not d13.any() and not d2.any(), "dW not zero"
    acc = (torch.ones_like(w13, dtype=torch.float32), torch.ones_like(w2, dtype=torch.float32))
    lv = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    mega_moe(lv[0], idx, lv[1], lv[2], lv[3], backend=backend, wgrad_accum=acc).backward(dy)
    assert bool((acc[0] == 1).all()) and bool((acc[1] == 1).all()), "wgrad_accum changed by an empty batch"
    return "empty y, zero / unchanged weight gradients"


for _b in ("auto", "grouped", "fused", "reference"):
    case(f"t0_{_b}", 60)(lambda _b=_b: _t0(_b))


@case("t0_low_level", 60)
def _t0_low_level():
    _need_cuda()
    import prime_kernels

    buf = prime_kernels.get_symm_buffer_for_mega_moe(None, E0, 64, K0, H0, I0, device="cuda", reuse=False)
    _, _, _, w13, w2, _ = _problem(0, E0, H0, I0, K0)
    y = torch.empty(0, H0, dtype=torch.bfloat16, device="cuda")
    st = prime_kernels.bf16_mega_moe(y, w13, w2, buf, save_h=True)
    dw1 = torch.ones(w13.shape, device="cuda")
    dw2 = torch.ones(w2.shape, device="cuda")
    dx = torch.empty(0, H0, dtype=torch.bfloat16, device="cuda")
    dt = torch.empty(0, K0, device="cuda")
    prime_kernels.bf16_mega_moe_backward(dx, dw1, dw2, dt, y.clone(), w13, w2, buf, state=st, accumulate=True)
    assert bool((dw1 == 1).all()) and bool((dw2 == 1).all()), "accumulated weight gradients changed"
    return "bf16_mega_moe / _backward with T = 0"


def _clamp(value):
    _need_cuda()
    import prime_kernels
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2, _ = _problem(64, E0, H0, I0, K0)
    for backend in ("auto", "reference"):
        _rejects(lambda: mega_moe(x, idx, w, w13, w2, backend=backend, activation_clamp=value),
                 "activation_clamp", what=f"mega_moe(backend={backend!r}, activation_clamp={value})")
    buf = prime_kernels.get_symm_buffer_for_mega_moe(None, E0, 64, K0, H0, I0, device="cuda", reuse=False)
    buf.x[:64].copy_(x), buf.topk_idx[:64].copy_(idx), buf.topk_weights[:64].copy_(w)
    y = torch.full((64, H0), 7.0, dtype=torch.bfloat16, device="cuda")
    _rejects(lambda: prime_kernels.bf16_mega_moe(y, w13, w2, buf, activation_clamp=value), "activation_clamp",
             what=f"bf16_mega_moe(activation_clamp={value})")
    assert bool((y == 7).all()), "bf16_mega_moe wrote y before rejecting the clamp"
    return "rejected by mega_moe (auto, reference) and bf16_mega_moe; nothing written"


for _name, _v in (("zero", 0.0), ("negative", -1.0), ("nan", math.nan), ("inf", math.inf)):
    case(f"clamp_{_name}_rejected", 60)(lambda _v=_v: _clamp(_v))


def _stage(buf, x, idx, w):
    T = x.shape[0]
    buf.x[:T].copy_(x), buf.topk_idx[:T].copy_(idx), buf.topk_weights[:T].copy_(w)


def _bwd_outputs(T, w13, w2):
    dev = "cuda"
    return (torch.full((T, H0), 7.0, dtype=torch.bfloat16, device=dev), torch.full(w13.shape, 7.0, device=dev),
            torch.full(w2.shape, 7.0, device=dev), torch.full((T, K0), 7.0, device=dev))


def _untouched(outs, what):
    for o in outs:
        if not bool((o == 7).all()):
            raise AssertionError(f"{what}: an output was written before the state was rejected")


@case("stale_state_newer_staging", 60)
def _stale_newer():
    """A state from a forward on inputs A, after a forward on inputs B into the same buffer: the buffer holds B."""
    _need_cuda()
    import prime_kernels

    buf = prime_kernels.get_symm_buffer_for_mega_moe(None, E0, 256, K0, H0, I0, device="cuda", reuse=False)
    xa, ia, wa, w13, w2, dy = _problem(200, E0, H0, I0, K0, seed=1)
    xb, ib, wb, _, _, _ = _problem(200, E0, H0, I0, K0, seed=2)
    y = torch.empty(200, H0, dtype=torch.bfloat16, device="cuda")
    _stage(buf, xa, ia, wa)
    st_a = prime_kernels.bf16_mega_moe(y, w13, w2, buf, save_h=True)
    _stage(buf, xb, ib, wb)
    prime_kernels.bf16_mega_moe(y, w13, w2, buf, save_h=True)
    outs = _bwd_outputs(200, w13, w2)
    _rejects(lambda: prime_kernels.bf16_mega_moe_backward(*outs, dy, w13, w2, buf, state=st_a), "state",
             what="backward with the state of an earlier staging")
    _untouched(outs, "stale state")
    return "rejected, nothing written"


@case("stale_state_other_T", 60)
def _stale_t():
    _need_cuda()
    import prime_kernels

    buf = prime_kernels.get_symm_buffer_for_mega_moe(None, E0, 256, K0, H0, I0, device="cuda", reuse=False)
    x, i, w, w13, w2, dy = _problem(200, E0, H0, I0, K0, seed=3)
    _stage(buf, x, i, w)
    st = prime_kernels.bf16_mega_moe(torch.empty(200, H0, dtype=torch.bfloat16, device="cuda"), w13, w2, buf, save_h=True)
    outs = _bwd_outputs(100, w13, w2)
    _rejects(lambda: prime_kernels.bf16_mega_moe_backward(*outs, dy[:100].contiguous(), w13, w2, buf, state=st), "state",
             what="backward of T=100 with the state of a T=200 forward")
    _untouched(outs, "state of another T")
    return "rejected, nothing written"


@case("stale_state_other_buffer", 60)
def _stale_buffer():
    _need_cuda()
    import prime_kernels

    b1 = prime_kernels.get_symm_buffer_for_mega_moe(None, E0, 256, K0, H0, I0, device="cuda", reuse=False)
    b2 = prime_kernels.get_symm_buffer_for_mega_moe(None, E0, 256, K0, H0, I0, device="cuda", reuse=False)
    x, i, w, w13, w2, dy = _problem(128, E0, H0, I0, K0, seed=4)
    x2, i2, w2_, _, _, _ = _problem(128, E0, H0, I0, K0, seed=5)
    _stage(b1, x, i, w)
    st = prime_kernels.bf16_mega_moe(torch.empty(128, H0, dtype=torch.bfloat16, device="cuda"), w13, w2, b1, save_h=True)
    _stage(b2, x2, i2, w2_)
    outs = _bwd_outputs(128, w13, w2)
    _rejects(lambda: prime_kernels.bf16_mega_moe_backward(*outs, dy, w13, w2, b2, state=st), "state",
             what="backward on buffer 2 with the state of a forward on buffer 1")
    _untouched(outs, "state of another buffer")
    return "rejected, nothing written"


@case("state_after_restaging", 60)
def _state_restaged():
    """A state belongs to the staging it was made from: after the same inputs are staged again, the backward with
    the old state is refused (the buffer cannot tell equal inputs from new ones without reading them), and the
    backward without a state, which plans again from what is staged, runs and equals the backward with the state
    made right before it."""
    _need_cuda()
    import prime_kernels

    buf = prime_kernels.get_symm_buffer_for_mega_moe(None, E0, 256, K0, H0, I0, device="cuda", reuse=False)
    x, i, w, w13, w2, dy = _problem(200, E0, H0, I0, K0, seed=6)
    _stage(buf, x, i, w)
    st = prime_kernels.bf16_mega_moe(torch.empty(200, H0, dtype=torch.bfloat16, device="cuda"), w13, w2, buf, save_h=True)
    a = _bwd_outputs(200, w13, w2)
    prime_kernels.bf16_mega_moe_backward(*a, dy, w13, w2, buf, state=st)
    _stage(buf, x, i, w)
    stale = _bwd_outputs(200, w13, w2)
    _rejects(lambda: prime_kernels.bf16_mega_moe_backward(*stale, dy, w13, w2, buf, state=st), "state",
             what="a state from before the inputs were staged again")
    b = _bwd_outputs(200, w13, w2)
    prime_kernels.bf16_mega_moe_backward(*b, dy, w13, w2, buf)
    for u, v, n in zip(a, b, ("dx", "dw1", "dw2", "dtopk")):
        assert _rel(u, v) < 1e-2, f"{n}: without a state {_rel(u, v):.3e} from with it"
    return "old state refused after re-staging; the stateless backward equals the stateful one"


@case("expert_id_out_of_range", 60)
def _bad_ids():
    _need_cuda()
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2, _ = _problem(64, E0, H0, I0, K0)
    idx = idx.clone()
    idx[5, 1] = E0
    _rejects(lambda: mega_moe(x, idx, w, w13, w2), "expert", what="an expert id == E")
    return "rejected"


# grouped GEMMs with bad group_offsets: M = 256 rows in 3 groups
_M, _G = 256, 3
_BAD_OFFSETS = {"decreasing": [0, 160, 64, 256], "past_end": [0, 64, 160, 256 + 128], "negative": [-64, 64, 160, 256]}


def _grouped_call(op, offs):
    """(call, tensors that must stay unchanged) for one grouped op on offsets ``offs``."""
    from prime_kernels import grouped_gemm as gg

    g = torch.Generator().manual_seed(7)

    def r(*s):
        return (torch.randn(*s, generator=g) * 0.1).bfloat16().cuda()

    a = r(_M, 128)
    if op == "m_nt":
        b = r(_G, 128, 128)
        return (lambda: gg.m_grouped_bf16_gemm_nt(a, b, offs)), []
    if op == "m_nn":
        b = r(_G, 128, 128)
        return (lambda: gg.m_grouped_bf16_gemm_nn(a, b, offs)), []
    if op == "m_nt_gather":
        b = r(_G, 128, 128)
        ri = torch.randint(0, _M, (_M,), generator=g, dtype=torch.int32).cuda()
        return (lambda: gg.m_grouped_bf16_gemm_nt(a, b, offs, a_row_index=ri, m_total=_M)), []
    if op == "m_swiglu":
        w13 = r(_G, 256, 128)
        return (lambda: gg.m_grouped_bf16_gemm_swiglu(a, w13, offs, save_h=True)), []
    if op == "m_swiglu_bwd":
        w2, h = r(_G, 128, 128), r(_M, 256)
        route = torch.arange(_M, dtype=torch.int32).cuda()
        tw = torch.rand(_M, 1, generator=g).cuda()
        return (lambda: gg.m_grouped_bf16_gemm_swiglu_bwd(a, w2, offs, h, route, tw)), []
    if op == "k_tn":
        b = r(_M, 128)
        return (lambda: gg.k_grouped_bf16_gemm_tn(a, b, offs)), []
    if op == "k_tn_accumulate":
        b = r(_M, 128)
        acc = torch.full((_G, 128, 128), 7.0, device="cuda")
        return (lambda: gg.k_grouped_bf16_gemm_tn(a, b, offs, accumulate_into=acc)), [acc]
    raise KeyError(op)


def _bad_offsets(op, kind):
    _need_cuda()
    offs = torch.tensor(_BAD_OFFSETS[kind], dtype=torch.int32, device="cuda")
    call, kept = _grouped_call(op, offs)
    _rejects(call, "offset", what=f"{op} with {kind} group_offsets {_BAD_OFFSETS[kind]}")
    for t in kept:
        assert bool((t == 7).all()), f"{op}: the accumulation buffer changed although the call was rejected"
    good, _ = _grouped_call(op, torch.tensor([0, 64, 160, 256], dtype=torch.int32, device="cuda"))
    good()
    torch.cuda.synchronize()
    return "rejected; a valid call runs afterwards"


for _op in ("m_nt", "m_nn", "m_nt_gather", "m_swiglu", "m_swiglu_bwd", "k_tn", "k_tn_accumulate"):
    for _kind in _BAD_OFFSETS:
        case(f"group_offsets_{_kind}_{_op}", 60)(lambda _op=_op, _kind=_kind: _bad_offsets(_op, _kind))


def _combine_bad(value):
    _need_cuda()
    import prime_kernels

    slots = torch.randn(256, 128, device="cuda").bfloat16()
    r2p = torch.randint(0, 256, (64, 2), dtype=torch.int32, device="cuda")
    r2p[3, 1] = value
    w = torch.rand(64, 2, device="cuda")
    _rejects(lambda: prime_kernels.combine(slots, r2p, w), "route", what=f"combine with a route {value} (slots: 256)")
    return "rejected"


case("combine_route_past_slots", 60)(lambda: _combine_bad(256 + 10))
case("combine_route_below_minus_one", 60)(lambda: _combine_bad(-5))


@case("dispatch_rows_route_past_out", 60)
def _dispatch_bad():
    """Documented: a route naming a row outside [0, rows) writes nothing. Either that, or an error; never a fault."""
    _need_cuda()
    import prime_kernels

    src = torch.randn(64, 128, device="cuda").bfloat16()
    r2p = torch.randperm(256, device="cuda")[:128].view(64, 2).to(torch.int32)
    r2p[3, 1] = 256 + 44
    out = torch.zeros(256, 128, dtype=torch.bfloat16, device="cuda")
    want = out.clone()
    live = r2p.reshape(-1) < 256
    want[r2p.reshape(-1)[live].long()] = src.repeat_interleave(2, 0)[live]
    _clear_findings()
    try:
        prime_kernels.dispatch_rows(src, r2p, out)
    except REJECTED as exc:
        torch.cuda.synchronize()
        return f"rejected: {str(exc)[:80]}"
    torch.cuda.synchronize()
    try:
        prime_kernels.check_device_errors()
        raise AssertionError("dispatch_rows: the out-of-range route was not reported")
    except RuntimeError as exc:
        assert "route" in str(exc), f"dispatch_rows: the report does not name the route: {str(exc)[:200]}"
    assert torch.equal(out, want), "an out-of-range route wrote something (or a valid one did not)"
    return "the out-of-range route wrote nothing and was reported"


def _gather_bad(op):
    """Index values outside [0, rows) of a gathered operand: an error or the documented zero row; never a fault."""
    _need_cuda()
    from prime_kernels import grouped_gemm as gg

    offs = torch.tensor([0, 64, 160, 256], dtype=torch.int32, device="cuda")
    src = (torch.randn(100, 128, device="cuda") * 0.1).bfloat16()
    ri = torch.randint(0, 100, (_M,), dtype=torch.int32, device="cuda")
    ri[7], ri[99] = 100 + 50, -9
    fixed = torch.where((ri >= 0) & (ri < 100), ri, torch.full_like(ri, -1))
    if op == "nt_gather":
        b = (torch.randn(_G, 128, 128, device="cuda") * 0.1).bfloat16()
        run = lambda i: gg.m_grouped_bf16_gemm_nt(src, b, offs, a_row_index=i, m_total=_M)  # noqa: E731
    elif op == "swiglu_gather":
        w13 = (torch.randn(_G, 256, 128, device="cuda") * 0.1).bfloat16()
        run = lambda i: gg.m_grouped_bf16_gemm_swiglu(src, w13, offs, a_row_index=i, m_total=_M)[0]  # noqa: E731
    else:
        w2 = (torch.randn(_G, 128, 128, device="cuda") * 0.1).bfloat16()
        h = (torch.randn(_M, 256, device="cuda") * 0.1).bfloat16()
        route = torch.arange(_M, dtype=torch.int32, device="cuda")
        tw = torch.rand(_M, 1, device="cuda")
        run = lambda i: gg.m_grouped_bf16_gemm_swiglu_bwd(src, w2, offs, h, route, tw, a_row_index=i,  # noqa: E731
                                                          m_total=_M)[0]
    import prime_kernels

    _clear_findings()
    try:
        got = run(ri)
    except REJECTED as exc:
        torch.cuda.synchronize()
        return f"rejected: {str(exc)[:80]}"
    torch.cuda.synchronize()
    try:
        prime_kernels.check_device_errors()
        raise AssertionError(f"{op}: out-of-range a_row_index values were not reported")
    except RuntimeError as exc:
        assert "a_row_index" in str(exc), f"{op}: the report does not name a_row_index: {str(exc)[:200]}"
    assert torch.equal(got, run(fixed)), "out-of-range rows were not read as zero rows"
    short = ri[: _M // 2].contiguous()
    _rejects(lambda: run(short), what=f"{op} with a_row_index shorter than m_total")
    return "out-of-range rows read as zeros and reported; a short index rejected"


for _op in ("nt_gather", "swiglu_gather"):
    case(f"a_row_index_out_of_range_{_op}", 60)(lambda _op=_op: _gather_bad(_op))


def _route_bad(op):
    """pool_src_route values index topk_weights: one past its end must be rejected, not read."""
    _need_cuda()
    from prime_kernels import grouped_gemm as gg
    from prime_kernels.swiglu import swiglu_bwd

    offs = torch.tensor([0, 64, 160, 256], dtype=torch.int32, device="cuda")
    tw = torch.rand(64, 2, device="cuda")
    route = torch.randint(0, 128, (_M,), dtype=torch.int32, device="cuda")
    route[11] = 128 + 1000
    h = (torch.randn(_M, 256, device="cuda") * 0.1).bfloat16()
    if op == "m_swiglu_bwd":
        dy = (torch.randn(_M, 128, device="cuda") * 0.1).bfloat16()
        w2 = (torch.randn(_G, 128, 128, device="cuda") * 0.1).bfloat16()
        call = lambda: gg.m_grouped_bf16_gemm_swiglu_bwd(dy, w2, offs, h, route, tw)  # noqa: E731
    else:
        da = (torch.randn(_M, 128, device="cuda") * 0.1).bfloat16()
        n = torch.tensor([_M], dtype=torch.int32, device="cuda")
        call = lambda: swiglu_bwd(h, da, route, tw, n)  # noqa: E731
    _rejects(call, what=f"{op} with a pool_src_route past topk_weights")
    return "rejected"


for _op in ("m_swiglu_bwd", "swiglu_bwd"):
    case(f"pool_src_route_out_of_range_{_op}", 60)(lambda _op=_op: _route_bad(_op))


def _fused_raw(corrupt):
    _need_cuda()
    _fused_fwd_or_skip()
    import prime_kernels

    T, E, H, I, K = 256, 8, 256, 128, 2
    x, idx, w, w13, w2, _ = _problem(T, E, H, I, K, masked=0.0)
    plan = prime_kernels.routing_plan(idx, num_experts=E, block_m=128)
    src, offs = plan.pool_src_route.clone(), plan.expert_offsets.clone()
    if corrupt == "route":
        src[0] = T * K + 1000
    else:
        offs[2], offs[3] = offs[3].clone(), offs[2].clone()
        assert bool((offs[1:] < offs[:-1]).any()), "the plan's offsets could not be made non-monotonic"
    op = torch.ops.prime_kernels.mega_moe_fused_fwd
    _rejects(lambda: op(x, src, offs, w13, w2, K, False, 0.0, False, plan.route_to_pool.view(T, K), w),
             what=f"mega_moe_fused_fwd with a bad {corrupt}")
    return "rejected"


case("fused_fwd_op_route_past_tokens", 60)(lambda: _fused_raw("route"))
case("fused_fwd_op_non_monotonic_offsets", 60)(lambda: _fused_raw("offsets"))


@case("many_experts_auto_runs", 120)
def _many_experts():
    """E beyond the fused kernel's limit: backend="auto" runs the grouped pipeline and matches the reference."""
    _need_cuda()
    E, H, I, K = 520, 128, 128, 2
    prob = _problem(96, E, H, I, K, seed=8)
    got = _layer(*prob, backend="auto")
    ref = _layer(*prob, backend="reference")
    for n, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, ref):
        assert _rel(a, b) < 2e-2, f"{n}: rel err {_rel(a, b):.3e} against the reference"
    return "E=520 ran under auto, equal to the reference within 2e-2"


def _block_m(value):
    _need_cuda()
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2, _ = _problem(64, E0, H0, I0, K0)
    # the message must list the accepted values (128 among them); a ZeroDivisionError is not a rejection
    msg = _rejects(lambda: mega_moe(x, idx, w, w13, w2, block_m=value), "block_m", "128",
                   what=f"mega_moe(block_m={value})")
    return f"rejected: {msg[:80]}"


for _v in (0, 7, -128, 4096):
    case(f"block_m_{_v}_rejected".replace("-", "neg"), 60)(lambda _v=_v: _block_m(_v))


# ------------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------------


def _threads(fns, deadline_s, what):
    """Run each fn in its own thread, started together; fail when one raises or has not ended by the deadline."""
    start = threading.Barrier(len(fns))
    errors, results = [None] * len(fns), [None] * len(fns)

    def body(i, fn):
        try:
            start.wait()
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors[i] = exc

    ts = [threading.Thread(target=body, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    end = time.monotonic() + deadline_s
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    alive = [i for i, t in enumerate(ts) if t.is_alive()]
    if alive:
        raise AssertionError(f"{what}: threads {alive} still running after {deadline_s:.0f} s (a hang)")
    for e in errors:
        if e is not None:
            raise e
    return results


def _on_stream(stream, fn, reps=1):
    def run():
        with torch.cuda.stream(stream):
            out = None
            for _ in range(reps):
                out = fn()
            stream.synchronize()
            return out
    return run


@case("four_streams_with_matmul_bitwise", 240)
def _four_streams():
    _need_cuda()
    probs = [_problem(2048, 32, 1024, 512, 4, seed=20 + i) for i in range(4)]
    serial = [_layer(*p) for p in probs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(5)]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    fns = [_on_stream(s, lambda p=p: _layer(*p), reps=3) for s, p in zip(streams[:4], probs)]
    fns.append(_on_stream(streams[4], lambda: torch.mm(a, a), reps=30))
    outs = _threads(fns, 180, "4 streams + a matmul stream")
    for i in range(4):
        _equal(f"stream {i}", outs[i], serial[i])
    return "4 concurrent fwd+bwd equal to the serial results bit for bit"


@case("three_streams_forward_completes", 120)
def _three_streams():
    """The layer forward (the fused kernel under auto) on 3 streams at once must return."""
    _need_cuda()
    from prime_kernels.mega import mega_moe

    probs = [_problem(4096, 128, 2048, 768, 8, seed=30 + i, masked=0.0) for i in range(3)]
    with torch.no_grad():
        serial = [mega_moe(p[0], p[1], p[2], p[3], p[4]) for p in probs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(3)]

    def fwd(p):
        with torch.no_grad():
            return mega_moe(p[0], p[1], p[2], p[3], p[4])

    outs = _threads([_on_stream(s, lambda p=p: fwd(p), reps=5) for s, p in zip(streams, probs)], 90,
                    "3 concurrent forwards")
    for i in range(3):
        _equal(f"stream {i}", [outs[i]], [serial[i]])
    return "3 concurrent forwards returned, equal to the serial results"


@case("repeat_2000_bitwise_flat_memory", 180)
def _repeat():
    _need_cuda()
    prob = _problem(512, 16, 256, 256, 4, seed=40, skewed=True)
    return repeat_bitwise(lambda i: _layer(*prob))


def repeat_bitwise(call, n: int = 2000) -> str:
    """call(i) for i = 0 .. n - 1 back to back (differences counted on the device, no sync per call): every output
    bitwise equal to those of a first call, and memory_allocated flat from call 20 on. Returns the note."""
    first = call(0)
    torch.cuda.synchronize()
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    mem = {}
    for i in range(n):
        out = call(i)
        bad += torch.stack([torch.ne(a, b).any() for a, b in zip(out, first)]).sum()
        del out
        if i in (20, n // 4, n // 2, n - 1):
            torch.cuda.synchronize()
            mem[i] = torch.cuda.memory_allocated()
    n_bad = int(bad.item())
    assert n_bad == 0, f"{n_bad} outputs over {n} calls differ from the first call's"
    assert len(set(mem.values())) == 1, f"memory_allocated grew: {mem}"
    return f"{n} calls bitwise equal, memory_allocated flat at {mem[20]} bytes"


@case("cuda_graph_fwd_bwd_equals_eager", 180)
def _graph():
    _need_cuda()
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2, dy = _problem(1024, 16, 512, 256, 4, seed=50)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    static_idx, static_dy = idx.clone(), dy.clone()

    def step():
        y = mega_moe(leaves[0], static_idx, leaves[1], leaves[2], leaves[3])
        return (y.detach(), *torch.autograd.grad(y, leaves, static_dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (50, 51):
        nx, nidx, nw, n13, n2, ndy = _problem(1024, 16, 512, 256, 4, seed=seed)
        with torch.no_grad():
            for t, v in zip((*leaves, static_idx, static_dy), (nx, nw, n13, n2, nidx, ndy)):
                t.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        _equal(f"replay (inputs of seed {seed})", static_out, _layer(nx, nidx, nw, n13, n2, ndy))
    return "replays equal eager bit for bit, also after new inputs were copied in"


# ------------------------------------------------------------------------------------------------
# forward progress: the layer while all SMs but k are held by a helper kernel
# ------------------------------------------------------------------------------------------------

# One CTA per SM: it asks for the largest dynamic shared memory a block may have, which with the 1 KiB every
# block reserves is the whole SM, so neither a second helper CTA nor any other kernel's CTA fits beside it. Its
# thread 0 writes %smid + 1 to its slot, then polls a flag in mapped pinned host memory (the host writes it; no
# kernel, copy or stream is needed to release it) and leaves when the flag is set, or after a time bound of its
# own (so a broken test cannot leave the GPU held), writing 1 (released) or 2 (timed out) to its exit slot.
# Written in PTX and loaded through the driver API (the driver compiles it): the GPU machine needs no compiler.
_OCCUPY_PTX = r"""
.version 7.8
.target sm_90
.address_size 64

.visible .entry pk_occupy(.param .u64 p_base, .param .u32 p_n, .param .u64 p_max_ns)
{
    .reg .pred %p<4>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [p_base];
    ld.param.u32 %r1, [p_n];
    ld.param.u64 %rd2, [p_max_ns];
    mov.u32 %r2, %tid.x;
    setp.ne.u32 %p1, %r2, 0;
    @%p1 bra DONE;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %smid;
    add.u32 %r5, %r4, 1;
    add.u32 %r6, %r3, 1;
    mul.wide.u32 %rd3, %r6, 4;
    add.u64 %rd4, %rd1, %rd3;
    st.volatile.global.u32 [%rd4], %r5;
    membar.sys;
    add.u32 %r7, %r6, %r1;
    mul.wide.u32 %rd5, %r7, 4;
    add.u64 %rd6, %rd1, %rd5;
    mov.u64 %rd7, %globaltimer;
SPIN:
    ld.volatile.global.u32 %r8, [%rd1];
    setp.ne.u32 %p2, %r8, 0;
    @%p2 bra RELEASED;
    nanosleep.u32 1000;
    mov.u64 %rd8, %globaltimer;
    sub.u64 %rd9, %rd8, %rd7;
    setp.lt.u64 %p3, %rd9, %rd2;
    @%p3 bra SPIN;
    mov.u32 %r9, 2;
    st.volatile.global.u32 [%rd6], %r9;
    bra.uni DONE;
RELEASED:
    mov.u32 %r9, 1;
    st.volatile.global.u32 [%rd6], %r9;
DONE:
    ret;
}
"""


class SmOccupier:
    """Holds ``n`` SMs of the current GPU with one spinning CTA each until :meth:`release`.

    Assumptions: the driver can JIT-compile PTX 7.8 for sm_90 (any R525+ driver); pinned host memory from
    cuMemHostAlloc(DEVICEMAP) is readable by kernels (unified addressing, every 64-bit Linux system); the n CTAs
    all become resident at once (nothing else holds SMs: :meth:`start` checks it, reading the SM ids the CTAs
    report, and fails otherwise); the caller runs nothing on the occupier's stream and never synchronises the
    device while it holds (a device-wide sync would wait for the helper)."""

    def __init__(self, n: int, max_seconds: float = 120.0):
        torch.zeros(1, device="cuda")  # torch's primary context exists and is current on this thread
        self.cu = cu = ctypes.CDLL("libcuda.so.1")
        self.n = n
        ctx = ctypes.c_void_p()
        self._ck(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int(torch.cuda.current_device())
            self._ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        log = ctypes.create_string_buffer(8192)
        opts = (ctypes.c_int * 2)(5, 6)  # CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
        vals = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(8192))
        rc = cu.cuModuleLoadDataEx(ctypes.byref(self.module), ctypes.c_char_p(_OCCUPY_PTX.encode()), 2, opts, vals)
        self._ck(rc, f"cuModuleLoadDataEx (JIT log: {log.value.decode(errors='replace')})")
        self._ck(cu.cuModuleGetFunction(ctypes.byref(self.func), self.module, b"pk_occupy"), "cuModuleGetFunction")
        dev = ctypes.c_int()
        self._ck(cu.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
        smem = ctypes.c_int()
        self._ck(cu.cuDeviceGetAttribute(ctypes.byref(smem), 97, dev), "cuDeviceGetAttribute(smem optin)")
        self.smem = smem.value
        self._ck(cu.cuFuncSetAttribute(self.func, 8, self.smem), "cuFuncSetAttribute(max dynamic smem)")
        self.words = 1 + 2 * n
        self.host = ctypes.c_void_p()
        self._ck(cu.cuMemHostAlloc(ctypes.byref(self.host), ctypes.c_size_t(4 * self.words), 0x3), "cuMemHostAlloc")
        ctypes.memset(self.host, 0, 4 * self.words)
        self.dptr = ctypes.c_uint64()
        self._ck(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(self.dptr), self.host, 0), "cuMemHostGetDevicePointer")
        self.words_view = (ctypes.c_int32 * self.words).from_address(self.host.value)
        self.max_ns = ctypes.c_uint64(int(max_seconds * 1e9))
        self.stream = torch.cuda.Stream()
        self.running = False

    def _ck(self, rc, what):
        if rc != 0:
            s = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(s))
            raise RuntimeError(f"SmOccupier: {what} failed: {rc} {s.value.decode() if s.value else ''}")

    def start(self, resident_timeout: float = 20.0) -> list[int]:
        base, n = ctypes.c_uint64(self.dptr.value), ctypes.c_uint32(self.n)
        params = (ctypes.c_void_p * 3)(ctypes.addressof(base), ctypes.addressof(n), ctypes.addressof(self.max_ns))
        self._keep = (base, n, params)
        self._ck(self.cu.cuLaunchKernel(self.func, self.n, 1, 1, 32, 1, 1, self.smem,
                                        ctypes.c_void_p(self.stream.cuda_stream), params, None), "cuLaunchKernel")
        self.running = True
        end = time.monotonic() + resident_timeout
        while time.monotonic() < end:
            seen = [self.words_view[1 + i] for i in range(self.n)]
            if all(seen):
                sms = sorted(s - 1 for s in seen)
                if len(set(sms)) != self.n:
                    raise RuntimeError(f"SmOccupier: {self.n} CTAs share SMs {sms}: not one CTA per SM")
                return sms
            time.sleep(0.01)
        got = sum(1 for i in range(self.n) if self.words_view[1 + i])
        raise RuntimeError(f"SmOccupier: only {got} of {self.n} CTAs became resident in {resident_timeout:.0f} s "
                           f"(something else holds SMs)")

    def holding(self) -> bool:
        """True while every CTA still spins (none left by its own time bound)."""
        return all(self.words_view[1 + self.n + i] == 0 for i in range(self.n))

    def release(self, timeout: float = 30.0) -> None:
        if not self.running:
            return
        self.words_view[0] = 1
        end = time.monotonic() + timeout
        while time.monotonic() < end and not all(self.words_view[1 + self.n + i] for i in range(self.n)):
            time.sleep(0.005)
        self.stream.synchronize()
        self.running = False

    def close(self) -> None:
        self.release()
        self.cu.cuMemFreeHost(self.host)
        self.cu.cuModuleUnload(self.module)


def free_sms_or_skip(k: int) -> int:
    """The GPU's SM count; Skip when it does not have more than k."""
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if k >= n_sm:
        raise Skip(f"k={k} >= the GPU's {n_sm} SMs")
    return n_sm


def progress_beside_helper(k: int, run, what: str) -> str:
    """``run(num_sms)`` -> (outputs, an event recorded after them), queued on a stream of its own without
    synchronising, must complete with num_sms = k and the default while a helper holds all SMs but k, and give the
    outputs of its solo runs bit for bit (so do the solo runs with k and the default). ``what`` names the work in
    messages. Returns the note."""
    n_sm = free_sms_or_skip(k)
    # Solo runs first: the reference results, and every kernel loaded and the caching allocator holding free
    # blocks for two more runs, so that the runs beside the helper need no module load or cudaMalloc (either may
    # synchronise the device, which would wait for the helper).
    solo = {}
    for ns in (k, None):
        solo[ns], ev = run(ns)
        ev.synchronize()
    spare = [run(ns) for ns in (k, None)]
    for _, ev in spare:
        ev.synchronize()
    del spare
    _equal(f"num_sms={k} against the default", solo[k], solo[None])
    occ = SmOccupier(n_sm - k)
    notes = []
    try:
        occ.start()
        for ns in (k, None):
            # launched from a thread, so that a launch that blocks the host cannot stall this case past its bound
            box = {}
            t = threading.Thread(target=lambda ns=ns: box.update(r=run(ns)), daemon=True)
            t0 = time.monotonic()
            t.start()
            t.join(60)
            ok = not t.is_alive() and "r" in box
            while ok and not box["r"][1].query():
                if time.monotonic() - t0 > 60:
                    ok = False
                    break
                time.sleep(0.002)
            if not ok:
                raise AssertionError(f"num_sms={ns}: {what} did not complete in 60 s while {n_sm - k} of "
                                     f"{n_sm} SMs were held (the helper was then released)")
            if not occ.holding():
                raise AssertionError(f"the helper left by its own time bound before {what} finished: not a test "
                                     "of forward progress")
            notes.append(f"num_sms={ns}: {time.monotonic() - t0:.2f} s")
            solo[f"held_{ns}"] = box["r"][0]
    finally:
        occ.release()
        occ.close()
    torch.cuda.synchronize()
    for ns in (k, None):
        _equal(f"num_sms={ns} beside the helper", solo[f"held_{ns}"], solo[ns])
    return f"{n_sm - k} SMs held; " + ", ".join(notes) + "; results equal to the solo runs"


def _forward_progress(k: int):
    _need_cuda()
    from prime_kernels.mega import mega_moe

    free_sms_or_skip(k)
    x, idx, w, w13, w2, dy = _problem(2048, 32, 1024, 512, 4, seed=60)
    stream = torch.cuda.Stream()

    def run(num_sms):
        with torch.cuda.stream(stream):
            leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
            y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], num_sms=num_sms)
            out = (y.detach(), *torch.autograd.grad(y, leaves, dy))
            done = torch.cuda.Event()
            done.record(stream)
            return out, done

    return progress_beside_helper(k, run, "forward+backward")


for _k in (8, 66):
    case(f"forward_progress_{_k}_free_sms", 240)(lambda _k=_k: _forward_progress(_k))


@case("occupier_self_check", 60)
def _occupier_check():
    """The helper itself: it holds the SMs it claims and lets go when released (independent of the library)."""
    _need_cuda()
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    occ = SmOccupier(n_sm - 4, max_seconds=30)
    try:
        sms = occ.start()
        time.sleep(0.2)
        assert occ.holding(), "a helper CTA left before it was released"
        occ.release()
        exits = [occ.words_view[1 + occ.n + i] for i in range(occ.n)]
        assert all(e == 1 for e in exits), f"exit states {sorted(set(exits))}: not every CTA saw the release"
    finally:
        occ.close()
    return f"held {len(sms)} distinct SMs, released"


# ------------------------------------------------------------------------------------------------
# the wait watchdog
# ------------------------------------------------------------------------------------------------

_PROBE_WORDS = ("timed out", "CUDA context is lost", "kernel", "wait", "cta", "expected", "observed")

# The start of a trapping child's code: attempt(label, fn) notes what each step raised, for the output's words.
CHILD_PRELUDE = r"""
import sys, time, traceback
import torch, prime_kernels
texts = []
def attempt(label, fn):
    try:
        fn()
        texts.append(f"{label}: no error")
    except Exception as exc:
        texts.append(f"{label}: {type(exc).__name__}: {exc}")
"""

_PROBE_CHILD = CHILD_PRELUDE + r"""
if {set_timeout}:
    prime_kernels.set_wait_timeout(1.0)
# the next call's inputs exist before the context is lost (creating a tensor afterwards fails in torch itself)
idx = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
torch.cuda.synchronize()
attempt("probe", lambda: prime_kernels._watchdog._wait_timeout_probe(1.0))
time.sleep(3.0)
if {sync}:
    attempt("synchronize", torch.cuda.synchronize)
attempt("next prime_kernels op", lambda: prime_kernels.routing_plan(idx, num_experts=4, block_m=128))
attempt("check_device_errors", prime_kernels.check_device_errors)
print("\n".join(texts), file=sys.stderr, flush=True)
"""


def trapping_child(code: str, words) -> str:
    """Runs ``code`` in a child process (its wait traps and its CUDA context is lost, not this worker's): it must
    end within 45 s, and its output must hold every word (case-insensitive). Returns the note."""
    import prime_kernels

    if not hasattr(prime_kernels, "set_wait_timeout"):
        raise AssertionError("prime_kernels.set_wait_timeout does not exist in this build")
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        raise AssertionError("the probe's process did not end within 60 s (the wait hung instead of trapping)")
    secs = time.monotonic() - t0
    text = r.stdout + r.stderr
    missing = [w for w in words if w.lower() not in text.lower()]
    if missing:
        raise AssertionError(f"the probe's error text lacks {missing}: {text[-1500:]}")
    assert secs < 45, f"the probe's process took {secs:.0f} s to end"
    return f"trapped and reported in {secs:.1f} s (process exit {r.returncode})"


def _probe(sync: bool, set_timeout: bool):
    _need_cuda()
    code = _PROBE_CHILD.replace("{sync}", str(sync)).replace("{set_timeout}", str(set_timeout))
    return trapping_child(code, _PROBE_WORDS)


case("wait_timeout_probe_then_sync", 90)(lambda: _probe(True, False))
case("wait_timeout_probe_then_next_op", 90)(lambda: _probe(False, True))


# Cases that check the runner itself (a hang, a dying worker, a plain failure), registered only with
# PK_FAULT_SELFTEST=1: python3 tests/test_fault_matrix.py selftest_hang selftest_die selftest_fail t0_auto
if os.environ.get("PK_FAULT_SELFTEST") == "1":
    case("selftest_hang", 3)(lambda: time.sleep(3600))
    case("selftest_die", 10)(lambda: os._exit(9))

    @case("selftest_fail", 10)
    def _selftest_fail():
        raise AssertionError("deliberate")


# The fused backwards' dgrad kernels have their cases in files of their own (tests/fault_cases_dgrad.py, BF16, and
# tests/fault_cases_dgrad_fp8.py, FP8), which import this module's helpers and register into CASES: when this file
# runs as the worker (__main__), those imports must find this module, not load a second copy with a CASES of its own.
sys.modules.setdefault("fault_cases", sys.modules[__name__])
import fault_cases_dgrad  # noqa: E402,F401
import fault_cases_dgrad_fp8  # noqa: E402,F401


# ------------------------------------------------------------------------------------------------
# the worker
# ------------------------------------------------------------------------------------------------


def _emit(obj):
    sys.stdout.write(PROTOCOL + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _healthy() -> bool:
    try:
        torch.cuda.synchronize()
        return float(torch.ones(4, device="cuda").sum().item()) == 4.0
    except Exception:  # noqa: BLE001
        return False


def run_case(name: str) -> dict:
    fn, _ = CASES[name]
    t0 = time.monotonic()
    try:
        note = fn()
        res = {"status": "pass", "detail": str(note or "")}
    except Skip as exc:
        res = {"status": "skip", "detail": str(exc)}
    except BaseException as exc:  # noqa: BLE001  (every failure is a result)
        tb = traceback.format_exc(limit=6)
        res = {"status": "fail", "detail": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-3000:]}
    res.update(name=name, seconds=round(time.monotonic() - t0, 3))
    res["healthy"] = _healthy() if torch.cuda.is_available() else True
    return res


def serve() -> int:
    """Reads case names from stdin, one a line; writes one protocol line per case. Ends after a case that left
    the CUDA context unusable (the runner starts a fresh worker)."""
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
    import prime_kernels  # noqa: F401  (loaded once, before the first case's clock)

    _emit({"ready": True, "pid": os.getpid()})
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        name = line.strip()
        if not name:
            continue
        res = run_case(name) if name in CASES else {"name": name, "status": "fail", "detail": "no such case",
                                                    "healthy": True, "seconds": 0}
        _emit(res)
        if not res["healthy"]:
            return 3


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve())
    for n in sys.argv[1:] or list(CASES):
        print(json.dumps(run_case(n)))
