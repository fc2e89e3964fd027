# loraplex: `make run` serves the built-in demo model, `make test` runs the suite.
# Both create or update the virtualenv first; nothing needs installing by hand.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Where no NVIDIA GPU is present, take the CPU build of torch (never pull CUDA wheels).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_CPU_INDEX ?=
PYTEST_ARGS ?=
# The suite's modules run on this many pytest-xdist workers, whole (--dist loadscope: a module's
# shared daemon is started once). Three on two cores: about half of a test's time is spent waiting
# on daemons and sockets. 0 runs everything in one process.
PYTEST_WORKERS ?= 3
# Property tests: `ci` replays the same derandomized examples on every run (tests/conftest.py);
# `make fuzz` draws fresh ones, FUZZ_SCALE times as many.
HYPOTHESIS_PROFILE ?= ci
FUZZ_SCALE ?= 20

.PHONY: run demo test test-host lint fuzz venv venv-host bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

$(VENV)/.torch-$(TORCH_VERSION): | $(PY)
ifeq ($(HAS_GPU),1)
	$(PIP) install -q "torch==$(TORCH_VERSION)"
else
	$(PIP) install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_CPU_INDEX),--index-url $(TORCH_CPU_INDEX))
endif
	touch $@

# The project with one extra: `engine` (the serving side) for run and demo, `test` (engine
# and the test tools) for the rest. Reinstall when the packaging or the native sources change.
$(VENV)/.installed-%: pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h) $(VENV)/.torch-$(TORCH_VERSION)
	$(PIP) install -q -e ".[$*]" "torch==$(TORCH_VERSION)"
	touch $@

venv: $(VENV)/.installed-test

run: $(VENV)/.installed-engine
	@echo "loraplex: serving the built-in demo model in the foreground (Ctrl-C drains and stops)."
	@echo "  In another terminal:  .venv/bin/loraplex generate --adapter upper 'ROMEO:'"
	@echo "                        (adapters: upper, reverse, amen; without --adapter the base model answers)"
	@echo "                        .venv/bin/loraplex adapters list;  .venv/bin/loraplex stats"
	$(PY) -m loraplex.cli serve

demo: $(VENV)/.installed-engine
	$(PY) -m loraplex.cli demo

# ruff: pyflakes, pycodestyle errors and import order over the whole tree (pyproject.toml [tool.ruff]).
lint: venv
	$(VENV)/bin/ruff check .

test: venv
	LORAPLEX_HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

fuzz: venv
	LORAPLEX_HYPOTHESIS_PROFILE=fuzz LORAPLEX_FUZZ_SCALE=$(FUZZ_SCALE) $(PY) -m pytest -m hypothesis $(PYTEST_ARGS)

bench: venv
	$(PY) bench/engine_throughput.py --json

# The GPU validation in one window (bench/README.md, "GPU validation"); a dry run at toy size without a GPU.
GPU_CHECK_OUT ?= bench/out/gpu
gpu-check: venv
	$(PY) bench/gpu_check.py --window 570 --out $(GPU_CHECK_OUT) $(if $(HAS_GPU),,--dry-run)

# The lent GPU hosts run torch 2.11 (CUDA 13) and triton 3.6, older than the pins above: a second
# virtualenv with exactly those (PyPI's CUDA build of torch, which runs on the CPU too; about 5 GB)
# runs the kernel compile check and the engine's parity tests there, so an API newer than the
# host's is caught without a GPU. numpy < 2.4: triton 3.6's CPU interpreter converts one-element
# arrays to ints, which numpy 2.4 refuses (the compiled path on the GPU host does not).
HOST_VENV ?= .venv-host
HOST_TORCH ?= 2.11.0
HOST_TRITON ?= 3.6.0
$(HOST_VENV)/.ready-$(HOST_TORCH)-$(HOST_TRITON): | $(PY)
	$(PYTHON) -m venv $(HOST_VENV)
	$(HOST_VENV)/bin/python -m pip install -q "torch==$(HOST_TORCH)" "triton==$(HOST_TRITON)" "numpy<2.4" safetensors \
	  msgpack pyzmq tokenizers pytest hypothesis transformers peft
	$(HOST_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

venv-host: venv $(HOST_VENV)/.ready-$(HOST_TORCH)-$(HOST_TRITON)

# The engine's parity tests (against transformers + PEFT, prompt logprobs included) and the kernel
# tests, and the packed CPU weights, on the hosts' versions.
HOST_TESTS ?= tests/test_parity_peft.py tests/test_architectures.py tests/test_kernels_lora.py tests/test_kernels_attention.py \
	tests/test_kernels_backend.py tests/test_prompt_logprobs.py tests/test_head_lora.py tests/test_cpu_gemm.py
test-host: venv-host
	LORAPLEX_HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(HOST_VENV)/bin/python -m pytest $(PYTEST_ARGS) $(HOST_TESTS)

clean:
	rm -rf $(VENV) $(HOST_VENV) build *.egg-info loraplex/_C*.so
