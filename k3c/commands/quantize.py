"""`k3c quantize` and `k3c calibrate-router` (registered by k3c/cli.py). The packed checkpoint's layout and its
reader are k3c/quant/checkpoint.py; write_quantized_checkpoint here writes it, streaming (one weight, or one part
of a random one, at a time: bounded memory for checkpoints larger than the host's).

    k3c quantize SPEC [WEIGHTS] -o DIR [--rule floor|rceil] [--force]    (WEIGHTS: safetensors / HF dir; default:
                                                                          the model directory's own checkpoint)
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
from ..ir.mxfp4_weights import packed_name
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
    q.add_argument("weights", nargs="?", help="safetensors file or model directory (default: the checkpoint of "
                   "the model directory given as SPEC; or --random)")
    q.add_argument("-o", "--output", required=True, help="checkpoint directory to write")
    q.add_argument("--rule", choices=("floor", "rceil"), help="E8M0 scale rule (default: the spec's)")
    q.add_argument("--random", action="store_true", help="quantize a random checkpoint (k3c.init_weights)")
    q.add_argument("--seed", type=seed, default=0, help="seed of --random, in [0, 2**63 - 1] (default 0)")
    q.add_argument("--force", action="store_true", help="replace an existing output directory")

    c = sub.add_parser("calibrate-router", help="router biases by Quantile Balancing of router scores, recorded "
                       "from the model over a text file (--text) or given (SCORES)")
    c.add_argument("spec", help="YAML spec, config.json or model directory")
    c.add_argument("scores", nargs="?", help="safetensors with layers.{i}.block_sparse_moe.gate.scores [tokens, "
                   "experts] (or --text)")
    c.add_argument("--text", metavar="FILE", help="record the scores by running the model (its weights: --weights, "
                   "default the model directory's checkpoint) over this UTF-8 file, tokenized with its tokenizer; "
                   "the trained biases are the starting point")
    c.add_argument("--weights", help="with --text: safetensors file or model directory (default: the model "
                   "directory's checkpoint)")
    c.add_argument("--window", type=positive("--window", 1 << 20), default=512,
                   help="with --text: tokens per forward window, each from a fresh context (default 512)")
    c.add_argument("-o", "--output", required=True, help="safetensors file for the new biases")
    c.add_argument("--iterations", type=positive("--iterations", MAX_ITERATIONS), default=8,
                   help=f"Quantile Balancing steps, at most {MAX_ITERATIONS} (default 8)")
    c.add_argument("--force", action="store_true", help="replace an existing output file")


PART_ELEMENTS = 1 << 25       # entries of a random weight drawn at a time (128 MB in fp32)
QUANT_SLAB_BYTES = 1 << 26    # quantize_stack's fp32 temporaries per slab of rows


def cmd_quantize(args) -> int:
    import k3c

    from ..outputs import QUANTIZED, check_output_dir

    if args.random and args.weights:
        raise ArgumentError("give WEIGHTS or --random, not both")
    check_output_dir(args.output, args.force, kind=QUANTIZED)         # before the weights are read
    spec = quantization_spec(k3c.load_spec(args.spec))
    weights = args.weights
    if not args.random and weights is None:
        from .run import model_checkpoint

        weights = model_checkpoint(args.spec)
        if weights is None:
            raise ArgumentError(f"give WEIGHTS (a safetensors file or model directory) or --random: {args.spec} "
                                f"holds no checkpoint")
    check_quantize_fits(spec, args.output, weights)                   # before anything large is allocated
    if weights is None:
        from ..runtime.weights import init_weight_parts

        parts, where = init_weight_parts(spec, args.seed, torch.bfloat16, PART_ELEMENTS), "--random weights"
    else:
        from ..runtime.checkpoint import iter_weights

        parts, where = iter_weights(spec, weights, experts_apart=True), weights   # refuses NaN / inf, naming it
    record = write_quantized_checkpoint(spec, parts, args.output, rule=args.rule, force=args.force, where=where)
    print(f"k3c: quantized {len(record['weights'])} weights of {spec.name} to MXFP4 ({record['rule']}) -> "
          f"{args.output}")
    return 0


def quantization_spec(spec):
    """`spec` with the quantization it asks for: its `quantization:` section, or, without one, the MXFP4 weights
    its precision section declares (a Hugging Face checkpoint's quantization_config: the trained example model
    says its routed experts are MXFP4 while storing them dense). ArgumentError when it asks for neither."""
    from dataclasses import replace

    from ..frontend.spec import QuantizationSpec

    if spec.quantization is not None:
        return spec
    declared = spec.precision.weights if spec.precision is not None else None
    if declared is not None and declared.format == "mxfp4":
        return replace(spec, quantization=QuantizationSpec(rule=declared.scale_rule, include=declared.include,
                                                           exclude=declared.exclude))
    _require_quantization(spec)
    return spec


def _require_quantization(spec) -> None:
    if spec.quantization is None:
        raise ArgumentError(f"spec '{spec.name}' has no quantization: section (add `quantization: {{format: mxfp4}}` "
                            f"to pack its routed experts)")


def quantize_estimate(spec, weights: str | None) -> tuple[int, int]:
    """(peak memory, checkpoint bytes) of `k3c quantize`, both upper bounds: it holds one weight at a time (a
    random one a part of PART_ELEMENTS at a time, a read expert stack an expert at a time), its MXFP4 slabs, and
    the scales of one stack until they are written. The largest piece read (checkpoint.stored_peak_bytes) is
    counted three times: as read and as converted to fp32 (2 bytes an entry becoming 4); the checkpoint is at most
    the size of the files read (packing only shrinks), or exactly what the random weights make."""
    import math

    from ..frontend.quant_check import quantized_names
    from ..frontend.weight_names import weight_table

    table = weight_table(spec)
    chosen = set(quantized_names(spec))
    largest = max(math.prod(i.shape) for i in table.values())
    scales = max((math.prod(table[n].shape) // 32 for n in chosen), default=0)
    slab = 4 * QUANT_SLAB_BYTES                     # quantize_stack's slab and its few fp32 temporaries
    if weights is None:
        piece = min(largest, PART_ELEMENTS + 16 * max(i.shape[-1] for i in table.values()))
        held = piece * (4 + 2 + 1)                  # drawn fp32, as bf16, its packed half
        size = sum(math.prod(i.shape) * (4 if i.dtype == "fp32" else 2) if n not in chosen
                   else math.prod(i.shape) * 17 // 32 for n, i in table.items())
    else:
        from ..runtime.checkpoint import _resolve_files, stored_peak_bytes

        held = stored_peak_bytes(spec, weights) * 3
        size = sum(os.path.getsize(f) for f in _resolve_files(weights)[0])
    return (held + slab + scales) * 5 // 4, size       # a quarter more for the allocator's slack (measured)


def check_quantize_fits(spec, out_dir: str, weights: str | None) -> None:
    """ArgumentError, before anything large is allocated or written, when the estimated peak memory exceeds the
    host's free memory or the checkpoint the free space where -o goes."""
    import shutil

    from .run import available_bytes

    need, size = quantize_estimate(spec, weights)
    free = available_bytes("cpu")
    if free is not None and need > free:
        raise ArgumentError(f"quantizing {spec.name} needs about {need / 2**30:,.2f} GiB of memory (one weight "
                            f"at a time), the host has {free / 2**30:,.2f} GiB free")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    disk = shutil.disk_usage(parent).free
    if size > disk:
        raise ArgumentError(f"-o {out_dir}: the checkpoint of {spec.name} takes up to {size / 2**30:,.2f} GiB, "
                            f"{parent} has {disk / 2**30:,.2f} GiB free")


