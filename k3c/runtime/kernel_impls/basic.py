"""The generic ops' torch-facing kernel wrappers and their kernel implementations (AOT side:
k3c/codegen/catalogue/basic.py). The layer ops' torch path is the executor's (k3c/runtime/executor.py), so this
family has no TORCH_IMPLS entries.

Wrappers (each builds and memoises the KernelSource specialised on the actual shapes and dtypes, then launches it
through k3c.runtime.launcher with the `binding=` its caller gives: the impls pass their call context's; a target
and binding default to the device's own, JIT):
    rmsnorm(x, weight, eps, residual=None) -> (out, new_residual or None)
    gemm(a, w, bias=None, act=None, residual=None) -> act(a @ w.T + bias) + residual
    gemm_glu(a, w_gate, w_up, act) -> act(a @ w_gate.T, a @ w_up.T)
    embedding(ids, table) -> table[ids]
"""
from __future__ import annotations

import functools

import torch

from ...codegen.buckets import m_bucket
from ...codegen.kernel import KernelSource
from ...codegen.kernels import emit_embedding, emit_gemm, emit_gemm_glu, emit_rmsnorm
from ...codegen.kernels.common import epi_act, glu_act
from ...codegen.targets import Target, get_target
from ...codegen.writer import CodegenError
from ...frontend.spec import ActivationSpec
from ..caches.context import call_binding
from ..devices import interpreted, tt_dtype
from ..launcher import Binding, launch, target_of


def _resolve(target: Target | str | None, binding: Binding | None, t: torch.Tensor) -> Target:
    """The Target to plan for: the one asked for, else the binding's (the device's own with none)."""
    if target is None:
        return target_of(binding, t.device)
    if isinstance(target, str):
        return get_target(target)
    return target


# -- memoised emitters ---------------------------------------------------------------------------------------------
_emit_rmsnorm = functools.lru_cache(maxsize=256)(emit_rmsnorm)
_emit_embedding = functools.lru_cache(maxsize=256)(emit_embedding)
_emit_gemm = functools.lru_cache(maxsize=512)(emit_gemm)
_emit_gemm_glu = functools.lru_cache(maxsize=256)(emit_gemm_glu)


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


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _check_last(t: torch.Tensor, n: int, what: str) -> None:
    if t.dim() < 1 or t.shape[-1] != n:
        raise CodegenError(f"{what}: expected last dim {n}, got shape {tuple(t.shape)}")


# -- family wrappers -----------------------------------------------------------------------------------------------
def _dt(t: torch.Tensor | None) -> str | None:
    return None if t is None else tt_dtype(t.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None, *,
            target: Target | str | None = None, binding: Binding | None = None, inplace: bool = False,
            max_block: int | None = None,
            ir_op: str = "rms_norm", loc: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim, fp32 inside. With `residual`: s = x + residual (in their promoted dtype) is
    returned as the new residual (written into `residual` itself when inplace=True) and out = rmsnorm(s).
    Returns (out, new_residual or None); out has x's dtype (the promoted dtype when fused), as the reference."""
    tgt = _resolve(target, binding, x)
    D = x.shape[-1]
    x2 = _rows(x)
    M = x2.shape[0]
    if weight is not None:
        _check_last(weight, D, "rmsnorm weight")
        weight = weight.reshape(D).contiguous()
    ws = [weight] if weight is not None else []
    interp = interpreted(x)
    if residual is None:
        out = torch.empty_like(x2)
        ks = _memo(("rmsnorm", id(tgt), D, eps, x.dtype, _dt(weight), max_block, ir_op, loc, interp), tgt,
                   lambda: _emit_rmsnorm(D, float(eps), target=tgt, dtype=tt_dtype(x.dtype),
                                         weight_dtype=_dt(weight), has_weight=weight is not None,
                                         max_block=max_block, ir_op=ir_op, loc=loc, interpret=interp))
        launch(ks, x2, *ws, out, M, binding=binding)
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
    launch(ks, x2, r2, *ws, out, res_out, M, binding=binding)
    return out.view(x.shape), (residual if inplace else res_out.view(x.shape))


def gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: object = None,
         residual: torch.Tensor | None = None, *, target: Target | str | None = None, binding: Binding | None = None,
         out_dtype: torch.dtype | None = None, fp32_precision: str = "ieee", ir_op: str = "linear",
         loc: str = "") -> torch.Tensor:
    """act(a @ w.T + bias) + residual for a [..., K], w [N, K] (nn.Linear layout); result [..., N] in out_dtype
    (default a's dtype). act: None | 'silu' | 'sigmoid' | 'relu' | ('situ_gate', beta) | ('situ_up', beta)."""
    tgt = _resolve(target, binding, a)
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
    interp, mb = interpreted(a), m_bucket(M)
    ks = _memo(("gemm", id(tgt), N, K, mb, a.dtype, w.dtype, odt, _dt(bias), _dt(residual), _hashable(act),
                fp32_precision, ir_op, loc, interp), tgt,
               lambda: _emit_gemm(N, K, target=tgt, m_hint=mb, dtype=tt_dtype(a.dtype), w_dtype=tt_dtype(w.dtype),
                                  out_dtype=tt_dtype(odt), bias=bias is not None, bias_dtype=_dt(bias),
                                  act=epi_act(act), residual=residual is not None, residual_dtype=_dt(residual),
                                  fp32_precision=fp32_precision, ir_op=ir_op, loc=loc, interpret=interp))
    launch(ks, a2, w.contiguous(), *extra, out, M, binding=binding)
    return out.view(*a.shape[:-1], N)


