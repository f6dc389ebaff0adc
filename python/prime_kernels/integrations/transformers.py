"""transformers (5.x) integration: the ``"prime_mega_moe"`` experts implementation.

transformers 5 routes the forward of every experts class decorated with
``@use_experts_implementation`` through a registry (``transformers.integrations.moe.ExpertsInterface``)
keyed by ``config._experts_implementation``; each entry is a function
``f(experts_module, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``
over the module's ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. Importing this module
registers :func:`mega_moe_experts_forward` there under :data:`NAME`.

Usage::

    import prime_kernels.integrations.transformers as pk_hf
    switched = pk_hf.apply(model)              # backend="auto"; returns the module names it switched
    pk_hf.apply(model, precision="fp8")        # the blockwise FP8 forward and backward (or "fp8_bwd")
    # or, at load time (after the import above; bf16):
    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="prime_mega_moe")

Mapping onto :func:`prime_kernels.mega.mega_moe`:

* ``gate_up_proj`` in transformers' concatenated layout is ``[gate rows; up rows]`` (the default
  gate function splits the projection with ``chunk(2)``: gate first), which is exactly mega's
  natural ``w13`` layout: the parameter is passed as is, no copy, no interleave.
* ``down_proj`` is ``w2``. Routing weights are applied in fp32 at the combine.
* Activations and weights are computed in bfloat16 (a differentiable cast when the model keeps
  fp32 weights; gradients flow back in the parameter's dtype). float64 models run the reference's
  exact mode (``backend="reference"`` only), which is how the tests check the mapping exactly.
* Under transformers' own expert parallelism the module holds its local experts and receives
  local ids, with off-rank routes marked by the sentinel id ``num_experts`` (weight 0): those
  become ``-1`` (masked) routes here.

Precision (``apply(..., precision=)``, passed to every call): "bf16" (default); "fp8", the blockwise e4m3 recipe
(1x128 activation and gradient scales, 128x128 weight tiles; docs/fp8.md) in the forward and the backward; "fp8_bwd",
the bf16 forward with that backward. The model keeps its bf16 parameters and the optimizer steps them as before: the
layer quantizes each weight itself and keeps the FP8 copy in its weight cache (``prime_kernels.mega.fp8.WEIGHT_CACHE``)
keyed on the parameter's version counter and emptied at every torch.optim step (fused optimizers such as
``AdamW(fused=True)`` leave the counter as it was), so a weight is quantized once per optimizer step, the recomputed
forward of activation checkpointing and every micro-batch of the step included. Keep the parameters in bf16: fp32
ones are cast on every call, and the cast copy is quantized again each time. A weight changed through ``.data``
outside an optimizer needs ``WEIGHT_CACHE.clear()``. FP8 needs H and I multiples of 64 on the kernel backends. Where
the FP8 kernels cannot run (no sm90 GPU), ``apply`` still switches the model and the first call raises the layer's
reason, as for bf16; ``backend="reference"`` runs the recipe's emulation on any device.

Supported: gated SiLU experts (``act_fn`` SiLU, transformers' default gate function), concatenated
``[gate; up]`` layout, non-transposed weights, no biases, no post-expert norm. Anything else raises
:class:`~prime_kernels.integrations.UnsupportedLayerError` naming the module and what is missing.
"""

from __future__ import annotations

import torch
from torch import nn

from ..mega import mega_moe
from ._common import PRECISIONS, UnsupportedLayerError, check_backend, check_precision, \
    compute_dtypes, fail

NAME = "prime_mega_moe"
_OPTIONS_ATTR = "_prime_mega_moe_options"
_CHECKED_ATTR = "_prime_mega_moe_checked"


def _hf_moe():
    try:
        import transformers.integrations.moe as hf_moe  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError("prime_kernels.integrations.transformers needs transformers>=5 "
                          "(pip install 'transformers>=5')") from exc
    if not hasattr(hf_moe, "ExpertsInterface"):
        raise ImportError("prime_kernels.integrations.transformers needs transformers>=5: this transformers has no "
                          "experts interface (transformers.integrations.moe.ExpertsInterface)")
    return hf_moe


def register() -> None:
    """Register :data:`NAME` in transformers' experts interface (idempotent; done at import)."""
    _hf_moe().ExpertsInterface.register(NAME, mega_moe_experts_forward)


