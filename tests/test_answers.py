"""Answers outnumber traces (`traced_frac`): every stage sees the same traced programs, the answer-only rows train
where a stage uses them (CODI's supervised control, GKD's and GRPO's prompts) and are refused where they cannot."""
import json
from types import SimpleNamespace
import torch
from conftest import run_cli, TEACHER, ROWS, ONE


def _summary(run): return json.loads((run / "final" / "training_summary.json").read_text())

def _rows(n=64, frac=0.25):
    from latent_rl.rows import load_traced, split_traced
    return split_traced(load_traced(ROWS, n, progress=False), frac, 0)

def test_sft_trains_on_the_traced_rows_or_on_every_answer(tmp_path):
    from latent_rl.models import load_tokenizer
    from latent_rl.tokens import sft_example
    rows, tok = _rows(), load_tokenizer(TEACHER)
    want = {m: sum(sft_example(tok, r, m, 384) is not None for r in rows if m == "answer" or "trace" in r)
            for m in ("trace", "answer")}
    assert want["trace"] <= 16 < want["answer"]
    for m in ("trace", "answer"):
        run_cli("sft", "--recipe", "none", "--model", TEACHER, "--train", ROWS, "--max_train", 64, "--traced_frac", 0.25,
                "--mode", m, "--steps", 1, "--batch_size", 4, "--save_every", 0, "--val", "", "--out", tmp_path / m,
                env=ONE)
        assert _summary(tmp_path / m)["examples"] == want[m], m

def test_gkd_draws_dataset_completions_from_traced_rows_only():
    "A cycle that samples draws from every row; one that uses the dataset's completions, from the traced rows."
    from latent_rl.gkd import GKDStep, GKDConfig, gkd_coin
    traced = list(range(0, 100, 10))
    for lmbda in (0.0, 1.0, 0.5):
        cfg = GKDConfig(batch_size=8, lmbda=lmbda, steps=40, seed=3)
        st = SimpleNamespace(cfg=cfg, traced=traced, n_examples=100, fits=lambda i: True)
        for step in range(40):
            idx = GKDStep.batch(st, step)
            assert len(idx) == 8
            if not gkd_coin(cfg.seed, step, lmbda): assert set(idx) <= set(traced), (lmbda, step, idx)
        if lmbda == 1.0: assert not set(idx) <= set(traced)          # prompts from every row
    st = SimpleNamespace(cfg=GKDConfig(batch_size=8, lmbda=0.0, steps=4), traced=None, n_examples=100,
                         fits=lambda i: True)
    from latent_rl.loop import batch_indices
    assert GKDStep.batch(st, 2) == batch_indices(2, 8, 100, 0)            # every row traced: the order as before

def test_refused_where_a_trace_is_needed(tmp_path, latent_student):
    p = run_cli("grpo", "--recipe", "none", "--model", latent_student, "--train", ROWS, "--max_train", 32,
                "--traced_frac", 0.5, "--rewards", "correct:1,path:0.5", "--out", tmp_path / "g", check=False)
    assert p.returncode == 2 and "path reward" in p.stderr and "traced_frac" in p.stderr, p.stderr
    p = run_cli("gkd", "--recipe", "none", "--model", latent_student, "--teacher", TEACHER, "--train", ROWS,
                "--max_train", 32, "--traced_frac", 0.5, "--teacher_locals", "true", "--out", tmp_path / "k",
                check=False)
    assert p.returncode == 2 and "teacher_locals" in p.stderr, p.stderr
    p = run_cli("codi", "--recipe", "none", "--model", TEACHER, "--train", ROWS, "--max_train", 32, "--answer_ce", 1,
                "--out", tmp_path / "c", check=False)
    assert p.returncode == 2 and "answer_ce" in p.stderr, p.stderr
    p = run_cli("sft", "--recipe", "none", "--traced_frac", 1.5, "--out", tmp_path / "s", check=False)
    assert p.returncode == 2 and "traced_frac" in p.stderr and "between 0 and 1" in p.stderr, p.stderr

def _answer_ce_run(tmp_path, name, answer_ce, monkeypatch=None):
    "CODI on the traced quarter of 64 rows with answer CE on the rest; the answer-only rows' CE before and after."
    from latent_rl.codi import CodiConfig, run_codi
    from latent_rl.latent import LatentModel
    from latent_rl.sft import eval_loss
    from latent_rl.tokens import sft_example
    torch.set_num_threads(1)
    cfg = CodiConfig(model=str(TEACHER), train=str(ROWS), max_train=64, traced_frac=0.25, answer_ce=answer_ce,
                     steps=20, batch_size=8, lr=1e-3, warmup=0, val="", save_every=0, anchor_every=0, log_every=5,
                     out=str(tmp_path / name))
    lm, tok = LatentModel.load(TEACHER)
    exs = [sft_example(tok, r, "answer", 384) for r in _rows() if "trace" not in r]
    gap = lambda m: eval_loss(m, _shift(exs), tok.pad_token_id) - eval_loss(m, exs, tok.pad_token_id)
    before, b_ce = gap(lm.model), eval_loss(lm.model, exs, tok.pad_token_id)
    m = LatentModel.load(run_codi(cfg, progress=False))[0].model
    return gap(m) - before, b_ce - eval_loss(m, exs, tok.pad_token_id)

def test_answer_ce_trains_the_answers_it_is_given(tmp_path, monkeypatch):
    """The supervised control's answer CE lowers the answer-only rows' CE (CODI alone, answer_ce 0, barely moves it)
    and keeps each answer with its own prompt: trained on answers paired with other programs' prompts, the model comes
    to prefer the swapped pairs (the CE gap between swapped and true pairs falls)."""
    (gap, drop), (_, drop0) = _answer_ce_run(tmp_path, "on", 1.0), _answer_ce_run(tmp_path, "off", 0.0)
    import latent_rl.codi as codi
    real = codi.sft_batch_loss
    monkeypatch.setattr(codi, "sft_batch_loss", lambda model, exs, pad: real(model, _shift(exs), pad))
    gap_mis, _ = _answer_ce_run(tmp_path, "mis", 1.0)
    # measured: CE drop 2.8 with answer CE, 0.05 without; the true-vs-swapped CE gap +0.03 aligned, -1.4 misaligned
    assert drop > 1.0 and drop0 < 0.3 and gap > -0.2 and gap_mis < gap - 0.5, (drop, drop0, gap, gap_mis)

def _shift(exs):
    "Each prompt with the next example's answer (misaligned pairs)."
    p = lambda e: next(i for i, l in enumerate(e["labels"]) if l != -100)
    return [dict(e, input_ids=e["input_ids"][:p(e)] + n["input_ids"][p(n):], labels=e["labels"][:p(e)] + n["labels"][p(n):])
            for e, n in zip(exs, exs[1:] + exs[:1])]
