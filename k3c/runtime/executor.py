"""Lowered IR -> torch.fx GraphModule. Each IR op becomes one call of its implementation; weights are buffers
read with get_attr, so `gm.code` reads like the IR and fx tooling works on it.

The graph's signature is `forward(input_ids, cache)`: `cache` (LayerCaches) carries the per-layer KDA states and
MLA latent caches across calls; stateful ops read the entry for their `layer` attr and store the new one.

An op's implementation is `fn(attrs, cache, data inputs (tuple), params {role: tensor})`: for ops the `codegen`
pass marks impl="kernel", kernel_impls.KERNEL_IMPLS (the generated kernels); for every other op TORCH_IMPLS, this
module's LAYER_IMPLS (the layer ops and the shard pass's collectives, each a call into k3c.reference or
k3c.runtime.distributed) with kernel_impls.TORCH_IMPLS (the kernel families' ops).
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx

from ..errors import IRError
from ..frontend.spec import ActivationSpec, KDASpec, MLASpec, MoESpec
from ..ir import Module
from ..ir.mxfp4_weights import is_mxfp4
from ..ir.ops import bind, get_op_def
from .. import reference as ref
from . import distributed, kernel_impls, routing_replay
from .caches import kda_rollback
from .kernel_impls import mxfp4_linear
from .caches.context import CallContext
from .caches.packed import GroupedEntry, aligned, entry_rows
from .launcher import Binding


class LayerCaches:
    """Mutable per-layer cache: KDA layers hold a KDAState, MLA layers a paged latent cache (kernel_impls/mla.py)."""

    def __init__(self, num_layers: int, ctx: CallContext | None = None):
        self.layers: list[Any] = [None] * num_layers
        self.length = 0
        self.ctx = ctx if ctx is not None else CallContext()   # the call's context (caches/context.py)

    def copy(self) -> "LayerCaches":
        """The caches for the next call: the same entries, binding and cache format."""
        out = LayerCaches(len(self.layers), self.ctx.next_call())
        out.layers, out.length = list(self.layers), self.length   # entries are never mutated in place
        return out


# ---- the layer ops' torch path ---------------------------------------------------------------------------------
def torch_embedding(a, cache, data, w):
    return w["embed_tokens.weight"][data[0]]


def torch_rmsnorm(a, cache, data, w):
    return ref.rms_norm(data[0], w["weight"], a["eps"])


def torch_add(a, cache, data, w):
    return data[0] + data[1]


def torch_lm_head(a, cache, data, w):
    """Float weights: the reference linear; MXFP4 (weight_format "mxfp4"): kernel_impls.mxfp4_linear's form."""
    if is_mxfp4(a):
        return mxfp4_linear.torch_lm_head(a, cache, data, w)
    return ref.linear(data[0], w["embed_tokens.weight" if a["tied"] else "lm_head.weight"])


def torch_kda(a, cache, data, w):
    cfg = KDASpec.from_attrs(a)
    state = cache.layers[a["layer"]]
    x = data[0]
    if kda_rollback.traced(cache) and x.shape[1] > 1:      # a speculative verification: every token's state kept
        if state is None:
            state = ref.kda_zero_state(cfg, x.shape[0], x.dtype, x.device)
        y, state = kda_rollback.step_tokens(cache, a["layer"], data, state,
                                            lambda d, s, out: ref.kda_layer(d[0], w, cfg, a["norm_eps"], s))
    else:
        y, state = ref.kda_layer(x, w, cfg, a["norm_eps"], state)
    cache.layers[a["layer"]] = state
    return y


def torch_mla(a, cache, data, w):
    y, latent = ref.mla_layer(data[0], w, MLASpec.from_attrs(a), cache.layers[a["layer"]])
    cache.layers[a["layer"]] = latent
    return y


