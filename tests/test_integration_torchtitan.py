"""prime_kernels.integrations.torchtitan: TorchTitan MoE layers with their routed experts on mega_moe,
against TorchTitan's own grouped-mm experts (torch._grouped_mm runs on the CPU in torch 2.14) on the
same weights and routing, forward and backward.

Tested with torchtitan==0.3.0 (pinned in ci/test.sh, installed with --no-deps plus spmd_types)."""

import copy
from functools import partial

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

from mega_helpers import auto_kernel_skip_reason, loop_reference, rel_err  # noqa: E402

import prime_kernels.integrations.torchtitan as pk_tt  # noqa: E402
from prime_kernels.integrations import UnsupportedLayerError  # noqa: E402
from prime_kernels.mega import _backend  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")

D, F, E, K = 64, 32, 8, 2


def shared_config(kind, dim=D, hidden=2 * F):
    """TorchTitan's shared-expert config: None, its plain FeedForward ("plain") or the sigmoid-gated one ("gated")."""
    if kind is None:
        return None
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.common.feed_forward import SigmoidGatedFeedForward
    from torchtitan.models.common.linear import Linear

    init = {"weight": partial(nn.init.normal_, std=0.2)}
    ffn = make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=init, w2w3_param_init=init)
    if kind == "plain":
        return ffn
    return SigmoidGatedFeedForward.Config(w1=ffn.w1, w2=ffn.w2, w3=ffn.w3,
                                          gate=Linear.Config(in_features=dim, out_features=1, param_init=init))


def build_moe(seed, *, dim=D, hidden=F, experts=E, top_k=K, device=None, score_func="softmax", route_norm=True,
              shared=None, shared_hidden=2 * F):
    torch.manual_seed(seed)
    init = partial(nn.init.normal_, std=0.2)
    cfg = make_moe_config(
        shared_experts=shared_config(shared, dim, shared_hidden),
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init={"weight": init}, top_k=top_k,
                                  score_func=score_func, route_norm=route_norm),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k,
                                                  param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init},
                                                  comm_backend="standard"),
        load_balance_coeff=None)
    if device is not None:
        with torch.device(device):
            return cfg.build()
    moe = cfg.build()
    moe.init_states()
    return moe


def capture_routing(moe, x):
    """(scores [T, K], expert ids [T, K]) that the router hands to routed_experts for x."""
    seen = {}

    def hook(mod, args):
        seen["s"], seen["i"] = args[1].detach().clone(), args[2].detach().clone()

    h = moe.routed_experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        moe(x)
    h.remove()
    return seen["s"].reshape(-1, seen["s"].shape[-1]), seen["i"].reshape(-1, seen["i"].shape[-1])


def run(moe, x, dy):
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = moe(x)
    y.backward(dy)
    return y.detach(), x.grad


def expert_grads(moe):
    inner = moe.routed_experts.inner_experts
    if isinstance(inner, pk_tt.MegaMoEGroupedExperts):
        g = inner.w13.grad
        return g[:, :inner.hidden_dim], g[:, inner.hidden_dim:], inner.w2_EDF.grad
    return inner.w1_EFD.grad, inner.w3_EFD.grad, inner.w2_EDF.grad


