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
# fla caches autotune results on disk, keyed without T: the precompile workers (T = 64) would otherwise pick fla's
# configs for every shape (fla's prefill then runs about 1.4x slower than in a clean run)
os.environ.setdefault("FLA_CACHE_RESULTS", "0")

import torch  # noqa: E402

from k3c.runtime.kernel_impls.kda import cu_seqlens, kda_chunk, kda_decode, kda_out, kda_prep, unpack  # noqa: E402

T_START = time.time()
DEV = os.environ.get("K3C_BENCH_DEVICE", "cuda")       # "cpu": a dry run of the script through the interpreter
D = 128
LB = -5.0
ROWS: list[dict] = []


def elapsed() -> float:
    return time.time() - T_START


def bench(fn, rep_ms: int = 50) -> float:
    if DEV == "cpu":
        t0 = time.time()
        fn()
        return time.time() - t0
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=rep_ms, return_mode="median") * 1e-3


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
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def gate_params(h):
    a_log = torch.linspace(math.log(0.5), math.log(8.0), h, device=DEV)
    dt_bias = torch.randn(h * D, device=DEV) - 1.0
    return a_log, dt_bias


def safe_gate(f, a_log, dt_bias, h):
    x = f.float().view(*f.shape[:-1], h, D) + dt_bias.view(h, D)
    return LB * torch.sigmoid(a_log.exp()[:, None] * x)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- plans swept (the defaults of k3c.codegen.kernels.kda.kda_plan are among them) -------------------------------
# the sweep's results per shape: docs/perf.md (KDA)
PREFILL_VARIANTS = [dict(chunk=16, block_v=32, chunk_warps=4), dict(chunk=16, block_v=128, chunk_warps=8),
                    dict(chunk=16, block_v=32, chunk_warps=4, chunk_stages=2), dict(chunk=16, block_v=64, chunk_warps=8),
                    dict(chunk=16, block_v=64, chunk_warps=4), dict(chunk=16, block_v=32, chunk_warps=8),
                    dict(chunk=32, block_v=32, chunk_warps=4)]
DECODE_REC_VARIANTS = [dict(decode_split=True, decode_block_v=16, decode_warps=2),
                       dict(decode_split=True, decode_block_v=32, decode_warps=4),
                       dict(decode_split=True, decode_block_v=64, decode_warps=4),
                       dict(decode_block_v=32, decode_warps=4), dict(decode_block_v=32, decode_warps=8)]
DECODE_LAYER_VARIANTS = [dict(decode_block_v=32, decode_warps=4), dict(decode_block_v=32, decode_warps=8),
                         dict(decode_block_v=16, decode_warps=4), dict(decode_block_v=64, decode_warps=8)]


def tag(var):
    return ",".join(f"{k_.replace('decode_', '').replace('chunk_', '')}={v_}" for k_, v_ in var.items()) or "default"


