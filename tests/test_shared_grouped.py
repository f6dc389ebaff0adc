"""Shared experts inside the routed experts' launches (prime_kernels.mega._shared_grouped): the grouped pipeline over
E routed and S * m shared groups on the second-B GEMMs.

CPU (the ops' CPU kernels): the chunk layouts invert each other; the pipeline's forward and backward equal the
reference over the extended routes (the shared chunks as experts, SF1-SF3), and the layer with shared experts in
float64 (mega_moe's shared path, exact) up to bf16 rounding; recompute gives the saved h's gradients. GPU: the same
against float64, once the second-B GEMMs are available."""

import pytest
import torch

from mega_helpers import make_problem, rel_err

NAMES = ("y", "dx", "dtopk", "dw13", "dw2", "dsw13", "dsw2", "dgate")


def _shared_problem(T, E, H, I, K, S, chunks, gate, seed, device="cpu"):
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, routing="skewed", seed=seed, masked_frac=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    sw13 = (torch.randn(S, 2 * chunks * I, H, generator=g) / H ** 0.5).bfloat16()
    sw2 = (torch.randn(S, H, chunks * I, generator=g) / (chunks * I) ** 0.5).bfloat16()
    sg = (torch.rand(T, S, generator=g) + 0.5) if gate else None
    return [t.to(device) if t is not None else None for t in (x, idx, w, w13, w2, sw13, sw2, sg, dy)]


def _pipeline(problem, chunks, clamp=None, recompute=False):
    from prime_kernels.mega import _shared_grouped as sg
    from prime_kernels.routing import pool_capacity

    x, idx, w, w13, w2, sw13, sw2, gate, dy = problem
    E, S = w13.shape[0], sw13.shape[0]
    idx_e, w_e = sg.extended_routes(idx, w, E, S, chunks, gate)
    cap = pool_capacity(x.shape[0], idx_e.shape[1], E + S * chunks, 128)
    fwd = sg.forward(x, idx_e, w_e, w13, w2, sw13, sw2, chunks=chunks, activation_clamp=clamp, block_m=128,
                     capacity=cap, save_h=not recompute)
    h = fwd[1] if not recompute else None
    bwd = sg.backward(dy, x, idx_e, w_e, w13, w2, sw13, sw2, h, fwd[2], fwd[3], fwd[4], fwd[6], chunks=chunks,
                      activation_clamp=clamp, recompute=recompute)
    return fwd, bwd, (idx_e, w_e, cap)


def test_chunk_layouts_invert_each_other_and_routes_extend():
    from prime_kernels.mega._shared_grouped import chunks_of, extended_routes
    from prime_kernels.second_b import collapse_chunks, expand_chunks

    w13 = torch.randn(2, 2 * 3 * 4, 5)
    w2 = torch.randn(2, 5, 3 * 4)
    assert torch.equal(collapse_chunks(expand_chunks(w13, 3, "w13"), 3, "w13"), w13)
    assert torch.equal(collapse_chunks(expand_chunks(w2, 3, "w2"), 3, "w2"), w2)
    assert chunks_of(128, 512) == 4 and chunks_of(128, 192) is None and chunks_of(128, 128) == 1
    idx = torch.tensor([[3, -1], [0, 2]])
    w = torch.tensor([[0.25, 0.5], [0.125, 0.0625]])
    gate = torch.tensor([[2.0, 3.0], [4.0, 5.0]])
    idx_e, w_e = extended_routes(idx, w, 8, 2, 2, gate)
    assert idx_e.tolist() == [[3, -1, 8, 9, 10, 11], [0, 2, 8, 9, 10, 11]]
    assert w_e.tolist() == [[0.25, 0.5, 2.0, 2.0, 3.0, 3.0], [0.125, 0.0625, 4.0, 4.0, 5.0, 5.0]]
    _, w_1 = extended_routes(idx, w, 8, 2, 2, None)
    assert w_1[:, 2:].eq(1).all()


