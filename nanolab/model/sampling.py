"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus) and min-p, after
logit bias and repetition, frequency and presence penalties; and the log-probabilities of the choice.

`SamplingParams` carries one request's settings, with vLLM's field names. `sample` picks one token per row
of a batch of logits, each row with its own parameters and its own random generator: a request's sampled
tokens depend only on its logits, its parameters, its own tokens and its seed, never on what else is in
the batch.

The order is vLLM's: `adjust_logits` adds the logit bias, then applies the repetition penalty (to every
token seen in the prompt or the output), then the frequency and presence penalties (to tokens of the
output); greedy takes the argmax of the result, and sampling filters it in Hugging Face's order —
temperature, then top-k, then top-p, then min-p — keeping the same tokens as HF's logits warpers
(`filter_logits` exposes the result for tests and plots). `token_logprobs` reports log-probabilities of
the model's own distribution (before bias, penalties and filters), as vLLM does by default.

Deliberately left out: beam search, ``best_of``, bad words, allowed token lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """An int or a float, not a bool (True is an int to Python, but not a temperature), that a float can hold
    (an int of 400 digits is not: the sampler would fail on it in the middle of a step)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


@dataclass(frozen=True)
class SamplingParams:
    """How to pick one request's output tokens (vLLM's names and defaults).

    ``temperature == 0`` means greedy (always the most likely token). ``stop`` accepts one string or a list.
    Every field is checked on construction; a bad value raises `ValueError` naming it and the allowed range.
    """

    max_tokens: int = 16  # most tokens to generate (>= 1)
    temperature: float = 1.0  # logits are divided by it; 0 = greedy
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p; 1 = off
    top_k: int | None = None  # keep the k most likely tokens; None = off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0 = off
    seed: int | None = None  # seeds this request's own generator; None = torch's global generator
    stop: list[str] | None = None  # stop when the output text contains one of these (excluded from the text)
    stop_token_ids: list[int] | None = None  # stop after generating one of these token ids
    ignore_eos: bool = False  # keep going past the end-of-sequence token
    n: int = 1  # samples of the same prompt (the prompt is computed once; sample i is seeded seed + i)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence of the token in the output
    repetition_penalty: float = (
        1.0  # a seen token's logit is divided by it (> 0) or multiplied (< 0); 1 = off
    )
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else
    logprobs: int | None = None  # report each output token's log-probability and this many top ones
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None:
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            object.__setattr__(self, "stop", list(stop))
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
            object.__setattr__(self, "stop_token_ids", list(ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1 (samples per prompt), got {self.n!r}")
        # torch seeds a generator with a 64-bit value; sample i of n is seeded seed + i
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)
        ):
            raise ValueError(
                f"seed must be an integer in [-2**63, 2**64 - n] (sample i is seeded seed + i) or None, got {self.seed!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
            for k, v in bias.items():
                if not _is_int(k) or k < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
                if not _is_number(v) or not -100 <= v <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for {k}")
            object.__setattr__(self, "logit_bias", {k: float(v) for k, v in bias.items()} or None)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= 20):
                raise ValueError(
                    f"{name} must be None (off) or an integer in [0, 20] (how many top tokens to report "
                    f"besides the chosen one), got {value!r}"
                )

    @property
    def adjusts_logits(self) -> bool:
        """True when logit bias or a penalty changes the logits before the choice."""
        penalized = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
        return bool(self.logit_bias or penalized)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded with ``seed``, or None (use torch's global generator) when seed is None.

    On the CPU whatever device the model runs on: `sample` draws its random numbers there, so a seed
    gives the same tokens on every device.
    """
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(seed)


