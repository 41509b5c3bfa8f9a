"""The engine: which requests run, and one step that runs them all (Labs 4 and 5; Lab 7 to come).

`config` (`EngineConfig`, every engine setting in one place), `request` (the request state machine and
its outputs), `prompt` (a prompt normalised, tokenized and checked, once), `batching` (static and continuous
batching simulated on a clock of steps), `chunking` (a step's token budget shared between decodes and
prompt chunks, on the same clock), `scheduler` (token budget, seats, policies, chunked prefill,
preemption), `engine` (the continuous-batching step loop and what it publishes to observers), `chat` (a
conversation rendered and tokenized: the prompt of `LLM.chat` and of the server's chat endpoint), `llm`
(`LLM`: offline generation in vLLM's shape).
"""
