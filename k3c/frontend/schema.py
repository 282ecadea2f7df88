"""YAML schema: validates a located mapping into a ModelSpec, with errors naming file, line and field.

Schema (every section but `model`, `layers` and `mlp` is optional):

    name: k3-tiny
    model:     {hidden_size, vocab_size, rms_norm_eps, max_context, tie_word_embeddings}
    layers:    {count, and one of: kinds [list] | pattern [list, repeated] | mla_layers / kda_layers [indices]}
               index_base: 0 | 1   (for index lists copied from published configs, which are 1-based)
    kda:       {num_heads, head_dim, conv_kernel, gate: softplus|safe, gate_lower_bound, gate_rank,
                output_gate: low_rank|full_rank, output_gate_rank}
    mla:       {num_heads, q_lora_rank (null = none), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                v_head_dim, rope: none, output_gate}
    attn_res:  {block_size}  or  attn_res: off
    mlp:       {dense_layers [indices] | first_k_dense, dense_intermediate_size,
                activation: situ|swiglu, situ_beta_gate, situ_beta_up}
    moe:       {num_experts, top_k, num_shared_experts, expert_intermediate_size, shared_intermediate_size,
                latent_dim (null = none), latent_norm, router_activation: sigmoid|softmax, router_bias,
                renormalize, routed_scaling_factor}
    precision: {weights: {format: bf16|mxfp4, include [patterns], exclude [patterns], scale_rule: floor|rceil},
                activations: bf16|mxfp8}
    quantization: {format: mxfp4, rule: floor|rceil, include [patterns], exclude [patterns]}
               (what the `mxfp4` pass packs; absent = nothing is quantized)
"""
from __future__ import annotations

import math
import re
from typing import Any

from ..errors import SpecError
from .located import MAX_SHOWN, LocDict, clean, did_you_mean, spec_error
from .quant_check import check_quantization
from .spec import (DEFAULT_MXFP4_INCLUDE, DEFAULT_QUANT_INCLUDE, LAYER_KINDS, ActivationSpec, AttnResSpec, KDASpec,
                   MLASpec, MLPSpec, ModelSpec, MoESpec, PrecisionSpec, QuantizationSpec, WeightPrecisionSpec)

MAX_DIM = 1 << 20          # widths (hidden, intermediate, ranks)
MAX_COUNT = 1 << 16        # layers, heads, experts
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 26
MAX_LAYERS = 4096
KDA_MIN_HEAD_DIM = 16      # the KDA kernels' chunk matmuls (tl.dot) need K >= 16
KDA_MAX_HEAD_DIM = 256     # the largest head dim the KDA kernels are built and checked for (K3: 128)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
PATTERN_RE = re.compile(r"^[A-Za-z0-9_.*?\[\]\-]{1,256}$")

# Every key each section accepts (docs/spec.md documents each one; tests check that the two agree).
SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "": ("name", "model", "layers", "kda", "mla", "attn_res", "mlp", "moe", "precision", "quantization"),
    "model": ("hidden_size", "vocab_size", "rms_norm_eps", "max_context", "tie_word_embeddings"),
    "layers": ("count", "index_base", "kinds", "pattern", "mla_layers", "kda_layers"),
    "kda": ("num_heads", "head_dim", "conv_kernel", "gate", "gate_lower_bound", "gate_rank", "output_gate",
            "output_gate_rank"),
    "mla": ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "rope", "output_gate"),
    "attn_res": ("block_size",),
    "mlp": ("dense_layers", "first_k_dense", "index_base", "dense_intermediate_size", "activation",
            "situ_beta_gate", "situ_beta_up"),
    "moe": ("num_experts", "top_k", "num_shared_experts", "expert_intermediate_size", "shared_intermediate_size",
            "latent_dim", "latent_norm", "router_activation", "router_bias", "renormalize", "routed_scaling_factor"),
    "precision": ("weights", "activations"),
    "precision.weights": ("format", "include", "exclude", "scale_rule"),
    "quantization": ("format", "rule", "include", "exclude"),
}
TOP_LEVEL = SECTION_KEYS[""]

_MISSING = object()


