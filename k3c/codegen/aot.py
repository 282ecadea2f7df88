"""Ahead-of-time compilation of generated Triton kernels for a named target, on a machine without that GPU.

    compiled = compile_kernels(kernels, get_target("mi355x"), "out/k3-tiny")   # list[CompiledKernel]
    open("out/k3-tiny/report.md", "w").write(report_markdown(compiled, "mi355x"))

How it works (docs/targets.md has the long version):
  * every KernelSource is looked up in the content-addressed cache (k3c/codegen/cache.py); a hit copies the stored
    files into out_dir and compiles nothing;
  * misses are written as a .py module into a staging directory and compiled in worker processes (a "spawn"
    ProcessPoolExecutor, reused across calls). Workers start from an environment without TRITON_INTERPRET (the
    interpreter breaks triton.compile in-process, even when only set at import time) and with
    TRITON_DEFAULT_FP_FUSION set explicitly. Each worker runs triton.compile(ASTSource(fn, signature, constexprs,
    attrs), target=GPUTarget(...), options={num_warps, num_stages}), writes the binary, the assembly, the ttgir and
    triton's metadata JSON, and reads resource usage back (k3c/codegen/resources.py);
  * the staging directory is published into the cache with one rename, then copied into out_dir:
        out_dir/kernels/<name>.py   the source
        out_dir/<name>.hsaco + <name>.amdgcn      (hip)    out_dir/<name>.cubin + <name>.ptx    (cuda)
        out_dir/<name>.ttgir        (keep_ttgir)   out_dir/<name>.json   triton's full kernel metadata
    (the assembly and ttgir only with keep_asm: a deployment artifact needs the binary, its metadata and source)
Nothing in this module imports triton in the calling process.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, fields

from ..errors import ArgumentError, K3cError
from .cache import cache_key, open_cache
from .kernel import KernelSource
from .resources import KernelResources, kernel_resources
from .targets import Target, get_target

# Kernel-metadata fields a launcher needs to run a binary later (the full set is in <name>.json).
LAUNCH_METADATA_KEYS = (
    "name", "shared", "num_warps", "num_ctas", "num_stages", "warp_size", "global_scratch_size",
    "global_scratch_align", "profile_scratch_size", "profile_scratch_align", "tmem_size", "launch_cooperative_grid",
    "launch_pdl", "cluster_dims", "hash", "triton_version", "arch", "backend_name", "enable_fp_fusion",
)
BINARY_KINDS = {"hip": ("hsaco", "amdgcn"), "cuda": ("cubin", "ptx")}
_NAME = re.compile(r"^[A-Za-z_]\w*$")
_MAX_ERROR_LINES = 14


class KernelCompileError(K3cError):
    """A generated kernel triton could not compile: names the kernel, its IR op and spec location."""

    def __init__(self, message: str, *, kernel: str, ir_op: str = "", loc: str = "", target: str = "",
                 detail: str = "", failed: tuple[str, ...] = ()):
        self.kernel, self.ir_op, self.loc, self.target, self.detail = kernel, ir_op, loc, target, detail
        self.failed = failed or (kernel,)
        super().__init__(message)


@dataclass
class CompiledKernel:
    """One kernel compiled for one target: where its files are and what it takes to launch it."""

    name: str
    target: str                              # k3c target name (mi355x, h200, ...)
    backend: str                             # hip | cuda
    arch: str                                # gfx950, sm_90, ...
    files: dict[str, str]                    # kind -> path relative to out_dir: source, hsaco|cubin, amdgcn|ptx,
                                             #                                  ttgir, metadata
    signature: dict[str, str]                # runtime args (constexprs excluded), in KernelSource order
    constexprs: dict[str, int | float | bool]
    grid: tuple[str, ...]
    num_warps: int
    num_stages: int
    resources: KernelResources
    # how this build got the kernel: kept in memory for the compile's own report, never written into an artifact
    # (an artifact holds what was built, byte-identical whatever the cache held or how busy the host was)
    compile_seconds: float = field(default=0.0, compare=False)      # triton.compile wall time (also for cache hits)
    compile_cpu_seconds: float = field(default=0.0, compare=False)  # its CPU time (worker + ptxas): busy hosts
    ir_op: str = ""
    loc: str = ""
    metadata: dict = field(default_factory=dict)           # LAUNCH_METADATA_KEYS subset of triton's metadata
    divisible_by_16: tuple[str, ...] = ()    # pointer args compiled assuming 16-byte alignment (launcher checks)
    cache_hit: bool = field(default=False, compare=False)
    key: str = ""                            # cache key
    digest: str = ""                         # KernelSource.digest
    catalogue_key: str = ""                  # KernelSource.key: what the runtime looks its launches up by
    sha256: dict[str, str] = field(default_factory=dict)   # file path (relative to out_dir) -> sha256 hex
    tier: str = "portable"                   # KernelSource.tier (the Triton that built it: metadata triton_version)

    @property
    def entry(self) -> str:
        """Symbol of the kernel entry in the binary (hsaco: also `<entry>.kd`)."""
        return self.metadata.get("name", self.name)

    @property
    def shared(self) -> int:
        """Dynamic shared memory / LDS bytes to pass at launch."""
        return int(self.metadata.get("shared", 0))

    @property
    def binary(self) -> str:
        """Path of the binary (hsaco or cubin) relative to out_dir."""
        return self.files[BINARY_KINDS[self.backend][0]]

    def to_dict(self) -> dict:
        return {
            "name": self.name, "target": self.target, "backend": self.backend, "arch": self.arch,
            "files": dict(sorted(self.files.items())), "signature": dict(self.signature), "constexprs": dict(self.constexprs),
            "grid": list(self.grid), "num_warps": self.num_warps, "num_stages": self.num_stages,
            "resources": self.resources.to_dict(), "ir_op": self.ir_op,
            "loc": self.loc, "metadata": dict(sorted(self.metadata.items())), "divisible_by_16": list(self.divisible_by_16),
            "key": self.key, "digest": self.digest,
            "catalogue_key": self.catalogue_key, "sha256": dict(self.sha256), "tier": self.tier,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CompiledKernel":
        data = dict(data)
        data["resources"] = KernelResources.from_dict(data["resources"])
        data["grid"] = tuple(data["grid"])
        data["divisible_by_16"] = tuple(data.get("divisible_by_16", ()))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown kernel fields {', '.join(unknown)}")
        return cls(**data)


# ================================================================================================== public API
def compile_kernels(kernels: list[KernelSource], target: Target | str, out_dir: str, *, jobs: int | None = None,
                    progress: bool = True, cache: bool = True, keep_ttgir: bool = True, keep_asm: bool = True,
                    assume_aligned: bool = True, triton_options: dict | None = None) -> list[CompiledKernel]:
    """Compile `kernels` for `target` into `out_dir`; one CompiledKernel per kernel, in input order.

    jobs:           worker processes (default: the CPUs this process may use); only misses are compiled.
    progress:       tqdm bar on stderr (also off when stderr is not a TTY).
    cache:          use the content-addressed cache under settings().cache_dir (K3C_CACHE_DIR).
    keep_ttgir:     also write <name>.ttgir.
    keep_asm:       write the assembly (.ptx / .amdgcn) and, with keep_ttgir, the ttgir (False: about half the
                    bytes; resources are read during the compile either way).
    assume_aligned: compile pointer args with tt.divisibility=16 (what triton's JIT does for 16-byte-aligned
                    tensors; torch allocations are); recorded in CompiledKernel.divisible_by_16.
    triton_options: extra backend options for triton.compile (e.g. {"waves_per_eu": 2} on hip,
                    {"ptx_version": 87} on cuda); num_warps/num_stages always come from the KernelSource.
    TRITON_* variables of this process (say TRITON_PTXAS_BLACKWELL_PATH) reach the workers and the cache key.
    Raises KernelCompileError (a K3cError) naming the kernel, its IR op and loc when triton fails; the other
    kernels are still compiled and cached first.
    """
    if isinstance(target, str):
        target = get_target(target)
    if target.backend not in BINARY_KINDS:
        raise ArgumentError(f"target '{target.name}' ({target.backend}) has no AOT binaries; "
                            f"AOT targets: {', '.join(n for n, t in _targets().items() if t.backend in BINARY_KINDS)}")
    kernels = _unique(kernels)
    os.makedirs(os.path.join(out_dir, "kernels"), exist_ok=True)
    options = {"assume_aligned": bool(assume_aligned), "fp_fusion": _fp_fusion(), "keep_ttgir": bool(keep_ttgir),
               "triton_options": dict(triton_options or {}), "env": _triton_env()}
    store = open_cache() if cache else None         # None, with one warning line, when it cannot be used
    if store is not None:
        store.sweep()                                # staging left by killed compiles
    results: list[CompiledKernel | None] = [None] * len(kernels)
    keys = [cache_key(k.compile_digest, target, options) for k in kernels]

    bar = _progress_bar(len(kernels), f"k3c aot {target.name}", progress)
    try:
        misses = []
        for i, (kernel, key) in enumerate(zip(kernels, keys)):
            entry = store.fetch(key, out_dir) if store else None
            if entry is not None:
                results[i] = _from_entry(entry, kernel, target, key, hit=True)
                bar.update(1)
            else:
                misses.append(i)
        failures = []
        if misses:
            failures = _compile_misses(kernels, misses, keys, results, target, out_dir, store, options, jobs, bar)
    finally:
        bar.close()
    if failures:
        raise _compile_error(failures, target)
    out = [r for r in results if r is not None]
    _write_artifact_files(kernels, out, out_dir, target, keep_asm)
    return out


def _compile_misses(kernels: list[KernelSource], misses: list[int], keys: list[str],
                    results: list[CompiledKernel | None], target: Target, out_dir: str, store, options: dict,
                    jobs: int | None, bar) -> list[tuple[KernelSource, str]]:
    """Compile kernels[i] for every i in `misses` in the worker pool: each result is copied into out_dir,
    published into the cache and set in results[i]; returns the (kernel, error) pairs of those that failed. No
    worker and no staging directory outlives the call, whatever ends it."""
    jobs_info = [(i, *_stage(kernels[i], target, store, options)) for i in misses]
    failures: list[tuple[KernelSource, str]] = []
    futures = {}
    restore_signals = _exit_on_signals()
    try:
        executor = _executor(jobs)
        with _worker_environment():
            futures = {executor.submit(_compile_worker, job): (i, staging) for i, staging, job in jobs_info}
        for future in as_completed(futures):
            i, staging = futures[future]
            kernel = kernels[i]
            res = _worker_result(future)
            if not res.get("ok"):
                shutil.rmtree(staging, ignore_errors=True)
                source_path = os.path.join(out_dir, "kernels", f"{kernel.name}.py")
                with open(source_path, "w") as f:                  # keep the failing source to look at
                    f.write(kernel.source)
                failures.append((kernel, res.get("error", "unknown error") + f"\nsource: {source_path}"))
            else:
                results[i] = _publish(kernel, target, res, staging, out_dir, store, keys[i])
            bar.update(1)
    finally:
        if any(not f.done() for f in futures) or len(futures) < len(jobs_info):
            shutdown_workers(wait=False, kill=True)         # interrupted: no compile is left running
        for _i, staging, _job_ in jobs_info:                # published ones were renamed away already
            shutil.rmtree(staging, ignore_errors=True)
        restore_signals()
    return failures


def _stage(kernel: KernelSource, target: Target, store, options: dict) -> tuple[str, dict]:
    """A staging directory holding the kernel's compile source, and the worker job that compiles it there."""
    staging = store.new_staging_dir() if store else tempfile.mkdtemp(prefix="k3c-aot-")
    source_rel = f"kernels/{kernel.name}.py"
    os.makedirs(os.path.join(staging, "kernels"), exist_ok=True)
    with open(os.path.join(staging, source_rel), "w", encoding="utf-8") as f:
        f.write(kernel.compile_source)         # comments blanked: the binary is the code's alone
    return staging, _job(kernel, target, staging, source_rel, options)


