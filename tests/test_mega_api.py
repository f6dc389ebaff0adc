"""Backend selection, the DeepGEMM-shaped low-level calls, buffers, and the fp8 names."""

import warnings

import pytest
import torch

from mega_helpers import make_problem, rel_err, run_layer

import prime_kernels.mega as mega
from prime_kernels.mega import _backend
from prime_kernels.mega import (
    bf16_mega_moe,
    bf16_mega_moe_backward,
    get_symm_buffer_for_mega_moe,
    mega_moe,
    transform_weights_for_mega_moe,
)

E, H, I, K = 6, 32, 16, 3


@pytest.fixture
def status(monkeypatch):
    """Pretend prime_kernels.status() returns the dict the test puts in (default: nothing available)."""
    st = {name: "not implemented yet" for name in set(_backend.KERNEL_NAMES.values())}
    monkeypatch.setattr(_backend, "_status", lambda: st)
    monkeypatch.setattr(_backend, "_warned", set())
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    return st


def test_fused_reason_reads_status(status):
    assert _backend._fused_reason("bf16", "fwd") == "mega_moe.bf16.sm90: not implemented yet"
    status["mega_moe.bf16.sm90"] = "available"
    assert _backend._fused_reason("bf16", "fwd") is None
    assert "mega_moe_backward.bf16.sm90" in _backend._fused_reason("bf16", "bwd")
    assert "mega_moe.mxfp8.sm100" in _backend._fused_reason("mxfp8", "fwd")


def test_fused_reason_without_status_function(monkeypatch):
    import prime_kernels

    monkeypatch.delattr(prime_kernels, "status", raising=False)
    assert _backend._fused_reason("bf16", "fwd").endswith("not implemented yet")


def test_reference_always_runs(status):
    assert _backend.resolve_backend("reference", "bf16", "fwd", device_type="cuda") == "reference"


def test_fused_raises_status_reason(status):
    with pytest.raises(_backend.FusedKernelUnavailable, match="mega_moe.bf16.sm90: not implemented yet"):
        _backend.resolve_backend("fused", "bf16", "fwd", device_type="cuda", hidden=128, intermediate=128)
    status["mega_moe.bf16.sm90"] = "available"
    assert _backend.resolve_backend("fused", "bf16", "fwd", device_type="cuda", hidden=128, intermediate=128) == "fused"


def test_auto_raises_without_env(status):
    with pytest.raises(_backend.FusedKernelUnavailable, match="PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK=1"):
        _backend.resolve_backend("auto", "bf16", "fwd", device_type="cuda", hidden=128, intermediate=128)


def test_auto_falls_back_with_env_and_warns_once(status, monkeypatch):
    monkeypatch.setenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", "1")
    with pytest.warns(RuntimeWarning, match="falling back to the pure-PyTorch reference"):
        assert _backend.resolve_backend("auto", "bf16", "fwd", device_type="cuda") == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.resolve_backend("auto", "bf16", "fwd", device_type="cuda") == "reference"


def test_auto_on_cpu_end_to_end(status, monkeypatch):
    x, idx, w, w13, w2, dy = make_problem(8, 128, 128, E, K, seed=51)
    with pytest.raises(_backend.FusedKernelUnavailable, match="need CUDA tensors"):
        mega_moe(x, idx, w, w13, w2)
    monkeypatch.setenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", "1")
    with pytest.warns(RuntimeWarning):
        y = mega_moe(x, idx, w, w13, w2)
    assert torch.equal(y, mega_moe(x, idx, w, w13, w2, backend="reference"))


def test_auto_prefers_fused_when_available(status):
    status["mega_moe.bf16.sm90"] = "available"
    assert _backend.resolve_backend("auto", "bf16", "fwd", device_type="cuda", hidden=256, intermediate=128) == "fused"


def test_reference_has_bf16_and_fp8_numerics_and_no_mxfp8(status):
    x, idx, w, w13, w2, _ = make_problem(4, H, I, E, K, seed=52)
    with pytest.raises(NotImplementedError, match="'mxfp8' has no reference numerics"):
        mega_moe(x, idx, w, w13, w2, precision="mxfp8", backend="reference")
    for precision in ("fp8", "fp8_bwd"):
        assert _backend.resolve_backend("reference", precision, "fwd", device_type="cuda") == "reference"
        assert mega_moe(x, idx, w, w13, w2, precision=precision, backend="reference").shape == x.shape


