"""Numerics of the trained example model (examples/k3-stdlib) through every way k3c can run it.

    python bench/trained.py [--device cpu|cuda] [--paths P ...] [--windows N] [--window-len T] [--prompts N]
                            [--new-tokens N] [--batch B] [--kernels | --no-kernels] [--threads N] [--json OUT]

Each execution path (PATHS) greedy-decodes prompts (the leading lines of held-out stdlib files) and scores held-out
windows (spread evenly over this interpreter's stdlib files of the held-out split of tools/train_example.py, each
from a fresh context). The table gives per path: held-out perplexity, its change against the fp32 reference, greedy
agreement with the reference of the same dtype (reference-bf16: with the fp32 one; check_logprobs_close: prompts
fully matched / acceptable / failed, mean matched steps), the relative L2 error of the first window's logits against
that reference, and seconds; below it the whole-model logits error of compiled bf16 against reference bf16 and of
reference bf16 against reference fp32 (over every window), and the kernels the runtime had to JIT-compile because
the artifact lacked them. A path that fails is reported in its row and the others still run.

API (tests/numerics import it):
    greedy(path, prompts, new_tokens, device=, model_dir=, weights=, kernels=, dtype=) -> [Generation]
    heldout_nll(path, windows [N, T+1], ...) -> mean next-token nll (nats)
    check_logprobs_close(ref, other, topk=5) -> Agreement
    heldout_prompts(n) / heldout_windows(n, t): the held-out data, tokenized with the model's tokenizer
`weights` replaces the checkpoint (canonical names, as k3c.load_weights returns): a test injects a weight bug there.
"""
import argparse
import functools
import importlib
import json
import math
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:       # `python bench/trained.py` without PYTHONPATH; the rank processes import us
    sys.path.insert(0, str(ROOT))

from k3c.errors import ArgumentError  # noqa: E402  (after the path above)

EXAMPLE = ROOT / "examples" / "k3-stdlib"
PATHS = ("reference-fp32", "reference-bf16", "compiled-fp32", "compiled-bf16", "mxfp4", "tp2-ep2",
         "prefix-resume", "cuda-graphs", "fp8-kv", "chunked-prefill")
# chunked-prefill's chunk (and step budget): odd, so boundaries fall inside KDA's 16-token sub-chunks and MLA pages
CHUNK = 45
# the activation dtype of each path; the paths without one in their name serve bf16 (the checkpoint's), except
# tp2-ep2, whose fp32 isolates the sharding from rounding
DTYPES = {"reference-fp32": torch.float32, "reference-bf16": torch.bfloat16, "compiled-fp32": torch.float32,
          "compiled-bf16": torch.bfloat16, "mxfp4": torch.bfloat16, "tp2-ep2": torch.float32,
          "prefix-resume": torch.bfloat16, "cuda-graphs": torch.bfloat16, "fp8-kv": torch.bfloat16,
          "chunked-prefill": torch.bfloat16}
MIN_PROMPT_TOKENS = 8


# ---- agreement -------------------------------------------------------------------------------------------------
@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[torch.Tensor]     # per generated step: fp32 log-softmax [V] the token was picked from


@dataclass
class Agreement:
    ok: bool
    steps: int                       # steps compared (up to and including the first differing one)
    matched: int                     # leading steps with equal tokens
    first_diff: int | None           # step of the first differing token (None: none)
    detail: str


