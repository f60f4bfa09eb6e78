"""Issue 52: the jail against a fourth attacker — no host-wide I/O from a row, no channel between jails, no state a
later row can see, cleanup that cannot stall a worker.

Each kind of attack has its own test here (each failed on 084ad70): flushes of the host's disk and evictions from its
page cache through host files bound into the jail, a lock channel between rows of two jails running at once, pid
and inode counters (and scratch files) that a row leaves for the next, a scratch tree that holds a worker while it
is walked, `/proc` facts of the host, a failure reason a row forges to be traced again on `--resume`, and control
tokens of hub tokenizers that are not shaped `<|…|>`. The same attacks join the hostile suite (`FOURTH` below), which
`test_sandbox.py` and `test_jail.py` run as root and as an ordinary user."""
import json, mmap, os, sysconfig, time, uuid
from pathlib import Path

import pytest

from latent_rl.pool import TracePool, trace_file
from latent_rl.sandbox import sandbox_status

needs_jail = pytest.mark.skipif(not sandbox_status()["available"], reason="no sandbox on this machine")

# each the body of `def f(info)`; info: a host file every jail can open read-only (a stdlib module) and a secret
FOURTH = {
    "fsync_flood": """import os, time
fd, n, t = os.open(info['lib'], os.O_RDONLY), 0, time.monotonic()
while time.monotonic() - t < 0.3:
    for call in (os.fsync, os.fdatasync):
        try: call(fd); n += 1
        except OSError: pass
return n > 0""",
    "fadvise_evict": """import os
n = 0
for d, _, names in os.walk(os.path.dirname(info['lib'])):
    for name in names:
        try:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd); n += 1
        except OSError: pass
return n > 0""",
    "flock_host_file": """import fcntl, os
fd, out = os.open(info['lib'], os.O_RDONLY), {}
for name, fn in (('flock', lambda: fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)),
                 ('lockf', lambda: fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)),
                 ('getlk', lambda: fcntl.fcntl(fd, fcntl.F_GETLK, bytes(32)))):
    try: fn(); out[name] = 'allowed'
    except OSError as e: out[name] = type(e).__name__
return out""",
    "pipe_size": """import fcntl, os
r, w = os.pipe()
try: fcntl.fcntl(w, 1031, 1 << 20); return 'allowed'
except OSError as e: return type(e).__name__""",
    "inotify_watch": """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
return (fd, ctypes.get_errno())""",
    "counters": """import os, threading
open('mine', 'w').close()
t = threading.Thread(target=lambda: None); t.start(); t.join()
return (os.getpid(), os.stat('mine').st_ino, sorted(os.listdir('.')), sorted(os.listdir('/tmp')))""",
    "burn_counters": """import os, threading
for i in range(3000): open('f%d' % i, 'w').close()
for i in range(200):
    t = threading.Thread(target=lambda: None); t.start(); t.join()
return os.getpid()""",
    "deep_tree": """import os, time
n, t = 0, time.monotonic()
try:
    while time.monotonic() - t < 1.5: os.mkdir('a'); os.chdir('a'); n += 1
except OSError as e: return (n, type(e).__name__)
return (n, None)""",
    "host_proc_facts": """out = {}
for p in ('/proc/stat', '/proc/meminfo', '/proc/diskstats', '/proc/pressure/cpu', '/proc/uptime', '/proc/version',
          '/proc/self/mountinfo', '/proc/self/stat', '/proc/sys/kernel/osrelease'):
    try: out[p] = len(open(p).read())
    except OSError as e: out[p] = type(e).__name__
return out""",
    "forged_start_failure": """import os
msg = b'{"ok": false, "reason": "sandbox: the jail could not start (forged)", "value": null, "frames": []}'
for fd in range(3, 64):
    try: os.write(fd, msg)
    except OSError: pass
os._exit(0)""",
}


def _untraced(body: str) -> str:
    "The body of `def f(info)` that runs `body` untraced (the tracer follows the program's own file only): an attack"
    "at full speed, as an attacker would write it."
    src = "def g(info):\n" + "\n".join("    " + line for line in body.split("\n"))
    return f"ns = {{}}\nexec(compile({src!r}, 'u', 'exec'), ns)\nreturn ns['g'](info)"


FOURTH = {k: _untraced(v) for k, v in FOURTH.items()}


def fourth_info() -> dict:
    return {"lib": os.path.join(sysconfig.get_path("stdlib"), "textwrap.py"), "secret": uuid.uuid4().hex}


def fourth_round(got):
    "What the fourth attacker's rows got, through any run (result dicts or `TraceResult`s by id)."
    got = {k: (v if isinstance(v, dict) else v.to_json()) for k, v in got.items()}
    assert set(eval(got["flock_host_file"]["value"]).values()) == {"PermissionError"}, got["flock_host_file"]
    assert got["pipe_size"]["value"] == "'PermissionError'", got["pipe_size"]
    fi = got["inotify_watch"]                              # ctypes is refused by the audit hook; seccomp refuses the call
    assert not fi["ok"] or eval(fi["value"]) == (-1, 1), fi
    assert set(eval(got["host_proc_facts"]["value"]).values()) == {"FileNotFoundError"}, got["host_proc_facts"]
    dt = got["deep_tree"]                                  # its scratch holds 4,096 inodes (under the audit hook, which
    if dt["ok"]:                                           # resolves each path, the row may reach its deadline first)
        n, err = eval(dt["value"])
        assert n < 4096 and err in ("OSError", None), (n, err)
    else: assert dt["reason"].startswith("timeout"), dt
    assert not got["forged_start_failure"]["reason"].startswith("sandbox: the jail could not start"), got["forged_start_failure"]


