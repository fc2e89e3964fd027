"""The package boundaries, read from the code's own imports (ast), and the light root.

The engine side (gpu_engine/, cpu_lora/, kernels/) never imports the daemon: what both
need lives in loraplex.contracts. `import loraplex` alone never imports torch, while
`from loraplex import LLM, SamplingParams` still gives the offline API.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SIDE = ("gpu_engine", "cpu_lora", "kernels")
# The folders whose package name is not their path (pyproject's package-dir).
PACKAGE_OF = {"gpu_engine": "loraplex.gpu_engine", "cpu_lora": "loraplex.cpu_lora", "kernels": "loraplex.kernels",
              "ipc": "loraplex.ipc", "daemon": "loraplex.daemon", "tui": "loraplex.tui",
              "gateway": "loraplex.gateway", "cluster": "loraplex.cluster", "loraplex": "loraplex"}


def module_imports(path: Path, *, top_level: bool = False) -> set[str]:
    """Every module `path` imports, anywhere in the file (also inside functions), by absolute name;
    `from X import name` counts as X and X.name, so a submodule imported by name is seen.
    top_level: only its module-level import statements (what runs when it is imported)."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = ".".join([PACKAGE_OF[rel.parts[0]], *rel.parts[1:-1]])
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def offending(folders: tuple[str, ...], forbidden: str) -> dict[str, list[str]]:
    out = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad = sorted(m for m in module_imports(path) if m == forbidden or m.startswith(forbidden + "."))
            if bad:
                out[str(path.relative_to(ROOT))] = bad
    return out


def test_the_engine_side_never_imports_the_daemon() -> None:
    assert offending(ENGINE_SIDE, "loraplex.daemon") == {}


def test_the_cluster_never_imports_torch_or_the_engine_side() -> None:
    """Ray Serve replicas run the daemon as a child process; the cluster code itself stays torch-free."""
    for forbidden in ("torch", "loraplex.gpu_engine", "loraplex.cpu_lora", "loraplex.kernels"):
        assert offending(("cluster",), forbidden) == {}, forbidden


def test_the_check_sees_every_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan itself can fail: plain, from, submodule-by-name and function-local imports all count."""
    folder = tmp_path / "gpu_engine"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text("import loraplex.daemon.registry\n")
    (folder / "b.py").write_text("def f():\n    from loraplex.daemon.memory.allocator import PageAllocator\n")
    (folder / "c.py").write_text("from loraplex import daemon\n")
    (folder / "sub" / "d.py").write_text("from ... import daemon\n")
    (folder / "e.py").write_text("from loraplex.contracts.geometry import PageGeometry\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(offending(("gpu_engine",), "loraplex.daemon")) == [
        "gpu_engine/a.py", "gpu_engine/b.py", "gpu_engine/c.py", "gpu_engine/sub/d.py"]


def test_messages_are_imported_through_the_protocol_module() -> None:
    """One path to the message classes: loraplex.ipc.protocol, which loads every declaration module
    (so decode's registry is complete); only ipc/messages/ itself and protocol.py reach inside."""
    folders = ("daemon", "ipc", "gpu_engine", "cpu_lora", "kernels", "tui", "gateway", "loraplex")
    found = offending(folders, "loraplex.ipc.messages")
    allowed = {"ipc/protocol.py"}
    assert {path: mods for path, mods in found.items()
            if path not in allowed and not path.startswith("ipc/messages/")} == {}


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_import_loraplex_and_its_client_never_import_torch() -> None:
    proc = run_python("import sys, loraplex, loraplex.ipc.client, loraplex.contracts.geometry, "
                      "loraplex.contracts.layer_groups, loraplex.contracts.names\n"
                      "assert 'torch' not in sys.modules, 'torch was imported'\n"
                      "assert 'loraplex.offline' not in sys.modules\n")
    assert proc.returncode == 0, proc.stderr


def test_the_offline_api_is_reached_from_the_root() -> None:
    import loraplex
    from loraplex import LLM, SamplingParams
    from loraplex.offline import LLM as OfflineLLM

    assert LLM is OfflineLLM and SamplingParams(max_tokens=3).max_tokens == 3
    assert set(loraplex.__all__) >= {"LLM", "SamplingParams", "RequestOutput"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loraplex.nope  # noqa: B018
    import loraplex.gpu_engine

    assert not hasattr(loraplex.gpu_engine, "LLM")  # re-exporting it would import the daemon


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports when it is imported: its module-level import statements
    (imports inside functions run later, and are how a deliberate back-reference is written)."""
    return module_imports(path, top_level=True) & modules


def import_cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module in the graph of module-level imports."""
    files = {}
    for folder, package in PACKAGE_OF.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *rel]).removesuffix(".__init__")
            files[name] = path
    graph = {name: _top_level_imports(path, set(files)) - {name} for name, path in files.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in order:
            visit(name)
    return cycles


def test_no_import_cycles() -> None:
    assert import_cycles() == []


def test_the_cycle_check_finds_a_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: two modules that import each other at module level are one cycle."""
    real = _top_level_imports

    def with_cycle(path: Path, modules: set[str]) -> set[str]:
        found = real(path, modules)
        if path == ROOT / "daemon" / "scheduler" / "sequence.py":
            found.add("loraplex.daemon.scheduler.base")
        return found

    monkeypatch.setitem(globals(), "_top_level_imports", with_cycle)
    assert any({"loraplex.daemon.scheduler.base", "loraplex.daemon.scheduler.sequence"} <= set(c)
               for c in import_cycles())
