"""Run a KernelSource on the device at hand, and the per-family wrappers the runtime calls.

    ks = emit_rmsnorm(64, 1e-6, target=get_target("cpu"), dtype="fp32")
    launch(ks, x, w, out, M)                         # args in ks.signature order; constexprs added from ks

Loading: the source is written to a private per-process directory, imported with importlib under a sanitised module
name (`k3c_gen_<kernel>_<digest>`), and cached by KernelSource.digest. On a CPU, TRITON_INTERPRET=1 is set while the
module is imported (Triton reads it when the @triton.jit function is defined), so the kernel runs in Triton's
interpreter; on CUDA/ROCm it is a plain JIT function. The grid rule is evaluated by `eval_grid`, a small AST walker
over names, integer constants, + - * // and calls to cdiv/max/min: never eval().

Wrappers (each builds and memoises the KernelSource specialised on the actual shapes and dtypes):
    rmsnorm(x, weight, eps, residual=None) -> (out, new_residual or None)
    gemm(a, w, bias=None, act=None, residual=None) -> act(a @ w.T + bias) + residual
    gemm_glu(a, w_gate, w_up, act) -> act(a @ w_gate.T, a @ w_up.T)
    glu(g, u=None, act="swiglu") -> act(g, u)    (u None: g is [..., 2F], gate first)
    embedding(ids, table) -> table[ids]
    softmax(x, scale=1.0) -> softmax(scale * x, -1)
"""
from __future__ import annotations

import ast
import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import debug
from .kernel import KernelSource
from .kernels import emit_embedding, emit_gemm, emit_gemm_glu, emit_glu, emit_rmsnorm, emit_softmax
from .kernels.common import epi_act, glu_act, pow2_ceil
from .targets import TARGETS, Target, get_target
from .writer import CodegenError, ident, name_part

# Passed explicitly at every launch (Triton warns when neither this nor TRITON_DEFAULT_FP_FUSION is set); it is
# Triton's own default and what the AOT path compiles with unless told otherwise.
ENABLE_FP_FUSION = True

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


# -- loading -------------------------------------------------------------------------------------------------------
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
def _interpret_env(interpret: bool):
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
            with _interpret_env(interpret):
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


# -- launching -----------------------------------------------------------------------------------------------------
TORCH_TO_TT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
               torch.int32: "i32"}
_TT_TO_TORCH = {v: k for k, v in TORCH_TO_TT.items()}
_INT_RANGE = {"i32": (-2 ** 31, 2 ** 31 - 1), "i64": (-2 ** 63, 2 ** 63 - 1)}


def tt_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_TT[dtype]
    except KeyError:
        raise CodegenError(f"no kernel dtype for {dtype}") from None


class _Prepared:
    """Everything about a KernelSource that launch() would otherwise recompute per call."""
    __slots__ = ("ks", "names", "checks", "int_names", "const_env", "grid_fns", "kwargs", "fns")

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
        self.fns: dict[bool, Any] = {}


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


def launch(ks: KernelSource, *args: Any) -> None:
    """Launch `ks` with its runtime args in signature order (tensors for pointers, ints/floats for scalars)."""
    p = _prepared(ks)
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
    env = dict(p.const_env)
    for i, aname in p.int_names:
        env[aname] = args[i]
    grid = _run_grid(p.grid_fns, ks.grid, env)
    if 0 in grid:
        return
    interpret = device is None or device.type == "cpu"
    fn = p.fns.get(interpret)
    if fn is None:
        fn = p.fns[interpret] = load_kernel(ks, interpret)
    if interpret:
        # numpy warns where IEEE arithmetic on a GPU is silent (exp overflowing to inf in sigmoid's tail)
        with _interpret_env(True), np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
            fn[grid](*args, **p.kwargs)
    else:
        fn[grid](*args, **p.kwargs)


# -- targets -------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _device_target(device_type: str, index: int) -> Target:
    if device_type == "cpu":
        return TARGETS["cpu"]
    if device_type != "cuda":
        raise CodegenError(f"no kernel target for device type {device_type!r}")
    props = torch.cuda.get_device_properties(index)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    if getattr(torch.version, "hip", None):
        arch = str(getattr(props, "gcnArchName", "")).split(":")[0]
        for t in TARGETS.values():
            if t.backend == "hip" and t.arch == arch:
                return t
        base = TARGETS["mi300x"]
        return dataclasses.replace(base, name=f"hip_{name_part(arch)}", arch=arch,
                                   shared_mem_bytes=smem or base.shared_mem_bytes)
    arch = f"sm_{props.major}{props.minor}"
    for t in TARGETS.values():
        if t.backend == "cuda" and t.arch == arch:
            return t
    base = TARGETS["h100"]
    return dataclasses.replace(base, name=f"cuda_{arch}", arch=arch, shared_mem_bytes=smem or 96 * 1024)


