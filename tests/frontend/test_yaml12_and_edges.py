"""Issue 20 (hostile and careless inputs), the spec front end: YAML 1.2 scalars, the supported edges of the
documented ranges, and spec paths that are not regular files. The refusals are in bad_specs/ (yaml11_*, edge_*,
hf_*); this file holds what must be accepted, and the cases that cannot be committed (a FIFO)."""
from __future__ import annotations

import json
import os

import pytest

from k3c.errors import SpecError
from k3c.frontend import dump_spec_yaml, load_spec, parse_spec_text
from k3c.frontend.hf_config import spec_from_hf_config_text
from k3c.frontend.yaml_loader import load_yaml_text

from .conftest import REPO


@pytest.mark.parametrize("text,value", [
    ("64", 64), ("+64", 64), ("-3", -3), ("0", 0), ("-0", 0), ("0x40", 64), ("0o100", 64), ("0x7fFF", 32767),
    ("1e-5", 1e-5), ("1E-5", 1e-5), ("1.0e-5", 1e-5), ("1e+5", 1e5), (".5", 0.5), ("-.5", -0.5), ("5.", 5.0),
    ("007.5", 7.5), ("true", True), ("True", True), ("TRUE", True), ("false", False), ("FALSE", False),
    ("~", None), ("null", None), ("Null", None), ("", None),
    ("yes", "yes"), ("no", "no"), ("on", "on"), ("Off", "Off"), ("y", "y"), ("1:04", "1:04"), ("1_000", "1_000"),
    ("0b101", "0b101"), ("0X40", "0X40"), ("inf", "inf"),
])
def test_yaml_1_2_core_scalars(text, value):
    got = load_yaml_text(f"a: {text}\n", "s.yaml")["a"]
    assert got == value and type(got) is type(value)


def test_special_floats():
    import math
    got = load_yaml_text("a: [.inf, -.Inf, +.INF, .nan, .NaN]\n", "s.yaml")["a"]
    assert got[:3] == [math.inf, -math.inf, math.inf] and all(math.isnan(x) for x in got[3:])


@pytest.mark.parametrize("text", ["0064", "-05", "+010", "00", "08", "!!int 0064"])
def test_leading_zeros_refused_with_the_line(text):
    with pytest.raises(SpecError, match="leading zeros") as info:
        load_yaml_text(f"x: 1\nsec:\n  a: {text}\n", "s.yaml")
    assert info.value.line == 3 and info.value.field == "sec.a"


def test_exponent_without_dot_is_a_float(tiny_text):
    spec = parse_spec_text(tiny_text.replace("rms_norm_eps: 1.0e-5", "rms_norm_eps: 1e-6"))
    assert spec.rms_norm_eps == 1e-6
    hexed = parse_spec_text(tiny_text.replace("hidden_size: 64", "hidden_size: 0x40"))
    assert hexed.hidden_size == 64


def test_yaml_1_1_strings_still_work_as_strings(tiny_text):
    # `off` is what attn_res accepts; `name: yes` is a name now (YAML 1.1 made it a bool)
    spec = parse_spec_text(tiny_text.replace("attn_res:\n  block_size: 3", "attn_res: off")
                           .replace("name: k3-tiny", "name: yes"))
    assert spec.attn_res is None and spec.name == "yes"


@pytest.mark.parametrize("name", ["1e5", "0o17", "0x1F", "TRUE", "0064", "yes", "1_000", "Null", "007.5"])
def test_dump_quotes_what_either_yaml_version_would_not_read_as_a_string(tiny_text, name):
    spec = parse_spec_text(tiny_text).replace(name=name)
    assert parse_spec_text(dump_spec_yaml(spec)) == spec


def test_json_numbers_are_unaffected():
    data = json.loads((REPO / "tests" / "hf" / "data" / "kimi_k3_config.json").read_text())
    data["text_config"]["rms_norm_eps"] = 1e-6
    text = json.dumps(data).replace("1e-06", "1e-6")
    assert '"rms_norm_eps": 1e-6' in text
    assert spec_from_hf_config_text(text, "c.json").rms_norm_eps == 1e-6
    with pytest.raises(SpecError, match="JSON"):                 # JSON has no leading-zero numbers at all
        spec_from_hf_config_text(text.replace('"hidden_size": 7168', '"hidden_size": 07168'), "c.json")


# ---- range edges that are supported (k3c run / compile --target mi355x checked on each) -------------------------
@pytest.mark.parametrize("old,new", [
    ("pattern: [kda, kda, kda, mla]", "pattern: [kda]"),                # all KDA: no MLA layer, no latent cache
    ("pattern: [kda, kda, kda, mla]", "pattern: [mla]"),                # all MLA
    ("pattern: [kda, kda, kda, mla]", "pattern: [kda, kda, kda, mla, kda, mla, kda, mla]"),   # pattern == count
    ("pattern: [kda, kda, kda, mla]", "pattern: [kda, kda, mla]"),      # count not a multiple of the pattern
    ("head_dim: 16\n  conv", "head_dim: 256\n  conv"),
    ("conv_kernel: 4", "conv_kernel: 2"),
    ("conv_kernel: 4", "conv_kernel: 64"),
    ("qk_rope_head_dim: 8", "qk_rope_head_dim: 1"),
    ("qk_rope_head_dim: 8", "qk_rope_head_dim: 3"),
    ("qk_nope_head_dim: 16", "qk_nope_head_dim: 1"),
    ("v_head_dim: 16", "v_head_dim: 1"),
    ("kv_lora_rank: 32", "kv_lora_rank: 1"),
])
def test_edges_load(tiny_text, old, new):
    assert old in tiny_text
    spec = parse_spec_text(tiny_text.replace(old, new, 1))
    assert parse_spec_text(dump_spec_yaml(spec)) == spec


def test_all_kda_model_has_no_mla_section_needed(tiny_text):
    text = tiny_text.replace("pattern: [kda, kda, kda, mla]", "pattern: [kda]")
    start, end = text.index("mla:\n"), text.index("attn_res:")
    spec = parse_spec_text(text[:start] + text[end:])
    assert spec.mla is None and set(spec.layer_kinds) == {"kda"}


def test_block_pool_without_mla_layers():
    import torch

    from k3c.runtime.caches.block_pool import BlockPool

    pool = BlockPool(2, 64, {}, torch.bfloat16, "cpu")
    assert not pool.used and pool.pages_for(100) == 0
    pool.mark_written([], 0, 9)                # an all-KDA model holds no pages: nothing to track
    pool.write_rows([], {}, 9)
    assert pool.read_rows([], 9) == {}
    pool.check_empty()


# ---- paths that are not regular files ------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_fifo_spec_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="FIFO") as info:
        load_spec(fifo)                       # would block forever in open() / read()
    assert info.value.file == str(fifo) and str(info.value).startswith(f"{fifo}: is a FIFO")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_fifo_config_json_in_a_model_dir(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(SpecError, match="FIFO") as info:
        load_spec(tmp_path)
    assert info.value.file == str(tmp_path / "config.json")


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_device_is_refused():
    with pytest.raises(SpecError, match="device"):
        load_spec("/dev/null")
