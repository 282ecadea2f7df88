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
over k3c time (the issue's targets: prefill >= 1.5x, decode >= 3x).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_weights(spec, module, device, dtype, seed: int = 0, reference: bool = True) -> dict[str, torch.Tensor]:
    """Random weights on the device: large matrices drawn there (scaled 1/sqrt(fan-in) as k3c.init_weights does),
    small ones from k3c's initialiser; MXFP4 experts as packed tensors (what the graph reads) plus, with
    `reference`, their exact dequantized values (what the reference reads; 59 GB at k3-wide)."""
    from k3c.quant.mx import mxfp4_dequantize
    from k3c.runtime.weight_names import model_weights
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="examples/k3-wide.yaml")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--prompt-len", type=int, help="prefill tokens (cuda 8192, cpu 256)")
    ap.add_argument("--cached", type=int, help="cached tokens per sequence for decode (cuda 8192, cpu 256)")
    ap.add_argument("--batches", help="decode batch sizes, comma separated (cuda 1,32, cpu 1,4)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (cuda 16, cpu 3)")
    ap.add_argument("--reps", type=int, default=None, help="timed prefill repetitions (cuda 3, cpu 1)")
    ap.add_argument("--ref-chunk", type=int, default=2048, help="reference prefill chunk (append path)")
    ap.add_argument("--no-kernels", action="store_true", help="k3c with every op through torch")
    ap.add_argument("--skip-compiled", action="store_true", help="no torch.compile peer")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the peer (inductor; aot_eager checks the plumbing on a CPU)")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    prompt_len = args.prompt_len or (8192 if cuda else 256)
    cached = args.cached or (8192 if cuda else 256)
    batches = [int(b) for b in (args.batches or ("1,32" if cuda else "1,4")).split(",")]
    steps = args.steps or (16 if cuda else 3)
    reps = args.reps or (3 if cuda else 1)

    import k3c
    from k3c.runtime.engine import Engine
    from k3c.runtime.reference import ReferenceModel
    from k3c.runtime.reference.kda import KDAState
    from k3c.runtime.reference.model import ReferenceCache

    torch.manual_seed(0)
    spec = k3c.load_spec(args.spec)
    model = k3c.compile(spec, target="h200" if cuda else "cpu")
    t0 = time.perf_counter()
    w = make_weights(spec, model.module, args.device, dtype)
    print(f"weights: {sum(t.numel() * t.element_size() for t in w.values()) / 2**30:.1f} GiB generated in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    timer = Timer(args.device)
    use_kernels = not args.no_kernels
    errors: dict[str, str] = {}
    result = {"spec": spec.name, "device": args.device, "dtype": str(dtype).replace("torch.", ""),
              "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
              "k3c_kernels": use_kernels, "compile_backend": None if args.skip_compiled else args.compile_backend,
              "prefill": {}, "decode": [], "errors": errors}

    # -- prefill ------------------------------------------------------------------------------------------------
    ids = torch.randint(0, spec.vocab_size, (1, prompt_len), device=args.device)
    from k3c.codegen.launch import target_for

    ctx_max = max(prompt_len, cached + steps + 2)
    ps = target_for(args.device).mla_page_size
    eng = Engine(model, w, device=args.device, max_batch=max(batches), max_context=ctx_max,
                 num_pages=max(batches) * -(-ctx_max // ps) + 1, page_size=ps, use_kernels=use_kernels)
    result["k3c_executor"] = eng.describe()
    progress("engine built")

    def k3c_prefill():
        rid = eng.open()
        out = eng.extend([rid], [ids[0]])[0]
        eng.finish(rid)
        return out

    ref_pre = ReferenceModel(spec, w, mla_mode="mha")

    def ref_prefill(fwd):
        def run():
            cache, outs = None, []
            with torch.no_grad():
                for s in range(0, prompt_len, args.ref_chunk):
                    logits, cache = fwd(ids[:, s:s + args.ref_chunk], cache)
                    outs.append(logits[:, -1])
            return outs[-1][0]
        return run

    pre = result["prefill"]
    pre["tokens"] = prompt_len
    t_k3c, out_k3c = timer(k3c_prefill, reps)
    pre["k3c_ms"], pre["mla_modes"] = t_k3c * 1e3, {str(k): v for k, v in eng.last_modes.items()}
    t_ref, out_ref = timer(ref_prefill(ref_pre.forward), reps)
    pre["eager_ms"] = t_ref * 1e3
    pre["rel_err_last_logits_vs_eager"] = rel(out_k3c[-1], out_ref)
    if not args.skip_compiled:
        # the reference's expert loop iterates over .tolist() of the routing (data-dependent): compiled as is, every
        # new expert set recompiles the frame until the recompile limit; run it eagerly inside the compiled graph
        from k3c.runtime.reference import moe as ref_moe

        ref_moe.routed_experts = torch.compiler.disable(ref_moe.routed_experts)
        cfwd = torch.compile(ref_pre.forward, dynamic=True, backend=args.compile_backend)
        got = guarded("compiled_prefill", lambda: timer(ref_prefill(cfwd), reps), errors)
        if got:
            pre["compiled_ms"] = got[0] * 1e3
    if cuda:
        pre["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del out_k3c, out_ref

    # -- decode -------------------------------------------------------------------------------------------------
    ref_dec = ReferenceModel(spec, w, mla_mode="mqa")
    cfg, mcfg = spec.kda, spec.mla
    for B in batches:
        g = torch.Generator(device=args.device).manual_seed(B)
        layers = []
        for kind in spec.layer_kinds:
            if kind == "kda":
                st = 0.05 * torch.randn(B, cfg.num_heads, cfg.head_dim, cfg.head_dim, generator=g, device=args.device)
                tails = tuple(torch.randn(B, cfg.width, cfg.conv_kernel - 1, generator=g, device=args.device
                                          ).to(dtype) for _ in range(3))
                layers.append(KDAState(st, tails))
            else:
                layers.append(torch.randn(B, cached, mcfg.kv_lora_rank + mcfg.qk_rope_head_dim, generator=g,
                                          device=args.device).to(dtype))
        ref_cache = ReferenceCache(tuple(layers), cached)
        toks = torch.randint(0, spec.vocab_size, (steps + 1, B), device=args.device)
        ctx = [0] * cached
        rids = [eng.adopt(ctx, {i: KDAState(c.state[b:b + 1], tuple(t[b:b + 1] for t in c.conv))
                                for i, c in enumerate(layers) if isinstance(c, KDAState)},
                          {i: c[b] for i, c in enumerate(layers) if not isinstance(c, KDAState)})
                for b in range(B)]
        rec = {"batch": B, "cached": cached, "steps": steps}

        def k3c_steps(n):
            out = None
            for s in range(n):
                out = eng.extend(rids, [[int(t)] for t in toks[s].tolist()])
            return torch.stack([o[-1] for o in out])

        first = k3c_steps(1)                             # warm-up step, also the numerics probe
        timer.sync()
        t0 = time.perf_counter()
        k3c_steps(steps)
        timer.sync()
        rec["k3c_ms_per_step"] = (time.perf_counter() - t0) * 1e3 / steps
        rec["mla_modes"] = {str(k): v for k, v in eng.last_modes.items()}
        for r in rids:
            eng.finish(r)

        def ref_steps(fwd, n, cache=ref_cache):
            out = None
            with torch.no_grad():
                for s in range(n):
                    out, cache = fwd(toks[s][:, None], cache)
            return out[:, -1]

        ref_first = ref_steps(ref_dec.forward, 1)
        rec["rel_err_first_step_vs_eager"] = rel(first, ref_first)
        timer.sync()
        t0 = time.perf_counter()
        ref_steps(ref_dec.forward, steps)
        timer.sync()
        rec["eager_ms_per_step"] = (time.perf_counter() - t0) * 1e3 / steps
        if not args.skip_compiled:
            cdec = torch.compile(ref_dec.forward, dynamic=True, backend=args.compile_backend)

            def compiled():
                ref_steps(cdec, 3)                       # compile (cache lengths vary: dynamic shapes)
                timer.sync()
                t = time.perf_counter()
                ref_steps(cdec, steps)
                timer.sync()
                return (time.perf_counter() - t) * 1e3 / steps
            ms = guarded(f"compiled_decode_b{B}", compiled, errors)
            if ms is not None:
                rec["compiled_ms_per_step"] = ms
        if cuda:
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["decode"].append(rec)
        del ref_cache, layers

    # -- report -------------------------------------------------------------------------------------------------
    def ratio(peer, ours):
        return f"{peer / ours:.2f}x" if peer and ours else "n/a"

    print(f"{spec.name} on {result['gpu'] or args.device}, {result['dtype']}; k3c: {result['k3c_executor']}")
    print(f"{'phase':28s} {'k3c ms':>10s} {'eager ms':>10s} {'compile ms':>11s} {'vs eager':>9s} {'vs compile':>11s}"
          f" {'k3c tok/s':>11s} {'rel err':>9s}")
    p = result["prefill"]
    print(f"{'prefill ' + str(prompt_len):28s} {p['k3c_ms']:10.2f} {p['eager_ms']:10.2f} "
          f"{p.get('compiled_ms', float('nan')):11.2f} {ratio(p['eager_ms'], p['k3c_ms']):>9s} "
          f"{ratio(p.get('compiled_ms'), p['k3c_ms']):>11s} {prompt_len / p['k3c_ms'] * 1e3:11.1f} "
          f"{p['rel_err_last_logits_vs_eager']:9.2e}")
    for d in result["decode"]:
        print(f"{'decode b' + str(d['batch']) + ' @' + str(d['cached']):28s} {d['k3c_ms_per_step']:10.2f} "
              f"{d['eager_ms_per_step']:10.2f} {d.get('compiled_ms_per_step', float('nan')):11.2f} "
              f"{ratio(d['eager_ms_per_step'], d['k3c_ms_per_step']):>9s} "
              f"{ratio(d.get('compiled_ms_per_step'), d['k3c_ms_per_step']):>11s} "
              f"{d['batch'] / d['k3c_ms_per_step'] * 1e3:11.1f} {d['rel_err_first_step_vs_eager']:9.2e}")
    print(f"MLA modes (k3c, per layer): prefill {p['mla_modes']}; decode {result['decode'][-1]['mla_modes']}")
    for k, v in errors.items():
        print(f"peer failed: {k}: {v}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