# ---- prefill ----------------------------------------------------------------------------------------------------
def prefill_inputs(b, t, h):
    n = b * t
    xq, xk, xv, xf = (randn(n, h * D) for _ in range(4))
    xb = randn(n, h)
    a_log, dt_bias = gate_params(h)
    q = torch.nn.functional.normalize(xq.float().view(n, h, D), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(xk.float().view(n, h, D), dim=-1).bfloat16()
    v = xv.view(n, h, D)
    g = safe_gate(xf, a_log, dt_bias, h).contiguous()
    beta = torch.sigmoid(xb.float()).bfloat16()
    return xq, xk, xv, xf, xb, a_log, dt_bias, q, k, v, g, beta


def run_fla_prefill(xq, xk, xv, xf, xb, a_log, dt_bias, s0, b, t, h):
    from fla.ops.kda import chunk_kda
    fq, fk, fv, ff = (x.view(b, t, h, D) for x in (xq, xk, xv, xf))
    return chunk_kda(fq, fk, fv, ff, xb.view(b, t, h), A_log=a_log, dt_bias=dt_bias, initial_state=s0,
                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB)


def prefill(b, t, h, variants):
    shape = f"B={b} T={t} H={h}"
    flops, nbytes = prefill_cost(b, t, h)
    xq, xk, xv, xf, xb, a_log, dt_bias, q, k, v, g, beta = prefill_inputs(b, t, h)
    s0 = randn(b, h, D, D, dtype=torch.float32, scale=0.1)
    cu = cu_seqlens([t] * b, DEV)
    t_fla = None
    try:
        with torch.inference_mode():
            fn = lambda: run_fla_prefill(xq, xk, xv, xf, xb, a_log, dt_bias, s0, b, t, h)  # noqa: E731
            o_fla, s_fla = fn()
            t_fla = bench(fn)
        record("prefill", shape, "fla chunk_kda", t_fla, flops, nbytes)
    except Exception as e:  # keep going: the k3c rows still mean something
        print(f"fla chunk_kda failed: {type(e).__name__}: {e}", flush=True)
        o_fla = None
    best = None
    for var in variants:
        name = "k3c chunk " + tag(var)
        try:
            fn = lambda: kda_chunk(q, k, v, g, beta, cu, s0, out_dtype=torch.bfloat16, max_len=t, **var)  # noqa: E731
            o, s = fn()
            err = ""
            if o_fla is not None:
                eo, es = rel(o.view(b, t, h, D), o_fla), rel(s, s_fla)
                err = f"rel err vs fla o {eo:.1e} state {es:.1e}"
                if not (eo < 2e-2 and es < 2e-2):
                    print(f"{name}: WRONG ({err})", flush=True)
                    continue
            sec = bench(fn)
            record("prefill", shape, name, sec, flops, nbytes, t_fla, err)
            if best is None or sec < best[0]:
                best = (sec, var)
        except Exception as e:
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
    if best is None:
        return []
    var = best[1]
    try:                                   # the best plan's two kernels timed alone
        from k3c.codegen.kernels.kda import inter_dtype
        from k3c.runtime.devices import target_for
        from k3c.runtime.launcher import launch
        from k3c.runtime.kernel_impls.kda import _emit_inter, _emit_intra, _plan
        pl = _plan(D, q.dtype, q.device, **var)
        idt = torch.bfloat16 if inter_dtype(pl.dot) == "bf16" else torch.float32
        tgt = target_for(q.device)
        ki = _emit_intra(h, D, target=tgt, qk_dtype="bf16", v_dtype="bf16", g_dtype="fp32", beta_dtype="bf16",
                         plan=pl, interpret=DEV == "cpu")
        kx = _emit_inter(h, D, target=tgt, o_dtype="bf16", plan=pl, interpret=DEV == "cpu")
        n = b * t
        wu = torch.empty(4, n, h, D, dtype=idt, device=DEV)
        aq = torch.empty(n, h, pl.chunk, dtype=idt, device=DEV)
        eg = torch.empty(n // pl.chunk + b + 1, h, D, dtype=torch.float32, device=DEV)
        o = torch.empty(n, h, D, dtype=torch.bfloat16, device=DEV)
        sT = torch.empty_like(s0)
        intra = lambda: launch(ki, q, k, v, g, beta, wu[0], wu[1], wu[2], wu[3], aq, eg, cu, q.stride(0),  # noqa
                               k.stride(0), v.stride(0), g.stride(0), beta.stride(0), b, t)
        inter = lambda: launch(kx, wu[0], wu[1], wu[2], wu[3], aq, eg, o, s0, sT, cu, b)  # noqa: E731
        intra()
        inter()
        nb = n * h * D * 2
        record("prefill", shape, f"  intra kernel alone ({tag(var)})", bench(intra), flops, 3 * nb + 2 * nb + 4 * nb,
               note="TB/s = q,k,v bf16 + g fp32 in, W,U,qg,kd bf16 out")
        record("prefill", shape, f"  inter kernel alone ({tag(var)})", bench(inter), flops, 5 * nb,
               note="TB/s = W,U,qg,kd bf16 in, o bf16 out")
    except Exception as e:
        print(f"per-kernel timing failed: {type(e).__name__}: {e}", flush=True)
    conv_w = tuple(randn(h * D, 1, 4, scale=0.5) for _ in range(3))
    tails = tuple(randn(b, h * D, 3) for _ in range(3))

    def prep():
        return kda_prep(xq, xk, xv, xf, xb, conv_w, a_log, dt_bias, tails, cu, num_heads=h, head_dim=D,
                        gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, max_len=t, qkv_dtype=torch.bfloat16)

    def full():
        packed, _ = prep()
        pq, pk, pv, pg, pb = unpack(packed, h, D)
        # as the IR path for a bf16 model: bf16 q / k / v rows from the prep, dot = "bf16"
        return kda_chunk(pq, pk, pv, pg, pb, cu, s0, out_dtype=torch.bfloat16, max_len=t, **{"dot": "bf16", **var})
    try:
        full()
        record("prefill", shape, "  prep kernel alone", bench(prep), flops, b * t * h * (4 * D * 2 + 3 * D * 2 + D * 4),
               note="TB/s = 4 x bf16 in, q,k,v bf16 + g fp32 out")
        record("prefill", shape, f"k3c prep+chunk ({tag(var)})", bench(full), flops, nbytes, t_fla,
               "incl. short conv, which fla's row does not do")
    except Exception as e:
        print(f"k3c prep+chunk failed: {type(e).__name__}: {e}", flush=True)
    ranked = sorted((r["seconds"], i) for i, r in enumerate(ROWS) if r["shape"] == shape and r["name"].startswith(
        "k3c chunk "))
    names = ["k3c chunk " + tag(v_) for v_ in variants]
    return [variants[names.index(ROWS[i]["name"])] for _, i in ranked]


# ---- decode -----------------------------------------------------------------------------------------------------
def decode_inputs(b, h):
    xq, xk, xv, xf, xg = (randn(b, h * D) for _ in range(5))
    xb = randn(b, h)
    a_log, dt_bias = gate_params(h)
    nw = torch.rand(D, device=DEV) + 0.5
    conv_w = tuple(randn(h * D, 1, 4, scale=0.5) for _ in range(3))
    tails = tuple(randn(b, h * D, 3) for _ in range(3))
    state = randn(b, h, D, D, dtype=torch.float32, scale=0.1)
    return xq, xk, xv, xf, xb, xg, a_log, dt_bias, nw, conv_w, tails, state


def decode_ref(xq, xk, xv, xf, xb, xg, a_log, dt_bias, nw, conv_w, tails, state, b, h):
    """torch reference of one fused decode step (fp32 math on the bf16 inputs): o, y, new state."""
    feats = []
    for x, w_, t_ in zip((xq, xk, xv), conv_w, tails):
        win = torch.cat([t_.float(), x.float()[:, :, None]], dim=-1)          # [b, HD, 4]
        y = (win * w_.float().view(h * D, 4)).sum(-1).bfloat16().float()
        feats.append((y * torch.sigmoid(y)).bfloat16().float().view(b, h, D))
    q = feats[0] / torch.sqrt((feats[0] ** 2).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
    k = feats[1] / torch.sqrt((feats[1] ** 2).sum(-1, keepdim=True) + 1e-6)
    v = feats[2]
    g = safe_gate(xf, a_log, dt_bias, h)
    beta = torch.sigmoid(xb.float())
    s = state * g.exp()[..., None]
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, s))
    s = s + k[..., None] * u[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q, s)
    y = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + 1e-5) * nw * torch.sigmoid(xg.float().view(b, h, D))
    return o.reshape(b, h * D), y.reshape(b, h * D), s


