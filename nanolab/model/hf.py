"""Hugging Face checkpoints: reading them into nanolab's layout, and `to_hf` for the way back.

`nanolab.model.loading.load_model` calls in here for a directory written by ``save_pretrained``:
GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM. The tensors are renamed to
ours, GPT-2's Conv1D weights (stored (in, out)) are transposed, and q/k/v and gate/up are concatenated
into nanolab's fused projections. `to_hf` builds the equivalent transformers model from a `Transformer`,
so tests and benchmarks can run HF on exactly the same weights.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from nanolab.model.checkpoint_files import CONFIG_FILE, load_weights_file, read_json
from nanolab.model.config import ModelConfig
from nanolab.model.transformer import Transformer

HF_ARCHS = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}
_HF_MODEL_TYPES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
# Buffers some HF checkpoints carry that are not weights: GPT-2's causal masks, old Llama RoPE frequencies.
_HF_IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")


def config_from_hf(raw: dict[str, Any], where: str = CONFIG_FILE) -> tuple[str, ModelConfig]:
    """(HF architecture name, equivalent ModelConfig) for an HF config.json dict.

    Raises `ValueError` naming ``where`` for an unsupported architecture or an option that would change
    the model's outputs (RoPE scaling, biases nanolab lacks, another activation, ...).
    """
    arch_name = (raw.get("architectures") or [_HF_MODEL_TYPES.get(raw.get("model_type"))])[0]
    if arch_name not in HF_ARCHS:
        raise ValueError(
            f"{where}: architecture {arch_name!r} (model_type {raw.get('model_type')!r}) is not supported; "
            f"nanolab loads {sorted(HF_ARCHS)} and its own checkpoints"
        )
    r = _HFConfig(raw, where, arch_name)
    fields = _gpt2_fields(r) if HF_ARCHS[arch_name] == "gpt2" else _llama_fields(r)
    try:
        return arch_name, ModelConfig(**fields)
    except ValueError as e:  # ModelConfig's own checks, e.g. heads that do not divide
        raise ValueError(f"{where}: {e}") from e


class _HFConfig:
    """An HF config.json dict that names its file and architecture in every complaint."""

    def __init__(self, raw: dict[str, Any], where: str, arch_name: str) -> None:
        self.raw, self.where, self.arch_name = raw, where, arch_name

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.raw.get(key) is None:
            raise ValueError(f"{self.where}: missing {key!r}, which a {self.arch_name} config must have")
        return self.raw[key]

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(
                f"{self.where}: {what} is not supported by nanolab's {self.arch_name} (it would change results)"
            )


def _gpt2_fields(r: _HFConfig) -> dict[str, Any]:
    act = r.get("activation_function", "gelu_new")
    r.require(act in ("gelu_new", "gelu_pytorch_tanh"), f"activation_function {act!r}")
    r.require(r.get("scale_attn_weights", True), "scale_attn_weights=false")
    r.require(not r.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=true")
    r.require(not r.get("add_cross_attention", False), "add_cross_attention=true")
    r.require(r.get("tie_word_embeddings", True), "tie_word_embeddings=false")
    n_heads, d_model = r.need("n_head"), r.need("n_embd")
    return dict(
        arch="gpt2",
        vocab_size=r.need("vocab_size"),
        n_layers=r.need("n_layer"),
        n_heads=n_heads,
        n_kv_heads=n_heads,
        d_model=d_model,
        d_ff=r.get("n_inner", 4 * d_model),
        max_seq_len=r.need("n_positions"),
        norm_eps=r.get("layer_norm_epsilon", 1e-5),
    )


def _llama_fields(r: _HFConfig) -> dict[str, Any]:
    is_qwen2 = r.arch_name == "Qwen2ForCausalLM"  # Qwen2 = Llama + q/k/v biases
    act = r.get("hidden_act", "silu")
    r.require(act == "silu", f"hidden_act {act!r}")
    r.require(not r.get("mlp_bias", False), "mlp_bias=true")
    r.require(is_qwen2 or not r.get("attention_bias", False), "attention_bias=true")
    d_model, n_heads = r.need("hidden_size"), r.need("num_attention_heads")
    head_dim = r.get("head_dim", d_model // n_heads)
    r.require(head_dim * n_heads == d_model, f"head_dim {head_dim} != hidden_size / num_attention_heads")

    # transformers >= 5 writes "rope_parameters"; older versions "rope_theta" and "rope_scaling".
    rope = r.get("rope_parameters") or r.get("rope_scaling") or {}
    r.require(not any(isinstance(v, dict) for v in rope.values()), "per-layer-type rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    r.require(rope_type == "default", f"RoPE scaling {rope_type!r}")
    factor = rope.get("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    r.require(factor == 1.0, f"partial_rotary_factor {factor}")

    max_seq_len = r.need("max_position_embeddings")
    # Qwen2 configs carry a sliding_window value that applies only when use_sliding_window is set.
    uses_window = r.arch_name == "MistralForCausalLM" or r.get("use_sliding_window", False)
    uses_window = uses_window or "sliding_attention" in r.get("layer_types", [])
    window = r.get("sliding_window") if uses_window else None
    if window is not None and window < max_seq_len:
        warnings.warn(
            f"{r.where}: sliding window {window} < max_position_embeddings {max_seq_len}; nanolab attends "
            f"to the full context, so max_seq_len is capped at {window}, where the two agree",
            stacklevel=4,
        )
        max_seq_len = window
    return dict(
        arch="llama",
        vocab_size=r.need("vocab_size"),
        n_layers=r.need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=r.get("num_key_value_heads", n_heads),
        d_model=d_model,
        d_ff=r.need("intermediate_size"),
        max_seq_len=max_seq_len,
        norm_eps=r.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", r.get("rope_theta", 10000.0))),
        tie_embeddings=r.get("tie_word_embeddings", False),
        qkv_bias=is_qwen2,
    )


class _Param(NamedTuple):
    """One nanolab tensor and the HF tensors it is made of (concatenated along dim 0, in this order)."""

    ours: str
    hf: tuple[str, ...]
    sizes: tuple[int, ...] | None = None  # rows each HF tensor contributes, when there are several
    transpose: bool = False  # GPT-2's Conv1D stores its weight as (in, out); nn.Linear as (out, in)


def _param_table(config: ModelConfig) -> list[_Param]:
    P = _Param
    table: list[_Param] = []
    if config.arch == "gpt2":
        table += [
            P("tok_emb.weight", ("transformer.wte.weight",)),
            P("pos_emb.weight", ("transformer.wpe.weight",)),
        ]
        for i in range(config.n_layers):
            o, h = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs, conv in (
                ("attn_norm", "ln_1", False),
                ("attn.qkv", "attn.c_attn", True),
                ("attn.out", "attn.c_proj", True),
                ("mlp_norm", "ln_2", False),
                ("mlp.fc", "mlp.c_fc", True),
                ("mlp.proj", "mlp.c_proj", True),
            ):
                table += [P(f"{o}{ours}.weight", (f"{h}{theirs}.weight",), transpose=conv)]
                table += [P(f"{o}{ours}.bias", (f"{h}{theirs}.bias",))]
        return table + [
            P("norm.weight", ("transformer.ln_f.weight",)),
            P("norm.bias", ("transformer.ln_f.bias",)),
        ]

    table.append(P("tok_emb.weight", ("model.embed_tokens.weight",)))
    qkv_sizes = (config.q_size, config.kv_size, config.kv_size)
    for i in range(config.n_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        qkv = tuple(f"{h}self_attn.{x}_proj" for x in "qkv")
        table.append(P(f"{o}attn_norm.weight", (f"{h}input_layernorm.weight",)))
        table.append(P(f"{o}attn.qkv.weight", tuple(f"{x}.weight" for x in qkv), qkv_sizes))
        if config.qkv_bias:
            table.append(P(f"{o}attn.qkv.bias", tuple(f"{x}.bias" for x in qkv), qkv_sizes))
        table.append(P(f"{o}attn.out.weight", (f"{h}self_attn.o_proj.weight",)))
        table.append(P(f"{o}mlp_norm.weight", (f"{h}post_attention_layernorm.weight",)))
        gate_up = (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight")
        table.append(P(f"{o}mlp.gate_up.weight", gate_up, (config.d_ff, config.d_ff)))
        table.append(P(f"{o}mlp.down.weight", (f"{h}mlp.down_proj.weight",)))
    table.append(P("norm.weight", ("model.norm.weight",)))
    if not config.tie_embeddings:
        table.append(P("lm_head.weight", ("lm_head.weight",)))
    return table


def state_from_hf(hf: dict[str, torch.Tensor], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    if config.arch == "gpt2":  # the original GPT-2 files name tensors without the "transformer." prefix
        hf = {
            k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in hf.items()
        }
    hf = dict(hf)
    state = {}
    for p in _param_table(config):
        for key in p.hf:
            if key not in hf:
                raise ValueError(f"{source} lacks tensor {key!r} (for nanolab's {p.ours}); is it complete?")
        parts = [hf.pop(key).t() if p.transpose else hf.pop(key) for key in p.hf]
        state[p.ours] = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    if config.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    unexpected = sorted(k for k in hf if not _HF_IGNORED.search(k))
    if unexpected:
        raise ValueError(
            f"{source} has tensors nanolab does not expect from its config.json: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; the checkpoint uses an option nanolab does not support"
        )
    return state


def _hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    ours = model.state_dict()
    state = {}
    for p in _param_table(model.config):
        parts = ours[p.ours].split(p.sizes) if p.sizes else (ours[p.ours],)
        for key, part in zip(p.hf, parts):
            state[key] = (part.t() if p.transpose else part).contiguous()
    if model.config.tie_embeddings:
        state["lm_head.weight"] = ours["tok_emb.weight"]
    return state


def to_hf(
    model: Transformer,
    *,
    attn_implementation: str = "sdpa",
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
):
    """The same model as a transformers GPT2LMHeadModel / LlamaForCausalLM (Qwen2ForCausalLM if qkv_bias).

    Same weights, same outputs (up to float rounding). ``eos_token_id`` lets HF ``generate`` stop where
    nanolab would. Needs the ``transformers`` package.
    """
    import transformers

    c = model.config
    common = dict(
        vocab_size=c.vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=c.tie_embeddings,
        attn_implementation=attn_implementation,
    )
    if c.arch == "gpt2":
        hf_config = transformers.GPT2Config(
            n_positions=c.max_seq_len,
            n_embd=c.d_model,
            n_layer=c.n_layers,
            n_head=c.n_heads,
            n_inner=c.d_ff,
            activation_function="gelu_pytorch_tanh",  # exactly F.gelu(approximate="tanh"), as nanolab
            layer_norm_epsilon=c.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        config_cls, cls = (
            (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
            if c.qkv_bias
            else (transformers.LlamaConfig, transformers.LlamaForCausalLM)
        )
        hf_config = config_cls(
            hidden_size=c.d_model,
            intermediate_size=c.d_ff,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            max_position_embeddings=c.max_seq_len,
            rms_norm_eps=c.norm_eps,
            rope_theta=c.rope_theta,
            hidden_act="silu",
            **common,
        )
    hf_model = cls(hf_config)
    missing, unexpected = hf_model.load_state_dict(_hf_state(model), strict=False)
    if missing or unexpected:  # a bug in the table above, not a user error
        raise RuntimeError(f"to_hf: HF model lacks {unexpected} / was not given {missing}")
    return hf_model.to(model.tok_emb.weight.dtype).eval()


def save_hf(model: Transformer, path: str | Path, **kwargs: Any) -> Path:
    """Write `to_hf(model, **kwargs)` with ``save_pretrained`` to ``path``; returns the directory."""
    to_hf(model, **kwargs).save_pretrained(path)
    return Path(path)


def read_hf_weights(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of an HF checkpoint (single file or sharded), and the file name to quote in errors."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        index = directory / f"{name}.index.json"
        if index.exists():
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(read_json(index)["weight_map"].values())):
                if not (directory / shard).exists():
                    raise FileNotFoundError(
                        f"{index} lists the shard {shard}, which is missing from {directory}"
                    )
                state.update(load_weights_file(directory / shard))
            return state, str(index)
        if (directory / name).exists():
            return load_weights_file(directory / name), str(directory / name)
    raise FileNotFoundError(
        f"{directory} has a Hugging Face {CONFIG_FILE} but no weights: expected model.safetensors, "
        f"a sharded model.safetensors.index.json, or pytorch_model.bin"
    )
