"""k3c.quant: OCP MX formats (MXFP4 weights, MXFP8 activations), K3's compressed-tensors expert layout, and Quantile
Balancing of router biases. See docs/quant.md for formats, rules, byte layouts and special values."""
from .balancing import expert_load, load_imbalance, quantile_balancing
from .compressed_tensors import pack_compressed_tensors_mxfp4, unpack_compressed_tensors_mxfp4
from .mx import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E8M0_NAN,
    RULES,
    e8m0_to_float,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    pack_fp4,
    unpack_fp4,
)

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E8M0_NAN",
    "RULES",
    "e8m0_to_float",
    "expert_load",
    "load_imbalance",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "pack_compressed_tensors_mxfp4",
    "pack_fp4",
    "quantile_balancing",
    "unpack_compressed_tensors_mxfp4",
    "unpack_fp4",
]
