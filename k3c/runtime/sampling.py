"""Choosing the next token from logits: the one sampler of the engine and the session.

    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1).seeded()
    gen = make_generator(params)                          # one per request: its draws are its own
    ids = sample(logits, [params, GREEDY], [gen, None])   # logits [B, V] -> token ids [B] (on logits' device)

Temperature 0 is greedy: the argmax, no randomness. Otherwise, in Hugging Face's order (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper): logits / temperature in fp32, the top_k largest kept (0: all), then the
nucleus: the smallest set of the most likely tokens whose probability reaches top_p (always at least one token);
the draw is an inverse-CDF lookup of one uniform number taken from the request's own CPU generator, so a request's
tokens do not depend on which other requests share its batch or where it sits in it.

What the sampler computes, and so what SamplingParams takes (docs/runtime.md, "Sampling"):
- temperature: 0 (greedy) or a finite number > 0; one in (0, MIN_TEMPERATURE) samples at MIN_TEMPERATURE. Below it
  fp32 gains nothing (at 1e-4 a token 0.01 below the top logit is already e^-100 less likely), and below ~1e-45
  the divisor underflows to 0 in fp32 (NaN probabilities).
- top_p: any number in (0, 1]: the most likely token is always kept, so a top_p at or below its probability
  (an fp32 underflow to 0 included) keeps that token alone.
- top_k: an integer in [0, limits.MAX_TOP_K]; a value past the vocabulary means the whole vocabulary.

sample_rows() confines a failure to its row: a batch whose sampling raises is sampled again row by row with the
same uniform numbers, so the other rows draw exactly what they would have, and the failing row gets its exception.
"""
from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass, replace

import torch

from ..errors import ArgumentError
from ..limits import MAX_SEED, MAX_TOP_K

