"""The public Python API (DESIGN.md): compile a spec, read the IR after each pass, save and load artifacts."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass, field

from . import __version__
from .codegen.targets import Target, get_target
from .errors import ArgumentError, UserError
from .frontend import ModelSpec, dump_spec_yaml, load_spec, parse_spec_text
from .ir import Module, parse_module, print_module

ARTIFACT_FORMAT = "k3c-artifact/1"


@dataclass
class CompiledModel:
    """A spec lowered for a target: the final IR, every intermediate stage, and the pass records."""

    spec: ModelSpec
    target: Target
    module: Module
    stages: list[tuple[str, Module]] = field(default_factory=list)   # ("frontend", m0), ("dce", m1), ...
    records: list = field(default_factory=list)                      # PassRecord per pass run

    @property
    def pass_names(self) -> list[str]:
        return [name for name, _ in self.stages[1:]]

    def module_after(self, after: str | None = None) -> Module:
        """The IR after the named pass (`frontend` for the first stage; None for the final module)."""
        if after is None:
            return self.module
        for name, module in reversed(self.stages):
            if name == after:
                return module
        valid = ", ".join(name for name, _ in self.stages)
        raise ArgumentError(f"no stage named '{after}' in this compilation; stages: {valid}")

    def ir(self, after: str | None = None) -> str:
        """Printed IR after a pass (default: the final IR)."""
        return print_module(self.module_after(after))

    @property
    def cache_key(self) -> str:
        """Content address: hash of (k3c version, printed IR, target, pipeline)."""
        h = hashlib.sha256()
        for part in (__version__, print_module(self.module), json.dumps(asdict(self.target), sort_keys=True),
                     ",".join(self.pass_names)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def manifest(self) -> dict:
        import torch

        from importlib.metadata import PackageNotFoundError, version

        try:  # not `import triton`: importing it here, outside the interpreter, would break CPU kernel runs later
            triton_version = version("triton")
        except PackageNotFoundError:  # pragma: no cover - triton is a dependency
            triton_version = None
        op_counts: dict[str, int] = {}
        for op in self.module.ops:
            op_counts[op.op] = op_counts.get(op.op, 0) + 1
        return {
            "format": ARTIFACT_FORMAT,
            "model": self.spec.name,
            "target": asdict(self.target),
            "passes": self.pass_names,
            "cache_key": self.cache_key,
            "op_counts": dict(sorted(op_counts.items())),
            "kernels": [],          # filled by codegen (issue: codegen and targets)
            "extern": [],
            "versions": {"k3c": __version__, "torch": torch.__version__, "triton": triton_version,
                         "python": platform.python_version()},
            "files": {"spec": "spec.yaml", "ir": "model.k3c", "stages": "ir/"},
        }

    def kernels(self) -> list:
        """The distinct generated kernels (KernelSource) of the final IR, specialised for the target."""
        from .codegen.emitters import emit_kernels

        return emit_kernels(self.module, self.target)

    def compile_kernels(self, out_dir: str, *, progress: bool = True) -> list:
        """AOT-compile every generated kernel for the target into out_dir (none for the cpu target, whose
        kernels run in the Triton interpreter)."""
        if self.target.backend == "cpu":
            return []
        from .codegen.aot import compile_kernels

        return compile_kernels(self.kernels(), self.target, out_dir, progress=progress)

    def extern_ops(self) -> list[dict]:
        """Ops the runtime executes through torch (impl extern / extern:reference), counted per kind."""
        counts: dict[tuple[str, str], int] = {}
        for op in self.module.ops:
            impl = op.attr("impl", None)
            if impl is not None and impl != "kernel":
                counts[(op.op, impl)] = counts.get((op.op, impl), 0) + 1
        return [{"op": o, "impl": i, "count": n} for (o, i), n in sorted(counts.items())]

    def save(self, path: str | os.PathLike, *, overwrite: bool = False, keep: str | os.PathLike | None = None,
             aot: bool = True, progress: bool = True) -> str:
        """Write the artifact directory atomically: a temp dir beside it, renamed into place at the end.
        With `aot`, every generated kernel is compiled for the target (binaries, assembly, resources).
        `keep`: a directory inside `path` written by this compilation (the --dump-ir dumps) that is carried over."""
        path = os.path.abspath(os.fspath(path))
        kept = None
        if keep is not None:
            keep = os.path.abspath(os.fspath(keep))
            if os.path.dirname(keep) == path and os.path.isdir(keep):
                kept = os.path.basename(keep)
        if os.path.exists(path):
            if not os.path.isdir(path):
                raise ArgumentError(f"{path} exists and is not a directory")
            ours = _is_artifact(path) or set(os.listdir(path)) <= ({kept} if kept else set())
            if not overwrite and not ours:
                raise ArgumentError(f"{path} exists and is not a k3c artifact; choose another -o or pass --force")
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".k3c-tmp-", dir=parent)
        except OSError as exc:
            raise ArgumentError(f"cannot create {path}: {exc.strerror}") from None
        try:
            os.makedirs(os.path.join(tmp, "ir"))
            _write(tmp, "spec.yaml", dump_spec_yaml(self.spec))
            _write(tmp, "model.k3c", print_module(self.module))
            for i, (name, module) in enumerate(self.stages):
                _write(tmp, os.path.join("ir", f"{i:03d}_{name}.k3c"), print_module(module))
            compiled = self.compile_kernels(tmp, progress=progress) if aot else None
            manifest = self.manifest()
            if compiled is not None:
                manifest["kernels"] = [k.to_dict() for k in compiled]
            manifest["extern"] = self.extern_ops()
            _write(tmp, "manifest.json", json.dumps(manifest, indent=2) + "\n")
            _write(tmp, "report.md", self.report(compiled))
            if kept:
                os.replace(os.path.join(path, kept), os.path.join(tmp, kept))
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def report(self, compiled: list | None = None) -> str:
        lines = [f"# k3c artifact: {self.spec.name} for {self.target.name}", "",
                 f"- layers: {self.spec.num_layers} ({self.spec.layer_kinds.count('kda')} KDA, "
                 f"{self.spec.layer_kinds.count('mla')} MLA)",
                 f"- passes: {', '.join(self.pass_names) or '(none)'}",
                 f"- ops after the last pass: {len(self.module.ops)}", "", "| pass | time (ms) | changed |",
                 "|---|---|---|"]
        for rec in self.records:
            lines.append(f"| {rec.name} | {rec.seconds * 1e3:.1f} | {'yes' if rec.changed else 'no'} |")
        lines += ["", "## Ops executed through torch", "", "| op | impl | count |", "|---|---|---|"]
        lines += [f"| {e['op']} | {e['impl']} | {e['count']} |" for e in self.extern_ops()]
        lines += ["", "## Generated kernels", ""]
        if compiled:
            from .codegen.aot import report_markdown

            lines.append(report_markdown(compiled, self.target))
        elif self.target.backend == "cpu":
            lines.append("Target cpu: kernels run in the Triton interpreter; nothing is compiled ahead of time.")
        else:
            lines.append("Not compiled ahead of time (save(aot=False)).")
        return "\n".join(lines) + "\n"

    def session(self, weights, *, device: str = "cpu", max_batch: int = 8, max_context: int | None = None,
                use_kernels: bool = True):
        """A runtime session over this compiled graph (prefill / decode with caches). Ops marked impl="kernel"
        launch their generated Triton kernels (through the interpreter on a CPU) unless use_kernels=False."""
        from .runtime.session import Session

        return Session(self, weights, device=device, max_batch=max_batch, max_context=max_context,
                       use_kernels=use_kernels)


def _write(root: str, rel: str, text: str) -> None:
    with open(os.path.join(root, rel), "w", encoding="utf-8") as fh:
        fh.write(text)


def _is_artifact(path: str) -> bool:
    try:
        with open(os.path.join(path, "manifest.json"), encoding="utf-8") as fh:
            return json.load(fh).get("format") == ARTIFACT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def compile(spec, target: str = "mi355x", *, passes: list[str] | None = None,  # noqa: A001 (public API name)
            dump_ir: str | os.PathLike | None = None, tp: int = 1, ep: int | None = None,
            rank: int = 0, seq_parallel: bool = True) -> CompiledModel:
    """Run the pass pipeline on a spec (a ModelSpec or a path) for a target.

    tp / ep / rank: compile rank `rank`'s slice for tensor parallel tp x expert parallel ep (ep None = tp; the
    ranks are max(tp, ep)): the `shard` pass runs first (docs/distributed.md). seq_parallel: with tp > 1, the
    residual stream and AttnRes blocks hold T/tp tokens per rank during prefill (reduce-scatter / all-gather
    instead of all-reduce)."""
    from .frontend.to_ir import spec_to_module
    from .passes.pipeline import resolve_passes, run_pipeline
    from .passes.shard import check_divisible, make_layout

    tgt = get_target(target) if isinstance(target, str) else target
    layout = make_layout(tp, tp if ep is None else ep, rank)
    if not isinstance(spec, ModelSpec):
        spec = load_spec(spec)
    module = spec_to_module(spec)
    names = list(passes) if passes is not None else ["default"]
    if layout.world > 1:
        module = module.replace(attrs={**module.attr_dict, "tp": layout.tp, "ep": layout.ep, "rank": layout.rank,
                                       "seq_parallel": bool(seq_parallel)})
        check_divisible(module, layout)           # bad --tp / --ep: a clear error before any pass runs
        if "shard" not in resolve_passes(names):
            names = ["shard"] + names
    stages: list = []
    final, records = run_pipeline(module, names, dump_dir=dump_ir, stages=stages)
    return CompiledModel(spec=spec, target=tgt, module=final, stages=stages, records=records)


def load(path: str | os.PathLike) -> CompiledModel:
    """Read an artifact directory written by CompiledModel.save."""
    path = os.fspath(path)
    if not _is_artifact(path):
        raise UserError(f"{path}: not a k3c artifact directory (no manifest.json of format {ARTIFACT_FORMAT})")
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    spec_path = os.path.join(path, "spec.yaml")
    with open(spec_path, encoding="utf-8") as fh:
        spec = parse_spec_text(fh.read(), spec_path)
    stage_dir = os.path.join(path, "ir")
    stages = []
    for fname in sorted(os.listdir(stage_dir)):
        if fname.endswith(".k3c"):
            with open(os.path.join(stage_dir, fname), encoding="utf-8") as fh:
                stages.append((fname[4:-4], parse_module(fh.read(), os.path.join(stage_dir, fname))))
    with open(os.path.join(path, "model.k3c"), encoding="utf-8") as fh:
        module = parse_module(fh.read(), os.path.join(path, "model.k3c"))
    return CompiledModel(spec=spec, target=get_target(manifest["target"]["name"]), module=module, stages=stages)
