"Tests of latent_rl.trace: CRUXEval fidelity, the sandbox, and the CWM trace format."
import json, os, sys, time, uuid
from pathlib import Path

import pytest

# the package may not be installed into the venv: import it from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from latent_rl.bench_trace import trace_bench
from latent_rl.trace import (TRACE_TOKENS, TRACE_CONTEXT_START, CALL_SEP, LINE_SEP, RETURN_SEP, EXCEPTION_SEP,
                             ACTION_SEP, ARG_SEP, FRAME_SEP, END_OF_TEXT, LATENT_START, LATENT_END, Frame, make_context,
                             parse_trace, predicted_value, prompt_text, render_frame, render_trace, trace_inprocess)
from latent_rl.pool import TracePool, find_cruxeval, trace_one, trace_rows


def _crux_rows():
    p = find_cruxeval()
    if p is None: pytest.fail("cruxeval_dev.jsonl not found: data/external/cruxeval ships with the repository")
    with open(p) as f: return [json.loads(l) for l in f if l.strip()]


def _failures(rows, res):
    return [(row["id"], r.reason, r.value, row["output"]) for row, r in zip(rows, res)
            if not (r.ok and r.value == row["output"])]


# ---------------------------------------------------------------- fidelity

def test_cruxeval_fidelity_sandboxed():
    rows = _crux_rows()
    assert len(rows) == 400
    res = trace_rows(rows, workers=2, progress=False)
    assert [r.id for r in res] == [row["id"] for row in rows]  # input order
    bad = _failures(rows, res)
    for b in bad: print("FAIL", b)
    assert not bad, f"{len(bad)}/{len(rows)} rows differ"


def test_cruxeval_fidelity_inprocess_and_parse():
    rows = _crux_rows()
    res = [trace_inprocess(r["code"], r["input"], id=r["id"]) for r in rows]
    bad = _failures(rows, res)
    for b in bad: print("FAIL", b)
    assert not bad, f"{len(bad)}/{len(rows)} rows differ"
    for row, r in zip(rows, res):
        p = parse_trace(r.trace)
        assert p.well_formed, (r.id, p.error)
        assert p.frames == r.frames and p.value == r.value == predicted_value(r.trace)
        assert r.n_line_frames == sum(f.kind == "line" for f in r.frames) >= 1
        main_line = f"    return f({row['input']})\n"
        assert (r.frames[0].kind, r.frames[0].line, r.frames[0].locals) == ("line", main_line, {})
        assert (r.frames[1].kind, r.frames[-1].kind, r.frames[-1].line) == ("call", "return", main_line)


# ---------------------------------------------------------------- sandbox

OK1 = {"id": "ok1", "code": "def f(x):\n    y = x + 1\n    return y", "input": "1"}
OK2 = {"id": "ok2", "code": "def f(s):\n    return sorted(set(s))", "input": "'banana'"}


