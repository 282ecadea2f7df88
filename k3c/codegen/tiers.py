"""Kernel tiers: the portable Triton kernels every target runs, and kernels written in Triton's Gluon dialect for
one chip family (docs/adding-an-op.md, "Adding a tier").

A tier is chosen by a family's plan function from the `Target` (`Target.tiers` lists the tiers a target can run),
so the AOT catalogue and the runtime agree by construction. A tier kernel's `KernelSource` names its tier and the
Triton release whose Gluon API its source is written in (`builds_with`): Gluon's API changes between releases
(3.6's `tma.async_copy_global_to_shared` is 3.9's `tma.async_load`), so the source builds only there. The
artifact's binaries do not care which Triton runs the program; a JIT of the source does (`can_build`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

PORTABLE = "portable"


@dataclass(frozen=True)
class Tier:
    name: str
    arch: str                  # the target arch its kernels are compiled for (Target.arch)
    builds_with: str           # "major.minor" of the Triton whose Gluon API the sources use
    doc: str


TIERS: dict[str, Tier] = {t.name: t for t in (
    Tier("hopper", "sm_90", "3.9", "Gluon for sm_90a: warpgroup MMA, TMA, mbarriers, warp specialisation; mma.sync "
                                   "with register operands, cp.async"),
)}


def tier_of(name: str) -> Tier:
    try:
        return TIERS[name]
    except KeyError:
        raise ValueError(f"unknown kernel tier {name!r}; tiers: {PORTABLE}, {', '.join(TIERS)}") from None


def triton_release() -> str:
    """major.minor of the installed Triton ("" when there is none), read from its package metadata: importing
    triton here would fix TRITON_INTERPRET for the process before the runtime sets it (k3c.runtime.devices)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return ".".join(version("triton").split(".")[:2])
    except PackageNotFoundError:
        return ""


def can_build(ks) -> bool:
    """Whether this process's Triton can compile the KernelSource `ks` from source (portable kernels: always)."""
    return ks.tier == PORTABLE or not ks.builds_with or ks.builds_with == triton_release()


def unbuildable(ks) -> str:
    """Why this process cannot JIT-compile the tier kernel `ks` (a clause)."""
    return (f"kernel {ks.name} is a {ks.tier}-tier Gluon source written for Triton {ks.builds_with}, which this "
            f"process's Triton {triton_release() or '(none)'} cannot build")


def refusal(ks) -> str:
    """One line: the tier kernel `ks` can be neither loaded nor built here, and what to do."""
    return (f"{unbuildable(ks)}: run an artifact compiled for this device (k3c compile --target ...), or pass "
            f"--allow-jit to use the portable kernels instead")


def buildable_target(target):
    """`target` without the tiers whose sources this process's Triton cannot build: what a compile here plans
    for (the artifact records it, so the runtime that loads the artifact plans alike). Said once per tier."""
    if not target.tiers:
        return target
    here = triton_release()
    kept = tuple(t for t in target.tiers if tier_of(t).builds_with == here)
    for t in sorted(set(target.tiers) - set(kept)):
        if t not in _SAID:
            _SAID.add(t)
            warnings.warn(f"k3c: the {t} tier's Gluon kernels are written for Triton {tier_of(t).builds_with}, "
                          f"which this process's Triton {here or '(none)'} is not: {target.name} compiles its "
                          f"portable kernels here (an artifact compiled with Triton {tier_of(t).builds_with} runs "
                          f"the {t} tier on any Triton)", RuntimeWarning, stacklevel=3)
    return target if kept == target.tiers else replace(target, tiers=kept)


_SAID: set[str] = set()
