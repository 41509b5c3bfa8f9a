"""Tests of `nanolab serve`: a live server on 127.0.0.1, driven by the official openai client and httpx.

The server runs in-process (uvicorn in a thread, on a socket bound to a free loopback port) so tests
can reach into the engine: slow its model down, or make one step fail. The checkpoint is a tiny random
model with a tiny trained tokenizer, built once per module; every expected output comes from offline
`LLM.generate` on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from helpers.engine_faults import Faults, faulty_engine, faulty_forward  # noqa: E402
from helpers.live_server import alive, engine_children, run_app, serve_command  # noqa: E402

from nanolab import LLM, SamplingParams  # noqa: E402
from nanolab.model.config import ModelConfig  # noqa: E402
from nanolab.model.loading import save_model  # noqa: E402
from nanolab.model.transformer import Transformer  # noqa: E402
from nanolab.serving.async_engine import AsyncEngine, EngineNotRunning  # noqa: E402
from nanolab.serving.engine_process import ProcessAsyncEngine  # noqa: E402
from nanolab.serving.server import build_app  # noqa: E402
from nanolab.text.tokenizer import Tokenizer  # noqa: E402

MODEL_NAME = "tiny"
MAX_LEN = 128
PROMPTS = [
    "def main():",
    "import os",
    "class Parser(object):",
    "    return self.",
    "for i in range(10):",
    "# Licensed under",
    "x = {'a': 1}",
    "if __name__ ==",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama-style model and a 300-token BPE tokenizer trained on Python source."""
    text = inspect.getsource(json) + inspect.getsource(textwrap)
    tokenizer = Tokenizer.train(text, 300, special_tokens=["<|endoftext|>"])
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_model=32,
        d_ff=64,
        max_seq_len=MAX_LEN,
    )
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # spread-out logits: greedy choices are far from ties
    return save_model(model, tmp_path_factory.mktemp("ckpt") / MODEL_NAME, tokenizer)


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint))


def offline_texts(llm: LLM, prompts, params: SamplingParams) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


@dataclass
class Live:
    """A running server, with one HTTP client (making clients is slow: each builds an SSL context)."""

    url: str
    app: object
    http: httpx.Client
    faults: Faults | None  # slow the engine's forward down, or make one fail
    engine_in: str  # "thread" or "process"

    @property
    def engine(self):
        """The engine itself (its engine in a thread only)."""
        return self.app.state.async_engine.engine

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        text = self.http.get("/metrics").text
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    @functools.cached_property
    def _client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=30)

    def client(self) -> openai.OpenAI:
        """The official client; no retries, so a 500 is seen as it is."""
        return self._client


def faulty_engine_for(llm: LLM, checkpoint: Path, folder: Path, engine_in: str):
    """An engine over the checkpoint, in a thread (over ``llm``'s model) or in a process of its own, whose
    forward watches ``folder`` for faults (see `helpers.engine_faults`)."""
    if engine_in == "process":
        factory = functools.partial(faulty_engine, str(checkpoint), str(folder))
        return ProcessAsyncEngine(factory, llm.tokenizer)
    llm.model.forward = faulty_forward(llm.model.forward, str(folder))
    return AsyncEngine(llm.model, llm.tokenizer, llm.engine.config)


@contextmanager
def running_server(checkpoint: Path, folder: Path, engine_in: str = "thread") -> Iterator[Live]:
    """A server over the checkpoint, its engine in a thread of this process or in a process of its own;
    the engine's forward watches ``folder`` for faults (see `helpers.engine_faults`)."""
    llm = LLM(str(checkpoint))
    aengine = faulty_engine_for(llm, checkpoint, folder, engine_in)
    app = build_app(aengine, MODEL_NAME, llm.chat_template)
    with run_app(app) as url:
        live = Live(url, app, httpx.Client(base_url=url, timeout=30), Faults(folder), engine_in)
        try:
            yield live
        finally:
            live.http.close()


@pytest.fixture(scope="module", params=["thread", "process"], ids=["engine-thread", "engine-process"])
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, request) -> Iterator[Live]:
    with running_server(checkpoint, tmp_path_factory.mktemp("faults"), request.param) as live:
        yield live


