"""networkx views of a module, for analyses (dependencies, topological order, liveness) and DOT output.

Node = op index in module.ops (ints keep the graph cheap and unambiguous); node attrs: `op` (the Op), `label`.
Edge u -> v: op v reads a result of op u; edge attr `values` lists the values carried.
"""
from __future__ import annotations

import networkx as nx

from .core import Module, Op


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


def topological_order(module: Module) -> list[Op]:
    """Ops in a dependency order, ties broken by position in the module: a valid module comes back unchanged,
    one whose ops were appended out of order comes back fixed. Raises networkx.NetworkXUnfeasible on a cycle."""
    g = to_networkx(module)
    return [module.ops[i] for i in nx.lexicographical_topological_sort(g)]


def dependencies(module: Module, value: str) -> list[Op]:
    """The ops `value` transitively depends on (including its definer), in module order."""
    g = to_networkx(module)
    node = next((i for i, op in enumerate(module.ops) if value in op.results), None)
    if node is None:
        raise KeyError(f"%{value} is not defined in module @{module.name}")
    return [module.ops[i] for i in sorted(nx.ancestors(g, node) | {node})]


def last_uses(module: Module) -> dict[str, int]:
    """value -> index of the last op reading it (len(ops) for module outputs); values never read map to their
    definer's index. The input to liveness-based memory planning."""
    out: dict[str, int] = {}
    for i, op in enumerate(module.ops):
        for r in op.results:
            out.setdefault(r, i)
        for v in op.inputs:
            out[v] = i
    for o in module.outputs:
        out[o] = len(module.ops)
    return out
