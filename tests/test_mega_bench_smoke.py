"""bench/bench_layer.py --smoke runs on the CPU and writes a results file with the documented fields (docs/performance.md);
bench/bench_bwd_dgrad.py, whose fused kernel has no CPU path, has its arguments, FLOP count, inputs and output check
tested on the CPU."""

import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"

TOP = {"gpu", "num_gpus", "torch", "cuda", "git_sha", "date", "peak_bf16_tflops", "timing", "options", "floor", "rows"}
ROW = {"shape", "num_experts", "hidden", "intermediate", "top_k", "shared_experts", "shared_intermediate", "tokens",
       "ep", "routing", "precision",
       "backend", "direction", "ms", "tflops", "pct_peak", "pct_peak_fp8", "ratio_vs_torch", "floor_ms",
       "ms_over_floor",
       "peak_mem_gib", "added_mem_gib"}


def _bench_module(name: str):
    """A module of bench/ (bench/ is on sys.path for the import only)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _run_smoke(out: Path, *extra: str) -> dict:
    """bench_layer.py --smoke at T=40 (2 iterations after 1 warm-up, no plot) plus `extra`; its results JSON."""
    _bench_module("bench_layer").main(["--smoke", "--tokens", "40", "--out", str(out), "--no-plot", "--iters", "2",
                                       "--warmup", "1", *extra])
    return json.loads(out.read_text())


def _timed_rows(doc) -> list[dict]:
    """The rows with a time: a peer installed here (sonicmoe on a CPU machine) has skipped rows instead."""
    return [r for r in doc["rows"] if not r.get("skipped")]


def test_bench_layer_smoke(tmp_path, capsys):
    plot_results = _bench_module("plot_results")
    out = tmp_path / "smoke.json"
    doc = _run_smoke(out)
    assert set(doc) == TOP
    assert doc["timing"]["iters"] == 2 and doc["timing"]["warmup"] == 1 and doc["timing"]["rounds"] >= 1
    assert doc["options"] == {"recompute": False, "keep_pooled_x": "auto", "activation_clamp": None,
                              "inference": False}
    assert not any(r["direction"] == "infer" for r in doc["rows"])
    rows = _timed_rows(doc)
    assert {(r["backend"], r["direction"], r["routing"]) for r in rows} >= {
        (b, d, g) for b in ("torch", "deep_gemm_reference") for d in ("fwd", "bwd", "fwdbwd")
        for g in ("uniform", "zipf")}
    for r in rows:
        want = ROW | ({"max_rel_err"} if r["backend"] != "torch" else set())
        assert set(r) == want, r
        if r["backend"] != "torch":
            assert r["max_rel_err"] < 1e-2
    assert not any(r["backend"] == "torch_fp8" for r in doc["rows"])  # only with --precision fp8/fp8_bwd or named
    assert "deep_gemm_reference" in capsys.readouterr().out  # the printed table
    png = plot_results.plot(out)
    if png is None:  # matplotlib missing: the plot is skipped with a message
        assert "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert Path(png).exists() and Path(png).stat().st_size > 0


def test_bench_layer_smoke_records_no_shared_experts(tmp_path):
    """Without --shared-experts every row says so (0 and None), and the floor is the routed experts' alone."""
    doc = _run_smoke(tmp_path / "plain.json", "--routings", "uniform", "--rounds", "1", "--no-check")
    assert all(r["shared_experts"] == 0 and r["shared_intermediate"] is None for r in doc["rows"])
    assert all("shared_experts" not in c for c in doc["floor"]["configs"])


@pytest.mark.parametrize("S,Is", [(1, None), (2, 64)])
def test_bench_layer_shared_experts_smoke(tmp_path, capsys, S, Is):
    """--shared-experts S (--shared-intermediate Is, default the shape's I): the torch baseline (torch_moe plus a
    dense MLP per shared expert) and our backends (here the reference) get every direction with S and Is in each row,
    ours within BF16 error of float64 in y and every gradient, the shared weights' included; torch_fp8, which has no
    shared experts, gets skipped rows with the reason; the floor counts the shared weights' gradient bytes."""
    extra = ["--shared-experts", str(S)] + ([] if Is is None else ["--shared-intermediate", str(Is)])
    doc = _run_smoke(tmp_path / "shared.json", "--backends", "torch,deep_gemm,deep_gemm_reference,torch_fp8",
                     "--rounds", "1", "--inference", *extra)
    E, H, I = 8, 128, 128  # the smoke shape (top-2)
    want_is = I if Is is None else Is
    rows = _timed_rows(doc)
    got = {(r["backend"], r["direction"], r["routing"]) for r in rows}
    assert got >= {(b, d, g) for b in ("torch", "deep_gemm_reference") for d in ("fwd", "bwd", "fwdbwd", "infer")
                   for g in ("uniform", "zipf")}, got
    for r in doc["rows"]:
        assert r["shared_experts"] == S and r["shared_intermediate"] == want_is, r
    for r in rows:
        assert set(r) == ROW | ({"max_rel_err"} if r["backend"] != "torch" else set()), r
        if r["backend"] != "torch":
            assert math.isfinite(r["max_rel_err"]) and r["max_rel_err"] < 1e-2, r
        if r["direction"] != "bwd":  # a difference of two timings: may be <= 0 at this size on the CPU
            assert r["ms"] > 0 and r["ratio_vs_torch"] > 0, r
    fp8 = [r for r in doc["rows"] if r["backend"] == "torch_fp8"]
    assert len(fp8) == 8 and all(r["skipped"] == "the torch_fp8 baseline has no shared experts (--shared-experts)"
                                 and r["ms"] is None for r in fp8), fp8
    for c in doc["floor"]["configs"]:
        assert (c["shared_experts"], c["shared_intermediate"]) == (S, want_is), c
        assert c["weight_grad_bytes"] == (E * 3 * I * H + S * 3 * want_is * H) * 2  # dW13 + dW2 + the shared, bf16
    out = capsys.readouterr().out
    assert "shared_intermediate" in out.split("[bench] wrote")[0]  # the printed table has the shared columns


