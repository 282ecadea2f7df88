"""`k3c run` from its parsed arguments (k3c/commands/run_args.py): the checks that need several flags at once, then
the report of random prompts (run_report), text in and text out, streamed (run_text), or a conversation (run_chat),
or one process per rank (ranks.run_report_distributed)."""
from __future__ import annotations

import sys

from ..errors import ArgumentError


def run_command(args) -> int:
    from .run import kernels_on, model_checkpoint

    flag = {"strict": "--strict", "allow-jit": "--allow-jit", "jit": "--jit"}.get(args.kernel_policy)
    if flag and args.no_kernels:
        raise ArgumentError(f"{flag} chooses where kernels come from; it cannot go with --no-kernels")
    text = args.prompt is not None or args.prompt_file is not None or args.chat
    _check_modes(args, text)
    use_kernels = kernels_on(args.device, not args.no_kernels, args.interpret)
    sampled = [f for f, v in (("--temperature", args.temperature), ("--top-p", args.top_p), ("--top-k", args.top_k),
                              ("--repetition-penalty", args.repetition_penalty)) if v is not None]
    threads = args.thread_choice.line() if getattr(args, "thread_choice", None) else None
    if args.tp > 1 or (args.ep or 1) > 1:       # one process per rank (or this process under torchrun)
        unsupported = flag or ("--warmup" if args.warmup else "--no-warmup" if args.warmup is not None else None) \
            or ("--chat" if args.chat else "--prompt" if text else None) or (sampled[0] if sampled else None) \
            or ("--kv-dtype" if args.kv_dtype != "auto" else None) or ("--speculate" if args.speculate else None)
        if unsupported:
            raise ArgumentError(f"{unsupported} is not supported with --tp/--ep yet (one process per rank)")
        from .ranks import run_report_distributed

        report = run_report_distributed(args.spec, tp=args.tp, ep=args.ep,
                                        weights=args.weights or model_checkpoint(args.spec), batch=args.batch or 1,
                                        prompt_len=args.prompt_len or 16, new_tokens=args.new_tokens or 8,
                                        seed=args.seed or 0, device=args.device, dtype=args.dtype or "float32",
                                        use_kernels=use_kernels, cuda_graphs=args.cuda_graphs)
        if report:                               # rank 0 reports (under torchrun the others print nothing)
            print(report)
        return 0
    from ..runtime.sampling import SamplingParams
    from .run import run_report

    sampling = SamplingParams(temperature=args.temperature or 0.0, top_p=1.0 if args.top_p is None else args.top_p,
                              top_k=args.top_k or 0, seed=args.seed if text else args.seed or 0,
                              repetition_penalty=1.0 if args.repetition_penalty is None else args.repetition_penalty)
    common = dict(weights=args.weights, device=args.device, dtype=args.dtype, use_kernels=not args.no_kernels,
                  interpret=args.interpret, prefill_chunk=args.prefill_chunk, cuda_graphs=args.cuda_graphs,
                  kernel_policy=args.kernel_policy, kv_dtype=args.kv_dtype, speculate=args.speculate,
                  draft_len=args.draft_len, max_step_tokens=args.max_step_tokens)
    if not text:
        print(run_report(args.spec, batch=args.batch or 1, prompt_len=args.prompt_len or 16,
                         new_tokens=args.new_tokens or 8, seed=args.seed or 0, sampling=sampling,
                         warmup=args.warmup, threads=threads, **common))
        return 0
    if args.chat:
        return _chat(args, sampling, threads, common)
    return _text(args, sampling, threads, common)


def _check_modes(args, text: bool) -> None:
    if text:
        shape = next((f for f, v in (("--batch", args.batch), ("--prompt-len", args.prompt_len)) if v is not None),
                     None)
        if shape:
            given = "--chat" if args.chat else "--prompt" if args.prompt is not None else "--prompt-file"
            raise ArgumentError(f"{shape} shapes the random prompts of the report; it cannot go with {given} (one "
                                f"sequence, as long as the text's tokens)")
    if args.system is not None and not args.chat:
        raise ArgumentError("--system opens a --chat conversation; give --chat too")
    if args.stop and not text:
        raise ArgumentError("--stop ends generated text; give --prompt, --prompt-file or --chat")
    if args.chat and args.prompt_file is not None:
        raise ArgumentError("--chat reads its turns from the terminal; --prompt can give the first, --prompt-file "
                            "cannot")


def _out(delta: str) -> None:
    sys.stdout.write(delta)
    sys.stdout.flush()


def _text(args, sampling, threads, common) -> int:
    from .run import run_text

    prompt = args.prompt if args.prompt is not None else read_text_file(args.prompt_file, "--prompt-file")
    stream = args.stream
    started = []

    def on_text(delta: str) -> None:
        if not started:                 # the prompt once the model is built: an error never follows half a text
            started.append(True)
            _out(prompt)
        _out(delta)

    continuation, stats = run_text(args.spec, prompt, new_tokens=args.new_tokens or 64, sampling=sampling,
                                   seed=args.seed or 0, warmup=args.warmup, stop=tuple(args.stop or ()),
                                   on_text=on_text if stream else None, threads=threads,
                                   warn=lambda line: print(line, file=sys.stderr, flush=True), **common)
    if not started:
        _out(prompt + continuation)
    out = prompt + continuation
    if not out.endswith("\n"):
        _out("\n")
    print(stats, file=sys.stderr)
    return 0


def _chat(args, sampling, threads, common) -> int:
    from .run import run_chat

    interactive = sys.stdin.isatty()

    def turns():
        if args.prompt is not None:
            if interactive:
                print(f"you> {args.prompt}", flush=True)
            yield args.prompt
        while True:
            if interactive:
                sys.stdout.write("you> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                return
            yield line.rstrip("\n")

    def on_text(delta: str) -> None:
        _out(delta)

    turn_iter = turns()

    def framed():
        for turn in turn_iter:
            yield turn
            _out("\n")                  # the reply's end

    stats = run_chat(args.spec, framed(), system=args.system, new_tokens=args.new_tokens or 256, sampling=sampling,
                     stop=tuple(args.stop or ()), on_text=on_text, threads=threads, seed=args.seed or 0,
                     warn=lambda line: print(line, file=sys.stderr, flush=True), **common)
    print(stats, file=sys.stderr)
    return 0


def read_text_file(path: str, flag: str) -> str:
    """A regular file's UTF-8 text, as it is (`flag` names it in errors)."""
    from ..paths import regular_file

    regular_file(path, f"file ({flag})")
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArgumentError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ArgumentError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None
