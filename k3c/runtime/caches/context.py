"""The call context: what one graph call's op implementations need beyond their inputs, weights and cache entries,
set by the caller (Session, the serving runner, a DecodeGraph) and read by the kernel impls. It travels as
`LayerCaches.ctx` (every impl gets the LayerCaches), declared here instead of attributes set on the cache by whoever
calls and read back with getattr defaults."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..launcher import Binding
from .latent_format import AUTO, KVFormat


@dataclass
class CallContext:
    binding: Binding | None = None              # the model's kernels on its device (launcher.Binding: its artifact,
    #                                             Target and policy), owned by its Session / Engine; None: nothing
    #                                             bound (the device's own target, kernels JIT-compiled)
    kv: KVFormat = AUTO                         # the format of MLA stores made in this call (latent_format.kv_format)
    mla_modes: dict[int, str] | None = None     # {MLA layer: mode} the caller chose (the runner: batch_mla_mode);
    #                                             None or a layer missing: the op chooses with the same rule
    modes: dict[int, str] = field(default_factory=dict)    # {MLA layer: the mode its op ran}: written by the impls
    kda_trace: dict | None = None               # a speculative verification: {KDA layer: KDATokens} (kda_rollback)
    kda_token_buffers: dict = field(default_factory=dict)  # static per-token buffers to trace into (a CUDA graph's)
    last_logits_only: bool = False              # lm_head on each row's last position only (logits [B, 1, V]): a
    #                                             prefill whose prompt-position logits nobody asked for
    groups: tuple | None = None                 # a packed call (input ids [1, N]): its rows' SegmentGroups
    #                                             (caches/packed.py); None: rows of equal length, ids [B, T]
    group_modes: list = field(default_factory=list)     # a packed call: (MLA layer, mode) of each group's op

    @property
    def traced(self) -> bool:
        """Whether this call keeps per-token KDA states (a speculative verification)."""
        return self.kda_trace is not None

    def next_call(self) -> "CallContext":
        """The context of the caller's next call: the same binding and cache format, nothing this call chose or
        wrote."""
        return dataclasses.replace(self, mla_modes=None, modes={}, kda_trace=None, kda_token_buffers={}, groups=None,
                                   group_modes=[])


def call_binding(cache) -> Binding | None:
    """The Binding an op implementation launches through: its call context's (None for a weight transform run at
    load time, which has no cache)."""
    return None if cache is None else cache.ctx.binding
