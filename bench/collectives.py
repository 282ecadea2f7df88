"""Collective latency and bandwidth on the GPUs of one host (NCCL, one process per GPU): all_reduce and
reduce_scatter of bf16 messages from 2 KiB to 64 MiB, launched eagerly and replayed from a CUDA graph (how the
sharded decode step runs them). The small-message time is the per-collective latency `k3c plan` charges
(Target.collective_latency_s); the large-message rate is the link bandwidth it charges (Target.link_bytes_per_s).

    NCCL_NVLS_ENABLE=0 python bench/collectives.py --world 2 --json bench/collectives-h200x2.json
    python bench/collectives.py --world 2 --device cpu --sizes 2048 65536     # gloo, a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = [2 << 10, 16 << 10, 128 << 10, 1 << 20, 8 << 20, 64 << 20]     # bytes per rank (the input)


def _time(fn, iters: int, cuda: bool) -> float:
    """Median seconds of one fn() over `iters` timed batches of 10 calls."""
    fn()
    out = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / 10)
    return sorted(out)[len(out) // 2]


def _rank(rank: int, device: str, sizes: list[int], iters: int) -> list[dict]:
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        n = max(size // 2, world)
        n -= n % world
        x = torch.ones(n, dtype=torch.bfloat16, device=device)
        out = torch.empty(n // world, dtype=torch.bfloat16, device=device)
        ops = {"all_reduce": lambda: dist.all_reduce(x),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, x)}
        for name, fn in ops.items():
            row = {"op": name, "bytes": n * 2, "world": world, "eager_s": _time(fn, iters, cuda)}
            if cuda:                                  # 10 collectives captured in one graph, replayed
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        fn()
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(10):
                        fn()
                row["graph_s"] = _time(g.replay, iters, True) / 10
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="processes (one GPU each on cuda)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per rank")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.world < 2 or any(s < 2 for s in args.sizes) or args.iters < 1:
        raise SystemExit("bench/collectives.py: --world >= 2, --sizes >= 2 bytes and --iters >= 1")
    from k3c.commands.ranks import run_ranks

    rows = run_ranks(_rank, args.world, 1, (args.sizes, args.iters), device=args.device, timeout=900)[0]
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"bench/collectives.py: {args.world} x {gpu}, bf16, {'nccl' if args.device.startswith('cuda') else 'gloo'}")
    print("| op | bytes / rank | eager us | graph us | bus GB/s (graph or eager) |\n|---|---|---|---|---|")
    for r in rows:
        t = r.get("graph_s") or r["eager_s"]
        # bus bandwidth (nccl-tests): all_reduce moves 2 (n-1)/n x bytes per rank, reduce_scatter (n-1)/n
        f = (2 if r["op"] == "all_reduce" else 1) * (r["world"] - 1) / r["world"]
        r["bus_bytes_per_s"] = f * r["bytes"] / t
        g = f"{r['graph_s'] * 1e6:.1f}" if "graph_s" in r else "-"
        print(f"| {r['op']} | {r['bytes']:,} | {r['eager_s'] * 1e6:.1f} | {g} | {r['bus_bytes_per_s'] / 1e9:.1f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"world": args.world, "device": gpu, "rows": rows}, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
