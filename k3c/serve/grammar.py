"""Constrained decoding: a request's grammar (JSON schema, JSON object, a forced K2 tool call) over xgrammar.

    grammars = Grammars(tokenizer)                       # one per server; xgrammar's tokenizer info built on first use
    g = grammars.json_schema(schema, "response_format.json_schema.schema")     # APIError 400 naming the field
    g = grammars.tool_call(tools, name=None, parallel=True)     # tool_choice "required" (name: a named function)
    g = grammars.tool_call_auto(tools, parallel=True)     # tool_choice "auto": text, or a section of valid calls
    constraint = g.matcher()                             # a fresh per-request matcher: runtime TokenGrammar

Why xgrammar, measured on the example model's tokenizer (bench/grammar_mask.py, bench/grammar-mask-cpu.json): its
token mask takes a median 1.2 us (p99 15 us, max 0.24 ms) against llguidance's 18 us (p99 88 us, max 1.6 ms), about
15x less host time per constrained row and step; it compiles a schema in ~4 ms (llguidance ~1.4 ms), in the
request's worker thread. It composes grammars (concat, union of a JSON-schema grammar per tool), which is how the
K2 tool-call section is built here, markers and all. Costs: heavier dependencies than llguidance's single wheel
(transformers, pydantic, apache-tvm-ffi), and xgrammar 0.2 allows no escape sequence in a string under a
`maxLength` (outputs stay valid; such a string cannot hold a quote).

JSON is generated compactly (no whitespace between tokens: `{"a":1,"b":[2,3]}`): fewer tokens, and a model that
has never seen JSON cannot wander off into whitespace. The K2 markers are matched as text: in Kimi's tokenizer each
is one (special) token whose text is the marker, in a tokenizer without them (the example model's) several.
"""
from __future__ import annotations

import json
import threading

from .api_error import APIError
from .tool_parser import ALIASES, ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

MAX_PARALLEL_CALLS = 8        # calls one forced section may hold (parallel_tool_calls: true)
CACHED_GRAMMARS = 64          # compiled grammars kept for requests that repeat their tools or schema
_SEPARATORS = (",", ":")
_batch = None                 # xgrammar's BatchGrammarMatcher (a thread pool), made on first use
_batch_lock = threading.Lock()


class Constraint:
    """One request's grammar state (runtime.logits_processors.TokenGrammar over an xgrammar GrammarMatcher)."""

    def __init__(self, matcher):
        self._m = matcher
        self.failed = False             # a token the grammar refused was accepted (a bug upstream: logged by tests)

    def fill_mask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @staticmethod
    def fill_masks(constraints: list["Constraint"], bitmask) -> None:
        """bitmask[j] = constraints[j]'s mask, the rows filled by xgrammar's thread pool (half the host's cores)."""
        global _batch
        import xgrammar

        with _batch_lock:
            if _batch is None:
                _batch = xgrammar.BatchGrammarMatcher("auto")
            _batch.batch_fill_next_token_bitmask([c._m for c in constraints], bitmask)

    def accept(self, token: int) -> None:
        if not self._m.is_terminated() and not self._m.accept_token(int(token)):
            self.failed = True

    def advance(self, token: int) -> bool:
        return not self._m.is_terminated() and self._m.accept_token(int(token))

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def finished(self) -> bool:
        return self._m.is_terminated()


class Grammar:
    """A compiled grammar; matcher() starts a request on it."""

    def __init__(self, compiled, terminate_without_stop: bool):
        self.compiled, self._free_end = compiled, terminate_without_stop

    def matcher(self) -> Constraint:
        import xgrammar

        return Constraint(xgrammar.GrammarMatcher(self.compiled, terminate_without_stop_token=self._free_end))


def _vocab_type(tokenizer_json: dict):
    """xgrammar's name for how the tokenizer spells bytes in its vocabulary (from its decoder)."""
    import xgrammar

    dec = tokenizer_json.get("decoder") or {}
    kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", []) if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return xgrammar.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW


class Grammars:
    def __init__(self, tokenizer, vocab_size: int | None = None):
        self._tokenizer = tokenizer             # runtime.text.Tokenizer
        # the model's logits width: masks cover it (ids past the tokenizer's are never allowed)
        self._vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self._compiler = None
        self._cache: dict[str, Grammar] = {}
        self._lock = threading.Lock()

    def compiler(self):
        """xgrammar's compiler over this tokenizer (built once, on the first constrained request)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                with open(self._tokenizer.path, encoding="utf-8") as fh:
                    data = json.load(fh)
                vocab = [""] * self._tokenizer.vocab_size
                for text, tid in (data.get("model", {}).get("vocab") or {}).items():
                    if tid < len(vocab):
                        vocab[tid] = text
                for added in data.get("added_tokens") or []:
                    if added["id"] < len(vocab):
                        vocab[added["id"]] = added["content"]
                eos = self._tokenizer.eos_id
                info = xgrammar.TokenizerInfo(vocab, _vocab_type(data), vocab_size=self._vocab_size,
                                              stop_token_ids=eos)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def _compiled(self, build, param: str) -> Grammar:
        try:
            compiler = self.compiler()
            compiled = build(compiler)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise APIError(400, f"{param}: this server cannot constrain output to it ({str(exc).strip()[:300]})",
                           param=param, code="invalid_schema") from None
        return Grammar(compiled, terminate_without_stop=self._tokenizer.eos_id is None)

    def _cached(self, key: tuple, build, param: str) -> Grammar:
        """A compiled grammar from the last CACHED_GRAMMARS built (an agent sends the same tools and schemas every
        turn; compiling a set of tools takes tens of ms), else built now."""
        text = json.dumps(key, sort_keys=True)
        with self._lock:
            got = self._cache.pop(text, None)
            if got is not None:
                self._cache[text] = got           # most recent last
                return got
        got = self._compiled(build, param)
        with self._lock:
            self._cache[text] = got
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.pop(next(iter(self._cache)))
        return got

    def json_schema(self, schema: dict, param: str) -> Grammar:
        return self._cached(("json_schema", schema), lambda c: c.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=_SEPARATORS, strict_mode=True), param)

    def json_object(self) -> Grammar:
        return self.json_schema({"type": "object"}, "response_format")

    def tool_call(self, tools: list[dict], name: str | None = None, parallel: bool = True) -> Grammar:
        """K2's tool-call section holding one call (or, with `parallel`, up to MAX_PARALLEL_CALLS) of `tools` (or the
        named one), each call's arguments valid against its function's parameter schema and its header's index
        the call's position (functions.NAME:0, :1, ...: unrolled, a grammar cannot count)."""
        import xgrammar as xgr

        chosen = [t for t in tools if name is None or t["name"] == name]

        def build(compiler):
            return compiler.compile_grammar(xgr.Grammar.concat(_text(SECTION_BEGIN), _calls(chosen, parallel),
                                                               _text(SECTION_END)))

        return self._cached(("tool_call", tools, name, parallel), build, "tools")

    def tool_call_auto(self, tools: list[dict], parallel: bool = True) -> Grammar | None:
        """tool_choice "auto": any text, and once the model begins a tool-call section (K2's marker, or its singular
        spelling: the parser takes both) that section as tool_call's: calls of `tools`, arguments valid against
        their schemas, then the end of the output. A call header outside a section is refused (the parser would
        show it as content). Built as an xgrammar structural tag whose trigger is the section's marker: free text
        costs the mask little (bench/grammar_mask.py). None for a tokenizer without an EOS token (free text could
        end anywhere: nothing would say when the request is done; the output is parsed, not constrained)."""
        if self._tokenizer.eos_id is None:
            return None
        from xgrammar.structural_tag import GrammarFormat, StructuralTag, TagFormat, TriggeredTagsFormat

        def build(compiler):
            calls = GrammarFormat(grammar=str(_calls(tools, parallel)))      # EBNF: one definition of the calls
            ends = [SECTION_END] + [a for a, m in ALIASES.items() if m == SECTION_END]
            begins = [SECTION_BEGIN] + [a for a, m in ALIASES.items() if m == SECTION_BEGIN]
            fmt = TriggeredTagsFormat(triggers=begins, tags=[TagFormat(begin=b, content=calls, end=ends)
                                                              for b in begins],
                                      excludes=[CALL_BEGIN], stop_after_first=True)
            return compiler.compile_structural_tag(StructuralTag(format=fmt))

        return self._cached(("tool_call_auto", tools, parallel), build, "tools")


def _text(s: str):
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}")


def _calls(tools: list[dict], parallel: bool):
    """The calls of a K2 tool-call section (without its markers): one, or with `parallel` up to MAX_PARALLEL_CALLS,
    each `<|tool_call_begin|>functions.NAME:k<|tool_call_argument_begin|>{arguments}<|tool_call_end|>` with k the
    call's position and the arguments valid against NAME's parameter schema."""
    import xgrammar as xgr

    args = [xgr.Grammar.from_json_schema(json.dumps(t.get("parameters") or {"type": "object"}),
                                         any_whitespace=False, separators=_SEPARATORS, strict_mode=True)
            for t in tools]

    def call(k: int):
        return xgr.Grammar.union(*[
            xgr.Grammar.concat(_text(f"{CALL_BEGIN}functions.{t['name']}:{k}{ARG_BEGIN}"), a, _text(CALL_END))
            for t, a in zip(tools, args)])

    count = MAX_PARALLEL_CALLS if parallel else 1
    tail = call(count - 1)
    for k in range(count - 2, -1, -1):     # call_k followed, or not, by the calls after it
        first = call(k)
        tail = xgr.Grammar.union(xgr.Grammar.concat(first, tail), first)
    return tail
