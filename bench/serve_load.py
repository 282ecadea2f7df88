"""Load test of a running `k3c serve`: concurrent streaming clients through the official `openai` client.

    k3c serve examples/k3-stdlib --port 8000 &
    python bench/serve_load.py --url http://127.0.0.1:8000/v1 --model k3-stdlib --clients 64 --max-tokens 32 --check

`--clients` streaming completions start at once, with mixed prompt lengths that share one prefix (a code-file
header); every `--disconnect-every`-th client closes its stream after a few tokens. Reports throughput (generated
tokens / wall time of the whole round), TTFT and inter-token latency p50 / p90 / p99 as the clients saw them, and
with --check whether every completed stream equals its prompt's single-request greedy output (taken first, one
request at a time, not streamed). Localhost only; bounded by --timeout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnect-every", type=int, default=8, help="every N-th client leaves early (0: none)")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--check", action="store_true", help="compare each completed stream with its greedy reference")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", help="write the summary as JSON")
    args = ap.parse_args(argv)
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
