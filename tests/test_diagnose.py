"Integration test of `python -m latent_rl.diagnose` on a tiny CODI run (SFT nano model → CODI → diagnosis)."
import json
import pytest
from conftest import run_cli

SECTIONS = ("## 1. Accuracy", "## 2. Latent usage", "## 3. Accuracy by trace length", "## 4. Control-flow faithfulness",
            "## 5. Latent probes", "## 6. Distillation floor")
FIGS = ("accuracy_by_length", "faithfulness", "probes", "kd_floor")
ONE = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

@pytest.fixture(scope="module")
def tiny_codi(tiny_data, tmp_path_factory):
    "A nano SFT model and a 4-step CODI run from it (kd_anchors.jsonl every step)."
    d = tmp_path_factory.mktemp("diag")
    run_cli(
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--size", "nano", "--steps", 4, "--batch_size", 8, "--save_every", 0, "--log_every", 2, "--out",
        d / "sft", env=ONE,
    )
    run_cli(
        "codi", "--recipe", "none", "--model", d / "sft" / "final", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--steps", 4, "--batch_size", 8, "--warmup", 1, "--save_every", 0, "--log_every", 1,
        "--anchor_every", 1, "--out", d / "codi", env=ONE,
    )
    return d

def test_diagnose_writes_report(tiny_data, tiny_codi):
    d, out = tiny_codi, tiny_codi / "diag"
    common = ["--rows", tiny_data / "corpus/test.jsonl", "--train_rows", tiny_data / "corpus/train.jsonl", "--limit", 8,
              "--probe_train", 60, "--max_new_tokens", 48, "--batch_size", 8, "--out", out]
    # the explicit teacher defaults to the run's `model` (the SFT checkpoint); the same model stands in for the no-trace one
    p = run_cli(d / "codi", "--notrace", d / "sft" / "final", *common, module="latent_rl.diagnose", env=ONE)
    assert "wrote" in p.stdout
    md = (out / "diagnosis.md").read_text()
    for s in SECTIONS: assert s in md, s
    for f in FIGS: assert (out / f"{f}.png").stat().st_size > 1000, f
    assert "| LINE frames | n | explicit exact | latent exact | no-trace exact |" in md
    assert "| latent |" in md and "plateau step" in md and "| *chance (majority class)* |" in md
    # a 4-step student may not write <|line_sep|> yet
    assert "usage cannot be measured" in md or "| intact |" in md
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["modes"]) == {"explicit", "latent", "no-trace"} and rep["n"] == 8
    assert {r["features"] for r in rep["probes"]["rows"]} >= {"latent step 1", "student layer 2", "teacher layer 2"}
    assert [r["layer"] for r in rep["kd_floor"]["table"]][-1] == "mean" and len(rep["kd_floor"]["steps"]) == 4
    for stem in ("explicit", "latent", "notrace"):
        recs = [json.loads(l) for l in (out / f"{stem}.records.jsonl").read_text().splitlines()]
        assert len(recs) == 8 and all(
            {
                "id", "n_line_frames", "generated", "frames", "well_formed", "predicted", "truth", "correct",
                "forward_passes",
            }
            <= set(r)
            for r in recs
        )
    # a latent model directory finds its run by walking up, and the records written above are reused (in-process)
    from latent_rl.diagnose import main
    main([d / "codi" / "final", *common, "--no_probes"])
    rep2 = json.loads((out / "report.json").read_text())
    assert rep2["run"] == str(d / "codi") and rep2["modes"]["latent"]["source"] == str(out / "latent.records.jsonl")
    assert rep2["modes"]["latent"]["accuracy"] == rep["modes"]["latent"]["accuracy"]
    assert "probes not run" in (out / "diagnosis.md").read_text()

def test_diagnose_refuses_what_is_not_a_run(tmp_path):
    from latent_rl.diagnose import main
    with pytest.raises(SystemExit, match="does not exist"): main([tmp_path / "nope"])
    with pytest.raises(SystemExit, match="neither a CODI run directory"): main([tmp_path])
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "latent_spec.json").write_text("{}")
    with pytest.raises(SystemExit, match="--notrace"): main([tmp_path, "--notrace", tmp_path / "missing"])

# ---------------------------------------------------------------- latent usage on students that provably do / do not use latents
def test_latent_usage_tells_users_from_ignorers(tiny_data):
    from latent_rl.models import load_tokenizer
    from latent_rl.latent_probes import latent_usage, OracleStudent
    from latent_rl.diagnose import usage_markdown
    tok = load_tokenizer(tiny_data / "tokenizer")
    rows = [json.loads(l) for l in (tiny_data / "corpus/train.jsonl").read_text().splitlines()][:120]
    res = {
        u: latent_usage(
            None, tok, rows, variants=("shuffle", "zero", "mean", "noise"), generate=OracleStudent(tok, rows, u),
            progress=False,
        )
        for u in (True, False)
    }
    for u in (True, False): assert res[u]["accuracy"]["mean"] == 1.0
    user, ignorer = res[True]["variants"], res[False]["variants"]
    # delta exactly 0
    assert all(ignorer[v]["mean"] == 0.0 and ignorer[v]["lo"] == ignorer[v]["hi"] == 0.0 for v in ignorer)
    # large delta
    assert user["shuffle"]["mean"] < -0.5 and user["shuffle"]["hi"] < -0.4 and res[True]["used"]
    assert res[False]["used"] is False and res[False]["verdict"].startswith("latents unused")
    md = "\n".join(usage_markdown(res[True]))
    assert md.startswith("**Latents used: replacing") and "| another program's latents (same block, same step) |" in md
