"""The stochastic latent policy (z = μ + σ·ε): rollouts replay exactly with their densities, the latent term of the
GRPO loss pushes μ toward rewarded noise (and away with the sign flipped), and the stage trains with it."""
import pytest, torch
from conftest import ROWS, TEACHER, rows_of, steps_of
from test_grpo import grpo, _learn


def _toy(sigma=0.3, learn=False, steps=1):
    from transformers import Qwen2Config, AutoModelForCausalLM
    from latent_rl.latent import LatentModel, LatentSpec
    from latent_rl.policy import Policy
    class Tok: eos_token_id, pad_token_id = 1, 0
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(
        Qwen2Config(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64,
        )
    )
    lm = (
        LatentModel(m, LatentSpec(90, 91, 80, 81, latent_steps=steps))
        .init_projector_to_embeddings()
        .set_noise(sigma, learn)
    )
    return Policy(lm, Tok())


def test_stochastic_rollout_replays_with_its_densities(latent_student):
    "At step start the trainer's text logprobs and latent log-densities equal the rollout's (≤ 1e-4), ratio 1 for both."
    from latent_rl.policy import Policy
    from latent_rl.grpo import grpo_micro_loss
    from latent_rl.trace import prompt_text
    from latent_rl.tokens import encode
    pol = Policy.load(latent_student)
    pol.model.set_noise(0.3)
    P = [encode(pol.tok, prompt_text(r["code"], r["input"])) for r in rows_of(ROWS)[:6] for _ in range(2)]
    ro = pol.generate(
        P, max_new_tokens=120, temperature=1.0, keys=list(range(len(P))), return_latents=True, latent_noise=True
    )
    assert sum(map(len, ro.latent_logprobs)) > 0
    smp = [
        {"prompt": p, "completion": c, "latent_at": la, "logp_inf": lp, "adv": 1.0, "latents": z, "latent_lp": d}
        for p, c, la, lp, z, d in zip(P, ro.completion_ids, ro.latent_at, ro.logprobs, ro.latents, ro.latent_logprobs)
    ]
    _, m = grpo_micro_loss(pol, smp, temperature=1.0)
    assert m["align_abs_max"] <= 1e-4 and m["latent_align_abs_max"] <= 1e-4, m
    assert abs(m["ratio_mean"] - 1) < 1e-5 and abs(m["latent_ratio_mean"] - 1) < 1e-5


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_latent_term_moves_mu_toward_rewarded_noise(sign):
    """Reward = the sampled ε points along a direction u. One SGD step on the latent term alone moves μ along u, and
    against it when the advantages' sign is flipped: the density term's sign and alignment are what carry the signal."""
    from latent_rl.losses import grpo_loss, group_advantages
    from latent_rl.generate import generate_latent
    pol, G = _toy(), 64
    u = torch.nn.functional.normalize(torch.randn(32), dim=0)
    # one block after index 1, the same text in every sample
    comp = [12, 80, 81, 13, 1]
    greedy = lambda: generate_latent(pol.model, [[5, 6, 7]], eos_id=1, pad_id=0, forced=[comp], return_latents=True,
                                     noise=pol.model.noise).latents[0].reshape(-1)         # temperature 0: μ
    mu0 = greedy()
    ro = generate_latent(pol.model, [[5, 6, 7]] * G, eos_id=1, pad_id=0, forced=[comp] * G, temperature=1.0,
                         keys=list(range(G)), return_latents=True, noise=pol.model.noise)
    Z = torch.stack([z.reshape(-1) for z in ro.latents])                                   # [G, H]
    R = ((Z - mu0) @ u > 0).double()                                                       # [G]
    A, _ = group_advantages(R, G)
    _, ld, lmask = pol.sampled_logprobs(ro.prompt_ids, ro.completion_ids, ro.latent_at, ro.latents)
    li = torch.tensor([d for d in ro.latent_logprobs])                                     # [G, 1]
    loss, m = grpo_loss(ld, li, sign * A.float(), lmask, densities=True)
    assert m["align_abs_max"] <= 1e-4
    loss.backward()
    with torch.no_grad():
        for p in pol.model.prj.parameters(): p -= 3.0 * p.grad
    mu1 = greedy()
    moved = float((mu1 - mu0) @ u)
    assert moved * sign > 0 and abs(moved) > 1e-3 * pol.model.noise.sigma.mean(), moved


def test_grpo_stochastic_latents_raise_a_reachable_reward(tmp_path, latent_student):
    """The reachable reward of test_grpo with stochastic latents (σ = 0.3 of the latents' scale, z replayed as actions):
    ≤ 0.3 at the first step, ≥ 0.8 over the last three of 12 (measured: 0.06 at step 1, 0.97–1.0 from step 8)."""
    R = _learn(tmp_path, "latent", latent_student, 12, cfg_kw={"latent_sigma": 0.3})
    s = steps_of(tmp_path / "run")
    assert R[0] <= 0.3 and sum(R[-3:]) / 3 >= 0.8, R
    assert s[0]["latent_align_abs_max"] <= 1e-4 and all("latent_ratio_mean" in r for r in s)


def test_grpo_cli_stochastic_latents(tmp_path, latent_student):
    "`--latent_sigma` through the CLI: latent metrics per step, σ saved with the model; a text policy refuses it in one line."
    grpo(tmp_path / "s", "--model", latent_student, "--steps", 2, "--latent_sigma", 0.3, "--latent_sigma_learn", "true",
         "--lr", 1e-3)
    s = steps_of(tmp_path / "s")
    assert len(s) == 2 and s[0]["latent_align_abs_max"] <= 1e-4 and s[0]["latent_sigma"] > 0
    assert (tmp_path / "s" / "final" / "latent_noise.pt").exists()
    from latent_rl.latent import LatentModel
    lm, _ = LatentModel.load(tmp_path / "s" / "final")
    assert (
        lm.noise is not None
        and abs(float(lm.noise.sigma.mean()) - s[-1]["latent_sigma"]) < 1e-3 * s[-1]["latent_sigma"] + 1e-6
    )
    p = grpo(tmp_path / "t", "--model", TEACHER, "--steps", 1, "--latent_sigma", 0.3, check=False)
    assert p.returncode == 2 and "text policy has no latent vectors" in p.stderr, p.stderr[-500:]
