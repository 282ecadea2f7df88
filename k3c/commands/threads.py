"""How many threads torch's CPU ops get: the cores this process may really use, less what other work is using.

torch's default is one thread per core of the machine. On a machine whose cores other processes are also using
(a shared 2-core box, a container with a CPU quota smaller than the host), its OpenMP threads wait on each other at
every op's barrier whenever one of them is descheduled: decoding a small model ran at 1.5-29 tokens/s with one busy
process beside it where one thread gave a steady 38 (issue 59). Too few threads costs at most the parallel speed-up
of small ops (48 vs 38 tokens/s on an idle 2-core box); too many can cost 10x. So the default leans low:

    usable = min(CPUs in this process's affinity mask, the cgroup's CPU quota rounded up)
    free   = the machine's CPUs - its 1-minute load average (others' runnable work), rounded
    threads = max(1, min(usable, free))

`--threads N` (or OMP_NUM_THREADS in the environment) overrides it. Whatever decides it, the run report says so.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str

    def line(self) -> str:
        return f"{self.threads} ({self.why})"


def cgroup_quota(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs the process's cgroup may use (cgroup v2 cpu.max on its path and every parent, v1 cfs quota); None
    when unlimited or unreadable."""
    limits = []
    try:
        with open(proc_cgroup, encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0":                      # v2: the unified hierarchy
            path = parts[2].strip("/")
            while True:
                limits.append(_v2_limit(os.path.join(root, path, "cpu.max")))
                if not path:
                    break
                path = os.path.dirname(path)
    limits.append(_v1_limit(os.path.join(root, "cpu", "cpu.cfs_quota_us"), os.path.join(root, "cpu",
                                                                                          "cpu.cfs_period_us")))
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def _v2_limit(path: str) -> float | None:
    try:
        with open(path, encoding="ascii") as fh:
            quota, period = fh.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(quota_path: str, period_path: str) -> float | None:
    try:
        with open(quota_path, encoding="ascii") as q, open(period_path, encoding="ascii") as p:
            quota, period = int(q.read()), int(p.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def choose_threads(requested: int | None = None, *, env=None, affinity=None, quota="read", load="read",
                   cpus: int | None = None) -> ThreadChoice:
    """The thread count and why (the keyword arguments stand in for the machine in tests)."""
    env = os.environ if env is None else env
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    omp = env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) >= 1:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS; --threads N overrides")
    affinity = _affinity() if affinity is None else affinity
    quota = cgroup_quota() if quota == "read" else quota
    load = _load() if load == "read" else load
    cpus = (os.cpu_count() or affinity) if cpus is None else cpus
    usable = min(affinity, math.ceil(quota)) if quota is not None else affinity
    usable = max(1, usable)
    what = f"{affinity} CPUs in the affinity mask" + (f", cgroup quota {quota:g}" if quota is not None else "")
    if load is None:
        return ThreadChoice(usable, f"{what}; --threads N overrides")
    free = max(1, min(usable, math.floor(cpus - load + 0.5)))
    busy = f"; load {load:.2f} on {cpus} CPUs leaves {max(0, cpus - load):.1f} free" if free < usable else ""
    return ThreadChoice(free, f"{what}{busy}; --threads N overrides")


def apply_threads(requested: int | None = None) -> ThreadChoice:
    """choose_threads, set as torch's intra-op thread count."""
    import torch

    choice = choose_threads(requested)
    torch.set_num_threads(choice.threads)
    return choice
