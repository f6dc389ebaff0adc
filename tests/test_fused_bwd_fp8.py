"""The fused FP8 dgrad (prime_kernels.swiglu_bwd_fp8.mega_moe_fp8_dgrad_fused, op
prime_kernels::mega_moe_fp8_dgrad_fused, csrc/sm90/mega_moe_bwd_fp8.cuh) against the two launches it replaces in the
FP8 backward (prime_kernels.mega._fp8_bwd.data_grads): m_grouped_fp8_gemm_swiglu_bwd, then m_grouped_fp8_gemm_nt on
its qK(dh) and W13^T.

The inputs are the FP8 backward's own: a routing plan with 128-row expert blocks, qK(dy) dispatched into the pool, the
weights' FP8 copies transposed as the weight cache makes them. CPU: the wrapper runs the two ops' CPU kernels (their
bits by construction), its argument checks, the fake kernel, the status entry and the C ABI. GPU (sm90): every output
of the fused kernel bit for bit the two launches' over routings, shapes, clamps, scale options, grid sizes and lags,
on NaN-poisoned memory, and a second run bit for bit the first. The status entry stays unverified until these have
passed on a GPU, so the tests call the op directly (it runs where the entry could run), never through a layer.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import prime_kernels
from conftest import requires_sm90
from mega_helpers import make_problem, poison_free_memory
from prime_kernels import _lib, _status, _verification
from prime_kernels import swiglu_bwd_fp8 as sbf
from prime_kernels.grouped_gemm import m_grouped_fp8_gemm_nt
from prime_kernels.mega import _fp8_fwd, fp8 as recipe
from prime_kernels.routing import routing_plan_reference

E4M3 = torch.float8_e4m3fn
KEY = sbf.FUSED_KEY
_WHY = _status.runnable(KEY)
requires_fused = pytest.mark.skipif(not _status.is_available(_WHY), reason=f"{KEY} cannot run here: {_WHY}")
PK_OK, PK_ERR_NOT_AVAILABLE = 0, 2


def one_expert_takes_most(idx: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """topk_idx with expert 0 in the first slot of a share of the tokens (the slot it held, if any, gets that
    token's first expert), so that one expert's rows are most of the pool."""
    idx = idx.clone()
    for t in torch.nonzero(torch.rand(idx.shape[0], generator=gen) < share).flatten().tolist():
        row = idx[t]
        hit = torch.nonzero(row == 0).flatten()
        if hit.numel():
            row[hit[0]] = row[0]
        row[0] = 0
    return idx


def make_state(T, H, I, E, K, *, routing="uniform", masked=0.0, used=None, pow2=False, seed=0, device="cpu"):
    """What the FP8 backward hands its two data-gradient launches (_fp8_bwd.data_grads): the pool of qK(dy) from a
    routing plan with 128-row expert blocks (padding rows unspecified, as there), the saved h (random: its padding
    rows NaN, which no output may read), the plan's pool_src_route and offsets, fp32 topk_weights [T, K], and the
    FP8 copies of W2 and W13 transposed as the weight cache makes them."""
    gen = torch.Generator().manual_seed(seed + 1)
    mk = "uniform" if routing == "one_expert" else routing
    _x, idx, w, w13, w2, dy = make_problem(T, H, I, E, K, routing=mk, seed=seed, masked_frac=masked,
                                           experts_used=used)
    if routing == "one_expert":
        idx = one_expert_takes_most(idx, 0.9, gen)
    plan = routing_plan_reference(idx, E, 128)
    assert all(o % 128 == 0 for o in plan.expert_offsets.tolist())
    cap = plan.pool_src_route.shape[0]
    h = (torch.randn(cap, 2 * I, generator=gen) * 2).bfloat16()
    h[plan.pool_src_route < 0] = float("nan")
    dev = torch.device(device)
    dy, h, idx, w, w13, w2 = (t.to(dev) for t in (dy, h, idx, w, w13, w2))
    counts, offsets = plan.expert_counts.to(dev), plan.expert_offsets.to(dev)
    route_to_pool, src = plan.route_to_pool.to(dev), plan.pool_src_route.to(dev)
    dy_q, dy_sa = _fp8_fwd.quantized_pool(dy, route_to_pool, counts, offsets, cap, pow2, zero_padding=False)
    w2t = recipe.QuantizedWeight(recipe.quantize_weight(w2, pow2)).transposed
    w13t = recipe.QuantizedWeight(recipe.quantize_weight(w13, pow2)).transposed
    return dict(dy_q=dy_q, dy_sa=dy_sa, w2t_q=w2t.data, w2t_sb=w2t.scale, w13t_q=w13t.data, w13t_sb=w13t.scale,
                group_offsets=offsets, h=h, pool_src_route=src, topk_weights=w.float().contiguous())


def poisoned_outputs(st):
    """The L2 dgrad's outputs in its layouts, every byte NaN (e4m3 0x7F) but dt_part's rows outside every group, which
    are zeros in the layout (allocate_outputs) and unwritten by both paths."""
    out = sbf.allocate_outputs(st["dy_q"].shape[0], st["w2t_q"].shape[1], st["dy_q"].device)
    rows = int(st["group_offsets"][-1])
    for t in out:
        if t.dtype == E4M3:
            t.view(torch.uint8).fill_(0x7F)
        elif t is out.dt_part:
            t[:rows].fill_(float("nan"))
        else:
            t.fill_(float("nan"))
    return out


def pipeline(st, clamp=None, pow2=False, num_sms=None, out=None):
    """The FP8 backward's two launches, as data_grads makes them."""
    l2 = sbf.m_grouped_fp8_gemm_swiglu_bwd(st["dy_q"], st["dy_sa"], st["w2t_q"], st["w2t_sb"], st["group_offsets"],
                                           st["h"], st["pool_src_route"], st["topk_weights"], clamp=clamp,
                                           pow2_scales=pow2, num_sms=num_sms, out=out)
    return l2, m_grouped_fp8_gemm_nt(l2.dh_q, l2.dh_sa, st["w13t_q"], st["w13t_sb"], st["group_offsets"],
                                     num_sms=num_sms)


def fused(st, clamp=None, pow2=False, num_sms=0, lag=-1, out=None):
    return sbf.mega_moe_fp8_dgrad_fused(**st, clamp=clamp, pow2_scales=pow2, num_sms=num_sms, lag=lag, out=out)


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def written(name, t):
    """The values of one output region hold no NaN (an element a kernel left unwritten keeps its poison)."""
    b = t.detach().cpu()
    nan = (b.view(torch.uint8) & 0x7F) == 0x7F if b.dtype == E4M3 else torch.isnan(b.float())
    assert not bool(nan.any()), f"{name}: {int(nan.sum())} values unwritten (still NaN)"


def regions(l2, dx, rows):
    """(name, tensor) of what both paths write: the rows of the groups (offsets are multiples of 128, so whole
    128-row blocks of the qT outputs' token axis), dt_part whole (zeros past the groups in both)."""
    tb = -(-rows // 128)
    return [("dh_q", l2.dh_q[:rows]), ("dh_sa", l2.dh_sa[:rows]), ("dht_q", l2.dht_q[:, :rows]),
            ("dht_s", l2.dht_s[:, :tb]), ("awt_q", l2.awt_q[:, :rows]), ("awt_s", l2.awt_s[:, :tb]),
            ("dt_part", l2.dt_part), ("dx_pool", dx[:rows])]


def assert_same_bits(got, want, rows, what=""):
    for (name, a), (_, b) in zip(regions(*got, rows), regions(*want, rows)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}{name}: {a.dtype} {list(a.shape)}"
        written(f"{what}{name}", a)
        assert torch.equal(bits(a), bits(b)), f"{what}{name}: differs from the two launches"


# ---------------------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("clamp,pow2", [(None, False), (1.5, True)])
@pytest.mark.parametrize("T,H,I,E,K,routing,masked,used", [
    (61, 256, 256, 8, 3, "skewed", 0.15, None),   # uneven experts, empty ones, masked routes
    (1, 128, 128, 2, 1, "uniform", 0.0, None),
    (40, 320, 128, 6, 2, "one_expert", 0.1, 4),   # H = 64 (mod 128); experts without rows
])
def test_cpu_is_the_two_ops_bit_for_bit(T, H, I, E, K, routing, masked, used, clamp, pow2):
    st = make_state(T, H, I, E, K, routing=routing, masked=masked, used=used, pow2=pow2, seed=T + E)
    rows = int(st["group_offsets"][-1])
    got = fused(st, clamp=clamp, pow2=pow2, out=poisoned_outputs(st))
    want = pipeline(st, clamp=clamp, pow2=pow2, out=poisoned_outputs(st))
    assert isinstance(got[0], sbf.Fp8SwigluBwd) and got[1].dtype == torch.bfloat16
    assert tuple(got[1].shape) == (st["dy_q"].shape[0], H)
    assert_same_bits(got, want, rows)


def test_cpu_writes_into_out_and_allocates_without_it():
    st = make_state(30, 128, 128, 3, 2, seed=4)
    out = poisoned_outputs(st)
    l2, dx = fused(st, out=out)
    assert all(a is b for a, b in zip(l2, out))
    l2b, dxb = fused(st)
    assert_same_bits((l2b, dxb), (l2, dx), int(st["group_offsets"][-1]))


def test_rejects_what_the_fused_kernel_does_not_take_before_writing():
    """On any device, before anything runs: I not a multiple of 128 (the two launches take I = 64 mod 128, the fused
    kernel does not), more than 256 experts (its tables in shared memory), W13^T of the wrong shape or dtype, a lag or num_sms out of range."""
    st = make_state(20, 128, 192, 2, 1, seed=1)
    ok = make_state(20, 128, 128, 2, 1, seed=1)

    def expect(state, msg, exc=ValueError, **kw):
        out = poisoned_outputs(state)
        with pytest.raises(exc, match=msg):
            fused(state, out=out, **kw)
        assert all(bool((t.view(torch.uint8) == 0x7F).all()) if t.dtype == E4M3 else bool(torch.isnan(t[:20]).all())
                   for t in out), "an output was written"

    expect(st, r"I \(192\) must be a multiple of 128")
    expect(make_state(20, 128, 128, 257, 1, seed=1), "257 experts; the fused kernel takes at most 256")
    expect(dict(ok, w13t_q=ok["w13t_q"][:, :64].contiguous()), r"w13t_q must be float8_e4m3fn \[E, H, 2I\]")
    expect(dict(ok, w13t_q=ok["w13t_q"].float()), "w13t_q must be float8_e4m3fn")
    expect(dict(ok, w13t_sb=ok["w13t_sb"][..., :1].contiguous()), r"w13t_sb must be float32 \[E, ceil\(H/128\)")
    expect(ok, "lag must be -1", lag=65)
    expect(ok, "lag must be -1", lag=-2)
    expect(ok, "lag must be -1", lag=True)
    expect(ok, "num_sms must be None or an int >= 0", num_sms=-1)
    expect(ok, "clamp must be >= 0", clamp=-1.0)  # the L2 dgrad's own rules, as its op checks them
    expect(dict(ok, group_offsets=torch.tensor([0, 100, 128], dtype=torch.int32)), "multiple of 128 or M")


def test_fake_kernel_gives_dx_pool_and_writes_the_outputs_in_place():
    M, H, I, E = 300, 384, 256, 2
    meta = dict(device="meta")
    out = sbf.allocate_outputs(M, I, "meta")
    args = (torch.empty(M, H, dtype=E4M3, **meta), prime_kernels.grouped_gemm.k_block_major_empty(M, H // 128, "meta"),
            torch.empty(E, I, H, dtype=E4M3, **meta), torch.empty(E, I // 128, H // 128, **meta),
            torch.empty(E, H, 2 * I, dtype=E4M3, **meta), torch.empty(E, H // 128, 2 * I // 128, **meta),
            torch.empty(E + 1, dtype=torch.int32, **meta), torch.empty(M, 2 * I, dtype=torch.bfloat16, **meta),
            torch.empty(M, dtype=torch.int32, **meta), torch.empty(M, **meta))
    dx = torch.ops.prime_kernels.mega_moe_fp8_dgrad_fused(*args, *out, 0.0, False, 0, -1)
    assert dx.device.type == "meta" and tuple(dx.shape) == (M, H) and dx.dtype == torch.bfloat16


def test_status_entry_is_withheld_and_never_available():
    """Verified on a GPU and no faster than the two launches: status() and reason() give the withholding note where
    it could run (so no layer chooses it, and the FP8 backward runs the two launches), runnable() says whether it
    could, and README's row says verified."""
    from prime_kernels.mega import _fp8_bwd

    entry = _status.KERNELS[KEY]
    assert (entry.compiled_as, entry.family) == ("mega_moe_bwd_fp8", "sm90")
    assert KEY in _status.withheld() and KEY not in _status.unverified()
    st = prime_kernels.status()
    assert not _status.is_available(st[KEY])
    if _status.is_available(_WHY):
        assert st[KEY] == _status.withheld()[KEY]
    elif not torch.cuda.is_available() and ("mega_moe_bwd_fp8", "90a") in _lib.compiled_kernels():
        assert st[KEY] == "no CUDA device"
    assert _verification.cell(KEY).level == _verification.VERIFIED
    assert _fp8_bwd.FUSED_DGRAD_KEY == KEY
    assert not _fp8_bwd._fused_dgrad_runs(torch.device("cuda"), torch.empty(8, 128, 128, device="meta"))


def test_the_build_lists_the_kernel_when_it_has_sm90():
    if "90a" not in _lib.built_archs():
        pytest.skip(f"this build has no sm90 kernels ({_lib.built_archs()})")
    assert ("mega_moe_bwd_fp8", "90a") in _lib.compiled_kernels()


def _core():
    core = _lib.load().core
    if core is None:
        pytest.skip(f"the native core is not loaded: {_lib.load().reason}")
    c = ctypes
    core.pk_mega_moe_bwd_fp8_counter_count.argtypes = [c.c_int64, c.c_int]
    core.pk_mega_moe_bwd_fp8_counter_count.restype = c.c_int64
    i64, ptr = c.c_int64, c.c_void_p
    core.pk_mega_moe_bwd_fp8.argtypes = (
        [ptr, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr,
         i64, ptr, i64, ptr, i64, ptr, i64, ptr, c.c_int, i64, i64, i64, c.c_float, c.c_int, ptr, i64, i64, ptr, i64,
         i64, ptr, i64, ptr, c.c_int, c.c_int, ptr])
    core.pk_mega_moe_bwd_fp8.restype = c.c_int
    core.pk_last_error.restype = c.c_char_p
    return core


def test_c_abi_counters_and_the_call_without_a_device():
    """One counter per 128-row m-block any grouping can have, one per expert, the task claim; without an sm90
    device (or in a build without sm90) the call refuses before it touches anything."""
    core = _core()
    assert core.pk_mega_moe_bwd_fp8_counter_count(300, 4) == (3 + 4) + 4 + 1
    assert core.pk_mega_moe_bwd_fp8_counter_count(0, 8) == 8 + 8 + 1
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm90 device is here: the GPU tests call the kernel")
    p = 0x1000
    args = [p, 256, p, 256, p, 256, 256 * 256, p, 2, 2, p, 512, p, p, 100, p, 512, p, 256, p, 256, p, 512, p, 256, p,
            256, p, 2, p, 2, 256, 256, 256, 0.0, 0, p, 512, 256 * 512, p, 4, 2, p, 256, p, -1, 0, None]
    rc = core.pk_mega_moe_bwd_fp8(*args)
    msg = core.pk_last_error().decode()
    assert rc != PK_OK, msg
    if "90a" not in _lib.built_archs():
        assert (rc, msg) == (PK_ERR_NOT_AVAILABLE, "mega_moe_bwd_fp8 is not built: rebuild with "
                                                   "PRIME_KERNELS_CUDA_ARCHS=90a")


# ---------------------------------------------------------------------------------------------------------- GPU


GPU_CASES = [  # T, E, H, I, K, routing, masked, experts used, clamp, pow2
    (1, 4, 256, 256, 2, "uniform", 0.0, None, None, False),
    (2, 16, 512, 128, 4, "uniform", 0.0, None, 1.5, True),
    (131, 16, 320, 256, 4, "skewed", 0.1, None, None, False),     # H = 64 (mod 128): half of L1's last block
    (513, 128, 256, 256, 8, "uniform", 0.0, 40, 1.5, False),      # 88 experts without rows
    (2048, 4, 2048, 768, 2, "one_expert", 0.0, None, None, True),  # the 30B widths, one expert most of the pool
    (513, 16, 2048, 768, 8, "uniform", 0.2, None, 1.5, True),     # masked routes
    (2048, 128, 512, 128, 8, "skewed", 0.05, None, None, False),  # many m-blocks, many experts
    (131, 4, 256, 256, 2, "all_masked", 0.0, None, None, False),  # a pool of padding: no task
]


@requires_sm90
@requires_fused
@pytest.mark.parametrize("T,E,H,I,K,routing,masked,used,clamp,pow2", GPU_CASES)
def test_cuda_is_the_two_launches_bit_for_bit(T, E, H, I, K, routing, masked, used, clamp, pow2):
    """Every output of every run (every SM or 7, the heuristic's lag, 0 and 3, then the first setting again) equals
    the two launches' on the same inputs, on memory filled with NaN before each run."""
    st = make_state(T, H, I, E, K, routing=routing, masked=masked, used=used, pow2=pow2, seed=T + E + H,
                    device="cuda")
    rows = int(st["group_offsets"][-1])
    poison_free_memory()
    want = pipeline(st, clamp=clamp, pow2=pow2, out=poisoned_outputs(st))
    torch.cuda.synchronize()
    prime_kernels.check_device_errors()
    for name, t in regions(*want, rows):
        written(f"pipeline {name}", t)
    settings = [(sms, lag) for sms in (0, 7) for lag in (-1, 0, 3)] + [(0, -1)]
    for sms, lag in settings:
        poison_free_memory()
        got = fused(st, clamp=clamp, pow2=pow2, num_sms=sms, lag=lag, out=poisoned_outputs(st))
        torch.cuda.synchronize()
        prime_kernels.check_device_errors()
        assert_same_bits(got, want, rows, f"num_sms={sms} lag={lag}: ")


@requires_sm90
@requires_fused
def test_cuda_allocates_the_outputs_and_repeats_bitwise():
    st = make_state(300, 256, 256, 8, 4, routing="skewed", masked=0.1, seed=21, device="cuda")
    rows = int(st["group_offsets"][-1])
    poison_free_memory()
    first = fused(st, clamp=1.5)
    poison_free_memory()
    again = fused(st, clamp=1.5)
    assert_same_bits(again, first, rows)


@requires_sm90
@requires_fused
def test_cuda_op_refuses_what_the_kernel_does_not_take():
    """The op itself (no wrapper in front): I = 64 (mod 128) and a lag past 64 are refused before a launch."""
    st = make_state(20, 128, 192, 2, 1, seed=2, device="cuda")
    out = poisoned_outputs(st)
    op = torch.ops.prime_kernels.mega_moe_fp8_dgrad_fused
    args = [st[k] for k in ("dy_q", "dy_sa", "w2t_q", "w2t_sb")]
    w13t = torch.zeros(2, 128, 384, dtype=E4M3, device="cuda"), torch.ones(2, 1, 3, device="cuda")
    rest = [st[k] for k in ("group_offsets", "h", "pool_src_route")] + [st["topk_weights"].reshape(-1)]
    with pytest.raises(RuntimeError, match=r"I \(192\) must be a multiple of 128"):
        op(*args, *w13t, *rest, *out, 0.0, False, 0, -1)
    ok = make_state(20, 128, 128, 2, 1, seed=2, device="cuda")
    out = poisoned_outputs(ok)
    with pytest.raises(RuntimeError, match="lag = 65"):
        op(*[ok[k] for k in ("dy_q", "dy_sa", "w2t_q", "w2t_sb", "w13t_q", "w13t_sb", "group_offsets", "h",
                             "pool_src_route")], ok["topk_weights"].reshape(-1), *out, 0.0, False, 0, 65)
    torch.cuda.synchronize()
    assert bool((out.dh_q.view(torch.uint8) == 0x7F).all()), "an output was written"


@requires_sm90
@requires_fused
def test_cuda_offsets_off_the_128_row_grid_write_nothing():
    st = make_state(200, 128, 128, 2, 1, seed=5, device="cuda")
    m = st["dy_q"].shape[0]
    st["group_offsets"] = torch.tensor([0, 100, m], dtype=torch.int32, device="cuda")  # unchecked on the host
    out = poisoned_outputs(st)
    fused(st, out=out)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="group_offsets"):
        prime_kernels.check_device_errors()
    assert bool((out.dh_q.view(torch.uint8) == 0x7F).all()) and bool(torch.isnan(out.dh_sa).all())
