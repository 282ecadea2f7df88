"""The hopper tier's KDA state passing through the runtime on a GPU: binaries compiled ahead of time by the Triton its
Gluon source is written for, bound to the device under the strict policy (a launch the catalogue lacks is an error),
then `kda_chunk` with the Gluon state-passing kernel (KDAPlan.inter_tier "hopper": every block_v and K split) and
with the portable one, both against an fp32 torch reference (k3c.reference.kda_chunked per sequence): o and the final
states, on random inputs (one and several sequences, ragged lengths that end mid-chunk, 1-token sequences, H 2..96,
with and without initial states).

The GPU machine's Triton may not build the Gluon source, so the binaries come from a folder built elsewhere:

    python tests/kda/test_kda_hopper_gpu.py build .kda-hopper-rt          # here (Triton 3.9)
    K3C_HOPPER_BIN=.kda-hopper-rt python -m pytest -q tests/kda/test_kda_hopper_gpu.py    # on the GPU

Without K3C_HOPPER_BIN the test compiles them itself where this Triton can (tiers.can_build)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from k3c.codegen.aot import CompiledKernel, compile_kernels
from k3c.codegen.kernels.kda import emit_kda_inter, emit_kda_intra, kda_plan
from k3c.codegen.targets import get_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D = 128
SCALE = D ** -0.5
LB = -5.0
# the Gluon kernel's plans at D = 128: every block_v it serves (16 V columns a warp) and every K split at BV 64
HOPPER = [dict(block_v=32), dict(block_v=64, inter_k_split=1), dict(block_v=64, inter_k_split=2),
          dict(block_v=128, inter_k_split=1), dict(block_v=128, inter_k_split=2)]
CASES = [(2, [16], True), (2, [1, 17, 100], False), (12, [4096], True), (32, [512, 33, 1000, 15, 2048], True),
         (96, [8192], True), (96, [1300, 547, 2048, 963, 271, 3063], False), (64, [1, 2, 3, 31], True)]
# (heads, sequence lengths, initial state)


def plans(target) -> list:
    """The portable default plan and the hopper plans (the runtime's _plan with these overrides)."""
    return [kda_plan(D, "bf16", target)] + [kda_plan(D, "bf16", target, inter_tier="hopper", **var) for var in HOPPER]


def kernels(target) -> list:
    """Every kernel the cases launch: the intra-chunk kernel and the state passing of each plan, as
    kda_chunk_launches emits them (bf16 q / k / v / beta, fp32 g, fp32 o)."""
    out = {}
    for heads, _, s0 in CASES:
        for plan in plans(target):
            for ks in (emit_kda_intra(heads, D, target=target, qk_dtype="bf16", g_dtype="fp32", beta_dtype="bf16",
                                      scale=SCALE, plan=plan, interpret=False),
                       emit_kda_inter(heads, D, target=target, v_dtype="bf16", o_dtype="fp32", plan=plan,
                                      has_initial_state=s0, interpret=False)):
                out[ks.key] = ks
    return list(out.values())


def build(out_dir: str, target_name: str = "h200") -> list[CompiledKernel]:
    compiled = compile_kernels(kernels(get_target(target_name)), get_target(target_name), out_dir, progress=False)
    with open(os.path.join(out_dir, "kernels.json"), "w", encoding="utf-8") as f:
        json.dump([ck.to_dict() for ck in compiled], f)
    return compiled


@pytest.fixture(scope="module")
def bound(tmp_path_factory):
    from k3c.codegen import tiers
    from k3c.runtime import launcher
    from k3c.runtime.devices import target_for

    dev = torch.device("cuda", torch.cuda.current_device())
    target = target_for(dev)
    if not target.has_tier("hopper"):
        pytest.skip(f"{target.name} has no hopper tier")
    root = os.environ.get("K3C_HOPPER_BIN")
    if root:
        with open(os.path.join(root, "kernels.json"), encoding="utf-8") as f:
            compiled = [CompiledKernel.from_dict(d) for d in json.load(f)]
    elif all(tiers.can_build(ks) for ks in kernels(target)):
        root = str(tmp_path_factory.mktemp("kda_hopper_rt"))
        compiled = build(root, target.name)
    else:
        pytest.skip("this Triton cannot build the hopper tier's source: set K3C_HOPPER_BIN (module doc)")
    binding = launcher.Binding(launcher.Catalogue(target, os.path.abspath(root),
                                                  {ck.catalogue_key: ck for ck in compiled}), target, "strict")
    launcher.reset_stats()
    yield dev, binding


def inputs(heads: int, lens: list[int], s0: bool, dev):
    """k3c's chunk-kernel inputs by the formulas the prep kernel fuses (bench/kda.py's derive_k3c): q, k L2-normed in
    bf16, v bf16, g = lb * sigmoid(..) fp32 (the safe gate), beta bf16 in (0, 1); int32 cu; fp32 states [N, H, K, V]."""
    gen = torch.Generator(device=dev).manual_seed(sum(lens) * 7 + heads)
    t = sum(lens)

    def r(*shape):
        return torch.randn(*shape, device=dev, generator=gen)
    q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (r(t, heads, D), r(t, heads, D)))
    g = LB * torch.sigmoid(r(t, heads, D) + 1.0)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return dict(q=q.bfloat16(), k=k.bfloat16(), v=r(t, heads, D).bfloat16(), g=g.contiguous(),
                beta=torch.sigmoid(r(t, heads)).bfloat16(), cu=torch.tensor(cu, dtype=torch.int32, device=dev),
                s0=(r(len(lens), heads, D, D) * 0.1) if s0 else None)


