#!/usr/bin/env python3
"""Training parity of the MoE layer's kernel backends: a trained model's loss curve against the reference's.

A small byte-level MoE language model is trained from one fixed initialisation on a corpus that
needs no download (the Python standard library's own ``*.py`` sources, found through
``sysconfig.get_paths()["stdlib"]``, read as bytes), several times:

* the *reference runs*: ``MegaMoE(backend="reference")`` (pure PyTorch) in BF16, one run per
  data-order seed of ``--reference-seeds`` (default 2 seeds: 0 and 1);
* the *candidate run*: ``MegaMoE(backend=--backend, precision=--precision)`` (default "auto": the
  fused kernels when ``prime_kernels.status()`` reports them, else the grouped-GEMM pipeline; default
  precision "bf16", or "fp8" / "fp8_bwd", the blockwise FP8 recipe of docs/fp8.md in both directions /
  in the backward only), with the data order of the first reference seed (``--candidate-seed``), so
  that candidate and reference 0 see the same batches and differ only by the layer's numerics. The
  band stays BF16 whatever the candidate's precision: an FP8 run is judged against the BF16 training
  it stands in for.

    python examples/train_parity.py                       # GPU check (H200: a few minutes)
    python examples/train_parity.py --backend grouped     # a named kernel backend
    python examples/train_parity.py --precision fp8       # the FP8 layer against the BF16 band
    python examples/train_parity.py --tiny --device cpu --backend reference   # CPU smoke, seconds
    python examples/train_parity.py --tiny --device cpu --backend reference --precision fp8
                                                          # CPU smoke of the reference's FP8 emulation

Model: token embedding (256 byte values) -> ``--layers`` pre-norm blocks, each with causal
multi-head attention (RoPE, ``scaled_dot_product_attention``) and an MoE feed-forward (an fp32
linear router, softmax, top-k, weights renormalised over the k chosen, a Switch-style load
balancing loss of weight ``--aux-weight``, and ``prime_kernels.mega.MegaMoE`` for the routed experts)
-> final RMSNorm -> untied linear head. Precision: every parameter has an fp32 master copy and
AdamW steps on the masters; the ``MegaMoE`` weights are held in bf16 (the layer's contract) and
refreshed from their masters after each step, the other parameters are fp32 and run under bf16
autocast (``--no-autocast`` for fp32); the MoE is called with bf16 tokens and fp32 top-k weights,
outside autocast. Its weight gradients arrive in bf16 (the parameters' dtype) and are widened into
the masters, or with ``--wgrad-accum`` the layer adds them in fp32 straight into the masters'
``.grad`` (the FSDP-style accumulation option). Batches: ``--batch`` windows of ``--seq`` + 1
bytes at offsets drawn from a CPU generator seeded with the data-order seed (identical on every
device). Every 20th source file (sorted order, from the first) is held out; the evaluation loss is the mean over
``--eval-batches`` fixed held-out batches (the same for every run).

Pass rule (all of it must hold, else FAIL and exit status 1):

1. every training loss of every run is finite;
2. smoothing: ``s[t]`` = mean of the raw training loss over steps ``[t - W + 1, t]``
   (W = ``--smooth``, default 25; fewer at the start). Band: ``lo[t] = min_r s_r[t]``,
   ``hi[t] = max_r s_r[t]`` over the reference runs. Margin ``m = max(--margin, --margin-frac *
   median(hi - lo))`` over the checked steps (defaults 0.03 nats and 0.5). For each of the last
   N steps (N = ``--check-last``, default half the run) ``lo[t] - m_t <= s_cand[t] <= hi[t] + m_t``,
   ``m_t = m`` for a BF16 candidate;
3. final loss: the candidate's final evaluation loss lies in ``[min - mf, max + mf]`` of the
   reference runs' final evaluation losses, ``mf = max(--margin, --margin-frac * (max - min))`` for
   a BF16 candidate.

An FP8 candidate (``--precision fp8`` or ``fp8_bwd``) is not the band's numerics, so both margins
are widened by 0.5% of the loss (FP8_MARGIN_REL): ``m_t = m + 0.005 * (lo[t] + hi[t]) / 2`` at
each checked step, and ``mf = max(--margin, --margin-frac * (max - min)) + 0.005 * mean`` of the
reference runs' final evaluation losses.

The script prints PASS or FAIL with the reasons, writes a JSON (every curve, the band, the
verdict, the configuration, the corpus's size and sha256, provenance) and a PNG (the candidate's
smoothed curve over the reference band, and the candidate's distance to the band) under
bench/results/ (``--out`` to change). With the reference as the candidate (on a CPU, or with
``--backend reference``) the run checks only the harness, and says so: it is not the kernel check.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import math
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))  # bench_common: the provenance fields every results file carries
from bench_common import git_sha  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
VOCAB = 256
CHECK_BACKENDS = ("auto", "fused", "grouped", "reference")
CHECK_PRECISIONS = ("bf16", "fp8", "fp8_bwd")
# The rule's widening for a candidate whose precision is not the band's (BF16): FP8 rounding is a real
# change of the numerics, so its curve may sit a little off a BF16 band without a bug; 0.5% of the loss.
FP8_MARGIN_REL = 0.005

# The sizes of --tiny (the CPU smoke run and the CPU test); every other default is the GPU run.
TINY = dict(layers=1, hidden=32, heads=2, intermediate=32, experts=4, top_k=2, seq=32, batch=4, steps=24,
            warmup=4, smooth=6, check_last=12, eval_batches=2, eval_every=0, log_every=8,
            corpus_max_bytes=300_000)


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto", choices=CHECK_BACKENDS,
                   help="the candidate backend of MegaMoE (default auto: the kernel backend available)")
    # %% since argparse %-formats help strings
    p.add_argument("--precision", default="bf16", choices=CHECK_PRECISIONS,
                   help="the candidate's MegaMoE precision (default bf16); the reference runs stay bf16, and a "
                   f"non-bf16 candidate gets margins widened by {100 * FP8_MARGIN_REL:g}%% of the loss")
    p.add_argument("--reference-seeds", type=int, default=2,
                   help="number of reference runs (data-order seeds 0, 1, ...); >= 2 to span a band")
    p.add_argument("--candidate-seed", type=int, default=None,
                   help="data-order seed of the candidate (default: the first reference seed)")
    p.add_argument("--init-seed", type=int, default=1234, help="seed of the one shared initialisation")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--cpu-threads", type=int, default=0, help="torch.set_num_threads for CPU runs (0: torch's)")
    p.add_argument("--tiny", action="store_true",
                   help=f"tiny sizes for a CPU smoke run (sets {', '.join(sorted(TINY))} unless given)")
    # model
    p.add_argument("--layers", type=int, default=None, help="blocks (default 4)")
    p.add_argument("--hidden", type=int, default=None, help="H (default 512; a multiple of 128 for kernels)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 8)")
    p.add_argument("--intermediate", type=int, default=None, help="expert I (default 256; multiple of 128)")
    p.add_argument("--experts", type=int, default=None, help="E (default 16)")
    p.add_argument("--top-k", type=int, default=None, help="K (default 4)")
    p.add_argument("--aux-weight", type=float, default=0.01, help="weight of the load-balancing loss")
    p.add_argument("--recompute", action="store_true", help="MegaMoE(recompute=True)")
    p.add_argument("--activation-clamp", type=float, default=None,
                   help="MegaMoE(activation_clamp=C), in the reference runs and the candidate alike")
    p.add_argument("--wgrad-accum", action="store_true",
                   help="MegaMoE adds its weight gradients in fp32 into the masters' .grad (wgrad_accum)")
    p.add_argument("--staging-buffer", action="store_true",
                   help="MegaMoE(max_tokens_per_rank=batch*seq): allocate the staging buffer up front")
    p.add_argument("--no-autocast", action="store_true", help="run the non-MoE parts in fp32")
    p.add_argument("--torch-gemms", action="store_true",
                   help="the candidate's grouped GEMMs on torch's grouped GEMM (prime_kernels.grouped_gemm_torch."
                   "forced): the path of GPUs without our sm90 GEMMs, checked on one that has them; needs "
                   "--backend grouped and bf16")
    # data and optimisation
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 16: 4096 tokens)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 400)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine decay ends at this fraction of --lr")
    p.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default 30)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: none)")
    p.add_argument("--corpus-max-bytes", type=int, default=None,
                   help="read the sorted stdlib sources up to this many bytes (default 0: all)")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches per evaluation (default 16)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps, 0: only at the end "
                   "(default 100)")
    # rule
    p.add_argument("--smooth", type=int, default=None, help="W, the trailing-mean window (default 25)")
    p.add_argument("--check-last", type=int, default=None, help="N, steps checked against the band "
                   "(default: half the run)")
    p.add_argument("--margin", type=float, default=0.03, help="the smallest margin, nats")
    p.add_argument("--margin-frac", type=float, default=0.5, help="margin as a fraction of the band's width")
    # output
    p.add_argument("--log-every", type=int, default=None, help="print every N steps (default 50)")
    p.add_argument("--out", default=None, help="results JSON path (the PNG goes next to it); "
                   "default bench/results/train_parity_<device>_<backend>[_<precision>]_<date>.json")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    defaults = dict(layers=4, hidden=512, heads=8, intermediate=256, experts=16, top_k=4, seq=256, batch=16,
                    steps=400, warmup=30, smooth=25, check_last=None, eval_batches=16, eval_every=100,
                    log_every=50, corpus_max_bytes=0)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, TINY[k] if args.tiny else v)
    if args.check_last is None:
        args.check_last = max(1, args.steps // 2)
    if args.reference_seeds < 1:
        p.error("--reference-seeds must be >= 1")
    if args.candidate_seed is None:
        args.candidate_seed = 0
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        p.error("--hidden must be a multiple of --heads with an even head size")
    if args.top_k > args.experts:
        p.error("--top-k must be <= --experts")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.torch_gemms and (args.backend != "grouped" or args.precision != "bf16"):
        p.error("--torch-gemms needs --backend grouped --precision bf16 (torch's grouped GEMMs are bf16 here)")
    return args


# ------------------------------------------------------------------------------------------------
# corpus and batches
# ------------------------------------------------------------------------------------------------


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [N]
    val: torch.Tensor  # uint8 [M]
    meta: dict


def stdlib_sources() -> list[Path]:
    """The standard library's own ``*.py`` files, sorted, without site-packages, test suites and caches."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
    files = [f for f in root.rglob("*.py") if not (skip & set(f.relative_to(root).parts[:-1]))]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def load_corpus(max_bytes: int = 0, val_every: int = 20) -> Corpus:
    """Read the sources as bytes; every ``val_every``-th file is held out. Files are joined by a NUL."""
    files = stdlib_sources()
    if not files:
        raise RuntimeError(f"no *.py files under {sysconfig.get_paths()['stdlib']}")
    train, val, total = [], [], 0
    for i, f in enumerate(files):
        data = f.read_bytes() + b"\0"
        (val if i % val_every == 0 else train).append(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    tr, va = b"".join(train), b"".join(val)
    if not tr or not va:
        raise RuntimeError(f"the corpus is too small to split ({total} bytes); raise --corpus-max-bytes")
    sha = hashlib.sha256(tr + b"\1" + va).hexdigest()
    meta = {"root": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0], "files": len(train) + len(val),
            "train_bytes": len(tr), "val_bytes": len(va), "sha256": sha}
    as_t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_t(tr), as_t(va), meta)


