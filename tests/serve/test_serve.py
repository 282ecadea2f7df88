"""`k3c serve` on the CPU with the trained example model, driven over HTTP by the official `openai` client.

One server process (the real CLI, on a free localhost port, with an API key) serves the module; the load test
and the shutdown test start their own.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "examples" / "k3-stdlib")
KEY = "test-key"
PROMPT = "import os\n"


class ServerProcess:
    def __init__(self, *args: str):
        env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
        env.pop("K3C_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "k3c.cli", "serve", MODEL, "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"k3c serve ended: {self.proc.stderr.read()}")
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return
        raise RuntimeError("k3c serve did not start in 120 s")

    def get(self, path: str, key: str | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, data: bytes, key: str | None = KEY) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, "".join(self.lines) + out


@pytest.fixture(scope="module")
def server():
    # a small step budget: prompts are prefilled in chunks (of 4, beside decoding streams), and the greedy
    # completions below still equal k3c run's whole-prompt prefill
    s = ServerProcess("--api-key", KEY, "--max-batch", "8", "--max-step-tokens", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def run_text_output():
    from k3c.commands.run import run_text

    text, _ = run_text(MODEL, PROMPT, new_tokens=24)
    return text


def test_greedy_completion_equals_k3c_run(client, run_text_output):
    r = client.completions.create(model="k3-stdlib", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == run_text_output
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 24, 27)
    streamed = client.completions.create(model="k3-stdlib", prompt=PROMPT, max_tokens=24, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == run_text_output
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_chat_uses_the_plain_template(client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model="k3-stdlib", messages=messages, max_tokens=12, temperature=0)
    plain = "system: You write Python.\nuser: def add(a, b):\nassistant:"
    c = client.completions.create(model="k3-stdlib", prompt=plain, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == c.choices[0].text
    assert r.usage.prompt_tokens == c.usage.prompt_tokens and r.usage.completion_tokens == 12
    stream = client.chat.completions.create(model="k3-stdlib", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_end_the_text_before_them(client, run_text_output):
    assert "\n" in run_text_output
    r = client.completions.create(model="k3-stdlib", prompt=PROMPT, max_tokens=24, temperature=0, stop=["\n"])
    assert r.choices[0].text == run_text_output.split("\n")[0]
    assert r.choices[0].finish_reason == "stop"
    # a stop string spanning tokens, streamed: nothing of it is sent
    cut = run_text_output.index("sys") + 1
    stop = run_text_output[cut - 1:cut + 3]
    chunks = list(client.completions.create(model="k3-stdlib", prompt=PROMPT, max_tokens=24, temperature=0,
                                            stop=[stop, "never-there"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == run_text_output[:cut - 1]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="k3-stdlib", prompt="def ", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=7, n=3, **kw)
    b = client.completions.create(seed=7, n=3, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1            # choice i draws from seed + i
    assert [c.index for c in a.choices] == [0, 1, 2] and a.usage.completion_tokens == 48
    one = client.completions.create(seed=8, **kw)
    assert one.choices[0].text == a.choices[1].text


def test_logprobs(client):
    r = client.completions.create(model="k3-stdlib", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0 and abs(max(top.values()) - chosen) < 1e-5   # greedy: the top one
    chat = client.chat.completions.create(model="k3-stdlib", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["k3-stdlib"]
    assert server.get("/health") == (200, '{"status":"ok"}')
    m = server.metrics()
    assert m['k3c_requests_total{endpoint=completions,status=200}'] >= 1
    assert m["k3c_generated_tokens_total"] > 0 and m["k3c_time_to_first_token_seconds_count"] > 0
    assert m["k3c_kv_pages_total"] > 0 and m["k3c_requests_running"] == 0
    assert 0 <= m["k3c_prefix_cache_hit_rate"] <= 1


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"model": "k3-stdlib"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "max_tokens": "8"}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "max_tokens": 100000000000}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "temperature": 9}', 400, "temperature"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "stop": [1]}', 400, "stop"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "echo": true}', 400, "echo"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "presence_penalty": 2.5}', 400, "presence_penalty"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "logit_bias": {"x": 1}}', 400, "logit_bias.x"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x", "frobnicate": 1}', 400, "frobnicate"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": [99999]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "k3-stdlib", "prompt": "' + b"x " * 5000 + b'"}', 400, "prompt"),
    ("/v1/chat/completions", b'{"model": "k3-stdlib", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "k3-stdlib", "messages": [{"role": "wizard", "content": "x"}]}', 400,
     "messages[0].role"),
    ("/v1/chat/completions", b'{"model": "k3-stdlib", "messages": [{"role": "user", "content": 5}]}', 400,
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "k3-stdlib", "messages": [{"role": "user", "content": "x"}], '
                             b'"tools": [{"type": "function"}]}', 400, "tools[0].function"),
    ("/v1/chat/completions", b'{"model": "k3-stdlib", "messages": [{"role": "user", "content": "x"}], '
                             b'"top_logprobs": 2}', 400, "top_logprobs"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    got, err = server.post(path, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param


def test_auth_and_unknown_routes(server):
    status, err = server.post("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x"}', key=None)
    assert status == 401 and err["error"]["type"] == "authentication_error"
    assert server.post("/v1/completions", b'{"model": "k3-stdlib", "prompt": "x"}', key="wrong")[0] == 401
    assert server.get("/v1/models")[0] == 401 and server.get("/v1/models", KEY)[0] == 200
    status, body = server.get("/v1/nothing", KEY)
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    assert server.get("/v1/completions", KEY)[0] == 405
    assert server.get("/health")[0] == 200           # open to probes


def test_server_survived_the_bad_requests(client, run_text_output):
    r = client.completions.create(model="k3-stdlib", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == run_text_output


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_load_64_streaming_clients():
    """64 concurrent streams with a shared prefix, every 8th leaving after 3 tokens, twice: every completed stream
    equals its prompt's greedy output, none is lost, the pages come back, memory is flat in the second round."""
    sys.path.insert(0, str(ROOT))
    from bench.serve_load import run_load

    s = ServerProcess("--max-batch", "16", "--max-context", "512", "--prefix-cache-bytes", str(16 << 20))
    try:
        url = s.url + "/v1"
        first = asyncio.run(run_load(url, "k3-stdlib", clients=64, max_tokens=24, disconnect_every=8))
        rss = _rss_kib(s.proc.pid)
        second = asyncio.run(run_load(url, "k3-stdlib", clients=64, max_tokens=24, disconnect_every=8,
                                      reference_texts=first["reference"]))
        grown = _rss_kib(s.proc.pid) - rss
        for res in (first, second):
            assert res["wrong"] == [] and res["completed"] == 56 and res["finished"] == 56
            assert res["disconnected"] == 8
        deadline = time.time() + 30
        while time.time() < deadline:
            m = s.metrics()
            if m["k3c_requests_running"] == 0 and m["k3c_requests_waiting"] == 0:
                break
            time.sleep(0.2)
        assert m["k3c_requests_running"] == 0 and m["k3c_requests_waiting"] == 0
        assert m["k3c_kv_pages_used"] == m["k3c_prefix_cache_pages"]     # only checkpoints hold pages
        assert m["k3c_choices_finished_total{reason=cancelled}"] == 16
        assert m["k3c_prefix_cache_hit_rate"] > 0.5                      # the shared header is resumed
        assert grown < 64 << 10, f"RSS grew by {grown} KiB in the second round"
        print(f"\nload: {json.dumps({k: v for k, v in second.items() if k != 'reference'})}")
    finally:
        code, out = s.stop()
    assert code == 0 and "stopped after" in out


def test_sigterm_ends_open_streams_with_an_error_event():
    s = ServerProcess()
    c = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = c.completions.create(model="k3-stdlib", prompt=PROMPT, max_tokens=1500, temperature=0, stream=True)
    it = iter(stream.response.iter_lines())
    got = [next(it) for _ in range(3)]
    assert any(line.startswith("data: {") for line in got)
    os.kill(s.proc.pid, signal.SIGTERM)
    rest = [line for line in it if line]
    assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "unavailable" and rest[-1] == "data: [DONE]"
    code, out = s.stop()
    assert code == 0 and "stopped after" in out
    assert re.search(r"(\d+) of \1 MLA pages free|(\d+) of (\d+) MLA pages free", out)
