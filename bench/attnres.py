"""Two-phase Block AttnRes (attnres-split) vs a plain residual add + RMSNorm vs the naive torch mix, same run.

    python bench/attnres.py                      # H200: d=7168, 8192 tokens, 8 blocks of 12 layers, bf16
    python bench/attnres.py --json out.json      # also write records {name, flops, bytes, seconds}
    python bench/attnres.py --smoke              # tiny shapes on the CPU (interpreter), checks the code path

Per decoder layer (two sublayers), averaged over the 8 block groups:
  split  = sum_g phase1(N = g + 1, Q = 24) / 96 + the phase-2 ops of a group / 12
           (per group: 1 sublayer without a partial, 1 reading it, 22 with the fused update; all with the fused
           RMSNorm of the next sublayer)
  plain  = 2 x the fused residual add + RMSNorm Triton kernel of k3c (k3c.runtime.kernel_impls.basic.rmsnorm(residual=...):
           reads x and r, writes r + x and its norm; one row per program, fp32 math)
  naive  = 2 x [p = p + y; h = attn_res_mix(b_0..b_{N-1}, p) (the eager reference); rmsnorm(h)], averaged over N
Also shown: the same residual + RMSNorm in eager torch (for scale only; the target compares against the Triton one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from k3c.runtime.kernel_impls import basic as L  # noqa: E402
from k3c.ir.attnres_ops import STATS  # noqa: E402
from k3c.runtime.kernel_impls import attnres as ka  # noqa: E402
from k3c.reference.attnres import attn_res_mix  # noqa: E402
from k3c.reference.norms import rms_norm  # noqa: E402

EPS = 1e-5


def bench(fn, dev, reps=None):
    if dev.type == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=reps or 60, return_mode="median") * 1e-3
    fn()
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--layers-per-block", type=int, default=12)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.d, args.tokens, args.blocks, args.layers_per_block = 64, 40, 3, 2
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    x = make_inputs(args.d, args.tokens, args.blocks, args.layers_per_block, dev)
    info = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    print(f"# AttnRes bench on {info}; torch {torch.__version__}; d={x.d} tokens={x.T} blocks={x.NB} x {x.S} layers, "
          f"bf16")
    check(x)
    plan1, plan2 = {}, {}
    if dev.type == "cuda" and not args.no_sweep:
        plan1 = sweep_phase1(x, dev)
        plan2 = sweep_phase2(x, dev, plan1)
    records, rows = [], []

    def rec(name, seconds, nbytes, shape):
        records.append({"name": name, "flops": 0, "bytes": int(nbytes), "seconds": seconds})
        rows.append((name, shape, seconds, nbytes))
    t = time_ops(x, dev, plan1, plan2, rec)
    report(x, t, rows, rec, plan1, plan2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def make_inputs(d, T, NB, S, dev):
    """NB completed blocks [T, d], the Q = 2 S pseudo-queries of a group (folded), a partial sum, an update and a
    norm gain: bf16, seeded."""
    Q = 2 * S
    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dt).to(dev)  # noqa: E731
    blocks = [rnd(T, d, scale=1 + i) for i in range(NB)]
    proj = [torch.randn(d, generator=g).to(dt).to(dev) * 0.05 for _ in range(Q)]
    norm = [(1 + 0.1 * torch.randn(d, generator=g)).to(dt).to(dev) for _ in range(Q)]
    queries = ka.fold_queries(list(zip(proj, norm)))
    p_old, y, gain = rnd(T, d), rnd(T, d), (1 + 0.1 * torch.randn(d, generator=g)).to(dt).to(dev)
    return types.SimpleNamespace(d=d, T=T, NB=NB, S=S, Q=Q, dt=dt, e=2, blocks=blocks, proj=proj, norm=norm,
                                 queries=queries, p_old=p_old, y=y, gain=gain, row_bytes=T * d * 2)


def check(x):
    """Correctness on the benchmark shapes (one group, last query) against the naive mix."""
    s1 = ka.phase1(x.blocks[:3], x.queries, EPS)
    r = ka.phase2(s1, x.queries, x.Q - 1, EPS, partial=x.p_old, update=x.y, weight=x.gain, norm_eps=EPS)
    want = rms_norm(attn_res_mix(x.blocks[:3] + [x.p_old + x.y], x.proj[-1], x.norm[-1], EPS), x.gain, EPS)
    err = ((r[1].float() - want.float()).norm() / want.float().norm()).item()
    print(f"# check vs naive (N=3, bf16): rel err {err:.2e}")


def sweep_phase1(x, dev):
    """The phase-1 tile plan at N = NB (the largest group): scores tiles first, then the output kernel's."""
    best = None
    cands = [dict(block_m=bm, scores_warps=sw) for bm, sw in [(64, 4), (16, 4), (32, 4), (64, 8)]]
    for c in cands:
        try:
            t = bench(lambda: ka.phase1(x.blocks, x.queries, EPS, **c), dev, 40)
        except Exception as ex:  # noqa: BLE001 (a config that does not compile is skipped)
            print(f"# phase1 {c}: failed ({type(ex).__name__})")
            continue
        print(f"# phase1 N={x.NB} {c}: {t * 1e3:.3f} ms")
        if best is None or t < best[0]:
            best = (t, c)
    for bd, nw in [(512, 4), (256, 4), (1024, 8), (512, 8)]:
        c = dict(best[1], block_d=bd, num_warps=nw)
        try:
            t = bench(lambda: ka.phase1(x.blocks, x.queries, EPS, **c), dev, 40)
        except Exception as ex:  # noqa: BLE001
            print(f"# phase1 {c}: failed ({type(ex).__name__})")
            continue
        print(f"# phase1 N={x.NB} {c}: {t * 1e3:.3f} ms")
        if t < best[0]:
            best = (t, c)
    plan1 = best[1] if best else {}
    print(f"# phase1 plan used: {plan1 or 'default'}")
    return plan1


