"""Shared helpers for engine tests: tiny random models and greedy comparison that knows about float ties.

Greedy decoding is a function of the logits; two correct engines can still disagree where the top two
logits are a genuine float near-tie (their order then depends on summation order, which depends on the
batch shape). `compare_greedy` accepts a divergence only at such a tie: where the reference's own gap
between its top two logits is below `TIE_GAP`, and it counts those ties so tests can report them.
"""

from __future__ import annotations

import copy
import random

import torch

from nanolab.engine.chunking import plan_prefill
from nanolab.model.config import ModelConfig
from nanolab.model.transformer import Transformer

TIE_GAP = 1e-4


def tiny_model(
    arch: str = "llama", seed: int = 0, vocab_size: int = 96, max_seq_len: int = 256
) -> Transformer:
    """A small random nanolab model; weights scaled up so logits are spread out."""
    kw = dict(n_kv_heads=2) if arch == "llama" else {}
    config = ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        n_layers=2,
        n_heads=4,
        d_model=32,
        d_ff=64,
        max_seq_len=max_seq_len,
        **kw,
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def spread_out(model: Transformer, seed: int = 0, std: float = 0.15) -> Transformer:
    """Redraw the weights larger than the training init, so logits are spread out (no near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else std * noise)
    return model.eval()


def noisy_copy(model: Transformer, noise: float = 0.3, seed: int = 0) -> Transformer:
    """``model`` with every weight moved by ``noise`` times its own scale: a draft that mostly agrees."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return draft.eval()


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """n random prompts of lo..hi tokens; with shared > 0, every other prompt starts with one shared prefix."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    prompts = []
    for i in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        body = torch.randint(0, vocab, (length,), generator=g).tolist()
        prompts.append(prefix + body if shared and i % 2 == 0 else body)
    return prompts


@torch.inference_mode()
def reference_greedy(model: Transformer, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full recompute with `Transformer.logits`, and the top-2 gap at each step."""
    ids, gaps = list(prompt), []
    for _ in range(max_tokens):
        logits = model.logits(torch.tensor([ids]))[0, -1]
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], gaps


def compare_greedy(expected: list[int], gaps: list[float], got: list[int]) -> int:
    """Assert ``got`` equals ``expected`` up to a near-tie; returns 1 if it diverged at a tie, else 0."""
    assert len(got) == len(expected), f"length {len(got)} != {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            assert gaps[i] < TIE_GAP, f"token {i}: expected {a}, got {b} (top-2 gap {gaps[i]:.2e} is no tie)"
            return 1
    return 0


def random_plans(n: int = 300):
    """Random ``plan_prefill`` inputs (prompt lengths, decodes, budget, order, chunk) and nanolab's plan."""
    rng = random.Random(7)
    for _ in range(n):
        lens = [rng.randint(1, 90) for _ in range(rng.randint(1, 6))]
        budget = rng.randint(1, 64)
        decodes = rng.randint(0, budget - 1)
        order = rng.choice(["fcfs", "round_robin"])
        chunk = rng.randint(1, 40)
        yield lens, decodes, budget, order, chunk, plan_prefill(lens, decodes, budget, order, chunk)
