"""Is a process group one NVLink domain? The check expert parallelism's path 2 runs at buffer creation.

Path 2 reads peers' rows and writes their results through torch symmetric memory, which is only sound when every
pair of GPUs in the group is joined by NVLink. NVML's peer-to-peer status (capability index NVLINK) answers that
per pair; a group that fails the check (or where NVML cannot be asked) runs on the all-to-all path (path 1)
instead, and the process says so once (:func:`warn_fallback_once`).

Entry points:
  :func:`load_nvml`            the ctypes binding of ``libnvidia-ml.so.1`` or the reason there is none (never raises)
  :func:`pair_status`          NVML's NVLink P2P status name of every pair i < j of a list of PCI bus ids
  :func:`nvlink_domain`        (True, "") when every pair is NVLink P2P OK, else (False, the first failing pair)
  :func:`group_bus_ids`        every rank's PCI bus id, in rank order (collective)
  :func:`check_group`          the group-level decision, identical on every rank (collective)
  :func:`warn_fallback_once`   one warning per process that path 1 runs instead
  :func:`disable_multicast_env` the environment the library and its tests run under: no NVLink multicast

``nvml`` arguments take any object with the methods of :class:`CtypesNvml` (``init``, ``shutdown``,
``handle_by_pci_bus_id``, ``p2p_status``; ``handle_by_uuid`` and ``pci_bus_id`` only where torch gives no bus
id), raising :class:`NvmlError` on an NVML error: the tests pass a fake.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import threading
import warnings
from typing import Any

# Values of NVIDIA's nvml.h (enum nvmlGpuP2PCapsIndex_enum and enum nvmlGpuP2PStatus_enum).
# nvmlGpuP2PCapsIndex_t:
NVML_P2P_CAPS_INDEX_READ = 0
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_CAPS_INDEX_ATOMICS = 3
NVML_P2P_CAPS_INDEX_PCI = 4  # the header's older name for it, NVML_P2P_CAPS_INDEX_PROP, is deprecated
NVML_P2P_CAPS_INDEX_UNKNOWN = 5
# nvmlGpuP2PStatus_t:
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED = 1  # spelled ..._CHIPSET_NOT_SUPPORED in nvml.h (both names exist)
NVML_P2P_STATUS_GPU_NOT_SUPPORTED = 2
NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED = 3
NVML_P2P_STATUS_DISABLED_BY_REGKEY = 4
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_P2P_STATUS_UNKNOWN = 6
NVML_SUCCESS = 0

P2P_STATUS_NAMES: dict[int, str] = {
    NVML_P2P_STATUS_OK: "NVML_P2P_STATUS_OK",
    NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED: "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED",
    NVML_P2P_STATUS_GPU_NOT_SUPPORTED: "NVML_P2P_STATUS_GPU_NOT_SUPPORTED",
    NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED: "NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED",
    NVML_P2P_STATUS_DISABLED_BY_REGKEY: "NVML_P2P_STATUS_DISABLED_BY_REGKEY",
    NVML_P2P_STATUS_NOT_SUPPORTED: "NVML_P2P_STATUS_NOT_SUPPORTED",
    NVML_P2P_STATUS_UNKNOWN: "NVML_P2P_STATUS_UNKNOWN",
}
STATUS_OK = P2P_STATUS_NAMES[NVML_P2P_STATUS_OK]
# Two ranks on one GPU (the one-GPU emulator): NVML is not asked (it rejects a device paired with itself), and
# the pair counts as connected, since a GPU reads its own memory.
STATUS_SAME_DEVICE = "SAME_DEVICE"
_PAIR_OK = (STATUS_OK, STATUS_SAME_DEVICE)

NVML_LIBRARY = "libnvidia-ml.so.1"


class NvmlError(RuntimeError):
    """An NVML call returned something other than NVML_SUCCESS."""

    def __init__(self, call: str, code: int, message: str):
        super().__init__(f"{call} returned {code} ({message})")
        self.call = call
        self.code = code
        self.message = message


class NvmlUnavailable(RuntimeError):
    """NVML cannot be asked at all: the library is missing, lacks a symbol, or does not initialize."""


class _PciInfo(ctypes.Structure):
    # nvmlPciInfo_t as nvmlDeviceGetPciInfo_v3 fills it.
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class CtypesNvml:
    """The few NVML calls the check needs, through ctypes (no Python dependency beyond the driver's library).

    Handles are plain ints (the nvmlDevice_t pointer). Every method raises :class:`NvmlError` on an NVML error.
    """

    def __init__(self, library: str = NVML_LIBRARY):
        try:
            lib = ctypes.CDLL(library)
        except OSError as e:
            raise NvmlUnavailable(f"the NVML library {library} could not be loaded ({e})") from None
        try:
            self._init = lib.nvmlInit_v2
            self._shutdown = lib.nvmlShutdown
            self._error_string = lib.nvmlErrorString
            self._by_bus_id = lib.nvmlDeviceGetHandleByPciBusId_v2
            self._p2p = lib.nvmlDeviceGetP2PStatus
        except AttributeError as e:
            raise NvmlUnavailable(f"the NVML library {library} lacks a function the check needs ({e})") from None
        # Only the bus-id fallback needs these; a library without them still serves the check itself.
        self._by_uuid = getattr(lib, "nvmlDeviceGetHandleByUUID", None)
        self._pci_info = getattr(lib, "nvmlDeviceGetPciInfo_v3", None)

        handle_p = ctypes.POINTER(ctypes.c_void_p)
        self._init.argtypes, self._init.restype = [], ctypes.c_int
        self._shutdown.argtypes, self._shutdown.restype = [], ctypes.c_int
        self._error_string.argtypes, self._error_string.restype = [ctypes.c_int], ctypes.c_char_p
        self._by_bus_id.argtypes, self._by_bus_id.restype = [ctypes.c_char_p, handle_p], ctypes.c_int
        self._p2p.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self._p2p.restype = ctypes.c_int
        if self._by_uuid is not None:
            self._by_uuid.argtypes, self._by_uuid.restype = [ctypes.c_char_p, handle_p], ctypes.c_int
        if self._pci_info is not None:
            self._pci_info.argtypes = [ctypes.c_void_p, ctypes.POINTER(_PciInfo)]
            self._pci_info.restype = ctypes.c_int
        self.library = library

    def error_string(self, code: int) -> str:
        text = self._error_string(code)
        return text.decode(errors="replace") if text else f"NVML error {code}"

    def _check(self, call: str, code: int) -> None:
        if code != NVML_SUCCESS:
            raise NvmlError(call, code, self.error_string(code))

    def init(self) -> None:
        self._check("nvmlInit_v2", self._init())

    def shutdown(self) -> None:
        self._check("nvmlShutdown", self._shutdown())

    def handle_by_pci_bus_id(self, bus_id: str) -> int:
        handle = ctypes.c_void_p()
        self._check("nvmlDeviceGetHandleByPciBusId_v2", self._by_bus_id(bus_id.encode(), ctypes.byref(handle)))
        return int(handle.value or 0)

    def p2p_status(self, handle1: int, handle2: int, caps_index: int) -> int:
        status = ctypes.c_int(NVML_P2P_STATUS_UNKNOWN)
        self._check("nvmlDeviceGetP2PStatus", self._p2p(ctypes.c_void_p(handle1), ctypes.c_void_p(handle2),
                                                         caps_index, ctypes.byref(status)))
        return status.value

    def handle_by_uuid(self, uuid: str) -> int:
        if self._by_uuid is None:
            raise NvmlUnavailable(f"{self.library} has no nvmlDeviceGetHandleByUUID")
        handle = ctypes.c_void_p()
        self._check("nvmlDeviceGetHandleByUUID", self._by_uuid(uuid.encode(), ctypes.byref(handle)))
        return int(handle.value or 0)

    def pci_bus_id(self, handle: int) -> str:
        if self._pci_info is None:
            raise NvmlUnavailable(f"{self.library} has no nvmlDeviceGetPciInfo_v3")
        info = _PciInfo()
        self._check("nvmlDeviceGetPciInfo_v3", self._pci_info(ctypes.c_void_p(handle), ctypes.byref(info)))
        return info.busId.decode(errors="replace")


_loaded: dict[str, tuple[CtypesNvml | None, str]] = {}
_load_lock = threading.Lock()


def load_nvml(library: str | None = None) -> tuple[CtypesNvml | None, str]:
    """(the binding, "") or (None, why not), for ``library`` (default :data:`NVML_LIBRARY`). Never raises. The
    outcome is cached per library name: a process loads the driver's library once."""
    name = library if library is not None else NVML_LIBRARY
    with _load_lock:
        if name not in _loaded:
            _loaded[name] = _load(name)
        return _loaded[name]


def _load(library: str) -> tuple[CtypesNvml | None, str]:
    try:
        return CtypesNvml(library), ""
    except NvmlUnavailable as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - an odd ctypes failure must still read as "no NVML", never raise
        return None, f"the NVML library {library} could not be used ({type(e).__name__}: {e})"


_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.([0-9a-fA-F]+))?$")