def test_bench_layer_shared_flops_and_arguments():
    """The useful FLOPs add 6 T H Is (forward) and 12 T H Is (backward) per shared expert to the routed ones; bad
    --shared-* values are refused before anything runs."""
    b = _bench_module("bench_layer")
    routes, T, H, I, Is = 80, 40, 128, 96, 64
    for S in (0, 1, 3):
        fwd = 6.0 * H * (routes * I + S * T * Is)
        want = {"fwd": fwd, "infer": fwd, "bwd": 2 * fwd, "fwdbwd": 3 * fwd}
        for d, v in want.items():
            assert b._useful_flops(routes, T, H, I, S, Is if S else None, d) == v, (S, d)
    a = b.parse_args(["--shared-experts", "2"])
    assert (a.shared_experts, a.shared_intermediate) == (2, None) and b._shared_dims(768, a) == (2, 768)
    assert b._shared_dims(768, b.parse_args([])) == (0, None)
    assert b._shared_dims(768, b.parse_args(["--shared-experts", "1", "--shared-intermediate", "256"])) == (1, 256)
    for bad in (["--shared-experts", "-1"], ["--shared-intermediate", "64"],
                ["--shared-experts", "1", "--shared-intermediate", "0"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)


def test_bench_layer_torch_shared_baseline_matches_float64():
    """The torch baseline with shared experts (bench_layer's "torch" layer: torch_moe plus one dense bf16 SwiGLU
    MLP per shared expert, gate rows then up rows) is the layer our reference computes with the same shared weights,
    in y and every gradient, to BF16 error; the shared weights with gate and up swapped are not."""
    from prime_kernels.mega import mega_moe

    b = _bench_module("bench_layer")
    bc = _bench_module("bench_common")
    E, H, I, K = bc.SHAPES["smoke"]
    S, Is, T = 2, 64, 40
    w13, w2 = bc.make_weights(E, H, I, 0, "cpu")
    sw13, sw2 = bc.make_shared_weights(S, H, Is, 0, "cpu")
    assert sw13.shape == (S, 2 * Is, H) and sw2.shape == (S, H, Is)
    assert not torch.equal(sw13[0], sw13[1]) and not torch.equal(sw13[0, :, :64], w13[0, :2 * Is, :64])
    x, idx, w, dy = bc.make_tokens(T, E, H, K, "zipf", 0, "cpu")
    args = b.parse_args(["--shared-experts", str(S), "--shared-intermediate", str(Is)])
    torch_layer = b._layer_fn("torch", None, E, args)

    def errors(shared_w13):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2, shared_w13, sw2)]
        y = torch_layer(leaves[0], idx, leaves[1], *leaves[2:])
        grads = torch.autograd.grad(y, leaves, dy)
        ref = [t.detach().double().requires_grad_() for t in (x, w, w13, w2, sw13, sw2)]
        y64 = mega_moe(ref[0], idx, ref[1], ref[2], ref[3], num_experts=E, backend="reference", shared_w13=ref[4],
                       shared_w2=ref[5])
        g64 = torch.autograd.grad(y64, ref, dy.double())
        return [bc.rel_err(y, y64)] + [bc.rel_err(g, r) for g, r in zip(grads, g64)]

    assert max(errors(sw13)) < 1e-2
    swapped = torch.cat([sw13[:, Is:], sw13[:, :Is]], dim=1)
    assert errors(swapped)[0] > 0.1


def test_bench_layer_sustained_smoke(tmp_path):
    """--sustained-seconds adds a steady-state time and its ratio to the torch baseline to every row."""
    doc = _run_smoke(tmp_path / "sustained.json", "--routings", "uniform", "--rounds", "1", "--sustained-seconds",
                     "0.05", "--no-check")
    assert "sustained" in doc["timing"]
    for r in _timed_rows(doc):
        if r["direction"] == "bwd":  # a difference of two timings: may be <= 0 at this size on the CPU
            continue
        assert r["ms_sustained"] > 0, r
        assert r["ratio_sustained"] == 1.0 if r["backend"] == "torch" else r["ratio_sustained"] > 0, r


