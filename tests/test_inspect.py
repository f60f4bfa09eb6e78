"Inspectors, headless: drive each widget's controls, assert on the data of the returned Figure; plot_run and the CLI."
import json, math
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli, ROOT
from latent_rl.records import read_metrics, read_logprobs, read_rollouts, read_anchors, run_kind, steps_of
from latent_rl.run_stats import token_arrays, alignment_stats, clip_stats, ratios, leaks, completion_lines, trace_lines
from latent_rl.figures import panel, to_png
from latent_rl.inspect_runs import (
    plot_metrics, AlignmentInspector, ClipInspector, AnchorInspector, RolloutViewer, plot_run, main,
)

TRACE_TOKENS = [
    "<|line_sep|>", "<|action_sep|>", "    y = x + 1\n", "<|frame_sep|>", "<|line_sep|>", "<|action_sep|>",
    "    return y\n", "<|frame_sep|>", "<|return_sep|>", "<|action_sep|>", "    return y\n", "<|arg_sep|>", '"3"',
    "<|frame_sep|>", "<|end_of_text|>",
]

def _jsonl(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)

def write_run(run: Path, kind="grpo", steps=(0, 1, 2), groups=2, G=4, seed=0, eps=(0.2, 0.28), half_line=True):
    """Synthetic records in the documented formats (numbers at random, fixed seed); records count steps from 0, metrics
    from 1."""
    rng = np.random.default_rng(seed)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(
        json.dumps({"eps_low": eps[0], "eps_high": eps[1]} if kind == "grpo" else {"beta": 0.5})
    )
    lps, ros, mets = [], [], []
    T = len(TRACE_TOKENS)
    for s in steps:
        for g in range(groups):
            R = rng.integers(0, 2, G).astype(float)
            A = (R - R.mean()) / max(R.std(), 1e-4) if kind == "grpo" else np.zeros(G)
            samples = []
            for k in range(G):
                lpi = -rng.exponential(1.0, T)
                mask = np.ones(T, int)
                mask[1] = 0
                lpi[1] = 0.0 if kind == "grpo" else lpi[1]   # forced token after the latent block
                lp = lpi + rng.normal(0, 0.1 * (s + 1), T)
                lps.append({"step": s, "micro": 0, "row": g * G + k, "tokens": TRACE_TOKENS, "logp": lp.tolist(),
                            "logp_inf": lpi.tolist(), "mask": mask.tolist(), "adv": float(A[k]), "reward": float(R[k]),
                            "latent_at": [0]})
                samples.append(
                    {
                        "text": "".join(TRACE_TOKENS), "tokens": TRACE_TOKENS, "reward": float(R[k]),
                        "adv": float(A[k]), "correct": bool(R[k]), "latent_at": [0],
                    }
                )
            ros.append(
                {
                    "step": s, "group": g,
                    "prompt": "<|trace_context_start|>\ndef f(x):\n    y = x + 1\n    return y\n<|frame_sep|>",
                    "truth": "3", "samples": samples,
                }
            )
        m = {"step": s + 1, "loss": 1.0 / (s + 1), "lr": 1e-5, "grad_norm": 0.5, "step_s": 1.0}
        if kind == "grpo":
            m.update(ratio_mean=1.0, clip_frac_low=0.1, clip_frac_high=0.05, align_abs_mean=0.01, reward_mean=0.5)
        else: m.update(jsd_loss=0.3, sft_loss=0.2, on_policy=s % 2, teacher_s=0.1)
        mets.append(m)
    _jsonl(run / "metrics.jsonl", mets + [{"event": "done"}])
    _jsonl(run / "logprobs.jsonl", lps, '{"step": 9, "tok' if half_line else "")   # a running job's half-written line
    if kind == "grpo": _jsonl(run / "rollouts.jsonl", ros)
    return run

@pytest.fixture
def grpo_run(tmp_path): return write_run(tmp_path / "grpo")

@pytest.fixture(scope="module")
def codi_run(tmp_path_factory):
    "A real 3-step CODI run from the shipped tiny teacher, recording KD anchors at every step."
    from latent_rl.codi import CodiConfig, run_codi
    out = tmp_path_factory.mktemp("codi")
    run_codi(
        CodiConfig(
            model=str(ROOT / "data/teacher"), train=str(ROOT / "data/corpus/train.jsonl"), val="", steps=3,
            batch_size=4, max_train=16, anchor_every=1, log_every=1, save_every=0, out=str(out),
        ),
        progress=False,
    )
    return out

