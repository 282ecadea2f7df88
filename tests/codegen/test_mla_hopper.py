"""The Hopper-tier MLA decode (k3c/codegen/kernels/mla_hopper.py): the shipped (lockstep) kernel compiles ahead of
time for sm_90a through compile_kernels into a spill-free binary whose PTX holds warpgroup MMAs and TMA loads; the
seesaw schedule compiles too (warp-specialised); both keep the portable decode's runtime contract (signature, grid)
so the runtime swaps kernels by plan alone; shapes the tier does not serve are refused. Numerics run on the GPU
(bench/mla_hopper.py)."""
from __future__ import annotations

import re

import pytest

from k3c.codegen.aot import compile_kernels, shutdown_workers
from k3c.codegen.kernels.mla import emit_mla_decode
from k3c.codegen.kernels.mla_hopper import SCHEDULES, emit_mla_decode_hopper
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError

SCALE = (128 + 64) ** -0.5


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_hopper")
    ks = emit_mla_decode_hopper(512, 64, 64, SCALE, target=get_target("h200"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")          # as in the CPU suite: the compile workers must clear it
        mp.setenv("K3C_CACHE_DIR", str(root / "cache"))
        (ck,) = compile_kernels([ks], get_target("h200"), str(root / "out"), progress=False, keep_asm=True)
        yield ks, ck, root / "out"
    shutdown_workers()


def test_compiles_for_sm90a_spill_free_with_wgmma_and_tma(compiled):
    ks, ck, out = compiled
    ptx = (out / ck.files["ptx"]).read_text()
    assert ".target sm_90a" in ptx
    # 9 pieces x 4 k-steps for S = Q K^T, 4 k-steps for O += P V (N = 256 per warpgroup)
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n32k16", ptx)) == 36
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16", ptx)) == 4
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx
    res = ck.resources
    assert not res.has_spills and res.scratch_bytes == 0, res
    assert 0 < res.regs <= 255
    assert 200 * 1024 < res.shared_bytes <= get_target("h200").shared_mem_bytes


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_same_runtime_contract_as_the_portable_decode(schedule):
    tgt = get_target("h200")
    hop = emit_mla_decode_hopper(512, 64, 64, SCALE, target=tgt, schedule=schedule)
    port = emit_mla_decode(512, 64, 64, SCALE, target=tgt)
    assert hop.signature == port.signature and list(hop.signature) == list(port.signature)
    assert hop.grid == port.grid == ("cdiv(ROWS, BLOCK_H)", "S", "B")
    assert hop.constexprs["BLOCK_H"] == 64
    assert hop.source.startswith("# k3c generated Triton kernel: k3c_mla_decode_hopper_l512_r64_p64_bf16")
    assert "IR op: mla_absorbed" in hop.source and "@gluon.jit" in hop.source
    assert emit_mla_decode_hopper(512, 64, 64, SCALE, target=tgt, name="my_decode").name == "my_decode"


def test_seesaw_schedule_compiles_warp_specialised(tmp_path):
    """Two warpgroup partitions (setmaxnreg), warpgroup MMAs, TMA pieces; not shipped: at
    255 registers a thread it keeps a few words on the stack (see the module doc)."""
    ks = emit_mla_decode_hopper(512, 64, 64, SCALE, target=get_target("h200"), schedule="seesaw")
    assert ks.name.endswith("_seesaw") and ks.num_warps == 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3C_CACHE_DIR", str(tmp_path / "cache"))
        (ck,) = compile_kernels([ks], get_target("h200"), str(tmp_path / "out"), progress=False, keep_asm=True)
    ptx = (tmp_path / "out" / ck.files["ptx"]).read_text()
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert len(re.findall(r"wgmma\.mma_async", ptx)) > 0 and ck.metadata["num_warps"] == 8


@pytest.mark.parametrize("kw, what", [
    (dict(page_size=32), "page size 64"),
    (dict(cache_dtype="fp8e4nv"), "fp8"),
    (dict(dtype="fp32"), "bf16, fp16"),
    (dict(kv_lora_rank=384), "L in (256, 512)"),
    (dict(target="mi355x"), "sm_90"),
    (dict(name="bad name"), "invalid identifier"),
    (dict(scale=float("nan")), "scale"),
    (dict(schedule="pingpong"), "schedule"),
])
def test_refuses_what_it_does_not_serve(kw, what):
    args = dict(kv_lora_rank=512, rope_dim=64, page_size=64, scale=SCALE, target="h200")
    args.update(kw)
    args["target"] = get_target(args["target"])
    with pytest.raises(CodegenError, match=re.escape(what)):
        emit_mla_decode_hopper(args.pop("kv_lora_rank"), args.pop("rope_dim"), args.pop("page_size"),
                               args.pop("scale"), **args)