class Section:
    """Typed access to one mapping of the spec; records which keys were used to flag unknown ones.

    With `known` given, keys outside it are rejected at once (before any missing-field error), with a did-you-mean
    over the known keys and a hint when the key belongs to another section.
    """

    def __init__(self, data: Any, path: str, file: str, line: int | None, record: dict[str, int],
                 known: tuple[str, ...] | None = None):
        if not isinstance(data, dict):
            raise spec_error(f"must be a mapping, got {_show(data)}", file=file,
                             line=line if line is not None else getattr(data, "line", None),
                             field=path or None)
        self.data = data
        self.path = path
        self.file = file
        self.line = line if line is not None else getattr(data, "line", None)
        self.used: set[str] = set()
        self.record = record
        self.known = known
        if known is not None:
            for key in data:
                if key not in known:
                    raise self.error(key, f"unknown key '{_key(key)}'{_unknown_hint(key, known, path)}")

    # -- helpers -----------------------------------------------------------------------------------------
    def field(self, key: Any) -> str:
        return f"{self.path}.{_key(key)}" if self.path else _key(key)

    def key_line(self, key: Any) -> int | None:
        lines = getattr(self.data, "key_lines", {})
        return lines.get(key, self.line)

    def error(self, key: Any | None, message: str, line: int | None = None) -> SpecError:
        if line is None:
            line = self.key_line(key) if key is not None else self.line
        return spec_error(message, file=self.file, line=line,
                          field=self.field(key) if key is not None else (self.path or None))

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is _MISSING:
                where = f"section '{self.path}'" if self.path else "the spec"
                raise spec_error(f"missing required field '{self.field(key)}' in {where}", file=self.file,
                                 line=self.line, field=self.field(key))
            return default
        self.record[self.field(key)] = self.key_line(key)
        return self.data[key]

    def has(self, key: str) -> bool:
        return key in self.data

    # -- typed getters -----------------------------------------------------------------------------------
    def int(self, key: str, default: Any = _MISSING, *, lo: int = 1, hi: int = MAX_DIM,
            allow_none: bool = False) -> int | None:
        value = self.raw(key, default)
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            hint = ""
            if isinstance(value, float) and math.isfinite(value) and value == int(value):
                hint = (f" (write {int(value)}, without a decimal point)" if abs(value) < 1e18
                        else " (write it as an integer, without a decimal point or exponent)")
            elif isinstance(value, str):
                hint = _yaml12_hint(value, "int")
            raise self.error(key, f"must be an integer{' or null' if allow_none else ''}, got {_show(value)}{hint}")
        if not lo <= value <= hi:
            raise self.error(key, f"must be in [{lo}, {hi}], got {_show(value)}")
        return value

    def float(self, key: str, default: Any = _MISSING, *, lo: float = -math.inf, hi: float = math.inf,
              open_lo: bool = False) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, got {_show(value)}{_yaml12_hint(value, 'number')}")
        try:
            value = float(value)
        except OverflowError:
            raise self.error(key, f"is far too large: {_show(value)}") from None
        if not math.isfinite(value):
            raise self.error(key, f"must be finite, got {value}")
        if value < lo or value > hi or (open_lo and value == lo):
            bound = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
            raise self.error(key, f"must be in {bound}, got {value}")
        return value

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_show(value)}{_yaml12_hint(value, 'bool')}")
        return value

    def choice(self, key: str, options: tuple[str, ...], default: Any = _MISSING) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or value not in options:
            hint = did_you_mean(value, options) if isinstance(value, str) else ""
            raise self.error(key, f"must be one of {', '.join(options)}, got {_show(value)}{hint}")
        return value

    def str(self, key: str, default: Any = _MISSING, *, pattern: re.Pattern = NAME_RE) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or not pattern.match(value):
            raise self.error(key, f"must be a name (letters, digits, '_', '.', '-'; starting with a letter or "
                                  f"digit; at most 128 characters), got {_show(value)}")
        return value

    def list(self, key: str, default: Any = _MISSING, *, allow_none: bool = True) -> list | None:
        value = self.raw(key, default)
        if value is None and allow_none:
            return None
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {_show(value)}")
        return value

    def item_line(self, key: str, index: int) -> int | None:
        value = self.data.get(key)
        lines = getattr(value, "item_lines", None)
        if lines and index < len(lines):
            return lines[index]
        return self.key_line(key)

    def sub(self, key: str, default: Any = _MISSING, known: tuple[str, ...] | None = None) -> "Section | None":
        value = self.raw(key, default)
        if value is None:
            if default is _MISSING:
                raise self.error(key, f"section '{self.field(key)}' must be a mapping, got null (it is required)")
            return None
        if known is None:
            known = SECTION_KEYS.get(self.field(key))
        return Section(value, self.field(key), self.file, self.key_line(key), self.record, known)

    def finish(self) -> None:
        """Reject keys nobody asked for, suggesting the closest known one."""
        for key in self.data:
            if key not in self.used:
                known = self.known if self.known is not None else tuple(sorted(self.used))
                if key in known:
                    raise self.error(key, f"'{_key(key)}' does not apply with the other settings of "
                                          f"'{self.path or 'the spec'}'")
                raise self.error(key, f"unknown key '{_key(key)}'{_unknown_hint(key, known, self.path)}")


