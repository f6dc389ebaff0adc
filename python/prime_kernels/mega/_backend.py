"""The one call path of ``prime_kernels.mega``: which backend runs a call, per direction, and running it.

Every entry point (the custom ops behind :func:`~prime_kernels.mega.mega_moe` and :class:`~prime_kernels.mega.MegaMoE`,
and the DeepGEMM-shaped ``bf16_mega_moe`` / ``bf16_mega_moe_backward``) validates its inputs at its own boundary,
then calls :func:`resolve` for the direction it runs and :func:`forward` / :func:`backward` here, which call the
backend modules: :mod:`prime_kernels.mega._fused` ("fused"), :mod:`prime_kernels.mega._grouped` ("grouped") and
:mod:`prime_kernels.mega.reference` ("reference"). The pool capacity of a call is :func:`capacity`.

Rules (the same for every entry point):

* ``backend="reference"`` always runs the pure-PyTorch reference: bf16, and the FP8 recipe (``"fp8"``,
  ``"fp8_bwd"``) emulated as :mod:`prime_kernels.mega.reference` defines it (docs/fp8.md); it has no mxfp8.
* ``precision="fp8"`` / ``"fp8_bwd"`` run on a kernel backend only when both directions' kernels exist
  (:func:`fp8_kernel_reason`), so that a forward never succeeds ahead of a backward that cannot run.
  ``"fp8"``'s forward is the fused FP8 kernel on backend "fused" (and "auto" where it runs), the grouped FP8
  pipeline (:mod:`prime_kernels.mega._fp8_fwd`) on "grouped", with the same bits; ``"fp8_bwd"``'s is the bf16
  forward kernels; the backward of both, on either kernel backend, is the FP8 backward pipeline
  (:mod:`prime_kernels.mega._fp8_bwd`).
* ``backend="fused"`` runs the fused kernel, or raises the reason ``prime_kernels.status()`` gives.
* ``backend="grouped"`` runs the pipeline of our grouped-GEMM kernels (:mod:`prime_kernels.mega._grouped`,
  bf16, fp8 and fp8_bwd; one rank or expert-parallel), or raises the reason. On Blackwell its five bf16 GEMMs are
  torch's grouped GEMM around our other kernels (status key ``mega_moe_grouped.bf16.sm100``, :func:`grouped_keys`):
  bf16 without activation_clamp, and ``precision="mxfp8"`` (:mod:`prime_kernels.mega._mxfp8`, status key
  ``mega_moe_grouped.mxfp8.sm100``: the forward's two GEMMs on torch's MXFP8 grouped GEMM, which runs on sm_100
  only, the backward the bf16 one; one rank, no activation_clamp). On any other device "mxfp8" raises that key's
  reason before anything runs.
* ``backend="auto"`` runs the fused kernel when it is available, else the grouped pipeline where
  that is available; otherwise it falls back to the reference only when the
  environment variable ``PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK=1`` is set, with a one-time warning,
  and raises the reasons otherwise. Never silently.
* A forward with more local experts than the fused kernel takes (``FUSED_MAX_EXPERTS``) is a ValueError
  under ``backend="fused"`` and runs the grouped pipeline under ``"auto"`` (:func:`choose_backend` says why).
* The kernel backends take ``block_m`` in ``KERNEL_BLOCK_MS`` only: another value is a ValueError listing
  them whenever one of them would run (the reference takes any block_m up to ``MAX_BLOCK_M``).
"""

from __future__ import annotations

import warnings

import torch

from . import _fp8_bwd, _fp8_fwd, _fused, _grouped, _grouped_ep, _mxfp8, _peer_ep, _plan, _selftest, _validate, \
    reference
from .._status import KERNELS, is_available
from ..routing import pool_capacity
from ._validate import FusedKernelUnavailable
from .constants import (ALLOW_FALLBACK_ENV, env_flag, BACKENDS, FP8_ALIGN, FULL_TILE_ALIGN, FUSED_MAX_EXPERTS,
                        GROUPED_MAX_EXPERTS, HIDDEN_ALIGN, INTERMEDIATE_ALIGN, PRECISIONS)

# (precision, direction) -> kernel name in prime_kernels.status().
# "fp8_bwd" is a BF16 forward with an FP8 backward.
KERNEL_NAMES = {
    ("bf16", "fwd"): "mega_moe.bf16.sm90",
    ("bf16", "bwd"): "mega_moe_backward.bf16.sm90",
    ("fp8", "fwd"): "mega_moe.fp8.sm90",
    ("fp8", "bwd"): "mega_moe.fp8_bwd.sm90",
    ("fp8_bwd", "fwd"): "mega_moe.bf16.sm90",
    ("fp8_bwd", "bwd"): "mega_moe.fp8_bwd.sm90",
    ("mxfp8", "fwd"): "mega_moe.mxfp8.sm100",
    ("mxfp8", "bwd"): "mega_moe.mxfp8.sm100",
}