def _worker_result(future) -> dict:
    """A worker's result dict; a dead worker or an exception becomes {"ok": False, "error": ...}."""
    try:
        return future.result()
    except BrokenProcessPool:
        return {"ok": False, "error": "the compiler worker process died (crash or out of memory) "
                                      "while compiling this kernel or one beside it"}
    except Exception as exc:  # noqa: BLE001 - reported per kernel by the caller
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _publish(kernel: KernelSource, target: Target, res: dict, staging: str, out_dir: str, store,
             key: str) -> CompiledKernel:
    """A compiled kernel's files copied from its staging directory into out_dir, then the directory published
    into the cache (or removed when it cannot be)."""
    entry = _entry_from_result(kernel, target, res)
    _copy_tree_files(staging, out_dir, entry["files"])     # the artifact never waits on the cache
    if store:
        try:
            store.publish(key, staging, entry)
        except OSError as exc:      # a cache dir that turned unwritable or hostile: not cached
            _warn_once(store.root, f"k3c: warning: cannot store kernels in the compile cache "
                                   f"{store.root} ({exc.strerror or exc}); they are not cached")
    shutil.rmtree(staging, ignore_errors=True)              # gone already once published
    return _from_entry(entry, kernel, target, key, hit=False)


def _write_artifact_files(kernels: list[KernelSource], compiled: list[CompiledKernel], out_dir: str,
                          target: Target, keep_asm: bool) -> None:
    """The kernels' sources as emitted (their headers name the spec locations; the compiled ones had comments
    blanked), the assembly and ttgir left out unless keep_asm, and each kernel's file digests."""
    for kernel in kernels:
        with open(os.path.join(out_dir, "kernels", f"{kernel.name}.py"), "w", encoding="utf-8") as f:
            f.write(kernel.source)
    for ck in compiled:
        if not keep_asm:        # compiled and cached with its assembly; the artifact leaves it out
            for kind in (BINARY_KINDS[target.backend][1], "ttgir"):
                rel = ck.files.pop(kind, None)
                if rel is not None:
                    os.unlink(os.path.join(out_dir, rel))
        ck.sha256 = {rel: file_sha256(os.path.join(out_dir, rel)) for rel in sorted(set(ck.files.values()))}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def report_markdown(compiled: list[CompiledKernel], target: Target | str) -> str:
    """report.md: one row per kernel (registers, LDS/shared, scratch/spills, occupancy, matrix instructions) and
    a summary line. Kernels that spill or use scratch are flagged."""
    if isinstance(target, str):
        target = get_target(target)
    amd = target.backend == "hip"
    shared_name = "LDS" if amd else "shared"
    lines = [f"# k3c AOT report: {target.name} ({target.backend} {target.arch}, warp {target.warp_size})", ""]
    header = ["kernel", "IR op", "warps/stages", "regs" + (" (VGPR/SGPR/AGPR)" if amd else "/thread"),
              f"{shared_name} bytes", "scratch / spills", "occupancy", "matrix instructions"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    flagged = []
    for ck in compiled:
        r = ck.resources
        spill = f"{r.scratch_bytes} B / {r.spill_count}"
        if getattr(r, "sgpr_lane_spills", 0):
            spill += f" (+{r.sgpr_lane_spills} SGPR to VGPR lane)"
        if r.has_spills:
            spill = f"**{spill} SPILL**"
            flagged.append(ck)
        op = ck.ir_op + (f" ({ck.loc})" if ck.loc else "") if ck.ir_op else "-"
        tier = "" if ck.tier == "portable" else f" ({ck.tier} tier)"
        lines.append("| " + " | ".join([
            f"`{ck.name}`{tier}", op, f"{ck.num_warps}/{ck.num_stages}", r.regs_text(), str(r.shared_bytes), spill,
            r.occupancy_text(), r.matrix_text()]) + " |")
    tiers = sorted({ck.tier for ck in compiled} - {"portable"})
    by_tier = "".join(f", {sum(ck.tier == t for ck in compiled)} {t} tier (Gluon)" for t in tiers)
    lines += ["", f"**{len(compiled)} kernels** for {target.name}{by_tier}; {len(flagged)} with scratch/spills."]
    if flagged:
        lines += ["", "Kernels using scratch (private/local memory: spills or local arrays): "
                  + ", ".join(f"`{ck.name}` ({ck.ir_op or '-'})" for ck in flagged)]
    lines += ["", _legend(target)]
    return "\n".join(lines) + "\n"


def shutdown_workers(wait: bool = True, *, kill: bool = False) -> None:
    """Stop the reusable worker pool (it is otherwise kept for the next compile_kernels call). kill: SIGKILL every
    worker's process group now (the worker and its ptxas / ld.lld), compiles in flight included."""
    global _EXECUTOR, _EXECUTOR_JOBS
    with _EXECUTOR_LOCK:
        executor, _EXECUTOR, _EXECUTOR_JOBS = _EXECUTOR, None, 0
    if executor is None or _EXECUTOR_PID != os.getpid():
        return                  # none, or a forked child's copy of its parent's pool: the parent's to stop
    procs = list((getattr(executor, "_processes", None) or {}).values()) if kill else []
    manager = getattr(executor, "_executor_manager_thread", None)
    executor.shutdown(wait=wait and not kill, cancel_futures=True)
    for proc in procs:
        with contextlib.suppress(Exception):
            if proc.exitcode is None:           # not reaped yet: its pid cannot name another process
                _kill_worker(proc.pid)
    if wait and kill:
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.join(5)
    if kill and manager is not None and manager is not threading.current_thread():
        # The pool's manager thread closes its wakeup pipe when it sees the workers gone; interpreter exit
        # (concurrent.futures' _python_exit) writes to that pipe without a lock, and in the race prints
        # "OSError: Bad file descriptor" on the way out of a SIGTERM'd compile. Let the thread finish first.
        with contextlib.suppress(Exception):
            manager.join(5)


# ================================================================================================ parent helpers
def _targets():
    from .targets import TARGETS

    return TARGETS


def _unique(kernels: list[KernelSource]) -> list[KernelSource]:
    seen: dict[str, KernelSource] = {}
    out = []
    for k in kernels:
        if not _NAME.match(k.name):
            raise ArgumentError(f"kernel name '{k.name}' is not a Python identifier")
        if k.name in seen:
            if seen[k.name].key != k.key:
                raise ArgumentError(f"two different kernels are both named '{k.name}' "
                                    f"({seen[k.name].ir_op or '?'} and {k.ir_op or '?'})")
            continue
        seen[k.name] = k
        out.append(k)
    return out


def _fp_fusion() -> str:
    value = os.environ.get("TRITON_DEFAULT_FP_FUSION", "").strip()
    return value if value in ("0", "1") else "1"      # triton <= 3.9 default (fusion on), set explicitly


# TRITON_* variables that do not change the generated code (everything else is part of the cache key)
_ENV_NOT_IN_KEY = frozenset({"TRITON_INTERPRET", "TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR",
                             "TRITON_DUMP_PTXAS_LOG", "TRITON_PRINT_AUTOTUNING", "TRITON_CACHE_MANAGER",
                             "TRITON_ALWAYS_COMPILE", "TRITON_DEFAULT_FP_FUSION"})


def _triton_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TRITON_") and k not in _ENV_NOT_IN_KEY}


def _job(kernel: KernelSource, target: Target, staging: str, source_rel: str, options: dict) -> dict:
    return {
        "name": kernel.name, "staging": staging, "source_rel": source_rel, "signature": dict(kernel.signature),
        "constexprs": dict(kernel.constexprs), "num_warps": kernel.num_warps, "num_stages": kernel.num_stages,
        "backend": target.backend, "arch": target.arch, "triton_target": target.triton_target,
        "assume_aligned": options["assume_aligned"], "keep_ttgir": options["keep_ttgir"],
        "fp_fusion": options["fp_fusion"], "triton_options": options["triton_options"],
    }


def _entry_from_result(kernel: KernelSource, target: Target, res: dict) -> dict:
    return {"name": kernel.name, "target": target.name, "backend": target.backend, "arch": target.arch,
            "files": res["files"], "resources": res["resources"], "compile_seconds": res["seconds"],
            "compile_cpu_seconds": res["cpu_seconds"],
            "metadata": res["metadata"], "divisible_by_16": res["divisible_by_16"],
            "digest": kernel.compile_digest}


def _from_entry(entry: dict, kernel: KernelSource, target: Target, key: str, *, hit: bool) -> CompiledKernel:
    """A CompiledKernel from a cache entry; the KernelSource supplies what its digest does not cover (ir_op, loc)."""
    return CompiledKernel(
        name=kernel.name, target=target.name, backend=target.backend, arch=target.arch, files=dict(entry["files"]),
        signature=dict(kernel.signature), constexprs=dict(kernel.constexprs), grid=tuple(kernel.grid),
        num_warps=kernel.num_warps, num_stages=kernel.num_stages,
        resources=KernelResources.from_dict(entry["resources"]), compile_seconds=float(entry["compile_seconds"]),
        compile_cpu_seconds=float(entry.get("compile_cpu_seconds", 0.0)),
        ir_op=kernel.ir_op, loc=kernel.loc, metadata=dict(entry["metadata"]),
        divisible_by_16=tuple(entry.get("divisible_by_16", ())), cache_hit=hit, key=key, digest=kernel.digest,
        catalogue_key=kernel.key, tier=kernel.tier)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """One line on stderr per `key` and process."""
    if key not in _WARNED:
        _WARNED.add(key)
        print(message, file=sys.stderr)


def _copy_tree_files(src_dir: str, out_dir: str, files: dict[str, str]) -> None:
    for rel in files.values():
        dst = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        shutil.copyfile(os.path.join(src_dir, rel), dst)


def _compile_error(failures: list[tuple[KernelSource, str]], target: Target) -> KernelCompileError:
    kernel, detail = failures[0]
    where = []
    if kernel.ir_op:
        where.append(f"IR op {kernel.ir_op}")
    if kernel.loc:
        where.append(f"at {kernel.loc}")
    message = (f"kernel '{kernel.name}'" + (f" ({', '.join(where)})" if where else "")
               + f" failed to compile for {target.name} ({target.backend} {target.arch}):\n" + _indent(detail))
    if len(failures) > 1:
        others = ", ".join(k.name for k, _ in failures[1:6]) + (", ..." if len(failures) > 6 else "")
        message += f"\n({len(failures) - 1} more kernels failed: {others})"
    return KernelCompileError(message, kernel=kernel.name, ir_op=kernel.ir_op, loc=kernel.loc, target=target.name,
                              detail=detail, failed=tuple(k.name for k, _ in failures))


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _legend(target: Target) -> str:
    if target.backend == "hip":
        return ("Columns: regs = VGPRs / SGPRs / AGPRs per lane; LDS = dynamic + static LDS bytes per workgroup; "
                "scratch = private segment bytes per lane / VGPR spill count (SGPRs parked in VGPR lanes, which costs no memory traffic, shown apart); occupancy = estimated waves per "
                "SIMD (of 8) and what limits it; matrix instructions = static count of v_mfma*/v_smfmac* "
                "(v_mfma_scale_* = MX).")
    return ("Columns: regs = registers per thread; shared = dynamic + static shared memory bytes per block; "
            "scratch = local-memory frame bytes per thread / spill store bytes (ptxas); occupancy = estimated "
            "warps per SM (of 64) and what limits it; matrix instructions = static PTX count of wgmma.mma_async "
            "(sm_90) / tcgen05.mma (sm_100) / mma.sync.")


def _progress_bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    enabled = progress and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="kernel", disable=not enabled, leave=False)


