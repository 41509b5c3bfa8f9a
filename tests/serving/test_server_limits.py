"""The server's limits: request deadlines (``--request-timeout``, a request's ``timeout``) and back-pressure
(``--max-waiting``), on `AsyncEngine` directly and behind a live server on 127.0.0.1 (the same limits with the
engine in a process of its own: test_engine_process.py).

The model is the bundled one (it has a chat template). Tests slow its forward down, or hold it on a
gate, from the engine thread: a request then runs long enough to meet its deadline, or the engine stays
in one step while requests pile up, which makes the count of waiting requests exact.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from helpers.live_server import run_app  # noqa: E402
from test_server import Live, blocks_all_returned, patched_forward, slow, wait_for  # noqa: E402

from nanolab import LLM, SamplingParams  # noqa: E402
from nanolab.cli import build_parser, main  # noqa: E402
from nanolab.engine.config import EngineConfig  # noqa: E402
from nanolab.serving.async_engine import AsyncEngine, ServerOverloaded  # noqa: E402
from nanolab.serving.server import build_app  # noqa: E402

MODEL = "tinypy"
LONG = {"max_tokens": 100, "temperature": 0, "ignore_eos": True}  # 100 slowed steps: > 1 s
CHAT = [{"role": "user", "content": "Read a JSON file."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@contextmanager
def serving(llm: LLM, **limits) -> Iterator[Live]:
    """A live server over ``llm``'s parts with a fresh engine in a thread: ``limits`` go to `AsyncEngine`
    (``config`` too, replacing ``llm``'s settings). Its model is ``llm``'s, for tests to slow down."""
    aengine = AsyncEngine(llm.model, llm.tokenizer, limits.pop("config", llm.engine.config), **limits)
    app = build_app(aengine, MODEL, llm.chat_template)
    with run_app(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield Live(url, app, http, None, "thread")


@contextmanager
def gated(model) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The model's first forward blocks until ``gate`` is set (at most 30 s); ``entered`` says it began.

    The engine thread then stays inside one step: it takes no command and publishes no count.
    """
    entered, gate = threading.Event(), threading.Event()

    def factory(original):
        def forward(*args, **kwargs):
            if not entered.is_set():
                entered.set()
                gate.wait(30)
            return original(*args, **kwargs)

        return forward

    with patched_forward(model, factory):
        try:
            yield entered, gate
        finally:
            gate.set()


def count(m: dict[str, float], status: str) -> float:
    return m.get(f'nanolab_requests_total{{status="{status}"}}', 0.0)


def stream_events(r: httpx.Response) -> list[dict]:
    """The JSON chunks of an event stream (which must end with [DONE])."""
    events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# ---- back-pressure ----------------------------------------------------------------------------------


def test_a_burst_between_two_steps_cannot_overshoot_max_waiting(llm: LLM) -> None:
    """While the engine is inside one step, accepted calls count as waiting: the call past the limit is
    refused at once (ServerOverloaded, nothing queued); a call's prompts count one each."""
    aengine = AsyncEngine(llm.model, llm.tokenizer, llm.engine.config, max_waiting=3)
    aengine.start()
    params = SamplingParams(max_tokens=4, temperature=0)

    async def main() -> list:
        with gated(aengine.engine.model) as (entered, gate):
            first = await aengine.add("g0", ["import os"], [params])
            assert await asyncio.to_thread(entered.wait, 30)
            second = asyncio.ensure_future(aengine.add("g1", ["def f", "class A"], [params] * 2))
            await asyncio.sleep(0)  # the task runs up to its wait for the engine thread
            assert aengine.num_waiting == 3
            with pytest.raises(ServerOverloaded, match=r"3 requests are waiting.*limit is 3") as info:
                await aengine.add("g2", ["x = 1"], [params])
            assert isinstance(info.value.retry_after, int) and info.value.retry_after >= 1
            gate.set()
            groups = [first, await second]
        finals = []
        for group in groups:
            for _ in group.request_ids:
                while not (item := (await group.queue.get())[1]).finished:
                    pass
                finals.append(item)
        await asyncio.to_thread(wait_for, lambda: aengine.num_waiting == 0, "an empty queue")
        third = await aengine.add("g3", ["x = 1"], [params])  # room again
        while not (await third.queue.get())[1].finished:
            pass
        return finals

    try:
        finals = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert [f.outputs[0].finish_reason for f in finals] == ["length"] * 3
    overloaded = aengine.metrics.registry.get_sample_value("nanolab_requests_total", {"status": "overloaded"})
    assert overloaded == 1
    st = aengine.engine.stats()
    assert st.kv_blocks_free + st.kv_blocks_cached == st.kv_blocks_total


def test_a_full_server_answers_503_with_retry_after_for_completions_chat_and_streams(llm: LLM) -> None:
    with serving(llm, max_waiting=1) as live, gated(live.engine.model) as (entered, gate):
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=live.url, timeout=30) as other:
            first = pool.submit(other.post, "/v1/completions", json={"prompt": "import os", "max_tokens": 4})
            assert entered.wait(30), "the first request never reached the model"
            refused = [
                live.http.post("/v1/completions", json={"prompt": "def f", "max_tokens": 4}),
                live.http.post("/v1/completions", json={"prompt": "def f", "max_tokens": 4, "stream": True}),
                live.http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}),
                live.http.post("/v1/chat/completions", json={"messages": CHAT, "stream": True}),
            ]
            with pytest.raises(openai.InternalServerError) as info:
                live.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert info.value.status_code == 503
            assert live.metrics()["nanolab_requests_waiting_max"] == 1
            gate.set()
            assert first.result().status_code == 200
        for r in refused:
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "server_overloaded"
            assert "overloaded" in error["message"] and "max_waiting" in error["message"]
        wait_for(lambda: blocks_all_returned(live.metrics()), "every KV block back")
        assert live.http.post("/v1/completions", json={"prompt": "def f", "max_tokens": 4}).status_code == 200
        m = live.metrics()
        assert count(m, "overloaded") == 5 and count(m, "length") == 2


