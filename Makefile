# The two commands of the README:
#   make reproduce   set up (if needed) and run the main job
#   make test        set up (if needed) and run the tests
# Setup is idempotent: it reinstalls only when pyproject.toml or the constraints change.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints-cpu.txt
STAMP := $(VENV)/.lrmoe-installed
MODE ?= quick

.PHONY: setup lint test test-all reproduce figures clean-venv

# Python keeps the bytecode it compiles (its default; some machines switch that off with PYTHONDONTWRITEBYTECODE).
# The tests and the main job start dozens of Python processes: without the cache each one compiles pandas,
# matplotlib and seaborn again (3-4 s a process on 2 cores).
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (torch CPU build pinned by $(CONSTRAINTS))"
	@# pip installs the installer uv; uv installs torch (from where pip's own settings find it: its find-links, when
	@# set, hold the CPU build that the constraints pin), then the rest in parallel, keeping that torch. The import
	@# check compiles what every process imports; the rest is compiled by its first user.
	@$(PY) -m pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) uv 2>&1 \
	    | grep -v "is ignored: it is neither a file nor a directory" || true
	@links="$${PIP_FIND_LINKS:-$$($(PY) -m pip config get global.find-links 2>/dev/null)}"; \
	    $(VENV)/bin/uv pip install --quiet --python $(PY) $${links:+--find-links "$$links"} \
	        -c $(CONSTRAINTS) torch
	@$(VENV)/bin/uv pip install --quiet --python $(PY) -c $(CONSTRAINTS) -e '.[dev,hf]'
	@$(PY) -c "import lrmoe, lrmoe.kernels, torch, torch._dynamo, triton"
	@touch $(STAMP)

# ruff (pyproject [tool.ruff]), then the import-layer contracts (pyproject [tool.importlinter]). import-linter reads
# the import graph from the file tree, where kernels/, experiments/ and paper_figures/ sit outside lrmoe/; it runs on
# a copy of the installed layout so that lrmoe.kernels, lrmoe.experiments and lrmoe.paper_figures are checked too.
LINT_TREE := build/lint-imports
lint: setup
	$(VENV)/bin/ruff check .
	@rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)
	@cp -R lrmoe $(LINT_TREE)/lrmoe
	@cp -R kernels $(LINT_TREE)/lrmoe/kernels
	@cp -R experiments $(LINT_TREE)/lrmoe/experiments
	@cp -R paper_figures $(LINT_TREE)/lrmoe/paper_figures
	cd $(LINT_TREE) && $(abspath $(VENV))/bin/lint-imports --no-logo --no-cache --config $(CURDIR)/pyproject.toml
	cd $(LINT_TREE) && $(abspath $(VENV))/bin/lint-imports --no-logo --no-cache --config $(CURDIR)/importlinter-installed.toml

# two workers (pytest-xdist): one per core of the 2-core machine this is sized for
test: lint
	$(PY) -m pytest -q -n 2

# also the tests marked slow (large shapes, long runs)
test-all: lint
	$(PY) -m pytest -q -m ""

reproduce: setup
	$(PY) experiments/reproduce.py --mode $(MODE)

figures: setup
	$(PY) paper_figures/make_all.py

clean-venv:
	rm -rf $(VENV)
