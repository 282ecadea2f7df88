"""`k3c plan --sharded` weight bytes per rank against what a sharded model really allocates per rank.

For each layout and rank: the plan of that rank's IR (`plan(k3c.compile(spec, tp=, ep=, rank=))`) against the
tensors the rank's Session holds (its fx graph's buffers: the rank's slices from `init_sharded_weights`, prepared
by weight_prep, plus the weight-transform results computed at load). Per param and in total, exactly: the params
that only weight transforms read (kv_b_proj before its mla_kvb_split, the AttnRes queries before
attn_res_fold_queries) are freed after load by both (the graph keeps no buffer no call reads).
"""
import pytest
import torch

import k3c
from k3c.analysis import plan
from k3c.runtime.distributed import init_sharded_weights

from .conftest import TINY

# k3-tiny with the mxfp4 pass on (a `quantization:` section) and experts wide enough that a TP 2 split of the
# down projection's reduction dim (64 / 2) is still a multiple of the MXFP4 block of 32
TINY_MXFP4 = (open(TINY).read().replace("expert_intermediate_size: 32", "expert_intermediate_size: 64")
              + "quantization:\n  format: mxfp4\n  rule: floor\n")

# (TP, EP): split experts (every expert's intermediate dim over TP), both split, experts only, TP < EP (4 ranks,
# two attention replicas), and one process
LAYOUTS = [(2, 1), (2, 2), (1, 2), (2, 4), (1, 1)]


def _buffer(name: str) -> str:
    from k3c.runtime.executor import _buffer_name

    return _buffer_name(name)


def _held(spec, tp, ep, rank):
    """(the rank's compiled model, {buffer name: bytes} its session holds)."""
    m = (k3c.compile(spec, target="mi355x", tp=tp, ep=ep, rank=rank) if max(tp, ep) > 1
         else k3c.compile(spec, target="mi355x"))
    sess = m.session(init_sharded_weights(m, seed=0, dtype=torch.bfloat16), device="cpu", use_kernels=False)
    return m, {n: b.numel() * b.element_size() for n, b in sess.graph.named_buffers()}


@pytest.fixture(scope="module")
def spec_mxfp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "k3-tiny-mxfp4.yaml"
    path.write_text(TINY_MXFP4)
    return k3c.load_spec(str(path))


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=[f"tp{t}xep{e}" for t, e in LAYOUTS])
def test_sharded_plan_equals_what_each_rank_allocates(spec_mxfp4, tp, ep):
    sizes = set()
    for rank in range(max(tp, ep)):
        m, held = _held(spec_mxfp4, tp, ep, rank)
        w = plan(m, "mi355x", context=256).weights
        assert m.module.attr("tp", 1) == tp and m.module.attr("ep", 1) == ep or max(tp, ep) == 1
        # every resident param, by name: the plan's per-GPU share is the rank's tensor, byte for byte; the dropped
        # ones (read only by weight transforms) are not held at all
        dropped = set(w.dropped)
        assert dropped and not any(_buffer(n) in held for n in dropped)
        for p in w.params:
            if p.name not in dropped:
                assert p.gpu_bytes == held[_buffer(p.name)], (rank, p.name)
        params = {_buffer(p.name) for p in w.params if p.name not in dropped}
        derived = sum(b for n, b in held.items() if n not in params)
        assert all(n.startswith("w_derived_") for n in held if n not in params)
        assert derived == sum(d["gpu_bytes"] for d in w.derived) > 0, rank
        assert sum(held.values()) == w.gpu_bytes, rank
        sizes.add(w.gpu_bytes)
    assert len(sizes) == 1          # k3-tiny divides evenly: every rank holds as much


def test_split_experts_hold_a_slice_of_every_expert(spec_mxfp4):
    """TP 2 x EP 1 and TP 2 x EP 2 hold the same expert bytes (half of every expert, or half of the experts), half
    of one process's; the plan's routed-expert line says so for both."""
    per = {}
    for tp, ep in ((2, 1), (2, 2), (1, 1)):
        m, held = _held(spec_mxfp4, tp, ep, 0)
        per[(tp, ep)] = sum(b for n, b in held.items() if "_block_sparse_moe_experts_w" in n)
        routed = plan(m, "mi355x", context=256).weights.by_category["routed experts"]["gpu_bytes"]
        assert routed == per[(tp, ep)]
    assert per[(2, 1)] == per[(2, 2)] == per[(1, 1)] / 2


def test_declared_precision_without_quantization_is_the_documented_difference():
    """k3-tiny declares MXFP4 experts (`precision:`) without a `quantization:` section: the planner counts the
    experts at 4.25 bits as deployed, the compiled graph holds them bf16. The difference is exactly that."""
    m, held = _held(k3c.load_spec(TINY), 2, 1, 0)
    w = plan(m, "mi355x", context=256).weights
    experts = [p for p in w.params if p.category == "routed experts"]
    assert experts and all(p.precision == "mxfp4" for p in experts)
    bf16 = sum(p.gpu_numel * 2 for p in experts)
    assert sum(held.values()) == w.gpu_bytes - sum(p.gpu_bytes for p in experts) + bf16