def test_bench_layer_inference_smoke(tmp_path):
    """--inference adds an 'infer' row per backend (the forward under no_grad) with its time, TFLOP/s, ratio to the
    torch baseline, peak memory and, for ours, the error against float64."""
    doc = _run_smoke(tmp_path / "infer.json", "--routings", "uniform", "--rounds", "2", "--inference")
    assert doc["options"]["inference"] is True
    infer = {r["backend"]: r for r in _timed_rows(doc) if r["direction"] == "infer"}
    # one row per backend that ran (torch and the reference on a CPU; the kernels' backends on a GPU)
    assert set(infer) == {r["backend"] for r in _timed_rows(doc) if r["direction"] == "fwd"}
    assert "torch" in infer and len(infer) >= 2, infer
    for b, r in infer.items():
        assert set(r) == ROW | ({"max_rel_err"} if b != "torch" else set()), r
        assert r["ms"] > 0 and r["tflops"] is not None and r["ratio_vs_torch"] > 0, r  # (tflops rounds to 0 here)
        if b != "torch":
            assert r["max_rel_err"] < 1e-2, r
    assert infer["torch"]["ratio_vs_torch"] == 1.0


def test_bench_layer_floor_smoke(tmp_path):
    """Every row carries the dense floor of its (shape, T), measured once per (shape, T) however many routings:
    the forward's GEMMs (fwd, infer), the backward's four GEMMs plus the weight-gradient write at the measured
    copy bandwidth (bwd), their sum (fwdbwd); ms_over_floor = ms / floor_ms."""
    doc = _run_smoke(tmp_path / "floor.json", "--tokens", "40,24", "--inference", "--rounds", "1", "--no-check")
    floor = doc["floor"]
    assert floor["copy_mib"] == 8 and floor["copy_gbps"] > 0
    E, H, I, K = 8, 128, 128, 2  # the smoke shape
    configs = {c["tokens"]: c for c in floor["configs"]}
    assert len(floor["configs"]) == 2 and set(configs) == {40, 24}  # two routings each, one floor each
    for T, c in configs.items():
        assert c["shape"] == "smoke" and c["routes"] == T * K
        assert c["weight_grad_bytes"] == E * (2 * I * H + H * I) * 2  # dW13 + dW2 in bf16
        assert c["dense_fwd_ms"] > 0 and c["dense_bwd_ms"] > 0
        # bytes / (GB/s) in ms, from the rounded bandwidth: equal to the rounding
        assert abs(c["weight_grad_write_ms"] - c["weight_grad_bytes"] / (floor["copy_gbps"] * 1e6)) \
            <= 0.06 * c["weight_grad_write_ms"] + 1e-4
    for r in doc["rows"]:
        c = configs[r["tokens"]]
        want = {"fwd": c["dense_fwd_ms"], "infer": c["dense_fwd_ms"],
                "bwd": c["dense_bwd_ms"] + c["weight_grad_write_ms"],
                "fwdbwd": c["dense_fwd_ms"] + c["dense_bwd_ms"] + c["weight_grad_write_ms"]}[r["direction"]]
        assert abs(r["floor_ms"] - want) <= 2e-4, r
        if r.get("skipped"):
            assert r["ms_over_floor"] is None, r
            continue
        # ms and floor_ms are written to 4 decimals: their quotient from the file is off by up to half a unit of
        # each, relatively (a 0.038 ms floor: 1.3e-3)
        rounding = 0.5e-4 / r["floor_ms"] + 0.5e-4 / max(r["ms"], 1e-4)
        assert abs(r["ms_over_floor"] - r["ms"] / r["floor_ms"]) <= (1e-3 + rounding) * max(1.0, r["ms_over_floor"]), r


def test_bench_layer_torch_fp8_smoke(tmp_path):
    """--backends torch,torch_fp8: the FP8 torch baseline (here the CPU emulation of torch._scaled_grouped_mm) gets
    every direction with precision "fp8", a time, a ratio to the BF16 torch row and an error against float64 that
    is an FP8 one: finite, below 0.15 and above BF16's."""
    doc = _run_smoke(tmp_path / "fp8.json", "--backends", "torch,torch_fp8", "--rounds", "1", "--inference")
    rows = _timed_rows(doc)
    assert len(rows) == len(doc["rows"])
    got = {(r["backend"], r["direction"], r["routing"]) for r in rows}
    assert got == {(b, d, g) for b in ("torch", "torch_fp8") for d in ("fwd", "bwd", "fwdbwd", "infer")
                   for g in ("uniform", "zipf")}, got
    for r in rows:
        if r["backend"] == "torch":
            assert r["precision"] == "bf16" and set(r) == ROW, r
            continue
        assert r["precision"] == "fp8" and set(r) == ROW | {"max_rel_err"}, r
        assert math.isfinite(r["max_rel_err"]) and 1e-2 < r["max_rel_err"] < 0.15, r
        if r["direction"] != "bwd":  # a difference of two timings: may be <= 0 at this size on the CPU
            assert r["ms"] > 0 and r["ratio_vs_torch"] > 0, r

    # in the default list with --precision fp8 (and fp8_bwd), not with bf16 (test_bench_layer_smoke)
    doc = _run_smoke(tmp_path / "fp8_default.json", "--precision", "fp8", "--routings", "uniform", "--rounds", "1",
                     "--no-check")
    fp8 = [r for r in doc["rows"] if r["backend"] == "torch_fp8"]
    assert sorted(r["direction"] for r in fp8) == ["bwd", "fwd", "fwdbwd"] and all(r["precision"] == "fp8" for r in fp8)


