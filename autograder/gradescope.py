"""A lab's autograder for Gradescope: ``nanolab gradescope LAB --out FILE.zip``.

Gradescope's programming assignments (https://gradescope-autograders.readthedocs.io/en/latest/specs/) take
a zip with ``setup.sh`` and ``run_autograder`` at its root. Gradescope unpacks it into ``/autograder/source``
and runs ``setup.sh`` once, as root on Ubuntu with internet, to build the image; then, for each submission,
it puts the student's files in ``/autograder/submission``, runs ``/autograder/run_autograder`` and reads
``/autograder/results/results.json``.

The zip this module writes holds:

- ``nanolab-src.tar.gz``: the package's source (nanolab, its C++ kernel, the grader and its hidden tests, the
  labs' setup code), without solutions, learner notebooks or nanolab's own tests;
- ``setup.sh``: system packages (a C++ compiler and CMake for the kernel), bubblewrap 0.8 built from its
  release when the distribution's is older (the sandbox needs options 0.8 added), a virtual environment
  with the CPU build of torch and nanolab;
- ``run_autograder``: ``python -m autograder.gradescope run`` with the kit's lab, visibility and sandbox
  policy;
- ``kit.json``: what the kit grades (lab, visibility, sandbox policy, nanolab's version, the lab's points).

``run`` (what ``run_autograder`` calls) always writes exactly one ``results.json``, whatever the submission:
it finds the one notebook wherever it is in the submission (in a folder, beside other files); several
notebooks are accepted only when exactly one has the lab's file name; none, several or another lab's notebook
score 0 with a message that says what to upload. It grades as the kit's lab, never as the lab a notebook
names. With the sandbox policy ``required`` (the default), a machine where the grader's sandbox cannot start
(no usable bubblewrap, no Landlock) scores every submission 0 with a message for the instructor, rather than
running students' code unconfined as root; ``preferred`` grades anyway.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

VISIBILITIES = ("visible", "after_due_date", "after_published", "hidden")
SANDBOX_POLICIES = ("required", "preferred")
# What the kit's source holds: the package and what it needs to build (pyproject.toml names them).
SOURCE_PATHS = ("pyproject.toml", "README.md", "csrc", "nanolab", "autograder", "labkit")
# Left out of the source even inside those folders: build products, caches.
SKIPPED = ("__pycache__", ".pyc", ".so", ".egg-info")
BWRAP_VERSION = "0.8.0"

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, to build the autograder's image.
set -euo pipefail
cd /autograder/source
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake \
    ca-certificates curl xz-utils meson ninja-build pkg-config libcap-dev

# The grader's sandbox needs bubblewrap >= {bwrap} (older ones lack --disable-userns): build it when the
# distribution's is older.
have=$(bwrap --version 2>/dev/null | awk '{{print $2}}' || true)
if [ -z "$have" ] || [ "$(printf '%s\n' "$have" "{bwrap}" | sort -V | head -n1)" != "{bwrap}" ]; then
    curl -fsSL -o /tmp/bwrap.tar.xz \
        https://github.com/containers/bubblewrap/releases/download/v{bwrap}/bubblewrap-{bwrap}.tar.xz
    tar -C /tmp -xJf /tmp/bwrap.tar.xz
    (cd /tmp/bubblewrap-{bwrap} && meson setup _build --prefix=/usr/local -Dman=disabled \
        && meson compile -C _build && meson install -C _build)
fi
bwrap --version

python3 -m venv /autograder/venv
/autograder/venv/bin/pip install --upgrade pip
# The CPU build of torch: PyPI's default build brings CUDA, which reserves GBs of address space on import,
# beyond what the grader lets a submission use.
/autograder/venv/bin/pip install "torch=={torch}" --index-url https://download.pytorch.org/whl/cpu
/autograder/venv/bin/pip install ./nanolab-src.tar.gz
/autograder/venv/bin/nanolab info
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission; it writes /autograder/results/results.json.
set -uo pipefail
exec "${{NANOLAB_PYTHON:-/autograder/venv/bin/python}}" -m autograder.gradescope run \\
    --root "${{AUTOGRADER_ROOT:-/autograder}}" --lab {lab} --visibility {visibility} --sandbox {sandbox}
"""


