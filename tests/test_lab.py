"""JupyterLab in a real headless browser (Chromium): `nbs/23_inspect.ipynb` runs top to bottom in the project's kernel
without an error output, and moving a live inspector's slider redraws its figure."""
import os, re, secrets, shutil, socket, subprocess, sys, time
from pathlib import Path

import pytest

from conftest import ROOT

CHROMIUM = os.environ.get("LATENT_RL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make docs installs it)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian: apt-get install chromium)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    "A JupyterLab server over a copy of the notebook (its data/ linked to the repository's), the project's kernel installed."
    work = tmp_path / "work"; (work / "nbs").mkdir(parents=True)
    (work / "data").symlink_to(ROOT / "data")
    shutil.copy(ROOT / "nbs" / "23_inspect.ipynb", work / "nbs")
    jp = tmp_path / "jupyter"
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", jp, "--name", "latent_rl",
                    "--display-name", "latent_rl"], check=True, capture_output=True)
    env = {**os.environ, "JUPYTER_PATH": str(jp / "share" / "jupyter"), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    port, token = free_port(), secrets.token_hex(8)
    p = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                          f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work / 'nbs'}", "--allow-root"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(120):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close(); break
        except OSError: time.sleep(0.5)
    try: yield f"http://127.0.0.1:{port}/lab/tree/23_inspect.ipynb?token={token}", work
    finally:
        p.terminate()
        try: p.wait(10)
        except subprocess.TimeoutExpired: p.kill()


def outputs_text(page) -> str:
    "Every output's text (textContent: JupyterLab skips rendering cells outside the view, innerText would miss them)."
    return "\n".join(page.eval_on_selector_all(".jp-OutputArea-output", "els => els.map(e => e.textContent)"))


def test_run_all_of_23_inspect_has_no_error_and_a_slider_redraws(lab):
    url, work = lab
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        assert page.locator("text=Select Kernel").count() == 0            # the notebook names the project's kernel
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
        t0 = time.time()
        while time.time() - t0 < 600:                                      # every code cell numbered, none running
            prompts = page.eval_on_selector_all(".jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.textContent.trim())")
            idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() == 1
            if idle and prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts): break
            time.sleep(2)
        else: raise AssertionError(f"Run All did not finish in 10 minutes: {prompts}")
        text = outputs_text(page)
        assert "Traceback" not in text and "SystemExit" not in text, text[-3000:]
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] >> text=Error").count() == 0
        sliders = page.locator(".widget-slider .noUi-handle")
        assert sliders.count() >= 4, sliders.count()                       # the four live inspectors
        img = page.locator(".widget-output img").first
        before = img.get_attribute("src")
        sliders.first.focus(); page.keyboard.press("ArrowLeft")
        page.wait_for_function("s => { const i = document.querySelector('.widget-output img'); return i && i.src !== s }",
                               arg=before, timeout=60_000)                 # the figure redrew
        assert "Traceback" not in outputs_text(page)
        b.close()
    assert (work / "nbs" / "23_inspect.ipynb").exists()
