"""`k3c quantize` and `k3c calibrate-router` (registered by k3c/cli.py). The packed checkpoint's layout and its
reader are k3c/quant/checkpoint.py; quantize_weights / save_quantized_checkpoint here write it.

    k3c quantize SPEC WEIGHTS -o DIR [--rule floor|rceil] [--force]      (WEIGHTS: safetensors / HF dir)
    k3c quantize SPEC --random --seed N -o DIR                            (a random checkpoint)
    k3c calibrate-router SPEC SCORES -o OUT.safetensors [--iterations N] [--force]

SCORES holds, per MoE layer i (0-based) to calibrate, `layers.{i}.block_sparse_moe.gate.scores`: the router scores
s (after the sigmoid, before the bias) of recorded tokens, fp32 [tokens, num_experts]. It may also hold the current
`layers.{i}.block_sparse_moe.gate.e_score_correction_bias` [num_experts] to start from (zeros otherwise). OUT gets
the new `layers.{i}.block_sparse_moe.gate.e_score_correction_bias` (fp32) of each layer given.
"""
from __future__ import annotations

import json
import os
import re

import torch

from ..errors import ArgumentError, WeightError
from ..quant.checkpoint import MODEL_FILE, QUANT_JSON
from ..quant.mx import BLOCK_SIZE, RULES

SCORES_RE = re.compile(r"^layers\.(\d+)\.block_sparse_moe\.gate\.scores$")
BIAS = "layers.{}.block_sparse_moe.gate.e_score_correction_bias"
MAX_ITERATIONS = 1000          # Quantile Balancing converges in a few steps; each costs a sort of the scores
MAX_BIAS = 1e6                 # |starting bias| bound: router scores lie in [0, 1], a bias beyond this is garbage


def add_parsers(sub, positive, seed) -> None:
    """`positive(name, bound)` and `seed` are the CLI's argument types (k3c/cli.py)."""
    q = sub.add_parser("quantize", help="write a packed MXFP4 checkpoint (the spec's quantization: section)")
    q.add_argument("spec", help="YAML spec (with a quantization: section), config.json or model directory")
    q.add_argument("weights", nargs="?", help="safetensors file or model directory (or --random)")
    q.add_argument("-o", "--output", required=True, help="checkpoint directory to write")
    q.add_argument("--rule", choices=("floor", "rceil"), help="E8M0 scale rule (default: the spec's)")
    q.add_argument("--random", action="store_true", help="quantize a random checkpoint (k3c.init_weights)")
    q.add_argument("--seed", type=seed, default=0, help="seed of --random, in [0, 2**63 - 1] (default 0)")
    q.add_argument("--force", action="store_true", help="replace an existing output directory")

    c = sub.add_parser("calibrate-router", help="router biases by Quantile Balancing of recorded scores")
    c.add_argument("spec", help="YAML spec, config.json or model directory")
    c.add_argument("scores", help="safetensors with layers.{i}.block_sparse_moe.gate.scores [tokens, experts]")
    c.add_argument("-o", "--output", required=True, help="safetensors file for the new biases")
    c.add_argument("--iterations", type=positive("--iterations", MAX_ITERATIONS), default=8,
                   help=f"Quantile Balancing steps, at most {MAX_ITERATIONS} (default 8)")
    c.add_argument("--force", action="store_true", help="replace an existing output file")


def cmd_quantize(args) -> int:
    import k3c

    if args.random == bool(args.weights):
        raise ArgumentError("k3c quantize: give WEIGHTS or --random (one of them)")
    from ..outputs import QUANTIZED, check_output_dir

    check_output_dir(args.output, args.force, kind=QUANTIZED)         # before the weights are read
    spec = k3c.load_spec(args.spec)
    _require_quantization(spec)
    if args.random:
        weights = k3c.init_weights(spec, seed=args.seed, dtype=torch.bfloat16)
    else:
        weights = k3c.load_weights(spec, args.weights)           # refuses NaN / inf weights, naming the tensor
    from ..runtime.checkpoint import check_finite

    for name, t in weights.items():                              # what is packed must be finite (MX keeps NaN)
        check_finite(name, t, args.weights or "--random weights")
    record = save_quantized_checkpoint(spec, weights, args.output, rule=args.rule, force=args.force)
    print(f"k3c: quantized {len(record['weights'])} weights of {spec.name} to MXFP4 ({record['rule']}) -> "
          f"{args.output}")
    return 0


