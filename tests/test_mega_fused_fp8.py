"""The fused FP8 forward (mega_moe.fp8.sm90, csrc/sm90/mega_moe_fwd_fp8.cuh) against the FP8 forward pipeline.

The kernel runs the pipeline's quantizations, promotions and roundings in the same order (the dispatch's qK(x, 128),
the FP8 L1 with SwiGLU and qK(s, 64), the FP8 L2 with 1 x 64 A scales), so y and h must be the pipeline's bits, not
merely close: any difference is a wrong operand, scale, row or order. Free memory is NaN-filled before each run so
that a row the kernel forgets to write shows. The grid size must not change a bit (the kernel claims its work: a
grid of one CTA runs every task itself). GPU only: the kernel has no CPU op (the CPU layer runs the pipeline)."""

import pytest
import torch

from conftest import requires_sm90
from mega_helpers import autograd_run, loop_reference, make_problem, poison_free_memory, rel_err, skip_unless_available

KEY = "mega_moe.fp8.sm90"
GRADS = ("dx", "dtopk", "dw13", "dw2")

CASES = [
    # T, E, H, I, K, routing, masked fraction
    (1000, 16, 512, 256, 4, "uniform", 0.0),
    (777, 8, 256, 384, 3, "skewed", 0.1),     # uneven experts, padding rows, masked routes
    (300, 32, 256, 128, 2, "skewed", 0.0),    # empty experts
    (1, 4, 128, 128, 1, "uniform", 0.0),      # one token
    (129, 8, 128, 128, 8, "uniform", 0.0),    # odd T
    (515, 8, 4096, 256, 2, "skewed", 0.05),   # H = 4096: two dispatch pieces per row
    (200, 4, 128, 128, 2, "uniform", 1.0),    # every route masked
]


def _both(problem, E, num_sms=0):
    """(fused forward, pipeline forward) of one problem, with one weight cache."""
    from prime_kernels.mega import _fp8_fwd, _fused, fp8
    from prime_kernels.routing import pool_capacity

    x, idx, w, w13, w2, _ = problem
    cap = pool_capacity(x.shape[0], idx.shape[1], E, 128)
    opts = dict(num_experts=E, block_m=128, capacity=cap, save_h=True)
    poison_free_memory()
    fused = _fused.forward(x, idx, w, w13, w2, precision="fp8", num_sms=num_sms, **opts)
    torch.cuda.synchronize()
    poison_free_memory()
    pipe = _fp8_fwd.forward(x, idx, w, w13, w2, weight_cache=fp8.WEIGHT_CACHE, **opts)
    torch.cuda.synchronize()
    return fused, pipe


@requires_sm90
@pytest.mark.parametrize("T,E,H,I,K,routing,masked", CASES)
def test_fused_fp8_forward_is_the_pipelines_bits(T, E, H, I, K, routing, masked):
    skip_unless_available(KEY)
    problem = [t.cuda() for t in make_problem(T, H, I, E, K, routing=routing, seed=T + E + H, masked_frac=masked)]
    fused, pipe = _both(problem, E)
    for a, b in zip(fused[2:7], pipe[2:7]):  # the plan
        assert torch.equal(a, b)
    assert fused[7] is None
    end = int(fused[3][-1])
    y, h = fused[0], fused[1][:end]
    assert torch.isfinite(y.float()).all() and torch.isfinite(h.float()).all()
    assert torch.equal(h, pipe[1][:end]), f"h differs in {(h != pipe[1][:end]).sum().item()} values"
    assert torch.equal(y, pipe[0]), f"y differs in {(y != pipe[0]).sum().item()} values"


@requires_sm90
@pytest.mark.parametrize("num_sms", [1, 3, 37])
def test_fused_fp8_forward_bits_do_not_depend_on_the_grid(num_sms):
    """Fewer CTAs than tiles (one CTA: every task, the whole dispatch and every wait in one CTA) give the same bits."""
    skip_unless_available(KEY)
    T, E, H, I, K = 600, 8, 512, 256, 4
    problem = [t.cuda() for t in make_problem(T, H, I, E, K, routing="skewed", seed=5, masked_frac=0.05)]
    full, _ = _both(problem, E)
    few, pipe = _both(problem, E, num_sms=num_sms)
    end = int(full[3][-1])
    assert torch.equal(few[0], full[0]) and torch.equal(few[1][:end], full[1][:end])
    assert torch.equal(few[0], pipe[0])


@requires_sm90
def test_fused_fp8_forward_pads_with_zero_rows_and_refuses_a_clamp():
    from prime_kernels.mega import _fused
    from prime_kernels.mega._validate import FusedKernelUnavailable
    from prime_kernels.routing import pool_capacity

    skip_unless_available(KEY)
    T, E, H, I, K = 90, 4, 256, 128, 2
    problem = [t.cuda() for t in make_problem(T, H, I, E, K, routing="skewed", seed=9, masked_frac=0.2)]
    fused, _ = _both(problem, E)
    counts, offsets = fused[2].tolist(), fused[3].tolist()
    for e in range(E):  # padding rows (dispatched as zeros): their h is zero, not left over
        assert not fused[1][offsets[e] + counts[e]:offsets[e + 1]].any()
    x, idx, w, w13, w2, _ = problem
    with pytest.raises(FusedKernelUnavailable, match="activation_clamp"):
        _fused.forward(x, idx, w, w13, w2, precision="fp8", activation_clamp=1.0, num_experts=E, block_m=128,
                       capacity=pool_capacity(T, K, E, 128))


