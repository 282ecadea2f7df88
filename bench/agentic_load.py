"""Agentic serving load, InferenceX-shaped: multi-turn sessions arriving over time, a concurrency sweep, and the KV
tiers and admission policy on and off.

    python bench/agentic_load.py --spec examples/k3-wide.yaml --device cuda --out bench/agentic-load-h200.json
    python bench/agentic_load.py --spec examples/k3-tiny.yaml --device cpu --no-kernels --small    # CI size

The workload keeps InferenceX's coding-agent ratios (median 142K input tokens per turn, 444 output tokens, 65 turns
per session) at 1/--scale of the tokens: a session's first prompt is a quarter of the median turn input and every
turn appends a tool output and the previous answer, so the median turn (turn T/2) sees the median input; a session
ends early rather than grow past 3x the median input (an agent compacts its context). Lengths and
turn counts are log-normal (sigma 0.5 prompt, 0.8 tool output, 0.6 answer and turns; turns capped at 2x the median);
--turns overrides the median turn count (the H200 run uses fewer turns than 65 to fit its time). Sessions arrive
with exponential gaps (mean --arrival-s) while fewer than C are live (C = the concurrency of the sweep point;
--sessions-factor x C sessions per point, default 2C); between turns a session runs its tool for an exponential time (mean --tool-s).

The MLA page pool is the "HBM budget": room for --budget sessions at the median turn's context (and at least one
longest request). Configurations (--configs):
  lru           prefix cache, least-recently-used eviction, checkpoints dropped when evicted
  lru+host      the same with a pinned host tier of --host-bytes (evicted checkpoints move there, pages stored once)
  working-set   the working-set policy (prefix_cache.py: active sessions' newest checkpoints protected for
                --protect-s, cold requests wait rather than evict them), no host tier
  ws+host       both
Per point: prefix-hit rate (prompt tokens taken from the cache; also over turns after the first), TTFT (submit to
first token: queueing included) and inter-token latency p50/p90/p99, tokens/s (prompt + generated tokens over the
wall time; generated tokens/s apart), KV throughput per turn (the turn's KV bytes, MLA rows of its whole context plus
its KDA states, over its prefill time = admission to first token), queue waits, tier traffic.

--virtual-clock: arrivals, tool times and the cache's protect_s run on a clock that advances --tick seconds per
engine step (and jumps to the next arrival when idle), so a run's hit rates do not depend on the machine's speed
(the CI test); latencies are still wall-clock.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {"lru": ("lru", False), "lru+host": ("lru", True), "working-set": ("working-set", False),
           "ws+host": ("working-set", True)}
INFERENCEX = {"input_median": 142_000, "output_median": 444, "turns_median": 65}


class Clock:
    """Seconds since the start: wall time, or virtual time that advances per engine step."""

    def __init__(self, virtual: bool, tick: float):
        self.virtual, self.tick, self.t, self.t0 = virtual, tick, 0.0, time.perf_counter()

    def __call__(self) -> float:
        return self.t if self.virtual else time.perf_counter() - self.t0

    def stepped(self) -> None:
        if self.virtual:
            self.t += self.tick

    def wait_until(self, t: float) -> None:
        if self.virtual:
            self.t = max(self.t, t)
        else:
            time.sleep(max(0.0, min(t - self(), 0.05)))


def lognormal(g: torch.Generator, median: float, sigma: float, low: int = 1, high: int | None = None) -> int:
    x = median * math.exp(sigma * float(torch.randn((), generator=g)))
    return int(max(low, min(high or 1 << 30, round(x))))


def workload(args, vocab: int, n_sessions: int, seed: int) -> list[dict]:
    """Sessions: first prompt tokens, per turn (tool tokens, answer length, tool seconds), the arrival gap."""
    g = torch.Generator().manual_seed(seed)
    turns_med = args.turns or INFERENCEX["turns_median"]
    inp = INFERENCEX["input_median"] / args.scale
    ans = max(1.0, INFERENCEX["output_median"] / args.scale)
    prompt = inp / 4
    tool = max(1.0, (inp - prompt) / (turns_med / 2) - ans)
    out = []
    cap = int(3 * inp)                   # an agent compacts its context before it grows past this
    for _ in range(n_sessions):
        n = lognormal(g, turns_med, 0.6, 2, 2 * turns_med)
        p0 = lognormal(g, prompt, 0.5, 8, cap // 2)
        turns, ctx = [], p0
        for k in range(n):
            t = lognormal(g, tool, 0.8) if k else 0
            a = lognormal(g, ans, 0.6)
            gap = float(torch.empty(()).exponential_(generator=g)) * args.tool_s
            if ctx + t + a > cap and turns:
                break
            turns.append((torch.randint(0, vocab, (t,), generator=g).tolist(), a, gap))
            ctx += t + a
        out.append({"prompt": torch.randint(0, vocab, (p0,), generator=g).tolist(), "turns": turns,
                    "arrival_gap": float(torch.empty(()).exponential_(generator=g)) * args.arrival_s})
    return out


def max_request(sessions) -> int:
    """The longest request's prompt + answer if every answer is as long as allowed (the engine's max_context)."""
    best = 0
    for s in sessions:
        ctx = len(s["prompt"])
        for tool, ans, _ in s["turns"]:
            ctx += len(tool)
            best = max(best, ctx + ans)
            ctx += ans
    return best


def median_context(sessions) -> int:
    ctxs = []
    for s in sessions:
        ctx = len(s["prompt"])
        for tool, ans, _ in s["turns"]:
            ctx += len(tool)
            ctxs.append(ctx + ans)
            ctx += ans
    return int(statistics.median(ctxs))


def pct(xs, q) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def run_point(model, w, graph, args, sessions, concurrency: int, config: str, num_pages: int, max_context: int):
    from k3c.runtime.engine import Engine
    from k3c.runtime.prefix_cache import PrefixCache

    policy, host = CONFIGS[config]
    clock = Clock(args.virtual_clock, args.tick)
    pc = PrefixCache(interval=args.interval, max_bytes=args.cache_bytes, host_bytes=args.host_bytes if host else 0,
                     policy=policy, protect_s=args.protect_s, clock=clock)
    eng = Engine(model, w, device=args.device, max_batch=args.max_batch, max_context=max_context,
                 num_pages=num_pages, page_size=args.page_size, use_kernels=not args.no_kernels, prefix_cache=pc, graph=graph,
                 kv_dtype=args.kv_dtype, admission=args.admission, max_step_tokens=args.max_step_tokens,
                 itl_target_ms=args.itl_target_ms)
    kv_row = eng.pool.page_bytes // eng.pool.page_size          # MLA bytes per token, every MLA layer
    kda_state = 0                                               # KDA states of a sequence: from a checkpoint
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    queue = list(range(len(sessions)))                          # sessions yet to arrive, in order
    next_arrival = sessions[0]["arrival_gap"]
    live: dict[int, dict] = {}                                  # session -> {context, turn}
    due: list = []                                              # heap of (time, session) of requests to submit
    by_rid: dict[int, dict] = {}
    turns, t_wall0 = [], time.perf_counter()
    tokens_in = tokens_out = 0
    while queue or live or eng.has_work():
        now = clock()
        while queue and len(live) < concurrency and next_arrival <= now:
            s = queue.pop(0)
            live[s] = {"context": list(sessions[s]["prompt"]), "turn": 0}
            heapq.heappush(due, (now, s))
            next_arrival = now + (sessions[queue[0]]["arrival_gap"] if queue else 0)
        while due and due[0][0] <= now:
            _, s = heapq.heappop(due)
            st = live[s]
            tool, ans, _ = sessions[s]["turns"][st["turn"]]
            prompt = st["context"] + tool
            rid = eng.add_request(prompt, ans)
            by_rid[rid] = {"session": s, "turn": st["turn"], "prompt": prompt, "t_submit": time.perf_counter(),
                           "times": [], "tokens": []}
        if not eng.has_work():
            waits = [t for t, _ in due[:1]] + ([next_arrival] if queue and len(live) < concurrency else [])
            if waits:
                clock.wait_until(min(waits))
            continue
        seqs = {rid: eng.seqs[rid] for rid in by_rid if rid in eng.seqs}
        outs = eng.step()
        clock.stepped()
        t = time.perf_counter()
        for o in outs:
            r = by_rid[o.rid]
            r["times"].append(t)
            r["tokens"].append(o.token)
            seq = seqs.get(o.rid)
            if seq is not None and "resumed" not in r:
                r.update(resumed=seq.resumed, tier=seq.resumed_tier,
                         prefill_s=t - seq.t_admitted, queued_s=seq.t_admitted - r["t_submit"])
            if o.finished:
                s, st = r["session"], live[r["session"]]
                st["context"] = r["prompt"] + r["tokens"]
                st["turn"] += 1
                tokens_in += len(r["prompt"])
                tokens_out += len(r["tokens"])
                ctx = len(r["prompt"])
                if not kda_state and pc.entries:
                    c = next(iter(pc.entries.values()))
                    kda_state = c.nbytes() - c.logits.numel() * c.logits.element_size()
                turns.append({"session": s, "turn": r["turn"], "prompt": ctx, "resumed": r["resumed"],
                              "tier": r["tier"], "ttft_s": r["times"][0] - r["t_submit"],
                              "queued_s": r["queued_s"], "prefill_s": r["prefill_s"],
                              "itl_s": [b - a for a, b in zip(r["times"], r["times"][1:])],
                              "kv_bytes": ctx * kv_row + kda_state})
                del by_rid[o.rid]
                if st["turn"] < len(sessions[s]["turns"]):
                    heapq.heappush(due, (clock() + sessions[s]["turns"][st["turn"] - 1][2], s))
                else:
                    del live[s]
    sync()
    wall = time.perf_counter() - t_wall0
    later = [t for t in turns if t["turn"] > 0]
    itl = [x for t in turns for x in t["itl_s"]]
    ttft = [t["ttft_s"] for t in turns]
    kvt = [t["kv_bytes"] / t["prefill_s"] for t in turns if t["prefill_s"] > 0]
    point = {"config": config, "concurrency": concurrency, "sessions": len(sessions), "turns": len(turns),
             "wall_s": wall, "hit_rate": pc.hit_rate(),
             "hit_rate_later_turns": (sum(t["resumed"] for t in later) / sum(t["prompt"] for t in later)
                                      if later else 0.0),
             "ttft_ms": {f"p{q}": 1e3 * pct(ttft, q) for q in (50, 90, 99)},
             "ttft_ms_later_turns": {f"p{q}": 1e3 * pct([t["ttft_s"] for t in later], q)
                                     for q in (50, 90, 99)}
             if later else None,
             "itl_ms": {f"p{q}": 1e3 * pct(itl, q) for q in (50, 90, 99)} if itl else None,
             "queued_ms_p50": 1e3 * pct([t["queued_s"] for t in turns], 50),
             "tokens_per_s": (tokens_in + tokens_out) / wall, "generated_tokens_per_s": tokens_out / wall,
             "kv_gb_per_s_p50": pct(kvt, 50) / 1e9 if kvt else None,
             "admission_waits": eng.stats["admission_waits"], "preempted": eng.stats["preempted"],
             "prefill_tokens": eng.stats["prefill_tokens"], "decode_tokens": eng.stats["decode_tokens"],
             "cache": {k: v for k, v in pc.stats.items()}, "per_turn": turns if args.per_turn else None}
    pc.clear()
    eng.pool.check_empty()
    return point


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="examples/k3-wide.yaml")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--admission", choices=("reserve", "optimistic"), default="reserve")
    ap.add_argument("--concurrency", default="4,8,12,16,24", help="live sessions per sweep point")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--budget", type=int, default=8, help="sessions the MLA page pool holds (the HBM budget)")
    ap.add_argument("--scale", type=float, default=32.0, help="InferenceX token counts divided by this")
    ap.add_argument("--turns", type=int, help="median turns per session (default InferenceX's 65)")
    ap.add_argument("--tool-s", type=float, default=0.3, help="mean tool time between turns (s)")
    ap.add_argument("--arrival-s", type=float, default=0.2, help="mean gap between session arrivals (s)")
    ap.add_argument("--protect-s", type=float, default=3.0, help="working-set policy: a session's newest "
                    "checkpoint stays protected this long after its last use (s)")
    ap.add_argument("--host-bytes", type=int, default=8 << 30)
    ap.add_argument("--cache-bytes", type=int, default=32 << 30, help="prefix-cache device budget (states + pages)")
    ap.add_argument("--interval", type=int, default=32768)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-step-tokens", type=int, help="the engine's step token budget (chunked prefill; default "
                    "none: whole prompts)")
    ap.add_argument("--itl-target-ms", type=float, help="the engine's inter-token latency target (default none)")
    ap.add_argument("--page-size", type=int, help="MLA page size (default the device target's)")
    ap.add_argument("--sessions-factor", type=float, default=2.0, help="sessions per point = this x C")
    ap.add_argument("--virtual-clock", action="store_true")
    ap.add_argument("--tick", type=float, default=0.01, help="virtual seconds per engine step")
    ap.add_argument("--small", action="store_true", help="CI size: tiny sessions, virtual clock, two points")
    ap.add_argument("--per-turn", action="store_true", help="keep every turn's figures in the JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.small:
        args.scale, args.turns, args.budget, args.virtual_clock, args.page_size = 1000.0, 10, 4, True, 8
        args.concurrency = "2,5" if args.concurrency == ap.get_default("concurrency") else args.concurrency
        args.tool_s, args.arrival_s, args.protect_s, args.max_batch = 0.05, 0.02, 1.0, 8
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: comma-separated integers expected, got {args.concurrency!r}")
    configs = args.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad or min(levels) < 1 or args.budget < 1 or args.scale <= 0:
        ap.error(f"--configs from {', '.join(CONFIGS)}; --concurrency, --budget, --scale positive (got {bad or ''})")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))

    import k3c
    from e2e import make_weights
    from k3c.runtime.devices import target_for
    from k3c.runtime.session import load_graph

    spec = k3c.load_spec(args.spec)
    model = k3c.compile(spec, target="h200" if cuda else "cpu")
    w = make_weights(spec, model.module, args.device, dtype, reference=False)
    graph = load_graph(model, w, torch.device(args.device), not args.no_kernels)
    work = {c: workload(args, spec.vocab_size, max(1, round(args.sessions_factor * c)), args.seed + c)
            for c in levels}
    warm = workload(args, spec.vocab_size, 2, args.seed + 10_000)
    every = [s for ss in work.values() for s in ss]
    ps = args.page_size or target_for(args.device).mla_page_size
    max_ctx = max_request(every + warm) + 1
    num_pages = max(args.budget * -(-median_context(every) // ps), -(-max_ctx // ps) + 1)
    # warm-up (JIT, graph captures) off the clock, on a short point
    run_point(model, w, graph, args, warm, 2, configs[0], num_pages, max_ctx)
    points = []
    print(f"{spec.name} on {args.device} ({str(dtype)[6:]}): InferenceX shape / {args.scale:g}, median turn input "
          f"{median_context(every)} tokens, longest request {max_ctx - 1}; pool {num_pages} pages of {ps} "
          f"(budget {args.budget} sessions at the median context)"
          + (f", virtual clock ({args.tick} s per step)" if args.virtual_clock else "")
          + (f"; step budget {args.max_step_tokens} tokens" if args.max_step_tokens else "")
          + (f" within {args.itl_target_ms:g} ms" if args.itl_target_ms else ""))
    print(f"{'config':>12s} {'C':>3s} | {'hit':>6s} {'later':>6s} | {'TTFT p50/p90/p99 ms':>24s} | "
          f"{'ITL p50/p90/p99 ms':>20s} | {'tok/s':>8s} {'KV GB/s':>8s} {'waits':>6s}")
    for c in levels:
        for config in configs:
            p = run_point(model, w, graph, args, work[c], c, config, num_pages, max_ctx)
            points.append(p)
            t, i = p["ttft_ms"], p["itl_ms"] or {"p50": 0, "p90": 0, "p99": 0}
            print(f"{config:>12s} {c:3d} | {p['hit_rate']:6.1%} {p['hit_rate_later_turns']:6.1%} | "
                  f"{t['p50']:7.1f} {t['p90']:7.1f} {t['p99']:8.1f} | {i['p50']:6.1f} {i['p90']:6.1f} {i['p99']:6.1f} | "
                  f"{p['tokens_per_s']:8.0f} {p['kv_gb_per_s_p50'] or 0:8.3g} {p['admission_waits']:6d}", flush=True)
            if args.out:                      # after every point: a run cut short keeps what it measured
                write(args, spec, dtype, num_pages, ps, max_ctx, every, points)
    return 0


def write(args, spec, dtype, num_pages, ps, max_ctx, every, points) -> None:
    with open(args.out, "w") as fh:
        json.dump({"spec": spec.name, "device": args.device, "dtype": str(dtype)[6:], "args": vars(args),
                   "num_pages": num_pages, "page_size": ps, "max_context": max_ctx,
                   "median_context": median_context(every), "points": points}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
