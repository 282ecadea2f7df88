"""Engine decode through DecodeGraph (cuda_graphs=True), with the stand-in capture backend on the CPU: the same
logits as the engine's ordinary decode while requests join and leave (the batch's KDA rows move in and out of the
graphs' static slots, a departing sequence keeps its own copy), and every page comes back.

k3-tiny cut to its first 4 layers (3 KDA, 1 MLA: every kind of state a graph holds): every kernel runs in Triton's
interpreter, at about 60 ms a launch, and each of these engine runs is ~150 launches a step."""
from pathlib import Path

import pytest
import torch

import k3c
from k3c.frontend import parse_spec_text
from k3c.runtime.cuda_graph import EagerBackend
from k3c.runtime.engine import Engine
from numerics import rel

TINY = "examples/k3-tiny.yaml"


def four_layer_tiny():
    text = Path(TINY).read_text()
    assert text.count("count: 8\n") == 1
    return parse_spec_text(text.replace("count: 8\n", "count: 4\n"), TINY)


def run(model, w, graphs: bool, prompts, news, joins, max_graphs: int = 4, packed: bool = True):
    eng = Engine(model, w, device="cpu", max_batch=3, max_context=48, page_size=8, use_kernels=True,
                 cuda_graphs=graphs, graph_backend=EagerBackend() if graphs else None, max_graphs=max_graphs,
                 packed_steps=packed)
    return drive(eng, prompts, news, joins, 30)


def drive(eng, prompts, news, joins, max_steps: int):
    """Requests join at the steps `joins` names ({step: [request index]}) and run to the end; every page must come
    back. Returns (eng, per request: its outputs in order). Also used by test_engine_graphs_gpu.py."""
    rids, outs = {}, {}
    for step in range(max_steps):
        for i in joins.get(step, []):
            rids[i] = eng.add_request(prompts[i], news[i])
        for o in eng.step():
            outs.setdefault(o.rid, []).append(o)
        if step > max(joins) and not eng.has_work():
            break
    eng.pool.check_empty()
    return eng, [outs[rids[i]] for i in range(len(prompts))]


PROMPT_LENS, NEWS, JOINS = (11, 17, 9), (8, 3, 6), {0: [0], 3: [1], 6: [2]}
# the engine's calls (steps not packed): decode B=1 x3, prefill, B=2 x2, B=1 (request 1 left), prefill, B=2, B=1 x4


@pytest.fixture(scope="module")
def case():
    """The model, weights, prompts and the ordinary decode's outputs (shared by both parametrisations)."""
    spec = four_layer_tiny()
    model, w = k3c.compile(spec, target="h200"), k3c.init_weights(spec, seed=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, without = run(model, w, False, prompts, NEWS, JOINS, packed=False)
    finally:
        torch.set_num_threads(before)
    return model, w, prompts, without


@pytest.mark.slow
@pytest.mark.parametrize("max_graphs,created,gathers", [(4, 2, 2), (1, 2, 2)])
def test_graph_decode_equals_eager_decode_with_joins_and_leaves(one_thread, case, max_graphs, created, gathers):
    """A batch size gets its graph on its second decode step in a row: B=1, then B=2 (with one graph allowed, B=2
    drops B=1's graph, its KDA rows rehomed first); the batch's rows are gathered into a graph's slots when it
    outgrows them by a join (twice), a request left alone after its partner finished stays in its row of the B=2
    graph, beside a padding row (the scratch page, length 0), and the third request joins it in the free row: the
    same tokens and logits."""
    model, w, prompts, without = case
    eng, with_graphs = run(model, w, True, prompts, NEWS, JOINS, max_graphs, packed=False)
    assert eng.stats["padded_graph_rows"] == 5
    assert eng.stats["graph_slot_gathers"] == gathers and eng.stats["graph_slot_joins"] == 1
    assert eng.stats["decode_graph_calls"] > 0
    assert all(dg.report.mode == "graph" for dg in eng.graph_pool.graphs.values())
    assert len(eng.graph_pool.graphs) <= max_graphs
    assert eng.stats["decode_graphs_created"] == created
    assert eng.stats["decode_calls"] > eng.stats["decode_graph_calls"]    # each new size's first step is eager
    for a, b in zip(with_graphs, without):
        assert [o.token for o in a] == [o.token for o in b]
        assert rel(torch.stack([o.logits for o in a]), torch.stack([o.logits for o in b])) <= 1e-5


@pytest.mark.slow
def test_packed_steps_beside_graph_decode(one_thread, case):
    """Steps packed: a joining prompt's prefill and the decoding rows run in one eager call (the rows leave their
    graph slots for it, their new states are the packed call's, gathered back into a graph's slots by the next
    decode-only step): the tokens and logits of the ordinary decode."""
    model, w, prompts, without = case
    eng, got = run(model, w, True, prompts, NEWS, JOINS, packed=True)
    assert eng.stats["mixed_calls"] == 2 and eng.stats["prefill_calls"] == 1      # the first prompt ran alone
    assert eng.stats["decode_graph_calls"] > 0
    for a, b in zip(got, without):
        assert [o.token for o in a] == [o.token for o in b]
        assert rel(torch.stack([o.logits for o in a]), torch.stack([o.logits for o in b])) <= 1e-5


def test_graphs_off_by_default_and_skipped_without_capture():
    """Off by default on a CPU; there without a stand-in backend the DecodeGraph reports eager and the engine keeps its
    ordinary path (no graph calls)."""
    spec = k3c.load_spec(TINY)
    model, w = k3c.compile(spec, target="h200"), k3c.init_weights(spec, seed=0)
    eng = Engine(model, w, device="cpu", max_batch=2, max_context=32, page_size=8, use_kernels=False)
    assert eng.cuda_graphs is False         # default: on only where graphs can be captured (CUDA + kernels)
    with pytest.raises(k3c.errors.ArgumentError, match="max_graphs"):
        Engine(model, w, device="cpu", max_batch=2, max_context=32, page_size=8, max_graphs=0)
    eng = Engine(model, w, device="cpu", max_batch=2, max_context=32, page_size=8, use_kernels=False,
                 cuda_graphs=True)
    eng.add_request(list(range(1, 10)), 3)
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        while eng.has_work():
            eng.step()
    assert eng.stats["decode_graph_calls"] == 0 and eng.stats["decode_calls"] > 0


@pytest.mark.slow
def test_a_request_joining_takes_a_free_row_in_place(one_thread, case):
    """Steps not packed. Three requests start together and the first finishes early: the two left run on in rows 1
    and 2 of the B=3 graph's KDA slots beside a padding row (no copy of their states: the one gather is the batch's
    first graph step). Then a fourth takes the free row (a busy server): its states are copied into it, the others
    stay where they are. The tokens and logits of the ordinary decode throughout."""
    model, w, prompts, _ = case
    prompts = list(prompts) + [prompts[0][::-1]]
    news, joins = (4, 12, 12, 5), {0: [0, 1, 2], 6: [3]}
    _, without = run(model, w, False, prompts, news, joins, packed=False)
    eng, with_graphs = run(model, w, True, prompts, news, joins, packed=False)   # packed, the join's step would
    assert eng.stats["graph_slot_gathers"] == 1 and eng.stats["graph_slot_joins"] == 1   # be one eager call
    assert eng.stats["padded_graph_rows"] > 0 and set(eng.graph_pool.graphs) == {(3, 1)}
    for a, b in zip(with_graphs, without):
        assert [o.token for o in a] == [o.token for o in b]
        assert rel(torch.stack([o.logits for o in a]), torch.stack([o.logits for o in b])) <= 1e-5