def _key(key: Any) -> str:
    return clean(key, MAX_SHOWN)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


def _short_repr(value: Any, budget: int = 40, depth: int = 0) -> str:
    """A bounded repr: never walks more than a few items (alias-bombed lists stay cheap)."""
    if isinstance(value, dict):
        if depth >= 2:
            return "{...}"
        parts = []
        for i, (k, v) in enumerate(value.items()):
            if i >= 3:
                parts.append("...")
                break
            parts.append(f"{_short_repr(k, 20, depth + 1)}: {_short_repr(v, 20, depth + 1)}")
        text = "{" + ", ".join(parts) + "}"
    elif isinstance(value, (list, tuple, set, frozenset)):
        if depth >= 2:
            return "[...]"
        parts = []
        for i, item in enumerate(value):
            if i >= 4:
                parts.append("...")
                break
            parts.append(_short_repr(item, 20, depth + 1))
        text = "[" + ", ".join(parts) + "]"
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        text = f"{'-' if value < 0 else ''}<integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    elif isinstance(value, (str, bytes)) and len(value) > budget:
        text = repr(value[:budget]) + "..."
    else:
        text = repr(value)
    return clean(text, budget)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = _short_repr(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return text
    return f"{_type_name(value)} {text}"


_YAML11_BOOLS = {"yes": "true", "no": "false", "on": "true", "off": "false", "y": "true", "n": "false"}
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_YAML11_BINARY = re.compile(r"^[-+]?0b[01_]+$")
_NUMBER_WITH_UNDERSCORES = re.compile(r"^[-+]?(?:0x[0-9a-fA-F_]+|0o[0-7_]+|[0-9_]*\.?[0-9_]+(?:[eE][-+]?[0-9]+)?)$")
_CORE_NUMBER = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|0o[0-7]+|0x[0-9a-fA-F]+)$")


def _yaml12_hint(value: Any, want: str) -> str:
    """A hint for a string where `want` ('bool', 'int' or 'number') was expected, when YAML 1.1 would have read it
    as one (specs are read as YAML 1.2: yes/no/on/off, 1:04 and 1_000 are strings), or it is a quoted number."""
    if not isinstance(value, str) or len(value) > 100:
        return ""
    shown = clean(value, MAX_SHOWN)
    low = value.lower()
    if low in _YAML11_BOOLS:
        if want == "bool":
            return f" ('{shown}' is a string in YAML 1.2; write {_YAML11_BOOLS[low]})"
        return f" ('{shown}' is a string in YAML 1.2, as k3c reads specs; YAML 1.1 read it as a boolean)"
    if want == "bool":
        return " (remove the quotes)" if low in ("true", "false") else ""
    if _SEXAGESIMAL.match(value):
        parts = value.lstrip("+-").replace("_", "").split(":")
        if "." not in value:
            total = 0
            for part in parts:
                total = total * 60 + int(part)
            sign = "-" if value.startswith("-") else ""
            return (f" ('{shown}' is a string in YAML 1.2; YAML 1.1 read it as the base-60 number "
                    f"{sign}{total}: write {sign}{total})")
        return f" ('{shown}' is a string in YAML 1.2; YAML 1.1 read it as a base-60 number: write the number)"
    if _YAML11_BINARY.match(value):
        sign = "-" if value.startswith("-") else ""
        n = int(value.lstrip("+-")[2:].replace("_", "") or "0", 2)
        return f" (binary '{shown}' is not a YAML 1.2 number: write {sign}{n} or {sign}{hex(n)})"
    if "_" in value and _NUMBER_WITH_UNDERSCORES.match(value) and _CORE_NUMBER.match(value.replace("_", "")):
        return f" ('_' digit separators are not part of YAML 1.2 numbers: write {value.replace('_', '')})"
    if re.match(r"^[-+]?0[XO][0-9a-fA-F]+$", value):
        return " (YAML 1.2 writes hex as 0x... and octal as 0o..., in lowercase)"
    if _CORE_NUMBER.match(value.strip()):
        return " (remove the quotes)"
    if low.lstrip("+-") in ("inf", "infinity", "nan"):
        return " (YAML writes infinity and not-a-number as .inf and .nan)"
    return ""


