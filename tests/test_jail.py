"""Issue 28: a jail that holds where latent-rl actually runs (as root, in CI and on clusters) and a trace run that loses
nothing when one row misbehaves.

The hostile suite of `test_sandbox.py` (its third round included) runs as root there; here it runs again as an
ordinary user, and inside a pids-capped cgroup; a jail that cannot start, a killed run, rows with 5 MB values and
injected special tokens each cost only their own row."""
import errno, json, os, re, shutil, signal, subprocess, sys, tempfile, time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import latent_rl.sandbox as SB
import latent_rl.pool as PL
from latent_rl.trace import trace_inprocess
from latent_rl.sandbox import sandbox_status
from latent_rl.pool import TracePool
from conftest import ROOT, run_cli
from test_sandbox import ATTACKS, SECRET, _untraced, check, hostile_rows, needs_jail, third_round, shared_rows, host  # noqa: F401,E501 (fixture)
from test_jail4 import fourth_round

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to make a cgroup, or to become an ordinary user)")
USER = 1_900_000_001            # the ordinary user: an uid no account has


def _plain(k):
    return {
        "id": f"plain{k}", "code": "def f(x):\n    return [x * 2, 'plain']", "input": str(k),
        "output": repr([2 * k, "plain"]),
    }


def _write(rows, path):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cli(*args, env=None):
    return [sys.executable, "-m", "latent_rl.train", *map(str, args)]


def _env(**kw):
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **kw}


# ---------------------------------------------------------------- the hostile suite as an ordinary user

def _blocked(paths):
    "(directory, child) pairs: the first directory on each path that others cannot search, and the entry below it."
    out = []
    for p in paths:
        parts = Path(os.path.realpath(p)).parts
        for k in range(1, len(parts) - 1):
            d = Path(*parts[:k + 1])
            if not os.stat(d).st_mode & 0o001:
                if (str(d), parts[k + 1]) not in out: out.append((str(d), parts[k + 1]))
                break
    return out


def as_user(cmd, uid, home):
    "`cmd` as host uid `uid`, in a private mount namespace where the interpreter and the project are reachable (a"
    "directory such as /root, mode 700, is replaced there by an empty tmpfs holding only the entries they need)."
    stage = tempfile.mkdtemp(prefix="latent_rl_user_")
    os.chmod(stage, 0o755)
    lines, pairs = ["set -e"], _blocked([sys.executable, ROOT, sys.prefix])
    for k, (d, c) in enumerate(pairs):
        os.mkdir(f"{stage}/{k}")
        lines.append(f"mount --bind '{d}/{c}' '{stage}/{k}'")
    for d in dict.fromkeys(d for d, _ in pairs): lines.append(f"mount -t tmpfs -o mode=755 tmpfs '{d}'")
    for k, (d, c) in enumerate(pairs): lines += [f"mkdir -p '{d}/{c}'", f"mount --bind '{stage}/{k}' '{d}/{c}'"]
    lines.append(f'exec setpriv --reuid={uid} --regid={uid} --clear-groups -- env HOME={home} "$@"')
    return [
        "unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines), "sh", *cmd,
    ], stage


@needs_jail
@as_root
def test_hostile_suite_as_an_ordinary_user(host):   # noqa: F811 (the fixture imported above)
    "Every attack, through `latent-rl trace` run by an unprivileged uid (bwrap in its own user namespace, as on a"
    "workstation): exit 0, every row answered, every plain row right, no secret anywhere."
    if SB.root_launcher_problem(): pytest.skip(SB.root_launcher_problem())
    work = tempfile.mkdtemp(prefix="latent_rl_as_user_")
    os.chown(work, USER, USER)
    rows = hostile_rows(list(ATTACKS), host)
    src = _write(rows, Path(work) / "hostile.jsonl")
    cmd, stage = as_user(
        _cli("trace", src, "-o", Path(work) / "out.jsonl", "--timeout", 0.5, "--workers", 2), USER, work
    )
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(LATENT_RL_TEST_SECRET=SECRET), capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert SECRET not in p.stdout + p.stderr
        out = [json.loads(l) for l in (Path(work) / "out.jsonl").read_text().splitlines()]
        check(rows, out)
        third_round({r["id"]: r for r in out})
        fourth_round({r["id"]: r for r in out})
        who = subprocess.run(as_user([sys.executable, "-m", "latent_rl.train", "doctor"], USER, work)[0], cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=300)
        assert f"{USER} (yours, unprivileged)" in who.stdout and "FAIL" not in who.stdout, who.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stage, ignore_errors=True)


