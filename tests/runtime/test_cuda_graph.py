"""CUDA-graph decode (k3c/runtime/cuda_graph.py) without a GPU: bucket choice, the static-audit of what blocks a
capture, the fallback (reported, and equal to the session's decode), and the static-buffer contract of a capture
through a stand-in backend (warm-ups change no state, each replay advances it exactly once, outputs stay in the
same buffers, buckets are captured on first use). The replay-vs-eager check on a GPU: test_cuda_graph_gpu.py."""
import warnings

import pytest
import torch

import k3c
from k3c.errors import ArgumentError
from k3c.runtime.cuda_graph import DecodeGraph, EagerBackend, capture_blockers, make_buckets, pick_bucket
from k3c.runtime.caches.latent_store import DeviceLenLatentCache, PagedLatentCache
from k3c.reference.kda import KDAState
from numerics import rel

TINY = "examples/k3-tiny.yaml"


TINY_TARGET = "h200"         # the conftest `tiny` fixture compiles for it


def test_buckets():
    assert make_buckets(100, 64, None) == [128]
    assert make_buckets(300, 64, [10, 64, 200, 5000]) == [64, 256, 320]
    assert pick_bucket([64, 256, 320], 1) == 64
    assert pick_bucket([64, 256, 320], 65) == 256
    assert pick_bucket([64, 256, 320], 320) == 320
    with pytest.raises(ArgumentError):
        pick_bucket([64, 256, 320], 321)


def test_capture_blockers(tiny):
    spec, model, _ = tiny
    assert capture_blockers(model.module, use_kernels=True, device="cuda") == []
    assert capture_blockers(model.module, use_kernels=True, device="cpu") == ["CUDA graphs need a CUDA device (got cpu)"]
    off = capture_blockers(model.module, use_kernels=False, device="cuda")
    assert any("torch_mla_absorbed" in b for b in off) and any("torch_route" in b for b in off)
    assert any("kernels are off" in b for b in off)
    plain = k3c.compile(spec, target="h200", passes=["attnres-split", "dce", "cse"])
    why = capture_blockers(plain.module, use_kernels=True, device="cuda")
    assert any("plain mla op" in b for b in why) and any("unlowered moe" in b for b in why)


def test_collectives_are_captured_only_over_nccl(tiny, monkeypatch):
    """A sharded graph's collectives block capture unless torch.distributed runs on NCCL (whose collectives are
    stream kernels a graph records; bench/dist.py replays sharded decode steps that way)."""
    from k3c.runtime import cuda_graph

    spec = tiny[0]
    sharded = k3c.compile(spec, target="h200", tp=2, ep=2, rank=0)
    why = capture_blockers(sharded.module, use_kernels=True, device="cuda")
    assert {w.split(":")[0] for w in why} >= {"collective all_reduce", "collective seq_scatter"}
    assert all(w.startswith("collective ") and "nccl" in w for w in why)
    monkeypatch.setattr(cuda_graph, "collectives_capturable", lambda device: device.type == "cuda")
    assert capture_blockers(sharded.module, use_kernels=True, device="cuda") == []
    assert capture_blockers(sharded.module, use_kernels=True, device="cpu") == [
        "CUDA graphs need a CUDA device (got cpu)"] + why


