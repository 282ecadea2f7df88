"""`k3c run`: compile (or load) a model and serve it through the engine: random prompts with a report of speed,
memory and the MLA modes that ran (run_report), or text in, text out with the model's tokenizer (run_text)."""
from __future__ import annotations

import copy
import os
import resource
import sys
import time

from ..errors import ArgumentError
from ..ir.core import DTYPE_SPELLINGS
from ..limits import MAX_SEED


def _is_artifact(path: str) -> bool:
    """A directory with a manifest.json (whatever the manifest is: api.load says what is wrong with it)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, "manifest.json"))


def _load_model(spec_or_artifact: str, device: str = "cpu", shard=None):
    """An artifact is loaded as it is; a spec is compiled for the device's target (cuda: devices.target_for, which
    tells an H200 from an H100; anything else: cpu). `shard` (tp, ep, rank): this rank's slice, compiled (an
    artifact's spec is recompiled sharded, its tokenizer kept)."""
    from .. import api

    if str(device).startswith("cuda"):
        from ..runtime.devices import target_for

        target = target_for(device)
    else:
        target = "cpu"
    if _is_artifact(spec_or_artifact):
        whole = api.load(spec_or_artifact)
        if shard is None:
            return whole
        model = api.compile(whole.spec, target=target, tp=shard[0], ep=shard[1], rank=shard[2])
        if getattr(model, "tokenizer", None) is None:
            model.tokenizer = whole.tokenizer
        return model
    if shard is not None:
        return api.compile(spec_or_artifact, target=target, tp=shard[0], ep=shard[1], rank=shard[2])
    return api.compile(spec_or_artifact, target=target)


def _peak_memory_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
    return int(peak_kib) * 1024


def speculation_line(eng, stats) -> str:
    """Speculative decoding: what drafted, how much of it the target kept, tokens per verification call."""
    sp = eng.speculation
    drafted, kept, calls = (stats.get(k, 0) for k in ("spec_drafted", "spec_accepted", "spec_calls"))
    rate = f"{kept / drafted:.1%}" if drafted else "n/a"
    per = f"{(kept + calls) / calls:.2f}" if calls else "n/a"
    plain = stats.get("decode_calls", 0)
    return (f"  speculation:     {sp.drafter.name}, draft length <= {sp.draft_len}: {kept} of {drafted} drafted "
            f"tokens accepted ({rate}), {per} tokens per sequence and verification ({calls} sequence-verifications "
            f"in {stats.get('verify_calls', 0)} calls, {stats.get('verify_graph_calls', 0)} graph replays), "
            f"{plain} plain decode steps"
            + (" (adaptive: drafting only where it pays)" if sp.adaptive else ""))


def _graph_line(eng, stats=None) -> str:
    """CUDA graphs on: how many decode steps were replayed (of `stats`, default the engine's totals), and each
    batch size's graph mode (why it fell back)."""
    stats = eng.stats if stats is None else stats
    per = "; ".join(f"batch {b}" + (f" x {t} tokens" if t > 1 else "") + f": {dg.report.mode}"
                    + (f" ({dg.report.reason[:160]})" if dg.report.mode != "graph" else "")
                    for (b, t), dg in sorted(eng.graph_pool.graphs.items()))
    return (f"  decode graphs:   {stats.get('decode_graph_calls', 0)} of {stats.get('decode_calls', 0)} decode steps "
            f"replayed; {per or 'none captured (a batch size gets its graph on its second decode step in a row)'}")


