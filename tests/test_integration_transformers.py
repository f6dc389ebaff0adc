"""prime_kernels.integrations.transformers: the "prime_mega_moe" experts implementation on a tiny
Qwen3-MoE built from a config (random weights, no download), against transformers' own eager
experts: logits, loss and every parameter gradient over a few AdamW steps (the shared experts taken into the routed
experts' call: test_integration_transformers_shared.py).

Tested with transformers==5.24.0 (pinned in ci/test.sh)."""

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")

from mega_helpers import auto_kernel_skip_reason, rel_err  # noqa: E402

import prime_kernels.integrations.transformers as pk_hf  # noqa: E402
from prime_kernels.integrations import UnsupportedLayerError  # noqa: E402
from prime_kernels.mega import _backend  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation  # noqa: E402

VOCAB = 96


def tiny_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=64, attn_implementation="eager",
                initializer_range=0.1)
    base.update(kw)
    return Qwen3MoeConfig(**base)


def build(seed, dtype, **kw):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**kw)).to(dtype)
    model.set_experts_implementation("eager")
    return model


def forward_backward(model, ids):
    """Logits, loss and {name: gradient, None where autograd gave none} of one step on ``ids``."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def step(model, opt, ids):
    """forward_backward, then the optimizer step."""
    result = forward_backward(model, ids)
    opt.step()
    return result


EXPERT_NAMES = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_registered_in_experts_interface():
    assert pk_hf.NAME == "prime_mega_moe"
    assert ALL_EXPERTS_FUNCTIONS["prime_mega_moe"] is pk_hf.mega_moe_experts_forward
    # valid at load time too: the config-level name check accepts it
    model = build(0, torch.float32)
    model.set_experts_implementation("prime_mega_moe")
    assert model.config._experts_implementation == "prime_mega_moe"


def test_gate_up_layout_is_gate_rows_then_up_rows():
    """transformers' default gate splits the projection with chunk(2): gate rows first, i.e. our w13."""
    model = build(1, torch.float64)
    ex = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(11)
    T, H = 5, ex.gate_up_proj.shape[2]
    x = torch.randn(T, H, dtype=torch.float64, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, dtype=torch.float64, generator=g)
    I = ex.gate_up_proj.shape[1] // 2
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(2):
            e = int(idx[t, k])
            gate = ex.gate_up_proj[e, :I] @ x[t]
            up = ex.gate_up_proj[e, I:] @ x[t]
            want[t] += w[t, k] * (ex.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    setattr(ex, "_prime_mega_moe_options", {"backend": "reference"})
    got = pk_hf.mega_moe_experts_forward(ex, x, idx, w)
    assert rel_err(got.detach(), want.detach()) < 1e-12


def test_exact_training_steps_match_eager():
    """float64 model (the reference's exact mode): logits, loss, every gradient and every updated
    parameter equal transformers' eager experts to ~1e-10 over three AdamW steps."""
    ref = build(2, torch.float64)
    ours = copy.deepcopy(ref)
    assert pk_hf.apply(ours, backend="reference") == EXPERT_NAMES
    assert ref.config._experts_implementation == "eager"
    assert ours.config._experts_implementation == "prime_mega_moe"
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (3, 24), generator=g)  # fresh data every step
        lr_, loss_r, gr = step(ref, opt_r, ids)
        lo, loss_o, go = step(ours, opt_o, ids)
        assert rel_err(lo, lr_) < 1e-10
        assert abs(loss_o.item() - loss_r.item()) < 1e-10 * abs(loss_r.item())
        assert gr.keys() == go.keys()
        for n in gr:
            if gr[n].norm() == 0:
                assert go[n].norm() == 0, n
            else:
                assert rel_err(go[n], gr[n]) < 1e-9, n
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert rel_err(q.detach(), p.detach()) < 1e-9, n
    # the experts' gradients are not trivially zero: the check above would catch a wrong mapping
    assert all(gr[f"{n}.gate_up_proj"].norm() > 0 and gr[f"{n}.down_proj"].norm() > 0 for n in EXPERT_NAMES)


