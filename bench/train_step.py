#!/usr/bin/env python3
"""Full training steps of a Qwen3-MoE with our experts against the trainer's own, in one process, for two model
families: transformers' ``Qwen3MoeForCausalLM`` and TorchTitan's Qwen3 MoE (``--model``).

    python3 bench/train_step.py --layers 2 --seq 4096 --batch 4 --checkpointing both \\
        --out bench/results/train_step_h200_<date>.json                  # transformers only (the default)
    python3 bench/train_step.py --model both --layers 2 --seq 4096 --batch 4 --checkpointing both \\
        --out bench/results/train_step_h200_<date>_both.json             # transformers, then TorchTitan
    python3 bench/train_step.py --layers 9 --checkpointing both \\
        --variants grouped_mm,prime_mega_moe,prime_mega_moe_fp8 --out ...  # our bf16 and FP8 experts only
    python3 bench/train_step.py --smoke --device cpu --model both   # the CI path: tiny models on the CPU, seconds

transformers family. What one step is: ``opt.zero_grad(set_to_none=True)``,
``loss = model(input_ids=ids, labels=ids).loss``, ``loss.backward()``, ``opt.step()`` on
``transformers.Qwen3MoeForCausalLM`` built from a config (random weights, no download) at the Qwen3-30B-A3B layer
shape (hidden 2048, moe_intermediate_size 768, 128 experts, top-8, 32 heads / 4 KV heads, head_dim 128, vocab
151936; every layer sparse, no router auxiliary loss) with ``--layers`` decoder layers, ``--batch`` sequences of
``--seq`` tokens, SDPA attention.

Precision: the model's parameters are bf16 (so are its gradients and AdamW's two moments); the optimizer is
``torch.optim.AdamW`` (fused=True on CUDA, foreach on the CPU), no fp32 master copy, no autocast. The loss is
transformers' own (logits upcast to fp32).

Variants, each from the same state dict (the model is built once with ``--seed`` and copied to host memory; every
variant builds its model and loads that copy) on the same seeded token batches:

* ``grouped_mm``: transformers' own experts implementation of that name (``transformers.integrations.moe``;
  ``config._experts_implementation``, chosen here with ``experts_implementation=`` in ``from_config``; it is also
  transformers' default), torch's grouped GEMM.
* ``prime_mega_moe``: ours, switched in with ``prime_kernels.integrations.transformers.apply(model, backend)``
  (``--backend``: "auto" on a GPU; the package has no kernels without one and refuses "auto" there, so the CPU
  runs the pure-PyTorch "reference" backend).
* ``prime_mega_moe_fp8`` and ``prime_mega_moe_fp8_bwd``: ours through ``apply(model, backend, precision="fp8")``
  (the blockwise FP8 forward and backward, docs/fp8.md) and ``precision="fp8_bwd"`` (bf16 forward, FP8 backward).
  The parameters, gradients and AdamW stay bf16 as in every run: the layer quantizes the expert weights itself, once
  per optimizer step. Where the layer cannot run that precision with ``--backend`` on this device and shape (no
  sm90 GPU, H or I not multiples of 128, or "auto" only by falling back to the reference), the variant is recorded
  as skipped with the layer's reason. On the CPU (reference backend) they run the recipe's emulation. transformers
  has no FP8 training path for its MoE experts (checked in 5.24.0: its finegrained-FP8 experts hold frozen FP8
  weights that take no gradient, for inference and adapters), so these rows too are compared with ``grouped_mm``,
  its bf16 experts; the results JSON says so (``fp8_baseline``).
* ``sonicmoe``: transformers' SonicMoE experts implementation, where its kernel loads (it needs the ``kernels``
  package, a Hopper GPU and a hub build); otherwise the variant is recorded as skipped with the loader's error.

Per variant and ``--checkpointing`` setting (full activation checkpointing of every decoder layer, transformers'
``activation_checkpointing_enable()``, non-reentrant), after ``--warmup`` untimed steps:

* step time: the median of ``--steps`` steps, each ``torch.cuda.synchronize()`` + ``time.perf_counter()`` around the
  whole step (host overheads included, as a trainer sees them); tokens/s/GPU = batch * seq / step time (one GPU).
* peak memory: ``torch.cuda.max_memory_allocated()`` from before the model is built to the end of the timed steps
  (weights, gradients, optimizer state and activations).
* the MoE experts' share of the step: ``--share-steps`` more steps with timing hooks on every experts module:
  a forward pre-hook / forward hook pair stamps the experts' forward (recomputed forwards under checkpointing
  included), and identity autograd functions on the experts' input and output stamp the start and end of their
  backward (the gradients of the experts' weights, inputs and routing weights). Stamps are CUDA events (CPU:
  perf_counter); share = the sum of those windows / that step's time. Attention, router, norms, embedding, the
  LM head, the loss and the optimizer are the rest. These steps are not among the timed ones.
* the loss of every step (warm-up, timed and share steps).

Parity: every variant's loss at each of the first ``--parity-steps`` steps is within a relative 1e-2 of its
family's reference (``grouped_mm``; TorchTitan: ``torchtitan_grouped_mm``) at the same checkpointing setting.
Both runs compute in bf16 and their expert GEMMs sum in a different order, so the losses are not bitwise equal;
after a step the weights differ in their last bits and a router's top-k can flip, so the runs drift apart slowly;
1e-2 bounds that drift over a few steps, while a wrong expert computation gives a different loss from the first
step. The tokens are uniform random, so the loss stays near ln(vocab): this rule catches divergence, NaNs and gross
errors, not small ones (tests/test_integration_transformers.py and tests/test_integration_torchtitan.py check the
mappings exactly in float64). The FP8 variants are held to a relative 1.5e-2 (FP8_PARITY_RTOL: the bf16 rule widened
by 0.5% of the loss, as the FP8 training-parity rule widens its bf16 band). The script exits 1 when a variant breaks
its rule (2 when ``--device cuda`` finds no GPU).

Results: a table on stdout; the results JSON (``--out``, default
bench/results/train_step_<gpu>_<date>.json) with the git sha, torch / transformers / torchtitan / CUDA versions,
the GPU, every argument, each family's model shape (``models``; ``model``: the first family's), each run's family,
experts' precision, figures and losses, the parity verdicts (each with its ``rtol``) and the step-time ratio of every variant to its family's reference (ours /
the family's own experts); and a PNG beside it (step time per run, loss curves), unless
``--no-plot`` or matplotlib is missing (then it says so).

TorchTitan family (``--model torchtitan`` or ``both``; written against torchtitan 0.3.0, the pinned version):
``torchtitan.models.qwen3.Qwen3Model`` built from its config classes as its ``30B-A3B`` flavour builds them, at the
same layer shape and ``--layers`` (bench/train_step_torchtitan.py; no checkpoint, no job config, no Trainer, no
parallelism: one GPU), bf16 parameters (built on the meta device, materialised in bf16, initialised by TorchTitan's
``init_states``), the same AdamW and the same batches. Two deliberate differences from TorchTitan's trainer: the
attention is TorchTitan's ``ScaledDotProductAttention`` (causal; its language-model default is a compiled
FlexAttention with a packed-document mask, the same attention for our one-document rows), and the MoE has no
load-balancing bias (``load_balance_coeff=None``: its update is an optimizer hook of TorchTitan's Trainer). One step:
``opt.zero_grad``, ``logits = model(ids)``, loss = fp32 cross-entropy of ``logits[:, :-1]`` against ``ids[:, 1:]``
(as transformers computes its loss), ``backward``, ``opt.step()``. Variants:

* ``torchtitan_grouped_mm``: TorchTitan's own routed experts (``RoutedExperts``: local token dispatch,
  ``GroupedExperts`` on ``torch._grouped_mm`` (0.3 has no other path, so no ``use_grouped_mm`` flag), combine).
* ``prime_mega_moe``: ours, switched in with ``prime_kernels.integrations.torchtitan.apply(model, backend)``
  (``MegaMoERoutedExperts``), after loading the shared weights and before the optimizer is built;
  ``prime_mega_moe_fp8``: the same with ``precision="fp8"``.
* ``torchtitan_fp8_grouped_mm``: TorchTitan's own FP8 experts (``train_step_torchtitan.apply_trainer_fp8``: what its
  ``quantize.grouped_mm.float8`` converter sets up, torchao's rowwise e4m3 scaled grouped GEMMs with token groups
  padded to 16 rows, applied to the loaded bf16 model), eager like every variant here (TorchTitan recommends
  torch.compile for it); skipped with the reason where torchao or an sm_89+ GPU is missing. Our FP8 rows get a ratio
  against it besides the one against ``torchtitan_grouped_mm``, and it is held to the FP8 parity rule.

Checkpointing "on" is TorchTitan's own full activation checkpointing (``torchtitan.distributed.activation_checkpoint.
FullAC``, as its Trainer applies ``activation_checkpoint=FullAC``: every transformer block in torch's
``checkpoint_wrapper``, non-reentrant). The experts' share hooks sit on the routed experts module (TorchTitan's
``RoutedExperts``, ours after the swap), whose input is the tokens and output the combined result, as for
transformers' experts module. Parity and ratios are taken within a family: each family's own experts are its
reference (``grouped_mm`` for transformers, ``torchtitan_grouped_mm`` for TorchTitan); its runs start from that
family's state dict (the two families' weights differ). Every run in the results records its ``family``. If
TorchTitan's Qwen3 model or our adapter does not import here, every TorchTitan run is recorded as skipped with the
exception (``skipped``) and the family in ``families_skipped``; the transformers runs go on.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib.metadata
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import train_step_torchtitan as titan  # noqa: E402 - imports torchtitan only when its family runs
from train_step_timer import ExpertsTimer  # noqa: E402

HF_VARIANTS = ("grouped_mm", "prime_mega_moe", "prime_mega_moe_fp8", "prime_mega_moe_fp8_bwd", "sonicmoe")
REFERENCE = "grouped_mm"  # transformers' own experts: what its parity and ratios are taken against
FAMILIES = {"transformers": HF_VARIANTS, titan.FAMILY: titan.VARIANTS}
REFERENCES = {"transformers": REFERENCE, titan.FAMILY: titan.REFERENCE}  # each family's own experts
VARIANTS = tuple(dict.fromkeys(v for vs in FAMILIES.values() for v in vs))  # every name, each once
OURS = {"prime_mega_moe": "bf16", "prime_mega_moe_fp8": "fp8", "prime_mega_moe_fp8_bwd": "fp8_bwd"}  # -> precision
OURS_FP8 = {v for v, p in OURS.items() if p != "bf16"}
PARITY_RTOL = 1e-2
# FP8 rounding is a real change of the numerics (the FP8 layer's error against float64 is about 6.5e-2, docs/fp8.md),
# so an FP8 run may sit a little further from the bf16 reference without a bug. 0.5% of the loss is the widening the
# FP8 training-parity runs passed under (examples/train_parity.py, FP8_MARGIN_REL, against the bf16 band); a wrong
# expert computation still moves the loss by far more from the first step.
FP8_PARITY_RTOL = PARITY_RTOL + 0.005
# What the FP8 rows are compared with, in the results.
FP8_BASELINE = ("transformers: grouped_mm, its bf16 experts: transformers has no FP8 training path for its MoE experts "
                "(checked in 5.24.0: transformers.integrations.finegrained_fp8's experts hold frozen FP8 weights that "
                "take no gradient, for inference and adapters); TorchTitan: torchtitan_fp8_grouped_mm, its own FP8 "
                "experts (torchao's rowwise scaled grouped GEMMs, as its quantize.grouped_mm.float8 converter sets "
                "them up), beside torchtitan_grouped_mm")
# The trainer's own FP8 experts, per family that has them: each FP8 variant of ours gets a ratio against it as well
TRAINER_FP8 = {titan.FAMILY: titan.TRAINER_FP8}
FP8_VARIANTS = OURS_FP8 | set(TRAINER_FP8.values())

# Qwen3-30B-A3B's decoder layer (its config.json), with a chosen number of layers
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, max_position_embeddings=40960, rms_norm_eps=1e-6)
SMOKE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
             rms_norm_eps=1e-6)


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("transformers", "torchtitan", "both"), default="transformers",
                   help="model family: transformers' Qwen3MoeForCausalLM, TorchTitan's Qwen3 MoE, or both in turn")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; --smoke: 64)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; --smoke: 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --smoke: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default 3; --smoke: 1)")
    p.add_argument("--share-steps", type=int, default=1,
                   help="steps after the timed ones with the experts' timing hooks on (default 1)")
    p.add_argument("--checkpointing", choices=("off", "on", "both"), default="off",
                   help="full activation checkpointing of every decoder layer: off, on, or both settings in turn")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list from {','.join(VARIANTS)}, each run in the families that have it (a family's "
                        f"reference, {' / '.join(REFERENCES.values())}, always runs; default: all of them, those "
                        f"this device cannot run recorded as skipped)")
    p.add_argument("--backend", default=None,
                   help=f"prime_kernels backend for {', '.join(OURS)} (default: auto on CUDA, reference on the CPU)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the token batches")
    p.add_argument("--parity-steps", type=int, default=10,
                   help=f"steps whose losses must agree within a relative {PARITY_RTOL:g} ({FP8_PARITY_RTOL:g} for "
                        f"the FP8 variants; default 10)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to train (default cuda)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model (hidden 128, 8 experts, top-2, vocab 256) that runs on the CPU in seconds")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/train_step_<gpu>_<date>.json)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    a = p.parse_args(argv)
    small = a.smoke
    a.seq = a.seq or (64 if small else 4096)
    a.batch = a.batch or (2 if small else 4)
    a.steps = a.steps if a.steps is not None else (2 if small else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if small else 3)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(a.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}: choose from {list(VARIANTS)}")
    a.variants = [v for v in VARIANTS if v in a.variants]
    a.families = ["transformers", titan.FAMILY] if a.model == "both" else [a.model]
    a.backend = a.backend or ("reference" if a.device == "cpu" else "auto")
    for name in ("layers", "seq", "batch", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0 or a.share_steps < 0 or a.parity_steps < 0:
        p.error("--warmup, --share-steps and --parity-steps must be >= 0")
    return a


def checkpointing_settings(choice: str) -> list[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[choice]


def family_variants(family: str, requested: list[str]) -> list[str]:
    """The family's reference first, then its other variants that were asked for."""
    ref = REFERENCES[family]
    return [ref] + [v for v in FAMILIES[family] if v in requested and v != ref]


