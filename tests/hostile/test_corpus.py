"""The hostile-input corpus: every case exits 0 (valid) or 2 (one line naming the file, field or argument), with
no traceback, within its time, changing nothing outside k3c's own outputs and leaving nothing half-written.

Cases: every file of the bad-spec corpus (tests/frontend/bad_specs) through `k3c inspect` and a sample through
`k3c compile`, plus the classes in cases.py (output folders, numeric arguments, input files, artifacts, the
command line, the environment). test_corpus_size keeps the count honest.
"""
from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from .cases import all_cases, build_base
from .sandbox import REPO, Case, changed_outside, leftovers, run_cli, snapshot

BAD_SPECS = REPO / "tests" / "frontend" / "bad_specs"
SPEC_FILES = sorted(p.name for p in BAD_SPECS.iterdir() if p.name != "EXPECTED.yaml")
COMPILED_SPECS = SPEC_FILES[::10]


def spec_cases() -> list[Case]:
    cases = [Case(f"inspect bad spec {name}", ("inspect", str(BAD_SPECS / name)), mentions=(str(BAD_SPECS / name),),
                  cls="spec", seconds=30) for name in SPEC_FILES]
    cases += [Case(f"compile bad spec {name}", ("compile", str(BAD_SPECS / name), "--target", "cpu", "-o", "out"),
                   mentions=(str(BAD_SPECS / name),), cls="spec", seconds=30) for name in COMPILED_SPECS]
    return cases


CASES = spec_cases() + all_cases()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-base")
    build_base(root)
    return root


@pytest.fixture
def sandbox(base, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "sandbox"
    shutil.copytree(base, root, symlinks=True)
    monkeypatch.chdir(root)
    monkeypatch.delenv("K3C_DEBUG", raising=False)
    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "cache"))
    return root


def test_corpus_size():
    by_class = Counter(case.cls for case in CASES)
    assert len(CASES) >= 300, by_class
    assert all(n >= 5 for n in by_class.values()), by_class


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case: Case, sandbox: Path, monkeypatch):
    if case.setup is not None:
        case.setup(sandbox)
    for key, value in case.env:
        monkeypatch.setenv(key, value)
    before = snapshot(sandbox)
    outcome = run_cli(list(case.argv), case.seconds)
    where = f"{case.name}: rc {outcome.rc}, stderr {outcome.stderr!r}"
    assert "Traceback" not in outcome.stderr + outcome.stdout, where
    assert outcome.rc in case.expect, where
    if outcome.rc == 2:
        lines = outcome.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("k3c: error: "), where
        for needle in case.mentions:
            assert needle in lines[0], f"{where}: does not name {needle!r}"
    changed = changed_outside(before, snapshot(sandbox), case.outputs if outcome.rc == 0 else ())
    assert not changed, f"{where}: changed outside its outputs: {changed[:5]}"
    assert not leftovers(sandbox), f"{where}: left behind {leftovers(sandbox)}"
    if case.check is not None:
        case.check(sandbox)
    assert not os.path.exists(sandbox / "out") or outcome.rc == 0 or "out" in case.outputs, where
