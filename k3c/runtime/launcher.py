"""The one launcher: every generated kernel the runtime runs goes through `launch(ks, *args, binding=b)`.

    launch(ks, x, w, out, M, binding=b)     # args in ks.signature order; constexprs come from ks

`b` is the Binding of the model the launch belongs to (its artifact's catalogue, its Target, its policy): the
session or engine that loaded the model owns it and its call context carries it to the kernel impls; there is no
table of bindings per device, so two models on one device (a target and its draft model) each launch their own
artifact's kernels. Where the code that runs comes from depends on the device of the tensors:
  cpu        Triton's interpreter runs the KernelSource (nothing is compiled).
  cuda/hip   the binary of the binding's artifact, found by `ks.key` in its catalogue and loaded through the driver
             API (k3c.runtime.binary; a binary two artifacts hold is loaded once per device). What a miss does is
             the binding's policy:
               "artifact"   JIT-compile the source once, with one warning, counted in `stats().jit`;
               "strict"     raise MissingKernelError (also K3C_NO_JIT=1, whatever the policy);
               "allow-jit"  the artifact is for another target: JIT every kernel, saying so once;
               "jit"        ignore the binaries and JIT everything (the comparison path).
             With no binding (binding=None) the source is JIT-compiled (counted), unless K3C_NO_JIT=1.
  meta       nothing runs: inside `recording()` the launch is recorded (the catalogue-coverage test), else an error.

The grid rule is evaluated by `eval_grid`, a small AST walker over names, integer constants, + - * // and calls to
cdiv/max/min: never eval(). JIT sources are written to a private per-process directory and imported under a
sanitised module name (`k3c_gen_<kernel>_<digest>`); artifact sources are never imported unless JIT is asked for.
"""
from __future__ import annotations

import ast
import atexit
import contextlib
import functools
import hashlib
import importlib.util
import inspect
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..codegen.kernel import KernelSource
from .devices import TORCH_TO_TT, target_for
from ..codegen.targets import Target
from ..codegen.tiers import can_build, refusal, unbuildable
from ..codegen.writer import CodegenError, ident, name_part
from ..config import debug, settings
from ..errors import K3cError

# Passed explicitly at every JIT launch (Triton warns when neither this nor TRITON_DEFAULT_FP_FUSION is set); it is
# Triton's own default and what the AOT path compiles with unless told otherwise.
ENABLE_FP_FUSION = True

POLICIES = ("artifact", "strict", "allow-jit", "jit")


class MissingKernelError(K3cError):
    """A launch whose kernel the bound artifact does not hold, where JIT is not allowed."""


# -- the grid evaluator ------------------------------------------------------------------------------------------
MAX_GRID_EXPR_LEN = 256
GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)      # CUDA's and HIP's limits on grid dims x, y, z


class GridError(CodegenError):
    """A grid rule that is malformed, unsafe or out of range."""


