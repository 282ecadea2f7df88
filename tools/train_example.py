"""Train the example model `examples/k3-stdlib` (architecture: tools/k3-stdlib.yaml) on the Python standard
library's own source files, through k3c's reference forward with autograd.

    python tools/train_example.py prepare -o .data/k3-stdlib          # CPU, ~1 min: corpus, BPE tokenizer, token ids
    python tools/train_example.py train --data .data/k3-stdlib -o OUT  # GPU: model directory OUT (HF K3 layout)

`prepare` reads every `*.py` under the running interpreter's stdlib (sysconfig's `stdlib` path, site-packages
excluded), in sorted path order; a file goes to the held-out split when the sha256 of its relative path is 0 mod 20.
The byte-level BPE tokenizer (`tokenizers`) is trained on the training split only; documents are joined with
`<|endoftext|>`. It writes tokenizer.json, tokenizer_config.json, tokens.safetensors (uint16 ids of both splits) and
corpus.json (Python version, file counts, bytes, the corpus sha256), so a training run names exactly what it saw.

`train` draws windows of --seq-len + 1 tokens at uniformly random offsets of the training stream (one generator
seeded from --seed); the first --copy-frac of each batch's windows repeat a span of their text (`copy_windows`), so
the model learns to copy as an agent's context quotes tool output (prompt lookup drafts only what a model copies);
it runs AdamW with a linear warm-up and a cosine decay, clips gradients, and balances the experts
without an auxiliary loss: after each step every MoE layer's router bias moves by --bias-rate towards the mean load
(sign rule; the bias picks experts, it never enters the weights: K3.md section 5). Deterministic algorithms are on, so
the same data, seed, step count and machine give the same weights. `--minutes M` (instead of --steps) times a few
steps on a throwaway copy first, picks the step count that fits M minutes, and records it in training.json: pass it
as --steps to reproduce the run. The model directory gets config.json + model.safetensors (bf16; fp32 where the spec
keeps fp32: A_log, dt_bias, router bias) + tokenizer files + training.json (settings, loss curve, held-out loss and
perplexity over the whole held-out split in non-overlapping --seq-len windows).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import sysconfig
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EOT = "<|endoftext|>"
DEFAULT_SPEC = ROOT / "tools" / "k3-stdlib.yaml"


# -- prepare -----------------------------------------------------------------------------------------------------
def corpus_files(stdlib: pathlib.Path) -> list[pathlib.Path]:
    return sorted((p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file()),
                  key=lambda p: p.relative_to(stdlib).as_posix())


def held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 20 == 0


def read_corpus(stdlib: pathlib.Path) -> tuple[list[str], list[str], dict]:
    train, valid, digest, nbytes = [], [], hashlib.sha256(), 0
    for p in corpus_files(stdlib):
        rel = p.relative_to(stdlib).as_posix()
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue                 # a few test files are deliberately not UTF-8
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
        nbytes += len(text.encode())
        (valid if held_out(rel) else train).append(text)
    if not train or not valid:
        raise SystemExit(f"{stdlib}: the corpus needs files in both splits (training {len(train)}, held-out "
                         f"{len(valid)})")
    info = {"python": platform.python_version(), "stdlib": str(stdlib), "files_train": len(train),
            "files_heldout": len(valid), "bytes": nbytes, "sha256": digest.hexdigest()}
    return train, valid, info


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_split(tok, texts: list[str]):
    import torch

    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32).to(torch.uint16)


def cmd_prepare(args) -> None:
    import k3c
    from safetensors.torch import save_file

    spec = k3c.load_spec(args.spec)
    stdlib = pathlib.Path(args.stdlib or sysconfig.get_paths()["stdlib"])
    t0 = time.perf_counter()
    train, valid, info = read_corpus(stdlib)
    tok = train_tokenizer(train, spec.vocab_size)
    if tok.get_vocab_size() != spec.vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, the spec {spec.vocab_size}")
    out = pathlib.Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tensors = {"train": encode_split(tok, train), "heldout": encode_split(tok, valid)}
    save_file(tensors, str(out / "tokens.safetensors"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec), indent=2) + "\n")
    info.update(tokens_train=int(tensors["train"].numel()), tokens_heldout=int(tensors["heldout"].numel()),
                vocab_size=spec.vocab_size, seconds=round(time.perf_counter() - t0, 1))
    (out / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


def tokenizer_config(spec) -> dict:
    """What transformers' AutoTokenizer needs beside tokenizer.json (and k3c reads the EOS token from)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None, "unk_token": None,
            "pad_token": EOT, "model_max_length": spec.max_context, "clean_up_tokenization_spaces": False}