@pytest.fixture(scope="module")
def gkd_run(codi_run, tmp_path_factory):
    "A real 2-step on-policy GKD run of the CODI student against the explicit-trace teacher, recording logprobs."
    from latent_rl.gkd import GKDConfig, run_gkd
    out = tmp_path_factory.mktemp("gkd")
    run_gkd(
        GKDConfig(
            model=str(codi_run / "final"), teacher=str(ROOT / "data/teacher"),
            train=str(ROOT / "data/corpus/train.jsonl"), out=str(out), steps=2, batch_size=4, max_train=16,
            max_new_tokens=48, lmbda=1.0, record_every=1, log_every=1, save_every=0,
        ),
        progress=False,
    )
    return out

@pytest.fixture(scope="module")
def real_grpo_run(codi_run, tmp_path_factory):
    "A real 2-step GRPO run of the CODI student (2 programs × 4 samples per step), recording logprobs and rollouts."
    from latent_rl.grpo import GRPOConfig, run_grpo
    out = tmp_path_factory.mktemp("grpo")
    run_grpo(
        GRPOConfig(
            model=str(codi_run / "final"), train=str(ROOT / "data/corpus/train.jsonl"), out=str(out), steps=2,
            batch_size=2, group_size=4, max_train=16, max_new_tokens=96, lr=1e-3, warmup=1, record_every=1,
            save_every=0,
        ),
        progress=False,
    )
    return out

def test_readers_skip_partial_lines_and_name_bad_fields(grpo_run, tmp_path):
    assert [r["step"] for r in read_metrics(grpo_run)] == [1, 2, 3]            # the "done" row is skipped
    rows = read_logprobs(grpo_run)
    assert len(rows) == 3 * 2 * 4 and 9 not in {r["step"] for r in rows}        # half-written line ignored
    assert len(read_logprobs(grpo_run, step=2)) == 8 and len(read_rollouts(grpo_run, step=0)) == 2
    assert run_kind(grpo_run) == "grpo"
    with pytest.raises(FileNotFoundError, match="kd_anchors.jsonl: not found"): read_anchors(grpo_run)
    bad = tmp_path / "bad"
    bad.mkdir()
    _jsonl(bad / "rollouts.jsonl", [{"step": 1, "group": 0}])
    with pytest.raises(ValueError, match=r"rollouts.jsonl: row 1: missing field\(s\) 'samples'"): read_rollouts(bad)
    _jsonl(bad / "kd_anchors.jsonl", [{"step": 0, "ids": ["a", "b"], "layers": [1], "dist": [[[0.1]]]}])
    with pytest.raises(ValueError, match="2 ids but 1 'dist'"): read_anchors(bad)

def test_stats_by_hand():
    rows = [{"step": 1, "tokens": list("abcde"), "logp": [-1.0, -2.3, -0.6, -3.0, -1.0],
             "logp_inf": [-1.1, -2.0, -1.0, 0.0, float("nan")], "mask": [1, 1, 1, 0, 0], "adv": 1.0}]
    s = alignment_stats(rows)
    assert math.isclose(s["mean"], 0.2 / 3) and math.isclose(s["abs_mean"], 0.8 / 3) and math.isclose(s["abs_max"], 0.4)
    assert (s["n"], s["masked"], s["leaks"]) == (3, 2, 2)
    c = clip_stats(rows + [{**rows[0], "adv": -2.0}], eps_low=0.2, eps_high=0.2)
    assert (c["n"], c["n_pos"], c["n_neg"]) == (6, 3, 3)
    assert all(
        math.isclose(c[k], 1 / 3) for k in ("below_pos", "above_pos", "below_neg", "above_neg", "below", "above")
    )
    assert math.isclose(c["ratio_mean_pos"], np.mean(np.exp([0.1, -0.3, 0.4])))
    assert leaks(np.array([-1.0, 0.0, np.nan, np.inf, 0.5]), np.zeros(5, bool)).tolist() == [
        False, True, True, True, True,
    ]

