"""The FP8 weight cache (prime_kernels.mega.fp8.Fp8WeightCache) makes each weight's FP8 copy once per version of the
weight and optimizer step: reused between steps (micro-batches, the recomputed forward of checkpointing), made anew
after any torch.optim step, including a fused one, which updates the parameter without bumping its version counter."""

from __future__ import annotations

import pytest
import torch

from prime_kernels.mega.fp8 import Fp8WeightCache


def _weight():
    g = torch.Generator().manual_seed(0)
    return torch.nn.Parameter(torch.randn(2, 256, 128, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_of_any_optimizer_makes_the_copy_anew(fused):
    w = _weight()
    cache = Fp8WeightCache()
    first = cache.get(w)
    assert cache.get(w) is first and (cache.hits, cache.misses) == (1, 1)  # reused between steps
    try:
        opt = torch.optim.AdamW([w], lr=1e-1, fused=fused)
    except (RuntimeError, ValueError) as e:  # a torch without fused AdamW on this device
        pytest.skip(f"AdamW(fused={fused}) is not available here: {e}")
    w.grad = torch.ones_like(w)
    opt.step()  # fused: the update leaves w._version as it was (why every step empties the caches)
    assert len(cache) == 0  # the step freed the stale copies
    second = cache.get(w)
    assert second is not first and cache.misses == 2
    fresh = Fp8WeightCache().get(w)
    assert torch.equal(second.weight.data.view(torch.uint8), fresh.weight.data.view(torch.uint8))
    assert torch.equal(second.weight.scale, fresh.weight.scale)
    assert cache.get(w) is second  # and reused again until the next step


def test_empty_weight_caches_empties_every_live_cache():
    from prime_kernels.mega.fp8 import empty_weight_caches

    w = _weight()
    caches = [Fp8WeightCache(), Fp8WeightCache()]
    firsts = [c.get(w) for c in caches]
    empty_weight_caches()
    assert [len(c) for c in caches] == [0, 0]
    assert all(c.get(w) is not first for c, first in zip(caches, firsts))


def test_an_in_place_update_outside_an_optimizer_makes_the_copy_anew():
    w = _weight()
    cache = Fp8WeightCache()
    first = cache.get(w)
    with torch.no_grad():
        w.mul_(2)
    assert cache.get(w) is not first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2_scales", [False, True])
def test_weight_quantization_is_the_generic_blocks_bit_for_bit(monkeypatch, dtype, pow2_scales):
    """quantize_weight's path for whole 128 x 128 tiles (amax by reductions, quotients a few experts at a time)
    against quantize_blocks, the recipe's generic Q1-Q3: a zero block (scale 1), a block with one huge value, tiny
    values, several chunks; and the generic path where a block needs padding."""
    from prime_kernels.mega import fp8

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(5, 256, 384, generator=g) * torch.logspace(-8, 2, 384)).to(dtype)
    w[1, :128, :128] = 0
    w[2, 5, 7] = 3e4
    monkeypatch.setattr(fp8, "_WEIGHT_CHUNK_ELEMENTS", 2 * 256 * 384)  # 2 experts a chunk: 3 chunks
    got, want = fp8.quantize_weight(w, pow2_scales), fp8.quantize_blocks(w, 128, 128, pow2_scales)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale) and (got.block_rows, got.block_cols) == (128, 128)
    assert float(got.scale[1, 0, 0]) == 1.0
    odd = w[:, :192, :]
    got, want = fp8.quantize_weight(odd, pow2_scales), fp8.quantize_blocks(odd, 128, 128, pow2_scales)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(got.scale, want.scale)


def test_an_alias_of_the_weight_finds_its_copy():
    """The backward of a checkpointed call gets a detached alias of a saved parameter (another tensor object): it
    must reuse the parameter's copy, not quantize the weight again."""
    w = _weight()
    cache = Fp8WeightCache()
    first = cache.get(w)
    assert cache.get(w.detach()) is first and (cache.hits, cache.misses) == (1, 1)
    assert cache.get(w[:1]) is not first  # another view: another weight


def test_a_copy_made_for_an_alias_outlives_the_alias():
    """The FP8 backward after a bf16 forward (fp8_bwd) only ever sees aliases of a checkpointed parameter, a new one
    each step: the copy the first made must serve the next while the parameter lives, and go when it is freed."""
    import gc

    w = _weight()
    cache = Fp8WeightCache()
    first = cache.get(w.detach())
    gc.collect()
    assert cache.get(w.detach()) is first and len(cache) == 1
    del w
    gc.collect()
    assert len(cache) == 0


