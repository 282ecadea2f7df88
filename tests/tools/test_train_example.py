"""tools/train_example.py (the example model's training) on a tiny spec and corpus, and the shipped model itself."""
from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import shutil
import sysconfig

import pytest
import torch

import k3c

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "k3-stdlib"


def _load_tool():
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "tools" / "train_example.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tool = _load_tool()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A corpus of seven stdlib modules (chunk.py and uu.py fall in the held-out split), a 320-token tokenizer on them, a k3-tiny spec with that vocabulary."""
    root = tmp_path_factory.mktemp("train")
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    lib = root / "lib"
    lib.mkdir()
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "chunk.py", "uu.py"):
        shutil.copyfile(stdlib / name, lib / name)
    text = (ROOT / "examples" / "k3-tiny.yaml").read_text().replace("vocab_size: 256", "vocab_size: 320")
    spec_path = root / "tiny.yaml"
    spec_path.write_text(text)
    tool.main(["prepare", "-o", str(root / "data"), "--spec", str(spec_path), "--stdlib", str(lib)])
    return root, spec_path


def _train(root, spec_path, out, seed=0):
    tool.main(["train", "--data", str(root / "data"), "-o", str(out), "--spec", str(spec_path), "--device", "cpu",
               "--steps", "3", "--batch", "2", "--seq-len", "32", "--warmup", "2", "--seed", str(seed),
               "--log-every", "1", "--final-windows", "2", "--chunk-size", "16", "--copy-frac", "0.5"])


def test_copy_windows_repeat_a_span_then_continue_the_stream():
    stream = torch.randperm(100_000, generator=torch.Generator().manual_seed(0))  # a value names its offset
    where = {int(v): i for i, v in enumerate(stream)}
    gen = torch.Generator().manual_seed(3)
    starts = torch.randint(0, 90_000, (64,), generator=gen)
    x, y, repeat = tool.copy_windows(stream, starts, 64, gen)
    assert x.shape == y.shape == repeat.shape == (64, 64) and torch.equal(x[:, 1:], y[:, :-1])
    for row, start in zip(range(64), starts.tolist()):
        offsets = [where[int(v)] - start for v in torch.cat([x[row], y[row, -1:]])]
        span = next(t for t in range(1, 65) if offsets[t] != t)           # where the repeat begins
        skip = offsets[span]
        assert 8 <= span <= 32 and 0 <= skip <= span // 2
        # S, then the stream again from S[skip]: the rest of S, then the text that followed S
        assert offsets[span:] == list(range(skip, skip + 65 - span))
        again = span - skip
        # the targets a copying model predicts: inside the repeat, after its first token
        assert [t + 1 for t in range(64) if repeat[row, t]] == list(range(span + 1, span + again))


def test_prepare_splits_by_path_hash_and_records_the_corpus(tiny_data):
    root, _ = tiny_data
    info = json.loads((root / "data" / "corpus.json").read_text())
    names = sorted(p.name for p in (root / "lib").iterdir())
    assert info["files_train"] + info["files_heldout"] == len(names)
    assert info["files_heldout"] == sum(tool.held_out(n) for n in names)
    assert info["vocab_size"] == 320 and info["tokens_train"] > 1000
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "data" / "tokenizer.json"))
    src = "def f(x):\n    return x  # ok\n"
    assert tok.decode(tok.encode(src).ids) == src                 # byte-level: lossless


def test_training_is_reproducible_and_loads_as_a_hf_model(tiny_data, tmp_path):
    root, spec_path = tiny_data
    _train(root, spec_path, tmp_path / "a")
    _train(root, spec_path, tmp_path / "b")
    _train(root, spec_path, tmp_path / "c", seed=1)
    spec = k3c.load_spec(tmp_path / "a")
    wa, wb, wc = (k3c.load_weights(spec, tmp_path / d) for d in "abc")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)              # same seed, same weights
    assert any(not torch.equal(wa[n], wc[n]) for n in wa)
    record = json.loads((tmp_path / "a" / "training.json").read_text())
    assert [c["step"] for c in record["loss_curve"]] == [0, 1, 2]
    assert record["settings"]["steps"] == 3 and (tmp_path / "a" / "tokenizer.json").is_file()


def test_every_trained_weight_gets_a_gradient(tiny_data):
    """forward_autograd reaches every weight but the router biases (moved by the balancing rule, not by gradients)
    and layer 0's first AttnRes mix (one source, the embedding: its softmax is 1 whatever the query): each K3 feature
    of the spec is differentiable through the reference. Checked on the second step: output_attn_res's query starts
    at zero (ZERO_INIT), so its norm weight has no gradient on the first."""
    root, spec_path = tiny_data
    from safetensors.torch import load_file

    args = tool.main.__globals__["argparse"].Namespace(
        seed=0, weight_decay=0.1, lr=1e-3, chunk_size=16, batch=2, seq_len=32, warmup=1, clip=1.0, bias_rate=1e-3,
        copy_frac=0.5)
    spec = k3c.load_spec(spec_path)
    trainer = tool.Trainer(spec, load_file(str(root / "data" / "tokens.safetensors")), args, "cpu")
    bias_before = {n: trainer.params[n].clone() for n in trainer.bias_names}
    trainer.step(0, 10)
    assert all(not torch.equal(bias_before[n], trainer.params[n]) for n in trainer.bias_names)
    x = trainer.train_stream[:66].reshape(2, 33)
    trainer.opt.zero_grad()
    trainer.loss(x[:, :-1], x[:, 1:]).backward()
    single_source = {"layers.0.self_attention_res.proj_weight", "layers.0.self_attention_res.norm_weight"}
    no_grad = [n for n, p in trainer.params.items() if n not in trainer.bias_names
               and (p.grad is None or not bool(p.grad.abs().sum() > 0))]
    assert sorted(no_grad) == sorted(single_source), no_grad


@pytest.mark.skipif(not (EXAMPLE / "model.safetensors").exists(), reason="the example model is not in this checkout")
def test_the_shipped_model_predicts_held_out_python():
    """The shipped checkpoint loads through the HF import path and transformers' tokenizer, and predicts a held-out
    stdlib file far better than chance (ln 4096 = 8.3 nats): a wrong load (names, transposes, the layout) fails."""
    from transformers import AutoTokenizer

    spec = k3c.load_spec(EXAMPLE)
    w = k3c.load_weights(spec, EXAMPLE, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(EXAMPLE))
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rel = next(p.relative_to(stdlib).as_posix() for p in tool.corpus_files(stdlib)
               if tool.held_out(p.relative_to(stdlib).as_posix()) and p.stat().st_size > 4000)
    ids = torch.tensor([tok((stdlib / rel).read_text(encoding="utf-8"))["input_ids"][:257]])
    logits = k3c.reference_forward(spec, w, ids[:, :-1])
    nll = float(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]))
    assert nll < 4.0, (rel, nll)                                  # measured 1.5-3 on held-out files
    assert math.isfinite(nll)
