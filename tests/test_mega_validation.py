"""Every argument check fires before any compute, with a one-line message saying what to do."""

import pytest
import torch

from mega_helpers import make_problem

from prime_kernels.mega import MegaMoE, bf16_mega_moe, get_symm_buffer_for_mega_moe, mega_moe

E, H, I, K, T = 4, 32, 16, 2, 6


@pytest.fixture
def prob():
    return make_problem(T, H, I, E, K, seed=41)


def _call(p, **over):
    x, idx, w, w13, w2, _ = p
    args = dict(x=x, topk_idx=idx, topk_weights=w, w13=w13, w2=w2)
    kw = {"backend": "reference"}
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return mega_moe(args["x"], args["topk_idx"], args["topk_weights"], args["w13"], args["w2"], **kw)


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith("prime_kernels.mega")
    return msg


def test_x_dtype(prob):
    with pytest.raises(TypeError, match="x must be bfloat16") as e:
        _call(prob, x=prob[0].half())
    _one_line(e)


def test_weight_dtype(prob):
    with pytest.raises(TypeError, match="w13 must have x's dtype") as e:
        _call(prob, w13=prob[3].float())
    _one_line(e)


def test_topk_weights_dtype(prob):
    with pytest.raises(TypeError, match="topk_weights must be torch.float32") as e:
        _call(prob, topk_weights=prob[2].bfloat16())
    _one_line(e)


