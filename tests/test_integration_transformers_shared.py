"""prime_kernels.integrations.transformers: the shared experts of Qwen2-MoE, Qwen3-Next, DeepSeek-V3 and Flint blocks
taken into the routed experts' call (MegaMoESharedExpert): exact in float64 with the choice forced both ways, the
blocks it leaves alone, and on the GPU against transformers' own block.

Tested with transformers==5.24.0 (pinned in ci/test.sh)."""

import copy
import importlib
from functools import partial

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")

from mega_helpers import rel_err  # noqa: E402
from test_integration_transformers import _COMMON, _FAMILIES, VOCAB, forward_backward  # noqa: E402

import prime_kernels.integrations.transformers as pk_hf  # noqa: E402

_SHARED_FAMILIES = {  # family: (its _FAMILIES entry, the shared expert gated)
    "qwen2_moe": (_FAMILIES["qwen2_moe"], True),  # router on the flat tokens
    "deepseek_v3": (_FAMILIES["deepseek_v3"], False),  # router on the block's input
    "qwen3_next": (("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], head_dim=8, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"])), True),
    "flint": (("FlintConfig", "FlintForCausalLM", dict(
        intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, head_dim=8, mlp_only_layers=[])), False),
}


def build_family(family, seed, dtype=torch.float64, device="cpu", **extra):
    (cfg_name, model_name, kw), _ = _SHARED_FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **kw, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(device=device, dtype=dtype)
    model.set_experts_implementation("eager")
    return model


def moe_blocks(model):
    return [m for m in model.modules() if pk_hf.is_experts_module(getattr(m, "experts", None))]


def shared_mlp(block):
    return block.shared_expert if hasattr(block, "shared_expert") else block.shared_experts


def force_inside(monkeypatch, inside):
    """Decide for every block, as the torchtitan tests do. The CPU's own answer is "beside" (the path inside the
    routed launches is CUDA only); forced inside, mega_moe gets the shared arguments and its reference adds them."""
    monkeypatch.setattr(pk_hf.MegaMoESharedExpert, "runs_inside", lambda self, x2d: inside)


def spy_shared_args(monkeypatch):
    """The shared arguments of every mega_moe call, as {name: (dtype, shape)}."""
    calls, real = [], pk_hf.mega_moe

    def spy(*args, **kw):
        calls.append({k: (v.dtype, tuple(v.shape)) for k, v in kw.items() if k.startswith("shared")})
        return real(*args, **kw)

    monkeypatch.setattr(pk_hf, "mega_moe", spy)
    return calls


def _assert_exact(got, want, tol=1e-12):
    (lo, so, go), (lr, sr, gr) = got, want
    assert rel_err(lo, lr) < tol and abs(so.item() - sr.item()) < tol * abs(sr.item())
    assert go.keys() == gr.keys()
    for n in gr:
        if gr[n] is None or gr[n].norm() == 0:
            assert go[n] is None or go[n].norm() == 0, n
        else:
            assert go[n] is not None and rel_err(go[n], gr[n]) < tol, n


