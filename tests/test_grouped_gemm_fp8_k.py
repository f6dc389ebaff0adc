"""The sm90 blockwise-FP8 k-grouped GEMM (k_grouped_fp8_gemm_tn, the weight gradients) against a float64 evaluation
of the same quantized operands and against the recipe's own emulation (prime_kernels.mega.fp8), plus its argument
checks: the CPU op's and the CUDA op's (the C++ launcher's run in test_grouped_gemm_fp8.py, whose host-compiled
check covers both FP8 GEMMs).

The operands are built as the recipe's producers are to write them (docs/fp8.md): each expert's token rows padded to
a multiple of 128 in the pool with zero rows (the routing plan's layout), qT-quantized per expert (one fp32 scale per
column and 128 rows of the token axis, quantize_along_tokens) and stored transposed, token axis contiguous.

Accuracy bound (GPU tests): the kernel and the float64 evaluation see the same e4m3 values and fp32 scales, so they
differ by (1) the tensor core's accumulation of one 128-row block's e4m3 products with fewer mantissa bits than fp32
(a few 1e-4 relative, the reason for the per-block promotion), (2) the fp32 sums of the promoted blocks (~1e-7 per
add) and, for a bf16 output, (3) its rounding (<= 2^-9 per element, ~1.1e-3 in the norm). 2e-3 (fp32 out) and 4e-3
(bf16 out) in the norm cover them with room; a wrong scale row or column, a block scaled twice or a missed block
gives errors of order 1e-1 and above.
"""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from prime_kernels.grouped_gemm import k_block_major_scales, k_grouped_fp8_gemm_reference
from prime_kernels.mega import fp8 as recipe
# the m-grouped FP8 tests' helpers; their host-compiled launcher check (tests/cpp/fp8_gemm_args_check.cpp) covers this
# kernel's argument checks too
from test_grouped_gemm_fp8 import poison_next_alloc, rel_err
BOUND_F32 = 2e-3
BOUND_BF16 = 4e-3
SPECIAL = [0, 1, 7, 127, 128, 129, 255, 300]


