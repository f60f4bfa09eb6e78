"Integration tests of the `latent-rl` command line: data, trace, sft, eval, bench, and bad inputs."
import json
from pathlib import Path
import pytest
from conftest import ROOT, run_cli

def test_data_builds_corpus_and_tokenizer(tiny_data):
    for s in ("train", "val", "test"):
        rows = [json.loads(l) for l in (tiny_data / "corpus" / f"{s}.jsonl").read_text().splitlines()]
        assert rows and all({"id", "code", "input", "output", "trace"} <= set(r) for r in rows)
    codes = {
        s: {json.loads(l)["code"] for l in (tiny_data / "corpus" / f"{s}.jsonl").read_text().splitlines()}
        for s in ("train", "val", "test")
    }
    assert (
        not (codes["train"] & codes["test"])
        and not (codes["train"] & codes["val"])
        and not (codes["val"] & codes["test"])
    )
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_data / "tokenizer"))
    assert tok.convert_tokens_to_ids("<|latent_start|>") != tok.unk_token_id

def test_data_is_deterministic(tiny_data, tmp_path):
    run_cli("data", "--out", tmp_path, "--n", 400, "--vocab", 300)
    for s in ("train", "val", "test"):
        assert (tmp_path / "corpus" / f"{s}.jsonl").read_bytes() == (tiny_data / "corpus" / f"{s}.jsonl").read_bytes()

def test_trace_command(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"id": "a", "code": "def f(x):\n    return x * 2", "input": "21", "output": "42"})
        + "\n"
        + json.dumps({"id": "b", "code": "def f(x):\n    while True:\n        pass", "input": "1", "output": "1"})
        + "\n"
    )
    p = run_cli("trace", rows, "-o", tmp_path / "out.jsonl", "--timeout", 1)
    out = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out[0]["ok"] and out[0]["value"] == "42" and out[0]["trace"].endswith("<|end_of_text|>")
    assert not out[1]["ok"] and out[1]["reason"]
    assert "1 return values equal" in p.stdout

def test_bad_rows_name_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "code": "def f(x):\n    return x", "input": "1", "output": "1"}) + "\n" +
                   json.dumps({"id": "b", "code": "def f(x):\n    return x", "input": "1"}) + "\n")
    p = run_cli("trace", bad, "-o", tmp_path / "o.jsonl", check=False)
    assert p.returncode != 0 and "bad.jsonl:2" in p.stderr and "'output'" in p.stderr
    bad.write_text("{not json\n")
    p = run_cli("trace", bad, "-o", tmp_path / "o.jsonl", check=False)
    assert p.returncode != 0 and "bad.jsonl:1" in p.stderr

def test_unknown_config_field_is_refused(tmp_path, tiny_data):
    p = run_cli("sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--stepz", "3", check=False)
    assert p.returncode != 0 and "stepz" in p.stderr
    cfg = tmp_path / "c.toml"
    cfg.write_text('lr = 0.01\nbogus = 1\n')
    p = run_cli("sft", "--recipe", "none", "--config", cfg, check=False)
    assert p.returncode != 0 and "bogus" in p.stderr and "c.toml" in p.stderr

def test_sft_then_eval(tiny_data, tmp_path):
    run_cli(
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", tiny_data / "corpus/val.jsonl", "--size", "nano", "--steps", 6, "--batch_size", 8, "--save_every", 3,
        "--log_every", 2, "--out", tmp_path / "run",
    )
    run = tmp_path / "run"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["steps"] == 6
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6] and all(r["loss"] > 0 for r in rows if "loss" in r)
    assert (run / "checkpoints" / "step-3" / "COMPLETE").exists() and (run / "final" / "config.json").exists()
    p = run_cli("eval", "--model", f"sft={run / 'final'}", "--rows", tiny_data / "corpus/test.jsonl", "--limit", 8,
                "--max_new_tokens", 16, "--out", tmp_path / "ev")
    assert "| sft |" in p.stdout
    recs = [json.loads(l) for l in (tmp_path / "ev" / "sft.records.jsonl").read_text().splitlines()]
    assert len(recs) == 8 and all(
        {"id", "generated", "predicted", "truth", "correct", "well_formed"} <= set(r) for r in recs
    )

