"""Packed MXFP4 checkpoints (`k3c quantize`): the spec's `quantization:` selection packed once, offline.

    DIR/model.safetensors    canonical names (k3c/frontend/weight_names.py): each selected stack P as
                             `P.weight_packed` u8 [E, out, in/2] + `P.weight_scale` u8 [E, out, in/32] (a selected
                             linear `X.weight` as `X.weight_packed` [out, in/2] + `X.weight_scale` [out, in/32]),
                             the rest as loaded (bf16)
    DIR/quantization.json    {"format": "mxfp4", "rule", "block": 32, "weights": [P, ...], "k3c_version", "spec"}

`k3c.load_weights(spec, DIR)` reads it back and a session uses the packed tensors as they are. The directory is
written atomically under k3c's output policy (k3c/outputs.py): into a staging sibling, renamed into place when
complete, so a failure leaves nothing half-written; an existing DIR is replaced only with `force` and only when it
is a k3c quantized checkpoint holding nothing else (a directory of other files is refused, `force` or not).
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import ArgumentError, WeightError
from .mx import BLOCK_SIZE, RULES

QUANT_JSON = "quantization.json"
MODEL_FILE = "model.safetensors"


def quantize_weights(spec, weights: dict[str, torch.Tensor], rule: str | None = None
                     ) -> tuple[dict[str, torch.Tensor], list[str], str]:
    """(tensors to write, quantized source names, rule) for `spec`'s quantization section. Weights already packed
    (`P.weight_packed`, from a packed checkpoint) are kept as they are."""
    from ..frontend.quant_check import quantized_names
    from ..ir.ops import packed_name
    from ..frontend.weight_names import weight_table
    from ..runtime.weight_prep import quantize_stack

    if spec.quantization is None:
        raise ArgumentError(f"spec '{spec.name}' has no quantization: section (add `quantization: {{format: mxfp4}}`"
                            f" to pack its routed experts)")
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


def read_quantization_json(directory: str) -> dict | None:
    """The record of a `k3c quantize` directory (None if absent), checked to be one k3c can read."""
    path = os.path.join(directory, QUANT_JSON)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightError(f"{path}: cannot read the quantization record: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != "mxfp4" or record.get("block") != BLOCK_SIZE:
        raise WeightError(f"{path}: expected format mxfp4 with block {BLOCK_SIZE}, got "
                          f"{ {k: record.get(k) for k in ('format', 'block')} if isinstance(record, dict) else record}")
    return record