def sweep_phase2(x, dev, plan1):
    """The warps of the phase-2 update kernel."""
    s1 = ka.phase1(x.blocks[:2], x.queries, EPS, **plan1)
    best = None
    for nw in (4, 8):  # noqa: B007
        t = bench(lambda: ka.phase2(s1, x.queries, 3, EPS, partial=x.p_old, update=x.y, weight=x.gain, norm_eps=EPS,
                                    num_warps=nw), dev, 40)
        print(f"# phase2 update warps={nw}: {t * 1e3:.3f} ms")
        if best is None or t < best[0]:
            best = (t, dict(num_warps=nw))
    return best[1]


def time_ops(x, dev, plan1, plan2, rec):
    """Every op timed alone (rec(name, seconds, bytes, shape) per row); returns the times the summary needs."""
    T, d, e, Q, NB, row_bytes = x.T, x.d, x.e, x.Q, x.NB, x.row_bytes
    t = {"p1": {}, "naive": {}}
    for n in range(1, NB + 1):
        t["p1"][n] = bench(lambda: ka.phase1(x.blocks[:n], x.queries, EPS, **plan1), dev)
        rec(f"attnres_phase1_n{n}", t["p1"][n], n * row_bytes + Q * T * (STATS + d) * e, f"N={n} Q={Q} [{T},{d}]")
    s1 = ka.phase1(x.blocks[:2], x.queries, EPS, **plan1)
    out2 = torch.empty(2, T, d, dtype=x.dt, device=dev)
    t["up"] = bench(lambda: ka.phase2(s1, x.queries, 3, EPS, partial=x.p_old, update=x.y, weight=x.gain,
                                      norm_eps=EPS, out=out2, **plan2), dev)
    rec("attnres_phase2_update_norm", t["up"], 5 * row_bytes + T * (STATS + d) * e, f"[{T},{d}]")
    t["src"] = bench(lambda: ka.phase2(s1, x.queries, 1, EPS, partial=x.p_old, weight=x.gain, norm_eps=EPS,
                                       **plan2), dev)
    rec("attnres_phase2_source_norm", t["src"], 2 * row_bytes + T * (STATS + d) * e, f"[{T},{d}]")
    t["none"] = bench(lambda: ka.phase2(s1, x.queries, 0, EPS, weight=x.gain, norm_eps=EPS, **plan2), dev)
    rec("attnres_phase2_none_norm", t["none"], row_bytes + T * (STATS + d) * e, f"[{T},{d}]")
    t["plain"] = bench(lambda: L.rmsnorm(x.y, x.gain, EPS, residual=x.p_old), dev)
    rec("residual_rmsnorm_triton", t["plain"], 4 * row_bytes, f"[{T},{d}]")

    def torch_plain():
        r = x.p_old + x.y
        return rms_norm(r, x.gain, EPS), r
    t["torch"] = bench(torch_plain, dev)
    rec("residual_rmsnorm_torch_eager", t["torch"], 4 * row_bytes, f"[{T},{d}]")
    for n in range(1, NB + 1):
        def naive(n=n):
            p = x.p_old + x.y
            return rms_norm(attn_res_mix(x.blocks[:n] + [p], x.proj[0], x.norm[0], EPS), x.gain, EPS), p
        t["naive"][n] = bench(naive, dev, 30)
        rec(f"attnres_naive_torch_n{n}", t["naive"][n], (2 * (n + 1) + 6) * row_bytes, f"N={n}+1 [{T},{d}]")
    return t