def _unknown_hint(key: Any, known, path: str) -> str:
    hint = did_you_mean(key, known)
    if hint:
        return hint
    homes = [sec for sec, keys in SECTION_KEYS.items() if key in keys and sec != path]
    if homes:
        where = " or ".join(f"'{h}'" if h else "the top level" for h in homes)
        return f" (it belongs in {where})"
    if known:
        return f" (known keys: {', '.join(known)})"
    return ""


# ----------------------------------------------------------------------------------------------------------
def spec_from_data(data: LocDict, file: str) -> ModelSpec:
    record: dict[str, int] = {}
    top = Section(data, "", file, 1, record, TOP_LEVEL)
    name = top.str("name", "model")
    model = top.sub("model")
    hidden = model.int("hidden_size")
    vocab = model.int("vocab_size", hi=MAX_VOCAB)
    eps = model.float("rms_norm_eps", 1e-5, lo=0.0, hi=1.0, open_lo=True)
    max_context = model.int("max_context", 4096, hi=MAX_CONTEXT)
    tie = model.bool("tie_word_embeddings", False)
    model.finish()

    layers = top.sub("layers")
    layer_kinds = _layer_kinds(layers)
    n_layers = len(layer_kinds)

    kda = _kda(top.sub("kda", None))
    mla = _mla(top.sub("mla", None))
    for kind, section_value in (("kda", kda), ("mla", mla)):
        if kind in layer_kinds and section_value is None:
            first = layer_kinds.index(kind)
            given = next((k for k in ("kinds", "pattern", "mla_layers", "kda_layers") if layers.has(k)), None)
            raise layers.error(given, f"layer {first} (0-based) is '{kind}' but the spec has no '{kind}' section")

    attn_res = _attn_res(top, n_layers)
    mlp = _mlp(top.sub("mlp"), top.sub("moe", None), n_layers, hidden)
    precision_sec = top.sub("precision", None)
    precision = _precision(precision_sec)
    quant_sec = top.sub("quantization", None)
    quantization = _quantization(quant_sec)
    top.finish()
    spec = ModelSpec(name=name, hidden_size=hidden, vocab_size=vocab, layer_kinds=layer_kinds, mlp=mlp, kda=kda,
                     mla=mla, attn_res=attn_res, precision=precision, quantization=quantization, rms_norm_eps=eps,
                     max_context=max_context, tie_word_embeddings=tie, source=file,
                     locations=tuple(sorted(record.items())))
    if quant_sec is not None:
        spec = check_quantization(spec, quant_sec, precision_sec)
    return spec


def _index_list(sec: Section, key: str, n_layers: int, base: int) -> tuple[list[int], dict[int, int | None]]:
    """0-based layer indices of `key` (a list of `base`-based indices) and the line of each."""
    items = sec.list(key, allow_none=False)
    out: list[int] = []
    lines: dict[int, int | None] = {}
    for i, item in enumerate(items):
        line = sec.item_line(key, i)
        if isinstance(item, bool) or not isinstance(item, int):
            raise sec.error(key, f"item {i} must be a layer index (an integer), got {_show(item)}"
                                 f"{_yaml12_hint(item, 'int')}", line)
        idx = item - base
        if not 0 <= idx < n_layers:
            why = "index_base 1: layers are numbered from 1, as published" if base == 1 else f"index_base {base}"
            raise sec.error(key, f"layer index {_show(item)} out of range for {n_layers} layers: valid "
                                 f"{base}..{n_layers - 1 + base} ({why})", line)
        if idx in lines:
            raise sec.error(key, f"layer index {item} listed twice (first at line {lines[idx]})", line)
        out.append(idx)
        lines[idx] = line
    return out, lines


