"""The ``ep_chunks`` option of mega_moe / MegaMoE: its default count's rule, the checks that refuse a count where no
chunked exchange runs (before any launch or collective, on every rank), and, through the public call over a loopback
group on one GPU, chunked calls equal to the one-chunk call bit for bit."""

from __future__ import annotations

import pytest
import torch

from test_mega_ep_grouped import E, H, I, K, _problem


def test_default_count_follows_the_rule():
    from prime_kernels.mega import _ep_heuristics as h

    # with the measured extra glue no count can save anything: one chunk
    assert h.chunks_that_pay() == 1
    assert h.default_ep_chunks(ep_size=8, backend="auto", precision="bf16") == h.chunks_that_pay()
    # the rule's answers where glue is cheap: the count with the largest margin, more chunks as glue gets cheaper
    assert h.chunks_that_pay(0.5) == 1
    assert h.chunks_that_pay(0.3) == 2
    assert h.chunks_that_pay(0.1) == 4
    assert h.chunks_that_pay(0.01) == 8
    # nothing to chunk: one rank, FP8, the reference
    assert h.default_ep_chunks(ep_size=1, backend="grouped", precision="bf16") == 1
    assert h.default_ep_chunks(ep_size=4, backend="grouped", precision="fp8") == 1
    assert h.default_ep_chunks(ep_size=4, backend="reference", precision="bf16") == 1


def _layer_inputs(T=6, seed=0):
    x, idx, w, w13, w2, dy = _problem((T,), "uniform", 0.0, seed)
    return x, idx, w, w13, w2


@pytest.mark.parametrize("bad", [0, -1, 65, True, 2.0, "2"])
def test_bad_counts_raise(bad):
    from prime_kernels.mega import mega_moe

    x, idx, w, w13, w2 = _layer_inputs()
    with pytest.raises((ValueError, TypeError), match="ep_chunks"):
        mega_moe(x, idx, w, w13, w2, backend="grouped", ep_chunks=bad)


def test_chunks_without_a_group_raise():
    from prime_kernels.mega import MegaMoE, mega_moe

    x, idx, w, w13, w2 = _layer_inputs()
    with pytest.raises(ValueError, match="without a group"):
        mega_moe(x, idx, w, w13, w2, backend="grouped", ep_chunks=2)
    assert torch.equal(mega_moe(x, idx, w, w13, w2, backend="reference", ep_chunks=1),
                       mega_moe(x, idx, w, w13, w2, backend="reference"))
    with pytest.raises(ValueError, match="without a group"):
        MegaMoE(E, H, I, K, backend="grouped", ep_chunks=2)


@pytest.mark.parametrize("backend, precision, match", [("reference", "bf16", "grouped backend"),
                                                       ("grouped", "fp8", "one chunk")])
def test_chunks_where_none_run_raise_on_every_rank(backend, precision, match):
    from prime_kernels.mega import LoopbackGroup, mega_moe

    world = 2
    group = LoopbackGroup(world, timeout_s=30)
    x, idx, w, w13, w2 = _layer_inputs(T=8)
    El = E // world

    def rank_fn(r):
        with pytest.raises(ValueError, match=match):
            mega_moe(x[4 * r:4 * r + 4], idx[4 * r:4 * r + 4], w[4 * r:4 * r + 4], w13[r * El:(r + 1) * El],
                     w2[r * El:(r + 1) * El], group=group, backend=backend, precision=precision, ep_chunks=2,
                     max_tokens_per_rank=4)
        return True

    assert group.run(rank_fn) == [True, True]


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_call_equals_one_chunk_bitwise(chunks):
    """mega_moe's forward with ep_chunks over a 2-rank loopback group on one GPU (ranks on their own streams; the
    loopback runs no autograd across its threads, so the backward's chunks are the loopback tests' part)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the grouped backend's public path takes CUDA tensors)")
    from mega_helpers import skip_unless_available

    skip_unless_available("mega_moe_grouped.bf16.sm90")
    from prime_kernels.mega import LoopbackGroup, mega_moe

    world, tokens = 2, (9, 5)
    El = E // world
    x, idx, w, w13, w2, dy = (t.cuda() for t in _problem(tokens, "skewed", 0.1, 3))

    def run(ep_chunks):
        group = LoopbackGroup(world, timeout_s=60)

        def rank_fn(r):
            lo = sum(tokens[:r])
            sl = slice(lo, lo + tokens[r])
            with torch.no_grad():
                return mega_moe(x[sl], idx[sl], w[sl], w13[r * El:(r + 1) * El].contiguous(),
                                w2[r * El:(r + 1) * El].contiguous(), group=group, backend="grouped",
                                ep_chunks=ep_chunks, max_tokens_per_rank=max(tokens))

        return group.run(rank_fn, device="cuda")

    want, got = run(1), run(chunks)
    for r in range(world):
        assert torch.equal(got[r], want[r]), f"chunks={chunks} rank {r}"
