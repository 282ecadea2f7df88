"""k3c.load (and `k3c run ARTIFACT`) on artifacts that were tampered with: every refusal is one UserError line
naming the file; nothing is followed through a symlink, nothing unlisted is read, the IR is verified."""
import os
import shutil

import pytest

import k3c
from k3c.cli import main
from k3c.errors import UserError

from hostile.sandbox import reseal_manifest

TINY = "examples/k3-tiny.yaml"
RUN = ["--batch", "1", "--prompt-len", "4", "--new-tokens", "1", "--no-kernels"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "art"
    k3c.compile(TINY, target="cpu").save(path)
    return path


@pytest.fixture
def art(saved, tmp_path):
    path = tmp_path / "art"
    shutil.copytree(saved, path, symlinks=True)
    return path


reseal = reseal_manifest


def refused(art, needle):
    with pytest.raises(UserError) as info:
        k3c.load(art)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg, msg
    return msg


def test_an_intact_artifact_loads(art):
    assert k3c.load(art).spec.name == "k3-tiny"


@pytest.mark.parametrize("resealed", [False, True])
def test_a_symlinked_spec_is_not_followed(art, resealed):
    (art / "spec.yaml").unlink()
    os.symlink("/etc/passwd", art / "spec.yaml")
    if resealed:
        reseal(art)
    msg = refused(art, "spec.yaml: is a symlink")
    assert "root:" not in msg


def test_a_symlinked_directory_or_manifest_is_refused(art, tmp_path):
    os.replace(art / "ir", art / "ir2")
    os.symlink("ir2", art / "ir")
    reseal(art)
    refused(art, "art/ir: is a symlink")
    other = tmp_path / "other"
    shutil.copytree(art.parent / "art", other, symlinks=True)
    os.replace(other / "manifest.json", other / "m.json")
    os.symlink("m.json", other / "manifest.json")
    refused(other, "manifest.json: is a symlink")


@pytest.mark.parametrize("rel", ["spec.yaml", "model.k3c", "ir"])
def test_a_missing_part_is_named(art, rel):
    shutil.rmtree(art / rel) if (art / rel).is_dir() else (art / rel).unlink()
    refused(art, rel)
    reseal(art)                     # not listed either: still named
    refused(art, f"{rel}" + ("/" if rel == "ir" else "") + ": missing")


def test_ir_that_does_not_verify_is_refused(art):
    lines = (art / "model.k3c").read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("%") and " = " in line)
    lines.insert(i + 1, lines[i])                   # a value defined twice
    (art / "model.k3c").write_text("".join(lines))
    reseal(art)
    refused(art, "model.k3c: the IR does not verify")


def test_a_stage_that_does_not_verify_is_refused(art):
    stage = art / "ir" / "000_frontend.k3c"
    lines = stage.read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("%") and " = " in line)
    lines.insert(i + 1, lines[i])
    stage.write_text("".join(lines))
    reseal(art)
    refused(art, "ir/000_frontend.k3c: the IR does not verify")


@pytest.mark.parametrize("rel", ["mynotes.txt", "ir/999_evil.k3c", "kernels/x.py"])
def test_an_unlisted_file_is_refused(art, rel):
    (art / rel).parent.mkdir(exist_ok=True)
    (art / rel).write_text("not k3c's\n")
    refused(art, f"{rel}: not listed in manifest.json")


def test_an_ir_dump_directory_inside_is_tolerated_not_read(art, tmp_path):
    from k3c.frontend.to_ir import spec_to_module
    from k3c.passes.pipeline import run_pipeline

    run_pipeline(spec_to_module(k3c.load_spec(TINY)), ["dce"], dump_dir=art / "ir-dumps")
    assert len(k3c.load(art).stages) == len(os.listdir(art / "ir"))