# ------------------------------------------------------------------------------------------------ worker pool
_EXECUTOR: ProcessPoolExecutor | None = None
_EXECUTOR_JOBS = 0
_EXECUTOR_ENV: tuple = ()
_EXECUTOR_LOCK = threading.Lock()
_ENV_LOCK = threading.Lock()
_EXECUTOR_PID = 0              # the process that made _EXECUTOR (a forked child must neither use nor kill it)
_ATEXIT = False
_WATCH_SECONDS = 0.2            # how often a worker checks that its parent is alive


def _default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _executor(jobs: int | None) -> ProcessPoolExecutor:
    """The shared spawn pool, created on demand and replaced when the job count or the TRITON_* environment it
    was started with changed (triton caches tool paths and versions per process). Workers are spawned lazily
    inside submit().

    No worker outlives this process, whatever ends it: each worker leads its own process group (so its ptxas goes
    with it, and a terminal's Ctrl-C reaches only this process, which kills the workers), points its stdin /
    stdout / stderr at /dev/null (a caller reading this process's output sees EOF when this process ends), and
    watches its parent from a thread: when it is gone (SIGKILL, a crash) the worker kills its group within
    _WATCH_SECONDS. Here, an exception or SIGTERM / SIGHUP during a compile (_exit_on_signals) kills the workers
    in the finally block, and interpreter exit stops the pool (atexit). multiprocessing's resource tracker ends by
    itself when the last process holding its pipe (this one and the workers) is gone."""
    global _EXECUTOR, _EXECUTOR_JOBS, _EXECUTOR_ENV, _EXECUTOR_PID, _ATEXIT
    jobs = max(1, int(jobs)) if jobs else _default_jobs()
    env = (_fp_fusion(), tuple(_triton_env().items()))
    with _EXECUTOR_LOCK:
        if _EXECUTOR is not None and _EXECUTOR_PID != os.getpid():
            _EXECUTOR = None        # inherited through fork: its threads and pipes are the parent's
        if _EXECUTOR is not None and (_EXECUTOR_JOBS != jobs or _EXECUTOR_ENV != env
                                      or getattr(_EXECUTOR, "_broken", False)):
            _EXECUTOR.shutdown(wait=False, cancel_futures=True)
            _EXECUTOR = None
        if _EXECUTOR is None:
            import multiprocessing

            _EXECUTOR = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_worker_init, initargs=(_fp_fusion(), os.getpid()))
            _EXECUTOR_JOBS, _EXECUTOR_ENV, _EXECUTOR_PID = jobs, env, os.getpid()
            if not _ATEXIT:
                atexit.register(shutdown_workers, False, kill=True)
                _ATEXIT = True
        return _EXECUTOR


