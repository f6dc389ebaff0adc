"""The FP8 recipe of the reference (precision "fp8" and "fp8_bwd") and the blockwise helpers it is built from
(prime_kernels.mega.fp8), on the CPU.

Two kinds of check: the recipe step by step against an emulation written here independently (blocks
quantized one at a time, float64 GEMMs on dequantized operands), to a tight bound, so that a changed rounding
point or scale rule fails; and the result against the unrounded float64 formula, to the bound FP8 allows."""

import gc
import math

import pytest
import torch
import torch.nn.functional as F

from mega_helpers import ROUTING_CASES, case_problem, loop_reference, make_problem, rel_err, run_layer

from prime_kernels.mega import MegaMoE, fp8, mega_moe, reference
from prime_kernels.mega.reference import mega_moe_reference, round_h

# FP8 against the float64 formula: four e4m3 quantizations on the way to y (x, w13, s, w2) and as many to each
# gradient. Measured over the cases below (H=256, I=128): fp8 5.4e-2 .. 7.6e-2 without a clamp and up to 7.9e-2
# with one; fp8_bwd 3.1e-3 .. 4.3e-3 for y (the bf16 forward) and 2.1e-3 .. 5.3e-2 for the gradients.
TOL_FORMULA = 1.2e-1
# With the FP8 forward and a clamp, h carries e4m3 error, so values near the bound fall on the other side of it
# than the exact h does and their gradient is cut (or passed) where the formula's is not: dX and dW13 measured
# 1.9e-1 .. 2.4e-1 at c = 0.75 on unit-variance h (a quarter of the gate and half of the up values clamped),
# 6.1e-2 .. 9.7e-2 at c = 2 (the same cases, not run here).
TOL_FORMULA_CLAMP_MASKS = 3.5e-1
# The reference against the independent emulation of the same recipe: they differ by fp32 (not float64)
# intermediates and the rare e4m3 or bf16 rounding (or block amax, and so a whole block's scale) those move
# across a boundary. Measured 0 .. 1.0e-4 over the cases of test_fp8_reference_follows_the_recipe; the
# mutations of test_a_changed_recipe_fails_the_recipe_check move it above 1e-2.
TOL_RECIPE = 1e-3
OUTPUTS = ("y", "dx", "dtopk", "dw13", "dw2")


def _bits(t):
    return t.view(torch.uint8) if t.dtype == fp8.E4M3 else t


# ---------------------------------------------------------------------------------------------------------------
# An independent emulation of the recipe
# ---------------------------------------------------------------------------------------------------------------


def _block_scale(amax: float, pow2: bool) -> float:
    """The scale rule of a block, on Python floats: fp32(amax / 448), or the next power of two up; 1 for zero."""
    scale = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32))
    if scale == 0.0:
        return 1.0
    if pow2:
        m, e = math.frexp(scale)
        scale = math.ldexp(1.0, e - 1 if m == 0.5 else e)
    return scale