def _grouped_f64(a, b, sizes):
    """out[rows of g] = a[rows] @ b[g] in float64, differentiable."""
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip([0] + ends[:-1], ends))])


def test_fp8_grouped_mm_gradients_match_float64():
    """_Fp8GroupedMM (torch_fp8's grouped GEMM; on the CPU the emulation of torch._scaled_grouped_mm, whose exact
    arguments pass torch's meta checks of the op on the way): out, d a and d b within FP8 error (0.1) of a float64
    grouped matmul, and off BF16's (it really quantizes), an empty group's d b is zero, d b is laid out like the
    weight it came from (w.transpose(-2, -1) as b: dW contiguous like w), and offsets outside the FP8 wgrad's
    contract (a group not a multiple of 16 rows) are refused."""
    bc = _bench_module("bench_common")
    g = torch.Generator().manual_seed(0)
    sizes = [32, 0, 16, 48, 64]
    G, K, N, P = len(sizes), 64, 96, sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    a = torch.randn(P, K, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(G, N, K, generator=g) * K ** -0.5).to(torch.bfloat16).requires_grad_()  # like w13 [G, 2I, H]
    dy = torch.randn(P, N, generator=g).to(torch.bfloat16)
    out = bc.fp8_grouped_mm(a, w.transpose(-2, -1), offs)
    assert out.dtype == torch.bfloat16 and out.shape == (P, N)
    da, dw = torch.autograd.grad(out, (a, w), dy)
    a64, w64 = (t.detach().double().requires_grad_() for t in (a, w))
    out64 = _grouped_f64(a64, w64.transpose(-2, -1), sizes)
    da64, dw64 = torch.autograd.grad(out64, (a64, w64), dy.double())
    for name, got, ref in (("out", out, out64), ("d a", da, da64), ("d w", dw, dw64)):
        err = bc.rel_err(got, ref)
        assert 5e-3 < err < 0.1, (name, err)
    assert dw.shape == w.shape and dw.is_contiguous() and da.shape == a.shape
    assert not bool(dw[1].any())  # the empty group

    bad = torch.tensor([24, 40, 48, 96, 160], dtype=torch.int32)  # groups of 24 and 8 rows
    out = bc.fp8_grouped_mm(a, w.transpose(-2, -1), bad)  # the forward (2d x 3d) takes any group sizes
    with pytest.raises(ValueError, match="multiples of 16"):
        torch.autograd.grad(out, (a, w), dy)

    # the CPU path holds the arguments to the op's contract: a row-major b (the op wants column-major) is refused
    a_q, a_s = bc._fp8_quant(a.detach(), -1)
    b_q, b_s = bc._fp8_quant(w.detach().transpose(-2, -1), -2)
    bc._scaled_gmm(a_q, b_q, a_s, b_s, offs)
    with pytest.raises(RuntimeError, match="column major"):
        bc._scaled_gmm(a_q, b_q.contiguous(), a_s, b_s, offs)


def test_torch_fp8_moe_is_single_rank():
    bc = _bench_module("bench_common")
    E, H, I, K = bc.SHAPES["smoke"]
    w13, w2 = bc.make_weights(E, H, I, 0, "cpu")
    x, idx, w, _dy = bc.make_tokens(8, E, H, K, "uniform", 0, "cpu")
    with pytest.raises(ValueError, match="single rank"):
        bc.torch_fp8_moe(x, idx, w, w13, w2, group=object())


def _sonicmoe_unimportable(monkeypatch) -> str:
    """Make `import sonicmoe` fail here; the exception it raises, as the bench reports it."""
    monkeypatch.setitem(sys.modules, "sonicmoe", None)
    try:
        import sonicmoe  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("import sonicmoe did not fail")


