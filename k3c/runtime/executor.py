"""Lowered IR -> torch.fx GraphModule. Each IR op becomes one call of its implementation; weights are buffers
read with get_attr, so `gm.code` reads like the IR and fx tooling works on it.

The graph's signature is `forward(input_ids, cache)`: `cache` (LayerCaches) carries the per-layer KDA states and
MLA latent caches across calls; stateful ops read the entry for their `layer` attr and store the new one.
Op implementations are the eager reference for layer ops until the kernel issues register Triton launchers
(`register_impl(op_name, fn)` replaces one).
"""
from __future__ import annotations

import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx

from ..errors import IRError
from ..frontend.spec import ActivationSpec, KDASpec, MLASpec, MoESpec
from ..ir import Module
from ..ir.ops import get_op_def
from .. import reference as ref


class LayerCaches:
    """Mutable per-layer cache: KDA layers hold a KDAState, MLA layers a latent cache [B, T, L+R]."""

    def __init__(self, num_layers: int):
        self.layers: list[Any] = [None] * num_layers
        self.length = 0
        self.modes: dict[int, str] = {}        # MLA layer -> the mode ("mha" | "mqa") its last call ran

    def copy(self) -> "LayerCaches":
        out = LayerCaches(len(self.layers))
        out.layers, out.length = list(self.layers), self.length   # entries are never mutated in place
        return out


# ---- op implementations: fn(attrs, cache, data inputs (tuple), params {role: tensor}) ------------------------------------------------------------
def _activation(a: dict) -> ActivationSpec:
    if a["activation"] == "situ":
        return ActivationSpec("situ", a["situ_beta_gate"], a["situ_beta_up"])
    return ActivationSpec(a["activation"])


def k3c_embedding(a, cache, data, w):
    return w["embed_tokens.weight"][data[0]]


def k3c_rmsnorm(a, cache, data, w):
    return ref.rms_norm(data[0], w["weight"], a["eps"])


def k3c_add(a, cache, data, w):
    return data[0] + data[1]


def k3c_lm_head(a, cache, data, w):
    return ref.linear(data[0], w["embed_tokens.weight" if a["tied"] else "lm_head.weight"])


def k3c_kda(a, cache, data, w):
    x = data[0]
    cfg = KDASpec(num_heads=a["num_heads"], head_dim=a["head_dim"], conv_kernel=a["conv_kernel"], gate=a["gate"],
                  gate_lower_bound=a["gate_lower_bound"], output_gate=a["output_gate"])
    y, state = ref.kda_layer(x, w, cfg, a["norm_eps"], cache.layers[a["layer"]])
    cache.layers[a["layer"]] = state
    return y


def k3c_mla(a, cache, data, w):
    x = data[0]
    cfg = MLASpec(num_heads=a["num_heads"], kv_lora_rank=a["kv_lora_rank"], qk_nope_head_dim=a["qk_nope_head_dim"],
                  qk_rope_head_dim=a["qk_rope_head_dim"], v_head_dim=a["v_head_dim"], q_lora_rank=a["q_lora_rank"],
                  rope=a["rope"], output_gate=a["output_gate"])
    y, latent = ref.mla_layer(x, w, cfg, cache.layers[a["layer"]])
    cache.layers[a["layer"]] = latent
    return y


def k3c_mlp(a, cache, data, w):
    return ref.mlp(data[0], w, _activation(a))


def _mxfp4_experts(w: dict) -> dict:
    """expert_format mxfp4: the packed stacks as lazily dequantized ones (only experts with tokens are expanded)."""
    from ..quant.packed import MXFP4Stack

    out = {k: v for k, v in w.items() if not k.startswith("experts.")}
    for s in ("w1", "w3", "w2"):
        out[f"experts.{s}"] = MXFP4Stack(w[f"experts.{s}.weight_packed"], w[f"experts.{s}.weight_scale"],
                                         name=f"experts.{s}")
    return out


def k3c_moe(a, cache, data, w):
    x = data[0]
    if a.get("expert_format", "bf16") == "mxfp4":
        w = _mxfp4_experts(w)
    cfg = MoESpec(num_experts=a["num_experts"], top_k=a["top_k"], expert_intermediate_size=w["experts.w1"].shape[1],
                  num_shared_experts=a["num_shared_experts"], latent_dim=a["latent_dim"],
                  latent_norm=a["latent_norm"], router_activation=a["router_activation"],
                  router_bias=a["router_bias"], renormalize=a["renormalize"],
                  routed_scaling_factor=a["routed_scaling_factor"])
    if a.get("ep_size", 1) > 1:     # this rank's experts only; the routed combine is all-reduced over EP
        from .distributed import moe_layer_ep

        return moe_layer_ep(x, w, cfg, _activation(a), a["norm_eps"], a["ep_rank"], a["ep_size"])
    return ref.moe_layer(x, w, cfg, _activation(a), a["norm_eps"])