def _fake_quant_block(block: torch.Tensor, pow2: bool) -> torch.Tensor:
    scale = _block_scale(float(block.abs().max()) if block.numel() else 0.0, pow2)
    s = torch.tensor(scale, dtype=torch.float32)
    return (block / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale


def fake_quant(v: torch.Tensor, block_rows: int, block_cols: int, pow2: bool = False) -> torch.Tensor:
    """The dequantized values (float64, exact) of v [R, C] quantized block by block."""
    v = v.float()
    out = torch.empty(v.shape, dtype=torch.float64)
    R, C = v.shape
    if block_rows == 1:  # one scale per row and column block: the rows at once
        for c0 in range(0, C, block_cols):
            blk = v[:, c0:c0 + block_cols]
            for r in range(R):
                out[r, c0:c0 + block_cols] = _fake_quant_block(blk[r], pow2)
        return out
    for r0 in range(0, R, block_rows):
        for c0 in range(0, C, block_cols):
            out[r0:r0 + block_rows, c0:c0 + block_cols] = _fake_quant_block(
                v[r0:r0 + block_rows, c0:c0 + block_cols], pow2)
    return out


def recipe_emulation(x, idx, w, w13, w2, dy, *, clamp=None, precision="fp8", pow2=False, l2_block=128):
    """(y, dx, dtopk, dw13, dw2) of the FP8 recipe, one expert at a time, routes in (token, k) order."""
    T, K = idx.shape
    El, twoI, H = w13.shape
    I = twoI // 2
    bf = torch.bfloat16
    slots = torch.zeros(T, K, H, dtype=torch.float64)
    dx_slots = torch.zeros(T, K, H, dtype=torch.float64)
    dtopk = torch.zeros(T, K, dtype=torch.float64)
    dw13 = torch.zeros(El, twoI, H, dtype=torch.float64)
    dw2 = torch.zeros(El, H, I, dtype=torch.float64)
    for e in range(El):
        tt, kk = torch.nonzero(idx == e, as_tuple=True)
        if tt.numel() == 0:
            continue
        xe, dye, we = x[tt], dy[tt], w[tt, kk].double()[:, None]
        W13 = fake_quant(w13[e], 128, 128, pow2)
        W2 = fake_quant(w2[e], 128, 128, pow2)
        if precision == "fp8":
            h = (fake_quant(xe, 1, 128, pow2) @ W13.t()).float()
            gate, up = h[:, :I].double(), h[:, I:].double()
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            s = fake_quant(F.silu(gate) * up, 1, l2_block, pow2)
            slots[tt, kk] = (s @ W2.t()).to(bf).double()
        else:  # the bf16 forward
            h = xe.float() @ w13[e].float().t()
            hb = round_h(h, clamp, bf).float()
            gate, up = hb[:, :I], hb[:, I:]
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            s = (F.silu(gate) * up).to(bf).float()
            slots[tt, kk] = (s @ w2[e].float().t()).to(bf).double()
        hs = round_h(h, clamp, bf).double()  # the saved h
        g, u = hs[:, :I], hs[:, I:]
        gc, uc = (g.clamp(max=clamp), u.clamp(-clamp, clamp)) if clamp is not None else (g, u)
        sig = torch.sigmoid(gc)
        silu = gc * sig
        s_b = silu * uc
        da = fake_quant(dye, 1, 128, pow2) @ W2
        dtopk[tt, kk] = (da * s_b).sum(-1)
        ds = we * da
        dg = ds * uc * sig * (1 + gc * (1 - sig))
        du = ds * silu
        if clamp is not None:
            dg = dg * (g < clamp)
            du = du * ((u > -clamp) & (u < clamp))
        dh = torch.cat([dg, du], 1).to(bf).double()  # B6 and B9: rounded to bf16, then quantized
        if I % 128 and I % 64 == 0:  # the kernels' sizes of I = 64 (mod 128): dg and du blocked on their own
            dh_k = torch.cat([fake_quant(dh[:, :I], 1, 128, pow2), fake_quant(dh[:, I:], 1, 128, pow2)], 1)
        else:
            dh_k = fake_quant(dh, 1, 128, pow2)
        dx_slots[tt, kk] = (dh_k @ W13).to(bf).double()
        dw2[e] = fake_quant(dye, 128, 1, pow2).t() @ fake_quant((we * s_b).to(bf).double(), 128, 1, pow2)
        dw13[e] = fake_quant(dh, 128, 1, pow2).t() @ fake_quant(xe, 128, 1, pow2)
    y = (w.double()[:, :, None] * slots).sum(1).to(bf)
    return y, dx_slots.sum(1).to(bf), dtopk.float(), dw13.to(bf), dw2.to(bf)


def run_fp8(x, idx, w, w13, w2, dy, **kwargs):
    """mega_moe_reference forward + backward on leaf copies: (y, dx, dtopk, dw13, dw2)."""
    xs = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    y = mega_moe_reference(xs[0], idx, xs[1], xs[2], xs[3], **kwargs)
    y.backward(dy)
    return y.detach(), xs[0].grad, xs[1].grad, xs[2].grad, xs[3].grad


def recipe_errors(problem, **kwargs):
    """Relative error per output of the reference against the independent emulation."""
    x, idx, w, w13, w2, dy = problem
    opts = {k: kwargs[k] for k in ("clamp", "precision") if k in kwargs}
    recipe = fp8.Fp8Recipe(l2_act_block=kwargs.get("l2_block", 128), pow2_scales=kwargs.get("pow2", False))
    with fp8.exact_partial_sums():  # the emulation below sums exactly; the tensor core's sums have their own tests
        got = run_fp8(x, idx, w, w13, w2, dy, precision=opts.get("precision", "fp8"),
                      activation_clamp=opts.get("clamp"), block_m=16, fp8_recipe=recipe,
                      weight_cache=fp8.Fp8WeightCache())
    ref = recipe_emulation(x, idx, w, w13, w2, dy, **kwargs)
    return {n: rel_err(a, b) for n, a, b in zip(OUTPUTS, got, ref)}


# ---------------------------------------------------------------------------------------------------------------
# Quantization helpers
# ---------------------------------------------------------------------------------------------------------------


def _spread(shape, seed):
    """bf16 values whose magnitude varies by orders of magnitude from row to row and column to column."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g)
    v = v * 10 ** (torch.rand(shape[0], 1, generator=g) * 6 - 3) * 10 ** (torch.rand(1, shape[1], generator=g) * 2 - 1)
    return v.bfloat16()


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("blocks", [(1, 128), (128, 1), (128, 128), (1, 64)])
def test_round_trip_error_per_block(blocks, pow2):
    v = _spread((300, 333), seed=1)  # tails on both axes
    br, bc = blocks
    q = fp8.quantize_blocks(v, br, bc, pow2)
    assert q.data.dtype == fp8.E4M3 and q.data.shape == v.shape
    assert q.scale.shape == (math.ceil(300 / br), math.ceil(333 / bc)) and q.scale.dtype == torch.float32
    vf = v.float()
    scale = q.expanded_scale()
    err = (q.dequantize() - vf).abs()
    # e4m3 has 3 mantissa bits: half an ulp is 2^-4 of the value in the normal range and 2^-10 of the scale
    # among the subnormals; plus the fp32 rounding of the dequantized product
    bound = torch.maximum(vf.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 2 ** -16)
    assert (err <= bound).all()
    # every block's scale follows the rule, and its largest element lands on (or, pow2, within) the e4m3 range
    for r0 in range(0, 300, max(br, 37)):
        for c0 in range(0, 333, max(bc, 41)):
            i, j = r0 // br, c0 // bc
            blk = vf[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            assert q.scale[i, j].item() == _block_scale(blk.abs().max().item(), pow2)
            top = q.data[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float().abs().max().item()
            assert top == 448.0 if not pow2 else 224.0 <= top <= 448.0


def test_zero_and_underflowing_blocks_get_scale_one():
    v = torch.zeros(3, 256)
    v[1, :128] = 1e-44  # amax / 448 underflows fp32
    v[2, 128:] = torch.linspace(-1, 1, 128)
    for pow2 in (False, True):
        q = fp8.quantize_along_k(v, 128, pow2)
        assert q.scale[0].tolist() == [1.0, 1.0] and q.scale[1].tolist() == [1.0, 1.0] and q.scale[2, 0] == 1.0
        assert (q.data[:2].float() == 0).all() and (q.data[2, :128].float() == 0).all()
    assert fp8.quantize_along_k(torch.zeros(0, 300)).scale.shape == (0, 3)


def test_power_of_two_scales_are_exact_powers():
    v = _spread((256, 384), seed=2)
    q = fp8.quantize_weight(v, pow2_scales=True)
    mantissa, _ = torch.frexp(q.scale)
    assert (mantissa == 0.5).all()  # exactly 2^n
    amax = v.float().abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    assert (q.scale >= amax / 448).all() and (q.scale / 2 < amax / 448).all()
    # an amax of 448 * 2^k gets 2^k itself, not 2^(k+1)
    exact = torch.full((1, 128), 448.0 * 2 ** -5)
    assert fp8.quantize_along_k(exact, pow2_scales=True).scale.item() == 2 ** -5
    # with power-of-two scales the quantized values are the values' own e4m3 rounding, rescaled exactly
    assert torch.equal(q.dequantize(), (v.float() / q.expanded_scale()).to(fp8.E4M3).float() * q.expanded_scale())


@pytest.mark.parametrize("pow2", [False, True])
def test_transposed_weight_copy_is_the_quantized_transpose(pow2):
    """128x128 blocks transpose exactly: the transposed copy equals quantizing the transposed weight, bit for
    bit, tail tiles included."""
    w = torch.stack([_spread((200, 330), seed=s) for s in (3, 4, 5)])  # [El, N, K]
    q = fp8.quantize_weight(w, pow2)
    qt = fp8.quantize_weight(w.transpose(1, 2), pow2)
    assert torch.equal(_bits(q.t().data), _bits(qt.data)) and torch.equal(q.t().scale, qt.scale)
    assert torch.equal(q.t().dequantize(), q.dequantize().transpose(1, 2))
    cache = fp8.Fp8WeightCache()
    cached = cache.get(w, pow2)
    assert cached._transposed is None  # made on first use: a forward holds one FP8 copy of the weight
    assert torch.equal(_bits(cached.transposed.data), _bits(qt.data)) and torch.equal(cached.transposed.scale, qt.scale)
    assert cache.get(w, pow2).transposed is cached.transposed  # kept with the entry
    assert torch.equal(_bits(cached.weight[1].data), _bits(q.data[1]))


def test_weight_cache_is_invalidated_by_an_in_place_update():
    cache = fp8.Fp8WeightCache()
    w = _spread((256, 128), seed=6).unsqueeze(0).clone()
    a = cache.get(w)
    assert cache.get(w) is a and (cache.hits, cache.misses) == (1, 1)
    w.add_(1)  # bumps w._version
    b = cache.get(w)
    assert b is not a and cache.misses == 2
    fresh = fp8.quantize_weight(w)
    assert torch.equal(_bits(b.weight.data), _bits(fresh.data)) and torch.equal(b.weight.scale, fresh.scale)
    assert not torch.equal(_bits(a.weight.data), _bits(fresh.data))
    assert cache.get(w, pow2_scales=True) is not b  # the scale option is part of the key
    # an optimizer step updates the parameter in place, and so invalidates too
    p = torch.nn.Parameter(_spread((128, 256), seed=7).unsqueeze(0).clone())
    c = cache.get(p)
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=0.5).step()
    assert cache.get(p) is not c
    # the entry of a freed weight goes
    n = len(cache)
    del p, c
    gc.collect()
    assert len(cache) == n - 1


def test_the_reference_quantizes_each_weight_once_per_version():
    x, idx, w, w13, w2, dy = make_problem(40, 256, 128, 4, 2, seed=8)
    cache = fp8.Fp8WeightCache()
    p13, p2 = (torch.nn.Parameter(t.clone()) for t in (w13, w2))
    for step in range(2):
        y = mega_moe_reference(x, idx, w, p13, p2, precision="fp8", block_m=16, weight_cache=cache)
        y.backward(dy)
        assert cache.misses == 2 * (step + 1)  # the backward reuses the forward's copies and transposes
        with torch.no_grad():
            p13.sub_(0.1 * p13.grad)
            p2.sub_(0.1 * p2.grad)


def test_fp8_gemm_equals_float64_gemm_of_dequantized_operands():
    """With exact partial sums G1-G3 lose nothing but fp32 rounding: the result is the float64 product of the
    dequantized operands to fp32 precision, with nested K blocks (1x64 against 128x128) and a K tail; with the
    tensor core's sums (cut to 14 bits below each step's largest term, 13 mantissa bits) to about 2^-13."""
    g = torch.Generator().manual_seed(9)
    a = torch.randn(70, 333, generator=g) * 3
    b = torch.randn(150, 333, generator=g)
    for block, pow2 in ((128, False), (64, False), (128, True), (64, True)):
        qa = fp8.quantize_along_k(a, block, pow2)
        qb = fp8.quantize_weight(b, pow2)
        ref = qa.dequantize().double() @ qb.dequantize().double().t()
        with fp8.exact_partial_sums():
            got = fp8.fp8_gemm_nt(qa, qb)
        assert got.dtype == torch.float32
        assert rel_err(got, ref) < 1e-6
        tc = fp8.fp8_gemm_nt(qa, qb)
        assert 1e-6 < rel_err(tc, ref) < 2e-4, rel_err(tc, ref)
    with pytest.raises(ValueError):
        fp8.fp8_gemm_nt(fp8.quantize_blocks(a, 1, 96), fp8.quantize_weight(b))


# ---------------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------------

def _problem(case, seed_base=200):
    return case_problem(case, 256, 128, 6, 3, seed_base)  # H, I, E, K


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("clamp", [None, 0.75])
def test_fp8_reference_vs_float64_formula(case, precision, clamp):
    x, idx, w, w13, w2, dy = _problem(case)
    got = run_fp8(x, idx, w, w13, w2, dy, precision=precision, activation_clamp=clamp, block_m=16)
    ref = loop_reference(x, idx, w, w13, w2, dy, clamp=clamp)
    for name, a, b in zip(OUTPUTS, got, ref):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        err = rel_err(a, b)
        masks_move = precision == "fp8" and clamp is not None and name in ("dx", "dw13")
        tol = TOL_FORMULA_CLAMP_MASKS if masks_move else TOL_FORMULA
        assert err < tol, f"{case} {precision} clamp={clamp} {name}: rel err {err:.3e}"
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert (got[2][idx < 0] == 0).all()  # masked routes: no topk-weight gradient
    used = ROUTING_CASES[case].get("experts_used")
    if used:
        assert (got[3][used:] == 0).all() and (got[4][used:] == 0).all()


@pytest.mark.parametrize("case", ["skewed", "masked_some", "T_odd", "empty_experts"])
@pytest.mark.parametrize("variant", [
    dict(precision="fp8"),
    dict(precision="fp8_bwd"),
    dict(precision="fp8", clamp=0.75),
    dict(precision="fp8", pow2=True),
    dict(precision="fp8", l2_block=64),
    dict(precision="fp8_bwd", pow2=True, clamp=0.5),
])
def test_fp8_reference_follows_the_recipe(case, variant):
    errs = recipe_errors(_problem(case, seed_base=300), **variant)
    for name, err in errs.items():
        assert err < TOL_RECIPE, f"{case} {variant} {name}: {err:.3e} from the recipe"


@pytest.mark.parametrize("H,I,block_m,last_variant", [
    (200, 96, 8, dict(l2_block=64)),  # sizes only the reference takes: narrower last blocks of any width
    # the kernels' sizes, H or I = 64 (mod 128): the last block along each is 64 wide, and dh is blocked per half
    # (B7 then promotes every 64 of 2I)
    (192, 320, 128, dict(l2_block=64, precision="fp8_bwd", clamp=1.0)),
    (320, 64, 128, dict(l2_block=64, precision="fp8_bwd", clamp=1.0)),
    (256, 192, 128, dict(l2_block=64, precision="fp8_bwd", clamp=1.0)),
])
def test_recipe_with_tail_blocks(H, I, block_m, last_variant):
    """H and I not multiples of 128: every quantization has a narrower last block; within TOL_RECIPE of the
    independent emulation and TOL_FORMULA of the formula."""
    problem = make_problem(75, H, I, 4, 2, routing="skewed", seed=400 if H == 200 else 410 + H + I)
    for variant in (dict(), dict(pow2=True), last_variant):
        for name, err in recipe_errors(problem, **variant).items():
            assert err < TOL_RECIPE, f"{variant} {name}: {err:.3e}"
    x, idx, w, w13, w2, dy = problem
    got = run_fp8(x, idx, w, w13, w2, dy, precision="fp8", block_m=block_m)
    for name, a, b in zip(OUTPUTS, got, loop_reference(x, idx, w, w13, w2, dy)):
        assert rel_err(a, b) < TOL_FORMULA, name


def test_a_64_wide_last_block_is_scaled_by_its_own_64_values():
    """quantize_along_k with 64 columns past the last multiple of 128: that block's scale is the amax of its 64
    values / 448, its largest value lands on 448, and the values round-trip (dequantize, quantize again: same bits)."""
    g = torch.Generator().manual_seed(9)
    v = torch.randn(5, 320, generator=g).bfloat16()
    v[:, 250] = 1000.0  # large, in block 1: must not raise the tail block's scale
    q = fp8.quantize_along_k(v, 128)
    assert q.scale.shape == (5, 3) and q.data.shape == (5, 320)
    tail = v[:, 256:].float()
    assert torch.equal(q.scale[:, 2], tail.abs().amax(1) / 448)
    assert bool((q.data[:, 256:].float().abs().amax(1) == 448).all())
    again = fp8.quantize_along_k(q.dequantize(), 128)
    assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))
    w0 = torch.randn(2, 320, 192, generator=g)
    w = fp8.quantize_weight(w0)  # 128 x 128 tiles, 64-wide tails both ways
    assert w.scale.shape == (2, 3, 2)
    wt = fp8.quantize_weight(w0.transpose(1, 2).contiguous())  # the transposed copy is qW of the transpose
    assert torch.equal(w.t().data.view(torch.uint8), wt.data.view(torch.uint8)) and torch.equal(w.t().scale, wt.scale)


def test_dh_halves_are_blocked_from_their_own_first_columns():
    """quantize_halves_along_k: I a multiple of 128 is the grid along 2I; I = 320 blocks dg and du apart, with a
    64-wide last block each, scales given per 64 columns (block_cols 64), each block's in both of its slots."""
    g = torch.Generator().manual_seed(10)
    v = torch.randn(7, 512, generator=g).bfloat16().float()
    a, b = fp8.quantize_halves_along_k(v), fp8.quantize_along_k(v, 128)
    assert a.block_cols == 128 and torch.equal(a.scale, b.scale) and torch.equal(a.data.view(torch.uint8),
                                                                                    b.data.view(torch.uint8))
    v = torch.randn(7, 640, generator=g).bfloat16().float()
    h = fp8.quantize_halves_along_k(v)
    assert h.block_cols == 64 and h.scale.shape == (7, 10)
    for half, cols in ((0, slice(0, 320)), (1, slice(320, 640))):
        own = fp8.quantize_along_k(v[:, cols], 128)
        assert torch.equal(h.data[:, cols].view(torch.uint8), own.data.view(torch.uint8))
        assert torch.equal(h.scale[:, 5 * half:5 * half + 5], own.scale.repeat_interleave(2, 1)[:, :5])
    assert torch.equal(h.expanded_scale(), torch.cat([fp8.quantize_along_k(v[:, :320], 128).expanded_scale(),
                                                       fp8.quantize_along_k(v[:, 320:], 128).expanded_scale()], 1))


