"""The runner: graph calls. It groups a plan into calls (rows of unequal lengths packed into one), takes the step's
pages from the ledger, makes the MLA mode choice of each call or group of a packed call (batch_mla_mode: the
kernels run what it chose), runs the call through a captured graph or eagerly, and commits the new KDA states and
lengths. It owns the mode statistics and the KDA traces of the last verification call."""
from __future__ import annotations

import time
from collections import Counter

import torch

from ..caches.context import CallContext
from ..caches.latent_format import KVFormat
from ..executor import LayerCaches, graph_binding
from ..caches.latent_store import LatentStore, PagedLatentCache
from ..kernel_impls.mla import batch_mla_mode
from ..caches.packed import GroupedEntry, segment_groups
from ..caches.seq_state import SeqState, gather_kda
from .graph_pool import GraphPool
from .ledger import PageLedger


def auto_mla_layers(module) -> dict[int, tuple]:
    """MLA layers whose op picks its mode at run time ("auto"): layer -> (key, attrs without the layer); layers of
    equal attrs share one choice."""
    out = {}
    for op in module.ops:
        if op.op == "mla_absorbed" and op.attr("mode", "auto") == "auto":
            attrs = {k: v for k, v in op.attr_dict.items() if k != "layer"}
            out[op.attr("layer")] = (repr(sorted(attrs.items())), attrs)
    return out


