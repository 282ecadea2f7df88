"""Spec frontend: YAML specs and Hugging Face configs become a validated ModelSpec.

Modules, lowest first (each imports only those before it): located (spec file text, located containers, one-line
errors) < yaml_loader, json_loader < spec (the dataclasses) < weight_names < quant_check < schema (YAML schema
-> ModelSpec and back) < hf_config (config.json -> ModelSpec), hf_export (ModelSpec -> config.json) < to_ir.
"""
from __future__ import annotations

import os

from ..errors import SpecError
from .hf_config import spec_from_hf_config_text
from .located import read_spec_text
from .schema import spec_from_data, spec_to_dict
from .spec import (ActivationSpec, AttnResSpec, KDASpec, MLASpec, MLPSpec, ModelSpec, MoESpec, PrecisionSpec,
                   WeightPrecisionSpec)
from .yaml_loader import dump_yaml_text, load_yaml_text

__all__ = ["load_spec", "parse_spec_text", "dump_spec_yaml", "ModelSpec", "KDASpec", "MLASpec", "AttnResSpec",
           "MLPSpec", "MoESpec", "ActivationSpec", "PrecisionSpec", "WeightPrecisionSpec"]


def parse_spec_text(text: str, file: str = "<spec>") -> ModelSpec:
    """Validate YAML spec text; errors name `file`."""
    return spec_from_data(load_yaml_text(text, file), file)


def load_spec(path: str | os.PathLike) -> ModelSpec:
    """Load a YAML spec, a Hugging Face `config.json`, or a model directory holding one."""
    path = os.fspath(path)
    if path and not os.path.lexists(path):
        near = _nearest_spec(path)
        if near:
            raise SpecError(f"no such file (did you mean {near}?)", file=path)
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if not os.path.exists(cfg):              # a config.json that is not a regular file: read_spec_text says so
            raise SpecError("is a directory without a config.json; expected a YAML spec or a Hugging Face "
                            "model directory", file=path)
        path = cfg
    text = read_spec_text(path)
    if path.endswith(".json"):
        return spec_from_hf_config_text(text, path)
    return parse_spec_text(text, path)


def _nearest_spec(path: str) -> str | None:
    """An existing spec the missing `path` probably meant: the same name with a spec extension (.yaml, .yml,
    .json) or none (a model directory), else a close spelling in the same directory."""
    import difflib

    stem, ext = os.path.splitext(path)
    if ext not in (".yaml", ".yml", ".json", ""):
        stem = path
    for cand in (stem + ".yaml", stem + ".yml", stem + ".json", stem):
        if cand != path and (os.path.isfile(cand) or os.path.isfile(os.path.join(cand, "config.json"))):
            return cand
    parent = os.path.dirname(path) or "."
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    close = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.75)
    return os.path.join(os.path.dirname(path), close[0]) if close else None


def dump_spec_yaml(spec: ModelSpec) -> str:
    """The spec as YAML text in k3c's schema."""
    return dump_yaml_text(spec_to_dict(spec))