@pytest.mark.parametrize("mutation", ["scale_max", "pow2_floor", "no_promotion_scale"])
def test_a_changed_recipe_fails_the_recipe_check(monkeypatch, mutation):
    """The recipe check can fail: with the scale rule or the GEMM's scaling altered, the reference drifts from
    the emulation by far more than TOL_RECIPE."""
    problem = _problem("skewed", seed_base=300)
    pow2 = mutation == "pow2_floor"
    if mutation == "scale_max":
        monkeypatch.setattr(fp8, "E4M3_MAX", 240.0)  # e4m3 values kept below 240: a different grid
    elif mutation == "pow2_floor":
        def floor_pow2(amax, pow2_scales=False):
            s = amax.float() / 448.0
            _, e = torch.frexp(s)
            return torch.where(s > 0, torch.ldexp(torch.ones_like(s), e - 1), torch.ones_like(s))
        monkeypatch.setattr(fp8, "scales_from_amax", floor_pow2)  # saturates the largest values
    else:
        real = fp8.fp8_gemm_nt

        def first_block_scales_only(a, b):  # scales of K block 0 for every slice
            a0 = fp8.BlockQuantized(a.data, a.scale[:, :1].expand_as(a.scale).contiguous(), a.block_rows, a.block_cols)
            return real(a0, b)
        monkeypatch.setattr(fp8, "fp8_gemm_nt", first_block_scales_only)
    errs = recipe_errors(problem, precision="fp8", pow2=pow2)
    assert max(errs.values()) > 10 * TOL_RECIPE, errs


