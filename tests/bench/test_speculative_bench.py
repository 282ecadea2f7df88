"""bench/speculative.py in its small mode (CPU, fp32, kernels off): the trained model's rows (fixed batches and
sustained load) and the replayed k3-tiny timing rows are there and consistent: speculation emitted exactly plain
decoding's tokens (trained rows), the accepted counts add up to the histogram, and the replay drafter kept the counts
it was given."""
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

import speculative  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "spec.json"
    # --every-step: part 1 verifies wherever the lookup finds a draft. The adaptive controller's choices follow
    # measured step times, and on a loaded CPU it may verify nothing in the timed passes, leaving part 2 no
    # acceptance to replay
    assert speculative.main(["--device", "cpu", "--no-kernels", "--small", "--no-draft", "--workloads", "code",
                             "--every-step", "--wide", "examples/k3-tiny.yaml", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_trained_rows_identical_to_plain_decoding(result):
    rows = result["trained"]["rows"]
    assert {(r["batch"], r["config"]) for r in rows} == {(b, c) for b in (1, 2) for c in ("plain", "ngram")}
    for r in rows:
        assert r["decode_tokens_per_s"] > 0
        if r["config"] == "plain":
            assert r["drafted"] == 0 and r["verify_calls"] == 0
            continue
        assert r["identical"] == r["requests"] == (2 if r["batch"] == 1 else r["batch"])   # greedy, fp32: token for token
        assert len(r.get("per_request_tokens_per_s", [0, 0])) == 2   # batch 1: each prompt alone
        assert sum(r["accept_hist"].values()) == r["verifications"]
        assert sum(int(k) * n for k, n in r["accept_hist"].items()) == r["accepted"] <= r["drafted"]
        if r["verifications"]:
            assert 1 <= r["tokens_per_verification"] <= result["draft_len"] + 1


def test_every_step_verifies_wherever_a_draft_is_found(result):
    rows = [r for r in result["trained"]["rows"] if r["config"] == "ngram"]
    assert rows and all(r["verifications"] > 0 for r in rows)     # greedy, fp32: the same drafts every run


def test_replayed_acceptance_follows_the_histogram(result):
    rows = [r for r in result["wide"]["rows"] if r["config"] == "replay (adaptive off)"]
    assert rows
    for r in rows:
        hist = {int(k): n for k, n in r["replayed_hist"].items()}
        got = {int(k): n for k, n in r["accept_hist"].items()}
        # every verification kept one of the replayed counts, or fewer where the request's budget capped the draft
        top = max(min(k, result["draft_len"]) for k in hist)
        assert got and max(got) <= top
        assert sum(got.values()) == r["verifications"] > 0 and r["speedup"] > 0


def test_sustained_rows_queue_more_requests_than_the_batch(result):
    rows = result["trained"]["sustained"]
    assert {(r["batch"], r["config"]) for r in rows} == {(2, "plain"), (2, "ngram")}
    for r in rows:
        assert r["requests"] == 4 and r["tokens_per_s"] > 0 and r["decode_calls"] + r["verify_calls"] > 0
    ngram = next(r for r in rows if r["config"] == "ngram")
    assert ngram["identical"] == ngram["requests"]          # greedy, fp32: token for token
