"""The model spec: frozen dataclasses covering every knob of K3.md.

Layer indices are 0-based everywhere inside k3c. A spec records where each field came from
(`spec.loc("kda.num_heads")` -> "examples/k3-tiny.yaml:14") so IR ops and errors can point back to the file.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping

LayerKind = Literal["kda", "mla"]
LAYER_KINDS = ("kda", "mla")


@dataclass(frozen=True)
class KDASpec:
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    gate: Literal["softplus", "safe"] = "safe"
    gate_lower_bound: float = -5.0          # used by the safe gate only
    gate_rank: int | None = None            # forget gate f = Wf_b(Wf_a x); None -> head_dim
    output_gate: Literal["low_rank", "full_rank"] = "full_rank"
    output_gate_rank: int | None = None     # low-rank output gate only; None -> head_dim

    @property
    def forget_rank(self) -> int:
        return self.gate_rank or self.head_dim

    @property
    def out_gate_rank(self) -> int:
        return self.output_gate_rank or self.head_dim

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_attrs(cls, a: Mapping[str, Any]) -> "KDASpec":
        """The spec an IR op's attrs describe (to_ir writes them; kernel-level ops carry the subset they need)."""
        return cls(**{k: a[k] for k in _FIELDS[cls] if k in a})


@dataclass(frozen=True)
class MLASpec:
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope: Literal["none"] = "none"          # NoPE: the rope dims exist but are never rotated
    output_gate: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values per token in the latent cache: [c (L) | k_pe (R)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_attrs(cls, a: Mapping[str, Any]) -> "MLASpec":
        """The spec an mla op's attrs describe."""
        return cls(**{k: a[k] for k in _FIELDS[cls] if k in a})


@dataclass(frozen=True)
class AttnResSpec:
    block_size: int                          # decoder layers per block


@dataclass(frozen=True)
class ActivationSpec:
    kind: Literal["situ", "swiglu"] = "swiglu"
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0

    @classmethod
    def from_attrs(cls, a: Mapping[str, Any]) -> "ActivationSpec":
        """The activation an op's attrs name (`activation`, and the SiTU betas for "situ")."""
        if a["activation"] == "situ":
            return cls("situ", a["situ_beta_gate"], a["situ_beta_up"])
        return cls(a["activation"])


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None   # None -> num_shared_experts * expert_intermediate_size
    latent_dim: int | None = None                 # LatentMoE width; None -> experts run at hidden width
    latent_norm: bool = False                     # RMSNorm of the combined latent before the up projection
    router_activation: Literal["sigmoid", "softmax"] = "sigmoid"
    router_bias: bool = True                      # e_score_correction_bias added for top-k selection only
    renormalize: bool = True
    routed_scaling_factor: float = 1.0

    @property
    def shared_width(self) -> int:
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.num_shared_experts * self.expert_intermediate_size

    @classmethod
    def from_attrs(cls, a: Mapping[str, Any], expert_intermediate_size: int) -> "MoESpec":
        """The spec a moe op's attrs describe; the expert width comes from its weights (the attrs do not hold it)."""
        return cls(expert_intermediate_size=expert_intermediate_size,
                   **{k: a[k] for k in _FIELDS[cls] if k in a and k != "expert_intermediate_size"})


@dataclass(frozen=True)
class MLPSpec:
    dense_layers: tuple[int, ...]                 # layers with a dense MLP; every other layer is MoE
    dense_intermediate_size: int
    activation: ActivationSpec = ActivationSpec()
    moe: MoESpec | None = None                    # None: every layer dense


@dataclass(frozen=True)
class WeightPrecisionSpec:
    format: Literal["bf16", "mxfp4"] = "bf16"
    include: tuple[str, ...] = ()                 # fnmatch patterns over canonical weight names
    exclude: tuple[str, ...] = ()
    scale_rule: Literal["floor", "rceil"] = "floor"


@dataclass(frozen=True)
class PrecisionSpec:
    weights: WeightPrecisionSpec = WeightPrecisionSpec()
    activations: Literal["bf16", "mxfp8"] = "bf16"


DEFAULT_MXFP4_INCLUDE = ("layers.*.block_sparse_moe.experts.*",)
# what the `mxfp4` pass quantizes when `quantization:` gives no include list: the routed expert stacks (as K3)
DEFAULT_QUANT_INCLUDE = ("*.experts.w1", "*.experts.w3", "*.experts.w2")


@dataclass(frozen=True)
class QuantizationSpec:
    """What k3c does to the weights at compile time (the `mxfp4` pass). `precision:` only declares formats for
    cost analysis; this section makes the compiled graph read packed MXFP4 weights."""
    format: Literal["mxfp4"] = "mxfp4"
    rule: Literal["floor", "rceil"] = "floor"
    include: tuple[str, ...] = DEFAULT_QUANT_INCLUDE   # fnmatch patterns over canonical weight names
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    vocab_size: int
    layer_kinds: tuple[str, ...]
    mlp: MLPSpec
    kda: KDASpec | None = None
    mla: MLASpec | None = None
    attn_res: AttnResSpec | None = None
    precision: PrecisionSpec = PrecisionSpec()
    quantization: QuantizationSpec | None = None  # None: no weight is quantized
    rms_norm_eps: float = 1e-5
    max_context: int = 4096
    tie_word_embeddings: bool = False
    # provenance: not part of equality
    source: str = field(default="<spec>", compare=False)
    locations: tuple[tuple[str, int], ...] = field(default=(), compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp.moe is not None and layer not in self.mlp.dense_layers

    def loc(self, path: str) -> str:
        """'file:line' of a dotted field path (falls back to its nearest located parent)."""
        lines = dict(self.locations)
        probe = path
        while probe:
            if probe in lines:
                return f"{self.source}:{lines[probe]}"
            probe = probe.rpartition(".")[0]
        return self.source

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


# Field names of the specs that from_attrs reads from IR attrs.
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in (KDASpec, MLASpec, MoESpec)}
