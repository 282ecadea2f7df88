"""`k3c serve MODEL --tp N --ep M`: the ranks of a sharded server (docs/distributed.md, "Serving").

    k3c serve examples/k3-stdlib --tp 2 --ep 2              # this process is rank 0; it starts ranks 1..3
    torchrun --nproc-per-node 8 -m k3c.cli serve DIR --tp 8 --device cuda    # or torchrun starts every rank

Rank 0 owns the socket, HTTP, tokenization and the scheduler; every rank builds its slice of the model and a
lock-step engine (runtime/serving/lockstep.py): rank 0's engine broadcasts one plan a step over a gloo group of its
own, the others apply it and run the same step on their shard.

Failures: rank 0 watches its ranks (the processes it started, and the step under way): a rank that exits, or a
step or broadcast that has not come back within --dist-timeout seconds, makes rank 0 fail every open request with
503, refuse new ones, stop its HTTP server and exit 1, ending the ranks it started. A rank started by rank 0 dies
with it (PR_SET_PDEATHSIG), and any rank exits 1 when rank 0 has not been heard from for twice --dist-timeout.
SIGINT / SIGTERM: rank 0 shuts down as one process does, then tells the ranks to stop (they exit 0); the ranks
rank 0 started ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: rank 0 coordinates), and a
rank told SIGTERM waits for rank 0's stop a while, then exits 1.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from ..errors import ArgumentError, UserError

STARTUP_TIMEOUT_S = 1800.0        # the ranks' rendezvous and every rank's build (a GPU rank compiles its slice)
STOP_GRACE_S = 10.0               # a rank told SIGTERM waits this long for rank 0's stop
ARGS_ENV, PARENT_ENV = "K3C_SERVE_ARGS", "K3C_SERVE_PARENT"
EXIT_RANK_FAILED = 1


@dataclass
class Layout:
    tp: int
    ep: int
    world: int
    rank: int
    local_rank: int
    local_world: int
    torchrun: bool                # started by torchrun (or another launcher setting RANK / WORLD_SIZE)

    def describe(self, device: str) -> str:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return f"{self.world} ranks (TP {self.tp} x EP {self.ep}, {backend})"


def layout(args) -> Layout | None:
    """The rank layout of `k3c serve` (None: one process): --tp / --ep checked as `k3c run` checks them, and
    against torchrun's WORLD_SIZE when it started this process."""
    from ..passes.shard import make_layout

    tp = args.tp or 1
    ep = args.ep if args.ep is not None else tp
    lay = make_layout(tp, ep)                   # ArgumentError: one of --tp, --ep must divide the other
    env_world = os.environ.get("WORLD_SIZE")
    if lay.world == 1 and env_world in (None, "1"):
        return None
    if env_world is not None and int(env_world) != lay.world:
        raise ArgumentError(f"--tp {tp} --ep {ep} need {lay.world} processes, the launcher started {env_world}")
    if args.speculate is not None:
        raise ArgumentError("--speculate is not built for a sharded server (--tp / --ep)")
    rank = int(os.environ.get("RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", lay.world if env_world is None else 1))
    return Layout(tp, ep, lay.world, rank, int(os.environ.get("LOCAL_RANK", rank)), local_world,
                  torchrun=env_world is not None and PARENT_ENV not in os.environ)


def check_model_shards(args, lay: Layout) -> None:
    """--tp / --ep that the model's heads or experts cannot be split by: one line, exit 2, before any rank starts."""
    from .. import api
    from ..frontend import load_spec
    from ..frontend.to_ir import spec_to_module
    from ..passes.shard import check_divisible, make_layout
    from .run import _is_artifact

    spec = api.load(args.model).spec if _is_artifact(args.model) else load_spec(args.model)
    check_divisible(spec_to_module(spec), make_layout(lay.tp, lay.ep))


