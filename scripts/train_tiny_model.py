"""Train nanolab's bundled model, "tinypy", on the Python source code that ships with Python itself.

Run from the repository root::

    python scripts/train_tiny_model.py                      # the full run: about 40 minutes on 2 CPU cores
    python scripts/train_tiny_model.py --quick --out DIR    # a smoke run of the whole pipeline, under a minute
    python scripts/train_tiny_model.py --draft-for nanolab/assets/tinypy   # tinypy's draft model (below)

A *draft model* (``--draft-for TARGET``) is trained the same way with smaller sizes and the target's own
tokenizer (a draft must speak the target's token ids): by default into ``nanolab/assets/tinypy-draft/``.
Its card adds how often it agrees with the target on the held-out windows (speculative decoding's
acceptance, see `nanolab.engine.speculative`).

What it does, in order:

1. **Corpus.** Every ``.py`` file of the running interpreter's standard library, in sorted path order,
   except tests (``test/``, ``tests/``, ``idle_test/``), ``site-packages/``, ``encodings/`` (mostly
   machine-generated codec tables) and ``pydoc_data/`` (one 750 kB file of documentation cut into string
   literals, which teaches a tiny model to answer ``class Stack:`` with quoted prose). A file is held out for evaluation when ``crc32(its path) % 20 == 0``:
   about 5% of the files, chosen by name alone, so the split is the same on every machine.
2. **Tokenizer.** `nanolab.text.tokenizer.Tokenizer.train` (byte-level BPE, GPT-4 split pattern) on a
   ~3 MB sample of whole training files drawn in seeded random order; ``<|endoftext|>`` is the one
   special token and separates documents.
3. **Model.** A Llama-style `nanolab.model.transformer.Transformer` (RoPE, RMSNorm, SwiGLU, grouped-query
   attention, tied embeddings) trained with `Transformer.logits` (a plain causal forward) on windows of
   ``seq_len`` tokens cut from the concatenated training files, in seeded random order: AdamW, linear
   warmup then cosine decay, gradient clipping.
4. **Outputs** (in ``--out``, by default ``nanolab/assets/tinypy/``): ``config.json``,
   ``model.safetensors`` and ``nanolab_tokenizer.json`` (via `nanolab.model.loading.save_model`), the
   same tokenizer as Hugging Face's ``tokenizer.json`` and ``tokenizer_config.json`` (`Tokenizer.save_hf`),
   ``training_curve.png``, and ``MODEL_CARD.md`` with every number measured by this run.

Reproducibility. The corpus is whatever the running Python ships, so the card records the Python
version and a hash of the corpus. Given the same corpus, the tokenizer (integer arithmetic only), the token
streams, the split, the batch order (a seeded CPU ``torch.Generator``) and the initial weights
(``torch.manual_seed``) are identical on every machine. The training arithmetic is bit-identical only on
the same CPU type with the same torch version and thread count (``--threads``, default 2): other SIMD
kernels or thread counts round differently, the weights drift apart in their last bits, and the final
losses then agree to about a hundredth of a nat rather than exactly. Timings are of course the machine's own.

Deliberately left out: GPUs, mixed precision, dropout, checkpoint/resume, and data beyond the standard library.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import platform
import random
import shlex
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from nanolab.model.config import ModelConfig
from nanolab.model.generate import generate
from nanolab.model.loading import load_model, save_model
from nanolab.model.sampling import SamplingParams
from nanolab.model.transformer import Transformer
from nanolab.text.tokenizer import ENDOFTEXT, TOKENIZER_FILENAME, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "nanolab" / "assets" / "tinypy"
DRAFT_OUT = ROOT / "nanolab" / "assets" / "tinypy-draft"
QUICK_OUT = ROOT / "runs" / "tinypy-quick"  # --quick never overwrites the bundled model by default
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)
HELD_OUT_EVERY = 20  # a file is held out when crc32(its relative path) % HELD_OUT_EVERY == 0
CHECK_WINDOWS = 8  # the held-out "check sample": the first windows of the held-out stream (see check_sample)
CURVE_WINDOWS = 8  # held-out windows evaluated during training for the curve
PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
PLOT_NAME, CARD_NAME = "training_curve.png", "MODEL_CARD.md"


@dataclass(frozen=True)
class Settings:
    """Everything that decides the result of a run (each is also a command-line flag)."""

    seed: int = 0  # seeds the tokenizer sample, the initial weights and the batch order
    threads: int = 2  # torch.set_num_threads: part of what makes the float arithmetic reproducible
    vocab_size: int = 4096  # tokenizer size: 256 bytes + merges + <|endoftext|>
    tokenizer_bytes: int = 3_000_000  # train the tokenizer on about this many bytes of whole files
    max_corpus_bytes: int = 0  # use only the first files up to this many bytes (held-out: a tenth); 0 = all
    d_model: int = 128  # model width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention)
    d_ff: int = 344  # SwiGLU hidden width (~ 8/3 d_model, rounded up to a multiple of 8)
    seq_len: int = 512  # training window, and the model's max_seq_len
    batch_size: int = 8  # windows per step
    steps: int = 3000  # optimizer steps
    lr: float = 4e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1  # AdamW decay of the weight matrices (not of the norms)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    eval_every: int = 200  # steps between the held-out points on the training curve
    eval_tokens: int = 65_536  # final held-out evaluation: at most this many tokens, spread evenly
    sample_tokens: int = 64  # tokens generated per prompt for the card
    compile: bool = True  # torch.compile the training step (faster on CPU; costs a few minutes up front)


FULL = Settings()
QUICK = replace(
    FULL,
    vocab_size=320,
    tokenizer_bytes=60_000,
    max_corpus_bytes=200_000,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=176,
    seq_len=64,
    batch_size=4,
    steps=12,
    warmup_steps=3,
    eval_every=4,
    eval_tokens=2048,
    sample_tokens=12,
    compile=False,
)
# tinypy's draft model: the same data and schedule, a fraction of the layers' width and depth
DRAFT = replace(FULL, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=176)


# ---- corpus ---------------------------------------------------------------------------------------


class Document(NamedTuple):
    path: str  # relative to the standard library directory, with "/" separators
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_paths(root: Path) -> list[str]:
    """Relative paths of the corpus files under ``root``, sorted (the order everything else follows)."""
    paths = (p.relative_to(root) for p in root.rglob("*.py"))
    return sorted(p.as_posix() for p in paths if not EXCLUDED_DIRS.intersection(p.parts))


def is_held_out(path: str) -> bool:
    """Whether the file at this relative path is held out: decided by its name, the same everywhere."""
    return zlib.crc32(path.encode("utf-8")) % HELD_OUT_EVERY == 0


def read_corpus(root: Path, max_bytes: int = 0) -> tuple[list[Document], list[Document]]:
    """(training documents, held-out documents), each in sorted path order.

    With ``max_bytes`` > 0, only the first files up to that many bytes are kept for training, and up
    to a tenth of it (at least one file) for held-out.
    """
    train: list[Document] = []
    held: list[Document] = []
    sizes = {"train": 0, "held": 0}
    for path in corpus_paths(root):
        part, docs, cap = (
            ("held", held, max_bytes // 10) if is_held_out(path) else ("train", train, max_bytes)
        )
        if max_bytes and sizes[part] >= cap and docs:
            continue
        text = (root / path).read_text(encoding="utf-8")
        docs.append(Document(path, text))
        sizes[part] += len(text.encode("utf-8"))
    return train, held


def tokenizer_sample(docs: list[Document], n_bytes: int, seed: int) -> str:
    """Whole documents in seeded random order until ``n_bytes``, joined by ``<|endoftext|>``."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    picked: list[str] = []
    total = 0
    for i in order:
        if total >= n_bytes:
            break
        picked.append(docs[i].text)
        total += len(docs[i].text.encode("utf-8"))
    return ENDOFTEXT.join(picked)


