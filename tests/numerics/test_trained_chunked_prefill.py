"""The trained example model through chunked prefill (bench/trained.py's chunked-prefill path: chunks of 45 tokens,
so boundaries fall inside KDA's 16-token sub-chunks and MLA pages) against whole-prompt prefill, fp32 on the CPU:
held-out perplexity within 0.1% (issue 56's bound; measured: 0, the same nll to the last bit on these windows)
and the same greedy tokens."""
from __future__ import annotations

import torch

from trained_checks import needs_example, ppl_change, trained

pytestmark = needs_example


def test_chunked_prefill_perplexity_and_greedy_equal_whole_prefill(heldout):
    windows = heldout.windows[:4, :129]                  # 128 scored positions each: chunks of 45, 45, 38
    whole = trained.heldout_nll("compiled-fp32", windows, kernels=False)
    chunked = trained.heldout_nll("chunked-prefill", windows, kernels=False, dtype=torch.float32)
    assert abs(ppl_change(chunked, whole)) <= 1e-3, ppl_change(chunked, whole)
    prompts = windows[:2, :100].tolist()                 # prompts of 100 tokens: 45 + 45 + 10 under the budget
    want = trained.greedy("compiled-fp32", prompts, 8, kernels=False)
    got = trained.greedy("chunked-prefill", prompts, 8, kernels=False, dtype=torch.float32)
    assert [g.tokens for g in got] == [g.tokens for g in want]