def _layer_kinds(sec: Section) -> tuple[str, ...]:
    given = [k for k in ("kinds", "pattern", "mla_layers", "kda_layers") if sec.has(k)]
    by_kinds = bool(given) and given[0] == "kinds"
    count = sec.int("count", None if by_kinds else _MISSING, hi=MAX_LAYERS, allow_none=by_kinds)
    base = sec.int("index_base", 0, lo=0, hi=1)
    if not given:
        raise sec.error(None, "give one of 'kinds', 'pattern', 'mla_layers' or 'kda_layers'")
    if "kinds" in given and len(given) > 1:
        raise sec.error(given[1], f"'kinds' lists every layer; do not combine it with '{given[1]}'")
    if "pattern" in given and len(given) > 1:
        raise sec.error(given[1], f"'pattern' defines every layer; do not combine it with '{given[1]}'")

    def check_kinds(key: str) -> list[str]:
        items = sec.list(key, allow_none=False)
        if not items:
            raise sec.error(key, "must not be empty")
        if len(items) > MAX_LAYERS:
            raise sec.error(key, f"lists {len(items)} layers; at most {MAX_LAYERS}")
        for i, item in enumerate(items):
            if not isinstance(item, str) or item not in LAYER_KINDS:
                hint = did_you_mean(item, LAYER_KINDS) if isinstance(item, str) else ""
                raise sec.error(key, f"item {i} must be one of {', '.join(LAYER_KINDS)}, got {_show(item)}{hint}",
                                sec.item_line(key, i))
        return list(items)

    if "kinds" in given:
        kinds = check_kinds("kinds")
        if count is not None and count != len(kinds):
            raise sec.error("kinds", f"lists {len(kinds)} layers but count is {count}")
    elif "pattern" in given:
        pattern = check_kinds("pattern")
        if len(pattern) > count:
            raise sec.error("pattern", f"lists {len(pattern)} layers but count is {count}: a pattern is repeated "
                                       f"to count layers, so it cannot be longer (use 'kinds' to list every layer)")
        kinds = [pattern[i % len(pattern)] for i in range(count)]
    else:
        mla, _ = _index_list(sec, "mla_layers", count, base) if sec.has("mla_layers") else (None, {})
        kda, kda_lines = _index_list(sec, "kda_layers", count, base) if sec.has("kda_layers") else (None, {})
        if mla is not None and kda is not None:
            overlap = sorted(set(mla) & set(kda))
            if overlap:
                raise sec.error("kda_layers", f"layer {overlap[0] + base} is listed as both kda and mla",
                                kda_lines.get(overlap[0]))
            missing = sorted(set(range(count)) - set(mla) - set(kda))
            if missing:
                raise sec.error("kda_layers", f"layer {missing[0] + base} is in neither kda_layers nor mla_layers "
                                              "(give one list and the other layers take the other kind)")
        if mla is not None:
            mla_set = set(mla)
            kinds = ["mla" if i in mla_set else "kda" for i in range(count)]
        else:
            kda_set = set(kda)
            kinds = ["kda" if i in kda_set else "mla" for i in range(count)]
    sec.finish()
    return tuple(kinds)