# ------------------------------------------------------------------------------------------------
# model, data, optimizer
# ------------------------------------------------------------------------------------------------


def make_config(args: argparse.Namespace):
    from transformers import Qwen3MoeConfig  # noqa: PLC0415

    shape = SMOKE if args.smoke else QWEN3_30B_A3B
    # every layer sparse (decoder_sparse_step=1, no mlp_only_layers), as in Qwen3-30B-A3B; no router auxiliary
    # loss, so the loss is the language-model loss alone
    return Qwen3MoeConfig(**shape, num_hidden_layers=args.layers, decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=True, tie_word_embeddings=False, output_router_logits=False,
                          max_window_layers=args.layers, use_cache=False)


def build_model(config, device: torch.device, impl: str):
    """A bf16 Qwen3-MoE on ``device`` with transformers' experts implementation ``impl``, randomly initialised."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with device:  # initialise on the device: the 30B-A3B layer shape is slow to initialise on the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation=impl,
                                                 attn_implementation="sdpa")
    return model.to(device)


def host_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def make_batches(n: int, batch: int, seq: int, vocab: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    """n batches of uniform random token ids, the same for every variant (a host generator, then moved)."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]


def make_optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    if device.type == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True), "fused"
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True), "foreach"


def hf_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
               loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, ids)
    loss.backward()
    opt.step()
    return loss.detach()


