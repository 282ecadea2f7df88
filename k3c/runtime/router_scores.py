"""Router scores recorded from a model running over text: what Quantile Balancing (`k3c calibrate-router`)
calibrates the router biases on.

    scores = record_router_scores(spec, weights, ids, window=512)   # {moe layer: fp32 [tokens, num_experts]}

The fp32 reference forward runs over non-overlapping windows of `ids` (each from a fresh context), and every MoE
layer's scores (after the router's sigmoid or softmax, before the correction bias) are kept.
"""
from __future__ import annotations

import torch

from ..reference.model import ReferenceModel
from ..reference.moe import route
from ..reference.norms import rms_norm


class RouterRecorder(ReferenceModel):
    """The fp32 reference model, recording per MoE layer the router scores [tokens, E] and the expert picks
    (through the choose_experts hook: the ids the router itself chose)."""

    def __init__(self, spec, weights):
        super().__init__(spec, weights, dtype=torch.float32, choose_experts=self._count)
        self.moe_layers = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
        self.scores: dict[int, list[torch.Tensor]] = {i: [] for i in self.moe_layers}
        self.picks = {i: torch.zeros(spec.mlp.moe.num_experts, dtype=torch.int64) for i in self.moe_layers}
        self._calls = 0

    def _count(self, ids: torch.Tensor) -> torch.Tensor:
        layer = self.moe_layers[self._calls % len(self.moe_layers)]      # one router call per MoE layer, in order
        self.picks[layer] += torch.bincount(ids.reshape(-1), minlength=self.picks[layer].numel())
        self._calls += 1
        return ids

    def feed_forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.spec.is_moe_layer(i):
            xn = rms_norm(x, self.w[f"layers.{i}.post_attention_layernorm.weight"], self.spec.rms_norm_eps)
            self.scores[i].append(route(xn.reshape(-1, xn.shape[-1]), self.ffn_w[i], self.spec.mlp.moe)[2])
        return super().feed_forward(i, x)

    def run(self, stream: torch.Tensor, window: int, batch: int = 8) -> float:
        """Mean next-token loss (nats) over the non-overlapping windows of `stream` (the last id of a window is
        only a target), recording as it goes."""
        n = (stream.numel() - 1) // window
        total, count = 0.0, 0
        for lo in range(0, n, batch):
            starts = torch.arange(lo, min(n, lo + batch)) * window
            idx = starts[:, None] + torch.arange(window + 1)[None]
            x, y = stream[idx][:, :-1], stream[idx][:, 1:]
            logits = self.prefill(x)[0]
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                             reduction="sum"))
            count += y.numel()
        return total / count

    def recorded_scores(self, i: int) -> torch.Tensor:
        return torch.cat(self.scores[i])


def record_router_scores(spec, weights: dict[str, torch.Tensor], ids: list[int] | torch.Tensor, window: int
                         ) -> dict[int, torch.Tensor]:
    """{MoE layer: fp32 scores [tokens, num_experts]} of `ids` run in windows of `window` tokens (a shorter text
    runs as one window)."""
    stream = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    window = max(1, min(window, stream.numel() - 1))
    rec = RouterRecorder(spec, weights)
    rec.run(stream, window)
    return {i: rec.recorded_scores(i) for i in rec.moe_layers}
