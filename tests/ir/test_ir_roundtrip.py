import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3c.frontend import load_spec
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import Module, Op, TensorType, parse_module, print_module

from .helpers import EXAMPLES, example_module


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_round_trip(name):
    m = example_module(name)
    text = print_module(m)
    assert parse_module(text) == m
    assert print_module(parse_module(text)) == text


def test_kimi_k3_prints_and_parses_fast():
    m = example_module("kimi-k3.yaml")
    assert sum(op.op == "param" for op in m.ops) > 2700
    start = time.process_time()              # CPU time: not inflated by other processes on a busy machine
    back = parse_module(print_module(m))
    assert time.process_time() - start < 2.0
    assert back == m


GOLDEN_HEAD = """\
module @k3-tiny attributes {activation_format = "mxfp8", attn_res_block_size = 3, dtype = "bf16", hidden_size = 64, \
layer_kinds = ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla"], max_context = 4096, mxfp4_exclude = [], \
mxfp4_include = ["layers.*.block_sparse_moe.experts.*"], mxfp4_scale_rule = "floor", num_layers = 8, \
rms_norm_eps = 1e-05, vocab_size = 256, weight_format = "mxfp4"} {
  %input_ids = input() {name = "input_ids"} : i64[B, T] loc("examples/k3-tiny.yaml:4")
  %w0 = param() {name = "embed_tokens.weight"} : bf16[256, 64] loc("examples/k3-tiny.yaml:6")
  %emb1 = embedding(%input_ids, %w0) : bf16[B, T, 64] loc("examples/k3-tiny.yaml:6")
  %w2 = param() {name = "layers.0.input_layernorm.weight"} : bf16[64] loc("examples/k3-tiny.yaml:7")
  %x3 = rmsnorm(%emb1, %w2) {eps = 1e-05, layer = 0} : bf16[B, T, 64] loc("examples/k3-tiny.yaml:7")
  %w4 = param() {name = "layers.0.self_attn.q_proj.weight"} : bf16[32, 64] loc("examples/k3-tiny.yaml:12")
"""
GOLDEN_KDA = (
    '  %a18 = kda(%x3, %w4, %w5, %w6, %w7, %w8, %w9, %w10, %w11, %w12, %w13, %w14, %w15, %w16, %w17) '
    '{conv_kernel = 4, gate = "safe", gate_lower_bound = -5.0, head_dim = 16, l2norm_eps = 1e-06, layer = 0, '
    'norm_eps = 1e-05, num_heads = 2, output_gate = "full_rank"} : bf16[B, T, 64] loc("examples/k3-tiny.yaml:12")')
GOLDEN_TAIL = """\
  %h290 = attn_res_mix(%emb1, %p106, %p216, %p287, %w288, %w289) {block = 3, eps = 1e-05, num_sources = 4, \
sublayer = "out"} : bf16[B, T, 64] loc("examples/k3-tiny.yaml:30")
  %w291 = param() {name = "norm.weight"} : bf16[64] loc("examples/k3-tiny.yaml:7")
  %x292 = rmsnorm(%h290, %w291) {eps = 1e-05} : bf16[B, T, 64] loc("examples/k3-tiny.yaml:7")
  %w293 = param() {name = "lm_head.weight"} : bf16[256, 64] loc("examples/k3-tiny.yaml:6")
  %logits = lm_head(%x292, %w293) {tied = false} : bf16[B, T, 256] loc("examples/k3-tiny.yaml:6")
  return %logits
}
"""


def test_printer_golden(in_root):
    text = print_module(spec_to_module(load_spec("examples/k3-tiny.yaml")))
    assert text.startswith(GOLDEN_HEAD)
    assert GOLDEN_KDA + "\n" in text
    assert text.endswith(GOLDEN_TAIL)


HAND_WRITTEN = r'''
# a comment before the module
module @hand.made-1 attributes {note = "a # inside a string", xs = [1, -2, 3]} {   # trailing comment

  %a, %b = split(%x) {axis = -1, none_attr = none, odd = "q\"uote\\ \n\t\u{e9}\u{1f600}"} : f32[4], f32[4]
  %x = source() : bf16[]
  %c = sink(%a, %b) {fl = [1.5, -inf, inf, nan, 1e+300, 5e-324, -0.0], flag = true, off = false, empty = []} : u8[2]
  %d = noattrs() : i64[N, 0, 3] loc("file with spaces.yaml:1")
  return %c, %d
}
# after the end
'''


def test_hand_written_text():
    m = parse_module(HAND_WRITTEN)
    assert m.name == "hand.made-1" and m.attr("xs") == (1, -2, 3) and m.attr("note") == "a # inside a string"
    split = m.ops[0]
    assert split.results == ("a", "b") and split.attr("axis") == -1 and split.attr("none_attr") is None
    assert split.attr("odd") == 'q"uote\\ \n\t\u00e9\U0001F600'
    fl = m.ops[2].attr("fl")
    assert fl[:3] == (1.5, -math.inf, math.inf) and math.isnan(fl[3]) and fl[4:6] == (1e300, 5e-324)
    assert math.copysign(1, fl[6]) == -1.0
    assert m.ops[2].attr("flag") is True and m.ops[2].attr("empty") == ()
    assert m.ops[3].types == (TensorType("i64", ("N", 0, 3)),) and m.ops[3].loc == "file with spaces.yaml:1"
    assert parse_module(print_module(m)) == m
    assert all(line.isascii() for line in print_module(m).splitlines())


# ---- hypothesis: arbitrary (not necessarily valid) modules round-trip ------------------------------------
LOWER, UPPER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789"


def _ident(first: str, rest: str, max_size: int = 8):
    # text strategies (from_regex is much slower); the patterns mirror k3c.ir.core's name rules
    return st.builds(lambda a, b: a + b, st.sampled_from(first), st.text(rest, max_size=max_size))


WORD = LOWER + UPPER + DIGITS + "_"
values = _ident(WORD, WORD + ".")
op_names = _ident(LOWER + UPPER + "_", WORD + ".")
keys = _ident(LOWER + UPPER + "_", WORD)
module_names = _ident(WORD, WORD + ".-")
dtypes = _ident(LOWER, LOWER + DIGITS, 5)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(), st.text(max_size=12))
attr_values = st.one_of(scalars, st.lists(scalars, max_size=4).map(tuple))
attrs = st.dictionaries(keys, attr_values, max_size=4)
dims = st.one_of(st.integers(0, 2 ** 40), keys)
types = st.builds(TensorType, dtypes, st.lists(dims, max_size=4).map(tuple))


@st.composite
def ops(draw):
    results = draw(st.lists(values, max_size=3, unique=True))
    return Op(tuple(results), draw(op_names), tuple(draw(st.lists(values, max_size=4))),
              draw(attrs), tuple(draw(types) for _ in results), draw(st.text(max_size=16)))


modules = st.builds(Module, module_names, st.lists(ops(), max_size=6).map(tuple),
                    st.lists(values, max_size=3).map(tuple), attrs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules)
def test_random_modules_round_trip(m):
    text = print_module(m)
    assert parse_module(text) == m