_NOT_IMPLEMENTED = "not implemented yet"
#: The precisions backend="reference" computes: bf16 and the emulated FP8 recipe.
REFERENCE_PRECISIONS = ("bf16",) + reference.FP8_PRECISIONS
_warned: set = set()


def _status() -> dict:
    try:
        import prime_kernels  # noqa: PLC0415  (lazy: the package imports before the lead's module lands)
    except Exception:  # pragma: no cover - only while the tree is half-built
        return {}
    fn = getattr(prime_kernels, "status", None)
    if fn is None:
        return {}
    try:
        return dict(fn())  # cheap: prime_kernels.status() remembers its answers once CUDA is up
    except Exception as exc:  # a broken status() is a reason, not a crash
        return {"__error__": f"prime_kernels.status() failed: {exc}"}


# current CUDA device -> "sm90" / "sm100" (a device's arch cannot change; get_device_capability costs a
# properties query, and every layer call asks two or three times)
_ARCH_BY_DEVICE: dict = {}


def _device_arch() -> str:
    """"sm100" on a Blackwell current device, else "sm90" (also without any GPU)."""
    try:
        if torch.cuda.is_available():
            dev = torch.cuda.current_device()
            arch = _ARCH_BY_DEVICE.get(dev)
            if arch is None:
                arch = "sm100" if torch.cuda.get_device_capability(dev)[0] == 10 else "sm90"
                _ARCH_BY_DEVICE[dev] = arch
            return arch
    except Exception:
        pass
    return "sm90"


def kernel_name(precision: str, direction: str) -> str:
    """The ``prime_kernels.status()`` key of the fused kernel for (precision, direction) on this device:
    the bf16 kernels have sm90 and sm100 variants; fp8/fp8_bwd are sm90, mxfp8 is sm100."""
    check_precision(precision)
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"prime_kernels.mega: direction must be 'fwd' or 'bwd', got {direction!r}")
    name = KERNEL_NAMES[(precision, direction)]
    if name.startswith(("mega_moe.bf16.", "mega_moe_backward.bf16.")) and _device_arch() == "sm100":
        name = name.replace(".sm90", ".sm100")
    return name


def _fused_reason(precision: str, direction: str) -> str | None:
    """None when the fused kernel for (precision, direction) is available, else the reason."""
    name = kernel_name(precision, direction)
    st = _status()
    if "__error__" in st:
        return st["__error__"]
    reason = st.get(name)
    if reason is None:
        return f"{name}: {_NOT_IMPLEMENTED}"
    if is_available(reason):
        return None
    return f"{name}: {reason}"


#: The expert-parallel path over peer memory (prime_kernels.mega._peer_ep): backend "fused" under a group.
PEER_KEY = "mega_moe_ep_peer.bf16.sm90"


#: Why "auto" under a group takes the all-to-all path even where the peer-memory path could run: the emulator proves
#: the peer path's protocol and bits on one GPU, but which of the two is faster on real NVLink (and whether the peer
#: path's reads and pushes hide under its tiles) is measured only on several GPUs.
AUTO_PEER_REASON = ("backend='auto' under a group runs the all-to-all path until the peer-memory path is measured on "
                    "several GPUs; backend='fused' runs it")


def _peer_reason(precision: str, activation_clamp: float | None, num_local_experts: int | None) -> str | None:
    """None when the peer-memory path can run this expert-parallel call (the group's NVLink domain is checked when its
    buffers are made), else why not. Its forward is our fused bf16 forward (or the grouped FP8 forward pipeline) and
    its backward the one-rank layer's pipeline on each rank's pool, so it needs those too."""
    if precision not in ("bf16", "fp8", "fp8_bwd"):
        return f"the peer-memory path runs bf16, fp8 and fp8_bwd (precision={precision!r})"
    why = _status().get(PEER_KEY, _NOT_IMPLEMENTED)
    if not is_available(why):
        return f"{PEER_KEY}: {why}"
    return _grouped_reason(precision, 1, activation_clamp, num_local_experts)


GROUPED_KEY = _grouped.STATUS_KEY
GROUPED_CLAMP_KEY = _grouped.CLAMP_STATUS_KEY
GROUPED_FP8_KEY = _fp8_fwd.STATUS_KEY
GROUPED_FP8_CLAMP_KEY = _fp8_fwd.CLAMP_STATUS_KEY
GROUPED_MXFP8_KEY = _mxfp8.STATUS_KEY


