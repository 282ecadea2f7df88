"""The graph pool: decode and verification steps through captured CUDA graphs (runtime/cuda_graph.py), one
DecodeGraph per (batch size, tokens per sequence), at most max_graphs of them, the least recently used dropped
first. It owns the graphs, their static KDA slots and which sequence's rows live there ("homes"), the padding of a
batch into a larger graph, and the per-token KDA buffers the verification graphs share."""
from __future__ import annotations

from collections import Counter, OrderedDict

import torch

from ...reference.kda import KDAState
from ..caches.latent_format import KVFormat
from ..caches.seq_state import SeqState, gather_kda
from .ledger import PageLedger


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class GraphPool:
    PADDED_CALLS = 8    # calls a batch size runs padded in a larger graph before its own is captured

    def __init__(self, compiled, graph, ledger: PageLedger, seqs: dict[int, SeqState], *, device, dtype,
                 kv: KVFormat, use_kernels: bool, max_batch: int, max_context: int, max_graphs: int, backend,
                 stats: Counter):
        self.compiled, self.spec, self.graph = compiled, compiled.spec, graph
        self.ledger = ledger
        self.seqs = seqs                            # every sequence of the engine (rows to re-home), read only
        self.device, self.dtype, self.kv, self.use_kernels = device, dtype, kv, use_kernels
        self.max_batch, self.max_context, self.max_graphs = max_batch, max_context, max_graphs
        self.backend = backend                      # a stand-in capture backend (tests); None: CUDA graphs
        self.stats = stats
        kinds = self.spec.layer_kinds
        self.kda_layers = [i for i, k in enumerate(kinds) if k == "kda"]
        self.mla_layers = [i for i, k in enumerate(kinds) if k == "mla"]
        self.graphs: OrderedDict = OrderedDict()    # (batch, tokens) -> DecodeGraph, least recently used first
        self.last_batch = None                      # (batch, tokens) of the previous decode / verification call
        self._graph_bt: dict = {}                   # (batch, tokens) -> (block-table key, slots) its graph holds
        self._rows_key, self._rows_dev = None, None # GraphPool._device_rows
        self.kda_tokens: dict = {}                  # tokens -> per-token KDA buffers the verification graphs share
        self.shape_calls: Counter = Counter()       # (batch, tokens) -> eager calls so far (graphs from the second)
        # a graph was captured this step, or the batch's KDA rows moved into a graph's slots (a batch that changed):
        # its time is no decode step's cost (the engine reads and clears it)
        self.untimed = False

    def choose(self, seqs: list[SeqState], tokens: int, graphable: bool, eligible: bool):
        """(the DecodeGraph a call of `tokens` tokens per sequence of `seqs` runs in, or None: eager; each
        sequence's slot row when the batch runs where its rows live, else None; the indexes of those joining).
        graphable: a decode or verification call; eligible: graphs are on and every MLA layer runs MQA."""
        batch = len(seqs)
        dg, home = None, None
        if graphable and eligible:
            home = self.home(seqs, tokens)
            dg = home[0] if home else self.decode_graph(batch, tokens)
            if dg is not None and (dg.report.mode != "graph"
                                   or max(s.length for s in seqs) + tokens > dg.capacity):
                dg = None                              # not capturable (reported) or past the last bucket
        self.last_batch = (batch, tokens) if graphable else None
        if graphable:
            self.shape_calls[(batch, tokens)] += 1
        at_home = dg is not None and home is not None and home[0] is dg
        return dg, (home[1] if at_home else None), (home[2] if at_home else ())

    def call(self, dg, seqs: list[SeqState], segments: list[list[int]], slots, joining):
        """Run the call in `dg`: (logits [B, T, V], the slot row of each sequence)."""
        captured, captured_s = len(dg.report.captured), sum(dg.report.captured.values())
        logits, slots = self.step(dg, seqs, segments, slots, joining)
        if dg.tokens == 1:
            logits = logits[:, None]
        if len(dg.report.captured) != captured:   # this step captured a bucket: its time is no decode rate
            self.untimed = True
            self.stats["graph_captures"] += 1
            self.stats["graph_capture_s"] += sum(dg.report.captured.values()) - captured_s
        self.stats["decode_graph_calls" if dg.tokens == 1 else "verify_graph_calls"] += 1
        return logits, slots

    def decode_graph(self, batch: int, tokens: int = 1):
        """The DecodeGraph of this batch size and tokens per sequence (1: decode; more: speculative verification)
        over the engine's page pools (created, not captured, on first use): length buckets of page_size x 2^k up
        to max_context, each captured on its first step. A shape without its graph runs in the smallest larger
        batch's graph of the same tokens (padding rows, GraphPool.step) when that one is at most twice its
        size, or until its own is due; None while the shape is new and no larger graph exists (an eager call)."""
        from ..cuda_graph import DecodeGraph

        key = (batch, tokens)
        # a decode shape gets its graph on its second call in a row (a batch that shrinks every step stays eager);
        # a verification shape on its second call at all (verifications alternate with plain decode steps)
        turn = self.last_batch == key or (tokens > 1 and self.shape_calls[key] >= 2)
        dg = self.graphs.get(key)
        if dg is None:
            # a larger batch's graph runs this one with padding rows: one of up to twice the batch always, a larger
            # one until this shape's own graph is due and it has run PADDED_CALLS times (a capture costs ~10 eager
            # steps; the tail of a batch whose requests finish one by one passes through sizes for a few steps
            # each, and under speculation through verification shapes too)
            larger = sorted((g for (b, t), g in self.graphs.items() if t == tokens and b > batch),
                            key=lambda g: g.batch)
            dg = next((g for g in larger if g.batch <= 2 * batch), None)
            if dg is None and larger and not (turn and self.shape_calls[key] >= self.PADDED_CALLS):
                dg = larger[0]
            key = (dg.batch, tokens) if dg is not None else key
        if dg is not None:
            self.graphs.move_to_end(key)
            return dg
        if not turn:
            return None
        while len(self.graphs) >= self.max_graphs:
            old_key, old = self.graphs.popitem(last=False)
            self.rehome(old, set())
            self._graph_bt.pop(old_key, None)
        ps, buckets, b = self.ledger.pool.page_size, [], self.ledger.pool.page_size
        while b < self.max_context:
            buckets.append(b)
            b *= 2
        dg = DecodeGraph(self.compiled, self.graph, batch=batch, capacity=self.max_context, device=self.device,
                         use_kernels=self.use_kernels, dtype=self.dtype, kv=self.kv, page_size=ps,
                         buckets=buckets, tokens=tokens,
                         kda_slots=next((g.kda for (b, _), g in self.graphs.items() if b == batch), None),
                         kda_tokens=self.verify_buffers(tokens) if tokens > 1 else None,
                         backend=self.backend, pools=self.ledger.pool.pools if self.mla_layers else None)
        self.graphs[key] = dg
        self.stats["decode_graphs_created"] += 1
        return dg

    def verify_buffers(self, tokens: int) -> dict:
        """{KDA layer: KDATokens of max_batch rows}: the per-token states every verification graph of `tokens`
        tokens writes into its first rows (tokens x max_batch x the state's bytes once, not per batch size)."""
        from ..cuda_graph import kda_token_buffers

        if tokens not in self.kda_tokens:
            self.kda_tokens[tokens] = kda_token_buffers(self.compiled, self.max_batch, tokens, self.dtype,
                                                         self.device)
        return self.kda_tokens[tokens]

    def rehome(self, dg, members: set[int]) -> None:
        """Sequences (other than `members`, by id) whose KDA rows live in dg's slots get their own copy, before the
        slots are overwritten or dropped."""
        for other in self.seqs.values():
            if id(other) in members:
                continue
            for i in self.kda_layers:
                r = other.kda.get(i)
                if r is not None and r[0] is dg.kda[i]:
                    st, j = r
                    other.kda[i] = (KDAState(st.state[j:j + 1].clone(), tuple(t[j:j + 1].clone() for t in st.conv)),
                                    0)

    def home(self, seqs: list[SeqState], tokens: int):
        """(graph, each sequence's row, the sequences joining) when one batch size's KDA slots already hold the rows
        of most of these sequences (one row in every layer, no two alike), that batch is at least len(seqs) and at
        most twice it, and its graph of `tokens` tokens exists: the call runs there with those rows in place (a
        departed request's row is a padding row) and each sequence not yet there (a request admitted in place of
        one that finished) copied into a free row, instead of the whole batch being gathered into a graph's slots
        (~1 ms at batch 32 of k3-stdlib, each time a request of a busy server is replaced or a speculating batch
        shrinks). None otherwise."""
        if not self.kda_layers:
            return None
        first = self.kda_layers[0]
        holders = {id(g.kda[first]): g for g in self.graphs.values()}
        votes = Counter(id(r[0]) for r in (s.kda.get(first) for s in seqs) if r is not None and id(r[0]) in holders)
        if not votes:
            return None
        home = holders[votes.most_common(1)[0][0]]
        if not len(seqs) <= home.batch <= 2 * len(seqs):
            return None
        key = (home.batch, tokens)
        dg = self.graphs.get(key)
        placed = self._placed(home, seqs) if dg is not None else None
        if placed is None:
            return None
        self.graphs.move_to_end(key)
        return (dg, *placed)

    def _placed(self, dg, seqs: list[SeqState]) -> tuple[list[int], list[int]] | None:
        """(each sequence's row in dg's KDA slots, the indexes of those to copy in): a sequence keeps the row its
        states live in, the others take free rows; None when more than a quarter would be copied (then one gather of
        the batch costs less than row-by-row moves)."""
        rows: list[int | None] = []
        taken: set[int] = set()
        for s in seqs:
            j = self._row_in(dg, s)
            if j in taken:
                j = None
            if j is not None:
                taken.add(j)
            rows.append(j)
        joining = [k for k, j in enumerate(rows) if j is None]
        if len(joining) > max(1, len(seqs) // 4):
            return None
        free = (j for j in range(dg.batch) if j not in taken)
        for k in joining:
            rows[k] = next(free)
        return rows, joining

    def _row_in(self, dg, s: SeqState) -> int | None:
        """The row of dg's KDA slots sequence s's states live in (the same row in every layer), else None."""
        j = None
        for i in self.kda_layers:
            r = s.kda.get(i)
            if r is None or r[0] is not dg.kda[i] or (j is not None and r[1] != j):
                return None
            j = r[1]
        return j

    def _slots(self, dg, seqs: list[SeqState]) -> list[int] | None:
        """The row of dg's KDA slots each sequence's states live in, or None unless all of them live there (at one
        row in every layer, no two sequences at the same row)."""
        slots = [self._row_in(dg, s) for s in seqs]
        return slots if None not in slots and len(set(slots)) == len(slots) else None

    def step(self, dg, seqs: list[SeqState], segments: list[list[int]],
                    slots: list[int] | None = None, joining: list[int] = ()) -> tuple[torch.Tensor, list[int]]:
        """One decode step of `seqs` through `dg`: (their logits, the slot row each ran in). The batch's KDA rows live
        in dg's static slots: each sequence's state is a row reference to a slot, and a sequence whose rows are
        there runs in place; otherwise the batch is copied into rows 0..B-1, after any other sequence still
        referring to those slots got its own copy. The graph's other rows run as padding: token 0 at length 0 on
        the pool's scratch page, on whatever their KDA slots hold; every op is row-independent, so they change
        nothing the real rows see, and their outputs are dropped."""
        B, T, pad = len(seqs), dg.tokens, dg.batch - len(seqs)
        if slots is None:
            slots = self._slots(dg, seqs) if self.kda_layers else list(range(B))
        if slots is None or pad or joining:
            self.rehome(dg, {id(s) for s in seqs})   # slots about to be overwritten: give their rows a home
        if joining:                            # a request admitted in place of a finished one: into a free row
            self.stats["graph_slot_joins"] += len(joining)
            self._write_slots(dg, [seqs[k] for k in joining],
                              self.ledger.h2d(torch.tensor([slots[k] for k in joining], dtype=torch.long)))
        if slots is None:                      # the whole batch into rows 0..B-1
            slots = list(range(B))
            self.stats["graph_slot_gathers"] += 1
            self._write_slots(dg, seqs, slice(0, B))
        in_order = slots == list(range(B))
        rows = [[0] * T for _ in range(dg.batch)]
        lens = [0] * dg.batch
        for j, seg, s in zip(slots, segments, seqs):
            rows[j] = seg
            lens[j] = s.length
        if self.mla_layers:
            bt = self.ledger.block_table(seqs)
            key = (dg.batch, dg.tokens)
            held = self._graph_bt.get(key)
            if held is None or held[0] is not self.ledger.bt_key or held[1] != slots:   # changes once per page_size steps
                if not in_order or pad:
                    full = torch.full((dg.batch, bt.shape[1]), self.ledger.pool.scratch, dtype=bt.dtype, device=bt.device)
                    full[self._device_rows(slots)] = bt
                    bt = full
                dg.set_block_table(bt)
                self._graph_bt[key] = (self.ledger.bt_key, slots)
        dg.set_lengths(lens)
        self.stats["padded_graph_rows"] += pad
        out = dg.step(self.ledger.h2d(torch.tensor(rows, dtype=torch.long)))
        # the replay's output is overwritten next step
        return (out[:B].clone() if in_order else out.index_select(0, self._device_rows(slots))), slots

    def _write_slots(self, dg, seqs: list[SeqState], rows) -> None:
        """Copy these sequences' KDA states into `rows` of dg's slots (a slice, or a device index of one row per
        sequence): one gather and one copy per tensor and layer for all of them."""
        self.untimed = True                   # a step that moved rows is no cost sample of a plain step
        if isinstance(rows, slice):
            def zero(d):
                d[rows].zero_()

            def put(d, src):
                d[rows].copy_(src)
        else:
            def zero(d):
                d.index_fill_(0, rows, 0)

            def put(d, src):
                d.index_copy_(0, rows, src)
        for i in self.kda_layers:
            g = gather_kda([s.kda.get(i) for s in seqs])
            slot = dg.kda[i]
            if g is None:                      # no state yet: zeros
                for d in (slot.state, *slot.conv):
                    zero(d)
                continue
            if _shares(g.state, slot.state):   # rows of this very slot (a view of them): read before writing
                g = KDAState(g.state.clone(), tuple(t.clone() for t in g.conv))
            for d, src in zip((slot.state, *slot.conv), (g.state, *g.conv)):
                put(d, src)

    def _device_rows(self, slots: list[int]) -> torch.Tensor:
        """`slots` as a device index (the last one kept: a batch runs in the same rows for many steps)."""
        key = tuple(slots)
        if self._rows_key != key:
            self._rows_key, self._rows_dev = key, self.ledger.h2d(torch.tensor(slots, dtype=torch.long))
        return self._rows_dev