def _kda(sec: Section | None) -> KDASpec | None:
    if sec is None:
        return None
    heads = sec.int("num_heads", hi=MAX_COUNT)
    head_dim = sec.int("head_dim", lo=-MAX_DIM, hi=MAX_DIM)
    if head_dim & (head_dim - 1) or not KDA_MIN_HEAD_DIM <= head_dim <= KDA_MAX_HEAD_DIM:
        raise sec.error("head_dim", f"must be a power of two in [{KDA_MIN_HEAD_DIM}, {KDA_MAX_HEAD_DIM}] (the KDA "
                                    f"kernels tile K = V in power-of-two blocks of at least 16), got {head_dim}")
    conv = sec.int("conv_kernel", 4, lo=-MAX_DIM, hi=MAX_DIM)
    if not 2 <= conv <= 64:
        raise sec.error("conv_kernel", f"must be in [2, 64], got {conv} (the KDA kernels carry conv_kernel - 1 past "
                                       "tokens; a 1-tap causal convolution would only be a scale)")
    gate = sec.choice("gate", ("softplus", "safe"), "safe")
    lb = sec.float("gate_lower_bound", -5.0, lo=-1e4, hi=0.0, open_lo=False)
    if gate == "safe" and lb == 0.0:
        raise sec.error("gate_lower_bound", "must be negative for the safe gate (0 means no decay at all)")
    gate_rank = sec.int("gate_rank", None, allow_none=True)
    out_gate = sec.choice("output_gate", ("low_rank", "full_rank"), "full_rank")
    out_rank = sec.int("output_gate_rank", None, allow_none=True)
    if out_gate == "full_rank" and out_rank is not None:
        raise sec.error("output_gate_rank", "only applies to output_gate: low_rank")
    sec.finish()
    return KDASpec(num_heads=heads, head_dim=head_dim, conv_kernel=conv, gate=gate, gate_lower_bound=lb,
                   gate_rank=gate_rank, output_gate=out_gate, output_gate_rank=out_rank)


def _mla(sec: Section | None) -> MLASpec | None:
    if sec is None:
        return None
    out = MLASpec(num_heads=sec.int("num_heads", hi=MAX_COUNT),
                  q_lora_rank=sec.int("q_lora_rank", None, allow_none=True),
                  kv_lora_rank=sec.int("kv_lora_rank"),
                  qk_nope_head_dim=sec.int("qk_nope_head_dim", hi=4096),
                  qk_rope_head_dim=_rope_dim(sec),
                  v_head_dim=sec.int("v_head_dim", hi=4096),
                  rope=sec.choice("rope", ("none",), "none"),
                  output_gate=sec.bool("output_gate", True))
    sec.finish()
    return out


def _rope_dim(sec: Section) -> int:
    value = sec.int("qk_rope_head_dim", lo=-MAX_DIM, hi=MAX_DIM)
    if not 1 <= value <= 4096:
        raise sec.error("qk_rope_head_dim", f"must be in [1, 4096], got {value} (the MLA kernels keep at least one "
                                            "rope dim beside the latent; under NoPE it is one more query/key dim)")
    return value


def _attn_res(top: Section, n_layers: int) -> AttnResSpec | None:
    value = top.raw("attn_res", None)
    if value is None or value is False or value == "off":
        return None
    if isinstance(value, str):
        hint = did_you_mean(value, ('off',))
        if value.lower() in _YAML11_BOOLS or value.lower() == "off":
            hint = f" ('{_key(value)}' is a string in YAML 1.2: write off or false to turn AttnRes off)"
        raise top.error("attn_res", f"must be a mapping {{block_size: N}} or 'off', got {_show(value)}{hint}")
    sec = Section(value, "attn_res", top.file, top.key_line("attn_res"), top.record, SECTION_KEYS["attn_res"])
    size = sec.int("block_size", hi=MAX_LAYERS)
    sec.finish()
    if size > n_layers:
        raise sec.error("block_size", f"block size {size} exceeds the {n_layers} layers (use attn_res: off)")
    return AttnResSpec(block_size=size)


