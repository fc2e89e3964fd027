"""The rules an adapter registry entry follows, torch-free and without the database: names
(contracts/names.py), paths (bounded, absolute, resolved inside the allowed roots), target
module lists, and the one error type their refusals raise (its codes are the wire's).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from loraplex.contracts.names import NAME_RULE, is_valid_name

MAX_PATH_LEN = 4096
ERROR_CODES: tuple[str, ...] = ("already_exists", "not_found", "invalid_field", "forbidden_path")


class RegistryError(ValueError):
    """A registry operation was refused; `code` is one of ERROR_CODES (the wire error codes)."""

    def __init__(self, code: str, message: str) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown registry error code {code!r}")
        super().__init__(message)
        self.code = code


def check_adapter_name(name: object) -> str:
    if not is_valid_name(name):
        shown = name[:64] if isinstance(name, str) else name
        raise RegistryError("invalid_field", f"adapter name must be {NAME_RULE}, got {shown!r}")
    return name  # type: ignore[return-value]


def check_adapter_path(path: str | os.PathLike[str], allowed_roots: tuple[str, ...] = ()) -> Path:
    """The adapter directory `path` with symlinks resolved, if it is allowed.

    Refuses (RegistryError) a relative or missing path, a non-directory
    (invalid_field) and, when `allowed_roots` is non-empty, a path whose resolved
    location is outside every resolved root (forbidden_path), so a symlink cannot
    escape the roots. Callers should store and load the returned path, not `path`.
    """
    raw = os.fspath(path)
    if not raw or "\x00" in raw or not os.path.isabs(raw):
        raise RegistryError("invalid_field", f"adapter path must be an absolute path, got {raw[:256]!r}")
    try:
        resolved = Path(raw).resolve(strict=True)
    except FileNotFoundError:
        raise RegistryError("invalid_field", f"adapter path {raw} does not exist") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: symlink loop on older Pythons
        raise RegistryError("invalid_field", f"adapter path {raw} cannot be resolved: {exc}") from None
    if allowed_roots:
        roots = [Path(root).expanduser().resolve() for root in allowed_roots]
        if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
            via = "" if str(resolved) == raw else f" (resolves to {resolved})"
            raise RegistryError(
                "forbidden_path",
                f"adapter path {raw}{via} is outside the allowed adapter directories: {', '.join(map(str, roots))}",
            )
    if not resolved.is_dir():
        raise RegistryError("invalid_field", f"adapter path {raw} is not a directory")
    return resolved


def check_path_text(path: str | os.PathLike[str]) -> str:
    """The path as text, if it is a bounded absolute path (the registry stores it unresolved)."""
    raw = os.fspath(path)
    if not isinstance(raw, str) or not 1 <= len(raw) <= MAX_PATH_LEN or "\x00" in raw:
        raise RegistryError("invalid_field", f"adapter path must be 1..{MAX_PATH_LEN} characters without NUL")
    if not os.path.isabs(raw):
        raise RegistryError(
            "invalid_field", f"adapter path must be absolute (the daemon's working directory is not yours), got {raw!r}"
        )
    return raw


def check_target_modules(target_modules: Iterable[str]) -> tuple[str, ...]:
    if isinstance(target_modules, str):
        raise RegistryError("invalid_field", "target_modules must be a sequence of module names, not one string")
    modules = tuple(target_modules)
    if not all(isinstance(m, str) and m for m in modules):
        raise RegistryError("invalid_field", f"target_modules must be non-empty strings, got {modules!r}")
    return modules
