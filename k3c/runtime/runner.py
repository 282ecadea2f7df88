"""`k3c run`: compile (or load) a model, serve random prompts through the engine (prefill, greedy decode), report
speed, memory and the MLA modes that ran."""
from __future__ import annotations

import os
import resource
import sys
import time

from ..errors import ArgumentError


def _load_model(spec_or_artifact: str, target: str = "cpu"):
    from .. import api

    if os.path.isdir(spec_or_artifact) and os.path.isfile(os.path.join(spec_or_artifact, "manifest.json")):
        return api.load(spec_or_artifact)
    return api.compile(spec_or_artifact, target=target)


def _peak_memory_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
    return int(peak_kib) * 1024


def _graph_line(eng) -> str:
    """CUDA graphs on: how many decode steps were replayed, and each batch size's graph mode (why it fell back)."""
    per = "; ".join(f"batch {b}: {dg.report.mode}" + (f" ({dg.report.reason[:160]})" if dg.report.mode != "graph"
                                                       else "") for b, dg in sorted(eng._graphs.items()))
    return (f"  decode graphs:   {eng.stats['decode_graph_calls']} of {eng.stats['decode_calls']} decode steps "
            f"replayed; {per or 'none captured (a batch size gets its graph on its second decode step in a row)'}")


def run_report(spec_or_artifact: str, *, weights: str | None = None, batch: int = 1, prompt_len: int = 16,
               new_tokens: int = 8, seed: int = 0, device: str = "cpu", dtype: str = "float32",
               use_kernels: bool = True, prefill_chunk: int | None = None, progress: bool | None = None,
               cuda_graphs: bool | None = None) -> str:
    """Serve `batch` random prompts through the engine (paged MLA cache, continuous batching): one prefill step,
    then greedy decode steps. TTFT = the first step (every prompt prefilled, first tokens sampled)."""
    import torch
    from tqdm import tqdm

    from .. import init_weights, load_weights
    from .engine import Engine

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ArgumentError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available here (use --device cpu)")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = _load_model(spec_or_artifact)
    spec = model.spec
    if prompt_len + new_tokens > spec.max_context:
        raise ArgumentError(f"--prompt-len + --new-tokens = {prompt_len + new_tokens} exceeds the spec's "
                            f"max_context {spec.max_context}")
    w = load_weights(spec, weights, dtype=torch_dtype) if weights else init_weights(spec, seed=seed,
                                                                                      dtype=torch_dtype)
    eng = Engine(model, w, device=device, max_batch=batch, max_context=prompt_len + new_tokens,
                 use_kernels=use_kernels, prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (batch, prompt_len), generator=gen)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    rids = [eng.add_request(ids[b], new_tokens) for b in range(batch)]
    show = (new_tokens > 32 or prompt_len > 4096) and sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=batch * (prompt_len + new_tokens), desc="k3c run", unit="tok", leave=False, disable=not show)
    tokens: dict[int, list[int]] = {r: [] for r in rids}
    t0 = time.perf_counter()
    first_at = None
    last_logits = None
    while eng.has_work():
        before = eng.stats["prefill_tokens"] + eng.stats["decode_tokens"]
        for o in eng.step():
            tokens[o.rid].append(o.token)
            last_logits = o.logits
        bar.update(eng.stats["prefill_tokens"] + eng.stats["decode_tokens"] - before)
        if first_at is None and all(tokens[r] for r in rids):
            sync()
            first_at = time.perf_counter()
    sync()
    end = time.perf_counter()
    bar.close()
    ttft, decode_s = first_at - t0, end - first_at
    n_decoded = eng.stats["decode_tokens"]
    out = torch.tensor([tokens[r] for r in rids])
    finite = bool(torch.isfinite(last_logits.float()).all())
    modes = ", ".join(f"layer {layer} {mode} x{n}" for (layer, mode), n in sorted(eng.mode_counts.items()))
    lines = [
        f"k3c run: {spec.name} ({spec.num_layers} layers: {spec.layer_kinds.count('kda')} KDA, "
        f"{spec.layer_kinds.count('mla')} MLA) on {device}, {dtype}, weights: {weights or f'random (seed {seed})'}",
        f"  executor:        {eng.describe()}",
        f"  batch x prompt:  {batch} x {prompt_len}, new tokens: {new_tokens}",
        f"  TTFT:            {ttft * 1e3:.1f} ms",
        f"  prefill:         {batch * prompt_len / ttft:,.1f} tokens/s",
        f"  decode:          {n_decoded / decode_s:,.1f} tokens/s" if n_decoded else "  decode:          (none)",
        f"  peak memory:     {_peak_memory_bytes(device) / 2**20:,.1f} MiB",
        f"  MLA cache:       {eng.pool.num_pages} pages of {eng.pool.page_size} tokens "
        f"({eng.pool.num_pages * eng.pool.page_bytes / 2**20:,.1f} MiB)",
        f"  MLA modes:       {modes or '(no MLA layers)'}",
        *([_graph_line(eng)] if eng.cuda_graphs else []),
        f"  logits finite:   {finite}",
        f"  tokens[0]:       {out[0].tolist()}",
    ]
    return "\n".join(lines)
