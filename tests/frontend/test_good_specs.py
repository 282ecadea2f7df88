"""Valid specs: the presets load to the published numbers, equivalent layer forms agree, defaults are as documented,
locations point at the right lines, and YAML conveniences (anchors, merge keys, CRLF, BOM, bytes) work."""
from __future__ import annotations

import re

import pytest

from k3c.errors import SpecError
from k3c.frontend import dump_spec_yaml, load_spec, parse_spec_text
from k3c.frontend.schema import SECTION_KEYS
from k3c.frontend.spec import DEFAULT_MXFP4_INCLUDE

from .conftest import EXAMPLES, PRESETS, REPO

K3_MLA_1BASED = [4 * i for i in range(1, 24)] + [93]


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_load_and_round_trip(preset):
    spec = load_spec(EXAMPLES / preset)
    assert spec.source == str(EXAMPLES / preset)
    text = dump_spec_yaml(spec)
    again = parse_spec_text(text, "dumped.yaml")
    assert again == spec
    assert dump_spec_yaml(again) == text


def test_kimi_k3_matches_k3_md_section_1():
    s = load_spec(EXAMPLES / "kimi-k3.yaml")
    assert s.name == "kimi-k3"
    assert (s.hidden_size, s.vocab_size, s.rms_norm_eps, s.max_context) == (7168, 163840, 1e-5, 1048576)
    assert s.tie_word_embeddings is False
    assert s.num_layers == 93
    mla = [i for i, k in enumerate(s.layer_kinds) if k == "mla"]
    assert [i + 1 for i in mla] == K3_MLA_1BASED
    assert len(mla) == 24 and s.layer_kinds.count("kda") == 69
    assert s.layer_kinds[91:] == ("mla", "mla")               # layers 92 and 93 (1-based) are both MLA

    k = s.kda
    assert (k.num_heads, k.head_dim, k.conv_kernel, k.gate, k.gate_lower_bound) == (96, 128, 4, "safe", -5.0)
    assert (k.gate_rank, k.forget_rank, k.output_gate, k.width) == (128, 128, "full_rank", 12288)

    m = s.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank) == (96, 1536, 512)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (128, 64, 128)
    assert (m.rope, m.output_gate, m.cache_width, m.qk_head_dim) == ("none", True, 576, 192)

    e = s.mlp.moe
    assert (e.num_experts, e.top_k, e.num_shared_experts, e.expert_intermediate_size) == (896, 16, 2, 3072)
    assert (e.latent_dim, e.latent_norm, e.shared_width) == (3584, True, 6144)
    assert (e.router_activation, e.router_bias, e.renormalize, e.routed_scaling_factor) == ("sigmoid", True, True,
                                                                                            1.0)
    assert s.mlp.dense_layers == (0,) and s.mlp.dense_intermediate_size == 33792
    assert not s.is_moe_layer(0) and all(s.is_moe_layer(i) for i in range(1, 93))
    a = s.mlp.activation
    assert (a.kind, a.situ_beta_gate, a.situ_beta_up) == ("situ", 4.0, 25.0)
    assert s.attn_res.block_size == 12
    w = s.precision.weights
    assert (w.format, w.include, w.exclude, w.scale_rule) == ("mxfp4", DEFAULT_MXFP4_INCLUDE, (), "floor")
    assert s.precision.activations == "mxfp8"


def test_kimi_linear_matches_k3_md():
    s = load_spec(EXAMPLES / "kimi-linear-48b.yaml")
    assert (s.hidden_size, s.num_layers, s.vocab_size) == (2304, 27, 163840)
    kda_1 = [i + 1 for i, k in enumerate(s.layer_kinds) if k == "kda"]
    assert kda_1 == [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]
    assert (s.kda.num_heads, s.kda.head_dim, s.kda.conv_kernel, s.kda.gate) == (32, 128, 4, "softplus")
    assert (s.kda.output_gate, s.kda.output_gate_rank) == ("low_rank", 128)
    assert (s.mla.num_heads, s.mla.q_lora_rank, s.mla.kv_lora_rank, s.mla.output_gate) == (32, None, 512, False)
    e = s.mlp.moe
    assert (e.num_experts, e.top_k, e.num_shared_experts, e.expert_intermediate_size) == (256, 8, 1, 1024)
    assert (e.latent_dim, e.latent_norm, e.routed_scaling_factor) == (None, False, 2.446)
    assert s.mlp.activation.kind == "swiglu" and s.mlp.dense_layers == (0,) and s.mlp.dense_intermediate_size == 9216
    assert s.attn_res is None
    assert s.precision.weights.format == "bf16" and s.precision.activations == "bf16"


