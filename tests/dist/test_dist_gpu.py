"""Sharded decode through real CUDA graphs with the NCCL collectives captured (2 GPUs, one process each): every
rank's replayed steps equal its session's ordinary decode (fp32 k3-tiny, TP 2 x EP 2 and TP 2 x EP 1). Needs two
CUDA GPUs (the lent nvidia-h200-x2); skipped elsewhere."""
import os

import pytest
import torch

import k3c
from k3c.commands.ranks import run_ranks
from k3c.runtime.cuda_graph import DecodeGraph
from k3c.runtime.distributed import shard_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "k3-tiny.yaml")


def _rank(rank, device, tp, ep):
    spec = k3c.load_spec(TINY)
    model = k3c.compile(spec, target="h200", tp=tp, ep=ep, rank=rank)
    w = {k: v.to(device) for k, v in shard_weights(model, k3c.init_weights(spec, seed=0)).items()}
    sess = model.session(w, device=device, use_kernels=True)
    sess.prefill(torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)))
    dg = DecodeGraph.for_session(sess, capacity=64, strict=True)
    nxt, errs = torch.tensor([3, 5]), []
    for _ in range(3):
        got = dg.step(nxt).clone()
        want = sess.decode(nxt)
        errs.append(float((got - want).norm() / want.norm()))
        nxt = want.argmax(-1).cpu()
    return errs, dg.report.mode, dg.report.replays


@pytest.mark.parametrize("tp, ep", [(2, 2), (2, 1)])
def test_sharded_decode_graph_on_two_gpus(tp, ep):
    for errs, mode, replays in run_ranks(_rank, tp, ep, (tp, ep), device="cuda", timeout=600):
        assert mode == "graph" and replays == 3
        assert max(errs) <= 1e-5, errs
