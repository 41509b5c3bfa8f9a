"""A live nanolab server for tests: uvicorn in a thread, on a free port of 127.0.0.1, always stopped.

`serve(llm)` serves ``llm``'s model, tokenizer, chat template and engine settings (with an engine of
its own, not ``llm``'s, in a thread or in a process), so a test can compare what the server answers with what ``llm`` gives offline.
`serve_command(args)` runs the ``nanolab serve`` command itself in a subprocess, stopped with Ctrl-C.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from nanolab import LLM
from nanolab.serving.async_engine import AsyncEngine, EngineClient
from nanolab.serving.engine_process import ProcessAsyncEngine, engine_from_parts
from nanolab.serving.server import build_app


@dataclass
class Server:
    url: str
    http: httpx.Client  # based at the server's root
    client: openai.OpenAI  # the official client, no retries: an error is seen as it is


def wait_healthy(http: httpx.Client, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll ``/health`` until it answers 200; fail after ``timeout`` s, or as soon as ``process`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        assert process is None or process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            if http.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not become healthy within {timeout} s"
        time.sleep(0.05)


@contextmanager
def run_app(app: Any, timeout: float = 30) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a thread on a free port of 127.0.0.1; yields its URL once it is
    healthy, and stops it after."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP, and without it
    # every response on a kept-alive connection waits about 40 ms for a delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))  # a free loopback port, held from here on: no race with other processes
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with httpx.Client(base_url=url, timeout=timeout) as http:
            wait_healthy(http, timeout)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def openai_client(url: str, timeout: float = 30) -> openai.OpenAI:
    """The official client for a server at ``url``; no retries, so an error is seen as it is."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def engine_children(pid: int) -> list[int]:
    """The engine processes started by ``pid`` (multiprocessing's spawned children, not its helpers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@dataclass
class Command:
    process: subprocess.Popen
    http: httpx.Client
    client: openai.OpenAI
    exit_code: int | None = None  # set once the command stopped


@contextmanager
def serve_command(args: list[str], timeout: float = 60) -> Iterator[Command]:
    """``nanolab serve <args>`` on a free port of 127.0.0.1, healthy before it is yielded; stopped with
    SIGINT (as Ctrl-C) after, its exit code then in ``exit_code``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nanolab.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    command = Command(proc, httpx.Client(base_url=url, timeout=30), openai_client(url))
    try:
        wait_healthy(command.http, timeout, proc)
        yield command
    finally:
        command.client.close()
        command.http.close()
        proc.send_signal(signal.SIGINT)
        try:
            command.exit_code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def engine_for(llm: LLM, engine_in: str = "thread", **limits: Any) -> EngineClient:
    """An engine over ``llm``'s parts (a copy of them in a process of its own for "process")."""
    if engine_in == "process":
        parts = engine_from_parts(llm.model, llm.tokenizer, llm.engine.config)
        return ProcessAsyncEngine(parts, llm.tokenizer, **limits)
    return AsyncEngine(llm.model, llm.tokenizer, llm.engine.config, **limits)


@contextmanager
def serve(
    llm: LLM, model_name: str = "tiny", timeout: float = 30, engine_in: str = "thread"
) -> Iterator[Server]:
    """A server over ``llm``'s parts, healthy before it is yielded and stopped after; its engine runs
    in a thread of this process or, with ``engine_in="process"``, in a process of its own."""
    aengine = engine_for(llm, engine_in)
    with run_app(build_app(aengine, model_name, llm.chat_template), timeout) as url:
        with httpx.Client(base_url=url, timeout=timeout) as http, openai_client(url, timeout) as client:
            yield Server(url, http, client)
