"""The end-to-end peer (issue 51): a K3 forward pass assembled from the kernels vLLM 0.33 runs for K3 on Hopper, on
the same weights and inputs as k3c, in the same process, beside k3c's own engine.

    python bench/stack.py --small                                       # CPU, k3-tiny, torch stand-ins (seconds)
    python bench/stack.py --out bench/stack-h200.json                   # one GPU, k3-wide, the issue's rows

The stack follows vllm/models/kimi_k3/nvidia/{model,kda,mla}.py of the vllm 0.33.0 wheel, op by op:
  embedding; per layer: AttnRes one-pass kernel (prefix += previous MLP output, block write on block-start layers,
  mix, input RMSNorm fused) -> attention -> AttnRes (post-attention RMSNorm fused) -> MLP / LatentMoE; the output
  AttnRes mix, final RMSNorm, lm_head on the positions that are sampled (the last token of each sequence).
  KDA: one in_proj_qkvgfab GEMM (q|k|v|g|f_a|b) -> f_b GEMM -> short conv + SiLU (q, k, v; one packed call at
    decode) -> FlashKDA (prefill) / fused recurrent KDA (decode) with gate, L2 norms and beta sigmoid in the
    kernel -> gated RMSNorm (o_norm * sigmoid(g)) -> o_proj.
  MLA: one fused_qkv_a_g GEMM (q_a | kv_a | g) -> q_a / kv_a RMSNorms -> q_b GEMM; prefill: kv_b GEMM, key concat,
    latent rows into the paged cache, causal attention; decode: W_UK absorb (bmm), q concat, latent row into the
    paged cache, FlashMLA, W_UV (bmm) -> sigmoid gate -> o_proj.
  MoE: fp32 router GEMM, sigmoid + correction bias top-k, renormalised weights; routed_expert_down_proj GEMM ->
    triton_kernels routing + matmul_ogs gate|up (gather) -> SiTU-GLU -> matmul_ogs down (scatter, top-k weighted
    reduce) -> routed_expert_norm -> routed_expert_up_proj; shared experts (gate|up GEMM, SiTU-GLU, down) added.
  Decode: one CUDA graph per batch size (vLLM's full-graph mode); FlashMLA's tile-scheduler metadata made once.
Where this deviates from what vLLM runs, DEVIATIONS says so and the bench prints it (also in the JSON).

The peers' inputs come from published wheels (../shared/peers/README.md: fetch_peers.sh builds carry/). The part
the stack uses is 11 MB, small enough to travel with the project to a GPU box (the whole carry is not):
    mkdir -p .peers/stack_carry/so && cp .peers/carry/fla_core-*.whl .peers/carry/triton_kernels-*.whl \
        .peers/carry/vllm_k3_attn_res.py .peers/stack_carry/ && cp .peers/carry/so/_flashkda_C.abi3.so \
        .peers/carry/so/_flashmla_C.abi3.so .peers/stack_carry/so/ && \
        pip download -q --no-deps -d .peers/stack_carry einops
and on the GPU box (carry .peers/stack_carry):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/stack_carry/*.whl && \
        export PYTHONPATH=/tmp/site && python3 bench/stack.py --carry .peers/stack_carry --out stack.json

Rows (one process, same weights, same prompts, same random decode caches): prefill of 8192 tokens (one sequence)
and of 8 x 1024; decode steps at batch 1 / 32 / 128 with 8K and 32K cached tokens; the fp8-latent rows (n/a: see
FP8_NA). Each row: k3c ms, stack ms, ratio stack / k3c (> 1: k3c faster), and a per-family breakdown of GPU time
(torch.profiler over the same calls run eagerly: KDA, MLA, MoE, AttnRes, GEMMs, other). k3c runs its served paths:
the engine's prefill (append-prefill, all rows' logits) and its CUDA-graph decode step (runtime/cuda_graph.py).

Numerics (--check-len tokens, first): one prompt through the float64 reference on the same weights (the "truth",
bench/e2e.py's WideReference; the MXFP4 experts dequantized per call), k3c and the stack, then one decode step of
each from the truth's cache: rel L2 of the logits against the truth and between the two, and the stack's error in
units of k3c's (~1: the same bf16 floor; >> 1: a stack bug). Bound: rel L2 <= 2.5e-2 where the model is not
chaotic (decode; the CPU fp32 small mode everywhere); on random weights a bf16 prefill is ~0.5 from the truth for
any implementation (docs/perf.md), so there the ratio is the check.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..")))

from stack_peers import KernelPeers, TorchPeers, install_site  # noqa: E402

DEVIATIONS = [
    "KDA decode: fla 0.6.0 fused_recurrent_kda (Triton) after fla's causal_conv1d_update; vLLM 0.33 on SM90 runs "
    "its native fused_kda_decode (conv + recurrence + gate in one CUDA kernel), which ships in "
    "_C_stable_libtorch.abi3.so (92 MB, larger than the 64 MiB the GPU transfer carries)",
    "KDA prefill short conv: fla 0.6.0 causal_conv1d (Triton), one call per q/k/v; vLLM: its own Triton "
    "causal_conv1d_fn, also one call per q/k/v",
    "MLA prefill attention: torch SDPA, causal, v zero-padded to the q/k width 192 (on the H100 torch 2.11 picks "
    "cuDNN's fused flash attention); vLLM runs FA3 (vllm_flash_attn, 172 MB, not carried)",
    "MoE: vLLM 0.33's MXFP4 oracle picks Marlin / Humming for K3 on SM90; the stack runs triton_kernels matmul_ogs "
    "(the issue's choice; vLLM's gpt-oss Hopper path), SiTU-GLU between the two GEMMs as one Triton kernel of this "
    "bench (matmul_ogs fuses only SwiGLU)",
    "router top-k and the MLA sigmoid gate: torch ops; RMSNorm and SiTU-GLU: this bench's Triton kernels (vLLM: "
    "its fused CUDA kernels); no aux-stream overlap (vLLM runs the MoE router beside the latent down projection "
    "and the MLA gate projection beside attention on a second stream at decode sizes)",
    "logits: the stack computes the last position of each sequence (what vLLM samples); k3c's engine returns every "
    "position's logits (its own cost: an 8192 x 7168 x vocab GEMM at prefill 8192)",
]
FP8_NA = ("n/a: vllm 0.33.0's _flashmla_C has no dense fp8 decode (only sparse_decode_fwd over its 656-byte "
          "fp8_ds_mla rows), and vLLM's K3 with --kv-cache-dtype fp8 fails on H200 (vllm#51313)")
FAMILIES = ("KDA", "MLA", "MoE", "AttnRes", "GEMMs", "other")
PAGE = 64


# ---------------------------------------------------------------------------------------------------------------
# the stack
# ---------------------------------------------------------------------------------------------------------------
class Stack:
    """A K3-family forward pass from the peers' kernels (module docstring) on k3c's weight dict (the names of
    k3c.frontend.weight_names, MXFP4 experts as `.weight_packed` / `.weight_scale`)."""

    def __init__(self, spec, w: dict, peers: TorchPeers, device, dtype: torch.dtype, share: bool = False):
        """share: rebind w's matrices that the stack fuses (KDA in_proj, MLA q_a|kv_a|g, gate|up pairs) to row views
        of the fused copies, so that k3c, built from w afterwards, reads the same memory (the values are equal; one
        GPU then holds both sides at K3 width)."""
        if spec.attn_res is None or spec.kda is None or spec.mla is None:
            raise ValueError(f"spec {spec.name!r}: the stack builds K3's families (KDA, MLA, AttnRes)")
        self.spec, self.peers, self.device, self.dtype = spec, peers, torch.device(device), dtype

        def fused(names):
            t = cast(torch.cat([w[n] for n in names]))
            if share:
                r = 0
                for n in names:
                    rows = w[n].shape[0]
                    w[n] = t[r:r + rows].view(w[n].shape)
                    r += rows
            return t

        self.eps = spec.rms_norm_eps
        self.S = spec.attn_res.block_size
        self.nblocks = -(-spec.num_layers // self.S)
        cast = lambda t: t.to(device=device, dtype=dtype)                                      # noqa: E731
        f32 = lambda t: t.to(device=device, dtype=torch.float32)                               # noqa: E731
        self.embed = cast(w["embed_tokens.weight"])
        self.lm_head = cast(w["embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"])
        self.norm = cast(w["norm.weight"])
        self.out_res = (cast(w["output_attn_res.norm_weight"]), cast(w["output_attn_res.proj_weight"]).reshape(-1))
        self.layers = []
        kc, mc = spec.kda, spec.mla
        for i, kind in enumerate(spec.layer_kinds):
            p = f"layers.{i}."
            L = {"kind": kind,
                 "in_ln": cast(w[p + "input_layernorm.weight"]),
                 "post_ln": cast(w[p + "post_attention_layernorm.weight"]),
                 "sa_res": (cast(w[p + "self_attention_res.norm_weight"]),
                            cast(w[p + "self_attention_res.proj_weight"]).reshape(-1)),
                 "mlp_res": (cast(w[p + "mlp_res.norm_weight"]), cast(w[p + "mlp_res.proj_weight"]).reshape(-1))}
            a = p + "self_attn."
            if kind == "kda":
                if kc.output_gate != "full_rank" or kc.gate != "safe":
                    raise ValueError("the stack builds K3's KDA (safe gate, full-rank output gate)")
                L.update(in_proj=fused([a + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                        "g_proj.weight", "f_a_proj.weight", "b_proj.weight")]),
                         f_b=cast(w[a + "f_b_proj.weight"]),
                         conv=[cast(w[a + f"{n}_conv1d.weight"]).reshape(kc.width, -1) for n in "qkv"],
                         A_log=f32(w[a + "A_log"]), dt_bias=f32(w[a + "dt_bias"]), o_norm=cast(w[a + "o_norm.weight"]),
                         o_proj=cast(w[a + "o_proj.weight"]))
                L["conv_packed"] = torch.cat(L["conv"]).contiguous()
            else:
                if mc.q_lora_rank is None or not mc.output_gate:
                    raise ValueError("the stack builds K3's MLA (q LoRA, output gate)")
                n, pn, dv, lat = mc.num_heads, mc.qk_nope_head_dim, mc.v_head_dim, mc.kv_lora_rank
                kvb = cast(w[a + "kv_b_proj.weight"])
                per = kvb.view(n, pn + dv, lat)
                L.update(qkv_a_g=fused([a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight", a + "g_proj.weight"]),
                         q_a_ln=cast(w[a + "q_a_layernorm.weight"]), kv_a_ln=cast(w[a + "kv_a_layernorm.weight"]),
                         q_b=cast(w[a + "q_b_proj.weight"]), kv_b=kvb,
                         W_UK_T=per[:, :pn].contiguous(), W_UV=per[:, pn:].transpose(1, 2).contiguous(),
                         o_proj=cast(w[a + "o_proj.weight"]))
            if spec.is_moe_layer(i):
                m = p + "block_sparse_moe."
                cfg = spec.mlp.moe
                if cfg.latent_dim is None or cfg.router_activation != "sigmoid":
                    raise ValueError("the stack builds K3's LatentMoE (sigmoid router)")
                if m + "experts.w1.weight_packed" in w:          # MXFP4 experts (K3's precision)
                    part = {"p": "weight_packed", "s": "weight_scale"}
                    ex = peers.prepare_experts(**{k: w[m + f"experts.{k[:2]}.{part[k[2]]}"].to(device)
                                                  for k in ("w1p", "w1s", "w3p", "w3s", "w2p", "w2s")}, dtype=dtype)
                else:                                           # a spec without routed-expert quantization
                    ex = peers.prepare_dense_experts(cast(w[m + "experts.w1"]), cast(w[m + "experts.w3"]),
                                                     cast(w[m + "experts.w2"]))
                L.update(moe=True, gate=f32(w[m + "gate.weight"]), bias=f32(w[m + "gate.e_score_correction_bias"]),
                         down=cast(w[m + "routed_expert_down_proj.weight"]),
                         up=cast(w[m + "routed_expert_up_proj.weight"]),
                         lat_norm=cast(w[m + "routed_expert_norm.weight"]),
                         experts=ex,
                         shared=self._mlp(w, m + "shared_experts.", cast, fused) if cfg.num_shared_experts else None)
            else:
                L.update(moe=False, mlp=self._mlp(w, p + "mlp.", cast, fused))
            self.layers.append(L)

    @staticmethod
    def _mlp(w, prefix, cast, fused):
        return {"gate_up": fused([prefix + "gate_proj.weight", prefix + "up_proj.weight"]),
                "down": cast(w[prefix + "down_proj.weight"]), "m": w[prefix + "gate_proj.weight"].shape[0]}

    # -- pieces -----------------------------------------------------------------------------------------------------
    def _dense(self, x, mlp):
        gu = x @ mlp["gate_up"].t()
        m = mlp["m"]
        return self.peers.situ_glu(gu[:, :m], gu[:, m:], self.spec.mlp.activation) @ mlp["down"].t()

    def _moe(self, x, L):
        cfg = self.spec.mlp.moe
        scores = torch.sigmoid(F.linear(x.float(), L["gate"]))                # fp32 router (vLLM: GateLinear fp32)
        ids = torch.topk(scores + L["bias"], cfg.top_k, dim=-1).indices
        p = scores.gather(-1, ids)
        if cfg.renormalize:
            p = p / (p.sum(-1, keepdim=True) + 1e-20)
        p = p * cfg.routed_scaling_factor
        z = x @ L["down"].t()
        u = self.peers.moe_experts(z, ids, p, L["experts"], self.spec.mlp.activation)
        y = self.peers.rms_norm(u, L["lat_norm"], self.eps) @ L["up"].t()
        if L["shared"] is not None:
            y = y + self._dense(x, L["shared"])
        return y

    def _ffn(self, x, L):
        return self._moe(x, L) if L["moe"] else self._dense(x, L["mlp"])

    def _kda_split(self, x, L):
        kc = self.spec.kda
        hk = kc.width
        proj = x @ L["in_proj"].t()
        mixed, g2, fa, beta = proj.split([3 * hk, hk, kc.gate_rank, kc.num_heads], dim=-1)
        return mixed, g2, fa @ L["f_b"].t(), beta

    def _kda_out(self, o, g2, L, T):
        kc = self.spec.kda
        o = self.peers.gated_norm(o.reshape(T * kc.num_heads, kc.head_dim),
                                  g2.reshape(T * kc.num_heads, kc.head_dim), L["o_norm"], self.eps)
        return o.reshape(T, kc.width) @ L["o_proj"].t()

    def _kda_prefill(self, x, L, cu, st=None):
        kc = self.spec.kda
        T, H, D, hk = x.shape[0], kc.num_heads, kc.head_dim, kc.width
        mixed, g2, g1, beta = self._kda_split(x, L)
        feats, convs = [], []
        for j in range(3):
            y, c = self.peers.conv_prefill(mixed[:, j * hk:(j + 1) * hk], L["conv"][j], cu)
            feats.append(y.reshape(1, T, H, D))
            convs.append(c)
        N = cu.numel() - 1
        h0 = torch.zeros(N, H, D, D, device=x.device, dtype=torch.float32)
        o = torch.empty(1, T, H, D, device=x.device, dtype=x.dtype)
        fin = self.peers.kda_prefill(*feats, g1.reshape(1, T, H, D), beta.unsqueeze(0), L["A_log"], L["dt_bias"],
                                     kc.gate_lower_bound, h0, cu, o)
        if st is not None:                                   # the decode state these sequences continue from
            st[0].copy_(fin)
            st[1].copy_(torch.cat(convs, dim=1))
        return self._kda_out(o, g2, L, T)

    def _kda_decode(self, x, L, state, conv):
        kc = self.spec.kda
        B, H, D, hk = x.shape[0], kc.num_heads, kc.head_dim, kc.width
        mixed, g2, g1, beta = self._kda_split(x, L)
        qkv = self.peers.conv_update(mixed, conv, L["conv_packed"])
        q, k, v = (qkv[:, j * hk:(j + 1) * hk].reshape(B, 1, H, D) for j in range(3))
        o = torch.empty(B, 1, H, D, device=x.device, dtype=x.dtype)
        self.peers.kda_decode(q, k, v, g1.reshape(B, 1, H, D), beta.reshape(B, 1, H), L["A_log"], L["dt_bias"],
                              kc.gate_lower_bound, state, o)
        return self._kda_out(o, g2, L, B)

    def _mla_front(self, x, L):
        mc = self.spec.mla
        proj = x @ L["qkv_a_g"].t()
        qc, kvc, kpe, gate = proj.split([mc.q_lora_rank, mc.kv_lora_rank, mc.qk_rope_head_dim,
                                         mc.num_heads * mc.v_head_dim], dim=-1)
        qc = self.peers.rms_norm(qc, L["q_a_ln"], 1e-6)
        kvc = self.peers.rms_norm(kvc, L["kv_a_ln"], 1e-6)
        q = (qc @ L["q_b"].t()).view(-1, mc.num_heads, mc.qk_head_dim)
        return q, kvc, kpe, gate

    def _mla_back(self, o, gate, L):
        return (o * torch.sigmoid(gate)) @ L["o_proj"].t()

    def _mla_prefill(self, x, L, lens, kcache=None, slots=None):
        mc = self.spec.mla
        T, n, pn, r, dv = x.shape[0], mc.num_heads, mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim
        q, kvc, kpe, gate = self._mla_front(x, L)
        if kcache is not None:                                  # the new tokens' latent rows into the paged cache
            kcache.view(-1, kcache.shape[-1]).index_copy_(0, slots, torch.cat([kvc, kpe], dim=-1))
        kv = (kvc @ L["kv_b"].t()).view(T, n, pn + dv)
        k = torch.cat([kv[..., :pn], kpe[:, None].expand(T, n, r)], dim=-1)
        v = kv[..., pn:]
        scale = mc.qk_head_dim ** -0.5
        if len(set(lens)) == 1:
            S = len(lens)
            o = self.peers.mla_prefill(q.view(S, -1, n, q.shape[-1]), k.view(S, -1, n, k.shape[-1]),
                                       v.reshape(S, -1, n, dv), scale).reshape(T, n * dv)
        else:
            outs, s0 = [], 0
            for ln in lens:
                sl = slice(s0, s0 + ln)
                outs.append(self.peers.mla_prefill(q[None, sl], k[None, sl], v[None, sl], scale)[0])
                s0 += ln
            o = torch.cat(outs).reshape(T, n * dv)
        return self._mla_back(o, gate, L)

    def _mla_decode(self, x, L, ds, kcache):
        mc = self.spec.mla
        B, n, pn, lat = x.shape[0], mc.num_heads, mc.qk_nope_head_dim, mc.kv_lora_rank
        q, kvc, kpe, gate = self._mla_front(x, L)
        ql = torch.bmm(q[..., :pn].transpose(0, 1), L["W_UK_T"]).transpose(0, 1)                # [B, N, L]
        mqa_q = torch.cat([ql, q[..., pn:]], dim=-1).unsqueeze(1)                               # [B, 1, N, L+R]
        kcache.view(-1, kcache.shape[-1]).index_copy_(0, ds.slots, torch.cat([kvc, kpe], dim=-1))
        o_lat = self.peers.mla_decode(mqa_q, kcache, ds.seqlens, ds.block_table, mc.qk_head_dim ** -0.5, lat,
                                      ds.meta)
        o = torch.bmm(o_lat[:, 0].transpose(0, 1), L["W_UV"]).transpose(0, 1).reshape(B, -1)  # [B, N*V]
        return self._mla_back(o, gate, L)

    # -- the model -------------------------------------------------------------------------------------------------
    def _trunk(self, x, attend):
        """vLLM's KimiLinearModel.forward with AttnRes: the blocks buffer, the prefix (partial block sum), each
        layer's two AttnRes calls around attention; returns the output mix (before the final norm)."""
        T, d = x.shape
        blocks = x.new_empty(T, self.nblocks, d)
        prefix, hidden = x, None
        for i, L in enumerate(self.layers):
            write = i % self.S == 0
            prev = -(-i // self.S)
            h = self.peers.attn_res(prefix, hidden, blocks, *L["sa_res"], L["in_ln"], prev,
                                    i // self.S if write else -1, self.eps, self.eps)
            y = attend(i, L, h)
            if write:
                prefix, delta = y, None
            else:
                delta = y
            h = self.peers.attn_res(prefix, delta, blocks, *L["mlp_res"], L["post_ln"], prev + write, -1,
                                    self.eps, self.eps)
            hidden = self._ffn(h, L)
        return self.peers.attn_res(prefix, hidden, blocks, *self.out_res, None, self.nblocks, -1, self.eps, 0.0)

    def _head(self, out):
        return self.peers.rms_norm(out, self.norm, self.eps) @ self.lm_head.t()

    @torch.no_grad()
    def prefill(self, seqs: list[torch.Tensor], all_logits: bool = False, ds: "DecodeState | None" = None):
        """Fresh prefill of sequences (1-D id tensors). Returns logits of every position [T, vocab] (all_logits) or
        of each sequence's last one [S, vocab]. With ds (batch len(seqs)), leaves the caches it continues from."""
        lens = [int(s.numel()) for s in seqs]
        ids = torch.cat(seqs).to(self.device)
        cu = torch.tensor([0] + [sum(lens[:j + 1]) for j in range(len(lens))], device=self.device, dtype=torch.int32)
        if ds is not None:
            pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
            seq = torch.cat([torch.full((n,), b, device=self.device) for b, n in enumerate(lens)])
            slots = (ds.block_table[seq, pos // PAGE].long() * PAGE + pos % PAGE)

        def attend(i, L, h):
            if L["kind"] == "kda":
                return self._kda_prefill(h, L, cu, ds.kda[i] if ds is not None else None)
            return self._mla_prefill(h, L, lens, ds.kcache[i] if ds is not None else None,
                                     slots if ds is not None else None)

        out = self._trunk(F.embedding(ids, self.embed), attend)
        if not all_logits:
            out = out[cu[1:].long() - 1]
        return self._head(out)

    @torch.no_grad()
    def decode(self, ds: "DecodeState", tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of ds's batch (tokens [B]): logits [B, vocab]. The new latent rows go to ds.slots and
        attention reads ds.seqlens rows (the caller advances them; the timed graphs replay one fixed position)."""
        def attend(i, L, h):
            if L["kind"] == "kda":
                return self._kda_decode(h, L, *ds.kda[i])
            return self._mla_decode(h, L, ds, ds.kcache[i])

        return self._head(self._trunk(F.embedding(tokens, self.embed), attend))


class DecodeState:
    """The stack's decode caches for B sequences: per KDA layer (state [B, H, V, K] fp32, packed q|k|v conv cache
    [B, 3 H K, W] as fla keeps it), per MLA layer a paged latent cache [pages, 64, 1, L+R] with each sequence's pages
    contiguous, block table, lengths (cached + the new token) and the slot the new token's row goes to."""

    def __init__(self, stack: Stack, B: int, cached: int, device, pools: dict | None = None,
                 block_table: torch.Tensor | None = None):
        """pools / block_table: read and write another owner's pages ({MLA layer: [pages, 64, L+R]}, [B, pages per
        sequence] int32: k3c's decode graph's, so that one copy of a long cache serves both sides)."""
        spec, dt = stack.spec, stack.dtype
        kc, mc = spec.kda, spec.mla
        self.B, self.cached = B, cached
        npg = -(-(cached + 1) // PAGE)
        self.kda = {i: (torch.zeros(B, kc.num_heads, kc.head_dim, kc.head_dim, device=device),
                        torch.zeros(B, 3 * kc.width, kc.conv_kernel, device=device, dtype=dt))
                    for i, k in enumerate(spec.layer_kinds) if k == "kda"}
        width = mc.kv_lora_rank + mc.qk_rope_head_dim
        if pools is not None:
            self.kcache = {i: p.view(p.shape[0], PAGE, 1, width) for i, p in pools.items()}
            self.block_table = block_table
        else:
            self.kcache = {i: torch.zeros(B * npg, PAGE, 1, width, device=device, dtype=dt)
                           for i, k in enumerate(spec.layer_kinds) if k == "mla"}
            self.block_table = torch.arange(B * npg, device=device, dtype=torch.int32).view(B, npg)
        self.set_length(cached)
        self.meta = None

    def set_length(self, cached: int) -> None:
        """Sequences hold `cached` tokens; the next decode writes position `cached` and attends over cached + 1."""
        B = self.B
        self.seqlens = torch.full((B,), cached + 1, device=self.block_table.device, dtype=torch.int32)
        b = torch.arange(B, device=self.block_table.device)
        self.slots = self.block_table[b, cached // PAGE].long() * PAGE + cached % PAGE

    def load(self, kda: dict, latent: dict) -> None:
        """From k3c's cache layout: KDAState (state [B, H, K, V], conv tails (q, k, v) [B, H K, W-1]) and latent rows
        [B, n, L+R]; layers absent from either dict keep what they hold."""
        for i, (state, conv) in self.kda.items():
            if i not in kda:
                continue
            state.copy_(kda[i].state.transpose(-1, -2))
            conv.zero_()
            conv[..., 1:] = torch.cat(kda[i].conv, dim=1)
        for i in latent:
            n = latent[i].shape[1]
            rows = self.kcache[i].view(-1, self.kcache[i].shape[-1])
            for b in range(self.B):
                pages = self.block_table[b, :-(-n // PAGE)].long()
                slots = (pages[:, None] * PAGE + torch.arange(PAGE, device=pages.device)).reshape(-1)[:n]
                rows[slots] = latent[i][b]


# ---------------------------------------------------------------------------------------------------------------
# profiling, timing
# ---------------------------------------------------------------------------------------------------------------
def family(name: str) -> str:
    """The family of a GPU kernel name (k3c's own kernels and the peers' and torch's)."""
    n = name.lower()
    if "attn_res" in n or "attnres" in n:
        return "AttnRes"
    if n.startswith("k3c_moe_linear") or "gemm_glu" in n:
        return "GEMMs"
    if "kda" in n or "causal_conv" in n or "layer_norm_gated" in n or "conv1d" in n or "recurrent" in n:
        return "KDA"
    if "mla" in n or "flash_fwd" in n or "fmha" in n or "flash_attn" in n or "attention" in n or "sdpa" in n:
        return "MLA"
    if "matmul_ogs" in n or "moe" in n or "routing" in n or "bitmatrix" in n or "expt" in n or "topk" in n \
            or "sort_tokens" in n or "situ_glu" in n:
        return "MoE"
    if "gemm" in n or "nvjet" in n or "xmma" in n or "cutlass" in n or "cublas" in n or "splitk" in n \
            or "sm90_" in n or "bmm" in n:
        return "GEMMs"
    return "other"


def profile_families(fn, n: int = 2) -> dict:
    """GPU time (ms per call) by family over n calls of fn (after one), from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    fam = {f: 0.0 for f in FAMILIES}
    top: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0 and "memcpy" not in ev.name.lower():
            fam[family(ev.name)] += ev.device_time / n / 1e3
            top[ev.name] = top.get(ev.name, 0.0) + ev.device_time / n / 1e3
    out = {k: round(v, 4) for k, v in fam.items()}
    out["total"] = round(sum(fam.values()), 4)
    out["top"] = [[k[:90], round(v, 4)] for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:8]]
    return out


def guarded_profile(fn, row: dict, n: int = 2) -> dict | None:
    """profile_families, or None with the reason in row["profile_errors"]: a profile that runs out of memory (the
    eager step's temporaries beside two K3-wide models) must not cost the row its times."""
    try:
        return profile_families(fn, n)
    except torch.OutOfMemoryError as exc:
        row.setdefault("profile_errors", []).append(f"OutOfMemoryError: {str(exc).splitlines()[0][:200]}")
        return None
    finally:
        torch.cuda.empty_cache()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, reps: int, device) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# the float64 truth without the dequantized expert stacks in memory
# ---------------------------------------------------------------------------------------------------------------
class LazyExperts:
    """An expert stack [E, N, K] that k3c's reference indexes expert by expert (w[e]): each dequantized from the
    MXFP4 bytes when used, in the dtype asked for; nothing of E x N x K is ever held."""

    def __init__(self, packed, scales, shape, dtype=torch.bfloat16):
        self.packed, self.scales, self.shape, self.dtype = packed, scales, torch.Size(shape), dtype

    def to(self, dtype=None, **_):
        dtype = dtype if isinstance(dtype, torch.dtype) else self.dtype
        return LazyExperts(self.packed, self.scales, self.shape, dtype)

    def is_floating_point(self) -> bool:
        return True

    def numel(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, e):
        from k3c.quant.mx import mxfp4_dequantize

        return mxfp4_dequantize(self.packed[e], self.scales[e], torch.float32).to(self.dtype)


def truth_model(spec, w):
    from e2e import WideReference
    from k3c.frontend.weight_names import model_weights

    full = dict(w)
    for info in model_weights(spec):
        if info.kind == "experts" and info.name not in full:
            full[info.name] = LazyExperts(w[info.name + ".weight_packed"], w[info.name + ".weight_scale"],
                                          info.shape)
    return WideReference(spec, full, torch.float64, mla_mode="mha")


# ---------------------------------------------------------------------------------------------------------------
# the bench
# ---------------------------------------------------------------------------------------------------------------
def setup(args) -> dict:
    import k3c
    from e2e import make_weights
    from k3c.runtime.devices import target_for
    from k3c.runtime.engine import Engine

    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.artifact:
        # an artifact compiled on a machine whose Triton builds the Hopper tier (the GPU box's cannot): k3c runs
        # its binaries, tier kernels included, as a deployment would
        model = k3c.load(args.artifact)
        spec = model.spec
        progress(f"k3c: artifact {args.artifact} (target {model.target.name}, tiers {model.target.tiers or 'none'})")
    else:
        spec = k3c.load_spec(args.spec)
        model = k3c.compile(spec, target="h200" if cuda else "cpu")
    t0 = time.perf_counter()
    w = make_weights(spec, model.module, args.device, dtype, seed=args.seed, reference=False)
    progress(f"weights in {time.perf_counter() - t0:.1f} s")
    if args.peers == "kernels":
        site = install_site()
        try:
            peers = KernelPeers(args.carry)
        except (RuntimeError, OSError, ImportError) as exc:     # no carry, a library that does not load, no wheels
            print(f"stack.py: error: the peers' kernels are not available: {type(exc).__name__}: {exc} (the carry: "
                  "bench/stack.py's docstring; --peers torch runs the stand-ins)", file=sys.stderr)
            raise SystemExit(2) from None
        progress(f"peers: kernels from {peers.carry} (wheels from {site})")
    else:
        peers = TorchPeers()
    stack = Stack(spec, w, peers, args.device, dtype, share=True)
    progress("stack built")
    ctx = max(max(args.prefill_tokens) if args.prefill_tokens else 0, args.check_len + 2)
    ps = target_for(args.device).mla_page_size
    eng = Engine(model, w, device=args.device, max_batch=max(8, max(s for s, _ in args.prefill) if args.prefill else 1),
                 max_context=ctx, num_pages=8 * -(-ctx // ps) + 8, page_size=ps, use_kernels=not args.no_kernels,
                 cuda_graphs=False)
    progress("k3c engine built")
    return {"spec": spec, "model": model, "w": w, "stack": stack, "eng": eng, "peers": peers, "dtype": dtype,
            "cuda": cuda}


def probe(b: dict, args) -> dict:
    """The numerics check (module docstring): prefill of --check-len tokens and one decode step from the truth's
    cache, k3c and the stack against the float64 truth and against each other."""
    from k3c.reference.kda import KDAState
    from k3c.reference.model import ReferenceCache

    spec, eng, stack, dtype, dev = b["spec"], b["eng"], b["stack"], b["dtype"], args.device
    g = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(0, spec.vocab_size, (1, args.check_len + 1), generator=g).to(dev)
    prompt, nxt = ids[:, :-1], ids[:, -1:]
    truth = truth_model(spec, b["w"])
    t_pre, t_cache = truth.forward(prompt, None)
    rid = eng.open()
    k_pre = eng.extend([rid], [prompt[0]])[0]
    eng.finish(rid)
    s_pre = stack.prefill([prompt[0]], all_logits=True)
    # decode from the truth's cache as the run's dtype stores it
    kda = {i: KDAState(c.state.float(), tuple(t.to(dtype) for t in c.conv))
           for i, c in enumerate(t_cache.layers) if isinstance(c, KDAState)}
    lat = {i: c.to(dtype) for i, c in enumerate(t_cache.layers) if not isinstance(c, KDAState)}
    wide = {i: KDAState(c.state.double(), c.conv) for i, c in kda.items()}      # the truth runs in float64
    t_dec = truth.forward(nxt, ReferenceCache(tuple(wide.get(i, lat.get(i)) for i in range(spec.num_layers)),
                                              t_cache.length))[0][0, -1]
    rid = eng.adopt(prompt[0].tolist(), kda, {i: c[0] for i, c in lat.items()})
    k_dec = eng.extend([rid], [nxt[0].tolist()])[0][-1]
    eng.finish(rid)
    ds = DecodeState(stack, 1, args.check_len, dev)
    ds.load(kda, lat)
    ds.meta = stack.peers.mla_prepare(next(iter(ds.kcache.values())), ds.seqlens, ds.block_table,
                                      spec.mla.num_heads)
    s_dec = stack.decode(ds, nxt[:, 0])[0]
    out = {"check_len": args.check_len}
    for phase, t, k, s in (("prefill", t_pre[0], k_pre, s_pre), ("decode", t_dec, k_dec, s_dec)):
        ek, es = rel(k, t), rel(s, t)
        out[phase] = {"k3c_vs_truth": ek, "stack_vs_truth": es, "stack_vs_k3c": rel(s, k),
                      "stack_over_k3c_error": es / ek if ek > 0 else None,
                      "top1_agree_stack_k3c": float((s.argmax(-1) == k.argmax(-1)).double().mean())}
    return out


def trained_check(b: dict, args) -> dict:
    """The numerics check on the trained example model (--trained DIR, a K3 checkpoint such as examples/k3-stdlib):
    its own k3c engine and stack on the same peers. Its widths are below what FlashKDA (head_dim 128) and FlashMLA
    (latent 512 + 64) take and its experts load dense, so those calls run the stand-ins (listed in the result); the
    rest (fla, the AttnRes kernel, SDPA, cuBLAS, this bench's kernels) run as in the table."""
    import k3c
    from k3c.frontend.weight_names import weight_table
    from k3c.runtime.devices import target_for
    from k3c.runtime.engine import Engine

    spec = k3c.load_spec(args.trained)
    table = weight_table(spec)
    w = {k: v.to(args.device, torch.float32 if k in table and table[k].dtype == "fp32" else b["dtype"])
         for k, v in k3c.load_weights(spec, args.trained).items()}
    model = k3c.compile(spec, target="h200" if b["cuda"] else "cpu")
    before = dict(b["peers"].fallbacks)
    stack = Stack(spec, w, b["peers"], args.device, b["dtype"])
    ps = target_for(args.device).mla_page_size
    ctx = args.check_len + 2
    eng = Engine(model, w, device=args.device, max_batch=1, max_context=ctx, num_pages=-(-ctx // ps) + 2,
                 page_size=ps, use_kernels=not args.no_kernels, cuda_graphs=False)
    out = probe({**b, "spec": spec, "w": w, "stack": stack, "eng": eng}, args)
    out["spec"] = spec.name
    out["stand_in_calls"] = {k: v - before.get(k, 0) for k, v in b["peers"].fallbacks.items() if v != before.get(k, 0)}
    b["peers"].fallbacks.clear()
    b["peers"].fallbacks.update(before)
    return out


def prefill_row(b: dict, args, S: int, L: int) -> dict:
    spec, eng, stack, dev = b["spec"], b["eng"], b["stack"], args.device
    g = torch.Generator(device="cpu").manual_seed(S * 100003 + L)
    seqs = [torch.randint(0, spec.vocab_size, (L,), generator=g).to(dev) for _ in range(S)]

    def k3c():
        rids = [eng.open() for _ in range(S)]
        out = eng.extend(rids, seqs)
        for r in rids:
            eng.finish(r)
        return torch.stack([o[-1] for o in out])

    ds = DecodeState(stack, S, L, dev)          # where the prefill leaves its caches (as vLLM's and k3c's do)

    def stk():
        return stack.prefill(seqs, ds=ds)

    row = {"phase": "prefill", "sequences": S, "tokens_each": L}
    row["k3c_ms"] = median_ms(k3c, args.reps, dev)
    row["stack_ms"] = median_ms(stk, args.reps, dev)
    row["last_logits_rel_stack_vs_k3c"] = rel(stk(), k3c())
    if b["cuda"] and args.profile:
        row["k3c_families_ms"] = guarded_profile(k3c, row, 1)
        row["stack_families_ms"] = guarded_profile(stk, row, 1)
    return row


def random_cache(spec, B: int, T: int, dev, dtype, seed: int):
    """Random decode caches in k3c's layout (bench/e2e.py random_cache's recipe): KDA states and conv tails per
    sequence; latent rows [B, T, L+R] drawn for one sequence and shared by the batch (an expanded view: decode time
    does not depend on the values, and a 128 x 32K cache then exists once, in the pages both sides read)."""
    from k3c.reference.kda import KDAState

    kc, mc = spec.kda, spec.mla
    g = torch.Generator(device=dev).manual_seed(seed)
    kda, lat = {}, {}
    for i, kind in enumerate(spec.layer_kinds):
        if kind == "kda":
            kda[i] = KDAState(0.05 * torch.randn(B, kc.num_heads, kc.head_dim, kc.head_dim, generator=g, device=dev),
                              tuple(torch.randn(B, kc.width, kc.conv_kernel - 1, generator=g, device=dev).to(dtype)
                                    for _ in range(3)))
        else:
            lat[i] = torch.randn(1, T, mc.kv_lora_rank + mc.qk_rope_head_dim, generator=g, device=dev
                                 ).to(dtype).expand(B, T, -1)
    return kda, lat


def decode_row(b: dict, args, B: int, T: int) -> dict:
    from k3c.runtime.cuda_graph import DecodeGraph

    spec, stack, dev, dtype = b["spec"], b["stack"], args.device, b["dtype"]
    row = {"phase": "decode", "batch": B, "cached": T, "steps": args.steps}
    kda, lat = random_cache(spec, B, T, dev, dtype, seed=B * 7 + T)
    g = torch.Generator(device="cpu").manual_seed(B + T)
    toks = torch.randint(0, spec.vocab_size, (args.steps + 4, B), generator=g).to(dev)
    # -- k3c: its CUDA-graph decode step (profiled first, eagerly: its temporaries are freed before the capture)
    dg = DecodeGraph(b["model"], b["eng"].graph, batch=B, capacity=-(-(T + args.steps + 6) // PAGE) * PAGE,
                     device=dev, dtype=dtype, use_kernels=not args.no_kernels)
    if b["cuda"] and args.profile:
        dg.load_state(kda, lat, [T] * B)
        row["k3c_families_ms"] = guarded_profile(lambda: dg.eager_step(toks[0], device_lengths=True), row)
    dg.load_state(kda, lat, [T] * B)
    first_k3c = dg.step(toks[0]).float().clone()
    row["k3c_mode"] = dg.report.mode + (f" ({dg.report.reason[:160]})" if dg.report.mode != "graph" else "")
    sync(dev)
    t = time.perf_counter()
    for s in range(args.steps):
        dg.step(toks[1 + s])
    sync(dev)
    row["k3c_ms"] = (time.perf_counter() - t) * 1e3 / args.steps
    # -- stack: over k3c's pages where FlashMLA takes them (bf16, page 64), metadata once, one CUDA graph
    shared = dg.page_size == PAGE and all(p.dtype == dtype for p in dg.pools.values())
    ds = DecodeState(stack, B, T, dev, pools=dg.pools if shared else None,
                     block_table=dg.block_table if shared else None)
    ds.load(kda, {} if shared else lat)       # shared pages hold the rows already (k3c wrote past T only)
    row["stack_reads_k3c_pages"] = shared
    ds.meta = stack.peers.mla_prepare(next(iter(ds.kcache.values())), ds.seqlens, ds.block_table, spec.mla.num_heads)
    tok_buf = toks[0].clone()
    first_stack = stack.decode(ds, tok_buf).float()
    row["first_step_rel_stack_vs_k3c"] = rel(first_stack, first_k3c)
    step = lambda: stack.decode(ds, tok_buf)                                               # noqa: E731
    if b["cuda"] and args.profile:
        row["stack_families_ms"] = guarded_profile(step, row)
    graph = None
    if b["cuda"] and not args.no_graph:
        try:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            torch.cuda.synchronize()
            row["stack_mode"] = "graph"
        except Exception as exc:
            graph = None
            row["stack_mode"] = f"eager (capture failed: {type(exc).__name__}: {str(exc)[:160]})"
            traceback.print_exc(file=sys.stderr)
    else:
        row["stack_mode"] = "eager"
    run = graph.replay if graph is not None else step
    run()
    sync(dev)
    t = time.perf_counter()
    for s in range(args.steps):
        tok_buf.copy_(toks[1 + s])
        run()
    sync(dev)
    row["stack_ms"] = (time.perf_counter() - t) * 1e3 / args.steps
    del graph, ds, dg, kda, lat
    if b["cuda"]:
        torch.cuda.empty_cache()
    return row


def print_table(result: dict) -> None:
    print(f"\n{result['spec']} on {result['gpu'] or result['device']}, {result['dtype']}; peers: "
          f"{result['peers']['peers']}")
    if result["peers"]["fallbacks_to_stand_ins"]:
        print(f"  calls run by torch stand-ins: {result['peers']['fallbacks_to_stand_ins']}")
    print(f"k3c: {result['k3c_from']}; kernels {result.get('k3c_kernels')}")
    print("deviations from vLLM 0.33's K3 path:")
    for d in result["deviations"]:
        print(f"  - {d}")
    nm = result.get("numerics")
    if nm:
        print(f"numerics ({nm['check_len']} tokens, truth = float64 reference on the same weights), rel L2 of logits:")
        for ph in ("prefill", "decode"):
            c = nm[ph]
            ratio = c["stack_over_k3c_error"]
            print(f"  {ph:8s} k3c {c['k3c_vs_truth']:.2e}  stack {c['stack_vs_truth']:.2e}  stack-k3c "
                  f"{c['stack_vs_k3c']:.2e}  stack/k3c error {ratio:.2f}" if ratio is not None else
                  f"  {ph:8s} exact")
    nt = result.get("numerics_trained")
    if nt:
        print(f"numerics on the trained {nt['spec']} ({nt['check_len']} tokens; stand-ins for {nt['stand_in_calls']}):")
        for ph in ("prefill", "decode"):
            c = nt[ph]
            print(f"  {ph:8s} k3c {c['k3c_vs_truth']:.2e}  stack {c['stack_vs_truth']:.2e}  stack-k3c "
                  f"{c['stack_vs_k3c']:.2e}")
    print(f"{'row':28s} {'k3c ms':>9s} {'stack ms':>9s} {'stack/k3c':>9s}  breakdown (k3c | stack, ms: "
          + " ".join(FAMILIES) + ")")
    for r in result["rows"]:
        name = (f"prefill {r['sequences']}x{r['tokens_each']}" if r["phase"] == "prefill"
                else f"decode b{r['batch']} @{r['cached'] // 1024}K" if r["cached"] >= 1024 else
                f"decode b{r['batch']} @{r['cached']}" + (" fp8" if r.get("fp8") else ""))
        if "error" in r or "na" in r:
            print(f"{name:28s} {r.get('error') or 'n/a (fp8 note below)'}")
            continue
        fam = ""
        if r.get("k3c_families_ms") and r.get("stack_families_ms"):
            fam = " | ".join(" ".join(f"{r[k][f]:.2f}" for f in FAMILIES) for k in ("k3c_families_ms",
                                                                                   "stack_families_ms"))
        print(f"{name:28s} {r['k3c_ms']:9.3f} {r['stack_ms']:9.3f} {r['stack_ms'] / r['k3c_ms']:8.2f}x  {fam}")
    if any(r.get("fp8") for r in result["rows"]):
        print(f"fp8 latent rows: {result['fp8']}")


def argument_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true",
                    help="CI size on the CPU: k3-tiny, fp32, torch stand-ins, k3c through torch ops, short rows")
    ap.add_argument("--spec", default=None, help="spec (default examples/k3-wide.yaml; --small: examples/k3-tiny.yaml)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--peers", choices=("kernels", "torch"), default=None,
                    help="the peers' real kernels (default on CUDA) or the torch stand-ins")
    ap.add_argument("--carry", default=None, help="the peers' carry/ (default .peers/carry, ../shared/peers/carry)")
    ap.add_argument("--prefill", default=None, help="prefill rows SxL, comma separated (default 1x8192,8x1024)")
    ap.add_argument("--decode", default=None, help="decode rows BxT, comma separated (default 1,32,128 x 8K,32K)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 20; --small 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed prefill repetitions (default 5; --small 1)")
    ap.add_argument("--check-len", type=int, default=None, help="numerics probe tokens (0: none; default 256)")
    ap.add_argument("--trained", default=None,
                    help="a trained K3 checkpoint for a second numerics check (default examples/k3-stdlib; '' none)")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--no-graph", action="store_true", help="stack decode eagerly (no CUDA graph)")
    ap.add_argument("--no-kernels", action="store_true", help="k3c with every op through torch")
    ap.add_argument("--deadline", type=float, default=None, help="seconds after which no new row starts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--artifact", default=None,
                    help="k3c from this compiled artifact (`k3c compile SPEC --target h100 -o DIR`, made where the "
                         "Hopper tier builds) instead of compiling --spec in this process")
    ap.add_argument("--out", help="JSON (rewritten after every row)")
    return ap


def parse(argv):
    ap = argument_parser()
    a = ap.parse_args(argv)
    small = a.small
    a.spec = a.spec or ("examples/k3-tiny.yaml" if small else "examples/k3-wide.yaml")
    a.device = a.device or ("cpu" if small or not torch.cuda.is_available() else "cuda")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    cuda = a.device.startswith("cuda")
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    a.peers = a.peers or ("kernels" if cuda else "torch")
    if a.peers == "kernels" and not cuda:
        ap.error("--peers kernels needs CUDA (the peers are SM90 CUDA libraries and Triton kernels)")
    a.no_kernels = a.no_kernels or not cuda            # k3c's interpreter kernels would take minutes on a CPU
    try:
        a.prefill = [tuple(int(v) for v in r.split("x")) for r in (a.prefill or ("1x24,2x12" if small else
                                                                                  "1x8192,8x1024")).split(",") if r]
        a.decode = [tuple(int(v) for v in r.split("x")) for r in (a.decode or (
            "1x16,3x16" if small else "1x8192,32x8192,128x8192,1x32768,32x32768,128x32768")).split(",") if r]
    except ValueError:
        ap.error("--prefill / --decode: rows like 1x8192,8x1024 (SxL / BxT)")
    if any(len(r) != 2 or min(r) < 1 for r in a.prefill + a.decode):
        ap.error("--prefill / --decode: rows like 1x8192,8x1024 (SxL / BxT), positive")
    if a.artifact and not os.path.isfile(os.path.join(a.artifact, "manifest.json")):
        ap.error(f"--artifact {a.artifact}: not a k3c artifact (no manifest.json)")
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        ap.error(f"--out {a.out}: no such directory")
    a.prefill_tokens = [L for _, L in a.prefill]
    a.steps = a.steps or (2 if small else 20)
    a.reps = a.reps or (1 if small else 5)
    a.check_len = (16 if small else 256) if a.check_len is None else a.check_len
    a.trained = "examples/k3-stdlib" if a.trained is None else a.trained
    if not a.check_len:
        a.trained = ""
    return a


def run(argv=None) -> dict:
    args = parse(argv)
    b = setup(args)
    from k3c.runtime import launcher

    launcher.reset_stats()
    result = {"spec": b["spec"].name, "device": args.device, "dtype": args.dtype,
              "k3c_from": (f"artifact {args.artifact} (target {b['model'].target.name}, tiers "
                           f"{list(b['model'].target.tiers)})") if args.artifact else "compiled in this process",
              "gpu": torch.cuda.get_device_name() if b["cuda"] else None, "torch": torch.__version__,
              "args": {k: v for k, v in vars(args).items()}, "deviations": DEVIATIONS, "fp8": FP8_NA,
              "rows": [], "errors": {}, "skipped": []}

    def save():
        result["peers"] = b["peers"].describe()
        st = launcher.stats()
        result["k3c_kernels"] = {"binaries": st.binaries, "jit": st.jit, "tier_fallbacks": list(st.tier_fallbacks)}
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=2)

    def phase(name, fn):
        if args.deadline is not None and time.perf_counter() - _T0 > args.deadline:
            result["skipped"].append(name)
            progress(f"{name}: skipped (past --deadline)")
            return None
        progress(f"{name} ...")
        try:
            got = fn()
        except Exception as exc:              # one failing row is reported, the others still run
            result["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
            traceback.print_exc(file=sys.stderr)
            got = None
            if b["cuda"]:
                torch.cuda.empty_cache()
        progress(f"{name}: done")
        save()
        return got

    if args.check_len:
        result["numerics"] = phase("numerics", lambda: probe(b, args))
    for S, L in args.prefill:
        r = phase(f"prefill_{S}x{L}", lambda: prefill_row(b, args, S, L))
        result["rows"].append(r or {"phase": "prefill", "sequences": S, "tokens_each": L,
                                    "error": result["errors"].get(f"prefill_{S}x{L}", "skipped")})
    for B, T in args.decode:
        r = phase(f"decode_b{B}_t{T}", lambda: decode_row(b, args, B, T))
        result["rows"].append(r or {"phase": "decode", "batch": B, "cached": T,
                                    "error": result["errors"].get(f"decode_b{B}_t{T}", "skipped")})
    for B, T in args.decode:
        result["rows"].append({"phase": "decode", "batch": B, "cached": T, "fp8": True, "na": FP8_NA})
    if args.trained:
        result["numerics_trained"] = phase("numerics_trained", lambda: trained_check(b, args))
    save()
    print_table(result)
    return result


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
