"""Start `make lab` the way a learner does, on 127.0.0.1 and a free port, and always stop it.

Used by the tests of `make lab` and by the browser test. JupyterLab's own state (settings, workspaces,
runtime files, the user's ~/.jupyter) is kept in a temporary folder, so a test neither reads nor
changes the developer's, and the venv's bin is taken off PATH, so that finding `nanolab` in
JupyterLab's terminal proves `make lab` put it there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "nanolab-test"
STAMP = ".venv/.nanolab-installed"  # make -o STAMP: use the installed venv as it is, never reinstall


@dataclass
class Lab:
    url: str  # http://127.0.0.1:PORT
    log: Path  # everything `make lab` printed

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path`` as the learner (token in the header); the status, and the body."""
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"token {TOKEN}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def page_config(self) -> dict:
        """The page config JupyterLab serves to the browser with /lab (the jupyter-config-data script)."""
        status, body = self.get("/lab")
        assert status == 200, f"GET /lab answered {status}"
        found = re.search(
            rb'<script id="jupyter-config-data" type="application/json">(.*?)</script>', body, re.S
        )
        assert found, "no jupyter-config-data in /lab"
        return json.loads(found.group(1))

    def loaded_server_extensions(self) -> set[str]:
        """The server extensions the server's log says it loaded."""
        return set(re.findall(r"\] (\S+) \| extension was successfully loaded", self.output()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def learner_env(state: Path) -> dict[str, str]:
    """The environment a learner's shell would have, minus the venv on PATH and any Jupyter state."""
    venv_bin = str(ROOT / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p.rstrip("/") != venv_bin
    )
    for name in (
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_DATA_DIR",
        "JUPYTER_RUNTIME_DIR",
        "JUPYTERLAB_SETTINGS_DIR",
        "JUPYTERLAB_WORKSPACES_DIR",
    ):
        env[name] = str(state / name.lower())
    return env


@contextlib.contextmanager
def make_lab(tmp: Path, *make_vars: str, timeout: float = 90, cwd: Path = ROOT) -> Iterator[Lab]:
    """Run ``make lab`` in ``cwd`` (a checkout, or a learner edition whose ``.venv`` is this checkout's) with
    ``make_vars`` (e.g. ``WORK=...``) until JupyterLab answers; stop it after."""
    port = free_port()
    args = f"--no-browser --ip 127.0.0.1 --port {port} --ServerApp.port_retries=0 --IdentityProvider.token={TOKEN}"
    log = tmp / "make-lab.log"
    lab = Lab(f"http://127.0.0.1:{port}", log)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["make", "-s", "-o", STAMP, "lab", f"LAB_ARGS={args}", *make_vars],
            cwd=cwd,
            env=learner_env(tmp / "jupyter-state"),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: make, the shell and JupyterLab stop together
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"make lab exited with {proc.returncode}:\n{lab.output()[-3000:]}")
            with contextlib.suppress(OSError):
                if lab.get("/api/status")[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"JupyterLab did not answer within {timeout:.0f} s:\n{lab.output()[-3000:]}"
                )
            time.sleep(0.5)
        yield lab
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
