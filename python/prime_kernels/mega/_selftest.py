"""Native kernels that run only after proving themselves on the device: the registry, the self-test and its verdicts.

No native sm_100 kernel has run on Blackwell hardware, and the project has no Blackwell GPU to verify one on. So a
native forward is not trusted because it is built: it is registered here as a :class:`Candidate` for its status key
(an entry of :mod:`prime_kernels._status` with ``self_tested``), and on each device it is used by
``backend="auto"`` / ``"fused"`` only after its self-test has passed there. The self-test runs the candidate on
small shapes (:data:`prime_kernels.mega._selftest_cases.CASES`: uniform and skewed routing, masked routes, an empty
expert, T = 1, an odd T) against the grouped backend's forward by the rules of :mod:`._selftest_cases`.

When it runs: at the first eager layer forward on each device of the candidate's arch (:func:`on_layer_call`, from
:func:`prime_kernels.mega._backend.resolve`), or when :func:`selftest` (``prime_kernels.selftest``) is called. Never
while a CUDA graph is being captured or torch.compile is tracing: the self-test syncs with the host, and a trace
would bake its choice in; the grouped backend runs until a later eager call has run it. Each (device, candidate)
is tested once per process (``selftest(rerun=True)`` tests again); a candidate that raises, in Python or through a
CUDA error, has failed with that message.

What status() says for the entry (:func:`verdict_reason`): "available: native sm100 forward: self-test passed on
this device (not verified by the project's CI)" after a pass, the failing case and error after a failure, and that
the test has not run yet before it; :func:`prime_kernels._status.runnable` says whether it could run at all.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import _status
from . import _grouped
from ._selftest_cases import CASES, REL_TOL, ROW_TOL, Case, Outcome, capacity, compare, make_inputs, \
    poison_free_blocks
from ._validate import FusedKernelUnavailable

PASSED_NOTE = "native {family} forward: self-test passed on this device (not verified by the project's CI)"
NOT_RUN = ("built for this device, but not used until its self-test passes here: it runs at the first eager layer "
           "forward on this device (not under CUDA-graph capture or torch.compile tracing) or at "
           "prime_kernels.selftest(); until then the grouped pipeline runs")
SEED = 1234


@dataclass(frozen=True)
class Candidate:
    """A native forward for the status entry ``key``. ``forward`` takes what :func:`prime_kernels.mega._fused.forward`
    takes for a bf16 layer on one rank (x, topk_idx, topk_weights, w13, w2, and the keywords activation_clamp,
    num_experts, block_m, capacity, save_h, keep_x_pool, id_check, num_sms) and returns its 8 outputs.
    ``compiled_as``: its name in the build's compiled-kernel list (whether this build holds it for the device)."""
    name: str
    key: str
    compiled_as: str
    forward: Callable[..., tuple]


@dataclass
class Verdict:
    """A candidate's self-test on one device."""
    candidate: str
    key: str
    device: str
    passed: bool
    outcomes: list[Outcome] = field(default_factory=list)
    why: str = ""  # the first failure: its case and error

    def report(self) -> str:
        head = "passed" if self.passed else f"FAILED: {self.why}"
        lines = [f"{self.key} ({self.candidate}) on {self.device}: {head}"]
        lines += [f"  {o.line()}" for o in self.outcomes]
        return "\n".join(lines)


class Report(dict):
    """status key -> :class:`Verdict` for one device, from :func:`selftest`; ``str()`` is the readable report."""

    def __init__(self, device: str, verdicts: dict, skipped: dict):
        super().__init__(verdicts)
        self.device = device
        self.skipped = skipped  # status key -> why its candidate was not tested on this device

    @property
    def passed(self) -> bool:
        """No tested kernel failed (also true when none was tested: see ``skipped`` and ``str()``)."""
        return all(v.passed for v in self.values())

    def __str__(self) -> str:
        lines = [f"prime_kernels self-test on {self.device} (bounds: relative error <= {REL_TOL:.0e}, row error <= "
                 f"{ROW_TOL:.0e}, against the grouped pipeline)"]
        lines += [v.report() for v in self.values()]
        lines += [f"{k}: not tested: {why}" for k, why in self.skipped.items()]
        if not self.values() and not self.skipped:
            lines.append("no native kernel is registered")
        return "\n".join(lines)