def test_fp8_bwd_forward_is_the_bf16_forward_bitwise():
    x, idx, w, w13, w2, dy = _problem("masked_some")
    for clamp in (None, 0.75):
        kw = dict(activation_clamp=clamp, num_experts=6, block_m=16, capacity=300)
        a = reference.forward(x, idx, w, w13, w2, **kw)
        b = reference.forward(x, idx, w, w13, w2, precision="fp8_bwd", **kw)
        for u, v in zip(a, b):
            assert torch.equal(u, v)
        y_layer = run_layer(x, idx, w, w13, w2, dy, backend="reference", activation_clamp=clamp, block_m=16)[0]
        y_fp8_bwd = run_fp8(x, idx, w, w13, w2, dy, precision="fp8_bwd", activation_clamp=clamp, block_m=16)[0]
        assert torch.equal(y_layer, y_fp8_bwd)


def test_bf16_through_the_autograd_node_equals_mega_moe_reference():
    x, idx, w, w13, w2, dy = _problem("skewed")
    a = run_layer(x, idx, w, w13, w2, dy, backend="reference", activation_clamp=0.75, block_m=16)
    b = run_fp8(x, idx, w, w13, w2, dy, precision="bf16", activation_clamp=0.75, block_m=16)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_block_m_and_recompute_do_not_change_fp8_results(precision):
    """The token-axis blocks start at each expert's first row, whatever the pool's padding; recompute gives the
    saved h exactly."""
    x, idx, w, w13, w2, dy = _problem("T_odd")
    base = run_fp8(x, idx, w, w13, w2, dy, precision=precision, activation_clamp=0.5, block_m=128)
    for kw in (dict(block_m=1), dict(block_m=16), dict(block_m=128, recompute=True)):
        other = run_fp8(x, idx, w, w13, w2, dy, precision=precision, activation_clamp=0.5, **kw)
        for name, u, v in zip(OUTPUTS, base, other):
            assert torch.equal(u, v), (kw, name)


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_empty_inputs(precision):
    x, idx, w, w13, w2, dy = make_problem(8, 256, 128, 4, 2, seed=10)
    y, dx, dtopk, dw13, dw2 = run_fp8(x[:0], idx[:0], w[:0], w13, w2, dy[:0], precision=precision)
    assert y.shape == (0, 256) and dx.shape == (0, 256) and dtopk.shape == (0, 2)
    assert (dw13 == 0).all() and (dw2 == 0).all()
    x, idx, w, w13, w2, dy = make_problem(20, 256, 128, 4, 2, routing="all_masked", seed=11)
    for t in run_fp8(x, idx, w, w13, w2, dy, precision=precision):
        assert (t == 0).all()


