"""What a request is made of at the engine's door: its checked token ids and stop ids, and what a step returns."""
from __future__ import annotations

import numbers

import torch

from ...errors import ArgumentError
from ..logits_processors import RowLogits
from ..session import check_token_ids

# reserve: a request is admitted when the pool holds its worst case (prompt + max_new_tokens) on top of what running
#   requests may still claim, so a step never runs short;
# optimistic: admitted when its prompt fits; a step that runs short preempts the most recently admitted sequences
#   (their state checkpointed into the prefix cache's tiers, or recomputed from their tokens without one) and
#   re-queues them first in line.
ADMISSIONS = ("reserve", "optimistic")


def token_ids(ids, name: str, vocab_size: int) -> list[int]:
    """`ids` (a 1-D tensor or a sequence of ints) as a non-empty list of ids in [0, vocab_size); ArgumentError
    naming `name` otherwise."""
    if isinstance(ids, torch.Tensor):
        check_token_ids(ids, name)                 # a float or bool tensor is not silently truncated
        if ids.dim() != 1:
            raise ArgumentError(f"{name} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    elif isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ArgumentError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    ids = list(ids)
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise ArgumentError(f"{name} must hold integer token ids, got {repr(bad)[:60]}")
    ids = [int(t) for t in ids]
    if not ids:
        raise ArgumentError(f"{name} must hold at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ArgumentError(f"{name}: token ids must be in [0, {vocab_size})")
    return ids


def stop_ids(ids, vocab_size: int) -> frozenset:
    """add_request's stop_token_ids, checked like a prompt (ids in the vocabulary); empty: none."""
    if isinstance(ids, (list, tuple, set, frozenset)) and not ids:
        return frozenset()
    return frozenset(token_ids(list(ids) if isinstance(ids, (set, frozenset)) else ids, "stop_token_ids",
                               vocab_size))


def segment_plan(seqs: dict, rids: list[int], segments, vocab_size: int, max_context: int) -> list[tuple]:
    """Engine.extend's arguments checked: [(opened sequence, its segment's token ids)]."""
    if len(rids) != len(segments):
        raise ArgumentError(f"{len(rids)} rids but {len(segments)} segments")
    if len(set(rids)) != len(rids):
        raise ArgumentError("a sequence may appear once per extend() call")
    plan = []
    for rid, seg in zip(rids, segments):
        seq = seqs.get(rid)
        if seq is None or seq.scheduled:
            raise ArgumentError(f"no opened sequence with id {rid} (open() one; requests are driven by step)")
        seg = token_ids(seg, f"segment of sequence {rid}", vocab_size)
        if seq.length + len(seg) > max_context:
            raise ArgumentError(f"sequence {rid}: {seq.length} cached + {len(seg)} new tokens exceed "
                                f"max_context {max_context}")
        plan.append((seq, seg))
    return plan


def check_adopted(n: int, kda: dict, latent: dict, kda_layers: list[int], widths: dict[int, int]) -> None:
    """Engine.adopt's states checked: one per KDA layer, latent rows [n, width] per MLA layer (`widths`)."""
    missing = [i for i in kda_layers if i not in kda] + [i for i in widths if i not in latent]
    if missing:
        raise ArgumentError(f"adopt(): no state given for layers {missing}")
    for i, width in widths.items():
        if tuple(latent[i].shape) != (n, width):
            raise ArgumentError(f"adopt(): layer {i} latent has shape {tuple(latent[i].shape)}, expected "
                                f"({n}, {width})")


def row_logits(logits, params) -> RowLogits | None:
    """add_request's `logits` (a RowLogits or None) with the sampling params' repetition penalty folded in (one rule,
    RowLogits'); None when nothing changes the request's logits."""
    if logits is not None and not isinstance(logits, RowLogits):
        raise ArgumentError(f"logits must be a RowLogits or None, got {type(logits).__name__}")
    if params.repetition_penalty != 1.0:
        if logits is None:
            logits = RowLogits(repetition_penalty=params.repetition_penalty)
        elif logits.repetition == 1.0:
            logits.repetition = params.repetition_penalty
    return logits if logits is not None and logits.active else None


def positive_ints(**values) -> None:
    """ArgumentError for the first of these arguments that is given (not None) and not a positive integer."""
    for name, v in values.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ArgumentError(f"{name} must be a positive integer, got {v!r}")


def positive_number(name: str, v) -> None:
    """ArgumentError unless `v` is None or a finite number above 0."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < float("inf")):
        raise ArgumentError(f"{name} must be a positive number, got {v!r}")


class StepOutput:
    """One emitted token: rid, token (chosen from `logits` under the request's SamplingParams, default greedy),
    logits ([vocab]), finished (max_new_tokens reached, or `token` is one of the request's stop tokens), seed (the
    seed of the request's draws, its own or drawn when it named none; None: greedy). A verification's outputs hold
    the call's [tokens, vocab] logits and their row (`row`): the [vocab] view is made when read, as most outputs'
    logits never are (a view a token is host time in every verification step). `error`: the exception choosing
    this request's token raised (then token is -1 and finished True: the request has left the engine; the other
    requests of the step are unaffected)."""

    __slots__ = ("rid", "token", "_logits", "_row", "finished", "seed", "error")

    def __init__(self, rid: int, token: int, logits: torch.Tensor, finished: bool, seed: int | None = None,
                 row: int | None = None, error: BaseException | None = None):
        self.rid, self.token, self._logits, self._row, self.finished, self.seed = (rid, token, logits, row,
                                                                                   finished, seed)
        self.error = error

    @property
    def logits(self) -> torch.Tensor:
        return self._logits if self._row is None else self._logits[self._row]

    def __repr__(self) -> str:
        err = f", error={type(self.error).__name__}" if self.error is not None else ""
        return f"StepOutput(rid={self.rid}, token={self.token}, finished={self.finished}, seed={self.seed}{err})"
