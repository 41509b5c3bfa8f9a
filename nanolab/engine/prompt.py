"""The one way a request enters: a prompt normalised, tokenized and checked, once, whoever calls.

`LLM.generate`, the server and the command line all hand their prompts to `Engine.add_requests`,
which runs them through a `PromptProcessor`: each prompt (text or token ids) becomes token ids, and a
request that could never run (empty, a token outside the vocabulary, longer than ``max_model_len``,
more KV blocks than the pool has, over the step budget without chunked prefill) is refused with an
error that names the limit and how to change it. Every prompt of a call is checked before any is queued,
so one bad prompt leaves the engine untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from nanolab.engine.config import EngineConfig
from nanolab.memory.paging import cdiv
from nanolab.model.sampling import SamplingParams

Prompt = str | list[int]
"""A prompt: text (needs a tokenizer) or token ids."""


class PromptError(ValueError):
    """A prompt that can never run; ``index`` is its position in the call (None for a single prompt)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class SamplingParamsError(ValueError):
    """Sampling parameters this engine cannot run; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_sampling_params(sp: SamplingParams, vocab_size: int, max_num_seqs: int, scheduler: Any) -> None:
    """What `SamplingParams` cannot check alone: token ids in the vocabulary, seats for n samples and a
    scheduler that forks them. Raises `SamplingParamsError`."""
    bad = [t for t in sp.logit_bias or () if t >= vocab_size]
    if bad:
        raise SamplingParamsError(
            f"logit_bias names token id {bad[0]} but the vocabulary has {vocab_size} tokens", "logit_bias"
        )
    if sp.n > max_num_seqs:
        raise SamplingParamsError(
            f"n={sp.n} samples cannot run at once: at most max_num_seqs={max_num_seqs} "
            "sequences run together (nanolab serve --max-num-seqs, or EngineConfig(max_num_seqs=...))",
            "n",
        )
    if sp.n > 1 and not callable(getattr(scheduler, "fork", None)):
        raise SamplingParamsError(
            f"n={sp.n} needs a scheduler with a fork(parent, child) method; "
            f"{type(scheduler).__name__} has none",
            "n",
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def as_prompt_list(prompts: Any) -> list[Prompt]:
    """One prompt, or a sequence of prompts, as a list of prompts; checks the types only.

    A string or a list of ints is one prompt; a list of those is many, all of one kind (all text or
    all token lists). Empty prompts and an empty list are refused.

    Example:
        >>> as_prompt_list("def f"), as_prompt_list([1, 2]), as_prompt_list(["a", "b"])
        (['def f'], [[1, 2]], ['a', 'b'])
    """
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and all(_is_int(t) for t in prompts)
    ):
        items: list[Any] = [prompts]
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        items = list(prompts)
    else:
        raise PromptError(f"a prompt must be a string or a list of token ids, got {type(prompts).__name__}")
    if not items:
        raise PromptError("the list of prompts is empty; give at least one prompt")
    for i, p in enumerate(items):
        where = "the prompt" if len(items) == 1 else f"prompt {i}"
        if isinstance(p, str):
            if not p:
                raise PromptError(f"{where} is empty; give at least one character", i)
        elif isinstance(p, (list, tuple)) and all(_is_int(t) for t in p):
            if not p:
                raise PromptError(f"{where} is an empty list of token ids; give at least one token", i)
        else:
            raise PromptError(f"{where} must be a string or a list of token ids (integers)", i)
    if len({isinstance(p, str) for p in items}) > 1:
        raise PromptError("the prompts mix text and token ids; give all as text or all as token ids")
    return [p if isinstance(p, str) else [int(t) for t in p] for p in items]


class ProcessedPrompt(NamedTuple):
    token_ids: list[int]
    text: str | None  # the prompt's text when it was given as text


class PromptProcessor:
    """Turns prompts into token ids and refuses what the engine could never run."""

    def __init__(self, tokenizer: Any, vocab_size: int, config: EngineConfig) -> None:
        if config.max_model_len is None or config.num_blocks is None:
            raise ValueError("the prompt processor needs a resolved EngineConfig (see EngineConfig.resolve)")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config

    def process(
        self, prompts: Prompt | Sequence[Prompt], params: Sequence[SamplingParams]
    ) -> list[ProcessedPrompt]:
        """Every prompt tokenized and checked with its sampling params (one each), or a `PromptError`."""
        items = as_prompt_list(prompts)
        if len(params) != len(items):
            raise ValueError(
                f"got {len(items)} prompts but {len(params)} SamplingParams; give one or one each"
            )
        out = []
        for i, (prompt, sp) in enumerate(zip(items, params)):
            index = i if len(items) > 1 else None
            try:
                out.append(self._one(prompt, sp))
            except PromptError as exc:
                prefix = "" if index is None else f"prompt {i}: "
                raise PromptError(prefix + str(exc), index) from None
        return out

    def _one(self, prompt: Prompt, params: SamplingParams) -> ProcessedPrompt:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("this engine has no tokenizer: give the prompt as a list of token ids")
            text, ids = prompt, self.tokenizer.encode(prompt, allowed_special="all")
        else:
            text, ids = None, prompt
        self.check(ids, params)
        return ProcessedPrompt(ids, text)

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raise `PromptError`, saying which limit and how to change it, for a request that could never run."""
        cfg = self.config
        P, M, L = len(ids), params.max_tokens, cfg.max_model_len
        if P == 0:
            raise PromptError("the prompt is empty; give at least one token")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        budget = cfg.max_num_batched_tokens
        if not cfg.enable_chunked_prefill and P > budget:
            raise PromptError(
                f"the prompt has {P} tokens but, without chunked prefill, a prompt must fit in one step of "
                f"max_num_batched_tokens={budget}; raise it or enable chunked prefill"
            )
        if P + M > L:
            why = ""
            if not cfg.enable_chunked_prefill and L == budget:
                why = " (without chunked prefill a request may hold at most max_num_batched_tokens)"
            raise PromptError(
                f"the prompt has {P} tokens and max_tokens is {M}: {P + M} > max_model_len {L}{why}; "
                "shorten the prompt, lower max_tokens or raise max_model_len"
            )
        need = cdiv(P + M, cfg.block_size)
        if need > cfg.num_blocks:
            raise PromptError(
                f"the request needs up to {need} KV blocks ({P} prompt + {M} output tokens) but the pool has "
                f"only {cfg.num_blocks}; raise num_blocks or lower max_tokens"
            )


def one_each(value: Any, n: int, what: str, kind: type) -> list:
    """``value`` for each of n prompts: one for all (an instance of ``kind``), or a sequence of n."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {n} prompts but {len(values)} {what}; give one for all or one each")
    return values
