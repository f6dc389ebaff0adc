"""The self-test that gates native kernels (prime_kernels.mega._selftest): on the CPU against a faked sm_100 device
and build with fake candidates (right, wrong, raising), the harness, the status() strings, the backend resolution,
the deferral under CUDA-graph capture and torch.compile, the caching and its thread safety; on a Hopper GPU the
harness pointed at our sm90 fused forward (must pass) and at deliberately wrong copies of it (must fail)."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from prime_kernels import _lib, _status
from prime_kernels import grouped_gemm_torch as torch_gemms
from prime_kernels.mega import _backend, _fused, _native_sm100, _selftest, reference
from prime_kernels.mega._selftest_cases import CASES, REL_TOL, ROW_TOL, capacity, make_inputs
from prime_kernels.mega._validate import FusedKernelUnavailable

KEY = "mega_moe.bf16.sm100"
COMPILED = "mega_moe_fwd_bf16_sm100"
ARCH_NEUTRAL = ("routing_plan", "combine", "dispatch_rows", "swiglu", "dispatch_rows_fp8", "quantize_tokens_fp8")
PASSED = ("available: native sm100 forward: self-test passed on this device (not verified by the project's CI)")
SHAPE = dict(device_type="cuda", hidden=256, intermediate=128)


def _reference_forward(x, topk_idx, topk_weights, w13, w2, *, activation_clamp, num_experts, block_m, capacity,
                       save_h, keep_x_pool, id_check, num_sms):
    """A right candidate on the CPU: the pure-PyTorch reference (another code path than the grouped pipeline's)."""
    out = reference.forward(x, topk_idx, topk_weights, w13, w2, precision="bf16", activation_clamp=activation_clamp,
                            group=None, num_experts=num_experts, max_tokens_per_rank=None, block_m=block_m,
                            capacity=capacity, save_h=save_h)
    pool = None
    if keep_x_pool:
        src = out[4].long()
        pool = x.index_select(0, src.clamp(min=0) // topk_idx.shape[1]).masked_fill((src < 0)[:, None], 0)
    return tuple(out) + (pool,)


def _wrong_slice(fwd):
    """The classic indexing bug: the last expert computed with the first expert's L1 weights."""
    def run(x, topk_idx, topk_weights, w13, w2, **kw):
        bad = w13.clone()
        bad[-1] = w13[0]
        return fwd(x, topk_idx, topk_weights, bad, w2, **kw)
    return run


def _one_row_off(fwd):
    """A small local error: one token's output 5% too large (under the relative bound at T > 25, over the row one)."""
    def run(x, topk_idx, *args, **kw):
        out = list(fwd(x, topk_idx, *args, **kw))
        out[0] = out[0].clone()
        out[0][x.shape[0] // 2] *= 1.05
        return tuple(out)
    return run


def _raises(*args, **kwargs):
    raise RuntimeError("boom: illegal instruction")


def _noisy(fwd):
    """Within the bounds but not the same bits twice."""
    def run(*args, **kw):
        out = list(fwd(*args, **kw))
        out[0] = out[0] + 1e-3 * torch.randn_like(out[0].float()).to(out[0].dtype) * out[0].abs()
        return tuple(out)
    return run


def _noisy_past_the_spans(fwd):
    """Different bits on every call only in h's rows past the experts' spans, which no kernel writes."""
    def run(*args, **kw):
        out = list(fwd(*args, **kw))
        span = int(out[3][-1])
        out[1] = out[1].clone()
        out[1][span:] = torch.randn_like(out[1][span:].float()).to(out[1].dtype)
        return tuple(out)
    return run


def _cand(forward, name="fake", compiled=COMPILED) -> _selftest.Candidate:
    return _selftest.Candidate(name=name, key=KEY, compiled_as=compiled, forward=forward)


class Counted:
    def __init__(self, fwd, delay=0.0):
        self.fwd, self.calls, self.delay = fwd, 0, delay

    def __call__(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay)
        return self.fwd(*args, **kwargs)


@pytest.fixture
def fake(monkeypatch):
    """fake(cc=(10, 0), archs=("90a", "100a"), native_built=True): a CUDA device of capability cc whose self-test
    tensors live on the CPU, a build of ``archs`` (the native kernel in it for 100a when ``native_built``), and an
    empty candidate registry. Returns a namespace whose ``capturing`` / ``compiling`` flags the fakes read."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    flags = types.SimpleNamespace(capturing=False, compiling=False)
    monkeypatch.setattr(_selftest, "_candidates", {})
    monkeypatch.setattr(_selftest, "_verdicts", {})
    monkeypatch.setattr(_selftest, "_settled", set())
    monkeypatch.setattr(_selftest, "_tensor_device", lambda index: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: flags.capturing)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: flags.compiling)
    monkeypatch.setattr(_backend, "_warned", set())

    def set_up(cc=(10, 0), archs=("90a", "100a"), native_built=True):
        pairs = {(k, a) for a in archs for k in ARCH_NEUTRAL}
        if native_built:
            pairs |= {(COMPILED, a) for a in archs if a != "90a"}
        monkeypatch.setattr(_lib, "built_archs", lambda: tuple(archs))
        monkeypatch.setattr(_lib, "compiled_kernels", lambda: frozenset(pairs))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(torch_gemms, "_selected_by_device", {})
        monkeypatch.setattr(_backend, "_ARCH_BY_DEVICE", {})
        # as once CUDA is up: answers remembered per device (fresh for this test)
        monkeypatch.setattr(_status, "_current_cuda_device", lambda: 0)
        monkeypatch.setattr(_status, "_answers", {})
        monkeypatch.setattr(_status, "_status_by_device", {})
        return flags

    return set_up


def _x():
    return types.SimpleNamespace(device=torch.device("cuda", 0), shape=(64, 256))


def _w13():
    return types.SimpleNamespace(shape=(8, 256, 256))


def _resolve(backend="auto", direction="fwd"):
    return _backend.resolve(direction, backend, "bf16", _x(), _w13(), block_m=128)


# --- the harness ------------------------------------------------------------------------------------------------------

def test_the_harness_passes_a_right_candidate_and_records_its_errors():
    v = _selftest.check(_cand(_reference_forward), torch.device("cpu"))
    assert v.passed, v.report()
    assert [o.case for o in v.outcomes] == list(CASES)
    for o in v.outcomes:
        assert o.passed and set(o.errors) == {"y", "h"}
        for rel, row in o.errors.values():
            assert rel <= REL_TOL and row <= ROW_TOL
    assert "passed" in v.report() and "one token" in v.report()


@pytest.mark.parametrize("make, case, words", [
    (lambda: _wrong_slice(_reference_forward), "odd T", "y relative error"),
    (lambda: _one_row_off(_reference_forward), "one token", "y relative error"),
    (lambda: _raises, "one token", "the candidate raised RuntimeError: boom: illegal instruction"),
    (lambda: _noisy(_reference_forward), "many routes, masked", "repeated: y or h differs"),
])
def test_the_harness_fails_wrong_candidates_and_names_the_case(make, case, words):
    v = _selftest.check(_cand(make()), torch.device("cpu"))
    assert not v.passed
    label = next(c.label() for c in CASES if c.name == case)
    assert v.why.startswith(label) and words in v.why, v.why
    assert "FAILED" in v.report() and label in v.report()


def test_the_repeat_reads_only_the_rows_a_kernel_writes():
    v = _selftest.check(_cand(_noisy_past_the_spans(_reference_forward)), torch.device("cpu"))
    assert v.passed, v.report()


def test_the_row_bound_catches_one_row_the_relative_bound_lets_through():
    bad = _one_row_off(_reference_forward)
    cases = tuple(c for c in CASES if c.name == "odd T")
    v = _selftest.check(_cand(bad), torch.device("cpu"), cases)
    assert not v.passed and "y row error" in v.why, v.why
    rel, row = v.outcomes[0].errors["y"]
    assert rel <= REL_TOL < ROW_TOL < row


def test_the_harness_checks_the_plan_and_the_pooled_rows():
    def wrong_plan(*args, **kw):
        out = list(_reference_forward(*args, **kw))
        out[6] = out[6].flip(0)
        return tuple(out)

    def wrong_pool(*args, **kw):
        out = list(_reference_forward(*args, **kw))
        if out[7] is not None:
            out[7] = torch.zeros_like(out[7])
        return tuple(out)

    v = _selftest.check(_cand(wrong_plan), torch.device("cpu"))
    assert not v.passed and "route_to_pool differs" in v.why, v.why
    v = _selftest.check(_cand(wrong_pool), torch.device("cpu"))
    assert not v.passed and v.why.startswith(CASES[1].label()) and "x_pool" in v.why, v.why


# --- status() ---------------------------------------------------------------------------------------------------------

def test_status_without_a_registered_kernel(fake):
    fake()
    assert prime_kernels.status()[KEY] == ("no native sm100 forward kernel is registered (prime_kernels.mega."
                                           "_native_sm100 registers it when the torch shim loads)")
    assert _selftest.candidate(KEY) is None
    report = prime_kernels.selftest()
    assert report.passed and not report and "no native kernel is registered" in str(report)


@pytest.mark.parametrize("case", ["not compiled", "not built", "sm_90 device", "sm_103 on 100a"])
def test_status_says_why_a_registered_kernel_cannot_run(fake, case):
    want = {"not compiled": "not compiled into this build of sm100 (its sources were not part of it)",
            "not built": "not built for sm100 (this build has 90a): rebuild with PRIME_KERNELS_CUDA_ARCHS=100a",
            "sm_90 device": "device sm_90 cannot run this sm100 kernel",
            "sm_103 on 100a": "device sm_103 needs a rebuild with PRIME_KERNELS_CUDA_ARCHS=103a"}[case]
    fake(cc={"sm_90 device": (9, 0), "sm_103 on 100a": (10, 3)}.get(case, (10, 0)),
         archs=("90a",) if case == "not built" else ("90a", "100a"), native_built=case != "not compiled")
    ran = Counted(_reference_forward)
    _selftest.register(_cand(ran))
    why = prime_kernels.status()[KEY]
    assert want in why and why == _status.runnable(KEY), why
    _selftest.on_layer_call(_x())
    report = prime_kernels.selftest(0)
    assert ran.calls == 0 and report.skipped == {KEY: why}


def test_status_before_the_self_test_and_runnable(fake):
    fake()
    _selftest.register(_cand(_reference_forward))
    assert prime_kernels.status()[KEY] == _selftest.NOT_RUN and not _status.is_available(_selftest.NOT_RUN)
    assert _status.runnable(KEY) == "available"
    with pytest.raises(RuntimeError, match="not used until its self-test passes"):
        _status.require(KEY)


# --- the first eager call, the resolution and the caching ---------------------------------------------------------

def test_first_eager_call_runs_the_self_test_and_auto_runs_a_passed_kernel(fake):
    fake()
    ran = Counted(_reference_forward)
    _selftest.register(_cand(ran, name="right"))
    assert _resolve("grouped") == "grouped" and ran.calls == 0  # a named grouped backend tests nothing
    assert _resolve("auto", "bwd") == "grouped" and ran.calls == 0  # nor a backward (no fused one on sm100)
    assert _resolve("auto") == "fused"
    calls = ran.calls
    assert calls == len(CASES) + 2  # every case, then the repeat of the last
    assert prime_kernels.status()[KEY] == PASSED and _status.is_available(PASSED)
    assert _resolve("auto") == "fused" and _resolve("fused") == "fused" and _resolve("grouped") == "grouped"
    assert ran.calls == calls  # once per device
    assert _resolve("auto", "bwd") == "grouped"  # the backward stays the grouped pipeline's


@pytest.mark.parametrize("bad, words", [(lambda: _wrong_slice(_reference_forward), "y relative error"),
                                        (lambda: _raises, "the candidate raised RuntimeError: boom")])
def test_a_failed_kernel_is_not_used_and_status_says_why(fake, bad, words):
    fake()
    _selftest.register(_cand(bad(), name="wrong"))
    assert _resolve("auto") == "grouped"
    why = prime_kernels.status()[KEY]
    assert why.startswith("self-test failed on this device, so the grouped pipeline runs: ") and words in why, why
    assert "candidate wrong" in why and not _status.is_available(why)
    which, fused_why = _backend.choose_backend("auto", "bf16", "fwd", **SHAPE)
    assert which == "grouped" and fused_why == f"{KEY}: {why}"
    with pytest.raises(FusedKernelUnavailable, match="self-test failed on this device"):
        _resolve("fused")
    with pytest.raises(FusedKernelUnavailable, match="self-test failed"):
        _selftest.native_forward(torch.device("cuda", 0), KEY)
    report = prime_kernels.selftest(0)
    assert not report.passed and words in str(report)


@pytest.mark.parametrize("flag", ["capturing", "compiling"])
def test_capture_and_compile_defer_the_self_test_to_a_later_eager_call(fake, flag):
    flags = fake()
    ran = Counted(_reference_forward)
    _selftest.register(_cand(ran))
    setattr(flags, flag, True)
    assert _resolve("auto") == "grouped" and ran.calls == 0
    assert prime_kernels.status()[KEY] == _selftest.NOT_RUN
    with pytest.raises(FusedKernelUnavailable, match="not used until its self-test passes"):
        _resolve("fused")
    with pytest.raises(RuntimeError, match="outside CUDA-graph capture and torch.compile"):
        prime_kernels.selftest()
    setattr(flags, flag, False)
    assert _resolve("auto") == "fused" and ran.calls > 0


def test_fake_tensors_defer_the_self_test(fake):
    """What torch.compile or torch.export trace with: a fake tensor defers the test, as capture does."""
    fake()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.empty(4, 256))
    assert _selftest._deferred(x) and not _selftest._deferred(torch.empty(4, 256))


def test_selftest_reports_and_reruns_on_request(fake):
    fake()
    ran = Counted(_reference_forward)
    _selftest.register(_cand(ran, name="right"))
    report = prime_kernels.selftest(0)
    assert report.passed and report[KEY].passed and report.device == "cuda:0"
    text = str(report)
    assert f"{KEY} (right) on cpu: passed" in text and "rel" in text and "odd T" in text
    calls = ran.calls
    assert prime_kernels.selftest(torch.device("cuda", 0))[KEY] is report[KEY] and ran.calls == calls
    assert prime_kernels.selftest(rerun=True).passed and ran.calls == 2 * calls
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        prime_kernels.selftest("cpu")


def test_register_replaces_the_kernel_and_its_verdicts(fake):
    fake()
    _selftest.register(_cand(_raises, name="first"))
    assert _resolve("auto") == "grouped"
    _selftest.register(_cand(_reference_forward, name="second"))
    assert prime_kernels.status()[KEY] == _selftest.NOT_RUN
    assert _resolve("auto") == "fused"
    with pytest.raises(ValueError, match="not a status entry that takes a self-tested kernel"):
        _selftest.register(_selftest.Candidate("x", "mega_moe.bf16.sm90", COMPILED, _reference_forward))
    _selftest.unregister(KEY)
    assert prime_kernels.status()[KEY].startswith("no native sm100 forward kernel is registered")


def test_threads_share_one_self_test(fake):
    fake()
    ran = Counted(_reference_forward, delay=0.01)
    _selftest.register(_cand(ran))
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(_resolve("auto"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == ["fused"] * 4 and ran.calls == len(CASES) + 2


def test_the_fused_backend_runs_the_passed_kernel_on_sm100(fake):
    fake()
    seen = []

    def native(x, *args, **kwargs):
        if isinstance(x, torch.Tensor):
            return _reference_forward(x, *args, **kwargs)
        seen.append(kwargs)
        return "native"

    _selftest.register(_cand(native))
    x = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 128))
    with pytest.raises(FusedKernelUnavailable, match="not used until its self-test passes"):
        _fused.forward(x, None, None, None, None, block_m=128, capacity=256)
    prime_kernels.selftest()
    assert _fused.forward(x, None, None, None, None, num_experts=4, block_m=128, capacity=256) == "native"
    assert seen[0]["capacity"] == 256 and seen[0]["activation_clamp"] is None
    with pytest.raises(FusedKernelUnavailable, match="self-test covers no activation_clamp"):
        _fused.forward(x, None, None, None, None, activation_clamp=7.0, block_m=128, capacity=256)


def test_a_clamp_resolves_past_the_passed_kernel_with_the_reason(fake, monkeypatch):
    fake()
    _selftest.register(_cand(_reference_forward))
    prime_kernels.selftest()
    clamped = dict(block_m=128, activation_clamp=7.0)
    assert _backend.resolve("fwd", "auto", "bf16", _x(), _w13(), block_m=128) == "fused"
    # the grouped pipeline on sm100 takes no clamp either: "auto" names both reasons, "fused" its own
    with pytest.raises(FusedKernelUnavailable, match="self-test covers no activation_clamp.*grouped pipeline cannot"):
        _backend.resolve("fwd", "auto", "bf16", _x(), _w13(), **clamped)
    with pytest.raises(FusedKernelUnavailable, match="self-test covers no activation_clamp"):
        _backend.resolve("fwd", "fused", "bf16", _x(), _w13(), **clamped)
    monkeypatch.setenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", "1")
    with pytest.warns(RuntimeWarning, match="falling back to the pure-PyTorch reference"):
        assert _backend.resolve("fwd", "auto", "bf16", _x(), _w13(), **clamped) == "reference"


# --- the native sm100 forward, as registered when the package loads -------------------------------------------------

PK_ERR_INVALID_ARGUMENT, PK_ERR_NOT_AVAILABLE, PK_ERR_CUDA = 1, 2, 3
NOT_BUILT = "mega_moe_fwd_bf16_sm100 is not built: rebuild with PRIME_KERNELS_CUDA_ARCHS including 100a"


def _blackwell_built() -> tuple[str, ...]:
    return tuple(a for a in prime_kernels.build_info()["cuda_archs"] if a in ("100a", "103a", "100f"))


def _status_on(cc: tuple[int, int]) -> str:
    """What status() must say for the native forward on a device of capability ``cc`` with this build (none of them
    has run its self-test)."""
    archs = tuple(prime_kernels.build_info()["cuda_archs"])
    if not _blackwell_built():
        return f"not built for sm100 (this build has {','.join(archs)}): rebuild with PRIME_KERNELS_CUDA_ARCHS=100a"
    if cc[0] != 10:
        return f"device sm_{cc[0]}{cc[1]} cannot run this sm100 kernel"
    if any(cc in _status._ARCH_RUNS_ON[a] for a in _blackwell_built()):
        return _selftest.NOT_RUN
    return f"device sm_{cc[0]}{cc[1]} needs a rebuild with PRIME_KERNELS_CUDA_ARCHS={_status._SUGGESTED[cc]}"


@pytest.fixture
def device(monkeypatch):
    """device(cc): a CUDA device of capability cc, with this build and the registry as the package left it (its
    verdicts fresh and dropped afterwards)."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    monkeypatch.setattr(_selftest, "_verdicts", {})
    monkeypatch.setattr(_selftest, "_settled", set())
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def set_up(cc):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(_backend, "_ARCH_BY_DEVICE", {})
        monkeypatch.setattr(_status, "_current_cuda_device", lambda: 0)
        monkeypatch.setattr(_status, "_answers", {})
        monkeypatch.setattr(_status, "_status_by_device", {})

    return set_up


def test_the_native_forward_is_registered_with_its_op():
    cand = _selftest.candidate(KEY)
    assert cand is not None and cand.forward is _native_sm100.forward
    assert (cand.key, cand.compiled_as, cand.name) == (KEY, COMPILED, _native_sm100.CANDIDATE_NAME)
    assert hasattr(torch.ops.prime_kernels, _native_sm100.OP)
    # the name the build lists for each Blackwell arch it has, and for no other
    compiled = {a for k, a in _lib.compiled_kernels() if k == COMPILED}
    assert compiled == set(_blackwell_built()), compiled


@pytest.mark.parametrize("cc", [(10, 0), (10, 3), (9, 0)])
def test_native_forward_status_on_a_device_before_its_self_test(device, cc):
    device(cc)
    want = _status_on(cc)
    assert prime_kernels.status()[KEY] == want and _status.reason(KEY) == want
    assert not _status.is_available(want)
    if want != _selftest.NOT_RUN:  # it cannot run here: never tested, the reason reported instead
        report = prime_kernels.selftest(0)
        assert report.skipped == {KEY: want} and not report
    if cc[0] == 10:  # the fused backend's reason there is the native forward's
        assert _backend._fused_reason("bf16", "fwd") == f"{KEY}: {want}"


def test_native_forward_refuses_another_device_before_the_plan(monkeypatch):
    planned = []
    monkeypatch.setattr(_fused, "routing_plan", lambda *a, **k: planned.append(a))
    kw = dict(activation_clamp=None, num_experts=4, block_m=128, capacity=256, save_h=True, keep_x_pool=False)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    with pytest.raises(FusedKernelUnavailable, match=r"mega_moe.bf16.sm100: .*runs on an sm_100 device, x is on cpu"):
        _native_sm100.forward(x, torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2), None, None, **kw)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    on_hopper = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(3, 128))
    with pytest.raises(FusedKernelUnavailable, match=r"x is on cuda:0 \(sm90\)"):
        _native_sm100.forward(on_hopper, None, None, None, None, **kw)
    assert planned == []


def test_native_forward_op_fake_gives_the_shims_shapes():
    T, H, I, E, K, M = 5, 128, 64, 4, 2, 512
    meta = dict(device="meta")
    x = torch.empty(T, H, dtype=torch.bfloat16, **meta)
    src, offs = torch.empty(M, dtype=torch.int32, **meta), torch.empty(E + 1, dtype=torch.int32, **meta)
    w13, w2 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, **meta), torch.empty(E, H, I, dtype=torch.bfloat16, **meta)
    r2p, wts = torch.empty(T, K, dtype=torch.int32, **meta), torch.empty(T, K, **meta)
    op = getattr(torch.ops.prime_kernels, _native_sm100.OP)
    shapes = [tuple(t.shape) for t in op(x, src, offs, w13, w2, K, True, 0.0, True, r2p, wts)]
    assert shapes == [(0, I), (M, 2 * I), (M, H), (M, H), (T, H)]
    shapes = [tuple(t.shape) for t in op(x, src, offs, w13, w2, K, False)]
    assert shapes == [(M, I), (0, 2 * I), (M, H), (0, H), (0, H)]


