"""Serving engine: continuous batching over the compiled graph with a paged MLA latent cache.

    eng = Engine(model, w, device="cuda", max_batch=32, max_context=16384, prefix_cache=PrefixCache())
    rid = eng.add_request(prompt_ids, max_new_tokens=64,    # joins at the next step
                          sampling=SamplingParams(temperature=0.8, top_p=0.95), stop_token_ids=[eos_id])
    outs = eng.step()                                       # [StepOutput(rid, token, logits, finished, seed)]
    eng.finish(rid)                                         # leave early (finished requests leave by themselves)

Each step admits waiting requests (up to max_batch; a request is admitted only when the pool can hold its worst case
on top of what running requests may still claim, so a step never runs out of pages), feeds every running sequence
its next segment (the rest of its prompt, cut at prefix-cache checkpoint boundaries and `prefill_chunk`, or its last
generated token), one graph call per group of equal segment length, and samples (runtime/sampling.py: greedy by
default; a request with a temperature draws from its own seeded generator). Sequences of different
lengths share a call: MLA reads each one's pages and length from the block table, KDA states are per row, and the
MLA mode (MHA / MQA) is chosen per call from the cost model over all of them (batch_mla_mode).

Lower level (what Session-like callers and tests drive): `open()` a sequence, `extend(rids, segments)` appends
segments and returns their logits; running out of pages there raises CacheFullError before anything changes.
"""
from __future__ import annotations

import numbers
import time
from collections import Counter, OrderedDict, deque

import torch

from ..analysis.cost import mla_mode_costs
from .devices import target_for
from ..errors import ArgumentError
from .block_pool import BlockPool, CacheFullError
from .executor import LayerCaches
from .kernel_impls.latent_format import check_kv_dtype, pool_dtype, row_width
from .kernel_impls.mla import LatentStore, PagedLatentCache
from ..reference.kda import KDAState
from .logits_processors import RowLogits, process
from .sampling import GREEDY, as_params, make_generator, params_for_rows, sample_rows
from .seq_state import SeqState, gather_kda
from .session import _device, check_token_ids, describe_graph, load_graph


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def batch_mla_mode(attrs, new: int, cached: list[int], target) -> str:
    """MHA or MQA for one MLA call of `new` tokens per sequence after `cached[b]` cached tokens, from the cost model
    (analysis.cost.mla_mode_costs) over every sequence of the call, on `target`:
      - MQA is one batched call (split-KV decode over each sequence's own pages, W_kvb read once): the cost of the
        whole batch at the mean cached length (exact: the cost is affine in the cached length);
      - MHA of equal lengths is one batched call too; of mixed lengths it runs one sequence at a time (each expands
        K/V from its own rows and reads W_kvb again): the sum of the per-sequence costs, B x the mean's.
    Every sequence counts: the first sequence's own choice can be the slower one for the batch."""
    b = len(cached)
    mean = sum(cached) / b
    both = mla_mode_costs(attrs, new, mean, target, batch=b)
    if len(set(cached)) == 1:
        return both.best
    mha = mla_mode_costs(attrs, new, mean, target, batch=1).mha.scaled(b)
    mha_s = mha.seconds({"bf16": target.peak_bf16_flops}, target.hbm_bytes_per_s)
    return "mha" if mha_s <= both.mqa_seconds else "mqa"


# reserve: a request is admitted when the pool holds its worst case (prompt + max_new_tokens) on top of what running
#   requests may still claim, so a step never runs short;
# optimistic: admitted when its prompt fits; a step that runs short preempts the most recently admitted sequences
#   (their state checkpointed into the prefix cache's tiers, or recomputed from their tokens without one) and
#   re-queues them first in line.
ADMISSIONS = ("reserve", "optimistic")


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


