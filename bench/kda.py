"""KDA benchmark: k3c's generated KDA kernels against the peers, all timed in one process (so every ratio comes from
one run on one GPU).

    python bench/kda.py [--json NAME] [--budget SECONDS] [--quick] [--variants JSON] [--flashkda-so PATH]
    K3C_BENCH_DEVICE=cpu TRITON_INTERPRET=1 python bench/kda.py --quick --tiny     # dry run on the CPU

Peers. Prefill: FlashKDA (the CUTLASS kernel vLLM ships for Kimi K3's KDA prefill, loaded from the prebuilt
_flashkda_C.abi3.so that ../shared/peers/fetch_peers.sh extracts into .peers/carry/so/) and fla 0.6.0's chunk_kda
(Triton). Decode: fla's fused_recurrent_kda and its layer path, and a torch copy of the state. On the GPU box:
    pip install --no-index --no-deps --target /tmp/site .peers/carry/*.whl && export PYTHONPATH=/tmp/site

Prefill (D = 128, safe gate lb = -5): B=1 T=8192 H=96 (the headline), B=1 T=32768 H=96, B=4 T=8192 H=12,
B=1 T=8192 H=64, a varlen batch of 8 sequences (512 .. 4096) and FlashKDA's own varlen case, both H=96. Each shape
has ONE set of raw inputs in FlashKDA's convention (bf16 q/k/v/gate/beta projections [1, T, H, D], A_log, dt_bias,
initial states [N, H, V, K]): FlashKDA and fla fuse the q/k L2 norm, beta sigmoid and the safe gate
lb * sigmoid(e^A_log (g + dt_bias)) in kernel; k3c's chunk kernels take those prepared (derive_k3c: q, k L2-normed
bf16, v bf16, g fp32, beta bf16, the state transposed to [N, H, K, V]). Every k3c plan variant is checked against
each peer's o and final state (relative error in the row; WRONG above 2e-2 against the first of FlashKDA, fla, a
torch reference that ran) and timed with triton.testing.do_bench (median; the same for all three); the peers and
k3c's best plan also get a CUDA-graph replay time. "x FlashKDA" / "x fla" = peer time / k3c time.
FLOPs: K3.md's per-chunk formula 12 C^3 + 8 C^2 D + 6 C D^2 with C = 64, per head and chunk, chunks counted per
sequence (the same count for every side). Bytes: `io` = what any implementation must move (the peer script's count:
q, k, v, gate, o in bf16, beta, the fp32 states in and out); `k3c` = what k3c's two kernels move (k3c_bytes).
Decode: B=64 H=96 and B=256 H=12; state TB/s = 8 D^2 bytes per head and token against the measured copy bandwidth.
Prep (the headline shape): the prep kernel (conv, norms, gate) at 16 / 32 / 64 tokens a program against a device copy
of the same bytes, each checked against the torch reference. --hopper-bin DIR adds the hopper-tier decode variants
and prep (Gluon; binaries built here by `python tests/kda/test_kda_decode_hopper_gpu.py build DIR`).

Steps run headline first, each one writes the JSON ($OUT/NAME) so a run cut short keeps its rows; no step starts
after --budget seconds. Kernels are compiled first in parallel worker processes (Triton's disk cache is then hit).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# fla caches autotune results on disk, keyed without T: the precompile workers (T = 64) would otherwise pick fla's
# configs for every shape (fla's prefill then runs about 1.4x slower than in a clean run)
os.environ.setdefault("FLA_CACHE_RESULTS", "0")
# keep fla on its own Triton path (it could otherwise hand chunk_kda to FlashKDA, which is timed on its own)
os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402

from k3c.codegen.kernels.kda import inter_dtype, kda_plan  # noqa: E402
from k3c.reference import kda_chunked, kda_recurrent  # noqa: E402
from k3c.reference.kda import kda_gate, short_conv  # noqa: E402
from k3c.reference.norms import l2_norm  # noqa: E402
from k3c.frontend.spec import KDASpec  # noqa: E402
from k3c.runtime.devices import target_for  # noqa: E402
from k3c.runtime.kernel_impls.kda import (cu_seqlens, kda_chunk, kda_chunk_launches, kda_decode, kda_out,  # noqa: E402
                                          kda_prep, unpack)

T_START = time.time()
DEV = os.environ.get("K3C_BENCH_DEVICE", "cuda")       # "cpu": a dry run of the script through the interpreter
D = 128
LB = -5.0
SCALE = D ** -0.5
FLOP_CHUNK = 64                                        # K3.md's C in the FLOP count (whatever chunk a kernel uses)
WRONG_BOUND = 2e-2
ROWS: list[dict] = []
SUMMARY: list[dict] = []

# ---- what runs (data) -------------------------------------------------------------------------------------------
# prefill shapes: (sequence lengths, heads, the --tiny stand-in's lengths); the first is the headline shape. The
# tiny varlen cases keep N > 1 and the longest length's divisibility by 16, with fewer sequences (the interpreter's
# time grows with the programs)
PREFILL_SHAPES = [
    ((8192,), 96, (130,)),
    ((32768,), 96, (128,)),
    ((8192,) * 4, 12, (64,) * 4),
    ((8192,), 64, (96,)),
    ((512, 4096, 1024, 3072, 2048, 768, 1536, 3584), 96, (20, 112, 64, 48)),
    ((1300, 547, 2048, 963, 271, 3063), 96, (130, 55, 27)),    # FlashKDA's own varlen case
]
QUICK_PREFILL = (0, 5)              # --quick: the headline and FlashKDA's varlen case
TINY_H = 2
# k3c chunk-kernel plans (kda_chunk keywords); {} = the target's default plan. The first shape runs them all, the
# others the best LATER_BEST of the first shape plus {}
PREFILL_VARIANTS = [{}, dict(block_v=32), dict(intra_warps=4), dict(block_v=64, chunk_warps=8),
                    dict(block_v=128, chunk_warps=8), dict(chunk=32, block_v=64, intra_warps=4),
                    dict(chunk=32, block_v=64, chunk_warps=8, intra_warps=8), dict(chunk=32, block_v=128, chunk_warps=8)]
LATER_BEST = 3
PLAN_KEYS = {"chunk", "block_v", "chunk_warps", "intra_warps", "dot"}
# decode shapes: (batch, heads, the --tiny stand-in's batch); heads become TINY_H under --tiny
DECODE_SHAPES = [(64, 96, 4), (256, 12, 8)]
DECODE_REC_VARIANTS = [dict(decode_split=True, decode_block_v=16, decode_warps=2),
                       dict(decode_split=True, decode_block_v=32, decode_warps=4),
                       dict(decode_split=True, decode_block_v=64, decode_warps=4),
                       dict(decode_block_v=32, decode_warps=4), dict(decode_block_v=32, decode_warps=8),
                       # fewer threads per head: more heads resident (sm_90: 195 / 251 registers, no spills)
                       dict(decode_block_v=16, decode_warps=2), dict(decode_block_v=32, decode_warps=2),
                       dict(decode_block_v=64, decode_warps=4)]
DECODE_LAYER_VARIANTS = [dict(decode_block_v=32, decode_warps=4), dict(decode_block_v=32, decode_warps=8),
                         dict(decode_block_v=16, decode_warps=4), dict(decode_block_v=64, decode_warps=8)]
FLASHKDA_SO = "_flashkda_C.abi3.so"
FLASHKDA_DIRS = (ROOT / ".peers" / "carry" / "so", ROOT.parent / "shared" / "peers" / "carry" / "so")


# ---- counting (pure) --------------------------------------------------------------------------------------------
def n_chunks(seqs, chunk: int) -> int:
    """Chunks of `chunk` tokens over all sequences: each sequence's last chunk may be short."""
    return sum(math.ceil(n / chunk) for n in seqs)


