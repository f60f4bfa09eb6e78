"""The first-contact table of issue 48, re-measured: on tiny GPT-2-, Qwen2- and Llama-3-Instruct-shaped models saved as
Hugging Face directories (`latent_rl.fixtures`) and loaded by path, (1) full SFT memorising 8 programs, then
`latent-rl eval` on them: how many completions stop at <|end_of_text|> within the 400-token budget; (2) LoRA SFT
(`--lora_r 8`; GPT-2: its Conv1D projections), then the saved model's trace-token rows: the least distance between
two of the 8 trace tokens the programs contain, input and output rows (0 = some are identical).

    .venv/bin/python .ci/first_contact.py            # about 2 minutes on 2 cores
"""
import json, os, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FAMILIES = {"gpt2": "GPT-2-shaped", "qwen2.5": "Qwen2-shaped", "llama3-instruct": "Llama-3-Instruct-shaped"}
TARGETS = {"gpt2": "c_attn,c_proj,c_fc"}

def cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "latent_rl.train", *map(str, args)], env=env, capture_output=True, text=True,
                       cwd=ROOT)
    return p.returncode, (p.stdout + p.stderr).strip().splitlines()[-1:]

def rows_distance(model_dir) -> str:
    import torch
    from latent_rl.models import load_model
    from latent_rl.trace import TRACE_TOKENS
    m, tok = load_model(model_dir)
    ids = tok.convert_tokens_to_ids([t for t in TRACE_TOKENS if t not in ("<|latent_start|>", "<|latent_end|>",
                                                                          "<|exception_sep|>")])
    d = [torch.pdist(W[ids].float()).min().item() for W in (m.get_input_embeddings().weight,
                                                            m.get_output_embeddings().weight)]
    return f"rows distinct (least distance: input {d[0]:.3f}, output {d[1]:.3f})" if min(d) > 1e-6 else \
        f"**rows identical** (least distance: input {d[0]:.3f}, output {d[1]:.3f})"

def main():
    from latent_rl.fixtures import build_fixture, fixture_texts
    tmp = Path(tempfile.mkdtemp(prefix="first_contact_"))
    lines = (ROOT / "data" / "corpus" / "train.jsonl").read_text().splitlines()
    texts = fixture_texts([json.loads(l) for l in lines[:200]])
    (tmp / "eight.jsonl").write_text("".join(l + "\n" for l in lines[:8]))
    stop, lora = {}, {}
    for fam in FAMILIES:
        base = build_fixture(fam, tmp / fam, texts)
        common = ["--recipe", "none", "--model", base, "--train", tmp / "eight.jsonl", "--val", "", "--batch_size", 8,
                  "--warmup", 5, "--save_every", 0]
        cli("sft", *common, "--steps", 150, "--lr", 3e-3, "--out", tmp / f"{fam}-sft")
        cli("eval", "--model", tmp / f"{fam}-sft" / "final", "--rows", tmp / "eight.jsonl", "--max_new_tokens", 400,
            "--out", tmp / f"{fam}-eval")
        recs = [json.loads(l) for l in (tmp / f"{fam}-eval" / "final.records.jsonl").read_text().splitlines()]
        exact = sum(r["correct"] for r in recs)
        stops = sum(r["generated"].endswith("<|end_of_text|>") and r["n_tokens"] < 400 for r in recs)
        stop[fam] = f"{exact}/8 exact, {stops}/8 stop"
        rc, last = cli("sft", *common, "--steps", 60, "--lr", 1e-2, "--lora_r", 8, "--lora_targets",
                       TARGETS.get(fam, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
                       "--out", tmp / f"{fam}-lora")
        lora[fam] = rows_distance(tmp / f"{fam}-lora" / "final") if rc == 0 else f"**crash**: {last}"
    print("| what | " + " | ".join(FAMILIES.values()) + " |\n|---|" + "---|" * len(FAMILIES))
    print("| full SFT memorising 8 programs, then `latent-rl eval` on them | " + " | ".join(stop.values()) + " |")
    print("| LoRA SFT (`--lora_r 8`), then the saved model's trace-token rows | " + " | ".join(lora.values()) + " |")

if __name__ == "__main__":
    main()