def sonicmoe_skip_reason() -> str | None:
    """None when transformers' SonicMoE kernel loads here, else why not (the loader's exception)."""
    try:
        from transformers.integrations.sonicmoe import load_sonicmoe_kernel  # noqa: PLC0415

        load_sonicmoe_kernel()
    except Exception as exc:  # noqa: BLE001 - any failure to load means: not measurable here, say why
        return f"{type(exc).__name__}: {exc}"
    return None


def precision_skip_reason(precision: str, args: argparse.Namespace, device: torch.device) -> str | None:
    """None when our layer runs ``precision`` with ``--backend`` on this device at the model's experts shape, forward
    and backward, else the layer's reason. "auto" resolving to the reference (PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK
    set on a device without the kernels) counts as not runnable: that would time the emulation, not the kernels."""
    from prime_kernels.mega import _backend  # noqa: PLC0415

    shape = SMOKE if args.smoke else QWEN3_30B_A3B
    try:
        for direction in ("fwd", "bwd"):
            which, why = _backend.choose_backend(
                args.backend, precision, direction, device_type=device.type, hidden=shape["hidden_size"],
                intermediate=shape["moe_intermediate_size"], num_local_experts=shape["num_experts"])
            if which == "reference" and args.backend != "reference":
                return f"precision={precision!r} {direction} would run the reference fallback here: {why}"
    except Exception as exc:  # noqa: BLE001 - the layer refuses this precision here: its reason is the record
        return f"{type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------------------------------------
