"""KDA kernels (interpreter on CPU) against the eager reference and fla's naive_recurrent_kda."""
from __future__ import annotations

import math

import pytest
import torch

from k3c.codegen.kernels.kda import emit_kda_inter, emit_kda_intra, kda_plan
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError
from k3c.frontend.spec import KDASpec
from k3c.runtime.kernel_impls.kda import cu_seqlens, kda_chunk, kda_decode, kda_out, kda_prep, unpack
from k3c.reference import kda_chunked, kda_gate, kda_recurrent, l2_norm, rms_norm, short_conv
from kdautil import rel_err, rnd, scan_inputs
from refutil import fla_naive


def per_seq(fn, lengths, *tensors):
    """Apply fn(seq tensors [1, T, ...], idx) per packed sequence; returns the list of results."""
    out, start = [], 0
    for i, n in enumerate(lengths):
        out.append(fn(*(t[start:start + n][None] for t in tensors), i))
        start += n
    return out


@pytest.mark.parametrize("gate, d, t", [("safe", 64, 1), ("softplus", 128, 1), ("safe", 128, 63),
                                        ("softplus", 64, 63), ("safe", 64, 65), ("softplus", 128, 65)])
def test_chunk_matches_fla_naive_fp32(gate, d, t):
    naive = fla_naive().naive_recurrent_kda
    q, k, v, g, beta, s0 = scan_inputs(t, 2, d, gate, seed=7 * d + t)
    o, s = kda_chunk(q, k, v, g, beta, cu_seqlens([t], "cpu"), s0)
    o_ref, s_ref = naive(q[None], k[None], v[None], g[None], beta[None], initial_state=s0.clone(),
                         output_final_state=True)
    assert o.dtype == s.dtype == torch.float32
    assert rel_err(o, o_ref[0]) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    o_r, s_r = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], initial_state=s0)
    assert rel_err(o, o_r[0]) <= 1e-5 and rel_err(s, s_r) <= 1e-5


@pytest.mark.parametrize("gate, t", [("safe", 500), ("softplus", 200)])
def test_chunk_long_sequence_and_no_initial_state(gate, t):
    d = 64
    q, k, v, g, beta, _ = scan_inputs(t, 1, d, gate, seed=11)
    o, s = kda_chunk(q, k, v, g, beta, cu_seqlens([t], "cpu"), None)
    o_r, s_r = kda_chunked(q[None], k[None], v[None], g[None], beta[None])
    assert rel_err(o, o_r[0]) <= 1e-5 and rel_err(s, s_r) <= 1e-5


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunk_variable_lengths_in_one_batch(chunk):
    """Two-kernel prefill (per-chunk slots of packed sequences) at both chunk steps (the state-passing kernel's
    prefetch of the next chunk reads one chunk past each sequence's end, masked; the intra programs past a short
    sequence's end exit)."""
    lengths = [1, 63, 17, 70, 2]
    h, d = 2, 64
    q, k, v, g, beta, s0 = scan_inputs(sum(lengths), h, d, "safe", seed=5, n_seq=len(lengths))
    o, s = kda_chunk(q, k, v, g, beta, cu_seqlens(lengths, "cpu"), s0, chunk=chunk)
    refs = per_seq(lambda q_, k_, v_, g_, b_, i: kda_recurrent(q_, k_, v_, g_, b_, initial_state=s0[i:i + 1]),
                   lengths, q, k, v, g, beta)
    assert rel_err(o, torch.cat([r[0][0] for r in refs])) <= 1e-5
    assert rel_err(s, torch.cat([r[1] for r in refs])) <= 1e-5


def test_chunk_bf16_inputs_fp32_state():
    t, h, d = 65, 2, 64
    q, k, v, g, beta, s0 = scan_inputs(t, h, d, "safe", seed=3)
    qb, kb, vb, bb = (x.bfloat16() for x in (q, k, v, beta))
    o, s = kda_chunk(qb, kb, vb, g, bb, cu_seqlens([t], "cpu"), s0, out_dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_r, s_r = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], initial_state=s0)
    assert rel_err(o, o_r[0]) <= 5e-3 and rel_err(s, s_r) <= 5e-3


