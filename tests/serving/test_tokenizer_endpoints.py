"""vLLM's tokenizer endpoints (``/tokenize``, ``/detokenize``, ``/tokenizer_info``) and ``/v1/models/{id}``, on the
bundled model: what evaluation clients (lm-evaluation-harness' remote tokenizer) read of the served tokenizer."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from helpers.live_server import serve  # noqa: E402

from nanolab import LLM, SamplingParams  # noqa: E402
from nanolab.model.loading import ASSETS_DIR  # noqa: E402

TEXT = "def area(r):\n    return 3.14159 * r ** 2  # café ☕<|endoftext|>"
CHAT = [{"role": "system", "content": "Helpers for files."}, {"role": "user", "content": "Read a JSON file."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def server(llm):
    with serve(llm, "tinypy") as live:
        yield live


def test_tokenize_gives_the_served_tokenizers_ids_reading_special_tokens_as_themselves(server, llm) -> None:
    got = server.http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    want = llm.tokenizer.encode(TEXT, allowed_special="all")
    assert got["tokens"] == want and got["count"] == len(want)
    assert want[-1] == llm.tokenizer.eos_token_id  # "<|endoftext|>" in the text is the end-of-text token
    assert got["max_model_len"] == llm.engine.config.max_model_len
    assert len(got["token_strs"]) == len(want) and got["token_strs"][-1] == "<|endoftext|>"
    plain = server.http.post("/tokenize", json={"prompt": "x = 1", "add_special_tokens": False}).json()
    assert plain["tokens"] == llm.tokenizer.encode("x = 1") and plain["token_strs"] is None


def test_tokenize_renders_a_conversation_as_chat_completions_does(server, llm) -> None:
    got = server.http.post("/tokenize", json={"messages": CHAT}).json()
    offline = llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert got["tokens"] == offline.prompt_token_ids
    bare = server.http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    text = llm.chat_template.render(CHAT, add_generation_prompt=False)
    assert bare["tokens"] == llm.tokenizer.encode(text) != got["tokens"]


def test_detokenize_gives_back_the_text(server, llm) -> None:
    text = "import json\nwith open(path) as f:\n    data = json.load(f)  # naïve"
    ids = server.http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert server.http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    assert server.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenizer_info_is_what_a_remote_tokenizer_reads(server, llm) -> None:
    info = server.http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] is None and info["pad_token"] is None
    assert info["chat_template"] == (ASSETS_DIR / "tinypy" / "chat_template.jinja").read_text()
    assert info["model_max_length"] == llm.engine.config.max_model_len
    assert info["vocab_size"] == llm.tokenizer.vocab_size
    # lm-evaluation-harness takes the end-of-text id as the first id of its token's text
    eos = server.http.post(
        "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()
    assert eos["tokens"] == [llm.tokenizer.eos_token_id]


def test_one_model_is_retrieved_by_its_id_and_another_is_a_404(server) -> None:
    card = server.client.models.retrieve("tinypy")
    assert card.id == "tinypy" and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.models.retrieve("gpt-17")


BAD = {
    "prompt and messages": ({"prompt": "a", "messages": CHAT}, "prompt", "not both"),
    "neither": ({"add_special_tokens": True}, "prompt", "either"),
    "prompt not a string": ({"prompt": [1, 2]}, "prompt", "must be a string"),
    "add_special_tokens not a bool": (
        {"prompt": "a", "add_special_tokens": 1},
        "add_special_tokens",
        "true or false",
    ),
    "return_token_strs not a bool": (
        {"prompt": "a", "return_token_strs": "yes"},
        "return_token_strs",
        "true or",
    ),
    "bad messages": ({"messages": [{"role": "user"}]}, "messages", "content"),
    "bad add_generation_prompt": (
        {"messages": CHAT, "add_generation_prompt": "no"},
        "add_generation_prompt",
        "",
    ),
    "unknown model": ({"prompt": "a", "model": "gpt-17"}, "model", "unknown model"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_tokenize_bodies_get_400_naming_the_field(server, case) -> None:
    body, param, words = BAD[case]
    r = server.http.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "tokens, words",
    [
        ("1 2", "list of token ids"),
        ([1, True], "list of token ids"),
        ([1, 10**9], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
    ],  # fmt: skip
    ids=["a string", "a bool", "beyond the vocabulary", "negative"],
)
def test_bad_detokenize_bodies_get_400_naming_the_tokens(server, tokens, words) -> None:
    r = server.http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert words in r.json()["error"]["message"]


def test_a_model_without_a_tokenizer_says_so(llm) -> None:
    with serve(LLM(llm.model), "ids-only") as live:
        for method, path, body in [
            ("POST", "/tokenize", {"prompt": "a"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", "/tokenizer_info", None),
        ]:
            r = live.http.request(method, path, json=body)
            assert r.status_code == 400 and "has no tokenizer" in r.json()["error"]["message"], path
