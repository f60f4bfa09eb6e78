"""Cluster readiness: 2-process (gloo) runs equal 1-process runs under DDP and FSDP2, SIGKILL + resume is exact (also
sharded, and resharded onto another process count), corrupt checkpoints are named and skipped. Its own CI step
(`make test-cluster`: each test starts two processes, so the lane runs them one at a time on the 2 cores)."""
import json, math, os, shutil, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest, torch
from conftest import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("LATENT_RL_CLUSTER_LANE") != "1",
                                reason="the multi-process lane runs as its own CI step: make test-cluster")

TEACHER = ROOT / "data" / "teacher"
ROWS = ROOT / "data" / "corpus" / "train.jsonl"
ENV = {
    **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def launch(nproc, *args, timeout=600):
    cmd = (
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), "-m", "latent_rl.train", *map(str, args),
        ]
        if nproc > 1
        else [sys.executable, "-m", "latent_rl.train", *map(str, args)]
    )
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p

def weights(d):
    from safetensors.torch import load_file
    sd = load_file(str(Path(d) / "model.safetensors"))
    if (Path(d) / "projector.pt").exists():
        sd.update({f"prj.{k}": v for k, v in torch.load(Path(d) / "projector.pt").items()})
    return sd

# Runs compared across process counts or launchers train in float64: fp32 reduction order differs between one process
# and two (and between instruction sets: AVX2 vs AVX-512 kernels), and Adam's first steps turn a near-zero gradient's
# ±1e-7 float noise into ±lr weight noise, so an fp32 tolerance holds on one CPU and not another. In fp64 the same
# runs agree to ~1e-15; 1e-10 leaves margin and still fails on any real difference (a wrong shard, a lost step).
EXACT = ["--dtype", "fp64"]
EXACT_TOL = 1e-10

def assert_close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    worst = max((x - b[k]).abs().max().item() for k, x in a.items())
    assert worst <= tol, f"max |Δ| = {worst}"
    return worst

def summary(d): return json.loads((Path(d) / "final" / "training_summary.json").read_text())

STAGES = {
    "sft": lambda data: [
        "sft", "--recipe", "none", "--tokenizer", data / "tokenizer", "--train", data / "corpus/train.jsonl", "--val",
        "", "--size", "nano", "--steps", 3, "--batch_size", 8, "--lr", 1e-3, "--save_every", 0, "--log_every", 1,
    ],
    "codi": lambda data: [
        "codi", "--recipe", "none", "--model", TEACHER, "--train", ROWS, "--val", "", "--max_train", 32, "--steps", 2,
        "--batch_size", 4, "--lr", 1e-4, "--save_every", 0, "--log_every", 1,
    ],
    "grpo": lambda data: [
        "grpo",
        "--recipe",
        "none",
        "--model",
        TEACHER,
        "--train",
        ROWS,
        "--max_train",
        16,
        "--steps",
        2,
        "--batch_size",
        2,
        "--group_size",
        4,
        "--max_new_tokens",
        200,
        "--lr",
        5e-5,
        "--warmup",
        0,
        "--save_every",
        0,
        # Adam turns float noise in near-zero gradients into ~0.1·lr weight noise
        "--record_every",
        0,
        "--dynamic_sampling",   # groups whose rewards are all equal are replaced: the 2 steps carry a signal
        2,
    ],
}

@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory):
    "The shipped teacher as a latent model with a fresh projector, seeded: every session tests the same student."
    import torch
    from latent_rl.latent import LatentModel
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm, tok = LatentModel.load(TEACHER)
    return lm.save(tmp_path_factory.mktemp("latent") / "student", tok)

STAGES["gkd"] = lambda data, latent: [
    "gkd", "--recipe", "none", "--model", latent, "--teacher", TEACHER, "--train", ROWS, "--max_train", 32,
    "--batch_size", 4, "--max_new_tokens", 48, "--lmbda", 1, "--steps", 2, "--lr", 1e-4, "--save_every", 0,
    "--record_every", 0,
]    # on-policy: latent generation + replay