def report(x, t, rows, rec, plan1, plan2):
    """Per decoder layer (see the module doc), then the table of every row and the targets."""
    T, d, e, Q, NB, S, row_bytes = x.T, x.d, x.e, x.Q, x.NB, x.S, x.row_bytes
    per_group_p2 = t["none"] + t["src"] + (Q - 2) * t["up"]
    split_layer = (sum(t["p1"].values()) + NB * per_group_p2) / (NB * S)
    plain_layer = 2 * t["plain"]
    naive_layer = 2 * statistics.mean(t["naive"].values())
    torch_layer = 2 * t["torch"]
    split_bytes = (sum(n * row_bytes + Q * T * (STATS + d) * e for n in range(1, NB + 1))
                   + NB * (row_bytes * (2 + 3 + 5 * (Q - 2)) + Q * T * (STATS + d) * e)) / (NB * S)
    plain_bytes = 2 * 4 * row_bytes
    naive_bytes = 2 * statistics.mean((2 * (n + 1) + 6) * row_bytes for n in range(1, NB + 1))
    rec("attnres_split_per_layer", split_layer, split_bytes, f"{NB}x{S} layers")
    rec("residual_rmsnorm_triton_per_layer", plain_layer, plain_bytes, "2 sublayers")
    rec("attnres_naive_torch_per_layer", naive_layer, naive_bytes, "2 sublayers, mean over N")

    print()
    print("| what | shape | ms | TB/s (model bytes) | ratio to plain residual+RMSNorm (Triton) |")
    print("|---|---|---|---|---|")
    for name, shape, sec, nb in rows:
        ratio = sec / (t["plain"] if "per_layer" not in name else plain_layer)
        print(f"| {name} | {shape} | {sec * 1e3:.3f} | {nb / sec / 1e12:.2f} | {ratio:.2f}x |")
    print()
    print(f"per layer: split {split_layer * 1e3:.3f} ms | plain residual+RMSNorm (Triton) {plain_layer * 1e3:.3f} ms "
          f"| naive torch {naive_layer * 1e3:.3f} ms | residual+RMSNorm torch eager {torch_layer * 1e3:.3f} ms")
    print(f"split / plain = {split_layer / plain_layer:.2f}x (target <= 1.25x); naive / split = "
          f"{naive_layer / split_layer:.1f}x (target >= 5x); byte floor split/plain = {split_bytes / plain_bytes:.2f}x")
    print(f"plans: phase1 {plan1 or 'default'}, phase2 {plan2 or 'default'}")


if __name__ == "__main__":
    main()
