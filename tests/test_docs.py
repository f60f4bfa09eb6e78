"""The documentation site (`make docs`): built from the notebooks, opened in a real headless browser (Chromium)."""
import os, re, shutil, subprocess, sys
from pathlib import Path

import pytest

from conftest import ROOT

CHROMIUM = os.environ.get("LATENT_RL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytest.importorskip("mkdocs_jupyter", reason="the docs extra is not installed (make docs installs it)")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make docs installs it)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian: apt-get install chromium)")


@pytest.fixture(scope="module")
def site():
    subprocess.run([sys.executable, str(ROOT / ".ci" / "docs.py")], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    return ROOT / "_site"


def page_facts(page, path: Path) -> dict:
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return {
        "text": page.inner_text("article"),
        "images": page.eval_on_selector_all(
            "article img", "els => els.filter(e => e.complete && e.naturalWidth > 0).length"
        ),
        "nav": page.inner_text("nav.md-nav--primary").split("\n"),
    }


def test_site_renders_index_and_lessons_with_figures(site):
    "The index (the README's source) and a lesson render their text and a figure; the sidebar is in pipeline order;"
    "a module's page carries the API entries of its exported functions."
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = b.new_page()
        idx, diag, losses = (page_facts(page, site / f"{n}.html") for n in ("index", "22_diagnose", "06_losses"))
        page.set_viewport_size({"width": 1600, "height": 1000})
        page.goto((site / "index.html").as_uri())
        overflow = page.eval_on_selector_all("article pre, article pre > code",            # the pipeline, the commands
                                             "els => Math.max(...els.map(e => e.scrollWidth - e.clientWidth))")
        b.close()
    assert overflow <= 1, f"a code block of the index scrolls by {overflow} px on a 1600-px-wide screen"
    assert "make demo" in idx["text"] and "latent student reasons through its blocks" in idx["text"]
    assert idx["images"] >= 1 and diag["images"] >= 1            # the README's figure; the lesson's saved figures
    assert "latent_usage" in diag["text"]
    nav = idx["nav"]
    assert [n for n in nav if n in ("trace", "losses", "codi", "gkd", "grpo", "diagnose")] == \
        ["trace", "losses", "codi", "gkd", "grpo", "diagnose"]
    # API entries (signature + docstring)
    assert "def grpo_loss" in losses["text"] and "def generalized_jsd" in losses["text"]


def test_pages_read_like_nbdevs(site):
    """Three pages as a reader sees them (the index, a stage lesson, a guide page): no `#|` directive, no `In [ ]:`
    prompt, headings that keep their code in the table of contents; every stage lesson shows a figure; the guide is
    several pages; an exported function shows as its signature and docstring, its code folded."""
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = b.new_page()
        pages = {n: page_facts(page, site / f"{n}.html") for n in ("index", "18_codi", "guide_03")}
        stages = {n: page_facts(page, site / f"{n}.html")["images"] for n in ("18_codi", "19_gkd", "20_grpo")}
        page.goto((site / "index.html").as_uri())
        toc = page.inner_text("nav.md-nav--secondary")
        page.goto((site / "18_codi.html").as_uri())
        folded = page.eval_on_selector_all("article details.src", "els => els.filter(e => !e.open).length")
        b.close()
    for name, f in pages.items():
        assert not re.search(r"(^|\n)\s*#\|", f["text"]), f"{name} shows a directive"
        assert "In [" not in f["text"] and "Out[" not in f["text"], f"{name} shows a prompt"
    assert "What make demo measures" in toc, toc
    assert all(n >= 1 for n in stages.values()), stages
    guide = [x for x in pages["index"]["nav"] if x.strip()]
    assert {"The command line", "The tracer's sandbox", "GRPO"} <= set(guide), guide
    assert "class CodiConfig" in pages["18_codi"]["text"] and folded >= 3
    assert "def run_codi" in pages["18_codi"]["text"] and "acc = setup(" not in pages["18_codi"]["text"]