@requires_sm90
def test_fused_fp8_op_refuses_bad_operands_before_any_launch():
    skip_unless_available(KEY)
    from prime_kernels.mega import fp8

    E, H, I = 4, 256, 128
    x = torch.randn(10, H, device="cuda", dtype=torch.bfloat16)
    w13 = fp8.quantize_weight(torch.randn(E, 2 * I, H, device="cuda"), False)
    w2 = fp8.quantize_weight(torch.randn(E, H, I, device="cuda"), False)
    src = torch.full((128 * E,), -1, dtype=torch.int32, device="cuda")
    r2p = torch.full((10 * 2,), -1, dtype=torch.int32, device="cuda")  # every route masked
    offs = torch.arange(E + 1, dtype=torch.int32, device="cuda") * 128
    op = torch.ops.prime_kernels.mega_moe_fp8_fused_fwd
    args = [x, src, r2p, offs, w13.data, w13.scale, w2.data, w2.scale, 2, True]
    h, o = op(*args)  # every row a padding row: zeros
    torch.cuda.synchronize()
    assert not h.any() and not o.any()
    bad = list(args)
    bad[4] = w13.data[:, :, :128]  # H mismatch
    with pytest.raises(RuntimeError, match="w13_q"):
        op(*bad)
    bad = list(args)
    bad[5] = w13.scale[:, :1]
    with pytest.raises(RuntimeError, match="w13_sb"):
        op(*bad)
    bad = list(args)
    bad[3] = offs[:-1]
    with pytest.raises(RuntimeError, match="expert_offsets"):
        op(*bad)
    bad = list(args)
    bad[2] = r2p[:-1]
    with pytest.raises(RuntimeError, match="route_to_pool"):
        op(*bad)
    bad = list(args)
    bad[0] = x[:, :128]
    with pytest.raises(RuntimeError, match="w13_q|x must"):
        op(*bad)


@requires_sm90
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_fp8_layer_through_autograd(recompute):
    """mega_moe(precision="fp8", backend="fused"): the same y and gradients as backend="grouped" (the same forward
    bits, then the same FP8 backward pipeline), and within the recipe's error of the float64 loop."""
    skip_unless_available(KEY)
    from prime_kernels.mega import _backend

    T, E, H, I, K = 517, 8, 256, 256, 4
    problem = [t.cuda() for t in make_problem(T, H, I, E, K, routing="skewed", seed=78, masked_frac=0.1)]
    assert _backend.resolve("fwd", "auto", "fp8", problem[0], problem[3]) == "fused"
    y, grads = autograd_run(problem, "fused", "fp8", recompute)
    y_ref, want = autograd_run(problem, "grouped", "fp8", recompute)
    exact = loop_reference(*(t.cpu() for t in problem))
    assert torch.equal(y, y_ref)
    assert rel_err(y.cpu(), exact[0]) < 1.2e-1
    for name, a, b in zip(GRADS, grads, want):
        assert a is not None and torch.equal(a, b), name


@requires_sm90
@pytest.mark.parametrize("pow2", [False, True])
def test_fused_fp8_op_over_an_unpadded_plan_is_the_kernels_bits(pow2):
    """A plan without padding (block_m = 1: every expert's last 128-row m-block is a tail, and its L1 and L2 tiles
    read rows of the next expert): the tail halves' generic-store epilogue and the row counts of partial m-blocks,
    which the layer's padded plans never reach. h and o against the pipeline's kernels on the same plan, bit for bit,
    with general and power-of-two scales."""
    skip_unless_available(KEY)
    from prime_kernels.grouped_gemm import m_grouped_fp8_gemm_nt
    from prime_kernels.mega import fp8
    from prime_kernels.quantize import dispatch_rows_fp8
    from prime_kernels.routing import routing_plan_reference
    from prime_kernels.swiglu_fwd_fp8 import m_grouped_fp8_gemm_swiglu

    T, E, H, I, K = 700, 8, 256, 256, 3
    x, idx, _, w13, w2, _ = [t.cuda() for t in make_problem(T, H, I, E, K, routing="skewed", seed=31,
                                                           masked_frac=0.1)]
    plan = routing_plan_reference(idx, E, 1)
    src, r2p, offs = plan.pool_src_route, plan.route_to_pool.reshape(-1).contiguous(), plan.expert_offsets
    assert (offs[1:-1] % 128 != 0).any()  # tails inside the pool, not only at its end
    q13, q2 = fp8.quantize_weight(w13, pow2), fp8.quantize_weight(w2, pow2)
    poison_free_memory()
    h, o = torch.ops.prime_kernels.mega_moe_fp8_fused_fwd(x, src, r2p, offs, q13.data, q13.scale, q2.data, q2.scale,
                                                          K, True, pow2)
    torch.cuda.synchronize()
    poison_free_memory()
    x_q, x_sa = dispatch_rows_fp8(x, r2p.view(T, K), src.shape[0], pow2_scales=pow2)
    l1 = m_grouped_fp8_gemm_swiglu(x_q, x_sa, q13.data, q13.scale, offs, pow2_scales=pow2, save_h=True)
    o_ref = m_grouped_fp8_gemm_nt(l1.s_q, l1.s_sa, q2.data, q2.scale, offs)
    torch.cuda.synchronize()
    end = int(offs[-1])
    assert torch.isfinite(h[:end].float()).all() and torch.isfinite(o[:end].float()).all()
    assert torch.equal(h[:end], l1.h[:end]), f"h differs in {(h[:end] != l1.h[:end]).sum().item()} values"
    assert torch.equal(o[:end], o_ref[:end]), f"o differs in {(o[:end] != o_ref[:end]).sum().item()} values"