def test_k3_tiny_has_every_feature():
    s = load_spec(EXAMPLES / "k3-tiny.yaml")
    assert s.layer_kinds == ("kda", "kda", "kda", "mla") * 2
    assert s.attn_res.block_size == 3 and s.num_layers % 3 != 0
    assert s.mlp.moe.latent_dim == 32 and s.mlp.activation.kind == "situ"
    assert s.precision.weights.format == "mxfp4" and s.precision.activations == "mxfp8"


# ---- equivalent forms of the layer list -------------------------------------------------------------------------
def _with_layers(text: str, layers_block: str) -> str:
    start = text.index("layers:\n")
    end = text.index("\nkda:")
    return text[:start] + layers_block.rstrip("\n") + text[end:]


TINY_FORMS = {
    "pattern": "layers:\n  count: 8\n  pattern: [kda, kda, kda, mla]\n",
    "kinds": "layers:\n  kinds: [kda, kda, kda, mla, kda, kda, kda, mla]\n",
    "kinds+count": "layers:\n  count: 8\n  kinds: [kda, kda, kda, mla, kda, kda, kda, mla]\n",
    "mla_layers": "layers:\n  count: 8\n  mla_layers: [3, 7]\n",
    "kda_layers": "layers:\n  count: 8\n  kda_layers: [0, 1, 2, 4, 5, 6]\n",
    "both": "layers:\n  count: 8\n  kda_layers: [6, 5, 4, 2, 1, 0]\n  mla_layers: [7, 3]\n",
    "mla_layers 1-based": "layers:\n  count: 8\n  index_base: 1\n  mla_layers: [4, 8]\n",
    "kda_layers 1-based": "layers:\n  count: 8\n  index_base: 1\n  kda_layers: [1, 2, 3, 5, 6, 7]\n",
    "block list": "layers:\n  count: 8\n  mla_layers:\n    - 3\n    - 7\n",
}


def test_layer_forms_agree(tiny_text):
    reference = parse_spec_text(tiny_text)
    for form, block in TINY_FORMS.items():
        spec = parse_spec_text(_with_layers(tiny_text, block), form)
        assert spec == reference, form


def test_kimi_k3_layer_forms_agree():
    text = (EXAMPLES / "kimi-k3.yaml").read_text()
    reference = load_spec(EXAMPLES / "kimi-k3.yaml")
    kinds = ["mla" if i + 1 in K3_MLA_1BASED else "kda" for i in range(93)]
    kda_1 = [i for i in range(1, 94) if i not in K3_MLA_1BASED]
    forms = {
        "kinds": f"layers:\n  kinds: [{', '.join(kinds)}]\n",
        "kda_layers 1-based": f"layers:\n  count: 93\n  index_base: 1\n  kda_layers: {kda_1}\n",
        "mla_layers 0-based": f"layers:\n  count: 93\n  mla_layers: {[i - 1 for i in K3_MLA_1BASED]}\n",
    }
    for form, block in forms.items():
        assert parse_spec_text(_with_layers(text, block), form) == reference, form
    # a 4-periodic pattern cannot express K3 (layer 93 is MLA too): it must differ exactly there
    pattern = parse_spec_text(_with_layers(text, "layers:\n  count: 93\n  pattern: [kda, kda, kda, mla]\n"))
    diff = [i for i in range(93) if pattern.layer_kinds[i] != reference.layer_kinds[i]]
    assert diff == [92]


def test_dense_layer_forms_agree(tiny_text):
    reference = parse_spec_text(tiny_text)
    for block in ("  dense_layers: [0]\n", "  dense_layers: [1]\n  index_base: 1\n"):
        text = tiny_text.replace("  first_k_dense: 1\n", block)
        assert parse_spec_text(text) == reference, block


