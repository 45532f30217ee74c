"""Incremental detokenization with stop strings, one instance per streamed choice.

Token ids are decoded in a small sliding window (vLLM's prefix/read offsets) so each step costs a
few tokens of decoding, not a re-decode of the whole output:

    ids:  ... | prefix ......... read | new ids ...
               <- left context ->       <- decoded now, minus the context's own text ->

The left context keeps leading-space markers (SentencePiece `▁`, WordPiece `##`) right; text that
ends in U+FFFD (a character split across byte-level tokens) is held until the character completes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

_REPLACEMENT = "\ufffd"


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode`, or its Rust backend directly when that gives the same text (no cleanup)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of output token ids into releasable text deltas, honouring stop strings.

    Concatenated deltas (from `add` then `finish`) equal `tokenizer.decode(output_ids,
    skip_special_tokens=...)`, cut just before the first stop string if one matched (`stopped`).
    `prompt_token_ids` is accepted for interface symmetry only: output text is decoded on its own.
    """

    __slots__ = ("_decode", "_stop", "_stop_firsts", "_max_stop", "_ids", "_prefix", "_read",
                 "_prefix_text", "_pending", "text", "stopped")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._stop = list(stop)
        self._stop_firsts = frozenset(s[0] for s in self._stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # first token of the left context
        self._read = 0  # tokens before this one have been turned into text
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._pending = ""  # decoded, but held back as the possible start of a stop string
        self.text = ""  # everything released so far
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Append new output tokens; return the text that can be released now (possibly "")."""
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """Release everything still held back (an incomplete character decodes as U+FFFD)."""
        if self.stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past `read`, decoded with the left context and then stripped of it."""
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(self._prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return delta

    def _release(self, delta: str, final: bool) -> str:
        """Cut at the stop string that completes first, or hold back a suffix that may become one.

        "Completes first" (smallest end, then smallest start) is what character-by-character
        generation would hit, so the result does not depend on how text arrives in deltas: with
        stops ["a", " aa"], " aa" stops at " " because "a" is complete before " aa" is.
        """
        if not self._stop:
            self.text += delta
            return delta
        buf = self._pending + delta
        matches = [(i + len(s), i) for s in self._stop if (i := buf.find(s)) >= 0]
        if matches:
            cut = min(matches)[1]
            out, self._pending, self.stopped = buf[:cut], "", True
        else:
            keep = 0 if final else self._partial_stop_len(buf)
            out, self._pending = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for i in range(max(0, len(buf) - self._max_stop + 1), len(buf)):
            if buf[i] in self._stop_firsts:
                tail = buf[i:]
                if any(s.startswith(tail) for s in self._stop):
                    return len(buf) - i
        return 0
