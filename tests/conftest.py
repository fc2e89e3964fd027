"""Shared fixtures: the demo model in a per-session temp dir (never the user's cache),
and reference generation through transformers + PEFT (test-only dependencies)."""
from __future__ import annotations

import os
import tempfile

# Set before anything can resolve the default demo location.
os.environ.setdefault("LORAPLEX_CACHE_DIR", tempfile.mkdtemp(prefix="loraplex-test-cache-"))
os.environ.setdefault("LORAPLEX_DEMO", "random")  # daemons started without --model serve the parity fixture
# Without a GPU, Triton kernels run under the interpreter; set before anything imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo():
    from loraplex.gpu_engine.demo import ensure_demo_model

    return ensure_demo_model()


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present."""
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
