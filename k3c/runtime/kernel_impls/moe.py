"""MoE runtime: launch wrappers of the generated MoE kernels (k3c.codegen.kernels.moe), the kernel implementations of
the moe-lower pass's ops (KERNEL_IMPLS, impl="kernel") and their torch implementations (TORCH_IMPLS: any other impl;
the per-op check's reference). moe_linear with MXFP4 weights: kernel_impls.mxfp4_linear, whose entries pick these
float ones or the MXFP4 GEMM. An active routing replay (k3c.runtime.routing_replay) chooses the experts of both
router paths.

Wrappers (tensors on any device; CPU runs through the Triton interpreter):
    route(logits [N, E] f32, bias, ...)                 -> (weights f32 [N, k], ids i32 [N, k], off i32 [EL + 1],
                                                            perm i32 [N * k])
    grouped_gemm(kind, a, weights, off, perm, ...)      -> gate_up: h [S, M] permuted; down: y [S, Z] slot order
    mx_linear(a, packed, scale, ...)                     -> a W^T for an MXFP4 weight (dense, same template)
    combine(y [N * k, Z], weights, ids, residual, ...)  -> u [N, Z]
"""
from __future__ import annotations

import functools
import weakref

import torch

from ...codegen.buckets import m_bucket
from ...codegen.kernels import moe as _kmoe
from ...codegen.kernels.moe import (ROW_BUCKETS, emit_moe_combine, emit_moe_linear, emit_moe_offsets, emit_moe_rank,
                                    emit_moe_scatter, emit_moe_topk, expert_gemm_kernels, expert_plan, moe_gemm_plan,
                                    mx_mode, row_bucket, tile_slots)
from ...codegen.writer import CodegenError
from ...frontend.spec import ActivationSpec
from ...quant import mxfp4_dequantize, mxfp4_quantize, mxfp8_dequantize, mxfp8_quantize
from ... import reference as ref
from ...reference.norms import acc
from .. import routing_replay
from ..caches.context import call_binding
from ..devices import interpreted, tt_dtype
from ..expert_layout import from_hopper, from_hopper_scales
from ..launcher import Binding, launch, target_of

_emit_topk = functools.lru_cache(maxsize=64)(emit_moe_topk)
_emit_rank = functools.lru_cache(maxsize=64)(emit_moe_rank)
_emit_scatter = functools.lru_cache(maxsize=64)(emit_moe_scatter)
_emit_offsets = functools.lru_cache(maxsize=64)(emit_moe_offsets)
_expert_kernels = functools.lru_cache(maxsize=256)(expert_gemm_kernels)
_expert_plan = functools.lru_cache(maxsize=256)(expert_plan)
_emit_combine = functools.lru_cache(maxsize=64)(emit_moe_combine)
_emit_linear = functools.lru_cache(maxsize=256)(emit_moe_linear)
_plan = functools.lru_cache(maxsize=256)(moe_gemm_plan)