def test_trace_rendering():
    assert completion_lines(TRACE_TOKENS, [0]) == ["LINE [latent 1] |     y = x + 1", "LINE  |     return y",
                                                   'RETURN |     return y -> "3"', "<eot>"]
    lines, spans = trace_lines(
        '<|line_sep|>{"x": "2"}<|action_sep|>    y = x + 1\n<|frame_sep|><|return_sep|><|action_sep|>'
        '    return y\n<|arg_sep|>"3"<|frame_sep|>'
    )
    assert lines == ['LINE [latent 1: {"x": "2"}] |     y = x + 1', 'RETURN |     return y -> "3"'] and spans == [
        "y = x + 1"
    ]

def test_alignment_inspector_slider_drives_the_figure(grpo_run):
    insp = AlignmentInspector(grpo_run)
    assert (insp.slider.min, insp.slider.max, insp.slider.value) == (0, 2, 2)
    for step in (1, 0):
        insp.slider.value = step
        fig = insp.fig
        t = token_arrays(read_logprobs(grpo_run, step=step))
        sc = panel(fig, "scatter")
        off = np.asarray(sc.collections[0].get_offsets())
        assert np.allclose(off[:, 0], t["logp_inf"][t["mask"]]) and np.allclose(off[:, 1], t["logp"][t["mask"]])
        assert len(sc.collections[2].get_offsets()) == 8                          # one placeholder leak per sequence
        assert f"step {step}" in sc.get_title() and "(nats)" in sc.get_xlabel()
        assert sum(p.get_height() for p in panel(fig, "hist").patches) == t["mask"].sum()
        st = alignment_stats(read_logprobs(grpo_run, step=step))
        txt = panel(fig, "hist").texts[0].get_text()
        assert f"max |.| {st['abs_max']:.3g}" in txt and f"n {st['n']}" in txt and "leaks 8" in txt
    steps_line = panel(fig, "steps").lines[0]
    assert list(steps_line.get_xdata()) == [0, 1, 2]
    logged = next(l for l in panel(fig, "steps").lines if "metrics" in l.get_label())
    # metrics row s describes record step s - 1
    assert list(logged.get_xdata()) == [0, 1, 2]

def test_alignment_refresh_sees_new_steps(grpo_run):
    insp = AlignmentInspector(grpo_run)
    write_run(grpo_run, steps=(0, 1, 2, 3), half_line=False)
    insp.refresh()
    assert insp.slider.max == 3 and insp.steps == [0, 1, 2, 3]

def test_gkd_alignment_is_student_vs_teacher(tmp_path):
    run = write_run(tmp_path / "gkd", kind="gkd")
    assert run_kind(run) == "gkd"
    fig = AlignmentInspector(run).figure(step=2)
    assert "teacher" in panel(fig, "scatter").get_xlabel()
    assert len(panel(fig, "scatter").collections[2].get_offsets()) == 0        # the teacher's masked logprobs are real
    assert [p.name for p in plot_run(run)] == ["metrics.png", "alignment.png"]  # no clipping view for GKD
    assert panel(fig, "scatter").get_ylabel() == "student log-prob (nats)"
    assert "on-policy" in panel(plot_metrics(run), "policy").get_ylabel()

def test_clip_inspector(grpo_run):
    insp = ClipInspector(grpo_run)
    assert (insp.eps_low, insp.eps_high) == (0.2, 0.28)                        # from config.json
    insp.slider.value = 2
    fig = insp.fig
    r, a = ratios(read_logprobs(grpo_run, step=2))
    assert sum(p.get_height() for p in panel(fig, "hist").patches) == len(r)
    steps, cs = insp.stats()
    lines = {l.get_label(): l for l in panel(fig, "clip").lines}
    assert np.allclose(lines["above, A > 0"].get_ydata(), [q["above_pos"] for q in cs])
    assert np.allclose(lines["below, A < 0"].get_ydata(), [q["below_neg"] for q in cs])
    q2 = clip_stats(read_logprobs(grpo_run, step=2), 0.2, 0.28)
    assert np.isclose(cs[2]["above_pos"], q2["above_pos"]) and np.isclose(q2["above_pos"], (r[a > 0] > 1.28).mean())
    assert list(lines["clip_frac_low (metrics)"].get_ydata()) == [0.1] * 3
    assert "eps_high=0.28" in fig._suptitle.get_text()

