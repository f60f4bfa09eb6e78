"""Issue 69: DDP searches each forward's autograd graph for unused parameters (`find_unused_parameters`) only where a
pass can leave a trainable parameter without a gradient (`latent_rl.engine.find_unused`). Each stage's loss runs on a
tiny model, edge cases included: where the engine says no pass can, every trainable parameter has a gradient after
backward (a wrong "no search" would stop a DDP run); where it says one can, such a pass is shown."""
import json
import pytest
import torch
from conftest import ROWS, TEACHER

from latent_rl.engine import find_unused
from latent_rl.models import load_tokenizer, build_tiny, add_lora
from latent_rl.tokens import sft_example, codi_example, trace_token_ids
from latent_rl.latent import LatentModel, LatentSpec, CodiOptions
from latent_rl.objective import codi_forward
from latent_rl.policy import Policy
from latent_rl.losses import TeacherOutput
from latent_rl.sft import SFTConfig, sft_batch_loss
from latent_rl.codi import CodiConfig
from latent_rl.gkd import GKDConfig, gkd_loss, dataset_completion
from latent_rl.grpo import GRPOConfig, grpo_micro_loss


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TEACHER)


@pytest.fixture(scope="module")
def rows(tok):
    "Three short traced rows (a CODI example each)."
    out = []
    for line in open(ROWS):
        r = json.loads(line)
        if codi_example(tok, r, 256) is not None: out.append(r)
        if len(out) == 3: return out


def text_model(tok, lora=False, tied=True, seed=0):
    "A nano model; `lora`: adapters, and the trace tokens' rows trained as deltas (what `load_model` marks on a hub model)."
    torch.manual_seed(seed)
    m = build_tiny(tok, "nano", seed=seed, tie_word_embeddings=tied)
    if lora:
        m.latent_rl_new_rows = sorted(trace_token_ids(tok).values())
        add_lora(m, 4, 8.0, seed=seed)
    return m


def latent_model(tok, **kw):
    return LatentModel(text_model(tok, **kw), LatentSpec.from_tokenizer(tok))


def unused(module, loss) -> list[str]:
    "The trainable parameters of `module` still without a gradient after `loss.backward()`."
    loss.backward()
    return [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]


LORA = dict(lora=True, tied=False)    # adapters, and row deltas in both the embedding and the (untied) head


@pytest.mark.parametrize("kw", [dict(), LORA], ids=["full", "lora-rows"])
def test_sft_uses_every_trainable_parameter(tok, rows, kw):
    m = text_model(tok, **kw)
    assert find_unused(m, SFTConfig()) is False
    exs = [sft_example(tok, rows[0], "trace", 400), sft_example(tok, rows[1], "answer", 400)]
    assert unused(m, sft_batch_loss(m, exs, tok.pad_token_id)[0]) == []


CODI = {
    "plain": (dict(), CodiOptions()),
    "lora-rows": (LORA, CodiOptions(single_anchor=True)),
    "forced-blocks": (dict(), CodiOptions(value_kd=1.0, latent_teacher_forcing=1.0)),   # every prj(h) replaced by a token
    "frozen-teacher-logit": (dict(frozen=True), CodiOptions(kd_target="logit", student_ce=0.0)),
}


@pytest.mark.parametrize("case", list(CODI))
def test_codi_uses_every_trainable_parameter(tok, rows, case):
    kw, opts = CODI[case]
    lm = latent_model(tok, **{k: v for k, v in kw.items() if k != "frozen"})
    teacher = text_model(tok, seed=1).eval().requires_grad_(False) if kw.get("frozen") else None
    assert find_unused(lm, CodiConfig()) is False
    exs = [codi_example(tok, r, 256) for r in rows[:2]]
    out = codi_forward(lm, exs, opts, teacher=teacher, generator=torch.Generator().manual_seed(0))
    assert unused(lm, out.loss) == []


