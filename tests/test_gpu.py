"GPU-only checks: they skip cleanly on a machine without CUDA (and without vLLM for the vLLM test)."
import importlib.util, json
import pytest, torch
from conftest import run_cli, ROOT

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

def test_stages_bench_cpu_tiny(tmp_path):
    "The GPU benchmark's code path, on the CPU with the tiny architecture (what CI can run)."
    run_cli("stages", "--quick", "--preset", "tiny", "--json", tmp_path / "s.json", module="latent_rl.bench")
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert {r["stage"] for r in rows} >= {"sft", "codi", "grpo rollout (latent)", "grpo train (latent)"}
    assert all(r["step_s"] > 0 for r in rows)

def test_stages_bench_refuses_cuda_without_gpu():
    if torch.cuda.is_available(): pytest.skip("a GPU is present")
    p = run_cli("stages", "--device", "cuda", "--quick", module="latent_rl.bench", check=False)
    assert p.returncode != 0 and "no CUDA device" in p.stderr

@cuda
def test_stages_bench_real_size_on_gpu(tmp_path):
    run_cli("stages", "--device", "cuda", "--preset", "qwen2.5-coder-0.5b", "--quick", "--json", tmp_path / "g.json",
            module="latent_rl.bench", timeout=1200)
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert all(r["peak_mem_gb"] > 0 for r in rows)

@cuda
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'latent_rl[vllm]')")
def test_vllm_rollout_logprobs_match_training(tmp_path):
    "vLLM's processed logprobs of its own samples equal the HF training forward's (bf16 tolerance), after a weight sync."
    from latent_rl.policy import Policy, VLLMEngine
    from latent_rl.trace import prompt_text
    from latent_rl.tokens import encode
    from latent_rl.corpus import load_rows
    pol = Policy.load(ROOT / "data" / "teacher", device="cuda")
    eng = VLLMEngine(ROOT / "data" / "teacher", dtype="float32", gpu_memory_utilization=0.2)
    eng.sync(pol.lm)
    P = [encode(pol.tok, prompt_text(r["code"], r["input"])) for r in load_rows(ROOT / "data/corpus/train.jsonl", 8)]
    ro = eng.generate(P, max_new_tokens=128, temperature=1.0, eos_id=pol.eos_id, seed=0)
    with torch.no_grad(): lp, _ = pol.logprobs(P, ro.completion_ids, None, 1.0)
    worst = max(abs(lp[b, i].item() - l) for b, ls in enumerate(ro.logprobs) for i, l in enumerate(ls))
    assert worst < 1e-3, worst
