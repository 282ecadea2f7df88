"""k3c.runtime.sampling against Hugging Face's logits warpers (transformers.generation.logits_process applied in
generate()'s order: temperature, top-k, top-p): the filtered distribution exactly, the draws statistically;
greedy is the argmax; a request's draws depend on its seed only; bad parameters are one-line ArgumentErrors."""
import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from k3c.errors import ArgumentError
from k3c.runtime.sampling import GREEDY, SamplingParams, filtered_probs, make_generator, params_for_rows, sample

V = 64


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution transformers' generate() samples from (its warpers in its order; a warper is left out
    where generate() leaves it out: top_k 0, top_p 1)."""
    scores = TemperatureLogitsWarper(p.temperature)(None, logits[None].float().clone())
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return scores.softmax(-1)[0]


def clear_logits(seed: int, p: SamplingParams) -> torch.Tensor:
    """Random logits [V] with no tie and no top-p boundary within 1e-4 of top_p (an exact comparison is then
    free of rounding at the cut): the first of a fixed sequence of draws that has both."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(V, generator=gen) * 2.5
        probs = (x / p.temperature).sort(descending=True).values
        if p.top_k:
            probs = probs[:p.top_k]
        cum = probs.softmax(-1).cumsum(-1)
        clear = p.top_p == 1.0 or bool(((cum - p.top_p).abs() > 1e-4).all())
        if len(set(x.tolist())) == V and clear:
            return x


GRID = [SamplingParams(t, p, k) for t in (0.5, 1.0, 1.7) for k in (0, 1, 5, 40) for p in (1.0, 0.9, 0.5, 0.05)]


def test_filtered_distribution_equals_hf_warpers():
    rows = [clear_logits(i, p) for i, p in enumerate(GRID)]
    batch = torch.stack(rows)
    together = filtered_probs(batch, GRID)                  # one call over rows of different params
    for i, p in enumerate(GRID):
        ref = hf_probs(rows[i], p)
        assert torch.equal(together[i] > 0, ref > 0), p     # the same kept set, token for token
        torch.testing.assert_close(together[i], ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(filtered_probs(rows[i][None], p)[0], together[i], atol=0, rtol=0)


def test_greedy_is_the_argmax_without_randomness():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(sample(logits, GREEDY), logits.argmax(-1))
    assert torch.equal(sample(logits, [GREEDY] * 5, [None] * 5), logits.argmax(-1))
    assert torch.equal(filtered_probs(logits, GREEDY).argmax(-1), logits.argmax(-1))
    assert GREEDY.seeded().seed is None and make_generator(GREEDY) is None


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic of `counts` against n x probs over the tokens either side gives mass (a count where the
    expected is 0 makes it infinite), and its degrees of freedom."""
    support = (probs > 0) | (counts > 0)
    expected = probs[support].double() * n
    observed = counts[support].double()
    if bool((expected == 0).any()):
        return math.inf, int(support.sum()) - 1
    return float(((observed - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def bound(df: int) -> float:
    """Far above the chi-square 1 - 1e-6 quantile for these df (df + 7 sqrt(2 df) + 15): a correct sampler with a
    fixed seed passes with room, a distribution off by one token misses by orders of magnitude."""
    return df + 7 * math.sqrt(2 * df) + 15


@pytest.mark.parametrize("p", [SamplingParams(1.0, 0.9, 0, seed=11), SamplingParams(2.0, 0.95, 20, seed=12),
                               SamplingParams(1.3, 1.0, 5, seed=13), SamplingParams(2.0, 1.0, 0, seed=1)])
def test_draws_follow_the_hf_distribution(p):
    n = 20000
    x = clear_logits(100, p)
    ref = hf_probs(x, p)
    rows = params_for_rows(p, n)                              # n requests, seeds seed .. seed + n - 1
    tokens = sample(x.expand(n, V), rows, [make_generator(r) for r in rows])
    counts = torch.bincount(tokens, minlength=V)
    stat, df = chi_square(counts, ref, n)
    assert stat < bound(df), (stat, df)
    # the same draws against the distribution of a top-p or top-k one token wider or narrower: far outside
    kept = int((ref > 0).sum())
    order = x.argsort(descending=True)
    for width in (kept - 1, kept + 1):
        if not 1 <= width <= V:
            continue
        wrong = torch.zeros(V)
        wrong[order[:width]] = (x[order[:width]] / p.temperature).softmax(-1)
        assert chi_square(counts, wrong, n)[0] > bound(df), width


def test_draws_depend_on_the_seed_only():
    """A request's tokens over several steps: alone, at another row, among other sampled and greedy rows."""
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(4, V, generator=gen) for _ in range(6)]
    mine = SamplingParams(0.9, 0.8, 20, seed=1234)
    other = SamplingParams(1.5, 1.0, 0, seed=99)

    def tokens(layout):                 # layout: params per row; returns the tokens of the row holding `mine`
        gens = [make_generator(q) for q in layout]
        row = layout.index(mine)
        return [int(sample(s[:len(layout)], layout, gens)[row]) for s in steps]

    g = make_generator(mine)
    alone = [int(sample(s[2:3], mine, [g])[0]) for s in steps]
    # each step's row 2 holds the logits `mine` sees in every layout below
    for layout in ([other, GREEDY, mine], [GREEDY, other, mine, other]):
        assert tokens(layout) == alone
    assert tokens([GREEDY, GREEDY, mine]) == alone
    again = SamplingParams(0.9, 0.8, 20, seed=1235)
    g = make_generator(again)
    assert [int(sample(s[2:3], again, [g])[0]) for s in steps] != alone


def test_seeds_drawn_and_per_row():
    p = SamplingParams(temperature=1.0).seeded()
    assert isinstance(p.seed, int) and 0 <= p.seed < 2 ** 63
    assert [r.seed for r in params_for_rows(SamplingParams(1.0, seed=7), 3)] == [7, 8, 9]
    assert params_for_rows(None, 2) == [GREEDY, GREEDY]
    assert [r.seed for r in params_for_rows([SamplingParams(1.0, seed=4), GREEDY], 2)] == [4, None]
    with pytest.raises(ArgumentError, match="2 SamplingParams for 3 prompts"):
        params_for_rows([GREEDY, GREEDY], 3)


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": 2 ** 63}, "seed"), ({"seed": 1.0}, "seed"),
])
def test_bad_params_are_argument_errors(kw, field):
    with pytest.raises(ArgumentError, match=rf"sampling {field} must be") as exc:
        SamplingParams(**kw)
    assert "\n" not in str(exc.value)


def test_sample_checks_its_arguments():
    logits = torch.randn(2, V)
    hot = SamplingParams(1.0, seed=1)
    with pytest.raises(ArgumentError, match="needs its torch.Generator"):
        sample(logits, [hot, GREEDY], [None, None])
    with pytest.raises(ArgumentError, match="one SamplingParams per row"):
        sample(logits, [hot])
    with pytest.raises(ArgumentError, match=r"float tensor \[B, V\]"):
        sample(logits[0], GREEDY)
    with pytest.raises(ArgumentError, match="seeded params"):
        make_generator(SamplingParams(1.0))
