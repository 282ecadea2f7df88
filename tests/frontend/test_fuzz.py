"""Hypothesis fuzz of the spec loader: anything in -> a ModelSpec or one-line SpecError out, nothing else.

(a) random text and bytes, plain and YAML-flavoured; (b) structured mutations of examples/k3-tiny.yaml (delete,
retype, rename, insert junk) -> a clean spec or a SpecError with a line and a field; (c) round trip of valid specs.
Bounded: fixed max_examples, small inputs, no example database written to the repo.
"""
from __future__ import annotations

import copy
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3c.errors import SpecError
from k3c.frontend import ModelSpec, dump_spec_yaml, parse_spec_text
from k3c.frontend.schema import SECTION_KEYS, spec_to_dict
from k3c.frontend.yaml_loader import SpecDumper

from .conftest import EXAMPLES



def fuzz(n: int):
    """Bounded and repeatable enough for CI: n examples, no deadline (CI machines vary), no database in the repo."""
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


FILE = "fuzz.yaml"
TINY = yaml.safe_load((EXAMPLES / "k3-tiny.yaml").read_text())


def _check(source) -> ModelSpec | SpecError:
    """parse_spec_text must return a ModelSpec or raise a one-line SpecError naming the file."""
    try:
        spec = parse_spec_text(source, FILE)
    except SpecError as err:
        text = str(err)
        assert text.splitlines() == [text] and text.isprintable(), repr(text)
        assert text.startswith(FILE) and err.file == FILE
        assert err.line is None or err.line >= 1
        return err
    assert isinstance(spec, ModelSpec)
    return spec


# ---- (a) random text and bytes -------------------------------------------------------------------------------------
YAML_TOKENS = st.sampled_from([
    "\n", "\n  ", "\n    ", " ", "\t", ": ", ":", "- ", "-", "[", "]", "{", "}", ",", "'", '"', "#", "&a ", "*a",
    "&b ", "*b", "<<: ", "? ", "!!", "!!python/object/apply:os.system ", "!!binary ", "!!set ", "!!int ", "!foo ",
    "|", ">", "---", "...", "%YAML 1.1\n", "~", "null", "true", "no", "0x1F", "0o17", "1_000", "1:30", ".inf",
    ".nan", "-4", "1e400", "1.0e+400", "2024-13-45", "9" * 30, "\\", "\\x", "\x85", "\u2028", "\ufeff", "\x00",
    "\x07", "é", "name", "model", "layers", "kda", "mla", "moe", "mlp", "attn_res", "precision", "hidden_size",
    "vocab_size", "count", "pattern", "kinds", "mla_layers", "index_base", "num_heads", "gate", "sfae", "64", "8",
])


@fuzz(200)
@given(st.text(max_size=300))
def test_random_text(text):
    _check(text)


@fuzz(200)
@given(st.binary(max_size=300))
def test_random_bytes(data):
    _check(data)


@fuzz(300)
@given(st.lists(YAML_TOKENS, max_size=60).map("".join))
def test_yaml_flavoured_text(text):
    _check(text)


@fuzz(150)
@given(st.lists(YAML_TOKENS, max_size=30).map("".join), st.integers(0, 10_000))
def test_tiny_with_injected_tokens(snippet, where):
    base = (EXAMPLES / "k3-tiny.yaml").read_text()
    at = where % (len(base) + 1)
    _check(base[:at] + snippet + base[at:])


# ---- (b) structured mutations of k3-tiny ---------------------------------------------------------------------------
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["kda", "mla", "safe", "softplus", "situ", "swiglu", "mxfp4", "bf16", "off", "low_rank",
                     "full_rank", "sigmoid", "softmax", "floor", "rceil", "mxfp8", "none", "layers.*.experts.*"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
KEYS = st.one_of(st.sampled_from(sorted({k for keys in SECTION_KEYS.values() for k in keys})), st.text(max_size=10),
                 st.integers(-5, 5), st.booleans(), st.none())


def _mappings(data, path=()):
    """Every (path, mapping) inside the data, the top level included."""
    yield path, data
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _mappings(value, path + (key,))


MUTATION = st.tuples(st.sampled_from(["delete", "retype", "rename", "insert", "near_miss"]), st.integers(0, 10**6),
                     st.integers(0, 10**6), VALUES, KEYS)


def _mutate(data, op, i, j, value, key):
    places = list(_mappings(data))
    _, target = places[i % len(places)]
    keys = list(target)
    if op == "insert" or not keys:
        target[key] = value
        return
    name = keys[j % len(keys)]
    if op == "delete":
        del target[name]
    elif op == "retype":
        target[name] = value
    elif op == "rename":
        target[key if key not in target else f"{key}_"] = target.pop(name)
    elif op == "near_miss" and isinstance(name, str) and name:
        k = j % len(name)
        target[name[:k] + name[k + 1:] + name[k]] = target.pop(name)    # move one letter to the end


@fuzz(150)
@given(st.lists(MUTATION, min_size=1, max_size=4))
def test_structured_mutations(mutations):
    data = copy.deepcopy(TINY)
    for mutation in mutations:
        _mutate(data, *mutation)
    text = yaml.safe_dump(data, sort_keys=False)
    result = _check(text)
    if isinstance(result, SpecError):
        assert result.line is not None, str(result)
        assert result.field is not None, str(result)
    else:
        assert parse_spec_text(dump_spec_yaml(result)) == result


@fuzz(75)
@given(st.lists(MUTATION, min_size=1, max_size=3), st.sampled_from(["flow", "block"]))
def test_structured_mutations_flow_style(mutations, style):
    data = copy.deepcopy(TINY)
    for mutation in mutations:
        _mutate(data, *mutation)
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=(style == "flow"))
    result = _check(text)
    if isinstance(result, SpecError):
        assert result.line is not None and result.field is not None, str(result)