def estimate_run_bytes(spec, *, batch: int, prompt_len: int, new_tokens: int, prefill_chunk: int | None = None,
                       elem_bytes: int = 4, page_size: int = 64, kv_pool=None,
                       max_step_tokens: int | None = None, shards=None, tp: int = 1) -> dict[str, int]:
    """A rough lower bound of the memory `k3c run` needs, by part: the weights (at `elem_bytes`, fp32 entries at
    4), the engine's MLA page pool (batch x pages of the whole context), the KDA states (fp32) and conv tails of
    every sequence, and the activations of the largest step (the prefill of every prompt, one chunk of each, or a
    step token budget's worth: a few hidden-state buffers per token, AttnRes's completed blocks, and the logits of
    each prompt's last position: the engine projects no other prompt position). One rank of a sharded model:
    `shards` (distributed.param_shards: name -> (dim, rank, size) or None) divides each weight by its split, and
    the KDA states (heads) by `tp`; the MLA cache is replicated on every rank."""
    import math

    from ..frontend.weight_names import weight_table
    from ..runtime.caches.latent_format import row_width

    def parts(name) -> int:
        split = (shards or {}).get(name)
        return split[2] if split else 1

    weights = sum(math.prod(w.shape) * (4 if w.dtype == "fp32" else elem_bytes) // parts(name)
                  for name, w in weight_table(spec).items())
    ctx = prompt_len + new_tokens
    kinds = spec.layer_kinds
    mla = 0
    if spec.mla is not None:
        L, R = spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim
        # the pool's rows (kv_pool: the pool's torch dtype; None = the activations' at elem_bytes)
        row = row_width(L, R, kv_pool) * kv_pool.itemsize if kv_pool is not None else (L + R) * elem_bytes
        mla = batch * -(-ctx // page_size) * page_size * row * kinds.count("mla")
    kda = 0
    if spec.kda is not None:
        h, d = spec.kda.num_heads, spec.kda.head_dim
        kda = batch * kinds.count("kda") * (h * d * d * 4 + 3 * h * d * (spec.kda.conv_kernel - 1) * elem_bytes) // tp
    n = batch * min(prompt_len, prefill_chunk or prompt_len)          # tokens of the largest step
    if max_step_tokens:
        n = min(n, max_step_tokens + batch)          # the budget (decoding rows beside it: at most the batch)
    blocks = -(-spec.num_layers // spec.attn_res.block_size) + 1 if spec.attn_res else 0
    acts = (n * spec.hidden_size * (4 + blocks) + batch * spec.vocab_size) * elem_bytes   # logits: last rows only
    return {"weights": weights, "MLA cache": mla, "KDA state": kda, "activations": acts}


def available_bytes(device: str) -> int | None:
    """Memory free for a run on `device`: the GPU's free memory (torch.cuda.mem_get_info), on a CPU the host's
    MemAvailable (/proc/meminfo; else the free physical pages). None when it cannot be told."""
    import torch

    if device.startswith("cuda"):
        try:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except Exception:           # no such device index, a driver error: the run itself will say
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


RUN_SIZE_FLAGS = ("--batch", "--prompt-len", "--new-tokens")


def check_run_fits(spec, device: str, flags=RUN_SIZE_FLAGS, *, rank: str = "", copies: int = 1, **sizes) -> None:
    """ArgumentError when the run's estimated memory (estimate_run_bytes) exceeds what `device` has free: refused
    before anything is allocated, not found out by the OOM killer. `flags`: the command's own names of batch,
    prompt length and new tokens (None: a size the command has no flag for), which the refusal names. One rank of
    a sharded run: `rank` names it ("rank 1 of 4"), `copies` ranks share this device's memory (the host's, when
    the ranks of one host run on its CPU)."""
    parts = estimate_run_bytes(spec, **sizes)
    need, free = sum(parts.values()) * copies, available_bytes(device)
    if free is not None and need > free:
        what = ", ".join(f"{k} {v / 2**30:,.2f}" for k, v in parts.items() if v)
        batch, length, new = flags
        shape = f"{batch} {sizes['batch']} x {length} {sizes['prompt_len']}" + (
            f" + {new} {sizes['new_tokens']}" if new else "")
        who = f"{rank}: " if rank else ""
        each = f" for each of {copies} ranks" if copies > 1 else ""
        raise ArgumentError(f"{who}{shape}: the run needs at least {sum(parts.values()) / 2**30:,.2f} GiB{each} "
                            f"({what} GiB), {device} has {free / 2**30:,.2f} GiB free; use a smaller {batch} or a "
                            f"shorter {length}")


# --dtype choices -> the artifact's run dtype name (the IR's, from its one spelling table)
_RUN_DTYPES = {name: DTYPE_SPELLINGS[name] for name in ("float32", "bfloat16")}
_DTYPE_NAMES = {v: k for k, v in _RUN_DTYPES.items()}


def kernels_on(device: str, use_kernels: bool, interpret: bool) -> bool:
    """Whether a run launches the generated kernels: on a GPU unless --no-kernels; on a CPU only with --interpret,
    in the Triton interpreter (~25 ms a launch: k3-tiny's 32 new tokens take minutes there, seconds through the
    torch ops)."""
    cuda = str(device).startswith("cuda")
    if interpret and cuda:
        raise ArgumentError("--interpret runs the generated kernels in the Triton interpreter on a CPU; it cannot "
                            "go with --device cuda (kernels run compiled there)")
    if interpret and not use_kernels:
        raise ArgumentError("--interpret runs the generated kernels; it cannot go with --no-kernels")
    return use_kernels and (cuda or interpret)


def _kernel_line(use_kernels: bool, total, before_timed, *, cpu_default: bool = False,
                 artifact_target: str | None = None) -> str:
    """Where the distinct kernels came from (launcher.stats() over the whole run) and what the timed pass added.
    `cpu_default`: kernels are off because the run is on a CPU without --interpret (kernels_on);
    `artifact_target`: the GPU target of the artifact run, whose kernels a CPU run then does not use."""
    if not use_kernels:
        if cpu_default and artifact_target:
            return (f"  kernels:         off on a CPU: torch ops, not the artifact's {artifact_target} kernels (they "
                    f"run on that GPU; --interpret runs their Triton sources in the interpreter)")
        if cpu_default:
            return ("  kernels:         off on a CPU: torch ops (--interpret runs the generated kernels in the "
                    "Triton interpreter)")
        return "  kernels:         off (--no-kernels: every op through torch)"
    line = (f"  kernels:         {total.binaries} from the artifact's binaries (load {total.load_seconds:.2f} s), "
            f"{total.jit} JIT-compiled ({total.jit_seconds:.2f} s), {total.interpreted} in the interpreter "
            f"(distinct kernels, whole run); {total.launches:,} launches")
    if before_timed is not None:
        line += (f"; timed pass: {total.jit - before_timed.jit} new JIT, "
                 f"{total.binaries - before_timed.binaries} new binaries")
    names = list(getattr(total, "jit_kernels", None) or ())
    if names:
        line += f"; JIT: {', '.join(names[:3])}" + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    fallbacks = list(getattr(total, "tier_fallbacks", None) or ())
    if fallbacks:
        line += (f"; {len(fallbacks)} Gluon-tier kernel{'s' if len(fallbacks) > 1 else ''} replaced by portable "
                 f"ones (this Triton cannot build them: {', '.join(fallbacks[:2])})")
    return line


def model_checkpoint(spec_or_artifact: str) -> str | None:
    """The checkpoint a Hugging Face model directory given as the model holds (the directory, or the one of its
    config.json, with model.safetensors or an index): what `k3c run` loads when --weights is not given."""
    from ..runtime.checkpoint import INDEX_NAME, SINGLE_NAME

    path = spec_or_artifact
    if os.path.basename(path) == "config.json" and os.path.isfile(path):
        path = os.path.dirname(path) or "."
    if not os.path.isdir(path) or _is_artifact(path):
        return None
    return path if any(os.path.lexists(os.path.join(path, n)) for n in (SINGLE_NAME, INDEX_NAME)) else None


def _serve(eng, ids, new_tokens: int, sync, bar, rows=None, stop=(), on_token=None) -> dict:
    """One pass: every row of `ids` queued as a request of `new_tokens` (sampled under rows[b], None: greedy;
    ending early at a `stop` token), the engine stepped until all finished. TTFT = until every prompt is prefilled
    and has its first token (synchronised); decode = the steps after. `on_token(row, token)` is told each token as
    it is decided; True from it ends that request there."""
    before = dict(eng.stats)
    modes_before = dict(eng.mode_counts)
    sync()
    rids = [eng.add_request(ids[b], new_tokens, sampling=rows[b] if rows else None, stop_token_ids=stop)
            for b in range(ids.shape[0])]
    tokens: dict[int, list[int]] = {r: [] for r in rids}
    t0 = time.perf_counter()
    first_at = None
    last_logits = None
    while eng.has_work():
        done = eng.stats["prefill_tokens"] + eng.stats["decode_tokens"]
        for o in eng.step():
            if o.error is not None:              # a request whose sampling failed ends the run with its error
                raise o.error
            tokens[o.rid].append(o.token)
            last_logits = o.logits
            if on_token is not None and on_token(rids.index(o.rid), o.token) and o.rid in eng.seqs:
                eng.finish(o.rid)
        bar.update(eng.stats["prefill_tokens"] + eng.stats["decode_tokens"] - done)
        if first_at is None and all(tokens[r] for r in rids):
            sync()
            first_at = time.perf_counter()
    sync()
    end = time.perf_counter()
    stats = {k: v - before.get(k, 0) for k, v in eng.stats.items()}
    modes = {k: n - modes_before.get(k, 0) for k, n in eng.mode_counts.items() if n - modes_before.get(k, 0)}
    return {"ttft": first_at - t0, "decode_s": end - first_at, "seconds": end - t0, "stats": stats, "modes": modes,
            "tokens": [tokens[r] for r in rids], "last_logits": last_logits}


def _build(spec_or_artifact: str, *, weights, seed, device, dtype, use_kernels, interpret, prefill_chunk,
           cuda_graphs, kernel_policy, sizes, kv_dtype: str = "auto", prefix_cache=None,
           admission: str = "reserve", speculate: str | None = None, draft_len: int = 4,
           size_flags=RUN_SIZE_FLAGS, max_step_tokens: int | None = None, itl_target_ms: float | None = None,
           rank=None) -> dict:
    """What both modes of `k3c run` set up, timed apart: the model (artifact loaded or spec compiled), its checks
    against `sizes(model)` -> (batch, prompt_len, new_tokens), the weights (given, the model directory's
    checkpoint, or random, drawn on the device; then prepared) and the engine (graph, kernels bound, page pool).
    `rank` (commands/serve_ranks.py RankSetup): one rank of a sharded model: its slice compiled and loaded, the
    memory check of what it holds, its lock-step engine."""
    import torch

    from ..runtime import launcher
    from ..runtime.devices import target_for, torch_dtype as to_torch_dtype
    from ..runtime.engine import Engine
    from ..runtime.caches.latent_format import kv_format

    cuda = device.startswith("cuda")
    kernels = kernels_on(device, use_kernels, interpret)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    launcher.reset_stats()
    t = time.perf_counter()
    model = _load_model(spec_or_artifact, device, None if rank is None else rank.shard)
    t_model = time.perf_counter() - t
    batch, prompt_len, new_tokens = sizes(model)
    dtype = _run_dtype(model, spec_or_artifact, dtype, cuda,
                       binaries=cuda and kernels and kernel_policy in ("artifact", "strict"))
    torch_dtype = to_torch_dtype(dtype, "--dtype")
    kv_dtype = kv_format(kv_dtype, "--kv-dtype")              # decoded once: the engine takes the KVFormat
    kv = kv_dtype.pool_dtype(torch_dtype, "--kv-dtype")      # fp8 with fp32 activations: refused before loading
    check_run_fits(model.spec, device, size_flags, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                   prefill_chunk=prefill_chunk, max_step_tokens=max_step_tokens,
                   elem_bytes=torch.empty((), dtype=torch_dtype).element_size(),
                   page_size=target_for(torch.device(device)).mla_page_size, kv_pool=kv,
                   **({} if rank is None else rank.fits(model)))
    default = model_checkpoint(spec_or_artifact) if weights is None else None
    t = time.perf_counter()
    w, t_prep = _graph_weights(model, weights or default, seed, torch_dtype, device, sync, sharded=rank is not None)
    t_weights = time.perf_counter() - t
    t = time.perf_counter()
    speculation = None
    if speculate is not None:
        speculation = build_speculation(speculate, draft_len, model, device=device, torch_dtype=torch_dtype,
                                        use_kernels=kernels, max_batch=batch, max_context=prompt_len + new_tokens,
                                        kernel_policy=kernel_policy, sync=sync)
    eng = (Engine if rank is None else rank.engine)(model, w, device=device, max_batch=batch, max_context=prompt_len + new_tokens,
                 use_kernels=kernels, prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs,
                 kernel_policy=kernel_policy, kv_dtype=kv_dtype, prefix_cache=prefix_cache, admission=admission,
                 speculation=speculation, max_step_tokens=max_step_tokens, itl_target_ms=itl_target_ms)
    del w                        # the graph holds what it reads
    sync()
    return {"model": model, "eng": eng, "sync": sync, "cuda": cuda, "dtype": dtype, "kernels": kernels,
            "cpu_default": use_kernels and not kernels, "weights": weights or default, "default_weights": default,
            "artifact_target": (model.target.name if _is_artifact(spec_or_artifact) and model.target.name != "cpu"
                                else None),
            "seed": seed,
            "t_model": t_model, "t_weights": t_weights, "t_prep": t_prep, "t_engine": time.perf_counter() - t}


def build_speculation(speculate: str, draft_len: int, model, *, device: str, torch_dtype, use_kernels: bool,
                      max_batch: int, max_context: int, kernel_policy: str, sync):
    """--speculate ngram | draft:PATH: the Speculation (a draft model gets its own Engine, without CUDA graphs,
    on the same device and dtype; it must share the target's vocabulary)."""
    from ..runtime.engine import Engine
    from ..runtime.speculative import parse_speculate

    def load_draft(path: str):
        draft = _load_model(path, device)
        if draft.spec.vocab_size != model.spec.vocab_size:
            raise ArgumentError(f"--speculate draft:{path}: its vocabulary has {draft.spec.vocab_size} tokens, the "
                                f"model's {model.spec.vocab_size} (a draft model must share the tokenizer)")
        if draft.spec.max_context < max_context:
            raise ArgumentError(f"--speculate draft:{path}: its max_context {draft.spec.max_context} is below the "
                                f"run's {max_context} tokens")
        ckpt = model_checkpoint(path)
        if ckpt is None:
            raise ArgumentError(f"--speculate draft:{path}: no checkpoint (model.safetensors) there: a draft model "
                                f"with random weights would draft noise")
        w, _ = _graph_weights(draft, ckpt, 0, torch_dtype, device, sync)
        return Engine(draft, w, device=device, max_batch=max_batch, max_context=max_context,
                      use_kernels=use_kernels, cuda_graphs=False, kernel_policy=kernel_policy)

    return parse_speculate(speculate, draft_len, load_draft)


def _passes(b: dict, ids, new_tokens: int, warmup: bool | None, progress: bool | None, rows=None, stop=(),
            on_token=None):
    """(warm-up pass or None, timed pass, kernels line): with `warmup` (default: on with CUDA), one untimed pass of
    the same requests first; `on_token` (_serve) follows the timed pass."""
    from tqdm import tqdm

    from ..runtime import launcher

    eng, sync = b["eng"], b["sync"]
    warmup = b["cuda"] if warmup is None else warmup
    if b["cuda"]:
        import torch

        torch.cuda.reset_peak_memory_stats()
    batch, prompt_len = ids.shape
    show = (new_tokens > 32 or prompt_len > 4096) and sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=(1 + warmup) * batch * (prompt_len + new_tokens), desc="k3c run", unit="tok", leave=False,
               disable=not show)
    # warm-up: the same requests once, untimed: every kernel shape and every CUDA graph (batch size x length
    # bucket) the timed pass meets is compiled / captured here (identical inputs and seeds: identical choices)
    warm = _serve(eng, ids, new_tokens, sync, bar, rows, stop) if warmup else None
    # stats() is the launcher's live record: copies, so the timed pass's additions can be told apart
    before_timed = copy.deepcopy(launcher.stats()) if warmup else None
    run = _serve(eng, ids, new_tokens, sync, bar, rows, stop, on_token)
    bar.close()
    kernels = _kernel_line(b["kernels"], copy.deepcopy(launcher.stats()), before_timed, cpu_default=b["cpu_default"],
                           artifact_target=b["artifact_target"])
    return warm, run, kernels


def run_report(spec_or_artifact: str, *, weights: str | None = None, batch: int = 1, prompt_len: int = 16,
               new_tokens: int = 8, seed: int = 0, device: str = "cpu", dtype: str | None = None,
               use_kernels: bool = True, interpret: bool = False, prefill_chunk: int | None = None,
               progress: bool | None = None, cuda_graphs: bool | None = None, warmup: bool | None = None,
               kernel_policy: str = "artifact", sampling=None, kv_dtype: str = "auto", speculate: str | None = None,
               draft_len: int = 4, threads: str | None = None, max_step_tokens: int | None = None) -> str:
    """Serve `batch` random prompts through the engine (paged MLA cache, continuous batching): one prefill step,
    then decode steps (greedy, or under `sampling`: runtime.sampling.params_for_rows). Timed apart: weights
    (given, else a Hugging Face model directory's own checkpoint, else random, drawn on the device; then prepared
    for the graph: MXFP4 packing), the model (artifact loaded or spec compiled), the engine build (graph, page pool)
    and, with `warmup` (default: on with CUDA, off on a CPU), one untimed pass of the same requests (JIT, CUDA graph
    capture of every length bucket the timed pass meets); then the timed pass: TTFT = its first step(s) (every
    prompt prefilled, first tokens sampled), prefill tokens/s = batch x prompt_len / TTFT, decode tokens/s over the
    steps after it. Kernels: kernels_on (a CPU runs the torch ops unless `interpret`).
    dtype: float32 | bfloat16; None = float32 on a CPU, the artifact's first run dtype on a GPU.
    `kernel_policy` (launcher.POLICIES) goes to the Engine: artifact (binaries; a miss is JIT-compiled once, with a
    warning), strict (a miss raises), allow-jit (an artifact of another target: its sources JIT-compiled for the
    device), jit (every kernel JIT-compiled from source, the artifact's binaries ignored)."""
    import torch

    from ..runtime.sampling import params_for_rows

    _check_run_args(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, prefill_chunk=prefill_chunk, seed=seed,
                    device=device, kernel_policy=kernel_policy, use_kernels=use_kernels)
    rows = params_for_rows(sampling, batch)

    def sizes(model):
        if prompt_len + new_tokens > model.spec.max_context:
            raise ArgumentError(f"--prompt-len + --new-tokens = {prompt_len + new_tokens} exceeds the spec's "
                                f"max_context {model.spec.max_context}")
        return batch, prompt_len, new_tokens

    b = _build(spec_or_artifact, weights=weights, seed=seed, device=device, dtype=dtype, use_kernels=use_kernels,
               interpret=interpret, prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs,
               kernel_policy=kernel_policy, sizes=sizes, kv_dtype=kv_dtype, speculate=speculate,
               draft_len=draft_len, max_step_tokens=max_step_tokens)
    model, eng, spec = b["model"], b["eng"], b["model"].spec
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (batch, prompt_len), generator=gen)
    warm, run, kernels = _passes(b, ids, new_tokens, warmup, progress, rows)
    source = (f"artifact {spec_or_artifact} loaded, target {model.target.name}" if _is_artifact(spec_or_artifact)
              else f"spec compiled for target {model.target.name}")
    loaded = b["weights"]
    where = ((f"loaded from {loaded}" + (" (the model directory's checkpoint; --weights overrides)"
                                         if b["default_weights"] else "")
              + f" to host memory, moved to {device} in the engine build") if loaded else
             f"random, seed {seed}, drawn on {device}") + f"; {b['t_prep']:.2f} s of it preparing them for the graph"
    head = [
        f"k3c run: {spec.name} ({spec.num_layers} layers: {spec.layer_kinds.count('kda')} KDA, "
        f"{spec.layer_kinds.count('mla')} MLA) on {device}, {b['dtype']}, weights: {loaded or f'random (seed {seed})'}",
        f"  executor:        {eng.describe()}",
        f"  batch x prompt:  {batch} x {prompt_len}, new tokens: {new_tokens}",
        f"  weights:         {b['t_weights']:.2f} s ({where})",
        f"  model:           {b['t_model']:.2f} s ({source})",
        f"  engine build:    {b['t_engine']:.2f} s (graph, kernels bound, MLA page pool; kernel policy "
        f"{kernel_policy})",
        _threads_line(threads),
    ]
    return "\n".join(head + _pass_lines(eng, warm, run, batch, prompt_len, b["t_model"] + b["t_engine"], kernels,
                                        device))


