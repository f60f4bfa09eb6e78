"""Hub names, as a user types them: models published under their hub names into a local Hugging Face cache (the layout
`huggingface_hub` writes; `latent_rl.fixtures.publish`) and read offline load everywhere a path does — the policy, the
teachers, `eval`, `plan`, `serve-teacher` — for `gpt2`, `owner/name` and `owner/name@revision` (refused before: 'model
path … does not exist'). `tests/test_hub_lane.py` runs the README's hub commands against such a cache."""
import json, os, subprocess, sys, time, urllib.request
import pytest, torch
from conftest import ROOT, ONE, run_cli, rows_of
from latent_rl.fixtures import build_fixture, fixture_texts, publish

ROWS = ROOT / "data" / "corpus" / "train.jsonl"
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"

@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    "A Hugging Face cache with `gpt2` and a Qwen2.5-Instruct-shaped model (`main`, and another at the tag `v1`)."
    d = tmp_path_factory.mktemp("hub")
    texts = fixture_texts([json.loads(l) for l in ROWS.read_text().splitlines()[:200]])
    publish(build_fixture("gpt2", d / "gpt2", texts), "gpt2", d / "cache")
    publish(build_fixture("qwen2.5-instruct", d / "qwen", texts), QWEN, d / "cache")
    publish(build_fixture("qwen2.5-instruct", d / "qwen-v1", texts, seed=1), QWEN, d / "cache", revision="v1")
    return d

@pytest.fixture
def offline(hub, monkeypatch):
    "This process reads the hub cache offline."
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hub / "cache"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    return hub

def env(hub) -> dict:
    return {**ONE, "HF_HUB_CACHE": str(hub / "cache"), "HF_HUB_OFFLINE": "1", "HF_HOME": str(hub / "home")}

def test_a_hub_name_resolves_to_its_cached_snapshot(offline):
    from latent_rl.models import resolve_model, load_model
    snap = resolve_model(QWEN)
    assert snap.parent.parent.name == f"models--{QWEN.replace('/', '--')}" and (snap / "config.json").exists()
    assert resolve_model(f"{QWEN}@v1") != snap                                        # the tag names its own commit
    m, _ = load_model(f"{QWEN}@v1")
    ref, _ = load_model(offline / "qwen-v1")
    assert torch.equal(m.lm_head.weight, ref.lm_head.weight)                          # the v1 weights, not main's
    assert not torch.equal(m.lm_head.weight, load_model(QWEN)[0].lm_head.weight)
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"): load_model("meta-llama/Llama-3.1-8B")
    with pytest.raises(FileNotFoundError, match="model path runs/sft/final does not exist"): load_model("runs/sft/final")

def test_every_loader_takes_a_hub_name(offline):
    "The policy (text and latent), the teachers and the memory planner, each by name."
    from latent_rl.policy import Policy
    from latent_rl.latent import LatentModel
    from latent_rl.teachers import ModelTeacher, ExplicitTraceTeacher
    from latent_rl.evaluate import load_policy
    from latent_rl.plan import model_config
    assert Policy.load("gpt2").kind == "text" and Policy.load(f"{QWEN}@v1").kind == "text"
    assert LatentModel.load(QWEN)[0].spec.latent_steps == 1
    assert ModelTeacher.load(QWEN, topk=4).topk == 4 and ExplicitTraceTeacher.load("gpt2").max_locals == 48
    assert load_policy(f"{QWEN}@v1")[2] == "text"
    assert model_config(QWEN).model_type == "qwen2"

def test_cli_commands_take_hub_names(hub, tmp_path):
    "`eval` and `plan` by name through the cache, offline; a name that is not there is one line and exit 2."
    p = run_cli("eval", "--model", f"v1={QWEN}@v1", "--model", "gpt2", "--rows", ROWS, "--limit", 2,
                "--max_new_tokens", 8, "--out", tmp_path, env=env(hub))
    assert "| v1 |" in p.stdout and "| gpt2 |" in p.stdout and len(rows_of(tmp_path / "v1.records.jsonl")) == 2
    p = run_cli("plan", "--model", QWEN, "--stage", "codi", "--gpus", 1, "--json", env=env(hub))
    assert json.loads(p.stdout[p.stdout.index("{"):])
    p = run_cli("eval", "--model", "Qwen/Qwen3-8B", "--rows", ROWS, "--limit", 1, env=env(hub), check=False)
    assert p.returncode == 2 and "not in the Hugging Face cache" in p.stderr and "Traceback" not in p.stderr

def test_serve_teacher_takes_a_hub_name(hub):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "latent_rl.train", "serve-teacher", "--model", f"{QWEN}@v1", "--port",
                             str(port)], cwd=ROOT, env={**os.environ, **env(hub)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    info = json.loads(r.read())["data"][0]
                break
            except OSError:
                if proc.poll() is not None: pytest.fail(proc.stdout.read()[-2000:])
                time.sleep(0.25)
        else: pytest.fail("serve-teacher did not start")
        assert info["vocab_size"] > 0
    finally:
        proc.kill()
        proc.wait()
