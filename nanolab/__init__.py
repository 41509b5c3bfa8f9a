"""nanolab: a small, complete LLM serving engine, and a lab workbook that has you build one.

    from nanolab import LLM, SamplingParams
    llm = LLM()                                   # the bundled model, trained on Python's own source
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=48, temperature=0))
    print(out[0].outputs[0].text)

The public names below are imported lazily, so ``import nanolab`` stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from nanolab._ext import HAS_C, backend
from nanolab.block_allocator import BlockAllocatorProtocol, PyBlockAllocator
from nanolab.errors import NanolabError, OutOfBlocksError

if HAS_C:
    from nanolab._ext import _C

    BlockAllocator = _C.BlockAllocator
else:
    BlockAllocator = PyBlockAllocator

__version__ = "0.1.0"

_LAZY = {
    "LLM": "nanolab.llm",
    "SamplingParams": "nanolab.sampling",
    "RequestOutput": "nanolab.request",
    "CompletionOutput": "nanolab.request",
    "Engine": "nanolab.engine",
    "EngineConfig": "nanolab.engine",
    "Tokenizer": "nanolab.tokenizer",
    "Transformer": "nanolab.model",
    "ModelConfig": "nanolab.model",
    "load_model": "nanolab.loading",
    "load_tokenizer": "nanolab.loading",
    "save_model": "nanolab.loading",
    "generate": "nanolab.generate",
    "RadixCache": "nanolab.radix_cache",
    "PrefixCacheProtocol": "nanolab.prefix_cache",
    "SchedulerProtocol": "nanolab.scheduler",
    "KVCacheProtocol": "nanolab.kv_cache",
}

if TYPE_CHECKING:
    from nanolab.engine import Engine, EngineConfig
    from nanolab.generate import generate
    from nanolab.kv_cache import KVCacheProtocol
    from nanolab.llm import LLM
    from nanolab.loading import load_model, load_tokenizer, save_model
    from nanolab.model import ModelConfig, Transformer
    from nanolab.prefix_cache import PrefixCacheProtocol
    from nanolab.radix_cache import RadixCache
    from nanolab.request import CompletionOutput, RequestOutput
    from nanolab.sampling import SamplingParams
    from nanolab.scheduler import SchedulerProtocol
    from nanolab.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nanolab' has no attribute {name!r}")


__all__ = [
    "HAS_C",
    "LLM",
    "BlockAllocator",
    "BlockAllocatorProtocol",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "KVCacheProtocol",
    "ModelConfig",
    "NanolabError",
    "OutOfBlocksError",
    "PrefixCacheProtocol",
    "PyBlockAllocator",
    "RadixCache",
    "RequestOutput",
    "SamplingParams",
    "SchedulerProtocol",
    "Tokenizer",
    "Transformer",
    "backend",
    "generate",
    "load_model",
    "load_tokenizer",
    "save_model",
]
assert set(_LAZY) <= set(__all__)
