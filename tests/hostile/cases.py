"""The hostile and careless cases, by class. Each is a Case (sandbox.py): argv, the exit codes allowed, what the
one error line must name, the sandbox paths it may write.

The sandbox (built by build_base) holds:
  project/spec.yaml, project/notes.txt, project/sub/keep.txt   a user's folder (k3-tiny's spec and their files)
  qspec.yaml                                                   k3-tiny with a quantization: section
  art/                                                         a k3c artifact of k3-tiny (target cpu)
  weights.safetensors                                          random k3-tiny weights, canonical names
  scores.safetensors                                           router scores of k3-tiny's MoE layers
  empty/                                                       an empty folder
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .sandbox import TINY, Case, reseal_manifest

QUANT_SECTION = "\nquantization:\n  format: mxfp4\n  rule: floor\n"
MOE_LAYERS = range(1, 8)          # k3-tiny: first_k_dense 1 of 8 layers
NUM_EXPERTS = 8


def build_base(root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import k3c

    (root / "project" / "sub").mkdir(parents=True)
    shutil.copy(TINY, root / "project" / "spec.yaml")
    (root / "project" / "notes.txt").write_text("my notes, not k3c's\n")
    (root / "project" / "sub" / "keep.txt").write_text("keep me\n")
    (root / "qspec.yaml").write_text(TINY.read_text() + QUANT_SECTION)
    (root / "empty").mkdir()
    spec = k3c.load_spec(str(TINY))
    k3c.compile(spec, target="cpu").save(str(root / "art"), progress=False)
    weights = k3c.init_weights(spec, seed=0)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "weights.safetensors"))
    gen = torch.Generator().manual_seed(0)
    scores = {f"layers.{i}.block_sparse_moe.gate.scores": torch.rand(64, NUM_EXPERTS, generator=gen)
              for i in MOE_LAYERS}
    save_file(scores, str(root / "scores.safetensors"))


# ---------------------------------------------------------------------------------------------- setups


def _fifo(name: str):
    def setup(root: Path) -> None:
        os.mkfifo(root / name)
    return setup


def _write(name: str, data: bytes | str):
    def setup(root: Path) -> None:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    return setup


def _symlink(name: str, target: str):
    def setup(root: Path) -> None:
        os.symlink(target, root / name)
    return setup


def _both(*setups):
    def setup(root: Path) -> None:
        for s in setups:
            s(root)
    return setup


def _weights(edit):
    """weights.safetensors rewritten by edit(dict of tensors) into bad.safetensors."""
    def setup(root: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(root / "weights.safetensors"))
        edit(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "bad.safetensors"))
    return setup


def _scores(edit):
    def setup(root: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(root / "scores.safetensors"))
        edit(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "bad-scores.safetensors"))
    return setup


def _artifact(edit, *, reseal: bool = False):
    """art/ changed by edit(root_of_art); reseal: the manifest's sha256 list recomputed afterwards (a forger who
    knows the format), so the check that must catch it is not the hash."""
    def setup(root: Path) -> None:
        art = root / "art"
        edit(art)
        if reseal:
            reseal_manifest(art)
    return setup


def _manifest(edit):
    def change(art: Path) -> None:
        manifest = json.loads((art / "manifest.json").read_text())
        edit(manifest)
        (art / "manifest.json").write_text(json.dumps(manifest))
    return _artifact(change)


def _rm(rel: str):
    def change(art: Path) -> None:
        p = art / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return change


def _append(rel: str, text: str):
    def change(art: Path) -> None:
        with open(art / rel, "a") as fh:
            fh.write(text)
    return change


def _duplicate_first_value(art: Path) -> None:
    """model.k3c with its first op line repeated: a value defined twice (the verifier must refuse it)."""
    lines = (art / "model.k3c").read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("%") and " = " in line)
    lines.insert(i + 1, lines[i])
    (art / "model.k3c").write_text("".join(lines))


def _link_spec_to_passwd(art: Path) -> None:
    (art / "spec.yaml").unlink()
    os.symlink("/etc/passwd", art / "spec.yaml")


def _user_file_in_art(art: Path) -> None:
    (art / "mynotes.txt").write_text("written by the user\n")


# ---------------------------------------------------------------------------------------------- the cases

RUN = ("--batch", "1", "--prompt-len", "4", "--new-tokens", "1", "--no-kernels")
PLAN = ("plan", "project/spec.yaml", "--target", "mi355x")
COMPILE = ("compile", "project/spec.yaml", "--target", "cpu")


def output_dir_cases() -> list[Case]:
    c = "output-dir"
    return [
        Case("compile -o a user folder --force", COMPILE + ("-o", "project", "--force"), mentions=("project",), cls=c),
        Case("compile -o a user folder", COMPILE + ("-o", "project"), mentions=("project",), cls=c),
        Case("compile -o . --force", COMPILE + ("-o", ".", "--force"), cls=c),
        Case("compile -o .. --force from project", ("compile", "spec.yaml", "--target", "cpu", "-o", "..",
                                                    "--force"), cls=c),
        Case("compile -o a user file", COMPILE + ("-o", "project/notes.txt"), mentions=("notes.txt",), cls=c),
        Case("compile -o a user file --force", COMPILE + ("-o", "project/notes.txt", "--force"),
             mentions=("notes.txt",), cls=c),
        Case("compile -o below a file", COMPILE + ("-o", "project/notes.txt/out"), mentions=("notes.txt",), cls=c),
        Case("compile -o a symlink to a user folder", COMPILE + ("-o", "link", "--force"), mentions=("link",),
             setup=_symlink("link", "project"), cls=c),
        Case("compile -o a dangling symlink", COMPILE + ("-o", "dangling"), mentions=("dangling",),
             setup=_symlink("dangling", "nowhere"), cls=c),
        Case("compile -o a name over 255 bytes", COMPILE + ("-o", "x" * 300), mentions=("x" * 20,), cls=c),
        Case("compile -o /dev/null", COMPILE + ("-o", "/dev/null", "--force"), mentions=("/dev/null",), cls=c),
        Case("compile -o an artifact holding a user file --force", COMPILE + ("-o", "art", "--force"),
             mentions=("mynotes.txt",), setup=_artifact(_user_file_in_art), cls=c),
        Case("compile -o an artifact --force", COMPILE + ("-o", "art", "--force"), expect=(0,), outputs=("art",),
             cls=c),
        Case("compile -o an artifact without --force", COMPILE + ("-o", "art"), expect=(0, 2), outputs=("art",),
             cls=c),
        Case("compile -o an empty folder", COMPILE + ("-o", "empty"), expect=(0,), outputs=("empty",), cls=c),
        Case("compile -o a new nested path", COMPILE + ("-o", "new/deep/out"), expect=(0,), outputs=("new",), cls=c),
        Case("compile -o a damaged artifact --force", COMPILE + ("-o", "art", "--force"), expect=(0,),
             outputs=("art",), setup=_artifact(_rm("model.k3c")), cls=c),
        Case("compile --dump-ir a user file", COMPILE + ("-o", "out", "--dump-ir", "project/notes.txt"),
             mentions=("notes.txt",), cls=c),
        Case("compile --dump-ir a user folder", COMPILE + ("-o", "out", "--dump-ir", "project"),
             mentions=("project",), cls=c),
        Case("compile --dump-ir /dev/null", COMPILE + ("-o", "out", "--dump-ir", "/dev/null"),
             mentions=("/dev/null",), cls=c),
        Case("compile --dump-ir below a file", COMPILE + ("-o", "out", "--dump-ir", "project/notes.txt/d"),
             mentions=("notes.txt",), cls=c),
        Case("compile --dump-ir with a refused -o", COMPILE + ("-o", "project", "--dump-ir", "dumps"),
             mentions=("project",), cls=c),
        Case("compile --dump-ir a new folder", COMPILE + ("-o", "out", "--dump-ir", "dumps"), expect=(0,),
             outputs=("out", "dumps"), cls=c),
        Case("compile --dump-ir inside -o", COMPILE + ("-o", "out", "--dump-ir", "out/ir-dumps"), expect=(0,),
             outputs=("out",), cls=c),
        Case("quantize -o a user folder --force", ("quantize", "qspec.yaml", "--random", "-o", "project",
                                                    "--force"), mentions=("project",), cls=c),
        Case("quantize -o a user file", ("quantize", "qspec.yaml", "--random", "-o", "project/notes.txt"),
             mentions=("notes.txt",), cls=c),
        Case("quantize -o a symlink", ("quantize", "qspec.yaml", "--random", "-o", "link", "--force"),
             mentions=("link",), setup=_symlink("link", "project"), cls=c),
        Case("quantize -o a new folder", ("quantize", "qspec.yaml", "--random", "-o", "q"), expect=(0,),
             outputs=("q",), cls=c),
        Case("calibrate-router -o a missing folder", ("calibrate-router", "project/spec.yaml", "scores.safetensors",
                                                      "-o", "missing/bias.safetensors"), mentions=("missing",), cls=c),
        Case("calibrate-router -o an existing file", ("calibrate-router", "project/spec.yaml", "scores.safetensors",
                                                      "-o", "project/notes.txt"), mentions=("notes.txt",), cls=c),
        Case("calibrate-router -o a folder", ("calibrate-router", "project/spec.yaml", "scores.safetensors",
                                              "-o", "empty", "--force"), mentions=("empty",), cls=c),
        Case("calibrate-router -o a new file", ("calibrate-router", "project/spec.yaml", "scores.safetensors",
                                                "-o", "bias.safetensors"), expect=(0,), outputs=("bias.safetensors",),
             cls=c),
        Case("inspect -o below a file", ("inspect", "project/spec.yaml", "-o", "project/notes.txt/x"),
             mentions=("notes.txt",), cls=c),
        Case("inspect -o a folder", ("inspect", "project/spec.yaml", "-o", "empty"), mentions=("empty",), cls=c),
        Case("inspect --format onnx without -o", ("inspect", "project/spec.yaml", "--format", "onnx"),
             mentions=("-o",), cls=c),
        Case("plan --plot into a missing folder", PLAN + ("--plot", "missing/plan.png"), mentions=("missing",),
             cls=c),
    ]


def numeric_cases() -> list[Case]:
    c = "numeric"
    # absurd but well-formed sizes may be planned (exit 0) if the plan is quick, or refused (exit 2)
    huge = ("10000000000", "1000000000000000", "1" + "0" * 40)
    cases = [Case(f"plan --context {v}", PLAN + ("--context", v), mentions=("--context",), cls=c, seconds=30,
                  expect=(0, 2) if v in huge else (2,))
             for v in ("0", "-5", "abc", "1e10", "4096.5") + huge]
    cases += [Case(f"plan --batch {v}", PLAN + ("--batch", v), mentions=("--batch",), cls=c, seconds=30,
                   expect=(0, 2) if v in huge else (2,))
              for v in ("0", "-1", "x") + huge]
    cases += [Case(f"plan --headroom {v}", PLAN + ("--headroom", v), mentions=("--headroom",), cls=c)
              for v in ("nan", "inf", "-inf", "-0.1", "1.0", "1.5", "abc")]
    cases += [Case(f"plan --{a} {v}", PLAN + (f"--{a}", v), mentions=(f"--{a}",), cls=c, seconds=30,
                   expect=(0, 2) if v in huge and a != "tp" else (2,))
              for a in ("tp", "ep", "prefill-chunk", "pp", "vpp") for v in ("0", "-2") + huge[:1]]
    cases += [
        Case("plan --tp 3 (an uneven split, planned with ceil)", PLAN + ("--tp", "3"), expect=(0,), cls=c),
        Case("plan --kv-dtype fp4", PLAN + ("--kv-dtype", "fp4"), mentions=("--kv-dtype",), cls=c),
        Case("plan --target nosuch", ("plan", "project/spec.yaml", "--target", "nosuch"), mentions=("nosuch",), cls=c),
        Case("plan valid", PLAN + ("--context", "8192"), expect=(0,), cls=c),
        Case("plan --json valid", PLAN + ("--json",), expect=(0,), cls=c),
    ]
    run = ("run", "project/spec.yaml")
    for arg, values in (("--batch", ("0", "-1", "1000000", "1" + "0" * 30)),
                        ("--prompt-len", ("0", "-4", "1000000000")),
                        ("--new-tokens", ("0", "1000000000")),
                        ("--prefill-chunk", ("0", "-1")),
                        ("--seed", ("1180591620717411303424", "-1", "1.5", "x"))):
        cases += [Case(f"run {arg} {v}", run + RUN + (arg, v), mentions=(arg,), cls=c, seconds=30) for v in values]
    # sampling values the sampler cannot compute as given: a temperature under the floor samples at the floor, a
    # top_p that underflows fp32 keeps the top token, a top_k past 2**31 is refused (issue 50: all exited 1)
    cases += [Case(f"run {' '.join(args)}", run + RUN + args + ("--seed", "1"), expect=(0,), cls=c, seconds=30)
              for args in (("--temperature", "1e-300"), ("--temperature", "1", "--top-p", "1e-300"),
                           ("--temperature", "1", "--top-p", "5e-324"))]
    cases += [Case(f"run --top-k {v}", run + RUN + ("--temperature", "1", "--top-k", v), mentions=("--top-k",), cls=c)
              for v in ("9223372036854775808", "2147483649", "-1")]
    cases += [
        Case("run --device tpu", run + RUN + ("--device", "tpu"), mentions=("tpu",), cls=c),
        Case("run --device cuda:99", run + RUN + ("--device", "cuda:99"), mentions=("cuda",), cls=c),
        Case("run --dtype float16", run + RUN + ("--dtype", "float16"), mentions=("--dtype",), cls=c),
        Case("run --strict --no-kernels", run + ("--strict", "--no-kernels"), mentions=("--strict",), cls=c),
        Case("run --tp 3", run + RUN + ("--tp", "3"), mentions=("3",), cls=c),
        Case("run --tp 0", run + RUN + ("--tp", "0"), mentions=("--tp",), cls=c),
        Case("run valid", run + RUN, expect=(0,), cls=c),
        Case("run an artifact", ("run", "art") + RUN, expect=(0,), cls=c),
        Case("calibrate-router --iterations 0", ("calibrate-router", "project/spec.yaml", "scores.safetensors", "-o",
                                                 "b.safetensors", "--iterations", "0"), mentions=("--iterations",),
             cls=c),
        Case("calibrate-router --iterations 1e9", ("calibrate-router", "project/spec.yaml", "scores.safetensors",
                                                   "-o", "b.safetensors", "--iterations", "1000000000"),
             mentions=("--iterations",), cls=c, seconds=20),
        Case("quantize --seed 2**70", ("quantize", "qspec.yaml", "--random", "--seed", "1180591620717411303424", "-o",
                                       "q"), mentions=("--seed",), cls=c),
        Case("quantize --seed -3", ("quantize", "qspec.yaml", "--random", "--seed", "-3", "-o", "q"),
             mentions=("--seed",), cls=c),
        Case("compile --rank 5 --tp 2", COMPILE + ("-o", "out", "--tp", "2", "--rank", "5"), mentions=("--rank",),
             cls=c),
        Case("compile --rank -1 --tp 2", COMPILE + ("-o", "out", "--tp", "2", "--rank", "-1"), mentions=("--rank",),
             cls=c),
        Case("compile --tp 1000000", COMPILE + ("-o", "out", "--tp", "1000000"), mentions=("1000000",), cls=c),
        Case("compile --run-dtypes float16", COMPILE + ("-o", "out", "--run-dtypes", "float16"),
             mentions=("float16",), cls=c),
        Case("compile --run-dtypes ,", COMPILE + ("-o", "out", "--run-dtypes", ","), mentions=("run dtypes",), cls=c),
    ]
    return cases


def input_file_cases() -> list[Case]:
    c = "input-file"
    run = ("run", "project/spec.yaml")
    nan = _weights(lambda t: t["embed_tokens.weight"].__setitem__((0, 0), float("nan")))
    inf = _weights(lambda t: t["layers.1.block_sparse_moe.experts.w1"].__setitem__((0, 0, 0), float("inf")))
    cases = [
        Case("inspect a FIFO", ("inspect", "fifo.yaml"), mentions=("fifo.yaml",), setup=_fifo("fifo.yaml"), cls=c,
             seconds=20),
        Case("inspect /dev/null", ("inspect", "/dev/null"), mentions=("/dev/null",), cls=c, seconds=20),
        Case("inspect /dev/zero", ("inspect", "/dev/zero"), mentions=("/dev/zero",), cls=c, seconds=20),
        Case("inspect a model dir whose config.json is a FIFO", ("inspect", "hfdir"), mentions=("config.json",),
             setup=_both(lambda r: (r / "hfdir").mkdir(), _fifo("hfdir/config.json")), cls=c, seconds=20),
        Case("inspect a folder without config.json", ("inspect", "empty"), mentions=("empty",), cls=c),
        Case("inspect a missing spec", ("inspect", "nope.yaml"), mentions=("nope.yaml",), cls=c),
        Case("inspect a NUL in the path", ("inspect", "a\0b.yaml"), mentions=("a",), cls=c),
        Case("inspect a dangling symlink", ("inspect", "dangling.yaml"), mentions=("dangling.yaml",),
             setup=_symlink("dangling.yaml", "nowhere.yaml"), cls=c),
        Case("plan --measured a FIFO", PLAN + ("--measured", "m.json"), mentions=("m.json",), setup=_fifo("m.json"),
             cls=c, seconds=20),
        Case("plan --measured missing", PLAN + ("--measured", "missing.json"), mentions=("missing.json",), cls=c),
        Case("plan --measured garbage", PLAN + ("--measured", "m.json"), mentions=("m.json",),
             setup=_write("m.json", "{not json"), cls=c),
        Case("plan --measured wrong shape", PLAN + ("--measured", "m.json"), mentions=("m.json",),
             setup=_write("m.json", '{"name": 1}'), cls=c),
        Case("plan --measured NaN seconds", PLAN + ("--measured", "m.json"), mentions=("m.json",),
             setup=_write("m.json", '[{"name": "x", "flops": 1e9, "bytes": 1e6, "seconds": NaN}]'), cls=c),
        Case("run --weights a FIFO", run + RUN + ("--weights", "w.safetensors"), mentions=("w.safetensors",),
             setup=_fifo("w.safetensors"), cls=c, seconds=20),
        Case("run --weights /dev/null", run + RUN + ("--weights", "/dev/null"), mentions=("/dev/null",), cls=c,
             seconds=20),
        Case("run --weights missing", run + RUN + ("--weights", "missing.safetensors"),
             mentions=("missing.safetensors",), cls=c),
        Case("run --weights garbage bytes", run + RUN + ("--weights", "g.safetensors"), mentions=("g.safetensors",),
             setup=_write("g.safetensors", os.urandom(4096)), cls=c),
        Case("run --weights a huge header length", run + RUN + ("--weights", "h.safetensors"),
             mentions=("h.safetensors",), setup=_write("h.safetensors", (2**60).to_bytes(8, "little") + b"{}"), cls=c),
        Case("run --weights truncated", run + RUN + ("--weights", "t.safetensors"), mentions=("t.safetensors",),
             setup=lambda r: (r / "t.safetensors").write_bytes((r / "weights.safetensors").read_bytes()[:50000]),
             cls=c),
        Case("run --weights a pickle", run + RUN + ("--weights", "w.pt"), mentions=("w.pt",),
             setup=_write("w.pt", b"\x80\x04\x95\x00"), cls=c),
        Case("run --weights a folder of pickles", run + RUN + ("--weights", "pdir"), mentions=("pdir",),
             setup=_write("pdir/pytorch_model.bin", b"\x80\x04\x95\x00"), cls=c),
        Case("run --weights an empty folder", run + RUN + ("--weights", "empty"), mentions=("empty",), cls=c),
        Case("run --weights with NaN", run + RUN + ("--weights", "bad.safetensors"),
             mentions=("embed_tokens.weight",), setup=nan, cls=c),
        Case("run --weights with inf", run + RUN + ("--weights", "bad.safetensors"),
             mentions=("experts.w1",), setup=inf, cls=c),
        Case("run --weights a missing tensor", run + RUN + ("--weights", "bad.safetensors"),
             mentions=("bad.safetensors",), setup=_weights(lambda t: t.pop("embed_tokens.weight")), cls=c),
        Case("run --weights a wrong shape", run + RUN + ("--weights", "bad.safetensors"),
             mentions=("embed_tokens.weight",),
             setup=_weights(lambda t: t.__setitem__("embed_tokens.weight", t["embed_tokens.weight"][:-1])), cls=c),
        Case("run --weights an int tensor", run + RUN + ("--weights", "bad.safetensors"),
             mentions=("embed_tokens.weight",),
             setup=_weights(lambda t: t.__setitem__("embed_tokens.weight", t["embed_tokens.weight"].long())), cls=c),
        Case("run --weights valid", run + RUN + ("--weights", "weights.safetensors"), expect=(0,), cls=c),
        Case("quantize NaN weights", ("quantize", "qspec.yaml", "bad.safetensors", "-o", "q"),
             mentions=("bad.safetensors",), setup=nan, cls=c),
        Case("quantize inf expert", ("quantize", "qspec.yaml", "bad.safetensors", "-o", "q"),
             mentions=("experts.w1",), setup=inf, cls=c),
        Case("quantize a spec without quantization", ("quantize", "plain.yaml", "--random", "-o", "q"),
             mentions=("quantization",), cls=c,
             setup=_write("plain.yaml", TINY.read_text().split("precision:")[0])),   # nor MXFP4 precision
        Case("quantize WEIGHTS and --random", ("quantize", "qspec.yaml", "weights.safetensors", "--random", "-o", "q"),
             mentions=("--random",), cls=c),
        Case("quantize --rule round", ("quantize", "qspec.yaml", "--random", "--rule", "round", "-o", "q"),
             mentions=("--rule",), cls=c),
        Case("quantize valid weights", ("quantize", "qspec.yaml", "weights.safetensors", "-o", "q"), expect=(0,),
             outputs=("q",), cls=c),
    ]
    cal = ("calibrate-router", "project/spec.yaml")
    key = "layers.1.block_sparse_moe.gate.scores"
    bias = "layers.1.block_sparse_moe.gate.e_score_correction_bias"
    for what, edit in (
            ("inf scores", lambda t: t[key].__setitem__((0, 0), float("inf"))),
            ("NaN scores", lambda t: t[key].__setitem__((0, 0), float("nan"))),
            ("negative scores", lambda t: t[key].__setitem__((0, 0), -0.5)),
            ("scores above 1", lambda t: t[key].__setitem__((0, 0), 3.0)),
            ("an inf starting bias", lambda t: t.__setitem__(bias, torch_full(NUM_EXPERTS, float("inf")))),
            ("a NaN starting bias", lambda t: t.__setitem__(bias, torch_full(NUM_EXPERTS, float("nan")))),
            ("a huge starting bias", lambda t: t.__setitem__(bias, torch_full(NUM_EXPERTS, 1e38))),
            ("a wrong expert count", lambda t: t.__setitem__(key, t[key][:, :-1])),
            ("int scores", lambda t: t.__setitem__(key, (t[key] * 10).long())),
            ("a 1-d scores tensor", lambda t: t.__setitem__(key, t[key][0])),
            ("zero tokens", lambda t: t.__setitem__(key, t[key][:0])),
            ("a dense layer", lambda t: t.__setitem__("layers.0.block_sparse_moe.gate.scores", t[key].clone())),
            ("a layer past the model", lambda t: t.__setitem__("layers.99.block_sparse_moe.gate.scores", t[key].clone())),
            ("an unknown tensor", lambda t: t.__setitem__("router.weight", t[key].clone())),
            ("a bias without scores", lambda t: t.__setitem__("layers.9.block_sparse_moe.gate.e_score_correction_bias",
                                                              torch_full(NUM_EXPERTS, 0.0)))):
        cases.append(Case(f"calibrate-router {what}", cal + ("bad-scores.safetensors", "-o", "b.safetensors"),
                          mentions=("bad-scores.safetensors",), setup=_scores(edit), cls=c))
    cases += [
        Case("calibrate-router scores a FIFO", cal + ("s.safetensors", "-o", "b.safetensors"),
             mentions=("s.safetensors",), setup=_fifo("s.safetensors"), cls=c, seconds=20),
        Case("calibrate-router scores missing", cal + ("nope.safetensors", "-o", "b.safetensors"),
             mentions=("nope.safetensors",), cls=c),
        Case("calibrate-router scores garbage", cal + ("g.safetensors", "-o", "b.safetensors"),
             mentions=("g.safetensors",), setup=_write("g.safetensors", os.urandom(100)), cls=c),
        Case("calibrate-router valid", cal + ("scores.safetensors", "-o", "b.safetensors"), expect=(0,),
             outputs=("b.safetensors",), cls=c),
    ]
    return cases


def _dense_spec() -> str:
    """k3-tiny with every layer dense and no moe: section."""
    import re

    text = re.sub(r"\nmoe:\n(  .*\n)+", "\n", TINY.read_text())
    return text.replace("first_k_dense: 1", "first_k_dense: 8")


def torch_full(n: int, value: float):
    import torch

    return torch.full((n,), value)


def artifact_cases() -> list[Case]:
    c = "artifact"
    run = ("run", "art") + RUN

    def case(what, setup, mentions):
        return Case(f"run an artifact with {what}", run, mentions=mentions, setup=setup, cls=c)

    return [
        case("no manifest", _artifact(_rm("manifest.json")), ("art",)),
        case("a garbage manifest", _artifact(lambda a: (a / "manifest.json").write_text("{oops")), ("manifest",)),
        case("a manifest that is a list", _artifact(lambda a: (a / "manifest.json").write_text("[]")), ("manifest",)),
        case("a FIFO manifest", _artifact(lambda a: ((a / "manifest.json").unlink(), os.mkfifo(a / "manifest.json"))),
             ("manifest.json",)),
        case("a symlinked manifest", _artifact(lambda a: (os.replace(a / "manifest.json", a / "m.json"),
                                                         os.symlink("m.json", a / "manifest.json"))),
             ("manifest.json",)),
        case("spec.yaml missing", _artifact(_rm("spec.yaml")), ("spec.yaml",)),
        case("model.k3c missing", _artifact(_rm("model.k3c")), ("model.k3c",)),
        case("ir/ missing", _artifact(_rm("ir")), ("ir",)),
        case("report.md missing", _artifact(_rm("report.md")), ("report.md",)),
        case("model.k3c changed", _artifact(_append("model.k3c", "\n")), ("model.k3c",)),
        case("spec.yaml changed", _artifact(_append("spec.yaml", "\n# edited\n")), ("spec.yaml",)),
        case("an IR stage changed", _artifact(_append("ir/000_frontend.k3c", "\n")), ("000_frontend.k3c",)),
        case("a value defined twice (resealed)", _artifact(_duplicate_first_value, reseal=True), ("model.k3c",)),
        case("spec.yaml a symlink to /etc/passwd", _artifact(_link_spec_to_passwd), ("spec.yaml",)),
        case("spec.yaml a symlink to /etc/passwd (resealed)", _artifact(_link_spec_to_passwd, reseal=True),
             ("spec.yaml",)),
        case("ir/ a symlink", _artifact(lambda a: (os.replace(a / "ir", a / "ir2"), os.symlink("ir2", a / "ir")),
                                        reseal=True), ("ir",)),
        case("a manifest entry outside it", _manifest(lambda m: m["sha256"].__setitem__("../weights.safetensors",
                                                                                       "0" * 64)), ("outside",)),
        case("a manifest entry absolute", _manifest(lambda m: m["sha256"].__setitem__("/etc/passwd", "0" * 64)),
             ("/etc/passwd",)),
        case("no sha256 list", _manifest(lambda m: m.pop("sha256")), ("sha256",)),
        case("an unknown target", _manifest(lambda m: m["target"].__setitem__("name", "tpu9")), ("tpu9",)),
        case("a changed target row", _manifest(lambda m: m["target"].__setitem__("hbm_bytes", 1)), ("target",)),
        case("a target that is a string", _manifest(lambda m: m.__setitem__("target", "cpu")), ("target",)),
        case("another format", _manifest(lambda m: m.__setitem__("format", "k3c-artifact/0")), ("art",)),
        case("bad run_dtypes", _manifest(lambda m: m.__setitem__("run_dtypes", ["f16"])), ("run_dtypes",)),
        case("a garbage kernel entry", _manifest(lambda m: m.__setitem__("kernels", [{"name": 3}])), ("kernel",)),
        case("an IR stage that does not parse", _artifact(_append("ir/000_frontend.k3c", "%%% garbage\n"),
                                                          reseal=True), ("000_frontend.k3c",)),
        case("a spec.yaml that does not parse", _artifact(lambda a: (a / "spec.yaml").write_text("name: [\n"),
                                                          reseal=True), ("spec.yaml",)),
        case("a file it does not list", _artifact(_user_file_in_art), ("mynotes.txt",)),
        case("a files entry naming /etc/passwd",
             _manifest(lambda m: m["files"].__setitem__("spec", "../../../etc/passwd")), ("files.spec", "outside")),
        case("a files entry naming an unlisted file", _manifest(lambda m: m["files"].__setitem__("ir", "other.k3c")),
             ("files.ir", "other.k3c")),
        case("files that is a list", _manifest(lambda m: m.__setitem__("files", ["spec.yaml"])), ("'files'",)),
        case("a 100,000-deep manifest", _artifact(lambda a: (a / "manifest.json").write_text(
            '{"a": ' * 100_000 + "1" + "}" * 100_000)), ("manifest.json", "deeper")),
        case("a 100-deep manifest", _manifest(lambda m: m.__setitem__("x", json.loads("[" * 100 + "]" * 100))),
             ("manifest.json", "deeper")),
        Case("run an artifact through a symlinked directory", ("run", "latest") + RUN, expect=(0,),
             setup=lambda r: os.symlink("art", r / "latest"), cls=c),
        Case("inspect an artifact through a symlinked directory", ("inspect", "latest"), expect=(0,),
             setup=lambda r: os.symlink("art", r / "latest"), cls=c),
    ]


def command_line_cases() -> list[Case]:
    c = "command-line"
    return [
        Case("no command", (), mentions=("command",), cls=c),
        Case("an unknown command", ("frobnicate",), mentions=("frobnicate",), cls=c),
        Case("compile without --target", ("compile", "project/spec.yaml", "-o", "out"), mentions=("--target",), cls=c),
        Case("compile without -o", ("compile", "project/spec.yaml", "--target", "cpu"), mentions=("-o",), cls=c),
        Case("compile --target nosuch", ("compile", "project/spec.yaml", "--target", "nosuch", "-o", "out"),
             mentions=("nosuch",), cls=c),
        Case("compile --passes nosuch", COMPILE + ("-o", "out", "--passes", "nosuch"), mentions=("nosuch",), cls=c),
        Case("compile --passes ,", COMPILE + ("-o", "out", "--passes", ","), mentions=("--passes",), cls=c),
        Case("compile --passes dce,dce,nosuch", COMPILE + ("-o", "out", "--passes", "dce,nosuch"),
             mentions=("nosuch",), cls=c),
        Case("inspect --after nosuch", ("inspect", "project/spec.yaml", "--after", "nosuch"), mentions=("nosuch",),
             cls=c),
        Case("inspect --format xml", ("inspect", "project/spec.yaml", "--format", "xml"), mentions=("--format",),
             cls=c),
        Case("inspect --target nosuch", ("inspect", "project/spec.yaml", "--target", "nosuch"),
             mentions=("nosuch",), cls=c),
        Case("inspect an artifact folder", ("inspect", "art"), expect=(0,), cls=c),
        Case("inspect an artifact folder --target", ("inspect", "art", "--target", "h200"), mentions=("--target",),
             cls=c),
        Case("inspect a tampered artifact folder", ("inspect", "art"), mentions=("spec.yaml",),
             setup=_artifact(_link_spec_to_passwd, reseal=True), cls=c),
        Case("inspect an artifact's spec.yaml", ("inspect", "art/spec.yaml"), expect=(0,), cls=c),
        Case("run a folder that is nothing", ("run", "empty") + RUN, mentions=("empty",), cls=c),
        Case("calibrate-router a spec without MoE", ("calibrate-router", "dense.yaml", "scores.safetensors", "-o",
                                                     "b.safetensors"), mentions=("MoE",),
             setup=lambda r: (r / "dense.yaml").write_text(_dense_spec()), cls=c),
        Case("quantize without -o", ("quantize", "qspec.yaml", "--random"), mentions=("-o",), cls=c),
        Case("inspect valid", ("inspect", "project/spec.yaml"), expect=(0,), cls=c),
        Case("inspect --bytes valid", ("inspect", "project/spec.yaml", "--bytes"), expect=(0,), cls=c),
        Case("version", ("--version",), expect=(0,), cls=c),
        Case("serve --header-timeout 0", ("serve", "project/spec.yaml", "--header-timeout", "0"),
             mentions=("--header-timeout",), cls=c),
        Case("serve --body-timeout nan", ("serve", "project/spec.yaml", "--body-timeout", "nan"),
             mentions=("--body-timeout",), cls=c),
    ]


def environment_cases() -> list[Case]:
    c = "environment"
    compile_ = COMPILE + ("-o", "out")
    return [
        Case("K3C_CACHE_DIR a file", compile_, expect=(0,), outputs=("out",), env=(("K3C_CACHE_DIR",
                                                                                   "project/notes.txt"),), cls=c),
        Case("K3C_CACHE_DIR /dev/null", compile_, expect=(0,), outputs=("out",), env=(("K3C_CACHE_DIR", "/dev/null"),),
             cls=c),
        Case("K3C_CACHE_DIR below a file", compile_, expect=(0,), outputs=("out",),
             env=(("K3C_CACHE_DIR", "project/notes.txt/cache"),), cls=c),
        Case("K3C_DEBUG not a number", ("inspect", "project/spec.yaml"), expect=(0,), env=(("K3C_DEBUG", "loud"),),
             cls=c),
        Case("K3C_NO_JIT garbage", ("inspect", "project/spec.yaml"), expect=(0,), env=(("K3C_NO_JIT", "maybe"),),
             cls=c),
    ]


def all_cases() -> list[Case]:
    cases = (output_dir_cases() + numeric_cases() + input_file_cases() + artifact_cases() + command_line_cases()
             + environment_cases())
    names = [case.name for case in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases
