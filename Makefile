# Two commands set everything up: `make demo` and `make test`. Both create .venv
# when it is missing and install the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/wcviz demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/cpu_digest.py --repeat 5
	$(BIN)/python benchmarks/refit.py --repeat 3

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks build *.egg-info