def prefill_flops(seqs, h: int, d: int = D, c: int = FLOP_CHUNK) -> int:
    """K3.md: 12 C^3 + 8 C^2 D + 6 C D^2 per chunk and head."""
    return h * n_chunks(seqs, c) * (12 * c ** 3 + 8 * c * c * d + 6 * c * d * d)


def io_bytes(seqs, h: int, d: int = D) -> int:
    """The peer script's count: q, k, v, gate in and o out in bf16, bf16 beta, fp32 states in and out."""
    t, n = sum(seqs), len(seqs)
    return 5 * t * h * d * 2 + t * h * 2 + 2 * n * h * d * d * 4


def intra_bytes(seqs, h: int, d: int, chunk: int, elt: int) -> int:
    """k3c's intra-chunk kernel (the buffers of kda_chunk_launches): reads q, k (bf16), g (fp32), beta (bf16); writes
    K e^Gamma, Q e^Gamma, K e^(Gamma_C - Gamma) [T, H, D] and A_qk, T diag(beta) [T, H, chunk] at `elt` bytes each,
    and e^Gamma_C (fp32, one row of D per chunk and head)."""
    t = sum(seqs)
    read = 2 * t * h * d * 2 + t * h * d * 4 + t * h * 2
    write = 3 * t * h * d * elt + 2 * t * h * chunk * elt + n_chunks(seqs, chunk) * h * d * 4
    return read + write


def inter_bytes(seqs, h: int, d: int, chunk: int, elt: int) -> int:
    """k3c's state-passing kernel: reads the intra kernel's outputs, v (bf16) and the initial states; writes o (bf16)
    and the final states. Each tensor counted once: the programs of the other V blocks re-read the [T, H, D] and
    [T, H, chunk] intermediates, mostly from L2, which this does not count."""
    t, n = sum(seqs), len(seqs)
    read = (3 * t * h * d * elt + 2 * t * h * chunk * elt + n_chunks(seqs, chunk) * h * d * 4 + t * h * d * 2
            + n * h * d * d * 4)
    write = t * h * d * 2 + n * h * d * d * 4
    return read + write


def k3c_bytes(seqs, h: int, d: int, chunk: int, elt: int) -> int:
    return intra_bytes(seqs, h, d, chunk, elt) + inter_bytes(seqs, h, d, chunk, elt)


def prep_bytes(seqs, h: int, d: int = D) -> int:
    """k3c's prep kernel: reads the q, k, v, gate projections and beta (bf16); writes q, k, v (bf16) and g|beta
    (fp32)."""
    t = sum(seqs)
    return 4 * t * h * d * 2 + t * h * 2 + 3 * t * h * d * 2 + t * (h * d + h) * 4


def warm_seqs(seqs) -> tuple:
    """Short lengths whose compiled kernels are the ones `seqs` uses: Triton specialises integer arguments on == 1
    and on divisibility by 16, so keep N (the sequence count) and the longest length's divisibility; H is part of
    the emitted source and stays as it is."""
    last = 64 if max(seqs) % 16 == 0 else 65
    return (64,) * (len(seqs) - 1) + (last,)


def shape_label(seqs, h: int) -> str:
    if len(set(seqs)) == 1:
        return f"B={len(seqs)} T={seqs[0]} H={h}"
    return f"varlen N={len(seqs)} T={sum(seqs)} H={h}"


def plan_of(var: dict):
    """The k3c plan a variant resolves to on this device (its chunk and intermediate dtype set k3c's bytes)."""
    pl = kda_plan(D, "bf16", target_for(DEV), **var)
    return pl.chunk, 2 if inter_dtype(pl.dot) == "bf16" else 4


