"""Reading and writing model weights: nanolab checkpoints and local Hugging Face checkpoints.

A nanolab checkpoint is a directory with ``config.json`` (the `ModelConfig` fields plus a
``"nanolab_format"`` marker), ``model.safetensors`` (the `Transformer` state dict; ``lm_head.weight`` is
left out when tied) and optionally ``nanolab_tokenizer.json`` and a chat template
(``chat_template.jinja``). The bundled model lives in
``nanolab/assets/<name>/``; a bare name such as ``"tinypy"`` means that directory.

A Hugging Face checkpoint is a local directory written by ``save_pretrained`` (nothing is downloaded):
GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM. Its tensors are renamed to
ours, GPT-2's Conv1D weights (stored (in, out)) are transposed, and q/k/v and gate/up are concatenated
into nanolab's fused projections; that conversion lives in `nanolab.model.hf`, whose `to_hf` goes the other way,
for comparing against HF on the same weights. Its ``tokenizer.json`` is read with the `tokenizers` library
(`nanolab.text.hf_tokenizer`), its chat template from ``chat_template.jinja`` or ``tokenizer_config.json``.

Deliberately left out: quantised weights, RoPE scaling, sliding windows (a Mistral/Qwen2 window caps
``max_seq_len`` instead: below the window it changes nothing), downloading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from nanolab.model.checkpoint_files import CONFIG_FILE, load_weights_file, read_json
from nanolab.model.config import ModelConfig
from nanolab.model.transformer import Transformer

if TYPE_CHECKING:
    from nanolab.text.chat_template import ChatTemplate
    from nanolab.text.hf_tokenizer import HFTokenizer
    from nanolab.text.tokenizer import Tokenizer

ASSETS_DIR = Path(__file__).parents[1] / "assets"  # nanolab/assets
DEFAULT_MODEL = "tinypy"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "nanolab_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"  # a Hugging Face checkpoint's tokenizer (the tokenizers library's file)
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # what a chat template may refer to
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


def load_tokenizer(path_or_name: str | Path | None = None) -> Tokenizer | HFTokenizer | None:
    """The checkpoint's tokenizer, or None if it has none.

    ``nanolab_tokenizer.json`` gives a `nanolab.text.tokenizer.Tokenizer`; a Hugging Face checkpoint's
    ``tokenizer.json`` gives a `nanolab.text.hf_tokenizer.HFTokenizer` (same interface), whose
    end-of-sequence ids come from ``generation_config.json``, else ``config.json`` (``eos_token_id``: one
    id or a list), else ``tokenizer_config.json``'s ``eos_token``, as in ``transformers``' ``generate``.
    """
    directory = resolve_checkpoint(path_or_name)
    if (directory / TOKENIZER_FILE).exists():
        from nanolab.text.tokenizer import Tokenizer

        return Tokenizer.load(directory / TOKENIZER_FILE)
    if (directory / HF_TOKENIZER_FILE).exists():
        from nanolab.text.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(directory, eos_token_ids=_hf_eos_token_ids(directory))
    return None


def _hf_eos_token_ids(directory: Path) -> list[int] | None:
    """``eos_token_id`` of the generation config, else of the model config (None when neither names one)."""
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        file = directory / name
        if not file.exists():
            continue
        value = read_json(file).get("eos_token_id")
        if value is None or value == []:
            continue
        ids = value if isinstance(value, list) else [value]
        if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            return ids
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
    return None


def load_chat_template(path_or_name: str | Path | None = None, tokenizer: Any = None) -> ChatTemplate | None:
    """The checkpoint's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``"chat_template"``), or None if it has none.

    The template sees the special tokens that ``tokenizer_config.json`` names (``bos_token``,
    ``eos_token``, ...); where it names no ``eos_token``, the tokenizer's (``tokenizer``, if given).
    """
    from nanolab.text.chat_template import ChatTemplate
    from nanolab.text.hf_tokenizer import read_tokenizer_config, token_text

    directory = resolve_checkpoint(path_or_name)
    config = read_tokenizer_config(directory)
    file = directory / CHAT_TEMPLATE_FILE
    source: Any = file.read_text(encoding="utf-8") if file.exists() else config.get("chat_template")
    if isinstance(source, list):  # several named templates: [{"name": "default", "template": "..."}, ...]
        source = next(
            (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not source:
        return None
    special = {k: text for k in _TEMPLATE_TOKENS if (text := token_text(config.get(k))) is not None}
    if "eos_token" not in special and getattr(tokenizer, "eos_token", None):
        special["eos_token"] = tokenizer.eos_token
    try:
        return ChatTemplate(source, special)
    except ValueError as exc:
        raise ValueError(f"{file if file.exists() else directory / 'tokenizer_config.json'}: {exc}") from None


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
