"""Chat: templates rendered as transformers renders them, `LLM.chat`, and ``/v1/chat/completions``.

The server tests run the bundled model (it ships a chat template of its own) behind a live server on
127.0.0.1 and drive it with the official openai client; every expected reply comes from offline
`LLM.chat` on the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from helpers.engine_utils import tiny_model  # noqa: E402
from helpers.live_server import serve  # noqa: E402

from nanolab import LLM, SamplingParams, Tokenizer  # noqa: E402
from nanolab.model.loading import ASSETS_DIR, load_chat_template, save_model  # noqa: E402
from nanolab.text.chat_template import ChatTemplate, ChatTemplateError, normalize_messages  # noqa: E402

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
HELPERS = """{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
    {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
    <{{ m.role }}>{% generation %}{{ m.content | tojson }}{% endgeneration %}
{% endfor -%}
{%- if ns.system %}[system: {{ ns.system | tojson }}]{% endif %}"""
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "helpers": HELPERS}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
CONVERSATION = [
    {"role": "system", "content": 'You write <Python> & "nothing" else.'},
    {"role": "user", "content": "Sort a list of numbers\nin place."},
    {"role": "assistant", "content": "  xs.sort()  "},
    {"role": "user", "content": "Now reverse it: naïve ✓"},
]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def bundled_template_source() -> str:
    return (ASSETS_DIR / "tinypy" / "chat_template.jinja").read_text()


# ---- templates ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*TEMPLATES, "tinypy"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers_apply_chat_template(name, add_generation_prompt) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    source = TEMPLATES.get(name) or bundled_template_source()
    conversation = CONVERSATION[1:] if name == "mistral" else CONVERSATION
    (expected,), _ = render_jinja_template(
        [conversation], chat_template=source, add_generation_prompt=add_generation_prompt, **SPECIAL
    )
    assert ChatTemplate(source, SPECIAL).render(conversation, add_generation_prompt) == expected


def test_the_bundled_template_writes_a_python_file() -> None:
    text = ChatTemplate(bundled_template_source()).render(CONVERSATION[:2])
    assert text == '# You write <Python> & "nothing" else.\n# Sort a list of numbers\n# in place.\n\n'


def test_a_template_that_refuses_a_conversation_raises_its_message() -> None:
    template = ChatTemplate(MISTRAL, SPECIAL)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(CONVERSATION)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",  # climbing to object: the sandbox's job
        "{{ ''.__class__.__base__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}",  # immutable: no changing the caller's data
    ],
)
def test_templates_run_sandboxed(source) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(CONVERSATION)


def test_a_template_that_is_not_jinja_is_refused_with_its_line() -> None:
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 2\)"):
        ChatTemplate("{% for m in messages %}\n{% endfor")


BAD_MESSAGES = {
    "not a list": ("hello", "non-empty list"),
    "empty": ([], "non-empty list"),
    "not an object": (["hi"], "messages[0] must be an object"),
    "no role": ([{"content": "hi"}], 'messages[0] needs a "role"'),
    "content not text": ([{"role": "user", "content": 3}], 'messages[0] needs a "content"'),
    "image part": (
        [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}],
        "messages[1].content[0] is of type 'image_url'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
def test_malformed_messages_are_refused_naming_the_message(case) -> None:
    messages, words = BAD_MESSAGES[case]
    with pytest.raises(ChatTemplateError) as err:
        normalize_messages(messages)
    assert words in str(err.value)


def test_text_parts_are_joined_into_one_content() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert normalize_messages([{"role": "user", "content": parts, "name": "x"}]) == [
        {"role": "user", "content": "one\ntwo", "name": "x"}
    ]


# ---- where a checkpoint keeps its template ----------------------------------------------------------


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory) -> Path:
    """A tiny nanolab checkpoint with a tokenizer and no chat template."""
    text = (Path(json.__file__).read_text()) * 2
    tok = Tokenizer.train(text, 300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return save_model(tiny_model("llama", vocab_size=tok.vocab_size), tmp_path_factory.mktemp("plain"), tok)


def test_the_template_comes_from_chat_template_jinja_else_tokenizer_config(plain_checkpoint, tmp_path):
    assert load_chat_template(plain_checkpoint) is None
    config = {"chat_template": CHATML, "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(tmp_path)
    assert template.source == CHATML and template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": LLAMA3}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(tmp_path).source == LLAMA3
    (tmp_path / "chat_template.jinja").write_text(MISTRAL)
    assert load_chat_template(tmp_path).source == MISTRAL
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="chat_template.jinja: the chat template is not valid Jinja"):
        load_chat_template(tmp_path)


def test_chat_without_a_template_says_so(plain_checkpoint) -> None:
    llm = LLM(plain_checkpoint)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    given = LLM(plain_checkpoint, chat_template=CHATML)
    out = given.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == given.tokenizer.encode(out.prompt, allowed_special="all")
    assert out.prompt_token_ids.count(given.tokenizer.special_tokens["<|im_start|>"]) == 2


# ---- LLM.chat on the bundled model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def test_chat_equals_generate_on_the_rendered_conversation(llm) -> None:
    (out,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    text = llm.chat_template.render(CONVERSATION)
    (expected,) = llm.generate(text, GREEDY, use_tqdm=False)
    assert out.prompt == text
    assert out.prompt_token_ids == expected.prompt_token_ids
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids and out.outputs[0].text


def test_chat_takes_a_list_of_conversations_and_answers_in_order(llm) -> None:
    first, second = CONVERSATION[:2], CONVERSATION
    short = SamplingParams(max_tokens=8, temperature=0)
    outs = llm.chat([first, second], short, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [
        llm.chat(c, short, use_tqdm=False)[0].outputs[0].text for c in (first, second)
    ]
    no_prompt = llm.chat(first, short, use_tqdm=False, add_generation_prompt=False)[0]
    assert no_prompt.prompt == outs[0].prompt.removesuffix("\n")


# ---- /v1/chat/completions ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["thread", "process"], ids=["engine-thread", "engine-process"])
def server(llm, request):
    with serve(llm, "tinypy", engine_in=request.param) as live:
        yield live


def offline_reply(llm: LLM, messages, max_tokens: int) -> tuple[str, str]:
    out = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)[0]
    return out.outputs[0].text, out.outputs[0].finish_reason


def test_openai_client_chat_equals_offline_chat(server, llm) -> None:
    reply = server.client.chat.completions.create(
        model="tinypy", messages=CONVERSATION, max_tokens=24, temperature=0
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert (choice.message.content, choice.finish_reason) == offline_reply(llm, CONVERSATION, 24)
    rendered = llm.tokenizer.encode(llm.chat_template.render(CONVERSATION), allowed_special="all")
    assert reply.usage.prompt_tokens == len(rendered) and reply.usage.completion_tokens == 24
    newer = server.client.chat.completions.create(
        model="tinypy", messages=CONVERSATION, max_completion_tokens=5, temperature=0
    )
    assert newer.usage.completion_tokens == 5 and reply.choices[0].message.content.startswith(
        newer.choices[0].message.content
    )


def test_openai_client_streamed_chat_has_role_then_content_then_finish(server, llm) -> None:
    stream = server.client.chat.completions.create(
        model="tinypy",
        messages=CONVERSATION[:2],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    pieces = [c.choices[0].delta.content for c in chunks[1:-2]]
    assert all(pieces) and all(c.choices[0].finish_reason is None for c in chunks[:-2])
    last, usage = chunks[-2], chunks[-1]
    assert last.choices[0].delta.content is None and usage.choices == []
    assert ("".join(pieces), last.choices[0].finish_reason) == offline_reply(llm, CONVERSATION[:2], 24)
    assert usage.usage.completion_tokens == 24


def test_raw_chat_stream_is_server_sent_events_ending_with_done(server) -> None:
    body = {"messages": CONVERSATION[:2], "max_tokens": 6, "temperature": 0, "stream": True}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in chunks[1:-1])
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0]


def test_without_max_tokens_a_reply_may_fill_the_context(llm) -> None:
    small = LLM(llm.model, llm.tokenizer, max_model_len=48, chat_template=llm.chat_template)
    with serve(small, "tinypy") as live:
        reply = live.client.chat.completions.create(
            model="tinypy", messages=CONVERSATION[:2], temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 48


BAD_CHAT = {
    "no messages": ({"max_tokens": 5}, "messages", "no messages"),
    "empty messages": ({"messages": []}, "messages", "non-empty list"),
    "message without role": ({"messages": [{"content": "hi"}]}, "messages", '"role"'),
    "image content": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
        "only text parts",
    ),
    "too long for the model": (
        {"messages": [{"role": "user", "content": "x = 1\n" * 400}], "max_tokens": 8},
        "messages",
        "max_model_len 512",
    ),
    "n of 0": ({"messages": CONVERSATION, "n": 0}, "n", "n must be an integer >= 1"),
    "logprobs not a bool": ({"messages": CONVERSATION, "logprobs": 3}, "logprobs", "true or false"),
    "top_logprobs without logprobs": ({"messages": CONVERSATION, "top_logprobs": 2}, "top_logprobs", "needs"),
    "top_logprobs above 20": (
        {"messages": CONVERSATION, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "[0, 20]",
    ),
    "frequency_penalty out of range": (
        {"messages": CONVERSATION, "frequency_penalty": -3},
        "frequency_penalty",
        "[-2, 2]",
    ),
    "tools": ({"messages": CONVERSATION, "tools": [{"type": "function"}]}, "tools", "not supported"),
    "negative temperature": (
        {"messages": CONVERSATION, "temperature": -1},
        "temperature",
        "temperature must be",
    ),
    "bad max_completion_tokens": (
        {"messages": CONVERSATION, "max_completion_tokens": 0},
        "max_completion_tokens",
        "max_completion_tokens must be an integer >= 1",
    ),
    "bad max_completion_tokens beside a good max_tokens": (
        {"messages": CONVERSATION, "max_tokens": 5, "max_completion_tokens": True},
        "max_completion_tokens",
        "max_completion_tokens must be",
    ),
    "bad max_tokens": ({"messages": CONVERSATION, "max_tokens": 0}, "max_tokens", "max_tokens must be"),
    "unknown model": ({"messages": CONVERSATION, "model": "gpt-17"}, "model", "unknown model"),
    "stream not a bool": ({"messages": CONVERSATION, "stream": "yes"}, "stream", "true or false"),
    "template kwargs not an object": (
        {"messages": CONVERSATION, "chat_template_kwargs": [1]},
        "chat_template_kwargs",
        "must be an object",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHAT))
def test_bad_chat_requests_get_400_naming_the_problem(server, case) -> None:
    body, param, words = BAD_CHAT[case]
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert words in error["message"], error["message"]


def test_a_model_without_a_chat_template_answers_400_that_says_so(llm) -> None:
    with serve(LLM(llm.model, llm.tokenizer), "plain") as live:
        with pytest.raises(openai.BadRequestError, match="no chat template") as err:
            live.client.chat.completions.create(model="plain", messages=CONVERSATION, max_tokens=4)
        assert err.value.code == "no_chat_template"
        ok = live.client.completions.create(model="plain", prompt="import os", max_tokens=4)
        assert ok.choices[0].text is not None
