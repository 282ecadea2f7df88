"""K3 published checkpoint layout: save -> load round trip on a tiny K3 with every feature on, and WeightErrors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3c.errors import WeightError
from k3c.frontend import load_spec
from k3c.runtime.checkpoint import k3_checkpoint_names, load_weights, save_k3_checkpoint
from k3c.frontend.weight_names import weight_table
from k3c.runtime.weights import init_weights

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    """examples/k3-tiny.yaml: KDA safe gate + full-rank output gate, gated NoPE MLA with q_lora, AttnRes block 3 of 8
    layers (does not divide), LatentMoE with norm, SiTU, 2 shared experts, MXFP4 precision."""
    spec = load_spec(ROOT / "examples" / "k3-tiny.yaml")
    assert spec.attn_res.block_size == 3 and spec.num_layers % 3 != 0
    return spec, init_weights(spec, seed=0)


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    spec, w = tiny
    return save_k3_checkpoint(spec, w, tmp_path_factory.mktemp("k3") / "ckpt")


def ckpt_file(path) -> str:
    return str(path / "model.safetensors") if not isinstance(path, str) else path + "/model.safetensors"


def rewrite(src_dir, dst_dir, fn) -> None:
    """Copy a saved checkpoint, passing its tensor dict through fn."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    (dst_dir / "config.json").write_text(open(f"{src_dir}/config.json").read())
    save_file(fn(load_file(f"{src_dir}/model.safetensors")), str(dst_dir / "model.safetensors"))


def test_round_trip_is_exact(tiny, saved):
    from k3c.reference import reference_forward

    spec, w = tiny
    cfg = json.load(open(f"{saved}/config.json"))
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["attn_res_block_size"] == 3
    spec2 = load_spec(saved)
    assert spec2 == spec and spec2.name == spec.name
    w2 = load_weights(spec2, saved)
    assert w2.keys() == w.keys()
    for k in w:
        assert w2[k].dtype == w[k].dtype and torch.equal(w2[k], w[k]), k
    ids = torch.randint(0, spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    assert torch.equal(reference_forward(spec, w, ids), reference_forward(spec2, w2, ids))


def test_published_names(tiny, saved):
    spec, _ = tiny
    with safe_open(ckpt_file(saved), "pt") as f:
        keys = set(f.keys())
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                 "language_model.model.layers.0.mlp.gate_proj.weight",
                 "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight",
                 "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
                 "language_model.model.layers.2.self_attn.q_conv1d.weight",
                 "language_model.model.layers.3.self_attn.g_proj.weight",
                 "language_model.model.layers.7.mlp_res.proj_weight",
                 "language_model.model.output_attn_res.norm_weight"):
        assert name in keys, name
    assert len(keys) == sum(len(v) for v in k3_checkpoint_names(spec).values())


