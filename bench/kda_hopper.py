"""The Hopper-tier KDA state passing (k3c/codegen/kernels/kda_hopper.py, Gluon, mma.sync with the state in registers)
against the portable state-passing kernel (kda.py's emit_kda_inter), on one sm_90 GPU.

Two steps, because the GPU box cannot build Gluon (Triton 3.6 there; the kernel is written for 3.9):
    python bench/kda_hopper.py build .data/kda-hopper-bench     # here (CPU box, Triton 3.9): every kernel the run
                                                                # launches, compiled (compile_kernels + kernels.json)
    python bench/kda_hopper.py run .data/kda-hopper-bench [--quick] [--json out.json]    # on the GPU

`run` binds those binaries to the device under the strict policy (no JIT: a launch the folder lacks is an error) and
goes through the runtime's kda_chunk_launches, so it times exactly what a plan with inter_tier "hopper" launches.
Per shape (issue 53's rows; random inputs by bench/kda.py's formulas, bf16 o): the intra-chunk kernel runs once, then
the state-passing kernel of each plan is timed alone (the portable default BV=64 / 4 warps and its BV=32 / BV=128
variants; the Gluon kernel at BV = 32 / 64 / 128, 16 V columns a warp, with the state in 1 or 2 K parts), and the
pair intra + inter of each. us/step = the inter kernel's time / the serial chunk steps of its longest sequence
(ceil(max len / 16)): what the chain of one chunk costs when every program is resident. Each Gluon row is checked
against the portable kernel's o and final state (relative L2; > 1e-2 is marked WRONG and not timed).
ms = median of triton.testing.do_bench.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

D = 128
SCALE = D ** -0.5
LB = -5.0
BT = 16
SHAPES = [                                                # (label, sequence lengths, heads)
    ("B=1 T=8192 H=96", (8192,), 96),
    ("B=1 T=32768 H=96", (32768,), 96),
    ("B=4 T=8192 H=12", (8192,) * 4, 12),
    ("B=1 T=8192 H=64", (8192,), 64),
    ("varlen 8 seqs 512-4096 H=96", (512, 4096, 1024, 3072, 2048, 768, 1536, 3584), 96),
    ("varlen FlashKDA 6 seqs H=96", (1300, 547, 2048, 963, 271, 3063), 96),
]
QUICK = (0, 4)
PORTABLE_VARIANTS = [dict(), dict(block_v=32), dict(block_v=128, chunk_warps=8)]
HOPPER_VARIANTS = [dict(block_v=bv, inter_tier="hopper", inter_k_split=nk) for bv in (32, 64, 128) for nk in (1, 2)]
WRONG_BOUND = 1e-2


def tag(var: dict) -> str:
    tier = var.get("inter_tier", "portable")
    return (f"{tier} BV={var.get('block_v', 64)}" + (f" w{var['chunk_warps']}" if "chunk_warps" in var else "")
            + (f" k{var['inter_k_split']}" if "inter_k_split" in var else ""))


def kernels(target) -> list:
    """Every kernel `run` launches (as kda_chunk_launches emits them: bf16 q / k / v / beta, fp32 g, bf16 o, with
    initial states)."""
    from k3c.codegen.kernels.kda import emit_kda_inter, emit_kda_intra, kda_plan

    out = {}
    for _, _, h in SHAPES:
        for var in PORTABLE_VARIANTS + HOPPER_VARIANTS:
            plan = kda_plan(D, "bf16", target, **var)
            for ks in (emit_kda_intra(h, D, target=target, qk_dtype="bf16", g_dtype="fp32", beta_dtype="bf16",
                                      scale=SCALE, plan=plan, interpret=False),
                       emit_kda_inter(h, D, target=target, v_dtype="bf16", o_dtype="bf16", plan=plan,
                                      has_initial_state=True, interpret=False)):
                out[ks.key] = ks
    return list(out.values())


# ---- build (CPU box) ------------------------------------------------------------------------------------------------
def build(out_dir: str) -> None:
    from k3c.codegen.aot import compile_kernels
    from k3c.codegen.targets import get_target

    target = get_target("h200")
    compiled = compile_kernels(kernels(target), target, out_dir, progress=False)
    with open(os.path.join(out_dir, "kernels.json"), "w", encoding="utf-8") as f:
        json.dump([ck.to_dict() for ck in compiled], f)
    for ck in compiled:
        r = ck.resources
        print(f"{ck.name} ({ck.tier}): {r.regs_text()} regs, spills {r.spill_count}, shared {r.shared_bytes} B")


# ---- run (GPU) ------------------------------------------------------------------------------------------------------
def bind(bin_dir: str):
    import torch

    from k3c.codegen.aot import CompiledKernel
    from k3c.runtime import launcher
    from k3c.runtime.devices import target_for

    dev = torch.device("cuda", torch.cuda.current_device())
    target = target_for(dev)
    if not target.has_tier("hopper"):
        print(f"bench/kda_hopper.py run: {target.name} has no hopper tier (an sm_90 GPU is needed)", file=sys.stderr)
        raise SystemExit(2)
    with open(os.path.join(bin_dir, "kernels.json"), encoding="utf-8") as f:
        compiled = [CompiledKernel.from_dict(d) for d in json.load(f)]
    cat = launcher.Catalogue(target, os.path.abspath(bin_dir), {ck.catalogue_key: ck for ck in compiled})
    return dev, launcher.Binding(cat, target, "strict")


def inputs(seqs, h: int, dev, seed: int = 0) -> dict:
    """bench/kda.py's derive_k3c distributions: q, k L2-normed bf16, v bf16, g = lb * sigmoid(..) fp32, beta bf16,
    int32 cu, initial states fp32 [N, H, K, V]."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed)
    t = sum(seqs)

    def r(*shape):
        return torch.randn(*shape, device=dev, generator=gen)
    q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (r(t, h, D), r(t, h, D)))
    g = LB * torch.sigmoid((r(h) * 0.5).exp()[None, :, None] * (r(t, h, D) + r(h, D) * 0.5))
    cu = [0]
    for n in seqs:
        cu.append(cu[-1] + n)
    return dict(q=q.bfloat16(), k=k.bfloat16(), v=r(t, h, D).bfloat16(), g=g.contiguous(),
                beta=torch.sigmoid(r(t, h)).bfloat16(), cu=torch.tensor(cu, dtype=torch.int32, device=dev),
                s0=r(len(seqs), h, D, D) * 0.1)