@pytest.mark.parametrize("seed,score_func", [(0, "softmax"), (1, "sigmoid")])
def test_forward_backward_match_torchtitan_grouped_mm(seed, score_func):
    """fp32 master weights, bf16 experts compute in both; routing from the same router. Output, dX,
    the router's gradient and dW1/dW3/dW2: close to TorchTitan's, and no further than TorchTitan's
    from a float64 evaluation of the same layer (the routing scores' gradient included)."""
    titan = build_moe(seed, score_func=score_func)
    ours = copy.deepcopy(titan)
    assert pk_tt.apply(ours, backend="reference") == [""]
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(3, 7, D, generator=g)
    dy = torch.randn(3, 7, D, generator=g)
    y_t, dx_t = run(titan, x, dy)
    y_o, dx_o = run(ours, x, dy)
    assert y_o.dtype == y_t.dtype == torch.float32

    # float64 oracle on the same routing (scores enter as a leaf, their gradient is checked via the router)
    s, idx = capture_routing(titan, x)
    inner = titan.routed_experts.inner_experts
    w13 = torch.cat([inner.w1_EFD, inner.w3_EFD], 1).detach()
    y_x, dx_x, ds_x, dw13_x, dw2_x = loop_reference(x.reshape(-1, D), idx, s, w13, inner.w2_EDF.detach(),
                                                    dy.reshape(-1, D))
    assert rel_err(y_o.reshape(-1, D), y_x) < 1e-2
    assert rel_err(y_o.reshape(-1, D), y_x) <= 1.25 * rel_err(y_t.reshape(-1, D), y_x) + 1e-3
    assert rel_err(y_o, y_t) < 2e-2
    for (go, gt, gx) in zip(expert_grads(ours), expert_grads(titan), (dw13_x[:, :F], dw13_x[:, F:], dw2_x)):
        assert rel_err(go, gx) < 1e-2
        assert rel_err(go, gx) <= 1.25 * rel_err(gt, gx) + 1e-3
        assert rel_err(go, gt) < 2e-2
    # dX also holds the router path (the scores depend on x), so compare it against TorchTitan only
    assert rel_err(dx_o, dx_t) < 2e-2
    assert rel_err(ours.router.gate.weight.grad, titan.router.gate.weight.grad) < 3e-2


def test_exact_mode_equals_float64_formula():
    """float64 layer on backend='reference' (unrounded): y, dX and the fused w13 gradient equal an
    independent float64 loop, so w1 -> gate rows and w3 -> up rows are mapped exactly."""
    moe = build_moe(2).double()
    pk_tt.apply(moe, backend="reference")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, D, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 9, D, generator=g, dtype=torch.float64)
    s, idx = capture_routing(moe, x)
    inner = moe.routed_experts.inner_experts
    y_x, _, _, dw13_x, dw2_x = loop_reference(x.reshape(-1, D), idx, s, inner.w13.detach(), inner.w2_EDF.detach(),
                                              dy.reshape(-1, D))
    y, _ = run(moe, x, dy)
    assert rel_err(y.reshape(-1, D), y_x) < 1e-12
    assert rel_err(inner.w13.grad, dw13_x) < 1e-12
    assert rel_err(inner.w2_EDF.grad, dw2_x) < 1e-12


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_precision_reaches_every_call(precision, monkeypatch):
    """apply(precision=) passes the precision to every mega_moe call (the FP8 recipe's emulation on the reference
    backend here: output and expert gradients within the recipe's error of TorchTitan's bf16 layer), and the shared
    experts ask _shared_ops.reason with it; an unknown precision is refused before anything is switched."""
    from prime_kernels.mega import _shared_ops

    titan = build_moe(5, dim=128, hidden=128, shared="plain", shared_hidden=128)
    ours = copy.deepcopy(titan)
    with pytest.raises(ValueError, match="precision"):
        pk_tt.apply(ours, precision="fp4")
    assert isinstance(ours.routed_experts, RoutedExperts)
    pk_tt.apply(ours, backend="reference", precision=precision)
    assert ours.routed_experts.precision == precision and precision in repr(ours.routed_experts)
    asked = []
    real_reason = _shared_ops.reason
    monkeypatch.setattr(_shared_ops, "reason", lambda *a, **k: asked.append(k["precision"]) or real_reason(*a, **k))
    g = torch.Generator().manual_seed(55)
    x = torch.randn(2, 40, 128, generator=g)
    dy = torch.randn(2, 40, 128, generator=g)
    y_t, dx_t = run(titan, x, dy)
    y_o, dx_o = run(ours, x, dy)
    assert asked and set(asked) == {precision}
    assert rel_err(y_o, y_t) < (1e-1 if precision == "fp8" else 2e-2)
    assert rel_err(dx_o, dx_t) < 1e-1
    for go, gt in zip(expert_grads(ours), expert_grads(titan)):
        assert 1e-3 < rel_err(go, gt) < 1.5e-1  # quantized: near, but not the bf16 layer's gradients
    pk_tt.apply(ours, backend="reference")  # switched again: back to bf16
    assert ours.routed_experts.precision == "bf16"


