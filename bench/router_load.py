"""Expert load of the trained example model (examples/k3-stdlib) under its trained router biases and under the
biases `k3c calibrate-router` computes from recorded router scores.

    python bench/router_load.py [--tokens N] [--json OUT] [--model DIR] [--window T] [--iterations I] [--threads N]

Text: the held-out split of the stdlib corpus (tools/train_example.py), as bench/trained.py reads it (tokenized with
the model's tokenizer, documents joined by the EOS token), in two halves by file (alternate held-out files): the
first N tokens of one half are the RECORDED tokens, the first N of the other half the OTHER set. Both run through the
fp32 reference forward in non-overlapping windows of T tokens, each from a fresh context.

1. Record, on the recorded tokens, every MoE layer's router scores (sigmoid, before the bias) and the experts the
   router picked; write `layers.{i}.block_sparse_moe.gate.scores` and the trained
   `layers.{i}.block_sparse_moe.gate.e_score_correction_bias` to a safetensors file.
2. Run `k3c calibrate-router` on it (Quantile Balancing, --iterations steps).
3. Report per MoE layer max/mean expert load (1.0 = every expert gets k/E of the picks):
   - `recorded`: topk(s + b) over the recorded scores with the trained b and with the calibrated b: what
     calibrate-router optimizes, on fixed scores;
   - `rerun`: the model run again with the calibrated biases on the same tokens: a layer's scores move with the
     routing of the MoE layers before it, so this is the load the calibrated model really has;
   - `other`: the other set through the model with the trained and with the calibrated biases.
   And the mean next-token loss (nats) of each run: the bias only picks experts, but the picks change the output.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:       # `python bench/router_load.py`: k3c and bench.trained from this checkout
    sys.path.insert(0, str(ROOT))

from k3c.errors import UserError  # noqa: E402  (after the repository root is importable)
from k3c.runtime.router_scores import RouterRecorder  # noqa: E402

EXAMPLE = ROOT / "examples" / "k3-stdlib"
BIAS = "layers.{}.block_sparse_moe.gate.e_score_correction_bias"
SCORES = "layers.{}.block_sparse_moe.gate.scores"


def heldout_halves(model_dir: pathlib.Path, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `tokens` ids of each half of the held-out split (alternate held-out files): bench/trained.py's
    held-out stream, tokenized with the model's tokenizer."""
    trained = importlib.import_module("bench.trained")
    files = trained.heldout_files()
    return tuple(trained.heldout_stream(tokens, model_dir=model_dir, files=part)
                 for part in (files[0::2], files[1::2]))


def max_over_mean(load: torch.Tensor) -> float:
    load = load.to(torch.float64)
    return float(load.max() / load.mean())


def calibrate_router(model_dir: pathlib.Path, rec: RouterRecorder, weights: dict, iterations: int,
                     scratch: pathlib.Path) -> dict[int, torch.Tensor]:
    """`k3c calibrate-router` on the recorded scores and the trained biases -> layer -> calibrated bias."""
    from safetensors.torch import load_file, save_file

    from k3c.cli import main as k3c_main

    scores_file, out_file = scratch / "router_scores.safetensors", scratch / "router_bias.safetensors"
    tensors = {SCORES.format(i): rec.recorded_scores(i).contiguous() for i in rec.moe_layers}
    tensors |= {BIAS.format(i): weights[BIAS.format(i)].float().contiguous() for i in rec.moe_layers}
    save_file(tensors, str(scores_file))
    rc = k3c_main(["calibrate-router", str(model_dir), str(scores_file), "-o", str(out_file),
                   "--iterations", str(iterations), "--force"])
    if rc != 0:
        raise SystemExit(f"k3c calibrate-router failed (exit {rc})")
    new = load_file(str(out_file))
    return {i: new[BIAS.format(i)] for i in rec.moe_layers}


