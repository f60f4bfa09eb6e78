"""The lean one-position path (`latent_rl.lean`, issue 50) against the backbone's full call, on every hub family's
fixture (GPT-2, Llama-3, Qwen2.5, Qwen3) in float64: hidden states, the keys and values it appends, gradients (with
LoRA adapters too); then the decoders and the CODI objective that use it, lean on against lean off."""
import contextlib, json

import pytest, torch

from conftest import ROOT
from latent_rl.fixtures import fixture_config, fixture_tokenizer, fixture_texts
from latent_rl.lean import lean_kind, lean_off, one_step
from latent_rl.models import add_lora, backbone, copy_cache, out_cache

FAMILIES = {"gpt2": "gpt2", "llama3": "rope", "qwen2.5": "rope", "qwen3": "rope"}


@pytest.fixture(scope="module")
def texts():
    lines = (ROOT / "data" / "corpus" / "train.jsonl").read_text().splitlines()[:40]
    return fixture_texts([json.loads(line) for line in lines])


def _model(family, texts, lora=False):
    from transformers import AutoModelForCausalLM
    tok = fixture_tokenizer(family, texts, 300)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(fixture_config(family, tok)).double()
    if lora:
        m = add_lora(m, 4, targets="c_attn,c_proj,c_fc" if family == "gpt2" else "q_proj,k_proj,v_proj,o_proj,up_proj")
        for n, p in m.named_parameters():                     # adapters that do something (B starts at zero)
            if "lora_B" in n: torch.nn.init.normal_(p, std=0.02)
    return m


def _prefix(body, B=3, L=6, V=200):
    "A left-padded prompt batch run through the full call: ids, mask, positions, cache."
    torch.manual_seed(1)
    ids = torch.randint(5, V, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, 3] = 0                                            # a hole, as a row that left mid-block leaves
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(): cache = out_cache(body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True))
    return ids, mask, pos, cache


def _step(body, cache, mask, pos, lean, **inp):
    with contextlib.nullcontext() if lean else lean_off():
        c = copy_cache(cache)
        return one_step(body, c, torch.cat([mask, torch.ones(len(mask), 1, dtype=torch.long)], 1), pos[:, -1] + 1,
                        **inp), c


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_step_equals_the_full_call(family, texts):
    body = backbone(_model(family, texts)).eval()
    assert lean_kind(body) == FAMILIES[family]
    ids, mask, pos, cache = _prefix(body)
    z = torch.randn(3, body.config.hidden_size, dtype=torch.float64)
    for inp in (dict(embeds=z), dict(ids=ids[:, -1])):
        (h1, c1), (h2, c2) = _step(body, cache, mask, pos, True, **inp), _step(body, cache, mask, pos, False, **inp)
        assert (h1 - h2).abs().max() < 1e-12, (h1 - h2).abs().max()
        for a, b in zip(c1.layers, c2.layers):
            assert a.keys.shape == b.keys.shape and (a.keys - b.keys).abs().max() < 1e-12
            assert (a.values - b.values).abs().max() < 1e-12


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
@pytest.mark.parametrize("lora", [False, True])
def test_one_step_gradients_equal_the_full_call(family, lora, texts):
    "Gradients of every parameter (LoRA adapters included) and of the input vector, lean against full."
    model = _model(family, texts, lora)
    body = backbone(model).eval()
    ids, mask, pos, cache = _prefix(body)
    grads = []
    for lean in (True, False):
        model.zero_grad()
        z = torch.randn(3, body.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        z.requires_grad_(True)
        h, _ = _step(body, cache, mask, pos, lean, embeds=z)
        h.pow(2).sum().backward()
        grads.append([z.grad] + [p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 1
    for a, b in zip(*grads): assert (a - b).abs().max() < 1e-10


def test_unknown_or_unsafe_models_take_the_full_call(texts):
    body = backbone(_model("qwen2.5", texts))
    body.train()
    body.config.attention_dropout = 0.1
    assert lean_kind(body) is None                            # dropout on: the full call
    body.eval()
    assert lean_kind(body) == "rope"
    with lean_off():                                          # and the full call gives the same (tested above)
        ids, mask, pos, cache = _prefix(body)
        h, c = _step(body, cache, mask, pos, True, ids=ids[:, -1])
        assert c.layers[0].keys.shape[-2] == 7


def test_decoders_and_codi_are_unchanged_by_the_lean_path():
    "Greedy text and latent rollouts (tokens, logprobs, latent positions) and the CODI losses and gradients are the"
    "same with the lean path on and off (the tiny model, 3 latent steps: every latent step a one-position call)."
    from latent_rl.generate import generate_latent, generate_text
    from latent_rl.latent import CodiOptions, LatentModel, LatentSpec
    from latent_rl.objective import codi_forward
    from latent_rl.models import build_tiny, load_tokenizer
    from latent_rl.tokens import codi_example, encode
    from latent_rl.trace import prompt_text
    tok = load_tokenizer(ROOT / "data" / "tokenizer")
    lm = LatentModel(build_tiny(tok, "tiny", seed=0, dtype="fp64"), LatentSpec.from_tokenizer(tok, 3))
    rows = [json.loads(line) for line in (ROOT / "data" / "corpus" / "train.jsonl").read_text().splitlines()[:6]]
    P = [encode(tok, prompt_text(r["code"], r["input"])) for r in rows]
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, max_new_tokens=40)
    exs = [e for e in (codi_example(tok, r, 384) for r in rows) if e]
    out = {}
    for lean in (True, False):
        with contextlib.nullcontext() if lean else lean_off():
            t = generate_text(lm.model, P, **kw)
            la = generate_latent(lm, P, forced=[e["trace_ids"][:40] for e in exs], **kw)
            lm.zero_grad()
            c = codi_forward(lm, exs, CodiOptions())
            c.loss.backward()
            g = torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None])
        out[lean] = (t, la, c.loss.detach(), g)
    (t1, l1, c1, g1), (t2, l2, c2, g2) = out[True], out[False]
    assert t1.completion_ids == t2.completion_ids and l1.completion_ids == l2.completion_ids
    assert l1.latent_at == l2.latent_at and t1.forward_passes == t2.forward_passes
    for a, b in ((t1.logprobs, t2.logprobs), (l1.logprobs, l2.logprobs)):
        assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < 1e-9
    assert abs(c1 - c2) < 1e-12 and (g1 - g2).abs().max() < 1e-10