def _rows(names, info):
    return [{"id": n, "code": "def f(info):\n" + "\n".join("    " + l for l in FOURTH[n].split("\n")),
             "input": repr(info)} for n in names]


def _pool_map(rows, workers=1, **kw):
    with TracePool(workers, timeout=2.0, **kw) as pool: return pool.map(rows, progress=False)


@needs_jail
def test_fourth_round_attacks_fail_inside_the_jail():
    "Every attack of the fourth round, with every layer and with the OS layers alone (the audit hook off)."
    info = fourth_info()
    names = [n for n in FOURTH if n not in ("counters", "burn_counters")]
    for audit in (True, False):
        res = _pool_map(_rows(names, info), _audit=audit)
        fourth_round({r.id: r for r in res})


def _flushes() -> int:
    "Flushes completed by the host's block devices (field 18 of /proc/diskstats), all devices summed."
    n = 0
    for line in open("/proc/diskstats"):
        f = line.split()
        if len(f) >= 18 and not f[2].startswith(("loop", "ram")): n += int(f[17])
    return n


def _cached_pages(path: str) -> int:
    "Pages of `path` in the host's page cache (mincore over a read-only shared map of it)."
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try: assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally: libc.munmap(addr, size)
    finally: os.close(fd)
    return sum(v & 1 for v in vec)


