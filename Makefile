# The two front-door commands: `make demo` and `make test`. Both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: deps demo test lint fmt bench clean

deps:
	@bash .ci/bootstrap.sh

demo: deps
	$(PY) examples/demo.py

# The tests run after the lint: formatting, types and the layer contracts are part of the suite.
test: lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# ruff (lint + format), mypy, and import-linter's layer/cycle contracts (pyproject.toml).
# mypy and lint-imports read the installed shape of the namespace from build/typecheck.
lint: deps
	$(VENV)/bin/ruff check modelpack mediatypes signing mount loader tests benchmarks examples
	$(VENV)/bin/ruff format --check modelpack mediatypes signing mount loader tests benchmarks examples
	@bash .ci/typecheck-tree.sh
	cd build/typecheck && MYPYPATH=. ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p modelpack
	cd build/typecheck && PYTHONPATH=. ../../$(VENV)/bin/lint-imports --no-cache --no-logo ../../pyproject.toml

fmt: deps
	$(VENV)/bin/ruff format modelpack mediatypes signing mount loader tests benchmarks examples
	$(VENV)/bin/ruff check --fix modelpack mediatypes signing mount loader tests benchmarks examples

bench: deps
	$(PY) benchmarks/pack.py
	$(PY) benchmarks/transfer.py
	$(PY) benchmarks/s3_transfer.py
	$(PY) benchmarks/cache_hit.py
	$(PY) benchmarks/load.py

clean:
	rm -rf build examples/generated .pytest_cache .mypy_cache .ruff_cache
