"""Decode step: the eager executor vs a CUDA-graph replay of the same step (k3c/runtime/cuda_graph.py).

    python bench/decode_graph.py --spec examples/k3-wide.yaml --batches 1,8 --cached 384 --steps 20 --capacity 1024

Per batch size: random KDA states and `--cached` random latent rows per sequence (no prefill), then the same
`--steps` teacher-forced decode steps (a fixed token per step) run (a) eagerly through the executor's ordinary
host-length path and (b) as graph replays, each from the same starting state. Prints ms per step of both, the
speedup, the capture time, and the largest relative error (per step: |a - b| / |b| over the logits, and the
largest element-wise error relative to max |b|) between them; also the error of the first step alone, and the
replay against the captured path run eagerly (device lengths, same grid: should be 0, i.e. the capture is exact).
With --capacity above the context the MLA decode grid differs from the eager call's (another split-KV merge
order): a ~1e-3 difference in one step that random bf16 weights amplify over the steps (MoE top-k flips).
--out writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="examples/k3-wide.yaml")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--cached", type=int, default=384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="eager steps before timing (JIT)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="tokens per sequence the graph holds (its largest bucket; default: just what the run needs). "
                         "Larger than the context, the MLA decode grid (split-KV count) differs from the eager one")
    ap.add_argument("--buckets", default="", help="extra bucket lengths (comma separated)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile N steps of the captured path run eagerly (the graph's kernels, device lengths) "
                         "with torch.profiler: GPU time per step by kernel family and the top kernels")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")

    import k3c
    from bench.e2e import make_weights
    from k3c.runtime.cuda_graph import DecodeGraph
    from k3c.reference.kda import KDAState

    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    spec = k3c.load_spec(args.spec)
    model = k3c.compile(spec, target="h200")
    w = make_weights(spec, model.module, "cuda", dtype, seed=0, reference=False)
    sess = model.session(w, device="cuda")
    del w
    print(f"{spec.name}: weights + graph in {time.perf_counter() - t0:.1f} s", flush=True)
    result = {"spec": spec.name, "gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "cached": args.cached,
              "steps": args.steps, "rows": []}
    cfg, mcfg = spec.kda, spec.mla
    extra = [int(b) for b in args.buckets.split(",") if b]
    for B in [int(b) for b in args.batches.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(B)
        kda = {i: KDAState(0.05 * torch.randn(B, cfg.num_heads, cfg.head_dim, cfg.head_dim, generator=g,
                                              device="cuda"),
                           tuple(torch.randn(B, cfg.width, cfg.conv_kernel - 1, generator=g, device="cuda").to(dtype)
                                 for _ in range(3)))
               for i, k in enumerate(spec.layer_kinds) if k == "kda"}
        lat = {i: torch.randn(B, args.cached, mcfg.kv_lora_rank + mcfg.qk_rope_head_dim, generator=g,
                              device="cuda").to(dtype)
               for i, k in enumerate(spec.layer_kinds) if k == "mla"}
        toks = torch.randint(0, spec.vocab_size, (args.steps + args.warmup, B), generator=g, device="cuda")
        cap = max(args.capacity or 0, args.cached + args.steps + args.warmup + 1)
        dg = DecodeGraph(model, sess.graph, batch=B, capacity=cap, device="cuda", buckets=extra)
        lens = [args.cached] * B

        def reset():
            dg.load_state(kda, lat, lens)
            torch.cuda.synchronize()

        def timed(fn):
            reset()
            outs = []
            for s in range(args.warmup):
                fn(toks[s])
            torch.cuda.synchronize()
            t = time.perf_counter()
            for s in range(args.warmup, args.warmup + args.steps):
                outs.append(fn(toks[s]).float().clone())
            torch.cuda.synchronize()
            return (time.perf_counter() - t) * 1e3 / args.steps, torch.stack(outs)

        eager_ms, eager_out = timed(dg.eager_step)
        _, same_out = timed(lambda t: dg.eager_step(t, device_lengths=True))
        reset()
        t = time.perf_counter()
        dg.capture_all()
        cap_s = time.perf_counter() - t
        graph_ms, graph_out = timed(dg.step)

        def errs(a, b):     # per step: |a - b| / |b|, and max |a - b| / max |b|
            d = a - b
            return ((d.flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)).tolist(),
                    (d.abs().amax(dim=(1, 2)) / b.abs().amax(dim=(1, 2))).tolist())
        rel, elem = errs(graph_out, eager_out)
        exact, _ = errs(graph_out, same_out)
        same_argmax = (graph_out.argmax(-1) == eager_out.argmax(-1)).float().mean().item()
        row = {"batch": B, "eager_ms": eager_ms, "graph_ms": graph_ms, "speedup": eager_ms / graph_ms,
               "capture_s": cap_s, "max_rel_err": max(rel), "rel_err_first_step": rel[0], "rel_err_per_step": rel,
               "max_elem_err_rel_to_max": max(elem), "argmax_agree": same_argmax,
               "max_rel_err_vs_same_path_eager": max(exact), "report": str(dg.report), "graph_mode": dg.report.mode}
        if args.profile:
            reset()
            row["profile"] = kernel_profile(lambda s: dg.eager_step(toks[s % len(toks)], device_lengths=True),
                                            args.profile, graph_ms)
        result["rows"].append(row)
        print(f"B={B} cached={args.cached}: eager {eager_ms:.2f} ms/step, graph replay {graph_ms:.2f} ms/step "
              f"({row['speedup']:.1f}x), capture {cap_s:.2f} s; replay vs eager executor: max rel err "
              f"{max(rel):.2e} (first step {rel[0]:.2e}, elementwise {max(elem):.2e}, argmax agree "
              f"{same_argmax:.3f}); replay vs the captured path run eagerly: {max(exact):.1e}; {dg.report}",
              flush=True)
        del dg
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def _family(name: str) -> str:
    """A kernel's family: k3c kernels by their first name parts (k3c_moe_gate_up, k3c_kda_decode, ...), others by
    their first word (e.g. cuBLAS / CUTLASS GEMMs, torch elementwise)."""
    import re

    if name.startswith("k3c_"):
        parts = []
        for p in name.split("_"):
            if re.fullmatch(r"[a-z]+\d+|\d+", p) and len(parts) >= 2:
                break
            parts.append(p)
        return "_".join(parts[:5])
    base = re.split(r"[<(\s]", name.removeprefix("void "), maxsplit=1)[0]
    return "nvjet (cuBLAS GEMM)" if base.startswith("nvjet") else base[:70]


def kernel_profile(step, n: int, graph_ms: float) -> dict:
    """GPU time per step by kernel family over n steps of `step(s)` (torch.profiler, CUDA activity): where the
    replayed step's time goes. Printed and returned (family -> us per step, plus the top kernels)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    step(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in range(n):
            step(s + 1)
        torch.cuda.synchronize()
    per_kernel: dict = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0 and "Memcpy" not in ev.name:
            k = per_kernel[ev.name]
            k[0] += ev.device_time / n
            k[1] += 1
    fam: dict = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        fam[_family(name)] += us
    total = sum(fam.values())
    print(f"  kernels: {total / 1e3:.2f} ms of GPU time per step (graph replay {graph_ms:.2f} ms/step)")
    for f, us in sorted(fam.items(), key=lambda x: -x[1])[:20]:
        print(f"    {us:9.1f} us  {100 * us / total:5.1f}%  {f}")
    top = sorted(per_kernel.items(), key=lambda x: -x[1][0])[:15]
    for name, (us, cnt) in top:
        print(f"      {us:9.1f} us  x{cnt / n:4.0f}/step  {name[:110]}")
    return {"kernel_ms_per_step": total / 1e3, "families_us": dict(fam),
            "top_kernels_us": {name: us for name, (us, _) in top}}


if __name__ == "__main__":
    main()
