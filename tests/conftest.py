"""Shared fixtures: the demo model in a per-session temp dir (never the user's cache),
and reference generation through transformers + PEFT (test-only dependencies); the
Hypothesis profiles (`ci`: derandomized, the default; `fuzz`: fresh randomness and
LORAPLEX_FUZZ_SCALE times the examples, for `make fuzz`)."""
from __future__ import annotations

import os
import tempfile

# Set before anything can resolve the default demo location.
os.environ.setdefault("LORAPLEX_CACHE_DIR", tempfile.mkdtemp(prefix="loraplex-test-cache-"))
os.environ.setdefault("LORAPLEX_DEMO", "random")  # daemons started without --model serve the parity fixture
# Without a GPU, Triton kernels run under the interpreter; set before anything imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import datetime  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, is_hypothesis_test, settings  # noqa: E402

# Registered and loaded before any test module builds its own settings, so those inherit
# derandomize and database from the profile (they set only examples, deadline, health checks).
# ci: the same examples on every run and machine, so a failure is a bug, never a draw; no
# example database (it would replay one machine's past failures); no timing health check
# (a loaded 2-core runner is not a slow test). The deadline only catches a runaway example.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True,
                          deadline=datetime.timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
# fuzz: exploration; failures land in .hypothesis/ and are replayed first next time.
settings.register_profile("fuzz", derandomize=False, print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
HYPOTHESIS_PROFILE = os.environ.get("LORAPLEX_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


@pytest.fixture(scope="session")
def demo():
    from loraplex.gpu_engine.demo import ensure_demo_model

    return ensure_demo_model()


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present; under the fuzz profile every property test
    runs LORAPLEX_FUZZ_SCALE times its own number of examples."""
    if HYPOTHESIS_PROFILE == "fuzz":
        _scale_examples(items, int(os.environ.get("LORAPLEX_FUZZ_SCALE", "20")))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _scale_examples(items, scale: int) -> None:
    """Multiply each property test's max_examples (a test's own @settings outrank any profile,
    so the profile alone cannot raise them). Hypothesis keeps a @given test's settings on
    `_hypothesis_internal_use_settings` and a state machine's on its TestCase class."""
    if scale < 1:
        raise ValueError("LORAPLEX_FUZZ_SCALE must be a positive integer")
    done: set[int] = set()
    for item in items:
        fn = getattr(item, "obj", None)
        if fn is None or not is_hypothesis_test(fn):
            continue
        cls = getattr(item, "cls", None)
        owner = cls if isinstance(getattr(cls, "settings", None), settings) else getattr(fn, "__func__", fn)
        attr = "settings" if owner is cls else "_hypothesis_internal_use_settings"
        if id(owner) in done:
            continue
        current = getattr(owner, attr, None)
        if not isinstance(current, settings):
            raise RuntimeError(f"cannot scale the examples of {item.nodeid}: Hypothesis changed how it keeps settings")
        setattr(owner, attr, settings(current, max_examples=current.max_examples * scale))
        done.add(id(owner))
