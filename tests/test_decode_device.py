"""Decoding tuned for the device (issue 69), checked on the CPU: `keyed_sample` in chunks draws what the one-`[B, V]`
original drew (a copy of it is the oracle) with no temporary over its chunk; each decode step of the text and latent
decoders reads the device at most once on the host; a model call's price in positions depends on the device."""
import json, math
from types import SimpleNamespace

import pytest, torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT, TEACHER
import latent_rl.generate as gen
from latent_rl.generate import _hash32, keyed_sample, row_key


def keyed_sample_oracle(logp, keys, t):
    "`keyed_sample` as it was before issue 69: the whole `[B, V]` of float64 scores at once."
    V, dev = logp.shape[-1], logp.device
    vh = _hash32(torch.arange(V, device=dev, dtype=torch.int64) + 0x165667B1)
    k = keys.to(torch.int64)
    h = _hash32(_hash32(_hash32(k) ^ (k >> 32)) + t * 0x27D4EB2F)
    u = (_hash32(h[:, None] ^ vh[None]).to(torch.float64) + 0.5) / 2**32
    return (logp.double() - torch.log(-torch.log(u))).argmax(-1)


@pytest.mark.parametrize("elems", [1, 7, 3 * 64, 1000, 1 << 23])
def test_keyed_sample_in_chunks_draws_the_same(monkeypatch, elems):
    "Many keys, steps and shapes (V no multiple of any chunk; one column a chunk; one chunk), ties, -inf, NaN rows."
    monkeypatch.setattr(gen, "_SAMPLE_ELEMS", elems)
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        B, V = int(torch.randint(1, 24, (1,), generator=g)), int(torch.randint(1, 3000, (1,), generator=g))
        logp = torch.log_softmax(torch.randn(B, V, generator=g) * 4, -1)
        if trial % 4 == 1: logp = logp.half().float()                          # coarse values: exact ties likelier
        if trial % 4 == 2 and V > 1: logp[:, ::2] = -math.inf                    # tokens never drawn
        if trial % 4 == 3: logp[0, V // 2] = math.nan                            # a NaN is argmax's maximum
        keys = torch.randint(0, 2**62, (B,), generator=g)
        for t in (0, 1, int(torch.randint(2, 10**6, (1,), generator=g))):
            assert torch.equal(keyed_sample(logp, keys, t), keyed_sample_oracle(logp, keys, t)), (B, V, t, elems)


def test_keyed_sample_ties_go_to_the_first_index(monkeypatch):
    "Equal best scores in two chunks after the first (every token's noise the same): the first of them wins."
    monkeypatch.setattr(gen, "_SAMPLE_ELEMS", 16)                                 # 16 columns a chunk
    monkeypatch.setattr(gen, "_hash32", lambda x: x & 0)                          # u the same for every token
    gen._VHASH.pop((64, torch.device("cpu")), None)
    lp = torch.full((2, 64), -5.0)
    lp[0, [20, 40]] = -1.0                                                        # chunks 2 and 3 tie
    lp[1, [3, 20, 63]] = -1.0
    try: assert keyed_sample(lp, torch.tensor([5, 6]), 3).tolist() == [20, 3]
    finally: gen._VHASH.pop((64, torch.device("cpu")), None)


class _Largest(TorchDispatchMode):
    "The most elements any op's output holds."
    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor): self.most = max(self.most, o.numel())
        return out


def test_keyed_sample_builds_no_batch_by_vocabulary_temporary(monkeypatch):
    "With chunks of 4,096 scores, no op of a `[16, 10,000]` draw outputs more; the original's are `[16, 10,000]`."
    monkeypatch.setattr(gen, "_SAMPLE_ELEMS", 4096)
    logp, keys = torch.log_softmax(torch.randn(16, 10_000), -1), torch.arange(16)
    keyed_sample(logp, keys, 0)                                                  # the vocabulary's hashes, cached
    with _Largest() as new: got = keyed_sample(logp, keys, 1)
    with _Largest() as old: want = keyed_sample_oracle(logp, keys, 1)
    assert torch.equal(got, want)
    assert new.most <= 4096 < old.most == 16 * 10_000, (new.most, old.most)


# ---- host reads per decode step ----

SYNC_OPS = {"_local_scalar_dense", "nonzero", "equal", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}


class _HostReads(TorchDispatchMode):
    """Counts what would make the host wait for a CUDA device: reading a value (`.item()`, `bool`, `int`, `float`,
    `if t`), `nonzero`, `equal`, boolean indexing (each an op here), plus `.tolist()`, `.cpu()` and `.numpy()`, which
    on a CPU tensor dispatch nothing (patched around the block)."""
    def __init__(self, monkeypatch):
        super().__init__()
        self.n, self.mp = 0, monkeypatch

    def __enter__(self):
        for name in ("tolist", "cpu", "numpy"):
            f = getattr(torch.Tensor, name)
            self.mp.setattr(torch.Tensor, name, lambda *a, _f=f, **k: (self._count(), _f(*a, **k))[1])
        return super().__enter__()

    def __exit__(self, *exc):
        self.mp.undo()
        return super().__exit__(*exc)

    def _count(self): self.n += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in SYNC_OPS or bool_index: self._count()
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def decoding():
    "The shipped tiny teacher as a latent model (a fresh projector), prompts of the corpus (two open a block)."
    from latent_rl.latent import LatentModel
    from latent_rl.tokens import encode
    from latent_rl.trace import prompt_text
    with torch.random.fork_rng():
        torch.manual_seed(0)
        lm, tok = LatentModel.load(TEACHER)
    lm.eval()
    rows = [json.loads(line) for line in (ROOT / "data" / "corpus" / "train.jsonl").read_text().splitlines()[:8]]
    P = [encode(tok, prompt_text(r["code"], r["input"])) for r in rows]
    P[2], P[5] = P[2] + [lm.spec.line_sep_id], P[5] + [lm.spec.line_sep_id]
    return SimpleNamespace(lm=lm, P=P, kw=dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id),
                           keys=[row_key(4, i) for i in range(len(P))])


