"""The routing plan op against its pure-torch reference, on the CPU (core host loop) and the GPU."""

import pytest
import torch

import prime_kernels
from conftest import requires_gpu
from prime_kernels.routing import RoutingPlan, pool_capacity, routing_plan, routing_plan_reference

FIELDS = ("expert_counts", "expert_offsets", "pool_src_route", "pool_src_rank", "route_to_pool")


def make_topk(T: int, E: int, K: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Routings the kernels must survive: uniform, skewed, one hot expert, empty experts, masked."""
    if kind == "uniform":
        scores = torch.randn(T, E, generator=gen)
        return torch.topk(torch.softmax(scores, -1), min(K, E), dim=-1).indices
    if kind == "zipf":
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.1
        pop = pop[torch.randperm(E, generator=gen)]
        return torch.multinomial(pop.expand(T, E), min(K, E), replacement=False, generator=gen)
    if kind == "hot":  # every token picks expert 3 first (duplicates across k allowed elsewhere)
        idx = torch.randint(0, E, (T, K), generator=gen)
        idx[:, 0] = 3 % E
        return idx
    if kind == "half_empty":  # only even experts are used
        return torch.randint(0, max(1, E // 2), (T, K), generator=gen) * 2 % E
    if kind == "masked":
        idx = torch.randint(0, E, (T, K), generator=gen)
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
        return idx
    if kind == "all_masked":
        return torch.full((T, K), -1, dtype=torch.int64)
    raise ValueError(kind)


def check_invariants(plan: RoutingPlan, topk_idx: torch.Tensor) -> None:
    """Independent of the reference: counts, padding, stable order and the two maps agree."""
    T, K = topk_idx.shape
    idx = topk_idx.cpu().to(torch.int64)
    counts = plan.expert_counts.cpu().to(torch.int64)
    offsets = plan.expert_offsets.cpu().to(torch.int64)
    src = plan.pool_src_route.cpu().to(torch.int64)
    r2p = plan.route_to_pool.cpu().to(torch.int64).reshape(-1)
    E = plan.num_experts
    for e in range(E):
        assert counts[e] == int((idx == e).sum())
        assert offsets[e] % plan.block_m == 0
        assert offsets[e + 1] - offsets[e] == (counts[e] + plan.block_m - 1) // plan.block_m * plan.block_m
        rows = src[offsets[e]:offsets[e] + counts[e]]
        assert bool((rows >= 0).all())
        assert bool((rows[1:] > rows[:-1]).all()), "pool rows of an expert must be in (token, k) order"
        assert bool((idx.reshape(-1)[rows] == e).all())
        assert bool((src[offsets[e] + counts[e]:offsets[e + 1]] == -1).all())
    assert bool((src[offsets[E]:] == -1).all())
    used = r2p >= 0
    assert bool((used == (idx.reshape(-1) >= 0)).all())
    assert bool((src[r2p[used]] == torch.nonzero(used).squeeze(1)).all())


CASES = [(1, 8, 1, "uniform", 1), (7, 8, 2, "masked", 16), (37, 8, 4, "hot", 16), (1000, 64, 8, "zipf", 128),
         (129, 256, 8, "half_empty", 64), (300, 16, 8, "all_masked", 128), (255, 128, 6, "uniform", 128),
         (513, 1, 1, "uniform", 7)]


@pytest.mark.parametrize("T,E,K,kind,block_m", CASES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cpu_op_matches_reference(T, E, K, kind, block_m, dtype):
    gen = torch.Generator().manual_seed(T * 31 + E)
    idx = make_topk(T, E, K, kind, gen).to(dtype).contiguous()
    ref = routing_plan_reference(idx, E, block_m)
    plan = routing_plan(idx, E, block_m)
    for f in FIELDS:
        assert torch.equal(getattr(plan, f), getattr(ref, f)), f
    check_invariants(plan, idx)
    assert plan.pool_capacity == pool_capacity(T, idx.size(1), E, block_m)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="outside"):
        routing_plan(torch.tensor([[0, 8]]), 8, 16)
    with pytest.raises(ValueError, match="outside"):
        routing_plan(torch.tensor([[0, -2]]), 8, 16)
    with pytest.raises(ValueError, match="outside"):
        routing_plan_reference(torch.tensor([[0, 9]]), 8, 16)
    with pytest.raises(TypeError, match="int64 or int32"):
        routing_plan(torch.zeros(2, 2), 8, 16)
    with pytest.raises(ValueError, match="2-D"):
        routing_plan(torch.zeros(4, dtype=torch.int64), 8, 16)
    with pytest.raises(RuntimeError, match="num_experts must be in"):
        torch.ops.prime_kernels.routing_plan(torch.zeros(2, 2, dtype=torch.int64), 5000, 16, 0)
    # validate=False maps bad ids to masked routes instead
    plan = routing_plan(torch.tensor([[0, 8]]), 8, 16, validate=False)
    assert plan.route_to_pool.tolist() == [[0, -1]]


def test_opcheck_and_fake():
    idx = make_topk(33, 16, 4, "masked", torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.prime_kernels.routing_plan.default, (idx, 16, 32, 0))
    torch.library.opcheck(torch.ops.prime_kernels.routing_plan.default, (idx, 16, 32, 0, pool_capacity(33, 4, 16, 32) + 5))
    compiled = torch.compile(lambda t: torch.ops.prime_kernels.routing_plan(t, 16, 32, 0), backend="aot_eager",
                             fullgraph=True)
    ref = routing_plan_reference(idx, 16, 32)
    assert torch.equal(compiled(idx)[4], ref.route_to_pool)


@requires_gpu
@pytest.mark.parametrize("T,E,K,kind,block_m", CASES + [(16384, 128, 8, "uniform", 128),
                                                        (16384, 128, 8, "zipf", 128),
                                                        (4097, 256, 8, "masked", 64),
                                                        # scan slices: 3 per expert (E=300), 1 (E=3000)
                                                        (20000, 300, 8, "zipf", 1), (6000, 3000, 4, "uniform", 16),
                                                        # the most experts (the scan's shared memory bound)
                                                        (5000, 4096, 2, "uniform", 8)])
def test_cuda_matches_reference_and_is_deterministic(T, E, K, kind, block_m):
    gen = torch.Generator().manual_seed(T + 7 * E)
    idx = make_topk(T, E, K, kind, gen).cuda()
    ref = routing_plan_reference(idx.cpu(), E, block_m)
    plans = [routing_plan(idx, E, block_m) for _ in range(3)]
    for f in FIELDS:
        for p in plans:
            assert torch.equal(getattr(p, f).cpu(), getattr(ref, f)), f
    check_invariants(plans[0], idx)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
def test_capacity_lays_the_plan_into_more_rows(device):
    """A caller's fixed capacity: the same plan, the rows past it padding; below the minimum raises."""
    idx = make_topk(129, 16, 4, "masked", torch.Generator().manual_seed(11)).to(device)
    need = pool_capacity(129, 4, 16, 8)
    base = routing_plan(idx, 16, 8)
    assert base.pool_src_route.numel() == need
    for cap in (need, need + 77):
        plan = routing_plan(idx, 16, 8, capacity=cap)
        for f in ("pool_src_route", "pool_src_rank"):
            t = getattr(plan, f).cpu()
            assert t.shape == (cap,), f
            assert torch.equal(t[:need], getattr(base, f).cpu()), f
            assert bool((t[need:] == -1).all()), f
        for f in ("expert_counts", "expert_offsets", "route_to_pool"):
            assert torch.equal(getattr(plan, f).cpu(), getattr(base, f).cpu()), f
    with pytest.raises(ValueError, match="capacity"):
        routing_plan(idx, 16, 8, capacity=need - 1)
    with pytest.raises(RuntimeError, match="capacity"):
        torch.ops.prime_kernels.routing_plan(idx, 16, 8, 0, need - 1)


@requires_gpu
def test_cuda_invalid_ids_and_streams():
    idx = torch.tensor([[1, 2], [3, 99]], device="cuda")
    with pytest.raises(ValueError, match="outside"):
        routing_plan(idx, 8, 16)
    s = torch.cuda.Stream()
    big = make_topk(8192, 64, 8, "uniform", torch.Generator().manual_seed(3)).cuda()
    with torch.cuda.stream(s):
        plan = routing_plan(big, 64, 128, validate=False)
    s.synchronize()
    assert torch.equal(plan.route_to_pool.cpu(), routing_plan_reference(big.cpu(), 64, 128).route_to_pool)


def test_status_keys_for_routing():
    st = prime_kernels.status()
    assert "routing_plan.int32.sm90" in st and "routing_plan.int32.sm100" in st


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
@pytest.mark.parametrize("T,E,K", [(1000, 16, 4), (9000, 128, 8)])
def test_num_invalid_counts_out_of_range_ids(device, T, E, K):
    """validate=False plans an out-of-range id as a masked route and counts it in num_invalid (the count the
    kernel backends' expert-id check reads instead of a min/max pass); the rest of the plan is the reference's
    for the same ids with those routes masked."""
    gen = torch.Generator().manual_seed(T + E)
    idx = make_topk(T, E, K, "masked", gen)
    pos = torch.randperm(T * K, generator=gen)[:37]
    bad = torch.tensor([E, E + 1, 999, -2, -100])[torch.randint(0, 5, (37,), generator=gen)]
    idx.view(-1)[pos] = bad.to(idx.dtype)
    plan = routing_plan(idx.to(device), E, 8, validate=False)
    assert plan.num_invalid.shape == (1,) and int(plan.num_invalid[0]) == 37
    clean = idx.clone()
    clean.view(-1)[pos] = -1
    ref = routing_plan_reference(clean, E, 8)
    for f in FIELDS:
        assert torch.equal(getattr(plan, f).cpu(), getattr(ref, f)), f
    assert int(routing_plan(clean.to(device), E, 8, validate=False).num_invalid[0]) == 0