@pytest.mark.parametrize("chunks,gate,clamp", [(1, False, None), (2, True, None), (3, False, 1.0)])
def test_pipeline_equals_the_reference_over_the_extended_routes_on_cpu(chunks, gate, clamp):
    """SF2 on the ops' CPU kernels against the reference backend on [w; expand_chunks(shared)] with the extended
    routes: the same rounding points, so y and h equal and the gradients agree to the reference's own distance
    from the CPU ops (fp32 sums in another order)."""
    from prime_kernels.mega import reference
    from prime_kernels.second_b import collapse_chunks, expand_chunks

    problem = _shared_problem(45, 6, 128, 128, 3, 2, chunks, gate, seed=chunks)
    x, idx, w, w13, w2, sw13, sw2, sg, dy = problem
    if clamp is not None:
        x = problem[0] = x * 2
    fwd, bwd, (idx_e, w_e, cap) = _pipeline(problem, chunks, clamp)
    w13_all = torch.cat([w13, expand_chunks(sw13, chunks, "w13")])
    w2_all = torch.cat([w2, expand_chunks(sw2, chunks, "w2")])
    E_all = w13_all.shape[0]
    opts = dict(num_experts=E_all, activation_clamp=clamp)
    want = reference.forward(x, idx_e, w_e, w13_all, w2_all, block_m=128, capacity=cap, save_h=True, **opts)
    end = int(fwd[3][-1])
    assert torch.equal(fwd[1][:end], want[1][:end])
    assert rel_err(fwd[0], want[0]) < 1e-5
    ref = reference.backward(dy, x, idx_e, w_e, w13_all, w2_all, *want[1:7], **opts)
    E = w13.shape[0]
    ref = (ref[0], ref[1], ref[2][:E], ref[3][:E], collapse_chunks(ref[2][E:], chunks, "w13"),
           collapse_chunks(ref[3][E:], chunks, "w2"))
    for name, a, b in zip(NAMES[1:], bwd, ref):
        assert a.shape == b.shape and torch.isfinite(a.float()).all(), name
        assert rel_err(a, b) < 1e-4, f"{name}: {rel_err(a, b):.3e}"


def _float64_layer(problem, clamp=None):
    """y and every gradient of the layer with shared experts in float64 (mega_moe's reference, exact)."""
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2, sw13, sw2, sg, dy = problem
    leaves = [t.double().requires_grad_() for t in (x, w, w13, w2, sw13, sw2)]
    gate = sg.double().requires_grad_() if sg is not None else None
    y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], shared_w13=leaves[4], shared_w2=leaves[5],
                 shared_gate=gate, backend="reference", activation_clamp=clamp, num_experts=w13.shape[0])
    y.backward(dy.double())
    return [y.detach()] + [t.grad for t in leaves] + ([gate.grad] if gate is not None else [])


@pytest.mark.parametrize("recompute", [False, True])
def test_pipeline_is_the_layer_with_shared_experts_on_cpu(recompute):
    """Against the layer with shared experts in float64 (the second pass's exact semantics, S1-S3): one rounding of
    y instead of two, so bf16-level agreement; d gate is the sum of its routes' d topk_weights."""
    chunks, S = 2, 2
    problem = _shared_problem(61, 8, 128, 128, 3, S, chunks, True, seed=7)
    fwd, bwd, _ = _pipeline(problem, chunks, recompute=recompute)
    exact = _float64_layer(problem)
    K = problem[1].shape[1]
    dtopk = bwd[1]
    dgate = dtopk[:, K:].reshape(-1, S, chunks).sum(-1)
    got = [fwd[0], bwd[0], dtopk[:, :K], bwd[2], bwd[3], bwd[4], bwd[5], dgate]
    # exact's order: y, dx, dw(topk), dw13, dw2, dsw13, dsw2, dgate
    for name, a, b in zip(NAMES, got, exact):
        assert rel_err(a, b) < 2e-2, f"{name}: {rel_err(a, b):.3e} (recompute {recompute})"
    if recompute:
        _, saved, _ = _pipeline(problem, chunks)
        for name, a, b in zip(NAMES[1:], bwd, saved):
            assert torch.equal(a, b), f"{name}: recompute differs from the saved h"


from conftest import requires_sm90  # noqa: E402


