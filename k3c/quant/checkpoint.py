"""Packed MXFP4 checkpoints (`k3c quantize`, k3c/commands/quantize.py, writes them): the spec's `quantization:`
selection packed once, offline. This module holds the layout and reads the record back.

    DIR/model.safetensors    canonical names (k3c/frontend/weight_names.py): each selected stack P as
                             `P.weight_packed` u8 [E, out, in/2] + `P.weight_scale` u8 [E, out, in/32] (a selected
                             linear `X.weight` as `X.weight_packed` [out, in/2] + `X.weight_scale` [out, in/32]),
                             the rest as loaded (bf16)
    DIR/quantization.json    {"format": "mxfp4", "rule", "block": 32, "weights": [P, ...], "k3c_version", "spec"}

`k3c.load_weights(spec, DIR)` reads it back and a session uses the packed tensors as they are. The writer puts DIR
in place atomically under k3c's output policy (k3c/outputs.py): into a staging sibling, renamed into place when
complete, so a failure leaves nothing half-written; an existing DIR is replaced only with `force` and only when it
is a k3c quantized checkpoint holding nothing else (a directory of other files is refused, `force` or not).
"""
from __future__ import annotations

import os

from ..errors import WeightError
from ..outputs import loads_json
from .mx import BLOCK_SIZE

QUANT_JSON = "quantization.json"
MODEL_FILE = "model.safetensors"


def read_quantization_json(directory: str) -> dict | None:
    """The record of a `k3c quantize` directory (None if absent), checked to be one k3c can read."""
    path = os.path.join(directory, QUANT_JSON)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise WeightError(f"{path}: cannot read the quantization record: {exc}") from None
    record = loads_json(raw, path, error=WeightError)
    if not isinstance(record, dict) or record.get("format") != "mxfp4" or record.get("block") != BLOCK_SIZE:
        raise WeightError(f"{path}: expected format mxfp4 with block {BLOCK_SIZE}, got "
                          f"{ {k: record.get(k) for k in ('format', 'block')} if isinstance(record, dict) else record}")
    return record
