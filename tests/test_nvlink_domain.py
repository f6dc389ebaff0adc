"""The NVLink-domain check of expert parallelism's path 2 (prime_kernels.mega._nvlink_domain), on the CPU: a fake
NVML stands in for the driver's library, and a gloo group of two spawned processes stands in for the ranks."""

from __future__ import annotations

import json
import os
import tempfile
import types
import warnings
from datetime import timedelta

import pytest
import torch

from prime_kernels.mega import _nvlink_domain as nd
from mega_helpers import end_rank, spawn_ranks

BUS = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
       "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0"]


class FakeNvml:
    """NVML as the check sees it: devices by bus id, a P2P status per pair (OK unless listed in ``broken``),
    NVML's own refusal of a device paired with itself, and counts of init/shutdown."""

    def __init__(self, bus_ids, broken=None, init_error=False, p2p_error=None):
        self.handles = {nd.normalize_bus_id(b): k + 1 for k, b in enumerate(bus_ids)}
        self.broken = {frozenset(nd.normalize_bus_id(b) for b in pair): st for pair, st in (broken or {}).items()}
        self.init_error = init_error
        self.p2p_error = frozenset(nd.normalize_bus_id(b) for b in p2p_error) if p2p_error else None
        self.inits = self.shutdowns = 0
        self.queries: list[tuple[int, int, int]] = []

    def _bus(self, handle):
        return next(b for b, h in self.handles.items() if h == handle)

    def init(self):
        if self.init_error:
            raise nd.NvmlError("nvmlInit_v2", 9, "Driver Not Loaded")
        self.inits += 1

    def shutdown(self):
        self.shutdowns += 1

    def handle_by_pci_bus_id(self, bus_id):
        assert self.inits > self.shutdowns, "NVML asked before nvmlInit"
        if bus_id not in self.handles:
            raise nd.NvmlError("nvmlDeviceGetHandleByPciBusId_v2", 6, "Not Found")
        return self.handles[bus_id]

    def p2p_status(self, h1, h2, caps_index):
        self.queries.append((h1, h2, caps_index))
        if h1 == h2:
            raise nd.NvmlError("nvmlDeviceGetP2PStatus", 2, "Invalid Argument")
        pair = frozenset((self._bus(h1), self._bus(h2)))
        if pair == self.p2p_error:
            raise nd.NvmlError("nvmlDeviceGetP2PStatus", 999, "Unknown Error")
        return self.broken.get(pair, nd.NVML_P2P_STATUS_OK)

    def handle_by_uuid(self, uuid):
        if uuid != "GPU-1234":
            raise nd.NvmlError("nvmlDeviceGetHandleByUUID", 6, "Not Found")
        return 1

    def pci_bus_id(self, handle):
        return "00000000:18:00.0"


def test_enum_values_of_nvml_h():
    assert (nd.NVML_P2P_CAPS_INDEX_READ, nd.NVML_P2P_CAPS_INDEX_WRITE, nd.NVML_P2P_CAPS_INDEX_NVLINK,
            nd.NVML_P2P_CAPS_INDEX_ATOMICS, nd.NVML_P2P_CAPS_INDEX_PCI, nd.NVML_P2P_CAPS_INDEX_UNKNOWN) == (0, 1, 2, 3,
                                                                                                           4, 5)
    assert [nd.P2P_STATUS_NAMES[v] for v in range(7)] == [
        "NVML_P2P_STATUS_OK", "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED", "NVML_P2P_STATUS_GPU_NOT_SUPPORTED",
        "NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED", "NVML_P2P_STATUS_DISABLED_BY_REGKEY",
        "NVML_P2P_STATUS_NOT_SUPPORTED", "NVML_P2P_STATUS_UNKNOWN"]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_nvlink_is_one_domain(n):
    fake = FakeNvml(BUS[:n])
    assert nd.nvlink_domain(BUS[:n], nvml=fake) == (True, "")
    assert fake.inits == fake.shutdowns == 1
    statuses = nd.pair_status(BUS[:n], nvml=fake)
    assert list(statuses) == [(i, j) for i in range(n) for j in range(i + 1, n)]
    assert set(statuses.values()) == {"NVML_P2P_STATUS_OK"}
    # every query asks for the NVLink capability, of two distinct GPUs
    assert {q[2] for q in fake.queries} == {nd.NVML_P2P_CAPS_INDEX_NVLINK}
    assert all(h1 != h2 for h1, h2, _ in fake.queries)


@pytest.mark.parametrize("status", [nd.NVML_P2P_STATUS_NOT_SUPPORTED, nd.NVML_P2P_STATUS_DISABLED_BY_REGKEY,
                                    nd.NVML_P2P_STATUS_UNKNOWN])