def encode_documents(tokenizer: Tokenizer, docs: list[Document], progress: bool = False) -> torch.Tensor:
    """One stream of token ids: each document's tokens followed by the end-of-text id. (N,) int64."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in tqdm(docs, desc="encode", unit="file", disable=not progress):
        ids.extend(tokenizer.encode(doc.text, allowed_special="none"))  # a literal "<|endoftext|>" is text
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping training windows: (N, seq_len + 1), row i = stream[i*seq_len : (i+1)*seq_len + 1].

    Inputs are ``row[:-1]`` and targets ``row[1:]``, so every token after the first is a target once.
    """
    return stream.unfold(0, seq_len + 1, seq_len)


def check_sample(tokenizer: Tokenizer, root: Path, seq_len: int) -> torch.Tensor:
    """The first `CHECK_WINDOWS` windows of the held-out stream: (CHECK_WINDOWS, seq_len + 1).

    Reads only as many held-out files as it needs, so a test can recompute the card's figure quickly.
    """
    needed = CHECK_WINDOWS * seq_len + 1
    docs: list[Document] = []
    stream = torch.empty(0, dtype=torch.long)
    for path in (p for p in corpus_paths(root) if is_held_out(p)):
        docs.append(Document(path, (root / path).read_text(encoding="utf-8")))
        stream = encode_documents(tokenizer, docs)
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise ValueError(f"the held-out files have {len(stream)} tokens; the check sample needs {needed}")
    return windows(stream[:needed], seq_len)


