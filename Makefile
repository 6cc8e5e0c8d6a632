# Set-up is part of each target: on a fresh machine `make serve` and `make test` do everything.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check

.PHONY: serve test lint tools train export evaluate bench

serve: $(VENV)/.installed
	$(BIN)/qkv serve

test: $(VENV)/.dev tools
	tests/deploy/docker_engine.sh $(BIN)/python -m pytest

lint: $(VENV)/.dev
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy service export

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[plot]'
	touch $@

$(VENV)/.dev: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	touch $@ $(VENV)/.installed

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
