import pytest

from k3c.errors import IRParseError, UserError
from k3c.ir import parse_module

HEAD = "module @m {\n"
OK_OP = '  %x = input() {name = "x"} : bf16[B, 4]\n'


@pytest.mark.parametrize("text, line, fragment", [
    ("", 1, "no 'module @name {'"),
    ("%x = input()\n", 1, "expected 'module @name'"),
    ("module m {\n", 1, "module name"),
    (HEAD + OK_OP + "  return %x\n", 3, "missing '}'"),
    (HEAD + OK_OP + "}\n", 3, "without a 'return'"),
    (HEAD + OK_OP + "  %y = add(%x, %x\n  return %y\n}\n", 3, "expected ')'"),
    (HEAD + OK_OP + "  %y = add(%x, %x) {a = 1,} : bf16[B, 4]\n", 3, "attribute name"),
    (HEAD + OK_OP + "  %y = add(%x) {a 1} : bf16[B, 4]\n", 3, "expected '='"),
    (HEAD + OK_OP + '  %y = add(%x) {a = "open} : bf16[B, 4]\n', 3, "unterminated string"),
    (HEAD + OK_OP + '  %y = add(%x) {a = "bad \\q"} : bf16[B, 4]\n', 3, "unknown escape"),
    (HEAD + OK_OP + "  %y = add(%x) {a = foo} : bf16[B, 4]\n", 3, "attribute value"),
    (HEAD + OK_OP + "  %y = add(%x) : bf16[B, 4.5]\n", 3, "dimension"),
    (HEAD + OK_OP + "  %y = add(%x) : bf16[B, -4]\n", 3, "invalid dimension"),
    (HEAD + OK_OP + "  %y, %z = add(%x) : bf16[B, 4]\n", 3, "2 results but 1 types"),
    (HEAD + OK_OP + "  %y = add(%x) : bf16[B, 4] loc(12)\n", 3, "loc string"),
    (HEAD + OK_OP + "  %y = add(%x) : bf16[B, 4] extra\n", 3, "after the end of the statement"),
    (HEAD + OK_OP + "  %y = add(%x) $\n", 3, "unexpected character '$'"),
    (HEAD + OK_OP + "  return %x\n  %z = add(%x)\n}\n", 4, "op after 'return'"),
    (HEAD + OK_OP + "  return %x\n}\n%junk\n", 5, "after the end of the module"),
    (HEAD + OK_OP + "  %y = add(%x) {a = 1, a = 2} : bf16[B, 4]\n", 3, "given twice"),
])
def test_parse_errors_name_the_line(text, line, fragment):
    with pytest.raises(IRParseError) as info:
        parse_module(text, source="t.k3c")
    err = info.value
    assert err.line == line
    assert f"t.k3c:{line}" in str(err)
    assert fragment in str(err)
    assert isinstance(err, UserError)    # a bad IR file is bad user input: exit code 2


def test_no_eval_of_text():
    # Python syntax is not IR: nothing is evaluated, the parser just rejects it
    with pytest.raises(IRParseError):
        parse_module(HEAD + '  %y = add(%x) {a = __import__("os").system("true")}\n  return %y\n}\n')