def test_bench_layer_sonicmoe_unavailable(tmp_path, monkeypatch, capsys):
    """A requested sonicmoe that does not import gets a row per direction with the exact import error, and no
    time; unrequested, it is left out of the default backends with the same error in the log."""
    error = _sonicmoe_unimportable(monkeypatch)
    doc = _run_smoke(tmp_path / "sonic.json", "--backends", "torch,sonicmoe", "--routings", "uniform",
                     "--rounds", "1", "--inference")
    sonic = [r for r in doc["rows"] if r["backend"] == "sonicmoe"]
    assert sorted(r["direction"] for r in sonic) == ["bwd", "fwd", "fwdbwd", "infer"]
    for r in sonic:
        assert r["skipped"] == f"import sonicmoe failed: {error}", r
        assert r["ms"] is None and r["max_rel_err"] is None and r["floor_ms"] > 0, r
        assert set(r) == ROW | {"max_rel_err", "skipped"}, r
    out = capsys.readouterr().out
    assert f"skipping backend sonicmoe: import sonicmoe failed: {error}" in out
    assert error in out.split("[bench] wrote")[0].splitlines()[-1]  # the table's last row shows the reason
    assert all(r["ms"] > 0 for r in doc["rows"] if r["backend"] == "torch" and r["direction"] != "bwd")
    png = _bench_module("plot_results").plot(tmp_path / "sonic.json")  # the skipped rows are named, not drawn
    out = capsys.readouterr().out
    if png is not None:
        assert f"not drawn: sonicmoe fwd smoke T=40 uniform: skipped: import sonicmoe failed: {error}" in out

    doc = _run_smoke(tmp_path / "default.json", "--routings", "uniform", "--rounds", "1", "--no-check")
    assert not any(r["backend"] == "sonicmoe" for r in doc["rows"])
    assert f"sonicmoe is not in the default backends: {error}" in capsys.readouterr().out


FAKE_SONICMOE = '''
"""A plain-torch stand-in for sonicmoe with the contract bench/peer_sonicmoe.py relies on (flat routes sorted by
token, w1 (2I, H, E) with [gate; up] rows under concat_layout=True, w2 (H, I, E), fp32 scores), in plain
torch so that autograd gives the gradients."""
import torch
import torch.nn.functional as F

from .enums import ActivationType


def moe_general_routing_inputs(x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id,
                               activation_type, is_inference_mode_enabled=False, concat_layout=False):
    assert concat_layout is True and activation_type is ActivationType.SWIGLU and b1 is None and b2 is None
    assert token_indices.dtype == expert_indices.dtype == torch.int32
    assert bool((token_indices[1:] >= token_indices[:-1]).all()), "token indices must be sorted"
    assert w1.shape[2] == w2.shape[2] == E and w1.shape[1] == w2.shape[0] == x.shape[1]
    assert is_inference_mode_enabled == (not torch.is_grad_enabled())
    I = w2.shape[1]
    t, e = token_indices.long(), expert_indices.long()
    h = torch.einsum("rh,ihr->ri", x[t].float(), w1.float()[:, :, e])
    a = F.silu(h[:, :I]) * h[:, I:]
    o = torch.einsum("ri,hir->rh", a, w2.float()[:, :, e]) * router_scores.float()[:, None]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add(0, t, o)
    return y.to(x.dtype), torch.bincount(e, minlength=E)
'''


