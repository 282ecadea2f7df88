"""Speculative decoding inside a step (runtime/speculative.py holds the drafters and the controller): which
decoding sequences draft, the verification call's acceptance, the rollback of what was not kept (MLA rows through
the ledger, KDA states from the call's per-token trace), and the host work done while the device runs.

Requests with logit changes (logits_processors.RowLogits: a grammar, penalties, biases) draft too, and their
acceptance is exact: a draft is cut before the first token its grammar refuses (RowLogits.draft_prefix, before the
call), each verified position's logits are changed as a plain step would change them at that position (the grammar's
mask after the draft tokens before it, filled while the device runs the call; penalties counting those tokens), and
the emitted tokens advance the grammar. Greedy constrained output with speculation is plain constrained output."""
from __future__ import annotations

import time
from collections import Counter

import torch

from ..caches.block_pool import CacheFullError
from ..caches.kda_rollback import restore
from ..caches.seq_state import SeqState
from ..logits_processors import mask_words, process
from .. import speculative            # looked up per call: the drafters and the acceptance rules live there
from .ledger import PageLedger
from .requests import StepOutput
from .runner import Runner
from .scheduler import Scheduler


class Speculator:
    def __init__(self, speculation, *, scheduler: Scheduler, ledger: PageLedger, runner: Runner,
                 seqs: dict[int, SeqState], sampling: dict, stop: dict, logits: dict, finish, max_context: int,
                 stats: Counter):
        self.speculation = speculation              # runtime/speculative.py Speculation
        self.scheduler, self.ledger, self.runner = scheduler, ledger, runner
        self.seqs, self.sampling, self.stop, self.logits = seqs, sampling, stop, logits    # the engine's, read only
        self.finish = finish                        # Engine.finish: a request that is done or failed leaves
        self.max_context, self.stats = max_context, stats
        self.kda_layers = runner.kda_layers
        self.accept_counts: Counter = Counter()     # drafts kept in one sequence-verification -> how often
        self.vocab = runner.spec.vocab_size
        self._drafted: dict[int, list[int]] = {}   # rid -> the draft of this step's verification (draft())
        self._masks: dict[int, tuple] = {}         # rid -> (its draft, grammar masks [len + 1, words]) filled ahead

    def drafting_rows(self, plan) -> list[SeqState]:
        """The sequences of a plan that may draft: scheduled requests decoding one token."""
        return [s for s, g in plan if len(g) == 1 and s.generated and s.scheduled]

    def _grammar_cut(self, rids: list[int], got: list[list[int]], count: bool = True) -> list[list[int]]:
        """Each draft cut before the first token its request's grammar refuses (or one completing it); `count`: in
        stat spec_grammar_cut."""
        out = []
        for rid, d in zip(rids, got):
            proc = self.logits.get(rid)
            if proc is not None and proc.grammar is not None and d:
                n = proc.draft_prefix(d)
                if n < len(d):
                    if count:
                        self.stats["spec_grammar_cut"] += len(d) - n
                    d = d[:n]
            out.append(d)
        return out

    def draft(self, plan) -> tuple[dict[int, tuple[list[int], list[int]]], bool, bool]:
        """({rid: (draft, the call's segment: last token + draft padded to the call's bucket)} for the decoding
        sequences of this plan that draft this step, empty when none does; whether the drafter was asked (False:
        speculation does not pay this step); whether the controller chose a plain step (its rows may shadow-draft)."""
        spec = self.speculation
        self._drafted = {}
        rows = self.drafting_rows(plan)
        if not rows:
            return {}, False, False
        rids = [s.rid for s in rows]
        if not spec.wanted(rids):
            return {}, False, True
        ks = [self.draft_room(s) for s in rows]
        got = speculative.propose(spec, rids, [s.tokens for s in rows], ks)
        got = self._grammar_cut(rids, [list(d)[:k] for d, k in zip(got, ks)])
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
        self._drafted = {r: d for r, (d, _) in out.items()}
        return out, True, False

    def verification_call(self, plan, drafts):
        """(the drafts still verified, the logits of the call) for a step whose decoding rows drafted; drafts are
        optional: where their pages are not free they are dropped ({}), never paid for by preempting a sequence or
        evicting a prefix checkpoint (the plain plan then does what plain decoding would)."""
        spec_plan = [(s, drafts[s.rid][1] if s.rid in drafts else g) for s, g in plan]
        if self.scheduler.admission == "optimistic" and \
                self.ledger.pages_needed(spec_plan) > self.ledger.pool.num_free:
            self.stats["spec_fallbacks"] += 1
            return {}, {}
        try:
            return drafts, self.runner.run(spec_plan, evict=True, trace=set(drafts), all_positions=False)
        except CacheFullError:        # the padded drafts do not fit beside the batch: decode plainly
            self.stats["spec_fallbacks"] += 1
            return {}, {}

    def while_device_runs(self, plan, shadowing: bool) -> None:
        """Speculation's host work that no launch waits for, done after the step's call is launched (the device's
        time hides it): score the pending shadow drafts that the tokens so far decide, bring the drafter's indexes up
        to the decoding rows' contexts (NgramDrafter.slack), and on a plain step of the controller's choosing
        shadow-draft a few rows, to be scored against the tokens that follow (Speculation.shadow_rids)."""
        spec = self.speculation
        self._fill_masks()
        spec.settle(self.seqs)
        rows = self.drafting_rows(plan)
        if not rows:
            return
        rids = [s.rid for s in rows]
        spec.index(rids, [s.tokens for s in rows])
        if shadowing:
            chosen = set(spec.shadow_rids(rids))
            rows = [s for s in rows if s.rid in chosen]
            if rows:
                got = speculative.propose(spec, [s.rid for s in rows], [s.tokens for s in rows],
                              [self.draft_room(s) for s in rows])
                # scored as a verification would have kept them: the grammar cuts a shadow draft as a real one
                got = self._grammar_cut([s.rid for s in rows], [list(d) for d in got], count=False)
                spec.found([s.rid for s in rows], [len(d) for d in got])
                for s, d in zip(rows, got):
                    spec.shadow(s.rid, len(s.tokens), d)

    def _fill_masks(self) -> None:
        """The grammar masks of this step's drafts, at each verified position (the host's share of constrained
        verification, while the device runs the call; a draft the engine did not verify leaves them unused)."""
        drafted, self._drafted, self._masks = self._drafted, {}, {}
        for rid, d in drafted.items():
            proc = self.logits.get(rid)
            if proc is not None and proc.grammar is not None:
                self._masks[rid] = (d, self._draft_masks(proc, d))

    def _draft_masks(self, proc, draft: list[int]) -> torch.Tensor:
        bitmask = torch.zeros(len(draft) + 1, mask_words(self.vocab), dtype=torch.int32)
        proc.fill_draft_masks(draft, bitmask, 0)
        return bitmask

    def _changed(self, drafts, logits) -> dict:
        """`logits` with the rows of requests with logit changes changed at each verified position (one batched
        `process` over every such row and position; the rows past a draft's last position are left as they are)."""
        rids = [r for r in drafts if r in self.logits]
        if not rids:
            return logits
        procs, contexts, starts, pieces, masks = [], [], [], [], []
        for rid in rids:
            d, proc, seq = drafts[rid][0], self.logits[rid], self.seqs[rid]
            n = len(d) + 1
            pieces.append(logits[rid][:n])
            procs += [proc] * n
            # position j's context: the tokens so far and the draft's first j (read for penalties only)
            contexts += [seq.tokens + d[:j] for j in range(n)] if proc.penalized else [[]] * n
            starts += [seq.prompt_len] * n
            if proc.grammar is not None:
                held = self._masks.get(rid)
                masks.append(held[1] if held is not None and held[0] == d else self._draft_masks(proc, d))
        self._masks = {}
        out = process(torch.cat(pieces), procs, contexts, starts, torch.cat(masks) if masks else None)
        changed, at = dict(logits), 0
        for rid, piece in zip(rids, pieces):
            n = piece.shape[0]
            row = logits[rid].clone()
            row[:n] = out[at:at + n]
            changed[rid], at = row, at + n
        return changed

    def draft_room(self, s: SeqState) -> int:
        """The most tokens sequence s may draft this step (a checkpoint boundary is not crossed, as prefill pieces
        do not)."""
        k = min(self.speculation.draft_len, s.max_new_tokens - len(s.generated) - 1, self.max_context - s.length - 1,
                self.scheduler.boundary_room(s) - 1)
        return max(0, k)

    def verify(self, drafts, logits) -> list[StepOutput]:
        """Accept or reject each drafting sequence's draft, emit its tokens, roll back what was not kept."""
        seqs = [self.seqs[r] for r in drafts]
        chosen_from = self._changed(drafts, logits)      # what tokens are chosen from: the requests' logit changes
        greedy = [s for s in seqs if s.rid not in self.sampling]
        picks = {}
        if greedy:                             # one argmax and one device sync for every greedy row
            top = torch.stack([chosen_from[s.rid] for s in greedy]).argmax(-1).tolist()
            picks = {s.rid: t for s, t in zip(greedy, top)}
        outs, kept, failed = self._accept(seqs, drafts, logits, chosen_from, picks)
        for seq, exc in failed:                # its KDA rows and pages are dropped with it
            outs.append(StepOutput(seq.rid, -1, logits[seq.rid], True, self.sampling[seq.rid][0].seed, error=exc))
            self.finish(seq.rid, checkpoint=False)
        self.stats["spec_calls"] += len(seqs)
        for trace, rows, states, dg in kept.values():   # KDA states back to the last kept token
            if trace:
                T, B = next(iter(trace.values())).states.shape[:2]
                keeps = [rows.get(j, T) for j in range(B)]
                if dg is not None:                    # a graph's static slots: its captured restore
                    dg.restore(keeps)
                else:
                    restore(trace, states, keeps)
        self.runner.traces = {}
        for seq in seqs:
            if seq.rid not in self.seqs:       # failed above
                continue
            self.scheduler.maybe_checkpoint(seq)
            proc = self.logits.get(seq.rid)
            if seq.done or (seq.generated and seq.generated[-1] in self.stop.get(seq.rid, ())) or \
                    (proc is not None and proc.finished):
                self.finish(seq.rid)
        return outs

    def _accept(self, seqs: list[SeqState], drafts, logits, chosen_from, picks):
        """Each sequence's emitted tokens (greedy: `picks`, the argmax; sampled: accept_sampled over `chosen_from`,
        the logits after the requests' changes), its MLA rows and length cut back to them; a grammar advanced past
        them (ending the request when it completes). (outputs, {id(trace): (trace, {row: kept count}, the call's KDA
        states, its DecodeGraph)}, [(seq, the exception its acceptance raised)]: those leave alone)."""
        outs, kept, failed = [], {}, []
        drafted = accepted = 0
        now = time.perf_counter()
        counts, traces = self.accept_counts, self.runner.traces
        for seq in seqs:
            rid = seq.rid
            draft, seg = drafts[rid]
            pick = picks.get(rid)
            if pick is not None:
                emitted, seed = speculative.accept_greedy(pick, draft), None
            else:
                params, gen = self.sampling[rid]
                seed = params.seed
                try:
                    emitted = speculative.accept_sampled(chosen_from[rid], draft, params, gen)
                except Exception as exc:
                    failed.append((seq, exc))
                    continue
            stop = self.stop.get(rid, ())
            if stop:
                emitted = emitted[:next((i + 1 for i, t in enumerate(emitted) if t in stop), len(emitted))]
            proc = self.logits.get(rid)
            if proc is not None:
                for i, t in enumerate(emitted):
                    proc.accept(t)
                    if proc.finished:          # a completed grammar ends the request: nothing after it
                        emitted = emitted[:i + 1]
                        break
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
                self.ledger.rewind(seq, base + keep)
            seq.length = base + keep
            rows = logits[rid]
            seq.last_logits = rows[keep - 1]
            seq.generated += emitted
            seq.tokens += emitted
            outs += [StepOutput(rid, tok, rows, False, seed, i) for i, tok in enumerate(emitted)]
            outs[-1].finished = seq.done or emitted[-1] in stop or (proc is not None and proc.finished)
            if seq.t_first is None:
                seq.t_first = now
        self.stats["generated_tokens"] += len(outs)
        self.stats["spec_drafted"] += drafted
        self.stats["spec_accepted"] += accepted
        return outs, kept, failed
