"""k3c plan on the lowered IR of kimi-k3 (and k3-tiny): weight totals, JSON keys, memory under TP/EP, costs."""
import dataclasses
import json

import pytest

from k3c.analysis import ParallelLayout, mla_crossover_new_tokens, mla_mode_costs, plan, weight_report
from k3c.analysis.cost import Step, _kda_core
from k3c.analysis.formulas import GB, kda_decode_bytes, kda_decode_flops, kda_prefill_bytes, kda_prefill_flops
from k3c.codegen.targets import get_target
from k3c.errors import ArgumentError
from k3c.ir import TensorType

ROUTED = 92 * 896 * 3 * 3584 * 3072          # routed expert weights of K3


# ---- weights ---------------------------------------------------------------------------------------------
def test_k3_routed_experts_exactly_4_25_bits(k3_plan):
    d = k3_plan.to_dict()
    assert d["routed_expert_bytes"] == ROUTED * 17 // 32 == 1_446_456_066_048       # 4.25 bits = 17/32 B
    assert f"{d['routed_expert_bytes'] / GB:,.3f}" == "1,446.456"
    prec = d["weights_by_precision"]
    assert prec["mxfp4 payload (E2M1)"]["bytes"] == ROUTED // 2
    assert prec["mxfp4 scales (E8M0)"]["bytes"] == ROUTED // 32


def test_k3_checkpoint_totals(k3_plan):
    d = k3_plan.to_dict()
    total = d["weights_total_bytes"]
    assert total == 1_559_945_202_816
    assert total == pytest.approx(1.561e12, rel=2e-3)          # published checkpoint: 1.561e12 bytes
    assert round(d["params_total"] / 1e12, 2) == 2.78            # 2.78T parameters
    assert round(d["params_active"] / 1e9, 1) == 104.2           # 104.2B active
    cats = {k: v["bytes"] / GB for k, v in d["weights_by_category"].items()}
    # published BF16 breakdown (K3.md s1): shared 24.31, latent 9.45, attention 72.40, embeddings + lm_head 4.71
    assert round(cats["shared experts"], 2) == 24.31
    assert round(cats["latent projections"], 2) == 9.45
    assert cats["attention (KDA)"] + cats["attention (MLA)"] == pytest.approx(72.40, abs=0.05)
    assert cats["embeddings + lm_head"] == pytest.approx(4.71, abs=0.02)
    bf16 = d["weights_by_precision"]["bf16"]["bytes"] / GB
    assert bf16 == pytest.approx(113.485, abs=1e-3)              # 0.875 GB under the published 114.36 (docs/plan.md)