@requires_sm90
@pytest.mark.parametrize("chunks,gate,clamp", [(1, False, None), (4, True, None), (2, True, 7.0)])
def test_pipeline_on_the_gpu_against_float64(chunks, gate, clamp):
    from prime_kernels import _status

    why = _status.runnable("m_grouped_gemm_second_b.bf16.sm90")
    if why != _status.AVAILABLE:
        pytest.skip(f"m_grouped_gemm_second_b.bf16.sm90: {why}")
    S = 1 if chunks == 4 else 2
    problem = _shared_problem(777, 16, 256, 256, 4, S, chunks, gate, seed=chunks + 3)
    fwd, bwd, _ = _pipeline([t.cuda() if t is not None else None for t in problem], chunks, clamp)
    exact = _float64_layer(problem, clamp)
    K = problem[1].shape[1]
    got = [fwd[0], bwd[0], bwd[1][:, :K], bwd[2], bwd[3], bwd[4], bwd[5]]
    if gate:
        got.append(bwd[1][:, K:].reshape(777, S, chunks).sum(-1))
    for name, a, b in zip(NAMES, got, exact):
        assert torch.isfinite(a.float()).all(), name
        assert rel_err(a.cpu(), b) < 2e-2, f"{name}: {rel_err(a.cpu(), b):.3e}"


@requires_sm90
@pytest.mark.parametrize("chunks,gate,clamp", [(1, False, None), (4, True, None), (2, True, 7.0)])
def test_fused_forward_with_the_second_b_equals_the_pipeline_on_the_gpu(chunks, gate, clamp):
    """The fused BF16 forward whose last groups read the shared weights (status mega_moe_shared_fused.bf16.sm90)
    against the pipeline's second-B GEMMs on the same extended routes: y, and h on every routed pool row, equal bit
    for bit (the fused forward keeps the pipeline's rounding points and k order), on NaN-poisoned memory, on every SM
    and on 7; repeats equal; the plan the same; y within the float64 layer's bf16 bound."""
    from prime_kernels import _status
    from prime_kernels.mega import _shared_ops
    from prime_kernels.mega import _shared_grouped as sg
    from prime_kernels.routing import pool_capacity
    from mega_helpers import poison_free_memory

    why = _status.runnable(_shared_ops.FUSED_BF16_KEY)
    if why != _status.AVAILABLE:
        pytest.skip(f"{_shared_ops.FUSED_BF16_KEY}: {why}")
    S = 1 if chunks == 4 else 2
    problem = _shared_problem(1029, 16, 256, 256, 4, S, chunks, gate, seed=chunks + 23)
    x, idx, w, w13, w2, sw13, sw2, g, _ = [t.cuda() if t is not None else None for t in problem]
    E = w13.shape[0]
    idx_e, w_e = sg.extended_routes(idx, w, E, S, chunks, g)
    cap = pool_capacity(x.shape[0], idx_e.shape[1], E + S * chunks, 128)
    runs = {}
    for fused, num_sms in ((False, 0), (True, 0), (True, 7), (True, 0)):
        poison_free_memory()
        runs.setdefault(fused, []).append(sg.forward(x, idx_e, w_e, w13, w2, sw13, sw2, chunks=chunks,
                                                     activation_clamp=clamp, block_m=128, capacity=cap, save_h=True,
                                                     num_sms=num_sms, fused=fused))
    want = runs[False][0]
    routed = want[4] >= 0  # pool rows that hold a route (not padding)
    for got in runs[True]:
        for a, b in zip(got[2:], want[2:]):
            assert torch.equal(a, b)
        assert torch.isfinite(got[0].float()).all() and torch.equal(got[0], want[0])
        assert torch.equal(got[1][routed], want[1][routed])
    exact = _float64_layer(problem, clamp)
    assert rel_err(runs[True][0][0].cpu(), exact[0]) < 2e-2


# --------------------------------------------------------------------------------------------- the layer's op


