"""The MLA latent cache's stores (the absorbed MLA op's cache entries, cache.layers[layer]).

LatentStore: the page pool [pages, PS, width] and the block table i32 [B, max_pages] the kernels read, with each
sequence's high-water mark. PagedLatentCache: a view (per-sequence lengths) of a store; DeviceLenLatentCache: the
same with lengths on the device (what a captured decode step reads). The pool's dtype is the cache format
(latent_format). Pages of the B sequences of a Session store are interleaved (page p of sequence b is pool page
p*B + b) so growing the pool keeps every page id; the serving engine's pool places pages by its block pool. Entries
are never changed in place: a write after an entry's length goes into its store only while no other writer has gone
past that length (the store's high-water mark), otherwise the store is copied first (copy-on-write, `reserve`), so
an old LayerCaches snapshot stays valid (Session keeps one for failed calls).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class LatentStore:
    def __init__(self, pool: torch.Tensor, block_table: torch.Tensor, high: list[int]):
        self.pool, self.block_table, self.high = pool, block_table, list(high)

    @property
    def page_size(self) -> int:
        return self.pool.shape[1]

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.page_size



def interleaved_block_table(batch: int, pages: int, device) -> torch.Tensor:
    return (torch.arange(pages, device=device)[None, :] * batch
            + torch.arange(batch, device=device)[:, None]).to(torch.int32)



def new_store(batch: int, tokens: int, width: int, page_size: int, dtype, device) -> LatentStore:
    pages = 1 << max(0, (-(-max(tokens, 1) // page_size) - 1).bit_length())
    pool = torch.empty(pages * batch, page_size, width, dtype=dtype, device=device)
    return LatentStore(pool, interleaved_block_table(batch, pages, device), [0] * batch)



@dataclass(frozen=True)
class PagedLatentCache:
    store: LatentStore
    lens: tuple[int, ...]          # cached tokens per sequence

    @property
    def batch(self) -> int:
        return len(self.lens)

    def gather(self, start: int = 0, stop: int | None = None, seq: int | None = None) -> torch.Tensor:
        """Pool rows [start, stop) of every sequence (or of `seq`) as [B, n, width], in the pool's format (a copy;
        chunks only; latent_format.decode_rows gives the values)."""
        stop = max(self.lens) if stop is None else stop
        pos = torch.arange(start, stop, device=self.store.pool.device)
        ps = self.store.page_size
        bt = self.store.block_table if seq is None else self.store.block_table[seq:seq + 1]
        pages = bt[:, pos // ps].long()
        return self.store.pool[pages, (pos % ps)[None, :]]



def reserve(entry: PagedLatentCache | None, batch: int, new: int, width: int, page_size: int, dtype, device
            ) -> tuple[LatentStore, tuple[int, ...]]:
    """A store that may take `new` tokens after `entry` (allocated, grown or copied as needed) and the lengths.
    width / dtype: a new store's row format; a grown or copied one keeps its store's."""
    if entry is None:
        return new_store(batch, new, width, page_size, dtype, device), (0,) * batch
    if entry.batch != batch:
        raise ValueError(f"MLA cache holds {entry.batch} sequences, the call has {batch}")
    st, lens = entry.store, entry.lens
    need = max(lens) + new
    fresh = any(h != n for h, n in zip(st.high, lens))          # someone appended past this snapshot
    if need > st.capacity or fresh:
        pages_old = st.block_table.shape[1]
        pages = pages_old
        while pages * st.page_size < need:
            pages *= 2
        pool = torch.empty(pages * batch, st.page_size, st.pool.shape[-1], dtype=st.pool.dtype, device=device)
        pool[: pages_old * batch] = st.pool                      # interleaved ids survive growth
        bt = interleaved_block_table(batch, pages, device)
        bt[:, :pages_old] = st.block_table
        st = LatentStore(pool, bt, lens)
    return st, lens



@dataclass(frozen=True)
class DeviceLenLatentCache:
    """A paged latent cache whose per-sequence lengths are a device tensor (i32 [B]) rather than host ints: the
    form a decode step captured in a CUDA graph reads (k3c/runtime/cuda_graph.py). The kernel path writes the new
    rows at lens[b] and runs MQA with a grid sized for `max_len` tokens (fixed; each program masks by its own
    sequence's length), so nothing in the call depends on the current lengths on the host. The store is written in
    place (no copy-on-write, no growth): its owner keeps no snapshots and sized it for `max_len`."""
    store: LatentStore
    lens: torch.Tensor             # i32 [B]: cached tokens per sequence, on the device
    max_len: int                   # bound on lens + new tokens (sizes the decode grid)

    @property
    def batch(self) -> int:
        return self.lens.shape[0]