def test_exact_check_detects_swapped_gate_up():
    """The exact comparison above can fail: swapping gate and up rows changes the logits by far more."""
    ref = build(4, torch.float64)
    bad = copy.deepcopy(ref)
    pk_hf.apply(bad, backend="reference")
    for layer in bad.model.layers:
        w = layer.mlp.experts.gate_up_proj.data
        I = w.shape[1] // 2
        w.copy_(torch.cat([w[:, I:], w[:, :I]], 1))
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        assert rel_err(bad(input_ids=ids).logits, ref(input_ids=ids).logits) > 1e-3


def _capture_expert_inputs(model, ids):
    """The (hidden_states, top_k_index, top_k_weights) every experts module sees in a forward."""
    seen = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, args, n=n: seen.__setitem__(n, [a.detach().clone() for a in args])) for n in EXPERT_NAMES]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


def _experts_fwd_bwd(module, impl, x, idx, w, dy):
    """Output and gradients (dx, d top_k_weights, d gate_up_proj, d down_proj) of one experts module."""
    m = copy.deepcopy(module)
    m.config = copy.copy(m.config)
    m.config._experts_implementation_internal = impl
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = m(x, idx, w)
    y.backward(dy)
    return [y.detach(), x.grad, w.grad, m.gate_up_proj.grad, m.down_proj.grad]


def test_bf16_experts_close_to_eager_on_model_inputs():
    """bfloat16 model, each experts module on the inputs it really receives (captured with a hook):
    output and every gradient against a float64 evaluation, no worse than transformers' eager bf16
    experts; and against those eager experts directly."""
    model = build(5, torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (4, 32), generator=g)
    captured = _capture_expert_inputs(model, ids)
    for n in EXPERT_NAMES:
        x, idx, w = captured[n]
        dy = torch.randn(x.shape, generator=g).to(x.dtype)
        mod = model.get_submodule(n)
        setattr(mod, "_prime_mega_moe_options", {"backend": "reference"})
        ours = _experts_fwd_bwd(mod, "prime_mega_moe", x, idx, w, dy)
        eager = _experts_fwd_bwd(mod, "eager", x, idx, w, dy)
        exact = _experts_fwd_bwd(copy.deepcopy(mod).double(), "eager", x.double(), idx, w.double(), dy.double())
        for what, o, e, r in zip(("y", "dx", "dtopk", "dgate_up", "ddown"), ours, eager, exact):
            assert o.dtype == e.dtype, what
            assert rel_err(o, r) < 1e-2, (n, what)
            assert rel_err(o, r) <= 1.25 * rel_err(e, r) + 1e-3, (n, what)
            assert rel_err(o, e) < 2e-2, (n, what)


def test_bf16_model_first_step_close_to_eager():
    """Whole bf16 model, one step from the same weights (later steps diverge through bf16 routing
    flips in both implementations, so they are compared exactly in float64 above)."""
    base = build(5, torch.bfloat16)
    ours = copy.deepcopy(base)
    pk_hf.apply(ours, backend="reference")
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(7))
    le, se, _ = step(base, torch.optim.SGD(base.parameters(), lr=0.0), ids)
    lo, so, _ = step(ours, torch.optim.SGD(ours.parameters(), lr=0.0), ids)
    assert abs(so.item() - se.item()) < 5e-3 * abs(se.item())
    assert rel_err(lo, le) < 8e-2  # a gate/up swap or a lost routing weight gives > 0.3


