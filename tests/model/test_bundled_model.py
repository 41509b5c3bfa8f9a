"""The bundled model, tinypy: its files agree with its card, it loads, and it is a trained model of Python.

The card (``MODEL_CARD.md``) is written by ``scripts/train_tiny_model.py`` from its own measurements; these
tests recompute what can be recomputed cheaply and check it against the card.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open

from nanolab.model.config import ModelConfig
from nanolab.model.generate import generate
from nanolab.model.loading import ASSETS_DIR, load_model, load_tokenizer
from nanolab.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ASSETS_DIR / "tinypy"
SCRIPT = ROOT / "scripts" / "train_tiny_model.py"
FILES = (
    "config.json",
    "model.safetensors",
    "nanolab_tokenizer.json",
    "tokenizer.json",  # the same tokenizer for Hugging Face's libraries
    "tokenizer_config.json",
    "MODEL_CARD.md",
    "training_curve.png",
)

# Same text as the card's check sample: the loss may differ only by float rounding (other CPUs, threads).
SAME_TEXT_TOLERANCE = 0.01
# Another Python version's standard library: the check sample is other text, so compare with the card's
# loss over the whole held-out set, loosely. An untrained model is ~8.3 nats/token, far outside this.
OTHER_TEXT_TOLERANCE = 0.75


@cache
def script() -> ModuleType:
    """scripts/train_tiny_model.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("train_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


@cache
def bundled() -> tuple[Transformer, object]:
    return load_model(), load_tokenizer()


def card_row(card: str, label: str) -> str:
    """The value in the card's table row ``| label | value |``."""
    match = re.search(rf"^\| {re.escape(label)} \| (.+?) \|$", card, re.M)
    assert match, f"the model card has no {label!r} row"
    return match.group(1)


def card_number(card: str, label: str) -> float:
    return float(re.match(r"[\d,.]+", card_row(card, label)).group().replace(",", ""))


def looks_like_python_function(text: str) -> list[str]:
    """What is missing from ``text`` (a ``def`` line plus its continuation) for it to look like Python code.

    Empty when the continuation starts the body on a new line indented by 4 spaces, the body uses some
    Python syntax (a keyword such as return/if/for, an assignment or a call), and every later non-blank
    line is either indented or starts a new top-level statement (def, class, import, from, @, #, if,
    for, while, with, try). A trained model passes; an untrained one emits unrelated tokens.
    """
    lines = text.split("\n")
    body = []
    for line in lines[1:]:
        if not re.match(r"^(    )+\S", line):
            break
        body.append(line.strip())
    missing = []
    if not body:
        missing.append("an indented body on the line after the def")
    if not re.search(r"\b(return|if|for|while|yield|raise)\b|\w+ = |\w\(", "\n".join(body)):
        missing.append("a keyword, an assignment or a call in the body")
    top_level = re.compile(r"^(    |def |class |import |from |@|#|if |for |while |with |try:)")
    if any(line.strip() and not top_level.match(line) for line in lines[1:]):
        missing.append("every line indented or a top-level statement")
    return missing


def test_bundled_directory_has_every_file():
    for name in FILES:
        path = BUNDLED / name
        assert path.is_file() and path.stat().st_size > 0, (
            f"{path} is missing or empty; run the training script"
        )
    assert (BUNDLED / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![training curve](training_curve.png)" in (BUNDLED / "MODEL_CARD.md").read_text()


def test_bundled_files_are_world_readable():
    """Installed into a shared environment, the package's files must be readable by every user."""
    for name in FILES:
        assert (BUNDLED / name).stat().st_mode & 0o444 == 0o444, f"{name} is not world-readable"


def test_weights_file_is_under_30_mb():
    assert (BUNDLED / "model.safetensors").stat().st_size < 30 * 1024 * 1024


def test_parameter_count_matches_the_card_and_the_weights_file():
    card = (BUNDLED / "MODEL_CARD.md").read_text()
    model, _ = bundled()
    with safe_open(str(BUNDLED / "model.safetensors"), "pt") as f:
        in_file = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert card_number(card, "parameters") == model.num_parameters() == in_file


def test_card_states_the_architecture_in_config_json():
    card = (BUNDLED / "MODEL_CARD.md").read_text()
    config = ModelConfig.from_dict(
        {k: v for k, v in json.loads((BUNDLED / "config.json").read_text()).items() if k != "nanolab_format"}
    )
    assert config.arch == "llama" and config.tie_embeddings
    assert card_number(card, "layers") == config.n_layers
    assert card_number(card, "d_model") == config.d_model
    assert card_number(card, "d_ff") == config.d_ff
    assert card_number(card, "max_seq_len") == config.max_seq_len
    assert card_row(card, "heads").startswith(f"{config.n_heads} query / {config.n_kv_heads} key-value")


def test_load_model_with_no_argument_loads_the_bundled_model_and_its_tokenizer():
    model, tokenizer = bundled()
    named = load_model("tinypy")
    assert model.config == named.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), named.state_dict().values()))
    assert not model.training
    assert tokenizer is not None and tokenizer.vocab_size == model.config.vocab_size
    assert tokenizer.eos_token_id == tokenizer.special_tokens["<|endoftext|>"] == model.config.vocab_size - 1


