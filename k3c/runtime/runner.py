"""`k3c run`: compile (or load) a model, prefill a random prompt, decode greedily, report speed and memory."""
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


def run_report(spec_or_artifact: str, *, weights: str | None = None, batch: int = 1, prompt_len: int = 16,
               new_tokens: int = 8, seed: int = 0, device: str = "cpu", dtype: str = "float32") -> str:
    import torch
    from tqdm import tqdm

    from .. import init_weights, load_weights

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available here (use --device cpu)")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ArgumentError(f"--device must be cpu or cuda, got {device!r}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = _load_model(spec_or_artifact)
    spec = model.spec
    if prompt_len + new_tokens > spec.max_context:
        raise ArgumentError(f"--prompt-len + --new-tokens = {prompt_len + new_tokens} exceeds the spec's "
                            f"max_context {spec.max_context}")
    w = load_weights(spec, weights, dtype=torch_dtype) if weights else init_weights(spec, seed=seed,
                                                                                      dtype=torch_dtype)
    sess = model.session(w, device=device, max_batch=batch, max_context=prompt_len + new_tokens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (batch, prompt_len), generator=gen)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    logits = sess.prefill(ids)
    sync()
    ttft = time.perf_counter() - t0
    tokens = [logits[:, -1].argmax(-1)]
    t1 = time.perf_counter()
    steps = range(new_tokens - 1)
    if new_tokens > 32 and sys.stderr.isatty():
        steps = tqdm(steps, desc="decode", unit="tok", leave=False)
    for _ in steps:
        logits = sess.decode(tokens[-1])
        tokens.append(logits.argmax(-1))
    sync()
    decode_s = time.perf_counter() - t1
    n_decoded = batch * (new_tokens - 1)
    out = torch.stack(tokens, dim=1)
    finite = bool(torch.isfinite(logits.float()).all())
    lines = [
        f"k3c run: {spec.name} ({spec.num_layers} layers: {spec.layer_kinds.count('kda')} KDA, "
        f"{spec.layer_kinds.count('mla')} MLA) on {device}, {dtype}, weights: {weights or f'random (seed {seed})'}",
        f"  executor:        {sess.describe()}",
        f"  batch x prompt:  {batch} x {prompt_len}, new tokens: {new_tokens}",
        f"  TTFT:            {ttft * 1e3:.1f} ms",
        f"  prefill:         {batch * prompt_len / ttft:,.1f} tokens/s",
        f"  decode:          {n_decoded / decode_s:,.1f} tokens/s" if n_decoded else "  decode:          (none)",
        f"  peak memory:     {_peak_memory_bytes(device) / 2**20:,.1f} MiB",
        f"  logits finite:   {finite}",
        f"  tokens[0]:       {out[0].tolist()}",
    ]
    return "\n".join(lines)
