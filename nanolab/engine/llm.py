"""`LLM`: offline generation with the reference engine, in vLLM's shape.

from nanolab import LLM, SamplingParams
llm = LLM()                                   # the bundled model
outs = llm.generate(["def fibonacci(n):", "import os"], SamplingParams(max_tokens=32, temperature=0))
print(outs[0].outputs[0].text)
reply = llm.chat([{"role": "user", "content": "Sort a list"}], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nanolab.engine.chat import as_conversations, chat_prompt
from nanolab.engine.config import EngineConfig
from nanolab.engine.engine import Engine
from nanolab.engine.outputs import RequestOutput
from nanolab.engine.prompt import Prompt
from nanolab.engine.stats import EngineStats, StepListener
from nanolab.model.sampling import SamplingParams
from nanolab.text.chat_template import ChatTemplate


class LLM:
    """A model, its tokenizer and a continuous-batching engine.

    ``model`` is None (the bundled model), a bundled model's name, a checkpoint directory that
    `nanolab.load_model` reads (nanolab or Hugging Face), or a `Transformer` already in memory.
    ``block_allocator``, ``prefix_cache`` and ``scheduler`` take a class (or instance) following
    `BlockAllocatorProtocol`, `PrefixCacheProtocol` or `SchedulerProtocol`: a learner's own component
    plugs in here. ``listeners`` are called with each step's `StepRecord`. Engine settings are given as keywords (``max_num_seqs=8``, ``block_size=4``: the
    fields of `EngineConfig`, checked by name) or as one ``config=EngineConfig(...)``. With
    ``device="cuda"`` (one of them) the model runs on that device: a `Transformer` given is moved there.
    ``chat_template`` (Jinja source or a `ChatTemplate`) replaces the checkpoint's own, for `chat`.
    ``speculator`` (a `nanolab.engine.speculative.Speculator`) replaces the one ``speculative_config``
    builds: a learner's own proposer, verification rules or rollback plug in here.
    ``shard_fn(model, tp)`` builds each rank's shard when ``tensor_parallel_size`` > 1
    (`nanolab.engine.tensor_parallel.TensorParallelRunner`): a learner's own sharding plugs in here.
    """

    def __init__(
        self,
        model: str | Path | Any = None,
        tokenizer: Any = None,
        *,
        block_allocator: Any = None,
        prefix_cache: Any = None,
        scheduler: Any = None,
        config: EngineConfig | None = None,
        listeners: Sequence[StepListener] = (),
        chat_template: str | ChatTemplate | None = None,
        speculator: Any = None,
        shard_fn: Any = None,
        **settings: Any,
    ) -> None:
        from nanolab.model.loading import load_chat_template, load_model, load_tokenizer
        from nanolab.model.transformer import Transformer

        if config is not None and settings:
            raise TypeError("give either config=EngineConfig(...) or engine settings as keywords, not both")
        config = config or EngineConfig.from_kwargs(**settings)  # checks the names before loading anything
        if isinstance(model, Transformer):
            self.model = model
        else:
            self.model = load_model(model)
            if tokenizer is None:
                tokenizer = load_tokenizer(model)
            if chat_template is None:
                chat_template = load_chat_template(model, tokenizer)
        self.tokenizer = tokenizer
        self.chat_template = self._as_template(chat_template)
        self.engine = Engine(
            self.model,
            tokenizer,
            config,
            block_allocator,
            prefix_cache,
            scheduler,
            listeners=listeners,
            speculator=speculator,
            shard_fn=shard_fn,
        )
        self.model = self.engine.model  # with tensor parallelism: rank 0's shard (the rest is in workers)

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (`Engine.close`); idempotent. ``with LLM(...)
        as llm:`` closes it at the end of the block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> LLM:
        """The `LLM` that a command's ``--model`` and engine flags describe (see `nanolab.cli`)."""
        return cls(args.model, config=EngineConfig.from_cli_args(args))

    def _add_all(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[str]:
        requests = self.engine.add_requests(prompts, sampling_params, 0 if priority is None else priority)
        return [r.request_id for r in requests]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished `RequestOutput` per prompt, in input order."""
        return self._run_to_end(self._add_all(prompts, sampling_params, priority), use_tqdm)

    def chat(
        self,
        messages: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | ChatTemplate | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Reply to a conversation, or to each of a list of conversations (vLLM's ``LLM.chat``).

        A conversation is a list of messages such as ``{"role": "user", "content": "Hello"}``. Each is
        rendered with the chat template (the checkpoint's, or ``chat_template``), tokenized and generated
        like a prompt: ``outputs[0].text`` is the assistant's reply, ``prompt`` the rendered conversation.
        Raises `ValueError` when the model has no chat template or a conversation is malformed.
        """
        template = self._as_template(chat_template) if chat_template is not None else self.chat_template
        kwargs = chat_template_kwargs or {}
        chats = [
            chat_prompt(template, self.tokenizer, c, add_generation_prompt, **kwargs)
            for c in as_conversations(messages)
        ]
        requests = self.engine.add_requests([c.token_ids for c in chats], sampling_params)
        for request, c in zip(requests, chats):
            request.prompt = c.text  # given to the engine as token ids; the output shows the text
        return self._run_to_end([r.request_id for r in requests], use_tqdm)

    def _run_to_end(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            return self.engine.run_until_finished(ids, lambda _: bar.update(1))

    def _as_template(self, template: str | ChatTemplate | None) -> ChatTemplate | None:
        if template is None or isinstance(template, ChatTemplate):
            return template
        eos = getattr(self.tokenizer, "eos_token", None)
        bos = getattr(self.tokenizer, "bos_token", None)
        special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
        return ChatTemplate(template, special)

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield incremental outputs as the engine produces them (``delta_text`` / ``delta_token_ids``)."""
        ids = set(self._add_all(prompts, sampling_params, priority))
        remaining = set(ids)
        while remaining:
            for out in self.engine.step():
                if out.request_id in ids:
                    if out.finished:
                        remaining.discard(out.request_id)
                    yield out

    def stats(self) -> EngineStats:
        """Engine counters and state: steps, generated tokens, throughput, mean batch size, KV usage, ..."""
        return self.engine.stats()
