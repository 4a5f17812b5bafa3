# The two front-door commands: `make demo` and `make test`. Both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: deps demo test lint fmt bench clean

deps:
	@bash .ci/bootstrap.sh

demo: deps
	$(PY) examples/demo.py

test: deps
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: deps
	$(VENV)/bin/ruff check modelpack mediatypes signing mount loader tests benchmarks examples
	$(VENV)/bin/ruff format --check modelpack mediatypes signing mount loader tests benchmarks examples
	@bash .ci/typecheck-tree.sh
	cd build/typecheck && MYPYPATH=. ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p modelpack

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
