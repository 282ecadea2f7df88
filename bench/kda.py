"""KDA benchmark (run on a GPU with fla-core / flash-linear-attention 0.6.0 installed): k3c's generated KDA kernels
against fla's chunk_kda (prefill) and fused_recurrent_kda (decode), measured in the same run.

    python bench/kda.py [--json out.json] [--budget SECONDS] [--quick]

Prefill: B=1 T=8192 H=96, B=1 T=32768 H=96, B=4 T=8192 H=12 (D=128). FLOPs by K3.md's per-chunk formula
12C^3 + 8C^2 D + 6C D^2 with C = 64 (the same count for both sides, so the ratio is the time ratio); bytes
8C^2 + 22CD per chunk and head. k3c rows: `chunk` = the chunk kernel on prepared inputs (bf16 q/k/v, fp32 g,
bf16 beta), several block-size variants; `prep+chunk` = from the raw projections (conv, SiLU, L2 norm, gate, beta
in the prep kernel). fla: chunk_kda with the safe gate, gate, L2 norm and beta sigmoid in kernel.
Decode: B=64 H=96 and B=256 H=12; state TB/s = 8 D^2 bytes per head and token (fp32 state read + write) against the
measured copy bandwidth; `layer` = conv + SiLU + norms + gates + recurrence + output RMSNorm x sigmoid gate (k3c: one
fused kernel; fla: 3 x causal_conv1d_update + fused_recurrent_kda with gate/norm/beta in kernel + rms_norm_gated).
Projections (GEMMs) are excluded on both sides. Prints a table and writes JSON records {name, flops, bytes, seconds}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

from k3c.runtime.kernels.kda import cu_seqlens, kda_chunk, kda_decode, kda_prep, unpack  # noqa: E402

T_START = time.time()
D = 128
LB = -5.0
ROWS: list[dict] = []


def elapsed() -> float:
    return time.time() - T_START


def bench(fn, rep_ms: int = 60) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e-3


def prefill_cost(b, t, h):
    c = 64
    chunks = b * h * math.ceil(t / c)
    return chunks * (12 * c ** 3 + 8 * c * c * D + 6 * c * D * D), chunks * (8 * c * c + 22 * c * D)


def record(group, shape, name, seconds, flops, nbytes, peer=None, note=""):
    row = dict(group=group, shape=shape, name=name, seconds=seconds, flops=flops, bytes=nbytes, peer=peer, note=note)
    ROWS.append(row)
    ratio = f"{peer / seconds:6.2f}x" if peer else "     -"
    print(f"{group:8s} {shape:22s} {name:34s} {seconds * 1e3:9.3f} ms {flops / seconds / 1e12:8.1f} TFLOP/s "
          f"{nbytes / seconds / 1e12:6.2f} TB/s  vs fla {ratio} {note}", flush=True)


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def gate_params(h):
    a_log = torch.linspace(math.log(0.5), math.log(8.0), h, device="cuda")
    dt_bias = torch.randn(h * D, device="cuda") - 1.0
    return a_log, dt_bias


def safe_gate(f, a_log, dt_bias, h):
    x = f.float().view(*f.shape[:-1], h, D) + dt_bias.view(h, D)
    return LB * torch.sigmoid(a_log.exp()[:, None] * x)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- numerics on the GPU (bf16 inputs, fp32 state) ----------------------------------------------------------------
def numerics():
    from k3c.runtime.reference import kda_chunked, kda_recurrent
    torch.manual_seed(0)
    t, h = 777, 4
    q = torch.nn.functional.normalize(randn(t, h, D).float(), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(t, h, D).float(), dim=-1).bfloat16()
    v = randn(t, h, D)
    a_log, dt_bias = gate_params(h)
    g = safe_gate(randn(t, h * D), a_log, dt_bias, h)
    beta = torch.sigmoid(randn(t, h).float()).bfloat16()
    s0 = randn(1, h, D, D, dtype=torch.float32, scale=0.5)
    o_r, s_r = kda_chunked(q[None], k[None], v[None], g[None], beta[None], initial_state=s0)
    for dot in ("bf16", "tf32"):
        o, s = kda_chunk(q, k, v, g, beta, cu_seqlens([t], "cuda"), s0, dot=dot)
        print(f"numerics chunk dot={dot}: rel err o {rel(o, o_r[0]):.2e} state {rel(s, s_r):.2e}", flush=True)
    g2 = torch.full_like(g, LB)
    o, s = kda_chunk(q, k, v, g2, beta, cu_seqlens([t], "cuda"), s0)
    o_r2, _ = kda_recurrent(q[None], k[None], v[None], g2[None], beta[None], initial_state=s0)
    print(f"numerics chunk g=lb everywhere: finite {bool(torch.isfinite(o).all() and torch.isfinite(s).all())} "
          f"rel err {rel(o, o_r2[0]):.2e}", flush=True)


# ---- prefill ----------------------------------------------------------------------------------------------------
CHUNK_VARIANTS = [dict(), dict(block_v=128, chunk_warps=8, dot="bf16"), dict(block_v=32, chunk_warps=8, dot="bf16"),
                  dict(block_v=64, chunk_warps=8, dot="tf32")]        # dict(): the default plan (BV=64, 8 warps, bf16)


def prefill(b, t, h, variants):
    from fla.ops.kda import chunk_kda
    shape = f"B={b} T={t} H={h}"
    flops, nbytes = prefill_cost(b, t, h)
    n = b * t
    xq, xk, xv, xf = (randn(n, h * D) for _ in range(4))
    xb = randn(n, h)
    a_log, dt_bias = gate_params(h)
    s0 = randn(b, h, D, D, dtype=torch.float32, scale=0.1)
    cu = cu_seqlens([t] * b, "cuda")
    # fla: raw projections in, gate / L2 norm / beta sigmoid in kernel (conv excluded)
    fq, fk, fv, ff = (x.view(b, t, h, D) for x in (xq, xk, xv, xf))
    fb = xb.view(b, t, h)

    def run_fla():
        return chunk_kda(fq, fk, fv, ff, fb, A_log=a_log, dt_bias=dt_bias, initial_state=s0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=True, lower_bound=LB)
    t_fla = None
    try:
        with torch.inference_mode():
            o_fla, s_fla = run_fla()
            t_fla = bench(run_fla)
        record("prefill", shape, "fla chunk_kda", t_fla, flops, nbytes)
    except Exception as e:  # keep going: the k3c rows still mean something
        print(f"fla chunk_kda failed: {type(e).__name__}: {e}", flush=True)
        o_fla = None
    # k3c inputs prepared as fla's kernel sees them internally
    q = torch.nn.functional.normalize(xq.float().view(n, h, D), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(xk.float().view(n, h, D), dim=-1).bfloat16()
    v = xv.view(n, h, D)
    g = safe_gate(xf, a_log, dt_bias, h).contiguous()
    beta = torch.sigmoid(xb.float()).bfloat16()
    best = None
    for var in variants:
        name = "k3c chunk " + (",".join(f"{k_}={v_}" for k_, v_ in var.items()) or "default plan")
        try:
            fn = lambda: kda_chunk(q, k, v, g, beta, cu, s0, out_dtype=torch.bfloat16, **var)  # noqa: E731
            o, s = fn()
            sec = bench(fn)
            err = ""
            if o_fla is not None:
                err = f"rel err vs fla o {rel(o.view(b, t, h, D), o_fla):.1e} state {rel(s, s_fla):.1e}"
            record("prefill", shape, name, sec, flops, nbytes, t_fla, err)
            if best is None or sec < best[0]:
                best = (sec, var)
        except Exception as e:
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
    if best is None:
        return
    var = best[1]
    conv_w = tuple(randn(h * D, 1, 4, scale=0.5) for _ in range(3))
    tails = tuple(randn(b, h * D, 3) for _ in range(3))

    def full():
        packed, _ = kda_prep(xq, xk, xv, xf, xb, conv_w, a_log, dt_bias, tails, cu, num_heads=h, head_dim=D,
                             gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, max_len=t)
        pq, pk, pv, pg, pb = unpack(packed, h, D)
        return kda_chunk(pq, pk, pv, pg, pb, cu, s0, out_dtype=torch.bfloat16, **var)
    try:
        full()
        record("prefill", shape, "k3c prep+chunk (best variant)", bench(full), flops, nbytes, t_fla,
               "incl. short conv, which fla's row does not do")
    except Exception as e:
        print(f"k3c prep+chunk failed: {type(e).__name__}: {e}", flush=True)


# ---- decode -----------------------------------------------------------------------------------------------------
def decode(b, h):
    from fla.ops.kda import fused_recurrent_kda
    shape = f"B={b} H={h}"
    nbytes = b * h * 8 * D * D
    flops = b * h * 7 * D * D
    state = randn(b, h, D, D, dtype=torch.float32, scale=0.1)
    other = torch.empty_like(state)
    t_copy = bench(lambda: other.copy_(state))
    record("decode", shape, "torch copy of the state", t_copy, 0, nbytes, note="copy bandwidth reference")
    xq, xk, xv, xf, xg = (randn(b, h * D) for _ in range(5))
    xb = randn(b, h)
    a_log, dt_bias = gate_params(h)
    nw = torch.ones(D, device="cuda")
    conv_w = tuple(randn(h * D, 1, 4, scale=0.5) for _ in range(3))
    tails = tuple(randn(b, h * D, 3) for _ in range(3))
    fla_state = state.clone()
    fq, fk, fv, ff = (x.view(b, 1, h, D) for x in (xq, xk, xv, xf))
    fb = xb.view(b, 1, h)

    def run_fla_rec():
        return fused_recurrent_kda(fq, fk, fv, ff, fb, A_log=a_log, dt_bias=dt_bias, initial_state=fla_state,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    t_rec = None
    try:
        with torch.inference_mode():
            run_fla_rec()
            t_rec = bench(run_fla_rec)
        record("decode", shape, "fla fused_recurrent_kda", t_rec, flops, nbytes,
               note=f"{nbytes / t_rec / (nbytes / t_copy):.0%} of copy BW")
    except Exception as e:
        print(f"fla fused_recurrent_kda failed: {type(e).__name__}: {e}", flush=True)
    k_state = state.clone()
    k_tails = tuple(t_.clone() for t_ in tails)

    def run_k3c_layer():
        return kda_decode(xq, xk, xv, xf, xb, xg, conv_w, a_log, dt_bias, nw, k_tails, k_state, num_heads=h,
                          head_dim=D, gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, norm_eps=1e-5, inplace=True)
    s_split = state.clone()

    def run_k3c_split():      # the IR path's decode: conv + norms + gates + step, V split, o in fp32 (kda_out follows)
        return kda_decode(xq, xk, xv, xf, xb, None, conv_w, a_log, dt_bias, None, k_tails, s_split, num_heads=h,
                          head_dim=D, gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, norm_eps=1e-5, inplace=True,
                          fuse_out=False)
    try:
        run_k3c_split()
        t_s = bench(run_k3c_split)
        record("decode", shape, "k3c decode, V split (no out norm)", t_s, flops, nbytes, t_rec,
               f"{nbytes / t_s / (nbytes / t_copy):.0%} of copy BW; ratio vs fla recurrence")
    except Exception as e:
        print(f"k3c split decode failed: {type(e).__name__}: {e}", flush=True)
    run_k3c_layer()
    t_k = bench(run_k3c_layer)
    record("decode", shape, "k3c fused decode (whole layer)", t_k, flops, nbytes, t_rec,
           f"{nbytes / t_k / (nbytes / t_copy):.0%} of copy BW; ratio vs fla recurrence only")
    # fla's layer path: conv updates + recurrence + gated RMSNorm
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        caches = tuple(randn(b, h * D, 4) for _ in range(3))
        wts = tuple(w_.view(h * D, 4) for w_ in conv_w)

        def run_fla_layer():
            q_, _ = causal_conv1d_update(xq.view(b, 1, h * D), caches[0], weight=wts[0], activation="silu")
            k_, _ = causal_conv1d_update(xk.view(b, 1, h * D), caches[1], weight=wts[1], activation="silu")
            v_, _ = causal_conv1d_update(xv.view(b, 1, h * D), caches[2], weight=wts[2], activation="silu")
            o, _ = fused_recurrent_kda(q_.view(b, 1, h, D), k_.view(b, 1, h, D), v_.view(b, 1, h, D), ff, fb,
                                       A_log=a_log, dt_bias=dt_bias, initial_state=fla_state, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, lower_bound=LB)
            return rms_norm_gated(o.view(b, h, D), xg.view(b, h, D), nw, None, activation="sigmoid", eps=1e-5)
        with torch.inference_mode():
            run_fla_layer()
            t_layer = bench(run_fla_layer)
        record("decode", shape, "fla layer path (conv+rec+norm)", t_layer, flops, nbytes)
        record("decode", shape, "k3c fused decode vs fla layer", t_k, flops, nbytes, t_layer)
    except Exception as e:
        print(f"fla layer path failed: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="kda-bench.json")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("K3C_BENCH_BUDGET", 230)),
                    help="start no new step after this many seconds (a started step runs to its end)")
    ap.add_argument("--quick", action="store_true", help="only the headline shapes")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    steps = [("numerics", numerics),
             ("decode 64x96", lambda: decode(64, 96)),
             ("decode 256x12", lambda: decode(256, 12)),
             ("prefill 1x8192x96", lambda: prefill(1, 8192, 96, CHUNK_VARIANTS))]
    if not args.quick:
        steps += [("prefill 4x8192x12", lambda: prefill(4, 8192, 12, CHUNK_VARIANTS[:3])),
                  ("prefill 1x32768x96", lambda: prefill(1, 32768, 96, CHUNK_VARIANTS[:2]))]
    for name, fn in steps:
        if elapsed() > args.budget:
            print(f"skipped {name}: {elapsed():.0f} s elapsed > budget {args.budget:.0f} s", flush=True)
            continue
        t0 = time.time()
        try:
            fn()
        except Exception as e:
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        print(f"[{name}: {time.time() - t0:.1f} s, total {elapsed():.0f} s]", flush=True)
        write_json(args.json)          # after every step: a run cut short still leaves its rows


def write_json(name):
    out = Path(os.environ.get("OUT", ".")) / name
    out.write_text(json.dumps([{"name": f"{r['group']} {r['shape']} {r['name']}", "flops": r["flops"],
                                "bytes": r["bytes"], "seconds": r["seconds"], "peer_seconds": r["peer"],
                                "note": r["note"]} for r in ROWS], indent=1))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