@pytest.mark.parametrize("family", sorted(_SHARED_FAMILIES))
def test_shared_expert_blocks_get_the_fused_forward(family):
    """apply() gives each MoE block the fused forward and changes nothing else (classes, modules, state-dict keys and
    values: the unswitched model's checkpoint loads strictly); a deep copy's forward is its own block's, and so is a
    second apply's. On the CPU the real decision is "beside"."""
    ref = build_family(family, 40)
    ours = copy.deepcopy(ref)
    pk_hf.apply(ours, backend="reference")
    assert moe_blocks(ours)
    for block, rblock in zip(moe_blocks(ours), moe_blocks(ref)):
        assert isinstance(block.forward, pk_hf.MegaMoESharedExpert) and block.forward.block is block
        assert type(block) is type(rblock) and type(shared_mlp(block)) is type(shared_mlp(rblock))
        assert (block.forward.layout.gate is not None) == _SHARED_FAMILIES[family][1]
        assert block.forward.runs_inside(torch.randn(5, 32, dtype=torch.float64)) is False
    want, got = ref.state_dict(), ours.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    ours.load_state_dict(want, strict=True)
    twin = copy.deepcopy(ours)
    assert all(b.forward.block is b for b in moe_blocks(twin))
    pk_hf.apply(twin, backend="reference")
    assert all(isinstance(b.forward, pk_hf.MegaMoESharedExpert) and b.forward.block is b for b in moe_blocks(twin))


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "beside"])
@pytest.mark.parametrize("family", sorted(_SHARED_FAMILIES))
def test_shared_expert_exact_in_float64(family, inside, monkeypatch):
    """float64, backend="reference", against the unswitched transformers model: with the choice forced to the routed
    call taking the shared expert (shared_w13 = [gate_proj; up_proj], the sigmoid gate as shared_gate; the block
    never calls the shared MLP) and to the block's own forward, logits, loss and every parameter's gradient (the
    shared expert's and its gate's included, all nonzero) equal transformers' to 1e-12. The check can fail: the
    routed call without the shared expert, or without its gate, moves the logits by far more."""
    gated = _SHARED_FAMILIES[family][1]
    ref = build_family(family, 41)
    ours = copy.deepcopy(ref)
    pk_hf.apply(ours, backend="reference")
    force_inside(monkeypatch, inside)
    calls = spy_shared_args(monkeypatch)
    mlp_calls = []
    for block in moe_blocks(ours):
        shared_mlp(block).register_forward_hook(lambda m, args, out: mlp_calls.append(m))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(42))
    want = forward_backward(ref, ids)
    _assert_exact(forward_backward(ours, ids), want)
    n = len(moe_blocks(ours))
    keys = {"shared_w13", "shared_w2", "shared_gate"} if gated else {"shared_w13", "shared_w2"}
    assert [set(c) for c in calls] == [keys if inside else set()] * n
    assert len(mlp_calls) == (0 if inside else n)
    shared_params = [k for k in want[2] if ".shared_expert" in k]
    assert len(shared_params) == n * (4 if gated else 3) and all(want[2][k].norm() > 0 for k in shared_params)
    if inside:
        real = pk_hf.MegaMoESharedExpert.mega_moe_args
        for drop in ({"shared_w13", "shared_w2", "shared_gate"}, {"shared_gate"} if gated else None):
            if drop:
                monkeypatch.setattr(pk_hf.MegaMoESharedExpert, "mega_moe_args", lambda self, *a, drop=drop: {
                    k: v for k, v in real(self, *a).items() if k not in drop})
                with torch.no_grad():
                    assert rel_err(ours(input_ids=ids).logits, want[0]) > 1e-3, drop


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_shared_expert_inside_bf16_close_to_eager(family, monkeypatch):
    """bf16 model forced inside: the shared arguments in the dtypes the layer takes (bf16 weights, the gate fp32
    [T]), logits and loss close to transformers' bf16 model, a gradient for every shared parameter."""
    ref = build_family(family, 45, dtype=torch.bfloat16)
    ours = copy.deepcopy(ref)
    pk_hf.apply(ours, backend="reference")
    force_inside(monkeypatch, True)
    calls = spy_shared_args(monkeypatch)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(46))
    (lr_, sr, _), (lo, so, go) = forward_backward(ref, ids), forward_backward(ours, ids)
    Is = shared_mlp(moe_blocks(ours)[0]).down_proj.weight.shape[1]
    want = {"shared_w13": (torch.bfloat16, (2 * Is, 32)), "shared_w2": (torch.bfloat16, (32, Is))}
    if _SHARED_FAMILIES[family][1]:
        want["shared_gate"] = (torch.float32, (4 * 32,))
    assert calls and all(c == want for c in calls)
    assert abs(so.item() - sr.item()) < 5e-3 * abs(sr.item()) and rel_err(lo, lr_) < 5e-2
    assert all(g is not None and g.norm() > 0 for k, g in go.items() if ".shared_expert" in k)


