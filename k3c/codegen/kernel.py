"""What an emitter produces and the AOT compiler consumes: one generated Triton kernel, specialised on shapes."""
from __future__ import annotations

import functools
import hashlib
import io
import tokenize
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelSource:
    """One @triton.jit kernel in a self-contained Python module text.

    name:        kernel function name in `source` (descriptive: k3c_rmsnorm_residual_fwd_d7168)
    source:      the module text (imports triton and triton.language as tl; defines exactly this jit function
                 plus any @triton.jit helpers it calls)
    signature:   argument name -> Triton type string for runtime args ("*bf16", "*fp32", "i32", "fp32", ...)
    constexprs:  argument name -> value for tl.constexpr args (block sizes, shapes baked in)
    grid:        launch-grid rule as a tuple of expressions over symbolic sizes, e.g. ("cdiv(M, 64)", "1", "1");
                 the runtime evaluates them with a tiny safe evaluator (names + integer ops), never eval()
    num_warps, num_stages: launch options
    ir_op:       the IR op this kernel implements (for the header comment and the manifest)
    loc:         its spec location ("examples/k3-tiny.yaml:13")
    tier:        "portable" (@triton.jit, any target) or a tier of k3c.codegen.tiers (@gluon.jit for one arch)
    builds_with: for a tier kernel, the Triton release ("3.9") whose Gluon API its source is written in
    """

    name: str
    source: str
    signature: dict[str, str]
    constexprs: dict[str, int | float | bool] = field(default_factory=dict)
    grid: tuple[str, ...] = ("1",)
    num_warps: int = 4
    num_stages: int = 2
    ir_op: str = ""
    loc: str = ""
    tier: str = "portable"          # the source differs between tiers, so neither field enters the key
    builds_with: str = ""

    @functools.cached_property
    def key(self) -> str:
        """The kernel's identity in the catalogue: its code without comments (the header names the IR op, the spec
        location and the target, which do not change what runs), signature, constexprs, grid and launch options.
        The AOT artifact and the runtime compute it alike, so equal code has one key wherever it was emitted."""
        return self._fingerprint(code_text(self.source), 20)

    @property
    def digest(self) -> str:
        """The fingerprint of the exact source text, comments included (recorded in the manifest)."""
        return self._fingerprint(self.source, 16)

    @functools.cached_property
    def compile_source(self) -> str:
        """What the AOT compiler compiles: `source` with the text of every comment dropped (lines and columns of
        the code unchanged, so line info still points into kernels/<name>.py). The header's spec location and
        target do not reach the binary or the AOT cache key: a renamed spec hits the cache and gives equal bytes."""
        return blank_comments(self.source)

    @functools.cached_property
    def compile_digest(self) -> str:
        """`digest` over `compile_source`: the AOT cache's view of the kernel."""
        return self._fingerprint(self.compile_source, 16, salt=b"compile_source\0")

    def _fingerprint(self, code: str, length: int, salt: bytes = b"") -> str:
        """sha256 of (salt, name, code, signature, constexprs, grid, warps, stages), hex, cut to `length`."""
        h = hashlib.sha256(salt)
        for part in (self.name, code, repr(sorted(self.signature.items())), repr(sorted(self.constexprs.items())),
                     repr(self.grid), str(self.num_warps), str(self.num_stages)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:length]


@functools.lru_cache(maxsize=8192)
def code_text(source: str) -> str:
    """`source` with every comment and blank line removed (tokenize, so a '#' inside a string stays)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            continue
        out.append(tok)
    lines = tokenize.untokenize(out).splitlines()
    return "\n".join(line.rstrip() for line in lines if line.strip())


@functools.lru_cache(maxsize=8192)
def blank_comments(source: str) -> str:
    """`source` with each comment reduced to a bare '#' (tokenize, so a '#' inside a string stays); every other
    character, line break and column is kept."""
    lines = io.StringIO(source).readlines()          # the lines tokenize reads (split at \n only)
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return source           # not valid Python: compiled as it is (and reported by the compiler)
    for tok in reversed(tokens):        # comments never span lines; right to left keeps earlier columns valid
        row, col = tok.start
        line = lines[row - 1]
        lines[row - 1] = line[:col] + "#" + line[tok.end[1]:]
    return "".join(lines)
