import pytest

from k3c.errors import IRError
from k3c.ir import Op, check_module, parse_module, verify

from .helpers import EXAMPLES, example_module

BASE = """\
module @t {
  %ids = input() {name = "input_ids"} : i64[B, T]
  %we = param() {name = "embed_tokens.weight"} : bf16[16, 8]
  %e = embedding(%ids, %we) : bf16[B, T, 8] loc("t.yaml:2")
  %wn = param() {name = "norm.weight"} : bf16[8]
  %x = rmsnorm(%e, %wn) {eps = 1e-05} : bf16[B, T, 8] loc("t.yaml:3")
  %s = add(%e, %x) : bf16[B, T, 8] loc("t.yaml:4")
  %wh = param() {name = "lm_head.weight"} : bf16[16, 8]
  %logits = lm_head(%s, %wh) {tied = false} : bf16[B, T, 16] loc("t.yaml:5")
  return %logits
}
"""


def test_base_and_examples_verify():
    verify(parse_module(BASE))
    for name in EXAMPLES:
        assert check_module(example_module(name)) == []


# (old, new, op named in the error, fragment of the message)
TEXT_CASES = [
    ("%s = add(%e, %x)", "%s = add(%e, %y)", "%s = add", "undefined value %y"),
    ("%x = rmsnorm(%e, %wn)", "%x = rmsnorm(%s, %wn)", "%x = rmsnorm", "before its definition"),
    ("%s = add(%e, %x)", "%x = add(%e, %x)", "%x = add", "redefines %x"),
    ("%s = add(%e, %x)", "%s = mul(%e, %x)", "%s = mul", "unknown op 'mul'"),
    ("%s = add(%e, %x)", "%s = add(%e)", "%s = add", "expects 2 inputs (lhs, rhs), got 1"),
    ("{eps = 1e-05}", "", "%x = rmsnorm", "missing attribute 'eps'"),
    ("{eps = 1e-05}", "{eps = 1}", "%x = rmsnorm", "attribute 'eps': expected float"),
    ("{eps = 1e-05}", "{eps = 1e-05, bogus = 1}", "%x = rmsnorm", "unknown attribute 'bogus'"),
    ("bf16[8]\n", "bf16[9]\n", "%x = rmsnorm", "weight: expected shape [8]"),
    ("%s = add(%e, %x) : bf16[B, T, 8]", "%s = add(%e, %x) : f32[B, T, 8]", "%s = add",
     "declared type f32[B, T, 8] but 'add' infers bf16[B, T, 8]"),
    ("%s = add(%e, %x)", "%s = add(%e, %ids)", "%s = add", "rhs: expected bf16[B, T, 8]"),
    ('{name = "norm.weight"}', '{name = "norm.scale"}', "%x = rmsnorm",
     "input 'weight' is fed weight 'norm.scale'"),
    ("{tied = false}", "{tied = false, layer = true}", "%logits = lm_head", "attribute 'layer': expected int"),
    ("return %logits", "return %logits, %nothing", "return", "module output %nothing is not defined"),
    ("i64[B, T]", "q7[B, T]", "%ids = input", "unknown dtype 'q7'"),
]


@pytest.mark.parametrize("old, new, opname, fragment", TEXT_CASES)
def test_verifier_rejects(old, new, opname, fragment):
    assert old in BASE
    m = parse_module(BASE.replace(old, new, 1))
    with pytest.raises(IRError) as info:
        verify(m)
    assert info.value.op == opname
    assert fragment in info.value.message
    assert opname in str(info.value)


def test_dead_op_is_rejected_unless_allowed():
    text = BASE.replace("  return", '  %dead = add(%e, %e) : bf16[B, T, 8] loc("t.yaml:9")\n  return')
    m = parse_module(text)
    with pytest.raises(IRError, match="dead") as info:
        verify(m)
    assert info.value.op == "%dead = add" and info.value.loc == "t.yaml:9"
    verify(m, allow_dead=True)


