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

import difflib
import json
import os
import re
from typing import Any

from ..errors import SpecError
from .json_loader import parse_json_located
from .located import did_you_mean, spec_error
from .quant_check import packable, quantizable_names, quantization_patterns, select
from .schema import spec_from_data
from .spec import DEFAULT_MXFP4_INCLUDE, ModelSpec
from .weight_names import K3_CHECKPOINT_PREFIX, K3_LM_HEAD, model_weights

SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")

_MISSING = object()


# ---------------------------------------------------------------------------------------------------------------
# Located field access
class _Scope:
    """One JSON mapping, its dotted path and the keys the importer consumed."""

    def __init__(self, data: Any, path: str, file: str, line: int | None):
        if not isinstance(data, dict):
            raise spec_error(f"must be a mapping, got {_show(data)}", file=file, line=line, field=path or None)
        self.data = data
        self.path = path
        self.file = file
        self.line = getattr(data, "line", None) or line
        self.known: set[str] = set()

    def field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def key_line(self, key: str) -> int | None:
        return getattr(self.data, "key_lines", {}).get(key, self.line)

    def error(self, key: str | None, message: str, line: int | None = None) -> SpecError:
        if line is None:
            line = self.key_line(key) if key else self.line
        return spec_error(message, file=self.file, line=line, field=self.field(key) if key else (self.path or None))

    def item_line(self, key: str, index: int) -> int | None:
        lines = getattr(self.data.get(key), "item_lines", None)
        return lines[index] if lines and index < len(lines) else self.key_line(key)

    def sub(self, key: str) -> "_Scope | None":
        self.known.add(key)
        value = self.data.get(key)
        if value is None:
            return None
        return _Scope(value, self.field(key), self.file, self.key_line(key))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Reader:
    """Reads logical fields through their aliases, recording where each schema field came from."""

    def __init__(self, file: str):
        self.file = file
        self.record: dict[str, tuple[str, int | None]] = {}     # schema path -> (json field, line)

    def find(self, names: list[tuple[_Scope | None, str]]) -> tuple[_Scope, str] | None:
        """The one (scope, key) among the aliases that is present; disagreeing duplicates are errors."""
        found: list[tuple[_Scope, str]] = []
        for scope, key in names:
            if scope is None:
                continue
            scope.known.add(key)
            if key in scope.data:
                found.append((scope, key))
        if not found:
            return None
        first_scope, first_key = found[0]
        for scope, key in found[1:]:
            if scope.data[key] != first_scope.data[first_key]:
                raise scope.error(key, f"disagrees with '{first_scope.field(first_key)}' "
                                       f"({_show(scope.data[key])} vs {_show(first_scope.data[first_key])}); "
                                       f"give one of them")
        return found[0]

    def get(self, schema_path: str | None, names: list[tuple[_Scope | None, str]], default: Any = _MISSING,
            *, null_is_default: bool = False) -> Any:
        hit = self.find(names)
        if hit is None or (null_is_default and hit[0].data[hit[1]] is None):
            if default is _MISSING:
                scope, key = next((s, k) for s, k in names if s is not None)
                raise scope.error(None, f"missing required field '{scope.field(key)}'")
            return default
        scope, key = hit
        if schema_path:
            self.record[schema_path] = (scope.field(key), scope.key_line(key))
        return scope.data[key]


def _int(scope_key: tuple[_Scope, str] | None, value: Any, reader: _Reader, what: str, *, lo: int = 1,
         hi: int = 1 << 24) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(reader, scope_key, what, f"must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise _err(reader, scope_key, what, f"must be in [{lo}, {hi}], got {value}")
    return value


def _err(reader: _Reader, scope_key: tuple[_Scope, str] | None, what: str, message: str) -> SpecError:
    if scope_key is None:
        return spec_error(message, file=reader.file, field=what)
    scope, key = scope_key
    return scope.error(key, message)


def _bool(value: Any, hit: tuple[_Scope, str] | None, reader: _Reader, what: str) -> bool:
    if not isinstance(value, bool):
        raise _err(reader, hit, what, f"must be true or false, got {_show(value)}")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Keys we know but do not need (so that typo detection does not flag them)
_IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "initializer_range", "output_router_logits", "router_aux_loss_coef",
    "pretraining_tp", "attention_dropout", "rope_theta", "rope_scaling", "rope_parameters", "head_dim",
    "qk_head_dim", "use_grouped_topk", "num_nextn_predict_layers", "output_hidden_states", "output_attentions",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "vision_config", "model_type", "_name_or_path", "name_or_path", "topk_method", "aux_loss_alpha",
    "seq_aux", "ep_size", "vision_tower", "mm_projector", "media_placeholder_token_id", "image_token_id",
    "video_token_id", "vision_start_token_id", "vision_end_token_id", "projection_hidden_size",
    "projection_layer_norm_eps", "use_unified_vision_chunk", "tie_encoder_decoder", "name",
}


