import os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "data" / "teacher"                  # the shipped tiny SFT model
ROWS = ROOT / "data" / "corpus" / "train.jsonl"
ONE = {"OMP_NUM_THREADS": "1"}                       # one intra-op thread: subprocess runs stay reproducible
BIN = Path(sys.executable).parent

# Under `pytest -n 2` (pytest-xdist) each worker computes on one thread: two workers on two cores, none oversubscribed.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)

# Prepared training data (`latent_rl.rows.prepared`) is cached in a directory of this test session, not the user's
os.environ.setdefault("LATENT_RL_CACHE", __import__("tempfile").mkdtemp(prefix="latent_rl_cache_"))

# Tracing needs the sandbox (a bwrap jail). Where it cannot start, the suite's own benign programs are traced without
# it (as `--unsafe-no-sandbox` would); tests/test_sandbox.py then skips its hostile programs, which never run unjailed.
sys.path.insert(0, str(ROOT))
from latent_rl.sandbox import UNSAFE_ENV, sandbox_status
if not sandbox_status()["available"]:
    print(f"conftest: no sandbox here ({sandbox_status()['reason']}): tracing the tests' own programs without it")
    os.environ[UNSAFE_ENV] = "1"

def run_cli(*args, cwd=None, timeout=600, check=True, module="latent_rl.train", env=None):
    "Run `python -m latent_rl.train ARGS` (or another module) in a subprocess; return the CompletedProcess."
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    p = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd or ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{module} {args} failed ({p.returncode}):\nSTDOUT:\n{p.stdout[-4000:]}\nSTDERR:\n{p.stderr[-4000:]}"
        )
    return p

def shared_dir(tmp_path_factory, worker_id, name, build) -> Path:
    """A session's directory `name`, built once by `build(dir)` and shared by every xdist worker (a file lock orders
    them)."""
    if worker_id == "master":
        build(d := tmp_path_factory.mktemp(name))
        return d
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp().parent     # this run's directory, above every worker's own
    d, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            build(d)
            done.touch()
    return d

@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, worker_id):
    "A small traced corpus + tokenizer built by the project's own `latent-rl data` command."
    build = lambda d: run_cli("data", "--out", d, "--n", 400, "--vocab", 300)
    return shared_dir(tmp_path_factory, worker_id, "data", build)

def rows_of(path) -> list[dict]:
    import json
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]

def steps_of(run) -> list[dict]:
    "The per-step rows of a run's metrics.jsonl."
    return [r for r in rows_of(Path(run) / "metrics.jsonl") if "step" in r]

@pytest.fixture(scope="session")
def latent_student(tmp_path_factory):
    """The shipped teacher as a latent model (a fresh projector, seeded: the tests that train it must not depend on
    which tests ran before on the worker): a latent policy without training."""
    import torch
    from latent_rl.latent import LatentModel
    d = tmp_path_factory.mktemp("latent")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm, tok = LatentModel.load(TEACHER)
    return lm.save(d / "student", tok)