def test_w13_is_w1_then_w3_and_w2_is_shared():
    titan = build_moe(3)
    inner = titan.routed_experts.inner_experts
    w1, w2, w3 = inner.w1_EFD.detach().clone(), inner.w2_EDF, inner.w3_EFD.detach().clone()
    pk_tt.apply(titan)
    new = titan.routed_experts.inner_experts
    assert torch.equal(new.w13[:, :F], w1) and torch.equal(new.w13[:, F:], w3)
    assert new.w2_EDF is w2  # the same Parameter object: optimizer state and references survive
    assert new.num_experts == E and titan.routed_experts.backend == "auto"


def test_state_dict_keeps_torchtitan_keys():
    titan = build_moe(4)
    ours = copy.deepcopy(titan)
    pk_tt.apply(ours)
    assert sorted(ours.state_dict().keys()) == sorted(titan.state_dict().keys())
    other = build_moe(5)  # different weights, loaded through the TorchTitan keys
    ours.load_state_dict(other.state_dict())
    oi = other.routed_experts.inner_experts
    assert torch.equal(ours.routed_experts.inner_experts.w13, torch.cat([oi.w1_EFD, oi.w3_EFD], 1))
    back = build_moe(6)
    back.load_state_dict(ours.state_dict())  # and back into a plain TorchTitan layer
    for k, v in other.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # in-place loads (e.g. DCP) write through the w1/w3 views into w13
    sd = ours.state_dict()
    fresh = torch.randn(sd["routed_experts.inner_experts.w3_EFD"].shape)
    sd["routed_experts.inner_experts.w3_EFD"].copy_(fresh)
    assert torch.equal(ours.routed_experts.inner_experts.w13[:, F:], fresh)


def test_meta_device_build_then_init_states():
    moe = build_moe(8, device="meta")
    assert pk_tt.apply(moe) == [""]
    moe.to_empty(device="cpu")
    moe.init_states()
    w13 = moe.routed_experts.inner_experts.w13
    assert torch.isfinite(w13).all() and 0.15 < w13.std().item() < 0.25
    assert not torch.equal(w13[:, :F], w13[:, F:])
    assert moe.tokens_per_expert_E.shape == (E,)


def _two_layers(seed):
    return nn.ModuleDict({"a": build_moe(seed), "b": build_moe(seed + 1)})


def test_every_layer_switched_and_reported():
    model = _two_layers(9)
    assert pk_tt.apply(model, backend="reference") == ["a", "b"]
    assert all(isinstance(m.routed_experts, pk_tt.MegaMoERoutedExperts) for m in model.values())
    assert pk_tt.apply(model, backend="auto") == ["a", "b"]  # re-apply: backend updated, nothing re-fused
    assert all(m.routed_experts.backend == "auto" for m in model.values())


class _SubExperts(GroupedExperts):
    pass


@pytest.mark.parametrize("breakage,match", [
    ("score_before", "score_before_experts"),
    ("experts_subclass", "_SubExperts are not supported"),
    ("ep_mesh", "expert parallelism"),
    ("dispatcher", "token dispatcher"),
])
def test_unsupported_configurations_raise_and_switch_nothing(breakage, match):
    model = _two_layers(10)
    bad = model["b"]
    if breakage == "score_before":
        bad.routed_experts.score_before_experts = True
    elif breakage == "experts_subclass":
        bad.routed_experts.inner_experts.__class__ = _SubExperts
    elif breakage == "ep_mesh":
        bad.routed_experts.token_dispatcher.ep_mesh = object()
    elif breakage == "dispatcher":
        bad.routed_experts.token_dispatcher = type("DeepEPLike", (), {"top_k": K})()
    with pytest.raises(UnsupportedLayerError, match=match) as info:
        pk_tt.apply(model)
    assert "b" in str(info.value)
    assert type(model["a"].routed_experts) is RoutedExperts  # nothing switched


def test_model_without_moe_raises():
    with pytest.raises(UnsupportedLayerError, match="no TorchTitan MoE layer"):
        pk_tt.apply(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="backend must be one of"):
        pk_tt.apply(build_moe(11), backend="triton")