def group_sizes(E: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "uniform":
        return [int(v) for v in torch.randint(100, 300, (E,), generator=gen)]
    if kind == "special":  # empty experts, one row, odd counts, a 128-row block boundary on each side
        rand = torch.randint(0, 300, (E,), generator=gen).tolist()
        return [SPECIAL[i] if i < len(SPECIAL) else rand[i] for i in range(E)]
    if kind == "skewed":  # Zipf-like: a few large experts, many tiny or empty
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.1
        pop = pop[torch.randperm(E, generator=gen)]
        return torch.round(pop / pop.sum() * 150 * E).long().tolist()
    if kind == "empty":
        return [0] * E
    raise ValueError(kind)


def pool_offsets(sizes: list[int]) -> list[int]:
    """The routing plan's pool: each expert's rows start at a multiple of 128 (its range padded with zero rows)."""
    offs = [0]
    for c in sizes:
        offs.append(offs[-1] + (c + 127) // 128 * 128)
    return offs


def quantize_pool(v: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """v [P, C] fp32 pool rows (zeros in the padding) -> the kernel's operand: e4m3 [C, P] token axis contiguous and
    fp32 scales [C, ceil(P / 128)], quantized per expert as the recipe's qT (block grid from each expert's first row)."""
    P, C = v.shape
    offs = pool_offsets(sizes)
    data = torch.zeros(C, P, dtype=torch.float8_e4m3fn)
    scale = torch.ones(C, (P + 127) // 128)
    for e in range(len(sizes)):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            q = recipe.quantize_along_tokens(v[lo:hi]).t()  # data [C, rows], scale [C, rows / 128]
            data[:, lo:hi] = q.data
            scale[:, lo // 128:hi // 128] = q.scale
    return data, scale


def make_inputs(sizes: list[int], M: int, N: int, seed: int):
    """dW[e] = dy_e^T x_e style operands for the weight shape [M, N]: a [M, P], sa [M, P/128], b [N, P], sb."""
    gen = torch.Generator().manual_seed(seed)
    offs = pool_offsets(sizes)
    P = offs[-1]
    dy = torch.zeros(P, M)
    x = torch.zeros(P, N)
    for e, c in enumerate(sizes):
        rows = slice(offs[e], offs[e] + c)
        dy[rows] = torch.randn(c, M, generator=gen) * torch.exp(torch.randn(c, 1, generator=gen))
        x[rows] = torch.randn(c, N, generator=gen)
    a, sa = quantize_pool(dy, sizes)
    b, sb = quantize_pool(x, sizes)
    return P, torch.tensor(offs, dtype=torch.int32), a, sa, b, sb


# --------------------------------------------------------------------------------------------- CPU


def test_cpu_op_is_the_recipe_bit_for_bit():
    """The CPU op (G1-G3 in the kernel's order) equals the recipe's emulated weight-gradient GEMM of the reference
    backend, fp8.fp8_gemm_nt(qT(dy_e)^T, qT(x_e)^T), expert by expert, bit for bit; and an expert with no rows is 0."""
    sizes = [5, 0, 130, 1, 256]
    P, offs, a, sa, b, sb = make_inputs(sizes, 136, 64, seed=1)
    out = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs)
    assert out.dtype == torch.float32 and out.shape == (5, 136, 64)
    o = offs.tolist()
    for e in range(len(sizes)):
        lo, hi = o[e], o[e + 1]
        if hi == lo:
            assert torch.equal(out[e], torch.zeros(136, 64))
            continue
        qa = recipe.BlockQuantized(a[:, lo:hi], sa[:, lo // 128:hi // 128], 1, 128)
        qb = recipe.BlockQuantized(b[:, lo:hi], sb[:, lo // 128:hi // 128], 1, 128)
        assert torch.equal(out[e], recipe.fp8_gemm_nt(qa, qb)), f"expert {e}"


def test_cpu_emulation_is_within_the_bound_of_float64():
    sizes = [77, 0, 300, 1]
    P, offs, a, sa, b, sb = make_inputs(sizes, 256, 128, seed=2)
    ref = k_grouped_fp8_gemm_reference(a, sa, b, sb, offs, torch.float64)
    out = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs)
    assert rel_err(out, ref) < BOUND_F32
    out16 = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, out_dtype=torch.bfloat16)
    assert out16.dtype == torch.bfloat16 and rel_err(out16, ref) < BOUND_BF16


def test_cpu_accumulate_adds_and_leaves_empty_experts_unchanged():
    sizes = [40, 0, 200]
    P, offs, a, sa, b, sb = make_inputs(sizes, 64, 64, seed=3)
    base = torch.randn(3, 64, 64)
    acc = base.clone()
    ret = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, accumulate_into=acc)
    assert ret is acc
    assert torch.equal(acc[1], base[1])
    assert torch.equal(acc, base + k_grouped_fp8_gemm_reference(a, sa, b, sb, offs))


def test_no_token_rows():
    """P = 0: zeros (store) or the accumulator unchanged, as the BF16 op."""
    a = torch.zeros(64, 0, dtype=torch.float8_e4m3fn)
    b = torch.zeros(72, 0, dtype=torch.float8_e4m3fn)
    sa, sb = torch.ones(64, 0), torch.ones(72, 0)
    offs = torch.zeros(3, dtype=torch.int32)
    out = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs)
    assert torch.equal(out, torch.zeros(2, 64, 72))
    acc = torch.randn(2, 64, 72)
    keep = acc.clone()
    prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, accumulate_into=acc)
    assert torch.equal(acc, keep)


def test_last_expert_may_end_at_a_ragged_pool_end():
    """Offsets are multiples of 128 or P: the last expert may end at a P that is not one (its last block is narrower)."""
    sizes = [128, 72]
    P, offs, a, sa, b, sb = make_inputs(sizes, 64, 64, seed=4)
    a, b = a[:, :200].contiguous(), b[:, :200].contiguous()
    offs = torch.tensor([0, 128, 200], dtype=torch.int32)
    out = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs)
    assert rel_err(out, k_grouped_fp8_gemm_reference(a, sa, b, sb, offs, torch.float64)) < BOUND_F32


def test_cpu_op_passes_opcheck():
    sizes = [3, 0, 130]
    P, offs, a, sa, b, sb = make_inputs(sizes, 64, 72, seed=5)
    # test_schema is left out: its mutation check does arithmetic on every input, which torch has no CPU kernel for on
    # float8_e4m3fn (m_grouped_fp8_gemm_nt's test does the same).
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.prime_kernels.k_grouped_fp8_gemm_tn.default, (a, sa, b, sb, offs, True, 0),
                          test_utils=utils)
    acc = torch.zeros(3, 64, 72)
    torch.library.opcheck(torch.ops.prime_kernels.k_grouped_fp8_gemm_tn_accumulate_.default,
                          (a, sa, b, sb, offs, acc, 0), test_utils=("test_faketensor",))


def _bad_calls():
    sizes = [40, 100]
    P, offs, a, sa, b, sb = make_inputs(sizes, 64, 64, seed=6)
    return {
        "a not e4m3": ((a.float(), sa, b, sb, offs), "float8_e4m3fn"),
        "b not e4m3": ((a, sa, b.to(torch.float8_e5m2), sb, offs), "float8_e4m3fn"),
        "sb not fp32": ((a, sa, b, sb.double(), offs), "float32"),
        "offsets not int32": ((a, sa, b, sb, offs.long()), "int32"),
        "token counts differ": ((a, sa, b[:, :128].contiguous(), sb, offs), "same token count"),
        "m not a multiple of 8": ((a[:60], sa[:60], b, sb, offs), "multiples of 8"),
        "sa shape": ((a, sa[:, :1], b, sb, offs), r"sa must be \[M, ceil\(P / 128\)\]"),
        "sb shape": ((a, sa, b, sb[:32], offs), r"sb must be \[N, ceil\(P / 128\)\]"),
        "offsets past rows": ((a, sa, b, sb, torch.tensor([0, 128, P + 128], dtype=torch.int32)), "non-decreasing"),
        "offsets decreasing": ((a, sa, b, sb, torch.tensor([0, 128, 0], dtype=torch.int32)), "non-decreasing"),
        "offset not on a token block": ((a, sa, b, sb, torch.tensor([0, 40, P], dtype=torch.int32)), "multiples of 128"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_cpu_op_rejects_bad_arguments(case):
    args, match = _bad_calls()[case]
    with pytest.raises((RuntimeError, TypeError), match=match):
        prime_kernels.k_grouped_fp8_gemm_tn(*args)


def test_bad_output_arguments():
    sizes = [40]
    P, offs, a, sa, b, sb = make_inputs(sizes, 64, 64, seed=7)
    with pytest.raises(TypeError, match="out_dtype"):
        prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, out_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, accumulate_into=torch.zeros(1, 64, 64).bfloat16())
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_sms"):
            prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, num_sms=bad)


def test_status_lists_the_fp8_k_gemm():
    from prime_kernels import _status

    st = prime_kernels.status()
    key = "k_grouped_gemm_tn.fp8.sm90"
    assert isinstance(st[key], str) and st[key]
    assert key not in _status.unverified()  # its GPU tests have passed on an H200
    if not torch.cuda.is_available():
        assert st[key] == "no CUDA device"


# --------------------------------------------------------------------------------------------- GPU

# (E, kind, M, N): the weight-gradient shapes of the Qwen3 layers at small token counts (30B: H=2048, I=768; 235B:
# H=4096, I=1536): dW13 [2I, H] = dh^T x and dW2 [H, I] = dy^T (w * s), plus a small ragged-N case and many experts.
CASES = [(8, "uniform", 1536, 2048), (8, "skewed", 2048, 768), (8, "special", 1536, 2048), (8, "special", 2048, 768),
         (4, "uniform", 3072, 4096), (4, "special", 4096, 1536), (1, "uniform", 136, 72), (128, "skewed", 256, 264),
         (4, "empty", 256, 128)]


def _cuda(*ts):
    return [t.cuda() for t in ts]


@requires_sm90
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,kind,M,N", CASES)
def test_fp8_k_gemm_matches_float64(E, kind, M, N, out_dtype):
    gen = torch.Generator().manual_seed(E * 100 + M + N)
    sizes = group_sizes(E, kind, gen)
    P, offs, a, sa, b, sb = make_inputs(sizes, M, N, seed=E * 7 + M + N + len(kind))
    # scales made K-block major here, so that the op allocates nothing before its output (which takes the NaN block)
    ac, bc, oc = _cuda(a, b, offs)
    sac, sbc = k_block_major_scales(sa.cuda()), k_block_major_scales(sb.cuda())
    poison_next_alloc(E * M * N, out_dtype)
    out = prime_kernels.k_grouped_fp8_gemm_tn(ac, sac, bc, sbc, oc, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert out.shape == (E, M, N) and out.dtype == out_dtype
    assert not torch.isnan(out).any(), "elements left unwritten"
    ref = k_grouped_fp8_gemm_reference(a, sa, b, sb, offs, torch.float64)
    if P == 0 or ref.norm() == 0:
        assert torch.equal(out.cpu().double(), ref)
        return
    err = rel_err(out.cpu(), ref)
    assert err <= (BOUND_F32 if out_dtype == torch.float32 else BOUND_BF16), f"rel err {err:.3e}"
    # the emulation (G1 as the tensor core sums, G2, G3), on the GPU for speed, gives the kernel's bits
    emu = k_grouped_fp8_gemm_reference(ac, sa.cuda(), bc, sb.cuda(), oc).to(out_dtype)
    differ = int((emu.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)
                  != out.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)).sum())
    assert differ == 0, f"{differ} of {out.numel()} values differ from the emulation's bits"
    for e, c in enumerate(sizes):
        if c == 0:
            assert torch.equal(out[e].cpu(), torch.zeros(M, N, dtype=out_dtype)), f"empty expert {e} not zero"
    again = prime_kernels.k_grouped_fp8_gemm_tn(ac, sac, bc, sbc, oc, out_dtype=out_dtype)
    assert torch.equal(out, again), "not deterministic"
    capped = prime_kernels.k_grouped_fp8_gemm_tn(ac, sac, bc, sbc, oc, out_dtype=out_dtype, num_sms=7)
    assert torch.equal(out, capped), "num_sms=7 differs from every SM"


