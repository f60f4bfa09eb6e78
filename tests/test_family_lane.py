"""The whole pipeline on every hub-shaped family (its own CI step, `make test-families`: about a minute a family on
one core): SFT → CODI → GKD → GRPO → eval, text and latent, each stage on the model the one before saved, loaded by
path through the code a hub name goes through. `tests/test_families.py` holds what is tested per family in `make test`
(stopping, LoRA rows); here each stage must run and save, and both evaluations decode every program to an end."""
import os
import pytest
from conftest import run_cli, ONE, rows_of, steps_of
from test_families import families  # noqa: F401  (the session fixture)
from latent_rl.fixtures import FAMILIES

pytestmark = pytest.mark.skipif(os.environ.get("LATENT_RL_FAMILY_LANE") != "1",
                                reason="the family lane runs as its own CI step: make test-families")

@pytest.mark.parametrize("family", list(FAMILIES))
def test_whole_pipeline_on_a_hub_shaped_family(families, family, tmp_path):  # noqa: F811
    data = ["--train", families / "eight.jsonl"]
    run_cli("sft", "--recipe", "none", "--model", families / family, *data, "--val", "", "--steps", 100, "--batch_size",
            8, "--lr", 3e-3, "--warmup", 5, "--save_every", 0, "--out", tmp_path / "sft", env=ONE)
    run_cli("codi", "--recipe", "cpu-smoke", "--model", tmp_path / "sft" / "final", *data, "--val", "", "--out",
            tmp_path / "codi", env=ONE)
    run_cli("gkd", "--recipe", "cpu-smoke", "--model", tmp_path / "codi" / "final", "--teacher",
            tmp_path / "sft" / "final", *data, "--out", tmp_path / "gkd", env=ONE)
    run_cli("grpo", "--recipe", "cpu-smoke", "--model", tmp_path / "gkd" / "final", *data, "--out", tmp_path / "grpo",
            env=ONE)
    for stage in ("codi", "gkd", "grpo"):
        assert steps_of(tmp_path / stage)[-1]["step"] == 2 and (tmp_path / stage / "final" / "config.json").exists()
    p = run_cli("eval", "--model", f"text={tmp_path / 'sft' / 'final'}", "--model", f"latent={tmp_path / 'grpo' / 'final'}",
                "--rows", families / "eight.jsonl", "--max_new_tokens", 300, "--out", tmp_path / "eval", env=ONE)
    assert "| text |" in p.stdout and "| latent |" in p.stdout
    text, latent = rows_of(tmp_path / "eval" / "text.records.jsonl"), rows_of(tmp_path / "eval" / "latent.records.jsonl")
    assert len(text) == len(latent) == 8
    assert sum(r["generated"].endswith("<|end_of_text|>") for r in text) >= 6        # the SFT model stops at the end