def timeit(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def shape_rows(label, seqs, h, dev, binding) -> list[dict]:
    import torch

    from k3c.runtime.kernel_impls.kda import kda_chunk_launches

    x = inputs(seqs, h, dev)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["s0"])
    steps = math.ceil(max(seqs) / BT)
    rows, ref, best = [], None, {}
    for var in PORTABLE_VARIANTS + HOPPER_VARIANTS:
        intra, inter, o, sT = kda_chunk_launches(*args, scale=SCALE, out_dtype=torch.bfloat16, max_len=max(seqs),
                                                 binding=binding, **var)
        intra()
        inter()
        torch.cuda.synchronize()
        row = dict(shape=label, seqs=list(seqs), heads=h, plan=tag(var), variant=var, steps=steps)
        if ref is None:
            ref = (o.clone(), sT.clone())
        else:
            row["o_vs_portable"], row["state_vs_portable"] = rel(o, ref[0]), rel(sT, ref[1])
            if not (row["o_vs_portable"] < WRONG_BOUND and row["state_vs_portable"] < WRONG_BOUND):
                print(f"{label} {tag(var)}: WRONG (o {row['o_vs_portable']:.2e}, state "
                      f"{row['state_vs_portable']:.2e} against the portable default)", flush=True)
                rows.append(dict(row, wrong=True))
                continue
        ms = timeit(inter)
        row.update(inter_ms=ms, us_per_step=ms * 1e3 / steps, intra_ms=timeit(intra))

        def both():
            intra()   # noqa: B023
            inter()   # noqa: B023
        row["chunk_ms"] = timeit(both)
        tier = var.get("inter_tier", "portable")
        if tier not in best or ms < best[tier]["inter_ms"]:
            best[tier] = row
        rows.append(row)
        extra = (f"  vs portable: o {row['o_vs_portable']:.1e} state {row['state_vs_portable']:.1e}"
                 if "o_vs_portable" in row else "")
        print(f"{label:30s} {tag(var):22s} inter {ms:7.3f} ms  {row['us_per_step']:6.3f} us/step  intra "
              f"{row['intra_ms']:6.3f} ms  intra+inter {row['chunk_ms']:7.3f} ms{extra}", flush=True)
    if "portable" in best and "hopper" in best:
        p, g = best["portable"], best["hopper"]
        print(f"{label:30s} best hopper ({g['plan']}) / best portable ({p['plan']}): inter "
              f"{p['inter_ms'] / g['inter_ms']:.2f}x faster, {g['us_per_step']:.3f} vs {p['us_per_step']:.3f} "
              f"us/step; intra+inter {g['chunk_ms']:.3f} vs {p['chunk_ms']:.3f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The Hopper-tier KDA state passing against the portable kernel "
                                             "(module doc)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile every kernel of the run (CPU box, Triton 3.9)")
    b.add_argument("out_dir")
    r = sub.add_parser("run", help="check and time them on an sm_90 GPU")
    r.add_argument("bin_dir")
    r.add_argument("--quick", action="store_true", help="the headline shape and the 8-sequence varlen one only")
    r.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.out_dir)
        return 0
    if not os.path.isfile(os.path.join(a.bin_dir, "kernels.json")):
        print(f"{a.bin_dir}: no kernels.json (run `python bench/kda_hopper.py build {a.bin_dir}` on a box with "
              "Triton 3.9 first)", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench/kda_hopper.py run: needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    dev, binding = bind(a.bin_dir)

    print(f"device: {torch.cuda.get_device_name(dev)}; target {binding.target.name}", flush=True)
    rows = []
    for i, (label, seqs, h) in enumerate(SHAPES):
        if a.quick and i not in QUICK:
            continue
        rows += shape_rows(label, seqs, h, dev, binding)
    from k3c.runtime import launcher

    s = launcher.stats()
    print(f"launches from binaries: {s.binaries}, jit: {s.jit}, tier fallbacks: {s.tier_fallbacks}", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
