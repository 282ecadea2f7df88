"""Sharded prefill / decode throughput and time in collectives (TP x EP on torch.distributed; docs/distributed.md).

    python bench/dist.py --tp 1 --device cuda                         # one GPU today (NCCL group of one rank)
    python bench/dist.py --tp 8 --ep 8 --device cuda --spec examples/kimi-linear-48b.yaml --out dist.json
    torchrun --nproc-per-node 8 bench/dist.py --tp 8 --ep 8 --device cuda   # or one process per rank under torchrun
    python bench/dist.py --tp 2 --ep 2 --device cpu --prompt-len 32 --decode 4   # gloo, tiny, CPU

Each rank compiles its slice (`shard` pass), generates only its slice of the random weights, then runs: warm-up,
timed prefill (`--reps` times) and decode steps for throughput (no synchronisation inside), then the same once
more with every collective synchronised and timed (`collective_s`: time inside all_reduce / all_gather, and the
share of the step it is). Rank 0 prints a table and writes JSON (per-rank rows included).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, device: str, a: dict) -> dict:
    import k3c
    from k3c.runtime.distributed import init_sharded_weights, state

    dtype = getattr(torch, a["dtype"])
    target = "h200" if device.startswith("cuda") else "cpu"
    model = k3c.compile(a["spec"], target=target, tp=a["tp"], ep=a["ep"], rank=rank)
    w = init_sharded_weights(model, seed=0, dtype=dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in w.values())
    sess = model.session(w, device=device, max_batch=a["batch"], max_context=a["prompt_len"] + a["decode"] + 1,
                         use_kernels=a["kernels"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.spec.vocab_size, (a["batch"], a["prompt_len"]), generator=g)
    st = state()

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def prefill() -> float:
        sync()
        t0 = time.perf_counter()
        logits = sess.prefill(ids)
        sync()
        return time.perf_counter() - t0, logits

    def decode(first: torch.Tensor) -> float:
        tok = first
        sync()
        t0 = time.perf_counter()
        for _ in range(a["decode"]):
            tok = sess.decode(tok).argmax(-1)
        sync()
        return time.perf_counter() - t0

    _, logits = prefill()                         # warm-up (kernel compilation / caches)
    decode(logits[:, -1].argmax(-1))
    pre = [prefill() for _ in range(a["reps"])]
    pre_s = min(t for t, _ in pre)
    dec_s = decode(pre[-1][1][:, -1].argmax(-1))
    st.timing = True                              # timed collectives: synchronised, so measured apart
    st.seconds, st.calls = 0.0, 0
    pre_t, logits = prefill()
    pre_coll, pre_calls = st.seconds, st.calls
    st.seconds, st.calls = 0.0, 0
    dec_t = decode(logits[:, -1].argmax(-1))
    dec_coll, dec_calls = st.seconds, st.calls
    st.timing = False
    mem = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    return {"rank": rank, "device": device, "weight_bytes": weight_bytes, "peak_bytes": mem,
            "prefill_s": pre_s, "prefill_tok_s": a["batch"] * a["prompt_len"] / pre_s,
            "decode_s": dec_s, "decode_tok_s": a["batch"] * a["decode"] / dec_s,
            "prefill_collective_s": pre_coll, "prefill_collective_calls": pre_calls, "prefill_timed_s": pre_t,
            "decode_collective_s": dec_coll, "decode_collective_calls": dec_calls, "decode_timed_s": dec_t,
            "describe": sess.describe()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="examples/k3-tiny.yaml")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, help="default: = --tp")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32, help="decode steps")
    ap.add_argument("--reps", type=int, default=3, help="timed prefills (best kept)")
    ap.add_argument("--no-kernels", action="store_true", help="every op through torch (default: generated "
                    "kernels on cuda, torch on cpu where the interpreter would dominate)")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)

    from k3c.runtime.distributed import run_ranks

    cuda = args.device.startswith("cuda")
    a = {"spec": args.spec, "tp": args.tp, "ep": args.tp if args.ep is None else args.ep,
         "dtype": args.dtype or ("bfloat16" if cuda else "float32"), "batch": args.batch,
         "prompt_len": args.prompt_len, "decode": args.decode, "reps": args.reps,
         "kernels": cuda and not args.no_kernels}
    t0 = time.perf_counter()
    rows = run_ranks(_rank, a["tp"], a["ep"], (a,), device=args.device, timeout=3600)
    if rows[0]["rank"] != 0:
        return 0                                   # torchrun: rank 0 reports
    world = max(a["tp"], a["ep"])
    backend = "nccl" if cuda else "gloo"
    print(f"bench/dist.py: {args.spec} TP {a['tp']} x EP {a['ep']} ({world} ranks, {backend}) on {args.device}, "
          f"{a['dtype']}, batch {a['batch']} x prompt {a['prompt_len']}, {a['decode']} decode steps, "
          f"{'kernels' if a['kernels'] else 'torch ops'}; wall {time.perf_counter() - t0:.1f} s")
    print(f"  executor: {rows[0]['describe']}")
    print("| rank | weights MiB | prefill tok/s | decode tok/s | prefill coll. ms (calls, share) "
          "| decode coll. ms (calls, share) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ps = r["prefill_collective_s"] / r["prefill_timed_s"] if r["prefill_timed_s"] else 0.0
        ds = r["decode_collective_s"] / r["decode_timed_s"] if r["decode_timed_s"] else 0.0
        print(f"| {r['rank']} | {r['weight_bytes'] / 2**20:,.1f} | {r['prefill_tok_s']:,.1f} | "
              f"{r['decode_tok_s']:,.1f} | {r['prefill_collective_s'] * 1e3:.2f} ({r['prefill_collective_calls']}, "
              f"{ps:.0%}) | {r['decode_collective_s'] * 1e3:.2f} ({r['decode_collective_calls']}, {ds:.0%}) |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"config": a, "world": world, "backend": backend, "ranks": rows}, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
