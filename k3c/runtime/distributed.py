"""Tensor x expert parallel execution on torch.distributed (docs/distributed.md): process groups, the collectives
the IR's all_reduce / all_gather ops call, per-rank weights, and a launcher (one process per rank).

    k3c run spec.yaml --tp 2 --ep 2                  # spawns max(tp, ep) processes (gloo on CPU, NCCL on GPU)
    torchrun --nproc-per-node 8 -m k3c.cli run spec.yaml --tp 8 --ep 8 --device cuda   # or under torchrun

Ranks: world = max(tp, ep); TP groups and EP groups are blocks of consecutive ranks (k3c.passes.shard.Layout).
Without an initialised process group (or with a group of one rank) the collectives are identity, so a sharded
graph of one rank, or an unsharded graph, runs in a plain process.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
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
                        "k3c.runtime.distributed (k3c run --tp/--ep, or torchrun)")
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


# ---- sequence parallel: the token dim split over the TP group during prefill ------------------------------------------
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


# ---- expert parallel MoE (the un-lowered moe op; moe-lower emits the same schedule as IR) -------------------------
def moe_layer_ep(x: torch.Tensor, w: dict, cfg, act, eps: float, ep_rank: int, ep_size: int) -> torch.Tensor:
    """(Latent)MoE with this rank's experts w["experts.*"][0:E/ep] = global [ep_rank E/ep, (ep_rank+1) E/ep).
    Routing runs over all E (router replicated), only local experts are computed, the fp32 routed combine is
    all-reduced over EP, then the (nonlinear) latent RMSNorm and up projection and the shared experts, as
    k3c.reference.moe_layer does on one rank."""
    from ..reference import glu_act, linear, route
    from ..reference.moe import moe_output
    from ..reference.norms import acc, acc_dtype

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    p, idx, _ = route(x2, w, cfg)
    z = linear(x2, w["routed_expert_down_proj.weight"]) if cfg.latent_dim is not None else x2
    w1, w3, w2 = w["experts.w1"], w["experts.w3"], w["experts.w2"]
    n_local = w1.shape[0]
    lo = ep_rank * n_local
    rows, ks = ((idx >= lo) & (idx < lo + n_local)).nonzero(as_tuple=True)   # (token, k) pairs routed here
    local = idx[rows, ks] - lo
    order = torch.argsort(local, stable=True)
    experts, counts = torch.unique_consecutive(local[order], return_counts=True)
    u = torch.zeros(x2.shape[0], w2.shape[1], dtype=acc_dtype(z.dtype), device=z.device)
    start = 0
    for e, cnt in zip(experts.tolist(), counts.tolist()):
        sel = order[start:start + cnt]
        start += cnt
        tokens = rows[sel]
        zs = z[tokens]
        y = linear(glu_act(linear(zs, w1[e]), linear(zs, w3[e]), act), w2[e])
        u.index_add_(0, tokens, acc(y) * p[tokens, ks[sel]][:, None])
    u = all_reduce(u, "ep", ep_size).to(z.dtype)          # partial over experts -> full, before the norm
    return moe_output(u, x2, w, cfg, act, eps).reshape(shape)


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
            from ..ir.ops import packed_name

            out[packed_name(info.name, "weight_packed")], out[packed_name(info.name, "weight_scale")] = \
                quantize_stack(info.name, t, rules[info.name])
        else:
            out[info.name] = t
    return out


def load_sharded_weights(compiled, path: str, dtype=None) -> dict[str, torch.Tensor]:
    """This rank's slices read from a safetensors checkpoint: only the slice bytes are read (safe_open.get_slice)."""
    from .checkpoint import load_weight_slices

    return load_weight_slices(compiled.spec, path, param_shards(compiled), dtype=dtype)


# ---- launcher --------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def compile_target(device: str) -> str:
    """The compile target of a rank's device: the GPU's own entry (its plans and page size), else cpu."""
    if device.startswith("cuda"):
        from ..codegen.launch import target_for

        return target_for(device).name
    return "cpu"


def _rank_device(device: str, rank: int) -> str:
    """cuda -> cuda:<local rank> (one GPU per process); cpu stays cpu."""
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return device


