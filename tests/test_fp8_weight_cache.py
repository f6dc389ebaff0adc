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
    opt.step()  # fused: the update leaves w._version as it was (why the cache counts optimizer steps)
    second = cache.get(w)
    assert second is not first and cache.misses == 2
    fresh = Fp8WeightCache().get(w)
    assert torch.equal(second.weight.data.view(torch.uint8), fresh.weight.data.view(torch.uint8))
    assert torch.equal(second.weight.scale, fresh.weight.scale)
    assert cache.get(w) is second  # and reused again until the next step


def test_an_in_place_update_outside_an_optimizer_makes_the_copy_anew():
    w = _weight()
    cache = Fp8WeightCache()
    first = cache.get(w)
    with torch.no_grad():
        w.mul_(2)
    assert cache.get(w) is not first
