"""Memory planner: weight bytes (whole model and per GPU) and per-GPU serving memory, all read from the IR.

Per GPU, for `batch` sequences of `context` tokens each on one attention replica (a TP group):
  weights      sum of the params' per-GPU shares (layout.py)
  MLA cache    batch x pages(context) x (kv_lora_rank + qk_rope_head_dim) x kv_bytes per MLA layer; the latent
               cache is not head-sharded: every TP rank holds all of it
  KDA state    batch x heads/TP x head_dim^2 x 4 (fp32) per KDA layer
  conv tails   batch x conv channels/TP x (kernel - 1) x act_bytes per KDA layer
  AttnRes      completed blocks x ceil(prefill_chunk / TP) x hidden x act_bytes (blocks of one prefill chunk,
               sequence-sharded over TP as in the AttnRes paper s4.2); x prefill_chunk without sequence parallel
  workspace    activations of one prefill step (`workspace_breakdown`)
  KDA prefix   batch x ceil(context / interval) checkpoints x (KDA state + conv tails + one logits row), with a
  checkpoints  prefix-cache interval (k3c.runtime.prefix_cache.PrefixCache: a checkpoint every `interval` tokens and
               at the prompt end; its MLA rows are the sequence's own pages, shared, so not counted again)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..codegen.kernels.mla_common import LATENT_FP8, latent_row_width
from ..ir.core import DTYPE_BITS, Module, Op
from .formulas import ceil_div
from .layout import CATEGORIES, ParallelLayout, ParamInfo, classify_params, op_params

KV_DTYPES = ("bf16", "fp8")


def kv_row_bytes(kv_dtype: str, row_values: int) -> int:
    """Bytes the runtime stores per cached token and MLA layer for a latent row of `row_values` (L + R) values: 2 per
    value in bf16; in fp8 the e4m3 codes and the row's two fp32 scales, padded to 16 bytes (the row format of
    codegen/kernels/mla_common.py): 592 for K3's 576."""
    if kv_dtype == "fp8":
        return latent_row_width(row_values, 0, LATENT_FP8)
    return 2 * row_values


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from the IR, gathered once."""

    name: str
    hidden: int
    vocab: int
    act_bytes: float                   # the module's activation dtype (bf16: 2)
    max_context: int
    activation_format: str
    mla: tuple[Op, ...]
    kda: tuple[Op, ...]
    moe: tuple[Op, ...]
    mlp: tuple[Op, ...]
    attn_res: tuple[Op, ...]
    attnres_blocks: int                # completed blocks the last mixes read (b_0 = embedding included)
    num_ops: int
    attnres_sources: int = 0           # block representations in all: b_0 .. b_N (the output mix's sources)

    @classmethod
    def from_module(cls, module: Module) -> "ModelFacts":
        dtype = module.attr("dtype", "bf16")

        def named(*names):
            return tuple(op for op in module.ops if op.op in names)
        # layer ops of the frontend, or the kernel-level ops a pass split them into (same attrs)
        mixes = named("attn_res_mix", "attn_res_phase2")
        phase1 = named("attn_res_phase1")
        blocks = max([op.attr("block", 0) for op in module.ops_named("attn_res_mix")]
                     + [op.attr("num_sources", 0) for op in phase1], default=0)
        sources = max([op.attr("num_sources", 0) for op in module.ops_named("attn_res_mix")]
                      + [op.attr("num_sources", 0) + 1 for op in phase1], default=0)
        return cls(module.name, int(module.attr("hidden_size", 0) or _hidden_from_ops(module)),
                   int(module.attr("vocab_size", 0) or 0), DTYPE_BITS.get(dtype, 16) / 8,
                   int(module.attr("max_context", 0) or 0), str(module.attr("activation_format", "bf16")),
                   named("mla", "mla_absorbed"), named("kda", "kda_attn"), named("moe"), named("mlp"), mixes,
                   int(blocks), len(module.ops), int(sources))


def _hidden_from_ops(module: Module) -> int:
    for op in module.ops:
        if op.op == "embedding":
            return int(op.type.shape[-1])
    return 0


# ---- weights ---------------------------------------------------------------------------------------------
@dataclass
class WeightReport:
    params: list[ParamInfo]
    total_bytes: int                  # on disk: every param
    gpu_bytes: float                  # resident per GPU: params used at run time + weight-transform results
    routed_expert_bytes: int
    total_params: int
    active_params: float
    by_category: dict[str, dict]
    by_precision: dict[str, dict]
    derived: list[dict] = field(default_factory=list)     # weight-transform results (resident)
    dropped: list[str] = field(default_factory=list)      # params read only by weight transforms (freed at load)

    @property
    def by_name(self) -> dict[str, ParamInfo]:
        return {p.name: p for p in self.params}


def weight_report(module: Module, layout: ParallelLayout, facts: ModelFacts | None = None) -> WeightReport:
    facts = facts or ModelFacts.from_module(module)
    params = classify_params(module, layout)
    by_cat: dict[str, dict] = {c: {"params": 0, "bytes": 0, "gpu_bytes": 0.0, "precisions": set()}
                               for c in CATEGORIES}
    by_prec: dict[str, dict] = {}
    for p in params:
        c = by_cat.setdefault(p.category, {"params": 0, "bytes": 0, "gpu_bytes": 0.0, "precisions": set()})
        c["params"] += p.numel
        c["bytes"] += p.bytes
        c["gpu_bytes"] += p.gpu_bytes
        c["precisions"].add(p.precision)
        if p.precision == "mxfp4":
            for key, b, gb in (("mxfp4 payload (E2M1)", p.payload_bytes, p.payload_bytes * p.gpu_fraction),
                               ("mxfp4 scales (E8M0)", p.scale_bytes, p.scale_bytes * p.gpu_fraction)):
                d = by_prec.setdefault(key, {"params": 0, "bytes": 0, "gpu_bytes": 0.0})
                d["bytes"] += b
                d["gpu_bytes"] += gb
            by_prec["mxfp4 payload (E2M1)"]["params"] += p.numel
        else:
            d = by_prec.setdefault(p.precision, {"params": 0, "bytes": 0, "gpu_bytes": 0.0})
            d["params"] += p.numel
            d["bytes"] += p.bytes
            d["gpu_bytes"] += p.gpu_bytes
    for c in by_cat.values():
        c["precisions"] = sorted(c["precisions"])
    derived, dropped = _weight_transforms(module, params, by_cat)
    routed = sum(p.bytes for p in params if p.category == "routed experts")
    routed_params = sum(p.numel for p in params if p.category == "routed experts")
    total_params = sum(p.numel for p in params)
    embed = sum(p.numel for p in params if p.name == "embed_tokens.weight" and p.op == "embedding")
    frac = 1.0
    if facts.moe:
        op = facts.moe[0]
        frac = op.attr("top_k") / op.attr("num_experts")
    active = total_params - routed_params - embed + routed_params * frac
    resident = (sum(p.gpu_bytes for p in params if p.name not in dropped)
                + sum(d["gpu_bytes"] for d in derived))
    return WeightReport(params, sum(p.bytes for p in params), resident, routed, total_params, active,
                        {k: v for k, v in by_cat.items() if v["params"]}, by_prec, derived, sorted(dropped))


def weight_derived_values(module: Module) -> dict[str, Op]:
    """Values computed from params only, with static shapes: weight transforms a pass introduced (W_kvb split,
    folded AttnRes queries, ...), evaluated once when weights load."""
    derived: dict[str, Op] = {}
    params = {op.result for op in module.ops if op.op == "param"}
    for op in module.ops:
        if op.op in ("param", "input") or not op.inputs:
            continue
        if all(v in params or v in derived for v in op.inputs) and all(
                all(isinstance(d, int) for d in t.shape) for t in op.types):
            for r in op.results:
                derived[r] = op
    return derived


def _weight_transforms(module: Module, params: list[ParamInfo], by_cat: dict) -> tuple[list[dict], set[str]]:
    """Resident results of weight transforms, and the params only transforms read (freed after load)."""
    derived = weight_derived_values(module)
    if not derived:
        return [], set()
    info = {op.result: p for op, p in zip((o for o in module.ops if o.op == "param"), params)}
    sharded = "tp" in module.attr_dict or "ep" in module.attr_dict      # the shard pass ran (as classify_params)
    runtime_users: dict[str, int] = {}
    all_users: dict[str, int] = {}
    for op in module.ops:
        runtime = op.results[0] not in derived if op.results else True
        for v in set(op.inputs):
            all_users[v] = all_users.get(v, 0) + 1
            if runtime:
                runtime_users[v] = runtime_users.get(v, 0) + 1
    out = []
    source: dict[str, ParamInfo] = {}
    for value, op in derived.items():
        src = next((info[v] if v in info else source.get(v) for v in op.inputs
                    if v in info or v in source), None)
        if src is not None:
            source[value] = src
        if value not in runtime_users:
            continue
        ty = module.types[value]
        nbytes = math.prod(ty.shape) * DTYPE_BITS.get(ty.dtype, 16) / 8
        frac = src.gpu_fraction if src is not None else 1.0
        cat = src.category if src is not None else "norms, AttnRes and other"
        # a rank's IR (sharded.unshard_view restores whole-model types of params only) types a transform's result
        # with the rank's slice already: that is its per-GPU size, and the whole model's is size / share
        whole, gpu = (nbytes / frac, nbytes) if sharded else (nbytes, nbytes * frac)
        out.append({"value": value, "op": op.op, "category": cat, "bytes": whole, "gpu_bytes": gpu})
        if cat in by_cat:
            by_cat[cat]["gpu_bytes"] += gpu
    dropped = {p.name for v, p in info.items() if all_users.get(v, 0) and not runtime_users.get(v, 0)}
    for p in params:
        if p.name in dropped and p.category in by_cat:
            by_cat[p.category]["gpu_bytes"] -= p.gpu_bytes
    return out, dropped


# ---- per-GPU memory --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryConfig:
    context: int
    batch: int
    kv_dtype: str = "bf16"
    prefill_chunk: int = 8192
    headroom: float = 0.10
    page_size: int = 64          # MLA cache page (target.mla_page_size)
    kda_chunk: int = 64          # KDA chunk length C (target.kda_chunk)
    prefix_interval: int = 0     # KDA prefix-cache checkpoint interval in tokens (0: no prefix cache)
    seq_parallel: bool = True    # AttnRes blocks (and the residual stream) split by tokens over TP in prefill


@dataclass
class MemoryPlan:
    config: MemoryConfig
    hbm_bytes: int
    weights_bytes: float
    mla_kv_cache_bytes: float
    kda_state_bytes: float
    conv_state_bytes: float
    attnres_bytes: float
    workspace_bytes: float
    workspace: dict[str, float] = field(default_factory=dict)
    kda_checkpoint_bytes: float = 0.0
    checkpoints: int = 0                 # prefix-cache checkpoints per sequence

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.mla_kv_cache_bytes + self.kda_state_bytes + self.conv_state_bytes
                + self.attnres_bytes + self.workspace_bytes + self.kda_checkpoint_bytes)

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * (1.0 - self.config.headroom)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    def as_dict(self) -> dict:
        return {"weights_bytes": self.weights_bytes, "mla_kv_cache_bytes": self.mla_kv_cache_bytes,
                "kda_state_bytes": self.kda_state_bytes, "conv_state_bytes": self.conv_state_bytes,
                "attnres_bytes": self.attnres_bytes, "workspace_bytes": self.workspace_bytes,
                "kda_checkpoint_bytes": self.kda_checkpoint_bytes, "kda_checkpoints_per_sequence": self.checkpoints,
                "total_bytes": self.total_bytes, "hbm_bytes": self.hbm_bytes, "usable_bytes": self.usable_bytes,
                "free_bytes": self.usable_bytes - self.total_bytes, "fits": self.fits,
                "workspace": dict(self.workspace)}


class MemoryPlanner:
    """Per-GPU memory as a function of (context, batch) for one model, layout and target."""

    def __init__(self, module: Module, layout: ParallelLayout, hbm_bytes: int, weights: WeightReport | None = None,
                 facts: ModelFacts | None = None):
        self.module = module
        self.layout = layout
        self.hbm_bytes = hbm_bytes
        self.facts = facts or ModelFacts.from_module(module)
        self.weights = weights or weight_report(module, layout, self.facts)
        tp = layout.tp
        by_name = self.weights.by_name
        # per-token, per-sequence constants read from the IR ops and their params
        self.mla_rows = [op.attr("kv_lora_rank") + op.attr("qk_rope_head_dim") for op in self.facts.mla]
        self.mla_values_per_token = sum(self.mla_rows)
        self.kda_state_per_seq = sum(ceil_div(op.attr("num_heads"), tp) * op.attr("head_dim") ** 2 * 4
                                     for op in self.facts.kda)
        conv = 0.0
        for op in self.facts.kda:
            for v in op.inputs:
                p = _param_of(module, v, by_name)
                if p is not None and p.role.endswith("conv1d.weight") and len(p.type.shape) == 3:
                    conv += p.type.shape[0] * p.gpu_fraction * (p.type.shape[-1] - 1) * self.facts.act_bytes
        self.conv_state_per_seq = conv
        # one unsharded copy of a sequence's recurrent state (the KV-throughput numerator)
        self.kda_state_per_seq_full = sum(op.attr("num_heads") * op.attr("head_dim") ** 2 * 4 for op in self.facts.kda)
        self.conv_state_per_seq_full = sum(
            p.type.shape[0] * (p.type.shape[-1] - 1) * self.facts.act_bytes
            for op in self.facts.kda for p in filter(None, (_param_of(module, v, by_name) for v in op.inputs))
            if p.role.endswith("conv1d.weight") and len(p.type.shape) == 3)

    @property
    def logits_row_bytes(self) -> float:
        """One sequence's last logits row as the runtime holds it (a prefix checkpoint keeps one): the full vocab
        (lm_head's all_gather gives every TP rank all of it) at the lm_head result's dtype."""
        head = next((op for op in self.module.ops if op.op == "lm_head"), None)
        bits = DTYPE_BITS.get(head.types[0].dtype, 16) if head is not None else 8 * self.facts.act_bytes
        return self.facts.vocab * bits / 8

    def checkpoint_bytes(self) -> float:
        """One prefix checkpoint of one sequence on one GPU: every KDA layer's state and conv tails (this rank's
        heads) and the logits row; its MLA rows are page references (prefix_cache.py), not copies."""
        return self.kda_state_per_seq + self.conv_state_per_seq + self.logits_row_bytes

    @staticmethod
    def checkpoints(config: MemoryConfig) -> int:
        """Checkpoints a sequence of `context` tokens leaves: one every interval tokens and one at its end (at an
        interval boundary they coincide): ceil(context / interval); none without a prefix cache."""
        return ceil_div(config.context, config.prefix_interval) if config.prefix_interval else 0

    def mla_bytes_per_token(self, kv_dtype: str) -> int:
        """Latent-cache bytes of one token over every MLA layer, in the runtime's row format."""
        return sum(kv_row_bytes(kv_dtype, v) for v in self.mla_rows)

    def plan(self, config: MemoryConfig) -> MemoryPlan:
        pages = ceil_div(config.context, config.page_size) * config.page_size
        ws = self.workspace_breakdown(config)
        n_ckpt = self.checkpoints(config)
        return MemoryPlan(config, self.hbm_bytes, self.weights.gpu_bytes,
                          config.batch * pages * self.mla_bytes_per_token(config.kv_dtype),
                          config.batch * self.kda_state_per_seq, config.batch * self.conv_state_per_seq,
                          self.attnres_bytes(config), sum(ws.values()), ws,
                          config.batch * n_ckpt * self.checkpoint_bytes(), n_ckpt)

    def step_tokens(self, config: MemoryConfig) -> int:
        """Tokens of the largest step: one prefill chunk, or one decode step of the whole batch."""
        return max(min(config.prefill_chunk, config.context), config.batch)

    def attnres_bytes(self, config: MemoryConfig) -> float:
        if not self.facts.attnres_blocks:
            return 0.0
        # sequence parallel splits the blocks by tokens over TP; without it every rank holds the whole chunk's
        tokens = ceil_div(self.step_tokens(config), self.layout.tp if config.seq_parallel else 1)
        return self.facts.attnres_blocks * tokens * self.facts.hidden * self.facts.act_bytes

    def workspace_breakdown(self, config: MemoryConfig) -> dict[str, float]:
        """Activation workspace of one step of n tokens, per GPU: the hidden-state buffers (partial sum, mix
        output, normed input, sublayer output), the largest layer's intermediates (layers run one at a time), and
        the fp32 logits of the last tokens."""
        f, tp, a = self.facts, self.layout.tp, self.facts.act_bytes
        n = self.step_tokens(config)
        d = f.hidden
        out = {"hidden_buffers": 4 * n * d * a}
        layer: dict[str, float] = {}
        for op in f.kda[:1]:
            h, dh = ceil_div(op.attr("num_heads"), tp), op.attr("head_dim")
            chunk = max(1, config.kda_chunk)
            # q, k, v, output gate (act dtype) + fp32 decay; fp32 chunk-boundary states of the chunked algorithm
            layer["kda"] = n * h * dh * (4 * a + 4) + ceil_div(n, chunk) * h * dh * dh * 4
        for op in f.mla[:1]:
            h = ceil_div(op.attr("num_heads"), tp)
            p, r, v, lat = (op.attr("qk_nope_head_dim"), op.attr("qk_rope_head_dim"), op.attr("v_head_dim"),
                            op.attr("kv_lora_rank"))
            # MHA over a context chunk of n tokens: q, expanded k_nope|v, output; the latent of the chunk
            layer["mla"] = n * h * ((p + r) + (p + v) + v) * a + n * (lat + r) * a
        for op in f.moe[:1]:
            e, k = op.attr("num_experts"), op.attr("top_k")
            z = op.attr("latent_dim") or d
            params = op_params(self.module, op, self.weights.by_name)
            m = expert_intermediate(params)
            rows = n * k / tp
            shared = 0.0
            if "shared_experts.gate_proj.weight" in params:
                shared = n * params["shared_experts.gate_proj.weight"].type.shape[0] / tp * 2 * a
            # router scores fp32, latent z, expert rows (input z, gate|up 2m, activation m, output z), shared
            layer["moe"] = n * e * 4 + n * z * a + rows * (2 * z + 3 * m) * a + shared
        for op in f.mlp[:1]:
            gate = op_params(self.module, op, self.weights.by_name).get("gate_proj.weight")
            width = gate.type.shape[0] if gate is not None else 0
            layer["mlp"] = n * width / tp * 3 * a
        if layer:
            kind = max(layer, key=layer.get)
            out[f"largest layer ({kind})"] = layer[kind]
        vocab = f.vocab
        if vocab:
            out["logits (fp32)"] = config.batch * ceil_div(vocab, tp) * 4
        return out

    # ---- fit -------------------------------------------------------------------------------------------
    def fits(self, context: int, batch: int, base: MemoryConfig) -> bool:
        cfg = dataclasses.replace(base, context=context, batch=batch)
        return self.plan(cfg).fits

    def max_context(self, batch: int, base: MemoryConfig, limit: int = 2 ** 36) -> int:
        """Largest context (multiple of the page size) whose plan fits at this batch; 0 if none."""
        page = base.page_size
        if not self.fits(page, batch, base):
            return 0
        lo, hi = 1, 2
        while hi * page <= limit and self.fits(hi * page, batch, base):
            lo, hi = hi, hi * 2
        if hi * page > limit:
            return lo * page
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid * page, batch, base) else (lo, mid)
        return lo * page

    def max_batch(self, context: int, base: MemoryConfig, limit: int = 2 ** 24) -> int:
        if not self.fits(context, 1, base):
            return 0
        lo, hi = 1, 2
        while hi <= limit and self.fits(context, hi, base):
            lo, hi = hi, hi * 2
        if hi > limit:
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(context, mid, base) else (lo, mid)
        return lo


def expert_intermediate(params: dict[str, ParamInfo]) -> int:
    """m, the routed experts' intermediate width: dim 1 of the stacked gate projection [E, m, z] (also of a packed
    u8 [E, m, z/2] one)."""
    w1 = params.get("experts.w1") or next((p for r, p in params.items() if r.startswith("experts.w1")), None)
    return int(w1.type.shape[1]) if w1 is not None and len(w1.type.shape) == 3 else 0


def _param_of(module: Module, value: str, by_name: dict[str, ParamInfo]) -> ParamInfo | None:
    op = module.defs.get(value)
    if op is None or op.op != "param":
        return None
    return by_name.get(op.attr("name"))
