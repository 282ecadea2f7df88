"""Hugging Face `config.json` import for Kimi Linear and Kimi K3 (hf_export writes the inverse).

    spec_from_hf_config_text(text, path) -> ModelSpec      # what load_spec() calls for *.json / model dirs

Two model types are understood (docs/hf-import.md lists every field, alias and default):

* `kimi_linear`: transformers' `KimiLinearConfig` (transformers >= 5.17), read with transformers' own field names,
  aliases (`attribute_map`) and defaults, including the hub form with a `linear_attn_config` sub-dict.
  Anything transformers' KimiLinear would silently ignore or cannot run (grouped routing, attention biases, a
  K3-only feature) is rejected with a SpecError rather than imported with a different meaning.
* `kimi_k3`: the K3 published layout, a top-level config with a `text_config` holding the fields of K3.md
  section 1 (a flat config without `text_config` is accepted too).

The importer builds the YAML schema's plain-data form and validates it with `schema.spec_from_data`, so HF and YAML
specs go through the same checks; every error is re-located to the JSON file, line and dotted key. A compressed-tensors
`quantization_config` becomes the precision section (and, for a packed checkpoint, the quantization section).
"""
from __future__ import annotations

import os
import re
from typing import Any

from ..errors import SpecError
from . import hf_families as fam
from .hf_scope import _MISSING, HFFields, _check_typos, _int, _Reader, _Scope, _show
from .json_loader import parse_json_located
from .located import did_you_mean, spec_error
from .quant_check import packable, quantizable_names, quantization_patterns, select
from .schema import spec_from_data
from .spec import DEFAULT_MXFP4_INCLUDE, ModelSpec
from .weight_names import K3_CHECKPOINT_PREFIX, K3_LM_HEAD, model_weights

SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")