def check_logprobs_close(ref: Generation, other: Generation, topk: int = 5) -> Agreement:
    """vLLM's check_logprobs_close for one prompt: equal tokens continue; at the first differing token both sides
    must hold the other's token within their own top-`topk` logprobs, and the comparison stops there (later tokens
    follow different prefixes). Generations of different lengths that agree up to the shorter one fail."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ArgumentError(f"topk must be a positive integer, got {topk!r}")
    for name, g in (("ref", ref), ("other", other)):
        if len(g.tokens) != len(g.logprobs):
            raise ArgumentError(f"{name}: {len(g.tokens)} tokens but {len(g.logprobs)} logprob rows")
    n = min(len(ref.tokens), len(other.tokens))
    for i in range(n):
        a, b = ref.tokens[i], other.tokens[i]
        if a == b:
            continue
        k = min(topk, ref.logprobs[i].numel())
        top_ref = ref.logprobs[i].topk(k).indices.tolist()
        top_other = other.logprobs[i].topk(k).indices.tolist()
        ok = a in top_other and b in top_ref
        detail = (f"step {i}: ref {a} ({float(ref.logprobs[i][a]):.3f}), other {b} "
                  f"({float(other.logprobs[i][b]):.3f}); ref's token {'in' if a in top_other else 'NOT in'} "
                  f"other's top-{topk}, other's token {'in' if b in top_ref else 'NOT in'} ref's top-{topk}")
        return Agreement(ok, i + 1, i, i, detail)
    if len(ref.tokens) != len(other.tokens):
        return Agreement(False, n, n, n, f"equal for {n} steps, then lengths differ: ref {len(ref.tokens)}, "
                                         f"other {len(other.tokens)}")
    return Agreement(True, n, n, None, f"all {n} tokens equal")


def agreement_summary(ref: list[Generation], other: list[Generation], topk: int = 5) -> dict:
    """Over prompts: fully matched / acceptable (differ, within top-k) / failed, and the mean matched steps."""
    if len(ref) != len(other):
        raise ArgumentError(f"{len(ref)} reference generations but {len(other)} others")
    ags = [check_logprobs_close(r, o, topk) for r, o in zip(ref, other)]
    full = sum(a.ok and a.first_diff is None for a in ags)
    failed = [a.detail for a in ags if not a.ok]
    return {"full": full, "acceptable": len(ags) - full - len(failed), "failed": len(failed),
            "mean_matched": sum(a.matched for a in ags) / max(1, len(ags)), "failures": failed}


# ---- held-out data ---------------------------------------------------------------------------------------------
def _train_example():
    return importlib.import_module("tools.train_example")


def heldout_files(stdlib: str | Path | None = None) -> list[Path]:
    """This interpreter's stdlib files of the held-out split (tools/train_example.py), in corpus order."""
    te = _train_example()
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    return [p for p in te.corpus_files(root) if te.held_out(p.relative_to(root).as_posix())]


def _texts(files):
    for p in files:
        try:
            yield p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue                   # as the corpus does: a few test files are deliberately not UTF-8


@functools.lru_cache(maxsize=4)
def tokenizer(model_dir: str | Path = EXAMPLE):
    """The model directory's tokenizer (k3c.runtime.text.Tokenizer)."""
    from k3c.runtime.text import load_tokenizer

    spec, _ = _checkpoint(str(model_dir))
    tok = load_tokenizer(str(model_dir), vocab_size=spec.vocab_size)
    if tok is None:
        raise ArgumentError(f"{model_dir}: no tokenizer.json")
    return tok


def heldout_prompts(n: int, *, model_dir: str | Path = EXAMPLE, files=None,
                    min_tokens: int = MIN_PROMPT_TOKENS) -> list[list[int]]:
    """n distinct prompts: the leading lines of held-out files (as many whole lines as make min_tokens tokens)."""
    tok, out = tokenizer(model_dir), []
    for text in _texts(files if files is not None else heldout_files()):
        lines = text.splitlines(keepends=True)
        for j in range(len(lines)):
            ids = tok.encode("".join(lines[:j + 1]))
            if len(ids) >= min_tokens:
                if ids not in out:
                    out.append(ids)
                break
        if len(out) == n:
            return out
    raise ArgumentError(f"the held-out files give {len(out)} prompts of >= {min_tokens} tokens, {n} asked for")


def heldout_stream(n_tokens: int | None = None, *, model_dir: str | Path = EXAMPLE, files=None) -> torch.Tensor:
    """The held-out files tokenized and joined by the EOS token as in training (int64): the first n_tokens, or
    all of them (None)."""
    tok, ids = tokenizer(model_dir), []
    for text in _texts(files if files is not None else heldout_files()):
        ids += tok.encode(text) + [tok.eos_id]
        if n_tokens is not None and len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens], dtype=torch.long)
    if n_tokens is not None:
        raise ArgumentError(f"the held-out files hold {len(ids)} tokens, {n_tokens} asked for")
    return torch.tensor(ids, dtype=torch.long)