def _abi():
    import ctypes  # noqa: PLC0415

    core = _lib.load().core
    fn = core.pk_mega_moe_fwd_bf16_sm100
    c = ctypes
    fn.argtypes = [c.c_void_p, c.c_int, c.c_int64, c.c_void_p, c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_int64,
                   c.c_int64, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                   c.c_int64, c.c_void_p, c.c_float, c.c_void_p, c.c_int, c.c_void_p]
    fn.restype = c.c_int

    def call(num_ranks=1, pool_src_rank=None, num_sms=0):
        table = (c.c_void_p * 2)(0x1000, 0x1000)
        rc = fn(c.cast(table, c.c_void_p), num_ranks, 128, 0x2000, pool_src_rank, 2, 0x3000, 4, 256, 128, 64, 0x4000,
                0x5000, 0x6000, 0x7000, 0x8000, 0x6000, 3, None, 0.0, None, num_sms, None)
        return rc, core.pk_last_error().decode()

    return call


@pytest.mark.parametrize("bad, words", [(dict(num_ranks=2), "num_ranks = 2, the sm100 forward takes one rank"),
                                        (dict(pool_src_rank=0x9000), "pool_src_rank must be null (one rank)"),
                                        (dict(num_sms=-1), "num_sms = -1, must be >= 0")])
