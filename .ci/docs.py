"""Build the documentation site from the notebooks: `make docs` (MkDocs + mkdocs-jupyter, from the package index alone).

Why this builder: nbdev's own site needs the Quarto binary, which these machines cannot fetch; MkDocs with
mkdocs-jupyter renders notebooks with their saved outputs (figures included) and installs from PyPI. We keep nbdev's
conventions: one page per notebook in pipeline order (the notebook numbers), the index page from `nbs/index.ipynb`
(the README's source), and after every export cell the API entry of each public name it defines — its signature and
the docstring the library exports (`show_doc` style). Widgets are not live on a static page; the figures the notebooks
save beside them show instead. Output: `_site/` (open `_site/index.html`).
"""
import ast, importlib, inspect, json, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC, SITE = ROOT / "_docs" / "src", ROOT / "_site"


def title(nb: dict, fallback: str) -> str:
    "The notebook's H1, else its file name."
    for c in nb["cells"]:
        if c["cell_type"] == "markdown" and (m := re.match(r"#\s+(.+)", "".join(c["source"]).strip())):
            return m.group(1).strip()
    return fallback


def module_of(nb: dict) -> str | None:
    "The `#| default_exp` module of a notebook (None for lessons that export nothing)."
    for c in nb["cells"]:
        if m := re.search(r"#\|\s*default_exp\s+(\S+)", "".join(c["source"])): return m.group(1)
    return None


def api_entry(obj, name: str) -> str:
    "A `show_doc`-style entry: the name, its signature and its docstring."
    try: sig = str(inspect.signature(obj))
    except (TypeError, ValueError): sig = ""
    kind = "class" if inspect.isclass(obj) else "def"
    doc = inspect.getdoc(obj) or ""
    return f"<div class='api-entry'>\n\n**`{kind} {name}`**`{sig}`\n\n{doc}\n\n</div>"


def with_api(nb: dict, mod) -> dict:
    "The notebook with an API entry after each export cell for the public functions and classes it defines."
    cells = []
    for c in nb["cells"]:
        cells.append(c)
        src = "".join(c["source"])
        if c["cell_type"] != "code" or not re.match(r"\s*#\|\s*export", src) or mod is None: continue
        try: tree = ast.parse(re.sub(r"^\s*%.*$", "", src, flags=re.M))
        except SyntaxError: continue
        names = [
            n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
        ]
        entries = [api_entry(getattr(mod, n), n) for n in names if hasattr(mod, n)]
        if entries: cells.append({"cell_type": "markdown", "metadata": {}, "source": "\n\n".join(entries)})
    return {**nb, "cells": cells}


def build() -> Path:
    if SRC.parent.exists(): shutil.rmtree(SRC.parent)
    SRC.mkdir(parents=True)
    sys.path.insert(0, str(ROOT))
    nav = []
    for p in sorted((ROOT / "nbs").glob("*.ipynb"), key=lambda p: (p.stem != "index", p.stem)):
        nb = json.loads(p.read_text())
        name = module_of(nb)
        mod = importlib.import_module(f"latent_rl.{name}") if name else None
        (SRC / p.name).write_text(json.dumps(with_api(nb, mod)))
        nav.append({("Home" if p.stem == "index" else title(nb, p.stem)): p.name})
    shutil.copytree(ROOT / "figures", SRC / "figures")               # the index page shows them
    (SRC / "extra.css").write_text(
        ".api-entry{border-left:3px solid #6a5acd;padding-left:.8em;margin:1em 0}\n"
        ".md-grid{max-width:none}.md-typeset pre>code,.md-typeset .highlight>pre{font-size:.75em}\n"
    )  # 120-character code lines fit
    cfg = {"site_name": "latent_rl", "docs_dir": str(SRC), "site_dir": str(SITE), "use_directory_urls": False,
           "theme": {"name": "material", "features": ["navigation.sections"]}, "extra_css": ["extra.css"], "nav": nav,
           "plugins": [{"mkdocs-jupyter": {"execute": False, "include_source": True, "ignore_h1_titles": False}}]}
    (SRC.parent / "mkdocs.yml").write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(SRC.parent / "mkdocs.yml")], check=True
    )
    return SITE / "index.html"


if __name__ == "__main__": print(f"wrote {build()}")
