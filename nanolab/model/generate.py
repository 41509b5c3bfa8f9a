"""Generating text for one request: the loop every serving engine grows out of.

1. Prefill: run the whole prompt through the model once, filling the KV cache, and sample the first
   new token from the logits of the prompt's last position.
2. Decode: feed that one token back in (its keys/values join the cache), sample the next, repeat until a
   stop condition: the end-of-sequence token (unless ``ignore_eos``), one of ``stop_token_ids``, one of
   the ``stop`` strings, ``max_tokens``, or the model's (or cache's) maximum length.

The engine does the same for many requests at once; this module is the single-request reference.
Deliberately left out: batching, streaming, prefix reuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from tqdm.auto import tqdm

from nanolab.model.kv_cache import ContiguousKVCache
from nanolab.model.sampling import SamplingParams, make_generator, sample

if TYPE_CHECKING:
    from nanolab.model.transformer import Transformer
    from nanolab.text.tokenizer import Tokenizer


class GenerateOutput(NamedTuple):
    text: str | None  # the generated text (stop token/string excluded); None without a tokenizer
    token_ids: list[int]  # the generated token ids, including a final eos / stop token id
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length" (max_tokens or max_seq_len)


@torch.inference_mode()
def generate(
    model: Transformer,
    tokenizer: Tokenizer | None,
    prompt: str | list[int],
    max_new_tokens: int | None = None,
    sampling: SamplingParams | None = None,
    *,
    progress: bool = False,
) -> GenerateOutput:
    """Continue ``prompt`` (text, which needs a tokenizer, or token ids) with the model.

    ``sampling`` defaults to greedy decoding; ``max_new_tokens``, when given, overrides its ``max_tokens``.
    The end-of-sequence token is ``tokenizer.eos_token_id`` (none without a tokenizer). Raises
    `ValueError` for an empty prompt or one that leaves no room below ``model.config.max_seq_len``.
    """
    params = sampling if sampling is not None else SamplingParams(temperature=0.0)
    max_tokens = params.max_tokens if max_new_tokens is None else max_new_tokens
    if max_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_tokens}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass one, or pass the prompt as token ids")
        prompt_ids = tokenizer.encode(prompt)
    else:
        prompt_ids = [int(t) for t in prompt]
    limit = model.config.max_seq_len
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt_ids) >= limit:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens but max_seq_len is {limit}; shorten it to at most {limit - 1}"
        )
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab}) (the model's vocab), got {bad[:5]}")

    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to see the text; pass one, or use stop_token_ids")
    eos = getattr(tokenizer, "eos_token_id", None)
    stop_ids = set(params.stop_token_ids or [])
    if eos is not None and not params.ignore_eos:
        stop_ids.add(eos)
        stop_ids.update(getattr(tokenizer, "eos_token_ids", ()))  # a Hugging Face checkpoint may name several
    budget = min(max_tokens, limit - len(prompt_ids))
    weight = model.tok_emb.weight
    device = weight.device
    cache = ContiguousKVCache(model.config, len(prompt_ids) + budget, dtype=weight.dtype, device=device)
    generator = make_generator(params.seed)

    new_ids = torch.tensor(prompt_ids, device=device)  # prefill: the whole prompt in one forward
    output: list[int] = []
    finish_reason, stop_at = "length", None  # stop_at: where a stop string starts in the output text
    for _ in tqdm(range(budget), desc="generate", disable=not progress):
        positions = cache.prepare(len(new_ids))
        hidden = model(new_ids, positions, cache)  # (T, D)
        logits = model.compute_logits(hidden[-1:])  # (1, V): only the last position predicts what's next
        token = int(sample(logits, [params], [generator])[0])
        output.append(token)
        if token in stop_ids:
            finish_reason = "stop"
            break
        if params.stop:
            stop_at = _find_stop(tokenizer.decode(output), params.stop)
            if stop_at is not None:
                finish_reason = "stop"
                break
        new_ids = torch.tensor([token], device=device)  # decode: one token per forward

    text = None
    if tokenizer is not None:
        ended_on_stop_id = finish_reason == "stop" and stop_at is None
        text = tokenizer.decode(output[:-1] if ended_on_stop_id else output)[:stop_at]
    return GenerateOutput(text=text, token_ids=output, finish_reason=finish_reason)


def _find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return min(hits) if hits else None
