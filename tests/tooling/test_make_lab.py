"""`make lab`, the learner's way in: a working copy that nothing the project runs fails on or overwrites,
JupyterLab with terminals that start in it and have `nanolab` on their PATH, and none of the instructor's
tools in the learner's UI."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.lab_server import ROOT, TOKEN, Lab, make_lab

sys.path.insert(0, str(ROOT / "scripts"))

import working_copy  # noqa: E402

LAB1 = "lab01_tokenizer.ipynb"
NBGRADER_LAB_EXTENSION = "@jupyter/nbgrader"
NEWS_PLUGIN = "@jupyterlab/apputils-extension:announcements"


def _saved_work(path: Path) -> None:
    """Make the notebook at ``path`` look like a learner's saved work: code typed in, cells run, outputs."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for n, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        cell["source"] = ["# my attempt\n", *cell["source"]]
        cell["execution_count"] = n + 1
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": [f"output {n}\n"]}]
    path.write_text(json.dumps(nb, indent=1), encoding="utf-8")


def test_working_copy_copies_new_labs_and_never_overwrites(tmp_path):
    labs, work = tmp_path / "labs", tmp_path / "work"
    shutil.copytree(ROOT / "labs", labs)
    names = sorted(p.name for p in labs.glob("*.ipynb"))

    first = "\n".join(working_copy.update_working_copy(labs, work))
    assert sorted(p.name for p in work.glob("*.ipynb")) == names
    assert all((work / n).read_bytes() == (labs / n).read_bytes() for n in names)
    assert "Your work lives in" in first and "nanolab grade" in first

    _saved_work(work / LAB1)
    saved = (work / LAB1).read_bytes()
    assert working_copy.update_working_copy(labs, work) == [], "nothing new: nothing to say"
    assert (work / LAB1).read_bytes() == saved

    # labs/ gets a newer version of Lab 1 and a new lab: the new lab is copied, the learner's Lab 1 kept
    (labs / LAB1).write_text((labs / LAB1).read_text() + "\n")
    shutil.copy(labs / LAB1, labs / "lab99_new.ipynb")
    said = "\n".join(working_copy.update_working_copy(labs, work))
    assert (work / LAB1).read_bytes() == saved, "the learner's work was overwritten"
    assert (work / "lab99_new.ipynb").read_bytes() == (labs / "lab99_new.ipynb").read_bytes()
    assert "new lab" in said and "lab99_new.ipynb" in said
    assert f"{LAB1} is newer" in said and "kept as it is" in said

    # a learner who deletes their copy starts over from the current version
    (work / LAB1).unlink()
    working_copy.update_working_copy(labs, work)
    assert (work / LAB1).read_bytes() == (labs / LAB1).read_bytes()
    assert working_copy.update_working_copy(labs, work) == [], "the fresh copy is recorded as up to date"


def test_working_copy_does_not_overwrite_a_file_it_did_not_copy(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / LAB1).write_text("mine")
    assert working_copy.main([str(work)]) == 0
    assert (work / LAB1).read_text() == "mine"