def test_fp32_model_computes_in_bf16_with_fp32_grads():
    base = build(7, torch.float32)
    exact = copy.deepcopy(base).double()
    ours = copy.deepcopy(base)
    pk_hf.apply(ours, backend="reference")
    ids = torch.randint(0, VOCAB, (2, 16))
    out_o = ours(input_ids=ids, labels=ids)
    out_x = exact(input_ids=ids, labels=ids)
    out_o.loss.backward()
    out_x.loss.backward()
    assert out_o.logits.dtype == torch.float32
    assert rel_err(out_o.logits.detach(), out_x.logits.detach()) < 2e-2
    for n in EXPERT_NAMES:
        e_o = ours.get_submodule(n)
        e_x = exact.get_submodule(n)
        assert e_o.gate_up_proj.grad.dtype == torch.float32
        assert rel_err(e_o.gate_up_proj.grad, e_x.gate_up_proj.grad) < 3e-2
        assert rel_err(e_o.down_proj.grad, e_x.down_proj.grad) < 3e-2


def test_expert_parallel_sentinels_are_masked():
    """Under transformers' EP the experts get local ids with off-rank routes marked num_experts (weight 0)."""
    model = build(8, torch.float64)
    ex = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(12)
    T, H, E = 9, ex.gate_up_proj.shape[2], ex.num_experts
    x = torch.randn(T, H, dtype=torch.float64, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    off = torch.rand(T, 2, generator=g) < 0.4
    idx = torch.where(off, torch.full_like(idx, E), idx)
    w = torch.rand(T, 2, dtype=torch.float64, generator=g).masked_fill(off, 0.0)
    want = ex.forward.__wrapped__(ex, x, idx, w)  # transformers' own eager experts loop
    ex._is_expert_parallel = True
    setattr(ex, "_prime_mega_moe_options", {"backend": "reference"})
    got = pk_hf.mega_moe_experts_forward(ex, x, idx, w)
    assert rel_err(got.detach(), want.detach()) < 1e-12


def test_auto_backend_is_passed_through(monkeypatch):
    """apply() defaults to backend='auto': on CPU without the fallback variable the call raises the
    status() reason (never a silent reference run); with it, it runs the reference and warns."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    monkeypatch.setattr(_backend, "_warned", set())
    model = build(9, torch.bfloat16)
    pk_hf.apply(model)
    seen = []
    real = pk_hf.mega_moe

    def spy(*a, **k):
        seen.append(k["backend"])
        return real(*a, **k)

    monkeypatch.setattr(pk_hf, "mega_moe", spy)
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(_backend.FusedKernelUnavailable, match="PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK"):
        model(input_ids=ids)
    assert seen == ["auto"]
    monkeypatch.setenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", "1")
    with pytest.warns(RuntimeWarning, match="falling back"):
        model(input_ids=ids)
    pk_hf.apply(model, backend="reference")
    seen.clear()
    model(input_ids=ids)
    assert seen == ["reference", "reference"]
    with pytest.raises(ValueError, match="backend must be one of"):
        pk_hf.apply(model, backend="fast")


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
def test_precision_is_passed_through(monkeypatch, precision):
    """apply(precision=) reaches every layer call with the backend; the default is bf16."""
    model = build(9, torch.bfloat16)
    seen = []
    real = pk_hf.mega_moe

    def spy(*a, **k):
        seen.append((k["backend"], k["precision"]))
        return real(*a, **k)

    monkeypatch.setattr(pk_hf, "mega_moe", spy)
    ids = torch.randint(0, VOCAB, (1, 8))
    pk_hf.apply(model, backend="reference")
    model(input_ids=ids)
    assert seen == [("reference", "bf16")] * 2
    seen.clear()
    pk_hf.apply(model, backend="reference", precision=precision)
    model(input_ids=ids)
    assert seen == [("reference", precision)] * 2


def test_fp8_without_its_kernels_raises_the_layer_reason_at_the_first_call(monkeypatch):
    """As for bf16: apply switches the model, and the first call under "auto" raises the layer's own reason
    (the FP8 kernels' status on the CPU; the FP8 alignment of H and I on a GPU, this model being tiny)."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    monkeypatch.setattr(_backend, "_warned", set())
    model = build(9, torch.bfloat16)
    assert pk_hf.apply(model, precision="fp8") == EXPERT_NAMES
    with pytest.raises(_backend.FusedKernelUnavailable, match="precision='fp8'"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))


@pytest.mark.parametrize("bad", ["fp16", "FP8", "mxfp8", None])
def test_bad_precision_raises_before_the_model_is_touched(bad):
    model = build(9, torch.bfloat16)
    with pytest.raises(ValueError, match=r"precision must be one of \('bf16', 'fp8', 'fp8_bwd'\)"):
        pk_hf.apply(model, precision=bad)
    assert model.config._experts_implementation == "eager"
    assert not any(hasattr(m, "_prime_mega_moe_options") for m in model.modules())
    pk_hf.apply(model, backend="reference", precision="fp8")  # a switched model keeps its options too
    with pytest.raises(ValueError, match="precision must be one of"):
        pk_hf.apply(model, backend="grouped", precision=bad)
    assert {m._prime_mega_moe_options["precision"] for m in model.modules()
            if hasattr(m, "_prime_mega_moe_options")} == {"fp8"}


def test_fp8_precisions_change_the_numerics_where_they_should():
    """On the reference (the recipe's emulation): "fp8" moves the logits by the FP8 rounding and no more, "fp8_bwd"
    keeps the bf16 forward bit for bit and quantizes the backward only."""
    base = build(5, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(7))
    runs = {}
    for precision in ("bf16", "fp8", "fp8_bwd"):
        model = copy.deepcopy(base)
        pk_hf.apply(model, backend="reference", precision=precision)
        runs[precision] = forward_backward(model, ids)
    (lb, sb, gb), (l8, s8, g8), (lw, sw, gw) = runs["bf16"], runs["fp8"], runs["fp8_bwd"]
    assert 1e-3 < rel_err(l8, lb) < 0.15 and abs(s8.item() - sb.item()) < 5e-3 * abs(sb.item())
    assert torch.equal(lw, lb) and torch.equal(sw, sb)
    for n in (f"{e}.{w}" for e in EXPERT_NAMES for w in ("gate_up_proj", "down_proj")):
        assert 1e-3 < rel_err(gw[n], gb[n]) < 0.2, n
        assert 1e-3 < rel_err(g8[n], gb[n]) < 0.3, n


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_weights_are_quantized_again_after_a_fused_adamw_step(precision):
    """The layer caches each weight's FP8 copy keyed on its version counter, which torch's fused AdamW does not bump:
    after fused steps the model must compute exactly what a copy with never-quantized parameters computes (the
    version bump after each step is what makes it; without it the logits moved by 0.9 here)."""
    model = build(5, torch.bfloat16)
    pk_hf.apply(model, backend="reference", precision=precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(8)
    for _ in range(2):
        step(model, opt, torch.randint(0, VOCAB, (2, 16), generator=g))
    fresh = copy.deepcopy(model)  # new parameter objects: their FP8 copies are made now
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    (lo, so, go), (lf, sf, gf) = forward_backward(model, ids), forward_backward(fresh, ids)
    assert torch.equal(lo, lf) and torch.equal(so, sf)
    assert all(torch.equal(go[n], gf[n]) for n in go if go[n] is not None), precision


# ------------------------------------------------------------------------------------------------
# Unsupported layouts raise and switch nothing
# ------------------------------------------------------------------------------------------------


class _Cfg:
    _experts_implementation = "eager"
    hidden_act = "silu"


def _experts_class(**flags):
    @use_experts_implementation(**flags)
    class FakeExperts(nn.Module):
        def __init__(self, config, transposed=False, bias=False, act=None):
            super().__init__()
            E, H, I = 4, 16, 8
            self.num_experts = E
            shape13, shape2 = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
            self.gate_up_proj = nn.Parameter(torch.randn(shape13))
            self.down_proj = nn.Parameter(torch.randn(shape2))
            if bias:
                self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
                self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
            self.act_fn = act if act is not None else nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("not called")

    return FakeExperts


class _Holder(nn.Module):
    def __init__(self, *experts):
        super().__init__()
        self.layers = nn.ModuleList(experts)


@pytest.mark.parametrize("flags,kwargs,match", [
    (dict(has_bias=True), dict(bias=True), "biases"),
    (dict(is_transposed=True), dict(transposed=True), "transposed"),
    (dict(is_concatenated=False), {}, "interleaved"),
    (dict(has_post_expert_norm=True), {}, "post-expert norm"),
    ({}, dict(act=nn.GELU()), "SiLU-gated"),
])
def test_unsupported_experts_raise_and_switch_nothing(flags, kwargs, match):
    good = _experts_class()(_Cfg())
    bad = _experts_class(**flags)(_Cfg(), **kwargs)
    holder = _Holder(good, bad)
    with pytest.raises(UnsupportedLayerError, match=match) as info:
        pk_hf.apply(holder, backend="reference")
    assert "layers.1" in str(info.value) and "FakeExperts" in str(info.value)
    assert not hasattr(good, "_prime_mega_moe_options")
    assert good.config._experts_implementation == "eager"


def test_quantized_experts_are_refused():
    q = _experts_class()(_Cfg())
    q.gate_up_proj = nn.Parameter(q.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)
    q.register_buffer("gate_up_proj_scale_inv", torch.ones(4, 1, 1))
    with pytest.raises(UnsupportedLayerError, match="quantized expert weights.*float8_e4m3fn.*scale"):
        pk_hf.apply(_Holder(q))


def test_custom_gate_function_is_refused():
    cls = _experts_class()

    class Clamped(cls):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)

    with pytest.raises(UnsupportedLayerError, match="custom gate function"):
        pk_hf.apply(_Holder(Clamped(_Cfg())), backend="reference")


def test_qwen3_gelu_activation_is_refused():
    model = build(10, torch.float32, hidden_act="gelu")
    with pytest.raises(UnsupportedLayerError, match="hidden_act='gelu'"):
        pk_hf.apply(model)
    assert model.config._experts_implementation == "eager"


def test_undecorated_experts_and_plain_models_are_reported():
    class LegacyExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
            self.down_proj = nn.Parameter(torch.randn(4, 8, 8))

    with pytest.raises(UnsupportedLayerError, match="does not use transformers' experts interface"):
        pk_hf.apply(_Holder(LegacyExperts()))
    with pytest.raises(UnsupportedLayerError, match="no experts module"):
        pk_hf.apply(nn.Sequential(nn.Linear(4, 4)))


# ------------------------------------------------------------------------------------------------
# GPU: the fused kernels under backend="auto"
# ------------------------------------------------------------------------------------------------


def _assert_step_matches_eager(got, eager, at) -> None:
    """One step's (logits, loss, gradients) of our backend against transformers' eager experts on the
    same bf16 weights and data. Whole-model bf16 runs differ through rounding and the router's
    near-ties (bf16 router logits; a flip moves whole tokens), so the bounds are wider than the
    per-module 1e-2: the reference backend's worst over 40 seeds x 3 steps was logits 0.032, loss
    1e-3 relative and 0.14 for one parameter's gradient (a router's; the noise is spread over all
    parameters, small-norm ones no worse, so no absolute floor). Each of these fails it (mutating
    our call in the training steps, on the CPU): expert weights one step stale, gate and up
    swapped, routing weights scaled by 0.9, no gradient into the routing weights or into x."""
    (lo, so, go), (le, se, ge) = got, eager
    assert abs(so.item() - se.item()) < 3e-3 * abs(se.item()), at
    assert rel_err(lo, le) < 5e-2, at
    assert go.keys() == ge.keys(), at
    for n in ge:
        o, e = go[n], ge[n]
        if o is None and e is None:
            continue
        assert o is not None and e is not None, (at, n, "a gradient in only one of ours / eager")
        if e.norm() == 0:  # e.g. the embedding of a token absent from the batch: ours exactly zero too
            assert o.norm() == 0, (at, n)
        else:
            assert rel_err(o, e) < 2e-1, (at, n)


def _check_against_reference_and_eager(device, backend, batch=(4, 64), steps=3):
    """``backend`` (on ``device``) for each experts module on its captured inputs, against the
    reference backend, float64 and transformers' eager bf16 experts; then ``steps`` AdamW steps of
    the whole model: loss close to the reference backend's own run, and at every step logits, loss
    and every parameter gradient against a bf16 eager-experts copy given our current weights (two
    bf16 runs stepping on their own drift apart through routing flips, 0.17 in the logits by the
    third step, so the copy follows ours instead). The GPU test runs it with the fused
    kernels (backend="auto"); the CPU test runs the same code with backend="reference"."""
    kw = dict(hidden_size=256, moe_intermediate_size=128, head_dim=64, num_experts=16, num_experts_per_tok=4)
    torch.manual_seed(13)
    base = Qwen3MoeForCausalLM(tiny_config(**kw)).to(device).bfloat16()
    base.set_experts_implementation("eager")
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, VOCAB, batch, generator=g).to(device)
    captured = _capture_expert_inputs(base, ids)
    for n in EXPERT_NAMES:
        x, idx, w = captured[n]
        dy = torch.randn(x.shape, generator=g).to(x.dtype).to(device)
        mod = base.get_submodule(n)
        setattr(mod, "_prime_mega_moe_options", {"backend": backend})
        tested = _experts_fwd_bwd(mod, "prime_mega_moe", x, idx, w, dy)
        setattr(mod, "_prime_mega_moe_options", {"backend": "reference"})
        ref = _experts_fwd_bwd(mod, "prime_mega_moe", x, idx, w, dy)
        eager = _experts_fwd_bwd(mod, "eager", x, idx, w, dy)
        exact = _experts_fwd_bwd(copy.deepcopy(mod).cpu().double(), "eager", x.cpu().double(), idx.cpu(),
                                 w.cpu().double(), dy.cpu().double())
        for what, f, r, e, xx in zip(("y", "dx", "dtopk", "dgate_up", "ddown"), tested, ref, eager, exact):
            assert f.device == x.device and f.dtype == e.dtype, (n, what)
            assert rel_err(f, r) < 1e-2, (n, what)
            assert rel_err(f.cpu(), xx) < 1e-2, (n, what)
            assert rel_err(f.cpu(), xx) <= 1.25 * rel_err(e.cpu(), xx) + 1e-3, (n, what)
    ours = copy.deepcopy(base)
    assert pk_hf.apply(ours, backend=backend) == EXPERT_NAMES
    refm = copy.deepcopy(base)
    pk_hf.apply(refm, backend="reference")
    eager_model = copy.deepcopy(base)
    assert eager_model.config._experts_implementation == "eager"
    # lr 1e-2: computing with expert weights one step stale is then far outside the bounds below
    # (logits 0.38 from eager's; 0.08 at lr 1e-3)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(refm.parameters(), lr=1e-2)
    for i in range(steps):
        ids = torch.randint(0, VOCAB, batch, generator=g).to(device)
        eager_model.load_state_dict(ours.state_dict())
        got = step(ours, opt_o, ids)
        _assert_step_matches_eager(got, forward_backward(eager_model, ids), i)
        _, sr, _ = step(refm, opt_r, ids)
        assert abs(got[1].item() - sr.item()) < 1e-2 * abs(sr.item()), i