MIN_TEMPERATURE = 1e-4      # a positive temperature below this samples at this (module docstring)
_PROCESS_RNG = random.Random()          # seeds of requests that name none (seeded from the OS at import)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0: greedy
    top_p: float = 1.0           # nucleus mass in (0, 1]; 1: off
    top_k: int = 0               # keep the k most likely tokens; 0: off
    seed: int | None = None      # of the request's generator; None: drawn from a process RNG by seeded()
    repetition_penalty: float = 1.0   # > 0; 1: off (penalize(): the context's tokens made less likely)

    def __post_init__(self):
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r) or r <= 0:
            raise ArgumentError(f"repetition penalty must be a finite number > 0, got {r!r}")
        object.__setattr__(self, "repetition_penalty", float(r))
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ArgumentError(f"sampling temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            t = MIN_TEMPERATURE
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:    # NaN fails both
            raise ArgumentError(f"sampling top_p must be a number in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= MAX_TOP_K:
            raise ArgumentError(f"sampling top_k must be an integer in [0, 2**31] (past the vocabulary: all of it), "
                                f"got {k!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s <= MAX_SEED):
            raise ArgumentError(f"sampling seed must be an integer in [0, 2**63 - 1] or None, got {s!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "seed", None if s is None else int(s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seeded(self) -> SamplingParams:
        """These params with a seed: their own, or one drawn from the process RNG (greedy needs none)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=_PROCESS_RNG.randrange(MAX_SEED + 1))


GREEDY = SamplingParams()


def penalize(logits: torch.Tensor, context: list[int], penalty: float) -> torch.Tensor:
    """A row of logits [V] with every token of `context` made less likely by `penalty`, transformers'
    RepetitionPenaltyLogitsProcessor rule: a positive logit divided by it, a negative one multiplied (a new
    tensor; penalty 1 returns the row as it is). Applied before temperature, top-k and top-p."""
    if penalty == 1.0 or not context:
        return logits
    from .logits_processors import RowLogits, process     # the one implementation of the rule (batched)

    return process(logits[None], [RowLogits(repetition_penalty=penalty)], [list(context)], [len(context)])[0]


def as_params(sampling, name: str = "sampling") -> SamplingParams:
    """`sampling` (SamplingParams or None: greedy), checked."""
    if sampling is None:
        return GREEDY
    if not isinstance(sampling, SamplingParams):
        raise ArgumentError(f"{name} must be a SamplingParams or None, got {type(sampling).__name__}")
    return sampling


def params_for_rows(sampling, rows: int) -> list[SamplingParams]:
    """One seeded SamplingParams per row: a list is taken as it is (one per row); one SamplingParams (or None)
    serves every row, row i drawing from seed + i (the seed drawn once when it is None), so row 0 of a batch draws
    what the same request alone draws."""
    if isinstance(sampling, (list, tuple)):
        if len(sampling) != rows:
            raise ArgumentError(f"sampling: {len(sampling)} SamplingParams for {rows} prompts")
        return [as_params(p, f"sampling[{i}]").seeded() for i, p in enumerate(sampling)]
    one = as_params(sampling).seeded()
    if one.greedy:
        return [one] * rows
    return [replace(one, seed=(one.seed + i) % (MAX_SEED + 1)) for i in range(rows)]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's generator (CPU, seeded from params.seed; params must be seeded()); None for greedy."""
    if params.greedy:
        return None
    if params.seed is None:
        raise ArgumentError("make_generator() needs seeded params (SamplingParams.seeded())")
    return torch.Generator().manual_seed(params.seed)


def _rows(logits, params) -> list[SamplingParams]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ArgumentError(f"logits must be a float tensor [B, V], got "
                            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if isinstance(params, SamplingParams):
        return [params] * logits.shape[0]
    params = list(params)
    if len(params) != logits.shape[0] or not all(isinstance(p, SamplingParams) for p in params):
        raise ArgumentError(f"sample(): one SamplingParams per row of logits ({logits.shape[0]}), got {len(params)}")
    return params


def _sorted_filtered(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [B, V] sorted in descending order, zero outside each row's kept set; their token ids) after
    temperature, top-k and top-p. Every row here samples (temperature > 0)."""
    dev, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    scores = logits.float()
    # shifted by the row's max first: a tiny temperature sends the others to -inf, never the max to inf (NaN)
    scores = (scores - scores.amax(-1, keepdim=True)) / temperature[:, None]
    scores, ids = scores.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)
    scores = scores.masked_fill(rank >= top_k[:, None], -math.inf)
    probs = scores.softmax(-1)
    # a token stays while the mass of the tokens before it is below top_p: the smallest set reaching top_p, and
    # the most likely token always (rank 0: also when top_p underflowed to 0 in fp32); top_p 1 keeps every token
    # (the fp32 running sum may reach 1 before the tail)
    before = torch.cat([probs.new_zeros(probs.shape[0], 1), probs.cumsum(-1)[:, :-1]], dim=-1)
    scores = scores.masked_fill((before >= top_p[:, None]) & (top_p[:, None] < 1) & (rank > 0), -math.inf)
    return scores.softmax(-1), ids


def filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution sample() draws each row from, in vocabulary order [B, V] fp32: for a greedy row the
    one-hot of its argmax."""
    rows = _rows(logits, params)
    out = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    drawn = [i for i, p in enumerate(rows) if not p.greedy]
    if drawn:
        probs, ids = _sorted_filtered(logits[drawn], [rows[i] for i in drawn])
        out[drawn] = torch.zeros_like(probs).scatter_(1, ids, probs)
    return out


def _uniforms(rows: list[SamplingParams], drawn: list[int], generators) -> torch.Tensor:
    """One uniform number per sampled row, from its own generator (CPU)."""
    generators = list(generators) if generators is not None else []
    if len(generators) != len(rows) or not all(isinstance(generators[i], torch.Generator) for i in drawn):
        raise ArgumentError("sample(): every sampled row needs its torch.Generator (make_generator)")
    return torch.cat([torch.rand(1, generator=generators[i]) for i in drawn])


def _draw(logits: torch.Tensor, rows: list[SamplingParams], drawn: list[int], u: torch.Tensor) -> torch.Tensor:
    """Token ids [B]: the argmax for greedy rows, the inverse-CDF lookup of u for the rows in `drawn`."""
    picks = logits.argmax(-1)
    if not drawn:
        return picks
    whole = len(drawn) == len(rows)
    probs, ids = _sorted_filtered(logits if whole else logits[drawn], [rows[i] for i in drawn])
    u = u.to(logits.device)
    cdf = probs.cumsum(-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)    # first token whose cdf passes u
    kept = (probs > 0).sum(-1, keepdim=True)                                # the kept set is a sorted prefix
    tokens = ids.gather(1, torch.minimum(at, kept - 1))[:, 0]
    if whole:
        return tokens
    return picks.index_copy(0, torch.tensor(drawn, device=logits.device), tokens)


def sample(logits: torch.Tensor, params, generators=None) -> torch.Tensor:
    """Token ids [B] (int64, on logits' device) for logits [B, V]: `params` one SamplingParams for every row or
    one per row; `generators` one per row (make_generator; None for greedy rows). A batch of greedy rows is one
    argmax and nothing else (no host sync); the sampled rows share one sort and one inverse-CDF lookup."""
    rows = _rows(logits, params)
    drawn = [i for i, p in enumerate(rows) if not p.greedy]
    return _draw(logits, rows, drawn, _uniforms(rows, drawn, generators) if drawn else None)


def sample_rows(logits: torch.Tensor, params, generators=None) -> list:
    """sample() as a list with a failure confined to its row: each entry is the row's token id (int), or the
    exception its sampling raised. The batch is tried whole first (one sort, one host sync); when that raises,
    each row is sampled alone with the uniform number it had already drawn, so every other row gets the token it
    gets in a batch without the failing row."""
    rows = _rows(logits, params)
    drawn = [i for i, p in enumerate(rows) if not p.greedy]
    u = _uniforms(rows, drawn, generators) if drawn else None
    try:
        return _draw(logits, rows, drawn, u).tolist()
    except Exception:                                   # some row cannot be sampled: find which, keep the others
        pass
    slot = {row: j for j, row in enumerate(drawn)}
    out = []
    for i, p in enumerate(rows):
        try:
            one = _draw(logits[i:i + 1], [p], [] if p.greedy else [0], None if p.greedy else u[slot[i]][None])
            out.append(int(one[0]))
        except Exception as exc:
            out.append(exc)
    return out
