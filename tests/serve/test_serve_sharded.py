"""`k3c serve --tp N --ep M` on the CPU (gloo): the sharded server returns what the one-process server returns, a
rank that dies gives 503s and a non-zero exit, SIGTERM stops every rank (docs/distributed.md, "Serving").

One one-process server gives the reference texts (single greedy requests), then stops; one sharded server per
layout serves the comparisons (2 ranks each: TP 2 x EP 2 and the split-expert TP 2 x EP 1) and its SIGTERM test;
the killed-rank test starts its own. The full 16-client prompt set of bench/serve_load.py is the slow test.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

import pytest

pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402

from tests.serve.test_serve import ROOT, ServerProcess  # noqa: E402

sys.path.insert(0, str(ROOT))
from bench.serve_load import prompts, reference, run_load  # noqa: E402

SMALL = dict(clients=6, max_tokens=10, disconnect_every=4)       # clients 1 and 5 leave after 3 tokens
FULL = dict(clients=16, max_tokens=24, disconnect_every=8)       # bench/serve_load.py's set (slow)
SERVE_ARGS = ("--max-batch", "8", "--max-context", "512", "--prefix-cache-bytes", str(16 << 20))
SAMPLED = dict(prompt="def main():\n    ", max_tokens=10, temperature=1.0, top_p=0.9, seed=7)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


async def _references(url: str, kw: dict) -> dict:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as c:
        out = await reference(c, "k3-stdlib", prompts(kw["clients"]), kw["max_tokens"])
        r = await c.completions.create(model="k3-stdlib", **SAMPLED)
        out["sampled"] = r.choices[0].text
        return out


class OneProcess:
    """The one-process server's texts for a prompt set (greedy, one request at a time) and a seeded sampled
    request, asked once per set."""

    def __init__(self):
        self.server = ServerProcess(*SERVE_ARGS)
        self._texts: dict[int, dict] = {}

    def texts(self, kw: dict) -> dict:
        if kw["clients"] not in self._texts:
            self._texts[kw["clients"]] = asyncio.run(_references(self.server.url + "/v1", kw))
        return self._texts[kw["clients"]]


@pytest.fixture(scope="module")
def one_process():
    ref = OneProcess()
    yield ref
    ref.server.stop()


@pytest.fixture(scope="module", params=["2x2", "2x1"])
def sharded(request):
    tp, ep = request.param.split("x")
    s = ServerProcess(*SERVE_ARGS, "--tp", tp, "--ep", ep, "--dist-timeout", "60")
    s.layout = request.param
    yield s
    s.stop()


def _settled(s: ServerProcess) -> dict:
    deadline = time.time() + 30
    while time.time() < deadline:
        m = s.metrics()
        if m["k3c_requests_running"] == 0 and m["k3c_requests_waiting"] == 0:
            return m
        time.sleep(0.2)
    return m


def test_streams_equal_the_one_process_server(sharded, one_process):
    """Streamed concurrent clients, two leaving early: every completed text is the one-process server's; a seeded
    sampled request draws the same text (rank 0 samples); the pages come back."""
    tp, ep = sharded.layout.split("x")
    assert any(f"on 2 ranks (TP {tp} x EP {ep}, gloo)" in line for line in sharded.lines)
    assert any("rank 1 of 2 (cpu): ready" in line for line in sharded.lines)
    want = one_process.texts(SMALL)
    res = asyncio.run(run_load(sharded.url + "/v1", "k3-stdlib", **SMALL, reference_texts=want))
    assert res["wrong"] == [] and res["completed"] == 4 and res["finished"] == 4 and res["disconnected"] == 2
    c = OpenAI(base_url=sharded.url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert c.completions.create(model="k3-stdlib", **SAMPLED).choices[0].text == want["sampled"]
    again = prompts(SMALL["clients"])[0]                 # resumed from its checkpoint (every rank's shard of it)
    r = c.completions.create(model="k3-stdlib", prompt=again, max_tokens=SMALL["max_tokens"], temperature=0)
    assert r.choices[0].text == want[again]
    m = _settled(sharded)
    assert m["k3c_requests_running"] == 0 and m["k3c_kv_pages_used"] == m["k3c_prefix_cache_pages"]
    assert m["k3c_prefix_cache_hit_rate"] > 0                        # the shared header resumed, on every rank


@pytest.mark.slow
def test_full_prompt_set_equals_the_one_process_server(sharded, one_process):
    """bench/serve_load.py's prompt set: 16 concurrent streams, every 8th leaving after 3 tokens."""
    res = asyncio.run(run_load(sharded.url + "/v1", "k3-stdlib", **FULL, reference_texts=one_process.texts(FULL)))
    assert res["wrong"] == [] and res["completed"] == 14 and res["finished"] == 14 and res["disconnected"] == 2
    print(f"\n{sharded.layout}: {json.dumps({k: v for k, v in res.items() if k not in ('reference', 'wrong')})}")