def k3c_rmsnorm_residual(a, cache, data, w):
    s = data[0] + data[1]
    return s, ref.rms_norm(s, w["weight"], a["eps"])


def k3c_attn_res_mix(a, cache, data, w):
    return ref.attn_res_mix(list(data), w["proj_weight"], w["norm_weight"], a["eps"])


IMPLS: dict[str, Callable] = {
    "embedding": k3c_embedding, "rmsnorm": k3c_rmsnorm, "add": k3c_add, "lm_head": k3c_lm_head, "kda": k3c_kda,
    "mla": k3c_mla, "mlp": k3c_mlp, "moe": k3c_moe, "attn_res_mix": k3c_attn_res_mix,
    "rmsnorm_residual": k3c_rmsnorm_residual,
}


def k3c_all_reduce(a, cache, data, w):
    from .distributed import all_reduce

    return all_reduce(data[0], a["group"], a["size"])


def k3c_all_gather(a, cache, data, w):
    from .distributed import all_gather

    return all_gather(data[0], a["group"], a["size"], a["dim"])


def _seq_impl(name: str) -> Callable:
    def impl(a, cache, data, w):
        from . import distributed

        return getattr(distributed, name)(data[0], a["group"], a["size"], a["dim"])
    impl.__name__ = f"k3c_{name}"
    return impl


IMPLS.update({"all_reduce": k3c_all_reduce, "all_gather": k3c_all_gather,     # torch.distributed (shard pass)
              **{n: _seq_impl(n) for n in ("seq_scatter", "reduce_scatter", "seq_gather")}})


def register_impl(op_name: str, fn: Callable) -> None:
    """Make `fn(attrs, cache, data, params)` the implementation of `op_name` in graphs built from now on."""
    IMPLS[op_name] = fn


# ---- graph construction ---------------------------------------------------------------------------------------
def _buffer_name(weight: str) -> str:
    return "w_" + re.sub(r"[^0-9A-Za-z_]", "_", weight)


def _implementation(op, use_kernels: bool) -> Callable:
    """impl="kernel" ops launch generated kernels (when `use_kernels`); everything else runs through torch."""
    if use_kernels and op.attr("impl", None) == "kernel":
        from .kernel_impls import KERNEL_IMPLS

        fn = KERNEL_IMPLS.get(op.op)
        if fn is None:
            raise IRError("marked impl=kernel but no kernel implementation is registered", op=op.describe(),
                          loc=op.loc)
        return fn
    fn = IMPLS.get(op.op)
    if fn is None:
        raise IRError("no runtime implementation for this op", op=op.describe(), loc=op.loc)
    return fn


def _is_weight_transform(op) -> bool:
    return bool(getattr(get_op_def(op.op), "weight_transform", False))


def build_graph_module(module: Module, weights: dict[str, torch.Tensor], *, use_kernels: bool = True,
                       wrap: Callable | None = None) -> fx.GraphModule:
    """An fx GraphModule computing `module` with `weights` (canonical names) as buffers. With `use_kernels`,
    ops the codegen pass marked impl="kernel" launch their generated Triton kernels (the interpreter on a CPU).
    `wrap(op, fn) -> fn'` may replace each op's implementation (k3c.runtime.opcheck uses it)."""
    from . import kernel_impls  # noqa: F401  (registers every family's kernel and reference implementations)

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
        if _is_weight_transform(op) and all(v in folded for v in op.inputs):
            # evaluated once here, when the weights load, and held as buffers: no per-call cost
            roles = get_op_def(op.op).roles(a)
            fdata = tuple(folded[v] for r, v in zip(roles, op.inputs) if not r.param)
            fparams = {r.name: folded[v] for r, v in zip(roles, op.inputs) if r.param}
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
        roles = get_op_def(op.op).roles(a)
        data, params = [], {}
        for role, value in zip(roles, op.inputs):
            if role.param:
                params[role.name] = values[value]
            else:
                data.append(values[value])
        names = [re.sub(r"[^0-9A-Za-z_]", "_", r) for r in op.results]     # fx names follow the IR
        node = graph.create_node("call_function", impl, (a, cache, tuple(data), params),
                                 name=names[0] if len(names) == 1 else "_".join(names))
        if len(op.results) == 1:
            values[op.results[0]] = node
        else:
            for i, (result, name) in enumerate(zip(op.results, names)):
                values[result] = graph.create_node("call_function", operator.getitem, (node, i), name=name + "_")
    graph.output(tuple(values[o] for o in module.outputs) if len(module.outputs) > 1 else values[module.outputs[0]])
    return fx.GraphModule(root, graph, class_name=f"K3cGraph")
