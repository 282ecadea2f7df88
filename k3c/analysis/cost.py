"""Cost model: FLOPs, HBM bytes and link bytes of every IR op for one serving step, per GPU, and the phases
(prefill, decode, append-prefill) built from steps.

A step is `seqs` sequences, each adding `new` tokens after `cached` ones (n = seqs x new tokens). Costs come from
the op's attrs and its params' types and per-GPU shares (layout.py); nothing is re-derived from the spec.
Traffic is compulsory traffic: each weight read once per step, each activation written once and read once
(tiling re-reads are assumed to hit on-chip memory), the formulas of K3.md for the KDA and MLA cores.

`mla_mode_costs` prices the MLA core in both modes for a given number of new and cached tokens; the `mla-absorb`
pass can reuse it to choose a mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..codegen.targets import Target
from ..ir.core import DTYPE_BITS, Module, Op
from .formulas import (causal_pairs, ceil_div, experts_touched, kda_decode_bytes, kda_decode_flops,
                       kda_prefill_bytes, kda_prefill_flops, mla_pair_flops, ring_allreduce_bytes)
from .layout import ParallelLayout, ParamInfo, op_params
from .memory import ModelFacts, WeightReport, expert_intermediate, kv_row_bytes, weight_derived_values

KINDS = ("kda", "mla", "moe", "mlp", "attn_res", "other")
EXACT_PREFILL_CHUNKS = 1024      # prefills of more chunks are summed piecewise linearly (CostModel._chunk_sum)


def kind_of(opname: str) -> str:
    """Layer kind of an op, for the per-kind tables: kda, kda_proj, kda_attn -> kda; mla_absorbed -> mla; ..."""
    for prefix, kind in (("kda", "kda"), ("mla", "mla"), ("moe", "moe"), ("mlp", "mlp"), ("attn_res", "attn_res")):
        if opname == prefix or opname.startswith(prefix + "_"):
            return kind
    return "other"


@dataclass
class Cost:
    """Per-GPU cost of some work: FLOPs by compute class ("bf16": dense bf16 tensor-core rate, "expert": the routed
    expert GEMM rate), HBM bytes, and bytes sent over the scale-up link."""

    flops: dict[str, float] = field(default_factory=dict)
    bytes: float = 0.0
    comm: float = 0.0
    collectives: float = 0.0          # collective calls on the link (each pays the target's latency)

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def add_flops(self, cls: str, value: float) -> None:
        self.flops[cls] = self.flops.get(cls, 0.0) + value

    def add(self, other: "Cost", times: float = 1.0) -> "Cost":
        for k, v in other.flops.items():
            self.add_flops(k, v * times)
        self.bytes += other.bytes * times
        self.comm += other.comm * times
        self.collectives += other.collectives * times
        return self

    def scaled(self, times: float) -> "Cost":
        return Cost().add(self, times)

    def compute_seconds(self, peaks: Mapping[str, float]) -> float:
        return sum(v / peaks[k] for k, v in self.flops.items())

    def seconds(self, peaks: Mapping[str, float], hbm_bytes_per_s: float) -> float:
        """Roofline time: max(compute, memory)."""
        return max(self.compute_seconds(peaks), self.bytes / hbm_bytes_per_s)

    def as_dict(self) -> dict:
        return {"flops": self.total_flops, "flops_by_class": dict(self.flops), "bytes": self.bytes,
                "comm_bytes": self.comm, "collectives": self.collectives}


@dataclass(frozen=True)
class Step:
    seqs: int            # sequences in the step
    new: int             # new tokens per sequence
    cached: int          # cached tokens per sequence before the step
    logits: int = 0      # rows of logits computed (the last token of each finishing sequence)

    @property
    def tokens(self) -> int:
        return self.seqs * self.new


def peaks_for(target: Target, facts: ModelFacts, experts_mxfp4: bool) -> dict[str, float]:
    """Peak FLOP/s per compute class. Routed expert GEMMs run MXFP8 x MXFP4 at the FP8 rate on a target with
    native MX support (gfx950 / sm_100 scaled MMA) when activations are MXFP8; otherwise weights are upcast
    and the GEMM runs at the bf16 rate. Everything else runs at the bf16 rate."""
    native = experts_mxfp4 and target.native_mxfp4 and facts.activation_format == "mxfp8"
    return {"bf16": target.peak_bf16_flops, "expert": target.peak_fp8_flops if native else target.peak_bf16_flops}


# ---- MLA modes -------------------------------------------------------------------------------------------
@dataclass
class MLAModeCosts:
    mha: Cost
    mqa: Cost
    mha_seconds: float
    mqa_seconds: float

    @property
    def best(self) -> str:
        return "mha" if self.mha_seconds <= self.mqa_seconds else "mqa"

    def cost(self, mode: str | None = None) -> Cost:
        return getattr(self, mode or self.best)

    def as_dict(self) -> dict:
        return {"mha": {**self.mha.as_dict(), "seconds": self.mha_seconds},
                "mqa": {**self.mqa.as_dict(), "seconds": self.mqa_seconds}, "best": self.best}


def _mla_attrs(attrs: Any) -> dict:
    if isinstance(attrs, Op):
        attrs = attrs.attr_dict
    d = dict(attrs)
    missing = [k for k in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
               if k not in d]
    if missing:
        raise KeyError(f"mla attrs lack {', '.join(missing)}")
    return d


def mla_mode_costs(attrs: Mapping[str, Any] | Op, new_tokens: int, cached_tokens: int, target: Target, *,
                   heads: int | None = None, batch: int = 1, kv_dtype: str | float = "bf16",
                   act_bytes: float = 2.0) -> MLAModeCosts:
    """Cost of the MLA core (W_kvb use + attention) for `batch` sequences appending `new_tokens` queries after
    `cached_tokens` cached ones, on one GPU holding `heads` heads (default: all).

    MHA mode expands k_nope|v with W_kvb for every context token (cached + new) and attends per head with
    2(P+R)+2V FLOPs per pair; MQA mode absorbs W_UK_T / W_UV per query token and attends over the shared 576-wide
    latent with 2(L+R)+2L FLOPs per pair. Both read the latent cache once and W_kvb once; MHA also writes and
    reads the expanded K/V. The projections common to both modes (q, kv_a, gate, o) are not included."""
    a = _mla_attrs(attrs)
    N = heads if heads is not None else a["num_heads"]
    P, R, V, L = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"], a["kv_lora_rank"]
    kvb = kv_row_bytes(kv_dtype, L + R) / (L + R) if isinstance(kv_dtype, str) else float(kv_dtype)
    s, T, S = batch, new_tokens, cached_tokens
    n, ctx = s * T, s * (S + T)
    pairs = s * causal_pairs(T, S)
    w_kvb = N * (P + V) * L                      # W_kvb elements on this GPU (= W_UK_T + W_UV)
    latent = ctx * (L + R) * kvb                 # the latent cache (and the new tokens' latents) read once
    mha = Cost({"bf16": 2 * w_kvb * ctx + pairs * N * mla_pair_flops("mha", P=P, R=R, V=V, L=L)},
               w_kvb * act_bytes + latent + 2 * ctx * N * (P + V) * act_bytes
               + n * N * (P + R) * act_bytes + n * N * V * act_bytes)
    mqa = Cost({"bf16": 2 * w_kvb * n + pairs * N * mla_pair_flops("mqa", P=P, R=R, V=V, L=L)},
               w_kvb * act_bytes + latent + n * N * P * act_bytes + 2 * n * N * (L + R) * act_bytes
               + 2 * n * N * L * act_bytes + n * N * V * act_bytes)
    peaks = {"bf16": target.peak_bf16_flops}
    return MLAModeCosts(mha, mqa, mha.seconds(peaks, target.hbm_bytes_per_s),
                        mqa.seconds(peaks, target.hbm_bytes_per_s))


def mla_crossover_new_tokens(attrs: Mapping[str, Any] | Op, cached_tokens: int, target: Target, *,
                             limit: int = 1 << 24, **kw) -> int | None:
    """Fewest new tokens for which MHA mode is at least as fast as MQA mode after `cached_tokens`; None when
    MQA stays faster up to `limit`."""
    def mha_wins(t: int) -> bool:
        c = mla_mode_costs(attrs, t, cached_tokens, target, **kw)
        return c.mha_seconds <= c.mqa_seconds

    if mha_wins(1):
        return 1
    hi = 2
    while hi <= limit and not mha_wins(hi):
        hi *= 2
    if hi > limit:
        return None
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mha_wins(mid) else (mid, hi)
    return hi


# ---- per-op costs ----------------------------------------------------------------------------------------
@dataclass
class PhaseResult:
    name: str
    description: str
    tokens: int                       # tokens processed (new tokens over all sequences)
    cost: Cost                        # per GPU
    seconds: float                    # roofline: sum over ops and steps of max(compute, memory)
    comm_seconds: float               # link bytes / link bandwidth + collectives x latency (not overlapped)
    by_kind: dict[str, dict]          # kind -> {"cost": Cost, "seconds": float, "ops": int}
    mla_modes: dict[str, int] = field(default_factory=dict)   # mode -> MLA op evaluations using it

    @property
    def total_seconds(self) -> float:
        return self.seconds + self.comm_seconds


class CostModel:
    """Costs of every op of a module for steps on one GPU of a layout and target."""

    def __init__(self, module: Module, layout: ParallelLayout, target: Target, weights: WeightReport,
                 facts: ModelFacts | None = None, *, kv_dtype: str = "bf16", kda_chunk: int | None = None,
                 mla_mode: str = "auto", seq_parallel: bool = True):
        self.module, self.layout, self.target, self.weights = module, layout, target, weights
        # the AttnRes mixes run on T/TP tokens per rank under sequence parallel, on all T without it
        self.seq_split = layout.tp if seq_parallel else 1
        self.facts = facts or ModelFacts.from_module(module)
        self.kv_dtype = kv_dtype
        self.kda_chunk = kda_chunk or target.kda_chunk
        self.mla_mode = mla_mode
        experts_mx = any(p.precision in ("mxfp4", "u8", "fp4e2m1") for p in weights.params
                         if p.category == "routed experts")
        self.peaks = peaks_for(target, self.facts, experts_mx)
        self.bw = target.hbm_bytes_per_s
        by_name = weights.by_name
        # group identical ops (same op, attrs but the layer, input types and param shares): K3 has ~40 groups
        groups: dict[tuple, list] = {}
        self.unmodeled: dict[str, int] = {}
        self.weight_transforms = weight_derived_values(module)      # evaluated once at load: no step cost
        for op in module.ops:
            if op.op in ("param", "input") or (op.results and op.results[0] in self.weight_transforms):
                continue
            if op.op not in _RULES:      # priced by the generic rule; listed in the report (ops without a
                #                          cost rule here)
                self.unmodeled[op.op] = self.unmodeled.get(op.op, 0) + 1
            params = op_params(module, op, by_name)
            key = (op.op, tuple((k, v) for k, v in op.attrs if k != "layer"),
                   tuple(module.types[v] for v in op.inputs),
                   tuple((r, p.bytes, p.gpu_fraction, p.precision) for r, p in params.items()))
            if key in groups:
                groups[key][2] += 1
            else:
                groups[key] = [op, params, 1]
        self.groups = [tuple(g) for g in groups.values()]
        self._kinds = [kind_of(op.op) for op, _, _ in self.groups]
        self._cache: dict[tuple, tuple[Cost, float, str | None]] = {}

    # one op
    def op_cost(self, op: Op, params: dict[str, ParamInfo], step: Step) -> tuple[Cost, str | None]:
        return _RULES.get(op.op, _generic)(self, op, params, step)

    def step(self, step: Step) -> dict[str, tuple[Cost, float, int, dict[str, int]]]:
        """kind -> (cost, roofline seconds, op count, MLA modes) for one step over the whole module."""
        out: dict[str, list] = {}
        for gi, (op, params, count) in enumerate(self.groups):
            # only attention over the cache depends on the cached tokens, only lm_head on the logits rows
            key = (gi, step if op.op in _CACHE_OPS else Step(step.seqs, step.new, 0,
                                                             step.logits if op.op == "lm_head" else 0))
            if key not in self._cache:
                cost, mode = self.op_cost(op, params, step)
                self._cache[key] = (cost, cost.seconds(self.peaks, self.bw), mode)
            cost, secs, mode = self._cache[key]
            kind = self._kinds[gi]
            acc = out.setdefault(kind, [Cost(), 0.0, 0, {}])
            acc[0].add(cost, count)
            acc[1] += secs * count
            acc[2] += count
            if mode:
                acc[3][mode] = acc[3].get(mode, 0) + count
        return {k: tuple(v) for k, v in out.items()}

    def phase(self, name: str, description: str, steps: list[tuple[Step, int]]) -> PhaseResult:
        total, secs, tokens = Cost(), 0.0, 0
        by_kind: dict[str, dict] = {}
        modes: dict[str, int] = {}
        for st, times in steps:
            tokens += st.tokens * times
            for kind, (cost, s, count, m) in self.step(st).items():
                d = by_kind.setdefault(kind, {"cost": Cost(), "seconds": 0.0, "ops": count})
                d["cost"].add(cost, times)
                d["seconds"] += s * times
                total.add(cost, times)
                secs += s * times
                for k, v in m.items():
                    modes[k] = modes.get(k, 0) + v * times
        link = self.target.link_bytes_per_s
        comm = (total.comm / link if link else 0.0) + total.collectives * self.target.collective_latency_s
        return PhaseResult(name, description, tokens, total, secs, comm,
                           {k: by_kind[k] for k in KINDS if k in by_kind}, modes)

    # phases
    def prefill(self, context: int, batch: int, chunk: int) -> PhaseResult:
        """`batch` fresh prompts of `context` tokens, each prefilled in chunks of `chunk` tokens. Up to
        EXACT_PREFILL_CHUNKS chunks are priced one by one; a longer prefill sums its chunks piecewise linearly
        (_chunk_sum): bounded work whatever the context (--context 10**10 at chunk 1 is a few hundred steps)."""
        full, rem = divmod(context, chunk)
        desc = f"{batch} x {context:,} fresh tokens in chunks of {chunk:,}"
        if full + (rem > 0) <= EXACT_PREFILL_CHUNKS:
            steps: dict[Step, int] = {}
            done = 0
            while done < context:
                t = min(chunk, context - done)
                st = Step(1, t, done, 1 if done + t >= context else 0)
                steps[st] = steps.get(st, 0) + batch
                done += t
            return self.phase("prefill", desc, list(steps.items()))
        n = full - (rem == 0)                  # full chunks without logits; the last chunk computes them
        last = Step(1, rem, full * chunk, 1) if rem else Step(1, chunk, (full - 1) * chunk, 1)
        return self.phase("prefill", desc, self._chunk_sum(chunk, n, batch) + [(last, batch)])

    def _chunk_sum(self, chunk: int, n: int, times: int) -> list[tuple[Step, int]]:
        """(step, times) pairs whose sum is that of chunks j = 0 .. n-1 (Step(1, chunk, j x chunk)) x `times`.
        Every cost of a step is piecewise linear in its cached tokens (linear per MLA mode and per roofline
        branch; the kinks are where the faster mode or the bound changes), so an interval of chunks on which the
        step is linear sums exactly from its ends: (n/2) x (first + last), n odd adding the midpoint once. An
        interval is taken as linear when its midpoint and quarter point lie on the chord; otherwise it is halved
        (O(kinks x log n) steps priced)."""
        if n <= 0:
            return []
        vec: dict[int, dict] = {}

        def at(j: int) -> dict:
            if j not in vec:
                flat: dict = {}
                for kind, (cost, secs, _count, modes) in self.step(Step(1, chunk, j * chunk, 0)).items():
                    flat.update({(kind, "flops", k): v for k, v in cost.flops.items()})
                    flat.update({(kind, "bytes"): cost.bytes, (kind, "comm"): cost.comm,
                                 (kind, "collectives"): cost.collectives, (kind, "seconds"): secs})
                    flat.update({(kind, "mode", k): v for k, v in modes.items()})
                vec[j] = flat
            return vec[j]

        def on_chord(a: int, b: int, x: int) -> bool:
            va, vb, vx = at(a), at(b), at(x)
            w = (x - a) / (b - a)
            for key in set(va) | set(vb) | set(vx):
                ya, yb, yx = va.get(key, 0.0), vb.get(key, 0.0), vx.get(key, 0.0)
                if abs(yx - (ya + (yb - ya) * w)) > 1e-9 * max(abs(ya), abs(yb), abs(yx)):
                    return False
            return True

        def st(j: int) -> Step:
            return Step(1, chunk, j * chunk, 0)

        out: list[tuple[Step, int]] = []
        todo = [(0, n - 1)]
        while todo:
            a, b = todo.pop()
            if b - a < 4:
                out += [(st(j), times) for j in range(a, b + 1)]
                continue
            mid = (a + b) // 2
            if on_chord(a, b, mid) and on_chord(a, b, (a + mid) // 2):
                count = b - a + 1
                out += [(st(a), times * (count // 2)), (st(b), times * (count // 2))]
                if count % 2:                  # b - a even: mid is the exact midpoint, the mean of the ends
                    out.append((st(mid), times))
            else:
                todo += [(a, mid), (mid + 1, b)]
        return out


    def decode(self, context: int, batch: int) -> PhaseResult:
        st = Step(batch, 1, max(context - 1, 0), batch)
        return self.phase("decode", f"1 token for each of {batch} sequences at context {context:,}", [(st, 1)])

    def append(self, context: int, batch: int, new: int) -> PhaseResult:
        new = min(new, context)
        st = Step(1, new, context - new, 1)
        return self.phase("append-prefill", f"{batch} x {new:,} new tokens after {context - new:,} cached",
                          [(st, batch)])

    # helpers for the rules
    def linear(self, params: dict[str, ParamInfo], n: float, skip: tuple[str, ...] = ()) -> Cost:
        """Dense linears and convs on n tokens: 2 x per-GPU weight elements FLOPs per token; weights read once;
        input and output activations written/read once (row-parallel: input split, output a full partial sum)."""
        a = self.facts.act_bytes
        c = Cost()
        for role, p in params.items():
            if role in skip:
                continue
            shape = p.type.shape
            c.bytes += p.gpu_bytes
            if p.precision == "mxfp4" and p.type.dtype == "u8" and p.numel == 0:
                continue            # E8M0 scales of a packed weight: their bytes only (the payload has the GEMM)
            if len(shape) == 2:
                out_f, in_f = shape
                if p.precision == "mxfp4" and p.type.dtype == "u8":
                    in_f *= 2       # packed payload [out, in/2]: two E2M1 weights per byte
                if p.split in ("heads", "tp", "vocab"):
                    if p.row_parallel:
                        in_f = in_f * p.gpu_fraction
                    else:
                        out_f = out_f * p.gpu_fraction
                c.add_flops("bf16", 2 * p.gpu_numel * n)
                c.bytes += n * (in_f + out_f) * a
            elif len(shape) == 3 and p.split != "ep":          # depthwise conv [channels, 1, kernel]
                c.add_flops("bf16", 2 * p.gpu_numel * n)
                c.bytes += 2 * n * shape[0] * p.gpu_fraction * a
        return c

    def allreduce(self, c: Cost, n: float, width: int) -> None:
        """A TP all-reduce of n x width activations into c: its ring bytes and one collective (none at TP 1)."""
        if self.layout.tp > 1:
            c.comm += ring_allreduce_bytes(self.layout.tp, n * width * self.facts.act_bytes)
            c.collectives += 1


def _kda_core(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step) -> Cost:
    """The KDA core per GPU: chunked prefill (K3.md: 12C^3 + 8C^2 D + 6C D^2 FLOPs, 8C^2 + 22CD bytes per chunk
    and head, plus the fp32 state loaded and stored once) or recurrent decode (7 D^2 FLOPs, 8 D^2 bytes per head
    and token); conv tails read and written once per sequence."""
    a = cm.facts.act_bytes
    h, D = ceil_div(op.attr("num_heads"), cm.layout.tp), op.attr("head_dim")
    c = Cost()
    if st.new == 1:
        c.add_flops("bf16", st.seqs * h * kda_decode_flops(D))
        c.bytes += st.seqs * h * kda_decode_bytes(D)
    else:
        C = cm.kda_chunk
        chunks = st.seqs * ceil_div(st.new, C)
        c.add_flops("bf16", chunks * h * kda_prefill_flops(C, D))
        c.bytes += chunks * h * kda_prefill_bytes(C, D) + st.seqs * h * kda_decode_bytes(D)
    conv = sum(p.type.shape[0] * p.gpu_fraction * (p.type.shape[-1] - 1)
               for r, p in params.items() if r.endswith("conv1d.weight") and len(p.type.shape) == 3)
    c.bytes += 2 * st.seqs * conv * a
    return c


def _kda(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    n, d, a = st.tokens, cm.facts.hidden, cm.facts.act_bytes
    c = cm.linear(params, n).add(_kda_core(cm, op, params, st))
    c.bytes += 2 * n * d * a                                      # layer in/out
    cm.allreduce(c, n, d)
    return c, None


def _kda_attn(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """kda-chunk's core op: the convs (its params) and the core; projections are separate kda_proj ops."""
    return cm.linear(params, st.tokens).add(_kda_core(cm, op, params, st)), None


