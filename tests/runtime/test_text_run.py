"""Text in, text out: the tokenizer of a model directory (k3c.runtime.text), carried into artifacts (k3c.api),
Session.generate on strings, the engine's stop tokens and sampling, and `k3c run --prompt`. The model: k3-tiny with
a 512-token vocabulary and random weights, saved as a Hugging Face model directory with a byte-level BPE tokenizer
trained here on two standard-library files."""
import json
import os
import shutil

import pytest
import torch

import k3c
from k3c.cli import main
from k3c.errors import ArgumentError, UserError, WeightError
from k3c.runtime.engine import Engine
from k3c.runtime.sampling import SamplingParams
from k3c.runtime.text import load_tokenizer

PROMPTS = ("import os\n", "def f(x):\n    return", "class A:")


def train_tokenizer(path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lib = os.path.dirname(os.__file__)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([open(os.path.join(lib, f), encoding="utf-8").read() for f in ("textwrap.py", "shlex.py")],
                            trainer)
    tok.save(str(path))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from k3c.runtime.checkpoint import save_k3_checkpoint

    root = tmp_path_factory.mktemp("text")
    yaml = root / "k3-tiny-text.yaml"
    yaml.write_text(open("examples/k3-tiny.yaml").read().replace("vocab_size: 256", "vocab_size: 512")
                    .replace("name: k3-tiny", "name: k3-tiny-text"))
    spec = k3c.load_spec(yaml)
    out = root / "model"
    save_k3_checkpoint(spec, k3c.init_weights(spec, seed=0), out)
    train_tokenizer(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    return out


@pytest.fixture(scope="module")
def compiled(model_dir):
    return k3c.compile(str(model_dir), target="cpu")


@pytest.fixture(scope="module")
def weights(model_dir, compiled):
    return k3c.load_weights(compiled.spec, str(model_dir))


def test_tokenizer_files(model_dir, tmp_path):
    tok = load_tokenizer(model_dir, vocab_size=512)
    for text in PROMPTS + ("naïve ✓\tend",):
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == tok._backend.token_to_id("<|endoftext|>") and tok.vocab_size == 512
    assert load_tokenizer(tmp_path) is None                             # no tokenizer.json
    with pytest.raises(WeightError, match=r"tokenizer.json: the tokenizer has 512 tokens, more than the model's "
                                          r"vocab_size 256"):
        load_tokenizer(model_dir, vocab_size=256)
    broken = (("tokenizer.json", b'{"model": 3}', "not a tokenizers tokenizer.json"),
              ("tokenizer.json", b"\xff\xfe", "not UTF-8"),
              ("tokenizer_config.json", b"{", "not valid JSON"),
              ("tokenizer_config.json", b'{"eos_token": "<eos>"}', "'<eos>' is not in the vocabulary"))
    for i, (name, content, needle) in enumerate(broken):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(model_dir, bad, ignore=shutil.ignore_patterns("*.safetensors"))
        (bad / name).write_bytes(content)
        with pytest.raises(ArgumentError, match=needle) as exc:
            load_tokenizer(bad)
        assert str(bad / name) in str(exc.value)
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain, ignore=shutil.ignore_patterns("*.safetensors", "tokenizer_config.json"))
    assert load_tokenizer(plain).eos_id == tok.eos_id                   # <|endoftext|> without a config


def test_artifact_carries_the_tokenizer(model_dir, compiled, tmp_path):
    assert compiled.tokenizer is not None
    assert k3c.compile("examples/k3-tiny.yaml", target="cpu").tokenizer is None
    art = compiled.save(tmp_path / "art", progress=False)
    manifest = json.loads(open(os.path.join(art, "manifest.json")).read())
    assert manifest["files"]["tokenizer"] == "tokenizer.json"
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["sha256"])
    loaded = k3c.load(art).tokenizer
    assert loaded.encode(PROMPTS[1]) == compiled.tokenizer.encode(PROMPTS[1])
    assert loaded.eos_id == compiled.tokenizer.eos_id
    with open(os.path.join(art, "tokenizer.json"), "a") as fh:          # a changed tokenizer is refused
        fh.write(" ")
    with pytest.raises(UserError, match="tokenizer.json: sha256 does not match"):
        k3c.load(art)
    # a tokenizer larger than the vocabulary is not shipped
    small = tmp_path / "small"
    shutil.copytree(model_dir, small)
    cfg = json.loads((small / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    text_cfg["vocab_size"] = 300
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match="vocab_size 300"):
        k3c.compile(str(small), target="cpu").save(tmp_path / "art2", progress=False)
    assert not (tmp_path / "art2").exists()


def test_session_generates_text(compiled, weights, one_thread):
    tok = compiled.tokenizer
    sess = compiled.session(weights, use_kernels=False)
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    greedy = sess.generate(ids, max_new_tokens=6)[0].tolist()
    assert tok.eos_id not in greedy
    assert sess.generate(PROMPTS[0], max_new_tokens=6) == tok.decode(greedy)
    # several prompts of different token counts: each what it gives alone
    alone = [sess.generate(p, max_new_tokens=4) for p in PROMPTS]
    assert sess.generate(list(PROMPTS), max_new_tokens=4) == alone
    # sampled: a seed gives the same text again; the seeded params are reported
    hot = SamplingParams(temperature=1.0, top_k=50, seed=3)
    first = sess.generate(PROMPTS[0], max_new_tokens=6, sampling=hot)
    assert sess.generate(PROMPTS[0], max_new_tokens=6, sampling=hot) == first
    assert sess.last_sampling == [hot]
    # the text ends at the EOS token: make the third greedy token the EOS
    eos = greedy[2]
    tok.eos_id = eos
    try:
        assert sess.generate(PROMPTS[0], max_new_tokens=6) == tok.decode(greedy[:greedy.index(eos)])
    finally:
        tok.eos_id = compiled.tokenizer._backend.token_to_id("<|endoftext|>")
    plain = k3c.compile("examples/k3-tiny.yaml", target="cpu")
    bare = plain.session(k3c.init_weights(plain.spec, seed=0), use_kernels=False)
    with pytest.raises(ArgumentError, match="a str prompt needs the model's tokenizer"):
        bare.generate("import os")


def test_engine_stop_tokens_and_seeds(compiled, weights, one_thread):
    tok = compiled.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    eng = Engine(compiled, weights, max_batch=4, max_context=64, use_kernels=False)
    greedy = eng.generate(prompts, max_new_tokens=6)
    # a request ends right after its stop token (included); the others go on
    stop = greedy[0][2]
    cut = eng.generate(prompts, max_new_tokens=6, stop_token_ids=[stop])
    for full, got in zip(greedy, cut):
        assert got == (full[:full.index(stop) + 1] if stop in full else full)
    # greedy StepOutputs are the argmax of their logits and report no seed; a sampled request reports its seed
    rid = eng.add_request(prompts[1], 3)
    hot = eng.add_request(prompts[2], 3, sampling=SamplingParams(temperature=0.8))
    seeds = {}
    while eng.has_work():
        for o in eng.step():
            seeds[o.rid] = o.seed
            if o.rid == rid:
                assert o.token == int(o.logits.argmax())
    assert seeds[rid] is None and isinstance(seeds[hot], int)
    # a sampled request's tokens depend on its seed only: alone, or second among others
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = eng.generate([prompts[0]], max_new_tokens=8, sampling=p)[0]
    mixed = eng.generate([prompts[1], prompts[0], prompts[2]], max_new_tokens=8,
                         sampling=[SamplingParams(temperature=0.7, seed=1), p, None])
    assert mixed[1] == alone
    with pytest.raises(ArgumentError, match="stop_token_ids: token ids must be in"):
        eng.add_request(prompts[0], 2, stop_token_ids=[512])
    with pytest.raises(ArgumentError, match="sampling must be a SamplingParams"):
        eng.add_request(prompts[0], 2, sampling={"temperature": 1.0})


def test_run_prompt_prints_the_continuation(model_dir, compiled, weights, capsys, one_thread):
    sess = compiled.session(weights, use_kernels=False)
    expected = sess.generate("import os\n", max_new_tokens=8)
    assert main(["run", str(model_dir), "--prompt", r"import os\n", "--new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out == "import os\n" + expected + ("" if expected.endswith("\n") else "\n")
    lines = err.splitlines()
    assert lines[0].startswith("k3c run: ") and "prompt tokens, 8 new tokens (the --new-tokens limit; greedy)" \
        in lines[0]
    assert "TTFT:" in err and "tokens/s" in err and "no warm-up: includes first-call costs" in err
    assert f"weights:         {model_dir} (the model directory's checkpoint)" in err
    assert "off on a CPU: torch ops (--interpret" in err and "random" not in err
    # the report mode takes the model directory's checkpoint too
    assert main(["run", str(model_dir), "--prompt-len", "3", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert f"loaded from {model_dir} (the model directory's checkpoint; --weights overrides)" in out


def test_run_prompt_file_and_sampling(model_dir, tmp_path, capsys, one_thread):
    raw = tmp_path / "prompt.txt"
    raw.write_bytes(r"x = '\n'".encode() + b"\n")                 # read as it is: the backslash stays
    args = ["run", str(model_dir), "--prompt-file", str(raw), "--new-tokens", "4", "--temperature", "0.9",
            "--top-p", "0.95", "--top-k", "40", "--seed", "7"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert first.out.startswith("x = '\\n'\n") and "seed 7" in first.err and "top-k 40" in first.err
    assert main(args) == 0
    assert capsys.readouterr().out == first.out


def test_run_artifact_with_random_weights_warns(model_dir, compiled, tmp_path, capsys, one_thread):
    art = compiled.save(tmp_path / "art", progress=False)
    assert main(["run", art, "--prompt", "import", "--new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("k3c: warning: the weights are random (no --weights") and "random (seed 0)" in err
    assert main(["run", art, "--prompt", "import", "--new-tokens", "2", "--weights", str(model_dir)]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--prompt", "x", "--batch", "2"], "--batch shapes the random prompts"),
    (["--prompt-file", "p.txt", "--prompt-len", "4"], "--prompt-len shapes the random prompts"),
    (["--prompt", "x", "--prompt-file", "p.txt"], "not allowed with argument"),
    (["--prompt-file", "missing.txt"], "missing.txt: no such file"),
    (["--prompt-file", "latin1.txt"], "--prompt-file latin1.txt: not UTF-8"),
    (["--prompt", ""], "the prompt encodes to no tokens"),
    (["--prompt", "x", "--new-tokens", "5000"], "exceed the model's max_context 4096"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--prompt", "x", "--top-p", "0"], "top_p must be a number in (0, 1]"),
    (["--prompt", "x", "--tp", "2"], "--prompt is not supported with --tp/--ep"),
    (["--interpret", "--device", "cuda"], "--interpret runs the generated kernels in the Triton interpreter on a "
                                          "CPU; it cannot go with --device cuda"),
    (["--interpret", "--no-kernels"], "it cannot go with --no-kernels"),
])
def test_run_text_bad_arguments(model_dir, tmp_path, monkeypatch, capsys, args, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "p.txt").write_text("x")
    assert main(["run", str(model_dir), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_run_prompt_needs_a_tokenizer(capsys):
    assert main(["run", "examples/k3-tiny.yaml", "--prompt", "x"]) == 2
    assert "no tokenizer (tokenizer.json) to encode --prompt with" in capsys.readouterr().err
