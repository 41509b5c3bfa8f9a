"""Hidden tests for Lab 8: the learner's `EngineLoop` behind nanolab's HTTP server, asked by the official
`openai` client and by plain HTTP.

The server (FastAPI under uvicorn, on a free port of 127.0.0.1) runs here, in the grader; its engine side is
`LearnersEngine`, whose thread drives the learner's `EngineLoop` through its handles, over the setup's
`ToyEngine`, both in the sandbox. That thread plays `LoopBase.run`'s part itself (no code of the notebook
waits for commands), so what is judged is only what the learner's methods decide: the rounds they hand back.
If the learner's code raises or hangs, the sandbox call fails, every waiting request gets an error, and the
server is stopped at the end of the test whatever happened: the grader stays in control.

What the clients get is compared with the same toy engine run here (`labkit.lab08.ToyEngine`), and the
server's /metrics with what the clients saw. Feedback says what went wrong and on which request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from autograder.testing import RemoteError
from labkit.lab08 import SamplingParams as ToyParams
from labkit.lab08 import ToyEngine
from nanolab.engine.outputs import CompletionOutput, RequestOutput
from nanolab.engine.stats import EngineStats
from nanolab.serving.async_engine import STOP, AddCommand, EngineClient, Round, ServerOverloaded
from nanolab.serving.server import build_app

MAX_MODEL_LEN = 400
SEATS = 4


def toy_text(prompt: list[int], max_tokens: int) -> tuple[str, str]:
    """What the toy engine makes of one request on its own: its text and finish reason."""
    engine = ToyEngine(SEATS, MAX_MODEL_LEN)
    engine.add_requests([prompt], [ToyParams(max_tokens=max_tokens)], 0, ["x"])
    while True:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].text, out.outputs[0].finish_reason


def long_prompt(rng, tokens: int) -> list[int]:
    """A prompt whose toy continuation runs ``tokens`` tokens without an end of text."""
    while True:
        prompt = [rng.randint(1, 25) for _ in range(rng.randint(2, 8))]
        if toy_text(prompt, tokens)[1] == "length":
            return prompt


class LearnersAdmission:
    """The learner's `Admission` (in the sandbox, through its handle) as nanolab's client calls it: the
    learner's `ServerOverloaded` becomes nanolab's, which the HTTP side answers with 503."""

    def __init__(self, lab, max_waiting: int, retry_after: int = 1) -> None:
        self.inner = lab.Admission(max_waiting, retry_after)
        self.max_waiting, self.retry_after = max_waiting, retry_after

    @property
    def waiting(self) -> int:
        return self.inner.waiting

    def admit(self, num_prompts: int) -> None:
        try:
            self.inner.admit(num_prompts)
        except RemoteError as exc:
            if exc.type_name != "ServerOverloaded":
                raise
            raise ServerOverloaded(exc.message, self.retry_after) from None

    def on_round(self, handled: int, engine_waiting: int) -> None:
        self.inner.on_round(handled, engine_waiting)


class LearnersEngine(EngineClient):
    """nanolab's asyncio side; the engine side is the learner's EngineLoop over a ToyEngine, in the sandbox."""

    def __init__(self, lab, step_delay: float = 0.0, **limits) -> None:
        super().__init__(**limits)
        self.toy = lab.ToyEngine(SEATS, MAX_MODEL_LEN)
        self.learners = lab.EngineLoop(self.toy)
        self.lab = lab
        self.step_delay = step_delay
        self.config = SimpleNamespace(max_model_len=MAX_MODEL_LEN)
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.crashed: str | None = None
        self._crash_lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._commands.put(STOP)
        self._thread.join(timeout)
        self._fail_everything("the server is shutting down")

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        return (
            self._thread is not None and self._thread.is_alive() and not self._stopping and not self.crashed
        )

    def _send(self, cmd) -> None:
        self._commands.put(cmd)
        if self.crashed:  # the loop died after the caller checked is_running: refuse what it will never see
            with self._crash_lock:
                self._fail_everything(f"the engine loop failed: {self.crashed}")

    def _receive(self, timeout: float | None):
        try:
            return self._commands.get_nowait() if timeout == 0 else self._commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # the learner's code raised, or a call into the sandbox failed or timed out
            with self._crash_lock:
                self.crashed = f"{type(exc).__name__}: {str(exc)[:300]}"
                self._fail_everything(f"the engine loop failed: {self.crashed}")

    def _loop(self) -> None:
        loop, lab = self.learners, self.lab
        while True:
            deadlines = loop.deadlines
            if self.toy.has_unfinished():
                cmd = self._receive(0)
            elif deadlines:
                cmd = self._receive(max(0.0, min(deadlines.values()) - time.monotonic()))
            else:
                cmd = self._receive(None)
            while cmd is not None:
                if cmd == STOP:
                    loop.abort(sorted(loop.live))
                    self._deliver(self._round())
                    return
                if isinstance(cmd, AddCommand):
                    params = [lab.SamplingParams(max_tokens=p.max_tokens) for p in cmd.params]
                    loop.handle(
                        lab.AddCommand(cmd.add_id, cmd.request_ids, cmd.prompts, params, 0, cmd.deadline)
                    )
                else:
                    loop.handle(lab.AbortCommand(cmd.request_ids))
                cmd = self._receive(0)
            self._deliver(self._round())
            if loop.deadlines:
                loop.expire(time.monotonic())
            if self.toy.has_unfinished():
                loop.step()
                time.sleep(self.step_delay)
            self._deliver(self._round())

    def _round(self) -> Round:
        """The learner's round, read through its handle into nanolab's `Round`."""
        r = self.learners.take_round()
        stats = r.stats
        running, waiting, steps = stats.num_running, stats.num_waiting, stats.steps
        return Round(
            accepted=[tuple(a) for a in r.accepted],
            refused=[tuple(x) for x in r.refused],
            outputs=[self._output(o) for o in r.outputs],
            failed=[tuple(f) for f in r.failed],
            step_errors=r.step_errors,
            stats=EngineStats(steps, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0, running, waiting, 1, 1, 0, 0.0, 0),
            handled=r.handled,
        )

    @staticmethod
    def _output(o) -> RequestOutput:
        samples = [
            CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, c.delta_text, c.delta_token_ids)
            for c in o.outputs
        ]
        return RequestOutput(o.request_id, None, o.prompt_token_ids, samples, o.finished, None)


@contextlib.contextmanager
def serving(aengine: LearnersEngine) -> Iterator[str]:
    """nanolab's server over ``aengine`` on a free port of 127.0.0.1, always stopped."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP, and without it
    # every response on a kept-alive connection waits about 40 ms for a delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(aengine, "toy"), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        for _ in range(400):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the server did not start")
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        aengine.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)


