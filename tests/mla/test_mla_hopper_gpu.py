"""The hopper tier's MLA decode through the runtime on a GPU: binaries compiled ahead of time by the Triton its Gluon
source is written for, bound to the device under the strict policy (a launch the catalogue lacks is an error),
then `mqa_decode` with the shipped plan (the hopper kernel) and with the portable plan, both against an fp32 torch
decode over the same paged cache (shuffled pages, ragged lengths, NaN past each sequence's end, 1-2 query tokens).

The GPU machine's Triton may not build the Gluon source, so the binaries come from a folder built elsewhere:

    python tests/mla/test_mla_hopper_gpu.py build .hopper-rt          # here (Triton 3.9)
    K3C_HOPPER_BIN=.hopper-rt python -m pytest -q tests/mla/test_mla_hopper_gpu.py    # on the GPU

Without K3C_HOPPER_BIN the test compiles them itself where this Triton can (tiers.can_build)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from k3c.codegen.aot import CompiledKernel, compile_kernels
from k3c.codegen.kernels.mla import decode_merge_blocks, decode_plan, emit_mla_merge
from k3c.codegen.kernels.mla_decode import decode_kernel
from k3c.codegen.targets import get_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

L, R, PS = 512, 64, 64
SCALE = (128 + R) ** -0.5           # K3: qk_nope 128 + rope 64
CASES = [(1, 96, 1, [1000]), (3, 96, 2, [64, 191, 4097]), (8, 96, 1, [130, 7, 2048, 64, 65, 999, 3000, 1]),
         (2, 128, 1, [300, 520])]     # (B, heads, query tokens, lens)


def kernels(target) -> list:
    """Every kernel the cases launch: the decode of each plan (hopper and portable) and every merge variant."""
    out = {}
    for rows in (96, 192, 128, 256):
        for tiers in (True, False):
            plan = decode_plan(rows, L, target, cache_dtype="bf16", rope_dim=R, tiers=tiers)
            ks = decode_kernel(plan, L, R, PS, SCALE, target=target, dtype="bf16", cache_dtype="bf16",
                               interpret=False)
            out[ks.key] = ks
    for bd in decode_merge_blocks(L):
        ks = emit_mla_merge(L, target=target, out_dtype="bf16", block_d=bd, write_lse=False, interpret=False)
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
        root = str(tmp_path_factory.mktemp("hopper_rt"))
        compiled = build(root, target.name)
    else:
        pytest.skip("this Triton cannot build the hopper tier's source: set K3C_HOPPER_BIN (module doc)")
    binding = launcher.Binding(launcher.Catalogue(target, os.path.abspath(root),
                                                  {ck.catalogue_key: ck for ck in compiled}), target, "strict")
    launcher.reset_stats()
    yield dev, binding


def reference(q, pool, bt, lens, tq: int, heads: int) -> torch.Tensor:
    """fp32 MQA decode: row (t, h) of sequence b sees keys [0, len - tq + t]."""
    out = torch.zeros(q.shape[0], q.shape[1], L, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        pages = bt[b, : -(-n // PS)].long()
        keys = pool[pages].reshape(-1, L + R)[:n].float()
        s = (q[b].float() @ keys.T) * SCALE                                        # [ROWS, n]
        t = torch.arange(q.shape[1], device=q.device) // heads
        visible = torch.arange(n, device=q.device)[None, :] <= (n - tq + t)[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        out[b] = p @ keys[:, :L]
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}_H{c[1]}_TQ{c[2]}")
def test_hopper_decode_through_the_runtime(bound, case):
    from k3c.runtime.kernel_impls import mla as rt

    dev, binding = bound
    target = binding.target
    B, H, TQ, lens = case
    gen = torch.Generator(device=dev).manual_seed(len(lens) * 1000 + H)
    store = rt.new_store(B, max(lens), L + R, PS, torch.bfloat16, dev)
    store.pool.normal_(generator=gen)
    for b, n in enumerate(lens):          # whatever lies past a sequence's end must not reach its output
        tail = torch.arange(n, store.block_table.shape[1] * PS, device=dev)
        pages = store.block_table[b, tail // PS].long()
        store.pool[pages, tail % PS] = float("nan")
    perm = torch.randperm(store.block_table.numel(), device=dev, generator=gen).to(torch.int32)
    shuffled = torch.empty_like(store.pool)
    shuffled[perm.long()] = store.pool[store.block_table.flatten().long()].view_as(store.pool)
    store = rt.LatentStore(shuffled, perm.view_as(store.block_table), list(lens))
    q = torch.randn(B, TQ * H, L + R, generator=gen, device=dev).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref = reference(q, store.pool, store.block_table, lens, TQ, H)

    shipped = rt.mqa_decode(q, store, lens_t, SCALE, L, num_heads=H, binding=binding, max_len=max(lens))
    portable = rt.mqa_decode(q, store, lens_t, SCALE, L, num_heads=H, binding=binding, max_len=max(lens),
                             plan=decode_plan(TQ * H, L, target, cache_dtype="bf16", rope_dim=R, tiers=False))
    assert decode_plan(TQ * H, L, target, cache_dtype="bf16", rope_dim=R).tier == "hopper"
    for got in (shipped, portable):
        assert torch.isfinite(got).all()
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
    assert ((shipped.float() - portable.float()).norm() / ref.norm()).item() < 1e-2


def test_the_strict_binding_served_every_launch_from_binaries(bound):
    from k3c.runtime import launcher

    s = launcher.stats()
    assert s.jit == 0 and s.tier_fallbacks == [] and s.binaries >= 3


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "build":
    for ck in build(sys.argv[2]):
        print(f"{ck.name} ({ck.tier}): {ck.resources.regs_text()} regs, spills {ck.resources.spill_count}")
