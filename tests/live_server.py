"""A live nanolab server for tests: uvicorn in a thread, on a free port of 127.0.0.1, always stopped.

`serve(llm)` serves ``llm``'s model, tokenizer, chat template and engine settings (with an engine of
its own, not ``llm``'s), so a test can compare what the server answers with what ``llm`` gives offline.
"""

from __future__ import annotations

import socket
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