def test_sft_resume_continues_exactly(tiny_data, tmp_path):
    # one intra-op thread: multi-threaded CPU kernels (e.g. the embedding backward) may sum in a different order from
    # run to run, and Adam amplifies last-bit differences; exactness of *resume* is what this test is about
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    common = [
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--size", "nano", "--batch_size", 8, "--save_every", 3, "--log_every", 1,
    ]
    run_cli(*common, "--steps", 6, "--out", tmp_path / "full", env=one)
    run_cli(*common, "--steps", 6, "--out", tmp_path / "part", "--save_every", 3, env=one)
    import shutil
    shutil.rmtree(tmp_path / "part" / "final")
    # pretend the run died after step 3: keep only the step-3 checkpoint, then resume
    for p in (tmp_path / "part" / "checkpoints").glob("step-*"):
        if p.name != "step-3": shutil.rmtree(p)
    run_cli(*common, "--steps", 6, "--out", tmp_path / "part", "--resume", env=one)
    from safetensors.torch import load_file
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(tmp_path / "part" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)

def test_bench_prints_table_and_json(tmp_path):
    from latent_rl.pool import find_cruxeval

    if find_cruxeval() is None:
        pytest.fail("cruxeval_dev.jsonl not found: data/external/cruxeval ships with the repository")
    p = run_cli("trace", "--quick", "--json", tmp_path / "b.json", module="latent_rl.bench")
    assert "| mode | programs | seconds | programs_per_s |" in p.stdout
    d = json.loads((tmp_path / "b.json").read_text())
    assert d["name"] == "trace" and d["rows"]

def test_every_announced_command_exists():
    from latent_rl.train import COMMANDS, PENDING
    assert not PENDING and {"gkd", "grpo", "plot", "diagnose", "serve-teacher", "recipes"} <= set(COMMANDS)
    p = run_cli("--help")
    assert all(c in p.stdout for c in COMMANDS)

def test_demo_pipeline_smoke(tmp_path):
    "`latent-rl demo` end to end with the cpu-smoke recipe: every stage, the table, the diagnosis and the figures."
    p = run_cli(
        "demo", "--recipe", "cpu-smoke", "--limit", 8, "--out", tmp_path / "demo", "--figures", tmp_path / "figs",
        env={"OMP_NUM_THREADS": "1"}, timeout=900,
    )
    for stage in ("SFT", "CODI", "CODI → GKD", "CODI → GKD → GRPO"):
        assert f"| {stage} |" in p.stdout, p.stdout[-3000:]
    # the study's exploration table beside the demo's own: which family refines in which setting
    assert "GRPO's exploration families, as the study measured them" in p.stdout and "explores by tokens" in p.stdout
    assert "| traces for 10% of the programs | tokens (text sampling only) | 23.5, 22.8 | +2.3 (+1.2 to +3.4) | refines |" in p.stdout
    res = json.loads((tmp_path / "demo" / "results.json").read_text())
    assert set(res["results"]) == {"teacher", "notrace", "codi", "gkd", "grpo"}
    assert (tmp_path / "figs" / "grpo_reward_curve.png").exists() and (
        tmp_path / "figs" / "gkd" / "alignment.png"
    ).exists()
    assert all(Path(f).exists() for f in res["figures"]) and Path(res["diagnosis"]).exists()

def _sft_args(tiny_data, out, *more):
    return [
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--size", "nano", "--batch_size", 8, "--log_every", 1, "--out", out, *more,
    ]

