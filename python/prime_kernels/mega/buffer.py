"""The staging buffer of the DeepGEMM-shaped low-level calls.

Allocate it once, before the first step (never inside a forward or an activation-checkpoint
recompute: with a process group the allocation is collective), and share it between every layer
of the same shape. ``get_symm_buffer_for_mega_moe`` caches buffers by (group, device, shape,
mma_type), so every layer that asks with the same arguments gets the same object.

With ``group=None`` (or a group of one rank) the buffer is an ordinary allocation. With a
``torch.distributed`` group on CUDA it is torch symmetric memory
(``torch.distributed._symmetric_memory``), so peers can address it; on CPU (gloo) it is an
ordinary allocation.

Views (all aliasing one byte allocation):
  x             [Tmax, H]  bf16 (mma_type "bf16xbf16"), float8_e4m3fn otherwise
  x_sf          [Tmax, H/128] fp32 (fp8 mma types only; H/32 int32-packed UE8M0 for "fp8xfp4")
  topk_idx      [Tmax, K]  int64, -1 = masked route
  topk_weights  [Tmax, K]  fp32
  dy            [Tmax, H]  bf16 (the backward's staging area)
Callers copy their inputs into ``buffer.x[:T]``, ``buffer.topk_idx[:T]``, ``buffer.topk_weights[:T]``
(or call :meth:`SymmBuffer.stage`) before a forward call, and again before a backward call that gets no
``state`` (as upstream). ``SymmBuffer.generation`` counts the stagings: a forward's state records it, and a
backward given that state refuses to run once the buffer has been staged again (its plan and h would belong to
other inputs).
"""

from __future__ import annotations

import itertools

import torch

MMA_TYPES = ("bf16xbf16", "fp8xfp8", "fp8xfp4")
_ALIGN = 256  # byte alignment of each view

_cache: dict = {}
_registry: dict = {}
_next_id = itertools.count(1)


def _round_up(v, a):
    return (v + a - 1) // a * a


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def packed_offsets(specs) -> tuple[list[int], int]:
    """Byte offsets of (name, shape, dtype) buffers laid one after another in one allocation, each starting on a
    multiple of _ALIGN bytes, and the allocation's size."""
    offsets, total = [], 0
    for _, shape, dt in specs:
        offsets.append(total)
        total = _round_up(total + _nbytes(shape, dt), _ALIGN)
    return offsets, total


def packed_views(raw: torch.Tensor, specs, offsets) -> dict[str, torch.Tensor]:
    """The buffers of :func:`packed_offsets` inside ``raw`` (uint8), by name."""
    return {name: raw[off:off + _nbytes(shape, dt)].view(dt).view(shape)
            for (name, shape, dt), off in zip(specs, offsets)}


def symmetric_empty(num_bytes: int, device, group):
    """(uint8 [num_bytes] in torch symmetric memory on ``device``, its rendezvous handle over ``group``): a
    collective; every peer's allocation is then reachable through the handle."""
    import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed by older torch; idempotent
        enable(group.group_name)
    raw = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
    return raw, symm_mem.rendezvous(raw, group.group_name)