def _worker(fn, rank: int, world: int, port: int, tp: int, ep: int, device: str, threads: int, args, queue) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        dev = _rank_device(device, rank)
        dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=300))
        try:
            init_groups(tp, ep)
            queue.put((rank, "ok", fn(rank, dev, *args)))
        finally:
            reset_groups()
            dist.destroy_process_group()
    except UserError as e:
        queue.put((rank, "user", str(e)))
    except BaseException:  # noqa: BLE001  (reported to the parent with the traceback)
        queue.put((rank, "error", traceback.format_exc()))
    finally:        # the compile pool of this rank's artifact: its workers must not outlive the rank
        from ..codegen.aot import shutdown_workers

        shutdown_workers()


def run_ranks(fn: Callable, tp: int, ep: int | None = None, args: tuple = (), *, device: str = "cpu",
              timeout: float = 600.0) -> list[Any]:
    """Run fn(rank, device, *args) on every rank of a tp x ep layout with its process groups initialised; return
    the per-rank results (picklable; tensors are returned as numpy arrays is safest).

    Under torchrun (WORLD_SIZE set) this process is one rank: it initialises from the environment and returns
    [its own result]. Otherwise it spawns max(tp, ep) processes (torch.multiprocessing, spawn): gloo on a CPU,
    NCCL with one GPU per rank on CUDA."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from ..passes.shard import make_layout

    ep = tp if ep is None else ep
    world = make_layout(tp, ep).world
    if device.startswith("cuda") and torch.cuda.device_count() < world and "WORLD_SIZE" not in os.environ:
        raise ArgumentError(f"--tp {tp} --ep {ep} need {world} GPUs, {torch.cuda.device_count()} visible")
    if "WORLD_SIZE" in os.environ:                      # torchrun: one rank per process, already launched
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ArgumentError(f"--tp {tp} --ep {ep} need {world} processes, torchrun started "
                                f"{os.environ['WORLD_SIZE']}")
        rank = int(os.environ["RANK"])
        dev = _rank_device(device, rank)
        if not dist.is_initialized():
            dist.init_process_group(_backend(device))
        init_groups(tp, ep)
        try:
            return [fn(rank, dev, *args)]
        finally:
            reset_groups()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    threads = max(1, (os.cpu_count() or 1) // world) if not device.startswith("cuda") else 4
    # not daemonic: a rank on a GPU compiles its slice's artifact through a process pool (a daemonic process may
    # have no children); the finally below ends every rank process
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, tp, ep, device, threads, args, queue),
                         daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"distributed run timed out after {timeout:.0f} s "
                                   f"({len(results)} of {world} ranks reported)")
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
                results[rank] = (status, value)
            except Exception:  # queue.Empty: check that no rank died without reporting
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                       "without reporting") from None
                if any(s != "ok" for s, _ in results.values()):
                    break                                       # one rank failed: the others may hang
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
    for rank in sorted(results):
        status, value = results[rank]
        if status == "user":
            raise UserError(value)
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    return [results[r][1] for r in range(world)]


# ---- `k3c run --tp N --ep M` ----------------------------------------------------------------------------------------
def _run_rank(rank: int, device: str, spec, tp: int, ep: int, weights: str | None, batch: int, prompt_len: int,
              new_tokens: int, seed: int, dtype: str, use_kernels: bool = True,
              cuda_graphs: bool | None = None) -> dict:
    """One rank of `k3c run`: compile its slice, load its weights, prefill + greedy decode (through a CUDA graph
    with the NCCL collectives captured, on cuda with kernels unless cuda_graphs is False); timings."""
    from .. import api
    from .cuda_graph import DecodeGraph

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = api.compile(spec, target=compile_target(device), tp=tp, ep=ep, rank=rank)
    w = (load_sharded_weights(model, weights, dtype=torch_dtype) if weights
         else init_sharded_weights(model, seed=seed, dtype=torch_dtype, device=device))
    local_bytes = sum(t.numel() * t.element_size() for t in w.values())
    sess = model.session(w, device=device, max_batch=batch, max_context=prompt_len + new_tokens,
                         use_kernels=use_kernels)
    gen = torch.Generator().manual_seed(seed)                   # the same prompt on every rank
    ids = torch.randint(0, model.spec.vocab_size, (batch, prompt_len), generator=gen)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    st = state()
    st.calls = 0
    t0 = time.perf_counter()
    logits = sess.prefill(ids)
    sync()
    ttft = time.perf_counter() - t0
    tokens = [logits[:, -1].argmax(-1)]
    t1 = time.perf_counter()
    graph, step = None, sess.decode
    if cuda_graphs is not False and use_kernels and device.startswith("cuda") and new_tokens > 1:
        graph = DecodeGraph.for_session(sess, capacity=prompt_len + new_tokens)   # captured on its first step
        step = graph.step
    for _ in range(new_tokens - 1):
        logits = step(tokens[-1])
        tokens.append(logits.argmax(-1))
    sync()
    return {"rank": rank, "ttft": ttft, "decode_s": time.perf_counter() - t1, "weight_bytes": local_bytes,
            "graph": str(graph.report) if graph is not None else None,
            "collectives": st.calls, "describe": sess.describe(), "tokens": torch.stack(tokens, 1).tolist(),
            "finite": bool(torch.isfinite(logits.float()).all()), "spec": model.spec.name,
            "layers": (model.spec.num_layers, model.spec.layer_kinds.count("kda"), model.spec.layer_kinds.count("mla"))}


def run_report_distributed(spec, *, tp: int, ep: int | None = None, weights: str | None = None, batch: int = 1,
                           prompt_len: int = 16, new_tokens: int = 8, seed: int = 0, device: str = "cpu",
                           dtype: str = "float32", use_kernels: bool = True, cuda_graphs: bool | None = None) -> str:
    """`k3c run --tp N --ep M`: the report of rank 0 (every rank decodes the same tokens; checked). Under torchrun
    the ranks other than 0 return ""."""
    from .. import api
    from ..frontend import load_spec

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ArgumentError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available here (use --device cpu)")
    ep = tp if ep is None else ep
    if isinstance(spec, str) and os.path.isdir(spec) and os.path.lexists(os.path.join(spec, "manifest.json")):
        spec = api.load(spec).spec                  # an artifact: recompile its spec sharded
    elif not hasattr(spec, "layer_kinds"):
        spec = load_spec(spec)
    if prompt_len + new_tokens > spec.max_context:
        raise ArgumentError(f"--prompt-len + --new-tokens = {prompt_len + new_tokens} exceeds the spec's "
                            f"max_context {spec.max_context}")
    from ..commands.run import check_run_fits

    check_run_fits(spec, device, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                   elem_bytes=4 if dtype == "float32" else 2)
    from ..passes.shard import check_divisible, make_layout
    from ..frontend.to_ir import spec_to_module

    lay = make_layout(tp, ep)
    check_divisible(spec_to_module(spec), lay)        # bad --tp / --ep: fail here, before spawning
    results = run_ranks(_run_rank, tp, ep, (spec, tp, ep, weights, batch, prompt_len, new_tokens, seed, dtype,
                                            use_kernels, cuda_graphs), device=device)
    if results[0]["rank"] != 0:
        return ""
    r0 = results[0]
    if any(r["tokens"] != r0["tokens"] for r in results):
        raise RuntimeError("ranks decoded different tokens: the sharded graph is inconsistent")
    n_dec = batch * (new_tokens - 1)
    layers, kda, mla = r0["layers"]
    w_bytes = [r["weight_bytes"] for r in results]
    lines = [
        f"k3c run: {r0['spec']} ({layers} layers: {kda} KDA, {mla} MLA) on {lay.world} ranks (TP {tp} x EP {ep}, "
        f"{_backend(device)}), {device}, {dtype}, weights: {weights or f'random (seed {seed})'}",
        f"  executor:        {r0['describe']}",
        f"  batch x prompt:  {batch} x {prompt_len}, new tokens: {new_tokens}",
        f"  TTFT:            {r0['ttft'] * 1e3:.1f} ms",
        f"  prefill:         {batch * prompt_len / r0['ttft']:,.1f} tokens/s",
        f"  decode:          {n_dec / r0['decode_s']:,.1f} tokens/s (first step's capture and JIT included)"
        if n_dec else "  decode:          (none)",
        *([f"  decode graph:    {r0['graph']}"] if r0["graph"] else []),
        f"  weights / rank:  {', '.join(f'{b / 2**20:,.2f}' for b in w_bytes)} MiB",
        f"  collectives:     {r0['collectives']} calls on rank 0",
        f"  logits finite:   {r0['finite']}",
        f"  tokens[0]:       {r0['tokens'][0]}",
    ]
    return "\n".join(lines)
