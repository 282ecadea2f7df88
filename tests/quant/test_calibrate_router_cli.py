"""`k3c calibrate-router`: Quantile Balancing of recorded router scores per MoE layer, written as
`gate.e_score_correction_bias`; bad score files exit 2 naming the tensor."""
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3c.cli import main
from k3c.quant import load_imbalance, quantile_balancing

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "k3-tiny.yaml")   # 8 experts, top-2, layers 1-7 MoE
KEY = "layers.{}.block_sparse_moe.gate.{}"


def skewed(seed, T=3001, n=8):
    gen = torch.Generator().manual_seed(seed)
    off = torch.linspace(-3, 3, n)[torch.randperm(n, generator=gen)]     # preferred and neglected experts
    return torch.sigmoid(torch.randn(T, n, generator=gen) + off)


def test_balances_each_layer_and_writes_biases(tmp_path, capsys):
    s1, s3 = skewed(1), skewed(3)
    start = torch.randn(8, generator=torch.Generator().manual_seed(4)) * 0.01
    save_file({KEY.format(1, "scores"): s1, KEY.format(3, "scores"): s3,
               KEY.format(3, "e_score_correction_bias"): start}, str(tmp_path / "scores.safetensors"))
    out = tmp_path / "bias.safetensors"
    assert main(["calibrate-router", TINY, str(tmp_path / "scores.safetensors"), "-o", str(out),
                 "--iterations", "6"]) == 0
    got = load_file(str(out))
    assert sorted(got) == [KEY.format(1, "e_score_correction_bias"), KEY.format(3, "e_score_correction_bias")]
    printed = capsys.readouterr().out
    for layer, s, b0 in ((1, s1, None), (3, s3, start)):
        b = b0
        for _ in range(6):
            b = quantile_balancing(s, 2, b)
        bias = got[KEY.format(layer, "e_score_correction_bias")]
        assert bias.dtype == torch.float32 and torch.equal(bias, b)
        before, after = load_imbalance(s, 2, b0), load_imbalance(s, 2, bias)
        assert before > 2.0 and after < 1.1                 # plain top-k stays skewed; balanced after
        line = re.search(rf"layer {layer}: ([0-9.]+) -> ([0-9.]+)", printed)
        assert line and float(line.group(1)) == pytest.approx(before, abs=1e-3)
        assert float(line.group(2)) == pytest.approx(after, abs=1e-3)


@pytest.mark.parametrize("tensors, words", [
    ({KEY.format(0, "scores"): torch.rand(5, 8)}, "layer 0 is not a MoE layer"),
    ({KEY.format(1, "scores"): torch.rand(5, 7)}, "must be float [tokens, 8]"),
    ({KEY.format(1, "scores"): torch.full((5, 8), float("nan"))}, "NaN"),
    ({"layers.1.router": torch.rand(5, 8)}, "unexpected tensor 'layers.1.router'"),
    ({KEY.format(2, "e_score_correction_bias"): torch.zeros(8)}, "no matching layers.2"),
])
def test_bad_scores_exit_2(tmp_path, capsys, tensors, words):
    save_file(tensors, str(tmp_path / "s.safetensors"))
    assert main(["calibrate-router", TINY, str(tmp_path / "s.safetensors"), "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_argument_errors(tmp_path, capsys):
    assert main(["calibrate-router", TINY, str(tmp_path / "none.safetensors"), "-o", str(tmp_path / "b")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "b").write_text("x")
    save_file({KEY.format(1, "scores"): skewed(0, 64)}, str(tmp_path / "s.safetensors"))
    assert main(["calibrate-router", TINY, str(tmp_path / "s.safetensors"), "-o", str(tmp_path / "b")]) == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "b").read_text() == "x"
    assert main(["calibrate-router", TINY, str(tmp_path / "s.safetensors"), "-o", str(tmp_path / "b"),
                 "--iterations", "0"]) == 2
