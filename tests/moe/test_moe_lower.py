"""The moe-lower pass: rewrite counts and IR shape on k3-tiny, and the lowered MoE layer (generated kernels through
the interpreter) against the eager reference MoE with the same (dequantized) weights: latent and not, SiTU-GLU and
SwiGLU, bf16 and fp32, MXFP4 experts, and expert parallelism (two ranks' partial combines summed in one process)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import k3c
from k3c.codegen.catalogue import EMITTERS
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import parse_module, print_module, verify
from k3c.ir.builder import Builder
from k3c.ir.core import TensorType
from k3c.ir.layer_ops import moe_roles
from k3c.passes import PIPELINES, run_pipeline
from k3c.quant import mxfp4_dequantize, mxfp4_quantize
from k3c.runtime.executor import LayerCaches, build_graph_module
from k3c.runtime.kernel_impls import KERNEL_IMPLS

ROOT = Path(__file__).resolve().parents[2]
MOE_OPS = ("moe_linear", "moe_route", "moe_gate_up", "moe_down", "moe_combine")
PREFIX = "layers.1.block_sparse_moe."
DT = {torch.bfloat16: "bf16", torch.float32: "f32"}


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_pass_rewrites_every_moe_layer():
    spec = k3c.load_spec(ROOT / "examples" / "k3-tiny.yaml")
    module, records = run_pipeline(spec_to_module(spec), ["moe-lower", "codegen"])
    n_moe = sum(1 for op in spec_to_module(spec).ops if op.op == "moe")
    assert n_moe >= 2
    counts = records[0].counts
    assert counts["moe_layers"] == counts["latent"] == counts["shared"] == n_moe and "all_reduce" not in counts
    ops = [op.op for op in module.ops]
    assert "moe" not in ops and ops.count("moe_route") == ops.count("moe_gate_up") == n_moe
    assert ops.count("moe_linear") == 3 * n_moe                  # router, latent down, latent up (+ shared)
    for op in module.ops:
        if op.op in MOE_OPS:
            assert op.attr("impl") == "kernel" and op.op in EMITTERS and op.op in KERNEL_IMPLS
    verify(module)
    assert parse_module(print_module(module)) == module
    default = list(PIPELINES["default"])
    assert default.index("attnres-split") < default.index("moe-lower") < default.index("codegen")


def moe_module(*, latent, act, dtype, fmt="bf16", shared=True, e=6, k=2, d=32, z=32, m=32, ep=(0, 1)):
    """One moe op on x [1, T, d] with its params; returns (module, weights: canonical name -> tensor)."""
    g = torch.Generator().manual_seed(11)
    attrs = {"layer": 1, "num_experts": e, "top_k": k, "num_shared_experts": 1 if shared else 0,
             "router_activation": "sigmoid", "router_bias": True, "renormalize": True, "routed_scaling_factor": 2.5,
             "latent_dim": z if latent else None, "latent_norm": latent, "norm_eps": 1e-5, "activation": act}
    if act == "situ":
        attrs.update(situ_beta_gate=4.0, situ_beta_up=25.0)
    if fmt == "mxfp4":
        attrs["expert_format"] = "mxfp4"
    if ep[1] > 1:
        attrs.update(ep_rank=ep[0], ep_size=ep[1])
    zd = z if latent else d
    el = e // ep[1]
    lo = ep[0] * el
    full = {"gate.weight": (e, d), "gate.e_score_correction_bias": (e,), "experts.w1": (e, m, zd),
            "experts.w3": (e, m, zd), "experts.w2": (e, zd, m), "shared_experts.gate_proj.weight": (m, d),
            "shared_experts.up_proj.weight": (m, d), "shared_experts.down_proj.weight": (d, m),
            "routed_expert_down_proj.weight": (z, d), "routed_expert_norm.weight": (z,),
            "routed_expert_up_proj.weight": (d, z)}
    dense = {n: torch.randn(*s, generator=g) / s[-1] ** 0.5 for n, s in full.items()}
    dense["gate.e_score_correction_bias"] = torch.randn(e, generator=g) * 0.1
    dense["routed_expert_norm.weight"] = 1 + 0.1 * torch.randn(z, generator=g)
    weights, ref_weights = {}, {}
    for n, t in dense.items():
        if n.startswith("experts."):
            if fmt == "mxfp4":
                p, s = mxfp4_quantize(t)
                t = mxfp4_dequantize(p, s, torch.float32)
                weights[f"{n}.weight_packed"], weights[f"{n}.weight_scale"] = p[lo:lo + el], s[lo:lo + el]
            else:
                weights[n] = t[lo:lo + el].to(dtype)
            ref_weights[n] = t.to(dtype)
        else:
            weights[n] = ref_weights[n] = t if n == "gate.e_score_correction_bias" else t.to(dtype)
    b = Builder("moe-test")
    x = b.declare("input", TensorType(DT[dtype], (1, "T", d)), {"name": "x"})
    ins = [x]
    for role in moe_roles(attrs)[1:]:
        t = weights[role.name]
        ty = "u8" if t.dtype == torch.uint8 else DT[t.dtype]
        ins.append(b.declare("param", TensorType(ty, tuple(t.shape)), {"name": PREFIX + role.name}))
    y = b.op("moe", ins, attrs)
    module = b.build([y])
    verify(module)
    return module, {PREFIX + n: t for n, t in weights.items()}, {PREFIX + n: t for n, t in ref_weights.items()}


def reference(module_kw, ref_w, x):
    kw = dict(module_kw, fmt="bf16", ep=(0, 1))
    module, _, _ = moe_module(**kw)
    return build_graph_module(module, ref_w, use_kernels=False)(x, LayerCaches(2))


def lowered(module, weights, wrap=None):
    low, _ = run_pipeline(module, ["moe-lower", "codegen"])
    return low, build_graph_module(low, weights, use_kernels=True, wrap=wrap)


@pytest.mark.parametrize("kw, tol", [
    (dict(latent=True, act="situ", dtype=torch.bfloat16, fmt="mxfp4"), 1e-2),      # K3: LatentMoE, MXFP4 experts
    (dict(latent=False, act="swiglu", dtype=torch.float32, e=5, k=3), 1e-5),       # non-latent, shared fused
    (dict(latent=True, act="swiglu", dtype=torch.float32, shared=False), 1e-5),
])
def test_lowered_moe_equals_reference(kw, tol):
    module, weights, ref_w = moe_module(**kw)
    x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(5)).to(kw["dtype"])
    low, gm = lowered(module, weights)
    ops = [op.op for op in low.ops]
    assert "moe" not in ops and ("add" not in ops)        # the shared experts ride in an epilogue
    assert rel(gm(x, LayerCaches(2)), reference(kw, ref_w, x)) <= tol


def test_expert_parallel_partials_sum_to_the_reference():
    """ep_size 2: each rank routes over all experts, runs its own; the all_reduce before the latent norm gets the
    other rank's partial combine added here (one process), and the result is the whole layer."""
    kw = dict(latent=True, act="situ", dtype=torch.float32, e=4)
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(6))
    partial = {}

    def capture(rank, replace):
        def wrap(op, fn):
            if op.op != "all_reduce":
                return fn

            def run(a, cache, data, w):
                partial[rank] = data[0]
                return partial[0] + partial[1] if replace else data[0]
            return run
        return wrap

    outs = []
    for rank, replace in ((1, False), (0, True)):
        module, weights, ref_w = moe_module(**kw, ep=(rank, 2))
        low, gm = lowered(module, weights, capture(rank, replace))
        ar = [op for op in low.ops if op.op == "all_reduce"]
        assert len(ar) == 1 and ar[0].attr("group") == "ep" and ar[0].attr("size") == 2
        nxt = [op for op in low.ops if ar[0].results[0] in op.inputs]
        assert [op.op for op in nxt] == ["rmsnorm"]              # all-reduced before the latent norm
        outs.append(gm(x, LayerCaches(2)))
    assert rel(outs[-1], reference(kw, ref_w, x)) <= 1e-5
