# Every target bootstraps a project-local .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# On a CPU machine pin the CPU build that lies on disk (any other torch pulls a multi-GB CUDA build);
# with an NVIDIA driver present take the CUDA build.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: install test test-fast bench gpu-check demo lint clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
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

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache .ruff_cache
