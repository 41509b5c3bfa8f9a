"""Tiny random Hugging Face models built offline from a config, for differential tests against nanolab.

`tiny_hf_model(kind)` returns an fp32 transformers model in eval mode; `save_tiny_hf_model(kind, path)`
also writes it with ``save_pretrained``. Weights are drawn with a fixed seed and a larger init scale than
HF's default, so logits are spread out (no near-ties to make greedy decoding fragile).
"""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 96
KINDS = ("gpt2", "llama", "llama_tied", "qwen2")  # qwen2: q/k/v biases, untied embeddings


def _config(kind: str, **overrides):
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "gpt2":
        kw = dict(n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.1)
        kw.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2Config(**{**common, **kw, **overrides})
    llama_like = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: two query heads per kv head
        max_position_embeddings=64,
        rope_theta=1000.0,
        initializer_range=0.1,
    )
    if kind in ("llama", "llama_tied"):
        return transformers.LlamaConfig(
            **{**common, **llama_like, "tie_word_embeddings": kind == "llama_tied", **overrides}
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**{**common, **llama_like, "tie_word_embeddings": False, **overrides})
    if kind == "mistral":
        return transformers.MistralConfig(**{**common, **llama_like, "sliding_window": 32, **overrides})
    raise ValueError(f"unknown kind {kind!r}")


_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "llama_tied": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def tiny_hf_model(kind: str, attn_implementation: str = "eager", seed: int = 0, **overrides):
    """A small random fp32 HF causal LM of the given kind (see KINDS, plus "mistral")."""
    config = _config(kind, attn_implementation=attn_implementation, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[kind])(config).float().eval()
    with torch.no_grad():  # RMSNorm/LayerNorm weights start at exactly 1 (biases at 0): perturb them too
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tiny_hf_model(kind: str, path: Path, **kwargs):
    """`tiny_hf_model` written to ``path`` with save_pretrained; returns the HF model."""
    model = tiny_hf_model(kind, **kwargs)
    model.save_pretrained(path)
    return model


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` tokens of ``hf.generate``'s greedy continuation of ``prompt``, and the gap between the top two
    logits at each of them (for `helpers.engine_utils.compare_greedy`'s near-tie rule)."""
    with torch.no_grad():
        res = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    top2 = [s[0].topk(2).values for s in res.scores]
    return res.sequences[0, len(prompt) :].tolist(), [float(t[0] - t[1]) for t in top2]