def _mlp(sec: Section, moe_sec: Section | None, n_layers: int, hidden: int) -> MLPSpec:
    if sec.has("dense_layers") and sec.has("first_k_dense"):
        raise sec.error("first_k_dense", "give either dense_layers or first_k_dense, not both")
    if sec.has("index_base") and not sec.has("dense_layers"):
        raise sec.error("index_base", "only applies to dense_layers")
    if sec.has("first_k_dense"):
        k = sec.int("first_k_dense", lo=0, hi=n_layers)
        dense = tuple(range(k))
        dense_key = "first_k_dense"
    elif sec.has("dense_layers"):
        base = sec.int("index_base", 0, lo=0, hi=1)
        dense = tuple(sorted(_index_list(sec, "dense_layers", n_layers, base)[0]))
        dense_key = "dense_layers"
    else:
        dense = tuple(range(n_layers)) if moe_sec is None else ()
        dense_key = None
    if moe_sec is None and dense_key is not None and len(dense) < n_layers:
        raise sec.error(dense_key, f"makes {n_layers - len(dense)} of the {n_layers} layers MoE, but the spec has "
                                   "no 'moe' section (add one, or drop this key: without 'moe' every layer is dense)")
    needs_dense = bool(dense) or moe_sec is None
    dense_size = sec.int("dense_intermediate_size", _MISSING if needs_dense else None, allow_none=not needs_dense)
    kind = sec.choice("activation", ("situ", "swiglu"), "swiglu")
    beta_g = sec.float("situ_beta_gate", 4.0, lo=0.0, hi=1e6, open_lo=True)
    beta_u = sec.float("situ_beta_up", 25.0, lo=0.0, hi=1e6, open_lo=True)
    if kind == "swiglu":
        for key in ("situ_beta_gate", "situ_beta_up"):
            if sec.has(key):
                raise sec.error(key, "only applies to activation: situ")
    sec.finish()
    act = ActivationSpec(kind=kind, situ_beta_gate=beta_g, situ_beta_up=beta_u)
    moe = _moe(moe_sec, hidden) if moe_sec is not None else None
    if moe is not None and len(dense) == n_layers:
        raise sec.error(dense_key or "dense_layers", "every layer is dense, yet a 'moe' section is given")
    return MLPSpec(dense_layers=dense, dense_intermediate_size=dense_size or 0, activation=act, moe=moe)


def _moe(sec: Section, hidden: int) -> MoESpec:
    experts = sec.int("num_experts", hi=MAX_COUNT)
    top_k = sec.int("top_k", hi=MAX_COUNT)
    if top_k > experts:
        raise sec.error("top_k", f"top_k {top_k} exceeds num_experts {experts}")
    moe = MoESpec(num_experts=experts, top_k=top_k,
                  expert_intermediate_size=sec.int("expert_intermediate_size"),
                  num_shared_experts=sec.int("num_shared_experts", 0, lo=0, hi=MAX_COUNT),
                  shared_intermediate_size=sec.int("shared_intermediate_size", None, allow_none=True),
                  latent_dim=sec.int("latent_dim", None, allow_none=True),
                  latent_norm=sec.bool("latent_norm", False),
                  router_activation=sec.choice("router_activation", ("sigmoid", "softmax"), "sigmoid"),
                  router_bias=sec.bool("router_bias", True),
                  renormalize=sec.bool("renormalize", True),
                  routed_scaling_factor=sec.float("routed_scaling_factor", 1.0, lo=0.0, hi=1e4, open_lo=True))
    if moe.latent_norm and moe.latent_dim is None:
        raise sec.error("latent_norm", "needs latent_dim (the norm sits before the latent up projection)")
    if moe.latent_dim is not None and moe.latent_dim > hidden:
        raise sec.error("latent_dim", f"latent_dim {moe.latent_dim} exceeds hidden_size {hidden}")
    if moe.shared_intermediate_size is not None and moe.num_shared_experts == 0:
        raise sec.error("shared_intermediate_size", "given but num_shared_experts is 0")
    sec.finish()
    return moe


