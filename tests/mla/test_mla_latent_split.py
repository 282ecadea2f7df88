"""The split-K latent write (k3c.codegen.kernels.mla.emit_mla_latent_partial + emit_mla_latent_reduce, launched by
k3c.runtime.kernel_impls.mla.write_latent for B*T <= LATENT_SPLIT_MAX_ROWS): against the eager reference in Triton's
interpreter (several column tiles with a partial last one, K splits with a masked last step, more than one row tile,
page boundaries crossed), bit-for-bit repeatable, the plan it picks for k3-wide on an H200, and (slow) both kernels
compiled for sm_90 and gfx950 without spills."""
from __future__ import annotations

import pytest
import torch

from k3c.codegen.kernels.mla import (LATENT_SPLIT_MAX_ROWS, emit_mla_latent_partial, emit_mla_latent_reduce,
                                     latent_split_plan)
from k3c.codegen.targets import get_target
from k3c.frontend.spec import MLASpec
from k3c import reference as ref
from k3c.runtime.kernel_impls import mla as rt

from mlautil import TOL, rel

D, L, R, PS = 72, 32, 8, 8          # D: 4.5 K steps of 16 (masked tail); L+R = 40: 2.5 column tiles of 16


def setup(B, T, start, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = MLASpec(num_heads=2, kv_lora_rank=L, qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=8)
    w = {"kv_a_proj_with_mqa.weight": (torch.randn(L + R, D, generator=gen) / D ** 0.5).to(dtype),
         "kv_a_layernorm.weight": (1 + 0.1 * torch.randn(L, generator=gen)).to(dtype)}
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    pages = -(-(max(start) + T) // PS)
    total = B * pages + 3
    bt = torch.randperm(total, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    pool = torch.randn(total, PS, L + R, generator=gen).to(dtype)
    return cfg, w, x, rt.LatentStore(pool, bt, [s + T for s in start])


def written(store, start, T):
    return [rt.PagedLatentCache(rt._SeqView(store, b), (s + T,)).gather(s, s + T)[0] for b, s in enumerate(start)]


def untouched(store, before, start, T) -> bool:
    mask = torch.ones(store.pool.shape[:2], dtype=torch.bool)
    for b, s in enumerate(start):
        pos = torch.arange(s, s + T)
        mask[store.block_table[b, pos // PS].long(), pos % PS] = False
    return torch.equal(store.pool[mask], before[mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,start", [(1, [7, 8, 23]), (3, [6, 15, 21])])
@pytest.mark.parametrize("splits", [None, 2, 5])
def test_split_write_matches_reference(dtype, T, start, splits):
    """B=3; T=3 rows run over page ends (6..8, 15..17); T=1 rows at a page's last / first slot; 1, 2 and 5 K
    splits (5 = every K step its own split, the last one masked)."""
    B = len(start)
    cfg, w, x, store = setup(B, T, start, dtype, seed=31 + T + (splits or 0))
    before = store.pool.clone()
    rt.write_latent(x, w["kv_a_proj_with_mqa.weight"], w["kv_a_layernorm.weight"], 1e-6, store, start, L,
                    split=True, splits=splits)
    want = ref.mla_latent(x, w, cfg)
    for b, got in enumerate(written(store, start, T)):
        assert rel(got, want[b]) <= TOL[dtype]
    assert untouched(store, before, start, T)


def test_split_equals_one_kernel_form_and_repeats_bitwise():
    """fp32: the split form agrees with the one-kernel form to rounding; 21 rows (two 16-row tiles of B*T); the
    default choice for B*T <= LATENT_SPLIT_MAX_ROWS is the split form, and it writes the same bits every time."""
    B, T, start = 3, 7, [0, 9, 12]
    _, w, x, store = setup(B, T, start, torch.float32, seed=5)
    args = (x, w["kv_a_proj_with_mqa.weight"], w["kv_a_layernorm.weight"], 1e-6)
    one = rt.LatentStore(store.pool.clone(), store.block_table, store.high)
    rt.write_latent(*args, one, start, L, split=False)
    rt.write_latent(*args, store, start, L)                      # auto: B*T = 21 <= LATENT_SPLIT_MAX_ROWS
    assert B * T <= LATENT_SPLIT_MAX_ROWS
    for a, b in zip(written(store, start, T), written(one, start, T)):
        assert rel(a, b) <= 1e-6
    first = store.pool.clone()
    store.pool.normal_()
    rt.write_latent(*args, store, start, L)
    again = written(store, start, T)
    for a, b in zip(written(rt.LatentStore(first, store.block_table, store.high), start, T), again):
        assert torch.equal(a, b)


def test_device_lens_decode_uses_split_form():
    """A device length tensor (the CUDA-graph decode form) goes through the same split kernels."""
    B, T, start = 2, 1, [15, 3]
    cfg, w, x, store = setup(B, T, start, torch.float32, seed=9)
    rt.write_latent(x, w["kv_a_proj_with_mqa.weight"], w["kv_a_layernorm.weight"], 1e-6, store,
                    rt.lens_tensor(start, "cpu"), L)
    want = ref.mla_latent(x, w, cfg)
    for b, got in enumerate(written(store, start, T)):
        assert rel(got, want[b]) <= 1e-5


@pytest.mark.parametrize("rows,min_progs", [(1, 200), (32, 200), (64, 120), (256, 100)])
def test_k3_wide_plan_on_h200(monkeypatch, rows, min_progs):
    """k3-wide (D=7168, L+R=576) on 132 SMs: >= 200 programs at decode B=1..32 (about one per SM past that,
    where the partials' cap binds), partials <= a quarter of the weight's bytes, every split a whole number of
    BLOCK_K steps."""
    monkeypatch.setattr(rt, "_sm_count", lambda kind, index: 132)
    h200 = get_target("h200")
    p = latent_split_plan(rows, 7168, 2, h200)
    S, k_split = rt.latent_splits(rows, 7168, 576, p.block_m, p.block_n, p.block_k, torch.device("cuda"))
    progs = -(-576 // p.block_n) * S * -(-rows // p.block_m)
    assert progs >= min_progs and k_split % p.block_k == 0 and S == -(-7168 // k_split)
    assert S * rows * 576 * 4 <= 7168 * 576 * 2 // 4
    assert p.block_m == (16 if rows <= 16 else 64)
    if rows == 1:
        assert (S, progs) == (28, 252)


@pytest.mark.slow
def test_split_kernels_compile_without_spills(tmp_path, monkeypatch):
    """Both new kernels at k3-wide's shape for sm_90 (h200) and gfx950 (mi355x): binaries, no scratch, no spills,
    shared memory inside the target's budget; the partial kernel's K loop is pipelined on sm_90 (more than one
    stage of tiles in shared memory)."""
    from k3c.codegen.aot import compile_kernels, shutdown_workers

    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "cache"))
    try:
        for tn in ("h200", "mi355x"):
            t = get_target(tn)
            ks = [emit_mla_latent_partial(7168, 576, target=t, dtype="bf16", rows_hint=m) for m in (1, 64)]
            ks.append(emit_mla_latent_reduce(512, 64, 1e-6, t.mla_page_size, target=t))
            out = compile_kernels(ks, t, str(tmp_path / tn), progress=False)
            for ck in out:
                r = ck.resources
                assert r.regs > 0 and not r.has_spills, (tn, ck.name, r)
                assert ck.shared <= t.shared_mem_bytes, (tn, ck.name, ck.shared)
            if tn == "h200":
                for ck, ks_ in zip(out[:2], ks[:2]):
                    c = ks_.constexprs
                    assert ck.shared >= 2 * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2, ck.name
    finally:
        shutdown_workers()
