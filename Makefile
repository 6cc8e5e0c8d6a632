# Set-up is part of each target: on a fresh machine `make serve` and `make test` do everything.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check
# What gets installed is a lock (requirements/*.txt: every distribution pinned, with its hashes), then the
# project itself with --no-deps. `make lock` writes the locks from pyproject.toml: docs/design.md, "Dependencies".
LOCKED := $(PIP) --require-hashes

.PHONY: serve test test-slow test-loaded lint tools train export evaluate bench lock triton-examples

serve: $(VENV)/.installed
	$(BIN)/qkv serve

# One pytest-xdist worker a core, a test file each (module fixtures start once); tests run in a random order
# (pytest-randomly: the seed is printed; `make test PYTEST_ARGS=--randomly-seed=N` repeats an order).
# `make test` leaves out the suites marked slow; `make test-slow` runs those alone.
PYTEST := $(BIN)/python -m pytest -n auto --dist loadfile --durations=15
test: $(VENV)/.dev tools
	tests/deploy/docker_engine.sh $(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-slow: $(VENV)/.dev tools
	tests/deploy/docker_engine.sh $(PYTEST) -m slow $(PYTEST_ARGS)

# The whole suite while stress-ng keeps every core busy: a test that depends on the machine's speed fails here.
test-loaded:
	tests/cpu_load.sh $(MAKE) test

# Triton's example clients (tests/triton_examples/clients) against qkv serving Triton's example repository,
# built from tests/triton_examples: passed / failed per client (docs/triton.md, "Triton's example programs").
triton-examples: $(VENV)/.dev
	$(BIN)/python -m tests.triton_examples.run

lint: $(VENV)/.dev
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy service export && $(BIN)/lint-imports --no-cache

# `make serve`: the server with the plot and client extras (tritonclient, grpcurl for the README's examples).
$(VENV)/.installed: pyproject.toml requirements/plot.txt requirements/client.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(LOCKED) -r requirements/plot.txt -r requirements/client.txt
	$(PIP) --no-deps -e .
	touch $@

$(VENV)/.dev: pyproject.toml requirements/dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(LOCKED) -r requirements/dev.txt
	$(PIP) --no-deps -e .
	touch $@ $(VENV)/.installed

# Every lock from pyproject.toml (and requirements/cuda.in), keeping the pinned versions that still fit;
# UPGRADE=1 moves every pin to the newest release allowed, UPGRADE_PACKAGE=numpy only that one.
# The dev lock is the superset; the others are resolved within it, so two locks never pin one
# distribution at two versions. The project itself is left out (--unsafe-package): it is installed apart.
COMPILE = $(BIN)/pip-compile -q --generate-hashes --strip-extras --unsafe-package qkv --no-emit-index-url \
  --no-emit-find-links $(if $(UPGRADE),--upgrade) $(if $(UPGRADE_PACKAGE),--upgrade-package $(UPGRADE_PACKAGE))
lock: $(VENV)/.dev
	$(COMPILE) --extra dev -o requirements/dev.txt pyproject.toml
	$(COMPILE) -c requirements/dev.txt -o requirements/serve.txt pyproject.toml
	for extra in plot trace export client graphs hf; do \
	  $(COMPILE) -c requirements/dev.txt --extra $$extra -o requirements/$$extra.txt pyproject.toml || exit 1; done
	$(COMPILE) -c requirements/dev.txt -o requirements/cuda.txt requirements/cuda.in

# From Debian, for the observability and deploy tests: Prometheus (promtool), and a Docker engine with
# docker-compose and debootstrap (the compose tests build offline stand-ins of the base images).
tools:
	@command -v promtool >/dev/null && command -v docker-compose >/dev/null && command -v dockerd >/dev/null \
	  && command -v debootstrap >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io docker-compose debootstrap; \
	  /etc/init.d/prometheus stop >/dev/null 2>&1 || true; }

# In the background, at idle CPU priority where chrt is available: it takes only cycles nothing else wants.
train: $(VENV)/.dev
	mkdir -p checkpoints
	nohup $$(command -v chrt >/dev/null && echo chrt --idle 0) $(BIN)/qkv train --resume $(TRAIN_ARGS) \
	  > checkpoints/train.log 2>&1 &

export: $(VENV)/.dev
	$(BIN)/qkv export checkpoints/g2p/best.pt

evaluate: $(VENV)/.dev
	$(BIN)/qkv evaluate --model-repository models
