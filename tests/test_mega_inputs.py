"""Inputs a trainer meets at the edges: no tokens, clamp values the kernels would read otherwise, stale backward
states, more experts than the fused kernel takes, block_m values the kernels do not take, and num_sms. The CPU
tests run the reference, or stand-ins for the kernel backends that record what they are handed (the layer's own
logic around them is what they check); the sm90 tests run the kernels."""

import math
import re
from pathlib import Path

import pytest
import torch

from conftest import requires_sm90
from mega_helpers import make_problem, run_layer

import prime_kernels.mega as mega
from prime_kernels.mega import (MegaMoE, _backend, _fused, _grouped, bf16_mega_moe, bf16_mega_moe_backward,
                            constants, get_symm_buffer_for_mega_moe, mega_moe, reference)

E, H, I, K = 6, 32, 16, 3
REPO = Path(__file__).resolve().parent.parent
KERNEL_BACKENDS = ("fused", "grouped")


def _empty_problem(H=H, I=I, E=E, K=K, device="cpu"):
    x, idx, w, w13, w2, _ = make_problem(4, H, I, E, K, seed=61, device=device)
    return x[:0].contiguous(), idx[:0].contiguous(), w[:0].contiguous(), w13, w2


class _Kernels:
    """Stand-ins for the kernel backends on the CPU: they record their keyword arguments and compute with the
    reference (so the gradients are real), or refuse to be called at all."""

    def __init__(self, monkeypatch, backend, refuse=False):
        self.calls = []
        monkeypatch.setattr(_backend, "resolve_backend", lambda *a, **k: backend)

        def fwd(*args, **kw):
            if refuse:
                raise AssertionError("a backend ran for an empty batch")
            self.calls.append(("fwd", kw))
            out = reference.forward(*args, **{k: v for k, v in kw.items() if k in _REF_FWD})
            return tuple(out) + ((args[0].new_empty((0, args[0].shape[1])),) if "keep_x_pool" in kw else ())

        def bwd(*args, **kw):
            if refuse:
                raise AssertionError("a backend ran for an empty batch")
            self.calls.append(("bwd", kw))
            return reference.backward(*args, **{k: v for k, v in kw.items() if k in _REF_BWD})

        for mod in (_fused, _grouped):
            monkeypatch.setattr(mod, "forward", fwd)
            monkeypatch.setattr(mod, "backward", bwd)


_REF_FWD = ("activation_clamp", "group", "num_experts", "max_tokens_per_rank", "block_m", "capacity", "save_h")
_REF_BWD = ("activation_clamp", "group", "num_experts", "recompute", "need_wgrad", "dw13_accum", "dw2_accum")


# --------------------------------------------------------------------------------------------------------------
# T = 0
# --------------------------------------------------------------------------------------------------------------


def _check_empty_layer(fn, x, idx, w, w13, w2, accum=False):
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    acc = (torch.randn(w13.shape), torch.randn(w2.shape)) if accum else None
    acc0 = tuple(a.clone() for a in acc) if accum else None
    y = fn(leaves[0], idx, leaves[1], leaves[2], leaves[3], acc)
    assert y.shape == (0, x.shape[1]) and y.dtype == x.dtype
    y.backward(torch.empty_like(y))
    assert leaves[0].grad.shape == x.shape and leaves[1].grad.shape == w.shape
    if accum:
        assert leaves[2].grad is None and leaves[3].grad is None
        assert all(torch.equal(a, b) for a, b in zip(acc, acc0))
    else:
        assert torch.equal(leaves[2].grad, torch.zeros_like(w13))
        assert torch.equal(leaves[3].grad, torch.zeros_like(w2))


@pytest.mark.parametrize("accum", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_empty_batch_on_the_reference(recompute, accum):
    x, idx, w, w13, w2 = _empty_problem()
    _check_empty_layer(lambda a, i, b, c, d, acc: mega_moe(a, i, b, c, d, backend="reference", recompute=recompute,
                                                           wgrad_accum=acc), x, idx, w, w13, w2, accum)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS + ("auto",))