def grouped_keys() -> tuple[str, str]:
    """(the bf16 grouped pipeline's status key, its key with activation_clamp) on the current device: on Blackwell
    its GEMMs are torch's grouped GEMM (prime_kernels.grouped_gemm_torch.selected), which have entries of their own."""
    if _device_arch() == "sm100":
        return _grouped.TORCH_GEMMS_STATUS_KEY, _grouped.TORCH_GEMMS_CLAMP_STATUS_KEY
    return GROUPED_KEY, GROUPED_CLAMP_KEY


def fused_experts_reason(num_local_experts: int | None) -> str | None:
    """None when the fused forward kernel takes this many local experts, else why not."""
    if num_local_experts is not None and num_local_experts > FUSED_MAX_EXPERTS:
        return (f"{num_local_experts} local experts exceed the fused forward kernel's limit of "
                f"FUSED_MAX_EXPERTS={FUSED_MAX_EXPERTS} (prime_kernels.mega.constants)")
    return None


def _grouped_reason(precision: str, ep_size: int, activation_clamp: float | None = None,
                    num_local_experts: int | None = None) -> str | None:
    """None when the grouped pipeline can run this call, else why not."""
    bf16_key, clamp_key = grouped_keys()
    if precision == "mxfp8":
        return _grouped_mxfp8_reason(ep_size, activation_clamp, num_local_experts)
    if activation_clamp is not None:
        # Its L1 saves h with the clamp masks (reference F6) in the kMaskedH kernels, which have a status entry of
        # their own; plainly rounded, values within half an ulp of the bound would land on it and lose their
        # gradient (measured ~3% in dX).
        if precision == "fp8":  # the FP8 L1's clamp instantiation (F2 on its accumulators, F6's masked rounding)
            clamp_key = GROUPED_FP8_CLAMP_KEY
        clamp_reason = _status().get(clamp_key, _NOT_IMPLEMENTED)
        if not is_available(clamp_reason):
            return f"{clamp_key}: {clamp_reason}"
    if precision not in ("bf16", "fp8_bwd", "fp8"):
        return f"the grouped pipeline runs bf16, fp8 and fp8_bwd (precision={precision!r})"
    if num_local_experts is not None and num_local_experts > GROUPED_MAX_EXPERTS:
        return (f"{num_local_experts} local experts exceed the grouped GEMMs' limit of "
                f"GROUPED_MAX_EXPERTS={GROUPED_MAX_EXPERTS} (prime_kernels.mega.constants)")
    key = GROUPED_FP8_KEY if precision == "fp8" else bf16_key
    reason = _status().get(key, f"{_NOT_IMPLEMENTED}")
    return None if is_available(reason) else f"{key}: {reason}"


def _grouped_mxfp8_reason(ep_size: int, activation_clamp: float | None, num_local_experts: int | None) -> str | None:
    """None when the MXFP8 pipeline (:mod:`prime_kernels.mega._mxfp8`) can run this call, else why not: its status
    entry first (on a device other than sm_100 that is the whole answer), then the limits of the call."""
    reason = _status().get(GROUPED_MXFP8_KEY, _NOT_IMPLEMENTED)
    if not is_available(reason):
        return f"{GROUPED_MXFP8_KEY}: {reason}"
    if ep_size != 1:
        return "precision='mxfp8' runs on a single rank (its pipeline has no expert-parallel path)"
    if activation_clamp is not None:
        return ("precision='mxfp8' takes no activation_clamp (torch's MXFP8 grouped GEMM returns h in bf16; the clamp "
                "masks need the fp32 h)")
    if num_local_experts is not None and num_local_experts > GROUPED_MAX_EXPERTS:
        return (f"{num_local_experts} local experts exceed the grouped pipeline's limit of "
                f"GROUPED_MAX_EXPERTS={GROUPED_MAX_EXPERTS} (prime_kernels.mega.constants)")
    return None


def fp8_kernel_reason(precision: str, direction: str = "fwd") -> str | None:
    """For "fp8" and "fp8_bwd": None when the kernels of both directions are available, else why not: the reason of
    ``direction``'s kernels first, then the other's; None for every other precision. Both directions are asked for
    in either, so that a forward never runs on a kernel ahead of a backward that has none."""
    if precision not in reference.FP8_PRECISIONS:
        return None
    for d in (direction, "bwd" if direction == "fwd" else "fwd"):
        why = _fp8_direction_reason(precision, d)
        if why is not None:
            return f"precision={precision!r}: {why}"
    return None


