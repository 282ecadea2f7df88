"""Checkpoint loading and saving: safetensors only, canonical weight names (weight_names.py) inside k3c.

    load_weights(spec, path, dtype=None, *, strict=True) -> dict[str, Tensor]
    save_k3_checkpoint(spec, weights, out_dir, *, shard_bytes=None) -> str
    k3_checkpoint_names(spec) -> dict[str, list[str]]

`path` is a Hugging Face model directory, one `.safetensors` file, or a sharded checkpoint's
`model.safetensors.index.json`. Pickle-based files (.bin, .pt, ...) are refused: k3c never unpickles.

Understood layouts (docs/hf-import.md has the full name table):
* the K3 published layout (K3.md section 8): prefix `language_model.model.`, per-expert `experts.{e}.w1/w3/w2.weight`,
  AttnRes `self_attention_res.proj_weight` (or the alias `self_attention_res_proj.weight`), ...;
* Kimi Linear as published and as transformers' `save_pretrained` writes it (the same names, prefix `model.`,
  the dense layer 0 under `block_sparse_moe.` or `mlp.`);
* transformers' in-memory KimiLinear names (`model.state_dict()` saved as is): fused `self_attn.conv1d.weight`
  [3W,1,K], `self_attn.forget_gate.*`, `A_log` [1,1,H,1], stacked `mlp.experts.gate_up_proj` [E,2m,z] and
  `mlp.experts.down_proj` [E,z,m].
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
from dataclasses import dataclass, field

import torch

from ..errors import WeightError
from ..ir.mxfp4_weights import packed_name
from ..outputs import loads_json
from ..paths import regular_file
from ..frontend.spec import ModelSpec
from ..frontend.weight_names import K3_CHECKPOINT_PREFIX, K3_LM_HEAD, WeightInfo, weight_table
from .devices import torch_dtype

__all__ = ["load_weights", "save_k3_checkpoint", "k3_checkpoint_names", "PICKLE_SUFFIXES"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".npy", ".npz", ".h5", ".msgpack")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Tensors of a multimodal checkpoint that k3c does not compile (K3.md section 8: the vision tower is ignored).
_IGNORED_PREFIXES = ("vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.",
                     "model.vision_tower.", "model.vision_model.", "model.mm_projector.",
                     "model.multi_modal_projector.", "language_model.vision_tower.")
_PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_shape")


def _weight_error(message: str) -> WeightError:
    """A one-line WeightError: control characters in tensor or file names are escaped."""
    if not message.isprintable():
        message = "".join(ch if ch.isprintable() or ch == " " else ascii(ch)[1:-1] for ch in message)
    return WeightError(message)


# ---------------------------------------------------------------------------------------------------------------
# Files
def _is_pickle(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(PICKLE_SUFFIXES) or ".bin.index.json" in lower or ".pt.index.json" in lower


def _pickle_error(file: str) -> WeightError:
    return _weight_error(f"{file}: pickle-based checkpoint files are not loaded (k3c never unpickles); convert the "
                       f"checkpoint to safetensors (e.g. with transformers' save_pretrained(safe_serialization=True))")


def _regular(path: str) -> str:
    """`path` when it is a regular file (a FIFO or device would block the read forever), else a WeightError."""
    return regular_file(path, "file", error=_weight_error)


def check_finite(name: str, t: torch.Tensor, where: str) -> torch.Tensor:
    """`t` when it holds no NaN or inf (float tensors; one isfinite().all() each), else a WeightError naming the
    tensor: a checkpoint with NaN weights is refused at load, not found out as non-finite logits."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise _weight_error(f"{where}: tensor '{name}' holds NaN or inf")
    return t


