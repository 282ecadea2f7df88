"""Restoring KDA layers to a token inside a multi-token call (speculative verification).

A KDA layer's recurrent state and conv tails cannot be "un-appended": after a verification call of T tokens, a
sequence that keeps only the first n < T of them needs the state after token n. k3c keeps the state after every
token of the call: a traced call (its CallContext carries a `kda_trace` dict) runs each KDA op token by token through the
one-token path that plain decoding runs (the fused decode kernel, or the reference recurrence), writing the state
and conv tails after token t into per-token buffers [T, B, ...] (`step_tokens`); `restore` then copies each row's
state after its kept count into the call's committed states, one gather per tensor and layer for the whole batch.

Why per-token states and not a recompute from the chunk start (what k3c did first): the recompute is one eager
KDA op per layer and kept-count group after the call, host-bound launches that cost 2 ms a rollback at
examples/k3-stdlib (0.34 ms a layer), more than the verification call itself; the per-token states cost T x the
state's bytes of writes inside the call, which a CUDA graph captures (docs/runtime.md, "Speculative decoding";
docs/perf.md has the figures). Stepping token by token also makes a verification's KDA numerics those of plain
decoding.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...reference.kda import KDAState


@dataclass
class KDATokens:
    """The states after each token of a traced call: states [T, B, H, K, V] fp32, conv tails (q, k, v) [T, B, C,
    kernel-1]; index t holds the state after token t + 1."""

    states: torch.Tensor
    conv: tuple[torch.Tensor, ...]

    @classmethod
    def like(cls, state: KDAState, tokens: int) -> "KDATokens":
        return cls(state.state.new_empty(tokens, *state.state.shape),
                   tuple(c.new_empty(tokens, *c.shape) for c in state.conv))

    def at(self, t: int) -> KDAState:
        return KDAState(self.states[t], tuple(c[t] for c in self.conv))

    @functools.cached_property
    def token_rows(self) -> tuple[tuple[torch.Tensor, ...], int]:
        """(states, *conv) each as a view [rows, ...] over its storage, and the rows from one token to the next (row
        b of token t is t * step + b): what `restore` gathers from (cached: a CUDA graph's buffers are static)."""
        flats, steps = [], set()
        for t in (self.states, *self.conv):
            row, inner = t.stride(1), t.shape[2:]
            inner_strides = torch.empty(inner, device="meta").stride()
            if t.stride()[2:] != inner_strides or t.stride(0) % row or (t.shape[1] > 1 and row != math.prod(inner)):
                raise ValueError("KDATokens: each token's rows must be contiguous")
            steps.add(t.stride(0) // row)
            rows = (t.shape[0] - 1) * (t.stride(0) // row) + t.shape[1]
            flats.append(t.as_strided((rows, *inner), (row, *inner_strides), t.storage_offset()))
        if len(steps) != 1:
            raise ValueError("KDATokens: states and conv tails of different row counts")
        return tuple(flats), steps.pop()

    def rows(self, batch: int) -> "KDATokens":
        """The first `batch` rows (views: each token's rows stay contiguous)."""
        return KDATokens(self.states[:, :batch], tuple(c[:, :batch] for c in self.conv))


def traced(cache) -> bool:
    """Whether this call keeps per-token KDA states (a speculative verification)."""
    return cache.ctx.traced


def step_tokens(cache, layer: int, data: tuple, state: KDAState, step: Callable) -> tuple[torch.Tensor, KDAState]:
    """A KDA op of a traced call run token by token: step(data_t, state, out) with data_t the op's inputs at token t
    ([B, 1, ...] each) runs one token from `state` and returns (its output [B, 1, ...], the new state); the new
    state lands in `out`, this token's buffers (a step may write it there itself, else it is copied). The buffers
    are the call's static ones (`ctx.kda_token_buffers`, a CUDA graph's) when it has them, else new; they are
    recorded in ctx.kda_trace. Returns (the outputs [B, T, ...], the state after the last token)."""
    T = data[0].shape[1]
    bufs = cache.ctx.kda_token_buffers.get(layer)
    if bufs is None or bufs.states.shape[:2] != (T, state.state.shape[0]) or not bufs.states[0].is_contiguous():
        bufs = KDATokens.like(state, T)
    outs = []
    for t in range(T):
        out = bufs.at(t)
        y, new = step(tuple(x[:, t:t + 1] for x in data), state, out)
        if new.state is not out.state:
            out.state.copy_(new.state)
            for d, src in zip(out.conv, new.conv):
                d.copy_(src)
        outs.append(y)
        state = out
    cache.ctx.kda_trace[layer] = bufs
    return torch.cat(outs, 1), state


def restore(trace: dict[int, KDATokens], states: dict[int, KDAState], keeps: list[int]) -> None:
    """Row b of each KDA layer's committed state (states[layer], the call's rows in order) back to its state after
    the first keeps[b] tokens of the traced call (1 <= keeps[b] <= T), in place: one index_select into the
    destination per tensor and layer, with one index for the batch (a verification of 32 sequences restores 24
    tensors at k3-stdlib: host dispatch, not bytes, is what this costs)."""
    if not trace:
        return
    first = next(iter(trace.values())).states
    T, B = first.shape[:2]
    if not _needs_restore(keeps, T, B):
        return
    if len(set(keeps)) == 1:                         # one kept count: a slice, no index tensor
        for layer, bufs in trace.items():
            dst = states[layer]
            dst.state.copy_(bufs.states[keeps[0] - 1])
            for d, s in zip(dst.conv, bufs.conv):
                d.copy_(s[keeps[0] - 1])
        return
    _gather_rows(trace, states, lambda step: _to_device(torch.tensor([(k - 1) * step + b for b, k in enumerate(keeps)]),
                                                        first.device))


def _needs_restore(keeps: list[int], tokens: int, batch: int) -> bool:
    """Whether keep counts (one a row, each in [1, tokens]; else ValueError) leave any row to restore."""
    if len(keeps) != batch or not all(1 <= k <= tokens for k in keeps):
        raise ValueError(f"restore: keep counts {keeps} for {batch} rows of a {tokens}-token call")
    return not all(k == tokens for k in keeps)


def _gather_rows(trace: dict[int, KDATokens], states: dict[int, KDAState], index_for) -> None:
    """Every layer's state and conv tails gathered from its trace rows: index_for(step) gives the flat row indices
    (row b of token t is t * step + b), made once per step size."""
    index: dict[int, torch.Tensor] = {}
    for layer, bufs in trace.items():
        flats, step = bufs.token_rows
        if step not in index:
            index[step] = index_for(step)
        dst = states[layer]
        for d, flat in zip((dst.state, *dst.conv), flats):
            # straight into d, unless d is a view of the buffer itself (an eager call's state after its last token)
            if d.is_contiguous() and d.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                torch.index_select(flat, 0, index[step], out=d)
            else:
                d.copy_(flat.index_select(0, index[step]))


class CapturedRestore:
    """`restore` of one verification graph's static buffers (its per-token trace into its KDA slots) captured once
    by the graph's capture backend: a restore is then one host-to-device copy of the keep counts and one replay,
    where the eager one dispatches a gather per tensor and layer (24 at examples/k3-stdlib, ~0.2 ms of host time
    a verification at batch 32). The flat row indices are computed on the device inside the replay."""

    def __init__(self, backend, trace: dict[int, KDATokens], states: dict[int, KDAState]):
        self.backend, self.trace, self.states = backend, trace, states
        first = next(iter(trace.values())).states
        self.tokens, self.batch = first.shape[:2]
        self.keeps = torch.full((self.batch,), self.tokens, dtype=torch.long, device=first.device)
        # the counts' host side: one pinned buffer (a fresh pinned tensor a call can cost a pinned allocation,
        # which waits for the device); `_copied` marks when its last copy has left it
        cuda = first.device.type == "cuda"
        self._host = torch.empty(self.batch, dtype=torch.long, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self._rows = torch.arange(self.batch, device=first.device)
        self._replay = None

    def _body(self) -> tuple:
        _gather_rows(self.trace, self.states, lambda step: (self.keeps - 1) * step + self._rows)
        return ()

    def __call__(self, keeps: list[int]) -> None:
        """Row b of every layer's slots back to its state after the first keeps[b] tokens (1 <= keeps[b] <= T)."""
        if not _needs_restore(keeps, self.tokens, self.batch):
            return
        if self._copied is not None:
            self._copied.synchronize()                 # the previous counts have been copied out
        self._host.copy_(torch.tensor(keeps, dtype=torch.long))
        self.keeps.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self._replay is None:
            # the body reads trace buffers and writes the slots, never the reverse: running it again (the
            # backend's warm-ups, then the replay) gives the same rows
            self._replay, _ = self.backend.capture(self._body, self._body)
        self._replay()


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device (pinned staging, non-blocking copy)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
