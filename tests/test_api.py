"""The public API of DESIGN.md: compile, ir(after=), save/load, session == reference."""
import os

import pytest
import torch

import k3c
from k3c.errors import ArgumentError
from k3c.ir import parse_module, print_module
from numerics import rel

TINY = "examples/k3-tiny.yaml"


def test_compile_stages_and_ir_after(tiny):
    spec, model, _ = tiny
    from k3c.passes import resolve_passes

    assert model.pass_names == resolve_passes("default")
    for name in ("frontend", *model.pass_names):
        text = model.ir(after=name)
        assert parse_module(text) == model.module_after(name)
    assert model.ir() == print_module(model.module)
    with pytest.raises(ArgumentError, match="stages: frontend, .*dce, cse"):
        model.ir(after="no-such-pass")


def test_save_load_round_trip(tiny, tmp_path):
    spec, model, _ = tiny
    out = tmp_path / "art"
    model.save(out)
    files = set(os.listdir(out))
    assert {"manifest.json", "spec.yaml", "model.k3c", "report.md", "ir"} <= files
    back = k3c.load(out)
    assert back.spec == spec and back.module == model.module
    assert [n for n, _ in back.stages] == ["frontend", *model.pass_names]
    assert back.cache_key == model.cache_key
    # no temp dirs left beside it
    assert [p for p in os.listdir(tmp_path) if p.startswith(".k3c-tmp")] == []


def test_save_refuses_foreign_dir(tiny, tmp_path):
    _, model, _ = tiny
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(ArgumentError, match="not a k3c artifact"):
        model.save(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "precious"


def test_session_matches_reference_prefill_decode_append(tiny):
    spec, model, w = tiny
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (2, 37), generator=g)
    ref = k3c.reference_forward(spec, w, ids)
    sess = model.session(w)
    # prefill of the first 30, 2 decodes, then an append of 5 == one prefill of 37. fp32, other summation orders:
    # this random model's one-process fp32 logits are 1.9e-5 from its float64 ones (tests/dist/test_dist_logits.py),
    # so two fp32 orders may differ by up to twice that; measured 1.02e-5 for the prefill (torch 2.13 CPU, numpy
    # 2.4.6; the same at 21e7e21), well below it
    tol = 2e-5
    head = sess.prefill(ids[:, :30])
    assert rel(head, ref[:, :30]) <= tol
    for t in (30, 31):
        step = sess.decode(ids[:, t])
        assert rel(step, ref[:, t]) <= tol
    tail = sess.append(ids[:, 32:])
    assert rel(tail, ref[:, 32:]) <= tol
    assert sess.length == 37


def test_session_errors_leave_cache_untouched(tiny):
    spec, model, w = tiny
    sess = model.session(w, max_batch=2, max_context=40)
    ids = torch.randint(0, spec.vocab_size, (2, 35))
    sess.prefill(ids)
    before = sess.cache
    with pytest.raises(ArgumentError, match="exceed max_context"):
        sess.append(torch.randint(0, spec.vocab_size, (2, 6)))
    with pytest.raises(ArgumentError, match="token ids"):
        sess.decode(torch.tensor([0, spec.vocab_size]))
    with pytest.raises(ArgumentError, match="max_batch"):
        sess.prefill(torch.zeros(3, 4, dtype=torch.long))
    assert sess.cache is before and sess.length == 35


def test_generate_is_greedy(tiny):
    spec, model, w = tiny
    ids = torch.randint(0, spec.vocab_size, (1, 9))
    out = model.session(w).generate(ids, max_new_tokens=3)
    seq = ids
    for i in range(3):
        nxt = k3c.reference_forward(spec, w, seq)[:, -1].argmax(-1)
        assert int(nxt) == int(out[0, i])
        seq = torch.cat([seq, nxt[:, None]], 1)


def test_fx_graph_code_is_readable(tiny):
    spec, model, w = tiny
    code = model.session(w).graph.code
    # one call per IR op, named after the IR value it defines
    compute = [op for op in model.module.ops if op.op not in ("input", "param")]
    for op in compute[:5] + compute[-5:]:
        assert f"{op.results[0]} = " in code or f"{op.results[0]}_ = " in code
    assert "def forward(self, input_ids, cache)" in code