def _fp8_direction_reason(precision: str, direction: str) -> str | None:
    """None when some kernel backend has the kernels of ``direction`` for an FP8 precision: the FP8 forward runs the
    fused kernel or the grouped FP8 pipeline, the others their one kernel entry."""
    why = _fused_reason(precision, direction)
    if why is None or (precision, direction) != ("fp8", "fwd"):
        return why
    grouped = _status().get(GROUPED_FP8_KEY, _NOT_IMPLEMENTED)
    if is_available(grouped):
        return None
    entry = KERNELS.get(kernel_name(precision, direction))
    if entry is not None and entry.missing:  # the fused kernel is not written: the pipeline's reason is the one
        return f"{GROUPED_FP8_KEY}: {grouped}"
    return f"{why}; {GROUPED_FP8_KEY}: {grouped}"


def _fp8_pipeline_reason(precision: str, ep_size: int, activation_clamp: float | None) -> str | None:
    """Why the FP8 backward pipeline cannot run this layer, asked before any forward runs (its own checks come
    after the forward); None when it can, and for the other precisions."""
    if precision not in reference.FP8_PRECISIONS:
        return None
    if activation_clamp is not None:  # a recompute runs the forward's L1 that saves h with the clamp masks
        clamp_key = GROUPED_FP8_CLAMP_KEY if precision == "fp8" else grouped_keys()[1]
        clamp_reason = _status().get(clamp_key, _NOT_IMPLEMENTED)
        if not is_available(clamp_reason):
            return f"precision={precision!r} with activation_clamp: {clamp_key}: {clamp_reason}"
    return None


def _kernel_forward_precision(precision: str) -> str:
    """The precision of the kernel forward that runs for ``precision``: "fp8_bwd" is the bf16 forward."""
    return "bf16" if precision == "fp8_bwd" else precision


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(
            f"prime_kernels.mega: precision must be one of {PRECISIONS}, got {precision!r}"
        )


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"prime_kernels.mega: backend must be one of {BACKENDS}, got {backend!r}")


def fallback_allowed() -> bool:
    return env_flag(ALLOW_FALLBACK_ENV)


def alignment_reason(hidden: int, intermediate: int, precision: str = "bf16") -> str | None:
    """None when H and I suit the kernel backends at ``precision``, else a one-line reason (the exact rule)."""
    if hidden % HIDDEN_ALIGN or intermediate % INTERMEDIATE_ALIGN:
        return (
            f"hidden={hidden} and intermediate={intermediate} must be multiples of "
            f"HIDDEN_ALIGN={HIDDEN_ALIGN} and INTERMEDIATE_ALIGN={INTERMEDIATE_ALIGN} "
            f"(prime_kernels.mega.constants) for the kernel backends; pad the weights or use "
            f"backend='reference'"
        )
    tails = hidden % FP8_ALIGN or intermediate % FP8_ALIGN
    if precision == "mxfp8" and tails:
        return (f"precision={precision!r}: hidden={hidden} and intermediate={intermediate} must be multiples of "
                f"FP8_ALIGN={FP8_ALIGN} (prime_kernels.mega.constants: the FP8 kernels' 128-wide scale blocks); "
                f"pad the weights, use precision='bf16', or backend='reference'")
    if precision in reference.FP8_PRECISIONS and tails:
        why = _status().get(FP8_TAILS_KEY, _NOT_IMPLEMENTED)
        if not is_available(why):
            return (f"precision={precision!r}: hidden={hidden} and intermediate={intermediate} are multiples of "
                    f"{HIDDEN_ALIGN} but not both of FP8_ALIGN={FP8_ALIGN}: {FP8_TAILS_KEY}: {why}; pad the weights "
                    f"to multiples of {FP8_ALIGN}, use precision='bf16', or backend='reference'")
    return None


#: The status entry of precision "fp8" / "fp8_bwd" on the kernel backends with H or I = 64 (mod 128): the kernels'
#: rule (multiples of 64, the last scale block 64 wide: prime_kernels.mega.reference), which the layer takes where
#: the entry says available (a GPU of the sm90 family with the kernels built).
FP8_TAILS_KEY = "mega_moe_half_tiles.fp8.sm90"


def fused_fp8_tails_reason(precision: str, direction: str, hidden: int | None,
                           intermediate: int | None) -> str | None:
    """Why the fused FP8 forward does not take this shape (it keeps whole 128-wide blocks), or None."""
    if precision != "fp8" or direction != "fwd" or hidden is None or intermediate is None:
        return None
    if not (hidden % FP8_ALIGN or intermediate % FP8_ALIGN):
        return None
    return (f"the fused FP8 forward takes hidden and intermediate multiples of FP8_ALIGN={FP8_ALIGN} (hidden={hidden}, "
            f"intermediate={intermediate}); the grouped FP8 pipeline takes multiples of {HIDDEN_ALIGN}")