class TokenLogprob(NamedTuple):
    """One output token's log-probability under the model, and the ``logprobs`` most likely tokens'."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
) -> torch.Tensor:
    """(B, V) logits with each row's logit bias and penalties applied (the same tensor if none has any).

    ``histories[b]`` is row b's (prompt token ids, output token ids): the repetition penalty acts on the
    tokens of both, the frequency and presence penalties on the output's. Rows are changed one by one from
    their own tokens and parameters, so a row's result does not depend on the others.
    """
    rows = [b for b, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    if histories is None or len(histories) != len(params):
        raise ValueError("penalties need each row's (prompt token ids, output token ids) in histories")
    out = logits.float().clone()
    device, V = out.device, out.shape[1]
    for b in rows:
        p, row = params[b], out[b]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
            if int(ids.max()) >= V:
                raise ValueError(f"logit_bias names token id {int(ids.max())} but the vocabulary has {V}")
            row[ids] += torch.tensor(list(p.logit_bias.values()), device=device)
        prompt, output = histories[b]
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=device)
            x = row[seen]
            row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and output:
            ids, counts = torch.tensor(list(output), dtype=torch.long, device=device).unique(
                return_counts=True
            )
            row[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability under softmax(logits), and its ``num_top[b]`` best."""
    logp = logits.float().log_softmax(dim=-1)
    rows = torch.arange(len(token_ids), device=logp.device)
    chosen = logp[rows, torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)].tolist()
    k = max(num_top, default=0)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprob(int(t), lp, tuple(zip(top_ids[b][: num_top[b]], top_lp[b][: num_top[b]])))
        for b, (t, lp) in enumerate(zip(token_ids, chosen))
    ]


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(B, V) logits -> (B, V) logits to sample from: temperature applied, filtered tokens at -inf.

    Row b follows ``params[b]``; softmax of a row is the distribution `sample` draws from. A greedy row
    keeps only its argmax. Every row keeps at least its most likely token.
    """
    if logits.ndim != 2 or logits.shape[0] != len(params):
        raise ValueError(
            f"expected logits (B, V) with B = len(params) = {len(params)}, got {tuple(logits.shape)}"
        )
    B, V = logits.shape
    device = logits.device
    logits = logits.float()
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)  # greedy rows: 1
    out = logits / temperature[:, None]  # (B, V)
    remove: torch.Tensor | None = None  # (B, V) bool: True = filtered out (None: nothing filtered yet)

    ranked = [p.top_k is not None or p.top_p < 1 for p in params]
    if any(ranked):
        # top-k and top-p act on ranks: rank the candidates once (only the top max(k) when every ranked
        # row has a k, much cheaper than sorting the whole vocabulary), decide in rank order, and
        # scatter the decision back to token order.
        ks = [p.top_k for p, r in zip(params, ranked) if r]
        window = V if None in ks else min(V, max(ks))
        sorted_logits, order = out.topk(window, dim=-1)  # (B, window), descending
        rank = torch.arange(window, device=device)[None, :]
        top_k = torch.tensor([V if p.top_k is None else p.top_k for p in params], device=device)
        sorted_remove = rank >= top_k[:, None]
        probs = sorted_logits.masked_fill(sorted_remove, -math.inf).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
        top_p = torch.tensor([p.top_p for p in params], device=device)
        sorted_remove |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
        sorted_remove[:, 0] = False  # the most likely token always stays
        remove = torch.ones(B, V, dtype=torch.bool, device=device).scatter_(1, order, sorted_remove)
        if not all(ranked):  # rows without top-k/top-p keep everything (so far)
            remove &= torch.tensor(ranked, device=device)[:, None]

    if any(p.min_p > 0 for p in params):
        probs = (out if remove is None else out.masked_fill(remove, -math.inf)).softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        unlikely = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        remove = unlikely if remove is None else remove | unlikely

    greedy = [p.greedy for p in params]
    if any(greedy):  # keep only the argmax (the first one on ties, like torch.argmax)
        rows = torch.tensor(greedy, device=device)[:, None]
        only_argmax = torch.ones(B, V, dtype=torch.bool, device=device)
        only_argmax.scatter_(1, logits.argmax(dim=-1, keepdim=True), False)
        remove = only_argmax & rows if remove is None else torch.where(rows, only_argmax, remove)
    return out if remove is None else out.masked_fill(remove, -math.inf)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of (B, V) logits, first index on ties (like `torch.argmax`).

    On the CPU this goes through NumPy, whose vectorised argmax is over 10x faster than torch's for a
    batch of vocabulary-sized rows: at batch 64 it is the difference between sampling being a visible
    share of a decode step or not.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.as_tensor(logits.numpy().argmax(axis=-1), device="cpu")
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token id per row of (B, V) logits -> (B,) int64.

    Logit bias and penalties are not applied here: give the logits `adjust_logits` returns. Greedy rows take the exact argmax. Other rows draw from softmax(`filter_logits`) with the Gumbel-max
    trick: the winner is argmax(logits_i + G_i) with G_i = -log(-log U_i), U_i uniform, which picks i
    with probability softmax(logits)_i. Row b's U comes from ``generators[b]`` (torch's global generator
    when None), so seeded output does not depend on what else is in the batch. U is drawn on the CPU
    (where `make_generator`'s generators live) and moved to the logits' device, so a seed gives the same
    tokens on every device.
    """
    if len(generators) != len(params):
        raise ValueError(f"got {len(params)} SamplingParams but {len(generators)} generators")
    result = argmax(logits)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return result
    sampled = logits if len(rows) == len(params) else logits[rows]
    filtered = filter_logits(sampled, [params[b] for b in rows])  # (R, V)
    gumbel = torch.empty(filtered.shape, dtype=torch.float32, device="cpu")
    for i, b in enumerate(rows):
        gumbel[i].uniform_(generator=generators[b])
    gumbel.log_().neg_().log_().neg_()  # -log(-log U); U = 0 gives -inf: that token cannot win, no nan
    result[rows] = filtered.add_(gumbel.to(filtered.device)).argmax(dim=-1)
    return result
