"""The whole model, eager: prefill, append-prefill and decode over an explicit cache.

Cache (ReferenceCache): per layer, in layer order,
  - KDA layer: KDAState(state [B, H, K, V] fp32, conv tails (q, k, v) [B, H*K, kernel-1]), fixed size;
  - MLA layer: the latent cache [B, T_seen, L+R] = [RMSNorm(c) | k_pe] of every token seen, growing.
  and `length`, the tokens seen. AttnRes keeps nothing across tokens (it mixes along depth, per position; see
  attnres.py). Calls never modify a cache in place: forward returns a new one, so a cache can be reused as a
  prefix for several continuations.
Dtypes: activations in the model dtype (weights' dtype unless `dtype` is given); fp32 for the KDA state and
recurrence, router scores, attention softmax, AttnRes scores and mixes, and inside every norm. With dtype float64
those fp32 parts run in float64 too: a float64 run is the oracle of the fp32 reference itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ArgumentError
from ..frontend.spec import ModelSpec
from ..frontend.weight_names import model_weights
from .attnres import attn_res_mix
from .kda import KDAMode, KDAState, kda_layer
from .mla import MLAMode, mla_layer
from .moe import ChooseExperts, mlp, moe_layer
from .norms import acc_dtype, linear, rms_norm

LayerCache = KDAState | torch.Tensor


class InputError(ArgumentError, ValueError):
    """Bad input ids or cache for the reference model: an ArgumentError (a user error, exit 2 through the CLI),
    and a ValueError (what Python callers catch for a bad argument value)."""


@dataclass(frozen=True)
class ReferenceCache:
    layers: tuple[LayerCache | None, ...]   # None: layer not run yet (empty cache)
    length: int = 0                          # tokens already consumed

    @property
    def batch(self) -> int | None:
        for c in self.layers:
            if c is not None:
                return (c.state if isinstance(c, KDAState) else c).shape[0]
        return None


def strip_prefix(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The weights under `prefix`, with it removed: the `w` dicts the layer functions take."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


class ReferenceModel:
    """Eager semantics of a spec. `weights`: every name of weight_names.model_weights(spec) (extra names are
    ignored). dtype: compute dtype (default: the embedding's); "fp32" weights stay fp32 (float64 in a float64 run).
    kda_mode / chunk_size pick the KDA form (auto: recurrent for single tokens); mla_mode "mha" or "mqa".
    choose_experts: given to every router call (moe.route), e.g. a routing replay's `choose`."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                 kda_mode: KDAMode = "auto", chunk_size: int = 64, mla_mode: MLAMode = "mha",
                 choose_experts: ChooseExperts | None = None):
        infos = model_weights(spec)
        missing = [i.name for i in infos if i.name not in weights]
        if missing:
            raise KeyError(f"{len(missing)} weights missing for spec {spec.name!r}, e.g. {missing[:3]}")
        bad = [f"{i.name}: {tuple(weights[i.name].shape)} != {i.shape}" for i in infos
               if tuple(weights[i.name].shape) != i.shape]
        if bad:
            raise ValueError(f"weight shapes do not match spec {spec.name!r}: " + "; ".join(bad[:3]))
        self.spec = spec
        self.dtype = dtype or weights["embed_tokens.weight"].dtype
        self.w = {i.name: weights[i.name].to(acc_dtype(self.dtype) if i.dtype == "fp32" else self.dtype)
                  for i in infos}
        self.kda_mode, self.chunk_size, self.mla_mode = kda_mode, chunk_size, mla_mode
        self.choose_experts = choose_experts
        self.attn_w = [strip_prefix(self.w, f"layers.{i}.self_attn.") for i in range(spec.num_layers)]
        self.ffn_w = [strip_prefix(self.w, f"layers.{i}.block_sparse_moe." if spec.is_moe_layer(i)
                                   else f"layers.{i}.mlp.") for i in range(spec.num_layers)]

    # -- sublayers (the naive AttnRes test drives these directly) -------------------------------------------------
    def attention(self, i: int, x: torch.Tensor, cache: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        """Layer i's attention (KDA or MLA) on x [B, T, d], before any norm; returns (y, new layer cache)."""
        spec = self.spec
        xn = rms_norm(x, self.w[f"layers.{i}.input_layernorm.weight"], spec.rms_norm_eps)
        if spec.layer_kinds[i] == "kda":
            return kda_layer(xn, self.attn_w[i], spec.kda, spec.rms_norm_eps, cache, mode=self.kda_mode,
                             chunk_size=self.chunk_size)
        return mla_layer(xn, self.attn_w[i], spec.mla, cache, mode=self.mla_mode)

    def feed_forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP or MoE on x [B, T, d], before any norm."""
        spec = self.spec
        xn = rms_norm(x, self.w[f"layers.{i}.post_attention_layernorm.weight"], spec.rms_norm_eps)
        if spec.is_moe_layer(i):
            return moe_layer(xn, self.ffn_w[i], spec.mlp.moe, spec.mlp.activation, spec.rms_norm_eps,
                             self.choose_experts)
        return mlp(xn, self.ffn_w[i], spec.mlp.activation)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.w["embed_tokens.weight"][input_ids]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.w["norm.weight"], self.spec.rms_norm_eps)
        return linear(x, self.w["embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"])

    def _mix(self, blocks: list[torch.Tensor], partial: torch.Tensor, prefix: str) -> torch.Tensor:
        return attn_res_mix([*blocks, partial], self.w[f"{prefix}.proj_weight"], self.w[f"{prefix}.norm_weight"],
                            self.spec.rms_norm_eps)

    # -- whole model ------------------------------------------------------------------------------------------------
    def empty_cache(self) -> ReferenceCache:
        return ReferenceCache((None,) * self.spec.num_layers, 0)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: ReferenceCache | None = None
                ) -> tuple[torch.Tensor, ReferenceCache]:
        """Logits [B, T, vocab] of a segment input_ids [B, T] appended after `cache` (None: a fresh prefill)."""
        return self.forward_autograd(input_ids, cache)

    def forward_autograd(self, input_ids: torch.Tensor, cache: ReferenceCache | None = None
                         ) -> tuple[torch.Tensor, ReferenceCache]:
        """forward() with autograd on: gradients reach the weight tensors this model was built from (those already
        in its compute dtype are used as given, not copied). Training runs through this (tools/train_example.py)."""
        if not isinstance(input_ids, torch.Tensor):
            raise InputError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
            raise InputError(f"input_ids must hold integer token ids, got dtype "
                             f"{str(input_ids.dtype).replace('torch.', '')}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
            raise InputError(f"input_ids must be [B, T] with B, T >= 1, got {tuple(input_ids.shape)}")
        vocab = self.spec.vocab_size
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):   # -1 would wrap to the last embedding row
            raise InputError(f"input_ids must be in [0, {vocab}), got values from {int(input_ids.min())} to "
                             f"{int(input_ids.max())}")
        cache = cache or self.empty_cache()
        if cache.batch not in (None, input_ids.shape[0]):
            raise InputError(f"batch {input_ids.shape[0]} does not match the cache's batch {cache.batch}")
        spec, new_caches = self.spec, []
        x = self.embed(input_ids)
        if spec.attn_res is None:
            for i in range(spec.num_layers):
                y, c = self.attention(i, x, cache.layers[i])
                new_caches.append(c)
                x = x + y
                x = x + self.feed_forward(i, x)
            out = x
        else:
            # K3.md section 4, line by line: b_0 is the embedding; sublayer outputs add to the partial block sum
            size = spec.attn_res.block_size
            partial, blocks = x, []
            for i in range(spec.num_layers):
                h = self._mix(blocks, partial, f"layers.{i}.self_attention_res")
                if i % size == 0:
                    blocks.append(partial)
                    partial = None
                y, c = self.attention(i, h, cache.layers[i])
                new_caches.append(c)
                partial = y if partial is None else partial + y
                h = self._mix(blocks, partial, f"layers.{i}.mlp_res")
                partial = partial + self.feed_forward(i, h)
            out = self._mix(blocks, partial, "output_attn_res")
        return self.head(out), ReferenceCache(tuple(new_caches), cache.length + input_ids.shape[1])

    __call__ = forward

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ReferenceCache]:
        return self.forward(input_ids, None)

    def decode(self, next_ids: torch.Tensor, cache: ReferenceCache) -> tuple[torch.Tensor, ReferenceCache]:
        """One token per sequence: next_ids [B] -> (logits [B, vocab], new cache)."""
        if not isinstance(next_ids, torch.Tensor) or next_ids.dim() != 1:
            got = tuple(next_ids.shape) if isinstance(next_ids, torch.Tensor) else type(next_ids).__name__
            raise InputError(f"next_ids must be a 1-D tensor [B], got {got}")
        logits, cache = self.forward(next_ids.reshape(-1, 1), cache)
        return logits[:, 0], cache


def reference_forward(spec: ModelSpec, weights: dict[str, torch.Tensor], input_ids: torch.Tensor,
                      **options) -> torch.Tensor:
    """Logits [B, T, vocab] of a fresh prefill: the numeric oracle in one call (options: see ReferenceModel)."""
    return ReferenceModel(spec, weights, **options).prefill(input_ids)[0]