def _fresh_clone(dest: Path) -> Path:
    """A git checkout of this working tree (tracked files, and new ones git does not ignore) at ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def _run(clone: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=clone, capture_output=True, text=True)


def test_saved_work_in_a_fresh_clone_fails_no_check_and_survives_make_labs(tmp_path):
    """A learner who saved their work (outputs and all) where `make lab` put it: the notebook checks the
    suite and CI run still pass, and regenerating labs/ leaves the work as it was."""
    clone = _fresh_clone(tmp_path / "nanolab")
    assert _run(clone, "scripts/working_copy.py", "work").returncode == 0
    saved = clone / "work" / LAB1
    _saved_work(saved)
    before = {p.name: p.read_bytes() for p in (clone / "work").iterdir() if p.is_file()}

    check = _run(clone, "scripts/check_notebooks.py")
    assert check.returncode == 0, check.stderr

    (clone / "labs" / LAB1).write_text("{}")  # stale: `make labs` has something to rewrite
    regenerate = _run(clone, "scripts/make_labs.py")
    assert regenerate.returncode == 0, regenerate.stderr
    assert f"wrote       labs/{LAB1}" in regenerate.stdout
    assert {p.name: p.read_bytes() for p in (clone / "work").iterdir() if p.is_file()} == before
    assert _run(clone, "scripts/check_notebooks.py").returncode == 0

    # the same saved notebook anywhere git would see it does fail the check
    shutil.copy(saved, clone / "labs" / LAB1)
    check = _run(clone, "scripts/check_notebooks.py")
    assert check.returncode == 1 and "has outputs" in check.stderr


async def _run_in_terminal(lab: Lab, command: str, timeout: float = 30) -> str:
    """Open a JupyterLab terminal through its API, type ``command``, and return what the terminal showed."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    headers = {"Authorization": f"token {TOKEN}"}
    request = urllib.request.Request(lab.url + "/api/terminals", data=b"", headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        name = json.load(r)["name"]
    ws_url = lab.url.replace("http://", "ws://") + f"/terminals/websocket/{name}"
    ws = await websocket_connect(HTTPRequest(ws_url, headers=headers))
    # the terminal echoes what is typed, so the end marker is computed: only the shell's answer holds it
    await ws.write_message(json.dumps(["stdin", f"{command}; echo END-$((6*7))\r"]))
    shown, deadline = "", time.monotonic() + timeout
    while "END-42" not in shown:
        message = await asyncio.wait_for(ws.read_message(), max(0.1, deadline - time.monotonic()))
        if message is None:
            break
        kind, *content = json.loads(message)
        if kind == "stdout":
            shown += content[0]
    ws.close()
    return shown


def test_make_lab_opens_the_working_copy_with_nanolab_on_path_and_no_instructor_tools(tmp_path):
    """`make lab` serves the learner's working copy, keeps a saved notebook there as it was, gives its
    terminals the venv's `nanolab`, and loads neither nbgrader (menu, buttons, server extensions) nor the
    news popup."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "labs" / LAB1, work / LAB1)
    _saved_work(work / LAB1)
    saved = (work / LAB1).read_bytes()

    with make_lab(tmp_path, f"WORK={work}") as lab:
        status, body = lab.get("/api/contents/")
        names = {item["name"] for item in json.loads(body)["content"]}
        expected = {p.name for p in (ROOT / "labs").glob("*.ipynb")}
        assert expected and expected <= names, f"JupyterLab serves {sorted(names)}, not the working copy"
        assert (work / LAB1).read_bytes() == saved, "make lab overwrote the learner's saved notebook"

        shown = asyncio.run(_run_in_terminal(lab, "command -v nanolab"))
        assert str(ROOT / ".venv" / "bin" / "nanolab") in shown, f"the terminal showed:\n{shown}"

        disabled = lab.page_config().get("disabledExtensions", [])
        assert NBGRADER_LAB_EXTENSION in disabled and NEWS_PLUGIN in disabled, disabled
        assert lab.page_config()["news"] == {"disabled": True}
        loaded = lab.loaded_server_extensions()
        assert "jupyterlab" in loaded, lab.output()[-3000:]
        assert not {e for e in loaded if e.startswith("nbgrader")}, loaded
        assert lab.get("/formgrader")[0] == 404
    assert "Your work lives in" not in lab.output(), "the working copy existed: nothing to announce"


def _grade_command(notebook: Path) -> str:
    """The command a lab notebook tells the learner to grade it with (``nanolab grade labNN_....ipynb``)."""
    text = "".join("".join(c["source"]) for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"])
    commands = set(re.findall(r"nanolab grade lab\d\d_\w+\.ipynb", text))
    assert commands == {f"nanolab grade {notebook.name}"}, f"{notebook.name} gives {sorted(commands)}"
    return commands.pop()


def _shown_lines(shown: str) -> list[str]:
    return [line.strip() for line in shown.splitlines()]


@pytest.mark.sandbox  # grades the working copy's Lab 1 from the terminal
def test_make_lab_terminals_start_in_the_working_copy(tmp_path):
    """A terminal of the learner's JupyterLab starts in the working copy, not where `make` ran, so the
    grade command a lab gives (`nanolab grade lab01_tokenizer.ipynb`, no folder) grades the learner's
    copy there."""
    work = tmp_path / "work"
    with make_lab(tmp_path, f"WORK={work}") as lab:
        shown = asyncio.run(_run_in_terminal(lab, "pwd"))
        assert {str(work), str(work.resolve())} & set(_shown_lines(shown)), (
            f"the terminal did not start in the working copy {work}; it showed:\n{shown}"
        )
        command = _grade_command(ROOT / "labs" / LAB1)
        shown = asyncio.run(_run_in_terminal(lab, command, timeout=120))
        assert "does not exist" not in shown, f"`{command}` found no notebook:\n{shown}"
        # the score line: the notebook, its lab, points out of the lab's total (the copy is blank: 0 points)
        assert re.search(rf"^{re.escape(LAB1)}\s+1\s+[\d.]+/[1-9][\d.]*\s", shown, re.M), (
            f"`{command}` in the terminal showed no score:\n{shown}"
        )


def test_make_lab_instructor_mode_has_nbgrader(tmp_path):
    """`make lab INSTRUCTOR=1` opens the repository with nbgrader's tools, for people who write labs; its
    terminals start in the repository, the folder it opens."""
    with make_lab(tmp_path, "INSTRUCTOR=1") as lab:
        names = {item["name"] for item in json.loads(lab.get("/api/contents/")[1])["content"]}
        assert {"solutions", "labs"} <= names
        shown = asyncio.run(_run_in_terminal(lab, "pwd"))
        assert str(ROOT) in _shown_lines(shown), f"the terminal did not start in {ROOT}:\n{shown}"
        assert NBGRADER_LAB_EXTENSION not in lab.page_config().get("disabledExtensions", [])
        assert "nbgrader.server_extensions.formgrader" in lab.loaded_server_extensions()
        assert lab.get("/formgrader")[0] != 404
