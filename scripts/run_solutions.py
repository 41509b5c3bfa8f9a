"""Run every solution notebook top to bottom on a real Jupyter kernel, and fail on any error.

    python scripts/run_solutions.py                   # all of solutions/lab*.ipynb
    python scripts/run_solutions.py solutions/lab01_tokenizer.ipynb
    python scripts/run_solutions.py --jobs 2          # two kernels at a time

Notebooks run with nbclient on the ``python3`` kernel of this interpreter's environment (registered
inside it with ``python -m ipykernel install --sys-prefix`` if it is missing), on the CPU, with the
notebook's own folder as the working directory. Executed copies go to build/solutions/, never back
into solutions/. Each notebook must finish within ``--timeout`` seconds (default 120); the time each
one took is printed. ``--jobs N`` runs N notebooks at a time, each on a kernel of its own (a kernel mostly
keeps one core busy).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "solutions"
KERNEL = "python3"


def ensure_kernel() -> None:
    """Make sure this environment has its own ``python3`` kernelspec, so the venv's Python runs the notebooks."""
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    own = Path(sys.prefix).resolve()
    if KERNEL in specs and Path(specs[KERNEL]).resolve().is_relative_to(own):
        return
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL], check=True
    )


def kernel_env() -> dict[str, str]:
    """A notebook kernel's environment: this one, with no GPU (the labs run on the CPU everywhere) and
    figures drawn inline."""
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }


@contextlib.contextmanager
def notebook_client(nb, **options):
    """An nbclient ``NotebookClient`` for ``nb`` (a context: use it inside) on a kernel of its own that talks
    over Unix sockets where it can.

    Over TCP, jupyter_client chooses the kernel's five ports by binding them and letting them go, and the
    kernel binds them again a moment later. Another kernel starting then, or any outgoing connection given
    an ephemeral port, can take one in between, and the kernel dies before it replies ("Address already in
    use"). Unix sockets are paths in a folder of this kernel's own, made here (only this user can open it)
    and removed after, so several notebooks can start at once. A socket's path is short (the system's
    limit is about 100 bytes): where the temporary folder's own path is too long for it, TCP it is."""
    from nbclient import NotebookClient
    from traitlets.config import Config

    config = Config()
    where = tempfile.mkdtemp(prefix="nbk-") if os.name == "posix" else None
    try:
        # an absolute path (the kernel runs in the notebook's folder), short enough for a socket's name
        if where is not None and len(where) < 80:
            config.KernelManager.transport = "ipc"
            config.KernelManager.ip = os.path.join(where, "k")  # the sockets are k-1 .. k-5
        # the client makes (and so shuts down and cleans up after) its own kernel manager from the config
        yield NotebookClient(nb, kernel_name=KERNEL, config=config, **options)
    finally:
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)


def run_notebook(path: Path, timeout: float, out: Path | None = None) -> float:
    """Execute ``path`` and write the executed copy to ``out`` (default build/solutions/); returns the seconds
    it took."""
    nb = nbformat.read(str(path), as_version=4)
    with notebook_client(
        nb,
        timeout=timeout,  # per cell; the whole notebook is checked against `timeout` below
        resources={"metadata": {"path": str(path.parent)}},
    ) as client:
        start = time.perf_counter()
        client.execute(env=kernel_env())
        elapsed = time.perf_counter() - start
    out = OUT if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(out / path.name))
    return elapsed


def run_notebooks(paths: list[Path], timeout: float, jobs: int = 1, out: Path | None = None):
    """Run ``paths``, ``jobs`` at a time; yields ``(path, seconds or the exception it raised)`` in the order
    of ``paths``, each once its notebook has ended (a later one may have ended before it)."""

    def one(path: Path) -> tuple[Path, float | Exception]:
        try:
            return path, run_notebook(path, timeout, out)
        except Exception as e:  # nbclient's CellExecutionError carries the cell and its traceback
            return path, e

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [pool.submit(one, path) for path in paths]
        for future in futures:
            yield future.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: solutions/lab*.ipynb")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds each notebook may take (default 120)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at a time (default 1)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted((ROOT / "solutions").glob("lab*.ipynb"))
    if not notebooks:
        print("no solution notebooks to run", file=sys.stderr)
        return 1
    ensure_kernel()
    failed = []
    print(f"running   {len(notebooks)} notebook(s), {max(1, args.jobs)} at a time ...", flush=True)
    for path, elapsed in run_notebooks([p.resolve() for p in notebooks], args.timeout, args.jobs):
        if isinstance(elapsed, Exception):
            failed.append(path.name)
            print(f"FAILED    {path.name}\n{elapsed}", file=sys.stderr)
            continue
        if elapsed > args.timeout:
            failed.append(path.name)
            print(f"TOO SLOW  {path.name}: {elapsed:.1f} s (limit {args.timeout:.0f} s)", file=sys.stderr)
        else:
            print(f"ok        {path.name}: {elapsed:.1f} s (executed copy in {OUT.relative_to(ROOT)})")
    if failed:
        print(
            f"{len(failed)} of {len(notebooks)} solution notebooks failed: {', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