def tag(var):
    return ",".join(f"{k_.replace('decode_', '').replace('chunk_', '')}={v_}" for k_, v_ in var.items()) or "default"


# ---- inputs -----------------------------------------------------------------------------------------------------
@dataclass
class Raw:
    """One shape's inputs in FlashKDA's convention: projections [1, T, H, D] bf16 (beta [1, T, H]), A_log [H],
    dt_bias [H, D], initial states h0 [N, H, V, K] fp32, cu int64 [N + 1]."""
    seqs: tuple
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    h0: torch.Tensor
    cu: torch.Tensor


def make_raw(seqs, h: int, device, seed: int = 0) -> Raw:
    """The peer script's distributions (bench_flashkda.make_inputs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t = sum(seqs)

    def r(*shape):
        return torch.randn(*shape, device=device, generator=gen)
    q, k, v, g = (r(1, t, h, D).bfloat16() for _ in range(4))
    beta = r(1, t, h).bfloat16()
    a_log, dt_bias = r(h) * 0.5, r(h, D) * 0.5
    h0 = r(len(seqs), h, D, D) * 0.1
    return Raw(tuple(seqs), q, k, v, g, beta, a_log, dt_bias, h0, cu_seqlens(seqs, device).long())


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def derive_k3c(raw: Raw) -> dict:
    """k3c's chunk-kernel inputs from the raw ones, by the formulas FlashKDA fuses: q, k L2-normed (fp32 math) in
    bf16, v bf16, g = lb * sigmoid(e^A_log (g + dt_bias)) fp32, beta = sigmoid(beta) bf16, all [T, H, D] ([T, H]);
    cu int32; the initial state transposed to k3c's [N, H, K, V]."""
    q, k = (l2norm(x[0].float()).bfloat16() for x in (raw.q, raw.k))
    g = LB * torch.sigmoid(raw.a_log.exp()[:, None] * (raw.g[0].float() + raw.dt_bias))
    return dict(q=q, k=k, v=raw.v[0], g=g.contiguous(), beta=torch.sigmoid(raw.beta[0].float()).bfloat16(),
                cu=raw.cu.int(), s0=raw.h0.transpose(-1, -2).contiguous())


def torch_reference(x: dict, seqs) -> tuple:
    """fp32 torch reference on k3c's inputs, per sequence: the token recurrence on the CPU, the chunked form (same
    math, batched) on a GPU. Returns (o [T, H, D], final states [N, H, K, V])."""
    ref = kda_recurrent if DEV == "cpu" else kda_chunked
    outs, finals, bos = [], [], 0
    for n, ln in enumerate(seqs):
        sl = slice(bos, bos + ln)
        o, s = ref(*(x[a][None, sl] for a in ("q", "k", "v", "g", "beta")), scale=SCALE,
                   initial_state=x["s0"][n:n + 1])
        outs.append(o[0])
        finals.append(s[0])
        bos += ln
    return torch.cat(outs), torch.stack(finals)


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- timing -----------------------------------------------------------------------------------------------------
def bench(fn, rep_ms: int = 100) -> float:
    if DEV == "cpu":
        t0 = time.time()
        fn()
        return time.time() - t0
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e-3


