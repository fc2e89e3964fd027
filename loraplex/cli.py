"""The `loraplex` command line: one argparse subcommand per entry in COMMANDS.

Owns argument parsing and what each command prints. Heavy imports (torch and
anything that pulls it in) stay inside the command functions, so torch-free
commands start fast and run on the light install (`pip install loraplex`); a
command that needs the engine side says which extra to install when it is missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex import ENGINE_INSTALL, ENGINE_MODULES, registry_cli


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its help line, how it adds its arguments, and what it runs.
    `engine`: it needs the serving side (torch...), installed as the `engine` extra."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    engine: bool = False


def missing_engine_modules() -> list[str]:
    """The engine side's modules this environment lacks; found without importing them
    (the daemon itself must never import torch)."""
    missing = []
    for name in ENGINE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _configure_demo_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir",
        nargs="?",
        type=Path,
        default=None,
        help="copy the demo here (default: the trained demo is used in place from the package; "
             "the random one is written to $LORAPLEX_CACHE_DIR/demo-v1 or ~/.cache/loraplex/demo-v1)",
    )
    parser.add_argument("--force", action="store_true", help="rewrite the demo even if it is already complete")
    parser.add_argument("--kind", default=None, metavar="KIND",
                        help="which demo: trained, random or random:<family> (qwen3, gemma2, phi3, gpt2, ...; "
                             "default: $LORAPLEX_DEMO, else trained)")


def _run_demo_model(args: argparse.Namespace) -> int:
    from loraplex.gpu_engine.demo import builtin_demo

    try:
        demo = builtin_demo(args.dir, force=args.force, kind=args.kind)
    except (OSError, ValueError) as exc:
        print(f"loraplex demo-model: error: {exc}", file=sys.stderr)
        return 1
    print(f"model\t{demo.model_dir}")
    for name, path in demo.adapters.items():
        print(f"adapter\t{name}\t{path}")
    return 0


DEMO_PROMPTS = (
    "ROMEO:\nWhat",
    "First Citizen:\nWe are",
)


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def _run_demo(args: argparse.Namespace) -> int:
    """Offline demo: the built-in model answers each prompt as the base and through every adapter, in one batch."""
    import time

    from loraplex import LLM, SamplingParams
    from loraplex.gpu_engine.demo import STYLES, builtin_demo

    print("loraplex demo: preparing the built-in demo model ...", file=sys.stderr)
    demo = builtin_demo()
    llm = LLM(demo.model_dir, device=args.device)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    print(f"loraplex demo: model {demo.model_dir}, adapters: {', '.join(demo.adapters)}", file=sys.stderr)
    rows = [(prompt, adapter) for prompt in DEMO_PROMPTS for adapter in (None, *demo.adapters)]
    prompts = [p for p, _ in rows]
    adapters = [a for _, a in rows]
    started = time.perf_counter()
    outs = llm.generate(prompts, adapters=adapters,
                        sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - started
    width = max(len(a or "base") for a in adapters)
    for prompt, adapter, out in zip(prompts, adapters, outs):
        print(f"[{adapter or 'base':<{width}}] {prompt!r} -> {out.text!r}")
    total = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tokens/s, one mixed batch)")
    styles = {style.name: style.description for style in STYLES}
    if set(demo.adapters) <= set(styles):
        print("adapters: " + "; ".join(f"{name} {styles[name]}" for name in demo.adapters))
    else:
        print("(the random demo's weights are random: text is gibberish, but each adapter changes it)")
    return 0


_SERVE_FLAGS = (
    # (flag, config key, type, help)
    ("--model", "model.model", str, "base model directory (default: the built-in demo model)"),
    ("--load-format", "model.load_format", str, "safetensors, or dummy: random weights (benchmarks)"),
    ("--device", "model.device", str, "auto, cpu, cuda or cuda:N"),
    ("--dtype", "model.dtype", str, "auto, float32, bfloat16 or float16"),
    ("--lora-backend", "model.lora_backend", str, "auto, torch or triton"),
    ("--max-lora-rank", "model.max_lora_rank", int, "largest adapter rank accepted"),
    ("--tensor-parallel-size", "model.tensor_parallel_size", int, "rank processes (devices) one engine spans"),
    ("--num-pages", "model.num_pages", int, "unified pool size in pages"),
    ("--cpu-threads", "model.cpu_threads", int, "torch threads per engine process (default: auto, cores - 1)"),
    ("--adapter-load-mode", "model.adapter_load_mode", str, "auto, cached, on_demand or cpu_assist"),
    ("--cpu-workers", "server.cpu_workers", int, "CPU LoRA worker processes (cpu_assist)"),
    ("--host-store-bytes", "model.host_store_bytes", int, "host adapter store size (the cache manager's)"),
    ("--max-num-seqs", "scheduler.max_num_seqs", int, "most sequences per iteration"),
    ("--max-batched-tokens", "scheduler.max_batched_tokens", int, "token budget per iteration"),
    ("--scheduler", "scheduler.policy", str, "scheduling policy: fcfs, mlq or dlora"),
    ("--ttft-slo-ms", "scheduler.ttft_slo_ms", float, "early-abort requests predicted to miss this TTFT"),
    ("--cache-policy", "scheduler.cache_policy", str, "GPU adapter cache eviction: none, lru, fifo or cost"),
    ("--engines", "server.engines", int, "engine processes (one per GPU; several may share one for testing)"),
    ("--router", "scheduler.router", str, "engine router: random, first_fit, most_idle, rank_aware or dlora"),
    ("--router-profile", "scheduler.router_profile", str, "rank_aware: PERF_BGMV/PERF_MBGMV profile (JSON)"),
    ("--runtime-dir", "server.runtime_dir", str, "directory of the daemon's sockets"),
    ("--state-dir", "server.state_dir", str, "directory of the adapter registry"),
    ("--tcp-listen", "server.tcp_listen", str, "also serve clients on tcp://HOST:PORT"),
    ("--decision-log", "server.decision_log", str, "append one JSON line per scheduled step to this file"),
    ("--grammar-compile-timeout-s", "server.grammar_compile_timeout_s", float,
     "structured output: seconds a grammar may take to compile (else grammar_too_complex)"),
    ("--grammar-compile-memory-mb", "server.grammar_compile_memory_mb", int,
     "structured output: MiB one grammar compile may take (else grammar_too_complex)"),
)


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="TOML config file (default: $LORAPLEX_CONFIG)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                        help="register an adapter at start (repeatable)")
    for flag, key, kind, text in _SERVE_FLAGS:
        parser.add_argument(flag, dest=key.replace(".", "__"), type=kind, default=None, help=text)


def _run_serve(args: argparse.Namespace) -> int:
    """Run the daemon in the foreground (torch stays in the engine process)."""
    from loraplex.daemon.config import ConfigError
    from loraplex.daemon.config_load import load_config
    from loraplex.daemon.config_names import parse_adapter_arg
    from loraplex.daemon.main import serve
    from loraplex.ipc.socket_options import EndpointInUse

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
    try:
        return serve(config, reload_config=lambda: load_config(args.config, overrides=overrides))
    except EndpointInUse as exc:
        print(f"loraplex serve: error: a daemon already serves {config.server.resolved_runtime_dir} ({exc.strerror}); "
              "stop it first, or give this one another --runtime-dir", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a runtime directory it may not create or write
        print(f"loraplex serve: error: {exc}", file=sys.stderr)
        return 1


def _runtime_dir_arg(parser: argparse.ArgumentParser, *, inner: bool = False) -> None:
    """inner: on an action's subparser too (`policy get --runtime-dir D`); its unset default must
    not override the value given before the action (`policy --runtime-dir D get`)."""
    parser.add_argument("--runtime-dir", type=Path, default=argparse.SUPPRESS if inner else None,
                        help="the daemon's runtime directory (default: $LORAPLEX_RUNTIME_DIR or the default one)")


def _client_args(parser: argparse.ArgumentParser) -> None:
    """Where the client socket is: the runtime directory, or a tcp:// endpoint (with CURVE keys)."""
    import os

    _runtime_dir_arg(parser)
    parser.add_argument("--endpoint", default=os.environ.get("LORAPLEX_ENDPOINT"),
                        help="the daemon's tcp://HOST:PORT (server.tcp_listen) or ipc:// socket "
                             "(default: $LORAPLEX_ENDPOINT, else the runtime directory's client socket)")
    parser.add_argument("--curve-server-key", type=Path, default=os.environ.get("LORAPLEX_CURVE_SERVER_KEY"),
                        metavar="FILE", help="the daemon's CURVE public key (.pub) for a tcp endpoint "
                                             "(default: $LORAPLEX_CURVE_SERVER_KEY)")
    parser.add_argument("--curve-client-key", type=Path, default=os.environ.get("LORAPLEX_CURVE_CLIENT_KEY"),
                        metavar="FILE", help="this client's CURVE secret key (.key, mode 0600) "
                                             "(default: $LORAPLEX_CURVE_CLIENT_KEY)")