def torch_mlp(a, cache, data, w):
    """Float weights: the reference MLP; MXFP4 (weight_format "mxfp4"): kernel_impls.mxfp4_linear's form."""
    if is_mxfp4(a):
        return mxfp4_linear.torch_mlp(a, cache, data, w)
    return ref.mlp(data[0], w, ActivationSpec.from_attrs(a))


def _mxfp4_experts(w: dict) -> dict:
    """expert_format mxfp4: the packed stacks as lazily dequantized ones (only experts with tokens are expanded)."""
    from ..quant.packed import MXFP4Stack

    out = {k: v for k, v in w.items() if not k.startswith("experts.")}
    for s in ("w1", "w3", "w2"):
        out[f"experts.{s}"] = MXFP4Stack(w[f"experts.{s}.weight_packed"], w[f"experts.{s}.weight_scale"],
                                         name=f"experts.{s}")
    return out


def torch_moe(a, cache, data, w):
    """The layer-level moe op (graphs without moe-lower) through the reference MoE: MXFP4 dense linears
    (`mxfp4_linears`) dequantized first, MXFP4 expert stacks dequantized lazily; an active routing replay chooses
    the experts; with EP, this rank's experts and the routed combine all-reduced over the EP group."""
    x = data[0]
    roles = tuple(a.get("mxfp4_linears", ()) or ())
    if roles:
        w = mxfp4_linear.dequantized(w, roles, x.dtype)
    if a.get("expert_format", "bf16") == "mxfp4":
        w = _mxfp4_experts(w)
    cfg = MoESpec.from_attrs(a, w["experts.w1"].shape[1])
    act, choose = ActivationSpec.from_attrs(a), routing_replay.active_choice()
    ep_size, expert_tp = a.get("ep_size", 1), a.get("expert_tp", 1)
    if ep_size > 1:
        return ref.moe_layer_ep(x, w, cfg, act, a["norm_eps"], a["ep_rank"],
                                lambda u: distributed.all_reduce(u, "ep", ep_size), choose)
    if expert_tp > 1:       # every expert's slice here (rank "0" of one EP rank), the partial combine summed over TP
        return ref.moe_layer_ep(x, w, cfg, act, a["norm_eps"], 0,
                                lambda u: distributed.all_reduce(u, "tp", expert_tp), choose)
    return ref.moe_layer(x, w, cfg, act, a["norm_eps"], choose)


def torch_rmsnorm_residual(a, cache, data, w):
    s = data[0] + data[1]
    return s, ref.rms_norm(s, w["weight"], a["eps"])


def torch_attn_res_mix(a, cache, data, w):
    return ref.attn_res_mix(list(data), w["proj_weight"], w["norm_weight"], a["eps"])


# the shard pass's collectives (torch.distributed; identity without process groups)
def torch_all_reduce(a, cache, data, w):
    return distributed.all_reduce(data[0], a["group"], a["size"])


def torch_all_gather(a, cache, data, w):
    return distributed.all_gather(data[0], a["group"], a["size"], a["dim"])


def torch_seq_scatter(a, cache, data, w):
    return distributed.seq_scatter(data[0], a["group"], a["size"], a["dim"])


def torch_reduce_scatter(a, cache, data, w):
    return distributed.reduce_scatter(data[0], a["group"], a["size"], a["dim"])


def torch_seq_gather(a, cache, data, w):
    return distributed.seq_gather(data[0], a["group"], a["size"], a["dim"])


LAYER_IMPLS: dict[str, Callable] = {
    "embedding": torch_embedding, "rmsnorm": torch_rmsnorm, "add": torch_add, "lm_head": torch_lm_head,
    "kda": torch_kda, "mla": torch_mla, "mlp": torch_mlp, "moe": torch_moe, "attn_res_mix": torch_attn_res_mix,
    "rmsnorm_residual": torch_rmsnorm_residual,
    "all_reduce": torch_all_reduce, "all_gather": torch_all_gather, "seq_scatter": torch_seq_scatter,
    "reduce_scatter": torch_reduce_scatter, "seq_gather": torch_seq_gather,
}


