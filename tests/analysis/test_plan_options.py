"""`k3c plan` options of issue 25, by hand on k3-tiny: KDA prefix checkpoints (--prefix-interval), AttnRes blocks
without sequence parallel (--no-seq-parallel, planner rules and a rank's IR), the hybrid-vs-full-attention KV
throughput (--compare-full-attention), and their bad arguments (exit 2, one line naming the option)."""
import json
import math

import pytest

import k3c
from k3c.analysis import plan
from k3c.analysis.hybrid import full_attention_spec
from k3c.cli import main
from k3c.errors import ArgumentError

from .conftest import TINY

# k3-tiny: 6 KDA layers (2 heads x 16, conv 4, q/k/v 32 channels each), 2 MLA layers (kv_lora 32 + rope 8), vocab 256
KDA_LAYERS, MLA_LAYERS, HEADS, D, VOCAB = 6, 2, 2, 16, 256


def _state(tp):                 # fp32 state of this rank's heads, conv tails of its channels (bf16), per sequence
    return KDA_LAYERS * (HEADS // tp) * D * D * 4, KDA_LAYERS * 3 * (HEADS // tp) * D * 3 * 2


@pytest.mark.parametrize("tp", [1, 2])
def test_prefix_checkpoints_by_hand(tp):
    state, conv = _state(tp)
    logits = VOCAB * 2                        # the lm_head result is bf16, the whole vocab on every rank
    p = plan(TINY, "mi355x", tp=tp, context=4096, batch=3, prefix_interval=1000)
    mem = p.memory
    assert mem.checkpoints == 5 == math.ceil(4096 / 1000)
    assert mem.kda_checkpoint_bytes == 3 * 5 * (state + conv + logits)
    off = plan(TINY, "mi355x", tp=tp, context=4096, batch=3)
    assert off.memory.kda_checkpoint_bytes == 0 and off.memory.checkpoints == 0
    assert mem.total_bytes == off.memory.total_bytes + mem.kda_checkpoint_bytes
    # an interval boundary at the prompt end is one checkpoint, not two
    assert plan(TINY, "mi355x", tp=tp, context=4000, prefix_interval=1000).memory.checkpoints == 4
    d = p.to_dict()
    assert d["per_gpu"]["kda_checkpoint_bytes"] == mem.kda_checkpoint_bytes and d["prefix_interval"] == 1000
    assert "KDA prefix checkpoints" in p.text() and "5 checkpoints" in p.text()


def test_checkpoints_shrink_what_fits():
    base = plan(TINY, "mi355x", tp=1, context=4096)
    tight = plan(TINY, "mi355x", tp=1, context=4096, prefix_interval=64)
    assert tight.fit["max_batch_at_context"] < base.fit["max_batch_at_context"]


def test_attnres_blocks_without_sequence_parallel_by_hand():
    blocks, d = None, 64
    sp = plan(TINY, "mi355x", tp=2, context=4096, prefill_chunk=1000)
    whole = plan(TINY, "mi355x", tp=2, context=4096, prefill_chunk=1000, seq_parallel=False)
    blocks = sp.facts.attnres_blocks
    assert blocks >= 2
    assert sp.memory.attnres_bytes == blocks * 500 * d * 2
    assert whole.memory.attnres_bytes == blocks * 1000 * d * 2
    assert "not sequence-sharded" in whole.text() and whole.to_dict()["seq_parallel"] is False
    # every rank computes every mix: twice the AttnRes work of the sequence-parallel plan
    a, b = (x.to_dict()["phases"]["prefill"]["by_kind"]["attn_res"]["flops"] for x in (sp, whole))
    assert b == pytest.approx(2 * a)


def test_no_seq_parallel_on_a_rank_ir():
    """--sharded --no-seq-parallel plans the shard pass's seq_parallel=False IR; a rank IR of the other kind is
    refused with a line naming the option."""
    spec = k3c.load_spec(TINY)
    on = plan(TINY, "mi355x", tp=2, context=4096, sharded=True)
    off = plan(TINY, "mi355x", tp=2, context=4096, sharded=True, seq_parallel=False)
    assert off.memory.attnres_bytes == 2 * on.memory.attnres_bytes
    m = k3c.compile(spec, target="mi355x", tp=2, rank=0, seq_parallel=False)
    assert plan(m, "mi355x", context=4096).memory.attnres_bytes == off.memory.attnres_bytes
    with pytest.raises(ArgumentError, match="--seq-parallel: this IR was sharded with sequence parallel off"):
        plan(m, "mi355x", context=4096, seq_parallel=True)


def test_full_attention_kv_throughput_by_hand():
    spec = k3c.load_spec(TINY)
    p = plan(spec, "mi355x", context=4096, compare_full_attention=True)
    state, conv = (KDA_LAYERS * HEADS * D * D * 4, KDA_LAYERS * 3 * HEADS * D * 3 * 2)   # one whole copy
    variant = full_attention_spec(spec)
    assert variant.layer_kinds == ("mla",) * 8 and variant.kda is None
    for row in p.full_attention:
        L = row["context"]
        h, f = row["hybrid"], row["full_attention"]
        assert h["cache_bytes"] == L * MLA_LAYERS * 40 * 2 + state + conv        # bf16 latent, 40 values a token
        assert f["cache_bytes"] == L * (MLA_LAYERS + KDA_LAYERS) * 40 * 2        # no fixed state at all
        assert h["bytes_per_s"] == h["cache_bytes"] / h["prefill_seconds"]
        assert f["bytes_per_s"] == f["cache_bytes"] / f["prefill_seconds"]
        assert row["kv_throughput_ratio"] == pytest.approx(
            (f["cache_bytes"] / f["prefill_seconds"]) / (h["cache_bytes"] / h["prefill_seconds"]))
    # the full model's prefill time is its own plan's prefill (batch 1, same chunk)
    alone = plan(variant, "mi355x", context=8192)
    assert len(alone.facts.kda) == 0 and len(alone.facts.mla) == 8
    assert p.full_attention[0]["full_attention"]["prefill_seconds"] == alone.phases[0].total_seconds
    assert "against full attention: k3-tiny-full-attention" in p.text()
    assert json.loads(json.dumps(p.to_dict()))["full_attention"][0]["context"] == 8192


def test_full_attention_needs_a_hybrid_spec(tiny_model):
    spec = k3c.load_spec(TINY)
    with pytest.raises(ArgumentError, match="already full attention"):
        full_attention_spec(full_attention_spec(spec))
    with pytest.raises(ArgumentError, match="--compare-full-attention needs a spec"):
        plan(tiny_model.module, "mi355x", compare_full_attention=True)
    assert plan(tiny_model, "mi355x", context=512, compare_full_attention=True).full_attention


@pytest.mark.parametrize("args,needle", [
    (["--prefix-interval", "-1"], "--prefix-interval must be an integer in [0, "),
    (["--prefix-interval", "1e3"], "--prefix-interval must be an integer, got '1e3'"),
    (["--no-seq-parallel=1"], "--no-seq-parallel"),
])
def test_cli_bad_options_exit_2(capsys, args, needle):
    assert main(["plan", TINY, "--target", "mi355x", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_options_print(capsys):
    assert main(["plan", TINY, "--target", "b300", "--tp", "2", "--prefix-interval", "1024", "--no-seq-parallel",
                 "--compare-full-attention", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "on b300 (cuda sm_103)" in out and "ceil(4,096/1,024) = 4 checkpoints" in out
    assert "(not sequence-sharded)" in out and "against full attention" in out
    assert main(["plan", TINY, "--target", "mi355x", "--tp", "2", "--sharded", "--no-seq-parallel", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_parallel"] is False


def test_plan_api_bad_values():
    with pytest.raises(ArgumentError, match="--prefix-interval must be an integer >= 0"):
        plan(TINY, "mi355x", prefix_interval=-5)
    with pytest.raises(ArgumentError, match="seq_parallel must be True, False or None"):
        plan(TINY, "mi355x", seq_parallel="no")