def test_sandbox_batch():
    escape = f"/tmp/latent_rl_escape_{uuid.uuid4().hex}"
    bad = [
        ("loop", "def f():\n    while True:\n        pass", ("frame cap", "timeout")),
        ("loop_untraced", "while True:\n    pass\ndef f():\n    return 1", ("timeout (1 s)",)),
        ("memory", "def f():\n    x = bytearray(10**10)\n    return len(x)", ("memory limit",)),
        (
            "write", f"def f():\n    with open({escape!r}, 'w') as fh:\n        fh.write('x')\n    return 1",
            ("sandbox: opening",),
        ),
        (
            "write_caught",
            f"def f():\n    try:\n        open({escape!r}, 'w')\n    except OSError:\n        pass\n    return 1",
            ("sandbox: opening",),
        ),
        ("remove", "import os\ndef f():\n    os.remove('/tmp/definitely_not_here_latent_rl')", ("sandbox: os.remove",)),
        ("socket", "import socket\ndef f():\n    socket.socket().connect(('127.0.0.1', 9))", ("sandbox: network",)),
        (
            "create_connection", "import socket\ndef f():\n    return socket.create_connection(('127.0.0.1', 9))",
            ("sandbox: network",),
        ),
        ("subprocess", "import subprocess\ndef f():\n    return subprocess.run(['true'])", ("sandbox:",)),
        ("system", "import os\ndef f():\n    return os.system('true')", ("sandbox:",)),
        ("million", "def f():\n    for i in range(10**6):\n        pass\n    return i", ("frame cap",)),
        ("bigpow", "def f():\n    return 10**10**8", ("timeout",)),
        ("c_hang", "import itertools\ndef f():\n    return any(itertools.repeat(0))", ("timeout (1 s; worker killed",)),
        ("exit", "import os\ndef f():\n    os._exit(1)", ("worker crashed (exit code 1)",)),
        ("sysexit", "import sys\ndef f():\n    sys.exit(3)", ("raised SystemExit: 3",)),
    ]
    rows = [OK1]
    for name, code, _ in bad: rows += [{"id": name, "code": code, "input": ""}, OK2]
    t0 = time.monotonic()
    res = trace_rows(rows, workers=2, timeout=1.0, grace=1.0, mem_mb=1024, progress=False)
    elapsed = time.monotonic() - t0
    assert elapsed < 12, elapsed
    by_id = {}
    for r in res: by_id.setdefault(r.id, r)
    for name, _, reasons in bad:
        r = by_id[name]
        print(f"{name:18} {r.reason}")
        assert not r.ok and r.value is None, name
        assert r.reason.startswith(reasons), (name, r.reason)
    goods = [r for r in res if r.id in ("ok1", "ok2")]
    assert len(goods) == 1 + len(bad) and all(r.ok for r in goods)
    assert {r.value for r in goods} == {"2", "['a', 'b', 'n']"}
    assert not os.path.exists(escape)


def test_c_level_hang_is_killed_in_time():
    t0 = time.monotonic()
    r = trace_one("import itertools\ndef f():\n    return any(itertools.repeat(0))", "", timeout=0.5, grace=0.5)
    elapsed = time.monotonic() - t0
    assert not r.ok and "worker killed" in r.reason
    assert 0.9 < elapsed < 5, elapsed


def test_python_loop_times_out_in_worker():
    t0 = time.monotonic()
    r = trace_one("import time\ndef f():\n    x = 1\n    time.sleep(100)", "", timeout=0.5)
    elapsed = time.monotonic() - t0
    assert not r.ok and r.reason == "timeout (0.5 s)", r.reason
    assert elapsed < 5, elapsed
    assert [f.kind for f in r.frames] == ["line", "call", "line", "line", "exception", "exception"]
    assert r.frames[-1].value == "TraceTimeout" and r.trace.endswith(END_OF_TEXT)  # the frames so far come back


def test_workdir_is_private_and_emptied():
    rows = [
        {
            "code": "import os\ndef f():\n    open('a.txt', 'w').write('hi')\n    os.mkdir('d')\n    return sorted(os.listdir('.'))",
            "input": "",
        },
        {"code": "import os\ndef f():\n    return os.listdir('.')", "input": ""},
        {
            "code": "import os, tempfile\ndef f():\n    return os.getcwd() == tempfile.gettempdir() and os.getcwd() != "
            + repr(os.getcwd()),
            "input": "",
        },
        {"code": "def f():\n    print('noise')\n    return input()", "input": ""},
    ]
    res = trace_rows(rows, workers=1, progress=False)
    assert [r.value for r in res[:3]] == ["['a.txt', 'd']", "[]", "True"]
    assert not res[3].ok and res[3].reason.startswith("raised EOFError")
    assert not [
        p for p in Path("/tmp").glob("latent_rl_trace_*") if p.stat().st_mtime > time.time() - 5 and any(p.iterdir())
    ]