def gemm_glu(a: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act: object = "swiglu", *,
             target: Target | str | None = None, binding: Binding | None = None,
             out_dtype: torch.dtype | None = None,
             fp32_precision: str = "ieee", ir_op: str = "linear_glu", loc: str = "") -> torch.Tensor:
    """act(a @ w_gate.T, a @ w_up.T) in one kernel (SwiGLU or SiTU-GLU; ActivationSpec accepted)."""
    tgt = _resolve(target, binding, a)
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise CodegenError(f"gemm_glu weights must be two [F, K] of one dtype, got {tuple(w_gate.shape)} "
                           f"{w_gate.dtype} and {tuple(w_up.shape)} {w_up.dtype}")
    F, K = w_gate.shape
    _check_last(a, K, "gemm_glu input")
    a2 = _rows(a)
    M = a2.shape[0]
    odt = out_dtype or a.dtype
    out = torch.empty(M, F, dtype=odt, device=a.device)
    interp, mb = interpreted(a), m_bucket(M)
    ks = _memo(("gemm_glu", id(tgt), F, K, mb, a.dtype, w_gate.dtype, odt, _hashable(act), fp32_precision, ir_op,
                loc, interp), tgt,
               lambda: _emit_gemm_glu(F, K, glu_act(act), target=tgt, m_hint=mb, dtype=tt_dtype(a.dtype),
                                      w_dtype=tt_dtype(w_gate.dtype), out_dtype=tt_dtype(odt),
                                      fp32_precision=fp32_precision, ir_op=ir_op, loc=loc, interpret=interp))
    launch(ks, a2, w_gate.contiguous(), w_up.contiguous(), out, M, binding=binding)
    return out.view(*a.shape[:-1], F)


def embedding(ids: torch.Tensor, table: torch.Tensor, *, target: Target | str | None = None,
              binding: Binding | None = None,
              ir_op: str = "embedding", loc: str = "") -> torch.Tensor:
    """table[ids] for integer ids of any shape and table [V, D]; ids outside [0, V) give zero rows."""
    tgt = _resolve(target, binding, table)
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
    launch(ks, flat, table.contiguous(), out, N, binding=binding)
    return out.view(*ids.shape, D)


# -- kernel implementations: fn(attrs, cache, data, params) ----------------------------------------------------------
def launch_embedding(a, cache, data, w):
    return embedding(data[0], w["embed_tokens.weight"], binding=call_binding(cache))


def launch_rmsnorm(a, cache, data, w):
    return rmsnorm(data[0], w["weight"], a["eps"], binding=call_binding(cache))[0]


def launch_rmsnorm_residual(a, cache, data, w):
    out, summed = rmsnorm(data[0], w["weight"], a["eps"], residual=data[1], binding=call_binding(cache))
    return summed, out


def launch_mlp(a, cache, data, w):
    b = call_binding(cache)
    h = gemm_glu(data[0], w["gate_proj.weight"], w["up_proj.weight"], ActivationSpec.from_attrs(a), binding=b)
    return gemm(h, w["down_proj.weight"], binding=b)


KERNEL_IMPLS = {"embedding": launch_embedding, "rmsnorm": launch_rmsnorm,
                "rmsnorm_residual": launch_rmsnorm_residual, "mlp": launch_mlp}
TORCH_IMPLS: dict = {}
