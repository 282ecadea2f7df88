"""Located field access for the Hugging Face config import (hf_config.py, hf_families.py): a scope of the JSON
document with its file and lines (`_Scope`), the reader that finds a field under its aliases and records where each
schema field came from (`_Reader`), typed checks (`_int`, `_bool`), the typo check, and `HFFields`, the view of a
config's scopes the importers share."""
from __future__ import annotations

import difflib
import json
from typing import Any

from ..errors import SpecError
from .located import spec_error

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


class HFFields:
    """A config's scopes as the importers read them: `top` (the file), `t` (its text_config, or the file itself)
    and `lin` (linear_attn_config inside it), the located reader `r`, and whether the model type is kimi_linear
    (`kl`: transformers' defaults and refusals apply)."""

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

    @property
    def latent_names(self) -> list[tuple[_Scope | None, str]]:
        return self.names("routed_expert_hidden_size", "latent_moe_dim")

    @property
    def latent_norm_names(self) -> list[tuple[_Scope | None, str]]:
        return self.names("latent_moe_use_norm")
