"""Issue 20, hostile and careless inputs: numeric arguments (bounded before any work starts), non-finite values,
run-time input files that are not regular files, and Python API misuse. Every CLI case exits 2 with one stderr
line naming the argument, never a traceback; every API case raises ArgumentError."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import k3c
from k3c.cli import main
from k3c.errors import ArgumentError, UserError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "k3-tiny.yaml")          # vocab 256, max_context 4096, 8 experts top-2
KEY = "layers.{}.block_sparse_moe.gate.{}"
HUGE = str(2 ** 70)                                      # 1180591620717411303424


def one_error(capsys, argv, *needles):
    """main(argv) exits 2 with exactly one stderr line, no traceback, holding every needle."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("k3c: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


# ---- k3c plan: every numeric argument bounded at parse time --------------------------------------------------
@pytest.mark.parametrize("flag, value, needle", [
    ("--context", "0", ">= 1"), ("--context", "-5", ">= 1"), ("--context", "1e10", "integer"),
    ("--context", "abc", "integer"), ("--context", str(2 ** 31 + 1), "<= 2147483648"),
    ("--context", "10000000000", "<="), ("--context", str(10 ** 15), "<="), ("--context", HUGE, "<="),
    ("--batch", "0", ">= 1"), ("--batch", str(2 ** 24 + 1), "<="), ("--batch", str(10 ** 21), "<="),
    ("--batch", "1.5", "integer"),
    ("--prefill-chunk", "0", ">= 1"), ("--prefill-chunk", str(2 ** 31 + 1), "<="), ("--prefill-chunk", "x", "integer"),
    ("--pp", "0", ">= 1"), ("--pp", "1025", "<= 1024"), ("--pp", str(10 ** 12), "<="),
    ("--vpp", "0", ">= 1"), ("--vpp", "1025", "<="), ("--vpp", str(10 ** 12), "<="),
    ("--tp", "0", ">= 1"), ("--tp", "65537", "<= 65536"), ("--tp", str(10 ** 9), "<="), ("--tp", "-8", ">= 1"),
    ("--ep", "0", ">= 1"), ("--ep", "65537", "<="), ("--ep", str(10 ** 9), "<="),
    ("--headroom", "nan", "[0, 1)"), ("--headroom", "inf", "[0, 1)"), ("--headroom", "-inf", "[0, 1)"),
    ("--headroom", "-1", "[0, 1)"), ("--headroom", "1", "[0, 1)"), ("--headroom", "1.5", "[0, 1)"),
    ("--headroom", "abc", "[0, 1)"), ("--headroom", "", "[0, 1)"), ("--headroom", "1e400", "[0, 1)"),
])
def test_plan_numeric_bounds(capsys, flag, value, needle):
    one_error(capsys, ["plan", TINY, "--target", "mi355x", f"{flag}={value}"], flag, needle)


def test_plan_long_context_is_bounded_work(capsys):
    """--context at the bound with 1-token chunks: the prefill sums its 2**31 chunks piecewise linearly."""
    t0 = time.perf_counter()
    assert main(["plan", TINY, "--target", "mi355x", "--context", str(2 ** 31), "--prefill-chunk", "1",
                 "--json"]) == 0
    assert time.perf_counter() - t0 < 60
    assert '"context": 2147483648' in capsys.readouterr().out


