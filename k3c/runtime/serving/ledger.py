"""The page ledger: the one writer of the MLA page pool's reference counts, of every sequence's page list
(`seq.pages`) and of the pages admitted requests may still claim (their budget). The scheduler, the runner,
speculation and the prefix cache ask it; none of them touches a reference count or a page list."""
from __future__ import annotations

import torch

from ..caches.block_pool import BlockPool, CacheFullError
from ..caches.seq_state import SeqState


class PageLedger:
    def __init__(self, pool: BlockPool, device: torch.device, h2d):
        self.pool = pool
        self.device = device
        self.h2d = h2d
        self.prefix = None                      # a PrefixCache whose device checkpoints may be moved for room
        self.budget: dict[int, int] = {}        # rid -> pages it may still claim (admission reserve)
        self.bt_key, self._bt = None, None      # the last block table (reused while no page list changes)

    # -- budgets ------------------------------------------------------------------------------------------------
    def outstanding(self) -> int:
        """Pages promised to admitted requests and not yet claimed."""
        return sum(max(0, b) for b in self.budget.values())

    def promise(self, rid: int, pages: int) -> None:
        self.budget[rid] = pages

    def unpromise(self, rid: int) -> None:
        self.budget.pop(rid, None)

    def make_room(self, need: int, guard: int = 0, outstanding: bool = False) -> bool:
        """Move prefix-cache checkpoints off their pages (sparing what `guard` keeps) until `need` pages are free
        (beyond the outstanding promises when `outstanding`). Whether they are."""
        def free():
            return self.pool.num_free - (self.outstanding() if outstanding else 0)
        while free() < need and self.prefix is not None and self.prefix.evict_for_pages(guard):
            pass
        return free() >= need

    # -- whole sequences ----------------------------------------------------------------------------------------
    def release(self, seq: SeqState) -> None:
        """Every page of `seq` goes back (its promise too)."""
        self.budget.pop(seq.rid, None)
        self.pool.decref(seq.pages)
        seq.pages = []

    def adopt(self, seq: SeqState, rows: dict[int, torch.Tensor], n: int) -> None:
        """`seq` gets pages holding `rows` {MLA layer: [n, width]} (CacheFullError before anything changes)."""
        pages = self.pool.alloc(self.pool.pages_for(n))
        self.pool.write_rows(pages, rows, n)
        seq.pages = pages

    def share(self, seq: SeqState, pages: list[int]) -> None:
        """`seq` resumes on a device checkpoint's pages: it holds them too."""
        self.pool.incref(pages)
        seq.pages = list(pages)

    def restore(self, seq: SeqState, n: int, page_rows) -> None:
        """`seq` resumes on n fresh pages filled from `page_rows` (one {MLA layer: rows} per page, from a tier)."""
        pages = self.pool.alloc(n)
        for p, rows in zip(pages, page_rows):
            self.pool.write_page(p, rows)
        seq.pages = pages

    def hold(self, pages: list[int]) -> None:
        """A prefix-cache checkpoint keeps these pages."""
        self.pool.incref(pages)

    def drop(self, pages: list[int]) -> None:
        """A prefix-cache checkpoint lets these pages go."""
        self.pool.decref(pages)

    def rewind(self, seq: SeqState, n: int) -> None:
        """Release the MLA rows of `seq` past its first n tokens: pages wholly past them go back to the pool (and
        to the request's page budget); the last kept page's high-water mark comes down to n (rows written in place
        on a shared page were past every other holder's: needs() copies otherwise)."""
        pool = self.pool
        if not pool.used:
            return
        keep = pool.pages_for(n)
        extra = seq.pages[keep:]
        if extra:
            pool.decref(extra)
            seq.pages = seq.pages[:keep]
            if seq.rid in self.budget:
                self.budget[seq.rid] += len(extra)
        if n % pool.page_size:
            p = seq.pages[n // pool.page_size]
            pool.filled[p] = min(pool.filled[p], n % pool.page_size)

    def written(self, seq: SeqState, tokens: int) -> None:
        """A call wrote `tokens` rows after seq.length (the caller advances seq.length)."""
        self.pool.mark_written(seq.pages, seq.length, seq.length + tokens)

    # -- a step's pages -----------------------------------------------------------------------------------------
    def needs(self, plan) -> list[tuple[int, bool]]:
        """(new pages, whether the partly filled last page must be copied first) per (seq, segment)."""
        pool, ps = self.pool, self.pool.page_size
        out = []
        writing = set()       # shared partial pages a sequence of this plan writes in place
        for seq, seg in plan:
            off = seq.length % ps
            cow = False
            if pool.used and off:
                page = seq.pages[seq.length // ps]
                # two holders of one partial page (a sequence and one resumed from its checkpoint) may both be at
                # the same row in one call: the filled count cannot tell them apart, so the second one copies
                cow = pool.needs_copy(page, off) or (pool.ref[page] > 1 and page in writing)
                if not cow:
                    writing.add(page)
            out.append((pool.pages_for(seq.length + len(seg)) - len(seq.pages), cow))
        return out

    def pages_needed(self, plan) -> int:
        return sum(new + cow for new, cow in self.needs(plan))

    def check_room(self, plan) -> None:
        """CacheFullError now, before anything changes, if the whole plan cannot get its pages."""
        pool = self.pool
        need = self.pages_needed(plan)
        if not self.make_room(need):
            raise CacheFullError(f"MLA cache full: this call needs up to {need} pages, {pool.num_free} of "
                                 f"{pool.num_pages} are free (page size {pool.page_size}); finish sequences or give "
                                 "the engine more num_pages")

    def reserve(self, plan, evict: bool) -> list:
        """Pages for every (seq, segment) of a step, or CacheFullError with nothing changed. Returns the undo log."""
        pool, ps = self.pool, self.pool.page_size
        needs = self.needs(plan)
        total = sum(new + cow for new, cow in needs)
        # pages promised to admitted requests stay theirs unless this plan is theirs
        if pool.used and total > pool.num_free and evict:
            self.make_room(total)
        if total > pool.num_free:
            raise CacheFullError(f"MLA cache full: this step needs {total} pages, {pool.num_free} of "
                                 f"{pool.num_pages} are free (page size {ps}); finish requests or give the engine "
                                 "more num_pages")
        undo = []
        for (seq, seg), (new, cow) in zip(plan, needs):
            before = list(seq.pages)
            if cow:
                idx = seq.length // ps
                fresh = pool.alloc(1)[0]
                pool.copy_page(seq.pages[idx], fresh, seq.length % ps)
                seq.pages[idx] = fresh
            seq.pages.extend(pool.alloc(new))
            undo.append((seq, before))
            if seq.rid in self.budget:
                self.budget[seq.rid] -= new + cow
        return undo

    def rollback(self, undo) -> None:
        for seq, before in undo:
            self.pool.decref([p for p in seq.pages if p not in before])
            seq.pages = before

    def commit(self, undo) -> None:
        for seq, before in undo:        # pages replaced by a copy lose this sequence's reference
            self.pool.decref([p for p in before if p not in seq.pages])

    def block_table(self, seqs: list[SeqState]) -> torch.Tensor:
        """The call's block table; the previous one when no page list changed (decode: all but one step in
        page_size), so a step does no host-to-device copy for it."""
        key = tuple(tuple(s.pages) for s in seqs)
        if key != self.bt_key:
            self._bt = self.pool.block_table([list(p) for p in key], self.device, h2d=self.h2d)
            self.bt_key = key
        return self._bt