def reference(x: dict, lens: list[int]):
    """fp32 o [T, H, D] and final states [N, H, K, V], one sequence at a time."""
    from k3c.reference import kda_chunked

    outs, finals, bos = [], [], 0
    for n, ln in enumerate(lens):
        sl = slice(bos, bos + ln)
        s0 = x["s0"][n:n + 1] if x["s0"] is not None else None
        o, s = kda_chunked(*(x[a][None, sl].float() for a in ("q", "k", "v", "g", "beta")), scale=SCALE,
                           initial_state=s0)
        outs.append(o[0])
        finals.append(s[0])
        bos += ln
    return torch.cat(outs), torch.stack(finals)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}_N{len(c[1])}_T{sum(c[1])}" + ("_s0" if c[2] else ""))
def test_hopper_state_passing_matches_the_portable_kernel(bound, case):
    from k3c.runtime.kernel_impls.kda import kda_chunk

    dev, binding = bound
    heads, lens, s0 = case
    x = inputs(heads, lens, s0, dev)
    o_ref, s_ref = reference(x, lens)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["s0"])
    common = dict(scale=SCALE, out_dtype=torch.float32, max_len=max(lens), binding=binding)
    o_p, s_p = kda_chunk(*args, **common)
    e_port = (rel(o_p, o_ref), rel(s_p, s_ref))
    for var in HOPPER:
        o_h, s_h = kda_chunk(*args, inter_tier="hopper", **var, **common)
        torch.cuda.synchronize()
        assert torch.isfinite(o_h).all() and torch.isfinite(s_h).all()
        e_hop = (rel(o_h, o_ref), rel(s_h, s_ref))
        print(f"H={heads} lens={lens} s0={s0} {var}: hopper o {e_hop[0]:.2e} state {e_hop[1]:.2e}; portable o "
              f"{e_port[0]:.2e} state {e_port[1]:.2e}; hopper - portable o {rel(o_h, o_p):.2e} state "
              f"{rel(s_h, s_p):.2e}")
        # the same bf16 rounding points as the portable dot="bf16" path: only the summation order differs
        for got, port in zip(e_hop, e_port):
            assert got <= 1.25 * port + 1e-3, (e_hop, e_port)
        assert rel(o_h, o_p) < 1e-2 and rel(s_h, s_p) < 1e-2


def test_the_strict_binding_served_every_launch_from_binaries(bound):
    from k3c.runtime import launcher

    s = launcher.stats()
    assert s.jit == 0 and s.tier_fallbacks == [] and s.binaries >= 3


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "build":
    for ck in build(sys.argv[2]):
        print(f"{ck.name} ({ck.tier}): {ck.resources.regs_text()} regs, spills {ck.resources.spill_count}")