def run_text(spec_or_artifact: str, prompt: str, *, weights: str | None = None, new_tokens: int = 64,
             sampling=None, seed: int = 0, device: str = "cpu", dtype: str | None = None, use_kernels: bool = True,
             interpret: bool = False, prefill_chunk: int | None = None, cuda_graphs: bool | None = None,
             warmup: bool | None = None, kernel_policy: str = "artifact", warn=None,
             kv_dtype: str = "auto", speculate: str | None = None, draft_len: int = 4, stop: tuple[str, ...] = (),
             on_text=None, threads: str | None = None, max_step_tokens: int | None = None) -> tuple[str, str]:
    """Text in, text out through the same engine path as run_report: `prompt` encoded with the model's tokenizer,
    continued by up to `new_tokens` tokens (greedy, or under `sampling`; ending at the EOS token, not shown, or
    before the first of the `stop` strings). `on_text(delta)` is handed the text as the timed pass decides it
    (held back only while it may be the start of a stop string or ends inside a character). Random weights (no
    `weights` and no checkpoint in the model directory) are drawn from `seed`, and `warn(line)` is told.
    Returns (the decoded continuation, a short stats block)."""
    from ..runtime.sampling import as_params

    _check_run_args(batch=1, prompt_len=1, new_tokens=new_tokens, prefill_chunk=prefill_chunk, seed=seed,
                    device=device, kernel_policy=kernel_policy, use_kernels=use_kernels)
    if not isinstance(prompt, str):
        raise ArgumentError(f"the prompt must be text, got {type(prompt).__name__}")
    stop = _stop_strings(stop)
    params = as_params(sampling).seeded()
    ids: list[int] = []

    def sizes(model):
        tok = _tokenizer(model, spec_or_artifact)
        ids.extend(tok.encode(prompt))
        if not ids:
            raise ArgumentError("the prompt encodes to no tokens")
        if len(ids) + new_tokens > model.spec.max_context:
            raise ArgumentError(f"the prompt's {len(ids)} tokens + --new-tokens {new_tokens} exceed the model's "
                                f"max_context {model.spec.max_context}")
        return 1, len(ids), new_tokens

    b = _build(spec_or_artifact, weights=weights, seed=seed, device=device, dtype=dtype, use_kernels=use_kernels,
               interpret=interpret, prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs,
               kernel_policy=kernel_policy, sizes=sizes, kv_dtype=kv_dtype, speculate=speculate,
               draft_len=draft_len, max_step_tokens=max_step_tokens)
    _warn_random(b, spec_or_artifact, warn)
    text, reason, warm, run, kernels = _generate_text(b, ids, new_tokens, warmup, params, stop, on_text)
    return text, "\n".join(_text_stats(b, warm, run, len(ids), len(run["tokens"][0]), reason, params, kernels,
                                       threads))