# -- train -------------------------------------------------------------------------------------------------------
# Zero at the start: the output mix begins as the plain average of the blocks (the AttnRes paper's initialisation);
# the per-layer mixes keep k3c.init_weights' random queries (depth scores O(1)).
ZERO_INIT = ("output_attn_res.proj_weight",)


def init_params(spec, seed: int, device):
    """k3c.init_weights in fp32 on `device`, with the ZERO_INIT tensors zeroed."""
    import torch

    from k3c.runtime.weights import init_weights

    w = init_weights(spec, seed=seed, dtype=torch.float32, device=device)
    for name in ZERO_INIT:
        w[name].zero_()
    return w


def router_bias_names(spec) -> list[str]:
    return [f"layers.{i}.block_sparse_moe.gate.e_score_correction_bias" for i in range(spec.num_layers)
            if spec.is_moe_layer(i)]


class LoadCounter:
    """The `choose_experts` hook of the reference model: counts each MoE layer's expert picks of a forward (the
    router is called once per MoE layer, in layer order) and returns the choice unchanged."""

    def __init__(self, num_moe: int, num_experts: int, device):
        self.counts = [None] * num_moe
        self.num_experts, self.device, self.calls = num_experts, device, 0

    def __call__(self, ids):
        import torch

        self.counts[self.calls % len(self.counts)] = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.calls += 1
        return ids


def windows(stream, starts, seq_len: int):
    import torch

    idx = starts[:, None] + torch.arange(seq_len + 1, device=stream.device)[None]
    batch = stream[idx]
    return batch[:, :-1], batch[:, 1:]


