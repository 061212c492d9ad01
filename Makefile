# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A machine whose system Python already has a CUDA torch keeps it: the venv then sees system packages.
CUDA_TORCH := $(shell $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 && echo 1)
VENV_FLAGS := $(if $(CUDA_TORCH),--system-site-packages,)
PYTEST_ARGS ?=
# The suite runs in two pytest-xdist workers, a test file per worker at a time (module fixtures
# build once): its end-to-end runs wait on Ray, servers and checkpoints for part of their time, and
# the unit tests use one core, so two workers keep a 2-core machine busy. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
# OpenMP threads sleep while they wait instead of spinning: the suite's workers and a run's
# processes share the cores, and spinning threads take them from each other
# (tools/bench_omp_wait.py; the CLI sets the same default).
export OMP_WAIT_POLICY ?= PASSIVE
# Exact versions of everything the CPU path installs (README numbers were measured with it).
# `make lock` re-resolves from pyproject.toml in a scratch venv and rewrites it.
LOCK := requirements/cpu.lock
LOCK_FLAGS := $(if $(CUDA_TORCH),,-c $(LOCK))
# Installs go through uv (a pinned copy under .uv/, fetched by pip): it resolves, unpacks and links
# from its cache in less time than pip and byte-compiles on both cores. On a quiet 2-core machine it
# is as fast as pip (56 s against 47-59 s), under other work's load faster (64-237 s where pip took
# 234-988 s); byte-compiling is most of the time (docs/results.md, "Set-up: both venvs from the
# locks"). uv reads none of pip's configuration, so tools/uv_pip.py hands it pip's indexes, wheel
# folders and constraints: a machine whose pip points at a private index gets the same packages. A
# CUDA-torch machine stays on pip: uv does not count the system packages a --system-site-packages
# venv sees as installed (astral-sh/uv#4466) and would shadow the system torch. INSTALLER=pip: pip
# everywhere.
INSTALLER ?= $(if $(CUDA_TORCH),pip,uv)
UV_VERSION := 0.13.9
# one folder per version: a new pin fetches its uv instead of keeping an older one
UV_DIR := .uv/$(UV_VERSION)
UV := $(UV_DIR)/bin/uv
# uv leaves bytecode to the first import, and each of the suite's processes (pytest workers, Ray
# workers, Megatron ranks, the SGLang server) would compile again where PYTHONDONTWRITEBYTECODE keeps
# them from saving it (4-8 CPU-seconds more per process that imports torch or starts the server,
# docs/results.md): compiled at install, as pip does (uv compiles what each call installs).
UV_INSTALL := $(PY) tools/uv_pip.py $(UV) install --quiet --compile-bytecode
# $(call install,VENV): the install command for VENV; INSTALLER_DEP: what it needs first
install = $(if $(filter uv,$(INSTALLER)),$(UV_INSTALL) --python $(1)/bin/python,$(1)/bin/python -m pip install --quiet)
INSTALLER_DEP := $(if $(filter uv,$(INSTALLER)),$(UV),)

.PHONY: setup setup-sglang demo test lint lock lock-sglang clean

setup: $(STAMP)

# Free disk each venv needs, measured on a fresh clone (.venv 1.9 GB, .venv-sglang 2.4 GB) plus pip's
# unpacking room: checked first, so a full disk stops with one line instead of pip's OSError midway.
# uv unpacks each wheel once into its cache (2.7 GB for both venvs) and hard-links the venvs' files to
# it where the cache shares their disk (3.5 GB in all then), so the cache's disk is checked too.
VENV_MB := 2600
SG_VENV_MB := 3200
UV_CACHE_DISK := $${UV_CACHE_DIR:-$${XDG_CACHE_HOME:-$$HOME/.cache}}
need_disk = @test -x $(3)/bin/python || $(PY) tools/check_disk.py --need-mb $(1) --what "$(2)" . "$${TMPDIR:-/tmp}" $(if $(filter uv,$(INSTALLER)),"$(UV_CACHE_DISK)")

