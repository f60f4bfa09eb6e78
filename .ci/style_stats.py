"""The code-reading figures, measured on the tree: module sizes, long lines, `;`-chained statements, methods attached
to a class by assignment after its body, functions over 80 lines, docstrings written as several string statements,
`policy.kind` branches outside `policy.py`, the README's length, and each lesson's longest stretch of exported code
without an example cell. `python .ci/style_stats.py [--json FILE]` prints a markdown table (and writes the figures as
JSON)."""
import argparse, ast, io, json, re, tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"_modidx.py"}
EXPORT = re.compile(r"^\s*#\|\s*export", re.M)


def semicolons(src: str) -> int:
    "Statements chained with `;` (the operator token, not the character inside strings or comments)."
    return sum(t.type == tokenize.OP and t.string == ";" for t in tokenize.generate_tokens(io.StringIO(src).readline))


def attached_methods(tree: ast.Module) -> list[str]:
    "`Cls.name = ...` at module level, where `Cls` is a class defined in the module: one entry per attached name."
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    out = []
    for n in tree.body:
        if not isinstance(n, ast.Assign): continue
        for t in n.targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in classes:
                    out.append(f"{e.value.id}.{e.attr}")
    return out


def long_functions(tree: ast.Module, limit: int = 80) -> list[tuple[str, int]]:
    "(name, lines) of every function or method longer than `limit` lines (nested functions count in their parent)."
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def split_docstrings(tree: ast.Module) -> list[str]:
    "Functions whose docstring is followed by more bare string statements (`help()` shows only the first)."
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or len(n.body) < 2: continue
        is_str = lambda s: isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)
        if is_str(n.body[0]) and is_str(n.body[1]): out.append(n.name)
    return out


KIND_BRANCH = re.compile(r"\bpolicy\.kind\s*[!=]=|\bself\.policy\.kind\s*[!=]=")


def module_stats(pkg: Path) -> dict:
    mods, lines, over100, over120, semi, attached, long, split, kind = {}, 0, 0, 0, 0, [], [], [], []
    for p in sorted(pkg.glob("*.py")):
        if p.name in GENERATED: continue
        src = p.read_text()
        ls = src.splitlines()
        mods[p.name] = len(ls)
        lines += len(ls)
        over100 += sum(len(l) > 100 for l in ls)
        over120 += sum(len(l) > 120 for l in ls)
        semi += semicolons(src)
        tree = ast.parse(src)
        attached += [f"{p.stem}: {a}" for a in attached_methods(tree)]
        long += [f"{p.stem}.{f} {n}" for f, n in long_functions(tree)]
        split += [f"{p.stem}.{f}" for f in split_docstrings(tree)]
        if p.name != "policy.py": kind += [f"{p.stem}:{i}" for i, l in enumerate(ls, 1) if KIND_BRANCH.search(l)]
    return {"modules": mods, "lines": lines, "over_100": over100, "over_120": over120, "semicolons": semi,
            "attached": attached, "over_700": sorted(m for m, n in mods.items() if n > 700), "over_80_lines": long,
            "split_docstrings": split, "kind_branches": kind}


def silent_stretch(nb: Path) -> int:
    "Longest run of exported code lines (consecutive export cells; markdown between them counts as silence too)."
    best = cur = 0
    for c in json.loads(nb.read_text())["cells"]:
        if c["cell_type"] != "code": continue
        src = "".join(c["source"])
        if EXPORT.search(src):
            cur += len(src.splitlines())
            best = max(best, cur)
        elif src.strip(): cur = 0                                   # an example (or test) cell ends the stretch
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    m = module_stats(ROOT / "latent_rl")
    nbs = {p.name: silent_stretch(p) for p in sorted((ROOT / "nbs").glob("[0-9]*.ipynb"))}
    m["silent_stretch"] = nbs
    top = sorted(m["modules"].items(), key=lambda kv: -kv[1])[:6]
    print("| figure | value |\n|---|---:|")
    print(f"| library lines (generated `_modidx.py` aside) | {m['lines']:,} |")
    print(f"| largest modules | {', '.join(f'{k} {v:,}' for k, v in top)} |")
    print(f"| modules over 700 lines | {len(m['over_700'])} ({', '.join(m['over_700'])}) |")
    print(f"| lines over 100 / 120 characters | {m['over_100'] / m['lines']:.1%} / {m['over_120'] / m['lines']:.1%} |")
    print(f"| `;`-chained statements | {m['semicolons']} |")
    print(f"| methods attached by assignment | {len(m['attached'])} |")
    print(f"| functions over 80 lines | {len(m['over_80_lines'])} {m['over_80_lines'] or ''} |")
    print(f"| docstrings of several string statements | {len(m['split_docstrings'])} |")
    print(f"| `policy.kind` branches outside policy.py | {len(m['kind_branches'])} {m['kind_branches'] or ''} |")
    m["readme_lines"] = len((ROOT / "README.md").read_text().splitlines())
    print(f"| README lines | {m['readme_lines']} |")
    worst = sorted(nbs.items(), key=lambda kv: -kv[1])[:5]
    print(f"| longest exported stretch without an example | {', '.join(f'{k} {v}' for k, v in worst)} lines |")
    if a.json: Path(a.json).write_text(json.dumps(m, indent=1))
    return m


if __name__ == "__main__":
    main()
