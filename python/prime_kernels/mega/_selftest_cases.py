"""The shapes, inputs and agreement rules of the native kernels' self-test (:mod:`prime_kernels.mega._selftest`).

A candidate forward is compared with the grouped backend's forward (:func:`prime_kernels.mega._grouped.forward`, which
on Blackwell runs torch's grouped GEMM around our arch-neutral kernels) on the same inputs. The rules, per case:

* the plan outputs (expert counts and offsets, pool_src_route, pool_src_rank, route_to_pool) equal the reference's
  exactly: the backward reads h and the pooled rows through that plan;
* y [T, H] and h's rows within the experts' spans ([0, offsets[-1]), padding rows included: the backward's GEMMs read
  them) are finite, and for each, ``||out - ref|| / ||ref|| <= REL_TOL`` (Frobenius) and every row r has
  ``||out_r - ref_r|| / max(||ref_r||, rms) <= ROW_TOL``, rms the root mean square of ref's row norms (a zero row,
  such as a token whose routes are all masked, must stay near zero). Both sides round to bf16 from fp32
  accumulators summed in different orders: one-ulp flips give errors near 2^-9, far below the bounds, while one
  expert's rows computed from a wrong weight slice move its rows by O(1);
* x_pool, where the case asks the candidate to keep it, is None (the layer gathers the rows itself) or holds the
  token rows of the pool bit for bit;
* a repeat of the last case gives the same y and h bits (the layer is deterministic).

Before the candidate runs, free blocks of the caching allocator of the sizes it will ask for are filled with NaN
and the reference's outputs stay alive, so an output the candidate does not write reads as NaN, not as the
reference's values left in a reused block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..routing import pool_capacity
from .constants import BLOCK_M

REL_TOL = 1e-2
ROW_TOL = 3e-2


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    hidden: int
    intermediate: int
    tokens: int
    top_k: int
    routing: str        # "uniform": K distinct experts per token, uniformly; "skewed": see make_inputs
    masked: float = 0.0  # fraction of routes set to -1 (dropped)
    keep_x_pool: bool = False

    def label(self) -> str:
        return (f"{self.name} (E={self.experts}, H={self.hidden}, I={self.intermediate}, T={self.tokens}, "
                f"K={self.top_k}, {self.routing} routing{f', {self.masked:.0%} masked' if self.masked else ''})")


# Small enough that the whole test takes well under a second of GPU time; H and I multiples of 64 (the kernel
# backends' alignment), one of them not of 128 (a half-width last tile).
CASES: tuple[Case, ...] = (
    Case("one token", 4, 128, 128, 1, 2, "uniform"),
    Case("odd T", 8, 256, 128, 37, 4, "uniform", keep_x_pool=True),
    Case("skewed with an empty expert", 8, 128, 256, 129, 2, "skewed", masked=0.1),
    Case("half tiles", 6, 192, 64, 64, 2, "skewed", keep_x_pool=True),
    Case("one expert", 1, 128, 64, 5, 1, "uniform"),
    Case("many routes, masked", 16, 256, 256, 301, 8, "uniform", masked=0.05),
)


def make_inputs(case: Case, device: torch.device, seed: int) -> dict:
    """The layer's inputs for ``case``, from a generator of their own (the caller's random state is untouched).
    Skewed routing draws each token's experts without replacement with weights 2^-e, the last expert never: one
    expert takes most rows, another none."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    E, H, I, T, K = case.experts, case.hidden, case.intermediate, case.tokens, case.top_k
    if case.routing == "uniform":
        idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    else:
        p = torch.tensor([2.0 ** -e for e in range(E)])
        p[-1] = 0.0
        idx = torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)
    if case.masked:
        idx = idx.masked_fill(torch.rand(T, K, generator=g) < case.masked, -1)
    cpu = dict(
        x=torch.randn(T, H, generator=g).bfloat16(),
        topk_idx=idx.to(torch.int32),
        topk_weights=torch.rand(T, K, generator=g).softmax(dim=1),
        w13=(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16(),
        w2=(torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16(),
    )
    return {k: v.to(device) for k, v in cpu.items()}


def capacity(case: Case) -> int:
    return pool_capacity(case.tokens, case.top_k, case.experts, BLOCK_M)


def poison_free_blocks(device: torch.device, shapes: list[tuple[int, ...]]) -> None:
    """Fill free caching-allocator blocks of these bf16 shapes with NaN (see the module docstring); the CPU has no
    caching allocator, so nothing to do there."""
    if device.type != "cuda":
        return
    held = [torch.full(s, float("nan"), dtype=torch.bfloat16, device=device) for s in shapes if all(s)]
    del held


def _rel(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(Frobenius relative error, largest row error) as the module docstring defines them."""
    d = (out.float() - ref.float())
    r = ref.float()
    total = r.norm().item()
    rel = d.norm().item() / total if total > 0 else d.norm().item()
    if r.shape[0] == 0:
        return rel, 0.0
    row_ref = r.norm(dim=1)
    floor = max(row_ref.square().mean().sqrt().item(), 1e-30)
    row = (d.norm(dim=1) / row_ref.clamp(min=floor)).max().item()
    return rel, row


@dataclass
class Outcome:
    """One case: whether the candidate agreed, the measured errors, and what failed."""
    case: Case
    passed: bool
    errors: dict  # name -> (relative error, row error)
    why: str = ""

    def line(self) -> str:
        errs = ", ".join(f"{k} rel {a:.2e} row {b:.2e}" for k, (a, b) in self.errors.items())
        head = "pass" if self.passed else f"FAIL: {self.why}"
        return f"{self.case.label()}: {head}" + (f" [{errs}]" if errs else "")


_PLAN = ("expert_counts", "expert_offsets", "pool_src_route", "pool_src_rank", "route_to_pool")


def compare(case: Case, out, ref, inputs: dict) -> Outcome:
    """Check the candidate's forward outputs ``out`` (8: y, h, the plan's five, x_pool) against the reference's
    ``ref`` (its first 7) by the rules of the module docstring."""
    if not isinstance(out, (tuple, list)) or len(out) != 8:
        return Outcome(case, False, {}, f"returned {type(out).__name__}, not the 8 outputs of the fused forward")
    for name, a, b in zip(_PLAN, out[2:7], ref[2:7]):
        if a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            return Outcome(case, False, {}, f"{name} differs from the grouped pipeline's plan")
    errors: dict = {}
    span = int(ref[3][-1].item())
    for name, a, b in (("y", out[0], ref[0]), ("h", out[1][:span], ref[1][:span])):
        if a.shape != b.shape or a.dtype != b.dtype:
            return Outcome(case, False, errors,
                           f"{name} is {a.dtype} {tuple(a.shape)}, want {b.dtype} {tuple(b.shape)}")
        if not bool(torch.isfinite(a).all()):
            return Outcome(case, False, errors, f"{name} has NaN or Inf ({int((~torch.isfinite(a)).sum())} values)")
        errors[name] = _rel(a, b)
        rel, row = errors[name]
        if rel > REL_TOL:
            return Outcome(case, False, errors, f"{name} relative error {rel:.3e} > {REL_TOL:.0e}")
        if row > ROW_TOL:
            return Outcome(case, False, errors, f"{name} row error {row:.3e} > {ROW_TOL:.0e}")
    if out[1].shape != ref[1].shape:
        return Outcome(case, False, errors, f"h is {tuple(out[1].shape)}, want {tuple(ref[1].shape)}")
    x_pool = out[7]
    if case.keep_x_pool and x_pool is not None:
        src = ref[4][:span].long()
        want = inputs["x"].index_select(0, (src.clamp(min=0) // case.top_k)).masked_fill((src < 0)[:, None], 0)
        if x_pool.shape[0] < span or not torch.equal(x_pool[:span], want):
            return Outcome(case, False, errors, "x_pool does not hold the token rows of the pool")
    return Outcome(case, True, errors)