def test_cpu_variant_of_the_gpu_check():
    """The GPU test's code and sizes on the CPU, reference backend (so its logic runs in CI)."""
    _check_against_reference_and_eager("cpu", "reference")


@pytest.mark.skipif(auto_kernel_skip_reason() is not None, reason=str(auto_kernel_skip_reason()))
def test_gpu_auto_backend_close_to_reference_and_eager(monkeypatch):
    """backend="auto" on the GPU: the fused kernels, else the grouped pipeline (no reference fallback)."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    _check_against_reference_and_eager("cuda", "auto")


# ------------------------------------------------------------------------------------------------
# Other model families with the same experts layout, and load-time selection
# ------------------------------------------------------------------------------------------------

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, initializer_range=0.2, attn_implementation="eager")
_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=16, num_experts=6, num_experts_per_tok=3, eos_token_id=None, pad_token_id=None)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                         q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=3,
                         num_key_value_heads=4)),
}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_other_families_exact(family):
    """Any model whose experts use the same interface and layout: float64 logits and every gradient
    equal the eager experts' (shared experts, dense first layers and group-limited routing included)."""
    cfg_name, model_name, kw = _FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **kw})
    torch.manual_seed(20)
    ref = getattr(transformers, model_name)(cfg).double()
    ref.set_experts_implementation("eager")
    ours = copy.deepcopy(ref)
    names = pk_hf.apply(ours, backend="reference")
    want = [n for n, m in ref.named_modules() if pk_hf.is_experts_module(m)]
    assert names == want and len(names) >= 2
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(21))
    out_r = ref(input_ids=ids, labels=ids)
    out_o = ours(input_ids=ids, labels=ids)
    out_r.loss.backward()
    out_o.loss.backward()
    assert rel_err(out_o.logits.detach(), out_r.logits.detach()) < 1e-10
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        if p.grad is None or p.grad.norm() == 0:
            assert q.grad is None or q.grad.norm() == 0, n
        else:
            assert rel_err(q.grad, p.grad) < 1e-9, n