@pytest.mark.parametrize("stage,strategies", [("sft", ["ddp", "fsdp"]), ("codi", ["ddp", "fsdp"]), ("gkd", ["fsdp"]),
                                              ("grpo", ["ddp", "fsdp"])])
def test_two_processes_equal_one(stage, strategies, tiny_data, latent_dir, tmp_path):
    args = [*(STAGES[stage](tiny_data, latent_dir) if stage == "gkd" else STAGES[stage](tiny_data)), *EXACT]
    launch(1, *args, "--out", tmp_path / "one")
    a = weights(tmp_path / "one" / "final")
    for strategy in strategies:                 # torch DDP (replicated) and FSDP2 (sharded, gathered once at the end)
        launch(2, *args, "--strategy", strategy, "--out", tmp_path / strategy)
        s1, s2 = summary(tmp_path / "one"), summary(tmp_path / strategy)
        assert s1["processes"] == 1 and s2["processes"] == 2
        assert len(s2["param_checksums"]) == 2 and s2["param_checksums"][0] == s2["param_checksums"][1]
        assert_close(a, weights(tmp_path / strategy / "final"), EXACT_TOL)
    base = weights(latent_dir if stage == "gkd" else TEACHER) if stage != "sft" else None
    # training moved the weights
    if base is not None: assert max((a[k] - base[k]).abs().max().item() for k in base) > 1e-6

def kill_after_checkpoint(cmd_args, out, step, nproc=1):
    "Start a run, SIGKILL it (every process of it) as soon as checkpoint `step` exists."
    run = (
        ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
        if nproc > 1
        else []
    )
    p = subprocess.Popen(
        [sys.executable, *run, "-m", "latent_rl.train", *map(str, cmd_args), "--out", str(out)], cwd=ROOT, env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    target = Path(out) / "checkpoints" / f"step-{step}"
    for _ in range(3000):
        if target.exists() or p.poll() is not None: break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {p.stderr.read()[-2000:]}"
    assert not (Path(out) / "final").exists()

def test_sigkill_then_resume_is_exact(tiny_data, tmp_path):
    args = [
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--size", "nano", "--steps", 60, "--batch_size", 16, "--save_every", 4, "--log_every", 1,
    ]
    launch(1, *args, "--out", tmp_path / "full")
    kill_after_checkpoint(args, tmp_path / "part", 8)
    launch(1, *args, "--out", tmp_path / "part", "--resume")
    assert_close(weights(tmp_path / "full" / "final"), weights(tmp_path / "part" / "final"), 1e-6)
    steps = [
        r["step"]
        for r in map(json.loads, (tmp_path / "part" / "metrics.jsonl").read_text().splitlines())
        if "step" in r
    ]
    # rows the killed run wrote past its checkpoint were dropped, then redone
    assert steps == list(range(1, 61))

@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_two_processes_checkpoint_together_and_resume_exactly(tiny_data, tmp_path, strategy):
    """A scheduler's SIGTERM to `torchrun` (which passes it to both ranks): every rank finishes the step, the checkpoint
    is written together and each rank exits 143; `--resume` on two processes ends with the uninterrupted run's weights.
    Before: no checkpoint, everything since the last save_every lost."""
    args = [
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--size", "nano", "--steps", 16, "--batch_size", 16, "--save_every", 0, "--log_every", 1,
        "--strategy", strategy,
    ]
    launch(2, *args, "--out", tmp_path / "full")
    out = tmp_path / "part"
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), "-m", "latent_rl.train", *map(str, args), "--out", str(out)], cwd=ROOT,
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(3000):
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3: break
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert err.count("SIGTERM: stopped after step") == 2, err[-4000:]                      # both ranks, one step
    step = int(err.split("stopped after step ")[1].split(",")[0])
    assert (out / "checkpoints" / f"step-{step}" / "COMPLETE").exists() and not (out / "final").exists()
    launch(2, *args, "--out", out, "--resume")
    assert_close(weights(tmp_path / "full" / "final"), weights(out / "final"), 0.0)         # exactly the same weights