def measure(model_dir: pathlib.Path, tokens: int, window: int, iterations: int) -> dict:
    import k3c
    from k3c.quant.balancing import load_imbalance

    spec = k3c.load_spec(model_dir)
    weights = k3c.load_weights(spec, model_dir, dtype=torch.float32)
    recorded, other = heldout_halves(model_dir, tokens)
    k = spec.mlp.moe.top_k

    first = RouterRecorder(spec, weights)
    nll = {"recorded_trained": first.run(recorded, window)}
    with tempfile.TemporaryDirectory() as scratch:
        new_bias = calibrate_router(model_dir, first, weights, iterations, pathlib.Path(scratch))
    calibrated_weights = weights | {BIAS.format(i): b for i, b in new_bias.items()}
    rerun = RouterRecorder(spec, calibrated_weights)
    nll["recorded_calibrated"] = rerun.run(recorded, window)
    other_trained, other_calibrated = RouterRecorder(spec, weights), RouterRecorder(spec, calibrated_weights)
    nll["other_trained"] = other_trained.run(other, window)
    nll["other_calibrated"] = other_calibrated.run(other, window)

    layers = []
    for i in first.moe_layers:
        s = first.recorded_scores(i)
        layers.append({
            "layer": i,
            "recorded_trained": load_imbalance(s, k, weights[BIAS.format(i)].float()),
            "recorded_calibrated": load_imbalance(s, k, new_bias[i]),
            "picks_trained": max_over_mean(first.picks[i]),         # the router's own picks in the same run
            "rerun_calibrated": max_over_mean(rerun.picks[i]),
            "other_trained": max_over_mean(other_trained.picks[i]),
            "other_calibrated": max_over_mean(other_calibrated.picks[i]),
        })
    return {"model": str(model_dir), "tokens": tokens, "window": window, "windows": (tokens - 1) // window,
            "iterations": iterations, "top_k": k, "num_experts": spec.mlp.moe.num_experts, "layers": layers,
            "nll": nll, "perplexity": {key: math.exp(v) for key, v in nll.items()}}


COLUMNS = (("recorded_trained", "recorded: trained"), ("recorded_calibrated", "recorded: calibrated"),
           ("rerun_calibrated", "rerun: calibrated"), ("other_trained", "other: trained"),
           ("other_calibrated", "other: calibrated"))


def table(result: dict) -> str:
    head = (f"max/mean expert load (1.0 = balanced), top-{result['top_k']} of {result['num_experts']}, "
            f"{result['windows']} windows of {result['window']} tokens per set, {result['iterations']} Quantile "
            f"Balancing iterations")
    rows = ["| MoE layer | " + " | ".join(name for _, name in COLUMNS) + " |",
            "|---|" + "---:|" * len(COLUMNS)]
    for r in result["layers"]:
        rows.append(f"| {r['layer']} | " + " | ".join(f"{r[key]:.3f}" for key, _ in COLUMNS) + " |")
    worst = {key: max(r[key] for r in result["layers"]) for key, _ in COLUMNS}
    rows.append("| worst | " + " | ".join(f"{worst[key]:.3f}" for key, _ in COLUMNS) + " |")
    p = result["perplexity"]
    ppl = (f"perplexity: recorded {p['recorded_trained']:.3f} (trained) -> {p['recorded_calibrated']:.3f} "
           f"(calibrated); other {p['other_trained']:.3f} -> {p['other_calibrated']:.3f}")
    return "\n".join([head, *rows, ppl])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(EXAMPLE), help="HF K3 model directory (default examples/k3-stdlib)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of each set (default 16384)")
    ap.add_argument("--window", type=int, default=512, help="tokens per forward window (default 512)")
    ap.add_argument("--iterations", type=int, default=8, help="Quantile Balancing iterations (default 8)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (one is fastest on a busy 2-core machine)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit("--threads must be positive")
        torch.set_num_threads(args.threads)
    if args.window < 1 or args.tokens < args.window + 1:
        raise SystemExit("--window must be positive and --tokens at least --window + 1")
    model_dir = pathlib.Path(args.model)
    if not (model_dir / "model.safetensors").exists():
        raise SystemExit(f"{model_dir}: no model.safetensors (give --model a trained model directory)")
    try:
        result = measure(model_dir, args.tokens, args.window, args.iterations)
    except UserError as exc:          # a model directory k3c refuses, too few held-out tokens
        print(f"router_load: error: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