# -------------------------------------------------------------------------------------------- the kit


def lab_points(lab: int) -> float:
    """The points of lab ``lab``'s built-in hidden tests (what the Gradescope assignment's total should be):
    each top-level ``test_*`` function is worth its ``@pytest.mark.points(n)``, 1 without one."""
    import ast

    from autograder.grading.grade import GradeOptions
    from autograder.submission.labs import lab_spec

    spec, total = lab_spec(lab), 0.0
    (folder,) = GradeOptions(lab=lab).read_tests()
    for name in folder.modules_for(spec):
        for node in ast.parse(folder.files[name]).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                points = 1.0
                for d in node.decorator_list:
                    if isinstance(d, ast.Call) and ast.unparse(d.func).endswith("mark.points") and d.args:
                        points = float(ast.literal_eval(d.args[0]))
                total += points
    return total


def torch_version() -> str:
    """The installed torch's version without its build tag (``2.13.0+cpu`` -> ``2.13.0``)."""
    from importlib.metadata import version

    return version("torch").split("+")[0]


def source_tarball(root: Path) -> bytes:
    """The package's source under ``root`` (a checkout) as a .tar.gz, for ``pip install``."""
    missing = [p for p in SOURCE_PATHS if not (root / p).exists()]
    if missing:
        raise FileNotFoundError(
            f"{root} is not a nanolab checkout (no {', '.join(missing)}): the kit is built from the source"
        )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in SOURCE_PATHS:
            path = root / name
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for f in files:
                rel = f.relative_to(root)
                if any(part.endswith(SKIPPED) for part in rel.parts) or rel.parts[0] == "build":
                    continue
                tar.add(f, arcname=f"nanolab-src/{rel.as_posix()}", recursive=False)
    return buffer.getvalue()


def build_kit(
    lab: int, out: Path, visibility: str = "visible", sandbox: str = "required", root: Path | None = None
) -> dict:
    """Write lab ``lab``'s Gradescope autograder zip to ``out``; returns its kit.json."""
    from autograder.submission.labs import lab_spec
    from nanolab._version import __version__

    if visibility not in VISIBILITIES:
        raise ValueError(f"visibility must be one of {', '.join(VISIBILITIES)}, got {visibility!r}")
    if sandbox not in SANDBOX_POLICIES:
        raise ValueError(f"sandbox must be one of {', '.join(SANDBOX_POLICIES)}, got {sandbox!r}")
    spec = lab_spec(lab)
    root = root or Path(__file__).resolve().parents[1]
    kit = {
        "lab": lab,
        "notebook": spec.notebook,
        "points": lab_points(lab),
        "visibility": visibility,
        "sandbox": sandbox,
        "nanolab": __version__,
        "torch": torch_version(),  # the CPU build of the torch the kit was made with
    }
    files = {
        "setup.sh": SETUP_SH.format(bwrap=BWRAP_VERSION, torch=kit["torch"]),
        "run_autograder": RUN_AUTOGRADER.format(lab=lab, visibility=visibility, sandbox=sandbox),
        "kit.json": json.dumps(kit, indent=2) + "\n",
    }
    tarball = source_tarball(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            info = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
            info.external_attr = (stat.S_IFREG | 0o755) << 16  # both scripts executable
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, text)
        z.writestr("nanolab-src.tar.gz", tarball)
    os.replace(tmp, out)
    return kit


# ---------------------------------------------------------------------------------------- one submission


def find_notebook(submission: Path, expected: str) -> tuple[Path | None, str]:
    """The notebook to grade in ``submission`` (searched in every folder), or None and why not.

    Jupyter's checkpoints and hidden or macOS metadata folders are skipped. Several notebooks are fine when
    exactly one is named ``expected`` (the lab's file name)."""
    found = sorted(
        p
        for p in submission.rglob("*.ipynb")
        if p.is_file()
        and not any(part.startswith(".") or part == "__MACOSX" for part in p.relative_to(submission).parts)
    )
    shown = ", ".join(str(p.relative_to(submission)) for p in found)
    if not found:
        return None, f"no notebook (.ipynb) was found in your submission: upload your {expected}"
    if len(found) == 1:
        return found[0], ""
    named = [p for p in found if p.name == expected]
    if len(named) == 1:
        return named[0], f"your submission has several notebooks ({shown}); {named[0].name} was graded"
    return None, f"your submission has several notebooks ({shown}): upload only your {expected}"