def test_fsdp_sigkill_resume_and_reshard(tiny_data, tmp_path):
    "FSDP2 on 2 processes: each rank writes its shard; SIGKILL + resume is exact; a 2-process checkpoint resumes on 1."
    args = [
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--size", "nano", "--steps", 12, "--batch_size", 16, "--save_every", 4, "--log_every", 1,
        "--strategy", "fsdp",
    ]
    launch(2, *args, "--out", tmp_path / "full")
    kill_after_checkpoint(args, tmp_path / "part", 8, nproc=2)
    ck = tmp_path / "part" / "checkpoints" / "step-8"
    assert (ck / "shards" / ".metadata").exists() and not (ck / "model").exists()       # shards, no gathered copy
    assert len(list((ck / "shards").glob("*.distcp"))) == 2                              # one file per rank
    launch(2, *args, "--out", tmp_path / "part", "--resume")
    assert_close(weights(tmp_path / "full" / "final"), weights(tmp_path / "part" / "final"), 1e-6)
    shutil.copytree(tmp_path / "part", tmp_path / "one")
    shutil.rmtree(tmp_path / "one" / "final")
    shutil.rmtree(tmp_path / "one" / "checkpoints" / "step-4")
    launch(1, *args, "--out", tmp_path / "one", "--resume")  # resharded onto 1 process
    loss = lambda d: {
        r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "step" in r
    }
    assert abs(loss(tmp_path / "one")[9] - loss(tmp_path / "full")[9]) < 1e-5
    assert summary(tmp_path / "one")["processes"] == 1

def test_fresh_run_refuses_a_used_directory(tiny_data, tmp_path):
    args = STAGES["sft"](tiny_data)
    launch(1, *args, "--out", tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "latent_rl.train", *map(str, args), "--out", str(tmp_path)], cwd=ROOT, env=ENV,
        capture_output=True, text=True,
    )
    assert p.returncode != 0 and "holds a previous run" in p.stderr and "--overwrite" in p.stderr
    launch(1, *args, "--out", tmp_path, "--overwrite")
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3]     # the old run's rows are gone, not appended to

def test_grpo_resume_mid_generation_cycle_is_exact(tmp_path):
    # steps_per_generation 2 and a checkpoint every step: the resume starts inside a cycle and must reuse the saved
    # rollout buffer (regenerating with moved weights would change the run)
    args = [
        "grpo", "--recipe", "none", "--model", TEACHER, "--train", ROWS, "--max_train", 16, "--steps", 12,
        "--batch_size", 2, "--group_size", 4, "--max_new_tokens", 200, "--lr", 3e-4, "--warmup", 0,
        "--steps_per_generation", 2, "--save_every", 1, "--record_every", 0,
    ]
    launch(1, *args, "--out", tmp_path / "full")
    kill_after_checkpoint(args, tmp_path / "part", 3)
    import shutil
    from latent_rl.checkpoints import list_checkpoints
    for step, path in list_checkpoints(tmp_path / "part"):
        if step % 2 == 0: shutil.rmtree(path)                     # resume from an odd step: inside a generation cycle
    assert list_checkpoints(tmp_path / "part") and all(s % 2 == 1 for s, _ in list_checkpoints(tmp_path / "part"))
    launch(1, *args, "--out", tmp_path / "part", "--resume")
    assert_close(weights(tmp_path / "full" / "final"), weights(tmp_path / "part" / "final"), 1e-6)

