# The two commands of the README. Each sets up what it needs first.
#   make serve   # virtualenv + kvd, then `kvd serve` on the embedded defaults
#   make test    # virtualenv + kvd[dev], then the whole test suite and checks
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
ARGS ?=

.PHONY: serve test setup setup-dev setup-vllm clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

# vLLM (CPU build) for the connector's end-to-end tests, apart from the main venv.
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
# on CPU torch; text models need none of them.
# --no-compile: byte-compiling 3 GB of packages up front doubles the install time;
# the engines compile what they import. pip's output goes to a log (tail on failure).
$(VLLM_VENV)/.installed: tests/vllm/requirements.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --no-compile -r tests/vllm/requirements.txt \
	  > $(VLLM_VENV)/pip.log 2>&1 || (tail -30 $(VLLM_VENV)/pip.log; exit 1)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev
setup-vllm: $(VLLM_VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/kvd serve $(ARGS)

test: $(VENV)/.installed-dev $(VLLM_VENV)/.installed
	bash tools/install_test_stores.sh
	KVD_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(VENV)/bin/python -m pytest -q
	bash tools/check_kernels.sh
	bash tools/check_service.sh $(VENV)
	bash tools/check_install.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