def test_auto_backend_is_passed_through(monkeypatch):
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    monkeypatch.setattr(_backend, "_warned", set())
    moe = build_moe(12)
    pk_tt.apply(moe)
    x = torch.randn(1, 4, D)
    with pytest.raises(_backend.FusedKernelUnavailable, match="PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK"):
        moe(x)
    monkeypatch.setenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", "1")
    with pytest.warns(RuntimeWarning, match="falling back"):
        moe(x)


def _check_against_torchtitan(device, backend, tokens=(4, 128)):
    """Kernel-aligned shapes (D 256, F 128, 16 experts, top-4): ``backend`` on ``device`` against
    TorchTitan's grouped-mm layer and the reference backend, forward and backward."""
    titan = build_moe(13, dim=256, hidden=128, experts=16, top_k=4).to(device)
    ours = copy.deepcopy(titan)
    pk_tt.apply(ours, backend=backend)
    ref = copy.deepcopy(titan)
    pk_tt.apply(ref, backend="reference")
    g = torch.Generator().manual_seed(14)
    x = torch.randn(*tokens, 256, generator=g).to(device)
    dy = torch.randn(*tokens, 256, generator=g).to(device)
    y_t, dx_t = run(titan, x, dy)
    y_o, dx_o = run(ours, x, dy)
    y_r, dx_r = run(ref, x, dy)
    assert y_o.device == x.device
    assert rel_err(y_o, y_r) < 1e-2 and rel_err(dx_o, dx_r) < 1e-2
    assert rel_err(y_o, y_t) < 2e-2 and rel_err(dx_o, dx_t) < 2e-2
    for go, gr, gt in zip(expert_grads(ours), expert_grads(ref), expert_grads(titan)):
        assert rel_err(go, gr) < 1e-2 and rel_err(go, gt) < 2e-2


def test_cpu_variant_of_the_gpu_check():
    _check_against_torchtitan("cpu", "reference", tokens=(2, 32))


@pytest.mark.skipif(auto_kernel_skip_reason() is not None, reason=str(auto_kernel_skip_reason()))
def test_gpu_auto_backend_matches_torchtitan(monkeypatch):
    """backend="auto" on the GPU: the fused kernels, else the grouped pipeline (no reference fallback)."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    _check_against_torchtitan("cuda", "auto")


def _tiny_qwen3_model(seed):
    """TorchTitan's Qwen3-MoE model class with a tiny config (the same layer builder as its flavors)."""
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    dim, hd, vocab = 64, 16, 128
    cfg = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=hd, moe_hidden_dim=F,
                                       num_experts=E, top_k=K, attn_backend="flex", moe_comm_backend="standard",
                                       rope=CosSinRoPE.Config(dim=hd, max_seq_len=64, theta=1e6)))
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return cfg, model


def test_whole_qwen3_model_switch_and_hf_export():
    """A whole TorchTitan Qwen3-MoE model: every MoE layer switched and reported, each layer's output
    on fresh inputs close to TorchTitan's, and its HF state-dict export (to_hf) unchanged."""
    try:
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    except ImportError as exc:  # torchtitan 0.3.0's FSDP helpers need a newer torch (seen on torch 2.11)
        pytest.skip(f"torchtitan's Qwen3 state-dict adapter does not import under torch {torch.__version__}: {exc}")

    cfg, titan = _tiny_qwen3_model(15)
    ours = copy.deepcopy(titan)
    assert pk_tt.apply(ours, backend="reference") == ["layers.0.moe", "layers.1.moe"]
    g = torch.Generator().manual_seed(16)
    for name in ("layers.0.moe", "layers.1.moe"):
        x = torch.randn(2, 11, D, generator=g)
        dy = torch.randn(2, 11, D, generator=g)
        y_t, dx_t = run(titan.get_submodule(name), x, dy)
        y_o, dx_o = run(ours.get_submodule(name), x, dy)
        assert rel_err(y_o, y_t) < 2e-2 and rel_err(dx_o, dx_t) < 2e-2
    adapter = Qwen3StateDictAdapter(cfg, None)
    hf_t = adapter.to_hf(titan.state_dict())
    hf_o = adapter.to_hf(ours.state_dict())
    assert hf_t.keys() == hf_o.keys() and any(".experts." in k for k in hf_o)
    for k in hf_t:
        assert torch.equal(hf_o[k], hf_t[k]), k
    _, back = _tiny_qwen3_model(17)  # other weights, switched, then loaded from the HF export
    pk_tt.apply(back)
    missing, unexpected = back.load_state_dict(adapter.from_hf(hf_t), strict=False)
    assert not unexpected and all(k.endswith("expert_bias_E") for k in missing)  # HF has no load-balancing bias
    for k, v in ours.state_dict().items():
        if not k.endswith("expert_bias_E"):
            assert torch.equal(back.state_dict()[k], v), k


