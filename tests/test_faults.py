"""Training runs that survive their faults (issue 64), each tried as a cluster user's would arrive, each asserting what
survives: a pre-emption signal (SIGTERM, SIGUSR1) checkpoints and exits 143, and --resume ends exactly where an
uninterrupted run does; a full disk is one line that names the directory, the space and the last checkpoint, and leaves
no partial write; a loss that turns non-finite is skipped and counted, and stops the run before a non-finite weight is
written; every loader's bad row is one line naming file, line and field; a damaged run directory is a refusal, never a
silent restart that empties its history; a checkpoint cut at any phase of its write is skipped for the one before.
The 2-process pre-emption runs in tests/test_cluster.py (make test-cluster)."""
import json, os, shutil, signal, subprocess, sys, time
from pathlib import Path
import pytest, torch
from conftest import ROOT, run_cli, rows_of, steps_of

ONE = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

def sft(tiny_data, out, *more):
    return ["sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train",
            tiny_data / "corpus/train.jsonl", "--val", "", "--size", "nano", "--batch_size", 8, "--log_every", 1,
            "--lr", 3e-3, "--out", out, *more]

def weights(run) -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(run) / "final" / "model.safetensors"))

def same(a: dict, b: dict) -> bool: return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

def start(args, env=ONE):
    return subprocess.Popen([sys.executable, "-m", "latent_rl.train", *map(str, args)], cwd=ROOT,
                            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

def wait_for_step(out, step: int, proc, timeout: float = 300):
    t = time.time()
    while time.time() - t < timeout:
        if (out / "metrics.jsonl").exists() and any(r.get("step", 0) >= step for r in rows_of(out / "metrics.jsonl")):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{out} never reached step {step}")

@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_preemption_signal_checkpoints_exits_143_and_resumes_exactly(tiny_data, tmp_path, sig):
    "Before: SIGTERM ended the run with 143 and no checkpoint; everything since the last save_every was lost."
    run_cli(*sft(tiny_data, tmp_path / "full", "--steps", 12, "--save_every", 0), env=ONE)
    p = start(sft(tiny_data, tmp_path / "part", "--steps", 12, "--save_every", 0))
    wait_for_step(tmp_path / "part", 3, p)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-3000:]
    step = int(err.split("stopped after step ")[1].split(",")[0])
    assert f"{sig}: stopped after step {step}, its checkpoint written" in err and "Traceback" not in err
    assert 3 <= step < 12 and (tmp_path / "part" / "checkpoints" / f"step-{step}" / "COMPLETE").exists()
    run_cli(*sft(tiny_data, tmp_path / "part", "--steps", 12, "--save_every", 0, "--resume"), env=ONE)
    assert same(weights(tmp_path / "full"), weights(tmp_path / "part"))          # no step lost, none done twice
    assert [r["step"] for r in steps_of(tmp_path / "part")] == list(range(1, 13))

def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0

@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "disk"
    if os.geteuid() != 0 or not _tmpfs(d, "2600k"): pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)

