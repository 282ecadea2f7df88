"""CUDA-graph decode on a GPU: replayed logits equal the eager executor's step over several steps, across a bucket
boundary, at batch 1 and 3; the KDA states and MLA rows the replays leave equal the eager path's."""
import pytest
import torch

import k3c
from k3c.runtime.cuda_graph import DecodeGraph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def tiny():
    spec = k3c.load_spec("examples/k3-tiny.yaml")
    model = k3c.compile(spec, target="h200")
    return spec, model, k3c.init_weights(spec, seed=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_replay_equals_eager_session_decode(tiny, batch):
    spec, model, w = tiny
    sess = model.session(w, device="cuda")
    g = torch.Generator().manual_seed(batch)
    sess.prefill(torch.randint(0, spec.vocab_size, (batch, 59), generator=g))
    # page 64 on the H200: buckets of 64 and 128 tokens; steps 60..67 cross from the first into the second
    dg = DecodeGraph.for_session(sess, capacity=128, buckets=[64], strict=True)
    nxt = torch.randint(0, spec.vocab_size, (batch,), generator=g).cuda()
    for _ in range(8):
        got = dg.step(nxt).clone()
        want = sess.decode(nxt)
        assert rel(got, want) <= 1e-5
        nxt = want.argmax(-1)
    assert dg.report.mode == "graph" and dg.report.replays == 8 and sorted(dg.report.captured) == [64, 128]
    snap = dg.snapshot()
    for i, st in enumerate(sess.cache.layers):
        if i in dg.kda:
            assert rel(snap.layers[i].state, st.state) <= 1e-5
        else:
            n = sess.cache.length
            assert rel(snap.layers[i].gather(0, n), st.gather(0, n)) <= 1e-6


def test_replay_equals_eager_path_bf16_small_wide():
    """k3-wide-small in bf16 (MXFP4 experts, 16 experts top-4): graph replays vs the eager path on the same
    buffers, from the same random state."""
    spec = k3c.load_spec("tests/bench/k3-wide-small.yaml")
    model = k3c.compile(spec, target="h200")
    w = {k: (v.to(torch.bfloat16) if v.is_floating_point() and v.dtype == torch.float32 else v)
         for k, v in k3c.init_weights(spec, seed=0).items()}
    sess = model.session(w, device="cuda")
    B = 4
    dg = DecodeGraph(model, sess.graph, batch=B, capacity=256, device="cuda", strict=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    from k3c.runtime.reference.kda import KDAState
    kda = {i: KDAState(0.05 * torch.randn_like(st.state), tuple(torch.randn_like(t) for t in st.conv))
           for i, st in dg.kda.items()}
    lat = {i: torch.randn(B, 200, p.shape[-1], generator=g, device="cuda").to(torch.bfloat16)
           for i, p in dg.pools.items()}
    toks = torch.randint(0, spec.vocab_size, (6, B), generator=g, device="cuda")
    outs = {}
    for name, fn in (("eager", dg.eager_step), ("graph", dg.step)):
        dg.load_state(kda, lat, [200, 150, 120, 199])       # mixed lengths
        outs[name] = torch.stack([fn(t).float().clone() for t in toks])
    assert dg.report.mode == "graph" and dg.report.replays == 6
    for s in range(6):
        assert rel(outs["graph"][s], outs["eager"][s]) <= 2e-2, s
    assert (outs["graph"].argmax(-1) == outs["eager"].argmax(-1)).float().mean() >= 0.9
