"""Models whose logits are not `h @ W.T`: an LM-head bias (Phi), a logit scale (Cohere, Granite), a soft cap (Gemma 2).
Every path that computes logits from hidden states goes through `latent_rl.models.Head`; each is checked here against
the model's own forward (or, for the kernels, against full logits in float64)."""
import random
import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, PhiConfig, Qwen2Config

from latent_rl.models import Head, lm_head, check_head, backbone
from latent_rl.logprobs import token_logprobs, token_logprobs_checkpointed, logprobs_from_logits, shift_labels
from latent_rl.losses import generalized_jsd, generalized_jsd_from_hidden, sft_loss, TeacherOutput
from latent_rl.teachers import hidden_to_output
from latent_rl.generate import generate_text
from latent_rl.latent import LatentModel, LatentSpec, CodiOptions
from latent_rl.objective import codi_forward
from latent_rl.reference import ref_forward

V = 48
KW = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=0)
HEADS = {
    "phi-bias": (PhiConfig, {}), "cohere-scale": (CohereConfig, dict(logit_scale=0.25)),
    "granite-scale": (GraniteConfig, dict(logits_scaling=4.0)),
    "gemma2-softcap": (Gemma2Config, dict(final_logit_softcapping=2.0)),
}

def model_with(name, seed=0):
    "A tiny model of that family whose head visibly transforms its logits (head weights and bias at unit scale)."
    C, extra = HEADS[name]
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(C(**KW, **extra)).float()
    with torch.no_grad():
        for p in m.get_output_embeddings().parameters(): p.normal_(0, 1)
    return m

def qwen_with_bias(seed=0):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(Qwen2Config(**{**KW, "tie_word_embeddings": False})).float()
    m.lm_head = torch.nn.Linear(32, V, bias=True)
    with torch.no_grad(): m.lm_head.bias.normal_(0, 1)
    return m

# ---------------------------------------------------------------- kernels vs full logits (float64)
CASES = [(1.0, None, True), (0.3, None, False), (1.0, 0.8, False), (2.5, 0.7, True)]

@pytest.mark.parametrize("scale,cap,bias", CASES)
def test_token_logprobs_with_a_full_head(scale, cap, bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g).requires_grad_() if bias else None
    lab = torch.randint(0, 11, (3, 5), generator=g)
    lab[0, :2] = -100
    T, up = torch.tensor([1.0, 0.7, 1.3]), torch.randn(3, 5, dtype=torch.float64, generator=g)
    up[1, 1] = 0.0                                                       # a row without gradient (skipped in backward)
    hd, ps = Head(W, b, scale, cap), [x for x in (h, W, b) if x is not None]
    ref = logprobs_from_logits(hd.logits(h), lab, T)
    gr = torch.autograd.grad((ref * up).sum(), ps)
    for fn in (token_logprobs, token_logprobs_checkpointed):
        out = fn(h, hd, lab, T, chunk_size=4)
        go = torch.autograd.grad((out * up).sum(), ps)
        assert torch.allclose(out, ref, atol=1e-12)
        assert all(torch.allclose(a, c, atol=1e-10) for a, c in zip(go, gr))
    loss, _ = sft_loss(h, hd, lab, chunk_size=4)
    assert torch.allclose(loss, -logprobs_from_logits(hd.logits(h), lab).sum() / (lab != -100).sum(), atol=1e-12)

