# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create .venv in the checkout and install into it; nothing is installed system-wide except
# PostgreSQL for the catalog tests (Debian package, installed by scripts/postgres.sh when absent).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ckptflow-installed
# torch first, pinned: an open-ended `torch` requirement would pull the multi-GB CUDA build.
# On a machine without CUDA, point pip at a CPU wheel (on these machines `torch==2.13.0` resolves
# to the local CPU wheel); set TORCH_SPEC to override.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint bench clean-scratch

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py $(if $(KEEP_UP),--keep-up,)

test: $(STAMP)
	bash scripts/run_tests.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) bench/stall.py

clean-scratch:
	rm -rf .scratch