def _stop_strings(stop) -> tuple[str, ...]:
    stop = tuple(stop or ())
    if not all(isinstance(x, str) and x for x in stop):
        raise ArgumentError(f"--stop takes non-empty strings, got {stop!r}")
    return stop


def _tokenizer(model, spec_or_artifact: str):
    if model.tokenizer is None:
        raise ArgumentError(f"{spec_or_artifact}: no tokenizer (tokenizer.json) to encode --prompt with: give a "
                            f"Hugging Face model directory that has one, or an artifact compiled from one")
    return model.tokenizer


def _warn_random(b: dict, spec_or_artifact: str, warn) -> None:
    if b["weights"] is None and warn is not None:
        warn(f"k3c: warning: the weights are random (no --weights, and {spec_or_artifact} holds no checkpoint): "
             f"the text is noise")


def _generate_text(b: dict, ids: list[int], new_tokens: int, warmup, params, stop: tuple[str, ...], on_text):
    """(text, why it ended, warm-up pass, timed pass, kernels line) of one prompt: the timed pass's tokens go
    through a TextStream (serve/text_stream.py) as they come, its deltas to `on_text`."""
    import torch

    from ..serve.text_stream import TextStream

    tok = b["model"].tokenizer
    eos = (tok.eos_id,) if tok.eos_id is not None else ()
    stream = TextStream(tok, stop)

    def on_token(_row: int, token: int) -> bool:
        if token not in eos:
            delta = stream.push(token)
            if delta and on_text is not None:
                on_text(delta)
        return stream.stopped

    warm, run, kernels = _passes(b, torch.tensor([ids]), new_tokens, warmup, False, [params], eos, on_token)
    rest = stream.finish()
    if rest and on_text is not None:
        on_text(rest)
    new = run["tokens"][0]
    reason = ("stopped at a --stop string" if stream.stopped else "stopped at EOS" if eos and new[-1] in eos
              else "the --new-tokens limit")
    return stream.text, reason, warm, run, kernels


