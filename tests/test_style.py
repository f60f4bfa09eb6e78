"""The house's size limits, guarded (`.ci/style_stats.py` measures them; this fails when one is crossed): no module over
700 lines (the generated `_modidx.py` aside), no function over 80, no branch on `policy.kind` outside `policy.py`, no
method attached to a training stage's class from outside its body (`@patch`: a stage class is declared whole, so
go-to-definition and `help()` see all of it). On a7b17f3 the first failed (bench.py: 719 lines)."""
import ast, sys
from pathlib import Path
from conftest import ROOT
sys.path.insert(0, str(ROOT / ".ci"))
from style_stats import module_stats                                                   # noqa: E402

LINES, FUNC = 700, 80

def stage_classes(pkg: Path) -> set[str]:
    "Every class of the package that derives, directly or not, from the loop's `Stage`."
    bases = {}
    for p in pkg.glob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ClassDef): bases[n.name] = {b.id for b in n.bases if isinstance(b, ast.Name)}
    found, grew = {"Stage"}, True
    while grew:
        new = {c for c, bs in bases.items() if bs & found} - found
        found |= new
        grew = bool(new)
    return found

def patched_stage_methods(pkg: Path) -> list[str]:
    "`@patch`ed functions whose `self` is a stage class."
    stages, out = stage_classes(pkg), []
    for p in pkg.glob("*.py"):
        for n in ast.parse(p.read_text()).body:
            if (isinstance(n, ast.FunctionDef) and any(getattr(d, "id", None) == "patch" for d in n.decorator_list)
                    and n.args.args and isinstance(a := n.args.args[0].annotation, ast.Name) and a.id in stages):
                out.append(f"{p.stem}: {a.id}.{n.name}")
    return out

def test_modules_and_functions_stay_short():
    m = module_stats(ROOT / "latent_rl")
    assert not [f"{k} {v}" for k, v in m["modules"].items() if v > LINES], "modules over 700 lines"
    assert not m["over_80_lines"], f"functions over {FUNC} lines: {m['over_80_lines']}"

def test_the_policy_owns_the_text_latent_difference():
    assert module_stats(ROOT / "latent_rl")["kind_branches"] == []

def test_stage_classes_are_declared_whole():
    assert {"OnPolicyStage", "GKDStep", "GRPOStep", "CodiStep", "SFTStep"} <= stage_classes(ROOT / "latent_rl")
    assert patched_stage_methods(ROOT / "latent_rl") == []


def test_every_configs_choices_are_its_annotations():
    """The values a config string may take are its field's `Literal` annotation, resolved for every stage's config (an
    annotation that failed to resolve would drop every choice of its class in silence)."""
    from latent_rl.fields import literal_choices
    from latent_rl.sft import SFTConfig
    from latent_rl.codi import CodiConfig
    from latent_rl.gkd import GKDConfig
    from latent_rl.grpo import GRPOConfig
    from latent_rl.plan import PlanConfig
    want = {
        SFTConfig: {"mode", "dtype", "precision", "strategy", "step_blocks", "wandb"},
        CodiConfig: {"curriculum_from", "prj_init", "kd_target", "dtype"},
        GKDConfig: {"truncation_strategy", "teacher_locals", "vllm_mode"},
        GRPOConfig: {"norm", "adv_scale", "replay", "explore", "vllm_mode"},
        PlanConfig: {"stage", "attention", "precision", "strategy"},
    }
    for cls, names in want.items(): assert names <= set(literal_choices(cls)), (cls.__name__, names - set(literal_choices(cls)))
    assert literal_choices(GRPOConfig)["norm"] == ("sequence", "token")


def test_a_codi_runs_config_visits_the_loop_at_most_twice(tmp_path):
    """Following a CODI run's config from `run_codi` (the functions that receive the config object, consecutive calls
    in one module as one visit), the loop's module is visited at most twice — LoRA and the optimizer — where a7b17f3
    visited it 7 times among 15 module changes (checkpoint files, the lock, data loading, W&B all lived there)."""
    from latent_rl.codi import CodiConfig, run_codi
    cfg = CodiConfig(model=str(ROOT / "data/teacher"), train=str(ROOT / "data/corpus/train.jsonl"), val="", steps=2,
                     batch_size=4, max_train=16, log_every=1, save_every=0, out=str(tmp_path / "codi"))
    seq = []
    def tracer(frame, event, arg):
        if event == "call" and "latent_rl" in frame.f_code.co_filename and any(v is cfg for v in frame.f_locals.values()):
            m = Path(frame.f_code.co_filename).name
            if not seq or seq[-1] != m: seq.append(m)
    old = sys.gettrace()
    sys.settrace(tracer)
    try: run_codi(cfg, progress=False)
    finally: sys.settrace(old)
    assert seq[0] == "codi.py" and seq.count("loop.py") <= 2, " → ".join(seq)
