"""Issue 3's done-when on the shipped kernels: compiling kimi-k3 writes a binary and assembly for every generated
kernel, and the default configuration of every kernel uses no scratch or spills on mi355x and h200. The mi355x
compile also writes IR dumps (`--dump-ir`), one a pass, each read back by the parser (the CLI's compile of the real
model, done once: a cold kimi-k3 compile takes minutes of a 2-core machine)."""
import json
import os

import pytest

from k3c.cli import main
from k3c.ir import parse_module, print_module


@pytest.mark.slow
@pytest.mark.parametrize("target, binary, asm, dumps", [("mi355x", "hsaco", "amdgcn", True),
                                                        ("h200", "cubin", "ptx", False)])
def test_kimi_k3_kernels_compile_without_spills(tmp_path, monkeypatch, capsys, target, binary, asm, dumps):
    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / target
    argv = ["compile", "examples/kimi-k3.yaml", "--target", target, "-o", str(out)]
    assert main(argv + (["--dump-ir", str(out / "ir-dumps")] if dumps else [])) == 0
    assert f"compiled kimi-k3 for {target}" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    kernels = manifest["kernels"]
    assert kernels, "no generated kernels"
    emitted = {k["ir_op"] for k in kernels}
    assert {"embedding", "rmsnorm", "mlp"} <= emitted
    for k in kernels:
        assert os.path.getsize(out / k["files"][binary]) > 0 and os.path.getsize(out / k["files"][asm]) > 0
        assert (out / k["files"][binary]).read_bytes()[:4] == b"\x7fELF"
        res = k["resources"]
        assert res["scratch_bytes"] == 0 and res["spill_count"] == 0, f"{k['name']} spills on {target}: {res}"
    report = (out / "report.md").read_text()
    assert all(k["name"] in report for k in kernels) and "0 with scratch/spills" in report
    # ops not turned into kernels are listed, never hidden
    assert any(e["impl"] == "extern" and e["op"] == "lm_head" for e in manifest["extern"])
    if dumps:
        check_dumps(out, manifest)


def check_dumps(out, manifest):
    """One dump before the passes and one after each, every one read back by the parser and printed again to the
    same module; the last is the artifact's model.k3c."""
    assert manifest["target"]["arch"] == "gfx950" and manifest["model"] == "kimi-k3"
    names = sorted(os.listdir(out / "ir-dumps"))
    assert names[0] == "000_frontend.k3c" and len(names) == 1 + len(manifest["passes"])
    final = None
    for name in names:
        text = (out / "ir-dumps" / name).read_text()
        module = parse_module(text, name)
        assert parse_module(module_text := print_module(module)) == module
        assert module_text.count("\n") > 3000
        final = module
    assert final == parse_module((out / "model.k3c").read_text())
