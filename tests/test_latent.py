"""The batched multi-span CODI forward against a per-example reference written to multi-codi's algorithm (yile-liu/multi-codi train_codi.py):
one example at a time, 3 + latent_steps model calls per span, a DynamicCache, full logits."""
import itertools
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, AutoModelForCausalLM

from latent_rl.latent import LatentModel, LatentSpec, CodiOptions
from latent_rl.objective import codi_forward
from latent_rl.student import Execution
from latent_rl.models import cache_kw, out_cache
from latent_rl.reference import ref_forward     # the per-example reference (multi-codi's algorithm): the oracle

V, LS, LE, LSEP, ASEP, EOT = 48, 40, 41, 42, 43, 44

def tiny(seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg).float()

def make_example(rng, n_spans, prompt_len):
    "A synthetic trace: code tokens, then per span <line_sep> locals <action_sep> code, ending with EOT."
    P = [rng.randrange(1, 30) for _ in range(prompt_len)]
    T, spans = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 4))], []
    for _ in range(n_spans):
        i = len(T)
        T.append(LSEP)
        T += [rng.randrange(1, 30) for _ in range(rng.randrange(1, 5))]
        j = len(T)
        T.append(ASEP)
        T += [rng.randrange(1, 30) for _ in range(rng.randrange(1, 4))]
        spans.append((i, j))
    T.append(EOT)
    return {"prompt_ids": P, "trace_ids": T, "spans": spans}

def batch(seed=0):
    import random
    rng = random.Random(seed)
    return [make_example(rng, n, p) for n, p in ((1, 5), (3, 3), (2, 7), (1, 2))]

# ---------------------------------------------------------------- the per-example reference (seed semantics)
# ---------------------------------------------------------------- equivalence
CASES = [
    dict(steps=s, kd=kd, frozen=fr, single=sa)
    for s, kd, fr, sa in itertools.product((1, 3), ("hidden", "logit"), (False, True), (False, True))
]

@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"steps{c['steps']}-{c['kd']}-{'frozen' if c['frozen'] else 'shared'}-{'single' if c['single'] else 'all'}"
    ),
)
@pytest.mark.parametrize("call_cost,tail_cost", [(None, None), (0.0, None), (None, 0.0)], ids=["lockstep", "groups", "tails"])
def test_batched_equals_reference(case, call_cost, tail_cost):
    base = tiny(0)
    spec = LatentSpec(LS, LE, LSEP, ASEP, latent_steps=case["steps"])
    lm = LatentModel(base, spec)
    teacher = tiny(1).eval().requires_grad_(False) if case["frozen"] else None
    opts = CodiOptions(kd_target=case["kd"], single_anchor=case["single"], anchor_kd=2.0)
    exs = batch(0)
    out = codi_forward(lm, exs, opts, teacher=teacher, how=Execution(call_cost, tail_cost))
    gb = torch.autograd.grad(out.loss, [p for p in lm.parameters()], allow_unused=True)
    ref_loss, ref_m = ref_forward(lm, exs, opts, teacher)
    gr = torch.autograd.grad(ref_loss, [p for p in lm.parameters()], allow_unused=True)
    assert abs(out.loss.item() - ref_loss.item()) < 1e-5, (out.loss.item(), ref_loss.item())
    for k in ("student_loss", "kd_loss", "teacher_loss"): assert abs(out.metrics[k] - ref_m[k]) < 1e-5, k
    K = max(len(e["spans"]) for e in exs)
    # the last step of a block rides in the next call
    if call_cost is None and tail_cost is None: assert out.metrics["model_calls"] == K * case["steps"] + 1
    # groups: no padding
    elif call_cost is not None:
        assert out.metrics["model_calls"] > K * case["steps"] + 1 and out.metrics["pad_ratio"] < 1.01
    else:   # tails: the rows ending in a phase run their rest apart, in more calls and fewer positions
        lock = codi_forward(lm, exs, opts, teacher=teacher)
        assert out.metrics["model_calls"] >= lock.metrics["model_calls"]
        assert out.metrics["pad_ratio"] <= lock.metrics["pad_ratio"]
    for a, b in zip(gb, gr):
        if a is None and b is None: continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert (a - b).norm() <= 1e-4 * max(b.norm(), 1e-8) + 1e-7, ((a - b).norm(), b.norm())

