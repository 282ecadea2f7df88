"""The artifact holds every kernel the runtime can launch: for every example spec and GPU target, prefill and decode
at several batch sizes and prompt lengths run on meta tensors (nothing executes) with the launcher recording, and
every launched kernel's catalogue key must be one the AOT path compiles (CompiledModel.kernels()). A shape class the
runtime reaches and the AOT enumeration misses fails here, naming the kernel and the first shape that needed it."""
from __future__ import annotations

import pytest
import torch

import k3c
from k3c.runtime import launcher

GPU_TARGETS = ("h100", "h200", "b200", "mi300x", "mi355x")
FULL_SHAPES = tuple((b, t) for b in (1, 8, 32) for t in (1, 17, 1024, 8192))
SPECS = ("k3-tiny", "k3-wide", "kimi-linear-48b", "kimi-k3")


_PARAM_DTYPES = {"f32": torch.float32, "u8": torch.uint8}


def _meta_weights(model, dtype):
    """Every weight the lowered graph reads, as it reads it (MXFP4 stacks already packed: quantizing kimi-k3's
    experts, even on meta tensors, costs minutes), on meta."""
    return {op.attr("name"): torch.empty(op.types[0].shape, dtype=_PARAM_DTYPES.get(op.types[0].dtype, dtype),
                                         device="meta")
            for op in model.module.ops if op.op == "param"}


def record_launches(model, shapes, dtype=torch.bfloat16):
    """[(kernel, (B, T))] for one prefill of B x T tokens and one decode step after it, per shape, on meta."""
    longest = max(t for _, t in shapes) + 1
    # a session on meta plans for its model's target (session.bind_kernels): the kernels it records are the ones
    # that target's GPU would launch
    sess = model.session(_meta_weights(model, dtype), device="meta", max_batch=max(b for b, _ in shapes),
                         max_context=longest)
    assert sess.binding.target is model.target
    out = []
    with launcher.recording() as rec:
        for b, t in shapes:
            sess.prefill(torch.zeros(b, t, dtype=torch.long))
            sess.decode(torch.zeros(b, dtype=torch.long))
            out += [(ks, (b, t)) for ks in rec]
            rec.clear()
    return out


@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("name", SPECS)
def test_every_launch_is_in_the_catalogue(name, target):
    model = k3c.compile(f"examples/{name}.yaml", target=target)
    catalogue = {ks.key for ks in model.kernels()}
    launched = record_launches(model, FULL_SHAPES)
    missing: dict[str, tuple] = {}
    for ks, shape in launched:
        if ks.key not in catalogue:
            missing.setdefault(ks.name, (ks.ir_op, shape))
    assert not missing, "kernels the runtime launched that the artifact lacks (name: IR op, first B x T): " + \
        "; ".join(f"{n}: {op} at {s}" for n, (op, s) in sorted(missing.items()))
    # the recording saw the model: every kernel op family of the IR launched something
    families = {op.op for op in model.module.ops if op.attr("impl", None) == "kernel"} - {"attn_res_take"}
    seen = {ks.ir_op for ks, _ in launched}
    assert len({ks.key for ks, _ in launched}) >= 20
    assert families & {"kda_attn", "mla_absorbed"} <= seen


@pytest.mark.parametrize("target", ("h100", "h200"))
def test_exact_pair_decode_is_in_the_catalogue(target, monkeypatch):
    """The other answer of the data-dependent scale check (a scale above PAIRS1_MAX_SCALE): the exact two-multiply
    decode of the routed experts' hopper form (sm_90: weights in the hopper layout) is in the artifact too."""
    from k3c.runtime.kernel_impls import moe

    monkeypatch.setattr(moe, "META_SCALES_FIT", False)
    for name in ("k3-wide", "kimi-k3"):
        model = k3c.compile(f"examples/{name}.yaml", target=target)
        catalogue = {ks.key for ks in model.kernels()}
        launched = record_launches(model, ((1, 1), (8, 1), (32, 17)))
        names = {ks.name for ks, _ in launched}
        assert any(n.endswith("_hp") for n in names) and not any("_hp1" in n for n in names), names
        missing = sorted({ks.name for ks, _ in launched if ks.key not in catalogue})
        assert not missing, missing


def test_recording_catches_a_missing_class():
    """The check can fail: drop the grouped-GEMM kernels of one row class from the catalogue and it is reported."""
    model = k3c.compile("examples/k3-wide.yaml", target="h200")
    launched = record_launches(model, ((1, 1),))
    names = {ks.name for ks, _ in launched}
    assert any("_hp1" in n for n in names), names        # decode takes the one-multiply hopper decode on meta
    catalogue = {ks.key for ks in model.kernels() if "_hp1" not in ks.name}
    assert any(ks.key not in catalogue for ks, _ in launched)


def test_meta_launch_outside_recording_is_refused():
    from k3c.codegen.kernels import emit_rmsnorm
    from k3c.codegen.targets import get_target
    from k3c.codegen.writer import CodegenError

    ks = emit_rmsnorm(64, 1e-6, target=get_target("h200"), dtype="fp32", interpret=False)
    x = torch.empty(2, 64, device="meta")
    with pytest.raises(CodegenError, match="meta"):
        launcher.launch(ks, x, torch.empty(64, device="meta"), torch.empty_like(x), 2)


@pytest.mark.parametrize("target", ("h200", "mi300x"))
def test_fp32_run_is_in_an_fp32_catalogue(target):
    """A session with float32 weights launches the f32 variants: an artifact compiled with run_dtypes f32 holds
    them, one compiled for bf16 only does not."""
    model = k3c.compile("examples/k3-wide.yaml", target=target, run_dtypes=("bf16", "f32"))
    catalogue = {ks.key for ks in model.kernels()}
    launched = record_launches(model, ((1, 1), (8, 17), (1, 8192)), dtype=torch.float32)
    missing = sorted({ks.name for ks, _ in launched if ks.key not in catalogue})
    assert not missing, missing
    bf16_only = {ks.key for ks in k3c.compile("examples/k3-wide.yaml", target=target).kernels()}
    assert any(ks.key not in bf16_only for ks, _ in launched)