def test_sharded_index(tiny, tmp_path):
    spec, w = tiny
    out = save_k3_checkpoint(spec, w, tmp_path / "sharded", shard_bytes=64 * 1024)
    index = json.load(open(f"{out}/model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 2
    for source in (out, f"{out}/model.safetensors.index.json"):
        w2 = load_weights(spec, source)
        assert all(torch.equal(w2[k], w[k]) for k in w)


def test_single_file_and_dtype(tiny, saved):
    spec, w = tiny
    w2 = load_weights(spec, ckpt_file(saved), dtype="bf16")
    assert w2["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert w2["layers.1.block_sparse_moe.experts.w1"].dtype == torch.bfloat16
    for fp32 in ("layers.0.self_attn.A_log", "layers.0.self_attn.dt_bias",
                 "layers.1.block_sparse_moe.gate.e_score_correction_bias"):
        assert w2[fp32].dtype == torch.float32 and torch.equal(w2[fp32], w[fp32])
    assert torch.equal(w2["norm.weight"], w["norm.weight"].bfloat16())


def test_alias_names_and_vision_tower(tiny, saved, tmp_path):
    """`*_res_proj.weight` / `*_res_norm.weight` aliases, output_attn_res aliases, A_log [1,1,H,1], proj [1,d];
    vision tower tensors are ignored."""
    spec, w = tiny

    def alias(sd):
        out = {}
        for k, v in sd.items():
            for part in ("self_attention_res", "mlp_res", "output_attn_res"):
                for which in ("proj", "norm"):
                    k = k.replace(f"{part}.{which}_weight", f"{part}_{which}.weight")
            if k.endswith("A_log"):
                v = v.reshape(1, 1, -1, 1)
            if k.endswith("_res_proj.weight"):
                v = v.reshape(1, -1)
            out[k] = v
        out["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(3, 3)
        return out

    rewrite(saved, tmp_path / "alias", alias)
    with safe_open(str(tmp_path / "alias" / "model.safetensors"), "pt") as f:
        assert "language_model.model.layers.0.self_attention_res_proj.weight" in f.keys()
    w2 = load_weights(spec, tmp_path / "alias")
    assert all(torch.equal(w2[k], w[k]) for k in w)


# -- errors --------------------------------------------------------------------------------------------------------
def test_missing_tensor(tiny, saved, tmp_path):
    spec, _ = tiny
    rewrite(saved, tmp_path / "m", lambda sd: {k: v for k, v in sd.items() if "layers.3.self_attn.g_proj" not in k})
    with pytest.raises(WeightError) as info:
        load_weights(spec, tmp_path / "m")
    msg = str(info.value)
    assert "layers.3.self_attn.g_proj.weight" in msg and str(tmp_path / "m") in msg and "[32, 64]" in msg


def test_missing_expert(tiny, saved, tmp_path):
    spec, _ = tiny
    rewrite(saved, tmp_path / "e", lambda sd: {k: v for k, v in sd.items() if ".experts.5.w3." not in k})
    with pytest.raises(WeightError, match=r"expert 5 of 'layers\.1\.block_sparse_moe\.experts\.w3'"):
        load_weights(spec, tmp_path / "e")


def test_wrong_shape(tiny, saved, tmp_path):
    spec, _ = tiny
    key = "language_model.model.layers.3.self_attn.kv_b_proj.weight"

    def bad(sd):
        sd[key] = torch.zeros(10, 32)
        return sd

    rewrite(saved, tmp_path / "s", bad)
    with pytest.raises(WeightError) as info:
        load_weights(spec, tmp_path / "s")
    msg = str(info.value)
    expected = weight_table(spec)["layers.3.self_attn.kv_b_proj.weight"].shape
    assert key in msg and "model.safetensors" in msg and "[10, 32]" in msg
    assert "[" + ", ".join(map(str, expected)) + "]" in msg


def test_unexpected_tensor(tiny, saved, tmp_path):
    spec, w = tiny

    def extra(sd):
        sd["language_model.model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
        return sd

    rewrite(saved, tmp_path / "u", extra)
    with pytest.raises(WeightError, match="unexpected tensor 'language_model.model.layers.0.self_attn.bogus"):
        load_weights(spec, tmp_path / "u")
    w2 = load_weights(spec, tmp_path / "u", strict=False)
    assert w2.keys() == w.keys()


def test_two_names_for_one_weight(tiny, saved, tmp_path):
    spec, _ = tiny

    def both(sd):
        p = "language_model.model.layers.0."
        sd[p + "mlp_res_proj.weight"] = sd[p + "mlp_res.proj_weight"].clone()
        return sd

    rewrite(saved, tmp_path / "d", both)
    with pytest.raises(WeightError, match="both give k3c weight 'layers.0.mlp_res.proj_weight'"):
        load_weights(spec, tmp_path / "d")


def test_mxfp4_packed_experts_load_stacked(tiny, saved, tmp_path):
    # K3's compressed-tensors layout (per expert weight_packed / weight_scale) -> stacked k3c packed tensors;
    # tests/quant/test_quantized_model.py checks the bytes against compressed-tensors itself
    spec, _ = tiny

    def packed(sd, bad=False):
        for k in [k for k in sd if ".experts." in k and k.endswith(".weight")]:
            v = sd.pop(k)
            base = k[: -len(".weight")]
            e = int(base.split(".experts.")[1].split(".")[0])
            sd[base + ".weight_packed"] = torch.full((v.shape[0], v.shape[1] // 2), e, dtype=torch.uint8)
            sd[base + ".weight_scale"] = torch.zeros(v.shape[0], v.shape[1] // 32 + bad, dtype=torch.uint8)
        return sd

    rewrite(saved, tmp_path / "p", packed)
    w = load_weights(spec, tmp_path / "p")
    stack = "layers.1.block_sparse_moe.experts.w2"
    assert stack not in w and w[stack + ".weight_packed"].dtype == torch.uint8
    e, rows, k = spec.mlp.moe.num_experts, spec.mlp.moe.latent_dim, spec.mlp.moe.expert_intermediate_size
    assert w[stack + ".weight_packed"].shape == (e, rows, k // 2)
    assert w[stack + ".weight_scale"].shape == (e, rows, k // 32)
    assert w[stack + ".weight_packed"][:, 0, 0].tolist() == list(range(e))           # expert order kept
    rewrite(saved, tmp_path / "bad", lambda sd: packed(sd, bad=True))
    with pytest.raises(WeightError, match=r"weight_scale.*has shape .*expected"):
        load_weights(spec, tmp_path / "bad")


def test_pickles_are_refused(tiny, saved, tmp_path):
    spec, _ = tiny
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(open(f"{saved}/config.json").read())
    (d / "pytorch_model.bin").write_bytes(b"not loaded, never unpickled")
    for target in (d, d / "pytorch_model.bin"):
        with pytest.raises(WeightError, match=r"pytorch_model\.bin.*never unpickles"):
            load_weights(spec, target)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model.bin"}}))
    with pytest.raises(WeightError, match=r"pytorch_model\.bin"):
        load_weights(spec, d)
    (d / "model.pt").write_bytes(b"x")
    with pytest.raises(WeightError, match=r"model\.pt"):
        load_weights(spec, d / "model.pt")


def test_bad_paths(tiny, tmp_path):
    spec, _ = tiny
    with pytest.raises(WeightError, match="no such file"):
        load_weights(spec, tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightError, match="no safetensors"):
        load_weights(spec, tmp_path / "empty")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(WeightError, match="garbage.safetensors"):
        load_weights(spec, tmp_path / "garbage.safetensors")
    (tmp_path / "idx.json").write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    with pytest.raises(WeightError, match="not a file name"):
        load_weights(spec, tmp_path / "idx.json")


def test_save_checks_weights(tiny, tmp_path):
    spec, w = tiny
    partial = dict(w)
    del partial["norm.weight"]
    with pytest.raises(WeightError, match="missing tensor 'norm.weight'"):
        save_k3_checkpoint(spec, partial, tmp_path / "x")
    bad = dict(w)
    bad["norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightError, match=r"'norm.weight' has shape \[3\]"):
        save_k3_checkpoint(spec, bad, tmp_path / "y")
