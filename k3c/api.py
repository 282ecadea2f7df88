"""The public Python API (DESIGN.md): compile a spec, read the IR after each pass, save and load artifacts."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

from . import __version__
from .codegen.targets import Target, get_target
from .codegen.tiers import buildable_target
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
    run_dtypes: tuple[str, ...] = ("bf16",)  # activation dtypes the artifact holds kernels for (bf16, f32)
    artifact_dir: str | None = None          # the artifact this model was saved to or loaded from
    compiled_kernels: list | None = None     # its CompiledKernels (the catalogue the runtime launches from)
    tokenizer_dir: str | None = None         # where its tokenizer.json is: the model directory or the artifact

    @cached_property
    def tokenizer(self):
        """The model's tokenizer (k3c.runtime.text.Tokenizer), read on first use; None when it has none: a model
        compiled from a Hugging Face model directory with a tokenizer.json, or an artifact saved from one, has one."""
        if self.tokenizer_dir is None:
            return None
        from .runtime.text import load_tokenizer

        return load_tokenizer(self.tokenizer_dir, vocab_size=self.spec.vocab_size)

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
        """Content address: hash of (k3c version, printed IR, target, pipeline). The IR is printed without its
        `loc` strings (the spec's path and line numbers): a spec renamed, moved or reformatted keeps its key."""
        h = hashlib.sha256()
        bare = self.module.replace(ops=tuple(op.replace(loc="") if op.loc else op for op in self.module.ops))
        for part in (__version__, print_module(bare), json.dumps(asdict(self.target), sort_keys=True),
                     ",".join(self.pass_names), ",".join(self.run_dtypes)):
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
            "run_dtypes": list(self.run_dtypes),
            "cache_key": self.cache_key,
            "op_counts": dict(sorted(op_counts.items())),
            "kernels": [],          # filled by codegen (issue: codegen and targets)
            "extern": [],
            "versions": {"k3c": __version__, "torch": torch.__version__, "triton": triton_version,
                         "python": platform.python_version()},
            "files": {"spec": "spec.yaml", "ir": "model.k3c", "stages": "ir/"},
        }

    def kernels(self) -> list:
        """The kernel catalogue: every generated kernel (KernelSource) the runtime can launch for the final IR on the
        target, for each of `run_dtypes`, every shape class."""
        from .codegen.catalogue import catalogue_kernels

        return catalogue_kernels(self.module, self.target, self.run_dtypes)

    def compile_kernels(self, out_dir: str, *, progress: bool = True, keep_asm: bool = True) -> list:
        """AOT-compile every generated kernel for the target into out_dir (none for the cpu target, whose
        kernels run in the Triton interpreter)."""
        if self.target.backend == "cpu":
            return []
        from .codegen.aot import compile_kernels

        return compile_kernels(self.kernels(), self.target, out_dir, progress=progress, keep_asm=keep_asm)

    def extern_ops(self) -> list[dict]:
        """Ops the runtime executes through torch (impl extern / extern:reference), counted per kind."""
        counts: dict[tuple[str, str], int] = {}
        for op in self.module.ops:
            impl = op.attr("impl", None)
            if impl is not None and impl != "kernel":
                counts[(op.op, impl)] = counts.get((op.op, impl), 0) + 1
        return [{"op": o, "impl": i, "count": n} for (o, i), n in sorted(counts.items())]

    def save(self, path: str | os.PathLike, *, overwrite: bool = False, keep: str | os.PathLike | None = None,
             aot: bool = True, progress: bool = True, keep_asm: bool = True, _replace_any: bool = False) -> str:
        """Write the artifact directory atomically under the output policy of k3c/outputs.py: the path is checked
        first (before any kernel is compiled), the artifact is written complete into a staging folder beside it
        and renamed into place; an existing artifact is replaced only with `overwrite` and only when it holds
        nothing k3c did not write. With `aot`, every generated kernel is compiled for the target (binaries,
        assembly unless keep_asm=False, resources).
        `keep`: a directory inside `path` written by this compilation (the --dump-ir dumps) that is carried over
        (and listed in the manifest's sha256 like every file)."""
        from .outputs import ARTIFACT, Staging, is_dump_dir

        keep = os.path.abspath(os.fspath(keep)) if keep is not None else None
        with Staging(path, overwrite=overwrite, kind=ARTIFACT, what="-o", keep=keep,
                     replace_any=_replace_any) as staging:
            path, tmp = staging.path, staging.dir
            kept = os.path.basename(keep) if keep and os.path.dirname(keep) == path and is_dump_dir(keep) else None
            os.makedirs(os.path.join(tmp, "ir"))
            _write(tmp, "spec.yaml", dump_spec_yaml(self.spec))
            _write(tmp, "model.k3c", print_module(self.module))
            for i, (name, module) in enumerate(self.stages):
                _write(tmp, os.path.join("ir", f"{i:03d}_{name}.k3c"), print_module(module))
            compiled = self.compile_kernels(tmp, progress=progress, keep_asm=keep_asm) if aot else None
            manifest = self.manifest()
            tokenizer = self._copy_tokenizer(tmp)
            if tokenizer:
                manifest["files"]["tokenizer"] = tokenizer
            if compiled is not None:
                manifest["kernels"] = [k.to_dict() for k in compiled]
            manifest["extern"] = self.extern_ops()
            _write(tmp, "report.md", self.report(compiled))
            if kept:
                os.rename(os.path.join(path, kept), os.path.join(tmp, kept))
            try:
                manifest["sha256"] = _tree_sha256(tmp)       # every file the artifact holds, checked by load()
                _write(tmp, "manifest.json", json.dumps(manifest, indent=2) + "\n")
                staging.commit()
            except BaseException:
                if kept:                # the dumps go back where they were
                    try:
                        os.rename(os.path.join(tmp, kept), os.path.join(path, kept))
                    except OSError:
                        pass
                raise
        if compiled is not None:
            self.artifact_dir, self.compiled_kernels = path, compiled
        return path

    def _copy_tokenizer(self, root: str) -> str | None:
        """The tokenizer files copied into an artifact being written (checked first: a tokenizer that does not
        load or fit the vocabulary is not shipped); the tokenizer.json's name in it, or None without one."""
        if self.tokenizer is None:
            return None
        from .runtime.text import TOKENIZER_FILE, TOKENIZER_FILES

        for name in TOKENIZER_FILES:
            src = os.path.join(self.tokenizer_dir, name)
            if os.path.lexists(src):
                shutil.copyfile(src, os.path.join(root, name))
        return TOKENIZER_FILE

    def catalogue(self):
        """The runtime's view of this model's artifact: catalogue key -> CompiledKernel (None: no artifact yet)."""
        from .runtime.launcher import Catalogue

        if self.artifact_dir is None or self.compiled_kernels is None:
            return None
        return Catalogue(target=self.target, root=self.artifact_dir,
                         entries={ck.catalogue_key: ck for ck in self.compiled_kernels})

    def ensure_artifact(self, *, progress: bool = True) -> str:
        """The artifact directory, compiling one into the cache (K3C_CACHE_DIR/artifacts/<cache key>) when this
        model has none: a second process with the same spec, passes and target loads it instead of compiling."""
        if self.artifact_dir is not None and self.compiled_kernels is not None:
            return self.artifact_dir
        from .codegen.cache import open_cache
        from .config import settings

        if open_cache() is None:        # an unusable K3C_CACHE_DIR (warned): a private artifact for this process
            import atexit

            path = tempfile.mkdtemp(prefix="k3c-artifact-")
            atexit.register(shutil.rmtree, path, True)
            path = os.path.join(path, self.cache_key[:32])
        else:
            path = os.path.join(settings().cache_dir, "artifacts", self.cache_key[:32])
        if _is_valid_artifact(path):
            try:
                cached = load(path)
            except UserError:
                cached = None       # damaged: compiled again below
            if cached is not None and cached.cache_key == self.cache_key and cached.compiled_kernels:
                self.artifact_dir, self.compiled_kernels = cached.artifact_dir, cached.compiled_kernels
                return path
        from .codegen.aot import shutdown_workers

        try:
            self.save(path, overwrite=True, progress=progress, _replace_any=True)   # the cache's own directory
        finally:        # a runtime process compiles once: no idle compiler workers left holding its stdout
            shutdown_workers()
        return path

    def report(self, compiled: list | None = None) -> str:
        lines = [f"# k3c artifact: {self.spec.name} for {self.target.name}", "",
                 f"- layers: {self.spec.num_layers} ({self.spec.layer_kinds.count('kda')} KDA, "
                 f"{self.spec.layer_kinds.count('mla')} MLA)",
                 f"- passes: {', '.join(self.pass_names) or '(none)'}",
                 f"- ops after the last pass: {len(self.module.ops)}", "", "| pass | changed |",
                 "|---|---|"]
        for rec in self.records:
            lines.append(f"| {rec.name} | {'yes' if rec.changed else 'no'} |")      # times: K3C_DEBUG=1
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
                use_kernels: bool = True, kernel_policy: str = "artifact", kv_dtype: str = "auto"):
        """A runtime session over this compiled graph (prefill / decode with caches). Ops marked impl="kernel"
        launch their generated Triton kernels unless use_kernels=False: on a GPU the artifact's binaries (one is
        compiled into the cache if this model has none; kernel_policy: runtime.session.bind_kernels), on a CPU
        through the interpreter. kv_dtype: the MLA latent cache's format, "auto" (the activation dtype) or "fp8"
        (e4m3 with per-token scales; runtime/caches/latent_format.py)."""
        from .runtime.session import Session

        return Session(self, weights, device=device, max_batch=max_batch, max_context=max_context,
                       use_kernels=use_kernels, kernel_policy=kernel_policy, kv_dtype=kv_dtype)