def test_topk_idx_dtype(prob):
    with pytest.raises(TypeError, match="topk_idx must be int64"):
        _call(prob, topk_idx=prob[1].float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type (CUDA) to mix devices")
def test_device_mismatch(prob):
    with pytest.raises(ValueError, match="one device"):
        _call(prob, w2=prob[4].cuda())


def test_device_mismatch_meta(prob):
    with pytest.raises(ValueError, match="one device"):
        _call(prob, w2=prob[4].to("meta"))


def test_contiguity(prob):
    x = prob[0]
    xt = torch.empty(H, T, dtype=x.dtype).t()
    xt.copy_(x)
    with pytest.raises(ValueError, match=r"x must be contiguous.*\.contiguous\(\)") as e:
        _call(prob, x=xt)
    _one_line(e)


def test_x_shape(prob):
    with pytest.raises(ValueError, match=r"x must be 2-D"):
        _call(prob, x=prob[0].unsqueeze(0))


def test_topk_idx_rows_mismatch(prob):
    with pytest.raises(ValueError, match=r"topk_idx must be \[T, K\] with T=6"):
        _call(prob, topk_idx=prob[1][:5], topk_weights=prob[2][:5])


def test_topk_weights_shape_mismatch(prob):
    with pytest.raises(ValueError, match="topk_weights shape .* must match topk_idx shape") as e:
        _call(prob, topk_weights=prob[2][:, :1].contiguous())
    _one_line(e)


def test_w13_shape(prob):
    with pytest.raises(ValueError, match=r"w13 must be \[El, 2I, H\]"):
        _call(prob, w13=prob[3][:, :, :16].contiguous())


def test_w2_shape(prob):
    with pytest.raises(ValueError, match=r"w2 must be \[El, H, I\]"):
        _call(prob, w2=prob[4][:, :, :8].contiguous())


def test_hidden_not_aligned_for_fused(prob):
    # H=32, I=16 are fine for the reference but not for the fused kernels
    with pytest.raises(ValueError, match="multiples of HIDDEN_ALIGN=64") as e:
        _call(prob, backend="fused")
    _one_line(e)


def test_intermediate_not_aligned_module():
    with pytest.raises(ValueError, match="INTERMEDIATE_ALIGN=64"):
        MegaMoE(8, 256, 100, 2, backend="fused")


def test_fp8_multiples_of_64_follow_their_status_entry(monkeypatch):
    """FP8 takes H and I multiples of 64 on the kernels (the last scale block 64 wide); where the status entry of those
    shapes is not available (a missing GPU, a build without sm90) the kernel backends refuse them with the rule and
    the entry's reason, and the fused FP8 forward keeps whole 128-wide blocks."""
    from prime_kernels import _status
    from prime_kernels.mega import _backend
    from prime_kernels.mega._backend import FP8_TAILS_KEY, alignment_reason, fused_fp8_tails_reason

    assert FP8_TAILS_KEY not in _status.unverified()
    real = _backend._status
    status = "no CUDA device (a stand-in reason)"
    monkeypatch.setattr(_backend, "_status", lambda: {**real(), FP8_TAILS_KEY: status})
    with pytest.raises(ValueError, match="FP8_ALIGN=128"):
        MegaMoE(8, 320, 256, 2, backend="fused", precision="fp8")
    for precision in ("fp8", "fp8_bwd"):
        why = alignment_reason(1088, 320, precision)
        assert f"are multiples of 64 but not both of FP8_ALIGN=128: {FP8_TAILS_KEY}: {status}; pad" in why
        assert alignment_reason(256, 128, precision) is None
    assert "HIDDEN_ALIGN=64" in alignment_reason(1000, 320, "fp8")
    assert "FP8_ALIGN=128" in alignment_reason(256, 192, "mxfp8")
    assert alignment_reason(256, 192, "bf16") is None and alignment_reason(2880, 2880) is None
    monkeypatch.setattr(_backend, "_status", lambda: {**real(), FP8_TAILS_KEY: _status.AVAILABLE})
    assert alignment_reason(2880, 2880, "fp8") is None and alignment_reason(1088, 320, "fp8_bwd") is None
    assert "the fused FP8 forward takes hidden and intermediate multiples of FP8_ALIGN=128" in \
        fused_fp8_tails_reason("fp8", "fwd", 1088, 320)
    assert fused_fp8_tails_reason("fp8", "bwd", 1088, 320) is None
    assert fused_fp8_tails_reason("fp8", "fwd", 1024, 256) is None


def test_half_width_last_tiles_follow_their_status_entry():
    """H or I a multiple of 64 but not of 128 (e.g. 2880, or I = 320) runs the kernel backends where the half-tiles
    entry is available; elsewhere a kernel backend raises that entry's reason (a missing GPU, or the GPU
    verification still to come), never a shape error."""
    from prime_kernels import _status
    from prime_kernels.mega import FusedKernelUnavailable
    from prime_kernels.mega._backend import HALF_TILES_KEY, half_tiles_reason, resolve_backend

    assert half_tiles_reason(2048, 768) is None
    why = _status.reason(HALF_TILES_KEY)
    for H, I in ((2880, 2880), (1088, 320), (2048, 320)):
        if why == _status.AVAILABLE:
            assert half_tiles_reason(H, I) is None
            continue
        assert f"{HALF_TILES_KEY}: {why}" in half_tiles_reason(H, I)
        for backend in ("fused", "grouped"):
            with pytest.raises(FusedKernelUnavailable, match=HALF_TILES_KEY):
                resolve_backend(backend, "bf16", "fwd", device_type="cuda", hidden=H, intermediate=I)


def test_expert_id_too_large(prob):
    idx = prob[1].clone()
    idx[2, 1] = E
    with pytest.raises(ValueError, match=r"must lie in \[-1, 3\]") as e:
        _call(prob, topk_idx=idx)
    _one_line(e)


def test_expert_id_below_minus_one(prob):
    idx = prob[1].clone()
    idx[0, 0] = -2
    with pytest.raises(ValueError, match=r"must lie in \[-1, 3\]"):
        _call(prob, topk_idx=idx)


def test_skipping_value_checks_never_applies_to_the_reference(prob, monkeypatch):
    """PRIME_KERNELS_SKIP_VALUE_CHECKS=1 skips the expert-id read only on the kernel backends (their routing
    plan masks an out-of-range id); the reference would index with it, so it still raises."""
    from prime_kernels.mega import _validate

    monkeypatch.setenv("PRIME_KERNELS_SKIP_VALUE_CHECKS", "1")
    idx = prob[1].clone()
    idx[2, 1] = E
    with pytest.raises(ValueError, match=r"must lie in \[-1, 3\]"):
        _call(prob, topk_idx=idx)
    _validate.check_expert_ids(idx, E, "grouped")  # skipped: no error
    _validate.check_expert_ids(idx, E, "fused")
    with pytest.raises(ValueError, match=r"must lie in \[-1, 3\]"):
        _validate.check_expert_ids(idx, E, "reference")
    monkeypatch.delenv("PRIME_KERNELS_SKIP_VALUE_CHECKS")
    with pytest.raises(ValueError, match=r"must lie in \[-1, 3\]"):
        _validate.check_expert_ids(idx, E, "grouped")


def test_more_tokens_than_buffer(prob):
    buf = get_symm_buffer_for_mega_moe(None, E, T - 1, K, H, I, device="cpu", reuse=False)
    with pytest.raises(ValueError, match="exceed the buffer's num_max_tokens_per_rank=5") as e:
        _call(prob, buffer=buf)
    _one_line(e)
    y = torch.empty(T, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exceed the buffer"):
        bf16_mega_moe(y, prob[3], prob[4], buf, backend="reference")


def test_group_size_not_dividing_experts():
    class FakeGroup:  # only the size matters for this check
        group_name = "fake"

    import torch.distributed as dist

    orig = dist.get_world_size
    dist.get_world_size = lambda group=None: 3 if isinstance(group, FakeGroup) else orig(group)
    try:
        with pytest.raises(ValueError, match="num_experts=8 is not divisible by the group size 3"):
            MegaMoE(8, 128, 128, 2, group=FakeGroup(), backend="reference")
    finally:
        dist.get_world_size = orig


def test_num_experts_not_matching_local_weights(prob):
    with pytest.raises(ValueError, match="w13 holds 4 local experts but num_experts=8"):
        _call(prob, num_experts=8)


def test_negative_clamp(prob):
    with pytest.raises(ValueError, match=r"activation_clamp must be None \(no clamp\) or a finite number > 0"):
        _call(prob, activation_clamp=-1.0)


def test_bad_backend_and_precision(prob):
    with pytest.raises(ValueError, match="backend must be one of"):
        _call(prob, backend="cuda")
    with pytest.raises(ValueError, match="precision must be one of"):
        _call(prob, precision="fp4")


def test_wgrad_accum_dtype(prob):
    bad = (torch.zeros(prob[3].shape, dtype=torch.bfloat16), torch.zeros(prob[4].shape))
    with pytest.raises(TypeError, match="must be torch.float32"):
        _call(prob, wgrad_accum=bad)


def test_no_compute_before_validation(prob, monkeypatch):
    """Checks run before any routing or GEMM."""
    import prime_kernels.mega.reference as ref

    def boom(*a, **k):
        raise AssertionError("computed before validating")

    monkeypatch.setattr(ref, "forward", boom)
    idx = prob[1].clone()
    idx[0, 0] = 99
    with pytest.raises(ValueError, match="must lie in"):
        _call(prob, topk_idx=idx)


def test_float64_needs_reference_backend():
    x, idx, w, w13, w2, _ = make_problem(T, H, I, E, K, seed=42, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64 inputs .* backend='reference' only"):
        mega_moe(x, idx, w, w13, w2, backend="auto")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_expert_id_check_from_plan_without_a_count_checks_synchronously():
    """An ExpertIdCheck that waits for the routing plan's count (from_plan=True) still raises in finish() when
    no count was handed to it (a backend path that built no plan), and passes clean ids either way."""
    from prime_kernels.mega import _validate

    idx = torch.randint(0, E, (T, K), device="cuda")
    for backend in ("fused", "grouped"):
        _validate.ExpertIdCheck(idx, E, backend, from_plan=True).finish()
        bad = idx.clone()
        bad[1, 0] = E
        with pytest.raises(ValueError, match=r"must lie in \[-1, 3\]"):
            _validate.ExpertIdCheck(bad, E, backend, from_plan=True).finish()
        check = _validate.ExpertIdCheck(bad, E, backend, from_plan=True)
        check.watch(torch.ones(1, dtype=torch.int32, device="cuda"))
        with pytest.raises(ValueError, match=r"must lie in \[-1, 3\]"):
            check.finish()
        check = _validate.ExpertIdCheck(idx, E, backend, from_plan=True)
        check.watch(torch.zeros(1, dtype=torch.int32, device="cuda"))
        check.finish()