def test_one_pair_without_nvlink_is_named(status):
    fake = FakeNvml(BUS[:4], broken={(BUS[1], BUS[3]): status})
    ok, reason = nd.nvlink_domain(BUS[:4], nvml=fake)
    assert not ok
    assert "ranks 1 and 3" in reason, reason
    assert BUS[1] in reason and BUS[3] in reason, reason
    assert nd.P2P_STATUS_NAMES[status] in reason, reason
    assert nd.pair_status(BUS[:4], nvml=fake)[(1, 3)] == nd.P2P_STATUS_NAMES[status]


def test_first_failing_pair_is_the_one_named():
    fake = FakeNvml(BUS[:4], broken={(BUS[2], BUS[3]): nd.NVML_P2P_STATUS_NOT_SUPPORTED,
                                     (BUS[0], BUS[2]): nd.NVML_P2P_STATUS_GPU_NOT_SUPPORTED})
    ok, reason = nd.nvlink_domain(BUS[:4], nvml=fake)
    assert not ok and "ranks 0 and 2" in reason and "NVML_P2P_STATUS_GPU_NOT_SUPPORTED" in reason, reason


def test_status_value_outside_the_enum_fails():
    fake = FakeNvml(BUS[:2], broken={(BUS[0], BUS[1]): 42})
    ok, reason = nd.nvlink_domain(BUS[:2], nvml=fake)
    assert not ok and "value 42" in reason, reason


def test_nvml_errors_per_pair_fail_with_the_error():
    fake = FakeNvml(BUS[:3], p2p_error=(BUS[0], BUS[2]))
    ok, reason = nd.nvlink_domain(BUS[:3], nvml=fake)
    assert not ok and "ranks 0 and 2" in reason and "Unknown Error" in reason, reason
    fake = FakeNvml(BUS[:2])  # BUS[2] is on no device NVML knows
    ok, reason = nd.nvlink_domain(BUS[:3], nvml=fake)
    assert not ok and "ranks 0 and 2" in reason and f"no device for PCI bus id {BUS[2]}" in reason, reason
    assert fake.inits == fake.shutdowns == 1


def test_nvml_missing_gives_the_reason(monkeypatch):
    monkeypatch.setattr(nd, "NVML_LIBRARY", "libprime-kernels-no-such-nvml.so.1")
    binding, why = nd.load_nvml()
    assert binding is None and "libprime-kernels-no-such-nvml.so.1" in why and "could not be loaded" in why, why
    ok, reason = nd.nvlink_domain(BUS[:2])
    assert not ok, reason
    assert "NVML could not be asked" in reason and "libprime-kernels-no-such-nvml.so.1" in reason, reason
    with pytest.raises(nd.NvmlUnavailable):
        nd.pair_status(BUS[:2])


def test_nvml_init_failure_gives_the_reason():
    fake = FakeNvml(BUS[:2], init_error=True)
    ok, reason = nd.nvlink_domain(BUS[:2], nvml=fake)
    assert not ok and "NVML could not be initialized" in reason and "Driver Not Loaded" in reason, reason


def test_same_bus_id_is_one_gpu(monkeypatch):
    # no NVML is needed when every rank shares one GPU (the one-GPU emulator)
    monkeypatch.setattr(nd, "NVML_LIBRARY", "libprime-kernels-no-such-nvml.so.1")
    assert nd.nvlink_domain([BUS[0], BUS[0]]) == (True, "")
    assert nd.nvlink_domain(["0000:18:00.0", "00000000:18:00.0", "18:00.0"]) == (True, "")
    assert nd.pair_status([BUS[0], BUS[0]]) == {(0, 1): nd.STATUS_SAME_DEVICE}
    # mixed: two ranks on GPU A, one on GPU B; NVML is asked about A-B only, never A-A
    fake = FakeNvml(BUS[:2])
    assert nd.nvlink_domain([BUS[0], BUS[0], BUS[1]], nvml=fake) == (True, "")
    assert len(fake.queries) == 2 and all(h1 != h2 for h1, h2, _ in fake.queries)
    # and a broken A-B link still fails it
    fake = FakeNvml(BUS[:2], broken={(BUS[0], BUS[1]): nd.NVML_P2P_STATUS_NOT_SUPPORTED})
    ok, reason = nd.nvlink_domain([BUS[0], BUS[0], BUS[1]], nvml=fake)
    assert not ok and "ranks 0 and 2" in reason, reason


def test_single_gpu_is_one_domain():
    assert nd.nvlink_domain([BUS[0]], nvml=FakeNvml([])) == (True, "")
    assert nd.nvlink_domain([]) == (True, "")


def test_normalize_bus_id():
    assert nd.normalize_bus_id("0000:1a:00.0") == "00000000:1A:00.0"
    assert nd.normalize_bus_id(" 00000000:1A:00.0 ") == "00000000:1A:00.0"
    assert nd.normalize_bus_id("1a:00.0") == "00000000:1A:00.0"
    assert nd.normalize_bus_id("not-a-bus-id") == "NOT-A-BUS-ID"


