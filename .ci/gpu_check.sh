#!/usr/bin/env bash
# `make gpu-check`: the GPU and vLLM checks (tests/test_gpu.py, marked cuda) as one script, a few minutes on one H200.
# Prints one PASS / FAIL / SKIP line per check and exits non-zero if any failed. Needs a CUDA GPU; the vLLM checks need
# the extra (pip install -e '.[vllm]': vLLM 0.33 wants torch 2.14) and skip, saying so, without it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LOG=${OUT:-/tmp}/gpu-check.log
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
"$PY" - <<'PYEOF'
import importlib.util, torch
v = importlib.util.find_spec("vllm")
print(f"gpu-check: torch {torch.__version__}, cuda {torch.cuda.is_available()} "
      f"({torch.cuda.device_count()} device(s){', ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}), "
      f"vllm {__import__('vllm').__version__ if v else 'NOT INSTALLED'}")
PYEOF
timeout 1500 "$PY" -m pytest tests/test_gpu.py -rA -s -p no:cacheprovider >"$LOG" 2>&1; rc=$?
grep -E "^(vLLM|sleep|one GPU)" "$LOG"
grep -E "^(PASSED|FAILED|SKIPPED|ERROR) " "$LOG" | sed -E 's/^PASSED/PASS/; s/^FAILED/FAIL/; s/^SKIPPED \[[0-9]+\]/SKIP/; s/^ERROR/FAIL/'
tail -1 "$LOG"
[ $rc -eq 0 ] && echo "gpu-check: PASS" || { echo "gpu-check: FAIL (exit $rc; full log $LOG)"; exit 1; }
