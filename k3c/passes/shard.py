"""shard: one rank's slice of the layer IR for tensor parallel (TP) x expert parallel (EP) execution
(docs/distributed.md). Runs first, on the layer ops, so every lowering pass works on already-smaller ops.

Options come from module attrs `tp`, `ep`, `rank` (k3c.compile(..., tp=, ep=, rank=) sets them); absent = 1, 1, 0.
Layout: world = max(tp, ep) ranks, one of tp, ep divides the other; tp_rank = rank % tp, ep_rank = rank % ep; the
TP group of a rank is its block of tp consecutive ranks, its EP group its block of ep consecutive ranks.

    kda   heads split: q/k/v/f_b/g(_b) rows, convs, b_proj, A_log, dt_bias by head; o_proj columns (row parallel);
          f_a / g_a (low rank) and o_norm (per head_dim) replicated   -> partial sum -> all_reduce (reduce_scatter) tp
    mla   heads split: q_b_proj, kv_b_proj, g_proj rows by head, o_proj columns; q_a, the latent projection
          kv_a_proj_with_mqa, its norm and so the latent cache replicated, as deployments do -> all_reduce tp
    mlp   gate/up rows, down columns                                          -> all_reduce tp
    moe   routed experts split over EP (experts.* hold [ep_rank E/ep, (ep_rank+1) E/ep), attrs ep_rank/ep_size);
          with EP 1 and TP > 1 (AMD's MI355X TP8 layout) every expert is split over TP instead: w1 / w3 rows and
          w2 columns of the intermediate dim (attr expert_tp), so each rank holds 1/tp of every expert. Router,
          latent down/norm/up replicated; the op all-reduces its routed combine (over EP, or over TP for split
          experts) before the latent norm. Shared experts (tp > 1) leave the op as an `mlp` split like the dense
          MLP -> all_reduce tp, added to the routed output. (TP > EP > 1 keeps whole experts, replicated over the
          TP / EP ranks that share an ep_rank.)
    lm_head (untied, vocab divisible by tp) vocab rows split                 -> all_gather tp (last dim)
Embeddings, norms and AttnRes weights stay replicated. Sequence parallel (tp > 1, module attr `seq_parallel`
not false): the embedding output is `seq_scatter`ed, so the residual stream, norms and AttnRes blocks hold T/tp
tokens per rank (dim `T_sp`); each layer op's input is `seq_gather`ed and its partial sum `reduce_scatter`ed in
place of the all_reduce; the replicated routed-MoE output is `seq_scatter`ed; lm_head gathers its input.
Every split param carries the local shape and `shard = "<group>:<dim>:<rank>/<size>"`; split layer ops carry
`shard = "tp:heads"` etc. Counts: `kda`, `mla`, `mlp`, `moe`, `shared_experts`, `lm_head`, `params`, and
`<collective>.<group>` per collective inserted.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArgumentError
from ..ir.builder import Builder
from ..ir.core import Module, Op
from ..ir.ops import bind, get_op_def
from .registry import PassContext, register_pass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def group_ranks(self, group: str) -> list[int]:
        size = self.tp if group == "tp" else self.ep
        start = self.rank - self.rank % size
        return list(range(start, start + size))


def make_layout(tp=1, ep=1, rank=0) -> Layout:
    """A checked Layout; ArgumentError naming --tp / --ep / rank otherwise."""
    for name, v in (("--tp", tp), ("--ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name} must be an integer >= 1, got {v!r}")
    if max(tp, ep) % min(tp, ep):
        raise ArgumentError(f"--tp {tp} and --ep {ep}: one must divide the other (the ranks are max(tp, ep); "
                            "EP groups and TP groups are blocks of consecutive ranks)")
    world = max(tp, ep)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ArgumentError(f"rank must be in [0, {world}) for --tp {tp} --ep {ep}, got {rank!r}")
    return Layout(tp, ep, rank)


def module_layout(module: Module) -> Layout:
    a = module.attr_dict
    return make_layout(a.get("tp", 1), a.get("ep", 1), a.get("rank", 0))


def check_divisible(module: Module, layout: Layout) -> None:
    """Every split count divides: ArgumentError naming --tp / --ep and the op otherwise."""
    tp, ep = layout.tp, layout.ep
    for op in module.ops:
        where = f"layer {op.attr('layer', '?')}"
        if op.op in ("kda", "mla") and op.attr("num_heads") % tp:
            raise ArgumentError(f"--tp {tp}: {op.op.upper()} num_heads {op.attr('num_heads')} ({where}) is not "
                                f"divisible by {tp}")
        if op.op == "moe" and op.attr("num_experts") % ep:
            raise ArgumentError(f"--ep {ep}: num_experts {op.attr('num_experts')} ({where}) is not divisible by {ep}")
        if op.op == "moe" and _split_experts(layout):
            inter = module.type_of(bind(op)["experts.w1"]).shape[1]
            if inter % tp:
                raise ArgumentError(f"--tp {tp} --ep 1: the routed experts' intermediate size {inter} ({where}) is "
                                    f"not divisible by {tp} (each expert is split over the TP ranks)")
        if op.op in ("mlp", "moe") and tp > 1:
            roles = bind(op)
            gate = roles.get("gate_proj.weight", roles.get("shared_experts.gate_proj.weight"))
            if gate is not None and module.type_of(gate).shape[0] % tp:
                what = "dense MLP" if op.op == "mlp" else "shared-expert"
                raise ArgumentError(f"--tp {tp}: {what} width {module.type_of(gate).shape[0]} ({where}) is not "
                                    f"divisible by {tp}")


def _split_experts(layout: Layout) -> bool:
    """EP 1 with TP > 1: every routed expert's matrices are split over the TP ranks (else whole experts per EP rank)."""
    return layout.ep == 1 and layout.tp > 1