@pytest.mark.parametrize("scale,cap,bias", CASES)
@pytest.mark.parametrize("kind", ["full", "topk", "topk-tail"])
def test_jsd_from_hidden_with_a_full_head(scale, cap, bias, kind):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(13, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(13, dtype=torch.float64, generator=g).requires_grad_() if bias else None
    zt = torch.randn(2, 4, 13, dtype=torch.float64, generator=g) * 2
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[0, 0] = False
    teacher = TeacherOutput(logits=zt) if kind == "full" else TeacherOutput.topk_from_logits(zt, 4)
    hd, ps = Head(W, b, scale, cap), [x for x in (h, W, b) if x is not None]
    for beta in (0.0, 0.5, 1.0):
        ref, _ = generalized_jsd(hd.logits(h), teacher, mask, beta=beta, temperature=0.9, tail=kind == "topk-tail")
        out, _ = generalized_jsd_from_hidden(
            h, hd, teacher, mask, beta=beta, temperature=0.9, tail=kind == "topk-tail", chunk_size=3
        )
        assert torch.allclose(out, ref, atol=1e-12)
        assert all(
            torch.allclose(a, c, atol=1e-10) for a, c in zip(torch.autograd.grad(out, ps), torch.autograd.grad(ref, ps))
        )

# ---------------------------------------------------------------- real architectures vs their own forward
@pytest.mark.parametrize("name", list(HEADS))
def test_head_paths_match_the_models_own_logits(name):
    m = model_with(name)
    check_head(m, name)
    hd = lm_head(m)
    x = torch.tensor([[5, 9, 2, 17, 30, 8, 3]])
    out = m(input_ids=x)                                                  # the model's own logits
    h = backbone(m)(input_ids=x).last_hidden_state
    assert not torch.allclose(h @ hd.weight.T, out.logits, atol=1e-3)    # plain h @ W.T would be wrong here
    lab = shift_labels(x)
    ref = logprobs_from_logits(out.logits, lab)
    lp = token_logprobs(h, hd, lab, chunk_size=3)
    assert torch.allclose(lp, ref, atol=1e-5)
    # gradients reach the head as through the model
    params = list(m.get_output_embeddings().parameters())
    ga = torch.autograd.grad(lp.sum(), params, retain_graph=True)
    gb = torch.autograd.grad(ref.sum(), params)
    assert all(torch.allclose(a, c, atol=1e-4) for a, c in zip(ga, gb))
    teacher = TeacherOutput(logits=torch.randn_like(out.logits))
    j1, _ = generalized_jsd_from_hidden(h, hd, teacher, beta=0.5)
    j2, _ = generalized_jsd(out.logits, teacher, beta=0.5)
    assert torch.allclose(j1, j2, atol=1e-5)
    full = hidden_to_output(h.detach(), hd, torch.ones_like(x, dtype=torch.bool), None)
    assert torch.allclose(full.logits, out.logits.detach(), atol=1e-5)

@pytest.mark.parametrize("name", ["phi-bias", "gemma2-softcap"])
def test_greedy_decoding_follows_the_models_own_logits(name):
    m = model_with(name).eval()
    x = [5, 9, 2, 17]
    ro = generate_text(m, [x], eos_id=-1, pad_id=0, max_new_tokens=6)
    seq = list(x)
    with torch.no_grad():
        for _ in range(6): seq.append(int(m(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert ro.completion_ids[0] == seq[len(x):]

# ---------------------------------------------------------------- the latent student against multi-codi's algorithm
from test_latent import LS, LE, LSEP, ASEP, make_example   # the same synthetic traces as the other CODI tests

def latent_batch(seed=0):
    rng = random.Random(seed)
    return [make_example(rng, n, p) for n, p in ((1, 5), (3, 3), (2, 7))]

@pytest.mark.parametrize("kd", ["hidden", "logit"])
@pytest.mark.parametrize("name", ["qwen2-bias", "cohere-scale", "granite-scale"])
def test_codi_with_a_full_head_equals_the_reference(name, kd):
    base = qwen_with_bias() if name == "qwen2-bias" else model_with(name)
    check_head(base, name)
    lm = LatentModel(base, LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2))
    opts, exs = CodiOptions(kd_target=kd, anchor_kd=2.0), latent_batch(0)
    out = codi_forward(lm, exs, opts)
    ref, ref_m = ref_forward(lm, exs, opts)
    assert abs(out.loss.item() - ref.item()) < 1e-4 * max(1.0, abs(ref.item())), (out.loss.item(), ref.item())
    for k in ("student_loss", "kd_loss", "teacher_loss"):
        assert out.metrics[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-5), k
    ps = [p for p in lm.parameters()]
    ga = torch.autograd.grad(out.loss, ps, allow_unused=True)
    gr = torch.autograd.grad(ref, ps, allow_unused=True)
    for a, c in zip(ga, gr):
        if a is None and c is None: continue
        a = torch.zeros_like(c) if a is None else a
        c = torch.zeros_like(a) if c is None else c
        assert (a - c).norm() <= 1e-4 * max(c.norm(), 1e-8) + 1e-6