def _write(root: str, rel: str, text: str) -> None:
    with open(os.path.join(root, rel), "w", encoding="utf-8") as fh:
        fh.write(text)


def _tree_sha256(root: str) -> dict[str, str]:
    from .codegen.aot import file_sha256

    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for fname in files:
            full = os.path.join(dirpath, fname)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel != "manifest.json":
                out[rel] = file_sha256(full)
    return dict(sorted(out.items()))


def _inside(rel) -> bool:
    """A path a manifest may name: relative, '/'-separated, no '', '.' or '..' part (nothing outside the artifact)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    return bool(parts) and not os.path.isabs(rel) and "\\" not in rel and "\0" not in rel \
        and not any(p in ("", ".", "..") for p in parts)


def _check_file_entries(path: str, manifest: dict, listed: dict[str, str], kernels) -> None:
    """The paths the manifest names besides its sha256 list: `files` (what each part of the artifact is called: a
    file, or a directory written with a trailing '/') and every kernel's files. Each must be inside the artifact and
    one of its listed files (or, for a directory, hold one), like the sha256 list's own entries."""
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        raise UserError(f"{path}/manifest.json: 'files' must be an object naming the artifact's parts")
    named = [(f"files.{k}"[:80], v) for k, v in files.items()]
    named += [(f"kernel {ck.name}"[:120], rel) for ck in kernels for rel in
              (ck.files.values() if isinstance(ck.files, dict) else [ck.files])]
    for where, rel in named:
        is_dir = isinstance(rel, str) and rel.endswith("/")
        if not _inside(rel[:-1] if is_dir else rel):
            raise UserError(f"{path}/manifest.json: {where} names {str(rel)[:200]!r}, which is outside the artifact")
        if not (any(r.startswith(rel) for r in listed) if is_dir else rel in listed):
            raise UserError(f"{path}/manifest.json: {where} names {rel[:200]!r}, which is not a file of the artifact "
                            f"(not in its sha256 list)")


