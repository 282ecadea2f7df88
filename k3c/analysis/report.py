"""`plan()`: memory plan, cost model and roofline of a compiled model for a target and a parallel layout, as a
JSON-able dict (stable keys, schema "k3c-plan/1") and a text report in which every derived number names its
formula and the assumptions are listed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..codegen.targets import TARGETS, Target, get_target
from ..errors import ArgumentError
from ..frontend import ModelSpec, load_spec
from ..ir.core import Module
from ..limits import MAX_BATCH, MAX_STAGES, MAX_TOKENS
from ..passes.pipeline import lower
from .cost import CostModel, PhaseResult, cost_rules, mla_crossover_new_tokens, mla_mode_costs
from .formulas import (FORMULAS, GB, GiB, attnres_pp_cached_blocks, attnres_pp_naive_blocks, ceil_div, fmt_bytes,
                       fmt_seconds, fmt_si, moe_comm_compute_ratio)
from .layout import ParallelLayout, op_params
from .memory import (KV_DTYPES, MemoryConfig, MemoryPlan, MemoryPlanner, ModelFacts, WeightReport,
                     expert_intermediate, weight_report)
from .roofline import KV_THROUGHPUT_LENGTHS, Point, kv_throughput, load_measured, measured_rows, ridge

SCHEMA = "k3c-plan/1"
FIT_LENGTHS = (8192, 32768, 131072, 1048576)
DEFAULT_PREFILL_CHUNK = 8192
DEFAULT_HEADROOM = 0.10
# Upper bounds of plan()'s sizes (k3c/limits.py): the plan's work is bounded whatever they are (the prefill sums
# its chunks in O(kinks x log chunks), CostModel._chunk_sum), these keep the numbers meaningful.
LIMITS = {"--context": MAX_TOKENS, "--batch": MAX_BATCH, "--prefill-chunk": MAX_TOKENS, "--pp": MAX_STAGES,
          "--vpp": MAX_STAGES}


@dataclass
class Plan:
    model: str
    target: Target
    layout: ParallelLayout
    config: MemoryConfig
    passes: list[str]
    facts: ModelFacts
    weights: WeightReport
    memory: MemoryPlan
    planner: MemoryPlanner
    cost_model: CostModel
    phases: list[PhaseResult]
    fit: dict
    kv_throughput: list[dict]
    mla: dict
    moe_comm: dict
    attnres_pp: dict
    measured: list[Point] = field(default_factory=list)
    plot_path: str | None = None
    full_attention: list[dict] = field(default_factory=list)      # hybrid.compare_rows, with the variant's plan
    full_attention_plan: "Plan | None" = None

    # ---- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        t, cfg = self.target, self.config
        peak = self.cost_model.peaks
        out = {
            "schema": SCHEMA,
            "model": self.model,
            "target": {"name": t.name, "arch": t.arch, "hbm_bytes": t.hbm_bytes, "hbm_bytes_per_s": t.hbm_bytes_per_s,
                       "peak_flops": dict(peak), "link_bytes_per_s": t.link_bytes_per_s,
                       "collective_latency_s": t.collective_latency_s},
            "layout": {"tp": self.layout.tp, "ep": self.layout.ep, "world": self.layout.world,
                       "dp_attention": self.layout.dp_attention},
            "context": cfg.context, "batch": cfg.batch, "kv_dtype": cfg.kv_dtype,
            "prefill_chunk": cfg.prefill_chunk, "kda_chunk": cfg.kda_chunk, "headroom": cfg.headroom,
            "prefix_interval": cfg.prefix_interval, "seq_parallel": cfg.seq_parallel,
            "passes": list(self.passes), "ir_ops": self.facts.num_ops,
            "weights_total_bytes": self.weights.total_bytes,
            "routed_expert_bytes": self.weights.routed_expert_bytes,
            "params_total": self.weights.total_params,
            "params_active": self.weights.active_params,
            "weights_by_category": {k: {"params": v["params"], "bytes": v["bytes"], "gpu_bytes": v["gpu_bytes"],
                                        "precisions": v["precisions"]} for k, v in self.weights.by_category.items()},
            "weights_by_precision": {k: dict(v) for k, v in self.weights.by_precision.items()},
            "per_gpu": self.memory.as_dict(),
            "fit": self.fit,
            "phases": {ph.name: _phase_dict(ph, t) for ph in self.phases},
            "kv_throughput": self.kv_throughput,
            "full_attention": self.full_attention,
            "mla_modes": self.mla,
            "moe_comm": self.moe_comm,
            "attnres_pp": self.attnres_pp,
            "generic_cost_ops": dict(self.cost_model.unmodeled),
            "assumptions": self.assumptions(),
            "formulas": dict(FORMULAS),
        }
        if self.measured:
            out["measured"] = measured_rows(self.measured, t, max(peak.values()))
        if self.plot_path:
            out["plot"] = self.plot_path
        return out

    # ---- assumptions -----------------------------------------------------------------------------------
    def assumptions(self) -> list[str]:
        lay, cfg, t = self.layout, self.config, self.target
        out = [
            "Everything is read from the lowered IR (params' types and shapes, layer ops' attrs); GB = 1e9 bytes, "
            "GiB = 2^30 bytes.",
            "Weight bytes: bf16/f32 params at their dtype width; params selected by the module's MXFP4 plan "
            "(weight_format, mxfp4_include/exclude fnmatch patterns) at 4.25 bits: E2M1 payload + one E8M0 scale "
            "per 32 along the last (reduction) dim; params already packed (u8/e8m0) count as typed.",
            f"Layout {lay}, {_ep_words(lay)}: KDA and MLA heads split over TP; MLA q_a, kv_a_proj_with_mqa and the "
            "latent cache replicated on every TP rank; dense MLP, shared experts and latent projections column/row "
            "parallel; routed experts spread whole over EP ranks (split further TP/EP ways when TP > EP); router, "
            "norms and AttnRes vectors replicated; embed_tokens and lm_head vocab-parallel.",
            f"Batch {cfg.batch} counts sequences per attention replica (TP group); memory is for the most "
            "loaded GPU (ceil of uneven splits).",
            f"MLA cache: kv_lora_rank + qk_rope_head_dim values per token per MLA layer at {cfg.kv_dtype} "
            f"(bf16: 2 B/value; fp8: e4m3 codes + two fp32 per-token scales, the row padded to 16 B, as the runtime "
            f"stores it), in pages of {cfg.page_size} tokens.",
            "KDA recurrent state fp32 (heads/TP x head_dim^2 per layer); conv tails (kernel-1) tokens of the q/k/v "
            "channels at the activation dtype; "
            + (f"prefix-cache checkpoints every {cfg.prefix_interval:,} tokens and at the prompt end "
               "(k3c.runtime.prefix_cache), each a copy of every KDA layer's state and conv tails and the logits "
               "row, held in HBM (the runtime's device tier); their MLA rows are the sequence's pages, shared."
               if cfg.prefix_interval else
               "no prefix cache (--prefix-interval N counts its KDA checkpoints; the runtime's default "
               "interval is 32,768)."),
            f"AttnRes: the completed block representations of one prefill chunk ({cfg.prefill_chunk:,} tokens), "
            + ("sequence-sharded over TP as in the AttnRes paper (s4.2); cost of each mix also split over TP."
               if cfg.seq_parallel or lay.tp == 1 else
               "whole on every TP rank (--no-seq-parallel: the residual stream is not split by tokens); each "
               "rank computes every mix."),
            "Workspace: activations of the largest step (a prefill chunk, or a decode step of the whole batch): "
            "4 hidden-state buffers, the largest layer's intermediates (layers run one at a time), fp32 logits.",
            f"Headroom {cfg.headroom:.0%} of HBM is kept free (allocator, graphs, communication buffers).",
            "Cost: compulsory traffic (each weight read once per step, each activation written and read once, "
            "tiling re-reads hit on-chip memory); roofline time = sum over ops of max(FLOPs/peak, bytes/BW).",
            f"Peaks from the target table: bf16 {fmt_si(t.peak_bf16_flops, 'FLOP/s')} for all GEMMs and the "
            f"KDA/MLA cores; routed-expert GEMMs at {fmt_si(self.cost_model.peaks['expert'], 'FLOP/s')} "
            "(MXFP8 x MXFP4 at the FP8 rate when the target executes MX natively, else bf16 after upcast).",
            f"Prefill runs chunks of {cfg.prefill_chunk:,} tokens (weights re-read per chunk, later chunks are "
            f"append-prefill over the cache); KDA chunk C = {cfg.kda_chunk} (target.kda_chunk); lm_head only "
            "for the last token of a prompt. MLA mode per step: the faster of MHA and MQA (mla_mode_costs).",
            "Routing balanced and uniform: each GPU computes n x top_k / TP expert rows; decode reads only the "
            "experts hit, E_local (1 - (1 - k/E)^n).",
            f"Communication over the target's link ({fmt_si(t.link_bytes_per_s, 'B/s')} per GPU, one direction), "
            "not overlapped with compute: ring all-reduce after attention, MLP/MoE (latent + hidden) and the "
            "vocab-parallel embedding; an all-to-all dispatch/combine only when EP > TP. Each collective also "
            f"pays {fmt_seconds(t.collective_latency_s)} of latency (target table; H200 measured from a "
            "CUDA graph on 2 GPUs, the others assumed).",
        ]
        if cfg.context > self.facts.max_context > 0:
            out.append(f"The context {cfg.context:,} exceeds the model's max_context {self.facts.max_context:,}.")
        if any(op.attr("num_heads") % lay.tp for op in self.facts.kda + self.facts.mla):
            out.append(f"TP {lay.tp} does not divide the head counts: the most loaded rank holds ceil(heads/TP).")
        return out

    # ---- text ------------------------------------------------------------------------------------------
    def text(self) -> str:
        return "\n".join(_render(self)) + "\n"


def _rate(ph: PhaseResult) -> float:
    return ph.tokens / ph.total_seconds if ph.total_seconds else 0.0


def _expected(ph: PhaseResult, target: Target) -> dict | None:
    """The plan's rate scaled by the share of it k3c's measured runs reach on this target (Target.plan_fraction):
    what to expect, not a ceiling. None where that phase was never measured on the target."""
    share = target.plan_fraction_of(ph.name)
    if share is None:
        return None
    return {"measured_share": list(share), "tokens_per_s": [share[0] * _rate(ph), share[1] * _rate(ph)]}


def _expected_line(ph: PhaseResult, target: Target) -> str:
    exp = _expected(ph, target)
    if exp is not None:
        (lo, hi), (r_lo, r_hi) = exp["measured_share"], exp["tokens_per_s"]
        return (f"  expected on {target.name}: {r_lo:,.1f}-{r_hi:,.1f} tokens/s per replica [k3c's measured runs "
                f"reach {lo * 100:.0f}-{hi:.0%} of this phase's plan here: bench/plan_check.py]")
    seen = {o.name: o.plan_fraction_of(ph.name) for o in TARGETS.values()}
    where = "; ".join(f"{name} {f[0] * 100:.0f}-{f[1]:.0%}" for name, f in seen.items() if f)
    return (f"  expected on {target.name}: not measured, read the rate above as a ceiling"
            + (f" [share of the {ph.name} plan reached where measured: {where}]" if where else ""))


def _phase_dict(ph: PhaseResult, target: Target) -> dict:
    c = ph.cost
    return {"description": ph.description, "tokens": ph.tokens, "flops": c.total_flops, "bytes": c.bytes,
            "comm_bytes": c.comm, "collectives": c.collectives, "roofline_seconds": ph.seconds,
            "comm_seconds": ph.comm_seconds,
            "total_seconds": ph.total_seconds,
            "tokens_per_s": _rate(ph),
            "expected": _expected(ph, target),
            "mla_modes": dict(ph.mla_modes),
            "by_kind": {k: {"ops": d["ops"], "flops": d["cost"].total_flops, "bytes": d["cost"].bytes,
                            "comm_bytes": d["cost"].comm, "seconds": d["seconds"],
                            "flops_per_token": d["cost"].total_flops / ph.tokens if ph.tokens else 0.0,
                            "bytes_per_token": d["cost"].bytes / ph.tokens if ph.tokens else 0.0}
                        for k, d in ph.by_kind.items()}}


# ---- building the plan -----------------------------------------------------------------------------------
@dataclass
class _Lowered:
    """A spec through the default pipeline: what plan() reads of a compiled model (the k3c.api.CompiledModel
    fields of the same names)."""
    spec: ModelSpec
    module: Module
    stages: list[tuple[str, Module]]


def _lowered(model, target: Target, layout: ParallelLayout | None = None, seq_parallel: bool = True) -> _Lowered:
    """A spec (a path or a ModelSpec) lowered for `target`; with `layout`, rank 0's slice of it (the shard pass)."""
    spec = model if isinstance(model, ModelSpec) else load_spec(model)
    shard = {} if layout is None else {"tp": layout.tp, "ep": layout.ep, "rank": 0, "seq_parallel": seq_parallel}
    stages: list[tuple[str, Module]] = []
    module, _ = lower(spec, target, stages=stages, **shard)
    return _Lowered(spec, module, stages)


