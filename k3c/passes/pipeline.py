"""Named pipelines (data), the pipeline runner (verify after every pass, numbered dumps, rewrite counts), and
`lower`: a spec to one rank's lowered module."""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..codegen.targets import DEFAULT_TARGET, Target, get_target
from ..config import debug, settings
from ..errors import ArgumentError, IRError
from ..frontend.spec import ModelSpec
from ..frontend.to_ir import spec_to_module
from ..ir.core import Module
from ..ir.printer import print_module
from ..ir.verifier import verify as verify_module
from .registry import PassContext, check_invariant, get_pass, registered_passes
from .shard import check_divisible, make_layout

# Pipelines are plain lists of pass names; a pipeline name may appear inside another list and is expanded.
# DESIGN order: lowering passes, fusion, codegen (impl marks), cleanup; mxfp4 precedes moe-lower and codegen, which
# read the formats it sets.
PIPELINES: dict[str, tuple[str, ...]] = {
    "default": ("kda-chunk", "fuse-residual-norm", "mla-absorb", "attnres-split", "mxfp4", "moe-lower", "codegen",
                "dce", "cse"),
    "cleanup": ("cse", "dce"),
    "none": (),
}
STAGE_NAMES = ("frontend",)     # names of pipeline stages that are not passes (skipped when resolving)


def register_pipeline(name: str, passes: Sequence[str]) -> None:
    PIPELINES[name] = tuple(passes)


@dataclass(frozen=True)
class PassRecord:
    index: int                     # dump number: 1 for the first pass
    name: str
    seconds: float
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)
    dump: str | None = None        # path of the dump written after the pass

    def header(self) -> list[str]:
        rewrites = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "none"
        return [f"k3c IR dump {self.index:03d}: after pass '{self.name}'",
                f"time: {self.seconds * 1e3:.3f} ms", f"changed: {'yes' if self.changed else 'no'}",
                f"rewrites: {rewrites}"]


def resolve_passes(passes: str | Iterable[str]) -> list[str]:
    """'dce,cse' | ['default'] | 'frontend,default' -> pass names, pipelines expanded, every name checked."""
    if isinstance(passes, str):
        passes = passes.split(",")
    out: list[str] = []

    def add(name: str, depth: int) -> None:
        name = name.strip()
        if not name or name in STAGE_NAMES:
            return
        if name in PIPELINES:
            if depth > 8:
                raise ArgumentError(f"pipeline '{name}' nests too deeply (does it include itself?)")
            for p in PIPELINES[name]:
                add(p, depth + 1)
        else:
            try:
                get_pass(name)
            except ArgumentError as e:      # the valid pass names, and the pipelines a name may also be
                raise ArgumentError(f"{e}; pipelines: {', '.join(sorted(PIPELINES))}") from None
            out.append(name)

    for p in passes:
        if not isinstance(p, str):
            raise ArgumentError(f"pass names must be strings, got {p!r}")
        add(p, 0)
    return out


def _dump(dumps, index: int, name: str, module: Module, header: list[str]) -> str:
    """Write one dump into the staging folder of `dumps` (an outputs.Staging); returns its path once in place."""
    fname = f"{index:03d}_{name}.k3c"
    with open(os.path.join(dumps.dir, fname), "w", encoding="utf-8") as f:
        f.write(print_module(module, header=header))
    return os.path.join(dumps.path, fname)


def _located(e: IRError, pass_name: str) -> IRError:
    return IRError(e.message, op=e.op, loc=e.loc, pass_name=pass_name)


def run_pipeline(module: Module, passes: str | Iterable[str], *, dump_dir: str | os.PathLike | None = None,
                 verify: bool = True, input_name: str = "frontend",
                 stages: list | None = None,
                 target: Target | str | None = None) -> tuple[Module, list[PassRecord]]:
    """Run `passes` in order; return the final module and one PassRecord per pass.

    `target` (a Target or a target name; None = the default compile target) is every pass's `ctx.target`: the
    passes that choose tiles or plans read it. It is named in the header of dump 000.

    With `verify`, the input and every pass output go through the verifier, plus the invariants each pass
    ensures. Dead ops are tolerated only while the input had some and no pass ensuring no-dead-ops (dce) has
    run yet: a pass may not create dead code, but is not blamed for what it was given. Any failure is an
    IRError naming the pass and the op.
    With `stages` (a list), appends (stage name, module) for the input and after every pass.
    With `dump_dir`, writes 000_<input_name>.k3c and NNN_<pass>.k3c, each before verification, so a broken
    IR is on disk to inspect. The dump directory follows k3c's output policy (k3c/outputs.py): it must be new,
    empty or an earlier dump directory (never a file, a symlink or a directory holding other files); the dumps
    are written into a staging folder beside it and put in place when the pipeline ends, failed or not."""
    names = resolve_passes(passes)
    tgt = get_target(target) if isinstance(target, str) else target
    if tgt is not None and not isinstance(tgt, Target):
        raise ArgumentError(f"target must be a Target or a target name, got {target!r}")
    dumps = None
    if dump_dir is not None:
        from ..outputs import DUMP, Staging

        dumps = Staging(dump_dir, kind=DUMP, what="--dump-ir")
    try:
        if dumps is not None:
            _dump(dumps, 0, input_name, module, [f"k3c IR dump 000: {input_name} (pipeline input)",
                                                 f"pipeline: {', '.join(names) or 'none'}",
                                                 f"target: {tgt.name if tgt is not None else DEFAULT_TARGET}"
                                                 + ("" if tgt is not None else " (default)")])
        result = _run_passes(module, names, tgt, dumps, verify=verify, input_name=input_name, stages=stages)
    except BaseException:
        if dumps is not None:           # the IR up to the failing pass is on disk to inspect
            try:
                dumps.commit()
            except ArgumentError:
                dumps.abort()
        raise
    if dumps is not None:
        try:
            dumps.commit()
        finally:
            if not dumps.done:
                dumps.abort()
    return result


