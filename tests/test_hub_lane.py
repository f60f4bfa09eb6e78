"""The README's hub path, rehearsed (its own CI step, `make test-hub`): tiny models and CODI's dataset are published
under the README's hub names into a local Hugging Face cache (`latent_rl.fixtures.HUB_NAMES`, `publish`,
`publish_dataset`), the hub is offline, and the README's hub commands run as written — `data`, `sft`, `codi` under
`torchrun`, `gkd`, `grpo`, `eval` under `torchrun` — each with the one scale-down switch, `--fast-dev-run`. The commands
are read from README.md, so the README and what CI runs cannot drift apart."""
import json, os, re, subprocess
import pytest
from conftest import ROOT, BIN, rows_of
from latent_rl.fixtures import HUB_NAMES, build_fixture, codi_gsm8k_aug, fixture_texts, publish, publish_dataset

pytestmark = pytest.mark.skipif(os.environ.get("LATENT_RL_HUB_LANE") != "1",
                                reason="the hub rehearsal runs as its own CI step: make test-hub")

def readme_hub_commands() -> list[str]:
    "The commands of the README's hub section, continued lines joined, comments dropped."
    text = (ROOT / "README.md").read_text()
    block = text.split("A hub model, on GPUs", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    block = re.sub(r"\\\n\s*", "", block)                                         # a command continued with `\`
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]

@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    "A working directory, and an offline Hugging Face cache holding a tiny model under each README hub name and data."
    d = tmp_path_factory.mktemp("hub")
    texts = fixture_texts([json.loads(l) for l in (ROOT / "data/corpus/train.jsonl").read_text().splitlines()[:200]])
    aug = codi_gsm8k_aug(ROOT / "data/external/icot/gsm8k/valid.txt")
    texts += [f"{r['question']} {r['cot']} {r['answer']}" for r in aug]           # their words, as a hub model knows
    for name, family in HUB_NAMES.items():
        publish(build_fixture(family, d / "models" / family, texts), name, d / "hf" / "hub")
    publish_dataset({"train": aug, "test": aug[:50]}, "zen-E/GSM8k-Aug", d / "hf" / "hub")
    (d / "work" / "data").mkdir(parents=True)
    (d / "work" / "data" / "external").symlink_to(ROOT / "data" / "external")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "HF_"))}
    env.update(HF_HOME=str(d / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PATH=f"{BIN}:{env['PATH']}",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", NETRC=str(d / "no-netrc"))
    return d / "work", env

def test_the_readme_lists_the_whole_hub_path():
    cmds = readme_hub_commands()
    stages = [re.search(r"(?:latent-rl|latent_rl\.train) (\S+)", c).group(1) for c in cmds]
    assert stages == ["data", "sft", "codi", "gkd", "grpo", "eval"], cmds
    assert sum(c.startswith("torchrun") for c in cmds) >= 2                      # some stages as a cluster runs them

def test_readme_hub_commands_run_as_written(hub):
    work, env = hub
    for cmd in readme_hub_commands():
        p = subprocess.run(f"{cmd} --fast-dev-run", shell=True, cwd=work, env=env, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = (work / "data/gsm8k_aug/train.txt").read_text().splitlines()
    assert lines and all("||" in l and "####" in l for l in lines)
    run = work / "runs/llama3.2-1b-gsm8k-aug"
    for stage in ("cot-sft", "codi", "gkd", "grpo"):
        assert [r["step"] for r in rows_of(run / stage / "metrics.jsonl") if "step" in r] == [1, 2], stage
        assert (run / stage / "final/config.json").exists() and (run / stage / "checkpoints").exists(), stage
    assert json.loads((run / "codi/final/training_summary.json").read_text())["processes"] == 2   # under torchrun
    assert (run / "codi/final/latent_spec.json").exists() and (run / "grpo/final/latent_spec.json").exists()
    recs = rows_of(work / "runs/eval/final.records.jsonl")
    assert len(recs) == 8 and all(r["id"] for r in recs)                       # eval's 8 rows, gathered from 2 processes
