"""MLA decode (MQA over the paged 576-wide latent cache, bf16 and fp8) and append-prefill (MHA vs MQA) on one GPU,
with peers run in the same process.

    python bench/mla.py                       # H200: the issue's grid, peers, ceilings; tables + JSON (a few minutes)
    python bench/mla.py --json out.json       # records {name, flops, bytes, seconds[, rel_err]} (k3c[<plan>] per plan)
    python bench/mla.py --kv-dtype bf16       # bf16 cache only (fp8: the fp8 cache only; default both)
    python bench/mla.py --no-flashmla         # no FlashMLA peer (--flashmla-so PATH: a .so elsewhere)
    python bench/mla.py --budget 150          # stop the plan sweep (the last step) after 150 s in all
    python bench/mla.py --smoke               # tiny shapes on the CPU (interpreter): every code path but FlashMLA

Decode: batch {1, 32, 128} x context {4K, 32K, 128K} x heads {96, 12}, one query token, page size from the device's
Target (mla_page_size), every sequence the full context. Per shape, on one cache:
  k3c bf16  rt.mqa_decode over the bf16 pool [pages, 64, 576] (the shipped default plan; the sweep adds the others)
  k3c fp8   rt.mqa_decode over an fp8 pool made from the same values (latent_format.encode_rows: e4m3 codes plus a
            per-token fp32 scale for the latent part and one for the rope part, 592 bytes a token); the plan is the
            runtime's own choice for fp8; err = relative L2 error against the k3c bf16 output (the cache rounding)
Peers on the bf16 cache's memory (the page pool laid out in order, which is also a contiguous [B, T, 576] cache):
  torch     q_lat|q_pe @ cache^T (bmm), softmax in fp32, @ c (bmm)
  sglang    SGLang's Triton `decode_attention_fwd` (split-KV, 8 splits, page size 1) from the sglang wheel's
            sglang/srt/layers/attention/triton_ops/decode_attention.py (kept out of the repository: .peers/); not run
            where the cache passes 2^31 elements (its 32-bit offsets fault there: an illegal access kills the process)
  FlashMLA  vllm 0.33.0's prebuilt FlashMLA SM90 dense decode (_flashmla_C.abi3.so, op
            torch.ops._flashmla_C.dense_decode_fwd), looked for in .peers/carry/so/ and ../shared/peers/carry/so/
            (--flashmla-so PATH). The library is first loaded in a child process (a crash there cannot take this run
            down), then here; any failure prints one line and the run goes on without it. It reads the same pool
            (viewed [pages, 64, 1, 576]), block table, lengths and query ([B, 1, H, 576]) with softmax scale
            (128 + 64)^-0.5, head dim v 512; the tile-scheduler metadata of its first call is reused (what an
            engine does across layers). err = relative L2 error against the k3c bf16 output. Needs CUDA, sm_90 and
            page size 64; skipped with a note otherwise (--smoke: no CUDA).
Roofline efficiency = max(cache bytes / time / measured copy bandwidth, FLOPs / time / measured bf16 matmul rate),
both ceilings measured in this run. FLOPs per (query head, cached token) = 2 (L + R) for q.k plus 2 L for p.v
= 2 (L + R) + 2 L (2176 at L = 512, R = 64; decode_flops); bytes = the cache read once, B T 576 x 2 in bf16 and
B T 592 in fp8 (decode_bytes; q and o are left out: at most 9% more, fp8 at H = 96 T = 4K; < 1.1% from T = 32K).
Append-prefill: 128K cached + {64, 512, 8192} new tokens, both modes through the runtime's own paths, and the mode
the cost model (k3c.analysis.cost.mla_mode_costs, target = this device) picks.

Time: the plan sweep runs last and stops starting shapes once --budget seconds (default 300, or K3C_BENCH_BUDGET)
have passed since the start, so a default H200 run stays within ~400 s with FlashMLA and the fp8 rows
(--skip-sweep: no sweep at all). JSON record names carry the cache dtype: mla_decode_<who>_<bf16|fp8>_B.._T.._H...
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import types

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from k3c.analysis.cost import mla_mode_costs  # noqa: E402
from k3c.codegen.kernels.mla import DecodePlan, decode_plan  # noqa: E402
from k3c.runtime.devices import target_for, tt_dtype  # noqa: E402
from k3c.runtime.kernel_impls import mla as rt  # noqa: E402

try:                                     # the fp8 latent cache (absent in older checkouts: bf16 rows only)
    from k3c.runtime.caches import latent_format as lf  # noqa: E402
    LF_ERROR = None
except ImportError as _e:                # pragma: no cover - depends on the checkout
    lf, LF_ERROR = None, f"{type(_e).__name__}: {_e}"

L_, R_, P_, V_ = 512, 64, 128, 128
SGL_FILE = os.path.join(ROOT, ".peers", "sglang", "srt", "layers", "attention", "triton_ops", "decode_attention.py")
FLASHMLA_SO = "_flashmla_C.abi3.so"
FLASHMLA_DIRS = (os.path.join(ROOT, ".peers", "carry", "so"),
                 os.path.normpath(os.path.join(ROOT, "..", "shared", "peers", "carry", "so")))
FLASHMLA_PAGE = 64                        # the only page size FlashMLA's dense decode takes
FP8 = torch.float8_e4m3fn


# ---- counting (pure) ------------------------------------------------------------------------------------------------
def decode_flops(B: int, T: int, H: int, L: int = 512, R: int = 64) -> float:
    """FLOPs of one decode step: per (query head, cached token) 2 (L + R) for q.k and 2 L for p.v."""
    return float(B) * H * T * (2 * (L + R) + 2 * L)


def row_bytes(kv_dtype: str, L: int = 512, R: int = 64) -> int:
    """Bytes per cached token: bf16 2 (L + R); fp8 the packed row (L + R e4m3 codes, padding, two fp32 scales in
    the last 8 bytes, 16-byte aligned: 592 at L = 512, R = 64)."""
    if kv_dtype == "bf16":
        return 2 * (L + R)
    if kv_dtype == "fp8":
        if lf is not None:
            return lf.row_width(L, R, FP8) * FP8.itemsize
        return -(-(L + R + 8) // 16) * 16
    raise ValueError(f"kv dtype must be bf16 or fp8, got {kv_dtype!r}")


def decode_bytes(B: int, T: int, kv_dtype: str = "bf16", L: int = 512, R: int = 64) -> float:
    """Bytes of one decode step: the cache read once."""
    return float(B) * T * row_bytes(kv_dtype, L, R)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm()).item()


def t_label(T: int) -> str:
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


# ---- timing ---------------------------------------------------------------------------------------------------------
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


# ---- peers ----------------------------------------------------------------------------------------------------------
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


_PROBE = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
          "print(torch.ops._flashmla_C.dense_decode_fwd.default._schema)")


class FlashMLA:
    """FlashMLA's dense paged decode (torch.ops._flashmla_C.dense_decode_fwd, vllm 0.33.0's prebuilt SM90 build):
    dense_decode_fwd(q [B, s_q, H, 576], kcache [pages, 64, 1, 576], head_size_v, seqlens_k i32 [B],
    block_table i32 [B, max_pages], softmax_scale, is_causal, tile_scheduler_metadata?, num_splits?, out_?)
    -> (out [B, s_q, H, head_size_v], lse, tile_scheduler_metadata, num_splits)."""

    def __init__(self, op, path: str = "", schema: str = "out_"):
        self.op, self.path, self.schema = op, path, schema
        self.has_out = "out_" in schema

    @classmethod
    def load(cls, path: str) -> "FlashMLA":
        torch.ops.load_library(path)
        op = torch.ops._flashmla_C.dense_decode_fwd
        return cls(op, path, str(op.default._schema))

    def bind(self, q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor, scale: float,
             head_size_v: int):
        """A call on k3c's own memory (views, nothing copied): q [B, H, L+R] as [B, 1, H, L+R], the pool
        [pages, ps, L+R] as [pages, ps, 1, L+R]. Makes the first call (which computes the tile-scheduler metadata)
        and returns fn() -> o [B, H, head_size_v] that reuses that metadata."""
        B, H, W = q.shape
        qv = q.view(B, 1, H, W)
        kc = pool.view(pool.shape[0], pool.shape[1], 1, W)
        out = torch.empty(B, 1, H, head_size_v, dtype=q.dtype, device=q.device)
        args = [qv, kc, head_size_v, lens, block_table, float(scale), False, None, None]
        if self.has_out:
            args.append(out)
        _, _, tsm, nsp = self.op(*args)
        args[7], args[8] = tsm, nsp
        op = self.op
        return lambda: op(*args)[0].view(B, H, head_size_v)


def load_flashmla(so_arg: str | None, off: bool, dev: torch.device) -> tuple[FlashMLA | None, str]:
    """The FlashMLA peer, or None; and the line that says which (or why not)."""
    if off:
        return None, "off (--no-flashmla)"
    if dev.type != "cuda":
        return None, "skipped: no CUDA here (FlashMLA is an SM90 CUDA library)"
    paths = [so_arg] if so_arg else [os.path.join(d, FLASHMLA_SO) for d in FLASHMLA_DIRS]
    found = [p for p in paths if os.path.exists(p)]
    if not found:
        return None, f"absent: no {FLASHMLA_SO} at {', '.join(paths)} (carry .peers/carry/so)"
    cap = torch.cuda.get_device_capability(dev)
    if cap[0] != 9:
        return None, f"skipped: its dense decode is SM90 only, this device is sm_{cap[0]}{cap[1]}"
    if target_for(dev).mla_page_size != FLASHMLA_PAGE:
        return None, f"skipped: page size {target_for(dev).mla_page_size}, FlashMLA takes {FLASHMLA_PAGE} only"
    path = found[0]
    try:        # a library that crashes while loading kills only this child
        r = subprocess.run([sys.executable, "-c", _PROBE, path], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, f"load failed: loading {path} in a child process took over 300 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"load failed: child loading {path} exited {r.returncode}: {last[:300]}"
    try:
        fm = FlashMLA.load(path)
    except Exception as e:
        return None, f"load failed: {path}: {type(e).__name__}: {str(e)[:300]}"
    return fm, f"loaded {path}"


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


# ---- caches ---------------------------------------------------------------------------------------------------------
def make_cache(B, T, dev, ps, gen_seed=0):
    """The pool laid out in order: sequence b's page p is pool page b * pages + p (the block table still says so)."""
    pages = -(-T // ps)
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    pool = torch.empty(B * pages, ps, L_ + R_, dtype=torch.bfloat16, device=dev)
    pool.normal_(generator=g)
    bt = (torch.arange(B, device=dev)[:, None] * pages + torch.arange(pages, device=dev)[None, :]).to(torch.int32)
    return rt.LatentStore(pool, bt, [T] * B)


def fp8_cache(store: rt.LatentStore, T: int, chunk_elems: int = 1 << 26) -> rt.LatentStore:
    """An fp8 store (rt.new_store: the runtime's own pool layout) holding `store`'s values, encode_rows of its bf16
    rows, token for token; encoded a few pages at a time (the encoding's fp32 temporaries stay small)."""
    B, ps = store.block_table.shape[0], store.page_size
    pages = -(-T // ps)
    st = rt.new_store(B, T, lf.row_width(L_, R_, FP8), ps, FP8, store.pool.device)
    src = store.block_table[:, :pages].reshape(-1).long()
    dst = st.block_table[:, :pages].reshape(-1).long()
    raw = st.pool.view(torch.uint8)
    step = max(1, chunk_elems // (ps * (L_ + R_)))
    for i in range(0, src.numel(), step):
        raw[dst[i:i + step]] = lf.encode_rows(store.pool[src[i:i + step]], L_, FP8).view(torch.uint8)
    st.high = [T] * B
    return st


# ---- decode ---------------------------------------------------------------------------------------------------------
def decode_point(B, T, H, dev, sgl, plans, peers=True, kv=("bf16",), fmla=None):
    """Times of `plans` (first = the shipped default) on the bf16 cache (when "bf16" in kv) and, with peers, the fp8
    cache's k3c row (when "fp8" in kv), the torch path, SGLang's kernel and FlashMLA on the same bf16 cache.
    Returns {"plans": {tag: s}, "fp8": {"plan", "s", "err"} | absent, "torch": s, "err": k3c vs torch,
    "sglang": s | None (2^31 fault) | absent, "flashmla": s, "flashmla_err": vs k3c bf16, "notes": [str]}."""
    tgt = target_for(dev)
    ps = tgt.mla_page_size
    store = make_cache(B, T, dev, ps)
    lens = rt.lens_tensor([T] * B, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, H, L_ + R_, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
    scale = (P_ + R_) ** -0.5
    res = {"plans": {}, "notes": []}

    def k3c(st, plan):
        return rt.mqa_decode(q, st, lens, scale, L_, num_heads=H, plan=plan, max_len=T)

    if "bf16" in kv:
        for plan in plans:
            try:
                res["plans"][plan_tag(plan)] = timeit(lambda: k3c(store, plan), dev)
            except Exception as e:  # out of resources etc.
                print(f"#   plan {plan_tag(plan)} failed: {type(e).__name__}: {str(e)[:120]}")
    if not peers:
        return res
    out16 = k3c(store, plans[0]).float()          # the reference of the fp8 row and of FlashMLA
    if "fp8" in kv:
        if lf is None:
            res["notes"].append(f"fp8 skipped: no latent_format ({LF_ERROR})")
        else:
            try:
                st8 = fp8_cache(store, T)
                tag = plan_tag(decode_plan(H, L_, tgt, cache_dtype=tt_dtype(FP8)))     # what mqa_decode picks
                t8 = timeit(lambda: k3c(st8, None), dev)
                res["fp8"] = {"plan": tag, "s": t8, "err": rel_err(k3c(st8, None), out16)}
                del st8
            except Exception as e:
                res["notes"].append(f"fp8 failed: {type(e).__name__}: {str(e)[:200]}")
    cache = store.pool.view(B, T, L_ + R_)
    if dev.type == "cpu" or B * H * T * 8 < 40e9:
        def torch_path():
            s = torch.bmm(q, cache.transpose(1, 2))
            p = torch.softmax(s.float() * scale, -1).to(torch.bfloat16)
            return torch.bmm(p, cache[..., :L_])
        res["torch"] = timeit(torch_path, dev)
        res["err"] = rel_err(out16, torch_path())
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
    if fmla is not None:
        try:
            fn = fmla.bind(q, store.pool, store.block_table, lens, scale, L_)
            res["flashmla_err"] = rel_err(fn(), out16)
            res["flashmla"] = timeit(fn, dev)
            if res["flashmla_err"] > 2e-2:
                res["notes"].append(f"FlashMLA output differs from k3c's: rel err {res['flashmla_err']:.1e}")
        except Exception as e:
            res["notes"].append(f"FlashMLA failed: {type(e).__name__}: {str(e)[:200]}")
    del store, cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def peer_times(res) -> dict:
    """The peers' times of one decode shape (bf16 cache)."""
    return {k: res[k] for k in ("torch", "sglang", "flashmla") if isinstance(res.get(k), float)}


def decode_records(B, T, H, res) -> list[dict]:
    """JSON records of one decode shape: every k3c plan (bf16), k3c fp8 and the peers; names carry the kv dtype."""
    out = []
    f = decode_flops(B, T, H, L_, R_)

    def rec(who, kv, t, err=None):
        r = {"name": f"mla_decode_{who}_{kv}_B{B}_T{T}_H{H}", "kv_dtype": kv, "flops": f,
             "bytes": decode_bytes(B, T, kv, L_, R_), "seconds": t}
        if err is not None:
            r["rel_err"] = err
        out.append(r)
    for tag, t in res["plans"].items():
        rec(f"k3c[{tag}]", "bf16", t)
    if "fp8" in res:
        rec(f"k3c[{res['fp8']['plan']}]", "fp8", res["fp8"]["s"], res["fp8"]["err"])
    errs = {"torch": res.get("err"), "flashmla": res.get("flashmla_err")}
    for k, t in peer_times(res).items():
        rec(k, "bf16", t, errs.get(k))
    return out


def fmt_decode(rows, ceil):
    """rows: (B, T, H, res, default tag). k3c = the default plan; best = the fastest spill-free plan timed."""
    bw, fl = ceil
    nan = float("nan")
    if any(res["plans"] for *_, res, _ in rows):
        print("\n| B | T | H | k3c bf16 ms (plan) | best spill-free ms (plan) | TB/s | TFLOP/s | roofline % | torch ms "
              "| x torch | sglang ms | x sglang | FlashMLA ms | x FlashMLA | err vs torch | FlashMLA err |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for B, T, H, res, dtag in rows:
            flops, nbytes = decode_flops(B, T, H, L_, R_), decode_bytes(B, T, "bf16", L_, R_)
            t = res["plans"].get(dtag, nan)
            free = {k: v for k, v in res["plans"].items() if k not in SPILLING}
            btag = min(free, key=free.get) if free else dtag
            tb = free.get(btag, t)
            eff = max(nbytes / t / bw, flops / t / fl) * 100
            tt, ts, tf = res.get("torch"), res.get("sglang", "n/a"), res.get("flashmla")
            s_sgl = "fault (2^31)" if ts is None else ("n/a" if ts == "n/a" else f"{ts * 1e3:.3f}")
            x_sgl = "-" if not isinstance(ts, float) else f"{ts / t:.2f}"
            print(f"| {B} | {t_label(T)} | {H} | {t * 1e3:.3f} ({dtag}) | {tb * 1e3:.3f} ({btag}) | "
                  f"{nbytes / t / 1e12:.2f} | {flops / t / 1e12:.0f} | {eff:.0f} | "
                  f"{'-' if tt is None else f'{tt * 1e3:.3f}'} | {'-' if tt is None else f'{tt / t:.2f}'} | "
                  f"{s_sgl} | {x_sgl} | {'-' if tf is None else f'{tf * 1e3:.3f}'} | "
                  f"{'-' if tf is None else f'{tf / t:.2f}'} | {res.get('err', nan):.1e} | "
                  f"{res.get('flashmla_err', nan):.1e} |")
    if any("fp8" in res for *_, res, _ in rows):
        print("\n| B | T | H | k3c fp8 ms (plan) | x bf16 cache | GB read | TB/s | TFLOP/s | roofline % | "
              "err vs k3c bf16 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for B, T, H, res, dtag in rows:
            if "fp8" not in res:
                continue
            f8 = res["fp8"]
            t, t16 = f8["s"], res["plans"].get(dtag)
            flops, nbytes = decode_flops(B, T, H, L_, R_), decode_bytes(B, T, "fp8", L_, R_)
            eff = max(nbytes / t / bw, flops / t / fl) * 100
            print(f"| {B} | {t_label(T)} | {H} | {t * 1e3:.3f} ({f8['plan']}) | "
                  f"{'-' if t16 is None else f'{t16 / t:.2f}'} | {nbytes / 1e9:.2f} | {nbytes / t / 1e12:.2f} | "
                  f"{flops / t / 1e12:.0f} | {eff:.0f} | {f8['err']:.1e} |")
    for B, T, H, res, dtag in rows:
        if len(res["plans"]) > 1:
            print(f"# sweep B={B} T={t_label(T)} H={H}: " + ", ".join(
                f"{k}{' (spills)' if k in SPILLING else ''} {v * 1e3:.3f}" for k, v in res["plans"].items()))


def summary_rows(rows) -> list[dict]:
    """Per decode shape: k3c bf16 / fp8 seconds, fp8 speedup (bf16 time / fp8 time), FlashMLA seconds, FlashMLA / k3c
    bf16, and the best peer (the fastest of torch, sglang, FlashMLA) / k3c bf16; None where not measured."""
    out = []
    for B, T, H, res, dtag in rows:
        t16 = res["plans"].get(dtag)
        t8 = res["fp8"]["s"] if "fp8" in res else None
        tf = res.get("flashmla")
        peers = peer_times(res)
        best = min(peers, key=peers.get) if peers else None
        out.append({"shape": f"B={B} T={t_label(T)} H={H}", "k3c_bf16": t16, "k3c_fp8": t8,
                    "fp8_speedup": t16 / t8 if t16 and t8 else None, "flashmla": tf,
                    "flashmla_over_k3c": tf / t16 if tf and t16 else None, "best_peer": best,
                    "best_peer_over_k3c": peers[best] / t16 if best and t16 else None})
    return out


def fmt_summary(rows):
    def ms(s):
        return "-" if s is None else f"{s * 1e3:.3f}"

    def x(v):
        return "-" if v is None else f"{v:.2f}"
    print("\n## Summary (ms; peer/k3c = peer time / k3c bf16-cache time, > 1: k3c faster; fp8 speedup = k3c bf16 "
          "time / k3c fp8 time)\n")
    print("| shape | k3c bf16 | k3c fp8 | fp8 speedup | FlashMLA | FlashMLA/k3c(bf16) | best-peer/k3c |")
    print("|---|---|---|---|---|---|---|")
    for s in summary_rows(rows):
        bp = "-" if s["best_peer"] is None else f"{x(s['best_peer_over_k3c'])} ({s['best_peer']})"
        print(f"| {s['shape']} | {ms(s['k3c_bf16'])} | {ms(s['k3c_fp8'])} | {x(s['fp8_speedup'])} | "
              f"{ms(s['flashmla'])} | {x(s['flashmla_over_k3c'])} | {bp} |")


# ---- append-prefill -------------------------------------------------------------------------------------------------
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
        print(f"| {t_label(cached)} | {new} | {H} | {tmha * 1e3:.1f} | {tmqa * 1e3:.1f} | {fast} | {best} | "
              f"{c.mha_seconds * 1e3:.1f}/{c.mqa_seconds * 1e3:.1f} | {'yes' if fast == best else 'NO'} | {err:.1e} |")


# ---- plans ----------------------------------------------------------------------------------------------------------
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

SMOKE_DIMS = (32, 8, 16, 16)             # L, R, P, V of --smoke
SMOKE_GRID = [(2, 128, 4), (1, 200, 3)]
SMOKE_APPENDS = [(96, 17, 2)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("K3C_BENCH_BUDGET", "300")),
                    help="seconds since the start: the plan sweep (last) starts no shape after them (default 300)")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8", "both"), default="both",
                    help="latent cache dtype(s) k3c is timed with (peers always read the bf16 cache; fp8 alone: "
                         "no bf16 rows and no sweep)")
    ap.add_argument("--flashmla-so", default=None,
                    help=f"path of {FLASHMLA_SO} (default: looked for in {', '.join(FLASHMLA_DIRS)})")
    ap.add_argument("--no-flashmla", action="store_true")
    return ap.parse_args(argv)


def main(argv=None):
    """Runs the benchmark; returns (JSON records, decode rows (B, T, H, res, default tag), append rows)."""
    args = parse_args(argv)
    t_start = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    kv = ("bf16", "fp8") if args.kv_dtype == "both" else (args.kv_dtype,)
    global L_, R_, P_, V_
    if args.smoke:
        L_, R_, P_, V_ = SMOKE_DIMS
        grid, appends = SMOKE_GRID, SMOKE_APPENDS
    else:
        L_, R_, P_, V_ = 512, 64, 128, 128
        grid = [(b, t, h) for h in (96, 12) for b in (1, 32, 128) for t in (4096, 32768, 131072)]
        appends = [(131072, n, h) for h in (96, 12) for n in (64, 512, 8192)]
    tgt = target_for(dev)
    ceil = ceilings(dev)
    print(f"# device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__ if dev.type == 'cuda' else '-'}; ceilings: copy "
          f"{ceil[0] / 1e12:.2f} TB/s, bf16 matmul {ceil[1] / 1e12:.0f} TFLOP/s; page size {tgt.mla_page_size}; "
          f"kv {'+'.join(kv)}")
    if "fp8" in kv and lf is None:
        print(f"# fp8 cache: unavailable ({LF_ERROR}); bf16 rows only")
    sgl = load_sglang() if dev.type == "cuda" else None
    print(f"# sglang peer: {'loaded' if sgl else 'absent'}", flush=True)
    fmla, note = load_flashmla(args.flashmla_so, args.no_flashmla, dev)
    print(f"# FlashMLA peer: {note}", flush=True)
    records, drows, arows = [], [], []
    # 1. every issue row: the shipped default plan (bf16 and fp8 caches) and the peers
    for B, T, H in grid:
        t0 = time.time()
        T = -(-T // tgt.mla_page_size) * tgt.mla_page_size
        default = decode_plan(H, L_, tgt)
        res = decode_point(B, T, H, dev, sgl, [default], kv=kv, fmla=fmla)
        drows.append((B, T, H, res, plan_tag(default)))
        ts = [("k3c bf16", res["plans"].get(plan_tag(default))),
              ("k3c fp8", res["fp8"]["s"] if "fp8" in res else None)] + list(peer_times(res).items())
        print(f"# decode B={B} T={T} H={H} ({plan_tag(default)}): "
              + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in ts if v is not None)
              + (f"; fp8 err {res['fp8']['err']:.1e}" if "fp8" in res else "")
              + (f"; FlashMLA err {res['flashmla_err']:.1e}" if "flashmla_err" in res else "")
              + f"; {time.time() - t0:.1f} s", flush=True)
        for n in res["notes"]:
            print(f"#   {n}", flush=True)
    # 2. append-prefill, both modes, and the cost model's pick
    for cached, new, H in appends:
        t0 = time.time()
        try:
            append_point(cached, new, H, dev, records, arows)
        except Exception as e:
            print(f"#   append failed: {type(e).__name__}: {str(e)[:300]}")
        print(f"# append C={cached} N={new} H={H}: {time.time() - t0:.1f} s", flush=True)
    # 3. the plan sweep (bf16 cache: spill-free candidates + the spilling plans for reference), budget permitting
    if not (args.skip_sweep or args.smoke) and "bf16" in kv:
        for B, T, H, res, dtag in sorted(drows, key=lambda r: (r[2] <= 32, r[0] == 1)):   # 96 heads, B >= 32 first
            if time.time() - t_start > args.budget:
                print(f"# sweep stopped: budget ({args.budget:.0f} s) spent", flush=True)
                break
            cands = [c for c in decode_candidates(H, L_, tgt) if plan_tag(c) not in res["plans"]]
            if H > 32 and B >= 32:
                cands += [p for p in SPILLING_PLANS if plan_tag(p) not in res["plans"]]
            res["plans"].update(decode_point(B, T, H, dev, None, cands, peers=False)["plans"])
    for B, T, H, res, dtag in drows:
        records.extend(decode_records(B, T, H, res))
    fmt_decode(drows, ceil)
    fmt_append(arows)
    fmt_summary(drows)
    print(f"# total {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return records, drows, arows


if __name__ == "__main__":
    main()