# The disk check comes first, before uv is fetched (uv is an order-only prerequisite of the stamps).
$(BIN)/python:
	$(call need_disk,$(VENV_MB),the CPU venv $(VENV),$(VENV))
	$(PY) -m venv $(VENV_FLAGS) $(VENV)

$(UV):
	$(PY) -m pip install --quiet --target $(UV_DIR) uv==$(UV_VERSION)

$(STAMP): $(BIN)/python pyproject.toml $(LOCK) | $(INSTALLER_DEP)
	$(call install,$(VENV)) --upgrade pip
	@if $(BIN)/python -c "import torch" >/dev/null 2>&1; then \
	  echo "torch present: $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	else \
	  echo "installing torch==2.13.0 (CPU build)"; $(call install,$(VENV)) $(LOCK_FLAGS) torch==2.13.0; \
	fi
	$(call install,$(VENV)) $(LOCK_FLAGS) -e ".[dev]"
	@touch $(STAMP)

# The real SGLang server for the tests, in its own venv: its declared pins (CUDA torch, flashinfer,
# the CUDA kernel package) clash with the project's, so sglang goes in with --no-deps next to CPU
# torch and the exact pure-Python packages its server imports (requirements/sglang-cpu.txt).
# The trainer talks to it over HTTP and a gloo group (rollout.sglang.python picks this venv).
SGLANG_VERSION := 0.5.23
SG_VENV := .venv-sglang
SG_STAMP := $(SG_VENV)/.installed
SG_LOCK := requirements/sglang-cpu.txt

setup-sglang: $(SG_STAMP)

$(SG_VENV)/bin/python:
	$(call need_disk,$(SG_VENV_MB),the SGLang test venv $(SG_VENV),$(SG_VENV))
	$(PY) -m venv $(SG_VENV)

$(SG_STAMP): $(SG_VENV)/bin/python $(SG_LOCK) | $(INSTALLER_DEP)
	$(call install,$(SG_VENV)) -r $(SG_LOCK)
	$(call install,$(SG_VENV)) --no-deps sglang==$(SGLANG_VERSION)
	@touch $(SG_STAMP)

demo: setup
	$(BIN)/megatron-dapo demo

# The two venvs install side by side (each install keeps a core busy); on a fresh clone the disk must
# hold both at once, so their sum is checked before either starts.
test:
	@if ! test -x $(BIN)/python && ! test -x $(SG_VENV)/bin/python; then \
	  $(PY) tools/check_disk.py --need-mb $$(( $(VENV_MB) + $(SG_VENV_MB) )) \
	    --what "installing .venv and .venv-sglang side by side" . "$${TMPDIR:-/tmp}" \
	    $(if $(filter uv,$(INSTALLER)),"$(UV_CACHE_DISK)"); fi
	$(MAKE) -j2 setup setup-sglang
	$(BIN)/python -m pytest -q -rs $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check megatron_dapo tests tools
	$(BIN)/ruff format --check megatron_dapo tests tools
	$(BIN)/python tools/check_imports.py

lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet torch==2.13.0 -e ".[dev]"
	{ echo "# CPU-path lock used by make setup (pip constraints). Refresh: make lock"; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | grep -v "^pip==" | sed "s/+cpu$$//"; } > $(LOCK)
	rm -rf .venv-lock

# Re-resolve the SGLang venv's packages (names in requirements/sglang-cpu.in) and rewrite its lock.
lock-sglang:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet -r requirements/sglang-cpu.in
	{ echo "# SGLang $(SGLANG_VERSION) CPU test server (.venv-sglang): exact versions of what its server imports, next to"; \
	  echo "# CPU torch. sglang itself goes in with --no-deps (Makefile). Refresh: make lock-sglang"; \
	  .venv-lock/bin/python -m pip freeze --all | grep -v "^pip==" | sed 's/+cpu$$//'; } > $(SG_LOCK)
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) $(SG_VENV) .uv .venv-lock .pytest_cache .ruff_cache