def _resolve_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read and, for an index, its weight_map (tensor name -> file path); each one a
    regular file."""
    files, weight_map = _resolve_paths(path)
    return [_regular(f) for f in files], weight_map


def _resolve_paths(path: str) -> tuple[list[str], dict[str, str] | None]:
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.lexists(index):
            return _read_index(_regular(index))
        single = os.path.join(path, SINGLE_NAME)
        if os.path.lexists(single):
            return [single], None
        names = sorted(os.listdir(path))
        shards = [os.path.join(path, n) for n in names if n.endswith(".safetensors")]
        if shards:
            return shards, None
        pickles = [n for n in names if _is_pickle(n)]
        if pickles:
            raise _pickle_error(os.path.join(path, pickles[0]))
        raise _weight_error(f"{path}: no safetensors weights in this directory (expected {SINGLE_NAME} or "
                          f"{INDEX_NAME})")
    if not os.path.exists(path):
        raise _weight_error(f"{path}: no such file or directory")
    _regular(path)                                   # not a FIFO, socket or device
    if _is_pickle(os.path.basename(path)):
        raise _pickle_error(path)
    if path.endswith(".json"):
        return _read_index(path)
    if path.endswith(".safetensors"):
        return [path], None
    raise _weight_error(f"{path}: not a safetensors file, index json or model directory")


def _read_index(index: str) -> tuple[list[str], dict[str, str]]:
    try:
        with open(index, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise _weight_error(f"{index}: cannot read the checkpoint index: {exc}") from None
    data = loads_json(raw, index, error=_weight_error)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _weight_error(f"{index}: not a safetensors index (no 'weight_map' object)")
    base = os.path.dirname(os.path.abspath(index))
    files: dict[str, str] = {}
    out_map: dict[str, str] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise _weight_error(f"{index}: tensor '{name}' maps to {shard!r}, not a file name in the index's "
                              f"directory")
        if _is_pickle(shard):
            raise _pickle_error(os.path.join(base, shard))
        if not shard.endswith(".safetensors"):
            raise _weight_error(f"{index}: tensor '{name}' maps to '{shard}', not a .safetensors file")
        full = os.path.join(base, shard)
        if shard not in files:
            if not os.path.lexists(full):
                raise _weight_error(f"{index}: shard '{shard}' (holding '{name}') does not exist")
            _regular(full)
            files[shard] = full
        out_map[name] = full
    return list(files.values()), out_map


def _to_dtype(dtype) -> torch.dtype | None:
    """None or a torch dtype as given; a name (any case) through the dtype table (k3c.runtime.devices)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return torch_dtype(dtype.lower() if isinstance(dtype, str) else dtype)


# ---------------------------------------------------------------------------------------------------------------
# Names
@dataclass(frozen=True)
class _Src:
    how: str              # direct | expert | gate_up | conv_qkv
    canon: str            # canonical target (for gate_up / conv_qkv: the prefix they expand from)
    key: str
    expert: int = -1


