"""MXFP4 dense linears end to end (lm_head, the dense MLP, the MoE layer's shared experts and latent
projections): the kernel implementations (dense MXFP4 x bf16 GEMM, Triton interpreter) against the torch reference
on the same dequantized weights; a whole k3-tiny with all of them quantized, eager and through the kernels, against
the reference model on the dequantized weights; `k3c quantize` / load round trips; the planner's bytes."""
import json

import pytest
import torch

import k3c
from k3c.cli import main
from k3c.frontend import parse_spec_text
from k3c.frontend.spec import ActivationSpec
from k3c.frontend.quant_check import quantized_names
from k3c.quant import mxfp4_dequantize, mxfp4_quantize
from k3c.runtime.checkpoint import load_weights, save_k3_checkpoint
from k3c.runtime.weight_prep import prepare_weights

from .test_quantized_model import TINY

SECTION = ("quantization:\n  format: mxfp4\n  include: ['*.experts.w*', 'lm_head.weight', "
           "'*.routed_expert_*_proj.weight', '*.shared_experts.*', 'layers.0.mlp.*']\n")
LINEARS = ("lm_head.weight", "layers.0.mlp.gate_proj.weight", "layers.1.block_sparse_moe.shared_experts.up_proj.weight",
           "layers.1.block_sparse_moe.routed_expert_down_proj.weight",
           "layers.2.block_sparse_moe.routed_expert_up_proj.weight")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def interp():
    from k3c.codegen.triton_mode import prepare_interpreter

    prepare_interpreter()