def wait_for(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def blocks_all_returned(m: dict[str, float]) -> bool:
    """No request holds a KV block: every block is free or held by the prefix cache alone."""
    return (
        m["nanolab_requests_running"] == 0
        and m["nanolab_kv_blocks_free"] + m["nanolab_kv_blocks_cached"] == m["nanolab_kv_blocks_total"]
    )


@contextmanager
def patched_forward(model: torch.nn.Module, wrapper_factory) -> Iterator[None]:
    """Replace ``model.forward`` (called from the engine thread) for the duration of the block."""
    original = model.forward
    model.forward = wrapper_factory(original)
    try:
        yield
    finally:
        del model.forward  # back to the class's forward


def slow(original, delay: float = 0.01):
    def forward(*args, **kwargs):
        time.sleep(delay)
        return original(*args, **kwargs)

    return forward


# ---- endpoints ----------------------------------------------------------------------------------


def test_health_and_models_list_the_served_model(server: Live) -> None:
    assert server.http.get("/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert server.http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_LEN


def test_unknown_route_gets_an_openai_style_404(server: Live) -> None:
    r = server.http.post("/v1/chat/nothing", json={})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


# ---- completions match offline generation -------------------------------------------------------


def test_completion_of_a_list_of_prompts_equals_offline_greedy(server: Live, offline: LLM) -> None:
    """One choice per prompt, in prompt order, with the text and token counts offline `generate` gives."""
    prompts = PROMPTS[:3]
    resp = server.client().completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=20, temperature=0)
    expected = offline.generate(prompts, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert resp.object == "text_completion" and resp.model == MODEL_NAME and resp.id.startswith("cmpl-")
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in resp.choices] == [o.outputs[0].finish_reason for o in expected]
    assert all(c.logprobs is None for c in resp.choices)
    n_prompt = sum(len(o.prompt_token_ids) for o in expected)
    n_out = sum(len(o.outputs[0].token_ids) for o in expected)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, n_out)
    assert resp.usage.total_tokens == n_prompt + n_out


def test_default_max_tokens_is_16(server: Live) -> None:
    resp = server.client().completions.create(
        model=MODEL_NAME, prompt="import", temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_token_id_prompts_are_accepted(server: Live, offline: LLM) -> None:
    ids = [[5, 17, 200, 33], [99, 1, 2]]
    resp = server.client().completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in resp.choices] == offline_texts(
        offline, ids, SamplingParams(max_tokens=8, temperature=0)
    )


def test_stop_strings_and_seeded_sampling_equal_offline(server: Live, offline: LLM) -> None:
    """Stop strings cut the text as offline; a seeded sample depends only on its seed, not the batch."""
    client = server.client()
    greedy = offline_texts(offline, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0))[0]
    stop = greedy[5:7] if len(greedy) > 7 else "zz"
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop]
    )
    want = offline_texts(offline, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert resp.choices[0].text == want and stop not in want

    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    resp = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50},
    )
    assert resp.choices[0].text == offline_texts(offline, PROMPTS[1], params)[0]


def test_streaming_equals_offline_and_ends_with_usage_and_done(server: Live, offline: LLM) -> None:
    prompts = PROMPTS[:2]
    params = SamplingParams(max_tokens=20, temperature=0)
    expected = offline.generate(prompts, params, use_tqdm=False)
    stream = server.client().completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage = ["", ""], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            assert finish[c.index] is None, "no text after a choice's finish_reason"
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason
    assert texts == [o.outputs[0].text for o in expected]
    assert finish == [o.outputs[0].finish_reason for o in expected]
    assert usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_raw_stream_is_server_sent_events_ending_with_done(server: Live) -> None:
    body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 5, "temperature": 0, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


# ---- concurrency ----------------------------------------------------------------------------------


