"""Routed experts of one K3 LatentMoE layer: k3c's grouped MXFP4 kernels against a bf16 torch baseline, same run.

    python bench/moe.py                            # H200: latent 3584 -> 2 x 3072 -> 3584, E in {128, 896}, top-16,
                                                   # tokens {1, 16, 64, 512, 4096}
    python bench/moe.py --json out.json            # also write every row
    python bench/moe.py --sweep --json out.json    # also time every plan variant of every row (within --budget s)
    python bench/moe.py --decode --json out.json   # decode rows (1, 16, 64 tokens): the plans without the pair
                                                   # decode ("old"), the default ("new") and DECODE_COMPARE
                                                   # variants, bf16, copy
    python bench/moe.py --layout canonical ...     # sm_90: the routed experts in k3c.quant's layout (the pre-hopper
                                                   # forms); default: the device target's (hopper on sm_90, converted
                                                   # in place after the peer copied them; variants: HOPPER_VARIANTS)
    python bench/moe.py --smoke                    # tiny shapes on the CPU (interpreter): checks the code path
    python bench/moe.py --sass                     # no GPU: the decode plans cross-compiled for sm_90, SASS of the
                                                   # K loop counted per weight (nvdisasm from triton's bundle)

Per row, the routing is fixed first (k3c's routing kernels on random router logits) and both sides compute
u = sum_k p_k E_k(z) for the tokens z [T, 3584] with the same weights (random MXFP4 payloads and scales; the
baseline holds them dequantized to bf16):
  k3c   moe_gate_up (gate/up grouped GEMM, SiTU-GLU epilogue) + moe_down + moe_combine on the MXFP4 stacks: the
        upcast path on sm_90 (native tl.dot_scaled on gfx950 / sm_100), all experts in one launch each
  bf16  torch: the active experts' bf16 weights (gathered once, outside the timing), tokens gathered per expert and
        padded to the largest count, torch.bmm (gate+up), SiTU-GLU, torch.bmm (down), weighted index_add
Both are timed as CUDA graph replays (triton.testing.do_bench_cudagraph, median). --sweep: every row also times
the plan variants (DECODE_VARIANTS at <= 16 rows per expert, else PREFILL_VARIANTS: the upcast forms gemv / joined /
dequant and their tiles, and the forms k3c does not ship, bench/moe_forms.py: split / postscale / perm; JSON rows
with "variant" and the plans' tags), within --budget seconds of
variant timing shared by the rows, and prints the best per row; before an E's rows, --jobs worker processes compile
all its rows' kernels into Triton's disk cache, so the main process only loads them.
Weight bandwidth = the active
experts' bytes (k3c: packed payload + E8M0 scales, 4.25 bits per weight; bf16: 16 bits) over the time; copy = a
2 GiB device-to-device copy in the same run, timed without a graph (read + write bytes over its time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import moe_forms as forms  # noqa: E402
import moe_peer  # noqa: E402
from k3c.runtime.expert_layout import from_hopper, from_hopper_scales, to_hopper, to_hopper_scales  # noqa: E402
from k3c.runtime.kernel_impls.moe_layout import to_lanes  # noqa: E402
from k3c.runtime.launcher import ENABLE_FP_FUSION, eval_grid, load_kernel  # noqa: E402
from k3c.runtime.devices import target_for  # noqa: E402
from k3c.frontend.spec import ActivationSpec  # noqa: E402
from k3c.runtime.kernel_impls import moe as M  # noqa: E402
from k3c.reference import glu_act  # noqa: E402

ACT = ActivationSpec("situ", 4.0, 25.0)
ROWS: list[dict] = []


def timed(fn, dev, rep_ms=100):
    if dev.type == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e-3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def random_mxfp4(e, n, k, dev, gen):
    """Random E2M1 payload bytes and E8M0 scales near 2^-6 (|w| up to 6 x 2^-4)."""
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
    scale = torch.randint(118, 124, (e, n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
    return packed, scale


_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequant_rows(packed, scale, rows, out, layout="canonical"):
    """Write bf16 [len(rows), N, K] of the experts `rows` into `out` (the values k3c.quant.mxfp4_dequantize gives);
    layout "hopper": the stacks are in the hopper layout (those experts are read back to the canonical one)."""
    lut = _LUT.to(packed.device)
    for i in range(0, len(rows), 16):
        idx = rows[i:i + 16]
        p, sc = packed[idx], scale[idx]
        if layout == "hopper":
            p, sc = from_hopper(p), from_hopper_scales(sc)
        p = p.long()
        v = torch.stack((lut[p & 15], lut[p >> 4]), dim=-1).flatten(-2)
        out[i:i + len(idx)] = (v * torch.exp2(sc.float() - 127.0).repeat_interleave(32, dim=-1))
    return out


def baseline_fn(z, wt, ids, w13, w2, active):
    """bf16 torch: tokens grouped per active expert, padded, two batched GEMMs."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()
    slot_e = torch.searchsorted(active, flat)                 # index of each slot's expert among the active ones
    order = torch.argsort(slot_e, stable=True)
    counts = torch.bincount(slot_e, minlength=active.numel())
    cap = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(flat.numel(), device=z.device) - starts[slot_e[order]]
    a_idx, m_idx = slot_e[order], pos
    tok = order // k
    wflat = wt.reshape(-1)[order]
    mi = w2.shape[2]

    def run():
        x = torch.zeros(active.numel(), cap, z.shape[1], dtype=z.dtype, device=z.device)
        x[a_idx, m_idx] = z[tok]
        gu = torch.bmm(x, w13.transpose(1, 2))
        h = glu_act(gu[..., :mi], gu[..., mi:], ACT)
        y = torch.bmm(h, w2.transpose(1, 2))[a_idx, m_idx]
        out = torch.zeros(t, z.shape[1], dtype=torch.float32, device=z.device)
        out.index_add_(0, tok, y.float() * wflat[:, None])
        return out.to(z.dtype)
    return run


