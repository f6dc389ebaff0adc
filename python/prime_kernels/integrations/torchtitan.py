"""TorchTitan integration: run the routed experts of TorchTitan's ``MoE`` layers on ``prime_kernels.mega``.

TorchTitan (0.3.x) builds each MoE layer as ``MoE(router, routed_experts, shared_experts)``, where
``routed_experts`` (``RoutedExperts``) dispatches tokens (``token_dispatcher``), runs the grouped
GEMMs (``inner_experts``: ``GroupedExperts`` with ``w1_EFD``/``w3_EFD [E, F, D]`` and
``w2_EDF [E, D, F]``) and combines them, applying the router scores in the combine.
:func:`apply` replaces every ``routed_experts`` by :class:`MegaMoERoutedExperts`, which does
dispatch, experts and combine in one :func:`prime_kernels.mega.mega_moe` call with the same forward
signature, so ``MoE.forward`` (router, load-balancing counters, the sum with the shared experts) is unchanged::

    import prime_kernels.integrations.torchtitan as pk_tt
    switched = pk_tt.apply(model)          # backend="auto"; names of the MoE layers switched
    pk_tt.apply(model, precision="fp8")    # the blockwise FP8 forward and backward (or "fp8_bwd")

``precision`` ("bf16" default, "fp8", "fp8_bwd") is passed to every ``mega_moe`` call, as the transformers
adapter does (its module docstring says how the FP8 weight copies are kept: quantized once per optimizer step).

Weights: w1 (gate) and w3 (up) are fused once into one parameter ``w13 [E, 2F, D]`` (rows
[0, F) = w1, [F, 2F) = w3: mega's natural layout), keeping the parameters' dtype and device
(meta included); ``w2_EDF`` is the original parameter object. Checkpoints keep TorchTitan's keys:
``state_dict()`` presents ``w1_EFD`` and ``w3_EFD`` as views of ``w13`` (in-place loads, e.g.
DCP, write through them) and ``load_state_dict`` accepts them. ``init_states()`` applies the
original ``w1_EFD``/``w3_EFD``/``w2_EDF`` initialisers to the fused halves.

Shared experts: a layer's ``shared_experts`` that is TorchTitan's plain ``FeedForward`` (w1/w2/w3, no biases) or
``SigmoidGatedFeedForward`` (its ``gate`` one output per token) becomes :class:`MegaMoESharedExperts`, the same
Linear modules under the same keys. On every call where the shared experts can run inside the routed experts'
launches (``prime_kernels.mega._shared_ops.reason``: CUDA, one rank, the shapes that path takes, its kernels
available), the routed experts' ``mega_moe`` call takes them (``shared_w13 = [w1; w3]``, ``shared_w2 = w2``,
``shared_gate`` = the sigmoid gate) and the shared module returns nothing for ``MoE.forward`` to add; on every other
call the shared module computes its FeedForward as TorchTitan does. Other shared-expert modules are left as they are.

Numerics: tokens and weights are cast to bfloat16 as TorchTitan's grouped-mm experts do (fp32
master weights get fp32 gradients), router scores are applied in fp32 at the combine; the output
has the input's dtype. float64 inputs run the reference's exact mode (``backend="reference"``).

Refused with :class:`~prime_kernels.integrations.UnsupportedLayerError` (nothing is switched):
router scores applied before the experts (``score_before_experts``), experts other than the
plain SiLU-gated ``GroupedExperts`` (GPT-OSS biases/clamped SwiGLU, the interleaved
``FusedGroupedExperts``, Float8/MXFP8 converted experts), expert parallelism through TorchTitan's
dispatchers (all-to-all with an EP mesh, DeepEP, HybridEP: apply before ``parallelize`` and
without EP), parameters that are already DTensors (apply before FSDP/TP), and MoE layouts of
other TorchTitan versions (no ``routed_experts``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..mega import _shared_ops, mega_moe
from ._common import UnsupportedLayerError, check_backend, check_precision, compute_dtypes, fail, is_dtensor

try:
    from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
    from torchtitan.models.common.moe import MoE, GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    from torchtitan.protocols.module import Module as _TitanModule
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("prime_kernels.integrations.torchtitan needs torchtitan (tested with torchtitan==0.3.0; "
                      "its models.common.moe MoE / RoutedExperts / GroupedExperts layout)") from exc


class MegaMoEGroupedExperts(_TitanModule):
    """The experts' weights in mega's layout: ``w13 [E, 2F, D]`` (w1 rows then w3 rows) and
    ``w2_EDF [E, D, F]``; no forward of its own (``MegaMoERoutedExperts`` uses them)."""

    def __init__(self, w13: nn.Parameter, w2_EDF: nn.Parameter, param_init: Optional[dict] = None):
        nn.Module.__init__(self)
        self.num_experts = w13.shape[0]
        self.hidden_dim = w13.shape[1] // 2
        self.dim = w13.shape[2]
        self.w13 = w13
        self.w2_EDF = w2_EDF
        self._titan_param_init = dict(param_init) if param_init else None
        self.register_state_dict_post_hook(_split_w13_on_save)
        self.register_load_state_dict_pre_hook(_merge_w13_on_load)

    def _init_self_parameters(self) -> None:
        """TorchTitan's init_states: the original w1/w3/w2 initialisers on the fused halves."""
        init = self._titan_param_init
        if init is None:
            raise ValueError("MegaMoEGroupedExperts: the replaced GroupedExperts had no param_init; initialise "
                             "w13 / w2_EDF yourself or load a checkpoint")
        F = self.hidden_dim
        with torch.no_grad():
            init["w1_EFD"](self.w13[:, :F])
            init["w3_EFD"](self.w13[:, F:])
            init["w2_EDF"](self.w2_EDF)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim} (w13 = [w1; w3])"


