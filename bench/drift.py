"""How a rounding difference grows through the model: the reference forward in a low precision (bf16) against
the same weights in fp32, sublayer by sublayer, with the fp32 run's expert choices replayed in the other run
(k3c.runtime.routing_replay), so that top-k flips are not what is measured. Prints each sublayer's input and
output relative error and the logits' error; a ratio above 1 per sublayer means this model amplifies rounding, and
no implementation's logits (sharded or not) can then sit closer to another's than the drift allows (docs/perf.md,
"Distributed").

    python bench/drift.py --spec examples/k3-tiny.yaml                 # CPU, seconds
    python bench/drift.py --spec tests/bench/k3-wide-small.yaml --len 128 --json drift.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(spec, seed, ids, dtype, replay):
    """(logits fp32, [(name, input, output)] per sublayer) of the reference forward in `dtype` (the same draw of the
    weights for every dtype; the fp32-only ones stay fp32, as a session loads them)."""
    import k3c
    from k3c.reference.model import ReferenceModel

    model = ReferenceModel(spec, k3c.init_weights(spec, seed=seed, dtype=dtype), choose_experts=replay.choose)
    rows = []
    attention, feed_forward = model.attention, model.feed_forward

    def att(i, h, cache):
        y, c = attention(i, h, cache)
        rows.append((f"layer {i} {spec.layer_kinds[i]}", h.float(), y.float()))
        return y, c

    def ff(i, h):
        y = feed_forward(i, h)
        rows.append((f"layer {i} ffn", h.float(), y.float()))
        return y

    model.attention, model.feed_forward = att, ff
    with torch.no_grad(), replay:
        logits = model.prefill(ids)[0].float()
    return logits, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="examples/k3-tiny.yaml")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--len", type=int, default=64, help="prompt tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-replay", action="store_true", help="let the low-precision run pick its own experts")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import k3c
    from k3c.errors import UserError
    from k3c.runtime.opcheck import rel_error as rel
    from k3c.runtime.routing_replay import RoutingReplay

    try:
        spec = k3c.load_spec(args.spec)
    except UserError as exc:
        print(f"bench/drift.py: {exc}", file=sys.stderr)
        return 2
    if args.batch < 1 or args.len < 1:
        raise SystemExit("bench/drift.py: --batch and --len must be positive")
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.len), generator=torch.Generator().manual_seed(args.seed))
    rec = RoutingReplay.record()
    truth, rows32 = _run(spec, args.seed, ids, torch.float32, rec)
    rep = RoutingReplay.record() if args.no_replay else RoutingReplay.replay(rec.routes)
    low, rows = _run(spec, args.seed, ids, getattr(torch, args.dtype), rep)
    table = [{"sublayer": n, "rel_err_in": rel(h, h32), "rel_err_out": rel(y, y32)}
             for (n, h32, y32), (_, h, y) in zip(rows32, rows)]
    out = {"spec": args.spec, "dtype": args.dtype, "batch": args.batch, "len": args.len, "replayed": not args.no_replay,
           "routing_flips": None if args.no_replay else rep.flips,
           "routing_decisions": None if args.no_replay else rep.decisions,
           "sublayers": table, "logits_rel_err": rel(low, truth)}
    first, last = table[0]["rel_err_in"], table[-1]["rel_err_out"]
    out["growth_per_sublayer"] = (last / first) ** (1 / len(table)) if first > 0 else None
    print(f"{args.spec}: {args.dtype} against fp32, batch {args.batch} x {args.len}, routing "
          f"{'free' if args.no_replay else f'replayed ({rep.flips} of {rep.decisions} choices would flip)'}")
    print("| sublayer | input rel err | output rel err |\n|---|---|---|")
    for r in table:
        print(f"| {r['sublayer']} | {r['rel_err_in']:.2e} | {r['rel_err_out']:.2e} |")
    g = out["growth_per_sublayer"]
    print(f"logits rel err {out['logits_rel_err']:.3e}; growth per sublayer {g:.2f}x" if g else
          f"logits rel err {out['logits_rel_err']:.3e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
