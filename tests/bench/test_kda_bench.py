"""bench/kda.py: its FLOP / byte counts against hand counts, the derivation of k3c's inputs from FlashKDA's raw ones
against FlashKDA's semantics written out here, and the tiny CPU dry run end to end (JSON rows, k3c checked against
the torch reference standing in for the peers)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location("kda_bench", ROOT / "bench" / "kda.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kda_bench"] = mod          # dataclasses look the module up while the class is made
    spec.loader.exec_module(mod)
    return mod


kb = _load_bench()

# per chunk and head at C = 64, D = 128 (K3.md): 12 * 64^3 = 3,145,728; 8 * 64^2 * 128 = 4,194,304;
# 6 * 64 * 128^2 = 6,291,456; sum 13,631,488
PER_CHUNK_HEAD = 13_631_488


def test_chunk_count_is_per_sequence():
    assert kb.n_chunks([130], 64) == 3                       # 64 + 64 + 2
    assert kb.n_chunks([128], 64) == 2
    assert kb.n_chunks([64, 66], 64) == 1 + 2                # not ceil(130 / 64) = 3 by luck: [1, 65] below
    assert kb.n_chunks([1, 65], 64) == 1 + 2                 # one packed count would say ceil(66 / 64) = 2
    # FlashKDA's varlen case: 1300 -> 21, 547 -> 9, 2048 -> 32, 963 -> 16, 271 -> 5, 3063 -> 48
    assert kb.n_chunks([1300, 547, 2048, 963, 271, 3063], 64) == 131


def test_prefill_flops_by_hand():
    assert 12 * 64 ** 3 + 8 * 64 ** 2 * 128 + 6 * 64 * 128 ** 2 == PER_CHUNK_HEAD
    assert kb.prefill_flops([130], 2) == 2 * 3 * PER_CHUNK_HEAD == 81_788_928
    assert kb.prefill_flops([8192] * 4, 12) == 12 * 4 * 128 * PER_CHUNK_HEAD


def test_io_bytes_by_hand():
    # T = 130, H = 2, D = 128, N = 1: q, k, v, gate, o bf16 5 * 130 * 2 * 128 * 2 = 332,800; beta 130 * 2 * 2 = 520;
    # states in + out 2 * 1 * 2 * 128 * 128 * 4 = 262,144
    assert kb.io_bytes([130], 2) == 332_800 + 520 + 262_144 == 595_464


def test_k3c_bytes_by_hand():
    # T = 130, H = 2, D = 128, chunk 32 (130 = 4 * 32 + 2: 5 chunks), bf16 intermediates (2 bytes), N = 1
    # intra reads q, k 2 * 130 * 2 * 128 * 2 = 133,120; g fp32 130 * 2 * 128 * 4 = 133,120; beta 130 * 2 * 2 = 520
    # intra writes K e^G, Q e^G, K e^(G_C - G) 3 * 130 * 2 * 128 * 2 = 199,680; A_qk, T diag(beta)
    #   2 * 130 * 2 * 32 * 2 = 33,280; e^Gamma_C 5 * 2 * 128 * 4 = 5,120
    intra = 133_120 + 133_120 + 520 + 199_680 + 33_280 + 5_120
    assert kb.intra_bytes([130], 2, 128, 32, 2) == intra == 504_840
    # inter reads 199,680 + 33,280 + 5,120, v 130 * 2 * 128 * 2 = 66,560, s0 2 * 128 * 128 * 4 = 131,072;
    #   writes o 66,560 and the final state 131,072
    inter = 199_680 + 33_280 + 5_120 + 66_560 + 131_072 + 66_560 + 131_072
    assert kb.inter_bytes([130], 2, 128, 32, 2) == inter == 633_344
    assert kb.k3c_bytes([130], 2, 128, 32, 2) == intra + inter
    # chunk 16 on two sequences [64, 66]: 4 + 5 = 9 chunks of e^Gamma_C; fp32 intermediates (4 bytes)
    t, h, d = 130, 2, 128
    intra16 = 2 * t * h * d * 2 + t * h * d * 4 + t * h * 2 + 3 * t * h * d * 4 + 2 * t * h * 16 * 4 + 9 * h * d * 4
    assert kb.intra_bytes([64, 66], 2, 128, 16, 4) == intra16


def test_warm_seqs_keep_the_specialisations():
    assert kb.warm_seqs([8192]) == (64,)
    assert kb.warm_seqs([8192] * 4) == (64,) * 4
    assert kb.warm_seqs([1300, 547, 2048, 963, 271, 3063]) == (64,) * 5 + (65,)     # 3063 % 16 != 0
    for seqs, _, _ in kb.PREFILL_SHAPES:
        w = kb.warm_seqs(seqs)
        assert len(w) == len(seqs) and (max(w) % 16 == 0) == (max(seqs) % 16 == 0)


def _flashkda_semantics(raw, lb=-5.0):
    """FlashKDA's contract on its raw inputs, written out token by token: the state S [V, K] per head (FlashKDA's
    layout), q / k L2-normed, beta sigmoid, the safe gate on the K axis; returns (o [T, H, V], final [N, H, V, K])."""
    scale = raw.q.shape[-1] ** -0.5

    def l2(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    o = torch.empty(raw.q.shape[1:], dtype=torch.float64)
    finals = []
    bos = 0
    for n, ln in enumerate(raw.seqs):
        s = raw.h0[n].double().clone()                                              # [H, V, K]
        for t in range(bos, bos + ln):
            q, k = l2(raw.q[0, t].double()), l2(raw.k[0, t].double())
            v, b = raw.v[0, t].double(), torch.sigmoid(raw.beta[0, t].double())
            g = lb * torch.sigmoid(raw.a_log.double().exp()[:, None] * (raw.g[0, t].double() + raw.dt_bias.double()))
            s = s * g.exp()[:, None, :]                                             # decay along K
            u = v - torch.einsum("hvk,hk->hv", s, k)
            s = s + b[:, None, None] * u[:, :, None] * k[:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", s, q * scale)
        finals.append(s)
        bos += ln
    return o, torch.stack(finals)


def test_derived_inputs_match_flashkda_semantics(monkeypatch):
    raw = kb.make_raw((5, 3), 2, "cpu", seed=3)
    want_o, want_s = _flashkda_semantics(raw)
    x = kb.derive_k3c(raw)
    assert x["cu"].dtype == torch.int32 and x["cu"].tolist() == [0, 5, 8] and raw.cu.dtype == torch.int64
    assert x["g"].dtype == torch.float32 and x["q"].dtype == x["k"].dtype == x["beta"].dtype == torch.bfloat16
    monkeypatch.setattr(kb, "DEV", "cpu")            # torch_reference: the token recurrence
    o, s = kb.torch_reference(x, raw.seqs)           # k3c's layout: state [N, H, K, V]
    assert kb.rel(o, want_o) < 1e-2                  # q / k / beta rounded to bf16: ~3e-3
    assert kb.rel(s.transpose(-1, -2), want_s) < 1e-2
    assert kb.rel(s, want_s) > 0.3                    # the check sees a state left in FlashKDA's layout


def test_parse_variants():
    assert kb.parse_variants('[{}, {"chunk": 64, "block_v": 32}]') == [{}, {"chunk": 64, "block_v": 32}]
    for bad in ("[{\"chunk\": 64", "{}", "[]", "[{\"blockv\": 32}]"):
        with pytest.raises(SystemExit):
            kb.parse_variants(bad)


def test_later_variants_best_three_and_default_once():
    ranked = [dict(chunk=64, block_v=128), {}, dict(chunk=16), dict(chunk=64, block_v=32)]
    assert kb.later_variants(ranked, kb.PREFILL_VARIANTS) == [dict(chunk=64, block_v=128), {}, dict(chunk=16)]
    assert kb.later_variants(ranked[2:], kb.PREFILL_VARIANTS) == [dict(chunk=16), dict(chunk=64, block_v=32), {}]


# two plans keep the interpreter run short; chunk 32 is one the kernels offer on every target
TINY_VARIANTS = [{}, dict(chunk=32, block_v=64, chunk_warps=4)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kda_bench")
    env = dict(os.environ, K3C_BENCH_DEVICE="cpu", TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1", OUT=str(out))
    variants = json.dumps(TINY_VARIANTS)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kda.py"), "--quick", "--tiny", "--json", "t.json",
                        "--variants", variants], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, json.loads((out / "t.json").read_text())


def test_tiny_cpu_dry_run_rows(tiny_run):
    stdout, js = tiny_run
    assert "FlashKDA skipped" in stdout and "fla skipped" in stdout
    assert js["env"]["tiny"] and js["env"]["variants"] == TINY_VARIANTS
    rows = js["rows"]
    for shape in ("B=1 T=130 H=2", "varlen N=3 T=212 H=2"):
        k3c = [r for r in rows if r["shape"] == shape and r["name"].startswith("k3c chunk ")]
        assert {r["name"] for r in k3c} == {"k3c chunk default", "k3c chunk chunk=32,block_v=64,warps=4"}, shape
        for r in k3c:
            e = r["rel_err"]["torch"]
            assert 0 < e["o"] < kb.WRONG_BOUND and 0 < e["state"] < kb.WRONG_BOUND, (shape, r["name"], e)
            assert r["seconds"] > 0 and r["flops"] == kb.prefill_flops(r["seqs"], 2)
            assert r["bytes"] == kb.io_bytes(r["seqs"], 2) and r["k3c_bytes"] > 0
            assert f"rel err vs torch o {e['o']:.1e}" in stdout
        assert any(r["shape"] == shape and r["name"].startswith("  intra kernel alone") for r in rows)
        assert any(r["shape"] == shape and r["name"].startswith("  inter kernel alone") for r in rows)
    assert sum(r["name"].startswith("k3c prep+chunk") for r in rows) == 1            # first shape only
    assert any(r["group"] == "decode" and r["name"].startswith("k3c decode step") for r in rows)
    shapes = [s["shape"] for s in js["summary"]]
    assert shapes[0] == "B=1 T=130 H=2" and "varlen N=3 T=212 H=2" in shapes and "decode step B=4 H=2" in shapes
    assert "SUMMARY" in stdout
