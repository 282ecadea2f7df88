"""Kernel-level ops of the two-phase Block AttnRes schedule (K3.md section 4, paper Alg. 1), made by `attnres-split`.

    %q  = attn_res_fold_queries(%proj.0, %norm.0, ..., %proj.{Q-1}, %norm.{Q-1}) {num_queries = Q}   : f32[Q, D]
          weight transform: row j = proj_j * norm_gain_j, the effective query of the j-th mix of a block group
    %s1 = attn_res_phase1(%b_0, ..., %b_{N-1}, %q) {num_sources = N, num_queries = Q, eps}
          : dtype[Q, *lead, STATS + D]
          every query of the group against the completed blocks, each block row read once: per query and token
          a row [lse (f32 bits in the first STATS elements), o (D values)], o = softmax-weighted sum, lse = m + log l
    %r  = attn_res_phase2(%s1, %q, [%p_old, %y | %p], [%gain]) {query, mode, normed, eps, norm_eps}
          merge of the partial sum by online softmax, fused with the update p = p_old + y (mode "update") and with
          the RMSNorm of the next sublayer (normed); mode "update" returns [2, *lead, D] = (new partial, output),
          else [*lead, D]
    %v  = attn_res_take(%r) {index}      : r[index] (a view; selects the partial or the output of an update)

The stats occupy STATS = 8 elements so that the o part stays 16-byte aligned for bf16 and fp32 alike; lse is the
f32 whose bits lie in the row's first 4 bytes. (One packed result because the executor runs single-result ops.)
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import TensorType
from .opdef import AttrSpec, OpDef, Role, TypeCheck, activation, expect, require

STATS = 8          # elements of a phase-1 row before o: the lse (f32 bits) and padding to 16 bytes


def _n(attrs: Mapping[str, Any], key: str) -> int:
    n = attrs.get(key, 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


# -- attn_res_fold_queries ---------------------------------------------------------------------------------------
def _fold_roles(attrs):
    out = []
    for j in range(_n(attrs, "num_queries")):
        out += [Role(f"proj.{j}"), Role(f"norm.{j}")]
    return tuple(out)


def _infer_fold(attrs, ins):
    q = _n(attrs, "num_queries")
    require(q > 0, "attn_res_fold_queries needs num_queries >= 1")
    d = ins["proj.0"].shape[0] if ins["proj.0"].rank == 1 else None
    require(d is not None, f"proj.0: expected [hidden], got {ins['proj.0']}")
    for j in range(q):
        expect(ins[f"proj.{j}"], f"proj.{j}", (d,))
        expect(ins[f"norm.{j}"], f"norm.{j}", (d,))
    return (TensorType("f32", (q, d)),)


ATTN_RES_FOLD_QUERIES = OpDef(
    "attn_res_fold_queries", _fold_roles, {"num_queries": AttrSpec("int")}, _infer_fold, weight_transform=True,
    doc="weight transform: row j = proj_weight_j * norm_weight_j in f32 (w . RMSNorm(v) = q . v/rms)")


# -- attn_res_phase1 -----------------------------------------------------------------------------------------------
def _phase1_roles(attrs):
    return tuple(Role(f"source.{i}") for i in range(_n(attrs, "num_sources"))) + (Role("queries"),)


def _check_phase1(attrs):
    for k in ("num_sources", "num_queries"):
        v = attrs.get(k)
        if v is not None and v < 1:
            raise TypeCheck(f"attn_res_phase1 needs {k} >= 1, got {v}")


def _infer_phase1(attrs, ins):
    n, q = _n(attrs, "num_sources"), _n(attrs, "num_queries")
    first, d = activation(ins, "source.0")
    for i in range(1, n):
        if ins[f"source.{i}"] != first:
            raise TypeCheck(f"source.{i}: expected {first} (as source.0), got {ins[f'source.{i}']}")
    expect(ins["queries"], "queries", (q, d), frozenset({"f32"}))
    require(isinstance(d, int), f"source.0: the hidden size must be static, got {first}")
    return (TensorType(first.dtype, (q,) + first.shape[:-1] + (STATS + d,)),)


ATTN_RES_PHASE1 = OpDef("attn_res_phase1", _phase1_roles, {
    "num_sources": AttrSpec("int", doc="N completed blocks b_0..b_{N-1}"),
    "num_queries": AttrSpec("int", doc="Q: the mixes of the block group, in program order"),
    "eps": AttrSpec("float", doc="rms(v) = sqrt(mean(v^2) + eps)"),
    "bytes": AttrSpec("int", required=False, doc="HBM bytes per token moved (annotation)"),
}, _infer_phase1, _check_phase1,
    doc="per query j: [lse_j, o_j] over the completed blocks, o = sum softmax(q_j . v_i / rms(v_i)) v_i")


# -- attn_res_phase2 -----------------------------------------------------------------------------------------------
MODES = ("none", "source", "update")


def _phase2_roles(attrs):
    mode = attrs.get("mode")
    roles = [Role("partials"), Role("queries")]
    if mode == "update":
        roles += [Role("partial"), Role("update")]
    elif mode == "source":
        roles += [Role("partial")]
    if attrs.get("normed"):
        roles.append(Role("weight", param=True))
    return tuple(roles)


def _check_phase2(attrs):
    q = attrs.get("query")
    if q is not None and q < 0:
        raise TypeCheck(f"attn_res_phase2 query must be >= 0, got {q}")
    if attrs.get("normed") and attrs.get("norm_eps") is None:
        raise TypeCheck("attn_res_phase2 with normed = true needs norm_eps")


def _infer_phase2(attrs, ins):
    s1, qs = ins["partials"], ins["queries"]
    require(s1.rank >= 2 and isinstance(s1.shape[-1], int) and s1.shape[-1] > STATS,
            f"partials: expected [Q, ..., {STATS} + hidden], got {s1}")
    d = s1.shape[-1] - STATS
    expect(qs, "queries", (None, d), frozenset({"f32"}))
    require(isinstance(qs.shape[0], int) and attrs.get("query", 0) < qs.shape[0],
            f"query {attrs.get('query')} is out of range for queries {qs}")
    require(s1.shape[0] == qs.shape[0], f"partials {s1} and queries {qs} disagree on the number of queries")
    out = TensorType(s1.dtype, s1.shape[1:-1] + (d,))
    mode = attrs.get("mode")
    if mode in ("update", "source"):
        expect(ins["partial"], "partial", out.shape, frozenset({out.dtype}))
    if mode == "update":
        expect(ins["update"], "update", out.shape, frozenset({out.dtype}))
    if attrs.get("normed"):
        expect(ins["weight"], "weight", (d,))
    if mode == "update":
        return (TensorType(out.dtype, (2,) + out.shape),)
    return (out,)


ATTN_RES_PHASE2 = OpDef("attn_res_phase2", _phase2_roles, {
    "query": AttrSpec("int", doc="row of the phase-1 result and of the queries"),
    "mode": AttrSpec("str", choices=MODES, doc="none: no partial sum (the mix of a block's first sublayer); "
                                               "source: the partial is an input; update: partial = partial + update"),
    "normed": AttrSpec("bool", doc="apply the next sublayer's RMSNorm (weight input) to the mix"),
    "eps": AttrSpec("float", doc="AttnRes key RMSNorm eps"),
    "norm_eps": AttrSpec("float", required=False, nullable=True, doc="eps of the fused RMSNorm"),
    "sublayer": AttrSpec("str", required=False, choices=("attn", "mlp", "out")),
    "bytes_naive": AttrSpec("int", required=False, doc="HBM bytes per token of the naive mix (+ add, norm)"),
    "bytes_split": AttrSpec("int", required=False, doc="HBM bytes per token of this op plus its share of phase 1"),
}, _infer_phase2, _check_phase2,
    doc="h = online-softmax merge of phase 1 with the partial sum, fused with the update and the next RMSNorm")


# -- attn_res_take -------------------------------------------------------------------------------------------------
def _infer_take(attrs, ins):
    x = ins["x"]
    require(x.rank >= 1 and isinstance(x.shape[0], int), f"x: expected [K, ...], got {x}")
    i = attrs.get("index", 0)
    require(0 <= i < x.shape[0], f"index {i} out of range for {x}")
    return (TensorType(x.dtype, x.shape[1:]),)


ATTN_RES_TAKE = OpDef("attn_res_take", lambda attrs: (Role("x"),), {"index": AttrSpec("int")}, _infer_take,
                      doc="x[index] along the leading dim (a view)")

OP_DEFS = (ATTN_RES_FOLD_QUERIES, ATTN_RES_PHASE1, ATTN_RES_PHASE2, ATTN_RES_TAKE)
