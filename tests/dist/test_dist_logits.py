"""Sharded execution across processes (gloo, torch.multiprocessing spawn) gives the logits of one process.

One spawn of 2 ranks runs the three layouts of a 2-rank world in turn (TP 2, EP 2, TP 2 x EP 2 on the same 2 ranks;
TP with sequence parallel, and once without), each compiling its rank's slice, loading its slice of the weights,
then prefill (batch 2, length 7: split 4 + 3 with a padding token), decode (T = 1: not split) and append-prefill; a 4-rank spawn (TP 2 x EP 4: two attention replicas) is marked slow. Kernels off (the collectives
and the sharding are under test here; the kernels have their own tests).
Tolerances (relative): float64 1e-12 (the sharded math is the same math; measured 1.7e-14); fp32 1e-5, decode
4e-5: a TP split changes fp32 summation orders, and this random model's one-process fp32 decode logits are
themselves 1.9e-5 from its float64 ones (prefill 3.8e-6), so two fp32 orders can differ by up to twice that
(measured 1.6e-5 and 1.7e-5 for decode, 2.1e-6 prefill, 5.2e-6 append; EP alone is bit-exact in fp32).
"""
import os

import pytest
import torch

import k3c
from k3c.commands.ranks import run_ranks
from k3c.runtime.distributed import init_groups, shard_weights, state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "k3-tiny.yaml")


def _inputs():
    g = torch.Generator().manual_seed(11)
    return (torch.randint(0, 256, (2, 7), generator=g), torch.randint(0, 256, (2,), generator=g),
            torch.randint(0, 256, (2, 3), generator=g))


def _run(model, weights, device="cpu"):
    prompt, nxt, seg = _inputs()
    sess = model.session(weights, device=device, use_kernels=False)
    return [sess.prefill(prompt), sess.decode(nxt), sess.append(seg)]


def _weights(spec, dtype):
    return {k: v.to(dtype) for k, v in k3c.init_weights(spec, seed=0).items()}


def _rank(rank, device, layouts):
    """Every (tp, ep, dtype) on this rank: compile its slice, take its slice of the full init, run."""
    spec = k3c.load_spec(TINY)
    out = {}
    for layout in layouts:
        tp, ep, dtype = layout[:3]
        init_groups(tp, ep)                         # re-made per layout, on the same ranks
        model = k3c.compile(spec, target="cpu", tp=tp, ep=ep, rank=rank, seq_parallel=len(layout) < 4)
        before = state().calls
        # tiny model: slicing a full init is fine here (big models: init_sharded_weights / load_sharded_weights)
        logits = _run(model, shard_weights(model, _weights(spec, dtype)), device)
        out[layout] = ([t.numpy() for t in logits], state().calls - before)
    return out


@pytest.fixture(scope="module")
def single():
    before = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny ops: threads only contend (as in the ranks, one thread each)
    try:
        spec = k3c.load_spec(TINY)
        model = k3c.compile(spec, target="cpu")
        return {dt: _run(model, _weights(spec, dt)) for dt in (torch.float32, torch.float64)}
    finally:
        torch.set_num_threads(before)


def _check(results, single, layout):
    dtype = layout[2]
    for rank, res in enumerate(results):
        logits, calls = res[layout]
        assert calls > 0, f"rank {rank} of {layout} ran no collective"
        for got, want, what in zip(logits, single[dtype], ("prefill", "decode", "append")):
            got = torch.from_numpy(got)
            assert got.shape == want.shape and got.dtype == dtype
            err = float((got - want).norm() / want.norm())
            tol = 1e-12 if dtype == torch.float64 else (4e-5 if what == "decode" else 1e-5)
            assert err <= tol, f"TP x EP {layout}, rank {rank}, {what}: rel. error {err:.2e} > {tol}"


# (tp, ep, dtype[, "no-sp"]): with TP, sequence parallel is on unless "no-sp" (all-reduce after each row split)
LAYOUTS_2 = ((2, 1, torch.float32), (1, 2, torch.float32), (2, 2, torch.float32), (2, 2, torch.float64),
             (2, 2, torch.float32, "no-sp"))


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_rank, 2, 2, (LAYOUTS_2,), timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS_2, ids=["tp2", "ep2", "tp2xep2", "tp2xep2-f64", "tp2xep2-no-sp"])
def test_two_ranks_match_one_process(two_ranks, single, layout):
    _check(two_ranks, single, layout)


@pytest.mark.slow
def test_four_ranks_tp2_ep4(single):
    layout = (2, 4, torch.float32)
    _check(run_ranks(_rank, 2, 4, ((layout,),), timeout=300), single, layout)


def test_rank_failure_is_reported():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_ranks(_fail_on_rank_1, 1, 2, timeout=120)


def _fail_on_rank_1(rank, device):
    if rank == 1:
        raise ValueError("boom")
    return rank
