"""`k3c run`'s arguments, in the groups `k3c run --help` shows them (input, generation, sampling, performance, cache,
kernels, parallel), each help line saying its default."""
from __future__ import annotations

import argparse

from ..limits import MAX_BATCH, MAX_TOKENS, MAX_TOP_K
from .argtypes import count, escaped, number, path, positive, seed

DESCRIPTION = """\
With --prompt / --prompt-file: the text is encoded with the model's tokenizer, continued through the serving engine
(greedy, or sampled with --temperature / --top-p / --top-k / --seed) and written to stdout as the tokens are decided,
after the prompt, until the EOS token, a --stop string or --new-tokens; a short stats block goes to stderr.
With --chat: a conversation in the terminal (the model's chat template; a line per turn, an empty line or EOF ends).
Without either: --batch random prompts of --prompt-len tokens, and a report (TTFT, tokens/s, memory, MLA modes).

  k3c run examples/k3-stdlib --prompt "import os\\n" --new-tokens 32
  k3c run examples/k3-stdlib --prompt "import os\\n\\n\\ndef " --new-tokens 64 --repetition-penalty 1.2
"""


def add_parser(sub, parallel_args) -> None:
    r = sub.add_parser("run", help="run a model: text in, text out with --prompt (streamed), a conversation with "
                       "--chat; otherwise random prompts and a report of speed and memory",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=DESCRIPTION)
    r.add_argument("spec", help="YAML spec, config.json, model directory, or a compiled artifact directory")
    _input(r.add_argument_group("input"))
    _generation(r.add_argument_group("generation"))
    _sampling(r.add_argument_group("sampling"))
    _performance(r.add_argument_group("performance"))
    _cache(r.add_argument_group("cache"))
    _kernels(r.add_argument_group("kernels"))
    parallel_args(r.add_argument_group("parallel (one process per rank)"))
    r.set_defaults(kernel_policy="artifact")


def _input(g) -> None:
    g.add_argument("--weights", metavar="PATH", type=path("--weights"),
                   help="safetensors file or Hugging Face model directory (default: the checkpoint of the model "
                   "directory given as the model, else random init; an artifact holds no weights: give --weights "
                   "for trained ones)")
    text = g.add_mutually_exclusive_group()
    text.add_argument("--prompt", metavar="TEXT", type=escaped,
                      help="the text to continue; the escapes \\n (newline), \\t (tab) and \\\\ (backslash) "
                      "are interpreted, any other backslash is kept (default: none, random prompts)")
    text.add_argument("--prompt-file", metavar="FILE", type=path("--prompt-file"),
                      help="the text to continue, read from a UTF-8 file as it is (default: none)")
    g.add_argument("--chat", action="store_true",
                   help="a conversation: each line read from the terminal (stdin) is a user turn, rendered with the "
                   "model's chat template (tokenizer_config.json; default: 'role: text' lines), the reply streamed; "
                   "--prompt, if given, is the first turn (default: off)")
    g.add_argument("--system", metavar="TEXT", type=escaped,
                   help="a system message opening the --chat conversation (default: none)")
    g.add_argument("--batch", metavar="N", type=positive("--batch", MAX_BATCH),
                   help="random prompts (default 1; not with --prompt; refused before anything is allocated when "
                   "the run's estimated memory exceeds the device's)")
    g.add_argument("--prompt-len", metavar="N", type=positive("--prompt-len", MAX_TOKENS),
                   help="tokens per random prompt (default 16; not with --prompt; prompt + new tokens <= the "
                   "model's max_context)")
    g.add_argument("--seed", metavar="S", type=seed,
                   help="seed of the random weights and prompts (default 0) and of the sampling draws (default: 0, "
                   "or with --prompt one drawn and printed), in [0, 2**63 - 1]")


def _generation(g) -> None:
    g.add_argument("--new-tokens", "--max-tokens", dest="new_tokens", metavar="N",
                   type=positive("--new-tokens", MAX_TOKENS),
                   help="tokens to generate (default 8; with --prompt 64, with --chat 256 a turn; fewer when the EOS "
                   "token or a --stop string comes first)")
    g.add_argument("--stop", metavar="TEXT", action="append", type=escaped,
                   help="end the text where this string appears (not printed); repeat for several (default: the "
                   "EOS token only; with the plain --chat template also a new 'user:' line)")
    g.add_argument("--no-stream", dest="stream", action="store_false",
                   help="print the text once generation ends instead of as each token is decided (default: stream)")


