"""The sm90 BF16 grouped GEMMs against float64, plus opcheck of the ops' CPU reference kernels."""

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from prime_kernels.grouped_gemm import k_grouped_gemm_reference, m_grouped_gemm_reference

SPECIAL = [0, 1, 7, 127, 128, 1000]


def group_sizes(E: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "special":  # every size the issue names, then random ones
        rand = torch.randint(0, 300, (E,), generator=gen).tolist()
        return [SPECIAL[i] if i < len(SPECIAL) else rand[i] for i in range(E)]
    if kind == "skewed":  # Zipf-like: a few huge groups, many tiny or empty
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.1
        pop = pop[torch.randperm(E, generator=gen)]
        return torch.round(pop / pop.sum() * 300 * min(E, 32)).long().tolist()
    if kind == "hot":  # one group of 40 m-blocks (two full bands of 16 and a partial one, see band_tile), others small
        sizes = torch.randint(0, 200, (E,), generator=gen).tolist()
        sizes[E // 2] = 5000
        return sizes
    raise ValueError(kind)


def offsets_of(sizes: list[int], device) -> torch.Tensor:
    offs = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32)
    return offs.to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_next_alloc(numel: int, dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of exactly this size in the caching allocator: the op's output of the
    same size on the same stream reuses it, so an unwritten element shows as NaN."""
    block = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del block


# --------------------------------------------------------------------------------------------- CPU


def test_cpu_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(0)
    offs = offsets_of([3, 0, 9, 4], "cpu")
    a = torch.randn(16, 64, generator=gen).bfloat16()
    b_nt = torch.randn(4, 32, 64, generator=gen).bfloat16()
    b_nn = torch.randn(4, 64, 32, generator=gen).bfloat16()
    ops = torch.ops.prime_kernels
    torch.library.opcheck(ops.m_grouped_bf16_gemm_nt.default, (a, b_nt, offs))
    torch.library.opcheck(ops.m_grouped_bf16_gemm_nn.default, (a, b_nn, offs))
    bk = torch.randn(16, 48, generator=gen).bfloat16()
    torch.library.opcheck(ops.k_grouped_bf16_gemm_tn.default, (a, bk, offs, True))
    c = torch.randn(4, 64, 48, generator=gen)
    torch.library.opcheck(ops.k_grouped_bf16_gemm_tn_accumulate_.default, (a, bk, offs, c))


@pytest.mark.parametrize("offs", [[0, 5, 3], [0, 2, 9], [-1, 2, 8], [0, 8, 8, 9], [3, 2, 8]])
def test_cpu_ops_reject_bad_group_offsets(offs):
    """Offsets must be non-decreasing within [0, rows] (8 rows here); the CPU kernels check them at once."""
    gen = torch.Generator().manual_seed(2)
    E = len(offs) - 1
    o = torch.tensor(offs, dtype=torch.int32)
    a = torch.randn(8, 64, generator=gen).bfloat16()
    with pytest.raises(RuntimeError, match="group_offsets must be non-decreasing"):
        prime_kernels.m_grouped_bf16_gemm_nt(a, torch.randn(E, 32, 64).bfloat16(), o)
    with pytest.raises(RuntimeError, match="group_offsets must be non-decreasing"):
        prime_kernels.m_grouped_bf16_gemm_nn(a, torch.randn(E, 64, 32).bfloat16(), o)
    with pytest.raises(RuntimeError, match="group_offsets must be non-decreasing"):
        prime_kernels.k_grouped_bf16_gemm_tn(a, torch.randn(8, 16).bfloat16(), o)


def test_cpu_ops_accept_a_first_offset_past_zero():
    """Rows before offsets[0] belong to no group (not an error)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(8, 64, generator=gen).bfloat16()
    b = torch.randn(2, 32, 64, generator=gen).bfloat16()
    offs = torch.tensor([2, 5, 8], dtype=torch.int32)
    out = prime_kernels.m_grouped_bf16_gemm_nt(a, b, offs)
    ref = m_grouped_gemm_reference(a, b, offs, True, torch.float64)
    assert rel_err(out[2:], ref[2:]) < 1e-2


def test_cpu_gather_rejects_row_indices_outside_a():
    a = torch.randn(12, 64).bfloat16()
    w13 = torch.randn(2, 128, 64).bfloat16()
    offs = offsets_of([4, 6], "cpu")
    for bad in (12, 40, -2):
        idx = torch.tensor([3, -1, 0, 11, 5, 7, 2, 2, 9, bad], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"a_row_index holds .*, outside \[-1, 12\)"):
            prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu(a, w13, offs, a_row_index=idx, m_total=10)
        with pytest.raises(RuntimeError, match=r"a_row_index holds"):
            prime_kernels.m_grouped_bf16_gemm_nt(a, w13, offs, a_row_index=idx, m_total=10)


def test_num_sms_argument_is_checked():
    a = torch.randn(8, 64).bfloat16()
    b = torch.randn(1, 32, 64).bfloat16()
    offs = offsets_of([8], "cpu")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_sms"):
            prime_kernels.m_grouped_bf16_gemm_nt(a, b, offs, num_sms=bad)
    assert torch.equal(prime_kernels.m_grouped_bf16_gemm_nt(a, b, offs, num_sms=3), prime_kernels.m_grouped_bf16_gemm_nt(a, b, offs))


def test_cpu_reference_matches_float64():
    gen = torch.Generator().manual_seed(1)
    sizes = [5, 0, 17, 1]
    offs = offsets_of(sizes, "cpu")
    a = torch.randn(23, 64, generator=gen).bfloat16()
    b = torch.randn(4, 40, 64, generator=gen).bfloat16()
    out = prime_kernels.m_grouped_bf16_gemm_nt(a, b, offs)
    ref = m_grouped_gemm_reference(a, b, offs, True, torch.float64)
    assert rel_err(out, ref) < 1e-2
    bk = torch.randn(23, 24, generator=gen).bfloat16()
    acc = torch.randn(4, 64, 24, generator=gen)
    expect = acc.double() + k_grouped_gemm_reference(a, bk, offs, torch.float64)
    prime_kernels.k_grouped_bf16_gemm_tn(a, bk, offs, accumulate_into=acc)
    assert rel_err(acc, expect) < 1e-5


# --------------------------------------------------------------------------------------------- GPU

M_CASES = [  # (E, kind, N, K)
    (1, "special", 192, 320), (8, "special", 448, 192), (8, "skewed", 256, 256), (128, "special", 192, 576),
    (128, "skewed", 1536, 256), (256, "special", 320, 192), (256, "skewed", 64, 128), (4, "hot", 320, 256),
]


@requires_sm90
@pytest.mark.parametrize("E,kind,N,K", M_CASES)
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_m_grouped_matches_float64(E, kind, N, K, layout):
    gen = torch.Generator().manual_seed(E * 1000 + N + K)
    sizes = group_sizes(E, kind, gen)
    M = sum(sizes)
    offs = offsets_of(sizes, "cuda")
    a = torch.randn(max(M, 1), K, generator=gen).bfloat16().cuda()
    b = (torch.randn(E, N, K, generator=gen) if layout == "nt" else torch.randn(E, K, N, generator=gen))
    b = (b / K ** 0.5).bfloat16().cuda()
    op = prime_kernels.m_grouped_bf16_gemm_nt if layout == "nt" else prime_kernels.m_grouped_bf16_gemm_nn
    poison_next_alloc(max(M, 1) * N, torch.bfloat16)
    out = op(a, b, offs)
    torch.cuda.synchronize()
    if M == 0:
        return
    ref = m_grouped_gemm_reference(a.cpu(), b.cpu(), offs.cpu(), layout == "nt", torch.float64)
    assert not torch.isnan(out[:M]).any(), "rows inside groups left unwritten"
    err = rel_err(out[:M].cpu(), ref[:M])
    assert err < 1e-2, f"rel err {err:.3e}"
    again = op(a, b, offs)
    assert torch.equal(out[:M], again[:M]), "not deterministic"


K_CASES = [(1, "special", 192, 320), (8, "special", 256, 192), (128, "skewed", 768, 320), (256, "special", 192, 64),
           (128, "special", 128, 1536)]


@requires_sm90
@pytest.mark.parametrize("E,kind,Mdim,Ndim", K_CASES)
@pytest.mark.parametrize("mode", ["fp32", "bf16", "accumulate"])
def test_k_grouped_matches_float64(E, kind, Mdim, Ndim, mode):
    gen = torch.Generator().manual_seed(E * 7 + Mdim + Ndim)
    sizes = group_sizes(E, kind, gen)
    P = sum(sizes)
    offs = offsets_of(sizes, "cuda")
    a = torch.randn(max(P, 1), Mdim, generator=gen).bfloat16().cuda()
    b = torch.randn(max(P, 1), Ndim, generator=gen).bfloat16().cuda()
    ref = k_grouped_gemm_reference(a.cpu(), b.cpu(), offs.cpu(), torch.float64)
    if mode == "accumulate":
        base = torch.randn(E, Mdim, Ndim, generator=gen)
        out = base.cuda()
        prime_kernels.k_grouped_bf16_gemm_tn(a, b, offs, accumulate_into=out)
        ref = ref + base.double()
    else:
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        poison_next_alloc(E * Mdim * Ndim, dtype)
        out = prime_kernels.k_grouped_bf16_gemm_tn(a, b, offs, out_dtype=dtype)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "output left unwritten"
    for g, n in enumerate(sizes):  # empty groups: exact zeros (store) or the untouched base (accumulate)
        if n == 0:
            assert torch.equal(out[g].double().cpu(), ref[g].to(out.dtype).double())
    err = rel_err(out.cpu(), ref)
    assert err < 1e-2, f"rel err {err:.3e}"


@requires_sm90
def test_bad_gemm_inputs_raise_before_launch():
    a = torch.randn(64, 128, device="cuda").bfloat16()
    b = torch.randn(2, 64, 128, device="cuda").bfloat16()
    offs = offsets_of([32, 32], "cuda")
    with pytest.raises(RuntimeError, match="bfloat16"):
        prime_kernels.m_grouped_bf16_gemm_nt(a.float(), b, offs)
    with pytest.raises(RuntimeError, match="groups"):
        prime_kernels.m_grouped_bf16_gemm_nt(a, b, offsets_of([64], "cuda"))
    with pytest.raises(RuntimeError, match="K"):
        prime_kernels.m_grouped_bf16_gemm_nt(a, b[:, :, :64], offs)
    with pytest.raises(RuntimeError, match="int32"):
        prime_kernels.m_grouped_bf16_gemm_nt(a, b, offs.long())
    with pytest.raises(RuntimeError):
        prime_kernels.m_grouped_bf16_gemm_nt(a[:, :100], b[:, :, :100], offs)  # K % 8 != 0


def _swiglu_ref64(rows, w13, offs, clamp):
    h = m_grouped_gemm_reference(rows, w13, offs, True, torch.float64)
    I = w13.shape[1] // 2
    g, u = h[:, :I], h[:, I:]
    if clamp is not None:
        g, u = torch.clamp(g, max=clamp), torch.clamp(u, min=-clamp, max=clamp)
    return torch.nn.functional.silu(g) * u, h


def test_swiglu_gemm_cpu_opcheck():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(12, 64, generator=gen).bfloat16()
    w13 = torch.randn(3, 128, 64, generator=gen).bfloat16()
    offs = offsets_of([4, 0, 6], "cpu")
    idx = torch.tensor([3, -1, 0, 11, 5, 7, 2, 2, 9, 4, 1, 6], dtype=torch.int32)
    torch.library.opcheck(torch.ops.prime_kernels.m_grouped_bf16_gemm_swiglu.default, (a, w13, offs, idx, 10, True, 0.5))
    torch.library.opcheck(torch.ops.prime_kernels.m_grouped_bf16_gemm_swiglu.default, (a, w13, offs, None, 10, False, 0.0))


@requires_sm90
@pytest.mark.parametrize("E,kind,I,K,gathered,clamp", [(8, "special", 192, 256, True, None),
                                                       (128, "skewed", 768, 512, True, 0.75),
                                                       (1, "skewed", 64, 320, False, None),
                                                       (4, "hot", 256, 128, False, None)])
def test_swiglu_gemm_matches_float64(E, kind, I, K, gathered, clamp):
    gen = torch.Generator().manual_seed(E + I + K)
    sizes = group_sizes(E, kind, gen)
    M = sum(sizes)
    offs = offsets_of(sizes, "cuda")
    src_rows = 700
    if gathered:
        x = torch.randn(src_rows, K, generator=gen).bfloat16().cuda()
        idx = torch.randint(-1, src_rows, (M,), generator=gen, dtype=torch.int32).cuda()
        rows = torch.where((idx >= 0)[:, None].cpu(), x.cpu()[idx.clamp(min=0).long().cpu()], torch.zeros(()).bfloat16())
    else:
        x = torch.randn(M, K, generator=gen).bfloat16().cuda()
        idx, rows = None, x.cpu()
    w13 = (torch.randn(E, 2 * I, K, generator=gen) / K ** 0.5).bfloat16().cuda()
    s, h = prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu(x, w13, offs, a_row_index=idx, m_total=M, save_h=True,
                                                             clamp=clamp)
    s_ref, h_ref = _swiglu_ref64(rows, w13.cpu(), offs.cpu(), clamp)
    assert torch.isfinite(s).all() and torch.isfinite(h).all()
    assert rel_err(s.cpu(), s_ref) < 1e-2 and rel_err(h.cpu(), h_ref) < 1e-2


# ------------------------------------------------------------------ L2 dgrad + SwiGLU backward epilogue


def _swiglu_bwd_ref64(dy_pool, w2, offs, h, src, weights, clamp):
    """float64 (dh, w * s, d topk_weight per row) of the SwiGLU backward after da = dy_pool @ w2_g."""
    da = m_grouped_gemm_reference(dy_pool.double(), w2.double(), offs, False, torch.float64)
    I = w2.shape[2]
    M = dy_pool.shape[0]
    g, u = h[:M, :I].double(), h[:M, I:].double()
    gc, uc = (g.clamp(max=clamp), u.clamp(-clamp, clamp)) if clamp else (g, u)
    s64 = src[:M].long()
    w = torch.where(s64 >= 0, weights.reshape(-1).double()[s64.clamp(min=0)], torch.zeros((), dtype=torch.float64))
    sig = torch.sigmoid(gc)
    silu, sv = gc * sig, gc * sig * uc
    dg = w[:, None] * da * uc * sig * (1 + gc * (1 - sig))
    du = w[:, None] * da * silu
    if clamp:
        dg, du = dg * (g < clamp), du * ((u > -clamp) & (u < clamp))
    dt = torch.where(s64 >= 0, (da * sv).sum(1), torch.zeros((), dtype=torch.float64))
    return torch.cat([dg, du], 1), w[:, None] * sv, dt


def _swiglu_bwd_inputs(E: int, kind: str, I: int, H: int, seed: int):
    """(M, offsets, dy_pool, w2, h, pool_src_route, topk_weights) on CUDA for the L2 dgrad + SwiGLU backward op: top-2
    routes of M tokens, some pool rows padding (route -1)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = group_sizes(E, kind, gen)
    M = sum(sizes)
    offs = offsets_of(sizes, "cuda")
    dy = torch.randn(M, H, generator=gen).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=gen) / H ** 0.5).bfloat16().cuda()
    h = (torch.randn(M, 2 * I, generator=gen) * 2).bfloat16().cuda()
    src = torch.randint(-1, 2 * M, (M,), generator=gen, dtype=torch.int32).cuda()  # -1: padding rows
    wts = (torch.rand(M, 2, generator=gen) + 0.1).cuda()
    return M, offs, dy, w2, h, src, wts


def test_swiglu_bwd_gemm_cpu_opcheck():
    gen = torch.Generator().manual_seed(5)
    dy = torch.randn(10, 64, generator=gen).bfloat16()
    w2 = torch.randn(3, 64, 320, generator=gen).bfloat16()
    h = torch.randn(10, 640, generator=gen).bfloat16()
    src = torch.tensor([0, 5, -1, 7, 2, 9, 11, 3, -1, 4], dtype=torch.int32)
    wts = torch.rand(12, generator=gen) + 0.1
    offs = offsets_of([4, 0, 6], "cpu")
    for clamp in (0.0, 0.5):
        torch.library.opcheck(torch.ops.prime_kernels.m_grouped_bf16_gemm_swiglu_bwd.default, (dy, w2, offs, h, src, wts, clamp))


@requires_sm90
@pytest.mark.parametrize("E,kind,I,H,clamp", [(8, "special", 768, 256, None), (128, "skewed", 1536, 512, 0.75),
                                              (3, "skewed", 320, 128, None), (5, "skewed", 192, 136, 0.5),
                                              (4, "hot", 256, 128, None)])
def test_swiglu_bwd_gemm_matches_float64(E, kind, I, H, clamp):
    M, offs, dy, w2, h, src, wts = _swiglu_bwd_inputs(E, kind, I, H, seed=E + I + H)
    nb = (I + 127) // 128
    poison_next_alloc(M * 2 * I, torch.bfloat16)
    dh, aw, dt_part = prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd(dy, w2, offs, h, src, wts, clamp=clamp)
    assert dt_part.shape == (M, nb)
    dh_ref, aw_ref, dt_ref = _swiglu_bwd_ref64(dy.cpu(), w2.cpu(), offs.cpu(), h.cpu(), src.cpu(), wts.cpu(), clamp)
    for name, out, ref in (("dh", dh, dh_ref), ("w*s", aw, aw_ref), ("dt", dt_part.sum(1), dt_ref)):
        assert torch.isfinite(out).all(), name
        assert rel_err(out.cpu(), ref) < 1e-2, name
    again = prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd(dy, w2, offs, h, src, wts, clamp=clamp)
    for a, b in zip((dh, aw, dt_part), again):
        assert torch.equal(a, b)  # deterministic


@requires_sm90
def test_swiglu_bwd_gemm_bad_inputs_raise():
    dy = torch.randn(16, 128, device="cuda").bfloat16()
    w2 = torch.randn(2, 128, 256, device="cuda").bfloat16()
    h = torch.randn(16, 512, device="cuda").bfloat16()
    src = torch.zeros(16, dtype=torch.int32, device="cuda")
    wts = torch.rand(16, device="cuda")
    offs = offsets_of([8, 8], "cuda")
    f = prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd
    with pytest.raises(RuntimeError, match="h must be"):
        f(dy, w2, offs, h[:, :256], src, wts)
    with pytest.raises(RuntimeError, match="w2 must be"):
        f(dy, w2[:, :64], offs, h, src, wts)
    with pytest.raises(RuntimeError, match="topk_weights"):
        f(dy, w2, offs, h, src, wts.double())
    with pytest.raises(ValueError, match="clamp"):
        f(dy, w2, offs, h, src, wts, clamp=-1.0)
    with pytest.raises(RuntimeError, match="multiple of 64"):  # the one kernel's 64-column boxes
        f(dy, w2[:, :, :200].contiguous(), offs, h[:, :400], src, wts)


def _all_grouped_ops(seed: int = 5):
    """Every grouped op on one skewed grouping (an empty group, groups not a multiple of 128 rows): a list of
    calls f(num_sms) -> list of outputs, and the output sizes to poison (bf16, then fp32)."""
    gen = torch.Generator().manual_seed(seed)
    E, I, H = 6, 256, 192
    sizes = group_sizes(E, "skewed", gen)
    sizes[1] = 0
    offs = offsets_of(sizes, "cuda")
    M = sum(sizes)
    a = torch.randn(M, H, generator=gen).bfloat16().cuda()
    idx = torch.randint(-1, M, (M,), generator=gen, dtype=torch.int32).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16().cuda()
    b_k = torch.randn(M, I, generator=gen).bfloat16().cuda()  # the k-grouped GEMM's second operand
    M2, offs2, dy, w2b, h, src, wts = _swiglu_bwd_inputs(E, "skewed", I, H, seed=seed + 12)
    gg = prime_kernels.grouped_gemm
    acc0 = torch.randn(E, H, I, generator=gen).cuda()
    calls = {
        "nt": lambda n: [gg.m_grouped_bf16_gemm_nt(a, w13, offs, num_sms=n)],
        "nt_gather": lambda n: [gg.m_grouped_bf16_gemm_nt(a, w13, offs, a_row_index=idx, m_total=M, num_sms=n)],
        "nn": lambda n: [gg.m_grouped_bf16_gemm_nn(a, w2, offs, num_sms=n)],
        "swiglu": lambda n: list(gg.m_grouped_bf16_gemm_swiglu(a, w13, offs, a_row_index=idx, m_total=M, save_h=True,
                                                               num_sms=n)),
        "swiglu_bwd": lambda n: list(gg.m_grouped_bf16_gemm_swiglu_bwd(dy, w2b, offs2, h, src, wts, num_sms=n)),
        "k_bf16": lambda n: [gg.k_grouped_bf16_gemm_tn(a, b_k, offs, out_dtype=torch.bfloat16, num_sms=n)],
        "k_fp32": lambda n: [gg.k_grouped_bf16_gemm_tn(a, b_k, offs, num_sms=n)],
        "k_acc": lambda n: [gg.k_grouped_bf16_gemm_tn(a, b_k, offs, accumulate_into=acc0.clone(), num_sms=n)],
    }
    return calls, M, offs


@requires_sm90
@pytest.mark.parametrize("op", ["nt", "nt_gather", "nn", "swiglu", "swiglu_bwd", "k_bf16", "k_fp32", "k_acc"])
def test_num_sms_gives_the_same_bits(op):
    """No grouped kernel assumes grid == SMs: the tiles are fixed, so every cap (one SM included, which makes one
    CTA run every tile) gives the bits of the default."""
    calls, M, _ = _all_grouped_ops()
    f = calls[op]
    base = f(None)
    for n in (1, 7, 66, 131, 132, 100000):
        for x, y in zip(base, f(n)):
            rows = min(M, x.shape[0]) if x.dim() == 2 and op not in ("k_bf16", "k_fp32", "k_acc") else x.shape[0]
            assert torch.equal(x[:rows], y[:rows]), f"{op}: num_sms={n} differs from every SM"


def _finding(match: str) -> None:
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=match):
        prime_kernels.check_device_errors()
    prime_kernels.check_device_errors()  # reported once, then cleared


BAD_OFFSETS = {"decreasing": lambda o, M: [0, o[3], o[1]] + o[3:],  # groups 0 and 2 overlap if run
               "past_rows": lambda o, M: o[:-1] + [M + 1],
               "negative": lambda o, M: [-128] + o[1:],
               "first_past_second": lambda o, M: [o[2] + 1] + o[1:]}


@requires_sm90
@pytest.mark.parametrize("bad", list(BAD_OFFSETS))
@pytest.mark.parametrize("op", ["nt", "nt_gather", "nn", "swiglu", "k_bf16", "k_fp32", "k_acc"])
def test_bad_group_offsets_write_nothing_and_are_reported(op, bad):
    """Offsets that are not non-decreasing within [0, rows] make every CTA leave before its first store (output
    poisoned with NaN stays NaN; an accumulated buffer keeps its bits), and the finding is raised once."""
    gen = torch.Generator().manual_seed(11)
    E, H, N = 4, 128, 256
    sizes = [100, 0, 300, 57]
    M = sum(sizes)
    good = offsets_of(sizes, "cpu").tolist()
    offs = torch.tensor(BAD_OFFSETS[bad](good, M), dtype=torch.int32, device="cuda")
    a = torch.randn(M, H, generator=gen).bfloat16().cuda()
    idx = torch.arange(M, dtype=torch.int32, device="cuda")
    gg = prime_kernels.grouped_gemm
    if op.startswith("k_"):
        b = torch.randn(M, N, generator=gen).bfloat16().cuda()
        if op == "k_acc":
            c = torch.randn(E, H, N, generator=gen).cuda()
            before = c.clone()
            gg.k_grouped_bf16_gemm_tn(a, b, offs, accumulate_into=c)
            torch.cuda.synchronize()
            assert torch.equal(c, before)
        else:
            dtype = torch.bfloat16 if op == "k_bf16" else torch.float32
            poison_next_alloc(E * H * N, dtype)
            out = gg.k_grouped_bf16_gemm_tn(a, b, offs, out_dtype=dtype)
            torch.cuda.synchronize()
            assert out.isnan().all(), "a k-grouped GEMM with bad offsets wrote something"
        _finding("k-grouped GEMM's group_offsets are not non-decreasing")
        return
    if op == "swiglu":
        w13 = torch.randn(E, 2 * N, H, generator=gen).bfloat16().cuda()
        poison_next_alloc(M * N, torch.bfloat16)
        s, _ = gg.m_grouped_bf16_gemm_swiglu(a, w13, offs, a_row_index=idx, m_total=M)
        outs = [s]
    else:
        b = torch.randn(E, N, H, generator=gen).bfloat16().cuda() if op != "nn" else \
            torch.randn(E, H, N, generator=gen).bfloat16().cuda()
        poison_next_alloc(M * N, torch.bfloat16)
        if op == "nt":
            outs = [gg.m_grouped_bf16_gemm_nt(a, b, offs)]
        elif op == "nt_gather":
            outs = [gg.m_grouped_bf16_gemm_nt(a, b, offs, a_row_index=idx, m_total=M)]
        else:
            outs = [gg.m_grouped_bf16_gemm_nn(a, b, offs)]
    torch.cuda.synchronize()
    for out in outs:
        assert out.isnan().all(), f"{op} with bad offsets wrote something"
    _finding("m-grouped GEMM's group_offsets are not non-decreasing")


@requires_sm90
def test_bad_offsets_of_the_swiglu_backward_write_nothing():
    M, offs, dy, w2, h, src, wts = _swiglu_bwd_inputs(4, "special", 256, 128, seed=9)
    bad = offs.clone()
    bad[1] = M + 5
    poison_next_alloc(M * 2 * 256, torch.bfloat16)
    dh, aw, dt = prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd(dy, w2, bad, h, src, wts)
    torch.cuda.synchronize()
    assert dh.isnan().all()
    _finding("m-grouped GEMM's group_offsets are not non-decreasing")


@requires_sm90
def test_gather_index_outside_a_reads_zeros_and_is_reported():
    gen = torch.Generator().manual_seed(12)
    E, K, N, T = 3, 128, 256, 50
    sizes = [70, 0, 90]
    M = sum(sizes)
    offs = offsets_of(sizes, "cuda")
    x = torch.randn(T, K, generator=gen).bfloat16().cuda()
    idx = torch.randint(-1, T, (M,), generator=gen, dtype=torch.int32)
    bad = idx.clone()
    bad[3], bad[100], bad[150] = T, -7, 1 << 30
    masked = torch.where((bad >= -1) & (bad < T), bad, torch.full_like(bad, -1))
    b = (torch.randn(E, N, K, generator=gen) / K ** 0.5).bfloat16().cuda()
    w13 = (torch.randn(E, 2 * N, K, generator=gen) / K ** 0.5).bfloat16().cuda()
    gg = prime_kernels.grouped_gemm
    want = gg.m_grouped_bf16_gemm_nt(x, b, offs, a_row_index=masked.cuda(), m_total=M)
    got = gg.m_grouped_bf16_gemm_nt(x, b, offs, a_row_index=bad.cuda(), m_total=M)
    assert torch.equal(got, want)
    _finding("a_row_index names a row outside A")
    want_s, _ = gg.m_grouped_bf16_gemm_swiglu(x, w13, offs, a_row_index=masked.cuda(), m_total=M)
    got_s, _ = gg.m_grouped_bf16_gemm_swiglu(x, w13, offs, a_row_index=bad.cuda(), m_total=M)
    assert torch.equal(got_s, want_s)
    _finding("a_row_index names a row outside A")


@requires_sm90
def test_swiglu_bwd_route_without_a_weight_gets_zero_and_is_reported():
    M, offs, dy, w2, h, src, wts = _swiglu_bwd_inputs(4, "special", 256, 128, seed=10)
    n_routes = wts.numel()
    bad = src.clone()
    bad[0], bad[M // 2] = n_routes, n_routes + 1000
    masked = torch.where(bad < n_routes, bad, torch.full_like(bad, -1))
    f = prime_kernels.grouped_gemm.m_grouped_bf16_gemm_swiglu_bwd
    want = f(dy, w2, offs, h, masked, wts)
    got = f(dy, w2, offs, h, bad, wts)
    for x, y in zip(want, got):
        assert torch.equal(x, y)
    _finding("pool_src_route names a route without a weight")
    # the pool-row kernel: the same rule
    rows = torch.tensor([M], dtype=torch.int32, device="cuda")
    da = torch.randn(M, 256, device="cuda").bfloat16()
    want = prime_kernels.swiglu.swiglu_bwd(h[:M], da, masked, wts, rows)
    got = prime_kernels.swiglu.swiglu_bwd(h[:M], da, bad, wts, rows)
    for x, y in zip(want, got):
        assert torch.equal(x, y)
    _finding("pool_src_route names a route without a weight")
