"""The artifact is what runs (GPU): k3-tiny and a reduced k3-wide from h200 artifacts compiled on a machine with
no GPU (K3C_GPU_ARTIFACTS=DIR holding <name>-h200/, e.g. from `k3c compile SPEC --target h200 --run-dtypes
bfloat16,float32`; without it they are compiled here), run with JIT made impossible: K3C_NO_JIT=1, the strict
policy, and a launcher whose JIT loader raises. fp32 logits match the JIT path and the eager reference to 1e-5;
in bf16 every kernel op is within its per-op bound of torch on the same inputs."""
from __future__ import annotations

import os

import pytest
import torch

import k3c
from k3c.runtime import launcher
from k3c.runtime.opcheck import check_ops, rel_error, summarize
from k3c.frontend.weight_names import weight_table

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SPECS = {"k3-tiny": "examples/k3-tiny.yaml", "k3-wide-small": "tests/bench/k3-wide-small.yaml"}


_ARTIFACTS: dict[str, str] = {}


def _artifact_path(name, tmp_path_factory) -> str:
    if name not in _ARTIFACTS:
        root = os.environ.get("K3C_GPU_ARTIFACTS")
        path = os.path.join(root, f"{name}-h200") if root else None
        if path is None or not os.path.isdir(path):
            path = str(tmp_path_factory.mktemp(name) / "art")
            k3c.compile(SPECS[name], target="h200", run_dtypes=("bf16", "f32")).save(path, progress=False)
        _ARTIFACTS[name] = path
    return _ARTIFACTS[name]


@pytest.fixture(scope="module", params=sorted(SPECS))
def artifact(request, tmp_path_factory):
    return request.param, _artifact_path(request.param, tmp_path_factory)


@pytest.fixture
def no_jit(monkeypatch):
    """Any JIT compile raises; K3C_NO_JIT=1 too (a miss the strict policy would let through still fails)."""
    real = launcher.load_kernel

    def load_kernel(ks, interpret):
        if not interpret:
            raise AssertionError(f"JIT compile of {ks.name} attempted")
        return real(ks, interpret)

    monkeypatch.setattr(launcher, "load_kernel", load_kernel)
    monkeypatch.setenv("K3C_NO_JIT", "1")


def _weights(spec, dtype, seed=0):
    table = weight_table(spec)
    w = k3c.init_weights(spec, seed=seed)
    return {k: (v if table[k].dtype == "fp32" else v.to(dtype)) for k, v in w.items()}


def _reference_weights(spec, w):
    """The weights the session runs: the spec's quantized experts through MXFP4 and back (its rule)."""
    from k3c.frontend.quant_check import quantized_names
    from k3c.quant import mxfp4_dequantize, mxfp4_quantize

    out = dict(w)
    for n in quantized_names(spec):
        out[n] = mxfp4_dequantize(*mxfp4_quantize(w[n], spec.quantization.rule), w[n].dtype)
    return out


def _run(model, w, ids, policy):
    sess = model.session(w, device="cuda", max_batch=ids.shape[0], max_context=ids.shape[1] + 4,
                         kernel_policy=policy)
    pre = sess.prefill(ids)
    dec = sess.decode(pre[:, -1].argmax(-1))
    torch.cuda.synchronize()
    return pre.float().cpu(), dec.float().cpu()


def test_fp32_from_the_artifact_matches_jit_and_reference(artifact, no_jit, monkeypatch):
    name, path = artifact
    model = k3c.load(path)
    assert model.target.name == "h200" and "f32" in model.run_dtypes
    spec = model.spec
    w = _weights(spec, torch.float32)
    ids = torch.randint(0, spec.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    launcher.reset_stats()
    pre, dec = _run(model, w, ids, "strict")
    st = launcher.stats()
    assert st.jit == 0 and st.binaries > 10, st
    ref_w = {k: v.cuda() for k, v in _reference_weights(spec, w).items()}
    ref = k3c.reference_forward(spec, ref_w, ids.cuda()).float().cpu()
    assert rel_error(pre, ref) <= 1e-5, f"{name}: prefill vs reference {rel_error(pre, ref):.2e}"
    # the same sources JIT-compiled here (the pre-loader path)
    monkeypatch.undo()
    jit_pre, jit_dec = _run(model, w, ids, "jit")
    assert rel_error(pre, jit_pre) <= 1e-5 and rel_error(dec, jit_dec) <= 1e-5, \
        (rel_error(pre, jit_pre), rel_error(dec, jit_dec))


def test_bf16_kernel_ops_from_the_artifact_match_torch(artifact, no_jit):
    name, path = artifact
    model = k3c.load(path)
    spec = model.spec
    ids = torch.randint(0, spec.vocab_size, (2, 21), generator=torch.Generator().manual_seed(2))
    launcher.reset_stats()
    summary = summarize(check_ops(model, _weights(spec, torch.bfloat16, seed=2), ids, decode_steps=2,
                                  device="cuda", kernel_policy="strict"))
    assert launcher.stats().jit == 0
    kernel_ops = {op.op for op in model.module.ops if op.attr("impl", None) == "kernel"}
    assert {op for op, _ in summary} == kernel_ops
    for (op, phase), (_n, worst, finite) in summary.items():
        assert finite and worst <= 1e-2, f"{name} {op} ({phase}): relative error {worst:.3e} > 1e-2"


def test_two_models_on_one_device_both_run_from_their_artifacts(tmp_path_factory, no_jit):
    """A target and its draft model share a GPU: each session holds its own Binding, so making the second takes
    nothing from the first, and each launches its own artifact's kernels (interleaved, no re-binding)."""
    models = {name: k3c.load(_artifact_path(name, tmp_path_factory)) for name in sorted(SPECS)}
    runs = {}
    for name, model in models.items():
        w = _weights(model.spec, torch.float32)
        ids = torch.randint(0, model.spec.vocab_size, (1, 11), generator=torch.Generator().manual_seed(3))
        runs[name] = (model.session(w, device="cuda", max_batch=1, max_context=16, kernel_policy="strict"), ids)
    bindings = [sess.binding for sess, _ in runs.values()]
    assert len({id(b) for b in bindings}) == len(bindings)
    assert all(b.policy == "strict" and b.catalogue is not None for b in bindings)
    launcher.reset_stats()
    launched = {name: [] for name in runs}
    outs = {}
    for name, (sess, ids) in runs.items():        # the first-made model runs after the second was made
        with launcher.recording() as rec:
            outs[name] = sess.prefill(ids)
        launched[name] += rec
    for name, (sess, ids) in runs.items():        # and again, interleaved
        with launcher.recording() as rec:
            sess.decode(outs[name][:, -1].argmax(-1))
        launched[name] += rec
    torch.cuda.synchronize()
    # binaries loaded by earlier tests stay loaded (stats().binaries counts loads, not launches): what shows that
    # each model ran from its own artifact is that every launch of it is a key of its catalogue (strict: a key
    # missing there raises) and nothing was JIT-compiled
    for name, model in models.items():
        own = model.catalogue().entries
        assert launched[name] and all(ks.key in own for ks in launched[name]), name
    assert launcher.stats().jit == 0, launcher.stats()


def test_artifact_for_another_target_is_refused(tmp_path):
    model = k3c.compile(SPECS["k3-tiny"], target="mi355x")
    model.save(str(tmp_path / "mi"), aot=False)
    loaded = k3c.load(str(tmp_path / "mi"))
    from k3c.errors import ArgumentError

    with pytest.raises(ArgumentError, match="compiled for mi355x"):
        loaded.session(_weights(loaded.spec, torch.bfloat16), device="cuda")
