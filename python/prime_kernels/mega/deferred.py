"""Deferred weight gradients: the backward returns dX and d topk_weights, and dW13 / dW2 are added later.

Pipeline-parallel and FSDP trainers schedule the weight gradients apart from the data gradients: the next stage
needs dX at once, the weight gradients only at the last micro-batch (or when the gradient reduction starts). Pass a
:class:`DeferredWgrad` as ``wgrad_accum`` to :func:`~prime_kernels.mega.mega_moe` (or ``MegaMoE.forward``): each
backward then computes dX and d topk_weights and queues its weight-gradient work; :meth:`DeferredWgrad.flush` runs
the queue in order, adding into the fp32 accumulators, on a side stream if one is given. The result is bitwise the
immediate path's (``wgrad_accum=(dw13_fp32, dw2_fp32)`` on every backward): the same additions in the same order.

What a queued backward keeps until the flush (memory): on the kernel backends (bf16) the weight-gradient GEMMs'
operands in pool order, [capacity, H] dy and x rows, [capacity, I] w * s and [capacity, 2I] dh (bf16); elsewhere
(the reference, the FP8 precisions) the backward's own inputs, and the flush runs that backward again with the
data gradients discarded. With expert parallelism every rank must flush the same queue (the re-run exchanges rows).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Optional

import torch

from . import _validate

_next_id = itertools.count(1)
_registry: "weakref.WeakValueDictionary[int, DeferredWgrad]" = weakref.WeakValueDictionary()


class WgradLater:
    """One backward's queued weight-gradient work: ``run(dw13_accum, dw2_accum)`` adds its gradients; ``tensors``
    are the device tensors it reads (kept alive, and marked for a side stream, until it ran)."""

    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor], None], tensors):
        self.run = run
        self.tensors = [t for t in tensors if isinstance(t, torch.Tensor)]


class DeferredWgrad:
    """fp32 accumulators (dw13 like w13, dw2 like w2) whose additions wait for :meth:`flush`.

    ``stream``: the CUDA stream the flush runs the queued work on (default: the current stream at the flush). It
    starts after what the current stream has queued by then; :meth:`wait` makes the current stream wait for it, and
    the accumulators must not be read before that. ``max_pending``: the most backwards queued at once (each holds its
    operands, see the module docstring); one more raises rather than growing the memory without a bound."""

    def __init__(self, dw13: torch.Tensor, dw2: torch.Tensor, *, stream: Optional[torch.cuda.Stream] = None,
                 max_pending: int = 64):
        for name, t in (("dw13", dw13), ("dw2", dw2)):
            if not isinstance(t, torch.Tensor):
                _validate._fail(f"DeferredWgrad: {name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            _validate._fail(f"DeferredWgrad: max_pending must be an int >= 1, got {max_pending!r}")
        if stream is not None and dw13.device.type != "cuda":
            _validate._fail(f"DeferredWgrad: a stream needs CUDA accumulators, got {dw13.device}")
        self.dw13 = dw13
        self.dw2 = dw2
        self.stream = stream
        self.max_pending = max_pending
        self._pending: list[WgradLater] = []
        self._done: Optional[torch.cuda.Event] = None
        self.deferral_id = next(_next_id)
        _registry[self.deferral_id] = self

    @property
    def pending(self) -> int:
        """How many backwards are queued."""
        return len(self._pending)

    def push(self, later: WgradLater) -> None:
        if len(self._pending) >= self.max_pending:
            _validate._fail(f"DeferredWgrad: {self.max_pending} backwards are queued already (max_pending); call "
                            "flush() first")
        self._pending.append(later)

    def flush(self) -> None:
        """Add every queued backward's weight gradients into the accumulators, in the order they were queued."""
        work, self._pending = self._pending, []
        if not work:
            return
        if self.stream is None:
            for w in work:
                w.run(self.dw13, self.dw2)
            return
        current = torch.cuda.current_stream(self.dw13.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for w in work:
                w.run(self.dw13, self.dw2)
        for w in work:  # allocated on the current stream, read on the side stream: not reused before it is done
            for t in w.tensors:
                if t.device.type == "cuda":
                    t.record_stream(self.stream)
        for t in (self.dw13, self.dw2):
            t.record_stream(self.stream)
        self._done = torch.cuda.Event()
        self._done.record(self.stream)

    def wait(self) -> None:
        """Make the current stream wait for the last flush on the side stream (nothing to do without one)."""
        if self._done is not None:
            torch.cuda.current_stream(self.dw13.device).wait_event(self._done)
            self._done = None


def get(deferral_id: int) -> DeferredWgrad:
    d = _registry.get(int(deferral_id))
    if d is None:
        raise RuntimeError(f"prime_kernels.mega: no DeferredWgrad {deferral_id} (it was garbage-collected before the "
                           "backward ran; keep it alive until flush)")
    return d