@pytest.mark.parametrize("recompute", [False, True])
def test_layer_op_through_autograd_on_cpu(recompute):
    """mega_moe's call when the shared experts run inside the routed launches (_shared_ops.layer: the custom ops and
    their autograd), on the ops' CPU kernels: every gradient, d shared_gate included, against the float64 layer; the
    ops pass opcheck; the reasons say why not where it does not run."""
    from prime_kernels.mega import _shared_ops

    chunks, S = 2, 1
    problem = _shared_problem(40, 4, 128, 128, 2, S, chunks, True, seed=5)
    x, idx, w, w13, w2, sw13, sw2, sg, dy = problem
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2, sw13, sw2, sg)]
    y = _shared_ops.layer(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], leaves[6],
                          activation_clamp=None, block_m=128, recompute=recompute, num_sms=0)
    y.backward(dy)
    exact = _float64_layer(problem)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2", "dsw13", "dsw2", "dgate"),
                          [y.detach()] + [t.grad for t in leaves], exact):
        assert a is not None and rel_err(a, b) < 2e-2, f"{name}: {rel_err(a, b):.3e}"
    # an expert id past the routed experts would be a route to a shared chunk: refused
    bad = idx.clone()
    bad[0, 0] = 4
    with pytest.raises(ValueError, match="out of range|expert"):
        _shared_ops.layer(x, bad, w, w13, w2, sw13, sw2, sg, activation_clamp=None, block_m=128, recompute=False,
                          num_sms=0)
    why = _shared_ops.reason(x, w13, sw13, backend="auto", precision="bf16", ep_size=1, accumulators=False,
                             return_plan=False, activation_clamp=None)
    assert why == "the shared experts run inside the routed launches on CUDA only"


def test_bf16_takes_the_second_pass_beyond_two_shared_groups():
    """bf16 runs inside the routed launches only up to BF16_MAX_SHARED_GROUPS shared groups (S x Is / I), where it was
    measured faster than the second pass; fp8 has no such limit. Asked for a CUDA tensor (the first check), with
    meta weights so no kernel runs."""
    from prime_kernels.mega import _shared_ops

    if not torch.cuda.is_available():
        pytest.skip("reason() answers for CUDA tensors only: the device check comes first")
    x = torch.empty(64, 256, device="cuda")
    w13 = torch.empty(8, 256, 256, device="meta")  # I = 128
    assert _shared_ops.BF16_MAX_SHARED_GROUPS == 2
    for sw13 in (torch.empty(1, 768, 256, device="meta"), torch.empty(3, 256, 256, device="meta")):
        why = _shared_ops.reason(x, w13, sw13, backend="auto", precision="bf16", ep_size=1, accumulators=False,
                                 return_plan=False, activation_clamp=None)
        assert why is not None and "3 groups" in why and "second pass is faster" in why, why
    for sw13 in (torch.empty(1, 256, 256, device="meta"), torch.empty(1, 512, 256, device="meta"),
                 torch.empty(2, 256, 256, device="meta")):
        for precision in ("bf16", "fp8"):
            why = _shared_ops.reason(x, w13, sw13, backend="auto", precision=precision, ep_size=1,
                                     accumulators=False, return_plan=False, activation_clamp=None)
            assert why is None or "groups" not in why, why
    why = _shared_ops.reason(x, w13, torch.empty(1, 1024, 256, device="meta"), backend="auto", precision="fp8",
                             ep_size=1, accumulators=False, return_plan=False, activation_clamp=None)
    assert why is None or "groups" not in why, why


def test_layer_ops_pass_opcheck_on_cpu():
    from prime_kernels.mega import _shared_grouped as sg
    from prime_kernels.mega import _shared_ops  # noqa: F401  (registers the ops)

    problem = _shared_problem(20, 4, 128, 128, 2, 1, 1, False, seed=9)
    x, idx, w, w13, w2, sw13, sw2, _, dy = problem
    idx_e, w_e = sg.extended_routes(idx, w, 4, 1, 1)
    ops = torch.ops.prime_kernels
    args = (x, idx_e, w_e, w13, w2, sw13, sw2, 1, None, 128, True, 0)
    torch.library.opcheck(ops.mega_moe_shared_fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    out = ops.mega_moe_shared_fwd(*args)
    bargs = (dy, x, idx_e, w_e, w13, w2, sw13, sw2, *out[1:7], 1, None, False, True, 0)
    torch.library.opcheck(ops.mega_moe_shared_bwd.default, bargs, test_utils=("test_schema", "test_faketensor"))


@requires_sm90
@pytest.mark.parametrize("backend,T", [("auto", 513), ("grouped", 513), ("auto", 1), ("auto", 2)])
def test_mega_moe_runs_the_shared_experts_inside_the_routed_launches_on_the_gpu(backend, T):
    """mega_moe with shared experts on CUDA where the second-B GEMMs are available: the call takes the path inside
    the routed launches (reason None) and every output and gradient is the float64 layer's to bf16 level."""
    from prime_kernels.mega import _shared_ops, mega_moe

    problem = _shared_problem(T, 16, 256, 256, 4, 1, 1, True, seed=11 + T)  # bf16 runs one shared group inside
    cuda = [t.cuda() for t in problem]
    x, idx, w, w13, w2, sw13, sw2, sg, dy = cuda
    why = _shared_ops.reason(x, w13, sw13, backend=backend, precision="bf16", ep_size=1, accumulators=False,
                             return_plan=False, activation_clamp=None)
    if why is not None:
        pytest.skip(why)
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2, sw13, sw2, sg)]
    y = mega_moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], shared_w13=leaves[4], shared_w2=leaves[5],
                 shared_gate=leaves[6], backend=backend, num_experts=16)
    y.backward(dy)
    exact = _float64_layer(problem)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2", "dsw13", "dsw2", "dgate"),
                          [y.detach()] + [t.grad for t in leaves], exact):
        assert a is not None and torch.isfinite(a.float()).all(), name
        assert rel_err(a.cpu(), b) < 2e-2, f"{name}: {rel_err(a.cpu(), b):.3e}"


