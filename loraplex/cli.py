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


DEMO_PROMPTS = (
    ("The river that runs through the valley", None),
    ("The river that runs through the valley", "qv-r8"),
    ("In the morning the old house was quiet", "all-r32"),
    ("In the morning the old house was quiet", "mlp-r64"),
    ("She opened the letter and read", "rslora-r16"),
    ("She opened the letter and read", None),
)


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per prompt (default 24)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def _run_demo(args: argparse.Namespace) -> int:
    """Offline demo: the built-in model answers a few prompts through several adapters in one batch."""
    import time

    from loraplex.gpu_engine import LLM, SamplingParams
    from loraplex.gpu_engine.demo import ensure_demo_model

    print("loraplex demo: preparing the built-in demo model ...", file=sys.stderr)
    demo = ensure_demo_model()
    llm = LLM(demo.model_dir, device=args.device)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    print(f"loraplex demo: model {demo.model_dir}, adapters: {', '.join(demo.adapters)}", file=sys.stderr)
    prompts = [p for p, _ in DEMO_PROMPTS]
    adapters = [a for _, a in DEMO_PROMPTS]
    started = time.perf_counter()
    outs = llm.generate(prompts, adapters=adapters,
                        sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - started
    for prompt, adapter, out in zip(prompts, adapters, outs):
        print(f"[{adapter or 'base'}] {prompt!r} -> {out.text!r}")
    total = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tokens/s, one mixed batch)")
    print("(the demo weights are random: text is gibberish, but each adapter changes it)")
    return 0


_SERVE_FLAGS = (
    # (flag, config key, type, help)
    ("--model", "model.model", str, "base model directory (default: the built-in demo model)"),
    ("--device", "model.device", str, "auto, cpu, cuda or cuda:N"),
    ("--dtype", "model.dtype", str, "auto, float32, bfloat16 or float16"),
    ("--lora-backend", "model.lora_backend", str, "auto, torch or triton"),
    ("--max-lora-rank", "model.max_lora_rank", int, "largest adapter rank accepted"),
    ("--num-pages", "model.num_pages", int, "unified pool size in pages"),
    ("--max-num-seqs", "scheduler.max_num_seqs", int, "most sequences per iteration"),
    ("--max-batched-tokens", "scheduler.max_batched_tokens", int, "token budget per iteration"),
    ("--scheduler", "scheduler.policy", str, "scheduling policy"),
    ("--runtime-dir", "server.runtime_dir", str, "directory of the daemon's sockets"),
    ("--state-dir", "server.state_dir", str, "directory of the adapter registry"),
    ("--tcp-listen", "server.tcp_listen", str, "also serve clients on tcp://HOST:PORT"),
)


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="TOML config file (default: $LORAPLEX_CONFIG)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                        help="register an adapter at start (repeatable)")
    for flag, key, kind, text in _SERVE_FLAGS:
        parser.add_argument(flag, dest=key.replace(".", "__"), type=kind, default=None, help=text)


def _run_serve(args: argparse.Namespace) -> int:
    """Run the daemon in the foreground (torch stays in the engine process)."""
    from loraplex.daemon.config import ConfigError, load_config, parse_adapter_arg
    from loraplex.daemon.main import serve

    overrides: dict[str, object] = {}
    for _, key, _, _ in _SERVE_FLAGS:
        value = getattr(args, key.replace(".", "__"))
        if value is not None:
            overrides[key] = value
    try:
        if args.adapter:
            overrides["adapters"] = [parse_adapter_arg(a) for a in args.adapter]
        config = load_config(args.config, overrides=overrides)
    except (ConfigError, OSError) as exc:
        print(f"loraplex serve: error: {exc}", file=sys.stderr)
        return 2
    return serve(config)


COMMANDS: dict[str, Command] = {
    "serve": Command(
        help="run the daemon in the foreground (Ctrl-C drains and stops)",
        configure=_configure_serve,
        run=_run_serve,
    ),
    "demo": Command(
        help="offline demo: the built-in model answers prompts through several adapters in one batch",
        configure=_configure_demo,
        run=_run_demo,
    ),
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


def serve_main() -> int:
    """`loraplexd`: the daemon entry point, same as `loraplex serve`."""
    return main(["serve", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the chosen command, return its exit status."""
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    raise SystemExit(main())
