"GRPO: alignment of replayed and rollout logprobs (text and latent, T 0.7 and 1.0), zero-advantage steps, the stage."
import json
from pathlib import Path
import pytest, torch
from conftest import run_cli, ROOT, TEACHER, ROWS, ONE, rows_of, steps_of


@pytest.mark.parametrize("kind", ["text", "latent"])
@pytest.mark.parametrize("T", [0.7, 1.0])
def test_alignment_at_step_start(kind, T, latent_student):
    from latent_rl.policy import Policy
    from latent_rl.grpo import grpo_micro_loss
    from latent_rl.trace import prompt_text
    from latent_rl.tokens import encode
    pol = Policy.load(TEACHER if kind == "text" else latent_student)
    assert pol.kind == kind
    P = [encode(pol.tok, prompt_text(r["code"], r["input"])) for r in rows_of(ROWS)[:6] for _ in range(2)]
    ro = pol.generate(P, max_new_tokens=160, temperature=T, keys=list(range(len(P))))
    if kind == "latent": assert sum(map(len, ro.latent_at)) > 0            # blocks were inserted and are replayed
    smp = [{"prompt": p, "completion": c, "latent_at": la, "logp_inf": lp, "adv": 1.0}
           for p, c, la, lp in zip(P, ro.completion_ids, ro.latent_at, ro.logprobs)]
    _, m = grpo_micro_loss(pol, smp, temperature=T)
    assert m["align_abs_max"] <= 1e-4, m["align_abs_max"]
    assert m["invalid_inf_logp"] == 0 and abs(m["ratio_mean"] - 1) < 1e-5

def grpo(out, *args, check=True, **kw):
    base = ["grpo", "--model", TEACHER, "--train", ROWS, "--max_train", 64, "--batch_size", 2, "--group_size", 4,
            "--max_new_tokens", 96, "--log_every", 1, "--save_every", 0, "--out", out]
    return run_cli(*base, *map(str, args), check=check, env=ONE, **kw)

def test_zero_advantage_step_changes_no_weight(tmp_path):
    grpo(tmp_path, "--steps", 2, "--rewards", "correct:0", "--lr", 1e-2, "--warmup", 0)
    s = steps_of(tmp_path)
    assert all(r["frac_reward_zero_std"] == 1 and r["loss"] == 0 and r["grad_norm"] == 0 for r in s)
    assert all(v == v for r in s for v in r.values() if isinstance(v, float))            # no NaN anywhere
    from latent_rl.models import load_model
    a, _ = load_model(TEACHER); b, _ = load_model(tmp_path / "final")
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()): assert torch.equal(x, y), k

@pytest.mark.parametrize("kind", ["text", "latent"])
def test_grpo_stage_records(tmp_path, kind, latent_student):
    model = TEACHER if kind == "text" else latent_student
    grpo(tmp_path, "--model", model, "--steps", 2, "--record_every", 1, "--temperature", 0.7)
    s = steps_of(tmp_path)
    assert len(s) == 2 and s[0]["align_abs_max"] <= 1e-4
    for k in ("loss", "grad_norm", "lr", "ratio_mean", "clip_frac_low", "clip_frac_high", "pos_adv_logp", "neg_adv_logp",
              "align_mean", "align_abs_mean", "reward_mean", "frac_reward_zero_std", "gen_s", "train_s", "sync_s", "peak_mem_mb"):
        assert k in s[0], k
    lp, ro = rows_of(tmp_path / "logprobs.jsonl"), rows_of(tmp_path / "rollouts.jsonl")
    assert lp and all(len(r["logp"]) == len(r["logp_inf"]) == len(r["mask"]) == len(r["tokens"]) for r in lp)
    assert ro and len(ro[0]["samples"]) == 4 and {"text", "reward", "adv", "latent_at"} <= set(ro[0]["samples"][0])
    summ = json.loads((tmp_path / "final" / "training_summary.json").read_text())["benchmark"]
    assert 0 < summ["gen_share"] < 1 and summ["rollout_tokens_per_s"] > 0
    if kind == "latent": assert (tmp_path / "final" / "latent_spec.json").exists()

def test_clipping_acts_on_later_steps_of_a_generation_cycle(tmp_path):
    grpo(tmp_path, "--steps", 3, "--steps_per_generation", 3, "--lr", 3e-3, "--warmup", 0, "--temperature", 1.0,
         "--rewards", "format:1,correct:1", "--batch_size", 4, "--max_new_tokens", 320)
    s = steps_of(tmp_path)
    assert s[0]["frac_reward_zero_std"] < 1, "every group had equal rewards: nothing to learn from"
    assert s[0]["align_abs_max"] <= 1e-4 and abs(s[0]["ratio_mean"] - 1) < 1e-4
    assert max(r["align_abs_max"] for r in s[1:]) > 1e-4          # the policy moved inside the cycle: ratio != 1

def test_truncated_replay_aligns_and_trains(tmp_path, latent_student):
    "replay = truncated: recorded latents in two parallel forwards give the rollout's logprobs at step start (1e-4)."
    grpo(tmp_path, "--model", latent_student, "--steps", 2, "--temperature", 0.7, "--replay", "truncated", "--lr", 1e-3)
    s = steps_of(tmp_path)
    assert len(s) == 2 and s[0]["align_abs_max"] <= 1e-4
    assert all(r["grad_norm"] > 0 for r in s if r["frac_reward_zero_std"] < 1)         # a gradient wherever there is signal
