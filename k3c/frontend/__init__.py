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


def dump_spec_yaml(spec: ModelSpec) -> str:
    """The spec as YAML text in k3c's schema."""
    return dump_yaml_text(spec_to_dict(spec))
