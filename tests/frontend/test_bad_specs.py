"""The bad-spec corpus: every file in bad_specs/ must fail with one SpecError line naming file, line and field.

bad_specs/EXPECTED.yaml holds the expectation of each file (line, field, a substring of the message). Cases that
cannot be committed (a directory, a missing file, a gigantic file) are generated here.
"""
from __future__ import annotations

import os
import tracemalloc

import pytest
import yaml

from k3c.errors import SpecError, UserError
from k3c.frontend import load_spec, parse_spec_text, yaml_loader
from k3c.frontend.located import MAX_SPEC_BYTES
from k3c.frontend.yaml_loader import MAX_YAML_BYTES

from .conftest import BAD_SPECS

EXPECTED = yaml.safe_load((BAD_SPECS / "EXPECTED.yaml").read_text())
CORPUS = sorted(p.name for p in BAD_SPECS.iterdir() if p.name != "EXPECTED.yaml")


def _assert_one_line(err: SpecError, path: str) -> str:
    text = str(err)
    assert text == err.render()
    assert text.splitlines() == [text], f"not one line: {text!r}"
    assert text.isprintable(), f"control characters in: {text!r}"
    assert text.startswith(path), text
    assert err.file == path
    assert isinstance(err, UserError) and err.exit_code == 2
    return text


def test_corpus_and_table_agree():
    assert len(CORPUS) >= 40
    assert sorted(EXPECTED) == CORPUS, "every corpus file needs a row in EXPECTED.yaml and vice versa"
    for name, row in EXPECTED.items():
        assert set(row) == {"what", "line", "field", "message"}, name
        assert row["message"], name


@pytest.mark.parametrize("name", CORPUS)
def test_bad_spec(name):
    want = EXPECTED[name]
    path = str(BAD_SPECS / name)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    text = _assert_one_line(err, path)
    assert want["message"] in err.message, f"{name}: {text}"
    assert err.line == want["line"], f"{name}: {text}"
    assert err.field == want["field"], f"{name}: {text}"
    if want["line"] is not None:
        assert f"{path}:{want['line']}: " in text
    if want["field"] is not None:
        assert f"field '{want['field']}'" in text


@pytest.mark.parametrize("name", ["alias_billion_laughs.yaml", "alias_merge_bomb.yaml"])
def test_alias_bombs_are_cheap(name, monkeypatch):
    # refused before construction: no value is ever built, and memory stays small (work bounds, not wall time)
    built = []
    original = yaml_loader._LocatingSafeLoader.construct_object
    monkeypatch.setattr(yaml_loader._LocatingSafeLoader, "construct_object",
                        lambda self, node, deep=False: built.append(node) or original(self, node, deep))
    text = (BAD_SPECS / name).read_text()
    tracemalloc.start()
    try:
        with pytest.raises(SpecError, match="alias bomb"):
            parse_spec_text(text, name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built == []
    assert peak < 20 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_python_tag_never_runs(tmp_path):
    marker = "/tmp/k3c_pwned"
    if os.path.exists(marker):
        os.remove(marker)
    with pytest.raises(SpecError):
        load_spec(BAD_SPECS / "tag_python_os_system.yaml")
    assert not os.path.exists(marker)


# ---- generated cases ------------------------------------------------------------------------------------------
def test_directory(tmp_path):
    d = tmp_path / "spec.yaml"
    d.mkdir()
    with pytest.raises(SpecError, match="is a directory") as info:
        load_spec(d)
    _assert_one_line(info.value, str(d))


def test_directory_read_directly(tmp_path):
    from k3c.frontend.located import read_spec_text

    with pytest.raises(SpecError, match="is a directory") as info:
        read_spec_text(str(tmp_path))
    _assert_one_line(info.value, str(tmp_path))


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="no such file") as info:
        load_spec(path)
    _assert_one_line(info.value, str(path))


def test_path_with_nul():
    with pytest.raises(SpecError, match="not a usable path") as info:
        load_spec("bad\0name.yaml")
    assert "\0" not in str(info.value)


def test_gigantic_file(tmp_path):
    path = tmp_path / "huge.yaml"
    chunk = b"# padding padding padding padding padding padding padding padding padding padding\n" * 1000
    with open(path, "wb") as fh:
        for _ in range(16 * 2**20 // len(chunk)):          # 16 MiB, written at test time, never committed
            fh.write(chunk)
    tracemalloc.start()                          # only the first MAX_SPEC_BYTES + 1 bytes are read, not the 16 MiB
    try:
        with pytest.raises(SpecError, match="larger than") as info:
            load_spec(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_SPEC_BYTES + 2**20, f"peak {peak / 2**20:.1f} MiB for a 16 MiB file"
    _assert_one_line(info.value, str(path))


def test_just_over_the_limit_with_multibyte_text():
    # just over the limit in 3-byte characters: refused on bytes, whatever the character count
    text = "# " + "\u20ac" * (MAX_YAML_BYTES // 3 + 10) + "\n"
    assert len(text) < MAX_YAML_BYTES
    with pytest.raises(SpecError, match="larger than"):
        parse_spec_text(text, "big.yaml")
    with pytest.raises(SpecError, match="larger than"):
        parse_spec_text(text.encode(), "big.yaml")


def test_many_nodes_fail_fast(monkeypatch):
    # composition stops at the node limit: the scanner never reaches the rest of the list (a work bound, not time)
    composed, furthest = [0], [0]
    original = yaml_loader._LocatingSafeLoader.compose_node

    def counting(self, parent, index):
        composed[0] += 1
        furthest[0] = max(furthest[0], self.index)
        return original(self, parent, index)

    monkeypatch.setattr(yaml_loader._LocatingSafeLoader, "compose_node", counting)
    text = "name: x\nmodel: {hidden_size: 8, vocab_size: 8}\njunk: [" + "0," * 60_000 + "0]\n"
    with pytest.raises(SpecError, match="YAML nodes") as info:
        parse_spec_text(text, "many.yaml")
    assert info.value.line == 3
    assert composed[0] == yaml_loader.MAX_NODES + 1
    assert furthest[0] < len(text) // 4, (furthest[0], len(text))


def test_unreadable_file(tmp_path):
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("root can read anything")
    path = tmp_path / "locked.yaml"
    path.write_text("name: x\n")
    path.chmod(0)
    with pytest.raises(SpecError, match="cannot read") as info:
        load_spec(path)
    _assert_one_line(info.value, str(path))


def test_bytes_input():
    with pytest.raises(SpecError, match="not UTF-8"):
        parse_spec_text(b"\xff\xfe\x00garbage", "b.yaml")


def test_file_name_with_newline_stays_one_line():
    with pytest.raises(SpecError) as info:
        parse_spec_text("[1, 2]", "evil\nname.yaml")
    assert len(str(info.value).splitlines()) == 1
