"""Agentic replay: synthetic multi-turn sessions on the serving engine, with and without the prefix cache.

    python bench/agentic.py --spec examples/k3-wide.yaml --device cuda --out agentic.json
    python bench/agentic.py --spec examples/k3-tiny.yaml --device cpu --no-kernels          # small mode

Each session starts with a system prompt + task (--prompt tokens); every turn appends a tool output (--tool random
tokens) to the context so far (previous prompt + the generated answer) and generates a short answer (--answer
tokens, greedy). The turns of all sessions run as one wave of requests (continuous batching), turn after turn.
With the prefix cache, a turn resumes from the previous turn's finish checkpoint (KDA states + conv tails, shared MLA
pages) and prefills only the new part; without it, every turn prefills its whole context. Reports the prefix-cache
hit rate (share of prompt tokens taken from the cache), TTFT per turn and tokens/s, and whether both runs generated
the same answers. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run(model, w, graph, args, use_prefix: bool, n_turns: int) -> dict:
    from k3c.runtime.devices import target_for
    from k3c.runtime.engine import Engine
    from k3c.runtime.prefix_cache import PrefixCache

    ctx_max = args.prompt + args.turns * (args.tool + args.answer) + 1
    pc = PrefixCache(interval=args.interval, max_bytes=args.cache_bytes) if use_prefix else None
    # room for the running contexts and as much again for checkpoints (they pin pages until evicted)
    pages = 2 * args.sessions * -(-ctx_max // target_for(args.device).mla_page_size)
    eng = Engine(model, w, device=args.device, max_batch=args.sessions, max_context=ctx_max, num_pages=pages,
                 use_kernels=not args.no_kernels, prefix_cache=pc, graph=graph)
    g = torch.Generator().manual_seed(args.seed)
    contexts = [torch.randint(0, model.spec.vocab_size, (args.prompt,), generator=g).tolist()
                for _ in range(args.sessions)]
    tools = [[torch.randint(0, model.spec.vocab_size, (args.tool,), generator=g).tolist()
              for _ in range(args.sessions)] for _ in range(args.turns)]
    turns, answers = [], []
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    t_all = time.perf_counter()
    for k in range(n_turns):
        prompts = [c + tools[k][s] if k else c for s, c in enumerate(contexts)]
        sync()
        t0 = time.perf_counter()
        rids = [eng.add_request(p, args.answer) for p in prompts]
        seqs = [eng.seqs[r] for r in rids]
        before = dict(eng.stats)
        got = eng.run()
        sync()
        wall = time.perf_counter() - t0
        computed = eng.stats["prefill_tokens"] - before.get("prefill_tokens", 0)
        decoded = eng.stats["decode_tokens"] - before.get("decode_tokens", 0)
        ttft = [s.t_first - s.t_added for s in seqs]
        turns.append({"turn": k, "resumed_per_request": [s.resumed for s in seqs],
                      "prompt_tokens": sum(len(p) for p in prompts), "prefilled_tokens": computed,
                      "resumed_tokens": sum(s.resumed for s in seqs), "ttft_ms_mean": statistics.mean(ttft) * 1e3,
                      "ttft_ms_max": max(ttft) * 1e3, "wall_ms": wall * 1e3,
                      "tokens_per_s": (sum(len(p) for p in prompts) + decoded + len(rids)) / wall})
        answers.append([got[r] for r in rids])
        contexts = [p + got[r] for p, r in zip(prompts, rids)]
    total = time.perf_counter() - t_all
    out = {"prefix_cache": use_prefix, "turns": turns, "seconds": total,
           "generated_tokens": n_turns * args.sessions * args.answer, "answers": answers,
           "mla_modes": {f"{layer}:{mode}": n for (layer, mode), n in sorted(eng.mode_counts.items())}}
    if pc is not None:
        out["hit_rate"] = pc.hit_rate()
        out["prefix_stats"] = dict(pc.stats)
        out["checkpoint_bytes_device"] = pc.tier_bytes("device")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="examples/k3-wide.yaml")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--sessions", type=int, help="concurrent sessions (cuda 8, cpu 3)")
    ap.add_argument("--turns", type=int, help="turns per session (cuda 6, cpu 3)")
    ap.add_argument("--prompt", type=int, help="first prompt tokens (cuda 8192, cpu 48)")
    ap.add_argument("--tool", type=int, help="tool-output tokens appended per turn (cuda 1024, cpu 16)")
    ap.add_argument("--answer", type=int, help="generated tokens per turn (cuda 32, cpu 4)")
    ap.add_argument("--interval", type=int, default=32768, help="prefix-cache checkpoint interval")
    ap.add_argument("--cache-bytes", type=int, default=16 << 30, help="prefix-cache device budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    for name, gpu, cpu in (("sessions", 8, 3), ("turns", 6, 3), ("prompt", 8192, 48), ("tool", 1024, 16),
                           ("answer", 32, 4)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))

    import k3c
    from e2e import make_weights

    spec = k3c.load_spec(args.spec)
    model = k3c.compile(spec, target="h200" if cuda else "cpu")
    w = make_weights(spec, model.module, args.device, dtype, reference=False)     # k3c only: packed experts
    from k3c.runtime.session import load_graph

    graph = load_graph(model, w, torch.device(args.device), not args.no_kernels)
    run(model, w, graph, args, True, min(2, args.turns))          # warm-up: JIT and first-call costs off the clock
    runs = [run(model, w, graph, args, use_prefix, args.turns) for use_prefix in (True, False)]
    with_pc, without = runs
    same = sum(a == b for ta, tb in zip(with_pc["answers"], without["answers"]) for a, b in zip(ta, tb))
    n = args.turns * args.sessions
    print(f"{spec.name} on {args.device} ({str(dtype)[6:]}): {args.sessions} sessions x {args.turns} turns, prompt "
          f"{args.prompt}, +{args.tool} tool tokens and {args.answer} answer tokens per turn")
    print(f"{'turn':>4s} {'context':>9s} | {'prefilled':>9s} {'TTFT ms':>9s} {'tok/s':>9s} | {'prefilled':>9s} "
          f"{'TTFT ms':>9s} {'tok/s':>9s} | {'TTFT ratio':>10s}")
    print(f"{'':14s} | {'with prefix cache':^29s} | {'without':^29s} |")
    for a, b in zip(with_pc["turns"], without["turns"]):
        print(f"{a['turn']:4d} {a['prompt_tokens'] // args.sessions:9d} | {a['prefilled_tokens']:9d} "
              f"{a['ttft_ms_mean']:9.1f} {a['tokens_per_s']:9.1f} | {b['prefilled_tokens']:9d} "
              f"{b['ttft_ms_mean']:9.1f} {b['tokens_per_s']:9.1f} | {b['ttft_ms_mean'] / a['ttft_ms_mean']:9.2f}x")
    print(f"prefix-cache hit rate {with_pc['hit_rate']:.1%} of prompt tokens; total {with_pc['seconds']:.2f} s with, "
          f"{without['seconds']:.2f} s without; identical answers {same}/{n}")
    summary = summarize(with_pc, without)
    print(f"summary: TTFT (turns 1+) {summary['ttft_ms_later_turns_with']:.1f} ms with, "
          f"{summary['ttft_ms_later_turns_without']:.1f} ms without ({summary['ttft_speedup_later_turns']:.2f}x); "
          f"tokens/s {summary['tokens_per_s_with']:.1f} with, {summary['tokens_per_s_without']:.1f} without")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"spec": spec.name, "device": args.device, "dtype": str(dtype)[6:], "args": vars(args),
                       "summary": summary, "with_prefix_cache": with_pc, "without_prefix_cache": without,
                       "identical_answers": same, "requests": n}, fh, indent=2)
    return 0


def summarize(with_pc: dict, without: dict) -> dict:
    """The headline numbers: hit rate, mean TTFT of the turns after the first (where the cache can hit) and
    overall tokens/s (prompt + generated tokens over the wall time of all turns), with and without the cache."""
    def ttft(run):
        later = [t["ttft_ms_mean"] for t in run["turns"][1:]] or [t["ttft_ms_mean"] for t in run["turns"]]
        return statistics.mean(later)

    def tps(run):
        return sum(t["tokens_per_s"] * t["wall_ms"] / 1e3 for t in run["turns"]) / sum(t["wall_ms"] / 1e3
                                                                                          for t in run["turns"])

    out = {"hit_rate": with_pc["hit_rate"], "ttft_ms_later_turns_with": ttft(with_pc),
           "ttft_ms_later_turns_without": ttft(without), "tokens_per_s_with": tps(with_pc),
           "tokens_per_s_without": tps(without)}
    out["ttft_speedup_later_turns"] = out["ttft_ms_later_turns_without"] / out["ttft_ms_later_turns_with"]
    return out


if __name__ == "__main__":
    sys.exit(main())
