"""The fp8 MLA latent cache (e4m3 codes, per-token fp32 scales per part; codegen/kernels/mla_common.py's module doc):
the row format against torch's own e4m3 cast, the latent-write kernels (both forms) writing what the torch encoder
writes, the MQA decode and the chunked MHA prefill reading it, and the runtime paths that hold it (Session, Engine's
page pool, its prefix cache with a host tier, its decode graphs) against the bf16 cache and the torch reference."""
import pytest
import torch

import k3c
from k3c.errors import ArgumentError
from k3c.runtime.cuda_graph import EagerBackend
from k3c.runtime.engine import Engine
from k3c.runtime.kernel_impls import mla as rt
from k3c.runtime.caches.latent_format import KVFormat, decode_rows, encode_rows, kv_format, row_width
from k3c.runtime.prefix_cache import PrefixCache
from numerics import rel

FP8 = torch.float8_e4m3fn
TINY = "examples/k3-tiny.yaml"


def test_row_format_is_codes_then_scales_and_rounds_like_torch():
    g = torch.Generator().manual_seed(0)
    L, R = 32, 8
    rows = torch.randn(5, L + R, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 1.0])[:, None]
    rows[4, :L] = rows[4, :L].clamp(-0.9, 0.9)
    rows[4, 0] = 1.0                                               # row 4's latent amax is 1 ...
    rows[4, 1] = 127.8 / 448                                       # ... so this code is 127.8: rounds up to 128
    packed = encode_rows(rows, L, FP8)
    assert packed.dtype == FP8 and packed.shape == (5, row_width(L, R, FP8)) == (5, 48)
    raw = packed.view(torch.uint8)
    scales = raw[:, -8:].contiguous().view(torch.float32)
    for part, (lo, hi) in enumerate(((0, L), (L, L + R))):
        amax = rows[:, lo:hi].abs().amax(-1)
        want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        assert torch.equal(scales[:, part], want)
        codes = (rows[:, lo:hi] / want[:, None]).to(FP8)                 # torch's cast: the outside rule
        assert torch.equal(raw[:, lo:hi], codes.view(torch.uint8))
    assert packed[4, 1].float().item() == 128.0
    assert (packed[3, :L + R].float() == 0).all() and (scales[3] == 1).all()      # all-zero row: scale 1, codes 0
    back = decode_rows(packed, L, R, torch.float32)
    sc = torch.repeat_interleave(scales, torch.tensor([L, R]), dim=1)
    assert ((back - rows).abs() <= rows.abs() * 2 ** -4 + sc * 2 ** -10).all()      # half an e4m3 step
    assert torch.equal(decode_rows(encode_rows(rows, L, torch.bfloat16), L, R, torch.float32),
                       rows.bfloat16().float())


def test_fp8_needs_half_precision_activations():
    with pytest.raises(ArgumentError, match="fp8"):
        kv_format("fp8").pool_dtype(torch.float32)
    with pytest.raises(ArgumentError, match="--kv-dtype must be one of"):
        kv_format("int8", "--kv-dtype")
    with pytest.raises(ArgumentError, match="kv_dtype must be one of"):
        kv_format(torch.float8_e4m3fn)                  # a torch dtype is not a kv_dtype name
    fmt = kv_format("fp8")
    assert kv_format(fmt) is fmt and isinstance(fmt, KVFormat) and str(fmt) == "fp8"   # decoded once, passed on
    assert fmt.pool_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert kv_format("auto").pool_dtype(torch.float16) == torch.float16


def latent_ref(x, w, nw, L, eps):
    kv = x.float() @ w.float().T
    c = kv[..., :L] * torch.rsqrt(kv[..., :L].pow(2).mean(-1, keepdim=True) + eps) * nw.float()
    return torch.cat([c, kv[..., L:]], -1)


@pytest.mark.parametrize("split", [False, True])
def test_latent_write_stores_the_encoders_rows(split):
    """Both write forms against encode_rows of the fp32 reference rows (the kernels' GEMM order may move a value
    across a rounding boundary: allow a few codes one step off)."""
    g = torch.Generator().manual_seed(1)
    B, T, D, L, R, PS = 2, 21 if not split else 3, 64, 32, 16, 8
    x = torch.randn(B, T, D, generator=g).bfloat16()
    w = (torch.randn(L + R, D, generator=g) * 0.2).bfloat16()
    nw = (torch.rand(L, generator=g) + 0.5).bfloat16()
    store = rt.new_store(B, 5 + T, row_width(L, R, FP8), PS, FP8, "cpu")
    rt.write_latent(x, w, nw, 1e-6, store, [5, 5], L, split=split)
    got = rt.PagedLatentCache(store, (5 + T,) * B).gather(5)
    want = encode_rows(latent_ref(x, w, nw, L, 1e-6), L, FP8)
    same = (got[..., :L + R].view(torch.uint8) == want[..., :L + R].view(torch.uint8)).float().mean().item()
    assert same >= 0.98
    ref = latent_ref(x, w, nw, L, 1e-6)
    assert rel(decode_rows(got, L, R, torch.float32), decode_rows(want, L, R, torch.float32)) <= 1e-2
    assert rel(decode_rows(got, L, R, torch.float32), ref) <= 4e-2                  # e4m3: ~2-3% rms