def _verify_files(path: str, manifest: dict) -> dict[str, str]:
    """Every file the manifest lists exists, is a regular file (no symlink anywhere in the artifact) and has its
    sha256; no file the manifest does not list is there (IR dump directories excepted: k3c's, never read).
    Returns the listed files (relative path -> sha256): nothing in an artifact is used unchecked."""
    import stat

    from .codegen.aot import file_sha256
    from .outputs import _STAGING, is_dump_dir

    listed = manifest.get("sha256")
    if not isinstance(listed, dict) or not listed:
        raise UserError(f"{path}/manifest.json: no 'sha256' file list (written by an older k3c?); recompile the "
                        f"artifact")
    for rel, digest in listed.items():
        if not _inside(rel) or not isinstance(digest, str):
            raise UserError(f"{path}/manifest.json: file entry {str(rel)[:200]!r} is outside the artifact")
    for dirpath, dirs, files in os.walk(path):          # what is there: regular files and directories only
        rel_dir = os.path.relpath(dirpath, path).replace(os.sep, "/")
        for name in sorted(dirs + files):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                raise UserError(f"{path}/{rel}: is a symlink; an artifact holds regular files only (recompile it)")
            if stat.S_ISDIR(mode):
                if rel_dir == "." and name != "ir" and (is_dump_dir(full) or _STAGING.match(name)) \
                        and not any(r.startswith(name + "/") for r in listed):
                    dirs.remove(name)                   # --dump-ir dumps written into -o: never read
                continue
            if not stat.S_ISREG(mode):
                raise UserError(f"{path}/{rel}: is not a regular file; an artifact holds regular files only")
            if rel != "manifest.json" and rel not in listed:
                raise UserError(f"{path}/{rel}: not listed in manifest.json (k3c did not write it); remove it or "
                                f"recompile the artifact")
    for rel, digest in listed.items():
        full = os.path.join(path, *rel.split("/"))
        try:
            mode = os.lstat(full).st_mode
        except OSError:
            mode = None
        if mode is None or not stat.S_ISREG(mode):
            raise UserError(f"{path}/{rel}: missing (listed in manifest.json); recompile the artifact")
        if file_sha256(full) != digest:
            raise UserError(f"{path}/{rel}: sha256 does not match manifest.json (the artifact was changed after "
                            f"it was written); recompile it")
    for required in ("spec.yaml", "model.k3c"):
        if required not in listed:
            raise UserError(f"{path}/{required}: missing (not in manifest.json); recompile the artifact")
    if not any(rel.startswith("ir/") for rel in listed):
        raise UserError(f"{path}/ir/: missing (no stage in manifest.json); recompile the artifact")
    return listed


