"""The artifact holds every kernel the runtime can launch: for every example spec and GPU target, prefill and decode
at several batch sizes and prompt lengths run on meta tensors (nothing executes) with the launcher recording, and
every launched kernel's catalogue key must be one the AOT path compiles (CompiledModel.kernels()). A shape class the
runtime reaches and the AOT enumeration misses fails here, naming the kernel and the first shape that needed it."""
from __future__ import annotations

import pytest
import torch

import k3c
from k3c.codegen.launch import bind_device_target, unbind_device_target
from k3c.runtime import launcher
from k3c.runtime.weight_names import model_weights

GPU_TARGETS = ("h100", "h200", "b200", "mi300x", "mi355x")
FULL_SHAPES = tuple((b, t) for b in (1, 8, 32) for t in (1, 17, 1024, 8192))
# kimi-k3 (61 layers, 896 experts) costs ~10x a k3-wide step even on meta tensors: the shapes that reach each
# class of its plans (decode and a 1-token prefill, a short odd prompt, a long batch, the dequant-sized prefill)
K3_SHAPES = ((1, 1), (8, 17), (32, 1024), (1, 8192))
SPECS = {"k3-tiny": FULL_SHAPES, "k3-wide": FULL_SHAPES, "kimi-linear-48b": FULL_SHAPES, "kimi-k3": K3_SHAPES}


def _meta_weights(spec, dtype):
    return {i.name: torch.empty(i.shape, dtype=torch.float32 if i.dtype == "fp32" else dtype, device="meta")
            for i in model_weights(spec)}


def record_launches(model, shapes, dtype=torch.bfloat16):
    """[(kernel, (B, T))] for one prefill of B x T tokens and one decode step after it, per shape, on meta."""
    spec = model.spec
    longest = max(t for _, t in shapes) + 1
    bind_device_target("meta", model.target)
    try:
        sess = model.session(_meta_weights(spec, dtype), device="meta", max_batch=max(b for b, _ in shapes),
                             max_context=longest)
        out = []
        with launcher.recording() as rec:
            for b, t in shapes:
                sess.prefill(torch.zeros(b, t, dtype=torch.long))
                sess.decode(torch.zeros(b, dtype=torch.long))
                out += [(ks, (b, t)) for ks in rec]
                rec.clear()
        return out
    finally:
        unbind_device_target("meta")


@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("name", list(SPECS))
def test_every_launch_is_in_the_catalogue(name, target):
    model = k3c.compile(f"examples/{name}.yaml", target=target)
    catalogue = {ks.key for ks in model.kernels()}
    launched = record_launches(model, SPECS[name])
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


def test_recording_catches_a_missing_class():
    """The check can fail: drop the grouped-GEMM kernels of one row class from the catalogue and it is reported."""
    model = k3c.compile("examples/k3-wide.yaml", target="h200")
    launched = record_launches(model, ((1, 1),))
    names = {ks.name for ks, _ in launched}
    assert any("_jp1" in n for n in names), names        # decode takes the one-multiply pair decode on meta
    catalogue = {ks.key for ks in model.kernels() if "_jp1" not in ks.name}
    assert any(ks.key not in catalogue for ks, _ in launched)


def test_meta_launch_outside_recording_is_refused():
    from k3c.codegen.kernels import emit_rmsnorm
    from k3c.codegen.targets import get_target
    from k3c.codegen.writer import CodegenError

    ks = emit_rmsnorm(64, 1e-6, target=get_target("h200"), dtype="fp32", interpret=False)
    x = torch.empty(2, 64, device="meta")
    with pytest.raises(CodegenError, match="meta"):
        launcher.launch(ks, x, torch.empty(64, device="meta"), torch.empty_like(x), 2)
