"Integration test of `python -m latent_rl.diagnose` on a tiny CODI run (SFT nano model → CODI → diagnosis)."
import json
import pytest
from conftest import run_cli

SECTIONS = ("## 1. Accuracy", "## 2. Accuracy by trace length", "## 3. Control-flow faithfulness", "## 4. Latent probes",
            "## 5. Distillation floor")
FIGS = ("accuracy_by_length", "faithfulness", "probes", "kd_floor")
ONE = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

@pytest.fixture(scope="module")
def tiny_codi(tiny_data, tmp_path_factory):
    "A nano SFT model and a 4-step CODI run from it (kd_anchors.jsonl every step)."
    d = tmp_path_factory.mktemp("diag")
    run_cli("sft", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl", "--val", "",
            "--preset", "nano", "--steps", 4, "--batch_size", 8, "--save_every", 0, "--log_every", 2, "--out", d / "sft", env=ONE)
    run_cli("codi", "--model", d / "sft" / "final", "--train", tiny_data / "corpus/train.jsonl", "--val", "", "--steps", 4,
            "--batch_size", 8, "--warmup", 1, "--save_every", 0, "--log_every", 1, "--anchor_every", 1, "--out", d / "codi", env=ONE)
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
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["modes"]) == {"explicit", "latent", "no-trace"} and rep["n"] == 8
    assert {r["features"] for r in rep["probes"]["rows"]} >= {"latent step 1", "student layer 2", "teacher layer 2"}
    assert [r["layer"] for r in rep["kd_floor"]["table"]][-1] == "mean" and len(rep["kd_floor"]["steps"]) == 4
    for stem in ("explicit", "latent", "notrace"):
        recs = [json.loads(l) for l in (out / f"{stem}.records.jsonl").read_text().splitlines()]
        assert len(recs) == 8 and all({"id", "n_line_frames", "generated", "frames", "well_formed", "predicted", "truth",
                                       "correct", "forward_passes"} <= set(r) for r in recs)
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
    (tmp_path / "final").mkdir(); (tmp_path / "final" / "latent_spec.json").write_text("{}")
    with pytest.raises(SystemExit, match="--notrace"): main([tmp_path, "--notrace", tmp_path / "missing"])