def normalize_bus_id(bus_id: str) -> str:
    """The canonical form ``DDDDDDDD:BB:DD.F`` (upper-case hex, NVML's own), so that "0000:18:00.0" and
    "00000000:18:00.0" name one GPU; a string of another shape is returned stripped and upper-cased."""
    s = str(bus_id).strip()
    m = _BUS_ID.match(s)
    if not m:
        return s.upper()
    dom, bus, dev, fn = (int(g, 16) if g else 0 for g in m.groups())
    return f"{dom:08X}:{bus:02X}:{dev:02X}.{fn:X}"


def _status_name(code: int) -> str:
    return P2P_STATUS_NAMES.get(code, f"NVML_P2P_STATUS value {code} (not in nvml.h's enum)")


def pair_status(bus_ids: list[str], nvml: Any = None) -> dict[tuple[int, int], str]:
    """NVML's NVLink P2P status name of every pair (i, j), i < j, of ``bus_ids`` (PCI bus ids, in rank order):
    "NVML_P2P_STATUS_OK" and the other names of nvmlGpuP2PStatus_t, :data:`STATUS_SAME_DEVICE` for two equal
    bus ids, or "NVML error: ..." where a handle lookup or the status query failed.

    Raises :class:`NvmlUnavailable` when some pair needs NVML and NVML cannot be loaded or initialized."""
    ids = [normalize_bus_id(b) for b in bus_ids]
    out: dict[tuple[int, int], str] = {}
    asked = []
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            if ids[i] == ids[j]:
                out[(i, j)] = STATUS_SAME_DEVICE
            else:
                asked.append((i, j))
    if not asked:
        return out
    if nvml is None:
        nvml, why = load_nvml()
        if nvml is None:
            raise NvmlUnavailable(why)
    try:
        nvml.init()
    except NvmlError as e:
        raise NvmlUnavailable(f"NVML could not be initialized: {e}") from None
    try:
        handles: dict[str, int | str] = {}
        for b in sorted({ids[k] for pair in asked for k in pair}):
            try:
                handles[b] = nvml.handle_by_pci_bus_id(b)
            except NvmlError as e:
                handles[b] = f"NVML error: no device for PCI bus id {b}: {e}"
        for i, j in asked:
            hi, hj = handles[ids[i]], handles[ids[j]]
            if isinstance(hi, str) or isinstance(hj, str):
                out[(i, j)] = hi if isinstance(hi, str) else hj  # type: ignore[assignment]
                continue
            try:
                out[(i, j)] = _status_name(nvml.p2p_status(hi, hj, NVML_P2P_CAPS_INDEX_NVLINK))
            except NvmlError as e:
                out[(i, j)] = f"NVML error: {e}"
    finally:
        try:
            nvml.shutdown()
        except NvmlError:
            pass  # the answers are in hand; a failed release of NVML's reference changes none of them
    return dict(sorted(out.items()))


