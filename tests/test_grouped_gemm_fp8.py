"""The sm90 blockwise-FP8 m-grouped GEMM (m_grouped_fp8_gemm_nt) against a float64 evaluation of the same quantized
operands, plus its argument checks: the C++ launcher's (compiled with the host compiler alone), the CPU op's and the
CUDA op's.

Accuracy bound (GPU tests): the kernel and the float64 evaluation see the same e4m3 values and fp32 scales, so they
differ only by (1) the bf16 rounding of the output, at most 2^-9 ~ 1.95e-3 relative per element (about 1.1e-3 in
the norm for uniformly spread rounding errors), (2) the tensor core's accumulation of one 128-K block's e4m3
products with fewer mantissa bits than fp32 (the reason for the per-block promotion: with 14 kept bits and 128 terms
of mixed signs, a few 1e-4 relative), and (3) the fp32 sum of the promoted blocks (~1e-7 per add). 4e-3 in the
norm covers all three with room; an indexing or scaling bug (a wrong scale row, a block scaled twice, a missed
block) gives errors of order 1e-1 and above.
"""

from __future__ import annotations

import pytest
import torch

import prime_kernels
from conftest import requires_host_cxx, requires_sm90, run_host_check
from prime_kernels.grouped_gemm import k_block_major_scales, m_grouped_fp8_gemm_reference

E4M3_MAX = 448.0
BOUND = 4e-3
SPECIAL = [0, 1, 7, 127, 128, 129, 255, 1000]


