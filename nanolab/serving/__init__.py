"""Serving: the engine behind an OpenAI-compatible HTTP API (Lab 8, still to come).

`async_engine` (one engine thread, many asyncio connections), `openai_protocol` (request bodies to
sampling parameters and outputs to response bodies), `chat_protocol` (the same for chat completions),
`metrics` (Prometheus counters fed by the engine's step records), `server` (the FastAPI app and
`nanolab serve`).
"""
