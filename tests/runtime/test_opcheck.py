"""Every op of k3-tiny that runs a generated kernel agrees with its torch implementation on the same inputs,
in prefill and decode, in fp32 (<= 1e-5) and bf16 (<= 1e-2): the per-op check that bench/compiled_vs_reference.py
--per-op runs on a GPU."""
import pytest
import torch

import k3c
from k3c.runtime.opcheck import check_ops, summarize
from k3c.frontend.weight_names import weight_table


@pytest.fixture(scope="module")
def tiny():
    spec = k3c.load_spec("examples/k3-tiny.yaml")
    return spec, k3c.compile(spec, target="h200")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_every_kernel_op_matches_torch(tiny, dtype, tol):
    spec, model = tiny
    table = weight_table(spec)
    w = {k: (v if table[k].dtype == "fp32" else v.to(dtype)) for k, v in k3c.init_weights(spec, seed=3).items()}
    ids = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    summary = summarize(check_ops(model, w, ids, decode_steps=1))
    kernel_ops = {op.op for op in model.module.ops if op.attr("impl", None) == "kernel"}
    assert {op for op, _ in summary} == kernel_ops          # every kernel op was checked
    assert {ph for _, ph in summary} == {"prefill", "decode"}
    for (op, phase), (n, worst, finite) in summary.items():
        assert finite and worst <= tol, f"{op} ({phase}): relative error {worst:.3e} > {tol}"


def test_quantized_model_ops_match_torch(tmp_path):
    """MXFP4 experts: the check quantizes the float stacks the way a session does, and the MoE kernels (routing,
    grouped upcast GEMMs, combine) agree with their torch implementations on the packed weights."""
    text = open("examples/k3-tiny.yaml").read().split("precision:")[0] + "quantization:\n  format: mxfp4\n"
    path = tmp_path / "tiny-q.yaml"
    path.write_text(text)
    spec = k3c.load_spec(str(path))
    model = k3c.compile(spec, target="h200")
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    summary = summarize(check_ops(model, k3c.init_weights(spec, seed=5), ids, decode_steps=1))
    assert any(op.startswith("moe_") for op, _ in summary)
    for (op, phase), (n, worst, finite) in summary.items():
        assert finite and worst <= 1e-5, f"{op} ({phase}): relative error {worst:.3e} > 1e-5"
