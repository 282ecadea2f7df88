"""End to end: the k3c serving engine against the eager reference and `torch.compile` of the reference, same weights,
same inputs, same cache, one process.

    python bench/e2e.py --spec examples/k3-wide.yaml --device cuda --out e2e.json     # H200: prefill 8192, decode
    python bench/e2e.py --spec examples/k3-tiny.yaml --device cpu                     # small mode (seconds-minutes)

Prefill: one sequence of --prompt-len tokens (k3c: one append-prefill call; the reference: its own append path in
chunks of --ref-chunk tokens, since a single 8192-token MHA softmax at 96 heads needs ~50 GB). Decode: batches of
--batches sequences, each with --cached tokens already cached; the cache (KDA states, conv tails, MLA latent rows) is
random, built once and handed to all three (decode time does not depend on the values), then --steps greedy decode
steps are timed. Weights are random, generated on the device; routed experts are rounded to MXFP4 once: k3c runs the
packed experts, the reference their exact bf16 values. Prints a table and writes JSON; ratios are torch.compile time
over k3c time (targets: prefill >= 1.5x, decode >= 3x).

Numerics probe (--check-len tokens, before the timed runs; --probe-only for it alone): k3c, the eager reference and
the fp32 reference against a float64 "truth" on the same weights (WideReference), prefill and one decode step. On
random weights the bf16 logits are far from the truth for k3c and eager alike (discrete MoE routing flips amplify
rounding; docs/perf.md): `k3c_over_eager_error` ~1 says k3c sits at the model's bf16 floor, >> 1 a k3c bug.
Phases (weights, numerics, prefill k3c/eager, decode k3c/eager per batch, then every torch.compile phase) are
timestamped on stderr and the JSON is rewritten after each, so a time-out leaves numbers; --deadline stops starting
new phases. Full size on one H200 in one command (docs/perf.md):
    timeout 540 python bench/e2e.py --spec examples/k3-wide.yaml --device cuda --prompt-len 8192 --cached 8192 \
        --batches 1,32 --steps 16 --peer-steps 8 --reps 2 --check-len 256 --deadline 420 --out bench/e2e-h200.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, fields

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def grouped_experts(z, w1, w3, w2, p, idx, act):
    """The reference's routed experts (k3c.reference.moe.routed_experts: same math, fp32 combine) as three
    grouped GEMMs over the expert-sorted slots (torch._grouped_mm): no .tolist(), no host sync, so torch.compile
    keeps the MoE in its graph (--compile-moe grouped: the strongest torch peer we know how to write)."""
    from k3c.reference.moe import glu_act

    n, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w1.shape[0], dtype=torch.int32, device=z.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))                  # static shape (bincount's is not)
    offs = counts.cumsum(0).to(torch.int32)
    tokens = order // k
    zs = z[tokens]
    h = glu_act(torch._grouped_mm(zs, w1.transpose(-1, -2), offs=offs),
                torch._grouped_mm(zs, w3.transpose(-1, -2), offs=offs), act)
    y = torch._grouped_mm(h.to(w2.dtype), w2.transpose(-1, -2), offs=offs)
    u = torch.zeros(n, w2.shape[1], dtype=torch.float32, device=z.device)
    u.index_add_(0, tokens, y.float() * p.reshape(-1)[order, None].float())
    return u.to(z.dtype)


def make_weights(spec, module, device, dtype, seed: int = 0, reference: bool = True) -> dict[str, torch.Tensor]:
    """Random weights on the device: large matrices drawn there (scaled 1/sqrt(fan-in) as k3c.init_weights does),
    small ones from k3c's initialiser; MXFP4 experts as packed tensors (what the graph reads) plus, with
    `reference`, their exact dequantized values (what the reference reads; 59 GB at k3-wide)."""
    from k3c.quant.mx import mxfp4_dequantize
    from k3c.frontend.weight_names import model_weights
    from k3c.runtime.weight_prep import graph_params, quantize_stack
    from k3c.runtime.weights import _generator, _init_one

    packed_wanted = {n[: -len(".weight_packed")] for n in graph_params(module) if n.endswith(".weight_packed")}
    rule = spec.quantization.rule if getattr(spec, "quantization", None) else "floor"
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for info in model_weights(spec):
        n = math.prod(info.shape)
        if info.kind in ("linear", "experts", "embedding") and n >= 1 << 20:
            t = torch.empty(info.shape, dtype=dtype, device=device)
            rows = max(1, (1 << 26) // math.prod(info.shape[1:]))     # slabs of <= 256 MB of fp32 temporaries
            for i in range(0, info.shape[0], rows):
                t[i:i + rows] = torch.randn((min(rows, info.shape[0] - i), *info.shape[1:]), generator=gen,
                                            device=device)
            if info.kind != "embedding":
                t /= math.sqrt(info.shape[-1])
        else:
            t = _init_one(spec, info, _generator(seed, info.name)).to(device)
            t = t if info.dtype == "fp32" else t.to(dtype)
        if info.name in packed_wanted:
            packed, scales = quantize_stack(info.name, t, rule)
            out[f"{info.name}.weight_packed"], out[f"{info.name}.weight_scale"] = packed, scales
            if not reference:
                del t
                continue
            for i in range(t.shape[0]):                 # the reference gets exactly the values k3c runs
                t[i] = mxfp4_dequantize(packed[i], scales[i], dtype)
        out[info.name] = t
    return out


class WideReference:
    """The eager reference with its activations in a wider dtype (float64 by default) on the *same* weights: the
    numerics probe's "truth". Weights stay as generated (bf16) and are upcast where they are used (reference.norms
    .linear casts the weight to the activation dtype), so it needs no second copy of the big matrices; the small
    ones (norms, AttnRes queries, gates, kv_b) are upcast once. With float64 its distance to the exact function of
    these weights is ~1e-15, and the fp32 reference's is ~1e-6 (bench/e2e.py reports the latter as a calibration)."""

    def __new__(cls, spec, w, act: torch.dtype, **options):
        from k3c.reference import ReferenceModel
        from k3c.reference.model import strip_prefix

        class _Wide(ReferenceModel):
            def embed(self, input_ids):
                return super().embed(input_ids).to(act)

        m = _Wide(spec, w, **options)
        small = {n: v.to(act) for n, v in m.w.items() if v.is_floating_point() and v.numel() <= 1 << 24}
        m.w = {**m.w, **small}
        m.attn_w = [strip_prefix(m.w, f"layers.{i}.self_attn.") for i in range(spec.num_layers)]
        m.ffn_w = [strip_prefix(m.w, f"layers.{i}.block_sparse_moe." if spec.is_moe_layer(i) else f"layers.{i}.mlp.")
                   for i in range(spec.num_layers)]
        m.dtype = act
        return m


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Logit agreement of rows [N, vocab]: relative error of the last row, of all rows together, the median and
    max per-row relative error, and the share of rows whose argmax agrees."""
    got, want = got.double().reshape(-1, got.shape[-1]), want.double().reshape(-1, want.shape[-1])
    per_row = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return {"last": float(per_row[-1]), "all": float((got - want).norm() / want.norm()),
            "row_median": float(per_row.median()), "row_max": float(per_row.max()),
            "top1_agree": float((got.argmax(-1) == want.argmax(-1)).double().mean())}


def numerics_probe(spec, eng, w, device: str, dtype: torch.dtype, check_len: int, truth_dtype: torch.dtype,
                   eager_pre=None) -> dict:
    """Independent of the timed runs: one prompt of check_len tokens through k3c, the eager reference in the run's
    dtype, the reference in fp32 (calibration) and the wide "truth" (WideReference), then one decode step of each
    from the same cache (the truth's prefill cache rounded as the run's dtype stores it). The gap of k3c to the
    truth, next to eager's own gap to the truth, says whether k3c's difference from eager is the bf16 floor of the
    model (same order) or a bug (k3c much worse)."""
    from k3c.reference import ReferenceModel
    from k3c.reference.kda import KDAState
    from k3c.reference.model import ReferenceCache

    g = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(0, spec.vocab_size, (1, check_len + 1), generator=g).to(device)
    prompt, nxt = ids[:, :check_len], ids[:, check_len:]
    models = {"truth": WideReference(spec, w, truth_dtype, mla_mode="mha")}
    if dtype != torch.float32:
        models["eager_fp32"] = WideReference(spec, w, torch.float32, mla_mode="mha")
    models["eager"] = eager_pre if eager_pre is not None else ReferenceModel(spec, w, mla_mode="mha")
    pre, caches = {}, {}
    t0 = time.perf_counter()
    for name, m in models.items():
        pre[name], caches[name] = m.forward(prompt, None)
        pre[name] = pre[name][0]
    rid = eng.open()
    pre["k3c"] = eng.extend([rid], [prompt[0]])[0]
    eng.finish(rid)

    # decode: every model continues from the truth's cache, stored as the run's dtype stores it
    tc = caches["truth"]

    def cast(c, act):
        if isinstance(c, KDAState):     # state fp32 (wider in the truth), conv tails in the activation dtype
            st = c.state.to(torch.float32).to(act if act == torch.float64 else torch.float32)
            return KDAState(st, tuple(t.to(dtype).to(act) for t in c.conv))
        return c.to(dtype).to(act)

    dec = {}
    for name, m in models.items():
        act = m.dtype if name != "eager" else dtype
        mode, m.mla_mode = m.mla_mode, "mqa"
        dec[name] = m.forward(nxt, ReferenceCache(tuple(cast(c, act) for c in tc.layers), tc.length))[0][0, -1:]
        m.mla_mode = mode
    rid = eng.adopt(prompt[0].tolist(),
                    {i: KDAState(c.state.to(torch.float32), tuple(t.to(dtype) for t in c.conv))
                     for i, c in enumerate(tc.layers) if isinstance(c, KDAState)},
                    {i: c[0].to(dtype) for i, c in enumerate(tc.layers) if not isinstance(c, KDAState)})
    dec["k3c"] = eng.extend([rid], [nxt[0].tolist()])[0][-1:]
    eng.finish(rid)
    out = {"check_len": check_len, "truth_dtype": str(truth_dtype).replace("torch.", ""),
           "seconds": time.perf_counter() - t0}
    for phase, got in (("prefill", pre), ("decode", dec)):
        t = got["truth"]
        out[phase] = {"k3c_vs_truth": compare(got["k3c"], t), "eager_vs_truth": compare(got["eager"], t),
                      "k3c_vs_eager": compare(got["k3c"], got["eager"])}
        if "eager_fp32" in got:
            out[phase]["eager_fp32_vs_truth"] = compare(got["eager_fp32"], t)
        # k3c's distance to the truth in units of eager's own: ~1 is the rounding floor of the model, >> 1 a bug
        e = out[phase]["eager_vs_truth"]["all"]
        out[phase]["k3c_over_eager_error"] = out[phase]["k3c_vs_truth"]["all"] / e if e > 0 else None
    return out


def print_numerics(nm: dict) -> None:
    print(f"numerics probe ({nm['check_len']} tokens, truth = reference in {nm['truth_dtype']} on the same weights):")
    print(f"  {'pair':22s} {'phase':8s} {'last row':>9s} {'all rows':>9s} {'row med':>9s} {'row max':>9s} "
          f"{'top1':>6s}")
    for phase in ("prefill", "decode"):
        for pair, c in nm[phase].items():
            if isinstance(c, dict):
                print(f"  {pair:22s} {phase:8s} {c['last']:9.2e} {c['all']:9.2e} {c['row_median']:9.2e} "
                      f"{c['row_max']:9.2e} {c['top1_agree']:6.1%}")
        r = nm[phase]["k3c_over_eager_error"]
        print(f"  {phase}: k3c's error vs truth / eager's = {r:.2f}" if r is not None else f"  {phase}: exact")


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """Phase timestamps on stderr: a run cut short by a time limit still shows where the time went."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


