"""Streaming text out of token ids: incremental UTF-8-safe detokenization and stop strings.

Owns turning each request's sampled ids into text chunks that are final (never a
half character, never text a stop string later swallows). Uses the `tokenizers`
library only; never imports torch or numpy, never touches the engine.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token, so decoders that
# strip or merge at the start of a string (SentencePiece's leading space) see the
# output as a continuation (the same offset as vLLM's incremental detokenizer).
PROMPT_CONTEXT_TOKENS = 5
# Unsettled tokens after which a window still ending in U+FFFD is checked for a safe cut.
MAX_PENDING_TOKENS = 8


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Tokenizer | None:
    """The model's tokenizer.json as a Tokenizer; None if the directory has none.
    ValueError if the file exists but cannot be parsed."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"cannot load tokenizer {path}: {exc}") from None


class IncrementalDetokenizer:
    """Decodes one sequence's output ids as they arrive, emitting only final text.

    The prefix/read-offset technique of vLLM and TGI: `prefix` starts a window of
    a few settled tokens decoded as context, `read` is where unsettled tokens
    start, and `sent` counts the window's characters already emitted (or given
    as prompt context). Per token it decodes ids[prefix:] and emits what is new.
    A trailing U+FFFD may be an incomplete UTF-8 sequence that later tokens
    complete, so it is held back and the window stays put until the text ends
    cleanly; everything before it is final and goes out at once. Cost per token
    is O(window), not O(sequence); a window that never ends cleanly (a model
    emitting stray bytes) is cut once a split point provably changes no text.
    """

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_num_prompt", "_prefix", "_read", "_sent")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or ())
        self._num_prompt = len(self._ids)
        self._read = len(self._ids)
        self._prefix = max(self._read - PROMPT_CONTEXT_TOKENS, 0)
        self._sent = len(self._decode(self._prefix, self._read))

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def num_output_tokens(self) -> int:
        """Output ids pushed so far (prompt ids excluded)."""
        return len(self._ids) - self._num_prompt

    def push(self, token_ids: Iterable[int]) -> str:
        """Append `token_ids`; return the text that became final (possibly "")."""
        out: list[str] = []
        for token_id in token_ids:
            self._ids.append(token_id)
            text = self._decode(self._prefix, len(self._ids))
            if not text.endswith(REPLACEMENT_CHAR):
                if len(text) >= self._sent:
                    out.append(text[self._sent:])
                    self._prefix, self._read = self._read, len(self._ids)
                    self._sent = len(self._decode(self._prefix, self._read))
                continue
            final = len(text) - 1  # all but the U+FFFD that may still become a character
            if final > self._sent:
                out.append(text[self._sent:final])
                self._sent = final
            if len(self._ids) - self._read > MAX_PENDING_TOKENS:
                self._cut_window(text)
        return "".join(out)

    def flush(self) -> str:
        """End of the sequence: return the held-back text, U+FFFD included if it never completed."""
        text = self._decode(self._prefix, len(self._ids))
        rest = text[self._sent:]
        self._prefix = self._read = len(self._ids)
        self._sent = 0
        return rest

    def _cut_window(self, text: str) -> None:
        """Move the window start past settled stray bytes. An incomplete UTF-8 tail is
        at most 3 bytes, so it lies in the last 3 tokens; the split before them is safe
        when decoding both sides apart gives exactly the window's text (no character
        and no decoder context spans it)."""
        cut = len(self._ids) - 3
        head = self._decode(self._prefix, cut)
        if len(head) <= self._sent and head + self._decode(cut, len(self._ids)) == text:
            self._prefix = self._read = cut
            self._sent -= len(head)

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special)


class StopStringMatcher:
    """Cuts a text stream at the first stop string, across chunk boundaries.

    "First" means the occurrence that completes first (smallest end; among those
    ending at the same place, the longest), which is the only definition that
    does not depend on how the text was chunked. A tail that could still become a
    stop string is held back until it can no longer match, so emitted text never
    contains a stop string and is never retracted.
    """

    __slots__ = ("_stops", "_longest", "_pending", "_matched")

    def __init__(self, stops: Iterable[str]) -> None:
        stops = tuple(dict.fromkeys(stops))
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._pending = ""
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._matched

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop was hit). After a hit everything
        else, this chunk's rest included, is discarded and feed returns ("", True)."""
        if self._matched is not None:
            return "", True
        if not self._stops:
            return text, False
        buf = self._pending + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            self._matched, self._pending = best[2], ""
            return buf[: best[1]], True
        hold = self._holdback(buf)
        self._pending = buf[len(buf) - hold:]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of the stream: the held-back tail (it turned out not to be a stop)."""
        rest, self._pending = self._pending, ""
        return "" if self._matched is not None else rest

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0
