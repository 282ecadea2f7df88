"""The CLI as other tools' users expect it (issue 59): torch's thread count chosen from the cores really available
and reported, text streamed as it is decided, --stop / --repetition-penalty / --max-tokens / --chat / --system,
`k3c targets`, grouped `k3c run --help` with defaults, one error prefix, "did you mean", serve's --max-model-len
and its memory refusal in its own flags, one overwrite policy for every file written, and a CPU run of a GPU
artifact saying its kernels were not used."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from k3c.cli import build_parser, main
from k3c.commands.threads import cgroup_quota, choose_threads
from k3c.runtime.sampling import SamplingParams, penalize

TINY = "examples/k3-tiny.yaml"
STDLIB = "examples/k3-stdlib"


# ---- threads -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("affinity, quota, load, cpus, want", [
    (2, None, 0.0, 2, 2),          # an idle 2-core box: both
    (2, None, 1.0, 2, 1),          # one busy process beside it: one (issue 59: 38 tok/s vs 1.5-29 with two)
    (2, None, 5.0, 2, 1),          # never below one
    (64, 4.0, 3.0, 64, 4),         # a container with a 4-CPU quota on a busy-ish 64-core host: its quota
    (64, 1.5, 0.0, 64, 2),         # a fractional quota rounds up
    (8, None, 6.2, 8, 2),          # 8 cores, ~6 busy: what is left
    (4, None, None, 4, 4),         # no load average: every usable core
])
def test_thread_count_follows_affinity_quota_and_load(affinity, quota, load, cpus, want):
    c = choose_threads(env={}, affinity=affinity, quota=quota, load=load, cpus=cpus)
    assert c.threads == want, c
    assert "--threads N overrides" in c.why


def test_thread_flag_and_environment_win():
    assert choose_threads(3, env={"OMP_NUM_THREADS": "7"}, affinity=2, quota=None, load=9.0, cpus=2).threads == 3
    c = choose_threads(env={"OMP_NUM_THREADS": "7"}, affinity=2, quota=None, load=9.0, cpus=2)
    assert c.threads == 7 and "OMP_NUM_THREADS" in c.why


def test_cgroup_quota_is_read_on_the_process_path_and_its_parents(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cgroup_quota(str(tmp_path), str(proc)) == 1.5
    proc.write_text("0::/\n")
    assert cgroup_quota(str(tmp_path), str(proc)) is None


def test_run_report_says_how_many_threads_ran(capsys):
    before = torch.get_num_threads()
    assert main(["run", TINY, "--new-tokens", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  threads:         1 \(--threads\)$", out, re.M), out
    assert torch.get_num_threads() == before                     # an in-process call leaves the caller's setting


# ---- streaming -----------------------------------------------------------------------------------------------------

def test_text_streams_as_tokens_are_decided(tmp_path):
    """The first generated text comes through the pipe while the process is still generating: it is interrupted
    then, before writing its stats (a run that wrote once at the end would have nothing to show by then)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "k3c.cli", "run", STDLIB, "--prompt", "import os\\n",
                             "--new-tokens", "1900"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        got = b""
        deadline = time.monotonic() + 240
        while len(got) <= len(b"import os\n") + 8:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk and time.monotonic() < deadline, (got, proc.stderr.read()[-2000:])
            got += chunk
        assert got.startswith(b"import os\n")
        assert proc.poll() is None, "the process ended before its text was read: it did not stream"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and b"k3c: interrupted" in err and b"tokens/s" not in err, err[-2000:]


def test_stop_string_ends_the_text(capsys):
    assert main(["run", STDLIB, "--prompt", "import os\\n", "--max-tokens", "64", "--stop", "import"]) == 0
    out, err = capsys.readouterr()
    assert out == "import os\n\n" or (out.startswith("import os\n") and "import" not in out[len("import os\n"):]), out
    assert "stopped at a --stop string" in err


def test_no_stream_prints_the_same_text(capsys):
    assert main(["run", STDLIB, "--prompt", "import os\\n", "--new-tokens", "12", "--no-stream"]) == 0
    plain = capsys.readouterr().out
    assert main(["run", STDLIB, "--prompt", "import os\\n", "--new-tokens", "12"]) == 0
    assert capsys.readouterr().out == plain


# ---- repetition penalty --------------------------------------------------------------------------------------------

def test_repetition_penalty_is_transformers_rule():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    context = [3, 7, 7, 11, 40]
    ours = penalize(logits, context, 1.3)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([context]), logits[None].clone())[0]
    assert torch.equal(ours, ref)
    assert penalize(logits, context, 1.0) is logits
    with pytest.raises(Exception, match="repetition penalty"):
        SamplingParams(repetition_penalty=0.0)


