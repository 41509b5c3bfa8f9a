"""`n`, logprobs, echo, penalties and logit bias through the server, with the official `openai` client:
what the server answers equals what `LLM` gives offline for the same parameters (greedy, or seeded: a
seed makes sampling reproducible), plain and streamed, for completions and chat."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from helpers.live_server import serve, serve_command  # noqa: E402

from nanolab import LLM, SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef main():\n"]
MESSAGES = [{"role": "user", "content": "Read a file and count its lines"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module", params=["thread", "process"], ids=["engine-thread", "engine-process"])
def server(llm, request):
    with serve(llm, "tinypy", engine_in=request.param) as live:
        yield live


def offline(llm: LLM, prompts, **params):
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def test_n_choices_per_prompt_are_indexed_prompt_by_prompt_and_equal_offline(server, llm) -> None:
    resp = server.client.completions.create(
        model="tinypy", prompt=PROMPTS, n=3, max_tokens=12, temperature=0.9, seed=5
    )
    want = offline(llm, PROMPTS, n=3, max_tokens=12, temperature=0.9, seed=5)
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [c.text for o in want for c in o.outputs]
    assert len({c.text for c in resp.choices[:3]}) > 1  # the samples differ
    prompt_tokens = sum(len(o.prompt_token_ids) for o in want)  # each prompt once, not once per sample
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for o in want for c in o.outputs)


def test_logprobs_are_openais_legacy_object_and_equal_offline(server, llm) -> None:
    resp = server.client.completions.create(
        model="tinypy", prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=5
    )
    (want,) = offline(llm, PROMPTS[0], max_tokens=10, temperature=0, logprobs=5)
    (choice,) = resp.choices
    lp, expected = choice.logprobs, want.outputs[0].logprobs
    assert choice.text == want.outputs[0].text and choice.text.isascii()
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, top, e in zip(lp.tokens, lp.top_logprobs, expected):
        assert len(top) == 5 and token in top  # greedy: the chosen token is among the 5 best
        assert max(top.values()) == pytest.approx(top[token], abs=1e-6)
        assert sorted(top.values(), reverse=True) == pytest.approx([v for _, v in e.top], abs=1e-4)


def test_a_stream_of_n_samples_with_logprobs_adds_up_to_the_plain_answer(server) -> None:
    args = dict(model="tinypy", prompt=PROMPTS, n=2, max_tokens=10, temperature=0.8, seed=3, logprobs=2)
    plain = server.client.completions.create(**args)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in server.client.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    for c in plain.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert finishes[c.index] == [c.finish_reason]  # each sample's finish reason, once


def test_echo_puts_the_prompt_first_plain_streamed_and_for_token_ids(server, llm) -> None:
    resp = server.client.completions.create(
        model="tinypy", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True
    )
    (want,) = offline(llm, PROMPTS[0], max_tokens=6, temperature=0)
    assert resp.choices[0].text == PROMPTS[0] + want.outputs[0].text
    streamed = server.client.completions.create(
        model="tinypy", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == resp.choices[0].text
    ids = llm.tokenizer.encode(PROMPTS[1])
    by_ids = server.client.completions.create(
        model="tinypy", prompt=ids, max_tokens=4, temperature=0, echo=True
    )
    assert by_ids.choices[0].text.startswith(PROMPTS[1])


def test_penalties_and_logit_bias_equal_offline(server, llm) -> None:
    banned = llm.tokenizer.encode("    ")  # indentation
    resp = server.client.completions.create(
        model="tinypy",
        prompt=PROMPTS,
        max_tokens=24,
        temperature=0,
        frequency_penalty=1.2,
        presence_penalty=0.4,
        logit_bias={str(t): -100 for t in banned},
        extra_body={"repetition_penalty": 1.1},
    )
    params = dict(
        frequency_penalty=1.2,
        presence_penalty=0.4,
        repetition_penalty=1.1,
        logit_bias=dict.fromkeys(banned, -100),
    )
    want = offline(llm, PROMPTS, max_tokens=24, temperature=0, **params)
    assert [c.text for c in resp.choices] == [o.outputs[0].text for o in want]
    plain = offline(llm, PROMPTS, max_tokens=24, temperature=0)
    assert [o.outputs[0].text for o in want] != [o.outputs[0].text for o in plain]  # they did change the text
    assert all(t not in c.token_ids for o in want for c in o.outputs for t in banned)


def test_chat_with_n_and_top_logprobs_equals_offline(server, llm) -> None:
    reply = server.client.chat.completions.create(
        model="tinypy",
        messages=MESSAGES,
        n=3,
        max_tokens=10,
        temperature=0.7,
        seed=9,
        logprobs=True,
        top_logprobs=3,
    )
    (want,) = llm.chat(
        MESSAGES, SamplingParams(n=3, max_tokens=10, temperature=0.7, seed=9, logprobs=3), use_tqdm=False
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [c.text for c in want.outputs]
    for choice, w in zip(reply.choices, want.outputs):
        content = choice.logprobs.content
        assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
        assert all(len(e.top_logprobs) == 3 for e in content)
        assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)


def test_a_streamed_chat_of_n_samples_has_a_role_content_and_finish_per_choice(server) -> None:
    args = dict(model="tinypy", messages=MESSAGES, n=2, max_tokens=8, temperature=0.7, seed=4)
    plain = server.client.chat.completions.create(**args)
    roles, contents, finishes = {}, {}, {}
    for chunk in server.client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert roles == {0: "assistant", 1: "assistant"}
    assert contents == {c.index: c.message.content for c in plain.choices}
    assert finishes == {c.index: [c.finish_reason] for c in plain.choices}


def test_raw_streamed_logprobs_are_per_chunk(server) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "logprobs": 1, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    logprobs = [c["choices"][0]["logprobs"] for c in events]
    assert all(lp is not None and len(lp["tokens"]) == len(lp["token_logprobs"]) for lp in logprobs)
    assert sum(len(lp["tokens"]) for lp in logprobs) == 5


def test_echo_with_logprobs_gives_the_prompts_tokens_first(server, llm) -> None:
    resp = server.client.completions.create(
        model="tinypy", prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    (want,) = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, logprobs=1, prompt_logprobs=1), use_tqdm=False
    )
    lp = resp.choices[0].logprobs
    n_prompt = len(want.prompt_token_ids)
    assert resp.choices[0].text == PROMPTS[0] + want.outputs[0].text == "".join(lp.tokens)
    assert len(lp.tokens) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.outputs[0].logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = server.client.completions.create(
        model="tinypy", prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True, logprobs=1, stream=True
    )
    tokens, offsets = [], []
    for chunk in streamed:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_max_tokens_0_with_echo_scores_the_prompt_alone(server, llm) -> None:
    """As older scoring clients ask: the prompt and its log-probabilities, nothing generated, finish reason
    "length", no completion tokens; plain, streamed and for token-id prompts. Without echo it is a 400."""
    ids = llm.tokenizer.encode(PROMPTS[1])
    (want,) = llm.generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2), use_tqdm=False
    )
    expected = [e.logprob for e in want.prompt_logprobs[1:]]
    for prompt in (PROMPTS[1], ids):
        resp = server.client.completions.create(
            model="tinypy", prompt=prompt, max_tokens=0, echo=True, logprobs=2
        )
        c = resp.choices[0]
        assert (c.text, c.finish_reason) == (PROMPTS[1], "length")
        assert len(c.logprobs.tokens) == len(ids) and "".join(c.logprobs.tokens) == PROMPTS[1]
        assert c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 0)
    chunks = list(
        server.client.completions.create(
            model="tinypy",
            prompt=ids,
            max_tokens=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    r = server.http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "0 only with echo" in r.json()["error"]["message"]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, llm) -> None:
    """vLLM's stream option: with include_usage, every chunk carries the usage so far (completions and
    chat), growing to the totals of the last chunk; without include_usage, no chunk has usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    ids = llm.tokenizer.encode(PROMPTS[0])
    chunks = list(
        server.client.completions.create(
            model="tinypy", prompt=ids, max_tokens=6, temperature=0, stream=True, stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    usages = [c.usage for c in chunks]
    assert all(u is not None and u.prompt_tokens == len(ids) for u in usages)
    done = [u.completion_tokens for u in usages]
    assert done == sorted(done) and done[0] >= 1 and done[-1] == 6
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    messages = [{"role": "user", "content": "Sort a list."}]
    chat_chunks = list(
        server.client.chat.completions.create(
            model="tinypy", messages=messages, max_tokens=5, stream=True, stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    n_prompt = server.http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert all(c.usage is not None and c.usage.prompt_tokens == n_prompt for c in chat_chunks)
    assert chat_chunks[0].usage.completion_tokens == 0 and chat_chunks[-1].usage.completion_tokens == 5
    plain = server.client.completions.create(
        model="tinypy", prompt=ids, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True}
    )
    assert all(c.usage is None for c in plain)


def test_the_nanolab_serve_command_answers_the_openai_client_as_llm_does_offline(llm) -> None:
    """The command itself, with both limits set: completions and chat, plain and streamed, n=3, logprobs=5
    and penalties, greedy, equal to offline `LLM`."""
    penalties = dict(frequency_penalty=0.8, presence_penalty=0.3)
    greedy = SamplingParams(max_tokens=10, temperature=0, n=3, logprobs=5, **penalties)
    want = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs
    (chat_want,) = llm.chat(MESSAGES, greedy, use_tqdm=False)
    args = dict(model="tinypy", max_tokens=10, temperature=0, n=3, **penalties)
    with serve_command(["--max-waiting", "8", "--request-timeout", "60"]) as command:
        client = command.client
        plain = client.completions.create(prompt=PROMPTS[0], logprobs=5, **args)
        streamed: dict[int, str] = {}
        for chunk in client.completions.create(prompt=PROMPTS[0], logprobs=5, stream=True, **args):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        reply = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=5, **args)
        chat_streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(messages=MESSAGES, stream=True, **args):
            for c in chunk.choices:
                chat_streamed[c.index] = chat_streamed.get(c.index, "") + (c.delta.content or "")
    assert command.exit_code == 0
    assert [c.text for c in plain.choices] == [w.text for w in want] == [streamed[i] for i in range(3)]
    for c, w in zip(plain.choices, want):
        assert c.logprobs.token_logprobs == pytest.approx([e.logprob for e in w.logprobs], abs=1e-4)
        assert all(len(top) == 5 for top in c.logprobs.top_logprobs)
    texts = [c.text for c in chat_want.outputs]
    assert [c.message.content for c in reply.choices] == texts == [chat_streamed[i] for i in range(3)]
    assert all(len(e.top_logprobs) == 5 for c in reply.choices for e in c.logprobs.content)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "a", "echo": 1}, "echo"),
        ("/v1/completions", {"prompt": "a", "stream": 0}, "stream"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 0}, "logprobs"),
    ],
)
def test_true_or_false_fields_refuse_numbers(server, path, body, param) -> None:
    r = server.http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert f"{param} must be true or false, got {json.dumps(body[param])}" in r.json()["error"]["message"]


def test_unknown_fields_are_ignored_and_named_in_the_servers_log(server, caplog) -> None:
    with caplog.at_level("WARNING", logger="nanolab.server"):
        r = server.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "repetiton_penalty": 2})
        chat = server.http.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "echo": True}
        )
    assert r.status_code == 200 and chat.status_code == 200
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == "nanolab.server"]
    assert "ignored request fields nanolab does not know: repetiton_penalty" in warnings
    assert "ignored request fields nanolab does not know: echo" in warnings
    known = server.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "user": "u", "n": 1})
    assert known.status_code == 200 and len(caplog.records) == len(warnings)
