"""The lanes form of the upcast MXFP4 grouped expert GEMM (k3c.codegen.kernels.moe_lanes) and its load-time payload
layout (k3c.runtime.kernel_impls.moe_layout): to_lanes / from_lanes as inverses and as the layout's definition, the
perm decode's PTX op list (run in Python with PTX semantics, test_moe_pairs_decode.run_ops) on words of the lanes
layout against k3c.quant's dequantization, the lanes kernels through the Triton interpreter against the reference
routed experts and the joined upcast form (canonical payloads must come out wrong), the plan rules, and the sm_90
cross-compile (wgmma with the decoded weights as the register A operand, the perm decode's PTX, no spills)."""
from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

from k3c import reference as ref
from k3c.codegen.kernels import moe as KM
from k3c.codegen.kernels import moe_lanes as KL
from k3c.codegen.kernels.moe import GroupedGemm, emit_moe_gemm, gemm_kernel_name, moe_gemm_plan
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError
from k3c.quant import mxfp4_dequantize, mxfp4_quantize
from k3c.runtime.kernel_impls import moe as M
from k3c.runtime.kernel_impls.moe_layout import from_lanes, perm_words, to_lanes

from . import test_bench_moe_forms as bench_forms_tests
from .test_moe_kernels import SITU, rel
from .test_moe_pairs_decode import run_ops

K3_SHAPES = (("gate_up", 3072, 3584), ("down", 3584, 3072))


# ---- 1. the layout transform and its inverse -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 192), (2, 3, 4, 128), (1, 256)])
def test_lanes_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape))
    p = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    keep = p.clone()
    stored = to_lanes(p)
    assert stored.shape == p.shape and stored.dtype == torch.uint8 and stored.data_ptr() != p.data_ptr()
    assert torch.equal(p, keep)                                  # not in place: the input is untouched
    assert not torch.equal(stored, p)                            # not the identity
    back = from_lanes(stored)
    assert torch.equal(back, p) and back.data_ptr() != stored.data_ptr()
    # from_lanes is not the same map as to_lanes (the round trip is not twice the same permutation by accident)
    assert not torch.equal(from_lanes(p), stored)
    # in place: the same tensor object, rewritten to the same bytes; and back
    q = p.clone()
    ptr = q.data_ptr()
    r = to_lanes(q, in_place=True)
    assert r is q and q.data_ptr() == ptr and torch.equal(q, stored)
    r = from_lanes(q, in_place=True)
    assert r is q and q.data_ptr() == ptr and torch.equal(q, p)
    # a non-contiguous input is fine out of place (same bytes as its contiguous copy)
    if p.numel() > p.shape[-1]:
        nc = torch.stack([p, torch.zeros_like(p)], dim=-2)[..., 0, :]
        assert not nc.is_contiguous() and torch.equal(to_lanes(nc), stored)


def test_lanes_slabs_match_one_shot(monkeypatch):
    """The in-place rewrite goes slab by slab (bounded temporaries): slabs of a few rows give the same bytes."""
    from k3c.runtime.kernel_impls import moe_layout

    g = torch.Generator().manual_seed(3)
    p = torch.randint(0, 256, (4, 9, 128), dtype=torch.uint8, generator=g)
    want = to_lanes(p)
    monkeypatch.setattr(moe_layout, "_SLAB_BYTES", 128 * 8 * 4)       # 4 rows per slab, the last one partial
    q = p.clone()
    assert torch.equal(to_lanes(q, in_place=True), want) and torch.equal(from_lanes(q, in_place=True), p)


