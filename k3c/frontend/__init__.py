"""Spec frontend: YAML specs and Hugging Face configs become a validated ModelSpec."""
from __future__ import annotations

import json
import os

from ..errors import SpecError
from .schema import spec_from_data, spec_to_dict
from .spec import (ActivationSpec, AttnResSpec, KDASpec, MLASpec, MLPSpec, ModelSpec, MoESpec, PrecisionSpec,
                   WeightPrecisionSpec)
from .yaml_loader import load_yaml_text, read_spec_text

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
        from .hf_config import spec_from_hf_config_text

        return spec_from_hf_config_text(text, path)
    return parse_spec_text(text, path)


def dump_spec_yaml(spec: ModelSpec) -> str:
    """The spec as YAML text in k3c's schema."""
    import yaml

    return yaml.dump(spec_to_dict(spec), Dumper=_spec_dumper(yaml), sort_keys=False, default_flow_style=None,
                     width=120)


def _spec_dumper(yaml):
    """SafeDumper that also quotes strings YAML 1.2 (how specs are read) would take as numbers or booleans (`1e5`,
    `0o17`), besides those YAML 1.1 would (`0064`, `yes`)."""
    from .yaml_loader import _CORE_BOOL, _CORE_FLOAT, _CORE_INT

    dumper = type("_SpecDumper", (yaml.SafeDumper,), {})
    dumper.add_implicit_resolver("tag:yaml.org,2002:bool", _CORE_BOOL, list("tTfF"))
    dumper.add_implicit_resolver("tag:yaml.org,2002:int", _CORE_INT, list("-+0123456789"))
    dumper.add_implicit_resolver("tag:yaml.org,2002:float", _CORE_FLOAT, list("-+.0123456789"))
    return dumper
