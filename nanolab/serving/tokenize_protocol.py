"""vLLM's tokenizer endpoints on the wire, which evaluation and load-testing clients use to count and
cut text with the served model's own tokenizer (lm-evaluation-harness' remote tokenizer reads them).

``POST /tokenize``: ``{"prompt": "text"}`` or ``{"messages": [...]}`` (a conversation, rendered with the
model's chat template; ``add_generation_prompt`` and ``chat_template_kwargs`` as for chat completions),
with ``add_special_tokens`` (default true for a prompt, false for messages: a chat template writes its
own) and ``return_token_strs``. Special tokens written in the text (``<|endoftext|>``) are read as
themselves, as Hugging Face tokenizers read them. Answer: ``{"count", "max_model_len", "tokens",
"token_strs"}``.

``POST /detokenize``: ``{"tokens": [ids]}`` → ``{"prompt": "text"}``.

``GET /tokenizer_info``: the tokenizer's class, its ``eos_token``, ``bos_token`` and ``pad_token`` (null
when it has none), the chat template's source (null without one), ``model_max_length`` (the server's
``max_model_len``) and ``vocab_size``.

Errors are OpenAI-style 400s naming the field, as on the other endpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanolab.serving.chat_protocol import parse_template_options
from nanolab.serving.openai_protocol import InvalidRequest, check_body_and_model, flag, unknown_fields
from nanolab.text.chat_template import ChatTemplateError, Message, normalize_messages

TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "return_token_strs",
        "add_generation_prompt",
        "chat_template_kwargs",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None  # the text to tokenize, or None for a conversation
    messages: list[Message] | None
    add_special_tokens: bool
    return_token_strs: bool
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] | None = None
    ignored: tuple[str, ...] = ()


def parse_tokenize_request(body: Any, model_name: str) -> TokenizeRequest:
    """Validate a ``/tokenize`` body; raises `InvalidRequest` naming the first problem found."""
    check_body_and_model(body, model_name)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidRequest(
            'give either "prompt" (a string) or "messages" (a conversation), not both and not neither',
            "prompt",
        )
    return_token_strs = flag(body, "return_token_strs")
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise InvalidRequest(
            f"add_special_tokens must be true or false, got {special!r}", "add_special_tokens"
        )
    ignored = unknown_fields(body, TOKENIZE_FIELDS)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
        return TokenizeRequest(prompt, None, special is not False, return_token_strs, ignored=ignored)
    try:
        conversation = normalize_messages(messages)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), "messages") from None
    add_generation_prompt, template_kwargs = parse_template_options(body)
    return TokenizeRequest(
        None,
        conversation,
        special is True,
        return_token_strs,
        add_generation_prompt,
        template_kwargs,
        ignored,
    )


def parse_detokenize_request(body: Any, model_name: str, vocab_size: int) -> list[int]:
    """The token ids of a ``/detokenize`` body, each in ``[0, vocab_size)``."""
    check_body_and_model(body, model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise InvalidRequest("tokens must be a list of token ids such as [15, 2001, 9]", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(
            f"token id {bad[0]} is outside the vocabulary (ids run from 0 to {vocab_size - 1})", "tokens"
        )
    return tokens