def test_rollout_viewer(grpo_run):
    v = RolloutViewer(grpo_run)
    v.slider.value, v.group.value = 2, 1
    fig = v.fig
    g = next(r for r in read_rollouts(grpo_run, step=2) if r["group"] == 1)
    bars = panel(fig, "bars")
    assert [p.get_height() for p in bars.containers[0]] == [s["reward"] for s in g["samples"]]
    assert np.allclose([p.get_height() for p in bars.containers[1]], [s["adv"] for s in g["samples"]])
    assert "group 1 at step 2" in bars.get_title()
    texts = [t.get_text() for t in panel(fig, "sample0").texts]
    assert texts[0] == "LINE [latent 1] |     y = x + 1"
    assert f"reward {g['samples'][0]['reward']:.2f}" in panel(fig, "sample0").get_title(loc="left")

def test_rollout_viewer_labels_each_samples_code_where_a_family_explored(grpo_run):
    """The exploration view: a group recorded under `explore=gumbel` labels each sample with its code (the key it is
    drawn from: the same label for the same key) and names the family and how many distinct completions the group
    holds; a text-sampling group labels none."""
    rows = read_rollouts(grpo_run)
    for r in rows:
        r["explore"] = "gumbel"
        for j, q in enumerate(r["samples"]): q.update(key=10**6 * 7 + 1000 * r["group"] + j)
    _jsonl(grpo_run / "rollouts.jsonl", rows)
    fig = RolloutViewer(grpo_run).figure(step=2, group=1)
    titles = [panel(fig, f"sample{i}").get_title(loc="left") for i in range(4)]
    assert [t.split(":")[0] for t in titles] == [f"sample {j}, code 00{1000 + j}" for j in range(4)], titles
    assert "exploring by gumbel: 1 distinct of 4" in fig._suptitle.get_text()
    for r in rows: r.pop("explore")
    _jsonl(grpo_run / "rollouts.jsonl", rows)
    fig = RolloutViewer(grpo_run).figure(step=2, group=1)
    assert "code" not in panel(fig, "sample0").get_title(loc="left") and "by tokens" in fig._suptitle.get_text()

def test_plot_run_and_cli(grpo_run, tmp_path):
    paths = plot_run(grpo_run)
    assert [p.name for p in paths] == ["metrics.png", "alignment.png", "clip.png", "rollouts.png"]
    assert all(p.parent == grpo_run / "figures" and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    p = run_cli(grpo_run, "--out", tmp_path / "figs", module="latent_rl.inspect_runs")
    assert sorted(x.name for x in (tmp_path / "figs").iterdir()) == [
        "alignment.png", "clip.png", "metrics.png", "rollouts.png",
    ]
    assert str(tmp_path / "figs" / "clip.png") in p.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    p = run_cli(empty, module="latent_rl.inspect_runs", check=False)
    assert p.returncode != 0 and "metrics.jsonl: not found" in p.stderr
    with pytest.raises(SystemExit, match="no such run directory"): main([str(tmp_path / "nope")])

def test_anchor_inspector_records(codi_run):
    an = AnchorInspector(codi_run)
    assert an.steps == [0, 1, 2]
    an.slider.value = 1
    rec = read_anchors(codi_run, step=1)[0]
    assert list(an.example.options) == rec["ids"]
    for i in (2, 0):
        an.example.value = rec["ids"][i]
        fig = an.fig
        assert np.allclose(panel(fig, "heatmap").images[0].get_array(), np.array(rec["dist"][i]))
        assert rec["ids"][i] in fig._suptitle.get_text()
    tr = [t.get_text() for t in panel(fig, "trace").texts]
    n_latent = sum("[latent" in t for t in tr)
    assert n_latent == len(rec["dist"][0])                                     # one marked block per anchor
    mean_line = next(l for l in panel(fig, "layers").lines if l.get_label() == "mean over layers")
    per_step = [np.concatenate([np.asarray(d) for d in r["dist"]]).mean() for r in read_anchors(codi_run)]
    assert np.allclose(mean_line.get_ydata(), per_step)
    assert [p.name for p in plot_run(codi_run)] == ["metrics.png", "anchors.png"]

def test_anchor_inspector_live_and_missing_rows(codi_run):
    an = AnchorInspector(codi_run, model=codi_run / "final", topk=3)
    an.source.value = "live"
    fig = an.fig
    lm, tok = an.lm()
    n = lm.model.config.num_hidden_layers
    L = an.live(an.example.value)
    K = len(trace_lines(an.row(an.example.value)["trace"])[1])
    assert panel(fig, "heatmap").images[0].get_array().shape == (K, n + 1)
    assert np.allclose(L["dist"][:, 0], 0, atol=1e-6)                          # embedding layer: the same token
    assert L["latents"].shape[:2] == (K, lm.spec.latent_steps)
    lens = panel(fig, "lens").images[0].get_array()
    assert lens.shape == (K * lm.spec.latent_steps, 3) and np.all(np.diff(lens, axis=1) <= 1e-7)   # top-k, sorted
    import torch
    p = torch.softmax(torch.tensor(L["latents"][0, 0]) @ lm.head_weight.detach().float().T, -1)
    assert np.allclose(L["lens_p"][0, 0], p.topk(3).values.numpy(), atol=1e-5)
    an2 = AnchorInspector(codi_run, rows=[])                                   # rows that do not hold the example
    assert any("not found" in t.get_text() for t in panel(an2.fig, "trace").texts)
    # legible where JupyterLab shows it: scaled to its output area (860 px: the file browser open)
    for f in (fig, an2.fig):
        assert smallest_text_px(f, 860) >= 9, smallest_text_px(f, 860)
    lens_box = panel(fig, "lens").get_position()
    # the lens: its own full-width row
    assert lens_box.width > 0.8 and lens_box.y1 < panel(fig, "heatmap").get_position().y0


def smallest_text_px(fig, out_px: int) -> float:
    "Pixel height of the figure's smallest visible text when the figure is scaled to `out_px` pixels wide."
    import matplotlib.text
    to_png(fig)                                                                # lay out and draw: ticks exist
    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes) / 72 * out_px / fig.get_figwidth()

