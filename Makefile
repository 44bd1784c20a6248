# The project's commands: `make demo` and `make test` for a user; `make test-fast` after each change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup system-deps demo test test-fast test-smoke bench clean

setup: $(STAMP) system-deps

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.[test,peers,ray]'
	@# byte-compiled on every core (pip compiles on one: 78 s against 35 + 25 s here); a file
	@# that does not compile is left to the interpreter, as pip leaves it
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	@# matplotlib's font cache, built once here (fc-list): the fast tier starts no process
	MPLBACKEND=Agg $(BIN)/python -c 'import matplotlib.pyplot'
	touch $(STAMP)

# etcd (Debian's etcd-server) for the membership tests; installed when running as root.
system-deps:
	@command -v etcd >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; \
	  else echo "etcd is missing: install Debian's etcd-server (sudo apt-get install etcd-server)"; fi; }

# The demo trains on real text: the project's own docs, tokenized once (a BPE of 1024 ids
# trained on them) into runs/demo-data; TensorBoard event files go beside the report.
DEMO_TEXT := README.md $(wildcard docs/*.md)

demo: setup runs/demo-data/header.json
	run=runs/demo-$$(date +%Y%m%d-%H%M%S) && \
	$(BIN)/bamboo train --config examples/demo.yaml --out $$run --tensorboard $$run/tensorboard

runs/demo-data/header.json: $(DEMO_TEXT) | setup
	rm -rf runs/demo-data
	$(BIN)/bamboo data prepare $(DEMO_TEXT) --out runs/demo-data --tokenizer bpe:1024

# Two tests at a time (pytest-xdist): most process tests wait (for leases, detection
# deadlines, joins) far more than they compute, so a second one uses the idle core.
XDIST := -n 2 --dist worksteal

# Static checks before every tier: ruff (lint and import order) and mypy ([tool.ruff] and
# [tool.mypy] in pyproject.toml).
LINT := $(BIN)/ruff check --quiet src tests benchmarks examples && $(BIN)/mypy

test: setup
	$(LINT)
	$(BIN)/python -m pytest -q $(XDIST) --durations=15

# Unit, property and decision tests (tests/unit): no worker processes, under 2 minutes
# (after each change).
test-fast: $(STAMP)
	$(LINT)
	$(BIN)/python -m pytest -q --fast

# One end-to-end run per capability (kill, drain, join, checkpoint restore, re-route, agents,
# etcd, the demo's job): tests/conftest.py's SMOKE, under 5 minutes.
test-smoke: setup
	$(BIN)/python -m pytest -q $(XDIST) -m smoke --durations=10 tests/integration

bench: setup
	$(BIN)/python benchmarks/engine_vs_torch.py

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info src/*.egg-info