def crash_note(aengine: LearnersEngine) -> str:
    return f" (your loop failed: {aengine.crashed})" if aengine.crashed else ""


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.points(2)
def test_the_openai_client_gets_each_request_s_text_through_your_loop(lab, rng):
    """behind nanolab's server, your loop answers the openai client with each request's own text, plain and streamed, one client or eight at once"""
    prompts = [[rng.randint(1, 25) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    lengths = [rng.randint(1, 30) for _ in prompts]
    expected = [toy_text(p, n) for p, n in zip(prompts, lengths)]
    aengine = LearnersEngine(lab)
    with lab.time_limit(20), serving(aengine) as url:
        api = client(url)
        try:
            one = api.completions.create(model="toy", prompt=prompts[0], max_tokens=lengths[0])
            chunks = [
                c.choices[0]
                for c in api.completions.create(
                    model="toy", prompt=prompts[1], max_tokens=lengths[1], stream=True
                )
                if c.choices
            ]
            with ThreadPoolExecutor(8) as pool:
                together = list(
                    pool.map(
                        lambda i: api.completions.create(
                            model="toy", prompt=prompts[i], max_tokens=lengths[i]
                        ),
                        range(8),
                    )
                )
        except openai.APIError as e:
            raise AssertionError(
                f"the server answered an error: {str(e)[:200]}{crash_note(aengine)}"
            ) from None
        metrics = scrape(url)
    assert (one.choices[0].text, one.choices[0].finish_reason) == expected[0], (
        f"a completion of prompt {prompts[0]} with max_tokens {lengths[0]}: the client got "
        f"{one.choices[0].text!r} ({one.choices[0].finish_reason}): outputs lost, repeated or from another request?"
    )
    assert "".join(c.text for c in chunks) == expected[1][0], (
        f"a streamed completion of prompt {prompts[1]}: the chunks do not add up to the request's text"
    )
    assert [c.finish_reason for c in chunks if c.finish_reason] == [expected[1][1]], (
        "a streamed completion ends with one finish reason: is its final output passed on once?"
    )
    for i, r in enumerate(together):
        assert (r.choices[0].text, r.choices[0].finish_reason) == expected[i], (
            f"eight requests at once: request {i} (prompt {prompts[i]}, max_tokens {lengths[i]}) got another text: "
            "does every live request's output reach the round?"
        )
    finished = sum(metrics.get(f'nanolab_requests_total{{status="{s}"}}', 0) for s in ("stop", "length"))
    assert finished == 10, (
        f"the server counted {finished:.0f} finished requests for the 10 the clients saw finish"
    )
    assert metrics["nanolab_requests_waiting"] == 0 and metrics["nanolab_requests_running"] == 0, (
        "after every request finished, your round's stats should show none running or waiting"
    )


def test_clients_that_leave_deadlines_and_bad_bodies_leave_the_server_serving(lab, rng):
    """clients that disconnect mid-stream have their requests stopped, a request past its deadline ends with 'timeout' and its text so far, bad bodies get 400, and the server still answers"""
    aengine = LearnersEngine(lab, step_delay=0.01)
    slow = long_prompt(rng, 200)
    quick = [rng.randint(1, 25) for _ in range(5)]

    async def leave_early(url: str, n: int) -> int:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:

            async def one() -> int:
                body = {"prompt": slow, "max_tokens": 200, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return r.status_code  # leaving the block closes the connection
                return r.status_code

            return sum(s == 200 for s in await asyncio.gather(*(one() for _ in range(n))))

    with lab.time_limit(20), serving(aengine) as url:
        left = asyncio.run(leave_early(url, 3))
        assert left == 3, f"3 streams should have started, {left} did{crash_note(aengine)}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and scrape(url)["nanolab_requests_running"] > 0:
            time.sleep(0.05)
        metrics = scrape(url)
        timed = httpx.post(
            f"{url}/v1/completions", json={"prompt": slow, "max_tokens": 200, "timeout": 0.3}, timeout=30
        )
        bad = [
            httpx.post(
                f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30
            )
            for raw in (b'{"prompt": ', b'{"prompt": [1], "top_p": NaN}', b'{"prompt": [], "max_tokens": 3}')
        ]
        after = httpx.post(f"{url}/v1/completions", json={"prompt": quick, "max_tokens": 5}, timeout=30)
    aborted = metrics.get('nanolab_requests_total{status="abort"}', 0)
    assert aborted == 3, (
        f"3 clients left their streams: {aborted:.0f} requests were stopped with 'abort'{crash_note(aengine)}: "
        "does abort stop live requests and pass their last output on?"
    )
    assert metrics["nanolab_requests_running"] == 0, "the requests whose clients left are still running"
    assert timed.status_code == 200, (
        f"a request with a deadline got HTTP {timed.status_code}{crash_note(aengine)}"
    )
    choice = timed.json()["choices"][0]
    assert choice["finish_reason"] == "timeout", (
        f"a 200-token request with a 0.3 s deadline (steps of 10 ms) ended with {choice['finish_reason']!r}, not 'timeout'"
    )
    assert choice["text"] and toy_text(slow, 200)[0].startswith(choice["text"]), (
        "a request that timed out keeps the text made so far, and only that"
    )
    assert [r.status_code for r in bad] == [400, 400, 400], "bad bodies are refused with 400"
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == toy_text(quick, 5)[0], (
        f"after all that, a plain request should be served as usual{crash_note(aengine)}"
    )


def test_a_full_server_refuses_at_once_and_serves_what_it_accepted(lab, rng):
    """with your Admission at max_waiting 2, a burst of 12 requests gets only 200s and 503s with Retry-After, every 200 carries its request's text, and the count is back to 0 at the end"""
    aengine = LearnersEngine(lab, step_delay=0.01, admission=LearnersAdmission(lab, 2))
    prompts = [[rng.randint(1, 25) for _ in range(4)] for _ in range(12)]
    with lab.time_limit(20), serving(aengine) as url:

        def one(p):
            return httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 20}, timeout=30)

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, prompts))
        left = aengine.admission.waiting
    statuses = [a.status_code for a in answers]
    assert not aengine.crashed, f"your loop failed: {aengine.crashed}"
    assert set(statuses) <= {200, 503} and 503 in statuses, (
        f"a burst of 12 on 4 seats and 2 waiting places: statuses {sorted(set(statuses))}{crash_note(aengine)}"
    )
    assert all(a.headers.get("retry-after") == "1" for a in answers if a.status_code == 503), (
        "a 503 carries Retry-After"
    )
    for p, a in zip(prompts, answers):
        if a.status_code == 200:
            assert a.json()["choices"][0]["text"] == toy_text(p, 20)[0], (
                f"an accepted request (prompt {p}) got another text"
            )
    assert json.loads(answers[statuses.index(503)].text)["error"]["type"], "a 503 has OpenAI's error body"
    assert statuses.count(200) >= 2, (
        f"a burst of 12 on 4 seats and 2 waiting places: only {statuses.count(200)} were served: "
        "does your Admission refuse while there is room?"
    )
    assert left == 0, (
        f"every request finished, and your Admission still counts {left} waiting: "
        "waiting is engine_waiting + sent - handled, with the last round's numbers"
    )