def bench_graph(fn, what: str):
    """Median seconds of back-to-back replays from a CUDA graph (no host overhead, no L2 flush), or None."""
    if DEV == "cpu":
        return None
    try:
        from triton.testing import do_bench_cudagraph
        return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3
    except Exception as e:
        print(f"CUDA graph of {what} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return None


def ratio(peer, mine):
    return peer / mine if peer and mine else None


def record(group, shape, name, seconds, flops, nbytes, *, k3c_b=None, graph=None, flashkda=None, fla=None,
           errs=None, variant=None, seqs=None, note=""):
    row = dict(group=group, shape=shape, name=name, seconds=seconds, graph_seconds=graph, flops=flops, bytes=nbytes,
               k3c_bytes=k3c_b, flashkda_seconds=flashkda, fla_seconds=fla, x_flashkda=ratio(flashkda, seconds),
               x_fla=ratio(fla, seconds), rel_err=errs, variant=variant, seqs=list(seqs) if seqs else None, note=note)
    ROWS.append(row)

    def x(v):
        return f"{v:5.2f}" if v else "    -"
    gr = f"graph {graph * 1e3:7.3f}" if graph else " " * 13
    kb = f"k3c {k3c_b / seconds / 1e12:5.2f}" if k3c_b else " " * 9
    print(f"{group:7s} {shape:24s} {name:44s} {seconds * 1e3:8.3f} ms {gr} {flops / seconds / 1e12:6.1f} TFLOP/s "
          f"io {nbytes / seconds / 1e12:5.2f} {kb} TB/s  x FlashKDA {x(row['x_flashkda'])}  x fla {x(row['x_fla'])}"
          f"  {note}", flush=True)
    return row


# ---- peers ------------------------------------------------------------------------------------------------------
class Peers:
    """FlashKDA's op and fla's chunk_kda, or None with the reason printed once."""

    def __init__(self, so_arg, no_flashkda, no_fla):
        self.flashkda = None if no_flashkda else self._load_flashkda(so_arg)
        self.fla = None if no_fla else self._load_fla()

    @staticmethod
    def _load_flashkda(so_arg):
        if DEV == "cpu":
            print("FlashKDA skipped: a CUDA kernel (this is a CPU run)", flush=True)
            return None
        paths = [Path(so_arg)] if so_arg else [d / FLASHKDA_SO for d in FLASHKDA_DIRS]
        found = [p for p in paths if p.exists()]
        if not found:
            print(f"FlashKDA skipped: no {FLASHKDA_SO} at {', '.join(map(str, paths))} (build it with "
                  f"../shared/peers/fetch_peers.sh .peers/carry)", flush=True)
            return None
        try:
            torch.ops.load_library(str(found[0]))
            print(f"FlashKDA loaded from {found[0]}", flush=True)
            return torch.ops._flashkda_C
        except Exception as e:
            print(f"FlashKDA skipped: loading {found[0]} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return None

    @staticmethod
    def _load_fla():
        if DEV == "cpu":        # fla imports on a CPU machine but its kernels need a GPU driver
            print("fla skipped: its Triton kernels need a GPU (this is a CPU run)", flush=True)
            return None
        try:
            import fla
            from fla.ops.kda import chunk_kda
            print(f"fla {getattr(fla, '__version__', '?')} loaded", flush=True)
            return chunk_kda
        except Exception as e:
            print(f"fla skipped: {type(e).__name__}: {e}", flush=True)
            return None


def flashkda_call(op, raw: Raw):
    """A thunk running FlashKDA on the raw inputs into preallocated buffers, and those (o [1, T, H, D] bf16, final
    states [N, H, V, K] fp32)."""
    t, h, n = raw.q.shape[1], raw.q.shape[2], len(raw.seqs)
    ws = torch.empty(int(op.get_workspace_size(t, h, n)), device=DEV, dtype=torch.uint8)
    out = torch.empty_like(raw.v)
    fin = torch.empty(n, h, D, D, device=DEV, dtype=torch.float32)

    def run():
        op.fwd(raw.q, raw.k, raw.v, raw.g, raw.beta, SCALE, out, ws, raw.a_log, raw.dt_bias, LB, raw.h0, fin, raw.cu,
               None, None)
    return run, out, fin


def fla_call(chunk_kda, raw: Raw):
    """A thunk running fla's chunk_kda on the raw inputs (gate, L2 norm, beta sigmoid in kernel; states [N, H, V, K]
    as FlashKDA's); it returns (o, final states)."""
    kw = dict(scale=SCALE, initial_state=raw.h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB,
              A_log=raw.a_log, dt_bias=raw.dt_bias.reshape(-1), state_v_first=True, cu_seqlens=raw.cu)
    return lambda: chunk_kda(raw.q, raw.k, raw.v, raw.g, raw.beta, **kw)


# ---- prefill ----------------------------------------------------------------------------------------------------
def run_peers(peers: Peers, raw: Raw, shape, flops, nio):
    """Time FlashKDA and fla on the raw inputs. Returns ({flashkda, flashkda_graph, fla: seconds}, {reference:
    (o [T, H, D], state in k3c's [N, H, K, V])}); a torch reference stands in when no peer ran (always on the CPU)."""
    times, refs, t = {}, {}, sum(raw.seqs)
    if peers.flashkda is not None:
        try:
            run, out, fin = flashkda_call(peers.flashkda, raw)
            run()
            refs["FlashKDA"] = (out.view(t, -1, D), fin.transpose(-1, -2))
            times["flashkda"], times["flashkda_graph"] = bench(run), bench_graph(run, "FlashKDA")
            record("prefill", shape, "FlashKDA", times["flashkda"], flops, nio, graph=times["flashkda_graph"],
                   seqs=raw.seqs)
        except Exception as e:
            print(f"FlashKDA failed at {shape}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    if peers.fla is not None:
        try:
            run = fla_call(peers.fla, raw)
            o, s = run()
            refs["fla"] = (o.view(t, -1, D), s.transpose(-1, -2))
            times["fla"] = bench(run)
            errs = errors(refs["fla"], {k_: v_ for k_, v_ in refs.items() if k_ == "FlashKDA"})
            record("prefill", shape, "fla chunk_kda", times["fla"], flops, nio, flashkda=times.get("flashkda"),
                   errs=errs, seqs=raw.seqs, note=err_note(errs))
        except Exception as e:
            print(f"fla chunk_kda failed at {shape}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    if not refs:
        refs["torch"] = torch_reference(derive_k3c(raw), raw.seqs)
    return times, refs


def errors(mine, refs) -> dict:
    """{reference: {"o": rel err, "state": rel err}} of mine = (o, state) against each reference."""
    return {name: dict(o=rel(mine[0], o), state=rel(mine[1], s)) for name, (o, s) in refs.items()}


def err_note(errs) -> str:
    return "; ".join(f"rel err vs {n} o {e['o']:.1e} state {e['state']:.1e}" for n, e in errs.items())


def prefill(peers: Peers, seqs, h, variants, extras: bool):
    """One shape: the peers, then every k3c plan in `variants` (checked, timed); for the best plan its two kernels
    alone and a CUDA-graph time, and with `extras` the prep kernel and prep + chunk. Returns the variants that
    passed, fastest first."""
    shape = shape_label(seqs, h)
    flops, nio, t, max_len = prefill_flops(seqs, h), io_bytes(seqs, h), sum(seqs), max(seqs)
    raw = make_raw(seqs, h, DEV)
    times, refs = run_peers(peers, raw, shape, flops, nio)
    x = derive_k3c(raw)
    primary = next(iter(refs))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["s0"])
    peer_t = dict(flashkda=times.get("flashkda"), fla=times.get("fla"))
    passed = []
    for var in variants:
        name = "k3c chunk " + tag(var)
        try:
            def fn():
                return kda_chunk(*args, scale=SCALE, out_dtype=torch.bfloat16, max_len=max_len, **var)  # noqa: B023
            errs = errors(fn(), refs)
            if not (errs[primary]["o"] < WRONG_BOUND and errs[primary]["state"] < WRONG_BOUND):
                print(f"{shape} {name}: WRONG ({err_note(errs)})", flush=True)
                continue
            sec = bench(fn)
            record("prefill", shape, name, sec, flops, nio, k3c_b=k3c_bytes(seqs, h, D, *plan_of(var)), errs=errs,
                   variant=var, seqs=seqs, note=err_note(errs), **peer_t)
            passed.append((sec, var))
        except Exception as e:
            print(f"{shape} {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
    passed.sort(key=lambda p: p[0])
    if not passed:
        return []
    sec, var = passed[0]
    graph = best_kernels(args, seqs, h, shape, var, flops, nio, times.get("flashkda_graph"))
    SUMMARY.append(dict(shape=shape, seqs=list(seqs), k3c_seconds=sec, k3c_graph_seconds=graph, variant=var,
                        flashkda_seconds=peer_t["flashkda"], fla_seconds=peer_t["fla"],
                        flashkda_graph_seconds=times.get("flashkda_graph"),
                        x_flashkda=ratio(peer_t["flashkda"], sec), x_fla=ratio(peer_t["fla"], sec)))
    if extras:
        prep_rows(raw, x, seqs, h, shape, var, flops, nio, peer_t)
    return [v_ for _, v_ in passed]


def best_kernels(args, seqs, h, shape, var, flops, nio, flashkda_graph):
    """The best plan's intra and inter kernels timed alone, and both replayed from a CUDA graph (its seconds; the
    row's x FlashKDA is against FlashKDA's graph replay)."""
    chunk, elt = plan_of(var)
    try:
        intra, inter, _, _ = kda_chunk_launches(*args, scale=SCALE, out_dtype=torch.bfloat16, max_len=max(seqs),
                                                **var)
        intra()                                        # inter reads intra's outputs
        record("prefill", shape, f"  intra kernel alone ({tag(var)})", bench(intra), flops, nio,
               k3c_b=intra_bytes(seqs, h, D, chunk, elt), variant=var, seqs=seqs)
        record("prefill", shape, f"  inter kernel alone ({tag(var)})", bench(inter), flops, nio,
               k3c_b=inter_bytes(seqs, h, D, chunk, elt), variant=var, seqs=seqs)

        def both():
            intra()
            inter()
        graph = bench_graph(both, f"k3c {tag(var)}")
        if graph:
            record("prefill", shape, f"k3c chunk {tag(var)}, CUDA graph", graph, flops, nio,
                   k3c_b=k3c_bytes(seqs, h, D, chunk, elt), variant=var, seqs=seqs, flashkda=flashkda_graph,
                   note="graph replay, against FlashKDA's graph replay")
        return graph
    except Exception as e:
        print(f"per-kernel timing failed: {type(e).__name__}: {e}", flush=True)
        return None


def prep_inputs(raw: Raw, h):
    """kda_prep's arguments from the raw projections ([T, H*D] rows), with random short-conv weights."""
    t = sum(raw.seqs)
    xq, xk, xv, xf = (a.view(t, h * D) for a in (raw.q, raw.k, raw.v, raw.g))
    conv_w = tuple(randn(h * D, 1, 4, scale=0.5) for _ in range(3))
    return (xq, xk, xv, xf, raw.beta.view(t, h), conv_w, raw.a_log, raw.dt_bias.reshape(-1), None, raw.cu.int())


def run_prep(pin, h, max_len, block_t=None, tier=None):
    return kda_prep(*pin, num_heads=h, head_dim=D, gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6,
                    max_len=max_len, qkv_dtype=torch.bfloat16, block_t=block_t, tier=tier,
                    binding=HOPPER.get("binding") if tier == "hopper" else None)


# tokens per prep program: the plan's default (None) and the others timed beside it
PREP_BLOCKS = (None, 16, 32, 64)
HOPPER = {}     # --hopper-bin: the Binding over the hopper-tier binaries and the prep block sizes built there


def copy_seconds(nbytes: int) -> float:
    """A device copy moving `nbytes` (half read, half written): the bandwidth a memory-bound kernel is held to."""
    src = torch.empty(nbytes // 4, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src)) * nbytes / (2 * src.numel())


def prep_error(pin, packed, seqs, h) -> float:
    """Largest relative L2 error of the prep's q, k, v, g, beta against the torch reference (k3c.reference: short
    conv + SiLU, L2 norms, the safe gate), sequence by sequence from zero conv tails."""
    xq, xk, xv, xf, xb, conv_w, a_log, dt_bias = pin[:8]
    cfg = KDASpec(num_heads=h, head_dim=D, gate="safe", gate_lower_bound=LB)
    got = unpack(packed, h, D)
    worst, start = 0.0, 0
    for n in seqs:
        sl = slice(start, start + n)
        ref = [short_conv(x_[sl][None], w_)[0][0].unflatten(-1, (h, D)).float() for x_, w_ in zip((xq, xk, xv), conv_w)]
        ref = [l2_norm(ref[0], 1e-6), l2_norm(ref[1], 1e-6), ref[2], kda_gate(xf[sl], a_log, dt_bias, cfg),
               torch.sigmoid(xb[sl].float())]
        for r, g in zip(ref, got):
            worst = max(worst, ((g[sl].float() - r).norm() / r.norm().clamp_min(1e-30)).item())
        start += n
    return worst


def prep_rows(raw, x, seqs, h, shape, var, flops, nio, peer_t):
    """The prep kernel alone and prep + chunk (the IR path for a bf16 model: bf16 q / k / v rows from the prep)."""
    pin, max_len = prep_inputs(raw, h), max(seqs)

    def full():
        packed, _ = run_prep(pin, h, max_len)
        return kda_chunk(*unpack(packed, h, D), x["cu"], x["s0"], scale=SCALE, out_dtype=torch.bfloat16,
                         max_len=max_len, **{"dot": "bf16", **var})
    try:
        full()
        nbytes = prep_bytes(seqs, h)
        t_copy = copy_seconds(nbytes)
        record("prefill", shape, "  copy of the prep's bytes", t_copy, 0, nio, k3c_b=nbytes, seqs=seqs,
               note=f"{nbytes / t_copy / 1e12:.2f} TB/s: copy bandwidth reference")
        default = kda_plan(D, "bf16", target_for(DEV)).prep_block_t
        runs = [(bt, None) for bt in PREP_BLOCKS if bt is None or bt != default]
        runs += [(bt, "hopper") for bt in HOPPER.get("prep_blocks", ())]
        for bt, tier in runs:
            err = prep_error(pin, run_prep(pin, h, max_len, bt, tier)[0], seqs, h)
            t = bench(lambda: run_prep(pin, h, max_len, bt, tier))  # noqa: B023 - timed before the next one
            label = ("hopper, " if tier else "") + ("default" if bt is None else f"block_t={bt}")
            record("prefill", shape, f"  prep kernel alone ({label})", t, flops, nio, k3c_b=nbytes, seqs=seqs,
                   note=f"{nbytes / t / 1e12:.2f} TB/s, {100 * t_copy / t:.0f}% of copy BW; rel err vs torch "
                        f"ref {err:.1e}" + (" WRONG" if err > 2e-2 else ""))
        record("prefill", shape, f"k3c prep+chunk ({tag(var)})", bench(full), flops, nio,
               k3c_b=prep_bytes(seqs, h) + k3c_bytes(seqs, h, D, *plan_of(var)), variant=var, seqs=seqs,
               note="incl. short conv, which the peers' rows do not do", **peer_t)
    except Exception as e:
        print(f"k3c prep+chunk failed: {type(e).__name__}: {e}", flush=True)


# ---- decode -----------------------------------------------------------------------------------------------------
def gate_params(h):
    a_log = torch.linspace(math.log(0.5), math.log(8.0), h, device=DEV)
    dt_bias = torch.randn(h * D, device=DEV) - 1.0
    return a_log, dt_bias


def safe_gate(f, a_log, dt_bias, h):
    x = f.float().view(*f.shape[:-1], h, D) + dt_bias.view(h, D)
    return LB * torch.sigmoid(a_log.exp()[:, None] * x)


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


def decode(peers: Peers, b, h):
    shape = f"B={b} H={h}"
    nbytes = b * h * 8 * D * D
    flops = b * h * 7 * D * D
    inputs = decode_inputs(b, h)
    xq, xk, xv, xf, xb, xg, a_log, dt_bias, nw, conv_w, tails, state = inputs
    other = torch.empty_like(state)
    t_copy = bench(lambda: other.copy_(state), rep_ms=50)
    record("decode", shape, "torch copy of the state", t_copy, 0, nbytes, note="copy bandwidth reference")
    o_ref, y_ref, s_ref = decode_ref(*inputs, b, h)
    fla_state = state.clone()
    t_rec = fla_recurrence(inputs, fla_state, b, h, shape, flops, nbytes, t_copy) if peers.fla else None
    common = dict(num_heads=h, head_dim=D, gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, norm_eps=1e-5)

    def check(name, out, want, s_new):
        eo, es = rel(out, want), rel(s_new, s_ref)
        ok = eo < 1e-2 and es < 1e-3
        if not ok:
            print(f"{name}: WRONG rel err out {eo:.1e} state {es:.1e}", flush=True)
        return ok, f"rel err vs torch ref out {eo:.1e} state {es:.1e}"

    def step(var):          # the recurrence (conv + norms + gates + step), o out in fp32
        return kda_decode(xq, xk, xv, xf, xb, None, conv_w, a_log, dt_bias, None, tails, state, fuse_out=False,
                          binding=decode_binding(var), **var, **common)

    def layer(var):         # the whole layer in one kernel (RMSNorm x gate fused)
        return kda_decode(xq, xk, xv, xf, xb, xg, conv_w, a_log, dt_bias, nw, tails, state,
                          binding=decode_binding(var), **var, **common)

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
            sec = bench(two, rep_ms=50)
            ok, err = check("step+out", two(), y_ref, s_ref)
            record("decode", shape, name, sec, flops, nbytes, fla=t_rec, note=err)
            if best_layer is None or sec < best_layer[0]:
                best_layer = (sec, name, var)
        except Exception as e:
            print(f"k3c step+out failed: {type(e).__name__}: {e}", flush=True)
    t_layer = fla_layer(inputs, fla_state, b, h, shape, flops, nbytes, best_layer) if peers.fla else None
    for what, best, t_fla in (("step", best_rec, t_rec), ("layer", best_layer, t_layer)):
        if best is not None:
            SUMMARY.append(dict(shape=f"decode {what} {shape}", k3c_seconds=best[0], variant=best[2],
                                flashkda_seconds=None, fla_seconds=t_fla, x_flashkda=None, x_fla=ratio(t_fla, best[0])))


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
            sec = bench(lambda: run(var), rep_ms=50)  # noqa: B023 - timed before the next iteration
            record("decode", shape, name, sec, flops, nbytes, fla=t_rec, variant=var,
                   note=f"{t_copy / sec:.0%} of copy BW; {err}")
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
        run_fla_rec()
        t_rec = bench(run_fla_rec, rep_ms=50)
        record("decode", shape, "fla fused_recurrent_kda", t_rec, flops, nbytes,
               note=f"{t_copy / t_rec:.0%} of copy BW")
        return t_rec
    except Exception as e:
        print(f"fla fused_recurrent_kda failed: {type(e).__name__}: {e}", flush=True)
        return None


def fla_layer(inputs, fla_state, b, h, shape, flops, nbytes, best_layer):
    """fla's layer path (conv updates + recurrence + gated RMSNorm), and the best k3c layer against it: its time."""
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
        run_fla_layer()
        t_layer = bench(run_fla_layer, rep_ms=50)
        record("decode", shape, "fla layer path (conv+rec+norm)", t_layer, flops, nbytes)
        if best_layer is not None:
            record("decode", shape, f"best k3c layer vs fla layer: {best_layer[1]}", best_layer[0], flops, nbytes,
                   fla=t_layer)
        return t_layer
    except Exception as e:
        print(f"fla layer path failed: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        return None


# ---- compile first, in parallel processes (Triton's on-disk cache is then hit in the timed process) -------------
def _warm(job):
    kind, seqs_or_b, h, var = job
    torch.manual_seed(0)
    try:
        with torch.inference_mode():
            if kind == "prefill":
                _warm_prefill(seqs_or_b, h, var)
            else:
                _warm_decode(kind, seqs_or_b, h, var)
        if DEV != "cpu":
            torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{job}: {type(e).__name__}: {e}"


def _warm_prefill(seqs, h, var):
    raw = make_raw(seqs, h, DEV)
    if var == "fla":
        from fla.ops.kda import chunk_kda
        fla_call(chunk_kda, raw)()
    elif var == "prep":             # the prep kernel (prep + chunk runs chunk kernels of the same specialisations)
        run_prep(prep_inputs(raw, h), h, max(seqs))
    else:
        x = derive_k3c(raw)
        kda_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["s0"], scale=SCALE, out_dtype=torch.bfloat16,
                  max_len=max(seqs), **var)


def _warm_decode(kind, b, h, var):
    xq, xk, xv, xf, xb, xg, a_log, dt_bias, nw, conv_w, tails, state = decode_inputs(b, h)
    common = dict(num_heads=h, head_dim=D, gate="safe", gate_lower_bound=LB, l2norm_eps=1e-6, norm_eps=1e-5)
    if var == "fla":
        from fla.ops.kda import fused_recurrent_kda
        fused_recurrent_kda(*(x.view(b, 1, h, D) for x in (xq, xk, xv, xf)), xb.view(b, 1, h), A_log=a_log,
                            dt_bias=dt_bias, initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                            use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    elif var == "out":
        kda_out(xq.float().view(b, h, D), xg, nw, 1e-5)
    elif kind == "decode_rec":
        kda_decode(xq, xk, xv, xf, xb, None, conv_w, a_log, dt_bias, None, tails, state, fuse_out=False,
                   **var, **common)
    else:
        kda_decode(xq, xk, xv, xf, xb, xg, conv_w, a_log, dt_bias, nw, tails, state, **var, **common)


def prefill_jobs(shapes, variants, peers: Peers, prep: bool):
    """Warm-up jobs for prefill shapes (seqs, h): one per distinct specialisation (warm_seqs, h) and plan."""
    jobs = []
    for warm in dict.fromkeys((warm_seqs(seqs), h) for seqs, h in shapes):
        jobs += [("prefill", *warm, v) for v in variants]
        jobs += [("prefill", *warm, "fla")] if peers.fla else []
        jobs += [("prefill", *warm, "prep")] if prep else []
    return jobs


def hopper_decode(root: str) -> None:
    """Add the hopper-tier decode variants and prep block sizes (prebuilt binaries: the GPU box's Triton may not
    build Gluon) to the decode sweeps and the prep rows, launched through a Binding over `root`."""
    sys.path.insert(0, str(ROOT / "tests" / "kda"))
    from test_kda_decode_hopper_gpu import PREP_BLOCKS as HOPPER_PREP_BLOCKS, VARIANTS, binding_from

    HOPPER["binding"] = binding_from(root, target_for(DEV))
    HOPPER["prep_blocks"] = HOPPER_PREP_BLOCKS
    for bv, w, lk in VARIANTS:
        var = dict(decode_tier="hopper", decode_block_v=bv, decode_warps=w, decode_lanes_k=lk)
        DECODE_REC_VARIANTS.append(var)
        DECODE_LAYER_VARIANTS.append(dict(var))


def decode_binding(var):
    return HOPPER.get("binding") if var.get("decode_tier") == "hopper" else None


def decode_jobs(h, peers: Peers):
    """decode B=16 has the specialisation of 64 / 256 (divisible by 16)."""
    jobs = [("decode_rec", 16, h, v) for v in DECODE_REC_VARIANTS if "decode_tier" not in v]
    jobs += [("decode_layer", 16, h, v) for v in DECODE_LAYER_VARIANTS if "decode_tier" not in v]
    return jobs + [("decode_rec", 16, h, "out")] + ([("decode_rec", 16, h, "fla")] if peers.fla else [])


def precompile(work, workers=12):
    if not work:
        return
    import concurrent.futures as cf
    import multiprocessing as mp
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        for err in ex.map(_warm, work):
            if err:
                print(f"precompile: {err}", flush=True)
    print(f"[precompile: {len(work)} jobs in {time.time() - t0:.1f} s]", flush=True)


# ---- the run ----------------------------------------------------------------------------------------------------
def parse_variants(text: str) -> list:
    """--variants: a JSON list of plan dicts (kda_chunk keywords)."""
    try:
        variants = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--variants is not JSON: {e}")
    if not isinstance(variants, list) or not all(isinstance(v_, dict) for v_ in variants) or not variants:
        raise SystemExit(f"--variants must be a non-empty JSON list of objects, got {text!r}")
    for v_ in variants:
        bad = set(v_) - PLAN_KEYS
        if bad:
            raise SystemExit(f"--variants: unknown plan keys {sorted(bad)} (known: {sorted(PLAN_KEYS)})")
    return variants


def later_variants(ranked, variants):
    """The best LATER_BEST plans of the first shape, plus the default plan (each once)."""
    picked = (ranked or variants)[:LATER_BEST] + [{}]
    unique: dict = {}
    for v_ in picked:
        unique.setdefault(json.dumps(v_, sort_keys=True), v_)
    return list(unique.values())


def plan_steps(args, peers: Peers, variants):
    """(name, thunk) in run order: the headline prefill shape and decode 64x96 first, then the other decode shape,
    then the other prefill shapes."""
    pick = QUICK_PREFILL if args.quick else range(len(PREFILL_SHAPES))
    shapes = [(tiny if args.tiny else seqs, TINY_H if args.tiny else h) for seqs, h, tiny in
              (PREFILL_SHAPES[i] for i in pick)]
    decodes = [(tb if args.tiny else b, TINY_H if args.tiny else h) for b, h, tb in
               DECODE_SHAPES[:1 if args.quick else None]]
    ranked: list = []
    warm = not args.no_precompile and DEV != "cpu"       # the interpreter compiles nothing
    first, rest = shapes[0], shapes[1:]
    steps = []
    if warm:
        steps.append(("precompile headline", lambda: precompile(prefill_jobs([first], variants, peers, True)
                                                                  + decode_jobs(decodes[0][1], peers))))
    steps.append((f"prefill {shape_label(*first)}",
                  lambda: ranked.extend(prefill(peers, *first, variants, extras=True))))
    steps.append((f"decode {decodes[0][0]}x{decodes[0][1]}", lambda: decode(peers, *decodes[0])))
    if warm and (rest or decodes[1:]):
        steps.append(("precompile the rest", lambda: precompile(
            prefill_jobs(rest, later_variants(ranked, variants), peers, False)
            + [j for _, h in decodes[1:] for j in decode_jobs(h, peers)])))
    for b, h in decodes[1:]:          # short: before the other prefill shapes, so a tight --budget keeps them
        steps.append((f"decode {b}x{h}", lambda b=b, h=h: decode(peers, b, h)))
    for seqs, h in rest:
        steps.append((f"prefill {shape_label(seqs, h)}",
                      lambda s=seqs, h=h: prefill(peers, s, h, later_variants(ranked, variants), extras=False)))
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="kda-bench.json", help="written to $OUT/NAME (default: ./NAME)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("K3C_BENCH_BUDGET", 420)),
                    help="start no new step after this many seconds (a started step runs to its end)")
    ap.add_argument("--quick", action="store_true", help="the headline and FlashKDA's varlen shape, decode 64x96")
    ap.add_argument("--tiny", action="store_true", help=f"every shape shrunk (T <= 130, H = {TINY_H}): a dry run")
    ap.add_argument("--variants", help="JSON list of k3c plans (kda_chunk keywords) instead of PREFILL_VARIANTS")
    ap.add_argument("--flashkda-so", help=f"path of {FLASHKDA_SO} (default: looked for in "
                                          f"{', '.join(map(str, FLASHKDA_DIRS))})")
    ap.add_argument("--no-flashkda", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--hopper-bin", help="folder of the hopper-tier decode binaries (built on a box whose Triton "
                    "builds the Gluon source: python tests/kda/test_kda_decode_hopper_gpu.py build DIR): its "
                    "variants join the decode rows")
    args = ap.parse_args(argv)
    if args.hopper_bin:
        hopper_decode(args.hopper_bin)
    variants = parse_variants(args.variants) if args.variants else PREFILL_VARIANTS
    dev_name = "cpu (Triton interpreter)" if DEV == "cpu" else torch.cuda.get_device_name()
    print(f"device {dev_name} torch {torch.__version__}", flush=True)
    peers = Peers(args.flashkda_so, args.no_flashkda, args.no_fla)
    env = dict(device=dev_name, torch=torch.__version__, tiny=args.tiny, quick=args.quick, variants=variants)
    with torch.inference_mode():
        for name, fn in plan_steps(args, peers, variants):
            if elapsed() > args.budget:
                print(f"skipped {name}: {elapsed():.0f} s elapsed > budget {args.budget:.0f} s", flush=True)
                continue
            t0 = time.time()
            try:
                fn()
            except Exception as e:
                print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
            if DEV != "cpu":
                torch.cuda.empty_cache()
            print(f"[{name}: {time.time() - t0:.1f} s, total {elapsed():.0f} s]", flush=True)
            write_json(args.json, env)          # after every step: a run cut short still leaves its rows
    summary()
    return 0


def elapsed() -> float:
    return time.time() - T_START


def summary():
    print("\nSUMMARY (ms, do_bench median; x = peer time / k3c time; graph = CUDA-graph replay)")
    print(f"{'shape':28s} {'k3c best':>9s} {'variant':36s} {'FlashKDA':>9s} {'fla':>9s} {'x FlashKDA':>10s} "
          f"{'x fla':>6s} {'k3c graph':>9s} {'FKDA graph':>10s}")

    def ms(s):
        return f"{s * 1e3:9.3f}" if s else f"{'-':>9s}"

    def x(v, w):
        return f"{v:{w}.2f}" if v else f"{'-':>{w}s}"
    for s in SUMMARY:
        print(f"{s['shape']:28s} {ms(s['k3c_seconds'])} {tag(s['variant'])[:36]:36s} {ms(s['flashkda_seconds'])} "
              f"{ms(s['fla_seconds'])} {x(s['x_flashkda'], 10)} {x(s['x_fla'], 6)} {ms(s.get('k3c_graph_seconds'))} "
              f" {ms(s.get('flashkda_graph_seconds'))}")


def write_json(name, env):
    out = Path(os.environ.get("OUT", ".")) / name
    out.write_text(json.dumps(dict(env=env, rows=ROWS, summary=SUMMARY), indent=1))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