def run_chat(spec_or_artifact: str, turns, *, system: str | None = None, new_tokens: int = 256, sampling=None,
             stop: tuple[str, ...] = (), on_text=None, warn=None, threads: str | None = None, seed: int = 0,
             **build) -> str:
    """A conversation: each user turn from the iterable `turns` (ends when it does, or at an empty turn) is added
    to the messages, the whole conversation rendered with the model's chat template (serve/chat.py; the plain
    'role: text' lines without one) and continued, the reply streamed to `on_text` and kept as the assistant's
    turn. The plain template's replies also stop at a new 'user:' line. Returns a stats line of the last turn."""
    from ..runtime.sampling import as_params
    from ..serve.chat import ChatTemplate

    stop = _stop_strings(stop)
    params = as_params(sampling).seeded()
    context: list[int] = []

    def sizes(model):
        _tokenizer(model, spec_or_artifact)
        if new_tokens >= model.spec.max_context:
            raise ArgumentError(f"--new-tokens {new_tokens} leaves no room for a prompt in the model's max_context "
                                f"{model.spec.max_context}")
        context.append(model.spec.max_context)
        return 1, model.spec.max_context - new_tokens, new_tokens

    b = _build(spec_or_artifact, seed=seed, sizes=sizes, **build)
    _warn_random(b, spec_or_artifact, warn)
    tok = b["model"].tokenizer
    template = ChatTemplate.from_directory(os.path.dirname(tok.path),
                                           eos_token=None if tok.eos_id is None else tok.decode([tok.eos_id]))
    if template.origin == "plain":
        stop = stop + ("\nuser:",)
    messages = [{"role": "system", "content": system}] if system else []
    stats = "k3c run --chat: no turns"
    for turn in turns:
        if not turn.strip():
            break
        messages.append({"role": "user", "content": turn})
        ids = tok.encode(template.render(messages))
        room = context[0] - len(ids)
        if room < 1:
            raise ArgumentError(f"the conversation's {len(ids)} tokens fill the model's max_context {context[0]}")
        text, reason, warm, run, kernels = _generate_text(b, ids, min(new_tokens, room), False, params, stop,
                                                          on_text)
        messages.append({"role": "assistant", "content": text.strip()})
        stats = "\n".join(_text_stats(b, warm, run, len(ids), len(run["tokens"][0]), reason, params, kernels,
                                      threads))
    return stats


