# Two commands set everything up: `make demo` and `make test`. Both create .venv
# when it is missing and install the project into it (~3.3 GB; pip keeps no cache of it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean lab browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-cache-dir --upgrade pip
	$(BIN)/python -m pip install --quiet --no-cache-dir -c constraints.txt -e '.[test,notebook,ray]' \
	  || { echo "pip install failed. The venv takes ~3.3 GB (torch, triton, ray); free space here:" >&2; \
	       df -h . >&2; exit 1; }
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/wcviz demo

test: $(STAMP) browser
	$(BIN)/python -m pytest -q

# JupyterLab on notebooks/ with this venv's kernel, on 127.0.0.1 only; it prints the URL with its token.
lab: $(STAMP)
	@echo "JupyterLab on notebooks/: open the http://127.0.0.1:...?token=... URL printed below; Ctrl-C stops it"
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.open_browser=False \
	  --ServerApp.root_dir=notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)

# Headless Chromium for tests/test_browser.py: Debian's chromium + chromium-driver (Playwright drives
# /usr/bin/chromium and never downloads a browser). apt-get runs only when it is missing, as root or
# through sudo -n. If it cannot be installed, make goes on and the browser test skips, naming what
# failed (from $(BROWSER_LOG)).
CHROMIUM := /usr/bin/chromium
BROWSER_LOG := $(VENV)/chromium-install.log
browser:
	@if [ -x $(CHROMIUM) ]; then rm -f $(BROWSER_LOG); exit 0; fi; \
	mkdir -p $(VENV); \
	if [ "$$(id -u)" = 0 ]; then sudo=; \
	elif command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; \
	else echo "cannot install chromium: not root and no sudo" | tee $(BROWSER_LOG); exit 0; fi; \
	echo "installing chromium chromium-driver with apt-get (for tests/test_browser.py) ..."; \
	if $$sudo env DEBIAN_FRONTEND=noninteractive sh -c 'apt-get update -q && apt-get install -y -q chromium chromium-driver' \
	    >$(BROWSER_LOG) 2>&1 && [ -x $(CHROMIUM) ]; then \
	  echo "installed $$($(CHROMIUM) --version)"; rm -f $(BROWSER_LOG); \
	else echo "could not install chromium (see $(BROWSER_LOG)); tests/test_browser.py will skip"; fi

# The CPU benchmarks; on a machine with a CUDA GPU, also `$(BIN)/python benchmarks/gpu.py` (BENCHMARKS.md).
bench: $(STAMP)
	$(BIN)/python benchmarks/cpu_digest.py --repeat 5
	$(BIN)/python benchmarks/mix_cost.py
	$(BIN)/python benchmarks/ports.py
	$(BIN)/python benchmarks/fold_parts.py
	$(BIN)/python benchmarks/refit.py --repeat 3
	$(BIN)/python benchmarks/fanout.py --repeat 3
	$(BIN)/python benchmarks/fanout_client.py
	$(BIN)/python benchmarks/frame.py
	$(BIN)/python benchmarks/engine_digests.py
	$(BIN)/python benchmarks/checkpoint.py --mib 512
	@if $(BIN)/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
	  $(BIN)/python benchmarks/gpu.py --gib 1; else echo "no CUDA GPU here: benchmarks/gpu.py not run"; fi

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks build *.egg-info
