"""MLA kernels (k3c.codegen.kernels.mla through k3c.runtime.kernel_impls.mla) against the eager reference, in Triton's
interpreter: paged latent write with fused RMSNorm, MQA split-KV decode (mixed lengths, page boundaries, query length
> 1 with causal masking, forced splits), the chunked MHA prefill step, and the whole absorbed sublayer in both modes
== the reference mla_layer over prefill, append and decode. Metric ||out - ref|| / ||ref||: fp32 <= 1e-5,
bf16 <= 1e-2."""
from __future__ import annotations

import pytest
import torch

from k3c.codegen.targets import get_target
from k3c.frontend.spec import MLASpec
from k3c import reference as ref
from k3c.runtime.executor import LayerCaches
from k3c.runtime.kernel_impls import mla as rt

from mlautil import TOL, layer_setup, rel

CPU = get_target("cpu")


def paged(B, lens, W, ps, dtype, gen, extra=3):
    """A shuffled page pool full of random values (unused slots too) and its block table."""
    pages = -(-max(lens) // ps)
    total = B * pages + extra
    bt = torch.randperm(total, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    pool = torch.randn(total, ps, W, generator=gen).to(dtype)
    return rt.LatentStore(pool, bt, list(lens))


def mqa_oracle(q, store, lens, L, N, scale):
    """o_lat [B, ROWS, L] in float64: causal softmax over each sequence's latent rows."""
    B, ROWS, W = q.shape
    tq = ROWS // N
    out = torch.zeros(B, ROWS, L, dtype=torch.float64)
    for b in range(B):
        n = lens[b]
        lat = rt.PagedLatentCache(rt._SeqView(store, b), (n,)).gather().double()[0]      # [n, W]
        s = (q[b].double() @ lat.T) * scale                                                  # [ROWS, n]
        qpos = n - tq + torch.arange(ROWS) // N
        s = s.masked_fill(torch.arange(n)[None, :] > qpos[:, None], float("-inf"))
        out[b] = torch.softmax(s, -1) @ lat[:, :L]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tq,splits", [(1, None), (1, 3), (3, 2)])
def test_decode_paged_mixed_lengths(dtype, tq, splits):
    gen = torch.Generator().manual_seed(7 + tq)
    B, N, L, R, ps = 3, 3, 32, 8, 16
    lens = [5, 37, 70]                  # inside one page, across pages, past 4 pages; include the new tokens
    store = paged(B, lens, L + R, ps, dtype, gen)
    q = torch.randn(B, tq * N, L + R, generator=gen).to(dtype)
    scale = (24) ** -0.5
    out = rt.mqa_decode(q, store, rt.lens_tensor(lens, "cpu"), scale, L, num_heads=N, splits=splits,
                        out_dtype=torch.float32)
    want = mqa_oracle(q, store, lens, L, N, scale)
    assert rel(out, want) <= TOL[dtype]


@pytest.mark.parametrize("block_n", [None, 4])
def test_decode_head_tiles_and_empty_splits(block_n):
    """More rows than one head tile (two tiles), more splits than a short sequence has pages (empty splits
    must merge to nothing), and (block_n) pages stepped through a few keys at a time (the 64-lane targets' plan)."""
    gen = torch.Generator().manual_seed(3)
    B, N, L, R, ps = 2, 20, 16, 8, 8
    lens = [3, 50]
    store = paged(B, lens, L + R, ps, torch.float32, gen)
    q = torch.randn(B, N, L + R, generator=gen)
    plan = rt.decode_plan(N, L, CPU, block_h=16, block_n=block_n)
    out = rt.mqa_decode(q, store, rt.lens_tensor(lens, "cpu"), 0.2, L, num_heads=N, splits=7, plan=plan)
    assert rel(out, mqa_oracle(q, store, lens, L, N, 0.2)) <= 1e-5


@pytest.mark.parametrize("plan", [rt.DecodePlan(32, 4, 2, 16), rt.DecodePlan(64, 8, 2, 32, True),
                                  rt.DecodePlan(16, 4, 2, 16, True, lazy=True)],
                         ids=["h32_w4_s2_n16", "h64_w8_s2_n32_kq", "h16_w4_s2_n16_kq_lazy"])
@pytest.mark.parametrize("tq", [1, 3])
def test_decode_sm90_plans(plan, tq):
    """The sm_90 plans (16-32 keys a step, scores as K q^T, lazy rescaling): full pages take the unmasked loop, the last page and
    the causal band of a 3-token query the masked one; lengths on, before and after page boundaries."""
    gen = torch.Generator().manual_seed(17 + tq)
    B, N, L, R, ps = 3, 5, 32, 8, 32
    lens = [32, 70, 131]
    store = paged(B, lens, L + R, ps, torch.float32, gen)
    q = torch.randn(B, tq * N, L + R, generator=gen)
    for splits in (None, 2):
        out = rt.mqa_decode(q, store, rt.lens_tensor(lens, "cpu"), 0.3, L, num_heads=N, splits=splits, plan=plan)
        assert rel(out, mqa_oracle(q, store, lens, L, N, 0.3)) <= 1e-5


def test_decode_many_splits_column_merge():
    """More splits than the merge reads at once (40 > BLOCK_S), and few rows: the merge splits each row's
    columns over several programs."""
    gen = torch.Generator().manual_seed(23)
    N, L, R, ps = 2, 128, 8, 4
    lens = [157]
    store = paged(1, lens, L + R, ps, torch.float32, gen)
    q = torch.randn(1, N, L + R, generator=gen)
    out = rt.mqa_decode(q, store, rt.lens_tensor(lens, "cpu"), 0.1, L, num_heads=N, splits=40)
    assert rel(out, mqa_oracle(q, store, lens, L, N, 0.1)) <= 1e-5
    ks_merge = rt._decode_setup(1, N, L + R, L, ps, torch.float32, torch.float32, torch.float32, None, 40, 40, 0.1, CPU,
                                torch.device("cpu"), True)[3]
    assert ks_merge.constexprs["BLOCK_D"] < L and 40 > ks_merge.constexprs["BLOCK_S"]


@pytest.mark.parametrize("split", [False, None], ids=["one_kernel", "auto_split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_write_fused_rmsnorm_paged(dtype, split):
    gen = torch.Generator().manual_seed(11)
    B, T, D, L, R, ps = 2, 11, 40, 32, 8, 8
    cfg = MLASpec(num_heads=2, kv_lora_rank=L, qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=8)
    w = {"kv_a_proj_with_mqa.weight": (torch.randn(L + R, D, generator=gen) / D ** 0.5).to(dtype),
         "kv_a_layernorm.weight": (1 + 0.1 * torch.randn(L, generator=gen)).to(dtype)}
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    start = [5, 13]                     # both writes cross page boundaries, at different offsets
    store = paged(B, [s + T for s in start], L + R, ps, dtype, gen)
    before = store.pool.clone()
    rt.write_latent(x, w["kv_a_proj_with_mqa.weight"], w["kv_a_layernorm.weight"], 1e-6, store, start, L,
                    split=split)
    want = ref.mla_latent(x, w, cfg)
    for b in range(B):
        got = rt.PagedLatentCache(rt._SeqView(store, b), (start[b] + T,)).gather(start[b], start[b] + T)[0]
        assert rel(got, want[b]) <= TOL[dtype]
    # nothing else in the pool changed
    mask = torch.ones(store.pool.shape[:2], dtype=torch.bool)
    for b in range(B):
        pos = torch.arange(start[b], start[b] + T)
        mask[store.block_table[b, pos // ps].long(), pos % ps] = False
    assert torch.equal(store.pool[mask], before[mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached,new,chunk,splits", [(0, 19, 7, 1), (23, 5, 8, None), (30, 9, 40, 3)])
def test_mha_chunked_prefill(dtype, cached, new, chunk, splits):
    gen = torch.Generator().manual_seed(cached + new)
    B, N, P, R, V, L = 2, 2, 16, 8, 16, 32
    cfg = MLASpec(num_heads=N, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V)
    total = cached + new
    store = paged(B, [total] * B, L + R, 8, dtype, gen)
    entry = rt.PagedLatentCache(store, (total,) * B)
    w_kvb = (torch.randn(N * (P + V), L, generator=gen) / L ** 0.5).to(dtype)
    uk, uv = rt.split_kvb(w_kvb, N, P, V, "uk_t"), rt.split_kvb(w_kvb, N, P, V, "uv")
    q = torch.randn(B, new, N, P + R, generator=gen).to(dtype)
    o = rt.mha_attention(q, entry, uk, uv, (P + R) ** -0.5, chunk, key_splits=splits)
    want = ref.mla_attention(q.double(), entry.gather().double(), {"kv_b_proj.weight": w_kvb.double()}, cfg, "mha")
    assert rel(o, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sublayer_modes_equal_reference(dtype):
    """prefill 13 -> append 6 -> decode 1 -> 2 speculative tokens, page size 8 (boundaries, pool growth), batch 2:
    MQA == MHA == auto == reference mla_layer, through the kernels and through the reference implementation."""
    cfg, w, wa, attrs, gen = layer_setup(dtype)
    B, D = 2, 48
    steps = [13, 6, 1, 2]
    xs = [torch.randn(B, t, D, generator=gen).to(dtype) for t in steps]
    want, cache = [], None
    for x in xs:
        y, cache = ref.mla_layer(x, w, cfg, cache)
        want.append(y)
    for impl in (rt.launch_mla_absorbed, rt.torch_mla_absorbed):
        for mode in ("mqa", "mha", "auto") if impl is rt.launch_mla_absorbed else ("mqa", "mha"):
            a = {**attrs, "mode": mode}
            lc = LayerCaches(1)
            lc.layers[0] = rt.PagedLatentCache(rt.new_store(B, 1, 40, 8, dtype, "cpu"), (0, 0))
            for x, y_ref in zip(xs, want):
                y = impl(a, lc, (x,), wa)
                assert rel(y, y_ref) <= TOL[dtype], (impl.__name__, mode, x.shape)


def test_snapshot_copy_on_write():
    """Two continuations of the same cache snapshot (what Session's failure copy allows) do not see each other."""
    cfg, w, wa, attrs, gen = layer_setup(torch.float32, seed=5)
    x0, xa, xb = (torch.randn(1, t, 48, generator=gen) for t in (9, 1, 1))
    lc = LayerCaches(1)
    rt.launch_mla_absorbed(attrs, lc, (x0,), wa)
    snap = lc.copy()
    ya = rt.launch_mla_absorbed(attrs, lc, (xa,), wa)
    yb = rt.launch_mla_absorbed(attrs, snap, (xb,), wa)
    _, c0 = ref.mla_layer(x0, w, cfg)
    assert rel(ya, ref.mla_layer(xa, w, cfg, c0)[0]) <= 1e-5
    assert rel(yb, ref.mla_layer(xb, w, cfg, c0)[0]) <= 1e-5
    assert lc.layers[0].store is not snap.layers[0].store
