"""The kernel registry: for every kernel x precision x arch, "available" or the exact reason."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

from . import _lib

AVAILABLE = "available"
# Which built arch values run on which compute capability ("a" targets: that exact one; "f": the family).
_ARCH_RUNS_ON = {"90a": {(9, 0)}, "100a": {(10, 0)}, "103a": {(10, 3)}, "100f": {(10, 0), (10, 3)}}
_FAMILY_ARCHS = {"sm90": ("90a",), "sm100": ("100a", "103a", "100f")}
_SUGGESTED = {(9, 0): "90a", (10, 0): "100a", (10, 3): "103a"}


@dataclass(frozen=True)
class KernelEntry:
    key: str          # "<kernel>.<precision>.<arch family>", the status() key
    compiled_as: str  # name in pk_compiled_kernels(), or "" when not implemented
    family: str       # "sm90" or "sm100"
    missing: str = ""  # non-empty: the kernel is not written yet (or cannot be), and why/where it is tracked
    # non-empty: the kernel is built and could run here but has not been verified on a GPU yet; this is its status()
    # reason in place of "available", so nothing that follows status() calls it (runnable() still says whether it
    # could run, for the tests that verify it)
    unverified: str = ""
    # non-empty: the kernel is verified on a GPU and could run here, but no layer chooses it, for the measured reason
    # given (e.g. slower than what runs instead); status() and reason() give this note in place of "available" as
    # for `unverified`, and runnable() says it could run (its own op, tests and benchmarks run it)
    withheld: str = ""
    # further kernels (names in pk_compiled_kernels()) the entry runs besides `compiled_as`: every one must be built
    # for an arch that runs here
    also_compiled: tuple[str, ...] = ()
    # non-empty: a torch function the entry runs (an attribute of the torch module), which this torch must have
    torch_function: str = ""
    # non-empty: where the entry can run, status() and reason() give "available: <this>" in place of "available",
    # with {arch} replaced by the built arch that runs here (is_available() reads both as available): what runs and
    # how far it was checked, for entries that run here with a caveat
    available_note: str = ""
    # set: what this torch can run on the device of compute capability cc, asked once everything else holds (None:
    # it can, else the reason), for entries that run a torch kernel narrower than the arches they are built for
    torch_check: Callable[[tuple[int, int]], str | None] | None = None

    # the kernel is a native one that runs only after proving itself on the device (prime_kernels.mega._selftest):
    # while no kernel is registered for the entry its reason is `missing`; once one is, its compiled name is the
    # registered one, and where it could run status() and reason() give its self-test verdict on the current device
    # (runnable() says whether it could run at all, for the self-test itself)
    self_tested: bool = False

    def kernels(self) -> tuple[str, ...]:
        return (self.compiled_as,) + self.also_compiled


def _entries() -> list[KernelEntry]:
    e: list[KernelEntry] = []
    for fam in ("sm90", "sm100"):
        e.append(KernelEntry(f"routing_plan.int32.{fam}", "routing_plan", fam))
        e.append(KernelEntry(f"combine.bf16.{fam}", "combine", fam))
        e.append(KernelEntry(f"dispatch_rows.bf16.{fam}", "dispatch_rows", fam))
        e.append(KernelEntry(f"swiglu.bf16.{fam}", "swiglu", fam))
        # the recipe's quantizing producers (prime_kernels.quantize), arch-neutral like the bf16 dispatch
        e.append(KernelEntry(f"dispatch_rows.fp8.{fam}", "dispatch_rows_fp8", fam))
        e.append(KernelEntry(f"quantize_tokens.fp8.{fam}", "quantize_tokens_fp8", fam))
    for name in ("m_grouped_gemm_nt", "m_grouped_gemm_nn", "m_grouped_gemm_nt_gather", "m_grouped_gemm_swiglu",
                 "m_grouped_gemm_swiglu_bwd", "k_grouped_gemm_tn"):
        compiled = name.replace("_gemm_", "_bf16_gemm_")
        e.append(KernelEntry(f"{name}.bf16.sm90", compiled, "sm90"))
    # the layer's weights in 128 x 128 tiles, once per optimizer step (fp8.quantize_weight)
    e.append(KernelEntry("quantize_weight.fp8.sm90", "quantize_weight_fp8", "sm90"))
    # their transposed copy for the dgrad GEMMs (fp8.QuantizedWeight.transposed), byte for byte
    e.append(KernelEntry("transpose_tiles.fp8.sm90", "transpose_tiles_fp8", "sm90"))
    e.append(KernelEntry("m_grouped_gemm_nt.fp8.sm90", "m_grouped_fp8_gemm_nt", "sm90"))
    e.append(KernelEntry("k_grouped_gemm_tn.fp8.sm90", "k_grouped_fp8_gemm_tn", "sm90"))
    # The FP8 L2 dgrad with the SwiGLU backward and the quantizing epilogue (prime_kernels.swiglu_bwd_fp8)
    e.append(KernelEntry("m_grouped_gemm_swiglu_bwd.fp8.sm90", "m_grouped_fp8_gemm_swiglu_bwd", "sm90"))
    # The FP8 L1 GEMM with the SwiGLU forward and the quantization of s (prime_kernels.swiglu_fwd_fp8)
    e.append(KernelEntry("m_grouped_gemm_swiglu.fp8.sm90", "m_grouped_fp8_gemm_swiglu", "sm90"))
    # Its instantiation with the activation clamp (F2 on the fp32 accumulators, the saved h's masked rounding F6)
    e.append(KernelEntry("m_grouped_gemm_swiglu_clamp.fp8.sm90", "m_grouped_fp8_gemm_swiglu", "sm90"))
    # The m-grouped BF16 GEMMs whose last groups read a second weight tensor (prime_kernels.second_b: shared experts as
    # extra groups of the routed experts' launch)
    e.append(KernelEntry("m_grouped_gemm_second_b.bf16.sm90", "m_grouped_bf16_gemm_second_b", "sm90"))
    # The BF16 layer with its shared experts inside the grouped pipeline's launches on those GEMMs
    # (prime_kernels.mega._shared_grouped)
    e.append(KernelEntry("mega_moe_shared.bf16.sm90", "m_grouped_bf16_gemm_second_b", "sm90",
                         also_compiled=("m_grouped_bf16_gemm_swiglu_bwd", "k_grouped_bf16_gemm_tn")))
    # Its forward on the fused BF16 kernel whose last groups read the shared weights (mega_moe_fwd_second_b_kernel)
    e.append(KernelEntry("mega_moe_shared_fused.bf16.sm90", "mega_moe_fwd_bf16_second_b", "sm90"))
    # The FP8 layer with its shared experts inside the routed launches (prime_kernels.mega._shared_fp8: the FP8 kernels
    # on the weights' FP8 copies with the shared chunks as experts after the routed ones)
    e.append(KernelEntry("mega_moe_shared.fp8.sm90", "mega_moe_fwd_fp8", "sm90",
                         also_compiled=("m_grouped_fp8_gemm_swiglu_bwd", "k_grouped_fp8_gemm_tn")))
    # The single-rank pipeline of our grouped GEMMs (prime_kernels.mega backend="grouped").
    e.append(KernelEntry("mega_moe_grouped.bf16.sm90", "m_grouped_bf16_gemm_swiglu", "sm90"))
    # The same pipeline with activation_clamp: its L1 saves h with the clamp masks (the m-grouped SwiGLU kernels'
    # kMaskedH variants), so its backward can take the clamp.
    e.append(KernelEntry("mega_moe_grouped_clamp.bf16.sm90", "m_grouped_bf16_gemm_swiglu", "sm90"))
    # Its FP8 forward (prime_kernels.mega._fp8_fwd): the quantizing dispatch, the FP8 L1 with SwiGLU, the FP8 L2
    # and the combine; the layer's forward for precision="fp8" until the fused FP8 forward exists.
    e.append(KernelEntry("mega_moe_grouped.fp8.sm90", "m_grouped_fp8_gemm_swiglu", "sm90"))
    # The same pipeline where our sm90 GEMMs cannot run: our arch-neutral kernels (csrc/common, built for every
    # requested arch) around torch's grouped GEMM (prime_kernels.grouped_gemm_torch), which has sm_100 kernels.
    e.append(KernelEntry(
        "mega_moe_grouped.bf16.sm100", "routing_plan", "sm100", also_compiled=("dispatch_rows", "swiglu", "combine"),
        torch_function="_grouped_mm",
        available_note="our routing plan, dispatch, SwiGLU and combine kernels, compiled for {arch}, around torch's "
                       "grouped GEMM (torch._grouped_mm) for the five bf16 GEMMs (prime_kernels.grouped_gemm_torch: "
                       "da and the weight gradients rounded to bf16); never run on Blackwell hardware, verified on "
                       "Hopper with torch's GEMMs forced"))
    # Its clamp: F6 keeps the clamp masks of the fp32 pre-activation, which torch's grouped GEMM (bf16 out) does not
    # give
    e.append(KernelEntry(
        "mega_moe_grouped_clamp.bf16.sm100", "", "sm100",
        missing="the grouped pipeline on torch's grouped GEMM takes no activation_clamp: keeping the clamp masks of "
                "the fp32 pre-activation (reference F6) needs an fp32 L1 output, and torch's grouped GEMM returns "
                "bf16"))
    # MXFP8 on Blackwell (docs/mxfp8.md): our quantization kernel, arch-neutral, and the grouped pipeline's forward
    # on torch's MXFP8 grouped GEMM (prime_kernels.mega._mxfp8)
    # Arch-neutral: the sm90 build's kernel runs bit for bit the reference on Hopper (tests/test_mxfp8_kernel.py);
    # the sm100 build's is the same source, compiled for a GPU nothing here has run
    e.append(KernelEntry("quantize.mxfp8.sm90", "quantize_mxfp8", "sm90"))
    e.append(KernelEntry(
        "quantize.mxfp8.sm100", "quantize_mxfp8", "sm100",
        unverified="built for sm_100 from the source that runs bit for bit the reference on Hopper; never run on "
                   "Blackwell hardware"))
    e.append(KernelEntry(
        "mega_moe_grouped.mxfp8.sm100", "quantize_mxfp8", "sm100",
        also_compiled=("routing_plan", "dispatch_rows", "swiglu", "combine"), torch_function="_scaled_grouped_mm",
        torch_check=_torch_mxfp8_grouped_reason,
        available_note="our routing plan, dispatch, MXFP8 quantization, SwiGLU and combine kernels, compiled for "
                       "{arch}, around torch's MXFP8 grouped GEMM (torch._scaled_grouped_mm) for the forward's L1 "
                       "and L2; the backward in bf16 on torch's grouped GEMM (prime_kernels.mega._mxfp8); never run "
                       "on Blackwell hardware (the quantization kernel is bit for bit the reference on Hopper): its "
                       "plumbing checked on the CPU with the GEMM emulated"))
    # Expert parallelism over peer memory (prime_kernels.mega._peer_ep): the epoch barriers, the fused forward that
    # reads its pool rows from their ranks and pushes its L2 rows back, the row moves of the backward.
    e.append(KernelEntry(
        "mega_moe_ep_peer.bf16.sm90", "mega_moe_fwd_bf16_ranks", "sm90", also_compiled=("ep_barrier", "peer_rows"),
        available_note="backend='fused' under a group whose ranks are NVLink peers; verified through its one-GPU "
                       "emulator on an H100 (forward and backward bit for bit EP = 1, bf16 and FP8, with per-rank "
                       "delays, 2,000 calls, CUDA-graph replay, a late rank; sanitizer-clean), never run on several "
                       "GPUs, so backend='auto' under a group runs the all-to-all path"))
    # The kernel backends (bf16) with H or I a multiple of 64 but not of 128: every kernel's last tile half-width
    e.append(KernelEntry("mega_moe_half_tiles.bf16.sm90", "mega_moe_fwd_bf16", "sm90"))
    # The FP8 kernel backends with H or I = 64 (mod 128): a 64-wide last scale block along H or I (the L2 dgrad's
    # and the dispatch's tail instantiations, the GEMMs' 64-wide last k-blocks); the layer refuses these shapes
    # for precision "fp8" / "fp8_bwd" where this entry is not available (_backend.alignment_reason)
    e.append(KernelEntry("mega_moe_half_tiles.fp8.sm90", "m_grouped_fp8_gemm_swiglu_bwd", "sm90"))
    todo = "not implemented yet"
    e += [
        KernelEntry("mega_moe.bf16.sm90", "mega_moe_fwd_bf16", "sm90"),
        # The fused backward (prime_kernels.mega._fused_bwd): L2 dgrad with the SwiGLU backward, L1 dgrad and the
        # weight gradients in one persistent kernel, between the dy dispatch and the dX combine.
        KernelEntry("mega_moe_backward.bf16.sm90", "mega_moe_bwd_bf16", "sm90",
                    withheld="verified on a GPU, but slower than the grouped pipeline's kernels it would replace "
                             "(docs/performance.md): the backward runs as the grouped pipeline of our kernels"),
        # The fused FP8 forward (dispatch with qK(x, 128), FP8 L1 with SwiGLU and qK(s, 64), FP8 L2 in one kernel)
        KernelEntry("mega_moe.fp8.sm90", "mega_moe_fwd_fp8", "sm90"),
        # The FP8 backward (prime_kernels.mega._fp8_bwd): the quantizing producers, the FP8 L2 dgrad with the SwiGLU
        # backward, the FP8 grouped GEMMs and the combine; its status is that of its last kernel to be verified.
        KernelEntry("mega_moe.fp8_bwd.sm90", "m_grouped_fp8_gemm_swiglu_bwd", "sm90"),
        # The fused FP8 dgrad (prime_kernels.swiglu_bwd_fp8.mega_moe_fp8_dgrad_fused): that backward's FP8 L2 dgrad
        # with the SwiGLU backward and its FP8 L1 dgrad in one persistent kernel, with their bits
        KernelEntry("mega_moe_backward.fp8.sm90", "mega_moe_bwd_fp8", "sm90",
                    withheld="verified on a GPU, but no faster than the two launches it would replace (0.99-1.06x "
                             "their time, docs/performance.md): the FP8 backward runs m_grouped_fp8_gemm_swiglu_bwd "
                             "and m_grouped_fp8_gemm_nt"),
        # The native fused forward on Blackwell: no Blackwell GPU has run it, so it is used on a device only after
        # its self-test there has agreed with the grouped pipeline. Its kernel comes from the registered candidate
        # (prime_kernels.mega._native_sm100, registered when the shim loads); `missing` is said only without one.
        KernelEntry("mega_moe.bf16.sm100", "", "sm100", "no native sm100 forward kernel is registered (prime_kernels"
                    ".mega._native_sm100 registers it when the torch shim loads)", self_tested=True),
        KernelEntry("mega_moe.mxfp8.sm100", "", "sm100", f"{todo} (Blackwell mxfp8)"),
    ]
    return e


@functools.lru_cache(maxsize=1)
def _torch_build_config() -> str:
    import torch

    try:
        return torch.__config__.show()
    except Exception:  # a torch without the build summary: read as built without the MXFP8 grouped kernels
        return ""


def _torch_mxfp8_grouped_reason(cc: tuple[int, int]) -> str | None:
    """None when torch's MXFP8 grouped GEMM runs on compute capability cc: torch's own test condition
    (PLATFORM_SUPPORTS_MXFP8_GROUPED_GEMM: a CUDA build with USE_MSLK, or its predecessor USE_FBGEMM_GENAI, and a
    device of capability exactly 10.0, the only one its CUTLASS kernel is compiled for); else why not."""
    import torch

    if torch.version.hip is not None:
        return f"torch {torch.__version__} is a ROCm build: its MXFP8 grouped GEMM here is the CUDA sm_100 one"
    config = _torch_build_config()
    if "USE_MSLK" not in config and "USE_FBGEMM_GENAI" not in config:
        return (f"torch {torch.__version__} was built without USE_MSLK (or USE_FBGEMM_GENAI): its "
                "torch._scaled_grouped_mm has no MXFP8 kernel")
    if cc != (10, 0):
        return (f"torch's MXFP8 grouped GEMM (torch._scaled_grouped_mm) runs on sm_100 (compute capability 10.0) "
                f"only, this device is sm_{cc[0]}{cc[1]}")
    return None


KERNELS: dict[str, KernelEntry] = {k.key: k for k in _entries()}


def _device_capability() -> tuple[int, int] | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_capability()
    except Exception:
        return None


def _current_cuda_device() -> int | None:
    """The current CUDA device once CUDA is initialised, else None."""
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    except Exception:
        return None


# (key, CUDA device, ignore_unverified) -> reason. Answers are remembered once CUDA is up (the build and the device cannot
# change within the process then): reason() is on every op's launch path, and status() on every
# prime_kernels.mega call's. Before that, and on CPU-only machines, each call asks afresh.
_answers: dict = {}


def is_available(why: str) -> bool:
    """Whether a status() / reason() answer says the kernel runs here: "available", or "available: <note>" (an entry
    with an ``available_note``)."""
    return why == AVAILABLE or why.startswith(AVAILABLE + ": ")


def reason(key: str) -> str:
    """"available" (or "available: <note>", see :func:`is_available`), or why kernel `key` cannot run here (for a
    kernel not yet verified on a GPU, that reason)."""
    return _cached(key, False)


def runnable(key: str) -> str:
    """As :func:`reason`, except that a built kernel not yet verified on a GPU (or withheld from the layers) is
    "available" where it could run: for the code that verifies or measures it, never for choosing what a layer
    runs."""
    return _cached(key, True)


def _cached(key: str, ignore_unverified: bool) -> str:
    dev = _current_cuda_device()
    slot = (key, dev, ignore_unverified)
    if dev is not None and slot in _answers:
        return _answers[slot]
    entry = KERNELS.get(key)
    if entry is not None and entry.self_tested:
        return _self_tested_reason(key, dev, ignore_unverified)
    why = _reason(key)
    if is_available(why) and (entry.unverified or entry.withheld) and not ignore_unverified:
        why = entry.unverified or entry.withheld
    if dev is not None:
        _answers[slot] = why
    return why


def _registered(key: str):
    """The native kernel registered for the self-tested entry ``key`` (prime_kernels.mega._selftest), or None."""
    if not _lib.load().shim_loaded:
        return None
    from .mega import _selftest  # noqa: PLC0415  (the layer package imports this module first)

    return _selftest.candidate(key)


def _self_tested_reason(key: str, dev: int | None, ignore_unverified: bool) -> str:
    """As _cached for an entry with ``self_tested``: whether its registered kernel could run here is remembered per
    device and kernel, its self-test verdict is asked afresh (it changes when the test runs)."""
    slot = (key, dev, True, id(_registered(key)))
    why = _answers.get(slot) if dev is not None else None
    if why is None:
        why = _reason(key)
        if dev is not None:
            _answers[slot] = why
    if ignore_unverified or not is_available(why):
        return why
    from .mega import _selftest  # noqa: PLC0415

    return _selftest.verdict_reason(key, dev)


def _reason(key: str) -> str:
    """Whether kernel `key` is built and can run here, whether or not it was verified (for a self-tested entry, the
    kernel registered for it)."""
    entry = KERNELS.get(key)
    if entry is None:
        raise KeyError(f"unknown kernel {key!r}; known: {', '.join(sorted(KERNELS))}")
    res = _lib.load()
    if res.reason is not None:
        return res.reason
    native = _registered(key) if entry.self_tested else None
    if native is not None:
        entry = replace(entry, compiled_as=native.compiled_as, missing="")
    if entry.missing:
        return entry.missing
    family_archs = _FAMILY_ARCHS[entry.family]
    compiled = _lib.compiled_kernels()
    built = [a for a in family_archs if all((k, a) in compiled for k in entry.kernels())]
    if not built:
        hint = "90a" if entry.family == "sm90" else "100a"
        if any(a in _lib.built_archs() for a in family_archs):
            absent = [k for k in entry.kernels() if not any((k, a) in compiled for a in family_archs)]
            which = f"our {', '.join(absent)} kernel(s) " if entry.also_compiled else ""
            return f"{which}not compiled into this build of {entry.family} (its sources were not part of it)"
        return (f"not built for {entry.family} (this build has {','.join(_lib.built_archs()) or 'no arches'}): "
                f"rebuild with PRIME_KERNELS_CUDA_ARCHS={hint}")
    if entry.torch_function:
        import torch

        if not hasattr(torch, entry.torch_function):
            return f"torch {torch.__version__} has no torch.{entry.torch_function}: upgrade torch"
    cc = _device_capability()
    if cc is None:
        return "no CUDA device"
    runs = [a for a in built if cc in _ARCH_RUNS_ON[a]]
    if runs and entry.torch_check is not None:
        why = entry.torch_check(cc)
        if why is not None:
            return why
    if runs:
        if entry.available_note:
            return f"{AVAILABLE}: {entry.available_note.format(arch=f'sm_{runs[0]}')}"
        return AVAILABLE
    want = _SUGGESTED.get(cc)
    if want is None or (want == "90a") != (entry.family == "sm90"):
        return f"device sm_{cc[0]}{cc[1]} cannot run this {entry.family} kernel"
    return f"device sm_{cc[0]}{cc[1]} needs a rebuild with PRIME_KERNELS_CUDA_ARCHS={want}"


# CUDA device -> the whole status() answer, once CUDA is up (as _answers): prime_kernels.mega resolves its backend
# through status() two or three times per layer call, and asking reason() per key costs ~20 device queries each.
_status_by_device: dict = {}


def status() -> dict[str, str]:
    """Every kernel x precision x arch: "available" or the exact reason it is not."""
    dev = _current_cuda_device()
    answer = _status_by_device.get(dev) if dev is not None else None
    if answer is None:
        answer = {key: reason(key) for key in KERNELS}
        if dev is not None:
            _status_by_device[dev] = answer
    answer = dict(answer)
    for key, entry in KERNELS.items():
        if entry.self_tested:  # its verdict changes once its self-test has run on the device
            answer[key] = reason(key)
    return answer


def unverified() -> dict[str, str]:
    """Kernels that are compiled but not yet verified on a GPU, with what is missing (status() gives that note in
    place of "available" where they could run)."""
    return {k.key: k.unverified for k in KERNELS.values() if k.unverified}


def withheld() -> dict[str, str]:
    """Kernels verified on a GPU that no layer chooses, with the reason (status() gives it in place of "available"
    where they could run)."""
    return {k.key: k.withheld for k in KERNELS.values() if k.withheld}


def require(key: str, *, allow_unverified: bool = False) -> None:
    """Raise RuntimeError with the status() reason unless kernel `key` can run here; with allow_unverified, a
    built kernel not yet verified on a GPU counts as able to run (its explicit op only, never a layer's choice)."""
    why = runnable(key) if allow_unverified else reason(key)
    if not is_available(why):
        raise RuntimeError(f"prime_kernels: {key} is not available: {why}")


def require_on(device, key_stem: str, op: str, *, allow_unverified: bool = False) -> None:
    """The check before an op that runs on CUDA and on the CPU: on CUDA, ``require`` of ``<key_stem>.<family of
    the tensor's device>`` (sm90 when the family is unknown; ``allow_unverified`` as there); on the CPU, the shim
    must be loaded."""
    if device.type == "cuda":
        require(f"{key_stem}.{family_of_device(device.index) or 'sm90'}", allow_unverified=allow_unverified)
        return
    res = _lib.load()
    if not res.shim_loaded:
        raise RuntimeError(f"prime_kernels: {op} is not available: {res.reason}")


def family_of_device(device_index: int | None = None) -> str | None:
    """'sm90' / 'sm100' for the current (or given) CUDA device, None otherwise."""
    try:
        import torch

        cc = torch.cuda.get_device_capability(device_index)
    except Exception:
        return None
    return {9: "sm90", 10: "sm100"}.get(cc[0])