def test_runs_inside_asks_the_shared_path_and_checks_the_block(monkeypatch):
    """runs_inside asks prime_kernels.mega._shared_ops.runs_inside with this call's tokens, the routed weights, the
    shared intermediate size and the experts' backend and precision; it says no without asking where the shared MLP
    or one of its Linears has a hook, under transformers' expert parallelism, where the MLP is no longer a SiLU
    SwiGLU, or where the experts went back to eager (the model then computes as transformers does)."""
    ref = build_family("qwen2_moe", 47)
    ours = copy.deepcopy(ref)
    pk_hf.apply(ours, backend="grouped", precision="fp8")
    block = moe_blocks(ours)[0]
    asked, answer = [], [None]
    monkeypatch.setattr(pk_hf, "_shared_ops", type("FakeSharedOps", (), {
        "runs_inside": staticmethod(lambda *a, **kw: asked.append((a, kw)) or answer[0] is None)}))
    x2d = torch.randn(7, 32, dtype=torch.float64)
    assert block.forward.runs_inside(x2d) is True
    ((x, w13, shared_inter), kw), = asked
    assert x is x2d and w13 is block.experts.gate_up_proj and shared_inter == 16
    assert kw == dict(backend="grouped", precision="fp8")
    answer[0] = "no"
    assert block.forward.runs_inside(x2d) is False
    asked.clear()
    answer[0] = None
    handle = block.shared_expert.up_proj.register_forward_pre_hook(lambda m, a: None)
    assert block.forward.runs_inside(x2d) is False
    handle.remove()
    block.experts._is_expert_parallel = True
    assert block.forward.runs_inside(x2d) is False
    block.experts._is_expert_parallel = False
    silu, block.shared_expert.act_fn = block.shared_expert.act_fn, nn.GELU()
    assert block.forward.runs_inside(x2d) is False
    block.shared_expert.act_fn = silu
    assert asked == [] and block.forward.runs_inside(x2d) is True
    ours.set_experts_implementation("eager")
    assert block.forward.runs_inside(x2d) is False
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(48))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)


def _with_bias(block):
    old = block.shared_expert.down_proj
    block.shared_expert.down_proj = nn.Linear(old.in_features, old.out_features, dtype=old.weight.dtype)
    with torch.no_grad():
        block.shared_expert.down_proj.weight.copy_(old.weight)


class _ScaledQwen2MoeBlock(transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock):
    def forward(self, hidden_states):
        return 2 * super().forward(hidden_states)


_CHANGES = {
    "bias": _with_bias,
    "gelu": lambda block: setattr(block.shared_expert, "act_fn", nn.GELU()),
    "other_block_forward": lambda block: setattr(block, "__class__", _ScaledQwen2MoeBlock),
    "instance_forward": lambda block: setattr(block, "forward", partial(type(block).forward, block)),
}


@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_unsupported_shared_experts_are_left_alone(change, monkeypatch):
    """A shared MLP with a bias or another activation, a block whose forward is not a known one, or a block whose
    instance has someone else's forward: the experts are switched, the block keeps its forward (even with the choice
    forced inside, which it never asks) and the float64 model computes as transformers does."""
    ref = build_family("qwen2_moe", 49)
    for block in moe_blocks(ref):
        _CHANGES[change](block)
    ours = copy.deepcopy(ref)
    assert len(pk_hf.apply(ours, backend="reference")) == len(moe_blocks(ours))
    assert not any(isinstance(b.__dict__.get("forward"), pk_hf.MegaMoESharedExpert) for b in moe_blocks(ours))
    force_inside(monkeypatch, True)
    calls = spy_shared_args(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(50))
    _assert_exact(forward_backward(ours, ids), forward_backward(ref, ids))
    assert calls == [{}] * len(moe_blocks(ours))


def test_a_second_apply_takes_back_the_forward_of_a_block_no_longer_supported():
    model = build_family("deepseek_v3", 51)
    pk_hf.apply(model, backend="reference")
    first, *others = moe_blocks(model)
    first.shared_experts.act_fn = nn.GELU()
    pk_hf.apply(model, backend="reference")
    assert "forward" not in first.__dict__
    assert others and all(isinstance(b.forward, pk_hf.MegaMoESharedExpert) for b in others)


_FLAT_GATED = ("flat", "shared_expert", "shared_expert_gate")
_INPUT = ("input", "shared_experts", None)


