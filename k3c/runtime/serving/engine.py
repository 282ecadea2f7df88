"""Serving engine: continuous batching over the compiled graph with a paged MLA latent cache.

    eng = Engine(model, w, device="cuda", max_batch=32, max_context=16384, prefix_cache=PrefixCache())
    rid = eng.add_request(prompt_ids, max_new_tokens=64,    # joins at the next step
                          sampling=SamplingParams(temperature=0.8, top_p=0.95), stop_token_ids=[eos_id])
    outs = eng.step()                                       # [StepOutput(rid, token, logits, finished, seed)]
    eng.finish(rid)                                         # leave early (finished requests leave by themselves)

Each step admits waiting requests (up to max_batch; a request is admitted only when the pool can hold its worst case
on top of what running requests may still claim, so a step never runs out of pages), feeds every running sequence
its next segment (its last generated token, or the rest of its prompt cut at prefix-cache checkpoint boundaries,
`prefill_chunk` and the step token budget: `max_step_tokens` bounds a step's tokens, decoding rows first, prompts
taking chunks of the rest in admission order; `itl_target_ms` further limits the prompt tokens of a step beside
decoding rows to what measured costs say fits the inter-token latency target: scheduler.StepBudget), runs them in
one graph call (rows of unequal lengths packed: decode rows and prompt chunks together, `packed_steps`; a
decode-only step replays its CUDA graph), and samples (runtime/sampling.py: greedy by default; a request with a
temperature draws from its own seeded generator). A prompt chunk resumes from the state its previous chunk left (KDA
states and conv tails per row, MLA latent rows in its pages), so chunked and whole prefill compute the same thing;
only each prompt's last position goes through lm_head in a step. Sequences of different lengths share a call: MLA
reads each one's pages and length from the block table, KDA states are per row, and the MLA mode (MHA / MQA) is
chosen per group of equal segment length from the cost model over all of them (runner.batch_mla_mode).

Lower level (what Session-like callers and tests drive): `open()` a sequence, `extend(rids, segments)` appends
segments and returns their logits; running out of pages there raises CacheFullError before anything changes.

The Engine is a facade over its rooms (docs/runtime.md, "Who owns what"): the ledger (pages), the scheduler
(admission, preemption, segments), the graph pool (captured graphs, KDA slot homes), the runner (calls, the MLA
mode choice) and speculation. It owns the requests themselves: their sequences, samplers and stop ids.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from ...errors import ArgumentError
from ...reference.kda import KDAState
from ..caches.block_pool import BlockPool, CacheFullError
from ..caches.latent_format import kv_format, row_width
from ..devices import host_to_device
from ..launcher import target_of
from ..logits_processors import RowLogits, process
from ..sampling import GREEDY, as_params, make_generator, params_for_rows, sample_rows
from ..caches.seq_state import SeqState
from ..executor import graph_binding
from ..session import _device, describe_graph, load_graph
from .graph_pool import GraphPool
from .ledger import PageLedger
from .requests import (ADMISSIONS, StepOutput, check_adopted, positive_ints, positive_number,
                       row_logits, segment_plan, stop_ids, token_ids)
from .runner import Runner
from .scheduler import Scheduler, StepBudget
from .speculation import Speculator


class Engine:
    def __init__(self, compiled, weights: dict[str, torch.Tensor], *, device: str = "cpu", max_batch: int = 8,
                 max_context: int | None = None, num_pages: int | None = None, page_size: int | None = None,
                 use_kernels: bool = True, prefix_cache=None, prefill_chunk: int | None = None, graph=None,
                 cuda_graphs: bool | None = None, graph_backend=None, max_graphs: int = 4,
                 kernel_policy: str = "artifact", kv_dtype: str = "auto", admission: str = "reserve",
                 speculation=None, max_step_tokens: int | None = None, itl_target_ms: float | None = None,
                 packed_steps: bool = True):
        spec = compiled.spec
        if any(op.op == "mla" for op in compiled.module.ops):
            raise ArgumentError("the serving engine needs the paged MLA cache: compile with the mla-absorb pass "
                                "(the default pipeline)")
        positive_ints(max_batch=max_batch, max_context=max_context, num_pages=num_pages, page_size=page_size,
                      prefill_chunk=prefill_chunk, max_step_tokens=max_step_tokens)
        positive_number("itl_target_ms", itl_target_ms)
        if admission not in ADMISSIONS:
            raise ArgumentError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        self.admission = admission
        self.compiled, self.spec = compiled, spec
        self.device = _device(device)
        self.max_batch = max_batch
        self.max_context = max_context or spec.max_context
        self.use_kernels = use_kernels
        self.prefill_chunk = prefill_chunk
        self.max_step_tokens, self.itl_target_ms, self.packed_steps = max_step_tokens, itl_target_ms, packed_steps
        self.dtype = weights["embed_tokens.weight"].dtype
        self.kv = kv_format(kv_dtype)                          # the MLA cache's format (latent_format.KVFormat)
        self.kv_pool_dtype = self.kv.pool_dtype(self.dtype)     # the page pool's rows
        # load_graph's graphs run the MLA mode the runner sets per call (batch_mla_mode)
        self.graph = graph if graph is not None else load_graph(compiled, weights, self.device, use_kernels,
                                                                kernel_policy=kernel_policy)
        self.kernel_policy = kernel_policy
        self.binding = graph_binding(self.graph)     # its kernels on the device (session.bind_kernels), which the
        self.target = target_of(self.binding, self.device)    # graph built with it (or given) holds
        self.kda_layers = [i for i, k in enumerate(spec.layer_kinds) if k == "kda"]
        self.mla_layers = [i for i, k in enumerate(spec.layer_kinds) if k == "mla"]
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ArgumentError(f"max_graphs must be a positive integer, got {max_graphs!r}")
        # decode steps through captured CUDA graphs (serving/graph_pool.py). None: on where they can be captured (a
        # CUDA device with kernels, or a stand-in backend)
        if cuda_graphs is None:
            cuda_graphs = graph_backend is not None or (self.device.type == "cuda" and use_kernels)
        self.cuda_graphs, self.max_graphs = cuda_graphs, max_graphs
        self.seqs: dict[int, SeqState] = {}
        self._sampling: dict[int, tuple] = {}      # rid -> (seeded SamplingParams, its generator) of sampled requests
        self._stop: dict[int, frozenset] = {}      # rid -> the token ids that end it
        self._logits: dict[int, RowLogits] = {}    # rid -> its penalties, biases, grammar (logits_processors.py)
        self._next_rid = 0
        self.stats = Counter()
        self._rooms(num_pages, page_size, prefix_cache, speculation, graph_backend)

    def _rooms(self, num_pages, page_size, prefix_cache, speculation, graph_backend) -> None:
        spec, h2d = self.spec, host_to_device(self.device)
        ps = page_size or self.target.mla_page_size
        width = row_width(spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, self.kv_pool_dtype) if spec.mla else 0
        pages = num_pages or self.max_batch * -(-self.max_context // ps)
        pool = BlockPool(pages, ps, {i: width for i in self.mla_layers}, self.kv_pool_dtype, self.device)
        self.ledger = PageLedger(pool, self.device, h2d)
        self.prefix = prefix_cache
        self.scheduler = Scheduler(self.ledger, max_batch=self.max_batch, admission=self.admission,
                                   prefill_chunk=self.prefill_chunk, prefix=prefix_cache, kda_layers=self.kda_layers,
                                   stats=self.stats, budget=StepBudget(
                                       self.max_step_tokens,
                                       None if self.itl_target_ms is None else self.itl_target_ms / 1000))
        if prefix_cache is not None:
            self.ledger.prefix = prefix_cache
            prefix_cache.attach(self.ledger, kda_layers=self.kda_layers, busy=lambda: bool(self.scheduler.running))
        self.graph_pool = GraphPool(self.compiled, self.graph, self.ledger, self.seqs, device=self.device,
                                    dtype=self.dtype, kv=self.kv, use_kernels=self.use_kernels,
                                    max_batch=self.max_batch, max_context=self.max_context,
                                    max_graphs=self.max_graphs, backend=graph_backend, stats=self.stats)
        self.runner = Runner(self.compiled, self.graph, self.ledger, self.graph_pool, target=self.target,
                             kv=self.kv, dtype=self.dtype, device=self.device, max_batch=self.max_batch,
                             cuda_graphs=self.cuda_graphs, stats=self.stats, packed=self.packed_steps)
        self.speculation = speculation              # runtime/speculative.py Speculation, or None
        self.speculator = None if speculation is None else Speculator(
            speculation, scheduler=self.scheduler, ledger=self.ledger, runner=self.runner, seqs=self.seqs,
            sampling=self._sampling, stop=self._stop, logits=self._logits, finish=self.finish, max_context=self.max_context,
            stats=self.stats)

    # -- what the rooms hold, read through the facade --------------------------------------------------------------
    pool = property(lambda self: self.ledger.pool, doc="the MLA page pool (the ledger's)")
    running = property(lambda self: self.scheduler.running, doc="the running batch (the scheduler's)")
    waiting = property(lambda self: self.scheduler.waiting, doc="the queue (the scheduler's)")
    last_modes = property(lambda self: self.runner.last_modes, doc="{MLA layer: mode} of the last graph call")
    mode_counts = property(lambda self: self.runner.mode_counts, doc="(layer, mode) -> calls")
    accept_counts = property(lambda self: self.speculator.accept_counts if self.speculator else Counter(),
                             doc="drafts kept in one sequence-verification -> how often")

    def mla_modes(self, new: int, cached: list[int]) -> dict[int, str]:
        """{MLA layer: mode} for a call of `new` tokens per sequence after `cached` tokens (batch_mla_mode)."""
        return self.runner.mla_modes(new, cached)

    def describe(self) -> str:
        return describe_graph(self.compiled, self.use_kernels)

    # -- requests -----------------------------------------------------------------------------------------------
    def _tokens(self, ids, name: str) -> list[int]:
        return token_ids(ids, name, self.spec.vocab_size)

    def _new_seq(self, tokens: list[int], max_new: int, scheduled: bool, register: bool = True) -> SeqState:
        seq = SeqState(self._next_rid, tokens, len(tokens), max_new, scheduled=scheduled, t_added=time.perf_counter())
        seq.kda = {i: None for i in self.kda_layers}
        return self._register(seq) if register else seq

    def _register(self, seq: SeqState) -> SeqState:
        self._next_rid += 1
        self.seqs[seq.rid] = seq
        return seq

    def add_request(self, prompt, max_new_tokens: int = 16, sampling=None, stop_token_ids=(), logits=None) -> int:
        """Queue a request (prompt: 1-D token ids); it joins the batch at the next step with room. It ends after
        max_new_tokens or after emitting one of `stop_token_ids` (the EOS id); `sampling` (SamplingParams, None:
        greedy) chooses its tokens, a seed of None drawn now (reported in each StepOutput); `logits` (a
        logits_processors.RowLogits: penalties, biases, a grammar) changes its logits first, and a grammar that
        is complete ends it. Returns its id."""
        tokens = self._tokens(prompt, "prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ArgumentError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        params = as_params(sampling).seeded()
        stop = stop_ids(stop_token_ids, self.spec.vocab_size)
        if len(tokens) + max_new_tokens > self.max_context:
            raise ArgumentError(f"prompt of {len(tokens)} + {max_new_tokens} new tokens exceeds max_context "
                                f"{self.max_context}")
        if self.pool.pages_for(len(tokens) + max_new_tokens) > self.pool.num_pages:
            raise CacheFullError(f"a request of {len(tokens) + max_new_tokens} tokens needs "
                                 f"{self.pool.pages_for(len(tokens) + max_new_tokens)} MLA pages, the pool has "
                                 f"{self.pool.num_pages}")
        seq = self._new_seq(tokens, max_new_tokens, scheduled=True)
        if not params.greedy:
            self._sampling[seq.rid] = (params, make_generator(params))
        if stop:
            self._stop[seq.rid] = stop
        logits = row_logits(logits, params)
        if logits is not None:
            self._logits[seq.rid] = logits
        self.scheduler.queue(seq)
        return seq.rid

    def open(self) -> int:
        """A sequence driven by extend() (not by step)."""
        return self._new_seq([], 0, scheduled=False).rid

    def adopt(self, tokens, kda: dict, latent: dict) -> int:
        """An opened sequence whose cache is given: `kda` {KDA layer: KDAState of batch 1}, `latent` {MLA layer:
        rows [len(tokens), L+R]} (a migrated or synthetic context). Pages are taken from the pool (CacheFullError
        when it cannot hold them, before anything changes)."""
        tokens = self._tokens(tokens, "tokens")
        n = len(tokens)
        if n > self.max_context:
            raise ArgumentError(f"{n} tokens exceed max_context {self.max_context}")
        check_adopted(n, kda, latent, self.kda_layers, {i: self.pool.pools[i].shape[-1] for i in self.mla_layers})
        seq = self._new_seq(tokens, 0, scheduled=False, register=False)
        self.ledger.adopt(seq, {i: latent[i] for i in self.mla_layers}, n)   # CacheFullError: nothing changed
        self._register(seq)
        seq.length = n
        seq.kda = {i: (KDAState(kda[i].state.to(self.device), tuple(t.to(self.device, self.dtype)
                                                                       for t in kda[i].conv)), 0)
                   for i in self.kda_layers}
        return seq.rid

    def finish(self, rid: int, checkpoint: bool = True) -> None:
        """Remove a sequence (running, waiting or opened): checkpoint it in the prefix cache (unless `checkpoint` is
        False: a request that failed leaves nothing behind), release its pages."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            raise ArgumentError(f"no sequence with id {rid}")
        self.scheduler.remove(seq)
        self._sampling.pop(rid, None)
        self._stop.pop(rid, None)
        self._logits.pop(rid, None)
        if self.speculation is not None:
            self.speculation.forget(rid)
        if self.prefix is not None:
            if seq.length > 0 and self.prefix.on_finish and checkpoint:
                self.prefix.insert(seq, final=True)
            else:
                self.prefix.forget(rid)
        self.ledger.release(seq)
        seq.kda = {}

    # -- stepping -----------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit, run one segment of every running sequence, sample; finished requests leave. With speculation,
        decoding sequences run their last token and a draft in one call and may emit several tokens."""
        t0 = time.perf_counter()               # the controller times whole steps: drafting to the last output
        step = self.last_plan = self.scheduler.plan()
        plan = step.segments
        # tried: the drafter was asked (a step that asked and found nothing is no cost sample); shadowing: a plain
        # step by the controller's choice, whose rows may shadow-draft (Speculator.while_device_runs)
        t_draft = time.perf_counter()
        spec = self.speculator
        drafts, tried, shadowing = spec.draft(plan) if spec is not None else ({}, False, False)
        # deciding not to verify is speculation's, no part of a plain step's cost: the controller weighs verifying
        # against decoding without speculation
        bookkeeping = 0.0 if drafts else time.perf_counter() - t_draft
        decoding = sum(1 for s, g in plan if len(g) == 1 and s.generated)
        if drafts:
            drafts, logits = spec.verification_call(plan, drafts)
        if not drafts:
            if self.admission == "optimistic":
                self.scheduler.fit(step)
                plan = step.segments
            logits = self.runner.run(plan, evict=True, all_positions=False) if plan else {}
        if spec is not None:
            spec.while_device_runs(plan, shadowing and not drafts)
        outs = spec.verify(drafts, logits) if drafts else []
        for seq in self.running:
            if seq.rid in logits and seq.rid not in drafts:
                seq.last_logits = logits[seq.rid][-1]
                self.scheduler.maybe_checkpoint(seq)
        outs += self._sample([s for s in self.running if not s.pending and s.last_logits is not None
                              and s.rid not in drafts])     # others: prefilling
        if spec is not None and decoding and decoding == len(plan) and (drafts or not tried):
            # the gain of a request is what its verifications emit when it has a draft (a step without one for most
            # rows does not verify: Speculation.worth)
            emitted = Counter(o.rid for o in outs if o.rid in drafts and drafts[o.rid][0]
                              and o.rid in self.seqs) if drafts else None
            self.speculation.observe([s.rid for s, _ in plan], time.perf_counter() - t0 - bookkeeping, emitted,
                                     timed=not self.graph_pool.untimed)
        if not drafts and not self.graph_pool.untimed:
            self.scheduler.budget.observe(step.decode_tokens, step.prefill_tokens, time.perf_counter() - t0)
        self.graph_pool.untimed = False
        self.stats["steps"] += 1
        return outs

    def _sample(self, ready: list[SeqState]) -> list[StepOutput]:
        """The next token of every sequence in `ready`: one sample (greedy rows: one argmax) and one device sync for
        the whole batch; a row whose sampling raises fails alone (sample_rows): it leaves with its error, the others
        keep their tokens."""
        drawn = [self._sampling.get(s.rid, (GREEDY, None)) for s in ready]
        procs = [self._logits.get(s.rid) for s in ready]
        picks = sample_rows(process(torch.stack([s.last_logits for s in ready]), procs, [s.tokens for s in ready],
                                    [s.prompt_len for s in ready]), [p for p, _ in drawn],
                            [g for _, g in drawn]) if ready else []
        now = time.perf_counter()
        outs = []
        for seq, tok, (params, _), proc in zip(ready, picks, drawn, procs):
            if isinstance(tok, BaseException):
                outs.append(StepOutput(seq.rid, -1, seq.last_logits, True, params.seed, error=tok))
                self.finish(seq.rid, checkpoint=False)
                continue
            self.stats["generated_tokens"] += 1
            seq.generated.append(tok)
            seq.tokens.append(tok)
            if seq.t_first is None:
                seq.t_first = now
                if self.speculation is not None:
                    self.speculation.prepare(seq.rid, seq.tokens)
            done = seq.done or tok in self._stop.get(seq.rid, ())
            if proc is not None:
                proc.accept(tok)
                done = done or proc.finished
            outs.append(StepOutput(seq.rid, tok, seq.last_logits, done, params.seed))
            if done:
                self.finish(seq.rid)
        return outs

    def rewind(self, rid: int, n: int, kda: dict) -> None:
        """An opened sequence back to its first n consumed tokens, with `kda` {KDA layer: row reference} its states
        at that point (kept from an earlier extend: states are never changed in place). The draft model's follow
        of its target (speculative.DraftModelDrafter)."""
        seq = self.seqs.get(rid)
        if seq is None or seq.scheduled:
            raise ArgumentError(f"no opened sequence with id {rid}")
        if not 0 <= n <= seq.length:
            raise ArgumentError(f"sequence {rid}: cannot rewind {seq.length} tokens to {n}")
        self.ledger.rewind(seq, n)
        seq.length = n
        del seq.tokens[n:]
        seq.kda = dict(kda)
        seq.last_logits = None

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def run(self) -> dict[int, list[int]]:
        """Step until every queued request has finished: {rid: generated tokens}. A request whose sampling failed
        raises its error (a server steps itself and fails that request alone)."""
        got: dict[int, list[int]] = {}
        while self.has_work():
            for o in self.step():
                if o.error is not None:
                    raise o.error
                got.setdefault(o.rid, []).append(o.token)
        return got

    def generate(self, prompts, max_new_tokens: int = 16, sampling=None, stop_token_ids=()) -> list[list[int]]:
        """Continuations of several prompts (any lengths), batched continuously; each ends after max_new_tokens or
        with a stop token (included). `sampling`: one SamplingParams per prompt, or one for all (prompt i drawing
        from seed + i: sampling.params_for_rows); None: greedy."""
        prompts = list(prompts)
        rows = params_for_rows(sampling, len(prompts))
        rids = [self.add_request(p, max_new_tokens, sampling=r, stop_token_ids=stop_token_ids)
                for p, r in zip(prompts, rows)]
        got = self.run()
        return [got[r] for r in rids]

    # -- explicit segments --------------------------------------------------------------------------------------
    def extend(self, rids: list[int], segments) -> list[torch.Tensor]:
        """Append segments (token id lists, any lengths) to opened sequences: their logits [T_i, vocab] each."""
        plan = segment_plan(self.seqs, rids, segments, self.spec.vocab_size, self.max_context)
        self.ledger.check_room(plan)
        for seq, seg in plan:
            seq.tokens.extend(seg)
        # rounds of pieces cut at prefix-cache checkpoint boundaries; a segment end is a prompt end
        out: dict[int, list[torch.Tensor]] = {r: [] for r in rids}
        try:
            while plan:
                logits = self.runner.run([(seq, self.scheduler.segment(seq)) for seq, _ in plan], evict=True)
                for seq, _ in plan:
                    out[seq.rid].append(logits[seq.rid])
                    seq.last_logits = logits[seq.rid][-1]
                    if self.prefix is not None and (not seq.pending or seq.length % self.prefix.interval == 0):
                        self.prefix.insert(seq)
                plan = [(seq, None) for seq, _ in plan if seq.pending]
        finally:
            for seq, _ in plan:                  # what was not consumed is not part of the sequence
                del seq.tokens[seq.length:]
        return [out[r][0] if len(out[r]) == 1 else torch.cat(out[r]) for r in rids]   # no copy: one piece