def test_64_clients_flooding_a_server_with_max_waiting_8_get_only_200s_and_503s(llm: LLM) -> None:
    """No 5xx but 503, every accepted request completes (streams too), every KV block comes back."""
    config = EngineConfig(max_num_seqs=4)

    async def flood(url: str) -> list[tuple[int, dict]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

            async def one(i: int) -> tuple[int, dict]:
                body = {"prompt": f"def f{i}(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                if i % 4 == 0:  # a quarter streams
                    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        raw = (await r.aread()).decode()
                    if r.status_code != 200:
                        return r.status_code, {"headers": dict(r.headers), **json.loads(raw)}
                    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
                    assert raw.endswith("data: [DONE]\n\n") and "error" not in chunks[-1]
                    return 200, {"finish": chunks[-1]["choices"][0]["finish_reason"]}
                r = await client.post("/v1/completions", json=body)
                if r.status_code != 200:
                    return r.status_code, {"headers": dict(r.headers), **r.json()}
                return 200, {"finish": r.json()["choices"][0]["finish_reason"]}

            return await asyncio.gather(*(one(i) for i in range(64)))

    with serving(llm, config=config, max_waiting=8) as live:
        before = live.metrics()
        with patched_forward(live.engine.model, slow):
            results = asyncio.run(flood(live.url))
        statuses = [s for s, _ in results]
        assert set(statuses) <= {200, 503}, statuses
        ok, refused = statuses.count(200), statuses.count(503)
        assert ok >= 8 and refused >= 1, (ok, refused)  # the first 8 always fit; 64 at once do not
        assert all(r["finish"] == "length" for s, r in results if s == 200)
        for _, r in (x for x in results if x[0] == 503):
            assert r["error"]["code"] == "server_overloaded" and int(r["headers"]["retry-after"]) >= 1
        wait_for(lambda: blocks_all_returned(live.metrics()), "every KV block back")
        after = live.metrics()
        assert count(after, "overloaded") - count(before, "overloaded") == refused
        assert count(after, "length") - count(before, "length") == ok
        assert after["nanolab_requests_waiting"] == 0


# ---- deadlines ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[Live]:
    with serving(llm) as live:
        yield live


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_request_past_its_deadline_ends_with_its_partial_text_and_finish_reason_timeout(
    server: Live, endpoint: str, stream: bool
) -> None:
    before = server.metrics()
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": "def parse(text):", **LONG}
    else:
        path, body = "/v1/chat/completions", {"messages": CHAT, **LONG}
    body = {**body, "timeout": 0.2, "stream": stream}
    with patched_forward(server.engine.model, slow):
        text, finish, n_tokens = _ask(server.http, path, body, chat=endpoint == "chat")
    assert finish == "timeout"
    assert text, "the text generated before the deadline"
    assert 0 < n_tokens < 100
    wait_for(lambda: blocks_all_returned(server.metrics()), "every KV block back")
    assert count(server.metrics(), "timeout") == count(before, "timeout") + 1


def _ask(http: httpx.Client, path: str, body: dict, chat: bool) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of one choice, plain or streamed."""
    if not body.get("stream"):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        return (
            (choice["message"]["content"] if chat else choice["text"]),
            choice["finish_reason"],
            usage["completion_tokens"],
        )
    body = {**body, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        chunks = stream_events(r)
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join((p["delta"].get("content") or "") if chat else p["text"] for p in pieces)
    return text, pieces[-1]["finish_reason"], chunks[-1]["usage"]["completion_tokens"]


def test_the_openai_client_sees_finish_reason_timeout(server: Live) -> None:
    with patched_forward(server.engine.model, slow):
        resp = server.client().completions.create(
            model=MODEL,
            prompt="class Stack:",
            extra_body={"timeout": 0.2, "ignore_eos": True},
            max_tokens=100,
        )
        stream = server.client().chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=100, stream=True, extra_body={"timeout": 0.2}
        )
        chunks = [c for c in stream if c.choices]
    assert resp.choices[0].finish_reason == "timeout" and resp.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "timeout"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_server_default_deadline_applies_unless_a_request_gives_its_own(llm: LLM, stream: bool) -> None:
    with serving(llm, request_timeout=0.2) as live, patched_forward(live.engine.model, slow):
        body = {"prompt": "import os", **LONG, "stream": stream}
        text, finish, n_tokens = _ask(live.http, "/v1/completions", body, chat=False)
        assert (finish, bool(text)) == ("timeout", True) and 0 < n_tokens < 100
        # its own, longer deadline: 40 slowed tokens take more than the server's 0.2 s
        body = {"prompt": "import os", **LONG, "max_tokens": 40, "timeout": 60, "stream": stream}
        _, finish, n_tokens = _ask(live.http, "/v1/completions", body, chat=False)
        assert (finish, n_tokens) == ("length", 40)
        wait_for(lambda: blocks_all_returned(live.metrics()), "every KV block back")
        assert count(live.metrics(), "timeout") == 1


def test_a_request_still_waiting_at_its_deadline_times_out_without_text(llm: LLM) -> None:
    """A deadline also ends a request that was never admitted (one running slot, taken)."""
    aengine = AsyncEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=1))
    aengine.start()
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def main():
        with patched_forward(aengine.engine.model, slow):
            running = await aengine.add("a", ["import os"], [long])
            waiting = await aengine.add("b", ["def f"], [long], timeout=0.2)
            while not (late := (await waiting.queue.get())[1]).finished:
                pass
            aengine.abort(running.request_ids)
            while not (first := (await running.queue.get())[1]).finished:
                pass
        return late, first

    try:
        late, first = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert late.outputs[0].finish_reason == "timeout"
    assert late.outputs[0].token_ids == [] and late.outputs[0].text == ""
    assert first.outputs[0].finish_reason == "abort", "the running request was not the one timed out"
    st = aengine.engine.stats()
    assert st.kv_blocks_free + st.kv_blocks_cached == st.kv_blocks_total


def test_an_idle_engine_thread_wakes_up_for_a_pending_deadline(llm: LLM) -> None:
    """With nothing to step, the thread sleeps on its command queue, but no longer than the next deadline."""
    aengine = AsyncEngine(llm.model, llm.tokenizer)
    aengine.engine.has_unfinished = lambda: False  # the thread never steps: the request stays waiting
    aengine.start()

    async def main():
        group = await aengine.add("g", ["import os"], [SamplingParams(max_tokens=4)], timeout=0.2)
        return (await asyncio.wait_for(group.queue.get(), 30))[1]

    try:
        out = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert out.finished and out.outputs[0].finish_reason == "timeout" and out.outputs[0].token_ids == []
    assert aengine.engine.stats().num_waiting == 0


# ---- bad values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, "5", True, float("inf")], ids=repr)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_timeout_field_gets_400_naming_it(server: Live, path: str, value) -> None:
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": CHAT}
    r = server.http.post(
        path, content=json.dumps({**body, "timeout": value}), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "timeout" and "timeout must be" in error["message"]


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--max-waiting", "0", "must be >= 1"),
        ("--max-waiting", "-3", "must be >= 1"),
        ("--max-waiting", "1.5", "whole number"),
        ("--max-waiting", "many", "whole number"),
        ("--request-timeout", "0", "seconds > 0"),
        ("--request-timeout", "-2", "seconds > 0"),
        ("--request-timeout", "soon", "seconds > 0"),
        ("--request-timeout", "inf", "seconds > 0"),
        ("--request-timeout", "nan", "seconds > 0"),
    ],
)
def test_bad_limit_flags_are_argparse_errors_naming_the_flag(
    capsys, flag: str, value: str, words: str
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and words in err and value in err


def test_the_limit_flags_reach_the_engine_and_default_to_no_limit(monkeypatch) -> None:
    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, *args: served.append(server.config.app))
    assert main(["serve", "--max-waiting", "8", "--request-timeout", "2.5", "--log-level", "error"]) == 0
    assert main(["serve", "--log-level", "error", "--engine-in", "thread"]) == 0
    limited, plain = (app.state.async_engine for app in served)
    assert (limited.max_waiting, limited.request_timeout) == (8, 2.5)
    assert (plain.max_waiting, plain.request_timeout) == (None, None)


def test_serve_help_documents_the_limits(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--request-timeout SECONDS" in out and "--max-waiting N" in out
    assert 'finish_reason "timeout"' in out and "HTTP 503 and a Retry-After header" in out
    assert out.count("default: no limit") == 2


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_waiting": 0}, "max_waiting must be an integer >= 1"),
        ({"max_waiting": 2.5}, "max_waiting must be an integer >= 1"),
        ({"max_waiting": True}, "max_waiting must be an integer >= 1"),
        ({"request_timeout": 0}, "request_timeout must be a number of seconds > 0"),
        ({"request_timeout": float("nan")}, "request_timeout must be a number of seconds > 0"),
        ({"request_timeout": "3"}, "request_timeout must be a number of seconds > 0"),
    ],
)
def test_bad_async_engine_limits_are_value_errors_naming_them(llm: LLM, kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        AsyncEngine(llm.model, llm.tokenizer, **kwargs)


def test_a_bad_timeout_given_to_add_is_a_value_error_and_queues_nothing(llm: LLM) -> None:
    aengine = AsyncEngine(llm.model, llm.tokenizer)
    aengine.start()
    try:
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0, got -1"):
            asyncio.run(aengine.add("g", ["a"], [SamplingParams()], timeout=-1))
        assert aengine.num_waiting == 0
    finally:
        aengine.shutdown()