def _run_passes(module: Module, names: list[str], tgt: Target | None, dumps, *, verify: bool, input_name: str,
                stages: list | None) -> tuple[Module, list[PassRecord]]:
    allow_dead = False
    if verify:
        try:
            verify_module(module, allow_dead=True)
        except IRError as e:
            raise _located(e, input_name) from None
        allow_dead = check_invariant("no-dead-ops", module) is not None
    records: list[PassRecord] = []
    if stages is not None:
        stages.append((input_name, module))
    for index, name in enumerate(names, 1):
        info = get_pass(name)
        ctx = PassContext(name, tgt)
        start = time.perf_counter()
        try:
            out = info.fn(module, ctx)
        except IRError as e:
            op = e.op or (ctx.current_op.describe() if ctx.current_op else None)
            loc = e.loc or (ctx.current_op.loc if ctx.current_op else None)
            raise IRError(e.message, op=op, loc=loc, pass_name=name) from e
        except Exception as e:  # a bug in the pass: report where it was working
            cur = ctx.current_op
            raise IRError(f"{type(e).__name__}: {e}", op=cur.describe() if cur else None,
                          loc=(cur.loc or None) if cur else None, pass_name=name) from e
        seconds = time.perf_counter() - start
        if not isinstance(out, Module):
            raise IRError(f"returned {type(out).__name__}, not a Module", pass_name=name)
        record = PassRecord(index, name, seconds, out != module, dict(ctx.counts))
        if dumps is not None:
            record = dataclasses.replace(record, dump=_dump(dumps, index, name, out, record.header()))
        if verify:
            allow_dead = allow_dead and "no-dead-ops" not in info.ensures
            try:
                verify_module(out, allow_dead=allow_dead)
                for inv in info.ensures:
                    problem = check_invariant(inv, out)
                    if problem is not None:
                        raise problem
            except IRError as e:
                raise _located(e, name) from None
        records.append(record)
        debug(1, f"pass {index:03d} {name}: {seconds * 1e3:.2f} ms, changed={record.changed}, "
                 f"counts={dict(sorted(record.counts.items()))}")
        if settings().debug >= 3:
            debug(3, f"IR after '{name}':\n{print_module(out)}")
        module = out
        if stages is not None:
            stages.append((name, module))
    return module, records


def run_pass(module: Module, name: str, *, verify: bool = True,
             target: Target | str | None = None) -> tuple[Module, PassRecord]:
    """One pass through the pipeline machinery (verification included)."""
    out, records = run_pipeline(module, [name], verify=verify, target=target)
    return out, records[0]


def lower(spec: ModelSpec, target: Target | str | None = None, passes: str | Iterable[str] = "default", *,
          tp: int = 1, ep: int | None = None, rank: int = 0, seq_parallel: bool = True,
          dump_dir: str | os.PathLike | None = None,
          stages: list | None = None) -> tuple[Module, list[PassRecord]]:
    """The spec's IR (k3c.frontend.to_ir) through `passes` for `target`, as run_pipeline: (module, records).

    tp / ep / rank: rank `rank`'s slice for tensor parallel tp x expert parallel ep (ep None = tp; the ranks are
    max(tp, ep)): the module carries the layout as attrs, the split counts are checked before any pass runs, and
    the `shard` pass runs first unless `passes` names it. seq_parallel: with tp > 1, the residual stream and
    AttnRes blocks hold T/tp tokens per rank during prefill."""
    layout = make_layout(tp, tp if ep is None else ep, rank)
    module = spec_to_module(spec)
    names = passes.split(",") if isinstance(passes, str) else list(passes)
    if layout.world > 1:
        module = module.replace(attrs={**module.attr_dict, "tp": layout.tp, "ep": layout.ep, "rank": layout.rank,
                                       "seq_parallel": bool(seq_parallel)})
        check_divisible(module, layout)           # bad --tp / --ep: a clear error before any pass runs
        if "shard" not in resolve_passes(names):
            names = ["shard"] + names
    return run_pipeline(module, names, dump_dir=dump_dir, stages=stages, target=target)


def available() -> dict[str, list[str]]:
    """Valid names, for CLI help: {'passes': [...], 'pipelines': [...]}."""
    return {"passes": sorted(registered_passes()), "pipelines": sorted(PIPELINES)}
