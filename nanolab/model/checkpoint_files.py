"""The files of a checkpoint directory, read with errors that name the file: shared by nanolab's own
checkpoints (`nanolab.model.loading`) and Hugging Face's (`nanolab.model.hf`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "config.json"


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file; errors say which file is missing or broken."""
    if not path.exists():
        raise FileNotFoundError(f"{path.parent} is not a model checkpoint: it has no {path.name}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` (or PyTorch ``.bin``) file, on the CPU."""
    try:
        if path.suffix == ".bin":
            return torch.load(path, map_location="cpu", weights_only=True)
        return load_file(str(path))
    except Exception as e:
        raise ValueError(f"could not read weights from {path}: {e}") from e
