"""Cold start of `k3c run` on one GPU: a fresh process runs a compiled artifact, and the same with `--jit` (every
kernel JIT-compiled from source: the path before the loader) beside it.

    python bench/coldstart.py --artifact out/k3-wide-h200 --out bench/coldstart-h200.json       # one H200
    python bench/coldstart.py --artifact out/k3-wide-h200 --e2e --dist --out bench/coldstart-h200.json

Each mode (--modes, default artifact,jit) is one fresh process of
    k3c run ARTIFACT --device cuda --dtype bfloat16 --batch 8 --prompt-len 1024 --new-tokens 64 [--jit]
timed from the outside (total wall time: interpreter start, imports, weights, load, warm-up, timed pass, exit), its
report parsed (k3c/commands/run.py: weights, model, engine build and warm-up seconds, cold TTFT = model + engine
build + the first prefill, weights excluded, steady TTFT and prefill / decode tokens/s of the timed pass, the kernel
provenance line). Each process gets empty Triton and k3c caches (--keep-caches: the user's), so the JIT mode pays
what a first run pays. An absent artifact is compiled first (`k3c compile --spec --target`, timed apart, not part
of the cold start).

Steady-state references, in the same job, optional: --dist runs bench/dist.py's one-rank layout at exactly this
shape (batch x prompt-len prefill, new-tokens - 1 decode steps through CUDA graphs); --e2e runs bench/e2e.py's k3c
rows (prefill: one sequence of batch x prompt-len tokens, e2e's only prefill shape; decode: batch sequences at
prompt-len cached tokens). The steady-state check compares with dist when it ran, else e2e.

Targets (issue 18): total wall <= 20 s, cold TTFT <= 1.5 s, steady prefill and decode within 10% of the reference,
zero JIT compiles. Prints a table and writes JSON (rewritten after each process, so a time-out leaves numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"wall_s": 20.0, "cold_ttft_s": 1.5, "steady_ratio": 0.90, "jit": 0}
_NUM = r"([\d,]+(?:\.\d+)?)"


def _num(text: str | None) -> float | None:
    return None if text is None else float(text.replace(",", ""))


def _field(text: str, label: str, unit: str) -> float | None:
    """The number after `  label:` (at the start of a report line) followed by `unit`, or None."""
    m = re.search(rf"^\s+{re.escape(label)}:\s+{_NUM} {re.escape(unit)}", text, re.M)
    return _num(m.group(1)) if m else None


def parse_report(text: str) -> dict:
    """The fields of a `k3c run` report (None where a line is absent or says none / skipped)."""
    ms = {k: _field(text, label, "ms") for k, label in (("cold_ttft_ms", "cold TTFT"), ("ttft_ms", "TTFT"))}
    out = {"weights_s": _field(text, "weights", "s"), "model_s": _field(text, "model", "s"),
           "engine_s": _field(text, "engine build", "s"), "warmup_s": _field(text, "warm-up", "s"),
           "warmup_skipped": bool(re.search(r"^\s+warm-up:\s+skipped", text, re.M)),
           "cold_ttft_s": None if ms["cold_ttft_ms"] is None else ms["cold_ttft_ms"] / 1e3,
           "ttft_ms": ms["ttft_ms"], "prefill_tok_s": _field(text, "prefill", "tokens/s"),
           "decode_tok_s": _field(text, "decode", "tokens/s"), "peak_mib": _field(text, "peak memory", "MiB"),
           "kernels": None}
    m = re.search(r"^\s+kernels:\s+(\d+) from the artifact's binaries \(load ([\d.]+) s\), (\d+) JIT-compiled "
                  r"\(([\d.]+) s\), (\d+) in the interpreter[^;]*; ([\d,]+) launches"
                  r"(?:; timed pass: (\d+) new JIT, (\d+) new binaries)?", text, re.M)
    if m:
        g = m.groups()
        out["kernels"] = {"binaries": int(g[0]), "load_s": float(g[1]), "jit": int(g[2]), "jit_s": float(g[3]),
                          "interpreted": int(g[4]), "launches": int(g[5].replace(",", "")),
                          "timed_new_jit": None if g[6] is None else int(g[6]),
                          "timed_new_binaries": None if g[7] is None else int(g[7])}
    m = re.search(r"^\s+model:\s+[\d.]+ s \((.*)\)$", text, re.M)
    out["model_source"] = m.group(1) if m else None
    return out


def run_command(args, mode: str) -> list[str]:
    cmd = [sys.executable, "-m", "k3c.cli", "run", args.artifact, "--device", args.device, "--dtype", args.dtype,
           "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    return cmd + ({"artifact": [], "jit": ["--jit"], "strict": ["--strict"]}[mode])


def _fresh_env(args, tmp: str) -> dict:
    env = dict(os.environ)
    if not args.keep_caches:
        for var in ("TRITON_CACHE_DIR", "K3C_CACHE_DIR"):
            env[var] = tempfile.mkdtemp(prefix=var.lower() + "-", dir=tmp)
    return env


def run_mode(args, mode: str, tmp: str) -> dict:
    """One fresh `k3c run` process: its wall time, exit status, the report's fields, the tail of stderr."""
    cmd = run_command(args, mode)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_fresh_env(args, tmp), timeout=args.timeout,
                           cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = None, exc.stdout or "", f"timed out after {args.timeout} s"
        out, err = (out.decode() if isinstance(out, bytes) else out), err
    rec = {"mode": mode, "command": " ".join(cmd), "rc": rc, "wall_s": time.perf_counter() - t0,
           **parse_report(out), "report": out, "stderr_tail": (err or "")[-3000:]}
    return rec