@pytest.mark.parametrize("depths", [(2, 3), (4, 6)])                    # (student, frozen teacher) layers
@pytest.mark.parametrize("kd_layers", [None, (-1,), (1, -1)])
def test_frozen_teacher_of_another_depth_is_distilled_at_its_own_layers(kd_layers, depths):
    lm = LatentModel(tiny(0, layers=depths[0]), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=1))
    teacher = tiny(1, layers=depths[1]).eval().requires_grad_(False)    # deeper than the student
    opts, exs = CodiOptions(anchor_kd=2.0, kd_layers=",".join(map(str, kd_layers or ()))), batch(0)
    out = codi_forward(lm, exs, opts, teacher=teacher, return_states=True)
    ref_loss, ref_m = ref_forward(lm, exs, opts, teacher)
    assert abs(out.loss.item() - ref_loss.item()) < 1e-5 and abs(out.metrics["kd_loss"] - ref_m["kd_loss"]) < 1e-5
    e = exs[0]
    full = torch.tensor(e["prompt_ids"] + e["trace_ids"])[None]
    hs = teacher(input_ids=full, output_hidden_states=True).hidden_states
    want = (-1,) if kd_layers is None else kd_layers                       # resolved on the teacher's own layers
    pos = len(e["prompt_ids"]) + e["spans"][0][1]
    for i, l in enumerate(want): assert torch.allclose(out.teacher_states[0, 0, i], hs[l][0, pos], atol=1e-6)
    with pytest.raises(ValueError, match="out of range"):             # a layer past the student's own
        codi_forward(lm, exs, CodiOptions(kd_layers=str(depths[0] + 1)), teacher=teacher)

def test_scheduled_sampling_equals_reference():
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2))
    exs = batch(3)
    K = max(len(e["spans"]) for e in exs)
    coins = torch.zeros(len(exs), K + 1, dtype=torch.bool)
    coins[0, 1] = coins[1, 2] = coins[1, 3] = coins[2, 1] = True
    opts = CodiOptions(scheduled_sampling=0.5)
    out = codi_forward(lm, exs, opts, ss_coins=coins)
    ref_loss, _ = ref_forward(lm, exs, opts, None, coins=coins)   # coins[b, k]: text segment k of example b
    assert abs(out.loss.item() - ref_loss.item()) < 1e-5
    grouped = codi_forward(lm, exs, opts, ss_coins=coins, how=Execution(groups=0.0))
    assert abs(grouped.loss.item() - ref_loss.item()) < 1e-5
    tails = codi_forward(lm, exs, opts, ss_coins=coins, how=Execution(tails=0.0))
    assert abs(tails.loss.item() - ref_loss.item()) < 1e-5
    plain = codi_forward(lm, exs, CodiOptions())
    assert abs(plain.loss.item() - out.loss.item()) > 1e-6   # the coins did change the student's inputs

@pytest.mark.parametrize("steps", [1, 2])
def test_long_last_phases_run_apart_and_equal_reference(steps):
    "A one-span row whose last phase is long (the rest of its trace): with `tail_cost` it runs that rest in calls of"
    "its own, after the rows that go on have their latent block; the losses and gradients stay the reference's."
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=steps))
    exs = batch(0)
    exs[0] = {**exs[0], "trace_ids": exs[0]["trace_ids"][:-1] + [7] * 20 + [EOT]}
    exs[3] = {**exs[3], "trace_ids": exs[3]["trace_ids"][:-1] + [9] * 9 + [EOT]}
    opts = CodiOptions(anchor_kd=2.0)
    lock, tails = codi_forward(lm, exs, opts), codi_forward(lm, exs, opts, how=Execution(tails=0.0))
    ref_loss, _ = ref_forward(lm, exs, opts, None)
    assert abs(tails.loss.item() - ref_loss.item()) < 1e-5 and abs(lock.loss.item() - ref_loss.item()) < 1e-5
    assert tails.metrics["model_calls"] == lock.metrics["model_calls"] + 2            # the two tails, one chunk each
    assert tails.metrics["pad_ratio"] < lock.metrics["pad_ratio"]
    params = list(lm.parameters())
    gt = torch.autograd.grad(tails.loss, params, allow_unused=True)
    gr = torch.autograd.grad(ref_loss, params, allow_unused=True)
    for a, b in zip(gt, gr):
        if a is None or b is None: continue
        assert (a - b).norm() <= 1e-4 * max(b.norm(), 1e-8) + 1e-7

def test_padding_does_not_change_an_example():
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2))
    exs = batch(5)
    one = codi_forward(lm, exs[1:2], CodiOptions(), return_logprobs=True)
    allb = codi_forward(lm, exs, CodiOptions(), return_logprobs=True)
    a, b = one.trace_logprobs[0], allb.trace_logprobs[1, :one.trace_logprobs.shape[1]]
    ok = ~torch.isnan(a)
    assert torch.equal(ok, ~torch.isnan(b)) and (a[ok] - b[ok]).abs().max() < 1e-5

