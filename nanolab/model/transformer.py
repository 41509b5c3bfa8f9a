"""A small decoder-only transformer in two families: GPT-2 style and Llama style.

The model serves many requests at once without knowing it. `Transformer.forward` takes the new tokens of
any number of sequences flattened into one batch of T tokens, with each token's position in its own
sequence, and every attention layer hands its queries, keys and values to ``cache.attend(layer, q, k, v)``.
The cache (see `nanolab.model.kv_cache`) knows which token belongs to which sequence and where its keys and
values live; the model only does the per-token arithmetic (projections, RoPE, MLP, norms), which is the
same for every token. That split is what lets the engine mix prefills and decodes of different requests
in one forward.

The two families:

- ``arch="gpt2"``: learned position embeddings, LayerNorm, GELU (tanh approximation) MLP, biases on every
  linear layer, tied input/output embeddings.
- ``arch="llama"`` (also Qwen2 and Mistral checkpoints): rotary position embeddings (RoPE), RMSNorm,
  SwiGLU MLP, grouped-query attention (``n_kv_heads`` <= ``n_heads``), optional q/k/v biases (Qwen2),
  tied or untied embeddings.

Deliberately left out: dropout and training tricks, RoPE scaling variants, sliding-window attention,
and any notion of batches or padding (the cache owns the batch layout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanolab.model.attention import sdpa
from nanolab.model.config import ModelConfig
from nanolab.model.kv_cache import KVCacheProtocol
from nanolab.model.prepacked import linear  # F.linear, or where an engine activates them, its faster products
from nanolab.model.tensor_parallel import TPShard, check_shardable, head_ranges, shard_state_dict

Rope = tuple[torch.Tensor, torch.Tensor]  # cos and sin for each token, (..., 1, head_dim) each


def rope_tables(
    config: ModelConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, rotary frequency), each (max_seq_len, head_dim).

    The same arithmetic as Hugging Face's Llama: frequency i is ``theta ** (-2i / head_dim)``, and the
    table repeats the frequencies for the two halves of a head (the "rotate_half" convention), so HF
    Llama weights load without permuting q/k rows.
    """
    hs = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float, device=device) / hs))
    t = torch.arange(config.max_seq_len, dtype=torch.float, device=device)
    freqs = t[:, None] * inv_freq[None, :]  # (max_seq_len, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_seq_len, hs)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x by its token's angles: x (..., n_heads, hs), cos/sin (..., 1, hs)."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., nh, hs/2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half(x)
    return x * cos + rotated * sin


def attention_forward(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    out_weight: torch.Tensor,
    out_bias: torch.Tensor | None,
    n_heads: int,
    n_kv_heads: int,
    rope: Rope | None,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    tp: TPShard,
) -> torch.Tensor:
    """One attention layer's output on one rank of ``tp`` (one rank of one: the whole layer).

    x (..., d_model) is the whole input, the same on every rank. The rank holds ``n_heads`` query heads and
    ``n_kv_heads`` KV heads: ``qkv_weight`` ((n_heads + 2 * n_kv_heads) * head_dim, d_model) is its rows of
    the fused projection, [its q heads | its k heads | its v heads], with ``qkv_bias`` to match (or None);
    ``out_weight`` (d_model, n_heads * head_dim) is its columns of the output projection (row-parallel),
    ``out_bias`` the whole layer's bias (or None). ``rope`` is the tokens' (cos, sin) or None;
    ``attend(q, k, v)`` runs attention over the cache ((..., n_heads, hd) queries, (..., n_kv_heads, hd)
    keys and values -> (..., n_heads, hd)). The output projection's partial products are summed over the
    ranks with ``tp.all_reduce`` and the bias added once after the sum: the result (..., d_model) is the
    same on every rank.
    """
    lead = x.shape[:-1]
    head_dim = qkv_weight.shape[0] // (n_heads + 2 * n_kv_heads)
    heads = linear(x, qkv_weight, qkv_bias).view(*lead, -1, head_dim)  # (..., nh + 2*nkv, hs)
    qk, v = heads.split((n_heads + n_kv_heads, n_kv_heads), dim=-2)
    if rope is not None:
        qk = apply_rope(qk, *rope)  # q and k heads rotate alike: one call for both
    q, k = qk.split((n_heads, n_kv_heads), dim=-2)  # (..., nh, hs), (..., nkv, hs)
    y = attend(q, k, v).reshape(*lead, n_heads * head_dim)
    return row_parallel_linear(y, out_weight, out_bias, tp)