@pytest.mark.parametrize("value", ["off", "false", "False", "null", "~"])      # `no` is a string in YAML 1.2
def test_attn_res_off_forms(tiny_text, value):
    text = tiny_text.replace("attn_res:\n  block_size: 3", f"attn_res: {value}")
    assert parse_spec_text(text).attn_res is None
    without = tiny_text.replace("attn_res:\n  block_size: 3\n", "")
    assert parse_spec_text(without) == parse_spec_text(text)


# ---- defaults ----------------------------------------------------------------------------------------------------
MINIMAL = """\
model: {hidden_size: 64, vocab_size: 256}
layers: {count: 4, pattern: [kda, mla]}
kda: {num_heads: 2, head_dim: 16}
mla: {num_heads: 2, kv_lora_rank: 32, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16}
mlp: {dense_intermediate_size: 128}
"""


def test_defaults():
    s = parse_spec_text(MINIMAL, "minimal.yaml")
    assert (s.name, s.rms_norm_eps, s.max_context, s.tie_word_embeddings) == ("model", 1e-5, 4096, False)
    k = s.kda
    assert (k.conv_kernel, k.gate, k.gate_lower_bound, k.gate_rank, k.output_gate, k.output_gate_rank) == (
        4, "safe", -5.0, None, "full_rank", None)
    assert k.forget_rank == 16 and k.out_gate_rank == 16          # None -> head_dim
    m = s.mla
    assert (m.q_lora_rank, m.rope, m.output_gate) == (None, "none", True)
    assert s.attn_res is None
    assert s.mlp.moe is None and s.mlp.dense_layers == (0, 1, 2, 3)    # no moe: every layer dense
    a = s.mlp.activation
    assert (a.kind, a.situ_beta_gate, a.situ_beta_up) == ("swiglu", 4.0, 25.0)
    w = s.precision.weights
    assert (w.format, w.include, w.exclude, w.scale_rule, s.precision.activations) == ("bf16", (), (), "floor",
                                                                                       "bf16")


def test_moe_defaults():
    s = parse_spec_text(MINIMAL.replace("mlp: {dense_intermediate_size: 128}",
                                        "mlp: {}\nmoe: {num_experts: 4, top_k: 2, expert_intermediate_size: 32}"))
    e = s.mlp.moe
    assert s.mlp.dense_layers == () and s.mlp.dense_intermediate_size == 0      # with moe: no dense layer
    assert (e.num_shared_experts, e.shared_intermediate_size, e.latent_dim, e.latent_norm) == (0, None, None, False)
    assert (e.router_activation, e.router_bias, e.renormalize, e.routed_scaling_factor) == ("sigmoid", True, True,
                                                                                            1.0)
    assert e.shared_width == 0


def test_mxfp4_default_include():
    s = parse_spec_text(MINIMAL + "precision: {weights: {format: mxfp4}}\n")
    assert s.precision.weights.include == DEFAULT_MXFP4_INCLUDE
    s = parse_spec_text(MINIMAL + "precision: {weights: {format: mxfp4, include: []}}\n")
    assert s.precision.weights.include == ()


def test_docs_cover_every_key():
    """docs/spec.md has a table per section listing exactly the keys the schema accepts."""
    doc = (REPO / "docs" / "spec.md").read_text()
    for section, keys in SECTION_KEYS.items():
        if not section:
            continue
        m = re.search(rf"^### `{re.escape(section)}`.*?\n(.*?)(?=^#)", doc, re.S | re.M)
        assert m, f"docs/spec.md has no '### `{section}`' heading"
        documented = re.findall(r"^\| `([a-z_]+)` \|", m.group(1), re.M)
        assert sorted(documented) == sorted(keys), section
    for key in SECTION_KEYS[""]:
        assert f"`{key}`" in doc


# ---- locations ----------------------------------------------------------------------------------------------------
def _line_of(text: str, section: str, key: str | None = None) -> int:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{section}:"))
    if key is None:
        return start + 1
    for i in range(start + 1, len(lines)):
        if lines[i] and not lines[i].startswith((" ", "#")):
            break
        if lines[i].strip().startswith(f"{key}:"):
            return i + 1
    raise AssertionError(f"{section}.{key} not in text")


@pytest.mark.parametrize("field", ["kda.num_heads", "mla.kv_lora_rank", "moe.latent_dim", "layers.mla_layers",
                                   "attn_res.block_size", "mlp.first_k_dense", "model.hidden_size",
                                   "precision.weights.format", "precision.activations"])