# model families: how each builds, swaps, checkpoints and scores its model
# ------------------------------------------------------------------------------------------------


@dataclass
class Family:
    """One model family's hooks into the common run loop. ``state`` is its shared host state dict: every variant
    builds a fresh model and loads it."""

    name: str
    state: dict[str, torch.Tensor]
    build: Callable[[torch.device, str], torch.nn.Module]  # (device, variant): the model before our swap
    # (model, backend, precision): our experts in place of its own
    swap_in_ours: Callable[[torch.nn.Module, str, str], None]
    enable_checkpointing: Callable[[torch.nn.Module], object]
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    is_experts_module: Callable[[torch.nn.Module], bool]
    experts_implementation: Callable[[torch.nn.Module], str]
    summary: dict = field(default_factory=dict)
    # (model, variant): the family's own FP8 experts for its trainer-FP8 variant (TRAINER_FP8); else nothing
    convert: Callable[[torch.nn.Module, str], None] = lambda model, variant: None


def hf_family(args: argparse.Namespace, device: torch.device) -> Family:
    from prime_kernels.integrations.transformers import is_experts_module  # noqa: PLC0415

    config = make_config(args)

    def build(dev: torch.device, variant: str) -> torch.nn.Module:
        # ours are built as grouped_mm and swapped; the others are transformers' implementations by name
        return build_model(config, dev, "grouped_mm" if variant in OURS else variant)

    def swap(model: torch.nn.Module, backend: str, precision: str) -> None:
        import prime_kernels.integrations.transformers as pk_hf  # noqa: PLC0415

        pk_hf.apply(model, backend=backend, precision=precision)

    def checkpointing(model: torch.nn.Module) -> None:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()

    torch.manual_seed(args.seed)
    base = build(device, REFERENCE)
    state = host_state_dict(base)
    del base
    return Family(name="transformers", state=state, build=build, swap_in_ours=swap,
                  enable_checkpointing=checkpointing, loss=hf_loss, is_experts_module=is_experts_module,
                  experts_implementation=lambda model: model.config._experts_implementation,
                  summary=model_summary(config, state, args.smoke))


