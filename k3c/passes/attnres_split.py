"""attnres-split: Block AttnRes as the two-phase schedule of the paper (Alg. 1; K3.md section 4).

Before (per sublayer, as the frontend writes K3.md line by line):
    %p = add(%p_old, %y)                                   # the partial sum b_n^i
    %h = attn_res_mix(%b_0, ..., %b_{N-1}, %p, %w, %g)     # every source read (twice) by every sublayer
    %x = rmsnorm(%h, %gain)                                # the next sublayer's input norm
After:
    per block group (the mixes that share the completed blocks b_0..b_{N-1}, including the final output mix):
    %q  = attn_res_fold_queries(%w_0, %g_0, ...)           # weight transform: one f32 query per mix
    %s  = attn_res_phase1(%b_0, ..., %b_{N-1}, %q)          # all Q queries, each block row read once
    per sublayer:
    %r  = attn_res_phase2(%s, %q, %p_old, %y, %gain) {query = j, mode = "update", normed = true}
    %p  = attn_res_take(%r) {index = 0}                     # the new partial (same name as the add it replaces)
    %x  = attn_res_take(%r) {index = 1}                     # the normed mix (same name as the rmsnorm)

The add is fused when its result is the mix's partial and is used nowhere before the mix; the rmsnorm when it is
the mix's only user. Param ops the new ops need earlier are hoisted (params have no inputs).

Bytes (per token, annotated on every phase-2 op, summed per layer by `k3c inspect --bytes`; e = element bytes):
  naive  = add 3De (if it is fused here) + mix 2 n_src De (scores pass and weighted-sum pass over every source)
           + De (h) + norm 2De (if fused)
  split  = update 3De | partial read De | 0, + (STATS + D)e (phase-1 row) + De (output)
           + 1/Q of phase 1: N De (blocks) + Q (STATS + D)e (rows written)
"""
from __future__ import annotations

from ..ir.attnres_ops import STATS
from ..ir.builder import Builder
from ..ir.core import DTYPE_BITS, Module
from .registry import PassContext, register_pass


