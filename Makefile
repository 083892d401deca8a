# Every target bootstraps a project-local .venv when it is missing.
#
# Dependencies: requirements.lock holds the exact set the suite passed with (every package, pip and setuptools
# included; pyproject.toml keeps the ranges for installing into your own environment). `make install` builds .venv
# from it and nothing else (`pip install --no-deps`, then `pip check`); a changed lock rebuilds .venv from scratch,
# so a package the lock dropped does not linger. `make lock` resolves the newest releases, writes the lock and runs
# the suite; `make test-latest` runs the suite against the newest releases in .venv-latest, lock untouched.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
LOCK   := requirements.lock
LOCKED_TORCH := $(patsubst torch==%,%,$(filter torch==%,$(file <$(LOCK))))
# PyTorch, at the locked version: with an NVIDIA driver (nvidia-smi on PATH) the CUDA build from PyPI, with the
# CUDA libraries and the triton it pins (the lock's CPU-resolved triton is then left out). Without one, the CPU
# build from PyTorch's CPU wheel index (`--index-url https://download.pytorch.org/whl/cpu`, the official way;
# PyPI's Linux torch is the multi-GB CUDA build), when that index answers within 5 s; when it does not (a machine
# that reaches only PyPI), a local CPU wheel that pip's own configuration finds (find-links) or PyPI's. The probe
# runs only when the venv is (re)installed.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
HAS_NVIDIA      := $(shell command -v nvidia-smi 2>/dev/null)
TORCH_INDEX     ?= $(if $(HAS_NVIDIA),,$(shell $(PYTHON) -c "import urllib.request as r; \
                   r.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1 && echo --index-url $(TORCH_CPU_INDEX)))
# The newest torch for `make lock` / `make test-latest`: from the CPU index when it answers; without it PyPI's
# newest Linux torch is the multi-GB CUDA build, so the locked version is kept (and said).
TORCH_LATEST    ?= $(if $(TORCH_INDEX),torch,torch==$(LOCKED_TORCH))
NOT_FROM_LOCK   := $(if $(HAS_NVIDIA),'^(torch|triton)==','^torch==')

.PHONY: install lock test test-fast test-latest bench gpu-check device-bundle demo lint format clean

$(VENV)/.installed: pyproject.toml $(LOCK)
	@test -n "$(LOCKED_TORCH)" || { echo "make: $(LOCK) has no torch==VERSION line" >&2; exit 2; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$$(grep '^pip==' $(LOCK))"
	$(PY) -m pip install -q $(TORCH_INDEX) "torch==$(LOCKED_TORCH)"
	grep -vE $(NOT_FROM_LOCK) $(LOCK) >$(VENV)/lock-rest.txt
	$(PY) -m pip install -q --no-deps -r $(VENV)/lock-rest.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	@touch $@

install: $(VENV)/.installed

# resolve-latest DIR: a fresh venv in DIR with the newest releases pyproject.toml's ranges admit
define resolve-latest
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip setuptools
	@$(if $(TORCH_INDEX),,echo "make: the CPU wheel index does not answer: torch stays at the locked $(LOCKED_TORCH)")
	$(1)/bin/pip install -q $(TORCH_INDEX) "$(TORCH_LATEST)"
	$(1)/bin/pip install -q -e ".[dev]"
	$(1)/bin/pip check
endef

lock:   # refresh the lock from the newest releases, then rebuild .venv from it and run the suite
	$(call resolve-latest,.venv-lock)
	{ sed -n '1,/^# ---/p' $(LOCK); .venv-lock/bin/pip freeze --all --exclude-editable \
	  | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } >$(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf .venv-lock
	git --no-pager diff --stat -- $(LOCK) || true
	$(MAKE) test

test-latest:   # the suite against the newest releases (.venv-latest), the lock untouched: drift seen early
	$(call resolve-latest,.venv-latest)
	@.venv-latest/bin/pip freeze --all --exclude-editable | sed -E 's/^(torch==[^+]*)\+.*/\1/' >.venv-latest/freeze.txt
	@if grep -v '^#' $(LOCK) | diff -q - .venv-latest/freeze.txt >/dev/null; then \
	  echo "make: the newest releases are the locked ones"; else grep -v '^#' $(LOCK) | diff - .venv-latest/freeze.txt \
	  | grep '^[<>]' | sed 's/^</locked:/; s/^>/latest:/'; fi
	.venv-latest/bin/python -m pytest -q $(XDIST)

# pytest-xdist: one worker a core, a test file's tests on one worker (its module fixtures built once), the
# longest files first (tests/durations.json; tests/conftest.py orders them). `make test PYTEST_N=0` runs serially.
PYTEST_N ?= auto
XDIST := $(if $(filter 0,$(PYTEST_N)),,-n $(PYTEST_N) --dist loadfile --no-loadscope-reorder)

test: install
	$(PY) -m pytest -q $(XDIST)

test-fast: install   # the inner loop: the suite without the slow integration tests
	$(PY) -m pytest -q $(XDIST) -m "not slow"

bench: install
	$(PY) -m bench.all

# One GPU: 9 stages, each its own command of <= 4 min, 515 s planned (docs/gpu.md). On the GPU image (no network,
# no .venv) it runs the device bundle's script: the bundle's wheels installed offline, the image's python and torch.
BUNDLE := dist/device-bundle
gpu-check:
	@if [ ! -f $(VENV)/.installed ] && [ -f $(BUNDLE)/run-gpu-check.sh ]; then bash $(BUNDLE)/run-gpu-check.sh; \
	else $(MAKE) --no-print-directory install && $(PY) -m bench.gpu_check; fi

device-bundle: install   # wheels for the GPU image (CPython 3.12, offline): what gpu_check lacks there, <= 64 MiB
	$(PY) -m bench.device_bundle $(BUNDLE)

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
