"""Constrained decoding's cost in the engine (issue 57's target): decode tokens/s of a batch whose every request is
constrained by a JSON schema against the same batch unconstrained, measured in one run, no HTTP.

    python bench/constrained_decode.py --device cuda --out bench/constrained-decode-h100.json     # GPU: both models
    python bench/constrained_decode.py --device cpu --no-kernels --small                          # CI size

Models (--models): `stdlib`, the trained example model (examples/k3-stdlib, its checkpoint and tokenizer), and
`wide`, examples/k3-wide.yaml with random weights (K3's widths; compiled for the H200 target on a GPU, as
bench/speculative.py part 2). k3-wide has no tokenizer: its grammars use a synthetic byte-level vocabulary of the
model's vocab_size (the example model's 4096 tokens, then words, identifiers and punctuation runs of k3c's own
sources and docs, with and without a leading space, and pairs of them), so the host's mask work is that of a
vocabulary of K3's size, not of 4096 tokens (xgrammar's mask time grows with the tokens a position leaves undecided).

Per model and batch (--batch, default 32): --batch prompts ("Answer in JSON ...", the example tokenizer's ids, valid
in both models), --new-tokens tokens each. Constrained: each request its own random schema (bench/structured_outputs
.random_schema: nested objects, enums, bounded numbers, arrays, bounded strings) as the items of an array of at least
1000 (the grammar cannot complete within the run, so every request decodes --new-tokens tokens, as unconstrained
ones do: the batch stays full), greedy; each request's matcher is its own (serve/grammar.py, as `k3c serve`
compiles it). Unconstrained: the same prompts, no logit changes. Untimed passes of each until one captures no CUDA
graph, then --repeats timed passes alternating the two, the median reported. Decode tokens/s = tokens after each
request's first / the time after every request has its first token. The engine fills the grammar masks on the host
after the step's graph call is launched (logits_processors.process), so the device's step hides them: host mask
ms per step is reported beside the step time. Every constrained token was one its grammar allowed (checked).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

STDLIB = os.path.join(ROOT, "examples", "k3-stdlib")
UNBOUNDED_ITEMS = 1000      # minItems of the array: no completion within a run (xgrammar repeats, never unrolls)


class TimedConstraint:
    """A request's grammar (serve/grammar.Constraint) whose mask fills are timed (the host's share of a step)."""

    def __init__(self, inner, clock: list):
        self._c, self._clock = inner, clock

    def fill_mask(self, bitmask, row):
        t0 = time.perf_counter()
        self._c.fill_mask(bitmask, row)
        self._clock[0] += time.perf_counter() - t0

    @staticmethod
    def fill_masks(timed: list, bitmask) -> None:
        """The engine's batch fill (logits_processors.fill_masks), timed."""
        t0 = time.perf_counter()
        type(timed[0]._c).fill_masks([t._c for t in timed], bitmask)
        timed[0]._clock[0] += time.perf_counter() - t0

    def accept(self, token):
        self._c.accept(token)

    def advance(self, token):
        return self._c.advance(token)

    def rollback(self, n):
        self._c.rollback(n)

    @property
    def finished(self):
        return self._c.finished

    @property
    def failed(self):
        return self._c.failed


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (how a byte-level BPE vocabulary spells bytes)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def synthetic_vocab(size: int) -> list[str]:
    """`size` distinct byte-level token strings: the example model's vocabulary, then pieces of k3c's sources."""
    with open(os.path.join(STDLIB, "tokenizer.json"), encoding="utf-8") as fh:
        data = json.load(fh)
    base = [""] * len(data["model"]["vocab"])
    for text, tid in data["model"]["vocab"].items():
        base[tid] = text
    for added in data.get("added_tokens") or []:
        if added["id"] < len(base):
            base[added["id"]] = added["content"]
    seen, out = set(base), list(base)
    b2u = _bytes_to_unicode()

    def add(piece: str) -> None:
        s = "".join(b2u[b] for b in piece.encode("utf-8"))
        if s not in seen and len(out) < size:
            seen.add(s)
            out.append(s)

    texts = []
    for top in ("k3c", "docs", "bench", "tests"):
        for dirpath, _, files in sorted(os.walk(os.path.join(ROOT, top))):
            texts += [open(os.path.join(dirpath, f), encoding="utf-8", errors="replace").read()
                      for f in sorted(files) if f.endswith((".py", ".md"))]
    words = sorted({w for t in texts for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]{1,4}|[^\sA-Za-z0-9]{1,3}", t)})
    for w in words:
        for piece in (w, " " + w, w.capitalize(), " " + w.capitalize(), w.upper()):
            add(piece)
    rng = random.Random(0)
    while len(out) < size:                  # pairs of words (identifiers, phrases), as a large BPE vocabulary has
        a, b = rng.choice(words), rng.choice(words)
        add(rng.choice(("", " ")) + a + rng.choice(("", "_", " ", ".")) + b)
    return out[:size]


class VocabTokenizer:
    """What serve/grammar.Grammars reads of a tokenizer, over a tokenizer.json written for a given vocabulary."""

    def __init__(self, vocab: list[str], eos_id: int, directory: str):
        self.path = os.path.join(directory, "tokenizer.json")
        with open(self.path, "w", encoding="utf-8") as fh:
            json.dump({"model": {"type": "BPE", "vocab": {s: i for i, s in enumerate(vocab)}, "merges": []},
                       "decoder": {"type": "ByteLevel"}}, fh)
        self.vocab_size, self.eos_id = len(vocab), eos_id


def load(name: str, args, dev, dtype, sync):
    """(compiled model, weights, Grammars) of a model name."""
    from k3c.serve.grammar import Grammars

    if name == "stdlib":
        from k3c.commands.run import _graph_weights, _load_model

        model = _load_model(STDLIB, args.device)
        w, _ = _graph_weights(model, STDLIB, 0, dtype, args.device, sync)
        return model, w, Grammars(model.tokenizer, model.spec.vocab_size), None
    import k3c
    from e2e import make_weights

    spec = k3c.load_spec(args.wide)
    model = k3c.compile(spec, target="h200" if dev.type == "cuda" else "cpu")
    w = make_weights(spec, model.module, args.device, dtype, reference=False)
    tmp = tempfile.TemporaryDirectory()
    tok = VocabTokenizer(synthetic_vocab(spec.vocab_size), 0, tmp.name)
    return model, w, Grammars(tok, spec.vocab_size), tmp


def timed_pass(eng, prompts, new_tokens: int, sync, procs=None) -> dict:
    procs = procs or [None] * len(prompts)
    before = dict(eng.stats)
    sync()
    rids = [eng.add_request(p, new_tokens, logits=proc) for p, proc in zip(prompts, procs)]
    got = {r: [] for r in rids}
    first = None
    t0 = time.perf_counter()
    steps_at_first = 0
    while eng.has_work():
        for o in eng.step():
            if o.error is not None:
                raise o.error
            got[o.rid].append(o.token)
        if first is None and all(got[r] for r in rids):
            sync()
            first = time.perf_counter()
            steps_at_first, capture_at_first = eng.stats["steps"], eng.stats["graph_capture_s"]
    sync()
    end = time.perf_counter()
    st = {k: v - before.get(k, 0) for k, v in eng.stats.items()}
    capture_s = eng.stats["graph_capture_s"] - capture_at_first
    decode_s = end - first - capture_s
    steps = eng.stats["steps"] - steps_at_first
    return {"tokens": [got[r] for r in rids], "decode_tokens_per_s": sum(len(v) - 1 for v in got.values()) / decode_s,
            "decode_s": decode_s, "decode_steps": steps, "ttft_s": first - t0,
            "graph_captures": st.get("graph_captures", 0)}


def run_model(name: str, args, dev, dtype, sync) -> list[dict]:
    from k3c.runtime.engine import Engine
    from k3c.runtime.logits_processors import RowLogits
    from structured_outputs import random_schema

    model, w, grammars, tmp = load(name, args, dev, dtype, sync)
    from k3c.runtime.text import load_tokenizer

    tok = load_tokenizer(STDLIB)
    rng = random.Random(args.seed)
    schemas = [{"type": "array", "items": random_schema(rng), "minItems": UNBOUNDED_ITEMS}
               for _ in range(args.batch)]
    t0 = time.perf_counter()
    compiled = [grammars.json_schema(s, "schema") for s in schemas]
    compile_s = time.perf_counter() - t0
    vocab = model.spec.vocab_size            # a model smaller than the example's vocabulary (k3-tiny): ids wrapped
    prompts = [[t % vocab for t in tok.encode(f"Answer in JSON, a list of objects with the keys "
                                              f"{', '.join(s['items']['properties'])}: ")] for s in schemas]
    ctx = max(len(p) for p in prompts) + args.new_tokens + 8
    eng = Engine(model, w, device=args.device, max_batch=args.batch, max_context=ctx, use_kernels=not args.no_kernels,
                 max_graphs=8)
    clock = [0.0]

    def constrained():
        return [RowLogits(grammar=TimedConstraint(g.matcher(), clock)) for g in compiled]

    configs = {"unconstrained": lambda: None, "json_schema": constrained}
    for cfg, make in configs.items():               # JIT, graph captures: a server pays them once
        for _ in range(args.warmup):
            if not timed_pass(eng, prompts, args.new_tokens, sync, make())["graph_captures"]:
                break
    runs = {c: [] for c in configs}
    failures = 0
    for _ in range(args.repeats):
        for cfg, make in configs.items():
            procs = make()
            clock[0] = 0.0
            r = timed_pass(eng, prompts, args.new_tokens, sync, procs)
            r["mask_s"] = clock[0]
            if procs:
                failures += sum(p.grammar.failed for p in procs)
                assert all(len(t) == args.new_tokens for t in r["tokens"]), "a constrained request ended early"
            runs[cfg].append(r)
    eng.pool.check_empty()
    rows = []
    plain = statistics.median(r["decode_tokens_per_s"] for r in runs["unconstrained"])
    for cfg, rs in runs.items():
        rate = statistics.median(r["decode_tokens_per_s"] for r in rs)
        steps = sum(r["decode_steps"] for r in rs)
        rows.append({"model": name, "config": cfg, "batch": args.batch, "new_tokens": args.new_tokens,
                     "decode_tokens_per_s": round(rate, 3), "vs_unconstrained": round(rate / plain, 4),
                     "step_ms": round(1e3 * sum(r["decode_s"] for r in rs) / steps, 3),
                     "host_mask_ms_per_step": round(1e3 * sum(r.get("mask_s", 0.0) for r in rs) / steps, 3),
                     "runs_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in rs],
                     **({"grammar_failures": failures, "schema_compile_s": round(compile_s, 3)}
                        if cfg == "json_schema" else {}),
                     "vocab": grammars._vocab_size})
    del eng
    if tmp is not None:
        tmp.cleanup()
    return rows


def line(r: dict) -> str:
    return (f"{r['model']:7} {r['config']:13} {r['batch']:5} {r['decode_tokens_per_s']:11.1f} "
            f"{r['vs_unconstrained']:8.3f} {r['step_ms']:9.3f} {r['host_mask_ms_per_step']:10.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--models", default="stdlib,wide", help="stdlib (the trained example), wide (k3-wide, random)")
    ap.add_argument("--wide", default=os.path.join(ROOT, "examples", "k3-wide.yaml"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4, help="untimed passes at most per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="CI size: batch 4, 12 new tokens, 1 repeat, 1 warm-up")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.small:
        args.batch, args.new_tokens, args.repeats, args.warmup = 4, 12, 1, 1
    models = args.models.split(",")
    for m in models:
        if m not in ("stdlib", "wide"):
            ap.error(f"--models: {m!r} is neither stdlib nor wide")
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dtype)[6:],
           "torch": torch.__version__, "rows": []}
    print(f"{'model':7} {'config':13} {'batch':>5} {'decode tok/s':>11} {'vs free':>8} {'step ms':>9} "
          f"{'mask ms/step':>10}", flush=True)
    for m in models:
        for r in run_model(m, args, dev, dtype, sync):
            out["rows"].append(r)
            print(line(r), flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