def _kill_worker(pid: int) -> None:
    """SIGKILL a worker's process group (it leads one once started) and the worker itself. Only for a child not
    reaped yet: until then its pid (and so the group id) cannot name anything else."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        with contextlib.suppress(OSError):
            kill(target, signal.SIGKILL)


def _exit_on_signals():
    """While this call's kernels compile: SIGTERM / SIGHUP raise SystemExit(128 + signal) in the main thread, so
    the finally blocks kill the workers and remove the staging directories (and `k3c compile` exits 143). Only
    installed from the main thread and where the signal has its default action (a program's own handler is left
    alone). Returns the function that restores the previous handlers. A second signal during the cleanup is
    ignored."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    fired = []

    def handler(signo, _frame):
        if not fired:
            fired.append(signo)
            raise SystemExit(128 + signo)

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) == signal.SIG_DFL:
                saved[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, previous in saved.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, previous)
    return restore


@contextlib.contextmanager
def _worker_environment():
    """Worker processes spawned inside this block (ProcessPoolExecutor spawns them inside submit()):
      * inherit an environment without TRITON_INTERPRET and with TRITON_DEFAULT_FP_FUSION set (the initializer
        sets both again, but runs too late for anything imported while the child bootstraps);
      * do not re-import the caller's __main__ (spawn normally does: a script without an `if __name__ ==
        "__main__"` guard would recurse, and one that imports triton under TRITON_INTERPRET=1 would poison the
        worker). Workers only run functions of this module, so they never need __main__.
    """
    overrides = {"TRITON_INTERPRET": None, "TRITON_DEFAULT_FP_FUSION": _fp_fusion()}
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in overrides}
        main = sys.modules.get("__main__")
        try:
            for k, v in overrides.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            sys.modules["__main__"] = types.ModuleType("__main__")     # no __file__, no __spec__
            yield
        finally:
            if main is not None:
                sys.modules["__main__"] = main
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# ===================================================================================== worker side (spawned process)
def _worker_init(fp_fusion: str, parent_pid: int | None = None) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DEFAULT_FP_FUSION"] = fp_fusion
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"           # ptxas -v log to stdout: exact spill bytes (captured)
    if parent_pid is not None:
        _detach_from_parent(parent_pid)


