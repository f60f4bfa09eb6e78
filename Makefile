# latent_rl — `make demo` runs the whole pipeline on a tiny CPU model, `make test` runs every test.
# Both create .venv and install what they need.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is chosen deliberately: the CPU build on a machine without an NVIDIA GPU
# (2.13.0 lies on disk here), the default CUDA wheel where `nvidia-smi` exists.
# Override with `make TORCH_SPEC='torch==X.Y.Z' ...`.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
FROM_SCRATCH ?= 0
DEMO_ARGS ?=

.PHONY: venv demo test export check-export check-clean check-readme readme nbtest pytest bench clean-venv

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

venv: $(VENV)/.installed

demo: venv
	$(BIN)/latent-rl demo $(if $(filter 1,$(FROM_SCRATCH)),--from-scratch,) $(DEMO_ARGS)

export: venv
	$(BIN)/nbdev-export

# The library must be in step with the notebooks: exporting changes nothing.
check-export: venv
	@before=$$(git status --porcelain --untracked-files=all -- latent_rl; git diff -- latent_rl); \
	$(BIN)/nbdev-export; \
	after=$$(git status --porcelain --untracked-files=all -- latent_rl; git diff -- latent_rl); \
	if [ "$$before" != "$$after" ]; then echo "nbdev-export changed latent_rl/: the package was out of step with nbs/ (now re-exported; commit it)"; git status --short -- latent_rl; exit 1; fi; \
	echo "nbdev-export: latent_rl/ in step with nbs/"

# Notebooks are committed clean: cleaning changes nothing.
check-clean: venv
	@before=$$(git status --porcelain --untracked-files=all -- nbs; git diff -- nbs); \
	$(BIN)/nbdev-clean; \
	after=$$(git status --porcelain --untracked-files=all -- nbs; git diff -- nbs); \
	if [ "$$before" != "$$after" ]; then echo "nbdev-clean changed nbs/: notebooks were not clean (now cleaned; commit them)"; git status --short -- nbs; exit 1; fi; \
	echo "nbdev-clean: nbs/ clean"

nbtest: venv
	$(BIN)/nbdev-test --n-workers 2 --timing

pytest: venv
	$(BIN)/python -m pytest tests -q -ra

readme: venv
	$(BIN)/python .ci/readme.py

check-readme: venv
	$(BIN)/python .ci/readme.py --check

test: check-export check-clean check-readme nbtest pytest

bench: venv
	$(BIN)/python -m latent_rl.bench all

clean-venv:
	rm -rf $(VENV)
