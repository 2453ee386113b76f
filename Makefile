# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: demo test install install-dev system-deps lint typecheck pytest proto clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(BIN)/activate
	$(PY) -m pip install --quiet -e '.[embedded]'

install-dev: $(BIN)/activate
	$(PY) -m pip install --quiet -e '.[dev]'

# Debian packages the tests need (a real redis-server). Skipped when present.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi; }

demo: install
	$(BIN)/kvc demo

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck:
	$(BIN)/mypy

pytest:
	$(BIN)/pytest

test: install-dev system-deps lint typecheck pytest

# Regenerate the gRPC stubs from proto/ (a test fails when they are stale).
proto: install-dev
	$(PY) -m kvc.protogen

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
