"""prime-rl's FP8 Mega MoE call sequence, replayed through the ``deep_gemm`` drop-in (names from ``deep_gemm.mega.fp8``,
the module prime-rl imports them from on its DeepGEMM fork).

The sequence (../shared/research/prime_and_ports.md 1.4, Gen C, its FP8 token dispatcher; that file is outside this
repository): one FP8 staging buffer and one L2 operand pool for every layer; per forward, x cast 1 x 128 with
power-of-two scales (DeepEP's FP8 dispatch format), topk_idx masked to -1 where the score is 0, both staged,
``fp8_mega_moe(y, (w13, w13_sf), (w2, w2_sf), pools, buffer)``, then ``column_quant`` of the pooled x on a side
stream; per backward, dy staged, ``fp8_mega_moe_backward`` for the data gradients and ``fp8_mega_moe_weight_grads``
into fp32 accumulators (now, or deferred and flushed by ``fp8_mega_moe_weight_grads_add``). Weight gradients bypass
autograd. Every output starts as NaN.

Checked against the FP8 pipelines the layer API runs (``_fp8_fwd.forward`` / ``_fp8_bwd.backward``) on the same
values (x dequantized, the recipe with power-of-two scales): the same kernels on the same operands, so the same
bits; and against the unquantized float64 layer, loosely."""

import pytest
import torch

from mega_helpers import loop_reference, make_problem, rel_err, skip_unless_available

import deep_gemm
from deep_gemm.mega import fp8 as dg_fp8

BLOCK = 128


def _nan(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


class Layer:
    """What prime-rl's dispatcher holds for one layer shape: the staging buffer, the shared L2 operand pool, the
    step's FP8 weights, the fp32 gradient accumulators and the deferred micro-batches."""

    def __init__(self, E, T_max, K, H, I, w13, w2, device, defer=False, pow2=True, clamp=None):
        self.pow2 = pow2
        self.clamp = clamp  # the model's activation_clamp, given to the forward and backward calls alike  # the caller's cast and the kernels' own quantization: power-of-two scales, or general
        self.buffer = dg_fp8.FP8SymmBuffer(None, E, T_max, K, H, device=device)
        self.capacity = dg_fp8.pool_capacity(T_max, K, E, 1.0)
        self.h, self.h_sf = dg_fp8.FP8Pools.l2_operand(self.capacity, I, device=device)
        self.E, self.H, self.I = E, H, I
        self.weights = dg_fp8.fp8_weights_for_mega_moe(w13, w2, pow2_scales=pow2, cache=dg_fp8.Fp8WeightCache())
        self.dw13 = torch.zeros(w13.shape, dtype=torch.float32, device=device)
        self.dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=device)
        self.side = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        self.pending = [] if defer else None


