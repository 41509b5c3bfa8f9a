"""The engine: a model, its tokenizer and the parts of `EngineCore`, assembled from one config.

`Engine` builds the block allocator, the prefix cache, the block manager, the paged KV cache, the
scheduler and the model runner from an `EngineConfig` (each swappable, behind a small protocol:
`BlockAllocatorProtocol`, `PrefixCacheProtocol`, `SchedulerProtocol`, and the attention backend of the
paged cache), and turns prompts into requests: `add_requests` tokenizes and checks every prompt and its
sampling parameters before any is queued (see `nanolab.engine.prompt`). The loop, aborts and
`stats` are `nanolab.engine.core.EngineCore`'s. The model (moved there in place), the KV pool and every
step's tensors live on ``config.device``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from nanolab.engine.config import EngineConfig
from nanolab.engine.core import EngineCore
from nanolab.engine.model_runner import ModelRunner
from nanolab.engine.prompt import Prompt, PromptProcessor, as_prompt_list, check_sampling_params, one_each
from nanolab.engine.request import Request
from nanolab.engine.scheduler import Scheduler, SchedulerProtocol
from nanolab.engine.speculative import DraftModelProposer, NgramProposer, Speculator
from nanolab.engine.stats import StepListener
from nanolab.engine.tensor_parallel import TensorParallelRunner
from nanolab.memory.block_allocator import BlockAllocator, BlockAllocatorProtocol
from nanolab.memory.block_manager import BlockManager
from nanolab.memory.paged_kv_cache import PagedKVCache
from nanolab.memory.prefix_cache import PrefixCacheProtocol
from nanolab.memory.radix_cache import RadixCache
from nanolab.model.sampling import SamplingParams
from nanolab.model.transformer import Transformer


class Engine(EngineCore):
    """Continuous-batching engine over one model. Use `nanolab.LLM` for the friendly API."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        block_allocator: type | BlockAllocatorProtocol | None = None,
        prefix_cache: type | PrefixCacheProtocol | None = None,
        scheduler: type | SchedulerProtocol | None = None,
        listeners: Sequence[StepListener] = (),
        speculator: Speculator | None = None,
        shard_fn: Any = None,
    ) -> None:
        cfg = (config or EngineConfig()).resolve(model.config)
        self.config = cfg
        device = torch.device(cfg.device)
        self.model = model.eval().to(device)
        self.tokenizer = tokenizer

        allocator = _build(block_allocator, BlockAllocator, cfg.num_blocks)
        if allocator.num_total != cfg.num_blocks:
            raise ValueError(
                f"the block allocator has {allocator.num_total} blocks, expected {cfg.num_blocks}"
            )
        cache = None
        if cfg.enable_prefix_caching:
            cache = _build(prefix_cache, RadixCache, allocator, cfg.block_size)
        block_manager = BlockManager(allocator, cfg.block_size, cache)
        backend = cfg.attention_backend.value
        if cfg.tensor_parallel_size > 1:  # this process is rank 0 and keeps its shard of the model only
            runner: ModelRunner = TensorParallelRunner(
                model, cfg.tensor_parallel_size, cfg.num_blocks, cfg.block_size, backend, shard_fn=shard_fn
            )
            self.model = runner.model
        else:
            kv_cache = PagedKVCache(
                model.config, cfg.num_blocks, cfg.block_size, attention_backend=backend, device=device
            )
            runner = ModelRunner(self.model, kv_cache, prepack_weights=cfg.prepack_weights)
        super().__init__(
            _build(scheduler, Scheduler, cfg, block_manager),
            block_manager,
            runner,
            tokenizer,
            cfg.max_model_len,
            listeners,
            speculator if speculator is not None else _speculator(cfg, model),
        )
        self._ids = itertools.count()
        self.prompts = PromptProcessor(tokenizer, model.config.vocab_size, cfg)

    def close(self) -> None:
        """Stop what the engine runs beside this process (tensor-parallel workers); idempotent. The
        engine can run no further step after it."""
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def kv_cache(self) -> PagedKVCache:
        """The paged KV cache the model runs on (the model runner's); setting it swaps the runner's cache."""
        return self.runner.kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: PagedKVCache) -> None:
        self.runner.kv_cache = cache

    # -- requests -----------------------------------------------------------------------------------

    def add_requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | Sequence[int] = 0,
        request_ids: Sequence[str] | None = None,
    ) -> list[Request]:
        """Queue one request per prompt, all or none.

        ``prompts``: one prompt (text or token ids) or a list of them. ``sampling_params`` and
        ``priority``: one for all, or one each. Every prompt is tokenized and checked before any is
        queued: a `nanolab.engine.prompt.PromptError` (a `ValueError`) names the first that could never
        run, and the engine is left untouched.
        """
        items = as_prompt_list(prompts)
        n = len(items)
        params = one_each(sampling_params or SamplingParams(), n, "SamplingParams", SamplingParams)
        priorities = one_each(priority, n, "priorities", int)
        if request_ids is None:
            request_ids = [str(next(self._ids)) for _ in range(n)]
        elif len(request_ids) != n:
            raise ValueError(f"got {n} prompts but {len(request_ids)} request ids")
        taken = [rid for rid in request_ids if rid in self.requests]
        if taken or len(set(request_ids)) != n:
            raise ValueError(f"request id {(taken or request_ids)[0]!r} is already in use")
        for sp in params:
            check_sampling_params(sp, self.model.config.vocab_size, self.config.max_num_seqs, self.scheduler)
        processed = self.prompts.process(items, params)
        requests = []
        for (ids, text), sp, prio, rid in zip(processed, params, priorities, request_ids):
            req = Request(rid, ids, sp, prompt=text, priority=prio)
            self.add(req)
            requests.append(req)
        return requests

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Queue one request (see `add_requests`)."""
        ids = None if request_id is None else [request_id]
        return self.add_requests([prompt], sampling_params, priority, ids)[0]


def _speculator(cfg: EngineConfig, model: Transformer) -> Speculator | None:
    """The engine's speculation, as ``cfg.speculative_config`` says (None: none)."""
    spec = cfg.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return Speculator(spec, NgramProposer(spec))
    from nanolab.model.loading import load_model

    draft = spec.model if isinstance(spec.model, Transformer) else load_model(spec.model)
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens but the "
            f"model has {model.config.vocab_size}: a draft model must share its target's tokenizer"
        )
    proposer = DraftModelProposer(
        spec, draft, cfg.num_blocks, cfg.block_size, cfg.attention_backend.value, device=cfg.device
    )
    return Speculator(spec, proposer)


def _build(given: Any, default: type, *args: Any) -> Any:
    """An instance from ``given`` (None: the default class; a class or factory: called with args)."""
    if given is None:
        return default(*args)
    if isinstance(given, type) or (callable(given) and not hasattr(given, "allocate")):
        return given(*args)
    return given