def quantize_rows(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> e4m3 [M, K] and fp32 scales [M, ceil(K / block)] (one per row per block of K, the last one over the
    columns that exist): x ~ q * s."""
    m, k = x.shape
    kb = -(-k // block)
    pad = torch.zeros(m, kb * block, dtype=torch.float32)
    pad[:, :k] = x.float()
    blocks = pad.view(m, kb, block)
    s = (blocks.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)
    q = (blocks / s[..., None]).to(torch.float8_e4m3fn).view(m, kb * block)[:, :k].contiguous()
    return q, s


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> e4m3 [E, N, K] and fp32 scales [E, ceil(N / 128), ceil(K / 128)] (one per 128 x 128 block)."""
    e, n, k = w.shape
    nb, kb = (n + 127) // 128, (k + 127) // 128
    pad = torch.zeros(e, nb * 128, kb * 128, dtype=torch.float32)
    pad[:, :n, :k] = w.float()
    blocks = pad.view(e, nb, 128, kb, 128)
    s = (blocks.abs().amax(dim=(2, 4)) / E4M3_MAX).clamp_min(1e-12)
    q = (blocks / s[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, nb * 128, kb * 128)[:, :n, :k].contiguous()
    return q, s


def group_sizes(E: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "single_row":  # M_total = 1: one group of one row, the others empty
        return [1 if g == E // 2 else 0 for g in range(E)]
    if kind == "uniform":
        return [int(v) for v in torch.randint(40, 90, (E,), generator=gen)]
    if kind == "special":  # empty groups, one row, odd counts, an m-block boundary on each side
        rand = torch.randint(0, 300, (E,), generator=gen).tolist()
        return [SPECIAL[i] if i < len(SPECIAL) else rand[i] for i in range(E)]
    if kind == "skewed":  # Zipf-like: a few large groups, many tiny or empty
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.1
        pop = pop[torch.randperm(E, generator=gen)]
        return torch.round(pop / pop.sum() * 80 * E).long().tolist()
    raise ValueError(kind)


def offsets_of(sizes: list[int], device) -> torch.Tensor:
    offs = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32)
    return offs.to(device)


def make_inputs(E: int, sizes: list[int], N: int, K: int, seed: int, a_block: int = 128):
    """Fresh random operands, quantized by the recipe (CPU tensors); A in 1 x a_block blocks."""
    gen = torch.Generator().manual_seed(seed)
    M = sum(sizes)
    x = torch.randn(M, K, generator=gen) * torch.exp(torch.randn(M, 1, generator=gen))  # rows of different scale
    w = torch.randn(E, N, K, generator=gen) / K ** 0.5
    a, sa = quantize_rows(x, a_block)
    b, sb = quantize_blocks(w)
    return M, a, sa, b, sb


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_next_alloc(numel: int, dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of exactly this size in the caching allocator: the op's output of the same size on the
    same stream reuses it, so an unwritten element shows as NaN."""
    block = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del block


# --------------------------------------------------------------------------------------------- CPU


@requires_host_cxx
def test_launcher_argument_checks_on_the_host(tmp_path):
    """The launcher's checks (csrc/sm90/grouped_gemm_fp8.hpp) run before anything touches a device: compiled here
    without CUDA, every bad argument fails with a message that names it."""
    run_host_check("fp8_gemm_args_check", tmp_path, timeout=60)


def test_cpu_op_passes_opcheck():
    sizes = [3, 0, 9, 4]
    M, a, sa, b, sb = make_inputs(4, sizes, 136, 256, seed=0)
    # test_schema is left out: its mutation check does arithmetic on every input, which torch has no CPU kernel for
    # on float8_e4m3fn (the op's schema mutates nothing).
    torch.library.opcheck(torch.ops.prime_kernels.m_grouped_fp8_gemm_nt.default, (a, sa, b, sb, offsets_of(sizes, "cpu")),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("K", [384, 320])
def test_cpu_emulation_is_within_the_bound_of_float64(K):
    """The fp32 emulation (the kernel's order, bf16 out) against the float64 product of the dequantized operands;
    K = 320 ends on a 64-wide k-block."""
    sizes = [5, 0, 130, 1, 77]
    M, a, sa, b, sb = make_inputs(5, sizes, 264, K, seed=1)
    assert sa.shape == (M, -(-K // 128)) and sb.shape == (5, 3, -(-K // 128))
    offs = offsets_of(sizes, "cpu")
    out = prime_kernels.m_grouped_fp8_gemm_nt(a, sa, b, sb, offs)
    assert out.dtype == torch.bfloat16 and out.shape == (M, 264)
    ref = m_grouped_fp8_gemm_reference(a, sa, b, sb, offs, torch.float64)
    assert rel_err(out, ref) < BOUND


def test_cpu_emulation_with_a_quantized_1x64():
    """An A with one scale per 64 of K (the FP8 forward's L2 operand): the emulation promotes per 64, within the bound
    of the float64 product, and differs from treating the scales as 128-wide (which the shapes tell apart)."""
    sizes = [5, 0, 130, 77]
    M, a, sa, b, sb = make_inputs(4, sizes, 264, 384, seed=11, a_block=64)
    assert sa.shape == (M, 6)
    offs = offsets_of(sizes, "cpu")
    out = prime_kernels.m_grouped_fp8_gemm_nt(a, sa, b, sb, offs)
    ref = m_grouped_fp8_gemm_reference(a, sa, b, sb, offs, torch.float64)
    assert rel_err(out, ref) < BOUND
    wrong = m_grouped_fp8_gemm_reference(a, sa[:, ::2].contiguous(), b, sb, offs, torch.float64)
    assert rel_err(wrong, ref) > 10 * BOUND


def test_m_total_zero_gives_an_empty_output():
    _, a, sa, b, sb = make_inputs(2, [0, 0], 128, 128, seed=2)
    out = prime_kernels.m_grouped_fp8_gemm_nt(a, sa, b, sb, offsets_of([0, 0], "cpu"))
    assert out.shape == (0, 128) and out.dtype == torch.bfloat16


def test_k_block_major_scales():
    """sa becomes K-block major (stride(0) 1, stride(1) a multiple of 4 >= M) with the same values; an sa laid out so
    already is returned as it is."""
    for m, kb in ((1, 3), (5, 2), (8, 1), (130, 16)):
        sa = torch.rand(m, kb)
        t = k_block_major_scales(sa)
        assert torch.equal(t, sa)
        assert (m <= 1 or t.stride(0) == 1) and (kb == 1 or (t.stride(1) % 4 == 0 and t.stride(1) >= m))
        assert k_block_major_scales(t).data_ptr() == t.data_ptr()


def _bad_calls():
    sizes = [40, 24]
    M, a, sa, b, sb = make_inputs(2, sizes, 256, 256, seed=3)
    offs = offsets_of(sizes, "cpu")
    return {
        "a not e4m3": ((a.float(), sa, b, sb, offs), "float8_e4m3fn"),
        "b not e4m3": ((a, sa, b.to(torch.float8_e5m2), sb, offs), "float8_e4m3fn"),
        "sa not fp32": ((a, sa.double(), b, sb, offs), "float32"),
        "offsets not int32": ((a, sa, b, sb, offs.long()), "int32"),
        "groups mismatch": ((a, sa, b[:1], sb[:1], offs), "groups"),
        "K mismatch": ((a, sa, b[:, :, :128], sb[:, :, :1], offs), "K"),
        "K not a multiple of 64": ((a[:, :200], sa, b[:, :, :200].contiguous(), sb, offs),
                                   r"k \(200\) must be a positive multiple of 64 \(one scale block per 128 of K, the "
                                   r"last one 64 wide when k is 64 mod 128\)"),
        "sa shape": ((a, sa[:, :1], b, sb, offs), r"sa must be \[M, ceil\(K / 128\)\]"),
        "sb shape": ((a, sa, b, sb[:, :1], offs), r"sb must be \[E, ceil\(N / 128\), ceil\(K / 128\)\]"),
        "offsets past rows": ((a, sa, b, sb, torch.tensor([0, 40, M + 1], dtype=torch.int32)), "non-decreasing"),
        "offsets decreasing": ((a, sa, b, sb, torch.tensor([0, 50, 40], dtype=torch.int32)), "non-decreasing"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_cpu_op_rejects_bad_arguments(case):
    args, match = _bad_calls()[case]
    with pytest.raises((RuntimeError, TypeError), match=match):
        prime_kernels.m_grouped_fp8_gemm_nt(*args)


def test_num_sms_argument_is_checked():
    _, a, sa, b, sb = make_inputs(1, [8], 128, 128, seed=4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_sms"):
            prime_kernels.m_grouped_fp8_gemm_nt(a, sa, b, sb, offsets_of([8], "cpu"), num_sms=bad)


def test_status_lists_the_fp8_gemm():
    from prime_kernels import _status

    st = prime_kernels.status()
    key = "m_grouped_gemm_nt.fp8.sm90"
    assert isinstance(st[key], str) and st[key]
    assert key not in _status.unverified()  # its GPU tests have passed on an H200
    if not torch.cuda.is_available():
        assert st[key] == "no CUDA device"


# --------------------------------------------------------------------------------------------- GPU

# (E, kind, N, K): the Qwen3 layer shapes at small M (30B: H=2048, I=768; 235B: H=4096, I=1536; L1 is [2I, H],
# L2 [H, I]), plus one group with a ragged N and the smallest K, many groups, and M_total = 1.
CASES = [(8, "uniform", 1536, 2048), (8, "skewed", 2048, 768), (8, "special", 1536, 2048), (8, "special", 2048, 768),
         (4, "uniform", 3072, 4096), (4, "special", 4096, 1536), (1, "uniform", 136, 128), (128, "skewed", 264, 256),
         (4, "single_row", 2048, 768),
         # K = 64 (mod 128): a 64-wide last k-block (H = 1088, 2880 and 2I = 640 as K; the L1 dgrad's N = 1088)
         (4, "uniform", 640, 1088), (4, "skewed", 1088, 640), (4, "special", 5760, 2880), (1, "uniform", 136, 64)]


@requires_sm90
@pytest.mark.parametrize("E,kind,N,K", CASES)
def test_fp8_gemm_matches_float64(E, kind, N, K):
    gen = torch.Generator().manual_seed(E * 100 + N + K)
    sizes = group_sizes(E, kind, gen)
    M, a, sa, b, sb = make_inputs(E, sizes, N, K, seed=E * 7 + N + K + len(kind))
    offs = offsets_of(sizes, "cuda")
    # sa made K-block major here, so that the op allocates nothing before its output (which takes the NaN block)
    ac, sac, bc, sbc = a.cuda(), k_block_major_scales(sa.cuda()), b.cuda(), sb.cuda()
    poison_next_alloc(M * N, torch.bfloat16)
    out = prime_kernels.m_grouped_fp8_gemm_nt(ac, sac, bc, sbc, offs)
    torch.cuda.synchronize()
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    if M == 0:
        return
    assert not torch.isnan(out).any(), "rows inside groups left unwritten"
    ref = m_grouped_fp8_gemm_reference(a, sa, b, sb, offs.cpu(), torch.float64)
    err = rel_err(out.cpu(), ref)
    assert err <= BOUND, f"rel err {err:.3e}"
    # the emulation (G1 as the tensor core sums, G2, G3, bf16), on the GPU for speed, gives the kernel's bits
    emu = m_grouped_fp8_gemm_reference(ac, sa.cuda(), bc, sbc, offs)
    differ = int((emu.view(torch.int16) != out.view(torch.int16)).sum())
    assert differ == 0, f"{differ} of {out.numel()} values differ from the emulation's bits"
    again = prime_kernels.m_grouped_fp8_gemm_nt(ac, sac, bc, sbc, offs)
    assert torch.equal(out, again), "not deterministic"
    capped = prime_kernels.m_grouped_fp8_gemm_nt(ac, sac, bc, sbc, offs, num_sms=7)
    assert torch.equal(out, capped), "num_sms=7 differs from every SM"


@requires_sm90
@pytest.mark.parametrize("E,kind,N,K", [(8, "uniform", 2048, 768), (8, "special", 4096, 1536), (1, "uniform", 136, 128),
                                        (4, "single_row", 2048, 768),
                                        # K = I = 64 (mod 128): the last k-block's second scale box lies past K
                                        (4, "uniform", 1088, 320), (4, "skewed", 2880, 2880)])
def test_fp8_gemm_with_a_quantized_1x64_matches_float64(E, kind, N, K):
    """sa [M, K / 64]: each 128-wide k-block promoted in two halves with their own A scales (NaN-poisoned output,
    bitwise repeatable over grid sizes)."""
    gen = torch.Generator().manual_seed(E * 100 + N + K + 1)
    sizes = group_sizes(E, kind, gen)
    M, a, sa, b, sb = make_inputs(E, sizes, N, K, seed=E * 7 + N + K + 3, a_block=64)
    offs = offsets_of(sizes, "cuda")
    ac, sac, bc, sbc = a.cuda(), k_block_major_scales(sa.cuda()), b.cuda(), sb.cuda()
    poison_next_alloc(M * N, torch.bfloat16)
    out = prime_kernels.m_grouped_fp8_gemm_nt(ac, sac, bc, sbc, offs)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "rows inside groups left unwritten"
    ref = m_grouped_fp8_gemm_reference(a, sa, b, sb, offs.cpu(), torch.float64)
    err = rel_err(out.cpu(), ref)
    assert err <= BOUND, f"rel err {err:.3e}"
    emu = m_grouped_fp8_gemm_reference(ac, sa.cuda(), bc, sbc, offs)
    differ = int((emu.view(torch.int16) != out.view(torch.int16)).sum())
    assert differ == 0, f"{differ} of {out.numel()} values differ from the emulation's bits"
    assert torch.equal(out, prime_kernels.m_grouped_fp8_gemm_nt(ac, sac, bc, sbc, offs, num_sms=7))


@requires_sm90
def test_fp8_gemm_m_total_zero_launches_nothing():
    _, a, sa, b, sb = make_inputs(3, [0, 0, 0], 256, 256, seed=5)
    out = prime_kernels.m_grouped_fp8_gemm_nt(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), offsets_of([0, 0, 0], "cuda"))
    torch.cuda.synchronize()
    assert out.shape == (0, 256)


@requires_sm90
def test_fp8_gemm_bad_group_offsets_write_nothing_and_are_reported():
    sizes = [100, 0, 300, 57]
    M, a, sa, b, sb = make_inputs(4, sizes, 256, 256, seed=6)
    good = offsets_of(sizes, "cpu").tolist()
    a, sa, b, sb = a.cuda(), k_block_major_scales(sa.cuda()), b.cuda(), sb.cuda()
    for bad in ([0, good[3], good[1]] + good[3:], good[:-1] + [M + 1], [-128] + good[1:]):
        offs = torch.tensor(bad, dtype=torch.int32, device="cuda")
        poison_next_alloc(M * 256, torch.bfloat16)
        out = prime_kernels.m_grouped_fp8_gemm_nt(a, sa, b, sb, offs)
        torch.cuda.synchronize()
        assert out.isnan().all(), f"bad offsets {bad} wrote something"
        with pytest.raises(RuntimeError, match="m-grouped GEMM's group_offsets are not non-decreasing"):
            prime_kernels.check_device_errors()
        prime_kernels.check_device_errors()  # reported once, then cleared


@requires_sm90
def test_fp8_gemm_bad_cuda_inputs_raise_before_launch():
    sizes = [40, 24]
    M, a, sa, b, sb = make_inputs(2, sizes, 256, 256, seed=7)
    a, sa, b, sb, offs = a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), offsets_of(sizes, "cuda")
    op = torch.ops.prime_kernels.m_grouped_fp8_gemm_nt
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        op(a.float(), sa, b, sb, offs)
    with pytest.raises(RuntimeError, match="K-block major"):
        op(a, sa.contiguous(), b, sb, offs)  # row-major sa is what the Python wrapper converts, not the op
    sak = k_block_major_scales(sa)
    with pytest.raises(RuntimeError, match=r"K \(160\) must be a multiple of 64"):
        op(a[:, :160].contiguous(), sak, b[:, :, :160].contiguous(), sb, offs)
    with pytest.raises(RuntimeError, match=r"sb must be \[E"):
        op(a, sak, b, sb[:, :, :1], offs)
    with pytest.raises(RuntimeError, match="ld_sa"):  # a stride between k-blocks that TMA cannot use
        op(a, torch.empty(2, M + 2, device="cuda")[:, :M].t(), b, sb, offs)
