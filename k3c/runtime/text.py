"""Text in, text out: a model's tokenizer.

    tok = load_tokenizer("examples/k3-stdlib", vocab_size=4096)     # None when the directory holds no tokenizer
    ids = tok.encode("import os\\n")
    text = tok.decode(ids)
    tok.eos_id                                                       # the id generation stops at (None: none)

A tokenizer is a Hugging Face `tokenizer.json` read with the `tokenizers` library; its EOS token comes from
`tokenizer_config.json` (`eos_token`), else `<|endoftext|>` when the vocabulary has it. The files sit in the model
directory a spec was loaded from, and k3c copies them into the artifacts it saves from one (k3c.api).
"""
from __future__ import annotations

import os

from ..errors import ArgumentError, WeightError
from ..outputs import loads_json
from ..paths import regular_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG)      # what an artifact copies, when there
DEFAULT_EOS = "<|endoftext|>"


class Tokenizer:
    """encode / decode through a `tokenizers.Tokenizer`, and the EOS id."""

    def __init__(self, backend, eos_id: int | None, path: str):
        self._backend = backend
        self.eos_id = eos_id
        self.path = path                  # the tokenizer.json it was read from
        self._longest: int | None = None  # bytes of the longest token's text (max_chars)

    @property
    def vocab_size(self) -> int:
        """Ids it can produce: the vocabulary and the added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ArgumentError(f"encode() takes a str, got {type(text).__name__}")
        # the library's encode() holds the GIL for the whole call (seconds for megabytes); encode_batch() releases
        # it, so a server encoding in a worker thread keeps answering
        return list(self._backend.encode_batch([text])[0].ids)

    def max_chars(self, tokens: int) -> int | None:
        """The most characters a text that encodes to at most `tokens` tokens can hold: every token stands for at
        most the bytes of the longest one (special tokens included), a character for at least one byte; 4 times
        that when the tokenizer normalizes text first (Unicode composition joins up to 3 characters into one).
        A longer text cannot fit: it is refused without being encoded. None (no bound) for a tokenizer that can
        map text of any length to one token: a model other than BPE (WordPiece, WordLevel and Unigram turn a
        whole unknown word or run into one unknown token), or a BPE that fuses unknown runs."""
        model = self._backend.model
        if type(model).__name__ != "BPE" or (model.unk_token is not None and model.fuse_unk):
            return None
        if self._longest is None:
            size = self._backend.get_vocab_size(with_added_tokens=True)
            texts = self._backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
            self._longest = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1) or 1
        return tokens * self._longest * (4 if self._backend.normalizer is not None else 1)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        """The id of the added (special) token spelled `text`, None when the vocabulary has none."""
        for tid, added in self._backend.get_added_tokens_decoder().items():
            if added.content == text:
                return tid
        return None


def has_tokenizer(directory: str) -> bool:
    return os.path.lexists(os.path.join(directory, TOKENIZER_FILE))


def _read_text(path: str) -> str:
    regular_file(path, "tokenizer file")
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8")
    except UnicodeDecodeError:
        raise ArgumentError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ArgumentError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _eos_name(directory: str) -> str | None:
    """tokenizer_config.json's eos_token (a string, or an added-token record with "content"); None when the file
    or the entry is absent."""
    path = os.path.join(directory, TOKENIZER_CONFIG)
    if not os.path.lexists(path):
        return None
    config = loads_json(_read_text(path), path, error=ArgumentError)
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise ArgumentError(f"{path}: eos_token must be a string, got {type(eos).__name__}")
    return eos


def load_tokenizer(directory: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer | None:
    """The tokenizer of a model directory or artifact (None when it holds no tokenizer.json). ArgumentError naming
    the file when a file is unreadable, not a tokenizer or names an EOS token the vocabulary lacks; WeightError
    when the tokenizer's ids do not fit the model's `vocab_size`."""
    from tokenizers import Tokenizer as Backend

    directory = os.fspath(directory)
    path = os.path.join(directory, TOKENIZER_FILE)
    if not has_tokenizer(directory):
        return None
    text = _read_text(path)
    try:
        backend = Backend.from_str(text)
    except Exception as exc:             # the library raises plain Exceptions for every parse problem
        raise ArgumentError(f"{path}: not a tokenizers tokenizer.json ({str(exc).splitlines()[0][:160]})") from None
    eos = _eos_name(directory)
    eos_id = backend.token_to_id(eos if eos is not None else DEFAULT_EOS)
    if eos is not None and eos_id is None:
        raise ArgumentError(f"{os.path.join(directory, TOKENIZER_CONFIG)}: eos_token {eos!r} is not in the "
                            f"vocabulary of {path}")
    tok = Tokenizer(backend, eos_id, path)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise WeightError(f"{path}: the tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size "
                          f"{vocab_size}")
    return tok
