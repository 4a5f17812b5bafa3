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

# Every benchmark at small sizes, a few minutes on 2 cores; results (JSON, PNG) under $(BENCH_OUT).
# Larger runs by flag, e.g. `make bench SCALING="--sizes 1G,4G,16G"` (docs/performance.md has each
# benchmark's full-size command). assets.py is left out: its cold torch.compile alone takes minutes.
BENCH_OUT ?= build/bench
SCALING ?= --sizes 64M,256M,1G
bench: deps
	mkdir -p $(BENCH_OUT)
	$(PY) benchmarks/pack.py --size 256MiB --repeat 1 --dir /tmp/modelpack-bench-small
	$(PY) benchmarks/transfer.py --size 256M --rounds 1
	$(PY) benchmarks/s3_transfer.py --size 128MiB --reps 1
	$(PY) benchmarks/cache_hit.py --sizes 64 --repeat 20 --process-repeat 5
	$(PY) benchmarks/load.py --size 256MiB --repeat 2 --dir /tmp/modelpack-bench-load-small --clean
	$(PY) benchmarks/scaling.py $(SCALING) --json-out $(BENCH_OUT)/scaling.json --png $(BENCH_OUT)/scaling.png
	$(PY) benchmarks/gpu_load.py --device cpu --size 64MiB --workers 2 --json-out $(BENCH_OUT)/gpu_load.json

clean:
	rm -rf build examples/generated .pytest_cache .mypy_cache .ruff_cache
