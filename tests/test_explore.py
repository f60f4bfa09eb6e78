"""Exploration inside the latent blocks (`latent-rl grpo --explore`): every family replays its rollouts exactly (the
ratio is 1 at a generation's first step), on the project's latent student and on a hub-shaped model loaded by its hub
name; a rollout's code is a pure function of its key (batch- and process-independent); each family raises a reachable
reward through the real stage and fails with the advantage's sign flipped; a text policy or a truncated replay
refuses a code family in one line."""
import pytest, torch
from conftest import ROWS, TEACHER, rows_of, steps_of
from test_grpo import grpo, _learn

FAMILIES = {"tokens": 0.0, "gaussian": 0.3, "svp": 1.0, "dropout": 0.3, "gumbel": 1.0}   # each family's scale here
CODES = ["svp", "dropout", "gumbel"]                                       # the families drawn from a rollout's key
SOFT = 0.5                                                                 # the soft-token students' τ (gumbel's)


@pytest.fixture(scope="module")
def soft_student(tmp_path_factory):
    "The shipped teacher as a soft-token latent model (τ 0.5; a seeded, unused projector): gumbel's student."
    from latent_rl.latent import LatentModel
    d = tmp_path_factory.mktemp("soft")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm, tok = LatentModel.load(TEACHER)
    lm.spec.soft_temp = SOFT
    return lm.save(d / "student", tok)

def _student(request, fam):
    return request.getfixturevalue("soft_student" if fam == "gumbel" else "latent_student")


def _explorer(path, fam):
    from latent_rl.grpo import GRPOConfig, set_exploration
    from latent_rl.policy import Policy
    pol = Policy.load(path)
    set_exploration(GRPOConfig(explore=fam, explore_scale=FAMILIES[fam], temperature=1.0), pol)
    return pol

