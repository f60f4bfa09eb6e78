"""Build the documentation site from the notebooks: `make docs` (MkDocs + mkdocs-jupyter, from the package index alone).

Why this builder: nbdev's own site needs the Quarto binary, which these machines cannot fetch; MkDocs with
mkdocs-jupyter renders notebooks with their saved outputs (figures included) and installs from PyPI. The pages read
like nbdev's: the `#|` directives are hidden (a `#| hide` cell entirely), an exported cell shows as the signature and
docstring of each public name it defines (`show_doc` style) with its code one click away, and the examples show in
full with their saved outputs, without `In [ ]:` prompts. Navigation follows the pipeline (data and jail, models and
losses, the stages, inspect and diagnose, tools); the guide is one page per topic; the index page is
`nbs/index.ipynb` (the README's source). Widgets are not live on a static page; the figures the notebooks save beside
them show instead. Output: `_site/` (open `_site/index.html`).
"""
import ast, html, importlib, inspect, json, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC, SITE = ROOT / "_docs" / "src", ROOT / "_site"
DIRECTIVE = re.compile(r"^\s*#\|.*$\n?", re.M)
# the pipeline's sections, by notebook number (the first characters of a lesson's file name)
SECTIONS = [("Data and jail", ("00", "01", "02", "03")), ("Models and losses", ("04", "05", "06", "07", "08", "09")),
            ("The stages", ("10", "11", "12", "13", "14", "15", "16", "17", "18", "19", "20")),
            ("Inspect and diagnose", ("21", "22", "23")), ("Tools", ("24", "25", "26", "27", "28", "29", "30"))]


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


def export_cell(src: str, mod) -> dict:
    "An exported cell as the docs show it: the API entry of each public name it defines, its code one click away."
    code = DIRECTIVE.sub("", src).strip("\n")
    try: tree = ast.parse(re.sub(r"^\s*%.*$", "", src, flags=re.M))
    except SyntaxError: tree = ast.Module(body=[], type_ignores=[])
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
    entries = [api_entry(getattr(mod, n), n) for n in names if mod is not None and hasattr(mod, n)]
    defined = [n.name for n in tree.body if hasattr(n, "name")]
    label = "source" if entries else f"source ({', '.join(defined)})" if defined else "source (imports and constants)"
    fold = f"<details class='src'><summary>{html.escape(label)}</summary><pre><code>{html.escape(code)}</code></pre></details>"
    return {"cell_type": "markdown", "metadata": {}, "source": "\n\n".join(entries + [fold])}


