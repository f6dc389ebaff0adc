"""A loopback expert-parallel group: R virtual ranks in one process, for tests and single-GPU measurements.

The layer's expert parallelism needs R ranks exchanging rows. Where one GPU (or none) is at hand, a
:class:`LoopbackGroup` runs R ranks as R threads of this process: :meth:`LoopbackGroup.run` calls ``fn(rank)`` in
each, and the collectives the layer makes (``all_gather`` and ``all_to_all_single``; see
:mod:`prime_kernels.mega._comm`) meet at a barrier and copy between the ranks' tensors, on each rank's current
stream (device copies on a GPU). With CUDA tensors every rank runs on its own stream of the one device, so one rank's
copies can overlap another's GEMMs as they would across GPUs. As a collective of a process group does, a call returns
once the copies are queued: the host never waits for the GPU, each rank's stream is ordered after every rank's copies
out of its operand, and an operand's memory stays allocated until the readers' streams are done with it.

``link_gbps`` models an interconnect's bandwidth: each ``all_to_all_single`` then also holds the receiving rank's
stream, after its copies, for the time the rows from the other ranks would take over a link of that many GB/s (a
one-thread spin kernel: the rank's next work on that stream waits, other streams and the rest of the GPU do not).
Without it the exchanges are copies within one card's memory, far faster than any link.

What it does not model: an interconnect's latency and contention (``link_gbps`` is bandwidth alone), and
autograd (the backward of a custom op runs on the autograd engine's device thread, which the ranks' threads share,
so R ranks' backwards would wait on each other there): call the backends' forward and backward directly, as the
tests and ``bench/bench_ep_loopback.py`` do.

A rank that raises breaks the barrier: the others raise ``threading.BrokenBarrierError`` at their next collective
instead of waiting, and :meth:`run` re-raises the first rank's exception. Every barrier wait is bounded by
``timeout_s``.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_REGISTRY: dict[str, "LoopbackGroup"] = {}
_COUNTER = itertools.count()


class LoopbackGroup:
    """R virtual ranks of this process (see the module docstring). ``group_name`` resolves back to the group
    (:func:`resolve`), as a process group's name does."""

    def __init__(self, world_size: int, timeout_s: float = 60.0, link_gbps: float | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LoopbackGroup: world_size must be an int >= 1, got {world_size!r}")
        if link_gbps is not None and not link_gbps > 0:
            raise ValueError(f"LoopbackGroup: link_gbps must be > 0 (or None), got {link_gbps!r}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.link_gbps = link_gbps
        self.group_name = f"prime_kernels.loopback.{next(_COUNTER)}"
        self._barrier = threading.Barrier(world_size, timeout=self.timeout_s)
        self._slots: list = [None] * world_size
        self._done_events: list = [None] * world_size
        self._streams: dict = {}
        self._local = threading.local()
        _REGISTRY[self.group_name] = self

    def size(self) -> int:
        return self.world_size

    def rank(self) -> int:
        r = getattr(self._local, "rank", None)
        if r is None:
            raise RuntimeError(f"{self.group_name}: a collective outside LoopbackGroup.run (no rank on this thread)")
        return r

    def run(self, fn: Callable[[int], T], device: torch.device | str | None = None) -> list[T]:
        """``fn(rank)`` for every rank, each in its own thread (on its own CUDA stream of ``device`` when that is a
        CUDA device); returns their results in rank order, or raises the first exception a rank raised."""
        dev = None if device is None else torch.device(device)
        if dev is not None and dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())  # the caller's device, not the new threads'
        results: list = [None] * self.world_size
        errors: list = [None] * self.world_size
        start = None
        if dev is not None and dev.type == "cuda":  # the ranks' streams see what the caller's stream has queued
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(dev))

        def body(r: int) -> None:
            self._local.rank = r
            try:
                if dev is not None and dev.type == "cuda":
                    torch.cuda.set_device(dev)
                    with torch.cuda.stream(self._rank_stream(dev, r)):
                        torch.cuda.current_stream(dev).wait_event(start)
                        results[r] = fn(r)
                        torch.cuda.current_stream(dev).synchronize()
                else:
                    results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors[r] = e
                self._barrier.abort()  # the other ranks raise at their next collective instead of waiting

        threads = [threading.Thread(target=body, args=(r,), name=f"{self.group_name}.rank{r}")
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        self._slots = [None] * self.world_size
        self._done_events = [None] * self.world_size
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results

    def _rank_stream(self, device: torch.device, r: int) -> torch.cuda.Stream:
        """Rank r's stream on ``device``, the same one on every call: the caching allocator keeps freed blocks per
        stream, so a fresh stream per call would find none to reuse and fall back to cudaMalloc / cudaFree (which
        synchronises the device)."""
        key = (device.index, r)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    # -- the collectives (prime_kernels.mega._comm calls these with a LoopbackGroup) ----------------------------

    def _publish(self, value) -> None:
        """Put this rank's operand where the others read it, once the rank's queued work that writes it is done."""
        event = None
        tensor = value[0] if isinstance(value, tuple) else value
        if tensor.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        self._slots[self.rank()] = (value, event)
        self._barrier.wait()

    def _read(self, src: int):
        """Rank ``src``'s operand, ordered after the work that wrote it; the caching allocator keeps its memory until
        this rank's stream has read it (as a collective on a stream would), without a host wait."""
        value, event = self._slots[src]
        if event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(event)
            (value[0] if isinstance(value, tuple) else value).record_stream(stream)
        return value

    def _done(self, sample: torch.Tensor) -> None:
        """Like a collective launched on a stream: each rank's stream goes on only once every rank's copies out of
        its operand are done (a device-side wait on the readers' events; the host does not wait for the GPU), and no
        rank publishes its next operand before every rank has read this one."""
        if sample.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(sample.device))
            self._done_events[self.rank()] = event
        self._barrier.wait()
        if sample.is_cuda:
            stream = torch.cuda.current_stream(sample.device)
            for r, event in enumerate(self._done_events):
                if r != self.rank():
                    stream.wait_event(event)
        self._barrier.wait()  # every rank has queued its waits before any overwrites its event

    def all_gather(self, out_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self._publish(tensor)
        for src in range(self.world_size):
            out_list[src].copy_(self._read(src))
        self._done(tensor)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                          in_splits: list[int]) -> None:
        """Rows of ``inp`` split by ``in_splits`` go to the ranks in order; ``out`` receives ``out_splits[src]``
        rows from each rank ``src`` in order (both as torch.distributed.all_to_all_single takes them)."""
        r = self.rank()
        self._publish((inp, list(in_splits)))
        at = 0
        for src in range(self.world_size):
            src_inp, src_splits = self._read(src)
            start = sum(src_splits[:r])
            n = src_splits[r]
            if n != out_splits[src]:
                self._barrier.abort()
                raise RuntimeError(f"{self.group_name}: rank {src} sends {n} rows to rank {r}, which expects "
                                   f"{out_splits[src]}")
            out[at:at + n].copy_(src_inp[start:start + n])
            at += n
        if self.link_gbps is not None and out.is_cuda:  # the rows from other ranks cross the modelled link
            row_bytes = out[0].numel() * out.element_size() if out.shape[0] else 0
            _hold_stream((sum(out_splits) - out_splits[r]) * row_bytes / (self.link_gbps * 1e9), out.device)
        self._done(inp)


_SPIN_CYCLES_PER_S: dict = {}


def _hold_stream(seconds: float, device: torch.device) -> None:
    """Keep the current stream busy for ``seconds`` with a one-thread spin kernel (a link's transfer time: the
    stream's next work waits for it, the rest of the GPU does not)."""
    if seconds <= 0:
        return
    if device.index not in _SPIN_CYCLES_PER_S:  # the spin kernel counts clock cycles: measure their rate once
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        _SPIN_CYCLES_PER_S[device.index] = 2_000_000 / (start.elapsed_time(end) * 1e-3)
    torch.cuda._sleep(int(seconds * _SPIN_CYCLES_PER_S[device.index]))


def resolve(group_name: str) -> LoopbackGroup | None:
    """The loopback group of this name, or None."""
    return _REGISTRY.get(group_name)
