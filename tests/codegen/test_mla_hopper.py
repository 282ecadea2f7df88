"""The Hopper-tier MLA decode (k3c/codegen/kernels/mla_hopper.py): both schedules (the shipped seesaw, warp-specialised,
and the lockstep one) compile ahead of time for sm_90a through compile_kernels into spill-free binaries whose PTX holds
warpgroup MMAs and TMA loads; both keep the portable decode's runtime contract (signature, grid) so the runtime swaps
kernels by plan alone; shapes the tier does not serve are refused. Numerics run on the GPU (bench/mla_hopper.py,
tests/mla/test_mla_hopper_gpu.py)."""
from __future__ import annotations

import re

import pytest

from k3c.codegen.aot import compile_kernels, shutdown_workers
from k3c.codegen.kernels.mla import emit_mla_decode
from k3c.codegen.kernels.mla_hopper import SCHEDULES, emit_mla_decode_hopper
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError

SCALE = (128 + 64) ** -0.5


# per schedule: (score MMA shape, its count, P V MMA count) in the PTX. lockstep: 9 pieces x 4 k-steps at N = 32 (each
# warpgroup 32 keys), 4 k-steps at N = 256; seesaw: a whole 64 x 64 score tile per warpgroup (36 k-steps) in warpgroup
# 0's first block and in each warpgroup's page loop, P V in 7 places (first block, own / other block, the last one)
MMAS = {"lockstep": ("m64n32k16", 36, 4), "seesaw": ("m64n64k16", 3 * 36, 7 * 4)}


@pytest.fixture(scope="module", params=SCHEDULES)
def compiled(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"mla_hopper_{request.param}")
    ks = emit_mla_decode_hopper(512, 64, 64, SCALE, target=get_target("h200"), schedule=request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")          # as in the CPU suite: the compile workers must clear it
        mp.setenv("K3C_CACHE_DIR", str(root / "cache"))
        (ck,) = compile_kernels([ks], get_target("h200"), str(root / "out"), progress=False, keep_asm=True)
        yield request.param, ks, ck, root / "out"
    shutdown_workers()


def test_compiles_for_sm90a_spill_free_with_wgmma_and_tma(compiled):
    schedule, ks, ck, out = compiled
    ptx = (out / ck.files["ptx"]).read_text()
    assert ".target sm_90a" in ptx
    score, n_score, n_pv = MMAS[schedule]
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.{score}", ptx)) == n_score
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16", ptx)) == n_pv
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx
    assert ck.metadata["num_warps"] == 8
    if schedule == "seesaw":        # two warp-specialised warpgroups, each given the whole register file's half
        assert ks.name.endswith("_seesaw") and ks.num_warps == 4 and "setmaxnreg" in ptx
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


@pytest.mark.parametrize("kw, what", [
    (dict(page_size=32), "page size 64"),
    (dict(cache_dtype="fp8e4nv"), "fp8"),
    (dict(dtype="fp32"), "bf16, fp16"),
    (dict(kv_lora_rank=384), "L in (256, 512)"),
    (dict(rope_dim=128), "L + R <= 576"),           # 3 x 64 x 640 x 2 B = 240 KB of query tile and page buffers
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
