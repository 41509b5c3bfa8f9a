"""A live nanolab server for tests: uvicorn in a thread, on a free port of 127.0.0.1, always stopped.

`serve(llm)` serves ``llm``'s model, tokenizer, chat template and engine settings (with an engine of
its own, not ``llm``'s), so a test can compare what the server answers with what ``llm`` gives offline.
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

import httpx
import openai
import uvicorn

from nanolab import LLM
from nanolab.serving.async_engine import AsyncEngine
from nanolab.serving.server import build_app


@dataclass
class Server:
    url: str
    http: httpx.Client  # based at the server's root
    client: openai.OpenAI  # the official client, no retries: an error is seen as it is


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
    http = httpx.Client(base_url=url, timeout=30)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    command = Command(proc, http, client)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"nanolab serve did not become healthy within {timeout} s"
            time.sleep(0.1)
        yield command
    finally:
        client.close()
        http.close()
        proc.send_signal(signal.SIGINT)
        try:
            command.exit_code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@contextmanager
def serve(llm: LLM, model_name: str = "tiny", timeout: float = 30) -> Iterator[Server]:
    """A server over ``llm``'s parts, healthy before it is yielded and stopped after."""
    aengine = AsyncEngine(llm.model, llm.tokenizer, llm.engine.config)
    app = build_app(aengine, model_name, llm.chat_template)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free loopback port, held from here on: no race with other processes
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    http = httpx.Client(base_url=url, timeout=timeout)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not become healthy within {timeout} s"
            time.sleep(0.05)
        yield Server(url, http, client)
    finally:
        client.close()
        http.close()
        server.should_exit = True
        thread.join(timeout)
        sock.close()