def test_native_forward_c_abi_refuses_bad_input_before_the_device(bad, words):
    """Through the C ABI on any machine: a build with a Blackwell arch refuses what the kernel does not take, before
    it asks for a device; a build without one says it is not built, whatever the arguments."""
    rc, msg = _abi()(**bad)
    if _blackwell_built():
        assert rc == PK_ERR_INVALID_ARGUMENT and words in msg, (rc, msg)
    else:
        assert rc == PK_ERR_NOT_AVAILABLE and msg == NOT_BUILT, (rc, msg)


def test_native_forward_c_abi_needs_an_sm100_device():
    """Its arguments accepted, the call still launches nothing on a machine without an sm_100 device (the project
    has none): the device check comes before the kernel's own."""
    rc, msg = _abi()()
    if not _blackwell_built():
        assert (rc, msg) == (PK_ERR_NOT_AVAILABLE, NOT_BUILT)
    elif torch.cuda.is_available():
        assert rc == PK_ERR_NOT_AVAILABLE and "this kernel is for sm_100 (Blackwell)" in msg, (rc, msg)
    else:  # no device, or a CUDA runtime without a driver: its own error (PK_ERR_CUDA)
        assert rc in (PK_ERR_NOT_AVAILABLE, PK_ERR_CUDA) and ("no CUDA device" in msg or "cudaGetDevice" in msg), msg


