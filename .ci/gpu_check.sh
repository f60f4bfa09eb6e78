#!/usr/bin/env bash
# `make gpu-check` (on a machine with a CUDA GPU) and `make gpu-check-cpu` (its rehearsal on the CPU): .ci/gpu_check.py,
# whose docstring says what each step checks, with the interpreter that has the project's torch: .venv's where there is
# one, else python3 (PY=... picks another). Arguments pass through: --device, --scale, --only, --budget, --out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
exec "$PY" .ci/gpu_check.py "$@"
