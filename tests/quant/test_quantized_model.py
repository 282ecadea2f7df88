"""Quantized k3-tiny end to end: the compiled graph on packed experts equals the reference on the same dequantized
weights; packed checkpoints (`k3c quantize`, K3's compressed-tensors experts) load and run like quantizing at load;
load-time checks of packed tensors; `k3c quantize` exit codes and atomic writes."""
import json
import os
from pathlib import Path

import pytest
import torch

import k3c
from k3c.cli import main
from k3c.errors import WeightError
from k3c.passes import resolve_passes
from k3c.quant import e8m0_to_float, mxfp4_dequantize, mxfp4_quantize
from k3c.runtime.checkpoint import load_weights, save_k3_checkpoint
from k3c.runtime.weight_prep import prepare_weights

ROOT = Path(__file__).resolve().parents[2]
TINY = (ROOT / "examples" / "k3-tiny.yaml").read_text().split("precision:")[0]   # precision is the last section


def spec_file(tmp_path, rule="floor", name="tiny-q.yaml"):
    path = tmp_path / name
    path.write_text(TINY + f"quantization:\n  format: mxfp4\n  rule: {rule}\n")
    return path


# the default pipeline with the moe op left to the reference MoE (the MoE kernels are tested on their own)
PASSES = [p for p in resolve_passes("default") if p != "moe-lower"]


@pytest.fixture(scope="module")
def qtiny(tmp_path_factory):
    path = spec_file(tmp_path_factory.mktemp("spec"))
    spec = k3c.load_spec(path)
    return path, spec, k3c.compile(spec, target="cpu", passes=PASSES)