# --- on a Hopper GPU: the harness against a real kernel -------------------------------------------------------------

@requires_sm90
def test_on_hopper_the_harness_passes_our_fused_forward_and_fails_wrong_copies():
    """Run on the H200: our sm90 fused forward as the candidate must pass; the same kernel with the last expert's L1
    weights taken from the first, with one expert's L2 weights 25% off, and writing no output, must fail, with the
    failing shape named."""
    device = torch.device("cuda", torch.cuda.current_device())
    if not _status.is_available(_status.reason("mega_moe.bf16.sm90")):
        pytest.skip(f"mega_moe.bf16.sm90: {_status.reason('mega_moe.bf16.sm90')}")
    start = time.perf_counter()
    v = _selftest.check(_cand(_fused.forward, name="sm90 fused forward"), device)
    assert v.passed, v.report()

    def one_expert_off(x, topk_idx, topk_weights, w13, w2, **kw):
        bad = w2.clone()
        bad[0] *= 1.25
        return _fused.forward(x, topk_idx, topk_weights, w13, bad, **kw)

    def writes_nothing(x, topk_idx, topk_weights, w13, w2, **kw):
        out = list(_fused.forward(x, topk_idx, topk_weights, w13, w2, **kw))
        out[0], out[1] = torch.empty_like(out[0]), torch.empty_like(out[1])
        return tuple(out)

    for name, bad in (("wrong slice", _wrong_slice(_fused.forward)), ("one expert off", one_expert_off),
                      ("writes nothing", writes_nothing), ("raises", _raises)):
        v = _selftest.check(_cand(bad, name=name), device)
        assert not v.passed, name
        assert any(v.why.startswith(c.label()) for c in CASES), v.why
        print(f"{name}: {v.why}")
    assert time.perf_counter() - start < 20