def _sampling(g) -> None:
    g.add_argument("--temperature", metavar="T", type=number("--temperature"),
                   help="sampling temperature (default 0: greedy, the most likely token; one below 1e-4 samples at "
                   "1e-4)")
    g.add_argument("--top-p", metavar="P", type=number("--top-p"),
                   help="sample from the smallest set of the most likely tokens whose probability reaches P, in "
                   "(0, 1] (default 1: all)")
    g.add_argument("--top-k", metavar="K", type=count("--top-k", MAX_TOP_K),
                   help="sample from the K most likely tokens (default 0: all; past the vocabulary: all)")
    g.add_argument("--repetition-penalty", type=number("--repetition-penalty"), metavar="P",
                   help="divide the positive logits (multiply the negative ones) of every token already in the "
                   "context by P before choosing, as transformers does; > 1 discourages loops (default 1: off)")


def _performance(g) -> None:
    g.add_argument("--device", metavar="DEVICE", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="weights and activations (default: float32 on a CPU and with --tp/--ep; on a GPU the "
                   "artifact's first run dtype, bfloat16 unless compiled with --run-dtypes float32)")
    g.add_argument("--threads", metavar="N", type=positive("--threads", 4096),
                   help="torch CPU threads (default: the cores this process may use, less the machine's load, "
                   "at least 1; or OMP_NUM_THREADS; the report says which)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="one untimed pass of the same requests before the timed one (JIT compiles, CUDA graph "
                   "capture of every length bucket), reported apart; TTFT and tokens/s are the timed pass's "
                   "(default: on with --device cuda, off on a CPU, where there is no JIT: the rates then include "
                   "first-call costs, and say so)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps through captured CUDA graphs (runtime/cuda_graph.py; default: on with --device "
                   "cuda and kernels; falls back to the ordinary step where capture is impossible, reported)")
    g.add_argument("--speculate", metavar="ngram|draft:PATH",
                   help="speculative decoding: ngram (prompt lookup in the sequence's own context) or draft:PATH (a "
                        "draft model directory sharing the tokenizer, e.g. examples/k3-stdlib-draft) (default: off)")
    g.add_argument("--draft-len", metavar="N", type=positive("--draft-len", 64), default=4,
                   help="most draft tokens verified per step with --speculate (default 4)")
    g.add_argument("--prefill-chunk", metavar="N", type=positive("--prefill-chunk", MAX_TOKENS),
                   help="prefill at most this many tokens per sequence and step (default: the whole prompt)")
    g.add_argument("--max-step-tokens", metavar="N", type=positive("--max-step-tokens", MAX_TOKENS),
                   help="run at most N tokens per engine step, all sequences together: decoding rows first, prompts "
                   "chunked into the rest (chunked prefill; bounds a step's activations) (default: no budget)")


def _cache(g) -> None:
    g.add_argument("--kv-dtype", choices=("auto", "bf16", "fp8"), default="auto",
                   help="MLA latent cache format: auto = the activation dtype; fp8 = e4m3 codes with per-token "
                   "scales, 592 B per token and layer instead of 1,152 (needs --dtype bfloat16) (default auto)")


def _kernels(g) -> None:
    g.add_argument("--no-kernels", action="store_true",
                   help="run every op through torch on a GPU too (default: the generated kernels on a GPU; a CPU "
                   "runs torch ops)")
    g.add_argument("--interpret", action="store_true",
                   help="on a CPU, run the generated kernels in the Triton interpreter (~25 ms a launch: minutes "
                   "for what the torch ops do in seconds; default on a CPU: the torch ops)")
    pol = g.add_mutually_exclusive_group()
    pol.add_argument("--strict", dest="kernel_policy", action="store_const", const="strict",
                     help="a kernel launch missing from the artifact is an error (default: JIT-compiled once, "
                     "with a warning, counted in the report)")
    pol.add_argument("--allow-jit", dest="kernel_policy", action="store_const", const="allow-jit",
                     help="run an artifact compiled for another target by JIT-compiling its kernel sources for "
                     "this device (default: refused)")
    pol.add_argument("--jit", dest="kernel_policy", action="store_const", const="jit",
                     help="ignore the artifact's binaries and JIT-compile every kernel from source (the pre-loader "
                     "path, for comparison; default: off)")