def test_duplicate_param_with_other_type():
    text = BASE.replace("  return", '  %wn2 = param() {name = "norm.weight"} : bf16[9]\n'
                                    '  %y = add(%s, %s) : bf16[B, T, 8]\n  return')
    with pytest.raises(IRError, match="weight 'norm.weight' has type bf16\\[9\\] here"):
        verify(parse_module(text), allow_dead=True)


# ---- layer ops, on the real tiny model ---------------------------------------------------------------------
def _swap(module, old: Op, new: Op):
    return module.replace(ops=tuple(new if op is old else op for op in module.ops))


def _first(module, opname):
    return next(op for op in module.ops if op.op == opname)


def _rejects(module, op, fragment):
    with pytest.raises(IRError) as info:
        verify(module)
    assert info.value.op == op.describe() and info.value.loc == op.loc
    assert fragment in info.value.message, info.value.message
    return info.value


def test_kda_heads_times_head_dim_must_match_weights():
    m = example_module("k3-tiny.yaml")
    kda = _first(m, "kda")
    bad = kda.with_attrs(num_heads=4)
    err = _rejects(_swap(m, kda, bad), bad, "q_proj.weight: expected shape [64, 64], got bf16[32, 64]")
    assert "k3-tiny.yaml:12" in str(err)


def test_kda_weight_slots_are_checked_by_role():
    m = example_module("k3-tiny.yaml")
    kda = _first(m, "kda")
    inputs = list(kda.inputs)
    inputs[1], inputs[2] = inputs[2], inputs[1]        # k_proj fed into the q_proj slot
    bad = kda.replace(inputs=tuple(inputs))
    _rejects(_swap(m, kda, bad), bad, "input 'q_proj.weight' is fed weight 'layers.0.self_attn.k_proj.weight'")


def test_kda_output_gate_kind_changes_the_signature():
    m = example_module("k3-tiny.yaml")
    kda = _first(m, "kda")
    bad = kda.with_attrs(output_gate="low_rank")
    _rejects(_swap(m, kda, bad), bad, "expects 16 inputs")


def test_moe_top_k_at_most_experts():
    m = example_module("k3-tiny.yaml")
    moe = _first(m, "moe")
    bad = moe.with_attrs(top_k=9)
    _rejects(_swap(m, moe, bad), bad, "top_k 9 exceeds num_experts 8")


def test_mla_gate_choice_and_rank():
    m = example_module("k3-tiny.yaml")
    mla = _first(m, "mla")
    bad = mla.with_attrs(q_lora_rank=16)
    _rejects(_swap(m, mla, bad), bad, "q_a_proj.weight: expected shape [16, 64]")
    bad = mla.with_attrs(rope="yarn")
    _rejects(_swap(m, mla, bad), bad, "attribute 'rope': expected one of 'none'")


def test_attn_res_mix_needs_a_source():
    m = example_module("k3-tiny.yaml")
    mix = _first(m, "attn_res_mix")
    bad = mix.replace(inputs=mix.inputs[-2:], attrs={**mix.attr_dict, "num_sources": 0, "block": 0})
    _rejects(_swap(m, mix, bad), bad, "needs >= 1 source")


def test_attn_res_mix_sources_must_agree():
    m = example_module("k3-tiny.yaml")
    mix = _first(m, "attn_res_mix")
    bad = mix.replace(inputs=(mix.inputs[0], "input_ids") + mix.inputs[2:])
    _rejects(_swap(m, mix, bad), bad, "source.1: expected bf16[B, T, 64]")


def test_check_module_lists_every_problem():
    m = example_module("k3-tiny.yaml")
    kda, moe = _first(m, "kda"), _first(m, "moe")
    broken = _swap(_swap(m, kda, kda.with_attrs(head_dim=8)), moe, moe.with_attrs(top_k=100))
    problems = check_module(broken)
    assert [p.op for p in problems] == [kda.describe(), moe.describe()]