@needs_jail
def test_no_host_flushes_and_no_page_cache_evictions():
    "Rows that fsync a host file for 0.3 s each and fadvise(DONTNEED) the standard library: the host's block devices"
    "see no more flushes than idle (< 1,000 for the run; was ~27,000), and a stdlib file stays cached."
    info = fourth_info()
    open(info["lib"], "rb").read()                                    # cached before the rows run
    before_pages, total = _cached_pages(info["lib"]), (os.path.getsize(info["lib"]) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    assert before_pages == total
    f0 = _flushes()
    res = _pool_map(_rows(["fsync_flood", "fadvise_evict"] * 5, info), workers=2)
    flushed = _flushes() - f0
    print(f"host flushes during 10 hostile rows: {flushed}; {info['lib']}: {_cached_pages(info['lib'])}/{total} pages")
    assert all(r.ok for r in res), [r.reason for r in res]
    assert flushed < 1000, flushed
    assert _cached_pages(info["lib"]) == total


@needs_jail
def test_no_lock_channel_between_parallel_jails():
    "A sender row in one jail takes flocks on a pattern of host library files; a receiver in the other jail, at the same"
    "time, reads the pattern by trying the same locks. With locks refused the receiver learns nothing."
    bits = [int(c) for c in format(int(uuid.uuid4().hex[:4], 16), "016b")]
    files = sorted(str(p) for p in Path(sysconfig.get_path("stdlib")).glob("*.py"))[:16]
    send = ("def f(x):\n    import fcntl, os, time\n    held = []\n    for p, b in zip(x[0], x[1]):\n"
            "        if b:\n            fd = os.open(p, os.O_RDONLY)\n"
            "            try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); held.append(fd)\n"
            "            except OSError: pass\n    time.sleep(1.0)\n    return len(held)")
    recv = ("def f(x):\n    import fcntl, os, time\n    time.sleep(0.4)\n    out = []\n    for p in x[0]:\n"
            "        fd = os.open(p, os.O_RDONLY)\n"
            "        try: fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB); out.append(0)\n"
            "        except BlockingIOError: out.append(1)\n        except OSError: out.append(-1)\n"
            "        os.close(fd)\n    return out")
    rows = [{"id": "send", "code": send, "input": repr((files, bits))},
            {"id": "recv", "code": recv, "input": repr((files, bits))}]
    res = _pool_map(rows, workers=2, _audit=False)
    got = {r.id: r for r in res}
    assert got["send"].ok and got["send"].value == "0", got["send"]       # no lock taken
    assert got["recv"].ok and eval(got["recv"].value) == [-1] * 16, got["recv"].value
    assert eval(got["recv"].value) != bits


COUNTERS = """import os
THREAD = "(lambda t: (t.start(), t.join(), t.native_id)[2])(__import__('threading').Thread(target=len, args=('',)))"
def f(x):
    open('mine', 'w').close()
    tid = eval(THREAD)
    return (os.getpid(), tid, os.stat('mine').st_ino, sorted(os.listdir('.')), sorted(os.listdir('/tmp')))"""


@needs_jail
def test_a_trace_is_a_function_of_its_program_and_input():
    "The same program (its pid, a thread's id, a new file's inode, the scratch's listing) traced first in a fresh jail,"
    "then after rows that made 3,000 files and 200 threads each, gives the same trace: each row has its own PID"
    "namespace and scratch (was: pid 3004, inode 20004 after such a neighbour)."
    info = fourth_info()
    probe = {"id": "probe", "code": COUNTERS, "input": "0"}
    alone = _pool_map([probe])[0]
    res = _pool_map([probe] + _rows(["burn_counters"], info) + [probe] + _rows(["burn_counters"] * 2, info) + [probe])
    assert alone.ok and eval(alone.value)[:2] == (1, 2) and eval(alone.value)[3:] == (["mine"], ["w"]), alone.value
    for r in (res[0], res[2], res[5]):
        assert r.ok and r.value == alone.value and r.trace == alone.trace, (r.value, alone.value)
    assert res[1].ok and res[1].value == "1", res[1]


@needs_jail
def test_deep_scratch_trees_cost_no_more_than_plain_rows():
    "Twelve rows that build a scratch tree as deep as they can for 0.5 s (each followed by a plain sentinel) cost at"
    "most 3x the wall time of twelve rows that spin for 0.5 s making nothing (was: the tree, walked away after its row,"
    "held the worker ~9 s), and every sentinel is right."
    info = fourth_info()
    plain = lambda k: {"id": f"plain{k}", "code": "def f(x):\n    return [x * 2, 'plain']", "input": str(k)}
    spin = _untraced("import time\nt = time.monotonic()\nwhile time.monotonic() - t < 0.5: pass\nreturn (0, 'OSError')")
    deep = FOURTH["deep_tree"].replace("1.5", "0.5")
    rows = lambda body, name: [r for k in range(12) for r in (
        {"id": f"{name}{k}", "code": "def f(info):\n" + "\n".join("    " + l for l in body.split("\n")),
         "input": repr(info)}, plain(k))]
    with TracePool(2, timeout=2.0, _audit=False) as pool:                 # the OS layers alone: the attack at full
        pool.map([plain(k) for k in range(4)], progress=False)              # strength (the audit hook slows mkdir)
        t0 = time.monotonic()
        got = pool.map(rows(deep, "deep"), progress=False)
        t_deep = time.monotonic() - t0
        t0 = time.monotonic()
        spun = pool.map(rows(spin, "spin"), progress=False)
        t_spin = time.monotonic() - t0
    print(f"12 deep-tree rows + 12 sentinels: {t_deep:.2f} s; 12 spinning rows + 12 sentinels: {t_spin:.2f} s")
    assert all(r.ok and r.value == repr([2 * int(r.id[5:]), "plain"]) for r in got + spun if r.id.startswith("plain"))
    for r in got:
        if r.id.startswith("deep"): assert r.ok and eval(r.value)[0] < 4096, (r.id, r.reason, r.value)
    assert t_deep <= 3 * t_spin, (t_deep, t_spin)


@needs_jail
def test_a_forged_start_failure_is_not_traced_again_on_resume(tmp_path):
    "A row that writes the pool's own 'the jail could not start' as its result gets a reason of its own, so `--resume`"
    "keeps it (a real start failure is traced again)."
    info = fourth_info()
    rows = _rows(["forged_start_failure"], info) + [{"id": "ok", "code": "def f(x):\n    return x", "input": "1"}]
    out = tmp_path / "o.jsonl"
    trace_file(rows, out, progress=False, timeout=2.0)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert not got[0]["ok"] and not got[0]["reason"].startswith("sandbox: the jail could not start"), got[0]
    assert got[0]["reason"].startswith("bad result"), got[0]
    assert got[1]["ok"]


def test_control_tokens_of_hub_tokenizers_are_refused():
    "A row whose value spells a control token of the model's own tokenizer that is not shaped <|…|> (Qwen3's"
    "<tool_call>) is refused by the example builders for that tokenizer; our own tokenizer reads it as text."
    from latent_rl.fixtures import fixture_tokenizer
    from latent_rl.tokens import control_tokens, foreign_special, sft_example, add_trace_tokens, train_tokenizer
    from latent_rl.trace import trace_inprocess
    row = {"id": "tc", "code": "def f(x):\n    return '<tool' + '_call>' + x", "input": "'a'"}
    row["trace"] = trace_inprocess(row["code"], row["input"]).trace
    qwen3 = fixture_tokenizer("qwen3", [row["trace"]] * 20)
    add_trace_tokens(qwen3)
    assert "<tool_call>" in control_tokens(qwen3) and "<|endoftext|>" in control_tokens(qwen3)
    assert foreign_special(row) is None                                       # the <|…|> shape alone: no refusal
    assert "<tool_call>" in foreign_special(row, qwen3)
    assert sft_example(qwen3, row) is None
    ours = train_tokenizer([row["trace"]] * 20, vocab_size=300)
    assert sft_example(ours, row) is not None
    plain = {"id": "p", "code": "def f(x):\n    return x + 'tool'", "input": "'a'"}
    plain["trace"] = trace_inprocess(plain["code"], plain["input"]).trace
    assert sft_example(qwen3, plain) is not None