def test_save_load_roundtrip(tmp_path):
    from latent_rl.tokens import train_tokenizer
    from latent_rl.trace import trace_inprocess, prompt_text
    from latent_rl.models import build_tiny
    tr = trace_inprocess("def f(x):\n    y = x + 1\n    return y", "2")
    tok = train_tokenizer([prompt_text("def f(x):\n    y = x + 1\n    return y", "2") + tr.trace] * 5, vocab_size=300)
    lm = LatentModel(build_tiny(tok, "nano"), LatentSpec.from_tokenizer(tok, 2))
    lm.save(tmp_path / "m", tok)
    lm2, tok2 = LatentModel.load(tmp_path / "m")
    assert lm2.spec == lm.spec
    for (n, p), (_, q) in zip(lm.state_dict().items(), lm2.state_dict().items()): assert torch.equal(p, q), n
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "m")   # a normal HF model directory

# ---------------------------------------------------------------- latent decoding vs the training forward
def student_format(ex):
    "Drop each span's locals: the text a latent policy writes; spans become (i, i+1)."
    T, out, spans, prev = ex["trace_ids"], [], [], 0
    for i, j in ex["spans"]:
        out += T[prev:i + 1]
        spans.append((len(out) - 1, len(out)))
        prev = j
    out += T[prev:]
    return {"prompt_ids": ex["prompt_ids"], "trace_ids": out, "spans": spans}

@pytest.mark.parametrize("steps", [1, 3])
def test_latent_decoding_reproduces_training_logprobs(steps):
    from latent_rl.generate import generate_latent
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=steps)).eval()
    exs = [student_format(e) for e in batch(7)]
    fwd = codi_forward(lm, exs, CodiOptions(), return_logprobs=True)
    ro = generate_latent(lm, [e["prompt_ids"] for e in exs], eos_id=EOT, pad_id=0, forced=[e["trace_ids"] for e in exs],
                         max_new_tokens=200)
    for b, e in enumerate(exs):
        assert ro.completion_ids[b] == e["trace_ids"]
        assert ro.latent_at[b] == [i for i, _ in e["spans"]]
        ref = fwd.trace_logprobs[b, :len(e["trace_ids"])]
        assert not torch.isnan(ref).any()
        assert (torch.tensor(ro.logprobs[b]) - ref).abs().max() <= 1e-4

def test_latent_decoding_free_runs_and_respects_limits():
    from latent_rl.generate import generate_latent
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2)).eval()
    # make <line_sep> likely so latent blocks actually happen
    with torch.no_grad(): lm.model.lm_head.weight[LSEP] += 0.5 * lm.model.lm_head.weight.mean(0)
    prompts = [e["prompt_ids"] for e in batch(1)]
    g = torch.Generator().manual_seed(0)
    ro = generate_latent(lm, prompts, eos_id=EOT, pad_id=0, max_new_tokens=30, temperature=1.0, generator=g)
    assert all(len(c) <= 30 for c in ro.completion_ids)
    assert any(ro.latent_at), "no latent block ran: the test would check nothing"
    for c, l in zip(ro.completion_ids, ro.latent_at):
        assert all(c[i] == LSEP and (i + 1 == len(c) or c[i + 1] == ASEP) for i in l)
    ro2 = generate_latent(lm, prompts, eos_id=EOT, pad_id=0, max_new_tokens=30, max_forward_passes=5)
    assert ro2.forward_passes <= 5

def test_kd_norm_std_divides_each_layer_loss_by_teacher_std():
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=1))
    exs = batch(2)
    a = codi_forward(lm, exs, CodiOptions())
    b = codi_forward(lm, exs, CodiOptions(kd_norm_std=True))
    from latent_rl.objective import teacher_pass
    t_anc = teacher_pass(lm, exs, a.layers).anchors
    std = t_anc[a.kd_valid].std(dim=(0, 2))                                    # per layer
    assert torch.allclose(b.kd_dist * std[None, None, :], a.kd_dist, atol=1e-6)
    assert b.metrics["student_loss"] == pytest.approx(a.metrics["student_loss"])

def test_sliding_window_models_are_refused():
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    lm = LatentModel(AutoModelForCausalLM.from_config(cfg), LatentSpec(LS, LE, LSEP, ASEP))
    with pytest.raises(ValueError, match="sliding"):
        codi_forward(lm, batch(0), CodiOptions())