def _text_stats(b: dict, warm, run, prompt_tokens: int, new_tokens: int, reason: str, params, kernels: str,
                threads: str | None = None) -> list[str]:
    passed = "warm-up pass excluded" if warm else "no warm-up: includes first-call costs"
    decoded = run["stats"].get("generated_tokens", 0) - 1      # after the first (speculation: several a step)
    weights = (f"{b['weights']}" + (" (the model directory's checkpoint)" if b["default_weights"] else "")
               if b["weights"] else f"random (seed {b['seed']})")
    how = ("greedy" if params.greedy else f"sampled: temperature {params.temperature:g}, top-p {params.top_p:g}, "
           f"top-k {params.top_k}, seed {params.seed}")
    if params.repetition_penalty != 1.0:
        how += f", repetition penalty {params.repetition_penalty:g}"
    return [
        f"k3c run: {prompt_tokens} prompt tokens, {new_tokens} new tokens ({reason}; {how})",
        f"  TTFT:            {run['ttft'] * 1e3:,.1f} ms ({passed}; model {b['t_model']:.2f} s, weights "
        f"{b['t_weights']:.2f} s and engine build {b['t_engine']:.2f} s before it, not included)",
        (f"  decode:          {decoded / run['decode_s']:,.1f} tokens/s ({decoded} tokens after the first; {passed})"
         if decoded and run["decode_s"] > 0 else "  decode:          (none: the first token is the prefill's)"),
        f"  weights:         {weights}",
        *([speculation_line(b["eng"], run["stats"])] if b["eng"].speculation is not None else []),
        _threads_line(threads),
        kernels,
    ]


