"""bench/stack.py (issue 51) on the CPU with torch stand-ins for the peers' kernels: the stack follows the reference's
op order (fp32 logits equal to k3c's reference for a varlen prefill and for decode steps over a paged, interleaved
cache), the AttnRes stand-in is vLLM's one-pass kernel's contract, kernel names fall into the right families, and
the small CLI run writes a complete JSON."""
import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

import stack  # noqa: E402
from stack_peers import TorchPeers  # noqa: E402

TINY = "examples/k3-tiny.yaml"


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def tiny():
    import k3c
    from e2e import make_weights

    spec = k3c.load_spec(TINY)
    model = k3c.compile(spec, target="cpu")
    w = make_weights(spec, model.module, "cpu", torch.float32, seed=3, reference=False)
    return spec, w


def test_prefill_matches_reference_varlen(tiny):
    """Two sequences of different lengths in one flat prefill (cu_seqlens, per-sequence MLA attention, AttnRes over
    the token rows) give each sequence's own reference logits."""
    from k3c.reference import ReferenceModel

    spec, w = tiny
    st = stack.Stack(spec, dict(w), TorchPeers(), "cpu", torch.float32)
    ref = ReferenceModel(spec, w, mla_mode="mha")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g) for n in (13, 7)]
    got = st.prefill(seqs, all_logits=True)
    want = torch.cat([ref.forward(s[None])[0][0] for s in seqs])
    assert _rel(got, want) < 1e-5
    last = st.prefill(seqs)
    assert last.shape == (2, spec.vocab_size)
    assert _rel(last, torch.stack([want[12], want[19]])) < 1e-5


def test_decode_continues_prefill_and_reference(tiny):
    """The stack's prefill leaves KDA states, conv caches and latent pages that its decode continues from (two
    steps), equal to the reference decoding from its own cache; a second copy of the pages with an interleaved block
    table (k3c's decode graph's layout) gives the same step."""
    from k3c.reference import ReferenceModel

    spec, w = tiny
    peers = TorchPeers()
    st = stack.Stack(spec, dict(w), peers, "cpu", torch.float32)
    ref = ReferenceModel(spec, w, mla_mode="mqa")
    g = torch.Generator().manual_seed(1)
    B, T = 2, 9
    ids = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    nxt = torch.randint(0, spec.vocab_size, (B, 2), generator=g)
    ds = stack.DecodeState(st, B, T + 1, "cpu")
    ds.set_length(T)
    st.prefill([ids[0], ids[1]], ds=ds)
    _, cache = ref.forward(ids)
    for s in range(2):
        got = st.decode(ds, nxt[:, s])
        want, cache = ref.forward(nxt[:, s:s + 1], cache)
        assert _rel(got, want[:, 0]) < 1e-5, s
        ds.set_length(T + 1 + s)
    # the same cache in interleaved pages (page p of sequence b at p * B + b), read through a block table
    ds2 = stack.DecodeState(st, B, T, "cpu")
    lat = {i: ds.kcache[i].view(B, -1, ds.kcache[i].shape[-1])[:, :T] for i in ds.kcache}
    npg = ds2.block_table.shape[1]
    pools = {i: torch.zeros(B * npg, stack.PAGE, c.shape[-1]) for i, c in ds.kcache.items()}
    inter = (torch.arange(npg)[None, :] * B + torch.arange(B)[:, None]).to(torch.int32)
    ds3 = stack.DecodeState(st, B, T, "cpu", pools=pools, block_table=inter)
    ds3.load({}, lat)
    for a, b in ((ds2, ds), (ds3, ds)):
        for i in a.kda:
            a.kda[i][0].copy_(ds.kda[i][0])
            a.kda[i][1].copy_(ds.kda[i][1])
    ds2.load({}, lat)
    tok = torch.tensor([5, 7])
    assert _rel(st.decode(ds3, tok), st.decode(ds2, tok)) < 1e-6


