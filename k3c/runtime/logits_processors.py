"""Per-request changes to the logits before a token is chosen, batched over the rows that have them.

    proc = RowLogits(logit_bias={42: -100.0}, presence_penalty=0.5, frequency_penalty=0.2,
                     repetition_penalty=1.1, grammar=matcher)          # matcher: the TokenGrammar protocol below
    eng.add_request(ids, 64, logits=proc)
    # each step, for the rows choosing a token:  logits = process(logits, procs, contexts, prompt_lens)
    # after the choice:                          proc.accept(token)   (advances the grammar)
    # a speculative draft:  n = proc.draft_prefix(draft)   (the drafts the grammar takes; cut the rest)
    #                       proc.fill_draft_masks(draft, bitmask, row0)     (the mask at each verified position)

The rules (OpenAI's API and vLLM's, which match transformers' for the repetition penalty):
- repetition_penalty r (1: off) over every token of the context (prompt and generated): a positive logit divided
  by r, a negative one multiplied (transformers' RepetitionPenaltyLogitsProcessor);
- presence_penalty p and frequency_penalty f over the generated tokens only: logit - p * [count > 0] - f * count;
- logit_bias: added to the named tokens' logits;
- grammar: tokens the request's grammar forbids get -inf (its mask is computed on the host, one bit per token).
Applied in that order, before temperature, top-k and top-p (sampling.py): greedy requests are constrained too.

Speculative verification applies the same rules at every verified position of a draft, exactly: position j's row
is processed with the context extended by the draft's first j tokens (its penalties count them) and with the
grammar's mask after those tokens (fill_draft_masks walks the grammar along the draft and back), so a draft token
is accepted only when the processed logits accept it; a token the grammar refuses is never drafted (draft_prefix).

Batched: one [R, V] count tensor built by one scatter-add over the rows' padded token ids, one index_put of every
row's biases, one unpack of the rows' grammar bitmasks into a boolean mask, all on the logits' device; the only
per-row work is the host side of the grammar (filling its bitmask), done before any of these ops waits on the
device, so it overlaps the step's graph call the logits come from.
"""
from __future__ import annotations

import math
import numbers
from typing import Protocol

import torch

from ..errors import ArgumentError

MAX_LOGIT_BIAS = 100.0     # OpenAI's bound on a bias


