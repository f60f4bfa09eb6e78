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
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server over a copy of the notebook (its data/ linked to the repository's), the project's kernel
    installed."""
    work = tmp_path / "work"
    (work / "nbs").mkdir(parents=True)
    (work / "data").symlink_to(ROOT / "data")
    shutil.copy(ROOT / "nbs" / "23_inspect.ipynb", work / "nbs")
    jp = tmp_path / "jupyter"
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", jp, "--name", "latent_rl",
                    "--display-name", "latent_rl"], check=True, capture_output=True)
    env = {**os.environ, "JUPYTER_PATH": str(jp / "share" / "jupyter"), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    port, token = free_port(), secrets.token_hex(8)
    # the server's log: quoted when the test fails
    log = open(tmp_path / "lab.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                          f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work / 'nbs'}", "--allow-root"],
                         env=env, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(120):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError: time.sleep(0.5)
    try: yield f"http://127.0.0.1:{port}/lab/tree/23_inspect.ipynb?token={token}", work
    finally:
        p.terminate()
        try: p.wait(10)
        except subprocess.TimeoutExpired: p.kill()
        log.close()


def outputs_text(page) -> str:
    "Every output's text (textContent: JupyterLab skips rendering cells outside the view, innerText would miss them)."
    return "\n".join(page.eval_on_selector_all(".jp-OutputArea-output", "els => els.map(e => e.textContent)"))


def prompts_of(page) -> list[str]:
    return page.eval_on_selector_all(".jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.textContent.trim())")


def diagnosis(page, work: Path, why: str) -> str:
    "What a failing run leaves to read: the page's dialogs and kernel status, a screenshot, the server log's tail."
    shot = work.parent / "lab.png"
    page.screenshot(path=str(shot))
    dialogs = page.eval_on_selector_all(".jp-Dialog", "els => els.map(e => e.textContent)")
    status = page.eval_on_selector_all(".jp-Notebook-ExecutionIndicator", "els => els.map(e => e.dataset.status)")
    kernel = page.eval_on_selector_all(".jp-KernelName, .jp-Toolbar-kernelName", "els => els.map(e => e.textContent)")
    log = (work.parent / "lab.log").read_text()[-3000:]
    return (
        f"{why}\nprompts: {prompts_of(page)[:8]}...\ndialogs: {dialogs}\nexecution status: {status}; kernel: {kernel}"
        f"\nscreenshot: {shot}\nserver log (tail):\n{log}"
    )


def run_all(page, work: Path, attempts: int = 3):
    """Run > Run All Cells, retried: under load the menu can open before the notebook is the current widget, when the
    item
    is disabled and a click on it does nothing. Returns once some cell is queued or numbered."""
    for _ in range(attempts):
        page.locator(".jp-Notebook .jp-Cell").first.click()               # the notebook is the current widget
        page.click(".lm-MenuBar-itemLabel:text-is('Run')")
        item = page.locator(".lm-Menu-item:has(.lm-Menu-itemLabel:text-is('Run All Cells'))")
        item.wait_for(timeout=30_000)
        if "lm-mod-disabled" not in (item.get_attribute("class") or ""):
            item.click()
            t0 = time.time()
            while time.time() - t0 < 60:
                if any(p != "[ ]:" for p in prompts_of(page)): return
                assert page.locator(".jp-Dialog >> text=Select Kernel").count() == 0, diagnosis(
                    page, work, "asked for a kernel"
                )
                time.sleep(1)
        page.keyboard.press("Escape")
        time.sleep(5)
    raise AssertionError(diagnosis(page, work, f"Run All Cells started no cell in {attempts} attempts"))


def test_run_all_of_23_inspect_has_no_error_and_a_slider_redraws(lab):
    url, work = lab
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=180_000)
        assert page.locator("text=Select Kernel").count() == 0, diagnosis(
            page, work, "the notebook names the project's kernel"
        )
        run_all(page, work)
        t0 = time.time()
        while time.time() - t0 < 600:                                      # every code cell numbered, none running
            prompts = prompts_of(page)
            idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() == 1
            if idle and prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts): break
            time.sleep(2)
        else: raise AssertionError(diagnosis(page, work, "Run All did not finish in 10 minutes"))
        text = outputs_text(page)
        assert "Traceback" not in text and "SystemExit" not in text, text[-3000:]
        assert (
            page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] >> text=Error").count()
            == 0
        )
        sliders = page.locator(".widget-slider .noUi-handle")
        assert sliders.count() >= 4, sliders.count()                       # the four live inspectors
        img = page.locator(".widget-output img").first
        before = img.get_attribute("src")
        sliders.first.focus()
        page.keyboard.press("ArrowLeft")
        page.wait_for_function(
            "s => { const i = document.querySelector('.widget-output img'); return i && i.src !== s }", arg=before,
            timeout=60_000,
        )                 # the figure redrew
        assert "Traceback" not in outputs_text(page)
        check_anchor_inspector(page, work)
        b.close()
    assert (work / "nbs" / "23_inspect.ipynb").exists()


def middle(locator) -> float:
    "Vertical centre of an element on the page (px)."
    b = locator.bounding_box()
    return b["y"] + b["height"] / 2


def check_anchor_inspector(page, work: Path):
    """The anchor inspector's controls sit on one line, its live logit lens draws, and its smallest text is >= 9 px as
    shown (the PNG is scaled to the output area). Leaves a screenshot of the widget beside the server log."""
    from latent_rl.inspect_runs import FIG_W, MIN_PT
    for no in page.locator(".Toastify button:text-is('No')").all(): no.click()           # the news toast
    buttons = page.locator(".widget-toggle-buttons").first                 # only the anchor inspector has a `source`
    buttons.scroll_into_view_if_needed()
    row = buttons.locator("xpath=..")
    mids = [middle(c) for c in row.locator(":scope > *").all()]
    assert len(mids) == 3 and max(mids) - min(mids) < 6, f"controls not on one line: vertical centres {mids}"
    label, first = (middle(buttons.locator(q).first) for q in (".widget-label", "button"))
    assert abs(label - first) < 6, "`source` wraps above its buttons"
    img = row.locator("xpath=..").locator(".widget-output img")
    before = img.get_attribute("src")
    buttons.locator("button:text-is('live')").click()
    # a redraw replaces the <img>: poll the locator
    t0 = time.time()
    while img.get_attribute("src") == before:
        assert time.time() - t0 < 120, diagnosis(page, work, "the anchor inspector did not redraw in live mode")
        time.sleep(1)
    shown, natural = img.evaluate("i => [i.getBoundingClientRect().width, i.naturalWidth]")
    assert natural == FIG_W * 100, natural                                  # to_png at 100 dpi
    px = MIN_PT / 72 * shown / FIG_W
    assert px >= 9, f"smallest text {px:.1f} px as shown ({shown:.0f} of {natural} px)"
    row.locator("xpath=..").screenshot(path=str(work.parent / "anchor_inspector.png"))
    assert "Traceback" not in outputs_text(page)
