"""Acceptance tests for latent_rl.logprobs and latent_rl.losses.

Every loss is checked against a naive reference written here (plain formulas, loops where that is clearer),
on inputs with padding and uneven lengths: values to 1e-6, gradients to 1e-5.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from latent_rl.logprobs import (IGNORE_INDEX, logprobs_from_logits, shift_labels, token_logprobs,
                                token_logprobs_checkpointed)
from latent_rl.bench_losses import losses_bench
from latent_rl.losses import (TeacherOutput, generalized_jsd, generalized_jsd_from_hidden, group_advantages,
                              grpo_loss, anchor_kd_loss, sft_loss)

VAL, GRAD = 1e-6, 1e-5


def close(a, b, tol):
    return torch.allclose(a.double(), b.double(), atol=tol, rtol=0)


# ----------------------------------------------------------------------------------------------- fixtures
def make_batch(dtype=torch.float64, B=3, S=7, H=8, V=23, seed=0):
    "Hidden states, head, bias and aligned labels with left padding, right padding and uneven lengths."
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g, dtype=dtype).requires_grad_()
    W = (torch.randn(V, H, generator=g, dtype=dtype) * 0.7).requires_grad_()
    bias = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :3] = IGNORE_INDEX            # prompt
    labels[1, 5:] = IGNORE_INDEX            # right padding
    labels[2, :1] = IGNORE_INDEX
    labels[2, 4:] = IGNORE_INDEX
    return hidden, W, bias, labels


def ref_logprobs(hidden, W, labels, temps, bias=None):
    "Naive: full logits, per-sample temperature (T<=0 -> 1), log_softmax, pick the label; 0 where ignored."
    out = torch.zeros(labels.shape, dtype=torch.promote_types(hidden.dtype, torch.float32))
    for b in range(labels.shape[0]):
        T = float(temps[b]) if torch.is_tensor(temps) else float(temps)
        T = 1.0 if T <= 0 else T
        for t in range(labels.shape[1]):
            y = int(labels[b, t])
            if y == IGNORE_INDEX: continue
            z = hidden[b, t] @ W.T + (0 if bias is None else bias)
            out = out.index_put((torch.tensor(b), torch.tensor(t)), torch.log_softmax(z / T, -1)[y])
    return out


# ----------------------------------------------------------------------------------------------- label shift
def test_shift_labels_convention():
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]])
    assert shift_labels(ids, mask=mask).tolist() == [[6, 7, 8, -100], [-100, 3, -100, -100]]
    assert shift_labels(ids, mask.bool()).tolist() == [[6, 7, 8, -100], [-100, 3, -100, -100]]
    assert shift_labels(ids, torch.where(mask.bool(), ids, -100)).tolist() == [[6, 7, 8, -100], [-100, 3, -100, -100]]
    with pytest.raises(ValueError):
        shift_labels(ids, ids, mask=mask)


# ----------------------------------------------------------------------------------------------- token logprobs
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_token_logprobs_equals_naive_values_and_grads(chunk):
    hidden, W, bias, labels = make_batch()
    temps = torch.tensor([0.7, 0.0, 1.3])
    g = torch.randn(labels.shape, dtype=torch.float64)
    ref = ref_logprobs(hidden, W, labels, temps, bias)
    ref_g = torch.autograd.grad((ref * g).sum(), (hidden, W, bias))
    out = token_logprobs(hidden, W, labels, temps, chunk_size=chunk, head_bias=bias)
    out_g = torch.autograd.grad((out * g).sum(), (hidden, W, bias))
    assert close(out, ref, VAL)
    assert all(close(a, b, GRAD) for a, b in zip(out_g, ref_g))
    assert (out[labels == IGNORE_INDEX] == 0).all()


def test_token_logprobs_rows_without_gradient_are_skipped_correctly():
    "Rows whose upstream gradient is exactly 0 (zero advantages, clipped tokens) take the compacted backward path."
    hidden, W, bias, labels = make_batch()
    temps = torch.tensor([0.7, 1.0, 1.3])
    g = torch.randn(labels.shape, dtype=torch.float64)
    g[0] = 0
    g[2, 2] = 0
    ref = ref_logprobs(hidden, W, labels, temps, bias)
    ref_g = torch.autograd.grad((ref * g).sum(), (hidden, W, bias))
    out = token_logprobs(hidden, W, labels, temps, chunk_size=2, head_bias=bias)
    out_g = torch.autograd.grad((out * g).sum(), (hidden, W, bias))
    assert all(close(a, b, GRAD) for a, b in zip(out_g, ref_g))
    assert (out_g[0][0] == 0).all()


def test_token_logprobs_fp32_scalar_temperature():
    hidden, W, bias, labels = make_batch(torch.float32)
    ref = ref_logprobs(hidden, W, labels, 0.9)
    ref_g = torch.autograd.grad(ref.sum(), (hidden, W))
    out = token_logprobs(hidden, W, labels, 0.9, chunk_size=4)
    out_g = torch.autograd.grad(out.sum(), (hidden, W))
    assert out.dtype == torch.float32 and close(out, ref, VAL)
    assert all(close(a, b, GRAD) for a, b in zip(out_g, ref_g))


def test_token_logprobs_half_inputs_compute_in_fp32():
    hidden, W, _, labels = make_batch(torch.float32)
    hb, Wb = hidden.detach().bfloat16().requires_grad_(), W.detach().bfloat16().requires_grad_()
    out = token_logprobs(hb, Wb, labels, 1.0, chunk_size=2)
    assert out.dtype == torch.float32
    assert close(out, logprobs_from_logits((hb @ Wb.T).float(), labels), 1e-5)
    out.sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and Wb.grad.dtype == torch.bfloat16 and torch.isfinite(Wb.grad.float()).all()


def test_checkpointed_variant_agrees():
    hidden, W, bias, labels = make_batch()
    a = token_logprobs(hidden, W, labels, 0.8, chunk_size=3, head_bias=bias)
    b = token_logprobs_checkpointed(hidden, W, labels, 0.8, chunk_size=3, head_bias=bias)
    ga = torch.autograd.grad(a.sum(), (hidden, W, bias))
    gb = torch.autograd.grad(b.sum(), (hidden, W, bias))
    assert close(a, b, 1e-12) and all(close(x, y, 1e-10) for x, y in zip(ga, gb))


class MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor): self.max = max(self.max, o.numel())
        return out


def test_no_full_logits_tensor_forward_or_backward():
    V, H = 300, 4
    hidden = torch.randn(4, 20, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (4, 20))
    with MaxNumel() as mode:
        token_logprobs(hidden, W, labels, chunk_size=10).sum().backward()
    assert mode.max <= 10 * V                       # never more than one chunk of logits
    with MaxNumel() as mode:
        generalized_jsd_from_hidden(hidden, W, TeacherOutput(logits=torch.randn(4, 20, V)), chunk_size=10)[0].backward()
    assert mode.max <= 4 * 20 * V                   # the teacher's own input; the student side stays chunked


def test_token_logprobs_rejects_bad_labels():
    hidden, W, _, labels = make_batch()
    labels[0, 5] = 10_000
    with pytest.raises(ValueError):
        token_logprobs(hidden, W, labels)


# ----------------------------------------------------------------------------------------------- SFT
def test_sft_equals_cross_entropy():
    hidden, W, bias, labels = make_batch(torch.float32)
    ref = F.cross_entropy((hidden @ W.T + bias).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_g = torch.autograd.grad(ref, (hidden, W, bias))
    loss, met = sft_loss(hidden, W, labels, chunk_size=5, head_bias=bias)
    out_g = torch.autograd.grad(loss, (hidden, W, bias))
    assert close(loss, ref, VAL) and all(close(a, b, GRAD) for a, b in zip(out_g, ref_g))
    assert met["n_tokens"] == (labels != -100).sum().item()
    empty, _ = sft_loss(hidden, W, torch.full_like(labels, -100))
    assert empty.item() == 0 and not torch.isnan(empty)


# ----------------------------------------------------------------------------------------------- GRPO
def ref_grpo(
    logp, logp_inf, adv, mask, eps_low, eps_high, norm, grad_accum=1, token_count=None, logp_ref=None, kl_beta=0.0
):
    "Token by token (with `kl_beta`: + β·(π_ref/π − log(π_ref/π) − 1), Schulman's k3)."
    seq_means, total, n_all = [], 0.0, 0
    for b in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[b, t]: continue
            r = torch.exp(logp[b, t] - logp_inf[b, t])
            term = -torch.min(r * adv[b], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[b])
            if kl_beta:
                q = torch.exp(logp_ref[b, t] - logp[b, t])
                term = term + kl_beta * (q - torch.log(q) - 1)
            terms.append(term)
        s = torch.stack(terms).sum() if terms else logp.sum() * 0
        seq_means.append(s / max(len(terms), 1))
        total, n_all = total + s, n_all + len(terms)
    if norm == "sequence": return torch.stack(seq_means).mean() / grad_accum
    return total / (token_count if token_count is not None else max(n_all, 1) * grad_accum)


def grpo_batch(seed=0, B=4, S=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, (i, j) in enumerate([(1, 6), (2, 4), (0, 3), (3, 6)][:B]): mask[b, i:j] = True
    logp = (-torch.rand(B, S, generator=g, dtype=dtype) * 3).requires_grad_()
    logp_inf = logp.detach() + 0.3 * torch.randn(B, S, generator=g, dtype=dtype)   # some ratios outside the clip range
    logp_inf = torch.where(mask, logp_inf.clamp(max=0), torch.tensor(1.0, dtype=dtype))   # seed placeholder 1.0
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2], dtype=dtype)[:B]
    return logp, logp_inf, adv, mask


@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_grpo_equals_naive(norm):
    logp, logp_inf, adv, mask = grpo_batch()
    kw = dict(eps_low=0.2, eps_high=0.28)
    ref = ref_grpo(logp, logp_inf, adv, mask, 0.2, 0.28, norm, grad_accum=2)
    (ref_g,) = torch.autograd.grad(ref, logp)
    loss, met = grpo_loss(logp, logp_inf, adv, mask, norm=norm, grad_accum=2, **kw)
    (g,) = torch.autograd.grad(loss, logp)
    assert close(loss, ref, VAL) and close(g, ref_g, GRAD)
    assert met["n_tokens"] == mask.sum().item() and met["masked_placeholders"] == (~mask).sum().item()
    assert met["invalid_inf_logp"] == 0
    d = (logp - logp_inf).detach()[mask]
    assert abs(met["align_mean"] - d.mean().item()) < VAL and abs(met["align_abs_max"] - d.abs().max().item()) < VAL
    assert abs(met["align_abs_mean"] - d.abs().mean().item()) < VAL
    r = torch.exp(d)
    a = adv[:, None].expand_as(mask)[mask]
    assert abs(met["ratio_mean"] - r.mean().item()) < VAL
    assert abs(met["clip_frac_low"] - ((r < 0.8) & (a < 0)).double().mean().item()) < VAL
    assert abs(met["clip_frac_high"] - ((r > 1.28) & (a > 0)).double().mean().item()) < VAL
    lp = logp.detach()
    assert abs(met["pos_adv_logp"] - lp[mask & (adv[:, None] > 0)].mean().item()) < VAL
    assert abs(met["neg_adv_logp"] - lp[mask & (adv[:, None] < 0)].mean().item()) < VAL
    # explicit token_count: sum / count
    tc_loss, _ = grpo_loss(logp, logp_inf, adv, mask, norm="token", token_count=40.0, **kw)
    assert close(tc_loss, ref_grpo(logp, logp_inf, adv, mask, 0.2, 0.28, "token", token_count=40.0), VAL)


@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_grpo_kl_penalty_equals_naive(norm):
    "kl_beta · k3 to a reference policy: value and gradient token by token; k3 >= 0 and exactly 0 where π = π_ref."
    logp, logp_inf, adv, mask = grpo_batch()
    g = torch.Generator().manual_seed(1)
    logp_ref = logp.detach() + 0.5 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    ref = ref_grpo(logp, logp_inf, adv, mask, 0.2, 0.2, norm, logp_ref=logp_ref, kl_beta=0.05)
    (ref_g,) = torch.autograd.grad(ref, logp)
    loss, met = grpo_loss(logp, logp_inf, adv, mask, norm=norm, logp_ref=logp_ref, kl_beta=0.05)
    (gr,) = torch.autograd.grad(loss, logp)
    assert close(loss, ref, VAL) and close(gr, ref_g, GRAD)
    d = (logp_ref - logp.detach())[mask]
    assert abs(met["kl_ref"] - (torch.exp(d) - d - 1).mean().item()) < VAL and met["kl_ref"] > 0
    same, m0 = grpo_loss(logp, logp_inf, adv, mask, norm=norm, logp_ref=logp.detach(), kl_beta=0.05)
    assert m0["kl_ref"] == 0 and close(same, grpo_loss(logp, logp_inf, adv, mask, norm=norm)[0], VAL)
    with pytest.raises(ValueError, match="logp_ref"): grpo_loss(logp, logp_inf, adv, mask, kl_beta=0.1)


def test_grpo_ratio_one_is_policy_gradient():
    logp, _, adv, mask = grpo_batch()
    for norm in ("sequence", "token"):
        loss, met = grpo_loss(logp, logp.detach(), adv, mask, norm=norm)
        (g,) = torch.autograd.grad(loss, logp)
        n = mask.sum(1, keepdim=True) * mask.shape[0] if norm == "sequence" else mask.sum()
        expected = torch.where(mask, -adv[:, None] / n, torch.zeros_like(logp))   # d/dlogp of -A·logp/n
        assert close(g, expected, GRAD) and met["align_abs_max"] == 0 and met["ratio_mean"] == 1
        assert met["clip_frac_low"] == 0 and met["clip_frac_high"] == 0


def test_grpo_clipping_engages_exactly_outside_the_range():
    eps_low, eps_high = 0.2, 0.28
    r = torch.tensor([0.5, 0.79, 0.81, 1.0, 1.27, 1.29, 2.0], dtype=torch.float64)
    logp = torch.full((1, 7), -1.0, dtype=torch.float64, requires_grad=True)
    logp_inf = (logp - torch.log(r)).detach()
    mask = torch.ones(1, 7, dtype=torch.bool)
    for a in (1.0, -1.0):
        loss, met = grpo_loss(logp, logp_inf, torch.tensor([a]), mask, eps_low=eps_low, eps_high=eps_high)
        (g,) = torch.autograd.grad(loss, logp)
        dead = (r > 1 + eps_high) if a > 0 else (r < 1 - eps_low)
        assert ((g[0] == 0) == dead).all(), (a, g)
        assert (g[0][~dead].abs() > 0).all()
        assert abs(met["clip_frac_high"] - (dead.double().mean().item() if a > 0 else 0)) < VAL
        assert abs(met["clip_frac_low"] - (dead.double().mean().item() if a < 0 else 0)) < VAL


def test_grpo_zero_advantages_and_empty_masks_give_no_nan():
    logp, logp_inf, _, mask = grpo_batch()
    bad = torch.where(mask, logp_inf, torch.tensor(float("nan"), dtype=logp.dtype))   # NaN placeholders
    bad[0, 0] = -math.inf
    for norm in ("sequence", "token"):
        loss, met = grpo_loss(logp, bad, torch.zeros(4, dtype=logp.dtype), mask, norm=norm)
        (g,) = torch.autograd.grad(loss, logp)
        assert (
            loss.item() == 0 and (g == 0).all() and not any(math.isnan(v) for v in met.values() if isinstance(v, float))
        )
        empty = torch.zeros_like(mask)
        loss, met = grpo_loss(logp, bad, torch.ones(4, dtype=logp.dtype), empty, norm=norm)
        (g,) = torch.autograd.grad(loss, logp)
        assert (
            loss.item() == 0 and (g == 0).all() and not any(math.isnan(v) for v in met.values() if isinstance(v, float))
        )


def test_grpo_requires_inference_logprobs():
    logp, _, adv, mask = grpo_batch()
    with pytest.raises(ValueError, match="logp_inf"):
        grpo_loss(logp, None, adv, mask)


def test_grpo_masked_placeholders_are_counted():
    logp, logp_inf, adv, mask = grpo_batch()
    _, met = grpo_loss(logp, logp_inf, adv, mask)
    assert met["masked_placeholders"] == (~mask).sum().item() and met["invalid_inf_logp"] == 0
    # an off-by-one alignment: the engine's logprobs shifted by one position puts placeholders on scored tokens
    shifted = torch.roll(logp_inf, 1, dims=1)
    loss, met = grpo_loss(logp, shifted, adv, mask)
    expected = (mask & ~((shifted <= 0) & torch.isfinite(shifted))).sum().item()
    assert met["invalid_inf_logp"] == expected > 0 and torch.isfinite(loss)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g).all()


def test_grpo_truncated_importance_sampling():
    logp, logp_inf, adv, mask = grpo_batch()
    logp_old = (logp.detach() + 0.05).clamp(max=0)
    loss, met = grpo_loss(logp, logp_inf, adv, mask, logp_old=logp_old, tis_cap=1.1, norm="token")
    w = torch.exp(logp_old - logp_inf).clamp(max=1.1)
    r = torch.exp(logp - logp_old)
    per = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None]) * w
    ref = per[mask].sum() / mask.sum()
    assert close(loss, ref, VAL)
    assert close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0], GRAD)
    assert 0 < met["tis_capped_frac"] < 1


def test_grpo_token_norm_is_invariant_to_micro_batching():
    "One optimizer step of 8 sequences split 1x8, 2x4, 8x1: the summed gradient is the same."
    g = torch.Generator().manual_seed(3)
    B, S, H, V = 8, 9, 6, 31
    hidden = torch.randn(B, S, H, generator=g)
    W0 = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (B, S), generator=g)
    for b in range(B):
        labels[b, : b % 4] = -100
        labels[b, S - (b % 3):] = -100    # uneven lengths
    mask = labels != -100
    temps = torch.full((B,), 0.9)
    with torch.no_grad():
        logp_inf = token_logprobs(hidden, W0, labels, temps) + 0.1 * torch.randn(B, S, generator=g) * mask
    adv = torch.randn(B, generator=g)
    total = float(mask.sum())
    grads = []
    for n_micro in (1, 2, 8):
        W = W0.clone().requires_grad_()
        for idx in torch.arange(B).chunk(n_micro):
            lp = token_logprobs(hidden[idx], W, labels[idx], temps[idx], chunk_size=7)
            loss, _ = grpo_loss(lp, logp_inf[idx], adv[idx], mask[idx], norm="token", token_count=total)
            loss.backward()
        grads.append(W.grad.clone())
    assert all(torch.allclose(grads[0], x, atol=1e-6, rtol=0) for x in grads[1:])
    assert grads[0].abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------- advantages
def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    adv, met = group_advantages(rewards, 4)
    assert not torch.isnan(adv).any() and abs(met["frac_reward_zero_std"] - 2 / 3) < 1e-6
    g0 = rewards[:4]
    assert torch.allclose(adv[:4], (g0 - g0.mean()) / g0.std(correction=0))   # population std
    assert (adv[4:] == 0).all()
    adv_b, _ = group_advantages(rewards, 4, scale="batch")
    assert torch.allclose(adv_b[:4], (g0 - g0.mean()) / rewards.std(correction=0))
    adv_n, _ = group_advantages(rewards, 4, scale="none")
    assert torch.allclose(adv_n[:4], g0 - g0.mean())
    tiny, _ = group_advantages(torch.tensor([1.0, 1.0 + 1e-9]), 2)
    assert torch.isfinite(tiny).all() and tiny.abs().max() < 1e-3      # max(std, eps) guards near-equal groups
    assert group_advantages(torch.ones(3), 1)[1]["frac_reward_zero_std"] == 1
    with pytest.raises(ValueError):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


# ----------------------------------------------------------------------------------------------- JSD
def ref_jsd_token(zs, zt, beta, T):
    "Direct probability-space formula for one position (float64)."
    ps, pt = torch.softmax(zs / T, -1), torch.softmax(zt / T, -1)
    if beta == 0: return (pt * (pt.log() - ps.log())).sum()
    if beta == 1: return (ps * (ps.log() - pt.log())).sum()
    M = beta * pt + (1 - beta) * ps
    return beta * (pt * (pt / M).log()).sum() + (1 - beta) * (ps * (ps / M).log()).sum()


def ref_jsd(zs, zt, mask, beta, T):
    vals = [
        ref_jsd_token(zs[b, t], zt[b, t], beta, T)
        for b in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[b, t]
    ]
    return torch.stack(vals).mean()


def jsd_batch(dtype=torch.float64, seed=1):
    hidden, W, bias, labels = make_batch(dtype, seed=seed)
    zt = torch.randn(*labels.shape, W.shape[0], dtype=dtype, generator=torch.Generator().manual_seed(seed)) * 2
    return hidden, W, bias, labels, zt


@pytest.mark.parametrize("beta,T", [(0.0, 1.0), (0.25, 0.7), (0.5, 1.0), (0.9, 1.5), (1.0, 0.7)])
def test_jsd_full_equals_naive_plain_chunked_and_topk_k_eq_V(beta, T):
    hidden, W, bias, labels, zt = jsd_batch()
    mask = labels != -100
    V = W.shape[0]
    ref = ref_jsd(hidden @ W.T + bias, zt, mask, beta, T)
    ref_g = torch.autograd.grad(ref, (hidden, W, bias))
    variants = {
        "plain": lambda: generalized_jsd(
            hidden @ W.T + bias, TeacherOutput(logits=zt), mask, beta=beta, temperature=T, chunk_size=4
        ),
        "hidden": lambda: generalized_jsd_from_hidden(
            hidden, W, TeacherOutput(logits=zt), mask, beta=beta, temperature=T, chunk_size=4, head_bias=bias
        ),
        "topk=V plain": lambda: generalized_jsd(
            hidden @ W.T + bias, TeacherOutput.topk_from_logits(zt, V), mask, beta=beta, temperature=T
        ),
        "topk=V hidden": lambda: generalized_jsd_from_hidden(
            hidden, W, TeacherOutput.topk_from_logits(zt, V), mask, beta=beta, temperature=T, chunk_size=5,
            head_bias=bias,
        ),
        "mask from labels": lambda: generalized_jsd_from_hidden(
            hidden, W, TeacherOutput(logits=zt, labels=labels), beta=beta, temperature=T, head_bias=bias
        ),
    }
    for name, f in variants.items():
        loss, met = f()
        g = torch.autograd.grad(loss, (hidden, W, bias))
        assert close(loss, ref, VAL), name
        assert all(close(a, b, GRAD) for a, b in zip(g, ref_g)), name
        assert met["n_tokens"] == mask.sum().item()


def test_jsd_fp32_chunked_equals_plain_and_naive():
    hidden, W, bias, labels, zt = jsd_batch(torch.float32, seed=4)
    mask = labels != -100
    ref = ref_jsd((hidden @ W.T).double(), zt.double(), mask, 0.5, 0.9)
    a, _ = generalized_jsd(hidden @ W.T, TeacherOutput(logits=zt), mask, temperature=0.9, chunk_size=3)
    b, _ = generalized_jsd_from_hidden(hidden, W, TeacherOutput(logits=zt.bfloat16().float()), mask, temperature=0.9)
    ga = torch.autograd.grad(a, (hidden, W))
    gb = torch.autograd.grad(generalized_jsd_from_hidden(hidden, W, TeacherOutput(logits=zt), mask, temperature=0.9,
                                                         chunk_size=5)[0], (hidden, W))
    assert close(a, ref, VAL) and all(close(x, y, GRAD) for x, y in zip(ga, gb))
    assert abs(a.item() - b.item()) < 1e-2          # bf16 teacher logits: same loss to bf16 precision


def test_jsd_from_bf16_hidden_and_head():
    hidden, W, _, labels, zt = jsd_batch(torch.float32, seed=5)
    mask = labels != -100
    ref, _ = generalized_jsd_from_hidden(hidden, W, TeacherOutput(logits=zt), mask, temperature=0.9)
    hb, Wb = hidden.detach().bfloat16().requires_grad_(), W.detach().bfloat16().requires_grad_()
    loss, _ = generalized_jsd_from_hidden(
        hb, Wb, TeacherOutput(logits=zt.bfloat16()), mask, temperature=0.9, chunk_size=4
    )
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 2e-2 * max(1.0, ref.item())
    loss.backward()
    assert (
        hb.grad.dtype == torch.bfloat16
        and torch.isfinite(hb.grad.float()).all()
        and torch.isfinite(Wb.grad.float()).all()
    )


def test_jsd_endpoints_are_forward_and_reverse_kl():
    hidden, W, _, labels, zt = jsd_batch()
    mask = labels != -100
    zs = (hidden @ W.T).detach()
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    fkl = (t.exp() * (t - s)).sum(-1)[mask].mean()
    rkl = (s.exp() * (s - t)).sum(-1)[mask].mean()
    assert close(generalized_jsd(zs, TeacherOutput(logits=zt), mask, beta=0.0)[0], fkl, 1e-10)
    assert close(generalized_jsd(zs, TeacherOutput(logits=zt), mask, beta=1.0)[0], rkl, 1e-10)
    # the documented jump: the mixture form vanishes near the endpoints
    assert generalized_jsd(zs, TeacherOutput(logits=zt), mask, beta=1e-4)[0] < 1e-3 * fkl


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8])
def test_topk_teacher_with_all_mass_in_topk_equals_full(beta):
    hidden, W, bias, labels, zt = jsd_batch()
    mask = labels != -100
    k = 5
    zt = zt.masked_fill(zt < zt.topk(k, -1).values[..., -1:], -math.inf)   # teacher mass only on its top-k
    full, _ = generalized_jsd(hidden @ W.T + bias, TeacherOutput(logits=zt), mask, beta=beta)
    full_g = torch.autograd.grad(full, (hidden, W, bias))
    topk = TeacherOutput.topk_from_logits(zt, k)
    for loss, met in [
        generalized_jsd(hidden @ W.T + bias, topk, mask, beta=beta, tail=True),
        generalized_jsd_from_hidden(hidden, W, topk, mask, beta=beta, tail=True, head_bias=bias, chunk_size=4),
    ]:
        assert close(loss, full, VAL) and abs(met["teacher_topk_mass"] - 1) < 1e-9
        assert all(close(a, b, GRAD) for a, b in zip(torch.autograd.grad(loss, (hidden, W, bias)), full_g))


def test_topk_renormalised_equals_naive_on_the_k_entries_and_missing_entries():
    hidden, W, bias, labels, zt = jsd_batch()
    mask = labels != -100
    topk = TeacherOutput.topk_from_logits(zt, 6)
    topk.topk_logprobs[..., 4:] = -math.inf                      # only 4 real entries (ids of the rest are junk)
    topk.topk_ids[..., 4:] = -1
    topk.topk_logprobs[0, 4] = -math.inf                         # one scored position without any entry: dropped
    zs = hidden @ W.T + bias
    vals = []
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t] or (b, t) == (0, 4): continue
            ids = topk.topk_ids[b, t, :4]
            vals.append(ref_jsd_token(zs[b, t, ids], topk.topk_logprobs[b, t, :4], 0.5, 0.8))
    ref = torch.stack(vals).mean()
    ref_g = torch.autograd.grad(ref, (hidden, W, bias))
    for f in (
        lambda: generalized_jsd(hidden @ W.T + bias, topk, mask, temperature=0.8),
        lambda: generalized_jsd_from_hidden(hidden, W, topk, mask, temperature=0.8, head_bias=bias, chunk_size=3),
    ):
        loss, met = f()
        assert close(loss, ref, VAL) and met["n_dropped"] == 1 and met["n_tokens"] == mask.sum().item() - 1
        assert all(
            close(a, b, GRAD) and torch.isfinite(a).all()
            for a, b in zip(torch.autograd.grad(loss, (hidden, W, bias)), ref_g)
        )
    for tail in (True, False):                                  # tail bucket with missing entries: finite gradients
        loss, _ = generalized_jsd_from_hidden(hidden, W, topk, mask, temperature=0.8, tail=tail, head_bias=bias)
        assert all(torch.isfinite(x).all() for x in torch.autograd.grad(loss, (hidden, W, bias)))


def test_teacher_output_validation():
    z = torch.randn(2, 3, 5)
    with pytest.raises(ValueError):
        TeacherOutput()
    with pytest.raises(ValueError):
        TeacherOutput(logits=z, topk_logprobs=z[..., :2], topk_ids=z[..., :2].long())
    with pytest.raises(ValueError):
        TeacherOutput(topk_logprobs=-z.abs()[..., :2])
    with pytest.raises(ValueError):
        TeacherOutput(topk_logprobs=z.abs()[..., :2] + 1, topk_ids=torch.zeros(2, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError):
        TeacherOutput(logits=z, labels=torch.zeros(2, 4, dtype=torch.long))
    bad = TeacherOutput(topk_logprobs=-z.abs()[..., :2], topk_ids=torch.full((2, 3, 2), 7))
    with pytest.raises(ValueError):
        generalized_jsd(torch.randn(2, 3, 5), bad)                 # ids outside the vocabulary
    with pytest.raises(ValueError):
        generalized_jsd(torch.randn(2, 3, 6), TeacherOutput(logits=z))   # vocabulary mismatch


def test_jsd_empty_mask_no_nan():
    hidden, W, _, labels, zt = jsd_batch()
    empty = torch.zeros_like(labels, dtype=torch.bool)
    for loss, _ in [generalized_jsd_from_hidden(hidden, W, TeacherOutput(logits=zt), empty),
                    generalized_jsd(hidden @ W.T, TeacherOutput.topk_from_logits(zt, 3), empty)]:
        assert loss.item() == 0
        assert all(
            torch.isfinite(g).all() for g in torch.autograd.grad(loss, (hidden, W), allow_unused=True) if g is not None
        )


# ----------------------------------------------------------------------------------------------- CODI KD
def test_anchor_kd_loss_equals_naive():
    "Per example: the mean over its real anchors of smooth-L1 per layer (÷ the teacher's per-layer std), as multi-codi."
    g = torch.Generator().manual_seed(0)
    B, K, L, H = 3, 4, 2, 8
    student = torch.randn(B, K, L, H, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = (
        torch.randn(B, K, L, H, generator=g, dtype=torch.float64)
        * torch.tensor([0.5, 10.0], dtype=torch.float64)[None, None, :, None]
    )
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    for norm in (False, True):
        std = torch.stack([teacher[valid][:, l].std() for l in range(L)])
        ref = []
        for b in range(B):
            per = []
            for k in range(int(valid[b].sum())):
                for l in range(L):
                    d = (student[b, k, l] - teacher[b, k, l]).abs()
                    sl1 = torch.where(d < 1, 0.5 * d ** 2, d - 0.5).mean()
                    per.append(sl1 / std[l] if norm else sl1)
            ref.append(torch.stack(per).mean())
        ref = torch.stack(ref)
        loss, met = anchor_kd_loss(student, teacher, valid, normalize_by_teacher_std=norm)
        assert close(loss, ref, VAL)
        assert close(torch.autograd.grad(loss.sum(), student)[0], torch.autograd.grad(ref.sum(), student)[0], GRAD)
        assert met["dist"].shape == (B, K, L) and not met["dist"].requires_grad
    t_req = teacher.clone().requires_grad_()
    anchor_kd_loss(student, t_req, valid)[0].sum().backward()
    assert t_req.grad is None                                      # teacher is stop-gradient


def test_anchor_kd_loss_logit_equals_naive():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 4, 11, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(1, 4, 11, generator=g, dtype=torch.float64)
    T = 2.0
    pt, ps = torch.softmax(t / T, -1), torch.softmax(s / T, -1)
    ref = (pt * (pt.log() - ps.log())).sum(-1).mean() * T * T
    loss, _ = anchor_kd_loss(s, t, torch.ones(1, 4, dtype=torch.bool), target="logit", temperature=T)
    assert close(loss[0], ref, VAL) and close(torch.autograd.grad(loss[0], s)[0], torch.autograd.grad(ref, s)[0], GRAD)


# ----------------------------------------------------------------------------------------------- bench
def test_bench_quick_runs():
    res = losses_bench(quick=True)
    assert res["name"] == "losses" and isinstance(res["notes"], str)
    assert len(res["rows"]) == 6
    for r in res["rows"]:
        assert {"case", "variant", "time_ms", "peak_mb", "time_x", "mem_x"} <= r.keys()
        assert r["time_ms"] > 0


# ----------------------------------------------------------------------------------------------- autocast (issue 69)
class Matmuls(TorchDispatchMode):
    "Input dtypes of every matrix product an op runs (what autocast decided), with its shapes."
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.rstrip("_") in ("mm", "addmm", "mv", "addmv", "bmm", "baddbmm"):
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            self.seen.append(({t.dtype for t in ts}, [tuple(t.shape) for t in ts]))
        return func(*args, **(kwargs or {}))

    def float32(self):
        return [s for d, s in self.seen if torch.float32 in d]


AMP_HEADS = [(1.0, None, False), (1.0, None, True), (0.5, 1.5, False), (2.0, 0.9, True)]   # (scale, cap, bias)


@pytest.mark.parametrize("scale,cap,bias", AMP_HEADS)
@pytest.mark.parametrize("temps", [1.0, "per-sample"])
def test_token_logprobs_backward_under_bf16_autocast_is_the_forwards_function(scale, cap, bias, temps):
    "fp32 master weights under CPU bf16 autocast: every matmul of the backward in bf16 (none in fp32), dW in fp32,"
    "values and gradients equal plain autograd through the bf16 logits (the same autocast) to bf16 precision."
    from latent_rl.models import Head
    hidden, W, b, labels = make_batch(torch.float32, B=3, S=9, H=16, V=40, seed=7)
    T = torch.tensor([0.7, 1.0, 1.3]) if temps == "per-sample" else temps
    hd = Head(W, b if bias else None, scale, cap)
    ps = [x for x in (hidden, W, b if bias else None) if x is not None]
    up = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    up[1, 2] = 0.0                                                   # a row the backward skips
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = token_logprobs(hidden, hd, labels, T, chunk_size=4)
        ref = logprobs_from_logits(hd.logits(hidden), labels, T)
    with Matmuls() as mm:
        g = torch.autograd.grad((out * up).sum(), ps)                # outside autocast, as the training loop runs it
    gr = torch.autograd.grad((ref * up).sum(), ps)
    assert len(mm.seen) >= 9 and mm.float32() == []                  # 3 chunks x 3 V-sized matmuls, all bf16
    assert g[1].dtype == torch.float32
    assert (out - ref).abs().max() <= 0.01 * ref.abs().max()        # bf16 logits of |z| ~ 10: ~0.05 apart
    for a, r in zip(g, gr): assert (a - r).abs().max() <= 0.03 * r.abs().max(), float((a - r).abs().max())


@pytest.mark.parametrize("kind", ["full", "topk-tail"])
def test_jsd_from_hidden_under_bf16_autocast_runs_bf16_and_matches_the_plain_path(kind):
    "The JSD's gradient (built in its forward) and the top-k kernels' backwards: bf16 matmuls only under autocast."
    hidden, W, _, labels, zt = jsd_batch(torch.float32, seed=6)
    mask = labels != -100
    teacher = TeacherOutput(logits=zt) if kind == "full" else TeacherOutput.topk_from_logits(zt, 6)
    with Matmuls() as mm:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = generalized_jsd_from_hidden(hidden, W, teacher, mask, beta=0.3, temperature=0.9,
                                                  tail=kind != "full", chunk_size=3)
        g = torch.autograd.grad(loss, (hidden, W))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = generalized_jsd(hidden @ W.T, teacher, mask, beta=0.3, temperature=0.9, tail=kind != "full")
    gr = torch.autograd.grad(ref, (hidden, W))
    assert mm.seen and mm.float32() == [], mm.float32()
    assert abs(loss.item() - ref.item()) <= 2e-2 * max(1.0, ref.item())
    for a, r in zip(g, gr): assert (a - r).abs().max() <= 0.03 * r.abs().max(), float((a - r).abs().max())


# The kernels as they were before issue 69 (backward outside autocast), frozen: without autocast the current ones must
# give the same bits — the demo's fp32 table depends on it.
def _old_scaled_logits(h, W, b, t, cd, cap=None):
    from latent_rl.logprobs import _raw_logits
    if h.dtype == cd and b is None and cap is None: return (h if t is None else h / t.unsqueeze(1)) @ W.T
    z = _raw_logits(h, W, b, cd)
    if cap is not None: z = z.div_(cap).tanh_().mul_(cap)
    return z if t is None else z.div_(t.unsqueeze(1))


def _old_chunk_grads(h, W, b, y, t, lse, coef, cap, gW, gb, need_h):
    from latent_rl.logprobs import _raw_logits
    cd = lse.dtype
    if cap is None:
        p = _old_scaled_logits(h, W, b, t, cd).sub_(lse.unsqueeze(1)).exp_()
        c = coef.unsqueeze(1)
        if gW is not None:
            ch = h.to(cd) * c
            gW.addmm_(p.T, ch, alpha=-1).index_add_(0, y, ch)
        if gb is not None: gb.sub_(p.T @ coef).index_add_(0, y, coef)
        if not need_h: return None
        pW = p @ W if W.dtype == cd else (p.to(W.dtype) @ W).to(cd)
        return (W[y].to(cd) - pW).mul_(c).to(h.dtype)
    th = _raw_logits(h, W, b, cd).div_(cap).tanh_()
    z = th * cap if t is None else th * cap / t.unsqueeze(1)
    d = z.sub_(lse.unsqueeze(1)).exp_().neg_()
    d.scatter_add_(1, y.unsqueeze(1), torch.ones_like(d[:, :1]))
    d.mul_(th.square_().neg_().add_(1)).mul_(coef.unsqueeze(1))
    if gW is not None: gW.addmm_(d.T, h.to(cd))
    if gb is not None: gb.add_(d.sum(0))
    return (d.to(W.dtype) @ W).to(h.dtype) if need_h else None


class _OldChunkedTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, W, b, y, t, chunk_size, cap=None):
        from latent_rl.logprobs import _compute_dtype, _lse_
        cd, n = _compute_dtype(h.dtype), h.shape[0]
        out, lse = torch.empty(n, dtype=cd), torch.empty(n, dtype=cd)
        for i in range(0, n, chunk_size):
            sl = slice(i, i + chunk_size)
            z = _old_scaled_logits(h[sl], W, b, None if t is None else t[sl], cd, cap)
            zy = z.gather(1, y[sl].unsqueeze(1)).squeeze(1)
            lse[sl] = _lse_(z)
            out[sl] = zy - lse[sl]
        ctx.save_for_backward(h, W, b, y, t, lse)
        ctx.chunk_size, ctx.cap = chunk_size, cap
        return out

    @staticmethod
    def backward(ctx, g):
        h, W, b, y, t, lse = ctx.saved_tensors
        need_h, need_W, need_b = ctx.needs_input_grad[:3]
        cd = lse.dtype
        gh = torch.zeros_like(h) if need_h else None
        gW = torch.zeros(W.shape, dtype=cd) if need_W else None
        gb = torch.zeros(W.shape[0], dtype=cd) if need_b else None
        g = g.to(cd)
        rows = (g != 0).nonzero().squeeze(1)
        if rows.shape[0] < g.shape[0]:
            h, y, lse, g = h[rows], y[rows], lse[rows], g[rows]
            t = None if t is None else t[rows]
        coef = g if t is None else g / t
        for i in range(0, h.shape[0], ctx.chunk_size):
            sl = slice(i, i + ctx.chunk_size)
            gh_c = _old_chunk_grads(h[sl], W, b, y[sl], None if t is None else t[sl], lse[sl], coef[sl], ctx.cap, gW,
                                    gb, need_h)
            if gh_c is None: continue
            if rows.shape[0] < gh.shape[0]: gh.index_copy_(0, rows[sl], gh_c)
            else: gh[sl] = gh_c
        return (gh, None if gW is None else gW.to(W.dtype), None if gb is None else gb.to(b.dtype),
                None, None, None, None)


def _old_jsd_from_hidden(h, W, b, zt, idx, beta, T, chunk_size, cap=None):
    "The old `_JSDFromHidden.forward`'s sums: (per-token losses, dh, dW)."
    from latent_rl.logprobs import _compute_dtype, _raw_logits
    from latent_rl.losses import _jsd_chunk
    cd = _compute_dtype(h.dtype)
    per_tok, gh, gW = torch.empty(h.shape[0], dtype=cd), torch.empty_like(h), torch.zeros(W.shape, dtype=cd)
    for i in range(0, h.shape[0], chunk_size):
        sl = slice(i, i + chunk_size)
        fold = b is None and h.dtype == cd and cap is None
        hc = h[sl] / T if fold and T != 1 else h[sl]
        zs = _raw_logits(hc, W, b, cd)
        if cap is not None:
            th = zs.div_(cap).tanh_()
            zs = th * cap
        per_tok[sl], d = _jsd_chunk(zs, zt.index_select(0, idx[sl]).to(cd), beta, T, True, student_tempered=fold)
        if cap is not None: d.mul_(th.square_().neg_().add_(1))
        gh[sl] = d.to(h.dtype) @ W
        gW.addmm_(d.T, h[sl].to(cd))
    return per_tok, gh, gW.to(W.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cap,bias,temps", [(None, False, None), (None, False, "t"), (None, True, "t"), (1.5, True, "t"),
                                            (0.8, False, None)])
def test_without_autocast_the_kernels_give_the_old_bits(dtype, cap, bias, temps):
    from latent_rl.logprobs import _ChunkedTokenLogprob
    from latent_rl.losses import _JSDFromHidden
    g = torch.Generator().manual_seed(3)
    n, H, V = 11, 16, 37
    h = torch.randn(n, H, generator=g, dtype=dtype).requires_grad_()
    W = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    y = torch.randint(0, V, (n,), generator=g)
    t = torch.rand(n, generator=g, dtype=torch.promote_types(dtype, torch.float32)) + 0.5 if temps else None
    up = torch.randn(n, generator=g, dtype=torch.promote_types(dtype, torch.float32))
    up[4] = 0.0                                                      # a skipped row
    ps = [x for x in (h, W, b) if x is not None]
    for C in (1, 4, 64):
        new = _ChunkedTokenLogprob.apply(h, W, b, y, t, C, cap)
        old = _OldChunkedTokenLogprob.apply(h, W, b, y, t, C, cap)
        assert torch.equal(new, old)
        assert all(torch.equal(a, c) for a, c in zip(torch.autograd.grad((new * up).sum(), ps),
                                                      torch.autograd.grad((old * up).sum(), ps)))
    zt, idx = torch.randn(n + 3, V, generator=g, dtype=dtype), torch.randperm(n + 3, generator=g)[:n]
    for T in (1.0, 0.8):
        total, per = _JSDFromHidden.apply(h, W, b, zt, idx, 0.4, T, 4, True, cap)
        o_per, o_gh, o_gW = _old_jsd_from_hidden(h.detach(), W.detach(), None if b is None else b.detach(), zt, idx,
                                                 0.4, T, 4, cap)
        gh, gW = torch.autograd.grad(total, (h, W))
        assert torch.equal(per, o_per) and torch.equal(gh, o_gh) and torch.equal(gW, o_gW)