@pytest.fixture(scope="module")
def qspec(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny-lin.yaml"
    path.write_text(TINY + SECTION)
    return path, k3c.load_spec(path)


@pytest.fixture(scope="module")
def qmodel(qspec):
    return k3c.compile(qspec[1], target="cpu")


def dequantized(spec, w, rule="floor"):
    deq = dict(w)
    for n in quantized_names(spec):
        deq[n] = mxfp4_dequantize(*mxfp4_quantize(w[n], rule), w[n].dtype)
    return deq


# ---- the op implementations ---------------------------------------------------------------------------------------
def _packed(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k // 32).repeat_interleave(32)  # varied block scales
    return mxfp4_quantize(w)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("m", [1, 7, 40, 300])      # decode, MMA tiles, the dequant plan (bucket 512)
def test_kernels_equal_reference_on_dequantized_weights(interp, dtype, tol, m):
    from k3c.runtime.executor import TORCH_IMPLS
    from k3c.runtime.kernel_impls import KERNEL_IMPLS

    g = torch.Generator().manual_seed(m)
    d, f, v = 64, 96, 160
    x = torch.randn(2, m, d, generator=g).to(dtype)
    head = dict(zip(("lm_head.weight_packed", "lm_head.weight_scale"), _packed(v, d, 1)))
    a = {"tied": False, "weight_format": "mxfp4", "act_format": "bf16"}
    got, ref = KERNEL_IMPLS["lm_head"](a, None, (x,), head), TORCH_IMPLS["lm_head"](a, None, (x,), head)
    assert got.dtype == dtype and got.shape == (2, m, v) and rel(got, ref) <= tol
    # the reference is the float op on the dequantized weight
    assert torch.equal(ref, torch.nn.functional.linear(x, mxfp4_dequantize(*head.values(), dtype)))

    mlp = {}
    for i, (role, shape) in enumerate((("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f)))):
        mlp.update(zip((f"{role}.weight_packed", f"{role}.weight_scale"), _packed(*shape, 10 + i)))
    a = {"layer": 0, "activation": "situ", "situ_beta_gate": 4.0, "situ_beta_up": 25.0, "weight_format": "mxfp4",
         "act_format": "bf16"}
    got, ref = KERNEL_IMPLS["mlp"](a, None, (x,), mlp), TORCH_IMPLS["mlp"](a, None, (x,), mlp)
    assert got.shape == x.shape and rel(got, ref) <= tol

    lin = dict(zip(("weight_packed", "weight_scale"), _packed(d, f, 20)))
    h = torch.randn(2, m, f, generator=g).to(dtype)
    res = torch.randn(2, m, d, generator=g).to(dtype)
    a = {"layer": 1, "proj": "latent_up", "residual": True, "weight_format": "mxfp4", "act_format": "bf16"}
    got, ref = KERNEL_IMPLS["moe_linear"](a, None, (h, res), lin), TORCH_IMPLS["moe_linear"](a, None, (h, res), lin)
    assert got.shape == res.shape and rel(got, ref) <= tol


@pytest.mark.parametrize("mode", ["e4m3", "e2m1"])
def test_native_mode_matches_reference_with_quantized_activations(interp, monkeypatch, mode):
    """On targets with MX matrix units (mi355x, b200: forced here) the kernel runs tl.dot_scaled on activations
    quantized per 32; the torch implementation quantizes them the same way (k3c.quant) before the float GEMM."""
    from k3c.runtime.executor import TORCH_IMPLS
    from k3c.runtime.kernel_impls import KERNEL_IMPLS
    from k3c.runtime.kernel_impls import mxfp4_linear as L

    monkeypatch.setattr(L, "dense_mx", lambda target, act: mode)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    mlp = {}
    for i, (role, shape) in enumerate((("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96)))):
        mlp.update(zip((f"{role}.weight_packed", f"{role}.weight_scale"), _packed(*shape, 30 + i)))
    a = {"layer": 0, "activation": "swiglu", "weight_format": "mxfp4", "act_format": "mxfp8"}
    got, ref = KERNEL_IMPLS["mlp"](a, None, (x,), mlp), TORCH_IMPLS["mlp"](a, None, (x,), mlp)
    assert rel(got, ref) <= 1e-2
    plain = L.ref.mlp(x, L.dequantized(mlp, ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                                       torch.bfloat16), ActivationSpec.from_attrs(a))
    assert rel(ref, plain) > 1e-3          # the activations really were quantized


def test_float_weights_keep_their_paths(interp):
    """Unquantized ops run their float paths (the MXFP4 family's entries hand them on)."""
    from k3c.runtime.executor import TORCH_IMPLS
    from k3c.runtime.kernel_impls import KERNEL_IMPLS
    from k3c.runtime.kernel_impls import basic
    from k3c.runtime.kernel_impls import moe as kmoe

    x = torch.randn(3, 64)
    w = {"lm_head.weight": torch.randn(100, 64)}
    assert torch.equal(TORCH_IMPLS["lm_head"]({"tied": False}, None, (x,), w), x @ w["lm_head.weight"].T)
    assert KERNEL_IMPLS["mlp"].__name__ == "launch_mlp" and basic.launch_mlp is not KERNEL_IMPLS["mlp"]
    wl = {"weight": torch.randn(32, 64)}
    a = {"proj": "latent_down"}
    assert torch.equal(KERNEL_IMPLS["moe_linear"](a, None, (x,), wl), kmoe.launch_moe_linear(a, None, (x,), wl))
    assert torch.equal(TORCH_IMPLS["moe_linear"](a, None, (x,), wl), kmoe.torch_moe_linear(a, None, (x,), wl))


# ---- the whole model ----------------------------------------------------------------------------------------------
def test_ir_packs_the_linears(qmodel):
    mod = qmodel.module
    assert mod.ops_named("lm_head")[0].attr("weight_format") == "mxfp4"
    assert mod.ops_named("lm_head")[0].attr("impl") == "kernel"
    assert {op.attr("weight_format", "bf16") for op in mod.ops_named("mlp")} == {"mxfp4"}     # dense + shared
    fmts = {(op.attr("proj"), op.attr("weight_format", "bf16")) for op in mod.ops_named("moe_linear")}
    assert fmts == {("router", "bf16"), ("latent_down", "mxfp4"), ("latent_up", "mxfp4")}


@pytest.mark.parametrize("use_kernels", [False, True])
def test_session_equals_reference_on_dequantized_weights(interp, qspec, qmodel, use_kernels):
    _, spec = qspec
    w = k3c.init_weights(spec, seed=5)                                  # fp32: the tight comparison
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    out = qmodel.session(w, use_kernels=use_kernels).prefill(ids)      # quantized once, at load
    ref = k3c.reference_forward(spec, dequantized(spec, w), ids)
    assert rel(out, ref) < 1e-5
    assert rel(out, k3c.reference_forward(spec, w, ids)) > 1e-3        # the weights really were quantized


def test_prepare_weights_quantizes_and_dequantizes_linears(qspec, qmodel):
    _, spec = qspec
    w = k3c.init_weights(spec, seed=1, dtype=torch.bfloat16)
    got = prepare_weights(qmodel.module, w)
    for n in LINEARS:
        p, s = mxfp4_quantize(w[n])
        stem = n[: -len("weight")]
        assert n not in got
        assert torch.equal(got[stem + "weight_packed"], p) and torch.equal(got[stem + "weight_scale"], s)
    # a float graph given only the packed head: dequantized at load
    plain = k3c.compile(parse_spec_text(TINY, "t.yaml"), target="cpu")
    base = {k: v for k, v in w.items() if k != "lm_head.weight"}
    p, s = mxfp4_quantize(w["lm_head.weight"])
    got = prepare_weights(plain.module, {**base, "lm_head.weight_packed": p, "lm_head.weight_scale": s})
    assert torch.equal(got["lm_head.weight"], mxfp4_dequantize(p, s, torch.bfloat16))


def test_quantize_cli_round_trip(qspec, qmodel, tmp_path):
    path, spec = qspec
    out = tmp_path / "packed"
    assert main(["quantize", str(path), "--random", "--seed", "3", "-o", str(out)]) == 0
    record = json.loads((out / "quantization.json").read_text())
    assert record["weights"] == quantized_names(spec) and set(LINEARS) <= set(record["weights"])
    packed = load_weights(spec, out)
    w = k3c.init_weights(spec, seed=3, dtype=torch.bfloat16)
    for n in LINEARS:
        stem = n[: -len("weight")]
        p, s = mxfp4_quantize(w[n])
        assert n not in packed
        assert torch.equal(packed[stem + "weight_packed"], p) and torch.equal(packed[stem + "weight_scale"], s)
    assert torch.equal(packed["layers.1.block_sparse_moe.gate.weight"], w["layers.1.block_sparse_moe.gate.weight"])
    ids = torch.randint(0, spec.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    a = qmodel.session(packed, use_kernels=False).prefill(ids)
    b = qmodel.session(w, use_kernels=False).prefill(ids)
    assert torch.equal(a, b)
    # the K3 layout writes packed linears under compressed-tensors names and reads them back
    k3dir = save_k3_checkpoint(spec, packed, tmp_path / "k3")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "k3" / "model.safetensors"), "pt") as h:
        keys = set(h.keys())
    assert "language_model.lm_head.weight_packed" in keys and "language_model.lm_head.weight_scale" in keys
    again = load_weights(spec, k3dir)
    assert set(again) == set(packed) and all(torch.equal(again[k], packed[k]) for k in packed)
    # its config.json imports back with the same quantization selection
    assert quantized_names(k3c.load_spec(k3dir)) == quantized_names(spec)


def test_sharded_compile_packs_slices(qspec):
    """TP 2 x EP 2, rank 1: the packed params keep the shard pass's split; weights drawn for the rank, or sliced from
    full ones, prepare; the sharded plan sees the whole model's bytes."""
    from k3c.analysis import plan
    from k3c.runtime.distributed import init_sharded_weights, shard_weights

    _, spec = qspec
    m = k3c.compile(spec, target="mi355x", tp=2, ep=2, rank=1)
    head = m.module.params()["lm_head.weight_packed"]
    assert head.attr("shard") == "tp:0:1/2" and head.type.shape == (spec.vocab_size // 2, spec.hidden_size // 2)
    drawn = init_sharded_weights(m, seed=1)
    assert "lm_head.weight_packed" in drawn and "lm_head.weight" not in drawn
    prepare_weights(m.module, drawn)
    prepare_weights(m.module, shard_weights(m, k3c.init_weights(spec, seed=1)))
    p = plan(m, "mi355x", context=256)
    assert p.weights.total_bytes == plan(spec, "mi355x", tp=2, context=256).weights.total_bytes
    assert p.weights.by_name["layers.0.mlp.down_proj.weight_packed"].gpu_fraction == 0.5


def test_plan_counts_quantized_linears_at_4_25_bits(qspec):
    from k3c.analysis.report import plan

    _, spec = qspec
    plain = parse_spec_text(TINY + "quantization:\n  format: mxfp4\n", "p.yaml")
    pq, pp = plan(spec, "h200", context=256), plan(plain, "h200", context=256)
    by = {p.name: p for p in pq.weights.params}
    v, d = spec.vocab_size, spec.hidden_size
    head = [by["lm_head.weight_packed"], by["lm_head.weight_scale"]]
    assert {p.precision for p in head} == {"mxfp4"}
    assert sum(p.bytes for p in head) == v * d * 4.25 / 8
    assert {p.name: p.precision for p in pp.weights.params}["lm_head.weight"] == "bf16"
    # the decode step reads fewer weight bytes, and the lm_head's FLOPs are unchanged
    dq, dp = pq.phases[1].cost, pp.phases[1].cost
    assert dq.bytes < dp.bytes and dq.total_flops == pytest.approx(dp.total_flops)
