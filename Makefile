# The two commands of the README:
#   make reproduce   set up (if needed) and run the main job
#   make test        set up (if needed) and run the tests
#   make test-browser  the explorer notebook driven in a real browser (CI runs it after `make test`)
# Setup is idempotent: it reinstalls only when pyproject.toml or the constraints change, or when the .venv runs
# another checkout's lrmoe (a .venv copied from elsewhere).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints-cpu.txt
STAMP := $(VENV)/.lrmoe-installed
MODE ?= quick

.PHONY: setup links lint import-graph test test-numerics test-all test-core browser test-browser reproduce figures clean-venv

# Python keeps the bytecode it compiles (its default; some machines switch that off with PYTHONDONTWRITEBYTECODE).
# The tests and the main job start dozens of Python processes: without the cache each one compiles pandas,
# matplotlib and seaborn again (3-4 s a process on 2 cores).
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP) links

# The strict editable install links each file: a module added or removed since needs the links made again (1-2 s,
# only when the list of the package's files has changed).
LINKED := $(VENV)/.lrmoe-linked-files
links: $(STAMP)
	@git ls-files -co --exclude-standard -- lrmoe kernels experiments paper_figures | grep '\.py$$' > $(LINKED).new
	@cmp -s $(LINKED).new $(LINKED) || { $(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps \
	    -C editable_mode=strict -e . && mv $(LINKED).new $(LINKED); }
	@rm -f $(LINKED).new

# A .venv copied from another checkout would keep importing that checkout's files (its editable install links to
# them): when the installed lrmoe is not this checkout's, the stamp goes and setup installs this checkout again.
ifneq ($(wildcard $(STAMP)),)
INSTALLED := $(shell $(PY) -c "import importlib.util as u, os; print(os.path.realpath(u.find_spec('lrmoe').origin))" 2>/dev/null)
ifneq ($(INSTALLED),$(realpath $(CURDIR))/lrmoe/__init__.py)
$(info $(VENV) runs lrmoe from $(or $(INSTALLED),nowhere), not from this checkout ($(realpath $(CURDIR))): reinstalling)
$(shell rm -f $(STAMP) $(LINKED))
endif
endif

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
	@# strict editable mode: a tree of links to the checkout's files, with kernels/, experiments/ and paper_figures/
	@# inside lrmoe/ as they import, which import-linter, type checkers and IDEs read in place
	@$(VENV)/bin/uv pip install --quiet --python $(PY) -c $(CONSTRAINTS) -C editable_mode=strict -e '.[dev,hf]'
	@$(PY) -c "import lrmoe, lrmoe.kernels, torch, torch._dynamo, triton"
	@touch $(STAMP)

# ruff (pyproject [tool.ruff]), then the import contracts (pyproject [tool.importlinter]) on the checkout itself:
# lrmoe/kernels, lrmoe/experiments and lrmoe/paper_figures are links to the top-level folders, so the tree shows the
# package as it imports and `lint-imports` reads it in place from the repository root.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo --no-cache

# lrmoe's modules by package, the import edges between packages, and any edge against the contracts of pyproject
# (lrmoe/harness/import_graph.py; grimp, the graph import-linter reads); fails if an edge runs against them
import-graph: setup
	$(PY) lrmoe/harness/import_graph.py

# two workers (pytest-xdist): one per core of the 2-core machine this is sized for
test: lint
	$(PY) -m pytest -q -n 2 --durations=15

# The numerics-sensitive tests (tolerances against references: the drop-in, bf16 autocast, the layer, the kernels)
# again under other vector units than this CPU's: ATEN's baseline kernels (`default`) and AVX2. Their tolerances come
# from the arithmetic, so they hold on any CPU (CI runs this after `make test`).
NUMERICS_TESTS := tests/test_hf_amp.py tests/test_hf.py tests/test_reference.py tests/test_layer.py \
	tests/test_grouped_gemm.py tests/test_compact.py tests/test_gradient_error.py tests/test_clip.py \
	tests/test_layer_lrmoe.py tests/test_layer_symi.py
test-numerics: setup
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -n 2 $(NUMERICS_TESTS)
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -n 2 $(NUMERICS_TESTS)

# also the tests marked slow (large shapes, long runs)
test-all: lint
	$(PY) -m pytest -q -m ""

# The browser test's tools: Playwright (the pyproject extra "browser", pinned by the constraints) and a Chromium.
# Where none is on PATH, Debian's is installed when this runs as root with apt-get; anywhere else, or when that
# install fails, the test skips and says why. Playwright never downloads a browser of its own.
BROWSER_STAMP := $(VENV)/.lrmoe-browser-installed
browser: setup $(BROWSER_STAMP)
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	    { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	      { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; } || \
	    echo "no Chromium installed: the browser test will skip"

$(BROWSER_STAMP): $(STAMP)
	$(VENV)/bin/uv pip install --quiet --python $(PY) -c $(CONSTRAINTS) -C editable_mode=strict -e '.[dev,hf,browser]'
	@touch $@

# JupyterLab and Chromium on this machine, a few minutes: apart from `make test`, which stays quick
test-browser: browser
	$(PY) -m pytest -q -n 0 -m browser

# The core install alone (torch, numpy, triton; the `hf` extra for transformers, and pytest), without the
# experiments' and notebooks' extras (W&B, pandas, scipy, seaborn, Jupyter): the drop-in's exactness tests run on it.
CORE_VENV ?= .venv-core
test-core:
	@test -x $(CORE_VENV)/bin/python || $(PYTHON) -m venv $(CORE_VENV)
	@$(CORE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) uv
	@links="$${PIP_FIND_LINKS:-$$($(CORE_VENV)/bin/python -m pip config get global.find-links 2>/dev/null)}"; \
	    $(CORE_VENV)/bin/uv pip install --quiet --python $(CORE_VENV)/bin/python $${links:+--find-links "$$links"} \
	        -c $(CONSTRAINTS) torch
	$(CORE_VENV)/bin/uv pip install --quiet --python $(CORE_VENV)/bin/python -c $(CONSTRAINTS) -e '.[hf]' pytest pytest-timeout
	$(CORE_VENV)/bin/python -c "import importlib.util as u, sys; extra = [m for m in ('wandb', 'pandas', 'scipy', 'seaborn', 'matplotlib') if u.find_spec(m)]; sys.exit(f'not a core install: {extra}' if extra else 0)"
	$(CORE_VENV)/bin/python -m pytest -q tests/test_hf.py

reproduce: setup
	$(PY) experiments/reproduce.py --mode $(MODE)

# every figure from results files alone: the main job's (outputs/$(MODE)) once it has run, else the committed final
# results (paper_figures/results); into outputs/figures, never over a committed figure
FIGURES_FROM ?= $(if $(wildcard outputs/$(MODE)/SUMMARY.md),outputs/$(MODE),paper_figures/results)
FIGURES_OUT ?= outputs/figures
figures: setup
	$(PY) paper_figures/make_all.py --results $(FIGURES_FROM) --out $(FIGURES_OUT)

clean-venv:
	rm -rf $(VENV)