def ids_digest(ids: torch.Tensor) -> str:
    """A short hash of token ids, to tell whether two runs looked at the same text."""
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


# ---- model and training ---------------------------------------------------------------------------


def build_model(s: Settings, vocab_size: int) -> Transformer:
    """A fresh Llama-style model with GPT-2's initialisation: N(0, 0.02), residual outputs scaled down.

    (nn.Embedding's default N(0, 1) would make the tied output layer's first logits huge.)
    """
    config = ModelConfig(
        arch="llama",
        vocab_size=vocab_size,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads,
        d_model=s.d_model,
        d_ff=s.d_ff,
        max_seq_len=s.seq_len,
        tie_embeddings=True,
    )
    model = Transformer(config)
    for name, p in model.named_parameters():  # the tied embedding appears once
        if p.ndim == 2:
            residual_out = name.endswith(("attn.out.weight", "mlp.down.weight"))
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * s.n_layers) if residual_out else 0.02)
    return model


def lr_at(step: int, s: Settings) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - 1 - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batches(data: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless (batch_size, seq_len + 1) batches: each epoch visits the windows in a new seeded order."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(data), generator=generator)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield data[order[i : i + batch_size]]


def next_token_loss(model: Transformer, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]`` (B, S + 1)."""
    logits = model.logits(batch[:, :-1])  # (B, S, V)
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def mean_loss(model: Transformer, data: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token loss (nats/token) over all windows in ``data`` (N, S + 1)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        batch = data[i : i + batch_size]
        total += next_token_loss(model, batch).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


def evenly_spaced(data: torch.Tensor, n: int) -> torch.Tensor:
    """At most n rows of ``data``, spread evenly over it (all of them when there are fewer)."""
    if len(data) <= n:
        return data
    return data[torch.linspace(0, len(data) - 1, n).round().long()]


@dataclass
class History:
    train_steps: list[int]
    train_loss: list[float]
    eval_steps: list[int]
    eval_loss: list[float]
    train_seconds: float = 0.0  # the training loop, held-out curve points excluded
    steady_tokens_per_s: float = 0.0  # after the first step (which compiles)


def train(model: Transformer, data: torch.Tensor, curve_data: torch.Tensor, s: Settings) -> History:
    """Train ``model`` in place on the windows ``data``; returns the loss history."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    loss_fn = torch.compile(next_token_loss) if s.compile else next_token_loss
    history = History([], [], [], [])
    tokens_per_step = s.batch_size * s.seq_len
    step_times: list[float] = []
    model.train()
    data_iter = batches(data, s.batch_size, s.seed)
    bar = tqdm(range(s.steps), desc="train", unit="step")
    for step in bar:
        if step % s.eval_every == 0:
            history.eval_steps.append(step)
            history.eval_loss.append(mean_loss(model, curve_data))
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s)
        loss = loss_fn(model, next(data_iter))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        step_times.append(time.perf_counter() - start)
        history.train_steps.append(step)
        history.train_loss.append(loss.item())
        recent = step_times[1:][-20:] or step_times
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_step * len(recent) / sum(recent):.0f}")
    history.eval_steps.append(s.steps)
    history.eval_loss.append(mean_loss(model, curve_data))
    history.train_seconds = sum(step_times)
    steady = step_times[1:] or step_times
    history.steady_tokens_per_s = tokens_per_step * len(steady) / sum(steady)
    return history


