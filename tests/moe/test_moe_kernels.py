"""The MoE kernels through the Triton interpreter: routing (exactly the torch routing, stable permutation), grouped
expert GEMMs + combine against the reference routed experts with the same (dequantized) weights, bf16 and fp32,
empty experts, one expert taking every token, odd token counts, both activations; MXFP4 upcast and native
(dot_scaled, activations quantized per 32) paths; the dense MXFP4 GEMM. (Expert parallelism: test_moe_lower.py.)"""
from __future__ import annotations

import pytest
import torch

from k3c.codegen.kernels import moe as KM
from k3c.codegen.kernels.moe import moe_gemm_plan
from k3c.codegen.targets import get_target
from k3c.frontend.spec import ActivationSpec
from k3c.quant import mxfp4_dequantize, mxfp4_quantize, mxfp8_dequantize, mxfp8_quantize
from k3c import reference as ref
from k3c.runtime.kernel_impls import moe as M

SITU = ActivationSpec("situ", 4.0, 25.0)
SWIGLU = ActivationSpec("swiglu")


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def experts(e, m, z, dtype, gen):
    def w(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)
    return w(e, m, z), w(e, m, z), w(e, z, m)


def run_experts(z, w13, w2, wt, ids, off, perm, k, act, mx="none", plan=None):
    h = M.grouped_gemm("gate_up", z, w13, off, perm, top_k=k, mx=mx, act=act, plan=plan)
    y = M.grouped_gemm("down", h, w2, off, perm, top_k=k, mx=mx)
    return M.combine(y, wt, ids, top_k=k, num_experts=off.shape[1] - 1)


@pytest.mark.parametrize("act, bias, n, ep", [("sigmoid", True, 7, (0, 1)), ("softmax", False, 33, (0, 1)),
                                              ("sigmoid", True, 9, (1, 2))])
def test_routing_equals_torch(act, bias, n, ep):
    g = torch.Generator().manual_seed(n)
    e, k = 12, 4
    lg = torch.randn(n, e, generator=g)
    b = torch.randn(e, generator=g) * 0.3 if bias else None
    kw = dict(top_k=k, router_activation=act, renormalize=bias, scaling=2.5, ep_rank=ep[0], ep_size=ep[1])
    got, want = M.route(lg, b, **kw), M.torch_route(lg, b, **kw)
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
    for gi, wi in zip(got[1:], want[1:]):
        assert torch.equal(gi.reshape(-1), wi.reshape(-1).to(gi.dtype))
    # the permutation lists every local slot once, grouped by expert, in slot order within an expert
    ids = got[1].reshape(-1).long()
    lo, el = ep[0] * e // ep[1], e // ep[1]
    local = ((ids >= lo) & (ids < lo + el)).nonzero().flatten()
    perm = got[3][:local.numel()].long()
    assert sorted(perm.tolist()) == local.tolist() and torch.all(got[3][local.numel():] == -1)
    assert torch.all(ids[perm][1:] >= ids[perm][:-1])


@pytest.mark.parametrize("case, dtype, tol", [("odd", torch.bfloat16, 1e-2), ("odd", torch.float32, 1e-5),
                                              ("one_expert_everywhere", torch.bfloat16, 1e-2),
                                              ("empty_experts", torch.float32, 1e-5)])
def test_grouped_experts_equal_reference(case, dtype, tol):
    g = torch.Generator().manual_seed(1)
    t, e, k, z, m = {"odd": (7, 6, 3, 32, 48), "one_expert_everywhere": (5, 4, 2, 32, 32),
                     "empty_experts": (3, 16, 2, 48, 32)}[case]
    lg = torch.randn(t, e, generator=g)
    if case == "one_expert_everywhere":
        lg[:, 2] += 50.0                                   # expert 2 in every token's top-k
    act = SITU if case != "odd" else SWIGLU
    wt, ids, off, perm = M.route(lg, None, top_k=k)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=e)
    if case == "one_expert_everywhere":
        assert counts[2] == t
    if case == "empty_experts":
        assert (counts == 0).sum() >= e - t * k
    x = torch.randn(t, z, generator=g).to(dtype)
    w1, w3, w2 = experts(e, m, z, dtype, g)
    got = run_experts(x, [w1, w3], [w2], wt, ids, off, perm, k, act)
    want = ref.routed_experts(x, w1, w3, w2, wt, ids.long(), act)
    assert rel(got, want) <= tol


UPCAST_FORMS = {"joined": dict(gemv=0), "gemv1": dict(gemv=1), "gemv2": dict(gemv=2), "dequant": dict(dequant=True),
                "swap": dict(gemv=0, swap=True)}