def target_for(device: torch.device | str) -> Target:
    """The Target describing `device` (cpu -> the interpreter target; cuda -> the table entry of its arch)."""
    d = torch.device(device)
    return _device_target(d.type, d.index if d.index is not None else
                          (torch.cuda.current_device() if d.type == "cuda" else 0))


def _resolve(target: Target | str | None, t: torch.Tensor) -> Target:
    if target is None:
        d = t.device
        return _device_target(d.type, d.index or 0)     # a CUDA tensor's device always carries its index
    if isinstance(target, str):
        return get_target(target)
    return target


M_BUCKET_MAX = 1024
M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)    # every m_hint the GEMM wrappers can ask for (AOT: emit these)


def m_bucket(m: int) -> int:
    """The token-count bucket the GEMM tiles are specialised for: powers of two from 16 to 1024 (every M >= 513
    shares the 1024 kernel; tiles only change below that, and the program-count rule needs M's scale)."""
    return max(16, min(M_BUCKET_MAX, pow2_ceil(max(1, m))))


# -- memoised emitters ---------------------------------------------------------------------------------------------
_emit_rmsnorm = functools.lru_cache(maxsize=256)(emit_rmsnorm)
_emit_embedding = functools.lru_cache(maxsize=256)(emit_embedding)
_emit_glu = functools.lru_cache(maxsize=256)(emit_glu)
_emit_gemm = functools.lru_cache(maxsize=512)(emit_gemm)
_emit_gemm_glu = functools.lru_cache(maxsize=256)(emit_gemm_glu)
_emit_softmax = functools.lru_cache(maxsize=256)(emit_softmax)


# Per-call fast path: (family, id(target), shapes, dtypes, options) -> KernelSource, in front of the lru-cached
# emitters (so equal specs from different keys still share one KernelSource, one loaded module and one launcher).
_FAST: dict[tuple, tuple[Target, KernelSource]] = {}
_MAX_FAST = 4096


def _memo(key: tuple, tgt: Target, build) -> KernelSource:
    hit = _FAST.get(key)
    if hit is not None and hit[0] is tgt:          # key holds id(tgt); the entry keeps tgt alive
        return hit[1]
    ks = build()
    if len(_FAST) >= _MAX_FAST:
        _FAST.clear()
    _FAST[key] = (tgt, ks)
    return ks


def _hashable(act: object) -> object:
    try:
        hash(act)
        return act
    except TypeError:
        return repr(act)


def _interp(t: torch.Tensor) -> bool:
    """A CPU tensor runs through the interpreter: emit the interpreter variant whatever the target."""
    return t.device.type == "cpu"


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _check_last(t: torch.Tensor, n: int, what: str) -> None:
    if t.dim() < 1 or t.shape[-1] != n:
        raise CodegenError(f"{what}: expected last dim {n}, got shape {tuple(t.shape)}")


