"""The rank launcher: one process per rank of a tensor x expert parallel layout, each with its process groups
initialised (k3c.runtime.distributed), and `k3c run --tp N --ep M` on top of it (docs/distributed.md).

    k3c run spec.yaml --tp 2 --ep 2                  # spawns max(tp, ep) processes (gloo on CPU, NCCL on GPU)
    torchrun --nproc-per-node 8 -m k3c.cli run spec.yaml --tp 8 --ep 8 --device cuda   # or under torchrun

Each rank of `k3c run` compiles its own slice of the model (k3c.api.compile with tp / ep / rank) and loads only
its weights.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from ..errors import ArgumentError, UserError
from ..runtime.distributed import init_groups, init_sharded_weights, load_sharded_weights, reset_groups, state


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
        from ..runtime.devices import target_for

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
    from ..runtime.cuda_graph import DecodeGraph
    from ..runtime.devices import torch_dtype as to_torch_dtype

    torch_dtype = to_torch_dtype(dtype, "--dtype")
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
    from .run import check_run_fits

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
