"""The compile target travels (issue 18): api.compile -> run_pipeline -> every PassContext -> kda-chunk's plan,
the dump header, and `k3c run --device` -> the compile target."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import k3c
from k3c.codegen.kernels import kda as kda_kernels
from k3c.codegen.targets import DEFAULT_TARGET, get_target
from k3c.errors import ArgumentError
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import parse_file
from k3c.passes import kda_chunk as kda_chunk_pass
from k3c.passes import run_pipeline
from k3c.passes.registry import _PASSES, PassContext, register_pass

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "k3-tiny.yaml"


@pytest.fixture(scope="module")
def tiny_spec():
    spec = k3c.load_spec(TINY)
    return spec.replace(layer_kinds=spec.layer_kinds[:4])      # kda x 3 + mla: enough, and quick


@pytest.fixture
def spy_passes():
    before = dict(_PASSES)
    seen: list = []

    @register_pass("spy-target-a")
    def _a(module, ctx):
        seen.append(("a", ctx.target, ctx.plan_target))
        return module

    @register_pass("spy-target-b")
    def _b(module, ctx):
        seen.append(("b", ctx.target, ctx.plan_target))
        return module

    yield seen
    _PASSES.clear()
    _PASSES.update(before)


def test_every_pass_context_gets_the_target(spy_passes, tiny):
    h200 = get_target("h200")
    run_pipeline(tiny, ["spy-target-a", "spy-target-b"], target=h200)
    assert [(n, t) for n, t, _ in spy_passes] == [("a", h200), ("b", h200)]
    assert all(p is h200 for *_, p in spy_passes)
    spy_passes.clear()
    run_pipeline(tiny, ["spy-target-a"], target="mi300x")             # a name is looked up
    assert spy_passes[0][1] is get_target("mi300x")
    spy_passes.clear()
    run_pipeline(tiny, ["spy-target-b"])                              # None: the default compile target
    assert spy_passes == [("b", None, get_target(DEFAULT_TARGET))]
    with pytest.raises(ArgumentError, match="unknown target 'h300'"):
        run_pipeline(tiny, ["spy-target-a"], target="h300")


def test_pass_context_default():
    assert PassContext("x").target is None and PassContext("x").plan_target is get_target("mi355x")
    assert PassContext("x", get_target("b200")).plan_target is get_target("b200")


def test_api_compile_gives_the_target_to_the_passes(spy_passes, tiny_spec):
    model = k3c.compile(tiny_spec, target="b200", passes=["spy-target-a"])
    assert model.target is get_target("b200") and spy_passes[0][1] is get_target("b200")
    custom = dataclasses.replace(get_target("h200"), name="h200_custom")   # a Target object travels as it is
    spy_passes.clear()
    k3c.compile(tiny_spec, target=custom, passes=["spy-target-b"])
    assert spy_passes[0][1] is custom


def _attn_plans(module):
    return [(op.attr("chunk"), op.attr("block_v"), op.attr("dot")) for op in module.ops if op.op == "kda_attn"]


def test_kda_chunk_plans_for_the_compile_target(tiny_spec, monkeypatch):
    """kda_plan's IR-visible fields (chunk, block_v, dot) are equal on every table row today, so a plan rule that
    does depend on the target stands in for it: the IR must follow the target k3c.compile was given (before issue
    18 every compile planned for mi355x)."""
    real = kda_kernels.kda_plan
    asked: list[str] = []

    def by_target(head_dim, dtype, target, **kw):
        asked.append(target.name)
        plan = real(head_dim, dtype, target, **kw)
        return dataclasses.replace(plan, chunk=32 if target.backend == "cuda" else 16,
                                   dot="tf32" if target.backend == "cuda" else plan.dot)

    monkeypatch.setattr(kda_chunk_pass, "kda_plan", by_target)
    h200 = k3c.compile(tiny_spec, target="h200", passes=["kda-chunk"]).module
    assert set(asked) == {"h200"}
    asked.clear()
    mi355x = k3c.compile(tiny_spec, target="mi355x", passes=["kda-chunk"]).module
    assert set(asked) == {"mi355x"}
    n_kda = sum(k == "kda" for k in tiny_spec.layer_kinds)
    assert _attn_plans(h200) == [(32, 16, "tf32")] * n_kda
    assert len(_attn_plans(mi355x)) == n_kda and all(c == 16 and d != "tf32" for c, _, d in _attn_plans(mi355x))
    assert _attn_plans(h200) != _attn_plans(mi355x)


def test_kda_chunk_real_plan_matches_the_target(tiny_spec, monkeypatch):
    """Unpatched: the recorded plan is kda_plan of the compile target (not of the module attr `target`, which is
    no longer read)."""
    module = spec_to_module(tiny_spec)
    module = module.replace(attrs={**module.attr_dict, "target": "cpu"})
    seen: list[tuple] = []
    real = kda_kernels.kda_plan

    def spy(head_dim, dtype, target, **kw):
        seen.append((head_dim, dtype, target.name))
        return real(head_dim, dtype, target, **kw)

    monkeypatch.setattr(kda_chunk_pass, "kda_plan", spy)
    out, _ = run_pipeline(module, ["kda-chunk"], target="mi300x")
    assert seen and {t for *_, t in seen} == {"mi300x"}
    attns = [op for op in out.ops if op.op == "kda_attn"]
    assert len(attns) == len(seen)
    for op, (head_dim, dtype, _) in zip(attns, seen):
        plan = real(head_dim, dtype, get_target("mi300x"))
        assert (op.attr("chunk"), op.attr("block_v"), op.attr("dot")) == (plan.chunk, plan.block_v, plan.dot)


def test_dump_header_names_the_target(tiny, tmp_path):
    run_pipeline(tiny, ["dce"], dump_dir=tmp_path / "a", target="h200")
    head = [ln for ln in (tmp_path / "a" / "000_frontend.k3c").read_text().splitlines() if ln.startswith("#")]
    assert head[:3] == ["# k3c IR dump 000: frontend (pipeline input)", "# pipeline: dce", "# target: h200"]
    assert parse_file(str(tmp_path / "a" / "000_frontend.k3c")) == tiny
    run_pipeline(tiny, ["dce"], dump_dir=tmp_path / "b")
    text = (tmp_path / "b" / "000_frontend.k3c").read_text()
    assert "# target: mi355x (default)" in text
    assert (tmp_path / "b" / "001_dce.k3c").read_text().startswith("# k3c IR dump 001: after pass 'dce'")


def test_run_compiles_for_the_device_target(monkeypatch):
    from k3c.runtime import devices as launch
    from k3c.commands import run as runner

    asked: list[str] = []

    def fake_target_for(device):
        asked.append(str(device))
        return get_target("h200")

    monkeypatch.setattr(launch, "target_for", fake_target_for)
    seen: list = []
    real_compile = k3c.api.compile
    monkeypatch.setattr(k3c.api, "compile", lambda spec, target="mi355x", **kw: seen.append(target) or
                        real_compile(spec, target=target, passes=["none"], **kw))
    model = runner._load_model(str(TINY), "cuda:1")
    assert asked == ["cuda:1"] and model.target is get_target("h200")
    model = runner._load_model(str(TINY), "cpu")
    assert asked == ["cuda:1"] and model.target is get_target("cpu")
    assert [getattr(t, "name", t) for t in seen] == ["h200", "cpu"]