def _require_quantization(spec) -> None:
    if spec.quantization is None:
        raise ArgumentError(f"spec '{spec.name}' has no quantization: section (add `quantization: {{format: mxfp4}}` "
                            f"to pack its routed experts)")


def quantize_weights(spec, weights: dict[str, torch.Tensor], rule: str | None = None
                     ) -> tuple[dict[str, torch.Tensor], list[str], str]:
    """(tensors to write, quantized source names, rule) for `spec`'s quantization section. Weights already packed
    (`P.weight_packed`, from a packed checkpoint) are kept as they are."""
    from ..frontend.quant_check import quantized_names
    from ..frontend.weight_names import weight_table
    from ..ir.mxfp4_weights import packed_name
    from ..runtime.weight_prep import quantize_stack

    _require_quantization(spec)
    rule = rule or spec.quantization.rule
    if rule not in RULES:
        raise ArgumentError(f"--rule must be one of {', '.join(RULES)}, got {rule!r}")
    chosen = quantized_names(spec)
    out: dict[str, torch.Tensor] = {}
    for name in weight_table(spec):
        pn, sn = packed_name(name, "weight_packed"), packed_name(name, "weight_scale")
        if name in chosen and name not in weights and pn in weights:
            out[pn], out[sn] = weights[pn], weights[sn]
            continue
        if name not in weights:
            raise WeightError(f"weight '{name}' is missing")
        t = weights[name]
        if name in chosen:
            out[pn], out[sn] = quantize_stack(name, t, rule)
        else:
            out[name] = t
    return out, chosen, rule


