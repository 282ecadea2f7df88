"""bench/mla.py: its FLOP / byte counts against hand counts (and FlashMLA's published figure), the fp8 cache it builds
against the bf16 one's values, the FlashMLA runner's layout conversions against a stand-in op with FlashMLA's
semantics written out here, and the --smoke run on the CPU end to end (rows, names, times, errors)."""
import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location("mla_bench", ROOT / "bench" / "mla.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mla_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


mb = _load_bench()
FP8 = torch.float8_e4m3fn


# ---- counts ---------------------------------------------------------------------------------------------------------
def test_decode_flops_by_hand():
    # per (query head, cached token): q.k over 512 + 64 = 2 * 576, p.v over 512 = 2 * 512; 2176 in all
    assert 2 * (512 + 64) + 2 * 512 == 2176
    assert mb.decode_flops(32, 32768, 96) == 32 * 96 * 32768 * (2 * 576 + 2 * 512) == 219_043_332_096
    assert mb.decode_flops(1, 1, 1) == 2176
    assert mb.decode_flops(128, 131072, 12) == 128 * 131072 * 12 * 2176
    assert mb.decode_flops(2, 128, 4, 32, 8) == 2 * 128 * 4 * (2 * 40 + 2 * 32)


def test_flashmla_figure_implies_the_same_count():
    # shared/peers/README.md: FlashMLA at B=32 T=32K H=96 takes 0.454 ms and "runs at 482 TFLOP/s, counting
    # 2 x (576 + 512) FLOPs per head and cached token": 219.04 GFLOP / 0.454 ms = 482.5 TFLOP/s (0.456 ms: 480)
    f = mb.decode_flops(32, 32 * 1024, 96)
    assert f / 0.454e-3 / 1e12 == pytest.approx(482, abs=0.5)
    assert f / 482e12 * 1e3 == pytest.approx(0.456, rel=5e-3)
    assert 2 * f / 0.454e-3 / 1e12 > 960                      # the old doubled count: twice FlashMLA's own figure


def test_decode_bytes_by_hand():
    assert mb.row_bytes("bf16") == 1152
    assert mb.row_bytes("fp8") == 592                          # 576 codes, 8 unused, 2 fp32 scales
    assert mb.decode_bytes(32, 32768) == mb.decode_bytes(32, 32768, "bf16") == 32 * 32768 * 576 * 2
    assert mb.decode_bytes(32, 32768, "fp8") == 32 * 32768 * 592 == 620_756_992
    assert mb.decode_bytes(2, 128, "bf16", 32, 8) == 2 * 128 * 40 * 2
    assert mb.row_bytes("fp8", 32, 8) == 48                    # 40 + 8 scale bytes, 16-aligned
    with pytest.raises(ValueError):
        mb.row_bytes("fp16")


def test_fp8_row_width_is_the_runtimes():
    lf = pytest.importorskip("k3c.runtime.caches.latent_format")
    assert mb.row_bytes("fp8") == lf.row_width(512, 64, FP8) == 592
    assert mb.row_bytes("fp8", 32, 8) == lf.row_width(32, 8, FP8)


def test_one_count_in_the_script():
    src = (ROOT / "bench" / "mla.py").read_text()
    assert "2.0 * B * H * T" not in src
    assert src.count("2 * (L + R) + 2 * L") == 1               # decode_flops only
    assert "(L_ + R_) * 2" not in src                          # bytes only through decode_bytes
    assert "FLOPs per (query head, cached token) = 2 (L + R) for q.k plus 2 L for p.v" in mb.__doc__


# ---- the fp8 cache and the FlashMLA runner (tiny shapes, CPU) -------------------------------------------------------
@pytest.fixture
def smoke_dims(monkeypatch):
    for name, v in zip(("L_", "R_", "P_", "V_"), mb.SMOKE_DIMS):
        monkeypatch.setattr(mb, name, v)
    return mb.SMOKE_DIMS


def test_fp8_cache_holds_the_same_values(smoke_dims):
    lf = pytest.importorskip("k3c.runtime.caches.latent_format")
    L, R = smoke_dims[:2]
    B, T, ps = 3, 200, 64
    store = mb.make_cache(B, T, torch.device("cpu"), ps)
    st8 = mb.fp8_cache(store, T, chunk_elems=ps * (L + R) * 2)      # two pages a chunk: the chunking is exercised
    assert st8.pool.dtype == FP8 and st8.pool.shape[-1] == lf.row_width(L, R, FP8) and st8.high == [T] * B
    for b in range(B):
        want = mb.rt.PagedLatentCache(store, (T,) * B).gather(seq=b)[0]
        packed = mb.rt.PagedLatentCache(st8, (T,) * B).gather(seq=b)[0]
        assert torch.equal(packed.view(torch.uint8), lf.encode_rows(want, L, FP8).view(torch.uint8))
        got = lf.decode_rows(packed, L, R, torch.float32)
        assert (got - want.float()).norm() / want.float().norm() < 4e-2


def test_fp8_error_is_the_cache_rounding(smoke_dims):
    """k3c on the fp8 cache against torch attention over the fp8 cache's own (decoded) values: bf16-level, so the
    fp8 row's error against the bf16 cache is the e4m3 rounding, not the kernel."""
    lf = pytest.importorskip("k3c.runtime.caches.latent_format")
    L, R, P = smoke_dims[:3]
    dev, B, T, H = torch.device("cpu"), 2, 128, 4
    store = mb.make_cache(B, T, dev, 64)
    st8 = mb.fp8_cache(store, T)
    lens = mb.rt.lens_tensor([T] * B, dev)
    q = torch.randn(B, H, L + R, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    scale = (P + R) ** -0.5
    o8 = mb.rt.mqa_decode(q, st8, lens, scale, L, num_heads=H, max_len=T).float()
    o16 = mb.rt.mqa_decode(q, store, lens, scale, L, num_heads=H, max_len=T).float()
    vals = lf.decode_rows(mb.rt.PagedLatentCache(st8, (T,) * B).gather(), L, R, torch.float32)      # [B, T, L+R]
    ref = torch.softmax(torch.bmm(q.float(), vals.transpose(1, 2)) * scale, -1) @ vals[..., :L]
    assert mb.rel_err(o8, ref) < 1e-2
    assert 1e-3 < mb.rel_err(o8, o16) < 5e-2


class FakeFlashMLA:
    """dense_decode_fwd as FlashMLA defines it, in torch: q [B, s_q, H, D], kcache [pages, ps, 1, D], seqlens [B],
    block table [B, pages]; softmax(q k^T scale) v over each sequence's first seqlens keys, v = k[..., :dv]."""

    def __init__(self):
        self.metadata = []

    def __call__(self, q, kc, dv, seqlens, bt, scale, causal, tsm, nsp, out):
        assert q.dim() == 4 and q.shape[1] == 1 and kc.dim() == 4 and kc.shape[2] == 1 and not causal
        assert seqlens.dtype == bt.dtype == torch.int32 and out.shape == (*q.shape[:3], dv)
        self.metadata.append(tsm)
        B, _, H, D = q.shape
        ps = kc.shape[1]
        for b in range(B):
            n = int(seqlens[b])
            rows = kc[bt[b, :-(-n // ps)].long()].reshape(-1, D)[:n].float()
            p = torch.softmax(q[b, 0].float() @ rows.T * scale, -1)
            out[b, 0] = (p @ rows[:, :dv]).to(out.dtype)
        return out, torch.zeros(B, H), torch.zeros(4, dtype=torch.int32), torch.ones(B + 1, dtype=torch.int32)


def test_flashmla_runner_on_k3c_memory(smoke_dims):
    dev = torch.device("cpu")
    fake = FakeFlashMLA()
    fm = mb.FlashMLA(fake, "fake", "dense_decode_fwd(..., Tensor(c!)? out_)")
    B, T, H = 2, 128, 4
    plan = mb.decode_plan(H, smoke_dims[0], mb.target_for(dev))
    res = mb.decode_point(B, T, H, dev, None, [plan], kv=("bf16",), fmla=fm)
    assert res["flashmla"] > 0 and res["flashmla_err"] < 1e-2, res
    assert fake.metadata[0] is None and all(m is not None for m in fake.metadata[1:])    # metadata reused
    recs = {r["name"]: r for r in mb.decode_records(B, T, H, res)}
    assert recs[f"mla_decode_flashmla_bf16_B{B}_T{T}_H{H}"]["rel_err"] == res["flashmla_err"]
    s = mb.summary_rows([(B, T, H, res, mb.plan_tag(plan))])[0]
    assert s["flashmla_over_k3c"] == pytest.approx(res["flashmla"] / res["plans"][mb.plan_tag(plan)])


def test_flashmla_skipped_without_cuda(tmp_path):
    cpu = torch.device("cpu")
    assert mb.load_flashmla(None, True, cpu) == (None, "off (--no-flashmla)")
    fm, note = mb.load_flashmla(str(tmp_path / "missing.so"), False, cpu)
    assert fm is None and "no CUDA" in note


# ---- --smoke end to end ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla_smoke") / "mla.json"
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            records, drows, arows = mb.main(["--smoke", "--json", str(path)])
    finally:
        mb.L_, mb.R_, mb.P_, mb.V_ = 512, 64, 128, 128
    return records, drows, arows, json.loads(path.read_text()), buf.getvalue()


def test_smoke_rows(smoke_run):
    pytest.importorskip("k3c.runtime.caches.latent_format")
    records, drows, arows, on_disk, text = smoke_run
    assert on_disk == records
    L, R = mb.SMOKE_DIMS[:2]
    assert len(drows) == len(mb.SMOKE_GRID) and len(arows) == len(mb.SMOKE_APPENDS)
    names = {r["name"]: r for r in records}
    for B, T, H, res, dtag in drows:
        assert T % 64 == 0
        shape = f"B{B}_T{T}_H{H}"
        bf, f8 = f"mla_decode_k3c[{dtag}]_bf16_{shape}", f"mla_decode_k3c[{res['fp8']['plan']}]_fp8_{shape}"
        tt = f"mla_decode_torch_bf16_{shape}"
        for n, kv in ((bf, "bf16"), (f8, "fp8"), (tt, "bf16")):
            r = names[n]
            assert r["seconds"] > 0 and r["kv_dtype"] == kv
            assert r["flops"] == mb.decode_flops(B, T, H, L, R) and r["bytes"] == mb.decode_bytes(B, T, kv, L, R)
        assert 0 < names[f8]["rel_err"] == res["fp8"]["err"] < 5e-2       # the fp8 rounding, no more
        assert res["err"] < 1e-2                                           # k3c bf16 vs torch
        assert "flashmla" not in res
    assert sum(n.startswith("mla_append_") for n in names) == 2 * len(mb.SMOKE_APPENDS)
    assert "# FlashMLA peer: skipped: no CUDA" in text
    assert "| shape | k3c bf16 | k3c fp8 | fp8 speedup | FlashMLA | FlashMLA/k3c(bf16) | best-peer/k3c |" in text
    summ = mb.summary_rows(drows)
    assert all(s["k3c_bf16"] > 0 and s["k3c_fp8"] > 0 and s["fp8_speedup"] > 0 and s["flashmla"] is None
               for s in summ)
