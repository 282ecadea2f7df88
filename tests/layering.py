"""The import graph of the k3c package and the layering rule it must obey (tests/test_layering.py, docs/layout.md).

Every `import` and `from ... import` in k3c, at the top of a module or inside a function, is an edge from the
importing module to the imported one (`from pkg import name` is an edge to `pkg.name` when that is a module).
Importing `a.b.c` also runs the package files `a/__init__.py` and `a/b/__init__.py`, so the edge reaches those
packages too, unless they enclose the importer (Python has run them before the importer started).

The rule: every module sits in one layer of LAYERS (the longest prefix that names it), an import never points to
a higher layer, and the graph has no cycle, inside a layer included. Inside the runtime the same holds for the
runtime's own order (RUNTIME_LAYERS: platform < caches < kernel impls < executor < session < the serving rooms <
the engine).
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

# Lowest first. An entry names a module or package; the longest matching entry decides a module's layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("k3c.errors", "k3c.config", "k3c.paths", "k3c.limits", "k3c.outputs")),
    ("ir", ("k3c.ir",)),
    ("model", ("k3c.frontend",)),                       # spec, schema, HF config import/export, weight names
    ("numerics", ("k3c.quant", "k3c.reference")),       # OCP MX formats; the eager PyTorch oracle
    ("kernels", ("k3c.codegen",)),                      # targets, Triton emitters, plans, the catalogue
    ("passes", ("k3c.passes",)),
    ("analysis", ("k3c.analysis",)),
    ("aot", ("k3c.codegen.aot", "k3c.codegen.cache")),  # ahead-of-time compilation and its cache
    ("runtime", ("k3c.runtime",)),
    ("api", ("k3c.api",)),
    ("serve", ("k3c.serve",)),                          # the HTTP server over the engine (`k3c serve`)
    ("commands", ("k3c.commands", "k3c.cli", "k3c")),   # `k3c ...` commands, the rank launcher, the CLI
)
LAYER_NAMES = tuple(name for name, _ in LAYERS)

# Inside the runtime layer, lowest first (the same longest-prefix rule; "k3c.runtime" catches a new module at the
# bottom, so what it imports from above is reported until it is placed here).
RUNTIME_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("platform", ("k3c.runtime",)),                     # devices, launcher, binary, checkpoints, weights, sampling
    ("caches", ("k3c.runtime.caches", "k3c.runtime.prefix_cache")),   # pages, sequence state, latent stores, KDA
    ("kernel_impls", ("k3c.runtime.kernel_impls",)),
    ("executor", ("k3c.runtime.executor", "k3c.runtime.cuda_graph")),
    ("session", ("k3c.runtime.session", "k3c.runtime.opcheck", "k3c.runtime.speculative")),
    ("serving.requests", ("k3c.runtime.serving", "k3c.runtime.serving.requests")),
    ("serving.ledger", ("k3c.runtime.serving.ledger",)),
    ("serving.scheduler", ("k3c.runtime.serving.scheduler",)),
    ("serving.graph_pool", ("k3c.runtime.serving.graph_pool",)),
    ("serving.runner", ("k3c.runtime.serving.runner",)),
    ("serving.speculation", ("k3c.runtime.serving.speculation",)),
    ("serving.engine", ("k3c.runtime.serving.engine", "k3c.runtime.engine")),
    ("serving.lockstep", ("k3c.runtime.serving.lockstep",)),    # one engine step on every rank (sharded serving)
)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    file: str
    line: int


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file under root/k3c."""
    out = {}
    for path in sorted((root / "k3c").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(mod: str, path: pathlib.Path, node: ast.AST, known: dict) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name == "k3c" or a.name.startswith("k3c.")]
    else:
        if node.level:
            base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            pkg = ".".join(base + ([node.module] if node.module else []))
        else:
            pkg = node.module or ""
        if not (pkg == "k3c" or pkg.startswith("k3c.")):
            return []
        names = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in known else pkg for a in node.names]
    out = []
    for name in names:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known:
            out.append(name)
    return out


def import_edges(root: pathlib.Path) -> list[Edge]:
    """Every k3c -> k3c import edge, with the package __init__ files each import runs."""
    known = modules(root)
    edges = []
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for dst in _targets(mod, path, node, known):
                parts = dst.split(".")
                for i in range(1, len(parts) + 1):
                    step = ".".join(parts[:i])
                    encloses = mod == step or mod.startswith(step + ".")
                    if step in known and step != mod and not encloses:
                        edges.append(Edge(mod, step, str(path.relative_to(root)), node.lineno))
    return edges


def layer_of(mod: str, layers=LAYERS) -> str | None:
    best, best_len = None, -1
    for name, prefixes in layers:
        for prefix in prefixes:
            if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    return best


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def violations(root: pathlib.Path) -> list[str]:
    """What breaks the rule, one line each (empty when the layering holds)."""
    known = modules(root)
    edges = import_edges(root)
    out = [f"{m}: in no layer (add it to tests/layering.py LAYERS)" for m in known if layer_of(m) is None]
    rank = {name: i for i, name in enumerate(LAYER_NAMES)}
    runtime_rank = {name: i for i, (name, _) in enumerate(RUNTIME_LAYERS)}
    for e in edges:
        a, b = layer_of(e.src), layer_of(e.dst)
        if a is not None and b is not None and rank[b] > rank[a]:
            out.append(f"{e.file}:{e.line}: {e.src} ({a}) imports {e.dst} ({b}), a higher layer")
        elif a == b == "runtime":
            ra, rb = layer_of(e.src, RUNTIME_LAYERS), layer_of(e.dst, RUNTIME_LAYERS)
            if runtime_rank[rb] > runtime_rank[ra]:
                out.append(f"{e.file}:{e.line}: {e.src} (runtime {ra}) imports {e.dst} (runtime {rb}), a higher "
                           "runtime layer")
    for comp in _cycles(edges):
        out.append(f"import cycle: {' <-> '.join(comp)}")
    return out