def copy_windows(stream, starts, seq_len: int, gen):
    """Windows whose text repeats itself, as an agent's context does when it quotes a tool's output: a span S of
    seq_len/8 .. seq_len/2 tokens from each start, then S again from a random point in its first half, then the text
    that followed S in the stream. Returns (inputs, targets, repeat), repeat marking the targets that a model which
    copies predicts (inside the repeat, after its first token)."""
    import torch

    n = starts.numel()
    span = torch.randint(seq_len // 8, seq_len // 2 + 1, (n, 1), generator=gen)
    skip = (torch.rand((n, 1), generator=gen) * (span // 2 + 1)).long()       # the repeat starts at S[skip]
    again = span - skip
    t = torch.arange(seq_len + 1)[None]
    offset = torch.where(t < span, t, torch.where(t < span + again, t - span + skip, t - again))
    batch = stream[(starts.cpu()[:, None] + offset).to(stream.device)]
    repeat = ((t[:, 1:] > span) & (t[:, 1:] < span + again)).to(stream.device)
    return batch[:, :-1], batch[:, 1:], repeat


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


class Trainer:
    def __init__(self, spec, data, args, device):
        import torch

        from k3c.reference.model import ReferenceModel

        self.spec, self.args, self.device = spec, args, device
        self.params = init_params(spec, args.seed, device)
        self.bias_names = router_bias_names(spec)
        trainable = [n for n in self.params if n not in self.bias_names]
        for n in trainable:
            self.params[n].requires_grad_(True)
        decay = [self.params[n] for n in trainable if self.params[n].dim() >= 2 and "embed" not in n]
        rest = [self.params[n] for n in trainable if not (self.params[n].dim() >= 2 and "embed" not in n)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                     eps=1e-8)
        self.loads = LoadCounter(len(self.bias_names), spec.mlp.moe.num_experts if self.bias_names else 1, device)
        self.model = ReferenceModel(spec, self.params, dtype=torch.float32, chunk_size=args.chunk_size,
                                    choose_experts=self.loads if self.bias_names else None)
        self.train_stream = data["train"].to(device=device, dtype=torch.int64)
        self.gen = torch.Generator(device="cpu").manual_seed(args.seed)

    def loss(self, x, y):
        import torch.nn.functional as F

        logits = self.model.forward_autograd(x)[0]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def step(self, step: int, steps: int) -> float:
        import torch

        a = self.args
        starts = torch.randint(0, self.train_stream.numel() - a.seq_len - 1, (a.batch,), generator=self.gen)
        x, y = windows(self.train_stream, starts.to(self.device), a.seq_len)
        copies = round(a.copy_frac * a.batch)
        if copies:                       # the first rows repeat their text (no draws at all when copy_frac is 0)
            x[:copies], y[:copies], _ = copy_windows(self.train_stream, starts[:copies], a.seq_len, self.gen)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, steps, a.lr, a.warmup)
        loss = self.loss(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], a.clip)
        self.opt.step()
        with torch.no_grad():
            for name, counts in zip(self.bias_names, self.loads.counts):
                load = counts.float()
                self.params[name].add_(a.bias_rate * torch.sign(load.mean() - load))
        return float(loss.detach())

    def evaluate(self, stream, seq_len: int, max_windows: int | None = None) -> float:
        """Mean next-token loss (nats) over non-overlapping windows of `stream`, each from a fresh context."""
        import torch

        n = (stream.numel() - 1) // seq_len
        if max_windows is not None:
            n = min(n, max_windows)
        total, count = 0.0, 0
        with torch.no_grad():
            for lo in range(0, n, self.args.batch):
                starts = torch.arange(lo, min(n, lo + self.args.batch), device=self.device) * seq_len
                x, y = windows(stream, starts, seq_len)
                logits = self.model.forward(x)[0]
                total += float(torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"))
                count += y.numel()
        return total / count

    def evaluate_copy(self, stream, seq_len: int, windows_: int, seed: int = 0) -> dict:
        """How well the model copies: copy windows of the held-out stream (fixed seed), the mean loss and the greedy
        top-1 accuracy over the tokens a copy predicts."""
        import torch

        gen = torch.Generator(device="cpu").manual_seed(seed)
        starts = torch.randint(0, stream.numel() - seq_len - 1, (windows_,), generator=gen)
        loss, hits, count = 0.0, 0, 0
        with torch.no_grad():
            for lo in range(0, windows_, self.args.batch):
                x, y, rep = copy_windows(stream, starts[lo:lo + self.args.batch], seq_len, gen)
                logits = self.model.forward(x)[0].float()
                loss += float(torch.nn.functional.cross_entropy(logits[rep], y[rep], reduction="sum"))
                hits += int((logits[rep].argmax(-1) == y[rep]).sum())
                count += int(rep.sum())
        return {"loss": round(loss / count, 4), "top1": round(hits / count, 4), "tokens": count,
                "windows": windows_}


def time_steps(spec, data, args, device, n: int = 8) -> float:
    """Seconds per training step, measured on a throwaway trainer (after two untimed steps)."""
    import torch

    probe = Trainer(spec, data, args, device)
    for i in range(2):
        probe.step(i, 100)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    sync()
    t = time.perf_counter()
    for i in range(n):
        probe.step(i, 100)
    sync()
    return (time.perf_counter() - t) / n


def save_model(spec, params, out: pathlib.Path, data_dir: pathlib.Path, record: dict) -> None:
    import torch

    from k3c.frontend.weight_names import weight_table
    from k3c.runtime.checkpoint import save_k3_checkpoint

    table = weight_table(spec)
    weights = {n: t.detach().to("cpu", torch.float32 if table[n].dtype == "fp32" else torch.bfloat16).contiguous()
               for n, t in params.items()}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_k3_checkpoint(spec, weights, tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data_dir / name, tmp / name)
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def set_numerics(args) -> None:
    """--deterministic: deterministic algorithms (bitwise-repeatable runs on one machine, at a speed cost: the
    profile subcommand measures it); --tf32: TF32 tensor-core matmuls for the training run (the shipped weights are
    what is checked; how they were computed is not)."""
    import torch

    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(bool(args.deterministic), warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.tf32)


def cmd_profile(args) -> None:
    """Seconds per step and tokens/s of each setting (deterministic x tf32 x batch), a profiler table of the
    default setting's step, and, on the last line, the train flags of the fastest setting in tokens/s."""
    import copy

    import torch
    from safetensors.torch import load_file

    import k3c

    spec = k3c.load_spec(args.spec)
    data = load_file(str(pathlib.Path(args.data) / "tokens.safetensors"))
    device = torch.device(args.device)
    results = []
    for det, tf32, batch in ((True, False, 32), (False, False, 32), (False, True, 32), (False, True, 64)):
        a = copy.copy(args)
        a.deterministic, a.tf32, a.batch = det, tf32, batch
        set_numerics(a)
        sec = time_steps(spec, data, a, device, n=4)
        results.append((batch * a.seq_len / sec, det, tf32, batch))
        print(f"deterministic {det!s:5} tf32 {tf32!s:5} batch {batch}: {sec * 1e3:7.1f} ms/step, "
              f"{batch * a.seq_len / sec:,.0f} tokens/s", flush=True)
    a = copy.copy(args)
    a.deterministic, a.tf32, a.batch = False, True, 32
    set_numerics(a)
    trainer = Trainer(spec, data, a, device)
    trainer.step(0, 100)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                                ) as prof:
        trainer.step(1, 100)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=50))
    best = max(results)
    print(("--deterministic" if best[1] else "--no-deterministic") + (" --tf32" if best[2] else " --no-tf32")
          + f" --batch {best[3]}")


