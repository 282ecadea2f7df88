"""Speculative decoding inside a step (runtime/speculative.py holds the drafters and the controller): which
decoding sequences draft, the verification call's acceptance, the rollback of what was not kept (MLA rows through
the ledger, KDA states from the call's per-token trace), and the host work done while the device runs."""
from __future__ import annotations

import time
from collections import Counter

import torch

from ..caches.kda_rollback import restore
from ..caches.seq_state import SeqState
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

    def drafting_rows(self, plan) -> list[SeqState]:
        """The sequences of a plan that may draft: scheduled requests decoding one token, without logit changes (a
        verified draft's tokens are chosen from the raw logits: a grammar or penalty would not see them)."""
        return [s for s, g in plan if len(g) == 1 and s.generated and s.scheduled and s.rid not in self.logits]

    def draft(self, plan) -> tuple[dict[int, tuple[list[int], list[int]]], bool, bool]:
        """({rid: (draft, the call's segment: last token + draft padded to the call's bucket)} for the decoding
        sequences of this plan that draft this step, empty when none does; whether the drafter was asked (False:
        speculation does not pay this step); whether the controller chose a plain step (its rows may shadow-draft)."""
        spec = self.speculation
        rows = self.drafting_rows(plan)
        if not rows:
            return {}, False, False
        rids = [s.rid for s in rows]
        if not spec.wanted(rids):
            return {}, False, True
        ks = [self.draft_room(s) for s in rows]
        got = speculative.propose(spec, rids, [s.tokens for s in rows], ks)
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

    def while_device_runs(self, plan, shadowing: bool) -> None:
        """Speculation's host work that no launch waits for, done after the step's call is launched (the device's
        time hides it): score the pending shadow drafts that the tokens so far decide, bring the drafter's indexes up
        to the decoding rows' contexts (NgramDrafter.slack), and on a plain step of the controller's choosing
        shadow-draft a few rows, to be scored against the tokens that follow (Speculation.shadow_rids)."""
        spec = self.speculation
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
                spec.found([s.rid for s in rows], [len(d) for d in got])
                for s, d in zip(rows, got):
                    spec.shadow(s.rid, len(s.tokens), d)

    def draft_room(self, s: SeqState) -> int:
        """The most tokens sequence s may draft this step (a checkpoint boundary is not crossed, as prefill pieces
        do not)."""
        k = min(self.speculation.draft_len, s.max_new_tokens - len(s.generated) - 1, self.max_context - s.length - 1,
                self.scheduler.boundary_room(s) - 1)
        return max(0, k)

    def verify(self, drafts, logits) -> list[StepOutput]:
        """Accept or reject each drafting sequence's draft, emit its tokens, roll back what was not kept."""
        seqs = [self.seqs[r] for r in drafts]
        greedy = [s for s in seqs if s.rid not in self.sampling]
        picks = {}
        if greedy:                             # one argmax and one device sync for every greedy row
            top = torch.stack([logits[s.rid] for s in greedy]).argmax(-1).tolist()
            picks = {s.rid: t for s, t in zip(greedy, top)}
        outs, kept, failed = self._accept(seqs, drafts, logits, picks)
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
            if seq.done or (seq.generated and seq.generated[-1] in self.stop.get(seq.rid, ())):
                self.finish(seq.rid)
        return outs

    def _accept(self, seqs: list[SeqState], drafts, logits, picks):
        """Each sequence's emitted tokens (greedy: `picks`, the argmax; sampled: accept_sampled), its MLA rows and
        length cut back to them. (outputs, {id(trace): (trace, {row: kept count}, the call's KDA states, its
        DecodeGraph)}, [(seq, the exception its acceptance raised)]: those leave alone)."""
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
                    emitted = speculative.accept_sampled(logits[rid], draft, params, gen)
                except Exception as exc:
                    failed.append((seq, exc))
                    continue
            stop = self.stop.get(rid, ())
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
                self.ledger.rewind(seq, base + keep)
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
        self.stats["spec_drafted"] += drafted
        self.stats["spec_accepted"] += accepted
        return outs, kept, failed