def test_mxfp4_patterns_and_packed_params(tiny_model):
    m = tiny_model.module
    lay = ParallelLayout.make(1)
    base = weight_report(m, lay)
    routed = [p for p in base.params if p.category == "routed experts"]
    assert routed and all(p.precision == "mxfp4" for p in routed)
    # exclude a layer's experts: they count as bf16 again
    attrs = dict(m.attrs)
    attrs["mxfp4_exclude"] = ("layers.1.*",)
    ex = weight_report(m.replace(attrs=attrs), lay)
    l1 = [p for p in routed if p.name.startswith("layers.1.")]
    assert ex.routed_expert_bytes - base.routed_expert_bytes == sum(p.numel * 2 - p.bytes for p in l1)
    # bf16 format: nothing is MXFP4
    attrs = dict(m.attrs)
    attrs["weight_format"] = "bf16"
    assert all(p.precision != "mxfp4" for p in weight_report(m.replace(attrs=attrs), lay).params)
    # a param a later mxfp4 pass already packed (u8 payload + e8m0 scales) is counted as typed
    w1 = next(p for p in routed if p.name == "layers.1.block_sparse_moe.experts.w1")
    e, rows, k = w1.type.shape
    ops = []
    for op in m.ops:
        if op.op == "param" and op.attr("name") == w1.name:
            op = op.replace(types=(TensorType("u8", (e, rows, k // 2)),))
            ops.append(op.replace(results=("w1_scale",), attrs={"name": w1.name + "_scale"},
                                  types=(TensorType("e8m0", (e, rows, k // 32)),)))
        ops.append(op)
    packed = weight_report(m.replace(ops=tuple(ops)), lay)
    got = {p.name: p for p in packed.params}
    assert got[w1.name].precision == "u8" and got[w1.name].bytes == e * rows * k // 2
    assert got[w1.name + "_scale"].precision == "e8m0" and got[w1.name + "_scale"].category == "routed experts"
    assert packed.routed_expert_bytes == base.routed_expert_bytes


# ---- JSON ------------------------------------------------------------------------------------------------
def test_json_keys_are_stable(k3_plan):
    d = json.loads(json.dumps(k3_plan.to_dict(), allow_nan=False))
    for key in ("schema", "weights_total_bytes", "routed_expert_bytes", "per_gpu", "fit", "phases",
                "kv_throughput", "mla_modes", "moe_comm", "attnres_pp", "assumptions", "formulas"):
        assert key in d, key
    g = d["per_gpu"]
    for key in ("weights_bytes", "mla_kv_cache_bytes", "kda_state_bytes", "conv_state_bytes", "attnres_bytes",
                "workspace_bytes", "total_bytes"):
        assert isinstance(g[key], (int, float)) and g[key] > 0, key
    assert g["total_bytes"] == pytest.approx(sum(g[k] for k in ("weights_bytes", "mla_kv_cache_bytes",
                                                                "kda_state_bytes", "conv_state_bytes",
                                                                "attnres_bytes", "workspace_bytes")))
    assert d["schema"] == "k3c-plan/1" and d["layout"] == {"tp": 8, "ep": 8, "world": 8, "dp_attention": 1}
    assert set(d["phases"]) == {"prefill", "decode", "append-prefill"}
    assert [r["context"] for r in d["kv_throughput"]] == [8192, 32768, 131072, 1048576]


def test_k3_memory_numbers(k3_plan):
    g = k3_plan.to_dict()["per_gpu"]
    # fp8 as the runtime stores it: 576 e4m3 codes + two fp32 per-token scales, padded to 16 B = 592 B per token
    # and layer: 14.90 GB, replicated per rank (AMD's 14.496 GB is 576 B: per-tensor scales, none in the row)
    assert g["mla_kv_cache_bytes"] == 1_048_576 * 592 * 24
    assert g["kda_state_bytes"] == 69 * 12 * 128 * 128 * 4                # 96 heads / TP 8, fp32
    assert g["conv_state_bytes"] == 69 * 3 * 12 * 128 * 3 * 2             # (kernel - 1) tokens, bf16
    assert g["attnres_bytes"] == 8 * (8192 // 8) * 7168 * 2               # 8 blocks, chunk sequence-sharded
    assert g["weights_bytes"] == pytest.approx(196.78e9, rel=1e-4)
    assert g["fits"] and g["total_bytes"] < g["usable_bytes"] < g["hbm_bytes"] == 288 * 2 ** 30
    fit = k3_plan.fit
    assert fit["max_batch_at_context"] == 5
    # the fit search is tight: the largest batch fits, one more does not
    planner, cfg = k3_plan.planner, k3_plan.config
    assert planner.plan(dataclasses.replace(cfg, batch=5)).fits
    assert not planner.plan(dataclasses.replace(cfg, batch=6)).fits
    ctx = fit["max_context_at_batch"]
    assert planner.plan(dataclasses.replace(cfg, context=ctx)).fits
    assert not planner.plan(dataclasses.replace(cfg, context=ctx + cfg.page_size)).fits


def test_kv_dtype_fp8_is_the_runtime_row(k3_model):
    """fp8 rows as the runtime stores them (the pool's row width: codes + two scales, padded): 592 / 1152 of bf16."""
    import torch

    from k3c.runtime.caches.latent_format import row_width

    fp8 = plan(k3_model, "mi355x", tp=8, context=131072, kv_dtype="fp8").to_dict()["per_gpu"]
    bf16 = plan(k3_model, "mi355x", tp=8, context=131072, kv_dtype="bf16").to_dict()["per_gpu"]
    assert fp8["mla_kv_cache_bytes"] * 1152 == bf16["mla_kv_cache_bytes"] * row_width(512, 64, torch.float8_e4m3fn)
    assert bf16["kda_state_bytes"] == fp8["kda_state_bytes"]


# ---- TP / EP ---------------------------------------------------------------------------------------------
def test_tp_replicates_mla_cache_and_divides_kda_state(k3_model):
    per = {tp: plan(k3_model, "mi355x", tp=tp, context=65536, kv_dtype="fp8") for tp in (1, 2, 8)}
    g = {tp: p.to_dict()["per_gpu"] for tp, p in per.items()}
    assert g[1]["mla_kv_cache_bytes"] == g[2]["mla_kv_cache_bytes"] == g[8]["mla_kv_cache_bytes"]
    assert g[1]["kda_state_bytes"] == 2 * g[2]["kda_state_bytes"] == 8 * g[8]["kda_state_bytes"]
    assert g[1]["conv_state_bytes"] == 8 * g[8]["conv_state_bytes"]
    assert g[1]["attnres_bytes"] == 8 * g[8]["attnres_bytes"]
    cat = {tp: p.to_dict()["weights_by_category"] for tp, p in per.items()}
    # EP follows TP: routed experts spread over the TP domain
    assert cat[8]["routed experts"]["gpu_bytes"] == pytest.approx(cat[1]["routed experts"]["bytes"] / 8)
    assert cat[8]["shared experts"]["gpu_bytes"] == pytest.approx(cat[1]["shared experts"]["bytes"] / 8)
    assert cat[8]["router"]["gpu_bytes"] == cat[1]["router"]["bytes"]                  # replicated
    # MLA: q_a and kv_a replicated, the head-split part divided
    mla = [p for p in per[8].weights.params if p.category == "attention (MLA)" and p.name.startswith("layers.3.")]
    rep = {p.role for p in mla if p.gpu_fraction == 1.0}
    assert rep == {"q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight",
                   "kv_a_layernorm.weight"}
    assert {p.gpu_fraction for p in mla if p.role not in rep} == {1 / 8}
    assert per[8].to_dict()["weights_total_bytes"] == per[1].to_dict()["weights_total_bytes"]


def test_ep_layouts(k3_model):
    a = plan(k3_model, "mi355x", tp=8, ep=1, context=8192)           # experts split TP-wise instead
    b = plan(k3_model, "mi355x", tp=1, ep=8, context=8192)           # attention data-parallel, 8 GPUs
    c = plan(k3_model, "mi355x", tp=8, context=8192)
    r = {n: p.weights.by_category["routed experts"]["gpu_bytes"] for n, p in (("a", a), ("b", b), ("c", c))}
    assert r["a"] == pytest.approx(r["c"]) and r["b"] == pytest.approx(r["c"])
    assert b.layout.world == 8 and b.layout.dp_attention == 8
    assert b.weights.by_category["attention (KDA)"]["gpu_bytes"] == b.weights.by_category["attention (KDA)"]["bytes"]
    with pytest.raises(ArgumentError, match="one must divide the other"):
        plan(k3_model, "mi355x", tp=8, ep=3)


def test_kimi_linear_without_attnres_or_latent():
    from .conftest import LINEAR

    d = plan(LINEAR, "h200", tp=2, context=32768).to_dict()
    assert d["per_gpu"]["attnres_bytes"] == 0 and d["attnres_pp"] == {}
    assert d["routed_expert_bytes"] == d["weights_by_category"]["routed experts"]["bytes"] > 0
    assert d["phases"]["decode"]["mla_modes"] == {"mqa": 7}


# ---- costs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["k3_frontend", "k3_full"])     # the layer op kda, and kda-chunk's kda_attn
def test_costs_use_the_pinned_kda_formulas(stage, request):
    p = plan(request.getfixturevalue(stage), "mi355x", tp=8, context=4096)
    cm = p.cost_model
    op, params = next((op, params) for op, params, _ in cm.groups if op.op in ("kda", "kda_attn"))
    conv = 2 * 3 * 12 * 128 * 3 * 2                   # conv tails read + written: 3 x 12 heads x 128 x (4-1) x bf16
    dec = _kda_core(cm, op, params, Step(1, 1, 1000))
    assert dec.total_flops == 12 * kda_decode_flops(128) and dec.bytes == 12 * kda_decode_bytes(128) + conv
    pre = _kda_core(cm, op, params, Step(1, 640, 0))     # 10 chunks of C = 64
    assert pre.total_flops == 10 * 12 * kda_prefill_flops(64, 128)
    assert pre.bytes == 10 * 12 * kda_prefill_bytes(64, 128) + 12 * kda_decode_bytes(128) + conv


def test_plan_is_the_same_whatever_the_passes(k3_frontend, k3_full):
    """Memory is exactly the same on the frontend IR and after kda-chunk, mla-absorb (W_kvb split: a weight
    transform replacing kv_b_proj), attnres-split and fusion; costs agree closely."""
    plans = [plan(m, "mi355x", tp=8, context=1 << 20, kv_dtype="fp8") for m in (k3_frontend, k3_full)]
    a, b = (p.to_dict() for p in plans)
    assert b["generic_cost_ops"] == {} and a["generic_cost_ops"] == {}
    assert {op.op for op, *_ in plans[1].cost_model.groups} >= {"kda_proj", "kda_attn", "mla_absorbed",
                                                                 "attn_res_phase1", "attn_res_phase2"}
    assert plans[1].weights.dropped and all("kv_b_proj" in n or "_res." in n for n in plans[1].weights.dropped)
    assert a["weights_total_bytes"] == b["weights_total_bytes"]
    for key in ("mla_kv_cache_bytes", "kda_state_bytes", "conv_state_bytes", "attnres_bytes", "workspace_bytes"):
        assert a["per_gpu"][key] == b["per_gpu"][key], key
    assert a["per_gpu"]["weights_bytes"] == pytest.approx(b["per_gpu"]["weights_bytes"], rel=1e-6)
    assert a["fit"] == b["fit"]
    for ph in ("prefill", "decode", "append-prefill"):
        x, y = a["phases"][ph], b["phases"][ph]
        assert x["flops"] == pytest.approx(y["flops"], rel=0.01), ph
        assert x["bytes"] == pytest.approx(y["bytes"], rel=0.1), ph
        assert x["roofline_seconds"] == pytest.approx(y["roofline_seconds"], rel=0.05), ph
    # the two-phase AttnRes schedule moves less than the naive mixes (with the adds and norms it absorbs)
    naive = sum(a["phases"]["prefill"]["by_kind"][k]["bytes"] for k in ("attn_res", "other"))
    split = sum(b["phases"]["prefill"]["by_kind"][k]["bytes"] for k in ("attn_res", "other"))
    assert split < naive / 3


def test_mla_mode_costs_and_crossover(k3_plan):
    t = get_target("mi355x")
    ds3 = dict(num_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
    c = mla_mode_costs(ds3, 1000, 0, t)
    w_kvb = 128 * 256 * 512
    pairs = 1000 * 1001 // 2
    assert c.mha.total_flops == 2 * w_kvb * 1000 + pairs * 128 * 640
    assert c.mqa.total_flops == 2 * w_kvb * 1000 + pairs * 128 * 2176
    assert (c.mqa.total_flops - 2 * w_kvb * 1000) / (c.mha.total_flops - 2 * w_kvb * 1000) == pytest.approx(3.4)
    assert c.best == "mha"                                          # fresh prefill: MHA
    mla_op = k3_plan.facts.mla[0]
    assert mla_mode_costs(mla_op, 1, 1 << 20, t, heads=12, kv_dtype="fp8").best == "mqa"    # decode: MQA
    # append-prefill: MHA wins once pairs x 1536 > 2 L (P+V) S, i.e. about 171 new tokens on a long cache
    x = mla_crossover_new_tokens(mla_op, 1 << 20, t, heads=12, kv_dtype="fp8")
    assert 150 <= x <= 200
    assert mla_mode_costs(mla_op, x, 1 << 20, t, heads=12, kv_dtype="fp8").best == "mha"
    assert mla_mode_costs(mla_op, x - 1, 1 << 20, t, heads=12, kv_dtype="fp8").best == "mqa"


def test_phases_and_modes(k3_plan):
    d = k3_plan.to_dict()["phases"]
    assert d["decode"]["mla_modes"] == {"mqa": 24}
    assert d["prefill"]["mla_modes"] == {"mha": 24 * 128}                 # 128 chunks of 8192 tokens
    assert d["prefill"]["tokens"] == 1 << 20 and d["decode"]["tokens"] == 1
    dec = d["decode"]["by_kind"]
    # decode at 1M context reads the whole replicated latent cache on every GPU
    assert dec["mla"]["bytes"] > 24 * (1 << 20) * 576
    assert d["prefill"]["total_seconds"] > d["append-prefill"]["total_seconds"] > d["decode"]["total_seconds"]


def test_generic_rule_prices_unknown_ops(tiny_model):
    names = tiny_model.pass_names      # the IR the planner reads: just before moe-lower (see report._module_of)
    m = tiny_model.module_after(names[names.index("moe-lower") - 1])
    ops = tuple(op.replace(op="fancy_norm") if op.op == "rmsnorm" else op for op in m.ops)
    p = plan(m.replace(ops=ops), "cpu", context=256)
    assert p.to_dict()["generic_cost_ops"] == {"fancy_norm": sum(op.op == "rmsnorm" for op in m.ops)}
    assert "priced as memory-bound" in p.text()
    assert p.phases[0].by_kind["other"]["cost"].bytes > 0


def test_bad_plan_arguments(tiny_model):
    for kw, needle in ((dict(kv_dtype="fp16"), "--kv-dtype"), (dict(context=0), "--context"),
                       (dict(batch=0), "--batch"), (dict(headroom=1.0), "--headroom"), (dict(tp=0), "--tp")):
        with pytest.raises(ArgumentError, match=needle):
            plan(tiny_model, "cpu", **kw)
