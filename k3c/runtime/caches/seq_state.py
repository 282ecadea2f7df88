"""Per-sequence serving state and its gathering into one batch.

A sequence owns: its tokens (prompt, appended segments, generated), how many the model has consumed, its MLA page
ids (block_pool.py), and per KDA layer a reference (KDAState of a batch, row) to its recurrent state and conv tails.
AttnRes keeps nothing across tokens (it mixes along depth, per position: K3.md section 4), so its block
representations live only inside one forward call and need no per-sequence slot.

KDA states are never changed in place (the kernels and the reference return new tensors), so a batch's output
state is shared by reference: the next step of the same batch passes it back as is (no copy); a changed batch
gathers the rows it needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...reference.kda import KDAState

RowRef = tuple[KDAState, int]


@dataclass
class SeqState:
    rid: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int = 0
    length: int = 0                               # tokens consumed by the model (cached)
    pages: list[int] = field(default_factory=list)
    kda: dict[int, RowRef | None] = field(default_factory=dict)
    generated: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None       # logits at position length-1
    resumed: int = 0                              # tokens taken from the prefix cache
    resumed_tier: str | None = None               # the tier they came from (device | host | disk)
    resumed_from: bytes | None = None             # the key of the checkpoint they came from
    preempted_at: int | None = None               # preempted (optimistic admission) at this length; back: None
    queued_at: float | None = None                # when it was queued (the prefix cache's clock)
    wants: bytes | None = None                    # waiting: the checkpoint it would resume from (kept resident)
    scheduled: bool = True                        # stepped by Engine.step (False: driven by Engine.extend)
    t_added: float = 0.0
    t_admitted: float | None = None               # when it joined the running batch (queueing ends)
    t_first: float | None = None

    @property
    def pending(self) -> int:
        """Tokens known but not yet consumed."""
        return len(self.tokens) - self.length

    @property
    def done(self) -> bool:
        return self.scheduled and len(self.generated) >= self.max_new_tokens


def row_state(ref: RowRef) -> KDAState:
    """One sequence's state as a batch of one (views, no copy)."""
    st, i = ref
    return KDAState(st.state[i:i + 1], tuple(t[i:i + 1] for t in st.conv))


def clone_row(ref: RowRef) -> KDAState:
    st = row_state(ref)
    return KDAState(st.state.clone(), tuple(t.clone() for t in st.conv))


def gather_kda(refs: list[RowRef | None]) -> KDAState | None:
    """The batch state of these rows; None when every sequence is fresh (the op starts from zeros)."""
    if all(r is None for r in refs):
        return None
    first = refs[0]
    if (first is not None and first[0].state.shape[0] == len(refs)
            and all(r is not None and r[0] is first[0] and r[1] == i for i, r in enumerate(refs))):
        return first[0]                          # the same batch as last step: pass it through
    # runs of consecutive rows of one batch state (or of fresh sequences) become one slice each: a sequence
    # leaving or joining costs a few slices per layer, not one per row
    runs: list[list] = []                        # [source state or None, first row, end row]
    for r in refs:
        src, i = (None, 0) if r is None else r
        last = runs[-1] if runs else None
        if last is not None and last[0] is src and (src is None or last[2] == i):
            last[2] += 1
        else:
            runs.append([src, i, i + 1])
    # a fresh row's zeros take their shape from a state of the call (a sharded model's states hold its rank's heads,
    # not the spec's)
    like = next(src for src, _, _ in runs if src is not None)
    parts = [KDAState(like.state.new_zeros((stop - start,) + like.state.shape[1:]),
                      tuple(t.new_zeros((stop - start,) + t.shape[1:]) for t in like.conv)) if src is None
             else KDAState(src.state[start:stop], tuple(t[start:stop] for t in src.conv))
             for src, start, stop in runs]
    if len(parts) == 1:
        return parts[0]
    return KDAState(torch.cat([s.state for s in parts]),
                    tuple(torch.cat([s.conv[j] for s in parts]) for j in range(3)))


def state_bytes(st: KDAState) -> int:
    return sum(t.numel() * t.element_size() for t in (st.state, *st.conv))