def _client(args: argparse.Namespace):
    """A Client for _client_args; raises ValueError (CurveError) for bad or half-given keys."""
    from loraplex.ipc.client import Client
    from loraplex.ipc.curve import CurveClientKeys, CurveError

    curve = None
    if args.curve_server_key is not None or args.curve_client_key is not None:
        if args.curve_server_key is None or args.curve_client_key is None:
            raise CurveError("CURVE needs both --curve-server-key and --curve-client-key")
        curve = CurveClientKeys.from_files(args.curve_server_key, args.curve_client_key)
    return Client(args.endpoint, runtime_dir=args.runtime_dir, curve=curve)


def _configure_generate(parser: argparse.ArgumentParser) -> None:
    _client_args(parser)
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--adapter", default=None, help="adapter name (default: the base model)")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="new tokens at most (default 64); more than the model's context leaves after the "
                             "prompt is refused (context_length_exceeded), never cut")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 disables it (vLLM)")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    parser.add_argument("--n", type=int, default=1, help="completions of the prompt (each printed in turn)")
    guided = parser.add_mutually_exclusive_group()
    guided.add_argument("--json-schema", default=None, metavar="SCHEMA",
                        help="structured output: text that validates against this JSON schema (its JSON text)")
    guided.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
    guided.add_argument("--regex", default=None, help="structured output: text matching this regular expression")
    guided.add_argument("--choice", action="append", default=None, help="structured output: one of these (repeatable)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="print each token's logprob and its N most likely alternatives (0..20)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")


def _run_generate(args: argparse.Namespace) -> int:
    from loraplex.generate_options import guided_from, logit_bias_from, print_logprobs
    from loraplex.ipc.client import LoraplexError

    try:
        options = dict(adapter=args.adapter, max_tokens=args.max_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or None,
                       ignore_eos=args.ignore_eos, timeout=args.timeout, min_tokens=args.min_tokens,
                       presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                       repetition_penalty=args.repetition_penalty, logit_bias=logit_bias_from(args.logit_bias),
                       logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0, n=args.n,
                       guided=guided_from(args))
        with _client(args) as client:
            if args.stream:
                stream = client.stream(args.prompt, **options)
                for chunk in stream:
                    if chunk.choice == 0:  # the others are printed once they are complete
                        print(chunk.text, end="", flush=True)
                print()
                result = stream.finished_result()
            else:
                result = client.generate(args.prompt, **options)
                print(result.text)
            for choice in result.choices:
                if choice.index:
                    print(f"--- choice {choice.index} [{choice.finish_reason}]")
                    print(choice.text)
                if args.logprobs is not None:
                    print_logprobs(choice)
    except (LoraplexError, ValueError) as exc:
        print(f"loraplex generate: error: {exc}", file=sys.stderr)
        return 1
    t = result.timings
    print(f"[{result.finish_reason}; {result.usage.get('completion_tokens')} tokens; "
          f"ttft {t.get('ttft_ms', 0):.1f} ms; "
          f"{t.get('tpt_ms', 0):.1f} ms/token; adapter {t.get('adapter_path')}]", file=sys.stderr)
    return 0


def _adapters_place_args(parser: argparse.ArgumentParser, *, inner: bool = False) -> None:
    """Which daemon or registry: before the action or after it (`adapters list --runtime-dir D`).
    inner: on an action's subparser, whose unset defaults must not override values given before it."""
    _runtime_dir_arg(parser, inner=inner)
    unset = argparse.SUPPRESS if inner else None
    parser.add_argument("--state-dir", type=Path, default=unset,
                        help="registry location used when no daemon is running")
    parser.add_argument("--model", default=unset,
                        help="with no daemon running: the base model whose adapters these are (default: the "
                             "configured model.model, else the built-in demo); the registry keeps each model's apart")


def _configure_adapters(parser: argparse.ArgumentParser) -> None:
    _adapters_place_args(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    lister = sub.add_parser("list", help="list the adapters (with no daemon running: the registered ones and, "
                                         "serving the built-in demo, the demo's)")
    lister.add_argument("--tier", choices=("gpu", "host", "disk"), default=None,
                        help="only the adapters in this tier of a running daemon (GPU pool, host store, on disk)")
    add = sub.add_parser("add", help="register an adapter (PEFT directory)")
    add.add_argument("name")
    add.add_argument("path", type=Path)
    add.add_argument("--replace", action="store_true",
                     help="give an existing adapter of this name the new weights (cached copies are invalidated)")
    rm = sub.add_parser("rm", help="unregister an adapter")
    rm.add_argument("name")
    for action in ("pin", "unpin"):
        p = sub.add_parser(action, help=f"{action} an adapter in the GPU cache")
        p.add_argument("name")
    for action_parser in sub.choices.values():
        _adapters_place_args(action_parser, inner=True)


def _run_adapters(args: argparse.Namespace) -> int:
    """Through the running daemon's admin socket; straight on the registry only when no daemon
    listens in the runtime directory. A daemon that listens but does not answer (starting, or
    busy) is an error: writing the registry behind its back would go unseen or wedge its next start."""
    from loraplex.ipc.client import AdminClient, LoraplexError
    from loraplex.ipc.errors import ProtocolError
    from loraplex.ipc.leftovers import daemon_listening
    from loraplex.ipc.runtime_dir import default_runtime_dir

    runtime_dir = args.runtime_dir if args.runtime_dir is not None else default_runtime_dir()
    if not daemon_listening(runtime_dir):
        return _adapters_via_registry(args, runtime_dir)
    try:
        with AdminClient(runtime_dir=runtime_dir) as admin:
            admin.ping(timeout=ADMIN_PING_TIMEOUT_S)
            return _adapters_via_daemon(admin, args)
    except LoraplexError as exc:
        if exc.code.value in ("unavailable", "timeout"):
            print(f"loraplex adapters: error: a daemon listens in {runtime_dir} but did not answer ({exc}); it may "
                  "be starting or busy. The registry was not changed: retry, or stop the daemon first",
                  file=sys.stderr)
        else:
            print(f"loraplex adapters: error: {exc}", file=sys.stderr)
        return 1
    except ProtocolError as exc:  # refused before sending, e.g. a name like '../x'
        print(f"loraplex adapters: error: {exc}", file=sys.stderr)
        return 1


ADMIN_PING_TIMEOUT_S = 5.0


def _adapters_via_daemon(admin, args: argparse.Namespace) -> int:
    if args.action == "list":
        for a in admin.adapters():
            tier = a.extra.get("tier")
            if args.tier is None or tier == args.tier:
                print(f"{a.name}\trank={a.rank}\t{a.state}\t{tier or '-'}\t{a.path}")
    elif args.action == "add":
        detail = admin.add_adapter(args.name, str(args.path.resolve()), replace=args.replace)
        if args.replace:
            print(f"replaced {args.name}" if detail.get("changed") else f"{args.name}: same weights, kept")
        else:
            print(f"added {args.name}")
    elif args.action == "rm":
        admin.remove_adapter(args.name)
        print(f"removed {args.name}")
    else:
        admin.pin_adapter(args.name, args.action == "pin")
        print(f"{args.action}ned {args.name}")
    return 0


def _adapters_via_registry(args: argparse.Namespace, runtime_dir: Path) -> int:
    import sqlite3

    from loraplex.adapters_offline import print_offline_list
    from loraplex.daemon.adapter_rules import RegistryError
    from loraplex.daemon.config import ConfigError
    from loraplex.daemon.config_load import load_config
    from loraplex.daemon.config_names import default_state_dir
    from loraplex.daemon.model_scope import ModelScopeError, model_scope
    from loraplex.daemon.registry import AdapterRegistry

    state_dir = args.state_dir or default_state_dir()
    try:
        model = args.model if args.model is not None else load_config(None).model.model
        scope = model_scope(model)
    except (ConfigError, ModelScopeError, OSError) as exc:
        print(f"loraplex adapters: error: {exc}", file=sys.stderr)
        return 1
    try:
        with AdapterRegistry(state_dir / "registry.sqlite3", model=scope) as registry:
            if args.action == "list":
                if args.tier is not None:
                    print("loraplex adapters: error: --tier needs a running daemon", file=sys.stderr)
                    return 1
                print_offline_list(registry.list(), serves_demo=model is None, runtime_dir=runtime_dir)
                others = registry.count_other_models()
                if others:
                    print(f"({others} more registered for other base models or not yet claimed by one; "
                          f"this is {model or 'the built-in demo'}, scope {scope})", file=sys.stderr)
            elif args.action == "add":
                if not (args.path / "adapter_config.json").is_file():
                    print(f"loraplex adapters: error: {args.path} has no adapter_config.json", file=sys.stderr)
                    return 1
                registry.add(args.name, str(args.path.resolve()), source="cli", replace=args.replace)
                print(f"added {args.name} (validated when the daemon starts)")
            elif args.action == "rm":
                registry.remove(args.name)
                print(f"removed {args.name}")
            else:
                registry.set_pinned(args.name, args.action == "pin")
                print(f"{args.action}ned {args.name}")
    except (RegistryError, OSError) as exc:
        print(f"loraplex adapters: error: {exc}", file=sys.stderr)
        return 1
    except sqlite3.Error as exc:  # a damaged registry, or a full state disk
        print(f"loraplex adapters: error: the adapter registry in {state_dir} cannot be used ({exc}); "
              "`loraplex registry check` says why", file=sys.stderr)
        return 1
    return 0


def _configure_stats(parser: argparse.ArgumentParser) -> None:
    _client_args(parser)
    parser.add_argument("--json", action="store_true", help="print the whole stats document as JSON")


def _run_stats(args: argparse.Namespace) -> int:
    """A short summary of the running daemon, or with --json its whole stats document."""
    import json

    from loraplex.ipc.client import LoraplexError
    from loraplex.tui.summary import summary_lines

    try:
        with _client(args) as client:
            stats = client.stats()
    except (LoraplexError, ValueError) as exc:
        print(f"loraplex stats: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else "\n".join(summary_lines(stats)))
    return 0


def _configure_policy(parser: argparse.ArgumentParser) -> None:
    _runtime_dir_arg(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    getter = sub.add_parser("get", help="print the scheduler, cache policy and router the running daemon uses")
    _runtime_dir_arg(getter, inner=True)
    setter = sub.add_parser("set", help="switch a policy of the running daemon")
    _runtime_dir_arg(setter, inner=True)
    setter.add_argument("kind", choices=("scheduler", "cache", "router"),
                        help="scheduler (fcfs, mlq, dlora), cache (none, lru, fifo, cost) or router "
                             "(random, first_fit, most_idle, rank_aware, dlora)")
    setter.add_argument("name")


def _run_policy(args: argparse.Namespace) -> int:
    """Show, or switch at run time, the scheduling policy, cache policy or engine router (admin socket)."""
    from loraplex.ipc.client import AdminClient, LoraplexError

    try:
        with AdminClient(runtime_dir=args.runtime_dir) as admin:
            if args.action == "get":
                stats = admin.stats()
                current = {"scheduler": stats.get("scheduler"), "cache": stats.get("cache_policy"),
                           "router": stats.get("router")}
            else:
                detail = admin.set_policy(args.kind, args.name)
                current = {args.kind: detail.get(args.kind, args.name)}
    except LoraplexError as exc:
        print(f"loraplex policy: error: {exc}", file=sys.stderr)
        return 1
    for kind, name in current.items():
        print(f"{kind}: {name if name is not None else 'unknown'}")
    return 0


def _run_pause(args: argparse.Namespace, paused: bool) -> int:
    """Hold or resume scheduling of the running daemon (admin socket)."""
    from loraplex.ipc.client import AdminClient, LoraplexError

    try:
        with AdminClient(runtime_dir=args.runtime_dir) as admin:
            admin.pause(paused)
    except LoraplexError as exc:
        print(f"loraplex {'pause' if paused else 'resume'}: error: {exc}", file=sys.stderr)
        return 1
    print("scheduling paused: requests queue up until `loraplex resume`" if paused else "scheduling resumed")
    return 0


def _run_cleanup(args: argparse.Namespace) -> int:
    """Remove what a daemon that died without stopping left: socket files and its shared memory."""
    from loraplex.ipc.leftovers import DaemonRunning, clean_runtime_dir
    from loraplex.ipc.runtime_dir import default_runtime_dir

    runtime_dir = args.runtime_dir if args.runtime_dir is not None else default_runtime_dir()
    try:
        done = clean_runtime_dir(runtime_dir)
    except (DaemonRunning, OSError) as exc:
        print(f"loraplex cleanup: error: {exc}", file=sys.stderr)
        return 1
    for path in done.sockets:
        print(f"removed socket\t{path}")
    for name in done.segments:
        print(f"removed shared memory\t{name}")
    for name in done.kept:
        print(f"kept shared memory\t{name}\t(its owner process still runs)")
    if not (done.sockets or done.segments or done.kept):
        print(f"nothing left behind in {runtime_dir}")
    return 1 if done.kept else 0


def _configure_keys(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    gen = sub.add_parser("generate", help="write a CURVE key pair: DIR/NAME.key (secret, 0600) and DIR/NAME.pub")
    gen.add_argument("dir", type=Path)
    gen.add_argument("--name", default="loraplex", help="file name stem (default: loraplex)")


def _run_keys(args: argparse.Namespace) -> int:
    """CURVE keys for server.tcp_listen: the server's pair, and one pair per client whose .pub the server allows."""
    from loraplex.ipc.curve import CurveError, generate_key_pair, read_public_key

    try:
        pub, key = generate_key_pair(args.dir, args.name)
    except (CurveError, OSError) as exc:
        print(f"loraplex keys: error: {exc}", file=sys.stderr)
        return 1
    print(f"secret\t{key}")
    print(f"public\t{pub}\t{read_public_key(pub).decode()}")
    return 0


def _configure_top(parser: argparse.ArgumentParser) -> None:
    _runtime_dir_arg(parser)


def _run_top(args: argparse.Namespace) -> int:
    """The live admin console (Textual); needs no running daemon to start."""
    try:
        from loraplex.tui.app import run_top
    except ImportError as exc:
        print(f"loraplex top: error: the console needs Textual ({exc}); pip install 'textual>=0.80'", file=sys.stderr)
        return 1
    try:
        return run_top(args.runtime_dir)
    except ValueError as exc:  # e.g. a runtime directory too long for a Unix socket path
        print(f"loraplex top: error: {exc}", file=sys.stderr)
        return 2


def _configure_gateway(parser: argparse.ArgumentParser) -> None:
    from loraplex.gateway.cli import configure

    configure(parser)


def _run_gateway(args: argparse.Namespace) -> int:
    """The OpenAI-compatible HTTP gateway, a client of the running daemon (aiohttp; never imports torch)."""
    from loraplex.gateway.cli import run

    return run(args)


def _configure_cluster(parser: argparse.ArgumentParser) -> None:
    from loraplex.cluster.cli import configure

    configure(parser)


def _run_cluster(args: argparse.Namespace) -> int:
    """Replicas of the daemon on Ray Serve behind an OpenAI ingress (needs the `cluster` extra)."""
    from loraplex.cluster.cli import run

    return run(args)


def _configure_sim(parser: argparse.ArgumentParser) -> None:
    from loraplex.daemon.sim.cli import configure

    configure(parser)


def _run_sim(args: argparse.Namespace) -> int:
    from loraplex.daemon.sim.cli import run

    return run(args)


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="WHAT")
    serve = sub.add_parser("serve", help="drive the running daemon with a workload and report latency figures")
    from loraplex.daemon.sim.loadgen import configure

    configure(serve)


def _run_bench(args: argparse.Namespace) -> int:
    from loraplex.daemon.sim.loadgen import run

    return run(args)


def _configure_plan(parser: argparse.ArgumentParser) -> None:
    from loraplex.daemon.sim.planner import configure

    configure(parser)


def _run_plan(args: argparse.Namespace) -> int:
    from loraplex.daemon.sim.planner import run

    return run(args)


COMMANDS: dict[str, Command] = {
    "bench": Command(help="live load generator: `loraplex bench serve` (same workload spec as `loraplex sim`)",
                     configure=_configure_bench, run=_run_bench),
    "generate": Command(help="generate a completion through the running daemon", configure=_configure_generate,
                        run=_run_generate),
    "adapters": Command(help="list, add, remove or pin adapters", configure=_configure_adapters,
                        run=_run_adapters),
    "registry": Command(help="check the adapter registry file, or repair a damaged one (keeping a backup)",
                        configure=registry_cli.configure, run=registry_cli.run),
    "stats": Command(help="a summary of the daemon's metrics (--json: the whole document)", configure=_configure_stats,
                     run=_run_stats),
    "cleanup": Command(help="remove the sockets and shared memory a killed daemon left in its runtime directory "
                            "(refused while a daemon serves there)", configure=_runtime_dir_arg, run=_run_cleanup),
    "keys": Command(help="CURVE key pairs for the tcp listener (server.tcp_curve_*) and its clients",
                    configure=_configure_keys, run=_run_keys),
    "policy": Command(help="show or switch the scheduler, cache policy or engine router of the running daemon",
                      configure=_configure_policy, run=_run_policy),
    "pause": Command(help="hold scheduling of the running daemon: requests are accepted and queue up, no new step "
                          "starts (steps in flight finish)", configure=_runtime_dir_arg,
                     run=lambda args: _run_pause(args, True)),
    "resume": Command(help="resume scheduling after `loraplex pause`", configure=_runtime_dir_arg,
                      run=lambda args: _run_pause(args, False)),
    "top": Command(help="live admin console: queues, requests, cache, PCIe, workers, engines; admin actions",
                   configure=_configure_top, run=_run_top),
    "gateway": Command(help="OpenAI-compatible HTTP server (completions, chat, models, metrics) over the daemon",
                       configure=_configure_gateway, run=_run_gateway),
    "cluster": Command(help="`loraplex cluster serve`: daemon replicas on Ray Serve behind one OpenAI ingress, "
                              "placed by a rank- and adapter-aware request router", configure=_configure_cluster,
                        run=_run_cluster),
    "serve": Command(
        help="run the daemon in the foreground (Ctrl-C drains and stops)",
        configure=_configure_serve,
        run=_run_serve,
        engine=True,
    ),
    "demo": Command(
        help="offline demo: the built-in model answers prompts through several adapters in one batch",
        configure=_configure_demo,
        run=_run_demo,
        engine=True,
    ),
    "demo-model": Command(
        help="show the built-in demo model and its LoRA adapters, or copy them to DIR (once; reused afterwards)",
        configure=_configure_demo_model,
        run=_run_demo_model,
        engine=True,
    ),
    "sim": Command(help="simulate engines with the daemon's own schedulers, routers and caches on a virtual clock",
                   configure=_configure_sim, run=_run_sim),
    "plan": Command(help="capacity planner: the fewest engines that serve a workload within its SLOs (simulated)",
                    configure=_configure_plan, run=_run_plan),
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
    command = COMMANDS[args.command]
    if command.engine and (missing := missing_engine_modules()):
        print(f"loraplex {args.command}: error: this command needs the engine side ({', '.join(missing)} not "
              f"installed); install it with: {ENGINE_INSTALL}", file=sys.stderr)
        return 2
    try:
        return command.run(args)
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
