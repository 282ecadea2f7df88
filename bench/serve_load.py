"""Load test of a running `k3c serve`: concurrent streaming clients through the official `openai` client.

    k3c serve examples/k3-stdlib --port 8000 &
    python bench/serve_load.py --url http://127.0.0.1:8000/v1 --model k3-stdlib --clients 64 --max-tokens 32 --check

`--clients` streaming completions start at once, with mixed prompt lengths that share one prefix (a code-file
header); every `--disconnect-every`-th client closes its stream after a few tokens. Reports throughput (generated
tokens / wall time of the whole round), TTFT and inter-token latency p50 / p90 / p99 as the clients saw them, and
with --check whether every completed stream equals its prompt's single-request greedy output (taken first, one
request at a time, not streamed). Localhost only; bounded by --timeout.

--mixed: the engine in this process (no server), the workload chunked prefill is for: --streams sequences decode
while --long prompts of --long-min to --long-max tokens (log-uniform) arrive every --arrive-ms; each configuration
runs the same workload on the same graph; --compare runs the step budget off (the engine before it: whole prompts,
one call per segment length), then on (--max-step-tokens, --itl-target-ms, packed steps: decode rows and chunks in
one call), in one invocation; --split adds the budget with one call per segment length. Reports per configuration
the inter-token latency p50/p90/p99 of every request's consecutive tokens after the first long prompt arrived (as
the engine emitted them: no HTTP), TTFT p50/p90 of the long prompts (arrival to first token), total tokens/s (prompt
and generated tokens the engine ran over the wall time) and generated tokens/s, peak GPU memory
(torch.cuda.max_memory_allocated; None on a CPU), the most tokens one step ran, and how many decode calls replayed a
captured CUDA graph.

    python bench/serve_load.py --mixed --spec examples/k3-wide.yaml --device cuda --streams 32 --long 16 \
        --compare --out bench/serve-mixed-h200.json
    python bench/serve_load.py --mixed --spec examples/k3-wide.yaml --device cuda --streams 0 --long 32 \
        --long-min 2048 --long-max 2048 --arrive-ms 0 --compare     # 32 x 2048 at once: peak memory
    python bench/serve_load.py --mixed --spec examples/k3-tiny.yaml --device cpu --no-kernels --small   # CI size
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

HEADER = ('"""Helpers shared by the standard library\'s tests.\n\nEach function here is small; read the code.\n"""\n'
          "import os\nimport sys\n")
BODIES = ["", "import re\n", "def main():\n    ", "class Config(object):\n    def __init__(self",
          "from typing import Any\n\n\ndef load(path):\n    with open(path) as f:\n        ",
          "x = [1, 2, 3]\nfor i in x:\n", "# TODO: faster\ndef fib(n):\n    if n < 2:\n        return n\n    ",
          "try:\n    import json\nexcept ImportError:\n    json = None\n\n\nclass Error(Exception):\n    "]