_lock = threading.RLock()
_candidates: dict[str, Candidate] = {}
_verdicts: dict[tuple[int, str], Verdict] = {}  # (device index, key)
_settled: set[int] = set()  # devices whose every candidate has a verdict or cannot run there
_running = threading.local()


def register(candidate: Candidate) -> None:
    """Make ``candidate`` the native kernel of its status entry (which must be a ``self_tested`` one); a previous
    candidate of that key and its verdicts are dropped."""
    entry = _status.KERNELS.get(candidate.key)
    if entry is None or not entry.self_tested:
        raise ValueError(f"prime_kernels: {candidate.key!r} is not a status entry that takes a self-tested kernel")
    with _lock:
        _candidates[candidate.key] = candidate
        for slot in [s for s in _verdicts if s[1] == candidate.key]:
            del _verdicts[slot]
        _settled.clear()


def unregister(key: str) -> None:
    with _lock:
        _candidates.pop(key, None)
        for slot in [s for s in _verdicts if s[1] == key]:
            del _verdicts[slot]
        _settled.clear()


def candidate(key: str) -> Candidate | None:
    return _candidates.get(key)


def _tensor_device(index: int) -> torch.device:
    """Where the self-test's tensors live for CUDA device ``index`` (the CPU tests point this at the CPU)."""
    return torch.device("cuda", index)