class TokenGrammar(Protocol):
    """What the engine needs of a request's grammar (serve/grammar.py implements it over llguidance)."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit t % 32 of word t // 32)."""

    def accept(self, token: int) -> None:
        """Advance past the chosen token."""

    def advance(self, token: int) -> bool:
        """Advance past `token` if the grammar allows it here (False: refused, nothing changed)."""

    def rollback(self, n: int) -> None:
        """Undo the last n tokens advanced past."""

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing may follow (the request ends)."""


def _number(name: str, v, low: float, high: float) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not low <= v <= high:
        raise ArgumentError(f"{name} must be a finite number in [{low:g}, {high:g}], got {v!r}")
    return float(v)


class RowLogits:
    """One request's logit changes (module docstring)."""

    def __init__(self, *, logit_bias: dict[int, float] | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, grammar: TokenGrammar | None = None):
        self.presence = _number("presence_penalty", presence_penalty, -2.0, 2.0)
        self.frequency = _number("frequency_penalty", frequency_penalty, -2.0, 2.0)
        r = repetition_penalty
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r) or r <= 0:
            raise ArgumentError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        self.repetition = float(r)
        self.bias = {int(t): _number(f"logit_bias[{t}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                     for t, b in (logit_bias or {}).items()}
        self.grammar = grammar

    @property
    def penalized(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1.0

    @property
    def active(self) -> bool:
        return self.penalized or bool(self.bias) or self.grammar is not None

    def accept(self, token: int) -> None:
        if self.grammar is not None:
            self.grammar.accept(token)

    @property
    def finished(self) -> bool:
        return self.grammar is not None and self.grammar.finished

    def draft_prefix(self, draft: list[int]) -> int:
        """How many leading tokens of a speculative draft the grammar takes: up to the first it refuses, and short
        of one that completes it (that token is left to the model's own pick, after which nothing may follow). The
        grammar is left where it was. Without a grammar: all of them."""
        g = self.grammar
        if g is None:
            return len(draft)
        n, completes = 0, False
        for t in draft:
            if not g.advance(t):
                break
            n += 1
            if g.finished:
                completes = True
                break
        g.rollback(n)
        return n - 1 if completes else n

    def fill_draft_masks(self, draft: list[int], bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row + j] = the grammar's mask after draft[:j], j = 0..len(draft) (each verified position of the
        draft; every draft token must be one the grammar takes: draft_prefix). The grammar is left where it was."""
        g = self.grammar
        for j, t in enumerate(draft):
            g.fill_mask(bitmask, row + j)
            if not g.advance(t):
                g.rollback(j)
                raise ValueError(f"draft token {t} at {j} is not one the grammar takes (cut drafts with "
                                 f"draft_prefix)")
        g.fill_mask(bitmask, row + len(draft))
        g.rollback(len(draft))


def _padded(lists: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R, L] padded with 0, valid [R, L] float) of token lists, on `device` (one copy each)."""
    width = max(1, max(len(x) for x in lists))
    ids = torch.zeros(len(lists), width, dtype=torch.long)
    valid = torch.zeros(len(lists), width)
    for i, x in enumerate(lists):
        if x:
            ids[i, :len(x)] = torch.tensor(x)
            valid[i, :len(x)] = 1
    return ids.to(device, non_blocking=True), valid.to(device, non_blocking=True)


def _counts(lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    ids, valid = _padded(lists, device)
    return torch.zeros(len(lists), vocab, device=device).scatter_add_(1, ids, valid)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [R, W] -> allowed [R, vocab] bool."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def mask_words(vocab: int) -> int:
    """int32 words of a grammar bitmask row over `vocab` tokens."""
    return (vocab + 31) // 32


def fill_masks(grammars: list, bitmask: torch.Tensor) -> None:
    """bitmask[j] = grammars[j]'s mask: in one call of their class's `fill_masks(grammars, bitmask)` when they share a
    class that has one (serve/grammar.py: xgrammar's batch fill, rows in parallel threads: at a vocabulary of K3's
    size one row's mask takes ~0.5 ms), else row by row."""
    kind = type(grammars[0])
    batch = getattr(kind, "fill_masks", None)
    if batch is not None and all(type(g) is kind for g in grammars):
        batch(grammars, bitmask)
        return
    for j, g in enumerate(grammars):
        g.fill_mask(bitmask, j)


def process(logits: torch.Tensor, procs: list, contexts: list[list[int]], prompt_lens: list[int],
            bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] after each row's RowLogits (None: unchanged); `contexts` the rows' tokens so far (prompt then
    generated: read for penalized rows only), `prompt_lens` where their generated tokens start. `bitmask`: the masks
    of the rows with a grammar, one row each in row order, filled already (a draft's positions: fill_draft_masks);
    None: each row's grammar fills its own. A new tensor when any row changes."""
    rows = [i for i, p in enumerate(procs) if p is not None and p.active]
    if not rows:
        return logits
    B, V = logits.shape
    dev = logits.device
    grammar_rows = [i for i in rows if procs[i].grammar is not None]
    if bitmask is not None and bitmask.shape[0] != len(grammar_rows):
        raise ValueError(f"{bitmask.shape[0]} grammar masks for {len(grammar_rows)} rows with a grammar")
    if grammar_rows and bitmask is None:             # host work first: nothing above has waited on the device
        bitmask = torch.zeros(len(grammar_rows), mask_words(V), dtype=torch.int32)
        fill_masks([procs[i].grammar for i in grammar_rows], bitmask)
    out = logits.float()
    if out is logits:                                # fp32 already: a copy to change (bf16 -> fp32 copied once)
        out = out.clone()
    pen = [i for i in rows if procs[i].penalized]
    if pen:
        index = torch.tensor(pen, device=dev)
        sub = out.index_select(0, index)
        rep = torch.tensor([procs[i].repetition for i in pen], device=dev)[:, None]
        if any(procs[i].repetition != 1.0 for i in pen):
            seen = _counts([contexts[i] for i in pen], V, dev) > 0
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(procs[i].presence or procs[i].frequency for i in pen):
            gen = _counts([contexts[i][prompt_lens[i]:] for i in pen], V, dev)
            presence = torch.tensor([procs[i].presence for i in pen], device=dev)[:, None]
            frequency = torch.tensor([procs[i].frequency for i in pen], device=dev)[:, None]
            sub = sub - presence * (gen > 0) - frequency * gen
        out.index_copy_(0, index, sub)
    biased = [(i, t, b) for i in rows for t, b in procs[i].bias.items() if t < V]
    if biased:
        r, t, b = zip(*biased)
        out.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                       torch.tensor(b, device=dev), accumulate=True)
    if grammar_rows:
        index = torch.tensor(grammar_rows, device=dev)
        allowed = unpack_bitmask(bitmask.to(dev, non_blocking=True), V)
        out.index_copy_(0, index, out.index_select(0, index).masked_fill(~allowed, -math.inf))
    return out.to(logits.dtype)