def nvlink_domain(bus_ids: list[str], nvml: Any = None) -> tuple[bool, str]:
    """(True, "") when every pair i < j of ``bus_ids`` reports NVLink P2P OK (equal bus ids count as one GPU, so
    one bus id, or one GPU shared by every rank, is trivially one domain); else (False, a reason that names the
    first failing pair by index and bus id with NVML's status name, or why NVML could not be asked)."""
    try:
        statuses = pair_status(bus_ids, nvml)
    except NvmlUnavailable as e:
        return False, f"NVML could not be asked whether the GPUs {list(bus_ids)} share NVLink: {e}"
    for (i, j), status in statuses.items():
        if status not in _PAIR_OK:
            return False, (f"ranks {i} and {j} (PCI bus ids {bus_ids[i]} and {bus_ids[j]}) are not NVLink peers: "
                           f"NVLink P2P status {status}")
    return True, ""


def _host_id() -> str:
    # The hostname alone can repeat across machines (containers); the kernel's boot id tells machines apart.
    host = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{host}/{f.read().strip()}"
    except OSError:
        return host


def local_bus_id(device: Any, nvml: Any = None) -> str:
    """The PCI bus id of CUDA ``device``: from torch's device properties, else through NVML by the device's UUID
    (so CUDA_VISIBLE_DEVICES' renumbering cannot mislead it). Raises ValueError for a device that is not CUDA,
    RuntimeError where neither source answers."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda":
        raise ValueError(f"device {dev} is not a CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return normalize_bus_id(f"{props.pci_domain_id:x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0")
    uuid = str(getattr(props, "uuid", "") or "")
    if not uuid:
        raise RuntimeError(f"torch gives neither a PCI bus id nor a UUID for cuda:{index}")
    if not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    if nvml is None:
        nvml, why = load_nvml()
        if nvml is None:
            raise RuntimeError(f"torch gives no PCI bus id for cuda:{index} and {why}")
    try:
        nvml.init()
    except NvmlError as e:
        raise RuntimeError(f"torch gives no PCI bus id for cuda:{index} and NVML could not be initialized: {e}")
    try:
        return normalize_bus_id(nvml.pci_bus_id(nvml.handle_by_uuid(uuid)))
    except (NvmlError, NvmlUnavailable) as e:
        raise RuntimeError(f"torch gives no PCI bus id for cuda:{index} and NVML found none for {uuid}: {e}")
    finally:
        try:
            nvml.shutdown()
        except NvmlError:
            pass


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _gather_identities(group: Any, device: Any, nvml: Any, bus_id: str | None,
                       host_id: str | None) -> list[dict[str, str | None]]:
    """Every rank's {"host", "bus", "error"}, in rank order. A rank that cannot name its GPU still joins the
    gather (with its error), so no rank is left waiting in a collective its peers skipped."""
    import torch.distributed as dist

    mine: dict[str, str | None] = {"host": host_id if host_id is not None else _host_id(), "bus": None,
                                   "error": None}
    try:
        mine["bus"] = normalize_bus_id(bus_id) if bus_id is not None else local_bus_id(device, nvml)
    except Exception as e:  # noqa: BLE001 - carried to every rank, which all decide on it alike
        mine["error"] = str(e)
    if group is None:
        return [mine]
    out: list[Any] = [None] * _group_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def group_bus_ids(group: Any, device: Any, *, bus_id: str | None = None, nvml: Any = None) -> list[str]:
    """Every rank's PCI bus id, in rank order, gathered with ``all_gather_object`` over ``group`` (collective:
    every rank of the group must call it). ``group=None``: this process's id alone. ``bus_id`` replaces this
    rank's own (tests). Raises RuntimeError, on every rank alike, when some rank cannot name its GPU."""
    ids = _gather_identities(group, device, nvml, bus_id, None)
    for r, ident in enumerate(ids):
        if ident["error"] is not None:
            raise RuntimeError(f"rank {r} has no PCI bus id: {ident['error']}")
    return [str(ident["bus"]) for ident in ids]