def is_experts_module(module: nn.Module) -> bool:
    """True for modules built from a class decorated with transformers' ``@use_experts_implementation``."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated", "config"))


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    if type(act).__name__ == "SiLUActivation":
        return True
    return act is torch.nn.functional.silu


def check_experts_module(module: nn.Module, name: str = "") -> tuple[int, int, int]:
    """Raise :class:`UnsupportedLayerError` unless ``module`` can run on mega_moe; returns (E, H, I)."""
    where = f"{name or '<module>'} ({type(module).__name__})"
    if not is_experts_module(module):
        fail(where, "does not use transformers' experts interface (@use_experts_implementation), so its forward "
                    "cannot be switched; only experts classes decorated with it are supported")
    if not module.has_gate or getattr(module, "gate_up_proj", None) is None:
        fail(where, "non-gated experts (an up_proj with no gate) are not supported: mega_moe computes "
                    "down(silu(gate) * up)")
    if module.has_bias or any(getattr(module, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias")):
        fail(where, "expert biases (gate_up_proj_bias / down_proj_bias) are not supported: mega_moe has no bias terms")
    if module.is_transposed:
        fail(where, "transposed expert weights (is_transposed=True, gate_up_proj [E, H, 2I]) are not supported: "
                    "mega_moe needs gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
    if not module.is_concatenated:
        fail(where, "interleaved gate/up rows (is_concatenated=False) are not supported: mega_moe needs the "
                    "concatenated layout [gate rows; up rows]")
    if getattr(module, "has_post_expert_norm", False):
        fail(where, "a post-expert norm (has_post_expert_norm=True) is not supported")
    hf_moe = _hf_moe()
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None and gate_fn is not hf_moe._default_apply_gate:
        fail(where, "a custom gate function (_apply_gate, e.g. a clamped or alpha-scaled SwiGLU) is not supported: "
                    "only the default silu(gate) * up is")
    act = getattr(module, "act_fn", None)
    if act is None or not _is_silu(act):
        hidden_act = getattr(module.config, "hidden_act", None)
        fail(where, f"activation {type(act).__name__ if act is not None else None} (config.hidden_act="
                    f"{hidden_act!r}) is not supported: mega_moe implements SiLU-gated experts "
                    f"(hidden_act='silu') only")
    w13, w2 = module.gate_up_proj, module.down_proj
    floats = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    scales = [n for n, t in vars(module).get("_parameters", {}).items() if "scale" in n and t is not None]
    scales += [n for n, t in vars(module).get("_buffers", {}).items() if "scale" in n and t is not None]
    if w13.dtype not in floats or w2.dtype not in floats or scales:
        fail(where, f"quantized expert weights (gate_up_proj {w13.dtype}, down_proj {w2.dtype}"
                    f"{', scales ' + str(scales) if scales else ''}) are not supported: load the model in bf16/fp32")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        fail(where, f"gate_up_proj {list(w13.shape)} / down_proj {list(w2.shape)} are not [E, 2I, H] / [E, H, I]")
    E, twoI, H = w13.shape
    I = twoI // 2
    if list(w2.shape) != [E, H, I]:
        fail(where, f"down_proj must be [E, H, I] = {[E, H, I]} to match gate_up_proj {list(w13.shape)}, "
                    f"got {list(w2.shape)}")
    return E, H, I


def _local(t: torch.Tensor, where: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if isinstance(t, DTensor):
        fail(where, "expert weights are DTensors inside the experts forward; run the model under transformers' "
                    "expert-parallel plan (which hands the experts their local shards) or unshard them")
    return t


def mega_moe_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``"prime_mega_moe"`` experts implementation (transformers' experts-interface signature).

    Uses the options :func:`apply` stored on the module (``backend``, ``precision``), else ``backend="auto"`` and
    ``precision="bf16"``."""
    if not getattr(self, _CHECKED_ATTR, False):
        check_experts_module(self)
        setattr(self, _CHECKED_ATTR, True)
    opts = getattr(self, _OPTIONS_ATTR, None) or {}
    backend = opts.get("backend", "auto")
    precision = opts.get("precision", "bf16")
    where = type(self).__name__
    w13 = _local(self.gate_up_proj, where)
    w2 = _local(self.down_proj, where)
    E = w13.shape[0]
    io, wdt = compute_dtypes(hidden_states.dtype)
    idx = top_k_index.long()
    if getattr(self, "_is_expert_parallel", False):
        # transformers' EP marks routes to other ranks' experts with local id >= num_experts (weight 0)
        idx = torch.where(idx >= E, torch.full_like(idx, -1), idx)
    y = mega_moe(hidden_states.to(io), idx, top_k_weights.to(wdt), w13.to(io), w2.to(io),
                 backend=backend, precision=precision, num_experts=E)
    return y.to(hidden_states.dtype)