def _torch_impls() -> dict[str, Callable]:
    clash = sorted(LAYER_IMPLS.keys() & kernel_impls.TORCH_IMPLS.keys())
    if clash:
        raise ValueError(f"ops with a torch implementation both in the executor and in kernel_impls: {clash}")
    return {**LAYER_IMPLS, **kernel_impls.TORCH_IMPLS}


TORCH_IMPLS: dict[str, Callable] = _torch_impls()


# ---- graph construction ---------------------------------------------------------------------------------------
def _buffer_name(weight: str) -> str:
    return "w_" + re.sub(r"[^0-9A-Za-z_]", "_", weight)


def _implementation(op, use_kernels: bool) -> Callable:
    """impl="kernel" ops launch generated kernels (when `use_kernels`); everything else runs through torch."""
    if use_kernels and op.attr("impl", None) == "kernel":
        fn = kernel_impls.KERNEL_IMPLS.get(op.op)
        if fn is None:
            raise IRError("marked impl=kernel but kernel_impls has no kernel implementation of it", op=op.describe(),
                          loc=op.loc)
        return fn
    fn = TORCH_IMPLS.get(op.op)
    if fn is None:
        raise IRError("no runtime implementation for this op", op=op.describe(), loc=op.loc)
    return fn


def _last_rows_when_asked(impl: Callable) -> Callable:
    """An lm_head implementation that projects only each row's last position when the call's context says so
    (CallContext.last_logits_only): a prefill of n tokens needs one row of logits, not n ([n, vocab] is most of a
    long prefill's activation memory). In a packed call the rows' last positions: logits [1, rows, V]."""
    def lm_head(a, cache, data, w):
        x = data[0]
        if cache is not None and cache.ctx.last_logits_only and x.dim() == 3 and x.shape[1] > 1:
            if cache.ctx.groups:
                # made on the device: a host tensor's copy would wait for the launched layers (no overlap)
                last = torch.cat([torch.arange(g.token + g.length - 1, g.token + g.tokens, g.length, device=x.device)
                                  for g in cache.ctx.groups])
                data = (x[:, last],) + tuple(data[1:])
            else:
                data = (x[:, -1:].contiguous(),) + tuple(data[1:])
        return impl(a, cache, data, w)
    return lm_head


def _per_segment_group(impl: Callable) -> Callable:
    """An implementation of an op with per-sequence state (OpDef.sequence_state) that, in a packed call, runs once
    per group of equal segment lengths on [rows, length] views of the packed tokens and its rows of the layer's
    cache entry, with the group's MLA modes; the layer's entry becomes a GroupedEntry (caches/packed.py)."""
    def op(a, cache, data, w):
        groups = None if cache is None else cache.ctx.groups
        if not groups:
            return impl(a, cache, data, w)
        layer = a["layer"]
        entry = cache.layers[layer]
        outs, parts = [], []
        for g in groups:
            sub = LayerCaches(len(cache.layers), dataclasses.replace(cache.ctx, groups=None, mla_modes=g.mla_modes))
            sub.layers[layer] = entry_rows(entry, g.row, g.row + g.rows)
            rows = tuple(aligned(x[0, g.token:g.token + g.tokens].unflatten(0, (g.rows, g.length))) for x in data)
            outs.append(impl(a, sub, rows, w).flatten(0, 1))
            parts.append(sub.layers[layer])
            if layer in cache.ctx.modes:                    # an MLA op: what this group ran (modes is shared)
                cache.ctx.group_modes.append((layer, cache.ctx.modes[layer]))
        cache.layers[layer] = GroupedEntry(tuple(parts), groups)
        return torch.cat(outs)[None]
    return op


def _inputs(op, value_of: Callable) -> tuple[tuple, dict]:
    """`op`'s inputs as an implementation takes them: (data values in role order, {param role: value})."""
    params = {r.name for r in get_op_def(op.op).roles(op.attr_dict) if r.param}
    bound = bind(op)
    return (tuple(value_of(v) for r, v in bound.items() if r not in params),
            {r: value_of(v) for r, v in bound.items() if r in params})


