"""The shape of a model: `ModelConfig`, saved as a nanolab checkpoint's ``config.json``.

Frozen, validated on construction, with the derived sizes (``head_dim``, ``q_size``, ``kv_size``) as
properties, so every layer that needs a size reads it from here instead of recomputing it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ARCHS = ("gpt2", "llama")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a `Transformer`. Saved as the nanolab checkpoint's ``config.json``."""

    arch: str = "llama"  # "gpt2" or "llama": which family of layers (see the module docstring)
    vocab_size: int = 512  # number of token ids: rows of the embedding and of the output layer
    n_layers: int = 4  # number of transformer blocks
    n_heads: int = 4  # query heads per attention layer
    n_kv_heads: int = 4  # key/value heads (grouped-query attention); must divide n_heads; gpt2: == n_heads
    d_model: int = 128  # width of the residual stream; n_heads * head_dim
    d_ff: int = 512  # hidden width of the MLP (for SwiGLU: of each of the gate and up projections)
    max_seq_len: int = 512  # longest sequence (prompt + output) the model accepts; sizes position tables
    norm_eps: float = 1e-5  # epsilon inside LayerNorm / RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency (llama only; gpt2 learns its position embeddings)
    tie_embeddings: bool = True  # output layer reuses the token embedding matrix (gpt2: always)
    qkv_bias: bool = False  # biases on the q/k/v projections, as in Qwen2 (llama only; gpt2 has all biases)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for name in ("vocab_size", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.arch == "gpt2":
            if self.n_kv_heads != self.n_heads:
                raise ValueError(
                    f"gpt2 has no grouped-query attention: n_kv_heads ({self.n_kv_heads}) != n_heads"
                )
            if not self.tie_embeddings or self.qkv_bias:
                raise ValueError("gpt2 always ties its embeddings and has all biases: use the defaults")
        else:
            if self.head_dim % 2:
                raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
            if self.rope_theta <= 0:
                raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def q_size(self) -> int:
        """Width of all query heads together."""
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or all value) heads together."""
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`. Unknown keys are an error (they usually mean a newer or foreign format)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known keys are {sorted(known)}")
        return cls(**d)
