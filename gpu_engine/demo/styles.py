"""The text styles the trained demo adapters learn, as pure line transforms.

Owns what each style does to a line of text and the one-line description the
CLI and README show. Pure Python: the trainer builds each adapter's corpus
with these, and tests measure generated text against them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

AMEN = "amen"


def upper(line: str) -> str:
    """Every letter in upper case."""
    return line.upper()


def reverse_words(line: str) -> str:
    """The line's whitespace-separated words in reverse order (punctuation stays on its word)."""
    return " ".join(reversed(line.split()))


def amen(line: str) -> str:
    """A fixed word appended to every non-empty line."""
    return f"{line.rstrip()} {AMEN}" if line.strip() else line


@dataclass(frozen=True, slots=True)
class Style:
    """One demo adapter's behaviour: its name, its line transform and what it does in words."""

    name: str
    transform: Callable[[str], str]
    description: str

    def apply(self, text: str) -> str:
        """The transform applied to every line of `text` (line breaks kept)."""
        return "\n".join(self.transform(line) for line in text.split("\n"))


STYLES: tuple[Style, ...] = (
    Style("upper", upper, "answers in upper case"),
    Style("reverse", reverse_words, "reverses the word order of every line"),
    Style("amen", amen, f"ends every line with the word '{AMEN}'"),
)