def _bench(args, name: str, extra: list[str], tmp: str) -> dict:
    """Another bench script in a fresh process, its JSON read back."""
    path = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), *extra, "--out", path]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        rc, err = p.returncode, p.stderr + p.stdout[-2000:]
    except subprocess.TimeoutExpired:
        rc, err = None, f"timed out after {args.timeout} s"
    data = None
    if os.path.isfile(path):
        with open(path) as fh:
            data = json.load(fh)
    return {"command": " ".join(cmd), "rc": rc, "wall_s": time.perf_counter() - t0, "data": data,
            "stderr_tail": (err or "")[-3000:]}


def e2e_rates(data: dict | None, batch: int) -> dict:
    """Steady k3c prefill / decode tokens/s from bench/e2e.py's JSON (decode: the row of `batch`)."""
    out = {"prefill_tok_s": None, "decode_tok_s": None}
    if not data:
        return out
    pre = data.get("prefill") or {}
    if pre.get("k3c_ms"):
        out["prefill_tok_s"] = pre["tokens"] / pre["k3c_ms"] * 1e3
    for d in data.get("decode") or []:
        if d.get("batch") == batch and d.get("k3c_ms_per_step"):
            out["decode_tok_s"] = batch / d["k3c_ms_per_step"] * 1e3
    return out


def dist_rates(data: dict | None) -> dict:
    """Steady prefill / decode tokens/s of bench/dist.py's first layout (rank 0)."""
    try:
        r0 = data["layouts"][0]["ranks"][0]
        return {"prefill_tok_s": r0["prefill_tok_s"], "decode_tok_s": r0["decode_tok_s"]}
    except (KeyError, IndexError, TypeError):
        return {"prefill_tok_s": None, "decode_tok_s": None}


def checks(run: dict, ref: dict | None) -> dict:
    """The issue's targets for one run: {name: (value, target, passed or None when unmeasured)}."""
    k = run.get("kernels") or {}
    out = {"wall_s": (run.get("wall_s"), TARGETS["wall_s"], None),
           "cold_ttft_s": (run.get("cold_ttft_s"), TARGETS["cold_ttft_s"], None),
           "jit": (k.get("jit"), TARGETS["jit"], None)}
    for name in ("prefill_tok_s", "decode_tok_s"):
        got, want = run.get(name), (ref or {}).get(name)
        out[f"{name}_vs_ref"] = (got / want if got and want else None, TARGETS["steady_ratio"], None)
    done = {}
    for name, (value, target, _) in out.items():
        ok = None if value is None or run.get("rc") != 0 else (value >= target if name.endswith("_vs_ref")
                                                               else value <= target)
        done[name] = {"value": value, "target": target, "passed": ok}
    return done


def _fmt(v, spec: str = ",.2f") -> str:
    return "n/a" if v is None else format(v, spec)


ROWS = (("exit status", "rc", "d"), ("total wall s", "wall_s", ",.1f"), ("weights s", "weights_s", ",.2f"),
        ("model (load) s", "model_s", ",.2f"), ("engine build s", "engine_s", ",.2f"),
        ("warm-up s", "warmup_s", ",.2f"), ("cold TTFT s (no weights)", "cold_ttft_s", ",.3f"),
        ("steady TTFT ms", "ttft_ms", ",.1f"), ("steady prefill tok/s", "prefill_tok_s", ",.1f"),
        ("steady decode tok/s", "decode_tok_s", ",.1f"), ("peak MiB", "peak_mib", ",.0f"))
KROWS = (("kernels from binaries", "binaries"), ("kernels JIT-compiled", "jit"), ("JIT seconds", "jit_s"),
         ("kernels interpreted", "interpreted"), ("JIT in the timed pass", "timed_new_jit"))


