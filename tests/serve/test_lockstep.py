"""The lock-step protocol of a sharded server (runtime/serving/lockstep.py) without processes: a leader and a
follower engine of the same (unsharded) model in one process, the plans handed over in memory. The follower must
end every step in the leader's state (same admissions, preemptions, prefix-cache checkpoints, pages) while never
sampling, whatever arrives and leaves between steps; a follower that differs stops at the next plan."""
import pytest
import torch

from k3c.runtime.prefix_cache import PrefixCache
from k3c.runtime.sampling import SamplingParams
from k3c.runtime.serving.lockstep import DivergedError, LockstepEngine, StepClock, follow


class Handover:
    """ControlChannel in memory: the leader's plans, received by the follower in order."""

    def __init__(self, rank: int, plans: list):
        self.rank, self.plans = rank, plans

    def send(self, plan) -> None:
        self.plans.append(plan)

    def receive(self):
        return self.plans.pop(0)


def toks(spec, n, seed):
    return torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pair(tiny, follower_kw=None, **kw):
    spec, model, w = tiny
    plans: list = []
    made = []
    for role, rank, extra in (("leader", 0, {}), ("follower", 1, follower_kw or {})):
        clock = StepClock()
        args = dict(use_kernels=False, max_context=96, page_size=8, max_batch=4, **kw)
        args.update(extra)
        pc = PrefixCache(interval=16, host_bytes=1 << 30, clock=clock)
        made.append(LockstepEngine(model, w, role=role, channel=Handover(rank, plans), clock=clock,
                                   prefix_cache=pc, **args))
    return made


def test_follower_keeps_the_leaders_state_through_preemption_and_cancels(tiny, one_thread):
    spec = tiny[0]
    # 13 pages of 8 rows, optimistic admission: the step that runs short preempts (into the host tier)
    lead, fol = pair(tiny, num_pages=13, admission="optimistic")
    rids = [lead.add_request(toks(spec, 20 + i, 40 + i), 22,
                             sampling=SamplingParams(temperature=0.9, seed=7) if i == 3 else None) for i in range(4)]
    got: dict[int, list[int]] = {}
    n = 0
    while lead.has_work():
        for o in lead.step():
            got.setdefault(o.rid, []).append(o.token)
        n += 1
        if n == 3:                              # a request arrives with a shared prefix, one leaves
            rids.append(lead.add_request(toks(spec, 20, 40) + [5, 6], 4))
            lead.finish(rids[1])
        plan = fol.channel.receive()             # the follower checks its last step against the leader's here
        fol.apply(plan)
        if plan.kind == "step":
            fol.follow_step()
    lead.stop()
    follow(fol)                                  # the last tokens and the stop
    assert lead.stats["preempted"] > 0 and fol.stats["preempted"] == lead.stats["preempted"]
    for key in ("prompt_tokens", "resumed_tokens", "restored_preempted", "generated_tokens", "steps"):
        assert fol.stats[key] == lead.stats[key], key
    assert fol.prefix.stats == lead.prefix.stats and fol.prefix.stats["hits"] > 0
    assert fol.pool.num_free == lead.pool.num_free and not fol.seqs and not lead.seqs
    assert len(got[rids[0]]) == 22 and len(got[rids[4]]) == 4


def test_the_followers_plan_with_rank_0s_measurements(tiny, one_thread):
    """What rank 0 measured and plans by (a step budget's costs: lockstep.MEASURED) reaches the followers, whose
    own clocks would say otherwise."""
    from k3c.runtime.serving.scheduler import StepBudget

    lead, fol = pair(tiny)
    for eng, token_s, decode_s in ((lead, 3e-5, 0.012), (fol, 9e-5, 0.040)):
        eng.scheduler.budget = StepBudget(max_tokens=64, itl_target=0.1)
        eng.scheduler.budget.token_s, eng.scheduler.budget.decode_s = token_s, decode_s
    lead.add_request(toks(tiny[0], 5, 1), 2)
    lead.step()
    fol.apply(fol.channel.receive())
    assert (fol.scheduler.budget.token_s, fol.scheduler.budget.decode_s) == (3e-5, 0.012)


def test_a_follower_that_differs_stops_at_the_next_plan(tiny, one_thread):
    spec = tiny[0]
    lead, fol = pair(tiny, follower_kw={"prefill_chunk": 8})     # it would cut prompts where the leader does not
    lead.add_request(toks(spec, 20, 1), 3)
    for _ in range(2):
        lead.step()
    fol.apply(fol.channel.receive())
    fol.follow_step()
    with pytest.raises(DivergedError, match="rank 1 diverged from rank 0 at plan 1"):
        fol.apply(fol.channel.receive())


def _channel_rank(rank: int, device: str) -> list:
    import torch.distributed as dist

    from k3c.runtime.serving.lockstep import ControlChannel, LockstepPlan

    ch = ControlChannel(dist.new_group(backend="gloo"), rank)
    got = []
    # the plan buffer's edge: plans under and over it, and one far over (new prompts)
    for n in (0, 990, 1010, 1040, 30000):
        plan = LockstepPlan(n, "step", 2.5, ops=[("add", 1, list(range(n)), 7)])
        if rank == 0:
            ch.send(plan)
        got.append(plan == (plan if rank == 0 else ch.receive()))
    return got


def test_plans_cross_the_channel_whole():
    """ControlChannel over gloo: plans of every size arrive equal (one broadcast when they fit its buffer, two
    otherwise)."""
    from k3c.commands.ranks import run_ranks
    from k3c.runtime.serving.lockstep import ControlChannel, LockstepPlan, encode

    sizes = [len(encode(LockstepPlan(n, "step", 2.5, ops=[("add", 1, list(range(n)), 7)]))) for n in (990, 1010, 1040)]
    assert min(sizes) < ControlChannel.HEADER - 8 < max(sizes)          # the sizes straddle the buffer
    assert run_ranks(_channel_rank, 2, 2, device="cpu", timeout=300) == [[True] * 5] * 2