@dataclass
class RankSetup:
    """One rank's part in the build (commands/run.py _build's `rank`): its slice, its memory check, its engine."""
    lay: Layout
    device: str
    channel: object = None                       # lockstep.ControlChannel
    clock: object = None                         # lockstep.StepClock (the prefix cache's clock)
    engine_obj: object = None
    ready_group: object = None

    @property
    def shard(self) -> tuple[int, int, int]:
        return self.lay.tp, self.lay.ep, self.lay.rank

    def fits(self, model) -> dict:
        from ..runtime.distributed import param_shards

        copies = 1 if self.device.startswith("cuda") else self.lay.local_world     # one host's CPU: all its ranks
        return {"shards": param_shards(model), "tp": self.lay.tp, "copies": copies,
                "rank": f"rank {self.lay.rank} of {self.lay.world}"}

    def engine(self, model, weights, **kwargs):
        from ..runtime.serving.lockstep import LockstepEngine

        self.engine_obj = LockstepEngine(model, weights, role="leader" if self.lay.rank == 0 else "follower",
                                         channel=self.channel, clock=self.clock, **kwargs)
        return self.engine_obj


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """This process gets SIGKILL when the process that started it dies (Linux), so no rank outlives rank 0."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:                  # rank 0 died before the prctl
        os._exit(EXIT_RANK_FAILED)


def _spawn_followers(args, lay: Layout, port: int) -> list[subprocess.Popen]:
    env_args = json.dumps({k: v for k, v in vars(args).items() if k != "func" and _plain(v)})
    procs = []
    for r in range(1, lay.world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(lay.world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(lay.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   **{ARGS_ENV: env_args, PARENT_ENV: str(os.getpid())})
        procs.append(subprocess.Popen([sys.executable, "-m", "k3c.commands.serve"], env=env,
                                      stdin=subprocess.DEVNULL))
    return procs


def _plain(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _threads(lay: Layout, device: str, args) -> None:
    """CPU ranks of one host share its cores: each takes its share of what `k3c serve` would take alone."""
    import torch

    if device.startswith("cuda") or getattr(args, "threads", None):
        return
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, lay.local_world)))


def _rank_device(device: str, lay: Layout) -> str:
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ArgumentError("--device cuda: no CUDA device is available here (use --device cpu)")
        if not lay.torchrun and torch.cuda.device_count() < lay.world:
            raise ArgumentError(f"--tp {lay.tp} --ep {lay.ep} need {lay.world} GPUs, {torch.cuda.device_count()} "
                                f"visible")
        local = lay.local_rank % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return device


def join_groups(lay: Layout, device: str, dist_timeout: float, *, init_method: str | None = None) -> RankSetup:
    """Rendezvous (torchrun's environment, or rank 0's address), the TP / EP groups the graph uses, the gloo
    group of the plans (timeout --dist-timeout) and one for the start (the builds may take long)."""
    import torch.distributed as dist

    from ..runtime.distributed import init_groups
    from ..runtime.serving.lockstep import ControlChannel, StepClock

    dev = _rank_device(device, lay)
    backend = "nccl" if dev.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=lay.rank, world_size=lay.world,
                                timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    init_groups(lay.tp, lay.ep)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=dist_timeout))
    ready = dist.new_group(backend="gloo", timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    return RankSetup(lay, dev, ControlChannel(control, lay.rank), StepClock(), ready_group=ready)


class OtherRankFailed(Exception):
    """Another rank failed to start (rank 0 says which and why); `code`: the exit code."""

    def __init__(self, text: str, code: int):
        super().__init__(text)
        self.code = code


def exchange_ready(setup: RankSetup, error: BaseException | None) -> None:
    """Every rank says whether its build succeeded; any failure is raised on every rank: on rank 0 as an error
    naming the rank (a UserError: a bad argument, a model that does not fit, stays one: exit 2), on the others
    as their own error or OtherRankFailed."""
    import torch.distributed as dist

    mine = None if error is None else ("user" if isinstance(error, UserError) else "error",
                                       str(error) or type(error).__name__)
    got: list = [None] * setup.lay.world
    dist.all_gather_object(got, mine, group=setup.ready_group)
    for r, status in enumerate(got):
        if status is not None:
            kind, text = status
            if r == setup.lay.rank and error is not None:
                raise error
            if setup.lay.rank != 0:
                raise OtherRankFailed(f"rank {r} failed to start", 2 if kind == "user" else EXIT_RANK_FAILED)
            text = text if text.startswith(f"rank {r} ") else f"rank {r}: {text}"
            raise ArgumentError(text) if kind == "user" else RuntimeError(f"{text} (failed to start)")


# ---- rank 0 ----------------------------------------------------------------------------------------------------------
@dataclass
class Leader:
    """Rank 0's side: the ranks it started, the watchdog, the stop."""
    lay: Layout
    dist_timeout: float
    procs: list = field(default_factory=list)
    setup: RankSetup | None = None
    failure: str | None = None
    _loop: object = None
    _server: object = None
    _stopping: bool = False
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, args, lay: Layout) -> Leader:
        leader = cls(lay, args.dist_timeout)
        init = None
        if not lay.torchrun:
            port = _free_port()
            leader.procs = _spawn_followers(args, lay, port)
            init = f"tcp://127.0.0.1:{port}"
        leader._thread = threading.Thread(target=leader._watch, name="k3c-rank-watchdog", daemon=True)
        leader._thread.start()
        leader.setup = join_groups(lay, args.device, args.dist_timeout, init_method=init)
        _threads(lay, leader.setup.device, args)
        return leader

    def supervise(self, loop, server) -> None:
        """From here a failure also stops the HTTP server (503 to what is open)."""
        self._loop, self._server = loop, server
        if self.failure is not None:
            self._fail(self.failure)

    def _watch(self) -> None:
        while not self._stopping:
            time.sleep(0.1)
            if self.failure is not None:
                continue
            for r, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._stopping:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    self._fail(f"rank {r} {how}")
                    break
            eng = self.setup.engine_obj if self.setup is not None else None
            since = getattr(eng, "busy_since", None)
            if since is not None and time.monotonic() - since > self.dist_timeout and self.failure is None:
                self._fail(f"a step has not finished in {self.dist_timeout:g} s (--dist-timeout): a rank hangs")
            loop = self._loop
            if loop is not None and loop.error is not None and self.failure is None:
                self._fail(f"{loop.error}")

    def _fail(self, why: str) -> None:
        """The server cannot go on: 503 to every open request and to new ones, HTTP stops, the process exits 1
        (within a deadline, whatever the engine thread is blocked in)."""
        first = self.failure is None
        self.failure = why
        if not first and self._loop is None:
            return
        if first:
            print(f"k3c serve: {why}; failing open requests with 503 and stopping", file=sys.stderr, flush=True)
        if self._loop is None:                  # still starting: nothing to fail, nobody to tell
            self._end(EXIT_RANK_FAILED)
        self._loop.fail_open("a rank of the sharded model failed; the server is stopping")
        self._server.should_exit = True
        deadline = threading.Timer(20.0, self._end, (EXIT_RANK_FAILED,))    # whatever still blocks
        deadline.daemon = True
        deadline.start()

    def _end(self, code: int) -> None:
        self._kill_followers()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _kill_followers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def finish(self) -> int:
        """After the HTTP server has stopped: the ranks told to stop (when healthy) and waited for; the exit code."""
        self._stopping = True                   # from here a rank that exits is one that was told to
        thread = getattr(self._loop, "_thread", None)
        if self.failure is None and thread is not None and thread.is_alive():
            self.failure = "the engine thread did not stop (a step still running): the ranks cannot be told"
        if self.failure is None:
            try:
                self.setup.engine_obj.stop()
            except Exception as exc:    # noqa: BLE001  (a rank gone: reported as the failure)
                self.failure = f"telling the ranks to stop failed ({exc})"
        if self.failure is not None:
            print(f"k3c serve: stopped: {self.failure}", file=sys.stderr, flush=True)
            self._end(EXIT_RANK_FAILED)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        bad = [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.returncode]
        import torch.distributed as dist

        try:
            dist.destroy_process_group()
        except Exception:               # noqa: BLE001
            pass
        if bad:
            print(f"k3c serve: rank {bad[0][0]} exited with code {bad[0][1]} at the stop", file=sys.stderr,
                  flush=True)
            return EXIT_RANK_FAILED
        return 0

    def abort(self) -> None:
        """Rank 0 failed to start: the ranks it started go too."""
        self._stopping = True
        self._kill_followers()


