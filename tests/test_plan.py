"""The memory planner against the recipes and the runs (issue 69): every stage of every GPU recipe fits the GPUs it is
for (`latent-rl plan --recipe R --stage S --gpus N`), a run with `grad_accum = "auto"` takes the planner's choice
(its `config.json` says so), a run the planner says cannot fit stops before a weight is loaded, in one line. The
plan lane (`make test-plan`, its own CI step) holds the planner to measured peaks on a Llama-shaped model, and a LoRA
step over a bf16 base to the memory that base saves."""
import json, os, subprocess, sys
from dataclasses import replace
import pytest
import torch
from conftest import ROOT, run_cli, ONE
from latent_rl.recipes import RECIPES
from latent_rl.config import parse_config
from latent_rl.sft import SFTConfig
from latent_rl.codi import CodiConfig
from latent_rl.gkd import GKDConfig
from latent_rl.grpo import GRPOConfig
from latent_rl.plan import recipe_plan, PlanConfig, ModelShape, plan_memory

CLASSES = {"SFTConfig": SFTConfig, "CodiConfig": CodiConfig, "GKDConfig": GKDConfig, "GRPOConfig": GRPOConfig}
GPU_MEM = {"gpu-qwen2.5-coder-32b": 141.0}      # the GPUs a recipe is for: 80 GB, or as its comment names them
# full fine-tuning of 7.6B parameters: 16 bytes a parameter of weights, gradients and AdamW states (122 GB) on one GPU
NEEDS_8 = {"gpu-qwen2.5-coder-7b"}
LANE = os.environ.get("LATENT_RL_PLAN_LANE") == "1"


def recipe_cases():
    return [(r, c, n) for r in RECIPES if r.startswith("gpu-") for c in RECIPES[r] for n in (1, 8)]


@pytest.mark.parametrize("recipe,cls,gpus", recipe_cases())
def test_every_gpu_recipe_fits_the_gpus_it_names(recipe, cls, gpus):
    cfg = parse_config(CLASSES[cls], ["--recipe", recipe])
    pc, res = recipe_plan(cfg, gpus, GPU_MEM.get(recipe, 80.0), RECIPES[recipe])
    if recipe in NEEDS_8 and gpus == 1:
        assert not res["fits"] and res["fix"]["changes"] == ["--lora_r 16 (LoRA student over a frozen bf16 base)"]
        return
    assert res["fits"], (recipe, cls, gpus, res["total_gb"], res["parts_gb"])
    accum = res["grad_accum"]
    assert isinstance(accum, int) and pc.micro_batch == cfg.batch_size // (gpus * accum) * getattr(cfg, "group_size", 1)


def test_codis_own_micro_batches_on_one_process():
    "CODI's scripts: GPT-2 64 × 2 accumulation, Llama 32 × 4, on one process (the guide's table says so too)."
    for recipe, micro in (("gpu-gpt2-gsm8k-aug", 64), ("gpu-llama3.2-1b-gsm8k-aug", 32)):
        pc, res = recipe_plan(parse_config(CodiConfig, ["--recipe", recipe]), 1, 80.0, RECIPES[recipe])
        assert (pc.micro_batch, res["fits"]) == (micro, True)


def test_the_plan_command_answers_for_a_recipe():
    p = run_cli("plan", "--recipe", "gpu-llama3.2-1b-gsm8k-aug", "--stage", "grpo", "--gpus", "8")   # the README's
    assert "fits:" in p.stdout and "grad_accum 1: micro-batch 64 × 512 tokens per GPU" in p.stdout, p.stdout
    p = run_cli("plan", "--recipe", "gpu-llama3.2-1b-gsm8k-aug", "--stage", "grpo", "--gpus", "8", "--json")
    out = json.loads(p.stdout[p.stdout.index("{"):])
    assert out["fits"] and out["config"]["model"] == "meta-llama/Llama-3.2-1B-Instruct" and out["config"]["lora_r"] == 128
    assert out["config"]["rollout_rows"] == 128 and out["grad_accum"] >= 1
    p = run_cli("plan", "--recipe", "gpu-qwen2.5-coder-7b", "--stage", "sft", "--gpus", "1")
    assert "does not fit" in p.stdout and "cheapest change: --lora_r 16" in p.stdout
    bad = run_cli("plan", "--recipe", "cpu-mult4", "--stage", "grpo", check=False)
    assert bad.returncode == 2 and "has no GRPOConfig section" in bad.stderr and "Traceback" not in bad.stderr