def for_docs(nb: dict, mod) -> dict:
    "The notebook as a page: directives hidden, `#| hide` cells dropped, exported cells as API entries, figure paths."
    cells = []
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "markdown":
            cells.append({**c, "source": src.replace("](../figures/", "](figures/")})
            continue
        if re.search(r"^\s*#\|\s*(hide|default_exp)\b", src, re.M) and not re.search(r"^\s*#\|\s*export", src, re.M):
            continue
        if re.match(r"\s*#\|\s*export", src): cells.append(export_cell(src, mod))
        elif DIRECTIVE.sub("", src).strip():                         # progress bars and warnings are not read
            outs = [o for o in c.get("outputs", []) if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
            cells.append({**c, "source": DIRECTIVE.sub("", src), "outputs": outs})
    return {**nb, "cells": cells}


def guide_pages(nb: dict) -> list[tuple[str, dict]]:
    "The guide as one page per `##` topic: (title, notebook); the first page keeps the guide's title and purpose."
    pages, head = [], []
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "markdown" and (m := re.match(r"##\s+(.+)", src)):
            top = {**c, "source": "# " + src[3:]} if pages else c              # later topics: the page's own title
            pages.append((m.group(1).strip(), ([] if pages else head) + [top]))
        elif pages: pages[-1][1].append(c)
        else: head.append(c)
    return [(t, {**nb, "cells": cs}) for t, cs in pages]


def section_of(stem: str) -> str:
    return next((name for name, nums in SECTIONS if stem[:2] in nums), "Tools")


def no_prompts(text: str) -> str:
    "A page's HTML without the `In [ ]:` / `Out[ ]:` prompt boxes of nbconvert's template."
    return re.sub(r'<div class="jp-(?:Input|Output)Prompt[^"]*">.*?</div>', "", text, flags=re.S)


def _matching_close(text: str, start: int) -> int:
    "The end of the `<ul>` element that opens at `start` (nested lists counted)."
    depth, tag = 0, re.compile(r"<(/?)ul\b[^>]*>")
    for m in tag.finditer(text, start):
        depth += -1 if m.group(1) else 1
        if depth == 0: return m.end()
    return len(text)


def real_toc(text: str) -> str:
    """The page's tables of contents rebuilt from its own headings: mkdocs-jupyter's drop a heading's inline code
    ("What `make demo` measures" → "What measures") and link to an id the heading does not have."""
    heads = re.findall(r'<h([23]) id="([^"]+)">(.*?)<a class="anchor-link"', text, flags=re.S)
    if not heads: return text
    items = "".join(f'<li class="md-nav__item"><a href="#{i}" class="md-nav__link"><span class="md-ellipsis">'
                    f'{"&nbsp;&nbsp;&nbsp;" if lvl == "3" else ""}{t.strip()}</span></a></li>' for lvl, i, t in heads)
    out, pos = [], 0
    for m in re.finditer(r'<ul class="md-nav__list" data-md-component="toc"[^>]*>', text):
        if m.start() < pos: continue
        out += [text[pos:m.end()], items, "</ul>"]
        pos = _matching_close(text, m.start())
    return "".join(out) + text[pos:]


def build() -> Path:
    if SRC.parent.exists(): shutil.rmtree(SRC.parent)
    SRC.mkdir(parents=True)
    sys.path.insert(0, str(ROOT))
    nav, sections, guide = [], {name: [] for name, _ in SECTIONS}, []
    for p in sorted((ROOT / "nbs").glob("*.ipynb"), key=lambda p: (p.stem != "index", p.stem)):
        nb = json.loads(p.read_text())
        if p.stem == "guide":
            for k, (t, page) in enumerate(guide_pages(for_docs(nb, None)), 1):
                (SRC / f"guide_{k:02d}.ipynb").write_text(json.dumps(page))
                guide.append({t: f"guide_{k:02d}.ipynb"})
            continue
        name = module_of(nb)
        mod = importlib.import_module(f"latent_rl.{name}") if name else None
        (SRC / p.name).write_text(json.dumps(for_docs(nb, mod)))
        entry = {title(nb, p.stem): p.name}
        if p.stem == "index": nav.append({"Home": p.name})
        elif p.stem[:1].isdigit(): sections[section_of(p.stem)].append(entry)
        else: guide.append(entry)                                    # guide_paper_recipes: a guide page of its own
    nav += [{"Guide": guide}] + [{name: items} for name, items in sections.items() if items]
    shutil.copytree(ROOT / "figures", SRC / "figures")               # the index page and the stage lessons show them
    (SRC / "extra.css").write_text(
        ".api-entry{border-left:3px solid #6a5acd;padding-left:.8em;margin:1em 0}\n"
        "details.src{margin:.2em 0 1em}details.src>summary{cursor:pointer;color:#6a5acd;font-size:.8em}\n"
        ".md-grid{max-width:none}.md-typeset pre>code,.md-typeset .highlight>pre{font-size:.75em}\n"
    )  # 120-character code lines fit
    cfg = {"site_name": "latent_rl", "docs_dir": str(SRC), "site_dir": str(SITE), "use_directory_urls": False,
           "theme": {"name": "material", "features": ["navigation.sections"]}, "extra_css": ["extra.css"], "nav": nav,
           "plugins": [{"mkdocs-jupyter": {"execute": False, "include_source": True, "ignore_h1_titles": False}}]}
    (SRC.parent / "mkdocs.yml").write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "-f", str(SRC.parent / "mkdocs.yml")], check=True
    )
    for page in SITE.glob("*.html"): page.write_text(real_toc(no_prompts(page.read_text())))
    return SITE / "index.html"


if __name__ == "__main__": print(f"wrote {build()}")
