"""The hybrid model against the same model with every layer full attention (`k3c plan --compare-full-attention`).

KV throughput = KV-cache bytes / prefill time for a given length (K3.md s7): the bandwidth needed to move a
prefilled cache (disaggregated prefill -> decode, offload to host). A KDA layer's cache is a fixed state; an MLA
layer's grows with the context. The variant replaces every KDA layer by an MLA layer of the spec's own MLA shape
(everything else, the MoE, AttnRes and precision included, unchanged), is compiled through the same pipeline and
planned with the same target, layout and options; both rows come from each plan's `kv_throughput`
(roofline.kv_throughput: one copy of the cache over the predicted prefill time of L tokens).
"""
from __future__ import annotations

from ..errors import ArgumentError
from ..frontend import ModelSpec


def full_attention_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` with every layer MLA (the KDA section dropped: no layer reads it)."""
    if spec.mla is None:
        raise ArgumentError(f"--compare-full-attention: {spec.name} has no mla section, so no full-attention layer "
                            "shape to put in place of its KDA layers")
    if "kda" not in spec.layer_kinds:
        raise ArgumentError(f"--compare-full-attention: every layer of {spec.name} is already full attention (MLA)")
    return spec.replace(name=f"{spec.name}-full-attention", layer_kinds=("mla",) * spec.num_layers, kda=None)


def compare_rows(hybrid: list[dict], full: list[dict]) -> list[dict]:
    """One row per length: each model's cache bytes, prefill seconds, KV throughput (bytes/s), and the ratios
    full / hybrid."""
    out = []
    for h, f in zip(hybrid, full):
        assert h["context"] == f["context"]
        out.append({"context": h["context"], "hybrid": dict(h), "full_attention": dict(f),
                    "cache_ratio": f["cache_bytes"] / h["cache_bytes"],
                    "prefill_ratio": f["prefill_seconds"] / h["prefill_seconds"],
                    "kv_throughput_ratio": f["bytes_per_s"] / h["bytes_per_s"]})
    return out