def test_fp8_needs_bf16_tokens_and_known_precisions():
    x, idx, w, w13, w2, dy = make_problem(4, 8, 4, 2, 1, seed=12, dtype=torch.float64)
    with pytest.raises(ValueError, match="bf16 tokens"):
        mega_moe_reference(x, idx, w, w13, w2, precision="fp8")
    with pytest.raises(ValueError, match="precision"):
        mega_moe_reference(x.bfloat16(), idx, w.float(), w13.bfloat16(), w2.bfloat16(), precision="mxfp8")
    with pytest.raises(ValueError):
        fp8.Fp8Recipe(l2_act_block=32)


def test_topk_weights_stay_fp32_at_the_combine():
    """F5 takes the weights in fp32: y is bf16(sum_k w[t, k] * o_{t,k}) in increasing k, the slots o read back
    through one-hot weights (y is then one slot, exactly). The same sum with bf16-rounded weights gives other
    bits, so the check sees a rounding of the weights."""
    x, idx, w, w13, w2, _ = _problem("skewed")
    T, K = idx.shape
    kw = dict(precision="fp8", block_m=16, weight_cache=fp8.Fp8WeightCache())
    with torch.no_grad():
        y = mega_moe_reference(x, idx, w, w13, w2, **kw)
        slots = [mega_moe_reference(x, idx, F.one_hot(torch.full((T,), k), K).float(), w13, w2, **kw)
                 for k in range(K)]

    def combine(weights):
        acc = torch.zeros(y.shape)
        for k in range(K):
            acc += weights[:, k:k + 1] * slots[k].float()
        return acc.bfloat16()

    assert torch.equal(y, combine(w))
    assert not torch.equal(y, combine(w.bfloat16().float()))


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_the_layer_api_with_backend_reference_runs_the_recipe(precision):
    """mega_moe and MegaMoE (custom ops, autograd) with backend="reference" give mega_moe_reference's results bit
    for bit; T = 0 runs."""
    x, idx, w, w13, w2, dy = _problem("masked_some")
    a = run_layer(x, idx, w, w13, w2, dy, backend="reference", precision=precision, activation_clamp=0.75,
                  block_m=16)
    b = run_fp8(x, idx, w, w13, w2, dy, precision=precision, activation_clamp=0.75, block_m=16)
    for name, u, v in zip(OUTPUTS, a, b):
        assert torch.equal(u, v), name
    layer = MegaMoE(6, 256, 128, 3, precision=precision, activation_clamp=0.75, backend="reference", block_m=16)
    with torch.no_grad():
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
        assert torch.equal(layer(x, idx, w), a[0])
    assert mega_moe(x[:0], idx[:0], w[:0], w13, w2, precision=precision, backend="reference").shape == (0, 256)


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_weight_gradients_add_into_fp32_accumulators(precision):
    """wgrad_accum: the recipe's fp32 dW13 and dW2 are added into the caller's buffers. From zero, their bf16
    rounding is what autograd returns without buffers; from other values, the sum is exactly buffer + that fp32
    gradient; y and dX are unchanged."""
    x, idx, w, w13, w2, dy = _problem("skewed")
    ref = run_layer(x, idx, w, w13, w2, dy, backend="reference", precision=precision, block_m=16)

    def run(a13, a2):
        xs = x.clone().requires_grad_()
        y = mega_moe(xs, idx, w, w13, w2, precision=precision, backend="reference", block_m=16,
                     wgrad_accum=(a13, a2))
        y.backward(dy)
        return y.detach(), xs.grad

    z13, z2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
    y, dx = run(z13, z2)
    assert torch.equal(y, ref[0]) and torch.equal(dx, ref[1])
    assert torch.equal(z13.bfloat16(), ref[3]) and torch.equal(z2.bfloat16(), ref[4])
    g = torch.Generator().manual_seed(13)
    p13, p2 = torch.randn(w13.shape, generator=g), torch.randn(w2.shape, generator=g)
    a13, a2 = p13.clone(), p2.clone()
    run(a13, a2)
    assert torch.equal(a13, p13 + z13) and torch.equal(a2, p2 + z2)


