"GKD stage: the coin, buffering, the SFT term, a fresh self-teacher, vocabulary and length checks, the HTTP teacher."
import math, os, socket, subprocess, sys, time
import pytest, torch
from conftest import run_cli, ROOT, TEACHER, ROWS, ONE, rows_of, steps_of


def gkd(out, *args, check=True, env=None, **kw):
    base = [
        "gkd", "--recipe", "none", "--model", TEACHER, "--teacher", TEACHER, "--train", ROWS, "--max_train", 64,
        "--batch_size", 4, "--max_new_tokens", 48, "--log_every", 1, "--save_every", 0, "--out", out,
    ]
    return run_cli(*base, *map(str, args), check=check, env={**ONE, **(env or {})}, **kw)


def test_coin_frequency_matches_lambda():
    from latent_rl.gkd import gkd_coin
    for lam in (0.2, 0.5, 0.9):
        f = sum(gkd_coin(3, s, lam) for s in range(20000)) / 20000
        assert abs(f - lam) < 4 * (lam * (1 - lam) / 20000) ** 0.5, (lam, f)

def test_generation_once_per_steps_per_generation(tmp_path):
    gkd(tmp_path, "--steps", 4, "--lmbda", 1, "--steps_per_generation", 2)
    gens = [r["generations"] for r in steps_of(tmp_path)]
    assert gens == [1, 1, 2, 2], gens                     # cumulative generation calls after each step
    assert all(r["on_policy"] == 1 for r in steps_of(tmp_path))

def test_no_sft_term_on_student_data(tmp_path):
    gkd(tmp_path / "on", "--steps", 2, "--lmbda", 1, "--sft_alpha", 1)
    gkd(tmp_path / "off", "--steps", 2, "--lmbda", 0, "--sft_alpha", 1)
    on, off = steps_of(tmp_path / "on"), steps_of(tmp_path / "off")
    assert all(r["sft_loss"] == 0 and abs(r["loss"] - r["jsd_loss"]) < 1e-9 for r in on)
    assert all(r["sft_loss"] > 0 and r["loss"] > r["jsd_loss"] for r in off)

def test_self_teacher_is_never_stale(tmp_path):
    # dataset completions, CE moves the weights every step; the self-teacher must be the *current* student at every
    # step of a 3-step generation buffer, so the JSD stays 0. A teacher cached at generation time would give JSD > 0
    # at the 2nd and 3rd step of each cycle.
    gkd(
        tmp_path, "--steps", 6, "--lmbda", 0, "--sft_alpha", 1, "--teacher", "self", "--steps_per_generation", 3,
        "--lr", 3e-3, "--warmup", 0,
    )
    s = steps_of(tmp_path)
    assert all(r["grad_norm"] > 0 for r in s)
    assert max(abs(r["jsd_loss"]) for r in s) < 1e-6, [r["jsd_loss"] for r in s]

def test_stale_teacher_would_be_caught():
    "The same check on a deliberately stale teacher gives JSD > 0 once the student has moved."
    from latent_rl.policy import Policy
    from latent_rl.teachers import SelfTeacher, ScoreBatch
    from latent_rl.gkd import gkd_loss, dataset_completion
    pol = Policy.load(TEACHER)
    items = [dataset_completion(pol.tok, r, "text") for r in rows_of(ROWS)[:4]]
    P, C = [i["prompt"] for i in items], [i["completion"] for i in items]
    from latent_rl.policy import sampled_mask
    stale = SelfTeacher(pol).score(ScoreBatch(P, C, sampled_mask(C)))
    # a fixed move (the global RNG depends on test order)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pol.module.parameters(): p.add_(torch.randn(p.shape, generator=g) * 3e-2)
    _, m_fresh = gkd_loss(pol, SelfTeacher(pol), items)
    _, m_stale = gkd_loss(pol, SelfTeacher(pol), items, teacher_out=stale)
    assert abs(m_fresh["jsd_loss"]) < 1e-6 and m_stale["jsd_loss"] > 1e-4

def test_latent_student_on_policy_with_explicit_teacher(tmp_path, latent_student):
    gkd(tmp_path, "--model", latent_student, "--steps", 2, "--lmbda", 1, "--record_every", 1)
    s = steps_of(tmp_path)
    assert len(s) == 2 and all(r["n_tokens"] > 0 and r["jsd_loss"] >= 0 for r in s)
    recs = rows_of(tmp_path / "logprobs.jsonl")
    assert recs and all(len(r["logp"]) == len(r["tokens"]) == len(r["mask"]) for r in recs)
    assert (tmp_path / "final" / "latent_spec.json").exists()

