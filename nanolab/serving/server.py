"""`nanolab serve`: the engine behind an OpenAI-compatible HTTP API.

    nanolab serve --port 8000                      # the bundled model on http://127.0.0.1:8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

Endpoints: ``POST /v1/completions`` (see `nanolab.serving.openai_protocol`), ``POST /v1/chat/completions``
(see `nanolab.serving.chat_protocol`; the messages are rendered with the model's chat template, and a
model without one answers 400), ``GET /v1/models`` and ``GET /v1/models/{id}``, vLLM's tokenizer endpoints
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (see `nanolab.serving.tokenize_protocol`),
``GET /health`` and ``GET /metrics`` (Prometheus text written by prometheus_client, see
`nanolab.serving.metrics`). Responses and streams are built in
`nanolab.serving.responses`: ``n`` choices per prompt, with logprobs and ``echo`` when asked for.

Every connection's requests go to one engine (`nanolab.serving.async_engine`), so concurrent clients share
continuous batches. `nanolab serve` runs it in a process of its own (`nanolab.serving.engine_process`;
``--engine-in thread`` runs it in a thread of the server's process instead), on one torch thread fewer than
the cores (`engine_process_threads`; ``--engine-threads N`` to choose). A client that disconnects has its requests aborted and
their KV blocks freed: a stream notices when its generator is cancelled, a plain request by polling
``request.is_disconnected()`` while it waits.

Limits (both off by default): ``--request-timeout S`` gives every request a deadline S seconds after it
arrived, and a request's ``timeout`` field its own; a request still running at its deadline is aborted
and answered with the text generated so far and finish reason "timeout" (a stream ends with that
reason). ``--max-waiting N`` refuses a new request at once with HTTP 503 and a ``Retry-After`` header
while N requests or more wait to be admitted, instead of queueing without bound. /metrics counts both
(``nanolab_requests_total{status="timeout"}`` and ``{status="overloaded"}``).

Deliberately left out: authentication, TLS, rate limits per client. Listen on 127.0.0.1 (the default)
unless a proxy guards the port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanolab.engine.chat import NoChatTemplate, chat_prompt, encode_text
from nanolab.serving import chat_protocol as chat
from nanolab.serving import openai_protocol as oa
from nanolab.serving import responses
from nanolab.serving import tokenize_protocol as tok
from nanolab.serving.async_engine import (
    AsyncEngine,
    EngineClient,
    EngineNotRunning,
    ServerOverloaded,
)
from nanolab.serving.responses import error_response
from nanolab.text.chat_template import ChatTemplate

log = logging.getLogger("nanolab.server")


def warn_ignored(fields: tuple[str, ...]) -> None:
    """Unknown fields are ignored, as vLLM does, but said so in the log: a misspelt field is then seen."""
    if fields:
        log.warning("ignored request fields nanolab does not know: %s", ", ".join(fields))


def build_app(aengine: EngineClient, model_name: str, chat_template: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI app serving ``aengine``'s model under the name ``model_name``.

    ``chat_template`` renders the messages of chat requests (see `nanolab.model.loading.load_chat_template`);
    without one, chat requests get a 400 that says so.

    The engine (a thread's, `AsyncEngine`, or a process's, `ProcessAsyncEngine`) stops with the app (its
    lifespan), and starts with it unless it was started before. ``app.state.async_engine`` and
    ``app.state.metrics`` give tests and embedders access to both.
    """
    metrics = aengine.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not aengine.started:  # `nanolab serve` starts an engine process before it listens
            await asyncio.to_thread(aengine.start)
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(title="nanolab", lifespan=lifespan)
    app.state.async_engine = aengine
    app.state.metrics = metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not aengine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": oa.now(),
            "owned_by": "nanolab",
            "max_model_len": aengine.config.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            message = f"the model {model_id!r} does not exist: this server serves {model_name!r}"
            return error_response(404, message, "not_found_error", "model", "model_not_found")
        return model_card()

    def reject(message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        """A 400 for a request refused before it reached the engine, counted as "rejected"."""
        metrics.requests.labels(status="rejected").inc()
        return error_response(400, message, param=param, code=code)

    def tokenizer_or_error() -> Any:
        if aengine.tokenizer is None:
            return reject(f"{model_name!r} has no tokenizer: it takes and gives token ids only")
        return aengine.tokenizer

    async def body_and_tokenizer(request: Request) -> tuple[Any, Any] | JSONResponse:
        """The JSON body and the tokenizer of a tokenizer endpoint, or the 400 that says why not."""
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        tokenizer = tokenizer_or_error()
        return tokenizer if isinstance(tokenizer, JSONResponse) else (body, tokenizer)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        got = await body_and_tokenizer(request)
        if isinstance(got, JSONResponse):
            return got
        body, tokenizer = got
        try:
            req = tok.parse_tokenize_request(body, model_name)
            warn_ignored(req.ignored)
            if req.prompt is not None:
                ids = encode_text(tokenizer, req.prompt, req.add_special_tokens)
            else:
                ids = chat_prompt(
                    chat_template, tokenizer, req.messages, req.add_generation_prompt, **req.template_kwargs
                ).token_ids
        except oa.InvalidRequest as exc:
            return reject(exc.message, exc.param, exc.code)
        except NoChatTemplate as exc:
            return reject(f"{model_name!r}: {exc}", "messages", "no_chat_template")
        except ValueError as exc:  # the template refused the messages
            return reject(str(exc), "messages")
        strs = [oa.token_text(tokenizer, t) for t in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": aengine.config.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        got = await body_and_tokenizer(request)
        if isinstance(got, JSONResponse):
            return got
        body, tokenizer = got
        try:
            ids = tok.parse_detokenize_request(body, model_name, tokenizer.vocab_size)
        except oa.InvalidRequest as exc:
            return reject(exc.message, exc.param, exc.code)
        return {"prompt": tokenizer.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tokenizer = tokenizer_or_error()
        if isinstance(tokenizer, JSONResponse):
            return tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": getattr(tokenizer, "eos_token", None),
            "bos_token": getattr(tokenizer, "bos_token", None),
            "pad_token": getattr(tokenizer, "pad_token", None),
            "chat_template": None if chat_template is None else chat_template.source,
            "model_max_length": aengine.config.max_model_len,
            "vocab_size": tokenizer.vocab_size,
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    async def read_json(request: Request) -> Any:
        """The request's JSON body, or the 400 response that says it is not JSON."""
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return reject(f"the request body is not valid JSON: {exc}", code="invalid_json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            req = oa.parse_completion_request(body, model_name)
            warn_ignored(req.ignored)
            cid = oa.new_completion_id()
            group = await aengine.add(
                cid, req.prompts, [req.params] * len(req.prompts), req.priority, timeout=req.timeout
            )
        except oa.InvalidRequest as exc:
            return reject(exc.message, exc.param, exc.code)
        except ValueError as exc:  # the engine refused a prompt (too long, bad token id, ...)
            return reject(str(exc), getattr(exc, "param", None) or "prompt")
        except EngineNotRunning as exc:
            return error_response(503, f"{exc}; try again later", "server_error")
        except ServerOverloaded as exc:  # too many requests waiting: refused at once, nothing queued
            body = oa.error_body(str(exc), "server_error", code="server_overloaded")
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(exc.retry_after)})
        if req.stream:
            return responses.event_stream(responses.stream_completion(aengine, group, req))
        finals = await responses.collect_or_error(aengine, group, request)
        if isinstance(finals, JSONResponse):
            return finals
        choices = responses.completion_choices(aengine.tokenizer, req, finals)
        usage = responses.usage_of(finals, req.echo_only)
        return oa.completion_body(cid, model_name, oa.now(), choices, usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            req = chat.parse_chat_request(body, model_name)
            warn_ignored(req.ignored)
            prompt = chat_prompt(
                chat_template,
                aengine.tokenizer,
                req.messages,
                req.add_generation_prompt,
                **req.template_kwargs,
            )
            params = req.params
            if not req.max_tokens_given:  # as many as fit (at least 1, so a too-long prompt is named)
                room = aengine.config.max_model_len - len(prompt.token_ids)
                params = replace(params, max_tokens=max(1, room))
            cid = chat.new_chat_id()
            group = await aengine.add(cid, [prompt.token_ids], [params], req.priority, timeout=req.timeout)
        except oa.InvalidRequest as exc:
            return reject(exc.message, exc.param, exc.code)
        except NoChatTemplate as exc:
            return reject(f"{model_name!r}: {exc}", code="no_chat_template")
        except ValueError as exc:  # the template refused the messages, or the engine the prompt
            return reject(str(exc), getattr(exc, "param", None) or "messages")
        except EngineNotRunning as exc:
            return error_response(503, f"{exc}; try again later", "server_error")
        except ServerOverloaded as exc:  # too many requests waiting: refused at once, nothing queued
            body = oa.error_body(str(exc), "server_error", code="server_overloaded")
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(exc.retry_after)})
        if req.stream:
            stream = responses.stream_chat(aengine, group, req, len(prompt.token_ids))
            return responses.event_stream(stream)
        finals = await responses.collect_or_error(aengine, group, request)
        if isinstance(finals, JSONResponse):
            return finals
        choices = responses.chat_choices(aengine.tokenizer, finals[0])
        return chat.chat_body(cid, model_name, oa.now(), choices, responses.usage_of(finals))

    return app


def engine_process_threads(requested: int | None = None) -> int:
    """Torch threads for the engine's own process: ``requested`` if given; else torch's count where
    OMP_NUM_THREADS sets it; else one fewer than torch would use (one per core), at least 1.

    The HTTP front end needs a core too. Given every core, the engine's threads share one with the front
    end, and each parallel region waits for the thread that lost its turn: on 2 cores under 32 streaming
    clients, the server delivered 2,130 output tokens/s with 2 threads and 3,349 with 1
    (``bench/bench_server.py``, 512 requests).
    """
    if requested is not None:
        return requested
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, torch.get_num_threads() - 1)


