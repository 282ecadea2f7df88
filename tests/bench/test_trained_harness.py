"""bench/trained.py's own pieces: check_logprobs_close on synthetic logprobs (equal, acceptable and unacceptable
mismatches, the stop after the first difference), the agreement summary, the argument checks, and the held-out
sampling on a few stdlib files (with the shipped tokenizer, when examples/k3-stdlib is there)."""
import importlib
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from k3c.errors import ArgumentError

ROOT = Path(__file__).resolve().parents[2]
HAVE_MODEL = (ROOT / "examples" / "k3-stdlib" / "model.safetensors").exists()
V = 16


@pytest.fixture(scope="module")
def bt():
    """bench/trained.py as the module bench.trained (the name its rank processes import it by)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("bench.trained")


def ranked(*top: int) -> torch.Tensor:
    """fp32 log-softmax over V tokens whose most likely tokens are `top`, in that order."""
    logits = torch.zeros(V)
    for rank, tok in enumerate(top):
        logits[tok] = 10.0 - rank
    return torch.log_softmax(logits, -1)


def gen(bt, steps):
    """steps: (token, its distribution's top tokens) per step."""
    return bt.Generation([tok for tok, _ in steps], [ranked(*top) for _, top in steps])


def test_equal_generations_agree(bt):
    a = gen(bt, [(1, (1, 2)), (3, (3, 4)), (5, (5, 6))])
    ag = bt.check_logprobs_close(a, gen(bt, [(1, (1, 9)), (3, (3, 9)), (5, (5, 9))]))
    assert (ag.ok, ag.steps, ag.matched, ag.first_diff) == (True, 3, 3, None)


def test_mismatch_within_both_top_k_is_acceptable_and_stops_there(bt):
    ref = gen(bt, [(1, (1,)), (2, (2, 7, 8)), (3, (3,)), (4, (4,))])
    # step 1: other picks 7 (ref's 2nd choice) and ranks ref's 2 second; after it, anything (other prefix)
    other = gen(bt, [(1, (1,)), (7, (7, 2)), (15, (15,)), (14, (14,))])
    ag = bt.check_logprobs_close(ref, other, topk=2)
    assert (ag.ok, ag.steps, ag.matched, ag.first_diff) == (True, 2, 1, 1)
    assert "step 1" in ag.detail


def test_mismatch_outside_top_k_fails(bt):
    ref = gen(bt, [(1, (1,)), (2, (2, 3, 4, 5, 6, 7))])
    far = gen(bt, [(1, (1,)), (7, (7, 2))])                       # 7 is ref's 6th choice
    ag = bt.check_logprobs_close(ref, far, topk=5)
    assert (ag.ok, ag.first_diff, ag.matched) == (False, 1, 1) and "NOT in ref's top-5" in ag.detail
    assert bt.check_logprobs_close(ref, far, topk=6).ok            # within the 6 most likely: acceptable
    # each side must hold the other's token: ref's 2 missing from the other's top-k fails too
    one_sided = gen(bt, [(1, (1,)), (3, (3, 9, 10, 11, 12, 13))])
    ag = bt.check_logprobs_close(ref, one_sided, topk=5)
    assert not ag.ok and "NOT in other's top-5" in ag.detail


def test_lengths_and_arguments(bt):
    a = gen(bt, [(1, (1,)), (2, (2,))])
    short = gen(bt, [(1, (1,))])
    ag = bt.check_logprobs_close(a, short)
    assert (ag.ok, ag.steps, ag.first_diff) == (False, 1, 1) and "lengths differ" in ag.detail
    with pytest.raises(ArgumentError, match="topk"):
        bt.check_logprobs_close(a, a, topk=0)
    with pytest.raises(ArgumentError, match="logprob rows"):
        bt.check_logprobs_close(a, bt.Generation([1, 2], [ranked(1)]))


def test_agreement_summary_counts(bt):
    ref = [gen(bt, [(1, (1, 2)), (3, (3,))]), gen(bt, [(1, (1, 2)), (3, (3,))]), gen(bt, [(1, (1,)), (3, (3,))])]
    other = [gen(bt, [(1, (1,)), (3, (3,))]),                      # equal
             gen(bt, [(2, (2, 1)), (9, (9,))]),                    # acceptable at step 0
             gen(bt, [(1, (1,)), (9, (9,))])]                      # fails at step 1
    s = bt.agreement_summary(ref, other)
    assert (s["full"], s["acceptable"], s["failed"]) == (1, 1, 1)
    assert s["mean_matched"] == pytest.approx((2 + 0 + 1) / 3) and len(s["failures"]) == 1
    with pytest.raises(ArgumentError, match="generations"):
        bt.agreement_summary(ref, other[:2])


def test_bad_path_device_and_inputs(bt):
    with pytest.raises(ArgumentError, match="path must be one of"):
        bt.greedy("compiled-fp16", [[1, 2]], 2)
    with pytest.raises(ArgumentError, match="new_tokens"):
        bt.greedy("reference-fp32", [[1, 2]], 0)
    with pytest.raises(ArgumentError, match="prompts"):
        bt.greedy("reference-fp32", [[]], 2)
    with pytest.raises(ArgumentError, match="its name fixes the dtype"):
        bt.greedy("compiled-bf16", [[1, 2]], 2, dtype=torch.float32)
    with pytest.raises(ArgumentError, match="dtype must be"):
        bt.greedy("prefix-resume", [[1, 2]], 2, dtype=torch.float16)
    with pytest.raises(ArgumentError, match=r"windows must be an integer tensor \[N, T\+1\]"):
        bt.heldout_nll("reference-fp32", torch.zeros(2, 5))
    if not torch.cuda.is_available():
        with pytest.raises(ArgumentError, match="cuda-graphs needs device cuda"):
            bt.greedy("cuda-graphs", [[1, 2]], 2, model_dir=ROOT / "no-such-model")


@pytest.mark.skipif(not HAVE_MODEL, reason="examples/k3-stdlib is not there")
def test_heldout_data_from_a_few_stdlib_files(bt):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = bt.heldout_files(stdlib)[:3]
    assert len(files) == 3 and all(bt._train_example().held_out(f.relative_to(stdlib).as_posix()) for f in files)
    prompts = bt.heldout_prompts(2, files=files)
    assert len(prompts) == 2 and prompts[0] != prompts[1]
    assert all(len(p) >= bt.MIN_PROMPT_TOKENS for p in prompts)
    tok = bt.tokenizer()
    assert files[0].read_text(encoding="utf-8").startswith(tok.decode(prompts[0]))
    stream = bt.heldout_stream(files=files)
    assert stream.dtype == torch.long and int((stream == tok.eos_id).sum()) == 3     # one EOS after each file
    w = bt.heldout_windows(4, 32, files=files)
    m = (stream.numel() - 1) // 32
    starts = [(i * m // 4) * 32 for i in range(4)]
    assert w.shape == (4, 33) and all(torch.equal(w[i], stream[s:s + 33]) for i, s in enumerate(starts))
    assert starts[-1] > stream.numel() // 2                        # spread over the stream, not its start
    with pytest.raises(ArgumentError, match="windows of 32 tokens"):
        bt.heldout_windows(m + 1, 32, files=files)