def _cdiv(a: int, b: int) -> int:
    if b == 0:
        raise GridError("cdiv by zero in grid rule")
    return -(-a // b)


_GRID_FUNCS = {"cdiv": _cdiv, "max": max, "min": min}
_GRID_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _floordiv(a: int, b: int) -> int:
    if b == 0:
        raise GridError("division by zero in grid rule")
    return a // b


def _lookup(name: str):
    def get(env: dict[str, int]) -> int:
        try:
            return env[name]
        except KeyError:
            raise GridError(f"grid rule uses unknown name {name!r} (known: {', '.join(sorted(env))})") from None
    return get


def _grid_closure(node: ast.AST):
    """Closure env -> int for one AST node; anything but the whitelisted forms raises GridError here."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise GridError(f"grid rule constant must be an int, got {node.value!r}")
        value = node.value
        return lambda env: value
    if isinstance(node, ast.Name):
        return _lookup(node.id)
    if isinstance(node, ast.BinOp) and (type(node.op) in _GRID_OPS or isinstance(node.op, ast.FloorDiv)):
        op = _floordiv if isinstance(node.op, ast.FloorDiv) else _GRID_OPS[type(node.op)]
        left, right = _grid_closure(node.left), _grid_closure(node.right)
        return lambda env: op(left(env), right(env))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _GRID_FUNCS:
        if node.keywords or not node.args or any(isinstance(a, ast.Starred) for a in node.args):
            raise GridError(f"{node.func.id}() in a grid rule takes plain positional arguments")
        if node.func.id == "cdiv" and len(node.args) != 2:
            raise GridError("cdiv() takes exactly two arguments")
        fn, args = _GRID_FUNCS[node.func.id], [_grid_closure(a) for a in node.args]
        return lambda env: fn(*[a(env) for a in args])
    raise GridError(f"grid rule may only use names, ints, + - * // and cdiv/max/min; found {type(node).__name__}")


@functools.lru_cache(maxsize=1024)
def compile_grid_expr(expr: str):
    """Parse one grid expression once (ast, never eval) into a closure env -> int."""
    if not isinstance(expr, str) or len(expr) > MAX_GRID_EXPR_LEN:
        raise GridError(f"grid rule {expr!r} must be a str of at most {MAX_GRID_EXPR_LEN} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise GridError(f"grid rule {expr!r} does not parse: {e.msg}") from None
    return _grid_closure(tree.body)


def _compile_grid(grid) -> tuple:
    if not isinstance(grid, (tuple, list)) or not 1 <= len(grid) <= 3:
        raise GridError(f"grid rule must be 1 to 3 expressions, got {grid!r}")
    for expr in grid:
        if not isinstance(expr, str):
            raise GridError(f"grid rule {expr!r} must be a str")
    return tuple(compile_grid_expr(e) for e in grid)


def _run_grid(fns: tuple, grid, env: dict[str, int]) -> tuple[int, ...]:
    out = []
    for i, fn in enumerate(fns):
        value = fn(env)
        if not 0 <= value <= GRID_LIMITS[i]:
            raise GridError(f"grid dim {i} = {value} from {grid[i]!r} is outside [0, {GRID_LIMITS[i]}]")
        out.append(value)
    return tuple(out)


def eval_grid(grid: tuple[str, ...] | list[str], env: dict[str, int]) -> tuple[int, ...]:
    """Evaluate a launch-grid rule over integer sizes, e.g. ("cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)",)."""
    fns = _compile_grid(grid)
    for k, v in env.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise GridError(f"grid environment value {k}={v!r} is not an int")
    return _run_grid(fns, grid, env)


# -- JIT / interpreter loading ---------------------------------------------------------------------------------------
_LOCK = threading.RLock()
_MODULES: dict[tuple[str, bool], Any] = {}
_DIR: dict[int, Path] = {}


def kernel_dir() -> Path:
    """This process's private directory of generated kernel modules (mkdtemp; removed at exit)."""
    pid = os.getpid()
    with _LOCK:
        if pid not in _DIR:
            d = Path(tempfile.mkdtemp(prefix=f"k3c-kernels-{pid}-"))
            _DIR[pid] = d
            atexit.register(shutil.rmtree, d, True)
        return _DIR[pid]


@contextlib.contextmanager
def interpret_env(interpret: bool):
    """TRITON_INTERPRET as wanted while a kernel module is defined or an interpreted kernel runs (Triton reads it
    at definition, and modules it imports lazily during an interpreted launch read it again), then restored."""
    with _LOCK:
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = before


def _interpreted_type():
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction


def load_kernel(ks: KernelSource, interpret: bool) -> Any:
    """The @triton.jit function of `ks` (interpreted when `interpret`), imported once per (digest, interpret)."""
    key = (ks.digest, bool(interpret))
    with _LOCK:
        fn = _MODULES.get(key)
        if fn is not None:
            return fn
        name = ident(ks.name)
        modname = ident(f"k3c_gen_{name_part(name)}_{ks.digest}{'_interp' if interpret else ''}")
        path = kernel_dir() / f"{modname}.py"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(ks.source, encoding="ascii")
        os.replace(tmp, path)
        debug(4, f"kernel {name} ({ks.ir_op or '-'}) -> {path}\n{ks.source}")
        spec = importlib.util.spec_from_file_location(modname, path)
        if spec is None or spec.loader is None:
            raise CodegenError(f"cannot import generated kernel module {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        try:
            with interpret_env(interpret):
                spec.loader.exec_module(module)
        except Exception:
            sys.modules.pop(modname, None)
            raise
        fn = getattr(module, name, None)
        if fn is None:
            raise CodegenError(f"generated module {modname} does not define kernel {name}")
        if interpret != isinstance(fn, _interpreted_type()):
            raise CodegenError(f"kernel {name}: wanted {'an interpreted' if interpret else 'a JIT'} function "
                               f"(is triton.knobs.runtime.interpret overridden?)")
        params = list(inspect.signature(fn.fn).parameters)
        expected = list(ks.signature) + list(ks.constexprs)
        if params != expected:
            raise CodegenError(f"kernel {name}: parameters {params} do not match signature + constexprs {expected}")
        _MODULES[key] = fn
        return fn


# -- catalogues and bindings ---------------------------------------------------------------------------------------
@dataclass
class Catalogue:
    """The kernels of one artifact (checked against its manifest by k3c.load): catalogue key -> CompiledKernel,
    for one target. `root` is the artifact directory its files are relative to."""

    target: Target
    root: str
    entries: dict[str, Any] = field(default_factory=dict)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


class Binding:
    """Where one model's kernels come from on one device: its artifact's catalogue (None: no artifact), the Target
    its kernels are planned for, and the policy of a launch whose key the catalogue lacks (see the module doc).
    The session or engine that loads the model makes it (session.bind_kernels) and owns it; every call's context
    (caches/context.py) carries it to the kernel impls, which plan with `target` and launch through it. Two models
    on one device hold two Bindings: neither sees, replaces or re-binds the other's kernels."""

    __slots__ = ("catalogue", "target", "policy", "warned")

    def __init__(self, catalogue: Catalogue | None, target: Target, policy: str = "artifact") -> None:
        if policy not in POLICIES:
            raise CodegenError(f"kernel policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not isinstance(target, Target):
            raise CodegenError(f"Binding: expected a Target, got {target!r}")
        self.catalogue, self.target, self.policy = catalogue, target, policy
        self.warned: set = set()

    @property
    def has_binaries(self) -> bool:
        return self.catalogue is not None and len(self.catalogue) > 0

    def find(self, key: str) -> Any | None:
        """The catalogue entry of `key`, or None."""
        return None if self.catalogue is None else self.catalogue.entries.get(key)

    def describe(self) -> str:
        root = self.catalogue.root if self.catalogue is not None else "(none)"
        return f"the artifact {root} for {self.catalogue.target.name if self.catalogue else self.target.name}"

    def __repr__(self) -> str:
        root = self.catalogue.root if self.catalogue is not None else None
        return f"Binding({root!r}, {self.target.name}, {self.policy})"


def target_of(binding: Binding | None, device: torch.device | str) -> Target:
    """The Target kernels on `device` are planned for: the binding's, or with none the device's own
    (devices.target_for)."""
    return binding.target if binding is not None else target_for(device)


@dataclass
class LaunchStats:
    """Distinct kernels by where their code came from, launches, and the time spent loading / JIT-compiling."""

    binaries: int = 0           # loaded from an artifact's binaries
    jit: int = 0                # JIT-compiled from source in this process
    interpreted: int = 0        # run in Triton's interpreter (cpu)
    launches: int = 0
    load_seconds: float = 0.0
    jit_seconds: float = 0.0    # host time of the first call of each JIT kernel (includes its compile)
    jit_kernels: list = field(default_factory=list)     # names of the JIT-compiled kernels
    tier_fallbacks: list = field(default_factory=list)  # tier kernels replaced by portable ones (tier_fallback)


_STATS = LaunchStats()
_SEEN_INTERP: set = set()
_RECORDERS: list[list] = []
_BINARIES: dict[tuple[str, int], Any] = {}      # (a binary's sha256, device index) -> its loaded kernel


def _device_slot(device: torch.device | str) -> tuple[str, int]:
    d = torch.device(device)
    if d.index is not None:
        return d.type, d.index
    return d.type, (torch.cuda.current_device() if d.type == "cuda" else 0)


def _artifact_first(b: Binding | None) -> bool:
    return b is not None and b.has_binaries and b.policy in ("artifact", "strict")


def tier_fallback(ks: KernelSource, device: torch.device, binding: Binding | None = None) -> bool:
    """Whether the run-time plan must replace the tier kernel `ks` by its portable plan on `device`: True where
    `ks` is neither in the binding's artifact nor buildable by this process's Triton (k3c.codegen.tiers) and JIT
    is what the binding asks for (--allow-jit, the jit policy, or no artifact); counted in stats() and said
    once. Under the artifact's own policy (or strict, or K3C_NO_JIT=1) that is refused: MissingKernelError."""
    if device.type not in ("cuda", "hip"):
        return False                      # the interpreter never meets a tier plan; meta only records the launch
    if _artifact_first(binding) and binding.find(ks.key) is not None:
        return False
    if can_build(ks):
        return False
    if settings().no_jit or _artifact_first(binding):
        raise MissingKernelError(refusal(ks))
    if ks.name not in _STATS.tier_fallbacks:
        _STATS.tier_fallbacks.append(ks.name)
        warnings.warn(f"k3c: {unbuildable(ks)}; running the portable kernel instead",
                      RuntimeWarning, stacklevel=3)
    return True


def stats() -> LaunchStats:
    return _STATS


def reset_stats() -> None:
    global _STATS
    _STATS = LaunchStats()
    _SEEN_INTERP.clear()


@contextlib.contextmanager
def recording():
    """Record every KernelSource launched inside the block (on any device; on meta tensors nothing runs)."""
    rec: list[KernelSource] = []
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


# -- launching -------------------------------------------------------------------------------------------------------
_TT_TO_TORCH = {v: k for k, v in TORCH_TO_TT.items()}
_INT_RANGE = {"i32": (-2 ** 31, 2 ** 31 - 1), "i64": (-2 ** 63, 2 ** 63 - 1)}


class _Prepared:
    """Everything about a KernelSource that launch() would otherwise recompute per call."""
    __slots__ = ("ks", "names", "checks", "int_names", "const_env", "grid_fns", "kwargs", "runners")

    def __init__(self, ks: KernelSource) -> None:
        self.ks = ks
        self.names = list(ks.signature)
        self.checks = []                 # (index, kind, payload)
        self.int_names = []
        for i, (aname, ty) in enumerate(ks.signature.items()):
            ident(aname)
            if ty.startswith("*"):
                if ty[1:] not in _TT_TO_TORCH:
                    raise CodegenError(f"kernel {ks.name}: unsupported pointer type {ty!r} for {aname}")
                self.checks.append((i, "ptr", _TT_TO_TORCH[ty[1:]]))
            elif ty in _INT_RANGE:
                self.checks.append((i, "int", _INT_RANGE[ty]))
                self.int_names.append((i, aname))
            elif ty in ("fp32", "fp64"):
                self.checks.append((i, "float", None))
            else:
                raise CodegenError(f"kernel {ks.name}: unsupported signature type {ty!r} for {aname}")
        self.const_env = {k: v for k, v in ks.constexprs.items() if isinstance(v, int) and not isinstance(v, bool)}
        self.grid_fns = _compile_grid(ks.grid)
        self.kwargs = dict(ks.constexprs, num_warps=ks.num_warps, num_stages=ks.num_stages,
                           enable_fp_fusion=ENABLE_FP_FUSION)
        self.runners: dict[tuple, Any] = {}     # (device slot, Binding or None) -> its runner


_PREPARED: dict[int, _Prepared] = {}
_MAX_PREPARED = 4096


def _prepared(ks: KernelSource) -> _Prepared:
    p = _PREPARED.get(id(ks))
    if p is None or p.ks is not ks:
        p = _Prepared(ks)
        with _LOCK:
            if len(_PREPARED) >= _MAX_PREPARED:
                _PREPARED.clear()
            _PREPARED[id(ks)] = p          # holds ks, so its id is not reused while the entry lives
    return p


def _check_args(p: _Prepared, ks: KernelSource, args: tuple) -> torch.device | None:
    if len(args) != len(p.names):
        raise CodegenError(f"kernel {ks.name} takes {len(p.names)} args ({', '.join(p.names)}), got {len(args)}")
    device = None
    for i, kind, payload in p.checks:
        val = args[i]
        if kind == "ptr":
            if not isinstance(val, torch.Tensor):
                raise CodegenError(f"kernel {ks.name}: arg {p.names[i]} must be a tensor")
            if val.dtype != payload:
                raise CodegenError(f"kernel {ks.name}: arg {p.names[i]} is {val.dtype}, kernel wants {payload}")
            if device is None:
                device = val.device
            elif val.device != device:
                raise CodegenError(f"kernel {ks.name}: arg {p.names[i]} is on {val.device}, others on {device}")
        elif kind == "int":
            if val.__class__ is not int and (isinstance(val, bool) or not isinstance(val, int)):
                raise CodegenError(f"kernel {ks.name}: arg {p.names[i]} must be an int")
            if not payload[0] <= val <= payload[1]:
                raise CodegenError(f"kernel {ks.name}: arg {p.names[i]}={val} out of range")
        elif isinstance(val, bool) or not isinstance(val, (int, float)):
            raise CodegenError(f"kernel {ks.name}: arg {p.names[i]} must be a float")
    return device


def _grid(p: _Prepared, ks: KernelSource, args: tuple) -> tuple[int, ...]:
    env = dict(p.const_env)
    for i, aname in p.int_names:
        env[aname] = args[i]
    return _run_grid(p.grid_fns, ks.grid, env)


def launch(ks: KernelSource, *args: Any, binding: Binding | None = None) -> None:
    """Launch `ks` with its runtime args in signature order (tensors for pointers, ints/floats for scalars); on a
    GPU its code comes from `binding` (None: nothing bound, JIT-compile it)."""
    p = _prepared(ks)
    device = _check_args(p, ks, args)
    for rec in _RECORDERS:
        rec.append(ks)
    grid = _grid(p, ks, args)
    _STATS.launches += 1
    if device is None or device.type == "cpu":
        _interpret(p, ks, grid, args)
        return
    if device.type == "meta":
        if not _RECORDERS:
            raise CodegenError(f"kernel {ks.name}: meta tensors hold no data; launch on meta only inside recording()")
        return
    if 0 in grid:
        return
    _runner(p, ks, device, binding)(grid, args)


def fixed_launcher(ks: KernelSource, *args: Any, binding: Binding | None = None):
    """Launch `ks` once like launch(), and return a callable(*args) that repeats it with the same grid and no
    argument checks (for launch-bound decode paths whose ints are fixed), or None where that does not apply."""
    launch(ks, *args, binding=binding)
    device = args[0].device if isinstance(args[0], torch.Tensor) else None
    if device is None or device.type not in ("cuda",) or _RECORDERS:
        return None
    p = _prepared(ks)
    grid = _grid(p, ks, args)
    run = _runner(p, ks, device, binding)
    return lambda *a: run(grid, a)


def _interpret(p: _Prepared, ks: KernelSource, grid, args) -> None:
    if ks.key not in _SEEN_INTERP:
        _SEEN_INTERP.add(ks.key)
        _STATS.interpreted += 1
    if 0 in grid:
        return
    fn = load_kernel(ks, True)
    # numpy warns where IEEE arithmetic on a GPU is silent (exp overflowing to inf in sigmoid's tail)
    with interpret_env(True), np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        fn[grid](*args, **p.kwargs)


def _runner(p: _Prepared, ks: KernelSource, device: torch.device, b: Binding | None):
    key = (_device_slot(device), b)           # a Binding hashes by identity: each model's own runners
    run = p.runners.get(key)
    if run is None:
        run = p.runners[key] = _resolve_runner(p, ks, key[0], b)
    return run


def _resolve_runner(p: _Prepared, ks: KernelSource, slot: tuple[str, int], b: Binding | None):
    no_jit = settings().no_jit
    if b is not None and b.has_binaries and b.policy != "jit":
        entry = b.find(ks.key)
        if entry is not None and b.policy != "allow-jit":
            return _binary_runner(b.catalogue, entry, slot)
        if b.policy == "strict" or no_jit:
            raise MissingKernelError(
                f"kernel {ks.name} (IR op {ks.ir_op or '-'}, key {ks.key}) is not in {b.describe()}: the runtime "
                f"met a shape class its catalogue does not list"
                + ("" if b.policy == "strict" else " (K3C_NO_JIT=1 forbids JIT-compiling it)"))
        if b.policy == "artifact":
            warnings.warn(f"k3c: kernel {ks.name} ({ks.ir_op or '-'}) is not in {b.describe()}; JIT-compiling "
                          f"its source once", RuntimeWarning, stacklevel=3)
        elif "allow-jit" not in b.warned:
            b.warned.add("allow-jit")
            warnings.warn(f"k3c: {b.describe()} is not for this device; JIT-compiling every kernel for it "
                          f"instead (--allow-jit)", RuntimeWarning, stacklevel=3)
    elif no_jit and (b is None or b.policy != "jit"):
        raise MissingKernelError(f"kernel {ks.name} (IR op {ks.ir_op or '-'}): no artifact is bound to "
                                 f"{slot[0]}:{slot[1]} and K3C_NO_JIT=1 forbids JIT-compiling it")
    if not can_build(ks):
        raise MissingKernelError(refusal(ks))
    return _jit_runner(p, ks)


def _jit_runner(p: _Prepared, ks: KernelSource):
    fn = load_kernel(ks, False)
    _STATS.jit += 1
    _STATS.jit_kernels.append(ks.name)
    first = [True]
    kwargs = p.kwargs

    def run(grid, args):
        if first[0]:
            first[0] = False
            t0 = time.perf_counter()
            fn[grid](*args, **kwargs)
            _STATS.jit_seconds += time.perf_counter() - t0
            return
        fn[grid](*args, **kwargs)
    return run


def _binary_runner(cat: Catalogue, entry, slot: tuple[str, int]):
    # one load per binary and device, whichever artifact lists it (equal sha256: equal code)
    key = (entry.sha256.get(entry.binary) or os.path.join(cat.root, entry.binary), slot[1])
    bk = _BINARIES.get(key)
    if bk is None:
        from .binary import load_binary

        t0 = time.perf_counter()
        with open(os.path.join(cat.root, entry.binary), "rb") as fh:
            image = fh.read()
        expected = entry.sha256.get(entry.binary)
        if expected is None or hashlib.sha256(image).hexdigest() != expected:
            raise MissingKernelError(f"{os.path.join(cat.root, entry.binary)}: the binary does not match the "
                                     f"manifest's sha256 (the artifact was modified after compiling)")
        bk = load_binary(image, backend=entry.backend, entry_name=entry.entry, signature=entry.signature,
                         metadata=entry.metadata, divisible_by_16=entry.divisible_by_16, device_index=slot[1])
        _BINARIES[key] = bk
        _STATS.binaries += 1
        _STATS.load_seconds += time.perf_counter() - t0
    return bk.launch


__all__ = ["launch", "fixed_launcher", "load_kernel", "eval_grid", "compile_grid_expr", "GridError", "kernel_dir",
           "interpret_env", "Catalogue", "Binding", "target_of", "tier_fallback", "stats",
           "reset_stats", "recording",
           "LaunchStats", "MissingKernelError", "POLICIES", "ENABLE_FP_FUSION"]