@pytest.mark.parametrize("form", list(UPCAST_FORMS))
def test_mxfp4_upcast_equals_reference_on_dequantized_weights(form, monkeypatch):
    g = torch.Generator().manual_seed(2)
    t, e, k, z, m = 5, 3, 2, 64, 64
    wt, ids, off, perm = M.route(torch.randn(t, e, generator=g), None, top_k=k)
    x = torch.randn(t, z, generator=g).to(torch.bfloat16)
    qs = [mxfp4_quantize(w) for w in experts(e, m, z, torch.float32, g)]
    d1, d3, d2 = (mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs)
    # dequant: a workspace of two experts' gate/up weights, so the 3 experts run in two chunks (2 + 1)
    monkeypatch.setattr(KM, "DEQUANT_WORKSPACE_BYTES", 2 * 2 * m * z * 2)
    # two N tiles and two K steps per program: the nibble / scale indexing across tiles (gemv2 with 3-4 rows per
    # expert: a full and a partial row group)
    cpu = get_target("cpu")
    pg = moe_gemm_plan("gate_up", m, z, 1, "upcast", "bf16", cpu, block_n=32, block_k=32, **UPCAST_FORMS[form])
    pd = moe_gemm_plan("down", z, m, 1, "upcast", "bf16", cpu, block_n=32, block_k=32, **UPCAST_FORMS[form])
    assert (pg.dequant, pg.gemv, pg.joined, pg.swap) == (
        form == "dequant", int(form[-1]) if "gemv" in form else 0, form in ("joined", "swap"), form == "swap")
    h = M.grouped_gemm("gate_up", x, [*qs[0], *qs[1]], off, perm, top_k=k, mx="upcast", act=SITU, plan=pg)
    y = M.grouped_gemm("down", h, [*qs[2]], off, perm, top_k=k, mx="upcast", plan=pd)
    got = M.combine(y, wt, ids, top_k=k, num_experts=e)
    assert rel(got, ref.routed_experts(x, d1, d3, d2, wt, ids.long(), SITU)) <= 1e-2


@pytest.mark.parametrize("form", ["gemv2", "dequant"])
def test_mxfp4_dense_forms(form):
    """The dense MXFP4 x bf16 GEMM in the GEMV form (5 rows: groups of 2, the last partial) and the dequant form."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    p, s = mxfp4_quantize(torch.randn(48, 64, generator=g))
    plan = moe_gemm_plan("dense", 48, 64, 5, "upcast", "bf16", get_target("cpu"), block_k=32, **UPCAST_FORMS[form])
    got = M.mx_linear(a, p, s, mx="upcast", plan=plan)
    assert rel(got, a.float() @ mxfp4_dequantize(p, s, torch.float32).T) <= 5e-3


def test_upcast_default_forms_follow_the_rows():
    """The runtime's default upcast form by rows per expert (the rules the bench's sweep is meant to retune): the
    GEMV form up to GEMV_MAX_ROWS, the joined MMA form above, the dequant form from DEQUANT_MIN_ROWS."""
    h200 = get_target("h200")

    def plan(rows, mx="upcast"):    # pairs=False: the rules without the pair decode (test_pair_decode_default_plans)
        return moe_gemm_plan("gate_up", 3072, 3584, rows, mx, "bf16", h200, pairs=False)
    assert plan(1).gemv == 1 and plan(3).gemv == (4 if KM.GEMV_MAX_ROWS >= 3 else 0)
    assert plan(KM.GEMV_MAX_ROWS + 1).gemv == 0 and plan(KM.GEMV_MAX_ROWS + 1).joined
    assert plan(KM.DEQUANT_MIN_ROWS).dequant and not plan(KM.DEQUANT_MIN_ROWS - 1).dequant
    assert not any(p.dequant or p.gemv or p.joined for p in (plan(1, "e4m3"), plan(4096, "e4m3"), plan(1, "none")))


def test_mxfp4_native_dot_scaled_quantizes_activations_like_k3c_quant():
    """The native path (mi355x / b200): activations quantized to MXFP8 (or MXFP4) per 32 in registers,
    tl.dot_scaled; equals the product of k3c.quant's quantized activations and the dequantized weights."""
    g = torch.Generator().manual_seed(3)
    m, n, kd = 9, 48, 96
    a = torch.randn(m, kd, generator=g).to(torch.bfloat16)
    p, s = mxfp4_quantize(torch.randn(n, kd, generator=g))
    got = M.mx_linear(a, p, s, mx="e4m3")
    aq = mxfp8_dequantize(*mxfp8_quantize(a), torch.float32)
    want = aq @ mxfp4_dequantize(p, s, torch.float32).T
    assert rel(got, want) <= 5e-3                          # bf16 output rounding only
    a4 = mxfp4_dequantize(*mxfp4_quantize(a), torch.float32)  # MXFP4 activations: the kind::mxf4 form on sm_100
    assert rel(M.mx_linear(a, p, s, mx="e2m1"), a4 @ mxfp4_dequantize(p, s, torch.float32).T) <= 5e-3
    assert rel(M.mx_linear(a, p, s, mx="upcast"), a.float() @ mxfp4_dequantize(p, s, torch.float32).T) <= 5e-3