def test_bench_layer_sonicmoe_adapter(tmp_path, monkeypatch):
    """With a sonicmoe that follows the contract the adapter was written against, the sonicmoe rows are timed and
    match the float64 reference in y and every gradient: the adapter's routing arrays and weight views agree with
    our layer's layout. A sonicmoe whose call fails gets skipped rows with that error."""
    pkg = tmp_path / "site" / "sonicmoe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_SONICMOE)
    (pkg / "enums.py").write_text("import enum\n\n\nclass ActivationType(enum.Enum):\n    SWIGLU = 'swiglu'\n"
                                  "    GEGLU = 'geglu'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("sonicmoe", "sonicmoe.enums"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    doc = _run_smoke(tmp_path / "peer.json", "--routings", "uniform,zipf", "--rounds", "1", "--inference")
    sonic = [r for r in doc["rows"] if r["backend"] == "sonicmoe"]  # in the default list: it imports
    assert len(sonic) == 8, sonic  # fwd, bwd, fwdbwd, infer per routing
    for r in sonic:
        assert "skipped" not in r, r
        assert set(r) == ROW | {"max_rel_err"}, r
        assert r["max_rel_err"] < 1e-2, r
        if r["direction"] != "bwd":
            assert r["ms"] > 0 and r["ratio_vs_torch"] > 0, r

    # a gate/up swap in the weights the adapter hands over is caught by the error check
    (pkg / "__init__.py").write_text(FAKE_SONICMOE.replace("a = F.silu(h[:, :I]) * h[:, I:]",
                                                           "a = F.silu(h[:, I:]) * h[:, :I]"))
    monkeypatch.delitem(sys.modules, "sonicmoe", raising=False)
    doc = _run_smoke(tmp_path / "swapped.json", "--backends", "sonicmoe", "--routings", "uniform", "--rounds", "1")
    assert all(r["max_rel_err"] > 0.1 for r in doc["rows"]), doc["rows"]

    (pkg / "__init__.py").write_text(FAKE_SONICMOE.replace("    I = w2.shape[1]\n",
                                                           "    raise RuntimeError('no kernel for this device')\n"))
    monkeypatch.delitem(sys.modules, "sonicmoe", raising=False)
    doc = _run_smoke(tmp_path / "failing.json", "--backends", "torch,sonicmoe", "--routings", "uniform",
                     "--rounds", "1")
    sonic = [r for r in doc["rows"] if r["backend"] == "sonicmoe"]
    assert len(sonic) == 3 and all(r["skipped"] == "RuntimeError: no kernel for this device" for r in sonic), sonic


def test_dense_floor_flops():
    """The floor's dense products do exactly the layer's useful FLOPs: 6 P H I forward, 12 P H I backward."""
    from torch.utils.flop_counter import FlopCounterMode

    bc = _bench_module("bench_common")
    P, H, I = 48, 32, 24
    calls = bc.dense_gemm_calls(P, H, I, "cpu")
    assert set(calls) == {"fwd", "bwd"}
    for direction, fn in calls.items():
        with FlopCounterMode(display=False) as counter:
            fn()
        assert counter.get_total_flops() == bc.layer_flops(P, H, I, direction), direction


def test_ab_smoke_on_the_cpu_reports_bursts_and_steady_state(tmp_path):
    """bench/ab.py's whole loop (two child processes per round, ABBA, the report) on the CPU reference backend,
    the same installed build as both A and B: every direction appears in burst and steady-state form, and the
    two builds give the same bits."""
    import subprocess

    import prime_kernels

    site = Path(prime_kernels.__file__).resolve().parent.parent
    out = tmp_path / "ab.json"
    # the children see no GPU, so they time the CPU (on a GPU machine they would time CUDA and add energy rows)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(BENCH / "ab.py"), "--old", str(site), "--new", str(site), "--smoke",
                        "--backend", "reference", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    got = {(row["shape"], row["direction"]) for row in doc["rows"]}
    want = {("smoke", d) for d in ("fwd", "bwd", "fwdbwd", "fwd_steady", "bwd_steady", "fwdbwd_steady")}
    assert got == want, got
    assert all(row["outputs_bitwise_equal"] for row in doc["rows"])
    assert doc["timing"]["steady_seconds"] > 0


def test_ab_summary_reports_energy_rows_in_millijoules():
    """bench/ab.py's summary: where every child measured energy (CUDA), the *_mj rows carry old_mj / new_mj and
    their ratio; where one did not, no energy row appears."""
    ab = _bench_module("ab")
    fp = {"y": 1}

    def child(fwd, fwdbwd, mj=None):
        res = {"fwd": fwd, "fwdbwd": fwdbwd, "bwd": fwdbwd - fwd, "fingerprint": fp}
        if mj is not None:
            res.update(fwd_mj=mj[0], fwdbwd_mj=mj[1], bwd_mj=mj[1] - mj[0])
        return {"shapes": {"smoke": res}}

    samples = {"old": [child(2.0, 6.0, (100.0, 300.0)), child(2.0, 6.0, (100.0, 300.0))],
               "new": [child(2.2, 6.0, (110.0, 300.0)), child(2.0, 6.6, (104.0, 330.0))]}
    rows = {r["direction"]: r for r in ab.summarize(samples, ["smoke"])}
    assert set(rows) == {"fwd", "bwd", "fwdbwd", "fwd_mj", "bwd_mj", "fwdbwd_mj"}
    assert rows["fwd_mj"]["old_mj"] == 100.0 and rows["fwd_mj"]["new_mj"] == 107.0
    assert rows["fwd_mj"]["ratio_new_old"] == 1.07 and "old_ms" not in rows["fwd_mj"]
    assert rows["fwd"]["ratio_new_old"] == 1.05 and "old_mj" not in rows["fwd"]
    samples["new"][1] = child(2.0, 6.6)  # one child without energy: no energy rows
    assert {r["direction"] for r in ab.summarize(samples, ["smoke"])} == {"fwd", "bwd", "fwdbwd"}


def test_bench_bwd_dgrad_arguments():
    """bench/bench_bwd_dgrad.py's defaults are the 30B and 235B shapes at T = 4096 and 16384, uniform and Zipf;
    lists parse, and a shape, routing or count it cannot run is refused before anything runs."""
    b = _bench_module("bench_bwd_dgrad")
    bc = _bench_module("bench_common")
    a = b.parse_args([])
    assert a.shapes == ["qwen3-30b-a3b", "qwen3-235b-a22b"] and a.tokens == [4096, 16384]
    assert a.routings == ["uniform", "zipf"] and (a.warmup, a.reps, a.max_seconds, a.out) == (5, 20, 0.0, None)
    assert [bc.SHAPES[s] for s in a.shapes] == [(128, 2048, 768, 8), (128, 4096, 1536, 8)]
    a = b.parse_args(["--shapes", "smoke", "--tokens", "40, 24", "--routings", "zipf", "--reps", "3",
                      "--max-seconds", "90", "--out", "x.json"])
    assert (a.shapes, a.tokens, a.routings, a.reps, a.max_seconds, a.out) == (["smoke"], [40, 24], ["zipf"], 3, 90.0,
                                                                               "x.json")
    assert b.parse_args([]).lags == [] and b.parse_args(["--lags", "1, 3,6"]).lags == [1, 3, 6]
    for bad in (["--shapes", "qwen3-7b"], ["--routings", "skewed"], ["--tokens", "0"], ["--reps", "0"],
                ["--lags", "65"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)


def test_bench_bwd_dgrad_flops():
    """dgrad_flops counts exactly the two dgrad GEMMs' FLOPs: dy [M, H] @ w2_e [H, I] and dh [M, 2I] @ w13_e [2I, H]."""
    from torch.utils.flop_counter import FlopCounterMode

    b = _bench_module("bench_bwd_dgrad")
    M, H, I = 48, 32, 24
    with FlopCounterMode(display=False) as counter:
        torch.mm(torch.randn(M, H), torch.randn(H, I))
        torch.mm(torch.randn(M, 2 * I), torch.randn(2 * I, H))
    assert counter.get_total_flops() == b.dgrad_flops(M, H, I) == 6 * M * H * I


def test_bench_bwd_dgrad_state_and_check_on_the_cpu():
    """The benchmark's inputs are the grouped backward's state (a padded plan, the dy rows of each route's token in
    pool order, padding rows zero) and pass the fused op's host checks; its comparison flags a changed element of
    the rows the op specifies and ignores the rows after the experts."""
    from prime_kernels.mega import _fused_bwd

    b = _bench_module("bench_bwd_dgrad")
    bc = _bench_module("bench_common")
    E, H, I, K = bc.SHAPES["smoke"]
    st = b.make_state("smoke", 40, "zipf", 0, "cpu")
    dy_pool, w13, w2, h, offs, src, wts = st["inputs"]
    assert st["routed_rows"] == 40 * K and st["pool_rows"] == src.shape[0] == dy_pool.shape[0] == h.shape[0]
    assert int(offs[-1]) == st["expert_rows"] and bool((offs[1:] >= offs[:-1]).all()) and not bool((offs % 128).any())
    _x, _idx, w, dy = bc.make_tokens(40, E, H, K, "zipf", 0, "cpu")
    live = src >= 0
    assert int(live.sum()) == st["routed_rows"]
    assert torch.equal(dy_pool[live], dy[src[live].long() // K]) and not bool(dy_pool[~live].any())
    assert torch.equal(wts, w)
    assert _fused_bwd.check_dgrad_inputs(*st["inputs"]) == (st["pool_rows"], H, I, E)
    out = b.pipeline(st["inputs"])  # the grouped GEMMs' CPU references
    rows = st["expert_rows"]
    same = b.compare(out, out, rows)
    assert same["bitwise_all"] and same["max_rel_err"] == 0.0
    moved = [out[0].clone(), *out[1:]]
    moved[0][0, 0] += 1
    diff = b.compare(moved, out, rows)
    assert not diff["bitwise"]["dh"] and diff["bitwise"]["dx_pool"] and diff["max_rel_err"] > 0
    tail = [t.clone() for t in out]
    assert st["pool_rows"] > rows
    for t in (tail[0], tail[1], tail[3]):
        t[rows:] = float("nan")
    assert b.compare(tail, out, rows)["bitwise_all"]
    # with the weight gradients: x_pool is x by pool row, and a changed gradient element is flagged
    x, *_ = bc.make_tokens(40, E, H, K, "zipf", 0, "cpu")
    assert torch.equal(st["x_pool"][live], x[src[live].long() // K]) and not bool(st["x_pool"][~live].any())
    full = b.pipeline_full(st["inputs"], st["x_pool"])
    assert [tuple(t.shape) for t in full[4:]] == [(E, 2 * I, H), (E, H, I)]
    moved = [*full[:5], full[5].clone()]
    moved[5][0, 0, 0] += 1
    diff = b.compare(moved, full, rows)
    assert not diff["bitwise"]["dw2"] and diff["bitwise"]["dw13"] and not diff["bitwise_all"]


def test_bench_bwd_dgrad_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    assert _bench_module("bench_bwd_dgrad").main(["--shapes", "smoke"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_grid_shapes_name_every_grid_point_and_read_back():
    """bench_layer --shapes grid: every E x (H, I) once, top-8, each name read back by shape_dims; the Qwen3 names
    read as SHAPES says; anything else is refused with the choices."""
    bc = _bench_module("bench_common")
    names = bc.grid_shapes()
    dims = [bc.shape_dims(n) for n in names]
    assert len(set(names)) == len(names) == len(bc.GRID_EXPERTS) * len(bc.GRID_HIDDEN_INTER)
    assert {(E, H, I) for E, H, I, _ in dims} == {(E, H, I) for E in bc.GRID_EXPERTS for H, I in bc.GRID_HIDDEN_INTER}
    assert all(K == 8 for *_, K in dims)
    assert bc.shape_dims("qwen3-30b-a3b") == (128, 2048, 768, 8)
    assert bc.shape_dims("e4-h64-i32-k2") == (4, 64, 32, 2)
    for bad in ("e4-h64-i32", "e4-h64-i32-k5", "x4-h64-i32-k2", "e0-h64-i32-k1", "grid"):
        with pytest.raises(ValueError, match="unknown shape"):
            bc.shape_dims(bad)


def test_bench_staged_fp8_smoke(tmp_path):
    """bench/bench_staged_fp8.py --smoke runs the staged FP8 sequence on the CPU and writes its rows."""
    out = tmp_path / "staged.json"
    assert _bench_module("bench_staged_fp8").main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    variants = [r["variant"] for r in doc["rows"]]
    assert variants == ["torch bf16", "staged fp8"]
    staged = doc["rows"][-1]
    assert staged["fwd_ms"] > 0 and staged["bwd_ms"] > 0
    assert set(staged["parts_ms"]) == {"column_quant", "fp8_mega_moe_backward", "fp8_mega_moe_weight_grads"}


def test_bench_layer_under_torchrun_reports_every_rank(tmp_path):
    """bench_layer under torchrun with 2 ranks (gloo, CPU): every row has ep = 2, every rank's time and the slowest
    as ms; torch's all-to-all layer beside the reference backend."""
    import subprocess

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "ep.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(BENCH / "bench_layer.py"), "--smoke", "--device", "cpu", "--tokens", "64",
                        "--routings", "uniform", "--backends", "torch,deep_gemm_reference", "--no-plot",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    # gloo's teardown can abort a rank after the run is over (a peer that exited first closes the sockets its
    # background threads still read): that is accepted once the results were written, nothing else is
    teardown_abort = "terminate called without an active exception" in r.stderr and out.exists()
    assert r.returncode == 0 or teardown_abort, r.stderr[-3000:]
    rows = [row for row in json.loads(out.read_text())["rows"] if not row.get("skipped")]
    assert {row["backend"] for row in rows} == {"torch", "deep_gemm_reference"}, rows
    for row in rows:
        assert row["ep"] == 2 and len(row["ms_per_rank"]) == 2, row
        assert row["ms"] == max(row["ms_per_rank"]), row
        # bwd is fwd+bwd minus fwd, two timings of a few ms on a loaded 2-core machine: only the measured ones must
        # be positive
        assert row["direction"] == "bwd" or row["ms"] > 0, row


def test_bench_ep_loopback_smoke(tmp_path):
    """bench/bench_ep_loopback.py --smoke on the CPU: every row's loopback output is bitwise EP = 1's, with and
    without chunks and a modelled link (which the CPU ignores)."""
    out = tmp_path / "ep.json"
    assert _bench_module("bench_ep_loopback").main(["--smoke", "--device", "cpu", "--ranks", "2", "--chunks", "1,2",
                                                    "--link-gbps", "0,50", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["chunks"], r["link_gbps"]) for r in rows] == [(1, 0.0), (1, 50.0), (2, 0.0), (2, 50.0)]
    assert all(r["bitwise"] and r["ep1_ms"] > 0 and r["loopback_ms"] > 0 for r in rows), rows


def test_trace_overlap_ties_kernels_to_their_rank_and_measures_the_overlap():
    """bench_ep_loopback.trace_overlap on a hand-made trace: kernels belong to the thread that launched them (by
    correlation id), a rank's GEMM streams are its compute streams, and the exchange time under its own GEMMs is
    the intersection with their union (another rank's GEMMs do not count)."""
    m = _bench_module("bench_ep_loopback")

    def launch(corr, tid):
        return {"cat": "cuda_runtime", "ph": "X", "tid": tid, "ts": 0, "dur": 1, "name": "cudaLaunchKernel",
                "args": {"correlation": corr}}

    def kernel(corr, name, stream, ts, dur, cat="kernel"):
        return {"cat": cat, "ph": "X", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr, "stream": stream}}

    events = [launch(c, 10) for c in (1, 2, 3, 4)] + [launch(c, 11) for c in (5, 6)] + [
        kernel(1, "void m_grouped_bf16_gemm_kernel<256>", 7, 0, 100),
        kernel(2, "void m_grouped_bf16_gemm_swiglu_bwd_pp_kernel<4>", 7, 150, 100),
        kernel(3, "Memcpy DtoD (Device -> Device)", 8, 50, 150, "gpu_memcpy"),  # 50 under each GEMM
        kernel(4, "index_elementwise_kernel", 7, 260, 10),  # same stream as the GEMMs: not exchange
        kernel(5, "void k_grouped_bf16_gemm_kernel<256>", 9, 0, 1000),  # rank 11's GEMM over all of it
        kernel(6, "copy", 12, 300, 20),
    ]
    got = {o["thread"]: o for o in m.trace_overlap({"traceEvents": events})}
    assert got[10]["gemm_us"] == 200 and got[10]["glue_us"] == 160
    assert got[10]["exchange_us"] == 150 and got[10]["under_own_gemms_us"] == 100
    assert got[11]["exchange_us"] == 20 and got[11]["under_own_gemms_us"] == 20 and got[11]["fraction"] == 1.0