def _patterns(w: Section, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    items = w.list(key, None)
    if items is None:
        return default
    for i, item in enumerate(items):
        if not isinstance(item, str) or not PATTERN_RE.match(item):
            raise w.error(key, f"item {i} must be a weight-name pattern (letters, digits, _ . * ? [ ] -), "
                               f"got {_show(item)}", w.item_line(key, i))
    return tuple(items)


def _quantization(sec: Section | None) -> QuantizationSpec | None:
    """The section alone; check_quantization (quant_check.py) then matches its patterns against the weights."""
    if sec is None:
        return None
    fmt = sec.choice("format", ("mxfp4",))
    rule = sec.choice("rule", ("floor", "rceil"), "floor")
    include = _patterns(sec, "include", DEFAULT_QUANT_INCLUDE)
    exclude = _patterns(sec, "exclude", ())
    sec.finish()
    return QuantizationSpec(format=fmt, rule=rule, include=include, exclude=exclude)


def _precision(sec: Section | None) -> PrecisionSpec:
    if sec is None:
        return PrecisionSpec()
    w = sec.sub("weights", None)
    weights = WeightPrecisionSpec()
    if w is not None:
        fmt = w.choice("format", ("bf16", "mxfp4"), "bf16")
        include = _patterns(w, "include", DEFAULT_MXFP4_INCLUDE if fmt == "mxfp4" else ())
        exclude = _patterns(w, "exclude", ())
        rule = w.choice("scale_rule", ("floor", "rceil"), "floor")
        w.finish()
        if fmt == "bf16" and include:
            raise w.error("include", "patterns only apply to format: mxfp4")
        if fmt == "bf16" and exclude:
            raise w.error("exclude", "patterns only apply to format: mxfp4")
        weights = WeightPrecisionSpec(format=fmt, include=include, exclude=exclude, scale_rule=rule)
    acts = sec.choice("activations", ("bf16", "mxfp8"), "bf16")
    sec.finish()
    return PrecisionSpec(weights=weights, activations=acts)


# ----------------------------------------------------------------------------------------------------------
def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """The spec in the YAML schema's shape; `spec_from_data(spec_to_dict(s)) == s`."""
    out: dict[str, Any] = {
        "name": spec.name,
        "model": {"hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
                  "rms_norm_eps": spec.rms_norm_eps, "max_context": spec.max_context,
                  "tie_word_embeddings": spec.tie_word_embeddings},
        "layers": {"count": spec.num_layers, "kinds": list(spec.layer_kinds)},
    }
    if spec.kda is not None:
        k = spec.kda
        out["kda"] = {"num_heads": k.num_heads, "head_dim": k.head_dim, "conv_kernel": k.conv_kernel,
                      "gate": k.gate, "gate_lower_bound": k.gate_lower_bound, "gate_rank": k.gate_rank,
                      "output_gate": k.output_gate}
        if k.output_gate == "low_rank":
            out["kda"]["output_gate_rank"] = k.output_gate_rank
    if spec.mla is not None:
        m = spec.mla
        out["mla"] = {"num_heads": m.num_heads, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
                      "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
                      "v_head_dim": m.v_head_dim, "rope": m.rope, "output_gate": m.output_gate}
    out["attn_res"] = {"block_size": spec.attn_res.block_size} if spec.attn_res else "off"
    mlp = spec.mlp
    out["mlp"] = {"dense_layers": list(mlp.dense_layers), "activation": mlp.activation.kind}
    if mlp.dense_layers or mlp.moe is None or mlp.dense_intermediate_size:
        out["mlp"]["dense_intermediate_size"] = mlp.dense_intermediate_size
    if mlp.activation.kind == "situ":
        out["mlp"]["situ_beta_gate"] = mlp.activation.situ_beta_gate
        out["mlp"]["situ_beta_up"] = mlp.activation.situ_beta_up
    if mlp.moe is not None:
        e = mlp.moe
        out["moe"] = {"num_experts": e.num_experts, "top_k": e.top_k,
                      "expert_intermediate_size": e.expert_intermediate_size,
                      "num_shared_experts": e.num_shared_experts, "latent_dim": e.latent_dim,
                      "latent_norm": e.latent_norm, "router_activation": e.router_activation,
                      "router_bias": e.router_bias, "renormalize": e.renormalize,
                      "routed_scaling_factor": e.routed_scaling_factor}
        if e.shared_intermediate_size is not None:
            out["moe"]["shared_intermediate_size"] = e.shared_intermediate_size
    w = spec.precision.weights
    weights: dict[str, Any] = {"format": w.format, "scale_rule": w.scale_rule}
    if w.format == "mxfp4":
        weights["include"] = list(w.include)
        weights["exclude"] = list(w.exclude)
    out["precision"] = {"weights": weights, "activations": spec.precision.activations}
    q = spec.quantization
    if q is not None:
        out["quantization"] = {"format": q.format, "rule": q.rule, "include": list(q.include),
                               "exclude": list(q.exclude)}
    return out
