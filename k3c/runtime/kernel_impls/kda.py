"""KDA runtime: launch wrappers of the generated KDA kernels (k3c.codegen.kernels.kda), the kernel implementations
of the kda-chunk pass's ops (impl="kernel") and their torch implementations (any other impl: the reference).

Wrappers (tensors on any device; CPU runs through the Triton interpreter):
    kda_prep(xq, xk, xv, xf, xb, conv_w, a_log, dt_bias, tails, cu, ...) -> ((qkv [total, 3HD], g|beta fp32
                                                                           [total, HD+H]), new tails)
    kda_chunk(q, k, v, g, beta, cu, initial_state, ...)                 -> (o [total, H, D], final state fp32)
    kda_decode(xq, xk, xv, xf, xb, xg, conv_w, a_log, dt_bias, o_norm_w, tails, state, ...) -> y [B, H*D]
    kda_out(o, gate, o_norm_w, eps)                                      -> y [M, H*D]
Tensors are token-major: [total tokens, H*D] with sequences packed by `cu` (int32 starts, length N + 1).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ...codegen.kernels.kda import (DECODE_NORM_EPS, emit_kda_inter, emit_kda_intra, emit_kda_out,
                                    inter_dtype, kda_plan, prep_qkv_dtype, run_dot)
from ...codegen.kernels.kda_decode_hopper import decode_kernel
from ...codegen.kernels.kda_prep_hopper import prep_kernel
from ...codegen.tiers import PORTABLE
from ...codegen.writer import CodegenError
from ...frontend.spec import KDASpec
from ... import reference as ref
from ...reference.kda import KDAState
from ...reference.norms import acc
from ..caches.kda_rollback import step_tokens, traced
from ..caches.context import call_binding
from ..devices import TT_TO_TORCH, interpreted, torch_dtype, tt_dtype
from ..launcher import Binding, launch, target_of, tier_fallback
from .basic import gemm

_emit_prep = functools.lru_cache(maxsize=128)(prep_kernel)
_emit_intra = functools.lru_cache(maxsize=128)(emit_kda_intra)
_emit_inter = functools.lru_cache(maxsize=128)(emit_kda_inter)
_emit_decode = functools.lru_cache(maxsize=128)(decode_kernel)
_emit_out = functools.lru_cache(maxsize=128)(emit_kda_out)


def _c(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def cu_seqlens(lengths, device) -> torch.Tensor:
    """int32 sequence starts [N + 1] from a list of lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
def _equal_cu(t: int, b: int, device) -> torch.Tensor:
    """cu_seqlens of b sequences of t tokens, made once per shape: a call captured in a CUDA graph (multi-token
    verification, runtime/cuda_graph.py) may not copy from the host, and its warm-up runs create it first."""
    return cu_seqlens([t] * b, device)


def _plan(head_dim: int, dtype: torch.dtype, tgt, chunk=None, block_v=None, dot=None, chunk_warps=None,
          **overrides):
    overrides = {k_: v_ for k_, v_ in overrides.items() if v_ is not None}
    return kda_plan(head_dim, tt_dtype(dtype), tgt, chunk=chunk, block_v=block_v, dot=dot,
                    chunk_warps=chunk_warps, **overrides)


def kda_prep(xq, xk, xv, xf, xb, conv_w, a_log, dt_bias, tails, cu, *, num_heads: int, head_dim: int, gate: str,
             gate_lower_bound: float, l2norm_eps: float, max_len: int, qkv_dtype=torch.float32,
             block_t: int | None = None, tier: str | None = None, binding: Binding | None = None,
             ir_op: str = "kda_attn", loc: str = ""):
    """Projections [total, H*D] (xb [total, H]), conv_w (q, k, v) each [H*D, 1, KW] or [H*D, KW], tails (q, k, v) each
    [N, H*D, KW-1] or None (zeros). Returns ((qkv [total, 3HD] in qkv_dtype, g|beta [total, HD+H] fp32), new tails);
    `unpack` gives the q, k, v, g, beta views. `block_t` (tokens per program) overrides the plan's and `tier`
    ("hopper": kda_prep_hopper.py's Gluon kernel, opt-in) the portable kernel, for benches and tests."""
    H, D = num_heads, head_dim
    dt = xq.dtype
    total, N = xq.shape[0], cu.numel() - 1
    kw = conv_w[0].shape[-1]
    tgt = target_of(binding, xq.device)
    ks = _emit_prep(H, D, kw, gate=gate, gate_lower_bound=float(gate_lower_bound), l2norm_eps=float(l2norm_eps),
                    target=tgt, dtype=tt_dtype(dt), qkv_dtype=tt_dtype(qkv_dtype), block_t=block_t, tier=tier,
                    ir_op=ir_op, loc=loc, interpret=interpreted(xq))
    if tails is None:
        z = torch.zeros(N, H * D, kw - 1, dtype=dt, device=xq.device)
        tails = (z, z, z)
    new = tuple(torch.empty(N, H * D, kw - 1, dtype=dt, device=xq.device) for _ in range(3))
    qkv = torch.empty(total, 3 * H * D, dtype=qkv_dtype, device=xq.device)
    gb = torch.empty(total, H * D + H, dtype=torch.float32, device=xq.device)
    ws = [_c(w_.reshape(H * D, kw), dt) for w_ in conv_w]
    launch(ks, _c(xq), _c(xk, dt), _c(xv, dt), _c(xf, dt), _c(xb, dt), *ws, _c(a_log, torch.float32),
           _c(dt_bias, torch.float32), *(_c(t, dt) for t in tails), *new, qkv, gb, _c(cu, torch.int32), N,
           int(max_len), binding=binding)
    return (qkv, gb), new