def test_loc_points_at_the_key(field):
    path = EXAMPLES / "kimi-k3.yaml"
    text = path.read_text()
    spec = load_spec(path)
    parts = field.split(".")
    if parts[0] == "precision" and parts[1] == "weights":
        want = _line_of(text, "precision", parts[2])
    else:
        want = _line_of(text, parts[0], parts[1])
    assert spec.loc(field) == f"{path}:{want}"


def test_loc_fallbacks():
    path = EXAMPLES / "k3-tiny.yaml"
    text = path.read_text()
    spec = load_spec(path)
    assert spec.loc("kda") == f"{path}:{_line_of(text, 'kda')}"
    assert spec.loc("kda.no_such_field") == spec.loc("kda")
    # a defaulted field is not in the file: it points at its section
    assert spec.loc("model.tie_word_embeddings") == f"{path}:{_line_of(text, 'model')}"
    assert spec.loc("nothing.at.all") == str(path)
    assert spec.loc("name") == f"{path}:{_line_of(text, 'name')}"


def test_locations_not_part_of_equality(tiny_text):
    a = parse_spec_text(tiny_text, "a.yaml")
    b = parse_spec_text("\n\n# shifted\n" + tiny_text, "b.yaml")
    assert a == b and a.loc("kda.num_heads") != b.loc("kda.num_heads")
    assert b.loc("kda.num_heads") == f"b.yaml:{int(a.loc('kda.num_heads').split(':')[1]) + 3}"


# ---- YAML conveniences ---------------------------------------------------------------------------------------------
def test_crlf_bom_and_bytes(tiny_text):
    reference = parse_spec_text(tiny_text)
    crlf = tiny_text.replace("\n", "\r\n")
    assert parse_spec_text(crlf) == reference
    assert parse_spec_text("\ufeff" + tiny_text) == reference
    assert parse_spec_text(tiny_text.encode()) == reference
    assert parse_spec_text(b"\xef\xbb\xbf" + crlf.encode()) == reference


def test_anchor_and_merge_keys(tiny_text):
    reference = parse_spec_text(tiny_text)
    text = tiny_text.replace("kda:\n  num_heads: 2\n  head_dim: 16\n",
                             "kda:\n  <<: &heads {num_heads: 2, head_dim: 99}\n  head_dim: 16\n")
    spec = parse_spec_text(text)
    assert spec == reference                                      # the explicit head_dim overrides the merged one
    # merged keys keep the line of their anchor
    assert spec.loc("kda.num_heads").endswith(f":{_line_of(text, 'kda') + 1}")
    # several sources: the earlier one wins, as in YAML 1.1
    text2 = tiny_text.replace("mla:\n  num_heads: 2\n",
                              "mla:\n  <<: [{num_heads: 2}, {num_heads: 7, rope: none}]\n")
    assert parse_spec_text(text2) == reference
    # an explicit key written twice is still an error, merge or not
    with pytest.raises(SpecError, match="duplicate key 'head_dim'"):
        parse_spec_text(text.replace("  head_dim: 16\n", "  head_dim: 16\n  head_dim: 16\n"))


def test_plain_alias(tiny_text):
    text = tiny_text.replace("  num_heads: 2\n  head_dim: 16", "  num_heads: &h 2\n  head_dim: 16").replace(
        "mla:\n  num_heads: 2", "mla:\n  num_heads: *h")
    assert parse_spec_text(text) == parse_spec_text(tiny_text)


def test_the_largest_legal_layer_list_loads_within_the_node_limit(monkeypatch):
    from k3c.frontend import yaml_loader

    composed = [0]
    original = yaml_loader._LocatingSafeLoader.compose_node
    monkeypatch.setattr(yaml_loader._LocatingSafeLoader, "compose_node",
                        lambda self, parent, index: composed.__setitem__(0, composed[0] + 1)
                        or original(self, parent, index))
    kinds = "\n".join("    - " + ("mla" if i % 4 == 3 else "kda") for i in range(4096))
    text = MINIMAL.replace("layers: {count: 4, pattern: [kda, mla]}", "layers:\n  kinds:\n" + kinds)
    spec = parse_spec_text(text)
    assert spec.num_layers == 4096
    assert 4096 < composed[0] < yaml_loader.MAX_NODES // 2       # headroom under the hostile-input bound
