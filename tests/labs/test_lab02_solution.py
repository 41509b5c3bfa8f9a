"""Lab 2's solution against nanolab: the learner code's signatures, the setup's mirrors of the config and
sampling parameters, and the learner's cache inside the reference model."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.grading_utils import solution_namespace
from helpers.notebook_utils import parameters

ROOT = Path(__file__).resolve().parents[2]
LAB02 = "lab02_attention_kv_cache.ipynb"


def test_lab02_learner_code_has_the_reference_signatures():
    from nanolab.model import attention, kv_cache, sampling

    namespace = solution_namespace(LAB02)
    assert parameters(namespace["causal_attention"]) == parameters(attention.dense_causal_attention)
    assert parameters(namespace["kv_cache_bytes"]) == parameters(kv_cache.kv_cache_bytes)
    for name in ("filter_logits", "sample", "make_generator"):
        assert parameters(namespace[name]) == parameters(getattr(sampling, name)), name
    learner, reference = namespace["ContiguousKVCache"], kv_cache.ContiguousKVCache
    for method in ("__init__", "prepare", "attend", "reset"):
        assert parameters(getattr(learner, method)) == parameters(getattr(reference, method)), method


def test_lab02_setup_mirrors_the_reference_config_and_sampling_params():
    """The setup code's (`labkit.lab02`, the setup cell's text) SamplingParams has the reference's fields and defaults (those it has), and its
    ModelShape the reference config's fields and head_dim, so the same hidden tests fit both."""
    import dataclasses

    from labkit import lab02 as setup
    from nanolab.model.config import ModelConfig
    from nanolab.model.sampling import SamplingParams

    reference = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    mine = {f.name: f.default for f in dataclasses.fields(setup.SamplingParams)}
    assert mine.items() <= reference.items()
    with pytest.raises(ValueError, match="top_p"):
        setup.SamplingParams(top_p=0)
    assert setup.SamplingParams(temperature=0).greedy and not setup.SamplingParams().greedy
    shape_fields = {f.name for f in dataclasses.fields(setup.ModelShape)}
    assert shape_fields <= {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(n_layers=3, n_heads=6, n_kv_heads=2, d_model=48, max_seq_len=64)
    shape = setup.ModelShape(**{name: getattr(config, name) for name in shape_fields})
    assert shape.head_dim == config.head_dim
    assert setup.make_generator(None) is None


def test_lab02_learner_cache_plugs_into_the_reference_model():
    """The solution's cache is a KVCacheProtocol and, in a random model, gives nanolab.generate's greedy tokens."""
    import torch

    from nanolab.model.config import ModelConfig
    from nanolab.model.generate import generate
    from nanolab.model.kv_cache import KVCacheProtocol
    from nanolab.model.transformer import Transformer

    namespace = solution_namespace(LAB02)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=50, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=40)
    )
    model.eval()
    cache = namespace["ContiguousKVCache"](model.config, 30)
    assert isinstance(cache, KVCacheProtocol)
    assert cache.nbytes == namespace["kv_cache_bytes"](model.config, 30)
    prompt = [3, 14, 15, 9, 2]
    new, output = torch.tensor(prompt), []
    with torch.inference_mode():
        for _ in range(20):
            hidden = model(new, cache.prepare(len(new)), cache)
            output.append(int(model.compute_logits(hidden[-1:]).argmax()))
            new = torch.tensor(output[-1:])
    assert output == generate(model, None, prompt, max_new_tokens=20).token_ids