def test_pool_survives_repeated_crashes_and_is_reusable():
    crash = {"code": "import os\ndef f():\n    os._exit(7)", "input": ""}
    with TracePool(2, timeout=1.0) as pool:
        res = pool.map([crash, OK1] * 4, progress=False)
        assert [r.ok for r in res] == [False, True] * 4
        assert all(r.reason == "worker crashed (exit code 7)" for r in res[::2])
        res2 = pool.map([OK2, {"code": 3}], progress=False)
        assert res2[0].value == "['a', 'b', 'n']" and res2[1].reason.startswith("bad row")


def test_sandboxed_equals_inprocess():
    code = "def f(xs):\n    d = {}\n    for x in xs:\n        d[x] = d.get(x, 0) + 1\n    return sorted(d.items())"
    r = trace_one(code, "[3, 1, 3]")
    assert r.ok and r.value == "[(1, 1), (3, 2)]"
    assert r.trace == trace_inprocess(code, "[3, 1, 3]").trace
    assert trace_rows([], progress=False) == []


# ---------------------------------------------------------------- format

def test_tokens_context_prompt():
    assert TRACE_TOKENS == ["<|trace_context_start|>", "<|call_sep|>", "<|line_sep|>", "<|return_sep|>",
                            "<|exception_sep|>", "<|action_sep|>", "<|arg_sep|>", "<|frame_sep|>",
                            "<|end_of_text|>", "<|latent_start|>", "<|latent_end|>"]
    assert TRACE_TOKENS == [TRACE_CONTEXT_START, CALL_SEP, LINE_SEP, RETURN_SEP, EXCEPTION_SEP, ACTION_SEP,
                            ARG_SEP, FRAME_SEP, END_OF_TEXT, LATENT_START, LATENT_END]
    assert make_context("def f(x):\n    return x\n\n  ", "1") == \
        "\ndef f(x):\n    return x\ndef main():  # << START_OF_TRACE\n    return f(1)\n"
    assert prompt_text("def f(x):\n    return x", "1") == (
        "<|trace_context_start|>\ndef f(x):\n    return x\ndef main():  # << START_OF_TRACE\n    return f(1)\n"
        "<|frame_sep|><|call_sep|>{}<|action_sep|>def main():\n<|frame_sep|>")


def test_exact_trace():
    r = trace_inprocess("def f(x):\n    y = x + 1\n    return y", "1", id="t")
    assert r.trace == (
        '<|line_sep|>{}<|action_sep|>    return f(1)\n<|frame_sep|>'
        '<|call_sep|>{"x": "1"}<|action_sep|>def f(x):\n<|frame_sep|>'
        '<|line_sep|>{"x": ".."}<|action_sep|>    y = x + 1\n<|frame_sep|>'
        '<|line_sep|>{"x": "..", "y": "2"}<|action_sep|>    return y\n<|frame_sep|>'
        '<|return_sep|><|action_sep|>    return y\n<|arg_sep|>"2"<|frame_sep|>'
        '<|return_sep|><|action_sep|>    return f(1)\n<|arg_sep|>"2"<|frame_sep|>'
        '<|end_of_text|>')
    assert r.to_json() == {"id": "t", "ok": True, "trace": r.trace, "value": "2", "n_line_frames": 3}
    bad = trace_inprocess("def f():\n    raise ValueError('no')", "")
    assert bad.to_json()["reason"] == "raised ValueError: no" and bad.to_json()["ok"] is False


def test_dots_in_loop():
    r = trace_inprocess("def f(xs):\n    t = 0\n    for x in xs:\n        t = t + x\n    return t", "[1, 1]")
    lines = [(f.line.strip(), f.locals) for f in r.frames if f.kind == "line"][1:]
    assert lines == [
        ("t = 0", {"xs": ".."}),
        ("for x in xs:", {"xs": "..", "t": "0"}),
        ("t = t + x", {"xs": "..", "t": "..", "x": "1"}),
        ("for x in xs:", {"xs": "..", "t": "1", "x": ".."}),
        ("t = t + x", {"xs": "..", "t": "..", "x": ".."}),  # x is 1 again: unchanged
        ("for x in xs:", {"xs": "..", "t": "2", "x": ".."}),
        ("return t", {"xs": "..", "t": "..", "x": ".."}),
    ]