def _samples(pol, P, keys, ro):
    out = [{"prompt": p, "completion": c, "latent_at": la, "logp_inf": lp, "adv": 1.0, "key": k}
           for p, c, la, lp, k in zip(P, ro.completion_ids, ro.latent_at, ro.logprobs, keys)]
    if pol.stochastic:
        for x, z, d in zip(out, ro.latents, ro.latent_logprobs): x.update(latents=z, latent_lp=d)
    return out


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_family_replays_its_rollouts_exactly(fam, request):
    """At a generation's first step the trainer's logprobs equal the rollout's (≤ 1e-4; the densities too for gaussian),
    ratio 1; a row sampled alone is the row sampled in the batch. Replayed under other keys, a code family's logprobs
    move: the code is what the replay reproduces."""
    from latent_rl.grpo import grpo_micro_loss
    from latent_rl.generate import row_key
    from latent_rl.trace import prompt_text
    from latent_rl.tokens import encode
    pol = _explorer(_student(request, fam), fam)
    P = [encode(pol.tok, prompt_text(r["code"], r["input"])) for r in rows_of(ROWS)[:6] for _ in range(2)]
    keys = [row_key(7, 0, b // 2, b % 2) for b in range(len(P))]
    ro = pol.sample(P, max_new_tokens=120, temperature=1.0, keys=keys, return_latents=pol.stochastic,
                    latent_noise=pol.stochastic)
    assert sum(map(len, ro.latent_at)) > 0                                      # blocks ran, and are replayed
    _, m = grpo_micro_loss(pol, _samples(pol, P, keys, ro), temperature=1.0)
    assert m["align_abs_max"] <= 1e-4 and abs(m["ratio_mean"] - 1) < 1e-5, m
    if fam == "gaussian": assert m["latent_align_abs_max"] <= 1e-4 and abs(m["latent_ratio_mean"] - 1) < 1e-5
    one = pol.sample(P[3:4], max_new_tokens=120, temperature=1.0, keys=keys[3:4], return_latents=pol.stochastic,
                     latent_noise=pol.stochastic)
    assert one.completion_ids[0] == ro.completion_ids[3]
    if fam in CODES:
        _, m2 = grpo_micro_loss(pol, [dict(x, key=x["key"] + 1) for x in _samples(pol, P, keys, ro)], temperature=1.0)
        assert m2["align_abs_max"] > 1e-3, m2["align_abs_max"]


@pytest.mark.parametrize("fam", CODES)
def test_codes_change_what_a_group_computes(fam, request):
    """One prompt, greedy text (T → 0 leaves the tokens nothing to explore): the group's eight codes feed eight
    different latents, where the unperturbed policy feeds one."""
    from latent_rl.generate import generate_latent, row_key
    from latent_rl.trace import prompt_text
    from latent_rl.tokens import encode
    pol = _explorer(_student(request, fam), fam)
    r = rows_of(ROWS)[0]
    P, keys = [encode(pol.tok, prompt_text(r["code"], r["input"]))] * 8, [row_key(3, 0, 0, j) for j in range(8)]
    kw = dict(eos_id=pol.eos_id, pad_id=pol.pad_id, max_new_tokens=60, temperature=1e-4, keys=keys, return_latents=True)
    with torch.no_grad():
        coded = generate_latent(pol.model, P, codes=pol.codes(keys), **kw)
        plain = generate_latent(pol.model, P, **kw)
    first = lambda ro: {tuple(z[0, 0].round(decimals=4).tolist()) for z in ro.latents if len(z)}
    assert len(first(plain)) == 1 and len(first(coded)) == 8


def test_a_hub_named_model_replays_its_codes(tmp_path):
    """A Llama-3-shaped latent model (BOS before every text, untied head), published under its hub name in a local
    Hugging Face cache and loaded by that name: forced rollouts through a block under svp, dropout and gumbel codes
    (soft tokens, τ 0.5), and with gaussian latents (their densities too), replay to 1e-5."""
    import huggingface_hub.constants as hc
    from unittest import mock
    from latent_rl.fixtures import build_fixture, fixture_texts, publish
    from latent_rl.latent import LatentModel
    from latent_rl.generate import generate_latent, row_key
    from latent_rl.policy import Policy
    from latent_rl.tokens import prompt_ids
    from latent_rl.trace import row_prompt
    rows = rows_of(ROWS)[:4]
    base = build_fixture("llama3-instruct", tmp_path / "base", fixture_texts(rows_of(ROWS)[:200]))
    lm, tok = LatentModel.load(base)
    name, cache = "meta-llama/Llama-3.2-1B-Instruct", tmp_path / "hub"
    publish(lm.init_projector_to_embeddings().save(tmp_path / "latent", tok), name, cache)
    with mock.patch.object(hc, "HF_HUB_CACHE", str(cache)), mock.patch.object(hc, "HF_HUB_OFFLINE", True):
        pol = Policy.load(name)
    assert pol.kind == "latent"
    sp = pol.model.spec
    P = [prompt_ids(pol.tok, row_prompt(r)) for r in rows]
    assert all(p[0] == pol.tok.bos_token_id for p in P)
    forced = [[7, sp.line_sep_id, sp.action_sep_id, 9, 11, pol.eos_id]] * len(P)
    keys = [row_key(1, b) for b in range(len(P))]
    for fam in CODES:
        pol.model.spec.soft_temp = SOFT if fam == "gumbel" else 0.0
        pol.model.set_explore(fam, FAMILIES[fam])
        with torch.no_grad():
            ro = generate_latent(pol.model, P, eos_id=pol.eos_id, pad_id=pol.pad_id, forced=forced, temperature=1.0,
                                 keys=keys, codes=pol.codes(keys))
            lp, _ = pol.logprobs(P, ro.completion_ids, ro.latent_at, keys=keys)
            other, _ = pol.logprobs(P, ro.completion_ids, ro.latent_at, keys=[k + 1 for k in keys])
        ref = torch.tensor(ro.logprobs)
        assert ro.latent_at == [[1]] * len(P) and (lp - ref).abs().max() < 1e-5, (fam, (lp - ref).abs().max())
        assert (other - ref).abs().max() > 1e-4                       # the tokens after the block felt the code
    pol.model.spec.soft_temp, pol.model.explore = 0.0, None             # gaussian: sampled latents and their densities
    pol.model.set_noise(FAMILIES["gaussian"])
    with torch.no_grad():
        ro = generate_latent(pol.model, P, eos_id=pol.eos_id, pad_id=pol.pad_id, forced=forced, temperature=1.0,
                             keys=keys, return_latents=True, noise=pol.model.noise)
        lp, ld, lmask = pol.sampled_logprobs(P, ro.completion_ids, ro.latent_at, ro.latents)
    d = torch.tensor([x for row in ro.latent_logprobs for x in row])
    assert d.numel() == len(P) * sp.latent_steps and (ld[lmask] - d).abs().max() < 1e-5
    assert (lp - torch.tensor(ro.logprobs)).abs().max() < 1e-5


@pytest.mark.parametrize("fam", CODES)
def test_code_family_raises_a_reachable_reward(tmp_path, fam, latent_student):
    """test_grpo's reachable reward with a code per rollout (the stage's real loop, ratio over the text tokens): ≤ 0.3
    at the first step, ≥ 0.8 over the last three of 16."""
    R = _learn(tmp_path, "latent", latent_student, 16, cfg_kw={"explore": fam, "explore_scale": FAMILIES[fam]},
               soft_temp=SOFT if fam == "gumbel" else 0.0)
    s = steps_of(tmp_path / "run")
    assert R[0] <= 0.3 and sum(R[-3:]) / 3 >= 0.8, R
    assert s[0]["align_abs_max"] <= 1e-4


@pytest.mark.parametrize("fam", CODES)
def test_code_family_with_the_sign_flipped_does_not_learn(tmp_path, fam, latent_student, monkeypatch):
    "The same runs with the advantages' sign flipped stay low: the signal's sign, not the noise, raises the reward."
    R = _learn(tmp_path, "latent", latent_student, 16, "sign", monkeypatch,
               cfg_kw={"explore": fam, "explore_scale": FAMILIES[fam]}, soft_temp=SOFT if fam == "gumbel" else 0.0)
    assert sum(R[-3:]) / 3 <= 0.3, R


def test_explore_refusals(tmp_path, latent_student):
    """A code family on a text policy, with a truncated replay, at a scale out of range, or gumbel on a projector's
    latents: one line, exit 2."""
    for model, extra, msg in (
        (TEACHER, ["--explore", "svp", "--explore_scale", 1], "text policy has no latent vectors"),
        (latent_student, ["--explore", "dropout", "--explore_scale", 1.5], "in (0, 1)"),
        (latent_student, ["--explore", "svp", "--explore_scale", 1, "--replay", "truncated"], "use replay=exact"),
        (latent_student, ["--explore", "gumbel", "--explore_scale", 1], "soft-token latents"),
    ):
        p = grpo(tmp_path / "r", "--model", model, "--steps", 1, *extra, check=False)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr[-800:]


def test_grpo_cli_explore_records_each_rollouts_key(tmp_path, latent_student):
    "`--explore svp` through the CLI: ratio 1 at the first step, each recorded rollout with its key, no code saved."
    grpo(tmp_path, "--model", latent_student, "--steps", 2, "--explore", "svp", "--explore_scale", 1.0,
         "--record_every", 1, "--temperature", 1.0, "--lr", 1e-4)
    s = steps_of(tmp_path)
    assert len(s) == 2 and s[0]["align_abs_max"] <= 1e-4
    ro = rows_of(tmp_path / "rollouts.jsonl")
    keys = [x["key"] for x in ro[0]["samples"]]
    assert len(set(keys)) == len(keys) == 4
    from latent_rl.latent import LatentModel
    lm, _ = LatentModel.load(tmp_path / "final")
    assert lm.explore is None                                  # exploration is the stage's, not the model's