def test_vocabulary_mismatch_refused(tmp_path, tiny_data):
    from latent_rl.models import load_tokenizer, build_tiny
    tok = load_tokenizer(tiny_data / "tokenizer")
    m = build_tiny(tok, "nano")
    m.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    p = gkd(tmp_path / "run", "--teacher", tmp_path / "other", "--steps", 1, check=False)
    assert p.returncode != 0 and "vocabulary mismatch" in p.stderr

def test_delete_and_resample_is_bounded(tmp_path):
    p = gkd(tmp_path, "--steps", 1, "--max_len", 40, "--max_resample_rounds", 5, check=False)
    assert p.returncode != 0 and "truncation_strategy='delete'" in p.stderr and "5 draws" in p.stderr
    from latent_rl.gkd import resample_overlong
    lens = [10] * 50 + [100] * 50
    out = resample_overlong(list(range(45, 55)), lambda i: lens[i] <= 10, 100, 0, 7, max_rounds=50)
    assert all(lens[i] <= 10 for i in out) and len(out) == 10

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

@pytest.fixture
def server():
    port = free_port()
    env = {**os.environ, **ONE, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "latent_rl.train", "serve-teacher", "--model", str(TEACHER), "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    from latent_rl.teachers import HTTPTeacher
    for _ in range(120):
        try:
            HTTPTeacher(url, retries=0, timeout=2).models()
            break
        except Exception: time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("serve-teacher did not start: " + proc.stdout.read())
    yield url, proc
    proc.kill()
    proc.wait()

def test_http_topk_equals_local(server):
    url, _ = server
    from latent_rl.teachers import HTTPTeacher, ModelTeacher, ScoreBatch
    from latent_rl.policy import Policy, sampled_mask
    from latent_rl.gkd import dataset_completion
    pol = Policy.load(TEACHER)
    items = [dataset_completion(pol.tok, r, "text") for r in rows_of(ROWS)[:3]]
    P, C = [i["prompt"] for i in items], [i["completion"] for i in items]
    b = ScoreBatch(P, C, sampled_mask(C))
    h, l = HTTPTeacher(url, topk=8).score(b), ModelTeacher.load(TEACHER, topk=8).score(b)
    m = b.mask
    assert torch.equal(h.topk_ids[m], l.topk_ids[m])
    assert (h.topk_logprobs[m] - l.topk_logprobs[m]).abs().max() < 1e-5

def test_http_teacher_killed_mid_run(server, tmp_path):
    url, proc = server
    env = {**os.environ, **ONE, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    run = subprocess.Popen(
        [
            sys.executable, "-m", "latent_rl.train", "gkd", "--recipe", "none", "--model", str(TEACHER), "--teacher",
            url, "--topk", "8", "--train", str(ROWS), "--max_train", "64", "--batch_size", "4", "--lmbda", "0",
            "--steps", "400", "--save_every", "1", "--log_every", "1", "--http_retries", "2", "--http_backoff", "0.2",
            "--http_timeout", "5", "--out", str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ck = tmp_path / "checkpoints"
    for _ in range(600):
        if ck.exists() and any(p.name.startswith("step-") for p in ck.iterdir()): break
        if run.poll() is not None: break
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    out, _ = run.communicate(timeout=300)
    assert run.returncode != 0, out[-2000:]
    assert "retry 1/2" in out and "failed after 3 attempts" in out, out[-3000:]
    from latent_rl.checkpoints import latest_checkpoint
    path, st = latest_checkpoint(tmp_path)
    assert (path / "COMPLETE").exists() and st["step"] >= 1 and (path / "model" / "config.json").exists()

def test_two_rank_run_agrees_on_the_coin(tmp_path):
    env = {**os.environ, **ONE, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "latent_rl.train", "gkd", "--recipe", "none", "--model", str(TEACHER), "--teacher", str(TEACHER),
            "--train", str(ROWS), "--max_train", "64", "--batch_size", "4", "--max_new_tokens", "32", "--lmbda", "0.5",
            "--steps", "6", "--log_every", "1", "--save_every", "0", "--out", str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    from latent_rl.gkd import gkd_coin
    got = [bool(r["on_policy"]) for r in steps_of(tmp_path)]
    assert got == [gkd_coin(0, s, 0.5) for s in range(6)]      # each rank checked the others' coin every cycle

def test_adapter_off_teacher_is_the_base_model():
    peft = pytest.importorskip("peft")
    from latent_rl.policy import Policy, sampled_mask
    from latent_rl.teachers import AdapterOffTeacher, ModelTeacher, SelfTeacher, ScoreBatch
    from latent_rl.gkd import dataset_completion
    from latent_rl.models import load_model
    base, tok = load_model(TEACHER)
    items = [dataset_completion(tok, r, "text") for r in rows_of(ROWS)[:3]]
    P, C = [i["prompt"] for i in items], [i["completion"] for i in items]
    b = ScoreBatch(P, C, sampled_mask(C))
    ref = ModelTeacher.load(TEACHER).score(b).logits
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    pol = Policy(lora, tok, "text")
    off, on = AdapterOffTeacher(pol).score(b).logits, SelfTeacher(pol).score(b).logits
    m = b.mask
    assert (off[m] - ref[m]).abs().max() < 1e-4 and (on[m] - ref[m]).abs().max() > 1e-3

def test_privileged_teacher_reads_another_prompt_and_checks_counts():
    from latent_rl.policy import sampled_mask
    from latent_rl.teachers import PrivilegedTeacher, ModelTeacher, ScoreBatch
    from latent_rl.gkd import dataset_completion
    from latent_rl.models import load_model
    m, tok = load_model(TEACHER)
    rows = rows_of(ROWS)[:2]
    items = [dataset_completion(tok, r, "text") for r in rows]
    P, C = [i["prompt"] for i in items], [i["completion"] for i in items]
    b = ScoreBatch(P, C, sampled_mask(C), rows=rows)
    hint = lambda row, p: p[:-3] + p                  # a different (longer) prompt, same response tokens
    priv, plain = PrivilegedTeacher(m, tok, hint).score(b), ModelTeacher(m, tok).score(b)
    assert priv.shape == plain.shape and (priv.logits[b.mask] - plain.logits[b.mask]).abs().max() > 1e-3
    short = min(range(2), key=lambda i: len(C[i]))
    mask = sampled_mask(C)
    mask[short, len(C[short])] = True          # the student scores a padding position too
    bad = ScoreBatch(P, C, mask, rows=rows)
    with pytest.raises(ValueError, match="tokens per row"):
        PrivilegedTeacher(m, tok, hint).score(bad)


def test_value_weighted_jsd_equals_a_per_token_reference():
    "value_weight w: (Σ_rest JSD + w·Σ_value JSD) / n against full logits token by token; w = 1 is the plain token mean."
    from latent_rl.gkd import gkd_loss, dataset_completion, value_mask
    from latent_rl.policy import Policy
    from latent_rl.teachers import ModelTeacher, ScoreBatch
    from latent_rl.policy import sampled_mask
    from latent_rl.tokens import trace_token_ids
    from latent_rl.trace import ARG_SEP, FRAME_SEP
    stu, teacher = Policy.load(ROOT / "data" / "notrace"), ModelTeacher.load(TEACHER)
    items = [dataset_completion(stu.tok, r, "text") for r in rows_of(ROWS)[:3]]
    C = [x["completion"] for x in items]
    ids = trace_token_ids(stu.tok)
    vm = value_mask(C, ids[ARG_SEP], ids[FRAME_SEP])
    for x, v in zip(C, vm):                                   # the value: between <|arg_sep|> and its <|frame_sep|>
        txt = stu.tok.decode([t for t, keep in zip(x, v.tolist()) if keep])
        assert txt and ARG_SEP not in txt and txt.count(FRAME_SEP) == stu.tok.decode(x).count(ARG_SEP), txt
    N, P = vm.shape[1], [x["prompt"] for x in items]
    mask = sampled_mask(C, None, N)
    tout = teacher.score(ScoreBatch(P, C, mask, [[]] * 3, [x["row"] for x in items]))
    with torch.no_grad():
        h, _ = stu.hidden(P, C)
        s = torch.log_softmax(stu.head.logits(h).double(), -1)                           # [B, N, V]
        t = torch.log_softmax(tout.logits.double(), -1)
        mix = torch.logsumexp(torch.stack([t + math.log(0.5), s + math.log(0.5)]), 0)
        per = 0.5 * (t.exp() * (t - mix)).sum(-1) + 0.5 * (s.exp() * (s - mix)).sum(-1)  # [B, N] JSD_0.5
    for w in (1.0, 7.0):
        loss, m = gkd_loss(stu, teacher, items, beta=0.5, teacher_out=tout, value_weight=w)
        ref = (per[mask & ~vm].sum() + w * per[vm & mask].sum()) / mask.sum()
        assert abs(loss.item() - ref.item()) < 1e-5, (w, loss.item(), ref.item())
        assert (
            abs(m["jsd_value"] - per[vm & mask].mean().item()) < 1e-5 and m["value_tokens"] == (vm & mask).sum().item()
        )
        assert abs(m["jsd_rest"] - per[mask & ~vm].mean().item()) < 1e-5


def test_true_locals_teacher_reads_the_real_state_and_trains(tmp_path, latent_student):
    """teacher_locals = true: on dataset completions the explicit-trace teacher reads the real trace token for token (its
    hidden states equal one plain forward over prompt + trace), and GKD on it lowers its own JSD; refused for a text
    student (no blocks to fill)."""
    from latent_rl.teachers import ExplicitTraceTeacher, ScoreBatch, explicit_fill
    from latent_rl.gkd import dataset_completion
    from latent_rl.models import load_model, backbone
    from latent_rl.tokens import encode
    m, tok = load_model(TEACHER)
    rows = rows_of(ROWS)[:3]
    items = [dataset_completion(tok, r, "latent") for r in rows]
    P, C, LA = ([x[k] for x in items] for k in ("prompt", "completion", "latent_at"))
    t = ExplicitTraceTeacher(m, tok, locals="true")
    h, seqs = explicit_fill(m, t.spec, P, C, LA, pad_id=tok.pad_token_id,
                            given=t.given(ScoreBatch(P, C, None, LA, rows)))
    for b, (p, r) in enumerate(zip(P, rows)):
        trace = encode(tok, r["trace"])
        assert seqs[b] == p + trace
        with torch.no_grad(): full = backbone(m)(input_ids=torch.tensor([seqs[b]])).last_hidden_state[0]   # [L, H]
        keep = [len(p) - 1 + j for j in range(len(trace)) if j not in _locals_at(trace, t.spec)]    # before each kept token
        assert len(keep) == len(C[b]) and (h[b, :len(C[b])] - full[keep]).abs().max() < 1e-4
    # 24 steps: the last four's JSD is 0.32-0.42 of the first four's with projectors of seeds 0-2 (12 steps: 0.64-0.71)
    gkd(tmp_path, "--model", latent_student, "--steps", 24, "--lmbda", 0, "--lr", 1e-3, "--warmup", 0,
        "--teacher_locals", "true", "--batch_size", 4)
    jsd = [r["jsd_loss"] for r in steps_of(tmp_path)]
    assert sum(jsd[-4:]) < 0.6 * sum(jsd[:4]), jsd
    r = gkd(tmp_path / "text", "--teacher_locals", "true", "--steps", 1, check=False)
    assert r.returncode != 0 and "teacher_locals" in r.stderr


def _locals_at(trace: list[int], spec) -> set[int]:
    "Positions of the locals tokens of each LINE frame (after <|line_sep|>, before the next <|action_sep|>)."
    out, inside = set(), False
    for j, x in enumerate(trace):
        if x == spec.action_sep_id: inside = False
        elif inside: out.add(j)
        if x == spec.line_sep_id: inside = True
    return out


def _pull_back(tmp_path, flip=None, monkeypatch=None, steps=16):
    """GKD through the real stage and loop, always on-policy: the shipped teacher's weights with seeded noise (σ 0.05)
    as the student, that teacher as the teacher (a target it can reach exactly); the per-step JSD of its own samples."""
    from latent_rl import gkd as G
    from latent_rl.engine import setup
    from latent_rl.loop import train_loop
    from latent_rl.policy import Policy
    # the counterfactuals: the loss's sign flipped, or each sample scored by the teacher on another prompt
    if flip == "sign":
        orig = G.gkd_loss
        monkeypatch.setattr(G, "gkd_loss", lambda *a, **k: (lambda l, m: (-l, m))(*orig(*a, **k)))
    elif flip == "shift":
        orig_score = G.GKDStep.score
        monkeypatch.setattr(G.GKDStep, "score", lambda self, items: orig_score(self, items[1:] + items[:1]))
    cfg = G.GKDConfig(model=str(TEACHER), teacher=str(TEACHER), steps=steps, batch_size=8, lmbda=1.0, max_new_tokens=24,
                      max_len=10**6, lr=1e-4, warmup=0, save_every=0, record_every=0, log_every=1,
                      out=str(tmp_path / "run"))
    torch.set_num_threads(1)
    acc, pol = setup(cfg.seed), Policy.load(cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pol.module.parameters(): p.add_(0.05 * torch.randn(p.shape, generator=g))
    data = [G.dataset_completion(pol.tok, r, "text") for r in rows_of(ROWS)[:256]]
    train_loop(G.GKDStep(cfg, acc, pol, G.make_teacher(cfg, pol, acc), data), progress=False)
    return [r["jsd_loss"] for r in steps_of(tmp_path / "run")]


def test_on_policy_gkd_pulls_a_student_to_a_teacher_it_can_reach(tmp_path):
    "The JSD of the student's own samples falls to under a quarter of its start within 16 steps."
    J = _pull_back(tmp_path)
    assert sum(J[-5:]) / 5 < 0.25 * sum(J[:3]) / 3, J


@pytest.mark.parametrize("flip", ["sign", "shift"])
def test_gkd_with_a_wrong_signal_does_not_learn(tmp_path, flip, monkeypatch):
    """The same run with the loss's sign flipped, or each sample's teacher scores from another prompt (misaligned), does
    not bring the student's JSD down."""
    J = _pull_back(tmp_path, flip, monkeypatch)
    assert sum(J[-5:]) / 5 > 0.5 * sum(J[:3]) / 3, J
