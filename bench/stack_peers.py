"""The peers' kernels behind one interface, for bench/stack.py: each method is one kernel call as vLLM 0.33 makes it
for K3 on Hopper, with the kernel's own tensor layouts.

TorchPeers: torch stand-ins, each the kernel's contract written in torch (fp32 inside), so the stack runs on a CPU
(`bench/stack.py --small`, tests/bench/test_stack.py) and a GPU run can fall back per call where a kernel does not
take the shape. KernelPeers: the real kernels from the peers' carry (../shared/peers/README.md):
  kda_prefill   FlashKDA (vllm 0.33.0's prebuilt _flashkda_C, torch.ops._flashkda_C.fwd), intermediate-state
                export off; raw q/k/g/beta in (it fuses the L2 norms, safe gate and beta sigmoid), state [N, H, V, K]
  kda_decode    fla 0.6.0 fused_recurrent_kda_fwd (Triton; gate, norms, sigmoid in the kernel, state updated in place)
  conv_*        fla 0.6.0 causal_conv1d (prefill, varlen) / causal_conv1d_update (decode, one packed q|k|v call)
  gated_norm    fla 0.6.0 rms_norm_gated, sigmoid (KDA's o_norm * sigmoid(g))
  mla_decode    FlashMLA SM90 dense decode (vllm 0.33.0's _flashmla_C dense_decode_fwd) over the paged 576-wide bf16
                latent cache, page 64, with its tile-scheduler metadata made once per shape and reused
  mla_prefill   torch SDPA (causal; v zero-padded to the q/k width): vLLM runs FA3 here, not in a wheel we can carry
  moe_experts   triton_kernels (vllm 0.33.0's copy) routing_from_bitmatrix + matmul_ogs, MXFP4 weights in the Hopper
                value/scale layouts, opt flags split_k 1; gate|up GEMM with gather, SiTU-GLU, down GEMM with scatter
                and the top-k weighted reduce (gammas)
  attn_res      vLLM's K3 one-pass AttnRes Triton kernel (carry/vllm_k3_attn_res.py)
  situ_glu, rms_norm  small Triton kernels of this bench (vLLM: its SituAndMul / RMSNorm custom ops)
A call a kernel cannot take (head_dim != 128 for FlashKDA, a latent other than 512 + 64 for FlashMLA, fp32
activations) runs the stand-in; `fallbacks` counts those, and the bench prints them.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections import Counter

import torch
import torch.nn.functional as F

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARRY_DIRS = (os.path.join(ROOT, ".peers", "carry"), os.path.normpath(os.path.join(ROOT, "..", "shared", "peers",
                                                                                    "carry")))
FLASHMLA_PAGE = 64
os.environ.setdefault("FLA_FLASH_KDA", "0")      # fla's kernels as published (its optional FlashKDA backend off)


def _l2(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)


def _safe_gate(g, A_log, dt_bias, lb):
    """lb * sigmoid(exp(A_log[h]) * (g + dt_bias[h, d])) for g [..., H, D] (FlashKDA's and fla's safe gate)."""
    h, d = g.shape[-2:]
    return lb * torch.sigmoid(A_log.float().exp()[:, None] * (g.float() + dt_bias.float().view(h, d)))


class TorchPeers:
    """The peers' kernel contracts in torch (the stand-ins)."""
    name = "torch stand-ins"

    def __init__(self):
        self.fallbacks: Counter = Counter()

    # -- KDA ------------------------------------------------------------------------------------------------------
    def kda_prefill(self, q, k, v, g, beta, A_log, dt_bias, lb, h0, cu, out):
        """FlashKDA's contract: q, k, v, g [1, T, H, D] (post-conv, raw), beta [1, T, H] (raw), h0 [N, H, V, K]
        fp32; writes out [1, T, H, D]; returns the final states [N, H, V, K]."""
        from k3c.reference.kda import kda_chunked

        finals = []
        bounds = cu.tolist()
        for n in range(len(bounds) - 1):
            sl = slice(bounds[n], bounds[n + 1])
            o, s = kda_chunked(_l2(q[:, sl]), _l2(k[:, sl]), v[:, sl].float(),
                               _safe_gate(g[:, sl], A_log, dt_bias, lb), torch.sigmoid(beta[:, sl].float()),
                               initial_state=h0[n:n + 1].transpose(-1, -2).float())
            out[:, sl] = o.to(out.dtype)
            finals.append(s[0].transpose(-1, -2))
        return torch.stack(finals)

    def kda_decode(self, q, k, v, g, beta, A_log, dt_bias, lb, state, out):
        """fla fused_recurrent_kda's contract for one token per sequence: q, k, v, g [B, 1, H, D], beta [B, 1, H];
        state [B, H, V, K] fp32 updated in place; writes out [B, 1, H, D]."""
        from k3c.reference.kda import kda_recurrent

        o, s = kda_recurrent(_l2(q), _l2(k), v.float(), _safe_gate(g, A_log, dt_bias, lb),
                             torch.sigmoid(beta.float()), initial_state=state.transpose(-1, -2))
        state.copy_(s.transpose(-1, -2))
        out.copy_(o.to(out.dtype))

    def conv_prefill(self, x, weight, cu):
        """Causal depthwise conv + SiLU of x [T, C] per sequence (cu: offsets), weight [C, W]: (y [T, C], the final
        conv caches [N, C, W] as fla keeps them: the last W inputs)."""
        c, wd = weight.shape
        ys, caches = [], []
        bounds = cu.tolist()
        for n in range(len(bounds) - 1):
            xs = x[bounds[n]:bounds[n + 1]].t()[None]                                  # [1, C, T]
            xp = F.pad(xs, (wd - 1, 0))
            ys.append(F.silu(F.conv1d(xp.float(), weight.float()[:, None], groups=c))[0].t().to(x.dtype))
            caches.append(F.pad(xs, (wd, 0))[0, :, -wd:])
        return torch.cat(ys), torch.stack(caches)

    def conv_update(self, x, cache, weight):
        """One token per sequence: x [B, C], cache [B, C, W] (the last W inputs; updated in place) -> y [B, C]."""
        cache.copy_(torch.cat([cache[..., 1:], x[..., None].to(cache.dtype)], dim=-1))
        return F.silu((cache.float() * weight.float()).sum(-1)).to(x.dtype)

    def gated_norm(self, x, g, weight, eps):
        """rms_norm(x) * weight * sigmoid(g) over the last dim (fp32 inside)."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (y * torch.sigmoid(g.float())).to(x.dtype)

    # -- MLA ------------------------------------------------------------------------------------------------------
    def mla_prefill(self, q, k, v, scale):
        """Causal attention of q, k [S, T, N, P+R], v [S, T, N, V] (S equal-length sequences) -> [S, T, N, V]."""
        s = torch.einsum("stnd,sknd->sntk", q.float(), k.float()) * scale
        t = q.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("sntk,sknv->stnv", p, v.float()).to(q.dtype)

    def mla_prepare(self, kcache, seqlens, block_table, num_heads):
        return None

    def mla_decode(self, q, kcache, seqlens, block_table, scale, latent_dim, meta=None):
        """FlashMLA's dense decode contract: q [B, 1, N, L+R], kcache [pages, page, 1, L+R], seqlens [B] int32,
        block_table [B, pages per seq] int32 -> o [B, 1, N, L]."""
        outs = []
        for b in range(q.shape[0]):
            n = int(seqlens[b])
            rows = kcache[block_table[b].long()].reshape(-1, kcache.shape[-1])[:n].float()
            p = torch.softmax(q[b, 0].float() @ rows.t() * scale, dim=-1)
            outs.append(p @ rows[:, :latent_dim])
        return torch.stack(outs)[:, None].to(q.dtype)

    # -- MoE ------------------------------------------------------------------------------------------------------
    def prepare_experts(self, w1p, w1s, w3p, w3s, w2p, w2s, dtype):
        """The routed experts as this backend runs them: here the dequantized values (what k3c's reference uses)."""
        from k3c.quant.mx import mxfp4_dequantize

        return {"w13": torch.cat([mxfp4_dequantize(w1p, w1s, dtype), mxfp4_dequantize(w3p, w3s, dtype)], dim=1),
                "w2": mxfp4_dequantize(w2p, w2s, dtype)}

    def prepare_dense_experts(self, w1, w3, w2):
        """Unquantized experts (a spec without MXFP4 experts): run by the stand-in on every backend."""
        self.fallbacks["moe_experts (bf16 experts: matmul_ogs here runs MXFP4 only)"] += 1
        return {"w13": torch.cat([w1, w3], dim=1), "w2": w2}

    def moe_experts(self, z, ids, weights, experts, act):
        """u [M, z] = sum_k weights[:, k] E_{ids[:, k]}(z) with E(z) = w2 act(w13 z) (gate rows first)."""
        w13, w2 = experts["w13"], experts["w2"]
        m = w2.shape[-1]
        u = torch.zeros(z.shape[0], w2.shape[1], dtype=torch.float32, device=z.device)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = F.linear(z[tok], w13[e].to(z.dtype))
            h = self.situ_glu(y[:, :m], y[:, m:], act)
            u.index_add_(0, tok, F.linear(h, w2[e].to(z.dtype)).float() * weights[tok, slot, None].float())
        return u.to(z.dtype)

    # -- AttnRes and small ops --------------------------------------------------------------------------------------
    def attn_res(self, prefix, delta, blocks, norm_w, qk_w, out_norm_w, num_blocks, block_write_idx, eps,
                 out_eps):
        """vLLM's one-pass K3 AttnRes kernel in torch: prefix += delta (rounded to the prefix dtype, stored back),
        optionally blocks[:, block_write_idx] = prefix, then the softmax mix over blocks[:, :num_blocks] and the
        prefix, then an optional RMSNorm with out_norm_w."""
        if delta is not None:
            prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
        if block_write_idx >= 0:
            blocks[:, block_write_idx] = prefix
        if num_blocks == 0:
            mixed = prefix.float()
        else:
            src = torch.cat([blocks[:, :num_blocks].float(), prefix.float()[:, None]], dim=1)     # [T, n+1, d]
            qw = norm_w.float() * qk_w.float()
            logits = (src @ qw) * torch.rsqrt(src.pow(2).mean(-1) + eps)
            mixed = (torch.softmax(logits, dim=-1)[..., None] * src).sum(1)
        if out_norm_w is not None:
            mixed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + out_eps) * out_norm_w.float()
        return mixed.to(prefix.dtype)

    def situ_glu(self, g, u, act):
        """SiTU-GLU [b_g tanh(g/b_g) sigmoid(g)] * [b_u tanh(u/b_u)] (fp32 inside), in g's dtype."""
        gf, uf = g.float(), u.float()
        bg, bu = act.situ_beta_gate, act.situ_beta_up
        return ((bg * torch.tanh(gf / bg) * torch.sigmoid(gf)) * (bu * torch.tanh(uf / bu))).to(g.dtype)

    def rms_norm(self, x, weight, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    def describe(self) -> dict:
        return {"peers": self.name, "fallbacks_to_stand_ins": dict(self.fallbacks)}


def find_carry() -> str | None:
    for d in CARRY_DIRS:
        if os.path.isdir(os.path.join(d, "so")):
            return d
    return None


def _load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class KernelPeers(TorchPeers):
    """The real kernels (module docstring); each call that a kernel cannot take runs the stand-in."""
    name = "vLLM 0.33 kernels (FlashKDA, fla 0.6.0, FlashMLA, triton_kernels matmul_ogs, vLLM K3 AttnRes)"

    def __init__(self, carry: str | None = None):
        super().__init__()
        carry = carry or find_carry()
        if carry is None:
            raise RuntimeError(f"no peers' carry/ (looked in {', '.join(CARRY_DIRS)}): build it with "
                               "../shared/peers/fetch_peers.sh .peers/carry")
        self.carry = carry
        torch.ops.load_library(os.path.join(carry, "so", "_flashkda_C.abi3.so"))
        torch.ops.load_library(os.path.join(carry, "so", "_flashmla_C.abi3.so"))
        self.kda_op = torch.ops._flashkda_C
        self.mla_op = torch.ops._flashmla_C.dense_decode_fwd
        self.attn_res_mod = _load_module(os.path.join(carry, "vllm_k3_attn_res.py"), "vllm_k3_attn_res")
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd, causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        from stack_triton import rms_norm as tl_rms_norm, situ_glu as tl_situ_glu

        self._conv_fwd, self._conv_update = causal_conv1d_fwd, causal_conv1d_update
        self._norm_gated, self._recurrent = layer_norm_gated_fwd, fused_recurrent_kda_fwd
        self._tl_rms_norm, self._tl_situ_glu = tl_rms_norm, tl_situ_glu
        opt_flags.update_opt_flags_constraints({"split_k": 1})          # what vLLM sets on SM90
        self._ws: dict = {}

    def _bf16(self, *ts) -> bool:
        return all(t.dtype == torch.bfloat16 and t.is_cuda for t in ts)

    def kda_prefill(self, q, k, v, g, beta, A_log, dt_bias, lb, h0, cu, out):
        if not self._bf16(q) or q.shape[-1] != 128:
            self.fallbacks["kda_prefill (FlashKDA takes bf16, head_dim 128)"] += 1
            return super().kda_prefill(q, k, v, g, beta, A_log, dt_bias, lb, h0, cu, out)
        T, H, D = q.shape[1], q.shape[2], q.shape[3]
        N = cu.numel() - 1
        key = ("kda", T, H, N)
        if key not in self._ws:
            self._ws[key] = torch.empty(int(self.kda_op.get_workspace_size(T, H, N)), device=q.device,
                                        dtype=torch.uint8)
        fin = torch.empty(N, H, D, D, device=q.device, dtype=torch.float32)
        self.kda_op.fwd(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta, D ** -0.5, out,
                        self._ws[key], A_log.float().contiguous(), dt_bias.float().view(H, D).contiguous(), lb,
                        h0.contiguous(), fin, cu.to(torch.long), None, None)
        return fin

    def kda_decode(self, q, k, v, g, beta, A_log, dt_bias, lb, state, out):
        if not self._bf16(q):
            self.fallbacks["kda_decode (bf16 only here)"] += 1
            return super().kda_decode(q, k, v, g, beta, A_log, dt_bias, lb, state, out)
        q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()   # the kernel's layout
        self._recurrent(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=state,
                        inplace_final_state=True, state_v_first=True, use_qk_l2norm_in_kernel=True,
                        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lb, out=out)

    def conv_prefill(self, x, weight, cu):
        if not self._bf16(x):
            self.fallbacks["conv (bf16 only here)"] += 1
            return super().conv_prefill(x, weight, cu)
        y, final = self._conv_fwd(x[None], weight, None, None, output_final_state=True, activation="silu",
                                  cu_seqlens=cu.to(torch.long) if cu.numel() > 2 else None)
        return y[0], final

    def conv_update(self, x, cache, weight):
        if not self._bf16(x):
            self.fallbacks["conv (bf16 only here)"] += 1
            return super().conv_update(x, cache, weight)
        return self._conv_update(x, cache, weight=weight, activation="silu")[0]

    def gated_norm(self, x, g, weight, eps):
        if not self._bf16(x):
            return super().gated_norm(x, g, weight, eps)
        return self._norm_gated(x, g, weight, None, activation="sigmoid", eps=eps, is_rms_norm=True)[0]

    def mla_prefill(self, q, k, v, scale):
        if not q.is_cuda:
            return super().mla_prefill(q, k, v, scale)
        pad = q.shape[-1] - v.shape[-1]
        vp = F.pad(v, (0, pad)) if pad > 0 else v
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), vp.transpose(1, 2), is_causal=True,
                                           scale=scale)
        return o.transpose(1, 2)[..., :v.shape[-1]]

    def _mla_ok(self, q, kcache, latent_dim):
        return (self._bf16(q) and kcache.shape[1] == FLASHMLA_PAGE and kcache.shape[-1] == 576 and latent_dim == 512)

    def mla_prepare(self, kcache, seqlens, block_table, num_heads):
        """FlashMLA's tile-scheduler metadata for this batch (one call with None; reused by every layer's call)."""
        if not self._mla_ok(torch.empty(0, dtype=kcache.dtype, device=kcache.device), kcache, 512):
            return None
        B = seqlens.numel()
        q = torch.zeros(B, 1, num_heads, 576, device=kcache.device, dtype=kcache.dtype)
        _, _, tsm, nsp = self.mla_op(q, kcache, 512, seqlens, block_table, 576 ** -0.5, False, None, None, None)
        return tsm, nsp

    def mla_decode(self, q, kcache, seqlens, block_table, scale, latent_dim, meta=None):
        if not self._mla_ok(q, kcache, latent_dim):
            self.fallbacks["mla_decode (FlashMLA takes bf16, latent 512 + 64, page 64)"] += 1
            return super().mla_decode(q, kcache, seqlens, block_table, scale, latent_dim)
        tsm, nsp = meta if meta is not None else (None, None)
        return self.mla_op(q, kcache, latent_dim, seqlens, block_table, scale, False, tsm, nsp, None)[0]

    def prepare_experts(self, w1p, w1s, w3p, w3s, w2p, w2s, dtype):
        if dtype != torch.bfloat16 or not w1p.is_cuda:
            return super().prepare_experts(w1p, w1s, w3p, w3s, w2p, w2s, dtype)
        from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
        from triton_kernels.numerics import InFlexData
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        def hopper(wq, ws):           # vLLM's _swizzle_mxfp4 for SM90: [E, N, K/2] -> [E, K/2, N] in the MX layouts
            vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            wt = convert_layout(wrap_torch_tensor(wq.transpose(-2, -1), dtype=FP4), vl, **vo)
            st = convert_layout(wrap_torch_tensor(ws.transpose(-2, -1)), sl, **so)
            return wt, PrecisionConfig(weight_scale=st, flex_ctx=FlexCtx(rhs_data=InFlexData()))

        w13, pc13 = hopper(torch.cat([w1p, w3p], dim=1), torch.cat([w1s, w3s], dim=1))
        w2, pc2 = hopper(w2p, w2s)
        return {"w13": w13, "pc13": pc13, "w2": w2, "pc2": pc2, "E": w1p.shape[0], "m": w2p.shape[-1] * 2}

    def moe_experts(self, z, ids, weights, experts, act):
        if "pc13" not in experts:
            return super().moe_experts(z, ids, weights, experts, act)
        from triton_kernels.matmul_ogs import matmul_ogs
        from triton_kernels.routing import routing_from_bitmatrix
        from triton_kernels.tensor import Bitmatrix

        M, k = ids.shape
        E, m = experts["E"], experts["m"]
        cols = -(-E // 32)
        # vLLM's make_routing_data: a bitmatrix of the chosen experts, then triton_kernels' own sort / metadata
        bits = torch.zeros(M, cols, dtype=torch.int64, device=z.device)
        bits.scatter_add_(1, ids // 32, torch.ones_like(ids) << (ids % 32))
        bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.uint32)
        bm = Bitmatrix(bits, shape=[M, cols * 32], shape_max=[M, None], scratchpad=None)
        rd, gi, si = routing_from_bitmatrix(bm, weights.to(torch.bfloat16), ids.to(torch.int16), E, k)
        y1 = matmul_ogs(z, experts["w13"], None, rd, gather_indx=gi, precision_config=experts["pc13"])
        y1 = y1.view(M * k, 2 * m)
        h = self.situ_glu(y1[:, :m], y1[:, m:], act)
        return matmul_ogs(h, experts["w2"], None, rd, scatter_indx=si, precision_config=experts["pc2"],
                          gammas=rd.gate_scal).view(M, -1)

    def attn_res(self, prefix, delta, blocks, norm_w, qk_w, out_norm_w, num_blocks, block_write_idx, eps,
                 out_eps):
        if not prefix.is_cuda:
            return super().attn_res(prefix, delta, blocks, norm_w, qk_w, out_norm_w, num_blocks, block_write_idx,
                                    eps, out_eps)
        return self.attn_res_mod.attn_res(prefix, delta, blocks, norm_w, qk_w, out_norm_w, num_blocks,
                                          block_write_idx, eps, out_eps)

    def situ_glu(self, g, u, act):
        if not g.is_cuda:
            return super().situ_glu(g, u, act)
        return self._tl_situ_glu(g, u, act.situ_beta_gate, act.situ_beta_up)

    def rms_norm(self, x, weight, eps):
        if not x.is_cuda:
            return super().rms_norm(x, weight, eps)
        return self._tl_rms_norm(x, weight, eps)


def install_site() -> str | None:
    """Where the carry's wheels were installed (the peers README's `pip install --target /tmp/site`), put on
    sys.path; None if not found."""
    for d in (os.environ.get("PEERS_SITE"), "/tmp/site"):
        if d and glob.glob(os.path.join(d, "triton_kernels")) and d not in sys.path:
            sys.path.insert(0, d)
            return d
        if d and d in sys.path:
            return d
    return None
