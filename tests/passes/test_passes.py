import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3c.errors import ArgumentError, IRError
from k3c.ir import Module, Op, TensorType, parse_file, parse_module, verify
from k3c.passes import (PIPELINES, available, register_pass, registered_passes, resolve_passes, run_pass,
                        run_pipeline)
from k3c.passes.registry import _PASSES

SMALL = """\
module @s {
  %x = input() {name = "x"} : bf16[B, 8]
  %w = param() {name = "norm.weight"} : bf16[8] loc("s.yaml:1")
  %w_again = param() {name = "norm.weight"} : bf16[8] loc("s.yaml:2")
  %a = rmsnorm(%x, %w) {eps = 1e-05} : bf16[B, 8]
  %b = rmsnorm(%x, %w_again) {eps = 1e-05} : bf16[B, 8]
  %c = add(%a, %b) : bf16[B, 8]
  %dead1 = add(%c, %c) : bf16[B, 8]
  %dead2 = add(%dead1, %a) : bf16[B, 8]
  %wd = param() {name = "unused.weight"} : bf16[8]
  return %c, %b
}
"""


@pytest.fixture
def scratch_passes():
    """Register throwaway passes for a test, then forget them."""
    before = dict(_PASSES)
    yield
    _PASSES.clear()
    _PASSES.update(before)


def test_registry_and_pipelines():
    assert {"dce", "cse"} <= set(registered_passes())
    assert PIPELINES["cleanup"] == ("cse", "dce")
    assert PIPELINES["default"][-2:] == ("dce", "cse")       # lowering passes come first, cleanup last
    assert resolve_passes("frontend,cleanup") == ["cse", "dce"]
    assert resolve_passes("frontend,default") == list(PIPELINES["default"])
    assert resolve_passes(["cse", "dce"]) == ["cse", "dce"]
    assert available()["pipelines"] == sorted(PIPELINES)


def test_bad_pipeline_and_pass_names(monkeypatch):
    monkeypatch.setitem(PIPELINES, "loop", ("dce", "loop"))
    with pytest.raises(ArgumentError, match="nests too deeply"):
        resolve_passes("loop")
    with pytest.raises(ValueError, match="invalid pass name"):
        register_pass("../evil")


def test_unknown_pass_lists_valid_names():
    with pytest.raises(ArgumentError) as info:
        resolve_passes("dce,mla-absorbb")
    msg = str(info.value)
    assert "unknown pass 'mla-absorbb'" in msg and "cse, dce" in msg and "default" in msg


def test_dce_counts_and_verifies():
    m = parse_module(SMALL)
    out, record = run_pass(m, "dce")
    assert record.changed and record.counts["removed_ops"] == 3
    assert record.counts["removed.add"] == 2 and record.counts["removed.param"] == 1
    assert [op.results[0] for op in out.ops] == ["x", "w", "w_again", "a", "b", "c"]
    verify(out)
    again, record = run_pass(out, "dce")
    assert again is out and not record.changed and record.counts["removed_ops"] == 0


def test_cse_merges_duplicate_params_then_ops():
    m, _ = run_pass(parse_module(SMALL), "dce")
    out, record = run_pass(m, "cse")
    assert record.counts == {"hits": 2, "hits.param": 1, "hits.rmsnorm": 1}
    assert [op.results[0] for op in out.ops] == ["x", "w", "a", "c"]
    assert out.defs["c"].inputs == ("a", "a") and out.outputs == ("c", "a")
    assert out.defs["w"].loc == "s.yaml:1"                    # the survivor keeps its own loc
    verify(out)


def test_cse_runs_clean_on_the_model(tiny):
    out, records = run_pipeline(tiny, ["dce", "cse"])
    assert out == tiny and [r.changed for r in records] == [False, False]
    assert records[1].counts == {"hits": 0}


def test_cse_on_a_model_with_duplicated_params(tiny):
    # declare every weight twice (the second copy feeds every use): CSE removes all the copies
    ops, rename = [], {}
    for op in tiny.ops:
        if op.op == "param":
            copy = op.replace(results=(op.results[0] + "_dup",))
            rename[op.results[0]] = copy.results[0]
            ops += [op, copy]
        else:
            ops.append(op.replace(inputs=tuple(rename.get(v, v) for v in op.inputs)))
    dup = tiny.replace(ops=tuple(ops))
    out, records = run_pipeline(dup, ["cse", "dce"])
    n = len(tiny.params())
    assert records[0].counts["hits.param"] == n and records[1].counts["removed_ops"] == 0
    assert len(out.ops) == len(tiny.ops)
    verify(out)