class Timer:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, reps: int) -> tuple[float, object]:
        """Median seconds of `reps` runs of fn() (after one warm-up run) and the last result."""
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        progress(f"{getattr(fn, '__name__', 'run')}: warm-up {time.perf_counter() - t0:.1f} s")
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out


def guarded(name: str, fn, errors: dict):
    try:
        return fn()
    except Exception as exc:        # a peer that cannot run (e.g. torch.compile) is reported, not fatal
        errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        traceback.print_exc(file=sys.stderr)
        return None


def dynamo_counts() -> dict:
    """torch._dynamo's counters: frames compiled, graphs produced, graph breaks (a recompile adds frames/graphs)."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["total"]), "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def count_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=2)


def argument_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="examples/k3-wide.yaml")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--prompt-len", type=int, help="prefill tokens (cuda 8192, cpu 256)")
    ap.add_argument("--cached", type=int, help="cached tokens per sequence for decode (cuda 8192, cpu 256)")
    ap.add_argument("--batches", help="decode batch sizes, comma separated (cuda 1,32, cpu 1,4)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps of k3c (cuda 16, cpu 3)")
    ap.add_argument("--peer-steps", type=int, default=None,
                    help="timed decode steps of the eager and compiled peers (default: --steps)")
    ap.add_argument("--eager-decode-batches", help="decode batches the eager peer runs (default: all of --batches)")
    ap.add_argument("--reps", type=int, default=None, help="timed prefill repetitions (cuda 3, cpu 1)")
    ap.add_argument("--ref-chunk", type=int, default=2048, help="reference prefill chunk (append path)")
    ap.add_argument("--no-kernels", action="store_true", help="k3c with every op through torch")
    ap.add_argument("--no-graph", action="store_true", help="no CUDA-graph decode row (default on cuda: the "
                    "engine's eager step and the captured step are both timed)")
    ap.add_argument("--engine-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine decodes through CUDA graphs (Engine cuda_graphs; default: the engine's own, on "
                    "with CUDA and kernels): the k3c decode rows are the served path")
    ap.add_argument("--graph", action="store_true", help="the CUDA-graph row off CUDA too (it falls back to the "
                    "eager step, reported: checks the plumbing)")
    ap.add_argument("--skip-compiled", action="store_true", help="no torch.compile peer")
    ap.add_argument("--skip-eager", action="store_true", help="no eager peer in the timed runs (the probe still runs)")
    ap.add_argument("--compile-moe", choices=("loop", "grouped"), default="loop",
                    help="the compiled peer's routed experts: loop = the reference's own (a data-dependent loop over "
                    "experts, run eagerly inside the compiled graph); grouped = grouped_experts (torch._grouped_mm, "
                    "compiled)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the peer (inductor; aot_eager checks the plumbing on a CPU)")
    ap.add_argument("--check-len", type=int, default=256,
                    help="numerics probe prompt (0: no probe): k3c, eager and the eager fp32 reference against a "
                         "wide reference (--truth-dtype) on the same weights, prefill and one decode step")
    ap.add_argument("--truth-dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--probe-only", action="store_true", help="the numerics probe, no timed runs")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds since start after which no further timed phase starts (skipped ones are listed "
                         "in the JSON); the JSON is rewritten after every phase either way")
    ap.add_argument("--seed", type=int, default=0, help="weights")
    ap.add_argument("--out", help="JSON file (rewritten after every phase)")
    return ap


@dataclass
class Settings:
    """The parsed options (`args` as given: the JSON's "args") and the sizes they resolve to on the device."""
    args: argparse.Namespace
    cuda: bool
    dtype: torch.dtype
    prompt_len: int
    cached: int
    batches: list[int]
    steps: int
    peer_steps: int
    eager_batches: list[int]
    reps: int

    @property
    def use_kernels(self) -> bool:
        return not self.args.no_kernels


def parse_settings(argv) -> Settings:
    ap = argument_parser()
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    batches = [int(b) for b in (args.batches or ("1,32" if cuda else "1,4")).split(",")]
    steps = args.steps or (16 if cuda else 3)
    return Settings(
        args=args, cuda=cuda, dtype=getattr(torch, args.dtype or ("bfloat16" if cuda else "float32")),
        prompt_len=args.prompt_len or (8192 if cuda else 256), cached=args.cached or (8192 if cuda else 256),
        batches=batches, steps=steps, peer_steps=args.peer_steps or steps,
        eager_batches=batches if args.eager_decode_batches is None else
        [int(b) for b in args.eager_decode_batches.split(",") if b],
        reps=args.reps or (3 if cuda else 1))


@dataclass
class Bench(Settings):
    """A run: its settings, what every peer shares (the spec, the compiled model, the weights, k3c's engine, the eager
    prefill reference) and the JSON being filled in (`result`, rewritten after every phase)."""
    spec: object
    model: object
    w: dict
    timer: Timer
    result: dict
    eng: object
    ref_pre: object

    def save(self) -> None:
        write_json(self.args.out, self.result)

    def phase(self, name: str, fn):
        """Run one phase (timestamped, errors kept, deadline honoured); the JSON is rewritten after it."""
        args, result = self.args, self.result
        if args.deadline is not None and time.perf_counter() - _T0 > args.deadline:
            result["skipped"].append(name)
            progress(f"{name}: skipped (past --deadline {args.deadline:.0f} s)")
            self.save()
            return None
        t = time.perf_counter()
        progress(f"{name} ...")
        got = guarded(name, fn, result["errors"])
        result["phase_seconds"][name] = time.perf_counter() - t
        progress(f"{name}: done in {time.perf_counter() - t:.1f} s")
        self.save()
        return got


def setup(s: Settings) -> Bench:
    """The compiled model, random weights, the JSON's header (written as soon as the weights exist), the engine and
    the eager prefill reference."""
    import k3c
    from k3c.reference import ReferenceModel
    from k3c.runtime.devices import target_for
    from k3c.runtime.engine import Engine

    args = s.args
    torch.manual_seed(0)
    spec = k3c.load_spec(args.spec)
    model = k3c.compile(spec, target="h200" if s.cuda else "cpu")
    t0 = time.perf_counter()
    w = make_weights(spec, model.module, args.device, s.dtype, seed=args.seed)
    result = {"spec": spec.name, "device": args.device, "dtype": str(s.dtype).replace("torch.", ""),
              "gpu": torch.cuda.get_device_name() if s.cuda else None, "torch": torch.__version__,
              "k3c_kernels": s.use_kernels, "compile_backend": None if args.skip_compiled else args.compile_backend,
              "compile_moe": None if args.skip_compiled else args.compile_moe,
              "args": vars(args), "weights_gib": sum(t.numel() * t.element_size() for t in w.values()) / 2**30,
              "phase_seconds": {"weights": time.perf_counter() - t0}, "prefill": {}, "decode": [],
              "errors": {}, "skipped": []}
    progress(f"weights: {result['weights_gib']:.1f} GiB in {result['phase_seconds']['weights']:.1f} s")
    write_json(args.out, result)

    ctx_max = max(s.prompt_len, s.cached + max(s.steps, s.peer_steps) + 4, args.check_len + 2)
    ps = target_for(args.device).mla_page_size
    eng = Engine(model, w, device=args.device, max_batch=max(s.batches), max_context=ctx_max,
                 num_pages=max(s.batches) * -(-ctx_max // ps) + 1, page_size=ps, use_kernels=s.use_kernels,
                 cuda_graphs=args.engine_graphs)
    result["k3c_executor"] = eng.describe()
    result["engine_graphs"] = eng.cuda_graphs
    progress("engine built")
    return Bench(**{f.name: getattr(s, f.name) for f in fields(Settings)}, spec=spec, model=model, w=w,
                 timer=Timer(args.device), result=result, eng=eng, ref_pre=ReferenceModel(spec, w, mla_mode="mha"))


def probe_numerics(b: Bench) -> None:
    """The numerics probe as the run's first phase (independent of the timed runs)."""
    nm = b.phase("numerics", lambda: numerics_probe(b.spec, b.eng, b.w, b.args.device, b.dtype, b.args.check_len,
                                                    getattr(torch, b.args.truth_dtype), b.ref_pre))
    if nm:
        b.result["numerics"] = nm
        print_numerics(nm)
        b.save()


# -- prefill ----------------------------------------------------------------------------------------------------

def ref_prefill(fwd, ids: torch.Tensor, chunk: int):
    """The reference's prefill of `ids` through `fwd` (eager or compiled), its append path in chunks of `chunk`
    tokens: a function of no arguments returning the last position's logits."""
    def run():
        cache, outs = None, []
        with torch.no_grad():
            for s in range(0, ids.shape[1], chunk):
                logits, cache = fwd(ids[:, s:s + chunk], cache)
                outs.append(logits[:, -1])
        return outs[-1][0]
    return run


def time_k3c_prefill(b: Bench, ids: torch.Tensor) -> torch.Tensor:
    """k3c's prefill (one append-prefill call on a fresh sequence), timed; returns its last position's logits."""
    def k3c_prefill():
        rid = b.eng.open()
        out = b.eng.extend([rid], [ids[0]])[0]
        b.eng.finish(rid)
        return out

    pre = b.result["prefill"]
    t, out = b.timer(k3c_prefill, b.reps)
    pre["k3c_ms"], pre["mla_modes"] = t * 1e3, {str(k): v for k, v in b.eng.last_modes.items()}
    return out[-1]


def time_eager_prefill(b: Bench, ids: torch.Tensor, k3c_logits: torch.Tensor | None) -> None:
    pre = b.result["prefill"]
    t, out = b.timer(ref_prefill(b.ref_pre.forward, ids, b.args.ref_chunk), b.reps)
    pre["eager_ms"] = t * 1e3
    if k3c_logits is not None:
        pre["rel_err_last_logits_vs_eager"] = rel(k3c_logits, out)


def compare_prefill(b: Bench) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prefill phases of k3c and the eager reference on one random prompt; returns the prompt and k3c's last
    logits (None if its phase did not run), which the compiled peer is held to."""
    ids = torch.randint(0, b.spec.vocab_size, (1, b.prompt_len), device=b.args.device)
    pre = b.result["prefill"]
    pre["tokens"] = b.prompt_len
    k3c_logits = b.phase("prefill_k3c", lambda: time_k3c_prefill(b, ids))
    if not b.args.skip_eager:
        b.phase("prefill_eager", lambda: time_eager_prefill(b, ids, k3c_logits))
    if b.cuda:
        pre["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    b.save()
    return ids, k3c_logits


# -- decode -----------------------------------------------------------------------------------------------------

def random_cache(b: Bench, B: int):
    """The decode cache of B sequences with `cached` tokens: random, the same for every peer (seeded by B)."""
    from k3c.reference.kda import KDAState
    from k3c.reference.model import ReferenceCache

    cfg, mcfg, device = b.spec.kda, b.spec.mla, b.args.device
    g = torch.Generator(device=device).manual_seed(B)
    layers = []
    for kind in b.spec.layer_kinds:
        if kind == "kda":
            st = 0.05 * torch.randn(B, cfg.num_heads, cfg.head_dim, cfg.head_dim, generator=g, device=device)
            tails = tuple(torch.randn(B, cfg.width, cfg.conv_kernel - 1, generator=g, device=device
                                      ).to(b.dtype) for _ in range(3))
            layers.append(KDAState(st, tails))
        else:
            layers.append(torch.randn(B, b.cached, mcfg.kv_lora_rank + mcfg.qk_rope_head_dim, generator=g,
                                      device=device).to(b.dtype))
    return ReferenceCache(tuple(layers), b.cached)


def ref_steps(fwd, cache, toks: torch.Tensor, n: int, s0: int = 0) -> torch.Tensor:
    """n greedy-input decode steps of the reference through `fwd` from `cache` (tokens toks[s0:s0+n]): the last
    step's logits."""
    out = None
    B = cache.batch
    with torch.no_grad():
        for s in range(s0, s0 + n):
            out, cache = fwd(toks[s, :B, None], cache)
    return out[:, -1]


def k3c_steps(eng, rids: list, toks: torch.Tensor, n: int, s0: int = 0) -> torch.Tensor:
    """n decode steps of k3c's sequences `rids` (tokens toks[s0:s0+n]): the last step's logits."""
    out = None
    for s in range(s0, s0 + n):
        out = eng.extend(rids, [[int(t)] for t in toks[s, :len(rids)].tolist()])
    return torch.stack([o[-1] for o in out])


@dataclass
class DecodeBatch:
    """One decode batch size's comparison: its JSON row, the random cache every peer starts from, the decode tokens,
    and each peer's first-step logits (k3c's and the graph's are compared with eager's)."""
    B: int
    rec: dict
    cache: object
    toks: torch.Tensor
    firsts: dict


def time_k3c_decode(b: Bench, d: DecodeBatch) -> None:
    from k3c.reference.kda import KDAState

    eng, rec = b.eng, d.rec
    ctx = [0] * b.cached
    rids = [eng.adopt(ctx, {i: KDAState(c.state[j:j + 1], tuple(t[j:j + 1] for t in c.conv))
                            for i, c in enumerate(d.cache.layers) if isinstance(c, KDAState)},
                      {i: c[j] for i, c in enumerate(d.cache.layers) if not isinstance(c, KDAState)})
            for j in range(d.B)]
    try:
        d.firsts["k3c"] = k3c_steps(eng, rids, d.toks, 1)   # warm-up step (JIT), also compared with the eager step
        k3c_steps(eng, rids, d.toks, 1, 1)                  # 2nd step: with graphs on, this batch size's capture
        b.timer.sync()
        t0 = time.perf_counter()
        k3c_steps(eng, rids, d.toks, b.steps, 2)
        b.timer.sync()
        rec["k3c_ms_per_step"] = (time.perf_counter() - t0) * 1e3 / b.steps
        rec["mla_modes"] = {str(k): v for k, v in eng.last_modes.items()}
    finally:
        for r in rids:
            eng.finish(r)


def time_k3c_graph_decode(b: Bench, d: DecodeBatch) -> None:
    """The same decode through k3c's CUDA-graph step (runtime/cuda_graph.py): the engine's compiled graph, static
    buffers loaded with the same random cache, one length bucket holding every step."""
    from k3c.reference.kda import KDAState
    from k3c.runtime.cuda_graph import DecodeGraph

    rec, toks, steps = d.rec, d.toks, b.steps
    ps = b.eng.pool.page_size
    cap = -(-(b.cached + steps + 2) // ps) * ps
    dg = DecodeGraph(b.model, b.eng.graph, batch=d.B, capacity=cap, device=b.args.device, dtype=b.dtype,
                     buckets=[cap], use_kernels=b.use_kernels)
    dg.load_state({i: c for i, c in enumerate(d.cache.layers) if isinstance(c, KDAState)},
                  {i: c for i, c in enumerate(d.cache.layers) if not isinstance(c, KDAState)},
                  [b.cached] * d.B)
    t0 = time.perf_counter()
    d.firsts["graph"] = dg.step(toks[0, :d.B]).clone()          # capture (after warm-ups) + the first step
    b.timer.sync()
    rec["k3c_graph_capture_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        dg.step(toks[s, :d.B])
    b.timer.sync()
    rec["k3c_graph_ms_per_step"] = (time.perf_counter() - t0) * 1e3 / steps
    rec["k3c_graph_mode"] = dg.report.mode + (f" ({dg.report.reason})" if dg.report.mode != "graph" else "")


def time_eager_decode(b: Bench, d: DecodeBatch, ref_dec) -> None:
    rec, firsts = d.rec, d.firsts
    firsts["eager"] = ref_steps(ref_dec.forward, d.cache, d.toks, 1)
    if "k3c" in firsts:
        rec["rel_err_first_step_vs_eager"] = rel(firsts["k3c"], firsts["eager"])
    if "graph" in firsts:
        rec["rel_err_graph_first_step_vs_eager"] = rel(firsts["graph"], firsts["eager"])
    b.timer.sync()
    t0 = time.perf_counter()
    ref_steps(ref_dec.forward, d.cache, d.toks, b.peer_steps)
    b.timer.sync()
    rec["eager_ms_per_step"] = (time.perf_counter() - t0) * 1e3 / b.peer_steps


def compare_decode_batch(b: Bench, B: int, toks: torch.Tensor, ref_dec) -> dict:
    """Decode phases of batch B: k3c, its CUDA-graph step (on CUDA with kernels, or --graph; not with --no-graph),
    the eager reference (if B is one of --eager-decode-batches); returns the batch's JSON row."""
    rec = {"batch": B, "cached": b.cached, "steps": b.steps, "peer_steps": b.peer_steps}
    b.result["decode"].append(rec)
    d = DecodeBatch(B, rec, random_cache(b, B), toks, {})
    args = b.args
    b.phase(f"decode_b{B}_k3c", lambda: time_k3c_decode(b, d))
    if (b.cuda and not args.no_kernels or args.graph) and not args.no_graph:
        b.phase(f"decode_b{B}_k3c_graph", lambda: time_k3c_graph_decode(b, d))
    if not args.skip_eager and B in b.eager_batches:
        b.phase(f"decode_b{B}_eager", lambda: time_eager_decode(b, d, ref_dec))
    if b.cuda:
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    b.save()
    return rec


def compare_decode(b: Bench):
    """Every --batches decode comparison; returns the eager decode reference, the decode tokens and each batch size's
    JSON row, which the compiled peer reuses."""
    from k3c.reference import ReferenceModel

    ref_dec = ReferenceModel(b.spec, b.w, mla_mode="mqa")
    toks = torch.randint(0, b.spec.vocab_size, (max(b.steps, b.peer_steps) + 4, max(b.batches)),
                         device=b.args.device)
    recs = {B: compare_decode_batch(b, B, toks, ref_dec) for B in b.batches}
    return ref_dec, toks, recs


# -- torch.compile peer -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def compilable_reference(args):
    """The reference made compilable, for the duration of the compiled peer. Its expert loop iterates over
    .tolist() of the routing (data-dependent): compiled as is, every new expert set recompiles the frame until the
    recompile limit; it runs eagerly inside the compiled graph (or as grouped GEMMs, --compile-moe grouped). The KDA
    chunk loop (T / 64 iterations a layer) would be unrolled into one huge graph (the first full-size run was still in
    inductor after 6 min): the loop runs eagerly and its body, one chunk, is compiled once."""
    from k3c.reference import kda as ref_kda
    from k3c.reference import moe as ref_moe
    import torch._dynamo as dynamo

    eager_experts = ref_moe.routed_experts
    eager_chunked, eager_step = ref_kda.kda_chunked, ref_kda.kda_chunk_step
    ref_moe.routed_experts = grouped_experts if args.compile_moe == "grouped" else \
        torch.compiler.disable(eager_experts)
    ref_kda.kda_chunked = torch.compiler.disable(eager_chunked)
    ref_kda.kda_chunk_step = torch.compile(eager_step, dynamic=False, backend=args.compile_backend)
    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    try:
        yield
    finally:
        ref_moe.routed_experts = eager_experts
        ref_kda.kda_chunked, ref_kda.kda_chunk_step = eager_chunked, eager_step


def time_compiled_prefill(b: Bench, cfwd, ids: torch.Tensor, k3c_logits: torch.Tensor | None) -> None:
    pre = b.result["prefill"]
    c0 = dynamo_counts()
    t = time.perf_counter()
    ref_prefill(cfwd, ids, b.args.ref_chunk)()          # compile (+ the first run)
    b.timer.sync()
    pre["compiled_warmup_s"] = time.perf_counter() - t
    c1 = dynamo_counts()
    t, out = b.timer(ref_prefill(cfwd, ids, b.args.ref_chunk), b.reps)
    pre["compiled_ms"] = t * 1e3
    if k3c_logits is not None:
        pre["rel_err_compiled_vs_k3c"] = rel(out, k3c_logits)
    pre["compiled_dynamo"] = {"warmup": count_delta(c0, c1), "timed": count_delta(c1, dynamo_counts())}


def time_compiled_decode(b: Bench, cdec, rec: dict, cache, toks: torch.Tensor) -> None:
    c0 = dynamo_counts()
    t = time.perf_counter()
    ref_steps(cdec, cache, toks, 2)                      # compile (cache lengths vary: dynamic shapes)
    b.timer.sync()
    rec["compiled_warmup_s"] = time.perf_counter() - t
    c1 = dynamo_counts()
    t = time.perf_counter()
    ref_steps(cdec, cache, toks, b.peer_steps)
    b.timer.sync()
    rec["compiled_ms_per_step"] = (time.perf_counter() - t) * 1e3 / b.peer_steps
    rec["compiled_dynamo"] = {"warmup": count_delta(c0, c1), "timed": count_delta(c1, dynamo_counts())}


def compiled_decode_batch(b: Bench, cdec, B: int, rec: dict, toks: torch.Tensor) -> None:
    """The compiled peer's decode phase of batch B, from the same random cache as the other peers."""
    cache = random_cache(b, B)
    b.phase(f"decode_b{B}_compiled", lambda: time_compiled_decode(b, cdec, rec, cache, toks))
    if b.cuda:
        rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    b.save()


def compiled_peer(b: Bench, ids: torch.Tensor, k3c_logits: torch.Tensor | None, ref_dec, toks: torch.Tensor,
                  recs: dict) -> None:
    """torch.compile of the reference, last (its compile time is the largest and least predictable cost): the same
    prefill and decode batches, filling in the prefill's and each batch's JSON row."""
    with compilable_reference(b.args):
        cfwd = torch.compile(b.ref_pre.forward, dynamic=True, backend=b.args.compile_backend)
        b.phase("prefill_compiled", lambda: time_compiled_prefill(b, cfwd, ids, k3c_logits))
        cdec = torch.compile(ref_dec.forward, dynamic=True, backend=b.args.compile_backend)
        for B in b.batches:
            compiled_decode_batch(b, cdec, B, recs[B], toks)


# -- report -----------------------------------------------------------------------------------------------------

def ratio(peer, ours) -> str:
    return f"{peer / ours:.2f}x" if peer and ours else "n/a"


def print_summary(b: Bench) -> None:
    """The table (k3c, eager and compiled times and their ratios per phase), then failed peers and skipped phases."""
    result, prompt_len = b.result, b.prompt_len
    nan = float("nan")
    print(f"{b.spec.name} on {result['gpu'] or b.args.device}, {result['dtype']}; k3c: {result['k3c_executor']}")
    print(f"{'phase':28s} {'k3c ms':>10s} {'eager ms':>10s} {'compile ms':>11s} {'vs eager':>9s} {'vs compile':>11s}"
          f" {'k3c tok/s':>11s} {'rel err':>9s}")
    p = result["prefill"]
    if "k3c_ms" in p:
        print(f"{'prefill ' + str(prompt_len):28s} {p['k3c_ms']:10.2f} {p.get('eager_ms', nan):10.2f} "
              f"{p.get('compiled_ms', nan):11.2f} {ratio(p.get('eager_ms'), p['k3c_ms']):>9s} "
              f"{ratio(p.get('compiled_ms'), p['k3c_ms']):>11s} {prompt_len / p['k3c_ms'] * 1e3:11.1f} "
              f"{p.get('rel_err_last_logits_vs_eager', nan):9.2e}")
    for d in result["decode"]:
        if "k3c_ms_per_step" not in d:
            continue
        print(f"{'decode b' + str(d['batch']) + ' @' + str(d['cached']):28s} {d['k3c_ms_per_step']:10.2f} "
              f"{d.get('eager_ms_per_step', nan):10.2f} {d.get('compiled_ms_per_step', nan):11.2f} "
              f"{ratio(d.get('eager_ms_per_step'), d['k3c_ms_per_step']):>9s} "
              f"{ratio(d.get('compiled_ms_per_step'), d['k3c_ms_per_step']):>11s} "
              f"{d['batch'] / d['k3c_ms_per_step'] * 1e3:11.1f} {d.get('rel_err_first_step_vs_eager', nan):9.2e}")
        if "k3c_graph_ms_per_step" in d:
            g = d["k3c_graph_ms_per_step"]
            print(f"{'  same, CUDA graph':28s} {g:10.2f} {d.get('eager_ms_per_step', nan):10.2f} "
                  f"{d.get('compiled_ms_per_step', nan):11.2f} {ratio(d.get('eager_ms_per_step'), g):>9s} "
                  f"{ratio(d.get('compiled_ms_per_step'), g):>11s} {d['batch'] / g * 1e3:11.1f} "
                  f"{d.get('rel_err_graph_first_step_vs_eager', nan):9.2e}  [{d['k3c_graph_mode'][:70]}]")
    for k, v in result["errors"].items():
        print(f"peer failed: {k}: {v}")
    if result["skipped"]:
        print(f"skipped (deadline): {', '.join(result['skipped'])}")


def run(argv=None) -> dict:
    """The whole bench (see the module docstring); returns the JSON's dict."""
    b = setup(parse_settings(argv))
    if b.args.check_len:
        probe_numerics(b)
    if b.args.probe_only:
        return b.result
    ids, k3c_logits = compare_prefill(b)
    ref_dec, toks, recs = compare_decode(b)
    if not b.args.skip_compiled:
        compiled_peer(b, ids, k3c_logits, ref_dec, toks, recs)
    print_summary(b)
    b.save()
    return b.result


def main(argv=None) -> int:
    run(argv)
    return 0


def numerics_probe_cli(argv) -> dict:
    """The numerics probe alone, with e2e's command-line options (tests, investigations)."""
    return run([*argv, "--probe-only"])["numerics"]


if __name__ == "__main__":
    sys.exit(main())