def test_gpt_oss_is_refused_for_its_biases():
    cfg = transformers.GptOssConfig(**{**_COMMON, "intermediate_size": 16, "num_local_experts": 4,
                                       "num_experts_per_tok": 2, "head_dim": 8, "layer_types": ["full_attention"] * 2})
    model = transformers.GptOssForCausalLM(cfg)
    with pytest.raises(UnsupportedLayerError, match="(?s)2 of 2 experts modules.*GptOssExperts.*biases"):
        pk_hf.apply(model)


def test_load_time_selection_and_gradient_checkpointing(tmp_path, monkeypatch):
    """save_pretrained / from_pretrained(experts_implementation="prime_mega_moe") from a local folder
    (no download) selects it at load time with backend="auto"; with gradient checkpointing the
    float64 gradients still equal eager's."""
    build(22, torch.float64).save_pretrained(tmp_path)
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="prime_mega_moe",
                                                 dtype=torch.float64)
    ref = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="eager", dtype=torch.float64)
    assert loaded.config._experts_implementation == "prime_mega_moe"
    ids = torch.randint(0, VOCAB, (2, 10))
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    # float64 under "auto": the exact mode is reference-only, so this raises
    with pytest.raises(ValueError, match="backend='reference'"):
        loaded(input_ids=ids)
    assert pk_hf.apply(loaded, backend="reference") == EXPERT_NAMES
    (getattr(loaded, "activation_checkpointing_enable", None) or loaded.gradient_checkpointing_enable)()
    loaded.train()
    ref.train()
    out_l = loaded(input_ids=ids, labels=ids)
    out_r = ref(input_ids=ids, labels=ids)
    out_l.loss.backward()
    out_r.loss.backward()
    assert rel_err(out_l.logits.detach(), out_r.logits.detach()) < 1e-10
    for (n, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
        if p.grad.norm() > 0:
            assert rel_err(q.grad, p.grad) < 1e-9, n
