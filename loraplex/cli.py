"""The `loraplex` command line: one argparse subcommand per entry in COMMANDS.

Owns argument parsing and what each command prints. Heavy imports (torch and
anything that pulls it in) stay inside the command functions, so torch-free
commands start fast.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its help line, how it adds its arguments, and what it runs."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _configure_demo_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir",
        nargs="?",
        type=Path,
        default=None,
        help="where to put the demo (default: $LORAPLEX_CACHE_DIR/demo-v1 or ~/.cache/loraplex/demo-v1)",
    )
    parser.add_argument("--force", action="store_true", help="rewrite the demo even if it is already complete")


def _run_demo_model(args: argparse.Namespace) -> int:
    from loraplex.gpu_engine.demo import ensure_demo_model

    try:
        demo = ensure_demo_model(args.dir, force=args.force)
    except OSError as exc:
        print(f"loraplex demo-model: error: {exc}", file=sys.stderr)
        return 1
    print(f"model\t{demo.model_dir}")
    for name, path in demo.adapters.items():
        print(f"adapter\t{name}\t{path}")
    return 0


COMMANDS: dict[str, Command] = {
    "demo-model": Command(
        help="write the built-in random demo model and its LoRA adapters (once; reused afterwards)",
        configure=_configure_demo_model,
        run=_run_demo_model,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per COMMANDS entry."""
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve many LoRA adapters over one base LLM.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.configure(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the chosen command, return its exit status."""
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    raise SystemExit(main())
