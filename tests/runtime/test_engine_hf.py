"""The Hugging Face Kimi Linear path through the serving engine: a tiny random checkpoint in HF's published format
(config.json with model_type kimi_linear + model.safetensors under transformers' tensor names, written here without
transformers), compiled from the config.json, weights loaded from the safetensors, served with continuous batching
(prefill + decode steps, requests joining between steps) and compared to the reference at fp32 (<= 1e-5)."""
import json

import pytest
import torch

import k3c
from k3c.runtime.checkpoint import load_weights
from k3c.runtime.engine import Engine

safetensors_torch = pytest.importorskip("safetensors.torch")

# transformers' KimiLinearConfig.save_pretrained of a 5-layer model (KDA / MLA, a dense first layer, 6 experts)
CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
    "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 5, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
    "linear_num_heads": 2, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "q_lora_rank": None, "kv_lora_rank": 16,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "qk_head_dim": 24, "v_head_dim": 16,
    "attention_bias": False, "attention_dropout": 0.0,
    "intermediate_size": 96, "moe_intermediate_size": 24, "num_experts": 6, "num_experts_per_token": 2,
    "num_shared_experts": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_expert_group": 1,
    "topk_group": 1, "tie_word_embeddings": False, "initializer_range": 0.02, "model_max_length": 1048576,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "use_cache": True, "transformers_version": "5.24.0",
}

# tensor names of that save_pretrained (layers 0 and 1; the others repeat them)
HF_NAMES_0_1 = {
    "model.layers.0.block_sparse_moe.down_proj.weight", "model.layers.0.block_sparse_moe.gate_proj.weight",
    "model.layers.0.block_sparse_moe.up_proj.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.A_log",
    "model.layers.0.self_attn.b_proj.weight", "model.layers.0.self_attn.dt_bias",
    "model.layers.0.self_attn.f_a_proj.weight", "model.layers.0.self_attn.f_b_proj.weight",
    "model.layers.0.self_attn.g_a_proj.weight", "model.layers.0.self_attn.g_b_proj.weight",
    "model.layers.0.self_attn.k_conv1d.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.o_norm.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.v_conv1d.weight", "model.layers.0.self_attn.v_proj.weight",
    *(f"model.layers.1.block_sparse_moe.experts.{e}.{p}.weight" for e in range(6) for p in ("w1", "w2", "w3")),
    "model.layers.1.block_sparse_moe.gate.e_score_correction_bias", "model.layers.1.block_sparse_moe.gate.weight",
    "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
    "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
    "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight", "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight", "model.layers.1.self_attn.kv_a_layernorm.weight",
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.kv_b_proj.weight",
    "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.q_proj.weight",
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_tensors(spec, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """k3c's canonical weights under HF Kimi Linear's published names: `model.` prefix, dense MLPs under
    block_sparse_moe, routed experts one tensor per expert and projection."""
    out = {}
    for name, t in w.items():
        if name == "lm_head.weight":
            out[name] = t
            continue
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "mlp":
            name = ".".join(parts[:2] + ["block_sparse_moe"] + parts[3:])
        if ".experts.w" in name and not name.endswith(".weight"):
            prefix, _, proj = name.rpartition(".")
            for e in range(t.shape[0]):
                out[f"model.{prefix}.{e}.{proj}.weight"] = t[e].clone()
            continue
        out["model." + name] = t
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear_tiny")
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    spec = k3c.load_spec(path)
    truth = k3c.init_weights(spec, seed=3)
    tensors = hf_tensors(spec, truth)
    assert HF_NAMES_0_1 <= set(tensors)
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, truth


def test_hf_kimi_linear_through_the_engine(hf_checkpoint, one_thread):
    path, truth = hf_checkpoint
    spec = k3c.load_spec(path / "config.json")
    assert spec.layer_kinds == ("kda", "mla", "kda", "kda", "mla") and spec.vocab_size == 96
    w = load_weights(spec, path)
    assert set(w) == set(truth) and all(torch.equal(w[k], truth[k]) for k in truth)
    model = k3c.compile(spec, target="cpu")
    eng = Engine(model, w, device="cpu", max_batch=3, max_context=64, page_size=8, use_kernels=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (13, 6, 21)]
    news = (5, 6, 3)
    joins = {0: [0], 1: [1], 3: [2]}                      # request -> joins before that step
    rids, outs = {}, {}
    for step in range(30):
        for i in joins.get(step, []):
            rids[i] = eng.add_request(prompts[i], news[i])
        for o in eng.step():
            outs.setdefault(o.rid, []).append(o)
        if step > 3 and not eng.has_work():
            break
    assert not eng.has_work()
    assert eng.stats["decode_calls"] < sum(news) - 2       # decodes of different requests shared calls
    assert {m for (_, m) in eng.mode_counts} == {"mha", "mqa"}
    for i, p in enumerate(prompts):
        got = outs[rids[i]]
        assert len(got) == news[i] and got[-1].finished
        toks = p + [o.token for o in got]
        ref = k3c.reference_forward(spec, w, torch.tensor([toks]))[0]
        logits = torch.stack([o.logits for o in got])
        assert rel(logits, ref[len(p) - 1:len(toks) - 1]) <= 1e-5
        assert [o.token for o in got] == logits.argmax(-1).tolist()
    eng.pool.check_empty()