def test_alignment_on_a_real_gkd_run(gkd_run):
    assert run_kind(gkd_run) == "gkd"
    insp = AlignmentInspector(gkd_run)
    insp.slider.value = insp.steps[-1]
    fig = insp.fig
    rows = read_logprobs(gkd_run, step=insp.steps[-1])
    t = token_arrays(rows)
    sc = panel(fig, "scatter")
    assert sc.get_ylabel() == "student log-prob (nats)" and "teacher" in sc.get_xlabel()
    assert np.allclose(np.asarray(sc.collections[0].get_offsets())[:, 1], t["logp"][t["mask"]])
    assert alignment_stats(rows)["masked"] == sum(len(r["latent_at"]) for r in rows)   # the forced <|action_sep|>s
    assert any("[latent 1]" in l for l in completion_lines(rows[0]["tokens"], rows[0]["latent_at"]))
    assert not any("Ġ" in l for l in completion_lines(rows[0]["tokens"], rows[0]["latent_at"]))
    assert [p.name for p in plot_run(gkd_run)] == ["metrics.png", "alignment.png"]

def test_inspectors_on_a_real_grpo_run(real_grpo_run):
    run = real_grpo_run
    assert run_kind(run) == "grpo" and steps_of(read_logprobs(run)) == [0, 1]
    ai = AlignmentInspector(run)
    ai.slider.value = 0
    rows = read_logprobs(run, step=0)
    t = token_arrays(rows)
    assert np.allclose(
        np.asarray(panel(ai.fig, "scatter").collections[0].get_offsets())[:, 0], t["logp_inf"][t["mask"]]
    )
    st = alignment_stats(rows)
    # in-process engine, fp32, before the update
    assert st["abs_max"] < 1e-3 and st["leaks"] == 0
    ci = ClipInspector(run)
    ci.slider.value = 1
    assert sum(p.get_height() for p in panel(ci.fig, "hist").patches) == len(ratios(read_logprobs(run, step=1))[0])
    rv = RolloutViewer(run)
    rv.slider.value, rv.group.value = 1, 0
    g = next(r for r in read_rollouts(run, step=1) if r["group"] == 0)
    assert [p.get_height() for p in panel(rv.fig, "bars").containers[0]] == [q["reward"] for q in g["samples"]]
    assert [p.name for p in plot_run(run)] == ["metrics.png", "alignment.png", "clip.png", "rollouts.png"]


def test_plot_metrics_draws_skipped_steps_once_there_are_some(tmp_path):
    "A run that skipped non-finite steps shows their count; a run that skipped none has no such panel."
    from latent_rl.inspect_runs import plot_metrics
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "skipped_steps": int(s >= 3)} for s in range(1, 6)]
    f = plot_metrics(tmp_path, rows)
    assert list(panel(f, "skipped").lines[0].get_ydata()) == [0, 0, 1, 1, 1]
    with pytest.raises(KeyError): panel(plot_metrics(tmp_path, [dict(r, skipped_steps=0) for r in rows]), "skipped")