def titan_family(args: argparse.Namespace, device: torch.device) -> Family:
    config = titan.make_config(SMOKE if args.smoke else QWEN3_30B_A3B, args.layers)
    torch.manual_seed(args.seed)
    base = titan.build_model(config, device)
    state = host_state_dict(base)
    del base
    def convert(model: torch.nn.Module, variant: str) -> None:
        if variant == titan.TRAINER_FP8:
            titan.apply_trainer_fp8(model)

    return Family(name=titan.FAMILY, state=state, build=lambda dev, variant: titan.build_model(config, dev),
                  swap_in_ours=titan.apply_ours, convert=convert,
                  enable_checkpointing=titan.enable_full_ac, loss=titan.loss,
                  is_experts_module=titan.is_experts_module, experts_implementation=titan.experts_implementation,
                  summary=titan.summary(config, state, args.smoke))


# ------------------------------------------------------------------------------------------------
# one run: a variant of a family at one checkpointing setting
# ------------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    variant: str
    checkpointing: bool
    family: str = "transformers"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def prepare_model(spec: RunSpec, fam: Family, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The variant's model with the family's shared weights, ours swapped in, checkpointing as asked."""
    model = fam.build(device, spec.variant)
    model.load_state_dict(fam.state, strict=True)
    if spec.variant in OURS:
        fam.swap_in_ours(model, args.backend, OURS[spec.variant])
    else:
        fam.convert(model, spec.variant)
    if spec.checkpointing:
        fam.enable_checkpointing(model)
    model.train()
    return model


def timed_step(model, opt, ids, device, loss_fn) -> tuple[float, torch.Tensor]:
    sync(device)
    t0 = time.perf_counter()
    loss = train_step(model, opt, ids, loss_fn)
    sync(device)
    return (time.perf_counter() - t0) * 1e3, loss


def run_variant(spec: RunSpec, fam: Family, batches: list[torch.Tensor], args: argparse.Namespace,
                device: torch.device) -> dict:
    free_memory(device)
    model = prepare_model(spec, fam, args, device)
    opt, opt_kind = make_optimizer(model, args.lr, device)
    losses: list[torch.Tensor] = []
    step_ms: list[float] = []
    for i, ids in enumerate(batches[:args.warmup + args.steps]):
        ms, loss = timed_step(model, opt, ids, device, fam.loss)
        losses.append(loss)
        if i >= args.warmup:
            step_ms.append(ms)
    peak_gib = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
    timer = ExpertsTimer(model, device.type == "cuda", fam.is_experts_module)
    shares = []
    for ids in batches[args.warmup + args.steps:]:
        timer.reset()
        timer.enabled = True
        ms, loss = timed_step(model, opt, ids, device, fam.loss)
        timer.enabled = False
        losses.append(loss)
        shares.append({"step_ms": ms, **timer.summary()})
    timer.remove()
    row = summarize_run(spec, fam.experts_implementation(model), step_ms, shares,
                        [float(x) for x in losses], args)
    row.update(optimizer=f"AdamW ({opt_kind})", peak_mem_gib=None if peak_gib is None else round(peak_gib, 3))
    del model, opt, timer
    free_memory(device)
    return row


def summarize_run(spec: RunSpec, experts_impl: str, step_ms: list[float], shares: list[dict], losses: list[float],
                  args: argparse.Namespace) -> dict:
    median = statistics.median(step_ms)
    experts_ms = [s["fwd_ms"] + s["bwd_ms"] for s in shares]
    share = statistics.median(e / s["step_ms"] for e, s in zip(experts_ms, shares)) if shares else None
    return {
        "family": spec.family,
        "variant": spec.variant,
        "checkpointing": spec.checkpointing,
        "experts_implementation": experts_impl,
        "backend": args.backend if spec.variant in OURS else None,
        "precision": OURS.get(spec.variant, "bf16"),  # the experts'; the rest of the model is bf16 in every run
        "step_ms": round(median, 3),
        "step_ms_all": [round(x, 3) for x in step_ms],
        "tokens_per_s_per_gpu": round(args.batch * args.seq / (median / 1e3), 1),
        "moe_experts_ms": None if not shares else round(statistics.median(experts_ms), 3),
        "moe_share": None if share is None else round(share, 4),
        "moe_share_steps": [{k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()} for s in shares],
        "losses": losses,
    }


# ------------------------------------------------------------------------------------------------
# parity, ratios, output
# ------------------------------------------------------------------------------------------------


def _family(row: dict) -> str:
    return row.get("family", "transformers")  # rows written before TorchTitan was added have no family


def _reference_row(rows: list[dict], row: dict) -> dict:
    """The family's own experts at the same checkpointing setting."""
    fam = _family(row)
    return next(r for r in rows if _family(r) == fam and r["variant"] == REFERENCES[fam]
                and r["checkpointing"] == row["checkpointing"])


def _compared(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("skipped") and r["variant"] != REFERENCES[_family(r)]]


def parity_rtol(variant: str) -> float:
    return FP8_PARITY_RTOL if variant in FP8_VARIANTS else PARITY_RTOL


def parity(rows: list[dict], steps: int) -> list[dict]:
    """Every timed variant's losses against its family's reference at the same checkpointing setting."""
    out = []
    for row in _compared(rows):
        ref = _reference_row(rows, row)
        n = min(steps, len(row["losses"]), len(ref["losses"]))
        diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"][:n], ref["losses"][:n])]
        finite = all(math.isfinite(x) for x in row["losses"] + ref["losses"])
        rtol = parity_rtol(row["variant"])
        ok = finite and all(d <= rtol for d in diffs)
        out.append({"family": _family(row), "variant": row["variant"], "vs": ref["variant"],
                    "checkpointing": row["checkpointing"], "steps_checked": n, "rtol": rtol,
                    "max_rel_diff": max(diffs, default=0.0), "rel_diffs": [float(f"{d:.3e}") for d in diffs],
                    "finite": finite, "ok": ok})
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Step time of every timed variant over its family's reference at the same setting (< 1: faster than the
    family's own experts), and of each FP8 variant of ours over the family's own FP8 experts where they ran."""
    out = []
    for row in _compared(rows):
        refs = [_reference_row(rows, row)]
        trainer_fp8 = TRAINER_FP8.get(_family(row))
        if row["variant"] in OURS_FP8 and trainer_fp8:
            refs += [r for r in rows if _family(r) == _family(row) and r["variant"] == trainer_fp8
                     and r["checkpointing"] == row["checkpointing"] and not r.get("skipped")]
        for ref in refs:
            out.append({"family": _family(row), "variant": row["variant"], "vs": ref["variant"],
                        "checkpointing": row["checkpointing"],
                        "step_ms_ratio": round(row["step_ms"] / ref["step_ms"], 4)})
    return out


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def default_out(device: torch.device) -> Path:
    """bench/results/train_step_<gpu>_<date>.json, <gpu> the model's first word ("NVIDIA H200" -> "h200")."""
    words = gpu_name(device).replace("NVIDIA", "").split()
    gpu = words[0].lower() if words else "gpu"
    return bc.RESULTS_DIR / f"train_step_{gpu}_{_dt.date.today().isoformat()}.json"


def model_summary(config, state: dict, smoke: bool) -> dict:
    experts = sum(v.numel() for k, v in state.items() if ".experts." in k)
    return {"model": "Qwen3MoeForCausalLM", "shape": "smoke" if smoke else "qwen3-30b-a3b",
            "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "moe_intermediate": config.moe_intermediate_size, "experts": config.num_experts,
            "top_k": config.num_experts_per_tok, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim, "vocab": config.vocab_size,
            "params": sum(v.numel() for v in state.values()), "expert_params": experts,
            "attention": "sdpa", "dtype": "bfloat16"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def header(args: argparse.Namespace, device: torch.device) -> dict:
    import prime_kernels  # noqa: PLC0415

    return {"benchmark": "train_step", "gpu": gpu_name(device), "device": device.type,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": _version("transformers"),
            "torchtitan": titan.version(), "torchtitan_stand_ins": titan.STAND_INS,
            "prime_kernels": prime_kernels.build_info()["version"],
            "git_sha": bc.git_sha(), "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "args": vars(args),
            "precision": "bf16 parameters, gradients and AdamW moments (no fp32 master weights, no autocast)",
            "fp8_baseline": FP8_BASELINE}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'family':<12} {'variant':<22} {'ckpt':<4} {'step_ms':>10} {'tok/s/gpu':>11} {'moe_share':>9} "
             f"{'peak_GiB':>9}  note"]
    for r in rows:
        ck = "on" if r["checkpointing"] else "off"
        lead = f"{_family(r):<12} {r['variant']:<22} {ck:<4}"
        if r.get("skipped"):
            lines.append(f"{lead} {'-':>10} {'-':>11} {'-':>9} {'-':>9}  skipped: {r['skipped']}")
            continue
        share = "-" if r["moe_share"] is None else f"{r['moe_share']:.3f}"
        peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        lines.append(f"{lead} {r['step_ms']:>10.2f} {r['tokens_per_s_per_gpu']:>11.0f} "
                     f"{share:>9} {peak:>9}  losses {', '.join(f'{x:.4f}' for x in r['losses'])}")
    return "\n".join(lines)