# ---- outputs --------------------------------------------------------------------------------------


def plot_curve(history: History, s: Settings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    millions = s.batch_size * s.seq_len / 1e6  # tokens per step, in millions
    ema, smooth = history.train_loss[0], []
    for x in history.train_loss:
        ema = 0.9 * ema + 0.1 * x
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x_train = [(i + 1) * millions for i in history.train_steps]
    ax.plot(x_train, history.train_loss, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(x_train, smooth, color="tab:blue", label="training batches (EMA 0.9)")
    x_eval = [i * millions for i in history.eval_steps]
    ax.plot(x_eval, history.eval_loss, "o-", color="tab:orange", label=f"held-out ({CURVE_WINDOWS} windows)")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("next-token loss (nats/token)")
    ax.set_title("tinypy: training curve")
    ax.set_ylim(bottom=0, top=1.05 * max(history.train_loss + history.eval_loss))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sample_generations(model: Transformer, tokenizer: Tokenizer, s: Settings) -> list[tuple[str, str, str]]:
    """(prompt, greedy continuation, sampled continuation) for each of `PROMPTS`."""
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=s.seed)
    out = []
    for prompt in PROMPTS:
        greedy = generate(model, tokenizer, prompt, s.sample_tokens).text
        drawn = generate(model, tokenizer, prompt, s.sample_tokens, sampled).text
        out.append((prompt, greedy, drawn))
    return out


def fence(text: str) -> str:
    """A markdown code block that holds ``text`` safely, whatever backticks it contains."""
    longest = 0
    run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}python\n{text}\n{ticks}"


