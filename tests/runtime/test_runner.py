"""`k3c run` through the serving engine: the report's fields, the MLA modes that ran, bad arguments exit 2."""
import re
import types

import pytest

from k3c.cli import main

TINY = "examples/k3-tiny.yaml"


def test_run_report_through_the_engine(capsys, one_thread):
    assert main(["run", TINY, "--batch", "3", "--prompt-len", "9", "--new-tokens", "4", "--no-kernels",
                 "--prefill-chunk", "4"]) == 0
    out = capsys.readouterr().out
    for key in ("TTFT:", "prefill:", "decode:", "peak memory:", "MLA cache:", "logits finite:   True",
                "kernels off"):
        assert key in out
    # per MLA layer: 3 prefill calls (chunks of 4, 4, 1 tokens) and 3 decode calls (MQA), all sequences batched
    for layer in (3, 7):
        counts = dict(re.findall(rf"layer {layer} (mha|mqa) x(\d+)", out))
        assert sum(int(n) for n in counts.values()) == 6 and int(counts["mqa"]) >= 3


def test_run_under_a_step_token_budget(capsys, one_thread):
    """--max-step-tokens 5 over 3 prompts of 9: the prompts go in chunks of the budget (more graph calls than one
    whole-prompt prefill); the engine's equality with whole-prompt prefill is test_chunked_prefill's."""
    argv = ["run", TINY, "--batch", "3", "--prompt-len", "9", "--new-tokens", "3", "--no-kernels"]
    assert main(argv) == 0
    whole = capsys.readouterr().out
    assert main(argv + ["--max-step-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "logits finite:   True" in out
    calls = {k: int(n) for k, n in re.findall(r"layer 3 (mha|mqa) x(\d+)", out)}
    assert sum(calls.values()) > sum(int(n) for n in re.findall(r"layer 3 (?:mha|mqa) x(\d+)", whole))


@pytest.mark.parametrize("args, message", [
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--max-step-tokens", "0"], "--max-step-tokens must be >= 1"),
    (["--max-step-tokens", "many"], "--max-step-tokens"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--new-tokens", "5000"], "exceeds the spec's max_context 4096"),
])
def test_run_bad_arguments_exit_2(capsys, args, message):
    assert main(["run", TINY, "--no-kernels", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


REPORT_LINES = ("weights:", "model:", "engine build:", "warm-up:", "cold TTFT:", "TTFT:", "prefill:", "decode:",
                "kernels:")


def _line(out: str, label: str) -> str:
    return next(ln for ln in out.splitlines() if ln.strip().startswith(label))


def test_run_on_a_cpu_defaults_to_the_torch_ops(capsys, one_thread):
    assert main(["run", TINY, "--batch", "1", "--prompt-len", "3", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert _line(out, "kernels:").endswith("off on a CPU: torch ops (--interpret runs the generated kernels in the "
                                           "Triton interpreter)")
    assert "kernel" not in _line(out, "executor:").replace("(kernels off)", "")


def test_run_report_phases_and_parse(capsys, one_thread, bench_script):
    """The report's phase lines exist, say what they include, and parse (bench/coldstart.py reads them)."""
    assert main(["run", TINY, "--batch", "2", "--prompt-len", "5", "--new-tokens", "3", "--no-kernels"]) == 0
    out = capsys.readouterr().out
    for label in REPORT_LINES:
        assert _line(out, label)
    assert "skipped (--no-warmup, the default on a CPU)" in _line(out, "warm-up:")       # CPU default: off
    assert "drawn on cpu" in _line(out, "weights:") and "spec compiled for target cpu" in _line(out, "model:")
    assert "includes first-call costs" in _line(out, "prefill:")
    assert "off (--no-kernels" in _line(out, "kernels:")
    got = bench_script("coldstart").parse_report(out)
    assert got["warmup_skipped"] and got["warmup_s"] is None and got["kernels"] is None
    for key in ("weights_s", "model_s", "engine_s", "cold_ttft_s", "ttft_ms", "prefill_tok_s", "decode_tok_s"):
        assert got[key] is not None and got[key] >= 0, key
    assert got["cold_ttft_s"] * 1e3 >= got["ttft_ms"]


def test_run_report_warmup_excluded_from_rates(monkeypatch, one_thread):
    """With --warmup, TTFT and tokens/s come from the second (timed) pass only. A fake clock: each step of the
    first pass costs 100 s, a prefill step of the second 2 s and a decode step 0.5 s."""
    from k3c.runtime import engine as engine_mod
    from k3c.commands import run as runner

    clock = {"now": 0.0, "steps": 0}
    batch, prompt, new = 2, 5, 4                       # a pass: 1 prefill step + 3 decode steps
    step = engine_mod.Engine.step

    def timed_step(self):
        outs = step(self)
        n = clock["steps"]
        clock["steps"] += 1
        clock["now"] += 100.0 if n < new else (2.0 if n == new else 0.5)
        return outs

    monkeypatch.setattr(engine_mod.Engine, "step", timed_step)
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    out = runner.run_report(TINY, batch=batch, prompt_len=prompt, new_tokens=new, use_kernels=False, warmup=True)
    assert clock["steps"] == 2 * new
    assert "400.00 s (untimed pass" in _line(out, "warm-up:") and "3 decode steps" in _line(out, "warm-up:")
    assert "2,000.0 ms (timed pass, warm-up excluded)" in _line(out, "TTFT:")
    assert "5.0 tokens/s" in _line(out, "prefill:")                      # 2 x 5 tokens / 2 s
    assert "4.0 tokens/s (6 tokens in 3 steps" in _line(out, "decode:")  # 6 tokens / 1.5 s
    assert "100,000.0 ms" in _line(out, "cold TTFT:")                    # the first pass's prefill step
    assert "x1," in _line(out, "MLA modes:") and "(timed pass)" in _line(out, "MLA modes:")


def test_kernel_provenance_line(monkeypatch):
    """The kernels line from k3c.runtime.launcher's stats(): the whole run's counts, and what the timed pass added."""
    from dataclasses import dataclass

    from k3c.commands import run as runner

    @dataclass
    class LaunchStats:
        binaries: int
        jit: int
        interpreted: int
        launches: int
        load_seconds: float
        jit_seconds: float

    total, before = LaunchStats(58, 2, 0, 12345, 0.125, 3.5), LaunchStats(58, 2, 0, 6000, 0.125, 3.5)
    line = runner._kernel_line(True, total, before)
    assert line == ("  kernels:         58 from the artifact's binaries (load 0.12 s), 2 JIT-compiled (3.50 s), "
                    "0 in the interpreter (distinct kernels, whole run); 12,345 launches; timed pass: 0 new JIT, "
                    "0 new binaries")
    assert "timed pass" not in runner._kernel_line(True, total, None)
    total.jit_kernels = ["k_a", "k_b", "k_c", "k_d"]                  # the launcher names what it JIT-compiled
    assert runner._kernel_line(True, total, None).endswith("launches; JIT: k_a, k_b, k_c (+1 more)")
    # with kernels off nothing launches through the launcher
    out = runner.run_report(TINY, batch=1, prompt_len=2, new_tokens=1, use_kernels=False)
    assert "off (--no-kernels" in _line(out, "kernels:")


@pytest.mark.parametrize("args, message", [
    (["--strict", "--jit"], "not allowed with argument"),
    (["--allow-jit", "--strict"], "not allowed with argument"),
    (["--jit", "--no-kernels"], "--jit chooses where kernels come from; it cannot go with --no-kernels"),
    (["--strict", "--tp", "2"], "--strict is not supported with --tp/--ep"),
    (["--no-warmup", "--tp", "2"], "--no-warmup is not supported with --tp/--ep"),
])
def test_run_bad_flag_combinations_exit_2(capsys, args, message):
    assert main(["run", TINY, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


class _Stop(BaseException):        # not an Exception: main() does not turn it into exit 1
    pass


def _stop(*args, **kwargs):
    raise _Stop


def test_kernel_policy_reaches_the_engine(monkeypatch, one_thread):
    """--strict / --allow-jit / --jit reach Engine(kernel_policy=...); the default is "artifact"."""
    from k3c.runtime import engine as engine_mod

    seen = []
    init = engine_mod.Engine.__init__

    def spy(self, *a, kernel_policy=None, **kw):
        seen.append(kernel_policy)
        init(self, *a, kernel_policy=kernel_policy, **kw)

    monkeypatch.setattr(engine_mod.Engine, "__init__", spy)
    from k3c.commands import run as runner

    for flag, policy in (("--strict", "strict"), ("--allow-jit", "allow-jit"), ("--jit", "jit"),
                         (None, "artifact")):
        # kernels on, but the run never launches one: --new-tokens 1 and a spy that stops before the engine steps
        args = ["run", TINY, "--batch", "1", "--prompt-len", "1", "--new-tokens", "1", "--interpret",
                *([flag] if flag else [])]
        monkeypatch.setattr(runner, "_serve", _stop)
        with pytest.raises(_Stop):
            main(args)
        assert seen[-1] == policy
