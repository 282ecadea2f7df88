"""Routing replay (k3c.runtime.routing_replay): a recorded run's expert choices, replayed in a perturbed run, are
taken by all three routers (kernel, executor torch op, reference) with this run's own weights at those experts. The
runtime's routers ask the active replay; the reference takes its `choose` as an argument (choose_experts)."""
from __future__ import annotations

import pytest
import torch

from k3c.frontend.spec import MoESpec
from k3c import reference as ref
from k3c.runtime.kernel_impls import moe as M
from k3c.runtime.routing_replay import RoutingReplay, load_routes, routed_weights


def _logits(n, e, seed):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(n, e, generator=g)
    return lg, lg + 0.3 * torch.randn(n, e, generator=g)       # a perturbation that flips some choices


@pytest.mark.parametrize("router, ep", [("kernel", (0, 1)), ("kernel", (1, 2)), ("torch", (1, 2))])
def test_replay_takes_recorded_choices_with_own_weights(router, ep):
    e, k, n = 12, 4, 37
    lg, lg2 = _logits(n, e, 3)
    bias = torch.linspace(-0.2, 0.2, e)
    kw = dict(top_k=k, router_activation="sigmoid", renormalize=True, scaling=2.5, ep_rank=ep[0], ep_size=ep[1])
    fn = M.route if router == "kernel" else M.torch_route
    with RoutingReplay.record() as rec:
        first = fn(lg, bias, **kw)
    assert rec.calls == 1 and torch.equal(rec.routes[0].long(), first[1].long())
    free = M.torch_route(lg2, bias, **kw)                                  # the perturbed run's own choice
    flipped = int((free[1].sort(-1).values != first[1].sort(-1).values).any(-1).sum())
    assert flipped > 0, "the perturbation must flip some choices, or the test shows nothing"
    with RoutingReplay.replay(rec.routes) as rep:
        got = fn(lg2, bias, **kw)
    assert torch.equal(got[1].long(), first[1].long())
    assert rep.flips == flipped and rep.decisions == n
    want_w = routed_weights(torch.sigmoid(lg2), first[1], True, 2.5)
    assert torch.allclose(got[0], want_w, rtol=1e-6, atol=1e-7)
    # the expert offsets and permutation follow the replayed ids exactly as a free route over them would
    with RoutingReplay.replay(rec.routes):
        want = M.torch_route(lg2, bias, **kw)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3].reshape(-1), want[3].reshape(-1))


def test_reference_router_replays():
    e, k, n, d = 10, 3, 21, 16
    g = torch.Generator().manual_seed(5)
    cfg = MoESpec(num_experts=e, top_k=k, expert_intermediate_size=8, router_activation="softmax", router_bias=False,
                  renormalize=False)
    x = torch.randn(n, d, generator=g)
    w = {"gate.weight": torch.randn(e, d, generator=g)}
    rec = RoutingReplay.record()
    _, idx, _ = ref.route(x, w, cfg, rec.choose)
    x2 = x + 0.5 * torch.randn(n, d, generator=g)
    rep = RoutingReplay.replay(rec.routes)
    p, idx2, scores = ref.route(x2, w, cfg, rep.choose)
    assert torch.equal(idx2, idx) and rep.flips > 0
    assert torch.allclose(p, scores.gather(-1, idx) * cfg.routed_scaling_factor)


def test_replay_mismatch_is_an_error(tmp_path):
    lg, _ = _logits(8, 12, 1)
    with RoutingReplay.record() as rec:
        M.torch_route(lg, None, top_k=2, router_activation="sigmoid", renormalize=True, scaling=1.0)
    path = str(tmp_path / "routes.safetensors")
    rec.save(path)
    routes = load_routes(path)
    assert len(routes) == 1 and torch.equal(routes[0].long(), rec.routes[0].long())
    with pytest.raises(RuntimeError, match=r"routes \(5, 2\) but the recorded call routed \(8, 2\)"):
        with RoutingReplay.replay(routes):
            M.torch_route(lg[:5], None, top_k=2, router_activation="sigmoid", renormalize=True, scaling=1.0)
    with pytest.raises(RuntimeError, match="router call 1 was not recorded"):
        with RoutingReplay.replay(routes):
            for _ in range(2):
                M.torch_route(lg, None, top_k=2, router_activation="sigmoid", renormalize=True, scaling=1.0)
    with pytest.raises(RuntimeError, match="already active"):
        with RoutingReplay.record(), RoutingReplay.record():
            pass


def test_sequence_parallel_rank_takes_its_token_block():
    """A TP rank under sequence parallel with EP 1 routes only its block of tokens (T = 5 over 2 ranks: blocks of 3,
    the last one padded): it takes its rows of the recorded call; padding rows keep their own choice, uncounted."""
    from k3c.runtime.distributed import state

    b, t, k = 2, 5, 2
    recorded = torch.arange(b * t * k, dtype=torch.int32).view(b * t, k)
    st = state()
    saved = (st.seq, st.seq_rank)
    try:
        st.seq, st.seq_rank = (t, 3), 1                     # rank 1 holds tokens 3, 4 and one padding token
        own = torch.full((b * 3, k), -7, dtype=torch.int32)
        with RoutingReplay.replay([recorded]) as rep:
            got = rep.choose(own)
        want = recorded.view(b, t, k)[:, 3:5]
        assert torch.equal(got.view(b, 3, k)[:, :2], want) and torch.all(got.view(b, 3, k)[:, 2] == -7)
        assert rep.decisions == b * 2 and rep.flips == b * 2       # every real row differed from its own choice
        st.seq = None                                       # not split (decode): a shape mismatch is an error
        with pytest.raises(RuntimeError, match="different router calls"):
            with RoutingReplay.replay([recorded]) as rep:
                rep.choose(own)
    finally:
        st.seq, st.seq_rank = saved