def write_card(path: Path, r: dict) -> None:
    s: Settings = r["settings"]
    c: ModelConfig = r["config"]
    h: History = r["history"]
    samples = "\n\n".join(
        f"Prompt {prompt!r}, greedy:\n\n{fence(prompt + greedy)}\n\nSampled (temperature 0.8, top-p 0.95, "
        f"seed {s.seed}):\n\n{fence(prompt + drawn)}"
        for prompt, greedy, drawn in r["samples"]
    )
    d = r.get("draft")
    if d is None:
        title, role = (
            "tinypy",
            (
                "It is nanolab's\nbundled model: `nanolab.model.loading.load_model()` with no argument loads it. "
                "It is small enough to serve on a\nlaptop and to read every tensor of, and it writes "
                "Python-looking code; it does not write correct programs."
            ),
        )
        tokenizer = (
            f"Byte-level BPE (`nanolab.text.tokenizer.Tokenizer`, GPT-4 split pattern), trained on "
            f"{r['tok_sample_bytes']:,}\nbytes of whole training files in {r['tok_seconds']:.1f} s."
        )
    else:
        title = r["out_name"]
        role = (
            f"It is the\ndraft model of `{d['target']}` ({d['target_params'] / 1e6:.2f}M parameters; this one "
            f"has {r['params'] / d['target_params']:.0%} of them) for\nspeculative decoding: "
            f'`LLM(speculative_config={{"method": "draft_model", "model": "{r["out_name"]}", '
            f'"num_speculative_tokens": 4}})`.'
        )
        tokenizer = (
            f"`{d['target']}`'s own, loaded rather than trained: a draft must use its target's token ids."
        )
    draft_section = (
        ""
        if d is None
        else f"""
## As a draft model for {d["target"]}

How often this model's next-token prediction agrees with `{d["target"]}`'s, at every position of the
held-out windows above ({d["positions"]:,} positions):

| | |
|---|---|
| greedy agreement | {d["greedy"]:.3f}: both models' most likely tokens are the same (greedy speculative decoding keeps a guess exactly then) |
| sampled acceptance | {d["sampled"]:.3f}: the mean of sum_x min(p(x), q(x)) at temperature 1, the chance that speculative sampling keeps a guess drawn from this model |

With a chance a of keeping each guess, k guesses give (1 - a^(k+1)) / (1 - a) tokens per target forward
on average (the guesses are not independent in real text, so the engine's own count differs: `LLM.stats()`).
"""
    )
    card = f"""# {title}

A {r["params"] / 1e6:.2f}M-parameter Llama-style language model of Python source code, trained on the
CPU from the standard library of Python {r["python"]} by `scripts/train_tiny_model.py`. {role}

Everything below was measured by the run that wrote this directory; regenerate it rather than edit it.

## Corpus

| | |
|---|---|
| source | the `.py` files of the Python {r["python"]} standard library (`{r["stdlib"]}`) |
| excluded | directories {", ".join(f"`{d}/`" for d in sorted(EXCLUDED_DIRS))} |
| files | {r["n_train_files"]} training + {r["n_held_files"]} held-out |
| bytes | {r["train_bytes"]:,} training + {r["held_bytes"]:,} held-out |
| tokens | {r["train_tokens"]:,} training + {r["held_tokens"]:,} held-out (each file followed by `<|endoftext|>`) |
| held-out rule | a file is held out when `crc32(relative path) % {HELD_OUT_EVERY} == 0` |
| corpus sha256 | `{r["corpus_sha"]}` (of every file's path and bytes, in order) |

Held-out files: {", ".join(f"`{p}`" for p in r["held_paths"])}.

## Tokenizer

{tokenizer}

| | |
|---|---|
| vocab size | {r["vocab_size"]} (256 bytes + {r["vocab_size"] - 257} merges + `<|endoftext|>` = id {r["eos_id"]}) |
| bytes per token | {r["train_bytes"] / (r["train_tokens"] - r["n_train_files"]):.2f} (training files), {r["held_bytes"] / (r["held_tokens"] - r["n_held_files"]):.2f} (held-out files) |

## Architecture

| | |
|---|---|
| parameters | {r["params"]:,} |
| family | Llama: RoPE (theta {c.rope_theta:g}), RMSNorm (eps {c.norm_eps:g}), SwiGLU MLP, grouped-query attention |
| layers | {c.n_layers} |
| d_model | {c.d_model} |
| heads | {c.n_heads} query / {c.n_kv_heads} key-value, head_dim {c.head_dim} |
| d_ff | {c.d_ff} |
| max_seq_len | {c.max_seq_len} (the training window) |
| embeddings | tied (input and output share one {c.vocab_size} x {c.d_model} matrix) |
| weights file | `model.safetensors`, float32, {r["weights_bytes"]:,} bytes |

## Training

| | |
|---|---|
| objective | next-token cross-entropy with `Transformer.logits` (causal), non-overlapping {s.seq_len}-token windows |
| steps | {s.steps} x {s.batch_size} windows x {s.seq_len} tokens = {s.steps * s.batch_size * s.seq_len:,} tokens ({s.steps * s.batch_size * s.seq_len / r["train_tokens"]:.2f} epochs) |
| optimizer | AdamW, betas (0.9, 0.95), weight decay {s.weight_decay} on weight matrices |
| learning rate | peak {s.lr:g}, linear warmup {s.warmup_steps} steps, cosine to {s.lr * s.min_lr_ratio:g} |
| gradient clipping | global norm {s.grad_clip} |
| initialisation | N(0, 0.02); attention and MLP output projections N(0, 0.02 / sqrt(2 x layers)) |
| seed, threads | {s.seed}, {s.threads} (`torch.set_num_threads`){", training step compiled with `torch.compile`" if s.compile else ""} |
| machine | {r["machine"]}, torch {torch.__version__} |
| training time | {h.train_seconds / 60:.1f} min in the training loop; {r["wall_seconds"] / 60:.1f} min for the whole script |
| throughput | {h.steady_tokens_per_s:,.0f} training tokens/s (steady state, after the first step) |
| final training loss | {sum(h.train_loss[-20:]) / len(h.train_loss[-20:]):.3f} nats/token (mean of the last {len(h.train_loss[-20:])} steps) |

![training curve]({PLOT_NAME})

## Held-out evaluation

Mean next-token loss over {r["eval_windows"]} non-overlapping {s.seq_len}-token windows spread evenly over the
held-out stream ({r["eval_windows"] * s.seq_len:,} predicted tokens):

| | |
|---|---|
| held-out loss | {r["held_loss"]:.4f} nats/token |
| held-out perplexity | {math.exp(r["held_loss"]):.2f} |
| bits per byte | {r["held_loss"] / math.log(2) * r["held_tokens_per_byte"]:.3f} |
| check sample loss | {r["check_loss"]:.4f} nats/token on the first {CHECK_WINDOWS} windows of the held-out stream (token ids sha256 `{r["check_digest"]}`) |

`tests/model/test_bundled_model.py` recomputes the check-sample loss.
{draft_section}
## Sample generations

{samples}

## Loading

`load_model("{r["out_name"]}")` took {r["load_seconds"]:.2f} s on the training machine.

## Reproduce

    {r["command"]}

The tokenizer, the data and the batch order are identical on any machine with the same Python version
(compare the corpus sha256 above); the trained weights are bit-identical only on the same CPU type with the
same torch version and thread count; elsewhere the losses agree closely but not exactly.
"""
    path.write_text(card)