def test_fsdp2_mixed_precision_after_apply():
    """TorchTitan's usual wrapping after apply(): FSDP2 fully_shard with bf16 params / fp32 reduce
    (one gloo rank on the CPU, in a subprocess): output, dX and the sharded fp32 w13 gradient close
    to TorchTitan's own layer under the same wrapping."""
    import socket

    from conftest import run_python

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import copy, os, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from mega_helpers import rel_err
from test_integration_torchtitan import D, F, build_moe, run
import prime_kernels.integrations.torchtitan as pk_tt
titan = build_moe(30)
ours = copy.deepcopy(titan)
pk_tt.apply(ours, backend="reference")
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
fully_shard(ours, mp_policy=mp)
fully_shard(titan, mp_policy=mp)
g = torch.Generator().manual_seed(31)
x, dy = torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g)
yo, dxo = run(ours, x, dy)
yt, dxt = run(titan, x, dy)
w13 = ours.routed_experts.inner_experts.w13
assert isinstance(w13, DTensor) and w13.grad.dtype == torch.float32
ti = titan.routed_experts.inner_experts
g13 = w13.grad.full_tensor()
errs = [rel_err(yo, yt), rel_err(dxo, dxt), rel_err(g13[:, :F], ti.w1_EFD.grad.full_tensor()),
        rel_err(g13[:, F:], ti.w3_EFD.grad.full_tensor()),
        rel_err(ours.routed_experts.inner_experts.w2_EDF.grad.full_tensor(), ti.w2_EDF.grad.full_tensor())]
