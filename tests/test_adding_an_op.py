"""docs/adding-an-op.md is true: its five code blocks, applied to a copy of the package as written, make a working
kernel-level op (verified IR, marked by `codegen`, in the catalogue, compiled ahead of time, launched equal to its
torch path and the reference), and they touch five files."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n# file: (?P<path>\S+) \((?P<how>append|new)\)\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[str, str, str]]:
    text = (ROOT / "docs" / "adding-an-op.md").read_text()
    return [(m["path"], m["how"], m["code"]) for m in BLOCK.finditer(text)]


def test_the_walk_through_touches_five_files():
    paths = [p for p, _, _ in _blocks()]
    assert len(paths) == len(set(paths)) == 5, paths
    for path, how, _ in _blocks():
        assert (ROOT / path).exists() == (how == "append"), path


CHECK = """
import torch
import k3c
from k3c.codegen.aot import compile_kernels
from k3c.codegen.catalogue import catalogue_kernels
from k3c.codegen.targets import get_target
from k3c.ir import Module, Op, TensorType, verify
from k3c.ir.ops import get_op_def
from k3c.passes.pipeline import run_pipeline
from k3c.reference.norms import scale
from k3c.runtime.kernel_impls import KERNEL_IMPLS, TORCH_IMPLS

assert get_op_def("scale") is not None

# the op after the final norm of the tiny model, as a pass would place it
m = k3c.compile("examples/k3-tiny.yaml", target="h200", passes=[]).module
norm = [op for op in m.ops if op.op == "rmsnorm"][-1]
ops = []
for op in m.ops:
    if op.results and op.result == norm.result:
        ops += [op.replace(results=("normed",)),
                Op.make(norm.result, "scale", ["normed"], {"factor": 0.3}, norm.types[0])]
    else:
        ops.append(op)
m = m.replace(ops=tuple(ops))
verify(m)
lowered, _ = run_pipeline(m, ["codegen"], target=get_target("h200"))
op = next(o for o in lowered.ops if o.op == "scale")
assert op.attr("impl") == "kernel", op
kernels = [k for k in catalogue_kernels(lowered, get_target("h200")) if k.ir_op == "scale"]
assert len(kernels) == 1, kernels
[compiled] = compile_kernels(kernels, "h200", OUT, progress=False)
assert os.path.getsize(os.path.join(OUT, compiled.files["cubin"])) > 0, compiled

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(37, 300, dtype=dtype)
    ran = KERNEL_IMPLS["scale"]({"factor": 0.3}, None, (x,), {})
    torched = TORCH_IMPLS["scale"]({"factor": 0.3}, None, (x,), {})
    assert torch.equal(ran, scale(x, 0.3)) and torch.equal(torched, scale(x, 0.3)), dtype
    assert not torch.equal(ran, x), dtype
print(kernels[0].name, compiled.files, "ok")
"""


def test_the_walk_through_makes_a_working_op(tmp_path):
    pytest.importorskip("triton")
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "k3c", tree / "k3c", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "examples", tree / "examples")
    for path, how, code in _blocks():
        target = tree / path
        if how == "new":
            target.write_text(code)
        else:
            target.write_text(target.read_text().rstrip("\n") + "\n\n\n" + code)
    out = tmp_path / "aot"
    env = {**os.environ, "PYTHONPATH": str(tree), "TRITON_DEFAULT_FP_FUSION": "1",
           "K3C_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    # the CPU launch needs the interpreter, set before triton is imported (k3c/codegen/triton_mode.py)
    prelude = "import os\nfrom k3c.codegen.triton_mode import prepare_interpreter\nprepare_interpreter()\n"
    script = prelude + f"OUT = {str(out)!r}\nos.makedirs(OUT, exist_ok=True)\n" + textwrap.dedent(CHECK)
    r = subprocess.run([sys.executable, "-c", script], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-4000:])