def decode(b, h):
    shape = f"B={b} H={h}"
    nbytes = b * h * 8 * D * D
    flops = b * h * 7 * D * D
    inputs = decode_inputs(b, h)
    xq, xk, xv, xf, xb, xg, a_log, dt_bias, nw, conv_w, tails, state = inputs
    other = torch.empty_like(state)
    t_copy = bench(lambda: other.copy_(state))
    record("decode", shape, "torch copy of the state", t_copy, 0, nbytes, note="copy bandwidth reference")
    o_ref, y_ref, s_ref = decode_ref(*inputs, b, h)
    fla_state = state.clone()
    t_rec = fla_recurrence(inputs, fla_state, b, h, shape, flops, nbytes, t_copy)
    common = dict(num_heads=h, head_dim=D, gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, norm_eps=1e-5)

    def check(name, out, want, s_new):
        eo, es = rel(out, want), rel(s_new, s_ref)
        ok = eo < 1e-2 and es < 1e-3
        if not ok:
            print(f"{name}: WRONG rel err out {eo:.1e} state {es:.1e}", flush=True)
        return ok, f"rel err vs torch ref out {eo:.1e} state {es:.1e}"

    def step(var):          # the recurrence (conv + norms + gates + step), o out in fp32
        return kda_decode(xq, xk, xv, xf, xb, None, conv_w, a_log, dt_bias, None, tails, state, fuse_out=False,
                          **var, **common)

    def layer(var):         # the whole layer in one kernel (RMSNorm x gate fused)
        return kda_decode(xq, xk, xv, xf, xb, xg, conv_w, a_log, dt_bias, nw, tails, state, **var, **common)

    timing = (shape, flops, nbytes, t_rec, t_copy)
    best_rec = decode_sweep("k3c decode step ", DECODE_REC_VARIANTS, step, o_ref, check, *timing)
    best_layer = decode_sweep("k3c fused layer ", DECODE_LAYER_VARIANTS, layer, y_ref, check, *timing)
    if best_rec is not None:               # the IR path: decode step + kda_out (two launches)
        var = best_rec[2]
        name = f"k3c step ({tag(var)}) + kda_out"

        def two():
            o, _, _ = step(var)
            return kda_out(o.view(b, h, D), xg, nw, 1e-5)
        try:
            sec = bench(two)
            ok, err = check("step+out", two(), y_ref, s_ref)
            record("decode", shape, name, sec, flops, nbytes, t_rec, err)
            if best_layer is None or sec < best_layer[0]:
                best_layer = (sec, name, var)
        except Exception as e:
            print(f"k3c step+out failed: {type(e).__name__}: {e}", flush=True)
    fla_layer(inputs, fla_state, b, h, shape, flops, nbytes, best_layer)