HALF_TILES_KEY = "mega_moe_half_tiles.bf16.sm90"


def half_tiles_reason(hidden: int, intermediate: int) -> str | None:
    """For H or I a multiple of 64 but not of 128 (a half-width last tile in the kernels): None where its status entry
    says available, else why not; None for full tiles, and on Blackwell, where no GEMM of ours runs: the half tiles are
    our GEMM kernels' (there torch's grouped GEMM runs, which with our row kernels needs only the 16-byte aligned rows
    HIDDEN_ALIGN and INTERMEDIATE_ALIGN give, and the fused kernels are unavailable for their own reason)."""
    if not (hidden % FULL_TILE_ALIGN or intermediate % FULL_TILE_ALIGN) or _device_arch() == "sm100":
        return None
    why = _status().get(HALF_TILES_KEY, _NOT_IMPLEMENTED)
    if is_available(why):
        return None
    return (f"hidden={hidden} and intermediate={intermediate} are not both multiples of "
            f"FULL_TILE_ALIGN={FULL_TILE_ALIGN}: {HALF_TILES_KEY}: {why}")


def resolve_backend(backend: str, precision: str, direction: str, **shape) -> str:
    """Return "fused", "grouped" or "reference", or raise with the reason (see the module docstring); the
    keyword arguments are those of :func:`choose_backend`."""
    return choose_backend(backend, precision, direction, **shape)[0]


def _require_kernel_block_m(block_m) -> None:
    why = None if block_m is None else _validate.kernel_block_m_reason(block_m)
    if why is not None:
        raise ValueError(f"prime_kernels.mega: {why}")


def choose_backend(
    backend: str,
    precision: str,
    direction: str,
    *,
    device_type: str = "cuda",
    hidden: int | None = None,
    intermediate: int | None = None,
    ep_size: int = 1,
    activation_clamp: float | None = None,
    num_local_experts: int | None = None,
    block_m: int | None = None,
) -> tuple[str, str | None]:
    """(the backend that runs this call, why the fused kernel does not run it or None when it does), or raise
    with the reason. Shape limits of the kernels (H and I alignment, the fused kernel's expert count, block_m)
    are ValueErrors when a kernel backend was named; under "auto" a shape the fused kernel cannot take runs the
    grouped pipeline where that can, and a block_m the kernel backends do not take is a ValueError whenever one
    of them would run."""
    check_backend(backend)
    check_precision(precision)
    if backend == "reference":
        if precision not in REFERENCE_PRECISIONS:
            raise NotImplementedError(
                f"prime_kernels.mega: the reference implements precision {REFERENCE_PRECISIONS}; "
                f"precision={precision!r} has no reference numerics yet"
            )
        return "reference", "backend='reference' was asked for"

    if backend in ("fused", "grouped"):  # a named kernel backend: the call is wrong on any device
        _require_kernel_block_m(block_m)
    shaped = hidden is not None and intermediate is not None
    align = alignment_reason(hidden, intermediate, precision) if shaped else None
    if align is not None and backend == "fused":
        raise ValueError(f"prime_kernels.mega: {align}")
    align = align or (half_tiles_reason(hidden, intermediate) if shaped else None)
    too_many = fused_experts_reason(num_local_experts) if direction == "fwd" else None
    if too_many is not None and backend == "fused":
        raise ValueError(f"prime_kernels.mega: backend='fused' cannot run: {too_many}; use backend='auto' or "
                         f"'grouped' (the grouped pipeline takes up to {GROUPED_MAX_EXPERTS})")
    off_device = None if device_type == "cuda" else f"tensors are on {device_type}; the fused kernels need CUDA tensors"
    common = (fp8_kernel_reason(precision, direction) or _fp8_pipeline_reason(precision, ep_size, activation_clamp)
              or align or off_device)
    if backend == "grouped":
        why = common or _grouped_reason(precision, ep_size, activation_clamp, num_local_experts)
        if why is not None:
            raise FusedKernelUnavailable(f"prime_kernels.mega: backend='grouped' cannot run: {why}")
        return "grouped", "backend='grouped' was asked for"
    # under a group, "fused" is the peer-memory path (its own entry; its backward is the one-rank pipeline's)
    peer = None if ep_size == 1 else _peer_reason(precision, activation_clamp, num_local_experts)
    if (ep_size > 1 and backend == "auto" and peer is None and common is None
            and _grouped_reason(precision, ep_size, activation_clamp, num_local_experts) is None):
        peer = AUTO_PEER_REASON
    fused_tails = fused_fp8_tails_reason(precision, direction, hidden, intermediate)
    reason = common or too_many or fused_tails or (peer if ep_size > 1 else _fused_reason(precision, direction)
                                    or _fused.clamp_reason(kernel_name(precision, direction),
                                                                  activation_clamp))
    if reason is None:
        _require_kernel_block_m(block_m)
        return "fused", None
    if backend == "auto" and common is None:
        grouped_why = _grouped_reason(precision, ep_size, activation_clamp, num_local_experts)
        if grouped_why is None:
            _require_kernel_block_m(block_m)
            return "grouped", reason
        # both reasons: the fused kernel's alone would hide why the pipeline "auto" falls to cannot run (a clamp
        # where the grouped GEMMs take none, too many experts for both)
        reason = f"{reason}, and the grouped pipeline cannot run either: {grouped_why}"

    advice = (
        "use backend='reference', or set "
        f"{ALLOW_FALLBACK_ENV}=1 to let backend='auto' fall back to it"
    )
    if backend == "fused":
        raise FusedKernelUnavailable(
            f"prime_kernels.mega: no fused kernel for precision={precision!r} {direction}: {reason}; {advice}"
        )
    # backend == "auto"
    if precision not in REFERENCE_PRECISIONS:
        raise FusedKernelUnavailable(
            f"prime_kernels.mega: no fused kernel for precision={precision!r} {direction}: {reason}; "
            f"the reference has no {precision} numerics either"
        )
    if not fallback_allowed():
        raise FusedKernelUnavailable(
            f"prime_kernels.mega: no fused kernel for precision={precision!r} {direction}: {reason}; {advice}"
        )
    key = (precision, direction, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"prime_kernels.mega: falling back to the pure-PyTorch reference for {precision} {direction} "
            f"({reason}); it is slow. Unset {ALLOW_FALLBACK_ENV} to make this an error.",
            RuntimeWarning,
            stacklevel=4,
        )
    return "reference", reason