# --------------------------------------------------------------------------------------------- FP8


def test_fp8_weights_with_chunks_are_the_tiles_of_the_expanded_weight():
    """The combined FP8 copy (the routed weight's tiles, then the shared chunks' as experts) is the recipe's
    quantization of cat([w, expand_chunks(w_2)]) bit for bit, built either way (I a multiple of 128: every tile of
    w_2 is a tile of one chunk); the cache keeps it per version of both weights."""
    from prime_kernels.mega import fp8
    from prime_kernels.second_b import expand_chunks

    g = torch.Generator().manual_seed(2)
    for layout, (w, w_2) in {"w13": (torch.randn(3, 256, 128, generator=g), torch.randn(2, 768, 128, generator=g)),
                             "w2": (torch.randn(3, 128, 128, generator=g), torch.randn(2, 128, 384, generator=g))
                             }.items():
        w, w_2 = w.bfloat16(), w_2.bfloat16()
        got = fp8.quantize_weight_with_chunks(w, w_2, 3, layout)
        split = (fp8.quantize_weight(w), fp8.quantize_weight(w_2))
        want_q = torch.cat([split[0].data.view(torch.uint8), expand_chunks(split[1].data.view(torch.uint8), 3, layout)])
        want_s = torch.cat([split[0].scale, expand_chunks(split[1].scale, 3, layout)])
        assert torch.equal(got.data.view(torch.uint8), want_q) and torch.equal(got.scale, want_s), layout
    cache = fp8.Fp8WeightCache()
    a = cache.get_with_chunks(w, w_2, 3, "w2")
    assert cache.get_with_chunks(w, w_2, 3, "w2") is a and cache.misses == 1
    w_2.add_(1)  # a new version of the shared weight: a new copy
    assert cache.get_with_chunks(w, w_2, 3, "w2") is not a


@pytest.mark.parametrize("clamp", [None, 1.0])
def test_fp8_pipeline_equals_the_reference_over_the_extended_routes_on_cpu(clamp):
    """precision="fp8" with shared experts inside the routed launches (the FP8 forward pipeline and the FP8 backward
    on the combined FP8 copies), on the ops' CPU kernels, against the reference's FP8 layer on the expanded weights
    over the extended routes."""
    from prime_kernels.mega import _shared_fp8, fp8, reference
    from prime_kernels.mega import _shared_grouped as sg
    from prime_kernels.routing import pool_capacity
    from prime_kernels.second_b import expand_chunks

    chunks, S = 2, 1
    x, idx, w, w13, w2, sw13, sw2, gate, dy = _shared_problem(45, 6, 128, 128, 3, S, chunks, True, seed=13)
    if clamp is not None:
        x = x * 2
    E = w13.shape[0]
    idx_e, w_e = sg.extended_routes(idx, w, E, S, chunks, gate)
    cap = pool_capacity(x.shape[0], idx_e.shape[1], E + S * chunks, 128)
    fwd = _shared_fp8.forward(x, idx_e, w_e, w13, w2, sw13, sw2, chunks=chunks, activation_clamp=clamp, block_m=128,
                              capacity=cap, fused=False)
    bwd = _shared_fp8.backward(dy, x, idx_e, w_e, w13, w2, sw13, sw2, fwd[1], *fwd[2:7], chunks=chunks,
                               activation_clamp=clamp)
    w13_all = torch.cat([w13, expand_chunks(sw13, chunks, "w13")])
    w2_all = torch.cat([w2, expand_chunks(sw2, chunks, "w2")])
    opts = dict(num_experts=E + S * chunks, activation_clamp=clamp, precision="fp8", weight_cache=fp8.Fp8WeightCache())
    want = reference.forward(x, idx_e, w_e, w13_all, w2_all, block_m=128, capacity=cap, save_h=True, **opts)
    end = int(fwd[3][-1])
    assert torch.equal(fwd[1][:end], want[1][:end])
    assert rel_err(fwd[0], want[0]) < 1e-4
    ref = reference.backward(dy, x, idx_e, w_e, w13_all, w2_all, *want[1:7], **opts)
    ref = (ref[0], ref[1], ref[2][:E], ref[3][:E], collapse(ref[2][E:], chunks, "w13"), collapse(ref[3][E:], chunks, "w2"))
    for name, a, b in zip(NAMES[1:], bwd, ref):
        assert a.shape == b.shape and torch.isfinite(a.float()).all(), name
        assert rel_err(a, b) < 1e-4, f"{name}: {rel_err(a, b):.3e}"


