"""Speculative decoding: drafters, verification and the controller that decides how much to draft.

    spec = Speculation(NgramDrafter(), draft_len=4)               # prompt lookup; or DraftModelDrafter(engine)
    eng = Engine(model, w, device="cuda", speculation=spec)        # step() then emits up to 1 + draft_len tokens

A step of a decoding sequence: the drafter proposes up to k tokens after its context; the engine runs the last
token and the drafts as one call of 1 + k tokens (rows of one call padded to the same length: a pad is a draft that
is rejected), which gives the target's logits after each of them; `accept` keeps the longest prefix of drafts the
target agrees with, plus one token of the target's own (the bonus): 1 to k + 1 tokens per call. Then the engine
rolls back what was not kept: MLA rows past the kept length are released (their pages go back to the pool) and each
KDA layer's state is set to the one the call kept after the last kept token (runtime/caches/kda_rollback.py).

Greedy requests keep a draft when it is the target's argmax: the output is non-speculative decoding's, token for
token. Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023) against the drafter's
distribution q, here a point mass (the drafters propose deterministically): draft d is kept with probability
p(d), where p is the request's filtered distribution (runtime/sampling.py); on a rejection the token is drawn from
p with d removed, renormalised (the residual max(0, p - q)); after k kept drafts the bonus is drawn from p. Every
emitted token is then distributed exactly as plain sampling's (tests/runtime/test_speculative.py measures it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ArgumentError
from .sampling import SamplingParams, filtered_probs


# ---- drafters ----------------------------------------------------------------------------------------------------
class _NgramIndex:
    """Where each n-gram of a context last ended (n in [min_n, max_n]), for the n-grams that end before the
    context's last token: built once, then extended by the tokens a sequence gains (a dict update per token and
    n), so a lookup costs O(max_n) whatever the context's length."""

    def __init__(self, min_n: int, max_n: int):
        self.ns = range(max_n, min_n - 1, -1)
        self.max_n, self.min_n = max_n, min_n
        self.cuts = range(max_n - min_n + 1)  # a max_n-gram's suffixes, longest first: n = max_n - cut
        self.ends: dict[tuple, int] = {}
        self.length = 0                       # n-grams ending at positions < length are in
        self.last = None                      # ctx[length - 1] when indexed (a cheap check that ctx extends it)

    def extend(self, ctx: list[int]) -> None:
        upto = len(ctx) - 1                   # the tail's own n-grams end at len(ctx): not matches of themselves
        start = max(self.length, 1)
        ends = self.ends
        if upto - start < 8:                  # a few tokens (a decode step's): one tuple an end, its suffixes the keys
            for e in range(start, upto + 1):
                if e >= self.max_n:
                    g = tuple(ctx[e - self.max_n:e])
                    for c in self.cuts:
                        ends[g[c:]] = e
                else:
                    for n in self.ns:
                        if n <= e:
                            ends[tuple(ctx[e - n:e])] = e
        else:
            for n in self.ns:                 # the n-grams ending at start..upto, in one dict update per n
                lo = max(start, n)
                if lo <= upto:
                    cols = [ctx[lo - n + i:upto - n + i + 1] for i in range(n)]
                    ends.update(zip(zip(*cols), range(lo, upto + 1)))
        self.length = max(self.length, upto + 1)
        self.last = ctx[self.length - 1] if self.length else None

    def extends(self, ctx: list[int]) -> bool:
        return len(ctx) >= self.length and (self.length == 0 or ctx[self.length - 1] == self.last)

    def lookup(self, ctx: list[int], k: int) -> list[int]:
        tail = tuple(ctx[-self.max_n:])       # its suffixes are the shorter n-grams
        get = self.ends.get
        for n in self.ns:
            if n < len(ctx):
                end = get(tail[len(tail) - n:])
                if end is not None:
                    return ctx[end:end + k]
        return []


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens
    (n from max_n down to min_n; the longest match wins), no model. Agentic contexts repeat spans of tool output and
    code, which is where this drafts well. Each request keeps an index of its context's n-grams, extended by the
    tokens it gains, so drafting a batch costs microseconds a sequence at any context length.

    Extending the indexes is the per-token cost (~1-2 us a token and request in Python, every decoding request every
    step); the engine pays it while the device runs a step (`index`), so a lookup on the step's critical path uses an
    index up to `slack` tokens behind its context: it misses only n-grams that end in the last step's tokens (a copy
    repeats text from further back). A lookup extends an index that lags by more."""

    name = "ngram"
    cheap = True        # drafting costs microseconds: plain steps may shadow-draft (Speculation.shadow_rids)

    def __init__(self, max_n: int = 4, min_n: int = 2, slack: int = 8):
        if not 1 <= min_n <= max_n:
            raise ArgumentError(f"NgramDrafter: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ArgumentError(f"NgramDrafter: slack must be an integer >= 0, got {slack!r}")
        self.max_n, self.min_n, self.slack = max_n, min_n, slack
        self._index: dict[int, _NgramIndex] = {}

    def propose(self, contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        """Drafts for contexts without a request id (an index built for each)."""
        return [self._draft(_NgramIndex(self.min_n, self.max_n), c, k) for c, k in zip(contexts, ks)]

    def propose_for(self, rids: list[int], contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        return [self._indexed(rid, ctx, self.slack).lookup(ctx, k) if k > 0 else []
                for rid, ctx, k in zip(rids, contexts, ks)]

    def index(self, rids: list[int], contexts: list[list[int]]) -> None:
        """Bring these requests' indexes up to their contexts (work a step's device time hides)."""
        for rid, ctx in zip(rids, contexts):
            self._indexed(rid, ctx, 0)

    def _indexed(self, rid: int, ctx: list[int], slack: int) -> _NgramIndex:
        """Request rid's index, extended to ctx unless it lags by at most `slack` tokens (a new one when ctx is not
        the context it indexed)."""
        idx = self._index.get(rid)
        if idx is None or not idx.extends(ctx):
            idx = self._index[rid] = _NgramIndex(self.min_n, self.max_n)
        if not idx.length or len(ctx) - idx.length > slack:
            idx.extend(ctx)
        return idx

    @staticmethod
    def _draft(idx: _NgramIndex, ctx: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        idx.extend(ctx)
        return idx.lookup(ctx, k)

    def prepare(self, rid: int, ctx: list[int]) -> None:
        """Index request rid's context now (its prompt, as its first token is out): building a long prompt's index
        is prefill-side work (~0.5 us a token), which would otherwise land in its first decode step."""
        self._indexed(rid, ctx, 0)

    def forget(self, rid: int) -> None:
        self._index.pop(rid, None)


class DraftModelDrafter:
    """A small model sharing the target's tokenizer (e.g. examples/k3-stdlib-draft), run by its own Engine: each
    request has an opened sequence there that follows the request's tokens; drafts are its greedy continuation,
    one batched call per drafted position. The draft sequence's KDA states after each drafted position are kept (a
    reference each: states are never changed in place), so following the target after a rejection is a rewind."""

    name = "draft"
    cheap = False

    def __init__(self, engine):
        if engine.cuda_graphs:
            raise ArgumentError("the draft model's engine must run without CUDA graphs (cuda_graphs=False): its "
                                "states are kept by reference between calls")
        self.engine = engine
        self._seqs: dict[int, int] = {}                 # target rid -> draft engine rid
        self._marks: dict[int, dict[int, dict]] = {}    # target rid -> {consumed length: KDA refs at that length}

    def propose_for(self, rids: list[int], contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
        eng = self.engine
        live = [(r, c, k) for r, c, k in zip(rids, contexts, ks) if k > 0]
        out = {r: [] for r in rids}
        if not live:
            return [out[r] for r in rids]
        catch, segs = [], []
        for rid, ctx, k in live:
            drid = self._follow(rid, ctx)
            seq = eng.seqs[drid]
            catch.append(drid)
            segs.append(ctx[seq.length:])
        logits = eng.extend(catch, segs)
        nxt = torch.stack([lg[-1] for lg in logits]).argmax(-1).tolist()
        drafting = list(zip([r for r, _, _ in live], catch, [k for _, _, k in live], nxt))
        for rid, drid, k, tok in drafting:
            out[rid].append(tok)
            self._mark(rid, drid)
        step = 1
        while True:
            rows = [(rid, drid) for rid, drid, k, _ in drafting if k > step]
            if not rows:
                break
            logits = eng.extend([d for _, d in rows], [[out[r][-1]] for r, _ in rows])
            toks = torch.stack([lg[-1] for lg in logits]).argmax(-1).tolist()
            for (rid, drid), tok in zip(rows, toks):
                out[rid].append(tok)
                self._mark(rid, drid)
            step += 1
        return [out[r] for r in rids]

    def _mark(self, rid: int, drid: int) -> None:
        seq = self.engine.seqs[drid]
        self._marks[rid][seq.length] = dict(seq.kda)

    def _follow(self, rid: int, ctx: list[int]) -> int:
        """The draft sequence of `rid`, rewound to the longest prefix of ctx it holds a state for."""
        eng = self.engine
        drid = self._seqs.get(rid)
        if drid is None:
            drid = self._seqs[rid] = eng.open()
            self._marks[rid] = {}
            return drid
        seq = eng.seqs[drid]
        common = 0
        for a, b in zip(seq.tokens, ctx):
            if a != b:
                break
            common += 1
        if common == len(ctx):          # nothing new to feed: step back one token to get the next logits
            common -= 1
        if common < seq.length:
            marks = self._marks[rid]
            back = max((n for n in marks if n <= common), default=None)
            if back is None:            # no state that early: start over
                eng.finish(drid)
                drid = self._seqs[rid] = eng.open()
                self._marks[rid] = {}
                return drid
            eng.rewind(drid, back, marks[back])
        self._marks[rid] = {n: m for n, m in self._marks[rid].items() if n <= eng.seqs[drid].length}
        return drid

    def forget(self, rid: int) -> None:
        drid = self._seqs.pop(rid, None)
        self._marks.pop(rid, None)
        if drid is not None:
            self.engine.finish(drid)


# ---- verification ------------------------------------------------------------------------------------------------
def accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """Emitted tokens of a greedy row: target[i] is the target's argmax after the i-th call token (the last
    context token, then each draft); the drafts up to the first disagreement, then the target's own token."""
    n = 0
    for d, t in zip(drafts, target):
        if d != t:
            break
        n += 1
    return target[:n + 1]


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from a distribution [V] (fp32, sums to ~1) with one uniform from the request's generator."""
    u = torch.rand(1, generator=gen).item()
    cdf = probs.double().cumsum(0)
    at = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(at, int(probs.nonzero()[-1]))


