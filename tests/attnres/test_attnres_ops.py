"""Two-phase AttnRes ops at op level (random inputs): the generated Triton kernels (interpreter on a CPU) and the
eager forms of the new ops against the naive reference mix (every sublayer attending to every source)."""
import pytest
import torch

from k3c.ir.attnres_ops import STATS
from k3c.runtime.kernel_impls import attnres as ka
from k3c.reference.attnres import attn_res_mix, attn_res_query
from k3c.reference.norms import rms_norm

EPS, NORM_EPS = 1e-5, 1e-6


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make(n, q, lead, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # blocks of different scales (as residual-stream sums grow), queries large enough for peaked softmaxes
    blocks = [(torch.randn(*lead, d, generator=g) * (1 + i)).to(dtype) for i in range(n)]
    proj = [torch.randn(d, generator=g) * 0.3 for _ in range(q)]
    norm = [1 + 0.2 * torch.randn(d, generator=g) for _ in range(q)]
    p_old = torch.randn(*lead, d, generator=g).to(dtype)
    y = torch.randn(*lead, d, generator=g).to(dtype)
    gain = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    return blocks, proj, norm, p_old, y, gain


def naive(blocks, partial, proj, norm, gain):
    h = attn_res_mix(blocks + ([partial] if partial is not None else []), proj, norm, EPS)
    return rms_norm(h, gain, NORM_EPS) if gain is not None else h


CASES = [  # n blocks, q queries, lead, d
    (1, 3, (2, 5), 64),
    (3, 5, (1, 19), 48),        # d not a power of two, M not a multiple of BLOCK_M
    (5, 18, (3, 3), 40),        # more queries than one 16-wide dot tile
]


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,q,lead,d", CASES)
def test_split_equals_naive(n, q, lead, d, dtype, tol, impl):
    blocks, proj, norm, p_old, y, gain = make(n, q, lead, d, dtype, seed=n * 100 + q)
    queries = ka.fold_queries(list(zip(proj, norm)))
    assert queries.dtype == torch.float32 and queries.shape == (q, d)
    p1 = ka.phase1 if impl == "kernel" else ka.phase1_reference
    p2 = ka.phase2 if impl == "kernel" else ka.phase2_reference
    s1 = p1(blocks, queries, EPS)
    assert s1.shape == (q, *lead, STATS + d) and s1.dtype == dtype
    p_new = p_old + y
    for j in sorted({0, q // 2, q - 1}):
        # update mode: partial += y, merged, normed
        r = p2(s1, queries, j, EPS, partial=p_old, update=y, weight=gain, norm_eps=NORM_EPS)
        assert r.shape == (2, *lead, d)
        assert torch.equal(r[0], p_new)
        assert rel(r[1], naive(blocks, p_new, proj[j], norm[j], gain)) <= tol
    j = q - 1
    # source mode, no norm (the mix itself)
    h = p2(s1, queries, j, EPS, partial=p_old)
    assert rel(h, naive(blocks, p_old, proj[j], norm[j], None)) <= tol
    # none mode (a block's first sublayer: completed blocks only), with and without the norm
    h = p2(s1, queries, 0, EPS)
    assert rel(h, naive(blocks, None, proj[0], norm[0], None)) <= tol
    x = p2(s1, queries, 0, EPS, weight=gain, norm_eps=NORM_EPS)
    assert rel(x, naive(blocks, None, proj[0], norm[0], gain)) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phase1_kernel_matches_two_phase_oracle(dtype):
    """o and lse of the kernel against the reference's attn_res_partial (lse = m + log l)."""
    from k3c.reference.attnres import attn_res_partial

    blocks, proj, norm, *_ = make(4, 6, (2, 9), 56, dtype, seed=7)
    queries = ka.fold_queries(list(zip(proj, norm)))
    s1 = ka.phase1(blocks, queries, EPS)
    lse = ka.lse_view(s1)
    for j in range(6):
        o, m, l = attn_res_partial(blocks, attn_res_query(proj[j], norm[j]), EPS)
        assert rel(s1[j, ..., STATS:], o) <= (1e-5 if dtype == torch.float32 else 1e-2)
        assert rel(lse[j], (m + l.log())[..., 0]) <= 1e-5


def test_fold_query_is_w_times_gain():
    g = torch.Generator().manual_seed(3)
    w, n = torch.randn(32, generator=g).bfloat16(), torch.randn(32, generator=g).bfloat16()
    q = ka.fold_queries([(w, n)])
    assert torch.equal(q[0], w.float() * n.float())
