"""The m-grouped BF16 GEMMs with a second weight tensor for their last groups (prime_kernels.second_b: shared experts
as chunks of width I beside the routed experts).

CPU: the chunk layout (expand_chunks) against slicing by hand; the L1 with SwiGLU and the L2 over the chunks summed
per token equal the shared experts' whole SwiGLU MLP (the separability the chunking rests on); the ops pass opcheck
and refuse mismatched shapes. GPU: each op bit for bit the routed op on the weights with the chunks laid out as
experts (the same tiles, the same k-order), NaN-filled outputs first, and the MLP identity there too."""

import pytest
import torch

from conftest import requires_sm90
from test_grouped_gemm import group_sizes, offsets_of, poison_next_alloc, rel_err

KEY = "m_grouped_gemm_second_b.bf16.sm90"


def _problem(E, S, chunks, I, H, sizes, device, seed=0):
    """Routed weights [E, 2I, H] / [E, H, I], shared ones [S, 2 chunks I, H] / [S, H, chunks I], pooled rows x [M, H]
    (sizes: the rows of the E + S * chunks groups), and the group offsets."""
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16()
    w13s = (torch.randn(S, 2 * chunks * I, H, generator=gen) / H ** 0.5).bfloat16()
    w2s = (torch.randn(S, H, chunks * I, generator=gen) / (chunks * I) ** 0.5).bfloat16()
    x = torch.randn(sum(sizes), H, generator=gen).bfloat16()
    return [t.to(device) for t in (w13, w2, w13s, w2s, x)] + [offsets_of(sizes, device)]


def test_expand_chunks_is_the_chunk_layout():
    from prime_kernels.second_b import expand_chunks

    S, m, I, H = 2, 3, 4, 5
    w13 = torch.arange(S * 2 * m * I * H, dtype=torch.float32).view(S, 2 * m * I, H)
    w2 = torch.arange(S * H * m * I, dtype=torch.float32).view(S, H, m * I)
    e13, e2 = expand_chunks(w13, m, "w13"), expand_chunks(w2, m, "w2")
    assert e13.shape == (S * m, 2 * I, H) and e2.shape == (S * m, H, I)
    for s in range(S):
        for j in range(m):
            v = s * m + j
            assert torch.equal(e13[v, :I], w13[s, j * I:(j + 1) * I])
            assert torch.equal(e13[v, I:], w13[s, m * I + j * I:m * I + (j + 1) * I])
            assert torch.equal(e2[v], w2[s, :, j * I:(j + 1) * I])
    with pytest.raises(ValueError, match="chunks"):
        expand_chunks(w13, 0, "w13")
    with pytest.raises(ValueError, match="not 2 \\* chunks"):
        expand_chunks(w13, 5, "w13")


def _shared_mlp_through_chunks(w13, w2, w13s, w2s, x, offs, E, S, chunks, clamp=None):
    """The shared experts' output per pool row of their first chunk: the L1 (SwiGLU) and L2 second-B ops, then each
    row's chunks summed in fp32, against the whole SwiGLU MLP of each shared expert in fp32 on the same rows."""
    from prime_kernels.second_b import m_grouped_bf16_gemm_nt_second_b, m_grouped_bf16_gemm_swiglu_second_b

    s, _ = m_grouped_bf16_gemm_swiglu_second_b(x, w13, w13s, offs, chunks=chunks, clamp=clamp)
    o = m_grouped_bf16_gemm_nt_second_b(s, w2, w2s, offs, chunks=chunks)
    o_offs = offs.tolist()
    got, want = [], []
    for sh in range(S):
        rows = [slice(o_offs[E + sh * chunks + j], o_offs[E + sh * chunks + j + 1]) for j in range(chunks)]
        got.append(sum(o[r].float() for r in rows))
        xs = x[rows[0]].float()
        Is = w13s.shape[1] // 2
        h = xs @ w13s[sh].float().t()
        g, u = h[:, :Is], h[:, Is:]
        if clamp is not None:
            g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
        want.append((torch.nn.functional.silu(g) * u) @ w2s[sh].float().t())
    return torch.cat(got), torch.cat(want)


