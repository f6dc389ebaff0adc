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

Shared experts: a MoE block whose forward is one that this module knows (the same code, compared by a fingerprint of
its source: Qwen2-MoE's, shared by Qwen3-Next, Qwen3.5-MoE and others, with its sigmoid-gated ``shared_expert``;
DeepSeek-V3's, shared by DeepSeek-V2, GLM-4.5-MoE, Kimi-Linear, Dots1 and others, with its ungated
``shared_experts``; and Flint's, ungated ``shared_expert`` on the flat tokens) and whose shared expert is a SwiGLU MLP
(``down_proj(silu(gate_proj(x)) * up_proj(x))`` over bias-free Linears, the gate a Linear with one output) gets a
:class:`MegaMoESharedExpert` as its ``forward``; its modules, keys and classes stay as they are. On every call where
the shared expert can run inside the routed experts' launches (``prime_kernels.mega._shared_ops.reason``: CUDA, one
rank, the shapes that path takes, its kernels available), the block routes as before and the routed experts'
``mega_moe`` call takes the shared expert (``shared_w13 = [gate_proj; up_proj]``, ``shared_w2 = down_proj``,
``shared_gate`` = the sigmoid gate on the same tokens), so the block has nothing left to add; on every other call
the block runs its own forward, transformers' code. Blocks of other forms (a routed scaling factor, a post norm, a
latent projection, an fp32 combine, ...) and other shared modules are left as they are.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
import tokenize
from dataclasses import dataclass
from io import StringIO
from typing import Callable, Optional

import torch
from torch import nn

from ..mega import _shared_ops, mega_moe
from ._common import PRECISIONS, UnsupportedLayerError, check_backend, check_precision, \
    compute_dtypes, fail, is_dtensor

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
    if is_dtensor(t):
        fail(where, "expert weights are DTensors inside the experts forward; run the model under transformers' "
                    "expert-parallel plan (which hands the experts their local shards) or unshard them")
    return t


def mega_moe_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    shared_expert: Optional["MegaMoESharedExpert"] = None,
) -> torch.Tensor:
    """The ``"prime_mega_moe"`` experts implementation (transformers' experts-interface signature).

    Uses the options :func:`apply` stored on the module (``backend``, ``precision``), else ``backend="auto"`` and
    ``precision="bf16"``. ``shared_expert``: passed by a block's :class:`MegaMoESharedExpert` forward on the calls
    where its shared expert runs inside this call (then the output includes it); transformers never passes it."""
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
    shared_args = shared_expert.mega_moe_args(hidden_states, io, wdt) if shared_expert is not None else {}
    y = mega_moe(hidden_states.to(io), idx, top_k_weights.to(wdt), w13.to(io), w2.to(io),
                 backend=backend, precision=precision, num_experts=E, **shared_args)
    return y.to(hidden_states.dtype)


# ------------------------------------------------------------------------------------------------
# Shared experts inside the routed experts' call
# ------------------------------------------------------------------------------------------------

_LAYOUT_TOKENS = frozenset((tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE))
_IGNORED_TOKENS = frozenset((tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER))


@functools.lru_cache(maxsize=None)
def code_fingerprint(fn: Callable) -> Optional[str]:
    """A hash of ``fn``'s source as tokens (comments, blank lines, line breaks inside brackets and the indentation
    width left out, so a reformatting keeps it and any change of code does not), or None where the source cannot be
    read. Token names rather than numbers: the numbers differ between Python versions."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        toks = [f"{tokenize.tok_name[t.type]} {'' if t.type in _LAYOUT_TOKENS else t.string}"
                for t in tokenize.generate_tokens(StringIO(src).readline) if t.type not in _IGNORED_TOKENS]
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):
        return None
    return hashlib.sha256("\n".join(toks).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SharedBlockLayout:
    """How a known MoE block forward computes: whether its router takes the flat tokens [T, H] ("flat") or the
    block's input as given ("input"), and the attributes of its shared MLP and of its sigmoid gate (None: ungated)."""

    router_input: str
    mlp: str
    gate: Optional[str]