# ----------------------------------------------------------------------------------------------
# The call path every entry point shares
# ----------------------------------------------------------------------------------------------


def resolve(direction: str, backend: str, precision: str, x, w13, *, ep_size: int = 1, activation_clamp=None,
            block_m: int | None = None) -> str:
    """The backend that runs this call's ``direction`` ("fwd" or "bwd"), or raise with the reason: the shape
    arguments of :func:`resolve_backend` read from the (validated) tokens ``x [T, H]`` and ``w13 [El, 2I, H]``.
    The first eager forward on a device runs the self-test of the native kernels that could run there
    (:mod:`prime_kernels.mega._selftest`), so that the status() this resolution reads has their verdicts."""
    if direction == "fwd" and backend in ("auto", "fused") and ep_size == 1:
        _selftest.on_layer_call(x)
    return resolve_backend(backend, precision, direction, device_type=x.device.type, hidden=x.shape[1],
                           intermediate=w13.shape[1] // 2, ep_size=ep_size, activation_clamp=activation_clamp,
                           num_local_experts=w13.shape[0], block_m=block_m)


def capacity(num_tokens, top_k: int, num_local_experts: int, ep_size: int, max_tokens_per_rank, block_m: int):
    """Pool rows of a call (its plan tensors, h and the pooled rows have this many): the capacity of every route
    that can reach this rank's experts, T*K on one rank and R * max_tokens_per_rank * K under expert parallelism.
    A pure function of the shapes (SymInts included), so the fake kernels give the same sizes."""
    tmax = num_tokens if ep_size == 1 else max_tokens_per_rank
    return pool_capacity(ep_size * tmax, top_k, num_local_experts, block_m)


def empty_forward(x, topk_idx, w13, capacity: int, save_h: bool, keep_pooled_x: bool):
    """The forward's outputs for T = 0 on one rank: y [0, H], zero counts and offsets (every expert empty),
    all-padding pool rows, and zero h / x_pool rows where they are kept (the shapes the fake gives). No backend
    runs: the kernels take no empty operands."""
    H = x.shape[1]
    El, twoI = w13.shape[0], w13.shape[1]
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((0, H)), x.new_zeros((capacity if save_h else 0, twoI)), torch.zeros((El,), **i32),
            torch.zeros((El + 1,), **i32), torch.full((capacity,), -1, **i32), torch.full((capacity,), -1, **i32),
            torch.empty((0, topk_idx.shape[1]), **i32), x.new_zeros((capacity if keep_pooled_x else 0, H)))


