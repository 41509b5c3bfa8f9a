"""The learner edition (`nanolab release OUT_DIR`): what a class hands out holds no solution, hidden test or
planted bug; `make lab` works from it; its wheel installs a `nanolab grade` that says the hidden tests are the
instructor's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib
from helpers.lab_server import ROOT, make_lab

from autograder.release import release


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("edition") / "nanolab-class"
    done = subprocess.run(
        [sys.executable, "-m", "nanolab.cli", "release", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


def solution_lines() -> set[str]:
    """Distinctive lines the learner writes: inside the solution regions of every solution notebook."""
    lines = set()
    for path in sorted((ROOT / "solutions").glob("lab*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            for region in re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", source, re.S):
                lines |= {line.strip() for line in region.splitlines() if len(line.strip()) >= 40}
    return lines


def test_the_edition_holds_no_solution_hidden_test_or_planted_bug(edition: Path) -> None:
    files = [p for p in edition.rglob("*") if p.is_file()]
    rel = {p.relative_to(edition).as_posix() for p in files}
    assert not [
        r for r in rel if r.startswith(("solutions/", "tests/", "autograder/tests/", "autograder/mutants/"))
    ]
    assert not [r for r in rel if "__pycache__" in r or r.endswith((".so", ".pyc"))]
    given = "\n".join(p.read_text() for p in (ROOT / "labs").glob("lab*.ipynb"))  # the blank labs' own text
    answers = {line for line in solution_lines() if json.dumps(line)[1:-1] not in given}
    assert len(answers) > 200
    for path in files:
        if path.relative_to(edition).parts[0] == "nanolab":
            continue  # the reference package is the learner's to read: the labs build on it
        text = path.read_text(encoding="utf-8", errors="replace")
        assert "### BEGIN SOLUTION" not in text and "### BEGIN HIDDEN TESTS" not in text, path
        leaked = [line for line in answers if line in text]
        assert not leaked, f"{path.relative_to(edition)} holds solution lines: {leaked[:3]}"
    for lab in sorted((ROOT / "labs").glob("lab*.ipynb")):
        assert (edition / "labs" / lab.name).read_bytes() == lab.read_bytes()


def test_the_edition_s_makefile_and_readme_are_the_learner_s(edition: Path) -> None:
    dry = subprocess.run(["make", "-n", "-C", str(edition), "clean"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    missing = subprocess.run(["make", "-n", "-C", str(edition), "test"], capture_output=True, text=True)
    assert missing.returncode != 0 and "No rule to make target" in missing.stderr
    readme = (edition / "README.md").read_text()
    assert "learner edition" in readme and "make lab" in readme and "## Working through a lab" in readme
    assert "make test" not in readme.split("## Working through a lab")[0]
    assert "## Teaching with nanolab" not in readme


def test_release_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        release(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_make_lab_works_from_the_edition(edition: Path, tmp_path: Path) -> None:
    (edition / ".venv").symlink_to(ROOT / ".venv")  # the set-up environment, as make setup would leave it
    with make_lab(tmp_path, cwd=edition) as lab:
        status, body = lab.get("/api/contents/lab01_tokenizer.ipynb?content=0")
        assert status == 200, body[:300]
    assert sorted(p.name for p in (edition / "work").glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "labs").glob("*.ipynb")
    )


def test_the_edition_s_grader_says_the_hidden_tests_are_the_instructor_s(edition: Path) -> None:
    """The edition's own package, imported from its folder (not this checkout's editable install): its
    `nanolab grade` exits 2 and says why. A wheel (`--wheel`: `pip wheel` of the folder) holds these packages."""
    paths = [str(edition), sysconfig.get_paths()["purelib"]]
    probe = (
        f"import sys; sys.path[:0] = {paths!r}; import autograder; assert autograder.__file__.startswith({paths[0]!r}); "
        f"from nanolab.cli import main; sys.exit(main(['grade', {str(ROOT / 'labs' / 'lab01_tokenizer.ipynb')!r}]))"
    )
    done = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no hidden tests" in done.stderr and "check cells" in done.stderr
    packages = tomllib.loads((edition / "pyproject.toml").read_text())["tool"]["scikit-build"]["wheel"][
        "packages"
    ]
    assert sorted(packages) == ["autograder", "labkit", "nanolab"]


def test_the_jupyterhub_image_recipe_copies_what_it_names_and_its_start_hook_never_overwrites(
    edition: Path, tmp_path: Path
) -> None:
    """As far as a machine without a Docker daemon goes: the Dockerfile's sources are in the edition, and the
    start hook, run as the image runs it, gives a learner's home the labs and leaves their work alone."""
    dockerfile = (edition / "Dockerfile").read_text()
    assert dockerfile.count("FROM ") == 1 and "download.pytorch.org/whl/cpu" in dockerfile
    for source in re.findall(r"(?m)^COPY (\S+) ", dockerfile):
        assert (edition / source).exists(), source
    config = re.search(r"JUPYTER_CONFIG_PATH=/opt/nanolab/(\S+)", dockerfile).group(1)
    assert (edition / config / "jupyter_server_config.json").is_file()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {"HOME": str(tmp_path / "home"), "NANOLAB_HOME": str(edition), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    (tmp_path / "home").mkdir()
    hook = edition / "docker" / "start-nanolab.sh"
    subprocess.run(["bash", str(hook)], env=env, check=True, capture_output=True)
    work = tmp_path / "home" / "work"
    assert sorted(p.name for p in work.glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "labs").glob("*.ipynb")
    )
    mine = work / "lab01_tokenizer.ipynb"
    mine.write_text('{"my": "work"}')
    subprocess.run(["bash", str(hook)], env=env, check=True, capture_output=True)
    assert mine.read_text() == '{"my": "work"}'