def _projection(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """A single dense projection (kda_proj): a row-parallel one ends in a TP all-reduce."""
    c = cm.linear(params, st.tokens)
    if any(p.row_parallel for p in params.values()):
        cm.allreduce(c, st.tokens, cm.facts.hidden)
    return c, None


def _mla(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    f, a = cm.facts, cm.facts.act_bytes
    n, d = st.tokens, f.hidden
    h = ceil_div(op.attr("num_heads"), cm.layout.tp)
    c = cm.linear(params, n, skip=("kv_b_proj.weight",))
    modes = mla_mode_costs(op, st.new, st.cached, cm.target, heads=h, batch=st.seqs, kv_dtype=cm.kv_dtype,
                           act_bytes=a)
    mode = op.attr("mode", "auto")                 # mla_absorbed may pin a mode; "auto" = the faster one
    if mode == "auto":
        mode = modes.best if cm.mla_mode == "auto" else cm.mla_mode
    c.add(modes.cost(mode))
    lat = op.attr("kv_lora_rank") + op.attr("qk_rope_head_dim")
    c.bytes += n * kv_row_bytes(cm.kv_dtype, lat) + 2 * n * d * a   # cache append; layer in/out
    cm.allreduce(c, n, d)
    return c, mode


def _moe(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    f, a, lay = cm.facts, cm.facts.act_bytes, cm.layout
    n, d = st.tokens, f.hidden
    E, k = op.attr("num_experts"), op.attr("top_k")
    z = op.attr("latent_dim") or d
    # the routed stacks by role, whatever their split (whole experts over EP, or every expert split over TP at EP 1:
    # either way a GPU computes n x top_k / TP expert rows' worth of FLOPs)
    experts = {r: p for r, p in params.items() if r.startswith("experts.")}
    c = cm.linear({r: p for r, p in params.items() if r not in experts}, n)
    m = expert_intermediate(params)
    rows = n * k / lay.tp                  # expert rows this GPU computes (balanced routing)
    c.add_flops("expert", rows * 6 * m * z)
    local = ceil_div(E, lay.ep)
    hit = experts_touched(local, k, E, n * lay.dp_attention) / local
    c.bytes += sum(p.gpu_bytes for p in experts.values()) * hit
    c.bytes += rows * 2 * (z + m) * a + 2 * n * d * a    # expert rows in/out (fused gate|up|act); layer in/out
    # combine: routed partials inside the TP group (all-reduce of the latent), shared + latent-up partials
    # (all-reduce of the hidden); EP beyond TP adds an all-to-all dispatch + combine of n/TP tokens x k x z
    cm.allreduce(c, n, z)
    cm.allreduce(c, n, d)
    if lay.ep > lay.tp:
        p_bytes = (1 + 1 / 32 if f.activation_format == "mxfp8" else a) + a
        c.comm += n / lay.tp * k * z * p_bytes * (1 - 1 / lay.ep)
        c.collectives += 2                                  # dispatch and combine
    return c, None


def _mlp(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    n, d, a = st.tokens, cm.facts.hidden, cm.facts.act_bytes
    c = cm.linear(params, n)
    c.bytes += 2 * n * d * a
    cm.allreduce(c, n, d)
    return c, None


def _attn_res(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """Naive mix, sequence-sharded over TP: per token rms + score + weighted sum over the sources (6 d each);
    reads every source once and writes the output."""
    n, d, a = st.tokens / cm.seq_split, cm.facts.hidden, cm.facts.act_bytes
    ns = op.attr("num_sources")
    c = Cost({"bf16": n * ns * 6 * d}, n * (ns + 1) * d * a + sum(p.gpu_bytes for p in params.values()))
    return c, None


def _attn_res_phase1(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """Two-phase AttnRes, phase 1 (sequence-sharded over TP): every query of a block group against the completed
    blocks, each block read once: rms (2d) + per query dot and weighted sum (4d) per source and token; writes
    one row of STATS + d per query and token."""
    n, d, a = st.tokens / cm.seq_split, cm.facts.hidden, cm.facts.act_bytes
    ns, q = op.attr("num_sources"), op.attr("num_queries")
    row = op.types[0].shape[-1] if op.types and isinstance(op.types[0].shape[-1], int) else d
    return Cost({"bf16": n * ns * (2 * d + 4 * q * d)}, n * ns * d * a + n * q * row * a), None


def _attn_res_phase2(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """Phase 2, sequence-sharded over TP like phase 1: reads its own phase-1 row (STATS + d), the partial sum
    (modes source/update) and the update (mode update); merges by online softmax (and the next RMSNorm when
    normed); writes the output (and the new partial in mode update)."""
    n, d, a = st.tokens / cm.seq_split, cm.facts.hidden, cm.facts.act_bytes
    s1 = cm.module.types.get(op.inputs[0]) if op.inputs else None
    row = s1.shape[-1] if s1 is not None and s1.shape and isinstance(s1.shape[-1], int) else d
    mode = op.attr("mode", "none")
    reads = row + d * (mode in ("source", "update")) + d * (mode == "update")
    writes = d * (2 if mode == "update" else 1)
    flops = n * d * (8 + (4 if op.attr("normed", False) else 0) + (1 if mode == "update" else 0))
    return Cost({"bf16": flops}, n * (reads + writes) * a + sum(p.gpu_bytes for p in params.values())), None


def _free(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """A view (attn_res_take): no traffic of its own."""
    return Cost(), None


def _rmsnorm(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    n, d, a = st.tokens, _width(cm, op), cm.facts.act_bytes
    return Cost({"bf16": 4 * n * d}, 2 * n * d * a + sum(p.gpu_bytes for p in params.values())), None


def _add(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    n, d, a = st.tokens, _width(cm, op), cm.facts.act_bytes
    return Cost({"bf16": n * d}, 3 * n * d * a), None


def _embedding(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """Vocab-parallel lookup: each GPU gathers the rows of its shard, then an all-reduce."""
    n, d, a = st.tokens, cm.facts.hidden, cm.facts.act_bytes
    c = Cost({}, 2 * n * d * a / cm.layout.tp + n * d * a)
    cm.allreduce(c, n, d)
    return c, None


def _lm_head(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step):
    """Logits for the last token of each finishing sequence only (serving engines skip the others)."""
    rows, d, a = st.logits, cm.facts.hidden, cm.facts.act_bytes
    if not rows:
        return Cost(), None
    w = next(iter(params.values()), None)
    vocab_gpu = w.type.shape[0] * w.gpu_fraction if w is not None else cm.facts.vocab
    # every param's bytes: an MXFP4 head (the mxfp4 pass) is its payload + E8M0 scales, 4.25 bits per weight
    w_bytes = sum(p.gpu_bytes for p in params.values())
    c = Cost({"bf16": 2 * rows * d * vocab_gpu}, w_bytes + rows * (d * a + vocab_gpu * 4))
    return c, None


def _generic(cm: CostModel, op: Op, params: dict[str, ParamInfo], st: Step, tokens: float | None = None):
    """An op without a rule of its own (a fused elementwise op a pass introduced, say): memory-bound, each
    activation input read once and each result written once (symbolic dims count as the step's tokens), its
    params read once, 1 FLOP per result element."""
    def elems(ty) -> float:
        fixed = 1
        symbolic = False
        for dim in ty.shape:
            if isinstance(dim, int):
                fixed *= dim
            else:
                symbolic = True
        return fixed * ((st.tokens if tokens is None else tokens) if symbolic else 1)

    c = Cost()
    param_values = set()
    for v in op.inputs:
        d = cm.module.defs.get(v)
        if d is not None and d.op == "param":
            param_values.add(v)
            continue
        ty = cm.module.types.get(v)
        if ty is not None:
            c.bytes += elems(ty) * DTYPE_BITS.get(ty.dtype, 16) / 8
    for ty in op.types:
        e = elems(ty)
        c.bytes += e * DTYPE_BITS.get(ty.dtype, 16) / 8
        c.add_flops("bf16", e)
    c.bytes += sum(p.gpu_bytes for p in params.values())
    return c, None


def _width(cm: CostModel, op: Op) -> int:
    shape = op.types[0].shape if op.types else ()
    last = shape[-1] if shape else cm.facts.hidden
    return last if isinstance(last, int) else cm.facts.hidden


_CACHE_OPS = ("mla", "mla_absorbed")
_RULES = {"kda": _kda, "mla": _mla, "moe": _moe, "mlp": _mlp, "attn_res_mix": _attn_res, "rmsnorm": _rmsnorm,
          "add": _add, "embedding": _embedding, "lm_head": _lm_head,
          # kernel-level ops of kda-chunk, mla-absorb, attnres-split, fuse-residual-norm
          "kda_proj": _projection, "kda_attn": _kda_attn, "mla_absorbed": _mla,
          "attn_res_phase1": _attn_res_phase1, "attn_res_phase2": _attn_res_phase2, "attn_res_take": _free,
          "kda_out": _generic, "rmsnorm_residual": _generic}


def cost_rules() -> tuple[str, ...]:
    """Ops with a cost rule of their own; others get `_generic` and are listed in the report."""
    return tuple(_RULES)