def zero(message: str, visibility: str) -> dict[str, Any]:
    """A results.json that gives no points and says why."""
    return {
        "score": 0,
        "execution_time": 0,
        "output": message,
        "visibility": visibility,
        "stdout_visibility": "hidden",
        "tests": [],
    }


def run(root: Path, lab: int, visibility: str = "visible", sandbox: str = "required") -> int:
    """Grade the submission under ``root`` (Gradescope's /autograder) as lab ``lab``; write exactly one
    ``results/results.json``. Returns 0 when it was written (whatever the score)."""
    from autograder.grading.results import write_atomically
    from autograder.submission.labs import lab_spec

    results_path = root / "results" / "results.json"
    spec = lab_spec(lab)

    def write(data: dict[str, Any]) -> int:
        write_atomically(results_path, json.dumps(data, indent=2) + "\n")
        return 0

    notebook, note = find_notebook(root / "submission", spec.notebook)
    if notebook is None:
        return write(zero(note, visibility))
    if sandbox == "required":
        from autograder.sandbox import isolation

        status = isolation.status()
        if not status.available:
            print(status.describe(), file=sys.stderr)
            return write(
                zero(
                    "The autograder could not start its sandbox on this machine, so it did not run your "
                    "notebook; your instructor has been told (the autograder's output names the reason).",
                    visibility,
                )
                | {"stdout_visibility": "hidden"}
            )
    from autograder.grading.grade import GradeOptions, grade

    result = grade([notebook], GradeOptions(lab=lab), progress=False)[0]
    data = result.to_gradescope(visibility)
    if note:
        data["output"] = "\n".join(filter(None, [note, data["output"]]))
    if result.internal_error:
        print(f"the grader failed on {notebook}: {result.internal_error}", file=sys.stderr)
    return write(data)


# ------------------------------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("lab", type=int, help="the lab the assignment grades")
    parser.add_argument("--out", type=Path, required=True, metavar="FILE.zip", help="where to write the zip")
    parser.add_argument(
        "--visibility",
        choices=VISIBILITIES,
        default="visible",
        help="when students see the tests' results (Gradescope's visibility; default: visible)",
    )
    parser.add_argument(
        "--sandbox",
        choices=SANDBOX_POLICIES,
        default="required",
        help="required (default): score 0 with a message where the sandbox cannot start; "
        "preferred: grade without it there (students' code then runs unconfined, as root)",
    )


def kit_command(args: argparse.Namespace) -> int:
    """``nanolab gradescope``: write the kit and say what to set on Gradescope."""
    try:
        kit = build_kit(args.lab, args.out, args.visibility, args.sandbox)
    except (ValueError, FileNotFoundError) as exc:
        print(f"nanolab gradescope: {exc}", file=sys.stderr)
        return 2
    size = args.out.stat().st_size / 2**20
    print(f"wrote {args.out} ({size:.1f} MiB): lab {kit['lab']}, {kit['notebook']}, {kit['points']:g} points")
    print(
        "On Gradescope: a Programming Assignment worth "
        f"{kit['points']:g} points; Configure Autograder -> Zip file upload -> this zip; "
        f"then Test Autograder with the {kit['notebook']} of a finished lab."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m autograder.gradescope run ...``: what ``run_autograder`` calls."""
    parser = argparse.ArgumentParser(prog="python -m autograder.gradescope")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="grade /autograder/submission into /autograder/results/results.json")
    r.add_argument("--root", type=Path, default=Path("/autograder"))
    r.add_argument("--lab", type=int, required=True)
    r.add_argument("--visibility", choices=VISIBILITIES, default="visible")
    r.add_argument("--sandbox", choices=SANDBOX_POLICIES, default="required")
    args = parser.parse_args(argv)
    return run(args.root, args.lab, args.visibility, args.sandbox)


if __name__ == "__main__":
    raise SystemExit(main())