def batch_offsets(n_bytes: int, seq: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    if n_bytes < seq + 2:
        raise ValueError(f"the corpus split has {n_bytes} bytes, fewer than seq + 2 = {seq + 2}")
    return torch.randint(0, n_bytes - seq - 1, (batch,), generator=gen)


def make_batch(data: torch.Tensor, offsets: torch.Tensor, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + torch.arange(seq + 1)[None, :]
    win = data[idx].long()
    return win[:, :-1].to(device, non_blocking=True), win[:, 1:].to(device, non_blocking=True)


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------


def rope_tables(seq: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x, cos, sin):
    # x [B, nh, S, d]: rotate the pairs (first half, second half)
    d2 = x.shape[-1] // 2
    a, b = x[..., :d2], x[..., d2:]
    c, s = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cos, sin):
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, H))


class MoE(nn.Module):
    """fp32 router -> softmax -> top-k (renormalised) -> ``MegaMoE`` (bf16 in and out)."""

    def __init__(self, args, backend: str, precision: str = "bf16"):
        super().__init__()
        from prime_kernels.mega import MegaMoE  # noqa: PLC0415

        self.E, self.K = args.experts, args.top_k
        self.router = nn.Linear(args.hidden, args.experts, bias=False)
        kw = {}
        if args.staging_buffer:
            kw["max_tokens_per_rank"] = args.batch * args.seq
        self.experts = MegaMoE(args.experts, args.hidden, args.intermediate, args.top_k, backend=backend,
                               precision=precision, recompute=args.recompute, device=args.device,
                               activation_clamp=args.activation_clamp, dtype=torch.bfloat16, **kw)
        self.wgrad_accum = None  # set by the trainer with --wgrad-accum

    def forward(self, x):
        B, S, H = x.shape
        with torch.autocast(x.device.type, enabled=False):
            flat = x.reshape(B * S, H)
            probs = torch.softmax(self.router(flat.float()), dim=-1)
            top_w, top_i = probs.topk(self.K, dim=-1)
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            # Switch-style balance: E * sum_e (fraction of routes to e) * (mean router prob of e)
            frac = torch.bincount(top_i.reshape(-1), minlength=self.E).float() / top_i.numel()
            aux = self.E * (frac * probs.mean(0)).sum()
            y = self.experts(flat.to(torch.bfloat16).contiguous(), top_i.contiguous(), top_w.float().contiguous(),
                             wgrad_accum=self.wgrad_accum)
        return y.float().view(B, S, H), aux


