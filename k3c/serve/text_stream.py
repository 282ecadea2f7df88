"""Generated token ids -> text deltas a client may be sent.

    stream = TextStream(tokenizer, stop=("\\n\\n",))
    delta = stream.push(token_id)     # text now final ("" while undecided); stream.stopped once a stop string came
    rest = stream.finish()            # at the end: what was held back

The whole generation is decoded again at each token (a byte-level BPE token may end inside a UTF-8 character, so
the text of a token alone is not the text it adds). Text is held back while it ends in an incomplete character
(U+FFFD) or in a proper prefix of a stop string; when a stop string appears, the text ends before it.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), keep_special: bool = False):
        self._tok = tokenizer
        self._keep = keep_special       # special tokens decoded as their text (K2's tool-call markers are)
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._sent = 0                  # characters of the decoded text already handed out
        self.text = ""                  # everything handed out
        self.stopped = False            # a stop string ended the text

    def _held(self, full: str) -> int:
        """Characters at the end of `full` that may not be sent yet."""
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        tail = len(full) - len(full.rstrip(_REPLACEMENT))
        return max(hold, tail)

    def _emit(self, upto: int, full: str) -> str:
        delta = full[self._sent:upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        self.text += delta
        return delta

    def _decode(self) -> str:
        return self._tok.decode(self._ids, skip_special_tokens=False) if self._keep else self._tok.decode(self._ids)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        full = self._decode()
        if self._stop:
            # a stop string can only start where it could not have been seen before: at most len(s) - 1 characters
            # back from what was sent
            start = max(0, self._sent - max(len(s) for s in self._stop) + 1)
            hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit(min(hits), full)
        return self._emit(len(full) - self._held(full), full)

    def finish(self) -> str:
        """The held-back text, once no token will follow."""
        if self.stopped or not self._ids:
            return ""
        full = self._decode()
        return self._emit(len(full), full)