class Engine:
    PADDED_CALLS = 8    # calls a batch size runs padded in a larger graph before its own is captured

    def __init__(self, compiled, weights: dict[str, torch.Tensor], *, device: str = "cpu", max_batch: int = 8,
                 max_context: int | None = None, num_pages: int | None = None, page_size: int | None = None,
                 use_kernels: bool = True, prefix_cache=None, prefill_chunk: int | None = None, graph=None,
                 cuda_graphs: bool | None = None, graph_backend=None, max_graphs: int = 4,
                 kernel_policy: str = "artifact", kv_dtype: str = "auto", admission: str = "reserve",
                 speculation=None):
        spec = compiled.spec
        if any(op.op == "mla" for op in compiled.module.ops):
            raise ArgumentError("the serving engine needs the paged MLA cache: compile with the mla-absorb pass "
                                "(the default pipeline)")
        for name, v in (("max_batch", max_batch), ("max_context", max_context), ("num_pages", num_pages),
                        ("page_size", page_size), ("prefill_chunk", prefill_chunk)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ArgumentError(f"{name} must be a positive integer, got {v!r}")
        if admission not in ADMISSIONS:
            raise ArgumentError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        self.admission = admission
        self.compiled, self.spec = compiled, spec
        self.device = _device(device)
        self.max_batch = max_batch
        self.max_context = max_context or spec.max_context
        self.use_kernels = use_kernels
        self.prefill_chunk = prefill_chunk
        self.dtype = weights["embed_tokens.weight"].dtype
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.kv_pool_dtype = pool_dtype(kv_dtype, self.dtype)     # the page pool's row format (latent_format)
        # load_graph's graphs run the MLA mode the engine sets per call (cache.mla_modes, from batch_mla_mode)
        self.graph = graph if graph is not None else load_graph(compiled, weights, self.device, use_kernels,
                                                                kernel_policy=kernel_policy)
        self.kernel_policy = kernel_policy
        self.target = target_for(self.device)
        # MLA layers whose op picks its mode at run time ("auto"): attrs without the layer, for batch_mla_mode
        self._mla_auto: dict[int, tuple] = {}      # layer -> (key, attrs): layers of equal attrs share one choice
        for op in compiled.module.ops:
            if op.op == "mla_absorbed" and op.attr("mode", "auto") == "auto":
                attrs = {k: v for k, v in op.attr_dict.items() if k != "layer"}
                self._mla_auto[op.attr("layer")] = (repr(sorted(attrs.items())), attrs)
        self._bt_key, self._bt = None, None        # the last block table (reused while no page list changes)
        self.kda_layers = [i for i, k in enumerate(spec.layer_kinds) if k == "kda"]
        self.mla_layers = [i for i, k in enumerate(spec.layer_kinds) if k == "mla"]
        ps = page_size or target_for(self.device).mla_page_size
        width = row_width(spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, self.kv_pool_dtype) if spec.mla else 0
        pages = num_pages or max_batch * -(-self.max_context // ps)
        self.pool = BlockPool(pages, ps, {i: width for i in self.mla_layers}, self.kv_pool_dtype, self.device)
        self.seqs: dict[int, SeqState] = {}
        self.running: list[SeqState] = []
        self.waiting: deque[SeqState] = deque()
        self._budget: dict[int, int] = {}          # rid -> pages it may still claim (admission reserve)
        self._sampling: dict[int, tuple] = {}      # rid -> (seeded SamplingParams, its generator) of sampled requests
        self._stop: dict[int, frozenset] = {}      # rid -> the token ids that end it
        self._logits: dict[int, RowLogits] = {}    # rid -> its penalties, biases, grammar (logits_processors.py)
        self._next_rid = 0
        self.last_modes: dict[int, str] = {}       # MLA layer -> mode of the last graph call
        self.stats = Counter()
        self.mode_counts: Counter = Counter()      # (layer, mode) -> calls
        self.prefix = prefix_cache
        if prefix_cache is not None:
            prefix_cache.attach(self)
        self.speculation = speculation              # runtime/speculative.py Speculation, or None
        self._traces: dict = {}                     # rid -> (KDA trace of its last verification call, row, its
        #                                             DecodeGraph or None)
        self.accept_counts: Counter = Counter()     # drafts kept in one sequence-verification -> how often
        # a CUDA graph was captured this step, or the batch's KDA rows moved into a graph's slots (a batch that
        # changed): its time is no decode step's cost
        self._untimed = False
        # decode steps through captured CUDA graphs (runtime/cuda_graph.py), one DecodeGraph per batch size. None:
        # on where they can be captured (a CUDA device with kernels, or a stand-in backend). A batch size gets its
        # graph on its second decode step in a row (a capture costs ~10 eager steps: a batch that shrinks every
        # step stays eager); at most max_graphs graphs (each holds KDA slots for its batch size: B x 38 MB at
        # k3-wide), the least recently used one dropped first
        if cuda_graphs is None:
            cuda_graphs = graph_backend is not None or (self.device.type == "cuda" and use_kernels)
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ArgumentError(f"max_graphs must be a positive integer, got {max_graphs!r}")
        self.cuda_graphs = cuda_graphs
        self.max_graphs = max_graphs
        self._graph_backend = graph_backend         # a stand-in capture backend (tests); None: CUDA graphs
        self._graphs: OrderedDict = OrderedDict()   # (batch, tokens) -> DecodeGraph, least recently used first
        self._last_decode_batch = None              # (batch, tokens) of the previous decode / verification call
        self._graph_bt: dict = {}                   # (batch, tokens) -> (block-table key, slots) its graph holds
        self._rows_key, self._rows_dev = None, None # Engine._device_rows
        self._kda_tokens: dict = {}                 # tokens -> per-token KDA buffers the verification graphs share
        self._shape_calls: Counter = Counter()      # (batch, tokens) -> eager calls so far (graphs from the second)

    def describe(self) -> str:
        return describe_graph(self.compiled, self.use_kernels)

    # -- requests -----------------------------------------------------------------------------------------------
    def _tokens(self, ids, name: str) -> list[int]:
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
        if min(ids) < 0 or max(ids) >= self.spec.vocab_size:
            raise ArgumentError(f"{name}: token ids must be in [0, {self.spec.vocab_size})")
        return ids

    def _new_seq(self, tokens: list[int], max_new: int, scheduled: bool) -> SeqState:
        seq = SeqState(self._next_rid, tokens, len(tokens), max_new, scheduled=scheduled, t_added=time.perf_counter())
        seq.kda = {i: None for i in self.kda_layers}
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
        stop = self._stop_ids(stop_token_ids)
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
        if logits is not None and not isinstance(logits, RowLogits):
            raise ArgumentError(f"logits must be a RowLogits or None, got {type(logits).__name__}")
        if params.repetition_penalty != 1.0:          # the sampling params' penalty: one rule, RowLogits'
            if logits is None:
                logits = RowLogits(repetition_penalty=params.repetition_penalty)
            elif logits.repetition == 1.0:
                logits.repetition = params.repetition_penalty
        if logits is not None:
            if logits.active:
                self._logits[seq.rid] = logits
        self.waiting.append(seq)
        if self.prefix is not None:
            self.prefix.want(seq)
        return seq.rid

    def _stop_ids(self, ids) -> frozenset:
        """add_request's stop_token_ids, checked like a prompt (ids in the vocabulary); empty: none."""
        if isinstance(ids, (list, tuple, set, frozenset)) and not ids:
            return frozenset()
        return frozenset(self._tokens(list(ids) if isinstance(ids, (set, frozenset)) else ids, "stop_token_ids"))

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
        missing = [i for i in self.kda_layers if i not in kda] + [i for i in self.mla_layers if i not in latent]
        if missing:
            raise ArgumentError(f"adopt(): no state given for layers {missing}")
        for i in self.mla_layers:
            if tuple(latent[i].shape) != (n, self.pool.pools[i].shape[-1]):
                raise ArgumentError(f"adopt(): layer {i} latent has shape {tuple(latent[i].shape)}, expected "
                                    f"({n}, {self.pool.pools[i].shape[-1]})")
        pages = self.pool.alloc(self.pool.pages_for(n))
        self.pool.write_rows(pages, {i: latent[i] for i in self.mla_layers}, n)
        seq = self._new_seq(tokens, 0, scheduled=False)
        seq.pages, seq.length = pages, n
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
        if seq in self.waiting:
            self.waiting.remove(seq)
            if self.prefix is not None:
                self.prefix.unwant(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._budget.pop(rid, None)
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
        self.pool.decref(seq.pages)
        seq.pages, seq.kda = [], {}

    # -- admission ----------------------------------------------------------------------------------------------
    def _outstanding(self) -> int:
        return sum(max(0, b) for b in self._budget.values())

    def _admit(self) -> None:
        """Admit waiting requests in order while there is room. Under the prefix cache's working-set policy a
        request that must wait (its pages could only come from checkpoints it may not evict: PrefixCache.guard)
        lets those behind it try."""
        passed = []                             # requests left waiting this step, in queue order
        scan = self.prefix is not None and self.prefix.policy == "working-set"
        try:
            while self.waiting and len(self.running) < self.max_batch:
                seq = self.waiting.popleft()
                try:
                    admitted = self._admit_one(seq)
                except BaseException:
                    self.waiting.appendleft(seq)     # a refusal changes nothing: it stays first in line
                    raise
                if not admitted:
                    passed.append(seq)
                    if not scan:
                        break
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_one(self, seq: SeqState) -> bool:
        limit = seq.preempted_at               # a preempted sequence resumes where it stopped, if a tier kept it
        if self.prefix is not None and not self.prefix.resume(seq, limit) and self.running:
            self.stats["admission_waits"] += 1
            return False                    # its checkpoint is offloaded and there is no room yet to bring it back
        ps = self.pool.page_size
        worst = seq.prompt_len + seq.max_new_tokens if self.admission == "reserve" else len(seq.tokens)
        need = self.pool.pages_for(worst) - len(seq.pages)
        if self.pool.used and seq.length % ps:
            need += 1                      # the shared partial last page may be copied
        if self.admission == "optimistic":
            need += len(self.running)           # headroom: a page per running sequence for its next step
        guard = self.prefix.guard(seq) if self.prefix is not None else 0
        while self.pool.num_free - self._outstanding() < need and self.prefix is not None \
                and self.prefix.evict_for_pages(guard):
            pass
        if self.pool.num_free - self._outstanding() < need:
            self._unresume(seq)
            if not self.running and (not guard or not self.prefix.tiers()["device"]):
                # nothing will free pages (opened sequences hold them): waiting would be for ever
                raise CacheFullError(f"MLA cache full: request {seq.rid} needs {need} pages, "
                                     f"{self.pool.num_free} of {self.pool.num_pages} are free")
            self.stats["admission_waits"] += 1
            return False                    # wait for running requests to leave (or protected sessions to idle)
        self._budget[seq.rid] = need
        self.running.append(seq)
        seq.t_admitted = time.perf_counter()
        if seq.preempted_at is not None:        # back from a preemption: its prompt was counted once
            self.stats["restored_preempted"] += 1
            self.stats["restored_preempted_tokens"] += seq.resumed
            seq.preempted_at = None
            if self.prefix is not None:
                self.prefix.unwant(seq)
            return True
        self.stats["prompt_tokens"] += seq.prompt_len
        self.stats["resumed_tokens"] += seq.resumed
        if self.prefix is not None:
            self.prefix.record(seq)
        return True

    def _fit(self, plan):
        """Optimistic admission: the plan cut to what the pool can hold, after moving prefix checkpoints off their
        pages, by preempting the most recently admitted sequences (never the last one: a lone sequence always fits,
        add_request checks it)."""
        pool = self.pool
        while True:
            total = sum(new + cow for new, cow in self._needs(plan))
            while total > pool.num_free and self.prefix is not None and self.prefix.evict_for_pages():
                pass
            if total <= pool.num_free or len(plan) <= 1:
                return plan
            victim = max((s for s, _ in plan), key=lambda s: s.t_admitted)
            self._preempt(victim)
            plan = [(s, g) for s, g in plan if s is not victim]

    def _preempt(self, seq: SeqState) -> None:
        """Take a running sequence off the device: its state becomes a prefix-cache checkpoint (kept in a tier below
        the device when the cache has one, else dropped: the sequence is recomputed from its tokens), its pages go
        back, and it waits first in line. Its tokens, sampler and budget of new tokens stay as they were."""
        self.stats["preempted"] += 1
        if self.prefix is not None and seq.length and seq.last_logits is not None:
            self.prefix.park(seq)
        self.running.remove(seq)
        self._budget.pop(seq.rid, None)
        seq.preempted_at = seq.length
        self.pool.decref(seq.pages)
        seq.pages, seq.length, seq.resumed, seq.last_logits = [], 0, 0, None
        seq.kda = {i: None for i in self.kda_layers}
        self.waiting.appendleft(seq)
        if self.prefix is not None:
            self.prefix.want(seq, seq.preempted_at)

    def _unresume(self, seq: SeqState) -> None:
        self.pool.decref(seq.pages)
        seq.pages, seq.length, seq.resumed, seq.last_logits = [], 0, 0, None
        seq.kda = {i: None for i in self.kda_layers}

    # -- stepping -----------------------------------------------------------------------------------------------
    def _segment(self, seq: SeqState) -> list[int]:
        end = len(seq.tokens)
        if self.prefill_chunk:
            end = min(end, seq.length + self.prefill_chunk)
        if self.prefix is not None:
            iv = self.prefix.interval
            end = min(end, (seq.length // iv + 1) * iv)         # stop at the next checkpoint boundary
        return seq.tokens[seq.length:end]

    def step(self) -> list[StepOutput]:
        """Admit, run one segment of every running sequence, sample; finished requests leave. With speculation,
        decoding sequences run their last token and a draft in one call and may emit several tokens."""
        t0 = time.perf_counter()               # the controller times whole steps: drafting to the last output
        self._admit()
        plan = [(s, self._segment(s)) for s in self.running if s.pending > 0]
        # tried: the drafter was asked (a step that asked and found nothing is no cost sample); shadowing: a plain
        # step by the controller's choice, whose rows may shadow-draft (Engine._while_device_runs)
        t_draft = time.perf_counter()
        drafts, tried, shadowing = self._draft(plan) if self.speculation is not None else ({}, False, False)
        # deciding not to verify is speculation's, no part of a plain step's cost: the controller weighs verifying
        # against decoding without speculation
        bookkeeping = 0.0 if drafts else time.perf_counter() - t_draft
        decoding = sum(1 for s, g in plan if len(g) == 1 and s.generated)
        if drafts:
            spec_plan = [(s, drafts[s.rid][1] if s.rid in drafts else g) for s, g in plan]
            # drafts are optional: where their pages are not free they are dropped, never paid for by preempting
            # a sequence or evicting a prefix checkpoint (the plain plan below does what plain decoding would)
            if self.admission == "optimistic" and sum(n + c for n, c in self._needs(spec_plan)) > self.pool.num_free:
                drafts = {}
                self.stats["spec_fallbacks"] += 1
            else:
                try:
                    logits = self._run(spec_plan, evict=True, trace=set(drafts))
                except CacheFullError:        # the padded drafts do not fit beside the batch: decode plainly
                    drafts = {}
                    self.stats["spec_fallbacks"] += 1
        if not drafts:
            if self.admission == "optimistic":
                plan = self._fit(plan)
            logits = self._run(plan, evict=True) if plan else {}
        if self.speculation is not None:
            self._while_device_runs(plan, shadowing and not drafts)
        outs = self._verify(drafts, logits) if drafts else []
        for seq in self.running:
            if seq.rid in logits and seq.rid not in drafts:
                seq.last_logits = logits[seq.rid][-1]
                self._maybe_checkpoint(seq)
        ready = [s for s in self.running if not s.pending and s.last_logits is not None
                 and s.rid not in drafts]     # others: prefilling
        # one sample (greedy rows: one argmax) and one device sync for the whole batch; a row whose sampling
        # raises fails alone (sample_rows): it leaves with its error, the others keep their tokens
        drawn = [self._sampling.get(s.rid, (GREEDY, None)) for s in ready]
        procs = [self._logits.get(s.rid) for s in ready]
        picks = sample_rows(process(torch.stack([s.last_logits for s in ready]), procs, [s.tokens for s in ready],
                                    [s.prompt_len for s in ready]), [p for p, _ in drawn],
                            [g for _, g in drawn]) if ready else []
        now = time.perf_counter()
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
        if self.speculation is not None and decoding and decoding == len(plan) and (drafts or not tried):
            # the gain of a request is what its verifications emit when it has a draft (a step without one for most
            # rows does not verify: Speculation.worth)
            emitted = Counter(o.rid for o in outs if o.rid in drafts and drafts[o.rid][0]
                              and o.rid in self.seqs) if drafts else None
            self.speculation.observe([s.rid for s, _ in plan], time.perf_counter() - t0 - bookkeeping, emitted,
                                     timed=not self._untimed)
        self._untimed = False
        self.stats["steps"] += 1
        return outs

    # -- speculative decoding (runtime/speculative.py) ------------------------------------------------------------
    def _drafting_rows(self, plan) -> list[SeqState]:
        """The sequences of a plan that may draft: scheduled requests decoding one token, without logit changes (a
        verified draft's tokens are chosen from the raw logits: a grammar or penalty would not see them)."""
        return [s for s, g in plan if len(g) == 1 and s.generated and s.scheduled and s.rid not in self._logits]

    def _draft(self, plan) -> tuple[dict[int, tuple[list[int], list[int]]], bool, bool]:
        """({rid: (draft, the call's segment: last token + draft padded to the call's bucket)} for the decoding
        sequences of this plan that draft this step, empty when none does; whether the drafter was asked (False:
        speculation does not pay this step); whether the controller chose a plain step (its rows may shadow-draft)."""
        from .speculative import propose

        spec = self.speculation
        rows = self._drafting_rows(plan)
        if not rows:
            return {}, False, False
        rids = [s.rid for s in rows]
        if not spec.wanted(rids):
            return {}, False, True
        ks = [self._draft_room(s) for s in rows]
        got = propose(spec, rids, [s.tokens for s in rows], ks)
        got = [list(d)[:k] for d, k in zip(got, ks)]
        lengths = [len(d) for d in got]
        spec.found(rids, lengths)
        longest = max(lengths)
        if longest == 0:
            self.stats["spec_empty_steps"] += 1
            return {}, True, False
        if not spec.worth(rids, lengths):
            # too few rows found a draft to pay for verifying them all: a plain step, the drafts scored as shadows
            for s, d in zip(rows, got):
                spec.shadow(s.rid, len(s.tokens), d)
            self.stats["spec_declined_steps"] += 1
            return {}, False, False
        pad = spec.bucket(longest)
        out = {}
        for s, d in zip(rows, got):
            if s.length + 1 + pad > self.max_context:
                continue                       # no room for the padded call: this one decodes plainly
            seg = [s.tokens[-1]] + d + [d[-1] if d else s.tokens[-1]] * (pad - len(d))
            out[s.rid] = (d, seg)
        return out, True, False

    def _while_device_runs(self, plan, shadowing: bool) -> None:
        """Speculation's host work that no launch waits for, done after the step's call is launched (the device's
        time hides it): score the pending shadow drafts that the tokens so far decide, bring the drafter's indexes up
        to the decoding rows' contexts (NgramDrafter.slack), and on a plain step of the controller's choosing
        shadow-draft a few rows, to be scored against the tokens that follow (Speculation.shadow_rids)."""
        from .speculative import propose

        spec = self.speculation
        spec.settle(self.seqs)
        rows = self._drafting_rows(plan)
        if not rows:
            return
        rids = [s.rid for s in rows]
        spec.index(rids, [s.tokens for s in rows])
        if shadowing:
            chosen = set(spec.shadow_rids(rids))
            rows = [s for s in rows if s.rid in chosen]
            if rows:
                got = propose(spec, [s.rid for s in rows], [s.tokens for s in rows],
                              [self._draft_room(s) for s in rows])
                spec.found([s.rid for s in rows], [len(d) for d in got])
                for s, d in zip(rows, got):
                    spec.shadow(s.rid, len(s.tokens), d)

    def _draft_room(self, s: SeqState) -> int:
        """The most tokens sequence s may draft this step."""
        k = min(self.speculation.draft_len, s.max_new_tokens - len(s.generated) - 1, self.max_context - s.length - 1)
        if self.prefix is not None:              # a checkpoint boundary is not crossed (as prefill pieces do)
            iv = self.prefix.interval
            k = min(k, (s.length // iv + 1) * iv - s.length - 1)
        return max(0, k)

    def _verify(self, drafts, logits) -> list[StepOutput]:
        """Accept or reject each drafting sequence's draft, emit its tokens, roll back what was not kept."""
        from .kda_rollback import restore
        from .speculative import accept_greedy, accept_sampled

        seqs = [self.seqs[r] for r in drafts]
        greedy = [s for s in seqs if s.rid not in self._sampling]
        picks = {}
        if greedy:                             # one argmax and one device sync for every greedy row
            top = torch.stack([logits[s.rid] for s in greedy]).argmax(-1).tolist()
            picks = {s.rid: t for s, t in zip(greedy, top)}
        outs, kept = [], {}                    # id(trace) -> (trace, {row: kept count}, the call's KDA states)
        failed = []                            # (seq, the exception its acceptance raised): it alone leaves
        drafted = accepted = 0
        now = time.perf_counter()
        counts, traces = self.accept_counts, self._traces
        for seq in seqs:
            rid = seq.rid
            draft, seg = drafts[rid]
            pick = picks.get(rid)
            if pick is not None:
                emitted, seed = accept_greedy(pick, draft), None
            else:
                params, gen = self._sampling[rid]
                seed = params.seed
                try:
                    emitted = accept_sampled(logits[rid], draft, params, gen)
                except Exception as exc:
                    failed.append((seq, exc))
                    continue
            stop = self._stop.get(rid, ())
            if stop:
                emitted = emitted[:next((i + 1 for i, t in enumerate(emitted) if t in stop), len(emitted))]
            keep = len(emitted)                # call tokens kept: the last token and the accepted drafts
            base = seq.length - len(seg)
            drafted += len(draft)
            accepted += keep - 1
            counts[keep - 1] += 1
            trace, row, dg = traces[rid]
            held = kept.get(id(trace))
            if held is None:
                held = kept[id(trace)] = (trace, {}, {i: seq.kda[i][0] for i in self.kda_layers}, dg)
            held[1][row] = keep
            if keep < len(seg):
                self._rewind_pages(seq, base + keep)
            seq.length = base + keep
            rows = logits[rid]
            seq.last_logits = rows[keep - 1]
            seq.generated += emitted
            seq.tokens += emitted
            outs += [StepOutput(rid, tok, rows, False, seed, i) for i, tok in enumerate(emitted)]
            outs[-1].finished = seq.done or emitted[-1] in stop
            if seq.t_first is None:
                seq.t_first = now
        self.stats["generated_tokens"] += len(outs)
        for seq, exc in failed:                # its KDA rows and pages are dropped with it
            outs.append(StepOutput(seq.rid, -1, logits[seq.rid], True, self._sampling[seq.rid][0].seed, error=exc))
            self.finish(seq.rid, checkpoint=False)
        self.stats["spec_drafted"] += drafted
        self.stats["spec_accepted"] += accepted
        self.stats["spec_calls"] += len(seqs)
        for trace, rows, states, dg in kept.values():   # KDA states back to the last kept token
            if trace:
                T, B = next(iter(trace.values())).states.shape[:2]
                keeps = [rows.get(j, T) for j in range(B)]
                if dg is not None:                    # a graph's static slots: its captured restore
                    dg.restore(keeps)
                else:
                    restore(trace, states, keeps)
        self._traces = {}
        for seq in seqs:
            if seq.rid not in self.seqs:       # failed above
                continue
            self._maybe_checkpoint(seq)
            if seq.done or (seq.generated and seq.generated[-1] in self._stop.get(seq.rid, ())):
                self.finish(seq.rid)
        return outs

    def _rewind_pages(self, seq: SeqState, n: int) -> None:
        """Release the MLA rows of `seq` past its first n tokens: pages wholly past them go back to the pool (and
        to the request's page budget); the last kept page's high-water mark comes down to n (rows written in place
        on a shared page were past every other holder's: Engine._needs copies otherwise)."""
        pool = self.pool
        if not pool.used:
            return
        keep = pool.pages_for(n)
        extra = seq.pages[keep:]
        if extra:
            pool.decref(extra)
            seq.pages = seq.pages[:keep]
            if seq.rid in self._budget:
                self._budget[seq.rid] += len(extra)
        if n % pool.page_size:
            p = seq.pages[n // pool.page_size]
            pool.filled[p] = min(pool.filled[p], n % pool.page_size)

    def rewind(self, rid: int, n: int, kda: dict) -> None:
        """An opened sequence back to its first n consumed tokens, with `kda` {KDA layer: row reference} its states
        at that point (kept from an earlier extend: states are never changed in place). The draft model's follow
        of its target (speculative.DraftModelDrafter)."""
        seq = self.seqs.get(rid)
        if seq is None or seq.scheduled:
            raise ArgumentError(f"no opened sequence with id {rid}")
        if not 0 <= n <= seq.length:
            raise ArgumentError(f"sequence {rid}: cannot rewind {seq.length} tokens to {n}")
        self._rewind_pages(seq, n)
        seq.length = n
        del seq.tokens[n:]
        seq.kda = dict(kda)
        seq.last_logits = None

    def _maybe_checkpoint(self, seq: SeqState) -> None:
        if self.prefix is not None and (seq.length == seq.prompt_len or seq.length % self.prefix.interval == 0):
            self.prefix.insert(seq)

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
        if len(rids) != len(segments):
            raise ArgumentError(f"{len(rids)} rids but {len(segments)} segments")
        if len(set(rids)) != len(rids):
            raise ArgumentError("a sequence may appear once per extend() call")
        plan = []
        for rid, seg in zip(rids, segments):
            seq = self.seqs.get(rid)
            if seq is None or seq.scheduled:
                raise ArgumentError(f"no opened sequence with id {rid} (open() one; requests are driven by step)")
            seg = self._tokens(seg, f"segment of sequence {rid}")
            if seq.length + len(seg) > self.max_context:
                raise ArgumentError(f"sequence {rid}: {seq.length} cached + {len(seg)} new tokens exceed "
                                    f"max_context {self.max_context}")
            plan.append((seq, seg))
        self._check_room(plan)
        for seq, seg in plan:
            seq.tokens.extend(seg)
        # rounds of pieces cut at prefix-cache checkpoint boundaries; a segment end is a prompt end
        out: dict[int, list[torch.Tensor]] = {r: [] for r in rids}
        try:
            while plan:
                logits = self._run([(seq, self._segment(seq)) for seq, _ in plan], evict=True)
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

    def _check_room(self, plan) -> None:
        """CacheFullError now, before anything changes, if the whole plan cannot get its pages."""
        pool = self.pool
        need = sum(new + cow for new, cow in self._needs(plan))
        while need > pool.num_free and self.prefix is not None and self.prefix.evict_for_pages():
            pass
        if need > pool.num_free:
            raise CacheFullError(f"MLA cache full: this call needs up to {need} pages, {pool.num_free} of "
                                 f"{pool.num_pages} are free (page size {pool.page_size}); finish sequences or give "
                                 "the engine more num_pages")

    # -- graph calls ----------------------------------------------------------------------------------------------
    def _needs(self, plan) -> list[tuple[int, bool]]:
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

    def _reserve(self, plan, evict: bool):
        """Pages for every (seq, segment) of a step, or CacheFullError with nothing changed. Returns the undo log."""
        pool, ps = self.pool, self.pool.page_size
        needs = self._needs(plan)
        total = sum(new + cow for new, cow in needs)
        # pages promised to admitted requests stay theirs unless this plan is theirs
        if pool.used and total > pool.num_free and evict and self.prefix is not None:
            while total > pool.num_free and self.prefix.evict_for_pages():
                pass
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
            if seq.rid in self._budget:
                self._budget[seq.rid] -= new + cow
        return undo

    def _rollback(self, undo) -> None:
        for seq, before in undo:
            self.pool.decref([p for p in seq.pages if p not in before])
            seq.pages = before

    def _commit(self, undo) -> None:
        for seq, before in undo:        # pages replaced by a copy lose this sequence's reference
            self.pool.decref([p for p in before if p not in seq.pages])

    def _run(self, plan, evict: bool, trace: set[int] = frozenset()) -> dict[int, torch.Tensor]:
        """One graph call per group of equal segment length (at most max_batch rows each). {rid: logits [T, V]}.
        trace: the ids of the sequences whose calls keep every token's KDA states (self._traces) for a rollback
        inside them (speculative verification); they run apart from prefill pieces of the same length."""
        undo = self._reserve(plan, evict)
        groups: dict[tuple, list] = {}
        for seq, seg in plan:
            groups.setdefault((len(seg), seq.rid in trace), []).append((seq, seg))
        out: dict[int, torch.Tensor] = {}
        done = set()
        try:
            for (t, traced), items in groups.items():
                for i in range(0, len(items), self.max_batch):
                    chunk = items[i:i + self.max_batch]
                    logits = self._call([s for s, _ in chunk], [g for _, g in chunk], trace=traced and t > 1)
                    for (seq, _), rows in zip(chunk, logits.unbind(0)):     # one call for every row's view
                        out[seq.rid] = rows
                        done.add(seq.rid)
        except BaseException:
            self._rollback([u for u in undo if u[0].rid not in done])
            self._commit([u for u in undo if u[0].rid in done])
            raise
        self._commit(undo)
        return out

    def _h2d(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the engine's device without a device sync (pinned staging, non-blocking copy; the
        caching host allocator keeps the staging block until the copy has run)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _block_table(self, seqs: list[SeqState]) -> torch.Tensor:
        """The call's block table; the previous one when no page list changed (decode: all but one step in
        page_size), so a step does no host-to-device copy for it."""
        key = tuple(tuple(s.pages) for s in seqs)
        if key != self._bt_key:
            self._bt = self.pool.block_table([list(p) for p in key], self.device, h2d=self._h2d)
            self._bt_key = key
        return self._bt

    def mla_modes(self, new: int, cached: list[int]) -> dict[int, str]:
        """{MLA layer: mode} for a call of `new` tokens per sequence after `cached` tokens (batch_mla_mode)."""
        memo: dict[str, str] = {}
        out = {}
        for layer, (key, attrs) in self._mla_auto.items():
            if key not in memo:
                memo[key] = batch_mla_mode(attrs, new, cached, self.target)
            out[layer] = memo[key]
        return out

    # -- decode through captured graphs -------------------------------------------------------------------------
    def _decode_graph(self, batch: int, tokens: int = 1):
        """The DecodeGraph of this batch size and tokens per sequence (1: decode; more: speculative verification)
        over the engine's page pools (created, not captured, on first use): length buckets of page_size x 2^k up
        to max_context, each captured on its first step. A shape without its graph runs in the smallest larger
        batch's graph of the same tokens (padding rows, Engine._graph_step) when that one is at most twice its
        size, or until its own is due; None while the shape is new and no larger graph exists (an eager call)."""
        from .cuda_graph import DecodeGraph

        key = (batch, tokens)
        # a decode shape gets its graph on its second call in a row (a batch that shrinks every step stays eager);
        # a verification shape on its second call at all (verifications alternate with plain decode steps)
        turn = self._last_decode_batch == key or (tokens > 1 and self._shape_calls[key] >= 2)
        dg = self._graphs.get(key)
        if dg is None:
            # a larger batch's graph runs this one with padding rows: one of up to twice the batch always, a larger
            # one until this shape's own graph is due and it has run PADDED_CALLS times (a capture costs ~10 eager
            # steps; the tail of a batch whose requests finish one by one passes through sizes for a few steps
            # each, and under speculation through verification shapes too)
            larger = sorted((g for (b, t), g in self._graphs.items() if t == tokens and b > batch),
                            key=lambda g: g.batch)
            dg = next((g for g in larger if g.batch <= 2 * batch), None)
            if dg is None and larger and not (turn and self._shape_calls[key] >= self.PADDED_CALLS):
                dg = larger[0]
            key = (dg.batch, tokens) if dg is not None else key
        if dg is not None:
            self._graphs.move_to_end(key)
            return dg
        if not turn:
            return None
        while len(self._graphs) >= self.max_graphs:
            old_key, old = self._graphs.popitem(last=False)
            self._rehome(old, set())
            self._graph_bt.pop(old_key, None)
        ps, buckets, b = self.pool.page_size, [], self.pool.page_size
        while b < self.max_context:
            buckets.append(b)
            b *= 2
        dg = DecodeGraph(self.compiled, self.graph, batch=batch, capacity=self.max_context, device=self.device,
                         use_kernels=self.use_kernels, dtype=self.dtype, kv_dtype=self.kv_dtype, page_size=ps,
                         buckets=buckets, tokens=tokens,
                         kda_slots=next((g.kda for (b, _), g in self._graphs.items() if b == batch), None),
                         kda_tokens=self._verify_buffers(tokens) if tokens > 1 else None,
                         backend=self._graph_backend, pools=self.pool.pools if self.mla_layers else None)
        self._graphs[key] = dg
        self.stats["decode_graphs_created"] += 1
        return dg

    def _verify_buffers(self, tokens: int) -> dict:
        """{KDA layer: KDATokens of max_batch rows}: the per-token states every verification graph of `tokens`
        tokens writes into its first rows (tokens x max_batch x the state's bytes once, not per batch size)."""
        from .cuda_graph import kda_token_buffers

        if tokens not in self._kda_tokens:
            self._kda_tokens[tokens] = kda_token_buffers(self.compiled, self.max_batch, tokens, self.dtype,
                                                         self.device)
        return self._kda_tokens[tokens]

    def _rehome(self, dg, members: set[int]) -> None:
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

    def _home(self, seqs: list[SeqState], tokens: int):
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
        holders = {id(g.kda[first]): g for g in self._graphs.values()}
        votes = Counter(id(r[0]) for r in (s.kda.get(first) for s in seqs) if r is not None and id(r[0]) in holders)
        if not votes:
            return None
        home = holders[votes.most_common(1)[0][0]]
        if not len(seqs) <= home.batch <= 2 * len(seqs):
            return None
        key = (home.batch, tokens)
        dg = self._graphs.get(key)
        placed = self._placed(home, seqs) if dg is not None else None
        if placed is None:
            return None
        self._graphs.move_to_end(key)
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

    def _graph_step(self, dg, seqs: list[SeqState], segments: list[list[int]],
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
            self._rehome(dg, {id(s) for s in seqs})   # slots about to be overwritten: give their rows a home
        if joining:                            # a request admitted in place of a finished one: into a free row
            self.stats["graph_slot_joins"] += len(joining)
            self._write_slots(dg, [seqs[k] for k in joining],
                              self._h2d(torch.tensor([slots[k] for k in joining], dtype=torch.long)))
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
            bt = self._block_table(seqs)
            key = (dg.batch, dg.tokens)
            held = self._graph_bt.get(key)
            if held is None or held[0] is not self._bt_key or held[1] != slots:   # changes once per page_size steps
                if not in_order or pad:
                    full = torch.full((dg.batch, bt.shape[1]), self.pool.scratch, dtype=bt.dtype, device=bt.device)
                    full[self._device_rows(slots)] = bt
                    bt = full
                dg.set_block_table(bt)
                self._graph_bt[key] = (self._bt_key, slots)
        dg.set_lengths(lens)
        self.stats["padded_graph_rows"] += pad
        out = dg.step(self._h2d(torch.tensor(rows, dtype=torch.long)))
        # the replay's output is overwritten next step
        return (out[:B].clone() if in_order else out.index_select(0, self._device_rows(slots))), slots

    def _write_slots(self, dg, seqs: list[SeqState], rows) -> None:
        """Copy these sequences' KDA states into `rows` of dg's slots (a slice, or a device index of one row per
        sequence): one gather and one copy per tensor and layer for all of them."""
        self._untimed = True                   # a step that moved rows is no cost sample of a plain step
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
            g = gather_kda([s.kda.get(i) for s in seqs], self.spec.kda, self.dtype, self.device)
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
            self._rows_key, self._rows_dev = key, self._h2d(torch.tensor(slots, dtype=torch.long))
        return self._rows_dev

    def _call(self, seqs: list[SeqState], segments: list[list[int]], trace: bool = False) -> torch.Tensor:
        """One graph call of equal-length segments; trace: a verification call (T > 1) whose KDA inputs are kept
        for a rollback (self._traces), through a CUDA graph per (batch, T) like decode steps."""
        B, T = len(segments), len(segments[0])
        lens = [s.length for s in seqs]
        modes = self.mla_modes(T, lens) if self.mla_layers else {}
        dg = None
        graphable = T == 1 or trace
        home = None
        if graphable and self.cuda_graphs and all(m == "mqa" for m in modes.values()):
            home = self._home(seqs, T)
            dg = home[0] if home else self._decode_graph(B, T)
            if dg is not None and (dg.report.mode != "graph" or max(lens) + T > dg.capacity):
                dg = None                              # not capturable (reported) or past the last bucket
        self._last_decode_batch = (B, T) if graphable else None
        if graphable:
            self._shape_calls[(B, T)] += 1
        kda_trace = None
        slots = range(B)                               # the KDA state row of each sequence after the call
        if dg is not None:
            t0 = time.perf_counter()
            captured, captured_s = len(dg.report.captured), sum(dg.report.captured.values())
            at_home = home is not None and home[0] is dg
            logits, slots = self._graph_step(dg, seqs, segments, home[1] if at_home else None,
                                             home[2] if at_home else ())
            if T == 1:
                logits = logits[:, None]
            if len(dg.report.captured) != captured:   # this step captured a bucket: its time is no decode rate
                self._untimed = True
                self.stats["graph_captures"] += 1
                self.stats["graph_capture_s"] += sum(dg.report.captured.values()) - captured_s
            states, ran, kda_trace = dg.kda, modes, dg.trace
            self.stats["decode_graph_calls" if T == 1 else "verify_graph_calls"] += 1
        else:
            ids = self._h2d(torch.tensor(segments, dtype=torch.long))
            cache = LayerCaches(self.spec.num_layers, self.kv_dtype)
            if trace:
                cache.kda_trace = kda_trace = {}
            for i in self.kda_layers:
                cache.layers[i] = gather_kda([s.kda.get(i) for s in seqs], self.spec.kda, self.dtype, self.device)
            if self.mla_layers:
                bt = self._block_table(seqs)
                for i in self.mla_layers:
                    cache.layers[i] = PagedLatentCache(LatentStore(self.pool.pools[i], bt, list(lens)), tuple(lens))
                cache.mla_modes = modes
            t0 = time.perf_counter()
            with torch.no_grad():
                logits = self.graph(ids, cache)
            states, ran = cache.layers, dict(getattr(cache, "modes", {}))
        kind = "decode" if T == 1 else "verify" if trace else "prefill"
        if trace:
            for j, seq in zip(slots, seqs):
                self._traces[seq.rid] = (kda_trace, j, dg)
        self.stats[f"{kind}_calls"] += 1
        self.stats[f"{kind}_tokens"] += B * T
        self.stats[f"{kind}_seconds_launch"] += time.perf_counter() - t0     # host time (no device sync)
        for j, seq in zip(slots, seqs):                # commit: nothing above changed a sequence
            for i in self.kda_layers:
                seq.kda[i] = (states[i], j)
            self.pool.mark_written(seq.pages, seq.length, seq.length + T)
            seq.length += T
        self.last_modes = ran
        for layer, mode in ran.items():
            self.mode_counts[(layer, mode)] += 1
        return logits
