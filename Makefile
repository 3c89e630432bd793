# The two commands of the README. Each sets up what it needs first.
#   make serve   # virtualenv + kvd, then `kvd serve` on the embedded defaults
#   make test    # virtualenv + kvd[dev], then the whole test suite and checks
PYTHON ?= python3
VENV ?= .venv
ARGS ?=

.PHONY: serve test setup setup-dev clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(VENV)/bin/kvd serve $(ARGS)

test: $(VENV)/.installed-dev
	bash tools/install_test_stores.sh
	$(VENV)/bin/python -m pytest -q
	bash tools/check_kernels.sh
	bash tools/check_service.sh $(VENV)
	bash tools/check_install.sh

clean:
	rm -rf $(VENV) build *.egg-info