def mlp_forward(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    act: str,
    tp: TPShard,
) -> torch.Tensor:
    """One MLP's output on one rank of ``tp`` (one rank of one: the whole MLP).

    x (..., d_model) is the whole input. ``act`` is "gelu" (GPT-2: ``up_weight`` (f, d_model) is the rank's
    rows of the up-projection, then GELU, tanh approximation) or "swiglu" (Llama: ``up_weight`` (2f,
    d_model) is the rank's rows of the fused [gate | up] projection, its gate rows then its up rows; then
    silu(gate) * up). ``down_weight`` (d_model, f) is the rank's columns of the down-projection, ``down_bias``
    the whole layer's bias (or None). The partial products are summed over the ranks with
    ``tp.all_reduce`` and the bias added once after the sum.
    """
    if act == "gelu":
        h = linear(x, up_weight, up_bias, gelu=True)  # F.gelu(F.linear(...), approximate="tanh")
    elif act == "swiglu":
        gate, up = linear(x, up_weight, up_bias).chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        raise ValueError(f"act must be 'gelu' or 'swiglu', got {act!r}")
    return row_parallel_linear(h, down_weight, down_bias, tp)


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPShard
) -> torch.Tensor:
    """A row-parallel layer: this rank's slice of the input times its columns of the weight, summed over
    the ranks, plus the (whole) bias once."""
    if tp.size == 1:
        return linear(x, weight, bias)
    y = tp.all_reduce(linear(x, weight))
    return y if bias is None else y + bias


class Attention(nn.Module):
    """Self-attention with one fused q/k/v projection; the attention itself is the cache's job.

    Split over ranks (``tp``), it holds its rank's heads: the q/k/v projection is column-parallel, the
    output projection row-parallel, and its output is summed over the ranks (`nanolab.model.tensor_parallel`).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPShard | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp or TPShard()
        heads, kv = head_ranges(config.n_heads, config.n_kv_heads, self.tp.rank, self.tp.size)
        self.n_heads, self.n_kv_heads, self.head_dim = len(heads), len(kv), config.head_dim
        gpt2 = config.arch == "gpt2"
        width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim  # [q heads | k heads | v heads]
        self.qkv = nn.Linear(config.d_model, width, bias=gpt2 or config.qkv_bias)
        self.out = nn.Linear(self.n_heads * self.head_dim, config.d_model, bias=gpt2)  # bias: the whole one's

    # the function the layer runs (the same arguments as `attention_forward`); a lab swaps in its own
    forward_fn = staticmethod(attention_forward)

    def forward(self, x: torch.Tensor, rope: Rope | None, cache: KVCacheProtocol) -> torch.Tensor:
        # x: (T, D) in the serving forward, (B, S, D) in Transformer.logits; "..." below is T or (B, S)
        return self.forward_fn(
            x,
            self.qkv.weight,
            self.qkv.bias,
            self.out.weight,
            self.out.bias,
            self.n_heads,
            self.n_kv_heads,
            rope,
            functools.partial(cache.attend, self.layer_idx),
            self.tp,
        )


class GeluMLP(nn.Module):
    """GPT-2's MLP: up-projection, GELU (tanh approximation), down-projection. Split over ranks (``tp``):
    the up-projection column-parallel, the down-projection row-parallel, the output summed over ranks."""

    def __init__(self, config: ModelConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        self.tp = tp or TPShard()
        d_ff = config.d_ff // self.tp.size
        self.fc = nn.Linear(config.d_model, d_ff)
        self.proj = nn.Linear(d_ff, config.d_model)

    forward_fn = staticmethod(mlp_forward)  # the same arguments as `mlp_forward`; a lab swaps in its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fn(
            x, self.fc.weight, self.fc.bias, self.proj.weight, self.proj.bias, "gelu", self.tp
        )


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul. Split over ranks
    (``tp``): gate/up column-parallel (each rank its share of both), down row-parallel, summed over ranks."""

    def __init__(self, config: ModelConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        self.tp = tp or TPShard()
        d_ff = config.d_ff // self.tp.size
        self.gate_up = nn.Linear(config.d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, config.d_model, bias=False)

    forward_fn = staticmethod(mlp_forward)  # the same arguments as `mlp_forward`; a lab swaps in its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fn(x, self.gate_up.weight, None, self.down.weight, None, "swiglu", self.tp)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.arch == "gpt2":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps)
    return nn.RMSNorm(config.d_model, eps=config.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPShard | None = None) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config, layer_idx, tp)
        self.mlp_norm = make_norm(config)
        self.mlp = GeluMLP(config, tp) if config.arch == "gpt2" else SwiGLU(config, tp)

    def forward(self, x: torch.Tensor, rope: Rope | None, cache: KVCacheProtocol) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache)
        return x + self.mlp(self.mlp_norm(x))


