"""Tensor x expert parallel execution on torch.distributed (docs/distributed.md): process groups, the collectives
the IR's all_reduce / all_gather / sequence-parallel ops call, and per-rank weights. The rank launcher (one
process per rank, `k3c run --tp N --ep M`) is k3c/commands/ranks.py.

Ranks: world = max(tp, ep); TP groups and EP groups are blocks of consecutive ranks (k3c.passes.shard.Layout).
Without an initialised process group (or with a group of one rank) the collectives are identity, so a sharded
graph of one rank, or an unsharded graph, runs in a plain process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import ArgumentError, UserError, WeightError


# ---- process groups and collectives ------------------------------------------------------------------------------
@dataclass
class DistState:
    """The groups of this process: "tp" and "ep" -> ProcessGroup; time spent in collectives (for bench/dist.py)."""
    groups: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    calls: int = 0
    timing: bool = False          # synchronise around each collective to time it (benchmarks only)
    seq: tuple[int, int] | None = None   # sequence parallel in this forward: (tokens T, tokens per rank) or off
    seq_rank: int = 0             # which block of tokens this rank holds when `seq` is set


_STATE = DistState()


def state() -> DistState:
    return _STATE


def init_groups(tp: int, ep: int) -> DistState:
    """Create this process's TP and EP groups (every rank must call it, in the same order); torch.distributed must
    be initialised with world size max(tp, ep)."""
    import torch.distributed as dist

    from ..passes.shard import make_layout

    world = dist.get_world_size()
    lay = make_layout(tp, ep, dist.get_rank())
    if world != lay.world:
        raise ArgumentError(f"--tp {tp} --ep {ep} need {lay.world} processes, torch.distributed has {world}")
    groups: dict[str, Any] = {}
    for name, size in (("tp", tp), ("ep", ep)):
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            g = dist.new_group(ranks) if size < world else dist.group.WORLD
            if lay.rank in ranks:
                groups[name] = g
    _STATE.groups, _STATE.sizes = groups, {"tp": tp, "ep": ep}
    _STATE.seconds, _STATE.calls = 0.0, 0
    return _STATE


def reset_groups() -> None:
    _STATE.groups, _STATE.sizes = {}, {}


def _group(name: str, size: int):
    """The process group for an IR collective; None = identity (one rank). A size that disagrees with the groups
    this process made means the graph was compiled for another layout."""
    if size == 1:
        return None
    g = _STATE.groups.get(name)
    if g is None:
        raise UserError(f"the graph needs a '{name}' group of {size} ranks but none is initialised: run it through "
                        "k3c.commands.ranks (k3c run --tp/--ep, or torchrun)")
    if _STATE.sizes.get(name) != size:
        raise UserError(f"the graph was compiled for {name} = {size}, the process groups have "
                        f"{name} = {_STATE.sizes.get(name)}")
    return g


def _timed(fn: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if not _STATE.timing:
        _STATE.calls += 1
        return fn()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    out = fn()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    _STATE.seconds += time.perf_counter() - t0
    _STATE.calls += 1
    return out


def all_reduce(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """Sum over the group (a new tensor; the input is not modified)."""
    g = _group(group, size)
    if g is None:
        return x
    import torch.distributed as dist

    def run():
        y = x.contiguous().clone()
        dist.all_reduce(y, group=g)
        return y
    return _timed(run, x)


def all_gather(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    """Concat over the group along dim, in rank order."""
    g = _group(group, size)
    if g is None:
        return x
    import torch.distributed as dist

    def run():
        xs = x.movedim(dim, 0).contiguous()
        out = xs.new_empty((size * xs.shape[0],) + tuple(xs.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, xs, group=g)
        return out.movedim(0, dim)
    return _timed(run, x)


# ---- sequence parallel: the token dim split over the TP group during prefill -----------------------------------------
def _pad_tokens(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    pad = list(x.shape)
    pad[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad)], dim=dim)


def seq_scatter(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    """This rank's block of tokens. Decides for the whole forward: split when T >= size (T padded with zero tokens
    up to a multiple of size: per-token ops keep zeros harmless, seq_gather drops them), else every rank keeps all
    T (decode) and the other sequence ops fall back to identity / all_reduce. Every rank sees the same T."""
    g = _group(group, size)
    if g is None:
        return x
    import torch.distributed as dist

    t = x.shape[dim]
    if t < size:
        _STATE.seq = None
        return x
    chunk = -(-t // size)
    r = dist.get_rank(g)
    _STATE.seq, _STATE.seq_rank = (t, chunk), r
    return _pad_tokens(x, dim, chunk * size).narrow(dim, r * chunk, chunk).contiguous()


def reduce_scatter(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    """Sum over the group, keeping this rank's tokens (all_reduce when the forward is not split)."""
    if _group(group, size) is None:
        return x
    if _STATE.seq is None:
        return all_reduce(x, group, size)
    import torch.distributed as dist

    t, chunk = _STATE.seq
    g = _group(group, size)

    def run():
        xs = _pad_tokens(x, dim, chunk * size).movedim(dim, 0).contiguous()
        out = xs.new_empty((chunk,) + tuple(xs.shape[1:]))
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, xs, group=g)
        return out.movedim(0, dim)
    return _timed(run, x)