def test_a_soft_token_codi_student_never_runs_its_projector(tok, rows):
    lm = latent_model(tok)
    lm.spec.soft_temp = 0.5
    assert find_unused(lm, CodiConfig()) is True
    left = unused(lm, codi_forward(lm, [codi_example(tok, r, 256) for r in rows]).loss)
    assert left and all(n.startswith("prj.") for n in left)       # the search is needed: the projector has no gradient


def gkd_items(tok, rows, kind, blocks=True):
    items = [dataset_completion(tok, r, kind) for r in rows[:2]]
    return items if blocks else [dict(it, latent_at=[]) for it in items]   # a replay without any latent block


def teacher_of(items, V, topk):
    N = max(len(it["completion"]) for it in items)
    logits = torch.randn(len(items), N, V, generator=torch.Generator().manual_seed(0))
    return TeacherOutput.topk_from_logits(logits, 4) if topk else TeacherOutput(logits=logits)


@pytest.mark.parametrize("kw,topk", [(dict(), True), (LORA, False)], ids=["topk-tail", "lora-rows"])
def test_gkd_text_student_uses_every_trainable_parameter(tok, rows, kw, topk):
    m = text_model(tok, **kw)
    pol = Policy(m, tok)
    assert find_unused(m, GKDConfig()) is False
    items = gkd_items(tok, rows, "text")
    loss, _ = gkd_loss(pol, None, items, teacher_out=teacher_of(items, pol.head_weight.shape[0], topk), tail=topk,
                       sft_alpha=0.5, value_weight=2.0)
    assert unused(m, loss) == []


@pytest.mark.parametrize("blocks", [True, False])
def test_gkd_latent_student_without_a_block_leaves_its_projector(tok, rows, blocks):
    lm = latent_model(tok)
    assert find_unused(lm, GKDConfig()) is True
    items = gkd_items(tok, rows, "latent", blocks)
    loss, _ = gkd_loss(Policy(lm, tok), None, items, teacher_out=teacher_of(items, lm.head_weight.shape[0], False))
    left = unused(lm, loss)
    assert left == [] if blocks else (left and all(n.startswith("prj.") for n in left))


def grpo_samples(tok, rows, kind, adv, eos_only=False, blocks=True):
    "One group per row of `rows[:2]`: its dataset completion (or a lone EOS) twice, with advantages `adv`."
    out = []
    for r in rows[:2]:
        it = gkd_items(tok, [r], kind, blocks)[0]
        c, la = ([tok.eos_token_id], []) if eos_only else (it["completion"], it["latent_at"])
        out += [dict(prompt=it["prompt"], completion=c, latent_at=la, logp_inf=[-1.0] * len(c), adv=a) for a in adv]
    return out


@pytest.mark.parametrize("kw,case", [(dict(), "mixed"), (dict(), "eos-only"), (LORA, "zero-advantage")],
                         ids=["mixed", "eos-only", "lora-rows-zero-advantage"])
def test_grpo_text_policy_uses_every_trainable_parameter(tok, rows, kw, case):
    m = text_model(tok, **kw)
    assert find_unused(m, GRPOConfig()) is False
    adv = [0.0, 0.0] if case == "zero-advantage" else [1.0, -1.0]
    smp = grpo_samples(tok, rows, "text", adv, eos_only=case == "eos-only")
    loss, _ = grpo_micro_loss(Policy(m, tok), smp, norm="token" if case == "eos-only" else "sequence")
    assert unused(m, loss) == []


@pytest.mark.parametrize("blocks", [True, False])
def test_grpo_latent_policy_without_a_block_leaves_its_projector(tok, rows, blocks):
    lm = latent_model(tok)
    assert find_unused(lm, GRPOConfig()) is True
    loss, _ = grpo_micro_loss(Policy(lm, tok), grpo_samples(tok, rows, "latent", [0.0, 0.0], blocks=blocks))
    left = unused(lm, loss)
    assert left == [] if blocks else (left and all(n.startswith("prj.") for n in left))