def check_group(group: Any, device: Any, *, nvml: Any = None, bus_id: str | None = None,
                host_id: str | None = None) -> tuple[bool, str]:
    """(True, "") when ``group`` is one NVLink domain on which path 2 may run, else (False, why).

    Collective: every rank of ``group`` calls it, and every rank gets the same answer. Each rank checks the whole
    matrix from the gathered bus ids, and the ranks then exchange their verdicts, so that a rank whose NVML answers
    differently (or not at all) cannot leave its peers on another path. ``group=None`` (no process group) and a
    group of one rank are trivially one domain. Ranks on different hosts are not (NVML sees one host's GPUs).
    ``bus_id`` and ``host_id`` replace this rank's own (tests)."""
    import torch.distributed as dist

    if group is None or _group_size(group) == 1:
        return True, ""
    idents = _gather_identities(group, device, nvml, bus_id, host_id)
    ok, reason = _decide(idents, nvml)
    verdicts: list[Any] = [None] * len(idents)
    dist.all_gather_object(verdicts, (ok, reason), group=group)
    failing = [(r, v[1]) for r, v in enumerate(verdicts) if not v[0]]
    if not failing:
        return True, ""
    if all(why == failing[0][1] for _, why in failing) and len(failing) == len(verdicts):
        return False, failing[0][1]
    r, why = failing[0]
    return False, f"rank {r} finds: {why}"