SHAPE = dict(device_type="cuda", hidden=256, intermediate=128)


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("backend", ["auto", "fused", "grouped"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_fp8_on_kernel_backends_raises_never_runs_bf16(status, precision, backend, direction):
    """Every kernel backend refuses fp8 / fp8_bwd, in both directions, while the FP8 kernels are unavailable, even
    where the bf16 kernels are available (fp8_bwd's forward is the bf16 kernel's: it must not run ahead of a backward
    that cannot); each direction names its own kernels' reason first: fp8's forward the fused FP8 forward's and the
    grouped FP8 pipeline's, the backward the FP8 backward pipeline's."""
    for name in ("mega_moe.bf16.sm90", "mega_moe_backward.bf16.sm90", _backend.GROUPED_KEY):
        status[name] = "available"
    if (precision, direction) == ("fp8", "fwd"):
        want = ("precision='fp8': mega_moe.fp8.sm90: not implemented yet; "
                "mega_moe_grouped.fp8.sm90: not implemented yet")
    else:
        want = f"precision='{precision}': mega_moe.fp8_bwd.sm90: not implemented yet"
    with pytest.raises(_backend.FusedKernelUnavailable, match=want):
        _backend.resolve_backend(backend, precision, direction, **SHAPE)


@pytest.mark.parametrize("backend", ["auto", "fused", "grouped"])
def test_fp8_bwd_takes_the_clamp_with_its_entry_and_expert_parallelism_on_the_grouped_path(status, backend):
    """fp8_bwd with activation_clamp runs where the grouped clamp entry (the L1 that saves h with the clamp masks,
    which its recompute runs) is available, in both directions and before any forward; under an expert-parallel
    group the grouped path (all-to-all) runs it, and backend "fused" (the peer-memory path there) gives its entry's
    reason."""
    for name in ("mega_moe.bf16.sm90", _backend.GROUPED_KEY, "mega_moe.fp8_bwd.sm90"):
        status[name] = "available"
    for direction in ("fwd", "bwd"):
        with pytest.raises(_backend.FusedKernelUnavailable,
                           match=f"with activation_clamp: {_backend.GROUPED_CLAMP_KEY}: not implemented yet"):
            _backend.resolve_backend(backend, "fp8_bwd", direction, activation_clamp=10.0, **SHAPE)
        if backend == "fused":
            with pytest.raises(_backend.FusedKernelUnavailable, match=f"{_backend.PEER_KEY}: not implemented yet"):
                _backend.resolve_backend(backend, "fp8_bwd", direction, ep_size=2, **SHAPE)
        else:
            assert _backend.resolve_backend(backend, "fp8_bwd", direction, ep_size=2, **SHAPE) == "grouped"
    status[_backend.GROUPED_CLAMP_KEY] = "available"
    for direction in ("fwd", "bwd"):
        assert _backend.resolve_backend(backend, "fp8_bwd", direction, activation_clamp=10.0, **SHAPE) in (
            "fused", "grouped")


def test_fp8_runs_on_the_kernels_once_both_directions_exist(status):
    status["mega_moe.fp8.sm90"] = "available"
    with pytest.raises(_backend.FusedKernelUnavailable, match="mega_moe.fp8_bwd.sm90: not implemented yet"):
        _backend.resolve_backend("fused", "fp8", "fwd", **SHAPE)
    status["mega_moe.fp8_bwd.sm90"] = "available"
    for direction in ("fwd", "bwd"):
        assert _backend.resolve_backend("fused", "fp8", direction, **SHAPE) == "fused"
    with pytest.raises(_backend.FusedKernelUnavailable, match="mega_moe_grouped.fp8.sm90: not implemented yet"):
        _backend.resolve_backend("grouped", "fp8", "fwd", **SHAPE)
    status[_backend.GROUPED_FP8_KEY] = "available"
    assert _backend.resolve_backend("grouped", "fp8", "fwd", **SHAPE) == "grouped"


def test_fp8_runs_the_grouped_fp8_forward_where_no_fused_one_exists(status):
    """Where the fused FP8 forward cannot run but the grouped FP8 forward pipeline and the FP8 backward pipeline
    can: "auto" and "grouped" run the pipeline forward, "fused" raises for the forward; the forward and the
    backward through backend.forward / backward on the CPU give the reference's fp8 numbers (the ops' CPU
    kernels)."""
    from prime_kernels.mega import reference

    status[_backend.GROUPED_FP8_KEY] = "available"
    status["mega_moe.fp8_bwd.sm90"] = "available"
    for backend in ("auto", "grouped"):
        assert _backend.resolve_backend(backend, "fp8", "fwd", **SHAPE) == "grouped"
    with pytest.raises(_backend.FusedKernelUnavailable, match="no fused kernel for precision='fp8' fwd: "
                                                              "mega_moe.fp8.sm90: not implemented yet"):
        _backend.resolve_backend("fused", "fp8", "fwd", **SHAPE)
    # with a clamp: the FP8 L1's clamp instantiation's entry decides, for every backend; the fused FP8 forward has none
    clamp_key = _backend.GROUPED_FP8_CLAMP_KEY
    status[clamp_key] = "compiled, not yet run on a GPU"
    for backend in ("auto", "grouped"):
        with pytest.raises(_backend.FusedKernelUnavailable, match=f"{clamp_key}: compiled, not yet run on a GPU"):
            _backend.resolve_backend(backend, "fp8", "fwd", activation_clamp=5.0, **SHAPE)
    status[clamp_key] = "available"
    for backend in ("auto", "grouped"):
        assert _backend.resolve_backend(backend, "fp8", "fwd", activation_clamp=5.0, **SHAPE) == "grouped"
    status["mega_moe.fp8.sm90"] = "available"
    assert _backend.resolve_backend("auto", "fp8", "fwd", activation_clamp=5.0, **SHAPE) == "grouped"
    assert _backend.resolve_backend("auto", "fp8", "fwd", **SHAPE) == "fused"
    with pytest.raises(_backend.FusedKernelUnavailable, match="fused FP8 forward kernel takes no activation_clamp"):
        _backend.resolve_backend("fused", "fp8", "fwd", activation_clamp=5.0, **SHAPE)
    status["mega_moe.fp8.sm90"] = "not implemented yet"
    x, idx, w, w13, w2, dy = make_problem(24, 128, 128, E, K, seed=59)
    opts = dict(precision="fp8", activation_clamp=None, group=None, num_experts=E)
    fwd = _backend.forward("grouped", x, idx, w, w13, w2, ep_size=1, max_tokens_per_rank=None, block_m=128,
                           save_h=True, **opts)
    want = _backend.forward("reference", x, idx, w, w13, w2, ep_size=1, max_tokens_per_rank=None, block_m=128,
                            save_h=True, **opts)
    assert rel_err(fwd[0], want[0]) < 1e-4
    state = fwd[1:7]
    bwd = dict(recompute=False, need_wgrad=True, **opts)
    ref = reference.backward(dy, x, idx, w, w13, w2, *state, **bwd)
    for a, b in zip(_backend.backward("grouped", dy, x, idx, w, w13, w2, *state, **bwd), ref):
        assert rel_err(a, b) < 1e-5


def test_fp8_bwd_runs_the_bf16_forward_and_the_fp8_backward_pipeline_once_its_kernel_exists(status):
    """fp8_bwd's forward is the bf16 kernels' and its backward the FP8 pipeline (prime_kernels.mega._fp8_bwd): once
    status() says its backward is available, "auto" runs the fused forward and "grouped" the grouped one; the
    backward of either is the FP8 pipeline, which backend.backward reaches for both names (on the CPU, through
    the ops' CPU kernels: the reference's fp8_bwd numbers)."""
    from prime_kernels.mega import reference

    for name in ("mega_moe.bf16.sm90", _backend.GROUPED_KEY):
        status[name] = "available"
    status["mega_moe.fp8_bwd.sm90"] = "available"
    for direction in ("fwd", "bwd"):
        assert _backend.resolve_backend("auto", "fp8_bwd", direction, **SHAPE) == "fused"
        assert _backend.resolve_backend("grouped", "fp8_bwd", direction, **SHAPE) == "grouped"
    T, H_, I_ = 24, 128, 128
    x, idx, w, w13, w2, dy = make_problem(T, H_, I_, E, K, seed=58)
    fwd = _backend.forward("grouped", x, idx, w, w13, w2, precision="fp8_bwd", activation_clamp=None, group=None,
                           num_experts=E, ep_size=1, max_tokens_per_rank=None, block_m=128, save_h=True)
    assert torch.equal(fwd[0], _backend.forward("grouped", x, idx, w, w13, w2, precision="bf16", activation_clamp=None,
                                                group=None, num_experts=E, ep_size=1, max_tokens_per_rank=None,
                                                block_m=128, save_h=True)[0])
    state = fwd[1:7]
    opts = dict(activation_clamp=None, group=None, num_experts=E, recompute=False, need_wgrad=True)
    want = reference.backward(dy, x, idx, w, w13, w2, *state, precision="fp8_bwd", **opts)
    for which in ("fused", "grouped"):
        got = _backend.backward(which, dy, x, idx, w, w13, w2, *state, precision="fp8_bwd", **opts)
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-5


def test_fp8_auto_falls_back_to_the_fp8_reference_only_with_env(status, monkeypatch):
    x, idx, w, w13, w2, _ = make_problem(6, 128, 128, E, K, seed=55)
    for precision, why in (("fp8", "precision='fp8': mega_moe.fp8.sm90: not implemented yet; "
                                   "mega_moe_grouped.fp8.sm90: not implemented"),
                           ("fp8_bwd", "precision='fp8_bwd': mega_moe.bf16.sm90: not implemented")):
        with pytest.raises(_backend.FusedKernelUnavailable, match=why):
            mega_moe(x, idx, w, w13, w2, precision=precision)
    monkeypatch.setenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", "1")
    with pytest.warns(RuntimeWarning, match="falling back to the pure-PyTorch reference for fp8 fwd"):
        y = mega_moe(x, idx, w, w13, w2, precision="fp8")
    assert torch.equal(y, mega_moe(x, idx, w, w13, w2, precision="fp8", backend="reference"))
    assert not torch.equal(y, mega_moe(x, idx, w, w13, w2, backend="reference"))  # the FP8 numerics, not bf16


@pytest.mark.parametrize("backend", ["auto", "fused", "grouped"])
def test_fp8_layer_calls_raise_with_real_status(backend):
    """Whatever prime_kernels.status() says on this machine, fp8 and fp8_bwd on CPU tensors raise a reason (the
    status() one where their kernels are unavailable, else that the kernels need CUDA tensors)."""
    x, idx, w, w13, w2, _ = make_problem(4, 128, 128, E, K, seed=56)
    for precision in ("fp8", "fp8_bwd"):
        with pytest.raises(_backend.FusedKernelUnavailable, match=f"{precision}|need CUDA tensors"):
            mega_moe(x, idx, w, w13, w2, precision=precision, backend=backend)


@pytest.mark.parametrize("fn,name", [
    (mega.mxfp8_mega_moe, "mega_moe.mxfp8.sm100"),
    (mega.mxfp8_mega_moe_backward, "mega_moe.mxfp8.sm100"),
    (mega.fp8_fp4_mega_moe, "mega_moe.mxfp8.sm100"),
])
def test_fp8_names_raise_status_reason(status, fn, name):
    status[name] = "no sm_100 device" if "sm100" in name else "not implemented yet"
    with pytest.raises(_backend.FusedKernelUnavailable, match=name + ": " + status[name]):
        fn(None, None, None, None)


def test_fp8_names_refuse_upstream_shaped_arguments():
    """The FP8 calls take prime-rl's arguments (weight pairs, pools; tests/test_integration_prime_rl_fp8.py); handed
    upstream's bf16-shaped ones, they refuse before writing and leave the output as it was (NaN-poisoned here)."""
    buf = get_symm_buffer_for_mega_moe(None, E, 32, K, 256, I, mma_type="fp8xfp8", device="cpu")
    _, _, _, w13, w2, _ = make_problem(2, 256, I, E, K, seed=57)
    y = torch.full((8, 256), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pair"):
        mega.fp8_mega_moe(y, w13, w2, None, buf)
    with pytest.raises(TypeError, match="pair"):
        mega.fp8_mega_moe_backward(y, torch.zeros(8, K), w13, w2, None, None, buf)
    with pytest.raises(TypeError, match="FP8BackwardBuffers"):
        mega.fp8_mega_moe_weight_grads(None, None, None, w13, w2)
    assert y.isnan().all()


def test_all_names_exist():
    for name in mega.__all__:
        assert hasattr(mega, name), name


def test_transform_weights_is_identity():
    _, _, _, w13, w2, _ = make_problem(2, H, I, E, K, seed=53)
    a, b = transform_weights_for_mega_moe(w13, w2)
    assert a is w13 and b is w2


def test_interleave_roundtrip():
    _, _, _, w13, _, _ = make_problem(2, H, I, E, K, seed=54)
    il = mega.interleave_l1(w13)
    assert torch.equal(il[:, :8], w13[:, :8]) and torch.equal(il[:, 8:16], w13[:, I : I + 8])
    assert torch.equal(mega.deinterleave_l1(il), w13)


def test_buffer_reused_per_shape_and_views():
    a = get_symm_buffer_for_mega_moe(None, E, 32, K, H, I, device="cpu")
    b = get_symm_buffer_for_mega_moe(None, E, 32, K, H, I, device="cpu")
    c = get_symm_buffer_for_mega_moe(None, E, 64, K, H, I, device="cpu")
    assert a is b and a is not c
    assert a.x.shape == (32, H) and a.x.dtype == torch.bfloat16
    assert a.topk_idx.shape == (32, K) and a.topk_idx.dtype == torch.int64
    assert a.topk_weights.dtype == torch.float32 and not a.symmetric
    assert a.x.untyped_storage().data_ptr() == a.topk_idx.untyped_storage().data_ptr()
    f = get_symm_buffer_for_mega_moe(None, E, 32, K, 256, I, mma_type="fp8xfp8", device="cpu")
    assert f.x.dtype == torch.float8_e4m3fn and f.x_sf.shape == (32, 2)


def _stage(buf, x, idx, w):
    buf.x[: x.shape[0]].copy_(x)
    buf.topk_idx[: x.shape[0]].copy_(idx)
    buf.topk_weights[: x.shape[0]].copy_(w)


@pytest.mark.parametrize("save_h", [False, True])
def test_low_level_forward_backward_match_autograd(save_h):
    T = 19
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, seed=55, masked_frac=0.15)
    y_ref, dx_ref, dt_ref, d13_ref, d2_ref = run_layer(x, idx, w, w13, w2, dy, backend="reference",
                                                       activation_clamp=0.7)
    buf = get_symm_buffer_for_mega_moe(None, E, 40, K, H, I, device="cpu")
    _stage(buf, x, idx, w)
    y = torch.full((T, H), 7.0, dtype=torch.bfloat16)  # garbage: must be overwritten
    stats = torch.zeros(E, dtype=torch.int32)
    state = bf16_mega_moe(y, w13, w2, buf, activation_clamp=0.7, backend="reference", save_h=save_h,
                          cumulative_local_expert_recv_stats=stats)
    assert torch.equal(y, y_ref)
    assert torch.equal(stats, torch.bincount(idx[idx >= 0], minlength=E).int())
    assert (state.h is not None) == save_h
    dx = torch.full_like(x, 3.0)
    dt = torch.full_like(w, 3.0)
    d13 = torch.full_like(w13, 3.0)
    d2 = torch.full_like(w2, 3.0)
    bf16_mega_moe_backward(dx, d13, d2, dt, dy, w13, w2, buf, activation_clamp=0.7, state=state,
                           backend="reference")
    for a, b in ((dx, dx_ref), (dt, dt_ref), (d13, d13_ref), (d2, d2_ref)):
        assert torch.equal(a, b)
    # without state: recompute plan and h from the re-staged inputs, same result
    _stage(buf, x, idx, w)
    dx2, dt2, d13b, d2b = (torch.empty_like(t) for t in (dx, dt, d13, d2))
    bf16_mega_moe_backward(dx2, d13b, d2b, dt2, dy, w13, w2, buf, activation_clamp=0.7, backend="reference")
    for a, b in ((dx2, dx), (dt2, dt), (d13b, d13), (d2b, d2)):
        assert torch.equal(a, b)


def test_low_level_accumulate_and_fp32_wgrad():
    T = 12
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, seed=56)
    buf = get_symm_buffer_for_mega_moe(None, E, 40, K, H, I, device="cpu")
    _stage(buf, x, idx, w)
    y0 = torch.randn(T, H).bfloat16()
    y = y0.clone()
    bf16_mega_moe(y, w13, w2, buf, backend="reference", accumulate=True)
    y1 = torch.empty_like(y)
    bf16_mega_moe(y1, w13, w2, buf, backend="reference")
    assert torch.equal(y, y0 + y1)
    dx, dt = torch.empty_like(x), torch.empty_like(w)
    d13, d2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
    bf16_mega_moe_backward(dx, d13, d2, dt, dy, w13, w2, buf, backend="reference")
    a13, a2 = torch.randn(w13.shape), torch.randn(w2.shape)
    a13_0, a2_0 = a13.clone(), a2.clone()
    dx2, dt2 = torch.zeros_like(x), torch.zeros_like(w)
    bf16_mega_moe_backward(dx2, a13, a2, dt2, dy, w13, w2, buf, backend="reference", accumulate=True)
    assert torch.equal(a13, a13_0 + d13) and torch.equal(a2, a2_0 + d2)  # fp32 grads, unrounded
    assert torch.equal(dx2, dx) and torch.equal(dt2, dt)


def test_low_level_interleaved_layouts():
    T = 10
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, seed=57)
    buf = get_symm_buffer_for_mega_moe(None, E, 40, K, H, I, device="cpu")
    _stage(buf, x, idx, w)
    y_nat, y_il = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)
    bf16_mega_moe(y_nat, w13, w2, buf, backend="reference")
    bf16_mega_moe(y_il, mega.interleave_l1(w13), w2, buf, backend="reference", l1_natural_layout=False)
    assert torch.equal(y_nat, y_il)
    outs = []
    for natural in (True, False):
        dx, dt, d13, d2 = torch.empty_like(x), torch.empty_like(w), torch.empty_like(w13), torch.empty_like(w2)
        bf16_mega_moe_backward(dx, d13, d2, dt, dy, w13, w2, buf, backend="reference", dw_natural_layout=natural)
        outs.append(d13)
    assert torch.equal(mega.interleave_l1(outs[0]), outs[1])


