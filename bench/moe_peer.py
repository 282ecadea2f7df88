"""The peer of bench/moe.py, in its process: OpenAI triton_kernels' `matmul_ogs` (the copy vLLM vendors; what vLLM
runs for MXFP4 experts on Hopper), fed the same MXFP4 payloads and scales as k3c, in vLLM's Hopper recipe (weights
[E, K/2, N] in HopperMXValueLayout(mx_axis=1), scales in HopperMXScaleLayout(mx_axis=1, num_warps=8), split_k 1),
as ../shared/peers/bench_triton_kernels_moe.py runs it. Timed as that script times it: gate/up and down, each
replayed from a CUDA graph (median), routing outside; its activation (silu x up, torch) is not in the timed GEMMs.

Found when `triton_kernels` imports (PYTHONPATH), or from a wheel: --peer-wheel or the K3C_PEER_TRITON_KERNELS
variable naming a directory that holds the unpacked package. Absent: bench/moe.py prints that and runs without it.
"""
from __future__ import annotations

import importlib
import os
import sys


def load():
    """The triton_kernels modules the peer needs, or (None, why)."""
    extra = os.environ.get("K3C_PEER_TRITON_KERNELS")
    if extra and extra not in sys.path:
        sys.path.insert(0, extra)
    try:
        mods = {n: importlib.import_module(f"triton_kernels.{n}") for n in
                ("matmul_ogs", "routing", "numerics", "tensor", "tensor_details.layout",
                 "matmul_ogs_details.opt_flags")}
    except Exception as exc:  # noqa: BLE001 - any import failure means: no peer in this run
        return None, f"{type(exc).__name__}: {exc}"[:300]
    mods["opt_flags"] = mods.pop("matmul_ogs_details.opt_flags")
    mods["layout"] = mods.pop("tensor_details.layout")
    mods["opt_flags"].update_opt_flags_constraints({"split_k": 1})       # what vLLM sets on SM90
    return mods, None


class PeerExperts:
    """One E's expert stacks in the peer's layout (gate rows then up rows in one [E, 2I, K] matrix, as vLLM's w13)."""

    def __init__(self, mods, w1p, w1s, w3p, w3s, w2p, w2s):
        import torch

        self.m = mods
        T, L = mods["tensor"], mods["layout"]

        def wrap(p, s):
            vl, vo = L.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = L.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            w = T.convert_layout(T.wrap_torch_tensor(p.transpose(-2, -1), dtype=T.FP4), vl, **vo)
            sc = T.convert_layout(T.wrap_torch_tensor(s.transpose(-2, -1)), sl, **so)
            pc = mods["matmul_ogs"].PrecisionConfig(
                weight_scale=sc, flex_ctx=mods["matmul_ogs"].FlexCtx(rhs_data=mods["numerics"].InFlexData()))
            return w, pc

        self.w13, self.pc13 = wrap(torch.cat((w1p, w3p), dim=1), torch.cat((w1s, w3s), dim=1))
        self.w2, self.pc2 = wrap(w2p, w2s)
        self.inter = w1p.shape[1]

    def timed(self, logits, z, top_k, timer):
        """(seconds of gate/up + down, each a CUDA-graph replay median, routing outside; the down GEMM's input)."""
        import torch

        mo = self.m["matmul_ogs"]
        rd, gi, si = self.m["routing"].routing(logits, top_k, sm_first=False)
        y1 = mo.matmul_ogs(z, self.w13, None, rd, gather_indx=gi, precision_config=self.pc13)
        y1 = y1.view(-1, 2 * self.inter)
        h = (torch.nn.functional.silu(y1[:, :self.inter].float()) * y1[:, self.inter:].float()).to(z.dtype)
        f1 = lambda: mo.matmul_ogs(z, self.w13, None, rd, gather_indx=gi, precision_config=self.pc13)  # noqa: E731
        f2 = lambda: mo.matmul_ogs(h, self.w2, None, rd, scatter_indx=si, precision_config=self.pc2,  # noqa: E731
                                   gammas=rd.gate_scal)
        return timer(f1) + timer(f2)

    def timed_layer(self, logits, z, top_k, timer):
        """Seconds of the peer's whole routed-expert layer in one graph: its routing, gate/up, the activation (torch,
        as vLLM runs it), down with the gammas and the scatter."""
        import torch

        mo = self.m["matmul_ogs"]

        def layer():
            rd, gi, si = self.m["routing"].routing(logits, top_k, sm_first=False)
            y1 = mo.matmul_ogs(z, self.w13, None, rd, gather_indx=gi, precision_config=self.pc13)
            y1 = y1.view(-1, 2 * self.inter)
            h = (torch.nn.functional.silu(y1[:, :self.inter].float()) * y1[:, self.inter:].float()).to(z.dtype)
            return mo.matmul_ogs(h, self.w2, None, rd, scatter_indx=si, precision_config=self.pc2,
                                 gammas=rd.gate_scal)
        return timer(layer)
