# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`  (`make env`: the environment alone).
# Both create the virtual environment (.venv) from pyproject.toml + constraints.txt when it is missing.
#
# Knobs (all optional; README "Set-up" says when to use them):
#   VENV_FLAGS=--system-site-packages   let .venv see the machine's own packages (a preinstalled CUDA torch)
#   VENV=/path/to/env                   use an environment that exists (one with a CUDA torch): glmvit goes into it
#   CONSTRAINTS=                        install without constraints.txt's exact versions (keep what the machine has)
#   PIP_FLAGS=--no-index                extra pip flags (--no-index: install nothing from the network)
#   EXTRAS=                             install glmvit alone, without the test/notebook tools
#                                       (default: test,notebooks,video,serve, and cuda where nvidia-smi runs)
#   HOST=0.0.0.0 PORT=8899              where `make lab` / `make explorer` listen (default 127.0.0.1, 8888 / 8866)
PYTHON      ?= python3
VENV        ?= .venv
VENV_FLAGS  ?=
CONSTRAINTS ?= constraints.txt
PIP_FLAGS   ?=
# The `cuda` extra (cuDNN's attention frontend, nvmath-python's cuBLASLt) only where a GPU answers: nothing CUDA-only on a
# CPU machine.
comma       := ,
CUDA_EXTRA  := $(if $(shell nvidia-smi -L 2>/dev/null),$(comma)cuda)
EXTRAS      ?= test,notebooks,video,serve$(CUDA_EXTRA)
HOST        ?= 127.0.0.1
PORT        ?=
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.glmvit-installed
PIP_INSTALL := $(strip $(BIN)/python -m pip install --progress-bar on $(PIP_FLAGS) $(if $(CONSTRAINTS),-c $(CONSTRAINTS)))
PYTEST_NB   := --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider
# The oldest transformers pyproject.toml allows, read from it, and the venv `make test-oldest` puts it in.
TRANSFORMERS_OLDEST := $(shell sed -n 's/^ *"transformers *>= *\([0-9.]*\).*/\1/p' pyproject.toml)
OLDEST_VENV ?= $(VENV)/oldest

.PHONY: demo test lint notebooks test-gpu test-oldest lab explorer env browser

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(strip $(PYTHON) -m venv $(VENV_FLAGS) $(VENV))
	$(PIP_INSTALL) -e "$(if $(EXTRAS),.[$(EXTRAS)],.)"
	touch $(STAMP)

env: $(STAMP)

## The main job: encode the sample images and clip (tiny config on CPU, full GLM-4.1V in bf16 on CUDA).
demo: $(STAMP)
	$(BIN)/python -m glmvit demo

## Every test, the notebooks included (nbval). Installs Debian's chromium for the browser test when it can.
test: $(STAMP) browser lint
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15 $(PYTEST_NB) tests notebooks
	@echo "recorded GPU results measured on code that has changed since (a warning: only a GPU can re-record):"
	-@$(BIN)/python -m glmvit records --stale

## ruff and mypy, configured in pyproject.toml (make test runs them first).
lint: $(STAMP)
	$(BIN)/ruff check glmvit tests tools data conftest.py
	$(BIN)/mypy

## Execute every notebook in place and stamp its code hash (commit the outputs; a test keeps them fresh).
notebooks: $(STAMP)
	$(BIN)/python tools/execute_notebooks.py

## On a CUDA machine: the GPU tests and the notebooks' gpu cells.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m "gpu or multigpu" tests
	$(BIN)/python -m pytest $(PYTEST_NB) notebooks

## The lower end of the supported range: the processing tests under the oldest transformers pyproject.toml allows,
## in a venv of its own ($(OLDEST_VENV)); torch as constraints.txt pins it (or the machine's, with CONSTRAINTS=).
test-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(strip $(PYTHON) -m venv $(VENV_FLAGS) $(OLDEST_VENV))
	$(if $(CONSTRAINTS),grep -E '^torch==' $(CONSTRAINTS),true) > $(OLDEST_VENV)/torch-constraint.txt
	$(strip $(OLDEST_VENV)/bin/python -m pip install --progress-bar on $(PIP_FLAGS)) -c $(OLDEST_VENV)/torch-constraint.txt \
	    -e . "transformers==$(TRANSFORMERS_OLDEST)" "pytest>=8.0"
	$(OLDEST_VENV)/bin/python -c "import glmvit.processing, transformers; print('transformers', transformers.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -p no:cacheprovider tests/test_processing.py

## The walkthrough in JupyterLab (no browser is opened: open the printed URL; root is allowed, as in containers).
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/ --no-browser --allow-root --ip=$(HOST) --port=$(or $(PORT),8888)

## The budget explorer as a standalone page (Voilà), behind a token: open the URL it prints. Your own token:
## JUPYTER_TOKEN=... make explorer (16+ characters). Its file fields read and write only in this directory.
explorer: $(STAMP)
	$(BIN)/python -m glmvit.cli.explorer_serve notebooks/explorer.ipynb --no-browser --Voila.ip=$(HOST) \
	    --port=$(or $(PORT),8866)

browser:
	@command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || \
	  { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	    || echo "chromium could not be installed: the browser test will be skipped"; }