_COLOR_KEYS = [(f, v) for f, vs in FAMILIES.items() for v in vs]  # one colour per family and variant


def _color(row: dict) -> str:
    return f"C{_COLOR_KEYS.index((_family(row), row['variant']))}"


def plot(doc: dict, path: Path) -> Path | None:
    """Step time per family, variant and setting (bars) and every run's loss curve, into ``path``."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("[train_step] matplotlib is not installed: no plot")
        return None
    rows = [r for r in doc["runs"] if not r.get("skipped")]
    if not rows:
        print("[train_step] every run was skipped: no plot")
        return None
    # the family is on its own line, so "torchtitan_" need not be repeated under the bar (the labels would collide)
    labels = [f"{_family(r)}\n{r['variant'].removeprefix('torchtitan_')}\nckpt {'on' if r['checkpointing'] else 'off'}"
              for r in rows]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12 if len(rows) <= 6 else 16, 4.5))
    bars.bar(range(len(rows)), [r["step_ms"] for r in rows], color=[_color(r) for r in rows])
    bars.set_xticks(range(len(rows)), labels, fontsize=7)
    bars.set_ylabel("step time, median (ms)")
    bars.set_title(f"{doc['gpu']}: {doc['model']['layers']} layers, batch {doc['args']['batch']} x "
                   f"seq {doc['args']['seq']}", fontsize=9)
    for r in rows:
        style = "--" if r["checkpointing"] else "-"
        curves.plot(r["losses"], style, marker=".", color=_color(r),
                    label=f"{_family(r)} {r['variant']} ckpt {'on' if r['checkpointing'] else 'off'}")
    curves.xaxis.get_major_locator().set_params(integer=True)
    curves.set_xlabel("step (warm-up, timed, share)")
    curves.set_ylabel("loss")
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def load_family(name: str, args: argparse.Namespace, device: torch.device) -> tuple[Family | None, str | None]:
    """(the family, None), or (None, why it cannot run here). Only TorchTitan may be skipped: transformers is this
    script's baseline, so its failures propagate."""
    if name == "transformers":
        return hf_family(args, device), None
    reason = titan.skip_reason()
    if reason is None:
        try:
            return titan_family(args, device), None
        except Exception as exc:  # noqa: BLE001 - its model code imported but does not build here: record why
            reason = f"{type(exc).__name__}: {exc}"
    return None, reason


