# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# Both create the virtual environment (.venv) from pyproject.toml + constraints.txt when it is missing.
PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= test,notebooks
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.glmvit-installed
PYTEST_NB := --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider

.PHONY: demo test test-gpu lab explorer env browser

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

env: $(STAMP)

## The main job: encode the sample images and clip (tiny config on CPU, full GLM-4.1V in bf16 on CUDA).
demo: $(STAMP)
	$(BIN)/python -m glmvit demo

## Every test, the notebooks included (nbval). Installs Debian's chromium for the browser test when it can.
test: $(STAMP) browser
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15 $(PYTEST_NB) tests notebooks

## On a CUDA machine: the GPU tests and the notebooks' gpu cells.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m "gpu or multigpu" tests
	$(BIN)/python -m pytest $(PYTEST_NB) notebooks

## The walkthrough in JupyterLab.
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/

## The budget explorer as a standalone page (Voilà).
explorer: $(STAMP)
	$(BIN)/voila notebooks/explorer.ipynb

browser:
	@command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || \
	  { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	    || echo "chromium could not be installed: the browser test will be skipped"; }
