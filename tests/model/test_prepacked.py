"""oneDNN layouts of the weights (`EngineConfig.prepack_weights`): used only where an engine activates
them, for products of 3 rows or more (fewer go through nanolab._C.linear_rows), never once a weight has
changed; the engine keeps them to itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.engine_utils import random_prompts, tiny_model

from nanolab.engine.config import EngineConfig
from nanolab.engine.llm import LLM
from nanolab.model import prepacked
from nanolab.model.prepacked import HAS_KERNEL, KERNEL_MAX_ROWS, Prepacked, linear
from nanolab.model.sampling import SamplingParams

needs_onednn = pytest.mark.skipif(not prepacked.available(), reason="this build of torch lacks oneDNN")


def weights(seed: int = 0, n_in: int = 48, n_out: int = 80):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(n_out, n_in, generator=g) * 0.2), torch.randn(n_out, generator=g)


def reference(x, w, b, gelu):
    y = F.linear(x, w, b)
    return F.gelu(y, approximate="tanh") if gelu else y


@pytest.fixture
def onednn_calls(monkeypatch):
    """How many products went through oneDNN's prepacked call."""
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return calls


@pytest.mark.parametrize("gelu", [False, True])
def test_linear_is_f_linear_where_no_layout_is_active(gelu):
    w, b = weights()
    x = torch.randn(16, 48)
    assert torch.equal(linear(x, w, b, gelu=gelu), reference(x, w, b, gelu))
    assert torch.equal(linear(x, w, gelu=gelu), reference(x, w, None, gelu))


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many products went through nanolab._C.linear_rows."""
    calls = []
    real = prepacked._linear_rows

    def spy(x, weight, bias):
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(prepacked, "_linear_rows", spy)
    return calls


@needs_onednn
@pytest.mark.parametrize("gelu", [False, True])
def test_an_active_layout_serves_products_of_3_rows_or_more_and_the_kernel_fewer(
    gelu, onednn_calls, kernel_calls
):
    w, b = weights()
    packed = Prepacked([w])
    rows = [1, 2, 3, 4, 5, 16, 64]
    with packed.active(), torch.no_grad():  # as in the engine's steps: no gradient wanted
        for n in rows:
            x = torch.randn(n, 48)
            got = linear(x, w, b, gelu=gelu)
            torch.testing.assert_close(got, reference(x, w, b, gelu), atol=1e-5, rtol=1e-5)
            if n <= KERNEL_MAX_ROWS and HAS_KERNEL:
                y = prepacked._ext._C.linear_rows(x.numpy(), w.detach().numpy(), b.numpy(), 1)
                want = torch.from_numpy(y)
                assert torch.equal(got, F.gelu(want, approximate="tanh") if gelu else want)
        other, _ = weights(seed=1)  # a weight it did not lay out
        linear(torch.randn(8, 48), other, b)
        linear(torch.randn(1, 48), other, b)
    assert KERNEL_MAX_ROWS == 2
    kernel_rows = [n for n in rows if n <= KERNEL_MAX_ROWS] if HAS_KERNEL else []
    assert kernel_calls == kernel_rows
    assert onednn_calls == [n for n in rows if n not in kernel_rows]


@needs_onednn
def test_the_kernel_takes_only_what_it_reads_in_place(onednn_calls, kernel_calls):
    """Rows or a bias that are not contiguous: oneDNN's call, with the bias made contiguous (oneDNN reads a
    strided bias as if it were not)."""
    w, b = weights()
    with Prepacked([w]).active(), torch.no_grad():
        x = torch.randn(48, 2).t()  # (2, 48), not contiguous
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        x, b = torch.randn(1, 48), torch.randn(160)[::2]
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert kernel_calls == []
    assert onednn_calls == [2, 1]


@needs_onednn
def test_a_weight_changed_after_it_was_laid_out_is_read_as_it_is_now(onednn_calls):
    w, b = weights()
    packed = Prepacked([w])
    x = torch.randn(8, 48)
    with torch.no_grad():
        w.mul_(2)  # in place: its version counter moves
    with packed.active(), torch.no_grad():
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    w.data = torch.randn(80, 48)  # new storage under the same parameter
    with packed.active(), torch.no_grad():
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert onednn_calls == []


@needs_onednn
def test_a_product_whose_gradient_is_wanted_goes_through_f_linear(onednn_calls):
    w, b = weights()
    x = torch.randn(8, 48, requires_grad=True)
    with Prepacked([w]).active():
        linear(x, w, b, gelu=True).sum().backward()  # oneDNN's call would leave w.grad None
        with torch.no_grad():
            linear(x, w, b)  # no gradient wanted: the layout
    got = w.grad.clone()
    w.grad = None
    reference(x.detach(), w, b, True).sum().backward()
    torch.testing.assert_close(got, w.grad)
    assert onednn_calls == [8]


@needs_onednn
def test_an_engine_takes_a_model_made_under_inference_mode():
    with torch.inference_mode():
        model = tiny_model("gpt2", seed=4)
    prompts = random_prompts(3, model.config.vocab_size, 4, 9, seed=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    packed = LLM(model, None, block_size=4, prepack_weights=True).generate(prompts, params, use_tqdm=False)
    plain = LLM(model, None, block_size=4).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in packed] == [o.outputs[0].token_ids for o in plain]


@needs_onednn
@pytest.mark.skipif(not HAS_KERNEL, reason="the C++ kernels are not built")
def test_a_decode_at_batch_1_goes_through_the_kernel(kernel_calls, onednn_calls):
    model = tiny_model("gpt2", seed=6)
    prompt = random_prompts(1, model.config.vocab_size, 6, 7, seed=3)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    packed = LLM(model, None, block_size=4, prepack_weights=True).generate(prompt, params, use_tqdm=False)
    # the prefill's logits (one row), then 4 decode steps, each through the layers' 4 products and the logits
    assert kernel_calls == [1] * (1 + 4 * (4 * model.config.n_layers + 1))
    assert onednn_calls and all(rows >= 6 for rows in onednn_calls)  # the prefill's layers
    plain = LLM(model, None, block_size=4).generate(prompt, params, use_tqdm=False)
    assert packed[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


@needs_onednn
def test_layouts_are_made_for_float32_cpu_matrices_only():
    with pytest.raises(ValueError, match=r"float32 matrices on the CPU, got a torch.float64 tensor"):
        Prepacked([torch.zeros(4, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        Prepacked([torch.zeros(4)])


def test_the_setting_is_refused_where_it_cannot_apply():
    with pytest.raises(
        ValueError, match="prepack_weights lays the weights out for oneDNN on the CPU, but device is 'cuda'"
    ):
        EngineConfig(prepack_weights=True, device="cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size is 2; leave prepack_weights off"):
        EngineConfig(prepack_weights=True, tensor_parallel_size=2)


@needs_onednn
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_an_engine_uses_its_layouts_in_its_own_steps_only(arch, onednn_calls):
    model = tiny_model(arch, seed=3)
    llm = LLM(model, None, block_size=4, prepack_weights=True)
    runner = llm.engine.runner
    assert len(runner.prepacked) == 4 * model.config.n_layers + 1  # q/k/v, out, the MLP's two; the logits'
    prompts = random_prompts(6, model.config.vocab_size, 4, 12, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    packed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert onednn_calls, "no product of the engine's steps went through the layouts"
    calls = len(onednn_calls)
    # The same model object, outside the engine's steps and in another engine: F.linear.
    x = torch.randn(8, model.config.d_model)
    qkv = model.layers[0].attn.qkv
    assert torch.equal(linear(x, qkv.weight, qkv.bias), F.linear(x, qkv.weight, qkv.bias))
    plain = [
        o.outputs[0].token_ids
        for o in LLM(model, None, block_size=4).generate(prompts, params, use_tqdm=False)
    ]
    assert len(onednn_calls) == calls
    assert packed == plain  # this model's logits are spread out: no near-ties to flip