def _repo_relative(path: str) -> str:
    p = pathlib.Path(path).resolve()
    return p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else str(path)


def cmd_train(args) -> None:
    import torch
    from safetensors.torch import load_file

    import k3c

    set_numerics(args)
    device = torch.device(args.device)
    spec = k3c.load_spec(args.spec).replace(name=pathlib.Path(args.output).name)
    data_dir = pathlib.Path(args.data)
    data = load_file(str(data_dir / "tokens.safetensors"))
    corpus = json.loads((data_dir / "corpus.json").read_text())
    steps, probe_s = args.steps, None
    if steps is None:
        probe_s = time_steps(spec, data, args, device)
        # the held-out evaluations cost about as much as a few percent of the steps
        steps = max(args.warmup + 1, int(args.minutes * 60 * 0.93 / probe_s))
        print(f"probe: {probe_s * 1e3:.1f} ms per step -> {steps} steps in {args.minutes} minutes", flush=True)
    torch.manual_seed(args.seed)
    trainer = Trainer(spec, data, args, device)
    heldout = data["heldout"].to(device=device, dtype=torch.int64)
    curve, evals, t0 = [], [], time.perf_counter()
    for step in range(steps):
        loss = trainer.step(step, steps)
        if step % args.log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(loss, 4), "seconds": round(time.perf_counter() - t0, 1)})
            print(f"step {step:6d}  loss {loss:.4f}  {time.perf_counter() - t0:7.1f} s", flush=True)
        if (step + 1) % args.eval_every == 0 and step + 1 < steps:
            ev = trainer.evaluate(heldout, args.seq_len, max_windows=args.eval_windows)
            evals.append({"step": step + 1, "heldout_loss": round(ev, 4)})
            print(f"  held-out loss {ev:.4f} (first {args.eval_windows} windows)", flush=True)
    train_s = time.perf_counter() - t0
    final = trainer.evaluate(heldout, args.seq_len, max_windows=args.final_windows)
    what = "whole split" if args.final_windows is None else f"first {args.final_windows} windows"
    print(f"held-out loss {final:.4f}, perplexity {math.exp(final):.3f} ({what}); {train_s:.0f} s of training")
    copying = trainer.evaluate_copy(heldout, args.seq_len, args.eval_windows)
    print(f"held-out copy windows: loss {copying['loss']:.4f}, top-1 {copying['top1']:.1%} over the repeated tokens")
    record = {
        "spec": _repo_relative(args.spec),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "cmd", "output", "data", "device")}
        | {"steps": steps, "spec": _repo_relative(args.spec)},
        "probe_seconds_per_step": probe_s, "corpus": corpus, "device": torch.cuda.get_device_name(device)
        if device.type == "cuda" else platform.processor() or "cpu", "torch": torch.__version__,
        "train_seconds": round(train_s, 1), "loss_curve": curve, "heldout_curve": evals,
        "heldout": {"loss": round(final, 4), "perplexity": round(math.exp(final), 3),
                    "tokens": int(heldout.numel()), "window": args.seq_len,
                    "windows": args.final_windows or (heldout.numel() - 1) // args.seq_len},
        "heldout_copy": copying,
    }
    save_model(spec, trainer.params, pathlib.Path(args.output), data_dir, record)
    print(f"wrote {args.output}")


def _training_args(p) -> None:
    p.add_argument("--data", required=True, help="the folder `prepare` wrote")
    p.add_argument("--spec", default=str(DEFAULT_SPEC))
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--copy-frac", type=float, default=0.25,
                   help="fraction of each batch's windows that repeat a span of their text (copy_windows)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of the evaluations during training")
    p.add_argument("--final-windows", type=int, help="held-out windows of the final evaluation (default: all)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="deterministic algorithms (default on)")
    p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=False,
                   help="TF32 matmuls in training (default off)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus, tokenizer and token ids")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--spec", default=str(DEFAULT_SPEC))
    p.add_argument("--stdlib", help="the stdlib folder to read (default: this interpreter's)")
    p.set_defaults(func=cmd_prepare)
    t = sub.add_parser("train", help="train and write the model directory")
    t.add_argument("-o", "--output", required=True)
    group = t.add_mutually_exclusive_group()
    group.add_argument("--steps", type=int)
    group.add_argument("--minutes", type=float, default=8.0)
    _training_args(t)
    t.set_defaults(func=cmd_train)
    pr = sub.add_parser("profile", help="time a step in each setting; print the fastest's train flags")
    _training_args(pr)
    pr.set_defaults(func=cmd_profile)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