@pytest.mark.parametrize("tq", [1, 3])
def test_decode_reads_the_fp8_rows(tq):
    """MQA decode over an fp8 pool (a partial last page; tq > 1: the causal band of the masked tail) against
    attention over the decoded values, and bounded against the bf16 pool of the same values."""
    g = torch.Generator().manual_seed(2)
    B, H, L, R, PS = 2, 4, 64, 16, 16
    lens = [45, 70]
    vals = torch.randn(B, max(lens), L + R, generator=g)
    stores = {}
    for dt in (torch.bfloat16, FP8):
        st = rt.new_store(B, max(lens), row_width(L, R, dt), PS, dt, "cpu")
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            st.pool[st.block_table[b, pos // PS].long(), pos % PS] = encode_rows(vals[b, :n], L, dt)
        stores[dt] = st
    q = torch.randn(B, tq * H, L + R, generator=g).bfloat16()
    lt = rt.lens_tensor(lens, "cpu")
    outs = {dt: rt.mqa_decode(q, st, lt, 0.125, L, num_heads=H, max_len=max(lens)).float()
            for dt, st in stores.items()}
    for b, n in enumerate(lens):
        lat = decode_rows(rt.PagedLatentCache(stores[FP8], tuple(lens)).gather(0, n, seq=b)[0], L, R, torch.float32)
        s = (q[b].float() @ lat.T) * 0.125
        qpos = n - tq + torch.arange(tq * H) // H
        s = s.masked_fill(torch.arange(n)[None, :] > qpos[:, None], float("-inf"))
        want = s.softmax(-1) @ lat[:, :L]
        assert rel(outs[FP8][b], want) <= 1e-2
    assert rel(outs[FP8], outs[torch.bfloat16]) <= 5e-2


def test_mha_prefill_reads_the_fp8_rows():
    g = torch.Generator().manual_seed(3)
    B, T, N, P, R, L, V, PS = 1, 6, 2, 16, 8, 32, 16, 8
    cached = 13
    vals = torch.randn(B, cached + T, L + R, generator=g)
    q = torch.randn(B, T, N, P + R, generator=g).bfloat16()
    wk = torch.randn(N, P, L, generator=g).bfloat16() * 0.3
    wv = torch.randn(N, L, V, generator=g).bfloat16() * 0.3
    outs = {}
    for dt in (torch.bfloat16, FP8):
        st = rt.new_store(B, cached + T, row_width(L, R, dt), PS, dt, "cpu")
        pos = torch.arange(cached + T)
        st.pool[st.block_table[0, pos // PS].long(), pos % PS] = encode_rows(vals[0], L, dt)
        entry = rt.PagedLatentCache(st, (cached + T,))
        outs[dt] = rt.mha_attention(q, entry, wk, wv, (P + R) ** -0.5, 8)
        lat = decode_rows(entry.gather(), L, R, torch.float32)[0]
        k = torch.einsum("kl,npl->knp", lat[:, :L], wk.float())
        v = torch.einsum("kl,nlv->knv", lat[:, :L], wv.float())
        s = (torch.einsum("tnp,knp->ntk", q[0, ..., :P].float(), k)
             + torch.einsum("tnr,kr->ntk", q[0, ..., P:].float(), lat[:, L:])) * (P + R) ** -0.5
        s = s.masked_fill(torch.arange(cached + T)[None, None, :] > cached + torch.arange(T)[None, :, None],
                          float("-inf"))
        want = torch.einsum("ntk,knv->tnv", s.softmax(-1), v)
        assert rel(outs[dt][0], want) <= 1e-2
    assert rel(outs[FP8], outs[torch.bfloat16]) <= 5e-2


@pytest.fixture(scope="module")
def tiny_bf16():
    spec = k3c.load_spec(TINY)
    return spec, k3c.compile(spec, target="h200"), k3c.init_weights(spec, seed=0, dtype=torch.bfloat16)


def test_session_fp8_cache_kernels_write_what_the_torch_path_writes(tiny_bf16, one_thread):
    """Session(kv_dtype="fp8") on the (random, bf16-chaotic) tiny model: after prefill + append + decode every MLA
    store is fp8, and the kernels' rows decode to the torch path's rows of the same calls (the whole-model numerics
    of the fp8 cache are tested on the trained model: tests/numerics, path fp8-kv)."""
    spec, model, w = tiny_bf16
    ids = torch.randint(0, spec.vocab_size, (2, 19), generator=torch.Generator().manual_seed(4))
    rows = {}
    for kernels in (True, False):
        s = model.session(w, kv_dtype="fp8", use_kernels=kernels)
        s.prefill(ids[:, :1])                 # the first layer's first rows see the same inputs on both paths
        entries = [e for e in s.cache.layers if isinstance(e, rt.PagedLatentCache)]
        assert entries and all(e.store.pool.dtype == FP8 for e in entries)
        rows[kernels] = decode_rows(entries[0].gather(), 32, 8, torch.float32)
        s.append(ids[:, 1:6])
        s.decode(ids[:, 0])
        assert all(e.store.pool.dtype == FP8 for e in s.cache.layers if isinstance(e, rt.PagedLatentCache))
    assert rel(rows[True], rows[False]) <= 6e-2      # 3.1e-2: the inputs differ by the KDA layers' bf16 rounding
    with pytest.raises(ArgumentError, match="kv_dtype"):
        model.session(w, kv_dtype="e4m3")


@pytest.fixture(scope="module")
def trained_bf16():
    """The trained example model in bf16 (not chaotic: a bf16-sized change of the computation keeps its greedy
    tokens, which the random tiny model's does not)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "numerics"))
    from trained_checks import EXAMPLE, checkpoint, needs_example, trained  # noqa: F401

    if not (EXAMPLE / "model.safetensors").exists():
        pytest.skip("the trained example model is not in this checkout")
    spec, w = checkpoint()
    return spec, k3c.compile(spec, target="h200"), trained._in_dtype(spec, w, torch.bfloat16, torch.device("cpu"))


def test_engine_fp8_pool_and_prefix_cache(trained_bf16, one_thread):
    """Engine(kv_dtype="fp8"), torch ops: the page pool holds fp8 rows; a request resumed from a host-tier
    checkpoint (fp8 rows copied out to host memory and back) gives the plain fp8 engine's tokens and logits; every
    page comes back."""
    spec, model, w = trained_bf16
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, spec.vocab_size, (40,), generator=g).tolist()
    prompts = [base + torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (4, 7)]
    L, R = spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim

    def serve(**kw):
        eng = Engine(model, w, device="cpu", max_batch=2, max_context=64, page_size=8, kv_dtype="fp8",
                     use_kernels=False, **kw)
        outs = []
        for p in prompts:                 # one after the other: the second may resume from the first's checkpoint
            rid = eng.add_request(p, 5)
            while eng.has_work():
                outs += [o for o in eng.step() if o.rid == rid]
        assert all(pool.dtype == FP8 and pool.shape[-1] == row_width(L, R, FP8) for pool in eng.pool.pools.values())
        if eng.prefix is not None:
            eng.prefix.clear()
        eng.pool.check_empty()
        return eng, outs

    _, plain = serve()
    eng, resumed = serve(prefix_cache=PrefixCache(interval=16, host_bytes=1 << 24, max_bytes=1))
    assert eng.prefix.stats["offloaded_host"] > 0 and eng.prefix.stats["hits"] > 0
    assert [o.token for o in resumed] == [o.token for o in plain]
    assert rel(torch.stack([o.logits for o in resumed]).float(), torch.stack([o.logits for o in plain]).float()) \
        <= 2e-2


@pytest.mark.slow
def test_engine_fp8_decode_graph_equals_eager_decode(tiny_bf16, one_thread):
    """The decode graph (stand-in capture backend, kernels in the interpreter) over the engine's fp8 page pool: the
    device-length MQA path reads the same rows as the eager decode, so tokens and logits are the same (~40 s)."""
    spec, model, w = tiny_bf16
    prompt = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    runs = []
    for graphs in (False, True):
        eng = Engine(model, w, device="cpu", max_batch=1, max_context=24, page_size=8, kv_dtype="fp8",
                     cuda_graphs=graphs, graph_backend=EagerBackend() if graphs else None)
        rid = eng.add_request(prompt, 4)
        outs = []
        while eng.has_work():
            outs += [o for o in eng.step() if o.rid == rid]
        assert (eng.stats["decode_graph_calls"] > 0) == graphs
        eng.pool.check_empty()
        runs.append(outs)
    assert [o.token for o in runs[0]] == [o.token for o in runs[1]]
    assert rel(torch.stack([o.logits for o in runs[1]]).float(), torch.stack([o.logits for o in runs[0]]).float()) \
        <= 1e-3
