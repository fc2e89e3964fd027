"""How strongly generated text shows each demo style, and a report for a trained demo.

Owns the three measures (upper-case letter share, share of lines ending in the
fixed word, share of word pairs in reversed order) and the fixed evaluation
prompts. `python -m loraplex.gpu_engine.demo.evaluate [DIR]` greedily generates
through the offline API as the base and through every adapter and prints them.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from .styles import AMEN

EVAL_PROMPTS: tuple[str, ...] = (
    "ROMEO:\nWhat",
    "First Citizen:\nWe are",
    "MENENIUS:\nThe gods",
    "QUEEN ELIZABETH:\nMy lord,",
    "GLOUCESTER:\nNow is the",
    "All:\nCome,",
)
EVAL_MAX_TOKENS = 48
_WORD = re.compile(r"[a-z']+")
_SPEAKER = re.compile(r"^\s*[A-Za-z][A-Za-z ,&']*:\s*$")


def spoken_lines(text: str) -> list[str]:
    """The lines of `text` that are not speaker tags ("MENENIUS:", upper case in the original too)."""
    return [line for line in text.split("\n") if not _SPEAKER.match(line)]


def upper_ratio(texts: Iterable[str]) -> float:
    """Upper-case letters / letters in the spoken lines of all `texts`."""
    letters = [c for text in texts for line in spoken_lines(text) for c in line if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def amen_ratio(texts: Iterable[str]) -> float:
    """Share of finished non-empty lines (those followed by a newline) whose last word is the fixed word."""
    lines = [line for text in texts for line in text.split("\n")[:-1] if line.strip()]
    ends = [line.rstrip().lower().endswith(AMEN) for line in lines]
    return sum(ends) / max(1, len(ends))


def word_pairs(text: str) -> list[tuple[str, str]]:
    """Adjacent lower-cased words within each line, punctuation dropped."""
    pairs: list[tuple[str, str]] = []
    for line in text.split("\n"):
        words = [w.strip("'") for w in _WORD.findall(line.lower())]
        words = [w for w in words if w]
        pairs += zip(words, words[1:])
    return pairs


def reversed_ratio(texts: Iterable[str], reference: str) -> float:
    """Of the word pairs `reference` uses more often in one order than the other, the share in the rarer order."""
    counts = Counter(word_pairs(reference))
    forward = backward = 0
    for text in texts:
        for a, b in word_pairs(text):
            ahead, behind = counts[(a, b)], counts[(b, a)]
            forward += ahead > behind
            backward += behind > ahead
    return backward / max(1, forward + backward)


def measure(texts: Sequence[str], reference: str) -> dict[str, float]:
    """All three measures of `texts`, rounded for reports."""
    return {
        "upper": round(upper_ratio(texts), 3),
        "reverse": round(reversed_ratio(texts, reference), 3),
        "amen": round(amen_ratio(texts), 3),
    }


def generate_all(model_dir: Path, adapters: dict[str, Path], prompts: Sequence[str] = EVAL_PROMPTS,
                 max_tokens: int = EVAL_MAX_TOKENS) -> dict[str, list[str]]:
    """Greedy continuations of `prompts` as the base ("base") and through each adapter, in one batch."""
    from loraplex import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu")
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names: list[str | None] = [None, *adapters]
    rows = [(p, a) for a in names for p in prompts]
    outs = llm.generate([p for p, _ in rows], adapters=[a for _, a in rows],
                        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    texts: dict[str, list[str]] = {}
    for (_, adapter), out in zip(rows, outs):
        texts.setdefault(adapter or "base", []).append(out.text)
    return texts


def main(argv: Sequence[str] | None = None) -> int:
    from .packaged import TRAINED_ADAPTERS, TRAINED_DIR
    from .train import load_text

    parser = argparse.ArgumentParser(prog="python -m loraplex.gpu_engine.demo.evaluate", description=__doc__)
    parser.add_argument("dir", nargs="?", type=Path, default=TRAINED_DIR,
                        help="a trained demo (default: the package's)")
    parser.add_argument("--json", action="store_true", help="print the measures as JSON")
    args = parser.parse_args(argv)
    adapters = {name: args.dir / "adapters" / name for name in TRAINED_ADAPTERS}
    texts = generate_all(args.dir / "model", adapters)
    reference = load_text()
    report = {name: measure(outs, reference) for name, outs in texts.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, outs in texts.items():
        print(f"== {name}: {report[name]}")
        for prompt, out in zip(EVAL_PROMPTS, outs):
            print(f"  {prompt!r} -> {out!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