def save_quantized_checkpoint(spec, weights: dict[str, torch.Tensor], out_dir: str | os.PathLike, *,
                              rule: str | None = None, force: bool = False) -> dict:
    """Quantize per the spec and write DIR atomically; returns the quantization.json record."""
    from safetensors.torch import save_file

    from .. import __version__
    from ..outputs import QUANTIZED, Staging, check_output_dir
    from ..runtime.checkpoint import check_finite

    out_dir = check_output_dir(out_dir, force, kind=QUANTIZED)        # before the (long) quantization
    for name, t in weights.items():                                   # NaN experts are refused, not packed
        check_finite(name, t, "weights")
    tensors, chosen, rule = quantize_weights(spec, weights, rule)
    record = {"format": "mxfp4", "rule": rule, "block": BLOCK_SIZE, "weights": chosen,
              "k3c_version": __version__, "spec": spec.name}
    with Staging(out_dir, overwrite=force, kind=QUANTIZED) as staging:
        tmp = staging.dir
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.path.join(tmp, MODEL_FILE),
                      metadata={"format": "pt", "k3c_quantization": "mxfp4"})
            with open(os.path.join(tmp, QUANT_JSON), "w", encoding="utf-8") as fh:
                json.dump(record, fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            raise ArgumentError(f"cannot write {out_dir}: {exc.strerror}") from None
        staging.commit()
    return record


def read_scores(spec, path: str) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """layer -> (scores fp32 [T, E], starting bias or None), checked against the spec."""
    from safetensors import safe_open

    from ..paths import regular_file

    regular_file(path, "file")                       # not a FIFO or device: a read of one never ends
    if spec.mlp.moe is None:
        raise ArgumentError(f"spec '{spec.name}' has no MoE layers to calibrate")
    n = spec.mlp.moe.num_experts
    try:
        with safe_open(path, framework="pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise WeightError(f"{path}: not a readable safetensors file ({exc})") from None
    out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for key, t in sorted(tensors.items()):
        m = SCORES_RE.match(key)
        if m is None:
            if re.match(r"^layers\.\d+\.block_sparse_moe\.gate\.e_score_correction_bias$", key):
                continue
            raise WeightError(f"{path}: unexpected tensor '{key}' (expected layers.{{i}}.block_sparse_moe.gate.scores "
                              f"and optionally layers.{{i}}.block_sparse_moe.gate.e_score_correction_bias)")
        layer = int(m.group(1))
        if not (layer < spec.num_layers and spec.is_moe_layer(layer)):
            raise WeightError(f"{path}: '{key}': layer {layer} is not a MoE layer of spec '{spec.name}'")
        if not t.is_floating_point() or t.dim() != 2 or t.shape[1] != n or t.shape[0] < 1:
            raise WeightError(f"{path}: '{key}' must be float [tokens, {n}], got {str(t.dtype)[6:]} "
                              f"{list(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise WeightError(f"{path}: '{key}' holds NaN or inf")
        if bool(((t < 0) | (t > 1)).any()):
            raise WeightError(f"{path}: '{key}' holds values outside [0, 1] (min {float(t.min()):g}, max "
                              f"{float(t.max()):g}); record the router scores after the sigmoid, before the bias")
        bias = tensors.get(BIAS.format(layer))
        if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_floating_point()):
            raise WeightError(f"{path}: '{BIAS.format(layer)}' must be float [{n}], got {list(bias.shape)}")
        if bias is not None and not bool((bias.to(torch.float64).abs() <= MAX_BIAS).all()):   # NaN fails too
            raise WeightError(f"{path}: '{BIAS.format(layer)}' holds NaN, inf or values beyond +-{MAX_BIAS:g}")
        out[layer] = (t.to(torch.float32), None if bias is None else bias.to(torch.float32))
    for key in tensors:
        m = re.match(r"^layers\.(\d+)\.block_sparse_moe\.gate\.e_score_correction_bias$", key)
        if m and int(m.group(1)) not in out:
            raise WeightError(f"{path}: '{key}' has no matching layers.{m.group(1)}.block_sparse_moe.gate.scores")
    if not out:
        raise WeightError(f"{path}: no layers.{{i}}.block_sparse_moe.gate.scores tensor")
    return out


def calibrate(spec, scores: dict, iterations: int) -> dict[int, tuple[torch.Tensor, float, float]]:
    """layer -> (new bias, max/mean load before, after), Quantile Balancing iterated on the recorded scores."""
    from ..quant.balancing import load_imbalance, quantile_balancing

    if isinstance(iterations, bool) or not isinstance(iterations, int) or not 1 <= iterations <= MAX_ITERATIONS:
        raise ArgumentError(f"--iterations must be an integer in [1, {MAX_ITERATIONS}], got {iterations!r}")
    k = spec.mlp.moe.top_k
    out = {}
    for layer, (s, bias) in scores.items():
        before = load_imbalance(s, k, bias)
        b = bias
        for _ in range(iterations):
            b = quantile_balancing(s, k, b)
        if not bool(torch.isfinite(b).all()):      # finite inputs give finite biases: never write NaN
            raise WeightError(f"layer {layer}: Quantile Balancing gave a non-finite bias (scores or starting bias "
                              f"out of range)")
        out[layer] = (b, before, load_imbalance(s, k, b))
    return out


def _check_output(path: str, force: bool) -> None:
    """The output file can be written: its directory exists, it is not a directory, --force to replace it."""
    if not path:
        raise ArgumentError("-o needs a file name, got an empty string")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ArgumentError(f"-o {path}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise ArgumentError(f"-o {path}: is a directory; give a .safetensors file name")
    if os.path.lexists(path) and not force:
        raise ArgumentError(f"{path} exists; pass --force to replace it")


def cmd_calibrate_router(args) -> int:
    import k3c
    from safetensors.torch import save_file

    spec = k3c.load_spec(args.spec)
    _check_output(args.output, args.force)
    result = calibrate(spec, read_scores(spec, args.scores), args.iterations)
    tensors = {BIAS.format(layer): b.contiguous() for layer, (b, _, _) in result.items()}
    tmp = f"{args.output}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata={"format": "pt", "k3c": "calibrate-router"})
        os.replace(tmp, args.output)
    except Exception as exc:        # OSError, or safetensors' own error for a file it cannot create
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ArgumentError(f"cannot write {args.output}: {getattr(exc, 'strerror', None) or exc}") from None
    print(f"k3c: Quantile Balancing, top-{spec.mlp.moe.top_k} of {spec.mlp.moe.num_experts} experts, "
          f"{args.iterations} iterations; max/mean expert load:")
    for layer, (_, before, after) in sorted(result.items()):
        print(f"  layer {layer}: {before:.3f} -> {after:.3f}")
    print(f"k3c: wrote {len(tensors)} biases -> {args.output}")
    return 0