def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2)).train()
    exs = batch(4)
    a = codi_forward(lm, exs, CodiOptions())
    ga = torch.autograd.grad(a.loss, list(lm.parameters()), allow_unused=True)
    b = codi_forward(lm, exs, CodiOptions(teacher_checkpointing=True))
    gb = torch.autograd.grad(b.loss, list(lm.parameters()), allow_unused=True)
    assert abs(a.loss.item() - b.loss.item()) < 1e-6
    for x, y in zip(ga, gb):
        if x is not None: assert torch.allclose(x, y, atol=1e-6)
    assert not lm.model.is_gradient_checkpointing     # switched off again for the cached student calls

# ---------------------------------------------------------------- the latent objectives against a per-example reference
from latent_rl.losses import state_kd_loss, embed_kd_loss

def with_targets(ex, rng):
    """Synthetic CWM-like targets: value tokens inside each span's dropped locals (or none), answer tokens after the
    last block."""
    e = dict(ex)
    e["value_tok"] = [
        list(range(i + 1, min(j, i + 1 + rng.randrange(1, 4)))) if rng.random() < 0.8 else [] for i, j in ex["spans"]
    ]
    last = ex["spans"][-1][1]
    e["answer_tok"] = sorted(rng.sample(range(last + 1, len(ex["trace_ids"])), min(2, len(ex["trace_ids"]) - last - 1)))
    e["recon_ids"] = [[rng.randrange(1, 30) for _ in range(rng.randrange(1, 5))] for _ in ex["spans"]]
    return e

def ref_objectives(lm, examples, opts, teacher=None, coins=None):
    "The value/answer/recon terms and the answer-weighted student CE, one example at a time (multi-codi's call pattern)."
    model, prj, S = lm.model, lm.prj, lm.spec.latent_steps
    body, emb = model.model, model.get_input_embeddings()
    E, tmodel = emb.weight, teacher if teacher is not None else model
    sv, tv, sa, ta, rec_lp, ces = [], [], [], [], [], []
    for bi, ex in enumerate(examples):
        prompt, trace = torch.tensor(ex["prompt_ids"]), torch.tensor(ex["trace_ids"])
        with torch.no_grad():
            ths = tmodel(input_ids=torch.cat([prompt, trace])[None], output_hidden_states=True).hidden_states
        T_at = lambda p: torch.stack([h[0, len(prompt) + p] for h in ths])              # [L+1, H]
        o = model(inputs_embeds=emb(prompt[None]), use_cache=True)
        cache, prev = out_cache(o), o.logits[:, -1]
        segs, pv = [], 0
        for k, (i, j) in enumerate(ex["spans"]):
            segs.append(("text", pv, i + 1))
            segs.append(("latent", k, None))
            pv = j
        segs.append(("text", pv, len(trace)))
        lps, ws = [], []
        for kind, a, b in segs:
            if kind == "latent":
                o = body(
                    inputs_embeds=emb(torch.tensor([[lm.spec.latent_start_id]])), use_cache=True,
                    **cache_kw(body, cache),
                )
                cache, h = out_cache(o), o.last_hidden_state[:, -1:]
                zs, hs = [], []
                vt = ex["value_tok"][a]
                for q in range(S):
                    z = prj(h)
                    if coins is not None and coins[bi, a] and vt and q >= 1:   # latent teacher forcing
                        z = emb(trace[min(vt[0] - 1 + q, len(trace) - 1)])[None, None]
                    zs.append(z[0, 0])
                    o = body(inputs_embeds=z, use_cache=True, output_hidden_states=True, **cache_kw(body, cache))
                    cache, h = out_cache(o), o.last_hidden_state[:, -1:]
                    hs.append(torch.stack([x[0, 0] for x in o.hidden_states]))
                vt = ex["value_tok"][a]
                if vt and opts.value_kd_at == "predict":
                    sv.append((1, hs[-1]))
                    tv.append(T_at(vt[0] - 1))
                if vt and opts.value_kd_at == "sequence":
                    for q in range(S):
                        sv.append((1 if q == 0 else 0, hs[q]))
                        tv.append(T_at(min(vt[0] - 1 + q, len(trace) - 1)))
                if vt and opts.value_kd_at == "tokens":
                    for q in range(min(S, len(vt))):
                        sv.append((0, hs[q]))
                        tv.append(T_at(vt[q]))
                if vt and opts.value_kd_at == "embed":
                    for q in range(S):
                        sv.append((0, zs[q]))
                        tv.append(E[trace[vt[q] if q < len(vt) else min(vt[-1] + 1, len(trace) - 1)]])
                dec = torch.cat(
                    [
                        emb(torch.tensor([lm.spec.latent_start_id])), torch.stack(zs),
                        emb(torch.tensor([lm.spec.latent_end_id])),
                        emb(torch.tensor(ex["recon_ids"][a] + [lm.spec.action_sep_id])),
                    ]
                )[None]
                dl = model(inputs_embeds=dec).logits[0, S + 1:-1]
                rec_lp.append(
                    F.log_softmax(dl, -1).gather(
                        -1, torch.tensor(ex["recon_ids"][a] + [lm.spec.action_sep_id])[:, None]
                    )
                )
                o = body(
                    inputs_embeds=emb(torch.tensor([[lm.spec.latent_end_id]])), use_cache=True, **cache_kw(body, cache)
                )
                cache, prev = out_cache(o), model.lm_head(o.last_hidden_state[:, -1])
                continue
            ids = trace[a:b]
            lps.append(F.log_softmax(prev, -1)[0, ids[0]][None])
            ws.append(a)
            o = model(inputs_embeds=emb(ids[None]), use_cache=True, output_hidden_states=True, **cache_kw(model, cache))
            cache = out_cache(o)
            if len(ids) > 1:
                lps.append(F.log_softmax(o.logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0])
                ws.extend(range(a + 1, b))
                for t in ex["answer_tok"]:
                    if a < t < b:
                        sa.append(torch.stack([x[0, t - 1 - a] for x in o.hidden_states]))
                        ta.append(T_at(t - 1))
            prev = o.logits[:, -1]
        w = torch.tensor([opts.answer_weight if t in ex["answer_tok"] else 1.0 for t in ws])
        ces.append(-(torch.cat(lps) * w).sum() / w.sum())
    out = {"student_loss": torch.stack(ces).mean()}
    if opts.value_kd:
        if opts.value_kd_at == "embed":
            out["value_kd_loss"] = embed_kd_loss(
                torch.stack([x for _, x in sv]), torch.stack(tv), (E.detach().norm(dim=-1) ** 2).mean()
            )[0]
        else:  # one state_kd_loss per first layer (0: embeddings included, 1: not), averaged
            parts = [
                state_kd_loss(
                    torch.stack([x for f, x in sv if f == g])[:, g:],
                    torch.stack([t for (f, _), t in zip(sv, tv) if f == g])[:, g:],
                )[0]
                for g in (0, 1)
                if any(f == g for f, _ in sv)
            ]
            out["value_kd_loss"] = sum(parts) / len(parts)
    if opts.answer_kd: out["answer_kd_loss"] = state_kd_loss(torch.stack(sa)[:, 1:], torch.stack(ta)[:, 1:])[0]
    if opts.recon: out["recon_loss"] = -torch.cat(rec_lp).mean()
    return out