def _module_of(model, target: Target) -> tuple[Module, str, list[str]]:
    """(the module the plan prices, the model's name, the passes it went through) of a Module, a compiled model
    (k3c.api.CompiledModel or _Lowered) or a spec."""
    if isinstance(model, Module):
        return model, model.name, []
    if not hasattr(model, "stages"):
        model = _lowered(model, target)
    names = [name for name, _ in model.stages[1:]]
    module = model.module
    if "moe-lower" in names and names.index("moe-lower") > 0:
        # the MoE cost and memory rules price the layer-level `moe` op (routing, active experts, dispatch): read
        # the IR just before moe-lower, where every other layer is already lowered
        before = names[names.index("moe-lower") - 1]
        module = next(m for name, m in reversed(model.stages) if name == before)
    return module, model.spec.name, names


def plan(model, target: str | Target = "mi355x", *, tp: int = 1, ep: int | None = None,
         context: int | None = None, batch: int = 1, kv_dtype: str = "bf16",
         prefill_chunk: int = DEFAULT_PREFILL_CHUNK, headroom: float = DEFAULT_HEADROOM, pp: int = 4, vpp: int = 2,
         measured: str | list[Point] | None = None, mla_mode: str = "auto", sharded: bool = False,
         prefix_interval: int = 0, seq_parallel: bool | None = None, compare_full_attention: bool = False) -> Plan:
    """Plan serving `model` (a spec path, ModelSpec, CompiledModel or IR Module) on `target` with TP x EP.
    sharded: plan rank 0's IR from the `shard` pass (what `k3c run --tp --ep` holds) instead of applying the
    planner's split rules to the whole model; a model already sharded is always read that way.
    prefix_interval: count the KDA prefix-cache checkpoints of a PrefixCache(interval=...) (0: no prefix cache).
    seq_parallel: AttnRes blocks split by tokens over TP (None: the sharded IR's own choice, else True).
    compare_full_attention: also plan the model with every layer MLA and compare KV throughput (hybrid.py)."""
    tgt = get_target(target) if isinstance(target, str) else target
    layout = ParallelLayout.make(tp, ep)
    if isinstance(prefix_interval, bool) or not isinstance(prefix_interval, int) or prefix_interval < 0:
        raise ArgumentError(f"--prefix-interval must be an integer >= 0 (0: no prefix cache), got {prefix_interval!r}")
    if prefix_interval > MAX_TOKENS:
        raise ArgumentError(f"--prefix-interval must be <= {MAX_TOKENS}, got {prefix_interval}")
    if seq_parallel is not None and not isinstance(seq_parallel, bool):
        raise ArgumentError(f"seq_parallel must be True, False or None, got {seq_parallel!r}")
    spec_of_model = _spec_of(model) if compare_full_attention else None
    if sharded and not isinstance(model, Module) and not hasattr(model, "module"):
        model = _lowered(model, tgt, layout, seq_parallel is not False)
    if kv_dtype not in KV_DTYPES:
        raise ArgumentError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    for name, v in (("--batch", batch), ("--prefill-chunk", prefill_chunk), ("--pp", pp), ("--vpp", vpp),
                    ("--context", context)):
        if name == "--context" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name} must be an integer >= 1, got {v!r}")
        if v > LIMITS[name]:
            raise ArgumentError(f"{name} must be <= {LIMITS[name]}, got {v}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ArgumentError(f"--headroom must be a number in [0, 1), got {headroom!r}")
    if mla_mode not in ("auto", "mha", "mqa"):
        raise ArgumentError(f"mla_mode must be auto, mha or mqa, got {mla_mode!r}")
    points = load_measured(measured) if isinstance(measured, str) else list(measured or [])
    module, name, passes = _module_of(model, tgt)
    from .sharded import is_sharded, sharded_layout, unshard_view

    rank_ir = is_sharded(module)
    if rank_ir:                     # one rank's IR (shard pass): its own layout and annotations decide the split
        layout = sharded_layout(module, tp if tp != 1 else None, ep)
        own = module.attr("seq_parallel", True) is not False
        if seq_parallel is not None and seq_parallel != own and layout.tp > 1:
            raise ArgumentError(f"--{'' if seq_parallel else 'no-'}seq-parallel: this IR was sharded with sequence "
                                f"parallel {'on' if own else 'off'}; drop the option or plan the spec")
        seq_parallel = own
        module = unshard_view(module)
    seq_parallel = seq_parallel is not False
    facts = ModelFacts.from_module(module)
    if context is None:
        context = facts.max_context or 4096
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ArgumentError(f"--context must be an integer >= 1, got {context!r}")

    weights = weight_report(module, layout, facts)
    planner = MemoryPlanner(module, layout, tgt.hbm_bytes, weights, facts)
    cfg = MemoryConfig(context, batch, kv_dtype, prefill_chunk, headroom, tgt.mla_page_size, tgt.kda_chunk,
                       prefix_interval, seq_parallel)
    memory = planner.plan(cfg)
    fit = {"max_context_at_batch": planner.max_context(batch, cfg), "batch": batch,
           "max_batch_at_context": planner.max_batch(context, cfg), "context": context,
           "max_context_at_batch_1": planner.max_context(1, cfg),
           "max_batch_by_context": {str(n): planner.max_batch(n, cfg) for n in FIT_LENGTHS},
           "model_max_context": facts.max_context}

    cm = CostModel(module, layout, tgt, weights, facts, kv_dtype=kv_dtype, kda_chunk=tgt.kda_chunk,
                   mla_mode=mla_mode, seq_parallel=seq_parallel)
    append_new = min(prefill_chunk, context)
    phases = [cm.prefill(context, batch, prefill_chunk), cm.decode(context, batch),
              cm.append(context, batch, append_new)]

    # one copy of a sequence's cache (not the TP replicas), for the KV throughput
    kvt = kv_throughput(cm, planner.mla_bytes_per_token(kv_dtype), planner.kda_state_per_seq_full,
                        planner.conv_state_per_seq_full, prefill_chunk, KV_THROUGHPUT_LENGTHS)
    result = Plan(name, tgt, layout, cfg, passes, facts, weights, memory, planner, cm, phases, fit, kvt,
                  _mla_section(cm, facts, layout, tgt, kv_dtype, context, append_new),
                  _moe_section(cm, facts, layout, tgt), _attnres_section(facts, pp, vpp, prefill_chunk), points)
    if spec_of_model is not None:
        from .hybrid import compare_rows, full_attention_spec

        variant = full_attention_spec(spec_of_model)
        # the variant planned the way this plan was: a rank's IR of the same layout, or the planner's split rules
        full = plan(_lowered(variant, tgt, layout, seq_parallel) if rank_ir else variant, tgt, tp=layout.tp,
                    ep=layout.ep, context=context, batch=batch, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
                    headroom=headroom, pp=pp, vpp=vpp, mla_mode=mla_mode, prefix_interval=prefix_interval,
                    seq_parallel=seq_parallel)
        result.full_attention, result.full_attention_plan = compare_rows(kvt, full.kv_throughput), full
    return result


def _spec_of(model) -> ModelSpec:
    """The spec behind a plan's model (for the full-attention variant); a bare IR Module has none."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Module):
        raise ArgumentError("--compare-full-attention needs a spec or a compiled model, not a bare IR module")
    spec = getattr(model, "spec", None)
    return spec if isinstance(spec, ModelSpec) else load_spec(model)


def _ep_words(lay: ParallelLayout) -> str:
    """What the layout does with the routed experts, in the assumptions' words."""
    if lay.tp > 1 and lay.ep == 1:
        return "EP 1 (AMD's MI355X TP8 layout: every routed expert split over the TP GPUs)"
    if lay.ep == lay.tp:
        return ("EP = TP, the default (whole experts, E/EP per GPU; AMD's MI355X TP8 deployment runs --ep 1 "
                "instead: every expert split over the 8 GPUs)")
    return f"EP {lay.ep}"


def _mla_section(cm: CostModel, facts: ModelFacts, layout: ParallelLayout, tgt: Target, kv_dtype: str,
                 context: int, append_new: int) -> dict:
    if not facts.mla:
        return {}
    op = facts.mla[0]
    h = ceil_div(op.attr("num_heads"), layout.tp)
    kw = dict(heads=h, kv_dtype=kv_dtype, act_bytes=facts.act_bytes)
    points = []
    for label, new, cached in (("decode", 1, context - 1), ("append-prefill", append_new, context - append_new),
                               ("fresh prefill", append_new, 0)):
        c = mla_mode_costs(op, new, max(cached, 0), tgt, **kw)
        points.append({"case": label, "new_tokens": new, "cached_tokens": max(cached, 0), **c.as_dict()})
    cross = {str(s): mla_crossover_new_tokens(op, s, tgt, **kw) for s in (8192, 131072, context) if s >= 1}
    P, R, V, L = (op.attr("qk_nope_head_dim"), op.attr("qk_rope_head_dim"), op.attr("v_head_dim"),
                  op.attr("kv_lora_rank"))
    return {"heads_per_gpu": h, "per_layer": points, "crossover_new_tokens": cross,
            "pair_flops": {"mha": 2 * (P + R) + 2 * V, "mqa": 2 * (L + R) + 2 * L},
            "layers": len(facts.mla)}


def _moe_section(cm: CostModel, facts: ModelFacts, layout: ParallelLayout, tgt: Target) -> dict:
    if not facts.moe:
        return {}
    op = facts.moe[0]
    m = expert_intermediate(op_params(cm.module, op, cm.weights.by_name))
    F = cm.peaks["expert"]
    B = tgt.link_bytes_per_s
    E = max(layout.ep, 2)
    disp = 1 + 1 / 32 if facts.activation_format == "mxfp8" else facts.act_bytes
    cases = [("dispatch + combine bf16", 2 * facts.act_bytes)]
    if facts.activation_format == "mxfp8":
        cases.insert(0, ("dispatch MXFP8 (1 B + 1/32 scale) + combine bf16", disp + facts.act_bytes))
    rows = [{"case": label, "P": P, "ratio": moe_comm_compute_ratio(P, F, m, B, E)} for label, P in cases]
    return {"m": m, "F": F, "B": B, "E": E, "latent_dim": op.attr("latent_dim"), "top_k": op.attr("top_k"),
            "rows": rows, "note": "E = EP ranks (2 when EP = 1, to show the all-to-all case)"
            if layout.ep < 2 else "E = EP ranks"}


def _attnres_section(facts: ModelFacts, pp: int, vpp: int, chunk: int) -> dict:
    if not facts.attn_res:
        return {}
    blocks = facts.attnres_sources                    # b_0 .. b_N: the embedding and every block
    C = pp * vpp
    Np = blocks / C
    per_block = facts.hidden * facts.act_bytes
    naive, cached = attnres_pp_naive_blocks(pp, vpp, Np), attnres_pp_cached_blocks(pp, vpp, Np)
    return {"P": pp, "V": vpp, "chunks": C, "blocks": blocks, "Np": Np,
            "naive_blocks_per_token": naive, "cached_blocks_per_token": cached,
            "naive_bytes_per_token": naive * per_block, "cached_bytes_per_token": cached * per_block,
            "naive_bytes_per_chunk": naive * per_block * chunk, "cached_bytes_per_chunk": cached * per_block * chunk,
            "peak_transition_blocks": {"naive": (C - 1) * Np, "cached": pp * Np if vpp > 1 else (C - 1) * Np},
            "reduction": naive / cached if cached else 1.0}


# ---- text ------------------------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    right = right if right is not None else set(range(1, len(headers)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(headers), "  " + "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _gb(x: float) -> str:
    return f"{x / GB:,.3f}"


def _render(p: Plan) -> list[str]:
    """The text report, one line per item: the header, sections 1-8, the unmodeled ops and the assumptions."""
    t, lay, cfg, f, w = p.target, p.layout, p.config, p.facts, p.weights
    out = [f"k3c plan: {p.model} on {t.name} ({t.backend} {t.arch}), {lay}",
           f"  context {cfg.context:,} tokens x batch {cfg.batch}, MLA cache {cfg.kv_dtype}, prefill chunk "
           f"{cfg.prefill_chunk:,} tokens, KDA chunk C = {cfg.kda_chunk}, headroom {cfg.headroom:.0%}",
           f"  read from the lowered IR: {f.num_ops:,} ops after passes {', '.join(p.passes) or '(none)'}; "
           f"{len(w.params):,} params; {len(f.kda)} KDA + {len(f.mla)} MLA layers, {len(f.moe)} MoE + "
           f"{len(f.mlp)} dense MLP, {len(f.attn_res)} AttnRes mixes",
           "  units: GB = 1e9 bytes, GiB = 2^30 bytes; [brackets] name the formula of each derived number", ""]
    for section in (_weights_lines, _memory_lines, _cost_lines, _kv_throughput_lines, _mla_lines,
                    _moe_comm_lines, _attnres_pp_lines, _measured_lines):
        out += section(p)
    if p.cost_model.unmodeled:
        out += ["", "  ops without a cost rule of their own, priced as memory-bound (activations in/out once, "
                "1 FLOP per result element): "
                + ", ".join(f"{k} x {v}" for k, v in sorted(p.cost_model.unmodeled.items()))
                + f"; rules exist for {', '.join(cost_rules())}"]
    out += ["", "Assumptions"] + [f"  - {s}" for s in p.assumptions()]
    if p.plot_path:
        out += ["", f"plot: {p.plot_path}"]
    return out


def _weights_lines(p: Plan) -> list[str]:
    """1. Weights: whole model and per GPU, by category and by precision."""
    w = p.weights
    out: list[str] = []
    out += ["1. Weights",
            f"  whole model on disk  {fmt_bytes(w.total_bytes)}  = {w.total_bytes:,} B  [sum over IR params of "
            "stored bytes: numel x dtype bits / 8; MXFP4: rows x (ceil(K/2) + ceil(K/32))]",
            f"  routed experts       {fmt_bytes(w.routed_expert_bytes)}  = {w.routed_expert_bytes:,} B",
            f"  params               {w.total_params:,} total ({w.total_params / 1e12:.3f} T), "
            f"{w.active_params / 1e9:,.2f} B active per token  [{FORMULAS['active_params']}]",
            f"  per GPU              {fmt_bytes(w.gpu_bytes)}  [sum of each resident param's per-GPU share"
            + (" + weight-transform results" if w.derived else "") + "]"]
    if w.derived:
        ops = sorted({d["op"] for d in w.derived})
        freed = sum(q.gpu_bytes for q in w.params if q.name in set(w.dropped))
        out.append(f"  weight transforms    {len(w.derived)} results of {', '.join(ops)} computed at load: "
                   f"{sum(d['gpu_bytes'] for d in w.derived) / GB:,.3f} GB per GPU, replacing {len(w.dropped)} "
                   f"params only they read ({freed / GB:,.3f} GB per GPU, freed after load)")
    out.append("")
    rows = []
    for cat, d in w.by_category.items():
        splits = sorted({q.split for q in w.params if q.category == cat})
        rows.append([cat, f"{d['params'] / 1e9:,.3f}", "+".join(d["precisions"]), _gb(d["bytes"]),
                     _gb(d["gpu_bytes"]), "/".join(splits)])
    out += _table(["category", "params (B)", "precision", "total GB", "per GPU GB", "split"], rows, {1, 3, 4})
    out.append("")
    rows = [[k, _gb(d["bytes"]), _gb(d["gpu_bytes"])] for k, d in w.by_precision.items()]
    out += _table(["precision", "total GB", "per GPU GB"], rows)
    out.append("")
    return out


def _memory_lines(p: Plan) -> list[str]:
    """2. Memory per GPU item by item, and the largest context and batch that fit."""
    t, lay, cfg, f, mem = p.target, p.layout, p.config, p.facts, p.memory
    a = f.act_bytes
    out: list[str] = []
    pages = ceil_div(cfg.context, cfg.page_size) * cfg.page_size
    ncols = f"{p.planner.mla_values_per_token // max(len(f.mla), 1)}" if f.mla else "0"
    kda0 = f.kda[0] if f.kda else None
    step_tokens = p.planner.step_tokens(cfg)
    ws_text = " + ".join(f"{k} {v / GB:.3f}" for k, v in mem.workspace.items())
    items = [
        ("weights", mem.weights_bytes, "sum of per-GPU param shares (section 1)"),
        ("MLA latent cache", mem.mla_kv_cache_bytes,
         f"{cfg.batch} x {pages:,} tokens x {len(f.mla)} layers x "
         f"{p.planner.mla_bytes_per_token(cfg.kv_dtype) // max(len(f.mla), 1)} B ({ncols} values, {cfg.kv_dtype}); "
         f"replicated on every TP rank"),
        ("KDA state", mem.kda_state_bytes,
         f"{cfg.batch} x {len(f.kda)} layers x {ceil_div(kda0.attr('num_heads'), lay.tp)} heads x "
         f"{kda0.attr('head_dim')}^2 x 4 B (fp32); heads/TP" if kda0 else "no KDA layers"),
        ("conv tails", mem.conv_state_bytes,
         f"{cfg.batch} x {len(f.kda)} layers x 3 x {ceil_div(kda0.attr('num_heads'), lay.tp)} heads x "
         f"{kda0.attr('head_dim')} ch x ({kda0.attr('conv_kernel')}-1) x {a:g} B" if kda0 else "no KDA layers"),
        ("AttnRes blocks", mem.attnres_bytes,
         (f"{f.attnres_blocks} blocks x ceil({step_tokens:,}/{lay.tp}) tokens x {f.hidden} x {a:g} B"
          if cfg.seq_parallel else
          f"{f.attnres_blocks} blocks x {step_tokens:,} tokens x {f.hidden} x {a:g} B (not sequence-sharded)")
         if f.attnres_blocks else "no AttnRes"),
        ("workspace", mem.workspace_bytes, f"n = {step_tokens:,} tokens: {ws_text} GB"),
        ("KDA prefix checkpoints", mem.kda_checkpoint_bytes,
         f"{cfg.batch} x ceil({cfg.context:,}/{cfg.prefix_interval:,}) = {mem.checkpoints} checkpoints x "
         f"(KDA state {p.planner.kda_state_per_seq / GB:.4f} + conv tails {p.planner.conv_state_per_seq / GB:.4f}"
         f" + logits row {p.planner.logits_row_bytes / GB:.4f} GB) [{FORMULAS['kda_checkpoints']}]"
         if cfg.prefix_interval else "no prefix cache (--prefix-interval N: a checkpoint every N tokens)"),
    ]
    out += [f"2. Memory per GPU: HBM {fmt_bytes(t.hbm_bytes)}, usable {fmt_bytes(mem.usable_bytes)} after "
            f"{cfg.headroom:.0%} headroom"]
    rows = [[k, _gb(v), f"{v / GiB:,.3f}", why] for k, v, why in items]
    rows.append(["total", _gb(mem.total_bytes), f"{mem.total_bytes / GiB:,.3f}",
                 f"{mem.total_bytes / mem.usable_bytes:.1%} of usable: "
                 + (f"fits, {(mem.usable_bytes - mem.total_bytes) / GB:,.2f} GB free" if mem.fits else
                    f"DOES NOT FIT, {(mem.total_bytes - mem.usable_bytes) / GB:,.2f} GB over")])
    out += _table(["item", "GB", "GiB", "formula"], rows, {1, 2})
    fit = p.fit
    cap = fit["model_max_context"]
    at1 = f"; at batch 1: {fit['max_context_at_batch_1']:,}" if cfg.batch != 1 else ""
    fixed = mem.total_bytes - mem.mla_kv_cache_bytes
    per_token = p.planner.mla_bytes_per_token(cfg.kv_dtype)
    pool = mem.usable_bytes - fixed
    if per_token:
        out += ["", f"  MLA cache pool after the fixed items: {pool / GB:,.2f} GB = "
                f"{max(pool, 0) / per_token / 1e6:,.3f} M tokens of {cfg.kv_dtype} latent cache per GPU  [(usable - "
                f"every item above but the MLA cache) / {per_token:,} B per token]"]
    out += ["", f"  largest context at batch {cfg.batch}: {fit['max_context_at_batch']:,} tokens "
            f"(model max_context {cap:,}){at1}  [largest page multiple with total <= usable]"
            + ("; the weights and fixed buffers alone exceed the usable HBM" if not fit["max_context_at_batch"]
               else ""),
            f"  largest batch at context {cfg.context:,}: {fit['max_batch_at_context']:,}; at "
            + ", ".join(f"{int(k) // 1024:,}K: {v:,}" for k, v in fit["max_batch_by_context"].items())
            + "  [largest batch with total <= usable]", ""]
    return out


def _cost_lines(p: Plan) -> list[str]:
    """3. Cost per GPU by layer kind for each phase, against the roofline."""
    t = p.target
    out: list[str] = []
    peaks = p.cost_model.peaks
    out += [f"3. Cost per GPU: FLOPs and HBM bytes per token by layer kind; roofline "
            f"[{FORMULAS['roofline_time']}]",
            f"  peaks: bf16 {fmt_si(peaks['bf16'], 'FLOP/s')}, routed experts {fmt_si(peaks['expert'], 'FLOP/s')}, "
            f"HBM {fmt_si(t.hbm_bytes_per_s, 'B/s')} (ridge {ridge(peaks['bf16'], t.hbm_bytes_per_s):.0f} "
            f"FLOP/B at bf16), link {fmt_si(t.link_bytes_per_s, 'B/s')}",
            "  per-op rules (per GPU, n tokens in a step; every linear: 2 x per-GPU weight elements FLOPs per token, "
            "weights read once per step, input and output activations once):",
            f"    kda       linears + core [{FORMULAS['kda_prefill_flops']}; {FORMULAS['kda_prefill_bytes']}] "
            f"for new > 1, else [{FORMULAS['kda_decode_flops']}; {FORMULAS['kda_decode_bytes']}]",
            "    mla       linears + mla_mode_costs of the faster (or pinned) mode [pairs x pair FLOPs + W_kvb use; "
            "latent cache read once] + cache append n x (L+R) x kv_bytes",
            f"    moe       router, shared, latent linears + experts n x top_k / TP x 6 m z FLOPs; expert weights read "
            f"for the experts hit [{FORMULAS['experts_touched']}]",
            "    mlp       linears; attn_res: naive mix 6 d FLOPs and d x act_bytes per source and token (two-phase "
            "ops when attnres-split ran), / TP; other: rmsnorm 4 d, add d, embedding gather, lm_head "
            "2 d V/TP for the last token of each prompt"]
    for ph in p.phases:
        c = ph.cost
        modes = ", ".join(f"{k} x {v:,}" for k, v in ph.mla_modes.items())
        out += ["", f"  {ph.name}: {ph.description}" + (f"; MLA layer-steps by mode: {modes}" if modes else "")]
        rows = []
        for kind, d in ph.by_kind.items():
            kc = d["cost"]
            ai = kc.total_flops / kc.bytes if kc.bytes else 0.0
            bound = "compute" if kc.compute_seconds(peaks) >= kc.bytes / t.hbm_bytes_per_s else "memory"
            rows.append([kind, f"{d['ops']}", fmt_si(kc.total_flops / ph.tokens), fmt_si(kc.bytes / ph.tokens, "B"),
                         f"{ai:,.1f}", bound, fmt_seconds(d["seconds"]),
                         f"{d['seconds'] / ph.seconds:.1%}" if ph.seconds else "-"])
        out += _table(["kind", "ops", "FLOPs/token", "bytes/token", "FLOP/B", "bound", "time", "share"], rows)
        rate = _rate(ph)
        lat = c.collectives * t.collective_latency_s
        out.append(f"  total {fmt_si(c.total_flops, 'FLOP')}, {fmt_si(c.bytes, 'B')} HBM, "
                   f"{fmt_si(c.comm, 'B')} link, {c.collectives:,.0f} collectives; roofline "
                   f"{fmt_seconds(ph.seconds)} + link {fmt_seconds(ph.comm_seconds - lat)} "
                   f"[{FORMULAS['allreduce_bytes']}] + latency {fmt_seconds(lat)} [{FORMULAS['collective_latency']}] "
                   f"= {fmt_seconds(ph.total_seconds)} -> {rate:,.1f} tokens/s per replica")
        out.append(_expected_line(ph, t))
    return out


def _kv_throughput_lines(p: Plan) -> list[str]:
    """4. KV throughput: bytes of cache per second of prefill, by context."""
    cfg = p.config
    out: list[str] = []
    out += ["", f"4. KV throughput [{FORMULAS['kv_throughput']}; one copy of the cache: MLA {cfg.kv_dtype} + "
            "KDA state + conv tails; prefill time = roofline + link, batch 1]"]
    rows = [[f"{r['context']:,}", _gb(r["cache_bytes"]), fmt_seconds(r["prefill_seconds"]),
             f"{r['bytes_per_s'] / GB:,.3f}"] for r in p.kv_throughput]
    out += _table(["context", "cache GB", "prefill", "GB/s"], rows)
    if p.full_attention:
        full = p.full_attention_plan
        out += ["", f"  against full attention: {full.model}, every layer MLA ({len(full.facts.mla)} MLA layers "
                f"for {len(p.facts.kda)} KDA + {len(p.facts.mla)} MLA), the same target, layout and options; "
                "KV throughput = cache bytes / prefill time of each model; ratios full / hybrid"]
        rows = [[f"{r['context']:,}", _gb(r["hybrid"]["cache_bytes"]), fmt_seconds(r["hybrid"]["prefill_seconds"]),
                 f"{r['hybrid']['bytes_per_s'] / GB:,.3f}", _gb(r["full_attention"]["cache_bytes"]),
                 fmt_seconds(r["full_attention"]["prefill_seconds"]),
                 f"{r['full_attention']['bytes_per_s'] / GB:,.3f}", f"{r['cache_ratio']:,.2f}x",
                 f"{r['prefill_ratio']:,.2f}x", f"{r['kv_throughput_ratio']:,.2f}x"] for r in p.full_attention]
        out += _table(["context", "hybrid GB", "prefill", "GB/s", "full GB", "prefill", "GB/s", "cache",
                       "prefill", "KV throughput"], rows)
    return out


def _mla_lines(p: Plan) -> list[str]:
    """5. MLA MHA vs MQA (absorbed) per layer and GPU; none without MLA layers."""
    if not p.mla:
        return []
    out: list[str] = []
    m = p.mla
    out += ["", f"5. MLA MHA vs MQA (absorbed) per layer and GPU ({m['heads_per_gpu']} heads): "
            f"[{FORMULAS['mla_mha_pair_flops']}] = {m['pair_flops']['mha']}, "
            f"[{FORMULAS['mla_mqa_pair_flops']}] = {m['pair_flops']['mqa']} "
            f"(ratio {m['pair_flops']['mqa'] / m['pair_flops']['mha']:.2f}); MHA adds "
            f"[{FORMULAS['mla_mha_expand_flops']}], MQA adds [{FORMULAS['mla_mqa_absorb_flops']}]"]
    rows = []
    for r in m["per_layer"]:
        rows.append([r["case"], f"{r['new_tokens']:,}", f"{r['cached_tokens']:,}",
                     fmt_si(r["mha"]["flops"]), fmt_seconds(r["mha"]["seconds"]),
                     fmt_si(r["mqa"]["flops"]), fmt_seconds(r["mqa"]["seconds"]), r["best"]])
    out += _table(["case", "new", "cached", "MHA FLOPs", "MHA time", "MQA FLOPs", "MQA time", "faster"], rows)
    out.append("  crossover (fewest new tokens for which MHA is at least as fast): "
               + ", ".join(f"after {int(s):,} cached: {'never' if v is None else f'{v:,}'}"
                           for s, v in m["crossover_new_tokens"].items())
               + "  [mla_mode_costs: roofline of both modes]")
    return out


def _moe_comm_lines(p: Plan) -> list[str]:
    """6. MoE communication against compute; none without MoE layers."""
    if not p.moe_comm:
        return []
    f = p.facts
    out: list[str] = []
    mc = p.moe_comm
    out += ["", f"6. MoE communication / compute [{FORMULAS['moe_comm_compute_ratio']}] with F = "
            f"{fmt_si(mc['F'], 'FLOP/s')} (expert GEMM peak), B = {fmt_si(mc['B'], 'B/s')} (link), "
            f"m = {mc['m']}, E = {mc['E']} ({mc['note']}); the expert width "
            f"({mc['latent_dim'] or f.hidden}{', latent' if mc['latent_dim'] else ''}) cancels"]
    for r in mc["rows"]:
        out.append(f"  {r['case']}: P = {r['P']:.3f} B/element -> T_comm/T_comp = {r['ratio']:.2f}"
                   + ("  (communication-bound at peak compute)" if r["ratio"] > 1 else ""))
    return out


def _attnres_pp_lines(p: Plan) -> list[str]:
    """7. AttnRes pipeline-parallel communication; none without AttnRes."""
    if not p.attnres_pp:
        return []
    cfg, f = p.config, p.facts
    a = f.act_bytes
    out: list[str] = []
    ar = p.attnres_pp
    out += ["", f"7. AttnRes pipeline-parallel communication, P = {ar['P']} stages x V = {ar['V']} virtual "
            f"stages (C = {ar['chunks']} chunks), {ar['blocks']} block representations (b_0 = embedding), "
            f"N_p = {ar['Np']:.3f} per chunk, {f.hidden} x {a:g} B each",
            f"  naive:  {ar['naive_blocks_per_token']:.2f} blocks/token = "
            f"{fmt_si(ar['naive_bytes_per_token'], 'B')}/token, {_gb(ar['naive_bytes_per_chunk'])} GB per "
            f"{cfg.prefill_chunk:,}-token micro-batch  [{FORMULAS['attnres_pp_naive']}]",
            f"  cached: {ar['cached_blocks_per_token']:.2f} blocks/token = "
            f"{fmt_si(ar['cached_bytes_per_token'], 'B')}/token, {_gb(ar['cached_bytes_per_chunk'])} GB  "
            f"[{FORMULAS['attnres_pp_cached']}]; {ar['reduction']:.2f}x less, peak per transition "
            f"{ar['peak_transition_blocks']['naive']:.2f} -> {ar['peak_transition_blocks']['cached']:.2f} blocks"]
    return out


def _measured_lines(p: Plan) -> list[str]:
    """8. Measured bench points against the roofline; none without them."""
    if not p.measured:
        return []
    t, peaks = p.target, p.cost_model.peaks
    out: list[str] = []
    out += ["", "8. Measured points (bench JSON) against the roofline"]
    rows = [[r["name"], f"{r['intensity']:,.1f}", fmt_si(r["flops_per_s"], "FLOP/s"),
             fmt_si(r["bytes_per_s"], "B/s"), fmt_si(r["roofline_flops_per_s"], "FLOP/s"),
             f"{r['fraction_of_roofline']:.1%}"]
            for r in measured_rows(p.measured, t, max(peaks.values()))]
    out += _table(["name", "FLOP/B", "achieved", "bandwidth", "roofline", "of roofline"], rows)
    return out


def write_plot(p: Plan, path: str, overwrite: bool = False) -> str:
    from .plot import plot_plan

    plot_plan(p, path, overwrite)
    p.plot_path = os.fspath(path)
    return p.plot_path
