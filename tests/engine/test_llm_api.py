"""The `LLM` API: prompt forms, ordering, text and streaming, stop conditions, seeds, plug-in components."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_utils import tiny_model

from nanolab import LLM, PyBlockAllocator, RadixCache, SamplingParams, Tokenizer
from nanolab.model.loading import save_model

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"
    "import os\nprint('hello world')\nfor i in range(10):\n    total += i * 2\n"
) * 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = Tokenizer.train(TEXT, 300, special_tokens=["<|endoftext|>"])
    model = tiny_model("llama", seed=5, vocab_size=tok.vocab_size, max_seq_len=256)
    return save_model(model, tmp_path_factory.mktemp("ckpt"), tok)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_prompt_forms_and_input_order(llm):
    prompts = ["def add", "import os", "class Stack:"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    one = llm.generate("import os", GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    ids = llm.tokenizer.encode("class Stack:")
    by_ids = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == ids and by_ids.outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(
        ["a", "b"],
        [SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=5, temperature=0)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [GREEDY] * 3)


def test_text_is_the_decoded_tokens_and_metrics_are_ordered(llm):
    out = llm.generate("for i in", GREEDY, use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == llm.tokenizer.decode(c.token_ids)
    assert c.finish_reason == "length" and out.finished
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    assert m.ttft >= 0 and m.time_per_output_token >= 0 and m.num_output_tokens == 12


def test_stop_string_cuts_the_text_before_it(llm):
    full = llm.generate(
        "def add", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    text = full.outputs[0].text
    stop = text[5:8]
    assert stop and stop in text
    out = llm.generate("def add", SamplingParams(max_tokens=30, temperature=0, stop=[stop]), use_tqdm=False)[
        0
    ]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == text[: text.index(stop)]


def test_stream_deltas_add_up_to_the_final_output(llm):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=["zzz"])
    pieces, ids, last = [], [], None
    for out in llm.stream(["print(", "total"], params):
        if out.prompt == "print(":
            pieces.append(out.outputs[0].delta_text)
            ids += out.outputs[0].delta_token_ids
            last = out
    assert last.finished
    assert "".join(pieces) == last.outputs[0].text
    assert ids == last.outputs[0].token_ids


def test_eos_finishes_unless_ignored(llm):
    probe = llm.generate("import", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    eos = probe[3]
    engine = llm.engine
    saved = engine.outputs.eos_token_ids
    engine.outputs.eos_token_ids = frozenset({eos})
    try:
        out = llm.generate("import", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids == probe[: probe.index(eos) + 1]
        ignored = llm.generate("import", GREEDY, use_tqdm=False)[0]
        assert ignored.outputs[0].token_ids == probe
    finally:
        engine.outputs.eos_token_ids = saved


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("class", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate(["x = 1", "class", "import os"], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_plugged_in_components_serve_the_same_output(checkpoint, llm):
    prompts = ["def add", "class Stack:", "def add(a, b)"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    custom = LLM(checkpoint, block_allocator=PyBlockAllocator, prefix_cache=RadixCache, block_size=4)
    got = [o.outputs[0].token_ids for o in custom.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert isinstance(custom.engine.block_manager.allocator, PyBlockAllocator)


def test_stats_report_the_run(checkpoint):
    llm = LLM(checkpoint)
    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False)
    st = llm.stats()
    assert st.generated_tokens == 36 and st.finished_requests == 3
    assert st.steps >= 12 and st.mean_batch_size > 1
    assert 0 < st.forward_fraction <= 1 and st.throughput > 0
    assert st.preemptions == 0 and 0 <= st.prefix_hit_rate <= 1


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1 is an empty list of token ids"):
        llm.generate(["fine", []], GREEDY)
    assert not llm.engine.has_unfinished()
    long = "x" * 10_000  # fine on its own type, but more tokens than max_model_len
    with pytest.raises(ValueError, match="prompt 1: the prompt has .* tokens"):
        llm.generate(["fine", long], GREEDY)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="mix text and token ids"):
        llm.generate(["fine", [1, 2]], GREEDY)
    assert not llm.engine.has_unfinished()


def test_model_in_memory_without_tokenizer_takes_token_ids():
    model = tiny_model("gpt2", seed=0)
    llm = LLM(model)
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].text is None and len(out.outputs[0].token_ids) == 12
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", GREEDY)
    assert torch.is_tensor(llm.model.tok_emb.weight)
