"""`loraplex generate`'s sampling options: --logit-bias pairs, the structured-output
flags as a Guided, and the --logprobs listing. CLI output only (print is its job)."""
from __future__ import annotations

import argparse

from loraplex.ipc.client import Choice, Guided


def logit_bias_from(pairs: list[str]) -> dict[int, float]:
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=BIAS, got {pair!r}") from None
    return bias


def guided_from(args: argparse.Namespace) -> Guided | None:
    if args.json_schema is not None:
        return Guided.json(args.json_schema)
    if args.json_object:
        return Guided.json_object()
    if args.regex is not None:
        return Guided.regex(args.regex)
    return Guided.choice(args.choice) if args.choice else None


def print_logprobs(result: Choice) -> None:
    """One line per completion token of a choice: its id and logprob, then its alternatives."""
    tops = result.top_logprobs or [None] * len(result.token_ids)
    for token, lp, top in zip(result.token_ids, result.logprobs or [], tops):
        alternatives = "" if top is None else "  " + "  ".join(
            f"{text!r}({alt}) {alt_lp:.3f}" for alt, alt_lp, text in zip(top.token_ids, top.logprobs, top.texts))
        print(f"{token}\t{lp:.4f}{alternatives}")
