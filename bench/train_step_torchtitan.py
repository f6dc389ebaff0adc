"""TorchTitan's Qwen3 MoE for bench/train_step.py: the model built from its config classes (no checkpoint, no job
config, no Trainer), its loss, its activation checkpointing and the hooks' view of its experts.

Written against torchtitan 0.3.0 (ci/test.sh, ci/device_wheels.sh). Everything TorchTitan-specific sits here, so a
TorchTitan that does not import or build is one exception, which train_step.py records as the family's skip reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import warnings

import torch
from torch import nn

FAMILY = "torchtitan"
REFERENCE = "torchtitan_grouped_mm"  # TorchTitan's own GroupedExperts: torch._grouped_mm, always (no flag in 0.3)
# TorchTitan's own FP8 experts: what its Float8GroupedExpertsConverter sets up (torchao's rowwise e4m3 scaled grouped
# GEMMs in the forward and backward, token groups padded to 16 rows); see apply_trainer_fp8
TRAINER_FP8 = "torchtitan_fp8_grouped_mm"
VARIANTS = (REFERENCE, "prime_mega_moe", "prime_mega_moe_fp8", TRAINER_FP8)
FP8_PAD_MULTIPLE = 16  # the converter's: e4m3 rows of 16 bytes


def version() -> str | None:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


# torch names that torchtitan 0.3.0 imports at module level but a torch older than the one it was written for lacks,
# each replaced by a stand-in that raises when used (see _add_stand_in). Filled by skip_reason(); the results file
# records it (train_step.header), so a row measured with stand-ins says so.
STAND_INS: list[str] = []
_MAX_STAND_INS = 8
_MISSING_NAME = re.compile(r"cannot import name '(\w+)' from '(torch(?:\.\w+)*)'")


def _add_stand_in(module_name: str, name: str) -> None:
    """Give torch module ``module_name`` a ``name`` that fails loudly when called, instantiated or subclassed.

    The names torchtitan 0.3.0 imports from torch's distributed packages at module level (``DataParallelMeshDims``
    under torch 2.11) serve its FSDP / tensor-parallel code and type hints. A one-GPU step never enters that code,
    and if it did, the stand-in would raise instead of doing something else, so a measured row cannot depend on one.
    """
    module = importlib.import_module(module_name)

    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"{module_name}.{name} is a stand-in (this torch, {torch.__version__}, lacks it); "
                           "bench/train_step_torchtitan.py measures one GPU, which must not use it")

    stand_in = type(name, (), {"__init__": refuse, "__call__": refuse, "__init_subclass__": classmethod(refuse),
                               "__module__": module_name, "__doc__": f"stand-in for {module_name}.{name}"})
    setattr(module, name, stand_in)
    STAND_INS.append(f"{module_name}.{name}")


def _forget_torchtitan() -> None:
    for mod in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        del sys.modules[mod]


def skip_reason() -> str | None:
    """None when TorchTitan's Qwen3 model code and our adapter import here, else the exception (type: message).

    A name torchtitan imports from a torch module that this torch lacks gets a stand-in (``STAND_INS``, at most
    ``_MAX_STAND_INS``) and the import is tried again; anything else is the reason."""
    for _ in range(_MAX_STAND_INS + 1):
        try:
            import torchtitan.models.qwen3  # noqa: F401, PLC0415

            import prime_kernels.integrations.torchtitan  # noqa: F401, PLC0415
        except ImportError as exc:
            missing = _MISSING_NAME.search(str(exc))
            if missing is None or len(STAND_INS) >= _MAX_STAND_INS:
                return f"{type(exc).__name__}: {exc}"
            _add_stand_in(missing.group(2), missing.group(1))
            _forget_torchtitan()
        except Exception as exc:  # noqa: BLE001 - any failure means: this family is not measurable here, say why
            return f"{type(exc).__name__}: {exc}"
        else:
            return None
    return f"more than {_MAX_STAND_INS} torch names missing: {', '.join(STAND_INS)}"


def make_config(shape: dict, layers: int):
    """``Qwen3Model.Config`` as torchtitan's ``qwen3_configs["30B-A3B"]`` builds it, at ``shape`` (train_step's
    transformers-style shape dict) with ``layers`` layers, and two changes for this benchmark:

    * attention: TorchTitan's ``ScaledDotProductAttention`` (causal) instead of its language-model default,
      FlexAttention with a packed-document block mask. Our batches are one document per row, so causal SDPA is the
      same attention; it avoids inductor-compiling flex_attention (max-autotune) inside the measured run, and it is
      what the transformers family runs too. The experts, the part compared, are untouched.
    * ``load_balance_coeff=None``: the auxiliary-loss-free bias is updated by an optimizer hook that TorchTitan's
      Trainer registers (``register_moe_load_balancing_hook``); without the Trainer it would stay zero anyway.
    """
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear  # noqa: PLC0415
    from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: PLC0415
    from torchtitan.models.qwen3 import (  # noqa: PLC0415
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    dim, vocab, head_dim = shape["hidden_size"], shape["vocab_size"], shape["head_dim"]
    blocks = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=layers, dim=dim, n_heads=shape["num_attention_heads"],
        n_kv_heads=shape["num_key_value_heads"], head_dim=head_dim, moe_hidden_dim=shape["moe_intermediate_size"],
        num_experts=shape["num_experts"], top_k=shape["num_experts_per_tok"], attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=shape["max_position_embeddings"], theta=1000000.0),
        moe_comm_backend="standard")
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
        block.moe.load_balance_coeff = None
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=blocks)


def build_model(config, device: torch.device) -> nn.Module:
    """A Qwen3 MoE with bf16 parameters on ``device``, randomly initialised by TorchTitan's ``init_states``.

    Built on the meta device and materialised in bf16, so no fp32 copy of the weights ever exists on the device
    (it would count in the peak memory). Only parameters become bf16: the RoPE cache and the MoE's token counters
    keep the dtypes TorchTitan gives them.
    """
    # the router computes its gate under autocast(float32), which the CPU does not offer: it warns on every step
    # and runs the gate in bf16 instead (the CPU smoke run only)
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    with torch.device("meta"):
        model = config.build()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.to_empty(device=device)
    model.init_states(buffer_device=device)
    return model


def apply_ours(model: nn.Module, backend: str, precision: str) -> None:
    import prime_kernels.integrations.torchtitan as pk_tt  # noqa: PLC0415

    pk_tt.apply(model, backend=backend, precision=precision)


def trainer_fp8_skip_reason(device: torch.device) -> str | None:
    """None where TorchTitan's FP8 experts run here, else why not: torchao missing or a GPU below sm_89 (the
    converter's own checks, its exception as the reason), or no CUDA device."""
    if device.type != "cuda":
        return "TorchTitan's FP8 experts run torchao's scaled grouped GEMMs on a CUDA GPU (sm_89 or later)"
    try:
        from torchtitan.components.quantization import Float8GroupedExpertsConverter  # noqa: PLC0415

        Float8GroupedExpertsConverter(Float8GroupedExpertsConverter.Config())
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: F401, PLC0415
        from torchao.quantization.quant_api import quantize_  # noqa: F401, PLC0415
    except Exception as exc:  # noqa: BLE001 - any failure means: the trainer's FP8 path does not run here
        return f"{type(exc).__name__}: {exc}"
    return None