# ---- (c) round trip of valid specs -----------------------------------------------------------------------------------
@st.composite
def valid_spec_data(draw):
    n = draw(st.integers(1, 40))
    kinds = draw(st.lists(st.sampled_from(["kda", "mla"]), min_size=n, max_size=n))
    hidden = draw(st.integers(1, 4096))
    data = {"name": draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}", fullmatch=True)),
            "model": {"hidden_size": hidden, "vocab_size": draw(st.integers(1, 1 << 20)),
                      "rms_norm_eps": draw(st.floats(1e-12, 1.0)), "max_context": draw(st.integers(1, 1 << 26)),
                      "tie_word_embeddings": draw(st.booleans())}}
    form = draw(st.sampled_from(["kinds", "mla_layers", "kda_layers", "pattern"]))
    base = draw(st.sampled_from([0, 1]))
    if form == "kinds":
        data["layers"] = {"kinds": kinds}
    elif form == "pattern":
        data["layers"] = {"count": n, "pattern": kinds[: draw(st.integers(1, n))]}
    else:
        want = form.split("_")[0]
        data["layers"] = {"count": n, "index_base": base, form: [i + base for i, k in enumerate(kinds) if k == want]}
    dim = st.integers(1, 512)
    if "kda" in kinds or draw(st.booleans()):
        gate = draw(st.sampled_from(["safe", "softplus"]))
        low = draw(st.booleans())
        data["kda"] = {"num_heads": draw(dim), "head_dim": draw(st.sampled_from([16, 32, 64, 128, 256])),
                       "conv_kernel": draw(st.integers(2, 64)),
                       "gate": gate, "gate_lower_bound": draw(st.floats(-1e4, -1e-3)),
                       "gate_rank": draw(st.none() | dim), "output_gate": "low_rank" if low else "full_rank"}
        if low:
            data["kda"]["output_gate_rank"] = draw(st.none() | dim)
    if "mla" in kinds or draw(st.booleans()):
        data["mla"] = {"num_heads": draw(dim), "q_lora_rank": draw(st.none() | dim), "kv_lora_rank": draw(dim),
                       "qk_nope_head_dim": draw(dim), "qk_rope_head_dim": draw(st.integers(1, 128)),
                       "v_head_dim": draw(dim), "output_gate": draw(st.booleans())}
    if draw(st.booleans()):
        data["attn_res"] = {"block_size": draw(st.integers(1, n))}
    act = draw(st.sampled_from(["situ", "swiglu"]))
    mlp = {"activation": act}
    if act == "situ":
        mlp["situ_beta_gate"] = draw(st.floats(1e-3, 1e6))
        mlp["situ_beta_up"] = draw(st.floats(1e-3, 1e6))
    if n > 1 and draw(st.booleans()):
        k = draw(st.integers(0, n - 1))
        if draw(st.booleans()):
            mlp["first_k_dense"] = k
        else:
            mlp["dense_layers"] = sorted(draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))
        experts = draw(st.integers(1, 64))
        shared = draw(st.integers(0, 3))
        latent = draw(st.none() | st.integers(1, hidden))
        data["moe"] = {"num_experts": experts, "top_k": draw(st.integers(1, experts)),
                       "expert_intermediate_size": draw(dim), "num_shared_experts": shared,
                       "latent_dim": latent, "latent_norm": latent is not None and draw(st.booleans()),
                       "router_activation": draw(st.sampled_from(["sigmoid", "softmax"])),
                       "router_bias": draw(st.booleans()), "renormalize": draw(st.booleans()),
                       "routed_scaling_factor": draw(st.floats(1e-3, 1e4))}
        if shared and draw(st.booleans()):
            data["moe"]["shared_intermediate_size"] = draw(dim)
        if draw(st.booleans()):
            mlp["dense_intermediate_size"] = draw(dim)
    mlp.setdefault("dense_intermediate_size", draw(dim))
    data["mlp"] = mlp
    fmt = draw(st.sampled_from(["bf16", "mxfp4"]))
    weights = {"format": fmt, "scale_rule": draw(st.sampled_from(["floor", "rceil"]))}
    if fmt == "mxfp4" and draw(st.booleans()):
        pat = st.from_regex(r"[A-Za-z0-9_.*?\-]{1,20}", fullmatch=True)
        weights["include"] = draw(st.lists(pat, max_size=3))
        weights["exclude"] = draw(st.lists(pat, max_size=3))
    data["precision"] = {"weights": weights, "activations": draw(st.sampled_from(["bf16", "mxfp8"]))}
    return data


@fuzz(100)
@given(valid_spec_data())
def test_round_trip(data):
    # dumped so that YAML 1.2 reads back what was drawn (a name like '1e5' or '0o7' needs quotes)
    spec = parse_spec_text(yaml.dump(data, Dumper=SpecDumper, sort_keys=False), "gen.yaml")
    text = dump_spec_yaml(spec)
    again = parse_spec_text(text, "dumped.yaml")
    assert again == spec
    assert dump_spec_yaml(again) == text
    assert spec_to_dict(spec) == spec_to_dict(again)
    for value in (spec.rms_norm_eps, spec.mlp.moe.routed_scaling_factor if spec.mlp.moe else 1.0):
        assert math.isfinite(value)
