"""The AttnRes kernels compiled for the GPU at K3's hidden size (skipped without CUDA)."""
import pytest
import torch

from k3c.runtime.kernel_impls import attnres as ka
from k3c.reference.attnres import attn_res_mix
from k3c.reference.norms import rms_norm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,q", [(1, 23), (8, 24)])
def test_kernels_k3_shapes(dtype, tol, n, q):
    g = torch.Generator().manual_seed(n)
    d, t = 7168, 300
    blocks = [(torch.randn(t, d, generator=g) * (1 + i)).to(dtype).cuda() for i in range(n)]
    proj = [(torch.randn(d, generator=g) * 0.05).cuda() for _ in range(q)]
    norm = [(1 + 0.1 * torch.randn(d, generator=g)).cuda() for _ in range(q)]
    p_old, y = (torch.randn(t, d, generator=g).to(dtype).cuda() for _ in range(2))
    gain = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).cuda()
    queries = ka.fold_queries(list(zip(proj, norm)))
    s1 = ka.phase1(blocks, queries, 1e-5)
    for j in (0, q - 1):
        r = ka.phase2(s1, queries, j, 1e-5, partial=p_old, update=y, weight=gain, norm_eps=1e-5)
        want = rms_norm(attn_res_mix(blocks + [p_old + y], proj[j], norm[j], 1e-5), gain, 1e-5)
        err = ((r[1].double() - want.double()).norm() / want.double().norm()).item()
        assert err <= tol, err
        assert torch.equal(r[0], p_old + y)