def _weights_to_quantize(device, num_mats=3, rows=256, cols=384):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(num_mats, rows, cols, generator=g) * torch.logspace(-6, 3, cols)
    w[0, :128, :128] = 0  # a zero tile: scale 1
    w[1, 3, 5] = 6e4      # one huge value in a tile
    return w.to(torch.bfloat16).to(device)


def _ops(device):
    from prime_kernels import _lib

    if _lib.load().core is None or not _lib.load().shim_loaded:
        pytest.skip(f"the native library is not loaded: {_lib.load().reason}")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("pow2_scales", [False, True])
def test_the_weight_quantizing_op_is_the_reference_bit_for_bit(device, pow2_scales):
    """quantize_weight_fp8_ (our kernel on CUDA, the host loop on the CPU) against quantize_blocks, the recipe's
    generic Q1-Q3, outputs NaN-filled first."""
    from prime_kernels.mega import fp8

    _ops(device)
    w = _weights_to_quantize(device)
    q = torch.full(w.shape, float("nan"), device=device).to(torch.float8_e4m3fn)
    scale = torch.full((w.shape[0], w.shape[1] // 128, w.shape[2] // 128), float("nan"), device=device)
    torch.ops.prime_kernels.quantize_weight_fp8_(w, q, scale, pow2_scales)
    want = fp8.quantize_blocks(w.cpu(), 128, 128, pow2_scales)
    assert torch.equal(q.cpu().view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(scale.cpu(), want.scale) and float(scale[0, 0, 0]) == 1.0


def test_the_weight_quantizing_op_refuses_partial_tiles():
    _ops("cpu")
    w = torch.zeros(1, 192, 128, dtype=torch.bfloat16)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(1, 1, 1)
    with pytest.raises(RuntimeError, match=r"multiples of 128 \(whole 128 x 128 tiles\)"):
        torch.ops.prime_kernels.quantize_weight_fp8_(w, q, scale, False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_tile_transposing_op_is_the_transpose_byte_for_byte(device):
    """transpose_tiles_fp8_ (our kernel on CUDA, the host loop on the CPU) against torch's transposed copy, every byte
    pattern present (NaN encodings included), the output NaN-filled first."""
    _ops(device)
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (3, 256, 384), generator=g, dtype=torch.uint8)
    q = raw.view(torch.float8_e4m3fn).to(device)
    qt = torch.full((3, 384, 256), float("nan"), device=device).to(torch.float8_e4m3fn)
    torch.ops.prime_kernels.transpose_tiles_fp8_(q, qt)
    assert torch.equal(qt.cpu().view(torch.uint8), raw.transpose(1, 2).contiguous())


def test_the_tile_transposing_op_refuses_bad_shapes():
    _ops("cpu")
    q = torch.zeros(1, 192, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"multiples of 128 \(whole 128 x 128 tiles\)"):
        torch.ops.prime_kernels.transpose_tiles_fp8_(q, torch.empty(1, 128, 192, dtype=torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match=r"qt must be a contiguous float8_e4m3fn \[L, C, R\]"):
        torch.ops.prime_kernels.transpose_tiles_fp8_(q, torch.empty(1, 192, 128, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_cached_transposed_copy_is_the_tiles_transposed(monkeypatch, device):
    """QuantizedWeight.transposed through the kernel (forced on where it runs) equals BlockQuantized.t()."""
    from prime_kernels.mega import fp8

    _ops(device)
    import prime_kernels.quantize as quantize

    runs = fp8._kernel_runs
    monkeypatch.setattr(fp8, "_kernel_runs", lambda stem, d: stem == "transpose_tiles.fp8" or runs(stem, d))
    ready = quantize._ready
    monkeypatch.setattr(quantize, "_ready", lambda stem, op, dev: None if stem == "transpose_tiles.fp8"
                        else ready(stem, op, dev))
    if device == "cpu":  # the kernel path is CUDA's; the CPU keeps torch's copy
        monkeypatch.setattr(fp8, "transpose_tiles_fp8", lambda q: pytest.fail("the CPU called the CUDA path"))
    w = _weights_to_quantize(device)
    got = fp8.QuantizedWeight(fp8.quantize_blocks(w, 128, 128)).transposed
    want = fp8.quantize_blocks(w, 128, 128).t()
    assert got.data.shape == want.data.shape and (got.block_rows, got.block_cols) == (want.block_rows, want.block_cols)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)
