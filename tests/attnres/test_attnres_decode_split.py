"""The decode form of AttnRes phase 1 (D split across programs, f32 workspace, partials summed in a fixed order)
against the reference and the row-tile form, on random inputs (interpreter on a CPU), and which form the runtime
picks for how many token rows."""
import pytest
import torch

from k3c.codegen.kernels.attnres import SPLIT_MAX_M, emit_attnres_phase1_split, phase1_split_plan
from k3c.codegen.targets import get_target
from k3c.ir.attnres_ops import STATS
from k3c.runtime.kernel_impls import attnres as ka
from k3c.reference.attnres import attn_res_partial, attn_res_query

from .test_attnres_ops import EPS, NORM_EPS, make, naive, rel

# hidden sizes, not powers of two: 600 = 38 slices of 16 columns, i.e. two rounds of the 32-slice partial sum (for
# M = 5, Q = 3 only: the interpreter's time grows with the programs); else 136 = 9 slices
def dim(m, q):
    return 600 if (m, q) == (5, 3) else 136



@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("q", [3, 18])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_split_matches_reference(m, n, q, dtype, tol):
    d = dim(m, q)
    blocks, proj, norm, *_ = make(n, q, (m,), d, dtype, seed=1000 * m + 10 * n + q)
    queries = ka.fold_queries(list(zip(proj, norm)))
    s1 = ka.phase1(blocks, queries, EPS, split=True)
    assert s1.shape == (q, m, STATS + d) and s1.dtype == dtype
    lse = ka.lse_view(s1)
    want_o, want_lse = [], []
    for j in range(q):
        o, mx, l = attn_res_partial(blocks, attn_res_query(proj[j], norm[j]), EPS)
        want_o.append(o)
        want_lse.append((mx + l.log())[..., 0])
    assert rel(s1[..., STATS:], torch.stack(want_o)) <= tol
    assert rel(lse, torch.stack(want_lse)) <= 1e-5
    # the same packed result as the row-tile form (scores summed in another order: not bit for bit in fp32)
    tiles = ka.phase1(blocks, queries, EPS, split=False)
    assert rel(ka.lse_view(tiles), lse) <= 1e-5
    assert rel(tiles[..., STATS:], s1[..., STATS:]) <= (1e-5 if dtype == torch.float32 else 1e-2)
    # deterministic: a second run is bit for bit the same (what a CUDA-graph replay is checked against)
    again = ka.phase1(blocks, queries, EPS, split=True)              # (the pad after lse is never written)
    assert torch.equal(ka.lse_view(again), lse) and torch.equal(again[..., STATS:], s1[..., STATS:])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_split_then_phase2_equals_naive(dtype, tol):
    """Decode (4 sequences, one token each) through both phases against the naive mix + RMSNorm."""
    n, q = 2, 5
    blocks, proj, norm, p_old, y, gain = make(n, q, (4, 1), 48, dtype, seed=11)
    queries = ka.fold_queries(list(zip(proj, norm)))
    s1 = ka.phase1(blocks, queries, EPS)
    for j in (0, q - 1):
        r = ka.phase2(s1, queries, j, EPS, partial=p_old, update=y, weight=gain, norm_eps=NORM_EPS)
        assert torch.equal(r[0], p_old + y)
        assert rel(r[1], naive(blocks, p_old + y, proj[j], norm[j], gain)) <= tol


def test_runtime_picks_split_for_few_rows(monkeypatch):
    names = []
    real = ka.launch

    def spy(ks, *args, binding=None):
        names.append(ks.name)
        return real(ks, *args, binding=binding)

    monkeypatch.setattr(ka, "launch", spy)
    blocks, proj, norm, *_ = make(2, 3, (SPLIT_MAX_M,), 32, torch.float32, seed=3)
    queries = ka.fold_queries(list(zip(proj, norm)))
    ka.phase1(blocks, queries, EPS)
    assert [k.split("_fwd")[0] for k in names] == ["k3c_attnres_phase1_split_scores", "k3c_attnres_phase1_split_out"]
    names.clear()
    more = [torch.cat([b, b[:1]]) for b in blocks]                  # SPLIT_MAX_M + 1 rows: the row-tile form
    got = ka.phase1(more, queries, EPS)
    assert [k.split("_fwd")[0] for k in names] == ["k3c_attnres_phase1_scores", "k3c_attnres_phase1_out"]
    want = ka.phase1(blocks, queries, EPS)
    assert rel(got[:, :SPLIT_MAX_M, STATS:], want[..., STATS:]) <= 1e-5
    assert rel(ka.lse_view(got)[:, :SPLIT_MAX_M], ka.lse_view(want)) <= 1e-5


def test_k3_decode_plan():
    """K3 (d = 7168, Q = 7-24): 112 slices of 64 columns, 16-row tiles: 112 programs at batch 1, 224 at 32
    (the row-tile form: one program walking all of d)."""
    for tname in ("h200", "mi355x"):
        t = get_target(tname)
        bm, ds, bk, ns, sb, bd, qp = phase1_split_plan(7168, 9, 2, t)
        assert (bm, ds, bk, ns, sb, qp) == (16, 64, 64, 112, 32, 16)
        part, fin = emit_attnres_phase1_split(7168, 2, 9, 1e-5, target=t)
        assert part.grid == ("NS", "cdiv(M, BLOCK_M)") and fin.grid == ("M", "cdiv(D, BLOCK_D)")
        assert part.name == "k3c_attnres_phase1_split_scores_fwd_d7168_n2_q9_bf16_m16_s64_w4"
        assert "tl.atomic" not in part.source and "tl.atomic" not in fin.source
        assert "[interpreter variant]" not in part.source
