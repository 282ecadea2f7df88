"""The output-directory policy (k3c/outputs.py) as compile's save, quantize and --dump-ir use it: k3c replaces only
what it wrote, checks the path before the long work, swaps directories atomically (concurrent writers and readers
included) and sweeps the staging folders of dead processes."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import k3c
from k3c import outputs
from k3c.errors import ArgumentError, UserError
from k3c.outputs import ARTIFACT, DUMP, QUANTIZED, Staging, check_output_dir, classify, sweep

TINY = "examples/k3-tiny.yaml"


@pytest.fixture(scope="module")
def model():
    return k3c.compile(TINY, target="cpu")


def leftovers(parent):
    return sorted(n for n in os.listdir(parent) if n.startswith(".k3c-"))


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- what may be replaced ------------------------------------------------------------------------------------------

def test_force_never_replaces_a_user_folder(model, tmp_path):
    proj = tmp_path / "project"
    (proj / "sub").mkdir(parents=True)
    (proj / "spec.yaml").write_text("mine")
    (proj / "sub" / "keep.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(ArgumentError, match=r"not a k3c artifact .*with or without --force"):
            model.save(proj, overwrite=overwrite)
    assert (proj / "spec.yaml").read_text() == "mine" and (proj / "sub" / "keep.txt").read_text() == "keep me"
    assert leftovers(tmp_path) == []


def test_an_artifact_is_replaced_with_force_only_and_never_with_a_user_file_in_it(model, tmp_path):
    art = tmp_path / "art"
    model.save(art)
    with pytest.raises(ArgumentError, match="pass --force"):
        model.save(art)
    ino = os.stat(art).st_ino
    model.save(art, overwrite=True)
    assert os.stat(art).st_ino != ino and k3c.load(art).module == model.module
    (art / "ir" / "mynotes.txt").write_text("the user's")
    with pytest.raises(ArgumentError, match=r"holds ir/mynotes.txt, which k3c did not write"):
        model.save(art, overwrite=True)
    assert (art / "ir" / "mynotes.txt").read_text() == "the user's"
    assert leftovers(tmp_path) == []


def test_an_empty_folder_is_fine_and_kinds_do_not_mix(model, tmp_path):
    (tmp_path / "empty").mkdir()
    model.save(tmp_path / "empty")
    assert k3c.load(tmp_path / "empty").spec == model.spec
    assert classify(str(tmp_path / "empty"))[0] == ARTIFACT
    with pytest.raises(ArgumentError, match="is a k3c artifact, not a k3c quantized checkpoint"):
        check_output_dir(tmp_path / "empty", True, kind=QUANTIZED)


@pytest.mark.parametrize("make", ["dir-link", "dangling", "file", "below-file", "long", "nul", "unwritable"])
def test_bad_output_paths_are_refused_before_any_work(model, tmp_path, monkeypatch, make):
    (tmp_path / "project").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    path, needle = {
        "dir-link": (tmp_path / "link", "symlink"), "dangling": (tmp_path / "dangling", "symlink"),
        "file": (tmp_path / "notes.txt", "not a directory"),
        "below-file": (tmp_path / "notes.txt" / "out", "notes.txt is not a directory"),
        "long": (tmp_path / ("x" * 300), "more than the 255"), "nul": (str(tmp_path / "a\0b"), "not a usable path"),
        "unwritable": ("/sys/k3c-test-out", "cannot create it in /sys"),
    }[make]
    if make == "dir-link":
        os.symlink(tmp_path / "project", path)
    if make == "dangling":
        os.symlink(tmp_path / "nowhere", path)

    def no_compile(*a, **k):
        raise AssertionError("compiled before the output path was checked")

    monkeypatch.setattr(model, "compile_kernels", no_compile)
    for call in (lambda: check_output_dir(path, True), lambda: model.save(path, overwrite=True)):
        with pytest.raises(ArgumentError, match=needle) as info:
            call()
        assert "\n" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == sorted(["project", "notes.txt"] + (["link"] if make == "dir-link" else [])
                                                  + (["dangling"] if make == "dangling" else []))


def test_a_long_output_name_that_fits_gets_a_short_staging_name(model, tmp_path):
    art = tmp_path / ("a" * 250)
    model.save(art)
    model.save(art, overwrite=True)
    assert k3c.load(art).module == model.module and leftovers(tmp_path) == []


# ---- staging, sweeping, concurrency --------------------------------------------------------------------------------

def test_stale_staging_of_dead_processes_is_swept_live_ones_are_not(model, tmp_path):
    dead, live = dead_pid(), os.getppid()
    names = {f".k3c-tmp-art-{dead}-0badc0de": True, f".k3c-old-art-{dead}-00ff00ff": True,
             f".k3c-tmp-art-{live}-12345678": False, f".k3c-tmp-other-{dead}-12345678": False,
             f".k3c-tmp-art-12-{dead}-abcdef00": False}          # output "art-12": not this name
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    model.save(tmp_path / "art")
    assert leftovers(tmp_path) == sorted(n for n, gone in names.items() if not gone)
    assert sweep(str(tmp_path), "art") == []


def test_staging_name_carries_the_pid(tmp_path):
    with Staging(tmp_path / "out") as st:
        assert os.path.basename(st.dir).startswith(f".k3c-tmp-out-{os.getpid()}-")
        (tmp_path / "out").mkdir()      # someone else's empty folder appears meanwhile: still fine
        st.commit()
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_concurrent_forced_saves_and_a_reader_all_succeed(model, tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    art = tmp_path / "art"
    model.save(art)
    errors, loads, done = [], [], threading.Event()

    def writer():
        try:
            for _ in range(4):
                model.save(art, overwrite=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader():
        try:
            while not done.is_set():
                loads.append(k3c.load(art).cache_key)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    r.join()
    assert errors == [] and loads and set(loads) == {model.cache_key}
    assert leftovers(tmp_path) == [] and os.listdir(tmp_path) == ["art"]


def test_two_cli_compiles_with_force_to_one_output_both_exit_0(tmp_path):
    art = tmp_path / "art"
    cmd = [sys.executable, "-m", "k3c.cli", "compile", TINY, "--target", "cpu", "-o", str(art), "--force",
           "--passes", "dce"]
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    assert subprocess.run(cmd, capture_output=True, env=env, timeout=300).returncode == 0
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    assert [code for code, _ in results] == [0, 0], results
    assert k3c.load(art).pass_names == ["dce"] and leftovers(tmp_path) == []


# ---- --dump-ir -----------------------------------------------------------------------------------------------------

def test_dump_ir_refuses_files_symlinks_and_user_folders(tmp_path):
    from k3c.frontend.to_ir import spec_to_module
    from k3c.passes.pipeline import run_pipeline

    module = spec_to_module(k3c.load_spec(TINY))
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "000_frontend.k3c").write_text("my own file")
    os.symlink(tmp_path / "user", tmp_path / "link")
    for path, needle in ((tmp_path / "notes.txt", "not a directory"), (tmp_path / "notes.txt" / "d", "notes.txt"),
                         (tmp_path / "user", "not a k3c IR dump directory"), (tmp_path / "link", "symlink"),
                         ("/dev/null", "not a directory")):
        with pytest.raises(ArgumentError, match=needle) as info:
            run_pipeline(module, ["dce"], dump_dir=path)
        assert str(info.value).startswith(f"--dump-ir {path}")
    assert (tmp_path / "user" / "000_frontend.k3c").read_text() == "my own file"
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "user") == []


def test_dump_ir_replaces_its_own_dumps_whole(tmp_path):
    from k3c.frontend.to_ir import spec_to_module
    from k3c.passes.pipeline import run_pipeline

    module = spec_to_module(k3c.load_spec(TINY))
    dumps = tmp_path / "dumps"
    run_pipeline(module, ["dce", "cse"], dump_dir=dumps)
    assert sorted(os.listdir(dumps)) == ["000_frontend.k3c", "001_dce.k3c", "002_cse.k3c"]
    assert classify(str(dumps)) == (DUMP, None)
    _, records = run_pipeline(module, ["cse"], dump_dir=dumps)
    assert sorted(os.listdir(dumps)) == ["000_frontend.k3c", "001_cse.k3c"]      # no stale 002 left over
    assert records[0].dump == str(dumps / "001_cse.k3c") and leftovers(tmp_path) == []


def test_dumps_inside_the_output_are_carried_listed_and_replaced(tmp_path):
    out, dumps = tmp_path / "out", tmp_path / "out" / "ir-dumps"
    for overwrite in (False, True):
        model = k3c.compile(TINY, target="cpu", passes=["dce"], dump_ir=dumps)
        check_output_dir(out, overwrite, keep=dumps)
        model.save(out, overwrite=overwrite, keep=dumps)
        manifest = json.loads((out / "manifest.json").read_text())
        assert "ir-dumps/001_dce.k3c" in manifest["sha256"] and k3c.load(out).pass_names == ["dce"]
    assert leftovers(tmp_path) == [] and leftovers(out) == []


def test_the_cli_checks_the_output_before_writing_dumps(tmp_path):
    from k3c.cli import main

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("x")
    code = main(["compile", TINY, "--target", "cpu", "-o", str(tmp_path / "project"), "--dump-ir",
                 str(tmp_path / "dumps")])
    assert code == 2
    assert sorted(os.listdir(tmp_path)) == ["project"]


# ---- quantize and the cache ----------------------------------------------------------------------------------------

def test_quantize_output_policy(tmp_path):
    from k3c.commands.quantize import save_quantized_checkpoint

    spec_path = tmp_path / "q.yaml"
    spec_path.write_text(open(TINY).read().split("precision:")[0] + "quantization:\n  format: mxfp4\n")
    spec = k3c.load_spec(spec_path)
    w = k3c.init_weights(spec, seed=0, dtype=torch.bfloat16)
    user = tmp_path / "user"
    user.mkdir()
    (user / "keep").write_text("x")
    with pytest.raises(ArgumentError, match="not a k3c quantized checkpoint"):
        save_quantized_checkpoint(spec, w, user, force=True)
    assert os.listdir(user) == ["keep"]
    q = tmp_path / "q"
    q.mkdir()
    save_quantized_checkpoint(spec, w, q)                                        # an empty folder is fine
    with pytest.raises(ArgumentError, match="pass --force"):
        save_quantized_checkpoint(spec, w, q)
    save_quantized_checkpoint(spec, w, q, force=True)
    assert sorted(os.listdir(q)) == ["model.safetensors", "quantization.json"]
    (q / "extra.txt").write_text("mine")
    with pytest.raises(ArgumentError, match="holds extra.txt"):
        save_quantized_checkpoint(spec, w, q, force=True)
    assert (q / "extra.txt").read_text() == "mine" and leftovers(tmp_path) == []


def test_cache_artifacts_are_replaced_even_when_damaged(model, tmp_path, monkeypatch):
    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "cache"))
    from k3c import config

    if hasattr(config.settings, "cache_clear"):
        config.settings.cache_clear()
    fresh = k3c.compile(TINY, target="cpu")
    path = fresh.ensure_artifact(progress=False)
    assert path.startswith(str(tmp_path / "cache")) and k3c.load(path).cache_key == fresh.cache_key
    with open(os.path.join(path, "stray.txt"), "w") as fh:       # damaged: load refuses it, the cache rewrites it
        fh.write("x")
    again = k3c.compile(TINY, target="cpu")
    assert again.ensure_artifact(progress=False) == path
    assert not os.path.exists(os.path.join(path, "stray.txt")) and k3c.load(path).cache_key == fresh.cache_key
    with pytest.raises(UserError):
        (tmp_path / "x").mkdir()
        k3c.load(tmp_path / "x")


@pytest.mark.parametrize("cache", ["/dev/null", "notes.txt"])
def test_an_unusable_cache_dir_gets_a_private_artifact(cache, tmp_path, monkeypatch, capfd):
    """K3C_CACHE_DIR naming /dev/null or a file: the runtime's artifact goes into a temp dir of this process (one
    warning), nothing is written where K3C_CACHE_DIR points."""
    (tmp_path / "notes.txt").write_text("a user's file\n")
    fresh = k3c.compile(TINY, target="cpu")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("K3C_CACHE_DIR", cache)
    path = fresh.ensure_artifact(progress=False)
    assert not path.startswith(str(tmp_path)) and k3c.load(path).cache_key == fresh.cache_key
    assert "not usable" in capfd.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "a user's file\n"


def test_a_path_moved_aside_between_the_rename_and_the_check_is_retried(model, tmp_path, monkeypatch):
    """Another writer (rename-aside form) moves the old artifact away just after our rename found it in place:
    the path is then missing, not "replaced by something else", and the commit tries again."""
    art = tmp_path / "art"
    model.save(art)
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    real_rename, moved = os.rename, []

    def rename(src, dst):
        if os.fspath(dst) == str(art) and not moved:        # the first attempt: art exists, then vanishes
            real_rename(art, tmp_path / "elsewhere")
            moved.append(True)
            raise OSError(39, "Directory not empty")        # ENOTEMPTY, as the failed rename reported it
        return real_rename(src, dst)

    monkeypatch.setattr(outputs.os, "rename", rename)
    model.save(art, overwrite=True)
    assert moved and k3c.load(art).cache_key == model.cache_key