@requires_sm90
@pytest.mark.parametrize("E,kind,M,N", [(8, "special", 2048, 768), (4, "skewed", 3072, 4096)])
def test_fp8_k_gemm_accumulates(E, kind, M, N):
    """Adds into the fp32 accumulator (the deferred weight gradients): base + the store op's result, bit for bit (the
    kernel adds its fp32 result to what C holds), and experts with no rows left exactly as they were."""
    sizes = group_sizes(E, kind, torch.Generator().manual_seed(9))
    P, offs, a, sa, b, sb = make_inputs(sizes, M, N, seed=10)
    ac, bc, oc, sac, sbc = _cuda(a, b, offs, sa, sb)
    base = torch.randn(E, M, N, device="cuda")
    acc = base.clone()
    prime_kernels.k_grouped_fp8_gemm_tn(ac, sac, bc, sbc, oc, accumulate_into=acc)
    fresh = prime_kernels.k_grouped_fp8_gemm_tn(ac, sac, bc, sbc, oc)
    assert torch.equal(acc, base + fresh)
    for e, c in enumerate(sizes):
        if c == 0:
            assert torch.equal(acc[e], base[e])


@requires_sm90
def test_fp8_k_gemm_no_token_rows():
    a = torch.zeros(64, 0, dtype=torch.float8_e4m3fn, device="cuda")
    b = torch.zeros(72, 0, dtype=torch.float8_e4m3fn, device="cuda")
    sa, sb = torch.ones(64, 0, device="cuda"), torch.ones(72, 0, device="cuda")
    offs = torch.zeros(3, dtype=torch.int32, device="cuda")
    poison_next_alloc(2 * 64 * 72, torch.float32)
    out = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))
    acc = torch.randn(2, 64, 72, device="cuda")
    keep = acc.clone()
    prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, accumulate_into=acc)
    assert torch.equal(acc, keep)


@requires_sm90
def test_fp8_k_gemm_bad_group_offsets_write_nothing_and_are_reported():
    sizes = [100, 0, 300, 57]
    P, offs, a, sa, b, sb = make_inputs(sizes, 256, 256, seed=11)
    good = offs.tolist()
    a, b, sa, sb = a.cuda(), b.cuda(), k_block_major_scales(sa.cuda()), k_block_major_scales(sb.cuda())
    for bad in ([0, good[3], good[1]] + good[3:], good[:-1] + [P + 128], [-128] + good[1:], [0, 100] + good[2:]):
        o = torch.tensor(bad, dtype=torch.int32, device="cuda")
        poison_next_alloc(4 * 256 * 256, torch.float32)
        out = prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, o)
        torch.cuda.synchronize()
        assert out.isnan().all(), f"bad offsets {bad} wrote something"
        with pytest.raises(RuntimeError, match="FP8 k-grouped GEMM's group_offsets are not non-decreasing"):
            prime_kernels.check_device_errors()
        prime_kernels.check_device_errors()  # reported once, then cleared


@requires_sm90
def test_fp8_k_gemm_bad_cuda_inputs_raise_before_launch():
    sizes = [40, 24]
    P, offs, a, sa, b, sb = make_inputs(sizes, 64, 64, seed=12)
    a, sa, b, sb, offs = _cuda(a, sa, b, sb, offs)
    op = torch.ops.prime_kernels.k_grouped_fp8_gemm_tn
    sak, sbk = k_block_major_scales(sa), k_block_major_scales(sb)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        op(a.float(), sak, b, sbk, offs)
    with pytest.raises(RuntimeError, match="K-block major"):
        op(a, sa.contiguous(), b, sbk, offs)  # row-major scales are what the Python wrapper converts, not the op
    with pytest.raises(RuntimeError, match="same token count"):
        op(a, sak, b[:, :128].contiguous(), sbk, offs)
    with pytest.raises(RuntimeError, match=r"sb must be \[N"):
        op(a, sak, b, sbk[:32], offs)
    with pytest.raises(RuntimeError, match="lda"):  # a row stride TMA cannot use
        op(torch.empty(64, P + 8, dtype=torch.float8_e4m3fn, device="cuda")[:, :P], sak, b, sbk, offs)