def run_server(args: argparse.Namespace) -> int:
    """`nanolab serve`: start the engine, build the app and run uvicorn until interrupted.

    Returns 0 after Ctrl-C, 2 if the model cannot be loaded, 1 if the engine process died while serving.
    """
    import uvicorn

    from nanolab.engine.config import EngineConfig
    from nanolab.model.loading import load_chat_template, load_model, load_tokenizer, resolve_checkpoint
    from nanolab.serving.engine_process import EngineProcessError, ProcessAsyncEngine, engine_from_checkpoint

    died = []
    server: uvicorn.Server | None = None

    def on_engine_death() -> None:  # stop serving: a supervisor restarts the whole server
        died.append(True)
        if server is not None:
            server.should_exit = True

    limits = {
        "max_waiting": getattr(args, "max_waiting", None),
        "request_timeout": getattr(args, "request_timeout", None),
    }
    try:
        config = EngineConfig.from_cli_args(args)
        path = resolve_checkpoint(args.model)
        tokenizer = load_tokenizer(args.model)
        template = load_chat_template(args.model, tokenizer)
        name = args.served_model_name or path.name
        if getattr(args, "engine_in", "process") == "thread":
            if getattr(args, "engine_threads", None):
                import torch

                torch.set_num_threads(args.engine_threads)  # the engine's threads are this process's
            aengine: EngineClient = AsyncEngine(load_model(args.model), tokenizer, config, **limits)
        else:
            aengine = ProcessAsyncEngine(
                engine_from_checkpoint(str(path), config),
                tokenizer,
                on_engine_death=on_engine_death,
                torch_threads=engine_process_threads(getattr(args, "engine_threads", None)),
                **limits,
            )
            aengine.start()  # load the model before listening: a bad checkpoint is an error, not a 503
    except (ValueError, FileNotFoundError, NotADirectoryError, EngineProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if tokenizer is None:
            print(
                "warning: this checkpoint has no tokenizer (nanolab_tokenizer.json or tokenizer.json): "
                "send prompts as token ids",
                file=sys.stderr,
            )
        if template is None:
            print(
                "note: this checkpoint has no chat template: /v1/chat/completions will answer 400",
                file=sys.stderr,
            )
        app = build_app(aengine, name, template)
        where = "a thread"
        if isinstance(aengine, ProcessAsyncEngine):
            threads = aengine.torch_threads
            where = f"its own process ({threads} torch thread{'s' if threads != 1 else ''})"
        print(
            f"serving {name!r} on http://{args.host}:{args.port}/v1, the engine in {where} (Ctrl-C to stop)",
            file=sys.stderr,
        )
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
        if died:  # the engine process died before the server was made
            return 1
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down (as uvicorn.run does)
            pass
    finally:
        aengine.shutdown()
    if died:
        print("error: the engine process died; the server stopped", file=sys.stderr)
        return 1
    return 0