def _check_typos(scope: _Scope | None) -> None:
    """Unknown keys are ignored (HF configs carry many), unless one looks like a misspelt field we read."""
    if scope is None:
        return
    known = scope.known | _IGNORED_KEYS
    absent = sorted(k for k in scope.known if k not in scope.data)
    for key in scope.data:
        if key in known:
            continue
        close = difflib.get_close_matches(key, absent, n=1, cutoff=0.85)
        if close:
            raise scope.error(key, f"unknown key '{key}' (did you mean '{close[0]}'?)")


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


class _Importer:
    """Builds the YAML schema's plain data from a config's scopes: `top` (the file), `text` (its text_config, or the
    file itself) and linear_attn_config inside it."""

    def __init__(self, reader: _Reader, top: _Scope, text: _Scope, model_type: str):
        self.r = reader
        self.top = top
        self.t = text
        self.kl = model_type == "kimi_linear"
        self.lin = text.sub("linear_attn_config")
        self.packed_scope: _Scope | None = None    # a quantization_config of packed MXFP4 weights (precision sets it)

    # -- helpers ---------------------------------------------------------------------------------------------
    def names(self, *keys: str, lin: tuple[str, ...] = ()) -> list[tuple[_Scope | None, str]]:
        return [(self.lin, k) for k in lin] + [(self.t, k) for k in keys]

    def get(self, schema_path: str | None, names, default=_MISSING, **kw):
        return self.r.get(schema_path, names, default, **kw)

    def dflt(self, kl_default: Any, k3_default: Any = _MISSING) -> Any:
        """transformers' KimiLinearConfig default for kimi_linear; K3 requires the field unless given here."""
        return kl_default if self.kl else k3_default

    def reject_for_kimi_linear(self, names, off_value: Any, what: str) -> None:
        hit = self.r.find(names)
        if self.kl and hit is not None and hit[0].data[hit[1]] not in (off_value, None):
            raise hit[0].error(hit[1], f"{what} is not part of transformers' KimiLinear (model_type kimi_linear "
                                       f"ignores it); use model_type kimi_k3 for this feature")

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
        kinds = self.layer_kinds(n_layers)
        out["layers"] = {"count": n_layers, "kinds": kinds}

        if "kda" in kinds:
            out["kda"] = self.kda()
        if "mla" in kinds:
            out["mla"] = self.mla()
        out["attn_res"] = self.attn_res()
        mlp, moe = self.mlp(n_layers)
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

    # -- layers --------------------------------------------------------------------------------------------
    def layer_kinds(self, n: int) -> list[str]:
        lt_names = self.names("layer_types")
        full_names = self.names("full_attn_layers", lin=("full_attn_layers",))
        kda_names = self.names("kda_layers", lin=("kda_layers",))
        from_types = from_lists = None
        hit = self.r.find(lt_names)
        if hit is not None and hit[0].data[hit[1]] is not None:
            from_types = self.from_layer_types(hit, n)
            self.r.record["layers.kinds"] = (hit[0].field(hit[1]), hit[0].key_line(hit[1]))
        full_hit, kda_hit = self.r.find(full_names), self.r.find(kda_names)
        given = [h for h in (full_hit, kda_hit) if h is not None]
        if given and not (self.kl and len(given) < 2):    # transformers' KimiLinear reads both lists or neither
            from_lists = self.from_index_lists(full_hit, kda_hit, n)
            if from_types is None:
                self.r.record["layers.kinds"] = (given[0][0].field(given[0][1]), given[0][0].key_line(given[0][1]))
        if from_types is not None and from_lists is not None and from_types != from_lists:
            first = next(i for i in range(n) if from_types[i] != from_lists[i])
            where = full_hit or kda_hit
            raise where[0].error(where[1], f"disagrees with '{hit[0].field(hit[1])}' at layer {first + 1} "
                                           f"(1-based): {from_lists[first]} vs {from_types[first]}")
        kinds = from_types or from_lists
        if kinds is None:
            if not self.kl:
                scope = self.lin or self.t
                raise scope.error(None, "give the attention layout: 'full_attn_layers' (1-based MLA layers, in "
                                        "linear_attn_config or text_config) or 'layer_types'")
            # transformers' default: full attention at every 4th layer (0-based i % 4 == 0, i > 0)
            kinds = ["mla" if i and i % 4 == 0 else "kda" for i in range(n)]
        return kinds

    def from_layer_types(self, hit, n: int) -> list[str]:
        scope, key = hit
        value = scope.data[key]
        if not isinstance(value, list):
            raise scope.error(key, f"must be a list, got {_show(value)}")
        if len(value) != n:
            raise scope.error(key, f"lists {len(value)} layers but num_hidden_layers is {n}")
        table = {"full_attention": "mla", "linear_attention": "kda"}
        kinds = []
        for i, item in enumerate(value):
            if not isinstance(item, str) or item not in table:
                hint = did_you_mean(item, table) if isinstance(item, str) else ""
                raise scope.error(key, f"item {i} must be one of full_attention, linear_attention, got "
                                       f"{_show(item)}{hint}", scope.item_line(key, i))
            kinds.append(table[item])
        return kinds

    def from_index_lists(self, full_hit, kda_hit, n: int) -> list[str]:
        def indices(hit) -> list[int]:
            scope, key = hit
            value = scope.data[key]
            if not isinstance(value, list):
                raise scope.error(key, f"must be a list of 1-based layer indices, got {_show(value)}")
            seen: list[int] = []
            for i, item in enumerate(value):
                line = scope.item_line(key, i)
                if isinstance(item, bool) or not isinstance(item, int):
                    raise scope.error(key, f"item {i} must be a 1-based layer index, got {_show(item)}", line)
                if not 1 <= item <= n:
                    raise scope.error(key, f"layer index {item} out of range 1..{n} (indices are 1-based)", line)
                if item in seen:
                    raise scope.error(key, f"layer index {item} listed twice", line)
                seen.append(item)
            return [i - 1 for i in seen]

        full = indices(full_hit) if full_hit is not None else None
        kda = indices(kda_hit) if kda_hit is not None else None
        if full is not None and kda is not None:
            both = sorted(set(full) & set(kda))
            if both:
                raise kda_hit[0].error(kda_hit[1], f"layer {both[0] + 1} is in both full_attn_layers and "
                                                   f"kda_layers")
            neither = sorted(set(range(n)) - set(full) - set(kda))
            if neither:
                raise kda_hit[0].error(kda_hit[1], f"layer {neither[0] + 1} is in neither full_attn_layers "
                                                   f"nor kda_layers")
        if full is not None:
            return ["mla" if i in full else "kda" for i in range(n)]
        return ["kda" if i in kda else "mla" for i in range(n)]

    # -- KDA ---------------------------------------------------------------------------------------------------
    def kda(self) -> dict:
        heads = self.get("kda.num_heads", self.names("linear_num_heads", lin=("num_heads",)), self.dflt(32))
        head_dim = self.get("kda.head_dim", self.names("linear_head_dim", lin=("head_dim",)), self.dflt(128))
        conv = self.get("kda.conv_kernel", self.names("linear_conv_kernel_dim", lin=("short_conv_kernel_size",)),
                        self.dflt(4))
        lb_names = self.names("gate_lower_bound", "linear_lower_bound", lin=("gate_lower_bound",))
        safe_names = self.names("safe_gate", lin=("safe_gate",))
        full_names = self.names("use_full_rank_gate", lin=("use_full_rank_gate",))
        frank_names = self.names(lin=("forget_gate_rank",))
        orank_names = self.names(lin=("output_gate_rank",))
        if self.kl:
            self.reject_for_kimi_linear(lb_names, None, "a gate lower bound (safe gate)")
            self.reject_for_kimi_linear(safe_names, False, "the safe gate")
            self.reject_for_kimi_linear(full_names, False, "a full-rank output gate")
            self.reject_for_kimi_linear(frank_names, None, "a forget-gate rank")
            self.reject_for_kimi_linear(orank_names, None, "an output-gate rank")
            self.hidden_act_for_conv()
        out: dict[str, Any] = {"num_heads": heads, "head_dim": head_dim, "conv_kernel": conv}
        lb = self.get("kda.gate_lower_bound", lb_names, None)
        safe_hit = self.r.find(safe_names)
        safe = _bool(safe_hit[0].data[safe_hit[1]], safe_hit, self.r, "safe_gate") if safe_hit else None
        if lb is None and safe:
            lb = -5.0                                      # GLM5-style configs: safe_gate without a bound = -5
            self.r.record["kda.gate"] = (safe_hit[0].field(safe_hit[1]), safe_hit[0].key_line(safe_hit[1]))
        if lb is not None and safe is False:
            raise safe_hit[0].error(safe_hit[1], "safe_gate is false but a gate_lower_bound is given")
        if lb is None:
            out["gate"] = "softplus"
        else:
            out["gate"] = "safe"
            out["gate_lower_bound"] = lb
            self.r.record.setdefault("kda.gate", self.r.record.get("kda.gate_lower_bound", ("", None)))
        full_hit = self.r.find(full_names)
        full = _bool(full_hit[0].data[full_hit[1]], full_hit, self.r, "use_full_rank_gate") if full_hit else False
        if full_hit:
            self.r.record["kda.output_gate"] = (full_hit[0].field(full_hit[1]), full_hit[0].key_line(full_hit[1]))
        # The forget gate (and the low-rank output gate) have rank head_dim in both Kimi Linear and K3.
        out["gate_rank"] = self.get("kda.gate_rank", frank_names, head_dim)
        out["output_gate"] = "full_rank" if full else "low_rank"
        if not full:
            out["output_gate_rank"] = self.get("kda.output_gate_rank", orank_names, head_dim)
        elif self.r.find(orank_names) is not None:
            scope, key = self.r.find(orank_names)
            raise scope.error(key, "only applies to a low-rank output gate (use_full_rank_gate is true)")
        return out

    def hidden_act_for_conv(self) -> None:
        """transformers' KimiLinear applies config.hidden_act to the KDA short convolution too."""
        names = self.names("hidden_act")
        act = self.get(None, names, "silu")
        if act != "silu":
            scope, key = self.r.find(names)
            raise scope.error(key, f"hidden_act {_show(act)} is not supported for model_type kimi_linear "
                                   f"(transformers applies it to the experts and to the KDA short convolution; "
                                   f"only silu is supported)")

    # -- MLA ---------------------------------------------------------------------------------------------------
    def mla(self) -> dict:
        heads_names = self.names("num_attention_heads")
        heads = self.get("mla.num_heads", heads_names, self.dflt(32))
        kv_names = self.names("num_key_value_heads")
        kv = self.get(None, kv_names, None)
        if isinstance(heads, bool) or not isinstance(heads, int):
            raise _err(self.r, self.r.find(heads_names), "num_attention_heads",
                       f"must be an integer, got {_show(heads)}")
        if kv is not None and kv != heads:
            scope, key = self.r.find(kv_names)
            raise scope.error(key, f"num_key_value_heads {kv} differs from num_attention_heads {heads}; MLA "
                                   f"decompresses one key and value per head (set them equal)")
        bias_names = self.names("attention_bias")
        if self.get(None, bias_names, False) not in (False, None):
            scope, key = self.r.find(bias_names)
            raise scope.error(key, "attention biases are not supported (K3 and Kimi Linear have none)")
        nope_names = self.names("mla_use_nope")
        nope = self.get("mla.rope", nope_names, True)
        if nope is not True:
            scope, key = self.r.find(nope_names)
            raise scope.error(key, f"must be true, got {_show(nope)}: k3c implements NoPE MLA only (the rope "
                                   f"dims exist but are never rotated)")
        gate_names = self.names("mla_use_output_gate")
        self.reject_for_kimi_linear(gate_names, False, "an MLA output gate")
        gate = self.get("mla.output_gate", gate_names, False)
        return {"num_heads": heads,
                "q_lora_rank": self.get("mla.q_lora_rank", self.names("q_lora_rank"), None),
                "kv_lora_rank": self.get("mla.kv_lora_rank", self.names("kv_lora_rank"), self.dflt(512)),
                "qk_nope_head_dim": self.get("mla.qk_nope_head_dim", self.names("qk_nope_head_dim"),
                                             self.dflt(128)),
                "qk_rope_head_dim": self.get("mla.qk_rope_head_dim", self.names("qk_rope_head_dim"),
                                             self.dflt(64)),
                "v_head_dim": self.get("mla.v_head_dim", self.names("v_head_dim"), self.dflt(128)),
                "rope": "none", "output_gate": gate}

    # -- AttnRes -----------------------------------------------------------------------------------------------
    def attn_res(self) -> Any:
        names = self.names("attn_res_block_size", "attention_residual_block_size", "block_attn_res_size")
        self.reject_for_kimi_linear(names, 0, "Block AttnRes")
        size = self.get("attn_res.block_size", names, None)
        if size is None or size == 0:
            return "off"
        return {"block_size": size}

    # -- MLP / MoE ---------------------------------------------------------------------------------------------
    def mlp(self, n: int) -> tuple[dict, dict | None]:
        """The mlp section and the moe section (None when no layer is MoE)."""
        types = self.mlp_layer_types(n)
        dense = [i for i in range(n) if types[i] == "dense"]
        any_moe = "sparse" in types
        activation = self.activation()
        mlp: dict[str, Any] = {"dense_layers": dense, "activation": activation}
        if dense or not any_moe:
            mlp["dense_intermediate_size"] = self.get("mlp.dense_intermediate_size", self.names("intermediate_size"),
                                                      self.dflt(9216))
        mlp.update(self.situ_betas(activation))
        self.check_routing()
        return mlp, (self.moe() if any_moe else None)

    def mlp_layer_types(self, n: int) -> list[str]:
        """'dense' or 'sparse' (MoE) per layer: mlp_layer_types, or first_k_dense_replace with moe_layer_freq."""
        mlt_names = self.names("mlp_layer_types")
        fk_names = self.names("first_k_dense_replace")
        freq_names = self.names("moe_layer_freq")
        fk_hit, freq_hit = self.r.find(fk_names), self.r.find(freq_names)
        freq = _int(freq_hit, freq_hit[0].data[freq_hit[1]], self.r, "moe_layer_freq", hi=4096) if freq_hit else 1
        if self.kl and freq != 1:
            raise freq_hit[0].error(freq_hit[1], "transformers' KimiLinear ignores moe_layer_freq (every layer "
                                                 "after first_k_dense_replace is MoE); only 1 is supported")
        fk = _int(fk_hit, fk_hit[0].data[fk_hit[1]], self.r, "first_k_dense_replace", lo=0, hi=n) if fk_hit else 1
        from_freq = ["dense" if i < fk or i % freq != 0 else "sparse" for i in range(n)]
        hit = self.r.find(mlt_names)
        if hit is None or hit[0].data[hit[1]] is None:
            if not self.kl and fk_hit is None:
                raise self.t.error(None, "missing required field 'first_k_dense_replace' (or 'mlp_layer_types')")
            where = fk_hit or freq_hit
            if where:
                self.r.record["mlp.dense_layers"] = (where[0].field(where[1]), where[0].key_line(where[1]))
            return from_freq
        scope, key = hit
        value = scope.data[key]
        if not isinstance(value, list) or len(value) != n:
            raise scope.error(key, f"must be a list of {n} entries 'dense' or 'sparse', got {_show(value)}")
        for i, item in enumerate(value):
            if item not in ("dense", "sparse"):
                raise scope.error(key, f"item {i} must be dense or sparse, got {_show(item)}", scope.item_line(key, i))
        if (fk_hit or freq_hit) and list(value) != from_freq:
            other = fk_hit or freq_hit
            raise other[0].error(other[1], f"disagrees with '{scope.field(key)}'")
        self.r.record["mlp.dense_layers"] = (scope.field(key), scope.key_line(key))
        return list(value)

    def activation(self) -> str:
        """The schema's MLP activation (swiglu or situ) that hidden_act names."""
        act_names = self.names("hidden_act")
        act = self.get("mlp.activation", act_names, "silu")
        acts = {"silu": "swiglu", "swiglu": "swiglu", "situ": "situ"}
        if not isinstance(act, str) or act not in acts or (self.kl and act != "silu"):
            scope, key = self.r.find(act_names)
            options = "silu" if self.kl else "silu, situ"
            raise scope.error(key, f"unsupported hidden_act {_show(act)}; supported: {options}")
        return acts[act]

    def situ_betas(self, activation: str) -> dict:
        """SiTU's betas (situ_betas = [gate, up], or situ_beta_gate / situ_beta_up); SwiGLU refuses them."""
        beta_pair = self.names("situ_betas", "hidden_act_betas")
        beta_g = self.names("situ_beta_gate")
        beta_u = self.names("situ_beta_up")
        if activation != "situ":
            for names in (beta_pair, beta_g, beta_u):
                hit = self.r.find(names)
                if hit is not None:
                    raise hit[0].error(hit[1], "only applies to hidden_act situ")
            return {}
        pair_hit = self.r.find(beta_pair)
        if pair_hit is None:
            return {"situ_beta_gate": self.get("mlp.situ_beta_gate", beta_g, 4.0),
                    "situ_beta_up": self.get("mlp.situ_beta_up", beta_u, 25.0)}
        scope, key = pair_hit
        pair = scope.data[key]
        if not isinstance(pair, list) or len(pair) != 2:
            raise scope.error(key, f"must be a list [beta_gate, beta_up], got {_show(pair)}")
        if self.r.find(beta_g) or self.r.find(beta_u):
            raise scope.error(key, "give either situ_betas or situ_beta_gate/situ_beta_up, not both")
        self.r.record["mlp.situ_beta_gate"] = self.r.record["mlp.situ_beta_up"] = (scope.field(key),
                                                                                    scope.key_line(key))
        return {"situ_beta_gate": pair[0], "situ_beta_up": pair[1]}

    def check_routing(self) -> None:
        """Refuse expert routing k3c does not run: LatentMoE under kimi_linear, grouped (n_group > 1) routing."""
        self.reject_for_kimi_linear(self.latent_names, None, "LatentMoE (routed_expert_hidden_size)")
        self.reject_for_kimi_linear(self.latent_norm_names, False, "LatentMoE's norm")
        group_names = self.names("n_group", "num_expert_group")
        topk_group_names = self.names("topk_group")
        groups = self.get(None, group_names, 1, null_is_default=True)
        topk_group = self.get(None, topk_group_names, groups, null_is_default=True)
        ghit = self.r.find(group_names)
        groups = _int(ghit, groups, self.r, "n_group", hi=1 << 16)
        if groups > 1 and topk_group != groups:
            raise ghit[0].error(ghit[1], f"grouped expert routing ({groups} groups, topk_group {topk_group}) is "
                                         f"not supported: k3c routes over all experts (set n_group 1)")

    def moe(self) -> dict:
        n_exp = self.get("moe.num_experts", self.names("n_routed_experts", "num_experts", "num_local_experts"),
                         self.dflt(256))
        top_k = self.get("moe.top_k", self.names("num_experts_per_tok", "num_experts_per_token"), self.dflt(8))
        shared = self.get("moe.num_shared_experts", self.names("n_shared_experts", "num_shared_experts"),
                          self.dflt(1, 0))
        inter = self.get("moe.expert_intermediate_size", self.names("moe_intermediate_size"), self.dflt(1024))
        router_names = self.names("moe_router_activation_func", "scoring_func")
        router = self.get("moe.router_activation", router_names, "sigmoid")
        if self.kl and router != "sigmoid":
            scope, key = self.r.find(router_names)
            raise scope.error(key, f"transformers' KimiLinear always routes with sigmoid scores, got "
                                   f"{_show(router)}")
        moe: dict[str, Any] = {
            "num_experts": n_exp, "top_k": top_k, "num_shared_experts": shared,
            "expert_intermediate_size": inter,
            "latent_dim": self.get("moe.latent_dim", self.latent_names, None),
            "latent_norm": self.get("moe.latent_norm", self.latent_norm_names, False),
            "router_activation": router,
            "router_bias": self.get("moe.router_bias", self.names("moe_router_bias"), True),
            "renormalize": self.get("moe.renormalize", self.names("norm_topk_prob", "moe_renormalize"), True),
            "routed_scaling_factor": self.get("moe.routed_scaling_factor", self.names("routed_scaling_factor"),
                                              self.dflt(2.446, 1.0)),
        }
        shared_size = self.get("moe.shared_intermediate_size", self.names("shared_expert_intermediate_size"), None)
        if shared_size is not None:
            self.reject_for_kimi_linear(self.names("shared_expert_intermediate_size"), None,
                                        "an explicit shared-expert width")
            moe["shared_intermediate_size"] = shared_size
        return moe

    @property
    def latent_names(self) -> list[tuple[_Scope | None, str]]:
        return self.names("routed_expert_hidden_size", "latent_moe_dim")

    @property
    def latent_norm_names(self) -> list[tuple[_Scope | None, str]]:
        return self.names("latent_moe_use_norm")

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