@pytest.mark.parametrize("chunks", [1, 3])
def test_chunks_summed_are_the_shared_mlp_on_cpu(chunks):
    """Every shared expert's rows (the same tokens in each of its chunk groups) through the L1 and L2 second-B ops,
    the chunks summed: the whole SwiGLU MLP of width chunks * I (bf16 roundings of h, s and o apart)."""
    E, S, I, H, T = 3, 2, 64, 128, 37
    sizes = [5, 0, 9] + [T] * (S * chunks)
    w13, w2, w13s, w2s, x, offs = _problem(E, S, chunks, I, H, sizes, "cpu", seed=chunks)
    # each chunk group of a shared expert holds the same T token rows
    o = offs.tolist()
    for sh in range(S):
        first = x[o[E + sh * chunks]:o[E + sh * chunks + 1]].clone()
        for j in range(chunks):
            x[o[E + sh * chunks + j]:o[E + sh * chunks + j + 1]] = first
    got, want = _shared_mlp_through_chunks(w13, w2, w13s, w2s, x, offs, E, S, chunks)
    assert rel_err(got, want.double()) < 2e-2


def test_cpu_ops_pass_opcheck_and_refuse_mismatched_shapes():
    E, S, m, I, H = 2, 1, 2, 64, 64
    w13, w2, w13s, w2s, x, offs = _problem(E, S, m, I, H, [3, 4, 5, 6], "cpu")
    ops = torch.ops.prime_kernels
    torch.library.opcheck(ops.m_grouped_bf16_gemm_swiglu_second_b.default, (x, w13, w13s, offs, None, 18, True, m, 0.0))
    s = torch.randn(18, I).bfloat16()
    torch.library.opcheck(ops.m_grouped_bf16_gemm_second_b.default, (s, w2, w2s, offs, True, m))
    dh = torch.randn(18, 2 * I).bfloat16()
    torch.library.opcheck(ops.m_grouped_bf16_gemm_second_b.default, (dh, w13, w13s, offs, False, m))
    dy = torch.randn(18, H).bfloat16()
    hh = torch.randn(18, 2 * I).bfloat16()
    route = torch.tensor(list(range(17)) + [-1], dtype=torch.int32)
    tw = torch.rand(17)
    outs = (torch.empty(18, 2 * I).bfloat16(), torch.empty(18, I).bfloat16(), torch.zeros(18, 1))
    torch.library.opcheck(ops.m_grouped_bf16_gemm_swiglu_bwd_into_.default,
                          (dy, w2, offs[: E + 1], hh, route, tw, *outs, 0.0))
    from prime_kernels.second_b import m_grouped_bf16_gemm_nt_second_b

    with pytest.raises(ValueError, match="chunks must be a positive int"):
        m_grouped_bf16_gemm_nt_second_b(s, w2, w2s, offs, chunks=0)
    with pytest.raises(Exception):  # 2 + 1 * 3 groups expected, the offsets have 4
        m_grouped_bf16_gemm_nt_second_b(s, w2, w2s, offs, chunks=3)


def test_status_lists_the_entry_as_verified():
    from prime_kernels import _status

    assert KEY in _status.KERNELS and KEY not in _status.unverified()


# --------------------------------------------------------------------------------------------- GPU


def _runnable_or_skip():
    from prime_kernels import _status

    why = _status.runnable(KEY)
    if why != _status.AVAILABLE:
        pytest.skip(f"{KEY} cannot run here: {why}")


@requires_sm90
@pytest.mark.parametrize("E,S,chunks,I,H,kind", [(8, 1, 1, 128, 256, "special"), (16, 2, 3, 192, 512, "skewed"),
                                                 (4, 1, 4, 64, 128, "hot"), (8, 2, 2, 256, 384, "skewed")])
