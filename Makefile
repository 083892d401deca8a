# Every target bootstraps a project-local .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# PyTorch: with an NVIDIA driver (nvidia-smi on PATH) the default CUDA build from PyPI. Without one, the CPU
# build from PyTorch's CPU wheel index (`--index-url https://download.pytorch.org/whl/cpu`, the official way;
# PyPI's Linux torch is the multi-GB CUDA build), when that index answers within 5 s; when it does not (a
# machine that reaches only PyPI), torch==2.13.0 from PyPI or a local CPU wheel that pip's own configuration
# finds (find-links). The probe runs only when the venv is (re)installed.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
HAS_NVIDIA      := $(shell command -v nvidia-smi 2>/dev/null)
TORCH_SPEC      ?= $(if $(HAS_NVIDIA),torch,torch==2.13.0)
TORCH_INDEX     ?= $(if $(HAS_NVIDIA),,$(shell $(PYTHON) -c "import urllib.request as r; \
                   r.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1 && echo --index-url $(TORCH_CPU_INDEX)))

.PHONY: install test test-fast bench gpu-check demo lint format clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) -m bench.all

gpu-check: install   # one GPU: 7 stages, each its own command of <= 4 min, 480 s planned in all (docs/gpu.md)
	$(PY) -m bench.gpu_check

demo: install
	./launch.sh

lint: install   # the formatter's layout (line length 120, pyproject.toml) and the linter's rules
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: install   # apply what `make lint` checks
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf runs .pytest_cache .ruff_cache
