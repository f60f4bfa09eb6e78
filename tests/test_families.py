"""First contact with real models: tiny models shaped like each hub family the recipes name (`latent_rl.fixtures`:
GPT-2, Llama-3 base and Instruct, Qwen2.5 and Qwen3 base and Instruct; each family's tokenizer conventions, tied and
untied heads), saved as Hugging Face directories and loaded by path through the same code as a hub name. Each stops
where a trace ends — in latent_rl's decoder and in `transformers` `generate` on the saved model — and learns its
trace tokens' rows under LoRA (GPT-2's Conv1D layers included)."""
import json
import pytest, torch
from conftest import run_cli, ROOT, ONE, shared_dir, rows_of, steps_of
from latent_rl.fixtures import FAMILIES, build_fixture, fixture_texts
from latent_rl.trace import END_OF_TEXT, TRACE_TOKENS, row_prompt

ROWS = ROOT / "data" / "corpus" / "train.jsonl"
# the trace tokens eight memorised programs contain (no latent markers, no exception)
SEEN = [t for t in TRACE_TOKENS if t not in ("<|latent_start|>", "<|latent_end|>", "<|exception_sep|>")]
LORA_TARGETS = {"gpt2": "c_attn,c_proj,c_fc"}            # GPT-2's Conv1D projections, as the CODI recipe names them

@pytest.fixture(scope="session")
def families(tmp_path_factory, worker_id):
    "Every family's fixture, and eight training programs to memorise."
    def build(d):
        d.mkdir(parents=True, exist_ok=True)
        lines = ROWS.read_text().splitlines()
        texts = fixture_texts([json.loads(l) for l in lines[:200]])
        for f in FAMILIES: build_fixture(f, d / f, texts)
        (d / "eight.jsonl").write_text("".join(l + "\n" for l in lines[:8]))
    return shared_dir(tmp_path_factory, worker_id, "families", build)

def sft(families, family, out, *extra, steps=150, lr=3e-3):
    run_cli(
        "sft", "--recipe", "none", "--model", families / family, "--train", families / "eight.jsonl", "--val", "",
        "--steps", steps, "--batch_size", 8, "--lr", lr, "--warmup", 5, "--save_every", 0, "--log_every", 50, "--out",
        out, *extra, env=ONE,
    )
    return out / "final"

@pytest.mark.parametrize("family", list(FAMILIES))
def test_loading_makes_the_trace_end_the_stop(families, family):
    from latent_rl.models import load_model
    saved = json.loads((families / family / "config.json").read_text())["vocab_size"]
    model, tok = load_model(families / family)
    end = tok.convert_tokens_to_ids(END_OF_TEXT)
    assert tok.eos_token_id == end and tok.pad_token_id not in (None, end)
    gen = model.generation_config.eos_token_id
    assert (gen if isinstance(gen, list) else [gen])[0] == end               # transformers' generate stops there first
    # the rows latent_rl added (at the mean): Llama-3's own <|end_of_text|> is not one of them; Qwen's land on spare rows
    base = len(tok) - len(tok._latent_rl_new_ids)
    assert model.latent_rl_new_rows == list(range(base, len(tok)))
    assert (end in model.latent_rl_new_rows) == (family not in ("llama3", "llama3-instruct"))
    assert model.get_input_embeddings().weight.shape[0] == max(saved, len(tok))    # spare rows: nothing resized
    assert (saved > len(tok)) == family.startswith("qwen")

@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_model_stops_where_its_trace_ends(families, family, tmp_path):
    "Full SFT memorising eight programs: every completion ends at <|end_of_text|>, in both engines (was: 0/8 stopped)."
    from latent_rl.evaluate import evaluate_path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    final = sft(families, family, tmp_path / "sft")
    rows = rows_of(families / "eight.jsonl")
    r = evaluate_path(final, rows, max_new_tokens=400, progress=False)
    assert r["format_valid"] >= 0.75 and r["accuracy"] >= 0.75, (r["format_valid"], r["accuracy"])   # memorised
    assert all(x["generated"].endswith(END_OF_TEXT) and x["n_tokens"] < 400 for x in r["records"])
    m, t = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)   # plain transformers
    ids = torch.tensor([t.encode(row_prompt(rows[0]))])                     # as a transformers user encodes: BOS included
    new = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=400, do_sample=False)[0, ids.shape[1]:]
    assert new[-1].item() == t.convert_tokens_to_ids(END_OF_TEXT) and len(new) < 400
    assert t.decode(new) == r["records"][0]["generated"]                     # the same trace as latent_rl's decoder

