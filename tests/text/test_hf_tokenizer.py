"""A Hugging Face checkpoint's tokenizer.json behind nanolab's tokenizer interface, held to transformers.

The checkpoint is built offline: a byte-level BPE tokenizer trained with the `tokenizers` library on
Python's own source, saved with ``transformers`` next to a tiny random Llama (and a ChatML chat
template). Every expectation is what ``transformers`` gives on the same directory: its tokenizer's
ids and text, its greedy ``generate``, its ``apply_chat_template``.
"""

from __future__ import annotations

import inspect
import json
import random
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from helpers.hf_models import tiny_hf_model  # noqa: E402
from helpers.live_server import serve  # noqa: E402

from nanolab import LLM, SamplingParams, load_tokenizer  # noqa: E402
from nanolab.text.hf_tokenizer import HFTokenizer, unicode_to_bytes  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: the trainer puts them first
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = ["def main():\n", "import os", "class Parser(object):", "    return self.", "x = {'naïve': 1}  # é"]
TEXTS = [
    *PROMPTS,
    "",
    "    for line in text.splitlines(True):\n        yield line  \t\n",
    "naïve café, ∑ 😀 — «ünïcödé»",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "  two spaces, <|im_end|>glued<|endoftext|>",
]


def train_byte_level_bpe(vocab_size: int = 320):
    """GPT-2-style byte-level BPE, trained on two standard-library modules (about a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([inspect.getsource(json), inspect.getsource(textwrap)], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A Hugging Face checkpoint directory: tiny Llama + trained tokenizer + ChatML template, EOS id 0."""
    path = tmp_path_factory.mktemp("hf") / "tiny"
    tok = train_byte_level_bpe()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    model = tiny_hf_model(
        "llama", vocab_size=tok.get_vocab_size(), max_position_embeddings=128, eos_token_id=0
    )
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint).float().eval()


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, block_size=4)


def same_text(got: str, hf_text: str) -> bool:
    """Equal, but for a character that the last tokens leave unfinished: transformers writes U+FFFD for
    it, the engine keeps it back (a later token might have finished it). A random model's output often
    ends with a stray byte."""
    return got == hf_text or (hf_text.endswith("\ufffd") and got == hf_text[:-1])


def hf_greedy(model, ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(ids) :].tolist()


# ---- the tokenizer ------------------------------------------------------------------------------


def test_load_tokenizer_reads_tokenizer_json_of_a_hf_checkpoint(checkpoint) -> None:
    tok = load_tokenizer(checkpoint)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 320
    assert tok.special_tokens == {t: i for i, t in enumerate(SPECIALS)}
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 0)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(llm, hf_tok, text) -> None:
    ids = llm.tokenizer.encode(text, allowed_special="all")
    assert ids == hf_tok(text)["input_ids"]
    assert llm.tokenizer.decode(ids) == hf_tok.decode(ids) == text


def test_the_bytes_of_each_token_add_up_to_the_decoded_text(llm, checkpoint) -> None:
    """The engine detokenizes from a table of each token's bytes; joined, they decode as tokenizers does."""
    rust = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tok = llm.tokenizer
    rng = random.Random(0)
    for _ in range(300):  # many cut a character in two: both then write U+FFFD for its bytes
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        data = b"".join(tok.decode_bytes([i]) for i in ids)
        assert data == tok.decode_bytes(ids)
        assert tok.decode(ids) == rust.decode(ids, skip_special_tokens=False), ids


def test_unicode_to_bytes_is_gpt2s_byte_alphabet() -> None:
    table = unicode_to_bytes()
    assert sorted(table.values()) == list(range(256))
    assert set(table) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())


def test_special_tokens_in_the_text_follow_allowed_special(llm) -> None:
    tok, text = llm.tokenizer, "a<|im_start|>b<|endoftext|>"
    with pytest.raises(ValueError, match=r"special token '<\|endoftext\|>'.*allowed_special"):
        tok.encode(text)
    with pytest.raises(ValueError, match="im_start"):
        tok.encode(text, allowed_special={"<|endoftext|>"})
    some = tok.encode(text, allowed_special={"<|im_start|>", "<|endoftext|>"})
    assert some == tok.encode(text, allowed_special="all") and {1, 0} <= set(some)
    plain = tok.encode(text, allowed_special="none")
    assert not set(plain) & {0, 1, 2} and tok.decode(plain) == text
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode(text, allowed_special={"<|nope|>"})


def test_eos_comes_from_generation_config_then_config_then_tokenizer_config(checkpoint, tmp_path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, d / name)
    assert load_tokenizer(d).eos_token_ids == (0,)  # tokenizer_config.json's eos_token
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    assert load_tokenizer(d).eos_token_ids == (2,)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tok = load_tokenizer(d)
    assert (tok.eos_token_ids, tok.eos_token_id) == ((2, 1), 2)
    assert tok.eos_token == "<|endoftext|>"  # the tokenizer's own, as a chat template writes it
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "end"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
        load_tokenizer(d)


