"""OpenAI's chat completions API on the wire: request bodies in, response bodies and stream chunks out.

Request (``POST /v1/chat/completions``, JSON): ``messages`` (a list of ``{"role", "content"}``; content
a string or a list of text parts), ``model``, ``max_tokens`` or its newer name ``max_completion_tokens``
(default: as many as ``max_model_len`` leaves after the prompt, as vLLM does), ``temperature``,
``top_p``, ``seed``, ``stop``, ``n``, ``logprobs`` (true/false) with ``top_logprobs`` (0..20),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``stream``,
``stream_options.include_usage`` (and ``continuous_usage_stats``); vLLM's extras ``repetition_penalty``, ``top_k``,
``min_p``, ``stop_token_ids``, ``ignore_eos``, ``priority``, ``add_generation_prompt`` (default true)
and ``chat_template_kwargs`` (more variables for the template); nanolab's ``timeout`` (as for
completions). Unknown fields are ignored; ``tools`` and ``tool_choice`` are refused.
The messages are rendered with the model's chat template (`nanolab.engine.chat`).

Response: ``{"id": "chatcmpl-...", "object": "chat.completion", "created", "model", "choices":
[{"index", "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}], "usage": {...}}``,
one choice per sample (``n``); ``logprobs`` is null or ``{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}``. Streamed, as server-sent events of ``"object": "chat.completion.chunk"``: the first
chunk's ``delta`` is ``{"role": "assistant", "content": ""}``, each next one's ``{"content": <new text>}``,
then a chunk with an empty ``delta`` and the ``finish_reason``; with ``include_usage``, a last chunk
with no choices carries the usage (``"usage": null`` on the others); ``data: [DONE]`` ends the stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nanolab.model.sampling import SamplingParams, TokenLogprob
from nanolab.serving.openai_protocol import (
    COMMON_FIELDS,
    InvalidRequest,
    check_body_and_model,
    flag,
    parse_priority,
    parse_sampling_params,
    parse_stream,
    parse_timeout,
    token_text,
    unknown_fields,
)
from nanolab.text.chat_template import ChatTemplateError, Message, normalize_messages

# Fields nanolab does not implement, with the value that means "not used".
_UNSUPPORTED = {"tools": None, "tool_choice": None}


@dataclass(frozen=True)
class ChatRequest:
    """A parsed, validated chat completions request (its messages not yet rendered)."""

    messages: list[Message]
    params: SamplingParams  # max_tokens is a placeholder when ``max_tokens_given`` is false
    max_tokens_given: bool
    model: str
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None  # seconds before the request is aborted; None = the server's default
    ignored: tuple[str, ...] = ()  # fields of the body nanolab does not know (the server logs them)
    continuous_usage: bool = False  # usage so far on every chunk (stream_options.continuous_usage_stats)


CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    *_UNSUPPORTED,
}


def parse_chat_request(body: Any, model_name: str) -> ChatRequest:
    """Validate a JSON body; raises `InvalidRequest` naming the first problem found."""
    check_body_and_model(body, model_name)
    if body.get("messages") is None:
        raise InvalidRequest(
            'the request has no messages: give "messages": [{"role": "user", "content": "..."}]', "messages"
        )
    try:
        messages = normalize_messages(body["messages"])
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), "messages") from None
    fields = dict(body)
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    given = fields.get("max_tokens") is not None
    fields["logprobs"] = parse_chat_logprobs(body)
    try:
        params = parse_sampling_params(fields, _UNSUPPORTED, defaults={"max_tokens": 1})
    except InvalidRequest as exc:
        if exc.param == "max_tokens" and body.get("max_completion_tokens") is not None:
            # the value came from max_completion_tokens (it wins over max_tokens): name the field sent
            message = exc.message.replace("max_tokens", "max_completion_tokens", 1)
            raise InvalidRequest(message, "max_completion_tokens") from None
        raise
    stream, include_usage, continuous_usage = parse_stream(body)
    add_generation_prompt, template_kwargs = parse_template_options(body)
    return ChatRequest(
        messages,
        params,
        given,
        model_name,
        stream,
        include_usage,
        parse_priority(body),
        add_generation_prompt,
        template_kwargs,
        parse_timeout(body),
        unknown_fields(body, CHAT_FIELDS),
        continuous_usage,
    )


def parse_template_options(body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """vLLM's ``add_generation_prompt`` (default true) and ``chat_template_kwargs`` (an object)."""
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise InvalidRequest(
            f"add_generation_prompt must be true or false, got {add_generation_prompt!r}",
            "add_generation_prompt",
        )
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise InvalidRequest(
            'chat_template_kwargs must be an object such as {"enable_thinking": false}',
            "chat_template_kwargs",
        )
    return add_generation_prompt, template_kwargs


def parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs`` (0..20) as `SamplingParams.logprobs`."""
    wanted, top = flag(body, "logprobs"), body.get("top_logprobs")
    if top is not None and not wanted:
        raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise InvalidRequest(f"top_logprobs must be an integer in [0, 20], got {top!r}", "top_logprobs")
    return (top or 0) if wanted else None


def chat_logprobs(tokenizer: Any, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat logprobs object: for each token its text, log-probability, UTF-8 bytes and the top
    ``top_logprobs`` tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        special = token_id in getattr(tokenizer, "special_tokens", {}).values()
        raw = text.encode() if special else tokenizer.decode_bytes([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in logprobs
    ]
    return {"content": content}


def new_chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def message_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def delta_choice(
    index: int,
    delta: dict[str, str],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A stream chunk's choice: ``delta`` is ``{"role": ...}`` first, then ``{"content": ...}``, then ``{}``."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_body(
    cid: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    *,
    chunk: bool = False,
) -> dict[str, Any]:
    """A response body, or (``chunk=True``) one stream chunk."""
    kind = "chat.completion.chunk" if chunk else "chat.completion"
    body = {"id": cid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body
