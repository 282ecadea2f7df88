"""KV splits of the MQA decode: a tier kernel holds one program per SM, so its split count comes from waves x (pages
per split + a program's fixed cost) (runtime/kernel_impls/mla.py decode_splits); portable plans keep choose_splits.
Pure host logic: the SM count is set, no GPU."""
from __future__ import annotations

import pytest
import torch

from k3c.codegen.kernels.mla import DecodePlan
from k3c.runtime.kernel_impls import mla as rt

HOPPER = DecodePlan(64, 8, 1, tier="hopper")
PORTABLE = DecodePlan(16, 4, 2)


@pytest.fixture
def sms_132(monkeypatch):
    monkeypatch.setattr(rt, "_sm_count", lambda kind, index: 132)
    rt._choose_splits_resident.cache_clear()
    rt._choose_splits.cache_clear()
    yield torch.device("cuda", 0)
    rt._choose_splits_resident.cache_clear()
    rt._choose_splits.cache_clear()


def cost(batch, tiles, pages, s, sms=132):
    pps = -(-pages // s)
    return -(-batch * tiles * -(-pages // pps) // sms) * (pps + rt.RESIDENT_OVERHEAD_PAGES)


@pytest.mark.parametrize("batch, pages, want", [(32, 64, 2), (32, 512, 2), (128, 64, 1), (128, 512, 1),
                                                (1, 64, 32), (1, 512, 64)])
def test_tier_splits_fill_one_wave_of_long_splits(sms_132, batch, pages, want):
    # 96 heads = 2 tiles of 64 rows. B=32 x 2 tiles x 2 splits = 128 programs: one wave of 32 pages each, where the
    # portable rule (two programs an SM) asks for 8 splits: 4 waves of 8 pages, each paying the fixed cost
    s = rt.decode_splits(HOPPER, batch, 2, pages, sms_132)
    assert s == want
    best = min(cost(batch, 2, pages, k) for k in range(1, pages // 2 + 1))
    assert cost(batch, 2, pages, s) <= 1.02 * best
    assert all(cost(batch, 2, pages, k) > 1.02 * best for k in range(1, s))     # the smallest such S


def test_portable_plans_keep_choose_splits(sms_132):
    for batch, pages in ((32, 64), (1, 512), (128, 2048)):
        assert rt.decode_splits(PORTABLE, batch, 6, pages, sms_132) == rt.choose_splits(batch, 6, pages, sms_132)
    assert rt.decode_splits(PORTABLE, 32, 2, 64, sms_132) == 8 != rt.decode_splits(HOPPER, 32, 2, 64, sms_132)