def test_dumps_have_headers_and_parse_back(tmp_path):
    m = parse_module(SMALL)
    out, records = run_pipeline(m, ["dce", "cse"], dump_dir=tmp_path / "dumps")
    files = sorted(os.listdir(tmp_path / "dumps"))
    assert files == ["000_frontend.k3c", "001_dce.k3c", "002_cse.k3c"]
    assert parse_file(str(tmp_path / "dumps" / "000_frontend.k3c")) == m
    stage = m
    for record in records:
        text = open(record.dump).read()
        header = [line for line in text.splitlines() if line.startswith("#")]
        assert header[0] == f"# k3c IR dump {record.index:03d}: after pass '{record.name}'"
        assert header[1].startswith("# time: ") and header[2] == "# changed: yes"
        expected = {"dce": "removed.add=2, removed.param=1, removed_ops=3", "cse": "hits=2"}[record.name]
        assert header[3].startswith(f"# rewrites: {expected}")
        stage, _ = run_pass(stage, record.name)
        assert parse_file(record.dump) == stage
    assert stage == out


def test_pipeline_reports_the_pass_and_the_op_on_a_verifier_failure(scratch_passes, tmp_path):
    @register_pass("break-rmsnorm")
    def break_rmsnorm(module, ctx):
        ops = [op.with_attrs(eps=1) if op.op == "rmsnorm" else op for op in module.ops]
        return module.replace(ops=tuple(ops))

    with pytest.raises(IRError) as info:
        run_pipeline(parse_module(SMALL), ["dce", "break-rmsnorm"], dump_dir=tmp_path)
    err = info.value
    assert err.pass_name == "break-rmsnorm" and err.op == "%a = rmsnorm"
    assert str(err).startswith("after pass 'break-rmsnorm', op %a = rmsnorm: attribute 'eps'")
    assert os.path.exists(tmp_path / "002_break-rmsnorm.k3c")   # the broken IR is on disk to inspect


def test_pipeline_reports_the_op_a_crashing_pass_was_on(scratch_passes):
    @register_pass("crash")
    def crash(module, ctx):
        for op in ctx.walk(module.ops):
            if op.op == "add":
                raise ZeroDivisionError("boom")
        return module

    with pytest.raises(IRError) as info:
        run_pipeline(parse_module(SMALL), ["crash"])
    err = info.value
    assert err.pass_name == "crash" and err.op == "%c = add" and "ZeroDivisionError: boom" in err.message


def test_ensured_invariants_are_checked(scratch_passes):
    @register_pass("dup-param", ensures=("unique-params",))
    def dup(module, ctx):
        w = module.defs["w"]
        ops = list(module.ops)
        ops.insert(ops.index(w) + 1, w.replace(results=("w_copy",), loc="s.yaml:7"))
        ops.append(Op.make("z", "add", ["c", "c"], {}, TensorType("bf16", ("B", 8))))
        ops.append(Op.make("z2", "rmsnorm", ["z", "w_copy"], {"eps": 1e-5}, TensorType("bf16", ("B", 8))))
        return module.replace(ops=tuple(ops), outputs=("z2",))

    m, _ = run_pass(parse_module(SMALL), "dce")
    m, _ = run_pass(m, "cse")
    with pytest.raises(IRError, match="after pass 'dup-param', op %w_copy = param, at s.yaml:7: weight "
                                      "'norm.weight' is declared again"):
        run_pipeline(m, ["dup-param"])


def test_pass_must_return_a_module(scratch_passes):
    register_pass("nothing")(lambda module, ctx: None)
    with pytest.raises(IRError, match="returned NoneType"):
        run_pipeline(parse_module(SMALL), ["nothing"])


def test_bad_input_is_reported_against_the_frontend():
    with pytest.raises(IRError, match="after pass 'frontend', op %c = add"):
        run_pipeline(parse_module(SMALL.replace("add(%a, %b)", "add(%a, %x9)")), ["dce", "cse"])


# ---- hypothesis: CSE + DCE on random DAGs of adds over a few inputs ------------------------------------
T = TensorType("f32", ("N",))


@st.composite
def dags(draw):
    ops = [Op.make(f"i{k}", "input", [], {"name": f"in{k}"}, T) for k in range(3)]
    for k in range(draw(st.integers(1, 14))):
        names = [op.results[0] for op in ops]
        a, b = draw(st.sampled_from(names)), draw(st.sampled_from(names))
        ops.append(Op.make(f"v{k}", "add", [a, b], {}, T))
    outs = draw(st.lists(st.sampled_from([op.results[0] for op in ops[3:]]), min_size=1, max_size=3))
    return Module("dag", tuple(ops), tuple(outs))


def _value(module, env):
    vals = dict(env)
    for op in module.ops:
        vals[op.results[0]] = (env[op.attr("name")] if op.op == "input"
                               else vals[op.inputs[0]] + vals[op.inputs[1]])
    return tuple(vals[o] for o in module.outputs)


@settings(max_examples=60, deadline=None)
@given(dags())
def test_cleanup_preserves_meaning_and_reaches_a_fixpoint(m):
    out, records = run_pipeline(m, "cleanup")
    verify(out)
    env = {"in0": 3, "in1": 10, "in2": 1000}
    assert _value(out, env) == _value(m, env)
    again, _ = run_pipeline(out, "cleanup")
    assert again == out
    removed = records[0].counts["hits"] + records[1].counts["removed_ops"]
    assert len(out.ops) == len(m.ops) - removed
