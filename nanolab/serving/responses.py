"""From engine outputs to HTTP responses: whole bodies for plain requests, server-sent events for streams.

A request group (one API call) holds one engine request per prompt; each has ``n`` samples, so a
completion has ``prompts × n`` choices, choice ``index = prompt position * n + sample``. A chat request
has one prompt, so its choices are its samples.

Plain requests wait for every prompt's final output (`collect`), polling the connection so a client
that leaves has its requests aborted. Streams send what each engine step produced, per choice: its new
text (with ``echo``, the prompt first), the log-probabilities of its new tokens, and its finish reason
once that sample is done — samples of one request finish at different steps. Everything already queued
goes out in one write: when the server lags, tokens are sent together rather than one write (and one
thread switch) each. A stream whose generator is cancelled (the client left) aborts its requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanolab.engine.outputs import CompletionOutput, RequestOutput
from nanolab.model.sampling import TokenLogprob
from nanolab.serving import chat_protocol as chat
from nanolab.serving import openai_protocol as oa
from nanolab.serving.async_engine import EngineClient, EngineStepError, RequestGroup

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


class ClientGone(Exception):
    """The client closed the connection before its completion was ready."""


def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
    return JSONResponse(oa.error_body(message, type, param, code), status_code=status)


# -- plain requests -------------------------------------------------------------------------------------


async def collect_or_error(
    aengine: EngineClient, group: RequestGroup, request: Request
) -> list[RequestOutput] | JSONResponse:
    """Every final output of the group, or the error response for a failed step or a client gone."""
    try:
        return await collect(aengine, group, request)
    except EngineStepError as exc:
        return error_response(500, str(exc), "server_error")
    except ClientGone:
        return error_response(499, "the client closed the connection")


async def collect(aengine: EngineClient, group: RequestGroup, request: Request) -> list[RequestOutput]:
    """Wait for every request of the group to finish; abort them all if anything goes wrong."""
    finals: list[RequestOutput | None] = [None] * len(group.request_ids)
    remaining = len(finals)
    get: asyncio.Future | None = None
    next_poll = time.monotonic() + DISCONNECT_POLL_S
    try:
        while remaining:
            get = get or asyncio.ensure_future(group.queue.get())
            done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
            if time.monotonic() >= next_poll:  # outputs may arrive every step: poll by the clock
                if await request.is_disconnected():
                    raise ClientGone
                next_poll = time.monotonic() + DISCONNECT_POLL_S
            if not done:
                continue
            index, item = get.result()
            get = None
            if isinstance(item, EngineStepError):
                raise item
            if item.finished:
                finals[index] = item
                remaining -= 1
    finally:
        if get is not None:
            get.cancel()
        if remaining:  # error, disconnect or cancellation: stop the group's other requests too
            aengine.abort(group.request_ids)
    return finals  # type: ignore[return-value]


def usage_of(finals: list[RequestOutput], echo_only: bool = False) -> dict[str, int]:
    """Each prompt counted once, every sample's output tokens (none for ``echo_only``)."""
    n_prompt = sum(len(o.prompt_token_ids) for o in finals)
    n_out = 0 if echo_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
    return oa.usage(n_prompt, n_out)


def prompt_text(tokenizer: Any, out: RequestOutput) -> str:
    """The prompt as text, for ``echo`` (decoded when it was given as token ids)."""
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def echoed_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """The prompt's logprobs as entries like the output's; the first token's log-probability is None."""
    if not out.prompt_logprobs:
        return []
    return [TokenLogprob(out.prompt_token_ids[0], None, ()), *out.prompt_logprobs[1:]]  # type: ignore[arg-type]


def completion_choices(tokenizer: Any, req: oa.CompletionRequest, finals: list[RequestOutput]) -> list[dict]:
    choices = []
    for i, out in enumerate(finals):
        prefix = prompt_text(tokenizer, out) if req.echo else ""
        echoed = echoed_logprobs(out) if req.echo else []
        for c in out.outputs:
            generated = [] if req.echo_only else (c.logprobs or [])
            lp = None
            if c.logprobs is not None:
                lp = oa.completion_logprobs(tokenizer, [*echoed, *generated], 0 if echoed else len(prefix))
            text = prefix + ("" if req.echo_only else c.text or "")
            reason = "length" if req.echo_only else c.finish_reason  # (the left-out token may have been EOS)
            choices.append(oa.choice(i * req.params.n + c.index, text, reason, lp))
    return choices


def chat_choices(tokenizer: Any, final: RequestOutput) -> list[dict]:
    return [
        chat.message_choice(
            c.index,
            c.text or "",
            c.finish_reason,
            None if c.logprobs is None else chat.chat_logprobs(tokenizer, c.logprobs),
        )
        for c in final.outputs
    ]


# -- streams --------------------------------------------------------------------------------------------


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _ready_items(group: RequestGroup) -> list:
    """The next item of the group's queue, waited for, and every item already behind it."""
    items = [await group.queue.get()]
    while not group.queue.empty():
        items.append(group.queue.get_nowait())
    return items


@dataclass
class _Sent:
    """What one choice of a stream has sent so far."""

    started: bool = False  # its first chunk (with echo, the prompt) went out
    offset: int = 0  # characters of its tokens' text so far (logprobs' text_offset)
    finished: bool = False  # its finish reason went out


