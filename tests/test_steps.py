"""Issue 29: the step-structured benchmarks (multiplication, GSM8k-Aug) through the same stages as the code traces."""
import json


from conftest import ROOT, run_cli
from latent_rl.steps import find_data, generate_multiplication, load_step_rows, save_step_lines

ICOT = find_data("icot")


def test_external_data_ships_with_the_repository():
    "A clone needs nothing beside it: the published files the lessons and tests read are in data/external/."
    assert ICOT == (ROOT / "data" / "external" / "icot").resolve()
    assert (ICOT / "LICENSE").is_file() and (ICOT / "4_by_4_mult" / "valid.txt").is_file()
    assert (find_data("gsm8k") / "test.jsonl").is_file() and (find_data("cruxeval") / "LICENSE").is_file()


def test_every_stage_runs_on_multiplication_steps(tmp_path):
    "Generated 4x4 training lines (disjoint from the published validation file) train the explicit-steps and the"
    "answer-only SFT baselines, a CODI student (a latent block per partial product), GKD from the explicit model and GRPO"
    "on 'the answer equals', all with the stages' own CLI; `eval` scores the five on the published validation lines. A"
    "smoke run (a few steps each): the code path, not a result."
    valid = ICOT / "4_by_4_mult" / "valid.txt"
    rows = generate_multiplication(64, seed=0, exclude=load_step_rows(valid))
    train, val = save_step_lines(rows[8:], tmp_path / "train.txt"), save_step_lines(rows[:8], tmp_path / "val.txt")
    common = [
        "--tokenizer", ROOT / "data" / "tokenizer", "--train", train, "--val", val, "--size", "nano", "--steps", 4,
        "--batch_size", 8, "--save_every", 0, "--log_every", 2,
    ]
    run_cli("sft", "--recipe", "none", *common, "--out", tmp_path / "explicit")
    run_cli("sft", "--recipe", "none", *common, "--mode", "answer", "--out", tmp_path / "answer")
    run_cli(
        "codi", "--recipe", "none", "--model", tmp_path / "explicit" / "final", "--train", train, "--val", "",
        "--steps", 2, "--batch_size", 4, "--save_every", 0, "--log_every", 1, "--split_tails", "true",
        "--out", tmp_path / "latent",
    )
    run_cli(
        "gkd", "--recipe", "none", "--model", tmp_path / "latent" / "final", "--teacher",
        tmp_path / "explicit" / "final", "--train", train, "--steps", 2, "--batch_size", 4, "--max_new_tokens", 48,
        "--save_every", 0, "--log_every", 1, "--out", tmp_path / "gkd",
    )
    run_cli(
        "grpo",
        "--recipe",
        "none",
        "--model",
        tmp_path / "gkd" / "final",
        "--train",
        train,
        "--steps",
        2,
        "--batch_size",
        2,
        "--group_size",
        4,
        # reward: the answer equals
        "--max_new_tokens",
        48,
        "--save_every",
        0,
        "--log_every",
        1,
        "--out",
        tmp_path / "grpo",
    )
    names = ("explicit", "answer", "latent", "gkd", "grpo")
    p = run_cli("eval", *[a for n in names for a in ("--model", f"{n}={tmp_path / n / 'final'}")],
                "--rows", valid, "--limit", 4, "--max_new_tokens", 48, "--out", tmp_path / "eval")
    for n in names:
        assert f"| {n} |" in p.stdout, p.stdout
        recs = [json.loads(l) for l in (tmp_path / "eval" / f"{n}.records.jsonl").read_text().splitlines()]
        assert [r["truth"] for r in recs] == [r["answer"] for r in load_step_rows(valid, 4)]
    run_cli("diagnose", tmp_path / "latent", "--teacher", tmp_path / "explicit" / "final", "--notrace",
            tmp_path / "answer" / "final", "--rows", valid, "--train_rows", train, "--limit", 6, "--probe_train", 24,
            "--max_new_tokens", 48, "--out", tmp_path / "diag")                # latent usage, probes, report
    rep = json.loads((tmp_path / "diag" / "report.json").read_text())
    assert rep["n"] == 6 and set(rep["modes"]) == {"explicit", "latent", "no-trace"}
    # a smoke model: no verdict to expect
    assert rep["usage"]["verdict"] and (tmp_path / "diag" / "diagnosis.md").exists()


def test_mult_command_writes_disjoint_verified_lines(tmp_path):
    "`latent-rl mult` (the cpu-mult4 recipe's data): seeded lines none of which is a published validation pair, each"
    "step checked against Python's `*` by the loader; a malformed --digits is one line and exit 2."
    run_cli("mult", "--count", 300, "--val", 20, "--out", tmp_path / "a")
    run_cli("mult", "--count", 300, "--val", 20, "--out", tmp_path / "b")
    assert (tmp_path / "a" / "train.txt").read_bytes() == (tmp_path / "b" / "train.txt").read_bytes()   # seeded
    tr, va = load_step_rows(tmp_path / "a" / "train.txt"), load_step_rows(tmp_path / "a" / "val.txt")
    assert (len(tr), len(va)) == (300, 20)
    valid = {r["question"] for r in load_step_rows(ICOT / "4_by_4_mult" / "valid.txt")}
    assert not valid & {r["question"] for r in tr + va} and len({r["question"] for r in tr + va}) == 320
    for r in tr[:50]:
        a, b = (int("".join(reversed(x.split()))) for x in r["question"].split(" * "))
        assert int("".join(reversed(r["answer"].split()))) == a * b
    p = run_cli("mult", "--digits", "44", "--out", tmp_path / "c", check=False)
    assert p.returncode == 2 and "--digits must look like 4x4" in p.stderr