def save_quantized_checkpoint(spec, weights: dict[str, torch.Tensor], out_dir: str | os.PathLike, *,
                              rule: str | None = None, force: bool = False) -> dict:
    """Quantize `weights` (canonical names; packed pairs kept as they are) per the spec and write DIR
    atomically; returns the quantization.json record."""
    return write_quantized_checkpoint(quantization_spec(spec), weights.items(), out_dir, rule=rule, force=force)


def write_quantized_checkpoint(spec, parts, out_dir: str | os.PathLike, *, rule: str | None = None,
                               force: bool = False, where: str = "weights") -> dict:
    """Quantize per the spec and write DIR atomically, streaming: `parts` yields (canonical name, tensor or the
    next rows of it); each part is checked, packed and written before the next is taken. Returns the
    quantization.json record."""
    from .. import __version__
    from ..frontend.quant_check import quantized_names
    from ..frontend.weight_names import weight_table
    from ..outputs import QUANTIZED, Staging, check_output_dir
    from ..quant.safetensors_stream import SafetensorsWriter
    from ..runtime.checkpoint import packed_infos

    _require_quantization(spec)
    rule = rule or spec.quantization.rule
    if rule not in RULES:
        raise ArgumentError(f"--rule must be one of {', '.join(RULES)}, got {rule!r}")
    out_dir = check_output_dir(out_dir, force, kind=QUANTIZED)        # before the (long) quantization
    table = weight_table(spec)
    packed = packed_infos(table)
    chosen = quantized_names(spec)
    bound = [(n, i.shape) for n, i in table.items()] + [(n, i.shape) for n, i in packed.items()]
    record = {"format": "mxfp4", "rule": rule, "block": BLOCK_SIZE, "weights": chosen,
              "k3c_version": __version__, "spec": spec.name}
    with Staging(out_dir, overwrite=force, kind=QUANTIZED) as staging:
        try:
            with SafetensorsWriter(os.path.join(staging.dir, MODEL_FILE), bound=bound,
                                   metadata={"format": "pt", "k3c_quantization": "mxfp4"}) as w:
                _PackedStream(w, table, packed, set(chosen), rule, where).run(parts)
            with open(os.path.join(staging.dir, QUANT_JSON), "w", encoding="utf-8") as fh:
                json.dump(record, fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            raise ArgumentError(f"cannot write {out_dir}: {exc.strerror}") from None
        staging.commit()
    return record


class _PackedStream:
    """The parts of a checkpoint into a SafetensorsWriter: chosen float weights packed a slab of rows at a time
    (payload written as it comes, the stack's scales after it), the rest written as they are."""

    def __init__(self, writer, table, packed, chosen: set[str], rule: str, where: str):
        self.w, self.table, self.packed, self.chosen, self.rule, self.where = writer, table, packed, chosen, rule, where
        self.current: str | None = None
        self.scales: list[torch.Tensor] = []
        self.done: set[str] = set()

    def run(self, parts) -> None:
        from ..runtime.checkpoint import check_finite

        for name, part in parts:
            if name != self.current:
                self._end()
                self._begin(name, part)
            check_finite(name, part, self.where)                     # MX keeps NaN: refused, not packed
            try:
                if name in self.chosen:
                    p, s = _quantize_rows(name, part, self.table[name].shape[-1], self.rule)
                    self.w.write(p)
                    self.scales.append(s)
                else:
                    self.w.write(part)
            except ValueError as exc:
                raise WeightError(f"weight '{name}': {exc}") from None
        self._end()
        for name in self.table:
            if name not in self.done and packed_name(name, "weight_packed") not in self.done:
                raise WeightError(f"weight '{name}' is missing")

    def _begin(self, name: str, part: torch.Tensor) -> None:
        if name in self.done:
            raise WeightError(f"weight '{name}' is given twice")
        self.current = name
        if name in self.chosen:
            if not part.is_floating_point():
                raise WeightError(f"weight '{name}' has dtype {part.dtype}; MXFP4 quantization needs a float tensor")
            pn = packed_name(name, "weight_packed")
            self.w.begin(pn, torch.uint8, self.packed[pn].shape)
            self.scales = []
        elif name in self.table or name in self.packed:
            self.w.begin(name, part.dtype, (self.table.get(name) or self.packed[name]).shape)
        else:
            raise WeightError(f"'{name}' is not a weight of this spec")

    def _end(self) -> None:
        name, self.current = self.current, None
        if name is None:
            return
        try:
            if name in self.chosen:
                sn = packed_name(name, "weight_scale")
                self.w.begin(sn, torch.uint8, self.packed[sn].shape)
                for s in self.scales:
                    self.w.write(s)
                self.scales = []
                self.done.add(packed_name(name, "weight_packed"))
            self.w.finish_tensor()
        except ValueError as exc:
            raise WeightError(f"weight '{name}': {exc}") from None
        self.done.add(name)


def _quantize_rows(name: str, part: torch.Tensor, last: int, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 payload and scales of a part (whole tensor or rows of it), flattened to rows of the weight's last
    dimension."""
    from ..runtime.weight_prep import quantize_stack

    if part.shape[-1] != last:
        raise ValueError(f"shape {tuple(part.shape)} does not end in {last}")
    return quantize_stack(name, part.reshape(-1, last), rule, chunk_bytes=QUANT_SLAB_BYTES)


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
            _check_scores_fit(path, {k: h.get_slice(k).get_shape() for k in h.keys()})
            tensors = {k: h.get_tensor(k) for k in h.keys()}
    except ArgumentError:
        raise
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


def _check_scores_fit(path: str, shapes: dict[str, list[int]]) -> None:
    """ArgumentError before the scores are read when they, as fp32, plus the sort Quantile Balancing makes of the
    largest layer (values and int64 indices, twice over) exceed the host's free memory."""
    import math

    from .run import available_bytes

    sizes = [math.prod(s) * 4 for s in shapes.values()]
    need = 2 * sum(sizes) + 6 * max(sizes, default=0)
    free = available_bytes("cpu")
    if free is not None and need > free:
        raise ArgumentError(f"{path}: calibrating on these scores needs about {need / 2**30:,.2f} GiB of memory, "
                            f"the host has {free / 2**30:,.2f} GiB free; record fewer tokens")


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


def cmd_calibrate_router(args) -> int:
    import k3c
    from safetensors.torch import save as save_bytes

    from ..outputs import check_output_file, write_file

    if (args.scores is None) == (args.text is None):
        raise ArgumentError("give SCORES (a safetensors file of recorded router scores) or --text FILE (record "
                            "them now), one of them")
    if args.text is None and (args.weights is not None):
        raise ArgumentError("--weights goes with --text (SCORES are already recorded)")
    spec = k3c.load_spec(args.spec)
    check_output_file(args.output, args.force)
    scores = read_scores(spec, args.scores) if args.scores is not None else text_scores(spec, args)
    result = calibrate(spec, scores, args.iterations)
    tensors = {BIAS.format(layer): b.contiguous() for layer, (b, _, _) in result.items()}
    write_file(args.output, save_bytes(tensors, metadata={"format": "pt", "k3c": "calibrate-router"}), args.force)
    print(f"k3c: Quantile Balancing, top-{spec.mlp.moe.top_k} of {spec.mlp.moe.num_experts} experts, "
          f"{args.iterations} iterations; max/mean expert load:")
    for layer, (_, before, after) in sorted(result.items()):
        print(f"  layer {layer}: {before:.3f} -> {after:.3f}")
    print(f"k3c: wrote {len(tensors)} biases -> {args.output}")
    return 0


def text_scores(spec, args) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """calibrate-router --text: {layer: (scores recorded over the file's tokens, the weights' bias)}."""
    import k3c

    from ..runtime.router_scores import record_router_scores
    from ..runtime.text import load_tokenizer
    from .run import model_checkpoint
    from .run_cli import read_text_file

    if spec.mlp.moe is None:
        raise ArgumentError(f"spec '{spec.name}' has no MoE layers to calibrate")
    weights = args.weights or model_checkpoint(args.spec)
    if weights is None:
        raise ArgumentError(f"--text records the model's router scores: give --weights ({args.spec} holds no "
                            f"checkpoint, and random weights route at random)")
    directory = args.spec if os.path.isdir(args.spec) else os.path.dirname(args.spec)
    tok = load_tokenizer(directory, spec.vocab_size)
    if tok is None:
        raise ArgumentError(f"--text: {args.spec} has no tokenizer.json to tokenize {args.text} with")
    ids = tok.encode(read_text_file(args.text, "--text"))
    if len(ids) < 2:
        raise ArgumentError(f"--text {args.text}: {len(ids)} token(s); record at least 2")
    _check_scores_fit(args.text, {"scores": [len(ids), spec.mlp.moe.num_experts]})
    w = k3c.load_weights(spec, weights, dtype=torch.float32)
    recorded = record_router_scores(spec, w, ids, args.window)
    return {i: (s, w[BIAS.format(i)].float() if spec.mlp.moe.router_bias else None) for i, s in recorded.items()}