def test_greedy_continuation_of_a_def_looks_like_python():
    """The trained model writes a function body; the same architecture untrained does not."""
    model, tokenizer = bundled()
    prompt = "def fibonacci(n):\n"  # the def line as it appears in source code, newline included
    text = prompt + generate(model, tokenizer, prompt, 48).text
    assert looks_like_python_function(text) == [], text

    torch.manual_seed(0)
    untrained = Transformer(model.config).eval()
    text = prompt + generate(untrained, tokenizer, prompt, 48).text
    assert looks_like_python_function(text) != [], text


def test_held_out_check_sample_loss_matches_the_card():
    card = (BUNDLED / "MODEL_CARD.md").read_text()
    model, tokenizer = bundled()
    train = script()
    sample = train.check_sample(tokenizer, train.stdlib_dir(), model.config.max_seq_len)
    loss = train.mean_loss(model, sample)
    row = card_row(card, "check sample loss")
    if f"`{train.ids_digest(sample)}`" in row:  # this Python's held-out files are the card's
        assert loss == pytest.approx(card_number(card, "check sample loss"), abs=SAME_TEXT_TOLERANCE)
    else:
        assert loss == pytest.approx(card_number(card, "held-out loss"), abs=OTHER_TEXT_TOLERANCE)


def test_card_perplexity_is_exp_of_the_held_out_loss():
    card = (BUNDLED / "MODEL_CARD.md").read_text()
    loss = card_number(card, "held-out loss")
    assert card_number(card, "held-out perplexity") == pytest.approx(math.exp(loss), abs=0.01)
    assert loss < math.log(bundled()[0].config.vocab_size) - 5  # far below the uniform guess


def test_training_is_deterministic_given_the_seed():
    """Same settings and seed: same initial weights, same batches, same weights after a few steps."""
    train = script()
    s = train.QUICK
    data = torch.randint(0, 320, (16, s.seq_len + 1), generator=torch.Generator().manual_seed(1))
    results = []
    for _ in range(2):
        torch.manual_seed(s.seed)
        model = train.build_model(s, 320)
        train.train(model, data, data[:2], replace(s, steps=3, eval_every=2))
        results.append(model.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


@pytest.mark.timeout(300)
def test_quick_mode_trains_end_to_end(tmp_path):
    out = tmp_path / "tinypy"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in FILES:
        assert (out / name).is_file(), f"--quick did not write {name}"
    model, tokenizer = load_model(out), load_tokenizer(out)
    card = (out / "MODEL_CARD.md").read_text()
    assert card_number(card, "parameters") == model.num_parameters()
    assert tokenizer.vocab_size == model.config.vocab_size == card_number(card, "vocab size")
    assert card_number(card, "held-out loss") < math.log(model.config.vocab_size)  # it learned something
    assert "--quick" in card and "def fibonacci(n):" in card
