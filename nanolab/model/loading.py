"""Reading and writing model weights: nanolab checkpoints and local Hugging Face checkpoints.

A nanolab checkpoint is a directory with ``config.json`` (the `ModelConfig` fields plus a
``"nanolab_format"`` marker), ``model.safetensors`` (the `Transformer` state dict; ``lm_head.weight`` is
left out when tied) and optionally ``nanolab_tokenizer.json``. The bundled model lives in
``nanolab/assets/<name>/``; a bare name such as ``"tinypy"`` means that directory.

A Hugging Face checkpoint is a local directory written by ``save_pretrained`` (nothing is downloaded):
GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM. Its tensors are renamed to
ours, GPT-2's Conv1D weights (stored (in, out)) are transposed, and q/k/v and gate/up are concatenated
into nanolab's fused projections; that conversion lives in `nanolab.model.hf`, whose `to_hf` goes the other way,
for comparing against HF on the same weights.

Deliberately left out: quantised weights, RoPE scaling, sliding windows (a Mistral/Qwen2 window caps
``max_seq_len`` instead: below the window it changes nothing), downloading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from nanolab.model.checkpoint_files import CONFIG_FILE, load_weights_file, read_json
from nanolab.model.config import ModelConfig
from nanolab.model.transformer import Transformer

if TYPE_CHECKING:
    from nanolab.text.tokenizer import Tokenizer

ASSETS_DIR = Path(__file__).parents[1] / "assets"  # nanolab/assets
DEFAULT_MODEL = "tinypy"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "nanolab_tokenizer.json"
FORMAT_KEY = "nanolab_format"  # present in (and only in) a nanolab checkpoint's config.json
FORMAT_VERSION = 1


def resolve_checkpoint(path_or_name: str | Path | None = None) -> Path:
    """The checkpoint directory meant by a path, a bundled model's name, or None (the bundled default).

    An existing directory wins over a bundled model of the same name.
    """
    if path_or_name is None:
        directory = ASSETS_DIR / DEFAULT_MODEL
        if not directory.is_dir():
            raise FileNotFoundError(
                f"the bundled model {directory} is not there; build it with the training script in "
                f"scripts/, or pass the path of a checkpoint directory"
            )
        return directory
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the checkpoint directory that holds {CONFIG_FILE}")
    name = str(path_or_name)
    if "/" not in name and "\\" not in name and (ASSETS_DIR / name).is_dir():
        return ASSETS_DIR / name
    bundled = sorted(p.name for p in ASSETS_DIR.glob("*") if p.is_dir() and not p.name.startswith((".", "_")))
    raise FileNotFoundError(
        f"no checkpoint directory {name!r}: it is neither a local directory nor a bundled model "
        f"(bundled: {bundled}). nanolab never downloads: fetch a Hugging Face model first, e.g. "
        f"`huggingface-cli download {name} --local-dir DIR`, and pass DIR"
    )


def load_model(path_or_name: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """Load a nanolab or Hugging Face checkpoint directory (see the module docstring) as a `Transformer`.

    Weights are converted to ``dtype``. The model is in eval mode, on the CPU.
    """
    directory = resolve_checkpoint(path_or_name)
    raw = read_json(directory / CONFIG_FILE)
    if FORMAT_KEY in raw:
        if raw[FORMAT_KEY] != FORMAT_VERSION:
            raise ValueError(
                f"{directory / CONFIG_FILE} is nanolab format {raw[FORMAT_KEY]!r}; this nanolab reads "
                f"format {FORMAT_VERSION}. Upgrade nanolab"
            )
        fields = {k: v for k, v in raw.items() if k != FORMAT_KEY}
        try:
            config = ModelConfig.from_dict(fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{directory / CONFIG_FILE}: {e}") from e
        weights = directory / WEIGHTS_FILE
        if not weights.exists():
            raise FileNotFoundError(f"{directory} has a nanolab {CONFIG_FILE} but no {WEIGHTS_FILE}")
        state, source = load_weights_file(weights), str(weights)
    elif "architectures" in raw or "model_type" in raw:
        from nanolab.model.hf import config_from_hf, read_hf_weights, state_from_hf

        _, config = config_from_hf(raw, where=str(directory / CONFIG_FILE))
        hf_state, source = read_hf_weights(directory)
        state = state_from_hf(hf_state, config, source)
    else:
        raise ValueError(
            f"{directory / CONFIG_FILE} is neither a nanolab checkpoint (no {FORMAT_KEY!r} key) nor a "
            f"Hugging Face one (no 'architectures' or 'model_type' key)"
        )
    state = {k: v.to(dtype) for k, v in state.items()}
    return Transformer.from_state_dict(config, state, source=source)


def load_tokenizer(path_or_name: str | Path | None = None) -> Tokenizer | None:
    """The checkpoint's ``nanolab_tokenizer.json`` as a `nanolab.text.tokenizer.Tokenizer`, or None if it has none."""
    file = resolve_checkpoint(path_or_name) / TOKENIZER_FILE
    if not file.exists():
        return None
    from nanolab.text.tokenizer import Tokenizer

    return Tokenizer.load(file)


def save_model(model: Transformer, path: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``) as a nanolab checkpoint directory; returns the directory."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = {FORMAT_KEY: FORMAT_VERSION, **model.config.to_dict()}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (model.config.tie_embeddings and k == "lm_head.weight")  # stored once, as tok_emb.weight
    }
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(str(directory / TOKENIZER_FILE))
    return directory