@pytest.mark.parametrize("text,msg", [('lr = "fast"\n', "field 'lr' expects a finite number, got 'fast'"),
                                      ("steps = 2.5\n", "field 'steps' expects an integer, got 2.5"),
                                      ("grad_accum = 0\n", "field 'grad_accum' must be ≥ 1 or auto, got 0"),
                                      ("batch_size = -4\n", "field 'batch_size' must be ≥ 1, got -4"),
                                      ("steps = -3\n", "field 'steps' must be ≥ 1, got -3"),
                                      ('resume = "maybe"\n', "field 'resume' expects true or false, got 'maybe'"),
                                      ("max_len = 0\n", "field 'max_len' must be ≥ 1, got 0"),
                                      ("[SFTconfig]\nsteps = 3\n", "unknown section(s) ['SFTconfig']")])
def test_bad_config_is_one_line_and_exit_2(tmp_path, text, msg):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    p = run_cli("sft", "--recipe", "none", "--config", cfg, "--out", tmp_path / "run", check=False)
    assert p.returncode == 2 and f"c.toml: {msg}" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run" / "final").exists()

def test_recipe_without_the_stage_is_refused(tmp_path):
    p = run_cli("sft", "--recipe", "cpu-smoke", "--out", tmp_path / "run", check=False)
    assert p.returncode == 2 and "recipe cpu-smoke has no SFTConfig section" in p.stderr, p.stderr[-2000:]

def test_non_utf8_row_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        json.dumps({"id": "a", "code": "def f(x):\n    return x", "input": "1", "output": "1"}).encode() + b"\n\xfe\n"
    )
    p = run_cli("trace", bad, "-o", tmp_path / "o.jsonl", check=False)
    assert p.returncode == 2 and "bad.jsonl:2: not UTF-8 text (byte 0xfe" in p.stderr and "Traceback" not in p.stderr, (
        p.stderr[-2000:]
    )

def test_resume_with_another_config_is_refused(tiny_data, tmp_path):
    run_cli(*_sft_args(tiny_data, tmp_path / "run", "--steps", 4, "--save_every", 2, "--lr", 0.003))
    p = run_cli(
        *_sft_args(tiny_data, tmp_path / "run", "--steps", 4, "--save_every", 2, "--lr", 0.01, "--resume"), check=False
    )
    assert p.returncode == 2 and "lr 0.003 → 0.01" in p.stderr, p.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"] == 0.003        # the run's config is kept
    run_cli(*_sft_args(tiny_data, tmp_path / "run", "--steps", 4, "--save_every", 2, "--lr", 0.01, "--resume",
                       "--allow_config_change"))
    ch = [json.loads(l) for l in (tmp_path / "run" / "config_changes.jsonl").read_text().splitlines()]
    assert ch[0]["changed"] == {"lr": [0.003, 0.01]}

def test_second_run_on_one_out_is_refused(tiny_data, tmp_path):
    import subprocess, sys, time, os
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [
            sys.executable, "-m", "latent_rl.train",
            *map(str, _sft_args(tiny_data, out, "--steps", 400, "--save_every", 0)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):                                   # until the first run holds the directory
            if (out / ".lock").exists() and (out / ".lock").read_text().strip(): break
            time.sleep(0.1)
        p = run_cli(*_sft_args(tiny_data, out, "--steps", 2, "--resume"), check=False)
        assert p.returncode == 2 and f"in use by another run (pid {first.pid})" in p.stderr, p.stderr[-2000:]
    finally:
        first.kill()
        first.wait()

def test_truncated_newest_checkpoint_falls_back_exactly(tiny_data, tmp_path):
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run_cli(*_sft_args(tiny_data, tmp_path / "full", "--steps", 9, "--save_every", 3), env=one)
    run_cli(*_sft_args(tiny_data, tmp_path / "part", "--steps", 9, "--save_every", 3), env=one)
    import shutil
    shutil.rmtree(tmp_path / "part" / "final")
    st = tmp_path / "part" / "checkpoints" / "step-6" / "model" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])              # the newest checkpoint, truncated
    (tmp_path / "part" / "checkpoints" / ".tmp-step-9-123").mkdir()       # and an interrupted write's leftovers
    p = run_cli(*_sft_args(tiny_data, tmp_path / "part", "--steps", 9, "--save_every", 3, "--resume"), env=one)
    assert "model.safetensors has" in p.stdout + p.stderr and "resumed from" in p.stdout + p.stderr
    assert not (tmp_path / "part" / "checkpoints" / ".tmp-step-9-123").exists()
    from safetensors.torch import load_file
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(tmp_path / "part" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)