def run_family(fam: Family, args: argparse.Namespace, device: torch.device,
               batches: list[torch.Tensor]) -> list[dict]:
    variants = family_variants(fam.name, args.variants)
    skip = {v: precision_skip_reason(OURS[v], args, device) for v in variants if v in OURS_FP8}
    if "sonicmoe" in variants:
        skip["sonicmoe"] = sonicmoe_skip_reason()
    if TRAINER_FP8.get(fam.name) in variants:
        skip[TRAINER_FP8[fam.name]] = titan.trainer_fp8_skip_reason(device)
    rows = []
    for ckpt in checkpointing_settings(args.checkpointing):
        for variant in variants:
            if skip.get(variant):
                print(f"[train_step] skipping {variant}: {skip[variant]}")
                rows.append({"family": fam.name, "variant": variant, "checkpointing": ckpt, "skipped": skip[variant]})
                continue
            print(f"[train_step] {fam.name} {variant}, checkpointing {'on' if ckpt else 'off'} ...", flush=True)
            rows.append(run_variant(RunSpec(variant, ckpt, fam.name), fam, batches, args, device))
    return rows


def skipped_rows(name: str, reason: str, args: argparse.Namespace) -> list[dict]:
    return [{"family": name, "variant": v, "checkpointing": ck, "skipped": reason}
            for ck in checkpointing_settings(args.checkpointing) for v in family_variants(name, args.variants)]