class PrimeRLFP8Experts(torch.autograd.Function):
    """Shaped like prime-rl's FP8 routed-experts function: saves topk_idx and the pool outputs, returns
    (grad_x, None, grad_topk_weights, None); the weight gradients go into the layer's accumulators."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, layer):
        T, buf = x.shape[0], layer.buffer
        q = dg_fp8.quantize_along_k(x, pow2_scales=layer.pow2)  # the caller's 1 x 128 cast
        buf.x[:T].copy_(q.data)
        buf.x_sf[:T].copy_(q.scale)
        buf.topk_idx[:T].copy_(torch.where(topk_weights == 0, torch.full_like(topk_idx, -1), topk_idx))
        buf.topk_weights[:T].copy_(topk_weights)
        pools = dg_fp8.FP8Pools.allocate(layer.capacity, layer.H, layer.I, layer.E, layer.h, layer.h_sf)
        y = _nan((T, layer.H), torch.bfloat16, x.device)
        w13, w13_sf, w2, w2_sf = layer.weights[:4]
        dg_fp8.fp8_mega_moe(y, (w13, w13_sf), (w2, w2_sf), pools, buf, pow2_scales=layer.pow2,
                            activation_clamp=layer.clamp)
        x_t, x_t_sf = dg_fp8.allocate_column_quant(layer.capacity, layer.H, device=x.device)
        if layer.side is not None:
            layer.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(layer.side):
                dg_fp8.column_quant(pools.x, pools.x_sf, pools.counts, x_t, x_t_sf, pow2_scales=layer.pow2)
            ctx.column_done = torch.cuda.Event()
            ctx.column_done.record(layer.side)
        else:
            dg_fp8.column_quant(pools.x, pools.x_sf, pools.counts, x_t, x_t_sf, pow2_scales=layer.pow2)
            ctx.column_done = None
        # what prime-rl's op returns for autograd to keep: not the pooled x (column_quant has read it), nor the
        # shared L2 operand, which the next layer overwrites
        ctx.x_t, ctx.layer = (x_t, x_t_sf), layer
        ctx.save_for_backward(topk_idx, pools.z, pools.weights, pools.meta, pools.counts)
        return y

    @staticmethod
    def backward(ctx, dy):
        layer = ctx.layer
        _, z, weights, meta, counts = ctx.saved_tensors
        pools = dg_fp8.FP8Pools(z=z, weights=weights, meta=meta, counts=counts)
        T = dy.shape[0]
        layer.buffer.dy[:T].copy_(dy)
        if ctx.column_done is not None:
            torch.cuda.current_stream().wait_event(ctx.column_done)
        bufs = dg_fp8.FP8BackwardBuffers(layer.capacity, layer.H, layer.I, device=dy.device)
        grad_x = _nan((T, layer.H), torch.bfloat16, dy.device)
        grad_w = _nan((T, layer.buffer.num_topk), torch.float32, dy.device)
        w13_t, w13_t_sf, w2_t, w2_t_sf = layer.weights[4:]
        dg_fp8.fp8_mega_moe_backward(grad_x, grad_w, (w13_t, w13_t_sf), (w2_t, w2_t_sf), pools, bufs, layer.buffer,
                                     pow2_scales=layer.pow2, activation_clamp=layer.clamp)
        dg_fp8.fp8_mega_moe_weight_grads(pools.counts, bufs, ctx.x_t, layer.dw13, layer.dw2, layer.side, False,
                                         pending=layer.pending, defer=layer.pending is not None)
        return grad_x, None, grad_w, None


def _finish(layer):
    if layer.pending is not None:
        deep_gemm.fp8_mega_moe_weight_grads_add(layer.pending, layer.dw13, layer.dw2, layer.side)
    if layer.side is not None:
        torch.cuda.current_stream().wait_stream(layer.side)


def _replay(problem, device, defer=False, micro_batches=1, max_tokens=None, pow2=True, clamp=None):
    x, idx, w, w13, w2, dy = (t.to(device) for t in problem)
    T, K = idx.shape
    layer = Layer(w13.shape[0], max_tokens or T, K, x.shape[1], w2.shape[2], w13, w2, device, defer=defer, pow2=pow2,
                  clamp=clamp)
    outs = []
    for _ in range(micro_batches):
        xg = x.clone().requires_grad_()
        wg = w.clone().requires_grad_()
        y = PrimeRLFP8Experts.apply(xg, idx, wg, layer)
        y.backward(dy)
        outs.append((y.detach(), xg.grad, wg.grad))
    _finish(layer)
    return outs, layer


def _pipeline(problem, device, clamp=None):
    """The layer API's FP8 pipelines on the same values: x as the staged bytes dequantized, the recipe with
    power-of-two scales, masked routes as the staged topk_idx has them."""
    from prime_kernels.mega import _fp8_bwd, _fp8_fwd, fp8
    from prime_kernels.routing import pool_capacity

    x, idx, w, w13, w2, dy = (t.to(device) for t in problem)
    T, K = idx.shape
    E = w13.shape[0]
    xv = fp8.quantize_along_k(x, pow2_scales=True).dequantize().to(torch.bfloat16)
    idx = torch.where(w == 0, torch.full_like(idx, -1), idx)
    recipe = fp8.Fp8Recipe(pow2_scales=True)
    cache = fp8.Fp8WeightCache()
    cap = pool_capacity(T, K, E, BLOCK)
    y, h, counts, offsets, src, srank, r2p = _fp8_fwd.forward(xv, idx, w, w13, w2, num_experts=E, block_m=BLOCK,
                                                              capacity=cap, fp8_recipe=recipe, weight_cache=cache,
                                                              activation_clamp=clamp)
    dw13 = torch.zeros(w13.shape, dtype=torch.float32, device=device)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=device)
    dx, dt, _, _ = _fp8_bwd.backward(dy, xv, idx, w, w13, w2, h, counts, offsets, src, srank, r2p, num_experts=E,
                                     need_wgrad=False, dw13_accum=dw13, dw2_accum=dw2, precision="fp8",
                                     fp8_recipe=recipe, weight_cache=cache, activation_clamp=clamp)
    return y, dx, dt, dw13, dw2


CASES = [
    # T, E, H, I, K, masked, routing
    (61, 8, 128, 128, 3, 0.15, "skewed"),   # empty experts, tails shorter than a 128-row block, masked routes
    (300, 4, 256, 128, 2, 0.0, "uniform"),  # experts over one 128-row block
    (1, 2, 128, 256, 1, 0.0, "uniform"),    # one token
]


def _device_or_skip(device, clamp=None):
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        skip_unless_available("mega_moe_grouped.fp8.sm90")
        skip_unless_available("mega_moe.fp8_bwd.sm90")
        if clamp is not None:
            skip_unless_available("m_grouped_gemm_swiglu_clamp.fp8.sm90")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("T,E,H,I,K,masked,routing", CASES)
def test_replay_equals_the_fp8_pipelines(device, T, E, H, I, K, masked, routing):
    _device_or_skip(device)
    problem = make_problem(T, H, I, E, K, routing=routing, seed=T + E, masked_frac=masked)
    outs, layer = _replay(problem, device)
    (y, dx, dt), = outs
    want = _pipeline(problem, device)
    got = (y, dx, dt, layer.dw13, layer.dw2)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, want):
        assert a.shape == b.shape, name
        assert torch.isfinite(a.float()).all(), name
        assert torch.equal(a.float(), b.float()), f"{name}: rel err {rel_err(a, b):.3e}"
    # masked routes get a zero gradient
    idx = problem[1]
    assert (dt.cpu()[idx == -1] == 0).all()
    # and the whole is the MoE layer, up to FP8's error (float64 reference of the unquantized layer; one token's
    # d topk_weights is one sum with cancellation, so only the larger cases are held to this)
    if T < 32:
        return
    ref = loop_reference(*problem)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), got, ref):
        assert rel_err(a.cpu(), b) < 0.1, f"{name}: {rel_err(a.cpu(), b):.3e} against float64"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("clamp", [1.0, 7.0])
def test_replay_with_a_clamp_equals_the_fp8_pipelines(device, clamp):
    """A clamped model's call sequence (activation_clamp given to the forward and to the backward): every output
    bitwise the layer API's FP8 pipelines with the same clamp, on pre-activations the clamp bites."""
    _device_or_skip(device, clamp)
    T, E, H, I, K = 61, 8, 128, 128, 3
    x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, routing="skewed", seed=23, masked_frac=0.1)
    problem = (x * 2, idx, w, w13 * 2, w2, dy)  # pre-activations of a few units
    outs, layer = _replay(problem, device, clamp=clamp)
    (y, dx, dt), = outs
    want = _pipeline(problem, device, clamp=clamp)
    unclamped = _pipeline(problem, device)
    assert not torch.equal(want[0], unclamped[0]), "the clamp never bites"
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), (y, dx, dt, layer.dw13, layer.dw2), want):
        assert torch.isfinite(a.float()).all(), name
        assert torch.equal(a.float(), b.float()), f"{name}: rel err {rel_err(a, b):.3e}"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deferred_weight_grads_equal_immediate(device):
    _device_or_skip(device)
    problem = make_problem(130, 128, 128, 4, 2, routing="skewed", seed=5, masked_frac=0.1)
    _, now = _replay(problem, device, defer=False, micro_batches=3)
    _, held = _replay(problem, device, defer=True, micro_batches=3)
    assert held.pending == []
    assert torch.equal(now.dw13, held.dw13) and torch.equal(now.dw2, held.dw2)
    once = _replay(problem, device)[1]
    assert rel_err(now.dw13, 3 * once.dw13) < 1e-6