def test_empty_training_file_and_trace_to_a_directory(tiny_data, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    p = run_cli(*_sft_args(tiny_data, tmp_path / "run", "--steps", 2), "--train", tmp_path / "empty.jsonl", check=False)
    assert p.returncode == 2 and "empty.jsonl: no rows (the file is empty)" in p.stderr, p.stderr[-2000:]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "code": "def f(x):\n    return x", "input": "1", "output": "1"}) + "\n")
    p = run_cli("trace", rows, "-o", tmp_path, check=False)
    assert p.returncode == 2 and "is a directory" in p.stderr and "traced" not in p.stdout, p.stderr[-2000:]

def test_ctrl_c_writes_a_checkpoint_and_resume_is_exact(tiny_data, tmp_path):
    import os, signal, subprocess, sys, time
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    args = lambda out, *m: _sft_args(tiny_data, out, "--steps", 30, "--save_every", 0, *m)
    run_cli(*args(tmp_path / "full"), env=one)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **one}
    p = subprocess.Popen([sys.executable, "-m", "latent_rl.train", *map(str, args(tmp_path / "part"))], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):                                        # until a few steps are logged
        m = tmp_path / "part" / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 3: break
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    ck = sorted((tmp_path / "part" / "checkpoints").glob("step-*"))
    assert len(ck) == 1 and 3 <= int(ck[0].name.split("-")[1]) < 30 and "checkpoint written" in out + err
    run_cli(*args(tmp_path / "part", "--resume"), env=one)
    from safetensors.torch import load_file
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(tmp_path / "part" / "final" / "model.safetensors")
    assert all((a[k] - b[k]).abs().max() < 1e-6 for k in a)

def test_wandb_offline_honours_env_and_resume_continues_the_run(tiny_data, tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "cluster-proj", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "grp" / "run"
    run_cli(*_sft_args(tiny_data, out, "--steps", 4, "--save_every", 2, "--wandb", "disabled"), env=env)
    rid = (out / "wandb_id").read_text().strip()
    import shutil
    shutil.rmtree(out / "final")
    run_cli(*_sft_args(tiny_data, out, "--steps", 4, "--save_every", 2, "--wandb", "disabled", "--resume"), env=env)
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(rid) for r in runs), runs      # the same W&B run, continued

def test_bf16_compute_keeps_fp32_master_weights_and_learns(tmp_path):
    "lr 1e-6, 3 AdamW steps: bf16 autocast over fp32 weights moves them like fp32 does; bf16 weights lose the update."
    from conftest import TEACHER
    from safetensors.torch import load_file

    base = [
        "sft", "--recipe", "none", "--model", TEACHER, "--train", TEACHER.parent / "corpus/train.jsonl", "--val", "",
        "--max_train", 64, "--steps", 3, "--batch_size", 8, "--lr", 1e-6, "--warmup", 0, "--min_lr_frac", 1.0,
        "--save_every", 0,
    ]
    one = {"OMP_NUM_THREADS": "1"}
    p = run_cli(*base, "--dtype", "bf16", "--out", tmp_path / "x", check=False)
    assert p.returncode == 2 and "--precision bf16" in p.stderr  # refused without the explicit flag
    for name, extra in (
        ("fp32", []), ("mixed", ["--precision", "bf16"]), ("pure", ["--dtype", "bf16", "--pure_low_precision"]),
    ):
        run_cli(*base, *extra, "--out", tmp_path / name, env=one)
    w0 = load_file(TEACHER / "model.safetensors")
    # pure: from the rounded weights
    start = {"fp32": w0, "mixed": w0, "pure": {k: v.bfloat16() for k, v in w0.items()}}
    upd = {n: {k: (load_file(tmp_path / n / "final/model.safetensors")[k].float() - start[n][k].float()) for k in w0}
           for n in ("fp32", "mixed", "pure")}
    norm = lambda n: sum(float(v.norm() ** 2) for v in upd[n].values()) ** 0.5
    cos = sum(float((upd["mixed"][k] * upd["fp32"][k]).sum()) for k in w0) / (norm("mixed") * norm("fp32"))
    # Adam's first steps move each weight by ~lr·sign(grad): the size of the update survives bf16 compute (within 5%);
    # its direction agrees on most weights (gradients near zero may flip sign under bf16 rounding)
    assert abs(norm("mixed") / norm("fp32") - 1) < 0.05 and cos > 0.5, (norm("mixed"), norm("fp32"), cos)
    print(f"update norm vs fp32: bf16 mixed {norm('mixed') / norm('fp32'):.3f} (cos {cos:.2f}), pure bf16 {norm('pure') / norm('fp32'):.3f}")
    assert norm("pure") < 0.5 * norm("fp32"), (norm("pure"), norm("fp32"))             # what pure bf16 weights lose