def copy_bandwidth(dev):
    if dev.type != "cuda":
        return None
    n = 1 << 30
    src = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    import triton.testing

    for _ in range(20):                     # clocks up before the first timing
        dst.copy_(src)
    # not a graph replay: a captured device-to-device copy may run on a copy engine (2.7 TB/s seen on an H200)
    sec = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median") * 1e-3
    return 2 * 2 * n / sec


def k3c_runner(e, args, weights, z, wt, ids, off, perm, mx):
    """k3c_fn(plan_gate_up, plan_down) -> the k3c side of one row (None plans: the runtime's default)."""
    k = args.top_k
    _, (w1p, w1s, w3p, w3s), (w2p, w2s) = weights
    permuted = {}

    def pw(t, plan):    # perm / lanes plans read the payload in their load-time layout (a copy, made once)
        lanes = getattr(plan, "lanes", False)
        if not (lanes or isinstance(plan, forms.FormPlan) and plan.form == "perm"):
            return t
        key = (id(t), lanes)
        if key not in permuted:
            permuted[key] = to_lanes(t) if lanes else forms.pairs_perm_words(t)
        return permuted[key]

    def gemm(kind, a, ws, plan, **kw):
        if isinstance(plan, forms.FormPlan):
            return forms.grouped_gemm(kind, a, ws, off, perm, top_k=k, plan=plan, **kw)
        return M.grouped_gemm(kind, a, ws, off, perm, top_k=k, mx=mx, plan=plan, layout=args.layout, **kw)

    def k3c_fn(pg=None, pd=None):
        def run():
            h = gemm("gate_up", z, [pw(w1p, pg), w1s, pw(w3p, pg), w3s], pg, act=ACT)
            y = gemm("down", h, [pw(w2p, pd), w2s], pd)
            return M.combine(y, wt, ids, top_k=k, num_experts=e)
        return run
    return k3c_fn


def k3c_layer(e, args, weights, lg, z, mx):
    """k3c's whole routed-expert layer with the default plans: routing (4 launches), gate_up (GLU fused), down,
    combine."""
    k = args.top_k
    _, (w1p, w1s, w3p, w3s), (w2p, w2s) = weights

    def run():
        wt, ids, off, perm = M.route(lg, None, top_k=k)
        h = M.grouped_gemm("gate_up", z, [w1p, w1s, w3p, w3s], off, perm, top_k=k, mx=mx, act=ACT,
                           layout=args.layout)
        y = M.grouped_gemm("down", h, [w2p, w2s], off, perm, top_k=k, mx=mx, layout=args.layout)
        return M.combine(y, wt, ids, top_k=k, num_experts=e)
    return run


