"""`k3c compile | inspect | run`. Exit 0 on success, 2 on bad input (one line, no traceback), 1 on internal errors."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .errors import ArgumentError, K3cError, UserError
from .limits import MAX_BATCH, MAX_RANKS, MAX_SEED, MAX_STAGES, MAX_TOKENS, MAX_TOP_K


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line and exits 2 (not a usage dump)."""

    def error(self, message: str):
        raise ArgumentError(f"{self.prog}: {message} (see {self.prog} --help)")




def _integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None


def _positive(name: str, maximum: int | None = None):
    def parse(text: str) -> int:
        value = _integer(name, text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be <= {maximum}, got {value}")
        return value
    return parse


def _count(name: str, maximum: int):
    """An integer in [0, maximum]."""
    def parse(text: str) -> int:
        value = _integer(name, text)
        if not 0 <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{name} must be an integer in [0, {maximum}], got {value}")
        return value
    return parse


def _seed(text: str) -> int:
    """--seed: an integer in [0, 2**63 - 1]."""
    value = _integer("--seed", text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"--seed must be in [0, 2**63 - 1], got {value}")
    return value


def _number(name: str):
    """A float (its range is checked where it is used: runtime.sampling.SamplingParams)."""
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
    return parse


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _escaped(text: str) -> str:
    """--prompt: the escapes \\n, \\t and \\\\ interpreted (a shell passes them as typed); any other backslash
    is kept as it is."""
    import re

    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def _fraction(name: str):
    """A finite float in [0, 1)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number in [0, 1), got {text!r}") from None
        if not 0.0 <= value < 1.0:          # NaN fails both comparisons; inf the upper one
            raise argparse.ArgumentTypeError(f"{name} must be a number in [0, 1), got {text!r}")
        return value
    return parse


def _path(name: str):
    """A path argument that is not empty (an unset shell variable: `--weights "$W"`)."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"{name} needs a path, got an empty string")
        return text
    return parse


def _passes(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--passes needs a comma-separated list of pass names")
    return names


def _parallel_args(p, rank: bool = False) -> None:
    p.add_argument("--tp", type=_positive("--tp", MAX_RANKS), default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--ep", type=_positive("--ep", MAX_RANKS),
                   help="expert-parallel ranks (default: = --tp); the ranks are "
                   "max(tp, ep), one must divide the other (docs/distributed.md)")
    if rank:
        p.add_argument("--rank", type=int, default=0, help="the rank whose slice to compile (default 0)")


def build_parser() -> argparse.ArgumentParser:
    from .codegen.targets import TARGETS

    p = _Parser(prog="k3c", description="Compiler for Kimi-K3-class hybrid LLMs.")
    p.add_argument("--version", action="store_true", help="print the k3c version and exit")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    c = sub.add_parser("compile", help="compile a spec into an artifact directory")
    c.add_argument("spec", help="YAML spec, Hugging Face config.json or model directory")
    c.add_argument("--target", required=True, help=f"one of: {', '.join(TARGETS)}")
    c.add_argument("-o", "--output", required=True, help="artifact directory to write")
    c.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass as numbered .k3c files")
    c.add_argument("--passes", type=_passes, help="comma-separated pass names (default: the target's pipeline)")
    c.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    c.add_argument("--no-asm", action="store_true",
                   help="leave the assembly (.ptx/.amdgcn) and .ttgir out of the artifact (about half the bytes; "
                   "binaries, sources and the resource report stay)")
    c.add_argument("--run-dtypes", default="bfloat16", metavar="LIST",
                   help="activation dtypes to hold kernels for, comma-separated: bfloat16 (default; the IR's), "
                   "float32 (a run with --dtype float32 on the GPU)")
    _parallel_args(c, rank=True)

    i = sub.add_parser("inspect", help="print the IR of a spec or a compiled artifact (after a pass) as text, DOT "
                       "or ONNX")
    i.add_argument("spec", help="YAML spec, Hugging Face config.json or model directory; or a compiled artifact "
                   "directory (verified as `k3c run` verifies it, then its own IR shown)")
    i.add_argument("--target", help=f"one of: {', '.join(TARGETS)} (default mi355x; an artifact's is its own)")
    i.add_argument("--after", metavar="PASS", help="show the IR after this pass (default: the last)")
    i.add_argument("--passes", type=_passes, help="comma-separated pass names")
    i.add_argument("--format", choices=("text", "dot", "onnx"), default="text")
    i.add_argument("-o", "--output", help="write to this file instead of stdout (required for onnx)")
    i.add_argument("--bytes", action="store_true", help="per-layer AttnRes bytes, naive vs split (attnres-split)")

    r = sub.add_parser("run", help="run a model: text in, text out with --prompt; otherwise random prompts and a "
                       "report of speed and memory", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="With --prompt / --prompt-file: the text is encoded with the model's tokenizer, "
                       "continued through the\nserving engine (greedy, or sampled with --temperature / --top-p / "
                       "--top-k / --seed) and printed after\nthe prompt on stdout, stopping at the EOS token; a short "
                       "stats block goes to stderr.\nWithout: --batch random prompts of --prompt-len tokens, and a "
                       "report (TTFT, tokens/s, memory, MLA modes).\n\n  k3c run examples/k3-stdlib --prompt "
                       "\"import os\\n\" --new-tokens 32")
    r.add_argument("spec", help="YAML spec, config.json, model directory, or a compiled artifact directory")
    r.add_argument("--weights", type=_path("--weights"),
                   help="safetensors file or Hugging Face model directory (default: the checkpoint of the model "
                   "directory given as the model, else random init; an artifact holds no weights: give --weights "
                   "for trained ones)")
    text = r.add_mutually_exclusive_group()
    text.add_argument("--prompt", metavar="TEXT", type=_escaped,
                      help="the text to continue; the escapes \\n (newline), \\t (tab) and \\\\ (backslash) "
                      "are interpreted, any other backslash is kept")
    text.add_argument("--prompt-file", metavar="FILE", type=_path("--prompt-file"),
                      help="the text to continue, read from a UTF-8 file as it is")
    r.add_argument("--batch", type=_positive("--batch", MAX_BATCH),
                   help="random prompts (default 1; not with --prompt; refused before anything is allocated when "
                   "the run's estimated memory exceeds the device's)")
    r.add_argument("--prompt-len", type=_positive("--prompt-len", MAX_TOKENS),
                   help="tokens per random prompt (default 16; not with --prompt; prompt + new tokens <= the "
                   "model's max_context)")
    r.add_argument("--new-tokens", type=_positive("--new-tokens", MAX_TOKENS),
                   help="tokens to generate (default 8; with --prompt 64, fewer when the EOS token comes first)")
    r.add_argument("--temperature", type=_number("--temperature"),
                   help="sampling temperature (default 0: greedy, the most likely token; one below 1e-4 samples at "
                   "1e-4)")
    r.add_argument("--top-p", type=_number("--top-p"),
                   help="sample from the smallest set of the most likely tokens whose probability reaches P, in "
                   "(0, 1] (default 1: all)")
    r.add_argument("--top-k", type=_count("--top-k", MAX_TOP_K),
                   help="sample from the K most likely tokens (default 0: all; past the vocabulary: all)")
    r.add_argument("--seed", type=_seed, help="seed of the random weights and prompts (default 0) and of the "
                   "sampling draws (default: 0, or with --prompt one drawn and printed), in [0, 2**63 - 1]")
    r.add_argument("--device", default="cpu", help="cpu or cuda")
    r.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="weights and activations (default: float32 on a CPU and with --tp/--ep; on a GPU the "
                   "artifact's first run dtype, bfloat16 unless compiled with --run-dtypes float32)")
    r.add_argument("--kv-dtype", choices=("auto", "bf16", "fp8"), default="auto",
                   help="MLA latent cache format: auto = the activation dtype; fp8 = e4m3 codes with per-token "
                   "scales, 592 B per token and layer instead of 1,152 (needs --dtype bfloat16)")
    r.add_argument("--no-kernels", action="store_true",
                   help="run every op through torch on a GPU too (no generated kernels; a CPU does so by default)")
    r.add_argument("--interpret", action="store_true",
                   help="on a CPU, run the generated kernels in the Triton interpreter (~25 ms a launch: minutes "
                   "for what the torch ops do in seconds; default on a CPU: the torch ops)")
    r.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps through captured CUDA graphs (runtime/cuda_graph.py; default: on with --device "
                   "cuda and kernels; falls back to the ordinary step where capture is impossible, reported)")
    r.add_argument("--speculate", metavar="ngram|draft:PATH",
                   help="speculative decoding: ngram (prompt lookup in the sequence's own context) or draft:PATH (a "
                        "draft model directory sharing the tokenizer, e.g. examples/k3-stdlib-draft)")
    r.add_argument("--draft-len", type=_positive("--draft-len", 64), default=4,
                   help="most draft tokens verified per step with --speculate (default 4)")
    r.add_argument("--prefill-chunk", type=_positive("--prefill-chunk", MAX_TOKENS),
                   help="prefill at most this many tokens per sequence and step (default: the whole prompt)")
    r.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="one untimed pass of the same requests before the timed one (JIT compiles, CUDA graph "
                   "capture of every length bucket), reported apart; TTFT and tokens/s are the timed pass's "
                   "(default: on with --device cuda, off on a CPU, where there is no JIT: the rates then include "
                   "first-call costs, and say so)")
    pol = r.add_mutually_exclusive_group()
    pol.add_argument("--strict", dest="kernel_policy", action="store_const", const="strict",
                     help="a kernel launch missing from the artifact is an error (default: JIT-compiled once, "
                     "with a warning, counted in the report)")
    pol.add_argument("--allow-jit", dest="kernel_policy", action="store_const", const="allow-jit",
                     help="run an artifact compiled for another target by JIT-compiling its kernel sources for "
                     "this device (default: refused)")
    pol.add_argument("--jit", dest="kernel_policy", action="store_const", const="jit",
                     help="ignore the artifact's binaries and JIT-compile every kernel from source (the pre-loader "
                     "path, for comparison)")
    r.set_defaults(kernel_policy="artifact")
    _parallel_args(r)

    pl = sub.add_parser("plan", help="memory plan, cost model and roofline for a target and a parallel layout")
    pl.add_argument("spec", help="YAML spec, Hugging Face config.json or model directory")
    pl.add_argument("--target", required=True, help=f"one of: {', '.join(TARGETS)}")
    pl.add_argument("--tp", type=_positive("--tp", MAX_RANKS), default=1, help="tensor-parallel GPUs (default 1)")
    pl.add_argument("--ep", type=_positive("--ep", MAX_RANKS), help="expert-parallel ranks (default: = TP)")
    pl.add_argument("--context", type=_positive("--context", MAX_TOKENS),
                    help="tokens per sequence, at most 2**31 (default: the model's max_context)")
    pl.add_argument("--batch", type=_positive("--batch", MAX_BATCH), default=1,
                    help="sequences per TP group, at most 2**24 (default 1)")
    pl.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="bf16", help="MLA latent cache dtype")
    pl.add_argument("--prefill-chunk", type=_positive("--prefill-chunk", MAX_TOKENS), default=8192,
                    help="tokens per chunked-prefill step (default 8192)")
    pl.add_argument("--headroom", type=_fraction("--headroom"), default=0.10,
                    help="fraction of HBM kept free, in [0, 1) (default 0.10)")
    pl.add_argument("--pp", type=_positive("--pp", MAX_STAGES), default=4, help="pipeline stages P for the AttnRes "
                    "pipeline-communication estimate (default 4)")
    pl.add_argument("--vpp", type=_positive("--vpp", MAX_STAGES), default=2, help="virtual stages V per pipeline stage "
                    "(default 2)")
    pl.add_argument("--sharded", action="store_true", help="plan rank 0's IR after the shard pass: the split "
                    "k3c run --tp/--ep really holds (docs/distributed.md)")
    pl.add_argument("--prefix-interval", type=_count("--prefix-interval", MAX_TOKENS), default=0, metavar="N",
                    help="count the KDA prefix-cache checkpoints of a prefix cache that keeps one every N tokens and "
                    "at each prompt end (the runtime's PrefixCache default: 32768); 0, the default: no prefix cache")
    pl.add_argument("--no-seq-parallel", dest="seq_parallel", action="store_false", default=None,
                    help="plan without sequence parallel: every TP rank holds the whole prefill chunk's AttnRes "
                    "blocks and computes every mix (with --sharded: the shard pass's seq_parallel=False)")
    pl.add_argument("--compare-full-attention", action="store_true",
                    help="also plan the same model with every layer full attention (MLA) and print both KV "
                    "throughputs (cache bytes / prefill time) by length")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON (stable keys) instead of text")
    pl.add_argument("--plot", metavar="FILE.png", type=_path("--plot"),
                    help="write the memory breakdown and roofline chart")
    pl.add_argument("--measured", metavar="BENCH.json", type=_path("--measured"),
                    help="benchmark records [{name, flops, bytes, seconds}] drawn on the roofline")
    from .commands.quantize import add_parsers as add_quant_parsers

    add_quant_parsers(sub, _positive, _seed)            # quantize, calibrate-router
    from .commands.serve import add_parser as add_serve_parser

    add_serve_parser(sub, _positive, _path, _seed)
    return p


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

    if _is_artifact(args.spec):
        given = "--target" if args.target is not None else "--passes" if args.passes is not None else None
        if given:
            raise ArgumentError(f"k3c inspect: {args.spec} is a compiled artifact (its target and passes are fixed); "
                                f"{given} applies to a spec")
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

        sys.stdout.write(bytes_summary(module))
        return 0
    if args.format == "text":
        from .ir import print_module

        from .analysis.mla_cost import mla_crossover_lines

        out = "".join(f"{line}\n" for line in mla_crossover_lines(module, model.target)) + print_module(module)
    elif args.format == "dot":
        from .ir.dot import to_dot

        out = to_dot(module)
    else:
        if not args.output:
            raise ArgumentError("k3c inspect: --format onnx writes a binary model; give -o FILE.onnx")
        from .ir.onnx_export import to_onnx

        data = to_onnx(module).SerializeToString()
        _write_atomic(args.output, data)
        print(f"k3c: wrote ONNX ({len(module.ops)} ops) to {args.output}")
        return 0
    if args.output:
        _write_atomic(args.output, out.encode())
    else:
        sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return 0