def shard_attr(group: str, dim: int, rank: int, size: int) -> str:
    return f"{group}:{dim}:{rank}/{size}"


def parse_shard(text: str) -> tuple[str, int, int, int] | None:
    """'tp:0:1/2' -> ('tp', 0, 1, 2); None for an op annotation ('tp:heads') or anything else."""
    try:
        group, dim, part = text.split(":")
        rank, size = part.split("/")
        return group, int(dim), int(rank), int(size)
    except (ValueError, AttributeError):
        return None


# role suffix -> split dim, per layer op ("rep" = replicated: absent)
_KDA = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0,
        "v_conv1d.weight": 0, "f_b_proj.weight": 0, "b_proj.weight": 0, "g_proj.weight": 0, "g_b_proj.weight": 0,
        "A_log": 0, "dt_bias": 0, "o_proj.weight": 1}
_MLA = {"q_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0, "g_proj.weight": 0, "o_proj.weight": 1}
_MLP = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}
_SHARED = tuple(f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down"))


@register_pass("shard")
def shard(module: Module, ctx: PassContext) -> Module:
    """Split heads / columns over TP and experts over EP for one rank; collectives where partial sums meet."""
    lay = module_layout(module)
    if lay.world == 1:
        return module
    check_divisible(module, lay)
    splits, vocab_split = _plan_splits(module, lay)
    rank = _RankSlice(module, ctx, lay, splits, vocab_split)
    for op in ctx.walk(module.ops):     # results keep their names: the collective takes the op's old name
        rank.rewrite(op)
    return rank.b.build(module.outputs)


def _plan_splits(module: Module, lay: Layout) -> tuple[dict[str, tuple[str, int]], bool]:
    """Which params this rank holds a slice of: param value -> (group, dim); and whether lm_head's vocab splits."""
    tp, ep = lay.tp, lay.ep
    splits: dict[str, tuple[str, int]] = {}

    def split(value: str, group: str, dim: int) -> None:
        if (group == "tp" and tp == 1) or (group == "ep" and ep == 1):
            return
        prev = splits.setdefault(value, (group, dim))
        if prev != (group, dim):
            raise ArgumentError(f"weight '{module.defs[value].attr('name')}' would be split two ways ({prev} and "
                                f"{(group, dim)})")

    vocab_split = False
    for op in module.ops:
        w = bind(op) if get_op_def(op.op) is not None and op.op != "param" else {}
        table = {"kda": _KDA, "mla": _MLA, "mlp": _MLP}.get(op.op)
        if table is not None:
            for role, dim in table.items():
                if role in w:
                    split(w[role], "tp", dim)
        elif op.op == "moe":
            # whole experts over EP, or (EP 1) each expert's intermediate dim over TP: w1 / w3 [E, I, D], w2 [E, D, I]
            dims = (("tp", 1), ("tp", 1), ("tp", 2)) if _split_experts(lay) else (("ep", 0),) * 3
            for role, (group, dim) in zip(("experts.w1", "experts.w3", "experts.w2"), dims):
                split(w[role], group, dim)
            if op.attr("num_shared_experts") > 0:
                for role, dim in zip(_SHARED, (0, 0, 1)):
                    split(w[role], "tp", dim)
        elif op.op == "lm_head" and not op.attr("tied") and tp > 1:
            wv = w["lm_head.weight"]
            if module.type_of(wv).shape[0] % tp == 0:
                split(wv, "tp", 0)
                vocab_split = True
    return splits, vocab_split


class _RankSlice:
    """The rewrite of one module into rank `lay.rank`'s slice: split params, split layer ops and the collectives
    that join their partial sums; under sequence parallel, the token scatter / gather around the layer ops."""

    def __init__(self, module: Module, ctx: PassContext, lay: Layout, splits: dict[str, tuple[str, int]],
                 vocab_split: bool):
        self.module, self.ctx, self.lay = module, ctx, lay
        self.splits, self.vocab_split = splits, vocab_split
        self.tp, self.ep = lay.tp, lay.ep
        self.b = Builder.like(module)
        # sequence parallel: the residual stream, AttnRes blocks and norms hold T/tp tokens per rank
        self.sp = lay.tp > 1 and module.attr_dict.get("seq_parallel", True) is not False
        self.gathered: dict[str, str] = {}          # local activation -> its seq_gather

    # ---- building blocks ------------------------------------------------------------------------------------
    def collective(self, kind: str, src: str, group: str, loc: str, name: str | None = None, **extra) -> str:
        size = self.tp if group == "tp" else self.ep
        self.ctx.count(f"{kind}.{group}")
        return self.b.op(kind, [src], {"group": group, "size": size, **extra}, loc, name=name, prefix="tp")

    def full(self, x: str, loc: str) -> str:
        """x with every token (a layer op's input)."""
        if not self.sp:
            return x
        if x not in self.gathered:
            self.gathered[x] = self.collective("seq_gather", x, "tp", loc, dim=1,
                                               full=str(self.module.type_of(x).shape[1]))
        return self.gathered[x]

    def combine(self, part: str, loc: str, name: str | None) -> str:
        """A TP partial sum -> the sum (all_reduce), or this rank's tokens of it (reduce_scatter)."""
        return self.collective("reduce_scatter", part, "tp", loc, name, dim=1) if self.sp else \
            self.collective("all_reduce", part, "tp", loc, name)

    def emit(self, opname: str, ins, attrs, loc, results) -> None:
        self.b.append(self.b.make(opname, ins, attrs, loc, results=results))

    # ---- per op -----------------------------------------------------------------------------------------------
    def rewrite(self, op: Op) -> None:
        tp, sp = self.tp, self.sp
        if op.op == "param" and op.results[0] in self.splits:
            self.param_slice(op)
        elif op.op in ("kda", "mla") and tp > 1:
            self.split_layer(op, {"num_heads": op.attr("num_heads") // tp, "shard": "tp:heads"})
        elif op.op == "mlp" and tp > 1:
            self.split_layer(op, {"shard": "tp:columns"})
        elif op.op == "moe":
            self.moe(op)
        elif op.op == "lm_head" and (self.vocab_split or sp):
            self.lm_head(op)
        elif op.op == "embedding" and sp:
            emb = self.b.fresh("tp")
            self.emit("embedding", op.inputs, op.attr_dict, op.loc, (emb,))
            self.collective("seq_scatter", emb, "tp", op.loc, op.results[0], dim=1)
        elif sp and get_op_def(op.op) is not None and get_op_def(op.op).infer is not None and op.op != "param":
            # per-token op on this rank's tokens: types re-inferred
            self.emit(op.op, op.inputs, op.attr_dict, op.loc, op.results)
        else:
            self.b.append(op)

    def param_slice(self, op: Op) -> None:
        group, dim = self.splits[op.results[0]]
        size, r = (self.tp, self.lay.tp_rank) if group == "tp" else (self.ep, self.lay.ep_rank)
        ty = op.types[0]
        shape = list(ty.shape)
        shape[dim] //= size
        self.b.append(op.replace(types=(ty.with_shape(shape),)).with_attrs(shard=shard_attr(group, dim, r, size)))
        self.ctx.count("params")

    def split_layer(self, op: Op, changes: dict) -> None:
        """A kda / mla / mlp op on this rank's heads or columns, its partial sum combined over TP."""
        part = self.b.fresh("tp")
        ins = list(op.inputs)
        self.emit(op.op, [self.full(ins[0], op.loc)] + ins[1:], {**op.attr_dict, **changes}, op.loc, (part,))
        self.combine(part, op.loc, op.results[0])
        self.ctx.count(op.op)

    def moe(self, op: Op) -> None:
        """Routed experts over EP (EP 1: every expert split over TP); the shared experts (tp > 1) as a column/row-split
        mlp added to the routed sum."""
        a, loc, res = op.attr_dict, op.loc, op.results[0]
        tp, ep, sp = self.tp, self.ep, self.sp
        w = bind(op)
        x = w["x"]
        # every token of the TP group: whole experts (EP) or every expert's slice (split experts) see all of them
        w["x"] = self.full(x, loc)
        attrs = {**a}
        if ep > 1:
            attrs.update(ep_rank=self.lay.ep_rank, ep_size=ep, shard="ep:experts")
        elif _split_experts(self.lay):
            attrs.update(expert_tp=tp, shard="tp:expert_columns")
            self.ctx.count("split_experts")
        shared = a["num_shared_experts"] > 0 and tp > 1
        if shared:
            attrs["num_shared_experts"] = 0
        moe_ins = [w[r.name] for r in get_op_def("moe").roles(attrs)]
        routed = res if not (shared or sp) else self.b.fresh("ep")
        self.emit("moe", moe_ins, attrs, loc, (routed,))
        if sp:          # the routed output is replicated over TP: keep this rank's tokens
            routed = self.collective("seq_scatter", routed, "tp", loc, None if shared else res, dim=1)
        if shared:
            act = {k: a[k] for k in ("activation", "situ_beta_gate", "situ_beta_up") if k in a}
            part = self.b.op("mlp", [self.full(x, loc)] + [w[r] for r in _SHARED],
                             {"layer": a["layer"], **act, "shard": "tp:columns"}, loc, prefix="tp")
            total = self.combine(part, loc, None)
            # routed + shared, the reference's order
            self.b.op("add", [routed, total], {"layer": a["layer"]}, loc, name=res)
            self.ctx.count("shared_experts")
        self.ctx.count("moe")

    def lm_head(self, op: Op) -> None:
        """Under sequence parallel on every token; vocab-split rows gathered along the last dim."""
        ins, a, res = list(op.inputs), op.attr_dict, op.results[0]
        x = self.full(ins[0], op.loc)
        if self.vocab_split:
            part = self.b.fresh("tp")
            self.emit("lm_head", [x] + ins[1:], {**a, "shard": "tp:vocab"}, op.loc, (part,))
            self.collective("all_gather", part, "tp", op.loc, res, dim=-1)
            self.ctx.count("lm_head")
        else:
            self.emit("lm_head", [x] + ins[1:], a, op.loc, (res,))
