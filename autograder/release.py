"""The learner edition: ``nanolab release OUT_DIR [--wheel]``, what a class hands out.

A clone of nanolab holds the answers: ``solutions/``, the hidden tests (``autograder/tests``) and the planted
learner bugs (``autograder/mutants``, whose lines come from the solutions). The learner edition is the same
project without them: the generated learner notebooks (``labs/``), the package (nanolab with its C++ kernel,
the labs' setup code, the grader's sandbox and CLI), the learner's JupyterLab settings (``jupyter/``), and a
Makefile with ``make lab`` (set up, copy the labs into ``work/``, open JupyterLab) and ``make clean``. Its
README is the learners' part of nanolab's. ``--wheel`` also builds a wheel of the edition's package, for a
class image (``pip install`` it after the CPU build of torch).

For JupyterHub, the edition is also the build context of a single-user image: its ``Dockerfile`` starts from
Jupyter's docker-stacks ``base-notebook``, installs the CPU build of torch and the edition, points
JupyterLab at the learner's settings, and adds a start hook (``docker/start-nanolab.sh``, run by the image's
``before-notebook.d``) that copies into ``~/work`` each lab a learner does not have yet, never overwriting
one.

In the edition, ``nanolab grade`` says that the hidden tests are the instructor's; the notebooks' check cells
are the learner's feedback.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the edition copies from a checkout, and what it leaves out of those folders.
COPIED = ("pyproject.toml", "environment.yml", "csrc", "nanolab", "autograder", "labkit", "labs", "jupyter")
LEFT_OUT = ("autograder/tests", "autograder/mutants")
SKIPPED = ("__pycache__", ".pyc", ".so", ".egg-info", ".ipynb_checkpoints")
# The Makefile's targets the edition keeps (the rest need solutions/, tests/ or bench/).
KEPT_TARGETS = ("setup", "lab", "clean")
# The README's sections a learner needs, by heading.
README_SECTIONS = ("Quick start", "Working through a lab (learners)", "Troubleshooting")
EDITION_NOTE = (
    "This is the **learner edition** of nanolab: the labs, the reference package they build on, and `make lab`."
    " Your instructor grades your notebooks with hidden tests; each notebook's check cells are your feedback"
    " as you work."
)


DOCKERFILE = """\
# A JupyterHub single-user image for this class: `docker build -t nanolab-class .` in this folder, then
# point JupyterHub's spawner at it (c.DockerSpawner.image or KubeSpawner's singleuser image).
FROM quay.io/jupyter/base-notebook:python-3.11
USER root
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \\
    && rm -rf /var/lib/apt/lists/*
COPY . /opt/nanolab
# the CPU build of torch (PyPI's Linux build brings CUDA), then the labs' package with its C++ kernel
RUN pip install --no-cache-dir "torch=={torch}" --index-url https://download.pytorch.org/whl/cpu \\
    && pip install --no-cache-dir /opt/nanolab && rm -rf /opt/nanolab/build
# the learner's JupyterLab: no nbgrader instructor tools, no news popup
ENV JUPYTER_CONFIG_PATH=/opt/nanolab/jupyter NANOLAB_HOME=/opt/nanolab
# at each start: the labs a learner's home does not have yet, copied into ~/work (never overwriting)
COPY docker/start-nanolab.sh /usr/local/bin/before-notebook.d/10-nanolab.sh
USER ${{NB_UID}}
"""

START_HOOK = """\
#!/usr/bin/env bash
# Run by the image at each start (docker-stacks' before-notebook.d), as the learner: copy the labs the
# learner's work folder does not have yet; a notebook already there is never written to.
python3 "${NANOLAB_HOME:-/opt/nanolab}/scripts/working_copy.py" "${HOME}/work" || true
"""


def edition_makefile(text: str) -> str:
    """The checkout's Makefile with only `KEPT_TARGETS`: its blocks (a ``## name:`` comment, the rule) for the
    other targets, and the variables only they use, are left out."""
    blocks = re.split(r"\n\n+", text.strip("\n"))
    kept = []
    for block in blocks:
        first = block.splitlines()[0]
        target = re.match(r"(?:## )?([a-z-]+):", first)
        if target and target.group(1) not in KEPT_TARGETS and not first.startswith(".PHONY"):
            continue
        if first.startswith("# The lab whose tests"):  # make mutants' variables
            continue
        if first.startswith(".PHONY"):
            block = ".PHONY: " + " ".join((*KEPT_TARGETS, "FORCE"))
        kept.append(block)
    return "\n\n".join(kept) + "\n"


def edition_readme(text: str) -> str:
    """The README's title and introduction, a note on the edition, and the learners' sections."""
    parts = re.split(r"(?m)^## ", text)
    intro = parts[0].split("| you are |")[0].rstrip()
    sections = {p.split("\n", 1)[0].strip(): "## " + p.rstrip() for p in parts[1:]}
    missing = [s for s in README_SECTIONS if s not in sections]
    if missing:
        raise ValueError(f"the README has no section {', '.join(missing)}")
    kept = "\n\n".join([intro, EDITION_NOTE, *(sections[s] for s in README_SECTIONS)]) + "\n"
    return "".join(line for line in kept.splitlines(keepends=True) if not line.startswith("make test "))


def _ignorer(root: Path):
    """shutil.copytree's ``ignore`` for a checkout at ``root``: build products, caches and `LEFT_OUT`."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        here = Path(directory).relative_to(root)
        return {n for n in names if n.endswith(SKIPPED) or n == "build" or (here / n).as_posix() in LEFT_OUT}

    return ignore


def release(out: Path, root: Path = ROOT) -> list[Path]:
    """Write the learner edition of the checkout at ``root`` into ``out`` (which must not exist or be empty);
    returns the files written."""
    missing = [
        p for p in (*COPIED, "Makefile", "README.md", "scripts/working_copy.py") if not (root / p).exists()
    ]
    if missing:
        raise FileNotFoundError(f"{root} is not a nanolab checkout (no {', '.join(missing)})")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, out / name, ignore=_ignorer(root))
        else:
            shutil.copy2(source, out / name)
    (out / "scripts").mkdir()
    shutil.copy2(root / "scripts" / "working_copy.py", out / "scripts" / "working_copy.py")
    (out / "Makefile").write_text(edition_makefile((root / "Makefile").read_text()))
    (out / "README.md").write_text(
        edition_readme((root / "README.md").read_text(encoding="utf-8")), encoding="utf-8"
    )
    (out / ".gitignore").write_text(".venv/\nbuild/\nwork/\n__pycache__/\n")
    from autograder.gradescope import torch_version

    (out / "Dockerfile").write_text(DOCKERFILE.format(torch=torch_version()))
    (out / ".dockerignore").write_text(".venv\nbuild\nwork\ndist\n**/__pycache__\n")
    (out / "docker").mkdir()
    hook = out / "docker" / "start-nanolab.sh"
    hook.write_text(START_HOOK)
    hook.chmod(0o755)
    return sorted(p for p in out.rglob("*") if p.is_file())


def build_wheel(edition: Path, dest: Path) -> Path:
    """A wheel of the edition's package (its C++ kernel compiled for this machine) in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dest), str(edition)],
        check=True,
    )
    (wheel,) = set(dest.glob("*.whl")) - before or set(dest.glob("nanolab-*.whl"))
    return wheel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="a new folder for the learner edition")
    parser.add_argument("--wheel", action="store_true", help="also build a wheel of it, in OUT_DIR/dist")


def release_command(args: argparse.Namespace) -> int:
    try:
        files = release(args.out)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"nanolab release: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the learner edition in {args.out} ({len(files)} files): labs/, the package, `make lab`")
    if args.wheel:
        try:
            wheel = build_wheel(args.out, args.out / "dist")
        except subprocess.CalledProcessError as exc:
            print(f"nanolab release: building the wheel failed ({exc})", file=sys.stderr)
            return 1
        print(f"wrote {wheel}")
    return 0
