"""The capturable decode path of a sharded graph (k3c.runtime.cuda_graph.DecodeGraph) on 2 gloo ranks, through
the stand-in backend: per-rank static buffers (KDA state of this rank's heads), device lengths through the MLA
kernels (Triton interpreter) and the collectives inside the step equal the session's ordinary sharded decode.
On a GPU the same path is captured with its NCCL collectives (bench/dist.py --cuda-graphs)."""
import os

import pytest
import torch

import k3c
from k3c.commands.ranks import run_ranks
from k3c.runtime import cuda_graph
from k3c.runtime.cuda_graph import DecodeGraph, EagerBackend
from k3c.runtime.distributed import shard_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "k3-tiny.yaml")


def _rank(rank, device, tp, ep):
    torch.set_num_threads(1)
    cuda_graph.collectives_capturable = lambda dev: True      # gloo stands in for NCCL under the stand-in backend
    spec = k3c.load_spec(TINY)
    model = k3c.compile(spec, target="h200", tp=tp, ep=ep, rank=rank)
    sess = model.session(shard_weights(model, k3c.init_weights(spec, seed=0)), device=device, use_kernels=True)
    sess.prefill(torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)))
    dg = DecodeGraph.for_session(sess, capacity=40, buckets=[16], backend=EagerBackend(), page_size=8, strict=True)
    heads = {i: tuple(s.state.shape) for i, s in dg.kda.items()}
    nxt, errs = torch.tensor([3, 5]), []
    for _ in range(2):
        got = dg.step(nxt).clone()
        want = sess.decode(nxt)
        errs.append(float((got - want).norm() / want.norm()))
        nxt = want.argmax(-1)
    return errs, heads, dg.report.replays


@pytest.mark.slow
def test_sharded_decode_graph_equals_session_decode():
    spec = k3c.load_spec(TINY)
    for errs, heads, replays in run_ranks(_rank, 2, 2, (2, 2), device="cpu", timeout=900):
        assert max(errs) <= 1e-5 and replays == 2
        assert all(h[1] == spec.kda.num_heads // 2 for h in heads.values())    # this rank's heads only
