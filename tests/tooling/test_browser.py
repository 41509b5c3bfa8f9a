"""A learner's lab in a real browser: `make lab`'s JupyterLab driven by headless Chromium.

The lab with the shortest run (Lab 1) is opened from a working copy whose graded cells hold the
solution's code; the test runs all cells from JupyterLab's Run menu, then checks what a learner would
see: no error, the plots drawn, a check cell's "passed" line, an ipywidgets slider that redraws what it
shows when moved, and none of the instructor's tools or the news popup. Last, it opens a terminal
(File > New > Terminal) and types the grade command the notebook gives (``nanolab grade
lab01_tokenizer.ipynb``, no folder: the terminal starts in the working copy), which must print the lab's
score line, with full marks. Needs Chromium and its WebDriver (Debian: ``apt-get install -y chromium
chromium-driver``; ``.ci/run`` installs them). Without them the test is skipped, unless
``NANOLAB_BROWSER_TEST=required`` (set by ``.ci/run`` once it has installed them). A failing run saves
screenshots in build/browser-test/ and names them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.lab_server import ROOT, TOKEN, make_lab

LAB = "lab01_tokenizer.ipynb"
PLOT_CELL = "plot"  # grade_ids of the cells checked
WIDGET_CELL = "widget"
CHECK_CELL = "check-pair-counts"
CHECK_PASSED = "pair_counts: all checks passed"
SHOTS = ROOT / "build" / "browser-test"
# The grader's score line for the lab: the notebook, its lab number, points out of the lab's total.
SCORE_LINE = re.compile(rf"^{re.escape(LAB)}\s+\d+\s+(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)(?![\d.])", re.M)
INSTALL = "apt-get install -y chromium chromium-driver"

# Everything the test reads from the page, in one call: per cell, its kind, prompt, outputs and errors.
CELLS_JS = """
return [...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')].map(cell => {
  const outputs = cell.querySelector('.jp-OutputArea');
  const drawn = (root, selector) => root ? [...root.querySelectorAll(selector)]
    .filter(i => i.complete && i.naturalWidth > 100 && i.naturalHeight > 100).map(i => i.src) : [];
  const widgetOutput = cell.querySelector('.widget-output');  // what an interact() callback displays
  return {
    code: cell.classList.contains('jp-CodeCell'),
    prompt: (cell.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
    text: outputs ? outputs.textContent : '',
    images: drawn(outputs, 'img'),
    canvases: outputs ? outputs.querySelectorAll('canvas').length : 0,
    widgetImages: drawn(widgetOutput, 'img'),
    widgetText: widgetOutput ? widgetOutput.textContent : '',
    widgetHTML: widgetOutput ? widgetOutput.innerHTML : '',
    // JupyterLab renders an exception's traceback as stderr text
    error: outputs ? [...outputs.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')]
      .map(e => e.textContent).filter(t => t.includes('Traceback (most recent call last)')).join('\\n') : '',
  };
});
"""

# What the open terminal shows, as text. xterm.js draws on a canvas; in screen reader mode (turned on for
# this test, see _readable_terminals) it also keeps its rows as text in an accessibility tree.
TERMINAL_JS = """
const rows = document.querySelectorAll('.jp-Terminal:not(.lm-mod-hidden) .xterm-accessibility-tree > div');
return [...rows].map(row => row.textContent.replace(/\\u00a0/g, ' ').trimEnd()).join('\\n');
"""


def _browser() -> tuple[str, str] | None:
    """Paths of Chromium and its WebDriver, or None."""
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver") or next(
        (p for p in ("/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver") if os.access(p, os.X_OK)),
        None,
    )
    return (chromium, driver) if chromium and driver else None


def _no_browser(message: str) -> None:
    """Skip, or fail where the browser test is required (CI, once it has installed the browser)."""
    if os.environ.get("NANOLAB_BROWSER_TEST") == "required":
        pytest.fail(message)
    pytest.skip(message)


def _solved_lab(dest: Path) -> list[str | None]:
    """Write the lab to ``dest`` with the solution's code in its graded cells; return each cell's grade_id."""
    lab = json.loads((ROOT / "labs" / LAB).read_text(encoding="utf-8"))
    solution = json.loads((ROOT / "solutions" / LAB).read_text(encoding="utf-8"))
    grade_id = lambda cell: cell["metadata"].get("nbgrader", {}).get("grade_id")  # noqa: E731
    solved = {
        grade_id(c): c["source"]
        for c in solution["cells"]
        if c["metadata"].get("nbgrader", {}).get("solution")
    }
    assert solved, f"solutions/{LAB} has no graded cells"
    for cell in lab["cells"]:
        if grade_id(cell) in solved:
            cell["source"] = solved[grade_id(cell)]
    dest.write_text(json.dumps(lab, indent=1), encoding="utf-8")
    return [grade_id(c) for c in lab["cells"]]


def _grade_command() -> str:
    """The command the lab's notebook tells the learner to grade it with, as it gives it."""
    text = "".join("".join(c["source"]) for c in json.loads((ROOT / "labs" / LAB).read_text())["cells"])
    commands = set(re.findall(r"nanolab grade lab\d\d_\w+\.ipynb", text))
    assert commands == {f"nanolab grade {LAB}"}, f"labs/{LAB} gives {sorted(commands)}"
    return commands.pop()


def _readable_terminals(lab) -> None:
    """Turn on the terminals' screen reader mode in this JupyterLab's settings (the test's own, in its
    temporary state folder), so that what a terminal shows can be read from the page as text."""
    body = json.dumps({"raw": json.dumps({"screenReaderMode": True})}).encode()
    request = urllib.request.Request(
        f"{lab.url}/lab/api/settings/@jupyterlab/terminal-extension:plugin",
        data=body,
        headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"},
        method="PUT",
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 204, f"the terminal settings were not saved ({r.status})"


class Page:
    """The browser, and what a failing test leaves behind: screenshots in build/browser-test/."""

    def __init__(self, driver, lab):
        self.driver, self.lab, self.stage = driver, lab, "starting"

    def cells(self) -> list[dict]:
        return self.driver.execute_script(CELLS_JS)

    def wait(self, what: str, condition, timeout: float):
        """Poll ``condition()`` until it returns something true; fail with ``what`` after ``timeout`` s."""
        self.stage = what
        deadline = time.monotonic() + timeout
        while True:
            result = condition()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.25)

    def show(self, index: int) -> None:
        """Scroll cell ``index`` to the middle of the window."""
        self.driver.execute_script(
            "document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')[arguments[0]]"
            ".scrollIntoView({block: 'center'});",
            index,
        )

    def terminal(self) -> str:
        return self.driver.execute_script(TERMINAL_JS)

    def click_menu(self, menu: str, *items: str) -> None:
        """Click ``menu`` in the menu bar, then each of ``items`` in turn (a submenu, then its item)."""
        from selenium.webdriver.common.by import By

        self.driver.find_element(
            By.XPATH, f"//div[contains(@class, 'lm-MenuBar-itemLabel')][text()='{menu}']"
        ).click()
        for item in items:
            self.wait(
                f"{item!r} in the {menu} menu",
                lambda item=item: [
                    e
                    for e in self.driver.find_elements(
                        By.XPATH, f"//div[contains(@class, 'lm-Menu-itemLabel')][text()='{item}']"
                    )
                    if e.is_displayed()
                ],
                10,
            )[-1].click()

    def save_failure(self) -> list[Path]:
        SHOTS.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^a-z0-9]+", "-", self.stage.lower()).strip("-")
        saved = [SHOTS / f"{name}.png", SHOTS / "page-top.png"]
        self.driver.save_screenshot(str(saved[0]))
        self.driver.execute_script("document.querySelector('.jp-WindowedPanel-outer')?.scrollTo(0, 0)")
        self.driver.save_screenshot(str(saved[1]))
        shutil.copy(self.lab.log, SHOTS / "jupyterlab.log")
        return [*saved, SHOTS / "jupyterlab.log"]