def decode_sweep(label, variants, run, want, check, shape, flops, nbytes, t_rec, t_copy):
    """Time run(var) for every variant whose output passes `check`; the fastest as (seconds, name, var) or None."""
    best = None
    for var in variants:
        name = label + tag(var)
        try:
            out, _, s_new = run(var)
            ok, err = check(name, out, want, s_new)
            if not ok:
                continue
            sec = bench(lambda: run(var))  # noqa: B023 - timed before the next iteration
            record("decode", shape, name, sec, flops, nbytes, t_rec, f"{t_copy / sec:.0%} of copy BW; {err}")
            if best is None or sec < best[0]:
                best = (sec, name, var)
        except Exception as e:
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
    return best


def fla_recurrence(inputs, fla_state, b, h, shape, flops, nbytes, t_copy):
    """fla's fused_recurrent_kda on the same step (gate, L2 norm and beta in kernel): its time, or None."""
    xq, xk, xv, xf, xb, _, a_log, dt_bias, *_ = inputs
    fq, fk, fv, ff = (x.view(b, 1, h, D) for x in (xq, xk, xv, xf))
    fb = xb.view(b, 1, h)

    def run_fla_rec():
        from fla.ops.kda import fused_recurrent_kda
        return fused_recurrent_kda(fq, fk, fv, ff, fb, A_log=a_log, dt_bias=dt_bias, initial_state=fla_state,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    try:
        with torch.inference_mode():
            run_fla_rec()
            t_rec = bench(run_fla_rec)
        record("decode", shape, "fla fused_recurrent_kda", t_rec, flops, nbytes,
               note=f"{t_copy / t_rec:.0%} of copy BW")
        return t_rec
    except Exception as e:
        print(f"fla fused_recurrent_kda failed: {type(e).__name__}: {e}", flush=True)
        return None


def fla_layer(inputs, fla_state, b, h, shape, flops, nbytes, best_layer):
    """fla's layer path (conv updates + recurrence + gated RMSNorm), and the best k3c layer against it."""
    xq, xk, xv, xf, xb, xg, a_log, dt_bias, nw, conv_w, _, _ = inputs
    ff, fb = xf.view(b, 1, h, D), xb.view(b, 1, h)
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.ops.kda import fused_recurrent_kda
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
        if best_layer is not None:
            record("decode", shape, f"best k3c layer vs fla layer: {best_layer[1]}", best_layer[0], flops, nbytes,
                   t_layer)
    except Exception as e:
        print(f"fla layer path failed: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


# ---- compile everything first, in parallel processes (Triton's on-disk cache is then hit in the timed process) --
def _warm(job):
    kind, b, h, var = job
    torch.manual_seed(0)
    try:
        if kind == "prefill":
            t = 64
            xq, xk, xv, xf, xb, a_log, dt_bias, q, k, v, g, beta = prefill_inputs(b, t, h)
            s0 = randn(b, h, D, D, dtype=torch.float32, scale=0.1)
            cu = cu_seqlens([t] * b, DEV)
            if var == "fla":
                run_fla_prefill(xq, xk, xv, xf, xb, a_log, dt_bias, s0, b, t, h)
            elif var == "prep":
                conv_w = tuple(randn(h * D, 1, 4, scale=0.5) for _ in range(3))
                packed, _ = kda_prep(xq, xk, xv, xf, xb, conv_w, a_log, dt_bias, None, cu, num_heads=h, head_dim=D,
                                     gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, max_len=t,
                                     qkv_dtype=torch.bfloat16)
                for v_ in PREFILL_VARIANTS[:3]:     # the prep+chunk row runs the best of the first shape's plans
                    kda_chunk(*unpack(packed, h, D), cu, s0, out_dtype=torch.bfloat16, max_len=t,
                              **{"dot": "bf16", **v_})
            else:
                kda_chunk(q, k, v, g, beta, cu, s0, out_dtype=torch.bfloat16, max_len=t, **var)
        else:
            xq, xk, xv, xf, xb, xg, a_log, dt_bias, nw, conv_w, tails, state = decode_inputs(b, h)
            common = dict(num_heads=h, head_dim=D, gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, norm_eps=1e-5)
            if var == "fla":
                from fla.ops.kda import fused_recurrent_kda
                fused_recurrent_kda(*(x.view(b, 1, h, D) for x in (xq, xk, xv, xf)), xb.view(b, 1, h), A_log=a_log,
                                    dt_bias=dt_bias, initial_state=state, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, lower_bound=LB)
            elif var == "out":
                from k3c.runtime.kernel_impls.kda import kda_out
                kda_out(xq.float().view(b, h, D), xg, nw, 1e-5)
            elif kind == "decode_rec":
                kda_decode(xq, xk, xv, xf, xb, None, conv_w, a_log, dt_bias, None, tails, state, fuse_out=False,
                           **var, **common)
            else:
                kda_decode(xq, xk, xv, xf, xb, xg, conv_w, a_log, dt_bias, nw, tails, state, **var, **common)
        if DEV != "cpu":
            torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{job}: {type(e).__name__}: {e}"


def precompile(shapes_prefill, shapes_decode, jobs=12):
    import concurrent.futures as cf
    import multiprocessing as mp
    work = []
    for b, h in shapes_decode:          # decode B=16 has the specialisation of 64 / 256 (divisible by 16)
        work += [("decode_rec", 16, h, v) for v in DECODE_REC_VARIANTS]
        work += [("decode_layer", 16, h, v) for v in DECODE_LAYER_VARIANTS]
        work += [("decode_rec", 16, h, "fla"), ("decode_rec", 16, h, "out")]
    for b, h in shapes_prefill:         # same B (N = 1 is specialised), T = 64
        work += [("prefill", b, h, v) for v in PREFILL_VARIANTS] + [("prefill", b, h, "prep"), ("prefill", b, h, "fla")]
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        for err in ex.map(_warm, work):
            if err:
                print(f"precompile: {err}", flush=True)
    print(f"[precompile: {len(work)} jobs in {time.time() - t0:.1f} s]", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="kda-bench.json")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("K3C_BENCH_BUDGET", 230)),
                    help="start no new step after this many seconds (a started step runs to its end)")
    ap.add_argument("--quick", action="store_true", help="only the headline shapes")
    ap.add_argument("--no-precompile", action="store_true")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    pre = [(1, 96)] + ([] if args.quick else [(4, 12)])
    dec = [(64, 96), (256, 12)]
    if not args.no_precompile:
        precompile(pre, dec)
    ranked: list = []
    steps = [("decode 64x96", lambda: decode(64, 96)),
             ("prefill 1x8192x96", lambda: ranked.extend(prefill(1, 8192, 96, PREFILL_VARIANTS))),
             ("decode 256x12", lambda: decode(256, 12))]
    if not args.quick:
        steps += [("prefill 4x8192x12", lambda: prefill(4, 8192, 12, PREFILL_VARIANTS)),
                  ("prefill 1x32768x96", lambda: prefill(1, 32768, 96, (ranked or PREFILL_VARIANTS)[:2]))]
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
        torch.cuda.empty_cache()
        print(f"[{name}: {time.time() - t0:.1f} s, total {elapsed():.0f} s]", flush=True)
        write_json(args.json)          # after every step: a run cut short still leaves its rows
    summary()


def summary():
    print("\nSUMMARY (ms; x = peer / k3c)")
    for r in ROWS:
        ratio = f"{r['peer'] / r['seconds']:.2f}x" if r["peer"] else ""
        print(f"{r['group'][:3]} {r['shape']:18s} {r['name'][:52]:52s} {r['seconds'] * 1e3:8.3f} {ratio:7s} "
              f"{r['note'][:40]}")


def write_json(name):
    out = Path(os.environ.get("OUT", ".")) / name
    out.write_text(json.dumps([{"name": f"{r['group']} {r['shape']} {r['name']}", "flops": r["flops"],
                                "bytes": r["bytes"], "seconds": r["seconds"], "peer_seconds": r["peer"],
                                "note": r["note"]} for r in ROWS], indent=1))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