class _CausalNoCache:
    """The "cache" behind `Transformer.logits`: plain causal attention over (B, S) batches with no padding."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, causal=True)  # q: (B, S, nh, hs), k and v: (B, S, nkv, hs)


class Transformer(nn.Module):
    """Decoder-only transformer. See the module docstring for the serving contract.

    ``tp`` (`nanolab.model.tensor_parallel.TPShard`) makes it one rank's shard of a tensor-parallel model:
    its attention and MLP layers hold that rank's part and sum their outputs over the ranks; the
    embeddings, norms and LM head are whole. ``config`` stays the whole model's.
    """

    def __init__(self, config: ModelConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPShard()
        check_shardable(config, self.tp.size)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.arch == "gpt2" else None
        self.layers = nn.ModuleList(Block(config, i, self.tp) for i in range(config.n_layers))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        if config.arch == "llama":  # derived from the config, so not saved with the weights
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hs)
            self.register_buffer("rope_sin", sin, persistent=False)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2's initialisation (as in nanoGPT): N(0, 0.02) weights, zero biases, and the projections
        # that write into the residual stream scaled down by sqrt(2 * n_layers) so it does not grow
        # with depth. Norms keep PyTorch's ones/zeros.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        residual_out = {Attention: "out", GeluMLP: "proj", SwiGLU: "down"}.get(type(module))
        if residual_out is not None:  # runs after the module's own Linear children (apply is bottom-up)
            weight = getattr(module, residual_out).weight
            nn.init.normal_(weight, mean=0.0, std=0.02 / (2 * self.config.n_layers) ** 0.5)

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope | None]:
        """Token embeddings (..., D), plus learned positions (gpt2) or the tokens' RoPE angles (llama)."""
        x = self.tok_emb(input_ids)  # (..., D)
        if self.pos_emb is not None:
            return x + self.pos_emb(positions), None
        # Tables stay float32 (as HF computes them); cast to the weights' dtype (a no-op in float32).
        cos = self.rope_cos[positions].unsqueeze(-2).to(x.dtype)  # (..., 1, hs): broadcasts over heads
        sin = self.rope_sin[positions].unsqueeze(-2).to(x.dtype)
        return x, (cos, sin)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCacheProtocol
    ) -> torch.Tensor:
        """Hidden states (T, d_model) of T new tokens, final norm applied.

        input_ids and positions are (T,) int64: the new tokens of one or many sequences, flattened, and
        each token's position in its own sequence (< max_seq_len). The cache must be set up by its owner
        for exactly these T tokens; each layer stores their keys/values there and reads the context back.
        Use `compute_logits` on the rows you want to sample from.
        """
        x, rope = self._embed(input_ids, positions)  # (T, D)
        for layer in self.layers:
            x = layer(x, rope, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d_model) hidden states from `forward` -> (N, vocab_size) logits: ``self.lm_head(hidden)``, or
        inside an engine's step with `prepack_weights`, its faster products (`nanolab.model.prepacked`)."""
        return linear(hidden, self.lm_head.weight, self.lm_head.bias)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain forward with no KV cache: (B, S) token ids -> (B, S, vocab_size) logits.

        Every row starts at position 0 and is attended causally; no padding. For labs, tests and training.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, S), got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if S > self.config.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len {self.config.max_seq_len}")
        positions = torch.arange(S, device=input_ids.device).expand(B, S)
        x, rope = self._embed(input_ids, positions)  # (B, S, D)
        for layer in self.layers:
            x = layer(x, rope, _CausalNoCache())
        return self.lm_head(self.norm(x))  # (B, S, V)

    def shard(self, tp: TPShard) -> Transformer:
        """Rank ``tp.rank``'s shard of this (whole) model, in new tensors: what that rank of a
        tensor-parallel engine runs."""
        if self.tp.size != 1:
            raise ValueError("this model is already a shard; shard the whole model")
        state = shard_state_dict(self.config, self.state_dict(), tp.rank, tp.size)
        if self.config.tie_embeddings:
            state.pop("lm_head.weight", None)
        return Transformer.from_state_dict(self.config, state, "the model", tp)

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        source: str = "the state dict",
        tp: TPShard | None = None,
    ) -> Transformer:
        """A model holding exactly these tensors (they are used as they are, not copied).

        ``lm_head.weight`` may be left out when the embeddings are tied. Missing, unexpected or
        mis-shaped tensors raise `ValueError` naming the key and ``source``. With ``tp``, the tensors are
        that rank's shard (`nanolab.model.tensor_parallel.shard_state_dict`).
        """
        # Random init first, then replaced: cheap at nanolab's sizes. (Building on the "meta" device
        # would skip it, but its first use imports torch's compiler stack, which takes seconds.)
        model = cls(config, tp)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        state_dict = dict(state_dict)
        if config.tie_embeddings:
            state_dict.pop("lm_head.weight", None)
            expected.pop("lm_head.weight")
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{source} does not match the config: missing tensors {missing}, unexpected tensors "
                f"{unexpected}. Is the config.json next to the weights the one they were saved with?"
            )
        for key, shape in expected.items():
            if tuple(state_dict[key].shape) != shape:
                raise ValueError(
                    f"tensor {key!r} in {source} has shape {tuple(state_dict[key].shape)} but the config "
                    f"implies {shape}"
                )
        if config.tie_embeddings:
            state_dict["lm_head.weight"] = state_dict["tok_emb.weight"]
        model.load_state_dict(state_dict, strict=True, assign=True)
        if config.tie_embeddings:
            model.lm_head.weight = model.tok_emb.weight
        return model.eval()