def apply_trainer_fp8(model: nn.Module) -> None:
    """TorchTitan's FP8 MoE training on the built model: what ``Float8GroupedExpertsConverter`` (its
    ``quantize.grouped_mm.float8`` converter) makes of the model config, done to the modules instead, so that the
    expert weights stay the bf16 parameters every other variant trains (the converter's config builds experts whose
    weights torchao wraps in fp32, and this model is materialised in bf16 before that): every ``GroupedExperts``
    through torchao's ``quantize_`` with ``Float8TrainingOpConfig`` (rowwise e4m3 scaled grouped GEMMs for the
    forward, dgrad and wgrad) and every ``RoutedExperts``' token dispatcher the ``TorchAOTokenDispatcher`` that pads
    each expert's tokens to 16 rows. Eager, as every variant here runs; TorchTitan recommends torch.compile for this
    path (the converter logs it), which no variant gets."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: PLC0415
    from torchao.quantization.quant_api import quantize_  # noqa: PLC0415
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: PLC0415
    from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher  # noqa: PLC0415

    quantize_(model, config=Float8TrainingOpConfig(), filter_fn=lambda mod, _fqn: isinstance(mod, GroupedExperts))
    for routed in (m for m in model.modules() if isinstance(m, RoutedExperts)):
        old = routed.token_dispatcher
        routed.token_dispatcher = TorchAOTokenDispatcher(TorchAOTokenDispatcher.Config(
            num_experts=old.num_experts, top_k=old.top_k, pad_multiple=FP8_PAD_MULTIPLE))


def enable_full_ac(model: nn.Module) -> str:
    """TorchTitan's own full activation checkpointing (``FullAC``: every transformer block wrapped in torch's
    ``checkpoint_wrapper``, non-reentrant), as its Trainer applies it with ``activation_checkpoint=FullAC``."""
    from torchtitan.distributed.activation_checkpoint import FullAC  # noqa: PLC0415

    FullAC(FullAC.Config()).apply(model)
    return "torchtitan.distributed.activation_checkpoint.FullAC"


def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over the B * (L - 1) predicted tokens, logits upcast to fp32 (as
    transformers' ForCausalLMLoss computes it; TorchTitan's model returns logits only)."""
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def is_experts_module(m: nn.Module) -> bool:
    """The routed experts (dispatch, grouped GEMMs, combine): TorchTitan's ``RoutedExperts`` or ours after the swap.
    Their first argument is the tokens, their output the combined result, as the timing hooks expect."""
    from prime_kernels.integrations.torchtitan import MegaMoERoutedExperts  # noqa: PLC0415
    from torchtitan.models.common.moe import RoutedExperts  # noqa: PLC0415

    return isinstance(m, (RoutedExperts, MegaMoERoutedExperts))


def experts_implementation(model: nn.Module) -> str:
    """e.g. "RoutedExperts(GroupedExperts)" or "MegaMoERoutedExperts(MegaMoEGroupedExperts)"."""
    kinds = {f"{type(m).__name__}({type(m.inner_experts).__name__})" for m in model.modules() if is_experts_module(m)}
    return ",".join(sorted(kinds))


def summary(config, state: dict, smoke: bool) -> dict:
    attn = config.layers[0].attention
    moe = config.layers[0].moe
    inner = moe.routed_experts.inner_experts
    experts = sum(v.numel() for k, v in state.items() if ".routed_experts." in k)
    return {"model": "torchtitan.models.qwen3.Qwen3Model", "shape": "smoke" if smoke else "qwen3-30b-a3b",
            "layers": len(config.layers), "hidden": config.dim, "moe_intermediate": inner.hidden_dim,
            "experts": moe.num_experts, "top_k": moe.router.top_k, "heads": attn.n_heads,
            "kv_heads": attn.n_kv_heads, "head_dim": attn.head_dim, "vocab": config.vocab_size,
            "params": sum(v.numel() for v in state.values()), "expert_params": experts,
            "attention": "sdpa (torchtitan ScaledDotProductAttention, causal)", "dtype": "bfloat16"}