def test_repetition_penalty_breaks_the_readme_loop(capsys):
    """The issue's loop (`def fibonacci(n):` greedy: 'the string of the string of ...') is broken by the penalty."""
    prompt = ["run", STDLIB, "--prompt", "def fibonacci(n):", "--new-tokens", "40"]
    assert main(prompt) == 0
    looped = capsys.readouterr().out
    assert looped.count("the string of") >= 4
    assert main(prompt + ["--repetition-penalty", "1.3"]) == 0
    out, err = capsys.readouterr()
    assert out.count("the string of") <= 1 and "repetition penalty 1.3" in err


# ---- chat ----------------------------------------------------------------------------------------------------------

def test_chat_reads_turns_and_answers_each(monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("import os\nimport sys\n"))
    assert main(["run", STDLIB, "--chat", "--system", "You write Python.", "--new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") >= 2 and "prompt tokens" in err
    assert main(["run", STDLIB, "--system", "x", "--prompt", "y"]) == 2
    assert "--system opens a --chat" in capsys.readouterr().err


# ---- conventions ---------------------------------------------------------------------------------------------------

def test_targets_lists_every_target(capsys):
    from k3c.codegen.targets import TARGETS

    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    for name in TARGETS:
        assert re.search(rf"^{name}\s", out, re.M), name
    assert "b300" in out and "sm_103" in out and "gfx950" in out


def test_run_help_is_grouped_with_defaults():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["run"]
    titles = [g.title for g in sub._action_groups]
    for group in ("input", "generation", "sampling", "performance", "cache"):
        assert group in titles, titles
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings


@pytest.mark.parametrize("argv, want", [
    (["run", TINY, "--new-tokens", "0"], "k3c: error: --new-tokens must be >= 1, got 0 (see k3c run --help)"),
    (["run", TINY, "--new-tokns", "3"], "k3c: error: unknown argument --new-tokns (did you mean --new-tokens?)"),
    (["compil", TINY], "(did you mean compile?)"),
    (["run", "examples/k3-tiny.yml"], "examples/k3-tiny.yml: no such file (did you mean examples/k3-tiny.yaml?)"),
    (["run", TINY, "--kv-dtype", "fp16"], "--kv-dtype: invalid choice: 'fp16' (did you mean bf16?)"),
    (["run", TINY, "--batch", "2", "--prompt", "x"], "k3c: error: --batch shapes the random prompts"),
])
def test_errors_have_one_prefix_and_suggest(argv, want, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and want in err and err.startswith("k3c: error: "), err
    assert not re.search(r"error: (k3c \w+: |argument )", err), err          # no second prefix


def test_max_tokens_and_max_model_len_are_aliases():
    p = build_parser()
    assert p.parse_args(["run", TINY, "--max-tokens", "5"]).new_tokens == 5
    assert p.parse_args(["serve", STDLIB, "--max-model-len", "512"]).max_context == 512


def test_serve_memory_refusal_names_serves_flags(monkeypatch, capsys):
    from k3c.commands import run as run_cmd

    monkeypatch.setattr(run_cmd, "available_bytes", lambda device: 1 << 20)
    assert main(["serve", STDLIB, "--port", "0", "--max-batch", "16"]) == 2
    err = capsys.readouterr().err
    assert "--max-batch 16 x --max-context 2048" in err and "--prompt-len" not in err and "--batch " not in err, err


# ---- one overwrite policy ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["inspect", TINY, "--after", "frontend", "-o", "{out}"],
    ["inspect", TINY, "--format", "dot", "-o", "{out}"],
    ["inspect", TINY, "--format", "onnx", "-o", "{out}"],
    ["plan", TINY, "--target", "cpu", "--plot", "{out}"],
    ["calibrate-router", STDLIB, "--text", "k3c/limits.py", "--window", "64", "-o", "{out}"],
])
def test_every_file_output_refuses_to_replace_without_force(argv, tmp_path, capsys):
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    out = tmp_path / "user-file"
    out.write_text("mine")
    args = [a.replace("{out}", str(out)) for a in argv]
    assert main(args) == 2
    assert "exists; pass --force to replace it" in capsys.readouterr().err and out.read_text() == "mine"
    assert main(args + ["--force"]) == 0
    assert out.read_bytes() != b"mine" and os.listdir(tmp_path) == ["user-file"]     # no staging left
    link = tmp_path / "link"
    link.symlink_to(out)
    assert main([a.replace("{out}", str(link)) for a in argv] + ["--force"]) == 2
    assert "symlink" in capsys.readouterr().err


# ---- a GPU artifact on the CPU -------------------------------------------------------------------------------------

def test_cpu_run_of_a_gpu_artifact_says_its_kernels_were_not_used(tmp_path, capsys):
    art = tmp_path / "art"
    assert main(["compile", TINY, "--target", "h200", "-o", str(art), "--passes", "mla-absorb"]) == 0
    capsys.readouterr()
    assert main(["run", str(art), "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "torch ops, not the artifact's h200 kernels" in out, out