def collapse(d, chunks, layout):
    from prime_kernels.second_b import collapse_chunks

    return collapse_chunks(d, chunks, layout)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_layer_op_in_each_precision_on_cpu(precision, recompute):
    """_shared_ops.layer (the custom ops, autograd) in bf16 and fp8 on the ops' CPU kernels against the float64 layer
    (FP8's error bound as the layer matrix's against float64)."""
    from prime_kernels.mega import _shared_ops

    problem = _shared_problem(40, 4, 128, 128, 2, 1, 2, True, seed=17)
    x, idx, w, w13, w2, sw13, sw2, sg, dy = problem
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2, sw13, sw2, sg)]
    y = _shared_ops.layer(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], leaves[6],
                          activation_clamp=None, block_m=128, recompute=recompute, num_sms=0, precision=precision)
    y.backward(dy)
    exact = _float64_layer(problem)
    bound = 2e-2 if precision == "bf16" else 1.2e-1
    for name, a, b in zip(NAMES, [y.detach()] + [t.grad for t in leaves], exact):
        assert a is not None and rel_err(a, b) < bound, f"{name}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_backward_op_outputs_share_no_memory_on_cpu(precision):
    """With one chunk per shared expert (Is = I) the shared gradients are the combined gradients' last groups as they
    stand: the backward op still returns no tensor that shares memory with another or with an input (torch's custom
    ops refuse aliased outputs)."""
    from prime_kernels.mega import _shared_ops  # noqa: F401  (registers the ops)
    from prime_kernels.mega import _shared_grouped as sg

    problem = _shared_problem(20, 4, 128, 128, 2, 1, 1, False, seed=29)
    x, idx, w, w13, w2, sw13, sw2, _, dy = problem
    idx_e, w_e = sg.extended_routes(idx, w, 4, 1, 1)
    ops = torch.ops.prime_kernels
    out = ops.mega_moe_shared_fwd(x, idx_e, w_e, w13, w2, sw13, sw2, 1, None, 128, True, 0, precision)
    grads = ops.mega_moe_shared_bwd(dy, x, idx_e, w_e, w13, w2, sw13, sw2, *out[1:7], 1, None, False, True, 0,
                                    precision)
    inputs = (dy, x, idx_e, w_e, w13, w2, sw13, sw2, *out[1:7])
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    for g in grads:
        ptr = g.untyped_storage().data_ptr()
        assert ptr not in seen
        seen.add(ptr)


