"""MLA decode (MQA over the paged 576-wide latent cache) and append-prefill (MHA vs MQA) on one GPU, with peers run
in the same process.

    python bench/mla.py                       # H200: the issue's grid, peers, ceilings; table + JSON
    python bench/mla.py --json out.json       # records {name, flops, bytes, seconds} (k3c[<plan>] per plan)
    python bench/mla.py --budget 150          # stop the plan sweep (the last step) after 150 s in all
    python bench/mla.py --smoke               # tiny shapes on the CPU (interpreter): checks every code path

Decode: batch {1, 32, 128} x context {4K, 32K, 128K} x heads {96, 12}, one query token, bf16 cache, page size from
the device's Target (mla_page_size). Peers on the same cache memory (the page pool laid out in order, which is
also a contiguous [B, T, 576] cache):
  torch   q_lat|q_pe @ cache^T (bmm), softmax in fp32, @ c (bmm)
  sglang  SGLang's Triton `decode_attention_fwd` (split-KV, 8 splits, page size 1) from the sglang wheel's
          sglang/srt/layers/attention/triton_ops/decode_attention.py (kept out of the repository: .peers/); not run
          where the cache passes 2^31 elements (its 32-bit offsets fault there: an illegal access kills the process)
Roofline efficiency = max(cache bytes / time / measured copy bandwidth, FLOPs / time / measured bf16 matmul rate),
both ceilings measured in this run. FLOPs per (query head, key) = 2 (L + R) + 2 L; bytes = the cache read once.
Append-prefill: 128K cached + {64, 512, 8192} new tokens, both modes through the runtime's own paths, and the mode
the cost model (k3c.analysis.cost.mla_mode_costs, target = this device) picks.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from k3c.analysis.cost import mla_mode_costs  # noqa: E402
from k3c.codegen.kernels.mla import DecodePlan, decode_plan  # noqa: E402
from k3c.runtime.devices import target_for  # noqa: E402
from k3c.runtime.kernel_impls import mla as rt  # noqa: E402

L_, R_, P_, V_ = 512, 64, 128, 128
SGL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".peers", "sglang", "srt", "layers",
                        "attention", "triton_ops", "decode_attention.py")


def timeit(fn, dev, rep_ms=40, min_reps=3):
    if dev.type == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize()
        t = triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median") * 1e-3
        if t < 1e-3:          # launch-bound sizes: the lower of two medians (host jitter, clock ramps)
            t = min(t, triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median") * 1e-3)
        return t
    fn()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timeit_slow(fn, dev, reps=2):
    """For calls of 100s of ms: one warm-up, then the median of `reps`."""
    fn()
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def load_sglang():
    if not os.path.exists(SGL_FILE):
        return None
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False
    sys.modules["sglang.srt.utils"] = utils
    spec = importlib.util.spec_from_file_location("sglang_decode_attention", SGL_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.decode_attention_fwd


def ceilings(dev):
    if dev.type != "cuda":
        return 1e11, 1e12
    x = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), dev, rep_ms=100)
    bw = 2 * x.numel() * 2 / t
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    t = timeit(lambda: a @ b, dev, rep_ms=200)
    return bw, 2 * 8192 ** 3 / t


def make_cache(B, T, dev, ps, gen_seed=0):
    """The pool laid out in order: sequence b's page p is pool page b * pages + p (the block table still says so)."""
    pages = -(-T // ps)
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    pool = torch.empty(B * pages, ps, L_ + R_, dtype=torch.bfloat16, device=dev)
    pool.normal_(generator=g)
    bt = (torch.arange(B, device=dev)[:, None] * pages + torch.arange(pages, device=dev)[None, :]).to(torch.int32)
    return rt.LatentStore(pool, bt, [T] * B)


def decode_point(B, T, H, dev, sgl, plans, peers=True):
    """Times of `plans` (first = the shipped default) and, with peers, of the torch path and SGLang's kernel on the
    same cache; returns {"plans": {tag: s}, "torch": s, "sglang": s | None (2^31 fault) | absent, "err": rel err}."""
    tgt = target_for(dev)
    ps = tgt.mla_page_size
    store = make_cache(B, T, dev, ps)
    lens = rt.lens_tensor([T] * B, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, H, L_ + R_, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
    scale = (P_ + R_) ** -0.5
    res = {"plans": {}}
    for plan in plans:
        try:
            res["plans"][plan_tag(plan)] = timeit(
                lambda: rt.mqa_decode(q, store, lens, scale, L_, num_heads=H, plan=plan, max_len=T), dev)
        except Exception as e:  # out of resources etc.
            print(f"#   plan {plan_tag(plan)} failed: {type(e).__name__}: {str(e)[:120]}")
    if not peers:
        return res
    cache = store.pool.view(B, T, L_ + R_)
    if dev.type == "cuda" and B * H * T * 8 < 40e9:
        def torch_path():
            s = torch.bmm(q, cache.transpose(1, 2))
            p = torch.softmax(s.float() * scale, -1).to(torch.bfloat16)
            return torch.bmm(p, cache[..., :L_])
        res["torch"] = timeit(torch_path, dev)
        ref = torch_path().float()
        out = rt.mqa_decode(q, store, lens, scale, L_, num_heads=H, plan=plans[0], max_len=T).float()
        res["err"] = ((out - ref).norm() / ref.norm()).item()
    if sgl is not None and dev.type == "cuda":
        if B * T * (L_ + R_) >= 2 ** 31:
            res["sglang"] = None          # 32-bit offsets: illegal memory access past 2^31 elements
        else:
            kbuf = store.pool.view(B * T, 1, L_ + R_)
            vbuf = kbuf[..., :L_]
            o = torch.empty(B, H, L_, dtype=torch.bfloat16, device=dev)
            indptr = (torch.arange(B + 1, device=dev) * T).to(torch.int32)
            indices = torch.arange(B * T, device=dev, dtype=torch.int32)
            logits = torch.empty(B, H, 8, L_, dtype=torch.float32, device=dev)
            lse = torch.empty(B, H, 8, dtype=torch.float32, device=dev)
            nspl = torch.full((B,), 8, dtype=torch.int32, device=dev)
            try:
                res["sglang"] = timeit(lambda: sgl(q, kbuf, vbuf, o, indptr, indices, logits, lse, nspl, 8, scale),
                                       dev)
            except Exception as e:
                print(f"#   sglang failed: {type(e).__name__}: {str(e)[:200]}")
    del store, cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def fmt_decode(rows, ceil):
    """rows: (B, T, H, res, default tag). k3c = the default plan; best = the fastest spill-free plan timed."""
    bw, fl = ceil
    print("\n| B | T | H | k3c ms (plan) | best spill-free ms (plan) | TB/s | TFLOP/s | roofline % | torch ms | x torch "
          "| sglang ms | x sglang | err vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, T, H, res, dtag in rows:
        flops = 2.0 * B * H * T * (2 * (L_ + R_) + 2 * L_)
        nbytes = float(B) * T * (L_ + R_) * 2
        t = res["plans"].get(dtag, float("nan"))
        free = {k: v for k, v in res["plans"].items() if k not in SPILLING}
        btag = min(free, key=free.get) if free else dtag
        tb = free.get(btag, t)
        eff = max(nbytes / t / bw, flops / t / fl) * 100
        tt, ts = res.get("torch"), res.get("sglang", "n/a")
        s_sgl = "fault (2^31)" if ts is None else ("n/a" if ts == "n/a" else f"{ts * 1e3:.3f}")
        x_sgl = "-" if not isinstance(ts, float) else f"{ts / t:.2f}"
        print(f"| {B} | {T // 1024}K | {H} | {t * 1e3:.3f} ({dtag}) | {tb * 1e3:.3f} ({btag}) | "
              f"{nbytes / t / 1e12:.2f} | {flops / t / 1e12:.0f} | {eff:.0f} | "
              f"{'-' if tt is None else f'{tt * 1e3:.3f}'} | {'-' if tt is None else f'{tt / t:.2f}'} | "
              f"{s_sgl} | {x_sgl} | {res.get('err', float('nan')):.1e} |")
    for B, T, H, res, dtag in rows:
        if len(res["plans"]) > 1:
            print(f"# sweep B={B} T={T // 1024}K H={H}: " + ", ".join(
                f"{k}{' (spills)' if k in SPILLING else ''} {v * 1e3:.3f}" for k, v in res["plans"].items()))


def append_point(cached, new, H, dev, records, rows_out):
    tgt = target_for(dev)
    ps = tgt.mla_page_size
    total = cached + new
    store = make_cache(1, total, dev, ps, gen_seed=2)
    entry = rt.PagedLatentCache(store, (total,))
    g = torch.Generator(device=dev).manual_seed(3)
    q = (torch.randn(1, new, H, P_ + R_, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    uk = (torch.randn(H, P_, L_, generator=g, device=dev) / L_ ** 0.5).to(torch.bfloat16)
    uv = (torch.randn(H, L_, V_, generator=g, device=dev) / L_ ** 0.5).to(torch.bfloat16)
    scale = (P_ + R_) ** -0.5
    lens = rt.lens_tensor([total], dev)

    def mha():
        return rt.mha_attention(q, entry, uk, uv, scale, 8192)

    def mqa():
        q_lat = torch.einsum("btnp,npl->btnl", q[..., :P_].float(), uk.float())
        qq = torch.cat([q_lat, q[..., P_:].float()], -1).to(torch.bfloat16).view(1, new * H, L_ + R_)
        o_lat = rt.mqa_decode(qq, store, lens, scale, L_, num_heads=H, max_len=total)
        return torch.einsum("btnl,nlv->btnv", o_lat.view(1, new, H, L_), uv)

    t_mha = timeit_slow(mha, dev)
    t_mqa = timeit_slow(mqa, dev)
    a, b = mha().float(), mqa().float()
    err = ((a - b).norm() / a.norm()).item()
    attrs = {"num_heads": H, "kv_lora_rank": L_, "qk_nope_head_dim": P_, "qk_rope_head_dim": R_, "v_head_dim": V_}
    c = mla_mode_costs(attrs, new, cached, tgt)
    for mode, t, cost in (("mha", t_mha, c.mha), ("mqa", t_mqa, c.mqa)):
        records.append({"name": f"mla_append_{mode}_C{cached}_N{new}_H{H}", "flops": cost.total_flops,
                        "bytes": cost.bytes, "seconds": t})
    rows_out.append((cached, new, H, t_mha, t_mqa, c.best, err, c))
    del store
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def fmt_append(rows):
    print("\n| cached | new | H | MHA ms | MQA ms | faster | model picks | model MHA/MQA ms | ok | MHA-MQA rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cached, new, H, tmha, tmqa, best, err, c in rows:
        fast = "mha" if tmha <= tmqa else "mqa"
        print(f"| {cached // 1024}K | {new} | {H} | {tmha * 1e3:.1f} | {tmqa * 1e3:.1f} | {fast} | {best} | "
              f"{c.mha_seconds * 1e3:.1f}/{c.mqa_seconds * 1e3:.1f} | {'yes' if fast == best else 'NO'} | {err:.1e} |")


def plan_tag(p: DecodePlan) -> str:
    """A decode plan's label in the tables and JSON records."""
    return (f"h{p.block_h} w{p.num_warps} s{p.num_stages}" + (f" n{p.block_n}" if p.block_n else "")
            + (" kq" if p.keys_major else "") + (" lazy" if p.lazy else ""))


def decode_candidates(rows: int, kv_lora_rank: int, target) -> list[DecodePlan]:
    """The default and the other spill-free plans (sm_90 AOT report, triton 3.9) the sweep times per shape."""
    default = decode_plan(rows, kv_lora_rank, target)
    if target.arch != "sm_90":
        return [default]
    if rows > 16:
        cand = [DecodePlan(32, 8, 2), DecodePlan(64, 8, 2, 32, True), DecodePlan(32, 8, 2, lazy=True),
                DecodePlan(32, 4, 2, 16), DecodePlan(16, 4, 3)]
    else:
        cand = [DecodePlan(16, 4, 3), DecodePlan(16, 4, 2, 32), DecodePlan(16, 8, 2)]
    return [default] + [c for c in cand if c != default]


# spill on sm_90 (AOT report): timed for reference only, never a default or "best spill-free"
SPILLING_PLANS = [DecodePlan(32, 4, 2), DecodePlan(64, 8, 2)]
SPILLING = {plan_tag(p) for p in SPILLING_PLANS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("K3C_BENCH_BUDGET", "1e9")),
                    help="seconds: the plan sweep (last) stops when they are spent")
    args = ap.parse_args()
    t_start = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    global L_, R_, P_, V_
    if args.smoke:
        L_, R_, P_, V_ = 32, 8, 16, 16
        grid = [(2, 128, 4), (1, 200, 3)]
        appends = [(96, 17, 2)]
    else:
        grid = [(b, t, h) for h in (96, 12) for b in (1, 32, 128) for t in (4096, 32768, 131072)]
        appends = [(131072, n, h) for h in (96, 12) for n in (64, 512, 8192)]
    tgt = target_for(dev)
    ceil = ceilings(dev)
    print(f"# device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__ if dev.type == 'cuda' else '-'}; ceilings: copy {ceil[0] / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil[1] / 1e12:.0f} TFLOP/s; page size {tgt.mla_page_size}")
    sgl = load_sglang() if dev.type == "cuda" else None
    print(f"# sglang peer: {'loaded' if sgl else 'absent'}", flush=True)
    records, drows, arows = [], [], []
    # 1. every issue row: the shipped default plan and both peers
    for B, T, H in grid:
        t0 = time.time()
        T = -(-T // tgt.mla_page_size) * tgt.mla_page_size
        default = decode_plan(H, L_, tgt)
        res = decode_point(B, T, H, dev, sgl, [default])
        drows.append((B, T, H, res, plan_tag(default)))
        print(f"# decode B={B} T={T} H={H} ({plan_tag(default)}): " + ", ".join(
            f"{k} {v * 1e3:.3f} ms" for k, v in [("k3c", res["plans"].get(plan_tag(default), float("nan")))]
            + [(k, res[k]) for k in ("torch", "sglang") if isinstance(res.get(k), float)])
            + f"; {time.time() - t0:.1f} s", flush=True)
    # 2. append-prefill, both modes, and the cost model's pick
    for cached, new, H in appends:
        t0 = time.time()
        try:
            append_point(cached, new, H, dev, records, arows)
        except Exception as e:
            print(f"#   append failed: {type(e).__name__}: {str(e)[:300]}")
        print(f"# append C={cached} N={new} H={H}: {time.time() - t0:.1f} s", flush=True)
    # 3. the plan sweep (spill-free candidates + the last run's spilling plan for reference), budget permitting
    if not (args.skip_sweep or args.smoke):
        for B, T, H, res, dtag in sorted(drows, key=lambda r: (r[2] <= 32, r[0] == 1)):   # 96 heads, B >= 32 first
            if time.time() - t_start > args.budget:
                print("# sweep stopped: budget spent", flush=True)
                break
            cands = [c for c in decode_candidates(H, L_, tgt) if plan_tag(c) not in res["plans"]]
            if H > 32 and B >= 32:
                cands += [p for p in SPILLING_PLANS if plan_tag(p) not in res["plans"]]
            res["plans"].update(decode_point(B, T, H, dev, None, cands, peers=False)["plans"])
    for B, T, H, res, dtag in drows:
        flops = 2.0 * B * H * T * (2 * (L_ + R_) + 2 * L_)
        nbytes = float(B) * T * (L_ + R_) * 2
        for name, t in [(f"k3c[{k}]", v) for k, v in res["plans"].items()] + \
                [(k, res[k]) for k in ("torch", "sglang") if isinstance(res.get(k), float)]:
            records.append({"name": f"mla_decode_{name}_B{B}_T{T}_H{H}", "flops": flops, "bytes": nbytes,
                            "seconds": t})
    fmt_decode(drows, ceil)
    fmt_append(arows)
    print(f"# total {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
