"""`k3c plan`'s roofline against measured runs: for every measured configuration in the checked-in H200 JSONs
(bench/dist.py sweeps, bench/e2e.py, bench/decode_graph.py), the plan of the same model, target, layout, batch and
context, and measured / planned tokens/s. The plan is a roofline (compulsory traffic, peak rates, communication
at link bandwidth, not overlapped), so the ratio is the fraction of it the code reaches: what to multiply a plan's
tokens/s by to expect a real figure on that hardware. The last line prints the range as the target table's
`plan_fraction` (k3c/codegen/targets.py), which `k3c plan` uses for its "expected on <target>" line. CPU only.

    python bench/plan_check.py                                   # every source below
    python bench/plan_check.py --sources bench/dist-h200x2-b32.json --json plan-check.json

Sources and how each maps to a plan:
  dist (config.batch, prompt_len, decode; layouts TP x EP): prefill = `batch` prompts of prompt_len
    (chunk = prompt_len); decode at the mean context of the timed steps (prompt_len + decode / 2); the slower
    rank's tokens/s; the plan of rank 0's sharded IR (`plan(..., sharded=True)`).
  e2e (args.prompt_len, cached, decode rows): one prompt of prompt_len; decode per batch at `cached`, the engine's
    graph replay (k3c_graph_ms_per_step).
  decode profile (cached, rows): decode per batch at `cached`, graph replay (graph_ms).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("bench/dist-h200x2.json", "bench/dist-h200x2-b32.json", "bench/e2e-h200-compile.json",
           "bench/decode-profile-h200.json")
SPECS = {"k3-wide": "examples/k3-wide.yaml"}


def _rows_of(path: str, data: dict) -> list[dict]:
    """Measured points: {source, spec, tp, ep, phase, batch, context, chunk, tok_s}."""
    name = os.path.relpath(path, ROOT) if os.path.isabs(path) else path
    if "layouts" in data:                                       # bench/dist.py
        c = data["config"]
        spec, b, p, steps = c["spec"], c["batch"], c["prompt_len"], c["decode"]
        out = []
        for lay in data["layouts"]:
            if "ranks" not in lay or lay.get("dtype", c["dtype"]) != c["dtype"]:
                continue
            pre = min(r["prefill_tok_s"] for r in lay["ranks"])
            dec = min(r["decode_tok_s"] for r in lay["ranks"])
            base = dict(source=name, spec=spec, tp=lay["tp"], ep=lay["ep"], batch=b)
            out.append({**base, "phase": "prefill", "context": p, "chunk": p, "tok_s": pre})
            out.append({**base, "phase": "decode", "context": p + steps // 2, "chunk": p, "tok_s": dec})
        return out
    spec = SPECS.get(data.get("spec"), data.get("spec"))
    if "prefill" in data and "decode" in data:                  # bench/e2e.py
        a = data["args"]
        out = [dict(source=name, spec=a["spec"], tp=1, ep=1, batch=1, phase="prefill", context=a["prompt_len"],
                    chunk=a["prompt_len"], tok_s=data["prefill"]["tokens"] / (data["prefill"]["k3c_ms"] / 1e3))]
        for d in data["decode"]:
            ms = d.get("k3c_graph_ms_per_step") or d["k3c_ms_per_step"]
            out.append(dict(source=name, spec=a["spec"], tp=1, ep=1, batch=d["batch"], phase="decode",
                            context=d["cached"], chunk=a["prompt_len"], tok_s=d["batch"] / (ms / 1e3)))
        return out
    if "rows" in data and "cached" in data:                     # bench/decode_graph.py
        return [dict(source=name, spec=spec, tp=1, ep=1, batch=r["batch"], phase="decode", context=data["cached"],
                     chunk=data["cached"], tok_s=r["batch"] / (r["graph_ms"] / 1e3)) for r in data["rows"]]
    raise SystemExit(f"bench/plan_check.py: {path}: not a bench/dist.py, e2e.py or decode_graph.py JSON")


def check(sources, target: str = "h200") -> list[dict]:
    from k3c.analysis import plan

    plans: dict[tuple, dict] = {}
    out = []
    for path in sources:
        full = path if os.path.isabs(path) else os.path.join(ROOT, path)
        try:
            with open(full, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"bench/plan_check.py: {path}: {exc}") from None
        for row in _rows_of(path, data):
            spec = row["spec"] if os.path.isabs(row["spec"]) else os.path.join(ROOT, row["spec"])
            key = (spec, row["tp"], row["ep"], row["batch"], row["context"], row["chunk"])
            if key not in plans:
                p = plan(spec, target, tp=row["tp"], ep=row["ep"], context=row["context"], batch=row["batch"],
                         prefill_chunk=row["chunk"], sharded=row["tp"] * row["ep"] > 1).to_dict()
                plans[key] = p["phases"]
            ph = plans[key][row["phase"]]
            out.append({**row, "plan_tok_s": ph["tokens_per_s"], "plan_comm_s": ph["comm_seconds"],
                        "ratio": row["tok_s"] / ph["tokens_per_s"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sources", nargs="+", default=list(SOURCES))
    ap.add_argument("--target", default="h200")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = check(args.sources, args.target)
    print(f"k3c plan ({args.target}) against measured tokens/s")
    print("| source | layout | phase | batch | context | measured tok/s | plan tok/s | measured / plan |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {os.path.basename(r['source'])} | TP {r['tp']} x EP {r['ep']} | {r['phase']} | {r['batch']} | "
              f"{r['context']:,} | {r['tok_s']:,.1f} | {r['plan_tok_s']:,.1f} | {r['ratio']:.0%} |")
    shares = []
    for phase in ("prefill", "decode"):
        rs = [r["ratio"] for r in rows if r["phase"] == phase]
        if rs:
            print(f"{phase}: measured / plan {min(rs):.0%} - {max(rs):.0%} over {len(rs)} points")
            shares.append((phase, math.floor(min(rs) * 100) / 100, math.ceil(max(rs) * 100) / 100))
    # what `k3c plan` multiplies its rate by for "expected on <target>" (k3c/codegen/targets.py)
    print(f"target table: {args.target} plan_fraction={tuple(shares)!r}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"target": args.target, "rows": rows}, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
