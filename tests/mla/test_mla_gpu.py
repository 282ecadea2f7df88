"""The MLA kernels compiled for the GPU at hand (not the interpreter): the same checks as test_mla_kernels.py on
CUDA tensors, plus a K3-shaped decode (576-wide latent, 96 and 12 heads) against a float64 oracle."""
from __future__ import annotations

import pytest
import torch

from k3c.runtime.executor import LayerCaches
from k3c import reference as ref
from k3c.runtime.kernel_impls import mla as rt
from mlautil import TOL, layer_setup, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sublayer_modes_equal_reference(dtype):
    cfg, w, wa, attrs, gen = layer_setup(dtype)
    w = {k: v.cuda() for k, v in w.items()}
    wa = {k: v.cuda() for k, v in wa.items()}
    B, D = 3, 48
    xs = [torch.randn(B, t, D, generator=gen).to(dtype).cuda() for t in (150, 70, 1, 3)]
    want, cache = [], None
    for x in xs:
        y, cache = ref.mla_layer(x, w, cfg, cache)
        want.append(y)
    for mode in ("mqa", "mha"):
        lc = LayerCaches(1)
        for x, y_ref in zip(xs, want):
            y = rt.launch_mla_absorbed({**attrs, "mode": mode, "prefill_chunk": 64}, lc, (x,), wa)
            assert rel(y, y_ref) <= TOL[dtype], (mode, x.shape)


@pytest.mark.parametrize("heads,tq", [(96, 1), (12, 1), (12, 4)])
def test_gpu_k3_decode(heads, tq):
    g = torch.Generator().manual_seed(heads)
    B, L, R, ps = 3, 512, 64, 64
    lens = [1000, 64 * 7 + 5, 3000]
    pages = -(-max(lens) // ps)
    bt = torch.randperm(B * pages + 2, generator=g)[: B * pages].view(B, pages).to(torch.int32)
    pool = torch.randn(B * pages + 2, ps, L + R, generator=g).bfloat16()
    q = torch.randn(B, tq * heads, L + R, generator=g).bfloat16()
    store = rt.LatentStore(pool.cuda(), bt.cuda(), lens)
    out = rt.mqa_decode(q.cuda(), store, rt.lens_tensor(lens, "cuda"), 0.072, L, num_heads=heads,
                        out_dtype=torch.float32).cpu()
    for b in range(B):
        n = lens[b]
        lat = pool[bt[b, torch.arange(n) // ps].long(), torch.arange(n) % ps].double()
        s = q[b].double() @ lat.T * 0.072
        qpos = n - tq + torch.arange(tq * heads) // heads
        s = s.masked_fill(torch.arange(n)[None, :] > qpos[:, None], float("-inf"))
        want = torch.softmax(s, -1) @ lat[:, :L]
        assert rel(out[b], want) <= 1e-2