def cmd_run(args) -> int:
    from .commands.run import kernels_on, model_checkpoint

    flag = {"strict": "--strict", "allow-jit": "--allow-jit", "jit": "--jit"}.get(args.kernel_policy)
    if flag and args.no_kernels:
        raise ArgumentError(f"k3c run: {flag} chooses where kernels come from; it cannot go with --no-kernels")
    text = args.prompt is not None or args.prompt_file is not None
    if text:
        shape = next((f for f, v in (("--batch", args.batch), ("--prompt-len", args.prompt_len)) if v is not None),
                     None)
        if shape:
            raise ArgumentError(f"k3c run: {shape} shapes the random prompts of the report; it cannot go with "
                                f"{'--prompt' if args.prompt is not None else '--prompt-file'} (one sequence, as "
                                f"long as the text's tokens)")
    use_kernels = kernels_on(args.device, not args.no_kernels, args.interpret)
    sampled = [f for f, v in (("--temperature", args.temperature), ("--top-p", args.top_p),
                              ("--top-k", args.top_k)) if v is not None]
    if args.tp > 1 or (args.ep or 1) > 1:       # one process per rank (or this process under torchrun)
        unsupported = flag or ("--warmup" if args.warmup else "--no-warmup" if args.warmup is not None else None) \
            or ("--prompt" if text else None) or (sampled[0] if sampled else None) \
            or ("--kv-dtype" if args.kv_dtype != "auto" else None) or ("--speculate" if args.speculate else None)
        if unsupported:
            raise ArgumentError(f"k3c run: {unsupported} is not supported with --tp/--ep yet (one process per rank)")
        from .commands.ranks import run_report_distributed

        report = run_report_distributed(args.spec, tp=args.tp, ep=args.ep,
                                        weights=args.weights or model_checkpoint(args.spec), batch=args.batch or 1,
                                        prompt_len=args.prompt_len or 16, new_tokens=args.new_tokens or 8,
                                        seed=args.seed or 0, device=args.device, dtype=args.dtype or "float32",
                                        use_kernels=use_kernels, cuda_graphs=args.cuda_graphs)
        if report:                               # rank 0 reports (under torchrun the others print nothing)
            print(report)
        return 0
    from .commands.run import run_report, run_text
    from .runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature or 0.0, top_p=1.0 if args.top_p is None else args.top_p,
                              top_k=args.top_k or 0, seed=args.seed if text else args.seed or 0)
    common = dict(weights=args.weights, device=args.device, dtype=args.dtype, use_kernels=not args.no_kernels,
                  interpret=args.interpret, prefill_chunk=args.prefill_chunk, cuda_graphs=args.cuda_graphs,
                  warmup=args.warmup, kernel_policy=args.kernel_policy, sampling=sampling, kv_dtype=args.kv_dtype,
                  speculate=args.speculate, draft_len=args.draft_len)
    if not text:
        print(run_report(args.spec, batch=args.batch or 1, prompt_len=args.prompt_len or 16,
                         new_tokens=args.new_tokens or 8, seed=args.seed or 0, **common))
        return 0
    prompt = args.prompt if args.prompt is not None else _read_prompt_file(args.prompt_file)
    continuation, stats = run_text(args.spec, prompt, new_tokens=args.new_tokens or 64, seed=args.seed or 0,
                                   warn=lambda line: print(line, file=sys.stderr, flush=True), **common)
    out = prompt + continuation
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    sys.stdout.flush()
    print(stats, file=sys.stderr)
    return 0