def test_plan_prints_parts_and_a_fix():
    p = run_cli(
        "plan", "--model", "qwen2.5-coder-7b", "--stage", "sft", "--gpus", "8", "--gpu-mem", "80", "--strategy", "ddp",
        "--micro-batch", "4", "--seq", "2048",
    )
    assert "| optimizer | 60.9 |" in p.stdout and "does not fit" in p.stdout and "cheapest change" in p.stdout
    p = run_cli("plan", "--model", "qwen2.5-coder-0.5b", "--stage", "codi", "--gpus", "1", "--gpu_mem", "141", "--json")
    out = json.loads(p.stdout)
    assert out["fits"] and out["config"]["gpu_mem"] == 141 and out["parts_gb"]["activations"] > 0
    p = run_cli("plan", "--stage", "ppo", check=False)
    assert p.returncode == 2 and "field 'stage' must be one of sft, codi, gkd, grpo" in p.stderr


@pytest.mark.parametrize("stage", ["sft", "codi", "gkd", "grpo"])
def test_every_flag_explains_itself(stage):
    """`latent-rl STAGE --help`: every field's flag carries its field's comment (one source: the dataclass), not only a
    default."""
    from dataclasses import fields
    from latent_rl.config import field_comments
    from latent_rl.sft import SFTConfig
    from latent_rl.codi import CodiConfig
    from latent_rl.gkd import GKDConfig
    from latent_rl.grpo import GRPOConfig
    cls = {"sft": SFTConfig, "codi": CodiConfig, "gkd": GKDConfig, "grpo": GRPOConfig}[stage]
    out = " ".join(run_cli(stage, "--help").stdout.split())          # argparse wraps lines: compare word by word
    helps = field_comments(cls)
    assert not [f.name for f in fields(cls) if not helps.get(f.name)], "fields without a comment"
    for f in fields(cls):
        assert f"--{f.name} " in out and " ".join(helps[f.name].split())[:40] in out, (f.name, helps[f.name])
    assert "optimizer steps (≥ 1; default:" in out                      # a field's range, from its annotation