@pytest.mark.parametrize("module,cls,layout", [
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock", _FLAT_GATED), ("qwen3_next", "Qwen3NextSparseMoeBlock", _FLAT_GATED),
    ("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", _FLAT_GATED), ("deepseek_v3", "DeepseekV3MoE", _INPUT),
    ("deepseek_v2", "DeepseekV2Moe", _INPUT), ("glm4_moe", "Glm4MoeMoE", _INPUT),
    ("kimi_linear", "KimiLinearMoE", _INPUT), ("flint", "FlintSparseMoeBlock", ("flat", "shared_expert", None)),
    ("lara_mini", "LaraMiniSparseMoeBlock", ("flat", "shared_expert", None)),
    # other arithmetic around the sum: routed scaling, a post norm, an fp32 combine, an optional shared expert, a
    # combination strategy, a latent projection
    ("laguna", "LagunaSparseMoeBlock", None), ("axk1", "AXK1MoE", None), ("hy_v3", "HYV3MoE", None),
    ("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", None), ("cohere2_moe", "Cohere2MoeSparseMoeBlock", None),
    ("nemotron_h", "NemotronHMoE", None),
])
def test_known_block_forwards(module, cls, layout):
    """Which transformers 5.24 MoE blocks have a forward that the fused forward reproduces, and how."""
    block_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    got = pk_hf.SHARED_BLOCK_FORWARDS.get(pk_hf.code_fingerprint(block_cls.forward))
    assert (got and (got.router_input, got.mlp, got.gate)) == layout


class _Plain:
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Reformatted:
    def forward(self, x):
        # a comment, a blank line and other line breaks: the same code

        return self.down_proj(
            self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Changed:
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 2


def test_code_fingerprint_ignores_layout_not_code():
    fp = pk_hf.code_fingerprint
    assert fp(_Plain.forward) == fp(_Reformatted.forward) != fp(_Changed.forward)
    assert fp(len) is None  # no Python source
    models = transformers.models
    assert fp(models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeMLP.forward) == pk_hf.SWIGLU_MLP_FORWARD
    assert fp(models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MLP.forward) == pk_hf.SWIGLU_MLP_FORWARD
    assert fp(models.nemotron_h.modeling_nemotron_h.NemotronHMLP.forward) != pk_hf.SWIGLU_MLP_FORWARD  # no gate


def _shared_inside_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from prime_kernels.mega import _shared_ops

    return _shared_ops.reason(torch.empty(64, 256, device="cuda"), torch.empty(8, 256, 256, device="meta"),
                              torch.empty(1, 256, 256, device="meta"), backend="auto", precision="bf16", ep_size=1,
                              accumulators=False, return_plan=False, activation_clamp=None)


@pytest.mark.skipif(_shared_inside_skip_reason() is not None, reason=str(_shared_inside_skip_reason()))
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_gpu_shared_expert_inside_the_routed_call_matches_transformers(family, monkeypatch):
    """On the GPU where the shared expert runs inside the routed experts' launches: fp32 weights, bf16 compute, each
    MoE block (shared expert of the routed width: bf16 runs one shared group inside) against transformers' fp32
    block on the same weights and inputs (so the same routing), output and every gradient, within the TorchTitan
    test's bounds."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    sizes = dict(hidden_size=256, moe_intermediate_size=128, num_experts_per_tok=2)
    sizes.update(dict(shared_expert_intermediate_size=128) if family == "qwen2_moe" else dict(n_shared_experts=1))
    ref = build_family(family, 52, dtype=torch.float32, device="cuda", **sizes)
    ours = copy.deepcopy(ref)
    pk_hf.apply(ours, backend="auto")
    calls = spy_shared_args(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(53)
    for block, rblock in zip(moe_blocks(ours), moe_blocks(ref)):
        x = torch.randn(4, 130, 256, device="cuda", generator=g)
        dy = torch.randn(4, 130, 256, device="cuda", generator=g)
        assert block.forward.runs_inside(x.reshape(-1, 256))
        runs = []
        for b in (block, rblock):
            xi = x.clone().requires_grad_()
            y = b(xi)
            y.backward(dy)
            runs.append((y.detach(), xi.grad, {n: p.grad for n, p in b.named_parameters()}))
        (y_o, dx_o, g_o), (y_r, dx_r, g_r) = runs
        assert rel_err(y_o, y_r) < 2e-2 and rel_err(dx_o, dx_r) < 3e-2
        for n, gr in g_r.items():
            if gr is not None and gr.norm() > 0:
                assert g_o[n] is not None and rel_err(g_o[n], gr) < 3e-2, n
    assert calls and all("shared_w13" in c for c in calls)