def _decide(idents: list[dict[str, str | None]], nvml: Any) -> tuple[bool, str]:
    for r, ident in enumerate(idents):
        if ident["error"] is not None:
            return False, f"rank {r} has no PCI bus id: {ident['error']}"
    for r, ident in enumerate(idents):
        if ident["host"] != idents[0]["host"]:
            return False, (f"ranks 0 and {r} run on different hosts ({idents[0]['host']} and {ident['host']}); "
                           "NVML answers for one host's GPUs only")
    return nvlink_domain([str(ident["bus"]) for ident in idents], nvml)


_warned = False
_warn_lock = threading.Lock()


def warn_fallback_once(reason: str) -> bool:
    """Warn (RuntimeWarning), the first time in this process only, that the group is not one NVLink domain, why,
    and that the all-to-all path runs instead. Returns whether this call warned."""
    global _warned
    with _warn_lock:
        if _warned:
            return False
        _warned = True
    warnings.warn(f"prime_kernels: the process group is not one NVLink domain ({reason}); expert parallelism runs "
                  "on the all-to-all path (path 1) instead of reading peers' memory (path 2)",
                  RuntimeWarning, stacklevel=2)
    return True


# NVLink multicast (NVLS) is never used by this library, and is disabled on the machines it is tested on: NCCL's
# NVLS algorithms, torch symmetric memory's multicast object and NVSHMEM's NVLS collectives all create one.
MULTICAST_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast_env() -> list[str]:
    """Set the variables of :data:`MULTICAST_OFF_ENV` in ``os.environ`` where they are unset: the environment the
    library and its tests run under. A variable the user already set to another value is left alone; the names of
    those are returned (empty: all are as wanted). Call it before the first process group and symmetric-memory
    allocation of the process, since NCCL and torch read them when they set up."""
    conflicts = []
    for name, value in MULTICAST_OFF_ENV.items():
        current = os.environ.setdefault(name, value)
        if current != value:
            conflicts.append(name)
    return conflicts