def test_a_run_with_grad_accum_auto_takes_the_plans_choice(tmp_path):
    """`latent-rl plan` for the run's own config and memory names a grad_accum; the run saves that one."""
    def planned(mem):
        return recipe_plan(parse_config(SFTConfig, ["--recipe", "cpu-tiny", "--grad_accum", "auto"]), 1, mem,
                           attention="math")[1]
    cfg = parse_config(SFTConfig, ["--recipe", "cpu-tiny"])
    tot = {a: recipe_plan(replace(cfg, grad_accum=a), 1, 100.0, attention="math")[1]["total_gb"] for a in (2, 4)}
    mem = round((tot[2] + tot[4]) / 2, 4)             # room for 4 micro-batches a step, not for 2
    assert planned(mem)["grad_accum"] == 4
    p = run_cli("plan", "--recipe", "cpu-tiny", "--stage", "sft", "--gpus", "1", "--gpu_mem", mem, "--device", "cpu",
                "--grad_accum", "auto")
    assert "grad_accum 4:" in p.stdout
    out = tmp_path / "sft"
    run_cli("sft", "--recipe", "cpu-tiny", "--grad_accum", "auto", "--device_mem", mem, "--steps", 1, "--max_train", 64,
            "--save_every", 0, "--out", out, env=ONE)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["grad_accum"], saved["batch_size"]) == (4, 32)


def test_a_run_that_cannot_fit_stops_before_loading_weights(tmp_path):
    p = run_cli("sft", "--recipe", "cpu-tiny", "--device_mem", 0.01, "--steps", 1, "--out", tmp_path / "r", check=False)
    err = [l for l in p.stderr.splitlines() if "error:" in l]
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(err) == 1, p.stderr[-2000:]
    assert "does not fit" in err[0] and "grad_accum" in err[0] and "0.01 GB" in err[0]
    assert not (tmp_path / "r" / "checkpoints").exists() and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_the_planner_counts_a_lora_base_in_the_compute_dtype():
    s = ModelShape(params=10**9, root=0, layer=0, layers=1, hidden=1024, intermediate=4096, kv=256, vocab=1000,
                   lora_per_r=10**5)
    w = {p: plan_memory(PlanConfig(stage="sft", gpus=1, strategy="ddp", precision=p, lora_r=8), s)["weights"]
         for p in ("fp32", "bf16")}
    assert w["fp32"] - w["bf16"] == 2 * 10**9                 # 4 bytes a base parameter, or 2 (`hold_frozen`)
    full = plan_memory(PlanConfig(stage="sft", gpus=1, strategy="ddp", precision="bf16"), s)
    assert full["cast_copies"] == 2 * 10**9                    # autocast's bf16 copy of fp32 weights, per micro-batch


