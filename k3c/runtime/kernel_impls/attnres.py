"""Runtime of the two-phase Block AttnRes ops (k3c/ir/attnres_ops.py): the generated Triton kernels
(k3c/codegen/kernels/attnres.py) and the eager reference form of every op (its torch implementation).

    queries = fold_queries([(proj_0, norm_0), ...])                  # f32 [Q, D]
    s1 = phase1([b_0, ..., b_{N-1}], queries, eps)                   # [Q, *lead, STATS + D] packed (lse, o)
    out = phase2(s1, queries, j, eps, partial=p_old, update=y, weight=gain, norm_eps=1e-5)
          # update given: [2, *lead, D] = (p_old + y, rmsnorm(mix)); else [*lead, D]
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ...codegen.kernels.attnres import (SPLIT_MAX_M, emit_attnres_phase1, emit_attnres_phase1_split,
                                        emit_attnres_phase2)
from ...ir.attnres_ops import STATS
from ...reference.attnres import attn_res_logits, attn_res_query
from ...reference.norms import acc, rms_norm
from ..caches.context import call_binding
from ..devices import interpreted, tt_dtype
from ..launcher import Binding, launch, target_of

# -- packed phase-1 rows --------------------------------------------------------------------------------------------


def lse_view(packed: torch.Tensor) -> torch.Tensor:
    """The lse [Q, *lead] held in the first bytes of every packed row (f32 bits, or the dtype itself when it is
    at least 4 bytes wide)."""
    if packed.element_size() >= 4:
        return packed[..., 0]
    return packed.view(torch.float32)[..., 0]


def pack(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Q, *lead, D] o and [Q, *lead] lse -> [Q, *lead, STATS + D] in dtype."""
    out = torch.zeros(o.shape[:-1] + (STATS + o.shape[-1],), dtype=dtype, device=o.device)
    out[..., STATS:] = o.to(dtype)
    if out.element_size() >= 4:
        out[..., 0] = lse.to(dtype)
    else:
        out.view(torch.float32)[..., 0] = lse.float()
    return out


# -- eager reference of each op (the executor's impl when an op is not impl = "kernel") -----------------------------


def fold_queries(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.stack([attn_res_query(p, n) for p, n in pairs]).float()


def phase1_reference(sources: Sequence[torch.Tensor], queries: torch.Tensor, eps: float) -> torch.Tensor:
    """For every query row j: o_j, lse_j over the sources (attn_res_partial with lse = m + log l), packed."""
    qs = queries.to(acc(sources[0]).dtype)
    cols = [attn_res_logits(sources, q, eps) for q in qs]          # each [..., N]
    s = torch.stack(cols, dim=0)                                   # [Q, ..., N]
    m = s.amax(-1, keepdim=True)
    e = (s - m).exp()
    l = e.sum(-1, keepdim=True)
    a = e / l
    o = sum(a[..., i, None] * acc(v)[None] for i, v in enumerate(sources))
    lse = (m + l.log())[..., 0]
    return pack(o, lse, sources[0].dtype)


def phase2_reference(s1: torch.Tensor, queries: torch.Tensor, query: int, eps: float, *,
                     partial: torch.Tensor | None = None, update: torch.Tensor | None = None,
                     weight: torch.Tensor | None = None, norm_eps: float | None = None) -> torch.Tensor:
    row = s1[query]
    o = row[..., STATS:]
    if partial is None:
        h = o
    else:
        p = partial + update if update is not None else partial
        pf = acc(p)
        lse = acc(lse_view(s1)[query])[..., None]
        q = queries[query].to(pf.dtype)
        s = (pf @ q)[..., None] * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + eps)
        mx = torch.maximum(lse, s)
        w1, w2 = (lse - mx).exp(), (s - mx).exp()
        h = ((w1 * acc(o) + w2 * pf) / (w1 + w2)).to(p.dtype)
    out = rms_norm(h, weight, norm_eps) if weight is not None else h
    if update is not None:
        return torch.stack([p, out])
    return out


def _phase2_call(fn, a: dict, data: tuple, w: dict):
    """`fn` (phase2_reference or the kernel's phase2) on an attn_res_phase2 op's inputs, by its mode."""
    s1, queries, rest = data[0], data[1], data[2:]
    kw = {}
    if a["mode"] == "update":
        kw["partial"], kw["update"] = rest[0], rest[1]
    elif a["mode"] == "source":
        kw["partial"] = rest[0]
    return fn(s1, queries, a["query"], a["eps"], weight=w.get("weight"), norm_eps=a.get("norm_eps"), **kw)


def torch_attn_res_fold_queries(a, cache, data, w):
    return fold_queries([(data[2 * j], data[2 * j + 1]) for j in range(a["num_queries"])])


def torch_attn_res_phase1(a, cache, data, w):
    return phase1_reference(list(data[:-1]), data[-1], a["eps"])


def torch_attn_res_phase2(a, cache, data, w):
    return _phase2_call(phase2_reference, a, data, w)


def torch_attn_res_take(a, cache, data, w):
    return data[0][a["index"]]