def test_recursion_has_separate_scopes():
    r = trace_inprocess("def f(n):\n    if n <= 1:\n        return 1\n    m = n * f(n - 1)\n    return m", "3")
    assert r.ok and r.value == "6"
    assert [f.locals for f in r.frames if f.kind == "call"] == [{"n": "3"}, {"n": "2"}, {"n": "1"}]
    # after f(1) returns, f(2)'s next LINE frame compares with f(2)'s own previous frame, not f(1)'s
    ret_lines = [f.locals for f in r.frames if f.kind == "line" and f.line == "    return m\n"]
    assert ret_lines == [{"n": "..", "m": "2"}, {"n": "..", "m": "6"}]
    assert [f.value for f in r.frames if f.kind == "return"] == ["1", "2", "6", "6"]


def test_caught_and_uncaught_exceptions():
    r = trace_inprocess(
        "def f(d):\n    try:\n        v = d['k']\n    except KeyError:\n        v = -1\n    return v", "{}"
    )
    assert r.ok and r.value == "-1"
    kinds = [(f.kind, f.line.strip(), f.value) for f in r.frames if f.kind != "line"]
    assert kinds == [("call", "def f(d):", None), ("exception", "v = d['k']", "KeyError"),
                     ("return", "return v", "-1"), ("return", "return f({})", "-1")]
    # an exception leaving a callee: EXCEPTION frames, no RETURN for the callee; caught in the caller
    r = trace_inprocess("def g():\n    raise ValueError('x')\ndef f():\n    try:\n        g()\n    except ValueError as e:\n        return str(e)", "")
    assert r.ok and r.value == "'x'"
    assert [(f.kind, f.line.strip()) for f in r.frames if f.kind in ("exception", "return")] == [
        ("exception", "raise ValueError('x')"), ("exception", "g()"), ("return", "return str(e)"),
        ("return", "return f()"),
    ]
    r = trace_inprocess("def f():\n    return [][0]", "")
    assert not r.ok and r.reason == "raised IndexError: list index out of range"
    assert [f.kind for f in r.frames][-2:] == ["exception", "exception"] and r.trace.endswith(END_OF_TEXT)
    assert not parse_trace(r.trace).well_formed  # no final RETURN frame


def test_list_comprehension():
    r = trace_inprocess("def f(xs):\n    ys = [x + 1 for x in xs]\n    return ys", "[1, 2]")
    assert r.ok and r.value == "[2, 3]"
    comp = "    ys = [x + 1 for x in xs]\n"
    assert [(f.kind, f.locals, f.value) for f in r.frames if f.line == comp] == [
        ("line", {"xs": ".."}, None),
        ("call", {}, None),                     # the comprehension's own scope; its `.0` iterator is hidden
        ("line", {}, None), ("line", {"x": "1"}, None), ("line", {"x": "2"}, None),
        ("return", None, "[2, 3]"),
    ]


def test_nested_function_and_lambda():
    r = trace_inprocess(
        "def f(k):\n    def add(v):\n        return v + k\n    return sorted(map(add, [3, 1]), key=lambda z: -z)", "10"
    )
    assert r.ok and r.value == "[13, 11]"
    calls = [(f.line.strip(), f.locals) for f in r.frames if f.kind == "call"]
    assert calls[0] == ("def f(k):", {"k": "10"})
    assert ("def add(v):", {"v": "3", "k": "10"}) in calls
    assert sum(line.startswith("return sorted") for line, _ in calls) == 2  # the lambda, called twice by sorted


def test_frame_cap_inprocess():
    r = trace_inprocess("def f():\n    i = 0\n    while True:\n        i += 1", "", max_frames=100)
    assert not r.ok and r.reason == "frame cap exceeded (100 frames)" and len(r.frames) == 100