@pytest.mark.parametrize("accum", [False, True])
def test_empty_batch_runs_no_backend(monkeypatch, backend, accum):
    """Whatever backend resolves, an empty batch is answered before any backend (the kernels take no empty
    operands): y [0, H], empty dX and d topk_weights, zero (or untouched accumulated) weight gradients."""
    _Kernels(monkeypatch, "fused" if backend == "auto" else backend, refuse=True)
    x, idx, w, w13, w2 = _empty_problem(H=128, I=128)
    _check_empty_layer(lambda a, i, b, c, d, acc: mega_moe(a, i, b, c, d, backend=backend, wgrad_accum=acc),
                       x, idx, w, w13, w2, accum)
    layer = MegaMoE(E, 128, 128, K, backend=backend, num_sms=4)
    y = layer(x, idx, w)
    y.sum().backward()
    assert y.shape == (0, 128)
    assert torch.equal(layer.w13.grad, torch.zeros_like(layer.w13))
    assert torch.equal(layer.w2.grad, torch.zeros_like(layer.w2))


def test_empty_batch_forward_op_outputs_match_the_fake():
    x, idx, w, w13, w2 = _empty_problem()
    for keep in (False, True):
        args = (x, idx, w, w13, w2, None, None, None, "", E, 1, 0, 128, True, "reference", "bf16", 0, keep, 0)
        torch.library.opcheck(torch.ops.prime_kernels.mega_moe_fwd.default, args)
        out = torch.ops.prime_kernels.mega_moe_fwd(*args)
        assert out[0].shape == (0, H) and not out[1].any() and not out[2].any() and not out[3].any()
        assert (out[4] == -1).all() and (out[5] == -1).all() and out[6].shape == (0, K)


@pytest.mark.parametrize("backend", ("reference",) + KERNEL_BACKENDS + ("auto",))
def test_empty_batch_low_level(monkeypatch, backend):
    if backend != "reference":
        _Kernels(monkeypatch, "fused" if backend == "auto" else backend, refuse=True)
    x, idx, w, w13, w2 = _empty_problem()
    buf = get_symm_buffer_for_mega_moe(None, E, 8, K, H, I, device="cpu", reuse=False)
    buf.stage(x, idx, w)
    y = torch.empty(0, H, dtype=torch.bfloat16)
    stats = torch.arange(E, dtype=torch.int32)
    state = bf16_mega_moe(y, w13, w2, buf, backend=backend, save_h=True, cumulative_local_expert_recv_stats=stats)
    assert torch.equal(stats, torch.arange(E, dtype=torch.int32))
    assert int(state.plan.expert_counts.sum()) == 0 and state.plan.route_to_pool.shape == (0, K)
    dx, dt, dy = torch.empty(0, H, dtype=torch.bfloat16), torch.empty(0, K), torch.empty(0, H, dtype=torch.bfloat16)
    d13, d2 = torch.full_like(w13, 3.0), torch.full(w2.shape, 3.0)
    bf16_mega_moe_backward(dx, d13, d2, dt, dy, w13, w2, buf, state=state, backend=backend)
    assert not d13.any() and not d2.any()
    a13, a2 = torch.full(w13.shape, 3.0), torch.full(w2.shape, 3.0)
    bf16_mega_moe_backward(dx, a13, a2, dt, dy, w13, w2, buf, backend=backend, accumulate=True)
    assert (a13 == 3).all() and (a2 == 3).all()