def _threads_line(threads: str | None) -> str:
    import torch

    return f"  threads:         {threads or f'{torch.get_num_threads()} (torch setting)'}"


def _check_run_args(*, batch, prompt_len, new_tokens, prefill_chunk, seed, device, kernel_policy,
                    use_kernels) -> None:
    """ArgumentError for a `k3c run` argument out of range, before anything is loaded."""
    import re

    import torch

    from ..runtime import launcher

    for name, v in (("--batch", batch), ("--prompt-len", prompt_len), ("--new-tokens", new_tokens),
                    ("--prefill-chunk", prefill_chunk)):
        if (v is not None or name != "--prefill-chunk") and (isinstance(v, bool) or not isinstance(v, int)
                                                              or v < 1):
            raise ArgumentError(f"{name} must be an integer >= 1, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ArgumentError(f"--seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:[0-9]{1,4})?", device):
        raise ArgumentError(f"--device must be cpu or cuda (cuda:N for one GPU), got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available here (use --device cpu)")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ArgumentError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                            f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    if kernel_policy not in launcher.POLICIES:
        raise ArgumentError(f"kernel_policy must be one of {', '.join(launcher.POLICIES)}, got {kernel_policy!r}")
    if kernel_policy != "artifact" and not use_kernels:
        raise ArgumentError(f"kernel policy {kernel_policy!r} needs kernels (it cannot go with --no-kernels)")