def test_local_bus_id_from_torch_properties_and_from_nvml(monkeypatch):
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x9A, pci_device_id=0, uuid="ignored")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert nd.local_bus_id("cuda:3") == "00000000:9A:00.0"
    # an older torch without the PCI fields: NVML by UUID
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="1234"))
    fake = FakeNvml([])
    assert nd.local_bus_id("cuda:0", nvml=fake) == "00000000:18:00.0"
    assert fake.inits == fake.shutdowns == 1
    with pytest.raises(ValueError, match="not a CUDA device"):
        nd.local_bus_id("cpu")


def test_check_group_without_a_process_group():
    assert nd.check_group(None, "cpu") == (True, "")
    assert nd.check_group(None, "cpu", nvml=FakeNvml([], init_error=True)) == (True, "")


def test_warn_fallback_once(monkeypatch):
    monkeypatch.setattr(nd, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert nd.warn_fallback_once("ranks 0 and 1 are not NVLink peers") is True
        assert nd.warn_fallback_once("another reason") is False
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert caught[0].category is RuntimeWarning
    assert "not one NVLink domain" in msg and "ranks 0 and 1 are not NVLink peers" in msg and "all-to-all" in msg


def test_disable_multicast_env(monkeypatch):
    for name in nd.MULTICAST_OFF_ENV:
        monkeypatch.delenv(name, raising=False)
    assert nd.disable_multicast_env() == []
    assert {k: os.environ[k] for k in nd.MULTICAST_OFF_ENV} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    # a value set already and equal is fine; one set to something else is left and reported
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert nd.disable_multicast_env() == ["NCCL_NVLS_ENABLE"]
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"


def test_real_nvml_when_present():
    binding, why = nd.load_nvml()
    if binding is None:
        pytest.skip(f"no NVML here: {why}")
    if not torch.cuda.is_available():
        pytest.skip("NVML loads but torch sees no CUDA GPU")
    ids = [nd.local_bus_id(f"cuda:{d}") for d in range(torch.cuda.device_count())]
    assert nd.nvlink_domain(ids[:1]) == (True, "")
    statuses = nd.pair_status(ids)
    known = set(nd.P2P_STATUS_NAMES.values())
    assert all(s in known for s in statuses.values()), statuses


# ---- two ranks over gloo: the decision is collective and identical on every rank ----

GLOO_BUS = [BUS[0], BUS[1]]


def _gloo_worker(rank, world, port, outdir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        g = dist.group.WORLD
        mine = GLOO_BUS[rank]
        res = {}
        res["bus_ids"] = nd.group_bus_ids(g, "cpu", bus_id=mine)
        res["all_nvlink"] = nd.check_group(g, "cpu", nvml=FakeNvml(GLOO_BUS), bus_id=mine)
        broken = FakeNvml(GLOO_BUS, broken={tuple(GLOO_BUS): nd.NVML_P2P_STATUS_NOT_SUPPORTED})
        res["not_nvlink"] = nd.check_group(g, "cpu", nvml=broken, bus_id=mine)
        # only rank 1's NVML fails: both ranks must still take the same decision
        res["nvml_fails_on_rank1"] = nd.check_group(g, "cpu", nvml=FakeNvml(GLOO_BUS, init_error=rank == 1),
                                                    bus_id=mine)
        res["hosts_differ"] = nd.check_group(g, "cpu", nvml=FakeNvml(GLOO_BUS), bus_id=mine, host_id=f"host{rank}")
        res["not_cuda"] = nd.check_group(g, "cpu", nvml=FakeNvml(GLOO_BUS))
        res["same_gpu"] = nd.check_group(g, "cpu", nvml=FakeNvml([], init_error=True), bus_id=BUS[0])
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        end_rank(rank, outdir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_check_group_over_gloo_two_ranks():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world = 2
    with tempfile.TemporaryDirectory() as outdir:
        codes = spawn_ranks(_gloo_worker, world, outdir, (), 60)
        assert codes == [0, 0], codes
        res = [json.load(open(os.path.join(outdir, f"rank{r}.json"))) for r in range(world)]
    assert res[0] == res[1], res
    r = res[0]
    assert r["bus_ids"] == GLOO_BUS
    assert r["all_nvlink"] == [True, ""]
    ok, why = r["not_nvlink"]
    assert not ok and "ranks 0 and 1" in why and "NVML_P2P_STATUS_NOT_SUPPORTED" in why and GLOO_BUS[1] in why, why
    ok, why = r["nvml_fails_on_rank1"]
    assert not ok and why.startswith("rank 1 finds: ") and "Driver Not Loaded" in why, why
    ok, why = r["hosts_differ"]
    assert not ok and "different hosts" in why and "host0" in why and "host1" in why, why
    ok, why = r["not_cuda"]
    assert not ok and "rank 0 has no PCI bus id" in why and "not a CUDA device" in why, why
    assert r["same_gpu"] == [True, ""]