@requires_sm90
@pytest.mark.parametrize("backend", ["reference", "grouped", "fused", "auto"])
def test_empty_batch_on_the_gpu(backend):
    """The kernel backends on real CUDA tensors. There is no fused backward kernel, so backend='fused' is checked
    through its forward only (its backward raises that reason for any T)."""
    x, idx, w, w13, w2 = _empty_problem(H=256, I=128, E=8, K=2, device="cuda")
    if backend == "fused":
        with torch.no_grad():
            y = mega_moe(x, idx, w, w13, w2, backend=backend)
        assert y.shape == (0, 256) and y.is_cuda
    else:
        for accum in (False, True):
            acc = (torch.randn(w13.shape, device="cuda"), torch.randn(w2.shape, device="cuda")) if accum else None
            acc0 = tuple(a.clone() for a in acc) if accum else None
            leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
            y = mega_moe(leaves[0], idx, *leaves[1:], backend=backend, wgrad_accum=acc)
            y.backward(torch.empty_like(y))
            assert y.shape == (0, 256) and leaves[0].grad.shape == (0, 256) and leaves[1].grad.shape == (0, 2)
            if accum:
                assert all(torch.equal(a, b) for a, b in zip(acc, acc0))
            else:
                assert not leaves[2].grad.any() and not leaves[3].grad.any()
    buf = get_symm_buffer_for_mega_moe(None, 8, 16, 2, 256, 128, reuse=False)
    buf.stage(x, idx, w)
    state = bf16_mega_moe(torch.empty(0, 256, dtype=torch.bfloat16, device="cuda"), w13, w2, buf, backend=backend)
    if backend != "fused":
        d13 = torch.full_like(w13, 3.0)
        d2 = torch.full_like(w2, 3.0)
        bf16_mega_moe_backward(torch.empty_like(x), d13, d2, torch.empty_like(w), torch.empty_like(x), w13, w2, buf,
                               state=state, backend=backend)
        assert not d13.any() and not d2.any()
    torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------------------
# activation_clamp
# --------------------------------------------------------------------------------------------------------------

BAD_CLAMPS = [0.0, -0.0, -1.0, math.nan, math.inf, -math.inf]
CLAMP_MSG = r"activation_clamp must be None \(no clamp\) or a finite number > 0"


@pytest.mark.parametrize("clamp", BAD_CLAMPS)
def test_bad_clamp_is_rejected_everywhere(clamp):
    x, idx, w, w13, w2, dy = make_problem(5, H, I, E, K, seed=62)
    with pytest.raises(ValueError, match=CLAMP_MSG):
        mega_moe(x, idx, w, w13, w2, backend="reference", activation_clamp=clamp)
    with pytest.raises(ValueError, match=CLAMP_MSG):
        MegaMoE(E, H, I, K, backend="reference", activation_clamp=clamp)
    with pytest.raises(ValueError, match=CLAMP_MSG):  # the op, called directly
        torch.ops.prime_kernels.mega_moe_fwd(x, idx, w, w13, w2, None, None, clamp, "", E, 1, 5, 8, True, "reference",
                                         "bf16", 0)
    buf = get_symm_buffer_for_mega_moe(None, E, 8, K, H, I, device="cpu", reuse=False)
    buf.stage(x, idx, w)
    with pytest.raises(ValueError, match=CLAMP_MSG):
        bf16_mega_moe(torch.empty(5, H, dtype=torch.bfloat16), w13, w2, buf, backend="reference",
                      activation_clamp=clamp)
    with pytest.raises(ValueError, match=CLAMP_MSG):
        bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf,
                               backend="reference", activation_clamp=clamp)


def test_clamp_that_is_not_a_number_is_a_type_error():
    x, idx, w, w13, w2, _ = make_problem(5, H, I, E, K, seed=63)
    for clamp in (True, "0.5"):
        with pytest.raises(TypeError, match="activation_clamp must be None"):
            mega_moe(x, idx, w, w13, w2, backend="reference", activation_clamp=clamp)