@requires_sm90
@pytest.mark.parametrize("clamp,T,S", [(None, 513, 1), (7.0, 513, 1), (None, 131, 2), (None, 1, 2)])
def test_fp8_layer_with_shared_experts_on_the_gpu(clamp, T, S):
    """precision="fp8" with shared experts inside the routed launches on CUDA (the fused FP8 forward, or the pipeline
    with a clamp; the FP8 backward on the combined copies), NaN-free, against the reference's FP8 layer on the
    expanded weights (the layer matrix's kernel-vs-emulation bound) and the float64 layer."""
    from prime_kernels import _status
    from prime_kernels.mega import _shared_ops, mega_moe

    why = _status.runnable(_shared_ops.FP8_KEY)
    if why != _status.AVAILABLE:
        pytest.skip(f"{_shared_ops.FP8_KEY}: {why}")
    problem = _shared_problem(T, 16, 256, 256, 4, S, 2, True, seed=19 + T)
    cuda = [t.cuda() for t in problem]
    x, idx, w, w13, w2, sw13, sw2, sg, dy = cuda
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2, sw13, sw2, sg)]
    y = _shared_ops.layer(leaves[0], idx, leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], leaves[6],
                          activation_clamp=clamp, block_m=128, recompute=False, num_sms=0, precision="fp8")
    y.backward(dy)
    got = [y.detach()] + [t.grad for t in leaves]
    exact = _float64_layer(problem, clamp)
    for name, a, b in zip(NAMES, got, exact):
        assert a is not None and torch.isfinite(a.float()).all(), name
        bound = 3.5e-1 if clamp and name in ("dx", "dw13", "dsw13") else 1.2e-1
        if T < 16 and name in ("dtopk", "dgate"):
            # a few values (one token: 4 and 2), each a dot product of dy with an output whose e4m3 roundings leave
            # ~6% error: a norm over so few does not average it (T = 1 measured 1.36e-1 for d topk_weights on an H100)
            bound = 2.5e-1
        assert rel_err(a.cpu(), b) < bound, f"{name}: {rel_err(a.cpu(), b):.3e}"
    leaves_r = [t.clone().requires_grad_() for t in (x, w, w13, w2, sw13, sw2, sg)]
    y_r = mega_moe(leaves_r[0], idx, leaves_r[1], leaves_r[2], leaves_r[3], shared_w13=leaves_r[4],
                   shared_w2=leaves_r[5], shared_gate=leaves_r[6], backend="reference", precision="fp8",
                   activation_clamp=clamp, num_experts=16)
    assert rel_err(y, y_r) < 3e-2  # the second pass's two roundings of y against one


@requires_sm90
def test_fp8_weights_with_chunks_on_the_gpu_are_the_expanded_weights_tiles():
    """On CUDA (the routed weight quantized by our kernel straight into the combined copy, the shared tiles moved):
    bit for bit the recipe's quantization of the expanded weight."""
    from prime_kernels.mega import fp8
    from prime_kernels.second_b import expand_chunks

    g = torch.Generator().manual_seed(4)
    for layout, (w, w_2) in {"w13": (torch.randn(4, 512, 256, generator=g), torch.randn(2, 1024, 256, generator=g)),
                             "w2": (torch.randn(4, 256, 256, generator=g), torch.randn(2, 256, 512, generator=g))
                             }.items():
        w, w_2 = w.bfloat16().cuda(), w_2.bfloat16().cuda()
        got = fp8.quantize_weight_with_chunks(w, w_2, 2, layout)
        want = fp8.quantize_weight(torch.cat([w, expand_chunks(w_2, 2, layout)]))
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), layout
        assert torch.equal(got.scale, want.scale), layout


def test_runs_inside_asks_reason_for_one_meta_shared_expert(monkeypatch):
    """_shared_ops.runs_inside, what both integrations ask: reason() with the tokens, the routed weights, a meta
    [1, 2 Is, H] shared weight, one rank and no accumulators, returned plan or clamp; True exactly when it says
    nothing against. On CPU tokens the real reason() refuses (CUDA only)."""
    from prime_kernels.mega import _shared_ops

    x, w13 = torch.empty(5, 64), torch.empty(4, 2 * 32, 64)
    assert _shared_ops.runs_inside(x, w13, 96, backend="auto", precision="bf16") is False
    asked, answer = [], [None]
    monkeypatch.setattr(_shared_ops, "reason", lambda *a, **kw: asked.append((a, kw)) or answer[0])
    assert _shared_ops.runs_inside(x, w13, 96, backend="grouped", precision="fp8") is True
    ((xa, wa, sw), kw), = asked
    assert xa is x and wa is w13 and sw.is_meta and list(sw.shape) == [1, 192, 64]
    assert kw == dict(backend="grouped", precision="fp8", ep_size=1, accumulators=False, return_plan=False,
                      activation_clamp=None)
    answer[0] = "no"
    assert _shared_ops.runs_inside(x, w13, 96, backend="grouped", precision="fp8") is False
