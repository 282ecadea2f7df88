"""Collective ops the `shard` pass introduces (docs/distributed.md). They run on torch.distributed process groups
named by `group`: "tp" (the ranks splitting attention heads and dense columns) or "ep" (the ranks splitting the
routed experts); `size` is that group's size, so the IR says how many ranks take part (a size of 1 is identity).

    all_reduce  y = sum over the group of x (every rank gets the sum): row-parallel partial sums (o_proj, the
                down projection of a column/row-split MLP, the routed-expert combine)
    all_gather  y = concat over the group of x along `dim` (rank order): vocab-parallel logits
Sequence parallel (residual stream and AttnRes blocks split by tokens over TP, docs/distributed.md):
    seq_scatter     this rank's tokens of a replicated tensor (after the embedding, after the routed MoE output)
    reduce_scatter  sum over the group, each rank keeping its tokens (instead of all_reduce after a row split)
    seq_gather      all ranks' tokens (before each layer op and lm_head)
"""
from __future__ import annotations

from .core import TensorType
from .opdef import AttrSpec, OpDef, TypeCheck, fixed_roles, require

GROUPS = ("tp", "ep")
COLLECTIVE_ATTRS = {
    "group": AttrSpec("str", choices=GROUPS, doc="process group: tp (tensor parallel) or ep (expert parallel)"),
    "size": AttrSpec("int", doc="ranks in the group"),
}


def _check_size(attrs):
    if attrs.get("size") is not None and attrs["size"] < 1:
        raise TypeCheck(f"attribute 'size' must be >= 1, got {attrs['size']}")


def _infer_all_reduce(attrs, ins):
    return (ins["x"],)


ALL_REDUCE = OpDef("all_reduce", fixed_roles("x"), COLLECTIVE_ATTRS, _infer_all_reduce, _check_size,
                   doc="sum of x over the ranks of `group` (same type out)")


def _infer_all_gather(attrs, ins):
    x = ins["x"]
    d = attrs["dim"]
    require(-x.rank <= d < x.rank, f"dim {d} is out of range for x {x}")
    d %= x.rank
    require(isinstance(x.shape[d], int), f"x: dim {d} must be a fixed size to gather, got {x}")
    shape = list(x.shape)
    shape[d] = shape[d] * attrs["size"]
    return (TensorType(x.dtype, tuple(shape)),)


ALL_GATHER = OpDef("all_gather", fixed_roles("x"), {**COLLECTIVE_ATTRS, "dim": AttrSpec("int", doc="concat dim")},
                   _infer_all_gather, _check_size,
                   doc="x of every rank of `group`, concatenated along `dim` in rank order")


# ---- sequence parallel (TP group): the residual stream and AttnRes blocks hold T / size tokens per rank ----------
# The sharded dim gets the symbol SP_DIM (type-level only: the runtime pads T up to a multiple of size and splits
# only when T >= size, e.g. not for single-token decode, where these ops fall back to identity / all_reduce).
SP_DIM = "T_sp"
_SEQ_ATTRS = {**COLLECTIVE_ATTRS, "dim": AttrSpec("int", doc="the token dim")}


def _with_dim(x, d: int, value):
    if not -x.rank <= d < x.rank:
        raise TypeCheck(f"dim {d} is out of range for x {x}")
    shape = list(x.shape)
    shape[d % x.rank] = value
    return TensorType(x.dtype, tuple(shape))


def _infer_seq_scatter(attrs, ins):
    return (_with_dim(ins["x"], attrs["dim"], SP_DIM),)


def _infer_seq_gather(attrs, ins):
    return (_with_dim(ins["x"], attrs["dim"], attrs["full"]),)


SEQ_SCATTER = OpDef("seq_scatter", fixed_roles("x"), _SEQ_ATTRS, _infer_seq_scatter, _check_size,
                    doc="this rank's block of tokens of a replicated x (a local slice, no communication)")
REDUCE_SCATTER = OpDef("reduce_scatter", fixed_roles("x"), _SEQ_ATTRS, _infer_seq_scatter, _check_size,
                       doc="sum over the group of x, each rank keeping its block of tokens")
SEQ_GATHER = OpDef("seq_gather", fixed_roles("x"), {**_SEQ_ATTRS, "full": AttrSpec("str", doc="the whole dim")},
                   _infer_seq_gather, _check_size,
                   doc="every rank's block of tokens, concatenated in rank order (all-gather along the token dim)")

OP_DEFS = (ALL_REDUCE, ALL_GATHER, SEQ_SCATTER, REDUCE_SCATTER, SEQ_GATHER)