def table(result: dict) -> str:
    """Markdown table: one column per mode, then the references and the targets of the artifact run."""
    runs = result["runs"]
    lines = ["| | " + " | ".join(r["mode"] for r in runs) + " |", "|---|" + "---:|" * len(runs)]
    for label, key, spec in ROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt(r.get(key), spec) for r in runs) + " |")
    for label, key in KROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt((r.get("kernels") or {}).get(key), "g") for r in runs) + " |")
    for name, ref in result["references"].items():
        lines.append(f"\n{name} (steady reference): prefill {_fmt(ref.get('prefill_tok_s'), ',.1f')} tok/s, decode "
                     f"{_fmt(ref.get('decode_tok_s'), ',.1f')} tok/s")
    for mode, chk in result["checks"].items():
        parts = []
        for name, c in chk.items():
            verdict = {True: "ok", False: "MISSED", None: "n/a"}[c["passed"]]
            op = ">=" if name.endswith("_vs_ref") else "<="
            parts.append(f"{name} {_fmt(c['value'], '.3g')} {op} {c['target']:g}: {verdict}")
        lines.append(f"targets ({mode}): " + "; ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="artifact directory (compiled first when absent)")
    ap.add_argument("--spec", default="examples/k3-wide.yaml", help="spec to compile an absent artifact from")
    ap.add_argument("--target", default="h200", help="target to compile an absent artifact for (default h200)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--modes", default="artifact,jit", help="k3c run modes, comma separated, each a fresh process: "
                    "artifact (default policy), jit (--jit), strict (--strict)")
    ap.add_argument("--e2e", action="store_true", help="also bench/e2e.py's k3c rows, for the steady state")
    ap.add_argument("--dist", action="store_true", help="also bench/dist.py's one-rank layout at this very shape")
    ap.add_argument("--keep-caches", action="store_true", help="the user's Triton / k3c caches (default: empty "
                    "ones per process, what a first run meets)")
    ap.add_argument("--timeout", type=int, default=540, help="seconds per process (default 540)")
    ap.add_argument("--out", help="JSON file (rewritten after each process)")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("artifact", "jit", "strict")]
    if bad or not modes:
        ap.error(f"--modes: unknown mode(s) {', '.join(bad) or '(none given)'}")
    result = {"artifact": args.artifact, "spec": args.spec, "target": args.target, "device": args.device,
              "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "fresh_caches": not args.keep_caches, "targets": TARGETS,
              "compile": None, "runs": [], "references": {}, "checks": {}}

    def save():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=2)

    def progress(msg: str):
        print(f"[coldstart] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="k3c-coldstart-") as tmp:
        if not os.path.isfile(os.path.join(args.artifact, "manifest.json")):
            cmd = [sys.executable, "-m", "k3c.cli", "compile", args.spec, "--target", args.target, "-o",
                   args.artifact, "--force"]
            progress(f"compiling {args.artifact}: {' '.join(cmd)}")
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            result["compile"] = {"command": " ".join(cmd), "rc": p.returncode, "seconds": time.perf_counter() - t0,
                                 "stdout": p.stdout[-2000:], "stderr_tail": p.stderr[-3000:]}
            save()
            if p.returncode != 0:
                print(f"coldstart: compile failed (exit {p.returncode}): {p.stderr.strip()[-500:]}", file=sys.stderr)
                return 1
        for mode in modes:
            progress(f"{mode}: {' '.join(run_command(args, mode))}")
            rec = run_mode(args, mode, tmp)
            progress(f"{mode}: exit {rec['rc']}, {rec['wall_s']:.1f} s")
            result["runs"].append(rec)
            save()
        if args.dist:
            progress("bench/dist.py ...")
            d = _bench(args, "dist", ["--configs", "1x1", "--spec", args.spec, "--device", args.device, "--dtype",
                                      args.dtype, "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
                                      "--decode", str(max(1, args.new_tokens - 1))], tmp)
            result["dist"] = {k: v for k, v in d.items() if k != "data"}
            result["references"]["dist"] = dist_rates(d["data"])
            save()
        if args.e2e:
            progress("bench/e2e.py ...")
            d = _bench(args, "e2e", ["--spec", args.spec, "--device", args.device, "--dtype", args.dtype,
                                     "--prompt-len", str(args.batch * args.prompt_len), "--cached",
                                     str(args.prompt_len), "--batches", str(args.batch), "--steps",
                                     str(max(1, args.new_tokens - 1)), "--reps", "3", "--check-len", "0",
                                     "--skip-compiled", "--skip-eager", "--no-graph"], tmp)
            result["e2e"] = {k: v for k, v in d.items() if k != "data"}
            result["references"]["e2e"] = e2e_rates(d["data"], args.batch)
            save()
    refs = result["references"]
    ref = refs.get("dist") if refs.get("dist", {}).get("prefill_tok_s") else refs.get("e2e")
    result["checks"] = {r["mode"]: checks(r, ref) for r in result["runs"]}
    save()
    print(f"k3c run cold start: {args.artifact} on {args.device}, {args.dtype}, batch {args.batch} x prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens; {'empty' if not args.keep_caches else 'kept'} caches")
    print(table(result))
    for r in result["runs"]:
        if r["rc"] != 0:
            print(f"{r['mode']}: exit {r['rc']}: {r['stderr_tail'].strip()[-400:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