def test_defer_flushes_past_the_limit():
    problem = make_problem(20, 128, 128, 2, 1, seed=9)
    x, idx, w, w13, w2, dy = problem
    _, layer = _replay(problem, "cpu", defer=True, micro_batches=dg_fp8.MAX_DEFERRED + 1)
    assert layer.pending == []  # _finish flushed the rest; the 5th call flushed the first four
    _, ref = _replay(problem, "cpu", micro_batches=dg_fp8.MAX_DEFERRED + 1)
    assert torch.equal(layer.dw13, ref.dw13)


def test_zero_tokens():
    _, _, _, w13, w2, _ = make_problem(2, 128, 128, 2, 2, seed=3)
    layer = Layer(2, 4, 2, 128, 128, w13, w2, "cpu")
    pools = dg_fp8.FP8Pools.allocate(layer.capacity, 128, 128, 2, layer.h, layer.h_sf)
    y = torch.empty(0, 128, dtype=torch.bfloat16)
    dg_fp8.fp8_mega_moe(y, layer.weights[0:2], layer.weights[2:4], pools, layer.buffer)
    assert (pools.counts == 0).all() and (pools.meta == -1).all() and (pools.weights == 0).all()
    bufs = dg_fp8.FP8BackwardBuffers(layer.capacity, 128, 128, device="cpu")
    gx, gw = torch.empty(0, 128, dtype=torch.bfloat16), torch.empty(0, 2)
    dg_fp8.fp8_mega_moe_backward(gx, gw, layer.weights[4:6], layer.weights[6:8], pools, bufs, layer.buffer)
    x_t, x_t_sf = dg_fp8.allocate_column_quant(layer.capacity, 128, device="cpu")
    dg_fp8.column_quant(pools.x, pools.x_sf, pools.counts, x_t, x_t_sf)
    dg_fp8.fp8_mega_moe_weight_grads(pools.counts, bufs, (x_t, x_t_sf), layer.dw13, layer.dw2)
    assert (layer.dw13 == 0).all() and (layer.dw2 == 0).all()