def test_plan_plot_at_the_bounds(capsys, tmp_path):
    """A memory bar far above the HBM line: its label is clipped to the axes (it overflowed the raster)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    assert main(["plan", TINY, "--target", "mi355x", "--context", str(2 ** 31), "--batch", str(2 ** 24),
                 "--plot", str(out)]) == 0
    assert out.stat().st_size > 0 and "Traceback" not in capsys.readouterr().err


def test_chunk_sum_matches_the_chunk_by_chunk_sum():
    """CostModel.prefill beyond EXACT_PREFILL_CHUNKS equals the exact per-chunk sum (mode switches included)."""
    from k3c.analysis import cost as C
    from k3c.analysis.layout import ParallelLayout
    from k3c.analysis.memory import ModelFacts, weight_report
    from k3c.analysis.report import _module_of
    from k3c.codegen.targets import get_target

    tgt = get_target("mi355x")
    module, _, _ = _module_of(TINY, tgt)
    lay = ParallelLayout.make(1, None)
    facts = ModelFacts.from_module(module)
    w = weight_report(module, lay, facts)
    for context, chunk in ((300_001, 97), (200_000, 64)):       # 3093 and 3125 chunks
        got = []
        for exact in (10 ** 9, 16):
            old, C.EXACT_PREFILL_CHUNKS = C.EXACT_PREFILL_CHUNKS, exact
            try:
                got.append(C.CostModel(module, lay, tgt, w, facts).prefill(context, 3, chunk))
            finally:
                C.EXACT_PREFILL_CHUNKS = old
        a, b = got
        assert a.tokens == b.tokens == 3 * context and a.mla_modes == b.mla_modes
        assert b.seconds == pytest.approx(a.seconds, rel=1e-9)
        assert b.cost.bytes == pytest.approx(a.cost.bytes, rel=1e-9)
        assert b.cost.total_flops == pytest.approx(a.cost.total_flops, rel=1e-9)


@pytest.mark.parametrize("kw, needle", [
    ({"context": 0}, "--context"), ({"context": 2 ** 40}, "--context"), ({"context": 1.5}, "--context"),
    ({"batch": 2 ** 30}, "--batch"), ({"batch": True}, "--batch"), ({"headroom": float("nan")}, "--headroom"),
    ({"headroom": float("inf")}, "--headroom"), ({"headroom": "0.1"}, "--headroom"), ({"tp": 2 ** 20}, "--tp"),
    ({"ep": 2 ** 20}, "--ep"), ({"pp": 0}, "--pp"), ({"vpp": 5000}, "--vpp"),
    ({"prefill_chunk": 1.5}, "--prefill-chunk"),
])
def test_plan_api_bounds(kw, needle):
    from k3c.analysis.report import plan

    with pytest.raises(ArgumentError, match=needle):
        plan(TINY, "mi355x", **kw)


# ---- run-time input files that are not regular files ----------------------------------------------------------
@pytest.fixture
def odd_paths(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / "pipe.safetensors")
    (tmp_path / "wdir").mkdir()
    os.mkfifo(tmp_path / "wdir" / "model.safetensors")
    (tmp_path / "shards").mkdir()
    os.mkfifo(tmp_path / "shards" / "a.safetensors")
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize("name, needle", [
    ("pipe", "FIFO"), ("pipe.safetensors", "FIFO"), ("wdir", "FIFO"), ("shards", "FIFO"), ("empty", "no safetensors"),
    ("missing.safetensors", "no such file"), ("/dev/null", "device"),
])
def test_run_weights_not_regular(capsys, odd_paths, name, needle):
    path = name if name.startswith("/") else str(odd_paths / name)
    one_error(capsys, ["run", TINY, "--weights", path, "--no-kernels"], needle)


@pytest.mark.parametrize("name, needle", [
    ("pipe", "FIFO"), ("empty", "directory"), ("missing.json", "no such file"), ("/dev/null", "device"),
])
def test_plan_measured_not_regular(capsys, odd_paths, name, needle):
    path = name if name.startswith("/") else str(odd_paths / name)
    one_error(capsys, ["plan", TINY, "--target", "mi355x", "--measured", path], "--measured", needle)


@pytest.mark.parametrize("name, needle", [
    ("pipe", "FIFO"), ("empty", "directory"), ("missing", "no such file"), ("/dev/null", "device"),
])
def test_calibrate_scores_not_regular(capsys, odd_paths, name, needle):
    path = name if name.startswith("/") else str(odd_paths / name)
    one_error(capsys, ["calibrate-router", TINY, path, "-o", str(odd_paths / "b.safetensors")], needle)
    assert not (odd_paths / "b.safetensors").exists()


# ---- k3c run ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--seed", HUGE], "--seed"), (["--seed", "-1"], "--seed"), (["--seed", "1.5"], "--seed"),
    (["--seed", str(2 ** 63)], "--seed"), (["--seed", "x"], "--seed"),
    (["--batch", "0"], "--batch"), (["--batch", str(2 ** 24 + 1)], "--batch"), (["--batch", "-3"], "--batch"),
    (["--prompt-len", "0"], "--prompt-len"), (["--prompt-len", str(2 ** 31 + 1)], "--prompt-len"),
    (["--prompt-len", "5000"], "max_context"), (["--new-tokens", "0"], "--new-tokens"),
    (["--new-tokens", "5000"], "max_context"), (["--new-tokens", HUGE], "--new-tokens"),
    (["--prefill-chunk", "0"], "--prefill-chunk"), (["--prefill-chunk", HUGE], "--prefill-chunk"),
    (["--device", "tpu"], "--device"), (["--device", "cuda"], "--device"), (["--device", "cuda:0"], "--device"),
    (["--device", "cuda:x"], "--device"), (["--device", "cpu:0"], "--device"), (["--device", "meta"], "--device"),
    (["--device", ""], "--device"), (["--dtype", "float16"], "--dtype"),
    (["--tp", "0"], "--tp"), (["--tp", "65537"], "--tp"), (["--ep", str(10 ** 9)], "--ep"),
    (["--strict", "--no-kernels"], "--no-kernels"), (["--jit", "--no-kernels"], "--no-kernels"),
])
def test_run_bad_numbers(capsys, argv, needle):
    one_error(capsys, ["run", TINY, *argv] + ([] if "--no-kernels" in argv else ["--no-kernels"]), needle)


@pytest.mark.parametrize("argv, needle", [
    (["run", TINY, "--weights", "", "--no-kernels"], "--weights"),
    (["plan", TINY, "--target", "mi355x", "--plot", ""], "--plot"),
    (["plan", TINY, "--target", "mi355x", "--measured", ""], "--measured"),
    (["calibrate-router", TINY, "/dev/null", "-o", ""], "-o"),
])
def test_empty_paths(capsys, argv, needle):
    one_error(capsys, argv, needle, "empty")


@pytest.mark.parametrize("argv, needle", [
    (["--rank", "5", "--tp", "2"], "--rank must be in [0, 2)"), (["--rank", "-1", "--tp", "2"], "--rank"),
    (["--rank", "1"], "--rank must be in [0, 1)"), (["--rank", "4", "--tp", "2", "--ep", "4"], "[0, 4)"),
    (["--rank", HUGE, "--tp", "2"], "--rank"), (["--rank", "abc"], "--rank"), (["--tp", "1000000"], "1000000"),
])
def test_compile_rank_and_ranks(capsys, tmp_path, argv, needle):
    one_error(capsys, ["compile", TINY, "--target", "mi355x", "-o", str(tmp_path / "a"), *argv], needle)
    assert not (tmp_path / "a").exists()


def test_run_refuses_what_does_not_fit_before_allocating(capsys, monkeypatch):
    from k3c.commands import run as runner
    from k3c.runtime import weights

    monkeypatch.setattr(runner, "available_bytes", lambda device: 2 ** 30)
    drawn = []
    monkeypatch.setattr(weights, "init_weights", lambda *a, **k: drawn.append(1))
    err = one_error(capsys, ["run", TINY, "--batch", "1000000", "--no-kernels"], "--batch 1000000", "GiB",
                    "cpu has 1.00 GiB free")
    assert "MLA cache" in err and "KDA state" in err and not drawn


def test_run_estimate_grows_with_every_size():
    from k3c.commands.run import estimate_run_bytes

    spec = k3c.load_spec(TINY)
    base = sum(estimate_run_bytes(spec, batch=1, prompt_len=16, new_tokens=8).values())
    for kw in ({"batch": 2}, {"prompt_len": 64}, {"new_tokens": 512}):
        args = {"batch": 1, "prompt_len": 16, "new_tokens": 8, **kw}
        assert sum(estimate_run_bytes(spec, **args).values()) > base


def test_run_odd_sizes_run(capsys):
    """Careless but valid sizes: a prefill chunk longer than the prompt, one-token prompts, bf16 without kernels."""
    for argv in (["--prefill-chunk", "100", "--prompt-len", "4", "--new-tokens", "1"],
                 ["--prompt-len", "1", "--new-tokens", "1", "--dtype", "bfloat16"],
                 ["--seed", str(2 ** 63 - 1), "--prompt-len", "2", "--new-tokens", "2"]):
        assert main(["run", TINY, "--no-kernels", *argv]) == 0
        out = capsys.readouterr().out
        assert "logits finite:   True" in out


@pytest.mark.parametrize("kw, needle", [
    ({"batch": 0}, "--batch"), ({"batch": True}, "--batch"), ({"prompt_len": 1.5}, "--prompt-len"),
    ({"new_tokens": -1}, "--new-tokens"), ({"prefill_chunk": 0}, "--prefill-chunk"), ({"seed": -1}, "--seed"),
    ({"seed": 2 ** 70}, "--seed"), ({"device": "cuda:x"}, "--device"), ({"device": None}, "--device"),
])
def test_run_report_api_arguments(kw, needle):
    from k3c.commands.run import run_report

    with pytest.raises(ArgumentError, match=needle):
        run_report(TINY, use_kernels=False, **kw)


# ---- weights with NaN / inf: refused at load, naming the tensor ------------------------------------------------
@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    from k3c.runtime.checkpoint import save_k3_checkpoint

    spec = k3c.load_spec(TINY)
    w = k3c.init_weights(spec, seed=0)
    w["layers.2.self_attn.q_proj.weight"][0, 0] = float("nan")
    w["layers.1.block_sparse_moe.experts.w1"][3, 0, 0] = float("inf")
    out = tmp_path_factory.mktemp("nanckpt")
    save_k3_checkpoint(spec, w, str(out))
    return str(out)


def test_run_nan_weights_refused(capsys, nan_checkpoint):
    one_error(capsys, ["run", TINY, "--weights", nan_checkpoint, "--no-kernels"], "NaN or inf", "layers.")


def test_load_weights_names_the_tensor(nan_checkpoint):
    from k3c.errors import WeightError

    with pytest.raises(WeightError, match=r"layers\.1\.block_sparse_moe\.experts\.w1' holds NaN or inf"):
        k3c.load_weights(k3c.load_spec(TINY), nan_checkpoint)


def test_quantize_nan_weights_refused(capsys, nan_checkpoint, tmp_path):
    spec = tmp_path / "q.yaml"
    spec.write_text(Path(TINY).read_text() + "quantization:\n  format: mxfp4\n")
    one_error(capsys, ["quantize", str(spec), nan_checkpoint, "-o", str(tmp_path / "out")], "NaN or inf")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", [HUGE, "-1", str(2 ** 63), "abc"])
def test_quantize_seed_bounds(capsys, tmp_path, seed):
    one_error(capsys, ["quantize", TINY, "--random", "--seed", seed, "-o", str(tmp_path / "q")], "--seed")


# ---- calibrate-router -----------------------------------------------------------------------------------------
def _scores(T=257, n=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(T, n, generator=gen))


@pytest.mark.parametrize("tensors, needle", [
    ({KEY.format(1, "scores"): _scores(), KEY.format(1, "e_score_correction_bias"): torch.full((8,), float("inf"))},
     "e_score_correction_bias"),
    ({KEY.format(1, "scores"): _scores(), KEY.format(1, "e_score_correction_bias"): torch.full((8,), float("nan"))},
     "NaN"),
    ({KEY.format(1, "scores"): _scores(), KEY.format(1, "e_score_correction_bias"): torch.full((8,), 1e30)},
     "beyond"),
    ({KEY.format(1, "scores"): _scores() - 2}, "outside [0, 1]"),
    ({KEY.format(1, "scores"): _scores() + 1}, "outside [0, 1]"),
    ({KEY.format(1, "scores"): torch.full((4, 8), float("-inf"))}, "NaN or inf"),
])
def test_calibrate_non_finite_or_out_of_range(capsys, tmp_path, tensors, needle):
    save_file(tensors, str(tmp_path / "s.safetensors"))
    one_error(capsys, ["calibrate-router", TINY, str(tmp_path / "s.safetensors"), "-o", str(tmp_path / "b")], needle)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--iterations", "0"], "--iterations"), (["--iterations", "1001"], "--iterations"),
    (["--iterations", str(10 ** 9)], "--iterations"), (["--iterations", "1e9"], "--iterations"),
    (["--iterations", "-2"], "--iterations"),
])
def test_calibrate_iterations_bounded(capsys, tmp_path, argv, needle):
    save_file({KEY.format(1, "scores"): _scores()}, str(tmp_path / "s.safetensors"))
    one_error(capsys, ["calibrate-router", TINY, str(tmp_path / "s.safetensors"), "-o", str(tmp_path / "b"), *argv],
              needle)


@pytest.mark.parametrize("out, needle", [("/missing/x.safetensors", "does not exist"), (".", "is a directory")])
def test_calibrate_output_path(capsys, tmp_path, out, needle):
    save_file({KEY.format(1, "scores"): _scores()}, str(tmp_path / "s.safetensors"))
    one_error(capsys, ["calibrate-router", TINY, str(tmp_path / "s.safetensors"), "-o",
                       out if out.startswith("/") else str(tmp_path)], "-o", needle)


def test_calibrate_api_iterations():
    from k3c.commands.quantize import calibrate

    spec = k3c.load_spec(TINY)
    for bad in (0, 10 ** 9, 2.0, True):
        with pytest.raises(ArgumentError, match="--iterations"):
            calibrate(spec, {1: (_scores(), None)}, bad)
    (b, _, _), = calibrate(spec, {1: (_scores(), None)}, 3).values()
    assert bool(torch.isfinite(b).all())


# ---- Python API: reference_forward, Session, Engine --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    spec = k3c.load_spec(TINY)
    return spec, k3c.init_weights(spec, seed=0), k3c.compile(spec, target="cpu")


@pytest.mark.parametrize("ids, needle", [
    (torch.full((1, 3), 256), r"\[0, 256\)"), (torch.full((1, 3), -1), r"\[0, 256\)"),
    (torch.tensor([[0, 1, 10 ** 6]]), "10+"), (torch.ones(1, 3, dtype=torch.bool), "dtype bool"),
    (torch.ones(1, 3), "dtype float32"), (torch.ones(1, 3, dtype=torch.float64), "float64"),
    ([[1, 2]], "torch.Tensor"), (torch.ones(3, dtype=torch.long), r"\[B, T\]"),
    (torch.ones(0, 3, dtype=torch.long), r"\[B, T\]"), (torch.ones(2, 0, dtype=torch.long), r"\[B, T\]"),
])
def test_reference_forward_ids(tiny, ids, needle):
    spec, w, _ = tiny
    with pytest.raises(ArgumentError, match=needle) as info:
        k3c.reference_forward(spec, w, ids)
    assert "input_ids" in str(info.value)
    assert isinstance(info.value, ValueError)           # what these checks raised before


@pytest.mark.parametrize("kw, needle", [
    ({"max_batch": 0}, "max_batch"), ({"max_batch": -1}, "max_batch"), ({"max_batch": 1.5}, "max_batch"),
    ({"max_batch": True}, "max_batch"), ({"max_batch": None}, "max_batch"), ({"max_context": 0}, "max_context"),
    ({"max_context": -3}, "max_context"), ({"max_context": "8"}, "max_context"), ({"device": "tpu"}, "device"),
    ({"device": 3.5}, "device"),
])
def test_session_sizes(tiny, kw, needle):
    _, w, model = tiny
    with pytest.raises(ArgumentError, match=needle):
        model.session(w, use_kernels=False, **kw)


@pytest.fixture(scope="module")
def session(tiny):
    _, w, model = tiny
    return model.session(w, use_kernels=False, max_batch=4, max_context=64)


@pytest.mark.parametrize("call, needle", [
    (lambda s: s.decode(torch.tensor([1, 2, 3])), "next_ids has 3 row"),
    (lambda s: s.decode(torch.tensor([1])), "next_ids has 1 row"),
    (lambda s: s.decode(torch.tensor([[1], [2]])), r"next_ids must be \[B\]"),
    (lambda s: s.decode(torch.tensor([1.0, 2.0])), "dtype float32"),
    (lambda s: s.decode(torch.tensor([1, 256])), r"next_ids: token ids must be in \[0, 256\)"),
    (lambda s: s.decode([1, 2]), "torch.Tensor"),
    (lambda s: s.append(torch.ones(1, 2, dtype=torch.long)), "segment_ids has 1 row"),
    (lambda s: s.append(torch.ones(2, 2, dtype=torch.bool)), "dtype bool"),
    (lambda s: s.prefill(torch.full((1, 3), -1)), "input_ids: token ids"),
    (lambda s: s.prefill(torch.ones(5, 3, dtype=torch.long)), "max_batch 4"),
    (lambda s: s.prefill(torch.ones(1, 65, dtype=torch.long)), "max_context 64"),
    (lambda s: s.generate(torch.ones(1, 3, dtype=torch.long), 0), "max_new_tokens"),
    (lambda s: s.generate(torch.ones(1, 3, dtype=torch.long), 10 ** 9), "max_context 64"),
])
def test_session_call_errors(session, call, needle):
    session.prefill(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ArgumentError, match=needle):
        call(session)
    assert session.length == 3 and session.batch == 2     # a refused call leaves the session as it was
    assert session.decode(torch.tensor([1, 2])).shape == (2, 256)


@pytest.mark.parametrize("kw", [{"max_batch": 0}, {"max_batch": True}, {"max_context": -1}, {"prefill_chunk": 0},
                                {"num_pages": 0}, {"device": "nope"}])
def test_engine_sizes(tiny, kw):
    from k3c.runtime.engine import Engine

    _, w, model = tiny
    with pytest.raises(ArgumentError, match=next(iter(kw))):
        Engine(model, w, use_kernels=False, **kw)


@pytest.fixture(scope="module")
def engine(tiny):
    from k3c.runtime.engine import Engine

    _, w, model = tiny
    return Engine(model, w, use_kernels=False, max_batch=2, max_context=64)


@pytest.mark.parametrize("prompt, new, needle", [
    (torch.ones(3), 4, "dtype float32"), (torch.ones(3, dtype=torch.bool), 4, "dtype bool"),
    ("abc", 4, "sequence of token ids"), ([1.5, 2.0], 4, "integer token ids"), (5, 4, "sequence of token ids"),
    ([True, False], 4, "integer token ids"), ([-1], 4, r"\[0, 256\)"), ([256], 4, r"\[0, 256\)"),
    ([], 4, "at least one token"), ([1, 2], 0, "max_new_tokens"), ([1, 2], True, "max_new_tokens"),
    ([1, 2], 2.0, "max_new_tokens"), ([1, 2], 100, "max_context 64"),
])
def test_engine_requests(engine, prompt, new, needle):
    with pytest.raises(ArgumentError, match=needle):
        engine.add_request(prompt, new)
    assert not engine.has_work()


def test_user_errors_are_one_line():
    assert issubclass(ArgumentError, UserError)


# ---- Ctrl-C: one line, exit 130 --------------------------------------------------------------------------------
def _sigint_default():
    """The child's SIGINT at its default action: a suite run in the background (a non-interactive shell's `&`)
    starts its processes with SIGINT ignored, which Python keeps."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# The child announces itself on stdout once the interpreter is up, then runs `python -m k3c.cli` as runpy does: a
# signal's delay counts from there. A Ctrl-C inside the interpreter's own start-up (site and the .pth files of
# site-packages; over 0.1 s on a loaded machine) is CPython's to report, before any k3c code runs.
STARTED = "print('started', flush=True); import runpy; runpy.run_module('k3c.cli', run_name='__main__')"


def _start_long_run():
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", STARTED, "run", TINY, "--batch", "2", "--prompt-len", "32",
                             "--new-tokens", "2048", "--interpret"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    assert proc.stdout.readline() == "started\n"
    return proc


@pytest.mark.parametrize("delay", [0.1, 0.2, 0.25, 0.3, 0.4])
def test_ctrl_c_while_starting_is_one_line(delay):
    """A Ctrl-C during `import torch` was swallowed by torch's extension init, and the run went on."""
    proc = _start_long_run()
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err == "k3c: interrupted\n", err


def test_ctrl_c_during_run_is_one_line():
    proc = _start_long_run()
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err == "k3c: interrupted\n", err
