"""The engine on a torch device (`EngineConfig.device`): the model, the KV pool and every tensor of a step
live there, and a device this machine cannot run on is refused before anything is loaded.

Most machines that run these tests have no GPU, so the key test catches a forgotten device on the CPU
alone: it makes "meta" torch's default device, and has `torch.from_numpy` (which always makes a CPU
tensor) make meta tensors too, then runs an engine with ``device="cpu"``. A tensor that the engine creates
without naming its device lands on meta, and the step fails (meta tensors hold no values and do not mix
with CPU ones): exactly the tensor that would have stayed on the CPU next to a CUDA model. The CUDA
tests run where torch finds a GPU and skip otherwise.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers.engine_utils import compare_greedy, noisy_copy, random_prompts, reference_greedy, tiny_model

from nanolab.engine.config import EngineConfig
from nanolab.engine.device import DeviceUnavailableError, check_device
from nanolab.engine.llm import LLM
from nanolab.memory import attention_backends
from nanolab.memory.paged_kv_cache import PagedKVCache
from nanolab.model.sampling import SamplingParams

VOCAB = 96
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=11, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def draft(model):
    return noisy_copy(model)


# Requests that reach every tensor a step makes: long prompts in chunks, a shared prefix, greedy and seeded
# sampling (top-k, top-p, min-p), logit bias and penalties, logprobs of output and prompt, and n = 2
# samples (a shared last block, so a copy-on-write). Made once, before any test changes the default device.
PROMPTS = [*random_prompts(6, VOCAB, 9, 40, seed=3, shared=8), [5, 6, 7, 8] * 6]  # the last repeats itself
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PARAMS = [
    GREEDY,
    SamplingParams(max_tokens=10, temperature=0.9, top_k=8, top_p=0.9, min_p=0.02, seed=1, ignore_eos=True),
    SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={3: 2.0, 4: -5.0},
    ),
    SamplingParams(max_tokens=10, temperature=0.8, seed=5, n=2, ignore_eos=True, prompt_logprobs=1),
    SamplingParams(max_tokens=10, temperature=1.0, seed=9, ignore_eos=True, logprobs=0),
    GREEDY,
    SamplingParams(max_tokens=10, temperature=0.7, seed=2, ignore_eos=True),
]  # fmt: skip


# chunked prefill (8 tokens a step) and a pool too small for every request at once (preemption)
SMALL = dict(block_size=4, num_blocks=24, max_num_batched_tokens=8, max_num_seqs=4)
SETTINGS = {
    "auto": dict(SMALL),
    "torch-attention": dict(SMALL, attention_backend="torch"),  # what runs on CUDA
    "ngram": dict(SMALL, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    "draft-model": dict(SMALL, speculative_config="draft"),
}


def run(model, settings: dict, draft=None, device: str = "cpu") -> tuple[list, LLM]:
    """The workload's outputs, all they say (tokens, text, logprobs of output and prompt), and the `LLM`."""
    settings = dict(settings)
    if settings.get("speculative_config") == "draft":
        settings["speculative_config"] = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": 3,
        }
    llm = LLM(model, device=device, **settings)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    seen = [
        (o.prompt_logprobs, [(c.token_ids, c.text, c.logprobs, c.finish_reason) for c in o.outputs])
        for o in outs
    ]
    return seen, llm


FROM_NUMPY = torch.from_numpy


def meta_from_numpy(array: np.ndarray) -> torch.Tensor:
    """What `torch.from_numpy` would give if it followed the default device: a meta tensor."""
    return FROM_NUMPY(array).to("meta")


@pytest.mark.parametrize("name", list(SETTINGS))
def test_no_tensor_of_a_step_is_left_on_the_default_device(model, draft, name, monkeypatch):
    """With "meta" as torch's default device, an engine on ``device="cpu"`` gives exactly the outputs it
    gives without: every tensor it makes (the pool, each step's ids, positions, slots, block tables,
    context lengths, masks, sampling parameters, penalties, random numbers, a draft model's inputs) names
    its device."""
    expected, llm = run(model, SETTINGS[name], draft)
    stats = llm.stats()
    assert stats.preemptions > 0, "the workload should preempt (a smaller pool)"
    if name in ("ngram", "draft-model"):
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    monkeypatch.setattr(torch, "from_numpy", meta_from_numpy)
    torch.set_default_device("meta")
    try:
        assert torch.empty(1).is_meta and torch.from_numpy(np.zeros(1)).is_meta  # the trap is set
        got, llm = run(model, SETTINGS[name], draft)
    finally:
        torch.set_default_device(None)
        monkeypatch.setattr(torch, "from_numpy", FROM_NUMPY)
    assert got == expected
    assert llm.engine.kv_cache.k[0].device.type == "cpu"


# -- the setting ----------------------------------------------------------------------------------------