_ATTNRES_ALIAS = re.compile(r"^(self_attention|self_attn|mlp)_res_(proj|norm)\.weight$")
_ATTNRES_DOTTED = re.compile(r"^(self_attention|self_attn|mlp)_res\.(proj|norm)\.weight$")
_OUT_ATTNRES = re.compile(r"^output_attn_res(?:_(proj|norm)\.weight|\.(proj|norm)\.weight)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_NAMES = {"w1": "w1", "w3": "w3", "w2": "w2", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _normalize(spec: ModelSpec, key: str) -> _Src | None:
    """A checkpoint tensor name -> where it goes in k3c's canonical names; None = ignored (vision tower)."""
    if key.startswith(_IGNORED_PREFIXES) or key.endswith(".inv_freq"):
        return None
    if key.endswith((".weight_packed", ".weight_scale")):
        # MXFP4: k3c's stacked `experts.w1.weight_packed` or K3's per-expert `experts.{e}.w1.weight_packed`
        key_base, _, part = key.rpartition(".")
        src = _normalize(spec, key_base + ".weight")
        if src is None or src.how not in ("direct", "expert"):
            return src
        canon = src.canon[: -len(".weight")] if src.canon.endswith(".weight") else src.canon
        return _Src(src.how, f"{canon}.{part}", key, src.expert)
    if key.endswith(_PACKED_SUFFIXES):
        raise _weight_error(f"tensor '{key}': compressed-tensors {key.rpartition('.')[2]} is not part of the "
                          f"MXFP4 layout k3c reads (weight_packed + weight_scale, group 32)")
    k = key
    if k.startswith("language_model.lm_head."):
        k = "lm_head." + k[len("language_model.lm_head."):]
    else:
        for prefix in (K3_CHECKPOINT_PREFIX, "model.language_model.", "model."):
            if k.startswith(prefix):
                k = k[len(prefix):]
                break
    m = _OUT_ATTNRES.match(k)
    if m:
        part = m.group(1) or m.group(2)
        return _Src("direct", f"output_attn_res.{part}_weight", key)
    m = re.match(r"^layers\.(\d+)\.(.*)$", k)
    if not m:
        return _Src("direct", k, key)
    i, rest = int(m.group(1)), m.group(2)
    p = f"layers.{i}."
    if rest.startswith("self_attn.forget_gate."):
        rest = "self_attn." + rest[len("self_attn.forget_gate."):]
    if rest == "self_attn.conv1d.weight":
        return _Src("conv_qkv", p + "self_attn.", key)
    for pattern in (_ATTNRES_ALIAS, _ATTNRES_DOTTED):
        a = pattern.match(rest)
        if a:
            which = "mlp" if a.group(1) == "mlp" else "self_attention"
            return _Src("direct", f"{p}{which}_res.{a.group(2)}_weight", key)
    if rest.startswith("self_attn_res."):
        rest = "self_attention_res." + rest[len("self_attn_res."):]
    for old in ("mlp.", "block_sparse_moe."):
        if rest.startswith(old):
            moe = i < spec.num_layers and spec.is_moe_layer(i)
            body = rest[len(old):]
            if not moe:
                return _Src("direct", p + "mlp." + body, key)
            mp = p + "block_sparse_moe."
            e = _EXPERT.match(body)
            if e:
                return _Src("expert", f"{mp}experts.{_EXPERT_NAMES[e.group(2)]}", key, int(e.group(1)))
            if body == "experts.gate_up_proj":
                return _Src("gate_up", mp + "experts.", key)
            if body == "experts.down_proj":
                return _Src("direct", mp + "experts.w2", key)
            return _Src("direct", mp + body, key)
    return _Src("direct", p + rest, key)


def k3_checkpoint_names(spec: ModelSpec) -> dict[str, list[str]]:
    """Canonical weight name -> the tensor name(s) of the K3 published layout (per expert for stacked experts)."""
    out: dict[str, list[str]] = {}
    for info in weight_table(spec).values():
        if info.kind == "experts":
            prefix, _, proj = info.name.rpartition(".")
            out[info.name] = [f"{K3_CHECKPOINT_PREFIX}{prefix}.{e}.{proj}.weight" for e in range(info.shape[0])]
        elif info.name == "lm_head.weight":
            out[info.name] = [K3_LM_HEAD + ".weight"]
        else:
            out[info.name] = [K3_CHECKPOINT_PREFIX + info.name]
    return out


# ---------------------------------------------------------------------------------------------------------------
def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _fit(t: torch.Tensor, info: WeightInfo, expected: tuple[int, ...], key: str, file: str) -> torch.Tensor:
    """Check the shape; reshape the harmless variants (A_log [1,1,H,1], conv [W,K], proj_weight [1,d], ...)."""
    if not t.is_floating_point():
        raise _weight_error(f"{file}: tensor '{key}' has dtype {str(t.dtype).replace('torch.', '')}; expected a "
                          f"floating-point tensor (MXFP4 experts are read as `weight_packed` + `weight_scale`)")
    got = tuple(t.shape)
    if got == expected:
        return t
    if info.kind in ("vector", "norm", "conv", "attnres"):
        squeeze = lambda s: tuple(x for x in s if x != 1)  # noqa: E731
        numel_ok = t.numel() == _numel(expected)
        if numel_ok and (squeeze(got) == squeeze(expected) or info.kind == "vector"):
            return t.reshape(expected)
    raise _weight_error(f"{file}: tensor '{key}' (k3c '{info.name}') has shape {_fmt(got)}, expected "
                      f"{_fmt(expected)}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def load_weights(spec: ModelSpec, path: str | os.PathLike, dtype=None, *, strict: bool = True
                 ) -> dict[str, torch.Tensor]:
    """Read a safetensors checkpoint into k3c's canonical names, checking every tensor against the spec.

    dtype: None keeps the stored dtype; otherwise every "float" entry is converted to it. Entries the canonical
    table marks fp32 (A_log, dt_bias, e_score_correction_bias) are always float32.
    strict: unexpected tensors are errors (True) or ignored (False); missing tensors are always errors.
    """
    return dict(iter_weights(spec, path, dtype, strict=strict))


def iter_weights(spec: ModelSpec, path: str | os.PathLike, dtype=None, *, strict: bool = True,
                 experts_apart: bool = False):
    """load_weights one tensor at a time (yields (canonical name, tensor); a packed pair as two): what streams a
    checkpoint larger than memory (`k3c quantize`). Every check is load_weights'; the plan of sources is made,
    and an unexpected tensor refused, before the first tensor is read. `experts_apart`: a float expert stack
    comes one expert at a time (yields (name, expert [out, in]) E times, in order; read from K3's per-expert
    tensors or sliced from a stored stack), but for a fused transformers gate_up source, which comes whole."""
    path = os.fspath(path)
    target = _to_dtype(dtype)
    files, weight_map = _resolve_files(path)
    table = weight_table(spec)
    packed_table = packed_infos(table)
    record = None
    if os.path.isdir(path):                          # a `k3c quantize` directory says what it packed
        from ..quant.checkpoint import read_quantization_json

        record = read_quantization_json(path)
    with contextlib.ExitStack() as stack:
        stored = _open_stored(stack, files, weight_map, path)
        sources = _plan_sources(spec, stored, table, {**table, **packed_table}, path)
        if sources.unexpected and strict:
            key, canon = sources.unexpected[0]
            more = f" (and {len(sources.unexpected) - 1} more)" if len(sources.unexpected) > 1 else ""
            raise _weight_error(f"{stored.where[key]}: unexpected tensor '{key}' (k3c name '{canon}' is not a weight "
                              f"of spec '{spec.name}'){more}")
        for name in (record or {}).get("weights", ()):
            if name in table and not _given_packed(name, table[name], sources):
                raise _weight_error(f"{path}: quantization.json lists '{name}' as MXFP4 but the checkpoint holds "
                                  f"no '{packed_name(name, 'weight_packed')}'")
        fused_cache: dict[str, torch.Tensor] = {}
        uses = collections.Counter(src.key for src in sources.fused.values())
        for name, info in table.items():
            if _given_packed(name, info, sources):
                yield from _load_packed_pair(name, packed_table, sources, stored, path).items()
                continue
            want = torch.float32 if info.dtype == "fp32" else target
            if experts_apart and info.kind == "experts" and name not in sources.fused:
                for part in _expert_parts(name, info, sources, stored, path, spec):
                    part = part.to(want) if want is not None and part.dtype != want else part
                    yield name, check_finite(name, part.contiguous(), path)
                continue
            t = _load_float(name, info, sources, stored, path, spec, want, fused_cache)
            if want is not None and t.dtype != want:
                t = t.to(want)
            if name in sources.fused:               # a fused source is dropped once its last part is cut
                uses[sources.fused[name].key] -= 1
                if not uses[sources.fused[name].key]:
                    fused_cache.pop(sources.fused[name].key, None)
            yield name, check_finite(name, t.contiguous(), path)


@dataclass
class _Stored:
    """The tensors of a checkpoint's files: which file holds each name (each name stored once), open handles."""
    handles: dict
    where: dict[str, str]

    def get(self, key: str) -> torch.Tensor:
        return self.handles[self.where[key]].get_tensor(key)


def _open_stored(stack: contextlib.ExitStack, files: list[str], weight_map: dict[str, str] | None,
                 path: str) -> _Stored:
    """Every file opened on `stack`; a name stored twice, or an index that disagrees with the files, is refused."""
    from safetensors import safe_open

    handles, where = {}, {}
    for f in files:
        try:
            h = stack.enter_context(safe_open(f, framework="pt"))
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise _weight_error(f"{f}: not a readable safetensors file ({exc})") from None
        handles[f] = h
        for k in h.keys():
            if k in where:
                raise _weight_error(f"tensor '{k}' is stored twice: in {where[k]} and {f}")
            where[k] = f
    if weight_map is not None:
        for k, f in weight_map.items():
            if where.get(k) != f:
                raise _weight_error(f"{path}: the index maps '{k}' to {os.path.basename(f)}, but "
                                  f"{'that file does not hold it' if k not in where else 'it is in ' + where[k]}")
    return _Stored(handles, where)


@dataclass
class _Sources:
    """Where each canonical weight comes from in one checkpoint (load_weights' plan, made before any tensor is read)."""
    direct: dict[str, _Src] = field(default_factory=dict)
    experts: dict[str, dict[int, _Src]] = field(default_factory=dict)     # per-expert tensors of a stack
    fused: dict[str, _Src] = field(default_factory=dict)        # canonical name -> the fused source it is cut from
    owner: dict[str, _Src] = field(default_factory=dict)        # canonical name -> first source claiming it
    unexpected: list[tuple[str, str]] = field(default_factory=list)

    def claim(self, canon: str, src: _Src, path: str) -> None:
        prev = self.owner.setdefault(canon, src)
        if prev is not src and not (prev.how == src.how == "expert"):
            raise _weight_error(f"{path}: tensors '{prev.key}' and '{src.key}' both give k3c weight '{canon}'")


def _plan_sources(spec: ModelSpec, stored: _Stored, table: dict[str, WeightInfo], known: dict[str, WeightInfo],
                  path: str) -> _Sources:
    """Each stored tensor's canonical destination (`known`: the float table and its packed names)."""
    out = _Sources()
    for key in sorted(stored.where):
        src = _normalize(spec, key)
        if src is None:
            continue
        if src.how in ("direct", "expert"):
            if src.canon == "lm_head.weight" and spec.tie_word_embeddings:
                continue                        # tied: the embedding is the head
            if src.canon not in known or (src.how == "expert" and src.expert >= known[src.canon].shape[0]):
                suffix = f"[{src.expert}]" if src.how == "expert" else ""
                out.unexpected.append((key, src.canon + suffix))
                continue
            out.claim(src.canon, src, path)
            if src.how == "direct":
                out.direct[src.canon] = src
                continue
            slot = out.experts.setdefault(src.canon, {})
            if src.expert in slot:
                raise _weight_error(f"{path}: tensors '{slot[src.expert].key}' and '{key}' are both expert "
                                  f"{src.expert} of '{src.canon}'")
            slot[src.expert] = src
        else:
            parts = ("w1", "w3") if src.how == "gate_up" else ("q_conv1d.weight", "k_conv1d.weight",
                                                               "v_conv1d.weight")
            names = [src.canon + part for part in parts]
            if not all(n in table for n in names):
                out.unexpected.append((key, names[0]))
                continue
            for n in names:
                out.claim(n, src, path)
                out.fused[n] = src
    return out


def _given_packed(name: str, info: WeightInfo, sources: _Sources) -> bool:
    """The checkpoint gives `name` as MXFP4 (either part; a float tensor of the same name is read instead)."""
    return (name not in sources.direct and name not in sources.fused and info.kind in ("experts", "linear")
            and any(packed_name(name, part) in sources.owner for part in ("weight_packed", "weight_scale")))


def _load_packed_pair(name: str, packed_table: dict[str, WeightInfo], sources: _Sources, stored: _Stored,
                      path: str) -> dict[str, torch.Tensor]:
    out = {}
    for part in ("weight_packed", "weight_scale"):
        pname = packed_name(name, part)
        if pname not in sources.owner:
            other = sources.owner[packed_name(name, "weight_packed" if part == "weight_scale" else "weight_scale")]
            raise _weight_error(f"{path}: '{other.key}' has no matching {part} tensor (k3c '{pname}')")
        out[pname] = _load_packed(pname, packed_table[pname], sources.direct.get(pname), sources.experts.get(pname),
                                  stored.get, stored.where, path)
    if name in sources.experts:
        raise _weight_error(f"{path}: '{name}' is given both as floats and MXFP4-packed")
    return out


def _load_float(name: str, info: WeightInfo, sources: _Sources, stored: _Stored, path: str, spec: ModelSpec,
                want: torch.dtype | None, fused_cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """Canonical float weight `name` from its direct tensor, its fused source, or its per-expert tensors."""
    where = stored.where
    if name in sources.direct:
        src = sources.direct[name]
        return _fit(stored.get(src.key), info, info.shape, src.key, where[src.key])
    if name in sources.fused:
        src = sources.fused[name]
        if src.key not in fused_cache:
            fused_cache[src.key] = stored.get(src.key)
        return _cut(fused_cache[src.key], info, src, where[src.key], spec)
    slot = _expert_slot(name, info, sources, path, spec)
    t = None
    for e in range(info.shape[0]):
        src = slot[e]
        part = _fit(stored.get(src.key), info, info.shape[1:], src.key, where[src.key])
        if t is None:
            t = torch.empty(info.shape, dtype=want or part.dtype)
        t[e].copy_(part)
    return t


def _expert_slot(name: str, info: WeightInfo, sources: _Sources, path: str, spec: ModelSpec) -> dict[int, _Src]:
    """The per-expert sources of stack `name`, every expert there."""
    if name not in sources.experts:
        raise _weight_error(f"{path}: missing tensor '{name}' (k3c name; K3 layout "
                          f"'{k3_checkpoint_names(spec)[name][0]}'), expected shape {_fmt(info.shape)}")
    slot = sources.experts[name]
    n = info.shape[0]
    missing = [e for e in range(n) if e not in slot]
    if missing:
        prefix, _, proj = name.rpartition(".")
        raise _weight_error(f"{path}: missing tensor for expert {missing[0]} of '{name}' (k3c), e.g. "
                          f"'{K3_CHECKPOINT_PREFIX}{prefix}.{missing[0]}.{proj}.weight'"
                          f"{f' ({len(missing)} experts missing)' if len(missing) > 1 else ''}; "
                          f"expected {n} experts of shape {_fmt(info.shape[1:])}")
    return slot


_FLOAT_STORED = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _expert_parts(name: str, info: WeightInfo, sources: _Sources, stored: _Stored, path: str, spec: ModelSpec):
    """Expert stack `name` one expert [out, in] at a time: sliced from a stored stack (its header checked first),
    or K3's per-expert tensors."""
    if name in sources.direct:
        src = sources.direct[name]
        file = stored.where[src.key]
        view = stored.handles[file].get_slice(src.key)
        shape, dtype = tuple(view.get_shape()), view.get_dtype()
        if dtype not in _FLOAT_STORED:
            raise _weight_error(f"{file}: tensor '{src.key}' has dtype {dtype}; expected a floating-point tensor "
                              f"(MXFP4 experts are read as `weight_packed` + `weight_scale`)")
        if shape != tuple(info.shape):
            raise _weight_error(f"{file}: tensor '{src.key}' (k3c '{info.name}') has shape {_fmt(shape)}, expected "
                              f"{_fmt(info.shape)}")
        for e in range(info.shape[0]):
            yield view[e]
        return
    slot = _expert_slot(name, info, sources, path, spec)
    for e in range(info.shape[0]):
        src = slot[e]
        yield _fit(stored.get(src.key), info, info.shape[1:], src.key, stored.where[src.key])


def stored_peak_bytes(spec: ModelSpec, path: str | os.PathLike) -> int:
    """The most bytes iter_weights(..., experts_apart=True) reads at once from `path`: its largest stored tensor,
    a stored expert stack counted one expert at a time (from the files' headers; nothing is read)."""
    from safetensors import safe_open

    files, _ = _resolve_files(os.fspath(path))
    table = weight_table(spec)
    sizes = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}
    peak = 0
    for f in files:
        try:
            with safe_open(f, framework="pt") as h:
                for key in h.keys():
                    view = h.get_slice(key)
                    shape = view.get_shape()
                    n = _numel(shape) * sizes.get(view.get_dtype(), 1)
                    src = _normalize(spec, key)
                    if (src is not None and src.how == "direct" and src.canon in table
                            and table[src.canon].kind == "experts" and shape):
                        n //= shape[0]
                    peak = max(peak, n)
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise _weight_error(f"{f}: not a readable safetensors file ({exc})") from None
    return peak

def packed_infos(table: dict[str, WeightInfo]) -> dict[str, WeightInfo]:
    """`P.weight_packed` u8 [E, out, in/2] and `P.weight_scale` u8 [E, out, in/32] for every expert stack P, and
    `X.weight_packed` u8 [out, in/2] / `X.weight_scale` u8 [out, in/32] for every linear `X.weight` (kind
    "packed_linear"; k3c.ir.mxfp4_weights.packed_name)."""
    out = {}
    for name, info in table.items():
        if info.kind in ("experts", "linear") and info.shape[-1] % 32 == 0:
            lead, k = info.shape[:-1], info.shape[-1]
            kind = "packed" if info.kind == "experts" else "packed_linear"
            for part, cols in (("weight_packed", k // 2), ("weight_scale", k // 32)):
                pn = packed_name(name, part)
                out[pn] = WeightInfo(pn, (*lead, cols), "u8", kind)
    return out


def _packed_part(t: torch.Tensor, info: WeightInfo, expected: tuple, key: str, file: str) -> torch.Tensor:
    """One MXFP4 tensor as stored: uint8, or (compressed-tensors exports) weight_scale as float powers of two."""
    if info.name.endswith(".weight_scale") and t.is_floating_point():
        from ..quant.compressed_tensors import _float_scale_to_e8m0

        try:
            t = _float_scale_to_e8m0(t)
        except ValueError as exc:
            raise _weight_error(f"{file}: tensor '{key}': {exc}") from None
    if t.dtype != torch.uint8:
        raise _weight_error(f"{file}: tensor '{key}' (k3c '{info.name}') has dtype "
                          f"{str(t.dtype).replace('torch.', '')}; MXFP4 payload and E8M0 scales are uint8")
    if tuple(t.shape) != tuple(expected):
        raise _weight_error(f"{file}: tensor '{key}' (k3c '{info.name}') has shape {_fmt(t.shape)}, expected "
                          f"{_fmt(expected)} (MXFP4, blocks of 32 along the last dimension)")
    if info.name.endswith(".weight_scale") and bool((t == 255).any()):
        raise _weight_error(f"{file}: tensor '{key}' (k3c '{info.name}') holds the E8M0 NaN scale 0xFF")
    return t


def _load_packed(name: str, info: WeightInfo, direct: _Src | None, slot: dict | None, get, where, path
                 ) -> torch.Tensor:
    """A stacked MXFP4 tensor from k3c's stacked layout or from K3's per-expert compressed-tensors layout."""
    if direct is not None:
        return _packed_part(get(direct.key), info, info.shape, direct.key, where[direct.key]).contiguous()
    n = info.shape[0]
    missing = [e for e in range(n) if e not in slot]
    if missing:
        prefix, _, rest = name.partition(".experts.")
        proj, _, part = rest.partition(".")
        raise _weight_error(f"{path}: missing tensor for expert {missing[0]} of '{name}' (k3c), e.g. "
                          f"'{K3_CHECKPOINT_PREFIX}{prefix}.experts.{missing[0]}.{proj}.{part}'"
                          f"{f' ({len(missing)} experts missing)' if len(missing) > 1 else ''}")
    out = torch.empty(info.shape, dtype=torch.uint8)
    for e in range(n):
        src = slot[e]
        out[e].copy_(_packed_part(get(src.key), info, info.shape[1:], src.key, where[src.key]))
    return out


def _cut(t: torch.Tensor, info: WeightInfo, src: _Src, file: str, spec: ModelSpec) -> torch.Tensor:
    """One canonical tensor out of a fused transformers tensor (conv1d [3W,1,K] or experts.gate_up_proj)."""
    if not t.is_floating_point():
        raise _weight_error(f"{file}: tensor '{src.key}' has dtype {t.dtype}; expected a floating-point tensor")
    if src.how == "conv_qkv":
        w, one, k = info.shape
        expected = (3 * w, one, k)
        if tuple(t.shape) == (3 * w, k):
            t = t.unsqueeze(1)
        if tuple(t.shape) != expected:
            raise _weight_error(f"{file}: tensor '{src.key}' (fused q/k/v conv of k3c '{info.name}') has shape "
                              f"{_fmt(t.shape)}, expected {_fmt(expected)}")
        which = "qkv".index(info.name.rpartition(".")[0].rpartition(".")[2][0])
        return t[which * w:(which + 1) * w]
    e, m, z = info.shape
    expected = (e, 2 * m, z)
    if tuple(t.shape) != expected:
        raise _weight_error(f"{file}: tensor '{src.key}' (fused gate/up of k3c '{info.name}') has shape "
                          f"{_fmt(t.shape)}, expected {_fmt(expected)}")
    return t[:, :m] if info.name.endswith(".w1") else t[:, m:]


# ---------------------------------------------------------------------------------------------------------------
def save_k3_checkpoint(spec: ModelSpec, weights: dict[str, torch.Tensor], out_dir: str | os.PathLike, *,
                       shard_bytes: int | None = None) -> str:
    """Write `weights` (canonical names) in the K3 published layout: config.json (model_type kimi_k3 with a
    text_config, from spec_to_hf_config) and model.safetensors, or shards of at most `shard_bytes` plus
    model.safetensors.index.json. Returns the directory."""
    from safetensors.torch import save_file

    from ..frontend.hf_export import spec_to_hf_config

    out_dir = os.fspath(out_dir)
    table = weight_table(spec)
    packed = packed_infos(table)
    for n in list(table):            # MXFP4 stacks are written per expert in compressed-tensors' layout
        pn, sn = packed_name(n, "weight_packed"), packed_name(n, "weight_scale")
        if n not in weights and pn in weights and sn in weights:
            del table[n]
            table.update({p: packed[p] for p in (pn, sn)})
    missing = [n for n in table if n not in weights]
    if missing:
        raise _weight_error(f"cannot save: missing tensor '{missing[0]}' (expected shape "
                          f"{_fmt(table[missing[0]].shape)})")
    extra = [n for n in weights if n not in table]
    if extra:
        raise _weight_error(f"cannot save: '{extra[0]}' is not a weight of spec '{spec.name}'")
    names = k3_checkpoint_names(spec)
    tensors: dict[str, torch.Tensor] = {}
    for name, info in table.items():
        t = weights[name]
        if tuple(t.shape) != info.shape:
            raise _weight_error(f"cannot save: tensor '{name}' has shape {_fmt(t.shape)}, expected {_fmt(info.shape)}")
        t = t.detach().cpu()
        if info.kind == "packed_linear":      # compressed-tensors names a packed Linear `X.weight_packed`
            part = "weight_packed" if name.endswith("weight_packed") else "weight_scale"
            key = names[name[: -len(part)] + "weight"][0]
            tensors[f"{key[: -len('weight')]}{part}"] = t.clone().contiguous()
        elif info.kind == "packed":
            src, _, part = name.rpartition(".")
            for e, key in enumerate(names[src]):
                tensors[f"{key[: -len('.weight')]}.{part}"] = t[e].clone().contiguous()
        elif info.kind == "experts":
            for e, key in enumerate(names[name]):
                tensors[key] = t[e].clone().contiguous()
        else:
            tensors[names[name][0]] = t.clone().contiguous()

    os.makedirs(out_dir, exist_ok=True)
    config = spec_to_hf_config(spec)
    quant = config["text_config"].get("quantization_config")
    if quant is not None and not any(i.kind in ("packed", "packed_linear") for i in table.values()):
        # the tensors written here are unpacked floats: say so (k3c quantizes at compile time, from the spec)
        quant["format"] = "dense"
        quant["quantization_status"] = "frozen"
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
    meta = {"format": "pt"}
    if shard_bytes is None:
        save_file(tensors, os.path.join(out_dir, SINGLE_NAME), metadata=meta)
        return out_dir
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, INDEX_NAME), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        fh.write("\n")
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
def load_weight_slices(spec: ModelSpec, path: str | os.PathLike, shards: dict, dtype=None) -> dict[str, torch.Tensor]:
    """One rank's weights (the `shard` pass; docs/distributed.md): `shards` maps each canonical name the rank
    needs to (dim, rank, size) or None (the whole tensor). Only those bytes are read: safetensors `get_slice` for
    split tensors, only the rank's experts for per-expert layouts. Other tensors in the checkpoint are not read
    or checked (load_weights validates a whole checkpoint)."""
    path = os.fspath(path)
    target = _to_dtype(dtype)
    files, weight_map = _resolve_files(path)
    table = weight_table(spec)
    with contextlib.ExitStack() as stack:
        stored = _open_stored(stack, files, weight_map, path)
        where = stored.where
        handles = {k: stored.handles[f] for k, f in where.items()}
        direct, experts, fused = {}, {}, {}
        for key in sorted(where):
            src = _normalize(spec, key)
            if src is None:
                continue
            if src.how == "direct":
                direct[src.canon] = src
            elif src.how == "expert":
                experts.setdefault(src.canon, {})[src.expert] = src
            else:
                parts = ("w1", "w3") if src.how == "gate_up" else ("q_conv1d.weight", "k_conv1d.weight",
                                                                   "v_conv1d.weight")
                for part in parts:
                    fused[src.canon + part] = src

        def region(shape, shard):
            """Index tuple selecting the shard of a tensor of `shape`, and the local shape."""
            if shard is None:
                return (), tuple(shape)
            dim, rank, size = shard
            n = shape[dim] // size
            local = tuple(n if i == dim else s for i, s in enumerate(shape))
            return (slice(None),) * dim + (slice(rank * n, (rank + 1) * n),), local

        out: dict[str, torch.Tensor] = {}
        for name, shard in shards.items():
            info = table.get(name)
            if info is None:
                raise _weight_error(f"'{name}' is not a weight of spec '{spec.name}'")
            idx, local = region(info.shape, shard)
            if name in direct:
                src = direct[name]
                sl = handles[src.key].get_slice(src.key)
                if tuple(sl.get_shape()) == info.shape:
                    t = sl[idx] if idx else sl[:]
                else:       # a harmless layout variant (A_log [1,1,H,1], ...): small, read whole, then cut
                    t = _fit(handles[src.key].get_tensor(src.key), info, info.shape, src.key, where[src.key])
                    t = t[idx] if idx else t
            elif name in experts:
                # split by expert (EP): this rank's experts whole; split inside each expert (TP, EP 1): every
                # expert, each cut along the same dim
                by_expert = shard is not None and shard[0] == 0
                lo, hi = (idx[0].start, idx[0].stop) if by_expert else (0, info.shape[0])
                inner = idx[1:] if shard is not None and not by_expert else ()
                slot = experts[name]
                missing = [e for e in range(lo, hi) if e not in slot]
                if missing:
                    raise _weight_error(f"{path}: missing tensor for expert {missing[0]} of '{name}' (k3c)")
                t = torch.stack([_fit(handles[slot[e].key].get_tensor(slot[e].key), info, info.shape[1:],
                                      slot[e].key, where[slot[e].key])[inner] for e in range(lo, hi)])
            elif name in fused:
                src = fused[name]
                if src.how == "gate_up":            # [E, 2m, z]: read only this rank's experts
                    e_idx = idx[0] if idx and shard[0] == 0 else slice(None)
                    part = handles[src.key].get_slice(src.key)[e_idx]
                    t = _cut(part, WeightInfo(info.name, (part.shape[0],) + info.shape[1:], info.dtype, info.kind),
                             src, where[src.key], spec)
                    if shard is not None and shard[0] != 0:
                        t = t[idx]
                else:                               # fused q/k/v conv: small
                    t = _cut(handles[src.key].get_tensor(src.key), info, src, where[src.key], spec)
                    t = t[idx] if idx else t
            else:
                raise _weight_error(f"{path}: missing tensor '{name}' (k3c name; K3 layout "
                                    f"'{k3_checkpoint_names(spec)[name][0]}'), expected shape {_fmt(info.shape)}")
            if tuple(t.shape) != local:
                raise _weight_error(f"{path}: '{name}' slice has shape {_fmt(t.shape)}, expected {_fmt(local)}")
            want = torch.float32 if info.dtype == "fp32" else target
            if want is not None and t.dtype != want:
                t = t.to(want)
            out[name] = check_finite(name, t.contiguous(), path)
        return out
