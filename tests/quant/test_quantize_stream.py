"""`k3c quantize` streams: random weights drawn a part at a time equal init_weights, the streamed checkpoint equals
quantizing the whole weights, its peak memory stays bounded under an address-space limit the whole weights would
break, and a checkpoint larger than the host's memory or disk is refused before anything is allocated."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import k3c
from k3c.cli import main
from k3c.commands.quantize import quantization_spec, write_quantized_checkpoint
from k3c.frontend.quant_check import quantized_names
from k3c.ir.mxfp4_weights import packed_name
from k3c.quant import mxfp4_quantize
from k3c.runtime.weights import init_weight_parts

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "k3-tiny.yaml"


def test_parts_equal_init_weights():
    spec = k3c.load_spec(TINY)
    whole = k3c.init_weights(spec, seed=3, dtype=torch.bfloat16)
    got: dict[str, list[torch.Tensor]] = {}
    for name, part in init_weight_parts(spec, seed=3, dtype=torch.bfloat16, max_elements=200):
        got.setdefault(name, []).append(part)
    assert list(got) == list(whole)
    assert max(len(p) for p in got.values()) > 10                     # the big ones came in many parts
    for name, parts in got.items():
        joined = torch.cat([p.reshape(-1) for p in parts]).reshape(whole[name].shape)
        assert joined.dtype == whole[name].dtype and torch.equal(joined, whole[name]), name


def test_streamed_checkpoint_equals_whole_quantization(tmp_path):
    spec = quantization_spec(k3c.load_spec(TINY))                     # precision: MXFP4 experts
    chosen = quantized_names(spec)
    assert chosen and all(".experts." in n for n in chosen)
    write_quantized_checkpoint(spec, init_weight_parts(spec, seed=1, dtype=torch.bfloat16, max_elements=300),
                               tmp_path / "q")
    got = load_file(str(tmp_path / "q" / "model.safetensors"))
    whole = k3c.init_weights(spec, seed=1, dtype=torch.bfloat16)
    for name, t in whole.items():
        if name in chosen:
            p, s = mxfp4_quantize(t, spec.quantization.rule)
            assert torch.equal(got[packed_name(name, "weight_packed")], p), name
            assert torch.equal(got[packed_name(name, "weight_scale")], s), name
        else:
            assert torch.equal(got[name], t), name
    # and it loads and runs as the spec's checkpoint
    k3c.load_weights(spec, tmp_path / "q")


BIG = """
name: wide-experts
model: {hidden_size: 512, vocab_size: 512, rms_norm_eps: 1.0e-5, max_context: 1024}
layers: {count: 2, pattern: [kda, mla]}
kda: {num_heads: 2, head_dim: 32, conv_kernel: 4, gate: safe, gate_lower_bound: -5.0, gate_rank: 32,
      output_gate: full_rank}
mla: {num_heads: 2, q_lora_rank: 64, kv_lora_rank: 64, qk_nope_head_dim: 32, qk_rope_head_dim: 16, v_head_dim: 32,
      rope: none, output_gate: true}
mlp: {first_k_dense: 0, activation: situ, situ_beta_gate: 4.0, situ_beta_up: 25.0}
moe: {num_experts: 64, top_k: 2, num_shared_experts: 1, expert_intermediate_size: 1024, latent_dim: 512,
      latent_norm: true, router_activation: sigmoid, router_bias: true, renormalize: true,
      routed_scaling_factor: 1.0}
quantization: {format: mxfp4, rule: floor}
"""

# in a fresh interpreter: the address space is capped at what the imports left plus LIMIT_MB, then the spec's
# 200 MB of random bf16 experts (400 MB as drawn in fp32) are quantized a part of 1M entries at a time
CHILD = """
import os, resource, sys
import torch
torch.set_num_threads(1)
import k3c
from k3c.commands import quantize as q
from k3c.runtime.weights import init_weight_parts
spec = k3c.load_spec(sys.argv[1])
whole = sys.argv[3] == "whole"
parts = (k3c.init_weights(spec, seed=0, dtype=torch.bfloat16).items() if whole
         else init_weight_parts(spec, seed=0, dtype=torch.bfloat16, max_elements=1 << 20))