def _split_w13_on_save(module, state_dict, prefix, local_metadata):
    w13 = state_dict.pop(prefix + "w13", None)
    if w13 is None:
        return
    F = w13.shape[1] // 2
    state_dict[prefix + "w1_EFD"] = w13[:, :F]
    state_dict[prefix + "w3_EFD"] = w13[:, F:]


def _merge_w13_on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs):
    k1, k3 = prefix + "w1_EFD", prefix + "w3_EFD"
    if k1 in state_dict and k3 in state_dict:
        state_dict[prefix + "w13"] = torch.cat([state_dict.pop(k1), state_dict.pop(k3)], dim=1)


class MegaMoESharedExperts(_TitanModule):
    """A layer's shared SwiGLU expert (TorchTitan's ``FeedForward`` or ``SigmoidGatedFeedForward``) with the same
    Linear children (``w1``, ``w2``, ``w3``, and ``gate`` when gated, so the same state-dict keys and initialisers),
    whose work the layer's :class:`MegaMoERoutedExperts` takes into its ``mega_moe`` call where it can run inside the
    routed experts' launches (then ``forward`` returns None and ``MoE.forward`` adds nothing)."""

    def __init__(self, feed_forward: nn.Module, routed: "MegaMoERoutedExperts"):
        nn.Module.__init__(self)
        for name in ("w1", "w2", "w3", "gate"):
            if hasattr(feed_forward, name):
                setattr(self, name, getattr(feed_forward, name))
        self.gated = hasattr(feed_forward, "gate")
        # TorchTitan's per-module init and sharding configuration, as the replaced module had them
        self._param_init = getattr(feed_forward, "_param_init", None)
        self._sharding_config = getattr(feed_forward, "_sharding_config", None)
        self.__dict__["_routed"] = routed  # not a child: its parameters stay under routed_experts only
        routed.__dict__["_shared_experts"] = self

    def runs_inside(self, x2d: torch.Tensor, w13: torch.Tensor) -> bool:
        """Whether this call's shared expert runs inside the routed experts' launches: a function of the inputs'
        shapes, devices and the kernels' status only, so the two modules of one layer always agree."""
        if any(is_dtensor(m.weight) for m in (self.w1, self.w2, self.w3)):
            return False
        return _shared_ops.runs_inside(x2d, w13, self.w1.weight.shape[0], backend=self._routed.backend,
                                       precision=self._routed.precision)

    def mega_moe_args(self, x2d: torch.Tensor, io: torch.dtype, weight_dtype: torch.dtype) -> dict:
        """The shared experts' arguments of the routed experts' mega_moe call (the gate in the routing weights'
        dtype)."""
        args = dict(shared_w13=torch.cat([self.w1.weight, self.w3.weight], 0).to(io),
                    shared_w2=self.w2.weight.to(io))
        if self.gated:
            args["shared_gate"] = torch.sigmoid(self.gate(x2d)).to(weight_dtype).reshape(x2d.shape[0])
        return args

    def forward(self, x_BLD: torch.Tensor) -> Optional[torch.Tensor]:
        routed = self._routed
        if self.runs_inside(x_BLD.reshape(-1, x_BLD.shape[-1]), routed.inner_experts.w13):
            return None
        out = self.w2(nn.functional.silu(self.w1(x_BLD)) * self.w3(x_BLD))
        return torch.sigmoid(self.gate(x_BLD)) * out if self.gated else out


