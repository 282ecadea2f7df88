"""One engine step on every rank of a sharded model (docs/distributed.md, "Serving"): rank 0 leads, the others
follow, in lock step.

    clock = StepClock()                                        # the prefix cache's clock on every rank
    eng = LockstepEngine(model, w, channel=ControlChannel(group), role="leader" | "follower", clock=clock, ...)
    # rank 0: an Engine as any other (the server's EngineLoop drives it); each step() first broadcasts a LockstepPlan
    # ranks > 0: follow(eng) -> applies each plan and runs the same step on its shard, until rank 0 says stop

Every rank holds a whole Engine over its slice of the graph: its pages, its KDA rows (its heads) and prefix-cache
checkpoints of them. Rank 0 alone takes requests, chooses tokens (sampling, seeds, grammars, stop ids) and ends
requests; what changes the engines reaches the others in ONE broadcast per step, a LockstepPlan: the requests that
arrived (their token ids and budgets), the ones that left (cancelled, failed), the tokens rank 0 chose at the end of
the previous step (and which sequences finished with them), rank 0's clock, and rank 0's account of the previous
step. A follower applies that plan, then runs Engine.step itself: admission, preemption, prefix-cache decisions,
segments and page tables are computed by the same code from the same state (the prefix cache reads the broadcast
clock, never its own), so they are rank 0's decisions; each rank checks its account of the step (the segments of
every call, the free pages after it, the preemptions) against rank 0's and stops with DivergedError at the first
difference, rather than compute on pages that differ. A follower never samples: its rows wait for rank 0's tokens,
which arrive at the head of the next plan, before anything else of that step.

Rank 0 broadcasts a heartbeat plan when it has been idle for HEARTBEAT_S, so a follower never waits longer than
that for word from rank 0 (its control group's timeout is the hang detector); a "stop" plan ends the followers.
Any exception inside a leader's step is a RankFailure (a collective that failed, or a state that may now differ
between ranks): the server fails its requests with 503 and exits (serve/engine_loop.py).
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

import torch

from .engine import Engine
from .requests import StepOutput

HEARTBEAT_S = 1.0          # rank 0 broadcasts at least this often, idle or not
# rank 0's measurements that steer its scheduler (a step budget fitted to measured step times): they travel with
# every plan and replace the followers' own, which their clocks would make differ; a path that does not resolve on
# this engine is skipped
MEASURED = ("scheduler.budget.token_s", "scheduler.budget.decode_s")


class RankFailure(RuntimeError):
    """A rank of a sharded engine failed, or the ranks may no longer agree: the engine cannot go on."""
    fatal = True


class DivergedError(RankFailure):
    """A follower's step differs from rank 0's (a bug: the same code on the same state must decide the same)."""


@dataclass
class LockstepPlan:
    """What one step changes, from rank 0 (plain values: JSON for the broadcast, never pickle: a follower
    runs nothing it receives)."""
    number: int                                 # plans sent before this one
    kind: str                                   # "step": run a step | "beat": only apply | "stop": followers exit
    clock: float                                # rank 0's clock for this step (the prefix cache's time)
    outputs: list[tuple[int, int, bool, bool]] = field(default_factory=list)   # (rid, token, finished, failed)
    ops: list[tuple] = field(default_factory=list)      # ("add", rid, tokens, max_new) | ("finish", rid, checkpoint)
    account: tuple | None = None                # rank 0's account of its previous step (StepAccount.key)
    measured: dict = field(default_factory=dict)        # MEASURED path -> rank 0's value


class StepClock:
    """A clock that moves only when rank 0 says: the prefix cache's time on every rank (its LRU order and the
    working-set protection windows then decide alike everywhere)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ControlChannel:
    """Plans from rank 0 to the others over a torch.distributed group (gloo: host memory, no device sync; on GPUs
    a group of its own beside the NCCL groups the graph uses). One broadcast of a packed byte tensor a plan: the
    length is the first 8 bytes of a fixed-size 4 KiB buffer that holds a decode step's plan (~1 KB for a
    batch of 64); a plan larger than it (new prompts) sends the rest in a second broadcast."""
    HEADER = 1 << 12

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank

    def send(self, plan: LockstepPlan) -> None:
        import torch.distributed as dist

        data = encode(plan)
        buf = torch.zeros(self.HEADER, dtype=torch.uint8)
        buf[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        head = data[:self.HEADER - 8]
        buf[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        if len(data) > len(head):
            rest = torch.frombuffer(bytearray(data[len(head):]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)

    def receive(self) -> LockstepPlan:
        import torch.distributed as dist

        buf = torch.empty(self.HEADER, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        n = int.from_bytes(bytes(buf[:8].tolist()), "little")
        data = bytes(buf[8:8 + min(n, self.HEADER - 8)].numpy())
        if n > len(data):
            rest = torch.empty(n - len(data), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += bytes(rest.numpy())
        return decode(data)


def encode(plan: LockstepPlan) -> bytes:
    """A plan as JSON (plain values only: a follower runs nothing it receives, unlike a pickle)."""
    return json.dumps(dataclasses.asdict(plan), separators=(",", ":")).encode()


def decode(data: bytes) -> LockstepPlan:
    """encode's inverse: the tuples JSON made lists restored (an account then compares equal to a rank's own)."""
    d = json.loads(data)
    return LockstepPlan(d["number"], d["kind"], d["clock"], [tuple(o) for o in d["outputs"]],
                        [tuple(op) for op in d["ops"]], _tuples(d["account"]), d["measured"])


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class StepAccount:
    """A rank's record of one step: every graph call's (sequence, segment length), the free pages after it, and the
    preemptions and admission waits so far. Rank 0 sends its own in the next plan; a follower compares."""

    def __init__(self):
        self.calls: list[tuple] = []

    def key(self, engine: Engine) -> tuple:
        s = engine.stats
        return tuple(self.calls), s["preempted"], s["admission_waits"]


class LockstepEngine(Engine):
    """An Engine on one rank of a sharded model (the module docstring). `role`: "leader" (rank 0) or "follower";
    `channel`: the ControlChannel; `clock`: the StepClock its prefix cache was given (None: no prefix cache)."""

    def __init__(self, compiled, weights, *, role: str, channel: ControlChannel, clock: StepClock | None = None,
                 **kwargs):
        if role not in ("leader", "follower"):
            raise ValueError(f"role must be leader or follower, got {role!r}")
        if kwargs.get("speculation") is not None:
            raise ValueError("speculative decoding is not built for a sharded engine")
        super().__init__(compiled, weights, **kwargs)
        self.role, self.channel = role, channel
        self.clock = clock if clock is not None else StepClock()
        self.plans = 0                           # plans sent (leader) or applied (follower)
        self._ops: list[tuple] = []              # leader: changes since the last plan
        self._outputs: list[tuple] = []          # leader: the tokens of the last step
        self._account_key: tuple | None = None   # this rank's account of its last step
        self._account = StepAccount()
        self._stepping = False
        self._last_sent = time.monotonic()
        self.busy_since: float | None = None     # leader: when the step (or broadcast) under way began
        run = self.runner.run

        def counted_run(plan, *args, **kw):      # every graph call of a step, with the pages left after it
            out = run(plan, *args, **kw)
            self._account.calls.append((tuple((s.rid, len(g)) for s, g in plan), self.pool.num_free))
            return out

        self.runner.run = counted_run

    # -- the leader: record what changes, broadcast it at the head of each step -----------------------------------
    def add_request(self, prompt, max_new_tokens: int = 16, sampling=None, stop_token_ids=(), logits=None) -> int:
        rid = super().add_request(prompt, max_new_tokens, sampling=sampling, stop_token_ids=stop_token_ids,
                                  logits=logits)
        if self.role == "leader":
            self._ops.append(("add", rid, list(self.seqs[rid].tokens), max_new_tokens))
        return rid

    def finish(self, rid: int, checkpoint: bool = True) -> None:
        super().finish(rid, checkpoint)
        if self.role == "leader" and not self._stepping:     # a step's own finishes travel as its outputs
            self._ops.append(("finish", rid, checkpoint))

    def has_work(self) -> bool:
        if self.role == "leader" and (self._ops or time.monotonic() - self._last_sent >= HEARTBEAT_S):
            return True                          # a heartbeat (with any changes) is due
        return super().has_work()

    def step(self) -> list[StepOutput]:
        if self.role != "leader":
            raise RuntimeError("a follower steps through follow(), on rank 0's plans")
        kind = "step" if super().has_work() else "beat"
        self.busy_since = time.monotonic()
        try:
            self.clock.now = time.monotonic()
            self._send(LockstepPlan(self.plans, kind, self.clock.now, self._outputs, self._ops, self._account_key,
                                self._measured()))
            self._ops, self._outputs, self._account_key = [], [], None
            if kind == "beat":
                return []
            outs = self._run_step()
            self._outputs = [(o.rid, o.token, o.finished, o.error is not None) for o in outs]
            return outs
        finally:
            self.busy_since = None

    def stop(self) -> None:
        """Tell the followers to exit (the last plan: they apply what it carries first)."""
        self._send(LockstepPlan(self.plans, "stop", self.clock.now, self._outputs, self._ops, self._account_key))
        self._ops, self._outputs, self._account_key = [], [], None

    def _measured(self) -> dict:
        out = {}
        for path in MEASURED:
            owner_path, _, name = path.rpartition(".")
            owner = self
            for part in owner_path.split("."):
                owner = getattr(owner, part, None)
            if owner is not None and hasattr(owner, name):
                out[path] = getattr(owner, name)
        return out

    def _send(self, plan: LockstepPlan) -> None:
        try:
            self.channel.send(plan)
        except Exception as exc:
            raise RankFailure(f"broadcasting step {plan.number} to the other ranks failed: {exc}") from exc
        self.plans += 1
        self._last_sent = time.monotonic()

    def _run_step(self) -> list[StepOutput]:
        self._account = StepAccount()
        self._stepping = True
        try:
            outs = super().step()
        except Exception as exc:
            raise RankFailure(f"an engine step failed on rank 0: {type(exc).__name__}: {exc}") from exc
        finally:
            self._stepping = False
        self._account_key = self._account.key(self)
        return outs

    # -- a follower: apply rank 0's plan, run the same step, never sample -----------------------------------------
    def _sample(self, ready):
        if self.role == "leader":
            return super()._sample(ready)
        return []                                # rank 0's tokens come with the next plan

    def apply(self, plan: LockstepPlan) -> None:
        """A follower takes rank 0's changes: the tokens of the last step, rank 0's account of it (checked against
        its own), the requests that came and left; then rank 0's clock."""
        if plan.number != self.plans:
            raise DivergedError(f"rank {self.channel.rank}: plan {plan.number} arrived, {self.plans} expected")
        self.plans += 1
        if plan.account != self._account_key:
            raise DivergedError(f"rank {self.channel.rank} diverged from rank 0 at plan {plan.number}: rank 0's step "
                                f"{plan.account}, this rank's {self._account_key}")
        self._account_key = None
        for rid, token, finished, failed in plan.outputs:
            seq = self.seqs[rid]
            if not failed:
                self.stats["generated_tokens"] += 1
                seq.generated.append(token)
                seq.tokens.append(token)
            if finished:
                super().finish(rid, checkpoint=not failed)
        for op in plan.ops:
            if op[0] == "add":
                _, rid, tokens, max_new = op
                got = super().add_request(tokens, max_new)
                if got != rid:
                    raise DivergedError(f"rank {self.channel.rank}: request {rid} of rank 0 became {got} here")
            else:
                _, rid, checkpoint = op
                super().finish(rid, checkpoint)
        self.clock.now = plan.clock
        for path, value in plan.measured.items():
            owner_path, _, name = path.rpartition(".")
            owner = self
            for part in owner_path.split("."):
                owner = getattr(owner, part)
            setattr(owner, name, value)

    def follow_step(self) -> None:
        """The step of a "step" plan (an exception here ends this rank: rank 0 then fails as well)."""
        self._account = StepAccount()
        super().step()
        self._account_key = self._account.key(self)


def follow(engine: LockstepEngine, on_plan=None) -> int:
    """A follower's loop: receive each plan, apply it, run its step; returns the plans applied when rank 0 says
    stop. `on_plan(plan)` (optional) is told each plan first (a watchdog's pulse, a signal check)."""
    while True:
        plan = engine.channel.receive()
        if on_plan is not None:
            on_plan(plan)
        engine.apply(plan)
        if plan.kind == "stop":
            return engine.plans
        if plan.kind == "step":
            engine.follow_step()