def _read_manifest(path: str):
    """The artifact's manifest.json (a regular file, bounded, JSON); None when there is none."""
    from .outputs import read_json

    try:
        return read_json(os.path.join(path, "manifest.json"))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_valid_artifact(path: str) -> bool:
    """A directory whose manifest reads as a k3c artifact's (commands/run.py's `_is_artifact` only asks whether there
    is a manifest to read: load then says what is wrong with it)."""
    try:
        manifest = _read_manifest(path)
    except UserError:
        return False
    return isinstance(manifest, dict) and manifest.get("format") == ARTIFACT_FORMAT


def _read_text(path: str, rel: str) -> str:
    try:
        with open(os.path.join(path, *rel.split("/")), "rb") as fh:
            return fh.read().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}/{rel}: not UTF-8 text") from None


def _verified(module: Module, path: str, rel: str) -> Module:
    from .errors import IRError
    from .ir.verifier import verify

    try:
        verify(module, allow_dead=True)
    except IRError as exc:
        raise UserError(f"{path}/{rel}: the IR does not verify: {exc}") from None
    return module


def compile(spec, target: str | Target = "mi355x", *, passes: list[str] | None = None,  # noqa: A001 (public API)
            dump_ir: str | os.PathLike | None = None, tp: int = 1, ep: int | None = None,
            rank: int = 0, seq_parallel: bool = True, run_dtypes=("bf16",)) -> CompiledModel:
    """Run the pass pipeline on a spec (a ModelSpec or a path) for a target (a name or a Target): every pass gets
    it as `ctx.target`, so its tile and plan choices are the target's.

    run_dtypes: the activation dtypes the artifact holds kernels for ("bfloat16" and/or "float32"; the IR is
    bf16, a session with float32 weights launches the fp32 variants).
    tp / ep / rank: compile rank `rank`'s slice for tensor parallel tp x expert parallel ep (ep None = tp; the
    ranks are max(tp, ep)): the `shard` pass runs first (docs/distributed.md). seq_parallel: with tp > 1, the
    residual stream and AttnRes blocks hold T/tp tokens per rank during prefill (reduce-scatter / all-gather
    instead of all-reduce)."""
    from .passes.pipeline import lower

    tgt = buildable_target(get_target(target) if isinstance(target, str) else target)
    if not isinstance(spec, ModelSpec):
        spec = load_spec(spec)
    stages: list = []
    final, records = lower(spec, tgt, list(passes) if passes is not None else ["default"], tp=tp, ep=ep, rank=rank,
                           seq_parallel=seq_parallel, dump_dir=dump_ir, stages=stages)
    return CompiledModel(spec=spec, target=tgt, module=final, stages=stages, records=records,
                         run_dtypes=_run_dtypes(run_dtypes), tokenizer_dir=_model_dir_tokenizer(spec))