def test_fallback_is_reported_and_equals_session_decode(tiny, one_thread):
    spec, model, w = tiny
    sess = model.session(w, device="cpu", use_kernels=False)
    sess.prefill(torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ArgumentError, match="not capturable"):
        DecodeGraph.for_session(sess, capacity=32, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dg = DecodeGraph.for_session(sess, capacity=32)
    assert any("running eagerly" in str(c.message) for c in caught)
    assert dg.report.mode == "eager" and "CUDA" in dg.report.reason and "EAGER" in str(dg.report)
    nxt = torch.tensor([3, 5])
    for _ in range(4):
        got = dg.step(nxt).clone()
        want = sess.decode(nxt)
        assert rel(got, want) <= 1e-6
        nxt = want.argmax(-1)
    assert dg.report.eager_steps == 4 and dg.report.replays == 0 and dg.lens == [13, 13]
    snap = dg.snapshot()
    for i in dg.kda:
        assert torch.equal(snap.layers[i].state, sess.cache.layers[i].state)
    for i in dg.pools:
        assert torch.equal(snap.layers[i].gather(0, 13), sess.cache.layers[i].gather(0, 13))


def fake_graph(V=5):
    """A stand-in for the executor's graph with the ops' cache contract: KDA layers return new states, MLA layers
    write the token at each sequence's length and return the entry with lengths + 1 (device or host lengths)."""
    calls = {"n": 0}

    def graph(ids, cache):
        calls["n"] += 1
        B = ids.shape[0]
        acc = ids.float()                                          # [B, 1]
        for i, e in enumerate(cache.layers):
            if isinstance(e, KDAState):
                cache.layers[i] = KDAState(e.state + ids.float().view(B, 1, 1, 1),
                                           tuple(t + 1 for t in e.conv))
                acc = acc + cache.layers[i].state.mean(dim=(1, 2, 3))[:, None]
            elif isinstance(e, (DeviceLenLatentCache, PagedLatentCache)):
                st = e.store
                lens = e.lens.long() if isinstance(e, DeviceLenLatentCache) else torch.tensor(e.lens)
                page = st.block_table[torch.arange(B), lens // st.page_size].long()
                st.pool[page, lens % st.page_size] = ids.float().to(st.pool.dtype)
                acc = acc + lens[:, None].float() + st.pool.sum() * 1e-3
                cache.layers[i] = (DeviceLenLatentCache(st, e.lens + 1, e.max_len)
                                   if isinstance(e, DeviceLenLatentCache)
                                   else PagedLatentCache(st, tuple(n + 1 for n in e.lens)))
        return acc[:, :, None].expand(B, 1, V).contiguous()
    return graph, calls


def test_static_buffer_contract_with_stand_in_backend(tiny):
    spec, model, _ = tiny
    graph, calls = fake_graph()
    B = 2
    be = EagerBackend(warmups=2)
    dg = DecodeGraph(model, graph, batch=B, capacity=20, device="cpu", dtype=torch.float32, page_size=4,
                     buckets=[8], backend=be, strict=True)
    assert dg.buckets == [8, 20] and dg.report.mode == "graph"
    ref = DecodeGraph(model, graph, batch=B, capacity=20, device="cpu", dtype=torch.float32, page_size=4,
                      backend=be, strict=True)
    g = torch.Generator().manual_seed(0)
    kda = {i: KDAState(torch.randn_like(s.state, generator=None), tuple(torch.randn_like(t) for t in s.conv))
           for i, s in dg.kda.items()}
    lat = {i: torch.randn(B, 6, p.shape[-1], generator=g) for i, p in dg.pools.items()}
    for d in (dg, ref):
        d.load_state(kda, lat, [6, 4])
    before = {i: s.state.clone() for i, s in dg.kda.items()}
    dg.capture_all()                                # warm-ups + "captures" of both buckets: no state change
    assert be.captures == 2 and calls["n"] == 2 * (2 + 1)
    assert all(torch.equal(before[i], s.state) for i, s in dg.kda.items())
    assert dg.lens_dev.tolist() == [6, 4]
    outs = []
    for s in range(8):                              # lengths 6 -> 14: bucket 8 for 2 steps, then 20
        tok = torch.tensor([s, 10 + s])
        out = dg.step(tok)
        want = ref.eager_step(tok)
        assert torch.equal(out, want), s
        assert dg.lens_dev.tolist() == dg.lens == ref.lens
        outs.append(out)
    assert dg.report.replays == 8 and be.replays == 8 and dg.report.eager_steps == 0
    assert outs[0].data_ptr() == outs[1].data_ptr() != outs[2].data_ptr() == outs[7].data_ptr()  # static outputs
    for i in dg.kda:
        assert torch.equal(dg.kda[i].state, ref.kda[i].state)
        assert all(torch.equal(a, b) for a, b in zip(dg.kda[i].conv, ref.kda[i].conv))
    for i in dg.pools:
        assert torch.equal(dg.pools[i], ref.pools[i])
    with pytest.raises(ArgumentError, match="capacity"):
        for _ in range(20):
            dg.step(torch.tensor([1, 2]))


def test_capture_failure_falls_back(tiny):
    spec, model, _ = tiny
    graph, _ = fake_graph()

    class Broken(EagerBackend):
        def capture(self, warm, body):
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.warns(RuntimeWarning, match="capture of the 8-token bucket failed"):
        dg = DecodeGraph(model, graph, batch=1, capacity=8, device="cpu", dtype=torch.float32, page_size=4,
                         backend=Broken())
        out = dg.step(torch.tensor([3]))
    assert dg.report.mode == "eager" and "not permitted" in dg.report.reason and dg.report.eager_steps == 1
    assert out.shape == (1, 5) and dg.lens == [1]


@pytest.mark.slow
def test_device_length_kernel_path_equals_session_decode(tiny, one_thread):
    """The capturable path itself (DeviceLenLatentCache through the MLA kernels, in the Triton interpreter) run by
    the stand-in backend equals the session's ordinary decode."""
    spec, model, w = tiny
    sess = model.session(w, device="cpu", use_kernels=True)
    sess.prefill(torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)))
    dg = DecodeGraph.for_session(sess, capacity=40, buckets=[16], backend=EagerBackend(), page_size=8, strict=True)
    nxt = torch.tensor([3, 5])
    for _ in range(2):
        got = dg.step(nxt).clone()
        want = sess.decode(nxt)
        assert rel(got, want) <= 1e-5
        nxt = want.argmax(-1)
    assert dg.report.replays == 2 and list(dg.report.captured) == [16]


def test_external_pools_and_block_table(tiny):
    """A serving pool (Engine.pool.pools) instead of own pools: rows land in the pages the block table names."""
    spec, model, _ = tiny
    graph, _ = fake_graph()
    mla = [i for i, k in enumerate(spec.layer_kinds) if k == "mla"]
    width = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    pools = {i: torch.zeros(10, 4, width) for i in mla}
    dg = DecodeGraph(model, graph, batch=2, capacity=8, device="cpu", dtype=torch.float32, backend=EagerBackend(),
                     strict=True, pools=pools)
    assert dg.page_size == 4 and dg.pools[mla[0]] is pools[mla[0]]
    dg.set_block_table(torch.tensor([[7, 2], [5, 9]], dtype=torch.int32))
    dg.set_lengths([3, 4])
    dg.step(torch.tensor([11, 22]))
    dg.step(torch.tensor([12, 23]))
    p = pools[mla[0]][:, :, 0]
    assert p[7, 3] == 11 and p[2, 0] == 12 and p[9, 0] == 22 and p[9, 1] == 23
    with pytest.raises(ArgumentError):
        dg.set_block_table(torch.zeros(2, 3, dtype=torch.int32))
