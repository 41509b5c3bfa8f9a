# nanolab's two commands: `make lab` and `make test`. Everything else is set up on the way.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned so a fresh machine takes the CPU build rather than the default CUDA wheels.
TORCH := torch==2.13.0
STAMP := $(VENV)/.nanolab-installed
LINT_DIRS := $(wildcard nanolab tests bench scripts autograder labkit)
BUILD_INPUTS := pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/CMakeLists.txt)
# The editable install maps each module to its file when it is installed, so a module added, moved or
# removed needs a reinstall: the list of modules is kept in a file that changes only when the list does.
MODULES := $(sort $(shell find nanolab autograder labkit -name '*.py' -not -path '*/tests/*' 2>/dev/null))
MODULE_LIST := $(VENV)/.nanolab-modules

.PHONY: setup clients lab test lint bench labs solutions check-notebooks mutants clean FORCE

$(MODULE_LIST): FORCE
	@mkdir -p $(VENV)
	@echo "$(MODULES)" | cmp -s - $@ || echo "$(MODULES)" > $@

$(STAMP): $(BUILD_INPUTS) $(MODULE_LIST)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -c "import nanolab, nanolab._C; print('nanolab', nanolab.__version__, 'installed with its C++ kernel')"
	@touch $(STAMP)

## setup: create .venv and install nanolab editable (C++ kernel built) with the dev tools
setup: $(STAMP)

# The clients users already run against `nanolab serve` (lm-evaluation-harness, guidellm) live in an
# environment of their own: their dependencies are not nanolab's. uv installs them with torch under the same pin
# as above, looking where pip is configured to look for wheels first (PIP_FIND_LINKS, pip's find-links), as pip
# does for .venv: that is where the pinned CPU build is found.
CLIENTS_VENV := .venv-clients
CLIENTS := "lm-eval[api]==0.4.13" "guidellm==0.8.1"
CLIENTS_STAMP := $(CLIENTS_VENV)/.clients-installed
CLIENTS_PINS := $(CLIENTS_VENV)/.clients-pins
FIND_LINKS = $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

$(CLIENTS_PINS): FORCE
	@mkdir -p $(CLIENTS_VENV)
	@echo '$(TORCH) $(CLIENTS)' | cmp -s - $@ || echo '$(TORCH) $(CLIENTS)' > $@

$(CLIENTS_STAMP): $(CLIENTS_PINS)
	@test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet uv
	$(CLIENTS_VENV)/bin/uv pip install --quiet --python $(CLIENTS_VENV)/bin/python \
		$(addprefix --find-links ,$(FIND_LINKS)) "$(TORCH)" $(CLIENTS)
	$(CLIENTS_VENV)/bin/python -c "import lm_eval, guidellm, torch; print('clients installed: lm-eval', lm_eval.__version__, '· torch', torch.__version__)"
	@touch $(CLIENTS_STAMP)

## clients: set up, and install lm-evaluation-harness and guidellm in .venv-clients (for tests/serving/test_clients.py)
clients: setup $(CLIENTS_STAMP)

# Extra JupyterLab options, e.g. `make lab LAB_ARGS="--no-browser --port 8890"`. As root (containers),
# JupyterLab refuses to start without --allow-root, so it is added there.
LAB_ARGS ?=
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)
# The learner's working copy: each lab notebook is copied here once and never overwritten (git ignores it).
WORK ?= work
# JupyterLab runs with the venv's bin first on PATH, so its terminals and kernels find `nanolab`; its
# terminals run the user's shell as it is, not as a login shell, whose /etc/profile would reset PATH.
# It is started from inside the folder it opens (WORK, or the repository for INSTRUCTOR=1): a terminal
# starts in the server's own working directory (terminado_settings has no `cwd` that jupyter-server
# reads), so that is where `nanolab grade lab01_tokenizer.ipynb`, as the notebooks give it, finds the lab.
# The learner's JupyterLab also reads jupyter/ (no nbgrader menus, buttons or server extensions, no news
# popup); INSTRUCTOR=1 leaves that out and opens the whole repository, nbgrader's tools included.
INSTRUCTOR ?=
LAB_ENV := PATH="$(abspath $(VENV))/bin:$$PATH"
TERMINAL_ARGS := --ServerApp.terminado_settings=shell_command="$${SHELL:-sh}"
LEARNER_ENV := JUPYTER_CONFIG_PATH="$(abspath jupyter)$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}"

## lab: set up, copy new labs into work/ (never overwriting), then open work/ in JupyterLab
lab: setup
ifeq ($(INSTRUCTOR),)
	$(PY) scripts/working_copy.py "$(WORK)"
	CDPATH= cd -- "$(WORK)" && $(LAB_ENV) $(LEARNER_ENV) "$(abspath $(VENV))/bin/jupyter" lab $(ROOT_ARGS) $(TERMINAL_ARGS) $(LAB_ARGS) .
else
	$(LAB_ENV) $(VENV)/bin/jupyter lab $(ROOT_ARGS) $(TERMINAL_ARGS) $(LAB_ARGS) .
endif

## test: set up, then run the whole test suite
test: setup
	$(PY) -m pytest

## lint: ruff over the package, tests, benchmarks and scripts
lint: setup
	$(VENV)/bin/ruff check $(LINT_DIRS)
	$(VENV)/bin/ruff format --check $(LINT_DIRS)

## labs: regenerate labs/ from solutions/ (solutions and outputs cleared, cells locked; deterministic)
labs: setup
	$(PY) scripts/make_labs.py

## solutions: run every solution notebook top to bottom on a Jupyter kernel (fails on any error)
solutions: setup
	$(PY) scripts/run_solutions.py

## check-notebooks: fail if labs/ is out of date with solutions/ or a notebook in git carries outputs
check-notebooks: setup
	$(PY) scripts/check_notebooks.py

# The lab whose tests `make mutants` measures, and extra options for scripts/mutants.py
# (e.g. MUTANTS_ARGS="--jobs 1 --json build/mutants/lab01.json").
LAB ?= 1
MUTANTS_ARGS ?=

## mutants: measure a lab's tests: how many of its planted learner bugs the hidden tests and the visible checks catch
mutants: setup
	$(PY) scripts/mutants.py --lab $(LAB) $(MUTANTS_ARGS)

## bench: run every benchmark in bench/ (prints ratios against baselines measured in the same run)
bench: setup
	@set -e; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b; done

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) build