def test_h_is_saved_only_when_a_backward_can_follow(monkeypatch):
    """mega_moe asks the forward op for h only when autograd can call the backward (grad mode on and an input
    that takes a gradient, and no recompute): inference neither computes nor keeps it. y is the same bits either
    way, and the backward after a saving forward still runs."""
    from prime_kernels.mega import _ops

    asked = []
    op = _ops.mega_moe_fwd

    def spy(*args):
        asked.append(args[13])  # save_h
        out = op(*args)
        asked.append(out[1].shape[0] > 0)  # h came back
        return out

    monkeypatch.setattr(_ops, "mega_moe_fwd", spy)
    x, idx, w, w13, w2, dy = make_problem(9, H, I, E, K, seed=53, masked_frac=0.1)
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]

    y_train = mega_moe(leaves[0], idx, *leaves[1:], backend="reference")
    assert asked == [True, True]
    torch.autograd.grad(y_train, leaves, dy)
    with torch.no_grad():
        y_infer = mega_moe(*leaves[:1], idx, *leaves[1:], backend="reference")
    assert asked[2:] == [False, False]
    with torch.inference_mode():
        mega_moe(x, idx, w, w13, w2, backend="reference")
    y_plain = mega_moe(x, idx, w, w13, w2, backend="reference")  # grad mode on, nothing requires grad
    mega_moe(leaves[0], idx, *leaves[1:], backend="reference", recompute=True)
    assert asked[4:] == [False, False, False, False, False, False]
    assert torch.equal(y_train.detach(), y_infer) and torch.equal(y_infer, y_plain)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_auto_under_a_group_runs_the_all_to_all_path_while_fused_runs_the_peer_path(status, direction):
    """With the peer-memory path available, backend "fused" under a group runs it, and "auto" runs the all-to-all
    path (grouped) with the reason that says why."""
    for name in ("mega_moe.bf16.sm90", "mega_moe_backward.bf16.sm90", _backend.GROUPED_KEY, _backend.PEER_KEY):
        status[name] = "available"
    assert _backend.choose_backend("fused", "bf16", direction, ep_size=2, **SHAPE) == ("fused", None)
    assert _backend.choose_backend("auto", "bf16", direction, ep_size=2, **SHAPE) == (
        "grouped", _backend.AUTO_PEER_REASON)
    assert _backend.choose_backend("auto", "bf16", direction, ep_size=1, **SHAPE)[0] == "fused"
    status[_backend.PEER_KEY] = "not implemented yet"
    which, why = _backend.choose_backend("auto", "bf16", direction, ep_size=2, **SHAPE)
    assert which == "grouped" and why == f"{_backend.PEER_KEY}: not implemented yet"
