"""A packed call: rows of unequal segment lengths in one graph call (the serving runner's mixed steps: decode rows
and prefill chunks together). Its tokens lie in one row of input ids, [1, N], grouped by segment length: group g
holds `rows` rows of `length` tokens each, row-major, after the groups before it. Ops without per-sequence state
(projections, norms, MoE, AttnRes: each token on its own) run once over all N tokens; an op that reads and writes
its layer's per-sequence cache entry (OpDef.sequence_state: KDA states, MLA latent pages) runs once per group on
its rows' slice of the entry ([rows, length] views of the packed tokens, no copy), and leaves a GroupedEntry."""
from __future__ import annotations

from dataclasses import dataclass

from ...reference.kda import KDAState
from .latent_store import LatentStore, PagedLatentCache


@dataclass(frozen=True)
class SegmentGroup:
    row: int                        # its first row among the call's rows
    rows: int
    token: int                      # its first token among the packed tokens
    length: int                     # tokens per row
    mla_modes: dict | None = None   # {MLA layer: mode} the caller chose for this group (CallContext.mla_modes)

    @property
    def tokens(self) -> int:
        return self.rows * self.length


def segment_groups(lengths: list[int], modes=None) -> tuple[SegmentGroup, ...]:
    """The groups of a call whose rows have these segment lengths, rows of equal length adjacent (the caller orders
    them so); modes(length, first_row, stop_row) -> the group's MLA modes, or None."""
    groups, row, token = [], 0, 0
    while row < len(lengths):
        stop = row
        while stop < len(lengths) and lengths[stop] == lengths[row]:
            stop += 1
        t = lengths[row]
        groups.append(SegmentGroup(row, stop - row, token, t, modes(t, row, stop) if modes else None))
        token += (stop - row) * t
        row = stop
    return tuple(groups)


def aligned(t):
    """t, or a copy when a slice left its address off 16 bytes (the compiled kernels assume aligned pointers: a
    block table's rows are a few int32 apart, a 4-head beta's tokens 8 bytes)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def entry_rows(entry, start: int, stop: int):
    """Rows start..stop of a layer's cache entry (views where aligned: KDA states are never changed in place, and an
    MLA store's pages are shared)."""
    if entry is None:
        return None
    if isinstance(entry, KDAState):
        return KDAState(aligned(entry.state[start:stop]), tuple(aligned(t[start:stop]) for t in entry.conv))
    if isinstance(entry, PagedLatentCache):
        st = entry.store
        return PagedLatentCache(LatentStore(st.pool, aligned(st.block_table[start:stop]), st.high[start:stop]),
                                entry.lens[start:stop])
    raise TypeError(f"a packed call cannot split a cache entry of type {type(entry).__name__} by rows")


@dataclass(frozen=True)
class GroupedEntry:
    """A layer's cache entry after a packed call: each group's own (its rows' new state)."""
    parts: tuple
    groups: tuple[SegmentGroup, ...]

    def row(self, r: int):
        """(the entry holding row r, r's row in it)."""
        for part, g in zip(self.parts, self.groups):
            if g.row <= r < g.row + g.rows:
                return part, r - g.row
        raise IndexError(f"row {r} is in no group of this call")