# ---------------------------------------------------------------- PID exhaustion inside a pids-capped run

@needs_jail
@as_root
def test_pid_exhaustion_in_a_pids_capped_run(tmp_path):
    "The whole run in a pids cgroup of 400 (a stand-in for the host's limit): rows that make thousands of threads cost"
    "only themselves (their jail's uid has its own RLIMIT_NPROC, their jail its own pids cgroup); the run exits 0."
    base = SB._pids_cgroup_base()
    if base is None: pytest.skip("no pids cgroup can be made here")
    cg = os.path.join(base, f"latent_rl_test_{os.getpid()}")
    os.mkdir(cg)
    try:
        Path(cg, "pids.max").write_text("400")
        storm = "def f(info):\n" + "\n".join("    " + l for l in ATTACKS["thread_storm"].split("\n"))
        rows = [
            r
            for k in range(4)
            for r in ({"id": f"storm{k}", "code": storm, "input": "None", "output": "None"}, _plain(k))
        ]
        src = _write(rows, tmp_path / "rows.jsonl")
        sh = f'echo $$ > {cg}/cgroup.procs && exec "$@"'
        p = subprocess.run(["/bin/sh", "-c", sh, "sh", *_cli("trace", src, "-o", tmp_path / "o.jsonl", "--workers", 2)],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        out = {r["id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
        assert all(out[f"plain{k}"]["value"] == repr([2 * k, "plain"]) for k in range(4)), out
        for k in range(4): assert eval(out[f"storm{k}"]["value"])[0] < 128, out[f"storm{k}"]
        assert int(Path(cg, "pids.events").read_text().split()[-1]) == 0     # the run's own cap was never hit
    finally: SB._remove_cgroup(cg)


# ---------------------------------------------------------------- a jail that cannot start costs one row

@needs_jail
def test_a_jail_that_cannot_start_costs_only_its_row(monkeypatch):
    "Three failed starts in a row answer the next row with the reason (after backoff); the run goes on and the rows"
    "after it are traced once jails start again. A machine that cannot start any answers every row, and returns."
    monkeypatch.setattr(PL, "_BACKOFF", 0.001)
    real, calls = SB._Jail.__init__, {"n": 0}
    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] <= 4: raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        real(self, *a, **k)
    monkeypatch.setattr(SB._Jail, "__init__", flaky)
    rows = [_plain(k) for k in range(5)]
    with TracePool(1, unsafe_no_sandbox=False) as pool: res = pool.map(rows, progress=False)
    assert res[0].reason.startswith("sandbox: the jail could not start (") and "[Errno 11]" in res[0].reason, res[
        0
    ].reason
    assert [r.value for r in res[1:]] == [repr([2 * k, "plain"]) for k in range(1, 5)], [r.reason for r in res]
    calls["n"] = -10 ** 9                                             # one jail starts, every later start fails:
    def second_fails(self, *a, **k):                                  # the jail that is up traces every row
        calls["n"] += 1
        if calls["n"] > -10 ** 9 + 1: raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        real(self, *a, **k)
    monkeypatch.setattr(SB._Jail, "__init__", second_fails)
    with TracePool(2, unsafe_no_sandbox=False) as pool: res = pool.map([_plain(k) for k in range(40)], progress=False)
    assert all(r.ok for r in res), {r.reason for r in res}
    starts = {"n": 0}
    def counted(self, *a, **k):
        starts["n"] += 1
        real(self, *a, **k)
    monkeypatch.setattr(SB._Jail, "__init__", counted)
    monkeypatch.setattr(SB, "_bwrap", lambda: "/bin/false")            # every jail dies before it is ready
    t0 = time.monotonic()
    with TracePool(2, unsafe_no_sandbox=False) as pool: res = pool.map([_plain(k) for k in range(30)], progress=False)
    assert all(not r.ok and r.reason.startswith("sandbox: the jail could not start") for r in res), {
        r.reason for r in res
    }
    assert starts["n"] <= PL._START_TRIES * PL._LOST_TO_START + 2, starts  # then the rest are answered without a try
    assert time.monotonic() - t0 < 60


@needs_jail
@as_root
def test_each_jail_of_root_has_its_own_uid_and_pids_cgroup():
    "As root: every jail runs as an uid of its own (not root) inside a pids cgroup of its own, removed when it ends."
    if not sandbox_status().get("drop_uid"): pytest.skip(sandbox_status().get("root_problem"))
    if SB._pids_cgroup_base() is None: pytest.skip("no pids cgroup can be made here")
    with TracePool(2, unsafe_no_sandbox=False) as pool:
        pool.map([_plain(k) for k in range(4)], progress=False)
        ws = list(pool._ws)
        uids = {int(open(f"/proc/{w.p.pid}/status").read().split("Uid:")[1].split()[0]) for w in ws}
        assert len(uids) == 2 and min(uids) >= SB._JAIL_UID0, uids
        for w in ws:
            assert str(w.p.pid) in Path(w.cgroup, "cgroup.procs").read_text().split()
            assert Path(w.cgroup, "pids.max").read_text().strip() == str(SB._JAIL_PIDS)
    assert not any(os.path.exists(w.cgroup) for w in ws)


# ---------------------------------------------------------------- a killed run resumes; memory stays bounded

SLOW = "import time\ndef f(x):\n    time.sleep(0.04)\n    return x * 3"


@needs_jail
def test_a_killed_trace_run_resumes_to_the_same_output(tmp_path):
    "SIGKILL mid-run (the CLI and its jails), then `--resume`: the output equals an uninterrupted run's, and only the"
    "rows the killed run had not finished are traced again."
    rows = [{"id": f"s{k}", "code": SLOW, "input": str(k), "output": str(3 * k)} for k in range(40)]
    src = _write(rows, tmp_path / "rows.jsonl")
    run_cli("trace", src, "-o", tmp_path / "whole.jsonl", "--workers", 2)
    out, partial = tmp_path / "cut.jsonl", tmp_path / "cut.jsonl.partial"
    p = subprocess.Popen(_cli("trace", src, "-o", out, "--workers", 2), cwd=ROOT, env=_env(), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 120
    while time.monotonic() < end and (not partial.exists() or len(partial.read_bytes().splitlines()) < 15):
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    done = len(partial.read_bytes().splitlines()) - 1
    assert 10 <= done < 40 and not out.exists(), done
    r = run_cli("trace", src, "-o", out, "--workers", 2, "--resume")
    resumed = int(re.search(r"\((\d+) rows resumed\)", r.stdout).group(1))
    assert resumed >= done - 1, (resumed, done)                # a torn last line is traced again
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()
    assert not partial.exists()


MEMORY_BOUND_MB = 1000          # the parent's peak, whatever the rows return (baseline ~330 MB: python, torch, the CLI)


@needs_jail
def test_parent_memory_stays_bounded_with_5mb_values(tmp_path):
    "Rows returning 5 MB each: results go to disk as they finish, so the parent's peak does not grow with the rows."
    code = "def f(n):\n    return '\\U0001F600' + 'a' * n"
    rows = [{"id": f"b{k}", "code": code, "input": str(5_000_000 + k), "output": "None"} for k in range(12)]
    p = run_cli("trace", _write(rows, tmp_path / "big.jsonl"), "-o", tmp_path / "o.jsonl", "--workers", 2)
    peak = float(re.search(r"parent peak memory (\d+) MB", p.stdout).group(1))
    assert "12 ok" in p.stdout and peak < MEMORY_BOUND_MB, p.stdout


# ---------------------------------------------------------------- special tokens never reach a target

@needs_jail
def test_an_injected_special_token_cannot_reach_a_target(tmp_path):
    "Rows whose values, locals or exceptions spell a trace token are refused by the tracer (so the corpus never has"
    "them); the same rows traced without the jail are refused by the SFT and CODI example builders."
    from latent_rl.corpus import trace_and_fill
    from latent_rl.tokens import codi_example, foreign_special, sft_example, train_tokenizer
    t = "(lambda n: '<' + '|' + n + '|' + '>')"
    evil = {"value": f"def f(x):\n    return {t}('frame_sep') + x",
            "local": f"def f(x):\n    y = {t}('end_of_text')\n    return len(y) + len(x)",
            "exception": f"def f(x):\n    class E(Exception): pass\n    E.__name__ = {t}('frame_sep')\n"
                         "    try: raise E()\n    except E: pass\n    return x"}
    rows = [{"id": k, "code": c, "input": "'a'", "output": "None"} for k, c in evil.items()] + [
        {"id": "ok", "code": "def f(x):\n    y = x * 2\n    return y", "input": "'a'", "output": "'aa'"}]
    res = PL.trace_rows(rows, workers=1, progress=False)
    assert [r.ok for r in res] == [False, False, False, True], [r.reason for r in res]
    assert all(r.reason.startswith("special token") for r in res[:3]), [r.reason for r in res]
    kept, _ = trace_and_fill(rows, progress=False)
    assert [r["id"] for r in kept] == ["ok"]
    unjailed = [{**r, "trace": trace_inprocess(r["code"], r["input"]).trace} for r in rows]
    tok = train_tokenizer([u["trace"] for u in unjailed] * 10, vocab_size=300)
    for u in unjailed[:3]:
        assert foreign_special(u) and sft_example(tok, u) is None and codi_example(tok, u) is None, u["id"]
    assert sft_example(tok, unjailed[3]) is not None


# ---------------------------------------------------------------- a row cannot change its jail for the rows after it

PROC_WRITES = """import os
RESULT = {}
for pid in (1, 2):
    for name, v in (('autogroup', '19'), ('oom_score_adj', '1000')):
        try:
            with open(f'/proc/{pid}/{name}', 'w') as fh: fh.write(v)
            RESULT[f'{pid}/{name}'] = 'written'
        except OSError as e: RESULT[f'{pid}/{name}'] = type(e).__name__
"""
STATE = "RESULT = (open('/proc/self/oom_score_adj').read().strip(), open('/proc/self/autogroup').read().split()[-1])\n"


@needs_jail
def test_a_row_cannot_change_its_jail_for_later_rows(monkeypatch):
    "The zygote's and server's /proc files (autogroup, oom_score_adj) are not the rows' to write, so the next row of"
    "the same jail runs as the first did. Counterfactual: root starting bwrap itself (the old way), they were."
    if not os.path.exists("/proc/self/autogroup"): pytest.skip("no autogroup scheduling here")
    shared_rows(monkeypatch)                                  # a fresh row has no /proc at all: the shared layout
    rows = [{"id": "w", "code": _untraced(PROC_WRITES), "input": repr(PROC_WRITES)},
            {"id": "s", "code": _untraced(STATE), "input": repr(STATE)}]
    def run():
        with TracePool(1, timeout=2.0, unsafe_no_sandbox=False, _audit=False) as pool:
            return pool.map(rows, progress=False)
    w, s = run()
    assert "written" not in w.value, w.value
    assert eval(s.value) == ("0", "0"), s.value
    if os.geteuid() != 0 or not sandbox_status().get("drop_uid"): return
    monkeypatch.setattr(SB, "_ROOT_DROPS", False)
    monkeypatch.setenv(SB.ROOT_ENV, "1")
    SB.sandbox_status(refresh=True)
    try: w, s = run()
    finally:
        monkeypatch.undo()
        SB.sandbox_status(refresh=True)
    assert "written" in w.value and eval(s.value)[0] == "1000", (w.value, s.value)   # the test can fail