@pytest.mark.parametrize("kind", ["fifo", "garbage", "list", "huge", "binary"])
def test_a_bad_manifest_is_one_line(art, kind):
    m = art / "manifest.json"
    m.unlink()
    if kind == "fifo":
        os.mkfifo(m)
    elif kind == "huge":
        with open(m, "wb") as fh:
            fh.truncate(65 << 20)               # sparse: nothing is written
    else:
        m.write_bytes({"garbage": b"{oops", "list": b"[]", "binary": b"\xff\xfe{"}[kind])
    refused(art, "art")
    if kind in ("fifo", "huge"):
        with pytest.raises(UserError, match=r"manifest.json: (is a FIFO|\d+ bytes, more than)"):
            from k3c.outputs import read_json

            read_json(str(m))


def test_k3c_run_on_a_tampered_artifact_exits_2_with_one_line(art, capsys):
    (art / "spec.yaml").unlink()
    os.symlink("/etc/passwd", art / "spec.yaml")
    reseal(art)
    assert main(["run", str(art)] + RUN) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "spec.yaml" in err and "root:" not in err


def _edit_manifest(art, edit):
    import json

    m = json.loads((art / "manifest.json").read_text())
    edit(m)
    (art / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("value, needle", [
    ("../../../etc/passwd", "outside the artifact"), ("/etc/passwd", "outside the artifact"),
    ("ir/../spec.yaml", "outside the artifact"), (["spec.yaml"], "outside the artifact"),
    ("notes.txt", "not a file of the artifact"), ("kernels/", "not a file of the artifact"),
])
def test_manifest_files_entries_are_paths_inside_it(art, value, needle):
    """`files` names the artifact's parts: each must be a listed file inside it (or a directory holding one)."""
    _edit_manifest(art, lambda m: m["files"].__setitem__("spec", value))
    msg = refused(art, needle)
    assert "files.spec" in msg and "root:" not in msg


def test_kernel_file_entries_are_paths_inside_it(art):
    """A kernel's files are opened by the launcher: one naming a file outside the artifact is refused at load."""
    from k3c.codegen.aot import CompiledKernel
    from k3c.codegen.resources import KernelResources

    ck = CompiledKernel(name="k3c_x", target="cpu", backend="cpu", arch="cpu", files={"source": "spec.yaml"},
                        signature={}, constexprs={}, grid=("1",), num_warps=1, num_stages=1,
                        resources=KernelResources(backend="cpu", arch="cpu", regs=0), catalogue_key="x")
    _edit_manifest(art, lambda m: m.__setitem__("kernels", [ck.to_dict()]))
    k3c.load(art)                                   # a listed file: accepted
    ck.files["cubin"] = "../../../../etc/passwd"
    _edit_manifest(art, lambda m: m.__setitem__("kernels", [ck.to_dict()]))
    assert "kernel k3c_x" in refused(art, "outside the artifact")


@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_deeply_nested_manifest_is_one_line(art, depth):
    (art / "manifest.json").write_text('{"a": ' * depth + "1" + "}" * depth)
    refused(art, "manifest.json: JSON nested deeper than 64 levels")


def test_a_symlinked_artifact_directory_is_followed_once(art, tmp_path):
    """The policy (docs/robustness.md): a link to an artifact is resolved when it is loaded; the model reads that
    directory from then on, whatever the link points to later. Inside the artifact no symlink is followed."""
    other = tmp_path / "other"
    shutil.copytree(art, other, symlinks=True)
    link = tmp_path / "latest"
    os.symlink("art", link)
    model = k3c.load(link)
    assert model.artifact_dir == str(art.resolve())
    os.unlink(link)
    os.symlink("other", link)                       # the link moves to another build
    assert model.artifact_dir == str(art.resolve())
    assert k3c.load(link).artifact_dir == str(other.resolve())


def test_k3c_inspect_verifies_an_artifact_and_prints_its_ir(art, capsys):
    assert main(["inspect", str(art)]) == 0
    out, err = capsys.readouterr()
    assert out.endswith(k3c.load(art).ir()) and "verified" in err
    assert main(["inspect", str(art), "--after", "frontend"]) == 0
    assert capsys.readouterr().out.endswith(k3c.load(art).ir(after="frontend"))
    (art / "spec.yaml").unlink()
    os.symlink("/etc/passwd", art / "spec.yaml")
    reseal(art)
    assert main(["inspect", str(art)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "spec.yaml: is a symlink" in err