def _staged_layer(T=8, E=2, K=2, H=128, I=128, seed=4):
    problem = make_problem(T, H, I, E, K, seed=seed)
    x, idx, w, w13, w2, dy = problem
    layer = Layer(E, T, K, H, I, w13, w2, "cpu")
    q = dg_fp8.quantize_along_k(x, pow2_scales=True)
    layer.buffer.x[:T].copy_(q.data)
    layer.buffer.x_sf[:T].copy_(q.scale)
    layer.buffer.topk_idx[:T].copy_(idx)
    layer.buffer.topk_weights[:T].copy_(w)
    pools = dg_fp8.FP8Pools.allocate(layer.capacity, H, I, E, layer.h, layer.h_sf)
    return layer, pools, T


def test_refusals_leave_the_outputs_untouched():
    layer, pools, T = _staged_layer()
    l1, l2 = layer.weights[0:2], layer.weights[2:4]
    y = _nan((T, 128), torch.bfloat16, "cpu")
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="activation_clamp"):
            dg_fp8.fp8_mega_moe(y, l1, l2, pools, layer.buffer, activation_clamp=bad)
    with pytest.raises(ValueError, match="shape"):
        dg_fp8.fp8_mega_moe(_nan((T, 256), torch.bfloat16, "cpu"), l1, l2, pools, layer.buffer)
    with pytest.raises(TypeError, match="pair"):
        dg_fp8.fp8_mega_moe(y, l1[0], l2, pools, layer.buffer)
    with pytest.raises(ValueError, match="l1_t|l1"):
        dg_fp8.fp8_mega_moe(y, layer.weights[4:6], l2, pools, layer.buffer)  # transposed tiles where l1 goes
    small = dg_fp8.FP8Pools.allocate(64, 128, 128, 2, device="cpu")
    with pytest.raises(ValueError, match="pool_capacity"):
        dg_fp8.fp8_mega_moe(y, l1, l2, small, layer.buffer)
    bf16_buffer = deep_gemm.get_symm_buffer_for_mega_moe(None, 2, 8, 2, 128, 128, device="cpu", reuse=False)
    with pytest.raises(TypeError, match="FP8SymmBuffer"):
        dg_fp8.fp8_mega_moe(y, l1, l2, pools, bf16_buffer)
    layer.buffer.topk_idx[0, 0] = 5  # an expert id past the 2 experts
    with pytest.raises(ValueError, match="expert"):
        dg_fp8.fp8_mega_moe(y, l1, l2, pools, layer.buffer)
    assert y.isnan().all()
    bufs = dg_fp8.FP8BackwardBuffers(layer.capacity, 128, 128, device="cpu")
    x_t = dg_fp8.allocate_column_quant(layer.capacity, 128, device="cpu")
    with pytest.raises(NotImplementedError, match="wgrad_tile_scales"):
        dg_fp8.fp8_mega_moe_weight_grads(pools.counts, bufs, x_t,
                                         layer.dw13, layer.dw2, None, True)
    with pytest.raises(TypeError, match="pending"):
        dg_fp8.fp8_mega_moe_weight_grads(pools.counts, bufs, x_t,
                                         layer.dw13, layer.dw2, defer=True)
    with pytest.raises(TypeError, match="dw13"):
        dg_fp8.fp8_mega_moe_weight_grads(pools.counts, bufs, x_t,
                                         layer.dw13.bfloat16(), layer.dw2)
    assert (layer.dw13 == 0).all()


def test_expert_offsets_are_the_plans():
    from prime_kernels.routing import routing_plan

    for seed in range(4):
        _, idx, *_ = make_problem(97, 128, 128, 8, 3, routing="skewed", seed=seed, masked_frac=0.2)
        plan = routing_plan(idx, 8, BLOCK)
        assert torch.equal(dg_fp8.expert_offsets(plan.expert_counts), plan.expert_offsets)


