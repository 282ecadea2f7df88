"""The networkx view of a module, for DOT output (dot.py) and graph analyses.

Node = op index in module.ops (ints keep the graph cheap and unambiguous); node attrs: `op` (the Op), `label`.
Edge u -> v: op v reads a result of op u; edge attr `values` lists the values carried.
"""
from __future__ import annotations

import networkx as nx

from .core import Module


def to_networkx(module: Module, *, include_params: bool = True) -> nx.DiGraph:
    g = nx.DiGraph(name=module.name)
    producer: dict[str, int] = {}
    for i, op in enumerate(module.ops):
        if include_params or op.op != "param":
            for r in op.results:
                producer.setdefault(r, i)
    for i, op in enumerate(module.ops):
        if not include_params and op.op == "param":
            continue
        g.add_node(i, op=op, kind=op.op, label=op.describe())
        for v in dict.fromkeys(op.inputs):
            src = producer.get(v)
            if src is None:
                continue            # a param left out, or an undefined value (the verifier's business)
            if g.has_edge(src, i):
                g.edges[src, i]["values"].append(v)
            else:
                g.add_edge(src, i, values=[v])
    g.graph["outputs"] = [producer[o] for o in module.outputs if o in producer]
    return g
