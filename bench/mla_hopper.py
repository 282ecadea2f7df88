"""The Hopper-tier MLA decode (k3c/codegen/kernels/mla_hopper.py, Gluon) against an fp32 reference, k3c's portable
decode and FlashMLA, on one sm_90 GPU.

Two steps, because the GPU box cannot build Gluon (Triton 3.6 there; the kernel is written for 3.9):
    python bench/mla_hopper.py build .hopper-bin          # here (CPU box, Triton 3.9): cubin + metadata JSON
    python bench/mla_hopper.py run .hopper-bin [--quick]  # on the GPU: loads the cubin through k3c.runtime.binary

`run` first checks numerics on small shapes (random bf16, pages in shuffled order, ragged lengths with partial last
pages whose dead slots hold NaN, 1..3 query tokens with the causal band, head counts that leave padded rows), each
against an fp32 torch reference of the paged MQA decode (relative L2 error; the portable k3c decode's error is
printed beside it), then times one decode step (the Hopper kernel + k3c's LSE merge kernel) beside the portable
decode (rt.mqa_decode) and FlashMLA (vllm 0.33.0's _flashmla_C dense decode, through bench/mla.py's loader: .peers/
carry/so/_flashmla_C.abi3.so) on B x T x H of issue 52 (one query token, every sequence the full context).
ms = median of triton.testing.do_bench; ratio = FlashMLA ms / k3c Hopper ms (> 1: k3c is faster).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

L, R, PS = 512, 64, 64
SCALE = (128 + 64) ** -0.5
SHAPES = [(1, 4096), (1, 32768), (32, 4096), (32, 32768), (128, 32768), (1, 131072), (32, 131072), (128, 4096),
          (128, 131072)]
HEADS = (96, 12)


def kernel_sources():
    """Both schedules of the Hopper decode (the shipped seesaw first, then the lockstep one)."""
    from k3c.codegen.kernels.mla_hopper import SCHEDULES, emit_mla_decode_hopper
    from k3c.codegen.targets import get_target

    return [emit_mla_decode_hopper(L, R, PS, SCALE, target=get_target("h200"), schedule=s) for s in SCHEDULES]


# ---- build (CPU box) ------------------------------------------------------------------------------------------------
def build(out_dir: str) -> None:
    import linecache
    import re
    import types

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k3c.codegen.resources import parse_cubin

    os.makedirs(out_dir, exist_ok=True)
    entries = []
    for ks in kernel_sources():
        fname = os.path.join(out_dir, f"{ks.name}.py")
        with open(fname, "w") as f:
            f.write(ks.source)
        mod = types.ModuleType(f"_k3c_hopper_{ks.name}")
        mod.__file__ = fname
        linecache.cache[fname] = (len(ks.source), None, ks.source.splitlines(True), fname)
        exec(compile(ks.source, fname, "exec"), mod.__dict__)      # noqa: S102 - our own generated module
        fn = getattr(mod, ks.name)
        sig = {**ks.signature, **{k: "constexpr" for k in ks.constexprs}}
        ptrs = [a for a, t in ks.signature.items() if t.startswith("*")]
        t0 = time.time()
        c = triton.compile(GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                                               for k, v in ks.constexprs.items()},
                                          attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ptrs}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": ks.num_warps, "num_stages": 1})
        md = c.metadata._asdict()
        md["target"] = {"backend": "cuda", "arch": 90, "warp_size": 32}
        md = {k: (v if _jsonable(v) else repr(v)) for k, v in md.items()}
        res = parse_cubin(c.asm["cubin"], ks.name)
        wgmma = len(re.findall(r"wgmma\.mma_async", c.asm["ptx"]))
        with open(os.path.join(out_dir, f"{ks.name}.cubin"), "wb") as f:
            f.write(c.asm["cubin"])
        with open(os.path.join(out_dir, f"{ks.name}.ptx"), "w") as f:
            f.write(c.asm["ptx"])
        entries.append({"name": ks.name, "signature": ks.signature, "constexprs": ks.constexprs, "metadata": md,
                        "divisible_by_16": ptrs, "resources": res, "wgmma": wgmma})
        print(f"built {ks.name} in {time.time() - t0:.1f} s: regs {res.get('regs')} stack frame "
              f"{res.get('frame_bytes')} B, shared {md.get('shared')} B, global scratch "
              f"{md.get('global_scratch_size')} B, {md.get('num_warps')} warps, wgmma {wgmma} in the PTX")
    with open(os.path.join(out_dir, "kernels.json"), "w") as f:
        json.dump(entries, f, indent=1)


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


# ---- run (GPU) ------------------------------------------------------------------------------------------------------
class Hopper:
    """The prebuilt Hopper decode kernel + k3c's portable LSE merge: one decode step."""

    def __init__(self, bin_dir: str, info: dict, dev):
        from k3c.runtime.binary import load_binary

        self.info = info
        self.tag = info["name"].rsplit("bf16", 1)[-1].strip("_") or "lockstep"
        with open(os.path.join(bin_dir, self.info["name"] + ".cubin"), "rb") as f:
            image = f.read()
        self.k = load_binary(image, backend="cuda", entry_name=self.info["name"], signature=self.info["signature"],
                             metadata=self.info["metadata"], divisible_by_16=self.info["divisible_by_16"],
                             device_index=dev.index or 0)
        self.dev = dev

    def plan(self, B, ROWS, n_pages):
        from k3c.codegen.kernels.mla import DecodePlan
        from k3c.runtime.kernel_impls.mla import decode_splits

        tiles = -(-ROWS // 64)
        S = decode_splits(DecodePlan(64, 8, 1, tier="hopper"), B, tiles, n_pages, self.dev)   # the runtime's rule
        pps = max(1, -(-n_pages // S))
        return max(1, -(-n_pages // pps)), pps, tiles

    def split(self, B, ROWS, max_len, splits=None):
        """(S, pages per split, head tiles): the runtime's rule, or `splits` asked for."""
        n_pages = -(-max_len // PS)
        S, pps, tiles = self.plan(B, ROWS, n_pages)
        if splits:
            pps = max(1, -(-n_pages // splits))
            S = -(-n_pages // pps)
        return S, pps, tiles

    def partials(self, q, pool, bt, lens, NH, max_len, splits=None):
        import torch

        B, ROWS, _ = q.shape
        S, pps, tiles = self.split(B, ROWS, max_len, splits)
        o = torch.full((S, B, ROWS, L), float("nan"), dtype=torch.float32, device=q.device)
        lse = torch.full((S, B, ROWS), float("nan"), dtype=torch.float32, device=q.device)
        args = [q, pool, bt, lens, o, lse, ROWS, NH, ROWS // NH, bt.shape[1], pps, B, S]
        return (tiles, S, B), args, o, lse

    def decode_fn(self, q, pool, bt, lens, NH, max_len, splits=None):
        """fn() -> o [B, ROWS, L] bf16: the kernel then the merge (the launches fixed, as the runtime does)."""
        import torch

        from k3c.codegen.kernels.mla import emit_mla_merge
        from k3c.runtime.devices import target_for
        from k3c.runtime.launcher import fixed_launcher

        grid, args, o, lse = self.partials(q, pool, bt, lens, NH, max_len, splits)
        B, ROWS = q.shape[0], q.shape[1]
        M, S = B * ROWS, grid[1]
        out = torch.empty(M, L, dtype=q.dtype, device=q.device)
        mk = emit_mla_merge(L, target=target_for(q.device), out_dtype="bf16", block_d=128, write_lse=False)
        k = self.k
        k.launch(grid, args)
        ops = o.view(S, M, L)
        lsv = lse.view(S, M)
        merge = fixed_launcher(mk, ops, lsv, out, lsv, M, S)

        def fn():
            k.launch(grid, args)
            if merge is not None:
                merge(ops, lsv, out, lsv, M, S)
            return out.view(B, ROWS, L)
        return fn


def reference(q, pool, bt, lens, NH):
    """fp32 paged MQA decode: o [B, ROWS, L] (rows token-major (t, head); causal band over the TQ query tokens)."""
    import torch

    B, ROWS, W = q.shape
    TQ = ROWS // NH
    outs = []
    for b in range(B):
        n = int(lens[b])
        pages = bt[b, : -(-n // PS)].long()
        kv = pool[pages].reshape(-1, W)[:n].float()
        s = (q[b].float() @ kv.T) * SCALE
        qpos = n - TQ + torch.arange(ROWS, device=q.device) // NH
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        outs.append(torch.softmax(s, -1) @ kv[:, :L])
    return torch.stack(outs)


def rel_err(a, ref) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm()).item()


def merge_torch(o, lse):
    """LSE merge of the split partials (the merge kernel's math, in torch): o [S, B, ROWS, L], lse [S, B, ROWS]."""
    import torch

    m = lse.max(0).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wgt = torch.exp(lse - m)
    return (wgt[..., None] * o).sum(0) / wgt.sum(0).clamp_min(1e-30)[..., None]


def check(hops, dev) -> bool:
    import torch

    from k3c.runtime.kernel_impls import mla as rt

    g = torch.Generator(device=dev).manual_seed(0)
    ok = True
    print("| case | B | lens | H | TQ | schedule | splits | rel err hopper (kernel+merge) | rel err partials "
          "(torch merge) | rel err portable | unwritten |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [(2, [200, 64], 12, 1, None), (3, [1000, 777, 65], 96, 1, None), (2, [4096, 3001], 96, 2, None),
             (2, [530, 129], 16, 3, 3), (1, [64 * 40], 128, 1, 7), (4, [5000, 1, 63, 2048], 12, 1, None)]
    for i, (B, lens_l, H, TQ, splits) in enumerate(cases):
        maxp = -(-max(lens_l) // PS) + 1
        n_pool = B * maxp + 3
        pool = torch.randn(n_pool, PS, L + R, generator=g, device=dev).to(torch.bfloat16)
        perm = torch.randperm(n_pool, generator=g, device=dev)[: B * maxp].view(B, maxp).to(torch.int32)
        for b, n in enumerate(lens_l):      # dead slots of each last page: NaN (never to be read)
            if n % PS:
                pool[perm[b, n // PS].long(), n % PS:] = float("nan")
        lens = torch.tensor(lens_l, dtype=torch.int32, device=dev)
        ROWS = TQ * H
        q = torch.randn(B, ROWS, L + R, generator=g, device=dev).to(torch.bfloat16)
        ref = reference(q, pool, perm, lens, H)
        try:
            store = rt.LatentStore(pool, perm, list(lens_l))
            e_port = rel_err(rt.mqa_decode(q, store, lens, SCALE, L, num_heads=H, max_len=max(lens_l),
                                           plan=portable_plan(ROWS, dev)), ref)
        except Exception as e:      # the portable path is context, not the subject
            e_port = float("nan")
            print(f"# portable decode failed: {type(e).__name__}: {str(e)[:200]}")
        for hop in hops:
            fn = hop.decode_fn(q, pool, perm, lens, H, max(lens_l), splits)
            grid, args, o, lse = hop.partials(q, pool, perm, lens, H, max(lens_l), splits)
            hop.k.launch(grid, args)
            torch.cuda.synchronize()
            unwritten = int(torch.isnan(o).sum() + torch.isnan(lse).sum())
            e_part = rel_err(merge_torch(o, lse), ref)
            e_hop = rel_err(fn(), ref)
            good = e_hop < 1e-2 and e_part < 1e-2 and unwritten == 0 and math.isfinite(e_hop)
            ok &= good
            print(f"| {i} | {B} | {lens_l} | {H} | {TQ} | {hop.tag} | {grid[1]} | {e_hop:.2e} | {e_part:.2e} "
                  f"| {e_port:.2e} | {unwritten} |{'' if good else ' FAIL'}", flush=True)
    return ok


def portable_plan(rows, dev):
    """The portable tier's shipped decode plan for this device (what the runtime runs without the Hopper tier)."""
    from k3c.codegen.kernels.mla import decode_plan
    from k3c.runtime.devices import target_for

    return decode_plan(rows, L, target_for(dev), cache_dtype="bf16", tiers=False)


def timeit(fn):
    import torch
    import triton.testing

    fn()
    torch.cuda.synchronize()
    t = triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
    if t < 1.0:
        t = min(t, triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median"))
    return t


def load_bench_mla():
    spec = importlib.util.spec_from_file_location("bench_mla", os.path.join(ROOT, "bench", "mla.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timings(hops, dev, shapes, heads, portable: bool, out_json: str | None, splits=(None,)) -> None:
    import torch

    from k3c.runtime.kernel_impls import mla as rt

    bm = load_bench_mla()
    fm, note = bm.load_flashmla(None, False, dev)
    print(f"# FlashMLA: {note}")
    name = torch.cuda.get_device_name(dev)
    recs = []
    print(f"| B | T | H | schedule | splits | k3c hopper ms | FlashMLA ms | portable k3c ms | ratio FlashMLA/hopper "
          f"| hopper TFLOP/s | hopper TB/s | err vs FlashMLA | GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, T in shapes:
        pages = -(-T // PS)
        g = torch.Generator(device=dev).manual_seed(1)
        pool = torch.empty(B * pages, PS, L + R, dtype=torch.bfloat16, device=dev)
        pool.normal_(generator=g)
        bt = (torch.arange(B, device=dev)[:, None] * pages + torch.arange(pages, device=dev)[None, :]).to(torch.int32)
        lens = torch.full((B,), T, dtype=torch.int32, device=dev)
        for H in heads:
            q = torch.randn(B, H, L + R, generator=g, device=dev).to(torch.bfloat16)
            tf = tp = f = None
            if fm is not None:
                try:
                    f = fm.bind(q, pool, bt, lens, SCALE, L)
                    tf = timeit(f)
                except Exception as e:
                    print(f"# FlashMLA failed: {type(e).__name__}: {str(e)[:200]}")
            if portable:
                store = rt.LatentStore(pool, bt, [T] * B)
                try:
                    pp = portable_plan(H, dev)
                    tp = timeit(lambda: rt.mqa_decode(q, store, lens, SCALE, L, num_heads=H, max_len=T, plan=pp))
                except Exception as e:
                    print(f"# portable failed: {type(e).__name__}: {str(e)[:200]}")
            for hop, split in ((h, sp) for h in hops for sp in splits):
                fn = hop.decode_fn(q, pool, bt, lens, H, T, split)
                n_split = hop.split(B, H, T, split)[0]
                th = timeit(fn)
                ef = rel_err(fn(), f()) if f is not None else None
                flops = B * H * T * (2 * (L + R) + 2 * L)
                byts = B * T * (L + R) * 2
                ratio = tf / th if tf else float("nan")
                recs.append({"B": B, "T": T, "H": H, "schedule": hop.tag, "splits": n_split, "hopper_ms": th,
                             "flashmla_ms": tf, "portable_ms": tp, "ratio": ratio, "err_vs_flashmla": ef, "gpu": name})
                fmt = lambda v, p=3: "n/a" if v is None else f"{v:.{p}f}"   # noqa: E731
                print(f"| {B} | {T // 1024}K | {H} | {hop.tag} | {n_split} | {th:.3f} | {fmt(tf)} | {fmt(tp)} "
                      f"| {ratio:.2f} | {flops / th / 1e9:.0f} | {byts / th / 1e9:.2f} | "
                      f"{'n/a' if ef is None else f'{ef:.1e}'} | {name} |", flush=True)
            del q
        del pool
        torch.cuda.empty_cache()
    if out_json:
        with open(out_json, "w") as f:
            json.dump(recs, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The Hopper-tier MLA decode against an fp32 reference, the portable "
                                             "decode and FlashMLA (build here, run on an sm_90 GPU).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out_dir")
    r = sub.add_parser("run")
    r.add_argument("bin_dir")
    r.add_argument("--quick", action="store_true", help="numerics + 4 timed shapes")
    r.add_argument("--no-check", action="store_true")
    r.add_argument("--no-portable", action="store_true")
    r.add_argument("--shapes", default=None, help="B:T,B:T,...")
    r.add_argument("--heads", default="96,12")
    r.add_argument("--json", default=None)
    r.add_argument("--splits", default=None, help="N,N,...: time these KV split counts too (0: the runtime's rule)")
    r.add_argument("--schedule", default=None, choices=("lockstep", "seesaw"), help="one schedule (default: both)")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.out_dir)
        return 0
    import torch

    index = os.path.join(a.bin_dir, "kernels.json")
    if not os.path.isfile(index):
        print(f"mla_hopper: {index}: no such file (run `python bench/mla_hopper.py build {a.bin_dir}` first, on a "
              "machine with Triton 3.9)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("mla_hopper: run needs an sm_90 GPU (H100 / H200): the binaries are sm_90a", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    with open(index) as f:
        infos = json.load(f)
    hops = [Hopper(a.bin_dir, info, dev) for info in infos if not a.schedule or a.schedule in info["name"]
            or (a.schedule == "lockstep" and info["name"].endswith("bf16"))]
    for hop in hops:
        info = hop.info
        print(f"# {info['name']}: regs {info['resources'].get('regs')}, stack frame "
              f"{info['resources'].get('frame_bytes')} B, shared {info['metadata'].get('shared')} B, "
              f"{info['metadata'].get('num_warps')} warps on {torch.cuda.get_device_name(dev)}")
    ok = True
    if not a.no_check:
        ok = check(hops, dev)
        print(f"# numerics: {'ok' if ok else 'FAILED'}", flush=True)
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")]
    elif a.quick:
        shapes = [(1, 32768), (32, 32768)]
    else:
        shapes = SHAPES
    heads = tuple(int(h) for h in a.heads.split(","))
    splits = tuple(int(x) or None for x in a.splits.split(",")) if a.splits else (None,)
    timings(hops, dev, shapes, heads, not a.no_portable, a.json, splits)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