def _gather_pool_rows(x, pool_src_route, top_k: int):
    """x rows in pool order (zero rows for padding), for backends whose forward does not keep them."""
    tok = _grouped._token_rows(pool_src_route, top_k)
    return x.index_select(0, tok.clamp(min=0).long()).masked_fill_((tok < 0)[:, None], 0)


def forward(which: str, x, topk_idx, topk_weights, w13, w2, *, precision: str, activation_clamp, group,
            num_experts: int, ep_size: int, max_tokens_per_rank, block_m: int, save_h: bool, buffer=None,
            keep_pooled_x: bool = False, num_sms: int = 0, ep_chunks: int = 1):
    """Run the forward on backend ``which`` (from :func:`resolve`) with validated inputs. Returns (y, h,
    expert_counts, expert_offsets, pool_src_route, pool_src_rank, route_to_pool, x_pool): x_pool holds the token
    rows in pool order [capacity, H] with ``keep_pooled_x`` (the fused forward keeps its dispatched rows, the
    other backends gather them), else [0, H]. T = 0 on one rank runs no backend (:func:`empty_forward`). The
    expert ids are checked before this returns, and so before the caller touches any memory of its own.
    ``ep_chunks``: under a group, the bf16 grouped path's chunk count (:mod:`prime_kernels.mega._ep_chunks`; the same
    bits for any count; the public calls' default is :mod:`prime_kernels.mega._ep_heuristics`), the same on every
    rank and in the backward."""
    T, K = topk_idx.shape
    cap = capacity(T, K, w13.shape[0], ep_size, max_tokens_per_rank, block_m)
    if T == 0 and ep_size == 1:
        return empty_forward(x, topk_idx, w13, cap, save_h, keep_pooled_x)
    # raises in finish() (see its docstring); the kernel backends hand it their plan's count
    ids = _validate.ExpertIdCheck(topk_idx, num_experts, which, from_plan=ep_size == 1)
    kwargs = dict(activation_clamp=activation_clamp, group=group, num_experts=num_experts,
                  max_tokens_per_rank=max_tokens_per_rank, block_m=block_m, capacity=cap, save_h=save_h)
    agreement = None
    if group is not None:  # checked at the plan's first collective, on every rank
        agreement = _plan.agreement_fields(x=x, w13=w13, precision=precision, backend=which,
                                           activation_clamp=activation_clamp, keep_pooled_x=keep_pooled_x,
                                           ep_chunks=ep_chunks)
    x_pool = None
    with torch.no_grad():
        if which == "fused":
            out = _fused.forward(x, topk_idx, topk_weights, w13, w2, precision=_kernel_forward_precision(precision),
                                 buffer=buffer, keep_x_pool=keep_pooled_x, id_check=ids, num_sms=num_sms, **kwargs)
            out, x_pool = out[:7], out[7]
        elif which == "grouped" and group is not None:
            out, pooled = _grouped_ep.forward(x, topk_idx, topk_weights, w13, w2, num_sms=num_sms,
                                              agreement=agreement, precision=_kernel_forward_precision(precision),
                                              chunks=ep_chunks, **kwargs)
            if keep_pooled_x:  # the rows came from every rank: only this forward has them
                x_pool = pooled
        elif which == "grouped" and precision == "mxfp8":
            out = _mxfp8.forward(x, topk_idx, topk_weights, w13, w2, id_check=ids, num_sms=num_sms, **kwargs)
        elif which == "grouped" and precision == "fp8":
            out = _fp8_fwd.forward(x, topk_idx, topk_weights, w13, w2, id_check=ids, num_sms=num_sms, **kwargs)
        elif which == "grouped":
            out = _grouped.forward(x, topk_idx, topk_weights, w13, w2, buffer=buffer, id_check=ids,
                                   num_sms=num_sms, **kwargs)
        else:
            out = reference.forward(x, topk_idx, topk_weights, w13, w2, precision=precision, agreement=agreement,
                                    **kwargs)
        if x_pool is None:
            x_pool = _gather_pool_rows(x, out[4], K) if keep_pooled_x else x.new_empty((0, x.shape[1]))
    ids.finish()
    return tuple(out) + (x_pool,)


