"""The engine: which requests run, and one step that runs them all (Labs 4, 5 and 7).

`config` (`EngineConfig`, every engine setting in one place), `device` (the torch device the engine runs
on, checked against what this machine offers), `request` (a request and its state machine), `prompt` (a
prompt normalised, tokenized and checked, once), `batching` (static and continuous batching simulated on a
clock of steps), `chunking` (a step's token budget shared between decodes and prompt chunks, on the same
clock), `scheduler` (token budget, seats, policies, chunked prefill, preemption), `model_runner` (a step's
batch laid out, one forward, sampling), `detokenizer` (text from a growing token list), `stopping` (the
stop rules), `output_processor` (text, stop rules and outputs per request), `outputs` (the output values),
`parallel` (n samples of one prompt), `engine` (the step: five calls), `stats` (what observers see),
`chat` (a conversation rendered and tokenized: the prompt of `LLM.chat` and of the server's chat
endpoint), `speculative` (speculative decoding: proposers, verification, the rejection sampler; Lab 9),
`llm` (`LLM`: offline generation in vLLM's shape).
"""