def test_call_costs_reports_both_paths():
    "`bench codi`/`bench grpo`'s per-call table: one position plain and lean, L positions plain; no timed assert."
    from latent_rl.bench import call_costs
    from latent_rl.latent import LatentModel, LatentSpec
    from latent_rl.models import build_tiny, load_tokenizer
    tok = load_tokenizer(ROOT / "data" / "tokenizer")
    lm = LatentModel(build_tiny(tok, "nano", seed=0), LatentSpec.from_tokenizer(tok, 1))
    for grad in (True, False):
        rows = call_costs(lm, B=2, T=8, L=4, reps=2, grad=grad)
        assert [(r["call"], r["path"]) for r in rows] == [("1 position", "lean"), ("1 position", "plain"),
                                                          ("4 positions", "plain")]
        assert all(r["us_per_call"] > 0 for r in rows) and rows[0]["call_in_positions"] is not None


@pytest.mark.parametrize("heads,groups", [(4, 2), (8, 2), (6, 3), (4, 4), (12, 1)])
@pytest.mark.parametrize("T", [1, 9, 40])
def test_packed_attend_equals_attend(heads, groups, T, monkeypatch):
    """CUDA's form of one position's attention (`packed_attend`: each group's query heads on the query axis, an
    additive mask) against the CPU's (`_attend`: boolean mask, `enable_gqa`), with left padding and a hole: to float32
    rounding, and in bfloat16 within bfloat16's. SDPA is called in the packed form: `[B, g, h/g, d]`, a float mask."""
    import torch.nn.functional as F
    from latent_rl.lean import _attend, additive_mask, packed_attend
    g = torch.Generator().manual_seed(heads * 100 + T)
    q, k, v = torch.randn(3, heads, 1, 16, generator=g), *torch.randn(2, 3, groups, T, 16, generator=g).unbind(0)
    keep = torch.ones(3, 1, 1, T, dtype=torch.bool)
    keep[0, ..., :T // 2] = False                                               # left padding
    keep[2, ..., (T - 1) // 2] = T == 1                                          # a hole (none where T = 1)
    want = _attend(q, k, v, keep, 0.3)
    for mask in (keep, additive_mask(keep, torch.float32)):
        got = packed_attend(q, k, v, mask, 0.3)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-6, (got - want).abs().max()
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    ref = _attend(q.double(), k.double(), v.double(), keep, 0.3)
    got, cpu = packed_attend(qb, kb, vb, keep, 0.3).double(), _attend(qb, kb, vb, keep, 0.3).double()
    assert (got - ref).abs().max() <= 2 * (cpu - ref).abs().max() + 2e-2 and (got - cpu).abs().max() <= 3e-2
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: (calls.append((a[0].shape, kw)), sdpa(*a, **kw))[1])
    packed_attend(qb, kb, vb, keep, 0.3)
    (shape, kw), = calls
    assert shape == (3, groups, heads // groups, 16) and kw["attn_mask"].dtype == torch.bfloat16 and "enable_gqa" not in kw


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_step_in_the_packed_form_equals_the_full_call(family, texts, monkeypatch):
    "Every layer's attention in CUDA's packed form (forced on the CPU): one step still equals the full call."
    import latent_rl.lean as lean
    body = backbone(_model(family, texts)).eval()
    ids, mask, pos, cache = _prefix(body)
    (h2, c2) = _step(body, cache, mask, pos, False, ids=ids[:, -1])
    monkeypatch.setattr(lean, "_attend", lambda q, k, v, keep, scale: lean.packed_attend(
        q, k, v, lean.additive_mask(keep, q.dtype), scale))
    (h1, c1) = _step(body, cache, mask, pos, True, ids=ids[:, -1])
    assert (h1 - h2).abs().max() < 1e-12, (h1 - h2).abs().max()
    assert all((a.values - b.values).abs().max() < 1e-12 for a, b in zip(c1.layers, c2.layers))