def prompts(count: int = len(BODIES)) -> list[str]:
    """`count` prompts of mixed lengths behind one shared header."""
    return [HEADER + BODIES[i % len(BODIES)] + ("\n" * (i // len(BODIES))) for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


async def _one(client, model: str, prompt: str, max_tokens: int, disconnect_after: int | None) -> dict:
    t0 = time.perf_counter()
    stamps, text, finish = [], [], None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    tokens = 0
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.text:
                stamps.append(time.perf_counter())
                text.append(choice.text)
            finish = choice.finish_reason or finish
            if disconnect_after is not None and len(stamps) >= disconnect_after:
                break
    finally:
        await stream.close()
    return {"prompt": prompt, "text": "".join(text), "finish": finish, "disconnected": disconnect_after is not None,
            "ttft": stamps[0] - t0 if stamps else None,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "chunks": len(stamps), "tokens": tokens}


async def reference(client, model: str, texts: list[str], max_tokens: int) -> dict[str, str]:
    """Each distinct prompt's greedy completion, one request at a time."""
    out = {}
    for p in dict.fromkeys(texts):
        r = await client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0)
        out[p] = r.choices[0].text
    return out


async def run_load(base_url: str, model: str, *, clients: int = 64, max_tokens: int = 32,
                   disconnect_every: int = 8, api_key: str = "none", check: bool = True,
                   timeout: float = 600.0, reference_texts: dict[str, str] | None = None) -> dict:
    from openai import AsyncOpenAI

    texts = prompts(clients)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0) as client:
        ref = (reference_texts if reference_texts is not None else await reference(client, model, texts, max_tokens)
               ) if check else {}
        t0 = time.perf_counter()
        runs = await asyncio.wait_for(asyncio.gather(*[
            _one(client, model, p, max_tokens, 3 if disconnect_every and i % disconnect_every == 1 else None)
            for i, p in enumerate(texts)]), timeout)
        wall = time.perf_counter() - t0
    done = [r for r in runs if not r["disconnected"]]
    wrong = [{"prompt": r["prompt"], "got": r["text"], "want": ref[r["prompt"]]} for r in done
             if check and r["text"] != ref[r["prompt"]]]
    ttft = [r["ttft"] for r in runs if r["ttft"] is not None]
    itl = [x for r in runs for x in r["itl"]]
    return {
        "clients": clients, "max_tokens": max_tokens, "completed": len(done),
        "disconnected": len(runs) - len(done), "finished": sum(r["finish"] is not None for r in done),
        "wrong": wrong, "checked": check, "wall_s": wall, "reference": ref,
        "tokens_per_s": sum(r["tokens"] for r in done) / wall,      # completed streams' usage counts
        "ttft_ms": {f"p{q}": percentile(ttft, q) * 1e3 for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": percentile(itl, q) * 1e3 for q in (50, 90, 99)},
        "itl_mean_ms": statistics.fmean(itl) * 1e3 if itl else None,
    }


# ---- --mixed: long prompts arriving while streams decode, the engine in this process ---------------------------
def mixed_workload(vocab: int, *, streams: int, stream_prompt: int, long: int, long_min: int, long_max: int,
                   seed: int) -> dict:
    """Token ids: the streams' prompts and the long prompts (lengths log-uniform in [long_min, long_max])."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [round(math.exp(math.log(long_min) + float(torch.rand((), generator=g))
                              * (math.log(long_max) - math.log(long_min)))) for _ in range(long)]
    return {"streams": [torch.randint(0, vocab, (stream_prompt,), generator=g).tolist() for _ in range(streams)],
            "long": [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]}


def run_mixed(make_engine, work: dict, *, long_new: int, stream_new: int, arrive_s: float, warm_steps: int,
              device: str) -> dict:
    """One configuration: the streams join and decode for `warm_steps` steps (graphs captured), then a long prompt
    arrives every `arrive_s` seconds (wall clock); ends when every long prompt has `long_new` tokens (the streams
    are then finished). Figures as the module's docstring says."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    eng = make_engine()
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
    streams = [eng.add_request(p, stream_new) for p in work["streams"]]
    for _ in range(warm_steps):
        eng.step()
    sync()
    stamps: dict[int, list[float]] = {}
    arrived: dict[int, float] = {}
    pending = list(work["long"])
    longs: list[int] = []
    before = dict(eng.stats)
    t0 = next_at = time.perf_counter()
    most = 0
    while pending or any(len(stamps.get(r, ())) < long_new for r in longs):
        now = time.perf_counter()
        while pending and now >= next_at:
            rid = eng.add_request(pending.pop(0), long_new)
            longs.append(rid)
            arrived[rid] = now
            next_at += arrive_s
        if not eng.has_work():
            time.sleep(min(0.001, max(0.0, next_at - now)))
            continue
        outs = eng.step()
        t = time.perf_counter()
        most = max(most, eng.last_plan.decode_tokens + eng.last_plan.prefill_tokens)
        for o in outs:
            if o.error is not None:
                raise o.error
            stamps.setdefault(o.rid, []).append(t)
    sync()
    wall = time.perf_counter() - t0
    ended_early = sum(1 for r in streams if r not in eng.seqs)
    for r in streams:
        if r in eng.seqs:
            eng.finish(r)
    ran = {k: v - before.get(k, 0) for k, v in eng.stats.items()}
    itl = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    ttft = [stamps[r][0] - arrived[r] for r in longs]
    tokens = ran.get("prefill_tokens", 0) + ran.get("decode_tokens", 0) + ran.get("verify_tokens", 0)
    return {"max_step_tokens": eng.max_step_tokens, "itl_target_ms": eng.itl_target_ms, "wall_s": wall,
            "itl_ms": {f"p{q}": percentile(itl, q) * 1e3 for q in (50, 90, 99)},
            "itl_p99_over_p50": percentile(itl, 99) / percentile(itl, 50) if itl else None,
            "ttft_long_ms": {f"p{q}": percentile(ttft, q) * 1e3 for q in (50, 90)},
            "tokens_per_s": tokens / wall, "generated_tokens_per_s": sum(len(v) for v in stamps.values()) / wall,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "most_step_tokens": most, "steps": ran.get("steps", 0), "streams_ended_early": ended_early,
            # decode calls that replayed a captured CUDA graph (the decode rows of a step with a chunk included, when
            # steps are not packed); mixed calls: packed steps (decode rows and chunks in one call)
            "decode_calls": ran.get("decode_calls", 0), "decode_graph_calls": ran.get("decode_graph_calls", 0),
            "mixed_calls": ran.get("mixed_calls", 0),
            "long_prompt_tokens": [len(p) for p in work["long"]]}


def mixed_main(args) -> dict:
    import torch

    import k3c
    from k3c.runtime.devices import target_for
    from k3c.runtime.engine import Engine
    from k3c.runtime.session import load_graph

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from e2e import make_weights

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("serve_load: --device cuda: no CUDA device here")
    if not cuda:               # a CPU's tiny ops: threads contending cost more than they give (issue 59)
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    spec = k3c.load_spec(args.spec)
    dev = torch.device(args.device)
    model = k3c.compile(spec, target=target_for(dev).name if cuda else "cpu")
    w = make_weights(spec, model.module, args.device, dtype, reference=False)
    graph = load_graph(model, w, dev, not args.no_kernels)
    work = mixed_workload(spec.vocab_size, streams=args.streams, stream_prompt=args.stream_prompt, long=args.long,
                          long_min=args.long_min, long_max=args.long_max, seed=args.seed)
    ps = args.page_size or target_for(dev).mla_page_size
    max_ctx = max(args.long_max + args.long_new, args.stream_prompt + args.stream_new)
    pages = sum(-(-(len(p) + args.stream_new) // ps) + 1 for p in work["streams"]) + \
        sum(-(-(len(p) + args.long_new) // ps) + 1 for p in work["long"])
    batch = max(1, args.streams + args.long)
    # (name, budget, latency target, packed steps): "off" is the engine before the budget (whole prompts, a call per
    # segment length); "split" the budget with a call per segment length; "on" the budget with packed steps
    configs = [("off", None, None, False)] if args.compare else []
    if args.split:
        configs.append(("split", args.max_step_tokens, args.itl_target_ms, False))
    configs.append(("on", args.max_step_tokens, args.itl_target_ms, True))

    def engine(budget, target, packed):
        return lambda: Engine(model, w, device=args.device, max_batch=batch, max_context=max_ctx, num_pages=pages,
                              page_size=args.page_size, use_kernels=not args.no_kernels, graph=graph,
                              kv_dtype=args.kv_dtype, max_step_tokens=budget, itl_target_ms=target,
                              packed_steps=packed)

    mixed = dict(long_new=args.long_new, stream_new=args.stream_new, warm_steps=args.warm_steps, device=args.device)
    if args.warmup:           # JIT and first launches off the clock: two long prompts of the shortest length
        warm = mixed_workload(spec.vocab_size, streams=min(args.streams, 2), stream_prompt=args.stream_prompt,
                              long=2, long_min=args.long_min, long_max=args.long_min, seed=args.seed + 1)
        for _, budget, target, packed in configs:
            run_mixed(engine(budget, target, packed), warm, arrive_s=0.0, **mixed)
    print(f"{spec.name} on {args.device} ({str(dtype)[6:]}): {args.streams} streams decoding, {args.long} prompts of "
          f"{args.long_min}-{args.long_max} tokens every {args.arrive_ms:g} ms")
    print(f"{'budget':>14s} | {'ITL p50/p90/p99 ms':>22s} {'p99/p50':>7s} | {'TTFT long p50 ms':>16s} | "
          f"{'tok/s':>9s} {'gen tok/s':>9s} | {'peak GiB':>8s} {'max step':>8s}")
    out = {"spec": spec.name, "device": args.device, "dtype": str(dtype)[6:], "args": vars(args), "configs": {}}
    for name, budget, target, packed in configs:
        try:
            r = run_mixed(engine(budget, target, packed), work, arrive_s=args.arrive_ms / 1e3, **mixed)
        except torch.cuda.OutOfMemoryError as exc:     # the budget-off run of a large burst may not fit: say so
            out["configs"][name] = {"max_step_tokens": budget, "error": f"out of memory: {str(exc).splitlines()[0]}"}
            print(f"{name:>14s} | out of memory ({str(exc).splitlines()[0][:100]})", flush=True)
            torch.cuda.empty_cache()
            continue
        out["configs"][name] = r
        i = r["itl_ms"]
        label = "off" if budget is None else f"{budget}" + (f" <{target:g}ms" if target else "") + \
            ("" if packed else " split")
        peak = f"{r['peak_gpu_bytes'] / 2**30:8.2f}" if r["peak_gpu_bytes"] is not None else f"{'-':>8s}"
        print(f"{label:>14s} | {i['p50']:6.1f} {i['p90']:7.1f} {i['p99']:7.1f} {r['itl_p99_over_p50'] or 0:7.2f} | "
              f"{r['ttft_long_ms']['p50']:16.1f} | {r['tokens_per_s']:9.0f} {r['generated_tokens_per_s']:9.1f} | "
              f"{peak} {r['most_step_tokens']:8d}", flush=True)
        if args.out:                              # after every configuration: a run cut short keeps what it measured
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


def _mixed_args(ap) -> None:
    m = ap.add_argument_group("--mixed (the engine in this process)")
    m.add_argument("--mixed", action="store_true", help="long prompts arriving while streams decode, in-process")
    m.add_argument("--spec", default="examples/k3-wide.yaml")
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", choices=("bfloat16", "float32"))
    m.add_argument("--kv-dtype", default="auto")
    m.add_argument("--no-kernels", action="store_true")
    m.add_argument("--page-size", type=int, help="MLA page size (default the device target's)")
    m.add_argument("--streams", type=int, default=32, help="sequences decoding throughout (default 32)")
    m.add_argument("--stream-prompt", type=int, default=256, help="their prompt tokens (default 256)")
    m.add_argument("--stream-new", type=int, default=2048, help="their most new tokens (default 2048)")
    m.add_argument("--long", type=int, default=16, help="long prompts arriving (default 16)")
    m.add_argument("--long-min", type=int, default=2048)
    m.add_argument("--long-max", type=int, default=16384)
    m.add_argument("--long-new", type=int, default=32, help="tokens each long prompt generates (default 32)")
    m.add_argument("--arrive-ms", type=float, default=250.0, help="gap between long prompts' arrivals")
    m.add_argument("--warm-steps", type=int, default=8, help="decode steps of the streams before the first arrival")
    m.add_argument("--max-step-tokens", type=int, default=2048, help="the budget of the 'on' configuration")
    m.add_argument("--itl-target-ms", type=float, help="its latency target (default none)")
    m.add_argument("--compare", action="store_true", help="run the budget off first, then on, same workload")
    m.add_argument("--split", action="store_true",
                   help="also the budget with one call per segment length (packed_steps=False) before 'on'")
    m.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="an untimed short pass of each configuration first (default on)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (default 1)")
    m.add_argument("--small", action="store_true", help="CI size: 4 streams, 3 prompts of 40-90 tokens, budget 24")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _mixed_args(ap)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", help="the served model id (HTTP mode)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnect-every", type=int, default=8, help="every N-th client leaves early (0: none)")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--check", action="store_true", help="compare each completed stream with its greedy reference")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", help="write the summary as JSON")
    args = ap.parse_args(argv)
    if args.mixed:
        if args.small:
            args.streams, args.stream_prompt, args.stream_new, args.long = 4, 8, 256, 3
            args.long_min, args.long_max, args.long_new, args.arrive_ms = 40, 90, 4, 0.0
            args.max_step_tokens, args.page_size, args.warm_steps = 24, args.page_size or 8, 2
        return mixed_main(args)
    if args.model is None:
        ap.error("--model is required (the served model id), unless --mixed")
    res = asyncio.run(run_load(args.url, args.model, clients=args.clients, max_tokens=args.max_tokens,
                               disconnect_every=args.disconnect_every, api_key=args.api_key, check=args.check,
                               timeout=args.timeout))
    print(f"{res['clients']} streaming clients x {res['max_tokens']} tokens: {res['completed']} completed, "
          f"{res['disconnected']} disconnected early, {len(res['wrong'])} differing from the greedy reference"
          f"{'' if res['checked'] else ' (not checked)'}; {res['wall_s']:.2f} s, {res['tokens_per_s']:.1f} tokens/s "
          f"(completed streams); TTFT p50/p90/p99 {res['ttft_ms']['p50']:.0f}/{res['ttft_ms']['p90']:.0f}/"
          f"{res['ttft_ms']['p99']:.0f} ms; inter-token p50/p90/p99 {res['itl_ms']['p50']:.1f}/"
          f"{res['itl_ms']['p90']:.1f}/{res['itl_ms']['p99']:.1f} ms")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({k: v for k, v in res.items() if k != "reference"}, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
