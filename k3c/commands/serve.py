"""`k3c serve`: the model (an artifact, a model directory, a spec) behind the OpenAI-compatible HTTP API.

    k3c serve examples/k3-stdlib --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "k3-stdlib", "prompt": "import os\\n", "max_tokens": 32, "temperature": 0}'

The model, weights and engine are built as `k3c run` builds them (commands/run.py), with a prefix cache; the
engine then runs in its own thread (serve/engine_loop.py) and uvicorn serves the app (serve/app.py) on one socket
bound before the model loads (while it loads, serve/loading.py answers 503, `/health` "loading"; the "listening"
line says it is ready, and which port --port 0 took). SIGINT / SIGTERM:
open streams get a last error event, new requests a 503, every sequence leaves the engine, the process exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

from ..errors import ArgumentError

API_KEY_ENV = "K3C_API_KEY"
# --max-step-tokens' default: a step runs every decoding stream's token and at most this many tokens in all, prompts
# chunked into what is left (chunked prefill). 2048 is the low end of what vLLM and SGLang budget a step (2048-8192):
# with 64 streams, 1984 prompt tokens a step. Chosen, not yet measured for k3c: bench/serve_load.py --mixed
# --compare is the measurement that should move it (docs/runtime.md, "Step token budget").
MAX_STEP_TOKENS = 2048


def add_parser(sub, positive, path, seed) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                       "streaming, /metrics)")
    s.add_argument("model", help="model directory with a tokenizer (config.json, model.safetensors, "
                   "tokenizer.json), a compiled artifact directory, or a spec with --tokenizer")
    s.add_argument("--weights", type=path("--weights"), help="safetensors file or model directory (default: the "
                   "model directory's checkpoint, else random weights from --seed)")
    s.add_argument("--tokenizer", type=path("--tokenizer"), metavar="DIR",
                   help="directory holding tokenizer.json (and tokenizer_config.json with an optional "
                   "chat_template); default: the model's own")
    s.add_argument("--served-model-name", help="the model id clients send (default: the spec's name)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=lambda t: _port(t), default=8000, help="TCP port (default 8000; 0: a free one)")
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="default: float32 on a CPU, the artifact's first run dtype on a GPU")
    s.add_argument("--max-batch", type=positive("--max-batch", 4096), default=16,
                   help="sequences decoded together (default 16); more wait in the queue")
    s.add_argument("--max-context", "--max-model-len", dest="max_context", type=positive("--max-context", 1 << 24),
                   help="prompt + completion tokens per sequence (default: the model's max_context)")
    s.add_argument("--kv-dtype", choices=("auto", "bf16", "fp8"), default="auto", help="MLA latent cache format")
    s.add_argument("--host-bytes", type=lambda t: _bytes("--host-bytes", t), default=0,
                   help="host-memory tier of the prefix cache in bytes (default 0: evicted checkpoints are "
                   "dropped)")
    s.add_argument("--prefix-cache-bytes", type=lambda t: _bytes("--prefix-cache-bytes", t), default=1 << 30,
                   help="device bytes of prefix-cache checkpoints besides their pages (default 1 GiB)")
    s.add_argument("--prefix-interval", type=positive("--prefix-interval", 1 << 24), default=32768,
                   help="checkpoint every this many tokens inside a sequence, besides prompt ends and finished "
                   "requests (default 32768)")
    s.add_argument("--disk-dir", type=path("--disk-dir"), metavar="DIR",
                   help="disk tier of the prefix cache below the host tier: checkpoints evicted from host memory "
                   "go to safetensors files here (default: none, they are dropped)")
    s.add_argument("--kv-policy", choices=("lru", "working-set"), default="lru",
                   help="which prefix-cache checkpoints leave the device first: lru (default), or working-set for "
                   "multi-turn sessions past the page pool (active sessions' newest checkpoints protected for "
                   "--protect-s; new sessions wait for room rather than displace them)")
    s.add_argument("--protect-s", type=lambda t: _seconds(t, "--protect-s"), default=60.0,
                   help="working-set policy: seconds a session's newest checkpoint stays protected after its last "
                   "use (default 60)")
    s.add_argument("--admission", choices=("reserve", "optimistic"), default="reserve",
                   help="reserve (default): a request joins when its worst case (prompt + max tokens) fits; "
                   "optimistic: when its prompt fits, preempting the newest sequences (into --host-bytes, or "
                   "recomputed) when a step runs short")
    s.add_argument("--max-step-tokens", type=positive("--max-step-tokens", 1 << 24), default=MAX_STEP_TOKENS,
                   metavar="N", help=f"tokens one engine step runs: every decoding stream's next token, then chunks "
                   f"of waiting prompts up to N (default {MAX_STEP_TOKENS}), so a long prompt no longer stalls "
                   f"the streams; a number above --max-batch plus the longest prompt prefills whole prompts")
    s.add_argument("--itl-target-ms", type=lambda t: _millis(t, "--itl-target-ms"), metavar="MS",
                   help="inter-token latency target: while streams decode, a step takes only the prompt tokens "
                   "its measured costs say fit in MS milliseconds (at least 16; default: no target, "
                   "--max-step-tokens alone)")
    s.add_argument("--no-prefix-cache", action="store_true", help="no prefix cache")
    s.add_argument("--speculate", metavar="ngram|draft:PATH",
                   help="speculative decoding: ngram (prompt lookup) or draft:PATH (a draft model directory sharing "
                        "the tokenizer); greedy requests stay token-identical, sampled ones keep their distribution")
    s.add_argument("--draft-len", type=positive("--draft-len", 64), default=4,
                   help="most draft tokens verified per step with --speculate (default 4)")
    s.add_argument("--header-timeout", type=lambda t: _seconds(t, "--header-timeout", low=0.1), default=10.0,
                   metavar="S",
                   help="seconds a connection may take to send a request's headers (from its opening, or the end "
                   "of its previous response) before it is closed (default 10)")
    s.add_argument("--body-timeout", type=lambda t: _seconds(t, "--body-timeout", low=0.1), default=60.0,
                   metavar="S",
                   help="seconds a request body may take to arrive once its headers have (default 60; later: 408 "
                   "and the connection closes)")
    s.add_argument("--api-key", help=f"clients must send Authorization: Bearer KEY on /v1 routes (default: the "
                   f"{API_KEY_ENV} environment variable; unset: no key)")
    s.add_argument("--no-kernels", action="store_true", help="torch ops on a GPU too")
    s.add_argument("--threads", type=positive("--threads", 4096),
                   help="torch CPU threads (default: the cores this process may use, less the machine's load)")
    s.add_argument("--seed", type=seed, default=0, help="seed of random weights (default 0)")
    s.add_argument("--tp", type=positive("--tp", 4096),
                   help="tensor parallel ranks (default 1): heads, dense and shared-expert MLPs and the vocabulary "
                   "split over them; this process is rank 0 and starts the others (or run every rank under "
                   "torchrun); docs/distributed.md")
    s.add_argument("--ep", type=positive("--ep", 4096),
                   help="expert parallel ranks (default: --tp); --ep 1 with --tp N splits every expert over the TP "
                   "ranks; one of --tp, --ep divides the other and max(tp, ep) ranks run")
    s.add_argument("--dist-timeout", type=lambda t: _seconds(t, "--dist-timeout", low=1.0), default=300.0,
                   metavar="S", help="with --tp / --ep: seconds a step (or rank 0's word, for the other ranks) may "
                   "take before a rank counts as hung: open requests then get 503 and the server exits 1 "
                   "(default 300: a first step may compile kernels; a rank that exits is noticed at once)")
    s.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning",
                   help="uvicorn's and k3c serve's log level (default warning)")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"--port must be an integer in [0, 65535], got {text!r}")
    return int(text)


def prefix_cache(args, clock=None, rank: int | None = None):
    """The server's PrefixCache from its arguments (None: --no-prefix-cache). A rank of a sharded server: the
    clock rank 0 broadcasts, and a disk tier of its own (rankN/ under --disk-dir: each rank's checkpoints hold its
    shard)."""
    import time as _time

    from ..runtime.prefix_cache import PrefixCache

    if args.no_prefix_cache:
        return None
    disk_dir = args.disk_dir
    if disk_dir is not None and rank is not None:
        disk_dir = os.path.join(disk_dir, f"rank{rank}")
    return PrefixCache(interval=args.prefix_interval, max_bytes=args.prefix_cache_bytes, host_bytes=args.host_bytes,
                       disk=args.disk_dir is not None, disk_dir=disk_dir, policy=args.kv_policy,
                       protect_s=args.protect_s, clock=clock or _time.monotonic)


def build_engine(args, rank=None) -> dict:
    """The model, weights and engine of `k3c serve` (commands/run.py _build), with the context it serves under
    "context"; `rank` (serve_ranks.RankSetup): this rank's slice and lock-step engine."""
    from .run import _build

    cache = prefix_cache(args, None if rank is None else rank.clock, None if rank is None else rank.lay.rank)
    context: list[int] = []

    def sizes(model):
        ctx = args.max_context or model.spec.max_context
        if ctx > model.spec.max_context:
            raise ArgumentError(f"--max-context {ctx} exceeds the model's max_context {model.spec.max_context}")
        context.append(ctx)
        return args.max_batch, ctx, 0

    b = _build(args.model, weights=args.weights, seed=args.seed, device=args.device if rank is None else rank.device,
               dtype=args.dtype, use_kernels=not args.no_kernels, interpret=False, prefill_chunk=None,
               cuda_graphs=None, kernel_policy="artifact", sizes=sizes, kv_dtype=args.kv_dtype, prefix_cache=cache,
               size_flags=("--max-batch", "--max-context", None),
               admission=args.admission, speculate=args.speculate, draft_len=args.draft_len,
               max_step_tokens=args.max_step_tokens, itl_target_ms=args.itl_target_ms, rank=rank)
    b["context"] = context[0]
    return b


