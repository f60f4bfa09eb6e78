"""LoRA students (peft adapters injected in place): the final model is a plain merged HF model, resume is exact,
2-process
FSDP2 equals 1 process, the CODI projector trains beside the adapters, GKD's adapter-off teacher is the base model."""
import shutil
import pytest, torch
from conftest import run_cli
from test_cluster import launch, weights, assert_close, TEACHER, ROWS, ENV, EXACT, EXACT_TOL

pytest.importorskip("peft")
LORA = ["--lora_r", 4, "--lora_alpha", 8]
ONE = {k: ENV[k] for k in ("OMP_NUM_THREADS", "WANDB_MODE")}

def sft_args(data):
    return [
        "sft", "--recipe", "none", "--tokenizer", data / "tokenizer", "--train", data / "corpus/train.jsonl", "--val",
        "", "--size", "nano", "--steps", 4, "--batch_size", 8, "--lr", 1e-2, "--log_every", 1, *LORA,
    ]

def test_sft_lora_exports_a_plain_merged_model_and_resumes_exactly(tiny_data, tmp_path):
    run_cli(*sft_args(tiny_data), "--save_every", 2, "--out", tmp_path / "full", env=ONE)
    final = tmp_path / "full" / "final"
    sd = weights(final)
    assert not any("lora_" in k or "base_layer" in k for k in sd)            # no peft names: a plain model
    ck = tmp_path / "full" / "checkpoints" / "step-2" / "model" / "lora.safetensors"
    from safetensors.torch import load_file
    assert ck.exists() and all("lora_" in k for k in load_file(str(ck)))      # the adapters, for a resume
    assert [p.name for p in ck.parent.iterdir()] == ["lora.safetensors"]     # and nothing else: no merged model
    from transformers import AutoModelForCausalLM
    from latent_rl.models import load_tokenizer, build_tiny
    m = AutoModelForCausalLM.from_pretrained(final)                          # loads without peft
    base = build_tiny(load_tokenizer(tiny_data / "tokenizer"), "nano", seed=0).state_dict()
    moved = {k for k in base if (base[k] - m.state_dict()[k]).abs().max() > 1e-7}
    assert moved and all(
        any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        for k in moved
    )                                      # only adapted projections changed
    shutil.copytree(tmp_path / "full", tmp_path / "part")
    shutil.rmtree(tmp_path / "part" / "final")
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-4", ignore_errors=True)
    run_cli(*sft_args(tiny_data), "--save_every", 2, "--out", tmp_path / "part", "--resume", env=ONE)
    assert_close(sd, weights(tmp_path / "part" / "final"), 1e-6)
    run_cli(*sft_args(tiny_data), "--steps", 2, "--save_every", 1, "--save_merged", "--out", tmp_path / "merged", env=ONE)
    assert (tmp_path / "merged" / "checkpoints" / "step-1" / "model" / "model.safetensors").exists()   # on request

def test_codi_lora_two_processes_fsdp_equal_one(tmp_path):
    args = [
        "codi", "--recipe", "none", "--model", TEACHER, "--train", ROWS, "--val", "", "--max_train", 32, "--steps", 2,
        "--batch_size", 4, "--lr", 1e-3, "--save_every", 0, "--log_every", 1, *LORA, *EXACT,
    ]
    launch(1, *args, "--out", tmp_path / "one")
    launch(2, *args, "--strategy", "fsdp", "--out", tmp_path / "fsdp")
    a = weights(tmp_path / "one" / "final")
    assert_close(a, weights(tmp_path / "fsdp" / "final"), EXACT_TOL)
    base = {k: v.double() for k, v in weights(TEACHER).items()}
    assert torch.equal(a["model.embed_tokens.weight"], base["model.embed_tokens.weight"])   # frozen base
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (a[q] - base[q]).abs().max() > 1e-6                               # the merged adapters moved it

GKD = [
    "gkd", "--recipe", "none", "--model", TEACHER, "--teacher", "base", "--train", ROWS, "--max_train", 16,
    "--batch_size", 2, "--max_new_tokens", 24, "--lmbda", 1, "--steps", 2, "--lr", 1e-3, "--save_every", 0,
    "--record_every", 0, "--log_every", 1,
]

def test_gkd_adapter_off_teacher_is_the_base(tmp_path):
    import json
    run_cli(*GKD, *LORA, "--out", tmp_path / "g", env=ONE)
    rows = [json.loads(l) for l in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1)
    assert first["jsd_loss"] < 1e-6                 # step 1: B = 0, so the adapted student is its base: JSD 0
    p = run_cli(*GKD, "--out", tmp_path / "h", env=ONE, check=False)
    assert p.returncode == 2 and "set lora_r > 0" in p.stderr

def test_grpo_lora_trains_only_the_adapters(tmp_path):
    run_cli(
        "grpo", "--recipe", "none", "--model", TEACHER, "--train", ROWS, "--max_train", 16, "--steps", 2,
        "--batch_size", 2, "--group_size", 4, "--max_new_tokens", 200, "--lr", 1e-2, "--warmup", 0, "--save_every", 0,
        "--record_every", 0, "--dynamic_sampling", 2, *LORA, "--out", tmp_path / "g", env=ONE,
    )
    a, base = weights(tmp_path / "g" / "final"), weights(TEACHER)
    assert a.keys() == base.keys()                                           # a plain model, the teacher's names
    moved = [k for k in a if (a[k] - base[k]).abs().max() > 0]
    # the adapted projections; embeddings, norms frozen
    assert moved and all("proj" in k for k in moved)
