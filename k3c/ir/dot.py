"""Graphviz DOT text of a module, built from its networkx graph (graph.py).

The DOT is written here rather than through pydot/pygraphviz (not dependencies of k3c); every label and id is
quoted and escaped, so names and locs cannot break the syntax.
"""
from __future__ import annotations

import networkx as nx

from .core import Module
from .graph import to_networkx

__all__ = ["to_dot"]

_SHAPES = {"param": "note", "input": "invhouse"}
_LAYER_COLORS = {"kda": "lightblue", "mla": "lightsalmon", "moe": "palegreen", "mlp": "palegreen",
                 "attn_res_mix": "khaki"}


def _q(text: str) -> str:
    """A DOT double-quoted string; newlines become DOT line breaks (\\n)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "").replace("\n", "\\n") + '"'


def _label(op) -> str:
    head = ", ".join("%" + r for r in op.results) + f" = {op.op}" if op.results else op.op
    lines = [head]
    if op.op in ("param", "input"):
        lines.append(str(op.attr("name", "")))
    elif op.has_attr("layer"):
        lines.append(f"layer {op.attr('layer')}")
    lines.append(", ".join(map(str, op.types)))
    return "\n".join(lines)


def graph_to_dot(g: nx.DiGraph, name: str) -> str:
    out = [f"digraph {_q(name)} {{", "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=10];']
    for i, data in g.nodes(data=True):
        op = data["op"]
        attrs = [f"label={_q(_label(op))}", f"shape={_SHAPES.get(op.op, 'box')}"]
        if op.op in _LAYER_COLORS:
            attrs.append(f"style=filled, fillcolor={_LAYER_COLORS[op.op]}")
        if op.loc:
            attrs.append(f"tooltip={_q(op.loc)}")
        out.append(f"  n{i} [{', '.join(attrs)}];")
    for u, v, data in g.edges(data=True):
        out.append(f"  n{u} -> n{v} [tooltip={_q(', '.join('%' + x for x in data['values']))}];")
    if g.graph.get("outputs"):
        out.append('  "return" [shape=house];')
        for i in dict.fromkeys(g.graph["outputs"]):
            out.append(f'  n{i} -> "return";')
    out.append("}")
    return "\n".join(out) + "\n"


def to_dot(module: Module, *, include_params: bool = True) -> str:
    """DOT text; `include_params=False` drops the weight nodes (kimi-k3 has ~2700)."""
    return graph_to_dot(to_networkx(module, include_params=include_params), module.name)
