"""The pieces of a packed call (runtime/caches/packed.py) and the gathering of KDA rows it relies on: groups of equal
segment lengths in packing order, a cache entry's rows as aligned views, a grouped entry's rows, and fresh rows
beside states whose shape is not the spec's (a sharded model's rank holds its own heads)."""
import pytest
import torch

from k3c.reference.kda import KDAState
from k3c.runtime.caches.latent_store import LatentStore, PagedLatentCache
from k3c.runtime.caches.packed import GroupedEntry, entry_rows, segment_groups
from k3c.runtime.caches.seq_state import gather_kda


def kda_state(rows: int, heads: int, fill: float) -> KDAState:
    return KDAState(torch.full((rows, heads, 4, 4), fill), tuple(torch.full((rows, heads * 4, 3), fill)
                                                                for _ in range(3)))


def test_groups_follow_the_rows_lengths():
    seen = []
    groups = segment_groups([5, 5, 3, 1, 1, 1], lambda t, a, b: seen.append((t, a, b)) or {0: f"m{t}"})
    assert [(g.row, g.rows, g.token, g.length, g.tokens) for g in groups] == [
        (0, 2, 0, 5, 10), (2, 1, 10, 3, 3), (3, 3, 13, 1, 3)]
    assert seen == [(5, 0, 2), (3, 2, 3), (1, 3, 6)] and groups[1].mla_modes == {0: "m3"}
    (one,) = segment_groups([2, 2])
    assert one.tokens == 4 and one.mla_modes is None


def test_entry_rows_are_views_or_aligned_copies():
    st = kda_state(4, 2, 1.0)
    part = entry_rows(st, 1, 3)
    assert part.state.data_ptr() == st.state[1].data_ptr() and part.state.shape[0] == 2
    bt = torch.arange(12, dtype=torch.int32).view(4, 3)         # rows 12 bytes apart: row 1 is off 16
    cache = PagedLatentCache(LatentStore(torch.zeros(12, 8, 16), bt, [5, 6, 7, 8]), (5, 6, 7, 8))
    rows = entry_rows(cache, 1, 3)
    assert rows.store.block_table.data_ptr() % 16 == 0 and torch.equal(rows.store.block_table, bt[1:3])
    assert rows.lens == (6, 7) and rows.store.high == [6, 7] and rows.store.pool is cache.store.pool
    assert entry_rows(None, 0, 1) is None
    with pytest.raises(TypeError, match="cannot split"):
        entry_rows(torch.zeros(2, 3), 0, 1)


def test_a_grouped_entry_names_each_rows_part():
    groups = segment_groups([3, 1, 1])
    a, b = kda_state(1, 2, 1.0), kda_state(2, 2, 2.0)
    entry = GroupedEntry((a, b), groups)
    assert entry.row(0) == (a, 0) and entry.row(1) == (b, 0) and entry.row(2) == (b, 1)
    with pytest.raises(IndexError):
        entry.row(3)


def test_fresh_rows_take_the_shape_of_the_calls_states():
    """Two heads per rank (the spec has more): the fresh rows' zeros have two heads too, in the states' dtypes."""
    st = kda_state(2, 2, 3.0)
    st = KDAState(st.state, tuple(t.to(torch.bfloat16) for t in st.conv))
    got = gather_kda([None, (st, 1), None, None, (st, 0)])
    assert got.state.shape == (5, 2, 4, 4) and got.conv[0].shape == (5, 8, 3)
    assert got.conv[0].dtype == torch.bfloat16 and got.state.dtype == torch.float32
    assert torch.equal(got.state[[0, 2, 3]], torch.zeros(3, 2, 4, 4))
    assert torch.equal(got.state[[1, 4]], torch.full((2, 2, 4, 4), 3.0))
    assert gather_kda([None, None]) is None