def experts(spec):
    from k3c.frontend.quant_check import quantized_names

    return quantized_names(spec)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_compiled_graph_equals_reference_on_dequantized_weights(qtiny):
    path, spec, model = qtiny
    assert {op.attr("expert_format") for op in model.module_after("mxfp4").ops_named("moe")} == {"mxfp4"}
    w = k3c.init_weights(spec, seed=5)
    deq = dict(w)
    for n in experts(spec):
        deq[n] = mxfp4_dequantize(*mxfp4_quantize(w[n], "floor"), torch.float32)
    ids = torch.randint(0, spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    out = model.session(w, use_kernels=False).prefill(ids)          # quantized once, at load
    ref = k3c.reference_forward(spec, deq, ids)
    assert rel(out, ref) < 1e-5
    assert rel(out, k3c.reference_forward(spec, w, ids)) > 1e-3        # the experts really were quantized


def test_quantize_cli_checkpoint_runs_like_quantizing_at_load(qtiny, tmp_path):
    path, spec, model = qtiny
    out = tmp_path / "packed"
    assert main(["quantize", str(path), "--random", "--seed", "2", "--rule", "rceil", "-o", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors", "quantization.json"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".packed")]           # no temp dir left
    record = json.loads((out / "quantization.json").read_text())
    assert (record["format"], record["rule"], record["block"]) == ("mxfp4", "rceil", 32)
    assert record["weights"] == experts(spec) and record["k3c_version"] == k3c.__version__
    packed = load_weights(spec, out)
    w = k3c.init_weights(spec, seed=2, dtype=torch.bfloat16)
    for n in experts(spec):
        assert n not in packed
        p, s = mxfp4_quantize(w[n], "rceil")
        assert torch.equal(packed[n + ".weight_packed"], p) and torch.equal(packed[n + ".weight_scale"], s)
    assert all(torch.equal(packed[n], t) for n, t in w.items() if n not in experts(spec))
    # the session reads the packed tensors as they are: same logits as the floats quantized at load (same rule)
    rmodel = k3c.compile(spec.replace(quantization=spec.quantization.__class__(rule="rceil"),
                                      precision=spec.precision.__class__(
                                          weights=spec.precision.weights.__class__(
                                              format="mxfp4", include=spec.precision.weights.include,
                                              scale_rule="rceil"))), target="cpu", passes=PASSES)
    ids = torch.randint(0, spec.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    a = rmodel.session(packed, use_kernels=False).prefill(ids)
    b = rmodel.session(w, use_kernels=False).prefill(ids)
    assert torch.equal(a, b)


def test_k3_compressed_tensors_experts_load(qtiny, tmp_path):
    """K3's published layout: per expert `experts.{e}.w1.weight_packed` / `weight_scale` as compressed-tensors'
    MXFP4PackedCompressor writes them -> stacked k3c packed tensors."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from safetensors.torch import save_file

    from k3c.runtime.checkpoint import k3_checkpoint_names

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    path, spec, model = qtiny
    w = k3c.init_weights(spec, seed=4, dtype=torch.bfloat16)
    names = k3_checkpoint_names(spec)
    tensors = {}
    for n, t in w.items():
        if n not in experts(spec):
            tensors[names[n][0]] = t.contiguous()
            continue
        for e, key in enumerate(names[n]):
            _, scales = mxfp4_quantize(t[e])
            comp = MXFP4PackedCompressor.compress({"weight": t[e], "weight_scale": e8m0_to_float(scales).to(t.dtype)},
                                                  scheme)
            base = key[: -len(".weight")]
            tensors[base + ".weight_packed"] = comp["weight_packed"]
            tensors[base + ".weight_scale"] = comp["weight_scale"]
    save_file(tensors, str(tmp_path / "k3.safetensors"))
    got = load_weights(spec, tmp_path / "k3.safetensors")
    for n in experts(spec):
        p, s = mxfp4_quantize(w[n])
        assert torch.equal(got[n + ".weight_packed"], p) and torch.equal(got[n + ".weight_scale"], s)
        e = 3
        dec = MXFP4PackedCompressor.decompress({"weight_packed": got[n + ".weight_packed"][e],
                                                "weight_scale": got[n + ".weight_scale"][e]}, scheme)["weight"]
        assert torch.equal(dec, mxfp4_dequantize(p[e], s[e], dec.dtype))
    # save_k3_checkpoint writes the same layout back, config marked packed
    out = save_k3_checkpoint(spec, got, tmp_path / "k3dir")
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    again = load_weights(spec, out)
    assert all(torch.equal(again[n], t) for n, t in got.items())
    assert k3c.load_spec(out).quantization == spec.quantization.__class__()     # the HF import sets the section
    # a missing scale tensor is named
    del tensors[names[experts(spec)[0]][5][: -len(".weight")] + ".weight_scale"]
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightError, match=r"missing tensor for expert 5 of '.*experts.w1.weight_scale'"):
        load_weights(spec, tmp_path / "bad.safetensors")


def test_prepare_weights_checks_packed_tensors(qtiny):
    path, spec, model = qtiny
    w = k3c.init_weights(spec, seed=1)
    n = experts(spec)[0]
    p, s = mxfp4_quantize(w[n])
    base = {k: v for k, v in w.items() if k != n}
    ok = prepare_weights(model.module, {**base, n + ".weight_packed": p, n + ".weight_scale": s})
    assert ok[n + ".weight_packed"] is p
    with pytest.raises(WeightError, match=r"weight_packed' has dtype torch.int8, the graph needs uint8"):
        prepare_weights(model.module, {**base, n + ".weight_packed": p.view(torch.int8), n + ".weight_scale": s})
    with pytest.raises(WeightError, match=r"weight_scale' has shape"):
        prepare_weights(model.module, {**base, n + ".weight_packed": p, n + ".weight_scale": s[:4]})
    with pytest.raises(WeightError, match=r"weight_scale' is missing while"):
        prepare_weights(model.module, {**w, n + ".weight_packed": p})
    with pytest.raises(WeightError, match=f"'{n}.weight_packed' is missing"):
        prepare_weights(model.module, base)
    # load-time quantization works a slab of rows at a time: the same bytes whatever the slab
    from k3c.runtime.weight_prep import quantize_stack

    for got, want in zip(quantize_stack(n, w[n], "rceil", chunk_bytes=3000), mxfp4_quantize(w[n], "rceil")):
        assert torch.equal(got, want)
    with pytest.raises(WeightError, match=r"multiple of 32"):
        quantize_stack(n, torch.randn(2, 48), "floor")
    # an unquantized graph given packed experts dequantizes them at load
    plain = k3c.compile(k3c.load_spec(ROOT / "examples" / "k3-tiny.yaml"), target="cpu", passes=PASSES)
    got = prepare_weights(plain.module, {**base, n + ".weight_packed": p, n + ".weight_scale": s})
    assert torch.equal(got[n], mxfp4_dequantize(p, s, w["embed_tokens.weight"].dtype))


def test_quantize_cli_errors(qtiny, tmp_path, capsys):
    path, spec, model = qtiny
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    assert main(["quantize", str(path), "--random", "-o", str(out)]) == 2                  # exists, no --force
    assert "--force" in capsys.readouterr().err and (out / "keep").exists()
    assert main(["quantize", str(path), "-o", str(tmp_path / "a")]) == 2                    # neither input
    plain = tmp_path / "plain.yaml"                   # neither a quantization: section nor MXFP4 precision
    plain.write_text(TINY)
    assert main(["quantize", str(plain), "--random", "-o", str(tmp_path / "b")]) == 2
    assert "no quantization: section" in capsys.readouterr().err
    plain.unlink()
    assert main(["quantize", str(path), "--random", "--rule", "ceil", "-o", str(tmp_path / "c")]) == 2
    # a checkpoint that misses a weight: error naming it, nothing written
    from safetensors.torch import save_file

    w = k3c.init_weights(spec, seed=0, dtype=torch.bfloat16)
    w.pop("norm.weight")
    save_file(w, str(tmp_path / "w.safetensors"))
    assert main(["quantize", str(path), str(tmp_path / "w.safetensors"), "-o", str(tmp_path / "d")]) == 2
    assert "norm.weight" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["o", "w.safetensors"]
    assert main(["quantize", str(path), "--random", "-o", str(out), "--force"]) == 2        # not k3c's: kept
    assert "not a k3c quantized checkpoint" in capsys.readouterr().err and (out / "keep").read_text() == "x"
    (out / "keep").unlink()
    assert main(["quantize", str(path), "--random", "-o", str(out)]) == 0                   # an empty dir is fine
    assert main(["quantize", str(path), "--random", "-o", str(out), "--force"]) == 0        # replaces its own
    assert sorted(os.listdir(out)) == ["model.safetensors", "quantization.json"]