OBJ = [dict(value_kd=1.0, value_kd_at=m) for m in ("sequence", "predict", "tokens", "embed")] + [
    dict(answer_kd=1.0), dict(answer_weight=4.0), dict(recon=1.0),
]

@pytest.mark.parametrize("call_cost", [None, 0.0], ids=["lockstep", "groups"])
@pytest.mark.parametrize("steps", [2, 3])
def test_latent_teacher_forcing_equals_reference(steps, call_cost):
    import random
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=steps))
    exs = [with_targets(e, random.Random(5)) for e in batch(6)]
    opts = CodiOptions(anchor_kd=0.0, teacher_ce=0.0, latent_teacher_forcing=0.5, value_kd=1.0)
    out = codi_forward(lm, exs, opts, tf_generator=torch.Generator().manual_seed(3), how=Execution(groups=call_cost))
    coins = torch.rand(len(exs), max(len(e["spans"]) for e in exs), generator=torch.Generator().manual_seed(3)) < 0.5
    assert coins.any() and not coins.all()
    ref = ref_objectives(lm, exs, opts, coins=coins)
    for k in ("student_loss", "value_kd_loss"):
        assert abs(out.metrics[k] - ref[k].item()) < 1e-5 * max(1, abs(ref[k].item())), k
    free = codi_forward(lm, exs, CodiOptions(anchor_kd=0.0, teacher_ce=0.0, value_kd=1.0))
    # forcing changed what the text read
    assert abs(free.metrics["student_loss"] - out.metrics["student_loss"]) > 1e-4