def _detach_from_parent(parent_pid: int) -> None:
    """Own process group, stdio on /dev/null (never the caller's pipes), and a thread that ends this worker and
    its group when the parent is gone (_executor says why)."""
    if os.getppid() != parent_pid:
        os._exit(1)                                     # the parent died while this worker started
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_WATCH_SECONDS)
        if os.getpgrp() == os.getpid():                # never the caller's group
            with contextlib.suppress(OSError):
                os.killpg(0, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="k3c-aot-parent-watch", daemon=True).start()


def _compile_worker(job: dict) -> dict:
    """Compile one kernel module (in a worker process). Never raises: returns {"ok": False, "error": ...}."""
    staging = job["staging"]
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DEFAULT_FP_FUSION"] = job["fp_fusion"]
    triton_cache = os.path.join(staging, ".triton")
    os.environ["TRITON_CACHE_DIR"] = triton_cache       # private per job: honest timings, nothing left behind
    log_path = os.path.join(staging, ".compile.log")
    try:
        with _capture_fds(log_path):
            try:
                result = _compile_in_worker(job)
            except Exception as exc:  # noqa: BLE001
                result = {"ok": False, "exc": exc}
        with open(log_path, errors="replace") as f:
            log = f.read()
        if not result.get("ok"):
            return {"ok": False, "error": _short_error(result.get("exc"), log)}
        if job["backend"] == "cuda":
            try:
                from .resources import nv_resources

                asm = result.pop("_asm")
                res = nv_resources(job["arch"], asm["cubin"], asm["ptx"], kernel=result["metadata"]["name"],
                                   shared=int(result["metadata"].get("shared", 0)), num_warps=job["num_warps"],
                                   ptxas_log=log)
                result["resources"] = res.to_dict()
            except Exception as exc:  # noqa: BLE001
                return {"ok": False, "error": f"reading resource usage failed: {type(exc).__name__}: {exc}"}
        result.pop("_asm", None)
        return result
    finally:
        shutil.rmtree(triton_cache, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(log_path)


def _compile_in_worker(job: dict) -> dict:
    import linecache

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set in the compiler worker; triton.compile cannot run")
    staging, name = job["staging"], job["name"]
    with open(os.path.join(staging, job["source_rel"]), encoding="utf-8") as f:
        text = f.read()
    # Reproducible binaries: triton's line info (the .debug_line / DI file of the hsaco and cubin, the ttgir and
    # PTX locs) names the file a kernel's code object was compiled from. The module is compiled under its artifact
    # path "kernels/<name>.py" (relative; inspect reads it from linecache), never the random staging path under the
    # cache, and under a fixed module name: two compiles of one kernel give the same bytes, and no cache path leaks.
    file_name, module_name = job["source_rel"], f"_k3c_aot_{name}"
    module = types.ModuleType(module_name)
    module.__file__ = file_name
    linecache.cache[file_name] = (len(text), None, text.splitlines(True), file_name)
    sys.modules[module_name] = module
    try:
        exec(compile(text, file_name, "exec"), module.__dict__)     # noqa: S102 - our own generated module
        fn = getattr(module, name, None)
        if fn is None or not hasattr(fn, "arg_names"):
            raise RuntimeError(f"the module defines no @triton.jit or @gluon.jit function named '{name}'")
        signature, constexprs, divisible = _triton_signature(fn, job)
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
        source_type = ASTSource
        if getattr(fn, "is_gluon", lambda: False)():      # a tier kernel (k3c.codegen.tiers): Gluon's own frontend
            from triton.experimental.gluon._runtime import GluonASTSource as source_type
        source = source_type(fn, signature, constexprs=constexprs, attrs=attrs)
        target = GPUTarget(*job["triton_target"])
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        compiled = triton.compile(source, target=target,
                                  options={**job["triton_options"], "num_warps": job["num_warps"],
                                           "num_stages": job["num_stages"]})
        seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
    finally:
        sys.modules.pop(module_name, None)
        linecache.cache.pop(file_name, None)

    metadata = _json_metadata(compiled.metadata._asdict())
    backend = job["backend"]
    binary_kind, asm_kind = BINARY_KINDS[backend]
    files = {"source": job["source_rel"], binary_kind: f"{name}.{binary_kind}", asm_kind: f"{name}.{asm_kind}",
             "metadata": f"{name}.json"}
    _write(staging, files[binary_kind], compiled.asm[binary_kind])
    _write(staging, files[asm_kind], compiled.asm[asm_kind])
    if job["keep_ttgir"] and "ttgir" in compiled.asm:
        files["ttgir"] = f"{name}.ttgir"
        _write(staging, files["ttgir"], compiled.asm["ttgir"])
    _write(staging, files["metadata"], json.dumps(metadata, indent=1, sort_keys=True))
    result = {"ok": True, "files": files, "seconds": seconds, "cpu_seconds": cpu_seconds,
              "divisible_by_16": list(divisible),
              "metadata": {k: metadata[k] for k in LAUNCH_METADATA_KEYS if k in metadata}}
    if backend == "hip":
        result["resources"] = kernel_resources(backend, job["arch"], compiled.asm, kernel=metadata["name"],
                                               shared=int(metadata.get("shared", 0)),
                                               num_warps=job["num_warps"]).to_dict()
    else:   # needs the ptxas log, which is only complete once the fds are restored
        result["_asm"] = {"cubin": compiled.asm["cubin"], "ptx": compiled.asm["ptx"]}
    return result


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): compile cost on a busy machine."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _triton_signature(fn, job: dict):
    """Full ASTSource signature in parameter order ('constexpr' for constexpr args), constexpr values, and the
    pointer args to mark 16-byte divisible."""
    sig_in, cx_in = job["signature"], job["constexprs"]
    unknown = sorted((set(sig_in) | set(cx_in)) - set(fn.arg_names))
    if unknown:
        raise RuntimeError(f"signature/constexprs name arguments the kernel does not have: {', '.join(unknown)}")
    signature, constexprs, divisible = {}, {}, []
    for param in fn.params:
        arg = param.name
        if arg in cx_in:
            signature[arg], constexprs[arg] = "constexpr", cx_in[arg]
        elif arg in sig_in:
            signature[arg] = sig_in[arg]
            if job["assume_aligned"] and sig_in[arg].startswith("*") and not param.do_not_specialize_on_alignment:
                divisible.append(arg)
        elif param.is_constexpr and param.has_default:
            signature[arg], constexprs[arg] = "constexpr", param.default
        else:
            raise RuntimeError(f"argument '{arg}' is in neither KernelSource.signature nor constexprs")
    return signature, constexprs, divisible