@pytest.mark.sandbox  # it grades the lab from JupyterLab's terminal
@pytest.mark.timeout(480)
def test_a_learner_runs_lab1_in_jupyterlab(tmp_path):
    """In `make lab`'s JupyterLab, in Chromium: Run > Run All Cells on Lab 1 with working code draws its
    plots, prints its checks' passed lines, and its slider redraws; no nbgrader tools, no news popup; and
    the notebook's grade command, typed in a new terminal, grades the learner's copy: full marks."""
    found = _browser()
    if found is None:
        _no_browser(
            f"no Chromium and chromedriver: install them with `{INSTALL}` (Debian/Ubuntu; .ci/run does)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
    except ImportError:
        _no_browser("selenium is not installed: `make setup` installs it (the dev extra)")
    shutil.rmtree(SHOTS, ignore_errors=True)
    work = tmp_path / "work"
    work.mkdir()
    grade_ids = _solved_lab(work / LAB)
    plot, widget, check = (grade_ids.index(g) for g in (PLOT_CELL, WIDGET_CELL, CHECK_CELL))

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(arg)
    with make_lab(tmp_path, f"WORK={work}") as lab:
        _readable_terminals(lab)
        driver = webdriver.Chrome(service=Service(found[1]), options=options)
        page = Page(driver, lab)
        try:
            started = time.monotonic()
            driver.get(f"{lab.url}/lab/tree/{LAB}?token={TOKEN}")
            page.wait("the notebook to open", lambda: len(page.cells()) == len(grade_ids), 60)
            page.wait(
                "the kernel to be idle",
                lambda: driver.find_elements(
                    By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']"
                ),
                60,
            )
            page.click_menu("Run", "Run All Cells")

            def finished() -> list[dict] | None:
                cells = page.cells()
                errors = [(i, c["error"]) for i, c in enumerate(cells) if c["error"]]
                if errors:
                    page.show(errors[0][0])  # for the screenshot
                assert not errors, (
                    f"cell {errors[0][0]} ({grade_ids[errors[0][0]]}) failed:\n{errors[0][1][-2000:]}"
                )
                done = all(c["prompt"].strip()[1:-2].isdigit() for c in cells if c["code"])
                return cells if done else None

            cells = page.wait("all cells to run", finished, 180)
            ran = time.monotonic() - started

            page.stage = "the plot"
            page.show(plot)

            def plotted() -> list[dict] | None:
                cells = page.cells()
                return cells if cells[plot]["images"] or cells[plot]["canvases"] else None

            cells = page.wait("the plot to be drawn", plotted, 20)

            page.stage = "the check cell"
            assert CHECK_PASSED in cells[check]["text"], f"the check cell showed: {cells[check]['text']!r}"

            page.stage = "the slider"
            page.show(widget)
            handle = page.wait(
                "the slider", lambda: driver.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle"), 20
            )[0]

            def drawn() -> tuple[str, ...]:
                """What the widget's callback drew (not the slider): its figures' images, else its HTML."""
                shown = page.cells()[widget]
                return tuple(shown["widgetImages"]) or (shown["widgetHTML"],)

            before = drawn()
            assert before != ("",), "the widget's output area is empty before the slider moves"
            ActionChains(driver).click_and_hold(handle).move_by_offset(80, 0).release().perform()
            page.wait("the widget to redraw", lambda: drawn() != before, 30)

            page.stage = "the learner's UI"
            menus = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel")]
            assert "Run" in menus and "Nbgrader" not in menus, f"menus: {menus}"
            ui = driver.execute_script(
                "return [...document.querySelectorAll('.jp-Toolbar, .lm-TabBar-tab, .jp-toast-message,"
                " .Toastify__toast')].map(e => e.textContent + ' ' + (e.title || '')).join(' | ')"
            )
            for instructor_only in ("Validate", "Create Assignment", "Jupyter news"):
                assert instructor_only not in ui, f"the learner's JupyterLab shows {instructor_only!r}: {ui}"
            print(f"Lab 1 ran in the browser in {ran:.1f} s")

            command = _grade_command()
            page.stage = "a new terminal"
            page.click_menu("File", "New", "Terminal")
            page.wait("the terminal's prompt", lambda: page.terminal().strip(), 30)
            typed = driver.find_element(
                By.CSS_SELECTOR, ".jp-Terminal:not(.lm-mod-hidden) .xterm-helper-textarea"
            )
            ActionChains(driver).send_keys_to_element(typed, command + Keys.ENTER).perform()

            def graded() -> re.Match | None:
                shown = page.terminal()
                assert "not graded" not in shown, f"`{command}` in the terminal did not grade:\n{shown}"
                return SCORE_LINE.search(shown)

            score = page.wait(f"the score line of `{command}`", graded, 120)
            points, total = float(score[1]), float(score[2])
            assert 0 < total == points, f"the solved copy scored {points}/{total}:\n{page.terminal()}"
            print(f"`{command}` in JupyterLab's terminal: {points}/{total}")
        except Exception as e:
            try:
                saved = page.save_failure()
            except Exception as shot_error:  # a dead browser: say so, keep the first error
                saved = [f"(no screenshot: {shot_error})"]
            names = ", ".join(str(p.relative_to(ROOT)) if isinstance(p, Path) else p for p in saved)
            raise AssertionError(f"{e}\n(at: {page.stage}; saved: {names})") from e
        finally:
            driver.quit()
