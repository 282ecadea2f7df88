"""Token-mask time of the constrained-decoding libraries on a model's tokenizer (issue 57: pick by measurement).

    python bench/grammar_mask.py [MODEL_DIR] [--out grammar-mask-cpu.json]

For llguidance and xgrammar (whichever import): the grammar compile time and the per-token mask time of two
JSON-schema grammars (nested objects, enums, arrays, bounded numbers; and the same with a maxLength string)
while a schema-valid document is fed one token at a time, on the model directory's tokenizer.json (default: the
trained example model). Prints a table and writes JSON. Host (CPU) work only: this is what runs beside each device
step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "coords": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                    "lon": {"type": "number"}},
                   "required": ["lat", "lon"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["city", "unit", "days", "coords", "tags"],
    "additionalProperties": False,
}
BOUNDED = json.loads(json.dumps(SCHEMA))
BOUNDED["properties"]["city"]["maxLength"] = 20     # a bounded string, common in tool schemas
DOC = json.dumps({"city": "Paris \"centre\"", "unit": "celsius", "days": 3, "coords": {"lat": 48.85, "lon": 2.35},
                  "tags": ["a", "bb", "ccc"]}, separators=(",", ":"))
# xgrammar 0.2 allows no escapes in a string under a maxLength (a limit it has: outputs stay valid, a quote cannot
# be written there); the bounded schema's document has none
DOC_BOUNDED = DOC.replace('\\"centre\\"', "centre")


def _llguidance(tok_json: str, ids: list[int], eos: int | None, schema: dict):
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, eos_token=eos)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(tok, grammar)
    t_compile = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return t_tok, t_compile, times


def _xgrammar(tok_json: str, ids: list[int], eos: int | None, vocab: list[str], schema: dict):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(compiled)
    t_compile = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t), t
    return t_tok, t_compile, times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", "examples",
                                                             "k3-stdlib"))
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    path = os.path.join(args.model, "tokenizer.json")
    if not os.path.isfile(path):
        print(f"error: {path}: no tokenizer.json", file=sys.stderr)
        return 2
    with open(path, encoding="utf-8") as fh:
        tok_json = fh.read()
    backend = Tokenizer.from_str(tok_json)
    docs = {"plain": backend.encode(DOC).ids, "maxLength": backend.encode(DOC_BOUNDED).ids}
    ids = docs["plain"]
    eos = backend.token_to_id("<|endoftext|>")
    size = backend.get_vocab_size(with_added_tokens=True)
    inv = {i: s for s, i in backend.get_vocab(with_added_tokens=True).items()}
    vocab = [inv.get(i, "") for i in range(size)]
    rows = {}
    for label, schema in (("plain", SCHEMA), ("maxLength", BOUNDED)):
        for lib, run in (("llguidance", lambda: _llguidance(tok_json, docs[label], eos, schema)),
                         ("xgrammar", lambda: _xgrammar(tok_json, docs[label], eos, vocab, schema))):
            name = f"{lib} {label}"
            try:
                t_tok, t_compile, times = run()
            except ImportError as exc:
                print(f"{name}: not importable ({exc})")
                continue
            rows[name] = {"tokenizer_s": t_tok, "compile_s": t_compile, "tokens": len(times),
                          "mask_us_median": statistics.median(times) * 1e6,
                          "mask_us_p99": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
                          "mask_us_max": max(times) * 1e6}
    print(f"tokenizer {path}: {size} tokens; document of {len(ids)} tokens")
    print(f"{'library schema':<22} {'tokenizer s':>12} {'compile ms':>11} {'mask us p50':>12} {'p99':>9} {'max':>9}")
    for name, r in rows.items():
        print(f"{name:<22} {r['tokenizer_s']:>12.3f} {r['compile_s'] * 1e3:>11.2f} {r['mask_us_median']:>12.1f} "
              f"{r['mask_us_p99']:>9.1f} {r['mask_us_max']:>9.1f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"tokenizer": path, "vocab": size, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