def _model_dir_tokenizer(spec: ModelSpec) -> str | None:
    """The directory of the config.json a spec was read from, when it holds a tokenizer.json (a Hugging Face
    model directory); None for YAML specs and specs built in code."""
    from .runtime.text import has_tokenizer

    if os.path.basename(spec.source) != "config.json":
        return None
    directory = os.path.dirname(os.path.abspath(spec.source))
    return directory if has_tokenizer(directory) else None


def _run_dtypes(dtypes) -> tuple[str, ...]:
    """("bf16",) / ("bf16", "f32") from names as users write them (bfloat16, float32, bf16, fp32, f32)."""
    if isinstance(dtypes, str):
        dtypes = [d.strip() for d in dtypes.split(",") if d.strip()]
    from .codegen.catalogue import RUN_DTYPES
    from .ir.core import DTYPE_SPELLINGS

    out = []
    for d in dtypes:
        ir = DTYPE_SPELLINGS.get(d) if isinstance(d, str) else None
        if ir not in RUN_DTYPES:
            raise ArgumentError(f"run dtype {d!r}: choose from bfloat16, float32")
        if ir not in out:
            out.append(ir)
    if not out:
        raise ArgumentError("run dtypes: name at least one of bfloat16, float32")
    return tuple(out)


def load(path: str | os.PathLike) -> CompiledModel:
    """Read an artifact directory written by CompiledModel.save: every file checked (sha256, regular, listed), the
    IR verified. An artifact replaced while it is read (a recompile with --force) is read again: the result is the
    old or the new one, complete."""
    import time

    from .outputs import identity, swap_in_progress

    path = os.fspath(path)
    if os.path.islink(path):
        # a link to an artifact (a `latest` pointing at a build) is followed once, here: the model reads the
        # directory it resolved to from now on (its kernel binaries too), so moving the link never mixes two
        # artifacts. Inside the artifact nothing may be a symlink (_verify_files).
        path = os.path.realpath(path)
    for attempt in range(8):
        before = identity(path)
        try:
            model = _load(path)
        except (UserError, OSError) as exc:
            after = identity(path)
            if attempt < 7 and (after != before or (after is None and swap_in_progress(path))):
                time.sleep(0.02 * (attempt + 1))        # replaced under us (or mid-swap): read it again
                continue
            if isinstance(exc, UserError):
                raise
            raise UserError(f"{exc.filename or path}: cannot read ({exc.strerror or exc})") from None
        if identity(path) == before or attempt == 7:
            return model
        time.sleep(0.02 * (attempt + 1))
    raise UserError(f"{path}: replaced repeatedly while being read")  # pragma: no cover


