"""Imports point one way (tests/layering.py holds the layers and the rule; docs/layout.md draws them)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from layering import import_edges, layer_of, violations

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_k3c_imports_point_one_way():
    found = sorted(set(violations(ROOT)))
    assert found == [], "\n".join(found)


def _copy_package(tmp_path) -> pathlib.Path:
    shutil.copytree(ROOT / "k3c", tmp_path / "k3c", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _append(path: pathlib.Path, text: str) -> None:
    path.write_text(path.read_text() + "\n\n" + textwrap.dedent(text))


def _new_violations(root: pathlib.Path) -> list[str]:
    """What the edit in the copy under `root` adds (the real tree's own state is the first test's business)."""
    before = set(violations(ROOT))
    return [v for v in violations(root) if v not in before]


def test_a_back_edge_inside_a_function_fails(tmp_path):
    root = _copy_package(tmp_path)
    _append(root / "k3c/ir/core.py", """
        def _helper():
            from ..api import compile  # a back edge: the IR reaching up to the API
            return compile
        """)
    found = _new_violations(root)
    assert any("k3c/ir/core.py" in v and "k3c.ir.core (ir) imports k3c.api (api)" in v for v in found), found
    assert any(v.startswith("import cycle:") and "k3c.ir.core" in v and "k3c.api" in v for v in found), found


def test_a_cycle_inside_one_layer_fails(tmp_path):
    root = _copy_package(tmp_path)
    _append(root / "k3c/ir/core.py", """
        def _helper():
            from . import verifier  # verifier imports core: a cycle with no layer crossed
            return verifier
        """)
    found = _new_violations(root)
    assert any(v.startswith("import cycle:") and "k3c.ir.core" in v and "k3c.ir.verifier" in v
               for v in found), found
    assert not any("a higher layer" in v for v in found), found


def test_a_module_outside_every_layer_fails(tmp_path):
    root = _copy_package(tmp_path)
    (root / "k3c/extras").mkdir()
    (root / "k3c/extras/__init__.py").write_text("")
    assert layer_of("k3c.extras") == "commands"        # the root package's entry catches it: the top layer
    (root / "k3c/extras/tool.py").write_text("from ..api import compile\n")
    assert not [v for v in _new_violations(root) if "k3c.extras" in v]


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def test_importing_a_submodule_runs_its_package_init(tmp_path):
    """`from ..analysis.cost import x` also runs k3c/analysis/__init__.py: when that facade imports a module above
    the importer, the rule sees it."""
    root = _tree(tmp_path, {
        "k3c/__init__.py": "",
        "k3c/analysis/__init__.py": "from .report import plan\n",
        "k3c/analysis/cost.py": "x = 1\n",
        "k3c/analysis/report.py": "def plan():\n    from ..api import compile\n",
        "k3c/api.py": "from .runtime import engine\n",
        "k3c/runtime/__init__.py": "",
        "k3c/runtime/engine.py": "from ..analysis.cost import x\n",
    })
    edges = {(e.src, e.dst) for e in import_edges(root)}
    assert ("k3c.runtime.engine", "k3c.analysis") in edges
    assert ("k3c.runtime.engine", "k3c.analysis.cost") in edges
    assert ("k3c.runtime.engine", "k3c.runtime") not in edges        # its own package ran before it
    found = violations(root)
    assert any("k3c.analysis.report (analysis) imports k3c.api (api)" in v for v in found), found
    assert any(v.startswith("import cycle:") and "k3c.runtime.engine" in v for v in found), found


def test_relative_and_absolute_imports_resolve_alike(tmp_path):
    root = _tree(tmp_path, {
        "k3c/__init__.py": "",
        "k3c/errors.py": "",
        "k3c/ir/__init__.py": "",
        "k3c/ir/core.py": "from .. import errors\nimport k3c.errors\nfrom k3c import errors as e\n",
    })
    edges = [(e.src, e.dst, e.line) for e in import_edges(root)]
    assert edges == [("k3c.ir.core", "k3c.errors", 1), ("k3c.ir.core", "k3c.errors", 2),
                     ("k3c.ir.core", "k3c.errors", 3)]


BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _without_torch(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", "K3C_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_pass_runs_without_torch(tmp_path):
    """Compiling is the compiler's job: no pass, no kernel emitter and no catalogue lookup may need torch."""
    r = _without_torch("""
        import k3c
        from k3c.passes import available
        for name in ("attnres-split", "codegen", "default"):
            k3c.compile("examples/k3-tiny.yaml", target="mi355x", passes=[name])
        m = k3c.compile("examples/k3-tiny.yaml", target="h200", tp=2, run_dtypes=("bf16", "f32"))
        print(len(m.kernels()), len(available()))
        """, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[0]) > 50


def test_ahead_of_time_compilation_runs_without_torch(tmp_path):
    pytest.importorskip("triton")
    r = _without_torch(f"""
        import k3c
        from k3c.codegen.aot import compile_kernels
        m = k3c.compile("examples/k3-tiny.yaml", target="mi355x")
        ks = sorted(m.kernels(), key=lambda k: len(k.source))[:2]
        out = compile_kernels(ks, m.target, {str(tmp_path / 'aot')!r}, progress=False)
        print(len(out))
        """, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "2"


def test_a_back_edge_inside_the_runtime_fails(tmp_path):
    """The runtime's own order (tests/layering.py RUNTIME_LAYERS): the page ledger may not reach up to the engine,
    a kernel impl to the serving rooms, nor the launcher (where a Binding is a plain value) to the session that
    makes one."""
    root = _copy_package(tmp_path)
    _append(root / "k3c/runtime/serving/ledger.py", """
        def _helper():
            from .engine import Engine  # a back edge: the ledger reaching up to the facade over it
            return Engine
        """)
    _append(root / "k3c/runtime/kernel_impls/basic.py", """
        def _helper():
            from ..serving.runner import batch_mla_mode  # a back edge: a kernel impl reaching up to the runner
            return batch_mla_mode
        """)
    _append(root / "k3c/runtime/launcher.py", """
        def _helper():
            from .session import bind_kernels  # a back edge: the launcher looking up who made a Binding
            return bind_kernels
        """)
    found = _new_violations(root)
    assert any("k3c.runtime.launcher (runtime platform) imports k3c.runtime.session (runtime session)" in v
               for v in found), found
    assert any("k3c.runtime.serving.ledger (runtime serving.ledger) imports k3c.runtime.serving.engine (runtime "
               "serving.engine)" in v for v in found), found
    assert any("k3c.runtime.kernel_impls.basic (runtime kernel_impls) imports k3c.runtime.serving.runner" in v
               for v in found), found
    assert any(v.startswith("import cycle:") and "k3c.runtime.serving.ledger" in v for v in found), found
