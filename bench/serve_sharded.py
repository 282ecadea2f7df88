"""Sharded serving against one process: `k3c serve --tp N --ep M` under bench/serve_load.py's load.

    python bench/serve_sharded.py --device cuda --configs 1x1,2x2,2x1                    # k3-stdlib, fp32: equality
    python bench/serve_sharded.py --device cuda --model examples/k3-wide.yaml --tokenizer examples/k3-stdlib \\
        --dtype bfloat16 --configs 1x1,2x2 --clients 64 --max-tokens 128 --no-check      # throughput (issue 58)

For each layout TPxEP in turn (1x1 = one process, no --tp), a server is started on a free port, the load runs
(`--clients` concurrent streams, every `--disconnect-every`-th leaving after 3 tokens), the server is stopped with
SIGTERM (it must exit 0). The first layout's texts are the reference: the first layout takes its prompts' greedy
texts one request at a time (bench/serve_load.py reference()), and every later layout's completed streams are
compared with them (--check, the default). Prints a table (tokens/s of the completed streams, TTFT and
inter-token p50, speed-up against the first layout, streams differing) and writes JSON (rewritten after every
layout, so a run cut short keeps what finished). A warm-up round runs first on each server (kernels, CUDA graphs
of every batch size), untimed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.serve_load import prompts, reference, run_load  # noqa: E402


def start(model: str, args: list[str], timeout: float) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "k3c.cli", "serve", model, "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("k3c serve ended:\n" + "".join(lines))
        lines.append(line)
        print("   ", line.rstrip(), flush=True)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1) + "/v1", lines
    proc.kill()
    raise RuntimeError(f"k3c serve did not start in {timeout:.0f} s")


def stop(proc: subprocess.Popen, lines: list[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    lines.append(out)
    return proc.returncode


async def _reference(url: str, model: str, clients: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600) as c:
        return await reference(c, model, prompts(clients), max_tokens)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "examples" / "k3-stdlib"))
    ap.add_argument("--tokenizer", help="tokenizer directory (a spec without one)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--configs", default="1x1,2x2,2x1", help="TPxEP layouts in turn; the first is the reference")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnect-every", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--no-check", action="store_true", help="no text comparison (random weights)")
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--out", default="bench/serve-sharded.json")
    args = ap.parse_args(argv)
    name = None
    rows: list[dict] = []
    ref: dict | None = None
    for cfg in args.configs.split(","):
        tp, ep = (int(x) for x in cfg.split("x"))
        flags = ["--device", args.device, "--dtype", args.dtype, "--max-batch", str(args.max_batch),
                 "--max-context", str(args.max_context)]
        if args.tokenizer:
            flags += ["--tokenizer", args.tokenizer]
        if tp * ep > 1:
            flags += ["--tp", str(tp), "--ep", str(ep)]
        print(f"== {cfg}: k3c serve {args.model} {' '.join(flags)}", flush=True)
        proc, url, lines = start(args.model, flags, args.start_timeout)
        try:
            if name is None:
                name = next(re.search(r"k3c serve: (\S+) on ", ln).group(1) for ln in lines
                            if re.search(r"k3c serve: (\S+) on ", ln))
            load = dict(clients=args.clients, max_tokens=args.max_tokens, disconnect_every=args.disconnect_every)
            if ref is None and not args.no_check:
                ref = asyncio.run(_reference(url, name, args.clients, args.max_tokens))
            asyncio.run(run_load(url, name, **load, check=False))                 # warm-up
            res = asyncio.run(run_load(url, name, **load, check=ref is not None, reference_texts=ref))
        finally:
            code = stop(proc, lines)
        row = {"config": cfg, "tp": tp, "ep": ep, "exit": code, "tokens_per_s": res["tokens_per_s"],
               "ttft_p50_ms": res["ttft_ms"]["p50"], "itl_p50_ms": res["itl_ms"]["p50"],
               "completed": res["completed"], "differing": len(res["wrong"]) if ref is not None else None,
               "wrong": res["wrong"][:4]}
        rows.append(row)
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        out = {"model": args.model, "device": args.device, "dtype": args.dtype, "clients": args.clients,
               "max_tokens": args.max_tokens, "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    print(f"\n{name} on {args.device}, {args.dtype}, {args.clients} streaming clients x {args.max_tokens} tokens")
    print(f"{'TPxEP':>6} {'tokens/s':>10} {'speed-up':>9} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'differing':>10} "
          f"{'exit':>5}")
    for r in rows:
        print(f"{r['config']:>6} {r['tokens_per_s']:>10.1f} {r['speedup']:>8.2f}x {r['ttft_p50_ms']:>12.1f} "
              f"{r['itl_p50_ms']:>11.2f} {str(r['differing']):>10} {r['exit']:>5}")
    return out


if __name__ == "__main__":
    main()