def test_a_sentencepiece_style_tokenizer_keeps_each_tokens_spaces_and_bytes() -> None:
    """Llama 2's kind: ``▁`` for a space, ``<0x..>`` byte tokens for what the vocabulary lacks. Token by
    token the text is tokenizers' decode, except the space the tokenizer put before the first word."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    text = inspect.getsource(json)
    spaced = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    plain = Tokenizer(models.BPE())
    plain.normalizer = spaced
    plain.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    trained = json.loads(plain.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    sp = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    sp.normalizer = spaced
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok = HFTokenizer(sp, bos_token="<s>", eos_token="</s>")
    assert (tok.eos_token_id, tok.bos_token_id) == (2, 1)
    for s in TEXTS[:8]:
        ids = tok.encode(s, allowed_special="all")
        assert tok.decode(ids) == " " + sp.decode(ids) if s else tok.decode(ids) == ""
    assert tok.decode_bytes([3 + 0xE2]) == b"\xe2"  # a byte token alone is that byte


# ---- generation ---------------------------------------------------------------------------------


def test_llm_text_in_text_out_equals_transformers_greedy(llm, hf_tok, hf_model) -> None:
    prompts = PROMPTS[::2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = hf_tok(prompt)["input_ids"]
        expected = hf_greedy(hf_model, ids, 16)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == expected, prompt
        assert same_text(out.outputs[0].text, hf_tok.decode(expected, skip_special_tokens=True))


def test_every_eos_of_the_generation_config_stops_as_in_transformers(checkpoint, hf_tok, hf_model, tmp_path):
    """Where the generation config lists several EOS ids, any of them ends the output, in both engines."""
    ids = hf_tok(PROMPTS[1])["input_ids"]
    probe = hf_greedy(hf_model, ids, 24)
    stop = next(t for t in probe[3:] if t not in probe[:3])  # a token first produced mid-way
    path = tmp_path / "two-eos"
    shutil.copytree(checkpoint, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, stop]}))
    out = LLM(path).generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    expected = hf_greedy(hf_model, ids, 24, eos_token_id=[0, stop])
    assert out.outputs[0].token_ids == expected == probe[: probe.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_chat_renders_and_generates_as_transformers(llm, hf_tok, hf_model) -> None:
    conversation = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Parse a JSON file."},
    ]
    text = hf_tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    out = llm.chat(conversation, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == ids
    expected = hf_greedy(hf_model, ids, 16)
    assert out.outputs[0].token_ids == expected
    assert same_text(out.outputs[0].text, hf_tok.decode(expected, skip_special_tokens=True))


# ---- through the server -------------------------------------------------------------------------


def test_the_server_answers_text_prompts_and_chat_as_transformers(llm, hf_tok, hf_model) -> None:
    with serve(llm) as server:
        for prompt in PROMPTS[:2]:
            expected = hf_greedy(hf_model, hf_tok(prompt)["input_ids"], 12)
            got = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            assert same_text(got.choices[0].text, hf_tok.decode(expected, skip_special_tokens=True))
            stream = server.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in stream) == got.choices[0].text
        messages = [{"role": "user", "content": "Sort a list."}]
        text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = hf_greedy(hf_model, hf_tok(text, add_special_tokens=False)["input_ids"], 12)
        reply = server.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
        assert same_text(reply.choices[0].message.content, hf_tok.decode(expected, skip_special_tokens=True))


def test_the_tokenizer_endpoints_answer_as_transformers(checkpoint, tmp_path) -> None:
    """/tokenize adds what the tokenizer's post-processor adds (here a start token) unless told not to (a
    conversation: never), /detokenize decodes, and /tokenizer_info names the tokenizer's own special tokens."""
    from tokenizers import Tokenizer, processors

    path = tmp_path / "with-bos"
    shutil.copytree(checkpoint, path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    start = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", start)]
    )
    tok.save(str(path / "tokenizer.json"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    assert hf_tok("x = 1")["input_ids"][0] == start  # the post-processor adds it
    messages = [{"role": "user", "content": "Sort a list."}]
    with serve(LLM(path, block_size=4)) as server:
        for prompt in PROMPTS[:2]:
            got = server.http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
            assert got == hf_tok(prompt)["input_ids"]
            bare = server.http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
            assert bare["tokens"] == hf_tok(prompt, add_special_tokens=False)["input_ids"]
            text = server.http.post("/detokenize", json={"tokens": bare["tokens"]}).json()["prompt"]
            assert same_text(text, hf_tok.decode(bare["tokens"], skip_special_tokens=True))
        chat = server.http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat == hf_tok(rendered, add_special_tokens=False)["input_ids"]
        info = server.http.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == (hf_tok.eos_token, hf_tok.bos_token)
    assert info["chat_template"] == hf_tok.chat_template
