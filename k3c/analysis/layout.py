"""Parallel layout (TP, EP) and how each IR param is stored: category, precision, bytes, share per GPU.

Everything is read from the lowered IR. A param's canonical name (k3c/frontend/weight_names.py; every pass keeps
it) decides its category and how it is split; the layer's ops give the head and expert counts; its declared type
decides its bytes. The module attrs `weight_format`, `mxfp4_include` and `mxfp4_exclude` (fnmatch patterns over
canonical names) select the weights counted as MXFP4 (4.25 bits per weight) while they are still typed bf16; a
param a later `mxfp4` pass has already replaced with packed u8 / e8m0 tensors is counted as typed.

Sharding (the assumptions the report prints):
- KDA: per-head weights (q/k/v/g/f_b/b projections, convs, A_log, dt_bias, o_proj's input) split over TP by heads;
  the low-rank f_a / g_a projections and the per-head-dim o_norm are replicated.
- MLA: q_b (or q), kv_b, g and o split over TP by heads; q_a, kv_a_proj_with_mqa and their norms replicated
  (every rank needs the whole latent, and the latent cache is replicated on every TP rank).
- Dense MLP, shared experts, latent down/up projections: column/row parallel over TP.
- Routed experts: whole experts spread over EP ranks (ceil(E/EP) per rank); with TP > EP each expert is further
  split TP/EP ways. Router weight and bias, norms and AttnRes vectors: replicated.
- embed_tokens and lm_head: vocab-parallel over TP.
A replica spans world = max(TP, EP) GPUs; with EP > TP the attention runs EP/TP data-parallel copies.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from ..errors import ArgumentError, IRError, K3cError
from ..ir.core import DTYPE_BITS, Module, Op, TensorType
from ..ir.ops import bind
from ..limits import MAX_RANKS
from .formulas import ceil_div, mxfp4_bytes

FLOAT_WEIGHT_DTYPES = ("bf16", "f16", "f32", "f64")
DEFAULT_MXFP4_INCLUDE = ("layers.*.block_sparse_moe.experts.*",)

CATEGORIES = ("routed experts", "attention (KDA)", "attention (MLA)", "shared experts", "latent projections",
              "router", "dense MLP", "embeddings + lm_head", "norms, AttnRes and other")

# role -> split, per consuming op. "heads": split over TP by heads; "tp": column/row parallel; "ep": experts;
# "vocab": vocab-parallel; "rep": replicated. Roles are matched by prefix so packed variants (".weight_packed",
# ".weight_scale") of a later pass inherit their weight's rule.
_SPLITS: dict[str, tuple[tuple[str, str], ...]] = {
    "kda": (("f_a_proj", "rep"), ("g_a_proj", "rep"), ("o_norm", "rep"), ("", "heads")),
    "mla": (("q_a_proj", "rep"), ("q_a_layernorm", "rep"), ("kv_a_proj_with_mqa", "rep"),
            ("kv_a_layernorm", "rep"), ("", "heads")),
    "mlp": (("", "tp"),),
    "moe": (("gate.", "rep"), ("experts.", "ep"), ("shared_experts.", "tp"), ("routed_expert_norm", "rep"),
            ("routed_expert_", "tp"), ("", "rep")),
    "embedding": (("", "vocab"),),
    "lm_head": (("", "vocab"),),
}
# row-parallel roles: the input dim is split, the output is a partial sum of full width
ROW_PARALLEL = ("o_proj", "down_proj", "shared_experts.down_proj", "routed_expert_up_proj")

_CATEGORY_OF = {"kda": "attention (KDA)", "mla": "attention (MLA)", "mlp": "dense MLP",
                "embedding": "embeddings + lm_head", "lm_head": "embeddings + lm_head"}


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    ep: int = 1

    @classmethod
    def make(cls, tp: int = 1, ep: int | None = None) -> "ParallelLayout":
        """EP defaults to TP: all experts in each TP domain, spread over its GPUs (MI355X TP8 deployment)."""
        ep = tp if ep is None else ep
        for name, v in (("--tp", tp), ("--ep", ep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ArgumentError(f"{name} must be an integer >= 1, got {v!r}")
            if v > MAX_RANKS:
                raise ArgumentError(f"{name} must be <= {MAX_RANKS}, got {v}")
        if max(tp, ep) % min(tp, ep):
            raise ArgumentError(f"--tp {tp} and --ep {ep}: one must divide the other "
                                "(a replica spans max(TP, EP) GPUs)")
        return cls(tp, ep)

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def dp_attention(self) -> int:
        """Data-parallel attention copies inside one replica (EP > TP)."""
        return self.world // self.tp

    def __str__(self) -> str:
        dp = f", {self.dp_attention} attention replicas" if self.dp_attention > 1 else ""
        return f"TP {self.tp} x EP {self.ep} ({self.world} GPUs{dp})"


@dataclass(frozen=True)
class ParamInfo:
    name: str
    type: TensorType
    op: str | None            # consuming op ("kda", "moe", ...) or None
    role: str                 # the weight role it fills (canonical suffix)
    category: str
    precision: str            # "mxfp4" (bf16-typed, selected by the patterns) or the declared dtype
    numel: int
    bytes: int                # whole model, on disk
    payload_bytes: int        # MXFP4: E2M1 payload; otherwise = bytes
    scale_bytes: int          # MXFP4: E8M0 scales; otherwise 0
    split: str                # rep | heads | tp | ep | vocab
    gpu_fraction: float       # share of the param one GPU holds (the most loaded rank)

    @property
    def gpu_bytes(self) -> float:
        return self.bytes * self.gpu_fraction

    @property
    def gpu_numel(self) -> float:
        return self.numel * self.gpu_fraction

    @property
    def row_parallel(self) -> bool:
        return self.role.startswith(ROW_PARALLEL) and self.split in ("heads", "tp")


def mxfp4_selected(name: str, module: Module) -> bool:
    """The module's precision plan picks this canonical weight name for MXFP4."""
    if module.attr("weight_format", "bf16") != "mxfp4":
        return False
    include = module.attr("mxfp4_include", ()) or DEFAULT_MXFP4_INCLUDE
    exclude = module.attr("mxfp4_exclude", ()) or ()
    if isinstance(include, str):
        include = (include,)
    if isinstance(exclude, str):
        exclude = (exclude,)
    return any(fnmatchcase(name, p) for p in include) and not any(fnmatchcase(name, p) for p in exclude)