class MegaMoERoutedExperts(_TitanModule):
    """Drop-in for TorchTitan's ``RoutedExperts``: dispatch + SiLU-gated experts + weighted combine
    in one :func:`prime_kernels.mega.mega_moe` call (same forward signature and output)."""

    def __init__(self, inner_experts: MegaMoEGroupedExperts, top_k: int, backend: str = "auto",
                 precision: str = "bf16"):
        nn.Module.__init__(self)
        self.inner_experts = inner_experts
        self.top_k = int(top_k)
        self.backend = check_backend(backend)
        self.precision = check_precision(precision)

    @classmethod
    def from_routed_experts(cls, routed: nn.Module, backend: str = "auto", name: str = "",
                            precision: str = "bf16") -> "MegaMoERoutedExperts":
        """Fuse ``routed.inner_experts``' w1/w3 into w13 (once) and wrap it; checks like :func:`apply`."""
        top_k = _check_routed_experts(routed, name)
        inner = routed.inner_experts
        with torch.no_grad():
            w13 = torch.cat([inner.w1_EFD.detach(), inner.w3_EFD.detach()], dim=1)
        w13 = nn.Parameter(w13, requires_grad=inner.w1_EFD.requires_grad or inner.w3_EFD.requires_grad)
        param_init = getattr(inner, "_param_init", None)
        return cls(MegaMoEGroupedExperts(w13, inner.w2_EDF, param_init), top_k, backend, precision)

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E=None):
        B, L, D = x_BLD.shape
        K = topk_expert_ids_BLK.shape[-1]
        T = B * L
        w13, w2 = self.inner_experts.w13, self.inner_experts.w2_EDF
        if is_dtensor(w13) or is_dtensor(w2) or is_dtensor(x_BLD):
            fail(type(self).__name__, "DTensor inputs or weights in the forward: tensor/expert-parallel sharding of "
                                      "the routed experts is not supported by this adapter")
        io, wdt = compute_dtypes(x_BLD.dtype)
        x2d = x_BLD.reshape(T, D)
        shared = self.__dict__.get("_shared_experts")
        shared_args = shared.mega_moe_args(x2d, io, wdt) if shared is not None and shared.runs_inside(x2d, w13) else {}
        y = mega_moe(x2d.to(io), topk_expert_ids_BLK.reshape(T, K).long(), topk_scores_BLK.reshape(T, K).to(wdt),
                     w13.to(io), w2.to(io), backend=self.backend, precision=self.precision, num_experts=w13.shape[0],
                     **shared_args)
        return y.to(x_BLD.dtype).view(B, L, D)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, backend={self.backend!r}, precision={self.precision!r}"


def _check_routed_experts(routed: nn.Module, where: str) -> int:
    """Raise unless TorchTitan's ``routed`` (RoutedExperts) can run on mega_moe; returns top_k."""
    where = f"{where or '<module>'} ({type(routed).__name__})"
    if type(routed) is not RoutedExperts:
        fail(where, "routed_experts is not TorchTitan's RoutedExperts (a subclass or another implementation); "
                    "only the plain dispatcher + GroupedExperts composition is supported")
    if getattr(routed, "score_before_experts", False) or getattr(routed.token_dispatcher, "score_before_experts",
                                                                    False):
        fail(where, "router scores applied before the experts (score_before_experts=True) are not supported: "
                    "mega_moe applies them at the combine; set score_before_experts=False")
    inner = routed.inner_experts
    if type(inner) is not GroupedExperts:
        fail(where, f"experts {type(inner).__name__} are not supported: only TorchTitan's plain SiLU-gated "
                    f"GroupedExperts (w1/w2/w3, no biases) is (GPT-OSS biases and clamped SwiGLU, the interleaved "
                    f"FusedGroupedExperts, and Float8/MXFP8 converted experts are not)")
    disp = routed.token_dispatcher
    if type(disp) not in (LocalTokenDispatcher, AllToAllTokenDispatcher):
        fail(where, f"token dispatcher {type(disp).__name__} is not supported: mega_moe does its own dispatch; "
                    f"use comm_backend='standard' without expert parallelism")
    if getattr(disp, "ep_mesh", None) is not None:
        fail(where, "expert parallelism through TorchTitan's all-to-all dispatcher (an EP mesh is wired) is not "
                    "supported by this adapter yet; apply it without EP (before parallelize)")
    for pname in ("w1_EFD", "w2_EDF", "w3_EFD"):
        p = getattr(inner, pname, None)
        if not isinstance(p, torch.Tensor) or p.dim() != 3:
            fail(where, f"GroupedExperts.{pname} is missing or not 3-D")
        if is_dtensor(p):
            fail(where, f"GroupedExperts.{pname} is a DTensor (already sharded by FSDP/TP/EP): apply this adapter "
                        f"before parallelizing the model")
    E, F, D = inner.w1_EFD.shape
    if list(inner.w3_EFD.shape) != [E, F, D] or list(inner.w2_EDF.shape) != [E, D, F]:
        fail(where, f"w1 {list(inner.w1_EFD.shape)} / w3 {list(inner.w3_EFD.shape)} / w2 {list(inner.w2_EDF.shape)} "
                    f"are not [E, F, D] / [E, F, D] / [E, D, F]")
    if inner.w1_EFD.dtype != inner.w3_EFD.dtype or inner.w1_EFD.device != inner.w3_EFD.device:
        fail(where, "w1_EFD and w3_EFD differ in dtype or device")
    return int(getattr(disp, "top_k", 0) or 0)


