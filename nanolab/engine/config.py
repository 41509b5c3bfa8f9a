"""Every engine setting, defined once: `EngineConfig`.

`LLM`'s keyword arguments are checked against its fields, the scheduler reads it, and the command
line's engine flags are generated from it (each flag's help is the field's comment), so a new setting
is one line here.

A config may leave sizes open (``num_blocks=None``, ...); `resolve` fills them in for a given model, and
the engine and its scheduler only ever see a resolved config.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import inspect
import io
import tokenize
import types
import typing
from dataclasses import dataclass, fields
from typing import Any

import torch

from nanolab.engine.device import check_device
from nanolab.engine.speculative import SpeculativeConfig
from nanolab.memory.paging import cdiv
from nanolab.model import prepacked
from nanolab.model.config import ModelConfig
from nanolab.model.kv_cache import kv_cache_bytes
from nanolab.model.tensor_parallel import check_shardable

DEFAULT_KV_MEMORY = 1 << 30  # bytes of KV pool when num_blocks is not given
DEFAULT_CHUNKED_BUDGET = 1024  # tokens per step with chunked prefill, when not given


class SchedulingPolicy(str, enum.Enum):
    """Which waiting request is admitted next."""

    FCFS = "fcfs"  # first come, first served
    PRIORITY = "priority"  # lowest `priority` value first; waiting raises a request's priority (aging)
    SHORTEST = "shortest"  # fewest prompt tokens still to compute first


class AttentionBackend(str, enum.Enum):
    """Which implementation of paged decode attention runs (see `nanolab.memory.paged_attention`)."""

    AUTO = "auto"  # the C++ kernel when it is built and applies, else torch
    CPP = "cpp"  # the C++ kernel in nanolab._C
    TORCH = "torch"  # gather the blocks, then PyTorch's fused attention


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. Strings are accepted for the enum fields (``scheduling_policy="priority"``);
    ``device`` takes whatever ``torch.device`` does and keeps its string (``torch.device("cpu")`` -> "cpu").
    """

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = (
        None  # KV blocks in the pool (default: room for max_num_seqs full requests, <= 1 GiB)
    )
    max_num_seqs: int = 64  # requests running at once, at most
    max_num_batched_tokens: int | None = (
        None  # tokens computed per step, at most (default: 1024 with chunked prefill, else max_model_len)
    )
    max_model_len: int | None = (
        None  # prompt + output tokens of a request, at most (default: the model's max_seq_len; without chunked prefill, at most max_num_batched_tokens)
    )
    enable_prefix_caching: bool = True  # share computed prompt blocks between requests (radix cache)
    enable_chunked_prefill: bool = True  # split long prompts over several steps, next to running decodes
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS  # which waiting request is admitted next
    aging_steps: int = 16  # with the priority policy: steps of waiting that count as one level of priority
    attention_backend: AttentionBackend = AttentionBackend.AUTO  # paged decode attention implementation
    prepack_weights: bool = False  # faster matrix products on the CPU (one process): the weights, output layer included, copied once into oneDNN's layout, and products of 1-2 rows through nanolab's own kernel; results differ from F.linear's by float rounding (~1e-6)
    tensor_parallel_size: int = 1  # processes the model is split over (tensor parallelism; gloo on the CPU)
    device: str = (
        "cpu"  # torch device of the model, the KV pool and each step's tensors: cpu, cuda, cuda:N, ...
    )
    speculative_config: SpeculativeConfig | None = (
        None  # speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4} or {"method": "draft_model", "model": ..., "num_speculative_tokens": 4}; default off
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = _field_type(f)
            if kind is SpeculativeConfig:
                object.__setattr__(self, f.name, SpeculativeConfig.parse(value))
            elif kind is str:  # the device: checked last, against the settings checked here
                continue
            elif issubclass(kind, enum.Enum):
                try:
                    object.__setattr__(self, f.name, kind(value))
                except ValueError:
                    choices = ", ".join(repr(c.value) for c in kind)
                    raise ValueError(f"{f.name} must be one of {choices}, got {value!r}") from None
            elif kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be True or False, got {value!r}")
            elif value is not None or not _optional(f):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    none = " or None" if _optional(f) else ""
                    raise ValueError(f"{f.name} must be a positive integer{none}, got {value!r}")
        if self.prepack_weights and self.tensor_parallel_size > 1:
            raise ValueError(
                f"prepack_weights lays out the weights of one process, but tensor_parallel_size is "
                f"{self.tensor_parallel_size}; leave prepack_weights off with tensor parallelism"
            )
        if self.prepack_weights and not prepacked.available():
            raise ValueError("prepack_weights needs oneDNN, which this build of torch lacks; leave it off")
        object.__setattr__(self, "device", str(self._check_device()))

    def _check_device(self) -> torch.device:
        """The device, checked against the settings that need the CPU, then against this machine."""
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None  # not a device at all: `check_device` below says so
        if device is not None and device.type != "cpu":
            if self.attention_backend is AttentionBackend.CPP:
                raise ValueError(
                    f"attention_backend 'cpp' is the C++ kernel, which runs on the CPU only, but device is "
                    f"{str(self.device)!r}; use attention_backend 'torch' (or 'auto', which picks torch off the CPU)"
                )
            if self.prepack_weights:
                raise ValueError(
                    f"prepack_weights lays the weights out for oneDNN on the CPU, but device is "
                    f"{str(self.device)!r}; leave prepack_weights off there"
                )
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    f"tensor_parallel_size {self.tensor_parallel_size} runs its ranks on the CPU (over gloo), "
                    f"but device is {str(self.device)!r}; use device 'cpu' or tensor_parallel_size 1"
                )
        return check_device(self.device)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """A config from keyword arguments; an unknown name is a `TypeError` that suggests the right one."""
        known = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the settings are {', '.join(known)}"
                raise TypeError(f"unknown engine setting {name!r}{hint}")
        return cls(**kwargs)

    def resolve(self, model: ModelConfig, dtype: torch.dtype = torch.float32) -> EngineConfig:
        """This config with every open size filled in for ``model``; checks what depends on the model."""
        check_shardable(model, self.tensor_parallel_size)
        max_model_len = self.max_model_len or model.max_seq_len
        if max_model_len > model.max_seq_len:
            raise ValueError(
                f"max_model_len {max_model_len} is more than the model's max_seq_len {model.max_seq_len}; "
                "lower it or leave it unset"
            )
        num_blocks = self.num_blocks
        if num_blocks is None:
            bytes_per_block = kv_cache_bytes(model, self.block_size, dtype)
            want = cdiv(self.max_num_seqs * max_model_len, self.block_size)
            fit = DEFAULT_KV_MEMORY // bytes_per_block
            num_blocks = max(min(want, fit), cdiv(max_model_len, self.block_size))
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_CHUNKED_BUDGET
            if not self.enable_chunked_prefill:
                budget = max(max_model_len, DEFAULT_CHUNKED_BUDGET)
        elif not self.enable_chunked_prefill and budget < max_model_len:
            # Without chunked prefill a step must compute a whole request: a preempted request is
            # recomputed in one step, prompt and output, so no request may grow past the budget.
            if self.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {max_model_len} is more than max_num_batched_tokens {budget}: without "
                    "chunked prefill a request is (re)computed in one step, so it may hold at most the step's "
                    "budget; raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
                )
            max_model_len = budget
        return dataclasses.replace(
            self, max_model_len=max_model_len, num_blocks=num_blocks, max_num_batched_tokens=budget
        )

    # -- the command line -------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field (``--block-size``, ``--enable-prefix-caching/--no-enable-...``)."""
        group = parser.add_argument_group("engine")
        helps = _field_comments(cls)
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _field_type(f)
            help_ = helps.get(f.name, "")
            if kind is SpeculativeConfig:
                group.add_argument(flag, default=None, metavar="JSON", help=help_)
            elif kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
            elif issubclass(kind, enum.Enum):
                choices = [c.value for c in kind]
                group.add_argument(flag, choices=choices, default=f.default.value, help=help_)
            elif kind is str:
                group.add_argument(flag, default=f.default, help=f"{help_} (default {f.default})")
            else:
                default = "" if f.default is None else f" (default {f.default})"
                group.add_argument(flag, type=int, default=f.default, help=help_ + default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _field_type(f: dataclasses.Field) -> type:
    """The field's type with ``| None`` taken off (the annotations are strings under __future__)."""
    hint = typing.get_type_hints(EngineConfig)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if isinstance(hint, types.UnionType) else hint


def _optional(f: dataclasses.Field) -> bool:
    return isinstance(typing.get_type_hints(EngineConfig)[f.name], types.UnionType)


def _field_comments(cls: type) -> dict[str, str]:
    """The comment at the end of each field's line in the class source: the help of its flag."""
    source = inspect.getsource(cls)
    comments = {
        tok.start[0]: tok.string.lstrip("# ").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            # a long field is wrapped by the formatter: its comment sits on a later line of the statement
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            found = [comments[i] for i in lines if i in comments]
            if found:
                out[node.target.id] = found[0]
    return out