assert max(errs) < 2e-2, errs
dist.destroy_process_group()
print("ok", errs)
"""
    # One CPU rank: hide GPUs, or FSDP2 would put its mesh (and the shards) on CUDA next to CPU inputs.
    res = run_python(code, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr


# ------------------------------------------------------------------------------------------------
# Shared experts
# ------------------------------------------------------------------------------------------------


def _all_grads(moe):
    """Every parameter's gradient by TorchTitan's names (w1/w3 out of the fused w13)."""
    out = {}
    for k, p in moe.named_parameters():
        if k.endswith("inner_experts.w13"):
            half = p.shape[1] // 2
            out[k[:-3] + "w1_EFD"], out[k[:-3] + "w3_EFD"] = p.grad[:, :half], p.grad[:, half:]
        else:
            out[k] = p.grad
    return out


@pytest.mark.parametrize("kind", ["plain", "gated"])
def test_shared_experts_exact_in_float64(kind, monkeypatch):
    """The shared FeedForward wrapped with the same keys. In float64 on backend="reference": where the shared experts
    run beside the routed call (the CPU: their path inside the launches is CUDA only) their parameters' gradients
    equal TorchTitan's eager layer's (whose routed experts round to bf16, so y only within 1e-2); with the choice
    forced to the routed call taking them (shared_w13 = [w1; w3], the sigmoid gate as shared_gate), y, dX and every
    parameter's gradient (the gate's included) equal the run beside."""
    titan = build_moe(30, shared=kind).double()
    beside = copy.deepcopy(titan)
    pk_tt.apply(beside, backend="reference")
    inside = copy.deepcopy(beside)
    assert isinstance(beside.shared_experts, pk_tt.MegaMoESharedExperts)
    assert beside.shared_experts.gated == (kind == "gated")
    assert sorted(beside.state_dict().keys()) == sorted(titan.state_dict().keys())
    g = torch.Generator().manual_seed(31)
    x = torch.randn(2, 9, D, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 9, D, generator=g, dtype=torch.float64)
    y_t, _ = run(titan, x, dy)
    y_b, dx_b = run(beside, x, dy)
    assert rel_err(y_b, y_t) < 1e-2
    got, want = _all_grads(beside), _all_grads(titan)
    assert sorted(got) == sorted(want)
    for k in (k for k in want if k.startswith("shared_experts.")):
        assert rel_err(got[k], want[k]) < 1e-12, k

    calls = []
    monkeypatch.setattr(pk_tt.MegaMoESharedExperts, "runs_inside", lambda self, x2d, w13: True)
    real = pk_tt.mega_moe

    def spy(*args, **kw):
        calls.append(sorted(k for k in kw if k.startswith("shared")))
        return real(*args, **kw)

    monkeypatch.setattr(pk_tt, "mega_moe", spy)
    y_i, dx_i = run(inside, x, dy)
    assert calls == [["shared_gate", "shared_w13", "shared_w2"] if kind == "gated" else ["shared_w13", "shared_w2"]]
    assert inside.shared_experts(x) is None
    assert rel_err(y_i, y_b) < 1e-12 and rel_err(dx_i, dx_b) < 1e-12
    got_i = _all_grads(inside)
    for k, gb in got.items():
        assert got_i[k] is not None and rel_err(got_i[k], gb) < 1e-12, k


def test_other_shared_modules_are_left_alone():
    """A shared-expert module that is not TorchTitan's plain or gated FeedForward (here one with biases) keeps
    running as the model wrote it."""
    titan = build_moe(32, shared="plain")
    titan.shared_experts.w2.bias = nn.Parameter(torch.zeros(D))
    ours = copy.deepcopy(titan)
    pk_tt.apply(ours, backend="reference")
    assert type(ours.shared_experts) is type(titan.shared_experts)


def test_shared_experts_survive_a_second_apply():
    moe = build_moe(33, shared="gated")
    pk_tt.apply(moe, backend="reference")
    wrapper = moe.shared_experts
    pk_tt.apply(moe, backend="auto")
    assert moe.shared_experts is wrapper and wrapper._routed is moe.routed_experts
    assert moe.routed_experts.backend == "auto"


def _shared_inside_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from prime_kernels.mega import _shared_ops

    x = torch.empty(64, 256, device="cuda")
    # one shared group (Is = I): the most bf16 runs inside the routed launches (BF16_MAX_SHARED_GROUPS)
    return _shared_ops.reason(x, torch.empty(8, 256, 256, device="meta"), torch.empty(1, 256, 256, device="meta"),
                              backend="auto", precision="bf16", ep_size=1, accumulators=False, return_plan=False,
                              activation_clamp=None)


@pytest.mark.skipif(_shared_inside_skip_reason() is not None, reason=str(_shared_inside_skip_reason()))
@pytest.mark.parametrize("kind", ["plain", "gated"])
def test_gpu_shared_experts_inside_the_routed_call_match_torchtitan(kind, monkeypatch):
    """On the GPU where the shared experts run inside the routed experts' launches: fp32 master weights, bf16
    compute, the layer (shared expert of the routed width) against TorchTitan's on the same weights and inputs,
    forward and every gradient."""
    monkeypatch.delenv("PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK", raising=False)
    dim, hidden = 256, 128
    titan = build_moe(34, dim=dim, hidden=hidden, shared=kind, shared_hidden=hidden).cuda()
    ours = copy.deepcopy(titan)
    pk_tt.apply(ours, backend="auto")
    g = torch.Generator(device="cuda").manual_seed(36)
    x = torch.randn(4, 130, dim, device="cuda", generator=g)
    dy = torch.randn(4, 130, dim, device="cuda", generator=g)
    assert ours.shared_experts.runs_inside(x.reshape(-1, dim), ours.routed_experts.inner_experts.w13)
    y_t, dx_t = run(titan, x, dy)
    y_o, dx_o = run(ours, x, dy)
    assert rel_err(y_o, y_t) < 2e-2 and rel_err(dx_o, dx_t) < 3e-2
    got, want = _all_grads(ours), _all_grads(titan)
    for k, gt in want.items():
        assert got[k] is not None and rel_err(got[k], gt) < 3e-2, k