def test_sigterm_or_sigint_stops_every_rank(sharded):
    ranks = _children(sharded.proc.pid)
    assert len(ranks) == 1
    code, out = sharded.stop(signal.SIGTERM if sharded.layout == "2x2" else signal.SIGINT)
    assert code == 0 and "stopped after" in out
    assert "rank 1 of 2: stopped after" in out
    assert not any(_alive(p) for p in ranks)


# a hang is seen by the watchdog (a step over --dist-timeout) or by gloo's own timeout of the next plan's broadcast
# (the same 6 s), a killed rank by the watchdog or by the broadcast's closed connection: whichever comes first
# names it
@pytest.mark.parametrize("sig, said", [(signal.SIGKILL, ("rank 1 was killed by signal 9",
                                                         "to the other ranks failed: ")),
                                       (signal.SIGSTOP, ("a step has not finished in 6 s (--dist-timeout): a rank "
                                                         "hangs", "to the other ranks failed: ")),
                                       ], ids=["killed", "hung"])
def test_a_failed_rank_gives_503_and_exit_1(sig, said):
    """Rank 1 killed (SIGKILL) or hung (SIGSTOP) during a stream and a plain request: both get 503 (the stream its
    last error event), rank 0 says what happened and exits 1 (a hang: after --dist-timeout), no rank is left."""
    s = ServerProcess("--max-batch", "4", "--tp", "2", "--ep", "2", "--dist-timeout", "6")
    try:
        ranks = _children(s.proc.pid)
        assert len(ranks) == 1
        c = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        stream = c.completions.create(model="k3-stdlib", prompt="import os\n", max_tokens=1500, temperature=0,
                                      stream=True)
        it = iter(stream.response.iter_lines())
        assert any(next(it).startswith("data: {") for _ in range(3))
        plain: dict = {}
        t = threading.Thread(target=lambda: plain.update(zip(("status", "body"), s.post(
            "/v1/completions", json.dumps({"model": "k3-stdlib", "prompt": "def ", "max_tokens": 1500}).encode(),
            key=None))))
        t.start()
        time.sleep(0.5)
        t0 = time.time()
        os.kill(ranks[0], sig)
        rest = [line for line in it if line]
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "unavailable" and rest[-1] == "data: [DONE]"
        t.join(30)
        assert plain["status"] == 503 and plain["body"]["error"]["code"] == "unavailable"
        out, err = s.proc.communicate(timeout=60)          # it exits by itself
        waited, code, out = time.time() - t0, s.proc.returncode, "".join(s.lines) + out + err
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 1 and any(x in out for x in said) and "Traceback" not in out, out
    assert waited < 30
    assert not any(_alive(p) for p in ranks)


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "not divisible by 3"),
    (["--tp", "2", "--ep", "3"], "one must divide the other"),
    (["--tp", "2", "--speculate", "ngram"], "--speculate is not built for a sharded server"),
])
def test_bad_layouts_exit_2_before_any_rank_starts(args, message, capsys):
    from k3c.cli import main

    assert main(["serve", str(ROOT / "examples" / "k3-stdlib"), "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_memory_check_runs_per_rank_before_loading():
    """Every rank checks what it would hold (its slices; the CPU ranks of one host together) before allocating;
    the refusal names a rank, rank 0 exits 2 with one line, no rank is left. (A step budget of 8M tokens: under the
    default budget the activations of a step are small and the pool of this shape fits.)"""
    import subprocess

    from k3c.commands.run import available_bytes

    free = available_bytes("cpu")
    if free is None or free > 150 << 30:
        pytest.skip("this machine could hold the oversized pool")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "k3c.cli", "serve", str(ROOT / "examples" / "k3-stdlib"), "--port", "0",
                        "--tp", "2", "--max-batch", "4096", "--max-context", "2048", "--max-step-tokens", str(1 << 23)],
                       capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "for each of 2 ranks" in err[0] and "rank 0 of 2: --max-batch 4096" in err[0]
    assert "Traceback" not in r.stdout + r.stderr
    print(f"refused in {time.time() - t0:.1f} s")