def _tensor_core_model(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The tensor core's e4m3 sum written out in float64, one output at a time (prime_kernels.mega.fp8's comment
    says what was measured): per 32 products, the products (exponent = the sum of the operands' frexp exponents - 1)
    and the running sum (its frexp exponent) cut toward zero 14 bits below the largest exponent among the nonzero
    ones, summed exactly, the sum cut toward zero to 13 mantissa bits."""
    A, B = a.double(), b.double()
    out = torch.zeros(A.shape[0], B.shape[0], dtype=torch.float32)
    for m in range(A.shape[0]):
        for n in range(B.shape[0]):
            acc = 0.0
            for k0 in range(0, A.shape[1], 32):
                terms = [(float(A[m, k] * B[n, k]), math.frexp(float(A[m, k]))[1] + math.frexp(float(B[n, k]))[1] - 1)
                         for k in range(k0, min(k0 + 32, A.shape[1]))]
                exps = [e for v, e in terms if v != 0.0] + ([math.frexp(acc)[1]] if acc != 0.0 else [])
                if not exps:
                    continue
                unit = math.ldexp(1.0, max(exps) - 14)
                total = sum(math.trunc(v / unit) for v, _ in terms) + math.trunc(acc / unit)
                mant, e = math.frexp(total * unit)
                acc = math.ldexp(math.trunc(mant * 2 ** 14) / 2 ** 14, e)
            out[m, n] = acc
    return out


@pytest.mark.parametrize("kind", ["normal", "wide", "cancel", "zeros", "tail"])
def test_tensor_core_partial_is_the_written_out_model(kind):
    """fp8.tensor_core_partial (vectorised, fp32) equals the model evaluated term by term in float64, bit for bit,
    for operands of one exponent range, of thirteen binades, cancelling halves, zero steps and a K of 80 (a last
    step of 16 products). The model itself was measured against an H100's k_grouped_fp8_gemm_tn partials (the GPU
    test in test_grouped_gemm_fp8_k.py keeps it so)."""
    g = torch.Generator().manual_seed(21)
    K = 80 if kind == "tail" else 128
    a, b = torch.randn(6, K, generator=g), torch.randn(5, K, generator=g)
    if kind == "wide":
        a = a * torch.exp2(torch.randint(-6, 7, a.shape, generator=g).float())
        b = b * torch.exp2(torch.randint(-6, 7, b.shape, generator=g).float())
    elif kind == "cancel":
        b[:, 64:] = -b[:, :64]
        a[:, 64:] = a[:, :64] * 1.001
    elif kind == "zeros":
        a[:, :40] = 0
        b[2] = 0
    qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    got = fp8.tensor_core_partial(qa, qb)
    assert torch.equal(got, _tensor_core_model(qa, qb))
    exact = (qa.double() @ qb.double().t()).float()
    if kind != "zeros":
        assert not torch.equal(got, exact)  # the cut is there: the exact sum is another model