#: MoE block forwards whose arithmetic :class:`MegaMoESharedExpert` reproduces, by :func:`code_fingerprint` (taken
#: from transformers 5.24). Each adds the shared MLP's output (times the sigmoid gate where there is one) to the
#: routed experts' output and nothing else: a forward that scales or normalises the routed output, projects it, or
#: sums in another dtype has another fingerprint and keeps its own forward.
SHARED_BLOCK_FORWARDS: dict[str, SharedBlockLayout] = {
    # Qwen2MoeSparseMoeBlock; the same code in Qwen3Next, Qwen3_5Moe, Qwen3OmniMoeTalkerText, Qwen4ExpText blocks
    "1a5260d851343946": SharedBlockLayout("flat", "shared_expert", "shared_expert_gate"),
    # DeepseekV3MoE; the same code in DeepseekV2Moe, DeepseekV32MoE, Glm4MoeMoE, Glm4MoeLiteMoE, Glm4vMoeTextMoE,
    # GlmMoeDsaMoE, KimiLinearMoE, Dots1MoE, ExaoneMoeSparseMoEBlock, Mistral4MoE, SolarOpenMoE and others
    "c0f60646ae025e27": SharedBlockLayout("input", "shared_experts", None),
    # FlintSparseMoeBlock and LaraMiniSparseMoeBlock: the shared expert ungated, on the flat tokens
    "4b73b5c55dafc9d0": SharedBlockLayout("flat", "shared_expert", None),
}

#: The SwiGLU MLP forward ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Qwen2MoeMLP, DeepseekV3MLP and the
#: other MLP classes written the same way), by :func:`code_fingerprint`.
SWIGLU_MLP_FORWARD = "27ba33fedb251f70"

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _swiglu_mlp(mlp: Optional[nn.Module], H: int) -> bool:
    """A shared MLP whose forward is transformers' SwiGLU with SiLU over plain bias-free Linears [Is, H], [Is, H] and
    [H, Is] in a float dtype (not DTensors): the computation that mega_moe's shared experts do."""
    if mlp is None or code_fingerprint(type(mlp).forward) != SWIGLU_MLP_FORWARD:
        return False
    if not _is_silu(getattr(mlp, "act_fn", None)):
        return False
    linears = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return False
    g, u, d = (m.weight for m in linears)
    if any(is_dtensor(w) or w.dtype not in _FLOAT_DTYPES for w in (g, u, d)):
        return False
    Is = g.shape[0]
    return list(g.shape) == [Is, H] and list(u.shape) == [Is, H] and list(d.shape) == [H, Is]


def _sigmoid_gate(gate: Optional[nn.Module], H: int) -> bool:
    return type(gate) is nn.Linear and gate.in_features == H and gate.out_features == 1


def _shared_layout(block: nn.Module, experts: nn.Module) -> Optional[SharedBlockLayout]:
    """The layout of ``block`` where its class forward is a known one around ``experts`` and its shared MLP (and gate)
    are what the routed call can take; else None."""
    if getattr(block, "experts", None) is not experts or not is_experts_module(experts):
        return None
    layout = SHARED_BLOCK_FORWARDS.get(code_fingerprint(type(block).forward))
    if layout is None:
        return None
    H = experts.gate_up_proj.shape[-1]
    if not _swiglu_mlp(getattr(block, layout.mlp, None), H):
        return None
    if layout.gate is not None and not _sigmoid_gate(getattr(block, layout.gate, None), H):
        return None
    return layout


def _runs_as_called(m: nn.Module) -> bool:
    """No hooks and no forward of the instance's own: reading the weights computes what calling the module would."""
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or "forward" in m.__dict__)