def test_attn_res_stand_in_is_the_kernel_contract():
    """prefix += delta (stored back), block write, the mix over num_blocks blocks + the prefix, the fused norm."""
    peers = TorchPeers()
    g = torch.Generator().manual_seed(2)
    T, n, d = 5, 3, 16
    blocks = torch.randn(T, n, d, generator=g)
    prefix, delta = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    nw, qw, ow = (torch.randn(d, generator=g) for _ in range(3))
    p0 = prefix.clone()
    out = peers.attn_res(prefix, delta, blocks, nw, qw, ow, 1, 2, 1e-5, 1e-5)
    assert torch.equal(prefix, p0 + delta) and torch.equal(blocks[:, 2], prefix)
    src = [blocks[:, 0], prefix]
    s = torch.stack([(v @ (nw * qw)) * torch.rsqrt(v.pow(2).mean(-1) + 1e-5) for v in src], -1).softmax(-1)
    mix = s[:, :1] * src[0] + s[:, 1:] * src[1]
    want = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + 1e-5) * ow
    assert torch.allclose(out, want, atol=1e-6)
    # no blocks yet: the prefix itself, normed
    out0 = peers.attn_res(p0.clone(), None, blocks, nw, qw, None, 0, -1, 1e-5, 0.0)
    assert torch.equal(out0, p0)


@pytest.mark.parametrize("name,fam", [
    ("k3c_kda_decode_fwd_h96_d128_k4_safe_bf16_bv32_w4_noout", "KDA"), ("fused_recurrent_kda_fwd_kernel", "KDA"),
    ("void flash::kda::fwd_kernel2<...>", "KDA"), ("causal_conv1d_fwd_kernel", "KDA"),
    ("void legacy::sm90::decode::dense::flash_fwd_splitkv_mla_kernel<x>", "MLA"),
    ("k3c_mla_decode_l512_r64_p64_bf16_h16_w4_s2", "MLA"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "MLA"),
    ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x256x128x1", "MoE"), ("k3c_moe_gate_up_situ_n3072_e128", "MoE"),
    ("_situ_glu_kernel", "MoE"), ("_attn_res_kernel", "AttnRes"), ("k3c_attn_res_phase1_scores", "AttnRes"),
    ("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", "GEMMs"), ("k3c_gemm_n12288_k7168_bf16_m16", "GEMMs"),
    ("k3c_moe_linear_n3584", "GEMMs"), ("k3c_gemm_glu_situ_f6144_k7168_bf16_m16", "GEMMs"),
    ("_rms_norm_kernel", "other"), ("vectorized_elementwise_kernel<4, at::native::sigmoid>", "other"),
])
def test_kernel_families(name, fam):
    assert stack.family(name) == fam


def test_small_cli_json(tmp_path):
    out = tmp_path / "stack.json"
    assert stack.main(["--small", "--prefill", "1x10,2x6", "--decode", "2x8", "--check-len", "8", "--trained", "",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["skipped"] == []
    assert r["deviations"] and r["fp8"].startswith("n/a")
    for c in r["numerics"]["prefill"], r["numerics"]["decode"]:
        assert c["stack_vs_truth"] < 1e-4 and c["k3c_vs_truth"] < 1e-4
    rows = [x for x in r["rows"] if not x.get("fp8")]
    assert [(x["phase"], x.get("sequences"), x.get("batch")) for x in rows] == \
        [("prefill", 1, None), ("prefill", 2, None), ("decode", None, 2)]
    for x in rows:
        assert x["k3c_ms"] > 0 and x["stack_ms"] > 0
    assert rows[0]["last_logits_rel_stack_vs_k3c"] < 1e-4
    assert rows[2]["first_step_rel_stack_vs_k3c"] < 1e-4 and rows[2]["stack_reads_k3c_pages"] in (True, False)


def test_small_cli_from_an_artifact(tmp_path):
    """--artifact: k3c runs from a saved artifact (where the GPU box's Triton cannot build the Hopper tier, an
    artifact compiled elsewhere brings its binaries); the spec is the artifact's, the JSON says where k3c came from;
    a directory that is not an artifact is refused before anything is built."""
    import k3c

    art = tmp_path / "tiny-cpu"
    k3c.compile(k3c.load_spec(TINY), target="cpu").save(str(art))
    out = tmp_path / "stack.json"
    assert stack.main(["--small", "--artifact", str(art), "--prefill", "1x6", "--decode", "1x4", "--check-len", "0",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["k3c_from"].startswith(f"artifact {art} (target cpu")
    assert r["spec"] == k3c.load_spec(TINY).name
    with pytest.raises(SystemExit) as exc:
        stack.main(["--small", "--artifact", str(tmp_path), "--prefill", "1x6", "--decode", "1x4"])
    assert exc.value.code == 2