def test_a_full_disk_is_one_line_and_leaves_no_partial_write(tiny_data, small_disk):
    """A 2.6 MB filesystem holds one checkpoint of the nano model (~1 MB) and its final copy, not three checkpoints:
    before, `torch.save`'s C++ error ('unexpected pos …'), exit 1."""
    out = small_disk / "run"
    p = run_cli(*sft(tiny_data, out, "--steps", 8, "--save_every", 2), env=ONE, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = [l for l in p.stderr.splitlines() if "error:" in l][0]
    assert f"no space left on {out}" in line and "MB needed" in line and "MB free" in line, line
    assert "the last complete checkpoint is" in line and "step-" in line, line
    from latent_rl.checkpoints import list_checkpoints, verify_checkpoint
    ck = list_checkpoints(out)
    assert ck and all(verify_checkpoint(c) is None for _, c in ck)                    # what was written is whole
    assert not list((out / "checkpoints").glob(".tmp-*")) and not (out / ".final-tmp").exists()
    assert not (out / "final").exists()

def test_a_full_disk_during_the_first_checkpoint(tiny_data, tmp_path):
    "The first checkpoint has no size to check against: the write that fills the disk is caught, removed, said."
    d = tmp_path / "tiny-disk"
    if os.geteuid() != 0 or not _tmpfs(d, "600k"): pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        p = run_cli(*sft(tiny_data, d / "run", "--steps", 4, "--save_every", 2), env=ONE, check=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert "no space left on" in p.stderr and "no checkpoint has been written yet" in p.stderr, p.stderr[-2000:]
        assert not list((d / "run" / "checkpoints").glob(".tmp-*"))
    finally: subprocess.run(["umount", "-l", str(d)], capture_output=True)

def test_a_diverging_loss_is_skipped_then_stops_and_never_writes_nan(tiny_data, tmp_path):
    """lr 1e4: the first update sends the loss to inf/nan. Before: training went on, its checkpoints were all-NaN
    weights, and it died with 'parameters differ across ranks: checksums [nan]'."""
    out = tmp_path / "run"
    p = run_cli(*sft(tiny_data, out, "--steps", 20, "--save_every", 1, "--lr", 1e4, "--warmup", 0,
                     "--max_bad_steps", 2), env=ONE, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "were not finite for 3 steps in a row (max_bad_steps 2)" in p.stderr, p.stderr[-2000:]
    assert "no non-finite weights were written, the last checkpoint is" in p.stderr
    from safetensors.torch import load_file
    from latent_rl.checkpoints import list_checkpoints
    for _, c in list_checkpoints(out):
        assert all(torch.isfinite(v).all() for v in load_file(str(c / "model" / "model.safetensors")).values())
    rows = steps_of(out)
    assert rows[-1]["skipped_steps"] == 2 and rows[0]["skipped_steps"] == 0    # counted in metrics.jsonl (the 3rd stops)

GOOD = {"id": "r", "code": "def f(x):\n    return x + 1", "input": "2", "output": "3"}
BAD_ROWS = {   # format -> (file name, its lines, the message)
    "trace: wrong type": ("t.jsonl", [GOOD | {"id": "a"}, GOOD | {"trace": 7}], "t.jsonl:2: field 'trace' must be str"),
    "trace: not a trace": ("t.jsonl", [GOOD | {"trace": "<|line_sep|>{}"}], "t.jsonl:1: field 'trace' is not a well-formed"),
    "trace: input": ("t.jsonl", [GOOD | {"input": 2}], "t.jsonl:1: field 'input' must be a string"),
    "trace: n_line_frames": ("t.jsonl", [GOOD | {"n_line_frames": "2"}], "t.jsonl:1: field 'n_line_frames' must be int"),
    "steps: no answer": ("s.txt", ["3 4 * 5 6||1 2 + 3 4"], "s.txt:1: no '####' before the answer"),
    "steps: no input": ("s.txt", ["||1 2 #### 3"], "s.txt:1: an empty input or answer"),
    "gsm8k-aug: cot": ("a.jsonl", [{"question": "q?", "cot": 7, "answer": "1"}], "a.jsonl:1: field 'cot' missing or not a string"),
    "gsm8k-aug: answer": ("a.jsonl", [{"question": "q?", "cot": "<<1+1=2>>", "answer": ""}], "a.jsonl:1: field 'answer' is empty"),
    "gsm8k: no ####": ("g.jsonl", [{"question": "q?", "answer": "2+2=<<2+2=4>>4"}], "g.jsonl:1: field 'answer' has no '####'"),
    "gsm8k: question": ("g.jsonl", [{"question": 3, "answer": "#### 4"}], "g.jsonl:1: field 'question' missing or not a string"),
}

@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_every_loaders_bad_row_is_one_line(tmp_path, case):
    name, lines, msg = BAD_ROWS[case]
    f = tmp_path / name
    f.write_text("".join((json.dumps(l) if isinstance(l, dict) else l) + "\n" for l in lines))
    p = run_cli("sft", "--recipe", "none", "--tokenizer", ROOT / "data/tokenizer", "--train", f, "--val", "", "--size",
                "nano", "--steps", 1, "--out", tmp_path / "run", env=ONE, check=False)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]

def test_resume_with_every_checkpoint_damaged_is_refused_and_deletes_nothing(tiny_data, tmp_path):
    "Before: exit 0 after 'falling back' warnings, a restart at step 0 and an empty metrics.jsonl."
    out = tmp_path / "run"
    run_cli(*sft(tiny_data, out, "--steps", 6, "--save_every", 2), env=ONE)
    shutil.rmtree(out / "final")
    for _, c in __import__("latent_rl.checkpoints", fromlist=["x"]).list_checkpoints(out): (c / "COMPLETE").unlink()
    before = (out / "metrics.jsonl").read_text()
    p = run_cli(*sft(tiny_data, out, "--steps", 6, "--save_every", 2, "--resume"), env=ONE, check=False)
    assert p.returncode == 2 and "--resume found no loadable checkpoint" in p.stderr and "Traceback" not in p.stderr
    assert (out / "metrics.jsonl").read_text() == before and len(list((out / "checkpoints").glob("step-*"))) == 2
    run_cli(*sft(tiny_data, out, "--steps", 6, "--save_every", 2, "--overwrite"), env=ONE)      # starting over, asked
    assert (out / "metrics.jsonl.1").read_text() == before and (out / "final").exists()     # the old history, kept

def test_resume_before_any_checkpoint_keeps_the_history(tiny_data, tmp_path):
    out = tmp_path / "run"
    p = start(sft(tiny_data, out, "--steps", 400, "--save_every", 0))
    wait_for_step(out, 2, p)
    p.kill()
    p.wait()
    before = (out / "metrics.jsonl").read_text()
    run_cli(*sft(tiny_data, out, "--steps", 3, "--save_every", 0, "--resume", "--allow_config_change"), env=ONE)
    assert (out / "metrics.jsonl.1").read_text() == before and [r["step"] for r in steps_of(out)] == [1, 2, 3]

PHASES = {   # the state a kill leaves at each phase of writing checkpoint step-4 (step-2 is whole)
    "weights half written": lambda tmp, ck: _cut(tmp / "model" / "model.safetensors"),
    "weights, no state": lambda tmp, ck: (tmp / "state.pt").unlink(),
    "state half written": lambda tmp, ck: _cut(tmp / "state.pt"),
    "no manifest": lambda tmp, ck: (tmp / "MANIFEST.json").unlink(),
    "no COMPLETE marker": lambda tmp, ck: (tmp / "COMPLETE").unlink(),
    "renamed, then a file cut": lambda tmp, ck: _cut(ck / "state.pt"),
}

def _cut(p: Path): p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

@pytest.mark.parametrize("phase", list(PHASES))
def test_a_kill_at_any_phase_of_a_checkpoint_write_resumes_exactly(tiny_data, tmp_path, phase):
    run_cli(*sft(tiny_data, tmp_path / "full", "--steps", 6, "--save_every", 2), env=ONE)
    out = tmp_path / "part"
    shutil.copytree(tmp_path / "full", out)
    shutil.rmtree(out / "final")
    ck = out / "checkpoints" / "step-4"
    if phase != "renamed, then a file cut":                                  # killed before the rename: a .tmp dir
        ck = ck.rename(out / "checkpoints" / ".tmp-step-4")
    PHASES[phase](ck, out / "checkpoints" / "step-4")
    p = run_cli(*sft(tiny_data, out, "--steps", 6, "--save_every", 2, "--resume"), env=ONE)
    assert "resumed from" in p.stdout + p.stderr and "step-2" in p.stdout + p.stderr
    assert same(weights(tmp_path / "full"), weights(out))

def test_a_dead_teacher_server_is_one_line(tmp_path):
    "A GKD run whose HTTP teacher is not there: before, `TeacherUnavailable` (a RuntimeError) was a traceback."
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = run_cli("gkd", "--recipe", "none", "--model", ROOT / "data/teacher", "--teacher", f"http://127.0.0.1:{port}",
                "--topk", 4, "--train", ROOT / "data/corpus/train.jsonl", "--max_train", 8, "--batch_size", 2,
                "--steps", 1, "--http_retries", 0, "--out", tmp_path / "run", env=ONE, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and f"HTTP teacher http://127.0.0.1:{port}" in p.stderr, (
        p.stderr[-2000:])