class MegaMoESharedExpert:
    """The forward of a MoE block with a SwiGLU shared expert (installed as the block's ``forward`` by :func:`apply`;
    the block keeps its modules, keys and class). On every call where the shared expert can run inside the routed
    experts' launches (:meth:`runs_inside`) it routes with the block's own router and the routed experts' mega_moe call
    takes the shared expert and its gate (:meth:`mega_moe_args`), so there is no sum left to do; on every other call
    it is the block class's own forward. The block's forward rather than a stand-in shared module that returns zeros:
    the block would still add those (and compute its gate to multiply them), passes over the activations for nothing."""

    def __init__(self, block: nn.Module, layout: SharedBlockLayout):
        self.block = block
        self.layout = layout

    def runs_inside(self, x2d: torch.Tensor) -> bool:
        """Whether this call's shared expert runs inside the routed experts' launches: the block's class forward
        still the one this reproduces, the experts still on :data:`NAME` without transformers' expert parallelism
        (whose sum over ranks would add the shared expert once per rank), the shared MLP still the SwiGLU it was with
        no hooks (the fused call reads its weights and calls none of its modules), and
        ``prime_kernels.mega._shared_ops.runs_inside`` for these tokens and shapes with the experts' backend and
        precision."""
        block = self.block
        experts = block.experts
        if _shared_layout(block, experts) != self.layout:
            return False
        if getattr(experts.config, "_experts_implementation", None) != NAME or getattr(experts, "_is_expert_parallel",
                                                                                       False):
            return False
        mlp = getattr(block, self.layout.mlp)
        if not all(_runs_as_called(m) for m in (mlp, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return False
        opts = getattr(experts, _OPTIONS_ATTR, None) or {}
        return _shared_ops.runs_inside(x2d, experts.gate_up_proj, mlp.gate_proj.weight.shape[0],
                                       backend=opts.get("backend", "auto"), precision=opts.get("precision", "bf16"))

    def mega_moe_args(self, x2d: torch.Tensor, io_dtype: torch.dtype, weight_dtype: torch.dtype) -> dict:
        """The shared expert's arguments of the routed experts' mega_moe call on the tokens ``x2d`` (the experts'
        input, the rows the block's gate would see), the gate in the routing weights' dtype."""
        mlp = getattr(self.block, self.layout.mlp)
        args = dict(shared_w13=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0).to(io_dtype),
                    shared_w2=mlp.down_proj.weight.to(io_dtype))
        if self.layout.gate is not None:
            gate = getattr(self.block, self.layout.gate)
            args["shared_gate"] = torch.sigmoid(gate(x2d)).reshape(x2d.shape[0]).to(weight_dtype)
        return args

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        block = self.block
        shape = hidden_states.shape
        x2d = hidden_states.view(-1, shape[-1])
        if not self.runs_inside(x2d):
            return type(block).forward(block, hidden_states)
        # the router gets what the block's own forward gives it: a router may read the shape
        _, weights, idx = block.gate(x2d if self.layout.router_input == "flat" else hidden_states)
        return block.experts(x2d, idx, weights, shared_expert=self).reshape(shape)

    def __repr__(self) -> str:
        gate = f", gate={self.layout.gate}" if self.layout.gate else ""
        return f"MegaMoESharedExpert({type(self.block).__name__}, mlp={self.layout.mlp}{gate})"


def _install_shared_forward(block: nn.Module, experts: nn.Module) -> None:
    """Give ``block`` (the parent of the switched ``experts``) a :class:`MegaMoESharedExpert` forward where
    :func:`_shared_layout` has one for it, and take back one installed earlier where it no longer has. A forward that
    someone else set on the instance (accelerate's hooks, say) is left alone: the fused forward would skip it."""
    current = block.__dict__.get("forward")
    if current is not None and not isinstance(current, MegaMoESharedExpert):
        return
    if current is not None:
        del block.forward
    layout = _shared_layout(block, experts)
    if layout is not None:
        block.forward = MegaMoESharedExpert(block, layout)


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

    A block holding switched experts and a SwiGLU shared expert in one of the forms listed in the module docstring
    gets a :class:`MegaMoESharedExpert` forward (``isinstance(block.forward, MegaMoESharedExpert)``), which hands the
    shared expert to the routed experts' call wherever it can run inside their launches; its modules and state-dict
    keys are unchanged.

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
    for name, m in found:
        if name:
            parent = model.get_submodule(name.rpartition(".")[0])
            _install_shared_forward(parent, m)
    return [name for name, _ in found]


register()

__all__ = ["NAME", "PRECISIONS", "apply", "register", "mega_moe_experts_forward", "check_experts_module",
           "is_experts_module", "MegaMoESharedExpert", "UnsupportedLayerError"]