def accept_sampled(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                   gen: torch.Generator) -> list[int]:
    """Emitted tokens of a sampled row (rejection sampling against point-mass drafts): logits [>= len(drafts) + 1,
    V], row i the target's logits after the i-th call token."""
    p = filtered_probs(logits[:len(drafts) + 1].float(), params).cpu()
    out = []
    for i, d in enumerate(drafts):
        if torch.rand(1, generator=gen).item() < float(p[i, d]):
            out.append(d)
            continue
        resid = p[i].clone()
        resid[d] = 0.0
        if float(resid.sum()) <= 0.0:     # p was a point mass at d: accepted with probability 1 above
            out.append(d)
            continue
        out.append(_draw(resid / resid.sum(), gen))
        return out
    out.append(_draw(p[len(drafts)], gen))
    return out


# ---- the controller ----------------------------------------------------------------------------------------------
@dataclass
class Speculation:
    """What the engine drafts with and how much: `drafter` (NgramDrafter or DraftModelDrafter), at most
    `draft_len` tokens a step.

    With `adaptive`, drafting pays for itself or stops. The cost side is per batch size: the engine times its whole
    decode steps, verifying ones (drafting, the call, acceptance, rollback) and plain ones (without their shadow
    drafting and scoring: the alternative to verifying is decoding without speculation), and the controller keeps
    the median of the last few of each (steps that captured a CUDA graph or moved the batch's KDA rows into a
    graph's slots, the first step of each kind and steps that tried to draft and found nothing are no sample). A
    batch size without both costs uses the cost ratio of the nearest one within a factor of two that has them; with
    none, it verifies until its verification cost is known, then decodes plainly until the plain cost is. The gain
    side is per request: the tokens its verifications emitted when it had a draft (an EMA; a request not yet
    verified counts as the mean of every request's so far, draft_len + 1 before the first) and how often its drafter
    finds one (an EMA; a verification without a draft emits one token): `expected`. A step drafts when the expected
    tokens of three quarters of the batch's requests beat the cost ratio by `margin` (`pays`), and verifies the
    drafts in hand only when they pass the same test with the rows that found none counted at one token (`worth`;
    otherwise it decodes plainly and scores them as shadow drafts). Otherwise it decodes plainly and probes (asks
    the drafter, which refreshes every row's gain) every (ratio - 1) / probe_cost plain steps, twice as long after
    each probe that did not pay (up to 32x), and only at that longest interval when a verification costs more than
    draft_len + 1 plain steps (no acceptance could pay for it). With a cheap drafter (prompt lookup), plain steps
    also shadow-draft (unless no acceptance could pay), after their call is launched: up to `shadow_rows` rows a
    step (round robin, one pending draft a row; each costs a lookup, a few us of host time) look up a draft, and
    once the tokens that follow decide it, the tokens a verification would have emitted count in the row's gain as
    a verified one's do, at no verification cost: a copy that resumes after the model departed from its source
    turns drafting back on within a few tokens."""

    drafter: object
    draft_len: int = 4
    adaptive: bool = True
    probe_cost: float = 0.05
    buckets: tuple[int, ...] = ()          # draft lengths calls are padded to (one CUDA graph each); () = draft_len
    margin: float = 0.05
    shadow_rows: int = 2

    MAX_BACKOFF = 32
    SAMPLES = 3                            # step times per (batch, kind) before that cost is known
    WINDOW = 9                             # the median is over the last WINDOW step times

    def __post_init__(self):
        if isinstance(self.draft_len, bool) or not isinstance(self.draft_len, int) or not 1 <= self.draft_len <= 64:
            raise ArgumentError(f"draft_len must be an integer in [1, 64], got {self.draft_len!r}")
        if not self.buckets:       # one verification shape per batch size: its graph is captured once and hit
            self.buckets = (self.draft_len,)
        self._times: dict[tuple, list[float]] = {}   # (batch, plain?) -> the last step times
        self._median: dict[tuple, float] = {}        # (batch, plain?) -> their median, once SAMPLES are in
        self._ratio: dict[int, float] = {}           # batch -> verification / plain median, both known
        self._seen: dict[tuple, int] = {}            # (batch, plain?) -> steps observed
        self._gain: dict[int, float] = {}            # request -> EMA tokens per verification with a draft
        self._found: dict[int, float] = {}           # request -> EMA of whether its drafter found a draft
        self._all_found = 1.0                        # that EMA over every request's
        self._all_gain: float | None = None          # EMA over every request's verifications
        self._since: dict[int, int] = {}             # batch -> plain steps since the last probe
        self._backoff: dict[int, int] = {}           # batch -> the multiple of probe_interval
        self._shadow: dict[int, tuple[int, list[int]]] = {}   # request -> (context length, its pending shadow draft)
        self._shadow_turn = 0

    def bucket(self, d: int) -> int:
        """The padded draft length of a call whose longest draft is d (> 0)."""
        return next(b for b in self.buckets if b >= d)

    def cost(self, batch: int, plain: bool) -> float | None:
        """The median seconds of a (plain or verifying) step of `batch` sequences; None until known."""
        return self._median.get((batch, plain))

    def gain(self, rids: list[int]) -> float:
        """The mean tokens a verification is expected to emit per sequence of these requests (a request not yet
        verified: every request's mean so far, draft_len + 1 before any)."""
        prior = self._prior()
        return sum(self._gain.get(r, prior) for r in rids) / len(rids)

    def _prior(self) -> float:
        """The gain of a request not yet verified: every request's mean so far, draft_len + 1 before any."""
        return self._all_gain if self._all_gain is not None else self.draft_len + 1.0

    def _beats(self, gains, ratio: float) -> bool:
        """Whether the lower quartile of these per-request tokens a verification beats the cost ratio by margin."""
        gains = sorted(gains)
        return gains[len(gains) // 4] > (1.0 + self.margin) * ratio

    def ratio(self, batch: int) -> float | None:
        """A verification step's cost in plain steps at this batch size: measured there, else at the nearest batch
        size within a factor of two where both are (the ratio changes slowly with the batch; a batch that shrinks
        as requests finish at different speeds would otherwise relearn every size); None when none has both (then
        this batch size learns its own: a verification of 32 sequences costs several plain steps where one of a
        single sequence costs about one)."""
        near = [b for b in self._ratio if batch <= 2 * b and b <= 2 * batch]    # within a factor of two
        if not near:
            return None
        b = batch if batch in self._ratio else min(near, key=lambda k: (abs(k - batch), k))
        return self._ratio[b]

    def probe_interval(self, ratio: float) -> int:
        """Plain steps between probes before backoff: a probe that keeps nothing costs ratio - 1 plain steps more
        than a plain step would."""
        return max(1, math.ceil((ratio - 1.0) / self.probe_cost))

    def pays(self, rids: list[int], ratio: float) -> bool:
        """Whether verifying beats plain decoding by the margin, at this cost ratio, for three quarters of these
        requests: a request whose verifications emit fewer tokens than they cost in plain steps is slowed down by
        each (at batch 32, ~3 plain steps for a verification at k3-stdlib), and a fixed batch ends with its slowest
        request; the batch's mean gain would trade those requests for the others."""
        if (1.0 + self.margin) * ratio >= self.draft_len + 1:
            return False                    # no request's tokens can beat it: every draft kept emits draft_len + 1
        return self._beats([self.expected(r) for r in rids], ratio)

    def expected(self, rid: int) -> float:
        """The tokens a verification of request rid is expected to emit: its gain when it has a draft, weighted by
        how often its drafter finds one (a verification without one emits one token)."""
        hit = self._found.get(rid, self._all_found)
        return 1.0 + hit * (self._gain.get(rid, self._prior()) - 1.0)

    def found(self, rids: list[int], lengths: list[int]) -> None:
        """The drafter was asked for these requests' drafts and found drafts of these lengths (0: none)."""
        for r, n in zip(rids, lengths):
            hit = 1.0 if n else 0.0
            old = self._found.get(r)
            self._found[r] = hit if old is None else 0.8 * old + 0.2 * hit
            self._all_found = 0.95 * self._all_found + 0.05 * hit

    def worth(self, rids: list[int], found: list[int]) -> bool:
        """Whether verifying the drafts in hand pays (found: each request's draft length this step, 0 for none):
        `pays`, with a request that found no draft counted at the one token it would emit. Rows of one call are
        padded to its longest draft, so a row without one pays a verification's cost for a plain step's token.
        True while the cost ratio is unknown or the controller is not adaptive."""
        ratio = self.ratio(len(rids)) if self.adaptive else None
        if ratio is None:
            return True
        prior, gain = self._prior(), self._gain
        return self._beats([gain.get(r, prior) if n else 1.0 for r, n in zip(rids, found)], ratio)

    def wanted(self, rids: list[int]) -> bool:
        """Whether this step of the decoding requests `rids` should draft."""
        b = len(rids)
        if not self.adaptive:
            return True
        ratio = self.ratio(b)
        if ratio is None:                      # nothing near known: learn at this batch size, verifications first
            return self.cost(b, False) is None
        if self.pays(rids, ratio):
            self._backoff[b] = 1
            return True
        if ratio > self.draft_len + 1:
            self._backoff[b] = self.MAX_BACKOFF              # not even every draft kept would pay
        self._since[b] = self._since.get(b, 0) + 1
        if self._since[b] >= self.probe_interval(ratio) * self._backoff.get(b, 1):
            self._since[b] = 0
            self._backoff[b] = min(2 * self._backoff.get(b, 1), self.MAX_BACKOFF)
            return True
        return False

    def observe(self, rids: list[int], seconds: float, emitted: dict[int, int] | None, timed: bool = True) -> None:
        """A decode step of `rids` took `seconds`; emitted: tokens per verified request (None: a plain step, one
        that did not try to draft). timed=False (a step that captured a CUDA graph) and the first step of each kind
        per batch size (it runs eagerly: a shape's graph is made on its second call) add no time."""
        for r, n in (emitted or {}).items():
            self._credit(r, n)
        kind = (len(rids), emitted is None)
        self._seen[kind] = self._seen.get(kind, 0) + 1
        if timed and self._seen[kind] > 1:
            t = self._times.setdefault(kind, [])
            t.append(seconds)
            del t[:-self.WINDOW]
            if len(t) >= self.SAMPLES:        # medians and ratios kept current here: wanted() runs every step
                self._median[kind] = sorted(t)[(len(t) - 1) // 2]
                b = kind[0]
                if (b, True) in self._median and (b, False) in self._median:
                    self._ratio[b] = self._median[(b, False)] / self._median[(b, True)]

    def _credit(self, rid: int, n: int) -> None:
        """A verification of request rid emitted (or would have emitted) n tokens."""
        old = self._gain.get(rid)
        self._gain[rid] = n if old is None else 0.7 * old + 0.3 * n
        self._all_gain = n if self._all_gain is None else 0.95 * self._all_gain + 0.05 * n

    def shadow_rids(self, rids: list[int]) -> list[int]:
        """Of a plain step's requests, those to shadow-draft: none unless the drafter is cheap and the controller
        adaptive; else up to shadow_rows without a pending shadow draft, taken round robin."""
        if not self.adaptive or not getattr(self.drafter, "cheap", False) or self.shadow_rows <= 0:
            return []
        ratio = self.ratio(len(rids))
        if ratio is not None and ratio > self.draft_len + 1:     # no acceptance could pay: nothing to learn
            return []
        free = [r for r in rids if r not in self._shadow]
        if not free:
            return []
        at = self._shadow_turn % len(free)
        self._shadow_turn += self.shadow_rows
        return (free[at:] + free[:at])[:self.shadow_rows]

    def shadow(self, rid: int, length: int, draft: list[int]) -> None:
        """Request rid's drafter proposed `draft` after its first `length` tokens, on a plain step."""
        if draft:
            self._shadow[rid] = (length, list(draft))

    def settle(self, seqs: dict) -> None:
        """Score the pending shadow drafts against their requests' tokens ({request: its sequence, whose `tokens`
        are its context so far}) where those decide them (a mismatch, or every drafted position filled): a verification would have kept the matching
        drafts plus one token of the target's."""
        for rid in [r for r in self._shadow if r in seqs]:
            length, draft = self._shadow[rid]
            new = seqs[rid].tokens[length:length + len(draft)]
            kept = 0
            while kept < len(new) and new[kept] == draft[kept]:
                kept += 1
            if kept == len(new) < len(draft):     # every token so far matches, and more are drafted: wait
                continue
            del self._shadow[rid]
            self._credit(rid, kept + 1)

    def prepare(self, rid: int, ctx: list[int]) -> None:
        """Request rid has its first token (ctx: its context): a drafter that indexes contexts does so now."""
        if hasattr(self.drafter, "prepare"):
            self.drafter.prepare(rid, ctx)

    def index(self, rids: list[int], contexts: list[list[int]]) -> None:
        """A drafter that indexes contexts brings these requests' up to date (the engine calls this while the device
        runs a step: NgramDrafter.slack)."""
        if hasattr(self.drafter, "index"):
            self.drafter.index(rids, contexts)

    def forget(self, rid: int) -> None:
        self._gain.pop(rid, None)
        self._found.pop(rid, None)
        self._shadow.pop(rid, None)
        self.drafter.forget(rid)

    def rates(self) -> dict[int, dict]:
        """Per batch size: plain and verification step seconds (medians) and, both known, the tokens per
        verification at which verifying breaks even with plain decoding."""
        out = {}
        for b in sorted({k[0] for k in self._times}):
            row = {"plain_s": self.cost(b, True), "verify_s": self.cost(b, False)}
            if row["plain_s"] and row["verify_s"]:
                row["breakeven_tokens"] = row["verify_s"] / row["plain_s"]
            out[b] = row
        return out


def propose(spec: Speculation, rids: list[int], contexts: list[list[int]], ks: list[int]) -> list[list[int]]:
    d = spec.drafter
    if hasattr(d, "propose_for"):
        return d.propose_for(rids, contexts, ks)
    return d.propose(contexts, ks)


def parse_speculate(text: str, draft_len: int, load_draft=None) -> Speculation:
    """`--speculate ngram` or `draft:PATH` (load_draft(PATH) -> the draft Engine)."""
    if text == "ngram":
        return Speculation(NgramDrafter(), draft_len=draft_len)
    if text.startswith("draft:") and len(text) > 6:
        if load_draft is None:
            raise ArgumentError("--speculate draft:PATH needs a draft model loader")
        return Speculation(DraftModelDrafter(load_draft(text[6:])), draft_len=draft_len)
    raise ArgumentError(f"--speculate must be ngram or draft:PATH, got {text!r}")


__all__ = ["NgramDrafter", "DraftModelDrafter", "Speculation", "accept_greedy", "accept_sampled", "propose",
           "parse_speculate"]