def _is_weight_transform(op) -> bool:
    opdef = get_op_def(op.op)
    return opdef is not None and opdef.weight_transform


def build_graph_module(module: Module, weights: dict[str, torch.Tensor], *, use_kernels: bool = True,
                       wrap: Callable | None = None, binding: Binding | None = None) -> fx.GraphModule:
    """An fx GraphModule computing `module` with `weights` (canonical names) as buffers. With `use_kernels`,
    ops the codegen pass marked impl="kernel" launch their generated Triton kernels (the interpreter on a CPU).
    `wrap(op, fn) -> fn'` may replace each op's implementation (k3c.runtime.opcheck uses it). The module's
    `binding` is the Binding its kernels launch through (session.bind_kernels; None: nothing bound): the graph
    holds it for its owner, whose calls pass it in their CallContext."""
    root = torch.nn.Module()
    graph = fx.Graph()
    values: dict[str, fx.Node] = {}
    folded: dict[str, torch.Tensor] = {}         # values that depend on weights only
    ids = graph.placeholder("input_ids")
    cache = graph.placeholder("cache")
    for op in module.ops:
        a = dict(op.attrs)
        if op.op == "input":
            values[op.results[0]] = ids
            continue
        if op.op == "param":
            name = a["name"]
            if name not in weights:
                raise IRError(f"weight '{name}' is not in the given weights", op=f"%{op.results[0]} = param",
                              loc=op.loc)
            buf = _buffer_name(name)
            if not hasattr(root, buf):
                root.register_buffer(buf, weights[name], persistent=False)
            values[op.results[0]] = graph.get_attr(buf)
            folded[op.results[0]] = weights[name]
            continue
        impl = _implementation(op, use_kernels)
        if op.op == "lm_head":
            impl = _last_rows_when_asked(impl)
        if get_op_def(op.op).sequence_state:
            impl = _per_segment_group(impl)
        if _is_weight_transform(op) and all(v in folded for v in op.inputs):
            # evaluated once here, when the weights load, and held as buffers: no per-call cost
            fdata, fparams = _inputs(op, folded.__getitem__)
            with torch.no_grad():
                out = impl(a, None, fdata, fparams)
            outs = out if len(op.results) > 1 else (out,)
            for result, t in zip(op.results, outs):
                buf = _buffer_name("derived." + result)
                root.register_buffer(buf, t, persistent=False)
                folded[result] = t
                values[result] = graph.get_attr(buf)
            continue
        if wrap is not None:
            impl = wrap(op, impl)
        data, params = _inputs(op, values.__getitem__)
        names = [re.sub(r"[^0-9A-Za-z_]", "_", r) for r in op.results]     # fx names follow the IR
        node = graph.create_node("call_function", impl, (a, cache, data, params),
                                 name=names[0] if len(names) == 1 else "_".join(names))
        if len(op.results) == 1:
            values[op.results[0]] = node
        else:
            for i, (result, name) in enumerate(zip(op.results, names)):
                values[result] = graph.create_node("call_function", operator.getitem, (node, i), name=name + "_")
    graph.output(tuple(values[o] for o in module.outputs) if len(module.outputs) > 1 else values[module.outputs[0]])
    # params only weight transforms read (kv_b_proj before its split, the AttnRes queries before their fold) were
    # consumed at load: no call reads them, so the graph does not keep them (what the planner counts as freed)
    for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
        graph.erase_node(node)
        delattr(root, node.target)
    gm = fx.GraphModule(root, graph, class_name="K3cGraph")
    gm.binding = binding
    return gm


def graph_binding(graph) -> Binding | None:
    """The Binding a graph of build_graph_module launches through (None: nothing bound, or a stand-in callable
    that is no such graph: a test's)."""
    return graph.binding if isinstance(graph, fx.GraphModule) else None