q.QUANT_SLAB_BYTES = 1 << 22
with open("/proc/self/status") as fh:
    vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[4]) * 2**20, resource.RLIM_INFINITY))
try:
    q.write_quantized_checkpoint(spec, parts, sys.argv[2])
except MemoryError:
    print("MemoryError")
    sys.exit(3)
print("done")
"""


@pytest.mark.parametrize("mode, ok", [("stream", True), ("whole", False)])
def test_peak_memory_is_bounded_under_rlimit_as(tmp_path, mode, ok):
    spec = tmp_path / "big.yaml"
    spec.write_text(textwrap.dedent(BIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1",
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}           # big buffers mmapped: freed ones leave the address space
    r = subprocess.run([sys.executable, "-c", CHILD, str(spec), str(tmp_path / "q"), mode, "160"], env=env,
                       capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-3000:]
        got = load_file(str(tmp_path / "q" / "model.safetensors"))
        assert got["layers.1.block_sparse_moe.experts.w1.weight_packed"].shape == (64, 1024, 256)
    else:                                  # the whole weights do not fit the same limit: the test can fail
        assert r.returncode != 0 and not (tmp_path / "q").exists(), r.stdout


def test_refused_before_allocating_when_memory_or_disk_is_short(tmp_path, capsys, monkeypatch):
    from k3c.commands import run as run_cmd

    monkeypatch.setattr(run_cmd, "available_bytes", lambda device: 64 << 20)
    assert main(["quantize", "examples/k3-wide.yaml", "--random", "-o", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "needs about" in err and "GiB of memory" in err and err.count("\n") == 1
    monkeypatch.setattr(run_cmd, "available_bytes", lambda device: 1 << 40)
    # kimi-k3's 2.8 T parameters: ~1.5 TB of checkpoint, more than this disk
    assert main(["quantize", "examples/kimi-k3.yaml", "--random", "-o", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    assert "GiB free" in err and "takes up to" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layout", ["k3c", "k3"])
def test_checkpoint_experts_are_read_one_at_a_time(tmp_path, layout):
    """A checkpoint's expert stacks stream an expert at a time (sliced from k3c's stored stack, or K3's per-expert
    tensors); joined, every weight equals load_weights', and the quantized checkpoint equals the random path's."""
    from safetensors.torch import save_file

    from k3c.runtime.checkpoint import iter_weights, save_k3_checkpoint, stored_peak_bytes

    spec = quantization_spec(k3c.load_spec(TINY))
    w = k3c.init_weights(spec, seed=4, dtype=torch.bfloat16)
    if layout == "k3c":
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in w.items()}, str(path))
    else:
        path = save_k3_checkpoint(spec, w, tmp_path / "k3")
    whole = k3c.load_weights(spec, path)
    got: dict[str, list[torch.Tensor]] = {}
    for name, part in iter_weights(spec, path, experts_apart=True):
        got.setdefault(name, []).append(part)
    assert list(got) == list(whole)
    for name, parts in got.items():
        stack = ".experts." in name
        assert len(parts) == (spec.mlp.moe.num_experts if stack else 1), name
        assert torch.equal(torch.stack(parts) if stack else parts[0], whole[name]), name
    largest_expert = max(math.prod(i[1:]) for i in [t.shape for n, t in w.items() if ".experts." in n]) * 2
    assert stored_peak_bytes(spec, path) >= largest_expert
    assert main(["quantize", str(TINY), str(path), "-o", str(tmp_path / "q")]) == 0
    write_quantized_checkpoint(spec, w.items(), tmp_path / "ref")
    assert load_file(str(tmp_path / "q" / "model.safetensors")).keys() == \
        load_file(str(tmp_path / "ref" / "model.safetensors")).keys()
    for k, v in load_file(str(tmp_path / "ref" / "model.safetensors")).items():
        assert torch.equal(load_file(str(tmp_path / "q" / "model.safetensors"))[k], v), k