@pytest.mark.parametrize("fn", [to_lanes, from_lanes])
def test_lanes_rejects_bad_payloads(fn):
    for last in (32, 96, 100):                                    # K/2 not a multiple of 64
        with pytest.raises(ValueError):
            fn(torch.zeros(4, last, dtype=torch.uint8))
    for dt in (torch.int8, torch.int32, torch.float32, torch.bfloat16):
        with pytest.raises(ValueError):
            fn(torch.zeros(4, 64, dtype=dt))
    with pytest.raises(ValueError):
        fn(torch.zeros((), dtype=torch.uint8))
    nc = torch.zeros(64, 4, dtype=torch.uint8).T                  # [4, 64], not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        fn(nc, in_place=True)
    assert fn(nc).shape == (4, 64)                                # out of place it is fine


# ---- 2. the layout against its definition, written out independently -------------------------------------------
def lanes_by_hand(packed: torch.Tensor) -> torch.Tensor:
    """Per 64-byte group of a row: stored byte c * 16 + i <- canonical byte 4 i + c; then each aligned 4-byte word
    (little endian) with stored bit b <- bit pairs_perm_bit_map()[b] of that word. Plain Python, one bit at a time."""
    bit_map = KL.pairs_perm_bit_map()
    out = []
    for row in packed.reshape(-1, packed.shape[-1]).tolist():
        moved = [0] * len(row)
        for g0 in range(0, len(row), 64):
            for c in range(4):
                for i in range(16):
                    moved[g0 + c * 16 + i] = row[g0 + 4 * i + c]
        stored = []
        for w0 in range(0, len(moved), 4):
            word = moved[w0] | moved[w0 + 1] << 8 | moved[w0 + 2] << 16 | moved[w0 + 3] << 24
            new = 0
            for b in range(32):
                new |= ((word >> bit_map[b]) & 1) << b
            stored += [(new >> (8 * t)) & 0xFF for t in range(4)]
        out.append(stored)
    return torch.tensor(out, dtype=torch.uint8).reshape(packed.shape)


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 192)])
def test_lanes_layout_is_its_definition(shape):
    g = torch.Generator().manual_seed(7)
    p = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    assert torch.equal(to_lanes(p), lanes_by_hand(p))
    assert torch.equal(from_lanes(lanes_by_hand(p)), p)