def test_extreme_gates_at_lower_bound_stay_finite():
    t, h, d = 65, 2, 64
    q, k, v, g, beta, s0 = scan_inputs(t, h, d, "safe", seed=9, f_scale=1e3)
    assert g.min() >= -5.0 and (g <= -4.999).float().mean() > 0.4
    g = g.clone()
    g[..., : d // 2] = -1e-4            # half the channels keep a memory so the check is not vacuous
    for gg in (g, torch.full_like(g, -5.0)):
        o, s = kda_chunk(q, k, v, gg, beta, cu_seqlens([t], "cpu"), s0)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        o_r, s_r = kda_recurrent(q[None], k[None], v[None], gg[None], beta[None], initial_state=s0)
        assert rel_err(o, o_r[0]) <= 1e-5 and rel_err(s, s_r) <= 1e-5


def test_chunk_state_handover_equals_one_segment():
    t1, t2, h, d = 40, 25, 2, 64
    q, k, v, g, beta, s0 = scan_inputs(t1 + t2, h, d, "softplus", seed=21)
    o, s = kda_chunk(q, k, v, g, beta, cu_seqlens([t1 + t2], "cpu"), s0)
    o1, s1 = kda_chunk(q[:t1], k[:t1], v[:t1], g[:t1], beta[:t1], cu_seqlens([t1], "cpu"), s0)
    o2, s2 = kda_chunk(q[t1:], k[t1:], v[t1:], g[t1:], beta[t1:], cu_seqlens([t2], "cpu"), s1)
    assert rel_err(torch.cat([o1, o2]), o) <= 1e-5 and rel_err(s2, s) <= 1e-5


@pytest.mark.parametrize("chunk", [16, 32])
def test_checkpoint_states_inside_a_prefill(chunk):
    """States exported at chunk boundaries inside each sequence of one varlen prefill (two, one or none per
    sequence; one at a sequence's end): the recurrence's state after those tokens, with the outputs and final
    states of the prefill without checkpoints."""
    lengths = [70, 40, 33, 16]
    h, d = 2, 32
    q, k, v, g, beta, s0 = scan_inputs(sum(lengths), h, d, "safe", seed=31, n_seq=len(lengths))
    cu = cu_seqlens(lengths, "cpu")
    want_ck = [[chunk, 2 * chunk], [chunk, -1], [-1, -1], [16 if chunk == 16 else -1, -1]]
    ck = torch.tensor(want_ck, dtype=torch.int32)
    o, (s, sk) = kda_chunk(q, k, v, g, beta, cu, s0, chunk=chunk, checkpoints=ck)
    o_plain, s_plain = kda_chunk(q, k, v, g, beta, cu, s0, chunk=chunk)
    assert torch.equal(o, o_plain) and torch.equal(s, s_plain)
    assert sk.shape == (len(lengths), 2, h, d, d)
    starts = [0] + list(torch.tensor(lengths).cumsum(0)[:-1].tolist())
    for i, (b, n) in enumerate(zip(starts, lengths)):
        for j, at in enumerate(want_ck[i]):
            if at < 0:
                continue
            sl = slice(b, b + at)
            _, ref = kda_recurrent(q[sl][None], k[sl][None], v[sl][None], g[sl][None], beta[sl][None],
                                   initial_state=s0[i:i + 1])
            assert rel_err(sk[i, j], ref[0]) <= 1e-5, (i, j, at)
    with pytest.raises(CodegenError, match="int32"):
        kda_chunk(q, k, v, g, beta, cu, s0, checkpoints=ck.long())
    with pytest.raises(CodegenError, match="checkpoints per sequence"):
        emit_kda_inter(h, d, target=get_target("h100"), checkpoints=3)
    with pytest.raises(CodegenError, match="portable tier only"):
        emit_kda_inter(128, 128, target=get_target("h100"), checkpoints=1,
                       plan=kda_plan(128, "bf16", get_target("h100"), inter_tier="hopper"))


# ---- prep ---------------------------------------------------------------------------------------------------
def prep_inputs(total, h, d, kw, dtype, seed, n_seq):
    x = [rnd(total, h * d, seed=seed + i).to(dtype) for i in range(4)]
    xb = rnd(total, h, seed=seed + 4).to(dtype)
    conv = [rnd(h * d, 1, kw, seed=seed + 5 + i, scale=0.5).to(dtype) for i in range(3)]
    a_log = torch.linspace(math.log(0.5), math.log(8.0), h)
    dt_bias = rnd(h * d, seed=seed + 8) - 1.0
    tails = [rnd(n_seq, h * d, kw - 1, seed=seed + 9 + i).to(dtype) for i in range(3)]
    return x, xb, conv, a_log, dt_bias, tails


def reference_prep(x, xb, conv, a_log, dt_bias, tails, lengths, h, d, gate, lb):
    cfg = KDASpec(num_heads=h, head_dim=d, gate=gate, gate_lower_bound=lb)
    outs = {n: [] for n in ("q", "k", "v", "g", "beta")}
    new_tails = [[], [], []]
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        for j, name in enumerate("qkv"):
            y, nt = short_conv(x[j][sl][None], conv[j], tails[j][i:i + 1])
            y = y[0].unflatten(-1, (h, d))
            outs[name].append(l2_norm(y) if name != "v" else y.float())
            new_tails[j].append(nt)
        outs["g"].append(kda_gate(x[3][sl], a_log, dt_bias, cfg))
        outs["beta"].append(torch.sigmoid(xb[sl].float()))
        start += n
    return {k_: torch.cat(v_) for k_, v_ in outs.items()}, [torch.cat(t) for t in new_tails]


@pytest.mark.parametrize("dtype, gate, block_t", [(torch.float32, "safe", None), (torch.bfloat16, "softplus", None),
                                                  (torch.float32, "safe", 2)])
def test_prep_conv_tails_norms_gates(dtype, gate, block_t):
    # lengths 1 and 2 are shorter than the conv window (the old tail carries through); block_t 2 gives 19 tokens ten
    # time blocks, the second of which still reaches back into the tail
    lengths = [1, 2, 19]
    h, d, kw = 2, 64, 4
    x, xb, conv, a_log, dt_bias, tails = prep_inputs(sum(lengths), h, d, kw, dtype, seed=31, n_seq=len(lengths))
    packed, new_tails = kda_prep(*x, xb, conv, a_log, dt_bias, tails, cu_seqlens(lengths, "cpu"), num_heads=h,
                                 head_dim=d, gate=gate, gate_lower_bound=-5.0, l2norm_eps=1e-6,
                                 max_len=max(lengths), block_t=block_t)
    ref, ref_tails = reference_prep(x, xb, conv, a_log, dt_bias, tails, lengths, h, d, gate, -5.0)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    for name, got in zip(("q", "k", "v", "g", "beta"), unpack(packed, h, d)):
        assert rel_err(got, ref[name]) <= tol, name
    for got, want in zip(new_tails, ref_tails):
        assert got.dtype == dtype and torch.equal(got, want)


# ---- decode and output ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, gate, split", [(torch.float32, "safe", True), (torch.bfloat16, "softplus", False)])
def test_fused_decode_step(dtype, gate, split):
    b, h, d, kw = 3, 2, 64, 4
    x, xb, conv, a_log, dt_bias, tails = prep_inputs(b, h, d, kw, dtype, seed=41, n_seq=b)
    xg = rnd(b, h * d, seed=50).to(dtype)
    nw = rnd(d, seed=51) * 0.1 + 1.0
    s0 = rnd(b, h, d, d, seed=52, scale=0.5)
    ref, ref_tails = reference_prep(x, xb, conv, a_log, dt_bias, tails, [1] * b, h, d, gate, -5.0)
    o_r, s_r = kda_recurrent(*(ref[n][:, None] for n in ("q", "k", "v", "g", "beta")), initial_state=s0)
    y_r = rms_norm(o_r[:, 0], nw, 1e-5) * torch.sigmoid(xg.float().unflatten(-1, (h, d)))
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    state = s0.clone()
    tails_in = [t.clone() for t in tails]
    # fused output norm: one program per head looping over V slices of 16 (4 slices: the prefetch chain runs)
    y, new_tails, new_state = kda_decode(*x, xb, xg, conv, a_log, dt_bias, nw, tails_in, state, num_heads=h,
                                         head_dim=d, gate=gate, gate_lower_bound=-5.0, l2norm_eps=1e-6,
                                         norm_eps=1e-5, inplace=True, decode_block_v=16)
    assert new_state is state and rel_err(state, s_r) <= 1e-5 * (1 if dtype == torch.float32 else 100)
    assert rel_err(y.float(), y_r.flatten(-2)) <= tol and y.dtype == dtype
    for got, want in zip(new_tails, ref_tails):
        assert torch.equal(got, want)
    # unfused output (V split over programs, or looped): the fp32 o itself; out of place, then in place
    dec = dict(decode_split=split, decode_block_v=32)
    o, t2, s2 = kda_decode(*x, xb, None, conv, a_log, dt_bias, None, tails, s0, num_heads=h, head_dim=d, gate=gate,
                           gate_lower_bound=-5.0, l2norm_eps=1e-6, norm_eps=1e-5, fuse_out=False, **dec)
    assert o.dtype == torch.float32 and rel_err(o, o_r[:, 0].flatten(-2)) <= tol and torch.equal(s2, state)
    assert all(torch.equal(a_, b_) for a_, b_ in zip(t2, ref_tails))
    s3, t3 = s0.clone(), [t.clone() for t in tails]
    o3, t3r, s3r = kda_decode(*x, xb, None, conv, a_log, dt_bias, None, t3, s3, num_heads=h, head_dim=d, gate=gate,
                              gate_lower_bound=-5.0, l2norm_eps=1e-6, norm_eps=1e-5, fuse_out=False, inplace=True,
                              **dec)
    assert s3r is s3 and torch.equal(s3, state) and torch.equal(o3, o)
    assert all(a_ is b_ and torch.equal(a_, c_) for a_, b_, c_ in zip(t3r, t3, ref_tails))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_norm_gate(dtype):
    m, h, d = 7, 3, 64
    o = rnd(m, h, d, seed=61)
    gate = rnd(m, h * d, seed=62).to(dtype)
    nw = rnd(d, seed=63) * 0.1 + 1.0
    y = kda_out(o, gate, nw, 1e-5)
    want = rms_norm(o, nw, 1e-5) * torch.sigmoid(gate.float().unflatten(-1, (h, d)))
    assert y.dtype == dtype and rel_err(y.float(), want.flatten(-2)) <= (1e-6 if dtype == torch.float32 else 5e-3)


# ---- plans and emitters ------------------------------------------------------------------------------------------
def test_plan_comes_from_the_target():
    p_amd = kda_plan(128, "bf16", get_target("mi355x"))
    p_nv = kda_plan(128, "bf16", get_target("h200"))
    assert p_amd.chunk == p_nv.chunk == 16
    assert p_amd.block_v == p_nv.block_v == 64 and kda_plan(32, "bf16", get_target("h200")).block_v == 32
    assert p_nv.chunk_warps == 4 and p_nv.decode_warps == 4 and p_amd.decode_warps == 2     # 128 threads each
    assert p_nv.intra_warps == 2 and kda_plan(128, "bf16", get_target("h200"), chunk=32).intra_warps == 8
    assert kda_plan(128, "fp32", get_target("h200")).dot == "ieee" and p_nv.dot == "bf16"
    with pytest.raises(CodegenError):
        kda_plan(96, "bf16", get_target("h200"))          # not a power of two
    with pytest.raises(CodegenError):
        kda_plan(128, "bf16", get_target("h200"), chunk=64)
    ki = emit_kda_intra(96, 128, target=get_target("h200"), plan=p_nv)
    kx = emit_kda_inter(96, 128, target=get_target("h200"), plan=p_nv)
    assert ki.grid == ("cdiv(T_MAX, BT)", "N * H") and kx.grid == ("D // BV", "N * H")
    assert kx.name.startswith("k3c_kda_inter_fwd_h96_d128_bt16_bv64_w4") and "bf16" in ki.signature["ko"]
