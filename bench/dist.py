"""Sharded prefill / decode throughput, time in collectives and logits against the one-rank run (TP x EP on
torch.distributed; docs/distributed.md).

    python bench/dist.py --configs 1x1,2x1,1x2,2x2 --spec examples/k3-wide.yaml --device cuda --out dist.json
    python bench/dist.py --tp 8 --ep 8 --device cuda --spec examples/kimi-linear-48b.yaml
    torchrun --nproc-per-node 8 bench/dist.py --tp 8 --ep 8 --device cuda   # one process per rank under torchrun
    python bench/dist.py --configs 1x1,2x2 --device cpu --prompt-len 32 --decode 4   # gloo, tiny, CPU

`--configs` lists TP x EP layouts run one after the other (max(tp, ep) processes each; NCCL with one GPU per rank
on CUDA, gloo on a CPU). Each rank compiles its slice (`shard` pass) and draws only its slice of the random weights
(on a GPU, drawn there: the same values for every layout). Then: warm-up, timed prefill (`--reps`, best kept) and
decode steps (no synchronisation inside), then the same once more with every collective synchronised and timed
(`collective_s`: time inside the collectives and its share of the step). The decode inputs are fixed tokens (not
argmax), so every layout sees the same inputs: rank 0's prefill last-token logits and every decode step's logits
are compared with the first layout's (relative error, max over steps). Speed-up and scaling efficiency are against
the first layout that ran (efficiency = speed-up / ranks). Rank 0 of each layout reports; the JSON is rewritten after each.
On cuda the decode steps run through CUDA graphs by default (k3c.runtime.cuda_graph.DecodeGraph: the NCCL
collectives are captured with the kernels); the eager decode is timed beside them (`--no-cuda-graphs`: eager only).
`--routing-replay` runs the compared passes once more, untimed, with the first layout's expert choices replayed
(k3c.runtime.routing_replay): the logits error that is left without top-k flips, and how many choices flipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, device: str, a: dict) -> dict:
    import k3c
    from k3c.commands.ranks import compile_target
    from k3c.runtime.distributed import init_sharded_weights, state

    dtype = getattr(torch, a["dtype"])
    t0 = time.perf_counter()
    model = k3c.compile(a["spec"], target=compile_target(device), tp=a["tp"], ep=a["ep"], rank=rank)
    t_compile = time.perf_counter() - t0
    w = init_sharded_weights(model, seed=0, dtype=dtype, device=device)
    weight_bytes = sum(t.numel() * t.element_size() for t in w.values())
    sess = model.session(w, device=device, max_batch=a["batch"], max_context=a["prompt_len"] + 2 * a["decode"] + 2,
                         use_kernels=a["kernels"])
    del w                                         # expert stacks were quantized at load: drop the float copies
    g = torch.Generator().manual_seed(0)          # the same inputs on every rank and in every layout
    ids = torch.randint(0, model.spec.vocab_size, (a["batch"], a["prompt_len"]), generator=g)
    toks = torch.randint(0, model.spec.vocab_size, (a["decode"], a["batch"]), generator=g)
    st = state()

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def prefill():
        sync()
        t0 = time.perf_counter()
        logits = sess.prefill(ids)
        sync()
        return time.perf_counter() - t0, logits[:, -1]

    graph = None                                  # --cuda-graphs: the decode steps replayed (collectives too)

    def decode(keep: bool = False, eager: bool = False):
        nonlocal graph
        step = sess.decode
        if a.get("graphs") and not eager:
            from k3c.runtime.cuda_graph import DecodeGraph

            if graph is None:                        # captured on its first step (the warm-up pass)
                graph = DecodeGraph.for_session(sess, capacity=a["prompt_len"] + a["decode"] + 1)
            else:
                graph.load(sess.cache)               # this prefill's state into the static buffers
            step = graph.step
        outs = []
        sync()
        t0 = time.perf_counter()
        for s in range(a["decode"]):
            out = step(toks[s])
            if keep:
                outs.append(out.float().cpu())
        sync()
        return time.perf_counter() - t0, outs

    t0 = time.perf_counter()
    prefill()                                     # warm-up (kernel compilation / caches)
    decode()
    if a.get("graphs"):                           # the eager decode's own launch paths, before it is timed
        prefill()
        decode(eager=True)
    t_warm = time.perf_counter() - t0
    pre = [prefill() for _ in range(a["reps"])]
    pre_s, last = min(t for t, _ in pre), pre[-1][1].float().cpu()
    dec_s, dec_logits = decode(keep=rank == 0)   # cache: prompt + decode steps (the timed pass copies to host
    prefill()                                     # after each step only on rank 0: a sync it would not have;
    dec_s = min(dec_s, decode()[0])              # the second, copy-free pass is kept when faster)
    eager_s = None
    if graph is not None:                         # the same steps run eagerly, for the graphs' gain
        prefill()
        eager_s = decode(eager=True)[0]
    st.timing = True                              # timed collectives: synchronised, so measured apart (eagerly)
    st.seconds, st.calls = 0.0, 0
    pre_t, _ = prefill()
    pre_coll, pre_calls = st.seconds, st.calls
    st.seconds, st.calls = 0.0, 0
    dec_t, _ = decode(eager=True)
    dec_coll, dec_calls = st.seconds, st.calls
    st.timing = False
    mem = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    replay = _replay_check(a, rank, device, prefill, decode)
    row = {"rank": rank, "device": device, "weight_bytes": weight_bytes, "peak_bytes": mem,
           "compile_s": t_compile, "warmup_s": t_warm,
           "prefill_s": pre_s, "prefill_tok_s": a["batch"] * a["prompt_len"] / pre_s,
           "decode_s": dec_s, "decode_tok_s": a["batch"] * a["decode"] / dec_s,
           "prefill_collective_s": pre_coll, "prefill_collective_calls": pre_calls, "prefill_timed_s": pre_t,
           "decode_collective_s": dec_coll, "decode_collective_calls": dec_calls, "decode_timed_s": dec_t,
           "decode_eager_tok_s": a["batch"] * a["decode"] / eager_s if eager_s else None,
           "decode_graph": str(graph.report) if graph is not None else None,
           "describe": sess.describe(), **{k: v for k, v in replay.items() if k != "replay_logits"}}
    if rank == 0:
        # [B, V], [steps, B, V], float32 as numpy: a tensor through the result queue would live in shared memory
        # owned by this process, which exits right after
        row["logits"] = (last.numpy(), torch.stack(dec_logits).numpy())
        if "replay_logits" in replay:
            row["replay_logits"] = replay["replay_logits"]
    return row


def _replay_check(a: dict, rank: int, device: str, prefill, decode) -> dict:
    """--routing-replay: once more, untimed, the compared prefill and decode steps. The first layout records every
    router call's experts (rank 0 saves them); a later layout replays them, so its logits differ from the first's
    only by rounding, not by flipped expert choices, and counts the tokens whose own choice differed (flips)."""
    from k3c.runtime.routing_replay import RoutingReplay, load_routes

    path = a.get("replay_path")
    if not path or (a["replay_mode"] == "replay" and not os.path.exists(path)):
        return {}
    rr = RoutingReplay.record() if a["replay_mode"] == "record" else RoutingReplay.replay(load_routes(path, device))
    with rr:                                      # eagerly: a replay cannot run inside a captured graph
        _, last = prefill()
        _, outs = decode(keep=rank == 0, eager=True)
    if rr.mode == "record":
        if rank == 0:
            rr.save(path)
        return {"router_calls": rr.calls}
    out = {"router_calls": rr.calls, "routing_flips": rr.flips, "routing_decisions": rr.decisions}
    if rank == 0:
        out["replay_logits"] = (last.float().cpu().numpy(), torch.stack(outs).numpy())
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


DTYPES = ("bfloat16", "float16", "float32")


def parse_configs(text: str) -> list[tuple[int, int, str | None]]:
    """'1x1@float32,2x1' -> [(1, 1, 'float32'), (2, 1, None)] (None: --dtype)."""
    out = []
    for part in text.split(","):
        layout, _, dtype = part.partition("@")
        try:
            tp, ep = (int(x) for x in layout.lower().split("x"))
        except ValueError:
            raise SystemExit(f"bench/dist.py: --configs: '{part}' is not TPxEP[@dtype] (e.g. 2x1 or 1x1@float32)"
                             ) from None
        if dtype and dtype not in DTYPES:
            raise SystemExit(f"bench/dist.py: --configs: '{part}': dtype must be one of {', '.join(DTYPES)}")
        out.append((tp, ep, dtype or None))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="examples/k3-tiny.yaml")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, help="default: = --tp")
    ap.add_argument("--configs", help="layouts TPxEP, comma separated, run in turn (e.g. 1x1,2x1,1x2,2x2); the "
                    "first is the baseline for logits and speed-up; TPxEP@dtype runs that layout in another dtype, "
                    "e.g. 1x1@float32,1x1,2x1 measures bf16's own error beside the sharded one (default: --tp x --ep)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32, help="decode steps")
    ap.add_argument("--reps", type=int, default=3, help="timed prefills (best kept)")
    ap.add_argument("--no-kernels", action="store_true", help="every op through torch (default: generated "
                    "kernels on cuda, torch on cpu where the interpreter would dominate)")
    ap.add_argument("--routing-replay", action="store_true", help="also run the compared prefill and decode once "
                    "more with the first layout's expert choices replayed (k3c.runtime.routing_replay): the logits "
                    "error without routing flips, and the count of flipped choices")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="decode steps through CUDA graphs, the NCCL collectives captured with them (default: on "
                    "cuda with kernels); the eager decode is timed too")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)

    from k3c.commands.ranks import run_ranks

    if args.routing_replay and "WORLD_SIZE" in os.environ:
        raise SystemExit("bench/dist.py: --routing-replay spawns its layouts itself (the recording travels through a "
                         "file of the launching process): run it without torchrun")
    cuda = args.device.startswith("cuda")
    configs = (parse_configs(args.configs) if args.configs
               else [(args.tp, args.tp if args.ep is None else args.ep, None)])
    base = {"spec": args.spec, "dtype": args.dtype or ("bfloat16" if cuda else "float32"), "batch": args.batch,
            "prompt_len": args.prompt_len, "decode": args.decode, "reps": args.reps,
            "kernels": cuda and not args.no_kernels}
    base["graphs"] = base["kernels"] if args.cuda_graphs is None else args.cuda_graphs
    backend = "nccl" if cuda else "gloo"
    print(f"bench/dist.py: {args.spec} on {args.device} ({backend}), {base['dtype']}, batch {base['batch']} x "
          f"prompt {base['prompt_len']}, {base['decode']} decode steps, "
          f"{'kernels' if base['kernels'] else 'torch ops'}{', decode through CUDA graphs' if base['graphs'] else ''}",
          flush=True)
    report = {"config": {**base, "routing_replay": args.routing_replay}, "backend": backend, "layouts": []}
    ref = None
    tmp = tempfile.TemporaryDirectory(prefix="k3c-dist-") if args.routing_replay else None
    for tp, ep, dtype in configs:
        a = {**base, "tp": tp, "ep": ep, "dtype": dtype or base["dtype"]}
        if tmp is not None:
            a.update(replay_path=os.path.join(tmp.name, "routes.safetensors"),
                     replay_mode="record" if ref is None else "replay")
        world = max(tp, ep)
        t0 = time.perf_counter()
        try:
            rows = run_ranks(_rank, tp, ep, (a,), device=args.device, timeout=3600)
        except Exception as exc:                    # one layout failing (memory, say) is reported, not fatal
            msg = str(exc).strip().splitlines()
            print(f"TP {tp} x EP {ep}: failed: {msg[-1] if msg else type(exc).__name__}", flush=True)
            report["layouts"].append({"tp": tp, "ep": ep, "world": world, "error": "\n".join(msg[-20:])})
            continue
        if rows[0]["rank"] != 0:
            return 0                                # torchrun: rank 0 reports
        last, dec = (torch.from_numpy(x) for x in rows[0].pop("logits"))
        replayed = [torch.from_numpy(x) for x in rows[0].pop("replay_logits", ())]
        lay = {"tp": tp, "ep": ep, "dtype": a["dtype"], "world": world, "wall_s": time.perf_counter() - t0,
               "ranks": rows}
        if ref is None:
            ref = (_name(tp, ep, a["dtype"], base["dtype"]), last, dec, max(r["weight_bytes"] for r in rows))
        else:
            lay["vs"] = ref[0]
            # decode streams the weights: the speed-up a layout can reach is the drop in bytes its busiest rank reads
            lay["decode_weight_ceiling"] = ref[3] / max(r["weight_bytes"] for r in rows)
            lay["rel_err_prefill"] = rel(last, ref[1])
            lay["rel_err_decode_max"] = max(rel(d, r) for d, r in zip(dec, ref[2]))
            if replayed:
                lay["replay_rel_err_prefill"] = rel(replayed[0], ref[1])
                lay["replay_rel_err_decode_max"] = max(rel(d, r) for d, r in zip(replayed[1], ref[2]))
                lay["routing_flips"] = rows[0]["routing_flips"]
                lay["routing_decisions"] = rows[0]["routing_decisions"]
        report["layouts"].append(lay)
        _print_layout(lay, next(x for x in report["layouts"] if "ranks" in x), base["dtype"])
        if args.out:
            with open(args.out, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=2)
                fh.write("\n")
    return 0


def _num(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _name(tp: int, ep: int, dtype: str, default: str) -> str:
    return f"{tp}x{ep}" + ("" if dtype == default else f"@{dtype}")


def _print_layout(lay: dict, first: dict, default_dtype: str) -> None:
    r0 = lay["ranks"][0]
    dt = "" if lay["dtype"] == default_dtype else f", {lay['dtype']}"
    print(f"\nTP {lay['tp']} x EP {lay['ep']} ({lay['world']} ranks{dt}), wall {lay['wall_s']:.1f} s; "
          f"compile {r0['compile_s']:.1f} s, warm-up {r0['warmup_s']:.1f} s; executor: {r0['describe']}")
    if "vs" in lay:
        p0, d0 = first["ranks"][0]["prefill_tok_s"], first["ranks"][0]["decode_tok_s"]
        ps, ds = r0["prefill_tok_s"] / p0, r0["decode_tok_s"] / d0
        print(f"  vs {lay['vs']}: logits rel err prefill {lay['rel_err_prefill']:.2e}, decode (max over steps) "
              f"{lay['rel_err_decode_max']:.2e}; speed-up prefill {ps:.2f}x (efficiency {ps / lay['world']:.0%}), "
              f"decode {ds:.2f}x (efficiency {ds / lay['world']:.0%}; {ds / lay['decode_weight_ceiling']:.0%} of the "
              f"{lay['decode_weight_ceiling']:.2f}x that the weight bytes per rank allow)")
        if "routing_flips" in lay:
            print(f"  routing replayed from {lay['vs']}: logits rel err prefill {lay['replay_rel_err_prefill']:.2e}, "
                  f"decode (max) {lay['replay_rel_err_decode_max']:.2e}; tokens whose own expert choice differed: "
                  f"{lay['routing_flips']} of {lay['routing_decisions']} router decisions")
    if r0.get("decode_graph"):
        print(f"  decode graph: {r0['decode_graph']}")
    print("| rank | weights MiB | peak GiB | prefill tok/s | decode tok/s | eager decode tok/s "
          "| prefill coll. ms (calls, share) | decode coll. ms (calls, share; eager) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in lay["ranks"]:
        ps = r["prefill_collective_s"] / r["prefill_timed_s"] if r["prefill_timed_s"] else 0.0
        ds = r["decode_collective_s"] / r["decode_timed_s"] if r["decode_timed_s"] else 0.0
        peak = f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else "-"
        print(f"| {r['rank']} | {r['weight_bytes'] / 2**20:,.1f} | {peak} | {r['prefill_tok_s']:,.1f} | "
              f"{r['decode_tok_s']:,.1f} | {_num(r.get('decode_eager_tok_s'))} | "
              f"{r['prefill_collective_s'] * 1e3:.2f} ({r['prefill_collective_calls']}, {ps:.0%}) | "
              f"{r['decode_collective_s'] * 1e3:.2f} ({r['decode_collective_calls']}, {ds:.0%}) |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
