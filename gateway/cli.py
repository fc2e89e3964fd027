"""`loraplex gateway`: its flags and its entry point (loraplex.cli registers
the subcommand and imports this module only when it runs).

Only argparse at import time, so `loraplex --help` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.gateway.config import DEFAULT_MAX_LORAS, DEFAULT_SERVED_MODEL_NAME, GatewayConfig, limit_fields

_TYPES = {"int": int, "float": float}


def limit_flag(name: str) -> str:
    """The flag of a GatewayConfig limit: header_timeout_s -> --header-timeout."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks one)")
    parser.add_argument("--runtime-dir", type=Path, default=None,
                        help="the daemon's runtime directory (default: $LORAPLEX_RUNTIME_DIR or the default one)")
    parser.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME,
                        help=f"the base model's id in the API (default {DEFAULT_SERVED_MODEL_NAME}); "
                             "any other model names an adapter")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the base model's HF directory, for its chat template (default: a plain "
                             "'role: content' template)")
    parser.add_argument("--enable-adapter-admin", action="store_true",
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds before a generation is given up (default: none)")
    parser.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS,
                        help=f"max_lora reported in vllm:lora_requests_info when the daemon does not report it "
                             f"(default {DEFAULT_MAX_LORAS}, the daemon's scheduler.max_loras_per_batch default)")
    for f in limit_fields():  # declared once, with their help, in GatewayConfig
        default = "" if f.default is None else f" (default {f.default:g})"
        parser.add_argument(limit_flag(f.name), dest=f.name, type=_TYPES[f.type.split("|")[0].strip()],
                            metavar="S" if f.name.endswith("_s") else "N", default=None,
                            help=f.metadata["help"] + default)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def config_from(args: argparse.Namespace) -> GatewayConfig:
    """The settings the flags give; ValueError for bad ones."""
    limits = {f.name: getattr(args, f.name) for f in limit_fields() if getattr(args, f.name) is not None}
    return GatewayConfig(host=args.host, port=args.port, runtime_dir=args.runtime_dir,
                         served_model_name=args.served_model_name, model_dir=args.model_dir,
                         enable_adapter_admin=args.enable_adapter_admin, request_timeout_s=args.request_timeout,
                         max_loras=args.max_loras, **limits)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; exit status 2 for bad settings."""
    import asyncio
    import logging

    from loraplex.gateway.app import serve
    from loraplex.gateway.chat_template import ChatTemplateError

    logging.basicConfig(level=args.log_level.upper(), format="loraplex-gateway %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"loraplex gateway: error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency; this only keeps odd platforms working
        runner = asyncio.run
    try:
        runner(serve(config))
    except ChatTemplateError as exc:
        print(f"loraplex gateway: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"loraplex gateway: error: {exc}", file=sys.stderr)
        return 1
    return 0
