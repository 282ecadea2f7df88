"""The `shard` pass on k3-tiny and kimi-k3: local param shapes and annotations, collectives and counts, layouts,
errors naming --tp / --ep, and per-rank weights (slice of a full init, random init, safetensors slices)."""
import os

import pytest
import torch

import k3c
from k3c.cli import main
from k3c.errors import ArgumentError
from k3c.ir import parse_module, print_module
from k3c.passes.shard import make_layout, parse_shard
from k3c.runtime.distributed import init_sharded_weights, load_sharded_weights, param_shards, shard_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "k3-tiny.yaml")


@pytest.fixture(scope="module")
def spec():
    return k3c.load_spec(TINY)


def _params(module):
    return {op.attr("name"): op for op in module.ops if op.op == "param"}


def test_shard_runs_first_and_splits_heads_experts_columns(spec):
    m = k3c.compile(spec, target="cpu", tp=2, ep=2, rank=1)
    assert m.pass_names[0] == "shard"
    s = m.module_after("shard")
    counts = m.records[0].counts
    # 6 KDA + 2 MLA + 1 dense MLP + 7 shared-expert MLPs reduce-scatter over TP (sequence parallel); every layer op
    # and lm_head gathers its input's tokens (the shared experts reuse the MoE's); lm_head gathers the vocab
    assert counts["reduce_scatter.tp"] == 16 and counts["seq_gather.tp"] == 16 + 1 and counts["all_gather.tp"] == 1
    assert counts["seq_scatter.tp"] == 1 + 7                  # the embedding and each replicated routed output
    assert (counts["kda"], counts["mla"], counts["mlp"], counts["moe"], counts["shared_experts"]) == (6, 2, 1, 7, 7)
    assert len(s.ops_named("reduce_scatter")) == 16 and not s.ops_named("all_reduce")
    # the residual stream and the AttnRes blocks hold this rank's tokens; layer ops see all of them
    assert s.defs["emb1"].type.shape == (("B", "T_sp", 64)) and s.ops_named("attn_res_mix")[0].type.shape[1] == "T_sp"
    assert s.ops_named("kda")[0].type.shape[1] == "T"
    p = _params(s)
    q = p["layers.0.self_attn.q_proj.weight"]
    assert q.types[0].shape == (16, 64) and q.attr("shard") == "tp:0:1/2"
    assert p["layers.0.self_attn.o_proj.weight"].types[0].shape == (64, 16)
    assert p["layers.0.self_attn.o_proj.weight"].attr("shard") == "tp:1:1/2"
    assert p["layers.0.self_attn.A_log"].types[0].shape == (1,)
    assert not p["layers.0.self_attn.f_a_proj.weight"].has_attr("shard")          # low rank: replicated
    # MLA: per-head slices; the latent projection (and so the latent cache) replicated
    assert p["layers.3.self_attn.kv_b_proj.weight"].types[0].shape == (32, 32)
    assert p["layers.3.self_attn.kv_a_proj_with_mqa.weight"].types[0].shape == (40, 64)
    assert not p["layers.3.self_attn.kv_a_proj_with_mqa.weight"].has_attr("shard")
    # experts: rank 1 of EP 2 holds experts 4..7; router replicated
    assert p["layers.1.block_sparse_moe.experts.w1"].attr("shard") == "ep:0:1/2"
    assert p["layers.1.block_sparse_moe.experts.w1"].types[0].shape == (4, 32, 32)
    assert p["layers.1.block_sparse_moe.gate.weight"].types[0].shape == (8, 64)
    moe = s.ops_named("moe")[0]
    assert (moe.attr("ep_rank"), moe.attr("ep_size"), moe.attr("num_shared_experts")) == (1, 2, 0)
    assert [op.attr("num_heads") for op in s.ops_named("kda")] == [1] * 6
    assert p["lm_head.weight"].types[0].shape == (128, 64)
    # the lowered IR keeps the collectives and round-trips through the printer/parser
    final = m.module
    groups = [op.attr("group") for op in final.ops_named("all_reduce")]
    # moe-lower spells the routed combine's EP all-reduce out as an op (one per MoE layer); before, it is inside moe
    assert groups.count("tp") == 0 and groups.count("ep") == (7 if "moe-lower" in m.pass_names else 0)
    assert len(final.ops_named("reduce_scatter")) == 16 and len(final.ops_named("all_gather")) == 1
    assert len(final.ops_named("seq_gather")) == 17 and final.ops_named("attn_res_phase1")   # attnres-split ran
    no_sp = k3c.compile(spec, target="cpu", passes=["shard"], tp=2, ep=2, rank=1, seq_parallel=False)
    assert no_sp.records[0].counts["all_reduce.tp"] == 16 and not no_sp.module.ops_named("seq_gather")
    assert parse_module(print_module(final)) == final
    assert 'all_reduce(%' in m.ir() and 'group = "tp"' in m.ir()