def _load(path: str) -> CompiledModel:
    if os.path.islink(os.path.join(path, "manifest.json")):
        raise UserError(f"{path}/manifest.json: is a symlink; an artifact holds regular files only")
    manifest = _read_manifest(path)
    if not isinstance(manifest, dict) or manifest.get("format") != ARTIFACT_FORMAT:
        raise UserError(f"{path}: not a k3c artifact directory (no manifest.json of format {ARTIFACT_FORMAT})")
    listed = _verify_files(path, manifest)
    target = _manifest_target(path, manifest)
    try:
        from .codegen.aot import CompiledKernel

        kernels = [CompiledKernel.from_dict(d) for d in manifest.get("kernels", [])]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{path}/manifest.json: a kernel entry does not parse ({exc})") from None
    for ck in kernels:
        if ck.target != target.name or not ck.catalogue_key:
            raise UserError(f"{path}/manifest.json: kernel {ck.name} is for target {ck.target!r} or has no "
                            f"catalogue key; recompile the artifact")
    _check_file_entries(path, manifest, listed, kernels)
    spec = parse_spec_text(_read_text(path, "spec.yaml"), os.path.join(path, "spec.yaml"))
    stages = []
    for rel in sorted(r for r in listed if r.startswith("ir/") and r.count("/") == 1 and r.endswith(".k3c")):
        fname = rel[3:]
        stages.append((fname[4:-4], _verified(parse_module(_read_text(path, rel), os.path.join(path, rel)),
                                              path, rel)))
    module = _verified(parse_module(_read_text(path, "model.k3c"), os.path.join(path, "model.k3c")), path,
                       "model.k3c")
    dtypes = manifest.get("run_dtypes", ["bf16"])
    if not isinstance(dtypes, list) or not dtypes or not all(d in ("bf16", "f32") for d in dtypes):
        raise UserError(f"{path}/manifest.json: run_dtypes {dtypes!r} must be a list of bf16 / f32")
    from .runtime.text import TOKENIZER_FILE

    return CompiledModel(spec=spec, target=target, module=module, stages=stages, run_dtypes=tuple(dtypes),
                         artifact_dir=os.path.abspath(path) if kernels or target.backend == "cpu" else None,
                         compiled_kernels=kernels if kernels or target.backend == "cpu" else None,
                         tokenizer_dir=os.path.abspath(path) if TOKENIZER_FILE in listed else None)


def _manifest_target(path: str, manifest: dict) -> Target:
    """The artifact's Target: the table row of its name, which must equal the row it was compiled with, but for
    tiers its compiler could not build (tiers.buildable_target: the recorded tiers are a subset of the row's)."""
    recorded = manifest.get("target")
    name = recorded.get("name") if isinstance(recorded, dict) else None
    try:
        target = get_target(name)
    except (ArgumentError, TypeError):
        raise UserError(f"{path}/manifest.json: unknown target {name!r}") from None
    built = recorded.get("tiers") if isinstance(recorded, dict) else None
    if isinstance(built, list) and all(isinstance(t, str) for t in built) and set(built) <= set(target.tiers):
        target = replace(target, tiers=tuple(t for t in target.tiers if t in built))
    if json.loads(json.dumps(asdict(target))) != recorded:
        raise UserError(f"{path}/manifest.json: target '{name}' was compiled with another row of the target table "
                        f"than this k3c has (another version?); recompile the artifact")
    return target
