"""The guide's field-by-field table of CODI's recipes (nbs/guide_paper_recipes.ipynb) is checked against the recipes
themselves (`latent_rl.recipes.RECIPES`): every `field=value` the table names is what the recipes run, and every field
the CODI recipes set is in the table — the table cannot drift from the code it describes."""
import ast, copy, json, re
from dataclasses import fields
from conftest import ROOT
from latent_rl.recipes import RECIPES
from latent_rl.sft import SFTConfig
from latent_rl.codi import CodiConfig
from latent_rl.gkd import GKDConfig
from latent_rl.grpo import GRPOConfig

GUIDE = ROOT / "nbs" / "guide_paper_recipes.ipynb"
NAMES = {"G": "gpu-gpt2-gsm8k-aug", "L": "gpu-llama3.2-1b-gsm8k-aug"}
CLASSES = (SFTConfig, CodiConfig, GKDConfig, GRPOConfig)
FIELDS = {f.name for c in CLASSES for f in fields(c)}
PAIR = re.compile(r"`(\w+)=([^`]*)`(?:\s*\((G|L)\))?")
# what a run's place and bookkeeping are, not how it trains: the table need not name them
NOT_TABLED = {"model", "out", "val", "save_every", "log_every", "wandb"}

def guide_text() -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(GUIDE.read_text())["cells"] if c["cell_type"] == "markdown")

def claims(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    "Each backticked `field=value` of a config field in the text, with the recipes it is about (G, L or both)."
    return [(f, v, (w,) if w else ("G", "L")) for f, v, w in PAIR.findall(text) if f in FIELDS]

def _value(s: str):
    try: return ast.literal_eval(s)
    except (ValueError, SyntaxError): return s

def resolved(recipes, name: str) -> list[dict]:
    "Each stage's config of a recipe as it runs: the dataclass's defaults under the recipe's fields."
    return [{f.name: f.default for f in fields(c)} | recipes[name].get(c.__name__, {}) for c in CLASSES
            if c.__name__ in recipes[name]]

def mismatches(text: str, recipes) -> list[str]:
    "What the table says that no stage of the recipe runs, and what the CODI recipes set that the table does not name."
    bad, named = [], {f for f, _, _ in claims(text)}
    for f, v, which in claims(text):
        for w in which:
            if not any(f in st and st[f] == _value(v) for st in resolved(recipes, NAMES[w])):
                bad.append(f"{f}={v} ({w}): the recipe {NAMES[w]} runs {[st.get(f) for st in resolved(recipes, NAMES[w])]}")
    for w, name in NAMES.items():
        bad += [f"{f} ({w}): set by {name}'s CodiConfig, not in the table"
                for f in recipes[name]["CodiConfig"] if f not in named | NOT_TABLED]
    return bad

def test_the_guides_recipe_table_is_the_recipes():
    text = guide_text()
    assert len(claims(text)) >= 30, "the table names the recipes' fields as `field=value`"
    assert mismatches(text, RECIPES) == []

def test_the_check_fails_when_a_recipe_moves():
    "Either way a table and its recipes drift apart, the check says where."
    moved = copy.deepcopy(RECIPES)
    moved[NAMES["L"]]["CodiConfig"]["answer_kd"] = 10.0                  # the table still says 20
    moved[NAMES["G"]]["CodiConfig"]["kd_layers"] = "-1"                  # set, and not in the table
    bad = mismatches(guide_text(), moved)
    assert any(b.startswith("answer_kd=20.0 (L)") for b in bad) and any(b.startswith("kd_layers (G)") for b in bad), bad