def backward(which: str, dy, x, topk_idx, topk_weights, w13, w2, h, expert_counts, expert_offsets, pool_src_route,
             pool_src_rank, route_to_pool, *, precision: str, activation_clamp, group, num_experts: int,
             recompute: bool, need_wgrad: bool, dw13_accum=None, dw2_accum=None, buffer=None, x_pool=None,
             num_sms: int = 0, defer_wgrad: bool = False, ep_chunks: int = 1):
    """Run the backward on backend ``which`` (from :func:`resolve`) with validated inputs and the forward's plan.
    Returns (dx, d topk_weights, dw13, dw2); a weight gradient is None where it was not asked for or was added
    into its accumulation buffer. ``x_pool`` (the forward's pooled rows) is used when it covers the pool.

    ``defer_wgrad``: returns (dx, d topk_weights, a :class:`~prime_kernels.mega.deferred.WgradLater`) whose run adds
    the weight gradients into the accumulators later, bitwise as this call would have added them (the accumulators
    are not touched now). The bf16 kernel backends keep their weight-gradient GEMMs' operands; the others keep this
    call's inputs and run the same backward again, its data gradients discarded."""
    args = (dy, x, topk_idx, topk_weights, w13, w2, h, expert_counts, expert_offsets, pool_src_route,
            pool_src_rank, route_to_pool)
    if defer_wgrad:
        return _deferred_backward(which, args, precision=precision, activation_clamp=activation_clamp, group=group,
                                  num_experts=num_experts, recompute=recompute, buffer=buffer, x_pool=x_pool,
                                  num_sms=num_sms, ep_chunks=ep_chunks)
    kwargs = dict(activation_clamp=activation_clamp, group=group, num_experts=num_experts, recompute=recompute,
                  need_wgrad=need_wgrad, dw13_accum=dw13_accum, dw2_accum=dw2_accum)
    if x_pool is not None and x_pool.shape[0] == pool_src_route.shape[0] and x_pool.shape[0] > 0:
        kwargs["x_pool"] = x_pool
    with torch.no_grad():
        if which == "fused" and group is not None:
            return _peer_ep.layer_backward(*args, precision=precision, num_sms=num_sms, **kwargs)
        if which == "grouped" and group is not None:
            return _grouped_ep.backward(*args, num_sms=num_sms, precision=precision, chunks=ep_chunks, **kwargs)
        if which == "grouped" and precision == "mxfp8":
            return _mxfp8.backward(*args, num_sms=num_sms, **kwargs)
        if which in ("fused", "grouped") and precision in reference.FP8_PRECISIONS:
            return _fp8_bwd.backward(*args, precision=precision, num_sms=num_sms, **kwargs)
        if which == "fused":
            return _fused.backward(*args, precision=precision, buffer=buffer, num_sms=num_sms, **kwargs)
        if which == "grouped":
            return _grouped.backward(*args, buffer=buffer, num_sms=num_sms, **kwargs)
        return reference.backward(*args, precision=precision, **kwargs)


def _deferred_backward(which: str, args, *, precision, activation_clamp, group, num_experts, recompute, buffer, x_pool,
                       num_sms, ep_chunks=1):
    """:func:`backward` with ``defer_wgrad``."""
    from .deferred import WgradLater

    opts = dict(precision=precision, activation_clamp=activation_clamp, group=group, num_experts=num_experts,
                recompute=recompute, buffer=buffer, x_pool=x_pool, num_sms=num_sms)
    if which == "fused" and group is not None:
        raise FusedKernelUnavailable("prime_kernels.mega: the peer-memory expert-parallel path does not defer its "
                                     "weight gradients yet; use backend='grouped' for deferred weight gradients")
    if which in ("fused", "grouped") and precision == "bf16":
        pool = x_pool if x_pool is not None and x_pool.shape[0] == args[9].shape[0] and x_pool.shape[0] > 0 else None
        if which == "grouped" and group is not None:
            with torch.no_grad():
                return _grouped_ep.backward(*args, activation_clamp=activation_clamp, group=group,
                                            num_experts=num_experts, recompute=recompute, need_wgrad=False,
                                            x_pool=pool, num_sms=num_sms, defer_wgrad=True, chunks=ep_chunks)
        impl = _fused.backward if which == "fused" else _grouped.backward
        extra = dict(precision=precision) if which == "fused" else {}
        with torch.no_grad():
            return impl(*args, activation_clamp=activation_clamp, group=group, num_experts=num_experts,
                        recompute=recompute, need_wgrad=False, buffer=buffer, x_pool=pool, num_sms=num_sms,
                        defer_wgrad=True, **extra)
    dx, dtopk, _, _ = backward(which, *args, need_wgrad=False, **opts)

    def run(dw13_accum, dw2_accum):
        backward(which, *args, need_wgrad=False, dw13_accum=dw13_accum, dw2_accum=dw2_accum, **opts)

    return dx, dtopk, WgradLater(run, list(args) + [x_pool])