def report(doc: dict, out: Path, args: argparse.Namespace) -> None:
    print(format_table(doc["runs"]))
    for r in doc["ratios"]:
        print(f"[train_step] {r['family']}: {r['variant']} / {r['vs']} step time, checkpointing "
              f"{'on' if r['checkpointing'] else 'off'}: {r['step_ms_ratio']:.3f}")
    for name, reason in doc["families_skipped"].items():
        print(f"[train_step] {name} family skipped: {reason}")
    print(f"[train_step] wrote {out}")
    if not args.no_plot:
        png = plot(doc, out.with_suffix(".png"))
        if png is not None:
            print(f"[train_step] wrote {png}")
    for p in doc["parity"]:
        if not p["ok"]:
            print(f"[train_step] PARITY FAIL: {p['family']} {p['variant']} vs {p['vs']} (checkpointing "
                  f"{'on' if p['checkpointing'] else 'off'}): max relative loss difference {p['max_rel_diff']:.3e} "
                  f"> {p['rtol']:g} over {p['steps_checked']} steps (finite: {p['finite']})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("[train_step] --device cuda needs a CUDA GPU; use --device cpu (with --smoke) on this machine")
        return 2
    n_steps = args.warmup + args.steps + args.share_steps
    vocab = (SMOKE if args.smoke else QWEN3_30B_A3B)["vocab_size"]  # both families: the same shape, same batches
    batches = make_batches(n_steps, args.batch, args.seq, vocab, args.seed, device)
    rows: list[dict] = []
    summaries: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for name in args.families:  # one family at a time: its host state dict is dropped before the next is built
        fam, reason = load_family(name, args, device)
        free_memory(device)
        if fam is None:
            print(f"[train_step] skipping the {name} family: {reason}")
            skipped[name] = reason
            rows += skipped_rows(name, reason, args)
            continue
        summaries[name] = fam.summary
        rows += run_family(fam, args, device, batches)
        del fam
    doc = header(args, device)
    # "model": the first family's summary (the layer shape is the same for both); "models": each family's
    doc.update(model=next(iter(summaries.values()), None), models=summaries, families_skipped=skipped,
               tokens_per_step=args.batch * args.seq, runs=rows, parity=parity(rows, args.parity_steps),
               ratios=ratios(rows))
    doc["parity_ok"] = all(p["ok"] for p in doc["parity"])
    out = Path(args.out) if args.out else default_out(device)
    bc.write_results(doc, out)
    report(doc, out, args)
    return 0 if doc["parity_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