@pytest.mark.parametrize("stage", ["sft", "codi", "gkd", "grpo", "plan"])
def test_range_rules_sit_on_the_fields(stage):
    """Each field's range is its annotation (`steps: PosInt`): a subclass that re-defaults a field keeps its base's rule,
    `check_config` refuses a value out of that range by the field's name (`--help` states it:
`test_every_flag_explains_itself`)."""
    from dataclasses import fields
    from latent_rl.config import RANGES, ConfigError, check_config
    from latent_rl.sft import SFTConfig
    from latent_rl.codi import CodiConfig
    from latent_rl.gkd import GKDConfig
    from latent_rl.grpo import GRPOConfig
    from latent_rl.plan import PlanConfig
    cls = {"sft": SFTConfig, "codi": CodiConfig, "gkd": GKDConfig, "grpo": GRPOConfig, "plan": PlanConfig}[stage]
    for base in cls.__mro__[1:]:
        for f in getattr(base, "__dataclass_fields__", {}).values():
            assert str(cls.__dataclass_fields__[f.name].type) == str(f.type), (cls.__name__, f.name, base.__name__)
    bad = {"PosInt": 0, "PosFloat": 0.0, "NonNegInt": -1, "NonNegFloat": -0.5, "Fraction": 1.5, "AutoInt": 0}
    ruled = [f for f in fields(cls) if str(f.type) in RANGES]
    assert len(ruled) >= 10, [f.name for f in ruled]
    for f in ruled:
        with pytest.raises(ConfigError, match=f"field '{f.name}' must be {RANGES[str(f.type)][1]}"):
            check_config(cls(**{f.name: bad[str(f.type)]}))


def test_eval_reads_step_files(tmp_path):
    "`latent-rl eval --rows` takes the implicit-CoT line format (.txt) and GSM8K's jsonl as they are published."
    from latent_rl.steps import find_data
    icot, gsm = find_data("icot"), find_data("gsm8k")
    assert icot is not None and gsm is not None, "data/external/icot and data/external/gsm8k ship with the repository"
    for rows in (icot / "4_by_4_mult" / "valid.txt", gsm / "test.jsonl"):
        p = run_cli("eval", "--model", ROOT / "data" / "teacher", "--rows", rows, "--limit", 4, "--max_new_tokens", 24,
                    "--out", tmp_path / rows.stem)
        assert f"({4} programs)" in p.stdout and "| 4 |" in p.stdout, p.stdout
        recs = [json.loads(l) for l in (tmp_path / rows.stem / "teacher.records.jsonl").read_text().splitlines()]
        assert len(recs) == 4 and all(r["truth"] for r in recs)

def test_old_field_names_still_work_with_a_warning(tmp_path):
    """A renamed field's old name works in a config file and as a flag (a warning names the new one, `--help` shows
    only the new), and a resumed run's config.json written under the old names is compared under the new ones."""
    import contextlib, io
    from dataclasses import asdict
    from latent_rl.codi import CodiConfig
    from latent_rl.config import parse_config, upgrade_keys
    from latent_rl.checkpoints import config_changes
    f = tmp_path / "old.toml"
    f.write_text("g = 0.0\ngrad_ckpt = true\nss_prob = 0.25\nlatent_tf_decay = true\n")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        cfg = parse_config(CodiConfig, ["--config", str(f), "--a", "0.5", "--latent_tf", "0.1", "--ss_ramp_frac", "0.3"])
    assert (cfg.anchor_kd, cfg.teacher_checkpointing, cfg.teacher_ce) == (0.0, True, 0.5)
    assert (cfg.scheduled_sampling, cfg.scheduled_sampling_ramp) == (0.25, 0.3)
    assert (cfg.latent_teacher_forcing, cfg.latent_teacher_forcing_decay) == (0.1, True)
    assert "command line: field 'latent_tf' is now 'latent_teacher_forcing'" in err.getvalue()
    assert f"{f}: field 'g' is now 'anchor_kd'" in err.getvalue()
    assert f"{f}: field 'grad_ckpt' is now 'teacher_checkpointing'" in err.getvalue()
    assert "command line: field 'a' is now 'teacher_ce'" in err.getvalue()
    saved = {("g" if k == "anchor_kd" else k): v for k, v in asdict(CodiConfig(anchor_kd=0.0)).items()}
    assert config_changes(upgrade_keys(saved, CodiConfig, warn=False), asdict(CodiConfig())) == {"anchor_kd": [0.0, 1.0]}
    h = run_cli("codi", "--help").stdout
    assert "--anchor_kd" in h and "--teacher_checkpointing" in h and "--grad_ckpt" not in h and "--g " not in h
    assert "--scheduled_sampling " in h and "--latent_teacher_forcing " in h and "--ss_prob" not in h and "--latent_tf " not in h