class Block(nn.Module):
    def __init__(self, args, backend: str, precision: str = "bf16"):
        super().__init__()
        self.norm1 = nn.RMSNorm(args.hidden)
        self.attn = Attention(args.hidden, args.heads)
        self.norm2 = nn.RMSNorm(args.hidden)
        self.moe = MoE(args, backend, precision)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin).float()
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class MoELM(nn.Module):
    def __init__(self, args, backend: str, precision: str = "bf16"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, args.hidden)
        self.blocks = nn.ModuleList(Block(args, backend, precision) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, VOCAB, bias=False)  # untied
        cos, sin = rope_tables(args.seq, args.hidden // args.heads, args.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens).float()
        aux = x.new_zeros(())
        for blk in self.blocks:
            x, a = blk(x, self.cos, self.sin)
            aux = aux + a
        return self.head(self.norm(x)).float(), aux / len(self.blocks)


def initial_state(args) -> dict[str, torch.Tensor]:
    """The one initialisation every run starts from (fp32 on the CPU, from a CPU generator)."""
    g = torch.Generator().manual_seed(args.init_seed)
    out_std = 0.02 / math.sqrt(2 * args.layers)  # residual-branch outputs
    shapes = {n: tuple(p.shape) for n, p in MoELM(_cpu_args(args), "reference").named_parameters()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")):
            state[name] = torch.ones(shape)
            continue
        std = out_std if name.endswith(("attn.proj.weight", "experts.w2")) else 0.02
        state[name] = torch.randn(shape, generator=g) * std
    return state


def _cpu_args(args):
    a = argparse.Namespace(**vars(args))
    a.device, a.staging_buffer = "cpu", False
    return a


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------


def resolved_backends(backend: str, args, precision: str | None = None) -> dict:
    """What MegaMoE(backend=..., precision=...) runs here for (fwd, bwd): "fused", "grouped", "reference", or
    the error. ``precision`` defaults to the candidate's (``args.precision``): the FP8 paths have kernels of
    their own, so a backend that runs BF16 here may not run FP8."""
    from prime_kernels.mega import _backend  # noqa: PLC0415

    precision = precision or args.precision
    out = {}
    for d in ("fwd", "bwd"):
        try:
            out[d] = _backend.resolve_backend(backend, precision, d, device_type=torch.device(args.device).type,
                                              hidden=args.hidden, intermediate=args.intermediate)
        except Exception as exc:  # noqa: BLE001  (reported, and the run stops before training)
            out[d] = f"unavailable: {exc}"
    return out


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@torch.no_grad()
def evaluate(model, corpus, args) -> float:
    g = torch.Generator().manual_seed(987654321)  # the same held-out batches for every run
    model.eval()
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = make_batch(corpus.val, batch_offsets(len(corpus.val), args.seq, args.batch, g), args.seq, args.device)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=not args.no_autocast):
            logits, _ = model(x)
        total += F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    model.train()
    return total / args.eval_batches


def train_run(args, corpus, init: dict, backend: str, data_seed: int, label: str, precision: str = "bf16") -> dict:
    """Train one run from ``init``; return its curves. ``precision`` is MegaMoE's, passed in rather than read
    from ``args.precision`` because that one is the candidate's and the reference runs are always BF16."""
    torch.manual_seed(args.init_seed)  # nothing random is drawn from it, but keep runs alike
    device = torch.device(args.device)
    model = MoELM(args, backend, precision).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    # fp32 masters: the fp32 parameters are their own masters; the bf16 MegaMoE weights get copies
    pairs, opt_params, decay, no_decay = [], [], [], []
    for name, p in model.named_parameters():
        m = p
        if p.dtype != torch.float32:
            m = torch.nn.Parameter(init[name].to(device=device, dtype=torch.float32).clone())
            pairs.append((p, m))
        (decay if p.dim() >= 2 and not name.startswith("embed") else no_decay).append(m)
        opt_params.append(m)
    accum = {}
    if args.wgrad_accum:
        for blk in model.blocks:
            ex = blk.moe.experts
            bufs = []
            for p in (ex.w13, ex.w2):
                m = next(mm for pp, mm in pairs if pp is p)
                m.grad = torch.zeros_like(m)
                accum[id(m)] = m
                bufs.append(m.grad)
            blk.moe.wgrad_accum = tuple(bufs)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(1000 + data_seed)
    losses, auxes, gnorms, evals = [], [], [], []
    dtype_ctx = dict(device_type=device.type, dtype=torch.bfloat16, enabled=not args.no_autocast)
    _sync(device)
    t0 = time.perf_counter()
    t_log = t0
    for step in range(args.steps):
        x, y = make_batch(corpus.train, batch_offsets(len(corpus.train), args.seq, args.batch, gen), args.seq, device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        for m in opt_params:
            if id(m) in accum:
                m.grad.zero_()
            else:
                m.grad = None
        with torch.autocast(**dtype_ctx):
            logits, aux = model(x)
        lm = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        (lm + args.aux_weight * aux).backward()
        for p, m in pairs:
            if id(m) not in accum:
                m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        gn = torch.nn.utils.clip_grad_norm_(opt_params, args.clip if args.clip > 0 else float("inf"))
        opt.step()
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)
        losses.append(lm.item())
        auxes.append(aux.item())
        gnorms.append(gn.item())
        last = step == args.steps - 1
        if (args.eval_every and (step + 1) % args.eval_every == 0) or last:
            evals.append((step + 1, evaluate(model, corpus, args)))
        if args.log_every and ((step + 1) % args.log_every == 0 or last):
            _sync(device)
            now = time.perf_counter()
            n = args.log_every if (step + 1) % args.log_every == 0 else (step + 1) % args.log_every
            ev = f"  eval {evals[-1][1]:.4f}" if evals and evals[-1][0] == step + 1 else ""
            print(f"[{label}] step {step + 1:5d}  loss {losses[-1]:.4f}  aux {auxes[-1]:.3f}  gnorm {gnorms[-1]:.3f}  "
                  f"lr {lr_at(step, args):.2e}  {1e3 * (now - t_log) / n:.1f} ms/step{ev}", flush=True)
            t_log = now
    _sync(device)
    secs = time.perf_counter() - t0
    return {"label": label, "backend": backend, "precision": precision, "data_seed": data_seed, "loss": losses,
            "aux": auxes, "grad_norm": gnorms, "eval": evals, "final_eval_loss": evals[-1][1],
            "seconds": round(secs, 2), "tokens_per_s": round(args.steps * args.batch * args.seq / secs, 1)}


# ------------------------------------------------------------------------------------------------
# the rule
# ------------------------------------------------------------------------------------------------


def smooth(xs, w: int) -> list[float]:
    """Trailing mean over ``w`` steps (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(xs):
        acc += v
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def judge(candidate: dict, references: list[dict], *, smooth_w: int, check_last: int, margin: float,
          margin_frac: float, precision: str = "bf16") -> dict:
    """Apply the pass rule of the module docstring; return the verdict with its numbers. ``precision`` is the
    candidate's: anything but "bf16" widens both margins by FP8_MARGIN_REL of the loss. In the verdict
    ``margin`` is the band margin before the widening and ``band_margin`` the one applied at each step;
    ``final_margin`` is the applied final-loss margin (``final_margin_base`` before the widening)."""
    if precision not in CHECK_PRECISIONS:  # a misspelt precision must not silently get the widening
        raise ValueError(f"precision must be one of {CHECK_PRECISIONS}, got {precision!r}")
    reasons = []
    n = len(candidate["loss"])
    for r in [candidate, *references]:
        if len(r["loss"]) != n:
            raise ValueError("every run must have the same number of steps")
        if not all(math.isfinite(v) for v in r["loss"]):
            reasons.append(f"{r['label']}: non-finite training loss")
    sc = smooth(candidate["loss"], smooth_w)
    sr = [smooth(r["loss"], smooth_w) for r in references]
    lo = [min(c) for c in zip(*sr)]
    hi = [max(c) for c in zip(*sr)]
    start = max(0, n - check_last)
    widths = [hi[t] - lo[t] for t in range(start, n)]
    m = max(margin, margin_frac * statistics.median(widths)) if widths else margin
    # relative to the loss, since FP8 rounding moves the loss in proportion to it, not by fixed nats
    rel = 0.0 if precision == "bf16" else FP8_MARGIN_REL
    mt = [m + rel * (a + b) / 2 for a, b in zip(lo, hi)]
    outside = [t for t in range(start, n) if not (lo[t] - mt[t] <= sc[t] <= hi[t] + mt[t])]
    worst_t, worst = None, 0.0
    for t in range(start, n):
        d = max(lo[t] - sc[t], sc[t] - hi[t])  # > 0 outside the band, <= 0 inside
        if worst_t is None or d > worst:
            worst_t, worst = t, d
    widened = f" + {rel:.1%} of the band centre ({precision} candidate)" if rel else ""
    if outside:
        reasons.append(f"smoothed loss outside the band +- {m:.4f}{widened} at {len(outside)} of the last "
                       f"{n - start} steps (worst: step {worst_t + 1}, {worst:.4f} nats beyond the band, margin "
                       f"{mt[worst_t]:.4f} there)")
    fr = [r["final_eval_loss"] for r in references]
    mf_base = max(margin, margin_frac * (max(fr) - min(fr)))
    mf = mf_base + rel * statistics.mean(fr)
    fc = candidate["final_eval_loss"]
    final_ok = math.isfinite(fc) and min(fr) - mf <= fc <= max(fr) + mf
    if not final_ok:
        why_mf = f" ({mf_base:.4f} + {rel:.1%} of the references' mean, {precision} candidate)" if rel else ""
        reasons.append(f"final eval loss {fc:.4f} outside [{min(fr):.4f}, {max(fr):.4f}] +- {mf:.4f}{why_mf}")
    same = [r for r in references if r["data_seed"] == candidate["data_seed"]]
    dev_same = (max(abs(sc[t] - s) for t, s in enumerate(smooth(same[0]["loss"], smooth_w)) if t >= start)
                if same else None)
    return {
        "pass": not reasons, "reasons": reasons, "smooth": smooth_w, "check_from_step": start + 1,
        "precision": precision, "margin_rel": rel, "margin": m, "band_margin": mt, "final_margin": mf,
        "final_margin_base": mf_base, "steps_outside": [t + 1 for t in outside],
        "worst_step": (worst_t + 1) if worst_t is not None else None, "worst_beyond_band": worst,
        "median_band_width": statistics.median(widths) if widths else 0.0,
        "final_eval_candidate": fc, "final_eval_references": fr,
        "max_abs_diff_vs_same_seed_reference": dev_same,
        "candidate_smoothed": sc, "band_lo": lo, "band_hi": hi,
    }


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------




def plot(doc: dict, png: Path) -> Path | None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return None
    v = doc["verdict"]
    cand = doc["candidate"]
    n = len(cand["loss"])
    steps = list(range(1, n + 1))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    ax.fill_between(steps, v["band_lo"], v["band_hi"], color="tab:blue", alpha=0.25,
                    label=f"reference band ({len(doc['references'])} data-order seeds, smoothed)")
    for r in doc["references"]:
        ax.plot(steps, r["loss"], color="tab:blue", alpha=0.12, lw=0.6)
        ax.plot(steps, smooth(r["loss"], v["smooth"]), color="tab:blue", lw=0.8, alpha=0.7)
    ax.plot(steps, cand["loss"], color="tab:red", alpha=0.15, lw=0.6)
    res = doc["resolved_candidate_backend"]
    prec = v.get("precision", "bf16")  # results files written before --precision were all bf16
    ax.plot(steps, v["candidate_smoothed"], color="tab:red", lw=1.6,
            label=f"candidate {doc['config']['backend']} {prec} (fwd {res['fwd']}, bwd {res['bwd']}), "
                  f"seed {cand['data_seed']}")
    for r in doc["references"]:
        ax.plot(*zip(*r["eval"]), "o", color="tab:blue", ms=4, mfc="none")
    ax.plot(*zip(*cand["eval"]), "x", color="tab:red", ms=6, label="held-out eval loss")
    ax.axvspan(v["check_from_step"], n, color="0.5", alpha=0.08, label=f"checked (last {n - v['check_from_step'] + 1})")
    evals = [e for r in [*doc["references"], cand] for _, e in r["eval"]]
    lo_y = min(min(v["band_lo"]), min(v["candidate_smoothed"]), *evals)
    ax.set_ylim(lo_y - 0.1, min(max(v["band_hi"][0], v["candidate_smoothed"][0]) + 0.1, lo_y + 3.0))
    ax.set_ylabel("training loss, nats/byte")
    c = doc["config"]
    widened = f" + {v['margin_rel']:.1%} of the loss" if v.get("margin_rel") else ""
    ax.set_title(f"{'PASS' if v['pass'] else 'FAIL'}: MoE LM training parity on {doc['device']}, {doc['git_sha'][:12]}\n"
                 f"candidate {prec} against bf16 references" + (f", margins{widened}" if widened else "") + "\n"
                 f"L={c['layers']} H={c['hidden']} I={c['intermediate']} E={c['experts']} top-{c['top_k']}, "
                 f"{c['batch']}x{c['seq']} tokens/step, {n} steps, smoothing {v['smooth']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    mid = [(a + b) / 2 for a, b in zip(v["band_lo"], v["band_hi"])]
    half = [(b - a) / 2 for a, b in zip(v["band_lo"], v["band_hi"])]
    bm = v.get("band_margin") or [v["margin"]] * n  # per step: the FP8 widening follows the loss
    ax2.fill_between(steps, [-h - b for h, b in zip(half, bm)], [h + b for h, b in zip(half, bm)], color="0.8",
                     label=f"band +- margin {v['margin']:.3f}{widened}")
    ax2.fill_between(steps, [-h for h in half], half, color="tab:blue", alpha=0.3)
    ax2.plot(steps, [s - m for s, m in zip(v["candidate_smoothed"], mid)], color="tab:red", lw=1.2,
             label="candidate (smoothed)")
    same = [r for r in doc["references"] if r["data_seed"] == cand["data_seed"]]
    if same:
        ax2.plot(steps, [a - b for a, b in zip(v["candidate_smoothed"], smooth(same[0]["loss"], v["smooth"]))],
                 color="k", lw=0.8, label=f"candidate - {same[0]['label']} (same batches)")
    ax2.axvline(v["check_from_step"], color="0.4", lw=0.8, ls="--")
    ax2.set_ylabel("candidate - band centre")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def default_out(doc: dict) -> Path:
    """bench/results/train_parity_<device>_<backend>[-<what it ran>][_<precision>]_<UTC stamp>.json (the
    precision only when it is not bf16, so the names of BF16 results stay as they were)."""
    tag = doc["device"].replace("NVIDIA ", "").replace(" ", "-").lower()
    ran = sorted(set(doc["resolved_candidate_backend"].values()))
    name = doc["config"]["backend"]
    if ran != [name]:
        name += "-" + "+".join(ran)
    precision = doc["config"].get("precision", "bf16")
    if precision != "bf16":
        name += "_" + precision
    stamp = doc["date"].replace(":", "").replace("-", "")
    return RESULTS_DIR / f"train_parity_{tag}_{name}_{stamp}.json"


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def _rule_text(precision: str) -> str:
    """The docstring's pass rule, and which of its variants this run applied (a reader of the JSON should not
    have to work out from the config whether the FP8 widening was on)."""
    rule = __doc__.split("Pass rule")[1].split("The script prints")[0].strip()
    applied = (f"the candidate precision is {precision!r}: the margins are widened by {FP8_MARGIN_REL:.1%} of the loss"
               if precision != "bf16" else "the candidate precision is 'bf16': the margins are not widened")
    return f"{rule}\n\nApplied here: {applied}."


def run_parity(args) -> dict:
    """Every run and the verdict (no files written)."""
    res = resolved_backends(args.backend, args)
    bad = [f"{d}: {r}" for d, r in res.items() if r.startswith("unavailable")]
    if bad:
        raise SystemExit("train_parity: the candidate backend cannot run here: " + "; ".join(bad))
    candidate_is_reference = all(r == "reference" for r in res.values())
    print(f"candidate backend {args.backend!r} precision {args.precision!r} runs fwd={res['fwd']} bwd={res['bwd']} "
          f"on {args.device} (references: bf16)")
    if candidate_is_reference:
        print("note: the candidate is the reference itself" + (f" (its {args.precision} emulation)"
              if args.precision != "bf16" else "") + ": this checks the harness, not a kernel")
    corpus = load_corpus(args.corpus_max_bytes)
    m = corpus.meta
    print(f"corpus: {m['files']} stdlib files from {m['root']}, {m['train_bytes']} train / {m['val_bytes']} held-out "
          f"bytes, sha256 {m['sha256'][:16]}")
    init = initial_state(args)
    n_par = sum(t.numel() for t in init.values())
    n_exp = sum(t.numel() for k, t in init.items() if ".experts." in k)
    print(f"model: {n_par / 1e6:.2f}M parameters ({n_exp / 1e6:.2f}M in experts), L={args.layers} H={args.hidden} "
          f"I={args.intermediate} E={args.experts} top-{args.top_k}; {args.batch}x{args.seq} tokens x {args.steps} steps")
    refs = [train_run(args, corpus, init, "reference", s, f"reference seed {s}") for s in range(args.reference_seeds)]
    label = f"candidate {args.backend}" + (f" {args.precision}" if args.precision != "bf16" else "")
    label += " on torch's grouped GEMMs" if args.torch_gemms else ""
    from prime_kernels import grouped_gemm_torch  # noqa: PLC0415

    with grouped_gemm_torch.forced() if args.torch_gemms else contextlib.nullcontext():
        cand = train_run(args, corpus, init, args.backend, args.candidate_seed, label, precision=args.precision)
    verdict = judge(cand, refs, smooth_w=args.smooth, check_last=args.check_last, margin=args.margin,
                    margin_frac=args.margin_frac, precision=args.precision)
    dev = torch.device(args.device)
    import prime_kernels  # noqa: PLC0415

    return {
        "script": "examples/train_parity.py", "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_sha": git_sha(), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "prime_kernels_build": prime_kernels.build_info(),
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "resolved_candidate_backend": res, "candidate_is_reference": candidate_is_reference,
        "parameters": n_par, "corpus": corpus.meta, "rule": _rule_text(args.precision), "verdict": verdict,
        "candidate": cand, "references": refs,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    try:
        doc = run_parity(args)
    finally:
        torch.set_num_threads(threads)
    v = doc["verdict"]
    out = Path(args.out) if args.out else default_out(doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    png = None if args.no_plot else plot(doc, out.with_suffix(".png"))
    cand = doc["candidate"]
    print(f"final eval loss: candidate {v['final_eval_candidate']:.4f}, references "
          f"{', '.join(f'{x:.4f}' for x in v['final_eval_references'])} (margin {v['final_margin']:.4f})")
    widened = (f" + {v['margin_rel']:.1%} of the band centre ({v['band_margin'][v['worst_step'] - 1]:.4f} at the worst "
               f"step)" if v["margin_rel"] and v["worst_step"] is not None else "")
    print(f"last {len(cand['loss']) - v['check_from_step'] + 1} steps: band median width {v['median_band_width']:.4f}, "
          f"margin {v['margin']:.4f}{widened}, worst {v['worst_beyond_band']:+.4f} nats beyond the band at step "
          f"{v['worst_step']}"
          + (f"; max |candidate - same-seed reference| {v['max_abs_diff_vs_same_seed_reference']:.4f}"
             if v["max_abs_diff_vs_same_seed_reference"] is not None else ""))
    print("time: " + ", ".join(f"{r['label']} {r['seconds']:.1f} s ({r['tokens_per_s']:.0f} tok/s)"
                               for r in [*doc["references"], cand]))
    print(f"results: {out}" + (f", {png}" if png else ""))
    if doc["candidate_is_reference"]:
        print("(the candidate was the reference: a harness check, not the kernel parity check)")
    print("PASS" if v["pass"] else "FAIL: " + "; ".join(v["reasons"]))
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