def test_lanes_layout_moves_single_bits():
    """A canonical row with one bit set (each of its 512 in turn) gives one bit set, where the definition puts it."""
    bit_map = KL.pairs_perm_bit_map()
    assert sorted(bit_map) == list(range(32)) and list(bit_map) != list(range(32))
    canon_to_stored = {c: s for s, c in enumerate(bit_map)}
    rows = torch.zeros(512, 64, dtype=torch.uint8)
    idx = torch.arange(512)
    rows[idx, idx // 8] = (1 << (idx % 8)).to(torch.uint8)
    stored = to_lanes(rows)
    for bit in range(512):
        byte, t = divmod(bit, 8)
        i, c = divmod(byte, 4)                                    # canonical byte 4 i + c -> stored byte c * 16 + i
        sb = c * 16 + i
        w, j = divmod(sb, 4)
        s = canon_to_stored[8 * j + t]
        want = torch.zeros(64, dtype=torch.uint8)
        want[4 * w + s // 8] = 1 << (s % 8)
        assert torch.equal(stored[bit], want), bit


# ---- 3. the perm decode's PTX op list -------------------------------------------------------------------------------
LANES_FORMS = types.SimpleNamespace(pairs_perm_words=perm_words, E2M1_PAIRS_PERM_OPS=KL.E2M1_PAIRS_PERM_OPS,
                                    E2M1_PAIRS1_PERM_OPS=KL.E2M1_PAIRS1_PERM_OPS)


@pytest.mark.parametrize("ops, scales", [("E2M1_PAIRS_PERM_OPS", range(0, 128)),
                                         ("E2M1_PAIRS_PERM_OPS", range(128, 255)),
                                         ("E2M1_PAIRS1_PERM_OPS", range(0, KM.PAIRS1_MAX_SCALE + 1))])
def test_perm_decode_ops_equal_dequantize_bitwise(ops, scales):
    """test_bench_moe_forms' check (every byte value at every position of a word, random words, every scale the
    decode is used for; bit for bit against mxfp4_dequantize), pointed at k3c's op lists and bit step."""
    bench_forms_tests.test_perm_pairs_decode_equals_dequantize_bitwise(LANES_FORMS, ops, scales)


def test_perm_words_is_the_bit_step_of_to_lanes():
    """to_lanes = the byte move of the definition, then perm_words (the bits of each word)."""
    p = torch.randint(0, 256, (3, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    moved = p.reshape(3, 2, 16, 4).transpose(-1, -2).reshape(3, 128)     # byte c * 16 + i <- 4 i + c
    assert torch.equal(to_lanes(p), perm_words(moved))


@pytest.mark.parametrize("ops, top", [("E2M1_PAIRS_PERM_OPS", 254), ("E2M1_PAIRS1_PERM_OPS", KM.PAIRS1_MAX_SCALE)])
def test_perm_decode_of_lanes_rows_is_the_dequantized_row(ops, top):
    """The decode as the kernel applies it to to_lanes output: stored word w of lane c in a 128-K group, with the
    scale of 32-block w, gives in register $j the bf16x2 K pair of canonical byte 16 w + 4 j + c (K = 2 (4 i + c) +
    half, i = 4 w + j): the dequantized row, bit for bit, for every byte value at every position of the group."""
    g = torch.Generator().manual_seed(6)
    R = 512
    base = torch.arange(256, dtype=torch.int64)
    canon = torch.cat([(base[:, None] + 37 * torch.arange(64)) % 256,            # every value at every byte
                       torch.randint(0, 256, (R - 256, 64), generator=g)]).to(torch.uint8)
    scales = torch.randint(0, top + 1, (R, 4), generator=g)
    scales[:4] = torch.tensor([0, 1, 127, top])                                   # the ends of the range
    stored = to_lanes(canon).to(torch.int64).reshape(R, 4, 4, 4)                  # [row, lane c, word w, byte]
    words = (stored << torch.tensor([0, 8, 16, 24])).sum(-1)                      # [R, c, w]
    sc = scales[:, None, :].expand(R, 4, 4)                                       # word w: block w's scale
    out = run_ops(getattr(KL, ops), {"$4": words.reshape(-1), "$5": sc.reshape(-1)})
    regs = torch.stack([out[f"${j}"] for j in range(4)], dim=-1).reshape(R, 4, 4, 4)   # [R, c, w, j]
    got = torch.zeros(R, 64, dtype=torch.int64)
    for c in range(4):
        for w in range(4):
            for j in range(4):
                got[:, 16 * w + 4 * j + c] = regs[:, c, w, j]
    got = torch.stack([got & 0xFFFF, got >> 16], dim=-1).reshape(R, 128)
    want = mxfp4_dequantize(canon, scales.to(torch.uint8), torch.bfloat16)
    want = want.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(got, want)


def test_perm_asm_text_is_the_ops():
    for ops, text in ((KL.E2M1_PAIRS_PERM_OPS, KL.E2M1_PAIRS_PERM_ASM),
                      (KL.E2M1_PAIRS1_PERM_OPS, KL.E2M1_PAIRS1_PERM_ASM)):
        assert text.count(";") == len(ops) + 1 and text.count("prmt.b32") == 4
        assert text.count("shf.r.wrap.b32") == 2 and "shl.b32" in text
    assert KL.E2M1_PAIRS1_PERM_ASM.count("mul.rn.bf16x2") == 4 and "max.u16x2" not in KL.E2M1_PAIRS1_PERM_ASM
    assert KL.E2M1_PAIRS_PERM_ASM.count("mul.rn.bf16x2") == 8 and "max.u16x2" in KL.E2M1_PAIRS_PERM_ASM


# ---- 4. the lanes kernels through the interpreter -----------------------------------------------------------------
CASES = {"odd": (7, 6, 3, 128, 256), "empty_experts": (3, 16, 2, 128, 128), "rows64": (48, 2, 2, 128, 256)}


def _case(case, seed=5, gain=None):
    g = torch.Generator().manual_seed(seed)
    t, e, k, z, m = CASES[case]
    wt, ids, off, perm = M.route(torch.randn(t, e, generator=g), None, top_k=k)
    x = torch.randn(t, z, generator=g).to(torch.bfloat16)
    ws = [torch.randn(*s, generator=g) / s[-1] ** 0.5 for s in ((e, m, z), (e, m, z), (e, z, m))]
    if gain is not None:
        ws = [w * gain.view(-1, 1, 1) for w in ws]
    qs = [mxfp4_quantize(w) for w in ws]
    return (t, e, k, z, m), (wt, ids, off, perm), x, qs


def _experts(x, qs, routing, dims, plans, act=SITU):
    wt, ids, off, perm = routing
    _, e, k, _, _ = dims
    pg, pd = plans
    h = M.grouped_gemm("gate_up", x, [*qs[0], *qs[1]], off, perm, top_k=k, mx="upcast", act=act, plan=pg)
    y = M.grouped_gemm("down", h, [*qs[2]], off, perm, top_k=k, mx="upcast", plan=pd)
    return M.combine(y, wt, ids, top_k=k, num_experts=e)


def _plans(dims, rows, **kw):
    _, _, _, z, m = dims
    cpu = get_target("cpu")
    return (moe_gemm_plan("gate_up", m, z, rows, "upcast", "bf16", cpu, **kw),
            moe_gemm_plan("down", z, m, rows, "upcast", "bf16", cpu, **kw))


@pytest.mark.parametrize("case, block_m", [("odd", 16), ("empty_experts", 16), ("rows64", 64)])
def test_lanes_experts_equal_reference(case, block_m):
    """odd: 7 tokens, 4 N tiles of gate_up; empty experts; rows64: 64-row tiles, 128-wide N tiles, two 128-K steps
    of the down GEMM."""
    dims, routing, x, qs = _case(case)
    t, e, k, _, _ = dims
    rows = -(-t * k // e)
    if case == "empty_experts":
        assert int((torch.bincount(routing[1].reshape(-1).long(), minlength=e) == 0).sum()) >= e - t * k
    plans = _plans(dims, rows, lanes=True)
    assert all(p.lanes and p.block_m == block_m and p.tag.startswith("lanes1") for p in plans)
    if case == "rows64":
        assert plans[0].block_n == 128 and CASES[case][4] // plans[1].block_k == 2
    want = ref.routed_experts(x, *(mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs), routing[0],
                              routing[1].long(), SITU)
    lanes = [(to_lanes(p), s) for p, s in qs]
    got = _experts(x, lanes, routing, dims, plans)
    assert rel(got, want) <= 1e-2
    if case != "empty_experts":
        # the layout is read: canonical payloads through the lanes kernels are something else entirely
        assert rel(_experts(x, qs, routing, dims, plans), want) > 0.5
        # and the lanes form agrees with the joined upcast form on canonical payloads
        joined = _experts(x, qs, routing, dims, _plans(dims, rows, gemv=0, dequant=False, pairs=False))
        assert rel(got, joined) <= 1e-2


def test_lanes_exact_decode_plan_on_large_scales():
    """Scales above PAIRS1_MAX_SCALE: the one-multiply decode would overflow there, so the runtime swaps a lanes1
    plan for the two-multiply one (still lanes); an explicit one_mul=False lanes plan runs and matches the reference.
    (The interpreter runs the portable decode either way: this checks the plan plumbing.)"""
    dims, routing, x, qs = _case("odd", seed=8, gain=torch.tensor([1.0, 64.0, 1.0, 128.0, 1.0, 1.0]))
    t, e, k, z, m = dims
    assert int(max(s.max() for _, s in qs)) > KM.PAIRS1_MAX_SCALE and not M.scales_fit_one_mul([qs[0][1]])
    plans = _plans(dims, 1, lanes=True, one_mul=False, block_k=128)       # down: two K steps
    assert plans[1].block_k == 128 and m // plans[1].block_k == 2
    assert all(p.lanes and not p.one_mul and p.tag.startswith("lanes_") for p in plans)
    one = moe_gemm_plan("down", z, m, 1, "upcast", "bf16", get_target("cpu"), lanes=True)
    swapped = KM.expert_plan("down", z, m, 1, target=get_target("cpu"), mx="upcast", dtype="bf16",
                             one_mul_fits=False, plan=one)
    assert swapped == dataclasses.replace(one, one_mul=False) and swapped.lanes
    assert KM.expert_plan("down", z, m, 1, target=get_target("cpu"), mx="upcast", dtype="bf16", plan=one) == one
    want = ref.routed_experts(x, *(mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs), routing[0],
                              routing[1].long(), SITU)
    got = _experts(x, [(to_lanes(p), s) for p, s in qs], routing, dims, plans)
    assert rel(got, want) <= 1e-2


# ---- 5. plan rules ---------------------------------------------------------------------------------------------------
def test_lanes_plans_on_h200():
    h200 = get_target("h200")
    for kind, n, k in K3_SHAPES:
        p = moe_gemm_plan(kind, n, k, 1, "upcast", "bf16", h200, lanes=True)
        assert p.lanes and p.one_mul and p.tag.startswith("lanes1")
        assert (p.block_m, p.block_n, p.num_warps, p.block_k, p.num_stages) == (16, 64, 4, 256, 2), p
        q = moe_gemm_plan(kind, n, k, 128, "upcast", "bf16", h200, lanes=True)
        assert q.tag.startswith("lanes1") and (q.block_m, q.block_n, q.num_warps) == (128, 128, 8), q
        assert q.block_k % KL.LANES_GROUP_K == 0 and k % q.block_k == 0 and q.num_stages >= 2
        e = moe_gemm_plan(kind, n, k, 1, "upcast", "bf16", h200, lanes=True, one_mul=False)
        assert e.tag.startswith("lanes_") and not e.one_mul
        assert not moe_gemm_plan(kind, n, k, 1, "upcast", "bf16", h200).lanes           # not a default
        g = GroupedGemm.checked(kind, n, k, target=h200, plan=p, num_experts=896, top_k=16, mx="upcast",
                                act=SITU if kind == "gate_up" else None, interpret=False)
        assert g.lanes and g.swap and g.lanes_asm == KL.E2M1_PAIRS1_PERM_ASM and "ln1" in gemm_kernel_name(g)
        g = GroupedGemm.checked(kind, n, k, target=h200, plan=e, num_experts=896, top_k=16, mx="upcast",
                                act=SITU if kind == "gate_up" else None, interpret=False)
        assert g.lanes_asm == KL.E2M1_PAIRS_PERM_ASM
        g = GroupedGemm.checked(kind, n, k, target=h200, plan=p, num_experts=896, top_k=16, mx="upcast",
                                act=SITU if kind == "gate_up" else None, interpret=True)
        assert g.lanes and g.lanes_asm is None                                          # the portable decode


def test_lanes_plans_refused():
    h200, cpu = get_target("h200"), get_target("cpu")
    for k in (64, 192, 320):                                      # K not a multiple of 128
        for t in (h200, cpu):
            with pytest.raises(CodegenError):
                moe_gemm_plan("down", 128, k, 1, "upcast", "bf16", t, lanes=True)
    with pytest.raises(CodegenError):
        moe_gemm_plan("down", 128, 128, 1, "upcast", "fp16", h200, lanes=True)
    with pytest.raises(CodegenError):
        moe_gemm_plan("down", 128, 384, 1, "upcast", "bf16", h200, lanes=True, block_n=32)   # not 64-row tiles
    with pytest.raises(CodegenError):
        moe_gemm_plan("down", 128, 384, 1, "upcast", "bf16", h200, lanes=True, block_k=64)   # not 128-K groups
    ok = moe_gemm_plan("down", 128, 384, 1, "upcast", "bf16", h200, lanes=True)
    assert ok.block_k == 128                                     # 256 does not divide 384: the largest that does
    kw = dict(num_experts=4, top_k=2, mx="upcast", interpret=False)
    emit_moe_gemm("down", 128, 384, target=h200, plan=ok, **kw)
    with pytest.raises(CodegenError):                             # fp16 activations with a lanes plan
        emit_moe_gemm("down", 128, 384, target=h200, plan=ok, dtype="fp16", **kw)
    with pytest.raises(CodegenError):                             # BLOCK_K not dividing K
        emit_moe_gemm("down", 128, 384, target=h200, plan=dataclasses.replace(ok, block_k=256), **kw)
    with pytest.raises(CodegenError):                             # BLOCK_N not a multiple of 64 on CUDA
        emit_moe_gemm("down", 128, 384, target=h200, plan=dataclasses.replace(ok, block_n=32), **kw)
    mi300x = get_target("mi300x")
    hip_plan = moe_gemm_plan("down", 128, 128, 1, "upcast", "bf16", mi300x, lanes=True)
    with pytest.raises(CodegenError, match="hip"):
        GroupedGemm.checked("down", 128, 128, target=mi300x, plan=hip_plan, **kw)
    with pytest.raises(CodegenError, match="hip"):
        emit_moe_gemm("down", 128, 128, target=mi300x, plan=hip_plan, **kw)


# ---- 6. the sm_90 cross-compile --------------------------------------------------------------------------------------
def _first_operand_type(line: str) -> str:
    """The type of a ttng.warp_group_dot's first operand: in its signature `: A * B -> C` (after the attributes,
    which hold ` : i32` of their own), A."""
    m = re.search(r" : ((?:tensor|!ttg\.memdesc)<.*?) \* ", line)
    assert m, line
    return m.group(1)


def test_lanes_kernels_compile_for_sm90_with_register_a_operand(aot_dir):
    """K3 expert shapes (896 experts, top-k 16, SiTU), decode (rows 1) and prefill (rows 128) tiles: wgmma with the
    decoded weights as the register A operand (a #ttg.dot_op opIdx 0 tensor, not a shared-memory descriptor), the
    perm decode's rotates and bf16x2 multiplies, no spills at decode rows."""
    from k3c.codegen.aot import compile_kernels

    h200 = get_target("h200")
    ks, rows_of = [], []
    for rows in (1, 128):
        for kind, n, k in K3_SHAPES:
            plan = moe_gemm_plan(kind, n, k, rows, "upcast", "bf16", h200, lanes=True)
            ks.append(emit_moe_gemm(kind, n, k, target=h200, plan=plan, num_experts=896, top_k=16, mx="upcast",
                                    act=SITU if kind == "gate_up" else None, interpret=False))
            rows_of.append(rows)
    out = aot_dir / "h200_lanes"
    cks = compile_kernels(ks, h200, str(out), progress=False, cache=False)
    assert len(cks) == 4
    for ck, rows in zip(cks, rows_of):
        assert "ln1" in ck.name, ck.name
        if rows == 1:
            assert not ck.resources.has_spills, (ck.name, ck.resources)
        ptx = (out / ck.files["ptx"]).read_text()
        assert "wgmma" in ptx and "mul.rn.bf16x2" in ptx and "shf.r.wrap" in ptx, ck.name
        ttgir = (out / ck.files["ttgir"]).read_text()
        dots = [ln for ln in ttgir.splitlines() if re.search(r"\bttng\.warp_group_dot\b", ln)]
        assert dots, ck.name
        for ln in dots:
            a = _first_operand_type(ln)
            assert a.startswith("tensor<") and re.search(r"#ttg\.dot_op<\{opIdx = 0", a), (ck.name, ln)
            assert "!ttg.memdesc" not in a, (ck.name, ln)