# ---------------------------------------------------------------------------------------------------------------
def spec_from_hf_config_text(text: str, path: str) -> ModelSpec:
    """Validate a Hugging Face config.json (Kimi Linear or Kimi K3) into a ModelSpec; errors name file:line."""
    data = parse_json_located(text, path)
    if not isinstance(data, dict):
        raise spec_error(f"a config.json must hold a JSON object, got {_show(data)}", file=path, line=1)
    top = _Scope(data, "", path, 1)
    model_type = data.get("model_type", _MISSING)
    if model_type is _MISSING:
        raise top.error(None, f"no 'model_type' key; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = did_you_mean(model_type, SUPPORTED_MODEL_TYPES)
        raise top.error("model_type", f"unsupported model_type {_show(model_type)}{hint}; supported model types: "
                                      f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    reader = _Reader(path)
    if model_type == "kimi_linear":
        text_scope = top
    else:
        top.known.add("text_config")
        if "text_config" in data and not isinstance(data["text_config"], dict):
            raise top.error("text_config", f"must be a mapping (the model's fields), got {_show(data['text_config'])}")
        text_scope = top.sub("text_config") if "text_config" in data else top
    importer = _Importer(reader, top, text_scope, model_type)
    schema_data = importer.run()
    return _validate(schema_data, reader, path)


def _validate(schema_data: dict, reader: _Reader, path: str) -> ModelSpec:
    try:
        spec = spec_from_data(schema_data, path)
    except SpecError as exc:
        field, line = None, None
        probe = exc.field or ""
        while probe:
            if probe in reader.record:
                field, line = reader.record[probe]
                break
            probe = probe.rpartition(".")[0]
        raise spec_error(exc.message, file=path, line=line, field=field or exc.field) from None
    locations = tuple(sorted((k, v[1]) for k, v in reader.record.items() if v[1] is not None))
    return spec.replace(source=path, locations=locations)


class _Importer(HFFields):
    """Builds the YAML schema's plain data from a config's scopes (HFFields): the model section, the layer layout
    and each family's section (hf_families), precision and quantization, then checks for misspelt keys."""

    # -- the import --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        out: dict[str, Any] = {"name": self.name()}
        hidden = self.get("model.hidden_size", self.names("hidden_size"), self.dflt(2304))
        vocab = self.get("model.vocab_size", self.names("vocab_size"), self.dflt(163840))
        eps = self.get("model.rms_norm_eps", self.names("rms_norm_eps"), 1e-5)
        max_ctx = self.get("model.max_context", self.names("max_position_embeddings", "model_max_length"),
                           self.dflt(1048576, 4096))
        tie = self.get("model.tie_word_embeddings", self.names("tie_word_embeddings"), False)
        if self.kl and tie is True:
            # transformers' KimiLinearForCausalLM declares no tied weights: lm_head stays a separate tensor (and
            # save_pretrained writes it) whatever the flag says. Follow the oracle.
            tie = False
        out["model"] = {"hidden_size": hidden, "vocab_size": vocab, "rms_norm_eps": eps, "max_context": max_ctx,
                        "tie_word_embeddings": tie}

        n_names = self.names("num_hidden_layers")
        n_layers = _int(self.r.find(n_names), self.get("layers.count", n_names, self.dflt(27)), self.r,
                        "num_hidden_layers", hi=4096)
        kinds = fam.layer_kinds(self, n_layers)
        out["layers"] = {"count": n_layers, "kinds": kinds}

        if "kda" in kinds:
            out["kda"] = fam.kda(self)
        if "mla" in kinds:
            out["mla"] = fam.mla(self)
        out["attn_res"] = fam.attn_res(self)
        mlp, moe = fam.mlp(self, n_layers)
        out["mlp"] = mlp
        if moe is not None:
            out["moe"] = moe
        out["precision"] = self.precision(out)
        quant = self.quantization(out)
        if quant is not None:
            out["quantization"] = quant
        for scope in (self.top, self.t, self.lin):
            _check_typos(scope)
        return out

    def name(self) -> str:
        for scope in (self.top, self.t):
            for key in ("_name_or_path", "name_or_path"):
                value = scope.data.get(key)
                if isinstance(value, str) and value.strip():
                    return _sanitize_name(os.path.basename(value.rstrip("/\\")))
        file = self.r.file
        if os.path.basename(file) == "config.json":
            base = os.path.basename(os.path.dirname(os.path.abspath(file)))
        else:
            base = os.path.splitext(os.path.basename(file))[0]
        return _sanitize_name(base)

    # -- precision ---------------------------------------------------------------------------------------------
    def precision(self, partial: dict) -> dict:
        names = [(self.t, "quantization_config")]
        if self.t is not self.top:
            names.append((self.top, "quantization_config"))
        hit = self.r.find(names)
        if hit is None or hit[0].data[hit[1]] is None:
            return {"weights": {"format": "bf16"}, "activations": "bf16"}
        self.reject_for_kimi_linear(names, None, "a quantization_config")
        scope = hit[0].sub(hit[1])
        self.packed_scope = scope if scope.data.get("format") == "mxfp4-pack-quantized" else None
        return _import_quantization(scope, partial, self.r)

    def quantization(self, partial: dict) -> dict | None:
        """A packed checkpoint (compressed-tensors format mxfp4-pack-quantized) of MXFP4 routed experts (and the
        linears k3c can read packed: lm_head, MLPs, shared experts, latent projections): the graph reads them packed,
        so the spec gets a `quantization:` section selecting what precision.weights does. A `dense` export (unpacked
        floats) or MXFP4 elsewhere (attention, router) gives none."""
        scope = self.packed_scope
        w = partial["precision"]["weights"]
        if scope is None or w.get("format") != "mxfp4":
            return None
        try:
            probe = _probe_spec(partial)
        except SpecError:
            return None
        chosen = set(select(quantizable_names(probe), w["include"], w["exclude"]))
        if not packable(probe, chosen):
            return None
        out = {"format": "mxfp4", "rule": w.get("scale_rule", "floor")}
        if list(w["include"]) != list(DEFAULT_MXFP4_INCLUDE):
            out["include"] = list(w["include"])
        if w["exclude"]:
            out["exclude"] = list(w["exclude"])
        self.r.record["quantization"] = (scope.path, scope.line)
        return out


def _sanitize_name(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.\-]+", "-", name).strip("-.") or "model"
    if not name[0].isalnum():
        name = "m" + name
    return name[:128]


# ---------------------------------------------------------------------------------------------------------------
# compressed-tensors quantization_config -> precision section (hf_export writes the inverse)
def _probe_spec(partial: dict) -> ModelSpec:
    data = dict(partial)
    data["precision"] = {"weights": {"format": "bf16"}, "activations": "bf16"}
    return spec_from_data(data, "<probe>")


def _module_names(spec: ModelSpec) -> list[tuple[str, list[str]]]:
    """(canonical weight name, module names in the K3 checkpoint it stands for) for every Linear weight."""
    out = []
    for w in model_weights(spec):
        if w.kind == "linear":
            base = w.name[: -len(".weight")]
            mod = K3_LM_HEAD if base == "lm_head" else K3_CHECKPOINT_PREFIX + base
            out.append((w.name, [mod]))
        elif w.kind == "experts":
            prefix, _, proj = w.name.rpartition(".")
            e = w.shape[0]
            out.append((w.name, [f"{K3_CHECKPOINT_PREFIX}{prefix}.{i}.{proj}" for i in sorted({0, e - 1})]))
    return out


def _ct_match(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == "Linear":
        return True
    return module == target or module.endswith("." + target)


def _import_quantization(q: _Scope, partial: dict, reader: _Reader) -> dict:
    method = q.data.get("quant_method")
    q.known.update({"quant_method", "config_groups", "ignore", "format", "quantization_status", "kv_cache_scheme",
                    "global_compression_ratio", "sparsity_config", "transform_config", "version"})
    if method != "compressed-tensors":
        raise q.error("quant_method", f"unsupported quant_method {_show(method)}: k3c imports compressed-tensors "
                                      f"MXFP4 (weights) / MXFP8 (activations) only")
    groups = q.sub("config_groups")
    if groups is None or not groups.data:
        raise q.error("config_groups", "a compressed-tensors config needs config_groups")
    ignore = q.data.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise q.error("ignore", "must be a list of module names or 're:' patterns")
    for i, pat in enumerate(ignore):
        _check_regex(q, "ignore", i, pat)
    try:
        probe = _probe_spec(partial)
    except SpecError:
        return {"weights": {"format": "bf16"}, "activations": "bf16"}   # the real validation reports it
    modules = _module_names(probe)
    quantized: set[str] = set()
    acts: set[str] = set()
    rule = "floor"
    for gname in groups.data:
        g = groups.sub(gname)
        if g is None:
            raise groups.error(gname, "must be a mapping (a compressed-tensors quantization group), got null")
        g.known.update({"targets", "weights", "input_activations", "output_activations", "format"})
        targets = g.data.get("targets")
        if not isinstance(targets, list) or not all(isinstance(x, str) for x in targets) or not targets:
            raise g.error("targets", "must be a non-empty list of module names, 'Linear' or 're:' patterns")
        for i, pat in enumerate(targets):
            _check_regex(g, "targets", i, pat)
            if not pat.startswith("re:") and pat[:1].isupper() and pat != "Linear":
                raise g.error("targets", f"module class target {_show(pat)} is not supported (only Linear)",
                              g.item_line("targets", i))
        w = g.sub("weights")
        if w is not None:
            w.known.update({"num_bits", "type", "group_size", "strategy", "symmetric", "dynamic", "observer",
                            "observer_kwargs", "actorder", "block_structure", "scale_dtype", "zp_dtype",
                            "scale_rule"})
            strategy = w.data.get("strategy", "group")
            if not (w.data.get("num_bits") == 4 and w.data.get("type") == "float"
                    and w.data.get("group_size") == 32 and strategy in ("group", "tensor_group")):
                raise w.error(None, f"unsupported weight quantization {dict(w.data)!r}: k3c supports MXFP4 only "
                                    f"(num_bits 4, type float, group_size 32)")
            if "scale_rule" in w.data:
                rule = w.data["scale_rule"]
                reader.record["precision.weights.scale_rule"] = (w.field("scale_rule"),
                                                                 w.key_line("scale_rule"))
        a = g.sub("input_activations")
        if a is None:
            acts.add("bf16")
        else:
            if not (a.data.get("num_bits") == 8 and a.data.get("type") == "float"
                    and a.data.get("group_size") == 32):
                raise a.error(None, f"unsupported activation quantization {dict(a.data)!r}: k3c supports MXFP8 "
                                    f"only (num_bits 8, type float, group_size 32)")
            acts.add("mxfp8")
            reader.record["precision.activations"] = (g.field("input_activations"),
                                                      g.key_line("input_activations"))
        for canon, mods in modules if w is not None else ():
            hits = [any(_ct_match(t, m) for t in targets) and not any(_ct_match(t, m) for t in ignore)
                    for m in mods]
            if any(hits) and not all(hits):
                raise g.error("targets", f"quantizes only some experts of {canon}; k3c quantizes a layer's "
                                         f"routed experts all or none")
            if hits[0]:
                quantized.add(canon)
    if len(acts) > 1:
        raise groups.error(None, "config groups disagree on activation quantization (k3c has one setting)")
    reader.record["precision.weights"] = (q.path, q.line)
    if not quantized:
        return {"weights": {"format": "bf16"}, "activations": acts.pop()}
    include, exclude = quantization_patterns(probe, quantized)
    return {"weights": {"format": "mxfp4", "include": include, "exclude": exclude, "scale_rule": rule},
            "activations": acts.pop()}


def _check_regex(scope: _Scope, key: str, index: int, pattern: str) -> None:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise scope.error(key, f"item {index}: bad regular expression {pattern!r}: {exc}",
                              scope.item_line(key, index)) from None
