"""The kda-chunk pass: rewrite counts, IR shape, and the lowered graph's numerics (reference impls and the Triton
kernels through the interpreter) against the unlowered reference, prefill + decode and segmented prefill."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import k3c
from k3c.codegen.catalogue import EMITTERS
from k3c.codegen.targets import get_target
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import parse_module, print_module, verify
from k3c.passes import PIPELINES, run_pipeline
from k3c.runtime import executor
from k3c.runtime.executor import LayerCaches, build_graph_module
from k3c.runtime.kernel_impls import KERNEL_IMPLS
from kdautil import rel_err

ROOT = Path(__file__).resolve().parents[2]
KDA_OPS = ("kda_proj", "kda_attn", "kda_out")


@pytest.fixture(scope="module")
def tiny():
    spec = k3c.load_spec(ROOT / "examples" / "k3-tiny.yaml")
    spec = spec.replace(layer_kinds=spec.layer_kinds[:4])     # kda, kda, kda, mla: every feature, half the time
    return spec, k3c.init_weights(spec, seed=0)


def lowered(spec):
    module, records = run_pipeline(spec_to_module(spec), ["kda-chunk"])
    return module, records[0]


def test_pass_rewrites_every_kda_layer(tiny, tmp_path):
    spec, _ = tiny
    module, rec = lowered(spec)
    n_kda = sum(1 for k in spec.layer_kinds if k == "kda")
    assert n_kda >= 2
    assert rec.changed and rec.counts["kda_layers"] == n_kda
    assert rec.counts["chunk"] == rec.counts["decode"] == rec.counts["out"] == n_kda
    ops = [op.op for op in module.ops]
    assert "kda" not in ops and ops.count("kda_attn") == ops.count("kda_out") == n_kda
    text = print_module(module)
    assert parse_module(text) == module
    verify(module)
    attn = next(op for op in module.ops if op.op == "kda_attn")
    assert attn.attr("chunk") == 16 and attn.attr("block_v") == 16 and attn.attr("layer") == 0
    # dumps show the rewrite
    run_pipeline(spec_to_module(spec), ["kda-chunk"], dump_dir=tmp_path)
    dump = (tmp_path / "001_kda-chunk.k3c").read_text()
    assert "kda_layers=" in dump and "kda_attn(" in dump
    # in the default pipeline, first
    default = list(PIPELINES["default"])
    assert "kda-chunk" in default and all(default.index("kda-chunk") < default.index(p) for p in ("mla-absorb", "codegen") if p in default)


def test_emitters_cover_kernel_ops(tiny):
    spec, _ = tiny
    module, _ = lowered(spec)
    assert "kda_attn" in EMITTERS and "kda_out" in EMITTERS
    attn = next(op for op in module.ops if op.op == "kda_attn")
    names = [ks.name for ks in EMITTERS["kda_attn"](attn, module, get_target("h200"))]
    assert any("kda_prep" in n for n in names) and any("kda_intra" in n for n in names)
    assert any("kda_inter" in n for n in names)
    assert any("kda_decode" in n for n in names)
    proj = next(op for op in module.ops if op.op == "kda_proj")
    assert all("gemm" in ks.name for ks in EMITTERS["kda_proj"](proj, module, get_target("h200")))
    marked, _ = run_pipeline(module, ["codegen"])
    impls = {op.op: op.attr("impl", None) for op in marked.ops if op.op in KDA_OPS}
    assert impls == {"kda_proj": "kernel", "kda_attn": "kernel", "kda_out": "kernel"}
    out = next(op for op in module.ops if op.op == "kda_out")
    assert [ks.name for ks in EMITTERS["kda_out"](out, module, get_target("mi355x"))][0].startswith("k3c_kda_out")


def graph_runner(module, weights, n_layers, kernels: bool, monkeypatch):
    if kernels:     # the KDA kernels; the projections stay torch here (the GEMM kernel has its own tests)
        for name in ("kda_attn", "kda_out"):
            monkeypatch.setitem(executor.TORCH_IMPLS, name, KERNEL_IMPLS[name])
    gm = build_graph_module(module, weights)

    def run(steps):
        cache = LayerCaches(n_layers)
        outs = []
        for ids in steps:
            out = gm(ids, cache)
            outs.append(out if out.dim() == 3 else out[:, None])
        return torch.cat(outs, 1)
    return run


@pytest.mark.parametrize("kernels", [False, True])
def test_lowered_graph_matches_reference_prefill_decode_segments(tiny, monkeypatch, kernels):
    spec, weights = tiny
    n = spec.num_layers
    ref = graph_runner(spec_to_module(spec), weights, n, False, monkeypatch)
    low = graph_runner(lowered(spec)[0], weights, n, kernels, monkeypatch)
    ids = torch.randint(0, spec.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    want = ref([ids])
    assert torch.isfinite(want).all()
    # one prefill; a prefill of T then 5 decodes; two segments with the state handed over
    runs = [[ids[:, :18]] + [ids[:, 18 + i:19 + i] for i in range(5)], [ids[:, :9], ids[:, 9:]]]
    for steps in ([[ids]] if not kernels else []) + runs:
        got = low(steps)
        assert rel_err(got, want) <= 1e-5, [s.shape for s in steps]


def test_projection_kernel_impl():
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    y = KERNEL_IMPLS["kda_proj"]({"proj": "q"}, None, (x,), {"weight": w})
    assert y.shape == (3, 5, 48) and rel_err(y, x @ w.T) <= 1e-5
