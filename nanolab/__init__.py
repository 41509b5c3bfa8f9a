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
from nanolab._version import __version__
from nanolab.errors import NanolabError, OutOfBlocksError
from nanolab.memory.block_allocator import BlockAllocator, BlockAllocatorProtocol, PyBlockAllocator

_LAZY = {
    "LLM": "nanolab.engine.llm",
    "SamplingParams": "nanolab.model.sampling",
    "TokenLogprob": "nanolab.model.sampling",
    "RequestOutput": "nanolab.engine.outputs",
    "CompletionOutput": "nanolab.engine.outputs",
    "Engine": "nanolab.engine.engine",
    "EngineConfig": "nanolab.engine.config",
    "Tokenizer": "nanolab.text.tokenizer",
    "Transformer": "nanolab.model.transformer",
    "ModelConfig": "nanolab.model.config",
    "load_model": "nanolab.model.loading",
    "load_tokenizer": "nanolab.model.loading",
    "save_model": "nanolab.model.loading",
    "generate": "nanolab.model.generate",
    "RadixCache": "nanolab.memory.radix_cache",
    "PrefixCacheProtocol": "nanolab.memory.prefix_cache",
    "SchedulerProtocol": "nanolab.engine.scheduler",
    "KVCacheProtocol": "nanolab.model.kv_cache",
}

if TYPE_CHECKING:
    from nanolab.engine.config import EngineConfig
    from nanolab.engine.engine import Engine
    from nanolab.engine.llm import LLM
    from nanolab.engine.outputs import CompletionOutput, RequestOutput
    from nanolab.engine.scheduler import SchedulerProtocol
    from nanolab.memory.prefix_cache import PrefixCacheProtocol
    from nanolab.memory.radix_cache import RadixCache
    from nanolab.model.config import ModelConfig
    from nanolab.model.generate import generate
    from nanolab.model.kv_cache import KVCacheProtocol
    from nanolab.model.loading import load_model, load_tokenizer, save_model
    from nanolab.model.sampling import SamplingParams, TokenLogprob
    from nanolab.model.transformer import Transformer
    from nanolab.text.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nanolab' has no attribute {name!r}")


__all__ = [
    "HAS_C",
    "__version__",
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
    "TokenLogprob",
    "Tokenizer",
    "Transformer",
    "backend",
    "generate",
    "load_model",
    "load_tokenizer",
    "save_model",
]
assert set(_LAZY) <= set(__all__)
