"The package's layout: modules import one way along the pipeline (notebook order), the CLI on top, never tests/."
import ast, graphlib, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "latent_rl"


def own_imports(path: Path) -> set[str]:
    "The package modules a module imports, anywhere in it (top level or inside functions)."
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level == 1: out.add(node.module.split(".")[0])
            elif node.module.startswith("latent_rl."): out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("latent_rl.")}
    return out


def modules() -> dict[str, Path]:
    return {p.stem: p for p in PKG.glob("*.py") if not p.stem.startswith("_")}


def notebook_order() -> dict[str, str]:
    "module -> the number of the notebook that exports it (`00`, `00a`, ...: a letter orders a module's successors)."
    out = {}
    for nb in (ROOT / "nbs").glob("[0-9][0-9]*_*.ipynb"):
        m = re.search(r"#\| default_exp (\w+)", nb.read_text())
        if m: out[m.group(1)] = nb.name.split("_")[0]
    return out


def test_no_import_cycles_and_imports_follow_the_notebook_order():
    graph = {m: own_imports(p) - {m} for m, p in modules().items()}
    list(graphlib.TopologicalSorter(graph).static_order())                  # raises CycleError on a cycle
    order = notebook_order()
    assert set(order) == set(graph), set(order) ^ set(graph)               # one notebook per module
    back = [(m, d) for m, ds in graph.items() for d in ds if order[d] >= order[m]]
    assert not back, f"imports against the notebook order: {back}"


def test_own_imports_sit_at_the_top():
    "A module's imports of the package are top-level statements (none inside functions)."
    inner = []
    for m, p in modules().items():
        tree = ast.parse(p.read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and id(node) not in top
                and (node.level == 1 or (node.module or "").startswith("latent_rl"))
            ):
                inner.append(f"{m}:{node.lineno}")
    assert not inner, inner


def test_cli_is_imported_by_nothing_and_nothing_imports_tests():
    for m, p in modules().items():
        if m == "train": continue
        assert "train" not in own_imports(p), f"{m} imports the CLI"
        assert not re.search(r"""["'/]tests/|\btests\.test_""", p.read_text()), f"{m} reaches into tests/"


def test_every_benchmark_lives_in_a_bench_module():
    "Benchmarks live in `bench` or a `bench_*` module beside it (which `bench`'s command line runs)."
    offenders = [
        m
        for m, p in modules().items()
        if not re.fullmatch(r"bench(_\w+)?", m) and re.search(r"^def (?!cmd_)(\w+_)?bench\(", p.read_text(), re.M)
    ]
    assert not offenders, offenders