# ---- the plan lane: measured peaks on a Llama-shaped model (Llama-3's vocabulary, 4 layers of 1024: 192M parameters)
def measure(stage, micro, precision="bf16", lora_r=8):
    code = ("import json, torch; torch.set_num_threads(2); from latent_rl.bench_stages import measure_step_peak, _ARCHS; "
            f"print(json.dumps(measure_step_peak({stage!r}, _ARCHS['llama3-192m'], {micro}, 1, max_len=256, "
            f"precision={precision!r}, lora_r={lora_r})))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    planned = sum(plan_memory(PlanConfig(**r["plan"]), ModelShape(**r["shape"])).values()) / 2**20
    return r, planned


@pytest.mark.skipif(not LANE, reason="the plan lane (make test-plan): a Llama-shaped model's real steps, ~6 min")
@pytest.mark.parametrize("stage", ["sft", "codi", "gkd", "grpo"])
def test_the_planner_is_within_a_quarter_of_measured_peaks(stage):
    for micro in (1, 2):
        r, planned = measure(stage, micro)
        err = planned / r["peak_mb"] - 1
        print(f"plan lane: {stage} micro-batch {micro} × {r['plan']['seq']} tokens, LoRA r8 bf16: measured "
              f"{r['peak_mb']:.0f} MB, planned {planned:.0f} MB ({err:+.0%})")
        assert abs(err) <= 0.25, (stage, micro, r["peak_mb"], planned)


@pytest.mark.skipif(not LANE, reason="the plan lane (make test-plan)")
def test_a_bf16_lora_base_saves_what_the_plan_says():
    """A LoRA SFT step with --precision bf16 peaks below the same step in fp32 by at least two thirds of the 2 bytes a
    frozen parameter that a bf16 base saves."""
    (b, _), (f, _) = measure("sft", 2, "bf16"), measure("sft", 2, "fp32")
    params = ModelShape(**b["shape"]).params
    saved = f["peak_mb"] - b["peak_mb"]
    print(f"plan lane: LoRA SFT step, {params / 1e6:.0f}M parameters: fp32 {f['peak_mb']:.0f} MB, bf16 "
          f"{b['peak_mb']:.0f} MB, saved {saved:.0f} MB (bar {2 / 3 * 2 * params / 2**20:.0f} MB)")
    assert saved >= 2 / 3 * 2 * params / 2**20


@pytest.mark.skipif(not LANE, reason="the plan lane (make test-plan)")
def test_a_bf16_base_gives_the_adapters_gradients_of_an_fp32_base():
    """The same LoRA SFT step under bf16 autocast over the fp32 base (what ran before `hold_frozen`) and over the base
    held in bf16: the adapters' gradients agree to bf16's precision (its ε is 2⁻⁸ ≈ 0.4%; over 4 layers and the head,
    ~1% of the gradient's norm, every tensor within 5%)."""
    import copy
    from types import SimpleNamespace
    from transformers import AutoConfig, AutoModelForCausalLM
    from latent_rl.bench_stages import _ARCHS
    from latent_rl.models import load_tokenizer, LORA_TARGETS, add_lora, fp32_masters
    from latent_rl.loop import lora_student
    from latent_rl.corpus import load_rows
    from latent_rl.tokens import sft_example
    from latent_rl.sft import sft_batch_loss
    tok = load_tokenizer(ROOT / "data" / "tokenizer")
    rows = load_rows(ROOT / "data" / "corpus" / "train.jsonl", 100)
    exs = [e for e in (sft_example(tok, r, "trace", 256) for r in rows) if e][:2]
    a = dict(_ARCHS["llama3-192m"])
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(a.pop("model_type"), **a))

    def step(held: bool):
        m = copy.deepcopy(base)
        if held: lora_student(SimpleNamespace(lora_r=8, lora_alpha=16, lora_targets=LORA_TARGETS, seed=0, dtype="fp32",
                                              precision="bf16"), m, m)
        else: fp32_masters(add_lora(m, 8, 16, LORA_TARGETS, 0))
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for n, p in m.named_parameters():
                if "lora_B" in n: p.copy_(torch.randn(p.shape, generator=g) * 1e-2)     # as after some training
        assert {p.dtype for p in m.parameters() if not p.requires_grad} == {torch.bfloat16 if held else torch.float32}
        with torch.autocast("cpu", dtype=torch.bfloat16): sft_batch_loss(m, exs, tok.pad_token_id)[0].backward()
        return {n: p.grad.float() for n, p in m.named_parameters() if p.requires_grad}
    g32, g16 = step(False), step(True)
    rel = sum(((g32[k] - g16[k]) ** 2).sum() for k in g32) ** 0.5 / sum((g32[k] ** 2).sum() for k in g32) ** 0.5
    worst = max(float((g32[k] - g16[k]).norm() / g32[k].norm()) for k in g32)
    print(f"plan lane: adapters' gradients over a bf16 base vs an fp32 one: {float(rel):.2%} of the norm, "
          f"worst tensor {worst:.2%}")
    assert len(g32) == 4 * 7 * 2 and rel < 0.02 and worst < 0.05