def _elem_bytes(dtype: str) -> int:
    return max(1, DTYPE_BITS[dtype] // 8)


@register_pass("attnres-split", ensures=("no-dead-ops",))
def attnres_split(module: Module, ctx: PassContext) -> Module:
    """Block AttnRes as per-block phase-1 ops + per-sublayer phase-2 ops (merge, update, next RMSNorm)."""
    if not any(op.op == "attn_res_mix" for op in module.ops):
        return module
    plan = _SplitPlan(module)
    out = _Rebuild(module, ctx, plan).run()
    naive_total = sum(o.attr("bytes_naive") for o in out.ops if o.op == "attn_res_phase2")
    split_total = sum(o.attr("bytes_split") for o in out.ops if o.op == "attn_res_phase2")
    return out.replace(attrs=tuple(sorted({**module.attr_dict, "attnres_bytes_per_token":
                                           (naive_total, split_total)}.items())))


class _SplitPlan:
    """What the rewrite does, by op index: the block groups (mixes sharing their completed blocks) and the adds /
    rmsnorms each mix absorbs."""

    def __init__(self, module: Module):
        ops = self.ops = module.ops
        self.mixes = [i for i, op in enumerate(ops) if op.op == "attn_res_mix"]
        self.pos = {r: i for i, op in enumerate(ops) for r in op.results}
        self.users: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            for v in op.inputs:
                self.users.setdefault(v, []).append(i)
        self.outputs = set(module.outputs)
        self.groups: dict[tuple, list[int]] = {}            # completed blocks -> the mixes reading them, in order
        for i in self.mixes:
            op = ops[i]
            self.groups.setdefault(tuple(op.inputs[:op.attr("block")]), []).append(i)
        self.group_of = {i: key for key, members in self.groups.items() for i in members}
        self.first_of = {members[0]: key for key, members in self.groups.items()}
        self.fused_add: dict[int, int] = {}       # mix index -> add index
        self.fused_norm: dict[int, int] = {}      # mix index -> rmsnorm index
        self.dropped: set[int] = set()
        for i in self.mixes:
            self._plan_fusions(i)

    def _plan_fusions(self, i: int) -> None:
        """The add making mix i's partial (used nowhere before the mix) and the rmsnorm that is the mix's only user."""
        ops, users, outputs = self.ops, self.users, self.outputs
        op = ops[i]
        if op.attr("num_sources") == op.attr("block") + 1:
            p = op.inputs[op.attr("block")]
            j = self.pos.get(p)
            if (j is not None and ops[j].op == "add" and p not in outputs and j not in self.dropped
                    and all(u >= i for u in users.get(p, ())) and users[p].count(i) == 1):
                self.fused_add[i] = j
                self.dropped.add(j)
        h = op.results[0]
        us = users.get(h, [])
        if len(us) == 1 and h not in outputs and ops[us[0]].op == "rmsnorm" and ops[us[0]].inputs[0] == h:
            self.fused_norm[i] = us[0]
            self.dropped.add(us[0])


class _Rebuild:
    """The module with each group's fold + phase 1 at its first mix, and each mix as its phase-2 op."""

    def __init__(self, module: Module, ctx: PassContext, plan: _SplitPlan):
        self.module, self.ctx, self.plan, self.ops = module, ctx, plan, module.ops
        self.b = Builder.like(module)
        self.emitted: set[int] = set()
        self.group_vals: dict[tuple, tuple[str, str, int]] = {}    # key -> (queries, phase1, phase-1 bytes/token)

    def run(self) -> Module:
        for i, op in enumerate(self.ctx.walk(self.ops)):
            if i in self.emitted or i in self.plan.dropped:
                continue
            if op.op != "attn_res_mix":
                self.emitted.add(i)
                self.b.append(op)
                continue
            if i in self.plan.first_of:
                self.phase1(op, self.plan.first_of[i])
            self.phase2(i, op)
            self.emitted.add(i)
        return self.b.build(self.module.outputs)

    def param(self, v: str) -> None:
        """Hoist the param defining v (params have no inputs) if it is not emitted yet."""
        k = self.plan.pos.get(v)
        if k is not None and self.ops[k].op == "param" and k not in self.emitted:
            self.emitted.add(k)
            self.b.append(self.ops[k])

    def phase1(self, op, key: tuple) -> None:
        """The group's folded queries and its phase-1 op, at the group's first mix `op`."""
        b, members = self.b, self.plan.groups[key]
        d, e = op.types[0].shape[-1], _elem_bytes(op.types[0].dtype)
        qin = []
        for m in members:
            for v in self.ops[m].inputs[-2:]:
                self.param(v)
                qin.append(v)
        qv = b.op("attn_res_fold_queries", qin, {"num_queries": len(members)}, op.loc, prefix="q")
        n, nq = len(key), len(members)
        p1_bytes = n * d * e + nq * (STATS + d) * e
        attrs1 = {"num_sources": n, "num_queries": nq, "eps": op.attr("eps"), "bytes": p1_bytes}
        if op.attr("layer", None) is not None:
            attrs1["layer"] = op.attr("layer")
        s1 = b.op("attn_res_phase1", list(key) + [qv], attrs1, op.loc, prefix="s")
        self.group_vals[key] = (qv, s1, p1_bytes)
        self.ctx.count("phase1")
        self.ctx.count("folded_queries", nq)

    def phase2(self, i: int, op) -> None:
        """Mix i as its phase-2 op, fused with its add (mode "update") and its rmsnorm (normed) where planned;
        annotated with the naive and split bytes per token."""
        plan, ops, b, ctx = self.plan, self.ops, self.b, self.ctx
        key = plan.group_of[i]
        d, e = op.types[0].shape[-1], _elem_bytes(op.types[0].dtype)
        qv, s1, p1_bytes = self.group_vals[key]
        members = plan.groups[key]
        attrs = {"query": members.index(i), "eps": op.attr("eps"), "sublayer": op.attr("sublayer")}
        if op.attr("layer", None) is not None:
            attrs["layer"] = op.attr("layer")
        inputs = [s1, qv]
        naive = 2 * op.attr("num_sources") * d * e + d * e
        split = (STATS + d) * e + d * e + p1_bytes // len(members)
        if i in plan.fused_add:
            add = ops[plan.fused_add[i]]
            attrs["mode"] = "update"
            inputs += list(add.inputs)
            naive += 3 * d * e
            split += 3 * d * e
            ctx.count("fused_update")
        elif op.attr("num_sources") == op.attr("block") + 1:
            attrs["mode"] = "source"
            inputs.append(op.inputs[op.attr("block")])
            split += d * e
        else:
            attrs["mode"] = "none"
        out_name, out_loc = op.results[0], op.loc
        if i in plan.fused_norm:
            norm = ops[plan.fused_norm[i]]
            self.param(norm.inputs[1])
            attrs.update(normed=True, norm_eps=norm.attr("eps"))
            inputs.append(norm.inputs[1])
            out_name = norm.results[0]
            naive += 2 * d * e
            ctx.count("fused_norm")
        else:
            attrs["normed"] = False
        attrs.update(bytes_naive=naive, bytes_split=split)
        ctx.count("phase2")
        if attrs["mode"] == "update":
            r = b.op("attn_res_phase2", inputs, attrs, op.loc, prefix="r")
            add = ops[plan.fused_add[i]]
            if plan.users.get(add.results[0]) != [i] or add.results[0] in plan.outputs:
                b.append(b.make("attn_res_take", [r], {"index": 0}, add.loc, results=(add.results[0],)))
            b.append(b.make("attn_res_take", [r], {"index": 1}, out_loc, results=(out_name,)))
        else:
            b.append(b.make("attn_res_phase2", inputs, attrs, op.loc, results=(out_name,)))


def bytes_summary(module: Module) -> str:
    """Per layer, the HBM bytes per token of the naive AttnRes against the split one (the phase-2 annotations;
    `k3c inspect --bytes`)."""
    rows: dict[str, list[int]] = {}
    for op in module.ops:
        if op.op == "attn_res_phase2" and op.attr("bytes_naive", None) is not None:
            layer = op.attr("layer", None)
            key = "out" if layer is None else str(layer)
            r = rows.setdefault(key, [0, 0, 0])
            r[0] += 1
            r[1] += op.attr("bytes_naive")
            r[2] += op.attr("bytes_split")
    if not rows:
        return "no AttnRes bytes annotations (run the attnres-split pass: --passes attnres-split,dce,cse)\n"
    lines = [f"AttnRes bytes per token (hidden {module.attr('hidden_size', '?')}, {module.attr('dtype', '?')}): "
             "naive (every sublayer reads every source) vs split (phase 1 shared per block + phase 2)",
             f"{'layer':>6} {'mixes':>5} {'naive B/tok':>12} {'split B/tok':>12} {'naive/split':>11}"]
    tn = ts = 0
    for key, (n, naive, split) in rows.items():
        tn, ts = tn + naive, ts + split
        lines.append(f"{key:>6} {n:>5} {naive:>12} {split:>12} {naive / split:>10.2f}x")
    lines.append(f"{'total':>6} {sum(r[0] for r in rows.values()):>5} {tn:>12} {ts:>12} {tn / ts:>10.2f}x")
    return "\n".join(lines) + "\n"