def _named_candidates(model: nn.Module):
    """Every module that holds routed experts: decorated experts classes, plus modules that look
    like experts (3-D gate_up_proj / up_proj / down_proj weights, or an ``experts`` ModuleList)
    but cannot be switched (reported, never skipped silently)."""
    for name, m in model.named_modules():
        if is_experts_module(m):
            yield name, m
            continue
        three_d = [p for p in ("gate_up_proj", "up_proj", "down_proj")
                   if isinstance(getattr(m, p, None), torch.Tensor) and getattr(m, p).dim() == 3]
        if three_d:
            yield name, m
        elif name.split(".")[-1] == "experts" and isinstance(m, nn.ModuleList):
            yield name, m


def apply(model: nn.Module, backend: str = "auto", precision: str = "bf16") -> list[str]:
    """Switch every experts module of ``model`` to the ``"prime_mega_moe"`` implementation.

    Args:
      model: a transformers ``PreTrainedModel`` (Qwen3-MoE, or any model whose experts class uses
        ``@use_experts_implementation`` with the same layout), or any ``nn.Module`` containing them.
      backend: "auto" (default: the fused kernels when ``prime_kernels.status()`` reports them, else
        the grouped-GEMM pipeline where it runs, else the reference only with
        ``PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK=1``), or "fused", "grouped", "reference"; passed to
        :func:`prime_kernels.mega.mega_moe` on every call.
      precision: "bf16" (default), "fp8" (blockwise FP8 forward and backward) or "fp8_bwd" (bf16 forward,
        FP8 backward); passed to :func:`prime_kernels.mega.mega_moe` on every call. The parameters stay
        bf16 (the module docstring says how the FP8 copies are kept); where the FP8 kernels cannot run,
        the first call raises the layer's reason.

    Returns the qualified names of the experts modules switched (all of them). Raises ValueError for a
    backend or precision not listed above, and :class:`UnsupportedLayerError` naming every module that
    cannot be switched, and when the model has no experts module at all; in each case before switching
    anything.
    """
    check_backend(backend)
    check_precision(precision)
    register()
    found = list(_named_candidates(model))
    if not found:
        raise UnsupportedLayerError(
            f"prime_kernels.integrations: {type(model).__name__} has no experts module (no class decorated with "
            f"transformers' @use_experts_implementation, no gate_up_proj/down_proj expert weights): nothing to switch")
    problems = []
    for name, m in found:
        try:
            check_experts_module(m, name)
        except UnsupportedLayerError as exc:
            problems.append(str(exc))
    if problems:
        raise UnsupportedLayerError(f"prime_kernels.integrations: {len(problems)} of {len(found)} experts modules cannot "
                                    f"run on prime_kernels.mega; nothing was switched:\n  " + "\n  ".join(problems))
    for _, m in found:
        setattr(m, _OPTIONS_ATTR, {"backend": backend, "precision": precision})
        setattr(m, _CHECKED_ATTR, True)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    for name, m in found:  # experts whose config the model-level switch did not reach
        if getattr(m.config, "_experts_implementation", None) != NAME:
            m.config._experts_implementation_internal = NAME
    missed = [name for name, m in found if getattr(m.config, "_experts_implementation", None) != NAME]
    if missed:
        raise RuntimeError(f"prime_kernels.integrations: could not switch {missed} to {NAME!r} "
                           f"(their config did not take experts_implementation)")
    return [name for name, _ in found]


register()

__all__ = ["NAME", "PRECISIONS", "apply", "register", "mega_moe_experts_forward", "check_experts_module",
           "is_experts_module", "UnsupportedLayerError"]