def test_parse_roundtrip_all_kinds():
    frames = [Frame("line", "    return f(1)\n", {}), Frame("call", "def f(x):\n", {"x": "1", "é": "'\\n'"}),
              Frame("line", "    y = x\n", {"x": ".."}), Frame("line", "    y = x\n", None),
              Frame("exception", "    y = x\n", value="ValueError"), Frame("return", "    return y\n", value="'a\"b'"),
              Frame("return", "    return f(1)\n", value="None")]
    text = render_trace(frames)
    p = parse_trace(text)
    assert p.well_formed and p.error is None and p.frames == frames and p.value == "None"
    assert parse_trace(prompt_text("def f(x):\n    return x", "1") + text).frames == frames
    lat = text.replace(LINE_SEP + ACTION_SEP, LINE_SEP + LATENT_START + LATENT_END + ACTION_SEP)
    assert lat != text and parse_trace(lat).frames == frames
    assert (
        render_frame(frames[1])
        == '<|call_sep|>{"x": "1", "\\u00e9": "\'\\\\n\'"}<|action_sep|>def f(x):\n<|frame_sep|>'
    )


@pytest.mark.parametrize("text", [
    "", "garbage", None, 42, END_OF_TEXT,
    '<|line_sep|>{}<|action_sep|>    return f(1)\n<|frame_sep|>',                                 # no end_of_text
    '<|line_sep|>{}<|action_sep|>    return f(1)\n<|frame_sep|><|end_of_text|>',                  # last is not RETURN
    '<|line_sep|>{"a": 1}<|action_sep|>x\n<|frame_sep|><|return_sep|><|action_sep|>x\n<|arg_sep|>"1"<|frame_sep|><|end_of_text|>',
    '<|line_sep|>{"a": "1"<|action_sep|>x\n<|frame_sep|><|end_of_text|>',                          # broken JSON
    '<|line_sep|>["1"]<|action_sep|>x\n<|frame_sep|><|end_of_text|>',                               # not an object
    '<|return_sep|><|action_sep|>x\n<|arg_sep|>1<|frame_sep|><|end_of_text|>',                      # value not a str
    '<|return_sep|><|action_sep|>x\n<|arg_sep|>"1"<|end_of_text|>',                                 # missing frame_sep
    '<|return_sep|>x\n<|arg_sep|>"1"<|frame_sep|><|end_of_text|>',                                  # missing action_sep
    '<|line_sep|>{}<|action_sep|>x<|line_sep|>\n<|frame_sep|><|end_of_text|>',                       # token in the line
    '<|return_sep|><|action_sep|>x\n<|arg_sep|>"1"<|frame_sep|><|end_of_text|>trailing',
    '<|call_sep|><|action_sep|>def f():\n<|frame_sep|><|return_sep|><|action_sep|>x\n<|arg_sep|>"1"<|frame_sep|><|end_of_text|>',
    "<|line_sep|>" + "[" * 100_000,
])
def test_parse_malformed_never_raises(text):
    p = parse_trace(text)
    assert p.well_formed is False and isinstance(p.error, str) and p.error


def test_parse_value_of_truncated_text():
    r = trace_inprocess("def f(x):\n    return x * 2", "21")
    assert predicted_value(r.trace) == "42"
    cut = r.trace[:-len(END_OF_TEXT)]
    p = parse_trace(cut)
    assert not p.well_formed and p.value == "42" and p.frames == r.frames


def test_bench_quick():
    if find_cruxeval() is None: pytest.skip("cruxeval_dev.jsonl not found")
    b = trace_bench(quick=True)
    assert b["name"] == "trace" and isinstance(b["notes"], str) and len(b["rows"]) == 2
    for row in b["rows"]:
        print(row)
        assert row["programs"] == 400 and row["fidelity"] == 1.0 and row["programs_per_s"] > 0