def _check_dir(path: str) -> None:
    """--disk-dir: a writable directory (made if missing), checked before anything loads."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ArgumentError(f"--disk-dir {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ArgumentError(f"--disk-dir {path}: cannot make the directory ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ArgumentError(f"--disk-dir {path}: not writable")


def _seconds(text: str, name: str, low: float = 0.0) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not low <= v <= 86400:
        raise argparse.ArgumentTypeError(f"{name} must be a number of seconds in [{low:g}, 86400], got {text!r}")
    return v


def _millis(text: str, name: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 3_600_000:
        raise argparse.ArgumentTypeError(f"{name} must be a number of milliseconds in (0, 3600000], got {text!r}")
    return v


def _bytes(name: str, text: str) -> int:
    if not text.isdigit() or int(text) > 1 << 50:
        raise argparse.ArgumentTypeError(f"{name} must be a whole number of bytes in [0, 2**50], got {text!r}")
    return int(text)


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ArgumentError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it every
    # response written in two parts (headers, body) waits out the client's delayed ACK (~40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ArgumentError(f"--host {host} --port {port}: cannot bind ({exc.strerror or exc})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _build_ranks(args, lay):
    """(build_engine's result, the Leader of the other ranks or None): one process, or rank 0 of a sharded server
    (the other ranks started unless torchrun did; every rank hears whether all of them built; a failure stops them)."""
    from . import serve_ranks

    if lay is None:
        return build_engine(args), None
    leader = serve_ranks.Leader.start(args, lay)
    try:
        try:
            b = build_engine(args, rank=leader.setup)
        except BaseException as exc:
            serve_ranks.exchange_ready(leader.setup, exc)      # every rank hears of it, then raises it
            raise
        serve_ranks.exchange_ready(leader.setup, None)
    except BaseException:
        leader.abort()
        raise
    return b, leader


def cmd_serve(args) -> int:
    import uvicorn

    from ..runtime.text import load_tokenizer
    from ..serve.app import SHUTDOWN_GRACE_S, body_limit, build_app
    from ..serve.chat import ChatTemplate
    from ..serve.connection import with_header_timeout
    from ..serve.engine_loop import EngineLoop
    from ..serve.grammar import Grammars
    from ..serve.metrics import ServerMetrics
    from ..serve.protocol import ModelInfo
    from . import serve_ranks
    from .run import _check_run_args

    _check_run_args(batch=args.max_batch, prompt_len=1, new_tokens=1, prefill_chunk=None, seed=args.seed,
                    device=args.device, kernel_policy="artifact", use_kernels=not args.no_kernels)
    lay = serve_ranks.layout(args)              # None: one process
    if lay is not None:
        serve_ranks.check_model_shards(args, lay)
        if lay.rank != 0:                       # under torchrun: a rank that follows rank 0
            return serve_ranks.follower_main(args, lay, build_engine)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise ArgumentError("--api-key must not be empty")
    if args.disk_dir is not None:
        _check_dir(args.disk_dir)
    sock = _bind(args.host, args.port)          # before the model loads: a taken port fails at once
    from ..serve.loading import LoadingResponder

    loading = LoadingResponder(sock).start()    # 503 ("loading") until the model is ready
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"k3c serve: loading {args.model} (http://{bound_host if ':' not in bound_host else f'[{bound_host}]'}:"
          f"{bound_port} answers 503 until it is ready)", flush=True)
    leader = None
    try:
        t0 = time.perf_counter()
        b, leader = _build_ranks(args, lay)
        model, eng, context = b["model"], b["eng"], [b["context"]]
        tok = load_tokenizer(args.tokenizer, model.spec.vocab_size) if args.tokenizer else model.tokenizer
        if tok is None:
            raise ArgumentError(f"{args.model}: no tokenizer (tokenizer.json); give --tokenizer DIR")
        template = ChatTemplate.from_directory(os.path.dirname(tok.path),
                                               eos_token=None if tok.eos_id is None else
                                               tok.decode([tok.eos_id], skip_special_tokens=False))
        info = ModelInfo(name=args.served_model_name or model.spec.name, tokenizer=tok, max_context=context[0],
                         vocab_size=model.spec.vocab_size, render_chat=template.render, created=int(time.time()),
                         max_prompt_chars=tok.max_chars(context[0]), grammars=Grammars(tok, model.spec.vocab_size))
        metrics = ServerMetrics()
        loop = EngineLoop(eng, metrics, eos_id=tok.eos_id)
        max_body = body_limit(info.max_prompt_chars)
        app = build_app(loop, info, metrics, api_key=api_key, body_timeout=args.body_timeout, max_body_bytes=max_body)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                loop.shutdown("the server is shutting down", timeout=0)   # streams get their error event
                super().handle_exit(sig, frame)
                # uvicorn re-raises a captured signal once it has shut down (the process then dies of it); this
                # server has shut down cleanly by then and exits 0 with its last line
                self._captured_signals.clear()

        server = _Server(uvicorn.Config(app, log_level=args.log_level, lifespan="off", access_log=False,
                                        http=with_header_timeout(args.header_timeout),
                                        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S) + 5))
        loop.start()
        if leader is not None:
            leader.supervise(loop, server)
        host, port = sock.getsockname()[:2]
        weights = b["weights"] or f"random (seed {args.seed})"
        where = args.device if lay is None else f"{lay.describe(args.device)} on {args.device}"
        target = f" within {args.itl_target_ms:g} ms" if args.itl_target_ms is not None else ""
        print(f"k3c serve: {info.name} on {where} ({b['dtype']}, weights {weights}; max batch "
              f"{args.max_batch}, context {info.max_context}, {eng.pool.num_pages} MLA pages, {args.max_step_tokens} "
              f"tokens a step{target}; chat template "
              f"{template.origin}; requests up to {max_body} bytes, prompts up to "
              f"{info.max_prompt_chars or 'any number of'} characters; ready in {time.perf_counter() - t0:.1f} s)",
              flush=True)
        if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            print(f"k3c serve: warning: bound to {args.host} without an API key: anyone who can reach it can use it",
                  file=sys.stderr, flush=True)
        loading.stop()                          # connections from here on wait for uvicorn, a moment away
        print(f"k3c serve: listening on http://{host if ':' not in host else f'[{host}]'}:{port} "
              f"(Ctrl-C stops)", flush=True)
        server.run(sockets=[sock])
        loop.shutdown(timeout=30.0 if leader is None or leader.failure is None else 0)
        code = 0 if leader is None else leader.finish()     # the ranks told to stop (a failure: exits 1 there)
        steps = loop.steps if leader is None else eng.stats["steps"]     # not counting the heartbeats
        print(f"k3c serve: stopped after {steps} engine steps; {eng.pool.num_free} of {eng.pool.num_pages} "
              f"MLA pages free (the rest hold prefix-cache checkpoints)", flush=True)
        return code
    except BaseException:
        if leader is not None:
            leader.abort()
        raise
    finally:
        loading.stop()
        sock.close()


if __name__ == "__main__":          # a rank that a sharded server's rank 0 started (commands/serve_ranks.py)
    from . import serve_ranks

    sys.exit(serve_ranks.spawned_main(build_engine))
