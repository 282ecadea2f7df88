"""Restoring KDA layers to a token inside a multi-token call (speculative verification).

A KDA layer's recurrent state and conv tails cannot be "un-appended": after a verification call of T tokens, a
sequence that keeps only the first n < T of them needs the state after token n. k3c recomputes it from the chunk
start: while the call runs, every KDA op records its inputs (the projections entering the layer's attention op,
[B, T, ...]) and the state it started from (`record`, when the cache carries a `kda_trace` dict); afterwards
`replay_prefix` runs the same op implementation (the kernels or the torch path that ran) on the first n tokens of
the chosen rows, from that state. Cost: one KDA attention op over n tokens per layer and group of equal n, against
keeping per-token states (T x the state, 38 MB a sequence at k3-wide, written on every call whether or not a token
is rejected): recomputing only moves what a rejection needs (docs/runtime.md, "Speculative decoding").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..reference.kda import KDAState


@dataclass
class KDACall:
    """One KDA op of a traced call: the implementation that ran, its attrs / params, its data inputs ([B, T, ...]
    each) and the batch state it started from (None: every sequence fresh)."""

    fn: Callable
    attrs: Any
    params: dict
    data: tuple
    state: KDAState | None


def record(cache, fn: Callable, attrs, data: tuple, params: dict, state: KDAState | None) -> None:
    """Keep what replay_prefix needs of this KDA op, when the cache asks for it (speculative verification)."""
    trace = getattr(cache, "kda_trace", None)
    if trace is not None:
        trace[attrs["layer"]] = KDACall(fn, attrs, params, data, state)


class _OneLayer:
    """The cache interface a KDA op implementation uses: `layers[layer]` read, then replaced by the new state."""

    def __init__(self, layer: int, state: KDAState | None):
        self.layers = [None] * (layer + 1)
        self.layers[layer] = state


def replay_prefix(call: KDACall, rows: list[int], n: int) -> KDAState:
    """The state (batch of len(rows), in that order) after the first n tokens of the traced call's `rows`."""
    T = call.data[0].shape[1]
    if not 1 <= n <= T:
        raise ValueError(f"replay_prefix: n = {n} outside [1, {T}]")
    dev = call.data[0].device
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    data = tuple(x.index_select(0, idx)[:, :n] for x in call.data)
    st = call.state
    if st is not None:
        st = KDAState(st.state.index_select(0, idx), tuple(t.index_select(0, idx) for t in st.conv))
    layer = call.attrs["layer"]
    tmp = _OneLayer(layer, st)
    with torch.no_grad():
        call.fn(call.attrs, tmp, data, call.params)
    return tmp.layers[layer]