def test_layouts_and_groups():
    lay = make_layout(2, 4, 3)
    assert (lay.world, lay.tp_rank, lay.ep_rank) == (4, 1, 3)
    assert lay.group_ranks("tp") == [2, 3] and lay.group_ranks("ep") == [0, 1, 2, 3]
    assert make_layout(4, 2, 2).group_ranks("ep") == [2, 3]
    assert parse_shard("ep:0:3/4") == ("ep", 0, 3, 4) and parse_shard("tp:heads") is None


def test_ep_only_and_tp_only(spec):
    ep = k3c.compile(spec, target="cpu", passes=["shard"], tp=1, ep=2, rank=0).module
    assert not ep.ops_named("all_reduce") and all(o.attr("ep_size") == 2 for o in ep.ops_named("moe"))
    assert all(o.attr("num_shared_experts") == 2 for o in ep.ops_named("moe"))      # no TP: shared stay inside
    tp = k3c.compile(spec, target="cpu", passes=["shard"], tp=2, ep=1, rank=1).module
    assert all(not o.has_attr("ep_size") and o.attr("expert_tp") == 2 for o in tp.ops_named("moe"))
    # EP 1 splits every expert over TP (AMD's layout): w1 / w3 rows and w2 columns of the intermediate dim
    p = _params(tp)
    for role, shape, shard in (("w1", (8, 16, 32), "tp:1:1/2"), ("w3", (8, 16, 32), "tp:1:1/2"),
                               ("w2", (8, 32, 16), "tp:2:1/2")):
        w = p[f"layers.1.block_sparse_moe.experts.{role}"]
        assert w.types[0].shape == shape and w.attr("shard") == shard, role
    assert len(tp.ops_named("reduce_scatter")) == 16
    # the split experts see every token of the TP group (the gathered input the shared experts use too) and
    # their all-reduced output is scattered back: 7 MoE layers
    assert all(o.type.shape[1] == "T" for o in tp.ops_named("moe"))
    assert len(tp.ops_named("seq_scatter")) == 1 + 7 and len(tp.ops_named("seq_gather")) == 16 + 1
    lowered = k3c.compile(spec, target="cpu", tp=2, ep=1, rank=1).module
    assert [(o.attr("group"), o.attr("size")) for o in lowered.ops_named("all_reduce")] == [("tp", 2)] * 7
    # ep defaults to tp
    both = k3c.compile(spec, target="cpu", passes=["shard"], tp=2, rank=0).module
    assert all(o.attr("ep_size") == 2 for o in both.ops_named("moe"))


@pytest.mark.parametrize("kw, match", [
    ({"tp": 4, "ep": 1}, r"--tp 4: KDA num_heads 2 \(layer 0\) is not divisible by 4"),
    ({"tp": 1, "ep": 16}, r"--ep 16: num_experts 8 .* not divisible by 16"),
    ({"tp": 2, "ep": 3}, r"--tp 2 and --ep 3: one must divide the other"),
    ({"tp": 0}, r"--tp must be an integer >= 1"),
    ({"tp": 2, "rank": 2}, r"rank must be in \[0, 2\)"),
])
def test_bad_layouts_name_the_argument(spec, kw, match):
    with pytest.raises(ArgumentError, match=match):
        k3c.compile(spec, target="cpu", **kw)