@pytest.mark.parametrize("family", ["gpt2", "llama3-instruct", "qwen2.5-instruct", "qwen3"])
def test_lora_trains_the_trace_tokens_rows(families, family, tmp_path):
    """LoRA SFT (GPT-2: its Conv1D projections, which crashed at export): the trace tokens' rows — new, at the mean —
    train beside the adapters (tied heads: one row each; untied: input and output rows), and the merged export is a
    plain model with the rows trained (was: all identical)."""
    from latent_rl.models import load_model
    from safetensors.torch import load_file
    targets = LORA_TARGETS.get(family, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    final = sft(families, family, tmp_path / "lora", "--lora_r", 8, "--lora_targets", targets, steps=60, lr=1e-2)
    assert not any("lora_" in k or "latent_rl" in k for k in load_file(str(final / "model.safetensors")))
    model, tok = load_model(final)
    ids = tok.convert_tokens_to_ids(SEEN)
    for W in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        assert torch.pdist(W[ids].float()).min() > 1e-3                       # every trace token its own vector
    base, _ = load_model(families / family)
    frozen = [i for i in range(len(tok)) if i not in base.latent_rl_new_rows]
    assert torch.equal(model.get_input_embeddings().weight[frozen], base.get_input_embeddings().weight[frozen])

def test_hub_name_without_recipe_is_refused():
    "A hub name with no --recipe never silently trains on the tiny CPU recipe's settings: the error names the recipes."
    for stage in ("sft", "codi", "gkd", "grpo"):
        p = run_cli(stage, "--model", "Qwen/Qwen2.5-Coder-1.5B", check=False, env=ONE)
        assert p.returncode != 0 and "--recipe" in p.stderr and "gpu-" in p.stderr, (stage, p.stderr[-500:])

def test_eval_takes_a_device_and_dtype(families, tmp_path):
    "`latent-rl eval --device --dtype`: the same batched decoding in another dtype (bf16 on a GPU; here the CPU)."
    p = run_cli("eval", "--model", f"t={families / 'qwen2.5'}", "--rows", families / "eight.jsonl", "--limit", 2,
                "--max_new_tokens", 8, "--device", "cpu", "--dtype", "bf16", "--out", tmp_path, env=ONE)
    assert "| t |" in p.stdout and len(rows_of(tmp_path / "t.records.jsonl")) == 2

def _aug_rows(n):
    "Rows shaped like CODI's GSM8k-Aug export (zen-E/GSM8k-Aug): question, space-separated equations, a bare answer."
    return [{"question": f"Tom has {a} bags of {a + 1} apples and eats 1. How many are left?",
             "cot": f"<<{a}*{a + 1}={a * (a + 1)}>> <<{a * (a + 1)}-1={a * (a + 1) - 1}>>", "answer": str(a * (a + 1) - 1)}
            for a in range(2, 2 + n)]

def test_gsm8k_aug_as_its_authors_ship_it(families, tmp_path, monkeypatch):
    """`latent-rl data gsm8k-aug --from FILE` reads CODI's GSM8k-Aug rows (refused before: "no '####'") from jsonl,
    json (and parquet where pyarrow is installed) or a hub name through `datasets`, writes the recipe's train.txt, and
    `latent-rl codi --recipe gpu-gpt2-gsm8k-aug --steps 2` then runs on the GPT-2-shaped model on the CPU."""
    from latent_rl.steps import load_step_source, load_step_rows, StepError
    rows = _aug_rows(40)
    (tmp_path / "aug.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "aug.json").write_text(json.dumps(rows))
    noid = lambda rs: [{k: v for k, v in r.items() if k != "id"} for r in rs]
    a = load_step_rows(tmp_path / "aug.jsonl")
    assert noid(a) == noid(load_step_rows(tmp_path / "aug.json")) and [s["latent"] for s in a[0]["steps"]] == ["2*3=6", "6-1=5"]
    assert a[0]["answer"] == "5"
    nl = load_step_rows(_write(tmp_path / "nl.jsonl", [{"question": "q?", "cot": "He has 2. He gets 3 more.", "answer": "5"}]))
    assert [s["latent"] for s in nl[0]["steps"]] == ["He has 2.", "He gets 3 more."]
    bad = _write(tmp_path / "bad.jsonl", rows[:2] + [{"question": "q?", "cot": 7, "answer": "1"}])
    with pytest.raises(StepError, match=r"bad.jsonl:3: field 'cot'"): load_step_rows(bad)
    import huggingface_hub.constants as hc
    from latent_rl.fixtures import publish_dataset
    publish_dataset({"train": rows, "test": rows[:3]}, "zen-E/GSM8k-Aug", tmp_path / "hub")     # the hub, without a network
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert noid(load_step_source("zen-E/GSM8k-Aug")) == noid(a)                   # through the real `datasets`
    assert len(load_step_source("zen-E/GSM8k-Aug", "test")) == 3
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"): load_step_source("zen-E/GSM8k-Aug-NL")
    p = run_cli("data", "gsm8k-aug", "--from", tmp_path / "aug.jsonl", "--out", tmp_path / "gsm8k_aug", "--drop_last_step",
                env=ONE)
    assert "40 rows" in p.stdout and "1.0 steps a row" in p.stdout                 # CODI drops the last equation
    assert (tmp_path / "gsm8k_aug" / "train.txt").read_text().splitlines()[0].endswith("||<<2*3=6>> #### 5")
    run_cli("codi", "--recipe", "gpu-gpt2-gsm8k-aug", "--steps", 2, "--model", families / "gpt2", "--train",
            tmp_path / "gsm8k_aug" / "train.txt", "--out", tmp_path / "codi", env=ONE)
    assert (tmp_path / "codi" / "final" / "projector.pt").exists()
    assert all("answer_kd_loss" in r for r in steps_of(tmp_path / "codi"))       # CODI's position: the answer's state

def test_gsm8k_aug_from_parquet(tmp_path):
    "The hub's own file format for a dataset's rows: a parquet table of CODI's rows reads like the jsonl."
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    from latent_rl.steps import load_step_rows, is_step_file
    rows = _aug_rows(5)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    got = load_step_rows(tmp_path / "train.parquet")
    assert is_step_file(tmp_path / "train.parquet") and [r["answer"] for r in got] == [r["answer"] for r in rows]

def _write(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path

def test_paper_recipes_cover_every_stage_as_codi_ran_them():
    "The GSM8k-Aug recipes: CODI's objective (distil at the answer's state, not <|action_sep|>) and GKD and GRPO sections."
    from latent_rl.recipes import RECIPES, recipe_fields
    from latent_rl.codi import CodiConfig
    from latent_rl.gkd import GKDConfig
    from latent_rl.grpo import GRPOConfig
    for name, beta in (("gpu-gpt2-gsm8k-aug", 1.0), ("gpu-llama3.2-1b-gsm8k-aug", 20.0)):
        c = recipe_fields(name, CodiConfig)
        assert (c["anchor_kd"], c["answer_kd"], c["answer_kd_at"], c["latent_steps"]) == (0.0, beta, "first", 6)
        assert (c["lora_r"], c["lora_alpha"], c["min_lr_frac"], c["seed"]) == (128, 32.0, 0.0, 11)
        for cls in (GKDConfig, GRPOConfig):
            f = recipe_fields(name, cls)
            assert f["train"] == "data/gsm8k_aug/train.txt" and f["lora_r"] == 128 and f["model"].startswith("runs/")
        assert set(RECIPES[name]) == {"SFTConfig", "CodiConfig", "GKDConfig", "GRPOConfig"}
