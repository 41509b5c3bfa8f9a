"""OpenAI's completions API on the wire: request bodies in, response bodies and stream chunks out.

Request (``POST /v1/completions``, JSON): ``prompt`` (a string, a list of strings, a list of token ids
or a list of such lists), ``model``, ``max_tokens`` (default 16), ``temperature``, ``top_p``, ``seed``,
``stop``, ``n`` (samples per prompt), ``logprobs`` (0..20 top tokens per output token), ``echo``,
``presence_penalty``, ``frequency_penalty``, ``logit_bias`` (token id -> bias), ``stream``,
``stream_options.include_usage`` (and vLLM's ``continuous_usage_stats``: the usage so far on every
chunk); ``max_tokens: 0`` with ``echo`` answers with the prompt (and, with
``logprobs``, its log-probabilities) alone, as older scoring clients ask; and vLLM's extras ``repetition_penalty``, ``top_k``, ``min_p``,
``stop_token_ids``, ``ignore_eos``, ``priority``; and nanolab's ``timeout`` (seconds until the request is
aborted with finish reason "timeout"; default: the server's ``--request-timeout``). Unknown fields are
ignored, as vLLM does; ``best_of`` and ``suffix`` are refused. With ``echo`` and ``logprobs``, the
prompt's tokens come first in the logprobs too (the first with a null log-probability).

Response: ``{"id", "object": "text_completion", "created", "model", "choices": [{"index", "text",
"finish_reason", "logprobs"}], "usage": {...}}``, ``n`` choices per prompt: choice ``index`` is
``prompt position * n + sample``. ``logprobs`` is null, or OpenAI's legacy object ``{"tokens",
"token_logprobs", "top_logprobs", "text_offset"}`` (the model's own log-probabilities, before penalties
and temperature). Streamed, each chunk has the same shape with the new text only, sent as a server-sent
event ``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.

Errors: ``{"error": {"message", "type", "param", "code"}}`` with HTTP 400 for bad input.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from nanolab.engine.prompt import Prompt, PromptError, as_prompt_list
from nanolab.model.sampling import SamplingParams, TokenLogprob

# Fields nanolab does not implement, with the value that means "not used".
_UNSUPPORTED = {"best_of": 1, "suffix": None}
# Body fields that are `SamplingParams` fields of the same name (``logit_bias`` is converted first).
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "ignore_eos",
)


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
    echo: bool = False  # the text of each choice starts with its prompt
    ignored: tuple[str, ...] = ()  # fields of the body nanolab does not know (the server logs them)
    # ``max_tokens: 0`` with ``echo``: the answer is the prompt (and its logprobs) alone, finish reason
    # "length". The engine runs the request for one token, which the answer leaves out.
    echo_only: bool = False
    continuous_usage: bool = False  # usage so far on every chunk (stream_options.continuous_usage_stats)


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
    echo = flag(body, "echo")
    max_tokens = body.get("max_tokens")
    echo_only = echo and _is_int(max_tokens) and max_tokens == 0  # older scoring clients ask this way
    if _is_int(max_tokens) and max_tokens == 0 and not echo:
        raise InvalidRequest(
            "max_tokens must be an integer >= 1 (0 only with echo: the prompt alone)", "max_tokens"
        )
    params = parse_sampling_params({**body, "max_tokens": 1} if echo_only else body, _UNSUPPORTED)
    stream, include_usage, continuous_usage = parse_stream(body)
    if echo and params.logprobs is not None:  # the prompt's tokens are echoed with their logprobs too
        params = replace(params, prompt_logprobs=params.logprobs)
    priority, timeout = parse_priority(body), parse_timeout(body)
    ignored = unknown_fields(body, COMPLETION_FIELDS)
    return CompletionRequest(
        prompts,
        params,
        model_name,
        stream,
        include_usage,
        priority,
        timeout,
        echo,
        ignored,
        echo_only,
        continuous_usage,
    )


# Every field a completions request may have: the others are ignored, with a warning in the server's log.
# "user" is OpenAI's end-user id, accepted and unused.
COMMON_FIELDS = frozenset(
    {"model", "stream", "stream_options", "priority", "timeout", "user", *_SAMPLING_FIELDS, *_UNSUPPORTED}
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}


def unknown_fields(body: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    return tuple(sorted(set(body) - known))


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
    if "logit_bias" in kw:
        kw["logit_bias"] = parse_logit_bias(kw["logit_bias"])
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        param = msg.split(" ", 1)[0]
        raise InvalidRequest(msg, param if param in _SAMPLING_FIELDS else None) from None


def parse_logit_bias(bias: Any) -> dict[int, Any]:
    """OpenAI's ``logit_bias``: a JSON object whose keys are token ids written as strings."""
    if not isinstance(bias, dict):
        raise InvalidRequest(
            f'logit_bias must be an object such as {{"50256": -100}}, got {bias!r}', "logit_bias"
        )
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        out[token] = value
    return out


def flag(body: dict[str, Any], name: str) -> bool:
    """A true/false field (absent or null: false); anything else is refused, 0 and 1 included."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {json.dumps(value)}", name)
    return value


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage`` and vLLM's ``stream_options.continuous_usage_stats``
    (with ``include_usage``: the usage so far on every chunk, not null)."""
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InvalidRequest(
            'stream_options must be an object such as {"include_usage": true}', "stream_options"
        )
    if options and not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        if not isinstance(options.get(name, False), (bool, type(None))):
            raise InvalidRequest(
                f"stream_options.{name} must be true or false, got {json.dumps(options[name])}",
                "stream_options",
            )
    include_usage = bool(options.get("include_usage"))
    return stream, include_usage, include_usage and bool(options.get("continuous_usage_stats"))


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
    if not _finite_seconds(timeout):
        raise InvalidRequest(
            f"timeout must be a number of seconds > 0 (the request's deadline), got {timeout!r}", "timeout"
        )
    return float(timeout)


def _finite_seconds(value: Any) -> bool:
    """A number > 0 that a float holds as finite (not a bool, not NaN, not an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:
        return False


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text for logprobs: its bytes decoded (an incomplete character shows as U+FFFD), or
    its name for a special token."""
    special = {v: k for k, v in getattr(tokenizer, "special_tokens", {}).items()}
    if token_id in special:
        return special[token_id]
    return tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer: Any, logprobs: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object for the tokens ``logprobs`` describe, their text starting at
    character ``offset`` of the choice's text. ``top_logprobs`` holds the top tokens and the chosen one."""
    tokens, offsets, top = [], [], []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        best = {token_text(tokenizer, t): v for t, v in lp.top}
        best.setdefault(text, lp.logprob)
        top.append(None if lp.logprob is None else best)  # an echoed prompt's first token has none
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


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
