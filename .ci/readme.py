"""Write README.md from nbs/index.ipynb (nbdev-readme needs Quarto, which these machines lack).

Markdown cells are copied as they are; code cells without a `#| hide` directive become fenced python blocks.
`python .ci/readme.py --check` exits 1 when README.md is out of step with the notebook."""
import json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def render() -> str:
    nb = json.loads((ROOT / "nbs" / "index.ipynb").read_text())
    out = []
    for c in nb["cells"]:
        src = "".join(c["source"]).strip("\n")
        if c["cell_type"] == "markdown": out.append(src)
        elif c["cell_type"] == "code" and "#| hide" not in src and src:
            out.append("```python\n" + "\n".join(l for l in src.splitlines() if not l.startswith("#|")) + "\n```")
    return "\n\n".join(out) + "\n"

if __name__ == "__main__":
    text, path = render(), ROOT / "README.md"
    if "--check" in sys.argv:
        if not path.exists() or path.read_text() != text:
            sys.exit("README.md is out of step with nbs/index.ipynb: run `make readme`")
        print("README.md in step with nbs/index.ipynb")
    else:
        path.write_text(text)
        print(f"wrote {path}")