# -- kernels ----------------------------------------------------------------------------------------------------------
_emit1 = functools.lru_cache(maxsize=256)(emit_attnres_phase1)
_emit1s = functools.lru_cache(maxsize=256)(emit_attnres_phase1_split)
_emit2 = functools.lru_cache(maxsize=256)(emit_attnres_phase2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def phase1(sources: Sequence[torch.Tensor], queries: torch.Tensor, eps: float, *, target=None,
           binding: Binding | None = None, loc: str = "", split: bool | None = None, **plan) -> torch.Tensor:
    """The packed phase-1 result [Q, *lead, STATS + D] through the generated kernels: for up to SPLIT_MAX_M token
    rows (decode) the decode form, D split across programs with an f32 workspace (allocated here, so safe under
    CUDA-graph capture); else the row-tile form. `split` forces one form; plan keys: block_m, block_d, num_warps,
    scores_warps, and block_ds (decode form only)."""
    x0 = sources[0]
    D, lead = x0.shape[-1], x0.shape[:-1]
    for v in sources:
        if v.shape != x0.shape or v.dtype != x0.dtype:
            raise ValueError(f"attn_res phase1: sources must share shape and dtype, got {v.shape} {v.dtype}")
    Q = queries.shape[0]
    rows = [_rows(v) for v in sources]
    M = rows[0].shape[0]
    out = torch.empty((Q, M, STATS + D), dtype=x0.dtype, device=x0.device)
    tgt = target or target_of(binding, x0.device)
    interp = interpreted(x0)
    block_ds = plan.pop("block_ds", None)
    if split if split is not None else M <= SPLIT_MAX_M:
        k_part, k_fin = _emit1s(D, len(sources), Q, float(eps), target=tgt, dtype=tt_dtype(x0.dtype), loc=loc,
                                interpret=interp, block_ds=block_ds, **plan)
        n = M * len(sources) * k_part.constexprs["NS"]
        ws = torch.empty(n * (k_part.constexprs["QP"] + 1), dtype=torch.float32, device=x0.device)
        wd, wss = ws[:n * k_part.constexprs["QP"]], ws[n * k_part.constexprs["QP"]:]
        launch(k_part, *rows, queries.float().contiguous(), wd, wss, M, binding=binding)
        launch(k_fin, *rows, wd, wss, out, out.view(torch.float32), M, binding=binding)
        return out.view((Q,) + tuple(lead) + (STATS + D,))
    k_scores, k_out = _emit1(D, len(sources), Q, float(eps), target=tgt, dtype=tt_dtype(x0.dtype), loc=loc,
                             interpret=interp, **plan)
    scratch = torch.empty((M, len(sources) + 1, k_scores.constexprs["QP"]), dtype=torch.float32, device=x0.device)
    launch(k_scores, *rows, queries.float().contiguous(), scratch, out.view(torch.float32), M,
           binding=binding)
    launch(k_out, *rows, scratch, out, M, binding=binding)
    return out.view((Q,) + tuple(lead) + (STATS + D,))


def phase2(s1: torch.Tensor, queries: torch.Tensor, query: int, eps: float, *, partial: torch.Tensor | None = None,
           update: torch.Tensor | None = None, weight: torch.Tensor | None = None, norm_eps: float | None = None,
           target=None, binding: Binding | None = None, loc: str = "", out: torch.Tensor | None = None,
           **plan) -> torch.Tensor:
    """Merge + update + RMSNorm through the generated kernel (see module doc for the result)."""
    D = s1.shape[-1] - STATS
    lead = s1.shape[1:-1]
    s1c = s1.contiguous()
    M = s1c[0].numel() // (STATS + D)
    mode = "update" if update is not None else "source" if partial is not None else "none"
    dt = s1.dtype
    tgt = target or target_of(binding, s1.device)
    ks = _emit2(D, float(eps), mode=mode, normed=weight is not None,
                norm_eps=float(norm_eps) if weight is not None else None, target=tgt, dtype=tt_dtype(dt),
                weight_dtype=tt_dtype(weight.dtype) if weight is not None else None, loc=loc,
                interpret=interpreted(s1), **plan)
    shape = ((2,) if mode == "update" else ()) + (M, D)
    if out is None:
        out = torch.empty(shape, dtype=dt, device=s1.device)
    args = [s1c, s1c.view(torch.float32), queries.float().contiguous()]
    if partial is not None:
        args.append(_rows(partial.to(dt)))
    if update is not None:
        args.append(_rows(update.to(dt)))
    if weight is not None:
        args.append(weight.reshape(D).contiguous())
    launch(ks, *args, out, int(query), M, binding=binding)
    return out.view(((2,) if mode == "update" else ()) + tuple(lead) + (D,))


def launch_attn_res_phase1(a, cache, data, w):
    return phase1(list(data[:-1]), data[-1], a["eps"], binding=call_binding(cache))


def launch_attn_res_phase2(a, cache, data, w):
    return _phase2_call(functools.partial(phase2, binding=call_binding(cache)), a, data, w)


# fold_queries and take have no kernel of their own: they run the same way on every path
KERNEL_IMPLS = {"attn_res_phase1": launch_attn_res_phase1, "attn_res_phase2": launch_attn_res_phase2,
                "attn_res_fold_queries": torch_attn_res_fold_queries, "attn_res_take": torch_attn_res_take}
TORCH_IMPLS = {"attn_res_fold_queries": torch_attn_res_fold_queries, "attn_res_phase1": torch_attn_res_phase1,
               "attn_res_phase2": torch_attn_res_phase2, "attn_res_take": torch_attn_res_take}

__all__ = ["fold_queries", "phase1", "phase2", "phase1_reference", "phase2_reference", "pack", "lse_view"]
