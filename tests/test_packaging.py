"""The two installs: `pip install loraplex` (the light side: clients, gateway, console,
the torch-free daemon) and `loraplex[engine]` (torch, safetensors, triton).

A light install is simulated by a subprocess in which the engine side's modules cannot
be found; the slow test installs the package into a fresh virtualenv for real.
"""
from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.daemon_process import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = "pip install 'loraplex[engine]'"

# Run first in the subprocess: the engine side is "not installed" (as pip would leave it).
NO_ENGINE = """
import sys
class _NoEngine:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "safetensors", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoEngine())
"""


def without_engine(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_ENGINE + code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_shim_hides_the_engine_side() -> None:
    proc = without_engine("import torch")
    assert proc.returncode == 1 and "No module named 'torch'" in proc.stderr


@pytest.mark.parametrize("argv", [["serve"], ["demo"], ["demo-model"]])
def test_an_engine_command_names_the_extra_in_one_line(argv: list[str], tmp_path: Path) -> None:
    proc = without_engine("import sys; from loraplex.cli import main; sys.exit(main(sys.argv[1:]))",
                          *argv, *(["--runtime-dir", str(tmp_path)] if argv == ["serve"] else []))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"loraplex {argv[0]}: error: this command needs the engine side (torch")
    assert proc.stderr.rstrip().endswith(INSTALL_HINT)
    assert not (tmp_path / "client.sock").exists()


def test_loraplexd_names_the_extra_too(tmp_path: Path) -> None:
    proc = without_engine("import sys; from loraplex.cli import serve_main; sys.argv[1:] = ['--runtime-dir', "
                          f"{str(tmp_path)!r}]; sys.exit(serve_main())")
    assert proc.returncode == 2 and proc.stderr.rstrip().endswith(INSTALL_HINT), proc.stderr


def test_client_commands_and_the_offline_api_on_a_light_install(tmp_path: Path) -> None:
    """A client command runs (and fails only for the missing daemon); the offline API names the extra."""
    proc = without_engine("import sys; from loraplex.cli import main; sys.exit(main(sys.argv[1:]))",
                          "generate", "--runtime-dir", str(tmp_path), "hi")
    assert proc.returncode == 1 and "no loraplex daemon is listening" in proc.stderr, proc.stderr
    proc = without_engine("from loraplex import LLM")
    assert proc.returncode == 1 and proc.stderr.rstrip().endswith(INSTALL_HINT), proc.stderr
    assert "loraplex.LLM needs the engine side (torch is not installed)" in proc.stderr


@pytest.mark.slow
def test_a_fresh_light_install_has_no_torch_and_talks_to_a_daemon(tmp_path: Path) -> None:
    """`pip install .` into a new virtualenv (needs the package index): no torch, and its
    `loraplex generate` is answered by a daemon of the full install."""
    env_dir = tmp_path / "light"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", str(ROOT)], check=True, timeout=900, capture_output=True)
    installed = subprocess.run([*pip, "list", "--format=freeze"], check=True, capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in installed.splitlines()}
    assert "loraplex" in names and not names & {"torch", "safetensors", "triton", "numpy", "ray"}, installed
    light = str(env_dir / "bin" / "loraplex")
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProcess(tmp_path / "daemon").start()
    try:
        proc = subprocess.run([light, "generate", "--runtime-dir", str(daemon.runtime_dir), "--max-tokens", "4",
                               "hi"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "tokens; ttft" in proc.stderr, proc.stderr
        proc = subprocess.run([light, "serve", "--runtime-dir", str(tmp_path / "other")], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.rstrip().endswith(INSTALL_HINT), proc.stderr
    finally:
        assert daemon.stop() == 0


def _setup_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("loraplex_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines ROOTS and packages() without building
    return module


def test_every_folder_of_modules_is_a_listed_package() -> None:
    """A regular install carries every package (a hand-kept list once left out loraplex.gpu_engine.tp)."""
    setup = _setup_module()
    listed = set(setup.packages())
    assert "loraplex.gpu_engine.tp" in listed
    for name, folder in setup.ROOTS.items():
        for module in (ROOT / folder).rglob("*.py"):
            parts = module.parent.relative_to(ROOT / folder).parts
            if "__pycache__" in parts:
                continue
            package = ".".join((name, *parts))
            assert package in listed, f"{module.relative_to(ROOT)} would be left out of the wheel"
            assert (module.parent / "__init__.py").exists(), f"{package} has modules but no __init__.py"


@pytest.mark.slow
def test_a_built_wheel_holds_every_module(tmp_path: Path) -> None:
    """`pip wheel .` (build isolation: needs the package index) from a clean copy of the tree."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", "build", "*.egg-info", ".git", "__pycache__",
                                                              "*.so", "bench", "tests", "docs"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, timeout=900, capture_output=True)
    names = set(zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist())
    setup = _setup_module()
    for name, folder in setup.ROOTS.items():
        for module in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in module.parts:
                wanted = "/".join((*name.split("."), *module.relative_to(ROOT / folder).parts))
                assert wanted in names, f"{wanted} missing from the wheel"


# setup.py's packages and folders with pyproject.toml's settings, built without the extension
# (its compile needs pybind11, a build-only requirement): the Python side of `pip install .`.
BUILD_PY = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("loraplex_setup", "setup.py")
setup_py = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup_py)
from setuptools import setup
setup(packages=setup_py.packages(), package_dir=setup_py.ROOTS, script_args=["build_py", "--build-lib", sys.argv[1]])
"""


def test_building_the_package_prints_no_setuptools_warnings(tmp_path: Path) -> None:
    """What the first `make run` builds (`pip install -e .`): setuptools' build_py on a clean
    copy warns about nothing (it warned once per data folder of the demo, taken for a package
    missing from `packages`), and the demo's files are still package data."""
    import os
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", "build", "*.egg-info", ".git", "__pycache__",
                                                              "*.so", "bench", "tests", "docs", ".hypothesis",
                                                              ".pytest_cache", ".whl"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # else build_py warns of that
    proc = subprocess.run([sys.executable, "-c", BUILD_PY, str(tmp_path / "lib")], cwd=src, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "warn" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
    trained = ROOT / "gpu_engine" / "demo" / "trained"
    built = tmp_path / "lib" / "loraplex" / "gpu_engine" / "demo" / "trained"
    for path in trained.rglob("*"):
        if path.is_file():
            assert (built / path.relative_to(trained)).is_file(), f"{path.relative_to(ROOT)} left out"
    assert all((tmp_path / "lib" / "loraplex" / name).is_file() for name in ("py.typed", "_C.pyi"))


def test_the_readme_shows_how_to_add_the_cluster_extra_from_a_checkout() -> None:
    import re

    import tomllib

    section = (ROOT / "README.md").read_text().split("### Beyond one node")[1].split("\n### ")[0]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    commands = re.findall(r"^\.venv/bin/python -m pip install -e '\.\[([a-z,]+)\]'$", section, re.MULTILINE)
    assert commands, "no command that adds the cluster extra to a checkout's .venv"
    for listed in commands:
        assert "cluster" in listed.split(",") and set(listed.split(",")) <= set(extras), listed
    # `make venv` (and `make test`) install the test extra, which holds the cluster one.
    assert "`make venv`" in section and "loraplex[cluster]" in extras["test"]
    assert re.search(r"^venv: \$\(VENV\)/\.installed-test$", (ROOT / "Makefile").read_text(), re.MULTILINE)
