# One entry point for people and CI: `make demo`, `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo lint typecheck unit test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' --config-settings editable_mode=strict
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/onceonly demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest

# The whole suite, exactly as CI runs it: lint, type check, tests (SQLite + PostgreSQL).
test: lint typecheck unit

bench: install
	$(PY) -m pip install -q --disable-pip-version-check -e '.[bench]' --config-settings editable_mode=strict
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache reports