def test_cli_bad_tp_exits_2(capsys, tmp_path):
    assert main(["compile", TINY, "--target", "cpu", "-o", str(tmp_path / "o"), "--tp", "4", "--ep", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tp 4" in err and "Traceback" not in err and err.count("\n") == 1
    assert main(["run", TINY, "--tp", "2", "--ep", "3"]) == 2
    assert "--ep 3" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_run_sharded_on_gloo(capsys):
    """`k3c run --tp 2 --ep 2` end to end on 2 CPU ranks (torch ops): both ranks decode the same tokens (checked
    inside), the report names the layout; on a CPU no decode graph is attempted."""
    assert main(["run", TINY, "--tp", "2", "--ep", "2", "--no-kernels", "--prompt-len", "5", "--new-tokens", "3",
                 "--cuda-graphs"]) == 0
    out = capsys.readouterr().out
    assert "on 2 ranks (TP 2 x EP 2, gloo)" in out and "kernels off" in out and "decode graph" not in out
    assert "tokens[0]:" in out and "logits finite:   True" in out


def test_kimi_k3_tp8_ep8_shapes():
    m = k3c.compile(os.path.join(ROOT, "examples", "kimi-k3.yaml"), target="mi355x", passes=["shard"], tp=8,
                    rank=7)
    p = _params(m.module)
    w1 = p["layers.1.block_sparse_moe.experts.w1"]
    assert w1.types[0].shape == (112, 3072, 3584) and w1.attr("shard") == "ep:0:7/8"
    assert p["layers.0.self_attn.q_proj.weight"].types[0].shape == (12 * 128, 7168)
    assert m.records[0].counts["reduce_scatter.tp"] == 93 + 1 + 92


def test_rank_weights_slice_init_and_safetensors(spec, tmp_path):
    from k3c.runtime.checkpoint import save_k3_checkpoint

    full = k3c.init_weights(spec, seed=5)
    save_k3_checkpoint(spec, full, tmp_path)
    for tp, ep, rank in ((2, 2, 1), (1, 2, 0), (2, 1, 1)):
        m = k3c.compile(spec, target="cpu", passes=["shard"], tp=tp, ep=ep, rank=rank)
        sliced = shard_weights(m, full)
        random = init_sharded_weights(m, seed=5)
        loaded = load_sharded_weights(m, str(tmp_path))
        assert sliced.keys() == random.keys() == loaded.keys() == param_shards(m).keys()
        for k, t in sliced.items():
            assert torch.equal(t, random[k]) and torch.equal(t, loaded[k]), k
        e = sliced["layers.1.block_sparse_moe.experts.w2"]
        w2 = full["layers.1.block_sparse_moe.experts.w2"]
        # EP rank r of 2: experts 4r..4r+3; EP 1 (TP 2): every expert, intermediate columns 16r..16r+15
        assert torch.equal(e, w2[4 * rank:4 * rank + 4] if ep == 2 else w2[:, :, 16 * rank:16 * rank + 16])


def test_plan_reads_the_sharding(spec):
    from k3c.analysis import plan

    m = k3c.compile(spec, target="mi355x", tp=2, ep=2, rank=1)
    p = plan(m, "mi355x", context=256)
    assert (p.layout.tp, p.layout.ep) == (2, 2)
    full = plan(TINY, "mi355x", tp=2, context=256)
    assert p.weights.total_bytes == full.weights.total_bytes          # the whole model, whichever view
    w = p.weights.by_name
    # what the rank holds: half the experts (EP 2) and heads, the embedding and latent projections replicated
    assert w["layers.1.block_sparse_moe.experts.w1" if "layers.1.block_sparse_moe.experts.w1" in w
             else "layers.1.block_sparse_moe.experts.w1.weight_packed"].gpu_fraction == 0.5
    assert w["layers.0.self_attn.q_proj.weight"].gpu_fraction == 0.5
    assert w["embed_tokens.weight"].gpu_fraction == 1.0 and w["lm_head.weight"].gpu_fraction == 0.5
    assert w["layers.1.block_sparse_moe.routed_expert_up_proj.weight"].gpu_fraction == 1.0
    assert p.memory.kda_state_bytes == full.memory.kda_state_bytes    # state of the rank's heads, same rule
    with pytest.raises(ArgumentError, match="--tp 4: this IR was sharded for TP 2 x EP 2"):
        plan(m, "mi355x", tp=4)
    assert main(["plan", TINY, "--target", "mi355x", "--tp", "2", "--sharded", "--json"]) == 0


def test_ep1_sharded_plan_splits_every_expert(spec):
    """TP 2 x EP 1 (AMD's layout): the rank's IR holds half of every expert, and the planner reads it as routed
    experts (not "router"), with the unsharded plan's per-GPU expert bytes and active parameters."""
    from k3c.analysis import plan

    sharded = plan(k3c.compile(spec, target="mi355x", tp=2, ep=1, rank=1), "mi355x", context=256).to_dict()
    whole = plan(TINY, "mi355x", tp=2, ep=1, context=256).to_dict()
    routed = sharded["weights_by_category"]["routed experts"]
    assert routed["gpu_bytes"] == whole["weights_by_category"]["routed experts"]["gpu_bytes"] == routed["bytes"] / 2
    assert sharded["params_active"] == whole["params_active"]
    assert sharded["weights_by_category"]["router"]["gpu_bytes"] == whole["weights_by_category"]["router"]["gpu_bytes"]


def test_sharded_plan_counts_experts_as_experts(spec):
    """A rank's IR at EP 1 holds a slice of every expert: the cost model still charges n x top_k / TP expert rows,
    as at EP 2, not a dense linear over every expert (which made TP 2 x EP 1 look 6x slower than TP 1)."""
    from k3c.analysis import plan

    kw = dict(context=64, batch=2, prefill_chunk=64)
    moe = {ep: plan(k3c.compile(spec, target="h200", tp=2, ep=ep, rank=0), "h200", **kw).to_dict()["phases"]
           for ep in (1, 2)}
    one = plan(TINY, "h200", **kw).to_dict()["phases"]
    for phase in ("prefill", "decode"):
        ep1, ep2 = (moe[ep][phase]["by_kind"]["moe"]["flops_per_token"] for ep in (1, 2))
        assert ep1 == ep2 < 0.75 * one[phase]["by_kind"]["moe"]["flops_per_token"]


def test_cli_compile_one_rank_artifact_round_trips(tmp_path):
    out = tmp_path / "rank1"
    assert main(["compile", TINY, "--target", "cpu", "--tp", "2", "--rank", "1", "-o", str(out)]) == 0
    loaded = k3c.load(out)
    assert loaded.module == k3c.compile(TINY, target="cpu", tp=2, rank=1).module
    shards = param_shards(loaded)                  # read from the saved IR after `shard`
    assert shards["layers.0.self_attn.o_proj.weight"] == (1, 1, 2) and shards["embed_tokens.weight"] is None