@pytest.mark.parametrize("call_cost,tail_cost", [(None, None), (0.0, None), (None, 0.0)], ids=["lockstep", "groups", "tails"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("obj", OBJ, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_latent_objectives_equal_reference(obj, steps, call_cost, tail_cost):
    import random
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=steps))
    rng = random.Random(11)
    exs = [with_targets(e, rng) for e in batch(6)]
    opts = CodiOptions(anchor_kd=0.0, teacher_ce=0.0, **obj)                                    # only the student CE and the new term
    out = codi_forward(lm, exs, opts, how=Execution(call_cost, tail_cost))
    ref = ref_objectives(lm, exs, opts)
    name = next(k for k in ref if k != "student_loss") if len(ref) > 1 else "student_loss"
    assert abs(out.metrics["student_loss"] - ref["student_loss"].item()) < 1e-5
    assert abs(out.metrics[name] - ref[name].item()) < 1e-5 * max(1.0, abs(ref[name].item())), (
        out.metrics[name],
        ref[name].item(),
    )
    params = [p for p in lm.parameters()]
    ref_total = (
        opts.student_ce * ref["student_loss"]
        + (getattr(opts, name.replace("_loss", ""), 0.0) if name != "student_loss" else 0.0) * ref[name]
    )
    gb = torch.autograd.grad(out.loss, params, allow_unused=True)
    gr = torch.autograd.grad(ref_total, params, allow_unused=True)
    for a, b in zip(gb, gr):
        if a is None and b is None: continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert (a - b).norm() <= 1e-4 * max(b.norm(), 1e-8) + 1e-7, ((a - b).norm(), b.norm())

def test_objectives_refuse_examples_without_targets():
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP))
    with pytest.raises(ValueError, match="targets=True"): codi_forward(lm, batch(0), CodiOptions(value_kd=1.0))

def test_gpt2_codi_equals_reference():
    "GPT-2 (the published GSM8k-Aug and multiplication recipes' model): learned absolute positions, Conv1D layers, a"
    "`transformer` backbone; the batched forward, lockstep and in phase groups, equals the per-example reference, and"
    "its LoRA targets (c_attn, c_proj, c_fc) take adapters."
    from transformers import GPT2Config
    from latent_rl.models import add_lora
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    lm = LatentModel(AutoModelForCausalLM.from_config(cfg).float(), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2))
    exs, opts = batch(7), CodiOptions(anchor_kd=2.0)
    ref_loss, _ = ref_forward(lm, exs, opts)
    for cc in (None, 0.0):
        assert abs(codi_forward(lm, exs, opts, how=Execution(groups=cc)).loss.item() - ref_loss.item()) < 1e-5
    add_lora(lm.model, 4, 8.0, "c_attn,c_proj,c_fc")
    trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    codi_forward(lm, exs, opts).loss.backward()
    assert all(p.grad is not None for n, p in lm.model.named_parameters() if p.requires_grad)

@pytest.mark.parametrize("call_cost,tail_cost", [(None, None), (0.0, None), (None, 0.0)], ids=["lockstep", "groups", "tails"])
@pytest.mark.parametrize("obj", [dict(), dict(answer_kd=1.0), dict(value_kd=1.0), dict(scheduled_sampling=0.5)], ids=str)
def test_phase0_from_the_teacher_equals_running_it(obj, call_cost, tail_cost):
    """`share_prefix` (the default): the student's phase 0 — the prompt and the text before the first block — is the
    shared-weight teacher's, cache, states and graph; the loss and gradients are those of running it again, and only
    `<|latent_start|>` runs (an answer token inside phase 0 exercises the states taken from the teacher)."""
    import random
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2))
    exs = [with_targets(e, random.Random(2)) for e in batch(3)]
    exs = [{**e, "answer_tok": [0] + e["answer_tok"]} for e in exs]
    opts, params = CodiOptions(**obj), list(lm.parameters())
    coins = torch.rand(len(exs), 4, generator=torch.Generator().manual_seed(0)) < 0.5
    run = lambda share: codi_forward(lm, exs, opts, how=Execution(call_cost, tail_cost, share),
                                     ss_coins=coins if opts.scheduled_sampling else None)
    a, b = run(True), run(False)
    assert abs(a.loss.item() - b.loss.item()) < 1e-5 and a.metrics["model_calls"] == b.metrics["model_calls"]
    for k in a.metrics:
        if k not in ("pad_ratio", "loss"): assert abs(a.metrics[k] - b.metrics[k]) < 1e-5, k
    for x, y in zip(torch.autograd.grad(a.loss, params, allow_unused=True),
                    torch.autograd.grad(b.loss, params, allow_unused=True)):
        assert (x is None) == (y is None)
        if x is not None: assert (x - y).norm() <= 1e-4 * max(y.norm(), 1e-8) + 1e-7, ((x - y).norm(), y.norm())

def test_phase0_is_run_when_the_teacher_is_frozen_or_checkpointed():
    """No shared pass to take phase 0 from (a frozen teacher, a recomputed one): the student runs it (same result:
    test_batched_equals_reference, test_gradient_checkpointing_gives_the_same_loss_and_gradients)."""
    lm, exs = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP)), batch(0)
    from latent_rl.objective import teacher_pass
    assert teacher_pass(lm, exs, [-1], keep_prefix=True).prefix is not None
    assert teacher_pass(lm, exs, [-1], teacher=tiny(1).eval(), keep_prefix=True).prefix is None
    lm.train()
    assert teacher_pass(lm, exs, [-1], checkpointing=True, keep_prefix=True).prefix is None

