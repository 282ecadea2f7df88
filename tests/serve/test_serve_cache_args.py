"""`k3c serve`'s prefix-cache arguments become the PrefixCache it serves with (policy, tiers, protection), its step
token budget and latency target the engine's; bad ones exit 2 naming the argument before anything loads."""
import pytest

from k3c.cli import build_parser, main
from k3c.commands.serve import prefix_cache


def _args(*extra):
    return build_parser().parse_args(["serve", "examples/k3-tiny.yaml", *extra])


def test_defaults_and_flags(tmp_path):
    pc = prefix_cache(_args())
    assert (pc.policy, pc.host_bytes, pc.disk, pc.interval) == ("lru", 0, False, 32768)
    pc = prefix_cache(_args("--kv-policy", "working-set", "--protect-s", "2.5", "--host-bytes", "4096",
                            "--disk-dir", str(tmp_path), "--prefix-interval", "64"))
    assert (pc.policy, pc.protect_s, pc.host_bytes, pc.disk, pc.interval) == ("working-set", 2.5, 4096, True, 64)
    assert pc.disk_tier.directory == str(tmp_path)
    assert prefix_cache(_args("--no-prefix-cache")) is None
    assert _args().admission == "reserve" and _args("--admission", "optimistic").admission == "optimistic"


def test_step_budget_flags():
    from k3c.commands.serve import MAX_STEP_TOKENS

    assert (_args().max_step_tokens, _args().itl_target_ms) == (MAX_STEP_TOKENS, None)
    a = _args("--max-step-tokens", "512", "--itl-target-ms", "40")
    assert (a.max_step_tokens, a.itl_target_ms) == (512, 40.0)


@pytest.mark.parametrize("extra, message", [
    (["--kv-policy", "mru"], "--kv-policy: invalid choice"),
    (["--admission", "eager"], "--admission: invalid choice"),
    (["--protect-s", "-1"], "--protect-s must be a number of seconds"),
    (["--protect-s", "nan"], "--protect-s must be a number of seconds"),
    (["--max-step-tokens", "0"], "--max-step-tokens must be >= 1"),
    (["--max-step-tokens", "1.5"], "--max-step-tokens"),
    (["--itl-target-ms", "0"], "--itl-target-ms must be a number of milliseconds"),
    (["--itl-target-ms", "nan"], "--itl-target-ms must be a number of milliseconds"),
])
def test_bad_arguments_exit_2(capsys, extra, message):
    assert main(["serve", "examples/k3-tiny.yaml", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_disk_dir_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["serve", "examples/k3-tiny.yaml", "--port", "0", "--disk-dir", str(f)]) == 2
    err = capsys.readouterr().err
    assert "--disk-dir" in err and "not a directory" in err and "Traceback" not in err