def _json_metadata(md: dict) -> dict:
    out = {}
    for k, v in md.items():
        if k == "target":
            v = {"backend": v.backend, "arch": v.arch, "warp_size": v.warp_size}
        try:
            json.dumps(v)
        except TypeError:
            v = repr(v)
        out[k] = v
    return out


def _write(staging: str, rel: str, data) -> None:
    mode = "wb" if isinstance(data, (bytes, bytearray)) else "w"
    with open(os.path.join(staging, rel), mode) as f:
        f.write(data)


@contextlib.contextmanager
def _capture_fds(path: str):
    """Send fd 1 and 2 (Python prints, MLIR diagnostics, ptxas logs) to `path` while compiling."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _short_error(exc, log: str) -> str:
    """Triton's message cut to what says what went wrong (head + tail of long ones), plus the first relevant
    lines of anything the compiler printed (MLIR diagnostics) when the exception itself says little."""
    text = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > _MAX_ERROR_LINES:
        lines = lines[:4] + [f"    ... ({len(lines) - 12} lines) ..."] + lines[-8:]
    diag = [line.rstrip() for line in log.splitlines()
            if line.strip() and ("error" in line.lower() or "note:" in line.lower())]
    if diag and len(lines) <= 3:
        lines += ["compiler output:"] + diag[:8]
    return "\n".join(lines)