# ---- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[Settings, Path, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and budget: a smoke test (< 1 min)")
    parser.add_argument(
        "--draft-for",
        type=Path,
        metavar="TARGET",
        help="train a draft model for the model in TARGET: its tokenizer, smaller sizes, agreement measured",
    )
    parser.add_argument(
        "--out", type=Path, help=f"output directory (default {DEFAULT_OUT.relative_to(ROOT)})"
    )
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=float if f.type == "float" else int, default=None)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DRAFT if args.draft_for else FULL
    overrides = {f.name: getattr(args, f.name) for f in fields(Settings) if getattr(args, f.name) is not None}
    out = args.out or (QUICK_OUT if args.quick else DRAFT_OUT if args.draft_for else DEFAULT_OUT)
    if args.draft_for is not None and not (args.draft_for / TOKENIZER_FILENAME).exists():
        parser.error(
            f"--draft-for {args.draft_for}: no {TOKENIZER_FILENAME} there (a nanolab model directory?)"
        )
    return replace(base, **overrides), out, args.draft_for


@torch.inference_mode()
def draft_agreement(draft: Transformer, target: Transformer, data: torch.Tensor, batch_size: int = 8) -> dict:
    """How well ``draft`` predicts ``target`` on ``data``'s windows, position by position.

    ``greedy``: the share of positions where both models' most likely tokens agree (greedy speculative
    decoding keeps a guess exactly then). ``sampled``: the mean of sum_x min(p(x), q(x)) at temperature
    1, the probability that speculative sampling keeps a guess drawn from the draft (Leviathan et al.).
    """
    agree, overlap, n = 0.0, 0.0, 0
    for i in range(0, len(data), batch_size):
        batch = data[i : i + batch_size, :-1]  # a window holds its inputs and one more token
        p = target.logits(batch).float().softmax(-1)
        q = draft.logits(batch).float().softmax(-1)
        agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        overlap += float(torch.minimum(p, q).sum())
        n += batch.numel()
    return {"greedy": agree / n, "sampled": overlap / n, "positions": n}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    s, out, draft_for = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    random.seed(s.seed)

    root = stdlib_dir()
    train_docs, held_docs = read_corpus(root, s.max_corpus_bytes)
    digest = hashlib.sha256()
    for doc in sorted(train_docs + held_docs):
        digest.update(doc.path.encode() + b"\0" + doc.text.encode("utf-8") + b"\0")
    print(f"corpus: {len(train_docs)} training + {len(held_docs)} held-out files from {root}")

    t = time.perf_counter()
    sample = tokenizer_sample(train_docs, s.tokenizer_bytes, s.seed)
    if draft_for is None:
        tokenizer = Tokenizer.train(sample, s.vocab_size, special_tokens=[ENDOFTEXT], verbose=True)
    else:
        tokenizer = Tokenizer.load(draft_for / TOKENIZER_FILENAME)  # a draft speaks its target's ids
    tok_seconds = time.perf_counter() - t
    train_stream = encode_documents(tokenizer, train_docs, progress=True)
    held_stream = encode_documents(tokenizer, held_docs, progress=True)
    train_data = windows(train_stream, s.seq_len)
    held_data = windows(held_stream, s.seq_len)
    eval_data = evenly_spaced(held_data, max(1, s.eval_tokens // s.seq_len))
    curve_data = evenly_spaced(held_data, CURVE_WINDOWS)
    check_data = held_data[:CHECK_WINDOWS]  # the same windows as check_sample(), which the test uses
    print(
        f"tokens: {len(train_stream):,} training ({len(train_data)} windows), {len(held_stream):,} held-out"
    )

    model = build_model(s, tokenizer.vocab_size)
    print(f"model: {model.num_parameters():,} parameters, {model.config}")
    history = train(model, train_data, curve_data, s)
    model.eval()
    held_loss = mean_loss(model, eval_data)
    check_loss = mean_loss(model, check_data)
    print(
        f"held-out loss {held_loss:.4f} (perplexity {math.exp(held_loss):.2f}), check sample {check_loss:.4f}"
    )

    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out, tokenizer)
    template = out / "chat_template.jinja"  # written by hand, kept by retraining
    # the same tokenizer as Hugging Face files, for transformers and the clients built on it
    tokenizer.save_hf(out, template.read_text() if template.exists() else None, model.config.max_seq_len)
    for name in ("config.json", "model.safetensors", TOKENIZER_FILENAME):
        (out / name).chmod(0o644)  # safetensors writes 0600; the packaged file must be world-readable
    plot_curve(history, s, out / PLOT_NAME)
    t = time.perf_counter()
    loaded = load_model(out)
    load_seconds = time.perf_counter() - t
    if abs(mean_loss(loaded, check_data) - check_loss) > 1e-4:
        raise RuntimeError("the saved model does not reproduce the trained model's loss")
    samples = sample_generations(loaded, tokenizer, s)
    draft = None
    if draft_for is not None:
        target = load_model(draft_for)
        draft = dict(
            target=draft_for.name,
            target_params=target.num_parameters(),
            **draft_agreement(loaded, target, eval_data),
        )
        print(
            f"agreement with {draft_for.name}: greedy {draft['greedy']:.3f}, sampled {draft['sampled']:.3f}"
        )
    for prompt, greedy, _ in samples:
        print(f"--- {prompt!r} (greedy) ---\n{prompt}{greedy}")

    def n_bytes(docs: list[Document]) -> int:
        return sum(len(d.text.encode("utf-8")) for d in docs)

    report = dict(
        settings=s,
        config=model.config,
        history=history,
        python=platform.python_version(),
        stdlib=f"lib/python{sys.version_info.major}.{sys.version_info.minor}",
        n_train_files=len(train_docs),
        n_held_files=len(held_docs),
        train_bytes=n_bytes(train_docs),
        held_bytes=n_bytes(held_docs),
        train_tokens=len(train_stream),
        held_tokens=len(held_stream),
        held_tokens_per_byte=(len(held_stream) - len(held_docs)) / n_bytes(held_docs),
        held_paths=[d.path for d in held_docs],
        corpus_sha=digest.hexdigest(),
        tok_sample_bytes=len(sample.encode("utf-8")),
        tok_seconds=tok_seconds,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_token_id,
        params=model.num_parameters(),
        weights_bytes=(out / "model.safetensors").stat().st_size,
        machine=f"{platform.machine()} {_cpu_name()}",
        eval_windows=len(eval_data),
        held_loss=held_loss,
        check_loss=check_loss,
        check_digest=ids_digest(check_data),
        samples=samples,
        load_seconds=load_seconds,
        out_name=out.name if out.resolve() in (DEFAULT_OUT, DRAFT_OUT) else str(out),
        command=" ".join(["python", "scripts/train_tiny_model.py", *map(shlex.quote, argv)]),
        draft=draft,
        wall_seconds=time.perf_counter() - started,
    )
    write_card(out / CARD_NAME, report)
    print(f"wrote {out} in {report['wall_seconds'] / 60:.1f} min")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
