"""`k3c run` through the serving engine: the report's fields, the MLA modes that ran, bad arguments exit 2."""
import re

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


@pytest.mark.parametrize("args, message", [
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--new-tokens", "5000"], "exceeds the spec's max_context 4096"),
])
def test_run_bad_arguments_exit_2(capsys, args, message):
    assert main(["run", TINY, "--no-kernels", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
