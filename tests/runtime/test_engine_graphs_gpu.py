"""Engine decode through real CUDA graphs (cuda_graphs=True, no stand-in backend) on a GPU: the same tokens and
logits as the engine's ordinary decode while requests join and leave (fp32 k3-tiny, <= 1e-5; bf16 k3-wide-small,
<= 1e-2), every decode call after the first of a batch size replayed, every page returned."""
import pytest
import torch

import k3c
from k3c.runtime.devices import target_for
from k3c.runtime.engine import Engine
from test_engine_graphs import drive  # tests/runtime is on sys.path under pytest (no __init__.py)
from numerics import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def run(model, w, graphs: bool, prompts, news, joins):
    eng = Engine(model, w, device="cuda", max_batch=3, max_context=160, page_size=target_for("cuda").mla_page_size,
                 use_kernels=True, cuda_graphs=graphs)
    return drive(eng, prompts, news, joins, 60)


@pytest.mark.parametrize("spec_path,dtype,tol", [("examples/k3-tiny.yaml", torch.float32, 1e-5),
                                                 ("tests/bench/k3-wide-small.yaml", torch.bfloat16, 1e-2)])
def test_engine_graph_decode_equals_ordinary_decode_on_gpu(spec_path, dtype, tol):
    spec = k3c.load_spec(spec_path)
    model = k3c.compile(spec, target="h200")
    w = {k: v.cuda() for k, v in k3c.init_weights(spec, seed=0, dtype=dtype).items()}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (41, 67, 29)]
    news, joins = (12, 6, 9), {0: [0], 2: [1], 4: [2]}    # request 1 leaves while 0 and 2 still decode
    eng, with_graphs = run(model, w, True, prompts, news, joins)
    _, without = run(model, w, False, prompts, news, joins)
    assert eng.stats["decode_graph_calls"] > 0
    assert all(dg.report.mode == "graph" for dg in eng.graph_pool.graphs.values()), \
        [dg.report.reason for dg in eng.graph_pool.graphs.values()]
    assert len(eng.graph_pool.graphs) >= 2
    for a, b in zip(with_graphs, without):
        ta, tb = [o.token for o in a], [o.token for o in b]
        if dtype == torch.float32:
            assert ta == tb
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(tb))
        m = min(same + 1, len(a), len(b))     # output i's logits depend on tokens < i only: comparable up to here
        assert m >= 2 if dtype == torch.float32 else m >= 1
        assert rel(torch.stack([o.logits for o in a[:m]]), torch.stack([o.logits for o in b[:m]])) <= tol


def test_a_packed_step_launches_without_a_device_sync():
    """A packed call (decode rows beside a prompt chunk, kernels, bf16 k3-wide-small) launches without waiting on the
    device, so the host runs ahead of a long chunk: torch's sync debug mode turns any synchronizing op inside the
    call (a pageable copy, .item(), .tolist()) into an error naming it. The first call of the shapes runs outside the
    check (JIT compiles, first allocations)."""
    spec = k3c.load_spec("tests/bench/k3-wide-small.yaml")
    model = k3c.compile(spec, target="h200")
    w = {k: v.cuda() for k, v in k3c.init_weights(spec, seed=0, dtype=torch.bfloat16).items()}
    eng = Engine(model, w, device="cuda", max_batch=4, max_context=256, use_kernels=True, cuda_graphs=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (33, 47, 96, 96)]
    rids = [eng.open() for _ in prompts]
    eng.extend(rids[:2], [prompts[0], prompts[1]])          # two rows with context: they decode beside the chunk

    def packed_call(chunk):
        seqs = [eng.seqs[r] for r in rids]
        segs = [[7], [8], prompts[2][chunk], prompts[3][chunk][:5]]
        for seq, seg in zip(seqs, segs):
            seq.tokens.extend(seg)
        return eng.runner.run(list(zip(seqs, segs)), evict=True, all_positions=False)

    packed_call(slice(0, 48))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = packed_call(slice(48, 96))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eng.stats["mixed_calls"] == 2
    assert all(torch.isfinite(out[r]).all() for r in rids)