@pytest.mark.parametrize("soft_temp", [0.0, 0.5], ids=["projector", "soft-tokens"])
@pytest.mark.parametrize("call_cost,tail_cost", [(None, None), (0.0, None), (None, 0.0)], ids=["lockstep", "groups", "tails"])
def test_codi_steps_lower_the_codi_loss(call_cost, tail_cost, soft_temp):
    """CODI trains, on every path and with either latent mode (the projector's vectors, or soft tokens): Adam steps on
    `codi_forward`'s loss (a batch mixing 1–3 spans, the phase 0 taken from the teacher's pass) lower it; the same
    steps on the loss's negative raise it, so a wrong sign would show."""
    def run(sign):
        lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2, soft_temp=soft_temp))
        opt, exs, losses = torch.optim.Adam(lm.parameters(), lr=3e-3), batch(0), []
        for _ in range(12):
            out = codi_forward(lm, exs, CodiOptions(), how=Execution(call_cost, tail_cost))
            (sign * out.loss).backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        return losses
    down, up = run(1.0), run(-1.0)
    assert down[-1] < 0.8 * down[0] and up[-1] > 1.2 * up[0], (down, up)

@pytest.mark.parametrize("call_cost,tail_cost", [(None, None), (0.0, None), (None, 0.0)], ids=["lockstep", "groups", "tails"])
def test_answer_kd_at_first_distils_where_codi_does(call_cost, tail_cost):
    """`answer_kd_at="first"`: only the states predicting the first token of each RETURN value are distilled (CODI's
    position: the token that predicts the answer), which equals `answer_kd` on examples whose answer tokens are cut to
    the first of each run; its gradient differs from distilling every answer token."""
    import random
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2))
    exs = [with_targets(e, random.Random(7)) for e in batch(6)]
    exs = [{**e, "answer_tok": e["answer_tok"] + [e["answer_tok"][-1] + 1]} if e["answer_tok"]
           and e["answer_tok"][-1] + 1 < len(e["trace_ids"]) else e for e in exs]                # runs of ≥ 2 tokens
    first = [{**e, "answer_tok": [t for t in e["answer_tok"] if t - 1 not in e["answer_tok"]]} for e in exs]
    assert sum(map(len, (e["answer_tok"] for e in first))) < sum(map(len, (e["answer_tok"] for e in exs)))
    run = lambda xs, at: codi_forward(lm, xs, CodiOptions(anchor_kd=0.0, answer_kd=1.0, answer_kd_at=at),
                                      how=Execution(call_cost, tail_cost))
    a, b, every = run(exs, "first"), run(first, "each"), run(exs, "each")
    assert abs(a.loss.item() - b.loss.item()) < 1e-6 and abs(a.metrics["answer_kd_loss"] - b.metrics["answer_kd_loss"]) < 1e-6
    assert abs(a.metrics["answer_kd_loss"] - every.metrics["answer_kd_loss"]) > 1e-6

def test_phase_groups_replay_a_batch_where_some_or_no_row_opened_a_block():
    """A latent policy's replay (phase groups) of completions where no row, or only a later group's rows, opened a
    latent block (GRPO's samples can be all text) equals the lockstep pass; it raised IndexError."""
    from latent_rl.student import grouped_student_pass, student_pass
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2))
    exs = batch(1)
    plain = [{**e, "spans": []} for e in exs]                                                    # no block anywhere
    mixed = [{**e, "spans": []} if k % 2 == 0 else e for k, e in enumerate(exs)]                 # some rows only
    for xs in (plain, mixed):
        a = grouped_student_pass(lm, xs, 0.0, ce=False, return_hidden=True)
        b = student_pass(lm, xs, ce=False, return_hidden=True)
        assert torch.allclose(a.pred_hidden, b.pred_hidden, atol=1e-5)