# -- family wrappers -----------------------------------------------------------------------------------------------
def _dt(t: torch.Tensor | None) -> str | None:
    return None if t is None else tt_dtype(t.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None, *,
            target: Target | str | None = None, inplace: bool = False, max_block: int | None = None,
            ir_op: str = "rms_norm", loc: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim, fp32 inside. With `residual`: s = x + residual (in their promoted dtype) is
    returned as the new residual (written into `residual` itself when inplace=True) and out = rmsnorm(s).
    Returns (out, new_residual or None); out has x's dtype (the promoted dtype when fused), as the reference."""
    tgt = _resolve(target, x)
    D = x.shape[-1]
    x2 = _rows(x)
    M = x2.shape[0]
    if weight is not None:
        _check_last(weight, D, "rmsnorm weight")
        weight = weight.reshape(D).contiguous()
    ws = [weight] if weight is not None else []
    interp = _interp(x)
    if residual is None:
        out = torch.empty_like(x2)
        ks = _memo(("rmsnorm", id(tgt), D, eps, x.dtype, _dt(weight), max_block, ir_op, loc, interp), tgt,
                   lambda: _emit_rmsnorm(D, float(eps), target=tgt, dtype=tt_dtype(x.dtype),
                                         weight_dtype=_dt(weight), has_weight=weight is not None,
                                         max_block=max_block, ir_op=ir_op, loc=loc, interpret=interp))
        launch(ks, x2, *ws, out, M)
        return out.view(x.shape), None
    if residual.shape != x.shape:
        raise CodegenError(f"rmsnorm residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    rdt = torch.promote_types(x.dtype, residual.dtype)
    if inplace and (residual.dtype != rdt or not residual.is_contiguous()):
        raise CodegenError("rmsnorm inplace=True needs a contiguous residual of the promoted dtype")
    r2 = _rows(residual)
    res_out = r2 if inplace else torch.empty(M, D, dtype=rdt, device=x.device)
    out = torch.empty(M, D, dtype=rdt, device=x.device)
    ks = _memo(("rmsnorm_res", id(tgt), D, eps, x.dtype, residual.dtype, _dt(weight), max_block, ir_op, loc,
                interp), tgt,
               lambda: _emit_rmsnorm(D, float(eps), target=tgt, dtype=tt_dtype(x.dtype), residual=True,
                                     residual_dtype=tt_dtype(rdt), out_dtype=tt_dtype(rdt),
                                     weight_dtype=_dt(weight), has_weight=weight is not None, max_block=max_block,
                                     ir_op=ir_op, loc=loc, interpret=interp))
    if r2.dtype != rdt:
        r2 = r2.to(rdt)
    launch(ks, x2, r2, *ws, out, res_out, M)
    return out.view(x.shape), (residual if inplace else res_out.view(x.shape))


def gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: object = None,
         residual: torch.Tensor | None = None, *, target: Target | str | None = None,
         out_dtype: torch.dtype | None = None, fp32_precision: str = "ieee", ir_op: str = "linear",
         loc: str = "") -> torch.Tensor:
    """act(a @ w.T + bias) + residual for a [..., K], w [N, K] (nn.Linear layout); result [..., N] in out_dtype
    (default a's dtype). act: None | 'silu' | 'sigmoid' | 'relu' | ('situ_gate', beta) | ('situ_up', beta)."""
    tgt = _resolve(target, a)
    if w.dim() != 2:
        raise CodegenError(f"gemm weight must be [N, K], got shape {tuple(w.shape)}")
    N, K = w.shape
    _check_last(a, K, "gemm input")
    a2 = _rows(a)
    M = a2.shape[0]
    odt = out_dtype or a.dtype
    extra = []
    if bias is not None:
        _check_last(bias, N, "gemm bias")
        bias = bias.reshape(N).contiguous()
        extra.append(bias)
    if residual is not None:
        _check_last(residual, N, "gemm residual")
        if residual.shape[:-1] != a.shape[:-1]:
            raise CodegenError(f"gemm residual shape {tuple(residual.shape)} does not match [..., {N}]")
        residual = _rows(residual)
        extra.append(residual)
    out = torch.empty(M, N, dtype=odt, device=a.device)
    interp, mb = _interp(a), m_bucket(M)
    ks = _memo(("gemm", id(tgt), N, K, mb, a.dtype, w.dtype, odt, _dt(bias), _dt(residual), _hashable(act),
                fp32_precision, ir_op, loc, interp), tgt,
               lambda: _emit_gemm(N, K, target=tgt, m_hint=mb, dtype=tt_dtype(a.dtype), w_dtype=tt_dtype(w.dtype),
                                  out_dtype=tt_dtype(odt), bias=bias is not None, bias_dtype=_dt(bias),
                                  act=epi_act(act), residual=residual is not None, residual_dtype=_dt(residual),
                                  fp32_precision=fp32_precision, ir_op=ir_op, loc=loc, interpret=interp))
    launch(ks, a2, w.contiguous(), *extra, out, M)
    return out.view(*a.shape[:-1], N)


def gemm_glu(a: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: object = "swiglu", *,
             target: Target | str | None = None, out_dtype: torch.dtype | None = None,
             fp32_precision: str = "ieee", ir_op: str = "linear_glu", loc: str = "") -> torch.Tensor:
    """act(a @ w_gate.T, a @ w_up.T) in one kernel (SwiGLU or SiTU-GLU; ActivationSpec accepted)."""
    tgt = _resolve(target, a)
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise CodegenError(f"gemm_glu weights must be two [F, K] of one dtype, got {tuple(w_gate.shape)} "
                           f"{w_gate.dtype} and {tuple(w_up.shape)} {w_up.dtype}")
    F, K = w_gate.shape
    _check_last(a, K, "gemm_glu input")
    a2 = _rows(a)
    M = a2.shape[0]
    odt = out_dtype or a.dtype
    out = torch.empty(M, F, dtype=odt, device=a.device)
    interp, mb = _interp(a), m_bucket(M)
    ks = _memo(("gemm_glu", id(tgt), F, K, mb, a.dtype, w_gate.dtype, odt, _hashable(act), fp32_precision, ir_op,
                loc, interp), tgt,
               lambda: _emit_gemm_glu(F, K, glu_act(act), target=tgt, m_hint=mb, dtype=tt_dtype(a.dtype),
                                      w_dtype=tt_dtype(w_gate.dtype), out_dtype=tt_dtype(odt),
                                      fp32_precision=fp32_precision, ir_op=ir_op, loc=loc, interpret=interp))
    launch(ks, a2, w_gate.contiguous(), w_up.contiguous(), out, M)
    return out.view(*a.shape[:-1], F)


def glu(g: torch.Tensor, u: torch.Tensor | None = None, act: object = "swiglu", *,
        target: Target | str | None = None, ir_op: str = "glu", loc: str = "") -> torch.Tensor:
    """act(g, u) elementwise, fp32 inside, in g's dtype. With u None, g is [..., 2F] (gate first, then up)."""
    tgt = _resolve(target, g)
    merged = u is None
    if merged:
        if g.shape[-1] % 2:
            raise CodegenError(f"glu on a merged input needs an even last dim, got {g.shape[-1]}")
        F = g.shape[-1] // 2
        ins = [_rows(g)]
        shape = (*g.shape[:-1], F)
    else:
        if u.shape != g.shape or u.dtype != g.dtype:
            raise CodegenError(f"glu gate and up must match: {tuple(g.shape)} {g.dtype} vs {tuple(u.shape)} "
                               f"{u.dtype}")
        F = g.shape[-1]
        ins = [_rows(g), _rows(u)]
        shape = tuple(g.shape)
    M = ins[0].shape[0]
    out = torch.empty(M, F, dtype=g.dtype, device=g.device)
    interp = _interp(g)
    ks = _memo(("glu", id(tgt), F, g.dtype, merged, _hashable(act), ir_op, loc, interp), tgt,
               lambda: _emit_glu(F, glu_act(act), target=tgt, dtype=tt_dtype(g.dtype), merged=merged, ir_op=ir_op,
                                 loc=loc, interpret=interp))
    launch(ks, *ins, out, M)
    return out.view(shape)


def embedding(ids: torch.Tensor, table: torch.Tensor, *, target: Target | str | None = None,
              ir_op: str = "embedding", loc: str = "") -> torch.Tensor:
    """table[ids] for integer ids of any shape and table [V, D]; ids outside [0, V) give zero rows."""
    tgt = _resolve(target, table)
    if table.dim() != 2:
        raise CodegenError(f"embedding table must be [V, D], got shape {tuple(table.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise CodegenError(f"embedding ids must be int64 or int32, got {ids.dtype}")
    V, D = table.shape
    flat = ids.reshape(-1).contiguous()
    N = flat.numel()
    out = torch.empty(N, D, dtype=table.dtype, device=table.device)
    ks = _memo(("embedding", id(tgt), V, D, table.dtype, ids.dtype, ir_op, loc), tgt,
               lambda: _emit_embedding(V, D, target=tgt, dtype=tt_dtype(table.dtype), ids_dtype=tt_dtype(ids.dtype),
                                       ir_op=ir_op, loc=loc))
    launch(ks, flat, table.contiguous(), out, N)
    return out.view(*ids.shape, D)


def softmax(x: torch.Tensor, scale: float = 1.0, *, target: Target | str | None = None,
            out_dtype: torch.dtype | None = None, max_block: int | None = None, ir_op: str = "softmax",
            loc: str = "") -> torch.Tensor:
    """softmax(scale * x) over the last dim, fp32 inside, in out_dtype (default x's dtype)."""
    tgt = _resolve(target, x)
    D = x.shape[-1]
    x2 = _rows(x)
    M = x2.shape[0]
    odt = out_dtype or x.dtype
    out = torch.empty(M, D, dtype=odt, device=x.device)
    interp = _interp(x)
    ks = _memo(("softmax", id(tgt), D, scale, x.dtype, odt, max_block, ir_op, loc, interp), tgt,
               lambda: _emit_softmax(D, target=tgt, scale=float(scale), dtype=tt_dtype(x.dtype),
                                     out_dtype=tt_dtype(odt), max_block=max_block, ir_op=ir_op, loc=loc,
                                     interpret=interp))
    launch(ks, x2, out, M)
    return out.view(x.shape)


__all__ = ["launch", "load_kernel", "eval_grid", "GridError", "kernel_dir", "target_for", "tt_dtype", "m_bucket",
           "M_BUCKETS", "compile_grid_expr",
           "rmsnorm", "gemm", "gemm_glu", "glu", "embedding", "softmax", "ENABLE_FP_FUSION"]