class Runner:
    def __init__(self, compiled, graph, ledger: PageLedger, graphs: GraphPool, *, target, kv: KVFormat,
                 dtype, device, max_batch: int, cuda_graphs: bool, stats: Counter, packed: bool = True):
        self.spec, self.graph, self.ledger, self.graphs = compiled.spec, graph, ledger, graphs
        self.target, self.kv, self.dtype, self.device = target, kv, dtype, device
        self.max_batch, self.cuda_graphs, self.stats = max_batch, cuda_graphs, stats
        self.packed = packed                       # rows of unequal lengths in one packed call (else one per length)
        self.kda_layers, self.mla_layers = graphs.kda_layers, graphs.mla_layers
        self._mla_auto = auto_mla_layers(compiled.module)
        self.last_modes: dict[int, str] = {}       # MLA layer -> mode of the last graph call
        self.mode_counts: Counter = Counter()      # (layer, mode) -> calls
        self.traces: dict = {}                     # rid -> (KDA trace of its last verification call, row, its
        #                                            DecodeGraph or None)

    def mla_modes(self, new: int, cached: list[int]) -> dict[int, str]:
        """{MLA layer: mode} for a call of `new` tokens per sequence after `cached` tokens (batch_mla_mode)."""
        memo: dict[str, str] = {}
        out = {}
        for layer, (key, attrs) in self._mla_auto.items():
            if key not in memo:
                memo[key] = batch_mla_mode(attrs, new, cached, self.target)
            out[layer] = memo[key]
        return out

    def run(self, plan, evict: bool, trace: set[int] = frozenset(), all_positions: bool = True
            ) -> dict[int, torch.Tensor]:
        """The plan's graph calls (`calls`, at most max_batch rows each). {rid: logits [T, V]}.
        trace: the ids of the sequences whose calls keep every token's KDA states (self.traces) for a rollback
        inside them (speculative verification); they run apart from prefill pieces of the same length.
        all_positions False: untraced rows get the logits of their last position only ([1, V]; lm_head runs on
        those rows alone), what a step samples from; a verification always gets every position's."""
        undo = self.ledger.reserve(plan, evict)
        out: dict[int, torch.Tensor] = {}
        done = set()
        try:
            for items, traced in self.calls(plan, trace):
                logits = self.call([s for s, _ in items], [g for _, g in items], trace=traced,
                                   all_positions=all_positions or traced)
                for (seq, _), rows in zip(items, logits):     # one call for every row's view
                    out[seq.rid] = rows
                    done.add(seq.rid)
        except BaseException:
            self.ledger.rollback([u for u in undo if u[0].rid not in done])
            self.ledger.commit([u for u in undo if u[0].rid in done])
            raise
        self.ledger.commit(undo)
        return out

    def calls(self, plan, trace: set[int]) -> list[tuple[list, bool]]:
        """The plan's rows as graph calls: [(items (seq, segment), traced)]. Verification rows run apart, one call
        per segment length (their KDA trace); the others, when their lengths differ and packing is on, in one
        packed call (decode rows and prefill chunks together, rows of equal length adjacent), else one call per
        length (a decode-only step's rows replay their CUDA graph)."""
        groups: dict[tuple, list] = {}
        for seq, seg in plan:
            traced = seq.rid in trace and len(seg) > 1
            groups.setdefault((len(seg), traced), []).append((seq, seg))
        plain = [k for k in groups if not k[1]]
        if self.packed and len(plain) > 1:
            rows = [item for k in sorted(plain, reverse=True) for item in groups.pop(k)]
            groups[(0, False)] = rows
        return [(items[i:i + self.max_batch], traced) for (_, traced), items in groups.items()
                for i in range(0, len(items), self.max_batch)]

    def call(self, seqs: list[SeqState], segments: list[list[int]], trace: bool = False,
             all_positions: bool = True) -> list[torch.Tensor]:
        """One graph call: rows of equal length (ids [B, T]) or of unequal lengths (a packed call, rows of equal
        length adjacent); trace: a verification call (T > 1) whose KDA inputs are kept for a rollback
        (self.traces), through a CUDA graph per (batch, T) like decode steps. Each row's logits: [T, V], or [1, V]
        (its last position) when not all_positions."""
        B, T = len(segments), len(segments[0])
        lens = [s.length for s in seqs]
        packed = any(len(g) != T for g in segments)
        modes = self.mla_modes(T, lens) if self.mla_layers and not packed else {}
        dg, slots, joining = self.graphs.choose(seqs, T, graphable=not packed and (T == 1 or trace),
                                                eligible=self.cuda_graphs and all(m == "mqa"
                                                                                 for m in modes.values()))
        if dg is not None:
            t0 = time.perf_counter()
            logits, slots = self.graphs.call(dg, seqs, segments, slots, joining)
            states, ran, kda_trace, group_modes = dg.kda, modes, dg.trace, ()
            rows = list(logits.unbind(0))
        else:
            slots = range(B)                           # the KDA state row of each sequence after the call
            rows, states, (ran, group_modes), kda_trace, t0 = self._eager(seqs, segments, modes, trace,
                                                                          all_positions)
        kind = "mixed" if packed else "decode" if T == 1 else "verify" if trace else "prefill"
        if trace:
            for j, seq in zip(slots, seqs):
                self.traces[seq.rid] = (kda_trace, j, dg)
        self.stats[f"{kind}_calls"] += 1
        self.stats[f"{kind}_seconds_launch"] += time.perf_counter() - t0     # host time (no device sync)
        if packed:                                 # tokens by what they are: one-token rows decode
            ones = sum(1 for g in segments if len(g) == 1)
            self.stats["decode_tokens"] += ones
            self.stats["prefill_tokens"] += sum(map(len, segments)) - ones
        else:
            self.stats[f"{kind}_tokens"] += B * T
        for j, seq, seg in zip(slots, seqs, segments):     # commit: nothing above changed a sequence
            for i in self.kda_layers:
                st = states[i]
                seq.kda[i] = st.row(j) if isinstance(st, GroupedEntry) else (st, j)
            self.ledger.written(seq, len(seg))
            seq.length += len(seg)
        self.last_modes = ran
        for layer, mode in group_modes or ran.items():       # a packed call: every group's
            self.mode_counts[(layer, mode)] += 1
        return rows

    def _eager(self, seqs: list[SeqState], segments: list[list[int]], modes: dict[int, str], trace: bool,
               all_positions: bool = True):
        """The call through the fx graph: (each row's logits, the KDA states after it, (the MLA modes it ran, a
        packed call's (layer, mode) per group), its KDA trace, when the launch began). Rows of unequal lengths run
        packed: ids [1, N], the groups and each group's MLA modes in the call context (caches/packed.py)."""
        lens = [s.length for s in seqs]
        groups = None
        if any(len(g) != len(segments[0]) for g in segments):
            groups = segment_groups([len(g) for g in segments],
                                    lambda t, a, b: self.mla_modes(t, lens[a:b]) if self.mla_layers else None)
            ids = torch.tensor([[t for g in segments for t in g]], dtype=torch.long)
        else:
            ids = torch.tensor(segments, dtype=torch.long)
        ctx = CallContext(graph_binding(self.graph), self.kv, mla_modes=modes, kda_trace={} if trace else None,
                          last_logits_only=not all_positions, groups=groups)
        cache = LayerCaches(self.spec.num_layers, ctx=ctx)
        for i in self.kda_layers:
            cache.layers[i] = gather_kda([s.kda.get(i) for s in seqs])
        if self.mla_layers:
            bt = self.ledger.block_table(seqs)
            for i in self.mla_layers:
                cache.layers[i] = PagedLatentCache(LatentStore(self.ledger.pool.pools[i], bt, list(lens)),
                                                   tuple(lens))
        ids = self.ledger.h2d(ids)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = self.graph(ids, cache)
        if groups is None:
            rows = list(logits.unbind(0))
        elif all_positions:
            rows = list(logits[0].split([len(g) for g in segments]))
        else:
            rows = list(logits[0].unsqueeze(1).unbind(0))
        return rows, cache.layers, (dict(ctx.modes), list(ctx.group_modes)), ctx.kda_trace, t0
