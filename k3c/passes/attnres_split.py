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
    from ..runtime import kernel_impls as _runtime_kernels  # noqa: F401  (registers the new ops' executor impls)

    ops = module.ops
    mixes = [i for i, op in enumerate(ops) if op.op == "attn_res_mix"]
    if not mixes:
        return module
    pos = {r: i for i, op in enumerate(ops) for r in op.results}
    users: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for v in op.inputs:
            users.setdefault(v, []).append(i)
    outputs = set(module.outputs)

    # -- plan ---------------------------------------------------------------------------------------------------
    groups: dict[tuple, list[int]] = {}
    for i in mixes:
        op = ops[i]
        groups.setdefault(tuple(op.inputs[:op.attr("block")]), []).append(i)
    group_of = {i: key for key, members in groups.items() for i in members}
    first_of = {members[0]: key for key, members in groups.items()}

    fused_add: dict[int, int] = {}       # mix index -> add index
    fused_norm: dict[int, int] = {}      # mix index -> rmsnorm index
    dropped: set[int] = set()
    for i in mixes:
        op = ops[i]
        if op.attr("num_sources") == op.attr("block") + 1:
            p = op.inputs[op.attr("block")]
            j = pos.get(p)
            if (j is not None and ops[j].op == "add" and p not in outputs and j not in dropped
                    and all(u >= i for u in users.get(p, ())) and users[p].count(i) == 1):
                fused_add[i] = j
                dropped.add(j)
        h = op.results[0]
        us = users.get(h, [])
        if len(us) == 1 and h not in outputs and ops[us[0]].op == "rmsnorm" and ops[us[0]].inputs[0] == h:
            fused_norm[i] = us[0]
            dropped.add(us[0])

    # -- rebuild --------------------------------------------------------------------------------------------------
    b = Builder.like(module)
    emitted: set[int] = set()
    group_vals: dict[tuple, tuple[str, str, int]] = {}     # key -> (queries, phase1, phase-1 bytes per token)

    def emit_param(v: str) -> None:
        k = pos.get(v)
        if k is not None and ops[k].op == "param" and k not in emitted:
            emitted.add(k)
            b.append(ops[k])

    for i, op in enumerate(ctx.walk(ops)):
        if i in emitted or i in dropped:
            continue
        if op.op != "attn_res_mix":
            emitted.add(i)
            b.append(op)
            continue
        key = group_of[i]
        d = op.types[0].shape[-1]
        e = _elem_bytes(op.types[0].dtype)
        if i in first_of:
            members = groups[key]
            qin = []
            for m in members:
                for v in ops[m].inputs[-2:]:
                    emit_param(v)
                    qin.append(v)
            qv = b.op("attn_res_fold_queries", qin, {"num_queries": len(members)}, op.loc, prefix="q")
            n, nq = len(key), len(members)
            p1_bytes = n * d * e + nq * (STATS + d) * e
            attrs1 = {"num_sources": n, "num_queries": nq, "eps": op.attr("eps"), "bytes": p1_bytes}
            if op.attr("layer", None) is not None:
                attrs1["layer"] = op.attr("layer")
            s1 = b.op("attn_res_phase1", list(key) + [qv], attrs1, op.loc, prefix="s")
            group_vals[key] = (qv, s1, p1_bytes)
            ctx.count("phase1")
            ctx.count("folded_queries", nq)
        qv, s1, p1_bytes = group_vals[key]
        members = groups[key]
        j = members.index(i)
        attrs = {"query": j, "eps": op.attr("eps"), "sublayer": op.attr("sublayer")}
        if op.attr("layer", None) is not None:
            attrs["layer"] = op.attr("layer")
        inputs = [s1, qv]
        naive = 2 * op.attr("num_sources") * d * e + d * e
        split = (STATS + d) * e + d * e + p1_bytes // len(members)
        if i in fused_add:
            add = ops[fused_add[i]]
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
        if i in fused_norm:
            norm = ops[fused_norm[i]]
            emit_param(norm.inputs[1])
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
            add = ops[fused_add[i]]
            if users.get(add.results[0]) != [i] or add.results[0] in outputs:
                b.append(b.make("attn_res_take", [r], {"index": 0}, add.loc, results=(add.results[0],)))
            b.append(b.make("attn_res_take", [r], {"index": 1}, out_loc, results=(out_name,)))
        else:
            b.append(b.make("attn_res_phase2", inputs, attrs, op.loc, results=(out_name,)))
        emitted.add(i)
    out = b.build(module.outputs)
    naive_total = sum(o.attr("bytes_naive") for o in out.ops if o.op == "attn_res_phase2")
    split_total = sum(o.attr("bytes_split") for o in out.ops if o.op == "attn_res_phase2")
    return out.replace(attrs=tuple(sorted({**module.attr_dict, "attnres_bytes_per_token":
                                           (naive_total, split_total)}.items())))


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