def heldout_windows(n: int, t: int, **kw) -> torch.Tensor:
    """n windows [n, t+1] (inputs [:t], targets [1:]) spread evenly over the non-overlapping windows of the whole
    held-out stream that training's evaluation scores (starts at multiples of t): a sample of the split, not of
    its first files. kw: heldout_stream's."""
    stream = heldout_stream(**kw)
    m = (stream.numel() - 1) // t
    if n > m:
        raise ArgumentError(f"the held-out stream holds {m} windows of {t} tokens, {n} asked for")
    return torch.stack([stream[s:s + t + 1] for s in ((i * m // n) * t for i in range(n))])


# ---- models ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _checkpoint(model_dir: str):
    import k3c

    spec = k3c.load_spec(model_dir)
    return spec, k3c.load_weights(spec, model_dir)


def _in_dtype(spec, weights: dict, dtype: torch.dtype, device) -> dict:
    """`weights` in `dtype` on `device`, those the spec keeps in fp32 (A_log, dt_bias, router bias) in fp32."""
    from k3c.frontend.weight_names import weight_table

    table = weight_table(spec)
    return {k: v.to(device, torch.float32 if k in table and table[k].dtype == "fp32" else dtype)
            for k, v in weights.items()}


def _path_dtype(path: str, dtype: torch.dtype | None) -> torch.dtype:
    """The path's dtype (DTYPES), or `dtype` for a path whose name fixes none (mxfp4, tp2-ep2, prefix-resume,
    cuda-graphs, chunked-prefill)."""
    if path not in PATHS:
        raise ArgumentError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if dtype is None:
        return DTYPES[path]
    if dtype not in (torch.float32, torch.bfloat16):
        raise ArgumentError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    if path.startswith(("reference-", "compiled-")) and dtype != DTYPES[path]:
        raise ArgumentError(f"path {path} runs {str(DTYPES[path])[6:]}; its name fixes the dtype")
    return dtype


def _setup(path: str, device: str, model_dir, weights, kernels: bool, dtype: torch.dtype | None):
    """(spec, weights in the path's dtype on its device, torch device, dtype) after checking the arguments."""
    dtype = _path_dtype(path, dtype)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ArgumentError(f"device must be cpu or cuda, got {device!r}") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise ArgumentError(f"device {device!r}: choose cpu, or cuda on a machine with a GPU")
    if path == "cuda-graphs" and (dev.type != "cuda" or not kernels):
        raise ArgumentError("path cuda-graphs needs device cuda with kernels (the captured decode steps)")
    spec, loaded = _checkpoint(str(model_dir))
    return spec, _in_dtype(spec, loaded if weights is None else weights, dtype, dev), dev, dtype


@functools.lru_cache(maxsize=8)
def _compiled(model_dir: str, target: str, run_dtype: str, quantized: bool):
    """The model compiled for `target`; quantized: with a `quantization:` section packing the experts the
    precision section selects (the routed experts) to MXFP4, quantized at load."""
    import k3c
    from k3c.frontend import dump_spec_yaml, parse_spec_text

    spec, _ = _checkpoint(model_dir)
    if quantized:
        spec = parse_spec_text(dump_spec_yaml(spec) + f"quantization:\n  format: mxfp4\n"
                                                      f"  rule: {spec.precision.weights.scale_rule}\n",
                               f"{model_dir} + quantization")
    model = k3c.compile(spec, target=target, run_dtypes=(run_dtype,))
    if quantized and not any(op.op == "param" and op.attr("name").endswith(".weight_packed")
                             for op in model.module.ops):
        raise RuntimeError(f"{model_dir}: the quantization section packed no weight")
    return model


def _engine(path: str, spec, w: dict, dev: torch.device, model_dir, kernels: bool, dtype: torch.dtype, *,
            max_batch: int, max_context: int):
    from k3c.runtime.devices import target_for
    from k3c.runtime.engine import Engine
    from k3c.runtime.prefix_cache import PrefixCache

    target = "cpu" if dev.type == "cpu" else target_for(dev).name
    model = _compiled(str(model_dir), target, "float32" if dtype == torch.float32 else "bfloat16", path == "mxfp4")
    prefix = PrefixCache() if path == "prefix-resume" else None
    pages = -(-max_context // target_for(dev).mla_page_size)
    # the prefix cache's checkpoints hold pages of finished requests: room for them beside the running ones
    chunk = CHUNK if path == "chunked-prefill" else None
    return Engine(model, w, device=str(dev), max_batch=max_batch, max_context=max_context,
                  num_pages=max_batch * pages * (3 if prefix else 1), use_kernels=kernels, prefix_cache=prefix,
                  cuda_graphs=path == "cuda-graphs", kv_dtype="fp8" if path == "fp8-kv" else "auto",
                  prefill_chunk=chunk, max_step_tokens=chunk)


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).cpu()


# ---- greedy decoding -------------------------------------------------------------------------------------------
def _check_prompts(prompts, new_tokens: int) -> list[list[int]]:
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ArgumentError(f"new_tokens must be a positive integer, got {new_tokens!r}")
    prompts = [list(p) for p in prompts]
    if not prompts or not all(prompts):
        raise ArgumentError("prompts must be a non-empty list of non-empty token id lists")
    return prompts


def _reference_greedy(spec, w: dict, dtype: torch.dtype, dev, prompts, new_tokens: int) -> list[Generation]:
    """ReferenceModel: one prefill per group of equal-length prompts, then decode steps over its cache."""
    from k3c.reference.model import ReferenceModel

    model = ReferenceModel(spec, w, dtype=dtype)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    out: list[Generation | None] = [None] * len(prompts)
    for members in groups.values():
        logits, cache = model.prefill(torch.tensor([prompts[i] for i in members], device=dev))
        last, gens = logits[:, -1], [Generation([], []) for _ in members]
        for step in range(new_tokens):
            nxt = last.argmax(-1)
            lp = _logprobs(last)
            for j, tok in enumerate(nxt.tolist()):
                gens[j].tokens.append(tok)
                gens[j].logprobs.append(lp[j])
            if step + 1 < new_tokens:
                last, cache = model.decode(nxt, cache)
        for i, g in zip(members, gens):
            out[i] = g
    return out


def _serve(eng, prompts, new_tokens: int):
    """Every prompt as an engine request (continuous batching, greedy): (generations, their SeqStates)."""
    rids = [eng.add_request(p, new_tokens) for p in prompts]
    seqs = [eng.seqs[r] for r in rids]
    gens = {r: Generation([], []) for r in rids}
    while eng.has_work():
        for o in eng.step():
            gens[o.rid].tokens.append(o.token)
            gens[o.rid].logprobs.append(_logprobs(o.logits))
    return [gens[r] for r in rids], seqs


def _engine_greedy(path: str, eng, prompts, new_tokens: int) -> list[Generation]:
    if path == "prefix-resume":
        _serve(eng, prompts, new_tokens)                     # cold: checkpoints at every prompt end
    gens, seqs = _serve(eng, prompts, new_tokens)
    if path == "prefix-resume":
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            if s.resumed != len(p):
                raise RuntimeError(f"prefix-resume: prompt {i} resumed at {s.resumed} of its {len(p)} tokens")
    if path == "cuda-graphs" and new_tokens > 2 and not eng.stats["decode_graph_calls"]:
        raise RuntimeError("cuda-graphs: no decode step ran through a captured graph")
    return gens


def greedy(path: str, prompts: list[list[int]], new_tokens: int, *, device: str = "cpu",
           model_dir: str | Path = EXAMPLE, weights: dict | None = None, kernels: bool = True,
           dtype: torch.dtype | None = None) -> list[Generation]:
    """Greedy continuations of `prompts` (new_tokens each) through one path of PATHS:
      reference-fp32 / -bf16: ReferenceModel in that dtype (prefill, then decode steps over its cache);
      compiled-fp32 / -bf16: k3c.compile for the device's target + the serving Engine (use_kernels=kernels; decode
        steps eager), all prompts one continuously batched run;
      mxfp4: compiled-bf16 with the routed experts packed to MXFP4 (quantized at load), bf16 activations;
      tp2-ep2: TP 2 x EP 2 on 2 CPU processes over gloo, fp32, the Engine on each rank's slice (whatever `device`
        says); rank 0's generations;
      prefix-resume: the Engine with a PrefixCache, every prompt served twice; returned is the second serving, which
        resumes from the checkpoint at its prompt end: its first token comes from the checkpoint's logits and every
        decode step runs on the restored KDA states and the shared MLA pages;
      cuda-graphs: compiled-bf16 with its decode steps through captured CUDA graphs (cuda, kernels only);
      chunked-prefill: the Engine under a step budget of CHUNK tokens: prompts prefilled in chunks of CHUNK (beside
        the other prompts' decoding rows), and held-out windows scored chunk by chunk (extend, prefill_chunk CHUNK).
    dtype: another activation dtype (fp32 or bf16) for the paths whose name fixes none (DTYPES)."""
    prompts = _check_prompts(prompts, new_tokens)
    spec, w, dev, dtype = _setup(path, device, model_dir, weights, kernels, dtype)
    if path.startswith("reference"):
        return _reference_greedy(spec, w, dtype, dev, prompts, new_tokens)
    if path == "tp2-ep2":
        return _tp_run(model_dir, weights, kernels, dtype, prompts=prompts, new_tokens=new_tokens)["generations"]
    eng = _engine(path, spec, w, dev, model_dir, kernels, dtype, max_batch=len(prompts),
                  max_context=max(map(len, prompts)) + new_tokens)
    return _engine_greedy(path, eng, prompts, new_tokens)


# ---- held-out scoring ------------------------------------------------------------------------------------------
def _check_windows(windows) -> torch.Tensor:
    if (not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 3
            or windows.is_floating_point() or windows.dtype == torch.bool):
        got = tuple(windows.shape) if isinstance(windows, torch.Tensor) else type(windows).__name__
        raise ArgumentError(f"windows must be an integer tensor [N, T+1] with N >= 1, T >= 2, got {got}")
    return windows.long().cpu()


def _fresh(eng, segments: list[list[int]]):
    """New sequences extended by `segments` (equal lengths): (their ids, logits [B, T, V])."""
    rids = [eng.open() for _ in segments]
    return rids, torch.stack(eng.extend(rids, segments))


def _resumed(eng, tokens: list[int]) -> int:
    """A new sequence started from the prefix cache's checkpoint of exactly `tokens` (the engine's admission path,
    PrefixCache.resume, on a sequence that extend() drives)."""
    rid = eng.open()
    seq = eng.seqs[rid]
    seq.tokens, seq.prompt_len = list(tokens), len(tokens)
    eng.prefix.resume(seq)
    if seq.resumed != len(tokens):
        raise RuntimeError(f"prefix-resume: resumed at {seq.resumed} of {len(tokens)} checkpointed tokens")
    return rid


def _resumed_logits(eng, rows: list[list[int]]) -> torch.Tensor:
    """Each window's first half cold (checkpointed at its end), its second half resumed from that checkpoint."""
    h = len(rows[0]) // 2
    rids, first = _fresh(eng, [r[:h] for r in rows])
    for r in rids:
        eng.finish(r)
    rids = [_resumed(eng, r[:h]) for r in rows]
    second = torch.stack(eng.extend(rids, [r[h:] for r in rows]))
    for r in rids:
        eng.finish(r)
    eng.prefix.clear()
    return torch.cat([first, second], dim=1)


def _decoded_logits(eng, rows: list[list[int]]) -> torch.Tensor:
    """Each window teacher-forced one token per call: every position through the decode path (its CUDA graphs)."""
    rids = [eng.open() for _ in rows]
    steps = [torch.stack(eng.extend(rids, [[r[t]] for r in rows]))[:, 0] for t in range(len(rows[0]))]
    for r in rids:
        eng.finish(r)
    if len(steps) > 2 and not eng.stats["decode_graph_calls"]:
        raise RuntimeError("cuda-graphs: no decode step ran through a captured graph")
    return torch.stack(steps, dim=1)


def _engine_logits(path: str, eng, chunks):
    """Logits [B, T, V] fp32 of each chunk of window inputs, every window from a fresh context."""
    for x in chunks:
        rows = x.tolist()
        if path == "prefix-resume":
            logits = _resumed_logits(eng, rows)
        elif path == "cuda-graphs":
            logits = _decoded_logits(eng, rows)
        else:
            rids, logits = _fresh(eng, rows)
            for r in rids:
                eng.finish(r)
        yield logits.float()


def window_logits(path: str, windows: torch.Tensor, *, device: str, model_dir, weights, kernels: bool,
                   batch: int, dtype: torch.dtype | None = None):
    """Logits [B, T, V] fp32 on the path's device of each chunk of `batch` windows (their inputs [:, :-1])."""
    spec, w, dev, dtype = _setup(path, device, model_dir, weights, kernels, dtype)
    chunks = windows[:, :-1].split(batch)
    if path.startswith("reference"):
        from k3c.reference.model import ReferenceModel

        model = ReferenceModel(spec, w, dtype=dtype)
        for x in chunks:
            yield model.prefill(x.to(dev))[0].float()
        return
    eng = _engine(path, spec, w, dev, model_dir, kernels, dtype, max_batch=min(batch, windows.shape[0]),
                  max_context=windows.shape[1] - 1)
    yield from _engine_logits(path, eng, chunks)


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   targets.reshape(-1).to(logits.device), reduction="sum"))


def heldout_nll(path: str, windows: torch.Tensor, *, device: str = "cpu", model_dir: str | Path = EXAMPLE,
                weights: dict | None = None, kernels: bool = True, batch: int = 16,
                dtype: torch.dtype | None = None) -> float:
    """Mean next-token nll (nats; perplexity = exp) of windows [N, T+1] through `path` (see greedy), each window
    from a fresh context, `batch` windows per call. prefix-resume scores each window's first half cold and its
    second half after resuming from the checkpoint of the first half; cuda-graphs feeds every window one token per
    step, so every position runs through the captured decode graphs (a fresh context's first step eagerly)."""
    windows = _check_windows(windows)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ArgumentError(f"batch must be a positive integer, got {batch!r}")
    if path == "tp2-ep2":
        _, _, _, dtype = _setup(path, device, model_dir, weights, kernels, dtype)
        return _tp_run(model_dir, weights, kernels, dtype, windows=windows, batch=batch)["nll"]
    total = sum(_nll_sum(lg, y) for lg, y in zip(
        window_logits(path, windows, device=device, model_dir=model_dir, weights=weights, kernels=kernels,
                       batch=batch, dtype=dtype), windows[:, 1:].split(batch)))
    return total / windows[:, 1:].numel()


# ---- TP 2 x EP 2 -----------------------------------------------------------------------------------------------
def _tp_rank(rank: int, device: str, model_dir: str, weights, kernels: bool, dtype: torch.dtype, prompts,
             new_tokens: int, windows, batch: int):
    """One rank: compile its slice, take its slice of the weights, serve the prompts and score the windows on the
    Engine; rank 0 returns generations (numpy logprobs), the nll and the first window's logits."""
    import k3c
    from k3c.runtime.distributed import shard_weights
    from k3c.runtime.engine import Engine

    spec, loaded = _checkpoint(model_dir)
    model = k3c.compile(spec, target="cpu", tp=2, ep=2, rank=rank,
                        run_dtypes=("float32" if dtype == torch.float32 else "bfloat16",))
    w = shard_weights(model, _in_dtype(spec, loaded if weights is None else weights, dtype, device))
    out: dict = {}
    if prompts:
        eng = Engine(model, w, device=device, max_batch=len(prompts),
                     max_context=max(map(len, prompts)) + new_tokens, use_kernels=kernels)
        out["generations"] = [(g.tokens, [lp.numpy() for lp in g.logprobs])
                              for g in _serve(eng, prompts, new_tokens)[0]]
    if windows is not None:
        eng = Engine(model, w, device=device, max_batch=min(batch, windows.shape[0]),
                     max_context=windows.shape[1] - 1, use_kernels=kernels)
        total, first = 0.0, None
        for lg, y in zip(_engine_logits("tp2-ep2", eng, windows[:, :-1].split(batch)), windows[:, 1:].split(batch)):
            total += _nll_sum(lg, y)
            first = lg[0].numpy() if first is None else first
        out["nll"], out["first"] = total / windows[:, 1:].numel(), first
    return out if rank == 0 else None


def _tp_run(model_dir, weights, kernels: bool, dtype: torch.dtype, *, prompts=None, new_tokens: int = 0,
            windows=None, batch: int = 16) -> dict:
    """TP 2 x EP 2 over gloo on 2 CPU processes (k3c.commands.ranks.run_ranks): rank 0's results."""
    from k3c.commands.ranks import run_ranks

    # the spawned ranks unpickle the rank function by module name: this file as the package module bench.trained
    fn = importlib.import_module("bench.trained")._tp_rank
    r = run_ranks(fn, 2, 2, (str(model_dir), weights, kernels, dtype, prompts, new_tokens, windows, batch),
                  timeout=600)[0]
    if "generations" in r:
        r["generations"] = [Generation(t, [torch.from_numpy(lp) for lp in lps]) for t, lps in r["generations"]]
    if r.get("first") is not None:
        r["first"] = torch.from_numpy(r["first"])
    return r


# ---- the report ------------------------------------------------------------------------------------------------
def comparison_reference(path: str) -> str | None:
    """The path a path's logits and tokens are compared with: the reference of its dtype (reference-bf16: the
    fp32 reference; reference-fp32: none)."""
    if path == "reference-fp32":
        return None
    if path == "reference-bf16" or DTYPES[path] == torch.float32:
        return "reference-fp32"
    return "reference-bf16"


WHOLE_MODEL_PAIRS = (("compiled-bf16", "reference-bf16"), ("reference-bf16", "reference-fp32"))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run_greedy(paths, prompts, args, kernels: dict) -> dict:
    """path -> {"generations" | "error", "seconds"}; tp2-ep2 also scores the windows in the same spawn."""
    out = {}
    for p in paths:
        t0 = time.perf_counter()
        try:
            if p == "tp2-ep2":
                r = _tp_run(EXAMPLE, None, kernels[p], DTYPES[p], prompts=prompts, new_tokens=args.new_tokens,
                            windows=args.windows_t, batch=args.batch)
                out[p] = {"generations": r["generations"], "nll": r["nll"], "first": r["first"]}
            else:
                out[p] = {"generations": greedy(p, prompts, args.new_tokens, device=args.device,
                                                kernels=kernels[p])}
        except Exception as e:  # noqa: BLE001  (one failing path is reported in its row; the others still run)
            out[p] = {"error": _error(e)}
        out[p]["seconds"] = time.perf_counter() - t0
        _progress(f"greedy {p}: {out[p]['seconds']:.1f} s{' (failed)' if 'error' in out[p] else ''}")
    return out


def _run_heldout(paths, windows: torch.Tensor, args, kernels: dict) -> tuple[dict, dict]:
    """Every path's windows, one path after the other (one engine, and its kernels' Binding, at a time), in PATHS
    order, so the references of the whole-model pairs run first and keep their logits for the later path to compare with chunk by chunk:
    ({path: {"nll", "first" | "error", "seconds"}}, {(a, b): rel L2 of a's logits from b's over all windows})."""
    kept = {b: [] for a, b in WHOLE_MODEL_PAIRS if a in paths and b in paths}
    acc = {pair: [0.0, 0.0] for pair in WHOLE_MODEL_PAIRS if set(pair) <= set(paths)}
    targets = windows[:, 1:].split(args.batch)
    res = {}
    for p in (p for p in paths if p != "tp2-ep2"):
        r = res[p] = {"nll_sum": 0.0}
        t0 = time.perf_counter()
        try:
            for i, (lg, y) in enumerate(zip(window_logits(p, windows, device=args.device, model_dir=EXAMPLE,
                                                           weights=None, kernels=kernels[p], batch=args.batch),
                                            targets)):
                r["nll_sum"] += _nll_sum(lg, y)
                r.setdefault("first", lg[0].cpu())
                if p in kept:
                    kept[p].append(lg)
                for (a, b), sums in acc.items():
                    if a == p and b in res and "error" not in res[b]:
                        sums[0] += float((lg - kept[b][i]).double().pow(2).sum())
                        sums[1] += float(kept[b][i].double().pow(2).sum())
            r["nll"] = r["nll_sum"] / windows[:, 1:].numel()
        except Exception as e:  # noqa: BLE001  (reported in the path's row; the other paths still run)
            r["error"] = _error(e)
        del r["nll_sum"]
        r["seconds"] = time.perf_counter() - t0
        _progress(f"held-out {p}: {r['seconds']:.1f} s{' (failed)' if 'error' in r else ''}")
    whole = {pair: math.sqrt(s[0] / s[1]) for pair, s in acc.items()
             if "error" not in res[pair[0]] and "error" not in res[pair[1]]}
    return res, whole


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _rows(paths, greedy_res: dict, held: dict) -> list[dict]:
    ppl32 = math.exp(held["reference-fp32"]["nll"]) if "nll" in held.get("reference-fp32", {}) else None
    rows = []
    for p in paths:
        g, h, ref = greedy_res[p], held[p], comparison_reference(p)
        row = {"path": p, "vs": ref, "seconds": g["seconds"] + h.get("seconds", 0.0),
               "seconds_greedy": g["seconds"], "seconds_heldout": h.get("seconds"),
               "errors": [e for e in (g.get("error"), h.get("error")) if e]}
        if "nll" in h:
            row["nll"], row["ppl"] = h["nll"], math.exp(h["nll"])
            row["ppl_vs_fp32_pct"] = 100 * (row["ppl"] / ppl32 - 1) if ppl32 else None
        if ref and "generations" in g and "generations" in greedy_res.get(ref, {}):
            row["greedy"] = agreement_summary(greedy_res[ref]["generations"], g["generations"])
        if ref and "first" in h and "first" in held.get(ref, {}):
            row["rel_l2_first_window"] = _rel(h["first"], held[ref]["first"])
        rows.append(row)
    return rows


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _table(rows: list[dict], whole: dict) -> str:
    lines = ["| path | held-out ppl | ppl vs fp32 ref | greedy vs ref: full / acceptable / failed, mean matched "
             "| logits rel L2, first window | vs | seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("greedy")
        greedy_s = f"{g['full']} / {g['acceptable']} / {g['failed']}, {g['mean_matched']:.1f}" if g else "-"
        lines.append(f"| {r['path']} | {_fmt(r.get('ppl'), '.4f')} | {_fmt(r.get('ppl_vs_fp32_pct'), '+.3f')}% | "
                     f"{greedy_s} | {_fmt(r.get('rel_l2_first_window'), '.3e')} | {r['vs'] or '-'} | "
                     f"{r['seconds']:.1f} |")
    notes = [f"- {r['path']} failed: {e}" for r in rows for e in r["errors"]]
    notes += [f"- whole-model logits rel L2 over the windows, {a} vs {b}: {v:.3e}" for (a, b), v in whole.items()]
    return "\n".join(lines + ([""] + notes if notes else []))


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (tp2-ep2 runs on 2 CPU processes either way)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, help="default: every path the device runs")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows (default 64)")
    ap.add_argument("--window-len", type=int, default=512, help="tokens scored per window (default 512)")
    ap.add_argument("--prompts", type=int, default=16, help="greedy prompts (default 16)")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    ap.add_argument("--batch", type=int, default=16, help="windows per call (default 16)")
    ap.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                    help="generated kernels for the compiled paths (default: on cuda; on a CPU they run in "
                         "Triton's interpreter); tp2-ep2 always runs torch ops")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args(argv)
    for name in ("windows", "window_len", "prompts", "new_tokens", "batch", "threads"):
        v = getattr(args, name)
        if v is not None and v < (2 if name == "window_len" else 1):
            ap.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'window_len' else 1}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    paths = [p for p in PATHS if p in args.paths] if args.paths else [p for p in PATHS if cuda or p != "cuda-graphs"]
    use = cuda if args.kernels is None else args.kernels
    kernels = {p: use and p != "tp2-ep2" for p in paths}
    t0 = time.perf_counter()
    prompts = heldout_prompts(args.prompts)
    args.windows_t = heldout_windows(args.windows, args.window_len)
    data_s = time.perf_counter() - t0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        greedy_res = _run_greedy(paths, prompts, args, kernels)
        held, whole = _run_heldout(paths, args.windows_t, args, kernels)
    jit = sorted({str(w.message).split()[2] for w in caught if "is not in the artifact" in str(w.message)})
    for w in caught:
        if "is not in the artifact" not in str(w.message):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if "tp2-ep2" in greedy_res:
        held["tp2-ep2"] = {k: greedy_res["tp2-ep2"].pop(k) for k in ("nll", "first") if k in greedy_res["tp2-ep2"]}
    rows = _rows(paths, greedy_res, held)
    print(f"k3-stdlib ({EXAMPLE.relative_to(ROOT)}) on {args.device}: {args.windows} held-out windows of "
          f"{args.window_len} tokens, {len(prompts)} prompts x {args.new_tokens} greedy tokens; kernels "
          f"{'on' if use else 'off'} (tp2-ep2: torch ops on 2 gloo CPU processes); held-out data {data_s:.1f} s "
          f"(Python {sys.version.split()[0]} stdlib)")
    print(_table(rows, whole))
    if jit:
        print(f"- {len(jit)} kernels JIT-compiled at run time, not in their artifact: {', '.join(jit[:4])}"
              f"{', ...' if len(jit) > 4 else ''}")
    if args.json:
        doc = {"device": args.device, "torch": torch.__version__, "python": sys.version.split()[0],
               "stdlib": sysconfig.get_paths()["stdlib"], "kernels": use, "windows": args.windows,
               "window_len": args.window_len, "prompts": len(prompts), "new_tokens": args.new_tokens,
               "batch": args.batch, "data_seconds": data_s, "rows": rows, "jit_kernels": jit,
               "whole_model_rel_l2": {f"{a} vs {b}": v for (a, b), v in whole.items()}}
        if cuda:
            doc["gpu"] = torch.cuda.get_device_name()
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