def bench_case(e, tokens, args, weights, dev, gen, copy_bw, plans=None, deadline=None, peer=None):
    zdim, mi, k = args.latent, args.inter, args.top_k
    lg = torch.randn(tokens, e, device=dev, generator=gen)
    wt, ids, off, perm = M.route(lg, None, top_k=k)
    z = torch.randn(tokens, zdim, device=dev, generator=gen).to(torch.bfloat16)
    tgt = target_for(dev)
    mx = "e4m3" if tgt.native_mxfp4 else "upcast"
    active = torch.unique(ids.reshape(-1).long())
    n_act = active.numel()
    _, (w1p, w1s, w3p, w3s), (w2p, w2s) = weights
    k3c_fn = k3c_runner(e, args, weights, z, wt, ids, off, perm, mx)

    act_cpu = active.cpu()
    w13 = torch.empty(n_act, 2 * mi, zdim, dtype=torch.bfloat16, device=dev)
    dequant_rows(w1p, w1s, act_cpu, w13[:, :mi], args.layout)
    dequant_rows(w3p, w3s, act_cpu, w13[:, mi:], args.layout)
    w2 = dequant_rows(w2p, w2s, act_cpu, torch.empty(n_act, zdim, mi, dtype=torch.bfloat16, device=dev), args.layout)
    base = baseline_fn(z, wt, ids, w13, w2, active)
    got, want = k3c_fn()(), base()
    err = rel(got, want)
    mx_bytes = n_act * 3 * mi * zdim * (0.5 + 1 / 32)
    bf_bytes = n_act * 3 * mi * zdim * 2
    t_base = timed(base, dev)
    t_k3c = timed(k3c_fn(), dev)
    hp = args.layout == "hopper" or None
    dg = M._plan("gate_up", mi, zdim, -(-tokens * k // e), mx, "bf16", tgt, hopper=hp)
    dd = M._plan("down", zdim, mi, -(-tokens * k // e), mx, "bf16", tgt, hopper=hp)
    best = ("default", t_k3c)
    t_var = time.time()
    for name, (pg, pd) in (plans or {}).items():
        if deadline is not None and time.time() > deadline:
            print(f"  sweep budget spent: {name} and later variants not timed", flush=True)
            break
        try:
            fn = k3c_fn(pg, pd)
            verr = rel(fn(), want)
            t = timed(fn, dev, rep_ms=25)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            print(f"  variant {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        ROWS.append({"experts": e, "tokens": tokens, "variant": name, "k3c_s": t, "rel_err_vs_bf16": verr,
                     "plan_gate_up": pg.tag, "plan_down": pd.tag,
                     "k3c_TBps": mx_bytes / t / 1e12, "speedup": t_base / t})
        print(f"  {name:22s} {t * 1e6:9.1f} us {mx_bytes / t / 1e12:5.2f} TB/s x{t_base / t:5.2f} err {verr:.1e}"
              f"  ({pg.tag} / {pd.tag})", flush=True)
        if t < best[1]:
            best = (name, t)
    row = {"experts": e, "tokens": tokens, "top_k": k, "active_experts": n_act, "mx": mx, "k3c_s": t_k3c,
           "bf16_s": t_base, "speedup": t_base / t_k3c, "k3c_weight_bytes": mx_bytes, "bf16_weight_bytes": bf_bytes,
           "k3c_TBps": mx_bytes / t_k3c / 1e12, "bf16_TBps": bf_bytes / t_base / 1e12,
           "copy_TBps": copy_bw / 1e12 if copy_bw else None,
           "k3c_frac_of_copy": mx_bytes / t_k3c / copy_bw if copy_bw else None, "rel_err_vs_bf16": err,
           "best_variant": best[0], "best_variant_s": best[1], "default_plan_gate_up": dg.tag,
           "default_plan_down": dd.tag, "variants_s": time.time() - t_var}
    ROWS.append(row)
    t_route = timed(lambda: M.route(lg, None, top_k=k), dev, rep_ms=25)
    row["route_s"] = t_route
    row["k3c_layer_s"] = timed(k3c_layer(e, args, weights, lg, z, mx), dev, rep_ms=50)
    peer_txt = ""
    if peer is not None:
        try:
            t_peer = peer.timed(lg, z, k, lambda f: timed(f, dev))
            row.update(peer_s=t_peer, peer_over_k3c=t_peer / t_k3c, peer_over_best=t_peer / best[1])
            peer_txt = f" | matmul_ogs {t_peer * 1e6:9.1f} us: peer/k3c {t_peer / t_k3c:4.2f} (best {t_peer / best[1]:4.2f})"
            t_pl = peer.timed_layer(lg, z, k, lambda f: timed(f, dev, rep_ms=50))
            row.update(peer_layer_s=t_pl, peer_layer_over_k3c_layer=t_pl / row["k3c_layer_s"])
            peer_txt += (f" | layer (routing + GEMMs + act/combine) k3c {row['k3c_layer_s'] * 1e6:.1f} us, peer "
                         f"{t_pl * 1e6:.1f} us: {t_pl / row['k3c_layer_s']:4.2f}")
        except Exception as exc:  # noqa: BLE001 - the peer failing is reported, k3c's row stands
            peer_txt = f" | matmul_ogs failed: {type(exc).__name__}: {str(exc)[:160]}"
    frac = f"{row['k3c_frac_of_copy'] * 100:5.1f}%" if copy_bw else "   - "
    print(f"E={e:4d} T={tokens:5d} act={n_act:4d} | k3c {t_k3c * 1e6:9.1f} us {row['k3c_TBps']:5.2f} TB/s {frac} | "
          f"bf16 {t_base * 1e6:9.1f} us {row['bf16_TBps']:5.2f} TB/s | x{row['speedup']:5.2f} | route "
          f"{t_route * 1e6:6.1f} us | err {err:.1e} | default {dg.tag} / {dd.tag} | best {best[0]} "
          f"{best[1] * 1e6:.1f} us" + peer_txt, flush=True)
    del w13, w2
    return row


# Plan variants per row: (name, overrides for gate_up (BLOCK_N per weight), for down): moe_gemm_plan's, or with
# "form" one of bench/moe_forms.py's FORMS. "G" stands for the GEMV row group of the row (min(4, rows per expert
# rounded up)); "rows" plans for that many rows per expert instead of the row's (BLOCK_M). Decode rows (<= 64
# tokens) and prefill rows.
# the lanes form (weights as wgmma's register A operand, payload in the lanes layout): decode and prefill tiles
LANES_DECODE = (
    ("lanes", dict(lanes=True), dict(lanes=True)),
    ("lanes_s3", dict(lanes=True, num_stages=3), dict(lanes=True, num_stages=3)),
    ("lanes_s4", dict(lanes=True, num_stages=4), dict(lanes=True, num_stages=4)),
    ("lanes_k128s2", dict(lanes=True, block_k=128), dict(lanes=True, block_k=128)),
    ("lanes_n128w4k128", dict(lanes=True, block_n=128, block_k=128, num_warps=4),
     dict(lanes=True, block_n=128, block_k=128, num_warps=4)),
    ("lanes_n128w8k128", dict(lanes=True, block_n=128, block_k=128), dict(lanes=True, block_n=128, block_k=128)),
    ("lanes_n256w8k128", dict(lanes=True, block_n=256, block_k=128, num_warps=8),     # the peer's Hopper tiles
     dict(lanes=True, block_n=256, block_k=128, num_warps=8)),
    ("lanes_n256w8k128s4", dict(lanes=True, block_n=256, block_k=128, num_warps=8, num_stages=4),
     dict(lanes=True, block_n=256, block_k=128, num_warps=8, num_stages=4)),
)
LANES_PREFILL = (
    ("lanes", dict(lanes=True), dict(lanes=True)),
    ("lanes_n256", dict(lanes=True, block_n=256, num_warps=8), dict(lanes=True, block_n=256, num_warps=8)),
    ("lanes_k256", dict(lanes=True, block_k=256), dict(lanes=True, block_k=256)),
    ("lanes_m64", dict(lanes=True, rows=64), dict(lanes=True, rows=64)),
    ("lanes_m64n256", dict(lanes=True, rows=64, block_n=256, num_warps=8),
     dict(lanes=True, rows=64, block_n=256, num_warps=8)),
    ("lanes_m64n256s4", dict(lanes=True, rows=64, block_n=256, num_warps=8, num_stages=4),
     dict(lanes=True, rows=64, block_n=256, num_warps=8, num_stages=4)),
    ("lanes_m32", dict(lanes=True, rows=32, block_n=256, block_k=128, num_warps=8),
     dict(lanes=True, rows=32, block_n=256, block_k=128, num_warps=8)),
)
# the hopper form's tiles (weights in the hopper layout: no other form reads them), any row count
HOPPER_VARIANTS = (
    ("hopper_w8", dict(hopper=True, num_warps=8), dict(hopper=True, num_warps=8)),
    ("hopper_n256", dict(hopper=True, block_n=256), dict(hopper=True, block_n=256)),
    ("hopper_s3", dict(hopper=True, num_stages=3), dict(hopper=True, num_stages=3)),
    ("hopper_gm64", dict(hopper=True, rows=64), dict(hopper=True)),
    ("hopper_m64", dict(hopper=True, rows=64), dict(hopper=True, rows=64)),
)
DECODE_VARIANTS = (
    ("gemv", dict(gemv="G"), dict(gemv="G")),
    ("gemv_bk512", dict(gemv="G", block_k=512), dict(gemv="G", block_k=512)),
    ("gemv_bn32", dict(gemv="G", block_n=32), dict(gemv="G", block_n=64)),
    ("gemv_bn8_w2", dict(gemv="G", block_n=8, num_warps=2), dict(gemv="G", block_n=16, num_warps=2)),
    ("gemv1", dict(gemv=1), dict(gemv=1)),
    ("joined", dict(gemv=0), dict(gemv=0)),
    ("joined_bk512_s2", dict(gemv=0, block_k=512, num_stages=2), dict(gemv=0, block_k=512, num_stages=2)),
    ("joined_bn16", dict(gemv=0, block_n=16), dict(gemv=0, block_n=32)),
    ("split", dict(form="split"), dict(form="split")),
    ("postscale", dict(form="postscale"), dict(form="postscale")),
) + LANES_DECODE
# --decode: the plans without the pair decode ("old": moe_gemm_plan(pairs=False), i.e. gemv at 1 row per expert and
# the fp16-decode joined tile above) against the default (pair decode, one multiply; the row's main timing) and
# alternatives of it; "old" first so that the budget never drops it
DECODE_COMPARE = (
    ("old", dict(pairs=False), dict(pairs=False)),
    ("pairs1_n64", dict(pairs=True, block_n=64), dict(pairs=True, block_n=128)),       # the default's tiles
    # the load-time perm bit layout (11 integer ops per 8 weights instead of 17), default tiles and n32 tiles
    ("pairs1_perm", dict(form="perm", pairs=True), dict(form="perm", pairs=True)),
    ("pairs1_perm_n32", dict(form="perm", pairs=True, block_n=32), dict(form="perm", pairs=True, block_n=64)),
    ("pairs_exact", dict(pairs=True, one_mul=False), dict(pairs=True, one_mul=False)),
    ("pairs1_w1k64", dict(pairs=True, num_warps=1, block_k=64, num_stages=4),
     dict(pairs=True, num_warps=1, block_k=64, num_stages=4)),
    ("pairs1_w2n64k64", dict(pairs=True, num_warps=2, block_n=64, block_k=64, num_stages=4),
     dict(pairs=True, num_warps=2, block_n=128, block_k=64, num_stages=4)),
    ("pairs1_n32", dict(pairs=True, block_n=32), dict(pairs=True, block_n=64)),
    ("pairs1_n128", dict(pairs=True, block_n=128), dict(pairs=True, block_n=256)),
    ("pairs1_n64k512", dict(pairs=True, block_k=512, num_stages=2), dict(pairs=True, block_k=512, num_stages=2)),
    ("pairs1_w8", dict(pairs=True, num_warps=8), dict(pairs=True, num_warps=8)),
    ("pairs1_s4", dict(pairs=True, num_stages=4), dict(pairs=True, num_stages=4)),
) + LANES_DECODE
PREFILL_VARIANTS = LANES_PREFILL + (
    ("dequant", dict(dequant=True), dict(dequant=True)),
    ("dequant_s4", dict(dequant=True, num_stages=4), dict(dequant=True, num_stages=4)),
    ("dequant_bn128", dict(dequant=True, block_n=128), dict(dequant=True, block_n=256)),
    ("joined", dict(dequant=False), dict(dequant=False)),
    ("joined_bk128", dict(dequant=False, block_k=128), dict(dequant=False, block_k=128)),
    ("joined_bn128", dict(dequant=False, block_n=128), dict(dequant=False, block_n=256)),
    ("joined_m64", dict(dequant=False, rows=64), dict(dequant=False, rows=64)),
)


def variants(args, dev, rows, specs):
    """Plan variants of the grouped kernels at `rows` per expert, for --sweep (duplicates of another dropped)."""
    tgt = target_for(dev)
    mx = "e4m3" if tgt.native_mxfp4 else "upcast"
    group = min(4, 1 << max(0, rows - 1).bit_length())
    out, seen = {}, set()
    for name, kg, kd in specs:
        if mx != "upcast" and any(x in kg for x in ("gemv", "dequant", "pairs", "form", "lanes", "hopper")):
            continue
        if (args.layout == "hopper") != bool(kg.get("hopper")):      # a variant must read the weights' layout
            continue
        kg, kd = ({k: group if v == "G" else v for k, v in kw.items()} for kw in (kg, kd))
        try:
            pg = forms.bench_plan("gate_up", args.inter, args.latent, kg.pop("rows", rows), mx, "bf16", tgt, **kg)
            pd = forms.bench_plan("down", args.latent, args.inter, kd.pop("rows", rows), mx, "bf16", tgt, **kd)
        except Exception:  # noqa: BLE001
            continue
        if (pg, pd) not in seen:
            seen.add((pg, pd))
            out[name] = (pg, pd)
    return out


# -- parallel precompile: worker processes fill Triton's disk cache with a row's variant kernels ------------------
def _warm(ks, specs):
    """Worker: compile `ks` for the args described by `specs` (("t", dtype) for a tensor, an int as is)."""
    args = [torch.empty(64, dtype=getattr(torch, v[1]), device="cuda") if isinstance(v, tuple) else v for v in specs]
    env = {k: v for k, v in ks.constexprs.items() if isinstance(v, int) and not isinstance(v, bool)}
    env.update({n: v for n, v in zip(ks.signature, specs) if not isinstance(v, tuple)})
    grid = eval_grid(ks.grid, env)
    load_kernel(ks, False).warmup(*args, grid=grid, **dict(ks.constexprs, num_warps=ks.num_warps,
                                                           num_stages=ks.num_stages, enable_fp_fusion=ENABLE_FP_FUSION))
    return ks.name


def precompile_rows(pool, e, args, weights, dev, row_plans, wait_s):
    """Compile every row's default and variant kernels of `e` experts in `pool` before the rows run."""
    mx = "e4m3" if target_for(dev).native_mxfp4 else "upcast"
    gen = torch.Generator(device=dev).manual_seed(1)
    fns = []
    for t, plans in row_plans.items():
        wt, ids, off, perm = M.route(torch.randn(t, e, device=dev, generator=gen), None, top_k=args.top_k)
        z = torch.zeros(t, args.latent, dtype=torch.bfloat16, device=dev)
        mk = k3c_runner(e, args, weights, z, wt, ids, off, perm, mx)
        fns += [mk()] + [mk(pg, pd) for pg, pd in (plans or {}).values()]
    try:
        precompile(pool, fns, time.time() + wait_s)
    except Exception as exc:  # noqa: BLE001 - only a speed-up: the kernels then compile in line
        print(f"  precompile failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def precompile(pool, fns, deadline):
    """Record the launches of `fns` without running them, compile their kernels in `pool`, wait (to the deadline)."""
    seen, launches = set(), []

    def record(ks, *args, binding=None):
        if ks.digest not in seen:
            seen.add(ks.digest)
            launches.append((ks, [("t", str(a.dtype).split(".")[-1]) if isinstance(a, torch.Tensor) else int(a)
                                  for a in args]))
    real = M.launch, forms.launch
    M.launch = forms.launch = record
    try:
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the timing loop reports it
                pass
    finally:
        M.launch, forms.launch = real
    t0 = time.time()
    futs = [pool.submit(_warm, ks, specs) for ks, specs in launches]
    from concurrent.futures import wait

    done, _ = wait(futs, timeout=max(1.0, (deadline or t0 + 120) - t0))
    bad = sum(1 for f in done if f.exception() is not None)
    print(f"  precompiled {len(done) - bad}/{len(futs)} kernels in {time.time() - t0:.1f} s", flush=True)


def decode_table(copy_bw):
    """The --decode summary: per row bf16, the plans without the pair decode ("old"), the default and the best
    variant."""
    var = {(r["experts"], r["tokens"], r["variant"]): r["k3c_s"] for r in ROWS if "variant" in r}
    print("\n| E | tokens | active | bf16 us | old us | new us | new TB/s | % copy | new x bf16 | new x old | "
          "new err | best variant (us) |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        if "variant" in r:
            continue
        e, t = r["experts"], r["tokens"]
        old = var.get((e, t, "old"))
        frac = f"{r['k3c_frac_of_copy'] * 100:.0f}" if r.get("k3c_frac_of_copy") else "-"
        print(f"| {e} | {t} | {r['active_experts']} | {r['bf16_s'] * 1e6:.1f} | "
              + (f"{old * 1e6:.1f}" if old else "-") + f" | {r['k3c_s'] * 1e6:.1f} | {r['k3c_TBps']:.2f} | {frac} | "
              f"{r['speedup']:.2f} | " + (f"{old / r['k3c_s']:.2f}" if old else "-")
              + f" | {r['rel_err_vs_bf16']:.1e} | {r['best_variant']} ({r['best_variant_s'] * 1e6:.1f}) |")
    if copy_bw:
        print(f"copy {copy_bw / 1e12:.2f} TB/s (read + write); TB/s = packed weight + scale bytes of the active "
              "experts")


def peer_table():
    """k3c's default against matmul_ogs per row (GEMMs: k3c gate_up + down + combine, the peer's gate/up + down; and
    the whole layer: routing + GEMMs + activation / combine on both sides)."""
    rows = [r for r in ROWS if "variant" not in r and "peer_s" in r]
    if not rows:
        return
    print("\n| E | tokens | k3c default us (plans) | matmul_ogs us | peer / k3c | best k3c us (variant) | peer / best | "
          "k3c layer us | peer layer us | peer / k3c (layer) |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['experts']} | {r['tokens']} | {r['k3c_s'] * 1e6:.1f} ({r['default_plan_gate_up']} / "
              f"{r['default_plan_down']}) | {r['peer_s'] * 1e6:.1f} | {r['peer_over_k3c']:.2f} | "
              f"{r['best_variant_s'] * 1e6:.1f} ({r['best_variant']}) | {r['peer_over_best']:.2f} | "
              + (f"{r['k3c_layer_s'] * 1e6:.1f} | {r['peer_layer_s'] * 1e6:.1f} | "
                 f"{r['peer_layer_over_k3c_layer']:.2f} |" if "peer_layer_s" in r else "- | - | - |"))


# --sass: (name, rows per expert, gate_up overrides, down overrides) cross-compiled for the h200 target
SASS_PLANS = (
    ("old gemv1 (1 row)", 1, dict(pairs=False), dict(pairs=False)),
    ("old joined (2-16 rows)", 2, dict(pairs=False), dict(pairs=False)),
) + tuple((f"new {name}", 1, kg, kd) for name, kg, kd in DECODE_COMPARE[1:]) + (("new default", 1, {}, {}),) + tuple(
    (f"prefill {name}", 128, kg, kd) for name, kg, kd in LANES_PREFILL if "rows" not in kg) + tuple(
    (f"hopper ({rows} rows)", rows, dict(hopper=True), dict(hopper=True)) for rows in (1, 32, 64, 128))


def _sass_loop(sass: str) -> list[str]:
    """The instructions of the innermost K loop: the shortest backward-branch body holding the MMAs / FMAs, else
    the longest one (nvdisasm -c text)."""
    import re

    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    labels, pending = {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if m:
            labels.update({lab: int(m.group(1), 16) for lab in pending})
            pending = []
    loops = []
    for addr, text in ins:
        lab = re.search(r"BRA.*?(\.L_x_\d+)", text)
        if lab and labels.get(lab.group(1), addr + 1) < addr:
            loops.append([t for a, t in ins if labels[lab.group(1)] <= a <= addr])
    inner = [b for b in loops if any("MMA" in t or "FFMA" in t for t in b)]
    return min(inner, key=len) if inner else max(loops, key=len, default=[])


def sass_report(args):
    """Compile SASS_PLANS for sm_90 at the bench shapes and print the K loop's SASS per weight (no GPU needed)."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton

    from k3c.codegen.aot import compile_kernels, shutdown_workers
    from k3c.codegen.targets import get_target

    tgt = get_target("h200")
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    ks, meta = [], []
    for name, rows, kg, kd in SASS_PLANS:
        for kind, n, k, kw in (("gate_up", args.inter, args.latent, kg), ("down", args.latent, args.inter, kd)):
            plan = forms.bench_plan(kind, n, k, rows, "upcast", "bf16", tgt, **kw)
            ks.append(forms.emit_bench_gemm(kind, n, k, target=tgt, plan=plan, num_experts=args.experts[0],
                                            top_k=args.top_k, mx="upcast", act=ACT if kind == "gate_up" else None,
                                            interpret=False, name=f"sass{len(ks)}_{kind}"))
            meta.append((name, kind, plan))
    out = tempfile.mkdtemp(prefix="moe-sass-")
    cks = compile_kernels(ks, tgt, out, progress=False)
    shutdown_workers()
    print("| plan | kernel | tag | regs | warps/SM | spills | K-loop SASS / weight | ALU (LOP3, PRMT, SHF, IADD3) "
          "/ weight | moves / weight | MMA |\n|---|---|---|---|---|---|---|---|---|---|")
    for ck, (name, kind, plan) in zip(cks, meta):
        text = subprocess.run([nvdisasm, "-c", os.path.join(out, ck.files["cubin"])], check=True,
                              capture_output=True, text=True).stdout
        loop = _sass_loop(text)
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in loop)
        tiles = plan.plan if isinstance(plan, forms.FormPlan) else plan
        per = (2 if kind == "gate_up" else 1) * tiles.block_n * tiles.block_k // (32 * tiles.num_warps)  # per thread
        alu = sum(v for op, v in ops.items() if op.split(".")[0] in ("LOP3", "PRMT", "SHF", "IADD3", "LEA"))
        mov = sum(v for op, v in ops.items() if op.split(".")[0] in ("MOV", "IMAD") and
                  (op == "MOV" or op.startswith("IMAD.MOV")))
        mma = sum(v for op, v in ops.items() if "MMA" in op)
        r = ck.resources
        print(f"| {name} | {kind} | {plan.tag} | {r.regs} | {r.occupancy} ({r.occupancy_limiter}) | "
              f"{'yes' if r.has_spills else 'no'} | {len(loop) / per:.2f} | {alu / per:.2f} | {mov / per:.2f} | "
              f"{mma} |")
    print(f"(per weight = per thread and K-loop iteration over the weights it decodes; {tgt.name} sm_90, triton "
          f"{triton.__version__})")


def write_json(args, dev, copy_bw):
    if args.json:
        import triton

        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                       "torch": torch.__version__, "triton": triton.__version__,
                       "copy_TBps": copy_bw / 1e12 if copy_bw else None, "rows": ROWS}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, nargs="+", default=[128, 896])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--sweep", action="store_true", help="time the plan variants of every row too")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of variant timing for the whole run (shared "
                    "by the rows; compile waits, baselines and defaults come on top)")
    ap.add_argument("--jobs", type=int, default=16, help="precompile processes for --sweep (0: compile in line)")
    ap.add_argument("--compile-wait", type=float, default=40.0, help="most seconds to wait for a precompile batch")
    ap.add_argument("--decode", action="store_true", help="decode rows (1, 16, 64 tokens unless --tokens): the "
                    "plans without the pair decode (old), the default (new) and DECODE_COMPARE variants, a summary "
                    "table at the end")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--sass", action="store_true", help="no GPU: SASS instruction counts of the decode plans")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-peer", action="store_true", help="do not run triton_kernels' matmul_ogs (bench/moe_peer.py)")
    ap.add_argument("--layout", choices=("auto", "canonical", "hopper"), default="auto",
                    help="the routed experts' layout: auto = the device target's (hopper on sm_90, as weight "
                    "preparation chooses), canonical = k3c.quant's (the pre-hopper forms and their variants)")
    args = ap.parse_args()
    if args.sass:
        return sass_report(args)
    if args.decode:
        args.sweep = True
        if args.tokens == ap.get_default("tokens"):
            args.tokens = [1, 16, 64]
    if args.smoke:
        from k3c.codegen.triton_mode import prepare_interpreter

        prepare_interpreter()
        args.experts, args.tokens, args.top_k, args.latent, args.inter = [8], [1, 5], 2, 64, 64
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.layout == "auto":
        from k3c.runtime.weight_prep import expert_layout

        args.layout = expert_layout(target_for(dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    t_start = time.time()
    budget_left = args.budget if args.sweep else None       # seconds of variant timing left, shared by the rows
    rows_left = len(args.experts) * len(args.tokens)
    pool = None
    if args.sweep and args.jobs > 0 and dev.type == "cuda":
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn"))
    peer_mods = None
    if dev.type == "cuda" and not args.no_peer:
        peer_mods, why = moe_peer.load()
        print("peer: triton_kernels matmul_ogs in this process" if peer_mods else f"peer: not run ({why})",
              flush=True)
    copy_bw = copy_bandwidth(dev)
    if copy_bw:
        copy_bw = max(copy_bw, copy_bandwidth(dev))
        print(f"device {torch.cuda.get_device_name()}  copy {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    with torch.no_grad():
        for e in args.experts:
            w1p, w1s = random_mxfp4(e, args.inter, args.latent, dev, gen)
            w3p, w3s = random_mxfp4(e, args.inter, args.latent, dev, gen)
            w2p, w2s = random_mxfp4(e, args.latent, args.inter, dev, gen)
            weights = ((None, None), (w1p, w1s, w3p, w3s), (w2p, w2s))
            rows_of = {t: -(-t * args.top_k // e) for t in args.tokens}
            row_plans = {t: variants(args, dev, r, HOPPER_VARIANTS if args.layout == "hopper" else DECODE_COMPARE
                                     if args.decode else DECODE_VARIANTS if r <= 16 else PREFILL_VARIANTS)
                         if args.sweep else None for t, r in rows_of.items()}
            if pool is not None:
                precompile_rows(pool, e, args, weights, dev, row_plans, args.compile_wait)
            peer = None
            if peer_mods is not None:
                try:
                    peer = moe_peer.PeerExperts(peer_mods, w1p, w1s, w3p, w3s, w2p, w2s)
                except Exception as exc:  # noqa: BLE001 - reported; the rows run without the peer
                    print(f"peer weights for E={e} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            if args.layout == "hopper":     # as weight preparation does for sm_90 targets: in place, once
                t0 = time.time()
                for t in (w1p, w3p, w2p):
                    to_hopper(t, in_place=True)
                for t in (w1s, w3s, w2s):
                    to_hopper_scales(t, in_place=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                print(f"  E={e}: expert stacks to the hopper layout in {time.time() - t0:.1f} s", flush=True)
            for t in args.tokens:
                row_deadline = time.time() + max(0.0, budget_left) / rows_left if budget_left is not None else None
                rows_left -= 1
                try:
                    row = bench_case(e, t, args, weights, dev, gen, copy_bw, row_plans[t], row_deadline, peer)
                    if budget_left is not None:
                        budget_left -= row["variants_s"]
                except Exception:  # noqa: BLE001 - report the row and go on with the others
                    import traceback

                    traceback.print_exc()
                write_json(args, dev, copy_bw)
            del w1p, w1s, w3p, w3s, w2p, w2s, weights, peer
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if pool is not None:
        pool.shutdown(cancel_futures=True)
    if args.decode:
        decode_table(copy_bw)
    peer_table()
    print(f"total {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