def test_the_calls_refuse_a_gpu_without_the_fp8_kernels(monkeypatch):
    """On CUDA every call asks status() first (here: a device whose FP8 kernels are unavailable, without a GPU)."""
    from prime_kernels.mega import _backend, staged_fp8

    monkeypatch.setattr(_backend, "fp8_kernel_reason", lambda precision, direction: f"{direction}: no sm_90 device")
    for call, direction in (("fp8_mega_moe", "fwd"), ("column_quant", "fwd"), ("fp8_mega_moe_backward", "bwd"),
                            ("fp8_mega_moe_weight_grads", "bwd")):
        with pytest.raises(_backend.FusedKernelUnavailable, match=f"{call}: .*{direction}: no sm_90 device"):
            staged_fp8.require_kernels(torch.device("cuda", 0), call)
    staged_fp8.require_kernels(torch.device("cpu"), "fp8_mega_moe")  # the CPU runs the ops' CPU kernels


@pytest.mark.parametrize("routing,max_tokens", [("all_masked", None), ("skewed", 300)])
def test_replay_all_masked_and_pools_larger_than_the_step(routing, max_tokens):
    """Every route masked (empty experts everywhere: zero outputs and gradients), and a buffer and pools sized for
    more tokens than this step has: the same bits as the pipelines."""
    problem = make_problem(45, 128, 128, 4, 2, routing=routing, seed=11, masked_frac=0.2)
    outs, layer = _replay(problem, "cpu", max_tokens=max_tokens)
    (y, dx, dt), = outs
    want = _pipeline(problem, "cpu")
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), (y, dx, dt, layer.dw13, layer.dw2), want):
        assert torch.equal(a.float(), b.float()), name
    if routing == "all_masked":
        assert not y.any() and not dx.any() and not dt.any() and not layer.dw13.any() and not layer.dw2.any()


def test_replay_with_general_scales_is_the_layer_up_to_fp8():
    """x cast with general (not power-of-two) scales and the kernels' own scales general too: not the pipelines'
    bits (their x is re-quantized from bf16), but the MoE layer within FP8's error of the float64 evaluation."""
    problem = make_problem(96, 256, 128, 4, 2, routing="skewed", seed=12, masked_frac=0.1)
    outs, layer = _replay(problem, "cpu", pow2=False)
    (y, dx, dt), = outs
    ref = loop_reference(*problem)
    for name, a, b in zip(("y", "dx", "dtopk", "dw13", "dw2"), (y, dx, dt, layer.dw13, layer.dw2), ref):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < 0.1, f"{name}: {rel_err(a, b):.3e} against float64"


def test_recv_stats_add_the_counts_and_num_sms_is_taken():
    layer, pools, T = _staged_layer(T=30, E=4, K=2, seed=13)
    stats = torch.full((4,), 5, dtype=torch.int32)
    y = _nan((T, 128), torch.bfloat16, "cpu")
    dg_fp8.fp8_mega_moe(y, layer.weights[0:2], layer.weights[2:4], pools, layer.buffer, num_sms=8,
                        cumulative_local_expert_recv_stats=stats)
    idx = layer.buffer.topk_idx[:T]
    assert torch.equal(stats, 5 + torch.bincount(idx[idx >= 0], minlength=4).int())
    assert torch.equal(pools.counts, stats - 5)
    with pytest.raises(ValueError, match="num_sms"):
        dg_fp8.fp8_mega_moe(y, layer.weights[0:2], layer.weights[2:4], pools, layer.buffer, num_sms=-1)


def test_backward_with_fewer_tokens_than_the_forward_raises():
    """dy of fewer tokens than the forward that filled the pools: refused (CPU: by the ops, before they write;
    CUDA: a device finding), never an out-of-bounds write."""
    dy = make_problem(40, 128, 128, 2, 2, seed=15)[5]
    layer, pools, T = _staged_layer(T=40, E=2, K=2, seed=14)
    dg_fp8.fp8_mega_moe(_nan((T, 128), torch.bfloat16, "cpu"), layer.weights[0:2], layer.weights[2:4], pools,
                        layer.buffer)
    layer.buffer.dy[:20].copy_(dy[:20])
    bufs = dg_fp8.FP8BackwardBuffers(layer.capacity, 128, 128, device="cpu")
    gx, gw = _nan((20, 128), torch.bfloat16, "cpu"), _nan((20, 2), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="route|past"):
        dg_fp8.fp8_mega_moe_backward(gx, gw, layer.weights[4:6], layer.weights[6:8], pools, bufs, layer.buffer)
    assert gx.isnan().all() and gw.isnan().all()