def test_corrupt_checkpoint_is_named_and_skipped(tiny_data, tmp_path):
    args = [
        "sft", "--recipe", "none", "--tokenizer", tiny_data / "tokenizer", "--train", tiny_data / "corpus/train.jsonl",
        "--val", "", "--size", "nano", "--steps", 60, "--batch_size", 8, "--save_every", 2, "--log_every", 1,
    ]
    kill_after_checkpoint(args, tmp_path, 6)
    from latent_rl.checkpoints import list_checkpoints, load_checkpoint_state, CheckpointError
    cks = list_checkpoints(tmp_path)
    newest, previous = cks[-1][1], cks[-2][1]
    st = newest / "state.pt"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])           # truncated mid-write
    with pytest.raises(CheckpointError, match=str(newest)): load_checkpoint_state(newest)
    p = launch(1, *args, "--out", tmp_path, "--steps", cks[-1][0] + 2, "--resume", "--allow_config_change")
    out = p.stdout + p.stderr                                            # the manifest names the bad file first
    assert f"checkpoint {newest}: state.pt has" in out and f"resumed from {previous}" in out, out[-3000:]
    assert previous.exists() or (tmp_path / "final").exists()

def test_accelerate_launch_two_processes(tiny_data, tmp_path):
    "The same script under `accelerate launch` (2 CPU processes, gloo, FSDP2) equals the 1-process run."
    args = [*STAGES["sft"](tiny_data), *EXACT]
    launch(1, *args, "--out", tmp_path / "one")
    p = subprocess.run(
        [
            str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(free_port()), "-m", "latent_rl.train", *map(str, args), "--strategy", "fsdp", "--out",
            str(tmp_path / "acc"),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(tmp_path / "acc")
    assert s["processes"] == 2 and s["param_checksums"][0] == s["param_checksums"][1]
    assert_close(weights(tmp_path / "one" / "final"), weights(tmp_path / "acc" / "final"), EXACT_TOL)

def test_two_nodes_by_rendezvous(tiny_data, tmp_path):
    "Two 'nodes' (two torchrun agents, one process each) meet at a c10d rendezvous on localhost: equal to one process."
    args = [*map(str, STAGES["codi"](tiny_data)), "--strategy", "fsdp", "--save_every", "1"]
    launch(1, *args, "--out", tmp_path / "one")
    port = free_port()
    node = lambda r: subprocess.Popen(
        [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
            str(r), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "latent-rl-test",
            "-m", "latent_rl.train", *args, "--out", str(tmp_path / "nodes"),
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs = [node(0), node(1)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs[0][-3000:] + errs[1][-3000:]
    assert summary(tmp_path / "nodes")["processes"] == 2
    assert_close(weights(tmp_path / "one" / "final"), weights(tmp_path / "nodes" / "final"), 1e-5)
    st = torch.load(tmp_path / "nodes" / "checkpoints" / "step-1" / "state.pt", weights_only=False)
    assert math.isfinite(st["save_peak_mb"])               # rank 0's added peak while writing its shard is recorded

GKD_TEXT = [
    "gkd", "--recipe", "none", "--model", TEACHER, "--teacher", TEACHER, "--train", ROWS, "--max_train", 32,
    "--batch_size", 4, "--max_new_tokens", 48, "--lmbda", 1, "--steps", 2, "--lr", 1e-4, "--save_every", 0,
    "--record_every", 0,
]

@pytest.mark.parametrize("stage", ["codi", "gkd"])
def test_frozen_teacher_sharded_two_processes_equal_one(stage, tiny_data, tmp_path):
    "FSDP2 shards a frozen teacher's layers too (CODI's teacher pass; GKD's text ModelTeacher): 2 processes = 1."
    args = [*STAGES["codi"](tiny_data), "--teacher", TEACHER] if stage == "codi" else GKD_TEXT
    launch(1, *args, "--out", tmp_path / "one")
    p = launch(2, *args, "--strategy", "fsdp", "--out", tmp_path / "fsdp")
    assert "decoder layers sharded over 2 processes" in p.stdout + p.stderr
    assert_close(weights(tmp_path / "one" / "final"), weights(tmp_path / "fsdp" / "final"), 1e-5)

def test_latent_activation_checkpointing_two_processes_equal_one(tiny_data, tmp_path):
    "CODI with every decoder layer recomputed in backward (KV cache included), 2-process FSDP2 = 1 process without."
    args = STAGES["codi"](tiny_data)
    launch(1, *args, "--out", tmp_path / "one")
    launch(2, *args, "--strategy", "fsdp", "--activation_checkpointing", "true", "--out", tmp_path / "ckpt")
    assert_close(weights(tmp_path / "one" / "final"), weights(tmp_path / "ckpt" / "final"), 1e-5)


def test_frozen_teacher_stays_sharded_after_its_forward(tmp_path):
    """`shard_frozen` under 2-process FSDP2: a frozen model never runs backward, so its layers must reshard after each
    forward (a sharded teacher that stays gathered after its first forward saves nothing); `gathered_weights` still
    holds them for a decode and frees them after."""
    out = tmp_path / "probe.json"
    p = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            str(ROOT / "tests" / "frozen_shard_probe.py"), str(out),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    # was: the whole teacher gathered after a forward
    assert r["after_shard"] == 0 and r["after_forward"] == 0, r
    assert r["inside_gathered_weights"] == r["whole_bytes"] and r["after_gathered_weights"] == 0, r


def test_two_process_fsdp_latent_grpo_with_a_kl_reference(latent_dir, tmp_path):
    """kl_beta under 2-process FSDP2: the sharded frozen reference replays latent rollouts whose call counts differ by
    rank."""
    launch(
        2, "grpo", "--model", latent_dir, "--train", ROWS, "--max_train", 16, "--steps", 2, "--batch_size", 2,
        "--group_size", 4, "--max_new_tokens", 64, "--lr", 1e-4, "--warmup", 0, "--save_every", 0, "--record_every", 0,
        "--strategy", "fsdp", "--kl_beta", 0.1, "--out", tmp_path, timeout=300,
    )
    s = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"step"' in l]
    assert len(s) == 2 and all("kl_ref" in r and r["align_abs_max"] <= 1e-4 for r in s)


@pytest.mark.parametrize("fam,scale", [("svp", 1.0), ("dropout", 0.3), ("gumbel", 1.0), ("gaussian", 0.3)])
def test_two_processes_exploring_inside_the_blocks_equal_one(latent_dir, tmp_path, fam, scale):
    """Latent GRPO exploring inside the blocks by every family — a code per rollout (svp and dropout on the projector;
    gumbel on soft tokens, τ 0.5) or sampled latents (gaussian, their densities in the ratio) — with a KL reference
    scoring under the same codes or densities: 2 processes (DDP, FSDP2) train the weights 1 process does, and the ratio
    is 1 at the first step on every rank."""
    model = latent_dir
    if fam == "gumbel":
        from latent_rl.latent import LatentModel
        lm, tok = LatentModel.load(latent_dir)
        lm.spec.soft_temp = 0.5
        model = lm.save(tmp_path / "soft", tok)
    args = [
        "grpo", "--recipe", "none", "--model", model, "--train", ROWS, "--max_train", 16, "--steps", 2,
        "--batch_size", 2, "--group_size", 4, "--max_new_tokens", 200, "--lr", 1e-4, "--warmup", 0, "--save_every", 0,
        "--record_every", 0, "--temperature", 1.0, "--explore", fam, "--explore_scale", scale, "--kl_beta", 0.05,
        "--rewards", "path:1,format:1,correct:1", *EXACT,   # path: a signal in every group, without dynamic sampling
        # (whose refills differ by rank count: each rank refills its own share of the batch)
    ]
    launch(1, *args, "--out", tmp_path / "one")
    a = weights(tmp_path / "one" / "final")
    for strategy in ("ddp", "fsdp"):
        launch(2, *args, "--strategy", strategy, "--out", tmp_path / strategy, timeout=300)
        s = [json.loads(l) for l in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines() if '"step"' in l]
        assert s[0]["align_abs_max"] <= 1e-4 and abs(s[0]["ratio_mean"] - 1) < 1e-5, s[0]   # rollouts score in fp32
        if fam == "gaussian": assert s[0]["latent_align_abs_max"] <= 1e-4, s[0]
        assert_close(a, weights(tmp_path / strategy / "final"), EXACT_TOL)
    base = weights(model)
    assert max((a[k] - base[k]).abs().max().item() for k in base) > 1e-6