def test_32_concurrent_streams_share_batches_and_each_equals_offline(server: Live, offline: LLM) -> None:
    """32 clients stream at once; each gets exactly its offline output, and engine steps ran many at once."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = offline_texts(offline, prompts, params)
    before = server.metrics()
    client = server.client()
    start = threading.Barrier(32)

    def run(prompt: str) -> str:
        start.wait()
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, prompts))
    assert got == expected
    after = server.metrics()
    steps = after["nanolab_batch_size_count"] - before["nanolab_batch_size_count"]
    seqs = after["nanolab_batch_size_sum"] - before["nanolab_batch_size_sum"]
    assert steps > 0 and seqs / steps > 2, f"mean batch size {seqs / steps:.2f}: requests did not share steps"
    single = after['nanolab_batch_size_bucket{le="1.0"}'] - before['nanolab_batch_size_bucket{le="1.0"}']
    assert single < steps
    assert after["nanolab_mean_batch_size"] > 1
    assert (
        after['nanolab_requests_total{status="length"}']
        - before.get('nanolab_requests_total{status="length"}', 0)
        == 32
    )
    assert blocks_all_returned(after)


# ---- disconnects ------------------------------------------------------------------------------------


def test_client_dropping_a_stream_aborts_its_request_and_frees_its_blocks(server: Live) -> None:
    before = server.metrics()
    aborts_before = before.get('nanolab_requests_total{status="abort"}', 0)
    body = {
        "model": MODEL_NAME,
        "prompt": "while True:",
        "max_tokens": 100,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with server.faults.slow():  # 100 tokens now take > 1 s: the drop comes first
        with server.http.stream("POST", "/v1/completions", json=body) as r:
            events = r.iter_lines()
            got: list[str] = []
            for line in events:
                if line.startswith("data: "):
                    got.append(line)
                if len(got) == 3:
                    break
            mid = server.metrics()
            assert mid["nanolab_requests_running"] == 1
            assert (
                mid["nanolab_kv_blocks_free"] + mid["nanolab_kv_blocks_cached"]
                < mid["nanolab_kv_blocks_total"]
            )
        # leaving the block closed the connection mid-stream
        wait_for(
            lambda: server.metrics().get('nanolab_requests_total{status="abort"}', 0) == aborts_before + 1,
            "the abort",
        )
    after = server.metrics()
    assert blocks_all_returned(after)
    generated = after["nanolab_generation_tokens_total"] - before["nanolab_generation_tokens_total"]
    assert 3 <= generated < 100, "the request stopped early"


def test_client_giving_up_on_a_plain_request_aborts_it(server: Live) -> None:
    aborts_before = server.metrics().get('nanolab_requests_total{status="abort"}', 0)
    body = {
        "model": MODEL_NAME,
        "prompt": "while True:",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.faults.slow():
        with pytest.raises(httpx.ReadTimeout):
            server.http.post("/v1/completions", json=body, timeout=0.3)
        wait_for(
            lambda: server.metrics().get('nanolab_requests_total{status="abort"}', 0) == aborts_before + 1,
            "the abort",
        )
    assert blocks_all_returned(server.metrics())


# ---- bad input ----------------------------------------------------------------------------------------

BAD = {
    "missing prompt": ({"max_tokens": 5}, "prompt", "no prompt"),
    "empty prompt": ({"prompt": ""}, "prompt", "empty"),
    "empty prompt list": ({"prompt": []}, "prompt", "empty"),
    "empty token list": ({"prompt": [[]]}, "prompt", "empty"),
    "prompt of the wrong type": ({"prompt": 42}, "prompt", "must be a string"),
    "prompts mixing text and token ids": ({"prompt": [[1, 2], "a"]}, "prompt", "mix text and token ids"),
    "negative max_tokens": ({"prompt": "a", "max_tokens": -3}, "max_tokens", "max_tokens must be"),
    "max_tokens not an integer": ({"prompt": "a", "max_tokens": "7"}, "max_tokens", "max_tokens must be"),
    "negative temperature": ({"prompt": "a", "temperature": -0.5}, "temperature", "temperature must be"),
    "top_p above 1": ({"prompt": "a", "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    "temperature true": ({"prompt": "a", "temperature": True}, "temperature", "temperature must be"),
    "top_p true": ({"prompt": "a", "top_p": True}, "top_p", "top_p must be in (0, 1]"),
    "top_p of 0": ({"prompt": "a", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    "empty stop string": ({"prompt": "a", "stop": [""]}, "stop", "stop must be"),
    "prompt longer than the model": ({"prompt": [7] * 200}, "prompt", "max_model_len 128"),
    "prompt + max_tokens too long": ({"prompt": "a", "max_tokens": 500}, "prompt", "lower max_tokens"),
    "token id outside the vocabulary": ({"prompt": [1, 10**6]}, "prompt", "outside the vocabulary"),
    "unknown model": ({"prompt": "a", "model": "gpt-17"}, "model", "unknown model 'gpt-17'"),
    "n of 0": ({"prompt": "a", "n": 0}, "n", "n must be an integer >= 1"),
    "n beyond max_num_seqs": ({"prompt": "a", "n": 10_000}, "n", "max_num_seqs="),
    "best_of": ({"prompt": "a", "best_of": 3}, "best_of", "not supported"),
    "logprobs above 20": ({"prompt": "a", "logprobs": 21}, "logprobs", "logprobs must be"),
    "echo not a bool": ({"prompt": "a", "echo": "yes"}, "echo", "echo must be true or false"),
    "presence_penalty out of range": ({"prompt": "a", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    "repetition_penalty of 0": ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    "logit_bias key not a token id": ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    "logit_bias out of range": ({"prompt": "a", "logit_bias": {"1": 200}}, "logit_bias", "[-100, 100]"),
    "logit_bias outside the vocabulary": (
        {"prompt": "a", "logit_bias": {"10000000": 1}},
        "logit_bias",
        "but the vocabulary has",
    ),
    "stop_token_ids not ids": ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids", "token ids"),
    "stream not a bool": ({"prompt": "a", "stream": "yes"}, "stream", "true or false"),
    "priority not an integer": ({"prompt": "a", "priority": "high"}, "priority", "priority must be"),
    "body not an object": ([1, 2], None, "JSON object"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_gets_400_naming_the_problem(server: Live, case: str) -> None:
    body, param, words = BAD[case]
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"], error["message"]


def test_malformed_json_gets_400_and_rejections_are_counted(server: Live) -> None:
    before = server.metrics().get('nanolab_requests_total{status="rejected"}', 0)
    r = server.http.post(
        "/v1/completions", content=b'{"prompt": "a",', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]
    assert server.metrics()['nanolab_requests_total{status="rejected"}'] == before + 1


def test_openai_client_sees_a_bad_request_error(server: Live) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        server.client().completions.create(model=MODEL_NAME, prompt="a", temperature=-1)


def test_a_rejected_list_queues_none_of_its_prompts(server: Live) -> None:
    before = server.metrics()["nanolab_prompt_tokens_total"]
    r = server.http.post("/v1/completions", json={"prompt": ["fine", [3] * 300]})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    assert server.metrics()["nanolab_prompt_tokens_total"] == before


# ---- engine failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_engine_error_fails_its_request_with_500_and_the_server_keeps_serving(
    server: Live, offline: LLM, stream: bool
) -> None:
    client = server.client()
    before = server.metrics()
    with server.faults.fail_once():
        if stream:
            with pytest.raises(openai.APIError, match="injected failure"):
                for _ in client.completions.create(
                    model=MODEL_NAME, prompt="import", max_tokens=8, stream=True
                ):
                    pass
        else:
            with pytest.raises(openai.InternalServerError, match="injected failure") as info:
                client.completions.create(model=MODEL_NAME, prompt="import", max_tokens=8)
            assert info.value.status_code == 500
        after = server.metrics()
        assert blocks_all_returned(after)
        assert (
            after['nanolab_requests_total{status="error"}']
            == before.get('nanolab_requests_total{status="error"}', 0) + 1
        )
        assert after["nanolab_engine_step_errors_total"] == before["nanolab_engine_step_errors_total"] + 1
        # the next request runs normally (the engine thread survived)
        resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert (
        resp.choices[0].text
        == offline_texts(offline, PROMPTS[2], SamplingParams(max_tokens=12, temperature=0))[0]
    )
    assert server.http.get("/health").status_code == 200


def test_an_idle_engine_sleeps_on_its_commands(server: Live) -> None:
    """No busy waiting: with nothing to do, the engine thread is always found blocked in queue.get, and
    the engine process uses no CPU."""
    wait_for(lambda: server.metrics()["nanolab_requests_running"] == 0, "an idle engine")
    if server.engine_in == "process":
        pid = server.app.state.async_engine.process.pid
        before = process_cpu_seconds(pid)
        time.sleep(1.0)
        assert process_cpu_seconds(pid) - before < 0.05
        return
    thread = server.app.state.async_engine._thread
    for _ in range(20):
        frame, stack = sys._current_frames()[thread.ident], []
        while frame is not None:
            stack.append(frame.f_code.co_name)
            frame = frame.f_back
        assert stack[0] == "wait" and "get" in stack and "_run" in stack, stack
        assert "step" not in stack
        time.sleep(0.01)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- metrics and lifecycle ---------------------------------------------------------------------------------


def test_metrics_are_valid_prometheus_text(server: Live) -> None:
    """Every family has HELP and TYPE; histogram buckets are cumulative and end at +Inf = _count."""
    parser = pytest.importorskip("prometheus_client.parser")
    server.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=4)
    text = server.http.get("/metrics").text
    assert server.http.get("/metrics").headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    want = {
        "nanolab_requests": "counter",
        "nanolab_prompt_tokens": "counter",
        "nanolab_generation_tokens": "counter",
        "nanolab_time_to_first_token_seconds": "histogram",
        "nanolab_inter_token_latency_seconds": "histogram",
        "nanolab_requests_running": "gauge",
        "nanolab_requests_waiting": "gauge",
        "nanolab_kv_block_usage": "gauge",
        "nanolab_prefix_cache_hit_rate": "gauge",
    }
    for name, kind in want.items():
        assert families[name].type == kind, name
        assert families[name].documentation
    for name in ("nanolab_time_to_first_token_seconds", "nanolab_inter_token_latency_seconds"):
        samples = families[name].samples
        buckets = [s.value for s in samples if s.name.endswith("_bucket")]
        count = next(s.value for s in samples if s.name.endswith("_count"))
        assert buckets == sorted(buckets) and buckets[-1] == count > 0
        assert samples[len(buckets) - 1].labels["le"] == "+Inf"


@pytest.mark.parametrize("engine_in", ["thread", "process"])
def test_stopping_the_server_stops_the_engine(checkpoint: Path, tmp_path: Path, engine_in: str) -> None:
    with running_server(checkpoint, tmp_path, engine_in) as live:
        resp = live.client().completions.create(model=MODEL_NAME, prompt="a", max_tokens=3)
        assert resp.choices[0].finish_reason in ("stop", "length")
        aengine = live.app.state.async_engine
        assert aengine._thread.is_alive()
        if engine_in == "process":
            assert aengine.process.is_alive()
    assert not aengine._thread.is_alive()
    assert not aengine.is_running
    if engine_in == "process":
        assert aengine.process.exitcode == 0, "the engine process did not end by itself"


@pytest.mark.parametrize("engine_in", ["thread", "process"])
def test_shutdown_aborts_running_requests_frees_their_blocks_and_refuses_new_ones(
    checkpoint: Path, tmp_path: Path, engine_in: str
) -> None:
    aengine = faulty_engine_for(LLM(str(checkpoint)), checkpoint, tmp_path, engine_in)
    aengine.start()
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def main() -> list:
        with Faults(tmp_path).slow():
            group = await aengine.add("g", ["while True:"], [params])
            items = [(await group.queue.get())[1]]  # a first token: the request is running
            await asyncio.to_thread(aengine.shutdown)
            while not items[-1].finished:
                items.append((await group.queue.get())[1])
        with pytest.raises(EngineNotRunning):
            await aengine.add("h", ["a"], [params])
        return items

    items = asyncio.run(main())
    assert items[-1].outputs[0].finish_reason == "abort"
    assert len(items[-1].outputs[0].token_ids) < 100
    assert not aengine._thread.is_alive()
    if engine_in == "process":
        assert aengine.process.exitcode == 0, "the engine process did not end by itself"
    m = aengine.metrics.registry.get_sample_value
    assert m("nanolab_kv_blocks_free") + m("nanolab_kv_blocks_cached") == m("nanolab_kv_blocks_total")
    assert m("nanolab_requests_running") == m("nanolab_requests_waiting") == 0, (
        "the server forgets finished requests"
    )


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
def test_nanolab_serve_command_serves_the_checkpoint_and_exits_cleanly_on_ctrl_c(
    checkpoint: Path, offline: LLM
) -> None:
    args = ["--model", str(checkpoint), "--served-model-name", "cli-model", "--max-num-seqs", "8"]
    with serve_command(args) as command:
        body = {"model": "cli-model", "prompt": PROMPTS[3], "max_tokens": 10, "temperature": 0}
        text = command.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        [engine_process] = engine_children(command.process.pid)  # the engine runs in a process of its own
    assert text == offline_texts(offline, PROMPTS[3], SamplingParams(max_tokens=10, temperature=0))[0]
    assert command.exit_code == 0, command.process.stderr.read()
    assert not alive(engine_process), "the engine process outlived the server"
