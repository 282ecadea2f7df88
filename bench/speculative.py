"""Speculative decoding: acceptance and decode tokens/s with and without it, on code and on tool-output copying.

    python bench/speculative.py --device cuda --out bench/speculative-h200.json           # H200: both parts
    python bench/speculative.py --device cpu --no-kernels --small --skip-wide               # CI size

Part 1, the trained example model (examples/k3-stdlib, its checkpoint; acceptance means something only on trained
weights). Two workloads of prompts cut from k3c's own source files (Python the model never saw):
  code   the first --prompt-tokens tokens of a file, continued;
  copy   an agent's tool call: "# $ cat FILE" + --prompt-tokens tokens of the file as the tool's output, then
         "# FILE, unchanged:" + the first half of the output.s lines: a continuation that copies the output.
Per batch size (--batches) and configuration (plain; ngram = prompt lookup; draft = examples/k3-stdlib-draft when
present; --draft-len tokens at most, the adaptive controller on unless --every-step): untimed passes until one
captures no CUDA graph (JIT, captures; at most 6), then --repeats timed passes of the same requests, the median
reported (every run's rate and graph captures listed); batch 1 times --b1-requests prompts, each alone, one after
the other. Decode tokens/s = tokens after each request's first / the time after every request has its first token
(warm-up and compile excluded; so are the seconds of any CUDA graph capture inside that time, a server's one-off
cost: the row says how many and how long). Also: drafts accepted / drafted, tokens per
verification, and greedy identity with the plain pass (requests whose tokens are equal).

Sustained load (--sustained K, part 1's model): K x batch requests queued at once on an engine of that max_batch,
max_new_tokens spread over [new/2, 3 new/2], plain and prompt lookup; tokens/s = every generated token / queueing
to the last token, prefill included. A fixed batch under speculation ends with its slowest request, in a shrinking
batch; a server replaces its finishers with queued requests.

Part 2, k3-wide-shaped timing (--wide spec, random weights, --wide-context tokens of random prompt): what a verified
draft costs at K3's widths. Random weights draft nothing worth measuring, so the drafter replays part 1's acceptance:
for each request it proposes the plain pass's own next tokens, as many as a draw from part 1's histogram of accepted
drafts per verification (that workload, --replay-batch or the nearest batch part 1 ran), then a wrong token.
Tokens/s against plain decoding, adaptive controller on (it turns speculation off where a verification's tokens per second are below plain decoding's)
and off (every step drafts).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

SOURCES = ["k3c/runtime/serving/engine.py", "k3c/runtime/prefix_cache.py", "k3c/runtime/caches/block_pool.py",
           "k3c/runtime/sampling.py", "k3c/runtime/cuda_graph.py", "k3c/runtime/kv_tiers.py", "k3c/frontend/spec.py",
           "k3c/ir/core.py", "k3c/codegen/writer.py", "k3c/analysis/cost.py", "k3c/runtime/launcher.py",
           "k3c/passes/attnres_split.py", "k3c/runtime/caches/seq_state.py", "k3c/quant/mx.py", "k3c/cli.py",
           "k3c/runtime/checkpoint.py"]


def prompts(tok, workload: str, n: int, length: int) -> list[list[int]]:
    out = []
    for i in range(n):
        path = SOURCES[i % len(SOURCES)]
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        ids = tok.encode(text)
        start = (i // len(SOURCES)) * length % max(1, len(ids) - length)
        body = ids[start:start + length]
        if workload == "code":
            out.append(body)
            continue
        # pieces encoded apart, as a chat template joins a tool's output: the quote repeats the output's own tokens
        # (text re-encoded at a cut would not: byte-level BPE merges a line's newline with the next indentation)
        out.append(tok.encode(f"# $ cat {path}\n") + body + tok.encode(f"\n# {path}, unchanged:\n")
                   + body[:len(body) // 2])
    return out


def timed_pass(eng, ps: list[list[int]], new_tokens: int, sync) -> dict:
    before = dict(eng.stats)
    hist_before = dict(eng.accept_counts)
    gc.collect()        # garbage of earlier passes is not collected inside this one (plain and speculative alike)
    sync()
    rids = [eng.add_request(p, new_tokens) for p in ps]
    got = {r: [] for r in rids}
    t0 = time.perf_counter()
    first = None
    while eng.has_work():
        for o in eng.step():
            got[o.rid].append(o.token)
        if first is None and all(got[r] for r in rids):
            sync()
            first = time.perf_counter()
            captured_before = eng.stats["graph_capture_s"]
    sync()
    end = time.perf_counter()
    st = {k: v - before.get(k, 0) for k, v in eng.stats.items()}
    hist = {k: v - hist_before.get(k, 0) for k, v in eng.accept_counts.items() if v - hist_before.get(k, 0)}
    after_first = sum(len(v) - 1 for v in got.values())
    # a capture is a server's one-off cost, not its decode rate: the seconds of any inside the decode are left out
    capture_s = eng.stats["graph_capture_s"] - captured_before
    decode_s = end - first - capture_s
    return {"tokens": [got[r] for r in rids], "decode_tokens_per_s": after_first / decode_s,
            "decode_s": decode_s, "decode_capture_s": capture_s, "ttft_s": first - t0, "drafted": st.get("spec_drafted", 0),
            "accepted": st.get("spec_accepted", 0), "verifications": st.get("spec_calls", 0),
            "verify_calls": st.get("verify_calls", 0), "verify_graph_calls": st.get("verify_graph_calls", 0),
            "decode_calls": st.get("decode_calls", 0), "decode_graph_calls": st.get("decode_graph_calls", 0),
            "padded_graph_rows": st.get("padded_graph_rows", 0), "graph_captures": st.get("graph_captures", 0),
            "graph_capture_s": st.get("graph_capture_s", 0.0),
            "accept_hist": {int(k): v for k, v in sorted(hist.items())}}


def warm_up(eng, ps: list[list[int]], new_tokens: int, sync, passes: int = 6) -> int:
    """Untimed passes until one captures no CUDA graph (JIT, captures: a server pays them once at start, and a
    batch that shrinks as its requests finish at different steps meets a new shape in each of the first passes);
    the passes it took."""
    for n in range(1, passes + 1):
        if not timed_pass(eng, ps, new_tokens, sync)["graph_captures"]:
            return n
    return passes


def timed_requests(eng, ps: list[list[int]], new_tokens: int, sync, together: bool) -> dict:
    """timed_pass of the prompts as one batch (together), or of each prompt alone, one after the other (batch 1
    over several prompts: one prompt's acceptance is not a workload's); alone, the figures are the sums."""
    if together:
        return timed_pass(eng, ps, new_tokens, sync)
    runs = [timed_pass(eng, [p], new_tokens, sync) for p in ps]
    out = {k: sum(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    out["tokens"] = [r["tokens"][0] for r in runs]
    out["decode_tokens_per_s"] = sum(len(t) - 1 for t in out["tokens"]) / out["decode_s"]
    out["accept_hist"] = {}
    for r in runs:
        for k, v in r["accept_hist"].items():
            out["accept_hist"][k] = out["accept_hist"].get(k, 0) + v
    out["per_request_tokens_per_s"] = [round(r["decode_tokens_per_s"], 1) for r in runs]
    return out


def sustained_lengths(n: int, new_tokens: int) -> list[int]:
    """Request i's max_new_tokens under sustained load: spread over [new_tokens / 2, 3 new_tokens / 2], in an order
    unrelated to i, so that plain decoding's requests finish at different steps too (equal lengths would admit
    plain decoding's requests in waves of a full batch)."""
    lo = max(1, new_tokens // 2)
    span = new_tokens + 1
    return [lo + (i * 37) % span for i in range(n)]


def sustained_pass(eng, ps: list[list[int]], new_tokens: int, sync) -> dict:
    """Every prompt queued at once on an engine of max_batch < len(ps): continuous batching keeps max_batch
    requests in flight, admitting the next as one finishes (a server under steady load, where a speculating batch's
    early finishers are replaced instead of leaving a shrinking tail). Tokens/s = every generated token / the time
    from queueing to the last token, prefill of the admitted requests included (one-off graph captures left out)."""
    before = dict(eng.stats)
    gc.collect()
    sync()
    t0 = time.perf_counter()
    rids = [eng.add_request(p, n) for p, n in zip(ps, sustained_lengths(len(ps), new_tokens))]
    got = {r: [] for r in rids}
    while eng.has_work():
        for o in eng.step():
            got[o.rid].append(o.token)
    sync()
    st = {k: v - before.get(k, 0) for k, v in eng.stats.items()}
    seconds = time.perf_counter() - t0 - st.get("graph_capture_s", 0.0)
    return {"tokens": [got[r] for r in rids], "tokens_per_s": sum(map(len, got.values())) / seconds,
            "seconds": seconds, "drafted": st.get("spec_drafted", 0), "accepted": st.get("spec_accepted", 0),
            **{k: st.get(k, 0) for k in ("steps", "graph_captures", "verify_calls", "verify_graph_calls", "decode_calls",
                                         "decode_graph_calls", "prefill_calls", "graph_slot_gathers",
                                         "padded_graph_rows")}}


def part_sustained(args, model, w, sync) -> list[dict]:
    """Plain and prompt lookup at a steady --sustained x batch requests per batch size (> 1): median of --repeats
    passes after warm-up passes (at most 3, until one captures no graph)."""
    from k3c.runtime.engine import Engine
    from k3c.runtime.speculative import NgramDrafter, Speculation

    rows = []
    for workload in args.workloads:
        for b in [b for b in args.batches if b > 1]:
            ps = prompts(model.tokenizer, workload, args.sustained * b, args.prompt_tokens)
            ctx = max(len(p) for p in ps) + max(sustained_lengths(len(ps), args.new_tokens)) + args.draft_len + 2
            plain = None
            for name in ("plain", "ngram"):
                eng = Engine(model, w, device=args.device, max_batch=b, max_context=ctx, use_kernels=not args.no_kernels,
                             speculation=Speculation(NgramDrafter(), args.draft_len) if name == "ngram" else None,
                             max_graphs=args.max_graphs)
                for _ in range(3):
                    if not sustained_pass(eng, ps, args.new_tokens, sync)["graph_captures"]:
                        break
                runs = [sustained_pass(eng, ps, args.new_tokens, sync) for _ in range(args.repeats)]
                r = sorted(runs, key=lambda x: x["tokens_per_s"])[len(runs) // 2]
                row = {"model": "k3-stdlib", "workload": workload, "batch": b, "requests": len(ps), "config": name,
                       **{k: v for k, v in r.items() if k != "tokens"},
                       "runs_tokens_per_s": [round(x["tokens_per_s"], 1) for x in runs]}
                if plain is None:
                    plain = r
                else:
                    row["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"]
                    row["identical"] = sum(a == c for a, c in zip(r["tokens"], plain["tokens"]))
                if r["drafted"]:
                    row["acceptance"] = r["accepted"] / r["drafted"]
                rows.append(row)
                eager = r["decode_calls"] + r["verify_calls"] - r["decode_graph_calls"] - r["verify_graph_calls"]
                print(f"{'k3-stdlib':>10} {workload:>4} b{b:<3} {name:<8} sustained, {len(ps)} requests: "
                      f"{r['tokens_per_s']:9.1f} tok/s (prefill included; median of "
                      f"{'/'.join(f'{x:.0f}' for x in row['runs_tokens_per_s'])}; {r['steps']} steps, "
                      f"{r['prefill_calls']} prefill calls, {eager} eager decode/verify calls, "
                      f"{r['graph_slot_gathers']} slot gathers)"
                      + (f", {row['speedup']:.2f}x plain, acceptance {row.get('acceptance', 0):.1%}, identical "
                         f"{row['identical']}/{len(ps)}" if "speedup" in row else ""), flush=True)
                args.save(sustained=rows)
                del eng
    return rows


def summary(r: dict, plain: dict | None) -> dict:
    out = {k: v for k, v in r.items() if k != "tokens"}
    if r["drafted"]:
        out["acceptance"] = r["accepted"] / r["drafted"]
    if r["verifications"]:
        out["tokens_per_verification"] = (r["accepted"] + r["verifications"]) / r["verifications"]
    if plain is not None:
        out["speedup"] = r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        out["identical"] = sum(a == b for a, b in zip(r["tokens"], plain["tokens"]))
        out["requests"] = len(r["tokens"])
    return out


class ReplayDrafter:
    """Part 2's drafter: as many drafts as a draw from an acceptance histogram, then a wrong one. Random weights'
    logits are near ties, so a verification's argmax is not plain decoding's (bf16 rounding of a T-token chunk):
    `forced_accept` (patched in for accept_greedy) keeps exactly the drawn count, so the calls, rollbacks and
    tokens per verification are those of the trained model's acceptance; the tokens themselves mean nothing."""

    name = "replay"

    def __init__(self, hist: dict[int, int], seed: int, vocab: int):
        self.values = [int(k) for k, n in hist.items() for _ in range(n)] or [0]   # JSON keys are text
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.refs: dict[int, tuple[int, list[int]]] = {}      # rid -> (prompt length, plain tokens)
        self.kept: dict[tuple, int] = {}                        # a proposal -> the drafts to keep of it

    def propose_for(self, rids, contexts, ks):
        out = []
        for rid, ctx, k in zip(rids, contexts, ks):
            plen, ref = self.refs[rid]
            g = len(ctx) - plen
            a = min(self.rng.choice(self.values), k)
            d = (ref[g:g + a] + [1] * a)[:a]
            if len(d) < k:
                d = d + [(ref[g + len(d)] + 1) % self.vocab if g + len(d) < len(ref) else 0]
            d = d[:k]
            self.kept[tuple(d)] = a
            out.append(d)
        return out

    def forced_accept(self, target, drafts):
        a = min(self.kept.get(tuple(drafts), 0), len(drafts))
        return list(drafts[:a]) + [target[a]]

    def forget(self, rid):
        pass


def part_trained(args, dev, dtype, sync) -> dict:
    from k3c.commands.run import _graph_weights, _load_model
    from k3c.runtime.engine import Engine
    from k3c.runtime.speculative import DraftModelDrafter, NgramDrafter, Speculation

    path = os.path.join(ROOT, "examples", "k3-stdlib")
    model = _load_model(path, args.device)
    w, _ = _graph_weights(model, path, 0, dtype, args.device, sync)
    draft_dir = os.path.join(ROOT, "examples", "k3-stdlib-draft")
    draft = None
    if os.path.exists(os.path.join(draft_dir, "model.safetensors")) and not args.no_draft:
        draft = _load_model(draft_dir, args.device)
        dw, _ = _graph_weights(draft, draft_dir, 0, dtype, args.device, sync)
    kernels = not args.no_kernels
    rows = []
    for workload in args.workloads:
        for b in args.batches:
            ps = prompts(model.tokenizer, workload, b if b > 1 else args.b1_requests, args.prompt_tokens)
            ctx = max(len(p) for p in ps) + args.new_tokens + args.draft_len + 2
            adaptive = not args.every_step
            configs = {"plain": None, "ngram": lambda: Speculation(NgramDrafter(), args.draft_len, adaptive=adaptive)}
            if draft is not None:
                configs["draft"] = lambda: Speculation(DraftModelDrafter(Engine(
                    draft, dw, device=args.device, max_batch=b, max_context=ctx, use_kernels=kernels,
                    cuda_graphs=False)), args.draft_len, adaptive=adaptive)
            plain = None
            for name, make in configs.items():
                eng = Engine(model, w, device=args.device, max_batch=b, max_context=ctx, use_kernels=kernels,
                             speculation=make() if make else None, max_graphs=args.max_graphs)
                warm_up(eng, ps[:b], args.new_tokens, sync)
                # a batch's timed pass lasts ~0.1 s: one late capture or host hiccup moves it by 10%; the median
                # of --repeats passes (the controller keeps learning across them, as a server's would)
                runs = [timed_requests(eng, ps, args.new_tokens, sync, together=b > 1) for _ in range(args.repeats)]
                r = sorted(runs, key=lambda x: x["decode_tokens_per_s"])[len(runs) // 2]
                r["runs_tokens_per_s"] = [round(x["decode_tokens_per_s"], 1) for x in runs]
                r["runs_graph_captures"] = [x["graph_captures"] for x in runs]
                if plain is None:
                    plain = r
                row = {"model": "k3-stdlib", "workload": workload, "batch": b, "config": name,
                       **summary(r, None if name == "plain" else plain)}
                if eng.speculation is not None:
                    row["controller"] = {str(k): v for k, v in eng.speculation.rates().items()}
                rows.append(row)
                print(line(row), flush=True)
                args.save(rows=rows)
                del eng
    out = {"rows": rows}
    if args.sustained:
        out["sustained"] = part_sustained(args, model, w, sync)
    return out


def part_wide(args, dev, dtype, sync, trained_rows) -> dict:
    import k3c
    from e2e import make_weights
    from k3c.runtime.engine import Engine
    from k3c.runtime.session import load_graph
    from k3c.runtime import speculative as speculative_rt
    from k3c.runtime.speculative import Speculation

    true_accept = speculative_rt.accept_greedy
    spec = k3c.load_spec(args.wide)
    model = k3c.compile(spec, target="h200" if dev.type == "cuda" else "cpu")
    w = make_weights(spec, model.module, args.device, dtype, reference=False)
    graph = load_graph(model, w, dev, not args.no_kernels)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for workload in args.workloads:
        # part 1's histogram at --replay-batch, else at the nearest batch part 1 ran; none: refuse (a replay of
        # nothing would only show the controller switching itself off)
        hists = {r["batch"]: r["accept_hist"] for r in trained_rows
                 if r["workload"] == workload and r["config"] == "ngram" and r.get("accept_hist")}
        if not hists:
            raise SystemExit(f"bench/speculative.py: part 2 replays part 1's ngram acceptance of {workload!r}: "
                             f"run part 1 (or pass --replay-from) with that workload")
        hist = hists[min(hists, key=lambda b: (abs(b - args.replay_batch), b))]
        for b in args.batches:
            ps = torch.randint(0, spec.vocab_size, (b, args.wide_context), generator=gen).tolist()
            ctx = args.wide_context + args.new_tokens + args.draft_len + 2
            plain_eng = Engine(model, w, device=args.device, max_batch=b, max_context=ctx, graph=graph,
                               use_kernels=not args.no_kernels, max_graphs=args.max_graphs)
            warm_up(plain_eng, ps, args.new_tokens, sync)
            plain = timed_pass(plain_eng, ps, args.new_tokens, sync)
            row = {"model": spec.name, "workload": workload, "batch": b, "config": "plain", **summary(plain, None)}
            rows.append(row)
            print(line(row), flush=True)
            del plain_eng
            for adaptive in (True, False):
                drafter = ReplayDrafter(hist, 1, spec.vocab_size)
                speculative_rt.accept_greedy = drafter.forced_accept
                eng = Engine(model, w, device=args.device, max_batch=b, max_context=ctx, graph=graph,
                             use_kernels=not args.no_kernels, max_graphs=args.max_graphs,
                             speculation=Speculation(drafter, args.draft_len, adaptive=adaptive))
                for warm in (True, True, False):
                    base = eng._next_rid
                    for i, p in enumerate(ps):
                        drafter.refs[base + i] = (len(p), plain["tokens"][i])
                    r = timed_pass(eng, ps, args.new_tokens, sync)
                row = {"model": spec.name, "workload": workload, "batch": b,
                       "config": "replay" + ("" if adaptive else " (adaptive off)"), "replayed_hist": hist,
                       **summary(r, plain), "controller": {str(k): v for k, v in eng.speculation.rates().items()}}
                rows.append(row)
                print(line(row), flush=True)
                args.save(rows=rows)
                del eng
    speculative_rt.accept_greedy = true_accept
    return {"rows": rows, "context": args.wide_context}


def line(r: dict) -> str:
    extra = ""
    if "acceptance" in r:
        extra = (f", acceptance {r['acceptance']:.1%}, {r.get('tokens_per_verification', 0):.2f} tokens/verification"
                 f" ({r['verify_graph_calls']}/{r['verify_calls']} graph calls)")
    if "speedup" in r:
        extra += f", {r['speedup']:.2f}x plain, identical {r['identical']}/{r['requests']}"
    if len(r.get("runs_tokens_per_s", ())) > 1:
        extra += f" (median of {'/'.join(f'{x:.0f}' for x in r['runs_tokens_per_s'])})"
    eager = r["decode_calls"] + r["verify_calls"] - r["decode_graph_calls"] - r["verify_graph_calls"]
    if eager:       # steps that ran without a graph (new batch shapes): host-bound, often what a loss is
        extra += f", {eager} eager decode/verify calls"
    if r.get("graph_captures"):   # a timed pass that captured: its seconds are left out of the decode rate
        extra += (f", {r['graph_captures']} graph captures in the timed pass ({r['graph_capture_s']:.3f} s, "
                  f"{r.get('decode_capture_s', 0.0):.3f} s of them after the first tokens: not in the rate)")
    return (f"{r['model']:>10} {r['workload']:>4} b{r['batch']:<3} {r['config']:<20} "
            f"{r['decode_tokens_per_s']:9.1f} tok/s{extra}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--workloads", default="copy,code")
    ap.add_argument("--b1-requests", type=int, default=8, help="prompts batch 1 runs, one after the other")
    ap.add_argument("--max-graphs", type=int, default=32,
                    help="CUDA graphs an engine keeps: speculation's requests finish at different steps, so a batch "
                         "shrinks through every size, each a decode and a verification graph; evicting the full "
                         "batch's graphs in the warm-up would make the timed pass capture them again")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes of each configuration (part 1): the median")
    ap.add_argument("--sustained", type=int, default=4, metavar="K",
                    help="part 1 also keeps each batch size (> 1) busy with K x batch requests queued at once, "
                         "plain and prompt lookup (0: skip)")
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model configuration")
    ap.add_argument("--every-step", action="store_true",
                    help="part 1 without the adaptive controller: every decode step drafts and verifies (the "
                         "drafters' acceptance where the controller would switch one off; rates then say what "
                         "verifying every step costs)")
    ap.add_argument("--wide", default=os.path.join(ROOT, "examples", "k3-wide.yaml"))
    ap.add_argument("--wide-context", type=int, default=2048)
    ap.add_argument("--replay-batch", type=int, default=1)
    ap.add_argument("--skip-wide", action="store_true")
    ap.add_argument("--skip-trained", action="store_true")
    ap.add_argument("--replay-from", metavar="JSON", help="part 1's rows from an earlier run of this bench")
    ap.add_argument("--small", action="store_true", help="CI size: batches 1,2, 48-token prompts, 16 new tokens")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.small:
        args.batches, args.prompt_tokens, args.new_tokens, args.wide_context = "1,2", 48, 16, 64
        args.b1_requests, args.repeats, args.sustained = 2, 1, 2
    args.batches = [int(b) for b in args.batches.split(",")]
    args.workloads = args.workloads.split(",")
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dtype)[6:],
           "torch": torch.__version__, "draft_len": args.draft_len, "new_tokens": args.new_tokens,
           "prompt_tokens": args.prompt_tokens}
    out["trained"] = {"rows": []}

    def save(rows=None, sustained=None):
        """The JSON so far (after every row: a run cut short keeps what it measured)."""
        if rows is not None:
            out["partial"] = rows
        if sustained is not None:
            out["partial_sustained"] = sustained
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1)

    args.save = save
    if args.replay_from:
        with open(args.replay_from) as fh:
            out["trained"] = trained = json.load(fh)["trained"]
    else:
        trained = part_trained(args, dev, dtype, sync) if not args.skip_trained else {"rows": []}
    out["trained"] = trained
    if not args.skip_wide:
        out["wide"] = part_wide(args, dev, dtype, sync, trained["rows"])
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
