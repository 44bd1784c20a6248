# The project's commands. `make demo` and `make test` are the two a user needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/bamboo train --nodes 4 --stages 4 --steps 50 --out runs/demo-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/engine_vs_torch.py

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