# ---------------------------------------------------------------- soft-token latents (LatentSpec.soft_temp > 0)
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("call_cost,tail_cost", [(None, None), (0.0, None), (None, 0.0)], ids=["lockstep", "groups", "tails"])
def test_soft_tokens_batched_equal_reference(steps, call_cost, tail_cost):
    """Soft-token blocks (each latent step feeds softmax(logits/τ)·E): the batched CODI forward's loss and gradients
    equal the per-example reference's, which calls the same `project`; the projector gets no gradient."""
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=steps, soft_temp=0.5))
    exs, opts = batch(0), CodiOptions(anchor_kd=2.0)
    out = codi_forward(lm, exs, opts, how=Execution(call_cost, tail_cost))
    ps = list(lm.parameters())
    gb = torch.autograd.grad(out.loss, ps, allow_unused=True)
    ref_loss, _ = ref_forward(lm, exs, opts, None)
    gr = torch.autograd.grad(ref_loss, ps, allow_unused=True)
    assert abs(out.loss.item() - ref_loss.item()) < 1e-5, (out.loss.item(), ref_loss.item())
    for (n, _), a, b in zip(lm.named_parameters(), gb, gr):
        if n.startswith("prj."): assert a is None and b is None, n
        else: assert (a - b).norm() <= 1e-4 * max(b.norm(), 1e-8) + 1e-7, (n, (a - b).norm(), b.norm())
    plain = codi_forward(LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=steps)), exs, opts)
    assert abs(plain.loss.item() - out.loss.item()) > 1e-4              # the blocks feed something else


@pytest.mark.parametrize("steps", [1, 3])
def test_soft_token_decoding_reproduces_training_logprobs(steps):
    "A soft-token student decodes what its training forward scores: forced rollouts' logprobs equal the forward's."
    from latent_rl.generate import generate_latent
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=steps, soft_temp=0.7)).eval()
    exs = [student_format(e) for e in batch(7)]
    fwd = codi_forward(lm, exs, CodiOptions(), return_logprobs=True)
    ro = generate_latent(lm, [e["prompt_ids"] for e in exs], eos_id=EOT, pad_id=0, forced=[e["trace_ids"] for e in exs],
                         max_new_tokens=200)
    for b, e in enumerate(exs):
        assert ro.latent_at[b] == [i for i, _ in e["spans"]]
        assert (torch.tensor(ro.logprobs[b]) - fwd.trace_logprobs[b, :len(e["trace_ids"])]).abs().max() <= 1e-4


def test_soft_tokens_under_lora_mix_the_trained_rows():
    """Under LoRA the trace tokens' rows train as deltas beside the frozen embeddings (`train_rows`): a soft token mixes
    the rows with their deltas (as the model reads them), and the deltas get a gradient through it. A soft-token
    model's Gaussian σ is the embeddings' per-dimension std (it has no projector gain)."""
    from latent_rl.models import add_lora, train_rows
    lm = LatentModel(tiny(0), LatentSpec(LS, LE, LSEP, ASEP, latent_steps=2, soft_temp=0.5))
    add_lora(lm.model, 4, 8.0)
    train_rows(lm.model, [3, 5, 7])
    emb = lm.model.get_input_embeddings()
    with torch.no_grad(): emb.latent_rl_delta.normal_()
    h = torch.randn(2, lm.head_weight.shape[1])
    z = lm.project(h)
    with torch.no_grad():
        E = emb.weight.clone()
        E[[3, 5, 7]] += emb.latent_rl_delta
        p = torch.softmax(lm.head.logits(h).float() / 0.5, -1)
        assert torch.allclose(z, p @ E[: p.shape[-1]], atol=1e-5)
        assert not torch.allclose(z, p @ emb.weight[: p.shape[-1]], atol=1e-3)   # the deltas count
        assert torch.equal(emb(torch.tensor([[5]]))[0, 0], E[5])                  # as the model reads token 5
    z.square().sum().backward()
    assert emb.latent_rl_delta.grad is not None and emb.latent_rl_delta.grad.abs().sum() > 0
    lm.set_noise(0.3)
    assert torch.allclose(lm.noise.log_sigma.exp(), 0.3 * emb.weight[: p.shape[-1]].detach().std(0), atol=1e-6)

def test_soft_temp_is_saved_and_codi_cli_trains_soft_tokens(tmp_path):
    "`latent-rl codi --soft_temp 0.5` writes a student whose spec keeps τ; loaded back, its blocks feed soft tokens."
    from conftest import run_cli, TEACHER, ROWS, steps_of
    run_cli("codi", "--recipe", "none", "--model", TEACHER, "--train", ROWS, "--val", "", "--max_train", 32,
            "--steps", 3, "--batch_size", 4, "--soft_temp", 0.5, "--out", tmp_path / "r", "--log_every", 1, "--save_every", 0)
    lm, _ = LatentModel.load(tmp_path / "r" / "final")
    assert lm.spec.soft_temp == 0.5 and len(steps_of(tmp_path / "r")) == 3
    h = torch.randn(2, lm.head_weight.shape[1])
    with torch.no_grad():
        E = lm.model.get_input_embeddings().weight
        ref = torch.softmax(lm.head.logits(h).float() / 0.5, -1) @ E[: lm.head_weight.shape[0]]
        assert torch.allclose(lm.project(h), ref, atol=1e-5)