def _decoders(d):
    """Each decoding path, as a function of the token budget. Its end of sequence is a token the model writes (' ' in
    text, ' =' in latent decoding) so that rows finish at different steps and leave the batch."""
    noisy = type(d.lm)(d.lm.model, d.lm.spec, d.lm.prj).eval().set_noise(0.3)
    forced = [[7] * n + [d.lm.spec.line_sep_id, d.lm.spec.action_sep_id] + [9] * n for n in (3, 40, 8, 20, 1, 30, 5, 12)]
    text, latent = dict(d.kw, eos_id=233), dict(d.kw, eos_id=299)
    return {
        "text greedy": lambda n: gen.generate_text(d.lm.model, d.P, max_new_tokens=n, **text),
        "text keyed": lambda n: gen.generate_text(d.lm.model, d.P, max_new_tokens=n, temperature=1.0, keys=d.keys, **text),
        "latent greedy": lambda n: gen.generate_latent(d.lm, d.P, max_new_tokens=n, **latent),
        "latent keyed, noise": lambda n: gen.generate_latent(noisy, d.P, max_new_tokens=n, temperature=1.0, keys=d.keys,
                                                             noise=noisy.noise, return_latents=True, **latent),
        "latent forced": lambda n: gen.generate_latent(d.lm, d.P, max_new_tokens=n, forced=[f[:n] for f in forced],
                                                       **d.kw),
    }


@pytest.mark.parametrize("path", ["text greedy", "text keyed", "latent greedy", "latent keyed, noise", "latent forced"])
def test_one_host_read_per_decode_step(decoding, monkeypatch, path):
    """Host reads of a whole decode, short and long: each decode step (a model call, or the last token, after which
    none follows) adds at most one (the budgets' difference), and the whole is at most one per step plus the prompt's
    and the gathering's. Before issue
    69 the text decoder read twice a token, the latent one 3 to 5 times. In the long decode rows finish at different
    steps and leave the batch; the latent ones run blocks. (On CUDA, `torch.cuda.set_sync_debug_mode("warn")` reports
    each synchronising call.)"""
    run, got = _decoders(decoding)[path], {}
    for n in (6, 60):
        with _HostReads(monkeypatch) as c: ro = run(n)
        got[n] = (c.n, ro.forward_passes)
    (r6, p6), (r60, p60) = got[6], got[60]
    assert p60 - p6 >= 30 and len({len(c) for c in ro.completion_ids}) > 1, got           # rows ended apart
    if path.startswith("latent"): assert any(ro.latent_at), path
    assert r60 - r6 <= p60 - p6 + 1, got                                          # + the last token's
    assert r60 <= p60 + 30, got


# ---- a model call's price ----

def test_a_calls_price_depends_on_the_device():
    "The CPU's price is the one every result was run at; a CUDA device (named: no GPU needed) gets its own, higher."
    from latent_rl.student import CALL_COST, CALL_COSTS, device_call_cost
    assert device_call_cost("cpu") == CALL_COST == 128.0 and device_call_cost(torch.zeros(2)) == CALL_COST
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))                     # a tensor or model as seen on a GPU
    assert device_call_cost(on_gpu) == device_call_cost("cuda:1") == CALL_COSTS["cuda"] > CALL_COST


# ---- on a GPU (skipped without one) ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("heads,groups", [(32, 8), (12, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attend_runs_in_a_fused_kernel_on_cuda(heads, groups, dtype):
    "With only the memory-efficient kernel allowed (SDPA raises where it refuses the form), one step's attention."
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from latent_rl.lean import _attend, additive_mask
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, heads, 1, 64, generator=g), *torch.randn(2, 4, groups, 37, 64, generator=g).unbind(0)
    keep = torch.ones(4, 1, 1, 37, dtype=torch.bool)
    keep[0, ..., :10] = False
    want = _attend(q.double(), k.double(), v.double(), keep, 0.125)
    qc, kc, vc = (t.to("cuda", dtype) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = _attend(qc, kc, vc, additive_mask(keep.cuda(), dtype), 0.125)       # as `one_step` calls it on CUDA
    assert (got.double().cpu() - want).abs().max() < (3e-2 if dtype == torch.bfloat16 else 1e-4)


@cuda
@pytest.mark.parametrize("latent", [False, True])
def test_decoding_on_cuda_synchronises_once_a_step(latent, decoding):
    "`torch.cuda.set_sync_debug_mode` counts the synchronising calls of a keyed decode, short and long."
    import warnings
    from latent_rl.latent import LatentModel
    lm, _ = LatentModel.load(TEACHER, device="cuda")
    lm.eval()
    kw = dict(decoding.kw, eos_id=299 if latent else 233, temperature=1.0, keys=decoding.keys)
    run = lambda n: (gen.generate_latent(lm, decoding.P, max_new_tokens=n, **kw) if latent
                     else gen.generate_text(lm.model, decoding.P, max_new_tokens=n, **kw))
    got = {}
    for n in (6, 60):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                ro = run(n)
        finally: torch.cuda.set_sync_debug_mode(0)
        got[n] = (sum("synchroniz" in str(x.message) for x in w), ro.forward_passes)
    (r6, p6), (r60, p60) = got[6], got[60]
    assert p60 - p6 >= 30 and r60 - r6 <= p60 - p6 + 1, got