def check(cand: Candidate, device: torch.device, cases: tuple[Case, ...] = CASES) -> Verdict:
    """Run ``cand`` against the grouped backend on ``cases`` on ``device`` (no registry, no caching): the harness
    itself, which the tests also point at deliberately wrong kernels."""
    verdict = Verdict(cand.name, cand.key, str(device), passed=False)
    last = None
    for i, case in enumerate(cases):
        inputs = make_inputs(case, device, SEED + i)
        kwargs = dict(num_experts=case.experts, block_m=128, capacity=capacity(case), save_h=True)
        try:
            with torch.no_grad():
                ref = _grouped.forward(*inputs.values(), **kwargs)
            _sync(device)
        except Exception as exc:  # without a reference nothing can be trusted
            verdict.why = f"{case.label()}: the grouped pipeline (the reference) raised {type(exc).__name__}: {exc}"
            return verdict
        outcome = _run_candidate(cand, case, inputs, kwargs, ref)
        verdict.outcomes.append(outcome)
        if not outcome.passed:
            verdict.why = f"{case.label()}: {outcome.why}"
            return verdict
        last = (case, inputs, kwargs, ref, outcome)
    if last is not None:  # a repeat gives the same bits
        case, inputs, kwargs, ref, _ = last
        first = _call(cand, case, inputs, kwargs)
        again = _call(cand, case, inputs, kwargs)
        if isinstance(first, str) or isinstance(again, str):
            verdict.why = f"{case.label()}, repeated: {first if isinstance(first, str) else again}"
            return verdict
        # h's rows past the experts' spans are capacity the kernels never write (poisoned between the runs)
        span = int(ref[3][-1].item())
        if not (torch.equal(first[0], again[0]) and torch.equal(first[1][:span], again[1][:span])):
            verdict.why = f"{case.label()}, repeated: y or h differs between two runs on the same inputs"
            return verdict
    verdict.passed = True
    return verdict


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(cand: Candidate, case: Case, inputs: dict, kwargs: dict):
    """The candidate's outputs, or the message of what it raised (a CUDA error included: the sync is inside)."""
    x = inputs["x"]
    T, H = x.shape
    I2 = inputs["w13"].shape[1]
    cap = kwargs["capacity"]
    poison_free_blocks(x.device, [(T, H), (cap, I2), (cap, I2 // 2), (cap, H), (cap, H)])
    try:
        with torch.no_grad():
            out = cand.forward(*inputs.values(), activation_clamp=None, keep_x_pool=case.keep_x_pool, id_check=None,
                               num_sms=0, **kwargs)
        _sync(x.device)
        return out
    except Exception as exc:
        return f"the candidate raised {type(exc).__name__}: {exc}"


def _run_candidate(cand: Candidate, case: Case, inputs: dict, kwargs: dict, ref) -> Outcome:
    out = _call(cand, case, inputs, kwargs)
    if isinstance(out, str):
        return Outcome(case, False, {}, out)
    try:
        return compare(case, out, ref, inputs)
    except Exception as exc:  # outputs of the wrong kind
        return Outcome(case, False, {}, f"its outputs could not be compared: {type(exc).__name__}: {exc}")


def _deferred(x) -> bool:
    """Whether this is no time to self-test: a CUDA graph being captured, torch.compile tracing, or fake tensors."""
    try:
        if torch.compiler.is_compiling():
            return True
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return True
        from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415

        return x is not None and is_fake(x)
    except Exception:
        return True


def _testable(key: str) -> str | None:
    """None when the candidate of ``key`` could run on the current device, else why not."""
    why = _status.runnable(key)
    return None if _status.is_available(why) else why


def _run_device(index: int, rerun: bool) -> tuple[dict, dict]:
    """Self-test every candidate that could run on device ``index`` that has no verdict there (every one with
    ``rerun``). Returns (key -> Verdict, key -> why it was not tested)."""
    verdicts, skipped = {}, {}
    with _lock:
        for key, cand in list(_candidates.items()):
            why = _testable(key)
            if why is not None:
                skipped[key] = why
                continue
            slot = (index, key)
            if rerun or slot not in _verdicts:
                _running.active = True
                try:
                    _verdicts[slot] = check(cand, _tensor_device(index))
                finally:
                    _running.active = False
            verdicts[key] = _verdicts[slot]
        _settled.add(index)
    return verdicts, skipped


def on_layer_call(x) -> None:
    """The first eager layer forward on a device runs the self-test of the candidates that could run there (see the
    module docstring); every later call costs a set lookup."""
    if not _candidates or getattr(x, "device", None) is None or x.device.type != "cuda":
        return
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index in _settled or getattr(_running, "active", False) or _deferred(x):
        return
    with torch.cuda.device(index):
        _run_device(index, rerun=False)


def selftest(device=None, *, rerun: bool = False) -> Report:
    """Self-test the registered native kernels on ``device`` (an index, a torch.device or None: the current one)
    against the grouped pipeline, once per process unless ``rerun``; returns the report (``str()`` reads it). A
    kernel that passes is what ``backend="auto"`` / ``"fused"`` run there, one that fails is not, and status() says
    which and why. Raises when called while a CUDA graph is captured or torch.compile traces."""
    if _deferred(None):
        raise RuntimeError("prime_kernels.selftest() syncs with the host: call it outside CUDA-graph capture and "
                           "torch.compile")
    if device is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else None
    else:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        index = d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else None)
        if d.type != "cuda":
            raise ValueError(f"prime_kernels.selftest: the self-test runs on a CUDA device, got {d}")
    if index is None:
        return Report("no CUDA device", {}, {k: "no CUDA device" for k in _candidates})
    with torch.cuda.device(index):
        verdicts, skipped = _run_device(index, rerun)
    return Report(f"cuda:{index}", verdicts, skipped)


def verdict_reason(key: str, index: int | None) -> str:
    """status()'s answer for the self-tested entry ``key`` on device ``index``, where it could run."""
    v = _verdicts.get((index, key)) if index is not None else None
    if v is None:
        return NOT_RUN
    if v.passed:
        return f"{_status.AVAILABLE}: {PASSED_NOTE.format(family=_status.KERNELS[key].family)}"
    return (f"self-test failed on this device, so the grouped pipeline runs: {v.why} (candidate {v.candidate}; "
            f"prime_kernels.selftest() gives the report)")


def native_forward(device: torch.device, key: str) -> Callable[..., tuple] | None:
    """The forward the fused backend runs for ``key`` on ``device``: the candidate that passed there. Raises with
    status()'s reason when there is none (the backend resolution should not have chosen it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    v = _verdicts.get((index, key))
    cand = _candidates.get(key)
    if v is None or not v.passed or cand is None or v.candidate != cand.name:
        raise FusedKernelUnavailable(f"prime_kernels.mega: {key}: {_status.reason(key)}")
    return cand.forward
