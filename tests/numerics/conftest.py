"""Fixtures of the trained-model numerics tests: the held-out sample and what the fp32 reference makes of it, once
per session (the agreement and the injected-bug tests compare with the same reference), and torch on one thread."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from trained_checks import (NEW_TOKENS, PROMPTS, WINDOW_LEN, WINDOWS, mxfp4_oracle_weights, one_thread, trained,
                            window_logits)


@dataclass
class Heldout:
    prompts: list[list[int]]
    windows: torch.Tensor            # [WINDOWS, WINDOW_LEN + 1]


@dataclass
class Reference:
    generations: list                # trained.Generation per prompt, NEW_TOKENS each
    nll: float                       # mean next-token nll over the windows


@pytest.fixture(autouse=True, scope="module")
def torch_one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def heldout() -> Heldout:
    return Heldout(trained.heldout_prompts(PROMPTS), trained.heldout_windows(WINDOWS, WINDOW_LEN))


@pytest.fixture(scope="session")
def reference(heldout) -> Reference:
    with one_thread():               # session fixtures are set up before the module's thread fixture
        return Reference(trained.greedy("reference-fp32", heldout.prompts, NEW_TOKENS),
                         trained.heldout_nll("reference-fp32", heldout.windows))


@pytest.fixture(scope="session")
def mxfp4_oracle_logits(heldout) -> torch.Tensor:
    """The bf16 reference on the checkpoint's MXFP4 expert values (the spec's scale rule): the mxfp4 path's oracle."""
    with one_thread():
        return window_logits("reference-bf16", heldout.windows, weights=mxfp4_oracle_weights(), kernels=False)