class SymmBuffer:
    """A staging buffer (see the module docstring)."""

    def __init__(
        self,
        group,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        mma_type: str = "bf16xbf16",
        activation: str = "swiglu",
        *,
        device=None,
        num_shared_experts: int = 0,
    ):
        from ._validate import _fail  # noqa: PLC0415

        if mma_type not in MMA_TYPES:
            _fail(f"mma_type must be one of {MMA_TYPES}, got {mma_type!r}")
        if activation != "swiglu":
            _fail(f"only activation='swiglu' is supported, got {activation!r}")
        for name, v in (("num_experts", num_experts), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                        ("num_topk", num_topk), ("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
            if int(v) < 1:
                _fail(f"{name} must be >= 1, got {v}")
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            _fail(f"num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
        # the shared experts' weights come with each call (shared_l1_weights / shared_l2_weights); their rows are the
        # staged tokens, so they need no staging of their own: the count is kept for the call sites that read it
        self.num_shared_experts = num_shared_experts
        self.group = group
        self.num_ranks = 1
        self.rank = 0
        if group is not None:
            import torch.distributed as dist  # noqa: PLC0415

            from .loopback import LoopbackGroup  # noqa: PLC0415

            if isinstance(group, LoopbackGroup):
                _fail("a LoopbackGroup has no symmetric buffer (its ranks are threads of one process): pass it to "
                      "mega_moe / the backends directly")
            self.num_ranks = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        if num_experts % self.num_ranks:
            _fail(f"num_experts={num_experts} is not divisible by the group size {self.num_ranks}; use a group whose size divides it")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.num_experts = int(num_experts)
        self.num_local_experts = self.num_experts // self.num_ranks
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        self.num_topk = int(num_topk)
        self.hidden = int(hidden)
        self.intermediate_hidden = int(intermediate_hidden)
        self.mma_type = mma_type
        self.activation = activation

        Tm, H, K = self.num_max_tokens_per_rank, self.hidden, self.num_topk
        fp8 = mma_type != "bf16xbf16"
        specs = [("x", (Tm, H), torch.float8_e4m3fn if fp8 else torch.bfloat16)]
        if mma_type == "fp8xfp8":
            specs.append(("x_sf", (Tm, max(1, H // 128)), torch.float32))
        elif mma_type == "fp8xfp4":
            specs.append(("x_sf", (Tm, max(1, H // 128)), torch.int32))
        specs += [
            ("topk_idx", (Tm, K), torch.int64),
            ("topk_weights", (Tm, K), torch.float32),
            ("dy", (Tm, H), torch.bfloat16),
        ]
        offsets, total = packed_offsets(specs)
        self.num_bytes = total
        self.symmetric = False
        self.handle = None
        if self.num_ranks > 1 and self.device.type == "cuda":
            raw, self.handle = symmetric_empty(total, self.device, group)
            self.symmetric = True
        else:
            raw = torch.empty(total, dtype=torch.uint8, device=self.device)
        raw.zero_()
        self.raw = raw
        for name, view in packed_views(raw, specs, offsets).items():
            setattr(self, name, view)
        self.topk_idx.fill_(-1)
        self._generation = 0
        self._seen_version = self._raw_version()
        if self.num_ranks > 1:
            import torch.distributed as dist  # noqa: PLC0415

            dist.barrier(group=group)
        self.buffer_id = next(_next_id)
        _registry[self.buffer_id] = self

    @property
    def group_name(self) -> str:
        return "" if self.group is None or self.num_ranks == 1 else self.group.group_name

    def _raw_version(self):
        """The version counter every view of the allocation shares (any in-place write bumps it), or None for a
        buffer allocated under inference mode, whose tensors keep no counter (only stage() counts there)."""
        try:
            return self.raw._version
        except RuntimeError:
            return None

    @property
    def generation(self) -> int:
        """The staging count: one more after every :meth:`stage`, and one more at the first read after any other
        in-place write into the views (a caller's ``buffer.x[:T].copy_(x)``), however many writes that staging
        took."""
        v = self._raw_version()
        if v != self._seen_version:
            self._seen_version = v
            self._generation += 1
        return self._generation

    def stage(self, x, topk_idx, topk_weights):
        """Copy a step's inputs into the staging views (rows [0, T)); a new generation."""
        T = x.shape[0]
        if T > self.num_max_tokens_per_rank:
            from ._validate import _fail  # noqa: PLC0415

            _fail(f"{T} tokens exceed the buffer's num_max_tokens_per_rank={self.num_max_tokens_per_rank}; allocate the buffer with a larger max")
        self.generation  # noqa: B018  (folds earlier direct writes into the previous generation)
        self.x[:T].copy_(x)
        self.topk_idx[:T].copy_(topk_idx)
        self.topk_weights[:T].copy_(topk_weights)
        self._generation += 1
        self._seen_version = self._raw_version()

    def __repr__(self):
        return (f"SymmBuffer(ranks={self.num_ranks}, E={self.num_experts}, Tmax={self.num_max_tokens_per_rank}, "
                f"K={self.num_topk}, H={self.hidden}, I={self.intermediate_hidden}, mma_type={self.mma_type!r}, "
                f"device={self.device}, symmetric={self.symmetric}, bytes={self.num_bytes})")


def get_buffer(buffer_id: int):
    """The buffer registered under ``buffer_id`` (0 = none)."""
    return _registry.get(int(buffer_id)) if buffer_id else None


def get_symm_buffer_for_mega_moe(
    group,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    use_fp8_dispatch=None,
    mma_type: str = "bf16xbf16",
    activation: str = "swiglu",
    *,
    device=None,
    reuse: bool = True,
    num_shared_experts: int = 0,
) -> SymmBuffer:
    """Allocate (or, with ``reuse=True``, return the cached) staging buffer for this shape.

    Positional arguments as upstream DeepGEMM. ``use_fp8_dispatch`` is accepted for old call sites:
    True selects ``mma_type="fp8xfp8"``. Call it once before the first step, outside any compiled
    or checkpointed region. ``num_shared_experts`` (as the fork's buffer takes it) is recorded; the shared experts
    stage nothing of their own.
    """
    if use_fp8_dispatch is not None and use_fp8_dispatch and mma_type == "bf16xbf16":
        mma_type = "fp8xfp8"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    gkey = None if group is None else (id(group), getattr(group, "group_name", None))
    key = (gkey, str(device), int(num_experts), int(num_max_tokens_per_rank), int(num_topk), int(hidden),
           int(intermediate_hidden), mma_type, activation, num_shared_experts)
    if reuse and key in _cache:
        return _cache[key]
    buf = SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                     mma_type, activation, device=device, num_shared_experts=num_shared_experts)
    if reuse:
        _cache[key] = buf
    return buf