def _fusable_shared_experts(moe: nn.Module) -> bool:
    """TorchTitan's plain or sigmoid-gated SwiGLU FeedForward as the shared experts, no biases, one gate per token."""
    ff = getattr(moe, "shared_experts", None)
    if type(ff) not in (FeedForward, SigmoidGatedFeedForward):
        return False
    linears = [getattr(ff, n, None) for n in ("w1", "w2", "w3")] + ([ff.gate] if hasattr(ff, "gate") else [])
    if not all(isinstance(m, nn.Linear) and m.bias is None and not is_dtensor(m.weight) for m in linears):
        return False
    F, D = ff.w1.weight.shape
    return (list(ff.w3.weight.shape) == [F, D] and list(ff.w2.weight.shape) == [D, F]
            and (not hasattr(ff, "gate") or list(ff.gate.weight.shape) == [1, D]))


def _moe_layers(model: nn.Module):
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            yield name, m


def apply(model: nn.Module, backend: str = "auto", precision: str = "bf16") -> list[str]:
    """Replace the routed experts of every TorchTitan MoE layer in ``model`` (the model itself may be
    an ``MoE``) by :class:`MegaMoERoutedExperts`.

    ``backend`` ("auto" default, "fused", "grouped", "reference") is passed to
    :func:`prime_kernels.mega.mega_moe` on every call, and ``precision`` ("bf16" default, "fp8", "fp8_bwd") too.
    Call it after building (and optionally initialising or loading) the model, before
    ``parallelize`` / FSDP and before building the optimizer (w1/w3 become one new parameter).
    Returns the names of the MoE layers switched (all of them); layers
    already switched get the new backend and are listed too. Raises
    :class:`UnsupportedLayerError` naming every layer it cannot switch, before changing any.
    """
    check_backend(backend)
    check_precision(precision)
    layers = list(_moe_layers(model))
    if not layers:
        raise UnsupportedLayerError(f"prime_kernels.integrations: {type(model).__name__} has no TorchTitan MoE layer "
                                    f"(torchtitan.models.common.moe.MoE): nothing to switch")
    problems, todo = [], []
    for name, moe in layers:
        where = name or "<model>"
        routed = getattr(moe, "routed_experts", None)
        try:
            if routed is None:
                fail(f"{where} ({type(moe).__name__})", "has no routed_experts: this MoE layout (another torchtitan "
                                                        "version?) is not supported; tested with torchtitan 0.3.0")
            if getattr(moe, "score_before_experts", False):
                fail(f"{where} ({type(moe).__name__})", "router scores applied before the experts "
                                                        "(score_before_experts=True) are not supported")
            if isinstance(routed, MegaMoERoutedExperts):
                todo.append((name, moe, None))
                continue
            _check_routed_experts(routed, f"{name + '.' if name else ''}routed_experts")
            todo.append((name, moe, routed))
        except UnsupportedLayerError as exc:
            problems.append(str(exc))
    if problems:
        raise UnsupportedLayerError(f"prime_kernels.integrations: {len(problems)} of {len(layers)} MoE layers cannot run "
                                    f"on prime_kernels.mega; nothing was switched:\n  " + "\n  ".join(problems))
    for name, moe, routed in todo:
        if routed is None:
            moe.routed_experts.backend = backend
            moe.routed_experts.precision = precision
        else:
            moe.routed_experts = MegaMoERoutedExperts.from_routed_experts(routed, backend, name, precision)
        if _fusable_shared_experts(moe):
            moe.shared_experts = MegaMoESharedExperts(moe.shared_experts, moe.routed_experts)
    return [name for name, _, _ in todo]


__all__ = ["apply", "MegaMoERoutedExperts", "MegaMoEGroupedExperts", "MegaMoESharedExperts", "UnsupportedLayerError"]
