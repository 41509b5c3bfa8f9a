"""What the engine hands back: a `RequestOutput` per request, with a `CompletionOutput` per sample.

These are plain values in vLLM's shape; `nanolab.engine.output_processor` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanolab.model.sampling import TokenLogprob


@dataclass(frozen=True)
class RequestMetrics:
    """Timing of one request, in seconds (time.monotonic clock)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        """Time to first token: from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (the inter-token latency)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    """One generated continuation: a request has one per sample (``SamplingParams.n``)."""

    index: int  # the sample's index, 0 .. n - 1
    text: str | None  # None when the engine has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout", None while running
    delta_text: str = ""  # text added since the previous streamed output
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, with SamplingParams.logprobs
    delta_logprobs: list[TokenLogprob] | None = None  # those of delta_token_ids


@dataclass
class RequestOutput:
    """What `LLM.generate` returns and `LLM.stream` yields for a request (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs: one per prompt token (None for the first), once all are known
    prompt_logprobs: list[TokenLogprob | None] | None = None
