"""Serving: the engine behind an OpenAI-compatible HTTP API (Lab 8, still to come).

`async_engine` (one engine, many asyncio connections: the engine loop, its front end, and the engine in
a thread), `engine_process` (the same loop in a process of its own, over ZeroMQ), `openai_protocol`
(request bodies to sampling parameters and outputs to response bodies), `chat_protocol` (the same for
chat completions), `metrics` (Prometheus counters fed by the engine's step records), `server` (the
FastAPI app and `nanolab serve`).
"""