def test_cuda_ops_equal_the_routed_ops_on_expanded_weights(E, S, chunks, I, H, kind):
    """Each second-B op on CUDA bit for bit the routed op on [w; expand_chunks(w_2)] (NaN-filled outputs), for the
    L1 (plain and gathered A, with and without a clamp), the L2 and the L1 dgrad; and the L2 dgrad with the SwiGLU
    backward as two launches into one set of outputs."""
    from prime_kernels.grouped_gemm import m_grouped_bf16_gemm_nn, m_grouped_bf16_gemm_nt, m_grouped_bf16_gemm_swiglu
    from prime_kernels.second_b import (expand_chunks, m_grouped_bf16_gemm_nn_second_b,
                                        m_grouped_bf16_gemm_nt_second_b, m_grouped_bf16_gemm_swiglu_second_b)

    _runnable_or_skip()
    gen = torch.Generator().manual_seed(E + chunks)
    sizes = group_sizes(E, kind, gen) + [300] * (S * chunks)
    w13, w2, w13s, w2s, x, offs = _problem(E, S, chunks, I, H, sizes, "cuda", seed=E)
    M = x.shape[0]
    w13_all = torch.cat([w13, expand_chunks(w13s, chunks, "w13")])
    w2_all = torch.cat([w2, expand_chunks(w2s, chunks, "w2")])
    index = torch.randperm(M, generator=gen).to(torch.int32).cuda()
    for clamp in (None, 0.75):
        for a_row_index in (None, index):
            poison_next_alloc(M * I, torch.bfloat16)
            s, h = m_grouped_bf16_gemm_swiglu_second_b(x, w13, w13s, offs, chunks=chunks, a_row_index=a_row_index,
                                                       save_h=True, clamp=clamp)
            s0, h0 = m_grouped_bf16_gemm_swiglu(x, w13_all, offs, a_row_index=a_row_index, save_h=True, clamp=clamp)
            torch.cuda.synchronize()
            assert torch.isfinite(s.float()).all() and torch.isfinite(h.float()).all()
            assert torch.equal(s, s0) and torch.equal(h, h0), (clamp, a_row_index is not None)
    poison_next_alloc(M * H, torch.bfloat16)
    o = m_grouped_bf16_gemm_nt_second_b(s, w2, w2s, offs, chunks=chunks)
    assert torch.isfinite(o.float()).all() and torch.equal(o, m_grouped_bf16_gemm_nt(s, w2_all, offs))
    dh = torch.randn(M, 2 * I, generator=gen).bfloat16().cuda()
    poison_next_alloc(M * H, torch.bfloat16)
    dx = m_grouped_bf16_gemm_nn_second_b(dh, w13, w13s, offs, chunks=chunks)
    assert torch.isfinite(dx.float()).all() and torch.equal(dx, m_grouped_bf16_gemm_nn(dh, w13_all, offs))
    # the L2 dgrad with the SwiGLU backward as two launches into one set of outputs (routed groups, then the shared
    # chunks on their expanded weight): the one launch over [w2; expanded] bit for bit
    from prime_kernels.grouped_gemm import m_grouped_bf16_gemm_swiglu_bwd
    from prime_kernels.second_b import m_grouped_bf16_gemm_swiglu_bwd_into

    dy = torch.randn(M, H, generator=gen).bfloat16().cuda()
    route = torch.randperm(M, generator=gen).to(torch.int32).cuda()
    route[::7] = -1  # padding rows
    tw = torch.rand(M, generator=gen).cuda()
    for clamp in (None, 0.75):
        got = (torch.full((M, 2 * I), float("nan"), device="cuda").bfloat16(),
               torch.full((M, I), float("nan"), device="cuda").bfloat16(),
               torch.zeros(M, -(-I // 128), device="cuda"))
        for w2_part, o in ((w2, offs[: E + 1]), (expand_chunks(w2s, chunks, "w2"), offs[E:])):
            m_grouped_bf16_gemm_swiglu_bwd_into(dy, w2_part, o, h, route, tw, got, clamp=clamp)
        want = m_grouped_bf16_gemm_swiglu_bwd(dy, w2_all, offs, h, route, tw, clamp=clamp)
        for name, a, b in zip(("dh", "aw", "dt_part"), got, want):
            assert torch.isfinite(a.float()).all() and torch.equal(a, b), (name, clamp)


@requires_sm90
def test_cuda_chunks_summed_are_the_shared_mlp():
    _runnable_or_skip()
    E, S, chunks, I, H, T = 8, 1, 4, 128, 256, 513
    sizes = [100, 0, 37, 400, 1, 0, 128, 9] + [T] * (S * chunks)
    w13, w2, w13s, w2s, x, offs = _problem(E, S, chunks, I, H, sizes, "cpu", seed=3)
    o = offs.tolist()
    for j in range(1, chunks):
        x[o[E + j]:o[E + j + 1]] = x[o[E]:o[E + 1]]
    got, want = _shared_mlp_through_chunks(*(t.cuda() for t in (w13, w2, w13s, w2s, x, offs)), E, S, chunks, 2.0)
    assert rel_err(got.cpu(), want.cpu().double()) < 2e-2