@requires_sm90
def test_on_hopper_the_native_forward_op_raises_its_reason_and_nothing_breaks():
    """On Hopper: the sm100 op, called with a layer's arguments, raises the C ABI's NOT_AVAILABLE reason (not built,
    or not this device) before any launch; the device stays usable (the sm90 fused forward runs after it), status and
    the self-test leave the candidate alone, and its forward refuses before the routing plan."""
    device = torch.device("cuda", torch.cuda.current_device())
    case = CASES[1]
    inputs = make_inputs(case, device, 7)
    T, K = inputs["topk_idx"].shape
    plan = prime_kernels.routing_plan(inputs["topk_idx"], case.experts, 128, validate=False, capacity=capacity(case))
    op = getattr(torch.ops.prime_kernels, _native_sm100.OP)
    with pytest.raises(RuntimeError) as info:
        op(inputs["x"], plan.pool_src_route, plan.expert_offsets, inputs["w13"], inputs["w2"], K, True, 0.0, False,
           plan.route_to_pool.view(T, K), inputs["topk_weights"].float())
    msg = str(info.value)
    assert f"prime_kernels.{_native_sm100.OP}: " in msg, msg
    reason = NOT_BUILT if not _blackwell_built() else "this kernel is for sm_100 (Blackwell); the device is sm_90"
    assert reason in msg, msg
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()  # raises if the refused call left anything behind
    want = _status_on((9, 0))
    assert prime_kernels.status()[KEY] == want
    assert prime_kernels.selftest(device).skipped == {KEY: want}
    with pytest.raises(FusedKernelUnavailable, match=r"x is on cuda:\d+ \(sm90\)"):
        _native_sm100.forward(*inputs.values(), activation_clamp=None, num_experts=case.experts, block_m=128,
                              capacity=capacity(case), save_h=True, keep_x_pool=False)
    if _status.is_available(_status.reason("mega_moe.bf16.sm90")):
        y = _fused.forward(*inputs.values(), num_experts=case.experts, block_m=128, capacity=capacity(case))[0]
        torch.cuda.synchronize()
        assert y.shape == inputs["x"].shape and bool(torch.isfinite(y).all())