def param_bytes(name: str, ty: TensorType, module: Module) -> tuple[str, int, int, int]:
    """(precision, bytes, payload bytes, scale bytes) of one param as stored."""
    shape = ty.shape
    if any(not isinstance(d, int) for d in shape):
        raise K3cError(f"param '{name}' has a symbolic shape {ty}; the planner needs concrete weight shapes")
    numel = math.prod(shape)
    if ty.dtype in FLOAT_WEIGHT_DTYPES and len(shape) >= 2 and mxfp4_selected(name, module):
        k = shape[-1]
        rows = numel // k if k else 0
        payload, scales = rows * ceil_div(k, 2), rows * ceil_div(k, 32)
        assert payload + scales == mxfp4_bytes(rows, k)
        return "mxfp4", payload + scales, payload, scales
    bits = DTYPE_BITS.get(ty.dtype)
    if bits is None:
        raise K3cError(f"param '{name}': unknown dtype {ty.dtype}")
    nbytes = ceil_div(numel * bits, 8)
    return ty.dtype, nbytes, nbytes, 0


def consumers(module: Module) -> dict[str, tuple[Op, str]]:
    """param value -> (first consuming op, role name) from the op registry's roles."""
    out: dict[str, tuple[Op, str]] = {}
    params = {op.result for op in module.ops if op.op == "param"}
    for op in module.ops:
        if op.op == "param":
            continue
        try:
            bound = bind(op)
        except IRError:        # an op the registry does not know: no roles, the names decide (name_kind_role)
            bound = {}
        for role, v in bound.items():
            if v in params and v not in out:
                out[v] = (op, role)
        for v in op.inputs:
            if v in params and v not in out:
                out[v] = (op, "")
    return out


def op_params(module: Module, op: Op, by_name: dict[str, ParamInfo]) -> dict[str, ParamInfo]:
    """The params an op reads, keyed by their role as the canonical name gives it (`q_proj.weight`,
    `experts.w1`, ...): stable whatever input order or role names a pass gives its kernel-level ops."""
    out: dict[str, ParamInfo] = {}
    for v in op.inputs:
        d = module.defs.get(v)
        if d is not None and d.op == "param":
            p = by_name[d.attr("name")]
            out[p.name if p.role in out else p.role] = p
    return out