def _news(c: CompletionOutput, sent: _Sent) -> str | None:
    """The finish reason to send for a sample now (once), or None."""
    if c.finish_reason is None or sent.finished:
        return None
    sent.finished = True
    return c.finish_reason


async def stream_completion(
    aengine: EngineClient, group: RequestGroup, req: oa.CompletionRequest
) -> AsyncIterator[str]:
    """Server-sent events for a streamed completion. Cancelled when the client disconnects."""
    cid, created, model, tokenizer = group.group_id, oa.now(), req.model, aengine.tokenizer
    n = len(group.request_ids)
    sent: dict[int, _Sent] = {}
    done = 0
    failed = False
    prompt_tokens = completion_tokens = 0
    seen_prompts: dict[int, int] = {}  # prompt tokens of each prompt that has sent something
    generated = 0  # tokens generated so far, for continuous usage
    try:
        while done < n and not failed:
            events = []
            for prompt_index, item in await _ready_items(group):
                if isinstance(item, EngineStepError):
                    events.append(oa.sse(oa.error_body(str(item), "server_error")))
                    failed = True
                    break
                seen_prompts[prompt_index] = len(item.prompt_token_ids)
                if not req.echo_only:
                    generated += sum(len(c.delta_token_ids) for c in item.outputs)
                for c in item.outputs:
                    index = prompt_index * req.params.n + c.index
                    s = sent.setdefault(index, _Sent())
                    text, entries = c.delta_text, list(c.delta_logprobs or ())
                    if req.echo_only:  # the prompt alone: the one token the engine ran is left out
                        text, entries = "", []
                    if not s.started:
                        s.started = True
                        if req.echo:
                            text = prompt_text(tokenizer, item) + text
                            entries = [*echoed_logprobs(item), *entries]
                    lp = None
                    if entries:
                        lp = oa.completion_logprobs(tokenizer, entries, s.offset)
                        s.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    finish = _news(c, s)
                    if finish and req.echo_only:
                        finish = "length"
                    if text or lp or finish:
                        chunk = oa.completion_body(
                            cid, model, created, [oa.choice(index, text, finish, lp)], None
                        )
                        if req.continuous_usage:
                            chunk["usage"] = oa.usage(sum(seen_prompts.values()), generated)
                        elif req.include_usage:
                            chunk["usage"] = None  # as OpenAI: null on every chunk, the totals in a last one
                        events.append(oa.sse(chunk))
                if item.finished:
                    done += 1
                    prompt_tokens += len(item.prompt_token_ids)
                    completion_tokens += 0 if req.echo_only else sum(len(c.token_ids) for c in item.outputs)
            if not failed and done == n and req.include_usage:
                usage = oa.usage(prompt_tokens, completion_tokens)
                events.append(oa.sse(oa.completion_body(cid, model, created, [], usage)))
            if events:
                yield "".join(events)
        yield oa.sse("[DONE]")
    finally:
        if done < n:  # the client left (the generator was cancelled or closed) or the engine failed
            aengine.abort(group.request_ids)


async def stream_chat(
    aengine: EngineClient, group: RequestGroup, req: chat.ChatRequest, prompt_tokens: int = 0
) -> AsyncIterator[str]:
    """Server-sent events for a streamed chat completion: per choice the role, the content, the finish
    reason. ``prompt_tokens``: the rendered conversation's length (for continuous usage)."""
    cid, created, model, tokenizer = group.group_id, oa.now(), req.model, aengine.tokenizer
    generated = 0  # tokens generated so far, for continuous usage

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body = chat.chat_body(cid, model, created, choices, usage, chunk=True)
        if req.continuous_usage and usage is None:
            body["usage"] = oa.usage(prompt_tokens, generated)
        elif req.include_usage and usage is None:
            body["usage"] = None  # as OpenAI: null on every chunk, the totals in a last one
        return oa.sse(body)

    sent = [_Sent() for _ in range(req.params.n)]
    finished = False
    try:
        yield "".join(
            chunk([chat.delta_choice(i, {"role": "assistant", "content": ""})]) for i in range(len(sent))
        )
        while not finished:
            events = []
            for _, item in await _ready_items(group):
                if isinstance(item, EngineStepError):
                    events.append(oa.sse(oa.error_body(str(item), "server_error")))
                    finished = True
                    break
                generated += sum(len(c.delta_token_ids) for c in item.outputs)
                for c in item.outputs:
                    lp = chat.chat_logprobs(tokenizer, c.delta_logprobs) if c.delta_logprobs else None
                    if c.delta_text or lp:
                        events.append(
                            chunk([chat.delta_choice(c.index, {"content": c.delta_text}, None, lp)])
                        )
                    finish = _news(c, sent[c.index])
                    if finish:
                        events.append(chunk([chat.delta_choice(c.index, {}, finish)]))
                if item.finished:
                    finished = True
                    if req.include_usage:
                        events.append(chunk([], usage_of([item])))
            if events:
                yield "".join(events)
        yield oa.sse("[DONE]")
    finally:
        if not finished:  # the client left (the generator was cancelled or closed)
            aengine.abort(group.request_ids)