def unpack(packed, num_heads: int, head_dim: int):
    """Views (q, k, v [total, H, D] at token stride 3HD, g [total, H, D] and beta [total, H] at token stride HD+H) of
    kda_prep's (qkv, g|beta) rows."""
    qkv, gb = packed
    H, D = num_heads, head_dim
    HD = H * D
    q, k, v = (qkv[:, i * HD:(i + 1) * HD].unflatten(-1, (H, D)) for i in range(3))
    return q, k, v, gb[:, :HD].unflatten(-1, (H, D)), gb[:, HD:]


def kda_chunk(q, k, v, g, beta, cu, initial_state=None, **kw):
    """q, k, g [total, H, D], v [total, H, D], beta [total, H] (token rows may be strided views with head stride D
    / 1), cu int32 [N + 1], initial_state [N, H, D, D] fp32 or None. Returns (o [total, H, D], final state).
    Two kernels: intra-chunk, then state passing. Keywords: kda_chunk_launches'."""
    intra, inter, o, sT = kda_chunk_launches(q, k, v, g, beta, cu, initial_state, **kw)
    intra()
    inter()
    return o, sT


def kda_chunk_launches(q, k, v, g, beta, cu, initial_state=None, *, scale: float | None = None,
                       out_dtype=torch.float32, chunk: int | None = None, block_v: int | None = None,
                       dot: str | None = None, chunk_warps: int | None = None, intra_warps: int | None = None,
                       inter_tier: str | None = None, inter_k_split: int | None = None,
                       max_len: int | None = None, final_state: torch.Tensor | None = None,
                       checkpoints: torch.Tensor | None = None,
                       binding: Binding | None = None, ir_op: str = "kda_attn", loc: str = ""):
    """kda_chunk's two launches, unlaunched: (intra(), inter(), o, final state); the outputs are filled once both
    ran (benchmarks time each kernel alone). max_len: the longest sequence (the intra kernel's grid; computed from
    cu, a device sync, when not given); chunk .. intra_warps, inter_tier ("hopper": the Gluon state-passing
    kernel, opt-in) and inter_k_split override the target's plan (benchmarks, tests). checkpoints: int32 [N, C]
    (C <= MAX_CHECKPOINTS) token offsets into each sequence, multiples of the plan's chunk, -1 for none: the final
    state is then (the state at the end, the states after those offsets [N, C, H, D, D]) (the portable state
    passing writes them; a checkpoint the caller did not fill is left unwritten)."""
    total, H, D = q.shape
    N = cu.numel() - 1
    for name, t, hs in (("q", q, D), ("k", k, D), ("v", v, D), ("g", g, D)):
        if t.shape != (total, H, D) or t.stride(2) != 1 or t.stride(1) != hs:
            raise CodegenError(f"kda_chunk: {name} must be [total, H, D] rows with head stride D, got "
                               f"{tuple(t.shape)} strides {t.stride()}")
    if beta.shape != (total, H) or beta.stride(1) != 1:
        raise CodegenError(f"kda_chunk: beta must be [total, H] with unit head stride, got {tuple(beta.shape)}")
    tgt = target_of(binding, q.device)
    plan = _plan(D, q.dtype, tgt, chunk, block_v, dot, chunk_warps, intra_warps=intra_warps, inter_tier=inter_tier,
                 inter_k_split=inter_k_split)
    has_s0 = initial_state is not None
    interp = interpreted(q)
    o = torch.empty(total, H, D, dtype=out_dtype, device=q.device)
    sT = final_state if final_state is not None else torch.empty(N, H, D, D, dtype=torch.float32, device=q.device)
    s0 = _c(initial_state, torch.float32) if has_s0 else sT
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    cu = _c(cu, torch.int32)
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max().item()) if N > 0 else 0
    BT = plan.chunk
    idt = torch_dtype(inter_dtype(plan.dot))
    ki = _emit_intra(H, D, target=tgt, qk_dtype=tt_dtype(q.dtype), g_dtype=tt_dtype(g.dtype),
                     beta_dtype=tt_dtype(beta.dtype), scale=scale, plan=plan, ir_op=ir_op, loc=loc, interpret=interp)
    ck = 0 if checkpoints is None else checkpoints.shape[1]
    if ck:
        if checkpoints.shape[0] != N or checkpoints.dtype != torch.int32:
            raise CodegenError(f"kda_chunk: checkpoints must be int32 [N={N}, C], got {checkpoints.dtype} "
                               f"{tuple(checkpoints.shape)}")
        plan = replace(plan, inter_tier=PORTABLE, inter_k_split=1)     # the tier that writes them
    kx = _emit_inter(H, D, target=tgt, v_dtype=tt_dtype(v.dtype), o_dtype=tt_dtype(out_dtype), plan=plan,
                     has_initial_state=has_s0, checkpoints=ck, ir_op=ir_op, loc=loc, interpret=interp)
    if plan.inter_tier != PORTABLE and tier_fallback(kx, q.device, binding):   # neither loadable nor buildable here
        kx = _emit_inter(H, D, target=tgt, v_dtype=tt_dtype(v.dtype), o_dtype=tt_dtype(out_dtype),
                         plan=replace(plan, inter_tier=PORTABLE, inter_k_split=1), has_initial_state=has_s0,
                         ir_op=ir_op, loc=loc, interpret=interp)
    kqd = torch.empty(3, total, H, D, dtype=idt, device=q.device)      # K e^Gamma, Q e^Gamma, K e^(Gamma_C - Gamma)
    at = torch.empty(2, total, H, BT, dtype=idt, device=q.device)      # A_qk, T diag(beta)
    eg = torch.empty(total // BT + N + 1, H, D, dtype=torch.float32, device=q.device)

    def intra():
        launch(ki, q, k, g, beta, kqd[0], kqd[1], kqd[2], at[0], at[1], eg, cu, q.stride(0), k.stride(0),
               g.stride(0), beta.stride(0), N, int(max_len), binding=binding)

    extra = ()
    if ck:
        sk = torch.empty(N, ck, H, D, D, dtype=torch.float32, device=q.device)
        extra = (_c(checkpoints, torch.int32), sk)

    def inter():
        launch(kx, kqd[0], kqd[1], kqd[2], at[0], at[1], eg, v, o, s0, sT, cu, v.stride(0), N, *extra,
               binding=binding)
    return intra, inter, o, (sT, extra[1]) if ck else sT


def kda_decode(xq, xk, xv, xf, xb, xg, conv_w, a_log, dt_bias, o_norm_w, tails, state, *, num_heads: int,
               head_dim: int, gate: str, gate_lower_bound: float, l2norm_eps: float, norm_eps: float,
               inplace: bool = False, fuse_out: bool = True, decode_block_v: int | None = None,
               decode_warps: int | None = None, decode_split: bool | None = None, decode_tier: str | None = None,
               decode_lanes_k: int | None = None, ir_op: str = "kda_attn",
               loc: str = "", out: KDAState | None = None, binding: Binding | None = None):
    """One token per sequence: x* [B, H*D] (xb [B, H]), tails (q, k, v) [B, H*D, KW-1], state [B, H, D, D] fp32.
    Returns (y [B, H*D] = RMSNorm(o) x sigmoid(xg), new tails, new state); with inplace the tails and the state are
    updated in place (and returned); with `out` (a KDAState of contiguous buffers) they are written there. Without
    fuse_out (xg, o_norm_w ignored), y is the fp32 o [B, H*D].
    decode_block_v / decode_warps / decode_split / decode_tier / decode_lanes_k override the target's plan
    (benchmarks, tests)."""
    H, D = num_heads, head_dim
    B = xq.shape[0]
    dt = xq.dtype
    kw = conv_w[0].shape[-1]
    tgt = target_of(binding, xq.device)
    plan = _plan(D, dt, tgt, decode_block_v=decode_block_v, decode_warps=decode_warps,
                 decode_split=decode_split, decode_tier=decode_tier, decode_lanes_k=decode_lanes_k)
    ks = _emit_decode(H, D, kw, gate=gate, gate_lower_bound=float(gate_lower_bound), l2norm_eps=float(l2norm_eps),
                      norm_eps=float(norm_eps), target=tgt, dtype=tt_dtype(dt), plan=plan, fuse_out=fuse_out,
                      ir_op=ir_op, loc=loc, interpret=interpreted(xq))
    tails = tuple(_c(t, dt) for t in tails)
    split = not fuse_out and plan.decode_split and plan.decode_block_v < D
    if inplace:
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise CodegenError("kda_decode inplace needs a contiguous fp32 state")
        # V-split programs all read the q / k tails: those are written out of place, then copied back
        new_tails = tuple(torch.empty_like(t) for t in tails) if split else tails
        new_state = state
    elif out is not None:
        if out.state.dtype != torch.float32 or not all(t.is_contiguous() for t in (out.state, *out.conv)):
            raise CodegenError("kda_decode out= needs contiguous buffers (an fp32 state)")
        new_tails, new_state = tuple(out.conv), out.state
    else:
        new_tails = tuple(torch.empty_like(t) for t in tails)
        new_state = torch.empty(B, H, D, D, dtype=torch.float32, device=xq.device)
    y = torch.empty(B, H * D, dtype=dt if fuse_out else torch.float32, device=xq.device)
    ws = [_c(w_.reshape(H * D, kw), dt) for w_ in conv_w]
    outs = (_c(xg, dt),) if fuse_out else ()
    norm = (_c(o_norm_w, torch.float32),) if fuse_out else ()
    launch(ks, _c(xq), _c(xk, dt), _c(xv, dt), _c(xf, dt), _c(xb, dt), *outs, *ws, _c(a_log, torch.float32),
           _c(dt_bias, torch.float32), *norm, *tails, *new_tails,
           state if inplace else _c(state, torch.float32), new_state, y, B, binding=binding)
    if inplace and split:
        for t, nt in zip(tails, new_tails):
            t.copy_(nt)
        new_tails = tails
    return y, new_tails, new_state


def kda_out(o, gate, o_norm_w, eps: float, *, binding: Binding | None = None, ir_op: str = "kda_out", loc: str = ""):
    """o [M, H, D], gate [M, H*D] -> [M, H*D] in gate's dtype."""
    M, H, D = o.shape
    ks = _emit_out(H, D, norm_eps=float(eps), target=target_of(binding, o.device), dtype=tt_dtype(gate.dtype),
                   o_dtype=tt_dtype(o.dtype), ir_op=ir_op, loc=loc, interpret=interpreted(o))
    y = torch.empty(M, H * D, dtype=gate.dtype, device=o.device)
    launch(ks, _c(o), _c(gate), _c(o_norm_w, torch.float32), y, M, binding=binding)
    return y


# ---- op implementations ----------------------------------------------------------------------------------------
def _state(cache, a, b, dtype, device) -> KDAState:
    st = cache.layers[a["layer"]]
    if st is None:
        st = ref.kda_zero_state(KDASpec.from_attrs(a), b, dtype, device)
    return st


def torch_kda_proj(a, cache, data, w):
    return ref.linear(data[0], w["weight"])


def torch_kda_attn(a, cache, data, w):
    """Eager semantics of kda_attn (the reference's kda_layer between the projections and the output norm); a
    traced call (speculative verification) steps token by token, keeping every token's state."""
    b = data[0].shape[0]
    st = _state(cache, a, b, data[0].dtype, data[0].device)
    if traced(cache) and data[0].shape[1] > 1:
        o, st = step_tokens(cache, a["layer"], data, st, lambda d, s, out: _torch_attn(a, d, w, s))
    else:
        o, st = _torch_attn(a, data, w, st)
    cache.layers[a["layer"]] = st
    return o


def _torch_attn(a, data, w, st: KDAState):
    xq, xk, xv, xf, xb = data
    t = xq.shape[1]
    h, d = a["num_heads"], a["head_dim"]
    feats, tails = [], []
    for x, name, tail in zip((xq, xk, xv), "qkv", st.conv):
        y, nt = ref.short_conv(x, w[f"{name}_conv1d.weight"], tail)
        feats.append(y.unflatten(-1, (h, d)))
        tails.append(nt)
    q, k, v = ref.l2_norm(feats[0], a["l2norm_eps"]), ref.l2_norm(feats[1], a["l2norm_eps"]), acc(feats[2])
    g = ref.kda_gate(xf, w["A_log"], w["dt_bias"], KDASpec.from_attrs(a))
    beta = torch.sigmoid(acc(xb))
    if t == 1:
        o, s = ref.kda_recurrent(q, k, v, g, beta, initial_state=st.state)
    else:
        o, s = ref.kda_chunked(q, k, v, g, beta, initial_state=st.state)
    return o, KDAState(s, tuple(tails))


def torch_kda_out(a, cache, data, w):
    o, gate = data
    y = ref.rms_norm(o, w["o_norm.weight"], a["norm_eps"]) * torch.sigmoid(acc(gate).unflatten(-1, o.shape[-2:]))
    return y.to(gate.dtype).flatten(-2)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def launch_kda_proj(a, cache, data, w):
    return gemm(data[0], w["weight"], ir_op="kda_proj", binding=call_binding(cache))     # the generated GEMM


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy when its address is not 16-byte aligned (a token's slice of [B, T, H] beta is 8 bytes in): the
    compiled kernels assume aligned pointers."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def launch_kda_attn(a, cache, data, w):
    """T = 1: the fused decode kernel (prep + recurrent step + conv tail update; kda_out follows); T > 1: the prep
    kernel, then the chunk kernel; a traced T > 1 call (speculative verification): the decode kernel token by
    token, each token's state written to its own buffer (kda_rollback.step_tokens)."""
    xq = data[0]
    b, t = xq.shape[:2]
    h, d = a["num_heads"], a["head_dim"]
    st = _state(cache, a, b, xq.dtype, xq.device)
    conv_w = tuple(w[f"{p}_conv1d.weight"] for p in "qkv")
    common = dict(num_heads=h, head_dim=d, gate=a["gate"], gate_lower_bound=a["gate_lower_bound"],
                  l2norm_eps=a["l2norm_eps"], binding=call_binding(cache))

    def one(d1, s, out=None):          # one token: (o [B, 1, H, D], the new state; in `out` when given)
        o, tails, new = kda_decode(*(_aligned(x.reshape(b, -1)) for x in d1), None, conv_w, _fp32(w["A_log"]),
                                   _fp32(w["dt_bias"]), None, s.conv, s.state, norm_eps=DECODE_NORM_EPS,
                                   fuse_out=False, out=out, **common)
        return o.view(b, 1, h, d), KDAState(new, tails)

    if t == 1:
        o, st = one(data, st)
    elif traced(cache):
        # token-major storage: each token's [B, ...] inputs are then contiguous, one copy per input and layer instead
        # of one per input and token (the kernel takes contiguous rows)
        data = tuple(x.transpose(0, 1).contiguous().transpose(0, 1) for x in data)
        o, st = step_tokens(cache, a["layer"], data, st, one)
    else:
        flat = [x.reshape(b * t, -1) for x in data]
        cu = _equal_cu(t, b, xq.device)
        dot = run_dot(tt_dtype(xq.dtype), a["dot"])
        packed, tails = kda_prep(*flat, conv_w, _fp32(w["A_log"]), _fp32(w["dt_bias"]), st.conv, cu,
                                 max_len=t, qkv_dtype=TT_TO_TORCH[prep_qkv_dtype(dot)], **common)
        q, k, v, g, beta = unpack(packed, h, d)
        o, s = kda_chunk(q, k, v, g, beta, cu, st.state, chunk=a["chunk"], block_v=min(a["block_v"], d), dot=dot,
                         max_len=t, binding=common["binding"])
        o, st = o.view(b, t, h, d), KDAState(s, tails)
    cache.layers[a["layer"]] = st
    return o


def launch_kda_out(a, cache, data, w):
    o, gate = data
    lead = gate.shape[:-1]
    y = kda_out(o.reshape(-1, a["num_heads"], a["head_dim"]), gate.reshape(-1, gate.shape[-1]),
                w["o_norm.weight"], a["norm_eps"], binding=call_binding(cache))
    return y.view(*lead, gate.shape[-1])


KERNEL_IMPLS = {"kda_proj": launch_kda_proj, "kda_attn": launch_kda_attn, "kda_out": launch_kda_out}
TORCH_IMPLS = {"kda_proj": torch_kda_proj, "kda_attn": torch_kda_attn, "kda_out": torch_kda_out}

__all__ = ["kda_prep", "kda_chunk", "kda_chunk_launches", "kda_decode", "kda_out", "unpack", "cu_seqlens"]
