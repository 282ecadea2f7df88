"""The mla-absorb pass (IR rewrite, weight transforms, round trip) and the MHA/MQA mode choice of the cost
model."""
from __future__ import annotations

import torch

from k3c import load_spec
from k3c.analysis.cost import mla_crossover_new_tokens, mla_mode_costs
from k3c.codegen.catalogue import EMITTERS
from k3c.codegen.targets import get_target
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import parse_module, print_module
from k3c.passes.pipeline import PIPELINES, run_pipeline
from k3c.runtime.kernel_impls import mla as rt

SPEC = "examples/k3-tiny.yaml"


def test_pass_rewrites_every_mla_layer():
    module = spec_to_module(load_spec(SPEC))
    n_mla = sum(op.op == "mla" for op in module.ops)
    assert n_mla > 0
    out, records = run_pipeline(module, ["mla-absorb"])
    assert records[0].counts == {"mla_layers": n_mla, "kvb_split": 2 * n_mla}
    ops = [op.op for op in out.ops]
    assert "mla" not in ops and ops.count("mla_absorbed") == n_mla and ops.count("mla_kvb_split") == 2 * n_mla
    split = next(op for op in out.ops if op.op == "mla_kvb_split" and op.attr("part") == "uk_t")
    a = next(op for op in out.ops if op.op == "mla_absorbed").attr_dict
    assert split.types[0].shape == (a["num_heads"], a["qk_nope_head_dim"], a["kv_lora_rank"])
    assert parse_module(print_module(out)) == out
    assert "mla-absorb" in PIPELINES["default"]
    assert "mla_absorbed" in EMITTERS


def test_default_pipeline_marks_kernel_and_weight_transforms():
    out, _ = run_pipeline(spec_to_module(load_spec(SPEC)), ["default"])
    impls = {op.op: op.attr("impl", None) for op in out.ops if op.op.startswith("mla")}
    assert impls == {"mla_absorbed": "kernel", "mla_kvb_split": "extern"}


def test_emitter_kernels_for_h200():
    out, _ = run_pipeline(spec_to_module(load_spec(SPEC)), ["mla-absorb"])
    op = next(op for op in out.ops if op.op == "mla_absorbed")
    kernels = EMITTERS["mla_absorbed"](op, out, get_target("h200"))
    names = [k.name for k in kernels]
    assert any("latent_write" in n for n in names) and any("decode" in n for n in names)
    assert any("prefill" in n for n in names) and any("merge" in n for n in names)
    assert all("interpreter variant" not in k.source for k in kernels)
    assert all(f"p{get_target('h200').mla_page_size}" in n for n in names
               if "decode" in n or ("latent" in n and "_split_" not in n))      # the split-K partials: no pages
    assert sum("latent_write_split" in n for n in names) == 2 and any("latent_write_reduce" in n for n in names)


def test_cost_model_mode_choice():
    h200 = get_target("h200")
    k3 = {"num_heads": 96, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert mla_mode_costs(k3, 1, 32768, h200).best == "mqa"               # decode
    assert mla_mode_costs(k3, 4, 131072, h200).best == "mqa"              # speculative / short append
    assert mla_mode_costs(k3, 8192, 0, h200).best == "mha"                # fresh prefill
    assert mla_mode_costs(k3, 8192, 131072, h200).best == "mha"           # long append-prefill
    t = mla_crossover_new_tokens(k3, 131072, h200)
    assert t is not None and 1 < t < 8192
    assert mla_mode_costs(k3, t, 131072, h200).best == "mha" and mla_mode_costs(k3, t - 1, 131072, h200).best == "mqa"
    a = {**k3, "mode": "auto"}
    assert rt.choose_mode(a, 1, [100], get_target("cpu")) == "mqa"
    assert rt.choose_mode({**a, "mode": "mha"}, 1, [100], get_target("cpu")) == "mha"


def test_inspect_prints_the_crossover(capsys):
    from k3c.cli import main

    assert main(["inspect", SPEC, "--target", "h200"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert head.startswith("# mla mode crossover on h200") and "131072 cached: MHA from" in head
    assert parse_module(out) is not None          # still parseable IR (the crossover is a comment)