def _run_dtype(model, spec_or_artifact: str, dtype: str | None, cuda: bool, *, binaries: bool) -> str:
    """--dtype, checked; None = the artifact's first run dtype on a GPU, float32 on a CPU. `binaries`: the run
    takes the artifact's kernels, so the dtype must be one the artifact holds."""
    if dtype is None:
        dtype = _DTYPE_NAMES[model.run_dtypes[0]] if cuda else "float32"
    if dtype not in _RUN_DTYPES:
        raise ArgumentError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if binaries and _RUN_DTYPES[dtype] not in model.run_dtypes:
        held = ", ".join(_DTYPE_NAMES[d] for d in model.run_dtypes)
        raise ArgumentError(f"{spec_or_artifact}: the artifact holds kernels for {held} only; run with --dtype "
                            f"{held.split(', ')[0]}, compile with --run-dtypes {dtype}, or pass --jit")
    return dtype


def _graph_weights(model, weights: str | None, seed: int, dtype, device: str, sync,
                   sharded: bool = False) -> tuple[dict, float]:
    """(what the graph reads, prepared; the seconds the preparation took): loaded to host memory (the engine build
    moves them) or drawn where they run, then prepared now (float expert stacks packed to MXFP4, the float copies
    dropped) so that this is counted as weights, not engine build; the engine's own preparation finds them ready.
    `sharded`: this rank's slices only (the same values as the slices of the whole model's weights)."""
    from .. import load_weights
    from ..runtime.distributed import init_sharded_weights, load_sharded_weights
    from ..runtime.weight_prep import prepare_weights
    from ..runtime.weights import init_weights           # takes device= (k3c.init_weights does not)

    if sharded:
        w = (load_sharded_weights(model, weights, dtype=dtype) if weights
             else init_sharded_weights(model, seed=seed, dtype=dtype, device=device))
    elif weights:
        w = load_weights(model.spec, weights, dtype=dtype)
    else:
        w = init_weights(model.spec, seed=seed, dtype=dtype, device=device)
    sync()
    t = time.perf_counter()
    w = prepare_weights(model.module, w, model.spec)
    sync()
    return w, time.perf_counter() - t


def _pass_lines(eng, warm: dict | None, run: dict, batch: int, prompt_len: int, build_s: float, kernels: str,
                device: str) -> list[str]:
    """The report's lines on the passes: the warm-up, TTFT and rates of the timed pass, kernels, memory, MLA."""
    import torch

    spec = eng.spec
    first = warm or run
    # tokens after each request's first (speculation emits several a step), in plain and verification steps
    n_decoded = run["stats"].get("generated_tokens", 0) - batch
    steps = run["stats"].get("decode_calls", 0) + run["stats"].get("verify_calls", 0)
    finite = bool(torch.isfinite(run["last_logits"].float()).all())
    modes = ", ".join(f"layer {layer} {mode} x{n}" for (layer, mode), n in sorted(run["modes"].items()))
    passed = "timed pass, warm-up excluded" if warm else "no warm-up: includes first-call costs"
    if warm:
        warm_line = (f"  warm-up:         {warm['seconds']:.2f} s (untimed pass of the same requests: prefill "
                     f"{batch} x {prompt_len}, {warm['stats'].get('decode_calls', 0)} decode steps; JIT, CUDA "
                     f"graph capture; its TTFT {warm['ttft'] * 1e3:,.1f} ms)")
    else:
        warm_line = ("  warm-up:         skipped (--no-warmup, the default on a CPU): the rates below include "
                     "first-call costs")
    return [
        warm_line,
        f"  cold TTFT:       {(build_s + first['ttft']) * 1e3:,.1f} ms (model + engine build + the first "
        f"pass's prefill; weights excluded)",
        f"  TTFT:            {run['ttft'] * 1e3:,.1f} ms ({passed})",
        f"  prefill:         {batch * prompt_len / run['ttft']:,.1f} tokens/s ({batch} x {prompt_len} tokens / TTFT; "
        f"{passed})",
        (f"  decode:          {n_decoded / run['decode_s']:,.1f} tokens/s ({n_decoded} tokens in {steps} steps after "
         f"the first token; {passed})" if n_decoded else "  decode:          (none: one new token is the prefill's)"),
        kernels,
        f"  peak memory:     {_peak_memory_bytes(device) / 2**20:,.1f} MiB",
        (f"  MLA cache:       {eng.pool.num_pages} pages of {eng.pool.page_size} tokens "
         f"({eng.pool.num_pages * eng.pool.page_bytes / 2**20:,.1f} MiB, "
         f"{'fp8 e4m3 + per-token scales' if eng.kv_pool_dtype == torch.float8_e4m3fn else str(eng.kv_pool_dtype)[6:]})"
         if "mla" in spec.layer_kinds
         else "  MLA cache:       none (no MLA layers)"),
        f"  MLA modes:       {modes or '(no MLA layers)'} (timed pass)",
        *([_graph_line(eng, run["stats"]) + " (timed pass)"] if eng.cuda_graphs else []),
        *([speculation_line(eng, run["stats"]) + " (timed pass)"] if eng.speculation is not None else []),
        f"  logits finite:   {finite}",
        f"  tokens[0]:       {run['tokens'][0]}",
    ]
