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

.PHONY: setup test test-all reproduce figures clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (torch CPU build pinned by $(CONSTRAINTS))"
	@$(PY) -m pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) -e '.[dev]' 2>&1 \
	    | grep -v "is ignored: it is neither a file nor a directory" || true
	@$(PY) -c "import lrmoe, lrmoe.kernels, torch, triton" 
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q

# also the tests marked slow (large shapes, long runs)
test-all: setup
	$(PY) -m pytest -q -m ""

reproduce: setup
	$(PY) experiments/reproduce.py --mode $(MODE)

figures: setup
	$(PY) paper_figures/make_all.py

clean-venv:
	rm -rf $(VENV)