# ---- ranks > 0 -------------------------------------------------------------------------------------------------------
def follower_main(args, lay: Layout, build) -> int:
    """A rank other than 0: build its slice (`build(args, rank=RankSetup)`: commands/serve.py build_engine),
    follow rank 0's plans until told to stop (exit 0), or fail (exit 1; a build's bad argument: 2)."""
    from ..runtime.serving.lockstep import follow

    _die_with_parent()
    stopping: list[float] = []
    # rank 0 stops the others: a terminal's Ctrl-C (the whole process group) is rank 0's to act on; a launcher's
    # SIGINT / SIGTERM (torchrun forwards them to every rank) gives rank 0 STOP_GRACE_S to send its stop
    if PARENT_ENV in os.environ:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, lambda *_: stopping.append(time.monotonic()))
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(time.monotonic()))
    pulse = [time.monotonic()]
    tag = f"k3c serve: rank {lay.rank} of {lay.world}"

    def watch():
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            if stopping and now - stopping[0] > STOP_GRACE_S:
                print(f"{tag}: SIGTERM and no stop from rank 0 in {STOP_GRACE_S:g} s; exiting", file=sys.stderr,
                      flush=True)
                os._exit(EXIT_RANK_FAILED)
            if pulse[0] is not None and now - pulse[0] > 2 * args.dist_timeout:
                print(f"{tag}: no word from rank 0 in {2 * args.dist_timeout:g} s; exiting", file=sys.stderr,
                      flush=True)
                os._exit(EXIT_RANK_FAILED)

    try:
        pulse[0] = None                                    # the start has its own (long) timeout
        setup = join_groups(lay, args.device, args.dist_timeout)
        _threads(lay, setup.device, args)
        error = None
        try:
            build(args, rank=setup)
        except BaseException as exc:                       # noqa: BLE001  (every rank hears of it)
            error = exc
        exchange_ready(setup, error)
        eng = setup.engine_obj
        print(f"{tag} ({setup.device}): ready, {eng.pool.num_pages} MLA pages; following rank 0", flush=True)
        pulse[0] = time.monotonic()
        threading.Thread(target=watch, name="k3c-rank-watchdog", daemon=True).start()

        def on_plan(plan):
            pulse[0] = time.monotonic()

        plans = follow(eng, on_plan)
    except OtherRankFailed as exc:                         # rank 0 says why
        return exc.code
    except UserError as exc:
        if lay.torchrun:                                   # else rank 0 prints it, naming this rank
            print(f"{tag}: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:          # noqa: BLE001  (rank 0 reports the failure to clients; here the cause)
        print(f"{tag}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_RANK_FAILED)     # no teardown of groups whose peers may be gone
    print(f"{tag}: stopped after {plans} plans", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def spawned_main(build) -> int:
    """Entry of a rank that rank 0 started (`python -m k3c.commands.serve`): the server's arguments from the
    environment; `build` as follower_main's."""
    import argparse

    _die_with_parent()
    args = argparse.Namespace(**json.loads(os.environ[ARGS_ENV]))
    from .threads import apply_threads

    args.thread_choice = apply_threads(args.threads)
    try:
        lay = layout(args)
        if lay is None:
            raise ArgumentError("a rank of a sharded server was started without a layout")
        return follower_main(args, lay, build)
    except UserError as exc:
        print(f"k3c serve: rank {os.environ.get('RANK')}: {exc}", file=sys.stderr, flush=True)
        return 2