def _read_prompt_file(path: str) -> str:
    """--prompt-file: a regular file's UTF-8 text, as it is."""
    from .paths import regular_file

    regular_file(path, "file (--prompt-file)")
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArgumentError(f"--prompt-file {path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ArgumentError(f"--prompt-file {path}: cannot read ({exc.strerror or exc})") from None


def cmd_plan(args) -> int:
    import json

    from .analysis.report import plan, write_plot

    result = plan(args.spec, args.target, tp=args.tp, ep=args.ep, context=args.context, batch=args.batch,
                  kv_dtype=args.kv_dtype, prefill_chunk=args.prefill_chunk, headroom=args.headroom, pp=args.pp,
                  vpp=args.vpp, measured=args.measured, sharded=args.sharded, prefix_interval=args.prefix_interval,
                  seq_parallel=args.seq_parallel, compare_full_attention=args.compare_full_attention)
    if args.plot:
        write_plot(result, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        sys.stdout.write(result.text())
    return 0


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ArgumentError(f"cannot write {path}: {exc.strerror}") from None


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
            "quantize": cmd_quantize, "calibrate-router": cmd_calibrate_router, "serve": cmd_serve}


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
            raise ArgumentError("k3c: give a command: compile, inspect, run, serve, plan, quantize or calibrate-router "
                                "(see k3c --help)")
        _check_ranks(args)
        return COMMANDS[args.command](args)
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