# ---- routing ---------------------------------------------------------------------------------------------------
def route(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, router_activation: str = "sigmoid",
          renormalize: bool = True, scaling: float = 1.0, ep_rank: int = 0, ep_size: int = 1, ir_op: str = "moe_route",
          loc: str = "", binding: Binding | None = None):
    """Routing kernels on fp32 logits [N, E]: (weights f32 [N, k], ids i32 [N, k], offsets i32 [1 + 4, EL + 1]
    (row 0: expert row offsets; rows 1..4: expert tile offsets for BLOCK_M 16, 32, 64, 128), perm i32 [N * k]:
    row r of the permuted order holds slot perm[r] = t * k + j; under expert parallelism only the first
    off[0, EL] rows are this rank's, the rest are -1)."""
    tgt = target_of(binding, logits.device)
    lg = logits.reshape(-1, logits.shape[-1]).to(torch.float32).contiguous()
    N, E = lg.shape
    el, e0 = E // ep_size, ep_rank * (E // ep_size)
    dev = logits.device
    w = torch.empty(N, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(N, top_k, dtype=torch.int32, device=dev)
    pres = torch.empty(N, el, dtype=torch.int32, device=dev)
    cnt = torch.empty(el, dtype=torch.int32, device=dev)
    off = torch.empty(1 + len(ROW_BUCKETS), el + 1, dtype=torch.int32, device=dev)
    perm = (torch.full((N * top_k,), -1, dtype=torch.int32, device=dev) if ep_size > 1
            else torch.empty(N * top_k, dtype=torch.int32, device=dev))
    ks = _emit_topk(E, top_k, target=tgt, router_activation=router_activation, bias=bias is not None,
                    renormalize=renormalize, scaling=float(scaling), e_local=el, e0=e0, ir_op=ir_op, loc=loc)
    extra = [bias.to(torch.float32).contiguous()] if bias is not None else []
    launch(ks, lg, *extra, w, ids, pres, N, binding=binding)
    if routing_replay.active() is not None:        # a replayed choice: this run's weights and presence for it
        ids = routing_replay.replayed_ids(ids)
        s = torch.sigmoid(lg) if router_activation == "sigmoid" else torch.softmax(lg, dim=-1)
        w = ref.routed_weights(s, ids, renormalize, scaling)
        local = ids.long() - e0
        mine = (local >= 0) & (local < el)
        pres = torch.zeros(N, el, dtype=torch.int32, device=dev).scatter_add_(1, local.clamp(0, el - 1),
                                                                              mine.to(torch.int32))
    launch(_emit_rank(el, target=tgt, ir_op=ir_op, loc=loc), pres, cnt, N, binding=binding)
    launch(_emit_offsets(el, target=tgt, ir_op=ir_op, loc=loc), cnt, off, binding=binding)
    launch(_emit_scatter(el, top_k, target=tgt, e0=e0, ir_op=ir_op, loc=loc), ids, pres, off, perm, N,
           binding=binding)
    return w, ids, off, perm


# ---- grouped GEMM ----------------------------------------------------------------------------------------------
_SCALES_FIT: dict[int, tuple[int, bool]] = {}   # id(scale tensor) -> (its _version, all scales <= PAIRS1_MAX_SCALE)


META_SCALES_FIT = True     # what the scale check answers for meta tensors (tests record both answers)


def scales_fit_one_mul(scales: list[torch.Tensor]) -> bool:
    """Whether every E8M0 scale is <= PAIRS1_MAX_SCALE, so the one-multiply pair decode is exact on these weights.
    One reduction per scale tensor, remembered while the tensor lives and is not written in place; during CUDA
    graph capture an unchecked tensor counts as not fitting (no host sync there: the exact decode runs)."""
    for t in scales:
        hit = _SCALES_FIT.get(id(t))
        if hit is None or hit[0] != t._version:
            if t.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            if t.is_meta:       # no data: the answer recordings on meta tensors ask for (the artifact holds both)
                return META_SCALES_FIT
            fits = t.numel() == 0 or int(t.max()) <= _kmoe.PAIRS1_MAX_SCALE
            if hit is None:
                weakref.finalize(t, _SCALES_FIT.pop, id(t), None)
            hit = _SCALES_FIT[id(t)] = (t._version, fits)
        if not hit[1]:
            return False
    return True


def _gemm_ks(kind, n, k, rows, a, w_dtype, mx, num_experts, top_k, act, out_dtype, plan=None, ir_op="", loc="",
             scales=(), hopper=False, binding: Binding | None = None):
    """(GEMM kernel, dequant kernel or None) for these shapes: expert_plan + expert_gemm_kernels, the one choice
    the AOT catalogue enumerates, with the weights' scale check answered here (only where the plan asks).
    hopper: the weights are in the hopper layout (weight_layout)."""
    tgt = target_of(binding, a.device)
    dt = tt_dtype(a.dtype)
    if hopper and mx != "upcast":
        raise CodegenError(f"{ir_op or kind}: the expert weights are in the hopper layout, which the upcast GEMMs "
                           f"read; this device runs them as mx '{mx}'")
    if hopper and plan is not None and not plan.hopper:
        raise CodegenError(f"{ir_op or kind}: the expert weights are in the hopper layout, which only the hopper "
                           f"form reads; got the plan {plan.tag}")
    first = plan or _plan(kind, n, k, rows, mx, dt, tgt, hopper=hopper or None)
    fits = not first.one_mul or scales_fit_one_mul(list(scales))
    chosen = _expert_plan(kind, n, k, rows, target=tgt, mx=mx, dtype=dt, one_mul_fits=fits, plan=plan,
                          hopper=hopper)
    return _expert_kernels(kind, n, k, plan=chosen, target=tgt, mx=mx, dtype=dt,
                           w_dtype=None if mx != "none" else tt_dtype(w_dtype), out_dtype=tt_dtype(out_dtype),
                           act=act, num_experts=num_experts, top_k=top_k, ir_op=ir_op, loc=loc,
                           interpret=interpreted(a))


def _dequant_run(ks, dq, a, weights, off, *tail, el, n, k, slots, binding: Binding | None = None):
    """The dequant path: per chunk of experts that fits DEQUANT_WORKSPACE_BYTES, the packed stacks to bf16 (one
    streaming kernel `dq` each), then the bf16 grouped GEMM `ks` on those experts' tiles. The stream orders the
    workspace's reuse; experts without rows are skipped by the dequant kernel and have no tiles."""
    pairs = list(zip(weights[0::2], weights[1::2]))
    per_expert = n * k * a.element_size() * len(pairs)
    chunk = max(1, min(el, _kmoe.DEQUANT_WORKSPACE_BYTES // per_expert))
    ws = [torch.empty(chunk, n, k, dtype=a.dtype, device=a.device) for _ in pairs]
    routed = "E0" in ks.signature
    bm = ks.constexprs["BLOCK_M"]
    rows_off = off if routed else torch.tensor([0, 1], dtype=torch.int32, device=a.device)
    for e0 in range(0, el, chunk):
        e1 = min(el, e0 + chunk)
        for (p, s), w in zip(pairs, ws):
            launch(dq, p, s, rows_off, w, e0, e1, binding=binding)
        if not routed:
            launch(ks, a, *ws, *tail, binding=binding)
        elif interpreted(a):
            t_off = off[1 + ROW_BUCKETS.index(bm)]
            launch(ks, a, *ws, off, *tail, int(t_off[e1] - t_off[e0]), e0, e1, binding=binding)
        else:
            launch(ks, a, *ws, off, *tail, tile_slots(slots, e1 - e0, bm), e0, e1, binding=binding)


def grouped_gemm(kind: str, a: torch.Tensor, weights: list[torch.Tensor], off: torch.Tensor, perm: torch.Tensor, *,
                 top_k: int, mx: str = "none", act=None, slots: int | None = None, plan=None,
                 ir_op: str = "", loc: str = "", layout: str = "canonical",
                 binding: Binding | None = None) -> torch.Tensor:
    """kind gate_up: a = z [T, K] (rows gathered through perm), weights [w1, w3] (bf16 [EL, M, K]) or
    [w1 packed, w1 scale, w3 packed, w3 scale]; returns h [S, M] in permuted order. kind down: a = h [S, K],
    weights [w2] or [packed, scale]; returns y [S, Z] in slot order. S = T * k (slots). layout: the MXFP4 stacks'
    layout (weight_layout.EXPERT_LAYOUTS: "hopper" runs the hopper form, upcast only)."""
    el = weights[0].shape[0]
    n = weights[0].shape[1]
    k = a.shape[-1]
    if mx != "none" and weights[0].shape[2] * 2 != k:
        raise CodegenError(f"packed weight {tuple(weights[0].shape)} does not match K = {k}")
    S = slots if slots is not None else (a.shape[0] * top_k if kind == "gate_up" else a.shape[0])
    rows = -(-S // max(1, el))
    ks, dq = _gemm_ks(kind, n, k, rows, a, weights[0].dtype, mx, el, top_k, act if kind == "gate_up" else None,
                      a.dtype, plan, ir_op or f"moe_{kind}", loc, scales=weights[1::2] if mx != "none" else (),
                      hopper=layout == "hopper", binding=binding)
    out = torch.empty(S, n, dtype=a.dtype, device=a.device)
    if dq is not None:
        _dequant_run(ks, dq, a.contiguous(), [t.contiguous() for t in weights], off, perm, out, el=el, n=n, k=k,
                     slots=S, binding=binding)
        return out
    bm = ks.constexprs["BLOCK_M"]
    if interpreted(a):      # the interpreter pays for every program, also those that exit: count the tiles exactly
        tiles = int(off[1 + ROW_BUCKETS.index(bm), -1])
    else:               # no host sync on a GPU: an upper bound, the programs past the last tile exit
        tiles = tile_slots(S, el, bm)
    launch(ks, a.contiguous(), *[t.contiguous() for t in weights], off, perm, out, tiles, binding=binding)
    return out


def mx_linear(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *, mx: str | None = None, plan=None,
              ir_op: str = "mx_linear", loc: str = "", binding: Binding | None = None) -> torch.Tensor:
    """a [..., K] @ W^T for an MXFP4 weight W [N, K] held as packed u8 [N, K/2] + E8M0 scales u8 [N, K/32]: the
    dense variant of the grouped template (native tl.dot_scaled on MX targets, upcast elsewhere)."""
    tgt = target_of(binding, a.device)
    mx = mx or ("e4m3" if tgt.native_mxfp4 else "upcast")
    a2 = a.reshape(-1, a.shape[-1]).contiguous()
    M, K = a2.shape
    N = packed.shape[0]
    ks, dq = _gemm_ks("dense", N, K, M, a2, torch.uint8, mx, 1, 1, None, a.dtype, plan, ir_op, loc,
                      scales=[scale], binding=binding)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    w = [packed.reshape(N, K // 2).contiguous(), scale.reshape(N, K // 32).contiguous()]
    if dq is not None:      # a dequant plan: bf16 weight, then the dense GEMM
        _dequant_run(ks, dq, a2, w, None, out, M, el=1, n=N, k=K, slots=M, binding=binding)
    else:
        launch(ks, a2, *w, out, M, binding=binding)
    return out.view(*a.shape[:-1], N)


def combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor | None = None, *,
            top_k: int, num_experts: int, ep_rank: int = 0, ep_size: int = 1, ir_op: str = "moe_combine",
            loc: str = "", binding: Binding | None = None) -> torch.Tensor:
    """u [N, Z] = sum_j weights[:, j] y[t k + j] (+ residual), fp32 inside, y's dtype out."""
    tgt = target_of(binding, y.device)
    Z = y.shape[-1]
    y2 = y.reshape(-1, Z).contiguous()
    N = y2.shape[0] // top_k
    el = num_experts // ep_size
    ks = _emit_combine(Z, top_k, target=tgt, dtype=tt_dtype(y.dtype), residual=residual is not None,
                       e_local=el if ep_size > 1 else None, e0=ep_rank * el, ir_op=ir_op, loc=loc,
                       interpret=interpreted(y))
    out = torch.empty(N, Z, dtype=y.dtype, device=y.device)
    extra = [ids.reshape(N, top_k).contiguous()] if ep_size > 1 else []
    if residual is not None:
        extra.append(residual.reshape(N, Z).to(y.dtype).contiguous())
    launch(ks, y2, weights.reshape(N, top_k).contiguous(), *extra, out, N, binding=binding)
    return out


# ---- the IR ops: kernel implementations ---------------------------------------------------------------------------
def _mx(a, t: torch.Tensor, cache) -> str:
    """The op's MX mode for this call (mx "auto": decided by the target its binding plans for)."""
    return mx_mode(a.get("expert_format", "bf16"), target_of(call_binding(cache), t.device), a.get("act_format"),
                   a["mx"])


def _layout(a) -> str:
    """The op's expert stack layout (expert_layout attr: weight_prep rewrote the stacks into it)."""
    return a.get("expert_layout", "canonical")


def _experts(a, w, names):
    if a.get("expert_format", "bf16") == "mxfp4":
        return [w[f"experts.{n}.{p}"] for n in names for p in ("weight_packed", "weight_scale")]
    return [w[f"experts.{n}"] for n in names]


def linear(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, *, binding: Binding | None = None) -> torch.Tensor:
    """x [..., K] W[N, K]^T (+ residual) through the MoE layer's own GEMM kernels (emit_moe_linear)."""
    tgt = target_of(binding, x.device)
    N, K = w.shape
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    odt = out_dtype or x.dtype
    ks = _emit_linear(N, K, target=tgt, m_hint=m_bucket(M), dtype=tt_dtype(x.dtype), w_dtype=tt_dtype(w.dtype),
                      out_dtype=tt_dtype(odt), residual=residual is not None, interpret=interpreted(x))
    out = torch.empty(M, N, dtype=odt, device=x.device)
    extra = [residual.reshape(M, N).contiguous()] if residual is not None else []
    launch(ks, x2, w.contiguous(), *extra, out, M, binding=binding)
    return out.view(*x.shape[:-1], N)


def launch_moe_linear(a, cache, data, w):
    res = data[1] if a.get("residual") else None
    return linear(data[0], w["weight"], res, torch.float32 if a.get("out_f32") else None,
                  binding=call_binding(cache))


def launch_moe_route(a, cache, data, w):
    lg = data[0]
    lead = lg.shape[:-1]
    k = a["top_k"]
    wt, ids, off, perm = route(lg, w.get("gate.e_score_correction_bias"), top_k=k,
                               router_activation=a["router_activation"], renormalize=a["renormalize"],
                               scaling=a["routed_scaling_factor"], ep_rank=a.get("ep_rank", 0),
                               ep_size=a.get("ep_size", 1), binding=call_binding(cache))
    return wt.view(*lead, k), ids.view(*lead, k), off, perm.view(*lead, k)


def launch_moe_gate_up(a, cache, data, w):
    z, off, perm = data
    k = a["top_k"]
    z2 = z.reshape(-1, z.shape[-1])
    h = grouped_gemm("gate_up", z2, _experts(a, w, ("w1", "w3")), off, perm.reshape(-1), top_k=k, mx=_mx(a, z, cache),
                     act=ActivationSpec.from_attrs(a), ir_op="moe_gate_up", layout=_layout(a),
                     binding=call_binding(cache))
    return h.view(*z.shape[:-1], k, h.shape[-1])


def launch_moe_down(a, cache, data, w):
    h, off, perm = data
    y = grouped_gemm("down", h.reshape(-1, h.shape[-1]), _experts(a, w, ("w2",)), off, perm.reshape(-1),
                     top_k=a["top_k"], mx=_mx(a, h, cache), ir_op="moe_down", layout=_layout(a),
                     binding=call_binding(cache))
    return y.view(*h.shape[:-1], y.shape[-1])


def launch_moe_combine(a, cache, data, w):
    y, wt, ids = data[:3]
    res = data[3] if a.get("residual") else None
    u = combine(y, wt, ids, res, top_k=a["top_k"], num_experts=a["num_experts"], ep_rank=a.get("ep_rank", 0),
                ep_size=a.get("ep_size", 1), binding=call_binding(cache))
    return u.view(*y.shape[:-2], y.shape[-1])


# ---- torch implementations (the per-op check's reference) ---------------------------------------------------------
def _dequant(a, w, name, dtype):
    if a.get("expert_format", "bf16") == "mxfp4":
        p, s = w[f"experts.{name}.weight_packed"], w[f"experts.{name}.weight_scale"]
        if _layout(a) == "hopper":      # read back to k3c.quant's layout (bit for bit)
            p, s = from_hopper(p), from_hopper_scales(s)
        return mxfp4_dequantize(p, s, dtype)
    return w[f"experts.{name}"]


def act_quantized(x: torch.Tensor, mx: str) -> torch.Tensor:
    """What the native MX kernels feed the matrix units: activations quantized per 32 (OCP floor rule)."""
    if mx == "e4m3":
        return mxfp8_dequantize(*mxfp8_quantize(x), x.dtype)
    if mx == "e2m1":
        return mxfp4_dequantize(*mxfp4_quantize(x), x.dtype)
    return x


def torch_moe_linear(a, cache, data, w):
    x = data[0]
    y = ref.linear(acc(x), acc(w["weight"])) if a.get("out_f32") else ref.linear(x, w["weight"])
    return y + data[1] if a.get("residual") else y


def torch_route(logits, bias, *, top_k, router_activation, renormalize, scaling, ep_rank=0, ep_size=1):
    lg = logits.reshape(-1, logits.shape[-1]).float()
    N, E = lg.shape
    s = torch.sigmoid(lg) if router_activation == "sigmoid" else torch.softmax(lg, dim=-1)
    choice = s + bias.float() if bias is not None else s
    idx = routing_replay.replayed_ids(torch.topk(choice, top_k, dim=-1).indices)
    p = ref.routed_weights(s, idx, renormalize, scaling)
    el, e0 = E // ep_size, ep_rank * (E // ep_size)
    flat = idx.reshape(-1) - e0
    local = (flat >= 0) & (flat < el)
    slots = torch.arange(flat.numel(), device=lg.device)[local]
    order = torch.argsort(flat[local], stable=True)
    perm = torch.full((flat.numel(),), -1, dtype=torch.int32, device=lg.device)
    perm[:order.numel()] = slots[order].to(torch.int32)
    counts = torch.bincount(flat[local], minlength=el)
    off = torch.zeros(1 + len(ROW_BUCKETS), el + 1, dtype=torch.int32, device=lg.device)
    for i, div in enumerate((1,) + ROW_BUCKETS):
        off[i, 1:] = torch.cumsum((counts + div - 1) // div, 0).to(torch.int32)
    return p, idx.to(torch.int32), off, perm


def torch_moe_route(a, cache, data, w):
    lg = data[0]
    k = a["top_k"]
    p, ids, off, perm = torch_route(lg, w.get("gate.e_score_correction_bias"), top_k=k,
                                    router_activation=a["router_activation"], renormalize=a["renormalize"],
                                    scaling=a["routed_scaling_factor"], ep_rank=a.get("ep_rank", 0),
                                    ep_size=a.get("ep_size", 1))
    lead = lg.shape[:-1]
    return p.view(*lead, k), ids.view(*lead, k), off, perm.view(*lead, k)


def _segments(off: torch.Tensor):
    o = off[0].tolist()
    return [(e, o[e], o[e + 1]) for e in range(len(o) - 1) if o[e + 1] > o[e]]


def torch_moe_gate_up(a, cache, data, w):
    z, off, perm = data
    k = a["top_k"]
    z2 = z.reshape(-1, z.shape[-1])
    w1, w3 = _dequant(a, w, "w1", z.dtype), _dequant(a, w, "w3", z.dtype)
    flat = perm.reshape(-1).long()
    h = torch.zeros(flat.numel(), w1.shape[1], dtype=z.dtype, device=z.device)
    act = ActivationSpec.from_attrs(a)
    for e, lo, hi in _segments(off):
        zs = act_quantized(z2[flat[lo:hi] // k], _mx(a, z, cache))
        h[lo:hi] = ref.glu_act(ref.linear(zs, w1[e]), ref.linear(zs, w3[e]), act)
    return h.view(*z.shape[:-1], k, w1.shape[1])


def torch_moe_down(a, cache, data, w):
    h, off, perm = data
    h2 = h.reshape(-1, h.shape[-1])
    w2 = _dequant(a, w, "w2", h.dtype)
    flat = perm.reshape(-1).long()
    y = torch.zeros(h2.shape[0], w2.shape[1], dtype=h.dtype, device=h.device)
    for e, lo, hi in _segments(off):
        y[flat[lo:hi]] = ref.linear(act_quantized(h2[lo:hi], _mx(a, h, cache)), w2[e])
    return y.view(*h.shape[:-1], w2.shape[1])


def torch_moe_combine(a, cache, data, w):
    y, wt, ids = data[:3]
    el = a["num_experts"] // a.get("ep_size", 1)
    e0 = a.get("ep_rank", 0) * el
    local = ((ids >= e0) & (ids < e0 + el)).unsqueeze(-1)
    u = torch.where(local, acc(y) * wt.unsqueeze(-1), 0.0).sum(-2)
    if a.get("residual"):
        u = u + acc(data[3])
    return u.to(y.dtype)


KERNEL_IMPLS = {"moe_linear": launch_moe_linear, "moe_route": launch_moe_route, "moe_gate_up": launch_moe_gate_up,
                "moe_down": launch_moe_down, "moe_combine": launch_moe_combine}
TORCH_IMPLS = {"moe_linear": torch_moe_linear, "moe_route": torch_moe_route, "moe_gate_up": torch_moe_gate_up,
               "moe_down": torch_moe_down, "moe_combine": torch_moe_combine}

__all__ = ["linear", "route", "grouped_gemm", "mx_linear", "combine", "torch_route", "row_bucket",
           "scales_fit_one_mul", "act_quantized", "KERNEL_IMPLS", "TORCH_IMPLS"]