_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def name_kind_role(name: str, module: Module) -> tuple[str | None, str, int | None]:
    """(op kind, role, layer) of a canonical weight name (k3c/frontend/weight_names.py). Names are what every
    stage of the IR keeps, whatever kernel-level ops a pass splits a layer into."""
    if name == "embed_tokens.weight":
        return "embedding", name, None
    if name == "lm_head.weight":
        return "lm_head", name, None
    m = _LAYER_RE.match(name)
    if not m:
        return None, name, None
    layer = int(m.group(1))
    for section, kind in (("self_attn.", None), ("block_sparse_moe.", "moe"), ("mlp.", "mlp")):
        if name.startswith(m.group(0) + section):
            role = name[len(m.group(0) + section):]
            if kind is None:
                kinds = module.attr("layer_kinds", ())
                kind = kinds[layer] if layer < len(kinds) else "kda"
            return kind, role, layer
    return None, name[len(m.group(0)):], layer


def _split_for(kind: str | None, role: str) -> str:
    for prefix, split in _SPLITS.get(kind or "", ()):
        if role.startswith(prefix):
            return split
    return "rep"


def _category(kind: str | None, role: str, split: str) -> str:
    if kind == "moe":
        if split == "ep" or role.startswith("experts."):       # whole over EP, or split over TP (EP 1)
            return "routed experts"
        if role.startswith("shared_experts."):
            return "shared experts"
        if role.startswith("routed_expert_"):
            return "latent projections"
        return "router"
    return _CATEGORY_OF.get(kind or "", "norms, AttnRes and other")


def layer_attr(module: Module, attr: str) -> dict[int, int]:
    """layer -> the first int value of `attr` on an op of that layer (num_heads, num_experts), any IR stage."""
    out: dict[int, int] = {}
    for op in module.ops:
        layer, v = op.attr("layer", None), op.attr(attr, None)
        if isinstance(layer, int) and isinstance(v, int) and not isinstance(v, bool) and layer not in out:
            out[layer] = v
    return out


def classify_params(module: Module, layout: ParallelLayout) -> list[ParamInfo]:
    """Every param of the module with its category, precision, bytes and per-GPU share."""
    users = consumers(module)
    heads, experts = layer_attr(module, "num_heads"), layer_attr(module, "num_experts")
    sharded = "tp" in module.attr_dict or "ep" in module.attr_dict      # the shard pass ran: read its annotations
    out = []
    for op in module.ops:
        if op.op != "param":
            continue
        name = op.attr("name")
        ty = op.type
        kind, role, layer = name_kind_role(name, module)
        if kind is None and op.result in users:          # model-level norms, AttnRes output mix, ...
            cop, crole = users[op.result]
            kind, role = cop.op, crole or role
        split = _split_for(kind, role)
        units = {"heads": heads, "ep": experts}.get(split, {}).get(layer) if layer is not None else None
        precision, nbytes, payload, scales = param_bytes(name, ty, module)
        numel = math.prod(ty.shape)
        if op.attr("quant", None) == "mxfp4":
            # packed by the mxfp4 pass: the payload carries the source's weights (two per byte), the scales none
            is_payload = name.endswith(".weight_packed")
            precision, numel = "mxfp4", 2 * numel if is_payload else 0
            payload, scales = (nbytes, 0) if is_payload else (0, nbytes)
        fraction = None
        if sharded:         # what the rank holds: annotated params are 1/size of the whole, the rest replicated
            from ..passes.shard import parse_shard

            s = parse_shard(op.attr("shard", "") or "")
            split = "rep" if s is None else "ep" if s[0] == "ep" else {
                "kda": "heads", "mla": "heads", "lm_head": "vocab", "embedding": "vocab"}.get(kind or "", "tp")
            fraction = 1.0 if s is None else 1.0 / s[3]
        out.append(ParamInfo(name, ty, kind, role, _category(kind, role, split), precision,
                             numel, nbytes, payload, scales, split,
                             _fraction(split, ty, units, layout) if fraction is None else fraction))
    return out


def _fraction(split: str, ty: TensorType, units: int | None, layout: ParallelLayout) -> float:
    """Share of a param on the most loaded GPU; `units` = the layer's heads or experts when known."""
    tp, ep = layout.tp, layout.ep
    if split == "rep":
        return 1.0
    if split == "heads":
        return ceil_div(units, tp) / units if units else 1.0 / tp
    if split == "tp":
        return 1.0 / tp
    if split == "vocab":
        vocab = ty.shape[0] if ty.shape else 1
        return ceil_div(vocab, tp) / vocab if vocab else 1.0
    if split == "ep":
        experts = units or (ty.shape[0] if ty.shape else 1)
        return ceil_div(experts, ep) / experts * ep / layout.world
    raise AssertionError(split)
