"""Stage `build-test`: build the extension, run the GPU tests, and the CUDA parity
checks at real size (bench/gpu_parity.py), each check in its own child process.

On CUDA: the `gpu`-marked tests, the kernel and decode-graph test files (which
follow the device), and every parity check. Dry run: the same items at toy size
on the CPU; the gpu-marked tests come back skipped by pytest itself, and the
CUDA-only parity check (graphs) reports its reason.
"""
from __future__ import annotations

import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

from .harness import ROOT, StageContext
from .plan import Step

STAGE = "build-test"

# Test files whose tests run on CUDA when it is present (on CPU they run in the default suite).
DEVICE_TEST_FILES = ("tests/test_kernels_lora.py", "tests/test_kernels_attention.py", "tests/test_kernels_backend.py",
                     "tests/test_kernels_e2e.py", "tests/test_decode_graphs.py")
EXTENSION_PROBE = (
    "import json, loraplex._C as C\n"
    "from loraplex.gpu_engine.cpu_assist_cuda import cuda_stream_ops_available\n"
    "print(json.dumps({'path': C.__file__, 'cuda_stream_ops': cuda_stream_ops_available(),\n"
    "                  'unavailable_reason': C.cuda_stream_ops_unavailable()}))\n")


MESSAGE_CHARS = 400  # of each failing test's message kept in the JSON: the next window starts from it


def junit_counts(path: Path) -> dict[str, Any]:
    """passed / failed / skipped counts, the failing test ids and their messages, of a pytest junit XML."""
    root = ET.parse(path).getroot()
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "messages": {}}
    for case in root.iter("testcase"):
        found = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "failed"}.get(found.tag if found is not None else "passed",
                                                            found.tag if found is not None else "passed")
        counts[key] += 1
        if key == "failed":
            test = f"{case.get('classname')}::{case.get('name')}"
            counts["failures"].append(test)
            counts["messages"][test] = (found.get("message") or found.text or "")[:MESSAGE_CHARS]
    return counts


def pytest_item(ctx: StageContext, name: str, args: list[str], est_s: float) -> None:
    with tempfile.TemporaryDirectory(prefix="lpx-gpu-junit-") as tmp:
        xml = Path(tmp) / "junit.xml"
        # exit 5: nothing collected under the marker, not a failure
        ctx.run(name, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args],
                est_s=est_s, parse_json=False, ok_codes=(0, 5))
        if xml.exists():
            counts = junit_counts(xml)
            ctx.note(name, **counts)
            ctx.figures[name] = {k: v for k, v in counts.items() if k not in ("failures", "messages")}


INSTALLED_PROBE = "import loraplex._C, loraplex.daemon, loraplex.gpu_engine; print(loraplex.__file__)"


def install(ctx: StageContext) -> None:
    """`pip install -e .` (no deps, no index: a GPU host has no network) unless this checkout is
    installed already, which builds the extension against the host's own Python and CUDA."""
    probe = ctx.run("installed", [sys.executable, "-c", INSTALLED_PROBE], est_s=5, parse_json=False,
                    ok_codes=(0, 1))
    here = probe is not None and str(ROOT) in probe["stdout_tail"]
    ctx.items.pop()  # the probe is not an item of its own
    if here:
        ctx.skip("install", f"this checkout is installed already ({ROOT})")
        return
    ctx.run("install", [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "-e", "."], est_s=60, parse_json=False)


def gpu_marked_files() -> list[str]:
    """The test files that mark tests `gpu`: collecting the whole suite to find them took longer
    than running them (a dry run on a CPU skips them all)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def extension(ctx: StageContext) -> None:
    ext = ctx.run("extension", [sys.executable, "-c", EXTENSION_PROBE], est_s=10)
    if ext is not None:
        ctx.note("extension", **ext)
        ctx.figures["cuda_stream_ops"] = ext["cuda_stream_ops"]
        if ctx.cuda and not ext["cuda_stream_ops"]:
            ctx.items[-1].status, ctx.items[-1].reason = "failed", f"no CUDA stream ops: {ext['unavailable_reason']}"


def kernel_compile(ctx: StageContext) -> None:
    """Every Triton kernel compiled by this host's triton and ptxas (tests/test_kernels_compile.py); a dry
    run keeps to the launch-space checks, since the suite itself runs the compiles."""
    pick = ["-k", "not every_launch_compiles"] if ctx.dry_run else []
    pytest_item(ctx, "kernel_compile", ["tests/test_kernels_compile.py", *pick], est_s=30)


def gpu_marked_tests(ctx: StageContext) -> None:
    pytest_item(ctx, "gpu_marked_tests", ["-m", "gpu", *gpu_marked_files()], est_s=30)


def device_tests(ctx: StageContext) -> None:
    if ctx.cuda:
        pytest_item(ctx, "device_tests", ["-m", "not slow", *DEVICE_TEST_FILES], est_s=60)
    else:
        ctx.skip("device_tests", "on the CPU these files run in the default suite under TRITON_INTERPRET")


# what a check needs of the budget to start (others: 20 s)
PARITY_EST_S = {"daemon": 60, "attention": 45, "families": 90}


def parity(check: str) -> Callable[[StageContext], None]:
    def run_check(ctx: StageContext) -> None:
        args = ["gpu_parity.py", "--json", "--checks", check, "--device", ctx.device] + (["--small"] if ctx.dry_run
                                                                                        else [])
        report = ctx.run(f"parity_{check}", args, est_s=PARITY_EST_S.get(check, 20), ok_codes=(0, 1))
        if report is None:
            return
        result = report["checks"][check]
        item = ctx.items[-1]
        if "skipped" in result:
            item.status, item.reason = "skipped", result["skipped"]
            return
        item.figures.update({k: v for k, v in result.items() if k != "traceback"})
        if not result.get("ok"):
            item.status = "failed"
            item.reason = result.get("error") or "outputs differ from the reference"
            if result.get("traceback"):
                item.reason += "\n" + result["traceback"]
        ctx.figures[f"parity_{check}"] = bool(result.get("ok"))
    return run_check


def steps() -> list[Step]:
    """This stage's steps, in the order a stage run takes them (tiers: gpu_stages.plan). Estimates: the
    first H200 window (bench/results/gpu), rounded up."""
    return [Step(STAGE, "extension", 1, 10, extension, order=0),
            Step(STAGE, "kernel_compile", 1, 40, kernel_compile, order=1),
            Step(STAGE, "parity_kernels", 2, 20, parity("kernels"), order=0),
            # not yet run on a GPU: ~16 JIT compiles (2 dtypes x head_dim 128/256 x capped or not) at 1-3 s each
            Step(STAGE, "parity_attention", 2, 45, parity("attention"), order=0),
            Step(STAGE, "parity_graphs", 2, 25, parity("graphs"), order=1),
            Step(STAGE, "parity_peft_offline", 2, 30, parity("peft_offline"), order=2),
            Step(STAGE, "parity_daemon", 2, 70, parity("daemon"), order=3),
            # not yet run on a GPU: seven families' demos and LoRA on embed_tokens / lm_head, each against PEFT
            Step(STAGE, "parity_families", 2, 120, parity("families"), order=4),
            Step(STAGE, "gpu_marked_tests", 2, 35, gpu_marked_tests, order=4),
            # the unit tests on CUDA: after the first headline figures (tier 3), they are many and slow to JIT
            Step(STAGE, "device_tests", 3, 45, device_tests, order=3)]


def run(ctx: StageContext) -> None:
    for step in steps():
        step.run(ctx)
