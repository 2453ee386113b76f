# The README's two commands: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PYTEST_ARGS ?=

.PHONY: demo test install install-dev system-deps lint typecheck pytest proto bench clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(BIN)/activate
	$(PY) -m pip install --quiet -e '.[embedded]'

install-dev: $(BIN)/activate
	$(PY) -m pip install --quiet -e '.[dev]'

# Debian packages the test suite needs (redis-server for the Redis tests).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }

demo: install
	$(BIN)/kvc demo

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck:
	$(BIN)/mypy

pytest:
	$(BIN)/pytest $(PYTEST_ARGS)

test: install-dev system-deps lint typecheck pytest

# Regenerate the gRPC stubs from proto/ (a test fails when they are stale).
proto: install-dev
	$(PY) -m kvc.protogen

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