class _FusedOp:
    """Records the arguments the fused forward hands the fused op (on the CPU, with outputs of the right
    shapes)."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(torch.ops.prime_kernels, "mega_moe_fused_fwd", self, raising=False)

    def __call__(self, x, src, offsets, w13, w2, top_k, save_h, clamp, keep_x_pool, r2p, weights, **kw):
        self.calls.append(dict(clamp=clamp, **kw))
        m, twoI, Hh = src.shape[0], w13.shape[1], x.shape[1]
        return (x.new_empty((0, twoI // 2)), x.new_zeros((m if save_h else 0, twoI)), x.new_zeros((m, Hh)),
                x.new_zeros((m if keep_x_pool else 0, Hh)), x.new_zeros((r2p.shape[0], Hh)))


@pytest.mark.parametrize("clamp,want", [(None, 0.0), (0.75, 0.75), (3, 3.0)])
def test_fused_op_reads_no_clamp_as_zero_and_gets_num_sms(monkeypatch, clamp, want):
    """The fused kernels encode "no clamp" as 0: None becomes 0.0 at the op call only, a bound passes as itself;
    num_sms reaches the op as an int (0 = every SM)."""
    op = _FusedOp(monkeypatch)
    x, idx, w, w13, w2, _ = make_problem(7, H, I, E, K, seed=64)
    cap = _backend.capacity(7, K, E, 1, 7, 128)
    for sms in (0, 5):
        _fused.forward(x, idx, w, w13, w2, activation_clamp=clamp, num_experts=E, block_m=128, capacity=cap,
                       num_sms=sms)
        assert op.calls[-1] == {"clamp": want, "num_sms": sms}
        assert type(op.calls[-1]["clamp"]) is float and type(op.calls[-1]["num_sms"]) is int


# --------------------------------------------------------------------------------------------------------------
# backward state
# --------------------------------------------------------------------------------------------------------------


def _staged_forward(T=11, seed=65, buf=None, restage=None):
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, seed=seed, masked_frac=0.1)
    buf = buf or get_symm_buffer_for_mega_moe(None, E, 16, K, H, I, device="cpu", reuse=False)
    buf.stage(x, idx, w)
    y = torch.empty(T, H, dtype=torch.bfloat16)
    state = bf16_mega_moe(y, w13, w2, buf, backend="reference", save_h=True)
    return buf, state, (x, idx, w, w13, w2, dy)


def _backward(buf, state, p, **kw):
    x, idx, w, w13, w2, dy = p
    out = [torch.empty_like(x), torch.empty_like(w13), torch.empty_like(w2), torch.empty_like(w)]
    bf16_mega_moe_backward(out[0], out[1], out[2], out[3], dy, w13, w2, buf, state=state, backend="reference", **kw)
    return out


def test_state_of_the_staged_inputs_is_accepted():
    buf, state, p = _staged_forward()
    got = _backward(buf, state, p)
    assert all(torch.equal(a, b) for a, b in zip(got, _backward(buf, None, p)))


@pytest.mark.parametrize("how", ["stage", "copy"])
def test_state_after_a_newer_staging_is_rejected(how):
    """The failure this guards: forward A, forward B on the same buffer, then A's backward with A's state would
    use A's plan and h against B's inputs, silently. Any staging after a state's forward retires the state,
    through stage() or through copies into the views."""
    buf, state_a, pa = _staged_forward(seed=66)
    _, state_b, pb = _staged_forward(seed=67, buf=buf)
    with pytest.raises(ValueError, match="staged again since"):
        _backward(buf, state_a, pa)
    _backward(buf, state_b, pb)  # B's own state still belongs to what is staged
    x, idx, w = pb[:3]
    if how == "stage":
        buf.stage(x, idx, w)
    else:
        buf.topk_idx[:x.shape[0]].copy_(idx)
    with pytest.raises(ValueError, match="staged again since"):
        _backward(buf, state_b, pb)
    _backward(buf, None, pb)  # without a state: plan and h from the inputs staged now


def test_state_of_other_tokens_or_buffer_is_rejected():
    buf, state, p = _staged_forward(T=11, seed=68)
    x, idx, w, w13, w2, dy = make_problem(9, H, I, E, K, seed=69)
    with pytest.raises(ValueError, match=r"state was made for T=11 tokens but dy has T=9"):
        _backward(buf, state, (x, idx, w, w13, w2, dy))
    other = get_symm_buffer_for_mega_moe(None, E, 16, K, H, I, device="cpu", reuse=False)
    other.stage(*p[:3])
    with pytest.raises(ValueError, match="not made by bf16_mega_moe on this buffer"):
        _backward(other, state, p)
    with pytest.raises(ValueError, match="block_m=128"):
        _backward(buf, state, p, block_m=64)
    with pytest.raises(TypeError, match="MegaMoEState"):
        _backward(buf, state.plan, p)
    with pytest.raises(ValueError, match="not made by bf16_mega_moe"):
        _backward(buf, mega.MegaMoEState(plan=state.plan, h=state.h), p)


def test_state_with_other_top_k_is_rejected():
    buf, state, p = _staged_forward(T=10, seed=70)
    x, idx, w, w13, w2, dy = p
    # the same buffer read with fewer top-k columns cannot happen (the buffer fixes K); a state whose plan has
    # another K is a hand-made one
    state.plan.top_k = K - 1
    with pytest.raises(ValueError, match=f"state was made for K={K - 1}"):
        _backward(buf, state, p)


# --------------------------------------------------------------------------------------------------------------
# the fused kernel's expert limit
# --------------------------------------------------------------------------------------------------------------


def _header_constant(path, name):
    text = (REPO / path).read_text()
    m = re.search(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
    assert m, f"{name} not found in {path}"
    return int(m.group(1))


def test_expert_limits_are_the_kernels():
    if not (REPO / "csrc").is_dir():
        pytest.skip("the CUDA sources are not beside the tests")
    assert constants.FUSED_MAX_EXPERTS == _header_constant("csrc/sm90/mega_moe_fwd_roles.cuh", "kMegaMaxExperts")
    assert constants.GROUPED_MAX_EXPERTS == _header_constant("csrc/sm90/kernel_common.cuh", "kMaxGroups")


@pytest.fixture
def kernels_available(monkeypatch):
    st = {name: "available" for name in set(_backend.KERNEL_NAMES.values())}
    st[_backend.GROUPED_KEY] = "available"
    st["mega_moe_backward.bf16.sm90"] = "not implemented yet"
    monkeypatch.setattr(_backend, "_status", lambda: st)
    monkeypatch.delenv(constants.ALLOW_FALLBACK_ENV, raising=False)
    return st


def _resolve(backend, El, direction="fwd", **kw):
    return _backend.choose_backend(backend, "bf16", direction, device_type="cuda", hidden=256, intermediate=128,
                                   num_local_experts=El, **kw)


def test_more_experts_than_the_fused_kernel_takes(kernels_available):
    lim = constants.FUSED_MAX_EXPERTS
    assert _resolve("auto", lim) == ("fused", None)
    which, why = _resolve("auto", lim + 1)
    assert which == "grouped" and f"FUSED_MAX_EXPERTS={lim}" in why and str(lim + 1) in why
    assert _resolve("auto", lim + 1, "bwd")[0] == "grouped"
    with pytest.raises(ValueError, match=f"backend='fused' cannot run: {lim + 1} local experts exceed .*FUSED_MAX_EXPERTS={lim}"):
        _resolve("fused", lim + 1)
    assert _resolve("grouped", lim + 1)[0] == "grouped"
    glim = constants.GROUPED_MAX_EXPERTS
    with pytest.raises(_backend.FusedKernelUnavailable, match=f"GROUPED_MAX_EXPERTS={glim}"):
        _resolve("auto", glim + 1)
    with pytest.raises(_backend.FusedKernelUnavailable, match=f"GROUPED_MAX_EXPERTS={glim}"):
        _resolve("grouped", glim + 1)


def test_fused_backend_with_too_many_experts_raises_from_the_layer():
    lim = constants.FUSED_MAX_EXPERTS
    x, idx, w, w13, w2, _ = make_problem(2, 128, 128, lim + 1, 1, seed=71)
    with pytest.raises(ValueError, match=f"exceed the fused forward kernel's limit of FUSED_MAX_EXPERTS={lim}"):
        mega_moe(x, idx, w, w13, w2, backend="fused")


@requires_sm90
def test_more_experts_than_the_fused_kernel_takes_run_grouped_under_auto():
    from mega_helpers import loop_reference, rel_err

    El = constants.FUSED_MAX_EXPERTS + 8
    x, idx, w, w13, w2, dy = make_problem(96, 128, 128, El, 2, seed=72)
    got = run_layer(*[t.cuda() for t in (x, idx, w, w13, w2, dy)], backend="auto")
    ref = loop_reference(x, idx, w, w13, w2, dy)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, ref):
        assert rel_err(a.cpu(), b) < 1e-2, name


# --------------------------------------------------------------------------------------------------------------
# block_m
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [0, -1, constants.MAX_BLOCK_M + 1, 1.5, True, "128"])
def test_block_m_out_of_range_lists_the_accepted_values(block_m):
    x, idx, w, w13, w2, dy = make_problem(5, H, I, E, K, seed=73)
    msg = re.escape(f"block_m must be one of {constants.KERNEL_BLOCK_MS}")
    with pytest.raises(ValueError, match=msg):
        mega_moe(x, idx, w, w13, w2, backend="reference", block_m=block_m)
    with pytest.raises(ValueError, match=msg):
        MegaMoE(E, H, I, K, backend="reference", block_m=block_m)
    buf = get_symm_buffer_for_mega_moe(None, E, 8, K, H, I, device="cpu", reuse=False)
    buf.stage(x, idx, w)
    with pytest.raises(ValueError, match=msg):
        bf16_mega_moe(torch.empty(5, H, dtype=torch.bfloat16), w13, w2, buf, backend="reference", block_m=block_m)
    with pytest.raises(ValueError, match=msg):
        bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf,
                               backend="reference", block_m=block_m)


def test_kernel_backends_take_only_their_block_m(kernels_available):
    accepted = re.escape(f"accepted values are {constants.KERNEL_BLOCK_MS}")
    for backend in ("fused", "grouped", "auto"):
        assert _resolve(backend, 8, block_m=128)[0] != "reference"
        with pytest.raises(ValueError, match=accepted):
            _resolve(backend, 8, block_m=64)
    # the reference takes any block_m in range
    x, idx, w, w13, w2, dy = make_problem(9, H, I, E, K, seed=74)
    a = run_layer(x, idx, w, w13, w2, dy, backend="reference", block_m=64)
    b = run_layer(x, idx, w, w13, w2, dy, backend="reference", block_m=128)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_block_m_the_kernels_do_not_take_is_a_value_error_from_the_layer():
    """Today block_m=0 divided by zero; a value in range that the kernels do not take fails before the device is
    looked at when a kernel backend is named (the call is wrong on any device)."""
    x, idx, w, w13, w2, dy = make_problem(5, 128, 128, E, K, seed=75)
    accepted = re.escape(f"accepted values are {constants.KERNEL_BLOCK_MS}")
    for backend in KERNEL_BACKENDS:
        with pytest.raises(ValueError, match=accepted):
            mega_moe(x, idx, w, w13, w2, backend=backend, block_m=64)
        buf = get_symm_buffer_for_mega_moe(None, E, 8, K, 128, 128, device="cpu", reuse=False)
        buf.stage(x, idx, w)
        with pytest.raises(ValueError, match=accepted):
            bf16_mega_moe(torch.empty(5, 128, dtype=torch.bfloat16), w13, w2, buf, backend=backend, block_m=64)
        with pytest.raises(ValueError, match=accepted):
            bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf,
                                   backend=backend, block_m=64)


# --------------------------------------------------------------------------------------------------------------
# num_sms
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_sms", [0, -3, 2.0, True, "8"])
def test_bad_num_sms_is_rejected_everywhere(num_sms):
    x, idx, w, w13, w2, dy = make_problem(5, H, I, E, K, seed=76)
    msg = r"num_sms must be None \(every SM\) or an int >= 1"
    with pytest.raises(ValueError, match=msg):
        mega_moe(x, idx, w, w13, w2, backend="reference", num_sms=num_sms)
    with pytest.raises(ValueError, match=msg):
        MegaMoE(E, H, I, K, backend="reference", num_sms=num_sms)
    buf = get_symm_buffer_for_mega_moe(None, E, 8, K, H, I, device="cpu", reuse=False)
    buf.stage(x, idx, w)
    with pytest.raises(ValueError, match=msg):
        bf16_mega_moe(torch.empty(5, H, dtype=torch.bfloat16), w13, w2, buf, backend="reference", num_sms=num_sms)
    with pytest.raises(ValueError, match=msg):
        bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf,
                               backend="reference", num_sms=num_sms)


def test_op_num_sms_must_not_be_negative():
    x, idx, w, w13, w2, _ = make_problem(5, H, I, E, K, seed=77)
    with pytest.raises(ValueError, match=r"num_sms must be an int >= 0 \(0 = every SM\)"):
        torch.ops.prime_kernels.mega_moe_fwd(x, idx, w, w13, w2, None, None, None, "", E, 1, 5, 8, True, "reference",
                                         "bf16", 0, False, -1)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("num_sms,want", [(None, 0), (1, 1), (7, 7)])
def test_num_sms_reaches_forward_and_backward(monkeypatch, backend, num_sms, want):
    """The layer hands num_sms (0 = every SM) to the backend of its forward and, through autograd, of its backward;
    so do the low-level calls. The reference is handed none (it ignores it)."""
    k = _Kernels(monkeypatch, backend)
    Hk, Ik = 128, 128  # sizes the kernel backends take (MegaMoE checks them for backend='fused')
    x, idx, w, w13, w2, dy = make_problem(9, Hk, Ik, E, K, seed=78, masked_frac=0.1)
    got = run_layer(x, idx, w, w13, w2, dy, backend=backend, num_sms=num_sms)
    assert [(d, kw["num_sms"]) for d, kw in k.calls] == [("fwd", want), ("bwd", want)]
    ref = run_layer(x, idx, w, w13, w2, dy, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    k.calls.clear()
    layer = MegaMoE(E, Hk, Ik, K, backend=backend, num_sms=num_sms)
    layer(x, idx, w).sum().backward()
    assert [(d, kw["num_sms"]) for d, kw in k.calls] == [("fwd", want), ("bwd", want)]
    k.calls.clear()
    buf = get_symm_buffer_for_mega_moe(None, E, 16, K, Hk, Ik, device="cpu", reuse=False)
    buf.stage(x, idx, w)
    state = bf16_mega_moe(torch.empty(9, Hk, dtype=torch.bfloat16), w13, w2, buf, backend=backend, num_sms=num_sms)
    bf16_mega_moe_backward(torch.empty_like(x), None, None, torch.empty_like(w), dy, w13, w2, buf, state=state,
                           backend=backend, num_sms=num_sms)
    assert [(d, kw["num_sms"]) for d, kw in k.calls] == [("fwd", want), ("bwd", want)]


def test_ops_with_num_sms_pass_opcheck():
    x, idx, w, w13, w2, dy = make_problem(8, H, I, E, K, seed=79, masked_frac=0.2)
    args = (x, idx, w, w13, w2, None, None, None, "", E, 1, 8, 8, True, "reference", "bf16", 0, False, 3)
    torch.library.opcheck(torch.ops.prime_kernels.mega_moe_fwd.default, args)
    _, h, counts, offsets, src, srank, r2p, xp = torch.ops.prime_kernels.mega_moe_fwd(*args)
    bwd = (dy, x, idx, w, w13, w2, h, counts, offsets, src, srank, r2p, None, None, None, "", E, False, True,
           "reference", "bf16", 0, None, 3)
    torch.library.opcheck(torch.ops.prime_kernels.mega_moe_bwd.default, bwd)


@requires_sm90
@pytest.mark.parametrize("backend", ["auto", "grouped"])
def test_num_sms_gives_the_same_bits_on_the_gpu(backend):
    x, idx, w, w13, w2, dy = [t.cuda() for t in make_problem(384, 256, 128, 16, 4, seed=80, masked_frac=0.1)]
    base = run_layer(x, idx, w, w13, w2, dy, backend=backend)
    for sms in (1, 7, 64):
        got = run_layer(x, idx, w, w13, w2, dy, backend=backend, num_sms=sms)
        for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, base):
            assert torch.equal(a, b), f"num_sms={sms}: {name}"