def test_the_default_device_is_the_cpu_and_any_torch_device_spelling_is_accepted():
    assert EngineConfig().device == "cpu"
    assert EngineConfig(device=torch.device("cpu")).device == "cpu"
    assert check_device("cpu") == torch.device("cpu")


def test_an_unknown_device_is_refused_with_the_accepted_spellings():
    for bad in ("gpu", "cuda:x", "", 3.5):
        with pytest.raises(ValueError, match=r"is not a torch device; use 'cpu', 'cuda' or 'cuda:N'"):
            EngineConfig(device=bad)
    with pytest.raises(ValueError, match="'meta' holds no values"):
        EngineConfig(device="meta")


def test_the_cpp_attention_backend_is_refused_off_the_cpu():
    """The C++ kernel runs on the CPU only; that is said before CUDA's availability is even checked."""
    with pytest.raises(
        ValueError, match="C\\+\\+ kernel, which runs on the CPU only.*'auto', which picks torch"
    ):
        EngineConfig(device="cuda", attention_backend="cpp")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 runs its ranks on the CPU"):
        EngineConfig(device="cuda:0", tensor_parallel_size=2)
    assert EngineConfig(device="cpu", attention_backend="cpp").attention_backend.value == "cpp"


def test_cuda_without_cuda_says_why(monkeypatch):
    """Without CUDA in this build of torch, or without a GPU, ``device="cuda"`` is refused and says which."""
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceUnavailableError, match="this build of torch .* has no CUDA support"):
        EngineConfig(device="cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="needs a CUDA GPU, but torch finds none"):
        EngineConfig(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceUnavailableError, match="names GPU 2, but this machine has 2"):
        EngineConfig(device="cuda:2")


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_llm_on_cuda_is_refused_before_the_model_is_loaded(tmp_path):
    with pytest.raises(ValueError, match="device 'cuda' needs"):
        LLM(tmp_path / "no-such-checkpoint", device="cuda")  # the config's error, not the missing files'


def test_auto_attention_takes_torch_off_the_cpu():
    """``auto`` sends a call to the C++ kernel only for CPU tensors; a cache off the CPU never batches its
    short chunks for the kernel."""
    q = torch.empty(1, 4, 8, device="meta")
    cache = torch.empty(2, 4, 2, 8, device="meta")
    assert attention_backends.resolve("auto", q, cache, cache) == "torch"
    meta_cache = PagedKVCache(tiny_model().config, 4, 4, device="meta")
    assert meta_cache.k[0].is_meta and not meta_cache._batch_short


# -- on CUDA --------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_greedy_on_cuda_equals_the_cpu_up_to_near_ties(spec, record_property):
    """Greedy outputs on CUDA equal the CPU reference's, except at a near-tie (the reference's top-two
    gap below `TIE_GAP`), where float rounding may pick either; the ties are counted and reported."""
    model = tiny_model("llama", seed=11, vocab_size=VOCAB)
    prompts = random_prompts(6, VOCAB, 5, 40, seed=7, shared=8)
    expected = [reference_greedy(model, p, 12) for p in prompts]
    settings: dict = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    if spec == "ngram":
        settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    elif spec == "draft":
        draft = noisy_copy(model)
        settings["speculative_config"] = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": 3,
        }
    llm = LLM(model, device="cuda", **settings)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    ties = sum(compare_greedy(t, g, o.outputs[0].token_ids) for (t, g), o in zip(expected, outs))
    record_property("near_ties", ties)
    print(f"near-ties where CUDA and the CPU reference may differ: {ties} of {len(prompts)} requests")


@needs_cuda
def test_the_model_and_the_kv_pool_are_on_cuda():
    model = tiny_model("llama", seed=11, vocab_size=VOCAB)
    draft = noisy_copy(model)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    llm = LLM(model, device="cuda", speculative_config=spec)
    engine = llm.engine
    assert engine.config.device == "cuda"
    assert all(p.device.type == "cuda" for p in llm.model.parameters())
    assert all(t.device.type == "cuda" for t in (*engine.kv_cache.k, *engine.kv_cache.v))
    proposer = engine.speculator.proposer
    assert all(p.device.type == "cuda" for p in proposer.model.parameters())
    assert proposer.kv_cache.k[0].device.type == "cuda"


@needs_cuda
def test_seeded_sampling_on_cuda_is_reproducible_and_matches_the_cpu(model):
    """Seeded requests draw their random numbers on the CPU from their own generator, so a seed gives the
    same tokens run after run on CUDA, and the CPU's tokens (the logits agree to float rounding)."""
    cpu, _ = run(model, SMALL)
    cuda_model = copy.deepcopy(model)  # LLM moves its model to the device; the fixture stays on the CPU
    first, _ = run(cuda_model, SMALL, device="cuda")
    again, _ = run(cuda_model, SMALL, device="cuda")
    tokens = [[c[0] for c in outs] for _, outs in first]
    assert tokens == [[c[0] for c in outs] for _, outs in again]
    assert tokens == [[c[0] for c in outs] for _, outs in cpu]