@pytest.mark.parametrize("case", ["odd", "one_expert_everywhere", "empty_experts"])
@pytest.mark.parametrize("form", ["pairs1", "pairs1_swap"])
def test_pair_decode_plans_equal_reference(case, form):
    """The decode-row plans of the pair decode (CUDA: E2M1_PAIRS(1)_OPS, checked bit for bit in
    test_moe_pairs_decode.py) through the launcher: on the interpreter the same plan runs the portable decode, so this
    checks the plan plumbing, the scale check and (swap) the transposed MMA and epilogue on random inputs."""
    import dataclasses

    g = torch.Generator().manual_seed(5)
    t, e, k, z, m = {"odd": (7, 6, 3, 64, 96), "one_expert_everywhere": (5, 4, 2, 64, 64),
                     "empty_experts": (3, 16, 2, 96, 64)}[case]
    lg = torch.randn(t, e, generator=g)
    if case == "one_expert_everywhere":
        lg[:, 2] += 50.0
    wt, ids, off, perm = M.route(lg, None, top_k=k)
    x = torch.randn(t, z, generator=g).to(torch.bfloat16)
    qs = [mxfp4_quantize(w) for w in experts(e, m, z, torch.float32, g)]
    d1, d3, d2 = (mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs)
    cpu = get_target("cpu")
    kw = dict(gemv=0, block_n=32, block_k=32, swap=form.endswith("swap"))
    pg, pd = (dataclasses.replace(moe_gemm_plan(kind, a, b, 1, "upcast", "bf16", cpu, **kw), pairs=True, one_mul=True)
              for kind, a, b in (("gate_up", m, z), ("down", z, m)))
    assert pg.tag.startswith("pairs1") and pg.swap == form.endswith("swap")
    h = M.grouped_gemm("gate_up", x, [*qs[0], *qs[1]], off, perm, top_k=k, mx="upcast", act=SITU, plan=pg)
    y = M.grouped_gemm("down", h, [*qs[2]], off, perm, top_k=k, mx="upcast", plan=pd)
    got = M.combine(y, wt, ids, top_k=k, num_experts=e)
    assert rel(got, ref.routed_experts(x, d1, d3, d2, wt, ids.long(), SITU)) <= 1e-2


def test_one_mul_scale_check():
    """scales_fit_one_mul: <= PAIRS1_MAX_SCALE everywhere, remembered per tensor, re-checked after an in-place write."""
    s = torch.full((4, 8), KM.PAIRS1_MAX_SCALE, dtype=torch.uint8)
    assert M.scales_fit_one_mul([s])
    s[1, 3] = KM.PAIRS1_MAX_SCALE + 1
    assert not M.scales_fit_one_mul([s])
    assert not M.scales_fit_one_mul([torch.zeros(2, dtype=torch.uint8), s])
    s.fill_(3)
    assert M.scales_fit_one_mul([s])


def test_pair_decode_default_plans():
    """Decode rows on CUDA with bf16 activations default to the pair decode (one multiply); with pairs=False, on
    other targets and with fp16 activations the rules of test_upcast_default_forms_follow_the_rows apply."""
    h200 = get_target("h200")

    def plan(rows, t=h200, dt="bf16", **kw):
        return moe_gemm_plan("down", 3584, 3072, rows, "upcast", dt, t, **kw)
    for rows in (1, 2, KM.PAIRS_MAX_ROWS):
        p = plan(rows)
        assert p.pairs and p.one_mul and p.joined and not p.gemv and p.block_m == 16
    assert not plan(KM.PAIRS_MAX_ROWS + 1).pairs
    assert plan(1, pairs=False).gemv == 1 and not plan(2, pairs=False).pairs
    assert not plan(1, get_target("mi300x")).pairs and not plan(1, dt="fp16").pairs
    assert plan(1, gemv=1).gemv == 1 and not plan(1, gemv=1).pairs
