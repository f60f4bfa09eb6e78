"""The teacher server under careless and hostile clients: every abuse gets a clear 4xx/503 and the server keeps
answering."""
import concurrent.futures, importlib.util, json, os, re, socket, subprocess, sys, time, urllib.error, urllib.request
import pytest
from conftest import ROOT, TEACHER, ROWS, ONE, rows_of

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def start(*args, env=None):
    """`latent-rl serve-teacher --model TEACHER ARGS` on a free loopback port; returns (url, process) once /health
    answers."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "latent_rl.train", "serve-teacher", "--model", str(TEACHER), "--port", str(port),
            *map(str, args),
        ],
        cwd=ROOT,
        env={**os.environ, **ONE, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2): return url, proc
        except Exception:
            if proc.poll() is not None: break
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError("serve-teacher did not start: " + proc.stdout.read())

def stop(proc) -> str:
    proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out

def raw(url, data: bytes, timeout=15.0) -> tuple[int, dict]:
    "Send raw bytes, read the whole answer (the server closes): (status, JSON body)."
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536): buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")

def post(url, obj, path="/v1/completions", headers=None, timeout=30) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + path, json.dumps(obj).encode() if obj is not None else None,
        {"Content-Type": "application/json", **(headers or {})}, method="POST" if obj is not None else "GET",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r: return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e: return e.code, json.loads(e.read() or b"{}")

def healthy(url, within=1.0):
    t0 = time.perf_counter()
    with urllib.request.urlopen(url + "/health", timeout=within) as r: assert r.status == 200
    return time.perf_counter() - t0

@pytest.fixture(scope="module")
def server():
    url, proc = start("--request-timeout", 3, "--idle-timeout", 3)
    yield url
    stop(proc)

def completion_rows(n):
    from latent_rl.policy import Policy
    from latent_rl.gkd import dataset_completion
    tok = Policy.load(TEACHER).tok
    return [(lambda d: d["prompt"] + d["completion"])(dataset_completion(tok, r, "text")) for r in rows_of(ROWS)[:n]]

def test_malformed_requests_get_400s_naming_the_field(server):
    head = lambda cl, body=b"": (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {cl}\r\n\r\n".encode() + body
    )
    code, b = raw(server, head("-1"))
    assert (code, b["error"]["param"]) == (400, "Content-Length"), b
    code, b = raw(server, head(str(10**12)))
    assert code == 413 and "limit" in b["error"]["message"], b
    code, b = raw(server, head("abc"))
    assert code == 400
    code, b = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 411
    cases = {
        "prompt_logprobs": [
            {"prompt": [[1, 2, 3]], "prompt_logprobs": -1},
            {"prompt": [[1, 2, 3]], "prompt_logprobs": 10**9},
        ],
        "prompt[0][1]": [{"prompt": [[1, 2.0, 3]], "prompt_logprobs": 2}, {"prompt": [[1, 10**6]]}],
        "prompt[0]": [{"prompt": [[]]}, {"prompt": [list(range(10, 300)) * 400]}],
    }       # the last: 116,000 tokens
    for param, bodies in cases.items():
        for obj in bodies:
            t0 = time.perf_counter()
            code, b = post(server, obj)
            assert (code, b["error"]["param"]) == (400, param), (obj if len(str(obj)) < 200 else param, b)
            assert time.perf_counter() - t0 < 5                # refused before any forward
    code, b = post(server, {"prompt": [list(range(10, 300)) * 400]})
    assert "maximum context length is 2048" in b["error"]["message"]
    deep = b"[" * 200_000 + b"]" * 200_000
    code, b = raw(server, head(str(len(deep)), deep))
    assert code == 400 and "nested" in b["error"]["message"], b
    code, b = raw(server, head("9", b"{not json"))
    assert code == 400
    code, b = post(server, {"prompt": [[1, 2]], "max_tokens": 5})
    assert (code, b["error"]["param"]) == (400, "max_tokens")
    code, b = post(server, None, path="/nowhere")
    assert code == 404
    healthy(server)

def test_models_reveal_no_local_path(server):
    code, b = post(server, None, path="/v1/models")
    assert code == 200 and b["data"][0]["id"] == "teacher" and b["data"][0]["max_model_len"] == 2048
    text = json.dumps(b)
    assert str(ROOT) not in text and "/" not in b["data"][0]["id"], text

def test_health_and_scoring_within_1s_while_300_requests_are_held_open(server):
    host, port = server.split("//")[1].split(":")
    hostile = []
    for i in range(300):                                   # half-sent: headers promise a body that never comes
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{\"prompt\": [[1, ")
        hostile.append(s)
    try:
        assert healthy(server, within=1.0) < 1.0
        t0 = time.perf_counter()
        code, b = post(
            server, {"prompt": [[10, 11, 12, 13, 14, 15]], "prompt_logprobs": 4, "max_tokens": 1}, timeout=1.0
        )
        assert code == 200 and len(b["choices"][0]["prompt_logprobs"]) == 6 and time.perf_counter() - t0 < 1.0
        time.sleep(3.5)                                    # the request timeout: every held request is answered 408
        answered = 0
        for s in hostile[:20]:
            s.settimeout(5)
            data = s.recv(4096)
            answered += data.startswith(b"HTTP/1.1 408")
        assert answered == 20
    finally:
        for s in hostile: s.close()
    healthy(server)

def test_concurrent_scoring_is_batched():
    "32 concurrent requests share forwards (batch size > 1 in the server's log) and get the answers 32 in a row get."
    url, proc = start("--batch-wait-ms", 20)
    try:
        seqs = completion_rows(32)
        one = lambda s: post(url, {"prompt": [s], "prompt_logprobs": 8, "max_tokens": 1})
        assert one(seqs[0])[0] == 200                     # warm-up
        t0 = time.perf_counter()
        serial = [one(s) for s in seqs]
        t_serial = time.perf_counter() - t0
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(32) as ex: conc = list(ex.map(one, seqs))
        t_conc = time.perf_counter() - t0
    finally:
        out = stop(proc)
    assert all(c == 200 for c, _ in serial + conc)
    for (_, x), (_, y) in zip(serial, conc):                # batching changes no answer (fp32 rounding aside)
        px, py = x["choices"][0]["prompt_logprobs"][5], y["choices"][0]["prompt_logprobs"][5]
        assert px.keys() == py.keys() and all(abs(px[t]["logprob"] - py[t]["logprob"]) < 1e-4 for t in px)
    sizes = [int(m) for m in re.findall(r"batch: (\d+) sequences", out)]
    print(f"\n32 scoring requests: serial {t_serial:.2f}s, concurrent {t_conc:.2f}s ({t_serial / t_conc:.1f}x); "
          f"server batch sizes of the concurrent run: {sizes[33:]}")
    assert max(sizes) > 1, sizes   # the requests shared forwards; how much sooner they finish is `bench`'s to measure

def test_full_queue_answers_503_not_a_dropped_connection():
    url, proc = start("--max-queue", 1, "--batch-wait-ms", 0)
    try:
        seqs = completion_rows(8)
        big = lambda _: post(url, {"prompt": seqs, "prompt_logprobs": 8}, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(16) as ex: res = list(ex.map(big, range(16)))
    finally: stop(proc)
    codes = sorted(c for c, _ in res)
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    assert all("retry" in b["error"]["message"] for c, b in res if c == 503)

def test_api_key_and_exposure():
    p = subprocess.run(
        [
            sys.executable, "-m", "latent_rl.train", "serve-teacher", "--model", str(TEACHER), "--host", "0.0.0.0",
            "--port", str(free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LATENT_RL_API_KEY": ""},
    )
    assert p.returncode != 0 and "--api-key" in p.stderr, p.stderr[-2000:]
    url, proc = start("--api-key", "s3cret")
    try:
        assert post(url, None, path="/v1/models")[0] == 401
        assert post(url, None, path="/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert post(url, None, path="/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
        healthy(url)                                        # /health stays open, as in vLLM
        from latent_rl.teachers import HTTPTeacher, TeacherUnavailable

        with pytest.raises(TeacherUnavailable, match="LATENT_RL_API_KEY"):
            HTTPTeacher(url, topk=4, retries=0, api_key="").models()
        assert HTTPTeacher(url, topk=4, retries=0, api_key="s3cret").models()["id"] == "teacher"
    finally: stop(proc)

def test_http_teacher_explains_a_logprob_cap_it_finds_by_probing(server):
    "vLLM does not advertise --max-logprobs: the start-up probe's 400 becomes the command that fixes it."
    from latent_rl.teachers import HTTPTeacher, TeacherUnavailable
    t = HTTPTeacher(server, topk=64, retries=0)
    t._request = (
        lambda orig: (
            lambda path, payload=None: (
                (lambda r: (r["data"][0].pop("max_logprobs", None), r)[1])(orig(path, payload))
                # a server that, like vLLM, does not say
                if path == "/v1/models"
                else orig(path, payload)
            )
        )
    )(t._request)
    with pytest.raises(TeacherUnavailable, match=r"vllm serve MODEL --max-logprobs 64"): t.models()

def test_serve_rollouts_command_and_engine_choice():
    "The vLLM server command (printed, no vLLM needed here) and the stage's engine choice, on CPU."
    from conftest import run_cli
    out = run_cli("serve-rollouts", "--model", TEACHER, "--max-logprobs", 64, "--print").stdout
    for part in (
        "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model", "--generation-config vllm",
        "--max-logprobs 64", "--logprobs-mode processed_logprobs", "--weight-transfer-config", "--max-model-len 2048",
        "--served-model-name teacher", "--host 127.0.0.1",
    ):
        assert part in out, (part, out)
    p = run_cli(
        "serve-rollouts", "--model", TEACHER, "--host", "0.0.0.0", "--print", check=False, env={"LATENT_RL_API_KEY": ""}
    )
    assert p.returncode != 0 and "--api-key" in p.stderr
    p = run_cli("serve-rollouts", "--model", TEACHER, "--max-model-len", 4096, "--print", check=False)
    assert p.returncode != 0 and "context" in p.stderr
    from latent_rl.policy import Policy
    from latent_rl.vllm import make_vllm_engine
    from latent_rl.grpo import GRPOConfig
    text, latent = Policy(None, None, "text"), Policy(None, None, "latent")          # the kind is all it reads
    assert make_vllm_engine(GRPOConfig(), text) is None
    with pytest.raises(ValueError, match="vllm_mode"):
        make_vllm_engine(GRPOConfig(use_vllm=True, vllm_mode="remote"), text)
    with pytest.raises(ValueError, match="latent blocks"): make_vllm_engine(GRPOConfig(use_vllm=True), latent)
    # the colocated engine needs the extra: the error says how to get it
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match=r"pip install 'latent_rl\[vllm\]'"):
            make_vllm_engine(GRPOConfig(use_vllm=True, model=str(TEACHER)), text)


def test_server_mode_weight_sync_address_is_a_config_field():
    "vllm_sync_host: the address of rank 0's machine that a server on another machine reaches for the NCCL weight sync "
    "(was: always $MASTER_ADDR, 127.0.0.1 under torchrun --standalone, so a remote server hung at rendezvous)."
    from latent_rl.policy import Policy
    from latent_rl.vllm import make_vllm_engine
    from latent_rl.grpo import GRPOConfig
    from latent_rl.gkd import GKDConfig
    url, proc = start()                                      # any server that answers /v1/models will do (no sync here)
    try:
        text = Policy(None, None, "text")
        for cls in (GRPOConfig, GKDConfig):
            eng = make_vllm_engine(
                cls(use_vllm=True, vllm_mode="server", vllm_server=url, vllm_sync_host="trainer-0.cluster"), text
            )
            assert eng.sync_host == "trainer-0.cluster" and eng.model_id
        eng = make_vllm_engine(GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server=url), text)
        assert eng.sync_host == os.environ.get("MASTER_ADDR", "127.0.0.1")
    finally: stop(proc)

def test_device_and_dtype_serve_the_model_they_name():
    "--device cpu --dtype bf16: the served logprobs are the bf16 model's, not the fp32 one's (issue 69)."
    import torch
    from latent_rl.models import load_model
    from latent_rl.serve import score_sequences
    seqs = completion_rows(4)
    url, proc = start("--device", "cpu", "--dtype", "bf16")
    try: code, b = post(url, {"prompt": seqs, "prompt_logprobs": 1, "max_tokens": 1}, timeout=120)
    finally: out = stop(proc)
    assert code == 200 and "on cpu in bf16" in out, out[-2000:]
    served = [[row[str(s[t + 1])]["logprob"] for t, row in enumerate(c["prompt_logprobs"][1:])]
              for s, c in zip(seqs, sorted(b["choices"], key=lambda c: c["index"]))]
    torch.set_num_threads(1)                                 # as the server computes (ONE)
    def gap(dtype):
        local = [sc["actual"].tolist() for sc in score_sequences(load_model(TEACHER, dtype=dtype)[0], seqs, 1)]
        return max(abs(x - y) for r, q in zip(served, local) for x, y in zip(r, q))
    bf16, fp32 = gap("bf16"), gap("fp32")
    assert bf16 < 1e-3 and fp32 > 10 * max(bf16, 1e-4), (bf16, fp32)

def test_device_that_is_not_there_is_refused_in_one_line():
    "--device cuda without CUDA (and a dtype a teacher does not serve in): one line, exit 2, before any weights load."
    import torch
    cases = [("--dtype", "fp64", "--dtype 'fp64': choose one of fp32, bf16, fp16"),
             ("--device", "gpu", "--device 'gpu': choose auto, cpu, cuda or cuda:N")]
    if not torch.cuda.is_available(): cases.append(("--device", "cuda", "--device cuda: no CUDA device here"))
    for flag, value, msg in cases:
        p = subprocess.run([sys.executable, "-m", "latent_rl.train", "serve-teacher", "--model", str(ROOT / "nowhere"),
                            flag, value, "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env={**os.environ, **ONE})
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2 and msg in err[0] and "Traceback" not in p.stderr and not p.stdout, p.stderr[-2000:]
        assert err[1:] == ["(run with --debug for the traceback)"], err
