"""bench/e2e.py and bench/agentic.py end to end in their small modes (CPU, k3-tiny): the JSON has every field, the
numbers are sane, and the numerics probe holds k3c to the float64 truth (fp32: within 1e-4; bf16: no worse than the
eager bf16 reference's own distance to it, up to a small factor)."""
import json
import math
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

import agentic  # noqa: E402
import e2e  # noqa: E402

TINY = "examples/k3-tiny.yaml"


def _finite_pos(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def e2e_fp32(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    assert e2e.main(["--spec", TINY, "--device", "cpu", "--dtype", "float32", "--prompt-len", "24", "--cached", "16",
                     "--batches", "1,3", "--steps", "2", "--check-len", "12", "--skip-compiled", "--no-kernels",
                     "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_e2e_json_fields_and_values(e2e_fp32):
    r = e2e_fp32
    assert r["errors"] == {} and r["skipped"] == []
    p = r["prefill"]
    assert p["tokens"] == 24
    for k in ("k3c_ms", "eager_ms"):
        assert _finite_pos(p[k]), k
    assert p["rel_err_last_logits_vs_eager"] < 1e-4
    assert [d["batch"] for d in r["decode"]] == [1, 3]
    for d in r["decode"]:
        for k in ("k3c_ms_per_step", "eager_ms_per_step"):
            assert _finite_pos(d[k]), (d["batch"], k)
        assert d["rel_err_first_step_vs_eager"] < 1e-4
        assert set(d["mla_modes"].values()) <= {"mqa", "mha"}
    assert {"weights", "numerics", "prefill_k3c", "prefill_eager", "decode_b1_k3c", "decode_b3_eager"} \
        <= set(r["phase_seconds"])


def test_e2e_probe_fp32_matches_truth(e2e_fp32):
    nm = e2e_fp32["numerics"]
    assert nm["truth_dtype"] == "float64" and nm["check_len"] == 12
    for phase in ("prefill", "decode"):
        for pair in ("k3c_vs_truth", "eager_vs_truth", "k3c_vs_eager"):
            c = nm[phase][pair]
            assert c["all"] < 1e-4 and c["last"] < 1e-4 and c["row_max"] < 1e-4, (phase, pair, c)
            assert c["top1_agree"] == 1.0
        assert nm[phase]["k3c_vs_truth"]["all"] > 0          # a real comparison (fp32 rounding is visible)


def test_e2e_probe_bf16_at_the_eager_floor():
    """bf16: k3c's distance to the truth is of the order of the eager bf16 reference's (a bug would be far above)."""
    nm = e2e.numerics_probe_cli(["--spec", TINY, "--device", "cpu", "--dtype", "bfloat16", "--check-len", "16",
                                 "--no-kernels"])
    for phase in ("prefill", "decode"):
        k, e = nm[phase]["k3c_vs_truth"]["all"], nm[phase]["eager_vs_truth"]["all"]
        assert 0 < e and k <= 3 * e + 1e-2, (phase, k, e)
        assert nm[phase]["eager_fp32_vs_truth"]["all"] < 1e-4


def test_probe_detects_a_wrong_engine(monkeypatch):
    """The probe can fail: an engine whose logits are perturbed by 1% is reported far from the truth."""
    real = e2e.numerics_probe

    class Skewed:
        def __init__(self, eng):
            self.eng = eng

        def __getattr__(self, name):
            return getattr(self.eng, name)

        def extend(self, rids, segs):
            return [o * 1.01 + 0.01 for o in self.eng.extend(rids, segs)]

    monkeypatch.setattr(e2e, "numerics_probe", lambda spec, eng, *a, **k: real(spec, Skewed(eng), *a, **k))
    nm = e2e.numerics_probe_cli(["--spec", TINY, "--device", "cpu", "--dtype", "float32", "--check-len", "8",
                                 "--no-kernels"])
    assert nm["prefill"]["k3c_vs_truth"]["all"] > 1e-3 and nm["prefill"]["eager_vs_truth"]["all"] < 1e-4


@pytest.mark.slow
def test_e2e_probe_with_generated_kernels():
    """The same probe through the generated kernels (Triton interpreter on a CPU: ~1-5 min)."""
    nm = e2e.numerics_probe_cli(["--spec", TINY, "--device", "cpu", "--dtype", "float32", "--check-len", "8"])
    for phase in ("prefill", "decode"):
        assert nm[phase]["k3c_vs_truth"]["all"] < 1e-4, (phase, nm[phase])


@pytest.mark.slow
@pytest.mark.parametrize("moe", ["loop", "grouped"])
def test_e2e_compiled_peer_runs_without_recompiling(tmp_path, moe):
    """torch.compile peer (aot_eager on a CPU): compiles once per phase, nothing recompiles in the timed runs; its
    prefill logits equal k3c's (fp32 with the loop; the grouped MoE traces in bf16 only); decode graph breaks."""
    out = tmp_path / "e2e.json"
    e2e.main(["--spec", TINY, "--device", "cpu", "--prompt-len", "16", "--ref-chunk", "8", "--cached", "8",
              "--batches", "2", "--steps", "2", "--check-len", "0", "--no-kernels", "--compile-backend", "aot_eager",
              "--compile-moe", moe, "--skip-eager", "--out", str(out),
              *(["--dtype", "bfloat16"] if moe == "grouped" else [])])    # _grouped_mm traces in bf16 only
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["compile_moe"] == moe
    p, d = r["prefill"], r["decode"][0]
    assert p["rel_err_compiled_vs_k3c"] <= (1e-4 if moe == "loop" else 3e-2)
    # decode (no KDA chunk loop): the grouped MoE leaves nothing outside the graph, the reference's loop does
    # (dynamo counts distinct break reasons, so prefill's KDA-loop breaks are not a per-layer count)
    breaks = d["compiled_dynamo"]["warmup"]["graph_breaks"]
    assert breaks == 0 if moe == "grouped" else breaks >= 1
    assert _finite_pos(p["compiled_ms"]) and _finite_pos(d["compiled_ms_per_step"])
    assert p["compiled_dynamo"]["warmup"]["graphs"] > 0
    assert all(v == 0 for v in p["compiled_dynamo"]["timed"].values())
    assert all(v == 0 for v in d["compiled_dynamo"]["timed"].values())


def test_agentic_small(tmp_path):
    out = tmp_path / "agentic.json"
    assert agentic.main(["--spec", TINY, "--device", "cpu", "--no-kernels", "--sessions", "2", "--turns", "3",
                         "--prompt", "12", "--tool", "5", "--answer", "2", "--interval", "4",
                         "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    w, wo = r["with_prefix_cache"], r["without_prefix_cache"]
    assert r["requests"] == 6 and r["identical_answers"] == 6
    assert 0.3 < w["hit_rate"] <= 1.0
    assert "hit_rate" not in wo
    for run in (w, wo):
        assert len(run["turns"]) == 3
        for t in run["turns"]:
            assert _finite_pos(t["ttft_ms_mean"]) and _finite_pos(t["tokens_per_s"])
            assert t["prefilled_tokens"] + t["resumed_tokens"] == t["prompt_tokens"]
    # without the cache every turn prefills its whole context; with it, later turns prefill less
    assert all(t["resumed_tokens"] == 0 for t in wo["turns"])
    assert all(a["prefilled_tokens"] < b["prefilled_tokens"] for a, b in zip(w["turns"][1:], wo["turns"][1:]))
    assert r["summary"]["hit_rate"] == w["hit_rate"]
    assert _finite_pos(r["summary"]["tokens_per_s_with"]) and _finite_pos(r["summary"]["tokens_per_s_without"])


def test_grouped_experts_equal_the_reference_loop():
    """bench/e2e.py's grouped-GEMM MoE (the compiled peer's --compile-moe grouped) equals the reference's expert loop,
    with empty experts and one expert taking most slots."""
    from k3c.reference.moe import routed_experts
    from k3c.frontend.spec import ActivationSpec

    g = torch.Generator().manual_seed(0)
    n, k, e, zd, m = 9, 3, 6, 16, 32
    z = torch.randn(n, zd, generator=g)
    w1, w3 = torch.randn(e, m, zd, generator=g), torch.randn(e, m, zd, generator=g)
    w2 = torch.randn(e, zd, m, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(n)])   # experts 4, 5 empty
    idx[:, 0] = 2                                                              # expert 2 in every token
    p = torch.rand(n, k, generator=g)
    act = ActivationSpec("swiglu")
    want = routed_experts(z, w1, w3, w2, p, idx, act)
    got = e2e.grouped_experts(z, w1, w3, w2, p, idx, act)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