def seq_gather(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    """Every rank's tokens in rank order, padding dropped (identity when the forward is not split)."""
    if _group(group, size) is None or _STATE.seq is None:
        return x
    t, _ = _STATE.seq
    return all_gather(x, group, size, dim).narrow(dim, 0, t)


# ---- per-rank weights ----------------------------------------------------------------------------------------------
def param_shards(compiled) -> dict[str, tuple[int, int, int] | None]:
    """Canonical weight name -> (dim, rank, size) of this rank's slice, None = whole tensor, for every weight the
    graph reads, as the `shard` pass annotated them (read from the IR right after it: later passes may rename or
    repack params, e.g. mxfp4; those are derived from the canonical slices at load)."""
    from ..passes.shard import parse_shard

    stage = compiled.module_after("shard") if any(n == "shard" for n, _ in compiled.stages) else compiled.module
    out: dict[str, tuple[int, int, int] | None] = {}
    for op in stage.ops:
        if op.op == "param":
            s = parse_shard(op.attr("shard", "") or "")
            out[op.attr("name")] = None if s is None else (s[1], s[2], s[3])
    return out


def slice_of(t: torch.Tensor, shard: tuple[int, int, int] | None) -> torch.Tensor:
    if shard is None:
        return t
    dim, rank, size = shard
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n).contiguous()


def shard_weights(compiled, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's slices of full weights (small models and tests: the full dict is already in memory)."""
    out = {}
    for name, shard in param_shards(compiled).items():
        if name not in weights:
            raise WeightError(f"weight '{name}' is missing")
        out[name] = slice_of(weights[name], shard)
    return out


def init_sharded_weights(compiled, seed: int = 0, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Random weights of this rank only, equal to the slices of k3c.init_weights(spec, seed, device=device): each
    full tensor is generated from its own (seed, name) generator and cut at once, so a rank holds at most one full
    tensor beyond its slices (never the whole model). On a GPU every rank draws the same full tensors. Stacks the
    graph reads as MXFP4 are quantized as they are drawn (what load would do), so the float copies of all expert
    stacks never coexist (59 GB in bf16 at k3-wide, twice that in fp32)."""
    from ..frontend.weight_names import model_weights
    from .weight_prep import quantize_stack
    from .weights import _generator, _init_one

    shards = param_shards(compiled)
    rules = {op.attr("source"): op.attr("rule", "floor") for op in compiled.module.ops
             if op.op == "param" and op.attr("quant", None) == "mxfp4"}
    out = {}
    for info in model_weights(compiled.spec):
        if info.name not in shards and info.name not in rules:     # unsharded graphs list packed names only
            continue
        t = slice_of(_init_one(compiled.spec, info, _generator(seed, info.name, device)), shards.get(info.name))
        t = t if info.dtype == "fp32" else t.to(dtype)
        if info.name in rules:
            from ..ir.mxfp4_weights import packed_name

            out[packed_name(info.name, "weight_packed")], out[packed_name(info.name, "weight_scale")] = \
                quantize_stack(info.name, t, rules[info.name])
        else:
            out[info.name] = t
    return out


def load_sharded_weights(compiled, path: str, dtype=None) -> dict[str, torch.Tensor]:
    """This rank's slices read from a safetensors checkpoint: only the slice bytes are read (safe_open.get_slice)."""
    from .checkpoint import load_weight_slices

    return load_weight_slices(compiled.spec, path, param_shards(compiled), dtype=dtype)
