"""`k3c compile | inspect | run`. Exit 0 on success, 2 on bad input (one line, no traceback), 1 on internal errors."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .commands.argtypes import Parser, count, fraction, passes, path, positive, seed
from .errors import ArgumentError, K3cError, UserError
from .limits import MAX_BATCH, MAX_RANKS, MAX_STAGES, MAX_TOKENS


def _parallel_args(p, rank: bool = False) -> None:
    p.add_argument("--tp", type=positive("--tp", MAX_RANKS), default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--ep", type=positive("--ep", MAX_RANKS),
                   help="expert-parallel ranks (default: = --tp); the ranks are "
                   "max(tp, ep), one must divide the other (docs/distributed.md)")
    if rank:
        p.add_argument("--rank", type=int, default=0, help="the rank whose slice to compile (default 0)")


def build_parser() -> argparse.ArgumentParser:
    from .commands import quantize, run_args, serve

    p = Parser(prog="k3c", description="Compiler for Kimi-K3-class hybrid LLMs.")
    p.add_argument("--version", action="store_true", help="print the k3c version and exit")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    _add_compile(sub)
    _add_inspect(sub)
    run_args.add_parser(sub, _parallel_args)
    _add_plan(sub)
    _add_targets(sub)
    quantize.add_parsers(sub, positive, seed)            # quantize, calibrate-router
    serve.add_parser(sub, positive, path, seed)
    return p


def _target_help(default: str | None = None) -> str:
    from .codegen.targets import TARGETS

    return f"one of: {', '.join(TARGETS)}" + (f" (default {default})" if default else "") + " (k3c targets lists them)"


def _add_compile(sub) -> None:
    c = sub.add_parser("compile", help="compile a spec into an artifact directory")
    c.add_argument("spec", help="YAML spec, Hugging Face config.json or model directory")
    c.add_argument("--target", required=True, help=_target_help())
    c.add_argument("-o", "--output", required=True, help="artifact directory to write")
    c.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass as numbered .k3c files")
    c.add_argument("--passes", type=passes, help="comma-separated pass names (default: the target's pipeline)")
    c.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    c.add_argument("--no-asm", action="store_true",
                   help="leave the assembly (.ptx/.amdgcn) and .ttgir out of the artifact (about half the bytes; "
                   "binaries, sources and the resource report stay)")
    c.add_argument("--run-dtypes", default="bfloat16", metavar="LIST",
                   help="activation dtypes to hold kernels for, comma-separated: bfloat16 (default; the IR's), "
                   "float32 (a run with --dtype float32 on the GPU)")
    _parallel_args(c, rank=True)


def _add_inspect(sub) -> None:
    i = sub.add_parser("inspect", help="print the IR of a spec or a compiled artifact (after a pass) as text, DOT "
                       "or ONNX")
    i.add_argument("spec", help="YAML spec, Hugging Face config.json or model directory; or a compiled artifact "
                   "directory (verified as `k3c run` verifies it, then its own IR shown)")
    i.add_argument("--target", help=_target_help("mi355x") + " (an artifact's is its own)")
    i.add_argument("--after", metavar="PASS", help="show the IR after this pass (default: the last)")
    i.add_argument("--passes", type=passes, help="comma-separated pass names")
    i.add_argument("--format", choices=("text", "dot", "onnx"), default="text", help="(default text)")
    i.add_argument("-o", "--output", help="write to this file instead of stdout (required for onnx); an existing "
                   "file is replaced only with --force")
    i.add_argument("--force", action="store_true", help="replace an existing -o file")
    i.add_argument("--bytes", action="store_true", help="per-layer AttnRes bytes, naive vs split (attnres-split)")


def _add_targets(sub) -> None:
    sub.add_parser("targets", help="list the compile targets and what each is")


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="memory plan, cost model and roofline for a target and a parallel layout")
    pl.add_argument("spec", help="YAML spec, Hugging Face config.json or model directory")
    pl.add_argument("--target", required=True, help=_target_help())
    pl.add_argument("--tp", type=positive("--tp", MAX_RANKS), default=1, help="tensor-parallel GPUs (default 1)")
    pl.add_argument("--ep", type=positive("--ep", MAX_RANKS), help="expert-parallel ranks (default: = TP)")
    pl.add_argument("--context", type=positive("--context", MAX_TOKENS),
                    help="tokens per sequence, at most 2**31 (default: the model's max_context)")
    pl.add_argument("--batch", type=positive("--batch", MAX_BATCH), default=1,
                    help="sequences per TP group, at most 2**24 (default 1)")
    pl.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="bf16", help="MLA latent cache dtype")
    pl.add_argument("--prefill-chunk", type=positive("--prefill-chunk", MAX_TOKENS), default=8192,
                    help="tokens per chunked-prefill step (default 8192)")
    pl.add_argument("--headroom", type=fraction("--headroom"), default=0.10,
                    help="fraction of HBM kept free, in [0, 1) (default 0.10)")
    pl.add_argument("--pp", type=positive("--pp", MAX_STAGES), default=4, help="pipeline stages P for the AttnRes "
                    "pipeline-communication estimate (default 4)")
    pl.add_argument("--vpp", type=positive("--vpp", MAX_STAGES), default=2, help="virtual stages V per pipeline "
                    "stage (default 2)")
    pl.add_argument("--sharded", action="store_true", help="plan rank 0's IR after the shard pass: the split "
                    "k3c run --tp/--ep really holds (docs/distributed.md)")
    pl.add_argument("--prefix-interval", type=count("--prefix-interval", MAX_TOKENS), default=0, metavar="N",
                    help="count the KDA prefix-cache checkpoints of a prefix cache that keeps one every N tokens and "
                    "at each prompt end (the runtime's PrefixCache default: 32768); 0, the default: no prefix cache")
    pl.add_argument("--no-seq-parallel", dest="seq_parallel", action="store_false", default=None,
                    help="plan without sequence parallel: every TP rank holds the whole prefill chunk's AttnRes "
                    "blocks and computes every mix (with --sharded: the shard pass's seq_parallel=False)")
    pl.add_argument("--compare-full-attention", action="store_true",
                    help="also plan the same model with every layer full attention (MLA) and print both KV "
                    "throughputs (cache bytes / prefill time) by length")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON (stable keys) instead of text")
    pl.add_argument("--plot", metavar="FILE.png", type=path("--plot"),
                    help="write the memory breakdown and roofline chart (needs matplotlib: pip install -e "
                    "'.[plot]'); an existing file is replaced only with --force")
    pl.add_argument("--force", action="store_true", help="replace an existing --plot file")
    pl.add_argument("--measured", metavar="BENCH.json", type=path("--measured"),
                    help="benchmark records [{name, flops, bytes, seconds}] drawn on the roofline")


def _check_ranks(args) -> None:
    """--rank names one of the max(--tp, --ep) ranks (checked here, where the flag is known by name)."""
    rank = getattr(args, "rank", None)
    if rank is None:
        return
    world = max(args.tp, args.ep or args.tp)
    if not 0 <= rank < world:
        raise ArgumentError(f"--rank must be in [0, {world}) for --tp {args.tp} --ep {args.ep or args.tp}, got "
                            f"{rank}")


def cmd_compile(args) -> int:
    from . import api
    from .outputs import DUMP, check_output_dir

    t0 = time.perf_counter()
    check_output_dir(args.output, args.force, keep=args.dump_ir)      # before the compile writes dumps or kernels
    if args.dump_ir is not None:
        check_output_dir(args.dump_ir, kind=DUMP, what="--dump-ir")
    model = api.compile(args.spec, target=args.target, passes=args.passes, dump_ir=args.dump_ir, tp=args.tp,
                        ep=args.ep, rank=args.rank, run_dtypes=args.run_dtypes)
    model.save(args.output, overwrite=args.force, keep=args.dump_ir, keep_asm=not args.no_asm)
    n_ops = len(model.module.ops)
    kernels = model.compiled_kernels or []
    hits = sum(ck.cache_hit for ck in kernels)
    built = (f"; {len(kernels)} kernels: {len(kernels) - hits} compiled "
             f"({sum(ck.compile_seconds for ck in kernels if not ck.cache_hit):.1f} s of compile time), {hits} "
             f"from the cache" if kernels else "")
    print(f"k3c: compiled {model.spec.name} for {model.target.name}: {n_ops} ops after "
          f"{len(model.records)} passes in {time.perf_counter() - t0:.2f} s{built} -> {args.output}")
    return 0


def cmd_inspect(args) -> int:
    from . import api
    from .commands.run import _is_artifact
    from .outputs import check_output_file, write_file

    if args.format == "onnx" and not args.output:
        raise ArgumentError("--format onnx writes a binary model; give -o FILE.onnx")
    if args.output:
        check_output_file(args.output, args.force)              # before the compile
    if _is_artifact(args.spec):
        given = "--target" if args.target is not None else "--passes" if args.passes is not None else None
        if given:
            raise ArgumentError(f"{args.spec} is a compiled artifact (its target and passes are fixed); {given} "
                                f"applies to a spec")
        model = api.load(args.spec)              # every file against the manifest, every stage through the verifier
        print(f"k3c inspect: artifact {args.spec} verified ({len(model.stages)} IR stages, target "
              f"{model.target.name})", file=sys.stderr)
    else:
        if os.path.basename(args.spec) == "spec.yaml" and _is_artifact(os.path.dirname(args.spec) or "."):
            print(f"k3c inspect: note: {args.spec} is the spec of an artifact, compiled afresh here; `k3c inspect "
                  f"{os.path.dirname(args.spec) or '.'}` verifies the artifact and shows its own IR", file=sys.stderr)
        model = api.compile(args.spec, target=args.target or "mi355x", passes=args.passes)
    module = model.module_after(args.after)
    if args.bytes:
        from .passes.attnres_split import bytes_summary

        out = bytes_summary(module)
    elif args.format == "text":
        from .analysis.mla_cost import mla_crossover_lines
        from .ir import print_module

        out = "".join(f"{line}\n" for line in mla_crossover_lines(module, model.target)) + print_module(module)
    elif args.format == "dot":
        from .ir.dot import to_dot

        out = to_dot(module)
    else:
        from .ir.onnx_export import to_onnx

        write_file(args.output, to_onnx(module).SerializeToString(), args.force)
        print(f"k3c: wrote ONNX ({len(module.ops)} ops) to {args.output}")
        return 0
    out = out if out.endswith("\n") else out + "\n"
    if args.output:
        write_file(args.output, out.encode(), args.force)
    else:
        sys.stdout.write(out)
    return 0


def cmd_targets(args) -> int:
    from .codegen.targets import TARGETS

    print(f"{'target':<8} {'backend':<8} {'arch':<7} {'warp':>4}  {'MXFP4':<8} {'HBM':>7} {'HBM/s':>9} "
          f"{'bf16 dense':>11}  binaries")
    for t in TARGETS.values():
        if t.backend == "cpu":
            print(f"{t.name:<8} {'cpu':<8} {'-':<7} {'-':>4}  {'emulated':<8} {'-':>7} {'-':>9} {'-':>11}  none: "
                  f"torch ops (or the Triton interpreter with k3c run --interpret)")
            continue
        binaries = ".hsaco + .amdgcn" if t.backend == "hip" else ".cubin + .ptx"
        print(f"{t.name:<8} {t.backend:<8} {t.arch:<7} {t.warp_size:>4}  {'native' if t.native_mxfp4 else 'upcast':<8} "
              f"{t.hbm_bytes / 2**30:>4.0f} GiB {t.hbm_bytes_per_s / 1e12:>5.2f} TB/s {t.peak_bf16_flops / 1e15:>6.2f} "
              f"PFLOP/s  {binaries}")
    print("k3c compile SPEC --target NAME -o DIR compiles for any of them on any machine (docs/targets.md)")
    return 0


def cmd_run(args) -> int:
    from .commands.run_cli import run_command

    return run_command(args)


def cmd_plan(args) -> int:
    import json

    from .analysis.report import plan, write_plot
    from .outputs import check_output_file

    if args.plot:
        check_output_file(args.plot, args.force, what="--plot")          # before the plan
    result = plan(args.spec, args.target, tp=args.tp, ep=args.ep, context=args.context, batch=args.batch,
                  kv_dtype=args.kv_dtype, prefill_chunk=args.prefill_chunk, headroom=args.headroom, pp=args.pp,
                  vpp=args.vpp, measured=args.measured, sharded=args.sharded, prefix_interval=args.prefix_interval,
                  seq_parallel=args.seq_parallel, compare_full_attention=args.compare_full_attention)
    if args.plot:
        write_plot(result, args.plot, args.force)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        sys.stdout.write(result.text())
    return 0


def cmd_serve(args) -> int:
    from .commands.serve import cmd_serve as serve

    return serve(args)


def cmd_quantize(args) -> int:
    from .commands.quantize import cmd_quantize as run

    return run(args)


def cmd_calibrate_router(args) -> int:
    from .commands.quantize import cmd_calibrate_router as run

    return run(args)


COMMANDS = {"compile": cmd_compile, "inspect": cmd_inspect, "run": cmd_run, "plan": cmd_plan,
            "quantize": cmd_quantize, "calibrate-router": cmd_calibrate_router, "serve": cmd_serve,
            "targets": cmd_targets}
# commands whose work is torch CPU ops: torch's thread count chosen for them (commands/threads.py)
_THREADED = ("run", "serve", "quantize", "calibrate-router")


def main(argv: list[str] | None = None) -> int:
    try:
        if argv is None:                # the program itself: a caller's in-process main([...]) has torch already
            _import_torch_holding_ctrl_c()
        args = build_parser().parse_args(argv)
        if args.version:
            from . import __version__

            print(f"k3c {__version__}")
            return 0
        if not args.command:
            raise ArgumentError("give a command: compile, inspect, run, serve, plan, quantize, calibrate-router or "
                                "targets (see k3c --help)")
        _check_ranks(args)
        if args.command not in _THREADED:
            return COMMANDS[args.command](args)
        import torch

        from .commands.threads import apply_threads

        before = torch.get_num_threads()
        args.thread_choice = apply_threads(getattr(args, "threads", None))
        try:
            return COMMANDS[args.command](args)
        finally:
            if argv is not None:        # a caller's in-process main([...]): its own setting back
                torch.set_num_threads(before)
    except UserError as exc:
        print(f"k3c: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except K3cError as exc:
        print(f"k3c: internal error: {exc}", file=sys.stderr)
        _maybe_traceback()
        return 1
    except KeyboardInterrupt:
        print("k3c: interrupted", file=sys.stderr)
        if argv is None:                # the program itself, not a caller's in-process main([...])
            _exit_quietly(130)
        return 130
    except Exception as exc:  # a bug: one line by default, the traceback with K3C_DEBUG >= 1
        print(f"k3c: internal error: {type(exc).__name__}: {exc} (set K3C_DEBUG=1 for a traceback)",
              file=sys.stderr)
        _maybe_traceback()
        return 1


def _import_torch_holding_ctrl_c() -> None:
    """Import torch with a Ctrl-C held until the import is done, then raised. torch's extension initialisation
    can swallow a KeyboardInterrupt raised inside it, and the program then runs on as if no Ctrl-C had come (a
    Ctrl-C in the first fraction of a second was lost). Only where SIGINT has Python's default handler."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        import torch  # noqa: F401
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signo, _frame: held.append(signo))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def _exit_quietly(code: int) -> None:
    """End an interrupted program now, with nothing printed after its one line. Ctrl-C can land inside Triton (a
    kernel being compiled, launched or interpreted, its objects half-built); the interpreter's teardown then
    collects those objects and a __del__ raises, printed as "Exception ignored in ..." with a traceback after
    "k3c: interrupted". So: flush, run the atexit handlers (k3c's own: the private kernel directory removed, AOT
    compile workers killed) with stderr pointed at /dev/null, and leave by os._exit, which skips the teardown's
    finalizers. Nothing else is lost: k3c writes its outputs to a staging path and renames them into place, and
    the unwinding that brought the KeyboardInterrupt here has already removed an interrupted write's staging."""
    import atexit

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:           # a closed pipe: nothing more to say on it
            pass
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        atexit._run_exitfuncs()
    except BaseException:           # a second Ctrl-C, or a handler's own error: exit all the same
        pass
    os._exit(code)


def _maybe_traceback() -> None:
    from .config import settings

    if settings().debug >= 1:
        import traceback

        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
