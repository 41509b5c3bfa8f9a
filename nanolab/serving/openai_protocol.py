"""OpenAI's completions API on the wire: request bodies in, response bodies and stream chunks out.

Request (``POST /v1/completions``, JSON): ``prompt`` (a string, a list of strings, a list of token ids
or a list of such lists), ``model``, ``max_tokens`` (default 16), ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream``, ``stream_options.include_usage``; and vLLM's extras ``top_k``, ``min_p``,
``stop_token_ids``, ``ignore_eos``, ``priority``; and nanolab's ``timeout`` (seconds until the request is
aborted with finish reason "timeout"; default: the server's ``--request-timeout``). Unknown fields are ignored, as vLLM does; fields nanolab cannot
honour (``n > 1``, ``logprobs``, ``echo``, ``suffix``, penalties, ``logit_bias``) are refused.

Response: ``{"id", "object": "text_completion", "created", "model", "choices": [{"index", "text",
"finish_reason", "logprobs": null}], "usage": {...}}``, one choice per prompt, ``index`` = the prompt's
position. Streamed, each chunk has the same shape with the new text only, sent as a server-sent event
``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.

Errors: ``{"error": {"message", "type", "param", "code"}}`` with HTTP 400 for bad input.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nanolab.engine.prompt import Prompt, PromptError, as_prompt_list
from nanolab.model.sampling import SamplingParams

# Fields nanolab does not implement, with the value that means "not used".
_UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "echo": False,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids")


class InvalidRequest(ValueError):
    """Bad input from a client: becomes an HTTP 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed, validated completions request."""

    prompts: list[Prompt]
    params: SamplingParams
    model: str
    stream: bool = False
    include_usage: bool = False
    priority: int = 0  # lower = sooner, with the engine's "priority" scheduling policy (vLLM's extra field)
    timeout: float | None = None  # seconds before the request is aborted; None = the server's default


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_prompts(prompt: Any) -> list[Prompt]:
    """The prompts of a request: a string, a list of strings, token ids, or a list of token id lists."""
    if prompt is None:
        raise InvalidRequest(
            "the request has no prompt: give 'prompt' as a string or a list of strings", "prompt"
        )
    try:
        return as_prompt_list(prompt)
    except PromptError as exc:
        raise InvalidRequest(str(exc), "prompt") from None


def parse_completion_request(body: Any, model_name: str) -> CompletionRequest:
    """Validate a JSON body; raises `InvalidRequest` naming the first problem found."""
    check_body_and_model(body, model_name)
    prompts = parse_prompts(body.get("prompt"))
    params = parse_sampling_params(body, _UNSUPPORTED)
    stream, include_usage = parse_stream(body)
    return CompletionRequest(
        prompts, params, model_name, stream, include_usage, parse_priority(body), parse_timeout(body)
    )


def check_body_and_model(body: Any, model_name: str) -> None:
    """The body is a JSON object and names this server's model (or none)."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise InvalidRequest(
            f"unknown model {model!r}: this server serves {model_name!r} (see GET /v1/models)",
            "model",
            "model_not_found",
        )


def parse_sampling_params(
    body: dict[str, Any], unsupported: dict[str, Any], defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """The body's sampling fields as `SamplingParams`; a field of ``unsupported`` set to a value other
    than its neutral one is refused. ``defaults`` fill fields the body leaves out."""
    for name, neutral in unsupported.items():
        if body.get(name, neutral) not in (neutral, None):
            raise InvalidRequest(f"{name}={body[name]!r} is not supported by nanolab; leave it out", name)
    kw = {**(defaults or {}), **{k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}}
    if kw.get("top_k") in (0, -1):
        kw["top_k"] = None  # vLLM's API spells "no limit" -1 (and 0); the Python API says None
    ignore_eos = body.get("ignore_eos", False)
    try:
        return SamplingParams(**kw, ignore_eos=ignore_eos)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        param = next((f for f in (*_SAMPLING_FIELDS, "ignore_eos") if msg.startswith(f)), None)
        raise InvalidRequest(msg, param) from None


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest(
            'stream_options must be an object such as {"include_usage": true}', "stream_options"
        )
    if options and not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")
    return stream, bool(options.get("include_usage"))


def parse_priority(body: dict[str, Any]) -> int:
    priority = body.get("priority") or 0
    if not _is_int(priority):
        raise InvalidRequest(f"priority must be an integer (lower = sooner), got {priority!r}", "priority")
    return priority


def parse_timeout(body: dict[str, Any]) -> float | None:
    """``timeout``: seconds from arrival until the request is aborted with finish reason "timeout"."""
    timeout = body.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidRequest(
            f"timeout must be a number of seconds > 0 (the request's deadline), got {timeout!r}", "timeout"
        )
    return float(timeout)


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def completion_body(
    cid: str, model: str, created: int, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    """A response body or a stream chunk (a chunk carries only its new text)."""
    body = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def now() -> int:
    return int(time.time())
