"""The compiled graph (generated Triton kernels + extern ops) against k3c.reference_forward on the device at hand.

    python bench/compiled_vs_reference.py [--spec examples/k3-tiny.yaml] [--device cuda] [--per-op] [--out result.json]

Prints, for prefill and each decode step, the relative error ||compiled - ref|| / ||ref|| of the logits against
(a) the reference in the same dtype and (b) the fp32 reference on the same (rounded) weights, plus the same run with
kernels off (every op through torch) so the kernels' own share of the error is visible. Also times prefill/decode.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="examples/k3-tiny.yaml")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=67)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--passes", help="comma-separated pass list (default: the default pipeline)")
    ap.add_argument("--per-op", action="store_true",
                    help="also compare every kernel op with its torch implementation on the same inputs")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import k3c
    from k3c.reference import ReferenceModel

    dtype = getattr(torch, args.dtype)
    spec = k3c.load_spec(args.spec)
    target = "h200" if args.device.startswith("cuda") else "cpu"
    model = k3c.compile(spec, target=target, passes=args.passes.split(",") if args.passes else None)
    from k3c.frontend.weight_names import weight_table

    table = weight_table(spec)
    base = k3c.init_weights(spec, seed=0)
    # the model's weights in `dtype` (fp32-kind entries stay fp32), and an fp32 copy of exactly those values
    w = {k: (v if table[k].dtype == "fp32" else v.to(dtype)).to(args.device) for k, v in base.items()}
    w32 = {k: v.float() for k, v in w.items()}
    g = torch.Generator().manual_seed(0)
    total = args.prompt_len + args.decode
    ids = torch.randint(0, spec.vocab_size, (args.batch, total), generator=g).to(args.device)
    with torch.no_grad():
        ref_same = ReferenceModel(spec, w).prefill(ids)[0]
        ref_fp32 = ReferenceModel(spec, w32).prefill(ids)[0]

    rows, result = [], {"spec": spec.name, "device": args.device, "dtype": args.dtype,
                        "impls": {}, "steps": []}
    for use_kernels in (True, False):
        sess = model.session(w, device=args.device, max_batch=args.batch, max_context=total,
                             use_kernels=use_kernels)
        result["impls"]["kernels" if use_kernels else "torch"] = sess.describe()
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        # warm-up: load / JIT every kernel of both phases, including Triton's specialisations of the decode shapes
        sess.prefill(ids[:, :args.prompt_len])
        for i in range(min(3, args.decode)):
            sess.decode(ids[:, args.prompt_len + i])
        sync()
        t0 = time.perf_counter()
        out = sess.prefill(ids[:, :args.prompt_len])
        sync()
        t_prefill = time.perf_counter() - t0
        steps = [("prefill", out, slice(0, args.prompt_len))]
        t_dec = 0.0
        for i in range(args.decode):
            t = args.prompt_len + i
            t0 = time.perf_counter()
            step = sess.decode(ids[:, t])
            sync()
            t_dec += time.perf_counter() - t0
            steps.append((f"decode {i + 1}", step[:, None], slice(t, t + 1)))
        for name, got, sl in steps:
            rec = {"run": "kernels" if use_kernels else "torch", "step": name,
                   "rel_vs_ref_same_dtype": rel(got, ref_same[:, sl]), "rel_vs_ref_fp32": rel(got, ref_fp32[:, sl]),
                   "finite": bool(torch.isfinite(got.float()).all())}
            result["steps"].append(rec)
            rows.append(rec)
        result[f"prefill_ms_{'kernels' if use_kernels else 'torch'}"] = t_prefill * 1e3
        result[f"decode_ms_per_step_{'kernels' if use_kernels else 'torch'}"] = t_dec * 1e3 / max(1, args.decode)

    print(f"{spec.name} on {args.device} ({args.dtype}), batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.decode} decodes; reference in {args.dtype} and in fp32 on the same rounded weights")
    for k, v in result["impls"].items():
        print(f"  {k:8s}: {v}")
    print(f"  {'run':8s} {'step':10s} {'vs ref (same dtype)':>20s} {'vs ref fp32':>12s} finite")
    for r in rows:
        print(f"  {r['run']:8s} {r['step']:10s} {r['rel_vs_ref_same_dtype']:20.3e} {r['rel_vs_ref_fp32']:12.3e} "
              f"{r['finite']}")
    for k in ("prefill_ms_kernels", "prefill_ms_torch", "decode_ms_per_step_kernels", "decode_ms_per_step_torch"):
        print(f"  {k}: {result[k]:.2f}")
    if args.per_op:
        from k3c.runtime.opcheck import check_ops, format_report, summarize

        errors = check_ops(model, w, ids[:, :args.prompt_len + 2], decode_steps=2, device=args.device)
        print("per-op relative error, kernel vs torch on the same inputs:")
        print(format_report(errors))
        result["per_op"] = [{"op": op, "phase": ph, "calls": n, "max_rel_err": worst, "finite": fin}
                            for (op, ph), (n, worst, fin) in sorted(summarize(errors).items())]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
